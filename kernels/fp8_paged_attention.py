"""Decode over an FP8 paged KV cache (spec ``fp8_paged_attention``); the write that quantizes new K/V rows
into it is :mod:`tritune.kernels.fp8_kv_write` (spec ``fp8_kv_write``).

The cache, in e4m3: K in ``paged_attention``'s layout, (num_blocks, block_size, Hkv, D); V transposed
within each block, (num_blocks, Hkv, D, block_size), tokens contiguous (each block and head a contiguous
(D, block_size) slab); one float32 scale per (token, kv head) beside each, (num_blocks, block_size, Hkv):
k ≈ k_cache · k_scale[..., None], v[n, b, h, :] ≈ v_cache[n, h, :, b] · v_scale[n, b, h].

Why V is transposed: P·V's B operand is V (tokens × D) with the tokens along the dot's K, so each thread
holds consecutive tokens; from a D-contiguous V, sm90 (no ldmatrix.trans for 8-bit data) reads the tile out
of shared memory byte by byte: at D = 128, 64-token tiles and 4 warps (Triton 3.6, sm90), 64 single-byte
loads per thread and tile, a loop of 1,160 SASS instructions (the bf16 decode's: 543) and 231 registers.
Tokens-contiguous, the tile loads as it lies: 795 instructions and 128 registers (most of the rest is the
e4m3 -> bf16 widening, which fp16 queries do in one instruction per pair). K needs no such care: q·Kᵀ
contracts over D, along which K (tokens, D) is already contiguous.

Per-token rather than per-head scales: each write quantizes its own rows with their own amax (dynamic, no
calibration pass, nothing saturates however later tokens grow, an outlier token coarsens only itself),
and the scale costs 4 bytes per D bytes of values (3% at D = 128), so the cache still reads about half of
bf16's bytes. A per-head scale fixed ahead of time would save those bytes and let the decode fold the
scales out of the loop, but needs calibration and clips what it did not foresee.

Decode: one program per (sequence, kv head[, chunk]) takes the G = Hq / Hkv query heads of that kv head at
once (padded to 16 rows for ``tl.dot``) and streams BLOCK_N-token tiles with an online softmax (float32, base
2). Both dots run in fp16 whatever the query's dtype: e4m3 widens to fp16 exactly in one instruction a pair,
while to bf16 it takes three, two of them on the SM's quarter-rate conversion pipe, which bounded the decode
(at B=64, 4k tokens: 384 conversions a token, ~190 µs of conversion pipe against the 127 µs the bytes need).
The query enters as fp16 times a power of two (exact: fp16 holds bf16's significand); each token's k scale
multiplies its score column. Each token's v scale cannot multiply P in fp16 (P·vs spans any range), so the
kernel keeps two running maxima: m of the scores, for the denominator Σ 2^(s − m), and r of s − m + log2(vs)
(relative to m: a score of 1e12 would swallow the scale's exponent), for the numerator's fp16 weights
2^(s − m + log2 vs − r) in [0, 1]; the finished row is acc · 2^r / l.
Whole tiles load unmasked (a per-token predicate would split V's token rows into byte loads), their block ids
loaded a tile ahead so that the pipeliner keeps num_stages - 1 tiles of K, V and scales in flight (see
paged_attention); the rest of the context goes through 16-token tiles masked per token. Split-KV (PARTITION > 0): chunks of
PARTITION tokens write partial (m, l, acc) to a float32 workspace, and the program that takes a (sequence, kv
head)'s last ticket merges them in chunk order (``paged_attention.merge_chunks``, the bf16 decode's merge over
blocks of chunks): one launch, as in paged_attention; a sequence that one chunk holds is finished by its first
chunk. Inside a CUDA graph the launch uses programmatic dependent launch (``PDL``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.fp8_kv_write import HEAD_DIMS, check_cache, fp8_write_kv, v_cache_shape  # noqa: F401
from tritune.kernels.paged_attention import merge_chunks, merge_parts_block
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_fp8
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8_attention as ref

if dev.interpreted():
    interpret_fp8.apply()   # e4m3 conversions round wrong in the interpreter without it

E4M3 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_PARTS = 1024
SMS = 132   # H100/H200; the split heuristic needs only the order of magnitude


# ---------------------------------------------------------------------------------------------------
# The decode
@triton.jit
def _block_ids(table, n0, end, stride_tn, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The block id of each token of [n0, n0 + BLOCK_N); 0 past the block holding token end - 1 (entries past
    the length are never read: they may hold anything). Masked by block, not by token, so that the ids keep
    their constancy over each block's tokens: V^T's token rows then stay 16-byte loads, not single bytes."""
    idx = (n0 + tl.arange(0, BLOCK_N)) // BLOCK_SIZE
    return tl.load(table + idx * stride_tn, mask=idx < tl.cdiv(end, BLOCK_SIZE), other=0).to(tl.int64)


