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
  a DynamicCache, and for no cache). The same when the model got no attention_mask and no static cache
  but transformers built a causal mask anyway (it does under torch.compile): ``_model_forward``. A
  prefill into a longer static cache without a mask (sdpa's top-left causal) attends to the first Tq keys.
- a mask and one query token (a decode step over a StaticCache, or any padded batch): the valid keys of
  each row are gathered through a block table into ``tritune.paged_attention`` with a block size of 1,
  so any key mask is exact and nothing syncs with the host (CUDA graphs, torch.compile).
- a mask and several query tokens (a padded prefill, a prefill under torch.compile with an
  attention_mask, chunked prefill with a past): the model's own attention function (sdpa), stated
  here because tritune's attention kernel takes no mask.
Training-mode dropout also takes the original forward.

The compiled decode step (``cuda_graphs=True``, the default; it
measured 1.79 against HF+compile's 2.89 ms a step on the H100, 1.80 against 2.30 on the H200, GPT-2 small
bf16 batch 32, medians of 5 interleaved rounds): HF ``generate`` with a static cache runs its
decode steps through ``model.get_compiled_call(compile_config)``. The patched model's returns a
``ThinGraphCall``: the forward compiled by the compile_config with inductor's own CUDA graphs off, and ONE
``torch.cuda.CUDAGraph`` of it per key (input shapes/strides/dtypes, the static cache's tensor addresses,
the other kwargs' values), replayed after one ``copy_`` per tensor input. Measured on the H100 (2026-11-24),
CUDA-graph trees' own Python (invariant checks, node bookkeeping) was ~740-960 us of host time a step,
about half of a 2.8 ms decode step at batch 32; a replay here is the key, the copies and ``replay()``.
Whatever the key cannot hold (positional args, autograd or training on, CPU tensors, a cache other than
StaticLayers, an output that is not tensors and the cache) runs the compiled call as it is.
"""
from __future__ import annotations

import collections
import inspect
import logging
import types
import weakref

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


def patch(model, cuda_graphs: bool = True):
    """Run a ``GPT2LMHeadModel`` (or ``GPT2Model``) on tritune kernels from now on; returns the model. A
    Llama or Qwen2 model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, their base models) is patched module by
    module instead (:mod:`tritune.model.patch_llama`).
    Refuses (ValueError naming the option) config options the kernels do not implement. Idempotent.
    ``cuda_graphs``: generate's compiled decode steps replay one CUDA graph per key (``ThinGraphCall``)
    instead of torch's CUDA-graph trees (the default); False leaves ``get_compiled_call`` to transformers."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs: expected a bool, got {type(cuda_graphs).__name__}")
    if getattr(getattr(model, "config", None), "model_type", None) in ("llama", "qwen2"):
        from tritune.model.patch_llama import patch_llama     # (cuda_graphs: GPT-2's compiled decode steps only)

        return patch_llama(model)
    try:
        from transformers import GPT2LMHeadModel, GPT2Model
    except ImportError as e:  # pragma: no cover - transformers is a test extra
        raise ImportError("tritune.patch needs transformers") from e
    if isinstance(model, GPT2LMHeadModel):
        base, head = model.transformer, model.lm_head
    elif isinstance(model, GPT2Model):
        base, head = model, None
    else:
        raise TypeError(f"model: expected a transformers GPT2LMHeadModel or GPT2Model (or a Llama / Qwen2 model), "
                        f"got {type(model).__name__}")
    _check_config(model.config)
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"model: dtype {dtype} not supported (float32, float16, bfloat16)")
    if getattr(model, "_tritune_cuda_graphs", None) != cuda_graphs:
        model.__dict__.pop("_compiled_call", None)  # made for the other setting: the next generate remakes it
        model._tritune_cuda_graphs = cuda_graphs
        if cuda_graphs:
            model.get_compiled_call = types.MethodType(_get_compiled_call, model)
            model._valid_auto_compile_criteria = types.MethodType(_compile_criteria, model)
            model.create_masks_for_generate = _DecodeMask(model)
        else:  # transformers' own, with no call in between
            for name in ("get_compiled_call", "_valid_auto_compile_criteria", "create_masks_for_generate",
                         "_tritune_compiled_steps"):
                model.__dict__.pop(name, None)
    if getattr(model, "_tritune_patched", False):
        return model
    memo = _StepMemo()
    params = list(inspect.signature(base.forward).parameters)
    cache_name = "past_key_values" if "past_key_values" in params else "cache"
    # (name, position) of the two arguments _model_forward reads: plain ints and strs, so a compiled
    # forward guards on nothing more (a list of names costs a guard per name)
    base._tritune_arg_pos = tuple((n, params.index(n) if n in params else 1 << 30)
                                  for n in ("attention_mask", cache_name))
    _swap(base, _model_forward)
    base._tritune_memo = memo
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
    self._tritune_memo.causal = False
    return _ln_forward(self, x)


