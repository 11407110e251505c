"""A new GPU type in one command: ``tritune tune all --budget 30m``.

``--budget`` is what the run may spend (see phase 3 below). Every study (kernel x bucket x dtype) starts from

1. the heuristic default (the baseline),
2. this GPU's own stored entry, if any,
3. the nearest GPU type's stored winners (``warm``): for the same bucket and dtype key, then for the
   nearest neighbouring buckets. Nearest: the same vendor, then the same family letter (h100, h200,
   h20: ``h``), then the closest model number (an H200 warm-starts from the H100).

The run has three phases. First the seeds (1-3) of every study, so that each bucket has its warm-started
result before any study explores (the seeds are what make a short budget good). Then the search (phase 2):
each unfinished study in turn gets an equal share of the budget left (time a study does not use goes to
the next ones; the time its re-timing should take is kept back, see below), first tries the current bests of
this run's three nearest buckets of the same kernel and dtype (``bucket_seed``: a winner moves between
neighbouring buckets more often than between GPU types; each config once per study), then walks from its
best by coordinate descent (:class:`_Local`): whenever no trial
waits, the next unevaluated valid one-step neighbour of the current best (the choice before or after it
in one parameter's list; a boolean flipped) is evaluated (user attribute ``local``), so a neighbour that
wins becomes the centre at once (first improvement), and the move that won is tried again first. The
BLOCK_N 128 -> 64, stages 4 -> 5 path of the H200's gemm M=512,N=768,K=3072 needs that order: stages 5
does not fit with BLOCK_N 128. At most ``LOCAL_MAX`` neighbours a turn. Only once the current best's
neighbourhood is evaluated does the study's sampler propose (Optuna's TPE, whose first proposals are
random draws: under a short budget, the neighbours of a warm seed are the better use of a trial; on the
H200, phase 2's draws took 20 of the 30 min and still left two buckets 11-15% behind); a draw that wins
opens its own neighbourhood to the descent. The study stops when it

- converged: ``PATIENCE`` evaluated trials in a row after the seeds (neighbours and draws alike) brought
  no gain, a gain being a time below the best so far by more than ``MIN_GAIN`` (the run-to-run spread of
  do_bench's median; smaller differences are noise that the re-timing below would not trust either).
  The neighbourhood comes first: a study converges only on a best whose neighbours are all evaluated
  (or ``LOCAL_MAX`` of them were in this turn);
- exhausted its space (every valid point evaluated), or reached ``--trials``;
- ran out of its share, or of the budget (``budget``): it is resumed by a later pass or call while
  budget is left (its descent goes on from its best).

At the end of phase 2, once per study (not after each of its turns: the next turn, or the next call's,
moves its best again; a call that ``--stop-after`` cuts leaves them to the next call, and the time they
should take, ``RETIME_EST_S`` or the study's last re-timing, is kept back from the budget's end), its front
runners (every config that was ever the study's best, and every seed: see ``front_runners``) are
re-timed side by side, in interleaved rounds with the order rotated each round,
in the worker process that swept it (compiled already), by the evaluator of the sweep (one timer:
CUDA-graph replay for short problems, see ``harness.bench.timing_mode``): the winner is the lowest median
over the rounds, so a config that was lucky once in the sweep does not win on noise, and a seed that was
unlucky once does not lose on it. The re-timing is a race: every front runner gets ``RACE_AFTER`` rounds,
then those more than ``RACE_MARGIN`` behind the leading median drop out, and the rounds left go to the
close calls (on the H200 the re-timings after every turn had taken a third of a 30 min budget). The re-timing is stored on the study (``retimed``); the export takes
its winner.

Phase 3, time left once every study has stopped (``fill``, the default), is not handed back: the converged
studies are searched again, in passes, each pass at twice the patience of the one before (12, 24, ...), until
the budget is spent or a pass finds nothing to evaluate. The patience counts the trials since the last gain,
so a study whose neighbourhood outlasted a pass's patience gets only its nearest buckets' winners in that
pass, and sampler trials in a later one (a pass that evaluated nothing is followed by the next level while a
study is converged). A study's turn in the fill

- first tries the current bests of this run's three nearest buckets of the same kernel and dtype
  (fewest bucket fields apart, then ``store.bucket_distance``; each config once per study, valid ones only: user attribute ``bucket_seed``);
- then goes on with phase 2's descent from its best (the same :class:`_Local`): a nearest bucket's winner
  that took the lead, or a draw of the pass before, opens a new neighbourhood, and a turn that
  ``LOCAL_MAX`` cut short is continued; once the best's neighbours are all evaluated, those of up to
  ``BEAM`` runners-up within ``RUNNER_UP`` of it (seeds first), for pairs of moves each worse alone;
- then hands the study back to its sampler until the pass's patience. Neighbours and nearest-bucket seeds
  count as sampler trials for convergence (a gain resets the patience).

Each pass is ordered by promise (:func:`promise`): first the studies whose best improved by more than
``MIN_GAIN`` in their last turn (the larger gain first; before the first pass, the search of phase 2
counts), then those whose best has unevaluated neighbours or an untried nearest-bucket winner, last
those whose last turn found nothing around a fully explored best; their shares of the pass weigh 4, 2 and
1 (``PROMISE``). A pass spends at most half the time left (``FILL_PASS_SHARE``; all of it under a minute), so
the next pass can give the rest to what this one found; a study its share cut short is searched again in
the next pass. A study is re-timed after its turn when its best changed, except after a turn its share
cut short: its best is likely to move again in the next pass, so it is re-timed once, at the end of the
fill, and the time that should take (its last re-timing's) is kept back from every turn until then.
``fill=False`` (``--no-fill``) stops at convergence instead.

Compiling ahead (:mod:`tritune.tuning.precompile`): a config's first launch compiles it, three quarters of a
trial's time on the H200. Helper processes (``--precompile N``; default the CPU cores less two, at most 8)
compile what the sweep will evaluate next (every study's seeds before phase 1, a study's nearest buckets'
winners and its best's unevaluated neighbours at the start of its turn and of the next study's, the
neighbours again whenever the best moves) into triton's cache, where the sweep's own first launch finds it;
the sweep still launches, verifies and times every config itself.

Kill-safe and resumable: the time each study spends (sweep and re-timing) is added to its ``budget``
user attribute after every trial, and the budget left is the budget less the sum over the plan's studies.
The same command on the same ``--storage`` skips finished studies (converged, exhausted, trial cap;
re-timed), continues a killed one (its abandoned trial is retried with its role, a neighbour as a
neighbour, see ``search.reap``; the descent skips every config evaluated before) and spends only
what is left, so a 30 min budget can run as several shorter calls (``--stop-after``). A kill loses at
most the time of the trial in flight from the accounting.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re
import statistics
import sys
import time

from tritune.tuning import precompile, search

from tritune.kernels.runtime import store

RETIME_ROUNDS = 5
RETIME_MAX = 6       # configs re-timed side by side per study (see front_runners)
ROLE_ORDER = ("tuned", "seed", "default", "led")
RETIME_SHARE = 0.1   # of a study's share, kept for re-timing its front runners
PATIENCE = 6         # K: sampler trials after the seeds without a gain -> converged
MIN_GAIN = 0.02      # a gain beats the best so far by more than this fraction (do_bench's run-to-run spread)
LEDGER = "budget"    # the study user attribute holding the time spent and why the study stopped
DONE = ("converged", "exhausted", "trials", "no valid config")
SEED_ATTRS = ("default", "previous", "warm", "seeded")
LOCAL_MAX = 32       # one-step neighbours evaluated per study turn, phase 2 and fill (gemm's neighbourhood: <= 18)
BEAM = 3             # the fill: runners-up whose neighbours are walked once the best's are all evaluated
RUNNER_UP = 0.10     # ... a runner-up: within this fraction of the best (seeds first, then the fastest)
REPAIR_STEPS = 2     # extra steps in other parameters that may make a refused one-step move valid (neighbours)
REPAIR_KEEP = 1      # repaired configs kept per refused move (each is a trial before a study can converge)
BUCKET_SEEDS = 3     # nearest buckets of the same kernel and dtype whose best a study tries in the fill
PROMISE = {"gaining": 4, "open": 2, "stale": 1}  # a fill pass's order and the weight of each study's share
FILL_PASS_SHARE = 0.5  # of the time left, spent by one fill pass (the rest goes to what that pass found)
FILL_LAST_PASS_S = 60.0  # with less left, one pass takes all of it

# Estimate (``--dry-run``): seconds per evaluated trial on an H100/H200 (compile the config, verify it
# against the float64 reference on fresh inputs, time it: do_bench 25 ms warm-up + 100 ms), read off the
# wall times of the tuning runs in lab/logs/h100 and lab/logs/h200 (2026-11-22/23: 0.5-1.5 s a trial);
# trials already in the storage replace them with their own recorded seconds.
TRIAL_S = {"gemm": 0.8, "gemv": 0.8, "attention": 1.3, "attention_varlen": 1.3, "paged_attention": 1.0,
           "quant_matmul": 1.2, "gelu": 0.6, "layer_norm": 0.6}
TRIAL_S_OTHER = 1.0
TIME_ONLY_S = 0.12   # one timing without compile or verification (a re-timing round of one config): 0.106 s
# on average over the 1,805 timings of the H200 run's last re-timings (lab/logs/h200/tune_all_budget_descent_*)
RACE_AFTER = 2       # re-timing rounds every front runner gets before clear losers drop out
RACE_MARGIN = 0.15   # a front runner this far behind the leading median after RACE_AFTER rounds drops out
RETIME_EST_S = (2 * 4 + 3 * 2) * TIME_ONLY_S  # a study's re-timing, for the time kept back: ~4 front runners
# for RACE_AFTER rounds, then the close two for the rest
WORKER_START_S = 15.0


def _model(slug: str) -> tuple[str, str, float | None]:
    """(vendor, family letters, model number) of a GPU slug: 'nvidia-h100-80gb-hbm3' -> ('nvidia', 'h', 100)."""
    parts = slug.lower().split("-")
    vendor = parts[0] if parts else ""
    for p in parts[1:]:
        m = re.fullmatch(r"([a-z]+)(\d+)[a-z]*", p)
        if m and m.group(1) not in ("gb", "hbm"):
            return vendor, m.group(1), float(m.group(2))
    return vendor, "", None


def nearest_slug(slug: str, available) -> str | None:
    """The stored GPU type nearest to ``slug``; None when none is of the same vendor."""
    v, fam, num = _model(slug)

    def score(other):
        ov, ofam, onum = _model(other)
        close = -abs(math.log(onum / num)) if (num and onum) else -99.0
        prefix = len([1 for a, b in zip(slug, other) if a == b])
        return (ofam == fam, close, prefix)

    cands = [s for s in available if s != slug and _model(s)[0] == v and v]
    return max(cands, key=score) if cands else None


def warm_configs(job, slug: str, limit: int = 3) -> list[dict]:
    """Another GPU type's stored winners for a job: its entry for the same bucket and dtype key, then
    those of the nearest buckets (at most ``limit`` distinct configs, invalid ones dropped)."""
    es = [e for e in store.entries(job.spec, slug) if e["dtype"] == job.key]
    want = store.parse_bucket(job.bucket)
    es.sort(key=lambda e: (store.bucket_distance(want, store.parse_bucket(e["bucket"])), e["bucket"]))
    out = []
    for e in es:
        cfg = dict(e["config"])
        if cfg not in out and not job.spec.space.why_invalid(cfg, job.problem, job.dtype):
            out.append(cfg)
        if len(out) >= limit:
            break
    return out


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
    st = search.study_stats(study)
    ts = search.current_trials(study.get_trials(deepcopy=False), search.code_version(st["kernel"]))
    done = sorted((t for t in ts if t.state == TrialState.COMPLETE and t.value is not None), key=lambda t: t.number)
    by_key: dict[str, dict] = {}

    def add(params: dict, value: float, role: str) -> None:
        c = by_key.setdefault(search.config_key(params, None), {"config": dict(params), "roles": [],
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
            res = runner(search.Task(job.spec.name, job.problem, job.dtype, cands[i]["config"], 0, spec=job.spec,
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
           "times_us": times_us, "rounds": done_rounds, "best_trial": search.study_stats(study)["best_trial"],
           "candidates": [{"config": c["config"], "roles": c["roles"], "sweep_us": round(c["sweep_us"], 3),
                           "retime_us": round(med[i], 3) if i in med else None} for i, c in enumerate(cands)]}
    study.set_user_attr("retimed", out)
    return out


# ---------------------------------------------------------------------------------------------------
# The ledger: time spent and why a study stopped, in the storage (resumable, shared by every call)
# ---------------------------------------------------------------------------------------------------
def ledger(study) -> dict:
    """{"spent_s", "stop", "calls"} of a study (zeros for one the budgeted run never touched)."""
    d = study.user_attrs.get(LEDGER)
    return {"spent_s": 0.0, "stop": None, "calls": 0, **(d if isinstance(d, dict) else {})}


class _Meter:
    """Adds wall time to a study's ledger as it goes (after every trial, so a kill loses one trial's)."""

    def __init__(self, study):
        self.study, self.mark = study, time.time()
        self.written = self.mark
        self.led = ledger(study)

    def charge(self, write: bool = False, **updates) -> None:
        """Add the time since the last charge; written after a trial was evaluated (``write``), with
        ``updates``, or when 0.5 s passed (free proposals, pruned or duplicates, come in bursts: a journal
        write per evaluated trial, not per proposal)."""
        now = time.time()
        self.led["spent_s"] = round(self.led["spent_s"] + (now - self.mark), 3)
        self.mark = now
        self.led.update(updates)
        if write or updates or now - self.written >= 0.5:
            self.study.set_user_attr(LEDGER, self.led)
            self.written = now


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
    """``trials``: the study's current trials (``search.current_trials``), in any order. A seed is a trial
    carrying a seed role (default, stored, warm, seeded), retried or not; every other evaluated trial is
    the sampler's (or forced), and each one that does not beat the best before it by more than
    ``min_gain`` extends the run without a gain (a failed one too: the draw found nothing)."""
    from optuna.trial import TrialState

    p = Progress(waiting=sum(t.state == TrialState.WAITING for t in trials))
    ev = sorted(search._evaluated(trials), key=lambda t: t.number)
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


class _Stop:
    """``run_study``'s ``should_stop``: after the seeds (``seeds_only``: as soon as none waits), or on
    convergence; charges the time to the ledger each time it is asked (once per proposal). With ``local``
    (phase 2 and the fill), the incumbent's unevaluated neighbours come before convergence and before the
    sampler: one is enqueued whenever no trial waits (:class:`_Local`)."""

    def __init__(self, meter: _Meter, seeds_only: bool, patience: int, min_gain: float, local=None):
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


# ---------------------------------------------------------------------------------------------------
# The search: the incumbent's neighbours (phase 2 and the fill); the fill's nearest buckets' winners and order
# ---------------------------------------------------------------------------------------------------
def neighbours(space, config: dict, problem, dtype, first: tuple | None = None,
               repair: int | None = None) -> list[dict]:
    """The valid one-step neighbours of ``config``: for each parameter, the choice before and the one
    after its value in the parameter's list (a boolean's flip), in the space's order. ``first``
    (parameter, step in the list): that move once more goes first, as coordinate descent keeps going the
    way it just gained.

    Then the repaired moves (``repair`` extra steps at most, ``REPAIR_STEPS`` by default, 0: none): a move
    that the space's constraint refuses, made valid by the fewest steps in the other parameters (at most
    ``REPAIR_KEEP`` such configs a move, single-parameter repairs first). A constraint splits a space into
    regions that no one-step walk crosses: quant_matmul's GEMV path (BLOCK_M 1, one stage) and its tiled
    path (BLOCK_M >= 8 needs BLOCK_M x BLOCK_N >= 4 x threads): on the H200 the int4 M=1 4096x4096 study
    converged at 9.7 us on the GEMV path, the tiled path's best being 7.2 (BLOCK_M 1 -> 8 at BLOCK_N 16,
    4 warps is refused: idle warps; with 1 warp, two steps more, it is valid)."""
    out, refused = [], []
    for k, choices in space.params.items():
        i = _index(choices, config.get(k))
        for j in (() if i is None else (i - 1, i + 1)):
            if 0 <= j < len(choices):
                c = dict(config, **{k: choices[j]})
                if not space.why_invalid(c, problem, dtype):
                    out.append(c)
                else:
                    refused.append((k, c))
    if first is not None and first[0] in space.params:
        k, d = first
        i = _index(space.params[k], config.get(k))
        out.sort(key=lambda c: i is None or _index(space.params[k], c[k]) != i + d)  # stable: the rest keep order
    steps = REPAIR_STEPS if repair is None else repair
    if steps > 0:
        seen = {search.config_key(c, space.params) for c in out}
        for k, c in refused:
            for r in _repairs(space, c, k, problem, dtype, steps):
                key = search.config_key(r, space.params)
                if key not in seen:
                    seen.add(key)
                    out.append(r)
    return out


def _repairs(space, c: dict, moved: str, problem, dtype, steps: int) -> list[dict]:
    """Valid configs that keep ``c[moved]`` and differ from ``c`` in the fewest steps (up to ``steps``) of
    the other parameters: at most ``REPAIR_KEEP`` of them at the least distance that has one, in the
    space's order (one parameter moved before two, the smaller step first, down before up)."""
    pos = {k: _index(ch, c.get(k)) for k, ch in space.params.items() if k != moved}
    others = [k for k, i in pos.items() if i is not None]
    for dist in range(1, steps + 1):
        found = []
        for n_par in range(1, dist + 1):
            for ks in itertools.combinations(others, n_par):
                for sizes in _compositions(dist, n_par):
                    for signs in itertools.product((-1, 1), repeat=n_par):
                        js = [pos[k] + a * b for k, a, b in zip(ks, sizes, signs)]
                        if all(0 <= j < len(space.params[k]) for k, j in zip(ks, js)):
                            d = dict(c, **{k: space.params[k][j] for k, j in zip(ks, js)})
                            if not space.why_invalid(d, problem, dtype):
                                found.append(d)
                                if len(found) >= REPAIR_KEEP:
                                    return found
        if found:
            return found
    return []


