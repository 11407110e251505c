"""Kernels and evaluations for the sweep tests (imported by name, so worker processes find them too).

``toy``: a registered spec over plain torch (no Triton): y = 2x, a 8x8 space; ``faulty``: the same,
except that the config ``a=3`` really faults (a NULL read: SIGSEGV), as a miscompiled kernel can.
The evaluations (``slow``, ``quick``) are fake objectives with a known best that leave a file per
evaluation started, so a test can kill a sweep in the middle of a trial.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass

import torch

from tritune import kernels as K


@dataclass(frozen=True)
class Problem:
    n: int


def _run(x, out=None, config=None):
    out = torch.empty_like(x) if out is None else out
    return out.copy_(x * 2)


def _faulty_run(x, out=None, config=None):
    if config == {"a": 3, "b": 2}:
        ctypes.string_at(0)  # a NULL read: SIGSEGV in the process that launches
    return _run(x, out=out, config=config)


def _make_inputs(p, dtype, device, seed, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(p.n, generator=g).to(dtype)
    return K.Case(args=(x,), out=torch.empty_like(x))


def _spec(name, run, params):
    return K.KernelSpec(
        name=name, run=run, reference=lambda x: x.double() * 2, make_inputs=_make_inputs, problems=None,
        space=K.Space(params=params), default_config=lambda p, d: {k: v[0] for k, v in params.items()},
        bucket=lambda p: {"n": p.n}, cost=lambda p, d: K.Cost(1.0, 1.0), problem_of=lambda x, **_: Problem(x.numel()),
        standard_problems=[Problem(64)], small_problems=[Problem(64)], dtypes=(torch.float32,))


TOY = K.REGISTRY.get("sweep_toy") or K.register(
    _spec("sweep_toy", _run, {"a": list(range(1, 9)), "b": list(range(1, 9))}))
FAULTY = K.REGISTRY.get("sweep_faulty") or K.register(
    _spec("sweep_faulty", _faulty_run, {"a": [1, 2, 3, 4], "b": [1, 2]}))


def _value(task) -> float:
    c = task.config
    return 1.0 + (c["a"] - 6) ** 2 + (c["b"] - 3) ** 2  # best: a=6, b=3


def slow(task):
    """Leave ``<pid>-<n>`` in $TRITUNE_TEST_MARKS when an evaluation starts, then take 0.4 s."""
    d = os.environ["TRITUNE_TEST_MARKS"]
    n = len(os.listdir(d))
    open(os.path.join(d, f"{os.getpid()}-{n}"), "w").close()
    time.sleep(0.4)
    return {"ok": True, "ms": _value(task)}


def quick(task):
    return {"ok": True, "ms": _value(task)}
