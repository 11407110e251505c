"""Re-timing as its own step: a study's front runners (every config that led it, every seed) timed side by
side in interleaved rounds, the order rotated each round, through the sweep's own runner and evaluator (one
timer), so a config that was lucky once does not win on noise and an unlucky seed gets a fair re-time.
A race: after ``RACE_AFTER`` rounds, configs more than ``RACE_MARGIN`` behind the leading median drop out
and the rounds left go to the close calls. The result is stored on the study (``retimed``); the export
takes its winner."""
from __future__ import annotations

import statistics
import time

from tritune.tuning.evaluate import Task
from tritune.tuning.ledger import Meter, ledger
from tritune.tuning.study import code_version, config_key, current_trials, study_stats

RETIME_ROUNDS = 5
RETIME_MAX = 6       # configs re-timed side by side per study (see front_runners)
ROLE_ORDER = ("tuned", "seed", "default", "led")
TIME_ONLY_S = 0.12   # one timing without compile or verification (a re-timing round of one config, H200)
RACE_AFTER = 2       # re-timing rounds every front runner gets before clear losers drop out
RACE_MARGIN = 0.15   # a front runner this far behind the leading median after RACE_AFTER rounds drops out
RETIME_EST_S = (2 * 4 + 3 * 2) * TIME_ONLY_S  # a study's re-timing, for the time kept back: ~4 front runners
# for RACE_AFTER rounds, then the close two for the rest


def front_runners(study, limit: int = None) -> list[dict]:
    """The configs the re-time before export decides between, each ``{"config", "roles", "sweep_us"}``
    (``sweep_us``: its best time in the sweep), on the current code, complete trials only:

    - every config that was the study's best at some point, in trial order (role ``led``; the current
      best is ``tuned``): a config that took the lead on one lucky measurement is re-timed, not trusted;
    - every seed: the default (``default``), the stored entry, the warm and given seeds (``seed``): a
      seed measured slow once in the sweep (a host hiccup in its one timing) gets its fair re-time.

    At most ``limit`` (RETIME_MAX): the tuned best and the default always, then the fastest in the sweep."""
    from optuna.trial import TrialState

    limit = RETIME_MAX if limit is None else limit
    st = study_stats(study)
    ts = current_trials(study.get_trials(deepcopy=False), code_version(st["kernel"]))
    done = sorted((t for t in ts if t.state == TrialState.COMPLETE and t.value is not None), key=lambda t: t.number)
    by_key: dict[str, dict] = {}

    def add(params: dict, value: float, role: str) -> None:
        c = by_key.setdefault(config_key(params, None), {"config": dict(params), "roles": [],
                                                                "sweep_us": value})
        c["sweep_us"] = min(c["sweep_us"], value)
        if role not in c["roles"]:
            c["roles"].append(role)

    lead = None
    for t in done:
        if lead is None or t.value < lead:
            lead = t.value
            add(t.params, t.value, "led")
        if any(t.user_attrs.get(k) for k in ("warm", "previous", "seeded")):
            add(t.params, t.value, "seed")
        if t.user_attrs.get("default") or (st["default_config"] is not None and dict(t.params) == st["default_config"]):
            add(t.params, t.value, "default")
    if st["config"] is not None:
        add(st["config"], st["best_us"], "tuned")
    cands = sorted(by_key.values(), key=lambda c: (not ({"tuned", "default"} & set(c["roles"])), c["sweep_us"]))
    for c in cands:  # a label in a fixed order: tuned, seed, default, led
        c["roles"] = [r for r in ROLE_ORDER if r in c["roles"]]
    return cands[:max(limit, 2)]


