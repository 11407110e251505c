"""The quantizing KV write of the FP8 paged cache (spec ``fp8_kv_write``): new K/V rows (T, Hkv, D) in
fp32/fp16/bf16 quantized into e4m3 caches, with one float32 scale per (token, kv head) in (num_blocks,
block_size, Hkv) beside each. K's cache is (num_blocks, block_size, Hkv, D); V's is transposed within each
block, (num_blocks, Hkv, D, block_size), tokens contiguous, each block and head a contiguous (D, block_size)
slab: k ≈ k_cache · k_scale[..., None], v[n, b, h, :] ≈ v_cache[n, h, :, b] · v_scale[n, b, h]. The decode
that reads the cache is :mod:`tritune.kernels.fp8_paged_attention` (where the per-token scales and V's layout
are explained: P·V's operand then loads tokens-contiguous, with no byte transposes on sm90).

One program quantizes one token's rows for BLOCK_H kv heads: each row's amax gives its scale (max|row| /
448, clamped away from 0), its values are divided, clamped to ±448 and rounded to e4m3, and both go to the
token's slot (slot = block id · block_size + offset; a negative slot is padding and writes nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.fp8_quant import outlier_rows
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_fp8
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8_attention as ref

if dev.interpreted():
    interpret_fp8.apply()   # the interpreter's float -> e4m3 conversion rounds wrong without it

E4M3 = torch.float8_e4m3fn
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128, 256)


@triton.jit
def _fp8_write_kv(Kn, Vn, Kc, Vc, Ks, Vs, Slots, num_slots, Hkv, D, stride_s,
                  s_knt, s_knh, s_knd, s_vnt, s_vnh, s_vnd,
                  s_kcn, s_kcb, s_kch, s_kcd, s_vcn, s_vch, s_vcd, s_vcb,
                  s_ksn, s_ksb, s_ksh, s_vsn, s_vsb, s_vsh,
                  BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                  MIN_SCALE: tl.constexpr):
    """Token t's heads [h0, h0 + BLOCK_H): each row quantized with its own scale into slot slots[t]."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(Slots + t * stride_s).to(tl.int64)
    live = (slot >= 0) & (slot < num_slots)   # negative: padding; out of range: dropped (validate reports)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    mask_h = offs_h < tl.where(live, Hkv, 0)
    mask = mask_h[:, None] & (offs_d < D)[None, :]
    for which in tl.static_range(2):
        if which == 0:
            x = tl.load(Kn + t * s_knt + offs_h[:, None] * s_knh + offs_d[None, :] * s_knd, mask=mask, other=0.0)
        else:
            x = tl.load(Vn + t * s_vnt + offs_h[:, None] * s_vnh + offs_d[None, :] * s_vnd, mask=mask, other=0.0)
        x = x.to(tl.float32)
        # IEEE-rounded divisions (fp32 `/` compiles to an approximate one on GPUs): the scales and codes are the
        # reference's bit for bit, which the decode's reference reads back
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0), MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0).to(tl.float8e4nv)
        if which == 0:
            tl.store(Kc + block * s_kcn + offset * s_kcb + offs_h[:, None] * s_kch + offs_d[None, :] * s_kcd, q,
                     mask=mask)
            tl.store(Ks + block * s_ksn + offset * s_ksb + offs_h * s_ksh, scale, mask=mask_h)
        else:
            tl.store(Vc + block * s_vcn + offset * s_vcb + offs_h[:, None] * s_vch + offs_d[None, :] * s_vcd, q,
                     mask=mask)
            tl.store(Vs + block * s_vsn + offset * s_vsb + offs_h * s_vsh, scale, mask=mask_h)


def v_cache_shape(num_blocks: int, block_size: int, Hkv: int, D: int) -> tuple[int, int, int, int]:
    """V's cache shape beside a K cache of (num_blocks, block_size, Hkv, D): transposed within each block."""
    return num_blocks, Hkv, D, block_size


