"""Every built-in kernel as a PyTorch custom op: ``torch.ops.tritune.<name>``.

Each op is a thin layer over the kernel's launcher (which keeps its validation, the tuned-config lookup,
its launch-plan cache, PDL and split-K counters) plus a fake implementation that gives the output's
shape, dtype and strides from the inputs' metadata alone, so ``torch.compile`` traces through the op
(symbolic shapes included) without running it, and CUDA graphs capture the launch the op makes.

Why ``torch.library.custom_op`` and not ``triton_op`` + ``wrap_triton``: a ``triton_op`` body must be
traceable down to its ``wrap_triton(kernel)[grid](...)`` calls, but the launchers call compiled kernels
directly (``kernels.launch_cached``), key plans on concrete strides and keep per-device workspaces;
tracing that symbolically would mean a second launcher per kernel. The opaque op keeps one launcher.

Schemas flatten the launchers' Python-object arguments: gemv's ``ln`` tuple is (ln_weight, ln_bias,
ln_eps) with ``ln_eps`` None for no LayerNorm; its ``kv`` tuple is (k_cache, v_cache, slot_mapping), the
required arguments of a second op, ``gemv_kv``, which declares the caches mutated (an op's mutated
arguments are never optional: see ``gemv_kv``); quant_matmul's ``QuantizedWeight`` travels as its
tensors and ints. fp8_quant's ``norm`` tuple is (norm, norm_weight, norm_bias, eps) with ``norm`` None,
"rms" or "layer"; fp8_kv_write (the spec's name; launcher ``fp8_write_kv``) writes four tensors in place,
all required. A launcher whose result is one tensor or a pair by its arguments is two ops: rms_norm and
``rms_norm_add`` (with ``residual``), rotary (new tensors) and ``rotary_kv`` (its ``kv`` tuple as
k_cache, v_cache, slot_mapping, v; the caches written in place). An explicit ``config`` is a launcher
argument only (the op takes the tuned or default config), and so are ``out=``, ``return_lse`` and
``return_stats``.

This module is imported by kernel discovery like any other in ``kernels/`` (it registers no spec): the
registrations cost ~1 ms each, once a process, and need nothing but torch.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from tritune.kernels import attention as _attention
from tritune.kernels import fp8_attention as _fp8_attention
from tritune.kernels import fp8_gemm as _fp8_gemm
from tritune.kernels import fp8_gemv as _fp8_gemv
from tritune.kernels import fp8_qgemv as _fp8_qgemv
from tritune.kernels import fp8_kv_write as _fp8_kv_write
from tritune.kernels import fp8_paged_attention as _fp8_paged
from tritune.kernels import fp8_quant as _fp8_quant
from tritune.kernels import gelu as _gelu
from tritune.kernels import gemm as _gemm
from tritune.kernels import gemv as _gemv
from tritune.kernels import layer_norm as _layer_norm
from tritune.kernels import paged_attention as _paged
from tritune.kernels import quant_matmul as _qmm
from tritune.kernels import rms_norm as _rms_norm
from tritune.kernels import rotary as _rotary
from tritune.references import quant as _quant

Tensor = torch.Tensor
_NS = "tritune"


# The bodies, undecorated: a caller running eagerly with autograd off (a Hugging Face ``generate`` on a
# patched model) calls these and skips the dispatcher: a linear call costs the CPU host 2.7 us against 6.1
# through torch.ops (12.6 before ``_lean``); torch.compile, autograd and fake tensors take the op.
EAGER: dict = {}


def _op(name: str, mutates_args: tuple):
    def register(fn):
        EAGER[name] = fn
        op = torch.library.custom_op(f"{_NS}::{name}", mutates_args=mutates_args)(fn)
        fake = op.register_fake

        def register_fake(impl):  # every fake first makes sure inductor has the ops' explicit fallbacks
            def traced(*args, **kwargs):
                if not _FALLBACKS["done"]:
                    inductor_fallbacks()
                return impl(*args, **kwargs)
            return fake(traced)

        op.register_fake = register_fake
        _lean(name, op, fn, mutating=bool(mutates_args))
        return op
    return register


# The runtime path. custom_op routes a call through Python layers that cost more than most bodies: its
# Autograd kernel (autograd_impl: a redispatch under _AutoDispatchBelowAutograd), then its backend kernel
# (backend_impl: an aliasing check, a dynamo-disable wrapper, the body): a call through torch.ops cost
# several times its body on the host, about half that with the registration below (docs/findings.md), and a
# GPT-2 prefill makes 62 such calls. custom_op stays for the schema, the fakes, opcheck and the autograd
# semantics; ``_LIB`` adds two kernels an op at more specific keys, which the dispatcher prefers to
# custom_op's (``CompositeExplicitAutograd`` and the ``Autograd`` alias):
# - the body itself at CPU and CUDA (custom_op's own ``register_kernel(device)`` adds the same
#   backend_impl wrapper, so it is no leaner);
# - at AutogradCPU/AutogradCUDA, ``fast``: the body when the inputs are plain
#   tensors (nothing between autograd and the backend: no fake, functional, batched or subclass tensor,
#   no dispatch mode) and no input needs a gradient, else custom_op's own autograd kernel (so a fake
#   tensor still reaches the fake, and an input that requires grad gets custom_op's grad_fn).
# What remains is the dispatcher's call into one Python function and the fast path's two checks. For a
# mutating op the fast path also bumps the version counters of what it writes, as custom_op's
# ADInplaceOrView kernel (which it skips, and which stays for the other paths) does. The compiled graph
# calls an op inside dynamo's disable (dynamo wraps every compiled graph), so the body needs no wrapper.
_LIB = torch.library.Library(_NS, "IMPL")
_DEVICES = ("CPU", "CUDA")


def _lean_wanted() -> bool:
    """The lean path leans on torch internals: on by default where the test suite has verified it (torch
    2.13, the CPU suite); TRITUNE_LEAN_DISPATCH=1/0 forces it on/off (torch 2.11, the GPU machines' torch:
    not yet run there)."""
    env = os.environ.get("TRITUNE_LEAN_DISPATCH", "").strip()
    if env in ("0", "1"):
        return env == "1"
    try:
        return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
    except ValueError:
        return False


LEAN = _lean_wanted()
_PLAIN: dict = {}  # DispatchKeySet.raw_repr() -> whether the backend is the next kernel after autograd
_KERNELS: dict = {}  # (op name, dispatch key) -> the Python kernel registered there


def _plain(keyset) -> bool:
    raw = keyset.raw_repr()
    plain = _PLAIN.get(raw)
    if plain is None:
        top = (keyset & torch._C._after_ADInplaceOrView_keyset).highestPriorityTypeId()
        plain = _PLAIN[raw] = top in (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
    return plain


def _lean(name: str, op, fn, mutating: bool, lib=None) -> None:
    """Register ``fn`` (the body of custom_op ``op``, ``name`` in ``lib``'s namespace, this module's by
    default) at the device keys, and the autograd fast path."""
    if lib is None and not LEAN:
        return
    lib, kernels = (_LIB, _KERNELS) if lib is None else (lib, {})
    for dev in _DEVICES:
        lib.impl(name, fn, dev)
        kernels[name, dev] = fn
    try:  # custom_op's autograd kernel, for the calls the fast path hands on (torch-internal API)
        from torch._library.autograd import make_autograd_impl
        from torch.autograd.graph import increment_version
        slow = make_autograd_impl(op._opoverload, op)
        grad_on, any_grad, _ = torch.is_grad_enabled, torch._C._any_requires_grad, torch._C.DispatchKeySet.raw_repr
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - another torch: custom_op's path
        return
    schema = op._opoverload._schema
    # a mutated argument is never optional here (see gemv_kv), so it is always among the positional args
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    assert bool(written) == mutating and not any(a.kwarg_only for a in schema.arguments), name

    def fast(keyset, *args, **kwargs):
        if _plain(keyset) and not (grad_on() and any_grad(*args, **kwargs)):
            for i in written:  # what custom_op's ADInplaceOrView kernel does, which this path skips
                increment_version(args[i])
            return fn(*args, **kwargs)
        return slow(keyset, *args, **kwargs)

    fast.__name__ = fast.__qualname__ = f"{name}_autograd_fast"
    for dev in _DEVICES:
        lib.impl(name, fast, "Autograd" + dev, with_keyset=True)
        kernels[name, "Autograd" + dev] = fast


def registered(name: str, key: str):
    """The Python kernel ``torch.ops.tritune.<name>`` runs at dispatch key ``key`` (CPU, AutogradCUDA,
    ...) when this module registered one, else None: what the tests check the lean path against."""
    return _KERNELS.get((name, key))


# Inductor lowers an op it has no lowering for through its implicit-fallback path, which first builds the
# log line "Creating implicit fallback for: <op>(<its args' IR>)". torch <= 2.11 builds it at every such op
# whatever the log level (an eager ``operator_str``; a LazyString from 2.12 on), and an argument's IR
# prints its inputs' IR recursively, with no memo: on a residual stream, where each layer's output reads
# the layer's input twice (through attention and as the GEMM epilogue's residual), the text doubles per
# op, and the 12-layer patched HF GPT-2's decode graph never finished lowering (docs/findings.md).
# Registering the same fallback
# (same layout constraint from the op's tags) up front skips that path. Done at the first fake call (the
# tracing that precedes any lowering) because importing inductor costs ~2 s, more than every op here.
_FALLBACKS = {"done": False}


def inductor_fallbacks() -> bool:
    """Register each ``torch.ops.tritune`` op with inductor as an explicit fallback: the compiled graph
    calls the op (our launcher) with the strides its fake saw, as inductor's implicit fallback would,
    without building the implicit path's log text. Once a process; False where inductor is unavailable."""
    if _FALLBACKS["done"]:
        return _FALLBACKS["ok"]
    _FALLBACKS.update(done=True, ok=False)
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes():  # called from a fake: inductor's import must not build fake tensors
            from torch._inductor import lowering
            from torch._library.utils import get_layout_constraint_tag
    except Exception:  # pragma: no cover - a torch without inductor: nothing to lower
        return False
    for name in OPS:
        op = getattr(torch.ops.tritune, name).default
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint, warn=False)
    _FALLBACKS["ok"] = True
    return True


