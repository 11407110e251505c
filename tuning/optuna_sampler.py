"""The Optuna strategy: TPE (seeded, the default), random, or the grid (every valid point once, in a seeded
random order), behind :func:`run_study`, the loop that runs one study's trials through a runner.

``trials`` counts *evaluated* trials (complete or failed), so constraint-pruned proposals (``invalid``)
and duplicates (``duplicate_of``: the earlier outcome is copied) are free; a sampler that keeps proposing
free trials is given an unevaluated valid point (``forced``) so a converged TPE cannot spin. A config
another unfinished trial holds (``busy_with``) is not timed twice: with several workers on one storage,
no config is timed twice and the count is met exactly (:func:`claim`, :func:`surplus`).
"""
from __future__ import annotations

import random
import time
import warnings
from typing import Callable

from tritune.tuning.evaluate import Task
from tritune.tuning.study import (by_config, code_version, config_key, current_trials, ensure_seeds, evaluated,
                                  is_dead, reap, record_default, seed_for, worker_id)

SAMPLERS = ("tpe", "random", "grid")
STALL = 20                 # free proposals in a row before an unevaluated valid point is forced


class TrialFailed(Exception):
    """Raised inside the objective to record a failed trial (caught by ``study.optimize``)."""


def make_sampler(name: str, space, seed: int):
    import optuna

    if name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        # The grid is walked by run_study, which enqueues every valid point once in a seeded random order
        # (Optuna's GridSampler would also walk the invalid points, and its bookkeeping costs O(trials) per
        # proposal). The nominal sampler only answers when another worker took the enqueued point first.
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler: expected one of {SAMPLERS}, got {name!r}")


class Objective:
    """One proposal of ``run_study``: validate the config, defer to a trial that holds or timed it, else
    evaluate it through the runner and record the facts (``evaluated``) and the outcome. ``launched`` says
    whether the last call evaluated anything (free proposals count towards a forced point)."""

    def __init__(self, study, job, runner, *, trials: int, seed: int, version, window: float):
        self.study, self.job, self.runner = study, job, runner
        self.trials, self.seed, self.version, self.window = trials, seed, version, window
        self.launched = False

    def __call__(self, trial):
        import optuna
        from optuna.trial import TrialState

        job, space = self.job, self.job.spec.space
        config = {k: trial.suggest_categorical(k, choices) for k, choices in space.params.items()}
        why = space.why_invalid(config, job.problem, job.dtype)
        if why:
            trial.set_user_attr("invalid", why)
            raise optuna.TrialPruned(why)
        prev, busy = claim(self.study, trial.number, config, space.params, self.version)
        if busy is not None:  # another trial holds this config: it will time it
            trial.set_user_attr("busy_with", busy)
            raise TrialFailed(f"trial {busy} holds this config")
        if prev is not None:
            trial.set_user_attr("duplicate_of", prev.number)
            if prev.state == TrialState.COMPLETE:
                return prev.value
            trial.set_user_attr("error", prev.user_attrs.get("error", "failed"))
            raise TrialFailed(prev.user_attrs.get("error", "failed"))
        if surplus(self.study, trial.number, self.trials, self.version, self.window):
            trial.set_user_attr("surplus", True)  # another worker started the last trial first
            raise optuna.TrialPruned("the study's trial count is reached")
        return self.evaluate(trial, config)

    def evaluate(self, trial, config: dict) -> float:
        job = self.job
        trial.set_user_attr("owner", worker_id())  # who to ask whether this trial is still alive
        tseed = seed_for(self.seed, job.name, trial.number, "inputs")
        t0 = time.time()
        res = self.runner(Task(job.spec.name, job.problem, job.dtype, config, tseed, spec=job.spec))
        self.launched = True
        facts = {"seed": tseed, "worker": worker_id(), "seconds": round(time.time() - t0, 3), "source": self.version}
        if "rel_error" in res:
            facts["rel_error"] = float(res["rel_error"])
        if "timer" in res:
            facts["timer"] = str(res["timer"])
        if isinstance(res.get("phases"), dict):
            facts["phases"] = res["phases"]
        trial.set_user_attr("evaluated", facts)  # one journal write per evaluated trial
        if res.get("ok"):
            return float(res["ms"]) * 1e3
        trial.set_user_attr("error", str(res.get("error", "failed"))[:1000])
        raise TrialFailed(res.get("error", "failed"))


