"""``tritune tune all --budget``: each study walks from its best seed through one-step neighbours before its sampler
proposes, and stops when converged; the time left then goes to them again with doubled patience (``fill``;
``--no-fill`` stops at convergence), the most promising first, each searched around its best and from its nearest
buckets' winners; the time spent kept in the storage (a killed or cut call resumes with what is left, no local
point evaluated again), and the --dry-run plan and estimate.
Fake evaluations over the sweep tests' plain-torch spec (tests/tritune_sweep_helpers.py) and a 4096-point bowl
(below): seconds each."""
from __future__ import annotations

import dataclasses

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

from tritune.tuning import budget as tb, estimate, fill, ledger, local, retime as rtm, search, turn

from tritune.harness.cli import tune as tcli

from tritune.kernels.runtime import store

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # worker processes (spawn) inherit it and import the helpers by name
import tritune_sweep_helpers as h  # noqa: E402
from tritune import kernels as K  # noqa: E402
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
    """The H100's winner is the optimum: its 4 neighbours bring no gain, which is the patience (4), and the
    study stops ('converged'); the call takes seconds of a 10-minute budget, and a rerun does nothing."""
    _warm_store({"a": 6, "b": 3})
    storage = str(tmp_path / "s.journal")
    t0 = time.time()
    rows, near = _budget(storage, 600.0, h.quick, patience=4, fill=False)
    assert near == NEAR and time.time() - t0 < 60
    for r in rows:
        assert r["ledger"]["stop"] == "converged", r["ledger"]
        assert r["best_us"] == 1000.0 and r["config"] == {"a": 6, "b": 3}
        assert r["progress"]["sampler"] == r["progress"]["local"] == 4 and r["progress"]["since_gain"] == 4
        assert r["trials"] == 2 + 4  # the default, the warm seed, then its 4 neighbours
        assert 0 < r["ledger"]["spent_s"] < time.time() - t0
    text = ledger.summary_table(rows, 600.0, time.time() - t0)
    assert "2 converged" in text and "of 10.0 min spent" in text
    n = [len(s.trials) for s in _studies(storage)]
    again, _ = _budget(storage, 600.0, h.quick, patience=4, fill=False)
    assert [len(s.trials) for s in _studies(storage)] == n  # finished studies are skipped
    assert [r["ledger"] for r in again] == [r["ledger"] for r in rows]


def test_time_left_goes_to_the_converged_studies_with_doubled_patience(tmp_path):
    """A poor warm seed and patience 1: without fill both studies stop once the descent from the default
    found nothing around its best; with fill the time left reopens them (patience 2, 4, ...) until their
    spaces are exhausted: they end on the optimum, and each converged study's ledger names the patience it
    converged at."""
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
    assert any("fill pass 1: 2 studies searched again (patience 2;" in m for m in logs), logs
    for r, capped_n in zip(rows, n_capped):
        assert r["trials"] > capped_n
        assert r["ledger"]["stop"] in ("converged", "exhausted"), r["ledger"]
        if r["ledger"]["stop"] == "converged":
            assert r["ledger"]["patience"] >= 2
        assert r["best_us"] == 1000.0 and r["config"] == {"a": 6, "b": 3}


def test_a_fill_pass_that_evaluates_nothing_is_followed_by_the_next_level(tmp_path):
    """The warm seed is the optimum: phase 2 evaluates its 4 neighbours (no gain), so patience 1 converged it
    4 trials without a gain ago; the fill's passes at patience 2 and 4 evaluate nothing, the one at 8 gets
    4 sampler draws (the fill does not end on an empty pass while a study is converged), the one at 16 the
    2 left to the trial cap."""
    _warm_store({"a": 6, "b": 3})
    logs = []
    (row,), _ = _budget(str(tmp_path / "s.journal"), 600.0, h.quick, patience=1, trials=12, log=logs.append,
                        problems=[h.Problem(64)])
    assert row["ledger"]["stop"] == "trials" and row["trials"] == 12 and row["progress"]["local"] == 4
    passes = [m.split(": ", 2)[2] for m in logs if "fill pass" in m]
    assert [p.split(" (")[1].split(";")[0] for p in passes] == ["patience 2", "patience 4", "patience 8",
                                                                   "patience 16"], logs


def test_a_gain_resets_the_patience():
    """Gains are counted only beyond the noise: 2% better resets the count, 1% better does not."""
    def trial(n, v, **attrs):
        return optuna.trial.create_trial(params={"a": n}, distributions={
            "a": optuna.distributions.CategoricalDistribution(list(range(20)))}, value=v,
            user_attrs={"evaluated": {"seconds": 1.0}, **attrs})

    ts = [trial(0, 100.0, default=True), trial(1, 105.0), trial(2, 99.0), trial(3, 97.0), trial(4, 96.5)]
    for i, t in enumerate(ts):
        t.number = i
    p = turn.study_progress(ts, min_gain=0.02)
    assert (p.sampler, p.since_gain, p.best_us) == (4, 1, 96.5)  # 97 was a gain (> 2% under 99), 96.5 not


