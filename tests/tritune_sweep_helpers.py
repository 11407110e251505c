"""Kernels and evaluations for the sweep tests (imported by name, so worker processes find them too).

``toy``: a registered spec over plain torch (no Triton): y = 2x, a 8x8 space; ``faulty``: the same,
except that the config ``a=3`` really faults (a NULL read: SIGSEGV), as a miscompiled kernel can.
The evaluations (``slow``, ``quick``) are fake objectives with a known best that leave a file per
evaluation started, so a test can kill a sweep in the middle of a trial; the checks below are shared by
the kill tests of every storage.
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from tritune import kernels as K
from tritune.tuning import search
from tritune.kernels.runtime import store


@dataclass(frozen=True)
class Problem:
    n: int


@pytest.fixture(autouse=True)
def own_user_store(tmp_path, monkeypatch):
    """A sweep test's own user config store (autouse in each module that imports it), so tuned results
    never leak into the real one or between tests."""
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path / "user-store"))
    store.clear_cache()
    yield
    store.clear_cache()


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


# ---------------------------------------------------------------------------------------------------
# Checks shared by the kill tests (journal, sqlite, PostgreSQL)
# ---------------------------------------------------------------------------------------------------
def _marks(d: Path) -> list[str]:
    return sorted(os.listdir(d), key=lambda m: int(m.split("-")[1]))


def _wait_for(d: Path, n: int, proc=None, timeout: float = 120.0) -> list[str]:
    t0 = time.time()
    while len(os.listdir(d)) < n:
        assert proc is None or proc.poll() is None, f"the sweep ended early (exit code {proc.returncode})"
        assert time.time() - t0 < timeout, f"no {n} evaluations within {timeout:.0f} s"
        time.sleep(0.02)
    return _marks(d)


def _study(storage: str):
    st = search.open_storage(storage)
    (name,) = [n for n in optuna.get_all_study_names(st) if n.startswith("sweep_toy:")]
    return optuna.load_study(study_name=name, storage=st)


def check_completed_exactly(storage: str, trials: int, before: dict | None = None) -> None:
    """The study has exactly ``trials`` evaluated trials, each config evaluated once; every abandoned
    (killed) trial was retried once with the same config; values measured before the kill are kept."""
    st = _study(storage)
    ts = st.get_trials(deepcopy=False)
    ev = search.evaluated(ts)
    assert len(ev) == trials
    configs = [tuple(sorted(t.params.items())) for t in ev]
    assert len(set(configs)) == trials, "a config was evaluated twice"
    abandoned = [t for t in ts if t.user_attrs.get("abandoned")]
    assert abandoned, "the killed trial was not found"
    for t in abandoned:
        assert t.state == TrialState.FAIL and "error" not in t.user_attrs
        (retry,) = [r for r in ts if r.user_attrs.get("retry_of") == t.number]
        assert retry.params == t.params and retry in ev
    assert not [t for t in ts if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    for number, value in (before or {}).items():
        assert ts[number].value == value


def two_workers_one_killed(storage: str, marks: Path, trials: int = 12) -> None:
    """Two worker processes sweep one study; one is killed with SIGKILL in the middle of a trial; the
    other finishes the study, the killed trial retried: exactly ``trials`` evaluated trials."""
    rows = []
    t = threading.Thread(target=lambda: rows.extend(search.tune(
        [TOY], [Problem(64)], [torch.float32], trials=trials, storage=storage, workers=2, evaluate=slow,
        isolation="inline", progress=False, log=lambda m: None)))
    t.start()
    try:
        victim = int(_wait_for(marks, 3)[-1].split("-")[0])  # its evaluation has just started
        os.kill(victim, signal.SIGKILL)
    finally:
        t.join(180)
    assert not t.is_alive()
    (row,) = rows
    assert row["trials"] == trials
    check_completed_exactly(storage, trials)
    killed = [t for t in _study(storage).trials if t.user_attrs.get("abandoned")]
    assert [t.user_attrs["owner"].rpartition(":")[2] for t in killed] == [str(victim)]


