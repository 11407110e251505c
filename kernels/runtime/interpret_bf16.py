"""bfloat16 arithmetic for Triton's interpreter (the CPU path), which computes it wrong, and a dot whose rows
do not depend on the tile's row count.

The interpreter stores bf16 as its raw 16 bits in numpy ``uint16`` arrays and then does integer
arithmetic on them: ``tl.dot``, ``+ - * /``, comparisons, math functions and reductions on bf16 return
values around 1e8-1e11 (triton 3.9, triton-lang/triton#11584), and fp32 -> bf16 casts truncate
where the GPU rounds to nearest even. Here the interpreter's builder computes each bf16 operation in
float32 and rounds the result to bf16 (round to nearest even, through torch): a single add, subtract or
multiply of bf16 operands rounded so is the correctly rounded bf16 result, what the GPU computes.
Every float ``tl.dot`` (bf16 or not) is computed by :func:`row_invariant_dot`: numpy's matmul would hand it to
BLAS, whose summation order follows the tile's shape and the CPU, and a row's bits would then depend on the
rows beside it (what the batch-invariance tests hold the kernels to). :func:`adopt_compiled_functions` runs
interpreted the functions ``@triton.jit`` made before the interpreter was switched on.

Nothing here touches a GPU run: it patches classes of ``triton.runtime.interpreter`` (and how a
compiled-kernel object launches), once, and only when the interpreter is on. :func:`check` runs a tiny bf16 kernel through the patched
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


_BUILDER_OPS = ("binary_op", "unary_op", "ternary_op", "create_dot", "cast_impl", "create_fp_to_fp", "create_fma")
_REDUCE_OPS = ("sum", "min_max", "generic_reduce")


def apply() -> bool:
    """Patch the interpreter's builder (idempotent). Returns whether it is patched."""
    global PATCHED, _WHY_NOT
    if PATCHED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as I

        B, R = I.InterpreterBuilder, I.ReduceOps
        b_orig = {n: getattr(B, n) for n in _BUILDER_OPS}
        r_orig = {n: getattr(R, n) for n in _REDUCE_OPS}
        _ = I.TensorHandle  # what every patch builds
    except (ImportError, AttributeError) as e:  # another triton: require() refuses bf16 launches
        _WHY_NOT = f"this triton's interpreter has no {e}"
        return False
    # the builder's bound lambdas (create_fadd = lambda self, ...: self.binary_op(...)) pick these up;
    # the casts are lambdas over cast_impl too
    for name, fn in {**_arith_patches(I, tl, b_orig), **_cast_patches(I, tl, b_orig)}.items():
        setattr(B, name, fn)
    for name, fn in _reduce_patches(I, tl, r_orig).items():
        setattr(R, name, fn)
    PATCHED = True
    return True


def _is_bf16(h, tl) -> bool:
    return getattr(getattr(h, "dtype", None), "scalar", None) == tl.bfloat16