def test_a_killed_call_resumes_with_the_budget_left(tmp_path):
    """SIGKILL in the middle of a trial of phase 2's descent (no warm seed: it walks from the default); the
    time spent until the last finished trial is in the storage; the rerun continues the killed study (its
    trial retried as a local one, around the same centre; no local point evaluated again) and spends only
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
    led = ledger.ledger(st)
    assert led["stop"] is None and len(search.evaluated(st.trials)) == 5
    assert 5 * 0.4 <= led["spent_s"] < killed_after  # the finished trials' time (each 0.4 s), not the killed one
    assert [t.state for t in st.trials].count(TrialState.RUNNING) == 1
    assert [bool(t.user_attrs.get("local")) for t in st.trials] == [False] + [True] * 5  # the default, then local

    logs = []
    rows, _ = _budget(storage, 120.0, h.quick, problems=[h.Problem(64)], slug="triton-interpreter", patience=30,
                      trials=12, log=logs.append)
    assert any(f"{led['spent_s'] / 60:.1f} min of it spent by earlier calls" in m for m in logs)
    (row,) = rows
    assert row["trials"] == 12 and row["ledger"]["stop"] == "trials" and row["ledger"]["calls"] == 2
    assert row["ledger"]["spent_s"] > led["spent_s"]
    (st,) = _studies(storage)
    ev = search.evaluated(st.trials)
    assert len({tuple(sorted(t.params.items())) for t in ev}) == 12, "a config was evaluated twice"
    (abandoned,) = [t for t in st.trials if t.user_attrs.get("abandoned")]
    (retry,) = [t for t in st.trials if t.user_attrs.get("retry_of") == abandoned.number]
    assert retry.params == abandoned.params and retry in ev
    assert retry.user_attrs["local"] and retry.user_attrs["local_of"] == abandoned.user_attrs["local_of"]
    assert row["progress"]["local"] == 11 and row["config"] == {"a": 6, "b": 3}  # the default, then the descent

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
    assert ledger.spent_s(rows) < 1.0 + 0.5  # the cap, but for the trial in flight and re-timing
    n1 = sum(r["trials"] for r in rows)
    rows, _ = _budget(storage, 3.0, slow_quick, patience=64)
    assert sum(r["trials"] for r in rows) > n1
    assert "budget" in ledger.summary_table(rows, 3.0)


def test_dry_run_lists_studies_split_and_estimate(tmp_path, capsys):
    _warm_store({"a": 6, "b": 3})
    storage = str(tmp_path / "s.journal")
    _budget(storage, 600.0, h.quick, patience=4, problems=[h.Problem(64)], fill=False)
    text = estimate.dry_run([h.TOY], 600.0, storage=storage, dtypes=[torch.float32], problems=PROBLEMS, slug=SLUG,
                      patience=4)
    assert "2 studies, 1 to run (1 finished in the storage)" in text
    assert "converged" in text and "warm start from nvidia-h100-80gb-hbm3" in text
    assert "estimate" in text and "min left" in text
    # phase 2's local search: the best seed's (the warm optimum's) 4 neighbours, counted before the patience
    assert "its nearest buckets' bests, local search from its best" in text
    assert "at least the best seed's neighbours" in text
    head, rule, *body = text.splitlines()
    col = head.split().index("neighbours") - 1  # "valid points" is one column of two words
    assert [line.split()[col] for line in body[:2]] == ["4", "4"]
    # the CLI: one line and exit 2 for the options that need --budget
    assert tcli.main(["tune", "sweep_toy", "--dry-run", "--storage", storage]) == 2
    assert "--dry-run goes with --budget" in capsys.readouterr().err
    assert tcli.main(["tune", "sweep_toy", "--budget", "1m", "--stop-after", "soon", "--storage", storage]) == 2
    assert tcli.main(["tune", "sweep_toy", "--budget", "1m", "--as-gpu", SLUG, "--storage", storage]) == 2
    assert tcli.main(["tune", "sweep_toy", "--budget", "10m", "--dry-run", "--storage", storage]) == 0
    assert "estimate" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# The search: local search around the best (phase 2 and the fill); the fill's nearest buckets' winners, promise
# ---------------------------------------------------------------------------------------------------
BOWL_PARAMS = {k: list(range(1, 9)) for k in "abcd"}   # 4096 points: a sampler's draw hits the optimum rarely


def _bowl_constraint(c, p, dtype):
    if c["d"] == 7:
        return "d=7 never fits"
    if c["a"] > p.n // 8:
        return "a larger than n/8"
    return None


BOWL = K.KernelSpec(
    name="tune_all_bowl", run=h._run, reference=lambda x: x.double() * 2, make_inputs=h._make_inputs, problems=None,
    space=K.Space(params=BOWL_PARAMS, constraint=_bowl_constraint),
    default_config=lambda p, d: dict.fromkeys("abcd", 1),
    bucket=lambda p: {"n": p.n}, cost=lambda p, d: K.Cost(1.0, 1.0), problem_of=lambda x, **_: h.Problem(x.numel()),
    standard_problems=[h.Problem(64)], small_problems=[h.Problem(64)], dtypes=(torch.float32,))
OPT = {"a": 6, "b": 6, "c": 6, "d": 6}


def _bowl(task):
    """10 µs at OPT, 10 µs more per squared step away: every step towards it a gain of >= 25%."""
    return {"ok": True, "ms": (10.0 + 10.0 * sum((task.config[k] - OPT[k]) ** 2 for k in OPT)) * 1e-3}


@pytest.fixture
def bowl(monkeypatch):
    monkeypatch.setitem(K.REGISTRY, BOWL.name, BOWL)
    return BOWL


def _warm(kernel: str, entries: dict) -> None:
    """The nearest GPU type (an H100) stored ``entries`` (bucket -> config) for ``kernel``."""
    d = Path(os.environ["TRITUNE_CONFIG_DIR"]) / NEAR
    d.mkdir(parents=True, exist_ok=True)
    rows = [{"bucket": b, "dtype": "float32", "config": c, "time_us": 1.0, "default_us": 2.0}
            for b, c in entries.items()]
    (d / f"{kernel}.json").write_text(json.dumps({"format": 1, "kernel": kernel, "gpu": NEAR, "entries": rows}))
    store.clear_cache()


def _key(cfg) -> tuple:
    return tuple(sorted(cfg.items()))


def _bowl_budget(storage, **kw):
    return tb.tune_budget([BOWL], 600.0, storage=storage, problems=[h.Problem(64)],
                          dtypes=[torch.float32], slug=SLUG, evaluate=_bowl, isolation="inline", progress=False,
                          log=kw.pop("log", lambda m: None), **kw)


def _check_local_trials(st, problem) -> None:
    """Each local trial a valid one-step neighbour of the trial it names (the best when it was enqueued);
    no config evaluated twice."""
    ev = search.evaluated(st.trials)
    by_number = {t.number: t for t in st.trials}
    for t in (t for t in ev if t.user_attrs.get("local")):
        assert BOWL.space.why_invalid(t.params, problem, torch.float32) is None
        centre = by_number[t.user_attrs["local_of"]].params
        moved = [k for k in OPT if t.params[k] != centre[k]]
        assert len(moved) == 1 and abs(t.params[moved[0]] - centre[moved[0]]) == 1, (centre, t.params)
    assert len({_key(t.params) for t in ev}) == len(ev), "a config was evaluated twice"


def test_phase2_walks_from_the_seed_to_an_optimum_before_any_draw(tmp_path, bowl):
    """The H100's winner is 3 coordinate steps (a, b, c: +1 each) from the optimum of a 4096-point space. Phase 2
    (no fill, patience 1) walks there through one-step neighbours within 3 neighbourhoods (<= 8 each), evaluates
    the optimum's whole neighbourhood and converges without one sampler draw: every neighbour valid, none
    evaluated twice, each counted in the summary."""
    _warm(BOWL.name, {"n=64": {"a": 5, "b": 5, "c": 5, "d": 6}})
    storage = str(tmp_path / "s.journal")
    rows, _ = _bowl_budget(storage, patience=1, fill=False)
    (row,) = rows
    assert row["config"] == OPT and row["best_us"] == 10.0 and row["ledger"]["stop"] == "converged"
    (st,) = _studies(storage)
    ev = sorted(search.evaluated(st.trials), key=lambda t: t.number)
    roles = ["seed" if t.user_attrs.get("default") or t.user_attrs.get("warm") else
             "local" if t.user_attrs.get("local") else "sampler" for t in ev]
    assert roles[:2] == ["seed", "seed"] and set(roles[2:]) == {"local"}, roles  # no draw at all
    first = next(i for i, t in enumerate(ev) if t.params == OPT)
    assert first - 2 <= 3 * 8
    around = {_key(n) for n in local.neighbours(BOWL.space, OPT, h.Problem(64), torch.float32)}
    assert around <= {_key(t.params) for t in ev}, "the optimum's neighbourhood was not exhausted"
    _check_local_trials(st, h.Problem(64))
    p = row["progress"]
    assert p["local"] == p["sampler"] == len(ev) - 2 and p["local_gains"] >= 3
    assert p["since_gain"] == len(ev) - first - 1 > 0  # after the optimum: the rest of its neighbourhood
    text = ledger.summary_table(rows, 600.0)
    assert f"local search: {p['local']} trials" in text and "local (gains)" in text


def test_an_exhausted_neighbourhood_hands_over_to_the_sampler(tmp_path):
    """The warm seed is the optimum: its 4 neighbours bring no gain, then the sampler proposes until the
    patience (6) is reached; a draw that takes the lead opens its own neighbourhood to the descent."""
    _warm_store({"a": 6, "b": 3})
    storage = str(tmp_path / "s.journal")
    rows, _ = _budget(storage, 600.0, h.quick, patience=6, fill=False, problems=[h.Problem(64)])
    (row,) = rows
    assert row["ledger"]["stop"] == "converged" and row["config"] == {"a": 6, "b": 3}
    (st,) = _studies(storage)
    ev = sorted(search.evaluated(st.trials), key=lambda t: t.number)
    roles = ["seed" if t.user_attrs.get("default") or t.user_attrs.get("warm") else
             "local" if t.user_attrs.get("local") else "sampler" for t in ev]
    assert roles == ["seed"] * 2 + ["local"] * 4 + ["sampler"] * 2, roles
    assert {_key(t.params) for t in ev[2:6]} == {_key({"a": a, "b": b}) for a, b in ((5, 3), (7, 3), (6, 2), (6, 4))}
    assert row["progress"]["since_gain"] == 6 and row["progress"]["local"] == 4
    # a draw far away that wins (as a seeded trial would): the descent resumes around it, not the sampler
    (job,) = search.plan([h.TOY], [h.Problem(64)], [torch.float32], SLUG)
    dist = {k: optuna.distributions.CategoricalDistribution(v) for k, v in h.TOY.space.params.items()}
    st.add_trial(optuna.trial.create_trial(params={"a": 2, "b": 7}, distributions=dist, value=0.5, user_attrs={
        "evaluated": {"seconds": 0.1, "source": search.code_version(h.TOY.name)}}))
    winner = st.trials[-1]
    cfg, of = local.Local(job).next_config(search.current_trials(st.trials, search.code_version(h.TOY.name)))
    assert of == winner.number and cfg == {"a": 1, "b": 7}


def test_the_fill_continues_a_descent_its_turn_cut_short(tmp_path, bowl, monkeypatch):
    """With 4 neighbours a turn (LOCAL_MAX), phase 2 stops its descent half-way, where patience 1 ends it
    (a call without fill); the next call's fill continues the same descent (the study gaining, so first)
    and reaches the optimum through local trials; a trial cap ends the fill's passes."""
    monkeypatch.setattr(local, "LOCAL_MAX", 4)
    _warm(BOWL.name, {"n=64": {"a": 5, "b": 5, "c": 5, "d": 6}})
    storage = str(tmp_path / "s.journal")
    (row,), _ = _bowl_budget(storage, patience=1, fill=False)
    assert row["config"] != OPT and row["ledger"]["stop"] == "converged" and row["progress"]["local"] == 4
    n2 = row["trials"]
    logs = []
    (row,), _ = _bowl_budget(storage, patience=1, log=logs.append, trials=24)
    assert row["config"] == OPT and row["ledger"]["stop"] == "trials" and row["trials"] == 24
    assert any("fill pass 1: 1 studies searched again (patience 2; 1 gaining;" in m for m in logs), logs
    (st,) = _studies(storage)
    ev = sorted(search.evaluated(st.trials), key=lambda t: t.number)
    first = next(i for i, t in enumerate(ev) if t.params == OPT)
    assert first >= n2 and ev[first].user_attrs.get("local"), "the fill's descent did not reach the optimum"
    _check_local_trials(st, h.Problem(64))


