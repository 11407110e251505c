"""Attention's problems, input checks, buckets, costs and generated inputs (shared by both specs)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S

@dataclass(frozen=True)
class Problem:
    B: int                 # batch
    Hq: int                # query heads
    Hkv: int               # key/value heads (Hq a multiple)
    Tq: int                # query length
    Tk: int                # key length
    D: int                 # head dim
    causal: bool = False
    window: int | None = None   # causal local attention: a query sees the last `window` keys up to its own


@dataclass(frozen=True)
class PackedProblem(Problem):
    """A packed launch as its launcher sees it without reading cu_seqlens: the batch, and the longest query
    and key sequences as Tq and Tk (a sequence may have more queries than keys where Tq <= Tk)."""


@dataclass(frozen=True)
class VarlenProblem:
    seqlens_q: tuple       # per-sequence query lengths (0 allowed)
    seqlens_k: tuple       # per-sequence key lengths
    Hq: int
    Hkv: int
    D: int
    causal: bool = False
    window: int | None = None

    # What a launcher sees without reading cu_seqlens: the batch and the longest lengths.
    @property
    def B(self) -> int:
        return len(self.seqlens_q)

    @property
    def Tq(self) -> int:
        return max(self.seqlens_q, default=0)

    @property
    def Tk(self) -> int:
        return max(self.seqlens_k, default=0)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 224, 256)  # flash-attn's, plus 80


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def check_qkv(q, k, v, ndim: int):
    """Shared checks; returns (Hq, Hkv, D)."""
    K.check_tensor("q", q, ndim=ndim, dtypes=DTYPES)
    K.check_device("q", q)
    for name, t in (("k", k), ("v", v)):
        K.check_tensor(name, t, ndim=ndim)
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {_name(t.dtype)} does not match q's {_name(q.dtype)}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    D = q.shape[-1]
    if k.shape[-1] != D:
        raise ValueError(f"k: head dim {k.shape[-1]} does not match q's {D}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim {D} not supported (expected one of {HEAD_DIMS})")
    Hq, Hkv = q.shape[1], k.shape[1]  # (B, H, T, D) and (total, H, D) both keep heads at dim 1
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q: {Hq} heads is not a multiple of k/v's {Hkv} heads")
    return Hq, Hkv, D


def check_window(window, causal) -> int:
    """A local-attention window (the keys a query sees, up to its own position) as the kernel's WINDOW: 0 for
    None (every key); ValueError for anything but a positive int, or a window without causal masking."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window: expected a positive int or None, got {window!r}")
    if not causal:
        raise ValueError("window: local attention is causal (pass causal=True)")
    return window


def check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number or None, got {scale!r}")




def bucket(p) -> dict:
    return {"B": triton.next_power_of_2(max(1, p.B)), "Hq": p.Hq, "Hkv": p.Hkv,
            "Tq": triton.next_power_of_2(max(1, p.Tq)), "Tk": triton.next_power_of_2(max(1, p.Tk)),
            "D": p.D, "mask": "causal" if p.causal else "full"}


def _pairs(p) -> float:
    """Query-key pairs a row of heads computes: Tq·Tk, halved under causal masking (square case); under a
    window at most the window's keys a query."""
    lens = zip(p.seqlens_q, p.seqlens_k) if isinstance(p, VarlenProblem) else [(p.Tq, p.Tk)] * p.B
    w = getattr(p, "window", None)
    return sum(q * k * (0.5 if p.causal else 1.0) if w is None else q * min(k, w) for q, k in lens)


