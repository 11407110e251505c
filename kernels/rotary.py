"""Rotary position embedding of q and k in one launch, from per-position cos / sin tables.

The "neox" layout Hugging Face's Llama, Qwen2 and Mistral use: the first R = rotary_dim dims of each head are
two halves (x1, x2) rotated as (x1·cos − x2·sin, x2·cos + x1·sin) by the angles of the token's position
(``cos[pos]``, ``sin[pos]``, R/2 values each); dims R..D pass through (partial rotary). The tables carry
whatever the rope scaling type made of the angles (linear, dynamic NTK, Llama 3, YaRN's attention factor):
the kernel only indexes them, so every type is the same launch. Arithmetic in float32.

One program takes BLOCK_T tokens and BLOCK_H heads of q or of k (the grid's second axis covers q's head
blocks, then k's), loading each token's cos / sin row once for its heads. q and k may be strided views (the
columns of a fused qkv projection's output); the results go to new tensors or over q and k (``out=(q, k)``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S
from tritune.references import rotary as ref


@triton.jit
def _rotate_heads(X, O, h0, H, offs_t, mask_t, c, s, stride_xt, stride_xh, stride_xd, stride_ot, stride_oh,
                  stride_od, HALF, D, Cache, slot, BLOCK_H: tl.constexpr, HALF_P: tl.constexpr,
                  REST_P: tl.constexpr, COPY_REST: tl.constexpr, TO_CACHE: tl.constexpr):
    """BLOCK_H heads of X rotated into O; TO_CACHE: the same rounded values (pass-through dims included)
    also to the contiguous (slots, H, D) cache at each token's slot (< 0: not written)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_th = mask_t[:, None] & (offs_h < H)[None, :]
    t64 = offs_t.to(tl.int64)[:, None, None]
    x_rows = X + t64 * stride_xt + offs_h[None, :, None] * stride_xh
    o_rows = O + t64 * stride_ot + offs_h[None, :, None] * stride_oh
    offs_d = tl.arange(0, HALF_P)[None, None, :]
    mask = mask_th[:, :, None] & (offs_d < HALF)
    x1 = tl.load(x_rows + offs_d * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + (offs_d + HALF) * stride_xd, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * c - x2 * s).to(O.dtype.element_ty)
    r2 = (x2 * c + x1 * s).to(O.dtype.element_ty)
    tl.store(o_rows + offs_d * stride_od, r1, mask=mask)
    tl.store(o_rows + (offs_d + HALF) * stride_od, r2, mask=mask)
    offs_r = 2 * HALF + tl.arange(0, REST_P)[None, None, :]
    mask_r = mask_th[:, :, None] & (offs_r < D)
    if COPY_REST or TO_CACHE:
        rest = tl.load(x_rows + offs_r * stride_xd, mask=mask_r)
    if COPY_REST:
        tl.store(o_rows + offs_r * stride_od, rest, mask=mask_r)
    if TO_CACHE:
        live = (slot >= 0)[:, None, None]
        c_rows = Cache + slot[:, None, None] * (H * D) + offs_h[None, :, None] * D
        tl.store(c_rows + offs_d, r1, mask=mask & live)
        tl.store(c_rows + offs_d + HALF, r2, mask=mask & live)
        tl.store(c_rows + offs_r, rest, mask=mask_r & live)


