"""Paged attention for decode: one query token per sequence against K/V held in a block pool.

out[b, h] = softmax(scale · q[b, h] · K_bᵀ) · V_b, where K_b, V_b are the first context_lens[b] tokens
of sequence b, token t living in block block_tables[b, t // block_size] at offset t % block_size.

One program handles one (sequence, kv head) — all G = Hq / Hkv query heads of that kv head at once, so
each K/V byte is read once per kv head, not once per query head. Keys stream through in tiles of
BLOCK_N tokens with an online softmax (log2 domain). Scores and P·V take one of two forms (USE_DOT):
``tl.dot`` with the query group padded to 16 rows (tensor cores; wasteful for small groups), or a
broadcast multiply and reduce in float32 on the CUDA cores (no padding).

Split-KV (flash-decoding), PARTITION > 0: the context is cut into chunks of PARTITION tokens handled by
separate programs, each writing its partial (m, l, acc) to a float32 workspace and taking a ticket
from a per-(sequence, kv head) counter; the program that takes the last ticket merges the partials and
resets the counter (one launch, no second kernel, no zero-fill; ``merge_chunks``, which the FP8-cache decode
shares). This fills the GPU when B·Hkv programs alone would leave SMs idle (small batch, long context).

Sliding window, WINDOW = W > 0 (a constexpr: W = 0 compiles the full-context kernel unchanged): a
sequence's keys are its last W tokens, from lo = max(len − W, 0) on. The tile loop starts at lo (not at a
BLOCK_N boundary: tokens are looked up one by one, so nothing before lo is read, neither K/V nor its
block-table entry), and split-KV chunks are counted from lo, so the grid has cdiv(min(capacity, W),
PARTITION) chunks a sequence and the config is chosen for that span (``Problem.span``).

A tile's block ids are loaded a tile ahead of its K/V (loop-carried): no K/V address depends on a load of
its own iteration, so Triton's pipeliner keeps num_stages - 1 K/V tiles in flight in shared memory. Looked
up in the same iteration, the ids took a stage of their own and left K/V one buffer (docs/findings.md).

Two tuned switches shape the tile loop: PREFETCH loads tile i + 1 by hand while tile i is used (with
num_stages 1: plain loads instead of the pipeliner's cp.async), and EVICT marks the K/V loads evict_first
(read once a step; the hint survives only plain loads, not the pipeliner's; docs/findings.md). The hand loop
wins for short split-KV chunks (B=1) and loses to the pipeliner on long single-pass programs (B=64).

``write_kv`` stores new tokens' K and V into their slots (slot = block id · block_size + offset).

The problem type, the cases and the peers: :mod:`tritune.kernels.paged_attention_cases` (re-exported here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.runtime import device as dev
from tritune.kernels.paged_attention_cases import Problem, flex, make_inputs, problems, validate_lengths, vendor
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
    elif PRECISION == "ieee":
        # fp32 operands: not the sum(x[:, :, None] * y[None, :, :], 1) form, which triton's combine pass
        # rewrites into a tl.dot of default (tf32) precision once every dim is >= 16 (seen on the H100:
        # 5.6e-4 relative error at GROUP_PAD = D = 16); reducing over the last axis is left alone.
        pv = tl.sum(p[:, None, :] * tl.trans(v.to(tl.float32))[None, :, :], axis=2)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return pv


@triton.jit
def _table_tile(table, n0, end, stride_tn, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block id of each token of [n0, n0 + BLOCK_N) (0 past end: table entries past the length are
    never read, they may hold anything)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(table + (offs_n // BLOCK_SIZE) * stride_tn, mask=offs_n < end, other=0).to(tl.int64)


@triton.jit
def _kv_at(block, k_head, v_head, n0, end, stride_kn, stride_kb, stride_vn, stride_vb,
           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    """K and V of tokens [n0, n0 + BLOCK_N) held in blocks ``block`` (those before end; the rest read
    nothing) and their mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    slot_in_block = offs_n % BLOCK_SIZE
    k_ptr = k_head + (block * stride_kn + slot_in_block * stride_kb)[:, None]
    v_ptr = v_head + (block * stride_vn + slot_in_block * stride_vb)[:, None]
    if EVICT:  # K and V are read once a step: first out of L2, ahead of what others may reuse
        k = tl.load(k_ptr, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptr, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
    else:
        k = tl.load(k_ptr, mask=mask_n[:, None], other=0.0)
        v = tl.load(v_ptr, mask=mask_n[:, None], other=0.0)
    return k, v, mask_n


@triton.jit
def _online_step(q, k, v, mask_n, m_i, l_i, acc, qk_scale, USE_DOT: tl.constexpr, GROUP_PAD: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One tile of the online softmax (log2 domain): the running max, sum and weighted values."""
    s = _scores(q, k, USE_DOT, GROUP_PAD, PRECISION) * qk_scale
    s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted_values(p, v, USE_DOT, GROUP_PAD, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_out(Out, b, heads, mask_g, offs_d, acc, l_i, stride_ob, stride_oh, stride_od):
    # A length-0 sequence (only possible with validate=False) gets zeros, not 0/0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l = 0 only when acc = 0
    tl.store(Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=mask_g[:, None])


@triton.jit
def _paged_attention_fwd(
        Q, Kc, Vc, BT, CL, Out, WS, Locks,
        qk_scale, num_parts, stride_cl,
        stride_qb, stride_qh, stride_qd,
        stride_kn, stride_kb, stride_kh, stride_kd,
        stride_vn, stride_vb, stride_vh, stride_vd,
        stride_tb, stride_tn,
        stride_ob, stride_oh, stride_od,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
        GROUP_MERGE: tl.constexpr, PARTS_BLOCK: tl.constexpr, PDL: tl.constexpr, EVICT: tl.constexpr,
        PREFETCH: tl.constexpr, WINDOW: tl.constexpr = 0):
    if PDL:  # programmatic dependent launch: q, the caches and the lengths come from launches before this
        tl.extra.cuda.gdc_wait()               # one (wait for them before any read or write); then the next
        tl.extra.cuda.gdc_launch_dependents()  # launch may start and read its weights: one launch ahead
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(CL + b * stride_cl)
    # WINDOW > 0: only the last WINDOW tokens (from lo on) exist for this program: the loops start at lo,
    # chunks are counted from lo, so nothing before the window is read (its blocks not even looked up)
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    else:
        lo = 0
    if PARTITION > 0:
        start = lo + part * PARTITION
        end = tl.minimum(start + PARTITION, seq_len)
    else:
        start = lo
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
    # The block ids of a tile are loaded one tile ahead (loop-carried): K/V addresses then depend on no load
    # of their own iteration, which is what lets Triton's pipeliner keep num_stages - 1 K/V tiles in flight
    # (looked up in the same iteration, the ids take a stage of their own and leave K/V one buffer, loaded
    # and waited for with nothing to overlap: cp.async.wait_group 0; docs/findings.md).
    block = _table_tile(table, start, end, stride_tn, BLOCK_SIZE, BLOCK_N)
    if PREFETCH:
        # Loads one tile ahead by hand (num_stages 1: no pipeliner), so they stay plain loads that keep
        # the EVICT hint (the pipeliner's cp.async drops it): tile i + 1 is in flight while tile i is used.
        k, v, mask_n = _kv_at(block, k_head, v_head, start, end, stride_kn, stride_kb, stride_vn, stride_vb,
                              BLOCK_SIZE, BLOCK_N, EVICT)
        block = _table_tile(table, start + BLOCK_N, end, stride_tn, BLOCK_SIZE, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            block_nx = _table_tile(table, n0 + 2 * BLOCK_N, end, stride_tn, BLOCK_SIZE, BLOCK_N)
            k_nx, v_nx, mask_nx = _kv_at(block, k_head, v_head, n0 + BLOCK_N, end, stride_kn, stride_kb,
                                         stride_vn, stride_vb, BLOCK_SIZE, BLOCK_N, EVICT)
            m_i, l_i, acc = _online_step(q, k, v, mask_n, m_i, l_i, acc, qk_scale, USE_DOT, GROUP_PAD, PRECISION)
            k, v, mask_n, block = k_nx, v_nx, mask_nx, block_nx
    else:
        for n0 in range(start, end, BLOCK_N):
            block_nx = _table_tile(table, n0 + BLOCK_N, end, stride_tn, BLOCK_SIZE, BLOCK_N)
            # Both tiles are requested before any math, so K and V loads are in flight together.
            k, v, mask_n = _kv_at(block, k_head, v_head, n0, end, stride_kn, stride_kb, stride_vn, stride_vb,
                                  BLOCK_SIZE, BLOCK_N, EVICT)
            m_i, l_i, acc = _online_step(q, k, v, mask_n, m_i, l_i, acc, qk_scale, USE_DOT, GROUP_PAD, PRECISION)
            block = block_nx

    if PARTITION > 0:
        # Chunks past the length do nothing; a sequence that fits one chunk is finished here.
        n_live = tl.maximum(tl.cdiv(seq_len - lo, PARTITION), 1)
        if n_live == 1:
            if part == 0:
                _store_out(Out, b, heads, mask_g, offs_d, acc, l_i, stride_ob, stride_oh, stride_od)
        elif part < n_live:
            # Workspace: acc (rows, D), then m (rows), then l (rows); row = (b, head, chunk).
            n_rows = tl.num_programs(0).to(tl.int64) * tl.num_programs(1) * GROUP * num_parts
            Mw = WS + n_rows * D
            Lw = Mw + n_rows
            row0 = (b * tl.num_programs(1) * GROUP + kvh * GROUP).to(tl.int64) * num_parts  # head 0, chunk 0
            row = row0 + offs_g * num_parts + part
            tl.store(Mw + row, m_i, mask=mask_g)
            tl.store(Lw + row, l_i, mask=mask_g)
            tl.store(WS + row[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])
            # Every thread's partial is written before the ticket is taken (the atomic releases them);
            # the program that takes the last ticket merges the chunks and resets the counter.
            tl.debug_barrier()
            lock = Locks + b * tl.num_programs(1) + kvh
            ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            if ticket == n_live - 1:
                _merge_chunks(WS + row0 * D, Mw + row0, Lw + row0, Out, b, kvh, n_live, num_parts,
                              stride_ob, stride_oh, stride_od, GROUP, D, GROUP_MERGE, PARTS_BLOCK)
                tl.store(lock, 0)
    else:
        _store_out(Out, b, heads, mask_g, offs_d, acc, l_i, stride_ob, stride_oh, stride_od)


@triton.jit
def _merge_chunks(Aw, Mw, Lw, Out, b, kvh, n_live, num_parts, stride_ob, stride_oh, stride_od,
                  GROUP: tl.constexpr, D: tl.constexpr, GROUP_MERGE: tl.constexpr, PARTS_BLOCK: tl.constexpr):
    """out = Σ_p 2^(m_p − M) acc_p / Σ_p 2^(m_p − M) l_p over the live chunks p, M = max m_p: an online
    merge over blocks of chunks, in chunk order (the result does not depend on which program merges)."""
    offs_g = tl.arange(0, GROUP_MERGE)
    mask_g = offs_g < GROUP
    offs_d = tl.arange(0, D)
    m_i = tl.zeros((GROUP_MERGE,), dtype=tl.float32) + float("-inf")
    l_i = tl.zeros((GROUP_MERGE,), dtype=tl.float32)
    acc = tl.zeros((GROUP_MERGE, D), dtype=tl.float32)
    for p0 in range(0, n_live, PARTS_BLOCK):
        offs_p = p0 + tl.arange(0, PARTS_BLOCK)
        idx = offs_g[:, None] * num_parts + offs_p[None, :]          # (GROUP_MERGE, PARTS_BLOCK)
        live = mask_g[:, None] & (offs_p < n_live)[None, :]
        # .cg: the partials were written by other programs; read them from L2, not a stale L1 line.
        m = tl.load(Mw + idx, mask=live, other=float("-inf"), cache_modifier=".cg")
        m = tl.where(mask_g[:, None], m, 0.0)  # padding heads stay finite (their rows are never stored)
        l = tl.load(Lw + idx, mask=live, other=0.0, cache_modifier=".cg")
        a = tl.load(Aw + idx[:, :, None] * D + offs_d[None, None, :], mask=live[:, :, None], other=0.0,
                    cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(m, axis=1))  # finite: block 0 holds chunk 0, which holds tokens
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(m - m_new[:, None])
        l_i = l_i * alpha + tl.sum(w * l, axis=1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a, axis=1)
        m_i = m_new
    heads = kvh * GROUP + offs_g
    _store_out(Out, b, heads, mask_g, offs_d, acc, l_i, stride_ob, stride_oh, stride_od)


merge_chunks = _merge_chunks   # shared with fp8_paged_attention's decode (the same partials' layout)


def merge_parts_block(num_parts: int, group_merge: int, D: int, num_warps: int) -> int:
    """``merge_chunks``' PARTS_BLOCK: chunks merged at a time ((group, chunks, D) float32 tiles, ~32 a thread)."""
    pb = 1
    while pb * 2 <= min(triton.next_power_of_2(num_parts), 32 * 32 * num_warps // (group_merge * D)):
        pb *= 2
    return pb


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
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_PARTS = 1024            # split-KV chunks per sequence (more only adds merge work)
SMS = 132                   # H100 SXM; the split heuristic only needs the order of magnitude


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def problem_of(q, k_cache, v_cache, block_tables, context_lens, *, window=None, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
                   block_tables.shape[1] * k_cache.shape[1], k_cache.shape[1], window=window)


def _check_scale(scale):
    if scale is not None and (not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")


def _check_window(window):
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected a positive int or None, got {window!r}")


def paged_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale=None, out=None, config=None,
                    validate: bool = True, window: int | None = None):
    """Decode attention over a paged KV cache. Returns out (B, Hq, D) in q's dtype.

    q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D) with Hq a multiple of Hkv;
    block_tables (B, max_blocks) int32; context_lens (B,) int32, each in [1, max_blocks · block_size].
    ``validate=True`` also checks the values of context_lens and of the block-table entries in use,
    which costs a device-to-host sync; the engine passes ``validate=False`` on its hot path (then a
    length of 0 yields zeros, and lengths or block ids out of range are undefined behaviour).
    ``window`` W (None: the whole context): sliding-window attention, each query sees only its sequence's
    last W tokens (positions > context_len − 1 − W; its own token is one of them), as transformers'
    ``sliding_window``; tokens before the window are not read, nor their block-table entries.
    Split-KV launches share per-device counters: two must not run at once on different streams.
    """
    # Decode launches are tiny, so the host-side work matters: the checks and every launch argument but
    # the tensors depend only on tensor metadata, and are computed once per metadata signature (_plan).
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
               k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device,
               block_tables.shape, block_tables.stride(), block_tables.dtype, block_tables.device,
               context_lens.shape, context_lens.stride(), context_lens.dtype, context_lens.device,
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               scale, None if config is None else tuple(sorted(config.items())), K.precision_key(q.dtype),
               window, type(window))
    except (AttributeError, TypeError):  # not tensors: the checks will say
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                                                 config, window), keep=lambda plan: plan.B)
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                               ("context_lens", context_lens)))
    if not plan.B:
        return out
    if validate and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # no host sync in a capture
        validate_lengths(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])
    # split-KV partials (acc, m, l) in one per-device float32 buffer; the kernel finds each part's offset
    ws = _workspace(q.device, plan.ws_numel) if plan.ws_numel else out
    # One launch (the split-KV merge is in the kernel). Triton's own launch is most of the host time
    # (35-57 us a call on the H100 machine), and do_bench's L2 flush gives the host only ~80 us a call to
    # stay ahead of the GPU: a slow host then shows in a B=1 time (48 us measured for a 5.8 us kernel).
    # After a plan's first launch the compiled kernel is called directly (kernels.launch_direct), keyed by
    # what triton specialises a pointer on (its 16-byte alignment) and by PDL.
    pdl = plan.meta_pdl is not None and K.pdl_now("paged_attention")
    meta = plan.meta_pdl if pdl else plan.meta
    locks = context_lens if plan.locks is None else plan.locks  # no split-KV: any pointer of this call
    args = (q, k_cache, v_cache, block_tables, context_lens, out, ws, locks, *plan.args)
    K.launch_cached(_paged_attention_fwd, plan.kernels, plan.grid, args, meta,
                    plan.consts_pdl if pdl else plan.consts, pdl, args[:8])
    return out


