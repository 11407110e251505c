"""FP8 W8A8 linears as a load-time swap: weights in e4m3 with a float32 scale per output channel (or per
128x128 block, ``block=True``), activations quantized per token when the linear runs, the product on the
scaled FP8 GEMM with its epilogues (bias, GELU, residual).

``quantize_fp8(model)`` rounds every projection of every layer (GPT-2's qkv, attention out, MLP in/out;
Llama's qkv, o, gate/up, down) to nearest e4m3; embeddings, norms and the LM head stay dense, as in
Hugging Face's and vLLM's FP8 checkpoints (the head's logits are where the format's error shows most, and
it is one GEMM of many). ``with_fp8_weights(model, weights)`` runs weights quantized elsewhere (a loaded
FP8 checkpoint: :mod:`tritune.model.quant.fp8_hf`).

Where the model's forward hands a norm and the linear after it to ``ln_linear`` (GPT-2's ln_1/ln_2 before
the qkv and MLP-in projections) or to ``rms_linear`` (the Llama family's input and post-attention
RMSNorms), the norm is fused into the activation quantization (``fp8_quant``'s ``norm=``): the normalized
bf16 row never reaches memory. Elsewhere the activations are quantized as they come. Triton backend, fp16/bf16 activations: the kernels ``fp8_quant`` and ``fp8_gemm``; the torch backend
(and fp32 activations, which ``fp8_gemm`` does not output) computes the same quantized math in PyTorch with
``tritune.references.fp8``'s quantizers: rows scaled by max|row| / 448 and rounded to e4m3, the product of
the dequantized operands in float32.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, is_dataclass, replace

import torch
import torch.nn.functional as F

from tritune.references import fp8 as ref

E4M3 = torch.float8_e4m3fn
BLOCK = ref.BLOCK
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear's weight in e4m3. ``data`` (N, K): the ``nn.Linear`` layout FP8 checkpoints store (the GEMM
    reads it as its (K, N) transpose, K contiguous); ``scale`` float32: (N,) per output channel, or
    (ceil(N/128), ceil(K/128)) per 128x128 block (Hugging Face's ``weight_scale_inv``): w ≈ data · scale."""
    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != E4M3 or self.data.dim() != 2:
            raise TypeError(f"data: expected a 2-D float8_e4m3fn tensor, got {getattr(self.data, 'dtype', self.data)}")
        n, k = self.data.shape
        blocks = (-(-n // BLOCK), -(-k // BLOCK))
        if (not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32
                or tuple(self.scale.shape) not in ((n,), blocks)):
            raise ValueError(f"scale: expected float32 of shape ({n},) (per channel) or {blocks} (128x128 blocks), "
                             f"got {getattr(self.scale, 'dtype', None)} {tuple(getattr(self.scale, 'shape', ()))}")

    @property
    def N(self) -> int:
        return self.data.shape[0]

    @property
    def K(self) -> int:
        return self.data.shape[1]

    @property
    def block(self) -> bool:
        return self.scale.dim() == 2

    @property
    def shape(self) -> tuple:
        """The (K, N) shape of the dense weight it stands for (what the model's code reads)."""
        return (self.K, self.N)

    @property
    def b(self) -> torch.Tensor:
        """The (K, N) operand of ``fp8_gemm`` (a view)."""
        return self.data.t()

    @property
    def b_scale(self) -> torch.Tensor:
        """The scale in ``fp8_gemm``'s orientation: (N,), or (ceil(K/128), ceil(N/128)) (a view)."""
        return self.scale.t() if self.block else self.scale

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """The (K, N) weight the e4m3 values and scales stand for, computed in float32."""
        s = self.b_scale
        if self.block:
            s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: self.K, : self.N]
        return (self.data.t().float() * s).to(dtype)

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.data.to(device), self.scale.to(device))

    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()