def row_invariant_dot(a: np.ndarray, b: np.ndarray, out_dtype) -> np.ndarray:
    """``a @ b`` rounded to ``out_dtype``, each output element summed over k in one fixed order.

    numpy's matmul hands float tiles to BLAS, whose kernel (and so the order it sums in) depends on the
    tile's shape and the CPU: a row's products could then change with the number of rows beside it, and
    batch invariance would hold on one CPU and not on another. Products of float16/bfloat16/float32 values
    are exact in float64; einsum without ``optimize`` never calls BLAS and sums each element sequentially."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.einsum("...ik,...kj->...ij", a64, b64, optimize=False).astype(out_dtype)


def _arith_patches(I, tl, orig) -> dict:
    TensorHandle, bf16 = I.TensorHandle, tl.bfloat16

    def f32(h):
        return to_f32(h.data) if _is_bf16(h, tl) else h.data

    def binary_op(self, lhs, rhs, op):
        if not (_is_bf16(lhs, tl) or _is_bf16(rhs, tl)):
            return orig["binary_op"](self, lhs, rhs, op)
        out = op(f32(lhs), f32(rhs))
        if out.dtype == np.bool_:  # a comparison: the builder keeps lhs's type on the handle, as the original
            return TensorHandle(out, lhs.dtype.scalar)
        return TensorHandle(to_bf16(out), bf16)

    def unary_op(self, arg, op):
        if not _is_bf16(arg, tl):
            return orig["unary_op"](self, arg, op)
        return TensorHandle(to_bf16(op(to_f32(arg.data))), bf16)

    def ternary_op(self, a, b, c, op):  # select and clamp: bf16 operands as values
        if not (_is_bf16(b, tl) or _is_bf16(c, tl)):
            return orig["ternary_op"](self, a, b, c, op)
        out = op(f32(a) if _is_bf16(a, tl) else a.data, f32(b), f32(c))
        return TensorHandle(to_bf16(out), c.dtype.scalar)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # every float dot, not only bf16 ones: a row's result must not depend on the tile's row count
        floats = a.dtype.is_floating() and b.dtype.is_floating() and d.data.dtype.kind == "f"
        if not floats or a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return orig["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)
        return TensorHandle(row_invariant_dot(f32(a), f32(b), d.data.dtype) + d.data, d.dtype.scalar)

    def create_fma(self, x, y, z):
        if not (_is_bf16(x, tl) or _is_bf16(y, tl) or _is_bf16(z, tl)):
            return orig["create_fma"](self, x, y, z)
        out = np.add(np.multiply(f32(x), f32(y), dtype=np.float64), f32(z), dtype=np.float64)
        return TensorHandle(to_bf16(out), bf16)

    return dict(binary_op=binary_op, unary_op=unary_op, ternary_op=ternary_op, create_dot=create_dot,
                create_fma=create_fma)


def _cast_patches(I, tl, orig) -> dict:
    TensorHandle, bf16 = I.TensorHandle, tl.bfloat16

    def cast_impl(self, src, dst_type):
        s, t = src.dtype.scalar, dst_type.scalar
        if s == bf16 and t == bf16:
            return TensorHandle(src.data, bf16)
        if t == bf16:  # from any float or integer: the value, rounded to nearest even
            return TensorHandle(to_bf16(src.data.astype(np.float64).astype(np.float32) if src.data.dtype.kind in "iub"
                                        else src.data), bf16)
        if s == bf16:
            return TensorHandle(to_f32(src.data).astype(I._get_np_dtype(dst_type)), t)
        return orig["cast_impl"](self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        s, t = src.dtype.scalar, dst_type.scalar
        if t == bf16 and s in (tl.float32, tl.float16, tl.float64) and rounding_mode != I._ir.ROUNDING_MODE.RTZ:
            return TensorHandle(to_bf16(src.data), bf16)
        if s == bf16 and t in (tl.float32, tl.float16, tl.float64):
            return TensorHandle(to_f32(src.data).astype(I._get_np_dtype(dst_type)), t)
        return orig["create_fp_to_fp"](self, src, dst_type, rounding_mode)

    return dict(cast_impl=cast_impl, create_fp_to_fp=create_fp_to_fp)


def _reduce_patches(I, tl, orig) -> dict:
    TensorHandle, bf16 = I.TensorHandle, tl.bfloat16

    def retensor(bits, dtype):
        bits = np.asarray(bits, dtype=np.uint16)
        if bits.shape:
            return tl.core.tensor(TensorHandle(bits, dtype.scalar), tl.block_type(dtype, list(bits.shape)))
        return tl.core.tensor(TensorHandle(bits.reshape(1), dtype.scalar), dtype)

    def r_sum(self, input):
        if input.dtype.scalar != bf16:
            return orig["sum"](self, input)
        out = np.sum(to_f32(input.handle.data), axis=self.axis, keepdims=self.keep_dims, dtype=np.float32)
        return retensor(to_bf16(out), input.dtype)

    def r_min_max(self, input, val_reduce_op, idx_reduce_op=None):
        x = input[0] if isinstance(input, tuple) else input
        if x.dtype.scalar != bf16:
            return orig["min_max"](self, input, val_reduce_op, idx_reduce_op)
        data = to_f32(x.handle.data)
        val = idx = None
        if val_reduce_op:
            val = retensor(to_bf16(val_reduce_op(data, axis=self.axis, keepdims=self.keep_dims)), x.dtype)
        if idx_reduce_op:
            idx = self.to_tensor(idx_reduce_op(data, axis=self.axis, keepdims=self.keep_dims), tl.int32)
        if val is not None and idx is not None:
            return val, idx
        return val if val is not None else idx

    def r_generic(self, input):
        if any(a.dtype.scalar == bf16 for a in input):
            raise NotImplementedError("a custom tl.reduce over bfloat16 under the Triton interpreter")
        return orig["generic_reduce"](self, input)

    return dict(sum=r_sum, min_max=r_min_max, generic_reduce=r_generic)


def adopt_compiled_functions() -> bool:
    """Under the interpreter, run interpreted the functions ``@triton.jit`` made before it was switched on.

    Triton picks compiled or interpreted when a function is decorated (``TRITON_INTERPRET`` read then):
    where triton was imported before tritune switched the interpreter on (``import transformers`` imports
    it; so does a user's kernel module imported first), those functions are compiled-kernel objects, and
    on a machine without a GPU a launch fails (no driver) and a call from an interpreted kernel fails
    ("Cannot call @triton.jit'd outside of the scope of a kernel": triton's own ``tl.sum`` helpers are
    such functions). Here a compiled-kernel object launches and calls through an interpreted twin of its
    Python function. Idempotent; returns whether it is in place."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:  # another triton: its own behaviour stands
        return False
    if getattr(JITFunction, "_tritune_adopted", False):
        return True

    def twin(self):
        f = self.__dict__.get("_tritune_interpreted")
        if f is None:
            f = self.__dict__["_tritune_interpreted"] = InterpretedFunction(self.fn)
        return f

    def run(self, *args, grid, warmup, **kwargs):
        return twin(self).run(*args, grid=grid, warmup=warmup, **kwargs)

    def call(self, *args, **kwargs):
        return twin(self)(*args, **kwargs)

    JITFunction.run, JITFunction.__call__, JITFunction._tritune_adopted = run, call, True
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