@triton.jit
def _decode_tile(q, block, k_head, v_head, ks_head, vs_head, n0, end, m_i, l_i, r_i, acc, qk_scale,
                 s_kcn, s_kcb, s_vcn, s_ksn, s_ksb, s_vsn, s_vsb,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Tokens [n0, n0 + BLOCK_N), held in blocks ``block``. MASKED=False only for a tile wholly inside the
    context: no per-token mask, whose predicates would split V's token-contiguous rows into byte loads (the
    tail's tiles pass True). Two running maxima: m_i of the scores s (for the denominator l_i) and r_i, relative
    to m_i, of s - m_i + log2(v scale) (for acc, whose fp16 weights 2^(s - m + log2 vs - r) lie in [0, 1])."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    slot = offs_n % BLOCK_SIZE
    if MASKED:
        mask_n = offs_n < end
        k = tl.load(k_head + (block * s_kcn + slot * s_kcb)[:, None], mask=mask_n[:, None], other=0.0)
        # V^T (D, BLOCK_N): each block's tokens contiguous
        vt = tl.load(v_head + (block * s_vcn + slot)[None, :], mask=mask_n[None, :], other=0.0)
        ks = tl.load(ks_head + block * s_ksn + slot * s_ksb, mask=mask_n, other=0.0)
        vs = tl.load(vs_head + block * s_vsn + slot * s_vsb, mask=mask_n, other=0.0)
    else:
        k = tl.load(k_head + (block * s_kcn + slot * s_kcb)[:, None])
        vt = tl.load(v_head + (block * s_vcn + slot)[None, :])
        ks = tl.load(ks_head + block * s_ksn + slot * s_ksb)
        vs = tl.load(vs_head + block * s_vsn + slot * s_vsb)
    # e4m3 -> fp16 is exact and one instruction a pair (to bf16: three, two of them on the conversion pipe)
    s = tl.dot(q, tl.trans(k.to(tl.float16))) * (ks * qk_scale)[None, :]
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    shift = m_i - m_new                      # <= 0; -inf on the first tile
    # at most 0: the GPU contracts s = dot * scale and s - m into one FMA, which leaves the top score up to half
    # an ulp of s above m (at |s| ~ 1e14 that is 2^24, and 2^(2^24) overflows)
    d = tl.minimum(s - m_new[:, None], 0.0)
    l_i = l_i * tl.exp2(shift) + tl.sum(tl.exp2(d), axis=1)
    # u = s - m + log2(vs), formed after the subtraction: scores of 1e12 would swallow the scale's exponent;
    # a zero scale (an all-zero row) weighs nothing: log2(0) = -inf
    u = d + tl.log2(vs)[None, :]
    r_new = tl.maximum(r_i + shift, tl.max(u, axis=1))
    r_sub = tl.where(r_new == float("-inf"), 0.0, r_new)
    # P·V with V^T's tokens along the dot's K: the operand loads as it lies, no byte transposes
    w = tl.exp2(u - r_sub[:, None]).to(tl.float16)
    acc = acc * tl.exp2(shift + r_i - r_sub)[:, None] + tl.dot(w, tl.trans(vt.to(tl.float16)))
    return m_new, l_i, r_new, acc


@triton.jit
def _fp16_query(q, qk_scale):
    """q (bf16 or fp16) as fp16 times 2^c, c an integer putting max |q| in [2^13, 2^14): exact (fp16 holds bf16's
    8 significant bits; what falls under fp16's range is < 2^-38 of the largest entry); the score scale
    absorbs 2^-c."""
    amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
    e = tl.minimum(tl.maximum(tl.math.floor(tl.log2(amax)), -100.0), 100.0).to(tl.int32)
    two_c = ((127 + 13 - e) << 23).to(tl.float32, bitcast=True)
    return (q.to(tl.float32) * two_c).to(tl.float16), qk_scale / two_c


@triton.jit
def _fp8_decode(Q, Kc, Vc, Ks, Vs, BT, CL, Out, WS, Locks, qk_scale, num_parts, stride_cl,
                s_qb, s_qh, s_qd, s_kcn, s_kcb, s_kch, s_kcd, s_vcn, s_vch,
                s_ksn, s_ksb, s_ksh, s_vsn, s_vsb, s_vsh, stride_tb, stride_tn, s_ob, s_oh, s_od,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, PARTITION: tl.constexpr, GROUP_MERGE: tl.constexpr,
                PARTS_BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: q, the caches and the lengths come from launches before this
        tl.extra.cuda.gdc_wait()               # one (wait for them before any read or write); then the next
        tl.extra.cuda.gdc_launch_dependents()  # launch may start and read its weights: one launch ahead
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
    q = tl.load(Q + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=mask_g[:, None],
                other=0.0)
    table = BT + b.to(tl.int64) * stride_tb
    kvh64 = kvh.to(tl.int64)
    k_head = Kc + kvh64 * s_kch + offs_d[None, :] * s_kcd
    v_head = Vc + kvh64 * s_vch + offs_d[:, None] * BLOCK_SIZE   # a (D, block_size) slab per block and head
    ks_head = Ks + kvh64 * s_ksh
    vs_head = Vs + kvh64 * s_vsh
    q, qk_scale = _fp16_query(q, qk_scale)
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    r_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
    # whole tiles unmasked (pipelined, vector loads), then what is left in 16-token tiles masked per token:
    # a small unpipelined tail keeps the kernel's registers at the main loop's
    full = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    TAIL_N: tl.constexpr = 16
    # The whole tiles' block ids are loaded one tile ahead (loop-carried), so K/V addresses depend on no load of
    # their own iteration: Triton's pipeliner then keeps num_stages - 1 tiles of K, V and scales in flight
    # (looked up in the same iteration, the ids take a stage of their own and leave the rest one buffer, waited
    # for with nothing to overlap: cp.async.wait_group 0)
    block = _block_ids(table, start, end, stride_tn, BLOCK_SIZE, BLOCK_N)
    for n0 in range(start, full, BLOCK_N):
        block_nx = _block_ids(table, n0 + BLOCK_N, end, stride_tn, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, r_i, acc = _decode_tile(q, block, k_head, v_head, ks_head, vs_head, n0, end, m_i, l_i, r_i, acc,
                                          qk_scale, s_kcn, s_kcb, s_vcn, s_ksn, s_ksb, s_vsn, s_vsb,
                                          BLOCK_SIZE, BLOCK_N, False)
        block = block_nx
    for n0 in tl.range(full, end, TAIL_N, num_stages=1):
        tail = _block_ids(table, n0, end, stride_tn, BLOCK_SIZE, TAIL_N)
        m_i, l_i, r_i, acc = _decode_tile(q, tail, k_head, v_head, ks_head, vs_head, n0, end, m_i, l_i, r_i, acc,
                                          qk_scale, s_kcn, s_kcb, s_vcn, s_ksn, s_ksb, s_vsn, s_vsb,
                                          BLOCK_SIZE, TAIL_N, True)
    # acc held Σ 2^(s - m + log2 vs - r) v: back to the standard partial Σ 2^(s - m) vs v (0 where nothing was seen)
    acc = acc * tl.where(r_i == float("-inf"), 0.0, tl.exp2(r_i))[:, None]
    n_live = 1
    if PARTITION > 0:
        n_live = tl.maximum(tl.cdiv(seq_len, PARTITION), 1)
    if n_live == 1:   # unsplit, or a sequence one chunk holds: finished here (chunks past it do nothing)
        if part == 0:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]   # a length-0 sequence (validate=False) gets zeros
            tl.store(Out + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od,
                     out.to(Out.dtype.element_ty), mask=mask_g[:, None])
    elif part < n_live:
        # partials (acc, then m, then l) of row (b, head, chunk), paged_attention's workspace layout
        n_rows = tl.num_programs(0).to(tl.int64) * tl.num_programs(1) * GROUP * num_parts
        row0 = (b.to(tl.int64) * tl.num_programs(1) * GROUP + kvh * GROUP) * num_parts   # head 0, chunk 0
        row = row0 + offs_g * num_parts + part
        tl.store(WS + row[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None])
        tl.store(WS + n_rows * D + row, m_i, mask=mask_g)
        tl.store(WS + n_rows * (D + 1) + row, l_i, mask=mask_g)
        # every thread's partial is written before the ticket is taken (the atomic releases them); the
        # program that takes the last ticket merges the chunks in chunk order and resets the counter
        tl.debug_barrier()
        lock = Locks + b * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        if ticket == n_live - 1:
            merge_chunks(WS + row0 * D, WS + n_rows * D + row0, WS + n_rows * (D + 1) + row0, Out, b, kvh, n_live,
                         num_parts, s_ob, s_oh, s_od, GROUP, D, GROUP_MERGE, PARTS_BLOCK)
            tl.store(lock, 0)


@dataclass(frozen=True)
class Problem:
    B: int                  # sequences (one query token each)
    Hq: int
    Hkv: int
    D: int
    ctx: int                # context length (the longest, when mixed)
    block_size: int = 16
    mixed: bool = False     # lengths drawn in [1, ctx] per sequence (tests); else all equal to ctx

    @property
    def capacity(self) -> int:
        return -(-self.ctx // self.block_size) * self.block_size


def problem_of(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2], block_tables.shape[1] * k_cache.shape[1],
                   k_cache.shape[1])


class _Plan:
    __slots__ = ("cfg", "cfg_key", "B", "out_shape", "grid", "args", "kws", "ws_numel", "locks", "kws_pdl",
                 "kernels", "consts", "consts_pdl")


_PLANS = K.PlanCache()
_workspace = K.Workspace()             # split-KV partials (acc, m, l), per device
_locks = K.Counters(minimum=1 << 14)   # split-KV tickets, per device, zero between launches


def _plan(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, out, config) -> _Plan:
    K.check_tensor("q", q, ndim=3, dtypes=Q_DTYPES)
    K.check_device("q", q)
    check_cache(k_cache, v_cache, k_scale, v_scale, q.device)
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dc = k_cache.shape
    if Dc != D:
        raise ValueError(f"k_cache: head dim {Dc} does not match q's {D}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim {D} not supported (expected one of {HEAD_DIMS})")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q: {Hq} heads is not a multiple of the cache's {Hkv} kv heads")
    K.check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32,))
    K.check_tensor("context_lens", context_lens, ndim=1, dtypes=(torch.int32,))
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
        if t.shape[0] != B:
            raise ValueError(f"{name}: {t.shape[0]} rows for a batch of {B} sequences (q's first dim)")
    if block_tables.shape[1] == 0:
        raise ValueError("block_tables: no columns (every sequence needs at least one block)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")
    if out is not None:
        K.check_out(out, (B, Hq, D), q.dtype, q.device)
    if dev.interpreted():
        interpret_fp8.require("fp8_paged_attention")
    plan = _Plan()
    plan.B, plan.out_shape = B, (B, Hq, D)
    if B == 0:
        return plan
    p = problem_of(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens)
    plan.cfg, plan.cfg_key = SPEC.config_and_key(p, q.dtype, config)
    c = SPACE.full(plan.cfg)
    group = Hq // Hkv
    part = c["PARTITION"]
    num_parts = triton.cdiv(p.capacity, part) if part else 1
    plan.ws_numel = B * Hq * num_parts * (D + 2) if part else 0
    plan.grid = (B, Hkv, num_parts)
    sm = (1.0 / math.sqrt(D) if scale is None else float(scale)) * LOG2E
    o_st = (Hq * D, D, 1) if out is None else out.stride()
    plan.args = (sm, num_parts, context_lens.stride(0), *q.stride(), *k_cache.stride(), *v_cache.stride()[:2],
                 *k_scale.stride(), *v_scale.stride(), *block_tables.stride(), *o_st)
    group_merge = triton.next_power_of_2(group)
    parts_block = merge_parts_block(num_parts, group_merge, D, c["num_warps"]) if part else 1
    # split-KV tickets (Counters keep outgrown buffers alive for captured graphs)
    plan.locks = _locks(q.device, B * Hkv) if part else None
    plan.kws = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, BLOCK_SIZE=block_size,
                    BLOCK_N=c["BLOCK_N"], PARTITION=part, GROUP_MERGE=group_merge, PARTS_BLOCK=parts_block,
                    PDL=False, num_warps=c["num_warps"], num_stages=c["num_stages"])
    if c["maxnreg"]:   # a register cap for ptxas: more programs an SM, what does not fit spills
        plan.kws["maxnreg"] = c["maxnreg"]
    K.launch_variants(plan, q.device, _CONSTEXPRS)   # PDL in graphs, direct launches after the first
    return plan