def cost(p, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    if isinstance(p, VarlenProblem):
        tq, tk = sum(p.seqlens_q), sum(p.seqlens_k)
    else:
        tq, tk = p.B * p.Tq, p.B * p.Tk
    # two dots of 2·D flops per query-key pair; bytes: q and o once, k and v once
    return K.Cost(flops=4.0 * p.Hq * p.D * _pairs(p), bytes=float(e * p.D * (2 * tq * p.Hq + 2 * tk * p.Hkv)))


# ---------------------------------------------------------------------------------------------------
# Inputs. Layouts: "contiguous" (B, H, T, D); "bthd": views of (B, T, H, D) buffers, k and v sharing one,
# as a model's projections produce them; "sliced": rows padded with NaN past D; "transposed": the
# head dim is not unit-stride.
def _qkv(shape_q, shape_kv, dtype, device, seed, layout):
    q = S.randn(shape_q, dtype, device, seed)
    k = S.randn(shape_kv, dtype, device, seed + 1)
    v = S.randn(shape_kv, dtype, device, seed + 2, scale=1.0, shift=0.25)
    if layout == "bthd":  # q from a (B, Tq, Hq, D) buffer, k and v from one fused (B, Tk, 2·Hkv, D) buffer
        hkv = shape_kv[1]
        kv = torch.cat([k, v], dim=1).transpose(1, 2).contiguous().transpose(1, 2)
        return q.transpose(1, 2).contiguous().transpose(1, 2), kv[:, :hkv], kv[:, hkv:]
    return tuple(S.with_layout(t, layout) for t in (q, k, v))


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    q, k, v = _qkv((p.B, p.Hq, p.Tq, p.D), (p.B, p.Hkv, p.Tk, p.D), dtype, device, seed, layout)
    return K.Case(args=(q, k, v), kwargs=_mask_kwargs(p),
                  out=torch.empty((p.B, p.Hq, p.Tq, p.D), dtype=dtype, device=device))


def _mask_kwargs(p) -> dict:
    return {"causal": p.causal} if p.window is None else {"causal": p.causal, "window": p.window}


def cu_seqlens(lens, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_varlen_inputs(p: VarlenProblem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    tq, tk = sum(p.seqlens_q), sum(p.seqlens_k)
    q, k, v = _qkv((tq, p.Hq, p.D), (tk, p.Hkv, p.D), dtype, device, seed, layout)
    return K.Case(args=(q, k, v, cu_seqlens(p.seqlens_q, device), cu_seqlens(p.seqlens_k, device), p.Tq, p.Tk),
                  kwargs=_mask_kwargs(p), out=torch.empty((tq, p.Hq, p.D), dtype=dtype, device=device))


def _heads(d, max_elems):
    from hypothesis import strategies as st

    small = max_elems <= 1 << 16  # the interpreter: few heads
    hkv = d(st.sampled_from([1, 2] if small else [1, 2, 3, 4]))
    group = d(st.sampled_from([1, 2, 4] if small else [1, 2, 4, 8]))
    return hkv * group, hkv


def _window(d, causal: bool, t: int):
    """A sliding window now and then under causal masking: one key, a few, or about the lengths."""
    from hypothesis import strategies as st

    return d(st.one_of(st.none(), st.integers(1, max(1, t) + 1))) if causal else None


def problems(max_elems: int):
    """Attention is Tq·Tk per head: lengths up to 64 on the interpreter, 2048 on a GPU; the batch keeps
    q within max_elems and the float64 reference's scores within 4·max_elems."""
    from hypothesis import strategies as st

    t_max = 64 if max_elems <= 1 << 16 else 2048

    @st.composite
    def draw(d):
        D = d(st.sampled_from(HEAD_DIMS))
        hq, hkv = _heads(d, max_elems)
        tq = d(S.sizes(t_max))
        tk = d(st.one_of(st.just(tq), S.sizes(t_max)))
        b_max = max(1, min(4, max_elems // (hq * max(tq, tk) * D), 4 * max_elems // (hq * tq * tk)))
        causal = d(st.booleans())
        return Problem(d(st.integers(1, b_max)), hq, hkv, tq, tk, D, causal, _window(d, causal, max(tq, tk)))

    return draw()


def varlen_problems(max_elems: int):
    from hypothesis import strategies as st

    t_max = 48 if max_elems <= 1 << 16 else 1024

    @st.composite
    def draw(d):
        D = d(st.sampled_from(HEAD_DIMS))
        hq, hkv = _heads(d, max_elems)
        length = st.one_of(st.sampled_from([0, 1]), S.sizes(t_max))
        lq = d(st.lists(length, min_size=1, max_size=4))
        lk = tuple(lq) if d(st.booleans()) else tuple(d(st.lists(length, min_size=len(lq), max_size=len(lq))))
        causal = d(st.booleans())
        return VarlenProblem(tuple(lq), lk, hq, hkv, D, causal, _window(d, causal, max(lq + list(lk))))

    return draw()


