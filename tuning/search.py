"""Config search: one Optuna study per (kernel, bucket, dtype, GPU slug), verified trials only.

The objective of a trial is the median time (µs) of a config that compiled, ran and matched the
reference within the dtype's tolerance on fresh random inputs (a new seed per trial), timed on fixed
rotating input sets by the harness's one timer (:func:`tritune.harness.bench.timing_mode` picks CUDA-graph
replay for short problems, do_bench's flushed median for long ones; :func:`tritune.harness.bench.time_ms`).
The re-time of the front runners before export (``tuning/budget.py``) and ``lab/compare_tune_all.py
--retime`` time configs through this same evaluator, so all three measure one quantity.

Trial outcomes, all recorded in the study with their reason in ``user_attrs``:

- ``COMPLETE``: verified and timed; the value is the median time in µs. ``evaluated`` holds the input
  seed, the worker (host:pid), the seconds the evaluation took and the relative error.
- ``FAIL`` + ``error``: compile error, out of resources, wrong answer, the worker process died or timed
  out; also ``evaluated``. Never fatal to the sweep.
- ``PRUNED`` + ``invalid``: the point breaks the space's constraint; nothing is launched. Pruned (not
  failed) because TPE learns from pruned trials (they join its "bad" group) but ignores failed ones.
- ``duplicate_of``: the sampler proposed a config this study already evaluated; the earlier outcome is
  copied without launching.
- ``FAIL`` + ``busy_with``: another unfinished trial (another worker's, or a queued seed or retry)
  holds the same config; it times it, this one launches nothing. With several workers, no config is
  timed twice. Failed, not pruned, so that TPE ignores it rather than learning the config is bad.

``--trials N`` counts *evaluated* trials (those that launched: complete or failed), so constraint-pruned
and duplicate proposals are free: they cost milliseconds, not a compile. A study also ends once every
valid point has been evaluated, and a sampler that keeps proposing free trials is given an unevaluated
valid point at random (``forced``) so a converged TPE cannot spin. Samplers: TPE (seeded, the default),
random, and grid: every valid point once, in a seeded random order (enqueued trials). The heuristic
default config is enqueued as the first trial of every study: its time is the baseline (``default_us``)
and the tuned result can only improve on it; the store's entry for the bucket (stale or not: the winner
on the kernel's code before an edit) is enqueued second.

Candidates are evaluated in a worker process (``spawn``) that is restarted when it dies, so a config that
corrupts the CUDA context (illegal address) costs one failed trial, not the sweep. Studies live in Optuna
storage (a journal file by default, any RDB URL otherwise); re-running the same command resumes them, and
several processes or machines pointed at the same storage optimise the same studies together.

The evaluator and its timer are injectable (``evaluate=``, ``Evaluator(timer=...)``): the tests drive the
whole machinery with fake objectives.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import random
import socket
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

SAMPLERS = ("tpe", "random", "grid")
STALL = 20                 # free proposals in a row before an unevaluated valid point is forced
TASK_TIMEOUT = 300.0       # seconds for one evaluation (compile + check + timing) before the worker is killed
START_TIMEOUT = 900.0      # seconds for a worker process to import torch/triton and say it is ready
_SCALARS = (bool, int, float, str, type(None))


class TrialFailed(Exception):
    """Raised inside the objective to record a failed trial (caught by ``study.optimize``)."""


# ---------------------------------------------------------------------------------------------------
# One evaluation: compile, run, check against the reference, time
# ---------------------------------------------------------------------------------------------------
@dataclass
class Task:
    kernel: str
    problem: Any
    dtype: Any
    config: dict
    seed: int
    spec: Any = None        # the spec itself for in-process evaluation; None across processes (by name)
    module: str | None = None   # the module that registers the spec: a worker process imports it first
    verify: bool = True     # False: time only (re-timing configs the sweep verified)
    fp32_precision: str | None = None  # torch.get_float32_matmul_precision() of the process that asked

    def __post_init__(self):
        if self.module is None and self.spec is not None:
            self.module = getattr(self.spec.run, "__module__", None)
        if self.fp32_precision is None:
            import torch

            self.fp32_precision = torch.get_float32_matmul_precision()

    def spec_or_lookup(self):
        if self.spec is not None:
            return self.spec
        import importlib

        from tritune import kernels

        if self.kernel not in kernels.REGISTRY and self.module and self.module != "__main__":
            try:  # a plugin's or a test's kernel: registered when its module is imported
                importlib.import_module(self.module)
            except ImportError:
                pass
        return kernels.get(self.kernel)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (tuple, list)) else [x]


# Messages of errors after which the CUDA context is unusable: the worker answers, then exits.
_FATAL = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
          "device-side assert", "CUDA error", "cudaErrorLaunchFailure", "an illegal")


def classify(e: BaseException) -> tuple[str, bool]:
    """(reason, fatal): a one-line reason for a failed evaluation, and whether the CUDA context is gone."""
    name = type(e).__name__
    text = " ".join(str(e).split())
    if len(text) > 400:
        text = text[:400] + "..."
    mod = type(e).__module__ or ""
    if "OutOfResources" in name:
        kind = "out of resources"
    elif "CompilationError" in name or mod.startswith("triton.compiler"):
        kind = "compile error"
    elif "OutOfMemory" in name:
        kind = "out of memory"
    else:
        kind = "error"
    fatal = any(s in text for s in _FATAL)
    if fatal:
        kind = "CUDA context error (worker restarted)"
    return f"{kind}: {name}: {text}", fatal


class Evaluator:
    """The default evaluation: validate, launch on fresh inputs, compare, then time on rotating inputs.

    Returns ``{"ok": True, "ms": float, "timer": mode}`` or ``{"ok": False, "error": reason}``; a result
    with ``"restart": True`` tells a worker process to exit after answering (the CUDA context is gone).
    The time is :func:`tritune.harness.bench.time_ms` in the problem's mode
    (:func:`tritune.harness.bench.timing_mode`; ``mode`` "graph" or "flush" forces one for every
    problem). ``timer(fn) -> ms`` replaces it (the tests' fake timers).
    """

    TIMING_SEED = 20240611   # timing inputs are fixed per problem (cached); the correctness inputs are not

    def __init__(self, timer: Callable | None = None, mode: str = "auto"):
        if mode not in ("auto", "graph", "flush"):
            raise ValueError(f"mode: expected auto, graph or flush, got {mode!r}")
        self.timer = timer
        self.mode = mode
        self._rotation_key = None
        self._rotation = None

    def __getstate__(self):  # the rotation cache never crosses a process boundary
        return {"timer": self.timer, "mode": self.mode, "_rotation_key": None, "_rotation": None}

    def __setstate__(self, state):
        self.__dict__.update({"mode": "auto", **state})

    def __call__(self, task: Task) -> dict:
        import torch

        from tritune.kernels.runtime import device as dev

        try:
            return self._evaluate(task)
        except Exception as e:
            reason, fatal = classify(e)
            self._rotation_key = self._rotation = None
            return {"ok": False, "error": reason, **({"restart": True} if fatal else {})}
        finally:
            if not dev.interpreted():
                try:
                    torch.cuda.empty_cache()
                except Exception:
                    pass

    def _evaluate(self, task: Task) -> dict:
        import torch

        from tritune.harness import bench

        from tritune.kernels.runtime import compare as cmp

        from tritune.kernels.runtime import device as dev

        spec = task.spec_or_lookup()
        problem, dtype, config = task.problem, task.dtype, dict(task.config)
        if task.fp32_precision and torch.get_float32_matmul_precision() != task.fp32_precision:
            torch.set_float32_matmul_precision(task.fp32_precision)  # a worker follows its parent's setting
        why = spec.space.why_invalid(config, problem, dtype)
        if why:
            return {"ok": False, "error": f"invalid config: {why}"}
        device = dev.device()
        worst = None
        clock = time.perf_counter
        phases = {}   # seconds: the first launch (compiles the config), the reference and the check, the timing
        if task.verify:
            worst = 0.0
            case = spec.make_inputs(problem, dtype, device, task.seed)
            for o in _as_list(case.out):
                cmp.poison(o)
            t = clock()
            got = spec.run(*case.args, out=case.out, config=config, **case.kwargs)
            if not dev.interpreted():
                torch.cuda.synchronize()  # surface asynchronous launch errors inside this trial
            phases["launch_s"], t = clock() - t, clock()
            ref = spec.reference(*case.args, **case.kwargs)
            got_l, ref_l = _as_list(got), _as_list(ref)
            if len(got_l) != len(ref_l):
                return {"ok": False, "error": f"wrong answer: {len(got_l)} outputs, reference has {len(ref_l)}"}
            for i, (o, r) in enumerate(zip(got_l, ref_l)):
                c = cmp.compare(o, r, dtype, spec.accumulation(dtype), what=f"out[{i}]" if len(got_l) > 1 else "out")
                if not c.ok:
                    return {"ok": False, "error": f"wrong answer: {c}"}
                worst = max(worst, c.error)
            del case, got, ref, got_l, ref_l
            phases["check_s"] = clock() - t
        t = clock()
        mode = bench.timing_mode(spec, problem, dtype, force=self.mode)
        key = (spec.name, repr(problem), str(dtype), mode)
        if self._rotation_key != key:
            self._rotation = None
            self._rotation = bench.timing_cases(spec, problem, dtype, device, self.TIMING_SEED, mode)
            self._rotation_key = key
        fn = bench.cycling(self._rotation, lambda c: functools.partial(
            spec.run, *c.args, out=c.out, config=config, **c.kwargs))
        if self.timer is not None:
            ms, mode = float(self.timer(fn)), getattr(self.timer, "__name__", "custom")
        else:
            ms = float(bench.time_ms(fn, mode))
        if not (ms > 0 and math.isfinite(ms)):
            return {"ok": False, "error": f"timer returned {ms!r}"}
        phases["time_s"] = clock() - t
        return {"ok": True, "ms": ms, "timer": mode, "phases": {k: round(v, 4) for k, v in phases.items()},
                **({} if worst is None else {"rel_error": worst})}


# ---------------------------------------------------------------------------------------------------
# Where evaluations run: in this process, or in a worker process restarted when it dies
# ---------------------------------------------------------------------------------------------------
class InlineRunner:
    """Evaluate in this process (the interpreter, tests): nothing can crash a CUDA context here."""

    def __init__(self, evaluate: Callable):
        self.evaluate = evaluate
        self.timeout = None

    def __call__(self, task: Task) -> dict:
        try:
            return self.evaluate(task)
        except Exception as e:
            return {"ok": False, "error": classify(e)[0]}

    def close(self) -> None:
        pass


def _serve(conn, evaluate) -> None:
    """Worker process: answer tasks until the pipe closes; exit after a fatal (CUDA) error."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills us
    import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)

    conn.send({"ready": True, "pid": os.getpid()})
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            res = evaluate(task)
        except BaseException as e:  # an evaluator that raises is a failed trial, not a dead worker
            res = {"ok": False, "error": classify(e)[0]}
        try:
            conn.send(res)
        except (OSError, ValueError):
            return
        if res.get("restart"):
            os._exit(3)