def check_cache(k_cache, v_cache, k_scale, v_scale, device):
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        K.check_tensor(name, c, ndim=4, dtypes=(E4M3,))
        if c.device != device:
            raise ValueError(f"{name}: on {c.device}, but the queries/new rows are on {device}")
    want = v_cache_shape(*k_cache.shape)
    if tuple(v_cache.shape) != want:
        old = " (K's token-major layout)" if v_cache.shape == k_cache.shape else ""
        raise ValueError(f"v_cache: expected shape {want} (num_blocks, Hkv, D, block_size), V transposed within "
                         f"each block beside k_cache {tuple(k_cache.shape)}; got {tuple(v_cache.shape)}{old}")
    bs, D = k_cache.shape[1], k_cache.shape[3]
    if (bs > 1 and v_cache.stride(3) != 1) or (D > 1 and v_cache.stride(2) != bs):
        raise ValueError(f"v_cache: each block's (D, block_size) slab must be contiguous (strides ({bs}, 1) in "
                         f"the last two dims), got strides {tuple(v_cache.stride())}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        K.check_tensor(name, s, ndim=3, dtypes=(torch.float32,))
        if tuple(s.shape) != tuple(k_cache.shape[:3]):
            raise ValueError(f"{name}: expected shape {tuple(k_cache.shape[:3])} (num_blocks, block_size, Hkv), "
                             f"got {tuple(s.shape)}")
        if s.device != device:
            raise ValueError(f"{name}: on {s.device}, but the queries/new rows are on {device}")
    bs = k_cache.shape[1]
    if not K.is_block_size(bs):
        raise ValueError(f"k_cache: block_size {bs} is not {K.BLOCK_SIZES}")


_WRITE_PLANS = K.PlanCache()


class _WritePlan:
    __slots__ = ("cfg", "cfg_key", "grid", "kws", "T")


def _write_plan(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, config) -> _WritePlan:
    for name, t in (("k", k), ("v", v)):
        K.check_tensor(name, t, ndim=3, dtypes=KV_DTYPES)
        K.check_device(name, t)
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: shape {tuple(v.shape)} / dtype {v.dtype} differ from k's {tuple(k.shape)} / {k.dtype}")
    check_cache(k_cache, v_cache, k_scale, v_scale, k.device)
    nb, bs, Hkv, D = k_cache.shape
    if tuple(k.shape[1:]) != (Hkv, D):
        raise ValueError(f"k: per-token shape {tuple(k.shape[1:])} does not match the cache's (Hkv, D) = {(Hkv, D)}")
    K.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32, torch.int64))
    if slot_mapping.device != k.device:
        raise ValueError(f"slot_mapping: on {slot_mapping.device}, but k is on {k.device}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")
    if dev.interpreted():
        interpret_fp8.require("fp8_kv_write")
    p = WriteProblem(k.shape[0], Hkv, D, bs)
    plan = _WritePlan()
    plan.T = k.shape[0]
    plan.cfg, plan.cfg_key = WRITE_SPEC.config_and_key(p, k.dtype, config)
    c = plan.cfg
    plan.grid = (k.shape[0], triton.cdiv(Hkv, c["BLOCK_H"]))
    plan.kws = dict(BLOCK_SIZE=bs, BLOCK_H=c["BLOCK_H"], BLOCK_D=triton.next_power_of_2(D),
                    MIN_SCALE=ref.MIN_SCALE, num_warps=c["num_warps"])
    return plan


