"""``tritune tune all --budget 30m`` over every visible GPU of the host: one worker process per GPU
(``CUDA_VISIBLE_DEVICES`` set to it; the rest of the environment, NCCL's and torch's included, inherited),
one shared storage, and the plan's studies spread so that no study is ever timed on two GPUs at once.

The plan is partitioned longest-first by an estimate of each study's time to converge (:func:`study_cost`:
seconds per trial of its kernel, from :mod:`~tritune.tuning.estimate`, times its seeds and one-step
neighbours, capped by its grid), each worker runs :func:`~tritune.tuning.budget.tune_budget` on its
share with the whole wall-clock budget, and the parent prints the summary over every study from the storage.
The partition depends on the plan and the number of workers only (never on the storage), so the same
command gives each worker the same share again and resumes each share with its own time left (another
``--workers`` re-splits the studies, and each new share's time left is the budget less what its studies
spent). Hosts that share a storage (PostgreSQL) split the plan first (``--host i/n``, :func:`host_share`),
then each spreads its share over its own GPUs: no study is tuned by two hosts.
"""
from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time

from tritune.kernels.runtime import store
from tritune.tuning import budget as tb, precompile
from tritune.tuning.estimate import TRIAL_S, TRIAL_S_OTHER
from tritune.tuning.local import neighbours
from tritune.tuning.runners import die_with_parent, stop_workers, worker_guard
from tritune.tuning.search import visible_gpus
from tritune.tuning.study import default_storage, open_storage, plan, resolve_specs
from tritune.tuning.turn import MIN_GAIN, PATIENCE
from tritune.tuning.warm import nearest_slug


def study_cost(job, patience: int = PATIENCE) -> float:
    """Estimated seconds for a study to converge: its seeds (the default) and at least its best's one-step
    neighbours or ``patience`` trials, at most its space's grid, at the kernel's seconds per trial. (The
    grid, not the valid points: enumerating those takes ~40 s over an H200's 730 studies, before any
    worker could start.)"""
    per = TRIAL_S.get(job.spec.name, TRIAL_S_OTHER)
    grid = math.prod(len(v) for v in job.spec.space.params.values())
    default = job.spec.default_config(job.problem, job.dtype)
    n_local = len(neighbours(job.spec.space, default, job.problem, job.dtype))
    return per * max(1, min(grid, 1 + max(patience, n_local)))


def partition(jobs: list, n: int, cost=study_cost) -> list[list]:
    """``jobs`` in ``n`` shares balanced by ``cost(job)``: the costliest first, each to the least loaded
    share (ties: the study's name, the lowest share). Every job lands in exactly one share; each share keeps
    the plan's order; the same jobs and ``n`` give the same shares."""
    if n < 1:
        raise ValueError(f"n: expected at least 1 share, got {n!r}")
    load, shares = [0.0] * n, [[] for _ in range(n)]
    order = {id(j): i for i, j in enumerate(jobs)}
    for c, _, job in sorted(((float(cost(j)), j.name, j) for j in jobs), key=lambda x: (-x[0], x[1])):
        k = min(range(n), key=lambda i: (load[i], i))
        load[k] += c
        shares[k].append(job)
    return [sorted(s, key=lambda j: order[id(j)]) for s in shares]


def host_share(jobs: list, host: tuple[int, int], patience: int = PATIENCE) -> list:
    """Host ``i`` of ``n``'s share of the plan (``host = (i, n)``): hosts on one storage (PostgreSQL) that each
    run the same command with their own ``--host i/n`` tune disjoint studies, each host then spreading its
    share over its own GPUs. The same plan and ``n`` give every host the same split."""
    i, n = host
    if not (isinstance(i, int) and isinstance(n, int) and 0 <= i < n):
        raise ValueError(f"host: expected (index, count) with 0 <= index < count, got {host!r}")
    return partition(jobs, n, lambda j: study_cost(j, patience))[i]


def _entry(index: int, kernel_names: list, budget_s: float, only: list, kwargs: dict, guard: dict,
           expect_slug: str | None, fp32_precision: str) -> None:
    """A worker: ``tune_budget`` on its share (``only``); it dies with the process that started it."""
    import tritune.kernels.runtime  # noqa: F401  (the interpreter switch before triton loads)
    import torch

    from tritune.kernels.runtime import device as dev

    die_with_parent(**guard)
    torch.set_float32_matmul_precision(fp32_precision)   # the parent's: it is in the studies' dtype keys
    if expect_slug is not None and not dev.interpreted() and dev.gpu_slug() != expect_slug:
        print(f"tune: worker {index}: GPU {os.environ.get('CUDA_VISIBLE_DEVICES')} is a {dev.gpu_slug()}, not "
              f"a {expect_slug} as GPU 0: tune one GPU type at a time (CUDA_VISIBLE_DEVICES)", file=sys.stderr)
        sys.exit(3)

    def log(m):
        print(f"[worker {index}] {m}", file=sys.stderr)

    try:
        tb.tune_budget(kernel_names, budget_s, only=frozenset(only), log=log, progress=False, **kwargs)
    except KeyboardInterrupt:
        sys.exit(130)


