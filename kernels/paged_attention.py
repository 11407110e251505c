"""Paged attention for decode: one query token per sequence against K/V held in a block pool.

out[b, h] = softmax(scale · q[b, h] · K_bᵀ) · V_b, where K_b, V_b are the first context_lens[b] tokens
of sequence b, token t living in block block_tables[b, t // block_size] at offset t % block_size.

One program handles one (sequence, kv head) — all G = Hq / Hkv query heads of that kv head at once, so
each K/V byte is read once per kv head, not once per query head. Keys stream through in tiles of
BLOCK_N tokens with an online softmax (log2 domain). Scores and P·V take one of two forms (USE_DOT):
``tl.dot`` with the query group padded to 16 rows (tensor cores; wasteful for small groups), or a
broadcast multiply and reduce in float32 on the CUDA cores (no padding).

Split-KV (flash-decoding), PARTITION > 0: the context is cut into chunks of PARTITION tokens handled by
separate programs, each writing its partial (m, l, acc) to a float32 workspace; a second kernel merges
the partials. This fills the GPU when B·Hkv programs alone would leave SMs idle (small batch, long
context).

``write_kv`` stores new tokens' K and V into their slots (slot = block id · block_size + offset).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.harness import device as dev
from tritune.harness import strategies as S
from tritune.references import paged_attention as ref

LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k, USE_DOT: tl.constexpr, GROUP_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """(GROUP_PAD, D) · (BLOCK_N, D)ᵀ -> (GROUP_PAD, BLOCK_N) in float32."""
    if USE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    elif GROUP_PAD == 1:  # one query head: a 2-D multiply, no size-1 third dim
        s = tl.sum(q * k.to(tl.float32), axis=1)[None, :]
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    return s


@triton.jit
def _weighted_values(p, v, USE_DOT: tl.constexpr, GROUP_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """(GROUP_PAD, BLOCK_N) · (BLOCK_N, D) -> (GROUP_PAD, D) in float32."""
    if USE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    elif GROUP_PAD == 1:
        pv = tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return pv


@triton.jit
def _paged_attention_fwd(
        Q, Kc, Vc, BT, CL, Out, Mw, Lw, Aw,
        qk_scale, num_parts, stride_cl,
        stride_qb, stride_qh, stride_qd,
        stride_kn, stride_kb, stride_kh, stride_kd,
        stride_vn, stride_vb, stride_vh, stride_vd,
        stride_tb, stride_tn,
        stride_ob, stride_oh, stride_od,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(CL + b * stride_cl)
    if PARTITION > 0:
        start = part * PARTITION
        end = tl.minimum(start + PARTITION, seq_len)
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, GROUP_PAD)
    mask_g = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=mask_g[:, None], other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)

    table = BT + b.to(tl.int64) * stride_tb
    k_head = Kc + kvh.to(tl.int64) * stride_kh + offs_d[None, :] * stride_kd
    v_head = Vc + kvh.to(tl.int64) * stride_vh + offs_d[None, :] * stride_vd

    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # Table entries past the length are never read: they may hold anything.
        block = tl.load(table + (offs_n // BLOCK_SIZE) * stride_tn, mask=mask_n, other=0).to(tl.int64)
        slot_in_block = offs_n % BLOCK_SIZE
        # Both tiles are requested before any math, so K and V loads are in flight together.
        k = tl.load(k_head + (block * stride_kn + slot_in_block * stride_kb)[:, None], mask=mask_n[:, None],
                    other=0.0)
        v = tl.load(v_head + (block * stride_vn + slot_in_block * stride_vb)[:, None], mask=mask_n[:, None],
                    other=0.0)
        s = _scores(q, k, USE_DOT, GROUP_PAD, PRECISION) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _weighted_values(p, v, USE_DOT, GROUP_PAD, PRECISION)
        m_i = m_new

    if PARTITION > 0:
        # Partial results; programs whose chunk starts past the length write nothing (the merge skips them).
        row = (b * (tl.num_programs(1) * GROUP) + heads).to(tl.int64) * num_parts + part
        live = mask_g & ((offs_g * 0 + start) < seq_len)
        tl.store(Mw + row, m_i, mask=live)
        tl.store(Lw + row, l_i, mask=live)
        tl.store(Aw + row[:, None] * D + offs_d[None, :], acc, mask=live[:, None])
    else:
        # A length-0 sequence (only possible with validate=False) gets zeros, not 0/0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only when acc = 0
        tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=mask_g[:, None])


@triton.jit
def _paged_attention_merge(Mw, Lw, Aw, CL, Out, num_parts, stride_cl, stride_ob, stride_oh, stride_od,
                           D: tl.constexpr, PARTITION: tl.constexpr, PARTS_PAD: tl.constexpr,
                           PARTS_BLOCK: tl.constexpr):
    """out = Σ_p 2^(m_p − M) acc_p / Σ_p 2^(m_p − M) l_p over the chunks p that hold tokens; M = max m_p."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(CL + b * stride_cl)
    n_live = (seq_len + PARTITION - 1) // PARTITION
    row0 = (b * tl.num_programs(1) + h).to(tl.int64) * num_parts
    offs_all = tl.arange(0, PARTS_PAD)
    m_max = tl.max(tl.load(Mw + row0 + offs_all, mask=offs_all < n_live, other=float("-inf")), axis=0)
    offs_d = tl.arange(0, D)
    acc = tl.zeros((D,), dtype=tl.float32)
    l_sum = tl.zeros((1,), dtype=tl.float32)
    for p0 in range(0, n_live, PARTS_BLOCK):
        offs_p = p0 + tl.arange(0, PARTS_BLOCK)
        mask_p = offs_p < n_live
        m = tl.load(Mw + row0 + offs_p, mask=mask_p, other=float("-inf"))
        w = tl.where(mask_p, tl.exp2(m - m_max), 0.0)
        l_sum += tl.sum(w * tl.load(Lw + row0 + offs_p, mask=mask_p, other=0.0), axis=0)
        a = tl.load(Aw + (row0 + offs_p)[:, None] * D + offs_d[None, :], mask=mask_p[:, None], other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_d * stride_od,
             out.to(Out.dtype.element_ty))


