"""GPTQ and AWQ checkpoints in the Hugging Face layout: written from, and repacked at load into, tritune's
INT4/INT8 :class:`~tritune.references.quant.QuantizedWeight`.

A quantized checkpoint is a GPT-2 directory whose ``config.json`` has a ``quantization_config`` and whose
linears (``transformer.h.{i}.attn.c_attn`` ..., ``lm_head`` when ``"lm_head": true``) hold, instead of
``weight``, the tensors below (W is the ``nn.Linear`` (N, K) weight; GPT-2's Conv1D modules are
transposed to it, as AutoGPTQ does)::

  GPTQ ("quant_method": "gptq"; packs along K)
    qweight  int32 (K·b/32, N)    word r of column n: k = r·(32/b) + i at bits [b·i, b·i + b)
    qzeros   int32 (G, N·b/32)    word c of row j: zero of n = c·(32/b) + i at bits [b·i, b·i + b)
    scales   (G, N)               w[n, k] = (q[n, k] − zero[g_idx[k], n]) · scales[g_idx[k], n]
    g_idx    int32 (K,)           group of column k: k // group_size, or any assignment (act-order)
  "checkpoint_format": "gptq" (v1, AutoGPTQ's and transformers' format) stores zero − 1 (its kernels add
  the 1 back); "gptq_v2" (GPTQModel) stores the zero itself. v1 cannot hold a zero point of 0 (it would
  be −1; AutoGPTQ's packing corrupts the neighbouring nibbles there), so the writer picks v1 when every
  zero point is >= 1 (always so for symmetric groups) and v2 otherwise (``checkpoint_format="auto"``).
  Both are read; a v1 file whose stored nibble is 15 means zero 16, which tritune's 0..15 cannot hold:
  a ValueError names the tensor.

  AWQ ("quant_method": "awq", "version": "gemm"; 4-bit; packs along N, interleaved)
    qweight  int32 (K, N/8)       word c of row k: nibble i holds n = 8c + AWQ_ORDER[i]
    qzeros   int32 (G, N/8)       the same interleave; zero points stored as they are
    scales   (G, N)               w[n, k] = (q − zero) · scales[k // group_size, n]

Repacking into tritune's layout: INT4 codes into half-group panels, scales (bf16) and zero points into
group-major words; INT8 (GPTQ 8-bit, symmetric, one group a row: zero 128) into int8 codes q − 128 with
float32 scales. A checkpoint group of gc columns becomes gc / g tritune groups of g (the largest of 128,
64, 32 dividing gc) with repeated parameters, which is exact. Act-order ``g_idx`` that is not ``k // g``:
the columns are sorted by group (each group must then be g consecutive columns, as GPTQ's act-order
gives), and the weight carries the permutation: the activations' columns are gathered in that order
before the kernel (:class:`ActOrderWeight`, run by :func:`quant_ops`). Exact as well.

Scales: tritune's INT4 scales are bf16. The writer stores them as float16 when that is exact (every bf16
value in fp16's normal range is), else as bf16; a foreign fp16 scale that bf16 cannot hold is rounded to
bf16 at load (at most 2^-9 relative: a fraction of the INT4 step) and the loader warns how many were.
INT8 scales are float32 in tritune and written as float32.

What is refused, with the key named: other quant_methods, bits other than 4 and 8, AWQ versions other
than gemm, INT8 with groups or zero points other than 128, groups that no supported g divides.
"""
from __future__ import annotations

import functools
import json
import shutil
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tritune.references import quant as Q

HF_LINEARS = {"w_qkv": "attn.c_attn", "w_o": "attn.c_proj", "w_fc": "mlp.c_fc", "w_proj": "mlp.c_proj"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)            # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
FORMATS = ("gptq", "awq")
COPY_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "generation_config.json")


