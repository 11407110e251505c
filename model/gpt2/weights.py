"""Hugging Face GPT-2 checkpoint -> our layout, once, at load.

Layout: GPT-2's Conv1D already stores its weight as (in, out) = (K, N), which is what ``gemm(a, b)``
takes as ``b``, so projections are kept as they are; c_attn stays fused (one (E, 3E) GEMM gives q, k, v
as views of one output). The tied lm_head is materialised once as a contiguous (E, V) copy of wte's
transpose: the logits GEMM then reads its ``b`` row-major like every other projection.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tritune.model.gpt2.config import GPT2Config

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


@dataclass
class LayerWeights:
    ln1_w: torch.Tensor      # (E,)
    ln1_b: torch.Tensor
    w_qkv: torch.Tensor      # (E, 3E): columns [q | k | v], head h at columns h*D:(h+1)*D of each
    b_qkv: torch.Tensor      # (3E,)
    w_o: torch.Tensor        # (E, E)
    b_o: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    w_fc: torch.Tensor       # (E, F)
    b_fc: torch.Tensor       # (F,)
    w_proj: torch.Tensor     # (F, E)
    b_proj: torch.Tensor     # (E,)


@dataclass
class GPT2Weights:
    wte: torch.Tensor        # (V, E) token embedding
    wpe: torch.Tensor        # (P, E) position embedding
    layers: list[LayerWeights]
    lnf_w: torch.Tensor
    lnf_b: torch.Tensor
    lm_head: torch.Tensor    # (E, V) contiguous: wte transposed when tied

    def nbytes(self) -> int:
        ts = [self.wte, self.wpe, self.lnf_w, self.lnf_b, self.lm_head]
        ts += [t for layer in self.layers for t in vars(layer).values()]
        return sum(t.numel() * t.element_size() for t in ts)


# ---------------------------------------------------------------------------------------------------
def resolve(model: str | Path) -> Path:
    """A checkpoint directory: ``model`` itself when it is one, else a hub id fetched by huggingface_hub."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise NotADirectoryError(f"{p}: expected a checkpoint directory (config.json + model.safetensors), "
                                 "got a file")
    name = str(model)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local:
        raise FileNotFoundError(f"{name}: no such checkpoint directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"{name}: no such directory, and huggingface_hub is not installed to fetch it "
                                "as a hub id") from None
    try:
        d = Path(snapshot_download(name, allow_patterns=["config.json", "*.safetensors",
                                                         "model.safetensors.index.json", *TOKENIZER_FILES]))
        if not any((d / f).exists() for f in WEIGHT_FILES[:2]):  # an old repo with only the pickle
            d = Path(snapshot_download(name, allow_patterns=["config.json", "pytorch_model.bin",
                                                             *TOKENIZER_FILES]))
    except Exception as e:  # offline, unknown repo, gated: all mean "cannot have this model here"
        raise FileNotFoundError(f"{name}: no such directory, and fetching it from the Hugging Face hub failed "
                                f"({type(e).__name__}: {e})") from None
    return d


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint on the CPU, keys without the ``transformer.`` prefix."""
    directory = Path(directory)
    st = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    binf = directory / "pytorch_model.bin"
    def read(path, fn):
        try:
            return fn(str(path))
        except Exception as e:  # a truncated or foreign file: name it, whatever the reader raised
            raise ValueError(f"{path}: cannot read the weights ({type(e).__name__}: {e})") from None

    if st.is_file():
        from safetensors.torch import load_file

        raw = read(st, load_file)
    elif index.is_file():
        from safetensors.torch import load_file

        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        raw = {}
        for s in shards:
            if not (directory / s).is_file():
                raise FileNotFoundError(f"{directory / s}: shard named in {index.name} is missing")
            raw.update(read(directory / s, load_file))
    elif binf.is_file():
        raw = read(binf, lambda f: torch.load(f, map_location="cpu", weights_only=True))
    else:
        raise FileNotFoundError(f"{directory}: no weights file (expected one of {', '.join(WEIGHT_FILES)})")
    if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise ValueError(f"{directory}: the weights file does not hold a dict of tensors")
    state = {}
    for k, v in raw.items():
        k = k[len("transformer."):] if k.startswith("transformer.") else k
        state[k] = v
    return state


def expected_shapes(c: GPT2Config) -> dict[str, tuple]:
    """Every tensor name of a GPT-2 state dict in this layout -> its shape (also what tests fill at random)."""
    E, F = c.n_embd, c.d_mlp
    shapes = {"wte.weight": (c.vocab_size, E), "wpe.weight": (c.n_positions, E),
              "ln_f.weight": (E,), "ln_f.bias": (E,)}
    for i in range(c.n_layer):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (E,), h + "ln_1.bias": (E,),
            h + "attn.c_attn.weight": (E, 3 * E), h + "attn.c_attn.bias": (3 * E,),
            h + "attn.c_proj.weight": (E, E), h + "attn.c_proj.bias": (E,),
            h + "ln_2.weight": (E,), h + "ln_2.bias": (E,),
            h + "mlp.c_fc.weight": (E, F), h + "mlp.c_fc.bias": (F,),
            h + "mlp.c_proj.weight": (F, E), h + "mlp.c_proj.bias": (E,),
        })
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, E)
    return shapes


def check_state(c: GPT2Config, state: dict, source: str = "checkpoint") -> None:
    """Every tensor the config implies is present with its shape; no layer beyond n_layer."""
    for name, shape in expected_shapes(c).items():
        if name not in state:
            raise ValueError(f"{source}: tensor {name!r} is missing (config.json: n_layer={c.n_layer})")
        got = tuple(state[name].shape)
        if got != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {got}, but config.json implies {shape} "
                             f"(n_embd={c.n_embd}, n_head={c.n_head}, vocab_size={c.vocab_size}, "
                             f"n_positions={c.n_positions})")
        if not state[name].is_floating_point():
            raise TypeError(f"{source}: tensor {name!r} has dtype {state[name].dtype}, expected floating point")
    extra = sorted({int(k.split(".")[1]) for k in state if k.startswith("h.") and k.split(".")[1].isdigit()}
                   - set(range(c.n_layer)))
    if extra:
        raise ValueError(f"{source}: has layer(s) {extra} but config.json says n_layer={c.n_layer}")


def to_layout(c: GPT2Config, state: dict, dtype: torch.dtype, device) -> GPT2Weights:
    def t(name):
        return state[name].to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(c.n_layer):
        h = f"h.{i}."
        layers.append(LayerWeights(
            ln1_w=t(h + "ln_1.weight"), ln1_b=t(h + "ln_1.bias"),
            w_qkv=t(h + "attn.c_attn.weight"), b_qkv=t(h + "attn.c_attn.bias"),
            w_o=t(h + "attn.c_proj.weight"), b_o=t(h + "attn.c_proj.bias"),
            ln2_w=t(h + "ln_2.weight"), ln2_b=t(h + "ln_2.bias"),
            w_fc=t(h + "mlp.c_fc.weight"), b_fc=t(h + "mlp.c_fc.bias"),
            w_proj=t(h + "mlp.c_proj.weight"), b_proj=t(h + "mlp.c_proj.bias")))
    wte = t("wte.weight")
    head = wte if c.tie_word_embeddings else t("lm_head.weight")
    return GPT2Weights(wte=wte, wpe=t("wpe.weight"), layers=layers, lnf_w=t("ln_f.weight"),
                       lnf_b=t("ln_f.bias"), lm_head=head.t().contiguous())


def _raw_config(directory: Path) -> dict:
    """config.json as plain JSON, or {} when missing or malformed (GPT2Config.from_file then says why)."""
    try:
        data = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load(model: str | Path, dtype: torch.dtype = torch.float32, device="cpu"):
    """(config, weights in our layout, checkpoint directory)."""
    directory = resolve(model)
    if "quantization_config" in _raw_config(directory):   # its linears hold qweight, not weight
        raise ValueError(f"{directory}: a quantized checkpoint (quantization_config in config.json): load it "
                         "with tritune.model.quant.hf.load_model (or run `tritune eval` on it)")
    config = GPT2Config.from_file(directory / "config.json")
    state = load_state_dict(directory)
    check_state(config, state, str(directory))
    return config, to_layout(config, state, dtype, device), directory