def fp8_write_kv(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, *, validate: bool = True,
                 config: dict | None = None):
    """Quantize new tokens into the FP8 cache, in place: for s = slot_mapping[t], each kv head's row of
    k[t] gets scale max|row| / 448 in k_scale[s // block_size, s % block_size] and its e4m3 values in
    k_cache at the same slot (and v likewise). k, v (T, Hkv, D) fp32/fp16/bf16; caches (num_blocks,
    block_size, Hkv, D) e4m3 for K, (num_blocks, Hkv, D, block_size) for V (see the module's docstring);
    scales (num_blocks, block_size, Hkv) float32; a negative slot is padding.
    ``validate=True`` checks that slots are in range and distinct (a host sync). Returns the four caches."""
    try:
        key = tuple(K.tensor_meta(t) for t in (k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale)) + (
            None if config is None else tuple(config.items()),)
        hash(key)
    except (AttributeError, TypeError):
        key = None
    plan = _WRITE_PLANS.get_or_make(key, lambda: _write_plan(k, v, slot_mapping, k_cache, v_cache, k_scale,
                                                             v_scale, config))
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if validate and plan.T:
        s = slot_mapping.long()
        live = s[s >= 0]
        if live.numel() and int(live.max()) >= num_slots:
            raise ValueError(f"slot_mapping: slot {int(live.max())} out of range for {k_cache.shape[0]} blocks x "
                             f"{k_cache.shape[1]} tokens")
        if torch.unique(live).numel() != live.numel():
            raise ValueError("slot_mapping: the same slot appears twice")
    if plan.T and k_cache.shape[2]:
        _fp8_write_kv[plan.grid](k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_slots,
                                 k_cache.shape[2], k_cache.shape[3], slot_mapping.stride(0), *k.stride(),
                                 *v.stride(), *k_cache.stride(), *v_cache.stride(), *k_scale.stride(),
                                 *v_scale.stride(), **plan.kws)
    return k_cache, v_cache, k_scale, v_scale