@triton.jit
def _copy_heads(V, Cache, h0, H, offs_t, mask_t, slot, stride_vt, stride_vh, stride_vd, D,
                BLOCK_H: tl.constexpr, D_P: tl.constexpr):
    """BLOCK_H heads of V to the (slots, H, D) cache at each token's slot (< 0: not written)."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_P)[None, None, :]
    mask = (mask_t[:, None] & (offs_h < H)[None, :])[:, :, None] & (offs_d < D) & (slot >= 0)[:, None, None]
    v = tl.load(V + offs_t.to(tl.int64)[:, None, None] * stride_vt + offs_h[None, :, None] * stride_vh
                + offs_d * stride_vd, mask=mask)
    tl.store(Cache + slot[:, None, None] * (H * D) + offs_h[None, :, None] * D + offs_d, v, mask=mask)


@triton.jit
def _rotary_fwd(Q, K_, QO, KO, Pos, Cos, Sin, V, KC, VC, Slots, T, Hq, Hk, HALF, D, q_blocks, k_blocks,
                stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                stride_qot, stride_qoh, stride_qod, stride_kot, stride_koh, stride_kod, stride_pos,
                stride_cos, stride_sin, stride_vt, stride_vh, stride_vd,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF_P: tl.constexpr, REST_P: tl.constexpr,
                COPY_REST: tl.constexpr, HAS_KV: tl.constexpr, D_P: tl.constexpr):
    """Grid (token blocks, q head blocks + k head blocks (+ v head blocks with HAS_KV)). HAS_KV: the
    rotated k and v also written to the paged caches KC / VC at Slots (the KV-cache write fused in)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    slot = offs_t * 0
    if HAS_KV:
        slot = tl.load(Slots + offs_t, mask=mask_t, other=-1).to(tl.int64)
    if pid_h < q_blocks + k_blocks:
        pos = tl.load(Pos + offs_t * stride_pos, mask=mask_t, other=0).to(tl.int64)
        offs_c = tl.arange(0, HALF_P)
        mask_c = mask_t[:, None] & (offs_c < HALF)[None, :]
        c = tl.load(Cos + pos[:, None] * stride_cos + offs_c[None, :], mask=mask_c, other=0.0).to(tl.float32)
        s = tl.load(Sin + pos[:, None] * stride_sin + offs_c[None, :], mask=mask_c, other=0.0).to(tl.float32)
        c = c[:, None, :]
        s = s[:, None, :]
        if pid_h < q_blocks:
            _rotate_heads(Q, QO, pid_h * BLOCK_H, Hq, offs_t, mask_t, c, s, stride_qt, stride_qh, stride_qd,
                          stride_qot, stride_qoh, stride_qod, HALF, D, KC, slot, BLOCK_H, HALF_P, REST_P,
                          COPY_REST, False)
        else:
            _rotate_heads(K_, KO, (pid_h - q_blocks) * BLOCK_H, Hk, offs_t, mask_t, c, s, stride_kt, stride_kh,
                          stride_kd, stride_kot, stride_koh, stride_kod, HALF, D, KC, slot, BLOCK_H, HALF_P,
                          REST_P, COPY_REST, HAS_KV)
    elif HAS_KV:
        _copy_heads(V, VC, (pid_h - q_blocks - k_blocks) * BLOCK_H, Hk, offs_t, mask_t, slot, stride_vt, stride_vh,
                    stride_vd, D, BLOCK_H, D_P)


# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    T: int       # tokens
    Hq: int      # query heads
    Hk: int      # key heads
    D: int       # head dim
    R: int       # rotary dims (even, <= D)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_D = 1024


def problem_of(q, k, cos, sin, positions, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], 2 * cos.shape[1])


class _Plan:
    __slots__ = ("T", "grid", "ints", "kws", "cfg", "cfg_key", "validate_n", "validate_slots")


_PLANS = K.PlanCache()


def _check_table(name, t, x):
    K.check_tensor(name, t, ndim=2, dtypes=DTYPES)
    if t.device != x.device:
        raise ValueError(f"{name}: on {t.device}, but q is on {x.device}")
    if t.shape[1] and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride along its last dim, got {t.stride(1)}")


