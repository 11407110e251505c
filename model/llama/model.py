"""The Llama-family forward (Llama, Qwen2, Qwen3, Mistral) on tritune kernels, with the same entry points,
cache layout and backends as :class:`~tritune.model.gpt2.model.GPT2`, so the engine runs either.

One layer, the residual stream ``x`` (T, E) over the T tokens of the step::

    h = rms_norm(x)                           input_layernorm
    q, k, v = gemm(h, W_qkv, b_qkv)           one fused projection; q (T, Hq, D), k, v (T, Hkv, D) its views
    q, k = rms_norm(q), rms_norm(k)           Qwen3 only: per head
    q, k = rotary(q, k, cos, sin, positions)  in place on the projection's output (triton backend)
    a = attention(q, k, v)                    grouped-query: Hkv <= Hq, one KV head per group of Hq / Hkv
    x = gemm(a, W_o, b_o, residual=x)         residual add fused into the GEMM epilogue
    h = rms_norm(x)                           post_attention_layernorm
    f = gemm(h, W_gu, b_gu, activation="swiglu")   gate and up as one (E, 2F) [gate | up] projection,
                                              silu(g) * u in its epilogue
    x = gemm(f, W_down, residual=x)

then ``logits = gemm(rms_norm(x), lm_head)``. Each RMSNorm and the linear after it go through
:func:`rms_linear`: on the triton backend, at <= ``GEMV_MAX_M`` rows (decode) the norm runs in the gemv's
prologue (``rms=``), as GPT-2's LayerNorms do (``ln=``); on more rows the rms_norm kernel, then the gemm.
The rotary tables (cos, sin per position, every rope scaling type worked into them:
:mod:`tritune.model.llama.rope`) are built once, at load.

Backends: ``"triton"`` runs RMSNorm and rotary on their tritune kernels and the rest as GPT-2's triton ops do
(gemm / gemv, varlen and paged attention, which take Hkv < Hq); ``"torch"`` runs plain PyTorch in the
model's dtype, RMSNorm and rotary written as transformers computes them (the float64 references in
``tritune.references`` judge the kernels; they are far too slow to run a model on).
"""
from __future__ import annotations

from pathlib import Path

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import torch
import torch.nn.functional as F

# DTYPES and BACKENDS are this module's names too
from tritune.model import family_base
from tritune.model.family_base import BACKENDS, DTYPES, FamilyModel, ops_chooser  # noqa: F401
from tritune.model.gpt2 import model as G
from tritune.model.llama import rope
from tritune.model.llama import weights as W
from tritune.model.llama.config import LlamaConfig


# ---------------------------------------------------------------------------------------------------
# The torch backend
# ---------------------------------------------------------------------------------------------------
def torch_rms_norm(x, w, eps):
    """transformers' LlamaRMSNorm: statistics and scaling in float32, rounded to x's dtype, then times w."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h.to(x.dtype)
    return h if w is None else w * h


def torch_rotary(q, k, cos, sin, positions):
    """(q, k) rotated (neox layout, the first 2 * cos.shape[1] dims), as new tensors."""
    half = cos.shape[1]
    c = cos[positions.long()][:, None, :].to(q.dtype)
    s = sin[positions.long()][:, None, :].to(q.dtype)

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:2 * half]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]), dim=-1)

    return rot(q), rot(k)


def _repeat_kv(t, n: int, dim: int):
    return t if n == 1 else t.repeat_interleave(n, dim=dim)


def torch_attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen, window=None):
    """q (T, Hq, D), k, v (T, Hkv, D) packed; causal within each sequence; query head h reads KV head
    h // (Hq / Hkv). ``window`` W: query i sees keys i − W < j <= i only (SDPA with that mask)."""
    n = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, n, 1), _repeat_kv(v, n, 1)
    if window is None:
        return G.torch_attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    s = 0
    for m in seq_lens:
        i = torch.arange(m, device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        o = F.scaled_dot_product_attention(q[s:s + m].transpose(0, 1), k[s:s + m].transpose(0, 1),
                                           v[s:s + m].transpose(0, 1), attn_mask=mask)
        out[s:s + m] = o.transpose(0, 1)
        s += m
    return out


def torch_attn_decode(q, k_cache, v_cache, block_tables, context_lens, window=None):
    """q (B, Hq, D) over paged (num_blocks, block_size, Hkv, D) caches; ``window`` W: the last W tokens only."""
    n = q.shape[1] // k_cache.shape[2]
    k_cache, v_cache = _repeat_kv(k_cache, n, 2), _repeat_kv(v_cache, n, 2)
    if window is None:
        return G.torch_attn_decode(q, k_cache, v_cache, block_tables, context_lens)
    B, nb = block_tables.shape
    bs = k_cache.shape[1]
    k = k_cache[block_tables.long()].reshape(B, nb * bs, *k_cache.shape[2:]).transpose(1, 2)   # (B, H, L, D)
    v = v_cache[block_tables.long()].reshape(B, nb * bs, *v_cache.shape[2:]).transpose(1, 2)
    pos, ctx = torch.arange(nb * bs, device=q.device)[None, :], context_lens[:, None].long()
    mask = (pos < ctx) & (pos >= ctx - window)
    return F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :])[:, :, 0, :]


