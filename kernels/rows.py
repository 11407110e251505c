"""Jitted helpers over tiles of rows that several kernels share: the LayerNorm statistics gemm's and gemv's
fused ``ln=`` prologues compute (float32, shifted sums as in ``layer_norm``), and the RMSNorm statistic of
their ``rms=`` prologues (float32 sum of squares, no mean).

A module of shared device code registers no kernel. Its function keeps the name and text it had inside
gemv: the store's source hash of a kernel covers the name and source of every jitted function the kernel's
module holds, so gemm's and gemv's tuned entries stay current; kernels import it as ``row_stats`` (and ``_row_rms`` as ``row_rms``).
"""
from __future__ import annotations

import triton
import triton.language as tl


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