def _compositions(total: int, parts: int) -> list[tuple]:
    """Ordered ways of writing ``total`` as ``parts`` positive integers."""
    if parts == 1:
        return [(total,)]
    return [(a,) + rest for a in range(1, total - parts + 2) for rest in _compositions(total - a, parts - 1)]


def _index(choices: list, value) -> int | None:
    """The position of ``value`` in a choice list (True is not 1 here)."""
    return next((n for n, c in enumerate(choices) if c == value and isinstance(c, bool) == isinstance(value, bool)),
                None)


def _incumbent(trials):
    """The best complete trial (the earliest of equal times), or None."""
    from optuna.trial import TrialState

    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    return min(ok, key=lambda t: (t.value, t.number)) if ok else None


def _taken(trials, params: dict) -> set:
    """Keys of the configs evaluated (on the current code), running or waiting: none is proposed again."""
    from optuna.trial import TrialState

    keys = {search.config_key(t.params, params) for t in search._evaluated(trials)}
    for t in trials:
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            keys.add(search.config_key(t.params or t.system_attrs.get("fixed_params") or {}, params))
    return keys


_PRE = None   # the Precompiler of the running tune_budget call (tuning.precompile), or None


def _prefetch(job, configs) -> None:
    """Hand ``configs`` of ``job`` to the precompile helpers (no-op without them)."""
    if _PRE is None:
        return
    for c in configs:
        _PRE.submit(search.Task(job.spec.name, job.problem, job.dtype, dict(c), 0, spec=job.spec))


