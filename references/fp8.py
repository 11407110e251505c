"""FP8 (e4m3) in plain PyTorch: quantization with per-tensor, per-row, per-channel and 128x128-block scales,
and the scaled GEMM computed in float64 from the same quantized values and scales as the kernels get.

A scale maps the quantized grid back to real values: ``x ≈ q * scale``, ``scale = amax / 448`` (448 is
e4m3's largest finite value), so a block's largest magnitude lands on the grid's edge and nothing saturates.
"""
from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row or block: any positive scale, the quantized values are 0
BLOCK = 128        # the weight-block side of DeepSeek-V3's recipe


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / E4M3_MAX).clamp_min(MIN_SCALE)


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) dynamic quantization of a 2-D tensor: (q e4m3, scale float32 of shape (M,))."""
    scale = _scale_of(x.abs().amax(dim=-1))
    return _to_e4m3(x, scale[:, None]), scale


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (a 0-dim float32)."""
    scale = _scale_of(x.abs().amax())
    return _to_e4m3(x, scale), scale


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (K, N) weight with one scale per output channel (column): scale of shape (N,)."""
    scale = _scale_of(w.abs().amax(dim=0))
    return _to_e4m3(w, scale[None, :]), scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A (K, N) weight with one scale per block x block tile: scale of shape (ceil(K/b), ceil(N/b))."""
    k, n = w.shape
    kb, nb = math.ceil(k / block), math.ceil(n / block)
    pad = torch.zeros(kb * block, nb * block, dtype=torch.float32, device=w.device)
    pad[:k, :n] = w.float()
    amax = pad.abs().view(kb, block, nb, block).amax(dim=(1, 3))
    scale = _scale_of(amax)
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:k, :n]
    return _to_e4m3(w, full), scale


def expand_b_scale(b_scale: torch.Tensor, k: int, n: int, block: int = BLOCK) -> torch.Tensor:
    """A B scale of any supported form as a (K, N) float64 tensor."""
    s = b_scale.double()
    if s.dim() == 0 or s.numel() == 1:
        return s.reshape(()).expand(k, n)
    if s.dim() == 1:
        return s[None, :].expand(k, n)
    return s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:k, :n]


def expand_a_scale(a_scale: torch.Tensor, m: int) -> torch.Tensor:
    s = a_scale.double()
    return s.reshape(-1, 1) if s.dim() else s   # (M, 1) per row, or a scalar


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 values of a quantized 2-D tensor and its row scales (M,) or a scalar."""
    s = scale.double()
    return q.double() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))


def normalize(x: torch.Tensor, norm=None, swiglu: bool = False) -> torch.Tensor:
    """What the quantization kernel quantizes, in float64: ``x`` itself; RMSNorm ``("rms", weight, eps)``
    (x · rsqrt(mean(x²) + eps) · weight); LayerNorm ``("layer", weight, bias, eps)`` (weight and bias may
    be None); or, with ``swiglu``, silu(gate) · up of a (M, 2N) [gate | up] tensor."""
    x64 = x.double()
    if swiglu:
        n = x64.shape[-1] // 2
        return torch.nn.functional.silu(x64[:, :n]) * x64[:, n:]
    if norm is None:
        return x64
    if norm[0] == "rms":
        _, w, eps = norm
        y = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps)
    else:
        _, w, b, eps = norm
        mu = x64.mean(dim=-1, keepdim=True)
        y = (x64 - mu) * torch.rsqrt((x64 - mu).pow(2).mean(dim=-1, keepdim=True) + eps)
        if b is not None:
            return y * (w.double() if w is not None else 1.0) + b.double()
    return y * w.double() if w is not None else y


def fp8_quant(x: torch.Tensor, norm=None, swiglu: bool = False, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantization kernel's reference in float64: per-row scales of the (normalized) rows, values
    rounded to e4m3 once. Returns (q as float64 values, scale float64 (M,))."""
    x64 = normalize(x, norm, swiglu)
    scale = (x64.abs().amax(dim=-1) / E4M3_MAX).clamp_min(MIN_SCALE)
    q = (x64 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.double(), scale


def fp8_gemm(a, b, a_scale, b_scale, bias=None, activation: str = "none", residual=None):
    """(a * a_scale) @ (b * b_scale) + bias, activation, + residual, in float64, from the e4m3 values."""
    m, k = a.shape
    n = b.shape[1]
    out = (a.double() * expand_a_scale(a_scale, m)) @ (b.double() * expand_b_scale(b_scale, k, n))
    if bias is not None:
        out = out + bias.double()
    if activation == "gelu_tanh":
        out = torch.nn.functional.gelu(out, approximate="tanh")
    elif activation == "gelu":
        out = torch.nn.functional.gelu(out)
    if residual is not None:
        out = out + residual.double()
    return out


def quotients(x: torch.Tensor, norm=None, swiglu: bool = False) -> torch.Tensor:
    """What :func:`fp8_quant` rounds to e4m3, in float64: y / scale of each row, clamped to ±448."""
    x64 = normalize(x, norm, swiglu)
    scale = (x64.abs().amax(dim=-1) / E4M3_MAX).clamp_min(MIN_SCALE)
    return (x64 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX)


def midpoint_distance(t: torch.Tensor) -> torch.Tensor:
    """How far each value lies from e4m3's nearest rounding midpoint, in units of the gap between the two
    codes around it: 0.5 on a code, 0 on a midpoint. A kernel that forms the quotient in float32 may round
    a value within float32's last bits of a midpoint the other way than this float64 reference does (both
    right); inputs kept a distance away from 0 compare code for code."""
    a = t.abs().double()
    step = torch.exp2(torch.floor(torch.log2(a.clamp_min(2.0**-6))) - 3)   # subnormals: the lowest binade's step
    frac = a / step
    return (frac - frac.floor() - 0.5).abs()


def fp8_qgemv(x, b, b_scale, bias=None, norm=None, swiglu: bool = False, activation: str = "none",
              residual=None, **_):
    """The fused W8A8 decode linear in float64: :func:`fp8_quant` of x (its norm or SwiGLU) gives the e4m3
    rows and their scales, :func:`fp8_gemm` multiplies them by b · b_scale (+ bias, GELU, + residual)."""
    q, scale = fp8_quant(x, norm=norm, swiglu=swiglu)
    return fp8_gemm(q, b, scale, b_scale, bias, activation, residual)
