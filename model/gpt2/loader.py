"""GPT-2's entry in :mod:`tritune.model.families`: a checkpoint directory to a model, dense or quantized."""
from __future__ import annotations

import torch


def load(directory, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
    """A :class:`~tritune.model.gpt2.model.GPT2` from ``directory``; a GPTQ/AWQ checkpoint (what ``tritune
    quantize`` writes) runs its quantized linears (:func:`tritune.model.quant.hf.load_model`)."""
    from tritune.model.gpt2.model import GPT2
    from tritune.model.quant import fp8_hf, hf

    if fp8_hf.is_fp8_checkpoint(directory):     # FP8 (Hugging Face's layout): W8A8 linears
        return fp8_hf.load_model(directory, backend=backend, dtype=dtype, device=device)
    if hf.quantization_config(directory) is not None:
        return hf.load_model(directory, backend=backend, dtype=dtype, device=device)
    return GPT2.from_pretrained(directory, backend=backend, dtype=dtype, device=device)
