"""``tritune tune all --budget``: studies stop when converged, the time left then goes to them again with doubled
patience (``fill``; ``--no-fill`` stops at convergence), the time spent kept in
the storage (a killed or cut call resumes with what is left), and the --dry-run plan and estimate.
Fake evaluations over the sweep tests' plain-torch spec (tests/tritune_sweep_helpers.py): seconds each."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

from tritune.tuning import budget as tb, cli as tcli, search, store

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # worker processes (spawn) inherit it and import the helpers by name
import tritune_sweep_helpers as h  # noqa: E402
from tritune_sweep_helpers import _wait_for, own_user_store  # noqa: E402,F401 (an autouse fixture)

SLUG = "nvidia-h200"
NEAR = "nvidia-h100-80gb-hbm3"
PROBLEMS = [h.Problem(64), h.Problem(32)]   # two studies (buckets n=64, n=32)


def _warm_store(config: dict) -> None:
    """The nearest GPU type (an H100) stored ``config`` for both buckets of the toy kernel."""
    d = Path(os.environ["TRITUNE_CONFIG_DIR"]) / NEAR
    d.mkdir(parents=True, exist_ok=True)
    entries = [{"bucket": f"n={p.n}", "dtype": "float32", "config": config, "time_us": 1.0, "default_us": 2.0}
               for p in PROBLEMS]
    (d / "sweep_toy.json").write_text(json.dumps({"format": 1, "kernel": "sweep_toy", "gpu": NEAR,
                                                  "entries": entries}))
    store.clear_cache()


def _studies(storage):
    st = search.open_storage(storage)
    return [optuna.load_study(study_name=n, storage=st) for n in sorted(optuna.get_all_study_names(st))]


def _budget(storage, seconds, evaluate, **kw):
    return tb.tune_budget([h.TOY], seconds, storage=storage, problems=kw.pop("problems", PROBLEMS),
                          dtypes=[torch.float32], slug=kw.pop("slug", SLUG), evaluate=evaluate, isolation="inline",
                          progress=False, log=kw.pop("log", lambda m: None), **kw)


def test_good_seeds_converge_long_before_the_budget(tmp_path):
    """The H100's winner is the optimum: after it, PATIENCE sampler trials without a gain and the study
    stops ('converged'); the call takes seconds of a 10-minute budget, and a rerun does nothing."""
    _warm_store({"a": 6, "b": 3})
    storage = str(tmp_path / "s.journal")
    t0 = time.time()
    rows, near = _budget(storage, 600.0, h.quick, patience=4, fill=False)
    assert near == NEAR and time.time() - t0 < 60
    for r in rows:
        assert r["ledger"]["stop"] == "converged", r["ledger"]
        assert r["best_us"] == 1000.0 and r["config"] == {"a": 6, "b": 3}
        assert r["progress"]["sampler"] == 4 and r["progress"]["since_gain"] == 4
        assert r["trials"] == 2 + 4  # the default, the warm seed, then 4 sampler trials
        assert 0 < r["ledger"]["spent_s"] < time.time() - t0
    text = tb.summary_table(rows, 600.0, time.time() - t0)
    assert "2 converged" in text and "of 10.0 min spent" in text
    n = [len(s.trials) for s in _studies(storage)]
    again, _ = _budget(storage, 600.0, h.quick, patience=4, fill=False)
    assert [len(s.trials) for s in _studies(storage)] == n  # finished studies are skipped
    assert [r["ledger"] for r in again] == [r["ledger"] for r in rows]


def test_time_left_goes_to_the_converged_studies_with_doubled_patience(tmp_path):
    """A poor warm seed and patience 1: without fill both studies stop after one draw without a gain; with
    fill the time left reopens them (patience 2, 4, ...) until their spaces are exhausted or a pass finds
    nothing: they end on the optimum, and each converged study's ledger names the patience it converged at."""
    _warm_store({"a": 1, "b": 8})
    capped = str(tmp_path / "capped.journal")
    rows, _ = _budget(capped, 600.0, h.quick, patience=1, fill=False)
    assert all(r["ledger"]["stop"] == "converged" and r["ledger"]["patience"] == 1 for r in rows)
    n_capped = [r["trials"] for r in rows]
    filled = str(tmp_path / "filled.journal")
    logs = []
    t0 = time.time()
    rows, _ = _budget(filled, 600.0, h.quick, patience=1, log=logs.append)
    assert time.time() - t0 < 120
    assert any("converged studies searched again (patience 2)" in m for m in logs), logs
    for r, capped_n in zip(rows, n_capped):
        assert r["trials"] > capped_n
        assert r["ledger"]["stop"] in ("converged", "exhausted"), r["ledger"]
        if r["ledger"]["stop"] == "converged":
            assert r["ledger"]["patience"] >= 2
        assert r["best_us"] == 1000.0 and r["config"] == {"a": 6, "b": 3}


def test_a_gain_resets_the_patience():
    """Gains are counted only beyond the noise: 2% better resets the count, 1% better does not."""
    def trial(n, v, **attrs):
        return optuna.trial.create_trial(params={"a": n}, distributions={
            "a": optuna.distributions.CategoricalDistribution(list(range(20)))}, value=v,
            user_attrs={"evaluated": {"seconds": 1.0}, **attrs})

    ts = [trial(0, 100.0, default=True), trial(1, 105.0), trial(2, 99.0), trial(3, 97.0), trial(4, 96.5)]
    for i, t in enumerate(ts):
        t.number = i
    p = tb.study_progress(ts, min_gain=0.02)
    assert (p.sampler, p.since_gain, p.best_us) == (4, 1, 96.5)  # 97 was a gain (> 2% under 99), 96.5 not


