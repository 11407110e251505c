"""Local search: coordinate descent from a study's best (its valid one-step neighbours, first improvement,
the move that won tried again first; a move the constraint refuses repaired by the fewest extra steps),
the neighbours of runners-up (the fill's beam), and the nearest buckets' winners of this run (a winner
moves between neighbouring buckets more often than between GPU types)."""
from __future__ import annotations

import itertools
import math

from tritune.kernels.runtime import store
from tritune.tuning.evaluate import Task
from tritune.tuning.study import (SEED_ATTRS, code_version, config_key, current_trials, evaluated,
                                  study_stats)

LOCAL_MAX = 32       # one-step neighbours evaluated per study turn, phase 2 and fill (gemm's neighbourhood: <= 18)
BEAM = 3             # the fill: runners-up whose neighbours are walked once the best's are all evaluated
RUNNER_UP = 0.10     # ... a runner-up: within this fraction of the best (seeds first, then the fastest)
REPAIR_STEPS = 2     # extra steps in other parameters that may make a refused one-step move valid (neighbours)
REPAIR_KEEP = 1      # repaired configs kept per refused move (each is a trial before a study can converge)
BUCKET_SEEDS = 3     # nearest buckets of the same kernel and dtype whose best a study tries in the fill


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
        i = index_of(choices, config.get(k))
        for j in (() if i is None else (i - 1, i + 1)):
            if 0 <= j < len(choices):
                c = dict(config, **{k: choices[j]})
                if not space.why_invalid(c, problem, dtype):
                    out.append(c)
                else:
                    refused.append((k, c))
    if first is not None and first[0] in space.params:
        k, d = first
        i = index_of(space.params[k], config.get(k))
        out.sort(key=lambda c: i is None or index_of(space.params[k], c[k]) != i + d)  # stable: the rest keep order
    steps = REPAIR_STEPS if repair is None else repair
    if steps > 0:
        seen = {config_key(c, space.params) for c in out}
        for k, c in refused:
            for r in _repairs(space, c, k, problem, dtype, steps):
                key = config_key(r, space.params)
                if key not in seen:
                    seen.add(key)
                    out.append(r)
    return out


def _repairs(space, c: dict, moved: str, problem, dtype, steps: int) -> list[dict]:
    """Valid configs that keep ``c[moved]`` and differ from ``c`` in the fewest steps (up to ``steps``) of
    the other parameters: at most ``REPAIR_KEEP`` of them at the least distance that has one, in the
    space's order (one parameter moved before two, the smaller step first, down before up)."""
    pos = {k: index_of(ch, c.get(k)) for k, ch in space.params.items() if k != moved}
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


def index_of(choices: list, value) -> int | None:
    """The position of ``value`` in a choice list (True is not 1 here)."""
    return next((n for n, c in enumerate(choices) if c == value and isinstance(c, bool) == isinstance(value, bool)),
                None)


def incumbent(trials):
    """The best complete trial (the earliest of equal times), or None."""
    from optuna.trial import TrialState

    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    return min(ok, key=lambda t: (t.value, t.number)) if ok else None


def taken(trials, params: dict) -> set:
    """Keys of the configs evaluated (on the current code), running or waiting: none is proposed again."""
    from optuna.trial import TrialState

    keys = {config_key(t.params, params) for t in evaluated(trials)}
    for t in trials:
        if t.state in (TrialState.RUNNING, TrialState.WAITING):
            keys.add(config_key(t.params or t.system_attrs.get("fixed_params") or {}, params))
    return keys


class Prefetch:
    """Hands the configs a sweep will evaluate next to the precompile helpers (:mod:`tritune.tuning.precompile`;
    a no-op without them): a study's waiting trials (seeds), then the unevaluated neighbours of its best."""

    def __init__(self, precompiler=None):
        self.pre = precompiler

    def configs(self, job, configs) -> None:
        if self.pre is None:
            return
        for c in configs:
            self.pre.submit(Task(job.spec.name, job.problem, job.dtype, dict(c), 0, spec=job.spec))

    def study(self, job, study) -> None:
        if self.pre is None:
            return
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        self.configs(job, [t.system_attrs.get("fixed_params") or t.params for t in trials
                           if t.state == TrialState.WAITING])
        inc = incumbent(trials)
        if inc is not None:
            done = taken(trials, job.spec.space.params)
            self.configs(job, [c for c in neighbours(job.spec.space, dict(inc.params), job.problem, job.dtype)
                               if config_key(c, job.spec.space.params) not in done])


def runners_up(trials, inc, beam: int, params: dict, within: float | None = None) -> list:
    """Up to ``beam`` complete trials of distinct configs other than the incumbent ``inc``'s, within
    ``within`` (``RUNNER_UP``) of its time: seeds (the default, the stored, warm and nearest buckets'
    winners: basins found elsewhere) first, then the fastest."""
    from optuna.trial import TrialState

    if beam <= 0 or inc is None:
        return []
    within = RUNNER_UP if within is None else within
    seen = {config_key(inc.params, params)}
    out = []
    ok = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
          and t.value <= inc.value * (1.0 + within)]
    seeds = SEED_ATTRS + ("bucket_seed",)
    for t in sorted(ok, key=lambda t: (not any(t.user_attrs.get(k) for k in seeds), t.value, t.number)):
        key = config_key(t.params, params)
        if key not in seen:
            seen.add(key)
            out.append(t)
            if len(out) == beam:
                break
    return out


class Local:
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

    def __init__(self, job, limit: int | None = None, beam: int = 0, prefetch: Prefetch | None = None):
        self.job, self.limit, self.n, self.beam = job, LOCAL_MAX if limit is None else limit, 0, beam
        self.prefetch = prefetch or Prefetch()

    def next_config(self, trials) -> tuple[dict, int] | tuple[None, None]:
        """(the next neighbour to evaluate, the number of the trial it is a neighbour of)."""
        space, params = self.job.spec.space, self.job.spec.space.params
        inc = incumbent(trials)
        if inc is None:
            return None, None
        first = None
        parent = next((t for t in trials if t.number == inc.user_attrs.get("local_of")), None)
        if parent is not None:
            moved = [k for k in params if parent.params.get(k) != inc.params.get(k)]
            if len(moved) == 1:
                k = moved[0]
                i, j = index_of(params[k], parent.params.get(k)), index_of(params[k], inc.params.get(k))
                first = (k, j - i) if i is not None and j is not None else None
        used = taken(trials, params)
        for centre in [inc] + runners_up(trials, inc, self.beam, params):
            todo = [c for c in neighbours(space, dict(centre.params), self.job.problem, self.job.dtype,
                                          first if centre is inc else None)
                    if config_key(c, params) not in used]
            if todo:
                self.prefetch.configs(self.job, todo)   # compiled by the helpers while the sweep evaluates them one by one
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
    used = taken(current_trials(st.get_trials(deepcopy=False), code_version(job.spec.name)), params)
    out, n = [], 0
    for *_, j in sib:
        cfg = study_stats(studies[j.name]).get("config")
        if cfg is None:
            continue
        n += 1
        key = config_key(cfg, params)
        if key not in used and not job.spec.space.why_invalid(cfg, job.problem, job.dtype):
            out.append(dict(cfg))
            used.add(key)
        if n >= limit:
            break
    return out
