"""``patch(model)``: a Hugging Face GPT-2 on tritune kernels, in place (as Liger's apply_liger_kernel_to_*).

Each GPT2Block's forward becomes the engine's step written on ``torch.ops.tritune``:

    h = layer_norm(x); qkv = gemm(h, W_qkv, b_qkv)        (linear op: gemv with the LayerNorm fused at <= 8 rows)
    a = attention(q, k, v)                                 (after the cache update, see below)
    x = gemm(a, W_o, b_o, residual=x)                      residual add in the GEMM epilogue
    f = gemm(layer_norm(x), W_fc, b_fc, "gelu_tanh")       bias + GELU in the epilogue
    x = gemm(f, W_proj, b_proj, residual=x)

and ln_f and lm_head run on the layer_norm and linear ops (the head on gemv at <= 8 rows, as the engine's).
Conv1D keeps its (in, out) weight, which is gemm's (K, N) operand as it is; lm_head's (V, C) weight goes
in as its transposed view. No weight is copied, so tied embeddings stay tied.

Eager calls with autograd off (``generate``, ``torch.no_grad``) go to the ops' bodies directly
(``torch_ops.EAGER``: the same launchers, without the dispatcher's ~11 us a call); under torch.compile,
with autograd on or on fake tensors they go through ``torch.ops.tritune``.

Attention, given the mask GPT2Model built (4-D bool for sdpa, additive for eager, or None):
- no mask: causal ``tritune.attention`` (bottom-right aligned: right for prefill, for a decode step over
  a DynamicCache, and for no cache). A prefill into a longer static cache without a mask (sdpa's
  top-left causal) attends to the first Tq keys.
- a mask and one query token (a decode step over a StaticCache, or any padded batch): the valid keys of
  each row are gathered through a block table into ``tritune.paged_attention`` with a block size of 1,
  so any key mask is exact and nothing syncs with the host (CUDA graphs, torch.compile).
- a mask and several query tokens (a padded prefill, a prefill under torch.compile with an
  attention_mask, chunked prefill with a past): the model's own attention function (sdpa), stated
  here because tritune's attention kernel takes no mask.
Training-mode dropout also takes the original forward.
"""
from __future__ import annotations

import types

import torch

from tritune.kernels import torch_ops  # registers torch.ops.tritune

OPS = torch.ops.tritune
EAGER = types.SimpleNamespace(**torch_ops.EAGER)
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh form: the GEMM epilogue's
ATTN_HEAD_DIMS = (32, 64, 128)         # what both attention kernels take
_REFUSED = {  # config option -> the value tritune supports
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


def _check_config(cfg) -> None:
    for name, ok in _REFUSED.items():
        if getattr(cfg, name, ok) != ok:
            raise ValueError(f"tritune.patch: config.{name}={getattr(cfg, name)!r} is not supported (needs {ok!r})")
    act = getattr(cfg, "activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"tritune.patch: config.activation_function={act!r} is not supported "
                         f"(expected one of {ACTIVATIONS})")
    d = cfg.n_embd // cfg.n_head
    if d not in ATTN_HEAD_DIMS:
        raise ValueError(f"tritune.patch: head dim config.n_embd / config.n_head = {d} is not supported "
                         f"(expected one of {ATTN_HEAD_DIMS})")


def patch(model):
    """Run a ``GPT2LMHeadModel`` (or ``GPT2Model``) on tritune kernels from now on; returns the model.
    Refuses (ValueError naming the option) config options the kernels do not implement. Idempotent."""
    try:
        from transformers import GPT2LMHeadModel, GPT2Model
    except ImportError as e:  # pragma: no cover - transformers is a test extra
        raise ImportError("tritune.patch needs transformers") from e
    if isinstance(model, GPT2LMHeadModel):
        base, head = model.transformer, model.lm_head
    elif isinstance(model, GPT2Model):
        base, head = model, None
    else:
        raise TypeError(f"model: expected a transformers GPT2LMHeadModel or GPT2Model, got {type(model).__name__}")
    _check_config(model.config)
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"model: dtype {dtype} not supported (float32, float16, bfloat16)")
    if getattr(model, "_tritune_patched", False):
        return model
    memo = _StepMemo()
    for block in base.h:
        _swap(block, _block_forward)
        block._tritune_memo = memo
    _swap(base.ln_f, _ln_final_forward)
    base.ln_f._tritune_memo = memo
    if head is not None:
        _swap(head, _head_forward)
    model._tritune_patched = True
    return model


def _swap(module, fn) -> None:
    module._tritune_original_forward = module.forward
    module.forward = types.MethodType(fn, module)


