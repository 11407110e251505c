"""``tritune tune``: the sweep over the studies a command means, in one process or in ``--workers``
processes (one per visible GPU) sharing the storage, each study run by :func:`optuna_sampler.run_study`.

Re-running the same command resumes the studies; several processes or machines pointed at the same
storage optimise the same studies together. The rest of the public tuning API is importable from here
(the study API, the evaluator and runners, the export) for the callers that know it by this name.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Callable

from tritune.tuning.evaluate import Evaluator, Task, classify  # noqa: F401  (public API)
from tritune.tuning.export import export  # noqa: F401  (public API)
from tritune.tuning.optuna_sampler import SAMPLERS, STALL, TrialFailed, make_sampler, run_study  # noqa: F401
from tritune.tuning.runners import (TASK_TIMEOUT, InlineRunner, ProcessRunner, ReplayRunner,  # noqa: F401
                                    die_with_parent, make_runner, stop_workers, worker_guard)
from tritune.tuning.study import (STORAGE_HELP, Job, StorageError, check_seed_configs,  # noqa: F401
                                  code_version, config_key, current_trials, default_storage, dtype_name,
                                  ensure_seeds, enqueue_seeds, evaluated, open_storage, open_study, plan, reap,
                                  resolve_specs, seed_for, store_key, study_name, study_stats, tuned_studies)


class Progress:
    """A tqdm bar per study on stderr (trials evaluated of the study's count, ETA, best time); nothing
    when disabled or when stderr is not a terminal."""

    def __init__(self, n_jobs: int, stream=None, enabled: bool = True, prefix: str = ""):
        self.stream = stream or sys.stderr
        self.n_jobs, self.prefix = n_jobs, prefix
        self.enabled = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.index = 0
        self.bar = None

    def __call__(self, job, n, target, failed, best, deadline=None) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=target, initial=n, desc=f"{self.prefix}[{self.index + 1}/{self.n_jobs}] {job.label()}",
                            unit="trial", file=self.stream, dynamic_ncols=True, leave=True)
        if self.bar.total != target:
            self.bar.total = target
        self.bar.update(n - self.bar.n)
        post = f"best {'-' if best is None else f'{best:.2f}'} µs, {failed} failed"
        if deadline is not None:
            post += f", ends by {time.strftime('%H:%M:%S', time.localtime(deadline))}"
        self.bar.set_postfix_str(post)

    def next_job(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None
        self.index += 1


def _sweep(jobs: list[Job], *, storage, sampler: str, trials: int, deadline: float | None, seed: int,
           runner, progress: Progress | None, stop_at: dict | None = None, seed_default: bool = True) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = open_storage(storage)
    for i, job in enumerate(jobs):
        if deadline is not None and time.time() >= deadline:
            break
        study_deadline = None
        if deadline is not None:  # an equal share of what is left; time a study does not use carries over
            study_deadline = time.time() + (deadline - time.time()) / (len(jobs) - i)
        study = open_study(storage, job, make_sampler(sampler, job.spec.space, seed_for(seed, job.name, sampler)))
        run_study(study, job, runner, trials=trials, sampler_name=sampler, deadline=study_deadline,
                  stop_at_us=(stop_at or {}).get(job.name), seed=seed, seed_default=seed_default,
                  progress=progress)
        if progress is not None:
            progress.next_job()


def _sweep_entry(jobs_data, kwargs, evaluate, isolation, timeout, guard=None) -> None:
    """A ``--workers`` process: rebuild the jobs by kernel name and sweep with its own evaluator; it dies
    with the process that started it (``guard``)."""
    import tritune.kernels.runtime  # noqa: F401
    from tritune import kernels

    if guard:
        die_with_parent(**guard)

    jobs = [Job(kernels.get(k), p, d, slug) for k, p, d, slug in jobs_data]
    runner = make_runner(evaluate, isolation, timeout=timeout)
    try:
        _sweep(jobs, runner=runner, progress=None, **kwargs)
    except KeyboardInterrupt:
        pass
    finally:
        runner.close()


def visible_gpus() -> list[str]:
    from tritune.kernels.runtime import device as dev

    if dev.interpreted():
        return []
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        return [v.strip() for v in vis.split(",") if v.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def tune(kernels_, problems=None, dtypes=None, *, trials: int = 40, sampler: str = "tpe", storage=None,
         workers: int = 1, time_budget: float | None = None, seed: int = 0, evaluate: Callable | None = None,
         isolation: str = "auto", timeout: float = TASK_TIMEOUT, progress: bool = True, slug: str | None = None,
         seed_default: bool = True, stop_at: dict | None = None, log=None,
         seed_configs: list[dict] | None = None, warm: Callable | None = None) -> list[dict]:
    """Tune kernels (names, 'all' or specs); returns one :func:`study_stats` row per study of the plan.

    ``seed_configs``: (partial) configs each study evaluates before its sampler proposes (completed from
    the heuristic default; skipped where invalid): the front runners of a probe, timed and verified by the
    same evaluation as every other trial. ``warm(job) -> [config]``: configs enqueued after those
    (under the ``warm`` attribute): another GPU's winners for the bucket (see :mod:`tritune.tuning.warm`).

    ``evaluate(task) -> {"ok", "ms" | "error"}`` replaces the real evaluation (it must be picklable
    when evaluations run in worker processes). KeyboardInterrupt propagates after the workers stop; the
    finished trials are in the storage and the same call resumes them.
    """
    import optuna

    if sampler not in SAMPLERS:
        raise ValueError(f"sampler: expected one of {SAMPLERS}, got {sampler!r}")
    if not isinstance(trials, int) or trials < 0:
        raise ValueError(f"trials: expected a whole number >= 0, got {trials!r}")
    log = log or (lambda msg: print(msg, file=sys.stderr))
    specs = resolve_specs(kernels_)
    jobs = plan(specs, problems, dtypes, slug, log)
    storage_obj = open_storage(storage)
    if seed_configs is not None:
        check_seed_configs(specs, seed_configs)
    if (seed_configs or warm) and trials > 0:
        for job in jobs:  # after the default and the stored config (each enqueued once)
            study = open_study(storage_obj, job)
            if seed_default:
                ensure_seeds(study, job)
            if seed_configs:
                mine = [c for c in seed_configs if set(c) <= set(job.spec.space.params)]
                if len(mine) < len(seed_configs):
                    log(f"{job.label()}: {len(seed_configs) - len(mine)} seed config(s) with another kernel's "
                        "parameters skipped")
                enqueue_seeds(study, job, mine)
            if warm is not None:
                enqueue_seeds(study, job, warm(job), attr="warm")
    deadline = time.time() + time_budget if time_budget else None
    if trials > 0 and jobs:
        if workers <= 1:
            runner = make_runner(evaluate, isolation, timeout=timeout)
            try:
                _sweep(jobs, storage=storage_obj, sampler=sampler, trials=trials, deadline=deadline, seed=seed,
                       runner=runner, progress=Progress(len(jobs), enabled=progress), stop_at=stop_at,
                       seed_default=seed_default)
            finally:
                runner.close()
        else:
            _run_workers(jobs, storage, storage_obj, workers=workers, sampler=sampler, trials=trials,
                         deadline=deadline, seed=seed, evaluate=evaluate, isolation=isolation, timeout=timeout,
                         progress=progress, stop_at=stop_at, seed_default=seed_default, log=log)
    rows = []
    for job in jobs:
        try:
            st = optuna.load_study(study_name=job.name, storage=storage_obj)
        except KeyError:
            rows.append({"study": job.name, "kernel": job.spec.name, "bucket": job.bucket,
                         "dtype": job.key, "trials": 0, "failed": 0, "best_us": None,
                         "default_us": None, "speedup": None, "config": None})
            continue
        rows.append(study_stats(st))
    return rows


def _run_workers(jobs, storage, storage_obj, *, workers, sampler, trials, deadline, seed, evaluate, isolation,
                 timeout, progress, stop_at, seed_default, log) -> None:
    import optuna

    if not isinstance(storage, (str, os.PathLike, type(None))):
        raise ValueError("--workers > 1 needs a storage URL or file path that other processes can open")
    storage_url = str(storage) if storage is not None else default_storage()
    gpus = visible_gpus()
    if gpus and workers > len(gpus):
        log(f"tune: {workers} workers on {len(gpus)} visible GPUs: some GPUs run several workers")
    for job in jobs:  # create the studies once, here, so the workers only load them
        open_study(storage_obj, job)
    ctx = multiprocessing.get_context("spawn")
    jobs_data = [(j.spec.name, j.problem, j.dtype, j.slug) for j in jobs]
    procs = []
    for w in range(workers):
        env = {"CUDA_VISIBLE_DEVICES": gpus[w % len(gpus)]} if gpus else {}
        kw = dict(storage=storage_url, sampler=sampler, trials=trials, deadline=deadline, seed=seed + 1000 * w,
                  stop_at=stop_at, seed_default=seed_default)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            p = ctx.Process(target=_sweep_entry, args=(jobs_data, kw, evaluate, isolation, timeout,
                                                                  worker_guard()), name=f"tritune-tune-{w}")
            p.start()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        procs.append(p)
        log(f"tune: worker {w} (pid {p.pid})" + (f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if env else ""))
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm.auto import tqdm

        total = sum(min(trials, len(j.spec.space.points(j.problem, j.dtype))) for j in jobs)
        bar = tqdm(total=total, desc=f"tune: {workers} workers, {len(jobs)} studies", unit="trial",
                   file=sys.stderr, dynamic_ncols=True)
    try:
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(timeout=2.0 / len(procs))
            if bar is None:
                continue
            n = failed = 0
            for j in jobs:
                try:
                    st = optuna.load_study(study_name=j.name, storage=storage_obj)
                except KeyError:
                    continue
                ev = evaluated(st.get_trials(deepcopy=False))
                n += len(ev)
                failed += sum(t.state.name == "FAIL" for t in ev)
            bar.update(min(n, bar.total) - bar.n)
            bar.set_postfix_str(f"{failed} failed")
    except KeyboardInterrupt:
        stop_workers(procs)
        raise
    finally:
        if bar is not None:
            bar.close()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        log(f"tune: {len(bad)} worker(s) exited with codes {bad}; their finished trials are kept")
