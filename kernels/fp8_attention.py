"""FP8 prefill attention: Q, K, V in e4m3 with per-(batch, kv head) descales, bf16 output.

FlashAttention-3's FP8 interface and recipe: ``q_descale, k_descale, v_descale`` float32 of shape (B, Hkv)
(here also (Hkv,) or None), the q·k descales folded into the softmax scale, V's applied to the finished
row; softmax in float32; the probabilities cast to e4m3 for the P·V product at a fixed scale, 2^8 at the
top (P = 2^(s − m + 8) in base 2), so they use e4m3's range instead of only [0, 1].

One difference from FA3: the running row maximum m is rounded up to an integer. P's top entries then lie in
(2^7, 2^8] instead of at 2^8 (no bit of precision lost: e4m3 has the same relative step at any exponent),
every rescale of the accumulator is an exact power of two, and, because a power-of-two shift commutes with
rounding to e4m3, the rounded P does not depend on how the maximum grew over the key blocks, i.e. on
BLOCK_N: the float64 reference (references/fp8_attention.py) rounds P exactly as the kernel does, so the
bf16 tolerance holds the kernel to its arithmetic, and a separate test bounds the format's error.

Q·K^T runs in fp16, P·V in FP8. Hopper's FP8 wgmma, what ``tl.dot`` of two e4m3 tiles compiles to for
BLOCK_M >= 64, keeps about 14 significant bits in its accumulator (truncated after each 32-wide step), so its
scores carry an error proportional to |score|: on an H200 those tiles missed the tolerance on large scores and
on fp16 output (3.9e-2 against 1e-2, 2.4e-3 against 2e-3; docs/findings.md). Every e4m3 value is an fp16 value
(2^-9 to 448), so Q, converted once before the key loop, and each K tile convert exactly, and the fp16 MMA
multiplies exactly and accumulates in float32 (wgmma for BLOCK_M >= 64, mma.sync below). wgmma reads K from
shared memory, so each step's converted tile goes back there (after the e4m3 tile's cp.async: a load, the
conversions, a store and a barrier): offline for sm90 (Triton 3.6) 5-15% more instructions in the key loop,
no spill in the default or stored configs. K converted to fp16 by the launcher instead gave the same loop, for
twice K's bytes and a copy a call. P·V stays FP8: each tile's product lands in a fresh accumulator and is added
to O in float32, which the H200 kept in tolerance.

One program owns BLOCK_M query rows of one head and streams key blocks with an online softmax: the blocks
every row sees in full run unmasked, the causal diagonal and the key tail masked (causal alignment as
``attention``: query i sees key j <= i + Tk − Tq). Any strides; V stored token-contiguous (the "v_t"
layout) gives the P·V product the K-major operand Hopper's FP8 MMA takes without a transpose, and V in
any other layout is copied so first (FA3 transposes V in the kernel instead).

Two implementations, the config's ``IMPL``: "triton" (the kernel below; ``SCHEDULE`` "pipelined", Triton's
software pipeliner) and "gluon", the FlashAttention-3-structured Hopper kernel (kernels/fp8_attention_gluon.py:
a TMA producer warp, two consumer warpgroups, ``SCHEDULE`` "ahead", "intra_wg" or "pingpong" as attention's
Gluon kernel), sm90 only, FP8 Q·K^T, refused (``GLUON_OFF``). Configs stored before those keys existed read as
IMPL="triton".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels import fp8_attention_gluon as FG
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_fp8
from tritune.kernels.runtime import strategies as S
from tritune.references import attention as ref_attn
from tritune.references import fp8_attention as ref

if dev.interpreted():
    interpret_fp8.apply()   # P's conversion to e4m3 rounds wrong in the interpreter without it

E4M3 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
OUT_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, Tk, delta, qk_scale, skn, svn,
           MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold the keys start_n..start_n+BLOCK_N into (acc, l_i, m_i)."""
    cols = start_n + offs_n
    if MASKED:
        k = tl.load(k_ptrs + cols[:, None].to(tl.int64) * skn, mask=(cols < Tk)[:, None], other=0.0)
        v = tl.load(v_ptrs + cols[:, None].to(tl.int64) * svn, mask=(cols < Tk)[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + cols[:, None].to(tl.int64) * skn)
        v = tl.load(v_ptrs + cols[:, None].to(tl.int64) * svn)
    # base-2 scores, descaled: fp16 operands (e4m3 converts exactly), float32 accumulation
    s = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
    if MASKED:
        visible = (cols < Tk)[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + delta)
        s = tl.where(visible, s, float("-inf"))
    # an integer maximum: rescales are exact powers of two and P's rounding does not depend on BLOCK_N
    m_new = tl.maximum(m_i, tl.math.ceil(tl.max(s, 1)))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet
    p = tl.math.exp2(s - m_sub[:, None] + 8.0)        # (0, 256]: e4m3's range, FA3's fixed P scale
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), v)
    return acc, l_i, m_new