class ProcessRunner:
    """Evaluate in a ``spawn`` worker process; restart it when it dies, hangs past ``timeout`` or asks to.

    ``env`` (e.g. ``CUDA_VISIBLE_DEVICES``) is in the worker's environment from its first instruction.
    """

    def __init__(self, evaluate: Callable, env: dict | None = None, timeout: float = TASK_TIMEOUT,
                 start_timeout: float = START_TIMEOUT):
        self.evaluate = evaluate
        self.env = dict(env or {})
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.proc = None
        self.conn = None
        self.starts = 0
        self._ctx = multiprocessing.get_context("spawn")

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            proc = self._ctx.Process(target=_serve, args=(child, self.evaluate), daemon=True,
                                     name="tritune-eval")
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()  # so that the worker's death reads as EOF here
        self.proc, self.conn = proc, parent
        self.starts += 1
        try:
            if not parent.poll(self.start_timeout):
                raise RuntimeError(f"evaluation worker did not start within {self.start_timeout:.0f} s")
            parent.recv()
        except (EOFError, OSError, RuntimeError) as e:
            self._stop()
            raise RuntimeError(f"evaluation worker failed to start: {e}") from None

    def _stop(self) -> int | None:
        p, self.proc = self.proc, None
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if p is None:
            return None
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)
        return p.exitcode

    def __call__(self, task: Task) -> dict:
        if self.proc is None or not self.proc.is_alive():
            if self.proc is not None:
                self._stop()
            self._start()
        try:
            self.conn.send(dataclasses.replace(task, spec=None))
            if not self.conn.poll(self.timeout):
                self._stop_now()
                return {"ok": False, "error": f"timeout: no result within {self.timeout:.0f} s (worker killed)",
                        "worker_died": True}
            res = self.conn.recv()
        except (EOFError, OSError):
            code = self._stop()
            return {"ok": False, "error": f"worker died (exit code {code})", "worker_died": True}
        if res.get("restart"):
            self._stop()
        return res

    def _stop_now(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        self._stop()

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except OSError:
                pass
        self._stop()


class TableRunner:
    """Outcomes looked up in a table of measured results (the sampler-efficiency replay)."""

    def __init__(self, table: dict):
        self.table = table
        self.timeout = None

    def __call__(self, task: Task) -> dict:
        return self.table.get(config_key(task.config, None),
                              {"ok": False, "error": "not measured in the grid table"})

    def close(self) -> None:
        pass


def make_runner(evaluate: Callable | None, isolation: str = "auto", env: dict | None = None,
                timeout: float = TASK_TIMEOUT):
    evaluate = evaluate if evaluate is not None else Evaluator()
    if isolation == "auto":  # everywhere, the interpreter included: a config that faults is one failed trial
        isolation = "process"
    if isolation == "inline":
        return InlineRunner(evaluate)
    if isolation == "process":
        return ProcessRunner(evaluate, env=env, timeout=timeout)
    raise ValueError(f"isolation: expected 'auto', 'inline' or 'process', got {isolation!r}")


# ---------------------------------------------------------------------------------------------------
# Storage, names, samplers
# ---------------------------------------------------------------------------------------------------
def default_storage() -> str:
    from tritune.kernels.runtime import device as dev

    return os.environ.get("TRITUNE_STUDIES") or str(dev.cache_dir() / "tuning-studies.journal")


class StorageError(ValueError):
    """A storage that cannot be opened: the message names it and says why, in one line."""


STORAGE_HELP = ("Optuna storage: a journal file (e.g. ./studies.journal), or an RDB URL: sqlite:///studies.db, "
                "postgresql+psycopg2://USER@127.0.0.1:5432/DB (pip install 'tritune[postgres]')")


def open_storage(url=None):
    """A journal file (any path), or any Optuna RDB URL (``sqlite:///...``, ``postgresql://...``); a
    storage that cannot be opened raises :class:`StorageError` naming it and the reason."""
    import optuna

    if url is None:
        url = default_storage()
    if not isinstance(url, (str, os.PathLike)):
        return url  # already a storage object
    url = str(url)
    if "://" in url:
        kw = {}
        if url.startswith("sqlite"):
            kw["engine_kwargs"] = {"connect_args": {"timeout": 120}}
        # heartbeats fail the trials of a process on another machine that stopped beating (this
        # machine's dead processes are found at once by their pid: see reap)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # heartbeat_interval is experimental in Optuna
                return optuna.storages.RDBStorage(url, heartbeat_interval=60, grace_period=300, **kw)
        except ModuleNotFoundError as e:
            hint = " (pip install 'tritune[postgres]')" if url.startswith("postgres") else ""
            raise StorageError(f"storage {url}: the database driver is not installed: {e}{hint}") from None
        except Exception as e:  # SQLAlchemy's errors: bad URL, unknown dialect, no server, no such directory
            first = (str(getattr(e, "orig", None) or e).strip().splitlines() or [type(e).__name__])[0]
            raise StorageError(f"storage {url}: cannot open it: {first[:300]}") from None
    path = Path(url).expanduser()
    if path.is_dir():
        raise StorageError(f"storage {url}: is a directory; give a journal file path inside it, "
                           f"e.g. {path / 'studies.journal'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        raise StorageError(f"storage {url}: cannot write a journal file there: {e.strerror or e}") from None
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def check_seed_configs(specs, configs) -> None:
    """ValueError for a seed config that is not a JSON object, or names a parameter no kernel being tuned
    has (a typo would otherwise be skipped without a word)."""
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        raise ValueError("seed configs must be a JSON list of config objects, e.g. [{\"BLOCK\": 1024}]")
    known = set().union(*(s.space.params for s in specs)) if specs else set()
    for i, c in enumerate(configs):
        bad = sorted(set(c) - known)
        if bad:
            names = ", ".join(s.name for s in specs)
            raise ValueError(f"seed config {i} {c}: unknown parameter {bad[0]!r} for {names} "
                             f"(parameters: {', '.join(sorted(known))})")


def dtype_name(dtype) -> str:
    from tritune.kernels.runtime.store import dtype_name as name

    return name(dtype)


def store_key(dtype) -> str:
    """The store's (and a study's) dtype key: fp32 under tf32 precision is "tfloat32" where the kernels
    package keys it so (``kernels.store_dtype``), the dtype's name otherwise."""
    from tritune import kernels

    fn = getattr(kernels, "store_dtype", None)
    return fn(dtype) if fn is not None else dtype_name(dtype)


def study_name(kernel: str, bucket: str, dtype, slug: str, params: dict | None = None) -> str:
    """kernel:bucket:dtype:slug, and with the space's parameters a short hash of their names and choices:
    Optuna keeps one set of choices per parameter and study, so a kernel whose space gained a value (a new
    version) continues in a study of its own instead of failing on the old one's trials."""
    name = f"{kernel}:{bucket}:{dtype_name(dtype)}:{slug}"
    if params:
        sig = json.dumps(sorted((k, list(v)) for k, v in params.items()), default=str)
        name += f":space-{zlib.crc32(sig.encode()) & 0xFFFFFFFF:08x}"
    return name


def config_key(config: dict, params: dict | None) -> str:
    keys = list(params) if params is not None else sorted(config)
    return json.dumps([[k, config.get(k)] for k in sorted(keys)])


def _seed(*parts) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


def make_sampler(name: str, space, seed: int):
    import optuna

    if name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        # The grid is walked by run_study, which enqueues every valid point once in a seeded random order
        # (Optuna's GridSampler would also walk the invalid points, and its bookkeeping costs O(trials) per
        # proposal). The nominal sampler only answers when another worker took the enqueued point first.
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"sampler: expected one of {SAMPLERS}, got {name!r}")


# ---------------------------------------------------------------------------------------------------
# The plan: which studies a command means
# ---------------------------------------------------------------------------------------------------
@dataclass
class Job:
    spec: Any
    problem: Any
    dtype: Any
    slug: str
    bucket: str = ""
    name: str = ""
    skipped: list = field(default_factory=list)   # further problems of the same bucket
    key: str = ""           # the store's dtype key (fp32 under tf32 precision: "tfloat32")

    def __post_init__(self):
        from tritune import kernels

        self.bucket = self.bucket or kernels.bucket_key(self.spec.bucket(self.problem))
        self.key = self.key or store_key(self.dtype)
        self.name = self.name or study_name(self.spec.name, self.bucket, self.key, self.slug,
                                            getattr(getattr(self.spec, "space", None), "params", None))

    def label(self) -> str:
        return f"{self.spec.name} {self.bucket} {self.key}"


def resolve_specs(kernels_) -> list:
    """Names, 'all', or spec objects -> specs."""
    from tritune import kernels

    if isinstance(kernels_, str):
        kernels_ = [kernels_]
    out = []
    for k in kernels_:
        if isinstance(k, str):
            out += kernels.all_specs() if k == "all" else [kernels.get(k)]
        else:
            out.append(k)
    return out


def plan(specs, problems=None, dtypes=None, slug: str | None = None, log=None) -> list[Job]:
    """One job per (kernel, bucket, dtype): the first given problem of each bucket is the one tuned."""
    from tritune.kernels.runtime import device as dev

    slug = slug or dev.gpu_slug()
    log = log or (lambda msg: None)
    jobs = []
    for spec in specs:
        probs = problems if problems is not None else (
            spec.small_problems if dev.interpreted() else spec.standard_problems)
        if not probs:
            log(f"{spec.name}: no problems to tune")
            continue
        if any(not all(isinstance(c, _SCALARS) for c in v) for v in spec.space.params.values()):
            log(f"{spec.name}: skipped: space choices must be scalars (int, float, str, bool) to be stored")
            continue
        for dt in (dtypes or spec.dtypes):
            if dt not in spec.dtypes:
                log(f"{spec.name}: skipping dtype {dtype_name(dt)} (supported: "
                    f"{', '.join(map(dtype_name, spec.dtypes))})")
                continue
            if dev.interpreted() and dt in spec.interpreter_skip:
                log(f"{spec.name}: skipping {dtype_name(dt)} on the interpreter: {spec.interpreter_skip[dt]}")
                continue
            by_bucket: dict[str, Job] = {}
            for p in probs:
                j = Job(spec, p, dt, slug)
                if j.bucket in by_bucket:
                    by_bucket[j.bucket].skipped.append(p)
                    log(f"{spec.name}: {p} shares bucket {j.bucket} with {by_bucket[j.bucket].problem}; "
                        "one config per bucket: tuning the first")
                else:
                    by_bucket[j.bucket] = j
            jobs += by_bucket.values()
    return jobs


# ---------------------------------------------------------------------------------------------------
# One study
# ---------------------------------------------------------------------------------------------------
def _problem_dict(problem) -> dict:
    if dataclasses.is_dataclass(problem):
        return {k: v for k, v in dataclasses.asdict(problem).items() if isinstance(v, _SCALARS)}
    return {"repr": repr(problem)}


def _problem_label(problem) -> str:
    from tritune.harness import bench

    return bench.problem_label(problem)


def open_study(storage, job: Job, sampler=None):
    """Create or load the study of a job (safe when several processes do it at once)."""
    import optuna

    study = optuna.create_study(study_name=job.name, storage=storage, direction="minimize",
                                sampler=sampler, load_if_exists=True)
    attrs = study.user_attrs
    if attrs.get("kernel") != job.spec.name:
        default = job.spec.default_config(job.problem, job.dtype)
        for k, v in {
            "tritune": 1, "kernel": job.spec.name, "bucket": job.bucket, "dtype": job.key,
            "slug": job.slug, "problem": _problem_dict(job.problem), "problem_label": _problem_label(job.problem),
            "default_config": default,
            "n_valid": len(job.spec.space.points(job.problem, job.dtype)),
        }.items():
            study.set_user_attr(k, v)
    elif attrs.get("problem") not in (None, _problem_dict(job.problem)) and dataclasses.is_dataclass(job.problem):
        # measurements in one study must be of one problem: keep the one the study started with
        try:
            old = type(job.problem)(**attrs["problem"])
        except TypeError:
            old = None
        if old is not None:
            print(f"tritune: study {job.name} was started on {attrs.get('problem_label')}; continuing with it "
                  f"(not {_problem_label(job.problem)})", file=sys.stderr)
            job.problem = old
    return study


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _evaluated(trials) -> list:
    """Trials whose evaluation finished: complete, or failed with the evaluation's reason. A trial that
    failed without one was abandoned (its process died after timing it, before telling the storage): it
    does not count, and it is retried."""
    from optuna.trial import TrialState

    return [t for t in trials if t.user_attrs.get("evaluated") and t.state.is_finished()
            and (t.state != TrialState.FAIL or "error" in t.user_attrs)]


# ---------------------------------------------------------------------------------------------------
# Trials of dead processes: failed, then retried once
# ---------------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child its parent has not waited for yet is a zombie: dead all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _is_dead(t, now: float, window: float) -> bool:
    """A RUNNING trial whose process is gone: its owner (host:pid) is on this host and not alive, or it
    started longer ago than any evaluation may take (another host's, or one killed before it said who
    owns it)."""
    owner = t.user_attrs.get("owner")
    if isinstance(owner, str) and ":" in owner:
        host, _, pid = owner.rpartition(":")
        if host == socket.gethostname() and pid.isdigit():
            return int(pid) != os.getpid() and not _pid_alive(int(pid))
    start = t.datetime_start.timestamp() if t.datetime_start is not None else now
    return now - start > window


# a retried trial keeps its role: a seed's, or tune all --budget's local-search and nearest-bucket marks
_CARRIED = ("default", "previous", "seeded", "warm", "forced", "local", "local_of", "bucket_seed")


def reap(study, window: float) -> int:
    """Fail the RUNNING trials of dead processes (a ``kill -9``, a crash, a lost machine) and enqueue
    each abandoned trial's config once again, with its role (default, seeded, ...): after a kill the
    study still reaches its trial count, and no finished evaluation is repeated. ``window``: seconds
    after which a trial of an unknown or remote process counts as dead. Returns how many were failed.
    RDB storages also fail trials whose heartbeat stopped (Optuna's ``fail_stale_trials``)."""
    import optuna
    from optuna.trial import TrialState

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental since Optuna 2.9
            optuna.storages.fail_stale_trials(study)
    except Exception:  # a storage without heartbeats, or a race with another worker: ours below suffices
        pass
    storage = study._storage
    now = time.time()
    n = 0
    ts = study.get_trials(deepcopy=False)
    for t in ts:
        if t.state != TrialState.RUNNING or not _is_dead(t, now, window):
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "abandoned", f"process gone ({t.user_attrs.get('owner', '?')})")
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError, ValueError):
            pass  # it finished after all, or another worker reaped it first
    if n:
        ts = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in ts}
    for t in ts:
        launched_nothing = any(k in t.user_attrs for k in ("duplicate_of", "busy_with", "invalid"))
        abandoned = (t.state == TrialState.FAIL and "error" not in t.user_attrs and not launched_nothing
                     and "retry_of" not in t.user_attrs and t.params)
        if abandoned and t.number not in retried:
            attrs = {k: t.user_attrs[k] for k in _CARRIED if k in t.user_attrs}
            study.enqueue_trial(dict(t.params), user_attrs={**attrs, "retry_of": t.number},
                                skip_if_exists=False)
            retried.add(t.number)
    return n


