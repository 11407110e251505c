"""Search efficiency: TPE and random against the exhaustive grid, on the same measurements (``tritune tune
--compare-samplers``): the grid measures every valid point once, then TPE and random are replayed on its
measurements (:class:`~tritune.tuning.runners.ReplayRunner`), so timing noise never separates them."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

from tritune.tuning.optuna_sampler import make_sampler, run_study
from tritune.tuning.runners import TASK_TIMEOUT, ReplayRunner, measured_table
from tritune.tuning.search import tune
from tritune.tuning.study import (Job, config_key, dtype_name, open_storage, plan, problem_dict, problem_label,
                                  resolve_specs, seed_for, study_stats)


def trials_to_target(study, target_us: float) -> int | None:
    """Evaluated trials (in order) until the first one at or below ``target_us``; None if never."""
    from optuna.trial import TrialState

    n = 0
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if t.user_attrs.get("evaluated"):
            n += 1
            if t.state == TrialState.COMPLETE and t.value <= target_us:
                return n
    return None


def compare_samplers(kernels_, problems=None, dtypes=None, *, storage=None, repeats: int = 10,
                     threshold: float = 0.03, seed: int = 0, time_budget: float | None = None, workers: int = 1,
                     evaluate: Callable | None = None, isolation: str = "auto", timeout: float = TASK_TIMEOUT,
                     results_dir: Path | str = "results", progress: bool = True, slug: str | None = None,
                     log=None) -> tuple[list[dict], Path | None]:
    """Grid (exhaustive, measured) vs TPE and random (replayed on the grid's measurements).

    The grid sampler completes each study over every valid point (resumable; earlier trials of the study
    count). TPE and random then search the same space with the same constraints, ``repeats`` seeds each,
    with the grid's measured times as their objective: the same timing for all samplers and no timing
    noise between them. Reported per bucket: evaluated trials until a config within ``threshold`` of the
    grid's best, as a fraction of the grid's trials.
    """
    import optuna

    from tritune.kernels.runtime import device as dev

    log = log or (lambda msg: print(msg, file=sys.stderr))
    slug = slug or dev.gpu_slug()
    tune(kernels_, problems, dtypes, trials=10**9, sampler="grid", storage=storage, workers=workers,
         time_budget=time_budget, seed=seed, evaluate=evaluate, isolation=isolation, timeout=timeout,
         progress=progress, slug=slug, log=log)
    storage_obj = open_storage(storage)
    jobs = plan(resolve_specs(kernels_), problems, dtypes, slug)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rows = []
    for job in jobs:
        try:
            st = optuna.load_study(study_name=job.name, storage=storage_obj)
        except KeyError:
            continue
        job.problem = _study_problem(st, job)
        table = measured_table(st, job)
        valid = {config_key(p, job.spec.space.params) for p in job.spec.space.points(job.problem, job.dtype)}
        stats = study_stats(st)
        row = {"kernel": job.spec.name, "bucket": job.bucket, "dtype": dtype_name(job.dtype),
               "problem": problem_label(job.problem), "n_valid": len(valid), "study": job.name,
               "grid_trials": len(valid), "study_trials": stats["trials"], "grid_failed": sum(not table[k]["ok"] for k in valid if k in table),
               "default_us": stats["default_us"], "threshold": threshold}
        missing = valid - set(table)
        ok = {k: v["ms"] * 1e3 for k, v in table.items() if v["ok"] and k in valid}
        if missing or not ok:
            row["incomplete"] = (f"{len(missing)} of {len(valid)} valid points not measured yet; run the same "
                                 "command again to continue") if missing else "no valid point passed"
            log(f"compare: {job.label()}: {row['incomplete']}")
            rows.append(row)
            continue
        best_key = min(ok, key=ok.get)
        row["grid_best_us"] = ok[best_key]
        row["grid_best_config"] = dict(json.loads(best_key))
        target = ok[best_key] * (1 + threshold)
        row["within_threshold_points"] = sum(v <= target for v in ok.values())
        for name in ("tpe", "random"):
            row[name] = _replay(job, table, name, repeats, target, len(valid), seed)
        row["tpe_within_25pct_of_grid"] = (row["tpe"]["median"] is not None
                                           and row["tpe"]["median"] <= 0.25 * len(valid))
        rows.append(row)
    path = _write(rows, results_dir, slug, threshold, repeats) if rows else None
    return rows, path


def _study_problem(study, job: Job):
    a = study.user_attrs.get("problem")
    if a and dataclasses.is_dataclass(job.problem) and a != problem_dict(job.problem):
        try:
            return type(job.problem)(**a)
        except TypeError:
            pass
    return job.problem


def _replay(job, table: dict, name: str, repeats: int, target: float, n_valid: int, seed: int) -> dict:
    """Sampler ``name`` replayed ``repeats`` times (seeds) on the grid's measurements: evaluated trials
    until one at or below ``target`` µs."""
    import optuna
    import statistics

    runner = ReplayRunner(table)
    counts = []
    for r in range(repeats):
        s = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="minimize",
                                sampler=make_sampler(name, job.spec.space, seed_for(seed, job.name, name, r)))
        s.set_user_attr("kernel", job.spec.name)
        run_study(s, job, runner, trials=n_valid, sampler_name=name, stop_at_us=target, seed=seed + r,
                  seed_default=False)
        counts.append(trials_to_target(s, target))
    reached = [c for c in counts if c is not None]
    med = statistics.median(reached) if reached else None
    return {"trials_to_target": counts, "median": med, "mean": statistics.fmean(reached) if reached else None,
            "max": max(reached) if reached else None,
            "median_fraction_of_grid": None if med is None else med / n_valid}


def _write(rows: list[dict], results_dir, slug: str, threshold: float, repeats: int) -> Path:
    """Merge ``rows`` into ``<results_dir>/<slug>/tuning_efficiency.json`` (by kernel, bucket and dtype)."""
    from tritune.tuning import timing

    d = Path(results_dir) / slug
    d.mkdir(parents=True, exist_ok=True)
    path = d / "tuning_efficiency.json"
    old = []
    if path.exists():
        try:
            old = json.loads(path.read_text()).get("experiments", [])
        except (OSError, ValueError):
            old = []
    keyed = {(e.get("kernel"), e.get("bucket"), e.get("dtype")): e for e in old}
    for row in rows:
        keyed[(row["kernel"], row["bucket"], row["dtype"])] = row
    experiments = sorted(keyed.values(), key=lambda e: (e["kernel"], e["dtype"], e["bucket"]))
    path.write_text(json.dumps({"environment": timing.environment(), "threshold": threshold, "repeats": repeats,
                                "experiments": experiments}, indent=1, default=str) + "\n")
    return path