@triton.jit
def _fp8_attn_fwd(Q, Kp, Vp, O, QD, KD, VD,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                  s_qdb, s_qdh, s_kdb, s_kdh, s_vdb, s_vdh,
                  Hq, group, Tq, Tk, num_m_blocks, sm_scale_log2,
                  D: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    mb = pid % num_m_blocks
    bh = pid // num_m_blocks
    start_m = (num_m_blocks - 1 - mb) * BLOCK_M   # the longest (causal) row blocks first
    b = bh // Hq
    h = bh % Hq
    kvh = h // group
    qk_scale = sm_scale_log2 * tl.load(QD + b * s_qdb + kvh * s_qdh) * tl.load(KD + b * s_kdb + kvh * s_kdh)
    v_descale = tl.load(VD + b * s_vdb + kvh * s_vdh)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    mask_m = offs_m < Tq
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * sqb + h.to(tl.int64) * sqh + offs_m[:, None].to(tl.int64) * sqm + offs_d[None, :] * sqd,
                mask=mask_m[:, None], other=0.0).to(tl.float16)   # exact: e4m3 is a subset of fp16
    k_ptrs = Kp + b64 * skb + kvh.to(tl.int64) * skh + offs_d[None, :] * skd
    v_ptrs = Vp + b64 * svb + kvh.to(tl.int64) * svh + offs_d[None, :] * svd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    delta = Tk - Tq
    full = Tk // BLOCK_N
    if CAUSAL:
        full = tl.minimum(full, tl.maximum(start_m + delta + 1, 0) // BLOCK_N)
        hi = tl.minimum(Tk, tl.maximum(start_m + BLOCK_M + delta, 0))
    else:
        hi = Tk
    for start_n in range(0, full * BLOCK_N, BLOCK_N):
        acc, l_i, m_i = _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, Tk, delta, qk_scale,
                               skn, svn, False, CAUSAL)
    for start_n in range(full * BLOCK_N, hi, BLOCK_N):
        acc, l_i, m_i = _block(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_m, offs_n, start_n, Tk, delta, qk_scale,
                               skn, svn, True, CAUSAL)
    # rows that saw no key: l = 0 and acc = 0 -> 0
    acc = acc * (v_descale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    tl.store(O + b64 * sob + h.to(tl.int64) * soh + offs_m[:, None].to(tl.int64) * som + offs_d[None, :] * sod,
             acc.to(O.dtype.element_ty), mask=mask_m[:, None])


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    B: int
    Hq: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    causal: bool = False


def problem_of(q, k, v, q_descale=None, k_descale=None, v_descale=None, *, causal=False, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], bool(causal))


_ONES: dict = {}


def _descale(name, d, B, Hkv, device):
    """(tensor, batch stride, head stride) of a descale given as None, (Hkv,) or (B, Hkv) float32."""
    if d is None:
        if device not in _ONES:
            _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
        return _ONES[device], 0, 0
    K.check_tensor(name, d, ndim=(1, 2), dtypes=(torch.float32,))
    if d.device != device:
        raise ValueError(f"{name}: on {d.device}, but q is on {device}")
    if tuple(d.shape) == (Hkv,):
        return d, 0, d.stride(0)
    if tuple(d.shape) == (B, Hkv):
        return d, d.stride(0), d.stride(1)
    raise ValueError(f"{name}: expected shape ({B}, {Hkv}) (batch, kv heads) or ({Hkv},), got {tuple(d.shape)}")


class _Plan:
    # gluon: the Gluon kernel's launch keywords (None: the Triton kernel, cfg's or, for an IMPL=gluon config,
    # the default, which also runs the Gluon plan's launches whose bases TMA cannot read); descales: their
    # (batch, kv head) strides; cache: the Gluon launch's (descriptor geometry, compiled kernels)
    __slots__ = ("cfg", "cfg_key", "grid", "args", "kws", "out_shape", "empty", "v_copy", "gluon", "descales",
                 "cache")


