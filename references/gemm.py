import math

import torch

from tritune.references.layer_norm import layer_norm
from tritune.references.rms_norm import rms_norm


def normed(a, ln=None, rms=None):
    """A in float64 after the prologue: a LayerNorm ``ln`` (weight, bias, eps), an RMSNorm ``rms``
    (weight, eps) (no mean subtracted), or neither."""
    if ln is not None:
        return layer_norm(a, ln[0], ln[1], ln[2])
    if rms is not None:
        return rms_norm(a, rms[0], rms[1])
    return a.double()


def gemm(a, b, bias=None, *, activation=None, residual=None, ln=None, rms=None, kv=None):
    """C = act(norm(A) @ B + bias) + residual in float64; A (..., K), B (K, N), output (..., N).

    activation: None; "gelu_tanh", 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))); or "swiglu": B is the
    concatenated [gate | up] weight (K, 2F) (bias, when given, [gate | up] too), and the output (..., F)
    is silu(g)·u of the two halves of the product, g = norm(A) @ B_gate + bias_gate, u likewise.
    ln: None or (weight, bias, eps), a LayerNorm of each row of A first; rms: None or (weight, eps), an
    RMSNorm instead. ``kv`` is not an input of the result (the kernel's cache write is checked against
    its own output by the kernel's tests).
    """
    c = normed(a, ln, rms) @ b.double()
    if bias is not None:
        c = c + bias.double()
    if activation == "gelu_tanh":
        c = 0.5 * c * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (c + 0.044715 * c**3)))
    elif activation == "swiglu":
        f = c.shape[-1] // 2
        c = torch.nn.functional.silu(c[..., :f]) * c[..., f:]
    elif activation is not None:
        raise ValueError(f"activation: unknown {activation!r}")
    if residual is not None:
        c = c + residual.double().reshape(c.shape)
    return c
