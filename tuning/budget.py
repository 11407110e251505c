"""``tritune tune all --budget 30m``: a new GPU type in one command, within a budget of wall time.

Every study (kernel x bucket x dtype) starts from the heuristic default, this GPU's stored entry and the
nearest GPU type's stored winners (:mod:`~tritune.tuning.warm`). Phase 1 runs every study's seeds; phase 2
gives each unfinished study an equal share of the time left for its search (:mod:`~tritune.tuning.turn`:
nearest buckets' winners, local descent, then its sampler) until it converges; the front runners of each
study are then re-timed side by side (:mod:`~tritune.tuning.retime`); phase 3 (:mod:`~tritune.tuning.fill`)
gives the time left to the converged studies. Helper processes compile the configs the sweep tries next
(:mod:`~tritune.tuning.precompile`). Kill-safe and resumable: the time each study spends is in its
ledger (:mod:`~tritune.tuning.ledger`), and the same command on the same storage spends only what is left.
"""
from __future__ import annotations

import dataclasses
import sys
import time

from tritune.kernels.runtime import store
from tritune.tuning import precompile
from tritune.tuning.fill import fill as run_fill, fill_cut_level
from tritune.tuning.ledger import DONE, ledger
from tritune.tuning.local import Prefetch, bucket_seed_configs
from tritune.tuning.optuna_sampler import make_sampler
from tritune.tuning.retime import RETIME_EST_S, RETIME_ROUNDS, front_runners, retime_done, retime_estimate, retime_study
from tritune.tuning.runners import TASK_TIMEOUT, make_runner
from tritune.tuning.search import Progress as Bar
from tritune.tuning.study import (code_version, current_trials, enqueue_seeds, ensure_seeds, open_storage, open_study,
                                  plan, reap, resolve_specs, seed_for, study_stats)
from tritune.tuning.turn import MIN_GAIN, PATIENCE, search_pass, study_progress, sweep_study
from tritune.tuning.warm import nearest_slug, warm_configs


@dataclasses.dataclass
class Budget:
    """The budget (seconds), the time already spent on the plan's studies in earlier calls, and this
    call's own deadline (``--stop-after``)."""
    total_s: float
    spent_before_s: float
    call_deadline: float | None = None
    started: float = dataclasses.field(default_factory=time.time)

    def end(self) -> float:
        """The wall-clock time at which the budget is spent."""
        t = self.started + max(0.0, self.total_s - self.spent_before_s)
        return t if self.call_deadline is None else min(t, self.call_deadline)

    def left(self) -> float:
        return max(0.0, self.end() - time.time())

    def total_end(self) -> float:
        """The wall-clock time at which the whole budget is spent (this call's ``--stop-after`` aside):
        what the time kept back for re-timings is kept back from."""
        return self.started + max(0.0, self.total_s - self.spent_before_s)


@dataclasses.dataclass
class Run:
    """What the phases of one ``tune_budget`` call share."""
    jobs: list
    studies: dict
    budget: Budget
    runner: object
    bar: object
    prefetch: Prefetch
    trials: int | None
    patience: int
    min_gain: float
    seed: int
    rounds: int
    log: object

    def turn_args(self) -> dict:
        return dict(trials=self.trials, min_gain=self.min_gain, seed=self.seed, prefetch=self.prefetch)


