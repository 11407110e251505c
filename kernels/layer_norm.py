"""LayerNorm forward over the last dim: y = (x − mean(x)) · rsqrt(var(x) + eps) · w + b.

Statistics in float32 whatever the storage type. Rows of up to BLOCK_N elements are normalised in one
pass from registers (x is read once); longer rows loop over BLOCK_N chunks twice (shifted sums for the
statistics, then normalise), the second read of a row mostly coming from L2. Several short rows share a program (ROWS) so small N still fills the warps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S
from tritune.references import layer_norm as ref


@triton.jit
def _layer_norm_fwd(X, Y, W, B, Mean, Rstd, M, N, stride_xm, stride_xn, stride_ym, eps,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
                    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = pid * ROWS + tl.arange(0, ROWS)
    mask_m = offs_m < M
    x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
    y_rows = Y + offs_m.to(tl.int64)[:, None] * stride_ym
    if ONE_PASS:
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mask = mask_m[:, None] & mask_n[None, :]
        x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        # w and b are requested with x, so their (L2) latency overlaps x's and the reductions
        if HAS_W:
            w = tl.load(W + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_B:
            bias = tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N
        rstd = tl.math.rsqrt(var + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + bias[None, :]
        tl.store(y_rows + offs_n[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Two passes over the row instead of three: sums of x − c and (x − c)² with the shift c = the
        # mean of the first chunk. E[(x−c)²] − E[x−c]² only cancels by (mean − c)² / var, which a shift
        # near the mean keeps O(1) — the unshifted E[x²] − E[x]² would lose everything for |mean| ≫ std.
        offs_n = tl.arange(0, BLOCK_N)
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        first = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        shift = tl.sum(first, axis=1) / tl.minimum(N, BLOCK_N)
        s1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        s2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask = mask_m[:, None] & (offs_n < N)[None, :]
            x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - shift[:, None], 0.0)
            s1 += xc
            s2 += xc * xc
        d = tl.sum(s1, axis=1) / N
        mean = shift + d
        var = tl.maximum(tl.sum(s2, axis=1) / N - d * d, 0.0)
        rstd = 1.0 / tl.sqrt(var + eps)
        for start in range(0, N, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            mask = mask_m[:, None] & mask_n[None, :]
            x = tl.load(x_rows + offs_n[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_B:
                y = y + tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + offs_n[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(Mean + offs_m, mean, mask=mask_m)
        tl.store(Rstd + offs_m, rstd, mask=mask_m)


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    M: int                 # rows (all leading dims flattened)
    N: int                 # normalised dim
    affine: bool = True    # weight and bias present


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_N = 65536


def problem_of(x, weight=None, bias=None, eps=1e-5, **_) -> Problem:
    N = x.shape[-1]
    return Problem(x.numel() // max(N, 1), N, weight is not None)


class _Plan:
    """What a launch needs beyond the data pointers, worked out (and the arguments checked) once per
    combination of metadata: see K.PlanCache. The hot path is then ~2 µs of Python before triton's launch
    (16 µs before, on a CPU where the launch itself stubbed out)."""
    __slots__ = ("out_shape", "stats_shape", "M", "N", "grid", "ints", "kws", "cfg", "cfg_key")


_PLANS = K.PlanCache()


def _plan(x, weight, bias, eps, out, return_stats, config) -> _Plan:
    K.check_tensor("x", x, dtypes=DTYPES)
    K.check_device("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim, got a scalar")
    N = x.shape[-1]
    if not 1 <= N <= MAX_N:
        raise ValueError(f"x: last dim N={N} out of range (1 <= N <= {MAX_N})")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            K.check_tensor(name, t, ndim=1, dtypes=DTYPES)
            if t.shape[0] != N:
                raise ValueError(f"{name}: expected shape ({N},) to match x's last dim, got {tuple(t.shape)}")
            if t.device != x.device:
                raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    if out is not None:
        K.check_out(out, x.shape, x.dtype, x.device)
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous tensor")
    p = _Plan()
    p.out_shape, p.stats_shape = x.shape, x.shape[:-1]
    x2 = x.reshape(-1, N)  # a view for row-strided inputs; copies only when dims cannot merge
    p.M, p.N = x2.shape[0], N
    if p.M == 0:
        p.cfg = p.cfg_key = p.grid = p.ints = p.kws = None
        return p
    p.cfg, p.cfg_key = SPEC.config_and_key(Problem(p.M, N, weight is not None), x.dtype, config)
    p.grid = (triton.cdiv(p.M, p.cfg["ROWS"]),)
    # x2's strides are those of the view reshape makes now; a copying reshape (rare) gives a contiguous
    # (M, N) whose strides are the same every call, so they are part of the plan either way
    p.ints = (p.M, N, x2.stride(0), x2.stride(1), N, float(eps))
    p.kws = dict(HAS_W=weight is not None, HAS_B=bias is not None, STORE_STATS=return_stats,
                 BLOCK_N=p.cfg["BLOCK_N"], ROWS=p.cfg["ROWS"], ONE_PASS=p.cfg["BLOCK_N"] >= N,
                 num_warps=p.cfg["num_warps"])
    return p


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5, *, out=None, return_stats: bool = False,
               config: dict | None = None):
    """LayerNorm over the last dim of ``x``. Returns y (x's shape and dtype), or (y, mean, rstd)."""
    try:  # the hot path: one dict lookup; anything odd takes _plan, which names the bad argument
        key = (x.shape, x.stride(), x.dtype, x.device, K.tensor_meta(weight), K.tensor_meta(bias), type(eps), eps,
               K.tensor_meta(out), bool(return_stats), None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(x, weight, bias, eps, out, return_stats, config))
    if out is None:
        out = torch.empty(plan.out_shape, dtype=x.dtype, device=x.device)
    else:
        K.check_no_alias(out, (("x", x), ("weight", weight), ("bias", bias)))
    if plan.M == 0:
        return (out, torch.empty(plan.stats_shape, dtype=torch.float32, device=x.device),
                torch.empty(plan.stats_shape, dtype=torch.float32, device=x.device)) if return_stats else out
    x2 = x.reshape(plan.M, plan.N)
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    mean = rstd = out
    if return_stats:
        mean = torch.empty(plan.stats_shape, dtype=torch.float32, device=x.device)
        rstd = torch.empty(plan.stats_shape, dtype=torch.float32, device=x.device)
    _layer_norm_fwd[plan.grid](x2, out, w, b, mean, rstd, *plan.ints, **plan.kws)
    return (out, mean, rstd) if return_stats else out


# ---------------------------------------------------------------------------------------------------
SPACE = K.Space(
    params={
        "BLOCK_N": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        "ROWS": [1, 2, 4, 8, 16, 32],
        "num_warps": [1, 2, 4, 8, 16, 32],
    },
)


def _constraint(c, p: Problem, dtype) -> str | None:
    n2 = triton.next_power_of_2(p.N)
    if c["BLOCK_N"] > max(16, n2):
        return "BLOCK_N larger than the row"
    if c["ROWS"] > triton.next_power_of_2(p.M):
        return "ROWS larger than the problem"
    per_thread = c["BLOCK_N"] * c["ROWS"] // (32 * c["num_warps"])
    if per_thread > 64:
        return f"{per_thread} elements per thread (register spills)"
    if per_thread < 1 and c["num_warps"] > 1:
        return "idle warps"
    if c["BLOCK_N"] < n2 and c["ROWS"] > 4:
        return "looped variant takes few rows"
    if c["ROWS"] * c["BLOCK_N"] > 32768:
        # a strided (e.g. transposed) x is staged through shared memory in a layout conversion: the fp32
        # tile must fit (H100: ROWS 32 x BLOCK_N 2048 asked 256 KiB of 227)
        return f"a {c['ROWS']}x{c['BLOCK_N']} tile (over 128 KiB of fp32 in shared memory)"
    return None


SPACE.constraint = _constraint


def default_config(p: Problem, dtype) -> dict:
    n2 = max(16, triton.next_power_of_2(p.N))
    if n2 <= 16384:
        block = n2
        rows = max(1, min(1024 // block, triton.next_power_of_2(p.M), 32))
    else:
        block, rows = 8192, 1
    warps = max(1, min(16, block * rows // 512))
    while block * rows // (32 * warps) > 64:
        warps *= 2
    return {"BLOCK_N": block, "ROWS": rows, "num_warps": warps}


def bucket(p: Problem) -> dict:
    return {"M": triton.next_power_of_2(p.M), "N": p.N}


def cost(p: Problem, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    return K.Cost(flops=8.0 * p.M * p.N, bytes=float(e * (2 * p.M * p.N + (2 * p.N if p.affine else 0))))


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    x = S.with_layout(S.randn((p.M, p.N), dtype, device, seed, scale=2.0, shift=0.5), layout)
    w = S.randn((p.N,), dtype, device, seed + 1, scale=0.5, shift=1.0) if p.affine else None
    b = S.randn((p.N,), dtype, device, seed + 2) if p.affine else None
    return K.Case(args=(x, w, b), kwargs={"eps": 1e-5}, out=torch.empty((p.M, p.N), dtype=dtype, device=device))


def problems(max_elems: int):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        n = d(S.sizes(min(MAX_N, max_elems)))
        m = d(S.sizes(max(1, min(4096, max_elems // n))))
        return Problem(m, n, d(st.booleans()))

    return draw()


def _vendor(c: K.Case):
    x, w, b = c.args
    return lambda: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, c.kwargs["eps"])


def _liger(c: K.Case):
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError:
        return None
    x, w, b = c.args
    if w is None:
        return None
    return lambda: LigerLayerNormFunction.apply(x, w, b, c.kwargs["eps"])


def _bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    return [
        ("integer x", lambda: layer_norm(x.to(torch.int32)), TypeError),
        ("float64 x", lambda: layer_norm(x.double()), TypeError),
        ("x on the wrong device", lambda: layer_norm(x.to("meta")), ValueError),
        ("weight of the wrong length", lambda: layer_norm(x, torch.ones(7, device=device)), ValueError),
        ("bias of the wrong length", lambda: layer_norm(x, None, torch.ones(9, device=device)), ValueError),
        ("N = 0", lambda: layer_norm(torch.randn(4, 0, device=device)), ValueError),
        ("N too large", lambda: layer_norm(torch.randn(1, MAX_N + 1, device=device)), ValueError),
        ("eps <= 0", lambda: layer_norm(x, eps=0.0), ValueError),
        ("x not a tensor", lambda: layer_norm([1.0, 2.0]), TypeError),
        ("out of the wrong shape", lambda: layer_norm(x, out=torch.empty(4, 9, device=device)), ValueError),
    ]


SPEC = K.register(K.KernelSpec(
    name="layer_norm",
    description="LayerNorm forward, one-pass or looped",
    run=layer_norm,
    reference=ref.layer_norm,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(8192, 768), Problem(65536, 4096), Problem(16384, 8192), Problem(4096, 65536)],
    small_problems=[Problem(64, 768), Problem(3, 2053)],
    layouts=("contiguous", "sliced", "transposed"),
    vendor=_vendor,
    vendor_name="F.layer_norm",
    peers={"liger": _liger},
    bad_inputs=_bad_inputs,
))