def code_version(kernel: str) -> str | None:
    """The kernel's jitted-code hash (``store.source_hash``): each evaluated trial records it."""
    from tritune.kernels.runtime import store

    return store.source_hash(kernel)


def _trial_source(t, by_number: dict) -> str | None:
    """The code version a trial was timed on: its own record, or (a repeat of an earlier config) that
    trial's. Trials from before versions were recorded have none."""
    for _ in range(8):
        ev = t.user_attrs.get("evaluated")
        if isinstance(ev, dict):
            return ev.get("source")
        prev = t.user_attrs.get("duplicate_of")
        if prev is None or prev not in by_number:
            return None
        t = by_number[prev]
    return None


def current_trials(trials, version: str | None) -> list:
    """The trials timed on this version of the kernel's code (all of them when the version is unknown).
    A study continued after the kernel changed keeps its old trials for the sampler, but none of them is
    reused as a result, exported or counted: they measured other code."""
    if version is None:
        return list(trials)
    by_number = {t.number: t for t in trials}
    return [t for t in trials if _trial_source(t, by_number) == version]


def run_study(study, job: Job, runner, *, trials: int, sampler_name: str = "tpe", deadline: float | None = None,
              stop_at_us: float | None = None, seed: int = 0, seed_default: bool = True,
              progress: Callable | None = None, stall: int = STALL,
              should_stop: Callable | None = None) -> None:
    """Run trials in ``study`` until ``trials`` evaluated trials exist (or every valid point is
    evaluated, or ``deadline`` passes, or a value <= ``stop_at_us`` is found, or ``should_stop(trials)``,
    asked before each proposal with the study's current trials, is true: see ``tuning/budget.py``)."""
    import optuna
    from optuna.trial import TrialState

    spec, space = job.spec, job.spec.space
    params = space.params
    valid = {config_key(p, params): p for p in space.points(job.problem, job.dtype)}
    if not valid:
        return
    rng = random.Random(_seed(seed, job.name, "forced"))
    inflight_window = (getattr(runner, "timeout", None) or 3600.0) + 120.0
    if seed_default:
        ensure_seeds(study, job)
    free_streak = 0
    version = code_version(spec)
    while True:
        reap(study, inflight_window)
        all_ts = study.get_trials(deepcopy=False)
        keep = {t.number for t in current_trials(all_ts, version)}
        ts = [t for t in all_ts if t.number in keep or not t.state.is_finished()]
        done = _by_config(_evaluated(ts), params)
        n_eval = len(_evaluated(ts))
        now = time.time()
        running = [t for t in ts if t.state == TrialState.RUNNING and t.datetime_start is not None
                   and now - t.datetime_start.timestamp() < inflight_window]
        best = min((t.value for t in ts if t.state == TrialState.COMPLETE and t.value is not None),
                   default=None)
        if progress is not None:
            progress(job, n_eval, min(trials, len(valid)), sum(t.state == TrialState.FAIL for t in _evaluated(ts)),
                     best, deadline)
        if n_eval + len(running) >= trials or len(set(done) & set(valid)) >= len(valid):
            break
        if deadline is not None and now >= deadline:
            break
        if stop_at_us is not None and best is not None and best <= stop_at_us:
            break
        if should_stop is not None and should_stop(ts):
            break
        waiting = any(t.state == TrialState.WAITING for t in ts)
        if not waiting and (sampler_name == "grid" or free_streak >= stall):
            busy = {config_key(t.params, params) for t in running}
            left = sorted(set(valid) - set(done) - busy) or sorted(set(valid) - set(done))
            study.enqueue_trial(valid[rng.choice(left)],
                                user_attrs=None if sampler_name == "grid" else {"forced": True})
            free_streak = 0
        outcome = {"evaluated": False}

        def objective(trial):
            config = {k: trial.suggest_categorical(k, choices) for k, choices in params.items()}
            why = space.why_invalid(config, job.problem, job.dtype)
            if why:
                trial.set_user_attr("invalid", why)
                raise optuna.TrialPruned(why)
            prev, busy = _claim(study, trial.number, config, params, version)
            if busy is not None:  # another trial holds this config: it will time it
                trial.set_user_attr("busy_with", busy)
                raise TrialFailed(f"trial {busy} holds this config")
            if prev is not None:
                trial.set_user_attr("duplicate_of", prev.number)
                if prev.state == TrialState.COMPLETE:
                    return prev.value
                trial.set_user_attr("error", prev.user_attrs.get("error", "failed"))
                raise TrialFailed(prev.user_attrs.get("error", "failed"))
            if _surplus(study, trial.number, trials, version, inflight_window):
                trial.set_user_attr("surplus", True)  # another worker started the last trial first
                raise optuna.TrialPruned("the study's trial count is reached")
            trial.set_user_attr("owner", _worker_id())  # who to ask whether this trial is still alive
            tseed = _seed(seed, job.name, trial.number, "inputs")
            t0 = time.time()
            res = runner(Task(spec.name, job.problem, job.dtype, config, tseed, spec=spec))
            outcome["evaluated"] = True
            facts = {"seed": tseed, "worker": _worker_id(), "seconds": round(time.time() - t0, 3),
                     "source": version}
            if "rel_error" in res:
                facts["rel_error"] = float(res["rel_error"])
            if "timer" in res:
                facts["timer"] = str(res["timer"])
            if isinstance(res.get("phases"), dict):
                facts["phases"] = res["phases"]
            trial.set_user_attr("evaluated", facts)  # one journal write per evaluated trial
            if res.get("ok"):
                return float(res["ms"]) * 1e3
            trial.set_user_attr("error", str(res.get("error", "failed"))[:1000])
            raise TrialFailed(res.get("error", "failed"))

        study.optimize(objective, n_trials=1, catch=(TrialFailed,), gc_after_trial=False)
        free_streak = 0 if outcome["evaluated"] else free_streak + 1
    _record_default(study)


