"""One study's turn in ``tune all --budget``: its seeds (phase 1), or its search within a share of the time
left (the nearest buckets' winners, the local descent from its best, then its sampler), until it converges
(``PATIENCE`` evaluated trials in a row after the seeds without a gain of more than ``MIN_GAIN``),
exhausts its space, reaches ``--trials`` or runs out of its share (``budget``); and a pass of turns over
several studies, each with its share (:func:`search_pass`)."""
from __future__ import annotations

import dataclasses
import time

from tritune.tuning.ledger import Meter
from tritune.tuning.local import Local, Prefetch
from tritune.tuning.optuna_sampler import run_study
from tritune.tuning.retime import retime_study
from tritune.tuning.study import SEED_ATTRS, code_version, config_key, current_trials, evaluated, study_stats

PATIENCE = 6         # K: sampler trials after the seeds without a gain -> converged
MIN_GAIN = 0.02      # a gain beats the best so far by more than this fraction (do_bench's run-to-run spread)
RETIME_SHARE = 0.1   # of a study's share, kept for re-timing its front runners


@dataclasses.dataclass
class Progress:
    """What a study's trials say about it: evaluated trials, seeds still waiting, sampler trials after
    the seeds, and how many of those in a row brought no gain; of the trials after the seeds, the
    local-search neighbours (``local``, phase 2 and the fill) and the fill's nearest-bucket seeds
    (``bucket_seeds``), and how many of each were a gain (``*_gains``)."""
    evaluated: int = 0
    waiting: int = 0
    sampler: int = 0
    since_gain: int = 0
    best_us: float | None = None
    local: int = 0
    local_gains: int = 0
    bucket_seeds: int = 0
    bucket_seed_gains: int = 0


def study_progress(trials, min_gain: float = MIN_GAIN) -> Progress:
    """``trials``: the study's current trials (``current_trials``), in any order. A seed is a trial
    carrying a seed role (default, stored, warm, seeded), retried or not; every other evaluated trial is
    the sampler's (or forced), and each one that does not beat the best before it by more than
    ``min_gain`` extends the run without a gain (a failed one too: the draw found nothing)."""
    from optuna.trial import TrialState

    p = Progress(waiting=sum(t.state == TrialState.WAITING for t in trials))
    ev = sorted(evaluated(trials), key=lambda t: t.number)
    p.evaluated = len(ev)
    ok = [t for t in ev if t.state == TrialState.COMPLETE and t.value is not None]
    seeds = [t for t in ok if any(t.user_attrs.get(a) for a in SEED_ATTRS)]
    best = min((t.value for t in seeds), default=None)
    for t in ev:
        if any(t.user_attrs.get(a) for a in SEED_ATTRS):
            continue
        p.sampler += 1
        v = t.value if t.state == TrialState.COMPLETE else None
        gain = v is not None and (best is None or v < best * (1.0 - min_gain))
        if gain:
            p.since_gain = 0
        else:
            p.since_gain += 1
        if t.user_attrs.get("local"):
            p.local += 1
            p.local_gains += gain
        elif t.user_attrs.get("bucket_seed"):
            p.bucket_seeds += 1
            p.bucket_seed_gains += gain
        if v is not None:
            best = v if best is None else min(best, v)
    p.best_us = best
    return p


class Stop:
    """``run_study``'s ``should_stop``: after the seeds (``seeds_only``: as soon as none waits), or on
    convergence; charges the time to the ledger each time it is asked (once per proposal). With ``local``
    (phase 2 and the fill), the incumbent's unevaluated neighbours come before convergence and before the
    sampler: one is enqueued whenever no trial waits (:class:`Local`)."""

    def __init__(self, meter: Meter, seeds_only: bool, patience: int, min_gain: float, local=None):
        self.meter, self.seeds_only, self.patience, self.min_gain = meter, seeds_only, patience, min_gain
        self.local = local
        self.reason = None
        self.progress = Progress()

    def need(self) -> int:
        """Evaluated trials the study needs at least before it may stop (the progress bar's total)."""
        p = self.progress
        return p.evaluated + p.waiting + (0 if self.seeds_only else max(0, self.patience - p.since_gain))

    def __call__(self, trials) -> bool:
        before = self.progress.evaluated
        self.progress = p = study_progress(trials, self.min_gain)
        self.meter.charge(write=p.evaluated != before)
        if p.waiting:
            return False
        if self.seeds_only:
            self.reason = "seeded"
            return True
        if self.local is not None and self.local.enqueue(self.meter.study, trials):
            return False
        if p.since_gain >= self.patience:
            self.reason = "converged"
            return True
        return False


