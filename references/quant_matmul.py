"""Reference for the weight-only quantized matmul: Y = X @ dequant(W)ᵀ (+ bias), in float64.

The kernel is held to this against the *dequantized* weight (its own error); how far dequant(W) is
from the original float weight is measured separately (``references.quant.quantization_error``).
"""
import torch


def quant_matmul(x, qw, bias=None):
    """Y = X @ dequant(W)ᵀ (+ bias) in float64; X (..., K), W the quantized (N, K) weight -> (..., N)."""
    w = qw.dequantize(torch.float64).to(x.device)
    y = x.to(torch.float64) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y