def _by_config(evaluated, params) -> dict:
    """Evaluated trials by config key: the first of each config, or its first complete one."""
    from optuna.trial import TrialState

    done: dict[str, Any] = {}
    for t in evaluated:
        k = config_key(t.params, params)
        if k not in done or (done[k].state != TrialState.COMPLETE and t.state == TrialState.COMPLETE):
            done[k] = t
    return done


def _claim(study, number: int, config: dict, params, version):
    """Whether trial ``number`` may time ``config``, asked after its parameters are in the storage (the
    storage's trials now, not the loop's snapshot): ``(prev, None)`` with the trial that already timed it
    on the current code, if any, or ``(None, other)`` when another unfinished trial holds the same config
    (waiting, running, or running in a dead process and about to be retried). Two trials that claim one
    config at once both see the other and both yield, never both time it."""
    from optuna.trial import TrialState

    key = config_key(config, params)
    ts = study.get_trials(deepcopy=False)
    for t in ts:
        if t.number == number:
            continue
        if t.state in (TrialState.WAITING, TrialState.RUNNING):
            held = t.params or t.system_attrs.get("fixed_params") or {}
            if held and config_key(held, params) == key:
                return None, t.number
    return _by_config(_evaluated(current_trials(ts, version)), params).get(key), None


def _surplus(study, number: int, trials: int, version, window: float) -> bool:
    """Whether trial ``number`` would go past the count: the evaluated trials and the live running ones
    created before it (lower numbers) already make ``trials``. Trials are numbered in the order the
    storage created them, so workers starting at once agree on which of them runs: the count is met
    exactly, not overshot."""
    from optuna.trial import TrialState

    ts = study.get_trials(deepcopy=False)
    now = time.time()
    ahead = sum(1 for t in ts if t.number < number and t.state == TrialState.RUNNING and not _is_dead(t, now, window))
    return len(_evaluated(current_trials(ts, version))) + ahead >= trials