def _prefetch_study(job, study) -> None:
    """What a study's next turn evaluates first: its waiting trials (seeds), then the unevaluated
    neighbours of its best."""
    if _PRE is None:
        return
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    _prefetch(job, [t.system_attrs.get("fixed_params") or t.params for t in trials if t.state == TrialState.WAITING])
    inc = _incumbent(trials)
    if inc is not None:
        taken = _taken(trials, job.spec.space.params)
        _prefetch(job, [c for c in neighbours(job.spec.space, dict(inc.params), job.problem, job.dtype)
                        if search.config_key(c, job.spec.space.params) not in taken])


def runners_up(trials, inc, beam: int, params: dict, within: float | None = None) -> list:
    """Up to ``beam`` complete trials of distinct configs other than the incumbent ``inc``'s, within
    ``within`` (``RUNNER_UP``) of its time: seeds (the default, the stored, warm and nearest buckets'
    winners: basins found elsewhere) first, then the fastest."""
    from optuna.trial import TrialState

    if beam <= 0 or inc is None:
        return []
    within = RUNNER_UP if within is None else within
    seen = {search.config_key(inc.params, params)}
    out = []
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
          and t.value <= inc.value * (1.0 + within)]
    seeds = SEED_ATTRS + ("bucket_seed",)
    for t in sorted(ok, key=lambda t: (not any(t.user_attrs.get(k) for k in seeds), t.value, t.number)):
        key = search.config_key(t.params, params)
        if key not in seen:
            seen.add(key)
            out.append(t)
            if len(out) == beam:
                break
    return out


