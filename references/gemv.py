import torch

from tritune.references.gemm import gemm
from tritune.references.layer_norm import layer_norm


def gemv(x, w, bias=None, *, activation=None, residual=None, ln=None, kv=None):
    """act(LN(x) @ w + bias) + residual in float64 (``ln``: (weight, bias, eps) or None). ``kv`` is not
    an input of the result (the cache write is checked against the result by the kernel's own tests)."""
    h = x.double() if ln is None else layer_norm(x, ln[0], ln[1], ln[2])
    return gemm(h, w, bias, activation=activation, residual=residual)
