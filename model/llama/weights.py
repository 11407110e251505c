"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral checkpoint -> our layout, once, at load.

HF stores each projection as an ``nn.Linear`` weight (out, in). We keep GPT-2's layout, (in, out) = (K, N)
contiguous, what ``gemm(a, b)`` takes as ``b``, and fuse at load: q, k, v into one (E, (Hq + 2 Hk)·D)
projection whose output holds q, k and v as column views (one GEMM instead of three), gate and up into one
(E, 2F) projection [gate | up] (SwiGLU reads both halves of one output). The LM head is the embedding's
transpose when tied, else its own (V, E) tensor kept as an (E, V) transposed view (the layout the gemm is
tuned on for the LM head, see GPT2.__init__).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tritune.model.gpt2 import weights as gpt2_weights
from tritune.model.llama.config import LlamaConfig

resolve = gpt2_weights.resolve


# the projections of a layer (what a weight-only quantizer swaps; embeddings and norms stay dense)
LINEARS = ("w_qkv", "w_o", "w_gu", "w_down")


@dataclass
class LayerWeights:
    ln1_w: torch.Tensor             # (E,) input_layernorm
    w_qkv: torch.Tensor             # (E, (Hq + 2 Hk) D): columns [q | k | v], head h at h*D:(h+1)*D of each
    b_qkv: torch.Tensor | None      # ((Hq + 2 Hk) D,) or None
    w_o: torch.Tensor               # (Hq D, E)
    b_o: torch.Tensor | None
    ln2_w: torch.Tensor             # (E,) post_attention_layernorm
    w_gu: torch.Tensor              # (E, 2F): columns [gate | up]
    b_gu: torch.Tensor | None
    w_down: torch.Tensor            # (F, E)
    b_down: torch.Tensor | None
    q_norm: torch.Tensor | None = None   # (D,) Qwen3
    k_norm: torch.Tensor | None = None


@dataclass
class LlamaWeights:
    wte: torch.Tensor               # (V, E) embed_tokens
    layers: list[LayerWeights]
    lnf_w: torch.Tensor             # (E,) the final norm
    lm_head: torch.Tensor           # (E, V): wte.t() when tied, else a (V, E) tensor's transposed view

    def nbytes(self) -> int:
        ts = [self.wte, self.lnf_w] + ([] if self.lm_head.data_ptr() == self.wte.data_ptr() else [self.lm_head])
        ts += [t for layer in self.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in ts)


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint on the CPU, keys without the ``model.`` prefix (``lm_head.weight`` as is)."""
    raw = gpt2_weights.load_state_dict(directory)
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in raw.items()}


def expected_shapes(c: LlamaConfig) -> dict[str, tuple]:
    """Every tensor name of the state dict (``model.`` stripped) -> its shape."""
    E, F, D, V = c.n_embd, c.d_mlp, c.head_dim, c.vocab_size
    shapes = {"embed_tokens.weight": (V, E), "norm.weight": (E,)}
    for i in range(c.n_layer):
        h = f"layers.{i}."
        a, m = h + "self_attn.", h + "mlp."
        shapes.update({h + "input_layernorm.weight": (E,), h + "post_attention_layernorm.weight": (E,),
                       a + "q_proj.weight": (c.q_dim, E), a + "k_proj.weight": (c.kv_dim, E),
                       a + "v_proj.weight": (c.kv_dim, E), a + "o_proj.weight": (E, c.q_dim),
                       m + "gate_proj.weight": (F, E), m + "up_proj.weight": (F, E), m + "down_proj.weight": (E, F)})
        if c.qkv_bias:
            shapes.update({a + "q_proj.bias": (c.q_dim,), a + "k_proj.bias": (c.kv_dim,),
                           a + "v_proj.bias": (c.kv_dim,)})
        if c.o_bias:
            shapes[a + "o_proj.bias"] = (E,)
        if c.mlp_bias:
            shapes.update({m + "gate_proj.bias": (F,), m + "up_proj.bias": (F,), m + "down_proj.bias": (E,)})
        if c.qk_norm:
            shapes.update({a + "q_norm.weight": (D,), a + "k_norm.weight": (D,)})
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, E)
    return shapes


def check_state(c: LlamaConfig, state: dict, source: str = "checkpoint") -> None:
    """Every tensor the config implies is present with its shape; nothing the config does not explain."""
    shapes = expected_shapes(c)
    for name, shape in shapes.items():
        if name not in state:
            raise ValueError(f"{source}: tensor {name!r} is missing (config.json: {c.model_type}, "
                             f"n_layer={c.n_layer})")
        got = tuple(state[name].shape)
        if got != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {got}, but config.json implies {shape} "
                             f"(hidden_size={c.n_embd}, heads={c.n_head}, kv heads={c.n_kv_head}, "
                             f"head_dim={c.head_dim}, intermediate_size={c.d_mlp}, vocab_size={c.vocab_size})")
        if not state[name].is_floating_point():
            raise TypeError(f"{source}: tensor {name!r} has dtype {state[name].dtype}, expected floating point")
    # a tied checkpoint may still carry lm_head.weight (a copy of the embedding); rotary tables are derived
    extra = sorted(k for k in state
                   if k not in shapes and k != "lm_head.weight" and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ValueError(f"{source}: tensor(s) {extra[:4]}{' ...' if len(extra) > 4 else ''} not used by a "
                         f"{c.model_type} of this config (e.g. a bias the config does not declare, or extra layers)")


def to_layout(c: LlamaConfig, state: dict, dtype: torch.dtype, device) -> LlamaWeights:
    def t(name):
        return state[name].to(device=device, dtype=dtype)

    def kn(*names):
        """The (out, in) linears ``names`` concatenated along out, as one (in, out) contiguous matrix."""
        return torch.cat([t(n) for n in names], dim=0).t().contiguous()

    def bias(*names):
        return torch.cat([t(n) for n in names]).contiguous() if names[0] in state else None

    layers = []
    for i in range(c.n_layer):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        qkv = [a + "q_proj", a + "k_proj", a + "v_proj"]
        gu = [m + "gate_proj", m + "up_proj"]
        layers.append(LayerWeights(
            ln1_w=t(f"layers.{i}.input_layernorm.weight").contiguous(),
            w_qkv=kn(*(n + ".weight" for n in qkv)), b_qkv=bias(*(n + ".bias" for n in qkv)),
            w_o=kn(a + "o_proj.weight"), b_o=bias(a + "o_proj.bias"),
            ln2_w=t(f"layers.{i}.post_attention_layernorm.weight").contiguous(),
            w_gu=kn(*(n + ".weight" for n in gu)), b_gu=bias(*(n + ".bias" for n in gu)),
            w_down=kn(m + "down_proj.weight"), b_down=bias(m + "down_proj.bias"),
            q_norm=t(a + "q_norm.weight").contiguous() if c.qk_norm else None,
            k_norm=t(a + "k_norm.weight").contiguous() if c.qk_norm else None))
    wte = t("embed_tokens.weight").contiguous()
    head = wte.t() if c.tie_word_embeddings else t("lm_head.weight").contiguous().t()
    return LlamaWeights(wte=wte, layers=layers, lnf_w=t("norm.weight").contiguous(), lm_head=head)


def load(model, dtype: torch.dtype = torch.float32, device="cpu"):
    """(config, weights in our layout, checkpoint directory)."""
    directory = resolve(model)
    config = LlamaConfig.from_file(Path(directory) / "config.json")
    config = config.with_generation_eos(Path(directory) / "generation_config.json")
    state = load_state_dict(directory)
    check_state(config, state, str(directory))
    return config, to_layout(config, state, dtype, device), directory
