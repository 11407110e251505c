"""Dynamic per-token FP8 quantization: q = e4m3(y / s), s = max|y| / 448 per row (float32, clamped away from
0), where y is the input row itself, its RMSNorm or LayerNorm (``norm=``), or silu(gate) · up of a (M, 2N)
[gate | up] row (``swiglu=True``): the activation side of a W8A8 linear (its scales are ``fp8_gemm``'s
per-row A scales), fused with the op that produces the activation so the bf16 intermediate never reaches
memory.

One program owns BLOCK_M rows. A row that fits one BLOCK_N tile is read once and kept in registers;
longer rows are read again per pass from L2 (the norm's statistics, the row's amax, the quantized store).
y stays float32 throughout; the e4m3 conversion saturates at ±448 (the clamp makes the largest value land
on 448 exactly whatever the division rounds to).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.rows import row_stats
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_fp8
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8 as ref

if dev.interpreted():
    interpret_fp8.apply()   # the interpreter's float -> e4m3 conversion rounds wrong without it

E4M3 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MODES = ("none", "rms", "layer", "swiglu")


@triton.jit
def _tile(X, W, Bias, rows, cols, mask, mean, rstd, N, s_xn,
          MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """y of one (BLOCK_M, BLOCK_N) tile in float32; masked entries 0."""
    x = tl.load(X + rows + cols[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
    if MODE == 3:   # swiglu: gate in columns [0, N), up in [N, 2N)
        u = tl.load(X + rows + (cols[None, :] + N) * s_xn, mask=mask, other=0.0).to(tl.float32)
        y = x / (1.0 + tl.exp(-x)) * u
    elif MODE == 0:
        y = x
    else:
        if MODE == 2:
            y = (x - mean[:, None]) * rstd[:, None]
        else:
            y = x * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return tl.where(mask, y, 0.0)


@triton.jit
def _fp8_quant_kernel(X, W, Bias, Q, Scale, M, N, eps, s_xm, s_xn, s_qm, s_qn,
                      MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, MIN_SCALE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n = tl.arange(0, BLOCK_N)
    rows = offs_m[:, None].to(tl.int64) * s_xm
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MODE == 1:   # RMSNorm: mean of squares
        s2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            mask = mask_m[:, None] & (n0 + offs_n < N)[None, :]
            x = tl.load(X + rows + (n0 + offs_n)[None, :] * s_xn, mask=mask, other=0.0).to(tl.float32)
            s2 += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(s2 / N + eps)
    elif MODE == 2:  # LayerNorm: shifted sums, as the norm kernels compute them
        shift, m1, rstd = row_stats(X + rows, mask_m, N, s_xn, eps, BLOCK_M, BLOCK_N)
        mean = shift + m1
    if BLOCK_N >= N:  # the whole row in one tile: read once
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        y = _tile(X, W, Bias, rows, offs_n, mask, mean, rstd, N, s_xn, MODE, HAS_W, HAS_B)
        scale = tl.maximum(tl.max(tl.abs(y), axis=1) / 448.0, MIN_SCALE)
        q = tl.clamp(y / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
        tl.store(Q + offs_m[:, None].to(tl.int64) * s_qm + offs_n[None, :] * s_qn, q, mask=mask)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            mask = mask_m[:, None] & (n0 + offs_n < N)[None, :]
            y = _tile(X, W, Bias, rows, n0 + offs_n, mask, mean, rstd, N, s_xn, MODE, HAS_W, HAS_B)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        scale = tl.maximum(amax / 448.0, MIN_SCALE)
        for n0 in range(0, N, BLOCK_N):
            mask = mask_m[:, None] & (n0 + offs_n < N)[None, :]
            y = _tile(X, W, Bias, rows, n0 + offs_n, mask, mean, rstd, N, s_xn, MODE, HAS_W, HAS_B)
            q = tl.clamp(y / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
            tl.store(Q + offs_m[:, None].to(tl.int64) * s_qm + (n0 + offs_n)[None, :] * s_qn, q, mask=mask)
    tl.store(Scale + offs_m, scale, mask=mask_m)


@dataclass(frozen=True)
class Problem:
    M: int
    N: int                  # output columns (the input has 2N under swiglu)
    mode: str = "none"      # "none" | "rms" | "layer" | "swiglu"
    weight: bool = True     # the norm's weight (and, for "layer", its bias) given
    eps: float = 1e-6


def _check_norm(norm, x):
    """(mode, weight, bias, eps) of a ``norm=`` argument, checked."""
    if norm is None:
        return "none", None, None, 0.0
    if not isinstance(norm, tuple) or not norm or norm[0] not in ("rms", "layer"):
        raise ValueError(f"norm: expected None, ('rms', weight, eps) or ('layer', weight, bias, eps), got {norm!r}")
    if len(norm) != (3 if norm[0] == "rms" else 4):
        raise ValueError(f"norm: a {norm[0]!r} norm takes {'(weight, eps)' if norm[0] == 'rms' else '(weight, bias, eps)'}"
                         f", got {len(norm) - 1} values")
    w, b, eps = (norm[1], None, norm[2]) if norm[0] == "rms" else norm[1:]
    for name, t in (("norm weight", w), ("norm bias", b)):
        if t is not None:
            K.check_vec(name, t, x.shape[1], x.dtype, x.device, "x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"norm eps: expected a finite number >= 0, got {eps!r}")
    return norm[0], w, b, float(eps)


def problem_of(x, *, norm=None, swiglu=False, **_) -> Problem:
    mode, w, _b, eps = _check_norm(norm, x)
    if swiglu:
        return Problem(x.shape[0], x.shape[1] // 2, "swiglu")
    return Problem(x.shape[0], x.shape[1], mode, w is not None, eps)


class _Plan:
    __slots__ = ("grid", "kws", "cfg", "cfg_key", "shape", "eps", "mode")


_PLANS = K.PlanCache()


def _plan(x, norm, swiglu, out, config) -> _Plan:
    K.check_tensor("x", x, ndim=2, dtypes=DTYPES)
    K.check_device("x", x)
    if not isinstance(swiglu, bool):
        raise TypeError(f"swiglu: expected a bool, got {type(swiglu).__name__}")
    if swiglu and norm is not None:
        raise ValueError("norm: not with swiglu=True (the norm goes before the gate/up projection)")
    if swiglu and x.shape[1] % 2:
        raise ValueError(f"x: swiglu needs an even number of columns ([gate | up]), got {x.shape[1]}")
    mode, w, b, eps = _check_norm(norm, x)
    p = problem_of(x, norm=norm, swiglu=swiglu)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out: expected a (q, scale) pair")
        K.check_out(out[0], (p.M, p.N), E4M3, x.device)
        K.check_out(out[1], (p.M,), torch.float32, x.device)
    if dev.interpreted():
        interpret_fp8.require("fp8_quant")
    plan = _Plan()
    plan.cfg, plan.cfg_key = SPEC.config_and_key(p, x.dtype, config)
    plan.shape = (p.M, p.N)
    plan.eps = eps
    plan.mode = MODES.index(p.mode)
    c = plan.cfg
    plan.grid = (triton.cdiv(p.M, c["BLOCK_M"]),)
    plan.kws = dict(MODE=plan.mode, HAS_W=w is not None, HAS_B=b is not None, BLOCK_M=c["BLOCK_M"],
                    BLOCK_N=c["BLOCK_N"], MIN_SCALE=ref.MIN_SCALE, num_warps=c["num_warps"])
    return plan


def fp8_quant(x, *, norm=None, swiglu: bool = False, out=None, config: dict | None = None):
    """Per-row dynamic e4m3 quantization of ``x`` (M, N) fp16/bf16/fp32, any strides. Returns (q (M, N) e4m3,
    scale (M,) float32) with x ≈ q · scale[:, None]. ``norm``: None, ("rms", weight, eps) or
    ("layer", weight, bias, eps) (weight, bias (N,) in x's dtype, or None) applied before quantizing;
    ``swiglu=True``: x is (M, 2N) [gate | up] and silu(gate) · up is quantized. ``out``: a (q, scale) pair."""
    try:
        nk = None if norm is None else tuple(K.tensor_meta(t) if isinstance(t, torch.Tensor) or t is None else t
                                            for t in norm)
        key = (K.tensor_meta(x), nk, swiglu, None if out is None else tuple(K.tensor_meta(t) for t in out),
               None if config is None else tuple(config.items()))
        hash(key)
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(x, norm, swiglu, out, config))
    m, n = plan.shape
    if out is None:
        q = torch.empty((m, n), dtype=E4M3, device=x.device)
        scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    else:
        q, scale = out
        for name, t in (("out q", q), ("out scale", scale)):
            K.check_no_alias(t, (("x", x),))
    if m == 0 or n == 0:
        return q, scale
    w = b = None
    if norm is not None:
        w, b = (norm[1], None) if norm[0] == "rms" else (norm[1], norm[2])
    _fp8_quant_kernel[plan.grid](x, w if w is not None else x, b if b is not None else x, q, scale, m, n, plan.eps,
                                 x.stride(0), x.stride(1), q.stride(0), q.stride(1), **plan.kws)
    return q, scale


# ---------------------------------------------------------------------------------------------------
def _constraint(c, p: Problem, dtype) -> str | None:
    if c["BLOCK_M"] > max(1, triton.next_power_of_2(p.M)):
        return "BLOCK_M larger than M"
    if c["BLOCK_N"] > max(128, triton.next_power_of_2(p.N)):
        return "BLOCK_N larger than the row"
    tiles = 2 if p.mode == "swiglu" else 1
    per_thread = tiles * c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"])
    if per_thread > 64:
        return f"{per_thread} values per thread (register spills)"
    if c["BLOCK_M"] * c["BLOCK_N"] < 32 * c["num_warps"]:
        return "idle threads"
    return None


SPACE = K.Space(
    params={"BLOCK_M": [1, 2, 4, 8, 16], "BLOCK_N": [128, 256, 512, 1024, 2048, 4096, 8192],
            "num_warps": [1, 2, 4, 8, 16]},
    constraint=_constraint,
)


def default_config(p: Problem, dtype) -> dict:
    """Whole rows in registers up to 8192 columns (one read of x); several rows a program when rows are
    short, so a program still moves a few KiB."""
    bn = min(8192, max(128, triton.next_power_of_2(p.N)))
    bm = max(1, min(16, triton.next_power_of_2(max(1, p.M)), 2048 // bn))
    warps = 1
    tiles = 2 if p.mode == "swiglu" else 1
    while tiles * bm * bn // (32 * warps) > 16 and warps < 16:
        warps *= 2
    while tiles * bm * bn // (32 * warps) > 64 and bn > 128:
        bn //= 2
    while bm * bn < 32 * warps:
        warps //= 2
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps}


def bucket(p: Problem) -> dict:
    return {"M": triton.next_power_of_2(p.M), "N": p.N, "mode": p.mode}


def cost(p: Problem, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    cols_in = 2 * p.N if p.mode == "swiglu" else p.N
    return K.Cost(flops=float(p.M * p.N * (8 if p.mode != "none" else 3)),
                  bytes=float(e * p.M * cols_in + p.M * p.N + 4 * p.M + (2 * e * p.N if p.mode in ("rms", "layer") else 0)))


# mantissas (as integers) that are prime: 2039 of fp16's 11 bits, 251 of bf16's 8, 2^24 - 3 of fp32's 24
_PRIME_MANTISSA = {torch.float16: 2039 / 1024, torch.bfloat16: 251 / 128, torch.float32: 16777213 / 2**23}


def outlier_rows(x: torch.Tensor, dtype, col: int) -> torch.Tensor:
    """``x`` (float32, rows along the last dim) in ``dtype`` with element ``col`` of every row made its
    largest, 8 to 16 times the rest, with a prime mantissa. An outlier is what per-token scales are for; the
    prime keeps every quotient x · 448 / amax off e4m3's rounding midpoints: where the row's values are
    proportional to the input's (no norm, or RMSNorm without a weight), a quotient exactly on a midpoint
    would be rounded one way or the other by the last bit of float32 versus float64 arithmetic."""
    if x.shape[-1] > 3:
        rest = x.abs().amax(dim=-1).clamp_min(1e-3)
        sign = torch.where(x[..., col] < 0, -1.0, 1.0)
        x[..., col] = sign * _PRIME_MANTISSA[dtype] * torch.exp2(torch.ceil(torch.log2(rest * 4)))
    return x.to(dtype)


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """Activations with an outlier column (:func:`outlier_rows`), shifted for LayerNorm."""
    cols = 2 * p.N if p.mode == "swiglu" else p.N
    x = S.randn((p.M, cols), torch.float32, device, seed, shift=0.5 if p.mode == "layer" else 0.0)
    x = S.with_layout(outlier_rows(x, dtype, seed % cols), layout)
    kwargs = {}
    if p.mode == "swiglu":
        kwargs["swiglu"] = True
    elif p.mode != "none":
        w = S.randn((p.N,), dtype, device, seed + 1, scale=0.2, shift=1.0) if p.weight else None
        if p.mode == "rms":
            kwargs["norm"] = ("rms", w, p.eps)
        else:
            b = S.randn((p.N,), dtype, device, seed + 2, scale=0.1) if p.weight else None
            kwargs["norm"] = ("layer", w, b, p.eps)
    return K.Case(args=(x,), kwargs=kwargs,
                  out=(torch.empty((p.M, p.N), dtype=E4M3, device=device),
                       torch.empty((p.M,), dtype=torch.float32, device=device)))


def reference(x, norm=None, swiglu=False, **_):
    return ref.fp8_quant(x, norm=norm, swiglu=swiglu)


def problems(max_elems: int):
    from hypothesis import strategies as st

    side = max(2, int(max_elems ** 0.5))
    return st.builds(Problem, S.sizes(min(side, 64)), S.sizes(max(side, 300)), st.sampled_from(MODES),
                     st.booleans(), st.sampled_from([1e-6, 1e-5]))


def _vendor(c: K.Case):
    """torch ops: the norm / SwiGLU in the input dtype, then amax, divide and cast (several kernels)."""
    x = c.args[0]
    norm, swiglu = c.kwargs.get("norm"), c.kwargs.get("swiglu", False)
    F = torch.nn.functional

    def call():
        if swiglu:
            n = x.shape[1] // 2
            y = F.silu(x[:, :n]) * x[:, n:]
        elif norm is None:
            y = x
        elif norm[0] == "rms":
            y = F.rms_norm(x, (x.shape[1],), norm[1], norm[2])
        else:
            y = F.layer_norm(x, (x.shape[1],), norm[1], norm[2], norm[3])
        s = (y.abs().amax(dim=1).float() / 448.0).clamp_min(ref.MIN_SCALE)
        return (y.float() / s[:, None]).clamp(-448, 448).to(E4M3), s

    return call


def _bad_inputs(device):
    x = torch.randn(4, 64, device=device)
    w = torch.ones(64, device=device)
    return [
        ("integer x", lambda: fp8_quant(x.int()), TypeError),
        ("3-D x", lambda: fp8_quant(x[None]), ValueError),
        ("unknown norm", lambda: fp8_quant(x, norm=("batch", w, 1e-5)), ValueError),
        ("rms norm with a bias", lambda: fp8_quant(x, norm=("rms", w, w, 1e-5)), ValueError),
        ("norm weight of the wrong size", lambda: fp8_quant(x, norm=("rms", w[:10], 1e-5)), ValueError),
        ("norm weight of another dtype", lambda: fp8_quant(x, norm=("rms", w.half(), 1e-5)), TypeError),
        ("negative eps", lambda: fp8_quant(x, norm=("layer", w, None, -1.0)), ValueError),
        ("swiglu with a norm", lambda: fp8_quant(x, norm=("rms", w, 1e-5), swiglu=True), ValueError),
        ("swiglu over odd columns", lambda: fp8_quant(x[:, :63], swiglu=True), ValueError),
        ("out q of the wrong dtype", lambda: fp8_quant(x, out=(x.clone(), torch.empty(4, device=device))), TypeError),
        ("out scale of the wrong shape", lambda: fp8_quant(x, out=(x.to(E4M3), torch.empty(5, device=device))), ValueError),
    ]


SPEC = K.register(K.KernelSpec(
    name="fp8_quant",
    description="dynamic per-token e4m3 quantization (row scales), optionally fused after RMSNorm/LayerNorm "
                "or SwiGLU",
    run=fp8_quant,
    reference=reference,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    # Llama-8B: hidden 4096 (attention and MLP inputs after RMSNorm), SwiGLU 14336 (the down projection's input)
    standard_problems=[Problem(m, n, mode) for m in (1, 128, 1024, 4096, 8192)
                       for n, mode in ((4096, "none"), (4096, "rms"), (14336, "swiglu"))],
    small_problems=[Problem(5, 96, "rms"), Problem(33, 300, "swiglu"), Problem(7, 130, "layer", False)],
    dtypes=(torch.bfloat16, torch.float16),
    layouts=("contiguous", "sliced", "transposed"),
    vendor=_vendor,
    vendor_name="torch ops (norm, amax, divide, cast)",
    bad_inputs=_bad_inputs,
))