def quantize_weight(w: torch.Tensor, block: bool = False) -> Fp8Weight:
    """A dense (K, N) weight (our layout) rounded to nearest e4m3, scales per channel or per block."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError(f"w: expected a 2-D tensor, got {type(w).__name__}")
    if block:
        q, s = ref.quantize_blocks(w.float())           # q (K, N), s (K/128, N/128)
        return Fp8Weight(q.t().contiguous(), s.t().contiguous())
    q, s = ref.quantize_channels(w.float())             # s (N,)
    return Fp8Weight(q.t().contiguous(), s.contiguous())


def linear_names(layer) -> tuple:
    """The projections of a layer: its 2-D ``w_*`` fields (norms and biases are 1-D)."""
    return tuple(f.name for f in fields(layer) if f.name.startswith("w_")
                 and isinstance(getattr(layer, f.name), (torch.Tensor, Fp8Weight))
                 and len(getattr(layer, f.name).shape) == 2)


def quantize_weights(w, block: bool = False):
    """A copy of a family's weights (GPT2Weights, LlamaWeights) with every layer's projections in FP8."""
    if not is_dataclass(w) or not hasattr(w, "layers"):
        raise TypeError(f"weights: expected a family's weights dataclass, got {type(w).__name__}")
    layers = [replace(L, **{k: quantize_weight(getattr(L, k), block) for k in linear_names(L)}) for L in w.layers]
    return replace(w, layers=layers)


def is_fp8_weights(w) -> bool:
    return any(isinstance(getattr(L, k), Fp8Weight) for L in getattr(w, "layers", ()) for k in linear_names(L))


def mode_of(weights) -> str | None:
    """"fp8" (per channel), "fp8-block" or None for dense weights."""
    ws = [getattr(L, k) for L in weights.layers for k in linear_names(L)]
    kinds = {x.block for x in ws if isinstance(x, Fp8Weight)}
    if not kinds:
        return None
    if len(kinds) > 1:
        raise ValueError("weights: FP8 linears with both per-channel and block scales")
    return "fp8-block" if kinds.pop() else "fp8"


# ---------------------------------------------------------------------------------------------------
def torch_quant_rows(x2: torch.Tensor):
    """``fp8_quant``'s math in PyTorch: per-row scale max|row| / 448 (float32), values rounded to e4m3."""
    return ref.quantize_rows(x2.float())


def torch_fp8_linear(q, s, w: Fp8Weight, b=None, activation=None, residual=None, out_dtype=torch.float32):
    """``fp8_gemm``'s math in PyTorch (float32): the dequantized activations times the dequantized weight."""
    y = (q.float() * s[:, None]) @ w.dequantize(torch.float32)
    if b is not None:
        y = y + b.float()
    if activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    if residual is not None:
        y = y + residual.reshape(y.shape).float()
    return y.to(out_dtype)


# decode steps of at most QGEMV_ROWS rows run fp8_qgemv (the per-token quantizer inside the GEMV, one launch a
# linear) instead of fp8_quant + fp8_gemv: on the H200 it is 0.98-1.47x the two launches at one row and
# 0.27-0.85x at eight (it re-reads the weight a row), so one row by default (docs/findings.md);
# TRITUNE_FP8_QGEMV=N sets the rows (0: never)
QGEMV_ENV = "TRITUNE_FP8_QGEMV"
QGEMV_ROWS = 1
GEMV_ROWS = 16  # decode steps of at most this many rows: fp8_gemv (reads the e4m3 weight once)


def qgemv_rows() -> int:
    """The most rows a decode step runs on fp8_qgemv: ``TRITUNE_FP8_QGEMV`` (0 to GEMV_ROWS), else QGEMV_ROWS."""
    raw = os.environ.get(QGEMV_ENV, "").strip()
    if not raw:
        return QGEMV_ROWS
    try:
        rows = int(raw)
    except ValueError:
        raise ValueError(f"{QGEMV_ENV}={raw!r}: expected a row count from 0 to {GEMV_ROWS}") from None
    if not 0 <= rows <= GEMV_ROWS:
        raise ValueError(f"{QGEMV_ENV}={raw!r}: expected a row count from 0 to {GEMV_ROWS}")
    return rows