@dataclass
class _Plan:
    B: int
    out_shape: tuple
    cfg: dict | None = None
    cfg_key: tuple | None = None       # the config cache key the default/tuned config came from
    ws_numel: int = 0                  # float32 workspace elements (split-KV only)
    locks: object = None               # split-KV chunk counters (per (sequence, kv head)); else None
    grid: tuple = ()
    args: tuple = ()                   # scalar launch arguments after the tensors
    meta: dict = field(default_factory=dict)
    meta_pdl: dict | None = None       # meta with programmatic dependent launch (CUDA graph capture only)
    kernels: dict | None = None        # compiled kernels for direct launches, by (pdl, alignment, device)
    consts: tuple = ()                 # the constexpr values a direct launch passes after the arguments
    consts_pdl: tuple | None = None


_PLANS = K.PlanCache()
_locks = K.Counters(minimum=1 << 14)   # split-KV tickets, per device, zero between launches
_workspace = K.Workspace()             # split-KV partials (acc, m, l), per device


def _plan(q, k_cache, v_cache, block_tables, context_lens, scale, out, config, window=None) -> _Plan:
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
    if not K.is_block_size(block_size):
        raise ValueError(f"k_cache: block_size {block_size} is not {K.BLOCK_SIZES}")
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
    _check_window(window)
    if out is not None:
        K.check_out(out, (B, Hq, D), q.dtype, q.device)
    plan = _Plan(B=B, out_shape=(B, Hq, D))
    if B == 0:
        return plan
    max_blocks = block_tables.shape[1]
    problem = Problem(B, Hq, Hkv, D, max_blocks * block_size, block_size, window=window)
    cfg = SPEC.config_for(problem, q.dtype, config)
    if config is None:
        plan.cfg_key = SPEC.config_key(problem, q.dtype)
    plan.cfg = cfg
    group = Hq // Hkv
    use_dot = cfg["USE_DOT"]
    group_pad = max(16, triton.next_power_of_2(group)) if use_dot else triton.next_power_of_2(group)
    partition = cfg["PARTITION"]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    precision = K.fp32_precision() if q.dtype == torch.float32 else "tf32"  # fp16/bf16 operands ignore it
    num_parts = triton.cdiv(problem.span, partition) if partition else 1  # chunks count from the window's start
    group_merge = triton.next_power_of_2(group)
    parts_block = merge_parts_block(num_parts, group_merge, D, cfg["num_warps"]) if partition else 1
    plan.ws_numel = B * Hq * num_parts * (D + 2) if partition else 0
    # split-KV tickets (Counters keep outgrown buffers alive for captured graphs); without split-KV none, and no
    # tensor of a call is kept: a plan made in a cudagraph tree's warm-up would keep memory of the graph's pool
    # alive that the graph does not own (torch.compile "reduce-overhead" refuses that)
    plan.locks = _locks(q.device, B * Hkv) if partition else None
    os_ = (Hq * D, D, 1) if out is None else out.stride()
    plan.grid = (B, Hkv, num_parts)
    plan.args = (scale * LOG2E, num_parts, context_lens.stride(0), *q.stride(), *k_cache.stride(),
                 *v_cache.stride(), *block_tables.stride(), *os_)
    plan.meta = dict(GROUP=group, GROUP_PAD=group_pad, D=D, BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"],
                     PARTITION=partition, USE_DOT=use_dot, PRECISION=precision, GROUP_MERGE=group_merge,
                     PARTS_BLOCK=parts_block, PDL=False, EVICT=cfg.get("EVICT", False),
                     PREFETCH=cfg.get("PREFETCH", False), WINDOW=window or 0, num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])
    # the same launch with programmatic dependent launch, taken while a CUDA graph is captured (K.pdl_now)
    plan.meta_pdl = dict(plan.meta, PDL=True, launch_pdl=True) if K.pdl(q.device) else None
    plan.kernels = {} if K.DIRECT_LAUNCH and q.device.type == "cuda" else None
    plan.consts = tuple(plan.meta[c] for c in _CONSTEXPRS)
    plan.consts_pdl = tuple(plan.meta_pdl[c] for c in _CONSTEXPRS) if plan.meta_pdl is not None else None
    return plan