def _ensure_default(study, job: Job) -> None:
    """Enqueue the heuristic default as a trial (once): its time is the baseline, and tuning can only
    improve on it."""
    from optuna.trial import TrialState

    default = job.spec.default_config(job.problem, job.dtype)
    if job.spec.space.why_invalid(default, job.problem, job.dtype):
        if "default_error" not in study.user_attrs:
            study.set_user_attr("default_error", "default config invalid: " +
                                job.spec.space.why_invalid(default, job.problem, job.dtype))
        return
    all_ts = study.get_trials(deepcopy=False)
    current = {t.number for t in current_trials(all_ts, code_version(job.spec.name))}
    for t in all_ts:
        if t.user_attrs.get("default") and (t.state in (TrialState.WAITING, TrialState.RUNNING)
                                            or (t.number in current and (t.user_attrs.get("evaluated")
                                                                         or "duplicate_of" in t.user_attrs))):
            return
    study.enqueue_trial(default, user_attrs={"default": True})


def _ensure_previous(study, job: Job) -> None:
    """Enqueue the store's entry for the job's bucket (once), stale or not: after an edit to the kernel's
    code, the config that won on the code before is the likeliest winner still, so the study times it
    again on the current code rather than hoping its sampler finds it."""
    from tritune.kernels.runtime import store

    try:
        prev = store.entry_config(job.spec.name, job.bucket, job.key, job.slug)
    except Exception:  # an unreadable store is reported where it is loaded
        return
    if prev is not None and prev != job.spec.default_config(job.problem, job.dtype):
        _enqueue_seeds(study, job, [prev], attr="previous")


