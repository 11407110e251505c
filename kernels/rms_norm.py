"""RMSNorm over the last dim, with the residual add fused in front: s = x (+ residual), y = s · rsqrt(mean(s²) +
eps) · w. With ``residual`` the launcher returns (y, s), the shape of vLLM's / Liger's fused add + RMSNorm: a
pre-norm block's next residual stream is the sum the norm was taken of, so one pass reads x and the residual
once and writes both.

Statistics in float32 whatever the storage type. The sum s is rounded to the storage type before it is
normalised (and stored): the same value a model that adds in its dtype and then normalises sees. Rows of up
to BLOCK_N elements are normalised in one pass from registers; longer rows loop over BLOCK_N chunks twice
(sum of squares, then normalise; with a residual the second pass re-reads the s it stored). The second pass
walks the chunks last to first, and the first pass's loads ask L2 to keep the row (``evict_last``), the second's
and its stores to drop it: a row re-read from L2 instead of HBM is what a long row's two passes cost (a 64k-wide
bf16 row is 128 KiB; a few hundred of them in flight fill L2). ``num_stages`` > 1 pipelines both passes' loads
(``cp.async`` into that many shared buffers: more bytes in flight a program without more warps); 1 is the
plain loop, what a config stored before the key existed means. Several short rows
share a program (ROWS) so small N still fills the warps.

``gluon=1`` (a config key; 0, the Triton kernel, for configs stored before it existed): long rows (N > 16384) of
bf16/fp16 without a residual take :mod:`.rms_norm_gluon`'s kernel on CUDA GPUs of compute capability 9 or more,
which holds each row in shared memory and reads it from HBM once (its BLOCK_N is the ring's chunk, num_warps its
warps). Where it does not take the call (the interpreter, another GPU, strides or a base TMA cannot read), the
Triton kernel runs with the same config: the same results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels import rms_norm_gluon as RG   # held as a module: its jitted code counts in the store's hash
from tritune.kernels.runtime import strategies as S
from tritune.references import rms_norm as ref


@triton.jit
def _sum_chunk(X, R, S_out, rows_x, rows_r, rows_s, offs_n, mask, stride_xn, stride_rn, stride_sn,
               HAS_R: tl.constexpr, POLICY: tl.constexpr):
    """One (ROWS, BLOCK_N) chunk of s = x (+ r) in float32, s rounded to the storage type and stored when
    there is a residual. ``POLICY``: the loads' L2 eviction hint ("evict_last" where the chunk is read again)."""
    s = tl.load(rows_x + offs_n[None, :] * stride_xn, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32)
    if HAS_R:
        s += tl.load(rows_r + offs_n[None, :] * stride_rn, mask=mask, other=0.0,
                     eviction_policy=POLICY).to(tl.float32)
        s_st = s.to(S_out.dtype.element_ty)
        tl.store(rows_s + offs_n[None, :] * stride_sn, s_st, mask=mask)
        s = s_st.to(tl.float32)
    return s