def _model_forward(self, *args, **kwargs):
    """GPT2Model's forward, noting for its layers whether their attention is plainly causal: no
    attention_mask and no fixed-length (static) cache. Eager, transformers drops that mask by itself (sdpa's
    is_causal); under torch.compile it materialises a (B, 1, Tq, Tk) causal mask instead, which would send
    every layer to sdpa with a dense mask (measured on the H100: a compiled 8 x 1024 prefill 9.6 ms
    against 8.6 ms eager). The layers take causal ``tritune.attention`` then, bottom-right aligned: the
    keys that mask allows, with or without a past in a DynamicCache. Decided from the arguments alone
    (names read at patch time): nothing is traced. With that, the compiled prefill launches what eager does
    (tests/test_hf_patch.py::test_compiled_prefill_launches_what_eager_launches) and still measured slower
    (H100, e9041e3: 10.3 against 8.4 ms): its 62 ops go through the dispatcher and custom_op's Python
    layers (~13 us a call on the CPU against ~3 for the body eager calls), host time that a prefill of
    short kernels does not hide."""
    (mask_name, mask_at), (cache_name, cache_at) = self._tritune_arg_pos
    mask = kwargs[mask_name] if mask_name in kwargs else args[mask_at] if mask_at < len(args) else None
    cache = kwargs[cache_name] if cache_name in kwargs else args[cache_at] if cache_at < len(args) else None
    self._tritune_memo.causal = mask is None and not getattr(cache, "is_compileable", False)
    return self._tritune_original_forward(*args, **kwargs)


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
        self.causal = False  # this forward's attention is plainly causal (set by _model_forward)


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
    if memo is not None and memo.causal:  # no mask and no static cache: whatever mask transformers built
        return ops.attention(q, k, v, True, attn.scaling).transpose(1, 2).reshape(B, Tq, H * D)
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


# ---------------------------------------------------------------------------------------------------
# generate's decode step as one CUDA graph a key
log = logging.getLogger(__name__)
_WEIGHTS_VERSION = [0]  # bumped when a watched module gets a parameter, buffer or submodule assigned
_WATCHED: dict = {}     # id -> weakref of the modules of models with a ThinGraphCall
_HOOKS: list = []


def _assigned(module, name, value):
    ref = _WATCHED.get(id(module))
    if ref is not None and ref() is module:  # not a new module at a dead one's id
        _WEIGHTS_VERSION[0] += 1


def _watch_weight_assignments(model) -> None:
    """A replay is valid while the model's parameters and buffers are the tensors it was captured with:
    their addresses are checked each replay (``.to``, ``.data =``), their replacement is seen here."""
    _WATCHED.update((id(m), weakref.ref(m)) for m in model.modules())
    if not _HOOKS:
        mm = torch.nn.modules.module
        _HOOKS.extend(reg(_assigned) for reg in (mm.register_module_parameter_registration_hook,
                                                  mm.register_module_buffer_registration_hook,
                                                  mm.register_module_module_registration_hook))