class _Local:
    """Coordinate descent around the incumbent for one study turn (phase 2's and the fill's): whenever no
    trial waits, the next unevaluated valid one-step neighbour of the current best is enqueued (user
    attribute ``local``; its centre in ``local_of``), so a neighbour that wins becomes the centre at once
    (first improvement). At most ``limit`` (``LOCAL_MAX``) per turn; the neighbours count as sampler trials
    for convergence.

    ``beam`` (the fill's, ``BEAM``): once the best's neighbours are all evaluated, those of up to ``beam``
    runners-up (distinct configs within ``RUNNER_UP`` of the best; seeds first, the fastest next). Two moves
    that are each worse alone are out of a one-step walk's reach: on the H200, gemm M=1 N=2304 K=768 with
    the LayerNorm prologue and KV epilogue sat at 8.9 us on BLOCK_K 128, 2 warps, while BLOCK_K 256 with 4
    warps takes 7.2; the H100's seed (BLOCK_K 256, 2 warps, 9.1 us, 2% behind) is one step from it."""

    def __init__(self, job, limit: int | None = None, beam: int = 0):
        self.job, self.limit, self.n, self.beam = job, LOCAL_MAX if limit is None else limit, 0, beam

    def next_config(self, trials) -> tuple[dict, int] | tuple[None, None]:
        """(the next neighbour to evaluate, the number of the trial it is a neighbour of)."""
        space, params = self.job.spec.space, self.job.spec.space.params
        inc = _incumbent(trials)
        if inc is None:
            return None, None
        first = None
        parent = next((t for t in trials if t.number == inc.user_attrs.get("local_of")), None)
        if parent is not None:
            moved = [k for k in params if parent.params.get(k) != inc.params.get(k)]
            if len(moved) == 1:
                k = moved[0]
                i, j = _index(params[k], parent.params.get(k)), _index(params[k], inc.params.get(k))
                first = (k, j - i) if i is not None and j is not None else None
        taken = _taken(trials, params)
        for centre in [inc] + runners_up(trials, inc, self.beam, params):
            todo = [c for c in neighbours(space, dict(centre.params), self.job.problem, self.job.dtype,
                                          first if centre is inc else None)
                    if search.config_key(c, params) not in taken]
            if todo:
                _prefetch(self.job, todo)   # compiled by the helpers while the sweep evaluates them one by one
                return todo[0], centre.number
        return None, None

    def enqueue(self, study, trials) -> bool:
        if self.n >= self.limit:
            return False
        cfg, of = self.next_config(trials)
        if cfg is None:
            return False
        study.enqueue_trial(cfg, user_attrs={"local": True, "local_of": of})
        self.n += 1
        return True


def bucket_seed_configs(job, jobs, studies, limit: int = BUCKET_SEEDS) -> list[dict]:
    """The current best configs of this run's studies of the same kernel and dtype key whose buckets are
    nearest to ``job``'s (the ``limit`` nearest with a best: fewest fields apart first, then
    ``store.bucket_distance`` without its per-field cap, which guards the store's runtime fallback; a seed
    here is verified and timed), keeping those valid for ``job``'s problem and neither evaluated nor
    enqueued in its study yet. On the H200 the int4 M=1 N=4096 K=4096 study never tried its M=16 sibling's
    best (7.8 us against its own 9.7): M=16 was past the cap, and its two nearest by distance were M=1
    buckets of other weight shapes."""
    want = store.parse_bucket(job.bucket)
    sib = []
    for j in jobs:
        if j is job or j.spec.name != job.spec.name or j.key != job.key or j.name not in studies:
            continue
        other = store.parse_bucket(j.bucket)
        d = store.bucket_distance(want, other, max_field_log2=math.inf)   # a seed is verified and timed: no cap
        if math.isfinite(d):   # fewest fields apart first: M=1 and M=16 of one weight shape before M=1 of another
            sib.append((sum(want[k] != other[k] for k in want), d, j.bucket, j))
    sib.sort(key=lambda x: x[:3])
    params = job.spec.space.params
    st = studies[job.name]
    taken = _taken(search.current_trials(st.get_trials(deepcopy=False), search.code_version(job.spec.name)), params)
    out, n = [], 0
    for *_, j in sib:
        cfg = search.study_stats(studies[j.name]).get("config")
        if cfg is None:
            continue
        n += 1
        key = search.config_key(cfg, params)
        if key not in taken and not job.spec.space.why_invalid(cfg, job.problem, job.dtype):
            out.append(dict(cfg))
            taken.add(key)
        if n >= limit:
            break
    return out


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


def _last_search_gain(study, job) -> float:
    """What the search before the fill found: the best seed's time over the best time, less 1 (0 when a
    seed is the best)."""
    from optuna.trial import TrialState

    ts = search.current_trials(study.get_trials(deepcopy=False), search.code_version(job.spec.name))
    ok = [t for t in ts if t.state == TrialState.COMPLETE and t.value is not None]
    seeds = [t.value for t in ok if any(t.user_attrs.get(a) for a in SEED_ATTRS)]
    if not ok or not seeds:
        return 0.0
    return max(0.0, min(seeds) / min(t.value for t in ok) - 1.0)


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
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


def _study_valid(study, job) -> set:
    """The keys of the job's valid points (enumerated once per job: every turn of a study asks)."""
    got = job.__dict__.get("_valid_keys")
    if got is None:
        got = job.__dict__["_valid_keys"] = {search.config_key(p, job.spec.space.params)
                                             for p in job.spec.space.points(job.problem, job.dtype)}
    return got


def _exhausted(study, job, valid: set) -> bool:
    from optuna.trial import TrialState

    ts = search.current_trials(study.get_trials(deepcopy=False), search.code_version(job.spec.name))
    done = {search.config_key(t.params, job.spec.space.params) for t in search._evaluated(ts)}
    return bool(valid) and valid <= done and not any(t.state == TrialState.WAITING for t in ts)


