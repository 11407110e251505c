"""Scaled FP8 GEMM: C = (A·sa) @ (B·sb) (+ bias, GELU, + residual), A and B in e4m3, C in bf16/fp16.

A (M, K) carries one scale per tensor or per row (per token, from dynamic quantization); B (K, N) one per
tensor, per output channel, or per 128x128 block (DeepSeek-V3's weights). Each K tile's product is a fresh
fp32 dot added into the fp32 accumulator: Hopper's FP8 tensor cores keep fewer accumulator bits than fp32,
and Triton lets them accumulate over the whole K by default, so starting each BLOCK_K (≤ 128) afresh is
the periodic promotion long K needs; block scales multiply each tile's partial product, row and channel
scales the finished tile once. Any strides: weights are usually stored (N, K) and passed as ``w.t()``.

Two loops compute the same thing. Where both operands are K-major with 16-byte aligned bases and rows (A
(M, K) row-major, B passed as ``w.t()`` of a row-major (N, K) weight) and the tile is at least 64 rows,
TMA tensor descriptors bring the tiles in (no per-thread address arithmetic in the loop); a 256-wide N
tile is then computed as two 128-wide halves, each half's K-tile product a fresh fp32 dot as above, so the
fresh product needs registers for half the tile only (a whole 128x256 product beside its accumulator
spills). Any other layout takes the pointer loop. Either way the wgmma of one K tile is waited on before
its product is added (Triton cannot keep a fresh product's MMA in flight): the promotion interval stays
one K tile (≤ 128), and its wait is not overlapped with the next tile's MMAs.

Config key ``IMPL``: "triton" (the two loops above) or "gluon" (:mod:`.fp8_gemm_gluon`, sm90 GPUs only: a
warp-specialized kernel whose consumer warpgroups keep the next K tile's wgmma in flight while the last one's
product is promoted; ``PERSISTENT=1``: its persistent grid). A stored config without these keys (tuned
before them) is IMPL="triton", PERSISTENT=0. Where the Gluon kernel does not take the operands (not K-major,
unaligned), a gluon config runs the Triton kernel with its tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels import fp8_gemm_gluon as FGG   # held as a module: its jitted code counts in the store's hash
from tritune.kernels.gemm import gemm
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8 as ref

E4M3 = torch.float8_e4m3fn
A_SCALES = ("tensor", "row")
B_SCALES = ("tensor", "channel", "block")
ACTIVATIONS = ("none", "gelu_tanh")
SCALE_BLOCK = ref.BLOCK

try:   # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:   # pragma: no cover
    TensorDescriptor = None


def _tma_device(t) -> bool:
    """TMA descriptors work here: the interpreter, or a Hopper (sm_90) or later GPU."""
    if TensorDescriptor is None:
        return False
    if dev.interpreted():
        return True
    return t.is_cuda and _sm90(t.device)


@functools.lru_cache(maxsize=None)
def _sm90(device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def _fp8_gemm_kernel(A, B, C, SA, SB, BIAS, RES, M, N, KD,
                     s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn,
                     A_ROW: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                     HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SBLOCK: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None].to(tl.int64) * s_am + offs_k[None, :] * s_ak
    b_ptrs = B + offs_k[:, None] * s_bk + offs_n[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):
        mask_k = k0 + offs_k < KD
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        part = tl.dot(a, b)   # a fresh fp32 accumulator per K tile: the promotion
        if B_MODE == 2:       # one scale per SBLOCK x SBLOCK block of B: a K tile lies in one block row
            sb = tl.load(SB + (k0 // SBLOCK) * s_sbk + (offs_n // SBLOCK) * s_sbn, mask=mask_n, other=0.0)
            acc += part * sb[None, :]
        else:
            acc += part
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    _fp8_epilogue(acc, C, SA, SB, BIAS, RES, M, N, offs_m, offs_n, s_cm, s_cn, s_rm, s_rn,
                  A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES)


@triton.jit
def _fp8_epilogue(acc, C, SA, SB, BIAS, RES, M, N, offs_m, offs_n, s_cm, s_cn, s_rm, s_rn,
                  A_ROW: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                  HAS_RES: tl.constexpr):
    mask_m = offs_m < M
    mask_n = offs_n < N
    if A_ROW:
        acc *= tl.load(SA + offs_m, mask=mask_m, other=0.0)[:, None]
    else:
        acc *= tl.load(SA)
    if B_MODE == 0:
        acc *= tl.load(SB)
    elif B_MODE == 1:
        acc *= tl.load(SB + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GELU:  # tanh form as x·sigmoid(2z): no overflow for large |z|
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-2.0 * z))
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        acc += tl.load(RES + offs_m[:, None].to(tl.int64) * s_rm + offs_n[None, :] * s_rn, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(C + offs_m[:, None].to(tl.int64) * s_cm + offs_n[None, :] * s_cn, acc.to(C.dtype.element_ty),
             mask=mask)


@triton.jit
def _fp8_tile_part(A_d, B_d, SB, acc, m0, n0, k0, N, s_sbk, s_sbn,
                   B_MODE: tl.constexpr, HN: tl.constexpr, SBLOCK: tl.constexpr):
    """acc + one K tile's product over HN columns from n0, as a fresh fp32 dot (the promotion)."""
    a = A_d.load([m0, k0])
    b = B_d.load([n0, k0])                    # (HN, BLOCK_K): B is K-major
    part = tl.dot(a, b.T)
    if B_MODE == 2:   # one scale per SBLOCK x SBLOCK block of B: a K tile lies in one block row
        offs_n = n0 + tl.arange(0, HN)
        sb = tl.load(SB + (k0 // SBLOCK) * s_sbk + (offs_n // SBLOCK) * s_sbn, mask=offs_n < N, other=0.0)
        return acc + part * sb[None, :]
    return acc + part


@triton.jit
def _fp8_gemm_tma_kernel(A_d, B_d, C, SA, SB, BIAS, RES, M, N, KD, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn,
                         A_ROW: tl.constexpr, B_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, GELU: tl.constexpr,
                         HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SBLOCK: tl.constexpr, HN: tl.constexpr):
    """The same product from TMA descriptors: A_d over A (M, K) in (BLOCK_M, BLOCK_K) boxes, B_d over B's
    (N, K) view in (HN, BLOCK_K) boxes; HN = BLOCK_N or BLOCK_N / 2 (two halves, fresh products of half
    the tile)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc0 = tl.zeros((BLOCK_M, HN), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, HN), dtype=tl.float32)
    for k0 in range(0, KD, BLOCK_K):   # out-of-bounds parts of a box (M, N and K edges) read as zeros
        acc0 = _fp8_tile_part(A_d, B_d, SB, acc0, m0, n0, k0, N, s_sbk, s_sbn, B_MODE, HN, SBLOCK)
        if HN < BLOCK_N:
            acc1 = _fp8_tile_part(A_d, B_d, SB, acc1, m0, n0 + HN, k0, N, s_sbk, s_sbn, B_MODE, HN, SBLOCK)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, HN)
    _fp8_epilogue(acc0, C, SA, SB, BIAS, RES, M, N, offs_m, offs_n, s_cm, s_cn, s_rm, s_rn,
                  A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES)
    if HN < BLOCK_N:
        _fp8_epilogue(acc1, C, SA, SB, BIAS, RES, M, N, offs_m, offs_n + HN, s_cm, s_cn, s_rm, s_rn,
                      A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES)


@dataclass(frozen=True)
class Problem:
    M: int
    N: int
    K: int
    a_scale: str = "row"        # "tensor" | "row"
    b_scale: str = "channel"    # "tensor" | "channel" | "block"
    bias: bool = False
    act: str = "none"
    residual: bool = False


OUT_DTYPES = (torch.bfloat16, torch.float16)


def _scale_mode(name: str, s, shapes: dict) -> str:
    K.check_tensor(name, s, dtypes=(torch.float32,))
    for mode, shape in shapes.items():
        if tuple(s.shape) in shape:
            return mode
    raise ValueError(f"{name}: expected shape {' or '.join(str(sh[0]) for sh in shapes.values())}, "
                     f"got {tuple(s.shape)}")


def problem_of(a, b, a_scale, b_scale, bias=None, activation="none", residual=None, **_) -> Problem:
    m, k = a.shape
    n = b.shape[1]
    am = _scale_mode("a_scale", a_scale, {"tensor": [(), (1,)], "row": [(m,), (m, 1)]})
    kb, nb = math.ceil(k / SCALE_BLOCK), math.ceil(n / SCALE_BLOCK)
    bm = _scale_mode("b_scale", b_scale, {"tensor": [(), (1,)], "channel": [(n,)], "block": [(kb, nb)]})
    return Problem(m, n, k, am, bm, bias is not None, activation, residual is not None)


class _Plan:
    __slots__ = ("problem", "grid", "kws", "cfg", "cfg_key", "out_dtype", "sbs", "tma", "hn", "descs", "gluon",
                 "kws_tma", "consts", "consts_tma", "kernels")


_PLANS = K.PlanCache()
_CONFIGS = K.BucketConfigs()  # (config, config cache key) per bucket: a new M of a known bucket skips the lookup
_NOT_M = operator.attrgetter(*(f.name for f in dataclasses.fields(Problem) if f.name != "M"))  # fields but M
# direct launches (K.launch_cached): every constexpr after the runtime arguments, in each kernel's order
_CONSTEXPRS = K.constexpr_params(_fp8_gemm_kernel)
_TMA_CONSTEXPRS = K.constexpr_params(_fp8_gemm_tma_kernel)


def check_args(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype) -> None:
    """fp8_gemm's argument checks (a ValueError/TypeError naming the argument); fp8_gemv's too."""
    K.check_tensor("a", a, ndim=2, dtypes=(E4M3,))
    K.check_tensor("b", b, ndim=2, dtypes=(E4M3,))
    K.check_device("a", a)
    for name, t in (("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if isinstance(t, torch.Tensor) and t.device != a.device:
            raise ValueError(f"{name}: on {t.device}, but a is on {a.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b: expected {a.shape[1]} rows (a's columns), got shape {tuple(b.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype}")
    m, n = a.shape[0], b.shape[1]
    if bias is not None:
        K.check_vec("bias", bias, n, out_dtype, a.device, "b's columns")
    if residual is not None:
        K.check_tensor("residual", residual, ndim=2, dtypes=(out_dtype,))
        if tuple(residual.shape) != (m, n):
            raise ValueError(f"residual: expected shape {(m, n)}, got {tuple(residual.shape)}")
        if residual.device != a.device:
            raise ValueError(f"residual: on {residual.device}, but a is on {a.device}")
    if out is not None:
        K.check_out(out, (m, n), out_dtype, a.device)


def _plan(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype, config) -> _Plan:
    check_args(a, b, a_scale, b_scale, bias, activation, residual, out, out_dtype)
    m, n = a.shape[0], b.shape[1]
    p = _Plan()
    p.problem = pr = problem_of(a, b, a_scale, b_scale, bias, activation, residual)
    p.out_dtype = out_dtype
    key = (K.next_power_of_2(pr.M), _NOT_M(pr), out_dtype, K.precision_key(out_dtype),
           None if config is None else tuple(config.items()))
    p.cfg, p.cfg_key = _CONFIGS.pair(key, lambda: SPEC.config_and_key(pr, out_dtype, config))
    c = p.cfg
    p.grid = (K.cdiv(m, c["BLOCK_M"]) * K.cdiv(n, c["BLOCK_N"]),)
    p.sbs = tuple(b_scale.stride()) if p.problem.b_scale == "block" else (0, 0)
    p.kws = dict(A_ROW=p.problem.a_scale == "row", B_MODE=B_SCALES.index(p.problem.b_scale),
                 HAS_BIAS=bias is not None, GELU=activation == "gelu_tanh", HAS_RES=residual is not None,
                 BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"],
                 SBLOCK=SCALE_BLOCK, num_warps=c["num_warps"], num_stages=c["num_stages"])
    # TMA loop: both operands K-major with 16-byte rows (the bases' alignment is checked per call), tiles
    # of 64 rows and more; a 256-wide tile as two 128-wide halves
    p.tma = c["BLOCK_M"] >= 64 and a.shape[1] > 0 and _tma_device(a) \
        and a.stride(1) == 1 and b.stride(0) == 1 and a.stride(0) % 16 == 0 and b.stride(1) % 16 == 0
    p.hn = min(c["BLOCK_N"], 128)
    p.kws_tma = dict(p.kws, HN=p.hn)
    p.consts = tuple(p.kws[k] for k in _CONSTEXPRS)
    p.consts_tma = tuple(p.kws_tma[k] for k in _TMA_CONSTEXPRS)
    p.kernels = {} if K.DIRECT_LAUNCH and a.device.type == "cuda" else None
    p.descs = (None, None)
    # IMPL=gluon (the constraint admits it on sm90 GPUs only): its launch state, where it takes the operands
    p.gluon = {} if c.get("IMPL") == "gluon" and FGG.takes(a, b) else None
    return p


def _descriptors(plan, a, b):
    """The TMA descriptors of a and b. B's (the weight, the same tensor call after call) is kept with the plan
    and made again when b changes; A's (activations: a new tensor most calls) is made each call, so a plan
    never holds an activation alive."""
    key, b_d = plan.descs
    if key != b.data_ptr():
        b_d = TensorDescriptor.from_tensor(b.t(), [plan.hn, plan.kws["BLOCK_K"]])
        plan.descs = (b.data_ptr(), b_d)
    return TensorDescriptor.from_tensor(a, [plan.kws["BLOCK_M"], plan.kws["BLOCK_K"]]), b_d


def fp8_gemm(a, b, a_scale, b_scale, bias=None, *, activation: str = "none", residual=None, out=None,
             out_dtype=torch.bfloat16, config: dict | None = None):
    """(a·a_scale) @ (b·b_scale) [+ bias] [GELU] [+ residual] in ``out_dtype``. ``a`` (M, K) and ``b`` (K, N)
    e4m3, any strides; ``a_scale`` float32 () or (M,); ``b_scale`` float32 (), (N,) or (ceil(K/128),
    ceil(N/128)); bias (N,) and residual (M, N) in ``out_dtype``."""
    if out is not None and isinstance(out, torch.Tensor):
        out_dtype = out.dtype
    try:
        key = (K.tensor_meta(a), K.tensor_meta(b), K.tensor_meta(a_scale), K.tensor_meta(b_scale),
               K.tensor_meta(bias), activation, K.tensor_meta(residual), K.tensor_meta(out), out_dtype,
               None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(a, b, a_scale, b_scale, bias, activation, residual, out,
                                                 out_dtype, config))
    m, n = a.shape[0], b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    else:
        K.check_no_alias(out, (("a", a), ("b", b), ("bias", bias), ("residual", residual)), "residual")
    if m == 0 or n == 0:
        return out
    if plan.gluon is not None and K.aligned(a, b):
        c = plan.cfg
        FGG.launch(a, b, out, a_scale, b_scale, bias, residual, kws=plan.kws, block_m=c["BLOCK_M"],
                     block_n=c["BLOCK_N"], stages=c["num_stages"], persistent=bool(c.get("PERSISTENT")),
                     sbs=plan.sbs, cache=plan.gluon)
        return out
    res = residual if residual is not None else out
    bias_arg = bias if bias is not None else out
    ptrs = (out, a_scale, b_scale, bias_arg, res)  # what a direct launch keys on besides the plan
    strides = (out.stride(0), out.stride(1), res.stride(0), res.stride(1), *plan.sbs)
    if plan.tma and K.aligned(a, b):
        a_d, b_d = _descriptors(plan, a, b)
        args = (a_d, b_d, out, a_scale, b_scale, bias_arg, res, m, n, a.shape[1], *strides)
        K.launch_cached(_fp8_gemm_tma_kernel, plan.kernels, plan.grid, args, plan.kws_tma, plan.consts_tma, "tma",
                        ptrs)
        return out
    args = (a, b, out, a_scale, b_scale, bias_arg, res, m, n, a.shape[1], a.stride(0), a.stride(1), b.stride(0),
            b.stride(1), *strides)
    K.launch_cached(_fp8_gemm_kernel, plan.kernels, plan.grid, args, plan.kws, plan.consts, "pointers", ptrs + (a, b))
    return out


def _gluon_constraint(c, p: Problem) -> str | None:
    """What the Gluon kernel does not take (beyond the Triton kernel's own limits, which its fallback needs)."""
    if not (FGG.AVAILABLE and dev.hopper()):
        return "IMPL=gluon (the warp-specialized Gluon kernel) runs on sm90 GPUs only"
    if c["BLOCK_M"] not in (64, 128) or c["BLOCK_N"] not in (64, 128) or c["BLOCK_K"] != 128:
        # a consumer warpgroup holds its 64 x BLOCK_N accumulator and two fresh products: 1.5 x BLOCK_N fp32
        # registers a thread (a 256-wide tile would need 384)
        return "IMPL=gluon: BLOCK_M 64 or 128 (one or two consumer warpgroups), BLOCK_N 64 or 128, BLOCK_K 128"
    if c["num_warps"] != 4:
        return "IMPL=gluon takes num_warps=4 (a consumer warpgroup a partition; the key it does not read, fixed)"
    if c["BLOCK_M"] == 128 and c["BLOCK_N"] == 128 and p.bias and p.act != "none" and p.residual:
        # the one epilogue whose registers spill beside two 64x128 warpgroups (sm90 SASS, triton 3.6)
        return "IMPL=gluon: bias, GELU and residual together take BLOCK_M or BLOCK_N 64"
    if FGG.smem_bytes(c["BLOCK_M"], c["BLOCK_N"], c["num_stages"]) > 227 * 1024:
        return "IMPL=gluon: its ring exceeds 227 KiB of shared memory"
    return None


def _constraint(c, p: Problem, dtype) -> str | None:
    if c.get("IMPL", "triton") == "gluon":
        why = _gluon_constraint(c, p)
        if why is not None:
            return why
    elif c.get("PERSISTENT", 0):
        return "PERSISTENT=1 is the Gluon kernel's (IMPL=gluon)"
    if c["BLOCK_M"] > max(16, K.next_power_of_2(p.M)):
        return "BLOCK_M larger than M"
    if c["BLOCK_N"] > max(32, K.next_power_of_2(p.N)):
        return "BLOCK_N larger than N"
    if c["BLOCK_K"] > max(32, K.next_power_of_2(p.K)):
        return "BLOCK_K larger than K"
    if p.b_scale == "block" and SCALE_BLOCK % c["BLOCK_K"]:
        return "a K tile must lie in one scale block"
    smem = c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"]   # e4m3: one byte each
    if smem > 200 * 1024:
        return f"{smem // 1024} KiB of shared memory"
    if c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"]) > 256:
        return "accumulator over 256 registers per thread"
    return None


# the keys added with the Gluon kernel, at the value a config stored before them meant
LEGACY = {"IMPL": "triton", "PERSISTENT": 0}


SPACE = K.Space(
    params={"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [32, 64, 128],
            "GROUP_M": [1, 8], "num_warps": [4, 8], "num_stages": [2, 3, 4, 5], "IMPL": ["triton", "gluon"],
            "PERSISTENT": [0, 1]},
    constraint=_constraint,
    legacy=LEGACY,   # a config stored before IMPL and PERSISTENT existed is the Triton kernel's
)


def default_config(p: Problem, dtype) -> dict:
    """Skinny M (decode, small batches): narrow row tiles, wide K; large M: 128x128 tiles, 128-deep K."""
    bm = min(128, max(16, K.next_power_of_2(p.M)))
    bn = min(128, max(32, K.next_power_of_2(p.N)))
    bk = min(128, max(32, K.next_power_of_2(p.K)))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8 if p.M >= 1024 else 1,
            "num_warps": 8 if bm * bn >= 128 * 128 else 4, "num_stages": 3 if bm >= 128 else 4, **LEGACY}


def seeds(p: Problem, dtype) -> list[dict]:
    """Large M: the 128x256 tile (TMA loop, two 128-wide fresh products) and 64x128 one-warpgroup tiles,
    which one-step moves from 128x128 do not reach together with their stage counts; and the Gluon kernel
    (IMPL="gluon" fixes several keys at once): 128x128 on two consumer warpgroups with 4 or 5 stages, its
    persistent grid, and 64x128 on one (two CTAs an SM). The tuner skips those the space refuses here."""
    if p.M < 256:
        return []
    gluon = dict(BLOCK_K=128, GROUP_M=8, num_warps=4, IMPL="gluon")
    return [{"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": g, "num_warps": 8, "num_stages": s, **LEGACY}
            for g in (8, 1) for s in (3, 4)] + \
        [{"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": s, **LEGACY}
         for s in (3, 4)] + \
        [dict(gluon, BLOCK_M=128, BLOCK_N=128, num_stages=s, PERSISTENT=pers) for pers in (0, 1) for s in (4, 5)] + \
        [dict(gluon, BLOCK_M=64, BLOCK_N=128, num_stages=4, PERSISTENT=0)]


def bucket(p: Problem) -> dict:
    return {"M": K.next_power_of_2(p.M), "N": p.N, "K": p.K, "a_scale": p.a_scale, "b_scale": p.b_scale,
            "epilogue": int(p.bias) + 2 * int(p.act != "none") + 4 * int(p.residual)}


def cost(p: Problem, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    return K.Cost(flops=2.0 * p.M * p.N * p.K,
                  bytes=float(p.M * p.K + p.K * p.N + e * p.M * p.N * (2 if p.residual else 1)))


def _quantize_b(w, mode: str):
    if mode == "tensor":
        return ref.quantize_tensor(w)
    if mode == "channel":
        return ref.quantize_channels(w)
    return ref.quantize_blocks(w)


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """bf16-like activations and weights, quantized by the reference quantizers (so kernel and reference
    read the same e4m3 values and scales). B is stored (N, K) and passed as its (K, N) transpose, as model
    weights are (and as Hopper's FP8 tensor cores read B: K-major); "transposed" gives the (K, N) row-major
    form instead."""
    x = S.randn((p.M, p.K), torch.float32, device, seed, scale=2.0)
    w = S.randn((p.K, p.N), torch.float32, device, seed + 1, scale=1.0 / math.sqrt(p.K))
    a, sa = ref.quantize_rows(x) if p.a_scale == "row" else ref.quantize_tensor(x)
    b, sb = _quantize_b(w, p.b_scale)
    if layout != "transposed":
        b = b.t().contiguous().t()
    if layout == "sliced":
        a = torch.empty((p.M, p.K + 16), dtype=E4M3, device=device)[:, 8:8 + p.K].copy_(a)
    bias = S.randn((p.N,), dtype, device, seed + 2, scale=0.5) if p.bias else None
    res = S.randn((p.M, p.N), dtype, device, seed + 3) if p.residual else None
    return K.Case(args=(a, b, sa, sb, bias), kwargs={"activation": p.act, "residual": res, "out_dtype": dtype},
                  out=torch.empty((p.M, p.N), dtype=dtype, device=device))


def reference(a, b, a_scale, b_scale, bias=None, activation="none", residual=None, out_dtype=None, **_):
    return ref.fp8_gemm(a, b, a_scale, b_scale, bias, activation, residual)


def problems(max_elems: int):
    from hypothesis import strategies as st

    side = max(2, int(max_elems ** (1 / 3)))
    return st.builds(Problem, S.sizes(side), S.sizes(side), S.sizes(max(side, 160)),
                     st.sampled_from(A_SCALES), st.sampled_from(B_SCALES), st.booleans(),
                     st.sampled_from(ACTIVATIONS), st.booleans())


def _vendor(c: K.Case):
    """torch._scaled_mm (cuBLASLt): per-tensor scales, row-wise A with channel-wise B, or B in 128x128 blocks
    (cuBLASLt's 1x128 x 128x128 form: A's scale repeated over its K blocks, both scale grids outer-dim-major);
    epilogues beyond bias are not among its forms (None: no vendor time for that row)."""
    a, b, sa, sb, bias = c.args
    if c.kwargs["activation"] != "none" or c.kwargs["residual"] is not None:
        return None
    bt = b.t().contiguous().t()   # cuBLASLt wants B column-major
    dt = c.kwargs["out_dtype"]
    if sb.dim() == 2:
        kb = sb.shape[0]
        scale_a = sa.reshape(-1, 1).expand(a.shape[0], kb).t().contiguous().t()
        scale_b = sb.t().contiguous().t()
        call = lambda: torch._scaled_mm(a, bt, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=dt)  # noqa: E731
        call.label = "torch._scaled_mm (cuBLASLt, 1x128 x 128x128 blocks)"
        return call
    rowwise = sa.dim() > 0 and sa.numel() > 1 or sb.dim() > 0 and sb.numel() > 1
    if rowwise and not (sa.numel() == a.shape[0] and sb.numel() == b.shape[1]):
        return None
    scale_a = sa.reshape(-1, 1) if rowwise else sa.reshape(())
    scale_b = sb.reshape(1, -1) if rowwise else sb.reshape(())
    return lambda: torch._scaled_mm(a, bt, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=dt)


def _bf16_operands(c: K.Case):
    """The same A and B as bf16, B in the same layout (timing only: the values are the e4m3 codes)."""
    a, b = c.args[0], c.args[1]
    bh = torch.empty_strided(b.shape, b.stride(), dtype=torch.bfloat16, device=b.device).copy_(b)
    return a.to(torch.bfloat16), bh


def _ours_bf16(c: K.Case):
    """tritune's own bf16 GEMM on the same shapes and layouts: the issue's "x our bf16 GEMM" column."""
    if c.kwargs["activation"] != "none" or c.kwargs["residual"] is not None:
        return None
    a, b = _bf16_operands(c)
    return lambda: gemm(a, b)


def _torch_bf16(c: K.Case):
    """torch.matmul in bf16 (cuBLAS) on the same shapes: what FP8 saves against the unquantized default."""
    if c.kwargs["activation"] != "none" or c.kwargs["residual"] is not None:
        return None
    a, b = _bf16_operands(c)
    return lambda: torch.matmul(a, b)


def _bad_inputs(device):
    a, sa = ref.quantize_rows(torch.randn(8, 64, device=device))
    b, sb = ref.quantize_channels(torch.randn(64, 32, device=device))
    return [
        ("bf16 a", lambda: fp8_gemm(a.to(torch.bfloat16), b, sa, sb), TypeError),
        ("mismatched K", lambda: fp8_gemm(a, b[:32], sa, sb), ValueError),
        ("a_scale of the wrong shape", lambda: fp8_gemm(a, b, sa[:3], sb), ValueError),
        ("b_scale of the wrong shape", lambda: fp8_gemm(a, b, sa, sb[:5]), ValueError),
        ("float16 scales", lambda: fp8_gemm(a, b, sa.half(), sb), TypeError),
        ("unknown activation", lambda: fp8_gemm(a, b, sa, sb, activation="relu"), ValueError),
        ("fp32 output", lambda: fp8_gemm(a, b, sa, sb, out_dtype=torch.float32), TypeError),
    ]


_LLAMA8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]   # (K, N): qkv, o, gate/up, down

SPEC = K.register(K.KernelSpec(
    name="fp8_gemm",
    description="scaled e4m3 GEMM (tensor/row A scales; tensor/channel/128x128-block B scales), fp32 "
                "accumulation promoted per K tile, bias/GELU/residual epilogue",
    run=fp8_gemm,
    reference=reference,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(m, n, k, "row", bs) for m in (1, 16, 128, 1024, 4096, 8192)
                       for k, n in _LLAMA8B for bs in ("channel", "block")],
    small_problems=[Problem(5, 40, 96), Problem(33, 130, 160, "tensor", "block", True, "gelu_tanh", True)],
    dtypes=OUT_DTYPES,
    layouts=("contiguous", "transposed", "sliced"),
    vendor=_vendor,
    vendor_name="torch._scaled_mm (cuBLASLt)",
    peers={"tritune_bf16": _ours_bf16, "torch_bf16": _torch_bf16},
    bad_inputs=_bad_inputs,
    seeds=seeds,
))