def ensure_seeds(study, job: Job) -> None:
    """Every study's own seeds, each enqueued once: the heuristic default, the store's entry for its bucket
    and the spec's seeds (``KernelSpec.seeds``, as seeded trials)."""
    _ensure_default(study, job)
    _ensure_previous(study, job)
    if job.spec.seeds is not None:
        _enqueue_seeds(study, job, list(job.spec.seeds(job.problem, job.dtype)))


def _enqueue_seeds(study, job: Job, configs: list[dict], attr: str = "seeded") -> int:
    """Enqueue each of ``configs`` (completed from the default) that is valid for the job and not yet
    waiting, running or timed on the current code under ``attr`` (the trial's user attribute, holding
    the config's key); returns how many were enqueued."""
    from optuna.trial import TrialState

    params = job.spec.space.params
    default = job.spec.default_config(job.problem, job.dtype)
    all_ts = study.get_trials(deepcopy=False)
    current = {t.number for t in current_trials(all_ts, code_version(job.spec.name))}
    have = {t.user_attrs.get(attr) for t in all_ts
            if t.state in (TrialState.WAITING, TrialState.RUNNING) or t.number in current}
    n = 0
    for cfg in configs:
        full = dict(default, **cfg)
        key = config_key(full, params)
        if key in have or job.spec.space.why_invalid(full, job.problem, job.dtype):
            continue
        study.enqueue_trial(full, user_attrs={attr: key})
        have.add(key)
        n += 1
    return n