def _without_cudagraphs(options: dict) -> dict:
    """torch.compile's kwargs from a CompileConfig's dict, with inductor's CUDA graphs off (the replay's own)."""
    kw = dict(options)
    if kw.get("backend", "inductor") != "inductor":
        return kw
    if kw.get("options"):  # torch.compile takes a mode or options, not both
        kw["options"] = {**kw["options"], "triton.cudagraphs": False}
        kw["mode"] = None
    else:
        kw["mode"] = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(kw.get("mode"),
                                                                                                 kw.get("mode"))
    return kw


def _get_compiled_call(self, compile_config=None):
    """The patched model's ``get_compiled_call``: transformers' contract (one callable per compile config,
    kept in ``_compiled_call``), returning a ``ThinGraphCall`` over the forward compiled without CUDA graphs."""
    if not self._tritune_cuda_graphs:
        return type(self).get_compiled_call(self, compile_config)
    compile_config = compile_config or self._default_compile_config()
    default = getattr(self.generation_config, "compile_config", None) or self._default_compile_config()
    if not hasattr(self, "_compiled_call") or getattr(self, "_last_compile_config", default) != compile_config:
        self._last_compile_config = compile_config
        self._compiled_call = ThinGraphCall(self, torch.compile(self.__call__,
                                                                **_without_cudagraphs(compile_config.to_dict())))
    return self._compiled_call


def _compile_criteria(self, model_kwargs, generation_config):
    """transformers' ``_valid_auto_compile_criteria`` (asked once at the start of each sampling loop),
    remembering its answer: a compiled generate's decode steps take :class:`_DecodeMask`."""
    ok = type(self)._valid_auto_compile_criteria(self, model_kwargs, generation_config)
    self._tritune_compiled_steps = bool(ok)
    return ok