def _validate_lengths(block_tables, context_lens, num_blocks, block_size):
    max_blocks = block_tables.shape[1]
    lens = context_lens.long()
    if bool((lens < 1).any()):
        i = int(torch.nonzero(lens < 1)[0, 0])
        raise ValueError(f"context_lens: sequence {i} has length {int(lens[i])}; lengths must be >= 1")
    if bool((lens > max_blocks * block_size).any()):
        i = int(torch.nonzero(lens > max_blocks * block_size)[0, 0])
        raise ValueError(f"context_lens: sequence {i} has length {int(lens[i])}, more than its block table "
                         f"addresses ({max_blocks} blocks x {block_size} tokens)")
    used = torch.arange(max_blocks, device=lens.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(f"block_tables: entry [{i}, {j}] = {int(block_tables[i, j])} is not a block id "
                         f"in [0, {num_blocks})")


def fp8_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, *, scale=None, out=None,
                        config: dict | None = None, validate: bool = True):
    """Decode attention over an FP8 paged KV cache. Returns out (B, Hq, D) in q's dtype (bf16 or fp16).

    q (B, Hq, D); k_cache (num_blocks, block_size, Hkv, D) and v_cache (num_blocks, Hkv, D, block_size) e4m3
    (V transposed per block, see the module's docstring) with Hq a multiple of Hkv; k_scale, v_scale
    (num_blocks, block_size, Hkv) float32 (as :func:`fp8_write_kv` writes them);
    block_tables (B, max_blocks) int32; context_lens (B,) int32, each in [1, max_blocks · block_size].
    ``validate=True`` checks the lengths and the block ids in use (a host sync)."""
    try:
        key = tuple(K.tensor_meta(t) for t in (q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                               out)) + (scale, None if config is None else tuple(config.items()))
        hash(key)
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                                 scale, out, config), keep=lambda pl: pl.B)
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_scale", k_scale),
                               ("v_scale", v_scale)))
    if not plan.B:
        return out
    if validate and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _validate_lengths(block_tables, context_lens, k_cache.shape[0], k_cache.shape[1])
    ws = _workspace(q.device, plan.ws_numel) if plan.ws_numel else out
    locks = context_lens if plan.locks is None else plan.locks   # no split-KV: any pointer of this call
    pdl = plan.kws_pdl is not None and K.pdl_now("fp8_paged_attention")
    args = (q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, out, ws, locks, *plan.args)
    K.launch_cached(_fp8_decode, plan.kernels, plan.grid, args, plan.kws_pdl if pdl else plan.kws,
                    plan.consts_pdl if pdl else plan.consts, pdl, args[:10])
    return out