def _prepare(storage_obj, jobs, warm, window: float) -> dict:
    """Open every study, fail the trials of a killed call (``search.reap``: each is enqueued again),
    enqueue its seeds (default, stored entry, warm winners; each once, see ``search._enqueue_seeds``) and
    return name -> study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    studies = {}
    for job in jobs:
        study = search.open_study(storage_obj, job, search.make_sampler(
            "tpe", job.spec.space, search._seed(0, job.name, "tpe")))
        if ledger(study)["stop"] not in DONE:
            search.reap(study, window)
            search.ensure_seeds(study, job)
            if warm is not None:
                search._enqueue_seeds(study, job, warm(job), attr="warm")
        studies[job.name] = study
    return studies


def _sweep_study(study, job, runner, *, budget: Budget, share_end: float, seeds_only: bool, trials: int | None,
                 patience: int, min_gain: float, seed: int, progress, local: bool = False, beam: int = 0) -> str:
    """Run one study's seeds (``seeds_only``) or its search (``local``, phase 2 and the fill: the
    incumbent's neighbours before the sampler's proposals, see :class:`_Local`); return why it stopped."""
    meter = _Meter(study)
    meter.led["calls"] = meter.led.get("calls", 0) + (0 if seeds_only else 1)
    valid = _study_valid(study, job)
    if not valid:
        meter.charge(stop="no valid config")
        return "no valid config"
    hard = budget.end()
    stop = _Stop(meter, seeds_only, patience, min_gain, _Local(job, beam=beam) if local and not seeds_only else None)
    deadline = hard if seeds_only else min(hard, share_end)

    def show(job_, n, target, failed, best, dl):  # the bar's total: what the study needs at least
        if progress is not None:
            progress(job_, n, max(n, min(target, stop.need())), failed, best, dl)

    search.run_study(study, job, runner, trials=trials if trials is not None else 10**9, deadline=deadline,
                     seed=seed, progress=show, should_stop=stop)
    p = study_progress(search.current_trials(study.get_trials(deepcopy=False), search.code_version(job.spec.name)),
                       min_gain)  # run_study's own stops (count, space, deadline) come before the hook's
    if stop.reason == "seeded":
        meter.charge()
        return "seeded"
    if stop.reason is not None:
        why = stop.reason
    elif _exhausted(study, job, valid):
        why = "exhausted"
    elif trials is not None and p.evaluated >= trials:
        why = "trials"
    else:
        why = "budget"
    meter.charge(stop=why, sampler_trials=p.sampler, since_gain=p.since_gain,
                 **({"patience": patience} if why == "converged" else {}))
    return why


def _retime_study(study, job, runner, rounds: int, deadline: float | None = None) -> dict | None:
    """Re-time the study's front runners (when at least two distinct configs compete); the time is
    charged to the study."""
    meter = _Meter(study)
    cands = front_runners(study)
    t0 = time.time()
    out = retime(study, job, runner, rounds, deadline) if len(cands) > 1 else None
    meter.charge(retimed=out is not None, retime_candidates=len(cands),
                 **({"retime_s": round(time.time() - t0, 3)} if out is not None else {}))
    return out


def _retime_estimate(study, rounds: int) -> float:
    """Seconds a re-timing of the study's front runners should take: its last one's, else ``rounds``
    rounds of them at ``TIME_ONLY_S`` a timing (nothing when there is no rival)."""
    led = ledger(study)
    if isinstance(led.get("retime_s"), (int, float)):
        return float(led["retime_s"])
    n = len(front_runners(study))
    race = min(rounds, RACE_AFTER) * n + max(0, rounds - RACE_AFTER) * min(n, 2)
    return race * TIME_ONLY_S if n > 1 else 0.0


def tune_budget(kernels_, budget_s: float, *, storage=None, trials: int | None = None, dtypes=None, problems=None,
                warm_from: str | None = None, rounds: int = RETIME_ROUNDS, progress: bool = True,
                slug: str | None = None, evaluate=None, isolation: str = "auto", timeout: float = search.TASK_TIMEOUT,
                seed: int = 0, log=None, patience: int = PATIENCE, min_gain: float = MIN_GAIN,
                stop_after: float | None = None, fill: bool = True,
                precompile_helpers: int | None = None) -> tuple[list[dict], str | None]:
    """Tune within ``budget_s`` seconds in all (this call and earlier ones on ``storage``), warm-started
    from ``warm_from`` (default: the nearest stored GPU type); see the module's docstring. ``stop_after``:
    this call stops starting trials after so many seconds (a later call resumes). ``precompile_helpers``:
    processes compiling the configs the sweep tries next (:mod:`tritune.tuning.precompile`; default
    ``TRITUNE_PRECOMPILE`` or the CPU cores less two, at most 8; none under the interpreter). ``fill``: spend time left
    after every study stopped on the converged ones (phase 3: doubled patience per pass, by promise, the
    nearest buckets' winners tried, the local search continued). Returns (rows, the GPU
    type warmed from); each row is the study's stats plus ``seed_us``, ``retimed`` and ``ledger``."""
    import optuna

    from tritune.kernels.runtime import device as dev

    if patience < 1:
        raise ValueError(f"patience: expected at least 1, got {patience!r}")
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain: expected a fraction in [0, 1), got {min_gain!r}")
    log = log or (lambda m: print(m, file=sys.stderr))
    slug = slug or dev.gpu_slug()
    near = warm_from or nearest_slug(slug, store.slugs())
    specs = search.resolve_specs(kernels_)
    jobs = search.plan(specs, problems, dtypes, slug, log)
    storage_obj = search.open_storage(storage)
    warm = (lambda job: warm_configs(job, near)) if near else None
    studies = _prepare(storage_obj, jobs, warm, timeout + 120.0)
    spent = sum(ledger(s)["spent_s"] for s in studies.values())
    budget = Budget(budget_s, spent, None if stop_after is None else time.time() + stop_after)
    log(f"tune: budget {budget_s / 60:.1f} min, {spent / 60:.1f} min of it spent by earlier calls; "
        f"{len(jobs)} studies; warm start from "
        f"{near + ' (stored winners seeded as first trials)' if near else 'nothing (no stored GPU type of this vendor)'}"
        f"; a study walks from its best by one-step neighbours, then its sampler proposes, and it converges "
        f"after {patience} trials without a gain > {min_gain:.0%}"
        + ("; time left then goes to the converged studies (doubled patience per pass, the most promising "
           "first; the nearest buckets' winners tried, the local search continued)" if fill else ""))
    # a study an earlier call's fill cut on its share (a call ended by --stop-after) resumes in the fill,
    # at that pass's level, its re-timing deferred to the fill's end: not phase 2 again, nor re-timed now
    resumed = {j.name: lv for j in jobs if fill and (lv := _fill_cut_level(ledger(studies[j.name])))}
    open_ = [j for j in jobs if j.name not in resumed
             and (ledger(studies[j.name])["stop"] not in DONE or not _retime_done(studies[j.name]))]
    refill = fill and budget.left() > 0 and (bool(resumed) or any(ledger(studies[j.name])["stop"] == "converged"
                                                                  for j in jobs))
    if len(open_) + len(resumed) < len(jobs):
        log(f"tune: {len(jobs) - len(open_) - len(resumed)} studies finished in earlier calls (skipped)")
    if resumed:
        log(f"tune: {len(resumed)} studies resume the fill where an earlier call stopped it")
    runner = search.make_runner(evaluate, isolation, timeout=timeout) if open_ or refill else None
    bar = search.Progress(len(open_), enabled=progress)
    global _PRE
    pre = precompile.Precompiler(helpers=precompile_helpers if runner is not None else 0)
    if pre.helpers:
        log(f"tune: {pre.helpers} helper processes compile the configs the sweep tries next ({precompile.ENV}=0: none)")
    _PRE = pre if pre.helpers else None
    try:
        for job in open_:   # phase 1's seeds, every study's, handed to the helpers at once
            _prefetch_study(job, studies[job.name])
        # phase 1: every study's seeds
        for job in open_:
            if budget.left() <= 0:
                break
            st = studies[job.name]
            if any(t.state.name == "WAITING" for t in st.get_trials(deepcopy=False)):
                bar.prefix = "seeds "
                _sweep_study(st, job, runner, budget=budget, share_end=budget.end(), seeds_only=True, trials=trials,
                             patience=patience, min_gain=min_gain, seed=seed, progress=bar)
                bar.next_job()
        # phase 2: the search, in passes while budget is left and a pass evaluates something. The
        # re-timings come at the end of the phase, one per study (not one per turn: a study's best moves
        # again in its next turn, or the next call's), and the time they should take is kept back from
        # the budget's end (not from this call's: a call cut by --stop-after leaves them to the next).
        bar.prefix, bar.index = "", 0
        reserve = {j.name: (0.0 if _retime_done(studies[j.name]) else RETIME_EST_S) for j in open_
                   if ledger(studies[j.name])["stop"] != "no valid config"}

        def note_turn(st, why, best):  # after a turn: what its re-timing should take now; none now
            reserve[st.study_name] = 0.0 if why == "no valid config" or _retime_done(st) else \
                _retime_estimate(st, rounds)
            return False

        def bucket_seeds(job, st):  # this run's nearest buckets' bests, each once, before the neighbours
            search._enqueue_seeds(st, job, bucket_seed_configs(job, jobs, studies), attr="bucket_seed")

        def keep() -> float:
            return sum(reserve.values())

        while budget.left() > 0 and budget.total_end() - keep() > time.time():
            todo = [j for j in open_ if ledger(studies[j.name])["stop"] not in DONE]
            turns = _search_pass(todo, studies, runner, budget, bar, note_turn, trials=trials, patience=patience,
                                 min_gain=min_gain, seed=seed, rounds=rounds, local=True, before=bucket_seeds,
                                 keep=keep, retime_share=0.0)
            if not any(n for _, _, n in turns) or not [j for j in open_ if ledger(studies[j.name])["stop"] not in DONE]:
                break
        for job in open_:  # the re-timings of phase 2 (and of finished studies whose re-timing a budget cut short)
            st = studies[job.name]
            if budget.left() > 0 and ledger(st)["stop"] != "no valid config" and not _retime_done(st) \
                    and search.study_stats(st).get("config") is not None:
                _retime_study(st, job, runner, rounds, budget.end())
            reserve.pop(job.name, None)
        if fill:  # phase 3: the time left goes to the converged studies, patience doubled per pass
            _fill(jobs, studies, runner, budget, patience=patience, min_gain=min_gain, trials=trials, seed=seed,
                  rounds=rounds, progress=bar, log=log, resumed=resumed)
    except KeyboardInterrupt:
        log("tune: interrupted; finished trials and the time spent are in the storage: the same command resumes")
        raise
    finally:
        _PRE = None
        if pre.helpers:
            st_ = pre.stats()
            log(f"tune: precompile helpers: {st_['submitted']} configs handed over, {st_['compiled']} compiled, "
                f"{st_['failed']} failed (compiled by the sweep instead)")
        pre.close()
        if runner is not None:
            runner.close()
        bar.next_job()
    rows = []
    for job in jobs:
        st = optuna.load_study(study_name=job.name, storage=storage_obj)
        row = search.study_stats(st)
        fr = front_runners(st) if row.get("config") is not None else []
        row["seed_us"] = min((c["sweep_us"] for c in fr if "seed" in c["roles"]), default=None)
        r = st.user_attrs.get("retimed")
        row["retimed"] = r if isinstance(r, dict) and r.get("best_trial") == row.get("best_trial") else None
        row["ledger"] = ledger(st)
        row["progress"] = dataclasses.asdict(study_progress(
            search.current_trials(st.get_trials(deepcopy=False), search.code_version(job.spec.name)), min_gain))
        rows.append(row)
    return rows, near


