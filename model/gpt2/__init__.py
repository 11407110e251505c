"""GPT-2 (the first model family): config, Hugging Face weights, the forward on tritune kernels.

``from tritune.model.gpt2 import GPT2`` resolves on first use (the package imports nothing by itself)."""
import importlib


def __getattr__(name: str):
    if name != "GPT2":
        raise AttributeError(f"module 'tritune.model.gpt2' has no attribute {name!r}")
    return importlib.import_module("tritune.model.gpt2.model").GPT2
