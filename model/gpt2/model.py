"""GPT-2's forward on tritune kernels, with a plain-PyTorch backend to compare it to step by step.

One layer, the residual stream ``x`` (T, E) over the T tokens of the step::

    h = layer_norm(x)                         ln_1
    q, k, v = gemm(h, W_qkv, b_qkv)           one fused c_attn GEMM; q, k, v are views of its output
    a = attention(q, k, v)                    prefill: causal within each packed sequence
                                              decode:  the new token against the paged KV cache
    x = gemm(a, W_o, b_o, residual=x)         residual add fused into the GEMM epilogue
    h = layer_norm(x)                         ln_2
    f = gemm(h, W_fc, b_fc, activation="gelu_tanh")
    x = gemm(f, W_proj, b_proj, residual=x)

then ``logits = gemm(layer_norm(x), wte^T)`` on the rows that need them.

Two entry points, both over *packed* tokens so the continuous-batching engine can call them as they are:
- :meth:`GPT2.prefill`: several whole sequences concatenated (``seq_lens``), each attending causally to
  itself; K/V written to the cache at ``slot_mapping`` when a cache is given.
- :meth:`GPT2.decode`: one new token per sequence; its K/V written at ``slot_mapping``, then paged
  attention over ``block_tables`` / ``context_lens``.
A KV cache is anything with per-layer lists ``k_caches`` / ``v_caches`` of (num_blocks, block_size, H, D)
tensors (:class:`PagedKVCache` here, or the engine's block pool).

Backends: ``"triton"`` runs each step on its tritune kernel (an attention kernel that does not take the
model's head dim leaves that step on PyTorch; :func:`backend_report` says which). ``"torch"`` runs plain
PyTorch ops (F.layer_norm, addmm, F.gelu, F.scaled_dot_product_attention) in the model's dtype: the
float64 ``tritune.references`` are the kernels' judges, far too slow to run a model on.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import replace
from pathlib import Path

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import torch
import torch.nn.functional as F

# DTYPES, BACKENDS, default_device and PagedKVCache are this module's names too (other modules import them here)
from tritune.model.family_base import (BACKENDS, DTYPES, FamilyModel, PagedKVCache,  # noqa: F401
                                       default_device, ops_chooser)
from tritune.model.gpt2 import weights as W
from tritune.model.gpt2.config import GPT2Config


# ---------------------------------------------------------------------------------------------------
# The torch backend: plain PyTorch ops in the model's dtype
# ---------------------------------------------------------------------------------------------------
def torch_layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def torch_linear(x, w, b=None, activation=None, residual=None):
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    if residual is not None:
        y = y + residual.reshape(y.shape)
    return y.reshape(*x.shape[:-1], w.shape[1])


def torch_attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen):
    """q, k, v (T, H, D) packed; causal within each sequence. One SDPA call per sequence."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    s = 0
    for n in seq_lens:
        e = s + n
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                           v[s:e].transpose(0, 1), is_causal=True)
        out[s:e] = o.transpose(0, 1)
        s = e
    return out