def retime(study, job, runner, rounds: int = RETIME_ROUNDS, deadline: float | None = None) -> dict | None:
    """Time the front runners (:func:`front_runners`) side by side in ``rounds`` interleaved rounds, the
    order rotated each round, through ``runner`` (the sweep's own evaluator: the same timer as every
    trial); the winner is the lowest median. A race: after ``RACE_AFTER`` rounds, a config whose median
    is more than ``RACE_MARGIN`` behind the leading median is not timed again (its median so far stands),
    and the re-timing ends when one config is left ("rounds" says how many ran): every front runner,
    an unlucky seed too, gets its ``RACE_AFTER`` fair timings, and the rounds go to the close calls. Stores and returns {"winner" (its roles joined by "+"),
    "config", "time_us", "default_us", "times_us" (per role: tuned, seed (the fastest seed), default),
    "rounds", "best_trial", "candidates" (each config's roles, sweep and re-time µs)}. No round starts
    after ``deadline`` (the budget's end) once one round is done: "rounds" says how many ran."""
    cands = front_runners(study)
    if not cands:
        return None
    times: list[list] = [[] for _ in cands]
    n = len(cands)
    racing = list(range(n))   # still timed: a clear loser drops out after RACE_AFTER rounds (see RACE_MARGIN)
    done_rounds = 0
    for r in range(rounds):
        if r and deadline is not None and time.time() >= deadline:
            break
        if r >= RACE_AFTER:
            now = {i: statistics.median(times[i]) for i in racing if times[i]}
            lead = min(now.values(), default=None)
            racing = [i for i in racing if i in now and now[i] <= lead * (1.0 + RACE_MARGIN)]
            if len(racing) < 2:
                break
        done_rounds += 1
        for i in [racing[(r + k) % len(racing)] for k in range(len(racing))]:
            res = runner(Task(job.spec.name, job.problem, job.dtype, cands[i]["config"], 0, spec=job.spec,
                                     verify=False))
            if res.get("ok"):
                times[i].append(float(res["ms"]) * 1e3)
    med = {i: statistics.median(ts) for i, ts in enumerate(times) if ts}
    if not med:
        return None
    win = min(med, key=med.get)
    times_us = {}
    for role in ("tuned", "seed", "default"):
        got = [med[i] for i in med if role in cands[i]["roles"]]
        if got:
            times_us[role] = round(min(got), 3)
    roles = cands[win]["roles"]  # "led" names a winner only when it has no other role
    out = {"winner": "+".join(r for r in roles if r != "led") or "led", "config": cands[win]["config"],
           "time_us": round(med[win], 3), "default_us": times_us.get("default"),
           "times_us": times_us, "rounds": done_rounds, "best_trial": study_stats(study)["best_trial"],
           "candidates": [{"config": c["config"], "roles": c["roles"], "sweep_us": round(c["sweep_us"], 3),
                           "retime_us": round(med[i], 3) if i in med else None} for i, c in enumerate(cands)]}
    study.set_user_attr("retimed", out)
    return out


def retime_study(study, job, runner, rounds: int, deadline: float | None = None) -> dict | None:
    """Re-time the study's front runners (when at least two distinct configs compete); the time is
    charged to the study."""
    meter = Meter(study)
    cands = front_runners(study)
    t0 = time.time()
    out = retime(study, job, runner, rounds, deadline) if len(cands) > 1 else None
    meter.charge(retimed=out is not None, retime_candidates=len(cands),
                 **({"retime_s": round(time.time() - t0, 3)} if out is not None else {}))
    return out


def retime_estimate(study, rounds: int) -> float:
    """Seconds a re-timing of the study's front runners should take: its last one's, else ``rounds``
    rounds of them at ``TIME_ONLY_S`` a timing (nothing when there is no rival)."""
    led = ledger(study)
    if isinstance(led.get("retime_s"), (int, float)):
        return float(led["retime_s"])
    n = len(front_runners(study))
    race = min(rounds, RACE_AFTER) * n + max(0, rounds - RACE_AFTER) * min(n, 2)
    return race * TIME_ONLY_S if n > 1 else 0.0


def retime_done(study) -> bool:
    """Whether the study's current best was re-timed (or had no rival to be re-timed against)."""
    led = ledger(study)
    if led.get("retime_candidates", 0) == 1 and not led.get("retimed"):
        return True
    r = study.user_attrs.get("retimed")
    return isinstance(r, dict) and r.get("best_trial") == study_stats(study)["best_trial"]
