"""GPT2Config: the sizes of a GPT-2 from a Hugging Face ``config.json``, and what we refuse to run.

Only the plain GPT-2 block is supported (pre-LN, fused c_attn, tanh-GELU MLP, learned positions, tied
embeddings); options that change the math (cross attention, per-layer attention scaling, another
activation) are rejected at load with the option named, rather than run wrong.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tritune.model.hf_config import config_json

# HF names of the tanh-approximated GELU GPT-2 uses (gelu_new is GPT-2's own name for it).
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a GPT-2 this package can run (architecture or option named in the message)."""


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int
    vocab_size: int
    layer_norm_epsilon: float = 1e-5
    n_inner: int | None = None          # MLP width; None means 4 * n_embd
    eos_token_id: int | None = 50256
    bos_token_id: int | None = 50256
    tie_word_embeddings: bool = True

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config: {name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"config: layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner < 1):
            raise ValueError(f"config: n_inner must be a positive int or null, got {self.n_inner!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def d_mlp(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "GPT2Config":
        mt = d.get("model_type")
        if mt != "gpt2":
            raise UnsupportedModelError(
                f"{source}: model_type is {mt!r}; only GPT-2 checkpoints (model_type 'gpt2') are supported")
        bad = []
        act = d.get("activation_function", "gelu_new")
        if act not in _TANH_GELU:
            bad.append(f"activation_function={act!r} (supported: tanh GELU, {', '.join(_TANH_GELU)})")
        if d.get("add_cross_attention"):
            bad.append("add_cross_attention=true (encoder-decoder GPT-2)")
        if d.get("scale_attn_by_inverse_layer_idx"):
            bad.append("scale_attn_by_inverse_layer_idx=true")
        if d.get("scale_attn_weights") is False:
            bad.append("scale_attn_weights=false")
        if bad:
            raise UnsupportedModelError(f"{source}: unsupported GPT-2 option(s): {'; '.join(bad)}")
        missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        eos = d.get("eos_token_id")
        bos = d.get("bos_token_id")
        return cls(n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_embd"], n_positions=d["n_positions"],
                   vocab_size=d["vocab_size"], layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
                   n_inner=d.get("n_inner"),
                   eos_token_id=eos if isinstance(eos, int) and 0 <= eos < d["vocab_size"] else None,
                   bos_token_id=bos if isinstance(bos, int) and 0 <= bos < d["vocab_size"] else None,
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))

    @classmethod
    def from_file(cls, path) -> "GPT2Config":
        path = Path(path)
        return cls.from_dict(config_json(path, "a GPT-2 checkpoint directory"), str(path))