def torch_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """k, v (T, H, D) into the flat slots of (num_blocks, block_size, H, D) caches; slot < 0 skips."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    kc[idx] = k[keep]
    vc[idx] = v[keep]


def torch_attn_decode(q, k_cache, v_cache, block_tables, context_lens):
    """q (B, H, D), one query per sequence, over its first context_lens cached tokens (gathered by block)."""
    B, nb = block_tables.shape
    bs = k_cache.shape[1]
    bt = block_tables.long()
    k = k_cache[bt].reshape(B, nb * bs, *k_cache.shape[2:]).transpose(1, 2)   # (B, H, L, D)
    v = v_cache[bt].reshape(B, nb * bs, *v_cache.shape[2:]).transpose(1, 2)
    mask = torch.arange(nb * bs, device=q.device)[None, :] < context_lens[:, None].long()
    o = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :])
    return o[:, :, 0, :]


# ---------------------------------------------------------------------------------------------------
# The triton backend: each step on its kernel
# ---------------------------------------------------------------------------------------------------
class TritonOps:
    """The implementation of each step for the triton backend, chosen once per head dim: an attention
    kernel that does not take the model's head dim leaves that step on PyTorch (and ``steps`` says so)."""

    def __init__(self, head_dim: int | None = None):
        from tritune.kernels import attention, paged_attention
        from tritune.kernels.gemm import gemm
        from tritune.kernels.gemv import gemv
        from tritune.kernels.layer_norm import layer_norm

        self._ln, self._gemm, self._gemv = layer_norm, gemm, gemv
        self.steps: dict[str, str] = {
            "layernorm": "kernel tritune.kernels.layer_norm",
            "linear": "kernel tritune.kernels.gemm (bias, residual fused; fp32 through tf32 on a GPU)",
            "gelu": "fused into the gemm epilogue (activation='gelu_tanh')",
        }

        def takes(module):
            return head_dim is None or head_dim in module.HEAD_DIMS

        self._varlen = attention.attention_varlen if takes(attention) else None
        self.steps["attention prefill"] = (
            "kernel tritune.kernels.attention.attention_varlen" if self._varlen else
            f"reference F.scaled_dot_product_attention (head dim {head_dim} not in the kernel's "
            f"{tuple(attention.HEAD_DIMS)})")
        self.steps["decode linears"] = (
            f"kernel tritune.kernels.gemv at <= {self.GEMV_MAX_M} rows (ln_1 / ln_2 / ln_f and the KV-cache write "
            "fused in)")
        ok = takes(paged_attention)
        self._paged, self._write_kv = (paged_attention.paged_attention, paged_attention.write_kv) if ok else (None, None)
        # the decode step without a host sync (the torch write_kv masks padding slots on the host): a CUDA
        # graph can hold it
        self.capturable = ok
        self.steps["attention decode"] = (
            "kernel tritune.kernels.paged_attention (write_kv + paged_attention)" if ok else
            f"reference: index_put into the cache + SDPA over gathered blocks (head dim {head_dim} not in the "
            f"kernel's {tuple(paged_attention.HEAD_DIMS)})")

    # Rows up to which the linears of a step run on the gemv kernel (decode of a few sequences), with the
    # LayerNorm before them and the KV-cache write after the qkv projection fused in.
    GEMV_MAX_M = 8

    def _gemv_rows(self, x, w) -> bool:
        return (self._gemv is not None and isinstance(w, torch.Tensor)
                and math.prod(x.shape[:-1]) <= self.GEMV_MAX_M)

    # -- steps --------------------------------------------------------------------------------------
    def layer_norm(self, x, w, b, eps):
        return self._ln(x, w, b, eps)

    def ln_linear(self, x, ln_w, ln_b, eps, w, b=None, activation=None, kv=None):
        """linear(layer_norm(x)), and with ``kv`` (k_cache, v_cache, slots) the qkv output's k and v written
        to the cache. Returns (y, whether the cache was written)."""
        if self._gemv_rows(x, w):
            return self._gemv(x, w, b, activation=activation, ln=(ln_w, ln_b, eps), kv=kv), kv is not None
        return self.linear(self.layer_norm(x, ln_w, ln_b, eps), w, b, activation=activation), False

    def linear(self, x, w, b=None, activation=None, residual=None):
        if self._gemv_rows(x, w):
            return self._gemv(x, w, b, activation=activation, residual=residual)
        return self._gemm(x, w, b, activation=activation, residual=residual)

    def attn_prefill(self, q, k, v, seq_lens, cu_seqlens, max_seqlen):
        if self._varlen:
            # cu_seqlens and max_seqlen are built from seq_lens by the caller (prefill, the runner's step):
            # consistent by construction, so the launcher's value check (a host read per layer) is skipped
            return self._varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True,
                                validate=False)
        return torch_attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        if self._write_kv:
            # validate=False: the slots come from our own block tables, and validation syncs with the host
            return self._write_kv(k, v, k_cache, v_cache, slot_mapping, validate=False)
        return torch_write_kv(k, v, k_cache, v_cache, slot_mapping)

    def attn_decode(self, q, k_cache, v_cache, block_tables, context_lens):
        if self._paged:
            cfg = serving_paged_config(q.shape[0], q.shape[1], k_cache.shape[2], q.shape[2],
                                       block_tables.shape[1] * k_cache.shape[1], k_cache.shape[1], q.dtype)
            return self._paged(q, k_cache, v_cache, block_tables, context_lens, validate=False, config=cfg)
        return torch_attn_decode(q, k_cache, v_cache, block_tables, context_lens)


