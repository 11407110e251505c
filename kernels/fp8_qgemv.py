"""FP8 (W8A8) decode linear in one launch: per-token e4m3 quantization of the activations inside the GEMV.

``fp8_quant`` (the row's dynamic e4m3 quantization, after RMSNorm or of silu(gate)·up) followed by
``fp8_gemv`` (the scaled e4m3 GEMV) is two launches a linear; at batch 1 the quantizer's launches cost about a
fifth of a token. This kernel takes the bf16/fp16 rows and computes the same numbers in one: each program
first works out its row's statistics over the whole row, as ``fp8_quant``'s kernel does (float32, the same
formulas: RMSNorm's rstd = 1 / sqrt(Σx² / K + eps), y = x·rstd·w, or y = g / (1 + exp(-g))·u; then
scale = max(amax|y| / 448, MIN_SCALE)); then ``fp8_gemv``'s one-row loop, the activation tile recomputed
from x on the way: y, q = e4m3(clamp(y / scale, ±448)), widened back to float32 and multiplied by the
e4m3 weights. The epilogue multiplies the float32 sums by the row's scale and the channel / tensor scale
(block scales: per 128 of K inside the sum), adds bias, GELU, residual.

Layout of the loop (``fp8_gemv``'s BLOCK_M = 1): (J, BLOCK_N, 16) tiles, J = BLOCK_K / 16, 16 e4m3 weights
a thread along B's contiguous dim (one 16-byte load where K is contiguous: ``Fp8Weight.b``), threads along
J, warps along N. The activations are read through the same (J, BLOCK_N, 16) pointers with stride 0 along
N: one layout, no conversion through shared memory; the repeated loads and their quantization fold into
one per K element a thread. The row statistics read the row again from L2 in every program (a K slice
too): its cost grows with the programs, which is why the default splits K less than ``fp8_gemv``'s.

Split-K (``SPLIT_K > 1``): each slice stores its float32 partial, takes a ticket from a per-tile counter;
the last sums the partials in slice order (deterministic) and runs the epilogue (every slice computed the
same scale). Workspace and counters are per device. Programmatic dependent launch in CUDA graphs: a program
reads its first weight tile, then waits for the launch before (which wrote x) with ``gdc_wait``.

Numbers: the codes are fp8_quant's where the float64 reference's quotient y / scale is not within float32's
last bits of an e4m3 rounding midpoint (``references.fp8.midpoint_distance``); :func:`make_inputs` keeps
its rows clear of those (:func:`clear_of_ties`), so the contract compares code for code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels import fp8_gemm as FG
from tritune.kernels import fp8_gemv as FGV
from tritune.kernels import fp8_quant as FQ
from tritune.kernels.gemv import gemv
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_fp8
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8 as ref

E4M3 = torch.float8_e4m3fn
MAX_M = FGV.MAX_M
SCALE_BLOCK = ref.BLOCK
MODES = ("none", "rms", "swiglu")
ACTIVATIONS = FG.ACTIVATIONS
DTYPES = FG.OUT_DTYPES        # x and the output
TIE_MARGIN = 2.0**-12         # clear_of_ties: quotients this close to a midpoint (in code steps) are moved


@triton.jit
def _y(xp, wp, up, mask, rstd, MODE: tl.constexpr, HAS_W: tl.constexpr, EVEN: tl.constexpr):
    """fp8_quant's y (float32) at x pointers ``xp`` of one row: x (MODE 0), x·rstd·w (RMSNorm, MODE 1, norm
    weight at ``wp``), silu(gate)·up (MODE 2, the up value ``up`` elements after its gate); 0 where masked
    (EVEN: no mask)."""
    if EVEN:
        x = tl.load(xp).to(tl.float32)
    else:
        x = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    if MODE == 2:
        if EVEN:
            u = tl.load(xp + up).to(tl.float32)
        else:
            u = tl.load(xp + up, mask=mask, other=0.0).to(tl.float32)
        y = x / (1.0 + tl.exp(-x)) * u
    elif MODE == 1:
        y = x * rstd
        if HAS_W:
            if EVEN:
                y = y * tl.load(wp).to(tl.float32)
            else:
                y = y * tl.load(wp, mask=mask, other=0.0).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _row_scale(Xrow, W, KD, eps, s_up, s_xk, s_w, MODE: tl.constexpr, HAS_W: tl.constexpr, BLOCK_S: tl.constexpr,
               MIN_SCALE: tl.constexpr):
    """The row's (scale, rstd) as fp8_quant's kernel computes them: the mean of squares (RMSNorm), then
    scale = max(max|y| / 448, MIN_SCALE) over the whole row. rstd is ``eps`` (unused) outside RMSNorm."""
    offs = tl.arange(0, BLOCK_S)
    rstd = eps
    if MODE == 1:
        s2 = tl.zeros((BLOCK_S,), dtype=tl.float32)
        for k0 in range(0, KD, BLOCK_S):
            k = k0 + offs
            x = tl.load(Xrow + k.to(tl.int64) * s_xk, mask=k < KD, other=0.0).to(tl.float32)
            s2 += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(s2, axis=0) / KD + eps)
    amax = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_S):
        k = k0 + offs
        y = _y(Xrow + k.to(tl.int64) * s_xk, W + k.to(tl.int64) * s_w, s_up, k < KD, rstd, MODE, HAS_W, False)
        amax = tl.maximum(amax, tl.where(k < KD, tl.abs(y), 0.0))
    return tl.maximum(tl.max(amax, axis=0) / 448.0, MIN_SCALE), rstd


@triton.jit
def _row_tile(acc, w, xp, wp, up, kmask, rstd, scale, sb_col, j16, k0, k_hi, s_sbk, MODE: tl.constexpr,
              HAS_W: tl.constexpr, B_MODE: tl.constexpr, EVEN_K: tl.constexpr, SBLOCK: tl.constexpr):
    """acc + each thread's 16 products of the tile at K offset k0: the activations quantized as fp8_quant
    quantizes them (e4m3, widened back exactly), times the e4m3 weights, summed in float32."""
    y = _y(xp, wp, up, kmask, rstd, MODE, HAS_W, EVEN_K)
    q = tl.clamp(y / scale, -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
    part = tl.sum(w.to(tl.float32) * q, axis=2)
    if B_MODE == 2:   # a thread's 16 values lie in one 128-block of K: its sum takes the block's scale
        return acc + part * tl.load(sb_col + ((k0 + j16) // SBLOCK) * s_sbk, mask=k0 + j16 < k_hi, other=0.0)
    return acc + part


@triton.jit
def _row_sums(Xrow, W, B, SB, n0, offs_n, mask_n, k_lo, k_hi, KD, eps, s_up, s_xk, s_w, s_bk, s_bn, s_sbk, s_sbn,
              MODE: tl.constexpr, HAS_W: tl.constexpr, B_MODE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, EVEN_K: tl.constexpr, SBLOCK: tl.constexpr,
              MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    """(Σ_k q[k]·b[k, n] (·sb[k // 128]) over [k_lo, k_hi) float32 (BLOCK_N,), the row's scale)."""
    J: tl.constexpr = BLOCK_K // 16
    j16 = tl.arange(0, J)[:, None] * 16                                        # (J, 1)
    kk = j16 + tl.arange(0, 16)[None, :]                                       # (J, 16): a tile's K
    w_ptrs = B + offs_n.to(tl.int64)[None, :, None] * s_bn + (k_lo + kk).to(tl.int64)[:, None, :] * s_bk
    kx = (k_lo + kk).to(tl.int64)[:, None, :] + 0 * offs_n[None, :, None]      # the same K for every column
    x_ptrs = Xrow + kx * s_xk
    n_ptrs = W + kx * s_w
    sb_col = SB + (n0 // SBLOCK) * s_sbn         # BLOCK_N divides 128: one scale block's column
    n_mask = mask_n[None, :, None]
    if EVEN_K:   # no K masks: 16-byte loads
        w = tl.load(w_ptrs, mask=n_mask, other=0.0)
    else:
        w = tl.load(w_ptrs, mask=n_mask & (k_lo + kk < k_hi)[:, None, :], other=0.0)
    if PDL:  # the weights are ours to read at once; x waits for the launch before this one
        tl.extra.cuda.gdc_wait()
    scale, rstd = _row_scale(Xrow, W, KD, eps, s_up, s_xk, s_w, MODE, HAS_W, BLOCK_S, MIN_SCALE)
    acc = _row_tile(tl.zeros((J, BLOCK_N), dtype=tl.float32), w, x_ptrs, n_ptrs, s_up,
                    (k_lo + kk < k_hi)[:, None, :], rstd, scale, sb_col, j16, k_lo, k_hi, s_sbk,
                    MODE, HAS_W, B_MODE, EVEN_K, SBLOCK)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        d = (k - k_lo).to(tl.int64)
        if EVEN_K:
            w = tl.load(w_ptrs + d * s_bk, mask=n_mask, other=0.0)
        else:
            w = tl.load(w_ptrs + d * s_bk, mask=n_mask & (k + kk < k_hi)[:, None, :], other=0.0)
        acc = _row_tile(acc, w, x_ptrs + d * s_xk, n_ptrs + d * s_w, s_up, (k + kk < k_hi)[:, None, :], rstd,
                        scale, sb_col, j16, k, k_hi, s_sbk, MODE, HAS_W, B_MODE, EVEN_K, SBLOCK)
    return tl.sum(acc, axis=0), scale


@triton.jit
def _epilogue(acc, scale, C, SB, BIAS, RES, row, offs_n, mask_n, s_cm, s_cn, s_rm, s_rn, s_sbn, s_bias,
              B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr, HAS_RES: tl.constexpr):
    """fp8_gemv's epilogue for one row: the row's scale, the tensor / channel scale of B, bias, GELU (tanh
    form, as x·sigmoid(2z)), residual."""
    acc *= scale
    if B_MODE == 0:
        acc *= tl.load(SB)
    elif B_MODE == 1:
        acc *= tl.load(SB + offs_n * s_sbn, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n * s_bias, mask=mask_n, other=0.0).to(tl.float32)
    if GELU:
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-2.0 * z))
    if HAS_RES:
        acc += tl.load(RES + row * s_rm + offs_n * s_rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(C + row * s_cm + offs_n * s_cn, acc.to(C.dtype.element_ty), mask=mask_n)


@triton.jit
def _fp8_qgemv_kernel(X, W, B, C, SB, BIAS, RES, Work, Locks, M, N, KD, TILES, eps, s_up,
                      s_xm, s_xk, s_w, s_bk, s_bn, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn, s_bias,
                      MODE: tl.constexpr, HAS_W: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      GELU: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_S: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, SBLOCK: tl.constexpr,
                      MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    """C[m, n] = epilogue(scale_m · sb[n] · Σ_k e4m3(y[m, k] / scale_m) · B[k, n]). Program (pid_n, pid_m,
    pid_k): columns pid_n·BLOCK_N.., row pid_m, K tiles pid_k·TILES.."""
    if PDL:  # the next launch (when it too is launched with PDL) may start now; it waits for us at its gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_lo = pid_k * TILES * BLOCK_K
    k_hi = tl.minimum(KD, k_lo + TILES * BLOCK_K)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    row = pid_m.to(tl.int64)
    acc, scale = _row_sums(X + row * s_xm, W, B, SB, n0, offs_n, mask_n, k_lo, k_hi, KD, eps, s_up, s_xk, s_w, s_bk,
                           s_bn, s_sbk, s_sbn, MODE, HAS_W, B_MODE, BLOCK_N, BLOCK_K, BLOCK_S, EVEN_K, SBLOCK,
                           MIN_SCALE, PDL)
    if SPLIT_K > 1:
        slab = M * N
        w_tile = Work + row * N + offs_n
        tl.store(w_tile + pid_k * slab, acc, mask=mask_n)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(Locks + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on arrival order
                acc += tl.load(w_tile + s * slab, mask=mask_n, other=0.0, cache_modifier=".cg")
            tl.store(Locks + tile, 0)
            _epilogue(acc, scale, C, SB, BIAS, RES, row, offs_n, mask_n, s_cm, s_cn, s_rm, s_rn, s_sbn, s_bias,
                      B_MODE, HAS_BIAS, GELU, HAS_RES)
    else:
        _epilogue(acc, scale, C, SB, BIAS, RES, row, offs_n, mask_n, s_cm, s_cn, s_rm, s_rn, s_sbn, s_bias,
                  B_MODE, HAS_BIAS, GELU, HAS_RES)


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    M: int
    N: int
    K: int                      # the GEMV's K: x has 2K columns under swiglu
    mode: str = "none"          # "none" | "rms" | "swiglu": what is quantized (fp8_quant's modes)
    b_scale: str = "channel"    # "tensor" | "channel" | "block"
    bias: bool = False
    act: str = "none"
    residual: bool = False
    weight: bool = True         # RMSNorm's weight given


class _Plan:
    __slots__ = ("m", "n", "empty", "extents", "cfg", "cfg_key", "grid", "ints", "work_numel", "locks", "kws",
                 "kws_pdl", "kernels", "consts", "consts_pdl")


_PLANS = K.PlanCache()
_locks = K.Counters(minimum=1024)
_workspace = K.Workspace()
_ONE = torch.ones(())   # an A scale for fp8_gemm's checks of b_scale (its form and dtype)


def _check_x(x, norm, swiglu) -> FQ.Problem:
    """x's, norm's and swiglu's checks (fp8_quant's, and at most MAX_M rows, RMSNorm only)."""
    K.check_tensor("x", x, ndim=2, dtypes=DTYPES)
    K.check_device("x", x)
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu: expected a bool, got {type(swiglu).__name__}")
    if norm is not None and (not isinstance(norm, tuple) or not norm or norm[0] != "rms"):
        raise ValueError(f"norm: expected None or ('rms', weight or None, eps), got {norm!r}")
    if swiglu and norm is not None:
        raise ValueError("norm: not with swiglu=True (the norm goes before the gate/up projection)")
    if swiglu and x.shape[1] % 2:
        raise ValueError(f"x: swiglu needs an even number of columns ([gate | up]), got {x.shape[1]}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"x: {x.shape[0]} rows; fp8_qgemv takes at most {MAX_M} (decode rows): use "
                         "tritune.kernels.fp8_quant.fp8_quant then tritune.kernels.fp8_gemm.fp8_gemm for more")
    return FQ.problem_of(x, norm=norm, swiglu=swiglu)   # the norm's weight (length, dtype, device) and eps


def _check(x, b, b_scale, bias, norm, swiglu, activation, residual, out) -> Problem:
    """Every argument's checks (errors name it: fp8_quant's for x and norm, fp8_gemm's for b_scale)."""
    q = _check_x(x, norm, swiglu)
    m, kdim = q.M, q.N
    K.check_tensor("b", b, ndim=2, dtypes=(E4M3,))
    for name, t in (("b", b), ("b_scale", b_scale)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
    if b.shape[0] != kdim:
        raise ValueError(f"b: expected {kdim} rows ({'half of ' if swiglu else ''}x's columns), got shape "
                         f"{tuple(b.shape)}")
    n = b.shape[1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if bias is not None:
        K.check_vec("bias", bias, n, x.dtype, x.device, "x")
    if residual is not None:
        K.check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,))
        if tuple(residual.shape) != (m, n):
            raise ValueError(f"residual: expected shape {(m, n)}, got {tuple(residual.shape)}")
        if residual.device != x.device:
            raise ValueError(f"residual: on {residual.device}, but x is on {x.device}")
    if out is not None:
        K.check_out(out, (m, n), x.dtype, x.device)
    sb = FG.problem_of(x.narrow(1, 0, kdim), b, _ONE, b_scale).b_scale
    return Problem(m, n, kdim, q.mode, sb, bias is not None, activation, residual is not None,
                   q.weight if q.mode == "rms" else True)


def problem_of(x, b, b_scale, bias=None, *, norm=None, swiglu=False, activation="none", residual=None,
               **_) -> Problem:
    return _check(x, b, b_scale, bias, norm, swiglu, activation, residual, None)


def _stats_block(kdim: int, warps: int) -> int:
    """The row statistics' tile: 8 elements (16 bytes of bf16) a thread, at most the row."""
    return min(max(16, triton.next_power_of_2(max(kdim, 1))), 256 * warps)


def _plan(x, b, b_scale, bias, norm, swiglu, activation, residual, out, config) -> _Plan:
    problem = _check(x, b, b_scale, bias, norm, swiglu, activation, residual, out)
    if dev.interpreted():
        interpret_fp8.require("fp8_qgemv")
    w = norm[1] if norm is not None else None
    p = _Plan()
    m, n, kdim = problem.M, problem.N, problem.K
    p.m, p.n, p.empty = m, n, m == 0 or n == 0
    p.extents = tuple(K.extent(t) for t in (out, x, b, b_scale, bias, residual, w))   # check_no_alias
    p.cfg = p.cfg_key = None
    if p.empty:
        return p
    p.cfg, p.cfg_key = SPEC.config_and_key(problem, x.dtype, config)
    c = p.cfg
    bn, bk = c["BLOCK_N"], c["BLOCK_K"]
    k_tiles = max(1, triton.cdiv(kdim, bk))
    tiles = triton.cdiv(k_tiles, c["SPLIT_K"])   # K tiles a slice
    split = triton.cdiv(k_tiles, tiles)          # no empty slice
    p.grid = (triton.cdiv(n, bn), m, split)
    p.work_numel = split * m * n if split > 1 else 0
    p.locks = _locks(x.device, p.grid[0] * p.grid[1]) if split > 1 else None
    s_cm, s_cn = out.stride() if out is not None else (n, 1)
    s_rm, s_rn = residual.stride() if residual is not None else (0, 0)
    s_sb = tuple(b_scale.stride()) if problem.b_scale == "block" else \
        (0, b_scale.stride(0)) if problem.b_scale == "channel" else (0, 0)
    eps = float(norm[2]) if norm is not None else 0.0
    p.ints = (m, n, kdim, tiles, eps, kdim * x.stride(1) if swiglu else 0, x.stride(0), x.stride(1), w.stride(0) if w is not None else 0, b.stride(0),
              b.stride(1), s_cm, s_cn, s_rm, s_rn, *s_sb, bias.stride(0) if bias is not None else 0)
    p.kws = dict(MODE=MODES.index(problem.mode), HAS_W=w is not None, B_MODE=FG.B_SCALES.index(problem.b_scale),
                 HAS_BIAS=bias is not None, GELU=activation == "gelu_tanh", HAS_RES=residual is not None,
                 BLOCK_N=bn, BLOCK_K=bk, BLOCK_S=_stats_block(kdim, c["num_warps"]), SPLIT_K=split,
                 EVEN_K=kdim > 0 and kdim % bk == 0, SBLOCK=SCALE_BLOCK, MIN_SCALE=ref.MIN_SCALE, PDL=False,
                 num_warps=c["num_warps"], num_stages=c["num_stages"])
    K.launch_variants(p, x.device, _CONSTEXPRS)   # PDL in graphs, direct launches after the first
    return p


_CONSTEXPRS = K.constexpr_params(_fp8_qgemv_kernel)   # what a direct launch passes after the runtime arguments
_meta = K.tensor_meta


def _key(x, b, b_scale, bias, norm, swiglu, activation, residual, out, config):
    """The launch plan's key: every tensor's metadata and every other argument (None: not cacheable)."""
    if not isinstance(swiglu, bool):
        return None
    try:
        nk = None if norm is None else tuple(_meta(t) if isinstance(t, torch.Tensor) or t is None else t
                                            for t in norm)
        key = (_meta(x), _meta(b), _meta(b_scale), _meta(bias), nk, swiglu, activation, _meta(residual),
               _meta(out), None if config is None else tuple(config.items()))
        hash(key)
    except (AttributeError, TypeError):
        return None
    return key


def fp8_qgemv(x, b, b_scale, bias=None, *, norm=None, swiglu: bool = False, activation: str = "none",
              residual=None, out=None, config: dict | None = None):
    """``fp8_quant(x, norm=norm, swiglu=swiglu)`` then ``fp8_gemv`` of its rows and scales with
    (b · b_scale) [+ bias] [GELU] [+ residual], in one launch, in x's dtype. ``x`` (M, K) bf16/fp16, M <= 16,
    any strides (swiglu=True: (M, 2K), [gate | up]); ``norm``: None or ("rms", weight (K,) or None, eps);
    ``b`` (K, N) e4m3 (fastest K contiguous: ``Fp8Weight.b``); ``b_scale`` float32 (), (N,) or
    (ceil(K/128), ceil(N/128)); bias (N,), residual (M, N) in x's dtype; ``out`` may be ``residual`` itself
    (in place)."""
    key = _key(x, b, b_scale, bias, norm, swiglu, activation, residual, out, config)
    plan = _PLANS.get_or_make(key, lambda: _plan(x, b, b_scale, bias, norm, swiglu, activation, residual, out,
                                                 config))
    w = norm[1] if norm is not None else None
    if out is None:
        out = torch.empty((plan.m, plan.n), dtype=x.dtype, device=x.device)
    else:   # out=residual (the residual stream updated in place) is the one overlap allowed
        K.check_no_alias(out, (("x", x), ("b", b), ("b_scale", b_scale), ("bias", bias), ("residual", residual),
                               ("norm weight", w)), "residual", plan.extents)
    if plan.empty:
        return out
    if plan.work_numel:
        work, locks = _workspace(x.device, plan.work_numel), plan.locks
    else:
        work = locks = out
    args = (x, x if w is None else w, b, out, b_scale, out if bias is None else bias,
            out if residual is None else residual, work, locks, *plan.ints)
    pdl = plan.kws_pdl is not None and K.pdl_now("fp8_qgemv")
    K.launch_cached(_fp8_qgemv_kernel, plan.kernels, plan.grid, args, plan.kws_pdl if pdl else plan.kws,
                    plan.consts_pdl if pdl else plan.consts, pdl, args[:9])
    return out


# ---------------------------------------------------------------------------------------------------
SPACE = K.Space(params={
    "BLOCK_N": [8, 16, 32, 64, 128, 256],
    "BLOCK_K": [16, 32, 64, 128, 256, 512, 1024, 2048],   # 2048: 4 warps along K (16 x 32 x 4)
    "SPLIT_K": [1, 2, 4, 8, 16],
    "num_warps": [1, 2, 4, 8],
    "num_stages": [1],             # no loads carried across steps (fp8_gemv's one-row loop)
})


def _constraint(c, p: Problem, dtype) -> str | None:
    if p.M > MAX_M:
        return f"M={p.M}: fp8_qgemv takes at most {MAX_M} rows (fp8_quant, then fp8_gemm's tiles for more)"
    return FGV.tile_limits(c, p) or FGV.one_row_limits(c)   # fp8_gemv's one-row loop, its tiles' limits


SPACE.constraint = _constraint


def default_config(p: Problem, dtype) -> dict:
    """128 weight bytes a thread (BLOCK_N x BLOCK_K = 4096 x warps): each activation quantized serves twice
    fp8_gemv's 4 columns a thread (sm90, triton 3.6, RMSNorm: 4.45 SASS instructions a weight byte against
    6.05 at fp8_gemv's 16 x 512, 96 registers). 512 along K (the engine's contiguous dim); under SwiGLU
    2048 x 8, a warp's threads and the warps all along K: no activation (an exp and two divisions) computed
    twice in a program. 4 warps for one row, 8 for more (fewer programs reading the row for its statistics).
    Split-K until the programs fill four per SM (one under SwiGLU, whose statistics cost most) while each
    slice keeps at least 512 of K: every slice computes the whole row's statistics."""
    warps = 8 if p.M > 1 else 4
    bk = min(2048 if p.mode == "swiglu" else 512, max(16, triton.next_power_of_2(p.K)))
    bn = max(8, min(256, 128 * 32 * warps // bk))
    if p.b_scale == "block":
        bn = min(bn, SCALE_BLOCK)
    bn = min(bn, max(16, triton.next_power_of_2(p.N)))
    while warps > 1 and bn * bk < 2 * 32 * warps:
        warps //= 2
    programs = triton.cdiv(p.N, bn) * max(p.M, 1)
    target = (1 if p.mode == "swiglu" else 4) * K.num_sms()
    k_tiles = triton.cdiv(p.K, bk)
    split = 1
    while split < 16 and programs * split < target and 2 * split <= k_tiles and p.K // (2 * split) >= 512:
        split *= 2
    cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps, "num_stages": 1}
    why = SPACE.constraint(cfg, p, dtype)
    assert why is None, f"fp8_qgemv: default {cfg} invalid for {p}: {why}"
    return cfg


def bucket(p: Problem) -> dict:
    return {"M": triton.next_power_of_2(p.M), "N": p.N, "K": p.K, "mode": p.mode, "b_scale": p.b_scale,
            "epilogue": int(p.bias) + 2 * int(p.act != "none") + 4 * int(p.residual)}


def cost(p: Problem, dtype) -> K.Cost:
    """The e4m3 weight and its scales, x (2K columns under SwiGLU) and the norm weight, bias, residual and
    output: each once."""
    e = torch.finfo(dtype).bits // 8
    sb = {"tensor": 1, "channel": p.N, "block": triton.cdiv(p.K, SCALE_BLOCK) * triton.cdiv(p.N, SCALE_BLOCK)}
    x_cols = 2 * p.K if p.mode == "swiglu" else p.K
    w = p.K if p.mode == "rms" and p.weight else 0
    return K.Cost(flops=2.0 * p.M * p.N * p.K,
                  bytes=float(p.K * p.N + 4 * sb[p.b_scale] + e * (p.M * x_cols + w + p.N * p.bias
                                                                  + p.M * p.N * (1 + p.residual))))


def problems(max_elems: int):
    """M up to 16, N up to sqrt(max_elems), K past several 128-blocks; every mode, scale form, epilogue."""
    from hypothesis import strategies as st

    side = max(2, int(math.sqrt(max_elems)))
    return st.builds(Problem, S.sizes(MAX_M), S.sizes(side), S.sizes(max(side, 400)), st.sampled_from(MODES),
                     st.sampled_from(FG.B_SCALES), st.booleans(), st.sampled_from(ACTIVATIONS), st.booleans(),
                     st.booleans())


def clear_of_ties(x: torch.Tensor, norm=None, swiglu: bool = False, margin: float = TIE_MARGIN) -> torch.Tensor:
    """A contiguous copy of ``x`` whose few elements with a quotient y / scale (float64) within ``margin``
    code steps of an e4m3 rounding midpoint (``references.fp8.midpoint_distance``) are moved one ulp of x's
    dtype away from zero (the up value under SwiGLU; y is linear in it), until none is. There the float32
    kernel and the float64 reference may both round right and differ by a code; one flipped code moves an
    output by up to 1/16 of its term, over fp16's tolerance at small K. The row's largest value (quotient
    448) is never near a midpoint: it is not moved and stays the largest."""
    x = x.contiguous().clone()
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    for _ in range(8):
        near = ref.midpoint_distance(ref.quotients(x, norm, swiglu)) < margin
        if not bool(near.any()):
            break
        bits = x.view(torch.int16)[:, k:] if swiglu else x.view(torch.int16)
        bits[near] += 1     # the magnitude one ulp up (sign-magnitude bits)
    return x


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """fp8_quant's rows (an outlier column a row; RMSNorm's weight or SwiGLU's [gate | up]), kept clear of
    e4m3 rounding midpoints (:func:`clear_of_ties`); fp8_gemm's weights: B stored (N, K) and passed as its
    (K, N) transpose (``Fp8Weight.b``), "transposed" the (K, N) row-major form (and x column-major)."""
    xc = FQ.make_inputs(FQ.Problem(p.M, p.K, p.mode, p.weight), dtype, device, seed, layout)
    x, kwargs = xc.args[0], dict(xc.kwargs)
    x.copy_(clear_of_ties(x, kwargs.get("norm"), kwargs.get("swiglu", False)))   # in place: x keeps its layout
    w = S.randn((p.K, p.N), torch.float32, device, seed + 11, scale=1.0 / math.sqrt(max(p.K, 1)))
    quant = {"tensor": ref.quantize_tensor, "channel": ref.quantize_channels, "block": ref.quantize_blocks}
    b, sb = quant[p.b_scale](w)
    if layout != "transposed":
        b = b.t().contiguous().t()
    bias = S.randn((p.N,), dtype, device, seed + 12, scale=0.5) if p.bias else None
    res = S.randn((p.M, p.N), dtype, device, seed + 13) if p.residual else None
    kwargs.update(activation=p.act, residual=res)
    return K.Case(args=(x, b, sb, bias), kwargs=kwargs, out=torch.empty((p.M, p.N), dtype=dtype, device=device))


def reference(x, b, b_scale, bias=None, norm=None, swiglu=False, activation="none", residual=None, **_):
    return ref.fp8_qgemv(x, b, b_scale, bias, norm, swiglu, activation, residual)


def _quant(c: K.Case):
    x = c.args[0]
    return lambda out=None: FQ.fp8_quant(x, norm=c.kwargs.get("norm"), swiglu=c.kwargs.get("swiglu", False),
                                         out=out)


def _vendor(c: K.Case):
    """fp8_quant, then torch._scaled_mm (cuBLASLt) on its rows and scales (fp8_gemm's vendor forms), then
    GELU and the residual as torch ops where the problem has them."""
    x, b, sb, bias = c.args
    act, res = c.kwargs["activation"], c.kwargs["residual"]
    quant = _quant(c)
    a, sa = quant()
    mm = FG.SPEC.vendor(K.Case(args=(a, b, sa, sb, bias),
                               kwargs={"activation": "none", "residual": None, "out_dtype": x.dtype}))
    if mm is None:
        return None

    def call():
        quant((a, sa))
        y = mm()
        if act == "gelu_tanh":
            y = torch.nn.functional.gelu(y, approximate="tanh")
        return y if res is None else y.add_(res)

    call.label = "fp8_quant + " + getattr(mm, "label", "torch._scaled_mm (cuBLASLt)")
    return call


def _two_launch_peer(c: K.Case):
    """What this kernel replaces: fp8_quant (the row's norm / SwiGLU and its e4m3 quantization) then
    fp8_gemv on its rows and scales, two launches."""
    x, b, sb, bias = c.args
    quant = _quant(c)
    a, sa = quant()

    def call():
        quant((a, sa))
        return FGV.fp8_gemv(a, b, sa, sb, bias, activation=c.kwargs["activation"], residual=c.kwargs["residual"],
                            out_dtype=x.dtype)

    return call


def _bf16_gemv_peer(c: K.Case):
    """tritune's bf16 GEMV on the same shapes, the weight (K, N) row-major (the e4m3 codes as bf16, timing
    only), RMSNorm fused as the bf16 engine runs it; under SwiGLU on the gate half of x (the bf16 engine
    computes silu(g)·u in the gate/up projection's epilogue)."""
    x, b, _, bias = c.args
    k = b.shape[0]
    norm = c.kwargs.get("norm")
    rms = (norm[1], norm[2]) if norm is not None else None
    act = None if c.kwargs["activation"] == "none" else c.kwargs["activation"]
    bh = b.to(x.dtype).contiguous()
    xh = x[:, :k]
    return lambda: gemv(xh, bh, bias, activation=act, residual=c.kwargs["residual"], rms=rms)


def _bad_inputs(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g).to(device, torch.bfloat16)
    b, sb = ref.quantize_channels(torch.randn(64, 32, generator=g).to(device))
    w = torch.ones(64, dtype=torch.bfloat16, device=device)
    big = torch.randn(17, 64, generator=g).to(device, torch.bfloat16)
    return [
        ("e4m3 x", lambda: fp8_qgemv(x.to(E4M3), b, sb), TypeError),
        ("fp32 x", lambda: fp8_qgemv(x.float(), b, sb), TypeError),
        ("mismatched K", lambda: fp8_qgemv(x, b[:32], sb), ValueError),
        ("swiglu: b of x's K, not half", lambda: fp8_qgemv(x, b, sb, swiglu=True), ValueError),
        ("swiglu over odd columns", lambda: fp8_qgemv(x[:, :63], b[:31], sb, swiglu=True), ValueError),
        ("more than 16 rows", lambda: fp8_qgemv(big, b, sb), ValueError),
        ("layer norm", lambda: fp8_qgemv(x, b, sb, norm=("layer", w, None, 1e-5)), ValueError),
        ("norm weight of the wrong size", lambda: fp8_qgemv(x, b, sb, norm=("rms", w[:10], 1e-5)), ValueError),
        ("norm weight of another dtype", lambda: fp8_qgemv(x, b, sb, norm=("rms", w.half(), 1e-5)), TypeError),
        ("negative eps", lambda: fp8_qgemv(x, b, sb, norm=("rms", w, -1.0)), ValueError),
        ("norm with swiglu", lambda: fp8_qgemv(x, b[:32], sb, norm=("rms", w, 1e-5), swiglu=True), ValueError),
        ("b_scale of the wrong shape", lambda: fp8_qgemv(x, b, sb[:5]), ValueError),
        ("float16 b_scale", lambda: fp8_qgemv(x, b, sb.half()), TypeError),
        ("unknown activation", lambda: fp8_qgemv(x, b, sb, activation="relu"), ValueError),
        ("bias of the wrong length", lambda: fp8_qgemv(x, b, sb, w[:5]), ValueError),
        ("residual of the wrong shape", lambda: fp8_qgemv(x, b, sb, residual=x[:, :5]), ValueError),
        ("out of another dtype", lambda: fp8_qgemv(x, b, sb, out=torch.empty(4, 32, device=device)), TypeError),
        ("out overlapping x", lambda: fp8_qgemv(x, b, sb, out=x[:, :32]), ValueError),
    ]


# Llama-3.2-1B's decode linears (K, N, what is quantized, residual): qkv after the attention's RMSNorm, o
# into the residual, gate/up after the MLP's RMSNorm, down of silu(gate)·up into the residual
LLAMA_1B = [(2048, 3072, "rms", False), (2048, 2048, "none", True), (2048, 16384, "rms", False),
            (8192, 2048, "swiglu", True)]

SPEC = K.register(K.KernelSpec(
    name="fp8_qgemv",
    description="W8A8 decode linear in one launch (M <= 16): fp8_quant's per-token e4m3 quantization (after "
                "RMSNorm, or of SwiGLU) inside fp8_gemv's one-row GEMV; channel/tensor/block weight scales, "
                "bias/GELU/residual, split-K",
    run=fp8_qgemv,
    reference=reference,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(m, n, k, mode, "channel", residual=res) for m in (1, 8)
                       for k, n, mode, res in LLAMA_1B],
    small_problems=[Problem(1, 200, 300, "rms", "channel", True, "gelu_tanh", True),
                    Problem(3, 40, 96, "swiglu", "block", False, "none", True),
                    Problem(2, 130, 260, "none", "tensor")],
    dtypes=DTYPES,
    layouts=("contiguous", "transposed", "sliced"),
    vendor=_vendor,
    vendor_name="fp8_quant + torch._scaled_mm (cuBLASLt)",
    peers={"tritune_fp8_quant+fp8_gemv": _two_launch_peer, "tritune_bf16_gemv": _bf16_gemv_peer},
    bad_inputs=_bad_inputs,
))
