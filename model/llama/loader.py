"""The Llama family's entry in :mod:`tritune.model.families` (model_type llama, qwen2, qwen3, mistral)."""
from __future__ import annotations

import torch


def load(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """A :class:`~tritune.model.llama.model.Llama` from ``directory`` (dense checkpoints only: a quantized one
    is refused by name in its config)."""
    from tritune.model.llama.model import load_model
    from tritune.model.quant import fp8_hf

    if fp8_hf.is_fp8_checkpoint(directory):     # FP8 in Hugging Face's layout: W8A8 linears
        return fp8_hf.load_model(directory, backend=backend, dtype=dtype, device=device)
    return load_model(directory, backend=backend, dtype=dtype, device=device)