# Split-KV chunk (tokens) the engine's decode attention keeps at most. The tuned store's paged-attention
# entries are timed with every sequence at one length, where many sequences need no split; a step's rows
# differ (a 2k-token prompt's chunk rows, or its decodes, among short ones), and unsplit, the longest row's
# program is the kernel's time: H100, GPT-2 small, 32 decodes at ~300 tokens and one row at 2048, the step's
# GPU time went from 0.49 to 1.3 ms with the B=64 entry's PARTITION=0.
# TRITUNE_SERVING_PARTITION=0 leaves the store's choice alone (to measure what the cap buys).
SERVING_PARTITION = int(os.environ.get("TRITUNE_SERVING_PARTITION", "256"))


@functools.lru_cache(maxsize=None)
def serving_paged_config(B, Hq, Hkv, D, capacity, block_size, dtype) -> dict | None:
    """The tuned (or default) paged-attention config for this shape, its KV partition capped at
    SERVING_PARTITION tokens; None (the launcher's own choice) when the cap does not apply or is invalid."""
    from tritune.kernels import paged_attention as PA

    if not SERVING_PARTITION or capacity <= SERVING_PARTITION:
        return None
    problem = PA.Problem(B, Hq, Hkv, D, capacity, block_size, mixed=True)
    cfg = PA.SPEC.config_for(problem, dtype, None)
    if 0 < cfg["PARTITION"] <= SERVING_PARTITION:
        return None
    return PA.with_partition(cfg, SERVING_PARTITION, problem, dtype)


def ln_linear(ops, x, ln_w, ln_b, eps, w, b=None, activation=None, kv=None):
    """``ops.ln_linear`` where the ops have one (a fused LayerNorm + linear, maybe writing the KV cache),
    else layer_norm then linear. Returns (y, whether the KV cache was written)."""
    fused = getattr(ops, "ln_linear", None)
    if fused is not None:
        return fused(x, ln_w, ln_b, eps, w, b, activation=activation, kv=kv)
    return ops.linear(ops.layer_norm(x, ln_w, ln_b, eps), w, b, activation=activation), False


class TorchOps:
    capturable = False      # write_kv masks padding slots on the host
    quant_kernel = False    # quantized linears: dequantize + matmul (the reference), not the kernel
    steps = {s: "plain PyTorch in the model dtype" for s in
             ("layernorm", "linear", "gelu", "attention prefill", "attention decode")}
    layer_norm = staticmethod(torch_layer_norm)
    linear = staticmethod(torch_linear)
    attn_prefill = staticmethod(torch_attn_prefill)
    write_kv = staticmethod(torch_write_kv)
    attn_decode = staticmethod(torch_attn_decode)


ops_for = ops_chooser(TritonOps, TorchOps)


def _report(title: str, steps: dict) -> str:
    width = max(map(len, steps))
    lines = [title]
    lines += [f"  {k:<{width}}  {v}" for k, v in steps.items()]
    lines.append(f"  {'embedding':<{width}}  torch indexing (wte[ids] + wpe[pos]; no kernel)")
    return "\n".join(lines)


