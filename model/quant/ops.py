"""Weight-only quantization as a load-time swap: a model whose linears hold
:class:`~tritune.references.quant.QuantizedWeight` and whose ops run them; nothing downstream branches on it.

``quantize_model(model, "int4", group_size=128)`` rounds every linear (qkv, attention out, MLP in/out and
the tied lm_head) to nearest; ``with_quantized_weights(model, weights)`` takes weights quantized elsewhere
(GPTQ, AWQ: any GPT2Weights whose linears are QuantizedWeight). Embeddings and LayerNorms stay dense.
fp16/bf16 activations run ``tritune.kernels.quant_matmul.quant_linear``; fp32 dequantizes to fp32 and
runs a dense matmul (the kernel takes half-precision activations only), and so does any dtype on the torch
backend (the reference path: its ops say ``quant_kernel = False``; on a CPU the kernel would run through
Triton's interpreter, ~100x slower).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from tritune.kernels.quant_matmul import quant_linear
from tritune.references import quant as Q

QUANT_MODES = (None, "int8", "int4", "fp8")   # fp8: W8A8, tritune.model.quant.fp8
LINEARS = ("w_qkv", "w_o", "w_fc", "w_proj")   # GPT-2's; a family's weights module lists its own


def linears_of(weights) -> tuple:
    """The projections a weight-only swap quantizes: ``LINEARS`` of the module defining ``weights``' class
    (``tritune.model.gpt2.weights``, ``tritune.model.llama.weights``), GPT-2's where it lists none."""
    import sys

    return getattr(sys.modules.get(type(weights).__module__), "LINEARS", LINEARS)


class QuantOps:
    """A model's ops, with a linear whose weight is a QuantizedWeight run weight-only quantized."""

    def __init__(self, base, mode: str):
        self.base, self.quant = base, mode
        self.attn_prefill, self.write_kv, self.attn_decode = base.attn_prefill, base.write_kv, base.attn_decode
        self.steps = dict(getattr(base, "steps", {}))
        self.capturable = getattr(base, "capturable", False)
        self.kernel = getattr(base, "quant_kernel", True)
        self.steps["linear"] = (f"{mode}: kernel tritune.kernels.quant_matmul.quant_linear for fp16/bf16 "
                                "activations (fp32: dequantize + dense matmul)" if self.kernel else
                                f"{mode}: dequantize + dense matmul in the activations' dtype")

    def linear(self, x, w, b=None, activation=None, residual=None):
        if not isinstance(w, Q.QuantizedWeight):
            return self.base.linear(x, w, b, activation=activation, residual=residual)
        x2 = x.reshape(-1, x.shape[-1])
        if self.kernel and x.dtype in (torch.float16, torch.bfloat16):   # the kernel's dtypes
            y = quant_linear(x2, w, b)
        else:
            wd = w.dequantize(torch.float32).to(x.dtype).t()
            y = torch.mm(x2, wd) if b is None else torch.addmm(b, x2, wd)
        if activation == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        elif activation == "swiglu":   # a [gate | up] projection (the Llama family's MLP)
            f = y.shape[-1] // 2
            y = F.silu(y[:, :f]) * y[:, f:]
        if residual is not None:
            y = y + residual.reshape(y.shape)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def __getattr__(self, name):
        # the family's other steps (layer_norm; rms_norm, rotary, swiglu) are the base ops'; never a fused
        # norm + linear of theirs (ln_linear, rms_linear), which would run the quantized weight as dense
        if name == "base" or "linear" in name:
            raise AttributeError(name)
        return getattr(self.base, name)


def check_mode(quant) -> None:
    if quant not in QUANT_MODES:
        raise ValueError(f"quant: expected one of {QUANT_MODES}, got {quant!r}")


def quantize_weights(w, quant: str, group_size: int = 128):
    """A copy of a family's weights (GPT2Weights, LlamaWeights) with every linear weight (:func:`linears_of`)
    and the LM head rounded to nearest (embeddings and norms kept).

    Our projections are stored (K, N) for gemm; the quantizers take the nn.Linear (N, K) layout, hence .t().
    """
    check_mode(quant)
    if quant not in ("int8", "int4"):
        raise ValueError(f"quant: {quant!r} is not weight-only (fp8: tritune.model.quant.fp8.quantize_weights)")
    bits = {"int8": 8, "int4": 4}[quant]
    if bits == 4 and group_size not in Q.INT4_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {Q.INT4_GROUP_SIZES}, got {group_size!r}")

    def q(t):
        K = t.shape[0]
        g = group_size
        if bits == 4 and K % g:   # a narrow model: the largest supported group that divides K
            g = Q.group_for(K, group_size)
            if g is None:
                raise ValueError(f"int4: K={K} is not a multiple of any group size in {Q.INT4_GROUP_SIZES}")
        return Q.quantize(t.t().contiguous(), bits, g)

    layers = [replace(L, **{k: q(getattr(L, k)) for k in linears_of(w)}) for L in w.layers]
    return replace(w, layers=layers, lm_head=q(w.lm_head))


def mode_of(weights) -> str | None:
    """"int8" or "int4" when the weights' linears are quantized, None when they are dense."""
    qws = [getattr(L, k) for L in weights.layers for k in linears_of(weights)] + [weights.lm_head]
    bits = {qw.bits for qw in qws if isinstance(qw, Q.QuantizedWeight)}
    if not bits:
        return None
    if len(bits) > 1:
        raise ValueError(f"weights: linears of mixed bit widths {sorted(bits)}")
    return f"int{bits.pop()}"


def with_quantized_weights(model, weights):
    """``model`` (any family's) on ``weights`` (its weights whose linears are QuantizedWeight, from any
    quantizer), with ops that run them. The caller's model is left as it is."""
    mode = mode_of(weights)
    if mode is None:
        raise ValueError("weights: no linear is a QuantizedWeight")
    base = model.ops.base if isinstance(model.ops, QuantOps) else model.ops
    return model.with_weights(weights, ops=QuantOps(base, mode))


def quantize_model(model, quant: str, group_size: int = 128, fp8_block: bool = False):
    """``model`` with every linear weight-only quantized (round to nearest; see :func:`quantize_weights`);
    ``quant="fp8"``: W8A8 e4m3, per-channel weight scales or 128x128 blocks (``fp8_block``)."""
    if quant == "fp8":
        from tritune.model.quant import fp8

        return fp8.quantize_model(model, fp8_block)
    return with_quantized_weights(model, quantize_weights(model.w, quant, group_size))


def is_quantized(model) -> bool:
    """Whether the model runs quantized linears (weight-only INT8/INT4, or FP8 W8A8)."""
    from tritune.model.quant import fp8

    ops = model.ops
    while ops is not None:      # under wrappers that keep the ops they wrap as ``base`` (the FP8 KV cache's)
        if isinstance(ops, (QuantOps, fp8.Fp8Ops)):
            return True
        ops = vars(ops).get("base") if hasattr(ops, "__dict__") else None
    return False
