"""Tuning on a miss (opt-in): the first launch of a (kernel, bucket, dtype) that no store holds a config for
runs a short, verified study, stores the winner in the user store and launches with it from then on.

Switched on by ``TRITUNE_TUNE_ON_MISS=1`` or ``tritune.kernels.runtime.spec.set_tune_on_miss(True)`` (also a
context manager); off by default. The runtime holds only the switch and the hook
(``spec.MISS_HANDLER`` names :func:`handle`, loaded with importlib once the switch is on: the runtime is a
floor below tuning and never imports it).

- A miss: no entry of this exact bucket and dtype key in either store, or only one timed on other code of
  the kernel (stale). A neighbouring bucket's entry does not count: it seeds the study.
- The study: the shared Optuna storage's study of the (kernel, bucket, dtype, GPU slug), the one ``tritune
  tune`` runs, so its trials count for both. Seeds first: the heuristic default (the baseline), the stale
  entry, the spec's seeds, the nearest buckets' winners on this GPU, then the nearest GPU type's winners;
  then TPE. Budget: ``TRITUNE_TUNE_ON_MISS_BUDGET`` seconds (default 30) and
  ``TRITUNE_TUNE_ON_MISS_TRIALS`` evaluated trials (default 24). Every trial is verified against the
  float64 reference, as in ``tritune tune``; in this process unless ``TRITUNE_TUNE_ON_MISS_ISOLATION=process``
  (:func:`isolation`).
- One tuner per bucket: a file lock beside the journal (per study name) is held while the study runs; a
  second process waits for it, then finds the first one's entry in the user store and uses it. The lock
  dies with its process, so a killed tuner blocks no one.
- Never inside a CUDA-graph capture or under torch.compile / jit / fx tracing, nor in a launch made by a
  study itself: the default config then, asked again at the next launch.
- A study that finds no verified config, or fails, warns once and leaves the heuristic default.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import warnings
import zlib
from pathlib import Path

from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import store
from tritune.tuning import warm
from tritune.tuning.optuna_sampler import make_sampler, run_study
from tritune.tuning.runners import make_runner
from tritune.tuning.study import (SCALARS, Job, default_storage, ensure_seeds, enqueue_seeds, open_storage,
                                  open_study, seed_for, study_stats)

BUDGET_ENV = "TRITUNE_TUNE_ON_MISS_BUDGET"
TRIALS_ENV = "TRITUNE_TUNE_ON_MISS_TRIALS"
ISOLATION_ENV = "TRITUNE_TUNE_ON_MISS_ISOLATION"
DEFAULT_BUDGET_S = 30.0
DEFAULT_TRIALS = 24
NEAREST = 3             # nearest buckets' (and the nearest GPU type's) winners each study tries first
WAIT_MARGIN_S = 60.0    # a waiting process gives up after the budget and this much more (a hung tuner)

UNTUNED = "launching untuned (the nearest bucket's stored config, else the heuristic default)"

HANDLED: dict = {}      # (kernel, bucket, dtype key) -> the config this process settled on (None: the default)
_STATE = threading.local()   # .busy: a study of this thread is running (its own launches never tune)


def budget() -> tuple[float, int]:
    """(seconds, trials) from TRITUNE_TUNE_ON_MISS_BUDGET and TRITUNE_TUNE_ON_MISS_TRIALS."""
    out = []
    for name, default, kind in ((BUDGET_ENV, DEFAULT_BUDGET_S, float), (TRIALS_ENV, DEFAULT_TRIALS, int)):
        raw = os.environ.get(name, "").strip()
        try:
            v = kind(raw) if raw else default
        except ValueError:
            v = None
        if v is None or not v > 0:
            raise ValueError(f"{name}: expected a positive {'number of seconds' if kind is float else 'whole number'}, "
                             f"got {raw!r}")
        out.append(v)
    return out[0], out[1]


def tracing() -> bool:
    """Whether a launch now is being captured into a CUDA graph or traced (torch.compile, jit, fx): no
    trial may run then, and what runs is recorded, not timed."""
    import torch

    try:
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return True
    except AttributeError:
        pass
    import torch.fx._symbolic_trace as fx

    symbolic = getattr(fx, "is_fx_symbolic_tracing", None) or getattr(fx, "is_fx_tracing", None)
    if symbolic is not None and symbolic():
        return True
    return (not dev.interpreted() and torch.cuda.is_available() and torch.cuda.is_initialized()
            and torch.cuda.is_current_stream_capturing())


def stored_entry(spec, bucket: str, key: str) -> dict | None:
    """This exact bucket's entry in the stores (the user's over the packaged), unless it is stale."""
    es = [e for e in store.entries(spec) if e["bucket"] == bucket and e["dtype"] == key]
    return es[0] if es and not store.stale(spec, es) else None


def handle(spec, problem, dtype, bucket: str, key: str, found: dict | None) -> tuple[dict | None, bool]:
    """The runtime's miss hook (``spec.MISS_HANDLER``): (the config to launch, whether the config cache may
    keep it). ``found``: what the store's lookup gave (a neighbour's config, or None: the default)."""
    ident = (spec.name, bucket, key)
    if ident in HANDLED:
        return HANDLED[ident] or found, True
    if getattr(_STATE, "busy", False) or tracing():
        return found, False
    if stored_entry(spec, bucket, key) is not None:
        return found, True
    if any(not all(isinstance(c, SCALARS) for c in v) for v in spec.space.params.values()):
        return found, True   # a space the store cannot hold
    seconds, trials = budget()   # a malformed setting is the caller's error, raised
    isolation()
    _STATE.busy = True
    try:
        cfg = tune_bucket(spec, problem, dtype, bucket, key, seconds, trials)
    except Exception as e:   # never a failed launch because tuning failed
        warnings.warn(f"tritune: tuning {spec.name} bucket {bucket} {key} on a miss failed "
                      f"({type(e).__name__}: {e}); {UNTUNED}", stacklevel=2)
        cfg = None
    finally:
        _STATE.busy = False
    HANDLED[ident] = cfg
    return cfg or found, True


def lock_path(job: Job, storage) -> Path:
    """The claim of a study: a lock file beside the journal (the cache folder for an RDB storage)."""
    base = Path(storage).expanduser().parent if isinstance(storage, str) and "://" not in storage \
        else dev.cache_path()
    return base / "tune-on-miss" / f"{job.spec.name}-{zlib.crc32(job.name.encode()) & 0xFFFFFFFF:08x}.lock"


@contextlib.contextmanager
def claimed(path: Path, wait_s: float, log):
    """Hold the lock at ``path``: at once when free, else after waiting (yields True), or False after
    ``wait_s`` seconds without it. The holder writes its host:pid into the file for those waiting."""
    import fcntl
    import socket

    dev.make_dir(path.parent, "the tune-on-miss locks")
    with open(path, "a+") as f:
        got, end, said = False, time.time() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                got = True
                break
            except BlockingIOError:
                if not said:
                    f.seek(0)
                    log(f"waiting for {f.read().strip() or 'another process'}, which is tuning it ... ")
                    said = True
                if time.time() >= end:
                    break
                time.sleep(0.2)
        try:
            if got:
                f.seek(0)
                f.truncate()
                f.write(f"{socket.gethostname()}:{os.getpid()}")
                f.flush()
            yield got
        finally:
            if got:
                fcntl.flock(f, fcntl.LOCK_UN)


def seed(study, job: Job) -> None:
    """The study's seeds: its own (default, stale entry, spec seeds), then the nearest buckets' winners on
    this GPU, then the nearest GPU type's winners for this bucket and its neighbours."""
    ensure_seeds(study, job)
    enqueue_seeds(study, job, warm.warm_configs(job, job.slug, NEAREST), attr="seeded")
    other = warm.nearest_slug(job.slug, store.slugs())
    if other is not None:
        enqueue_seeds(study, job, warm.warm_configs(job, other, NEAREST), attr="warm")


