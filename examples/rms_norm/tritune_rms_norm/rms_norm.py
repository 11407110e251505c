"""RMSNorm over the last dim: y = x · rsqrt(mean(x²) + eps) · w, statistics in float32.

A kernel outside tritune, written against its public API only: kernel, launcher, float64 reference and
the KernelSpec that lets tritune test, tune and benchmark it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import Case, Cost, KernelSpec, PlanCache, Space, check_device, check_out, check_tensor, randn, \
    register, sizes, tensor_meta, with_layout

MAX_N = 16384  # one pass from registers: the whole row is one block


@triton.jit
def _rms_norm_fwd(X, W, Y, M, N, stride_xm, stride_xn, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_n = tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    x = tl.load(X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=mask,
                other=0.0).to(tl.float32)
    w = tl.load(W + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], y.to(Y.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Problem:
    M: int
    N: int


_PLANS = PlanCache()


def _plan(x, weight, eps, out, config):
    check_tensor("x", x, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    check_device("x", x)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,))
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device}, got {weight.device}")
    M, N = x.shape
    if not 1 <= N <= MAX_N:
        raise ValueError(f"x: rows of 1 to {MAX_N} elements supported, got {N}")
    if weight.shape[0] != N:
        raise ValueError(f"weight: expected {N} elements (x's last dim), got {weight.shape[0]}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"eps: expected a positive float, got {eps!r}")
    if out is not None:
        check_out(out, (M, N), x.dtype, x.device)
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
    cfg, cfg_key = SPEC.config_and_key(Problem(M, N), x.dtype, config)
    grid = (triton.cdiv(M, cfg["ROWS"]),)
    return _Plan(cfg, cfg_key, grid)


@dataclass
class _Plan:
    cfg: dict
    cfg_key: tuple | None
    grid: tuple


def rms_norm(x, weight, eps: float = 1e-6, *, out=None, config: dict | None = None):
    """RMSNorm over the last dim of a 2-D ``x`` (any strides); returns ``out`` (contiguous, x's dtype)."""
    try:  # the hot path is a dict lookup; anything odd goes through _plan, which names the bad argument
        key = (x.shape, x.stride(), x.dtype, x.device, tensor_meta(weight), eps, tensor_meta(out),
               None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(x, weight, eps, out, config))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if x.shape[0]:
        c = plan.cfg
        _rms_norm_fwd[plan.grid](x, weight.contiguous(), out, x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                                 eps, BLOCK_N=c["BLOCK_N"], ROWS=c["ROWS"], num_warps=c["num_warps"])
    return out


def reference(x, weight, eps: float = 1e-6):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * weight.double()


# --- the spec: what tritune needs to test, tune and benchmark the kernel ------------------------------
def _constraint(c, p: Problem, dtype) -> str | None:
    if c["BLOCK_N"] != max(16, triton.next_power_of_2(p.N)):
        return "BLOCK_N must be the row length rounded up to a power of two"
    if c["ROWS"] > triton.next_power_of_2(p.M):
        return "ROWS larger than the problem"
    if c["BLOCK_N"] * c["ROWS"] // (32 * c["num_warps"]) > 64:
        return "more than 64 elements per thread (register spills)"
    return None


SPACE = Space(params={"BLOCK_N": [2 ** k for k in range(4, 15)], "ROWS": [1, 2, 4, 8, 16],
                      "num_warps": [1, 2, 4, 8, 16]}, constraint=_constraint)


def default_config(p: Problem, dtype) -> dict:
    block = max(16, triton.next_power_of_2(p.N))
    rows = max(1, min(16, 1024 // block, triton.next_power_of_2(p.M)))
    warps = max(1, min(16, block * rows // 512))
    return {"BLOCK_N": block, "ROWS": rows, "num_warps": warps}


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> Case:
    x = with_layout(randn((p.M, p.N), dtype, device, seed, scale=2.0, shift=0.3), layout)
    w = randn((p.N,), dtype, device, seed + 1, scale=0.5, shift=1.0)
    return Case(args=(x, w), kwargs={"eps": 1e-6}, out=torch.empty((p.M, p.N), dtype=dtype, device=device))


def problems(max_elems: int):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        n = d(sizes(min(MAX_N, max_elems)))
        return Problem(d(sizes(max(1, min(4096, max_elems // n)))), n)

    return draw()


def _liger(c: Case):
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    x, w = c.args
    return lambda: LigerRMSNormFunction.apply(x, w, c.kwargs["eps"])


def _bad_inputs(device):
    x, w = torch.randn(4, 8, device=device), torch.ones(8, device=device)
    return [("integer x", lambda: rms_norm(x.int(), w), TypeError),
            ("3-D x", lambda: rms_norm(x[None], w), ValueError),
            ("weight of the wrong length", lambda: rms_norm(x, w[:7]), ValueError),
            ("weight of another dtype", lambda: rms_norm(x, w.half()), TypeError),
            ("eps <= 0", lambda: rms_norm(x, w, eps=0.0), ValueError),
            ("rows too long", lambda: rms_norm(torch.randn(1, MAX_N + 1, device=device),
                                               torch.ones(MAX_N + 1, device=device)), ValueError),
            ("out of the wrong shape", lambda: rms_norm(x, w, out=torch.empty(4, 9, device=device)), ValueError)]


SPEC = register(KernelSpec(
    name="my_rms_norm", description="RMSNorm forward (an example plugin kernel)",
    run=rms_norm, reference=reference, make_inputs=make_inputs, problems=problems, space=SPACE,
    default_config=default_config, bucket=lambda p: {"M": triton.next_power_of_2(p.M), "N": p.N},
    cost=lambda p, dtype: Cost(flops=4.0 * p.M * p.N, bytes=torch.finfo(dtype).bits / 8 * (2 * p.M * p.N + p.N)),
    problem_of=lambda x, weight, eps=1e-6, **kw: Problem(*x.shape),
    standard_problems=[Problem(8192, 768), Problem(16384, 4096), Problem(4096, 8192)],
    small_problems=[Problem(64, 768), Problem(3, 2053)],
    layouts=("contiguous", "sliced", "transposed"),
    vendor=lambda c: (lambda: torch.nn.functional.rms_norm(c.args[0], (c.args[0].shape[-1],), c.args[1],
                                                           c.kwargs["eps"])),
    vendor_name="F.rms_norm", peers={"liger": _liger}, bad_inputs=_bad_inputs,
))
