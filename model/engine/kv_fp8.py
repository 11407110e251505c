"""The FP8 paged KV cache (``kv_cache_dtype="fp8"``): K and V in e4m3 with one float32 scale per (token,
kv head), half the bytes of a bf16 cache (plus 4 bytes per head_dim values of scale).

The pool holds, beside its e4m3 ``k_caches`` (num_blocks, block_size, n_kv_heads, head_dim) and ``v_caches``
(num_blocks, n_kv_heads, head_dim, block_size) (V transposed within each block, tokens contiguous: the
decode's P·V operand loads as it lies; :mod:`tritune.kernels.fp8_paged_attention`), per-layer ``k_scales`` /
``v_scales`` of shape (num_blocks, block_size, n_kv_heads): k ≈ k_cache · k_scale[..., None]. The attention
callback the engine
hands the model calls ``ops.write_kv`` / ``ops.attn_decode`` with a layer's caches only, so the ops here
find the layer's scales by the cache tensor they are given (its data pointer), and the engine's code stays
as it is:

- ``write_kv``: each new token's rows quantized with their own amax (kernel ``fp8_kv_write``; the torch
  backend the same math in PyTorch).
- ``attn_decode``: kernel ``fp8_paged_attention`` (K/V widened and scaled per token inside it); where the
  kernel does not apply (the torch backend, fp32 queries, a sliding window) the sequences' blocks are
  gathered, dequantized to the query's dtype, and the base decode runs on them.
- ``attn_prefill``: the base's, on the bf16 K/V the step just computed (what the cache holds is their
  rounding; a prefill of the same prompt through the dense cache gives the same first token).
- ``gather_kv``: dequantized rows of the cache at flat slots, for prefills that continue cached sequences
  (prefix-cache hits, chunks), which attend to cached blocks.
- The fused KV writes of the dense path (gemv's ``kv=``, Llama's ``rotary_kv``) are turned off: they store
  the projection's bf16 output as it is.
"""
from __future__ import annotations

import torch

from tritune.references import fp8 as ref

E4M3 = torch.float8_e4m3fn
Q_DTYPES = (torch.float16, torch.bfloat16)


def alloc(n_layer: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, device):
    """(cache (2, L, blocks, block_size, H, D) e4m3, scales (2, L, blocks, block_size, H) float32), zeroed:
    an unwritten slot dequantizes to 0. ``cache[1]`` holds V's blocks transposed: see :func:`layer_caches`."""
    cache = torch.zeros(2, n_layer, num_blocks, block_size, n_kv_heads, head_dim, dtype=E4M3, device=device)
    return cache, alloc_scales(n_layer, num_blocks, block_size, n_kv_heads, device)


def alloc_scales(n_layer: int, num_blocks: int, block_size: int, n_kv_heads: int, device):
    """Zeroed float32 scales (2, L, blocks, block_size, H), stored head-major within each block (strides
    (.., H·block_size, 1, block_size)): a kv head's block_size scales are one contiguous run, so the decode
    reads a tile's scales in whole sectors (token-major, each 4-byte scale sat in a sector of its own: 15% of
    the FP8 decode's L2 sectors at B=64, docs/findings.md). The kernels take any strides."""
    return torch.zeros(2, n_layer, num_blocks, n_kv_heads, block_size, dtype=torch.float32,
                       device=device).transpose(-1, -2)


def layer_caches(cache):
    """Per-layer (k_caches, v_caches) of an :func:`alloc` pool: K (num_blocks, block_size, H, D), V a view of
    the same bytes as (num_blocks, H, D, block_size), transposed within each block."""
    L, nb, bs, H, D = cache.shape[1:]
    return list(cache[0].unbind(0)), list(cache[1].view(L, nb, H, D, bs).unbind(0))


def v_rows(v_cache):
    """V's transposed blocks (num_blocks, H, D, block_size) as a (num_blocks, block_size, H, D) view."""
    return v_cache.permute(0, 3, 1, 2)