_CONSTEXPRS = K.constexpr_params(_paged_attention_fwd)  # what a direct launch passes after the arguments


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
    """tl.dot computes right here: on a GPU always; under the interpreter bf16 only once tritune's fix of
    its bf16 arithmetic (kernels/runtime/interpret_bf16.py) checks out."""
    if not (dev.interpreted() and dtype == torch.bfloat16):
        return True
    from tritune.kernels.runtime import interpret_bf16

    return interpret_bf16.check() is None


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
        # the pipeliner keeps num_stages - 1 K/V tiles in shared memory (the block ids load a tile ahead)
        if 2 * c["BLOCK_N"] * p.D * dtype.itemsize * max(1, c["num_stages"] - 1) > 192 * 1024:
            return "K and V tiles of every stage exceed shared memory"
    else:
        per_thread = triton.next_power_of_2(group) * c["BLOCK_N"] * p.D // (32 * warps)
        if per_thread > 128:
            return f"{per_thread} products per thread (register spills)"
        if c["num_stages"] > 2:
            return "no tl.dot to pipeline"
    if c["BLOCK_N"] * p.D < 32 * warps:
        return "idle threads"
    if c.get("PREFETCH") and c["num_stages"] > 1:
        return "PREFETCH is the hand-written pipeline: num_stages 1"
    if c.get("EVICT") and c["USE_DOT"] and c["num_stages"] > 1:
        return "EVICT on pipelined tl.dot loads (cp.async drops the hint)"
    part = c["PARTITION"]
    if part:
        if part % c["BLOCK_N"]:
            return "PARTITION not a multiple of BLOCK_N"
        if part >= p.span:
            return "one chunk holds the whole context or window (use PARTITION=0)"
        if -(-p.span // part) > MAX_PARTS:
            return f"more than {MAX_PARTS} chunks"
    return None


SPACE = K.Space(
    params={
        "BLOCK_N": [8, 16, 32, 64, 128],
        "PARTITION": [0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
        "USE_DOT": [False, True],
        "num_warps": [1, 2, 4, 8],
        "num_stages": [1, 2, 3, 4],
        "EVICT": [False, True],
        "PREFETCH": [False, True],
    },
    constraint=_constraint,
)


def with_partition(cfg: dict, partition: int, problem: Problem, dtype) -> dict | None:
    """``cfg`` with its KV chunk set to ``partition`` tokens (0: none): BLOCK_N cut to divide it, and the
    hand-pipelined loop (PREFETCH) dropped where the space refuses it with that chunk (the plain loop takes
    any). None if the result is still outside the space."""
    cfg = dict(cfg, PARTITION=partition)
    if partition % cfg["BLOCK_N"]:
        cfg["BLOCK_N"] = math.gcd(partition, cfg["BLOCK_N"])
    if SPEC.space.why_invalid(cfg, problem, dtype) is not None:
        cfg.update(PREFETCH=False, EVICT=False, num_stages=2 if cfg["USE_DOT"] else 1)
    return cfg if SPEC.space.why_invalid(cfg, problem, dtype) is None else None


def default_config(p: Problem, dtype) -> dict:
    """Defaults from H100 sweeps (bf16, issue 6; docs/findings.md), timed with the harness (do_bench,
    L2 flushed) and GPU-only (CUDA graph over the same rotating inputs).

    tl.dot wins even for one query head per kv head (the group padded to 16 rows costs tensor-core
    time that is free here): its K/V loads are software-pipelined (num_stages), the broadcast form's
    are not. BLOCK_N 64, 4 warps, 3 stages was within 1.5% of the best of 76 tiles at B=64 (D=64, ctx
    1024) and the best at B=128 (D=128, ctx 4096). float32 keeps the broadcast form for small groups (an
    ieee fp32 dot has no tensor cores), and the interpreter cannot run a bf16 dot.
    """
    group = p.Hq // p.Hkv
    use_dot = _tl_dot_ok(dtype) and (dtype != torch.float32 or group >= 4)
    if use_dot:
        cfg = {"BLOCK_N": 64, "PARTITION": 0, "USE_DOT": True, "num_warps": 4, "num_stages": 3,
               "EVICT": False, "PREFETCH": False}
        rows = max(16, triton.next_power_of_2(group))
        while (rows * cfg["BLOCK_N"] > 128 * 32 * cfg["num_warps"]
               or cfg["BLOCK_N"] * p.D > 128 * 32 * cfg["num_warps"]):
            if cfg["BLOCK_N"] > 16:
                cfg["BLOCK_N"] //= 2
            else:
                cfg["num_warps"] *= 2
        while 2 * cfg["BLOCK_N"] * p.D * dtype.itemsize * cfg["num_stages"] > 160 * 1024:
            # K and V tiles per stage (D=256, float32 most of all): stay inside shared memory
            if cfg["num_stages"] > 2:
                cfg["num_stages"] = 2
            elif cfg["BLOCK_N"] > 16:
                cfg["BLOCK_N"] //= 2
            else:
                cfg["num_stages"] = 1
    else:
        cfg = {"BLOCK_N": 64 if p.D <= 64 else 32, "PARTITION": 0, "USE_DOT": False, "num_warps": 4,
               "num_stages": 1, "EVICT": False, "PREFETCH": False}
        while triton.next_power_of_2(group) * cfg["BLOCK_N"] * p.D > 64 * 32 * cfg["num_warps"]:
            if cfg["BLOCK_N"] > 8:
                cfg["BLOCK_N"] //= 2
            elif cfg["num_warps"] < 8:
                cfg["num_warps"] *= 2
            else:
                break  # at most 128 products per thread: still inside the space's bound
    while cfg["BLOCK_N"] * p.D < 32 * cfg["num_warps"] and cfg["num_warps"] > 1:
        cfg["num_warps"] //= 2
    # Split-KV when one program per (sequence, kv head) gives less than ~3 programs per SM: aim at ~3,
    # in chunks of at least 64 tokens. Sweep best: B=1 ctx 4096 (Hkv 8) chunks of 128, ctx 32768 of
    # 1024, B=1 and B=8 with 12 heads chunks of 64..256; B=32 (Hkv 8, ctx 4096) 2 chunks (2% faster).
    # At >= 3 programs per SM (B=64 with 12 heads) splitting was slower: the merge costs, no tail to fill.
    programs = p.B * p.Hkv
    if programs < 3 * SMS and p.span >= 256:
        want = -(-3 * SMS // programs)
        part = max(64, cfg["BLOCK_N"], triton.next_power_of_2(-(-p.span // want)))
        while -(-p.span // part) > MAX_PARTS:
            part *= 2
        if part < p.span and part <= 4096:
            cfg["PARTITION"] = part
            # two warps per chunk program for D <= 64 (B=1 ctx 1024: 9.9 us vs 10.6 with four)
            two = dict(cfg, num_warps=2)
            if use_dot and p.D <= 64 and cfg["num_warps"] == 4 and _constraint(two, p, dtype) is None:
                cfg["num_warps"] = 2
    # A program of at most two tiles has nothing to pipeline beyond double buffering (B=1 ctx 4096, 128-
    # token chunks: 18.0 us with 2 stages, 23.6 with 3; B=256 ctx 128: 51.3 vs 52.5).
    if use_dot and (cfg["PARTITION"] or p.span) <= 2 * cfg["BLOCK_N"]:
        cfg["num_stages"] = min(cfg["num_stages"], 2)
    # Short chunks: the hand-pipelined loop with evict_first K/V loads (probe_variants.py, H100 bf16,
    # zero-fill do_bench / CUDA graph): B=1 GPT-2 ctx 1024 in 64-token chunks 9.95 / 5.75 us against
    # 10.21 / 6.33 pipelined by Triton; B=1 Llama ctx 4096 in 128-token chunks of 32-token tiles 16.99 /
    # 12.53 against 18.43 / 13.47. Long single-pass programs stay with the pipeliner (B=64 GPT-2 ctx
    # 1024: 92.4 / 83.4 hand-pipelined against 87.1 / 73.9).
    if use_dot and 0 < cfg["PARTITION"] <= 256:
        hand = dict(cfg, num_stages=1, PREFETCH=True, EVICT=True)
        if p.D >= 128 and hand["BLOCK_N"] > 32 and hand["PARTITION"] % 32 == 0:
            hand["BLOCK_N"] = 32
        if _constraint(hand, p, dtype) is None:
            cfg = hand
    return cfg


def seeds(p: Problem, dtype) -> list[dict]:
    """Deep K/V pipelines, tried first by every study: since the block ids load a tile ahead, num_stages 3-4
    keep 2-3 tiles in flight (before, one buffer at any num_stages), which one-step moves from the default's
    hand-pipelined short chunks (B=1) do not reach together with the tile and chunk: 64-token tiles at 4
    stages and 128-token ones at 3, at the default's chunk and twice it, where a chunk fills the pipeline."""
    base = default_config(p, dtype)
    if not base["USE_DOT"]:
        return []
    part = base["PARTITION"]
    out = []
    for chunk in ([part, 2 * part] if part else [0]):
        for block_n, stages in ((64, 4), (128, 3)):
            cfg = dict(base, PARTITION=chunk, BLOCK_N=block_n, num_stages=stages, EVICT=False, PREFETCH=False)
            if (chunk or p.span) >= stages * block_n and SPACE.why_invalid(cfg, p, dtype) is None:
                out.append(cfg)
    return out


def bucket(p: Problem) -> dict:
    # a window's problem is looked up as the full-context problem of its span (the same work a query)
    return {"B": triton.next_power_of_2(p.B), "Hq": p.Hq, "Hkv": p.Hkv, "D": p.D,
            "block_size": p.block_size, "ctx": triton.next_power_of_2(p.span)}


def cost(p: Problem, dtype) -> K.Cost:
    """K and V of the context tokens (the window's, with one) read once, q read, out written (mixed
    problems: counted at ctx)."""
    e = torch.finfo(dtype).bits // 8
    n = p.ctx if p.window is None else min(p.ctx, p.window)
    kv = 2.0 * p.B * n * p.Hkv * p.D * e
    return K.Cost(flops=4.0 * p.B * p.Hq * n * p.D, bytes=kv + 2.0 * p.B * p.Hq * p.D * e)


# ---------------------------------------------------------------------------------------------------
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
        ("window 0", lambda: paged_attention(q, kc, vc, bt, cl, window=0), ValueError),
        ("float window", lambda: paged_attention(q, kc, vc, bt, cl, window=4.0), ValueError),
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
    description="decode attention over a paged KV cache (GQA, split-KV, sliding window)",
    run=paged_attention,
    reference=ref.paged_attention,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    seeds=seeds,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[
        # GPT-2 small: 12 heads of 64
        Problem(1, 12, 12, 64, 128), Problem(1, 12, 12, 64, 1024), Problem(8, 12, 12, 64, 512),
        Problem(8, 12, 12, 64, 1024), Problem(64, 12, 12, 64, 512), Problem(64, 12, 12, 64, 1024),
        Problem(256, 12, 12, 64, 128), Problem(256, 12, 12, 64, 1024),
        # Llama-style GQA: 32 query heads on 8 kv heads of 128
        Problem(1, 32, 8, 128, 4096), Problem(1, 32, 8, 128, 8192), Problem(1, 32, 8, 128, 16384),
        Problem(1, 32, 8, 128, 32768), Problem(32, 32, 8, 128, 4096),
        Problem(128, 32, 8, 128, 4096),
    ],
    small_problems=[Problem(2, 4, 2, 32, 40), Problem(3, 2, 1, 64, 70, 8, True)],
    layouts=("contiguous", "strided"),
    vendor=vendor,
    vendor_name="sdpa (torch's default dispatch), contiguous KV",
    peers={"flex": flex},
    bad_inputs=_bad_inputs,
    accumulation=K.fp32_accumulation,  # fp32 scores and P·V follow torch.get_float32_matmul_precision()
))