def test_neighbours_of_the_h100_seeds_on_the_h200s_two_hard_buckets():
    """The two buckets the H200's 30 min budget missed: each neighbour one valid step from the H100's seed,
    the committed H200 config reachable step by step (its num_stages 5 only once BLOCK_N is 64: 240 KiB of
    shared memory with BLOCK_N 128); a boolean's neighbour is its flip; the move that just won goes first."""
    gemm, gemv = K.get("gemm"), K.get("gemv")
    gp = next(p for p in gemm.standard_problems if (p.M, p.N, p.K) == (512, 768, 3072))
    seed = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=4, TMA=False,
                PERSISTENT=False)
    ns = local.neighbours(gemm.space, seed, gp, torch.bfloat16, repair=0)
    assert 0 < len(ns) <= 2 * len(seed)
    for n in ns:
        assert gemm.space.why_invalid(n, gp, torch.bfloat16) is None
        (k,) = [k for k in seed if n[k] != seed[k]]
        ch = gemm.space.params[k]
        assert abs(ch.index(n[k]) - ch.index(seed[k])) == 1 or isinstance(seed[k], bool)
    moves = [{k: v for k, v in n.items() if v != seed[k]} for n in ns]
    for m in ({"BLOCK_N": 64}, {"GROUP_M": 4}, {"num_warps": 8}, {"TMA": True}):
        assert m in moves
    assert {"num_stages": 5} not in moves  # invalid here, valid one step later:
    bn64 = dict(seed, BLOCK_N=64)
    assert {"num_stages": 5} in [{k: v for k, v in n.items() if v != bn64[k]}
                                 for n in local.neighbours(gemm.space, bn64, gp, torch.bfloat16, repair=0)]
    vp = next(p for p in gemv.standard_problems if (p.M, p.N, p.K, p.ln) == (1, 768, 3072, False))
    vseed = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, SPLIT_K=16, num_warps=1, num_stages=2)
    moves = [{k: v for k, v in n.items() if v != vseed[k]}
             for n in local.neighbours(gemv.space, vseed, vp, torch.bfloat16, repair=0)]
    assert {"BLOCK_N": 32} in moves and {"num_stages": 3} in moves
    s3 = dict(vseed, num_stages=3)
    assert local.neighbours(gemv.space, s3, vp, torch.bfloat16, first=("num_stages", 1))[0] == dict(vseed, num_stages=4)