def prepare(storage_obj, jobs, warm, window: float) -> dict:
    """Open every study, fail the trials of a killed call (``reap``: each is enqueued again),
    enqueue its seeds (default, stored entry, warm winners; each once, see ``enqueue_seeds``) and
    return name -> study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    studies = {}
    for job in jobs:
        study = open_study(storage_obj, job, make_sampler(
            "tpe", job.spec.space, seed_for(0, job.name, "tpe")))
        if ledger(study)["stop"] not in DONE:
            reap(study, window)
            ensure_seeds(study, job)
            if warm is not None:
                enqueue_seeds(study, job, warm(job), attr="warm")
        studies[job.name] = study
    return studies


def tune_budget(kernels_, budget_s: float, *, storage=None, trials: int | None = None, dtypes=None, problems=None,
                warm_from: str | None = None, rounds: int = RETIME_ROUNDS, progress: bool = True,
                slug: str | None = None, evaluate=None, isolation: str = "auto", timeout: float = TASK_TIMEOUT,
                seed: int = 0, log=None, patience: int = PATIENCE, min_gain: float = MIN_GAIN,
                stop_after: float | None = None, fill: bool = True, precompile_helpers: int | None = None,
                only=None) -> tuple[list[dict], str | None]:
    """Tune within ``budget_s`` seconds in all (this call and earlier ones on ``storage``), warm-started
    from ``warm_from`` (default: the nearest stored GPU type); see the module's docstring. ``stop_after``:
    this call stops starting trials after so many seconds (a later call resumes). ``precompile_helpers``:
    processes compiling the configs the sweep tries next (:mod:`tritune.tuning.precompile`; default
    ``TRITUNE_PRECOMPILE`` or the CPU cores less two, at most 8; none under the interpreter). ``fill``: spend
    time left after every study stopped on the converged ones (phase 3). ``only``: study names, a worker's
    share of the plan (:mod:`tritune.tuning.spread`): the other studies are neither run nor counted in the
    time spent, and the plan's messages are left to whoever made the shares. Returns (rows, the GPU type
    warmed from); each row is the study's stats plus ``seed_us``, ``retimed``, ``ledger`` and ``progress``."""
    from tritune.kernels.runtime import device as dev

    if patience < 1:
        raise ValueError(f"patience: expected at least 1, got {patience!r}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain: expected a fraction in [0, 1), got {min_gain!r}")
    log = log or (lambda m: print(m, file=sys.stderr))
    slug = slug or dev.gpu_slug()
    near = warm_from or nearest_slug(slug, store.slugs())
    jobs = plan(resolve_specs(kernels_), problems, dtypes, slug, log if only is None else None)
    if only is not None:
        if not set(only) <= {j.name for j in jobs}:   # a worker's plan differs from its parent's
            raise ValueError(f"only: studies not in this plan: {sorted(set(only) - {j.name for j in jobs})[:3]}")
        jobs = [j for j in jobs if j.name in only]
    storage_obj = open_storage(storage)
    studies = prepare(storage_obj, jobs, (lambda job: warm_configs(job, near)) if near else None, timeout + 120.0)
    spent = sum(ledger(s)["spent_s"] for s in studies.values())
    budget = Budget(budget_s, spent, None if stop_after is None else time.time() + stop_after)
    _log_start(log, budget_s, spent, len(jobs), near, patience, min_gain, fill)
    # a study an earlier call's fill cut on its share (a call ended by --stop-after) resumes in the fill,
    # at that pass's level, its re-timing deferred to the fill's end: not phase 2 again, nor re-timed now
    resumed = {j.name: lv for j in jobs if fill and (lv := fill_cut_level(ledger(studies[j.name])))}
    open_ = [j for j in jobs if j.name not in resumed
             and (ledger(studies[j.name])["stop"] not in DONE or not retime_done(studies[j.name]))]
    refill = fill and budget.left() > 0 and (bool(resumed) or any(ledger(studies[j.name])["stop"] == "converged"
                                                                  for j in jobs))
    if len(open_) + len(resumed) < len(jobs):
        log(f"tune: {len(jobs) - len(open_) - len(resumed)} studies finished in earlier calls (skipped)")
    if resumed:
        log(f"tune: {len(resumed)} studies resume the fill where an earlier call stopped it")
    runner = make_runner(evaluate, isolation, timeout=timeout) if open_ or refill else None
    pre = precompile.Precompiler(helpers=precompile_helpers if runner is not None else 0)
    if pre.helpers:
        log(f"tune: {pre.helpers} helper processes compile the configs the sweep tries next ({precompile.ENV}=0: none)")
    run = Run(jobs, studies, budget, runner, Bar(len(open_), enabled=progress), Prefetch(pre if pre.helpers else None),
              trials, patience, min_gain, seed, rounds, log)
    try:
        _phase1(run, open_)
        _phase2(run, open_)
        if fill:  # phase 3: the time left goes to the converged studies, patience doubled per pass
            run_fill(jobs, studies, runner, budget, patience=patience, min_gain=min_gain, trials=trials, seed=seed,
                     rounds=rounds, progress=run.bar, log=log, resumed=resumed, prefetch=run.prefetch)
    except KeyboardInterrupt:
        log("tune: interrupted; finished trials and the time spent are in the storage: the same command resumes")
        raise
    finally:
        _close(run, pre)
    return [_row(studies[job.name], job, min_gain) for job in jobs], near