def _check_args(q, k, cos, sin, positions):
    K.check_tensor("q", q, ndim=3, dtypes=DTYPES)
    K.check_device("q", q)
    K.check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    if k.device != q.device:
        raise ValueError(f"k: on {k.device}, but q is on {q.device}")
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k: shape {tuple(k.shape)} does not match q's tokens and head dim {tuple(q.shape)}")
    D = q.shape[2]
    if not 2 <= D <= MAX_D:
        raise ValueError(f"q: head dim {D} out of range (2 <= D <= {MAX_D})")
    _check_table("cos", cos, q)
    _check_table("sin", sin, q)
    if sin.shape != cos.shape:
        raise ValueError(f"sin: shape {tuple(sin.shape)} differs from cos's {tuple(cos.shape)}")
    if not 1 <= 2 * cos.shape[1] <= D:
        raise ValueError(f"cos: {cos.shape[1]} angles per position rotate {2 * cos.shape[1]} dims; expected 1 to "
                         f"{D // 2} (head dim {D})")
    if cos.shape[0] < 1:
        raise ValueError("cos: expected at least one position")
    K.check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions: expected {q.shape[0]} (one per token of q), got {positions.shape[0]}")
    if positions.device != q.device:
        raise ValueError(f"positions: on {positions.device}, but q is on {q.device}")


def _check_kv(kv, q, k) -> None:
    """kv = (k_cache, v_cache, slot_mapping, v): contiguous (num_blocks, block_size, Hk, D) caches of q's dtype,
    v shaped as k, one int slot per token."""
    if not isinstance(kv, (tuple, list)) or len(kv) != 4:
        raise TypeError("kv: expected (k_cache, v_cache, slot_mapping, v)")
    kc, vc, slots, v = kv
    for name, t in (("k_cache", kc), ("v_cache", vc)):
        K.check_tensor(name, t, ndim=4, dtypes=(q.dtype,))
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
        if not t.is_contiguous() or tuple(t.shape[2:]) != tuple(k.shape[1:]):
            raise ValueError(f"{name}: expected a contiguous (num_blocks, block_size, {k.shape[1]}, {k.shape[2]}) "
                             f"cache (k's heads and head dim), got shape {tuple(t.shape)}")
    if vc.shape != kc.shape:
        raise ValueError(f"v_cache: shape {tuple(vc.shape)} differs from k_cache's {tuple(kc.shape)}")
    K.check_tensor("v", v, ndim=3, dtypes=(q.dtype,))
    if v.shape != k.shape or v.device != k.device:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)} on {k.device}, got {tuple(v.shape)} on {v.device}")
    K.check_tensor("slot_mapping", slots, ndim=1, dtypes=(torch.int32, torch.int64))
    if slots.shape[0] != q.shape[0] or slots.device != q.device:
        raise ValueError(f"slot_mapping: expected {q.shape[0]} slots (one per token) on {q.device}, got "
                         f"{slots.shape[0]} on {slots.device}")


def _plan(q, k, cos, sin, positions, out, config, kv=None) -> _Plan:
    _check_args(q, k, cos, sin, positions)
    if kv is not None:
        _check_kv(kv, q, k)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError("out: expected a pair (q_out, k_out)")
        for name, o, x in (("out[0]", out[0], q), ("out[1]", out[1], k)):
            K.check_tensor(name, o)
            if tuple(o.shape) != tuple(x.shape) or o.dtype != x.dtype or o.device != x.device:
                raise ValueError(f"{name}: expected shape {tuple(x.shape)}, {x.dtype} on {x.device}, got "
                                 f"{tuple(o.shape)}, {o.dtype} on {o.device}")
    T, Hq, D = q.shape
    Hk, half = k.shape[1], cos.shape[1]
    p = _Plan()
    p.T, p.validate_n = T, cos.shape[0]
    if T == 0 or Hq + Hk == 0:
        p.cfg = p.cfg_key = p.grid = p.ints = p.kws = None
        return p
    p.cfg, p.cfg_key = SPEC.config_and_key(Problem(T, Hq, Hk, D, 2 * half), q.dtype, config)
    bt, bh = p.cfg["BLOCK_T"], p.cfg["BLOCK_H"]
    q_blocks, k_blocks = triton.cdiv(Hq, bh), triton.cdiv(Hk, bh)
    p.grid = (triton.cdiv(T, bt), q_blocks + k_blocks * (2 if kv is not None else 1))
    # in place (part of the plan's key): the pass-through dims are already where they belong
    in_place = out is not None and _same_view(out[0], q) and _same_view(out[1], k)
    p.ints = (T, Hq, Hk, half, D, q_blocks, k_blocks)
    p.kws = dict(BLOCK_T=bt, BLOCK_H=bh, HALF_P=triton.next_power_of_2(half),
                 REST_P=triton.next_power_of_2(max(1, D - 2 * half)), COPY_REST=2 * half < D and not in_place,
                 HAS_KV=kv is not None, D_P=triton.next_power_of_2(D), num_warps=p.cfg["num_warps"])
    p.validate_slots = kv[0].shape[0] * kv[0].shape[1] if kv is not None else 0
    return p


