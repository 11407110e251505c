from tritune.references.gemm import gemm, normed


def gemv(x, w, bias=None, *, activation=None, residual=None, ln=None, rms=None, kv=None):
    """act(norm(x) @ w + bias) + residual in float64, as :func:`tritune.references.gemm.gemm` (``ln``:
    (weight, bias, eps), ``rms``: (weight, eps), or neither; activation None, "gelu_tanh" or "swiglu").
    ``kv`` is not an input of the result (the cache write is checked against the result by the kernel's
    own tests)."""
    return gemm(normed(x, ln, rms), w, bias, activation=activation, residual=residual)