def backend_report(head_dim: int = 64) -> str:
    """Which implementation each step of the triton backend runs (for ``tritune info``): kernel or
    reference, and why not the kernel. ``head_dim`` 64 is every released GPT-2's."""
    return _report(f"GPT-2 triton backend (tritune.model.gpt2.model), head dim {head_dim}:",
                   ops_for("triton", head_dim).steps)


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------
class GPT2(FamilyModel):
    """GPT-2's layer stack (the module docstring says what a layer computes); the entry points, loading and
    the sizes every family shares are :class:`~tritune.model.family_base.FamilyModel`'s."""

    ops_for = staticmethod(ops_for)
    load_weights = staticmethod(W.load)
    cache_type = PagedKVCache

    def __init__(self, config: GPT2Config, weights: W.GPT2Weights, *, backend: str = "triton",
                 directory: Path | None = None, ops=None):
        head = weights.lm_head
        if isinstance(head, torch.Tensor) and head.dim() == 2 and head.is_contiguous() and head.shape[1] > 1:
            # The LM head as the (E, V) transpose of a (V, E) tensor (K contiguous; the tied wte itself, or a
            # copy in that layout), not the N-contiguous (E, V) copy: with V = 50257 the copy's rows lie 100514
            # bytes apart, not 16-byte aligned, and the gemm streamed it at 66 GB/s (1171 us at M=1 in the
            # decode graph on the H100, 76% of the step); the transposed view is the LM-head problem the gemm
            # is tuned and benchmarked on (trans_b=True, 40.5 us at M=1).
            tied = weights.wte.shape == head.shape[::-1] and torch.equal(weights.wte, head.t())
            weights = replace(weights, lm_head=weights.wte.t() if tied else head.t().contiguous().t())
        super().__init__(config, weights, backend=backend, directory=directory, ops=ops)

    # -- the engine's contract: the sizes GPT-2 has its own way ---------------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.config.n_head           # no grouped-query attention in GPT-2

    @property
    def max_context(self) -> int:
        return self.config.n_positions

    def backend_report(self) -> str:
        """Which implementation each step of this model runs (kernel or reference, and why)."""
        return _report(f"GPT-2 {self.backend} backend, head dim {self.config.head_dim}, {self.dtype}:",
                       self.ops.steps)

    # -- the shared layer stack ---------------------------------------------------------------------
    def embed(self, input_ids, positions):
        return self.w.wte[input_ids] + self.w.wpe[positions]

    def blocks(self, x, attend, kv_for=None, positions=None):
        """The layer stack. ``attend(i, q, k, v, written)`` writes layer i's k, v to the cache unless
        ``written`` and returns the attention output; ``kv_for(i)`` (k_cache, v_cache, slots), when given,
        lets the qkv projection write the cache itself where the ops fuse that. ``positions`` is not read
        (GPT-2's positions are learned, added by :meth:`embed`)."""
        c, ops = self.config, self.ops
        T, H, D = x.shape[0], c.n_head, c.head_dim
        eps = c.layer_norm_epsilon
        for i, L in enumerate(self.w.layers):
            qkv, written = ln_linear(ops, x, L.ln1_w, L.ln1_b, eps, L.w_qkv, L.b_qkv,
                                     kv=kv_for(i) if kv_for is not None else None)
            qkv = qkv.view(T, 3, H, D)
            a = attend(i, qkv[:, 0], qkv[:, 1], qkv[:, 2], written)
            x = ops.linear(a.reshape(T, H * D), L.w_o, L.b_o, residual=x)
            f, _ = ln_linear(ops, x, L.ln2_w, L.ln2_b, eps, L.w_fc, L.b_fc, activation="gelu_tanh")
            x = ops.linear(f, L.w_proj, L.b_proj, residual=x)
        return x

    def logits(self, x):
        c = self.config
        return ln_linear(self.ops, x, self.w.lnf_w, self.w.lnf_b, c.layer_norm_epsilon, self.w.lm_head)[0]