def test_refused_moves_are_repaired_across_the_constraint():
    """quant_matmul int4 M=1 4096x4096 on the H200: the study sat on the GEMV path (BLOCK_M 1, 4 warps);
    BLOCK_M 1 -> 8 is refused there (idle warps), so the tiled path (the committed winner: BLOCK_M 8) was
    out of one-step reach. Repaired moves come after every plain one, valid, keep the moved value, and
    differ in at most REPAIR_STEPS more steps; repair=0 gives the plain moves alone."""
    qm = K.get("quant_matmul")
    p = next(p for p in qm.standard_problems if (p.bits, p.M, p.N, p.K) == (4, 1, 4096, 4096))
    best = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=1)
    plain = local.neighbours(qm.space, best, p, torch.bfloat16, repair=0)
    assert all(n["BLOCK_M"] == 1 for n in plain)
    ns = local.neighbours(qm.space, best, p, torch.bfloat16)
    assert ns[:len(plain)] == plain and len(ns) > len(plain)
    tiled = [n for n in ns[len(plain):] if n["BLOCK_M"] == 8]
    assert tiled, "BLOCK_M 8 reachable in one repaired move"
    ch = qm.space.params
    for n in ns[len(plain):]:
        assert qm.space.why_invalid(n, p, torch.bfloat16) is None
        steps = [abs(ch[k].index(n[k]) - ch[k].index(best[k])) for k in best if n[k] != best[k]]
        assert 2 <= sum(steps) <= 1 + local.REPAIR_STEPS
    assert dict(best, BLOCK_M=8, num_warps=1) in tiled or dict(best, BLOCK_M=8, BLOCK_N=64) in tiled
    assert len({tuple(sorted(n.items())) for n in ns}) == len(ns)