def swiglu(gu):
    """silu(gate) * up of a [gate | up] projection output (..., 2F)."""
    f = gu.shape[-1] // 2
    return F.silu(gu[..., :f]) * gu[..., f:]


def rms_linear(ops, x, norm_w, eps, w, b=None, activation=None):
    """linear(rms_norm(x)), with ``activation`` None or "swiglu" (``w`` the [gate | up] weight): the ops' own
    fused ``rms_linear`` where their class defines one, else the steps one by one. An ops wrapper that
    forwards what it lacks to its base (``__getattr__``: tensor parallel, fp8) takes the steps, so its own
    ``linear`` (a collective, a quantized product) is never skipped."""
    if hasattr(type(ops), "rms_linear"):
        return ops.rms_linear(x, norm_w, eps, w, b, activation=activation)
    y = ops.linear(ops.rms_norm(x, norm_w, eps), w, b)
    return ops.swiglu(y) if activation == "swiglu" else y


def rms_mlp(ops, x, norm_w, eps, w_gu, b_gu, w_down, b_down):
    """x + down(swiglu(gate_up(rms_norm(x)))): the ops' own fused ``rms_mlp`` where their class defines one
    (fp8: the SwiGLU fused into the down projection's activation quantization), else :func:`rms_linear`
    with the SwiGLU and then the down projection with the residual."""
    if hasattr(type(ops), "rms_mlp"):
        return ops.rms_mlp(x, norm_w, eps, w_gu, b_gu, w_down, b_down)
    f = rms_linear(ops, x, norm_w, eps, w_gu, b_gu, activation="swiglu")
    return ops.linear(f, w_down, b_down, residual=x)


class TorchOps:
    capturable = False      # write_kv masks padding slots on the host
    quant_kernel = False    # quantized linears: dequantize + matmul (the reference), not the kernel
    steps = {s: "plain PyTorch in the model dtype" for s in
             ("rmsnorm", "rotary", "linear", "swiglu", "attention prefill", "attention decode")}
    rms_norm = staticmethod(torch_rms_norm)
    rotary = staticmethod(torch_rotary)
    linear = staticmethod(G.torch_linear)
    swiglu = staticmethod(swiglu)
    attn_prefill = staticmethod(torch_attn_prefill)
    write_kv = staticmethod(G.torch_write_kv)
    attn_decode = staticmethod(torch_attn_decode)


