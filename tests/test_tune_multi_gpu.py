"""``tritune tune all --budget B`` over every visible GPU: the studies partitioned among worker processes
(one per GPU, one shared storage) so that no study is timed by two of them, each worker on its share with
the whole budget, the summary over every study at the end. On the CPU the workers run side by side without
a GPU each (``--workers 2``); fake evaluations over the sweep tests' plain-torch spec, and one real CLI run
of gelu through the interpreter."""
from __future__ import annotations

import argparse
import json
import math
import random
import socket
import sys
from pathlib import Path

import pytest
import torch

from tritune import kernels as K
from tritune.harness.cli import tune as tcli
from tritune.kernels.runtime import device as dev, store
from tritune.tuning import budget as tb, search, spread
from tritune.tuning.study import plan, resolve_specs

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # worker processes (spawn) inherit it and import the helpers by name
import tritune_sweep_helpers as h  # noqa: E402
from tritune_sweep_helpers import own_user_store  # noqa: E402,F401 (an autouse fixture)

SLUG = "nvidia-h200"
PROBLEMS = [h.Problem(64), h.Problem(32), h.Problem(16), h.Problem(128)]   # four studies (buckets n=...)


class FakeJob:
    def __init__(self, name):
        self.name = name


def _loads(shares, cost):
    return [sum(cost(j) for j in s) for s in shares]


def test_partition_puts_each_study_in_one_share_balanced_and_deterministic():
    rng = random.Random(7)
    jobs = [FakeJob(f"k{i % 3}:n={i}") for i in range(23)]
    costs = {j.name: rng.choice([1.0, 2.0, 5.0, 13.0, 40.0]) for j in jobs}
    cost = lambda j: costs[j.name]   # noqa: E731
    for n in (1, 2, 3, 8, 30):
        shares = spread.partition(jobs, n, cost)
        assert len(shares) == n
        names = [j.name for s in shares for j in s]
        assert sorted(names) == sorted(j.name for j in jobs)            # each study in exactly one share
        for s in shares:                                                # a share keeps the plan's order
            assert [jobs.index(j) for j in s] == sorted(jobs.index(j) for j in s)
        loads = _loads(shares, cost)
        # longest-first greedy: no share is ahead of the lightest by more than one study's cost
        assert max(loads) - min(loads) <= max(costs.values())
        assert max(loads) <= sum(costs.values()) / n + max(costs.values())
        # the same plan gives the same shares, in whatever order its studies come
        again = spread.partition(sorted(jobs, key=lambda j: rng.random()), n, cost)
        assert [sorted(j.name for j in s) for s in again] == [sorted(j.name for j in s) for s in shares]
    with pytest.raises(ValueError):
        spread.partition(jobs, 0, cost)


def test_study_cost_of_the_real_plan_and_its_two_shares():
    jobs = plan(resolve_specs(["gelu", "layer_norm"]), None, [torch.float32], "triton-interpreter")
    costs = {j.name: spread.study_cost(j) for j in jobs}
    assert all(math.isfinite(c) and c > 0 for c in costs.values())
    shares = spread.partition(jobs, 2)
    assert sorted(j.name for s in shares for j in s) == sorted(costs) and all(shares)
    loads = [sum(costs[j.name] for j in s) for s in shares]
    assert max(loads) - min(loads) <= max(costs.values())
    assert [[j.name for j in s] for s in spread.partition(jobs, 2)] == [[j.name for j in s] for s in shares]


def test_two_workers_time_each_study_in_one_process(tmp_path):
    storage, logs = str(tmp_path / "s.journal"), []
    rows, near, workers = spread.tune_budget_spread(
        [h.TOY], 600.0, workers=2, storage=storage, problems=PROBLEMS, dtypes=[torch.float32], slug=SLUG,
        evaluate=h.quick, isolation="inline", progress=False, log=logs.append, patience=4, fill=False)
    assert [w["exitcode"] for w in workers] == [0, 0] and len({w["pid"] for w in workers}) == 2
    assert [w["studies"] for w in workers] == [[j.name for j in s] for s in spread.partition(
        plan([h.TOY], PROBLEMS, [torch.float32], SLUG), 2)]
    assert [len(w["studies"]) for w in workers] == [2, 2]   # four studies of one cost: two each
    for w in workers:   # (on a GPU host: "... (pid P) on GPU g: 2 studies")
        gpu = "" if w["gpu"] is None else f" on GPU {w['gpu']}"
        assert f"tune: worker {w['index']} (pid {w['pid']}){gpu}: 2 studies" in logs
    owner = {name: f"{socket.gethostname()}:{w['pid']}" for w in workers for name in w["studies"]}
    assert sorted(r["study"] for r in rows) == sorted(owner)
    for r in rows:   # every trial of a study timed by the one worker whose share it is
        assert r["workers"] == [owner[r["study"]]], r
        assert r["ledger"]["stop"] == "converged" and r["trials"] >= 5 and r["best_us"] <= r["default_us"]
    # the rows read back equal what the parent returns; a rerun of the same command has nothing left to run
    assert [r["trials"] for r in tb.study_rows(plan([h.TOY], PROBLEMS, [torch.float32], SLUG), storage)] == \
        [r["trials"] for r in rows]
    again, _, _ = spread.tune_budget_spread(
        [h.TOY], 600.0, workers=2, storage=storage, problems=PROBLEMS, dtypes=[torch.float32], slug=SLUG,
        evaluate=h.quick, isolation="inline", progress=False, log=logs.append, patience=4, fill=False)
    assert [r["trials"] for r in again] == [r["trials"] for r in rows]
    # the exported winners are valid store entries, one per study
    search.export(storage, ["sweep_toy"], slug=SLUG, root=tmp_path / "cfg", log=lambda *a: None)
    entries = store.validate(json.loads((tmp_path / "cfg" / SLUG / "sweep_toy.json").read_text()), "sweep_toy", SLUG)
    assert sorted(e["bucket"] for e in entries) == sorted(f"n={p.n}" for p in PROBLEMS)
    for e in entries:
        assert h.TOY.space.why_invalid(e["config"], h.Problem(int(e["bucket"][2:])), torch.float32) is None
        assert e["time_us"] <= e["default_us"]


