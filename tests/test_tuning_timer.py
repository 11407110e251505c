"""The tuner's one timer (harness.timing.timing_mode / time_ms): which problems are CUDA-graph timed, that
the sweep and the re-time before export both time through it, which configs the re-time decides between,
and that a noisy measurement in the sweep cannot pick the exported winner."""
from __future__ import annotations

import dataclasses

import optuna
import pytest
import torch

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
from tritune import kernels as K
from tritune.tuning import budget as tb, retime as rtm, search, timing
from tritune.kernels.runtime import store


@dataclasses.dataclass(frozen=True)
class P:
    n: int


_LAST: dict = {}


def _run(x, out=None, config=None):
    _LAST["config"] = dict(config)
    out = torch.empty_like(x) if out is None else out
    out.copy_(x * 2)
    return out


def _make(p, dtype, device, seed, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    return K.Case(args=(torch.randn(p.n, generator=g, dtype=dtype),), out=torch.empty(p.n, dtype=dtype))


def _spec(name="timer_toy", nbytes=lambda p: 4.0 * p.n):
    return K.KernelSpec(
        name=name, run=_run, reference=lambda x: x.double() * 2, make_inputs=_make, problems=None,
        space=K.Space(params={"a": list(range(1, 9)), "b": list(range(1, 9))}),
        default_config=lambda p, d: {"a": 1, "b": 1}, bucket=lambda p: {"n": p.n},
        cost=lambda p, d: K.Cost(flops=0.0, bytes=nbytes(p)), problem_of=lambda x, **_: P(x.numel()),
        standard_problems=[P(64)], small_problems=[P(64)], dtypes=(torch.float32,))


def test_timing_mode_is_a_function_of_the_problem():
    spec = _spec()
    # floor at 3 TB/s: 64 floats -> graph; 1.2 GB -> 400 us -> flush
    assert timing.timing_mode(spec, P(64), torch.float32) == "graph"
    assert timing.timing_mode(spec, P(300_000_000), torch.float32) == "flush"
    edge = int(timing.GRAPH_FLOOR_US * 1e-6 * timing.NOMINAL_BYTES_PER_S / 4)
    assert timing.timing_mode(spec, P(edge - 1000), torch.float32) == "graph"
    assert timing.timing_mode(spec, P(edge + 1000), torch.float32) == "flush"
    assert timing.timing_mode(spec, P(300_000_000), torch.float32, force="graph") == "graph"
    assert timing.timing_mode(spec, P(64), torch.float32, force="flush") == "flush"
    assert timing.timing_mode(_spec(nbytes=lambda p: 1 / 0), P(64), torch.float32) == "graph"  # no cost: graph
    with pytest.raises(ValueError, match="timer"):
        timing.timing_mode(spec, P(64), torch.float32, force="cudagraph")
    with pytest.raises(ValueError, match="mode"):
        search.Evaluator(mode="do_bench")
    with pytest.raises(ValueError, match="mode"):
        timing.time_ms(lambda: None, "auto")


def test_every_standard_problem_has_a_mode():
    """Each built-in kernel's standard problems: short ones (a floor under 50 us) are graph timed, and
    the big ones that set the L2-flush semantics of the committed stores stay on do_bench."""
    modes = {}
    for spec in K.all_specs():
        for p in spec.standard_problems:
            for dt in spec.dtypes:
                modes[(spec.name, timing.problem_label(p), str(dt))] = timing.timing_mode(spec, p, dt)
    assert set(modes.values()) == {"graph", "flush"}
    gemm = K.get("gemm")
    small = [p for p in gemm.standard_problems if getattr(p, "M", 0) == 8 and p.N == 768 and p.K == 768]
    assert small and all(timing.timing_mode(gemm, p, torch.bfloat16) == "graph" for p in small)


def test_clone_case_keeps_views_strides_and_aliasing():
    pool = torch.randn(6, 2, 4, 3)
    k, v = pool[:, 0], pool[:, 1]
    q = torch.randn(5, 9)[:, 3:6]
    case = K.Case(args=(q, k, v, 7), kwargs={"scale": 0.5, "lens": torch.arange(3)}, out=torch.empty(5, 3))
    c = timing.clone_case(case)
    for a, b in zip(case.tensors(), c.tensors()):
        assert a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        assert torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert c.args[1].untyped_storage().data_ptr() == c.args[2].untyped_storage().data_ptr()  # K, V: one pool
    assert c.args[3] == 7 and c.kwargs["scale"] == 0.5


def test_graph_mode_cycles_enough_input_sets_past_l2():
    spec = _spec()
    per = _make(P(1024), torch.float32, "cpu", 0).nbytes()
    flush = timing.timing_cases(spec, P(1024), torch.float32, "cpu", 0, "flush", l2=100 * per)
    graph = timing.timing_cases(spec, P(1024), torch.float32, "cpu", 0, "graph", l2=100 * per)
    base = len(timing.rotation(spec, P(1024), torch.float32, "cpu", 0))    # (the GPU rotates several sets)
    assert len(flush) == base and len(graph) == min(timing.GRAPH_MAX_SETS, max(base, timing.GRAPH_L2_MULTIPLE * 100 + 1))
    assert sum(c.nbytes() for c in graph) > timing.GRAPH_L2_MULTIPLE * 100 * per
    assert len(timing.timing_cases(spec, P(1024), torch.float32, "cpu", 0, "graph", l2=10**6 * per)) == \
        timing.GRAPH_MAX_SETS


class _Recorder:
    """timing.time_ms replaced: records each (config, mode) and answers a time from the config."""

    def __init__(self, ms=lambda c: 1.0 + c["a"] + c["b"]):
        self.calls, self.ms = [], ms

    def __call__(self, fn, mode):
        fn()
        self.calls.append((_LAST["config"], mode))
        return self.ms(_LAST["config"])


def test_one_timer_for_trials_and_retime(tmp_path, monkeypatch):
    """The sweep's evaluator and the re-time before export both reach timing.time_ms, in the problem's mode;
    the evaluator reports the mode and the trial records it."""
    spec = _spec()
    rec = _Recorder()
    monkeypatch.setattr(timing, "time_ms", rec)
    monkeypatch.setitem(K.REGISTRY, spec.name, spec)
    ev = search.Evaluator()
    res = ev(search.Task(spec.name, P(64), torch.float32, {"a": 3, "b": 2}, 5, spec=spec))
    assert res["ok"] and res["ms"] == 6.0 and res["timer"] == "graph" and rec.calls == [({"a": 3, "b": 2}, "graph")]
    assert search.Evaluator(mode="flush")(search.Task(spec.name, P(64), torch.float32, {"a": 1, "b": 1}, 5,
                                                      spec=spec))["timer"] == "flush"

    storage = str(tmp_path / "s.journal")
    rows, _ = tb.tune_budget([spec], 60.0, storage=storage, trials=8, problems=[P(64)], dtypes=[torch.float32],
                             slug="nvidia-h200", evaluate=ev, isolation="inline", progress=False, log=lambda m: None)
    st = optuna.load_study(study_name=rows[0]["study"], storage=search.open_storage(storage))
    timed = [t for t in st.trials if t.user_attrs.get("evaluated")]
    assert timed and all(t.user_attrs["evaluated"].get("timer") == "graph" for t in timed)
    # where a trial's seconds went: the first launch (the compile on a GPU), the reference and check, the timing
    assert all(set(t.user_attrs["evaluated"]["phases"]) == {"launch_s", "check_s", "time_s"} for t in timed)
    n_sweep = len(rec.calls)
    job = search.plan([spec], [P(64)], [torch.float32], "nvidia-h200")[0]
    out = rtm.retime(st, job, search.InlineRunner(ev), rounds=2)
    # the re-time's rounds: every candidate twice, all through timing.time_ms in the problem's mode
    assert out is not None and len(rec.calls) - n_sweep == 2 * len(out["candidates"])
    assert [m for _, m in rec.calls[n_sweep:]] == ["graph"] * (2 * len(out["candidates"]))


def _trial(params, value, number_attrs=None):
    return optuna.trial.create_trial(
        params=params, distributions={k: optuna.distributions.CategoricalDistribution(list(range(1, 9)))
                                      for k in params},
        value=value, user_attrs={"evaluated": {"seconds": 0.1, "source": None}, **(number_attrs or {})})


def test_front_runners_hold_every_leader_and_every_seed(monkeypatch):
    monkeypatch.setattr(store, "source_hash", lambda kernel: None)
    st = optuna.create_study(direction="minimize")
    st.set_user_attr("kernel", "timer_toy")
    st.set_user_attr("default_config", {"a": 1, "b": 1})
    for params, v, attrs in [({"a": 1, "b": 1}, 10.0, {"default": True}),
                             ({"a": 2, "b": 2}, 30.0, {"warm": "k1"}),      # a seed slow once in the sweep
                             ({"a": 3, "b": 3}, 9.0, {"warm": "k2"}),       # led
                             ({"a": 4, "b": 4}, 12.0, {}),                  # never led, no seed: not re-timed
                             ({"a": 5, "b": 5}, 8.0, {}),                   # led
                             ({"a": 6, "b": 6}, 7.5, {})]:                  # led: the tuned best
        st.add_trial(_trial(params, v, attrs))
    fr = {c["config"]["a"]: c["roles"] for c in rtm.front_runners(st)}
    assert fr == {6: ["tuned", "led"], 1: ["default", "led"], 3: ["seed", "led"], 5: ["led"], 2: ["seed"]}
    assert [c["config"]["a"] for c in rtm.front_runners(st, limit=3)] == [6, 1, 5]  # tuned, default, fastest


def test_a_noisy_first_measurement_cannot_pick_the_winner(tmp_path, monkeypatch):
    """Sweep (verify=True) measurements are noisy: a warm seed's one timing reads 10x fast (lucky), the
    truly fastest config, another warm seed, reads 10x slow (a host hiccup). The re-time (time only)
    measures what is true, and the export takes its winner: the unlucky seed, not the lucky one."""
    monkeypatch.setattr(store, "source_hash", lambda kernel: None)
    spec = _spec(name="timer_toy2")
    true = {(7, 7): 2.0, (5, 5): 4.0, (1, 1): 6.0}

    def evaluate(task):
        c = task.config
        ms = true.get((c["a"], c["b"]), 5.0 + c["a"] + c["b"])
        if task.verify and (c["a"], c["b"]) == (5, 5):
            ms /= 10.0
        if task.verify and (c["a"], c["b"]) == (7, 7):
            ms *= 10.0
        return {"ok": True, "ms": ms, "timer": "graph"}

    d = tmp_path / "packaged" / "nvidia-h100-80gb-hbm3"
    d.mkdir(parents=True)
    (d / "timer_toy2.json").write_text(__import__("json").dumps({
        "format": 1, "kernel": "timer_toy2", "gpu": "nvidia-h100-80gb-hbm3",
        "entries": [{"bucket": "n=64", "dtype": "float32", "config": {"a": 5, "b": 5}, "time_us": 1.0},
                    {"bucket": "n=32", "dtype": "float32", "config": {"a": 7, "b": 7}, "time_us": 1.0}]}))
    monkeypatch.setenv("TRITUNE_CONFIGS", str(tmp_path / "packaged"))
    monkeypatch.setenv("TRITUNE_CONFIG_DIR", str(tmp_path / "user"))
    store.clear_cache()
    storage = str(tmp_path / "s.journal")
    try:
        rows, near = tb.tune_budget([spec], 60.0, storage=storage, trials=6, problems=[P(64)], dtypes=[torch.float32],
                                    slug="nvidia-h200", evaluate=evaluate, isolation="inline", progress=False,
                                    log=lambda m: None)
        assert near == "nvidia-h100-80gb-hbm3"
        (row,) = rows
        assert row["config"] == {"a": 5, "b": 5}  # the sweep's best: the lucky seed
        rt = row["retimed"]
        assert rt["config"] == {"a": 7, "b": 7} and rt["winner"] == "seed" and rt["time_us"] == 2000.0
        (path,) = search.export(storage, [spec], slug="nvidia-h200", root=tmp_path / "out", log=lambda m: None)
        (e,) = __import__("json").loads(path.read_text())["entries"]
        assert e["config"] == {"a": 7, "b": 7} and e["time_us"] == 2000.0
    finally:
        store.clear_cache()


def test_the_retime_is_a_race_the_close_calls_get_every_round(monkeypatch):
    """Five front runners: after RACE_AFTER rounds each, those more than RACE_MARGIN behind the leading median
    drop out (their medians stand in the result); the two within it are timed every round, and the winner is
    the lower median of the two."""
    monkeypatch.setattr(store, "source_hash", lambda kernel: None)
    spec = _spec(name="timer_race")
    st = optuna.create_study(direction="minimize")
    st.set_user_attr("kernel", spec.name)
    st.set_user_attr("default_config", {"a": 1, "b": 1})
    true = {1: 20.0, 2: 10.0, 3: 10.4, 4: 13.0, 5: 30.0}   # a=2 and a=3 within 15%; 4 (30% behind) drops out
    for a, v, attrs in [(1, 20.0, {"default": True}), (2, 11.0, {"warm": "k1"}), (3, 10.5, {}), (4, 10.8, {"warm": "k2"}),
                        (5, 9.0, {"warm": "k3"})]:    # a=5: lucky once in the sweep, the best there
        st.add_trial(_trial({"a": a, "b": a}, v, attrs))
    calls = []

    def evaluate(task):
        calls.append(task.config["a"])
        return {"ok": True, "ms": true[task.config["a"]] * 1e-3}

    job = search.plan([spec], [P(64)], [torch.float32], "nvidia-h200")[0]
    out = rtm.retime(st, job, search.InlineRunner(evaluate), rounds=5)
    counts = {a: calls.count(a) for a in true}
    assert counts == {1: 2, 2: 5, 3: 5, 4: 2, 5: 2} and out["rounds"] == 5
    assert out["config"] == {"a": 2, "b": 2} and out["time_us"] == 10.0 and out["times_us"]["default"] == 20.0
    by_a = {c["config"]["a"]: c["retime_us"] for c in out["candidates"]}
    assert by_a == {1: 20.0, 2: 10.0, 3: 10.4, 4: 13.0, 5: 30.0}


def test_graph_timers_time_each_launch_without_pdl(monkeypatch):
    """The graph timers replay one launch back to back: with programmatic dependent launch each would
    overlap the one before. The switch they use is the one launches read (a copy of a module flag, set
    elsewhere, would leave PDL on)."""
    from tritune.kernels.runtime import launch as L
    from tritune.tuning import timing

    seen = []

    def fake_bench(fn, rep, return_mode):
        with L.pdl_forced():            # as inside a capture
            seen.append(L.pdl_now())
        return 1.0

    monkeypatch.setattr(timing.dev, "interpreted", lambda: False)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing.triton.testing, "do_bench_cudagraph", fake_bench)
    monkeypatch.setattr(L, "PDL", True)
    monkeypatch.setattr(L, "PDL_KERNELS", None)
    assert timing.graph_ms(lambda: None) == 1.0 and seen == [False]
    with L.pdl_forced():
        assert L.pdl_now()              # outside the timer, PDL as configured
