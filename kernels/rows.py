"""Jitted helpers over tiles of rows that several kernels share: the LayerNorm statistics gemm's and gemv's
fused ``ln=`` prologues compute (float32, shifted sums as in ``layer_norm``), and the RMSNorm statistic of
their ``rms=`` prologues (float32 sum of squares, no mean).

Also the host side of those prologues both launchers share: :func:`prologue` (the ``ln`` / ``rms`` forms)
and :func:`check_rms`. A module of shared device code registers no kernel. ``_row_stats`` keeps the name and
text it had inside gemv (the store's code key of a kernel covers the name and source of every jitted
function its module holds); kernels import it as ``row_stats``, and ``_row_rms`` as ``row_rms``.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from tritune import kernels as K


@triton.jit
def _row_stats(x_rows, mask_m, K, s_xk, eps, BLOCK_M: tl.constexpr, LN_BLOCK: tl.constexpr):
    """LayerNorm statistics of BLOCK_M rows over all of K, float32: (shift, m1, rstd) with mean =
    shift + m1, from sums of x − shift (the first chunk's mean), as in ``layer_norm``: x − mean is then
    taken as (x − shift) − m1, exact in its first step for x near the shift."""
    offs_l = tl.arange(0, LN_BLOCK)
    lmask = mask_m[:, None] & (offs_l < K)[None, :]
    first = tl.load(x_rows + offs_l[None, :] * s_xk, mask=lmask, other=0.0).to(tl.float32)
    shift = tl.sum(first, axis=1) / tl.minimum(K, LN_BLOCK)
    xc = tl.where(lmask, first - shift[:, None], 0.0)
    s1 = tl.sum(xc, axis=1)
    s2 = tl.sum(xc * xc, axis=1)
    for start in range(LN_BLOCK, K, LN_BLOCK):
        kk = start + offs_l
        lmask = mask_m[:, None] & (kk < K)[None, :]
        xv = tl.load(x_rows + kk[None, :] * s_xk, mask=lmask, other=0.0).to(tl.float32)
        xc = tl.where(lmask, xv - shift[:, None], 0.0)
        s1 += tl.sum(xc, axis=1)
        s2 += tl.sum(xc * xc, axis=1)
    m1 = s1 / K
    rstd = 1.0 / tl.sqrt(tl.maximum(s2 / K - m1 * m1, 0.0) + eps)
    return shift, m1, rstd


@triton.jit
def _row_rms(x_rows, mask_m, K, s_xk, eps, BLOCK_M: tl.constexpr, LN_BLOCK: tl.constexpr):
    """RMSNorm's rstd = 1 / sqrt(mean(x²) + eps) of BLOCK_M rows over all of K, float32, K read in LN_BLOCK
    chunks in order (a row's value depends on the row, K and LN_BLOCK only, never on the other rows)."""
    offs_l = tl.arange(0, LN_BLOCK)
    s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, K, LN_BLOCK):
        kk = start + offs_l
        xv = tl.load(x_rows + kk[None, :] * s_xk, mask=mask_m[:, None] & (kk < K)[None, :], other=0.0)
        xf = xv.to(tl.float32)
        s2 += tl.sum(xf * xf, axis=1)
    return 1.0 / tl.sqrt(s2 / K + eps)


row_stats = _row_stats
row_rms = _row_rms


_NO_NORM = (None, None, 0.0, False)


def prologue(ln, rms) -> tuple:
    """(weight, bias, eps, is_rms) of a linear's norm prologue, from ``ln`` (weight or None, bias or None,
    eps), a LayerNorm, or ``rms`` (weight or None, eps), an RMSNorm; at most one of them. Checks the forms
    only (the hot path); :func:`check_rms` and ``check_fusions`` check the values."""
    if rms is None:
        if ln is None:
            return _NO_NORM
        if not isinstance(ln, (tuple, list)) or len(ln) != 3:
            raise TypeError("ln: expected (weight or None, bias or None, eps)")
        return ln[0], ln[1], ln[2], False
    if not isinstance(rms, (tuple, list)) or len(rms) != 2:
        raise TypeError("rms: expected (weight or None, eps)")
    if ln is not None:
        raise ValueError("rms: given with ln; a linear takes one norm prologue, the LayerNorm or the RMSNorm")
    return rms[0], None, rms[1], True


def check_rms(rms, kdim: int, x, x_name: str) -> None:
    """An RMSNorm prologue ``rms`` (weight (K,) or None, eps) over the K of ``x``: errors name it."""
    if rms is None:
        return
    w, eps = rms
    if w is not None:
        K.check_vec("rms weight", w, kdim, x.dtype, x.device, x_name)
        if w.stride(0) != 1:
            raise ValueError(f"rms weight: expected unit stride, got {w.stride(0)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"rms eps: expected a finite number >= 0, got {eps!r}")