def test_fill_passes_go_by_promise():
    """Gaining studies first (the larger gain first) with 4x the stale ones' share, then open neighbourhoods
    (2x), then the studies whose last turn found nothing around a fully evaluated best; the shares follow."""
    assert fill.promise(0.05, False) == "gaining" and fill.promise(0.01, True) == "open"
    assert fill.promise(0.0, False) == "stale" and fill.promise(0.019, False, min_gain=0.02) == "stale"
    items = [("s1", "stale", 0.0), ("o1", "open", 0.0), ("g1", "gaining", 0.05), ("s2", "stale", 0.0),
             ("g2", "gaining", 0.30), ("o2", "open", 0.01)]
    assert fill.by_promise(items) == [("g2", 4), ("g1", 4), ("o1", 2), ("o2", 2), ("s1", 1), ("s2", 1)]


def test_the_pass_shares_follow_the_weights(tmp_path, monkeypatch):
    """_search_pass: each study's share is its weight over the weights of those still to run, of the time left
    until the pass's end less what is kept back (asked before each turn), RETIME_SHARE of it for re-timing."""
    jobs = search.plan([h.TOY], [h.Problem(64), h.Problem(32), h.Problem(16)], [torch.float32], SLUG)
    st = search.open_storage(str(tmp_path / "s.journal"))
    studies = {j.name: search.open_study(st, j) for j in jobs}
    shares, kept = [], []
    clock = type("Clock", (), {"t": 1000.0, "time": lambda self: self.t})()

    def fake_sweep(study, job, runner, *, share_end, **kw):  # takes its whole share
        shares.append((job.bucket, share_end - clock.t, kw["local"]))
        clock.t = share_end
        return "budget"

    monkeypatch.setattr(turn, "sweep_study", fake_sweep)
    monkeypatch.setattr(turn, "time", clock)
    budget = tb.Budget(100.0, 0.0, started=clock.t)   # ends at 1100: 30 s after the pass's end
    seen = []
    turns = turn.search_pass(jobs, studies, None, budget, search.Progress(3, enabled=False),
                            lambda st, why, best: False, trials=None, patience=2, min_gain=0.02, seed=0, rounds=1,
                            weights=[4, 2, 1], end=clock.t + 70.0, local=True,
                            before=lambda j, s: seen.append(j.bucket), keep=lambda: kept.append(1) or 35.0)
    assert seen == [b for b, _, _ in shares] == ["n=64", "n=32", "n=16"] and all(loc for _, _, loc in shares)
    left, want = 65.0, []  # the budget's end less 35 s kept back comes before the pass's end
    for w, rest in ((4, 7), (2, 3), (1, 1)):
        want.append(left * w / rest * (1 - turn.RETIME_SHARE))
        left -= want[-1]
    assert [round(s, 6) for _, s, _ in shares] == [round(x, 6) for x in want] and len(kept) == 3
    assert [(j.bucket, why, n) for j, why, n in turns] == [("n=64", "budget", 0), ("n=32", "budget", 0),
                                                           ("n=16", "budget", 0)]