def _fill_cut_level(led: dict) -> int | None:
    """The fill pass's patience level a study was cut at in an earlier call, or None: its ledger's
    ``fill_cut``; else, for a study stopped on the budget after it had converged (only the fill searches a
    converged study), the level after the one it converged at."""
    if led.get("stop") != "budget":
        return None
    if led.get("fill_cut"):
        return int(led["fill_cut"])
    return 2 * int(led["patience"]) if isinstance(led.get("patience"), int) and led["patience"] > 0 else None


def _fill(jobs, studies, runner, budget: Budget, *, patience: int, min_gain: float, trials, seed: int, rounds: int,
          progress, log, resumed: dict | None = None) -> None:
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
    gain = {j.name: _last_search_gain(studies[j.name], j) for j in jobs}  # the search before: its last turn
    cut: set[str] = set(resumed)   # ended its last turn on its share: searched again in the next pass
    by_name = {j.name: j for j in jobs}
    deferred: dict[str, float] = {n: _retime_estimate(studies[n], rounds) for n in resumed  # name -> seconds its
                                  if not _retime_done(studies[n])}   # re-timing should take, cut with a new best
    passes = 0

    def retime_if(st, why, best):
        changed = search.study_stats(st).get("best_trial") != best or not _retime_done(st)
        if why == "budget" and changed:
            deferred[st.study_name] = _retime_estimate(st, rounds)
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
        tiers = []
        for j in todo:
            st = studies[j.name]
            ts = search.current_trials(st.get_trials(deepcopy=False), search.code_version(j.spec.name))
            open_ = _Local(j).next_config(ts)[0] is not None or bool(bucket_seed_configs(j, jobs, studies))
            tiers.append((j, promise(gain[j.name], open_, min_gain), gain[j.name]))
        order = by_promise(tiers)
        counts = {t: sum(1 for _, tier, _ in tiers if tier == t) for t in PROMISE}
        pass_s = left if left <= FILL_LAST_PASS_S else left * FILL_PASS_SHARE
        passes += 1
        log(f"tune: {budget.left() / 60:.1f} min left: fill pass {passes}: {len(todo)} studies searched again "
            f"(patience {level}; " + ", ".join(f"{n} {t}" for t, n in counts.items() if n) +
            f"; this pass up to {pass_s / 60:.1f} min)")
        progress.prefix, progress.index, progress.n_jobs = f"fill {passes} ", 0, len(todo)
        before = {j.name: search.study_stats(studies[j.name]).get("best_us") for j in todo}

        def seeds(job, st):  # the nearest buckets' winners, each once, before the neighbours
            search._enqueue_seeds(st, job, bucket_seed_configs(job, jobs, studies), attr="bucket_seed")

        turns = _search_pass([j for j, _ in order], studies, runner, budget, progress, retime_if, trials=trials,
                             patience=level, min_gain=min_gain, seed=seed, rounds=rounds, weights=[w for _, w in order],
                             end=time.time() + pass_s, local=True, before=seeds, keep=lambda: sum(deferred.values()),
                             beam=BEAM)
        for job, why, _ in turns:
            (cut.add if why == "budget" else cut.discard)(job.name)
            led, mark = ledger(studies[job.name]), (level if why == "budget" else None)
            if led.get("fill_cut") != mark:   # where a later call resumes it (see _fill_cut_level)
                led = {k: v for k, v in led.items() if k != "fill_cut"}
                studies[job.name].set_user_attr(LEDGER, {**led, **({"fill_cut": mark} if mark else {})})
            b, a = before[job.name], search.study_stats(studies[job.name]).get("best_us")
            gain[job.name] = (b / a - 1.0) if (a and b) else 0.0
        if not any(n for _, _, n in turns) and not cut & {j.name for j, _, _ in turns}:
            if any(ledger(studies[j.name])["stop"] == "converged" for j, _, _ in turns):
                continue  # each ran this level out before it (a neighbourhood without a gain is longer than
                # the patience): the doubled level gives it sampler trials (its run without a gain is finite)
            break
    for name in list(deferred):  # the deferred re-timings: the best of each changed in a turn cut short
        if budget.left() <= 0:
            break
        if not _retime_done(studies[name]):
            _retime_study(studies[name], by_name[name], runner, rounds, budget.end())
        deferred.pop(name)