def _validate_positions(positions, n: int) -> None:
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= n):
        raise ValueError(f"positions: expected values in [0, {n}) (the cos / sin tables' rows), got "
                         f"{int(positions.min())}..{int(positions.max())}")


def _validate_slots(slots, n: int) -> None:
    if slots.numel() and int(slots.max()) >= n:
        raise ValueError(f"slot_mapping: a slot {int(slots.max())} past the caches' {n} (num_blocks x block_size)")


def _same_view(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride())


def rotary(q, k, cos, sin, positions, *, out=None, kv=None, config: dict | None = None, validate: bool = True):
    """(q, k) rotated by the angles of ``positions``: q (T, Hq, D), k (T, Hk, D) of one float dtype (any
    strides); cos, sin (P, R/2) tables (R <= D: dims past R pass through); positions (T,) int32/int64 rows of
    the tables. Returns (q_out, k_out), new tensors or ``out``, which may be (q, k) themselves (in place).
    ``kv``: (k_cache, v_cache, slot_mapping, v): the rotated k and v (T, Hk, D) also written to the paged
    caches (num_blocks, block_size, Hk, D) at each token's flat slot (< 0: skipped), the KV-cache write of
    the step fused into the rotation. ``validate``: check that every position is a row of the tables and
    every slot one of the caches' (a host sync; off inside the model)."""
    try:  # the hot path: one dict lookup; anything odd takes _plan, which names the bad argument
        outs = out if isinstance(out, (tuple, list)) else (out,)
        in_place = len(outs) == 2 and _same_view(outs[0], q) and _same_view(outs[1], k)
        key = (q.shape, q.stride(), q.dtype, q.device, K.tensor_meta(k), K.tensor_meta(cos), K.tensor_meta(sin),
               K.tensor_meta(positions), *(K.tensor_meta(o) for o in outs), len(outs), in_place,
               None if kv is None else tuple(K.tensor_meta(t) for t in kv),
               None if config is None else tuple(config.items()))
    except (AttributeError, TypeError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _plan(q, k, cos, sin, positions, out, config, kv))
    if out is None:
        qo, ko = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                 device=k.device)
    else:
        qo, ko = out
        if not in_place:  # wholly in place: each element is read, then written, by one program
            ins = (("q", q), ("k", k), ("cos", cos), ("sin", sin), ("positions", positions))
            K.check_no_alias(qo, ins + (("out[1]", ko),), in_place="q")
            K.check_no_alias(ko, ins, in_place="k")
    if plan.grid is None:
        return qo, ko
    if validate:
        _validate_positions(positions, plan.validate_n)
    if kv is None:
        kc = vc = slots = v = q
    else:
        kc, vc, slots, v = kv
        if validate:
            _validate_slots(slots, plan.validate_slots)
    _rotary_fwd[plan.grid](q, k, qo, ko, positions, cos, sin, v, kc, vc, slots, *plan.ints, *q.stride(),
                           *k.stride(), *qo.stride(), *ko.stride(), positions.stride(0), cos.stride(0),
                           sin.stride(0), *v.stride(), **plan.kws)
    return qo, ko


