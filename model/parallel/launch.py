"""Several ranks on one host: ``launch(n, fn, *args)`` runs ``fn(group, *args)`` in ``n`` new processes
(torch.multiprocessing, spawned; rank 0's rendezvous on a free 127.0.0.1 port) and returns each rank's
result; :class:`Workers` starts ranks 1..n-1 beside a rank 0 that is the calling process (the engine's
way: its scheduler stays where the caller is).

A rank that dies never hangs the others: every collective has a timeout (the group's ``timeout_s``), and
a watchdog polls the children's exit codes; the first rank found dead (one killed by a signal or that
exited without a Python error first: the ranks whose collectives failed after it are its victims) is
reported as :class:`RankFailed` with its exit code, and the other ranks are stopped.
"""
from __future__ import annotations

import os
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from tritune.model.parallel import group as G


class RankFailed(RuntimeError):
    """A rank of a tensor-parallel group exited (``rank``, ``exitcode``: negative, the signal that killed
    it); ``failures``: every rank found failed {rank: (exitcode, its error or None)}."""

    def __init__(self, rank: int, exitcode, error: str | None = None, failures: dict | None = None):
        self.rank, self.exitcode, self.error = rank, exitcode, error
        self.failures = failures or {rank: (exitcode, error)}
        how = f"killed by signal {-exitcode}" if isinstance(exitcode, int) and exitcode < 0 else f"exit code {exitcode}"
        super().__init__(f"tensor-parallel rank {rank} died ({how})" + (f":\n{error}" if error else ""))


def _entry(rank, world, backend, port, timeout_s, threads, fn, args, results):
    """A child rank: join the group, run fn, send (rank, ok, value or traceback)."""
    if threads and backend == "gloo":
        torch.set_num_threads(threads)
    try:
        group = G.init(world, rank, backend, port=port, timeout_s=timeout_s)
        value = fn(group, *args)
    except BaseException:  # noqa: BLE001 (any failure of the rank is reported to the parent, then exits 1)
        results.put((rank, False, traceback.format_exc()))
        os._exit(1)     # skip interpreter teardown: a half-dead process group can hang it
    # the value first: leaving an NCCL group can wait for the peers to leave it too, and rank 0 (an engine's
    # process) leaves only once it has every follower's value
    results.put((rank, True, value))
    G.teardown()


