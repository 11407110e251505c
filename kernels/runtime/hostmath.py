"""Integer helpers for launchers' host code: triton's ``cdiv`` and ``next_power_of_2`` in plain Python.

Since triton 3.6 ``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s, ~1.4 us a
host call (argument unwrapping) against ~0.05 us here; a launch plan takes a dozen. The same results
(tests/test_hostmath.py). Not for ``@triton.jit`` code, which keeps ``tl.cdiv`` (and whose source is
part of the tuned stores' hash).
"""
from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for y > 0, as ``triton.cdiv``: (x + y - 1) // y."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2`` for every n <= 2^64."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
