"""Sweeps that survive kills and faults, for real: a sweep process killed with SIGKILL in the middle of a
trial (journal and sqlite storage; one process, and one of two workers sharing a study), and a config that
really segfaults the process that launches it. Each case takes seconds: fake objectives that sleep, a
spec over plain torch (tests/tritune_sweep_helpers.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from tritune.tuning import optuna_sampler, search

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # worker processes (spawn) inherit it and import the helpers by name
import tritune_sweep_helpers as h  # noqa: E402
from tritune_sweep_helpers import (  # noqa: E402,F401 (own_user_store: an autouse fixture)
    _study, _wait_for, check_completed_exactly, own_user_store, two_workers_one_killed)

CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
import tritune_sweep_helpers as h
from tritune.tuning import search
search.tune([h.TOY], [h.Problem(64)], [torch.float32], trials={trials}, storage={storage!r}, evaluate=h.slow,
            isolation="inline", progress=False)
"""


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_sweep_killed_mid_trial_completes_its_count_on_rerun(tmp_path, kind):
    storage = str(tmp_path / "s.journal") if kind == "journal" else f"sqlite:///{tmp_path / 's.db'}"
    marks = tmp_path / "marks"
    marks.mkdir()
    code = CHILD.format(tests=str(TESTS), trials=10, storage=storage)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TRITUNE_TEST_MARKS": str(marks)})
    try:
        _wait_for(marks, 4, proc)  # the fourth evaluation has started: kill in the middle of it
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    st = _study(storage)
    running = [t for t in st.trials if t.state == TrialState.RUNNING]
    assert len(running) == 1 and running[0].user_attrs["owner"].endswith(f":{proc.pid}")
    before = {t.number: t.value for t in search.evaluated(st.trials)}
    assert len(before) == 3
    (row,) = search.tune([h.TOY], [h.Problem(64)], [torch.float32], trials=10, storage=storage,
                         evaluate=h.quick, isolation="inline", progress=False)
    assert row["trials"] == 10
    check_completed_exactly(storage, 10, before)
    n = len(_study(storage).trials)
    (row,) = search.tune([h.TOY], [h.Problem(64)], [torch.float32], trials=10, storage=storage,
                         evaluate=h.quick, isolation="inline", progress=False)  # nothing left to do
    assert row["trials"] == 10 and len(_study(storage).trials) == n


def test_two_workers_on_a_journal_one_killed(tmp_path, monkeypatch):
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("TRITUNE_TEST_MARKS", str(tmp_path / "marks"))
    two_workers_one_killed(str(tmp_path / "s.journal"), tmp_path / "marks")


def test_a_config_that_segfaults_is_one_failed_trial(tmp_path):
    """The default isolation (a worker process, on the interpreter too): the faulting config kills its
    worker, which is restarted; the sweep evaluates every point and exports the best."""
    storage = str(tmp_path / "s.journal")
    (row,) = search.tune([h.FAULTY], [h.Problem(64)], [torch.float32], trials=100, sampler="grid",
                         storage=storage, progress=False, log=lambda m: None)
    assert row["trials"] == row["n_valid"] == 8 and row["failed"] == 1
    st = optuna.load_study(study_name=row["study"], storage=search.open_storage(storage))
    (bad,) = [t for t in search.evaluated(st.trials) if t.state == TrialState.FAIL]
    assert bad.params == {"a": 3, "b": 2}
    assert bad.user_attrs["error"] == f"worker died (exit code {-signal.SIGSEGV})"
    assert row["config"] is not None


def test_a_config_held_by_another_trial_is_not_timed_twice():
    """Two workers proposing one config at once (or one proposing what another is timing, or what a
    retry waits to time): the trial that claims it second yields, without launching."""
    st = optuna.create_study()
    params = h.TOY.space.params
    dists = {k: optuna.distributions.CategoricalDistribution(v) for k, v in params.items()}
    other = st.ask(dists)
    cfg = dict(other.params)
    st.enqueue_trial(cfg)
    mine = st.ask(dists)
    assert mine.params == cfg
    assert optuna_sampler.claim(st, mine.number, cfg, params, None) == (None, other.number)
    mine.set_user_attr("busy_with", other.number)
    st.tell(other, 3.0)
    st.tell(mine, state=TrialState.FAIL)
    assert search.reap(st, 3600.0) == 0 and len(st.trials) == 2   # a yielded trial is not retried
    queued = optuna.create_study()
    queued.enqueue_trial(cfg, user_attrs={"retry_of": 0})
    assert optuna_sampler.claim(queued, 99, cfg, params, None) == (None, 0)
    assert optuna_sampler.claim(queued, 99, dict(cfg, a=cfg["a"] % 8 + 1), params, None) == (None, None)