@triton.jit
def _write_kv(Kn, Vn, Kc, Vc, Slots, num_slots, stride_s,
              stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd,
              stride_kn, stride_kb, stride_kh, stride_kd, stride_vn, stride_vb, stride_vh, stride_vd,
              D, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """k_cache[slot // block_size, slot % block_size, h] = k[t, h] (and v) for slot = slots[t] in range."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(Slots + t * stride_s).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    # Negative slots are padding; out-of-range ones are dropped too (validate=True reports them).
    mask = offs_d < tl.where((slot >= 0) & (slot < num_slots), D, 0)
    k = tl.load(Kn + t * stride_knt + h * stride_knh + offs_d * stride_knd, mask=mask)
    v = tl.load(Vn + t * stride_vnt + h * stride_vnh + offs_d * stride_vnd, mask=mask)
    tl.store(Kc + block * stride_kn + offset * stride_kb + h * stride_kh + offs_d * stride_kd, k, mask=mask)
    tl.store(Vc + block * stride_vn + offset * stride_vb + h * stride_vh + offs_d * stride_vd, v, mask=mask)


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    B: int                  # sequences (one query token each)
    Hq: int                 # query heads
    Hkv: int                # kv heads (Hq a multiple)
    D: int                  # head dim
    ctx: int                # context length (the longest, when mixed)
    block_size: int = 16    # tokens per cache block
    mixed: bool = False     # lengths drawn in [1, ctx] per sequence (tests); else all equal to ctx

    @property
    def capacity(self) -> int:
        """Tokens the block table can address: what a launcher sees without reading context_lens."""
        return -(-self.ctx // self.block_size) * self.block_size


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_PARTS = 1024            # split-KV chunks per sequence (the merge kernel holds their maxima at once)
SMS = 132                   # H100 SXM; the split heuristic only needs the order of magnitude


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def problem_of(q, k_cache, v_cache, block_tables, context_lens, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
                   block_tables.shape[1] * k_cache.shape[1], k_cache.shape[1])


def _check_scale(scale):
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale=None, out=None, config=None,
                    validate: bool = True):
    """Decode attention over a paged KV cache. Returns out (B, Hq, D) in q's dtype.

    q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D) with Hq a multiple of Hkv;
    block_tables (B, max_blocks) int32; context_lens (B,) int32, each in [1, max_blocks · block_size].
    ``validate=True`` also checks the values of context_lens and of the block-table entries in use,
    which costs a device-to-host sync; the engine passes ``validate=False`` on its hot path (then a
    length of 0 yields zeros, and lengths or block ids out of range are undefined behaviour).
    """
    # Decode launches are tiny, so the host-side work matters: the checks and the launch parameters
    # depend only on tensor metadata, and are computed once per metadata signature (_plan).
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
               k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
               block_tables.shape, block_tables.stride(), block_tables.dtype, block_tables.device,
               context_lens.shape, context_lens.stride(), context_lens.dtype, context_lens.device,
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               scale, None if config is None else tuple(sorted(config.items())))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable arguments: the checks will say
        key, plan = None, None
    if plan is not None and plan.lookup is not None and K._CONFIG_CACHE.get(plan.lookup) is not plan.cfg:
        plan = None  # the tuned store was reloaded since: pick the config again
    if plan is None:
        plan = _plan(q, k_cache, v_cache, block_tables, context_lens, scale, out, config)
        if key is not None and plan.B:
            if len(_PLANS) > 4096:
                _PLANS.clear()
            _PLANS[key] = plan
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    if not plan.B:
        return out
    if validate:
        _validate_lengths(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])
    if plan.partition:  # one allocation for the three partial-result buffers (acc, m, l)
        n = plan.ws_rows
        ws = torch.empty(n * (plan.D + 2), dtype=torch.float32, device=q.device)
        a_ws, m_ws, l_ws = ws[: n * plan.D], ws[n * plan.D: n * (plan.D + 1)], ws[n * (plan.D + 1):]
    else:
        a_ws = m_ws = l_ws = out
    os_ = out.stride()
    _paged_attention_fwd[plan.grid](
        q, k_cache, v_cache, block_tables, context_lens, out, m_ws, l_ws, a_ws,
        plan.qk_scale, plan.num_parts, context_lens.stride(0),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *os_, **plan.fwd_meta)
    if plan.partition:
        _paged_attention_merge[plan.merge_grid](
            m_ws, l_ws, a_ws, context_lens, out, plan.num_parts, context_lens.stride(0), *os_,
            **plan.merge_meta)
    return out


@dataclass
class _Plan:
    B: int
    D: int
    out_shape: tuple
    cfg: dict | None = None
    lookup: tuple | None = None        # the config cache key the default/tuned config came from
    partition: int = 0
    num_parts: int = 1
    ws_rows: int = 0
    qk_scale: float = 1.0
    grid: tuple = ()
    merge_grid: tuple = ()
    fwd_meta: dict = field(default_factory=dict)
    merge_meta: dict = field(default_factory=dict)


_PLANS: dict = {}


def _plan(q, k_cache, v_cache, block_tables, context_lens, scale, out, config) -> _Plan:
    """Every metadata check (clear errors naming the argument), the config, and the launch parameters."""
    K.check_tensor("q", q, ndim=3, dtypes=DTYPES)
    K.check_device("q", q)
    B, Hq, D = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        K.check_tensor(name, c, ndim=4)
        if c.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {_name(c.dtype)} does not match q's {_name(q.dtype)}")
        if c.device != q.device:
            raise ValueError(f"{name}: on {c.device}, but q is on {q.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}")
    num_blocks, block_size, Hkv, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"k_cache: head dim {Dc} does not match q's {D}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim {D} not supported (expected one of {HEAD_DIMS})")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q: {Hq} heads is not a multiple of the cache's {Hkv} kv heads")
    if block_size & (block_size - 1) or not 1 <= block_size <= 256:
        raise ValueError(f"k_cache: block_size {block_size} is not a power of two in [1, 256]")
    K.check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    K.check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
        if t.shape[0] != B:
            raise ValueError(f"{name}: {t.shape[0]} rows for a batch of {B} sequences (q's first dim)")
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables: no columns (every sequence needs at least one block)")
    _check_scale(scale)
    if out is not None:
        K.check_out(out, (B, Hq, D), q.dtype, q.device)
    plan = _Plan(B=B, D=D, out_shape=(B, Hq, D))
    if B == 0:
        return plan
    max_blocks = block_tables.shape[1]
    problem = Problem(B, Hq, Hkv, D, max_blocks * block_size, block_size)
    cfg = SPEC.config_for(problem, q.dtype, config)
    if config is None:
        plan.lookup = (SPEC.name, K.bucket_key(bucket(problem)), q.dtype)
    plan.cfg = cfg
    group = Hq // Hkv
    use_dot = cfg["USE_DOT"]
    group_pad = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    partition = cfg["PARTITION"]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp16/bf16 operands ignore it
    num_parts = triton.cdiv(max_blocks * block_size, partition) if partition else 1
    plan.partition, plan.num_parts, plan.ws_rows = partition, num_parts, B * Hq * num_parts
    plan.qk_scale = scale * LOG2E
    plan.grid = (B, Hkv, num_parts)
    plan.fwd_meta = dict(GROUP=group, GROUP_PAD=group_pad, D=D, BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"],
                         PARTITION=partition, USE_DOT=use_dot, PRECISION=precision,
                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if partition:
        parts_pad = triton.next_power_of_2(num_parts)
        plan.merge_grid = (B, Hq)
        plan.merge_meta = dict(D=D, PARTITION=partition, PARTS_PAD=parts_pad,
                               PARTS_BLOCK=min(parts_pad, max(1, 2048 // D)), num_warps=4 if D >= 128 else 2)
    return plan


def _validate_lengths(block_tables, context_lens, num_blocks, block_size):
    """Length range and block ids of the table entries in use, with one device-to-host sync."""
    max_blocks = block_tables.shape[1]
    lens = context_lens.long()
    used = torch.arange(max_blocks, device=lens.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad_id = used & ((block_tables < 0) | (block_tables >= num_blocks))
    flags = torch.stack([(lens < 1).any(), (lens > max_blocks * block_size).any(), bad_id.any()]).tolist()
    if flags[0]:
        i = int(torch.nonzero(lens < 1)[0, 0])
        raise ValueError(f"context_lens: sequence {i} has length {int(lens[i])}; lengths must be >= 1")
    if flags[1]:
        i = int(torch.nonzero(lens > max_blocks * block_size)[0, 0])
        raise ValueError(f"context_lens: sequence {i} has length {int(lens[i])}, more than its block table "
                         f"addresses ({max_blocks} blocks x {block_size} tokens)")
    if flags[2]:
        i, j = (int(x) for x in torch.nonzero(bad_id)[0])
        raise ValueError(f"block_tables: entry [{i}, {j}] = {int(block_tables[i, j])} is not a block id "
                         f"in [0, {num_blocks})")


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, validate: bool = True):
    """Store new tokens: k_cache[s // block_size, s % block_size] = k[t] (and v) for s = slot_mapping[t].

    k, v (T, Hkv, D) in the caches' dtype; slot_mapping (T,) int32 or int64; a negative slot is padding
    and skipped. ``validate=True`` also checks that slots are in range and distinct (a host sync); with
    ``validate=False`` out-of-range slots are dropped and duplicates race.
    """
    for name, t in (("k", k), ("v", v)):
        K.check_tensor(name, t, ndim=3, dtypes=DTYPES)
        K.check_device(name, t)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        K.check_tensor(name, c, ndim=4, dtypes=DTYPES)
        if c.device != k.device:
            raise ValueError(f"{name}: on {c.device}, but k is on {k.device}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache's {tuple(k_cache.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    num_blocks, block_size, Hkv, D = k_cache.shape
    if tuple(k.shape[1:]) != (Hkv, D):
        raise ValueError(f"k: per-token shape {tuple(k.shape[1:])} does not match the cache's (Hkv, D) = {(Hkv, D)}")
    for name, t, c in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dtype != c.dtype:
            raise TypeError(f"{name}: dtype {_name(t.dtype)} does not match its cache's {_name(c.dtype)}")
    K.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping: on {slot_mapping.device}, but k is on {k.device}")
    T = k.shape[0]
    if slot_mapping.shape[0] != T:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {T} tokens")
    if block_size & (block_size - 1):
        raise ValueError(f"k_cache: block_size {block_size} is not a power of two")
    num_slots = num_blocks * block_size
    if validate and T:
        s = slot_mapping.long()
        live = s[s >= 0]
        flags = torch.stack([(live >= num_slots).any(), torch.tensor(live.numel(), device=s.device)]).tolist()
        if flags[0]:
            raise ValueError(f"slot_mapping: slot {int(live.max())} out of range for {num_blocks} blocks x "
                             f"{block_size} tokens")
        if torch.unique(live).numel() != flags[1]:
            raise ValueError("slot_mapping: the same slot appears twice")
    if T == 0 or Hkv == 0:
        return k_cache, v_cache
    _write_kv[(T, Hkv)](k, v, k_cache, v_cache, slot_mapping, num_slots, slot_mapping.stride(0),
                        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
                        D, BLOCK_SIZE=block_size, BLOCK_D=triton.next_power_of_2(D), num_warps=1)
    return k_cache, v_cache


# ---------------------------------------------------------------------------------------------------
def _tl_dot_ok(dtype) -> bool:
    return not (dev.interpreted() and dtype == torch.bfloat16)


def _constraint(c, p: Problem, dtype) -> str | None:
    group = p.Hq // p.Hkv
    warps = c["num_warps"]
    if c["USE_DOT"]:
        if not _tl_dot_ok(dtype):
            # tl.dot on bf16 operands returns garbage under the Triton interpreter (triton 3.9,
            # triton-lang/triton#11584): the broadcast form covers bf16 there, tl.dot on the GPU.
            return "tl.dot on bf16 under the interpreter"
        if c["BLOCK_N"] < 16:
            return "tl.dot needs BLOCK_N >= 16"
        rows = max(16, triton.next_power_of_2(group))
        if rows * c["BLOCK_N"] // (32 * warps) > 128 or c["BLOCK_N"] * p.D // (32 * warps) > 128:
            return "tiles too large for the warps (register spills)"
    else:
        per_thread = triton.next_power_of_2(group) * c["BLOCK_N"] * p.D // (32 * warps)
        if per_thread > 128:
            return f"{per_thread} products per thread (register spills)"
        if c["num_stages"] > 2:
            return "no tl.dot to pipeline"
    if c["BLOCK_N"] * p.D < 32 * warps:
        return "idle threads"
    part = c["PARTITION"]
    if part:
        if part % c["BLOCK_N"]:
            return "PARTITION not a multiple of BLOCK_N"
        if part >= p.capacity:
            return "one chunk holds the whole context (use PARTITION=0)"
        if -(-p.capacity // part) > MAX_PARTS:
            return f"more than {MAX_PARTS} chunks"
    return None


SPACE = K.Space(
    params={
        "BLOCK_N": [8, 16, 32, 64, 128],
        "PARTITION": [0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
        "USE_DOT": [False, True],
        "num_warps": [1, 2, 4, 8],
        "num_stages": [1, 2, 3],
    },
    constraint=_constraint,
)


def default_config(p: Problem, dtype) -> dict:
    """Defaults from an H100 sweep (bf16, issue 6), timed with the harness (do_bench, L2 flushed).

    tl.dot wins even for one query head per kv head (the group padded to 16 rows costs tensor-core
    time that is free here): its K/V loads are software-pipelined (num_stages), the broadcast form's
    are not. BLOCK_N 64, 4 warps, 3 stages was within 1% of the best tile from B=8 to B=256 (D=64) and
    at B=32..128 (D=128). float32 keeps the broadcast form for small groups (an ieee fp32 dot has no
    tensor cores), and the interpreter cannot run a bf16 dot.
    """
    group = p.Hq // p.Hkv
    use_dot = _tl_dot_ok(dtype) and (dtype != torch.float32 or group >= 4)
    if use_dot:
        cfg = {"BLOCK_N": 64, "PARTITION": 0, "USE_DOT": True, "num_warps": 4, "num_stages": 3}
        rows = max(16, triton.next_power_of_2(group))
        while (rows * cfg["BLOCK_N"] > 128 * 32 * cfg["num_warps"]
               or cfg["BLOCK_N"] * p.D > 128 * 32 * cfg["num_warps"]):
            if cfg["BLOCK_N"] > 16:
                cfg["BLOCK_N"] //= 2
            else:
                cfg["num_warps"] *= 2
        if 2 * cfg["BLOCK_N"] * p.D * dtype.itemsize * cfg["num_stages"] > 160 * 1024:
            cfg["num_stages"] = 2  # K and V tiles per stage (D=256): stay inside shared memory
    else:
        cfg = {"BLOCK_N": 64 if p.D <= 64 else 32, "PARTITION": 0, "USE_DOT": False, "num_warps": 4,
               "num_stages": 1}
        while triton.next_power_of_2(group) * cfg["BLOCK_N"] * p.D > 64 * 32 * cfg["num_warps"]:
            if cfg["BLOCK_N"] > 8:
                cfg["BLOCK_N"] //= 2
            elif cfg["num_warps"] < 8:
                cfg["num_warps"] *= 2
            else:
                break  # at most 128 products per thread: still inside the space's bound
    while cfg["BLOCK_N"] * p.D < 32 * cfg["num_warps"] and cfg["num_warps"] > 1:
        cfg["num_warps"] //= 2
    # Split-KV when one program per (sequence, kv head) leaves SMs idle: aim at ~4 programs per SM,
    # in chunks of at least 128 tokens (the sweep's best at B=1: 32..64 chunks of 128..1024 tokens).
    # At >= SMS programs the single pass was as fast (B=32, Hkv=8, ctx 4096) and skips the merge.
    programs = p.B * p.Hkv
    if programs < SMS and p.capacity > 512:
        want = -(-4 * SMS // programs)
        part = max(128, cfg["BLOCK_N"], triton.next_power_of_2(-(-p.capacity // want)))
        while -(-p.capacity // part) > MAX_PARTS:
            part *= 2
        if part < p.capacity and part <= 4096:
            cfg["PARTITION"] = part
    return cfg


def bucket(p: Problem) -> dict:
    return {"B": triton.next_power_of_2(p.B), "Hq": p.Hq, "Hkv": p.Hkv, "D": p.D,
            "block_size": p.block_size, "ctx": triton.next_power_of_2(p.capacity)}


def cost(p: Problem, dtype) -> K.Cost:
    """K and V of the context tokens read once, q read, out written (mixed problems: counted at ctx)."""
    e = torch.finfo(dtype).bits // 8
    kv = 2.0 * p.B * p.ctx * p.Hkv * p.D * e
    return K.Cost(flops=4.0 * p.B * p.Hq * p.ctx * p.D, bytes=kv + 2.0 * p.B * p.Hq * p.D * e)


# ---------------------------------------------------------------------------------------------------
def context_lengths(p: Problem, seed: int) -> list[int]:
    if not p.mixed:
        return [p.ctx] * p.B
    g = torch.Generator().manual_seed(seed)
    pick = [1, p.block_size, p.block_size + 1, p.ctx]
    lens = [pick[int(i)] if i < len(pick) else int(torch.randint(1, p.ctx + 1, (1,), generator=g))
            for i in torch.randint(0, 2 * len(pick), (p.B,), generator=g)]
    lens = [min(n, p.ctx) for n in lens]
    lens[int(torch.randint(0, p.B, (1,), generator=g))] = p.ctx  # the table is as wide as the longest
    return lens


def fill_garbage(k_cache, v_cache, block_tables, lens):
    """Put NaN / ±max in every slot no sequence may read: past each length, and in unowned blocks.

    K gets NaN in odd blocks and +max in even ones (a leaked score is NaN or dominates the softmax),
    −max in unowned blocks; V gets NaN everywhere (even a zero-weighted V read shows: 0 · NaN = NaN).
    """
    num_blocks, bs = k_cache.shape[:2]
    tables = block_tables.long().cpu()
    pos = torch.arange(tables.shape[1] * bs).reshape(tables.shape[1], bs)           # token index per slot
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    owned = torch.zeros(num_blocks, dtype=torch.bool)
    for b, n in enumerate(lens):
        readable[tables[b]] = pos < n
        owned[tables[b]] = True
    big = torch.finfo(k_cache.dtype).max
    odd = (torch.arange(num_blocks) % 2 == 1)[:, None].expand(num_blocks, bs)
    k_bad = torch.full((num_blocks, bs), big, dtype=torch.float32)
    k_bad[odd] = float("nan")
    k_bad[~owned] = -big
    dev_ = k_cache.device
    hidden = (~readable).to(dev_)[:, :, None, None]
    k_cache.copy_(torch.where(hidden, k_bad.to(dev_, k_cache.dtype)[:, :, None, None], k_cache))
    v_cache.copy_(torch.where(hidden, torch.full((), float("nan"), dtype=v_cache.dtype, device=dev_), v_cache))


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """Sequences own disjoint, randomly permuted blocks of a pool that has a few spare blocks; every slot
    not holding a context token (the tail of a sequence's last block, its blocks past its length, the
    spare blocks) holds NaN or ±max so a read that should not happen shows in the output.

    layout "strided": q is a slice of a wider (B, 3·Hq, D) buffer (q of a fused QKV) and K/V are views
    of one (num_blocks, block_size, 2, Hkv, D) pool.
    """
    nb = -(-p.ctx // p.block_size)
    spare = 3
    num_blocks = p.B * nb + spare
    shape = (num_blocks, p.block_size, p.Hkv, p.D)
    if layout == "strided":
        pool = S.randn((num_blocks, p.block_size, 2, p.Hkv, p.D), dtype, device, seed + 1)
        k_cache, v_cache = pool[:, :, 0], pool[:, :, 1]
        qkv = S.randn((p.B, 3 * p.Hq, p.D), dtype, device, seed, scale=1.5)
        q = qkv[:, p.Hq: 2 * p.Hq]
    elif layout == "contiguous":
        k_cache = S.randn(shape, dtype, device, seed + 1)
        v_cache = S.randn(shape, dtype, device, seed + 2)
        q = S.randn((p.B, p.Hq, p.D), dtype, device, seed, scale=1.5)
    else:
        raise ValueError(f"layout: unknown {layout!r}; expected contiguous or strided")
    g = torch.Generator().manual_seed(seed + 3)
    block_tables = torch.randperm(num_blocks, generator=g)[: p.B * nb].reshape(p.B, nb).to(torch.int32)
    lens = context_lengths(p, seed)
    fill_garbage(k_cache, v_cache, block_tables, lens)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return K.Case(args=(q, k_cache, v_cache, block_tables.to(device), context_lens),
                  kwargs={"scale": 1.0 / math.sqrt(p.D) * (1.0 + 0.25 * (seed % 3)), "validate": False},
                  out=torch.empty((p.B, p.Hq, p.D), dtype=dtype, device=device))


def problems(max_elems: int):
    from hypothesis import strategies as st

    small = dev.interpreted()

    @st.composite
    def draw(d):
        b = d(st.integers(1, 4 if small else 32))
        hkv = d(st.sampled_from([1, 2, 3] if small else [1, 2, 3, 4, 8]))
        group = d(st.sampled_from([1, 2, 3, 4] if small else [1, 2, 3, 4, 5, 8, 16]))
        if small:
            group = max(1, min(group, 4 // hkv))
        hd = d(st.sampled_from([16, 32, 64] if small else [16, 32, 64, 128, 256]))
        bs = d(st.sampled_from([8, 16, 32, 64]))
        top = max(1, min(100 if small else 4096, max_elems // (b * hkv * hd)))
        ctx = d(st.one_of(st.sampled_from([n for n in (1, bs, bs + 1, 2 * bs + 3) if n <= top] or [1]),
                          st.integers(1, top)))
        return Problem(b, hkv * group, hkv, hd, ctx, bs, d(st.booleans()) and b > 1)

    return draw()


# ---------------------------------------------------------------------------------------------------
def _contiguous_kv(c: K.Case):
    """(B, Hkv, ctx, D) copies of the equal-length K and V (the vendor's input), built untimed."""
    q, k_cache, v_cache, block_tables, context_lens = c.args
    n = int(context_lens.max())
    if int(context_lens.min()) != n:
        return None
    B = q.shape[0]
    blocks = block_tables[:, : -(-n // k_cache.shape[1])].long()

    def gather(cache):
        return cache[blocks].reshape(B, -1, *cache.shape[2:])[:, :n].transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)


def _vendor(c: K.Case):
    kv = _contiguous_kv(c)
    if kv is None:
        raise ValueError("SDPA comparison needs equal context lengths")
    k, v = kv
    q4 = c.args[0][:, :, None, :]
    scale = c.kwargs["scale"]
    F = torch.nn.functional
    gqa = q4.shape[1] != k.shape[1]
    try:
        F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=gqa)
    except (RuntimeError, TypeError):  # no GQA support in this build: expand (reads K/V G times)
        g = q4.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), False
    return lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=gqa)


