"""``tune all --budget --dry-run``: the studies a budgeted run would run (with what is already in the
storage), their seeds, the budget split and an estimate of the wall time; touches no GPU, writes nothing."""
from __future__ import annotations

import os
import statistics

from tritune.kernels.runtime import store
from tritune.tuning.fill import fill_cut_level
from tritune.tuning.ledger import DONE, ledger, ledger_empty
from tritune.tuning.local import neighbours
from tritune.tuning.retime import RACE_AFTER, RETIME_MAX, RETIME_ROUNDS, TIME_ONLY_S
from tritune.tuning.study import config_key, evaluated, open_storage, plan, resolve_specs
from tritune.tuning.turn import PATIENCE
from tritune.tuning.warm import nearest_slug, warm_configs

# Seconds per evaluated trial on an H100/H200 (compile the config, verify it against the float64 reference
# on fresh inputs, time it), from the wall times of tuning runs on both (0.5-1.5 s a trial); trials already
# in the storage replace them with their own recorded seconds.
TRIAL_S = {"gemm": 0.8, "gemv": 0.8, "attention": 1.3, "attention_varlen": 1.3, "paged_attention": 1.0,
           "quant_matmul": 1.2, "gelu": 0.6, "layer_norm": 0.6}
TRIAL_S_OTHER = 1.0
WORKER_START_S = 15.0


def plan_as_gpu(specs, problems, dtypes, slug: str, log=None) -> list:
    """The plan a GPU would run (its standard problems, every dtype), also from a CPU: for ``--dry-run
    --as-gpu``. The spaces' constraints read the interpreter's limits (an H100's shared memory)."""
    from tritune.kernels.runtime import device as dev

    real = dev.interpreted
    dev.interpreted = lambda: False  # plan() picks standard problems and keeps every dtype on a GPU
    try:
        return plan(specs, problems, dtypes, slug, log)
    finally:
        dev.interpreted = real


def measured_trial_s(storage_obj, jobs) -> dict:
    """kernel -> mean recorded seconds of an evaluated trial in the storage (where there are any)."""
    import optuna

    secs: dict[str, list] = {}
    names = set(optuna.get_all_study_names(storage_obj)) if storage_obj is not None else set()
    for job in jobs:
        if job.name not in names:
            continue
        st = optuna.load_study(study_name=job.name, storage=storage_obj)
        for t in evaluated(st.get_trials(deepcopy=False)):
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
    specs = resolve_specs(kernels_)
    jobs = (plan_as_gpu(specs, problems, dtypes, slug, log) if as_gpu
            else plan(specs, problems, dtypes, slug, log))
    storage_obj = None
    if storage is not None and (not isinstance(storage, str) or "://" in storage or os.path.exists(storage)):
        storage_obj = open_storage(storage)
    names = set(optuna.get_all_study_names(storage_obj)) if storage_obj is not None else set()
    measured = measured_trial_s(storage_obj, jobs) if storage_obj is not None else {}
    rows, est = [], {"seeds": 0.0, "search": 0.0, "retime": 0.0}
    spent = 0.0
    n_open = n_fill = 0
    for job in jobs:
        led = ledger(optuna.load_study(study_name=job.name, storage=storage_obj)) if job.name in names else \
            ledger_empty()
        r = _estimate_job(job, storage_obj if job.name in names else None, led, slug, near, measured, trials,
                          patience, rounds)
        spent += led["spent_s"]
        if fill_cut_level(led):
            n_fill += 1   # resumes in the fill (phase 3), not in phases 1 and 2
        elif led["stop"] not in DONE:
            n_open += 1
            for k in est:
                est[k] += r[k]
        rows.append(r["row"])
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


def _estimate_job(job, storage_obj, led: dict, slug: str, near: str | None, measured: dict, trials, patience: int,
                  rounds: int) -> dict:
    """One study's row of the dry run and the seconds its seeds, search and re-timing should take."""
    import optuna

    per = measured.get(job.spec.name, TRIAL_S.get(job.spec.name, TRIAL_S_OTHER))
    params = job.spec.space.params
    default = job.spec.default_config(job.problem, job.dtype)
    seeds = {config_key(default, params)}
    try:
        prev = store.entry_config(job.spec.name, job.bucket, job.key, slug)
    except Exception:  # an unreadable store is reported where it is loaded
        prev = None
    warm = warm_configs(job, near) if near else []
    for c in ([prev] if prev else []) + warm:
        seeds.add(config_key(dict(default, **c), params))
    n_valid = len(job.spec.space.points(job.problem, job.dtype))
    done = 0
    if storage_obj is not None:
        done = len(evaluated(optuna.load_study(study_name=job.name, storage=storage_obj).get_trials(deepcopy=False)))
    n_seeds = min(len(seeds), n_valid)
    # phase 2 evaluates at least the best seed's neighbourhood (this GPU's entry, else the nearest GPU's
    # winner, else the default: the likeliest best), longer than the patience where the space is large
    centre = dict(default, **(prev or (warm[0] if warm else {})))
    n_local = len(neighbours(job.spec.space, centre, job.problem, job.dtype))
    after = n_seeds + max(patience, n_local)
    need = min(n_valid, after) if trials is None else min(n_valid, trials, after)
    n_fr = min(RETIME_MAX, n_seeds + 2)
    return {"seeds": max(0, n_seeds - done) * per, "search": max(0, need - max(done, n_seeds)) * per,
            "retime": (min(rounds, RACE_AFTER) * n_fr + max(0, rounds - RACE_AFTER) * 2) * TIME_ONLY_S
            if n_seeds > 1 else 0.0,
            "row": [job.spec.name, job.bucket, job.key, n_valid, n_seeds, len(warm), n_local, done,
                    led["stop"] or "", f"{per:.2f}{'' if job.spec.name in measured else '*'}"]}