def bytes_per_block(n_layer: int, n_kv_heads: int, head_dim: int, block_size: int) -> int:
    return 2 * n_layer * block_size * n_kv_heads * (head_dim + 4)


def quantize_rows(x: torch.Tensor):
    """(T, H, D) -> (e4m3 (T, H, D), float32 scales (T, H)): ``fp8_kv_write``'s math in PyTorch."""
    scale = (x.float().abs().amax(dim=-1) / ref.E4M3_MAX).clamp_min(ref.MIN_SCALE)
    return (x.float() / scale[..., None]).clamp(-ref.E4M3_MAX, ref.E4M3_MAX).to(E4M3), scale


class Fp8KVOps:
    """``base`` ops over an FP8 paged cache whose per-layer scales are ``k_scales`` / ``v_scales`` (lists
    beside the pool's ``k_caches`` / ``v_caches``)."""

    rotary_kv = None    # Llama's fused rotary + cache write stores bf16: off

    def __init__(self, base, backend: str, k_caches, v_caches, k_scales, v_scales):
        self.base, self.backend = base, backend
        self._scales = {kc.data_ptr(): (ks, vs) for kc, ks, vs in zip(k_caches, k_scales, v_scales)}
        self.steps = dict(getattr(base, "steps", {}))
        self.quant = getattr(base, "quant", None)
        self._write = self._decode = None
        if backend == "triton":
            from tritune.kernels.fp8_kv_write import fp8_write_kv
            from tritune.kernels.fp8_paged_attention import HEAD_DIMS, fp8_paged_attention

            self._write, self._decode, self._head_dims = fp8_write_kv, fp8_paged_attention, HEAD_DIMS
            self.steps["attention decode"] = ("fp8 KV cache: kernels tritune.kernels.fp8_kv_write (per-token e4m3) "
                                              "+ tritune.kernels.fp8_paged_attention")
        else:
            self.steps["attention decode"] = "fp8 KV cache: per-token e4m3 in PyTorch, decode on dequantized blocks"
        # the decode step never syncs with the host where both kernels run it (validate=False)
        kernels = self._write is not None and all(kc.shape[-1] in self._head_dims for kc in k_caches)
        self.capturable = kernels and getattr(base, "capturable", False)

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def scales_of(self, k_cache):
        s = self._scales.get(k_cache.data_ptr())
        if s is None:
            raise ValueError("k_cache: not a layer of the FP8 pool these ops were made for")
        return s

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        ks, vs = self.scales_of(k_cache)
        if self._write is not None and k.shape[-1] in self._head_dims:
            self._write(k, v, slot_mapping, k_cache, v_cache, ks, vs, validate=False)
            return
        keep = slot_mapping >= 0
        idx = slot_mapping[keep].long()
        bs = k_cache.shape[1]
        for x, cache, scale in ((k, k_cache, ks), (v, v_rows(v_cache), vs)):
            q, s = quantize_rows(x[keep])
            cache.view(torch.uint8)[idx // bs, idx % bs] = q.view(torch.uint8)
            scale[idx // bs, idx % bs] = s   # (any layout: the pool's scales are head-major views)

    def gather_kv(self, k_cache, v_cache, idx, dtype):
        """K and V (len(idx), H, D) in ``dtype`` at flat slots ``idx``, dequantized."""
        ks, vs = self.scales_of(k_cache)
        out = []
        bs = k_cache.shape[1]
        for cache, scale in ((k_cache, ks), (v_rows(v_cache), vs)):
            q = cache[idx // bs, idx % bs]
            s = scale[idx // bs, idx % bs]
            out.append((q.float() * s[..., None]).to(dtype))
        return out[0], out[1]

    def attn_decode(self, q, k_cache, v_cache, block_tables, context_lens, **kw):
        ks, vs = self.scales_of(k_cache)
        if (self._decode is not None and not kw.get("window") and q.dtype in Q_DTYPES
                and q.shape[-1] in self._head_dims):
            return self._decode(q, k_cache, v_cache, ks, vs, block_tables, context_lens, validate=False)
        # the sequences' blocks dequantized, as a cache of their own addressed by arange tables
        B, nb = block_tables.shape
        bt = block_tables.long()
        kd = (k_cache[bt].float() * ks[bt][..., None]).to(q.dtype).reshape(B * nb, *k_cache.shape[1:])
        vd = (v_rows(v_cache[bt].flatten(0, 1)).float() * vs[bt].flatten(0, 1)[..., None]).to(q.dtype).contiguous()
        tables = torch.arange(B * nb, dtype=block_tables.dtype, device=q.device).view(B, nb)
        return self.base.attn_decode(q, kd, vd, tables, context_lens, **kw)

    def ln_linear(self, x, ln_w, ln_b, eps, w, b=None, activation=None, kv=None):
        """The base's LayerNorm + linear without its fused cache write (it would store bf16)."""
        fused = getattr(self.base, "ln_linear", None)
        if fused is not None:
            return fused(x, ln_w, ln_b, eps, w, b, activation=activation, kv=None)
        return self.base.linear(self.base.layer_norm(x, ln_w, ln_b, eps), w, b, activation=activation), False


    def rms_linear(self, x, norm_w, eps, w, b=None, activation=None):
        """The base's fused RMSNorm + linear where it has one (the Llama family's hook), else the steps."""
        if hasattr(type(self.base), "rms_linear"):
            return self.base.rms_linear(x, norm_w, eps, w, b, activation=activation)
        y = self.base.linear(self.base.rms_norm(x, norm_w, eps), w, b)
        return self.base.swiglu(y) if activation == "swiglu" else y


def is_fp8_kv(ops) -> bool:
    return isinstance(ops, Fp8KVOps)


class Fp8PagedCache:
    """An FP8 cache for one or a few sequences outside the engine (``model.prefill`` / ``model.decode`` take
    it like the dense ``PagedKVCache``); ``ops`` are the model's ops over it."""

    def __init__(self, model, num_tokens: int, block_size: int = 16):
        self.block_size = block_size
        self.num_blocks = max(1, -(-num_tokens // block_size))
        self.cache, self.scales = alloc(model.n_layers, self.num_blocks, block_size, model.n_kv_heads,
                                        model.head_dim, model.device)
        self.k_caches, self.v_caches = layer_caches(self.cache)
        self.k_scales, self.v_scales = list(self.scales[0].unbind(0)), list(self.scales[1].unbind(0))
        self.ops = Fp8KVOps(model.ops, model.backend, self.k_caches, self.v_caches, self.k_scales, self.v_scales)

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size


def with_fp8_cache(model, num_tokens: int, block_size: int = 16):
    """(the model on ops over a fresh FP8 cache, that cache)."""
    cache = Fp8PagedCache(model, num_tokens, block_size)
    return model.with_ops(cache.ops), cache


class Fp8KVPrefillOps:
    """``base`` ops whose prefill attention reads K and V as the FP8 cache would hold them (each row
    quantized per (token, kv head) and dequantized): what every later decode step attends to, so the
    next-token loss of a prefill measures the cache's effect (``tritune eval``'s KV rows)."""

    def __init__(self, base):
        self.base = base
        self.steps = dict(getattr(base, "steps", {}))
        self.steps["attention prefill"] = "K/V rounded as the fp8 cache holds them (per-token e4m3), then " + \
            self.steps.get("attention prefill", "the base's prefill")

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def attn_prefill(self, q, k, v, *args, **kw):
        def rounded(x):
            q8, s = quantize_rows(x)
            return (q8.float() * s[..., None]).to(x.dtype)

        return self.base.attn_prefill(q, rounded(k), rounded(v), *args, **kw)
