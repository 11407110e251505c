"""Phase 3 of ``tune all --budget`` (``fill``): time left once every study stopped is not handed back.
The converged studies are searched again in passes, each at twice the patience of the one before, until
the budget is spent or a pass finds nothing to evaluate. A pass goes by promise (gaining, open, stale:
shares weighted 4, 2, 1) and spends at most half the time left, so the next pass can give the rest to
what this one found; a study's turn tries its nearest buckets' winners, continues the descent (with the
runners-up's neighbours: ``BEAM``), then its sampler. A study whose turn its share cut is re-timed once,
at the end of the fill."""
from __future__ import annotations

import time

from tritune.tuning.ledger import LEDGER, ledger
from tritune.tuning.local import BEAM, Local, Prefetch, bucket_seed_configs
from tritune.tuning.retime import retime_done, retime_estimate, retime_study
from tritune.tuning.study import SEED_ATTRS, code_version, current_trials, enqueue_seeds, study_stats
from tritune.tuning.turn import MIN_GAIN, search_pass

PROMISE = {"gaining": 4, "open": 2, "stale": 1}  # a fill pass's order and the weight of each study's share
FILL_PASS_SHARE = 0.5  # of the time left, spent by one fill pass (the rest goes to what that pass found)
FILL_LAST_PASS_S = 60.0  # with less left, one pass takes all of it


def promise(gain: float, open_: bool, min_gain: float = MIN_GAIN) -> str:
    """A study's tier for the next fill pass: ``gaining`` (its best improved by more than ``min_gain``
    in its last turn), ``open`` (else: its incumbent has unevaluated neighbours, or a nearest bucket's
    winner is untried), ``stale`` (its last turn found nothing, and around its best nothing is left)."""
    return "gaining" if gain > min_gain else ("open" if open_ else "stale")


def by_promise(items: list[tuple]) -> list[tuple]:
    """``items``: (job, tier, gain) -> (job, weight), gaining first (the larger gain first), then open,
    then stale, in the plan's order within a tier; the weight is the tier's ``PROMISE``."""
    rank = list(PROMISE)
    order = sorted(range(len(items)), key=lambda i: (rank.index(items[i][1]), -items[i][2] if items[i][1] == "gaining"
                                                     else 0.0, i))
    return [(items[i][0], PROMISE[items[i][1]]) for i in order]


def last_search_gain(study, job) -> float:
    """What the search before the fill found: the best seed's time over the best time, less 1 (0 when a
    seed is the best)."""
    from optuna.trial import TrialState

    ts = current_trials(study.get_trials(deepcopy=False), code_version(job.spec.name))
    ok = [t for t in ts if t.state == TrialState.COMPLETE and t.value is not None]
    seeds = [t.value for t in ok if any(t.user_attrs.get(a) for a in SEED_ATTRS)]
    if not ok or not seeds:
        return 0.0
    return max(0.0, min(seeds) / min(t.value for t in ok) - 1.0)


def fill_cut_level(led: dict) -> int | None:
    """The fill pass's patience level a study was cut at in an earlier call, or None: its ledger's
    ``fill_cut``; else, for a study stopped on the budget after it had converged (only the fill searches a
    converged study), the level after the one it converged at."""
    if led.get("stop") != "budget":
        return None
    if led.get("fill_cut"):
        return int(led["fill_cut"])
    return 2 * int(led["patience"]) if isinstance(led.get("patience"), int) and led["patience"] > 0 else None


