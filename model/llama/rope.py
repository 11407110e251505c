"""The cos / sin tables of a checkpoint's rotary embedding, one row per position, for HF's rope types.

Computed in float32 with Hugging Face's own recipe (inverse frequencies in float32, angle = position · inv_freq
in float32, times the type's attention factor), so a float32 model sees the angles transformers sees. The
rotary kernel and its torch counterpart only index these tables: every type is the same launch.

``dynamic`` (NTK): transformers recomputes the frequencies from the longest position of each forward, the
base growing once the sequence passes ``max_position_embeddings``. Here row p holds the angles for a
sequence of p + 1 tokens: the same as transformers for every position up to the original length and for
each token generated past it; a prompt longer than the original length gets, per token, the frequencies of
its own length, where transformers would use the whole prompt's for all of them.
"""
from __future__ import annotations

import math

import torch

from tritune.model.llama.config import LlamaConfig, RopeConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _llama3(r: RopeConfig, dim: int) -> torch.Tensor:
    inv = _base_inv_freq(r.theta, dim)
    old = r.original_max_position_embeddings
    low_wavelen, high_wavelen = old / r.low_freq_factor, old / r.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / r.factor, inv)
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(r: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = r.factor
    attn = r.attention_factor
    if attn is None:
        attn = (float(mscale(factor, r.mscale) / mscale(factor, r.mscale_all_dim)) if r.mscale and r.mscale_all_dim
                else mscale(factor))

    def correction_dim(rotations):
        L = r.original_max_position_embeddings
        return (dim * math.log(L / (rotations * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = r.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn)


def inv_freq(r: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,) float32, attention factor) of a static rope type."""
    if r.type in ("default", "dynamic"):
        return _base_inv_freq(r.theta, dim), 1.0
    if r.type == "linear":
        return _base_inv_freq(r.theta, dim) / r.factor, 1.0
    if r.type == "llama3":
        return _llama3(r, dim), 1.0
    if r.type == "yarn":
        return _yarn(r, dim)
    raise ValueError(f"rope type {r.type!r} not supported")


def tables(config: LlamaConfig, n_positions: int | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n_positions, rotary_dim / 2) float32 on ``device`` (default: every position the model runs)."""
    P = config.n_positions if n_positions is None else n_positions
    r, dim = config.rope, config.rotary_dim
    pos = torch.arange(P, dtype=torch.int64)
    inv, scale = inv_freq(r, dim)
    freqs = pos[:, None].float() * inv[None, :]
    if r.type == "dynamic" and P > config.max_position_embeddings:
        L = config.max_position_embeddings
        seq = pos[L:] + 1          # row p: the frequencies of a p + 1 token sequence (module docstring)
        base = r.theta * ((r.factor * seq / L) - (r.factor - 1)) ** (dim / (dim - 2))
        inv_p = 1.0 / (base[:, None] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)[None, :])
        freqs[L:] = pos[L:, None].float() * inv_p.float()
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return cos.to(device).contiguous(), sin.to(device).contiguous()