def _search_pass(todo, studies, runner, budget: Budget, progress, retime_if, *, trials, patience: int,
                 min_gain: float, seed: int, rounds: int, weights=None, end: float | None = None, local: bool = False,
                 before=None, keep=None, retime_share: float = RETIME_SHARE, beam: int = 0) -> list[tuple]:
    """One pass over ``todo``: each study searched within its share of the time left until ``end`` (the
    budget's end by default, less ``keep()`` seconds kept back, asked before each turn):
    ``weights[i]`` over the sum of the weights of those not yet run (equal shares by default; time one
    does not use goes to the next), ``retime_share`` of it kept for re-timing; ``before(job, study)``
    first; then re-timed in the worker that compiled it when ``retime_if(study, why it stopped, its best
    trial before)``. Returns (job, why it stopped, trials evaluated) of each study that had its turn."""
    weights = list(weights) if weights is not None else [1.0] * len(todo)
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
        _prefetch_study(job, st)
        if i + 1 < len(todo):   # the helpers work one study ahead
            _prefetch_study(todo[i + 1], studies[todo[i + 1].name])
        best = search.study_stats(st).get("best_trial")
        n0 = len(search._evaluated(st.get_trials(deepcopy=False)))
        share_end = time.time() + left * weights[i] / sum(weights[i:]) * (1 - retime_share)
        why = _sweep_study(st, job, runner, budget=budget, share_end=share_end, seeds_only=False, trials=trials,
                           patience=patience, min_gain=min_gain, seed=seed, progress=progress, local=local,
                           beam=beam)
        turns.append((job, why, len(search._evaluated(st.get_trials(deepcopy=False))) - n0))
        if budget.left() > 0 and retime_if(st, why, best):
            _retime_study(st, job, runner, rounds, budget.end())
        progress.next_job()
    return turns


def _retime_done(study) -> bool:
    """Whether the study's current best was re-timed (or had no rival to be re-timed against)."""
    led = ledger(study)
    if led.get("retime_candidates", 0) == 1 and not led.get("retimed"):
        return True
    r = study.user_attrs.get("retimed")
    return isinstance(r, dict) and r.get("best_trial") == search.study_stats(study)["best_trial"]


def spent_s(rows: list[dict]) -> float:
    return sum((r.get("ledger") or {}).get("spent_s", 0.0) for r in rows)


def summary_table(rows: list[dict], budget_s: float | None = None, wall_s: float | None = None) -> str:
    """Per study: trials (of them after the seeds), why it stopped, time spent, the default's, the best
    warm seed's and the tuned best's times (re-timed side by side where there were rivals), the winner;
    then the totals: studies by stop reason, budget spent, this call's wall time, the geomean gain."""
    import collections

    from tabulate import tabulate

    from tritune.harness.report import _fmt

    table = []
    for r in rows:
        rt = r.get("retimed") or {}
        t = rt.get("times_us", {})
        led = r.get("ledger") or {}
        win_us, def_us = rt.get("time_us", r.get("best_us")), rt.get("default_us", r.get("default_us"))
        winner = rt.get("winner") or ("tuned (not re-timed)" if r.get("config") else "-")
        if r.get("config") and not rt and led.get("retime_candidates") == 1:
            winner = "tuned (no rival)"
        pr = r.get("progress") or {}
        table.append([r.get("kernel"), r.get("bucket"), r.get("dtype"), r.get("trials", 0),
                      pr.get("sampler", ""), _local_label(pr), r.get("failed", 0), _stop_label(r),
                      f"{led.get('spent_s', 0.0):.1f}",
                      _fmt(t.get("default", r.get("default_us"))), _fmt(t.get("seed", r.get("seed_us"))),
                      _fmt(t.get("tuned", r.get("best_us"))), winner,
                      f"{def_us / win_us:.2f}x" if win_us and def_us else ""])
    head = ["kernel", "bucket", "dtype", "trials", "after seeds", "local (gains)", "failed", "stopped", "spent s",
            "default µs",
            "warm seed µs", "tuned µs", "winner", "vs default"]
    text = tabulate(table, headers=head, disable_numparse=True)
    stops = collections.Counter(_stop_label(r) for r in rows)
    text += "\nstudies: " + ", ".join(f"{n} {k}" for k, n in stops.most_common())
    tot = collections.Counter()
    for r in rows:
        tot.update({k: v for k, v in (r.get("progress") or {}).items() if k.startswith(("local", "bucket_seed"))})
    if tot["local"] or tot["bucket_seeds"]:
        text += (f"\nlocal search: {tot['local']} trials (one-step neighbours of a study's best) in "
                 f"{sum(1 for r in rows if (r.get('progress') or {}).get('local'))} studies, {tot['local_gains']} "
                 f"of them a gain; fill: {tot['bucket_seeds']} nearest-bucket winners tried, "
                 f"{tot['bucket_seed_gains']} of them a gain")
    spent = spent_s(rows)
    if budget_s:
        text += f"\nbudget: {spent / 60:.1f} of {budget_s / 60:.1f} min spent (all calls, in the storage)"
    if wall_s is not None:
        text += f"; this call's wall time {wall_s / 60:.1f} min"
    sp = [(r["retimed"] or {}).get("default_us", 0) / r["retimed"]["time_us"] for r in rows
          if (r.get("retimed") or {}).get("default_us") and r["retimed"].get("time_us")]
    if sp:
        g = math.exp(sum(map(math.log, sp)) / len(sp))
        text += f"\ngeomean of the winners over the default (re-timed side by side): {g:.3f}x over {len(sp)} studies"
    return text


def _local_label(progress: dict) -> str:
    """A study's local-search trials (phase 2 and the fill), and how many of them were a gain: '17 (2)'."""
    n = progress.get("local", 0)
    return f"{n} ({progress.get('local_gains', 0)})" if n else ""


def _stop_label(row: dict) -> str:
    """Why a study stopped; 'seeds only' when the budget ended before its search began."""
    stop = (row.get("ledger") or {}).get("stop")
    return stop or ("seeds only" if row.get("trials") else "not run")


