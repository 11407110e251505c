"""FP8 checkpoints in Hugging Face's layout (transformers' ``FineGrainedFP8`` / DeepSeek-V3's): written by
``tritune quantize --method fp8``, read by ``tritune generate --model DIR`` (and by Hugging Face for the
families it runs in FP8: Llama, Qwen, Mistral).

``config.json`` gains ``quantization_config``::

  {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
   "modules_to_not_convert": ["lm_head"]}

and each projection ``<module>`` holds, instead of a dense ``weight``:

  weight            float8_e4m3fn (N, K)             the ``nn.Linear`` layout (GPT-2's Conv1D modules
                                                     transposed to it, as for GPTQ checkpoints)
  weight_scale_inv  float32 (ceil(N/128), ceil(K/128))  w[n, k] ≈ weight[n, k] · weight_scale_inv[n//128, k//128]

("inv": the reciprocal of the factor the weight was multiplied by to quantize it, i.e. the dequantizing
factor, tritune's ``Fp8Weight.scale``). Without ``weight_block_size`` Hugging Face reads one scale per
tensor; tritune's per-channel weights are written as (N, 1) ``weight_scale_inv`` columns there, and a
per-tensor scale is read as every channel's. Biases, norms and embeddings stay dense; so does the LM head.

Fused projections (Llama's q/k/v and gate/up, stored as separate modules) are fused at load like dense
ones; block scales then concatenate exactly when each part's width is a multiple of 128, else the fused
weight's blocks would straddle parts and it is requantized from the checkpoint's values (said in a warning).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from tritune.model.quant import fp8 as F8

QUANT_METHOD = "fp8"
COPY_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json")
GPT2_LINEARS = {"w_qkv": ("attn.c_attn",), "w_o": ("attn.c_proj",), "w_fc": ("mlp.c_fc",),
                "w_proj": ("mlp.c_proj",)}
LLAMA_LINEARS = {"w_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "w_o": ("self_attn.o_proj",), "w_gu": ("mlp.gate_proj", "mlp.up_proj"),
                 "w_down": ("mlp.down_proj",)}


def quantization_config(block: bool) -> dict:
    q = {"quant_method": QUANT_METHOD, "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head"]}
    if block:
        q["weight_block_size"] = [F8.BLOCK, F8.BLOCK]
    return q


def read_qcfg(directory) -> dict | None:
    """The checkpoint's ``quantization_config`` when it is an FP8 one, else None."""
    try:
        d = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = d.get("quantization_config") if isinstance(d, dict) else None
    return q if isinstance(q, dict) and q.get("quant_method") == QUANT_METHOD else None


def is_fp8_checkpoint(directory) -> bool:
    return read_qcfg(directory) is not None


def _check_qcfg(q: dict, source: str) -> bool:
    """Whether the checkpoint's weights are block-scaled; ValueError naming what tritune cannot run."""
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{source}: quantization_config.activation_scheme={q.get('activation_scheme')!r}: only "
                         "dynamic (per-token) activation scales are supported")
    bs = q.get("weight_block_size")
    if bs is not None and list(bs) != [F8.BLOCK, F8.BLOCK]:
        raise ValueError(f"{source}: quantization_config.weight_block_size={bs!r}: fp8_gemm's block scales are "
                         f"[{F8.BLOCK}, {F8.BLOCK}]")
    if q.get("scale_fmt", "float") not in (None, "float"):
        raise ValueError(f"{source}: quantization_config.scale_fmt={q.get('scale_fmt')!r}: only float32 scales")
    return bs is not None


# ---------------------------------------------------------------------------------------------------
# Writing (GPT-2)
# ---------------------------------------------------------------------------------------------------
def _scale_inv(w: F8.Fp8Weight) -> torch.Tensor:
    return w.scale.contiguous() if w.block else w.scale.reshape(-1, 1).contiguous()


