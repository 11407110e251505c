"""The Llama family's entry in :mod:`tritune.model.families` (model_type llama, qwen2, qwen3, mistral)."""
from __future__ import annotations

import torch


def load(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """A :class:`~tritune.model.llama.model.Llama` from ``directory``: dense, FP8 (Hugging Face's layout) or
    GPTQ / AWQ (weight-only INT8 / INT4) checkpoints; any other quantization is refused by name."""
    from tritune.model.llama.model import load_model
    from tritune.model.quant import fp8_hf
    from tritune.model.quant import hf as hf_quant

    if fp8_hf.is_fp8_checkpoint(directory):     # FP8 in Hugging Face's layout: W8A8 linears
        return fp8_hf.load_model(directory, backend=backend, dtype=dtype, device=device)
    if (hf_quant.quantization_config(directory) or {}).get("quant_method") in hf_quant.FORMATS:
        from tritune.model.quant import llama_hf

        return llama_hf.load_model(directory, backend=backend, dtype=dtype, device=device)
    return load_model(directory, backend=backend, dtype=dtype, device=device)