def _record_default(study) -> None:
    s = study_stats(study)
    if s.get("default_us") is not None and study.user_attrs.get("default_us") != s["default_us"]:
        study.set_user_attr("default_us", s["default_us"])
    if s.get("default_error") and study.user_attrs.get("default_error") != s["default_error"]:
        study.set_user_attr("default_error", s["default_error"])


# ---------------------------------------------------------------------------------------------------
# Reading studies back
# ---------------------------------------------------------------------------------------------------
def study_stats(study) -> dict:
    """What a study found: best verified config and time, the default's time, trials and failures."""
    from optuna.trial import TrialState

    a = study.user_attrs
    all_ts = study.get_trials(deepcopy=False)
    ts = current_trials(all_ts, code_version(a["kernel"]) if a.get("kernel") else None)
    evaluated = _evaluated(ts)
    failed = [t for t in evaluated if t.state == TrialState.FAIL]
    complete = [t for t in ts if t.state == TrialState.COMPLETE and t.value is not None]
    default_cfg = a.get("default_config")
    best = min(complete, key=lambda t: (t.value, t.number)) if complete else None
    default_us = default_error = None
    for t in sorted(ts, key=lambda t: t.number):
        is_default = t.user_attrs.get("default") or (default_cfg is not None and dict(t.params) == default_cfg)
        if not is_default:
            continue
        if t.state == TrialState.COMPLETE and t.value is not None:
            default_us = t.value
            break
        if t.state == TrialState.FAIL and (t.user_attrs.get("evaluated") or "duplicate_of" in t.user_attrs):
            default_error = t.user_attrs.get("error", "failed")
    if default_us is not None:
        default_error = None
    elif default_error is None:
        default_error = a.get("default_error")
    reasons = collections.Counter(str(t.user_attrs.get("error", "failed")).split(":")[0] for t in failed)
    return {
        "study": study.study_name, "kernel": a.get("kernel"), "bucket": a.get("bucket"), "dtype": a.get("dtype"),
        "slug": a.get("slug"), "problem": a.get("problem_label"), "problem_fields": a.get("problem"),
        "n_valid": a.get("n_valid"),
        "trials": len(evaluated), "failed": len(failed), "free": len(all_ts) - len(_evaluated(all_ts)),
        "stale_trials": len(_evaluated(all_ts)) - len(evaluated),
        "best_us": best.value if best else None, "config": dict(best.params) if best else None,
        "best_trial": best.number if best else None,
        "default_us": default_us, "default_config": default_cfg, "default_error": default_error,
        "speedup": (default_us / best.value) if (best and default_us) else None,
        "failure_kinds": dict(reasons),
        "workers": sorted({t.user_attrs["evaluated"]["worker"] for t in evaluated
                           if isinstance(t.user_attrs["evaluated"], dict) and "worker" in t.user_attrs["evaluated"]}),
    }


def tuned_studies(storage, kernel: str | None = None, slug: str | None = None) -> list:
    """Every tritune study in ``storage`` (optionally of one kernel and GPU slug), as loaded studies."""
    import optuna

    out = []
    for s in optuna.get_all_study_summaries(storage, include_best_trial=False):
        a = s.user_attrs
        if not a.get("tritune"):
            continue
        if kernel is not None and a.get("kernel") != kernel:
            continue
        if slug is not None and a.get("slug") != slug:
            continue
        out.append(optuna.load_study(study_name=s.study_name, storage=storage))
    return sorted(out, key=lambda st: st.study_name)