def test_a_failing_worker_is_reported_and_the_rows_still_come(tmp_path):
    logs = []   # patience 0 is refused by tune_budget, in each worker: both exit non-zero
    rows, _, workers = spread.tune_budget_spread(
        [h.TOY], 600.0, workers=2, storage=str(tmp_path / "s.journal"), problems=PROBLEMS[:2],
        dtypes=[torch.float32], slug=SLUG, evaluate=h.quick, isolation="inline", progress=False, log=logs.append,
        patience=0)
    assert [bool(w["exitcode"]) for w in workers] == [True, True]
    assert sum("exited with code" in m and "the same command resumes" in m for m in logs) == 2
    assert [r["trials"] for r in rows] == [0, 0]


def test_the_budget_cli_runs_two_workers_on_gelu(tmp_path, capsys):
    storage, cfg = str(tmp_path / "s.journal"), tmp_path / "cfg"
    rc = tcli.main(["tune", "gelu", "--problems", "numel=1021;numel=4099", "--dtype", "fp32", "--budget", "2m",
                    "--workers", "2", "--trials", "3", "--patience", "1", "--no-fill", "--retime-rounds", "1",
                    "--isolation", "inline", "--storage", storage, "--export", "--configs-dir", str(cfg), "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tune: worker 0 (pid " in err and "tune: worker 1 (pid " in err and ": 1 studies" in err
    assert "tune: 2 workers, each with the 2.0 min budget" in err
    assert "budget: " in out and "of 4.0 min spent" in out   # the summary over both workers' studies
    slug = dev.gpu_slug()
    entries = store.validate(json.loads((cfg / slug / "gelu.json").read_text()), "gelu", slug)
    assert len(entries) == 2
    for e in entries:
        n = int(e["bucket"].split("=")[1].split(",")[0])
        assert K.get("gelu").space.why_invalid(e["config"], type(K.get("gelu").small_problems[0])(n),
                                              torch.float32) is None


def _fake_spread(calls, exitcode=0):
    def fake(specs, budget, *, workers, **kw):
        calls.append(dict(kw, workers=workers, budget=budget))
        return [], None, [{"index": i, "pid": 1, "gpu": str(i), "studies": [], "exitcode": exitcode}
                          for i in range(workers)]
    return fake


def test_budget_workers_default_to_the_visible_gpus(tmp_path, monkeypatch, capsys):
    storage = str(tmp_path / "s.journal")
    base = ["tune", "sweep_toy", "--budget", "1m", "--storage", storage, "--quiet", "--isolation", "inline"]
    calls = []
    monkeypatch.setattr(spread, "tune_budget_spread", _fake_spread(calls))
    monkeypatch.setattr(search, "visible_gpus", lambda: ["0", "1", "2"])
    assert tcli.main(base) == 0
    assert [c["workers"] for c in calls] == [3] and calls[0]["budget"] == 60.0 and "slug" not in calls[0]
    assert tcli.main(base + ["--workers", "2"]) == 0 and calls[-1]["workers"] == 2
    monkeypatch.setattr(spread, "tune_budget_spread", _fake_spread(calls, exitcode=1))
    assert tcli.main(base + ["--workers", "2"]) == 1   # a worker's failure: the command fails
    # one GPU (or none: the interpreter) runs today's single process
    monkeypatch.setattr(spread, "tune_budget_spread", lambda *a, **k: pytest.fail("spread on one GPU"))
    monkeypatch.setattr(search, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(tb, "tune_budget", lambda *a, **k: ([], None))
    assert tcli.main(base) == 0
    assert tcli.main(base + ["--workers", "1"]) == 0
    capsys.readouterr()
    # --workers 0: one line, exit 2; --budget with --compare-samplers is still refused
    assert tcli.main(base + ["--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--workers 0: expected at least 1" in err
    assert tcli.main(base + ["--compare-samplers"]) == 2
    assert "--compare-samplers" in capsys.readouterr().err


def test_hosts_split_the_plan_disjointly():
    """``--host i/n``: the hosts' shares cover the plan once, the same for every host that computes them."""
    from tritune.tuning import spread
    from tritune.tuning.study import plan, resolve_specs

    jobs = plan(resolve_specs(["gelu", "rms_norm"]), None, None, "nvidia-h200", lambda m: None)
    shares = [spread.host_share(jobs, (i, 3)) for i in range(3)]
    names = [j.name for s in shares for j in s]
    assert sorted(names) == sorted(j.name for j in jobs) and len(set(names)) == len(names)
    assert [j.name for j in spread.host_share(jobs, (1, 3))] == [j.name for j in shares[1]]
    with pytest.raises(ValueError, match="host"):
        spread.host_share(jobs, (3, 3))


def test_host_flag_is_checked():
    from tritune.harness.cli.tune import host_share_arg

    assert host_share_arg("1/2") == (1, 2)
    for bad in ("2/2", "x/2", "1", "-1/2"):
        with pytest.raises(argparse.ArgumentTypeError):
            host_share_arg(bad)
