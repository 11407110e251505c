"""GELU, elementwise: exact y = x·Φ(x) = x/2·(1 + erf(x/√2)), or tanh y = x/2·(1 + tanh(√(2/π)(x + 0.044715x³))).

Computed in float32. The tanh form is evaluated as x·sigmoid(2z), the same function without a tanh
(0.5·(1 + tanh z) = sigmoid(2z)) and without overflow for large |z|. Contiguous input takes a flat
1-D path with BLOCK elements per program; any other strides go through a 4-D index decomposition so a
strided view is read in place rather than copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S
from tritune.references import gelu as ref


@triton.jit
def _erfc(z, SHORT: tl.constexpr):
    """erfc(z) for all z as t·exp(p(t) − a²), t = 1/(1 + a/2), a = |z|, reflected for z < 0 as
    erfc(z) = 2 − erfc(−z). One exp: rounding a² costs a relative a²·2⁻²⁴, at most 5e-6 where the result
    is still a normal fp32 number (a < 9.2). Underflows past.

    p is the 10-term Chebyshev fit of Numerical Recipes (erfcc, section 6.2; relative error below
    1.2e-7) for float32 outputs. SHORT (16-bit outputs) takes a 6-term least-squares fit of the same
    function of t over a ≤ 10.5 (relative error below 2e-5, 25x under fp16's unit roundoff 4.9e-4,
    200x under bf16's): four fewer FMAs per element in a kernel that is otherwise memory-bound."""
    a = tl.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    if SHORT:
        p = -1.266733845 + t * (1.020208724 + t * (0.2452628 + t * (
            0.492274459 + t * (-0.725328552 + t * 0.234335728))))
    else:
        p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
            0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    r = t * tl.exp(p - a * a)
    return tl.where(z >= 0, r, 2.0 - r)


@triton.jit
def _gelu_fwd(X, Y, numel, s1, s2, s3, st0, st1, st2, st3,
              APPROX_TANH: tl.constexpr, CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if CONTIGUOUS:
        src = offs
    else:  # offs = ((i0*s1 + i1)*s2 + i2)*s3 + i3 over the 4-D shape (s0, s1, s2, s3)
        i3 = offs % s3
        r = offs // s3
        i2 = r % s2
        r = r // s2
        i1 = r % s1
        i0 = r // s1
        src = i0 * st0 + i1 * st1 + i2 * st2 + i3 * st3
    if EVICT:  # streamed once: no line of x or y is worth keeping in L2
        x = tl.load(X + src, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(X + src, mask=mask, other=0.0).to(tl.float32)
    if APPROX_TANH:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * z))
    else:
        # x·Φ(x) = x/2·erfc(−x/√2). Written with erfc, not 1 + erf: for x < −5, 1 + erf(x/√2) cancels to
        # nothing in fp32 (torch's own fp32 GELU returns 0 at x = −6, 100% relative error).
        # (CUDA's erfcf is as accurate but measured 2x slower on an H200: 506 vs 259 µs for the tanh form
        # at 268M elements, where the bandwidth floor is 224 µs.)
        y = 0.5 * x * _erfc(-x * 0.7071067811865476, Y.dtype.element_ty != tl.float32)
    if EVICT:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    else:
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    numel: int
    approximate: str = "none"     # "none" (erf) or "tanh"


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def problem_of(x, approximate="none", **_) -> Problem:
    return Problem(x.numel(), approximate)


class _Plan:
    """The checks, config, grid and launch arguments for one combination of metadata (K.PlanCache)."""
    __slots__ = ("copy", "n", "grid", "ints", "kws", "cfg", "cfg_key")


_PLANS = K.PlanCache()


def _plan(x, approximate, out, config) -> _Plan:
    K.check_tensor("x", x, dtypes=DTYPES)
    K.check_device("x", x)
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    if out is not None:
        K.check_out(out, x.shape, x.dtype, x.device)
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
    p = _Plan()
    contiguous = x.is_contiguous()
    p.copy = not contiguous and x.dim() > 4  # beyond 4 strided dims: one copy, still correct
    contiguous = contiguous or p.copy
    p.n = x.numel()
    if p.n == 0:
        p.cfg = p.cfg_key = None
        return p
    p.cfg, p.cfg_key = SPEC.config_and_key(Problem(p.n, approximate), x.dtype, config)
    if contiguous:  # the flat path reads no shape or strides (and a > 4-D shape would not fit them)
        shape, strides = [1, 1, 1, p.n], [0, 0, 0, 1]
    else:
        shape = [1] * (4 - x.dim()) + list(x.shape)
        strides = [0] * (4 - x.dim()) + list(x.stride())
    block = p.cfg["BLOCK"]
    p.grid = (triton.cdiv(p.n, block),)
    p.ints = (p.n, shape[1], shape[2], shape[3], *strides)
    p.kws = dict(APPROX_TANH=approximate == "tanh", CONTIGUOUS=contiguous, BLOCK=block,
                 EVICT=p.cfg.get("EVICT", False), num_warps=p.cfg["num_warps"])
    return p


def gelu(x, approximate: str = "none", *, out=None, config: dict | None = None):
    """GELU of ``x`` (any shape up to 4-D for strided views, any shape when contiguous). ``out`` may be
    ``x`` itself (in place); any other overlap with x is refused."""
    try:  # the hot path: one dict lookup; anything odd takes _plan, which names the bad argument
        key = (x.shape, x.stride(), x.dtype, x.device, approximate, K.tensor_meta(out),
               None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(x, approximate, out, config))
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:  # elementwise: out=x in place is safe (each element read by the program that writes it)
        K.check_no_alias(out, (("x", x),), "x")
    if plan.n == 0:
        return out
    if plan.copy:
        x = x.contiguous()
    _gelu_fwd[plan.grid](x, out, *plan.ints, **plan.kws)
    return out


# ---------------------------------------------------------------------------------------------------
def _constraint(c, p: Problem, dtype) -> str | None:
    if c["BLOCK"] > max(128, triton.next_power_of_2(p.numel)):
        return "BLOCK larger than the tensor"
    per_thread = c["BLOCK"] // (32 * c["num_warps"])
    if per_thread > 64:
        return f"{per_thread} elements per thread"
    if per_thread < 1:
        return "idle threads"
    return None


SPACE = K.Space(
    params={"BLOCK": [128, 256, 512, 1024, 2048, 4096, 8192, 16384], "num_warps": [1, 2, 4, 8, 16],
            "EVICT": [False, True]},
    constraint=_constraint,
)


def default_config(p: Problem, dtype) -> dict:
    """32 elements per thread in 2-warp programs: of the 31 valid points, the one whose worst case over the
    standard problems is best on an H100 (docs/findings.md). Tuned entries in the store refine it per
    bucket."""
    block = min(2048, max(128, triton.next_power_of_2(p.numel)))
    return {"BLOCK": block, "num_warps": max(1, min(2, block // 512)), "EVICT": False}


def bucket(p: Problem) -> dict:
    return {"numel": triton.next_power_of_2(p.numel), "approximate": p.approximate}


def cost(p: Problem, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    return K.Cost(flops=10.0 * p.numel, bytes=2.0 * e * p.numel)


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    # a 2-D shape whose rows are not a power of two, so "transposed" and "sliced" mean something
    cols = next((c for c in (768, 257, 61, 13, 7, 3) if p.numel % c == 0 and p.numel > c), 1)
    x = S.with_layout(S.randn((p.numel // cols, cols), dtype, device, seed, scale=3.0), layout)
    return K.Case(args=(x,), kwargs={"approximate": p.approximate},
                  out=torch.empty(x.shape, dtype=dtype, device=device))


def problems(max_elems: int):
    from hypothesis import strategies as st

    return st.builds(Problem, S.sizes(max_elems), st.sampled_from(["none", "tanh"]))


def _vendor(c: K.Case):
    (x,) = c.args
    return lambda: torch.nn.functional.gelu(x, approximate=c.kwargs["approximate"])


def _bad_inputs(device):
    x = torch.randn(5, 7, device=device)
    return [
        ("integer x", lambda: gelu(x.to(torch.int64)), TypeError),
        ("float64 x", lambda: gelu(x.double()), TypeError),
        ("x on the wrong device", lambda: gelu(x.to("meta")), ValueError),
        ("unknown approximation", lambda: gelu(x, approximate="fast"), ValueError),
        ("out of the wrong dtype", lambda: gelu(x, out=torch.empty(5, 7, dtype=torch.float16, device=device)), TypeError),
    ]


SPEC = K.register(K.KernelSpec(
    name="gelu",
    description="GELU (erf or tanh), elementwise, strided",
    run=gelu,
    reference=ref.gelu,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(8192 * 768), Problem(8192 * 768, "tanh"), Problem(65536 * 4096),
                       Problem(65536 * 4096, "tanh"), Problem(16384 * 8192)],
    small_problems=[Problem(64 * 768), Problem(1021, "tanh")],
    layouts=("contiguous", "sliced", "transposed"),
    vendor=_vendor,
    vendor_name="F.gelu",
    bad_inputs=_bad_inputs,
))