def study_valid(study, job) -> set:
    """The keys of the job's valid points (enumerated once per job: every turn of a study asks)."""
    got = job.__dict__.get("_valid_keys")
    if got is None:
        got = job.__dict__["_valid_keys"] = {config_key(p, job.spec.space.params)
                                             for p in job.spec.space.points(job.problem, job.dtype)}
    return got


def exhausted(study, job, valid: set) -> bool:
    from optuna.trial import TrialState

    ts = current_trials(study.get_trials(deepcopy=False), code_version(job.spec.name))
    done = {config_key(t.params, job.spec.space.params) for t in evaluated(ts)}
    return bool(valid) and valid <= done and not any(t.state == TrialState.WAITING for t in ts)


def sweep_study(study, job, runner, *, budget, share_end: float, seeds_only: bool, trials: int | None,
                 patience: int, min_gain: float, seed: int, progress, local: bool = False, beam: int = 0,
                prefetch: Prefetch | None = None) -> str:
    """Run one study's seeds (``seeds_only``) or its search (``local``, phase 2 and the fill: the
    incumbent's neighbours before the sampler's proposals, see :class:`Local`); return why it stopped."""
    meter = Meter(study)
    meter.led["calls"] = meter.led.get("calls", 0) + (0 if seeds_only else 1)
    valid = study_valid(study, job)
    if not valid:
        meter.charge(stop="no valid config")
        return "no valid config"
    hard = budget.end()
    stop = Stop(meter, seeds_only, patience, min_gain, Local(job, beam=beam, prefetch=prefetch) if local and not seeds_only else None)
    deadline = hard if seeds_only else min(hard, share_end)

    def show(job_, n, target, failed, best, dl):  # the bar's total: what the study needs at least
        if progress is not None:
            progress(job_, n, max(n, min(target, stop.need())), failed, best, dl)

    run_study(study, job, runner, trials=trials if trials is not None else 10**9, deadline=deadline,
                     seed=seed, progress=show, should_stop=stop)
    p = study_progress(current_trials(study.get_trials(deepcopy=False), code_version(job.spec.name)),
                       min_gain)  # run_study's own stops (count, space, deadline) come before the hook's
    if stop.reason == "seeded":
        meter.charge()
        return "seeded"
    if stop.reason is not None:
        why = stop.reason
    elif exhausted(study, job, valid):
        why = "exhausted"
    elif trials is not None and p.evaluated >= trials:
        why = "trials"
    else:
        why = "budget"
    meter.charge(stop=why, sampler_trials=p.sampler, since_gain=p.since_gain,
                 **({"patience": patience} if why == "converged" else {}))
    return why


def search_pass(todo, studies, runner, budget, progress, retime_if, *, trials, patience: int,
                 min_gain: float, seed: int, rounds: int, weights=None, end: float | None = None, local: bool = False,
                 before=None, keep=None, retime_share: float = RETIME_SHARE, beam: int = 0, prefetch: Prefetch | None = None) -> list[tuple]:
    """One pass over ``todo``: each study searched within its share of the time left until ``end`` (the
    budget's end by default, less ``keep()`` seconds kept back, asked before each turn):
    ``weights[i]`` over the sum of the weights of those not yet run (equal shares by default; time one
    does not use goes to the next), ``retime_share`` of it kept for re-timing; ``before(job, study)``
    first; then re-timed in the worker that compiled it when ``retime_if(study, why it stopped, its best
    trial before)``. Returns (job, why it stopped, trials evaluated) of each study that had its turn."""
    weights = list(weights) if weights is not None else [1.0] * len(todo)
    prefetch = prefetch or Prefetch()
    turns = []
    for i, job in enumerate(todo):
        stop_at = min(budget.total_end() - (keep() if keep is not None else 0.0), budget.end(),
                      budget.end() if end is None else end)
        left = stop_at - time.time()
        if left <= 0:
            break
        st = studies[job.name]
        if before is not None:
            before(job, st)
        prefetch.study(job, st)
        if i + 1 < len(todo):   # the helpers work one study ahead
            prefetch.study(todo[i + 1], studies[todo[i + 1].name])
        best = study_stats(st).get("best_trial")
        n0 = len(evaluated(st.get_trials(deepcopy=False)))
        share_end = time.time() + left * weights[i] / sum(weights[i:]) * (1 - retime_share)
        why = sweep_study(st, job, runner, budget=budget, share_end=share_end, seeds_only=False, trials=trials,
                           patience=patience, min_gain=min_gain, seed=seed, progress=progress, local=local,
                           beam=beam, prefetch=prefetch)
        turns.append((job, why, len(evaluated(st.get_trials(deepcopy=False))) - n0))
        if budget.left() > 0 and retime_if(st, why, best):
            retime_study(st, job, runner, rounds, budget.end())
        progress.next_job()
    return turns