_PLANS = K.PlanCache()


def _check(q, k, v, scale):
    K.check_tensor("q", q, ndim=4, dtypes=(E4M3,))
    K.check_device("q", q)
    for name, t in (("k", k), ("v", v)):
        K.check_tensor(name, t, ndim=4, dtypes=(E4M3,))
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    B, Hq, Tq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"k: batch {k.shape[0]} does not match q's {B}")
    if k.shape[3] != D:
        raise ValueError(f"k: head dim {k.shape[3]} does not match q's {D}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim {D} not supported (expected one of {HEAD_DIMS})")
    if k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"q: {Hq} heads is not a multiple of k/v's {k.shape[1]} heads")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected a positive finite number or None, got {scale!r}")


def _plan(q, k, v, qd, kd, vd, causal, scale, out, out_dtype, config) -> _Plan:
    _check(q, k, v, scale)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype}")
    p = problem_of(q, k, v, causal=causal)
    shape = (p.B, p.Hq, p.Tq, p.D)
    if out is not None:
        K.check_out(out, shape, out_dtype, q.device)
    descales = [_descale(n, d, p.B, p.Hkv, q.device) for n, d in (("q_descale", qd), ("k_descale", kd),
                                                                  ("v_descale", vd))]
    if dev.interpreted():
        interpret_fp8.require("fp8_attention")
    plan = _Plan()
    plan.out_shape = shape
    plan.empty = p.B * p.Hq * p.Tq == 0
    plan.cfg, plan.cfg_key = SPEC.config_and_key(p, out_dtype, config)
    c = {**LEGACY, **plan.cfg}
    sm = (1.0 / math.sqrt(p.D) if scale is None else float(scale)) * LOG2E
    plan.descales = tuple(d[1:] for d in descales)
    plan.gluon = plan.cache = None
    if c["IMPL"] == "gluon":
        if _gluon_takes(p, q, k, out, out_dtype):
            plan.gluon = dict(causal=p.causal, sm_scale_log2=sm, BN=c["BLOCK_N"], stages=c["num_stages"],
                              schedule=GLUON_SCHEDULES[c["SCHEDULE"]])
            plan.cache = {}
        c = default_config(p, out_dtype)
    nmb = triton.cdiv(p.Tq, c["BLOCK_M"])
    plan.grid = (nmb * p.B * p.Hq,)
    o_st = out.stride() if out is not None else (p.Hq * p.Tq * p.D, p.Tq * p.D, p.D, 1)
    # V not token-contiguous: each call reads a token-contiguous copy (B·Hkv·Tk·D bytes, a copy's cost
    # against the attention's Tq·Tk work), the K-major operand Hopper's FP8 MMA takes; without it the P·V
    # product ran at under half of the bf16 kernel's speed on an H200
    plan.v_copy = v.stride(2) != 1 and p.Tk > 1
    v_st = (p.Hkv * p.D * p.Tk, p.D * p.Tk, 1, p.Tk) if plan.v_copy else v.stride()
    plan.args = (*q.stride(), *k.stride(), *v_st, *o_st, *(s for d in descales for s in d[1:]),
                 p.Hq, p.Hq // p.Hkv, p.Tq, p.Tk, nmb, sm)
    plan.kws = dict(D=p.D, CAUSAL=bool(causal), BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                    num_warps=c["num_warps"], num_stages=c["num_stages"])
    return plan


def fp8_attention(q, k, v, q_descale=None, k_descale=None, v_descale=None, *, causal: bool = False, scale=None,
                  out=None, out_dtype=torch.bfloat16, config: dict | None = None):
    """softmax(q kᵀ · q_descale · k_descale · scale) v · v_descale over e4m3 (B, H, T, D) tensors of any
    strides: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D), Hq a multiple of Hkv, D 64 or 128; descales float32
    (B, Hkv), (Hkv,) or None (1). Returns (B, Hq, Tq, D) in ``out_dtype`` (bf16 or fp16)."""
    if isinstance(out, torch.Tensor):
        out_dtype = out.dtype
    try:
        key = (K.tensor_meta(q), K.tensor_meta(k), K.tensor_meta(v), K.tensor_meta(q_descale),
               K.tensor_meta(k_descale), K.tensor_meta(v_descale), bool(causal), scale, type(scale),
               K.tensor_meta(out), out_dtype, None if config is None else tuple(config.items()))
        hash(key)
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(q, k, v, q_descale, k_descale, v_descale, causal, scale, out,
                                                 out_dtype, config))
    if out is None:
        out = torch.empty(plan.out_shape, dtype=out_dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k", k), ("v", v)))
    if plan.empty:
        return out
    if k.shape[2] == 0:
        return out.zero_()
    ones = _ONES.get(q.device)
    if plan.gluon is not None and K.aligned(q, k, out):
        ds = [(d if d is not None else ones, *st) for d, st in zip((q_descale, k_descale, v_descale), plan.descales)]
        FG.launch(q, k, v, out, ds, cache=plan.cache, **plan.gluon)
        return out
    if plan.v_copy:
        v = v.transpose(2, 3).contiguous().transpose(2, 3)
    _fp8_attn_fwd[plan.grid](q, k, v, out, q_descale if q_descale is not None else ones,
                             k_descale if k_descale is not None else ones,
                             v_descale if v_descale is not None else ones, *plan.args, **plan.kws)
    return out


# ---------------------------------------------------------------------------------------------------
# IMPL and SCHEDULE: which kernel runs, and the order of the Gluon kernel's GEMMs (its SCHEDULE constexpr)
LEGACY = {"IMPL": "triton", "SCHEDULE": "pipelined"}   # what a config stored before these keys existed means
GLUON_SCHEDULES = {"ahead": 0, "intra_wg": 1, "pingpong": 2}


# The Gluon kernel is refused everywhere. On an H200 its P·V fix (each tile's P @ V in a fresh accumulator, added
# in float32) is confirmed: 22 of its 24 GPU tests pass, test_gluon_long_key_streams_do_not_drift included. It is
# refused because its Q·K^T runs on FP8 wgmma, whose truncated accumulation (~14 significant bits) misses the
# tolerance on large scores (3.87e-2 against 1e-2) and on the fp16 output at D=64 (2.4e-3 against 2e-3); the
# Triton kernel computes Q·K^T in fp16 for that reason. docs/findings.md, "FP8 attention in Gluon" and after.
GLUON_OFF = ("IMPL=gluon (the FP8 Gluon attention) is off: its Q·K^T on FP8 wgmma (truncated accumulation) misses "
             "the tolerance on an H200 on large scores and fp16 output, 3.87e-2 / 2.4e-3 (docs/findings.md)")


def _gluon_call_constraint(p: Problem) -> str | None:
    """What of the problem (not the tiles) the Gluon kernel refuses."""
    if not FG.runs_here():
        return "IMPL=gluon (the FA3-structured Gluon kernel) runs on sm90 GPUs only, not in the interpreter"
    if GLUON_OFF:
        return GLUON_OFF
    if p.causal and p.Tq > p.Tk:   # every row must see a key (its first tile's softmax takes m finite)
        return "IMPL=gluon: causal needs Tq <= Tk"
    if p.B * p.Hq > 65535:   # its grid is (query tiles, batch x heads): CUDA caps the second dimension
        return "IMPL=gluon: at most 65,535 batch x heads"
    return None


def _gluon_constraint(c, p: Problem, dtype) -> str | None:
    why = _gluon_call_constraint(p)
    if why is not None:
        return why
    if c["SCHEDULE"] not in GLUON_SCHEDULES:
        return f"IMPL=gluon: SCHEDULE one of {tuple(GLUON_SCHEDULES)}"
    if (c["BLOCK_M"], c["num_warps"]) != (FG.ROWS, 4):
        return f"IMPL=gluon takes BLOCK_M={FG.ROWS} (two consumer warpgroups of {FG.BM} rows) and num_warps=4"
    if c["BLOCK_N"] not in (64, 128):
        return "IMPL=gluon: BLOCK_N 64 or 128"
    if c["num_stages"] < 2:
        return "IMPL=gluon: a ring of 2 stages or more"
    need = FG.smem_bytes(p.D, c["BLOCK_N"], c["num_stages"], torch.finfo(dtype).bits // 8)
    if need > FG.smem_limit():
        return f"IMPL=gluon: needs {need} B of shared memory (budget {FG.smem_limit()})"
    return None


def _gluon_takes(p: Problem, q, k, out, out_dtype) -> bool:
    """The Gluon kernel takes this call (a config of the bucket was checked against its first problem only):
    the problem, and strides TMA reads (q, k, and out where given: a new one is contiguous)."""
    return (_gluon_call_constraint(p) is None and FG.tma_strides_ok(q, k)
            and (out is None or FG.tma_strides_ok(out)) and out_dtype in OUT_DTYPES)


def _constraint(c, p: Problem, dtype) -> str | None:
    c = {**LEGACY, **c}
    if c["IMPL"] == "gluon":
        return _gluon_constraint(c, p, dtype)
    if c["SCHEDULE"] != "pipelined":
        return "IMPL=triton: SCHEDULE='pipelined' (the others are the Gluon kernel's)"
    if c["BLOCK_M"] > max(16, triton.next_power_of_2(p.Tq)):
        return "BLOCK_M larger than Tq"
    if c["BLOCK_N"] > max(32, triton.next_power_of_2(p.Tk)):
        return "BLOCK_N larger than Tk"
    smem = p.D * (c["BLOCK_M"] + 2 * c["BLOCK_N"] * c["num_stages"])   # e4m3: a byte an element
    if c["BLOCK_M"] >= 64:   # wgmma tiles also hold Q in fp16 and the K tile converted to fp16 in shared memory
        smem += p.D * (c["BLOCK_M"] + 2 * c["BLOCK_N"])
    if smem > 200 * 1024:
        return f"{smem // 1024} KiB of shared memory"
    regs = c["BLOCK_M"] * (p.D + c["BLOCK_N"]) // (32 * c["num_warps"])   # fp32 accumulator and scores
    if regs > 192:
        return f"{regs} fp32 registers per thread for the accumulator and scores"
    if c["BLOCK_M"] * c["BLOCK_N"] < 32 * c["num_warps"] * 4:
        return "tiles too small for the warps"
    return None


SPACE = K.Space(
    params={"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128, 256], "num_warps": [4, 8],
            "num_stages": [1, 2, 3, 4], "IMPL": ["triton", "gluon"],
            "SCHEDULE": ["pipelined", "ahead", "intra_wg", "pingpong"]},
    constraint=_constraint,
    legacy=LEGACY,   # a config stored before IMPL and SCHEDULE existed is the Triton kernel's
)


def default_config(p: Problem, dtype) -> dict:
    """128 query rows on 8 warps and 64-key blocks (128 at D=64): FA3's FP8 tile at D=128 is 128x128,
    halved here in N because Triton keeps the P tile in registers as well."""
    bm = min(128, max(16, triton.next_power_of_2(p.Tq)))
    bn = min(128 if p.D <= 64 else 64, max(32, triton.next_power_of_2(p.Tk)))
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 8 if bm >= 128 else 4, "num_stages": 3, **LEGACY}
    while _constraint(cfg, p, dtype) is not None and cfg["num_warps"] > 4:
        cfg["num_warps"] //= 2
    return cfg


def gluon_config(p: Problem, dtype, schedule: str = "pingpong", BLOCK_N: int = 128, num_stages: int = 2) -> dict:
    """The point that runs the Gluon kernel with ``schedule`` (a name of GLUON_SCHEDULES), its key tile and ring
    depth; not checked against the problem (``SPACE.why_invalid`` says)."""
    return dict(default_config(p, dtype), IMPL="gluon", SCHEDULE=schedule, BLOCK_M=FG.ROWS, num_warps=4,
                BLOCK_N=BLOCK_N, num_stages=num_stages)


def seeds(p: Problem, dtype) -> list[dict]:
    """Every tuning study's way into the Gluon kernel at 1k tokens and more (IMPL=gluon fixes BLOCK_M, num_warps
    and SCHEDULE at once, which no one-step move reaches): FA3's FP8 tile (128 x 128) under its two schedules,
    two and three stages, and 64-key tiles. The tuner skips those the problem refuses."""
    if min(p.Tq, p.Tk) < 1024 or GLUON_OFF:
        return []
    return [gluon_config(p, dtype, s, bn, st) for s, bn, st in (("intra_wg", 128, 2), ("pingpong", 128, 2),
                                                                ("intra_wg", 128, 3), ("pingpong", 64, 2))]


def bucket(p: Problem) -> dict:
    return {"B": triton.next_power_of_2(p.B), "Hq": p.Hq, "Hkv": p.Hkv, "Tq": triton.next_power_of_2(p.Tq),
            "Tk": triton.next_power_of_2(p.Tk), "D": p.D, "mask": "causal" if p.causal else "full"}


def cost(p: Problem, dtype) -> K.Cost:
    pairs = p.B * p.Tq * p.Tk * (0.5 if p.causal else 1.0)
    e = torch.finfo(dtype).bits // 8
    return K.Cost(flops=4.0 * p.Hq * p.D * pairs,
                  bytes=float(p.D * (p.B * p.Tq * p.Hq * (1 + e) + 2 * p.B * p.Tk * p.Hkv)))


def unquantized(p: Problem, device, seed: int):
    """The float32 q, k, v that :func:`make_inputs` quantizes (V shifted off zero, as attention's inputs)."""
    q = S.randn((p.B, p.Hq, p.Tq, p.D), torch.float32, device, seed, scale=1.5)
    k = S.randn((p.B, p.Hkv, p.Tk, p.D), torch.float32, device, seed + 1)
    v = S.randn((p.B, p.Hkv, p.Tk, p.D), torch.float32, device, seed + 2, shift=0.25)
    return q, k, v


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """q, k, v quantized per (batch, kv head) by the reference quantizer. Layouts: "contiguous" (B, H, T, D);
    "bthd": views of (B, T, H, D) buffers; "v_t": V stored token-contiguous ((B, H, D, T) transposed)."""
    q, k, v = (t.to(device) for t in unquantized(p, device, seed))
    (q8, qd), (k8, kd), (v8, vd) = (ref.quantize_heads(t, p.Hkv) for t in (q, k, v))
    if layout == "bthd":
        q8, k8, v8 = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q8, k8, v8))
    elif layout == "v_t":
        v8 = v8.transpose(2, 3).contiguous().transpose(2, 3)
    elif layout != "contiguous":
        raise ValueError(f"layout: unknown {layout!r}; expected contiguous, bthd or v_t")
    if seed % 3 == 1:
        qd = qd.amax(dim=0)   # the (Hkv,) form: one descale per kv head for the whole batch
        q8 = (q.float() / qd.repeat_interleave(p.Hq // p.Hkv)[None, :, None, None]).clamp(-448, 448).to(E4M3)
    return K.Case(args=(q8, k8, v8, qd, kd, vd), kwargs={"causal": p.causal, "out_dtype": dtype},
                  out=torch.empty((p.B, p.Hq, p.Tq, p.D), dtype=dtype, device=device))


def reference(q, k, v, q_descale=None, k_descale=None, v_descale=None, causal=False, scale=None, **_):
    return ref.fp8_attention(q, k, v, q_descale, k_descale, v_descale, causal=causal, scale=scale)


def problems(max_elems: int):
    from hypothesis import strategies as st

    small = max_elems <= 1 << 16
    t_max = 48 if small else 2048

    @st.composite
    def draw(d):
        D = d(st.sampled_from(HEAD_DIMS))
        hkv = d(st.sampled_from([1, 2] if small else [1, 2, 4, 8]))
        hq = hkv * d(st.sampled_from([1, 2] if small else [1, 2, 4]))
        tq = d(S.sizes(t_max))
        tk = d(st.one_of(st.just(tq), S.sizes(t_max)))
        return Problem(d(st.integers(1, 2 if small else 4)), hq, hkv, tq, tk, D, d(st.booleans()))

    return draw()


def _dequantized(c: K.Case):
    q, k, v, qd, kd, vd = c.args
    g = q.shape[1] // k.shape[1]

    def deq(t, d, rep):
        d = d if d.dim() == 2 else d[None, :].expand(t.shape[0], -1)
        return (t.float() * d.repeat_interleave(rep, dim=1)[:, :, None, None]).to(c.kwargs["out_dtype"])

    return deq(q, qd, g), deq(k, kd, 1), deq(v, vd, 1)


def _vendor(c: K.Case):
    """SDPA on the dequantized bf16 tensors (dequantized untimed): what a user without an FP8 attention
    kernel runs."""
    q, k, v = _dequantized(c)
    causal, gqa = c.kwargs["causal"], q.shape[1] != k.shape[1]
    F = torch.nn.functional

    def call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    call.label = f"sdpa on dequantized bf16 ({K.sdpa_backend(call)})"
    return call


def _fa3(c: K.Case):
    """FlashAttention-3's FP8 forward (``flash_attn_interface``, Hopper), with the same descales; None where
    it is not installed or the tensors are not on a GPU."""
    try:
        from flash_attn_interface import flash_attn_func
    except ImportError:
        return None
    q, k, v, qd, kd, vd = c.args
    if q.device.type != "cuda":
        return None
    B, Hkv = k.shape[0], k.shape[1]
    qd, kd, vd = (d if d.dim() == 2 else d[None, :].expand(B, Hkv).contiguous() for d in (qd, kd, vd))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))   # FA3 takes (B, T, H, D)

    def call():
        r = flash_attn_func(qt, kt, vt, causal=c.kwargs["causal"], q_descale=qd, k_descale=kd, v_descale=vd)
        return r[0] if isinstance(r, tuple) else r

    call()   # a case it cannot run (head dim, layout) raises here, named in the row
    return call