def _stop(procs, grace_s: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


class _Children:
    """Spawned ranks, their results queue, and the check of their exit codes."""

    def __init__(self, ranks, world, fn, args, backend, port, timeout_s, threads):
        ctx = mp.get_context("spawn")
        self.results = ctx.SimpleQueue()
        self.lock = threading.Lock()        # the watchdog thread and the caller both drain
        self.got: dict[int, tuple] = {}
        self.procs = {r: ctx.Process(target=_entry, daemon=True, name=f"tritune-tp-rank{r}",
                                     args=(r, world, backend, port, timeout_s, threads, fn, args, self.results))
                      for r in ranks}
        for p in self.procs.values():
            p.start()

    def drain(self) -> None:
        with self.lock:
            while not self.results.empty():
                rank, ok, value = self.results.get()
                self.got[rank] = (ok, value)

    def failure(self, grace_s: float = 2.0) -> RankFailed | None:
        """RankFailed for the ranks that exited non-zero (or sent an error), the likely first one named: when
        every failure so far is a Python error (often a collective broken by a peer that is dying), the
        ranks still running get up to ``grace_s`` to show their exit first."""
        err = self.found()
        deadline = time.monotonic() + grace_s
        while err is not None and err.error is not None and time.monotonic() < deadline and any(
                p.is_alive() for r, p in self.procs.items() if r not in err.failures):
            time.sleep(0.05)
            err = self.found()
        return err

    def found(self) -> RankFailed | None:
        """The failures seen now (see :meth:`failure`)."""
        self.drain()
        bad = {}
        for r, p in self.procs.items():
            ok, value = self.got.get(r, (True, None))
            if (p.exitcode not in (None, 0)) or not ok:
                bad[r] = (p.exitcode if p.exitcode is not None else 1, None if ok else value)
        if not bad:
            return None
        # a rank that died without a Python error (a signal, os._exit) caused the others' failed collectives
        first = min(bad, key=lambda r: (bad[r][1] is not None, r))
        return RankFailed(first, bad[first][0], bad[first][1], bad)

    def sent(self) -> bool:
        """Every rank has sent its value (it may still be leaving the group)."""
        self.drain()
        return set(self.got) >= set(self.procs)

    def done(self) -> bool:
        self.drain()
        return all(p.exitcode == 0 for p in self.procs.values()) and set(self.got) >= set(self.procs)

    def stop(self) -> None:
        _stop(list(self.procs.values()))
        self.drain()


def launch(n: int, fn, *args, backend: str = "gloo", timeout_s: float = 300.0,
           collective_timeout_s: float = G.DEFAULT_TIMEOUT_S, threads: int | None = 1) -> list:
    """``fn(group, *args)`` on ``n`` spawned ranks (``fn`` and ``args`` picklable: a module-level function);
    returns their results, rank 0's first (pickled back: plain values or numpy arrays; a tensor would travel
    through shared memory its exiting process takes away). A rank that fails raises :class:`RankFailed` (its exit code, its
    traceback when it raised) after the others are stopped; ranks still running after ``timeout_s`` are
    stopped and TimeoutError is raised. ``threads``: torch CPU threads per rank on gloo (None: torch's)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    kids = _Children(range(n), n, fn, args, backend, G.free_port(), collective_timeout_s, threads)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            err = kids.failure()
            if err is not None:
                kids.stop()         # (the ranks stopped here are not failures: err was taken before)
                raise err
            if kids.sent():     # every value is in; a rank still leaving its group gets a moment, then is stopped
                end = time.monotonic() + 5.0
                while not kids.done() and time.monotonic() < end:
                    time.sleep(0.05)
                return [kids.got[r][1] for r in range(n)]
            if time.monotonic() > deadline:
                alive = [r for r, p in kids.procs.items() if p.is_alive()]
                raise TimeoutError(f"launch: rank(s) {alive} still running after {timeout_s} s; stopped")
            time.sleep(0.05)
    finally:
        kids.stop()


class Workers:
    """Ranks 1..n-1 spawned to run ``fn(group, *args)``, while the caller joins the group as rank 0
    (:attr:`group`). A watchdog thread polls their exit codes: :meth:`check` raises :class:`RankFailed` once
    one has died (and ``on_failure(err)``, if given, is called from the watchdog when it sees it first)."""

    def __init__(self, n: int, fn, *args, backend: str = "gloo", timeout_s: float = G.DEFAULT_TIMEOUT_S,
                 threads: int | None = 1, on_failure=None, poll_s: float = 0.2):
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ValueError(f"n: expected an int >= 2 (rank 0 is this process), got {n!r}")
        port = G.free_port()
        self.kids = _Children(range(1, n), n, fn, args, backend, port, timeout_s, threads)
        self.failed: RankFailed | None = None
        self._closing = threading.Event()
        self._on_failure = on_failure
        try:
            self.group = G.init(n, 0, backend, port=port, timeout_s=timeout_s)
        except BaseException as e:
            # the rendezvous waits for every rank: a worker that died before joining ends it at the timeout
            err = self.kids.failure()
            self.kids.stop()
            if err is not None:
                raise err from e
            raise
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="tritune-tp-watchdog")
        self._thread.start()

    def _watch(self, poll_s: float) -> None:
        while not self._closing.wait(poll_s):
            err = self.kids.failure()
            if err is not None:
                self.failed = err
                if self._on_failure is not None:
                    self._on_failure(err)
                return

    def check(self) -> None:
        """Raise :class:`RankFailed` when a worker rank has died."""
        if self.failed is None:
            err = self.kids.failure()
            self.failed = err if err is not None and not self._closing.is_set() else self.failed
        if self.failed is not None:
            raise self.failed

    def wait_failure(self, grace_s: float = 3.0) -> None:
        """After a collective failed: raise :class:`RankFailed` if a worker died, waiting up to ``grace_s``
        for its exit to show (its sockets close a moment before its exit code can be read)."""
        deadline = time.monotonic() + grace_s
        while True:
            self.check()
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def results(self, timeout_s: float = 30.0) -> dict:
        """The workers' return values {rank: value}, waiting for them to exit (after rank 0 stopped them)."""
        deadline = time.monotonic() + timeout_s
        while not self.kids.sent():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers: not finished after {timeout_s} s")
            time.sleep(0.05)
        return {r: v for r, (ok, v) in self.kids.got.items()}

    def close(self) -> None:
        """Stop the watchdog and every worker still running; leave the group."""
        self._closing.set()
        self.kids.stop()
        G.teardown(G.TEARDOWN_TIMEOUT_S)