def export(storage=None, kernels_=None, slug: str | None = None, root: Path | str | None = None,
           log=print) -> list[Path]:
    """Write ``<root>/<slug>/<kernel>.json`` (store format) from the studies: per bucket and dtype the
    best verified config, its time, the default's time, trials used and failed."""
    from tritune import kernels
    from tritune.kernels.runtime import device as dev
    from tritune.kernels.runtime import store

    storage = open_storage(storage)
    slug = slug or dev.gpu_slug()
    names = None if kernels_ in (None, "all", ["all"]) else [getattr(k, "name", k) for k in
                                                            ([kernels_] if isinstance(kernels_, str) else kernels_)]
    by_kernel: dict[str, list] = collections.defaultdict(list)
    for st in tuned_studies(storage, slug=slug):
        a = st.user_attrs
        if names is not None and a["kernel"] not in names:
            continue
        s = study_stats(st)
        if s["config"] is None:
            log(f"export: {st.study_name}: no verified trial; nothing to store")
            continue
        try:
            spec = kernels.get(a["kernel"])
            if set(s["config"]) != set(spec.space.params):
                log(f"export: {st.study_name}: best config {s['config']} no longer matches the space; skipped")
                continue
        except KeyError:
            pass
        config, best_us, default_us = s["config"], s["best_us"], s["default_us"]
        r = a.get("retimed")  # the side-by-side re-timing of the front runners decides, where it is current
        retimed = isinstance(r, dict) and r.get("best_trial") == s["best_trial"] and r.get("config")
        if retimed:
            config, best_us, default_us = r["config"], r["time_us"], r.get("default_us", default_us)
        e = {"bucket": a["bucket"], "dtype": a["dtype"], "config": config, "time_us": round(best_us, 3),
             "default_us": None if default_us is None else round(default_us, 3),
             "default_config": s["default_config"],
             "speedup": None if not default_us else round(default_us / best_us, 4),
             "trials": s["trials"], "failed": s["failed"], "problem": s["problem"],
             "problem_fields": s["problem_fields"], "study": st.study_name}
        if retimed:
            e["retimed"] = {k: r[k] for k in ("winner", "times_us", "rounds") if k in r}
        by_kernel[a["kernel"]].append(e)
    paths = []
    for k, entries in sorted(by_kernel.items()):
        p = store.write(k, entries, slug=slug, root=Path(root) if root is not None else None)
        log(f"export: wrote {p} ({len(entries)} entries)")
        paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------------
# The sweep: one process, or N processes on N GPUs sharing the storage
# ---------------------------------------------------------------------------------------------------
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
        study = open_study(storage, job, make_sampler(sampler, job.spec.space, _seed(seed, job.name, sampler)))
        run_study(study, job, runner, trials=trials, sampler_name=sampler, deadline=study_deadline,
                  stop_at_us=(stop_at or {}).get(job.name), seed=seed, seed_default=seed_default,
                  progress=progress)
        if progress is not None:
            progress.next_job()


def _sweep_entry(jobs_data, kwargs, evaluate, isolation, timeout) -> None:
    """A ``--workers`` process: rebuild the jobs by kernel name and sweep with its own evaluator."""
    import tritune.kernels.runtime  # noqa: F401
    from tritune import kernels

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
    (under the ``warm`` attribute): another GPU's winners for the bucket (see ``tuning/budget.py``).

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
                _enqueue_seeds(study, job, mine)
            if warm is not None:
                _enqueue_seeds(study, job, warm(job), attr="warm")
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
            p = ctx.Process(target=_sweep_entry, args=(jobs_data, kw, evaluate,
                                                      isolation, timeout), name=f"tritune-tune-{w}")
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
                ev = _evaluated(st.get_trials(deepcopy=False))
                n += len(ev)
                failed += sum(t.state.name == "FAIL" for t in ev)
            bar.update(min(n, bar.total) - bar.n)
            bar.set_postfix_str(f"{failed} failed")
    except KeyboardInterrupt:
        for p in procs:
            p.join(10.0)
            if p.is_alive():
                p.terminate()
        raise
    finally:
        if bar is not None:
            bar.close()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        log(f"tune: {len(bad)} worker(s) exited with codes {bad}; their finished trials are kept")


# ---------------------------------------------------------------------------------------------------
# Search efficiency: TPE and random against the exhaustive grid, on the same measurements
# ---------------------------------------------------------------------------------------------------
def measured_table(study, job: Job) -> dict:
    """config key -> outcome, from every evaluated trial of a study (the median of repeated measurements)."""
    from optuna.trial import TrialState

    params = job.spec.space.params
    times: dict[str, list] = collections.defaultdict(list)
    errors: dict[str, str] = {}
    for t in _evaluated(study.get_trials(deepcopy=False)):
        k = config_key(t.params, params)
        if t.state == TrialState.COMPLETE:
            times[k].append(t.value)
        else:
            errors[k] = t.user_attrs.get("error", "failed")
    table = {k: {"ok": False, "error": e} for k, e in errors.items()}
    for k, v in times.items():
        v = sorted(v)
        table[k] = {"ok": True, "ms": v[len(v) // 2] / 1e3}
    return table


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
    import statistics

    from tritune.harness import bench

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
               "problem": _problem_label(job.problem), "n_valid": len(valid), "study": job.name,
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
        runner = TableRunner(table)
        for name in ("tpe", "random"):
            counts = []
            for r in range(repeats):
                s = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction="minimize",
                                        sampler=make_sampler(name, job.spec.space, _seed(seed, job.name, name, r)))
                s.set_user_attr("kernel", job.spec.name)
                run_study(s, job, runner, trials=len(valid), sampler_name=name, stop_at_us=target,
                          seed=seed + r, seed_default=False)
                counts.append(trials_to_target(s, target))
            reached = [c for c in counts if c is not None]
            med = statistics.median(reached) if reached else None
            row[name] = {"trials_to_target": counts, "median": med,
                         "mean": statistics.fmean(reached) if reached else None,
                         "max": max(reached) if reached else None,
                         "median_fraction_of_grid": None if med is None else med / len(valid)}
        row["tpe_within_25pct_of_grid"] = (row["tpe"]["median"] is not None
                                           and row["tpe"]["median"] <= 0.25 * len(valid))
        rows.append(row)
    path = None
    if rows:
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
        env = bench.environment()
        path.write_text(json.dumps({"environment": env, "threshold": threshold, "repeats": repeats,
                                    "experiments": sorted(keyed.values(), key=lambda e: (e["kernel"], e["dtype"],
                                                                                       e["bucket"]))},
                                   indent=1, default=str) + "\n")
    return rows, path


def _study_problem(study, job: Job):
    a = study.user_attrs.get("problem")
    if a and dataclasses.is_dataclass(job.problem) and a != _problem_dict(job.problem):
        try:
            return type(job.problem)(**a)
        except TypeError:
            pass
    return job.problem