# ---------------------------------------------------------------------------------------------------
# The triton backend: GPT-2's ops (linears, attention, the KV write) plus RMSNorm and rotary kernels
# ---------------------------------------------------------------------------------------------------
class TritonOps(G.TritonOps):
    def __init__(self, head_dim: int | None = None):
        super().__init__(head_dim)
        from tritune.kernels.rms_norm import rms_norm
        from tritune.kernels.rotary import rotary

        self._rms, self._rotary = rms_norm, rotary
        for gone in ("layernorm", "gelu"):
            self.steps.pop(gone, None)
        self.steps["decode linears"] = (f"kernel tritune.kernels.gemv at <= {self.GEMV_MAX_M} rows (the RMSNorms "
                                        "before qkv, gate/up and the LM head fused in: rms=)")
        self.steps.update({
            "rmsnorm": "kernel tritune.kernels.rms_norm (in decode steps: the gemv's prologue)",
            "rotary": "kernel tritune.kernels.rotary (in place on the qkv projection's output; in decode steps "
                      "the KV-cache write fused in)",
            "swiglu": "fused into the gate/up gemm / gemv epilogue (activation='swiglu')",
        })

    def rms_norm(self, x, w, eps):
        return self._rms(x, w, eps)

    def rms_linear(self, x, norm_w, eps, w, b=None, activation=None):
        """linear(rms_norm(x)) (see :func:`rms_linear`): at <= GEMV_MAX_M rows one gemv with the RMSNorm in
        its prologue, else the rms_norm kernel and the gemm; SwiGLU in the epilogue of either."""
        if self._gemv_rows(x, w):
            return self._gemv(x, w, b, activation=activation, rms=(norm_w, eps))
        return self.linear(self.rms_norm(x, norm_w, eps), w, b, activation=activation)

    def rotary(self, q, k, cos, sin, positions):
        # validate=False: positions come from the engine's own bookkeeping (checking them syncs the host)
        return self._rotary(q, k, cos, sin, positions, out=(q, k), validate=False)

    # Without the kernel (a head dim it does not take), this family's torch functions: GPT-2's have no KV groups.
    def attn_prefill(self, q, k, v, seq_lens, cu_seqlens, max_seqlen, window=None):
        if not self._varlen:
            return torch_attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen, window)
        if window is None:
            return super().attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen)
        # tiles wholly before every row's window are skipped
        return self._varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True, validate=False,
                            window=window)

    def attn_decode(self, q, k_cache, v_cache, block_tables, context_lens, window=None):
        if not self._paged:
            return torch_attn_decode(q, k_cache, v_cache, block_tables, context_lens, window)
        if window is None:
            return super().attn_decode(q, k_cache, v_cache, block_tables, context_lens)
        # the window's blocks only; the config chosen for the window's span
        return self._paged(q, k_cache, v_cache, block_tables, context_lens, validate=False, window=window)

    def rotary_kv(self, q, k, v, cos, sin, positions, kv):
        """:meth:`rotary` that also writes the rotated k and v to the paged caches ``kv`` = (k_cache, v_cache,
        slots): the step's KV-cache write fused into the rotation (one launch and one read of k, v fewer)."""
        kc, vc, slots = kv
        return self._rotary(q, k, cos, sin, positions, out=(q, k), kv=(kc, vc, slots, v), validate=False)

    swiglu = staticmethod(swiglu)


ops_for = ops_chooser(TritonOps, TorchOps)