class _DecodeMask:
    """The patched model's ``create_masks_for_generate`` (which ``prepare_inputs_for_generation`` calls on the
    host before every step over a static cache). For a compiled generate's one-token decode steps it returns
    the 2-D padding mask zero-padded to the cache's length: a fixed shape (one graph key for the whole
    generate), and the model's forward builds the same 4-D causal mask from it inside the compiled, replayed
    graph (transformers pads a shorter 2-D mask with zeros to the same length itself) instead of ~20 host
    ops a step here (masking_utils' sdpa_mask: ~700 us of a 2.5 ms step under cProfile on the H100). Every
    other call (prefill, eager generate, another cache) gets transformers' own mask."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.calls = collections.Counter()

    def __call__(self, config=None, inputs_embeds=None, attention_mask=None, **kw):
        from transformers.masking_utils import create_masks_for_generate

        model = self.model()
        length = _static_length(kw.get("cache", kw.get("past_key_values")))
        if (model is not None and getattr(model, "_tritune_compiled_steps", False) and inputs_embeds is not None
                and inputs_embeds.shape[1] == 1 and length is not None):
            if (isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2
                    and attention_mask.shape[1] <= length):
                self.calls["padded"] += 1
                return torch.nn.functional.pad(attention_mask, (0, length - attention_mask.shape[1]))
            pos = kw.get("position_ids")
            if attention_mask is None and isinstance(pos, torch.Tensor) and pos.ndim == 2:
                # no padding: a row's position is its cache index; keys up to it are valid (never None here:
                # an eager forward would read None as causal over the whole static cache)
                self.calls["positions"] += 1
                keys = torch.arange(length, device=pos.device)
                return (keys[None, :] <= pos[:, -1:]).to(torch.long).expand(inputs_embeds.shape[0], length)
        self.calls["transformers"] += 1
        return create_masks_for_generate(config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                         **kw)


def _static_length(cache) -> int | None:
    """The key length of a static cache whose layers are initialized StaticLayers (read off the first: the
    step's host work, unlike ``_cache_key``, reads no address), else None."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False):
        return None
    first = layers[0]
    return first.keys.shape[-2] if type(first) is StaticLayer and first.is_initialized else None


_WARM = object()  # an entry's state after its key's first call (the warm-up: the compiled call)


class _Graph:
    __slots__ = ("graph", "inputs", "out_type", "tensors", "caches", "weights")

    def __init__(self, graph, inputs, out_type, tensors, caches, weights):
        self.graph = graph          # .replay()
        self.inputs = inputs        # [(kwarg name, static buffer)]: copied into before each replay
        self.out_type = out_type    # the ModelOutput class the forward returned
        self.tensors = tensors      # {field: static output tensor}
        self.caches = caches        # {field: kwarg name}: the call's own cache object goes there
        self.weights = weights      # (weights version, data_ptrs of the model's parameters and buffers)


class ThinGraphCall:
    """generate's compiled decode call: per key (``key``), the first call runs ``compiled`` on a side
    stream (the warm-up: compiles, tunes, allocates lazily), the second captures one CUDA graph of it
    (static input buffers, the outputs in one memory pool shared by all captures) and replays it, later
    calls copy their tensor inputs into the buffers and replay. The key holds the static cache's tensor
    addresses, not the cache object (holding it would keep its memory, so the next generate's cache
    could never land at the same addresses): a replay runs only while the call's cache sits where the
    graph writes. A replay's logits are overwritten by the next replay, as with CUDA-graph trees: HF
    copies the last position's at once. Any call that does not fit runs ``compiled`` and is counted in
    ``stats`` under ``fallback: <reason>``."""

    MAX_GRAPHS = 8      # captures kept (least recently used dropped): batch sizes x live caches in a process
    require_cuda = True  # the CPU tests stub the capture and lift this

    def __init__(self, model, compiled):
        self.model, self.compiled = model, compiled
        self.entries: collections.OrderedDict = collections.OrderedDict()  # key -> _WARM | _Graph | reason
        self.stats: collections.Counter = collections.Counter()
        self._pool = self._stream = None
        self._weights = None
        _watch_weight_assignments(model)

    # -- the key ------------------------------------------------------------------------------------
    def key(self, args, kwargs):
        """A hashable key of everything the captured graph depends on, or a str: why this call can't replay."""
        if args:
            return "positional arguments"
        if self.model.training:
            return "training mode"
        if torch.is_grad_enabled():
            return "autograd on"
        from transformers.cache_utils import Cache

        parts = [torch.is_inference_mode_enabled()]
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                if self.require_cuda and not v.is_cuda:
                    return f"{name}: not a CUDA tensor"
                if v.requires_grad:
                    return f"{name}: requires grad"
                if not _dense(v):
                    return f"{name}: overlapping or non-dense strides"
                parts.append((name, v.shape, v.stride(), v.dtype, v.device))
            elif isinstance(v, Cache):
                sig = _cache_key(v)
                if isinstance(sig, str):
                    return f"{name}: {sig}"
                parts.append((name, sig))
            elif v is None or type(v) in (bool, int, float, str):
                parts.append((name, type(v), v))
            else:
                return f"{name}: a {type(v).__name__} the key cannot hold"
        return tuple(parts)

    # -- the call -----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        key = self.key(args, kwargs)
        entry = key if isinstance(key, str) else self.entries.get(key)
        if isinstance(entry, _Graph) and entry.weights != self._weights_now(entry.weights[0]):
            self.entries.clear()  # the weights moved or were replaced: every graph reads the old ones
            self.stats["invalidated: weights"] += 1
            entry = None
        if isinstance(entry, _Graph):
            self.entries.move_to_end(key)
            self.stats["replays"] += 1
            return self._replay(entry, kwargs)
        if entry is None:
            self._put(key, _WARM)
            self.stats["warmups"] += 1
            return self._warm(kwargs)
        if entry is not _WARM:  # a reason: this call, or this key, runs the compiled call
            self.stats[f"fallback: {entry}"] += 1
            return self.compiled(*args, **kwargs)
        try:  # second call of this key: capture
            entry = self._capture(kwargs)
        except Exception as e:  # noqa: BLE001 - not capturable: this key runs the compiled call from now on
            entry = f"capture failed: {type(e).__name__}: {e}"[:200]
            log.warning("tritune.patch: the decode step's CUDA graph: %s; running the compiled call", entry)
        self._put(key, entry)
        if isinstance(entry, str):
            self.stats[f"fallback: {entry}"] += 1
            return self.compiled(**kwargs)
        self.stats["captures"] += 1
        self.stats["replays"] += 1
        return self._replay(entry, kwargs)

    def _put(self, key, entry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.MAX_GRAPHS:
            self.entries.popitem(last=False)

    def _weights_now(self, version=None):
        if self._weights is None or version != _WEIGHTS_VERSION[0]:
            self._weights = [*self.model.parameters(), *self.model.buffers()]
        return _WEIGHTS_VERSION[0], tuple(map(torch.Tensor.data_ptr, self._weights))

    def _warm(self, kwargs):
        """The key's first call: the compiled call, on a side stream (torch's CUDA-graph recipe: lazy
        per-stream state and the warm-up's allocations stay off the capture)."""
        dev = next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if dev is None or dev.type != "cuda":
            return self.compiled(**kwargs)
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        cur = torch.cuda.current_stream(dev)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            out = self.compiled(**kwargs)
        cur.wait_stream(self._stream)
        return out

    def _record(self, static_kwargs):
        """(graph, output) of one capture of the compiled call; a CPU test replaces this."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.compiled(**static_kwargs)
        return graph, out

    def _capture(self, kwargs):
        """A _Graph for this call's key, or a str (why not). Capturing runs no kernel: the replay after
        it is this step."""
        weights = self._weights_now()
        inputs, static = [], {}
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                buf = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                buf.copy_(v)
                inputs.append((name, buf))
                static[name] = buf
            else:
                static[name] = v
        graph, out = self._record(static)
        from transformers.utils import ModelOutput

        if not isinstance(out, ModelOutput):
            return f"output: a {type(out).__name__}, not a ModelOutput"
        by_id = {id(v): n for n, v in kwargs.items() if not isinstance(v, (torch.Tensor, bool, int, float, str))
                 and v is not None}
        tensors, caches = {}, {}
        for field, v in out.items():
            if isinstance(v, torch.Tensor):
                tensors[field] = v
            elif id(v) in by_id:
                caches[field] = by_id[id(v)]
            else:
                return f"output {field}: a {type(v).__name__} (neither a tensor nor the call's cache)"
        return _Graph(graph, inputs, type(out), tensors, caches, weights)

    @staticmethod
    def _replay(entry, kwargs):
        for name, buf in entry.inputs:
            buf.copy_(kwargs[name])
        entry.graph.replay()
        return entry.out_type(**entry.tensors, **{f: kwargs[n] for f, n in entry.caches.items()})


def _dense(t) -> bool:
    """A buffer of t's strides can be made and copied into: no two elements at one address."""
    if t.is_contiguous():
        return True
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return False
        span = stride * size
    return True


def _cache_key(cache):
    """The addresses, shapes and dtype of a static cache's tensors (what a captured graph reads and writes
    in place), or a str: why a graph cannot serve this cache."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if not layers or getattr(cache, "offloading", False):
        return f"a {type(cache).__name__} (no layers, or offloaded)"
    sig = [type(cache), layers[0].keys.dtype if getattr(layers[0], "keys", None) is not None else None]
    for lay in layers:
        if type(lay) is not StaticLayer or not lay.is_initialized:
            return f"layer {type(lay).__name__} (a graph replays over initialized StaticLayers only)"
        k, v = lay.keys, lay.values
        sig.append((k.data_ptr(), v.data_ptr(), lay.cumulative_length.data_ptr(), k.shape, v.shape))
    return tuple(sig)
