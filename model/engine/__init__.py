"""The serving engine: scheduler, paged KV cache, runner, CUDA graphs, sampling, speculative decoding,
batch invariance, the fused decode step, generate.

``from tritune.model.engine import Engine, EngineConfig, SamplingParams`` resolves each name on first use
(nothing is imported with the package, so importing one of its modules never loads the rest)."""
import importlib

_LAZY = {"Engine": "tritune.model.engine.engine", "EngineConfig": "tritune.model.engine.config",
         "SamplingParams": "tritune.model.engine.sampling"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tritune.model.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