# ---------------------------------------------------------------------------------------------------
def _ops(x):
    """The ops' bodies when a call is plain eager inference (a tensor of torch's own type, autograd off, no
    compile): the dispatcher adds nothing there. Otherwise the ops (dynamo sees is_compiling() as True and
    traces the op; autograd and fake tensors need the op's registration)."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or type(x) is not torch.Tensor:
        return OPS
    return EAGER


def _linear(x, conv, activation=None, residual=None):
    """Conv1D: x @ W + b with W (in, out); gemv or gemm by the row count, chosen inside the op."""
    return _ops(x).linear(x, conv.weight, conv.bias, activation, residual)


def _ln_linear(x, ln, conv, activation=None):
    return _ops(x).linear(x, conv.weight, conv.bias, activation, None, ln.weight, ln.bias, ln.eps)


def _ln_forward(self, x):
    return _ops(x).layer_norm(x, self.weight, self.bias, self.eps)


def _ln_final_forward(self, x):
    self._tritune_memo.entry = None  # ln_f closes the forward: the next one starts with no tables
    return _ln_forward(self, x)


def _head_forward(self, x):
    # linear, not gemm: gemv at <= 8 rows (a decode step's logits), the engine's LM-head kernel
    return _ops(x).linear(x, self.weight.t(), self.bias)


# ---------------------------------------------------------------------------------------------------
def _valid_keys(mask, B, Tk):
    """(B, Tk) bool: the keys the one query of each row may see, from the 4-D mask (bool, or additive)."""
    valid = mask[:, 0, -1, :] if mask.dtype == torch.bool else mask[:, 0, -1, :] == 0
    return valid.expand(B, Tk)


def _tables(valid, B, per_row, device):
    """The block table (B, Tk) int32 and the lengths (B,) int32 of the valid keys (see _decode_paged): each
    valid key's position goes to its rank among the row's valid keys (a running count), the others to a
    spare column past the end. A scan and a scatter, which inductor lowers to kernels of its own and fuses
    with the cache update (a sort was an aten fallback a step); columns past a row's length stay 0 (the
    kernel reads no column past the length)."""
    Tk = valid.shape[1]
    count = valid.to(torch.int32).cumsum(-1, dtype=torch.int32)
    dest = torch.where(valid, count - 1, Tk).to(torch.int64)
    cols = torch.arange(Tk, device=device, dtype=torch.int32)
    src = (torch.arange(B, device=device, dtype=torch.int32).unsqueeze(1) * per_row + cols).expand(B, Tk)
    tables = torch.zeros(B, Tk + 1, dtype=torch.int32, device=device).scatter_(1, dest, src)
    return tables[:, :Tk], count[:, -1].contiguous()


class _StepMemo:
    """One forward's decode block table, shared by its layers. Every layer of a step gets the same mask
    object (GPT2Model builds it once a forward) over caches of one layout, hence the same table: made by
    the first layer (~12 small launches eagerly; a sort and a few kernels in a compiled graph, which
    inductor would not merge across layers), reused by the others, dropped by ln_f at the end of the
    forward. Under torch.compile the memo is a traced side effect: ``entry`` is None at every call's start
    (one guard, no recompile), and ``is`` between the traced mask and the stored one is decided while
    tracing. Holding the mask keeps its id from being reused while the entry lives."""

    def __init__(self):
        self.entry = None   # (mask, (B, Tk, per_row), (tables, lens))


def _decode_paged(q, k, v, mask, scale, ops, memo=None):
    """One query token a row over keys k, v (B, H, Tk, D), of which the mask's may be seen: the valid
    keys' positions, in order, become a block table over the cache viewed as blocks of one token
    (block id b·(sB/sS) + s addresses k[b, :, s]). None when the strides do not allow that view."""
    B, H, _, D = q.shape
    Tk = k.shape[2]
    sB, sH, sS, sD = k.stride()
    if k.stride() != v.stride() or sD != 1 or sS <= 0 or (B > 1 and sB % sS):
        return None
    per_row = sB // sS if B > 1 else 0
    key = (B, Tk, per_row)
    hit = None if memo is None else memo.entry
    if hit is not None and hit[0] is mask and hit[1] == key:
        tables, lens = hit[2]
    else:
        tables, lens = _tables(_valid_keys(mask, B, Tk), B, per_row, q.device)
        if memo is not None:
            memo.entry = (mask, key, (tables, lens))
    nb = (B - 1) * per_row + Tk
    kc = k.as_strided((nb, 1, H, D), (sS, sS, sH, 1))
    vc = v.as_strided((nb, 1, H, D), (sS, sS, sH, 1))
    return ops.paged_attention(q.reshape(B, H, D), kc, vc, tables, lens, scale, False).view(B, 1, H * D)


def _attend(attn, q, k, v, mask, memo=None, **kwargs):
    """(B, Tq, C) attention output for q, k, v (B, H, T, D); see the module docstring for the paths."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    ops = _ops(q)
    if mask is None:
        if 1 < Tq < Tk:  # sdpa's is_causal is top-left aligned: a prefill into a longer static cache
            k, v = k[:, :, :Tq], v[:, :, :Tq]
        return ops.attention(q, k, v, True, attn.scaling).transpose(1, 2).reshape(B, Tq, H * D)
    if Tq == 1:
        out = _decode_paged(q, k, v, mask, attn.scaling, ops, memo)
        if out is not None:
            return out
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward

    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    out, _ = fn(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    return out.reshape(B, Tq, H * D)


def _block_forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                   encoder_attention_mask=None, use_cache=False, **kwargs):
    attn, mlp = self.attn, self.mlp
    if self.training and (attn.attn_dropout.p or attn.resid_dropout.p or mlp.dropout.p):
        return self._tritune_original_forward(hidden_states, cache, attention_mask, encoder_hidden_states,
                                              encoder_attention_mask=encoder_attention_mask,
                                              use_cache=use_cache, **kwargs)
    if encoder_hidden_states is not None:
        raise ValueError("encoder_hidden_states: cross-attention is not supported by tritune.patch")
    x = hidden_states
    B, T, C = x.shape
    H = attn.num_heads
    qkv = _ln_linear(x, self.ln_1, attn.c_attn)
    q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv.split(C, dim=2))
    if cache is not None:
        from transformers.cache_utils import EncoderDecoderCache

        cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
    kwargs.pop("position_ids", None)
    a = _attend(attn, q, k, v, attention_mask, getattr(self, "_tritune_memo", None), **kwargs)
    x = _linear(a, attn.c_proj, residual=x)
    f = _ln_linear(x, self.ln_2, mlp.c_fc, activation="gelu_tanh")
    return _linear(f, mlp.c_proj, residual=x)