# ---------------------------------------------------------------------------------------------------
SPACE = K.Space(
    params={
        "BLOCK_T": [1, 2, 4, 8, 16, 32, 64],
        "BLOCK_H": [1, 2, 4, 8, 16, 32],
        "num_warps": [1, 2, 4, 8],
    },
)


def _constraint(c, p: Problem, dtype) -> str | None:
    if c["BLOCK_T"] > triton.next_power_of_2(p.T):
        return "BLOCK_T larger than the problem"
    if c["BLOCK_H"] > triton.next_power_of_2(max(p.Hq, p.Hk)):
        return "BLOCK_H larger than the heads"
    elems = c["BLOCK_T"] * c["BLOCK_H"] * triton.next_power_of_2(max(1, p.R // 2))
    per_thread = elems // (32 * c["num_warps"])
    if per_thread > 64:
        return f"{per_thread} elements per thread of each half (register spills)"
    if per_thread < 1 and c["num_warps"] > 1:
        return "idle warps"
    return None


SPACE.constraint = _constraint


def default_config(p: Problem, dtype) -> dict:
    half = triton.next_power_of_2(max(1, p.R // 2))
    bh = min(triton.next_power_of_2(max(p.Hq, p.Hk)), max(1, 256 // half), 32)
    bt = min(triton.next_power_of_2(p.T), max(1, 1024 // (half * bh)), 64)
    warps = max(1, min(8, bt * bh * half // 256))
    while bt * bh * half // (32 * warps) > 64:
        bt //= 2
    return {"BLOCK_T": bt, "BLOCK_H": bh, "num_warps": warps}


def bucket(p: Problem) -> dict:
    return {"T": triton.next_power_of_2(p.T), "Hq": p.Hq, "Hk": p.Hk, "D": p.D, "R": p.R}


def cost(p: Problem, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    rotated = p.T * (p.Hq + p.Hk) * p.R
    # q and k rotated dims read and written, pass-through dims copied, the tables' rows read once per token
    return K.Cost(flops=3.0 * rotated, bytes=float(e * 2 * p.T * (p.Hq + p.Hk) * p.D + 4 * p.T * p.R + 8 * p.T))


def _angles(P: int, half: int, device, base: float = 10000.0):
    """cos, sin (P, half) float32 of the default rope: angle = pos · base^(-2i/R)."""
    inv = 1.0 / (base ** (torch.arange(0, half, dtype=torch.float64) * 2 / (2 * half)))
    ang = torch.arange(P, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float().to(device), ang.sin().float().to(device)


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    if layout == "fused":   # q and k as column views of one (T, Hq + 2 Hk, D) qkv output
        qkv = S.randn((p.T, p.Hq + 2 * p.Hk, p.D), dtype, device, seed)
        q, k = qkv[:, :p.Hq], qkv[:, p.Hq:p.Hq + p.Hk]
    else:
        q = S.randn((p.T, p.Hq, p.D), dtype, device, seed)
        k = S.randn((p.T, p.Hk, p.D), dtype, device, seed + 1)
    P = p.T + 5
    cos, sin = _angles(P, p.R // 2, device)
    g = torch.Generator().manual_seed(seed + 2)
    positions = torch.randint(0, P, (p.T,), generator=g).to(device)
    out = (torch.empty((p.T, p.Hq, p.D), dtype=dtype, device=device),
           torch.empty((p.T, p.Hk, p.D), dtype=dtype, device=device))
    return K.Case(args=(q, k, cos, sin, positions), out=out)


def problems(max_elems: int):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        D = d(st.sampled_from([2, 8, 16, 32, 64, 80, 96, 128, 256]))
        R = 2 * d(st.integers(1, D // 2)) if d(st.booleans()) else D
        hq = d(st.integers(1, 16))
        hk = d(st.sampled_from([h for h in range(1, hq + 1) if hq % h == 0]))
        T = d(S.sizes(max(1, min(4096, max_elems // ((hq + hk) * D)))))
        return Problem(T, hq, hk, D, R)

    return draw()


def _vendor(c: K.Case):
    q, k, cos, sin, pos = c.args
    half = cos.shape[1]

    def rot(x, cc, ss):
        x1, x2 = x[..., :half], x[..., half:2 * half]
        return torch.cat((x1 * cc - x2 * ss, x2 * cc + x1 * ss, x[..., 2 * half:]), dim=-1)

    def call():
        cc, ss = cos[pos][:, None, :].to(q.dtype), sin[pos][:, None, :].to(q.dtype)
        return rot(q, cc, ss), rot(k, cc, ss)

    return call


def _bad_inputs(device):
    q, k = torch.randn(4, 2, 8, device=device), torch.randn(4, 1, 8, device=device)
    cos, sin = _angles(6, 4, device)
    pos = torch.arange(4, device=device)
    cache, cache2 = torch.zeros(4, 4, 1, 8, device=device), torch.zeros(4, 4, 2, 8, device=device)
    slots = torch.arange(4, device=device)

    def rot(**kw):
        a = dict(q=q, k=k, cos=cos, sin=sin, positions=pos)
        a.update(kw)
        return rotary(a.pop("q"), a.pop("k"), a.pop("cos"), a.pop("sin"), a.pop("positions"), **a)

    return [
        ("integer q", lambda: rot(q=q.int()), TypeError),
        ("2-D q", lambda: rot(q=q[:, 0]), ValueError),
        ("k of another dtype", lambda: rot(k=k.half()), TypeError),
        ("k of another head dim", lambda: rot(k=k[..., :6]), ValueError),
        ("k with other tokens", lambda: rot(k=k[:3]), ValueError),
        ("cos rotating more than the head", lambda: rot(cos=cos.repeat(1, 2), sin=sin.repeat(1, 2)), ValueError),
        ("sin of another shape", lambda: rot(sin=sin[:5]), ValueError),
        ("cos not a tensor", lambda: rot(cos=[1.0]), TypeError),
        ("float positions", lambda: rot(positions=pos.float()), TypeError),
        ("positions of another length", lambda: rot(positions=pos[:3]), ValueError),
        ("a position past the tables", lambda: rot(positions=pos + 3), ValueError),
        ("out not a pair", lambda: rot(out=torch.empty_like(q)), TypeError),
        ("out of the wrong shape", lambda: rot(out=(torch.empty_like(q), torch.empty_like(q))), ValueError),
        ("out[1] overlapping q", lambda: rot(out=(torch.empty_like(q), q[:, :1])), ValueError),
        ("kv not a 4-tuple", lambda: rot(kv=(cache, cache, slots)), TypeError),
        ("kv caches of other heads", lambda: rot(kv=(cache2, cache2, slots, k)), ValueError),
        ("kv slot past the caches", lambda: rot(kv=(cache, cache, slots + 13, k)), ValueError),
    ]


SPEC = K.register(K.KernelSpec(
    name="rotary",
    description="rotary position embedding of q and k (neox layout, partial rotary), from cos/sin tables",
    run=rotary,
    reference=ref.rotary,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[Problem(8192, 32, 8, 128, 128), Problem(16384, 14, 2, 64, 64), Problem(1, 32, 8, 128, 128),
                       Problem(4096, 32, 32, 128, 64)],
    small_problems=[Problem(17, 4, 2, 64, 64), Problem(5, 3, 1, 80, 32)],
    layouts=("contiguous", "fused"),
    vendor=_vendor,
    vendor_name="torch (index + cat)",
    bad_inputs=_bad_inputs,
))
