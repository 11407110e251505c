"""Skinny GEMM for decode: y = act(norm(x) @ W + bias) + residual, with the KV-cache write fused.

The decode step of a GPT-2-sized model is a chain of launches that each read a few MB of weights for one
to a few rows of activations: there the kernels are bound by latency and launch count, not by FLOPs. This
kernel takes those rows and folds into one launch what the decode step otherwise spends extra kernels on:

- ``ln=(weight, bias, eps)``: a LayerNorm of each row of x over K before the product (the row statistics
  are computed by every program from x, which is a few KB and sits in L2; float32, shifted sums as in
  ``layer_norm``). GPT-2's ln_1 / ln_2 / ln_f go into the qkv, MLP-in and LM-head products.
- ``rms=(weight, eps)``: an RMSNorm instead (x · rsqrt(mean(x²) + eps) · weight, no mean): a Llama-family
  model's input / post-attention / final norms, the same way.
- ``kv=(k_cache, v_cache, slot_mapping)``: with N = 3·C (a fused qkv projection, C = heads·head_dim), the
  columns [C, 2C) and [2C, 3C) of each row are also written to the paged caches (num_blocks, block_size,
  heads, head_dim) at that row's slot (slot < 0: nothing written), which is what ``write_kv`` does.
- bias, GELU (tanh form, as x·sigmoid(2z)) and a residual add in the epilogue, as in ``gemm``.
- ``activation="swiglu"``: W is the [gate | up] weight (K, 2F) and y has F columns, silu(g)·u, as in
  ``gemm``: each program reads the gate's columns n and the up's columns F + n of W into two float32
  accumulators (two weight tiles per K step; the stored weight is not reordered), and the epilogue
  combines them.

Two inner loops, chosen by BLOCK_M. BLOCK_M = 1 (one row per program, the M = 1 decode): no tensor cores;
each program multiplies its x slice into a BLOCK_K × BLOCK_N tile of W in float32 registers and reduces
over K once at the end, so fp32 is exact fp32 and LN's output is never rounded. BLOCK_M ≥ 16: ``tl.dot``
on row tiles (a few rows: batched decode); a normalised x tile is rounded to the input dtype before the
dot (as the unfused LN's output is); fp32 uses ``input_precision="ieee"`` (the kernel is memory bound;
the "ieee" tolerance holds for every dtype).

Split-K (``SPLIT_K > 1``) as in ``gemm``: each program stores its float32 partial tile to a workspace and
takes a ticket from a per-tile counter; the last one sums the partials in slice order (deterministic),
runs the epilogue and resets the counter. One launch. Counters and workspace are per device: two split-K
launches must not run concurrently on different streams.

Programmatic dependent launch (sm90+, only while a CUDA graph is captured: ``kernels.pdl_now``): a program
lets the next launch start at once (``gdc_launch_dependents`` first thing), reads its first weight tile,
then waits for the launch before it (``gdc_wait``) before it touches x, the residual, the workspace or
any output. A decode step's run of gemv launches thus overlaps several deep (H100, GPT-2 small, batch 1:
2984 tok/s with it, 2680 without; letting the next start only after our own wait measured 2830).
Kernels whose inputs are all outputs of the launch before (paged attention, the engine's step kernels)
signal only after their wait, so early launches never cascade through a whole step (every kernel
signalling first thing measured 2497 tok/s).

Host time: after a plan's first launch the compiled kernel is called directly (``kernels.launch_direct``),
~20 us a call instead of triton's ~60.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S
from tritune.kernels.rows import check_rms
from tritune.kernels.rows import prologue as _prologue
from tritune.kernels.rows import row_rms as _row_rms
from tritune.kernels.rows import row_stats as _row_stats
from tritune.references import gemv as ref


@triton.jit
def _gemv_kernel(X, W, Y, Bias, R, LnW, LnB, KC, VC, Slots, Work, Locks,
                 M, N, K, C_KV, eps,
                 s_xm, s_xk, s_wk, s_wn, s_ym, s_yn, s_rm, s_rn,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, HAS_LN: tl.constexpr,
                 HAS_LN_W: tl.constexpr, HAS_LN_B: tl.constexpr, HAS_KV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 LN_BLOCK: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr, PDL: tl.constexpr,
                 RMS: tl.constexpr = False):
    """y = act(norm(x) @ W + bias) + R (see the module's docstring). HAS_LN: a LayerNorm of x's rows (RMS: an
    RMSNorm). ACT 2 (SwiGLU): W has 2N columns, the up tile (columns N + n) in a second accumulator;
    split-K's workspace holds its partials after the gate's."""
    if PDL:  # the next launch (when it too is launched with PDL) may start now; it waits for us at its gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = pid_k * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + tiles_per_split * BLOCK_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    if INT64:
        cols = offs_n.to(tl.int64)
        s_wk = s_wk + pid_n.to(tl.int64) * 0  # widen a stride the JIT specialised to the constant 1
    else:
        cols = offs_n
    x_rows = X + rows[:, None] * s_xm
    acc_up = None
    cols_up = cols
    if ACT == 2:
        cols_up = cols + N

    if BLOCK_M == 1:
        # One row: float32 products into a BLOCK_K x BLOCK_N register tile, reduced over K at the end.
        # Loads run one K step ahead of the products, and the first step's are issued before the LayerNorm
        # statistics: the weight tile's DRAM latency overlaps them (the statistics read x from L2).
        x_row = X + pid_m.to(tl.int64) * s_xm
        if EVEN_K:  # no masks along K (vector loads when K is W's unit-stride dim): a step past the slice
            # reads its last tile again instead (in bounds; its values are never used)
            kk = tl.minimum(k_lo, K - BLOCK_K) + offs_k
            wv = tl.load(W + kk[:, None] * s_wk + cols[None, :] * s_wn, mask=mask_n[None, :], other=0.0)
            if ACT == 2:
                wu = tl.load(W + kk[:, None] * s_wk + cols_up[None, :] * s_wn, mask=mask_n[None, :], other=0.0)
            if PDL:  # the weights are ours to read at once; x, the residual and every output wait for the
                tl.extra.cuda.gdc_wait()  # launch before this one to finish
            xv = tl.load(x_row + kk * s_xk)
        else:
            kk = k_lo + offs_k
            in_k = kk < k_hi
            wv = tl.load(W + kk[:, None] * s_wk + cols[None, :] * s_wn, mask=in_k[:, None] & mask_n[None, :],
                         other=0.0)
            if ACT == 2:
                wu = tl.load(W + kk[:, None] * s_wk + cols_up[None, :] * s_wn, mask=in_k[:, None] & mask_n[None, :],
                             other=0.0)
            if PDL:
                tl.extra.cuda.gdc_wait()
            xv = tl.load(x_row + kk * s_xk, mask=in_k, other=0.0)
        if HAS_LN:
            if RMS:
                rstd1 = tl.sum(_row_rms(x_rows, mask_m, K, s_xk, eps, BLOCK_M, LN_BLOCK), axis=0)
            else:
                shift, m1, rstd = _row_stats(x_rows, mask_m, K, s_xk, eps, BLOCK_M, LN_BLOCK)
                shift1 = tl.sum(shift, axis=0)
                m1_1 = tl.sum(m1, axis=0)
                rstd1 = tl.sum(rstd, axis=0)
        acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        if ACT == 2:
            acc2_up = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            kk = k + offs_k
            kn = kk + BLOCK_K
            if EVEN_K:
                kc = tl.minimum(k + BLOCK_K, k_hi - BLOCK_K) + offs_k
                w_next = tl.load(W + kc[:, None] * s_wk + cols[None, :] * s_wn, mask=mask_n[None, :], other=0.0)
                if ACT == 2:
                    wu_next = tl.load(W + kc[:, None] * s_wk + cols_up[None, :] * s_wn, mask=mask_n[None, :],
                                      other=0.0)
                x_next = tl.load(x_row + kc * s_xk)
            else:
                in_n = kn < k_hi
                w_next = tl.load(W + kn[:, None] * s_wk + cols[None, :] * s_wn,
                                 mask=in_n[:, None] & mask_n[None, :], other=0.0)
                if ACT == 2:
                    wu_next = tl.load(W + kn[:, None] * s_wk + cols_up[None, :] * s_wn,
                                      mask=in_n[:, None] & mask_n[None, :], other=0.0)
                x_next = tl.load(x_row + kn * s_xk, mask=in_n, other=0.0)
            xf = xv.to(tl.float32)
            if HAS_LN:
                if RMS:
                    xf = xf * rstd1
                else:
                    xf = ((xf - shift1) - m1_1) * rstd1
                if HAS_LN_W:
                    xf = xf * tl.load(LnW + kk, mask=kk < K, other=0.0).to(tl.float32)
                if HAS_LN_B:
                    xf = xf + tl.load(LnB + kk, mask=kk < K, other=0.0).to(tl.float32)
                if not EVEN_K:
                    xf = tl.where(kk < k_hi, xf, 0.0)
            acc2 += xf[:, None] * wv.to(tl.float32)
            if ACT == 2:
                acc2_up += xf[:, None] * wu.to(tl.float32)
                wu = wu_next
            wv = w_next
            xv = x_next
        acc = tl.sum(acc2, axis=0)[None, :]
        if ACT == 2:
            acc_up = tl.sum(acc2_up, axis=0)[None, :]
    else:
        if PDL:
            tl.extra.cuda.gdc_wait()
        if HAS_LN:
            if RMS:
                rstd = _row_rms(x_rows, mask_m, K, s_xk, eps, BLOCK_M, LN_BLOCK)
            else:
                shift, m1, rstd = _row_stats(x_rows, mask_m, K, s_xk, eps, BLOCK_M, LN_BLOCK)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ACT == 2:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            kk = k + offs_k
            in_k = kk < k_hi
            if EVEN_K:
                xv = tl.load(x_rows + kk[None, :] * s_xk, mask=mask_m[:, None], other=0.0)
                wv = tl.load(W + kk[:, None] * s_wk + cols[None, :] * s_wn, mask=mask_n[None, :], other=0.0)
                if ACT == 2:
                    wu = tl.load(W + kk[:, None] * s_wk + cols_up[None, :] * s_wn, mask=mask_n[None, :], other=0.0)
            else:
                xv = tl.load(x_rows + kk[None, :] * s_xk, mask=mask_m[:, None] & in_k[None, :], other=0.0)
                wv = tl.load(W + kk[:, None] * s_wk + cols[None, :] * s_wn,
                             mask=in_k[:, None] & mask_n[None, :], other=0.0)
                if ACT == 2:
                    wu = tl.load(W + kk[:, None] * s_wk + cols_up[None, :] * s_wn,
                                 mask=in_k[:, None] & mask_n[None, :], other=0.0)
            if HAS_LN:
                if RMS:
                    xf = xv.to(tl.float32) * rstd[:, None]
                else:
                    xf = ((xv.to(tl.float32) - shift[:, None]) - m1[:, None]) * rstd[:, None]
                if HAS_LN_W:
                    xf = xf * tl.load(LnW + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
                if HAS_LN_B:
                    xf = xf + tl.load(LnB + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
                xf = tl.where(mask_m[:, None] & in_k[None, :], xf, 0.0)
                xv = xf.to(W.dtype.element_ty)
            acc = tl.dot(xv, wv, acc, input_precision="ieee")
            if ACT == 2:
                acc_up = tl.dot(xv, wu, acc_up, input_precision="ieee")

    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        slab = M * N
        if INT64:
            slab = slab.to(tl.int64)
        w_tile = Work + rows[:, None] * N + cols[None, :]
        tl.store(w_tile + pid_k * slab, acc, mask=mask)
        if ACT == 2:  # the up partials: SPLIT_K slabs after the gate's
            tl.store(w_tile + (SPLIT_K + pid_k) * slab, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(Locks + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on arrival order
                acc += tl.load(w_tile + s * slab, mask=mask, other=0.0, cache_modifier=".cg")
            if ACT == 2:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    acc_up += tl.load(w_tile + (SPLIT_K + s) * slab, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Locks + tile, 0)
            _epilogue(acc, rows, cols, mask_m, mask_n, mask, Y, Bias, R, KC, VC, Slots, C_KV,
                      s_ym, s_yn, s_rm, s_rn, HAS_BIAS, ACT, HAS_RES, HAS_KV, acc_up, cols_up)
    else:
        _epilogue(acc, rows, cols, mask_m, mask_n, mask, Y, Bias, R, KC, VC, Slots, C_KV,
                  s_ym, s_yn, s_rm, s_rn, HAS_BIAS, ACT, HAS_RES, HAS_KV, acc_up, cols_up)


@triton.jit
def _epilogue(acc, rows, cols, mask_m, mask_n, mask, Y, Bias, R, KC, VC, Slots, C_KV,
              s_ym, s_yn, s_rm, s_rn,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr, HAS_KV: tl.constexpr,
              acc_up=None, cols_up=None):
    y = acc
    if HAS_BIAS:
        y += tl.load(Bias + cols, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # tanh GELU as x·sigmoid(2z): no tanh, no overflow
        z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = y / (1.0 + tl.exp(-2.0 * z))
    if ACT == 2:  # SwiGLU: silu(g)·u, the up half's bias at columns N + n (exp overflow: g/inf = -0)
        up = acc_up
        if HAS_BIAS:
            up += tl.load(Bias + cols_up, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = y / (1.0 + tl.exp(-y)) * up
    if HAS_RES:
        y += tl.load(R + rows[:, None] * s_rm + cols[None, :] * s_rn, mask=mask, other=0.0).to(tl.float32)
    out = y.to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * s_ym + cols[None, :] * s_yn, out, mask=mask)
    if HAS_KV:  # columns [C, 2C) are K, [2C, 3C) are V: each row's slot in the (slots, C) caches
        slot = tl.load(Slots + rows, mask=mask_m, other=-1).to(tl.int64)
        live = mask & (slot >= 0)[:, None]
        at = slot[:, None] * C_KV + cols[None, :]
        is_v = cols >= 2 * C_KV
        tl.store(KC + at - C_KV, out, mask=live & ((cols >= C_KV) & ~is_v)[None, :])
        tl.store(VC + at - 2 * C_KV, out, mask=live & is_v[None, :])


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    M: int
    N: int
    K: int
    trans_w: bool = False        # W is a column-major view (a tied embedding (N, K) read as its .t())
    bias: bool = False
    act: str | None = None       # None, "gelu_tanh" or "swiglu" (N: W's [gate | up] 2F columns; y has N / 2)
    residual: bool = False
    ln: bool = False             # LayerNorm (weight and bias) of x over K first
    rms: bool = False            # RMSNorm (weight) of x over K first (instead of ln)

    @property
    def n_out(self) -> int:
        """Columns of y."""
        return self.N // 2 if self.act == "swiglu" else self.N


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = (None, "gelu_tanh", "swiglu")
INT32_LIMIT = 2**31
SMEM_BUDGET = 200 * 1024
_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}

_locks = K.Counters(minimum=1024)
_workspace = K.Workspace()
_PLANS = K.PlanCache()
_meta = K.tensor_meta


class _Plan:
    __slots__ = ("out_shape", "m", "n", "k", "grid", "ints", "kws", "kws_pdl", "kernels", "consts", "consts_pdl",
                 "work_numel", "locks", "cfg", "cfg_key",
                 "empty", "c_kv", "extents")


def gemv(x, w, bias=None, *, activation=None, residual=None, ln=None, rms=None, kv=None, out=None,
         config: dict | None = None):
    """y = act(norm(x) @ w + bias) + residual for x (M, K) (or (..., K)), w (K, N) (any strides).

    activation: None, "gelu_tanh" or "swiglu" (w the [gate | up] weight (K, 2F), bias (2F,); y and the
    residual F columns, silu(g)·u). ln: None or (weight (K,) or None, bias (K,) or None, eps), a LayerNorm;
    rms: None or (weight (K,) or None, eps), an RMSNorm (not with ln). kv: None or (k_cache, v_cache, slot_mapping):
    with N = 3·C, columns C..2C and 2C..3C of row m also go to k_cache / v_cache (num_blocks, block_size,
    heads, head_dim; heads·head_dim = C, contiguous) at flat slot slot_mapping[m] (< 0: skipped).
    Returns y (..., N) (N / 2 with SwiGLU) in x's dtype (into ``out`` when given; ``out`` may be
    ``residual`` itself, in place).
    """
    ln_w, ln_b, eps, is_rms = _prologue(ln, rms)
    if kv is not None and (not isinstance(kv, (tuple, list)) or len(kv) != 3):
        raise TypeError("kv: expected (k_cache, v_cache, slot_mapping)")
    kc, vc, slots = kv if kv is not None else (None, None, None)
    try:
        key = (x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, _meta(bias), _meta(residual),
               _meta(out), activation, ln is not None, is_rms, _meta(ln_w), _meta(ln_b), _meta(kc), _meta(vc),
               _meta(slots), None if config is None else tuple(config.items()), INT32_LIMIT)
    except (AttributeError, TypeError, ValueError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _make_plan(x, w, bias, activation, residual, ln, kv, out, config, rms))
    if out is None:
        out = torch.empty(plan.out_shape, dtype=x.dtype, device=x.device)
    else:  # out=residual (the residual stream updated in place) is the one overlap allowed
        K.check_no_alias(out, (("x", x), ("w", w), ("bias", bias), ("residual", residual), ("ln weight", ln_w),
                               ("ln bias", ln_b), ("k_cache", kc), ("v_cache", vc), ("slot_mapping", slots)),
                         "residual", plan.extents)
    if plan.empty:
        return out
    if plan.work_numel:
        work, locks = _workspace(x.device, plan.work_numel), plan.locks
    else:
        work = locks = out
    r_arg = out if residual is None else residual
    args = (x, w, out, out if bias is None else bias, r_arg, out if ln_w is None else ln_w,
            out if ln_b is None else ln_b, out if kc is None else kc, out if vc is None else vc,
            out if slots is None else slots, work, locks, plan.m, plan.n, plan.k, plan.c_kv, float(eps),
            *plan.ints)
    pdl = plan.kws_pdl is not None and K.pdl_now("gemv")
    kws = plan.kws_pdl if pdl else plan.kws
    K.launch_cached(_gemv_kernel, plan.kernels, plan.grid, args, kws, plan.consts_pdl if pdl else plan.consts,
                    pdl, args[:12])
    return out


def _check_vec(name, t, n, dtype, device):
    K.check_vec(name, t, n, dtype, device, "x")


def _residual_rows(residual, x, out_shape: tuple, m: int, n: int):
    """The residual checked (errors name it) and viewed as (m, n) rows; None without one."""
    if residual is None:
        return None
    K.check_tensor("residual", residual)
    if residual.dtype != x.dtype:
        raise TypeError(f"residual: dtype {residual.dtype} differs from x's {x.dtype}")
    if tuple(residual.shape) not in (out_shape, (m, n)):
        raise ValueError(f"residual: expected shape {out_shape} or {(m, n)}, got {tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"residual: on {residual.device}, but x is on {x.device}")
    try:
        return residual.view(m, n)
    except RuntimeError:
        raise ValueError(f"residual: its strides {residual.stride()} do not flatten to ({m}, {n})") from None


def _check_epilogue(x, w, bias, activation, kv) -> int:
    """The activation and the bias checked (errors name them); returns y's columns (N, or N / 2 with
    SwiGLU)."""
    n = w.shape[1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if bias is not None:
        _check_vec("bias", bias, n, x.dtype, x.device)
    if activation != "swiglu":
        return n
    if n % 2:
        raise ValueError(f"w: activation='swiglu' takes the [gate | up] weight, an even N; got N={n}")
    if kv is not None:
        raise ValueError("kv: the KV-cache write takes a qkv projection, not activation='swiglu'")
    return n // 2


def _make_plan(x, w, bias, activation, residual, ln, kv, out, config, rms=None) -> _Plan:
    K.check_tensor("x", x, dtypes=DTYPES)
    if x.device.type != K.kernel_device():
        K.check_device("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim (..., K), got a scalar")
    K.check_tensor("w", w, ndim=2, dtypes=DTYPES)
    if w.dtype != x.dtype:
        raise TypeError(f"w: dtype {w.dtype} differs from x's {x.dtype}")
    if w.device != x.device:
        raise ValueError(f"w: on {w.device}, but x is on {x.device}")
    kdim = w.shape[0]
    if x.shape[-1] != kdim:
        raise ValueError(f"x, w: inner sizes differ: x is {tuple(x.shape)} (K={x.shape[-1]}), "
                         f"w is {tuple(w.shape)} (K={kdim})")
    n = _check_epilogue(x, w, bias, activation, kv)
    m = math.prod(x.shape[:-1])
    out_shape = (*x.shape[:-1], n)
    try:
        x2 = x.view(m, kdim)
    except RuntimeError:
        raise ValueError(f"x: its strides {x.stride()} do not flatten to ({m}, {kdim}) rows") from None
    r2 = _residual_rows(residual, x, out_shape, m, n)
    c_kv = K.check_fusions(ln, kv, m, n, kdim, x, "x", "w")
    check_rms(rms, kdim, x, "x")
    if out is not None:
        K.check_out(out, out_shape, x.dtype, x.device)

    p = _Plan()
    p.out_shape, p.m, p.n, p.k, p.c_kv = out_shape, m, n, kdim, c_kv
    ln_w, ln_b, _, is_rms = _prologue(ln, rms)
    kc, vc, slots = kv if kv is not None else (None, None, None)
    p.extents = tuple(K.extent(t) for t in (out, x, w, bias, residual, ln_w, ln_b, kc, vc, slots))  # check_no_alias
    p.cfg = p.cfg_key = None
    p.empty = m == 0 or n == 0
    if p.empty:
        return p
    if out is None:
        s_ym, s_yn = n, 1
    else:
        try:
            s_ym, s_yn = out.view(m, n).stride()
        except RuntimeError:
            raise ValueError(f"out: its strides {out.stride()} do not flatten to ({m}, {n})") from None
    problem = Problem(m, w.shape[1], kdim, trans_w=w.stride(1) != 1, bias=bias is not None, act=activation,
                      residual=residual is not None, ln=ln is not None, rms=is_rms)
    cfg = SPEC.config_for(problem, x.dtype, config)
    if config is None:
        p.cfg, p.cfg_key = cfg, SPEC.config_key(problem, x.dtype)
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    accs = 2 if activation == "swiglu" else 1  # SwiGLU's split-K partials: the gate's, then the up's
    p.work_numel = accs * split * m * n if split > 1 else 0
    p.locks = _locks(x.device, tiles) if split > 1 else None
    p.grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    int64 = K.span(w) >= INT32_LIMIT or accs * split * m * n >= INT32_LIMIT or m * n >= INT32_LIMIT
    p.ints = (x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), s_ym, s_yn,
              r2.stride(0) if r2 is not None else 0, r2.stride(1) if r2 is not None else 0)
    p.kws = dict(HAS_BIAS=bias is not None, ACT=ACTIVATIONS.index(activation), HAS_RES=r2 is not None,
                 HAS_LN=ln is not None or is_rms, HAS_LN_W=ln_w is not None, HAS_LN_B=ln_b is not None,
                 HAS_KV=kv is not None, RMS=is_rms,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                 LN_BLOCK=min(triton.next_power_of_2(kdim), max(64, 8192 // max(bm, 1))),
                 EVEN_K=kdim % bk == 0, INT64=int64, PDL=False, num_warps=cfg["num_warps"],
                 num_stages=cfg["num_stages"])
    K.launch_variants(p, x.device, _CONSTEXPRS)   # PDL in graphs, direct launches after the first
    return p


_CONSTEXPRS = K.constexpr_params(_gemv_kernel)  # what a direct launch passes after the runtime arguments


SPACE = K.Space(params={
    "BLOCK_M": [1, 16, 32, 64],
    "BLOCK_N": [16, 32, 64, 128, 256],
    "BLOCK_K": [16, 32, 64, 128, 256, 512, 1024],   # up to all of a GPT-2 K in one step: one load round trip
    "SPLIT_K": [1, 2, 4, 8, 16],
    "num_warps": [1, 2, 4, 8],
    "num_stages": [1, 2, 3, 4],
})


def _constraint(c, p: Problem, dtype) -> str | None:
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    threads = 32 * c["num_warps"]
    tiles = 2 if p.act == "swiglu" else 1  # SwiGLU: a gate and an up tile of W, two accumulators
    if p.act == "swiglu" and p.N % 2:
        return "SwiGLU takes an even N ([gate | up])"
    if bn > max(16, triton.next_power_of_2(p.n_out)):
        return "BLOCK_N larger than N"
    if bk > max(16, triton.next_power_of_2(p.K)):
        return "BLOCK_K larger than K"
    if bm > max(16, triton.next_power_of_2(p.M)):
        return "BLOCK_M larger than M"
    if bm == 1:
        if tiles * bk * bn > 64 * threads:
            return f"{tiles * bk * bn // threads} float32 products per thread"
        if bk * bn < 2 * threads:
            return "idle threads"
        if p.M > 16:
            return "one row per program for many rows"
    else:
        if (bm + tiles * bn) * bk * _ELEM[dtype] * max(1, c["num_stages"]) > SMEM_BUDGET:
            return "shared memory for the pipeline"
        if tiles * bm * bn > 128 * threads:
            return f"{tiles * bm * bn // threads} accumulator registers per thread"
        if bm * bn < 4 * threads:
            return "idle warps"
    if c["SPLIT_K"] > triton.cdiv(p.K, bk):
        return "more K slices than K tiles"
    return None


SPACE.constraint = _constraint


def default_config(p: Problem, dtype) -> dict:
    """One row: BLOCK_M 1, 4 warps, a 64 x 64 tile of W (its unit-stride dim the 64); more rows: 16-row dot
    tiles. Split-K while the programs fill fewer than two waves and each slice keeps two K tiles. SwiGLU:
    the gate's and the up's tiles each half as wide (the same W bytes a program)."""
    if p.M == 1:
        bm, bn, bk, warps, stages = 1, 64, 64, 4, 3
    else:
        bm = min(64, max(16, triton.next_power_of_2(p.M)))
        bn, bk, warps, stages = 64, 64 if _ELEM[dtype] == 4 else 128, 4, 3
    if p.act == "swiglu":
        bn //= 2
    bn = min(bn, max(16, triton.next_power_of_2(p.n_out)))
    bk = min(bk, max(16, triton.next_power_of_2(p.K)))
    if bm == 1:
        while bk * bn < 2 * 32 * warps and warps > 1:
            warps //= 2
    else:
        while bm * bn < 4 * 32 * warps and warps > 1:
            warps //= 2
    tiles = triton.cdiv(p.M, bm) * triton.cdiv(p.n_out, bn)
    k_tiles = triton.cdiv(p.K, bk)
    split = 1
    while split < 16 and tiles * split * 2 <= 2 * K.num_sms() and k_tiles >= 4 * split:
        split *= 2
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": warps,
           "num_stages": stages}
    why = SPACE.constraint(cfg, p, dtype)
    assert why is None, f"gemv: default {cfg} invalid for {p}: {why}"
    return cfg


def bucket(p: Problem) -> dict:
    """M to a power of two, N, K, ln; rms=1 / swiglu=1 only when fused (the keys of the other problems, and
    the store entries tuned under them, are what they were; nearest-bucket lookups need the same fields)."""
    b = {"M": triton.next_power_of_2(p.M), "N": p.N, "K": p.K, "ln": int(p.ln)}
    if p.rms:
        b["rms"] = 1
    if p.act == "swiglu":
        b["swiglu"] = 1
    return b


def cost(p: Problem, dtype) -> K.Cost:
    e = _ELEM[dtype]
    elems = (p.M * p.K + p.K * p.N + p.M * p.n_out + (p.N if p.bias else 0) + (p.M * p.n_out if p.residual else 0)
             + (2 * p.K if p.ln else 0) + (p.K if p.rms else 0))
    return K.Cost(flops=2.0 * p.M * p.N * p.K, bytes=float(e * elems))


def problem_of(x, w, bias=None, *, activation=None, residual=None, ln=None, rms=None, **_) -> Problem:
    return Problem(math.prod(x.shape[:-1]), w.shape[-1], x.shape[-1], trans_w=w.stride(1) != 1,
                   bias=bias is not None, act=activation, residual=residual is not None, ln=ln is not None,
                   rms=rms is not None)


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    # x with a mean and spread per row (what LN removes); W scaled by 1/sqrt(K)
    x = S.with_layout(S.randn((p.M, p.K), dtype, device, seed, scale=2.0, shift=0.5 if p.ln or p.rms else 0.0),
                      layout)
    if p.trans_w:
        w = S.with_layout(S.randn((p.N, p.K), dtype, device, seed + 1, scale=1.0 / math.sqrt(p.K)), layout).t()
    else:
        w = S.with_layout(S.randn((p.K, p.N), dtype, device, seed + 1, scale=1.0 / math.sqrt(p.K)), layout)
    bias = S.randn((p.N,), dtype, device, seed + 2, scale=0.5) if p.bias else None
    res = S.randn((p.M, p.n_out), dtype, device, seed + 3) if p.residual else None
    ln = None
    if p.ln:
        ln = (S.randn((p.K,), dtype, device, seed + 4, scale=0.2, shift=1.0),
              S.randn((p.K,), dtype, device, seed + 5, scale=0.1), 1e-5)
    kwargs = {"activation": p.act, "residual": res, "ln": ln}
    if p.rms:  # only then: the other problems' cases keep the keywords they had
        kwargs["rms"] = (S.randn((p.K,), dtype, device, seed + 4, scale=0.2, shift=1.0), 1e-6)
    return K.Case(args=(x, w, bias), kwargs=kwargs, out=torch.empty((p.M, p.n_out), dtype=dtype, device=device))


def problems(max_elems: int):
    """M up to 16 (the decode rows this kernel is for; any M is correct), N and K up to sqrt(max_elems);
    the LayerNorm, the RMSNorm or no prologue; every activation (SwiGLU's N rounded to even)."""
    from hypothesis import strategies as st

    d = max(2, round(math.sqrt(max_elems)))

    @st.composite
    def draw(dr):
        m, n, k = dr(S.sizes(16)), dr(S.sizes(d)), dr(S.sizes(d))
        act, norm = dr(st.sampled_from(ACTIVATIONS)), dr(st.sampled_from([None, "ln", "rms"]))
        if act == "swiglu":
            n = 2 * max(1, n // 2)
        return Problem(m, n, k, trans_w=dr(st.booleans()), bias=dr(st.booleans()), act=act,
                       residual=dr(st.booleans()), ln=norm == "ln", rms=norm == "rms")

    return draw()


def _vendor(c: K.Case):
    """PyTorch as a model runs these ops: F.layer_norm or F.rms_norm, then cuBLAS (addmm, as F.linear) and
    the epilogue op by op (SwiGLU: F.silu(g) * u)."""
    x, w, bias = c.args
    act, res, ln, rms = c.kwargs["activation"], c.kwargs["residual"], c.kwargs["ln"], c.kwargs.get("rms")
    F = torch.nn.functional

    def run():
        h = x if ln is None else F.layer_norm(x, (x.shape[-1],), ln[0], ln[1], ln[2])
        if rms is not None:
            h = F.rms_norm(x, (x.shape[-1],), rms[0], rms[1])
        y = torch.addmm(bias, h, w) if bias is not None else torch.mm(h, w)
        if act == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        elif act == "swiglu":
            g, u = y.chunk(2, dim=-1)
            y = F.silu(g) * u
        if res is not None:
            y += res
        return y

    return run


def _gemm_peer(c: K.Case):
    """tritune's own path before this kernel: the layer_norm kernel, then the gemm kernel (the RMSNorm
    prologue goes to gemm as it is)."""
    from tritune.kernels.gemm import gemm
    from tritune.kernels.layer_norm import layer_norm

    x, w, bias = c.args
    act, res, ln, rms = c.kwargs["activation"], c.kwargs["residual"], c.kwargs["ln"], c.kwargs.get("rms")

    def run():
        h = x if ln is None else layer_norm(x, ln[0], ln[1], ln[2])
        return gemm(h, w, bias, activation=act, residual=res, rms=rms)

    return run


def _bad_inputs(device):
    x = torch.randn(2, 8, device=device)
    w = torch.randn(8, 6, device=device)
    kc = torch.zeros(3, 4, 1, 2, device=device)
    slots = torch.zeros(2, dtype=torch.int32, device=device)
    return [
        ("inner sizes differ", lambda: gemv(x, torch.randn(7, 6, device=device)), ValueError),
        ("dtype mismatch", lambda: gemv(x, w.half()), TypeError),
        ("integer x", lambda: gemv(x.to(torch.int32), w), TypeError),
        ("x on the wrong device", lambda: gemv(x.to("meta"), w), ValueError),
        ("bias of the wrong length", lambda: gemv(x, w, torch.randn(5, device=device)), ValueError),
        ("unknown activation", lambda: gemv(x, w, activation="relu"), ValueError),
        ("ln not a triple", lambda: gemv(x, w, ln=(None, None)), TypeError),
        ("ln weight of the wrong length", lambda: gemv(x, w, ln=(torch.randn(7, device=device), None, 1e-5)),
         ValueError),
        ("ln eps negative", lambda: gemv(x, w, ln=(None, None, -1.0)), ValueError),
        ("kv with N not 3 x heads x head_dim", lambda: gemv(x, torch.randn(8, 5, device=device), kv=(kc, kc, slots)),
         ValueError),
        ("kv slots of the wrong length", lambda: gemv(x, w, kv=(kc, kc, slots[:1])), ValueError),
        ("kv cache of another dtype", lambda: gemv(x, w, kv=(kc.half(), kc.half(), slots)), TypeError),
        ("kv slots of a float dtype", lambda: gemv(x, w, kv=(kc, kc, slots.float())), TypeError),
        ("residual of the wrong shape", lambda: gemv(x, w, residual=torch.randn(2, 5, device=device)), ValueError),
        ("out of the wrong shape", lambda: gemv(x, w, out=torch.empty(2, 5, device=device)), ValueError),
        ("swiglu with an odd N", lambda: gemv(x, torch.randn(8, 5, device=device), activation="swiglu"), ValueError),
        ("swiglu with the KV-cache write", lambda: gemv(x, w, activation="swiglu", kv=(kc, kc, slots)), ValueError),
        ("swiglu out of the whole N", lambda: gemv(x, w, activation="swiglu", out=torch.empty(2, 6, device=device)),
         ValueError),
        ("rms not a pair", lambda: gemv(x, w, rms=(None, None, 1e-6)), TypeError),
        ("rms and ln together", lambda: gemv(x, w, ln=(None, None, 1e-5), rms=(None, 1e-6)), ValueError),
        ("rms weight of the wrong length", lambda: gemv(x, w, rms=(torch.randn(7, device=device), 1e-6)), ValueError),
        ("rms eps negative", lambda: gemv(x, w, rms=(None, -1.0)), ValueError),
    ]


def _gpt2(m: int) -> list[Problem]:
    """GPT-2 small's decode linears with what they fuse: ln_1 + c_attn, attn c_proj + residual,
    ln_2 + c_fc + GELU, mlp c_proj + residual, ln_f + the tied LM head."""
    return [Problem(m, 2304, 768, bias=True, ln=True),
            Problem(m, 768, 768, bias=True, residual=True),
            Problem(m, 3072, 768, bias=True, act="gelu_tanh", ln=True),
            Problem(m, 768, 3072, bias=True, residual=True),
            Problem(m, 50257, 768, trans_w=True, ln=True)]


def borrow(c: dict, p: Problem, dtype) -> str | None:
    """Why a neighbouring bucket's config does not carry over: a tile of fewer rows than the problem has
    reads the weight once per tile of rows (a one-row tile tuned at M=1 reads it 4 times at M=4)."""
    if c["BLOCK_M"] < p.M:
        return f"BLOCK_M={c['BLOCK_M']} would read the weight {triton.cdiv(p.M, c['BLOCK_M'])} times for {p.M} rows"
    return None


def _llama(m: int, hidden: int = 2048, qkv: int = 3072, inter: int = 8192, vocab: int = 128256) -> list[Problem]:
    """A Llama-family model's decode linears with what they fuse (default: Llama-3.2-1B, hidden 2048, 32 / 8
    heads of 64, intermediate 8192): input RMSNorm + qkv, o_proj + residual, post-attention RMSNorm + gate/up
    + SwiGLU, down_proj + residual, the final RMSNorm + the LM head (the tied embedding, read transposed)."""
    return [Problem(m, qkv, hidden, rms=True), Problem(m, hidden, hidden, residual=True),
            Problem(m, 2 * inter, hidden, act="swiglu", rms=True), Problem(m, hidden, inter, residual=True),
            Problem(m, vocab, hidden, trans_w=True, rms=True)]


def _qwen05(m: int) -> list[Problem]:
    """Qwen2.5-0.5B's (hidden 896, 14 / 2 heads of 64, intermediate 4864, qkv with bias)."""
    return [Problem(m, 1152, 896, bias=True, rms=True)] + _llama(m, 896, 1152, 4864, 151936)[1:]


SPEC = K.register(K.KernelSpec(
    name="gemv",
    description="skinny GEMM for decode: LayerNorm / RMSNorm prologue, bias / GELU / SwiGLU / residual epilogue, "
                "KV-cache write",
    run=gemv,
    reference=ref.gemv,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[p for m in (1, 4, 8) for p in _gpt2(m)]
    + [Problem(1, 4096, 4096), Problem(1, 28672, 8192), Problem(8, 28672, 8192)]
    + [p for m in (1, 2, 4, 8) for p in _llama(m) + _qwen05(m)],
    small_problems=[Problem(1, 96, 80, bias=True, act="gelu_tanh", ln=True),
                    Problem(5, 33, 47, trans_w=True, residual=True),
                    Problem(3, 64, 40, bias=True, act="swiglu", residual=True, rms=True)],
    layouts=("contiguous", "sliced"),
    borrow=borrow,
    vendor=_vendor,
    vendor_name="torch (F.layer_norm / F.rms_norm + cuBLAS)",
    peers={"tritune_ln_gemm": _gemm_peer},
    bad_inputs=_bad_inputs,
))
