"""``tritune.patch`` for Hugging Face Llama-family models (LlamaForCausalLM, Qwen2ForCausalLM and their
base models), in place, module by module (as Liger's apply_liger_kernel_to_llama):

    RMSNorm     -> kernels/rms_norm.py (float32 statistics, rounded to the input's dtype, times the weight)
    attention   -> one projection of the concatenated [q | k | v] weight (the ``linear`` op: gemv at <= 8
                   rows, gemm above), rotary on kernels/rotary.py with the cos/sin rows transformers
                   computed (so every rope type it implements comes for free), the cache update as the
                   model's own, ``tritune.attention`` (causal, GQA) where transformers built no mask, else
                   the model's attention function (sdpa) with its mask; o_proj on ``linear``
    MLP         -> ``linear`` with the SwiGLU epilogue over the concatenated [gate | up] weight, then down_proj

The concatenated weights are copies, made at the first patched forward and again whenever a source weight
changes (its storage or version counter), so assigning or editing a weight after ``patch`` is seen. The LM
head and the embedding are the model's own.

A module runs its original forward when autograd is on, in training mode, under torch.compile or on a
tensor subclass (the kernels here have no backward and are called directly): patching never changes
training, only inference.
"""
from __future__ import annotations

import torch

MODEL_TYPES = ("llama", "qwen2")
ATTN_HEAD_DIMS = (32, 64, 128)         # what tritune's attention kernels take; other head dims use sdpa


def _eager(x) -> bool:
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling() or type(x) is not torch.Tensor)


def _ops():
    from tritune.kernels import torch_ops

    return torch_ops.EAGER


def check(model) -> None:
    """ValueError naming the option when the model is not one this patch runs exactly."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        raise ValueError(f"tritune.patch: config.model_type={mt!r} is not supported (expected gpt2 or one of "
                         f"{MODEL_TYPES})")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"tritune.patch: config.hidden_act={act!r} is not supported (SwiGLU needs 'silu')")
    prf = getattr(cfg, "partial_rotary_factor", 1.0)
    if prf not in (None, 1.0):
        raise ValueError(f"tritune.patch: config.partial_rotary_factor={prf!r} is not supported (needs 1.0)")
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"model: dtype {dtype} not supported (float32, float16, bfloat16)")


def patch_llama(model):
    """Swap the forwards of ``model``'s RMSNorms, attentions and MLPs onto tritune's kernels (idempotent)."""
    check(model)
    if getattr(model, "_tritune_patched", False):
        return model
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and hasattr(module, "weight"):
            _swap(module, _rms_forward)
        elif kind.endswith("Attention") and hasattr(module, "q_proj") and hasattr(module, "o_proj"):
            _swap(module, _attn_forward)
        elif kind.endswith("MLP") and hasattr(module, "gate_proj") and hasattr(module, "down_proj"):
            _swap(module, _mlp_forward)
    model._tritune_patched = True
    return model


def _swap(module, fn) -> None:
    module._tritune_orig_forward = module.forward
    module.forward = fn.__get__(module)


def _rms_forward(self, x):
    if not _eager(x):
        return self._tritune_orig_forward(x)
    from tritune.kernels.rms_norm import rms_norm

    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    return rms_norm(x, self.weight, eps)


def _fused(module, attr: str, linears) -> tuple:
    """(weight (K, sum N) as the ``linear`` op reads it, bias or None) of the linears concatenated along
    their outputs: cached on the module, remade when a source weight's storage or version changed."""
    key = tuple((m.weight.data_ptr(), m.weight._version, m.weight.dtype,
                 None if m.bias is None else (m.bias.data_ptr(), m.bias._version)) for m in linears)
    cached = module.__dict__.get(attr)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    w = torch.cat([m.weight.detach() for m in linears], dim=0).t()    # (K, N): a transposed view, no copy more
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        b = None
    else:
        b = torch.cat([(m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]))
                       for m in linears])
    module.__dict__[attr] = (key, w, b)
    return w, b


def _linear(x, lin, activation=None):
    return _ops()["linear"](x, lin.weight.t(), lin.bias, activation)


def _mlp_forward(self, x):
    if not _eager(x) or self.training:
        return self._tritune_orig_forward(x)
    w, b = _fused(self, "_tritune_gate_up", (self.gate_proj, self.up_proj))
    return _linear(_ops()["linear"](x, w, b, "swiglu"), self.down_proj)


def _cache_update(cache, k, v, layer_idx, cos, sin, kwargs):
    try:
        return cache.update(k, v, layer_idx, kwargs=kwargs)
    except TypeError:   # transformers before 5: a cache_kwargs dict as the fourth argument
        return cache.update(k, v, layer_idx, {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")})


def _attn_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    if not _eager(hidden_states) or self.training or args or position_embeddings is None:
        return self._tritune_orig_forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    cache = None
    for name in ("cache", "past_key_values", "past_key_value"):
        cache = kwargs.pop(name, None) if cache is None else cache
    B, T, _ = hidden_states.shape
    D = self.head_dim
    hq, hk = self.q_proj.weight.shape[0] // D, self.k_proj.weight.shape[0] // D
    w, b = _fused(self, "_tritune_qkv", (self.q_proj, self.k_proj, self.v_proj))
    qkv = _ops()["linear"](hidden_states, w, b).view(B * T, hq + 2 * hk, D)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    q, k = _rotate(q, k, *position_embeddings)
    q = q.view(B, T, hq, D).transpose(1, 2)
    k = k.view(B, T, hk, D).transpose(1, 2)
    v = v.reshape(B, T, hk, D).transpose(1, 2)
    if cache is not None:
        k, v = _cache_update(cache, k, v, self.layer_idx, *position_embeddings, kwargs)
    out = _attend(self, q, k, v, attention_mask, kwargs)
    return _linear(out, self.o_proj), None


def _rotate(q, k, cos, sin):
    """(q, k) (tokens, heads, D) rotated by transformers' per-token cos/sin (B, T, D): each token's row is a
    row of the kernel's table (the neox halves of HF's cos are equal: the table holds the first)."""
    from tritune.kernels.rotary import rotary

    D = q.shape[-1]
    n = q.shape[0]
    c = cos.to(q.dtype).reshape(-1, cos.shape[-1])[:, :D // 2]
    s = sin.to(q.dtype).reshape(-1, sin.shape[-1])[:, :D // 2]
    if c.shape[0] != n:      # cos of one batch row shared by all (transformers broadcasts position_ids of 1 row)
        c, s = c.repeat(n // c.shape[0], 1), s.repeat(n // s.shape[0], 1)
    positions = torch.arange(n, device=q.device)
    return rotary(q, k, c, s, positions, validate=False)


def _attend(attn, q, k, v, mask, kwargs):
    """(B, Tq, H * D): tritune's causal attention where transformers built no mask (no padding, no sliding
    window), else the model's own attention function with its mask."""
    B, H, Tq, D = q.shape
    window = getattr(attn, "sliding_window", None)
    if mask is None and window is None and D in ATTN_HEAD_DIMS:
        if 1 < Tq < k.shape[2]:  # sdpa's is_causal is top-left aligned: a prefill into a longer static cache
            k, v = k[:, :, :Tq], v[:, :, :Tq]
        return _ops()["attention"](q, k, v, True, attn.scaling).transpose(1, 2).reshape(B, Tq, H * D)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    extra = {} if window is None else {"sliding_window": window}
    out, _ = fn(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **extra, **kwargs)
    return out.reshape(B, Tq, H * D)