def snapshot(study, version, window: float) -> dict:
    """The study now, as the loop sees it: its current trials (and the unfinished ones), the evaluated
    ones, the live running ones, the best time, the failures and whether a trial waits."""
    from optuna.trial import TrialState

    all_ts = study.get_trials(deepcopy=False)
    keep = {t.number for t in current_trials(all_ts, version)}
    ts = [t for t in all_ts if t.number in keep or not t.state.is_finished()]
    ev = evaluated(ts)
    now = time.time()
    running = [t for t in ts if t.state == TrialState.RUNNING and t.datetime_start is not None
               and now - t.datetime_start.timestamp() < window]
    best = min((t.value for t in ts if t.state == TrialState.COMPLETE and t.value is not None), default=None)
    return {"trials": ts, "evaluated": ev, "running": running,
            "best": best, "failed": sum(t.state == TrialState.FAIL for t in ev),
            "waiting": any(t.state == TrialState.WAITING for t in ts)}


def wait_for_running(study, version, window: float, deadline: float | None = None, poll_s: float = 0.2) -> None:
    """Wait until no live trial of another worker runs (each finishes, or its process dies and is
    reaped), or ``deadline`` passes: a study ended by its count then reports that count in every worker,
    not each one's own. A trial running longer than ``window`` no longer counts as live."""
    while snapshot(study, version, window)["running"] and (deadline is None or time.time() < deadline):
        time.sleep(poll_s)
        reap(study, window)


def run_study(study, job, runner, *, trials: int, sampler_name: str = "tpe", deadline: float | None = None,
              stop_at_us: float | None = None, seed: int = 0, seed_default: bool = True,
              progress: Callable | None = None, stall: int = STALL, should_stop: Callable | None = None) -> None:
    """Run trials in ``study`` until ``trials`` evaluated trials exist (or every valid point is
    evaluated, or ``deadline`` passes, or a value <= ``stop_at_us`` is found, or ``should_stop(trials)``,
    asked before each proposal with the study's current trials, is true: see :mod:`tritune.tuning.turn`)."""
    params = job.spec.space.params
    valid = {config_key(p, params): p for p in job.spec.space.points(job.problem, job.dtype)}
    if not valid:
        return
    rng = random.Random(seed_for(seed, job.name, "forced"))
    window = (getattr(runner, "timeout", None) or 3600.0) + 120.0
    if seed_default:
        ensure_seeds(study, job)
    free_streak = 0
    version = code_version(job.spec)
    objective = Objective(study, job, runner, trials=trials, seed=seed, version=version, window=window)
    while True:
        reap(study, window)
        now = snapshot(study, version, window)
        done = by_config(now["evaluated"], params)
        if progress is not None:
            progress(job, len(now["evaluated"]), min(trials, len(valid)), now["failed"], now["best"], deadline)
        if len(now["evaluated"]) + len(now["running"]) >= trials:
            wait_for_running(study, version, window, deadline)
            break
        if (len(set(done) & set(valid)) >= len(valid) or (deadline is not None and time.time() >= deadline)
                or (stop_at_us is not None and now["best"] is not None and now["best"] <= stop_at_us)
                or (should_stop is not None and should_stop(now["trials"]))):
            break
        if not now["waiting"] and (sampler_name == "grid" or free_streak >= stall):
            busy = {config_key(t.params, params) for t in now["running"]}
            left = sorted(set(valid) - set(done) - busy) or sorted(set(valid) - set(done))
            study.enqueue_trial(valid[rng.choice(left)],
                                user_attrs=None if sampler_name == "grid" else {"forced": True})
            free_streak = 0
        objective.launched = False
        study.optimize(objective, n_trials=1, catch=(TrialFailed,), gc_after_trial=False)
        free_streak = 0 if objective.launched else free_streak + 1
    record_default(study)


def claim(study, number: int, config: dict, params, version):
    """Whether trial ``number`` may time ``config``, asked after its parameters are in the storage (the
    storage's trials now, not the loop's snapshot): ``(prev, None)`` with the trial that already timed it
    on the current code, if any, or ``(None, other)`` when another unfinished trial holds the same config
    (waiting, running, or running in a dead process and about to be retried). Two trials that claim one
    config at once both see the other and both yield, never both time it."""
    from optuna.trial import TrialState

    key = config_key(config, params)
    ts = study.get_trials(deepcopy=False)
    for t in ts:
        if t.number == number:
            continue
        if t.state in (TrialState.WAITING, TrialState.RUNNING):
            held = t.params or t.system_attrs.get("fixed_params") or {}
            if held and config_key(held, params) == key:
                return None, t.number
    return by_config(evaluated(current_trials(ts, version)), params).get(key), None


def surplus(study, number: int, trials: int, version, window: float) -> bool:
    """Whether trial ``number`` would go past the count: the evaluated trials and the live running ones
    created before it (lower numbers) already make ``trials``. Trials are numbered in the order the
    storage created them, so workers starting at once agree on which of them runs: the count is met
    exactly, not overshot."""
    from optuna.trial import TrialState

    ts = study.get_trials(deepcopy=False)
    now = time.time()
    ahead = sum(1 for t in ts if t.number < number and t.state == TrialState.RUNNING and not is_dead(t, now, window))
    return len(evaluated(current_trials(ts, version))) + ahead >= trials