class PagedKVCache(family_base.PagedKVCache):
    """The single-request paged cache with the model's KV heads (num_key_value_heads)."""

    @staticmethod
    def kv_heads(config: LlamaConfig) -> int:
        return config.n_kv_head


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------
class Llama(FamilyModel):
    """The Llama family's layer stack (the module docstring says what a layer computes); the entry points,
    loading and the sizes every family shares are :class:`~tritune.model.family_base.FamilyModel`'s."""

    ops_for = staticmethod(ops_for)
    load_weights = staticmethod(W.load)
    cache_type = PagedKVCache

    def __init__(self, config: LlamaConfig, weights: W.LlamaWeights, *, backend: str = "triton",
                 directory: Path | None = None, ops=None):
        super().__init__(config, weights, backend=backend, directory=directory, ops=ops)
        self.cos, self.sin = rope.tables(config, device=self.device)
        self.positions = None     # the positions of the tokens embed() saw last (see blocks)
        self.windows = config.layer_windows or (None,) * config.n_layer   # each layer's sliding window

    # -- the engine's contract: the sizes this family has its own way ----------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.config.n_kv_head

    @property
    def max_context(self) -> int:
        # The engine's attention callbacks pass no window yet: within the smallest window full attention is
        # the same, so the engine runs sequences up to it (prefill/decode here take the whole n_positions).
        return min([self.config.n_positions] + [w for w in self.windows if w is not None])

    @property
    def eos_token_ids(self) -> tuple:
        """Every id that ends a request (config.json's and generation_config.json's ``eos_token_id``)."""
        return self.config.eos_token_ids

    def compiled_decode(self, kv, write_kv):
        """The engine's ``compile=True`` decode over the paged cache ``kv`` (torch backend: the layer and head
        under torch.compile; ``write_kv`` the eager cache write), or None where this backend has none."""
        if self.backend != "torch":
            return None
        from tritune.model.llama.compiled import CompiledDecode

        return CompiledDecode(self, kv, write_kv, TorchOps)

    def backend_report(self) -> str:
        c = self.config
        steps = dict(self.ops.steps)
        steps["embedding"] = "torch indexing (embed_tokens[ids]; no kernel)"
        width = max(map(len, steps))
        lines = [f"{c.model_type} {self.backend} backend, head dim {c.head_dim}, {c.n_head} query / "
                 f"{c.n_kv_head} KV heads, {self.dtype}:"]
        return "\n".join(lines + [f"  {k:<{width}}  {v}" for k, v in steps.items()])

    # -- the shared layer stack ---------------------------------------------------------------------
    def embed(self, input_ids, positions):
        """The token embeddings; ``positions`` are kept for the rotary step of the next :meth:`blocks`
        call that is given none (the engine's forward calls ``blocks(embed(ids, positions), ...)``)."""
        self.positions = positions
        return self.w.wte[input_ids]

    def blocks(self, x, attend, kv_for=None, positions=None):
        """The layer stack. ``attend(i, q, k, v, written)`` writes layer i's k, v to the cache unless
        ``written`` and returns the attention output; ``kv_for(i)`` (k_cache, v_cache, slots), when given,
        lets the rotary step write the cache itself where the ops fuse that (``rotary_kv``). ``positions``
        (T,): each token's position (default: those :meth:`embed` saw last)."""
        c, ops = self.config, self.ops
        pos = self.positions if positions is None else positions
        if pos is None:
            raise ValueError("positions: required (blocks() before any embed() call)")
        T, D, Hq, Hk = x.shape[0], c.head_dim, c.n_head, c.n_kv_head
        eps = c.rms_norm_eps
        fused_kv = getattr(ops, "rotary_kv", None) if kv_for is not None else None
        for i, L in enumerate(self.w.layers):
            qkv = rms_linear(ops, x, L.ln1_w, eps, L.w_qkv, L.b_qkv)
            q = qkv[:, :Hq * D].view(T, Hq, D)
            k = qkv[:, Hq * D:(Hq + Hk) * D].view(T, Hk, D)
            v = qkv[:, (Hq + Hk) * D:].view(T, Hk, D)
            if L.q_norm is not None:
                q, k = ops.rms_norm(q, L.q_norm, eps), ops.rms_norm(k, L.k_norm, eps)
            if fused_kv is not None:
                q, k = fused_kv(q, k, v, self.cos, self.sin, pos, kv_for(i))
            else:
                q, k = ops.rotary(q, k, self.cos, self.sin, pos)
            a = attend(i, q, k, v, fused_kv is not None)
            x = ops.linear(a.reshape(T, Hq * D), L.w_o, L.b_o, residual=x)
            x = rms_mlp(ops, x, L.ln2_w, eps, L.w_gu, L.b_gu, L.w_down, L.b_down)
        return x

    def logits(self, x):
        return rms_linear(self.ops, x, self.w.lnf_w, self.config.rms_norm_eps, self.w.lm_head)

    # -- the hooks of the shared entry points ----------------------------------------------------------
    def window_kw(self, i: int) -> dict:
        """The attention ops' keyword for layer i's sliding window (none for a full layer: ops that take no
        window still run the model's full layers)."""
        return {} if self.windows[i] is None else {"window": self.windows[i]}

    def decode_positions(self, positions, context_lens, batch: int):
        """``positions`` (B,); None: each row's context length minus one (a paged decode row attends to every
        token up to its own, so its position is that), as the device-side decode step, which passes none,
        needs."""
        return context_lens.reshape(batch) - 1 if positions is None else positions.reshape(batch)


def load_model(model, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None) -> Llama:
    """A Llama / Qwen2 / Qwen3 / Mistral checkpoint (directory or hub id) as a :class:`Llama`."""
    return Llama.from_pretrained(model, backend=backend, dtype=dtype, device=device)
