import math

import torch

from tritune.references.layer_norm import layer_norm


def gemm(a, b, bias=None, *, activation=None, residual=None, ln=None, kv=None):
    """C = act(LN(A) @ B + bias) + residual in float64; A (..., K), B (K, N), output (..., N).

    activation: None or "gelu_tanh", 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))). ln: None or (weight,
    bias, eps), a LayerNorm of each row of A first. ``kv`` is not an input of the result (the kernel's
    cache write is checked against its own output by the kernel's tests).
    """
    h = a.double() if ln is None else layer_norm(a, ln[0], ln[1], ln[2])
    c = h @ b.double()
    if bias is not None:
        c = c + bias.double()
    if activation == "gelu_tanh":
        c = 0.5 * c * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (c + 0.044715 * c**3)))
    elif activation is not None:
        raise ValueError(f"activation: unknown {activation!r}")
    if residual is not None:
        c = c + residual.double().reshape(c.shape)
    return c
