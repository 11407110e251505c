"""LlamaConfig: the sizes and options of a Llama-shaped checkpoint (Llama, Qwen2, Qwen3, Mistral) from its Hugging
Face ``config.json``, and what we refuse to run.

The block: RMSNorm before attention and MLP, one fused qkv projection (optional bias: Qwen2's, Llama's
``attention_bias``), rotary positions on q and k (HF's rope types default, linear, dynamic, llama3, yarn),
grouped-query attention, a SwiGLU MLP (fused gate/up projection), a final RMSNorm and an LM head tied to the
embedding or not; Qwen3 adds an RMSNorm over each q and k head before the rotation. Options that change the
math in another way are refused at load with the option named, rather than run wrong.

Names shared with GPT2Config (``n_layer``, ``n_head``, ``n_embd``, ``n_positions``, ``vocab_size``,
``head_dim``, ``eos_token_id``) mean the same, so engine code written against GPT-2 reads them as they are;
``n_kv_head`` is the KV heads the cache holds (< ``n_head`` under GQA).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from tritune.model.hf_config import config_json

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM"}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family model this package can run (option named in the message)."""


@dataclass(frozen=True)
class RopeConfig:
    """HF's ``rope_parameters`` (or the older ``rope_theta`` + ``rope_scaling``), normalised."""
    type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0                          # linear, dynamic, llama3, yarn
    original_max_position_embeddings: int | None = None   # llama3, yarn
    low_freq_factor: float = 1.0                 # llama3
    high_freq_factor: float = 4.0                # llama3
    attention_factor: float | None = None        # yarn (None: from factor and mscale)
    beta_fast: float = 32.0                      # yarn
    beta_slow: float = 1.0                       # yarn
    mscale: float | None = None                  # yarn
    mscale_all_dim: float | None = None          # yarn
    truncate: bool = True                        # yarn


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    d_mlp: int                          # intermediate_size
    n_positions: int                    # the longest sequence we run (see from_dict)
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    qkv_bias: bool = False              # Qwen2 always; Llama's attention_bias
    o_bias: bool = False                # Llama's attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False               # Qwen3
    tie_word_embeddings: bool = False
    sliding_window: int | None = None   # the window of the sliding layers (None: no layer slides)
    layer_windows: tuple = ()           # per layer: its attention window (None: full); () = no layer slides
    eos_token_id: int | None = None
    eos_token_ids: tuple = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "d_mlp", "n_positions", "vocab_size", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config: {name} must be a positive int, got {v!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"config: num_attention_heads={self.n_head} is not a multiple of "
                             f"num_key_value_heads={self.n_kv_head}")
        if self.head_dim % 2:
            raise ValueError(f"config: head_dim={self.head_dim} must be even (rotary embedding)")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config: rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")

    @property
    def layer_norm_epsilon(self) -> float:
        """GPT2Config's name for the norm's eps."""
        return self.rms_norm_eps

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.head_dim

    # -------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "LlamaConfig":
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise UnsupportedModelError(f"{source}: model_type is {mt!r}; the Llama family takes "
                                        f"{', '.join(MODEL_TYPES)}")
        _refuse(d, mt, source)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        n_head = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // n_head
        max_pos = int(d.get("max_position_embeddings", 2048))
        rope = rope_of(d, max_pos, source)
        window = _window(d, mt)
        layer_windows = _layer_windows(d, mt, window)
        n_pos = max_pos if rope.type != "dynamic" else int(max_pos * rope.factor)
        vocab = d["vocab_size"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(e for e in (eos if isinstance(eos, list) else [eos])
                        if isinstance(e, int) and 0 <= e < vocab)
        bos = d.get("bos_token_id")
        attn_bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=mt, n_layer=d["num_hidden_layers"], n_head=n_head,
            n_kv_head=d.get("num_key_value_heads") or n_head, n_embd=d["hidden_size"],
            d_mlp=d["intermediate_size"], n_positions=n_pos, vocab_size=vocab, head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope=rope, max_position_embeddings=max_pos,
            qkv_bias=attn_bias or mt == "qwen2", o_bias=attn_bias and mt in ("llama", "qwen3"),
            mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=mt == "qwen3",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), sliding_window=window,
            layer_windows=layer_windows,
            eos_token_id=eos_ids[0] if eos_ids else None, eos_token_ids=eos_ids,
            bos_token_id=bos if isinstance(bos, int) and 0 <= bos < vocab else None)

    @classmethod
    def from_file(cls, path) -> "LlamaConfig":
        path = Path(path)
        return cls.from_dict(config_json(path, "a checkpoint directory"), str(path))

    def with_generation_eos(self, path) -> "LlamaConfig":
        """This config with the EOS ids of ``path`` (a checkpoint's generation_config.json, where Llama-3
        lists end of text and end of turn) added to its own; unchanged when the file is absent or unreadable."""
        try:
            eos = json.loads(Path(path).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            return self
        extra = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)
                 and not isinstance(e, bool) and 0 <= e < self.vocab_size and e not in self.eos_token_ids]
        if not extra:
            return self
        ids = self.eos_token_ids + tuple(extra)
        return replace(self, eos_token_ids=ids, eos_token_id=ids[0])