def _rows_times(x: Tensor, n) -> tuple:
    return (*x.shape[:-1], n)


def _inner(a_name: str, a: Tensor, b_name: str, k) -> None:
    # the one shape rule a fake must enforce: otherwise a mismatch would surface only when the graph runs
    torch._check(a.dim() >= 1, lambda: f"{a_name}: expected at least 1 dim (..., K)")
    torch._check(a.shape[-1] == k, lambda: f"{a_name}, {b_name}: inner sizes differ ({a.shape[-1]} vs {k})")


# ---------------------------------------------------------------------------------------------------
@_op("layer_norm", ())
def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim (tritune.kernels.layer_norm.layer_norm)."""
    return _layer_norm.layer_norm(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight=None, bias=None, eps=1e-5):
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------------------------------
@_op("gemm", ())
def gemm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
         residual: Optional[Tensor] = None) -> Tensor:
    """act(a @ b + bias) + residual; a (..., K), b (K, N) (tritune.kernels.gemm.gemm)."""
    return _gemm.gemm(a, b, bias, activation=activation, residual=residual)


@gemm.register_fake
def _(a, b, bias=None, activation=None, residual=None):
    _inner("a", a, "b", b.shape[0])
    return a.new_empty(_rows_times(a, b.shape[1] // 2 if activation == "swiglu" else b.shape[1]))


# ---------------------------------------------------------------------------------------------------
@_op("gelu", ())
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact ("none") or "tanh" (tritune.kernels.gelu.gelu)."""
    return _gelu.gelu(x, approximate)


