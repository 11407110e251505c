"""Error metrics, the one tolerance table, output poisoning and the "every element written" check.

All comparisons go through :func:`check`: ``‖out − ref‖ / ‖ref‖`` computed in float64, against a
tolerance looked up by output dtype and accumulation mode. Tolerances live here and only here; a test
never passes its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Relative Frobenius error allowed, by (dtype, accumulation). The numbers come from the unit roundoff u
# of the storage type: rounding every output alone gives ~u/sqrt(3) relative error (fp16 u=2^-11,
# bf16 u=2^-8 truncated / 2^-9 rounded), and kernels that round an intermediate (attention's P, a GEMM
# output fed to an epilogue) add a few more u. "tf32" is fp32 data through tensor cores with a 10-bit
# mantissa (u=2^-11) on the operands; "ieee" is true fp32 arithmetic.
TOLERANCE = {
    (torch.float32, "ieee"): 1e-5,
    (torch.float32, "tf32"): 2e-3,
    (torch.float16, "ieee"): 2e-3,
    (torch.bfloat16, "ieee"): 1e-2,
    (torch.float64, "ieee"): 1e-12,
}


def tolerance(dtype: torch.dtype, accumulation: str = "ieee") -> float:
    try:
        return TOLERANCE[(dtype, accumulation)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype={dtype}, accumulation={accumulation!r}") from None


CHUNK = 1 << 24  # elements per float64 slice: the comparison's memory stays ~0.5 GB whatever the tensor


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)


def _slices(out: torch.Tensor, ref: torch.Tensor):
    """Aligned float64 slices of the flattened tensors, on ``out``'s device (a GPU compares on the GPU:
    a 268M-element check copied to the CPU took ~80 s of the GPU test suite)."""
    o, r = _flat(out), _flat(ref)
    for i in range(0, o.numel(), CHUNK):
        yield (o[i:i + CHUNK].to(torch.float64),
               r[i:i + CHUNK].to(device=o.device, dtype=torch.float64))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖₂ / ‖ref‖₂ in float64 over the finite entries of ``ref``. NaN anywhere in ``out``, or
    an infinity where the reference has none (or one of the other sign), gives inf: never passes. An
    infinity the reference has too (the −inf log-sum-exp of a row that sees no key) must match exactly.
    Computed in slices on ``out``'s device."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    num2 = den2 = 0.0
    for o, r in _slices(out, ref):
        fin = torch.isfinite(r)
        if not bool(fin.all()):
            if not torch.equal(o[~fin], r[~fin]):  # NaN != NaN, so a NaN reference entry never passes either
                return math.inf
            o, r = o[fin], r[fin]
        if not bool(torch.isfinite(o).all()):
            return math.inf
        den2 += torch.linalg.vector_norm(r).item() ** 2
        num2 += torch.linalg.vector_norm(o - r).item() ** 2
    num, denom = math.sqrt(num2), math.sqrt(den2)
    if denom == 0.0:
        return num
    return num / denom


# Poison: a quiet NaN with a payload no arithmetic produces (the GPU's and the CPU's NaNs are canonical), so an
# element still holding these bits was never written, and any other NaN was written as NaN.
POISON_BITS = {torch.float16: (torch.int16, 0x7E5A), torch.bfloat16: (torch.int16, 0x7FDA),
               torch.float32: (torch.int32, 0x7FD5A5A5), torch.float64: (torch.int64, 0x7FFDA5A5A5A5A5A5)}


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with the poison NaN (:data:`POISON_BITS`; the max value for integer tensors) so an unwritten
    element cannot pass and is told apart from one written as NaN."""
    if t.dtype in POISON_BITS:
        as_int, bits = POISON_BITS[t.dtype]
        t.view(as_int).fill_(bits)
        return t
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return poison(torch.empty_like(t, memory_format=torch.contiguous_format))


def is_poison(t: torch.Tensor) -> torch.Tensor:
    """Where ``t`` still holds the poison's bits (all False for dtypes without a poison payload)."""
    if t.dtype not in POISON_BITS:
        return torch.zeros(t.shape, dtype=torch.bool, device=t.device)
    as_int, bits = POISON_BITS[t.dtype]
    return t.detach().view(as_int) == bits


def unwritten(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Count elements of ``out`` still holding the poison where the reference is finite (with a plain NaN
    poison, a dtype without a payload: every NaN there)."""
    return _count_nan(out, ref, poisoned=True)


def written_nan(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Count elements of ``out`` that are NaN but not the poison where the reference is finite: written NaN."""
    return _count_nan(out, ref, poisoned=False)


def _count_nan(out: torch.Tensor, ref: torch.Tensor, poisoned: bool) -> int:
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    flat, mark = _flat(out), _flat(is_poison(out))
    r = _flat(ref)
    n = 0
    for i in range(0, flat.numel(), CHUNK):
        nan = torch.isnan(flat[i:i + CHUNK]) & torch.isfinite(r[i:i + CHUNK].to(flat.device))
        if out.dtype in POISON_BITS:
            m = mark[i:i + CHUNK]
            nan &= m if poisoned else ~m
        elif not poisoned:
            continue
        n += int(nan.sum())
    return n


def representation_error(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative error of the exact answer merely stored in ``dtype``: no kernel can beat it."""
    if dtype == torch.float64:
        return 0.0
    num2 = den2 = 0.0
    for _, r in _slices(ref, ref):
        r = r[torch.isfinite(r)]
        den2 += torch.linalg.vector_norm(r).item() ** 2
        num2 += torch.linalg.vector_norm(r.to(dtype).to(torch.float64) - r).item() ** 2
    return math.sqrt(num2) / math.sqrt(den2) if den2 else math.sqrt(num2)


@dataclass
class Comparison:
    error: float
    tol: float
    unwritten: int
    what: str = "out"
    nan: int = 0        # elements written as NaN (not the poison) where the reference is finite

    @property
    def ok(self) -> bool:
        return self.unwritten == 0 and self.nan == 0 and self.error <= self.tol

    def __str__(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{self.what}: rel error {self.error:.3e} (tol {self.tol:.1e}), "
                f"{self.unwritten} unwritten (still the poison), {self.nan} written as NaN -> {verdict}")


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None,
            accumulation: str = "ieee", what: str = "out") -> Comparison:
    dtype = dtype or out.dtype
    # The table's tolerance, but never below twice what storing the exact answer in the output type
    # costs. For ordinary data that floor is ~u/sqrt(3), far under the table; it only matters where the
    # answer underflows the output type (GELU of x = -6 in fp16 is -6e-9: unrepresentable).
    tol = max(tolerance(dtype, accumulation), 2.0 * representation_error(ref, out.dtype))
    return Comparison(rel_error(out, ref), tol, unwritten(out, ref), what, written_nan(out, ref))


def check(out, ref, dtype=None, accumulation="ieee", what="out") -> Comparison:
    """Assert ``out`` matches ``ref``; outputs may be tensors or tuples of tensors."""
    if isinstance(out, (tuple, list)):
        if not isinstance(ref, (tuple, list)) or len(ref) != len(out):
            raise AssertionError(f"{what}: expected {len(out)} reference outputs")
        return [check(o, r, dtype, accumulation, f"{what}[{i}]") for i, (o, r) in enumerate(zip(out, ref))]
    c = compare(out, ref, dtype, accumulation, what)
    if not c.ok:
        raise AssertionError(str(c))
    return c
