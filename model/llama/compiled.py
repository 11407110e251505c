"""The Llama family's decode forward under ``torch.compile`` (the engine's ``compile=True``, torch backend).

As GPT-2's compiled decode (:class:`tritune.model.engine.runner.CompiledDecode`): the layer in two pieces
that take tensors only, so one compile serves every layer (regional compilation), the K/V-cache write
between them kept eager (an in-place write into a compiled graph's input), and the head a third piece.
Positions come in as a tensor and index the rotary tables inside the piece.
"""
from __future__ import annotations

import torch

from tritune.model.gpt2 import model as G


def pieces(ops):
    """(layer_in, layer_out, head) on ``ops``' PyTorch steps (the family's TorchOps: rms_norm, rotary, swiglu,
    attn_decode), uncompiled."""
    rms, rot, act, attn = ops.rms_norm, ops.rotary, ops.swiglu, ops.attn_decode

    def layer_in(x, ln_w, w_qkv, b_qkv, q_norm, k_norm, cos, sin, pos, eps: float, Hq: int, Hk: int, D: int):
        T = x.shape[0]
        qkv = G.torch_linear(rms(x, ln_w, eps), w_qkv, b_qkv)
        q = qkv[:, :Hq * D].reshape(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hk) * D].reshape(T, Hk, D)
        v = qkv[:, (Hq + Hk) * D:].reshape(T, Hk, D)
        if q_norm is not None:
            q, k = rms(q, q_norm, eps), rms(k, k_norm, eps)
        q, k = rot(q, k, cos, sin, pos)
        return q, k, v

    def layer_out(x, q, k_cache, v_cache, block_tables, context_lens, w_o, b_o, ln_w, w_gu, b_gu, w_down, b_down,
                  eps: float):
        T = x.shape[0]
        a = attn(q, k_cache, v_cache, block_tables, context_lens)
        x = G.torch_linear(a.reshape(T, -1), w_o, b_o, residual=x)
        f = act(G.torch_linear(rms(x, ln_w, eps), w_gu, b_gu))
        return G.torch_linear(f, w_down, b_down, residual=x)

    def head(x, ln_w, lm_head, eps: float):
        return G.torch_linear(rms(x, ln_w, eps), lm_head)

    return layer_in, layer_out, head


class CompiledDecode:
    """``logits = step(ids, positions, slots, block_tables, context_lens)``: the model's decode with its
    layer and head compiled (dynamic shapes); ``write_kv(k, v, k_cache, v_cache, slots)`` the eager cache
    write between the pieces. No sliding window: the engine runs sequences up to the smallest window
    (``Llama.max_context``), within which full attention is the same."""

    def __init__(self, model, kv, write_kv, ops):
        self.model, self.kv, self.write_kv = model, kv, write_kv
        self.layer_in, self.layer_out, self.head = (torch.compile(f, dynamic=True) for f in pieces(ops))

    def __call__(self, ids, pos, slots, block_tables, context_lens):
        from torch.fx.experimental import _config as fx_config

        m, kv = self.model, self.kv
        c = m.config
        eps = c.rms_norm_eps
        x = m.w.wte[ids]
        with fx_config.patch(use_duck_shape=False):   # see the GPT-2 CompiledDecode: no tied batch sizes
            for i, L in enumerate(m.w.layers):
                kc, vc = kv.k_caches[i], kv.v_caches[i]
                q, k, v = self.layer_in(x, L.ln1_w, L.w_qkv, L.b_qkv, L.q_norm, L.k_norm, m.cos, m.sin, pos, eps,
                                        c.n_head, c.n_kv_head, c.head_dim)
                self.write_kv(k, v, kc, vc, slots)
                x = self.layer_out(x, q, kc, vc, block_tables, context_lens, L.w_o, L.b_o, L.ln2_w, L.w_gu, L.b_gu,
                                   L.w_down, L.b_down, eps)
            return self.head(x, m.w.lnf_w, m.w.lm_head, eps)