@gelu.register_fake
def _(x, approximate="none"):
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------------------------------
@_op("gemv", ())
def gemv(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
         residual: Optional[Tensor] = None, ln_weight: Optional[Tensor] = None, ln_bias: Optional[Tensor] = None,
         ln_eps: Optional[float] = None) -> Tensor:
    """act(LN(x) @ w + bias) + residual for a few rows (tritune.kernels.gemv.gemv); LayerNorm when
    ``ln_eps`` is not None. The fused KV-cache write is ``gemv_kv``."""
    ln = None if ln_eps is None else (ln_weight, ln_bias, ln_eps)
    return _gemv.gemv(x, w, bias, activation=activation, residual=residual, ln=ln)


@gemv.register_fake
def _(x, w, bias=None, activation=None, residual=None, ln_weight=None, ln_bias=None, ln_eps=None):
    _inner("x", x, "w", w.shape[0])
    return x.new_empty(_rows_times(x, w.shape[1] // 2 if activation == "swiglu" else w.shape[1]))


# The mutating form is its own op, its caches required arguments: a mutated argument that may be left out
# (an Optional with a default) breaks torch <= 2.11, whose ADInplaceOrView wrapper indexes the call's
# arguments by schema position after the dispatcher dropped the defaulted ones (IndexError: tuple index
# out of range on every call that omits them; pytorch/pytorch#176078, fixed in 2.12). A pure ``gemv``
# also spares torch.compile the functionalization a mutating op needs.
@_op("gemv_kv", ("k_cache", "v_cache"))
def gemv_kv(x: Tensor, w: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
            bias: Optional[Tensor] = None, activation: Optional[str] = None, residual: Optional[Tensor] = None,
            ln_weight: Optional[Tensor] = None, ln_bias: Optional[Tensor] = None,
            ln_eps: Optional[float] = None) -> Tensor:
    """``gemv`` of a fused qkv projection (N = 3 x heads x head_dim) that also writes each row's k and v
    columns to the paged caches at its slot (slot < 0: not written), in place."""
    ln = None if ln_eps is None else (ln_weight, ln_bias, ln_eps)
    return _gemv.gemv(x, w, bias, activation=activation, residual=residual, ln=ln,
                      kv=(k_cache, v_cache, slot_mapping))


@gemv_kv.register_fake
def _(x, w, k_cache, v_cache, slot_mapping, bias=None, activation=None, residual=None, ln_weight=None,
      ln_bias=None, ln_eps=None):
    _inner("x", x, "w", w.shape[0])
    return x.new_empty(_rows_times(x, w.shape[1] // 2 if activation == "swiglu" else w.shape[1]))


GEMV_MAX_M = 8  # rows up to which `linear` takes the gemv kernel (the engine's threshold)


@_op("linear", ())
def linear(x: Tensor, w: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None,
           residual: Optional[Tensor] = None, ln_weight: Optional[Tensor] = None, ln_bias: Optional[Tensor] = None,
           ln_eps: Optional[float] = None) -> Tensor:
    """act(LN(x) @ w + bias) + residual as the engine runs it: gemv with the LayerNorm fused at <= 8 rows
    (decode), else layer_norm then gemm. The choice is made here, when the op runs, not in the caller:
    a branch on the row count in traced code would be a guard, and torch.compile would recompile when
    a sequence length crosses it."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= GEMV_MAX_M:
        ln = None if ln_eps is None else (ln_weight, ln_bias, ln_eps)
        return _gemv.gemv(x, w, bias, activation=activation, residual=residual, ln=ln)
    if ln_eps is not None:
        x = _layer_norm.layer_norm(x, ln_weight, ln_bias, ln_eps)
    return _gemm.gemm(x, w, bias, activation=activation, residual=residual)


@linear.register_fake
def _(x, w, bias=None, activation=None, residual=None, ln_weight=None, ln_bias=None, ln_eps=None):
    _inner("x", x, "w", w.shape[0])
    return x.new_empty(_rows_times(x, w.shape[1] // 2 if activation == "swiglu" else w.shape[1]))


# ---------------------------------------------------------------------------------------------------
@_op("attention", ())
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """Attention over (B, H, T, D) tensors; causal is bottom-right aligned (query i sees keys
    j <= i + Tk - Tq) (tritune.kernels.attention.attention)."""
    return _attention.attention(q, k, v, causal=causal, scale=scale)


@attention.register_fake
def _(q, k, v, causal=False, scale=None):
    torch._check(q.dim() == 4, lambda: f"q: expected 4 dims (B, H, T, D), got {q.dim()}")
    return q.new_empty(q.shape)


@_op("attention_varlen", ())
def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, causal: bool = False, scale: Optional[float] = None,
                     validate: Optional[bool] = None) -> Tensor:
    """Attention over packed sequences (tritune.kernels.attention.attention_varlen). ``validate`` is the
    launcher's: None (default) reads a cu_seqlens tensor's values back to the host the first time it is
    launched with and not again while it is unmodified, True on every call, False never (a CUDA-graph
    capture never does). The default was True, a host sync on every call of the op."""
    return _attention.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=causal, scale=scale, validate=validate)


@attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None, validate=None):
    torch._check(q.dim() == 3, lambda: f"q: expected 3 dims (total_q, H, D), got {q.dim()}")
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------------
@_op("paged_attention", ())
def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                    scale: Optional[float] = None, validate: bool = True) -> Tensor:
    """Decode attention over a paged KV cache (tritune.kernels.paged_attention.paged_attention)."""
    return _paged.paged_attention(q, k_cache, v_cache, block_tables, context_lens, scale=scale, validate=validate)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, scale=None, validate=True):
    torch._check(q.dim() == 3, lambda: f"q: expected 3 dims (B, Hq, D), got {q.dim()}")
    return q.new_empty(q.shape)


@_op("write_kv", ("k_cache", "v_cache"))
def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             validate: bool = True) -> None:
    """Store new tokens' K and V in their cache slots, in place (tritune.kernels.paged_attention.write_kv)."""
    _paged.write_kv(k, v, k_cache, v_cache, slot_mapping, validate=validate)


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping, validate=True):
    return None


# ---------------------------------------------------------------------------------------------------
@_op("quant_matmul", ())
def quant_matmul(x: Tensor, data: Tensor, scales: Tensor, zeros: Optional[Tensor], bits: int, n: int, k: int,
                 group_size: int, bias: Optional[Tensor] = None) -> Tensor:
    """x @ dequant(W)ᵀ (+ bias) with W = QuantizedWeight(bits, n, k, group_size, data, scales, zeros)
    (tritune.kernels.quant_matmul.quant_matmul). ``scales`` may be pack_scale_zero's (G, N) int32 words
    (``zeros`` None): int4 scales and zero points that are views into one tensor travel as that tensor,
    since an op's inputs are separate tensors to torch (opcheck and AOT clone them one by one)."""
    if scales.dtype == torch.int32 and zeros is None:
        scales, zeros = _quant.scale_zero_views(scales)
    qw = _quant.QuantizedWeight(bits, n, k, group_size, data, scales, zeros)
    return _qmm.quant_matmul(x, qw, bias)


@quant_matmul.register_fake
def _(x, data, scales, zeros, bits, n, k, group_size, bias=None):
    _inner("x", x, "qw", k)
    return x.new_empty(_rows_times(x, n))


def quant_linear(x: Tensor, qw, bias: Optional[Tensor] = None) -> Tensor:
    """``torch.ops.tritune.quant_matmul`` on a QuantizedWeight (its fields unpacked)."""
    words = _quant.sz_words(qw)
    scales, zeros = (qw.scales, qw.zeros) if words is None else (words, None)
    return torch.ops.tritune.quant_matmul(x, qw.data, scales, zeros, qw.bits, qw.N, qw.K, qw.group_size, bias)


# ---------------------------------------------------------------------------------------------------
# FP8: the scaled GEMM, the per-token activation quantizer, prefill attention and the e4m3 paged cache.
# Outputs in e4m3 and their float32 scales are ordinary tensors to the dispatcher (float8 is a ScalarType).
_E4M3 = torch.float8_e4m3fn


def _two_dims(name: str, t: Tensor) -> None:
    torch._check(t.dim() == 2, lambda: f"{name}: expected 2 dims, got {t.dim()}")


@_op("fp8_gemm", ())
def fp8_gemm(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, bias: Optional[Tensor] = None,
             activation: str = "none", residual: Optional[Tensor] = None,
             out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """(a·a_scale) @ (b·b_scale) [+ bias] [GELU] [+ residual] of e4m3 a (M, K) and b (K, N)
    (tritune.kernels.fp8_gemm.fp8_gemm); the output (M, N) in ``out_dtype`` (bf16 or fp16)."""
    return _fp8_gemm.fp8_gemm(a, b, a_scale, b_scale, bias, activation=activation, residual=residual,
                              out_dtype=out_dtype)


def _fp8_product_fake(a, b, a_scale, b_scale, bias=None, activation="none", residual=None,
                      out_dtype=torch.bfloat16):
    """The fake of fp8_gemm and fp8_gemv (one product, two kernels): (M, N) in ``out_dtype``."""
    _two_dims("a", a)
    _two_dims("b", b)
    _inner("a", a, "b", b.shape[0])
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


fp8_gemm.register_fake(_fp8_product_fake)


@_op("fp8_gemv", ())
def fp8_gemv(a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, bias: Optional[Tensor] = None,
             activation: str = "none", residual: Optional[Tensor] = None,
             out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """fp8_gemm's product for at most 16 rows of a (decode) (tritune.kernels.fp8_gemv.fp8_gemv)."""
    return _fp8_gemv.fp8_gemv(a, b, a_scale, b_scale, bias, activation=activation, residual=residual,
                              out_dtype=out_dtype)


fp8_gemv.register_fake(_fp8_product_fake)


@_op("fp8_qgemv", ())
def fp8_qgemv(x: Tensor, b: Tensor, b_scale: Tensor, bias: Optional[Tensor] = None, norm: Optional[str] = None,
              norm_weight: Optional[Tensor] = None, eps: float = 1e-6, swiglu: bool = False,
              activation: str = "none", residual: Optional[Tensor] = None) -> Tensor:
    """fp8_quant of x's rows then fp8_gemv, in one launch (tritune.kernels.fp8_qgemv.fp8_qgemv); the output
    (M, N) in x's dtype. The launcher's ``norm`` tuple flattened: ``norm`` None or "rms" (norm_weight, eps)."""
    return _fp8_qgemv.fp8_qgemv(x, b, b_scale, bias, norm=None if norm is None else (norm, norm_weight, eps),
                                swiglu=swiglu, activation=activation, residual=residual)


@fp8_qgemv.register_fake
def _(x, b, b_scale, bias=None, norm=None, norm_weight=None, eps=1e-6, swiglu=False, activation="none",
      residual=None):
    _two_dims("x", x)
    _two_dims("b", b)
    _inner("x", x, "b", b.shape[0] * (2 if swiglu else 1))
    return x.new_empty((x.shape[0], b.shape[1]))


@_op("fp8_quant", ())
def fp8_quant(x: Tensor, norm: Optional[str] = None, norm_weight: Optional[Tensor] = None,
              norm_bias: Optional[Tensor] = None, eps: float = 1e-6, swiglu: bool = False) -> tuple[Tensor, Tensor]:
    """Per-row dynamic e4m3 quantization of x (M, N) -> (q (M, N) e4m3, scale (M,) float32)
    (tritune.kernels.fp8_quant.fp8_quant). The launcher's ``norm`` tuple flattened: ``norm`` None, "rms"
    (norm_weight, eps) or "layer" (norm_weight, norm_bias, eps); ``swiglu``: x is (M, 2N) [gate | up]."""
    if norm is None:
        spec = None
    else:
        spec = ("rms", norm_weight, eps) if norm == "rms" else (norm, norm_weight, norm_bias, eps)
    return _fp8_quant.fp8_quant(x, norm=spec, swiglu=swiglu)


@fp8_quant.register_fake
def _(x, norm=None, norm_weight=None, norm_bias=None, eps=1e-6, swiglu=False):
    _two_dims("x", x)
    n = x.shape[1] // 2 if swiglu else x.shape[1]
    return x.new_empty((x.shape[0], n), dtype=_E4M3), x.new_empty((x.shape[0],), dtype=torch.float32)


@_op("fp8_attention", ())
def fp8_attention(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor] = None,
                  k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None, causal: bool = False,
                  scale: Optional[float] = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Prefill attention over e4m3 (B, H, T, D) q, k, v with float32 descales (B, Hkv), (Hkv,) or None
    (tritune.kernels.fp8_attention.fp8_attention); the output (B, Hq, Tq, D) in ``out_dtype``."""
    return _fp8_attention.fp8_attention(q, k, v, q_descale, k_descale, v_descale, causal=causal, scale=scale,
                                        out_dtype=out_dtype)


@fp8_attention.register_fake
def _(q, k, v, q_descale=None, k_descale=None, v_descale=None, causal=False, scale=None, out_dtype=torch.bfloat16):
    torch._check(q.dim() == 4, lambda: f"q: expected 4 dims (B, H, T, D), got {q.dim()}")
    return q.new_empty(q.shape, dtype=out_dtype)


# the spec's name; the launcher is fp8_kv_write.fp8_write_kv. Every argument it writes is required (gemv_kv).
@_op("fp8_kv_write", ("k_cache", "v_cache", "k_scale", "v_scale"))
def fp8_kv_write(k: Tensor, v: Tensor, slot_mapping: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor,
                 v_scale: Tensor, validate: bool = True) -> None:
    """Quantize new tokens' K and V (T, Hkv, D) into the e4m3 paged caches (V's transposed within each
    block) and their per-(token, kv head) float32 scales at each token's slot, in place
    (tritune.kernels.fp8_kv_write.fp8_write_kv)."""
    _fp8_kv_write.fp8_write_kv(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, validate=validate)


@fp8_kv_write.register_fake
def _(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, validate=True):
    return None


@_op("fp8_paged_attention", ())
def fp8_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor, v_scale: Tensor,
                        block_tables: Tensor, context_lens: Tensor, scale: Optional[float] = None,
                        validate: bool = True) -> Tensor:
    """Decode attention over the e4m3 paged cache with per-token scales
    (tritune.kernels.fp8_paged_attention.fp8_paged_attention); the output (B, Hq, D) in q's dtype."""
    return _fp8_paged.fp8_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens,
                                          scale=scale, validate=validate)


@fp8_paged_attention.register_fake
def _(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale=None, validate=True):
    torch._check(q.dim() == 3, lambda: f"q: expected 3 dims (B, Hq, D), got {q.dim()}")
    return q.new_empty(q.shape)


# ---------------------------------------------------------------------------------------------------
# The Llama family's RMSNorm and rotary embedding. Each launcher returns one thing or a pair as its
# arguments ask (``residual``; ``kv``), an op one fixed schema: the pair forms are ops of their own.
@_op("rms_norm", ())
def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim (tritune.kernels.rms_norm.rms_norm). With the residual add: ``rms_norm_add``."""
    return _rms_norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight=None, eps=1e-6):
    return x.new_empty(x.shape)


@_op("rms_norm_add", ())
def rms_norm_add(x: Tensor, residual: Tensor, weight: Optional[Tensor] = None,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual): the residual add fused before the norm, the sum rounded to x's
    dtype (tritune.kernels.rms_norm.rms_norm with ``residual``)."""
    return _rms_norm.rms_norm(x, weight, eps, residual)


@rms_norm_add.register_fake
def _(x, residual, weight=None, eps=1e-6):
    torch._check(residual.shape == x.shape, lambda: f"residual: shape {tuple(residual.shape)} differs from x's")
    return x.new_empty(x.shape), x.new_empty(x.shape)


@_op("rotary", ())
def rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
           validate: bool = True) -> tuple[Tensor, Tensor]:
    """(q, k) (T, H, D) rotated by the angles of ``positions`` into new tensors (tritune.kernels.rotary.rotary);
    the fused paged-KV write is ``rotary_kv``."""
    return _rotary.rotary(q, k, cos, sin, positions, validate=validate)


@rotary.register_fake
def _(q, k, cos, sin, positions, validate=True):
    torch._check(q.dim() == 3 and k.dim() == 3, lambda: "q, k: expected 3 dims (T, H, D)")
    return q.new_empty(q.shape), k.new_empty(k.shape)


@_op("rotary_kv", ("k_cache", "v_cache"))
def rotary_kv(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor,
              slot_mapping: Tensor, v: Tensor, validate: bool = True) -> tuple[Tensor, Tensor]:
    """``rotary`` that also writes the rotated k and ``v`` to the paged caches (num_blocks, block_size, Hk, D)
    at each token's slot (< 0: skipped), in place; the launcher's ``kv`` tuple flattened."""
    return _rotary.rotary(q, k, cos, sin, positions, kv=(k_cache, v_cache, slot_mapping, v), validate=validate)


@rotary_kv.register_fake
def _(q, k, cos, sin, positions, k_cache, v_cache, slot_mapping, v, validate=True):
    torch._check(q.dim() == 3 and k.dim() == 3, lambda: "q, k: expected 3 dims (T, H, D)")
    return q.new_empty(q.shape), k.new_empty(k.shape)


# every op by name: what the tests iterate
OPS = {"layer_norm": layer_norm, "gemm": gemm, "gelu": gelu, "gemv": gemv, "gemv_kv": gemv_kv, "linear": linear,
       "attention": attention, "attention_varlen": attention_varlen, "paged_attention": paged_attention,
       "write_kv": write_kv, "quant_matmul": quant_matmul, "fp8_gemm": fp8_gemm, "fp8_gemv": fp8_gemv, "fp8_qgemv": fp8_qgemv,
       "fp8_quant": fp8_quant, "fp8_attention": fp8_attention, "fp8_kv_write": fp8_kv_write,
       "fp8_paged_attention": fp8_paged_attention, "rms_norm": rms_norm, "rms_norm_add": rms_norm_add,
       "rotary": rotary, "rotary_kv": rotary_kv}
