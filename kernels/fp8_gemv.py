"""Scaled FP8 GEMV for decode: C = (A·sa) @ (B·sb) (+ bias, GELU, + residual) for M ≤ 16 rows.

``fp8_gemm``'s contract and numbers (same arguments, checks, scales and float64 reference), for the few rows
of a decode step, where the product is bound by reading the weight: e4m3 B is half of bf16's bytes, so a
kernel that streams it at the memory's rate runs a decode step's linears in about half the bf16 GEMV's time.
``fp8_gemm``'s tiles are built for many rows; this kernel is built like :mod:`gemv`: each program a BLOCK_N
slice of outputs and a loop over K in BLOCK_K chunks (``fp8_gemm`` stays the path for M > 16).

Two inner loops, chosen by BLOCK_M. BLOCK_M = 1 (one row a program; M = 1, CUDA cores): each thread loads
16 consecutive e4m3 weights along B's contiguous dim (one 16-byte load), widens them to float32 (e4m3 ->
fp16 -> fp32: exact), multiplies them by the activation values (e4m3, widened the same way) and sums its 16
products into one float32 accumulator; the accumulators are reduced across threads once, after the loop.
Where K is contiguous (the engine's weights: ``Fp8Weight.b`` is the (K, N) transpose of a row-major (N, K)
tensor) the 16 values lie along K and each step's sum stays in the thread (sm90, triton 3.6: 222 SASS
instructions a step for 64 weight bytes a thread, 48 registers); where N is contiguous it is as correct,
with a layout change each step. BLOCK_M = 16 (2 to 16 rows, tensor cores): both tiles widen to fp16
(exact) and ``tl.dot`` accumulates in float32 (fp16 MMA products are exact and their sums float32, so
fp8_gemm's per-tile promotion is not needed); the weight tiles come in through cp.async, num_stages deep.

Scales: a row's and a channel's (or a tensor's) multiply the finished float32 sums once, in the epilogue.
128x128 block scales: a program's BLOCK_N columns lie in one scale block (BLOCK_N ≤ 128), so its scale is
one number per 128 of K: the one-row loop multiplies each thread's 16-value sum by it (16 | 128), the dot
loop each K tile's fresh product (BLOCK_K ≤ 128).

Split-K (``SPLIT_K > 1``), as in ``gemv``: a decode linear with N = 2048 has too few column slices to keep
an H200's loads in flight; each K slice stores its float32 partial to a workspace and takes a ticket from a
per-tile counter; the last sums the partials in slice order (deterministic), runs the epilogue and resets
the counter. Workspace and counters are per device: two split-K launches must not run concurrently on
different streams. Programmatic dependent launch as in ``gemv`` (while a CUDA graph is captured): a
one-row program reads its first weight tile before it waits for the launch before (which wrote the
activations and their scales).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels import fp8_gemm as FG
from tritune.kernels.gemv import gemv
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8 as ref

MAX_M = 16            # more rows: fp8_gemm's tiles
SCALE_BLOCK = ref.BLOCK
ACTIVATIONS = FG.ACTIVATIONS
OUT_DTYPES = FG.OUT_DTYPES
Problem = FG.Problem  # M, N, K, a_scale, b_scale, bias, act, residual: fp8_gemm's problems


@triton.jit
def _row_sums(A, B, SB, pid_m, n0, offs_n, mask_n, k_lo, k_hi, s_am, s_ak, s_bk, s_bn, s_sbk, s_sbn,
              B_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              SBLOCK: tl.constexpr, PDL: tl.constexpr):
    """Σ_k x[k]·b[k, n] (·sb[k // 128]) over [k_lo, k_hi) for row pid_m of A, float32 (BLOCK_N,).

    The tiles are (J, BLOCK_N, 16), J = BLOCK_K / 16: 16 values along the contiguous dim a thread (one
    16-byte load), the threads of a warp along J (where K is contiguous: 512 contiguous bytes of one column),
    the warps along N, so that a thread's activation values serve several columns. The activations are
    loaded through the same (J, BLOCK_N, 16) pointers (stride 0 along N): one layout, no conversion through
    shared memory; the repeated loads and conversions fold into one. No loads are carried from one step
    to the next: triton carries an e4m3 tile as single bytes and packs them again (twice the instructions,
    three times the registers, sm90, triton 3.6); the loads in flight come from the other resident warps."""
    J: tl.constexpr = BLOCK_K // 16
    j16 = tl.arange(0, J)[:, None] * 16                                        # (J, 1)
    kk = j16 + tl.arange(0, 16)[None, :]                                       # (J, 16): a tile's K
    w_ptrs = B + offs_n.to(tl.int64)[None, :, None] * s_bn + (k_lo + kk).to(tl.int64)[:, None, :] * s_bk
    x_ptrs = A + pid_m.to(tl.int64) * s_am + (k_lo + kk).to(tl.int64)[:, None, :] * s_ak + 0 * offs_n[None, :, None]
    sb_col = SB + (n0 // SBLOCK) * s_sbn         # BLOCK_N divides 128: one scale block's column
    n_mask = mask_n[None, :, None]
    if EVEN_K:   # no K masks: 16-byte loads
        w = tl.load(w_ptrs, mask=n_mask, other=0.0)
    else:
        w = tl.load(w_ptrs, mask=n_mask & (k_lo + kk < k_hi)[:, None, :], other=0.0)
    if PDL:  # the weights are ours to read at once; the activations wait for the launch before this one
        tl.extra.cuda.gdc_wait()
    acc = _row_tile(tl.zeros((J, BLOCK_N), dtype=tl.float32), w, x_ptrs, sb_col, j16, kk, k_lo, k_hi, s_sbk,
                    B_MODE, EVEN_K, SBLOCK)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        d = (k - k_lo).to(tl.int64)
        if EVEN_K:
            w = tl.load(w_ptrs + d * s_bk, mask=n_mask, other=0.0)
        else:
            w = tl.load(w_ptrs + d * s_bk, mask=n_mask & (k + kk < k_hi)[:, None, :], other=0.0)
        acc = _row_tile(acc, w, x_ptrs + d * s_ak, sb_col, j16, kk, k, k_hi, s_sbk, B_MODE, EVEN_K, SBLOCK)
    return tl.sum(acc, axis=0)


@triton.jit
def _row_tile(acc, w, x_ptrs, sb_col, j16, kk, k0, k_hi, s_sbk, B_MODE: tl.constexpr, EVEN_K: tl.constexpr,
              SBLOCK: tl.constexpr):
    """acc + each thread's 16 products of the tile at K offset k0 summed (float32; e4m3 widens exactly)."""
    if EVEN_K:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=(k0 + kk < k_hi)[:, None, :], other=0.0)
    part = tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)
    if B_MODE == 2:   # a thread's 16 values lie in one 128-block of K: its sum takes the block's scale
        return acc + part * tl.load(sb_col + ((k0 + j16) // SBLOCK) * s_sbk, mask=k0 + j16 < k_hi, other=0.0)
    return acc + part


@triton.jit
def _rows_dot(A, B, SB, M, n0, offs_n, mask_n, k_lo, k_hi, s_am, s_ak, s_bk, s_bn, s_sbk, s_sbn,
              B_MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, SBLOCK: tl.constexpr, PDL: tl.constexpr):
    """A's rows (≤ BLOCK_M) times B's BLOCK_N columns over [k_lo, k_hi): fp16 dots, float32 (BLOCK_M, BLOCK_N)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    a_ptrs = A + offs_m.to(tl.int64)[:, None] * s_am + (k_lo + offs_k).to(tl.int64)[None, :] * s_ak
    b_ptrs = B + (k_lo + offs_k).to(tl.int64)[:, None] * s_bk + offs_n.to(tl.int64)[None, :] * s_bn
    sb_col = SB + (n0 // SBLOCK) * s_sbn
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            in_k = k + offs_k < k_hi
            a = tl.load(a_ptrs, mask=mask_m[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_k[:, None] & mask_n[None, :], other=0.0)
        # e4m3 -> fp16 is exact (one instruction a pair on sm90); the MMA's products are exact, its sums fp32
        if B_MODE == 2:   # a fresh product per K tile, times the tile's one scale (BLOCK_K divides 128)
            acc += tl.dot(a.to(tl.float16), b.to(tl.float16)) * tl.load(sb_col + (k // SBLOCK) * s_sbk)
        else:
            acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    return acc


@triton.jit
def _fp8_gemv_kernel(A, B, C, SA, SB, BIAS, RES, Work, Locks, M, N, KD, TILES,
                     s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_rm, s_rn, s_sa, s_sbk, s_sbn, s_bias,
                     A_ROW: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                     HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, SBLOCK: tl.constexpr, PDL: tl.constexpr):
    """C[m, n] = epilogue(sa[m] · sb[n] · Σ_k A[m, k] · B[k, n]) (block scales: sb inside the sum). Program
    (pid_n, pid_m, pid_k): columns pid_n·BLOCK_N.., rows pid_m·BLOCK_M.., K tiles pid_k·TILES.."""
    if PDL:  # the next launch (when it too is launched with PDL) may start now; it waits for us at its gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_lo = pid_k * TILES * BLOCK_K
    k_hi = tl.minimum(KD, k_lo + TILES * BLOCK_K)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    if BLOCK_M == 1:
        acc = _row_sums(A, B, SB, pid_m, n0, offs_n, mask_n, k_lo, k_hi, s_am, s_ak, s_bk, s_bn, s_sbk, s_sbn,
                        B_MODE, BLOCK_N, BLOCK_K, EVEN_K, SBLOCK, PDL)[None, :]
    else:
        acc = _rows_dot(A, B, SB, M, n0, offs_n, mask_n, k_lo, k_hi, s_am, s_ak, s_bk, s_bn, s_sbk, s_sbn,
                        B_MODE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SBLOCK, PDL)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        slab = M * N
        w_tile = Work + offs_m[:, None] * N + offs_n[None, :]
        tl.store(w_tile + pid_k * slab, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(Locks + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on arrival order
                acc += tl.load(w_tile + s * slab, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Locks + tile, 0)
            _epilogue(acc, C, SA, SB, BIAS, RES, offs_m, offs_n, mask_m, mask_n, s_cm, s_cn, s_rm, s_rn, s_sa,
                      s_sbn, s_bias, A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES)
    else:
        _epilogue(acc, C, SA, SB, BIAS, RES, offs_m, offs_n, mask_m, mask_n, s_cm, s_cn, s_rm, s_rn, s_sa, s_sbn,
                  s_bias, A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES)


@triton.jit
def _epilogue(acc, C, SA, SB, BIAS, RES, offs_m, offs_n, mask_m, mask_n, s_cm, s_cn, s_rm, s_rn, s_sa, s_sbn,
              s_bias, A_ROW: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
              HAS_RES: tl.constexpr):
    """fp8_gemm's epilogue: the row / tensor scale of A, the tensor / channel scale of B, bias, GELU (tanh
    form, as x·sigmoid(2z)), residual."""
    if A_ROW:
        acc *= tl.load(SA + offs_m * s_sa, mask=mask_m, other=0.0)[:, None]
    else:
        acc *= tl.load(SA)
    if B_MODE == 0:
        acc *= tl.load(SB)
    elif B_MODE == 1:
        acc *= tl.load(SB + offs_n * s_sbn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n * s_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GELU:
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-2.0 * z))
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    if HAS_RES:
        acc += tl.load(RES + rows * s_rm + offs_n[None, :] * s_rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + rows * s_cm + offs_n[None, :] * s_cn, acc.to(C.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------
class _Plan:
    __slots__ = ("m", "n", "empty", "extents", "cfg", "cfg_key", "grid", "ints", "work_numel", "locks", "kws",
                 "kws_pdl", "kernels", "consts", "consts_pdl")


_PLANS = K.PlanCache()
_locks = K.Counters(minimum=1024)
_workspace = K.Workspace()


def _check(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype) -> Problem:
    """fp8_gemm's checks (errors name the argument), and at most MAX_M rows; returns the problem."""
    FG.check_args(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype)
    if a.shape[0] > MAX_M:
        raise ValueError(f"a: {a.shape[0]} rows; fp8_gemv takes at most {MAX_M} (decode rows): "
                         "use tritune.kernels.fp8_gemm.fp8_gemm for more")
    return FG.problem_of(a, b, a_scale, b_scale, bias, activation, residual)


def _plan(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype, config) -> _Plan:
    problem = _check(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype)
    p = _Plan()
    m, n, kdim = problem.M, problem.N, problem.K
    p.m, p.n, p.empty = m, n, m == 0 or n == 0
    p.extents = tuple(K.extent(t) for t in (out, a, b, a_scale, b_scale, bias, residual))  # check_no_alias
    p.cfg = p.cfg_key = None
    if p.empty:
        return p
    p.cfg, p.cfg_key = SPEC.config_and_key(problem, out_dtype, config)
    c = p.cfg
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    k_tiles = max(1, triton.cdiv(kdim, bk))
    tiles = triton.cdiv(k_tiles, c["SPLIT_K"])   # K tiles a slice
    split = triton.cdiv(k_tiles, tiles)          # no empty slice
    p.grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    p.work_numel = split * m * n if split > 1 else 0
    p.locks = _locks(a.device, p.grid[0] * p.grid[1]) if split > 1 else None
    s_cm, s_cn = out.stride() if out is not None else (n, 1)
    s_rm, s_rn = residual.stride() if residual is not None else (0, 0)
    s_sa = a_scale.stride(0) if problem.a_scale == "row" else 0
    s_sb = {"tensor": (0, 0), "channel": (0, b_scale.stride(0)) if b_scale.dim() else (0, 0),
            "block": tuple(b_scale.stride())}[problem.b_scale]
    p.ints = (m, n, kdim, tiles, a.stride(0), a.stride(1), b.stride(0), b.stride(1), s_cm, s_cn, s_rm, s_rn,
              s_sa, *s_sb, bias.stride(0) if bias is not None else 0)
    p.kws = dict(A_ROW=problem.a_scale == "row", B_MODE=FG.B_SCALES.index(problem.b_scale),
                 HAS_BIAS=bias is not None, GELU=activation == "gelu_tanh", HAS_RES=residual is not None,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, EVEN_K=kdim > 0 and kdim % bk == 0,
                 SBLOCK=SCALE_BLOCK, PDL=False, num_warps=c["num_warps"], num_stages=c["num_stages"])
    K.launch_variants(p, a.device, _CONSTEXPRS)   # PDL in graphs, direct launches after the first
    return p


_CONSTEXPRS = K.constexpr_params(_fp8_gemv_kernel)   # what a direct launch passes after the runtime arguments
_meta = K.tensor_meta


def fp8_gemv(a, b, a_scale, b_scale, bias=None, *, activation: str = "none", residual=None, out=None,
             out_dtype=torch.bfloat16, config: dict | None = None):
    """(a·a_scale) @ (b·b_scale) [+ bias] [GELU] [+ residual] in ``out_dtype``, as ``fp8_gemm`` computes it,
    for a of at most 16 rows (decode). ``a`` (M, K) and ``b`` (K, N) e4m3, any strides (fastest with b's K
    contiguous: ``Fp8Weight.b``); ``a_scale`` float32 () or (M,); ``b_scale`` float32 (), (N,) or
    (ceil(K/128), ceil(N/128)); bias (N,) and residual (M, N) in ``out_dtype``; ``out`` may be ``residual``
    itself (in place)."""
    if out is not None and isinstance(out, torch.Tensor):
        out_dtype = out.dtype
    try:
        key = (_meta(a), _meta(b), _meta(a_scale), _meta(b_scale), _meta(bias), activation, _meta(residual),
               _meta(out), out_dtype, None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(a, b, a_scale, b_scale, bias, activation, residual, out,
                                                 out_dtype, config))
    if out is None:
        out = torch.empty((plan.m, plan.n), dtype=out_dtype, device=a.device)
    else:   # out=residual (the residual stream updated in place) is the one overlap allowed
        K.check_no_alias(out, (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("bias", bias),
                               ("residual", residual)), "residual", plan.extents)
    if plan.empty:
        return out
    if plan.work_numel:
        work, locks = _workspace(a.device, plan.work_numel), plan.locks
    else:
        work = locks = out
    args = (a, b, out, a_scale, b_scale, out if bias is None else bias, out if residual is None else residual,
            work, locks, *plan.ints)
    pdl = plan.kws_pdl is not None and K.pdl_now("fp8_gemv")
    K.launch_cached(_fp8_gemv_kernel, plan.kernels, plan.grid, args, plan.kws_pdl if pdl else plan.kws,
                    plan.consts_pdl if pdl else plan.consts, pdl, args[:9])
    return out


# ---------------------------------------------------------------------------------------------------
SPACE = K.Space(params={
    "BLOCK_M": [1, 16],                        # 1: a row a program on CUDA cores; 16: every row, fp16 tl.dot
    "BLOCK_N": [8, 16, 32, 64, 128, 256],
    "BLOCK_K": [16, 32, 64, 128, 256, 512, 1024],
    "SPLIT_K": [1, 2, 4, 8, 16],
    "num_warps": [1, 2, 4, 8],
    "num_stages": [1, 2, 3, 4, 5],
})


def tile_limits(c, p) -> str | None:
    """What every tile of this GEMV's loops keeps (fp8_qgemv's one-row loop too): within N and K, a program's
    columns in one 128-wide scale block, no more K slices than K tiles."""
    bn, bk = c["BLOCK_N"], c["BLOCK_K"]
    if bn > max(16, triton.next_power_of_2(p.N)):
        return "BLOCK_N larger than N"
    if bk > max(16, triton.next_power_of_2(p.K)):
        return "BLOCK_K larger than K"
    if p.b_scale == "block" and bn > SCALE_BLOCK:
        return "a program's columns must lie in one 128-wide scale block"
    if c["SPLIT_K"] > max(1, triton.cdiv(p.K, bk)):
        return "more K slices than K tiles"
    return None


def one_row_limits(c) -> str | None:
    """A one-row tile's weight bytes a thread: at most 128 (32 registers of e4m3 values, the float32 values
    beside them), at least 2."""
    bn, bk, threads = c["BLOCK_N"], c["BLOCK_K"], 32 * c["num_warps"]
    if bn * bk > 128 * threads:
        return f"{bn * bk // threads} weight bytes a thread per tile"
    if bn * bk < 2 * threads:
        return "idle threads"
    return None


def _constraint(c, p: Problem, dtype) -> str | None:
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    threads = 32 * c["num_warps"]
    if p.M > MAX_M:
        return f"M={p.M}: fp8_gemv takes at most {MAX_M} rows (fp8_gemm's tiles for more)"
    if bm == 1 and p.M > 4:
        return "one row per program reads the weight once per row (at most 4 rows)"
    why = tile_limits(c, p)
    if why is not None:
        return why
    if bm == 1:
        if c["num_stages"] != 1:
            return "BLOCK_M=1 pipelines no loads (num_stages=1)"
        return one_row_limits(c)
    if bn < 16:
        return "tl.dot takes BLOCK_N >= 16"
    if p.b_scale == "block" and bk > SCALE_BLOCK:
        return "a K tile must lie in one scale block (BLOCK_K <= 128)"
    if c["num_stages"] * (bm + bn) * bk * 2 > 200 * 1024:
        return "shared memory for the pipeline"
    if bn * bk * 2 > 256 * threads:   # the fp16 B operand: 64 registers a thread
        return f"{bn * bk * 2 // threads} bytes of fp16 weights a thread"
    if bm * bn < 4 * threads:
        return "idle warps"
    return None


SPACE.constraint = _constraint


def default_config(p: Problem, dtype) -> dict:
    """One row: 4 warps on a BLOCK_N x 512 tile of 8 KiB (64 weight bytes a thread: four 16-byte loads), 512
    along K (the engine's contiguous dim). More rows: 16-row fp16 dots on 32 x 128 tiles, 4 stages. Split-K
    until the programs fill four per SM (an N of 2048 needs it), while each slice keeps at least 64 · M
    of K (its float32 partials stay under 1/16 of its weight bytes)."""
    if p.M <= 1:
        bm, warps, stages = 1, 4, 1
        bk = min(512, max(16, triton.next_power_of_2(p.K)))
        bn = max(8, min(256, 8192 // bk))
        if p.b_scale == "block":
            bn = min(bn, SCALE_BLOCK)
    else:
        bm, bn, bk, warps, stages = 16, 32, 128, 4, 4
    bn = min(bn, max(16, triton.next_power_of_2(p.N)))
    bk = min(bk, max(16, triton.next_power_of_2(p.K)))
    while warps > 1 and (bn * bk < 2 * 32 * warps if bm == 1 else bm * bn < 4 * 32 * warps):
        warps //= 2
    programs = triton.cdiv(p.N, bn) * (max(p.M, 1) if bm == 1 else 1)
    k_tiles = triton.cdiv(p.K, bk)
    split = 1
    while split < 16 and programs * split < 4 * K.num_sms() and 2 * split <= k_tiles \
            and p.K // (2 * split) >= 64 * max(p.M, 1):
        split *= 2
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
           "num_stages": stages}
    why = SPACE.constraint(cfg, p, dtype)
    assert why is None, f"fp8_gemv: default {cfg} invalid for {p}: {why}"
    return cfg


def borrow(c: dict, p: Problem, dtype) -> str | None:
    """A one-row tile tuned at M=1 would read the weight once per row at M=2..4: not borrowed there."""
    if c["BLOCK_M"] < p.M:
        return f"BLOCK_M={c['BLOCK_M']} would read the weight {p.M} times"
    return None


def cost(p: Problem, dtype) -> K.Cost:
    """The e4m3 weight and activations, their scales, bias, residual and output: each once."""
    e = torch.finfo(dtype).bits // 8
    sb = {"tensor": 1, "channel": p.N, "block": triton.cdiv(p.K, SCALE_BLOCK) * triton.cdiv(p.N, SCALE_BLOCK)}
    scales = 4 * (sb[p.b_scale] + (p.M if p.a_scale == "row" else 1))
    return K.Cost(flops=2.0 * p.M * p.N * p.K,
                  bytes=float(p.K * p.N + p.M * p.K + scales + e * (p.N * p.bias + p.M * p.N * (1 + p.residual))))


def problems(max_elems: int):
    """M up to 16, N up to sqrt(max_elems), K past several 128-blocks; every scale form and epilogue."""
    from hypothesis import strategies as st

    side = max(2, int(math.sqrt(max_elems)))
    return st.builds(Problem, S.sizes(MAX_M), S.sizes(side), S.sizes(max(side, 400)),
                     st.sampled_from(FG.A_SCALES), st.sampled_from(FG.B_SCALES), st.booleans(),
                     st.sampled_from(ACTIVATIONS), st.booleans())


def _fp8_gemm_peer(c: K.Case):
    """tritune's FP8 path before this kernel: fp8_gemm's tl.dot tiles (what Fp8Ops ran for every M)."""
    return lambda: FG.fp8_gemm(*c.args, **c.kwargs)


def _bf16_gemv_peer(c: K.Case):
    """tritune's bf16 GEMV on the same shapes (the bf16 decode this kernel is to beat), its weight in the
    layout the engine keeps dense weights in, (K, N) row-major: the e4m3 codes as bf16 (timing only), bias
    and residual as they are."""
    a, b, _, _, bias = c.args
    dt = c.kwargs["out_dtype"]
    bh = b.to(dt).contiguous()
    ah = a.to(dt)
    act = None if c.kwargs["activation"] == "none" else c.kwargs["activation"]
    return lambda: gemv(ah, bh, bias, activation=act, residual=c.kwargs["residual"])


def _bad_inputs(device):
    a, sa = ref.quantize_rows(torch.randn(8, 64, device=device))
    b, sb = ref.quantize_channels(torch.randn(64, 32, device=device))
    big, sbig = ref.quantize_rows(torch.randn(17, 64, device=device))
    return [
        ("bf16 a", lambda: fp8_gemv(a.to(torch.bfloat16), b, sa, sb), TypeError),
        ("mismatched K", lambda: fp8_gemv(a, b[:32], sa, sb), ValueError),
        ("more than 16 rows", lambda: fp8_gemv(big, b, sbig, sb), ValueError),
        ("a_scale of the wrong shape", lambda: fp8_gemv(a, b, sa[:3], sb), ValueError),
        ("b_scale of the wrong shape", lambda: fp8_gemv(a, b, sa, sb[:5]), ValueError),
        ("float16 scales", lambda: fp8_gemv(a, b, sa.half(), sb), TypeError),
        ("unknown activation", lambda: fp8_gemv(a, b, sa, sb, activation="relu"), ValueError),
        ("fp32 output", lambda: fp8_gemv(a, b, sa, sb, out_dtype=torch.float32), TypeError),
        ("bias of the wrong length", lambda: fp8_gemv(a, b, sa, sb, torch.zeros(5, dtype=torch.bfloat16,
                                                                               device=device)), ValueError),
        ("residual of the wrong shape", lambda: fp8_gemv(a, b, sa, sb, residual=torch.zeros(
            8, 5, dtype=torch.bfloat16, device=device)), ValueError),
        ("out overlapping a", lambda: fp8_gemv(a, b, sa, sb, out=a.view(torch.bfloat16)[:, :32]), ValueError),
    ]


# Llama-3.2-1B's decode linears, (K, N): qkv (32 + 2 x 8 heads of 64), o, gate/up, down, the LM head
LLAMA_1B = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)]

SPEC = K.register(K.KernelSpec(
    name="fp8_gemv",
    description="scaled e4m3 GEMV for decode (M <= 16): fp8_gemm's scales and epilogues, the weight streamed "
                "in 16-byte loads, float32 sums (CUDA cores for one row, fp16 tl.dot for more), split-K",
    run=fp8_gemv,
    reference=FG.reference,
    make_inputs=FG.make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=FG.bucket,
    cost=cost,
    problem_of=FG.problem_of,
    standard_problems=[Problem(m, n, k, "row", bs) for m in (1, 8) for bs in ("channel", "block")
                       for k, n in LLAMA_1B],
    small_problems=[Problem(1, 200, 300, "row", "channel", True, "gelu_tanh", True), Problem(5, 40, 96),
                    Problem(8, 130, 260, "tensor", "block", True, "none", True)],
    dtypes=OUT_DTYPES,
    layouts=("contiguous", "transposed", "sliced"),
    vendor=FG.SPEC.vendor,
    vendor_name="torch._scaled_mm (cuBLASLt)",
    peers={"tritune_fp8_gemm": _fp8_gemm_peer, "tritune_bf16_gemv": _bf16_gemv_peer},
    bad_inputs=_bad_inputs,
    borrow=borrow,
))
