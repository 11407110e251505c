"""FP8 attention in float64: prefill attention over e4m3 Q, K, V with per-(batch, kv head) descales, and
decode over a paged e4m3 KV cache with per-token scales, with the quantizers that make their inputs.

Prefill (FlashAttention-3's FP8 recipe): scores s = (q·k) · q_descale · k_descale · scale, in base 2;
the probabilities that multiply V are rounded to e4m3, as the kernel's P·V product takes them, at a fixed
scale: P = 2^(s − m + 8) with m the row's largest score rounded *up to an integer*, so P lies in (2^7, 2^8]
at the top and uses e4m3's range, not only [0, 1]. A power-of-two shift commutes with rounding to e4m3
(outside its subnormal range), so however a kernel's running maximum grows over key blocks, its rounded P
equals this one: the reference reproduces the format's rounding of P, and the tolerance measures the kernel.
The denominator sums P before rounding (FA3 does the same); V's descale multiplies the finished row.

Decode: the cache holds e4m3 values with one float32 scale per (token, kv head) (``k ≈ q · scale``),
written by :func:`quantize_kv`; K's cache is (num_blocks, block_size, Hkv, D), V's is transposed within each
block, (num_blocks, Hkv, D, block_size) (:func:`v_rows` views it token-major).
"""
from __future__ import annotations

import math

import torch

from tritune.references.fp8 import E4M3, E4M3_MAX, MIN_SCALE

LOG2E = 1.4426950408889634
P_OFFSET = 8            # P = 2^(s - m + 8): the row's largest entries land in (128, 256]
_CHUNK = 1 << 26        # float64 score elements materialised at once


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    return (amax.double() / E4M3_MAX).clamp_min(MIN_SCALE).float()


def quantize_heads(x: torch.Tensor, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, T, D), H a multiple of ``hkv``: one scale per (batch, kv head) over its group of heads (the
    descale shape FA3 takes). Returns (e4m3 tensor of x's shape, descale float32 (B, hkv))."""
    B, H, T, D = x.shape
    g = H // hkv
    amax = x.float().abs().reshape(B, hkv, g * T * D).amax(dim=-1) if x.numel() else x.new_zeros(B, hkv)
    scale = _scale_of(amax)
    full = scale.repeat_interleave(g, dim=1)[:, :, None, None]
    return (x.float() / full).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_p(p: torch.Tensor) -> torch.Tensor:
    """P values (float64, in [0, 256]) on the e4m3 grid, as float64: rounded from float32 as a kernel does."""
    return p.float().clamp(max=E4M3_MAX).to(E4M3).double()


def _per_head(d, B: int, hkv: int, device) -> torch.Tensor:
    """A descale given as None, (hkv,) or (B, hkv), as float64 (B, hkv)."""
    if d is None:
        return torch.ones(B, hkv, dtype=torch.float64, device=device)
    d = d.double()
    return d.expand(B, hkv) if d.dim() == 1 else d


def fp8_attention(q, k, v, q_descale=None, k_descale=None, v_descale=None, causal: bool = False, scale=None,
                  **_) -> torch.Tensor:
    """q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) in e4m3; descales None, (Hkv,) or (B, Hkv). Causal: query i
    sees key j <= i + Tk − Tq; a row that sees no key outputs 0. Returns (B, Hq, Tq, D) float64."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    g = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dev = q.device
    qk = (_per_head(q_descale, B, Hkv, dev) * _per_head(k_descale, B, Hkv, dev)).repeat_interleave(g, 1)
    vd = _per_head(v_descale, B, Hkv, dev).repeat_interleave(g, 1)
    out = torch.zeros(B, Hq, Tq, D, dtype=torch.float64, device=dev)
    rows = max(1, _CHUNK // max(1, Hq * Tk))
    for b in range(B):
        kb = k[b].double().repeat_interleave(g, dim=0)
        vb = v[b].double().repeat_interleave(g, dim=0)
        for i0 in range(0, Tq, rows):
            qi = q[b, :, i0:i0 + rows].double()
            s = torch.einsum("hid,hjd->hij", qi, kb) * (qk[b] * scale * LOG2E)[:, None, None]
            if causal:
                i = torch.arange(i0, i0 + qi.shape[1], device=dev)[:, None]
                j = torch.arange(Tk, device=dev)[None, :]
                s = s.masked_fill(j > i + (Tk - Tq), float("-inf"))
            m = torch.ceil(s.amax(dim=-1, keepdim=True))
            m = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # a row that sees nothing
            p = torch.exp2(s - m + P_OFFSET)
            l = p.sum(dim=-1, keepdim=True)
            o = torch.einsum("hij,hjd->hid", quantize_p(p), vb)
            out[b, :, i0:i0 + rows] = torch.where(l > 0, o / l.clamp_min(1e-300), 0.0) * vd[b][:, None, None]
    return out


def attention_unquantized(q, k, v, causal: bool = False, scale=None) -> torch.Tensor:
    """Plain attention in float64 of the unquantized inputs (the format's error is measured against it)."""
    from tritune.references.attention import attention

    return attention(q, k, v, causal=causal, scale=scale)


# ---------------------------------------------------------------------------------------------------
# The FP8 paged KV cache: e4m3 values, one float32 scale per (token, kv head)
def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D): per-row (each token's head) scales. Returns (e4m3 of x's shape, scale float32 (...))."""
    amax = x.double().abs().amax(dim=-1)
    scale = (amax / E4M3_MAX).clamp_min(MIN_SCALE).float()   # the float32 scale stored, and divided by
    q = (x.double() / scale.double()[..., None]).clamp(-E4M3_MAX, E4M3_MAX).float().to(E4M3)
    return q, scale


def v_rows(v_cache):
    """V's cache (num_blocks, Hkv, D, block_size), transposed within each block, as a (num_blocks,
    block_size, Hkv, D) view: row [n, b] is the token at slot n · block_size + b, like K's cache."""
    return v_cache.permute(0, 3, 1, 2)


def fp8_write_kv(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, **_):
    """float64 copies of the four cache tensors with token t of k/v quantized into flat slot
    slot_mapping[t] (negative: skipped). Each token's scale is computed in float64 (amax / 448). V's cache is
    transposed within each block (:func:`v_rows`)."""
    outs = [t.double().clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    bs = k_cache.shape[1]
    rows = (outs[0], v_rows(outs[1]), outs[2], outs[3])   # views: writes land in outs
    for src, (qc, sc) in ((k, (rows[0], rows[2])), (v, (rows[1], rows[3]))):
        amax = src.double().abs().amax(dim=-1)
        scale = (amax / E4M3_MAX).clamp_min(MIN_SCALE)
        q = (src.double() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).double()
        for t, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                qc[slot // bs, slot % bs] = q[t]
                sc[slot // bs, slot % bs] = scale[t]
    return tuple(outs)


def gather(cache, block_table, n: int):
    block_size = cache.shape[1]
    blocks = block_table[: -(-n // block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def fp8_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale=None, **_):
    """One query token per sequence against its e4m3 paged K/V times their per-token scales, in float64:
    (B, Hq, D). v_cache is transposed within each block (:func:`v_rows`)."""
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty(B, Hq, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        kb = gather(k_cache, block_tables[b], n).double() * gather(k_scale, block_tables[b], n).double()[..., None]
        vb = gather(v_rows(v_cache), block_tables[b], n).double() * gather(v_scale, block_tables[b], n).double()[
            ..., None]
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), kb) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), vb)
    return out