# ---------------------------------------------------------------------------------------------------
# --dry-run: the plan, the budget split and the time it should take
# ---------------------------------------------------------------------------------------------------
def plan_as_gpu(specs, problems, dtypes, slug: str, log=None) -> list:
    """The plan a GPU would run (its standard problems, every dtype), also from a CPU: for ``--dry-run
    --as-gpu``. The spaces' constraints read the interpreter's limits (an H100's shared memory)."""
    from tritune.kernels.runtime import device as dev

    real = dev.interpreted
    dev.interpreted = lambda: False  # plan() picks standard problems and keeps every dtype on a GPU
    try:
        return search.plan(specs, problems, dtypes, slug, log)
    finally:
        dev.interpreted = real


def _measured_trial_s(storage_obj, jobs) -> dict:
    """kernel -> mean recorded seconds of an evaluated trial in the storage (where there are any)."""
    import optuna

    secs: dict[str, list] = {}
    names = set(optuna.get_all_study_names(storage_obj)) if storage_obj is not None else set()
    for job in jobs:
        if job.name not in names:
            continue
        st = optuna.load_study(study_name=job.name, storage=storage_obj)
        for t in search._evaluated(st.get_trials(deepcopy=False)):
            ev = t.user_attrs.get("evaluated")
            if isinstance(ev, dict) and isinstance(ev.get("seconds"), (int, float)):
                secs.setdefault(job.spec.name, []).append(float(ev["seconds"]))
    return {k: statistics.mean(v) for k, v in secs.items() if len(v) >= 3}


def dry_run(kernels_, budget_s: float, *, storage=None, dtypes=None, problems=None, slug: str | None = None,
            warm_from: str | None = None, as_gpu: str | None = None, trials: int | None = None,
            patience: int = PATIENCE, rounds: int = RETIME_ROUNDS, log=None) -> str:
    """The studies ``tune_budget`` would run (with what is already in ``storage``), their seeds, the
    budget split and an estimate of the wall time; touches no GPU and writes nothing."""
    import optuna
    from tabulate import tabulate

    from tritune.kernels.runtime import device as dev

    log = log or (lambda m: None)
    slug = as_gpu or slug or dev.gpu_slug()
    near = warm_from or nearest_slug(slug, store.slugs())
    specs = search.resolve_specs(kernels_)
    jobs = (plan_as_gpu(specs, problems, dtypes, slug, log) if as_gpu
            else search.plan(specs, problems, dtypes, slug, log))
    storage_obj = None
    if storage is not None and (not isinstance(storage, str) or "://" in storage or __import__("os").path.exists(storage)):
        storage_obj = search.open_storage(storage)
    names = set(optuna.get_all_study_names(storage_obj)) if storage_obj is not None else set()
    measured = _measured_trial_s(storage_obj, jobs) if storage_obj is not None else {}
    rows, est = [], {"seeds": 0.0, "search": 0.0, "retime": 0.0}
    spent = 0.0
    n_open = n_fill = 0
    for job in jobs:
        per = measured.get(job.spec.name, TRIAL_S.get(job.spec.name, TRIAL_S_OTHER))
        params = job.spec.space.params
        default = job.spec.default_config(job.problem, job.dtype)
        seeds = {search.config_key(default, params)}
        try:
            prev = store.entry_config(job.spec.name, job.bucket, job.key, slug)
        except Exception:  # an unreadable store is reported where it is loaded
            prev = None
        warm = warm_configs(job, near) if near else []
        for c in ([prev] if prev else []) + warm:
            seeds.add(search.config_key(dict(default, **c), params))
        n_valid = len(job.spec.space.points(job.problem, job.dtype))
        done, led = 0, ledger(optuna.load_study(study_name=job.name, storage=storage_obj)) if job.name in names else ledger_empty()
        if job.name in names:
            done = len(search._evaluated(optuna.load_study(study_name=job.name, storage=storage_obj)
                                         .get_trials(deepcopy=False)))
        spent += led["spent_s"]
        n_seeds = min(len(seeds), n_valid)
        # phase 2 evaluates at least the best seed's neighbourhood (this GPU's entry, else the nearest GPU's
        # winner, else the default: the likeliest best), longer than the patience where the space is large
        centre = dict(default, **(prev or (warm[0] if warm else {})))
        n_local = len(neighbours(job.spec.space, centre, job.problem, job.dtype))
        after = n_seeds + max(patience, n_local)
        need = min(n_valid, after) if trials is None else min(n_valid, trials, after)
        if _fill_cut_level(led):
            n_fill += 1   # resumes in the fill (phase 3), not in phases 1 and 2
        elif led["stop"] not in DONE:
            n_open += 1
            est["seeds"] += max(0, n_seeds - done) * per
            est["search"] += max(0, need - max(done, n_seeds)) * per
            n_fr = min(RETIME_MAX, n_seeds + 2)
            est["retime"] += (min(rounds, RACE_AFTER) * n_fr + max(0, rounds - RACE_AFTER) * 2) * TIME_ONLY_S \
                if n_seeds > 1 else 0.0
        rows.append([job.spec.name, job.bucket, job.key, n_valid, n_seeds, len(warm), n_local, done,
                     led["stop"] or "", f"{per:.2f}{'' if job.spec.name in measured else '*'}"])
    head = ["kernel", "bucket", "dtype", "valid points", "seeds", "warm", "neighbours", "evaluated", "stopped",
            "s/trial"]
    left = max(0.0, budget_s - spent)
    total = est["seeds"] + est["search"] + est["retime"] + (WORKER_START_S if n_open else 0.0)
    lines = [tabulate(rows, headers=head, disable_numparse=True), "",
             f"GPU type {slug}; warm start from {near or 'nothing'}; {len(jobs)} studies, {n_open} to run "
             f"({len(jobs) - n_open - n_fill} finished in the storage"
             + (f", {n_fill} resume the fill where an earlier call stopped it" if n_fill else "") + ")",
             f"budget {budget_s / 60:.1f} min, {spent / 60:.1f} min spent, {left / 60:.1f} min left: "
             + (f"phase 1 runs every study's seeds; phase 2 gives each unfinished study an equal share of what is "
                f"left (~{left / n_open:.1f} s each now, less the re-timing at the phase's end): its nearest "
                f"buckets' bests, local search from its best (one-step neighbours, first improvement), then its "
                f"sampler" if n_open else "phases 1 and 2 have nothing left to run"),
             f"estimate (s/trial: * = compile + verify + time from the H100/H200 tuning logs, else measured in "
             f"this storage): seeds {est['seeds'] / 60:.1f} min + search to convergence (at least the best "
             f"seed's neighbours, and {patience} trials without a gain each) {est['search'] / 60:.1f} min + "
             f"re-timing ({rounds} rounds) {est['retime'] / 60:.1f} min + worker start = {total / 60:.1f} min"
             + (f" > the {left / 60:.1f} min left: the budget ends it (studies stop 'budget')" if total > left
                else f", within the {left / 60:.1f} min left; phase 3 (unless --no-fill) gives the rest to the "
                     f"converged studies (patience doubled per pass, the most promising first, the nearest "
                     f"buckets' winners tried, the local search continued)")]
    return "\n".join(lines)


def ledger_empty() -> dict:
    return {"spent_s": 0.0, "stop": None, "calls": 0}