def _helpers_each(n_workers: int, asked: int | None) -> int | None:
    """Precompile helpers per worker: as asked (or ``TRITUNE_PRECOMPILE``), else the default capped by the
    worker's share of the CPU cores (less two: itself and its evaluation process)."""
    if asked is not None or os.environ.get(precompile.ENV, "").strip():
        return asked
    return min(precompile.helpers_wanted(), max(0, (os.cpu_count() or 1) // n_workers - 2))


def tune_budget_spread(kernels_, budget_s: float, *, workers: int, storage=None, dtypes=None, problems=None,
                       slug: str | None = None, warm_from: str | None = None, patience: int = PATIENCE,
                       min_gain: float = MIN_GAIN, precompile_helpers: int | None = None, progress: bool = True,
                       log=None, host: tuple[int, int] | None = None,
                       **kwargs) -> tuple[list[dict], str | None, list[dict]]:
    """:func:`~tritune.tuning.budget.tune_budget` in ``workers`` processes, one per visible GPU (round
    robin when there are more workers than GPUs; none set without a GPU), each on its share of the plan
    (:func:`partition`) with the whole budget; ``kwargs`` go to every worker's ``tune_budget`` (the
    ``evaluate`` function must be picklable). ``storage``: a journal path or RDB URL every worker opens.
    Returns (rows of every study of the plan, read from the storage; the GPU type warmed from; per worker
    ``index``, ``pid``, ``gpu``, ``studies`` (names) and ``exitcode``). A KeyboardInterrupt stops the workers
    and propagates; their finished trials and time spent are in the storage."""
    from tritune.kernels.runtime import device as dev

    if not isinstance(storage, (str, os.PathLike, type(None))):
        raise ValueError("several workers need a storage URL or file path that other processes can open")
    log = log or (lambda m: print(m, file=sys.stderr))
    storage = str(storage) if storage is not None else default_storage()
    expect_slug = None if slug else dev.gpu_slug()
    slug = slug or expect_slug
    specs = resolve_specs(kernels_)
    jobs = plan(specs, problems, dtypes, slug, log)
    if host is not None:    # this host's share of the plan (several hosts on one storage)
        jobs = host_share(jobs, host, patience)
    open_storage(storage)   # a storage that cannot be opened fails here, once
    gpus = visible_gpus()
    if gpus and workers > len(gpus):
        log(f"tune: {workers} workers on {len(gpus)} visible GPUs: some GPUs run several workers")
    shares = [s for s in partition(jobs, max(1, min(workers, len(jobs))), lambda j: study_cost(j, patience)) if s]
    kw = dict(kwargs, storage=storage, dtypes=dtypes, problems=problems, slug=slug, warm_from=warm_from,
              patience=patience, min_gain=min_gain,
              precompile_helpers=_helpers_each(max(1, len(shares)), precompile_helpers))
    procs = _start(shares, gpus, [s.name for s in specs], budget_s, kw, expect_slug, log)
    _wait(procs, budget_s, progress)
    info = [{"index": i, "pid": p.pid, "gpu": _gpu(gpus, i), "studies": [j.name for j in share],
             "exitcode": p.exitcode} for i, (p, share) in enumerate(zip(procs, shares))]
    for w in info:
        if w["exitcode"]:
            log(f"tune: worker {w['index']} (pid {w['pid']}) exited with code {w['exitcode']}; its finished "
                "trials are in the storage: the same command resumes")
    near = warm_from or nearest_slug(slug, store.slugs())
    return tb.study_rows(jobs, storage, min_gain), near, info


def _gpu(gpus: list, i: int) -> str | None:
    return gpus[i % len(gpus)] if gpus else None


def _start(shares, gpus, kernel_names, budget_s, kw, expect_slug, log) -> list:
    """One spawned worker per share, with ``CUDA_VISIBLE_DEVICES`` set to its GPU while it starts (spawn
    copies ``os.environ`` then; nothing else of it is changed)."""
    import torch

    ctx = multiprocessing.get_context("spawn")
    procs = []
    for i, share in enumerate(shares):
        gpu = _gpu(gpus, i)
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if gpu is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        try:
            p = ctx.Process(target=_entry, args=(i, kernel_names, budget_s, [j.name for j in share], kw,
                                                 worker_guard(), expect_slug, torch.get_float32_matmul_precision()),
                            name=f"tritune-tune-{i}")
            p.start()
        finally:
            if gpu is not None:
                os.environ.pop("CUDA_VISIBLE_DEVICES") if saved is None else \
                    os.environ.__setitem__("CUDA_VISIBLE_DEVICES", saved)
        procs.append(p)
        log(f"tune: worker {i} (pid {p.pid})" + (f" on GPU {gpu}" if gpu is not None else "")
            + f": {len(share)} studies")
    return procs


def _wait(procs, budget_s: float, progress: bool) -> None:
    """Until every worker has exited; a bar of the budget's wall time on a terminal. On Ctrl-C (which the
    workers get too, from the terminal) they are given 10 s to write their ledgers, then terminated."""
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm.auto import tqdm

        bar = tqdm(total=round(budget_s), unit="s", desc=f"tune: {len(procs)} workers", file=sys.stderr,
                   dynamic_ncols=True, bar_format="{desc}: {bar} {n_fmt}/{total_fmt} s of the budget{postfix}")
    t0 = time.time()
    try:
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(timeout=2.0 / len(procs))
            if bar is not None:
                bar.update(min(round(time.time() - t0), bar.total) - bar.n)
                bar.set_postfix_str(f"{sum(p.is_alive() for p in procs)} running")
    except KeyboardInterrupt:
        stop_workers(procs)
        raise
    finally:
        if bar is not None:
            bar.close()