_FLEX: dict = {}


def _flex(c: K.Case):
    """torch's flex_attention (compiled; its decode kernel) on the same contiguous K/V as SDPA."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    kv = _contiguous_kv(c)
    if kv is None:
        return None
    k, v = kv
    q4 = c.args[0][:, :, None, :]
    key = (tuple(q4.shape), tuple(k.shape), q4.dtype)
    if key not in _FLEX:  # one compile per shape; dynamo's recompile limit would fall back to eager
        torch._dynamo.reset()
        _FLEX.clear()
        _FLEX[key] = torch.compile(flex_attention, dynamic=False)
    fn, scale, gqa = _FLEX[key], c.kwargs["scale"], q4.shape[1] != k.shape[1]
    return lambda: fn(q4, k, v, scale=scale, enable_gqa=gqa)


def _bad_inputs(device):
    B, Hq, Hkv, D, bs, nb = 2, 4, 2, 32, 16, 3
    q = torch.randn(B, Hq, D, device=device)
    kc = torch.randn(B * nb, bs, Hkv, D, device=device)
    vc = torch.randn(B * nb, bs, Hkv, D, device=device)
    bt = torch.arange(B * nb, dtype=torch.int32, device=device).reshape(B, nb)
    cl = torch.tensor([5, 40], dtype=torch.int32, device=device)
    i32 = torch.int32

    def pa(**kw):
        a = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, context_lens=cl)
        a.update(kw)
        return lambda: paged_attention(**a)

    kn = torch.randn(3, Hkv, D, device=device)
    slots = torch.tensor([0, 17, -1], dtype=i32, device=device)

    def wk(**kw):
        a = dict(k=kn, v=kn.clone(), k_cache=kc.clone(), v_cache=vc.clone(), slot_mapping=slots)
        a.update(kw)
        return lambda: write_kv(**a)

    return [
        ("context longer than its block table", pa(context_lens=torch.tensor([5, nb * bs + 1], dtype=i32, device=device)), ValueError),
        ("context length 0", pa(context_lens=torch.tensor([0, 3], dtype=i32, device=device)), ValueError),
        ("block id out of the pool", pa(block_tables=bt + 100), ValueError),
        ("Hq not a multiple of Hkv", pa(q=torch.randn(B, 3, D, device=device)), ValueError),
        ("head dim mismatch", pa(q=torch.randn(B, Hq, 64, device=device)), ValueError),
        ("unsupported head dim", pa(q=torch.randn(B, Hq, 24, device=device),
                                    k_cache=torch.randn(6, bs, Hkv, 24, device=device),
                                    v_cache=torch.randn(6, bs, Hkv, 24, device=device)), ValueError),
        ("cache dtype differs from q", pa(k_cache=kc.half()), TypeError),
        ("v_cache shape differs", pa(v_cache=vc[:, :8]), ValueError),
        ("q on the wrong device", pa(q=q.to("meta")), ValueError),
        ("cache on the wrong device", pa(k_cache=kc.to("meta")), ValueError),
        ("int64 block table", pa(block_tables=bt.long()), TypeError),
        ("int64 context_lens", pa(context_lens=cl.long()), TypeError),
        ("block table rows != batch", pa(block_tables=bt[:1]), ValueError),
        ("float64 q", pa(q=q.double()), TypeError),
        ("non-power-of-two block size", pa(k_cache=torch.randn(6, 12, Hkv, D, device=device),
                                            v_cache=torch.randn(6, 12, Hkv, D, device=device)), ValueError),
        ("negative scale", lambda: paged_attention(q, kc, vc, bt, cl, scale=-1.0), ValueError),
        ("out of the wrong shape", lambda: paged_attention(q, kc, vc, bt, cl, out=torch.empty(B, Hq, D + 1, device=device)), ValueError),
        ("write_kv: slot out of range", wk(slot_mapping=torch.tensor([0, B * nb * bs, -1], dtype=i32, device=device)), ValueError),
        ("write_kv: duplicate slot", wk(slot_mapping=torch.tensor([4, 4, -1], dtype=i32, device=device)), ValueError),
        ("write_kv: float slot_mapping", wk(slot_mapping=slots.float()), TypeError),
        ("write_kv: slot count != tokens", wk(slot_mapping=slots[:2]), ValueError),
        ("write_kv: head count mismatch", wk(k=torch.randn(3, Hkv + 1, D, device=device),
                                             v=torch.randn(3, Hkv + 1, D, device=device)), ValueError),
        ("write_kv: dtype differs from cache", wk(k=kn.half(), v=kn.half()), TypeError),
        ("write_kv: k on the wrong device", wk(k=kn.to("meta")), ValueError),
    ]


SPEC = K.register(K.KernelSpec(
    name="paged_attention",
    description="decode attention over a paged KV cache (GQA, split-KV)",
    run=paged_attention,
    reference=ref.paged_attention,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[
        # GPT-2 small: 12 heads of 64
        Problem(1, 12, 12, 64, 128), Problem(1, 12, 12, 64, 1024), Problem(8, 12, 12, 64, 512),
        Problem(8, 12, 12, 64, 1024), Problem(64, 12, 12, 64, 512), Problem(64, 12, 12, 64, 1024),
        Problem(256, 12, 12, 64, 128), Problem(256, 12, 12, 64, 1024),
        # Llama-style GQA: 32 query heads on 8 kv heads of 128
        Problem(1, 32, 8, 128, 4096), Problem(1, 32, 8, 128, 32768), Problem(32, 32, 8, 128, 4096),
        Problem(128, 32, 8, 128, 4096),
    ],
    small_problems=[Problem(2, 4, 2, 32, 40), Problem(3, 2, 1, 64, 70, 8, True)],
    layouts=("contiguous", "strided"),
    vendor=_vendor,
    vendor_name="SDPA (contiguous KV)",
    peers={"flex": _flex},
    bad_inputs=_bad_inputs,
))