def study_rows(jobs, storage, min_gain: float = MIN_GAIN) -> list[dict]:
    """``tune_budget``'s rows of ``jobs``, read from ``storage`` without tuning (a study never opened yet
    is created, empty): the summary of studies other processes ran."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage_obj = open_storage(storage)
    return [_row(open_study(storage_obj, job), job, min_gain) for job in jobs]


def _log_start(log, budget_s: float, spent: float, n_jobs: int, near, patience: int, min_gain: float,
               fill: bool) -> None:
    log(f"tune: budget {budget_s / 60:.1f} min, {spent / 60:.1f} min of it spent by earlier calls; "
        f"{n_jobs} studies; warm start from "
        f"{near + ' (stored winners seeded as first trials)' if near else 'nothing (no stored GPU type of this vendor)'}"
        f"; a study walks from its best by one-step neighbours, then its sampler proposes, and it converges "
        f"after {patience} trials without a gain > {min_gain:.0%}"
        + ("; time left then goes to the converged studies (doubled patience per pass, the most promising "
           "first; the nearest buckets' winners tried, the local search continued)" if fill else ""))


def _phase1(run: Run, open_: list) -> None:
    """Every study's seeds, handed to the precompile helpers at once, then evaluated study by study."""
    for job in open_:
        run.prefetch.study(job, run.studies[job.name])
    for job in open_:
        if run.budget.left() <= 0:
            break
        st = run.studies[job.name]
        if any(t.state.name == "WAITING" for t in st.get_trials(deepcopy=False)):
            run.bar.prefix = "seeds "
            sweep_study(st, job, run.runner, budget=run.budget, share_end=run.budget.end(), seeds_only=True,
                        patience=run.patience, progress=run.bar, **run.turn_args())
            run.bar.next_job()


def _phase2(run: Run, open_: list) -> None:
    """The search, in passes while budget is left and a pass evaluates something. The re-timings come at
    the end of the phase, one per study (not one per turn: a study's best moves again in its next turn, or
    the next call's), and the time they should take is kept back from the budget's end (not from this
    call's: a call cut by --stop-after leaves them to the next)."""
    studies, budget = run.studies, run.budget
    run.bar.prefix, run.bar.index = "", 0
    reserve = {j.name: (0.0 if retime_done(studies[j.name]) else RETIME_EST_S) for j in open_
               if ledger(studies[j.name])["stop"] != "no valid config"}

    def note_turn(st, why, best):  # after a turn: what its re-timing should take now; none now
        reserve[st.study_name] = 0.0 if why == "no valid config" or retime_done(st) else \
            retime_estimate(st, run.rounds)
        return False

    def bucket_seeds(job, st):  # this run's nearest buckets' bests, each once, before the neighbours
        enqueue_seeds(st, job, bucket_seed_configs(job, run.jobs, studies), attr="bucket_seed")

    def keep() -> float:
        return sum(reserve.values())

    while budget.left() > 0 and budget.total_end() - keep() > time.time():
        todo = [j for j in open_ if ledger(studies[j.name])["stop"] not in DONE]
        turns = search_pass(todo, studies, run.runner, budget, run.bar, note_turn, patience=run.patience,
                            rounds=run.rounds, local=True, before=bucket_seeds, keep=keep, retime_share=0.0,
                            **run.turn_args())
        if not any(n for _, _, n in turns) or not [j for j in open_ if ledger(studies[j.name])["stop"] not in DONE]:
            break
    for job in open_:  # the re-timings of phase 2 (and of finished studies whose re-timing a budget cut short)
        st = studies[job.name]
        if budget.left() > 0 and ledger(st)["stop"] != "no valid config" and not retime_done(st) \
                and study_stats(st).get("config") is not None:
            retime_study(st, job, run.runner, run.rounds, budget.end())
        reserve.pop(job.name, None)


def _close(run: Run, pre) -> None:
    if pre.helpers:
        st_ = pre.stats()
        run.log(f"tune: precompile helpers: {st_['submitted']} configs handed over, {st_['compiled']} compiled, "
                f"{st_['failed']} failed (compiled by the sweep instead)")
    pre.close()
    if run.runner is not None:
        run.runner.close()
    run.bar.next_job()


def _row(st, job, min_gain: float) -> dict:
    """A study's row: its stats, the best seed's sweep time, its current re-timing, ledger and progress."""
    row = study_stats(st)
    fr = front_runners(st) if row.get("config") is not None else []
    row["seed_us"] = min((c["sweep_us"] for c in fr if "seed" in c["roles"]), default=None)
    r = st.user_attrs.get("retimed")
    row["retimed"] = r if isinstance(r, dict) and r.get("best_trial") == row.get("best_trial") else None
    row["ledger"] = ledger(st)
    row["progress"] = dataclasses.asdict(study_progress(
        current_trials(st.get_trials(deepcopy=False), code_version(job.spec.name)), min_gain))
    return row
