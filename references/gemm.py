import math

import torch


def gemm(a, b, bias=None, *, activation=None, residual=None):
    """C = act(A @ B + bias) + residual in float64; A (..., K), B (K, N), output (..., N).

    activation: None or "gelu_tanh", 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))).
    """
    c = a.double() @ b.double()
    if bias is not None:
        c = c + bias.double()
    if activation == "gelu_tanh":
        c = 0.5 * c * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (c + 0.044715 * c**3)))
    elif activation is not None:
        raise ValueError(f"activation: unknown {activation!r}")
    if residual is not None:
        c = c + residual.double().reshape(c.shape)
    return c