def fill(jobs, studies, runner, budget, *, patience: int, min_gain: float, trials, seed: int, rounds: int,
         progress, log, resumed: dict | None = None, prefetch: Prefetch | None = None) -> None:
    """Phase 3 (see the module's docstring): passes over the converged studies (and those a pass cut on
    their share) while budget is left, each pass at twice the patience of the one before, ordered and
    weighted by :func:`promise`, each study's turn starting with its nearest buckets' winners and its
    incumbent's neighbours. A study is re-timed after its turn when its best changed, unless its share cut
    the turn short: it is searched again in the next pass, and re-timed once at the end; the time those
    deferred re-timings should take is kept back from every turn.

    ``resumed`` (name -> the pass level it was cut at, the ledger's ``fill_cut``): the studies an earlier
    call's fill cut (a call that ``--stop-after`` ended): they start in ``cut`` at the lowest such level,
    their re-timing deferred, so a run in slices spends its fill as one call would."""
    resumed = resumed or {}
    level = max(patience, min(resumed.values()) // 2) if resumed else patience
    gain = {j.name: last_search_gain(studies[j.name], j) for j in jobs}  # the search before: its last turn
    cut: set[str] = set(resumed)   # ended its last turn on its share: searched again in the next pass
    by_name = {j.name: j for j in jobs}
    deferred: dict[str, float] = {n: retime_estimate(studies[n], rounds) for n in resumed  # name -> seconds its
                                  if not retime_done(studies[n])}   # re-timing should take, cut with a new best
    passes = 0
    prefetch = prefetch or Prefetch()

    def retime_if(st, why, best):
        changed = study_stats(st).get("best_trial") != best or not retime_done(st)
        if why == "budget" and changed:
            deferred[st.study_name] = retime_estimate(st, rounds)
            return False
        deferred.pop(st.study_name, None)
        return changed

    while True:
        left = budget.left() - sum(deferred.values())
        if left <= 0:
            break
        level *= 2
        todo = [j for j in jobs if j.name in cut or (ledger(studies[j.name])["stop"] == "converged"
                                                      and ledger(studies[j.name]).get("patience", patience) < level)]
        if not todo:
            if any(ledger(studies[j.name])["stop"] == "converged" for j in jobs):
                continue  # every converged study is at this level already: the next pass doubles it again
            break
        tiers = _tiers(todo, jobs, studies, gain, min_gain, prefetch)
        order = by_promise(tiers)
        counts = {t: sum(1 for _, tier, _ in tiers if tier == t) for t in PROMISE}
        pass_s = left if left <= FILL_LAST_PASS_S else left * FILL_PASS_SHARE
        passes += 1
        log(f"tune: {budget.left() / 60:.1f} min left: fill pass {passes}: {len(todo)} studies searched again "
            f"(patience {level}; " + ", ".join(f"{n} {t}" for t, n in counts.items() if n) +
            f"; this pass up to {pass_s / 60:.1f} min)")
        progress.prefix, progress.index, progress.n_jobs = f"fill {passes} ", 0, len(todo)
        before = {j.name: study_stats(studies[j.name]).get("best_us") for j in todo}

        def seeds(job, st):  # the nearest buckets' winners, each once, before the neighbours
            enqueue_seeds(st, job, bucket_seed_configs(job, jobs, studies), attr="bucket_seed")

        turns = search_pass([j for j, _ in order], studies, runner, budget, progress, retime_if, trials=trials,
                             patience=level, min_gain=min_gain, seed=seed, rounds=rounds, weights=[w for _, w in order],
                             end=time.time() + pass_s, local=True, before=seeds, keep=lambda: sum(deferred.values()),
                             beam=BEAM, prefetch=prefetch)
        _after_pass(turns, studies, cut, level, before, gain)
        if not any(n for _, _, n in turns) and not cut & {j.name for j, _, _ in turns}:
            if any(ledger(studies[j.name])["stop"] == "converged" for j, _, _ in turns):
                continue  # each ran this level out before it (a neighbourhood without a gain is longer than
                # the patience): the doubled level gives it sampler trials (its run without a gain is finite)
            break
    for name in list(deferred):  # the deferred re-timings: the best of each changed in a turn cut short
        if budget.left() <= 0:
            break
        if not retime_done(studies[name]):
            retime_study(studies[name], by_name[name], runner, rounds, budget.end())
        deferred.pop(name)


def _tiers(todo, jobs, studies, gain: dict, min_gain: float, prefetch) -> list[tuple]:
    """(job, its :func:`promise` tier, its last gain) of each study of a pass."""
    tiers = []
    for j in todo:
        st = studies[j.name]
        ts = current_trials(st.get_trials(deepcopy=False), code_version(j.spec.name))
        open_ = (Local(j, prefetch=prefetch).next_config(ts)[0] is not None
                 or bool(bucket_seed_configs(j, jobs, studies)))
        tiers.append((j, promise(gain[j.name], open_, min_gain), gain[j.name]))
    return tiers


def _after_pass(turns, studies, cut: set, level: int, before: dict, gain: dict) -> None:
    """After a pass: which studies its shares cut (marked in their ledger, where a later call resumes
    them: see :func:`fill_cut_level`) and what each turn gained."""
    for job, why, _ in turns:
        (cut.add if why == "budget" else cut.discard)(job.name)
        led, mark = ledger(studies[job.name]), (level if why == "budget" else None)
        if led.get("fill_cut") != mark:
            led = {k: v for k, v in led.items() if k != "fill_cut"}
            studies[job.name].set_user_attr(LEDGER, {**led, **({"fill_cut": mark} if mark else {})})
        b, a = before[job.name], study_stats(studies[job.name]).get("best_us")
        gain[job.name] = (b / a - 1.0) if (a and b) else 0.0