def isolation() -> str:
    """Where the trials run: in this process by default. A worker process (``TRITUNE_TUNE_ON_MISS_ISOLATION=
    process``) keeps a config that faults from taking the caller's CUDA context with it, but it is started
    by ``spawn``, which imports the caller's main script again (a script without a ``__main__`` guard would
    run its work twice), and its start costs seconds of the budget; every config a study tries is a valid
    point of the space, verified before it is timed."""
    v = os.environ.get(ISOLATION_ENV, "").strip() or "inline"
    if v not in ("inline", "process"):
        raise ValueError(f"{ISOLATION_ENV}: expected 'inline' or 'process', got {v!r}")
    return v


def run(job: Job, storage, seconds: float, trials: int) -> dict:
    """Run the job's study (budgeted) and return its :func:`study_stats`."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = open_study(storage, job, make_sampler("tpe", job.spec.space, seed_for(0, job.name, "on-miss")))
    seed(study, job)
    runner = make_runner(None, isolation(), env={"TRITUNE_TUNE_ON_MISS": "0"})   # a worker never tunes
    try:
        run_study(study, job, runner, trials=trials, deadline=time.time() + seconds, seed=0)
    finally:
        runner.close()
    return study_stats(study)


def entry_of(stats: dict, seconds: float) -> dict:
    """The store entry of a study's winner (the fields ``tritune tune --export`` writes)."""
    best, default_us = stats["best_us"], stats["default_us"]
    return {"bucket": stats["bucket"], "dtype": stats["dtype"], "config": stats["config"],
            "time_us": round(best, 3), "default_us": None if default_us is None else round(default_us, 3),
            "default_config": stats["default_config"],
            "speedup": None if not default_us else round(default_us / best, 4),
            "trials": stats["trials"], "failed": stats["failed"], "problem": stats["problem"],
            "problem_fields": stats["problem_fields"], "study": stats["study"],
            "tuned_on_miss": {"seconds": round(seconds, 1)}}


