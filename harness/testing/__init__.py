"""The kernel contract as tests you can run on your own spec.

One line in a test file gives a spec every property test the built-in kernels pass::

    from tritune.testing import contract_tests

    TestMyRMSNorm = contract_tests("my_rmsnorm")   # a class: pytest collects names starting with "Test"

or, with no test file at all, ``pytest --tritune-kernel my_rmsnorm`` / ``tritune test -m my_rmsnorm``.
The tests (in :mod:`tritune.testing.contract`): reference match on hypothesis-drawn problems, layouts (each
tensor input its own strides, offset and transposition, within the spec's ``layouts``) and config points,
with poisoned outputs and every element written (one never written is told apart from one written as NaN); the heuristic default valid for every
problem; repeated launches reading each call's data; bad inputs refused with a message; an explicit invalid
config refused; the standard problems on a GPU. Each test class carries the marker of its kernel (``-m name``).
Through the interpreter, ``--tritune-fast`` (or ``TRITUNE_CONTRACT_FAST=1``) fails a broken kernel in seconds:
a few examples, no shrinking.

This module stays light (the pytest plugin imports it in every pytest run): the contract, which needs torch,
triton and hypothesis, loads on first use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["contract_tests"]

if TYPE_CHECKING:
    from tritune.testing.contract import contract_tests


def __getattr__(name: str):
    if name == "contract_tests":
        from tritune.testing.contract import contract_tests

        return contract_tests
    raise AttributeError(f"module 'tritune.testing' has no attribute {name!r}")