_CONSTEXPRS = K.constexpr_params(_fp8_decode)  # what a direct launch passes after the runtime arguments


def _constraint(c, p: Problem, dtype) -> str | None:
    rows = max(16, triton.next_power_of_2(p.Hq // p.Hkv))
    warps = c["num_warps"]
    if rows * c["BLOCK_N"] // (32 * warps) > 128 or c["BLOCK_N"] * p.D // (32 * warps) > 128:
        return "tiles too large for the warps (register spills)"
    if c["BLOCK_N"] * p.D < 32 * warps:
        return "idle threads"
    if c["BLOCK_N"] > max(16, triton.next_power_of_2(p.capacity)):
        return "BLOCK_N larger than the context"
    if 2 * c["BLOCK_N"] * p.D * max(1, c["num_stages"] - 1) > 192 * 1024:   # the pipeliner's num_stages - 1
        return "K and V tiles of every stage exceed shared memory"
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
    params={"BLOCK_N": [16, 32, 64, 128, 256], "PARTITION": [0, 32, 64, 128, 256, 512, 1024, 2048, 4096],
            "num_warps": [1, 2, 4, 8], "num_stages": [1, 2, 3, 4],
            # ptxas's register cap (0: none). The B=64 winner (16-token tiles, one warp) takes 197 registers:
            # two warps a scheduler (12.5% occupancy, the bound ncu shows); 168 fits three, no spill (sm90)
            "maxnreg": [0, 128, 168]},
    constraint=_constraint,
    legacy={"maxnreg": 0},   # configs stored before the key: no cap
)


def default_config(p: Problem, dtype) -> dict:
    """paged_attention's tl.dot defaults (64-token tiles, 4 warps, 3 stages; half the bytes a tile, so the
    same tile moves half as much) and its split rule: chunks when B·Hkv programs give under ~3 per SM."""
    cfg = {"BLOCK_N": 64, "PARTITION": 0, "num_warps": 4, "num_stages": 3, "maxnreg": 0}
    cfg["BLOCK_N"] = min(64, max(16, triton.next_power_of_2(p.capacity)))
    while _constraint(cfg, p, dtype) is not None and cfg["BLOCK_N"] > 16:
        cfg["BLOCK_N"] //= 2
    while _constraint(cfg, p, dtype) is not None and cfg["num_warps"] < 8:
        cfg["num_warps"] *= 2
    while cfg["BLOCK_N"] * p.D < 32 * cfg["num_warps"] and cfg["num_warps"] > 1:
        cfg["num_warps"] //= 2
    programs = p.B * p.Hkv
    if programs < 3 * SMS and p.capacity >= 256:
        want = -(-3 * SMS // programs)
        part = max(64, cfg["BLOCK_N"], triton.next_power_of_2(-(-p.capacity // want)))
        while -(-p.capacity // part) > MAX_PARTS:
            part *= 2
        if part < p.capacity and part <= 4096:
            cfg["PARTITION"] = part
    if (cfg["PARTITION"] or p.capacity) <= 2 * cfg["BLOCK_N"]:
        cfg["num_stages"] = 2
    return cfg


def seeds(p: Problem, dtype) -> list[dict]:
    """Deep pipelines, tried first by every study: with the block ids loaded a tile ahead, num_stages 3-4 keep
    2-3 tiles of K, V and scales in flight (one buffer before, at any num_stages); 64- and 128-token tiles at 4
    stages and 256-token ones (a bf16 128-token tile's bytes) at 3, at the default's chunk and twice it, where
    a chunk fills the pipeline."""
    base = default_config(p, dtype)
    part = base["PARTITION"]
    out = []
    for chunk in ([part, 2 * part] if part else [0]):
        for block_n, warps, stages in ((64, 4, 4), (128, 4, 4), (128, 8, 4), (256, 8, 3)):
            cfg = dict(base, PARTITION=chunk, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            if (chunk or p.capacity) >= stages * block_n and SPACE.why_invalid(cfg, p, dtype) is None:
                out.append(cfg)
    return out


def bucket(p: Problem) -> dict:
    return {"B": triton.next_power_of_2(p.B), "Hq": p.Hq, "Hkv": p.Hkv, "D": p.D, "block_size": p.block_size,
            "ctx": triton.next_power_of_2(p.capacity)}


def cost(p: Problem, dtype) -> K.Cost:
    """e4m3 K and V of the context read once with their scales (4 bytes per token and head each), q read
    and out written."""
    e = torch.finfo(dtype).bits // 8
    kv = 2.0 * p.B * p.ctx * p.Hkv * (p.D + 4)
    return K.Cost(flops=4.0 * p.B * p.Hq * p.ctx * p.D, bytes=kv + 2.0 * p.B * p.Hq * p.D * e)


def context_lengths(p: Problem, seed: int) -> list[int]:
    if not p.mixed:
        return [p.ctx] * p.B
    g = torch.Generator().manual_seed(seed)
    pick = [1, p.block_size, p.block_size + 1, p.ctx]
    lens = [pick[int(i)] if i < len(pick) else int(torch.randint(1, p.ctx + 1, (1,), generator=g))
            for i in torch.randint(0, 2 * len(pick), (p.B,), generator=g)]
    lens = [min(n, p.ctx) for n in lens]
    lens[int(torch.randint(0, p.B, (1,), generator=g))] = p.ctx
    return lens


def _fill_garbage(caches, block_tables, lens):
    """NaN (and 448 in even blocks of K) in every slot no sequence may read, NaN scales there: a read that
    should not happen shows in the output."""
    k_cache, v_cache, k_scale, v_scale = caches
    num_blocks, bs = k_cache.shape[:2]
    tables = block_tables.long().cpu()
    pos = torch.arange(tables.shape[1] * bs).reshape(tables.shape[1], bs)
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        readable[tables[b]] = pos < n
    hidden = (~readable).to(k_cache.device)
    even = (torch.arange(num_blocks, device=k_cache.device) % 2 == 0)[:, None] & hidden
    k_cache.view(torch.uint8)[hidden] = 0x7F        # e4m3 NaN
    k_cache.view(torch.uint8)[even] = 0x7E          # 448
    ref.v_rows(v_cache.view(torch.uint8))[hidden] = 0x7F
    k_scale[hidden] = float("nan")
    v_scale[hidden] = float("nan")


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """K/V rows of varied magnitudes quantized per token by the reference quantizer into a pool of randomly
    permuted blocks with a few spare ones (V transposed within each block); every slot not holding a context
    token holds garbage. "contiguous": the scales head-major within each block, as the engine's pool holds
    them (``kv_fp8.alloc_scales``). "strided": q is a slice of a fused (B, 3·Hq, D) buffer, K/V are views of one
    pool of (num_blocks, 2, block_size · Hkv · D) bytes, K's and V's blocks interleaved, and the scales
    token-major (contiguous (num_blocks, block_size, Hkv))."""
    nb = -(-p.ctx // p.block_size)
    num_blocks = p.B * nb + 3
    shape = (num_blocks, p.block_size, p.Hkv, p.D)
    mag = torch.exp(S.randn((*shape[:3], 1), torch.float32, device, seed + 4, scale=0.5))
    k8, ks = ref.quantize_kv(S.randn(shape, torch.float32, device, seed + 1) * mag)
    v8, vs = ref.quantize_kv(S.randn(shape, torch.float32, device, seed + 2, shift=0.25) * mag.flip(0))
    v8 = v8.permute(0, 2, 3, 1).contiguous()        # (num_blocks, Hkv, D, block_size)
    if layout == "strided":
        pool = torch.empty((num_blocks, 2, v8[0].numel()), dtype=E4M3, device=device)
        pool[:, 0], pool[:, 1] = k8.flatten(1), v8.flatten(1)
        k8, v8 = pool[:, 0].view(k8.shape), pool[:, 1].view(v8.shape)
        q = S.randn((p.B, 3 * p.Hq, p.D), dtype, device, seed, scale=1.5)[:, p.Hq:2 * p.Hq]
    elif layout == "contiguous":
        q = S.randn((p.B, p.Hq, p.D), dtype, device, seed, scale=1.5)
        ks, vs = (s.transpose(1, 2).contiguous().transpose(1, 2) for s in (ks, vs))   # head-major storage
    else:
        raise ValueError(f"layout: unknown {layout!r}; expected contiguous or strided")
    g = torch.Generator().manual_seed(seed + 3)
    block_tables = torch.randperm(num_blocks, generator=g)[: p.B * nb].reshape(p.B, nb).to(torch.int32)
    lens = context_lengths(p, seed)
    _fill_garbage((k8, v8, ks, vs), block_tables, lens)
    return K.Case(args=(q, k8, v8, ks, vs, block_tables.to(device), torch.tensor(lens, dtype=torch.int32,
                                                                                    device=device)),
                  kwargs={"scale": 1.0 / math.sqrt(p.D) * (1.0 + 0.25 * (seed % 3)), "validate": False},
                  out=torch.empty((p.B, p.Hq, p.D), dtype=dtype, device=device))


def problems(max_elems: int):
    from hypothesis import strategies as st

    small = dev.interpreted()

    @st.composite
    def draw(d):
        b = d(st.integers(1, 3 if small else 32))
        hkv = d(st.sampled_from([1, 2] if small else [1, 2, 4, 8]))
        group = d(st.sampled_from([1, 2, 3, 4] if small else [1, 2, 4, 8, 16]))
        hd = d(st.sampled_from([16, 32, 64] if small else list(HEAD_DIMS)))
        bs = d(st.sampled_from([8, 16, 32]))
        top = max(1, min(100 if small else 4096, max_elems // (b * hkv * hd)))
        ctx = d(st.one_of(st.sampled_from([n for n in (1, bs, bs + 1, 2 * bs + 3) if n <= top] or [1]),
                          st.integers(1, top)))
        return Problem(b, hkv * group, hkv, hd, ctx, bs, d(st.booleans()) and b > 1)

    return draw()


def dequantized_kv(c: K.Case):
    """(B, Hkv, ctx, D) dequantized K and V of equal-length sequences in q's dtype (built untimed), else None."""
    q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens = c.args
    n = int(context_lens.max())
    if int(context_lens.min()) != n:
        return None
    blocks = block_tables[:, : -(-n // k_cache.shape[1])].long()
    B = q.shape[0]

    def gather(cache, sc):
        x = cache[blocks].float() * sc[blocks][..., None]
        return x.reshape(B, -1, *cache.shape[2:])[:, :n].transpose(1, 2).contiguous().to(q.dtype)

    return gather(k_cache, k_scale), gather(ref.v_rows(v_cache), v_scale)


def _vendor(c: K.Case):
    """SDPA on the dequantized bf16 K/V, contiguous (gathered and dequantized untimed)."""
    kv = dequantized_kv(c)
    if kv is None:
        raise ValueError("SDPA comparison needs equal context lengths")
    k, v = kv
    q4 = c.args[0][:, :, None, :]
    scale, gqa = c.kwargs["scale"], q4.shape[1] != k.shape[1]
    F = torch.nn.functional

    def call():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=gqa)

    call.label = f"sdpa on dequantized bf16 ({K.sdpa_backend(call)}), contiguous KV"
    return call


def _bad_inputs(device):
    B, Hq, Hkv, D, bs, nb = 2, 4, 2, 32, 16, 3
    q = torch.randn(B, Hq, D, device=device, dtype=torch.bfloat16)
    kc = torch.zeros(B * nb, bs, Hkv, D, device=device).to(E4M3)
    vc = torch.zeros(v_cache_shape(B * nb, bs, Hkv, D), device=device).to(E4M3)
    sc = torch.ones(B * nb, bs, Hkv, device=device)
    bt = torch.arange(B * nb, dtype=torch.int32, device=device).reshape(B, nb)
    cl = torch.tensor([5, 40], dtype=torch.int32, device=device)

    def pa(**kw):
        a = dict(q=q, k_cache=kc, v_cache=vc, k_scale=sc, v_scale=sc.clone(), block_tables=bt, context_lens=cl)
        a.update(kw)
        return lambda: fp8_paged_attention(**a)

    return [
        ("bf16 cache", pa(k_cache=kc.to(torch.bfloat16)), TypeError),
        ("fp32 q", pa(q=q.float()), TypeError),
        ("k_scale of the wrong shape", pa(k_scale=sc[:, :8]), ValueError),
        ("v_cache in K's token-major layout", pa(v_cache=kc.clone()), ValueError),
        ("v_cache blocks not contiguous slabs", pa(v_cache=kc.clone().permute(0, 2, 3, 1)), ValueError),
        ("float16 v_scale", pa(v_scale=sc.half()), TypeError),
        ("context longer than its block table", pa(context_lens=torch.tensor([5, nb * bs + 1], dtype=torch.int32,
                                                                              device=device)), ValueError),
        ("block id out of the pool", pa(block_tables=bt + 100), ValueError),
        ("Hq not a multiple of Hkv", pa(q=q[:, :3]), ValueError),
        ("head dim mismatch", pa(q=torch.randn(B, Hq, 64, device=device, dtype=torch.bfloat16)), ValueError),
        ("negative scale", lambda: fp8_paged_attention(q, kc, vc, sc, sc, bt, cl, scale=-1.0), ValueError),
    ]


# Llama-8B decode (32 query heads on 8 kv heads of 128): issue 50's B=64 ctx 4k and B=1 ctx 32k, and around them
_LLAMA = [(1, 4096), (1, 32768), (32, 4096), (64, 4096), (128, 4096)]

SPEC = K.register(K.KernelSpec(
    name="fp8_paged_attention",
    description="decode attention over an e4m3 paged KV cache with per-token scales (GQA, split-KV)",
    run=fp8_paged_attention,
    reference=ref.fp8_paged_attention,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    seeds=seeds,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(b, 32, 8, 128, ctx) for b, ctx in _LLAMA] + [Problem(64, 12, 12, 64, 1024)],
    small_problems=[Problem(2, 4, 2, 32, 40), Problem(3, 2, 1, 64, 70, 8, True)],
    dtypes=(torch.bfloat16,),
    layouts=("contiguous", "strided"),
    vendor=_vendor,
    vendor_name="sdpa on dequantized bf16 (torch's default dispatch), contiguous KV",
    bad_inputs=_bad_inputs,
))