class Fp8Ops:
    """A model's ops, with a linear whose weight is an :class:`Fp8Weight` run W8A8 (the rest delegated)."""

    def __init__(self, base, backend: str, mode: str = "fp8"):
        self.base, self.backend, self.quant = base, backend, mode
        self.steps = dict(getattr(base, "steps", {}))
        self.capturable = getattr(base, "capturable", False)
        if backend == "triton":
            from tritune.kernels.fp8_gemm import fp8_gemm
            from tritune.kernels.fp8_gemv import fp8_gemv
            from tritune.kernels.fp8_quant import fp8_quant

            self._quant, self._gemm, self._gemv = fp8_quant, fp8_gemm, fp8_gemv
            self.steps["linear"] = (f"{mode}: per-token kernel tritune.kernels.fp8_quant (the LayerNorm before "
                                    "it fused where the forward has one) + kernel tritune.kernels.fp8_gemm "
                                    f"(tritune.kernels.fp8_gemv for decode's <= {GEMV_ROWS} rows; bias, GELU, "
                                    "residual in their epilogue) for fp16/bf16 activations; fp32: the same "
                                    "quantized math in PyTorch")
            self._qgemv, self.qgemv_rows = None, qgemv_rows()
            if self.qgemv_rows:
                from tritune.kernels.fp8_qgemv import fp8_qgemv

                self._qgemv = fp8_qgemv
                self.steps["linear"] += (f"; at <= {self.qgemv_rows} rows kernel tritune.kernels.fp8_qgemv instead "
                                         f"(the quantizer inside the GEMV, one launch; {QGEMV_ENV}=0 turns it off)")
        else:
            self._quant = self._gemm = self._gemv = self._qgemv = None
            self.qgemv_rows = 0
            self.steps["linear"] = f"{mode}: per-token e4m3 activations x e4m3 weights, the quantized math in PyTorch"

    def __getattr__(self, name):
        # every other step (norms, rotary, attention, the KV write) is the base's
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def _kernels(self, x) -> bool:
        return self._gemm is not None and x.dtype in KERNEL_DTYPES

    def _fused(self, x, w) -> bool:
        """Whether fp8_qgemv takes this linear: decode steps of at most ``qgemv_rows`` rows on the kernels."""
        return (self._qgemv is not None and isinstance(w, Fp8Weight) and self._kernels(x)
                and x.numel() // x.shape[-1] <= self.qgemv_rows)

    def _qlinear(self, x, w: Fp8Weight, b=None, activation=None, residual=None, norm=None, swiglu=False):
        """fp8_qgemv: quantize x's rows (after ``norm``, or silu(g)·u with ``swiglu``) and multiply, one launch."""
        res = None if residual is None else residual.reshape(-1, w.N)
        y = self._qgemv(x.reshape(-1, x.shape[-1]), w.b, w.b_scale, b, norm=norm, swiglu=swiglu,
                        activation=activation or "none", residual=res)
        return y.reshape(*x.shape[:-1], w.N)

    def _run(self, q, s, x, w: Fp8Weight, b, activation, residual):
        lead = x.shape[:-1]
        if activation == "swiglu":      # on the [gate | up] output: not an fp8_gemm epilogue (N halves)
            y = self.base.swiglu(self._run(q, s, x, w, b, None, None))
            return y if residual is None else y + residual
        res = None if residual is None else residual.reshape(-1, w.N)
        if self._kernels(x):
            gemm = self._gemv if q.shape[0] <= GEMV_ROWS else self._gemm
            y = gemm(q, w.b, s, w.b_scale, b, activation=activation or "none", residual=res, out_dtype=x.dtype)
        else:
            y = torch_fp8_linear(q, s, w, b, activation, res, x.dtype)
        return y.reshape(*lead, w.N)

    def linear(self, x, w, b=None, activation=None, residual=None):
        if not isinstance(w, Fp8Weight):
            return self.base.linear(x, w, b, activation=activation, residual=residual)
        if self._fused(x, w) and activation != "swiglu":
            return self._qlinear(x, w, b, activation, residual)
        x2 = x.reshape(-1, x.shape[-1])
        q, s = self._quant(x2) if self._kernels(x) else torch_quant_rows(x2)
        return self._run(q, s, x, w, b, activation, residual)

    def ln_linear(self, x, ln_w, ln_b, eps, w, b=None, activation=None, kv=None):
        """linear(layer_norm(x)) with the LayerNorm fused into the activation quantization; the KV cache is
        never written here (returns (y, False)), so the caller's attention writes it."""
        if not isinstance(w, Fp8Weight):
            fused = getattr(self.base, "ln_linear", None)
            if fused is not None:
                return fused(x, ln_w, ln_b, eps, w, b, activation=activation, kv=kv)
            return self.base.linear(self.base.layer_norm(x, ln_w, ln_b, eps), w, b, activation=activation), False
        x2 = x.reshape(-1, x.shape[-1])
        if self._kernels(x):
            q, s = self._quant(x2, norm=("layer", ln_w, ln_b, eps))
        else:
            h = F.layer_norm(x2.float(), (x2.shape[-1],), None if ln_w is None else ln_w.float(),
                             None if ln_b is None else ln_b.float(), eps)
            q, s = torch_quant_rows(h)
        return self._run(q, s, x, w, b, activation, None), False


    def rms_mlp(self, x, norm_w, eps, w_gu, b_gu, w_down, b_down):
        """x + down(swiglu(gate_up(rms_norm(x)))) (the Llama family's hook): with both weights e4m3 and the
        kernels in use, the SwiGLU runs inside the down projection's activation quantization
        (``fp8_quant(swiglu=True)``), so silu(g)·u never reaches memory in bf16; otherwise the steps."""
        if not (isinstance(w_gu, Fp8Weight) and isinstance(w_down, Fp8Weight) and self._kernels(x)):
            f = self.rms_linear(x, norm_w, eps, w_gu, b_gu, activation="swiglu")
            return self.linear(f, w_down, b_down, residual=x)
        if self._fused(x, w_gu):
            gu = self._qlinear(x, w_gu, b_gu, norm=("rms", norm_w, eps))
            return self._qlinear(gu, w_down, b_down, residual=x, swiglu=True)
        x2 = x.reshape(-1, x.shape[-1])
        gu = self._run(*self._quant(x2, norm=("rms", norm_w, eps)), x, w_gu, b_gu, None, None)
        q, s = self._quant(gu.reshape(-1, w_gu.N), swiglu=True)
        return self._run(q, s, x, w_down, b_down, None, x)

    def rms_linear(self, x, norm_w, eps, w, b=None, activation=None):
        """linear(rms_norm(x)) (the Llama family's hook), the RMSNorm fused into the activation quantization;
        ``activation`` None or "swiglu" (``w`` the [gate | up] weight), applied to the GEMM's output."""
        if not isinstance(w, Fp8Weight):
            if hasattr(type(self.base), "rms_linear"):
                return self.base.rms_linear(x, norm_w, eps, w, b, activation=activation)
            y = self.base.linear(self.base.rms_norm(x, norm_w, eps), w, b)
            return self.base.swiglu(y) if activation == "swiglu" else y
        if self._fused(x, w):
            y = self._qlinear(x, w, b, norm=("rms", norm_w, eps))
            return self.base.swiglu(y) if activation == "swiglu" else y
        x2 = x.reshape(-1, x.shape[-1])
        if self._kernels(x):
            q, s = self._quant(x2, norm=("rms", norm_w, eps))
        else:
            h = x2.float() * torch.rsqrt(x2.float().pow(2).mean(-1, keepdim=True) + eps)
            q, s = torch_quant_rows(h if norm_w is None else h * norm_w.float())
        return self._run(q, s, x, w, b, activation, None)


def with_fp8_weights(model, weights):
    """``model`` on ``weights`` whose projections are :class:`Fp8Weight`, with ops that run them."""
    mode = mode_of(weights)
    if mode is None:
        raise ValueError("weights: no linear is an Fp8Weight")
    base = model.ops.base if isinstance(model.ops, Fp8Ops) else model.ops
    return model.with_weights(weights, ops=Fp8Ops(base, model.backend, mode))


def quantize_model(model, block: bool = False):
    """``model`` with every layer's projections in FP8 (per-channel scales, or 128x128 blocks)."""
    return with_fp8_weights(model, quantize_weights(model.w, block))


def is_fp8(model) -> bool:
    """Whether the model's ops (or the ops they wrap, as ``base``) run FP8 linears."""
    ops = model.ops
    while ops is not None:
        if isinstance(ops, Fp8Ops):
            return True
        ops = vars(ops).get("base") if hasattr(ops, "__dict__") else None
    return False