def test_a_killed_call_resumes_with_the_budget_left(tmp_path):
    """SIGKILL in the middle of a trial; the time spent until the last finished trial is in the storage;
    the rerun continues the killed study (its trial retried, no config evaluated twice) and spends only
    what is left; with nothing left a call evaluates nothing."""
    storage = str(tmp_path / "s.journal")
    marks = tmp_path / "marks"
    marks.mkdir()
    code = (f"import sys, torch; sys.path.insert(0, {str(TESTS)!r}); import tritune_sweep_helpers as h\n"
            "from tritune.tuning import budget as tb\n"
            f"tb.tune_budget([h.TOY], 120.0, storage={storage!r}, problems=[h.Problem(64)], dtypes=[torch.float32], "
            "slug='triton-interpreter', evaluate=h.slow, isolation='inline', progress=False, patience=30)\n")
    env = {**os.environ, "TRITUNE_TEST_MARKS": str(marks)}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        _wait_for(marks, 6, proc)  # the sixth evaluation has started: kill in the middle of it
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_after = time.time() - t0
    (st,) = _studies(storage)
    led = tb.ledger(st)
    assert led["stop"] is None and len(search._evaluated(st.trials)) == 5
    assert 5 * 0.4 <= led["spent_s"] < killed_after  # the finished trials' time (each 0.4 s), not the killed one
    assert [t.state for t in st.trials].count(TrialState.RUNNING) == 1

    logs = []
    rows, _ = _budget(storage, 120.0, h.quick, problems=[h.Problem(64)], slug="triton-interpreter", patience=30,
                      trials=12, log=logs.append)
    assert any(f"{led['spent_s'] / 60:.1f} min of it spent by earlier calls" in m for m in logs)
    (row,) = rows
    assert row["trials"] == 12 and row["ledger"]["stop"] == "trials" and row["ledger"]["calls"] == 2
    assert row["ledger"]["spent_s"] > led["spent_s"]
    (st,) = _studies(storage)
    ev = search._evaluated(st.trials)
    assert len({tuple(sorted(t.params.items())) for t in ev}) == 12, "a config was evaluated twice"
    (abandoned,) = [t for t in st.trials if t.user_attrs.get("abandoned")]
    assert [t.params for t in st.trials if t.user_attrs.get("retry_of") == abandoned.number] == [abandoned.params]

    # a new study on the same storage and budget: the budget is spent, nothing runs (--stop-after 0 too)
    spent = row["ledger"]["spent_s"]
    more, _ = _budget(storage, spent, h.quick, problems=[h.Problem(64), h.Problem(16)], slug="triton-interpreter")
    assert more[1]["trials"] == 0 and more[1]["ledger"]["spent_s"] == 0.0
    more, _ = _budget(storage, 600.0, h.quick, problems=[h.Problem(16)], slug="triton-interpreter", stop_after=0.0)
    assert more[0]["trials"] == 0


def test_the_budget_ends_studies_and_the_rest_goes_to_a_later_call(tmp_path):
    """No seed is good and the budget is short: the studies stop 'budget'; a second call with more budget
    continues them (the calls count), and the summary says so."""
    storage = str(tmp_path / "s.journal")

    def slow_quick(task):
        time.sleep(0.05)
        return h.quick(task)

    rows, _ = _budget(storage, 1.0, slow_quick, patience=64)
    assert {r["ledger"]["stop"] for r in rows} <= {"budget", None}
    assert tb.spent_s(rows) < 1.0 + 0.5  # the cap, but for the trial in flight and re-timing
    n1 = sum(r["trials"] for r in rows)
    rows, _ = _budget(storage, 3.0, slow_quick, patience=64)
    assert sum(r["trials"] for r in rows) > n1
    assert "budget" in tb.summary_table(rows, 3.0)


def test_dry_run_lists_studies_split_and_estimate(tmp_path, capsys):
    _warm_store({"a": 6, "b": 3})
    storage = str(tmp_path / "s.journal")
    _budget(storage, 600.0, h.quick, patience=4, problems=[h.Problem(64)], fill=False)
    text = tb.dry_run([h.TOY], 600.0, storage=storage, dtypes=[torch.float32], problems=PROBLEMS, slug=SLUG,
                      patience=4)
    assert "2 studies, 1 to run (1 finished in the storage)" in text
    assert "converged" in text and "warm start from nvidia-h100-80gb-hbm3" in text
    assert "estimate" in text and "min left" in text
    # the CLI: one line and exit 2 for the options that need --budget
    assert tcli.main(["tune", "sweep_toy", "--dry-run", "--storage", storage]) == 2
    assert "--dry-run goes with --budget" in capsys.readouterr().err
    assert tcli.main(["tune", "sweep_toy", "--budget", "1m", "--stop-after", "soon", "--storage", storage]) == 2
    assert tcli.main(["tune", "sweep_toy", "--budget", "1m", "--as-gpu", SLUG, "--storage", storage]) == 2
    assert tcli.main(["tune", "sweep_toy", "--budget", "10m", "--dry-run", "--storage", storage]) == 0
    assert "estimate" in capsys.readouterr().out
