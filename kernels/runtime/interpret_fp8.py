"""FP8 conversions for Triton's interpreter (the CPU path), which rounds them wrong.

The interpreter loads e4m3/e5m2 as raw bytes and computes fp8 ``tl.dot`` right (operands widened exactly
to float16, float32 accumulation), but its conversion *to* fp8 (``x.to(tl.float8e4nv)``) is a bit
manipulation that is wrong in several ways (triton 3.9): a mantissa that rounds up past 7 does not carry
into the exponent (0.4956 -> 0.25, 31.04 -> 16), ties round up instead of to even, the subnormal range
(|x| < 2^-6 for e4m3) comes out wrong, and values past the largest finite one give garbage or NaN where
the GPU's ``cvt.rn.satfinite`` saturates to ±448. Widening fp8 -> float also reads e4m3's NaN codes
(0x7F, 0xFF) as 480. Here the builder's fp8 conversions go through torch: round to nearest even,
saturated to the format's largest finite value (NaN kept), the GPU's conversion.

Only conversions with an fp8 operand are taken over; everything else goes to the builder as it was
(bf16 included: :mod:`interpret_bf16`'s patch is applied first). :func:`check` runs a probe kernel;
launchers of kernels that convert to fp8 call :func:`require`, which refuses clearly when this triton's
interpreter could not be patched or still converts wrong.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from tritune.kernels.runtime import interpret_bf16 as bf16

PATCHED = False
_WHY_NOT = ""
# triton's fp8 type names -> (torch dtype, largest finite value)
FORMATS = {"fp8e4nv": (torch.float8_e4m3fn, 448.0), "fp8e5": (torch.float8_e5m2, 57344.0)}
_NP = {"fp32": np.float32, "fp16": np.float16, "fp64": np.float64}


def _fmt(dtype):
    return FORMATS.get(getattr(dtype, "name", None))


def _values(handle, tl) -> np.ndarray:
    """A handle's elements as numpy floats (fp8 and bf16 widened exactly)."""
    s = handle.dtype.scalar
    f = _fmt(s)
    if f is not None:
        bits = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.uint8))
        return bits.view(f[0]).float().numpy()
    if s == tl.bfloat16:
        return bf16.to_f32(handle.data)
    return handle.data


def to_fp8(values: np.ndarray, name: str) -> np.ndarray:
    """Values -> fp8 bits (uint8): round to nearest even, saturated to the largest finite value, NaN kept."""
    dtype, top = FORMATS[name]
    t = torch.from_numpy(np.ascontiguousarray(values))
    return t.clamp(-top, top).to(dtype).view(torch.uint8).numpy()


def apply() -> bool:
    """Patch the interpreter's fp8 conversions (idempotent). Returns whether they are patched."""
    global PATCHED, _WHY_NOT
    if PATCHED:
        return True
    bf16.apply()   # first, so the fp8 conversions wrap it (a bf16 source or target is handled here)
    try:
        import triton.language as tl
        from triton.runtime import interpreter as I

        B, TensorHandle = I.InterpreterBuilder, I.TensorHandle
        orig = {n: getattr(B, n) for n in ("create_fp_to_fp", "cast_impl")}
    except (ImportError, AttributeError) as e:  # another triton: require() refuses
        _WHY_NOT = f"this triton's interpreter has no {e}"
        return False

    def convert(src, dst_type):
        t = dst_type.scalar
        vals = _values(src, tl)
        if _fmt(t) is not None:
            return TensorHandle(to_fp8(vals, t.name), t)
        if t == tl.bfloat16:
            return TensorHandle(bf16.to_bf16(vals), t)
        return TensorHandle(np.asarray(vals).astype(_NP.get(t.name, np.float32)), t)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if _fmt(src.dtype.scalar) is None and _fmt(dst_type.scalar) is None:
            return orig["create_fp_to_fp"](self, src, dst_type, rounding_mode)
        return convert(src, dst_type)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        floats = s.is_floating() and t.is_floating()
        if not floats or (_fmt(s) is None and _fmt(t) is None):
            return orig["cast_impl"](self, src, dst_type)
        return convert(src, dst_type)

    B.create_fp_to_fp, B.cast_impl = create_fp_to_fp, cast_impl
    PATCHED = True
    return True


@functools.lru_cache(maxsize=None)
def check() -> str | None:
    """None when conversions to and from e4m3 compute as on the GPU under the patched interpreter (ties,
    carries into the exponent, subnormals, saturation); else what is wrong."""
    if not apply():
        return _WHY_NOT
    import triton
    import triton.language as tl

    @triton.jit
    def probe(X, Q, Y, N: tl.constexpr):
        r = tl.arange(0, N)
        q = tl.load(X + r).to(tl.float8e4nv)
        tl.store(Q + r, q)
        tl.store(Y + r, q.to(tl.float32) * 2.0)

    codes = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()[:127]   # finite, >= 0
    mids = (codes[1:] + codes[:-1]) / 2
    x = torch.cat([codes, mids, -mids, torch.tensor([0.4956, 31.04, 1e-4, 465.0, 1e4, -1e4])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    q = torch.empty(n, dtype=torch.float8_e4m3fn)
    y = torch.empty(n)
    try:
        probe[(1,)](x, q, y, N=n)
    except Exception as e:  # pragma: no cover - a triton whose interpreter differs
        return f"an fp8 probe kernel failed under the interpreter: {type(e).__name__}: {e}"
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    if not torch.equal(q.view(torch.uint8), want.view(torch.uint8)) or not torch.equal(y, want.float() * 2):
        return "fp8 conversions under this triton's interpreter are still wrong after tritune's patch"
    return None


def require(what: str) -> None:
    """Raise a clear error when fp8 conversions cannot be computed correctly under the interpreter."""
    why = check()
    if why is not None:
        raise NotImplementedError(f"{what}: fp8 conversions need a GPU here: the Triton interpreter rounds "
                                  f"float -> e4m3 wrong and {why}")
