"""Which model family runs a checkpoint: Hugging Face's ``model_type`` (config.json) -> the family's loader.

A family is a folder beside ``gpt2/`` (config, weights, tokenizer, forward) with a ``loader`` module whose
``load(directory, *, backend, dtype, device)`` returns a model that meets the engine's contract
(:class:`tritune.model.engine.contract.EngineModel`); adding one is a line here, nothing in the engine.
The loaders are named, not imported, so that loading GPT-2 never imports another family's code.
"""
from __future__ import annotations

import importlib

# model_type -> the module holding the family's ``load`` (checkpoints quantized by GPTQ/AWQ included)
FAMILIES: dict[str, str] = {
    "gpt2": "tritune.model.gpt2.loader",
    "llama": "tritune.model.llama.loader",
    "mistral": "tritune.model.llama.loader",
    "qwen2": "tritune.model.llama.loader",
    "qwen3": "tritune.model.llama.loader",
}


class UnsupportedFamilyError(ValueError):
    """config.json names a ``model_type`` no family here runs."""


def loader(model_type):
    """The ``load`` function of the family that runs ``model_type``."""
    name = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        raise UnsupportedFamilyError(f"model_type {model_type!r} is not supported (supported: "
                                     f"{', '.join(sorted(FAMILIES))})")
    return importlib.import_module(name).load
