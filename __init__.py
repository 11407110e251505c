"""tritune: Triton kernels for LLM inference, tuned and tested against float64 references.

The public API for your own kernels lives here::

    from tritune import KernelSpec, Space, Case, Cost, register, check_tensor, check_device, check_out

    register(KernelSpec(name="my_rmsnorm", run=..., reference=..., ...))

Installed packages announce their kernels through the entry-point group ``tritune.kernels`` (the value is
a module that calls :func:`register` when imported); ``tritune --plugin MODULE`` and ``TRITUNE_PLUGINS``
load one ad hoc. ``from tritune.testing import contract_tests`` gives a test file the whole contract of a
spec in one line. ``tritune.patch(hf_model)`` swaps a Hugging Face GPT-2's modules onto the kernels.

This file is the package's ``__init__`` (pyproject maps package ``tritune`` to the repository root and each
code folder to a subpackage). It imports nothing heavy: every name below resolves on first use, so
``import tritune`` costs no torch or triton import until a name is touched.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_LAZY = {
    # the kernel spec contract (tritune.kernels)
    "KernelSpec": "tritune.kernels",
    "Space": "tritune.kernels",
    "Case": "tritune.kernels",
    "Cost": "tritune.kernels",
    "PlanCache": "tritune.kernels",
    "register": "tritune.kernels",
    "get": "tritune.kernels",
    "all_specs": "tritune.kernels",
    "bucket_key": "tritune.kernels",
    "check_tensor": "tritune.kernels",
    "check_device": "tritune.kernels",
    "check_out": "tritune.kernels",
    "kernel_device": "tritune.kernels",
    "tensor_meta": "tritune.kernels",
    # hypothesis strategies and layouts a spec's problems()/make_inputs use
    "sizes": "tritune.kernels.runtime.strategies",
    "with_layout": "tritune.kernels.runtime.strategies",
    "randn": "tritune.kernels.runtime.strategies",
    "LAYOUTS": "tritune.kernels.runtime.strategies",
    # the one tolerance table and the comparison
    "tolerance": "tritune.kernels.runtime.compare",
    # PyTorch integration
    "patch": "tritune.model.patch",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from tritune.kernels.runtime.compare import tolerance
    from tritune.kernels.runtime.strategies import LAYOUTS, randn, sizes, with_layout
    from tritune.kernels import (Case, Cost, KernelSpec, PlanCache, Space, all_specs, bucket_key, check_device,
                                 check_out, check_tensor, get, kernel_device, register, tensor_meta)
    from tritune.model.patch import patch


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'tritune' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value  # once resolved, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


try:
    from importlib.metadata import version as _version

    __version__ = _version("tritune")
except Exception:  # pragma: no cover - running from a tree that was never installed
    __version__ = "0+unknown"