def save(out, weights, config_dict: dict, *, src_dir=None, dtype: torch.dtype = torch.float16) -> Path:
    """Write GPT2Weights whose projections are Fp8Weight as an HF FP8 checkpoint: config.json (with
    ``quantization_config``), model.safetensors (dense tensors in ``dtype``), and ``src_dir``'s tokenizer
    and generation config."""
    from safetensors.torch import save_file

    mode = F8.mode_of(weights)
    if mode is None or any(not isinstance(getattr(L, k), F8.Fp8Weight) for L in weights.layers for k in GPT2_LINEARS):
        raise TypeError("weights: every projection must be an Fp8Weight to be written")
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
        for k, (mod,) in GPT2_LINEARS.items():
            w = getattr(L, k)
            state[h + f"{mod}.weight"] = w.data.detach().to("cpu").contiguous()
            state[h + f"{mod}.weight_scale_inv"] = _scale_inv(w).to("cpu")
            state[h + f"{mod}.bias"] = dense(getattr(L, "b" + k[1:]))
    if not torch.equal(weights.lm_head, weights.wte.t()):
        state["lm_head.weight"] = dense(weights.lm_head.t())
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config_dict)
    cfg["quantization_config"] = quantization_config(mode == "fp8-block")
    cfg["tie_word_embeddings"] = "lm_head.weight" not in state
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if src_dir is not None:
        for f in COPY_FILES:
            if (Path(src_dir) / f).is_file():
                shutil.copyfile(Path(src_dir) / f, out / f)
    return out


def quantize_checkpoint(model, out, *, block: bool = True) -> Path:
    """``tritune quantize --method fp8``: the GPT-2 checkpoint ``model`` with every projection rounded to
    e4m3 (128x128 block scales, or per-channel with ``block=False``), written to ``out``."""
    from tritune.model.gpt2 import weights as W

    directory = W.resolve(model)
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if cfg.get("quantization_config") is not None:
        raise ValueError(f"{directory}: already quantized")
    config, w, directory = W.load(directory, torch.float32, "cpu")
    src_dtype = next(iter(W.load_state_dict(directory).values())).dtype
    return save(out, F8.quantize_weights(w, block), cfg, src_dir=directory,
                dtype=src_dtype if src_dtype.is_floating_point else torch.float16)