def _refuse(d: dict, mt: str, source: str) -> None:
    bad = []
    act = d.get("hidden_act", "silu")
    if act != "silu":
        bad.append(f"hidden_act={act!r} (supported: 'silu', the SwiGLU MLP)")
    prf = d.get("partial_rotary_factor", (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        bad.append(f"partial_rotary_factor={prf!r} (these families rotate the whole head)")
    if d.get("quantization_config") is not None:
        bad.append("quantization_config (a quantized checkpoint)")
    arch = d.get("architectures") or []
    if arch and _ARCHITECTURES[mt] not in arch:
        bad.append(f"architectures={arch!r} (expected {_ARCHITECTURES[mt]})")
    if bad:
        raise UnsupportedModelError(f"{source}: unsupported {mt} option(s): {'; '.join(bad)}")


def _window(d: dict, mt: str) -> int | None:
    """The sliding attention window the checkpoint's attention uses, or None (full attention)."""
    w = d.get("sliding_window")
    if mt == "llama":   # transformers' Llama has no window, whatever the config holds
        return None
    if mt in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return None
    if mt in ("qwen2", "qwen3"):
        types = d.get("layer_types") or []
        if types and "sliding_attention" not in types:
            return None
    return int(w) if isinstance(w, int) and w > 0 else None


def _layer_windows(d: dict, mt: str, window: int | None) -> tuple:
    """Each layer's window, as transformers picks it: Mistral every layer; Qwen2/Qwen3 the layers that
    ``layer_types`` marks "sliding_attention", or (a config.json without layer_types) those from
    ``max_window_layers`` on under ``use_sliding_window``. () when no layer slides."""
    if window is None:
        return ()
    n = int(d["num_hidden_layers"])
    if mt == "mistral":
        return (window,) * n
    types = d.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} layers")
        out = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        first = int(d.get("max_window_layers", 28))   # transformers' Qwen2Config / Qwen3Config default
        out = tuple(window if i >= first else None for i in range(n))
    return out if any(w is not None for w in out) else ()


def rope_of(d: dict, max_pos: int, source: str = "config.json") -> RopeConfig:
    """RopeConfig from HF's ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(d.get("rope_parameters") or {})
    if not params or all(isinstance(v, dict) for v in params.values()):
        if params:
            raise UnsupportedModelError(f"{source}: rope_parameters per layer type (one rotary per layer)")
        params = dict(d.get("rope_scaling") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} not supported (supported: "
                                    f"{', '.join(ROPE_TYPES)})")
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
             "high_freq_factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "truncate", "partial_rotary_factor"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise UnsupportedModelError(f"{source}: rope_scaling key(s) {unknown} not supported")
    factor = params.get("factor")
    if kind != "default" and not (isinstance(factor, (int, float)) and factor > 0):
        if not (kind == "yarn" and factor is None and params.get("original_max_position_embeddings")):
            raise ValueError(f"{source}: rope_scaling type {kind!r} needs a positive factor, got {factor!r}")
    orig = params.get("original_max_position_embeddings")
    if kind in ("llama3", "yarn"):
        orig = int(orig or max_pos)
        if factor is None:   # yarn: the ratio of the context lengths, as HF infers it
            factor = max_pos / orig
    return RopeConfig(
        type=kind, theta=float(theta), factor=float(factor or 1.0), original_max_position_embeddings=orig,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        attention_factor=params.get("attention_factor"), beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(params.get("truncate", True)))