def test_nearest_bucket_winners_fewest_fields_apart_first(tmp_path, monkeypatch):
    """Siblings one bucket field apart (the same weight shape at another M) come before those two fields
    apart, however near those are by distance."""
    two = dataclasses.replace(BOWL, name="tune_all_bowl2", bucket=lambda p: {"m": p.n // 1000, "k": p.n % 1000})
    monkeypatch.setitem(K.REGISTRY, two.name, two)
    problems = [h.Problem(n) for n in (1064, 16064, 1256, 2128)]   # (m, k): target, m apart, k apart, both
    jobs = search.plan([two], problems, [torch.float32], SLUG)
    st = search.open_storage(str(tmp_path / "s.journal"))
    studies = {j.name: search.open_study(st, j) for j in jobs}
    version = search.code_version(two.name)
    dist = {k: optuna.distributions.CategoricalDistribution(v) for k, v in BOWL_PARAMS.items()}
    by = {j.bucket: j for j in jobs}
    for b, a in (("m=16,k=64", 2), ("m=1,k=256", 4), ("m=2,k=128", 3)):
        studies[by[b].name].add_trial(optuna.trial.create_trial(params={"a": a, "b": 1, "c": 1, "d": 1}, distributions=dist,
                                                            value=5.0, user_attrs={"evaluated": {"seconds": 0.1,
                                                                                                 "source": version}}))
    # by distance alone the (2, 128) sibling (|log2| 1 + 1) would come before (16, 64) (|log2| 4)
    assert [c["a"] for c in local.bucket_seed_configs(by["m=1,k=64"], jobs, studies, limit=2)] == [4, 2]


def test_nearest_bucket_winners_are_enqueued_once(tmp_path, bowl):
    """A study searched again tries the current bests of its 3 nearest buckets (same kernel and dtype) once
    each; one invalid for its problem is skipped, so is one it already evaluated; a sibling's new best is
    tried in turn."""
    problems = [h.Problem(n) for n in (32, 64, 16, 128, 8)]
    jobs = search.plan([BOWL], problems, [torch.float32], SLUG)
    st = search.open_storage(str(tmp_path / "s.journal"))
    studies = {j.name: search.open_study(st, j) for j in jobs}
    version = search.code_version(BOWL.name)
    dist = {k: optuna.distributions.CategoricalDistribution(v) for k, v in BOWL_PARAMS.items()}

    def best(job, cfg, value):
        studies[job.name].add_trial(optuna.trial.create_trial(params=cfg, distributions=dist, value=value, user_attrs={
            "evaluated": {"seconds": 0.1, "source": version}}))

    j32, j64, j16, j128, j8 = jobs
    best(j64, {"a": 6, "b": 2, "c": 2, "d": 2}, 5.0)   # a=6 > 32/8: invalid for n=32
    best(j16, {"a": 2, "b": 3, "c": 3, "d": 3}, 5.0)
    best(j128, {"a": 1, "b": 4, "c": 4, "d": 4}, 5.0)  # as far as 8: the third by name
    best(j8, {"a": 1, "b": 5, "c": 5, "d": 5}, 5.0)    # fourth: not tried
    assert local.bucket_seed_configs(j32, jobs, studies) == [{"a": 2, "b": 3, "c": 3, "d": 3},
                                                          {"a": 1, "b": 4, "c": 4, "d": 4}]
    assert local.bucket_seed_configs(j32, jobs, studies, limit=2) == [{"a": 2, "b": 3, "c": 3, "d": 3}]
    study = studies[j32.name]
    assert search.enqueue_seeds(study, j32, local.bucket_seed_configs(j32, jobs, studies, limit=2),
                                 attr="bucket_seed") == 1
    assert local.bucket_seed_configs(j32, jobs, studies, limit=2) == []  # waiting: not again
    search.run_study(study, j32, _bowl, trials=2, seed_default=False)  # evaluated: not again either
    assert [bool(t.user_attrs.get("bucket_seed")) for t in search.evaluated(study.trials)] == [True, False]
    assert local.bucket_seed_configs(j32, jobs, studies, limit=2) == []
    best(j16, {"a": 3, "b": 3, "c": 3, "d": 3}, 4.0)  # the 16's new best, valid for n=32
    assert local.bucket_seed_configs(j32, jobs, studies, limit=2) == [{"a": 3, "b": 3, "c": 3, "d": 3}]
    # an own evaluated config is not a seed
    best(j32, {"a": 3, "b": 3, "c": 3, "d": 3}, 6.0)
    assert local.bucket_seed_configs(j32, jobs, studies, limit=2) == []


def test_phase2_retimes_each_study_once_after_its_search_and_a_cut_call_leaves_them_to_the_next(tmp_path, bowl,
                                                                                                monkeypatch):
    """Phase 2 re-times at its end, once per study (not after every turn), each after its last trial; a call
    that --stop-after cuts in phase 2 re-times nothing (the next call's search would move the bests again) and
    the next call does."""
    done = []
    real = tb.retime_study

    def spy(study, job, runner, rounds, deadline=None):
        done.append((job.bucket, len(search.evaluated(study.get_trials(deepcopy=False)))))
        return real(study, job, runner, rounds, deadline)

    monkeypatch.setattr(tb, "retime_study", spy)
    problems = [h.Problem(64), h.Problem(128)]
    rows, _ = tb.tune_budget([BOWL], 600.0, storage=str(tmp_path / "a.journal"), problems=problems,
                             dtypes=[torch.float32], slug=SLUG, evaluate=_bowl, isolation="inline", progress=False,
                             log=lambda m: None, patience=2, fill=False)
    assert sorted(b for b, _ in done) == ["n=128", "n=64"]
    assert {b: n for b, n in done} == {r["bucket"]: r["trials"] for r in rows}
    assert all(r["retimed"] is not None or len(rtm.front_runners(
        optuna.load_study(study_name=r["study"], storage=search.open_storage(str(tmp_path / "a.journal"))))) < 2
        for r in rows)

    def slow_bowl(task):
        time.sleep(0.02)
        return _bowl(task)

    done.clear()
    storage = str(tmp_path / "b.journal")
    rows, _ = tb.tune_budget([BOWL], 600.0, storage=storage, problems=problems, dtypes=[torch.float32], slug=SLUG,
                             evaluate=slow_bowl, isolation="inline", progress=False, log=lambda m: None, patience=2,
                             fill=False, stop_after=0.3)
    assert done == [] and any(r["ledger"]["stop"] not in ledger.DONE for r in rows)
    rows, _ = tb.tune_budget([BOWL], 600.0, storage=storage, problems=problems, dtypes=[torch.float32], slug=SLUG,
                             evaluate=slow_bowl, isolation="inline", progress=False, log=lambda m: None, patience=2,
                             fill=False)
    assert sorted(b for b, _ in done) == ["n=128", "n=64"]
    assert all(r["ledger"]["stop"] == "converged" for r in rows)


def test_phase2_tries_the_nearest_buckets_best_before_walking(tmp_path, bowl):
    """No warm store: the n=64 study walks from the default to the optimum; the n=128 study's turn, next,
    first tries that best (a ``bucket_seed``) and so starts at the optimum instead of walking there."""
    rows, _ = tb.tune_budget([BOWL], 600.0, storage=str(tmp_path / "s.journal"), problems=[h.Problem(64), h.Problem(128)],
                             dtypes=[torch.float32], slug=SLUG, evaluate=_bowl, isolation="inline", progress=False,
                             log=lambda m: None, patience=2, fill=False)
    r64, r128 = rows
    assert r64["config"] == OPT == r128["config"]
    st = optuna.load_study(study_name=r128["study"], storage=search.open_storage(str(tmp_path / "s.journal")))
    ev = sorted(search.evaluated(st.trials), key=lambda t: t.number)
    assert ev[1].user_attrs.get("bucket_seed") and ev[1].params == OPT   # right after the default
    assert r128["trials"] < r64["trials"]


class _RecordingPool:
    """Stands in for tuning.precompile.Precompiler: records what the sweep hands over."""
    made: list = []

    def __init__(self, helpers=None):
        self.helpers, self.tasks, self.closed = helpers, [], False
        _RecordingPool.made.append(self)

    def submit(self, task):
        self.tasks.append((task.problem, dict(task.config)))
        return True

    def stats(self):
        return {"helpers": self.helpers, "submitted": len(self.tasks), "compiled": 0, "failed": 0}

    def close(self):
        self.closed = True


def test_precompile_gets_the_seeds_and_neighbours_before_they_are_evaluated(tmp_path, monkeypatch):
    """With helpers, every seed of every study goes to them before phase 1 starts, and each neighbour of a
    study's best before the descent evaluates it; the pool is closed when the call ends. (The sampler's
    proposals are not known ahead and are compiled by the sweep.)"""
    from tritune.tuning import precompile

    _warm_store({"a": 4, "b": 3})
    _RecordingPool.made = []
    monkeypatch.setattr(precompile, "Precompiler", _RecordingPool)
    storage = str(tmp_path / "s.journal")
    evaluated = []

    def ev(task):
        evaluated.append((task.problem, dict(task.config), len(_RecordingPool.made[-1].tasks)))
        return h.quick(task)

    rows, _ = _budget(storage, 600.0, ev, patience=4, fill=False, precompile_helpers=2)
    (pool,) = _RecordingPool.made
    assert pool.closed and pool.helpers == 2
    handed = pool.tasks
    assert handed
    seeds = [(p, {"a": 1, "b": 1}) for p in PROBLEMS] + [(p, {"a": 4, "b": 3}) for p in PROBLEMS]
    first_eval = evaluated[0][2]
    for s in seeds:  # all handed over before the first evaluation
        assert s in handed[:first_eval], s
    for st in _studies(storage):
        for t in st.trials:
            if t.user_attrs.get("local"):
                p = next(p for p in PROBLEMS if f"n={p.n}" in st.study_name)
                i = next(i for i, (pp, c, _) in enumerate(evaluated) if pp == p and c == t.params)
                assert (p, t.params) in handed[:evaluated[i][2]], t.params  # handed over before its evaluation


def test_precompile_pool_runs_configs_in_a_helper_process(tmp_path):
    """The real pool: a spawned helper imports the spec's module and runs each config once (on the
    interpreter its launches are plain runs; on a GPU they are compiles); a config handed over twice
    runs once; no helper under the interpreter by default."""
    from tritune.kernels.runtime import device as dev
    from tritune.tuning import precompile

    if dev.interpreted():   # on a GPU the default is a count of helpers (test_precompile_helpers_on_a_gpu)
        assert precompile.helpers_wanted() == 0
    with precompile.Precompiler(helpers=1) as pre:
        tasks = [search.Task(h.TOY.name, h.Problem(64), torch.float32, {"a": a, "b": 1}, 0, spec=h.TOY)
                 for a in (1, 2)]
        assert all(pre.submit(t) for t in tasks) and not pre.submit(tasks[0])
        t0 = time.time()
        while len(pre.done) < 2 and time.time() - t0 < 120:
            time.sleep(0.1)
        assert pre.stats() == {"helpers": 1, "submitted": 2, "compiled": 2, "failed": 0}, pre.done
    assert pre._pool is None and not pre.submit(tasks[1])


def test_precompile_helpers_setting_is_checked(monkeypatch, capsys):
    """A mistyped TRITUNE_PRECOMPILE or --precompile is refused by name (one line, exit 2)."""
    from tritune.tuning import precompile

    monkeypatch.setenv("TRITUNE_PRECOMPILE", "many")
    with pytest.raises(ValueError, match="TRITUNE_PRECOMPILE"):
        precompile.helpers_wanted()
    monkeypatch.setenv("TRITUNE_PRECOMPILE", "0")
    assert precompile.helpers_wanted() == 0
    r = subprocess.run([sys.executable, "-m", "tritune.harness.cli.tune", "tune", "gelu", "--budget", "1m", "--precompile", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--precompile -1" in r.stderr and "Traceback" not in r.stderr


def test_precompile_helpers_on_a_gpu(monkeypatch):
    """On a GPU (not the interpreter) the default is the CPU cores less two, at most 8, at most one per
    10 GiB of GPU memory; the setting wins."""
    from tritune.kernels.runtime import device as dev
    from tritune.tuning import precompile

    monkeypatch.setattr(dev, "interpreted", lambda: False)
    monkeypatch.setattr(dev, "device", lambda: "cuda")
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(precompile, "_gpu_memory_gib", lambda: 79.1)   # an H100
    monkeypatch.delenv("TRITUNE_PRECOMPILE", raising=False)
    assert precompile.helpers_wanted() == 7
    monkeypatch.setattr(precompile, "_gpu_memory_gib", lambda: 139.8)  # an H200
    assert precompile.helpers_wanted() == 8
    monkeypatch.setattr(precompile, "_gpu_memory_gib", lambda: 23.6)   # a 24 GB card
    assert precompile.helpers_wanted() == 2
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 2)
    assert precompile.helpers_wanted() == 0
    monkeypatch.setenv("TRITUNE_PRECOMPILE", "3")
    assert precompile.helpers_wanted() == 3


def test_the_fill_walks_the_neighbours_of_runners_up():
    """Once the best's neighbours are all evaluated, the fill's descent (beam) goes on around the runners-up
    within RUNNER_UP of it, a seed first (a basin found elsewhere), then the fastest; phase 2 (beam 0) and a
    runner-up too slow stop there."""
    (job,) = search.plan([h.TOY], [h.Problem(64)], [torch.float32], SLUG)
    dist = {k: optuna.distributions.CategoricalDistribution(v) for k, v in h.TOY.space.params.items()}
    src = {"evaluated": {"seconds": 0.1, "source": search.code_version(h.TOY.name)}}
    st = optuna.create_study(study_name="beam")

    def add(a, b, value, **attrs):
        st.add_trial(optuna.trial.create_trial(params={"a": a, "b": b}, distributions=dist, value=value,
                                               user_attrs={**src, **attrs}))
        return st.trials[-1]

    add(6, 3, 1.0)                                      # the best, its 4 neighbours evaluated and slower
    for a, b in ((5, 3), (7, 3), (6, 2), (6, 4)):
        add(a, b, 1.5, local=True)
    fast = add(1, 1, 1.04)                              # a runner-up found by the sampler
    seed = add(2, 7, 1.08, warm=True)                   # the warm seed: within 10%
    add(8, 8, 1.2, warm=True)                           # too slow to be a centre
    ts = search.current_trials(st.trials, search.code_version(h.TOY.name))
    assert local.Local(job).next_config(ts) == (None, None)
    cfg, of = local.Local(job, beam=local.BEAM).next_config(ts)
    assert of == seed.number and abs(cfg["a"] - 2) + abs(cfg["b"] - 7) == 1
    inc = local.incumbent(ts)
    assert [t.number for t in local.runners_up(ts, inc, 3, h.TOY.space.params)] == [seed.number, fast.number]
    assert local.runners_up(ts, inc, 3, h.TOY.space.params, within=0.05) == [fast]
    assert local.runners_up(ts, inc, 0, h.TOY.space.params) == []


def test_a_fill_cut_by_stop_after_resumes_in_the_fill(tmp_path):
    """A study the fill of an earlier call cut (that call ended by --stop-after: ledger stop 'budget',
    fill_cut = the pass's level) resumes in the next call's fill at that level, not in phase 2 with its
    re-timing; a finished turn clears the mark."""
    _warm_store({"a": 6, "b": 3})
    storage = str(tmp_path / "s.journal")
    _budget(storage, 600.0, h.quick, patience=4, fill=False)
    a, b = _studies(storage)
    a.set_user_attr(ledger.LEDGER, {**ledger.ledger(a), "stop": "budget", "fill_cut": 16})
    b.set_user_attr(ledger.LEDGER, {**ledger.ledger(b), "stop": "budget", "patience": 8})  # cut before the mark existed
    assert fill.fill_cut_level(ledger.ledger(b)) == 16 and fill.fill_cut_level({"stop": "budget"}) is None
    logs = []
    rows, _ = _budget(storage, 600.0, h.quick, patience=4, log=logs.append, trials=12)
    assert any("2 studies resume the fill" in m for m in logs), logs
    assert any("fill pass 1: 2 studies searched again (patience 16;" in m for m in logs), logs
    for r in rows:
        assert "fill_cut" not in r["ledger"] and r["ledger"]["stop"] != "budget", r["ledger"]