# ---------------------------------------------------------------------------------------------------
# Reading (GPT-2 and the Llama family)
# ---------------------------------------------------------------------------------------------------
def _module_weight(state: dict, name: str, block: bool, source: str) -> F8.Fp8Weight:
    """The Fp8Weight of module ``name`` (its ``weight`` e4m3 (N, K) and ``weight_scale_inv``), popping both."""
    w = state.pop(name + ".weight", None)
    s = state.pop(name + ".weight_scale_inv", None)
    if w is None or s is None:
        raise ValueError(f"{source}: tensor {name + ('.weight' if w is None else '.weight_scale_inv')!r} is missing")
    if w.dtype != F8.E4M3:
        raise TypeError(f"{source}: tensor {name}.weight has dtype {w.dtype}, expected float8_e4m3fn")
    n, k = w.shape
    s = s.float()
    if block:
        want = (-(-n // F8.BLOCK), -(-k // F8.BLOCK))
        if tuple(s.shape) != want:
            raise ValueError(f"{source}: tensor {name}.weight_scale_inv has shape {tuple(s.shape)}, expected {want}")
    elif s.numel() == 1:                       # Hugging Face's per-tensor form: every channel's scale
        s = s.reshape(1).expand(n)
    elif tuple(s.shape) in ((n,), (n, 1)):     # tritune's per-channel form
        s = s.reshape(n)
    else:
        raise ValueError(f"{source}: tensor {name}.weight_scale_inv has shape {tuple(s.shape)}, expected a scalar "
                         f"or ({n}, 1) (no weight_block_size)")
    return F8.Fp8Weight(w.contiguous(), s.contiguous())


def _fuse(parts: list, name: str) -> F8.Fp8Weight:
    """Fp8Weights of modules stacked along N (q/k/v, gate/up) as one; exact unless block scales straddle."""
    if len(parts) == 1:
        return parts[0]
    data = torch.cat([p.data for p in parts], dim=0)
    if not parts[0].block:
        return F8.Fp8Weight(data, torch.cat([p.scale for p in parts]))
    if all(p.N % F8.BLOCK == 0 for p in parts[:-1]):
        return F8.Fp8Weight(data, torch.cat([p.scale for p in parts], dim=0))
    warnings.warn(f"{name}: the fused projection's parts are not multiples of {F8.BLOCK} rows; its block scales "
                  "are recomputed from the checkpoint's values (requantized)", stacklevel=3)
    dense = torch.cat([p.dequantize(torch.float32) for p in parts], dim=1)     # (K, N)
    return F8.quantize_weight(dense, block=True)


def _load_fp8_linears(state: dict, n_layer: int, prefix: str, linears: dict, block: bool, conv1d: bool,
                      source: str) -> list:
    """Per layer {field: Fp8Weight}; each module's e4m3 weight replaced in ``state`` by a dense placeholder of
    its shape (zeros: the family's loader checks and lays out the rest, the FP8 weights are put in after)."""
    out = []
    for i in range(n_layer):
        fp8 = {}
        for field, mods in linears.items():
            parts = []
            for mod in mods:
                name = prefix.format(i=i) + mod
                w = _module_weight(state, name, block, source)
                parts.append(w)
                n, k = w.data.shape
                state[name + ".weight"] = torch.zeros((), dtype=torch.float16).expand((k, n) if conv1d else (n, k))
            fp8[field] = _fuse(parts, f"{source}: layer {i} {field}")
        out.append(fp8)
    return out


def load(directory, dtype: torch.dtype = torch.float32, device="cpu"):
    """(family "gpt2" | "llama", config, weights with Fp8Weight projections, directory)."""
    from dataclasses import replace

    from tritune.model.gpt2 import weights as GW

    directory = GW.resolve(directory)
    source = str(Path(directory) / "config.json")
    q = read_qcfg(directory)
    if q is None:
        raise ValueError(f"{source}: no quantization_config with quant_method 'fp8'")
    block = _check_qcfg(q, source)
    cfg_dict = json.loads((Path(directory) / "config.json").read_text())
    cfg_dict.pop("quantization_config")
    if cfg_dict.get("model_type") == "gpt2":
        from tritune.model.gpt2.config import GPT2Config

        family, c = "gpt2", GPT2Config.from_dict(cfg_dict, source)
        state = GW.load_state_dict(directory)
        fp8 = _load_fp8_linears(state, c.n_layer, "h.{i}.", GPT2_LINEARS, block, True, str(directory))
        GW.check_state(c, state, str(directory))
        w = GW.to_layout(c, state, dtype, "cpu")
    else:
        from tritune.model.llama import weights as LW
        from tritune.model.llama.config import LlamaConfig

        family, c = "llama", LlamaConfig.from_dict(cfg_dict, source)
        state = LW.load_state_dict(directory)
        fp8 = _load_fp8_linears(state, c.n_layer, "layers.{i}.", LLAMA_LINEARS, block, False, str(directory))
        LW.check_state(c, state, str(directory))
        w = LW.to_layout(c, state, dtype, "cpu")
    layers = [replace(L, **f) for L, f in zip(w.layers, fp8)]
    w = replace(w, layers=layers)
    return family, c, _to_device(w, device), directory


def _to_device(w, device):
    from dataclasses import fields, replace

    def move(v):
        if isinstance(v, F8.Fp8Weight):
            return v.to(device)
        return v.to(device) if isinstance(v, torch.Tensor) else v

    layers = [replace(L, **{f.name: move(getattr(L, f.name)) for f in fields(L)}) for L in w.layers]
    top = {f.name: move(getattr(w, f.name)) for f in fields(w) if f.name != "layers"}
    if w.lm_head.data_ptr() == w.wte.data_ptr():   # tied: keep the head a view of the embedding
        top["lm_head"] = top["wte"].t()
    return replace(w, layers=layers, **top)


def load_model(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """The family's model running an FP8 checkpoint's projections W8A8 (:class:`~tritune.model.quant.fp8.Fp8Ops`)."""
    if device is None:
        from tritune.model.gpt2.model import default_device

        device = default_device(backend)
    family, c, w, d = load(directory, dtype, device)
    if family == "gpt2":
        from tritune.model.gpt2.model import GPT2

        model = GPT2(c, w, backend=backend, directory=d)
    else:
        from tritune.model.llama.model import Llama

        model = Llama(c, w, backend=backend, directory=d)
    # model.w, not w: the constructor lays the LM head out as the gemm is tuned for (GPT-2's tied head a
    # view of wte), as quantize_model's models have it
    return F8.with_fp8_weights(model, model.w)