def _bad_inputs(device):
    q8 = torch.zeros(1, 4, 8, 64, device=device).to(E4M3)
    k8 = torch.zeros(1, 2, 8, 64, device=device).to(E4M3)
    d = torch.ones(1, 2, device=device)
    return [
        ("bf16 q", lambda: fp8_attention(q8.to(torch.bfloat16), k8, k8), TypeError),
        ("head dim 32", lambda: fp8_attention(*(torch.zeros(1, 2, 8, 32, device=device).to(E4M3),) * 3), ValueError),
        ("Hq not a multiple of Hkv", lambda: fp8_attention(q8[:, :3], k8, k8), ValueError),
        ("v shape differs from k", lambda: fp8_attention(q8, k8, k8[:, :, :4]), ValueError),
        ("batch mismatch", lambda: fp8_attention(q8, torch.cat([k8, k8]), torch.cat([k8, k8])), ValueError),
        ("descale of the wrong shape", lambda: fp8_attention(q8, k8, k8, torch.ones(4, device=device)), ValueError),
        ("float16 descale", lambda: fp8_attention(q8, k8, k8, d.half()), TypeError),
        ("scale not positive", lambda: fp8_attention(q8, k8, k8, d, d, d, scale=-1.0), ValueError),
        ("fp32 output", lambda: fp8_attention(q8, k8, k8, out_dtype=torch.float32), TypeError),
        ("out of the wrong shape", lambda: fp8_attention(q8, k8, k8, out=torch.empty(1, 4, 8, 63, device=device,
                                                                                     dtype=torch.bfloat16)), ValueError),
    ]


