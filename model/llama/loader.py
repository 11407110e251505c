"""The Llama family's entry in :mod:`tritune.model.families` (model_type llama, qwen2, qwen3, mistral)."""
from __future__ import annotations

import torch


def load(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """A :class:`~tritune.model.llama.model.Llama` from ``directory`` (dense checkpoints only: a quantized one
    is refused by name in its config)."""
    from tritune.model.llama.model import load_model

    return load_model(directory, backend=backend, dtype=dtype, device=device)