@triton.jit
def _rms_norm_fwd(X, R, W, Y, S_out, M, N, stride_xm, stride_xn, stride_rm, stride_rn, stride_ym, stride_yn,
                  stride_sm, stride_sn, eps,
                  HAS_R: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                  ONE_PASS: tl.constexpr, STAGES: tl.constexpr):
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)[:, None]
    rows_x, rows_r = X + rows * stride_xm, R + rows * stride_rm
    rows_y, rows_s = Y + rows * stride_ym, S_out + rows * stride_sm
    if ONE_PASS:
        offs_n = tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mask = mask_m[:, None] & mask_n[None, :]
        s = _sum_chunk(X, R, S_out, rows_x, rows_r, rows_s, offs_n, mask, stride_xn, stride_rn, stride_sn, HAS_R,
                       "")
        if HAS_W:  # requested with x, so its latency overlaps x's and the reduction
            w = tl.load(W + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(s * s, axis=1) / N + eps)
        y = s * rstd[:, None]
        if HAS_W:
            y = y * w[None, :]
        tl.store(rows_y + offs_n[None, :] * stride_yn, y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in tl.range(0, N, BLOCK_N, num_stages=STAGES):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask = mask_m[:, None] & (offs_n < N)[None, :]
            s = _sum_chunk(X, R, S_out, rows_x, rows_r, rows_s, offs_n, mask, stride_xn, stride_rn, stride_sn,
                           HAS_R, "evict_last")
            acc += s * s
        rstd = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)
        if HAS_R:
            tl.debug_barrier()  # the second pass reads back the s this program's threads stored
        n_chunks = tl.cdiv(N, BLOCK_N)
        # last chunk first: the most recently read, likeliest still in L2
        for i in tl.range(0, n_chunks, num_stages=STAGES):
            offs_n = (n_chunks - 1 - i) * BLOCK_N + tl.arange(0, BLOCK_N)
            mask_n = offs_n < N
            mask = mask_m[:, None] & mask_n[None, :]
            if HAS_R:
                s = tl.load(rows_s + offs_n[None, :] * stride_sn, mask=mask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
            else:
                s = tl.load(rows_x + offs_n[None, :] * stride_xn, mask=mask, other=0.0,
                            eviction_policy="evict_first").to(tl.float32)
            y = s * rstd[:, None]
            if HAS_W:
                y = y * tl.load(W + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(rows_y + offs_n[None, :] * stride_yn, y.to(Y.dtype.element_ty), mask=mask,
                     eviction_policy="evict_first")


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    M: int                   # rows (all leading dims flattened)
    N: int                   # normalised dim
    residual: bool = False   # the fused residual add
    affine: bool = True      # weight present


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_N = 65536


def problem_of(x, weight=None, eps=1e-6, residual=None, **_) -> Problem:
    N = x.shape[-1]
    return Problem(x.numel() // max(N, 1), N, residual is not None, weight is not None)


class _Plan:
    """What a launch needs beyond the data pointers, worked out (and the arguments checked) once per
    combination of metadata (K.PlanCache)."""
    # gluon: the Gluon kernel's launch state (kernels.rms_norm_gluon.launch's cache), where the config asks for it
    # and it takes the call (bf16/fp16, no residual, long rows, TMA-readable x, a GPU it runs on); else None
    __slots__ = ("shape", "M", "N", "grid", "kws", "eps", "cfg", "cfg_key", "gluon")


_PLANS = K.PlanCache()


def _check_x_like(name, t, x):
    K.check_tensor(name, t, dtypes=(x.dtype,))
    if t.shape != x.shape:
        raise ValueError(f"{name}: expected x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")


def _check_outs(x, residual, out):
    if residual is None:
        K.check_out(out, x.shape, x.dtype, x.device)
        return
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out: with residual, expected a pair (y, residual_out)")
    for name, t in (("out[0]", out[0]), ("out[1]", out[1])):
        K.check_tensor(name, t)
        try:
            K.check_out(t, x.shape, x.dtype, x.device)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: {str(e).removeprefix('out: ')}") from None


def _plan(x, weight, eps, residual, out, config) -> _Plan:
    K.check_tensor("x", x, dtypes=DTYPES)
    K.check_device("x", x)
    if x.dim() == 0:
        raise ValueError("x: expected at least 1 dim, got a scalar")
    N = x.shape[-1]
    if not 1 <= N <= MAX_N:
        raise ValueError(f"x: last dim N={N} out of range (1 <= N <= {MAX_N})")
    if weight is not None:
        K.check_tensor("weight", weight, ndim=1, dtypes=DTYPES)
        if weight.shape[0] != N:
            raise ValueError(f"weight: expected shape ({N},) to match x's last dim, got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise ValueError(f"weight: on {weight.device}, but x is on {x.device}")
    if residual is not None:
        _check_x_like("residual", residual, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    if out is not None:
        _check_outs(x, residual, out)
    p = _Plan()
    p.shape = x.shape
    p.M, p.N = x.numel() // N, N
    p.eps = float(eps)
    if p.M == 0:
        p.cfg = p.cfg_key = p.grid = p.kws = p.gluon = None
        return p
    p.cfg, p.cfg_key = SPEC.config_and_key(Problem(p.M, N, residual is not None, weight is not None), x.dtype,
                                           config)
    p.grid = (triton.cdiv(p.M, p.cfg["ROWS"]),)
    p.kws = dict(HAS_R=residual is not None, HAS_W=weight is not None, BLOCK_N=p.cfg["BLOCK_N"],
                 ROWS=p.cfg["ROWS"], ONE_PASS=p.cfg["BLOCK_N"] >= N, STAGES=SPACE.full(p.cfg)["num_stages"],
                 num_warps=p.cfg["num_warps"])
    p.gluon = {} if _gluon_takes(p, x, residual, out) else None
    return p


def _view_strides(t, M, N) -> tuple:
    """The strides of ``t``'s (M, N) rows as the launcher sees them (:func:`_rows`: a view, else a contiguous
    copy), without copying."""
    try:
        return t.view(M, N).stride()
    except RuntimeError:
        return (N, 1)


def _gluon_takes(p: _Plan, x, residual, out) -> bool:
    """The plan's config asks for the Gluon kernel and it takes the call (x's base: checked each launch)."""
    if not SPACE.full(p.cfg)["gluon"] or not RG.runs_on(x.device):
        return False
    if RG.problem_refusal(p.N, x.dtype, residual is not None, p.cfg["BLOCK_N"], x.device.index) is not None:
        return False
    y_strides = (p.N, 1) if out is None else _view_strides(out, p.M, p.N)
    return RG.strides_ok(p.N, _view_strides(x, p.M, p.N), y_strides, x.element_size())


def _rows(t, M, N):
    """(M, N) view of ``t`` (a copy only when its leading dims cannot merge) and its two strides."""
    t2 = t.reshape(M, N)
    return t2, t2.stride(0), t2.stride(1)


def _writable_rows(t, M, N):
    """(M, N) view of an output that the kernel writes through: never a copy."""
    try:
        t2 = t.view(M, N)
    except RuntimeError:
        raise ValueError("out: its leading dims cannot be viewed as one row dim (pass a contiguous tensor)") \
            from None
    return t2, t2.stride(0), t2.stride(1)


def rms_norm(x, weight=None, eps: float = 1e-6, residual=None, *, out=None, config: dict | None = None):
    """RMSNorm over the last dim of ``x``. Returns y (x's shape and dtype); with ``residual`` (x's shape and
    dtype) returns (y, x + residual), the sum rounded to x's dtype. ``out``: y, or with ``residual`` the pair
    (y, sum); the sum may be written over ``residual`` or ``x`` itself (in place), y may overlap nothing."""
    try:  # the hot path: one dict lookup; anything odd takes _plan, which names the bad argument
        outs = out if isinstance(out, (tuple, list)) else (out,)
        key = (x.shape, x.stride(), x.dtype, x.device, K.tensor_meta(weight), type(eps), eps,
               K.tensor_meta(residual), *(K.tensor_meta(o) for o in outs), len(outs),
               None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(x, weight, eps, residual, out, config))
    has_r = residual is not None
    if out is None:
        y = torch.empty(plan.shape, dtype=x.dtype, device=x.device)
        s = torch.empty(plan.shape, dtype=x.dtype, device=x.device) if has_r else None
    else:
        y, s = (out[0], out[1]) if has_r else (out, None)
        ins = (("x", x), ("weight", weight), ("residual", residual))
        K.check_no_alias(y, ins + ((("out[1]", s),) if has_r else ()))
        if has_r:
            same_as = next((n for n, t in (("residual", residual), ("x", x)) if t.data_ptr() == s.data_ptr()),
                           None)
            K.check_no_alias(s, ins, in_place=same_as)
    if plan.M == 0:
        return (y, s) if has_r else y
    M, N = plan.M, plan.N
    x2, sxm, sxn = _rows(x, M, N)
    r2, srm, srn = _rows(residual, M, N) if has_r else (x2, 0, 0)
    y2, sym, syn = _writable_rows(y, M, N)
    s2, ssm, ssn = _writable_rows(s, M, N) if has_r else (y2, 0, 0)
    if plan.gluon is not None and RG.aligned(x2):
        RG.launch(x2, weight.contiguous() if weight is not None else None, y2, plan.eps, chunk=plan.cfg["BLOCK_N"],
                  num_warps=plan.cfg["num_warps"], cache=plan.gluon)
        return y
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_fwd[plan.grid](x2, r2, w, y2, s2, M, N, sxm, sxn, srm, srn, sym, syn, ssm, ssn, plan.eps,
                             **plan.kws)
    return (y, s) if has_r else y


# ---------------------------------------------------------------------------------------------------
SPACE = K.Space(
    params={
        "BLOCK_N": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536],
        "ROWS": [1, 2, 4, 8, 16, 32],
        "num_warps": [1, 2, 4, 8, 16, 32],
        "num_stages": [1, 2, 3, 4],
        "gluon": [0, 1],
    },
    legacy={"num_stages": 1, "gluon": 0},   # the plain loops and the Triton kernel, before the keys existed
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
    stages = c.get("num_stages", 1)
    if stages > 1 and c["BLOCK_N"] >= p.N:
        return "num_stages > 1 pipelines the looped variant's chunks (this row fits one)"
    smem = stages * c["ROWS"] * c["BLOCK_N"] * (torch.finfo(dtype).bits // 8) * (2 if p.residual else 1)
    if stages > 1 and smem > 192 * 1024:
        return f"{smem // 1024} KiB of shared memory for {stages} stages"
    if c.get("gluon", 0):
        return _gluon_constraint(c, p, dtype)
    return None


def _gluon_constraint(c, p: Problem, dtype) -> str | None:
    """What the Gluon kernel does not take, beyond the Triton kernel's limits above (which its fallback needs):
    it reads BLOCK_N (its ring's chunk) and num_warps; ROWS and num_stages, the Triton kernel's, are fixed at 1."""
    if not RG.runs_here():
        return "gluon=1 (the Gluon kernel) runs on CUDA GPUs of compute capability 9 or more, not in the interpreter"
    if c["BLOCK_N"] not in RG.CHUNKS or c["num_warps"] not in RG.WARPS:
        return f"gluon=1: BLOCK_N (the ring's chunk) one of {RG.CHUNKS}, num_warps one of {RG.WARPS}"
    if c["ROWS"] != 1 or c.get("num_stages", 1) != 1:
        return "gluon=1 takes ROWS=1 and num_stages=1 (the Triton kernel's keys it does not read, fixed)"
    return RG.problem_refusal(p.N, dtype, p.residual, c["BLOCK_N"])


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
    return {"BLOCK_N": block, "ROWS": rows, "num_warps": warps, "num_stages": 1}


def seeds(p: Problem, dtype) -> list[dict]:
    """Rows past the default's one-pass width (16384): the whole row in registers, one pass (32 warps keep it
    at 64 values a thread up to 65536), which one-step moves from the looped 8192 do not reach; and the looped
    form with its loads pipelined (3-4 stages, fewer warps). Where the Gluon kernel takes the problem
    (bf16/fp16, no residual, on a GPU it runs on): gluon=1 with chunks of 4096 to 16384 (a row read from HBM
    once); seeds it refuses are skipped."""
    n2 = triton.next_power_of_2(p.N)
    if n2 <= 16384 or n2 > 65536:
        return []
    return [{"BLOCK_N": n2, "ROWS": 1, "num_warps": w, "num_stages": 1} for w in (16, 32) if n2 // (32 * w) <= 64] \
        + [{"BLOCK_N": b, "ROWS": 1, "num_warps": w, "num_stages": s} for b in (4096, 8192) for w in (8, 16)
           for s in (3, 4)] \
        + [{"BLOCK_N": b, "ROWS": 1, "num_warps": w, "num_stages": 1, "gluon": 1} for b in RG.CHUNKS for w in RG.WARPS]


def bucket(p: Problem) -> dict:
    return {"M": triton.next_power_of_2(p.M), "N": p.N, "residual": int(p.residual)}


def cost(p: Problem, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    rows = (4 if p.residual else 2) * p.M * p.N   # x (+ residual) in, y (+ the sum) out
    return K.Cost(flops=(5.0 if p.residual else 4.0) * p.M * p.N,
                  bytes=float(e * (rows + (p.N if p.affine else 0))))


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    x = S.with_layout(S.randn((p.M, p.N), dtype, device, seed, scale=2.0, shift=0.3), layout)
    w = S.randn((p.N,), dtype, device, seed + 1, scale=0.5, shift=1.0) if p.affine else None
    kwargs = {"eps": 1e-6}
    out = torch.empty((p.M, p.N), dtype=dtype, device=device)
    if p.residual:
        kwargs["residual"] = S.with_layout(S.randn((p.M, p.N), dtype, device, seed + 2), layout)
        out = (out, torch.empty((p.M, p.N), dtype=dtype, device=device))
    return K.Case(args=(x, w), kwargs=kwargs, out=out)


def problems(max_elems: int):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        n = d(S.sizes(min(MAX_N, max_elems)))
        m = d(S.sizes(max(1, min(4096, max_elems // n))))
        return Problem(m, n, d(st.booleans()), d(st.booleans()))

    return draw()


def _vendor(c: K.Case):
    x, w = c.args
    r, eps = c.kwargs.get("residual"), c.kwargs["eps"]
    if r is None:
        return lambda: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)

    def call():
        s = x + r
        return torch.nn.functional.rms_norm(s, (x.shape[-1],), w, eps), s

    return call


def _liger(c: K.Case):
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    x, w = c.args
    if w is None or "residual" in c.kwargs:
        return None
    return lambda: LigerRMSNormFunction.apply(x, w, c.kwargs["eps"])


def _bad_inputs(device):
    x, w = torch.randn(4, 8, device=device), torch.ones(8, device=device)
    r = torch.randn(4, 8, device=device)
    return [
        ("integer x", lambda: rms_norm(x.int(), w), TypeError),
        ("float64 x", lambda: rms_norm(x.double(), w.double()), TypeError),
        ("x not a tensor", lambda: rms_norm([1.0, 2.0], w), TypeError),
        ("x on the wrong device", lambda: rms_norm(x.to("meta"), w), ValueError),
        ("weight of the wrong length", lambda: rms_norm(x, w[:7]), ValueError),
        ("2-D weight", lambda: rms_norm(x, w[None]), ValueError),
        ("eps <= 0", lambda: rms_norm(x, w, eps=0.0), ValueError),
        ("N = 0", lambda: rms_norm(torch.randn(4, 0, device=device), None), ValueError),
        ("N too large", lambda: rms_norm(torch.randn(1, MAX_N + 1, device=device), None), ValueError),
        ("residual of another shape", lambda: rms_norm(x, w, residual=r[:3]), ValueError),
        ("residual of another dtype", lambda: rms_norm(x, w, residual=r.half()), TypeError),
        ("out of the wrong shape", lambda: rms_norm(x, w, out=torch.empty(4, 9, device=device)), ValueError),
        ("out not a pair with residual", lambda: rms_norm(x, w, residual=r, out=torch.empty_like(x)), TypeError),
        ("out aliasing x", lambda: rms_norm(x, w, out=x), ValueError),
    ]


SPEC = K.register(K.KernelSpec(
    name="rms_norm",
    description="RMSNorm forward with the fused residual add, one-pass or looped",
    run=rms_norm,
    reference=ref.rms_norm,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(8192, 4096), Problem(8192, 4096, residual=True), Problem(65536, 2048, True),
                       Problem(16384, 8192), Problem(4096, 65536)],
    small_problems=[Problem(64, 768), Problem(3, 2053, residual=True), Problem(5, 896, residual=True)],
    layouts=("contiguous", "sliced", "transposed"),
    vendor=_vendor,
    vendor_name="F.rms_norm",
    peers={"liger": _liger},
    bad_inputs=_bad_inputs,
    seeds=seeds,
))