# issue 50's benchmark, D=128 from 4k to 16k tokens, causal and not: attention's own large problems (32 heads,
# so the rows pair with the bf16 kernel's) and Llama-8B's GQA (32 query heads on 8 kv heads)
STANDARD = ([Problem(b, 32, 32, t, t, 128, c) for b, t in ((4, 4096), (1, 16384)) for c in (True, False)]
            + [Problem(b, 32, 8, t, t, 128, c) for b, t in ((4, 4096), (2, 8192), (1, 16384)) for c in (True, False)])

SPEC = K.register(K.KernelSpec(
    name="fp8_attention",
    description="FP8 (e4m3) prefill attention with per-(batch, kv head) descales, P in e4m3 at a fixed 2^8 "
                "scale, causal, GQA, bf16 output",
    run=fp8_attention,
    reference=reference,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=STANDARD + [Problem(4, 32, 8, 4096, 4096, 64, True)],
    small_problems=[Problem(2, 4, 2, 40, 40, 64, True), Problem(1, 2, 1, 17, 33, 128, False)],
    dtypes=(torch.bfloat16,),
    layouts=("contiguous", "bthd", "v_t"),
    vendor=_vendor,
    vendor_name="sdpa on dequantized bf16 (torch's default dispatch)",
    peers={"fa3_fp8": _fa3},
    bad_inputs=_bad_inputs,
    seeds=seeds,
))


def unquantized_attention(p: Problem, device, seed: int):
    """float64 attention of the unquantized inputs behind ``make_inputs(p, ..., seed)``: the format's error
    is measured against it."""
    q, k, v = unquantized(p, device, seed)
    return ref_attn.attention(q, k, v, causal=p.causal)