@dataclass(frozen=True)
class WriteProblem:
    T: int                 # tokens written (every slot of the cache, plus `pad` padding tokens)
    Hkv: int
    D: int
    block_size: int = 16
    pad: int = 0           # tokens with slot -1 (skipped)

    @property
    def blocks(self) -> int:
        return max(1, -(-(self.T - self.pad) // self.block_size))


def _write_problem_of(k, v, slot_mapping, *, num_blocks=None, block_size=16, **_) -> WriteProblem:
    return WriteProblem(k.shape[0], k.shape[1], k.shape[2], block_size)


def _write_run(k, v, slot_mapping, *, num_blocks: int, block_size: int, out=None, config=None, validate=False):
    """The spec's launch: the four cache tensors as ``out`` (fresh ones when None); every slot is written."""
    if out is None:
        Hkv, D = k.shape[1:]
        out = (torch.empty((num_blocks, block_size, Hkv, D), dtype=E4M3, device=k.device),
               torch.empty(v_cache_shape(num_blocks, block_size, Hkv, D), dtype=E4M3, device=k.device),
               torch.empty((num_blocks, block_size, Hkv), dtype=torch.float32, device=k.device),
               torch.empty((num_blocks, block_size, Hkv), dtype=torch.float32, device=k.device))
    return fp8_write_kv(k, v, slot_mapping, *out, validate=validate, config=config)


def _write_reference(k, v, slot_mapping, *, num_blocks: int, block_size: int, **_):
    Hkv, D = k.shape[1:]
    z4 = torch.zeros((num_blocks, block_size, Hkv, D), dtype=torch.float64, device=k.device)
    zv = torch.zeros(v_cache_shape(num_blocks, block_size, Hkv, D), dtype=torch.float64, device=k.device)
    z3 = torch.zeros((num_blocks, block_size, Hkv), dtype=torch.float64, device=k.device)
    return ref.fp8_write_kv(k, v, slot_mapping, z4, zv, z3, z3)


def _write_make_inputs(p: WriteProblem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """Every slot of a (blocks, block_size) cache written once, in a random order, with ``pad`` padding
    tokens (slot -1) among them; rows of very different magnitudes (per-token scales), each with an outlier
    (``fp8_quant.outlier_rows``: no quotient on a rounding midpoint). "sliced": k and v are views of one
    fused (T, 2·Hkv, D) buffer, as a QKV projection leaves them, and the scales token-major (contiguous);
    "contiguous": the scales head-major within each block, as the engine's pool holds them."""
    n = p.blocks * p.block_size
    T = n + p.pad
    # at most 2^9: a row's outlier is up to 16 times its largest other value, and must stay finite in fp16
    # (an inf input has no scale: inf / inf is NaN in the kernel and the reference alike)
    mag = torch.exp(S.randn((T, p.Hkv, 1), torch.float32, device, seed + 5, scale=2.0)).clamp(2.0 ** -9, 2.0 ** 9)
    k = S.randn((T, p.Hkv, p.D), torch.float32, device, seed) * mag
    v = S.randn((T, p.Hkv, p.D), torch.float32, device, seed + 1) * mag.flip(0)
    k, v = outlier_rows(k, dtype, seed % p.D), outlier_rows(v, dtype, (seed + 1) % p.D)
    if layout == "sliced":
        kv = torch.cat([k, v], dim=1)
        k, v = kv[:, :p.Hkv], kv[:, p.Hkv:]
    g = torch.Generator().manual_seed(seed)
    slots = torch.cat([torch.randperm(n, generator=g), torch.full((p.pad,), -1, dtype=torch.long)])
    slots = slots[torch.randperm(T, generator=g)].to(torch.int32 if seed % 2 else torch.int64).to(device)
    out = (torch.empty((p.blocks, p.block_size, p.Hkv, p.D), dtype=E4M3, device=device),
           torch.empty(v_cache_shape(p.blocks, p.block_size, p.Hkv, p.D), dtype=E4M3, device=device),
           *(torch.empty((p.blocks, p.block_size, p.Hkv), dtype=torch.float32, device=device) if layout == "sliced"
             else torch.empty((p.blocks, p.Hkv, p.block_size), dtype=torch.float32, device=device).transpose(1, 2)
             for _ in range(2)))
    return K.Case(args=(k, v, slots), kwargs={"num_blocks": p.blocks, "block_size": p.block_size}, out=out)


def _write_problems(max_elems: int):
    from hypothesis import strategies as st

    small = dev.interpreted()

    @st.composite
    def draw(d):
        bs = d(st.sampled_from([1, 4, 8] if small else [1, 8, 16]))
        blocks = d(st.integers(1, 4 if small else 256))
        pad = d(st.integers(0, 3))
        hkv = d(st.sampled_from([1, 2, 3, 8]))
        D = d(st.sampled_from([16, 64, 128] if small else list(HEAD_DIMS)))
        return WriteProblem(blocks * bs + pad, hkv, D, bs, pad)

    return draw()


def _write_constraint(c, p: WriteProblem, dtype) -> str | None:
    bd = triton.next_power_of_2(p.D)
    if c["BLOCK_H"] > triton.next_power_of_2(p.Hkv):
        return "BLOCK_H larger than Hkv"
    if c["BLOCK_H"] * bd // (32 * c["num_warps"]) > 64:
        return "register spills"
    if c["num_warps"] > 1 and c["BLOCK_H"] * bd < 32 * c["num_warps"]:
        return "idle threads"
    return None


WRITE_SPACE = K.Space(params={"BLOCK_H": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4]}, constraint=_write_constraint)


def _write_default(p: WriteProblem, dtype) -> dict:
    bd = triton.next_power_of_2(p.D)
    bh = min(triton.next_power_of_2(p.Hkv), 8)
    warps = 4
    while warps > 1 and bh * bd < 32 * warps:
        warps //= 2
    while bh * bd // (32 * warps) > 64:
        bh //= 2
    return {"BLOCK_H": bh, "num_warps": warps}


def _write_vendor(c: K.Case):
    """torch ops: amax, divide, cast, index_copy into the flat caches (a few kernels)."""
    k, v, slots = c.args
    nb, bs = c.kwargs["num_blocks"], c.kwargs["block_size"]
    caches = _write_run(k, v, slots, num_blocks=nb, block_size=bs)
    live = slots >= 0
    idx = slots[live].long()
    kl, vl = k[live], v[live]

    v_rows = ref.v_rows(caches[1])      # (num_blocks, block_size, Hkv, D) view of V's transposed blocks

    def call():
        for x, qc, sc in ((kl, caches[0], caches[2]), (vl, None, caches[3])):
            s = (x.abs().amax(dim=-1).float() / 448.0).clamp_min(ref.MIN_SCALE)
            q = (x.float() / s[..., None]).to(E4M3)
            if qc is None:
                v_rows.view(torch.uint8)[idx // bs, idx % bs] = q.view(torch.uint8)
            else:
                qc.view(nb * bs, *qc.shape[2:]).index_copy_(0, idx, q)
            sc.view(nb * bs, -1).index_copy_(0, idx, s)
        return caches

    return call


def _write_bad_inputs(device):
    Hkv, D, bs, nb = 2, 32, 16, 6
    kc = torch.zeros(nb, bs, Hkv, D, device=device).to(E4M3)
    vc = torch.zeros(v_cache_shape(nb, bs, Hkv, D), device=device).to(E4M3)
    sc = torch.ones(nb, bs, Hkv, device=device)
    kn = torch.randn(3, Hkv, D, device=device, dtype=torch.bfloat16)
    slots = torch.tensor([0, 17, -1], dtype=torch.int32, device=device)

    def wk(**kw):
        a = dict(k=kn, v=kn.clone(), slot_mapping=slots, k_cache=kc.clone(), v_cache=vc.clone(), k_scale=sc.clone(),
                 v_scale=sc.clone())
        a.update(kw)
        return lambda: fp8_write_kv(**a)

    return [
        ("k_scale of the wrong shape", wk(k_scale=sc[:, :8]), ValueError),
        ("write: v_cache in K's token-major layout", wk(v_cache=kc.clone()), ValueError),
        ("write: v_cache blocks not contiguous slabs", wk(v_cache=kc.clone().permute(0, 2, 3, 1)), ValueError),
        ("write: slot out of range", wk(slot_mapping=torch.tensor([0, nb * bs, -1], dtype=torch.int32,
                                                                   device=device)), ValueError),
        ("write: duplicate slot", wk(slot_mapping=torch.tensor([4, 4, -1], dtype=torch.int32, device=device)),
         ValueError),
        ("write: float slot_mapping", wk(slot_mapping=slots.float()), TypeError),
        ("write: bf16 cache", wk(k_cache=kc.to(torch.bfloat16)), TypeError),
        ("write: head count mismatch", wk(k=torch.randn(3, Hkv + 1, D, device=device), v=torch.randn(3, Hkv + 1, D,
                                                                                                    device=device)),
         ValueError),
    ]


WRITE_SPEC = K.register(K.KernelSpec(
    name="fp8_kv_write",
    description="quantizing KV write: new K/V rows to e4m3 in a paged cache, one float32 scale per (token, kv head)",
    run=_write_run,
    reference=_write_reference,
    make_inputs=_write_make_inputs,
    problems=_write_problems,
    space=WRITE_SPACE,
    default_config=_write_default,
    bucket=lambda p: {"T": triton.next_power_of_2(p.T), "Hkv": p.Hkv, "D": p.D},
    cost=lambda p, dtype: K.Cost(flops=6.0 * p.T * p.Hkv * p.D,
                                 bytes=float(2 * p.T * p.Hkv * (p.D * (torch.finfo(dtype).bits // 8 + 1) + 4))),
    problem_of=_write_problem_of,
    # a decode step of 64 sequences, and a 8k-token prefill (Llama-8B: 8 kv heads of 128)
    standard_problems=[WriteProblem(64, 8, 128), WriteProblem(8192, 8, 128), WriteProblem(256, 12, 64)],
    small_problems=[WriteProblem(2 * 8 + 1, 2, 64, 8, 1), WriteProblem(3 * 4, 3, 16, 4)],
    dtypes=(torch.bfloat16, torch.float16),
    layouts=("contiguous", "sliced"),
    vendor=_write_vendor,
    vendor_name="torch ops (amax, divide, cast, index_copy)",
    bad_inputs=_write_bad_inputs,
))
