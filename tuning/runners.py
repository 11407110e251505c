"""Where evaluations run: in this process (:class:`InlineRunner`), in a ``spawn`` worker process restarted
when it dies or hangs (:class:`ProcessRunner`: a config that corrupts the CUDA context costs one failed
trial, not the sweep), or nowhere: :class:`ReplayRunner` answers from recorded trials.

A runner is ``runner(task) -> {"ok", "ms" | "error"}`` with ``timeout`` and ``close()``. A worker process
dies with the process that started it (:func:`die_with_parent`).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from typing import Callable

from tritune.tuning.evaluate import Evaluator, Task, classify
from tritune.tuning.study import config_key

TASK_TIMEOUT = 300.0       # seconds for one evaluation (compile + check + timing) before the worker is killed
START_TIMEOUT = 900.0      # seconds for a worker process to import torch/triton and say it is ready


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


def die_with_parent(parent: int, death_signal: bool = True, poll_s: float = 0.5) -> None:
    """End this process when process ``parent`` dies, however it dies (``kill -9`` included), so that no
    worker or helper outlives the tuner. On Linux, ``PR_SET_PDEATHSIG`` (SIGKILL at the parent's death;
    only when ``death_signal``: it fires when the parent's *thread* that started us ends, so a parent that
    starts workers from another thread than its main one asks for the watch alone); everywhere, a daemon
    thread that watches the parent's pid (an evaluation in progress reads no pipe whose EOF it would see)."""
    import threading

    if death_signal and sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)   # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:   # it died before we got here
        os._exit(4)

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(4)

    threading.Thread(target=watch, name="tritune-parent-watch", daemon=True).start()


def worker_guard() -> dict:
    """What a process about to start a worker passes it for :func:`die_with_parent`."""
    import threading

    return {"parent": os.getpid(), "death_signal": threading.current_thread() is threading.main_thread()}


def serve(conn, evaluate, guard: dict | None = None) -> None:
    """Worker process: answer tasks until the pipe closes; exit after a fatal (CUDA) error, or when the
    process that started it dies (``guard``: :func:`worker_guard` of that process)."""
    import signal

    if guard:
        die_with_parent(**guard)
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
            proc = self._ctx.Process(target=serve, args=(child, self.evaluate, worker_guard()), daemon=True,
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


class ReplayRunner:
    """Outcomes answered from recorded trials instead of a launch. ``table``: config key -> outcome, for
    one study (the sampler-efficiency replay on a grid's measurements); or, from :meth:`from_storage`,
    (kernel, bucket, dtype key, config key) -> outcome over every study of a storage, the median time of
    a config's complete trials, or its failure. A config never recorded gets ``missing(task)`` (default:
    a failure "not measured")."""

    def __init__(self, table: dict, missing: Callable | None = None, by_study: bool = False):
        self.table, self.missing, self.by_study = table, missing, by_study
        self.timeout = None
        self.answered = {"recorded": 0, "missing": 0}

    @classmethod
    def from_storage(cls, storage, missing: Callable | None = None) -> "ReplayRunner":
        from tritune.tuning import study as st

        table = {}
        for s in st.tuned_studies(st.open_storage(storage)):
            a = s.user_attrs
            for k, v in measured_table(s, None).items():
                table[(a.get("kernel"), a.get("bucket"), a.get("dtype"), k)] = v
        return cls(table, missing, by_study=True)

    def key(self, task: Task):
        from tritune import kernels
        from tritune.tuning import study as st

        if not self.by_study:
            return config_key(task.config, None)
        spec = task.spec_or_lookup()
        cfg = {k: task.config.get(k) for k in spec.space.params}
        return (spec.name, kernels.bucket_key(spec.bucket(task.problem)), st.store_key(task.dtype),
                config_key(cfg, spec.space.params))

    def __call__(self, task: Task) -> dict:
        got = self.table.get(self.key(task))
        if got is not None:
            self.answered["recorded"] += 1
            return dict(got)
        self.answered["missing"] += 1
        return self.missing(task) if self.missing is not None else {"ok": False, "error": "not measured"}

    def close(self) -> None:
        pass


def measured_table(study, job=None) -> dict:
    """config key -> outcome, from every evaluated trial of a study (the median of repeated measurements;
    a config that never completed: its last failure). ``job``: the study's job (its space's parameters
    name the key), else the trials' own parameters."""
    import collections

    from optuna.trial import TrialState

    from tritune.tuning.study import evaluated

    params = job.spec.space.params if job is not None else None
    times: dict[str, list] = collections.defaultdict(list)
    errors: dict[str, str] = {}
    for t in evaluated(study.get_trials(deepcopy=False)):
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


def stop_workers(procs, grace_s: float = 10.0) -> None:
    """After Ctrl-C (which the workers get too, from the terminal): each worker gets ``grace_s`` to write what
    it has (its ledger, its last trial), then is terminated."""
    for p in procs:
        p.join(grace_s)
        if p.is_alive():
            p.terminate()

