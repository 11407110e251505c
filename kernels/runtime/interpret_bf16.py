"""bfloat16 arithmetic for Triton's interpreter (the CPU path), which computes it wrong.

The interpreter stores bf16 as its raw 16 bits in numpy ``uint16`` arrays and then does integer
arithmetic on them: ``tl.dot``, ``+ - * /``, comparisons, math functions and reductions on bf16 return
values around 1e8-1e11 (triton 3.9, triton-lang/triton#11584), and fp32 -> bf16 casts truncate
where the GPU rounds to nearest even. Here the interpreter's builder computes each bf16 operation in
float32 and rounds the result to bf16 (round to nearest even, through torch): a single add, subtract or
multiply of bf16 operands rounded so is the correctly rounded bf16 result, what the GPU computes.

Nothing here touches compiled (GPU) kernels: it patches classes of ``triton.runtime.interpreter``
only, once, when the interpreter is on. :func:`check` runs a tiny bf16 kernel through the patched
interpreter; launchers call :func:`require` for bf16 launches, which raises a clear error naming the
limitation if this triton's interpreter could not be patched or still computes bf16 wrong.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

PATCHED = False
_WHY_NOT = ""


def to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_bf16(values: np.ndarray) -> np.ndarray:
    """Values -> bf16 bits (uint16), rounded to nearest even (NaN and inf kept), as the GPU's cvt.rn.bf16."""
    f = np.ascontiguousarray(np.asarray(values, dtype=np.float32))
    return torch.from_numpy(f).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def apply() -> bool:
    """Patch the interpreter's builder (idempotent). Returns whether it is patched."""
    global PATCHED, _WHY_NOT
    if PATCHED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as I

        B = I.InterpreterBuilder
        originals = {n: getattr(B, n) for n in ("binary_op", "unary_op", "ternary_op", "create_dot", "cast_impl",
                                                 "create_fp_to_fp", "create_fma")}
        R = I.ReduceOps
        r_orig = {n: getattr(R, n) for n in ("sum", "min_max", "generic_reduce")}
        TensorHandle = I.TensorHandle
    except (ImportError, AttributeError) as e:  # another triton: require() refuses bf16 launches
        _WHY_NOT = f"this triton's interpreter has no {e}"
        return False
    bf16 = tl.bfloat16

    def is_bf16(h) -> bool:
        return getattr(getattr(h, "dtype", None), "scalar", None) == bf16

    def f32(h):
        return to_f32(h.data) if is_bf16(h) else h.data

    def binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return originals["binary_op"](self, lhs, rhs, op)
        out = op(f32(lhs), f32(rhs))
        if out.dtype == np.bool_:  # a comparison: the builder keeps lhs's type on the handle, as the original
            return TensorHandle(out, lhs.dtype.scalar)
        return TensorHandle(to_bf16(out), bf16)

    def unary_op(self, arg, op):
        if not is_bf16(arg):
            return originals["unary_op"](self, arg, op)
        return TensorHandle(to_bf16(op(to_f32(arg.data))), bf16)

    def ternary_op(self, a, b, c, op):  # select and clamp: bf16 operands as values
        if not (is_bf16(b) or is_bf16(c)):
            return originals["ternary_op"](self, a, b, c, op)
        out = op(f32(a) if is_bf16(a) else a.data, f32(b), f32(c))
        return TensorHandle(to_bf16(out), c.dtype.scalar)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (is_bf16(a) or is_bf16(b)):
            return originals["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        return TensorHandle(np.matmul(f32(a), f32(b), dtype=np.float32) + d.data, d.dtype.scalar)

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == bf16 and t == bf16:
            return TensorHandle(src.data, bf16)
        if t == bf16:  # from any float or integer: the value, rounded to nearest even
            return TensorHandle(to_bf16(src.data.astype(np.float64).astype(np.float32) if src.data.dtype.kind in "iub"
                                        else src.data), bf16)
        if s == bf16:
            return TensorHandle(to_f32(src.data).astype(I._get_np_dtype(dst_type)), t)
        return originals["cast_impl"](self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, t = src.dtype.scalar, dst_type.scalar
        if t == bf16 and s in (tl.float32, tl.float16, tl.float64) and rounding_mode != I._ir.ROUNDING_MODE.RTZ:
            return TensorHandle(to_bf16(src.data), bf16)
        if s == bf16 and t in (tl.float32, tl.float16, tl.float64):
            return TensorHandle(to_f32(src.data).astype(I._get_np_dtype(dst_type)), t)
        return originals["create_fp_to_fp"](self, src, dst_type, rounding_mode)

    def create_fma(self, x, y, z):
        if not (is_bf16(x) or is_bf16(y) or is_bf16(z)):
            return originals["create_fma"](self, x, y, z)
        out = np.add(np.multiply(f32(x), f32(y), dtype=np.float64), f32(z), dtype=np.float64)
        return TensorHandle(to_bf16(out), bf16)

    def _retensor(bits, dtype):
        bits = np.asarray(bits, dtype=np.uint16)
        if bits.shape:
            return tl.core.tensor(TensorHandle(bits, dtype.scalar), tl.block_type(dtype, list(bits.shape)))
        return tl.core.tensor(TensorHandle(bits.reshape(1), dtype.scalar), dtype)

    def r_sum(self, input):
        if input.dtype.scalar != bf16:
            return r_orig["sum"](self, input)
        out = np.sum(to_f32(input.handle.data), axis=self.axis, keepdims=self.keep_dims, dtype=np.float32)
        return _retensor(to_bf16(out), input.dtype)

    def r_min_max(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if x.dtype.scalar != bf16:
            return r_orig["min_max"](self, input, val_reduce_op, idx_reduce_op)
        data = to_f32(x.handle.data)
        val = idx = None
        if val_reduce_op:
            val = _retensor(to_bf16(val_reduce_op(data, axis=self.axis, keepdims=self.keep_dims)), x.dtype)
        if idx_reduce_op:
            idx = self.to_tensor(idx_reduce_op(data, axis=self.axis, keepdims=self.keep_dims), tl.int32)
        if val is not None and idx is not None:
            return val, idx
        return val if val is not None else idx

    def r_generic(self, input):
        if any(a.dtype.scalar == bf16 for a in input):
            raise NotImplementedError("a custom tl.reduce over bfloat16 under the Triton interpreter")
        return r_orig["generic_reduce"](self, input)

    B.binary_op, B.unary_op, B.ternary_op, B.create_dot = binary_op, unary_op, ternary_op, create_dot
    B.cast_impl, B.create_fp_to_fp, B.create_fma = cast_impl, create_fp_to_fp, create_fma
    # the builder's bound lambdas (create_fadd = lambda self, ...: self.binary_op(...)) pick these up;
    # the casts are lambdas over cast_impl too
    R.sum, R.min_max, R.generic_reduce = r_sum, r_min_max, r_generic
    PATCHED = True
    return True


@functools.lru_cache(maxsize=None)
def check() -> str | None:
    """None when a bf16 dot, arithmetic, a reduction and a rounding cast compute right on the patched
    interpreter; else what is wrong."""
    if not apply():
        return _WHY_NOT
    import triton
    import triton.language as tl

    @triton.jit
    def probe(A, B, C, S):
        r = tl.arange(0, 16)
        a = tl.load(A + r[:, None] * 16 + r[None, :])
        b = tl.load(B + r[:, None] * 16 + r[None, :])
        c = tl.dot(a, b) + (a - b).to(tl.float32) * 0.0
        tl.store(C + r[:, None] * 16 + r[None, :], c.to(tl.bfloat16))
        tl.store(S + r, tl.sum(a * b, axis=1))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    c = torch.empty(16, 16, dtype=torch.bfloat16)
    s = torch.empty(16, dtype=torch.bfloat16)
    try:
        probe[(1,)](a, b, c, s)
    except Exception as e:  # pragma: no cover - a triton whose interpreter differs
        return f"a bf16 probe kernel failed under the interpreter: {type(e).__name__}: {e}"
    want = (a.float() @ b.float()).to(torch.bfloat16)
    want_s = (a.float() * b.float()).to(torch.bfloat16).float().sum(1)
    if not torch.equal(c, want) or not torch.allclose(s.float(), want_s, rtol=2e-2, atol=1e-2):
        return "bf16 arithmetic under this triton's interpreter is still wrong after tritune's patch"
    return None


def require(what: str) -> None:
    """Raise a clear error when bf16 cannot be computed correctly under the interpreter."""
    why = check()
    if why is not None:
        raise NotImplementedError(f"{what}: bfloat16 needs a GPU here: the Triton interpreter computes bf16 "
                                  f"wrong (triton-lang/triton#11584) and {why}")