def tune_bucket(spec, problem, dtype, bucket: str, key: str, seconds: float, trials: int) -> dict | None:
    """Tune one bucket now (or take the entry another process just stored), saying so in one line on
    stderr; the config, or None (warned)."""
    print(f"tritune: tuning {spec.name} bucket {bucket} {key} on this GPU (no stored config; budget "
          f"{seconds:g} s) ... ", end="", file=sys.stderr, flush=True)
    try:
        return claim_and_tune(spec, problem, dtype, bucket, key, seconds, trials)
    except BaseException:
        print("failed", file=sys.stderr, flush=True)
        raise


def claim_and_tune(spec, problem, dtype, bucket: str, key: str, seconds: float, trials: int) -> dict | None:
    job = Job(spec, problem, dtype, dev.gpu_slug(), bucket=bucket, key=key)
    storage_url = os.environ.get("TRITUNE_STUDIES") or default_storage()

    def log(msg):
        print(msg, end="", file=sys.stderr, flush=True)

    t0 = time.time()
    with claimed(lock_path(job, storage_url), seconds + WAIT_MARGIN_S, log) as got:
        store.clear_cache()   # another process may have stored it meanwhile
        e = stored_entry(spec, bucket, key)
        if e is not None:
            print("another process tuned it; using its stored config", file=sys.stderr, flush=True)
            return dict(e["config"])
        if not got:
            print("gave up waiting", file=sys.stderr, flush=True)
            warnings.warn(f"tritune: another process held the tuning of {spec.name} bucket {bucket} {key} for "
                          f"over {seconds + WAIT_MARGIN_S:g} s; {UNTUNED}", stacklevel=3)
            return None
        stats = run(job, open_storage(storage_url), seconds, trials)
        took = time.time() - t0
        if stats["config"] is None:
            print("no verified config", file=sys.stderr, flush=True)
            reasons = ", ".join(f"{k} x{n}" for k, n in stats["failure_kinds"].items()) or "no trial finished"
            warnings.warn(f"tritune: tuning {spec.name} bucket {bucket} {key} on a miss found no verified "
                          f"config ({reasons}); {UNTUNED}", stacklevel=3)
            return None
        try:
            store.write(spec, [entry_of(stats, took)])
            where = "stored"
        except OSError as err:   # dev.CacheError: the user store cannot be written; this process still uses it
            where = f"not stored ({err})"
    gain = f"{stats['speedup']:.2f}x the default" if stats["speedup"] else "the default's time unknown"
    print(f"{where}, {gain} ({stats['trials']} trials, {took:.1f} s)", file=sys.stderr, flush=True)
    return dict(stats["config"])