# ---------------------------------------------------------------------------------------------------
# Bit packing (int64 arithmetic, stored as int32 words)
# ---------------------------------------------------------------------------------------------------
def _check_range(v: torch.Tensor, bits: int) -> None:
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"pack: values must lie in the {bits}-bit range [0, {(1 << bits) - 1}]")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, C) values in [0, 2^bits) -> (R·bits/32, C) int32: word r of column c holds rows r·p + i."""
    p = 32 // bits
    R, C = v.shape
    if R % p:
        raise ValueError(f"pack: {R} rows is not a multiple of {p}")
    _check_range(v, bits)
    v = v.to(torch.int64).view(R // p, p, C)
    shifts = (bits * torch.arange(p, dtype=torch.int64)).view(1, p, 1)
    return _to_int32((v << shifts).sum(dim=1))


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: (R', C) int32 -> (R'·32/bits, C) int64."""
    p = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = (bits * torch.arange(p, dtype=torch.int64)).view(1, p, 1)
    return ((w[:, None, :] >> shifts) & ((1 << bits) - 1)).reshape(-1, words.shape[1])


def pack_cols(v: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """(R, C) -> (R, C·bits/32) int32: word c holds columns c·p + order[i] at nibble i (order: identity)."""
    p = 32 // bits
    R, C = v.shape
    if C % p:
        raise ValueError(f"pack: {C} columns is not a multiple of {p}")
    _check_range(v, bits)
    v = v.to(torch.int64).view(R, C // p, p)
    if order is not None:
        v = v[:, :, list(order)]
    shifts = (bits * torch.arange(p, dtype=torch.int64)).view(1, 1, p)
    return _to_int32((v << shifts).sum(dim=2))


def unpack_cols(words: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    p = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = (bits * torch.arange(p, dtype=torch.int64)).view(1, 1, p)
    v = (w[:, :, None] >> shifts) & ((1 << bits) - 1)     # (R, C/p, p): nibble i
    if order is not None:
        inv = [0] * p
        for i, col in enumerate(order):
            inv[col] = i
        v = v[:, :, inv]                                     # column j is at nibble inv[j]
    return v.reshape(words.shape[0], -1)


# ---------------------------------------------------------------------------------------------------
# Act-order weights: a QuantizedWeight over permuted input columns
# ---------------------------------------------------------------------------------------------------
@dataclass
class ActOrderWeight:
    """y = x[..., perm] @ dequant(qw)ᵀ: ``qw`` holds the columns of W in the order ``perm`` (K,)."""
    qw: Q.QuantizedWeight
    perm: torch.Tensor

    def nbytes(self) -> int:
        return self.qw.nbytes() + self.perm.numel() * self.perm.element_size()

    def to(self, device) -> "ActOrderWeight":
        return ActOrderWeight(self.qw.to(device), self.perm.to(device))

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        d = self.qw.dequantize(dtype)
        out = torch.empty_like(d)
        out[:, self.perm.long()] = d
        return out


@functools.lru_cache(maxsize=None)
def _quant_ops_class():
    from tritune.model.quant.ops import QuantOps

    class PermutedOps(QuantOps):
        """QuantOps (the load-time swap's ops) that also run :class:`ActOrderWeight` linears: the
        activations' columns gathered in the weight's order, then the quantized linear as usual."""

        def linear(self, x, w, b=None, activation=None, residual=None):
            if isinstance(w, ActOrderWeight):
                x, w = x.index_select(-1, w.perm), w.qw
            if isinstance(w, Q.QuantizedWeight) and not x.is_cuda and x.dtype != torch.float32:
                # off the GPU quant_matmul would run in the Triton interpreter (hours for a perplexity):
                # the reference path, dequantized to the activations' dtype, as QuantOps does for fp32
                wd = w.dequantize(torch.float32).to(x.dtype).t()
                x2 = x.reshape(-1, x.shape[-1])
                y = torch.mm(x2, wd) if b is None else torch.addmm(b, x2, wd)
                y = y.reshape(*x.shape[:-1], y.shape[-1])
                if activation == "gelu_tanh":
                    y = torch.nn.functional.gelu(y, approximate="tanh")
                return y if residual is None else y + residual.reshape(y.shape)
            return super().linear(x, w, b, activation=activation, residual=residual)

    return PermutedOps


# ---------------------------------------------------------------------------------------------------
# QuantizedWeight <-> one module's tensors
# ---------------------------------------------------------------------------------------------------
def _scale_tensor(s_bf16: torch.Tensor) -> torch.Tensor:
    """bf16 scales as float16 when that is exact, else as they are."""
    h = s_bf16.to(torch.float16)
    return h if torch.equal(h.to(torch.bfloat16), s_bf16) and torch.isfinite(h).all() else s_bf16


def to_hf(qw: Q.QuantizedWeight, fmt: str, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """One linear's tensors in ``fmt`` ("gptq" or "awq"); ``checkpoint_format`` "gptq" (v1) or "gptq_v2"."""
    qw = qw.to("cpu")
    N, K = qw.N, qw.K
    codes = qw.codes().to(torch.int64)
    if qw.bits == 8:
        if fmt != "gptq":
            raise ValueError("fmt: an INT8 weight is written in the gptq format (awq is 4-bit)")
        zeros = torch.full((1, N), 128, dtype=torch.int64)
        return {"qweight": pack_rows((codes + 128).t(), 8),
                "qzeros": pack_cols(zeros - (1 if checkpoint_format == "gptq" else 0), 8),
                "scales": qw.scales.to(torch.float32)[None, :].contiguous(),
                "g_idx": torch.zeros(K, dtype=torch.int32)}
    zeros = qw.zeros.t().to(torch.int64)          # (G, N)
    scales = _scale_tensor(qw.scales.t().contiguous())
    if fmt == "awq":
        return {"qweight": pack_cols(codes.t(), 4, AWQ_ORDER), "qzeros": pack_cols(zeros, 4, AWQ_ORDER),
                "scales": scales}
    if checkpoint_format == "gptq":
        if int(zeros.min()) < 1:
            raise ValueError("checkpoint_format: gptq (v1) stores zero − 1 and cannot hold a zero point of 0; "
                             "use gptq_v2")
        zeros = zeros - 1
    return {"qweight": pack_rows(codes.t(), 4), "qzeros": pack_cols(zeros, 4), "scales": scales,
            "g_idx": (torch.arange(K) // qw.group_size).to(torch.int32)}


def from_hf(t: dict[str, torch.Tensor], qcfg: dict, N: int, K: int, name: str):
    """One linear's checkpoint tensors -> QuantizedWeight (or ActOrderWeight for a permuting g_idx)."""
    method, bits = qcfg["quant_method"], qcfg["bits"]
    for key in ("qweight", "qzeros", "scales"):
        if key not in t:
            raise ValueError(f"{name}.{key}: missing from the checkpoint")
    s = t["scales"]
    # The group count comes from the scales: a narrow linear (K below the configured group size) is
    # quantized with a smaller group that divides its K, as the engine's int4 mode does.
    if s.dim() != 2 or s.shape[1] != N or s.shape[0] < 1 or K % s.shape[0]:
        raise ValueError(f"{name}.scales: expected shape (G, {N}) with G dividing K={K}, got {tuple(s.shape)}")
    G = s.shape[0]
    gc = K // G
    if method == "awq":
        codes = unpack_cols(t["qweight"], 4, AWQ_ORDER)          # (K, N)
        zeros = unpack_cols(t["qzeros"], 4, AWQ_ORDER)           # (G, N)
        g_idx = None
    else:
        codes = unpack_rows(t["qweight"], bits)[:K]              # (K, N)
        zeros = unpack_cols(t["qzeros"], bits)[:, :N]
        if qcfg.get("checkpoint_format", "gptq") == "gptq":
            zeros = zeros + 1
        g_idx = t.get("g_idx")
    if tuple(codes.shape) != (K, N):
        raise ValueError(f"{name}.qweight: unpacks to {tuple(codes.shape)}, expected {(K, N)}")
    if tuple(zeros.shape) != (G, N):
        raise ValueError(f"{name}.qzeros: unpacks to {tuple(zeros.shape)}, expected {(G, N)}")
    codes, zeros = codes.t().contiguous(), zeros.t().contiguous()   # (N, K), (N, G)

    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if tuple(g_idx.shape) != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
            raise ValueError(f"{name}.g_idx: expected (K,) = ({K},) group ids in [0, {G})")
        if not torch.equal(g_idx, torch.arange(K) // gc):
            if not torch.equal(torch.bincount(g_idx, minlength=G), torch.full((G,), gc)):
                raise ValueError(f"{name}.g_idx: groups of unequal size; tritune needs {gc} columns a group")
            perm = torch.argsort(g_idx, stable=True)
            codes = codes[:, perm]            # now group j is columns j·gc .. (j+1)·gc − 1

    if bits == 8:
        if G != 1:
            raise ValueError(f"{name}: tritune's INT8 is per output channel; quantization_config.group_size "
                             f"must be -1 (or K), got {qcfg.get('group_size')}")
        if not torch.equal(zeros, torch.full_like(zeros, 128)):
            raise ValueError(f"{name}.qzeros: tritune's INT8 is symmetric (zero point 128); this checkpoint "
                             "has others")
        q = codes - 128
        if int(q.min()) < -Q.INT8_QMAX:
            raise ValueError(f"{name}.qweight: code -128 has no INT8 counterpart in [-127, 127]")
        qw = Q.QuantizedWeight(8, N, K, K, q.to(torch.int8).contiguous(),
                               s[0].to(torch.float32).contiguous(), None)
    else:
        if int(zeros.max()) > Q.INT4_QMAX:
            raise ValueError(f"{name}.qzeros: a zero point of {int(zeros.max())} (a v1 checkpoint's stored 15 "
                             "is zero 16): outside tritune's 0..15")
        g = next((c for c in sorted(Q.INT4_GROUP_SIZES, reverse=True) if gc % c == 0), None)
        if g is None:
            raise ValueError(f"{name}: group_size {gc} is not a multiple of any of {Q.INT4_GROUP_SIZES}")
        sb = s.t().to(torch.bfloat16)
        if s.dtype != torch.bfloat16 and not torch.equal(sb.to(s.dtype), s.t()):
            n = int((sb.to(s.dtype) != s.t()).sum())
            warnings.warn(f"{name}.scales: {n} of {s.numel()} {s.dtype} scales rounded to bf16", stacklevel=2)
        rep = gc // g
        sb = sb.repeat_interleave(rep, dim=1).contiguous()
        zeros = zeros.repeat_interleave(rep, dim=1).to(torch.uint8).contiguous()
        data = Q.to_panels(Q.pack_int4(codes.to(torch.uint8), g), g)
        scales, zp = Q.scale_zero_views(Q.pack_scale_zero(sb, zeros))
        qw = Q.QuantizedWeight(4, N, K, g, data, scales, zp)
    qw.validate()
    return qw if perm is None else ActOrderWeight(qw, perm)


# ---------------------------------------------------------------------------------------------------
# Whole checkpoints
# ---------------------------------------------------------------------------------------------------
def _is_quant(w) -> bool:
    return isinstance(w, (Q.QuantizedWeight, ActOrderWeight))


def save(out, weights, config_dict: dict, qcfg: dict, *, src_dir=None, checkpoint_format: str = "auto",
         dtype: torch.dtype = torch.float16) -> Path:
    """Write a quantized GPT2Weights as an HF checkpoint: config.json (+ ``quantization_config``),
    model.safetensors, and the tokenizer / generation config of ``src_dir``. Dense tensors in ``dtype``.
    ``qcfg``: at least quant_method ("gptq" | "awq"), bits, group_size; the rest is filled in."""
    from safetensors.torch import save_file

    fmt = qcfg["quant_method"]
    if fmt not in FORMATS:
        raise ValueError(f"quant_method: expected one of {FORMATS}, got {fmt!r}")
    qs = [getattr(L, k) for L in weights.layers for k in HF_LINEARS]
    head_q = _is_quant(weights.lm_head)
    if head_q:
        qs.append(weights.lm_head)
    if not all(isinstance(q, Q.QuantizedWeight) for q in qs):
        raise TypeError("weights: every linear must be a QuantizedWeight to be written")
    if checkpoint_format == "auto":
        v1 = all(q.bits == 8 or int(q.zeros.min()) >= 1 for q in qs)
        checkpoint_format = "gptq" if v1 else "gptq_v2"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    def dense(t):
        return t.detach().to("cpu", dtype).contiguous()

    state = {"transformer.wte.weight": dense(weights.wte), "transformer.wpe.weight": dense(weights.wpe),
             "transformer.ln_f.weight": dense(weights.lnf_w), "transformer.ln_f.bias": dense(weights.lnf_b)}
    for i, L in enumerate(weights.layers):
        h = f"transformer.h.{i}."
        state.update({h + "ln_1.weight": dense(L.ln1_w), h + "ln_1.bias": dense(L.ln1_b),
                      h + "ln_2.weight": dense(L.ln2_w), h + "ln_2.bias": dense(L.ln2_b)})
        for k, mod in HF_LINEARS.items():
            for tn, t in to_hf(getattr(L, k), fmt, checkpoint_format).items():
                state[h + f"{mod}.{tn}"] = t.contiguous()
            state[h + f"{mod}.bias"] = dense(getattr(L, "b" + k[1:]))
    if head_q:
        for tn, t in to_hf(weights.lm_head, fmt, checkpoint_format).items():
            state[f"lm_head.{tn}"] = t.contiguous()
    elif not torch.equal(weights.lm_head, weights.wte.t()):
        state["lm_head.weight"] = dense(weights.lm_head.t())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    cfg = dict(config_dict)
    q = dict(qcfg)
    bits = q["bits"]
    if fmt == "gptq":
        q.setdefault("sym", True)
        q.setdefault("desc_act", False)
        q["checkpoint_format"] = checkpoint_format
        if bits == 8:
            q["group_size"] = -1
    else:
        q.setdefault("zero_point", True)
        q["version"] = "gemm"
    q["lm_head"] = head_q
    cfg["quantization_config"] = q
    # a quantized lm_head is no longer the embedding
    cfg["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True)) and not head_q \
        and "lm_head.weight" not in state
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if src_dir is not None:
        for f in COPY_FILES:
            if (Path(src_dir) / f).is_file():
                shutil.copyfile(Path(src_dir) / f, out / f)
    return out


def quantization_config(directory) -> dict | None:
    """The checkpoint's ``quantization_config`` (None when it is not quantized)."""
    f = Path(directory) / "config.json"
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
    except ValueError:
        return None
    q = d.get("quantization_config") if isinstance(d, dict) else None
    return q if isinstance(q, dict) else None


def check_qcfg(q: dict, source: str) -> None:
    method = q.get("quant_method")
    if method not in FORMATS:
        raise ValueError(f"{source}: quantization_config.quant_method {method!r} is not supported "
                         f"(supported: {', '.join(FORMATS)})")
    bits = q.get("bits")
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"{source}: quantization_config.bits={bits!r} is not supported for {method}")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{source}: quantization_config.version={q.get('version')!r}: only AWQ's gemm packing "
                         "is supported")
    if method == "gptq" and q.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"{source}: quantization_config.checkpoint_format={q.get('checkpoint_format')!r} is not "
                         "supported (gptq, gptq_v2)")


def load(directory, dtype: torch.dtype = torch.float32, device="cpu"):
    """(GPT2Config, GPT2Weights with quantized linears, directory) from a GPTQ/AWQ HF checkpoint."""
    from tritune.model.gpt2 import weights as W
    from tritune.model.gpt2.config import GPT2Config

    directory = W.resolve(directory)
    q = quantization_config(directory)
    if q is None:
        raise ValueError(f"{directory}: config.json has no quantization_config")
    check_qcfg(q, str(directory / "config.json"))
    cfg_dict = json.loads((directory / "config.json").read_text())
    cfg_dict["tie_word_embeddings"] = True        # the embedding is read as wte either way
    c = GPT2Config.from_dict(cfg_dict, str(directory / "config.json"))
    state = W.load_state_dict(directory)
    E, Fd = c.n_embd, c.d_mlp
    shapes = {"w_qkv": (3 * E, E), "w_o": (E, E), "w_fc": (Fd, E), "w_proj": (E, Fd)}

    def dense(name, shape=None):
        if name not in state:
            raise ValueError(f"{directory}: tensor {name!r} is missing")
        t = state[name]
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{directory}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=device, dtype=dtype).contiguous()

    def linear(prefix, N, K):
        t = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
        return from_hf(t, q, N, K, prefix).to(device)

    layers = []
    for i in range(c.n_layer):
        h = f"h.{i}."
        kw = {}
        for k, mod in HF_LINEARS.items():
            N, K = shapes[k]
            kw[k] = linear(h + mod, N, K)
            kw["b" + k[1:]] = dense(h + mod + ".bias", (N,))
        layers.append(W.LayerWeights(ln1_w=dense(h + "ln_1.weight", (E,)), ln1_b=dense(h + "ln_1.bias", (E,)),
                                     ln2_w=dense(h + "ln_2.weight", (E,)), ln2_b=dense(h + "ln_2.bias", (E,)),
                                     **kw))
    wte = dense("wte.weight", (c.vocab_size, E))
    if "lm_head.qweight" in state:
        head = linear("lm_head", c.vocab_size, E)
    elif "lm_head.weight" in state:
        head = dense("lm_head.weight", (c.vocab_size, E)).t().contiguous()
    else:
        head = wte.t()
    w = W.GPT2Weights(wte=wte, wpe=dense("wpe.weight", (c.n_positions, E)), layers=layers,
                      lnf_w=dense("ln_f.weight", (E,)), lnf_b=dense("ln_f.bias", (E,)), lm_head=head)
    return c, w, directory


# ---------------------------------------------------------------------------------------------------
# Installing quantized weights into a model
# ---------------------------------------------------------------------------------------------------
def mode_of(weights) -> str:
    """"int4" or "int8": the bit width every quantized linear of ``weights`` shares."""
    qws = [getattr(L, k) for L in weights.layers for k in HF_LINEARS] + [weights.lm_head]
    bits = {(q.qw if isinstance(q, ActOrderWeight) else q).bits for q in qws if _is_quant(q)}
    if len(bits) != 1:
        raise ValueError(f"weights: expected quantized linears of one bit width, got {sorted(bits) or 'none'}")
    return f"int{bits.pop()}"


def quant_ops(base, mode: str):
    """``base`` ops running QuantizedWeight linears (tritune.model.quant.ops.QuantOps) and ActOrderWeight ones."""
    return _quant_ops_class()(base, mode)


def install(model, weights):
    """GPT2 ``model`` on quantized ``weights``, through the load-time swap of :mod:`tritune.model.quant.ops`
    (its QuantOps, extended to act-order weights). The caller's model is left as it is."""
    from tritune.model.quant.ops import QuantOps

    base = model.ops.base if isinstance(model.ops, QuantOps) else model.ops
    return model.with_weights(weights, ops=quant_ops(base, mode_of(weights)))


def load_model(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """A GPT2 running a GPTQ/AWQ checkpoint's weights, repacked into tritune's layout."""
    from tritune.model.gpt2.model import GPT2, default_device, ops_for

    ops_for(backend)
    if device is None:
        device = default_device(backend)
    c, w, d = load(directory, dtype, device)
    model = GPT2(c, w, backend=backend, directory=d)
    return install(model, w)
