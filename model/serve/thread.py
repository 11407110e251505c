"""The engine in a thread of the server's process (``tritune serve --engine thread``, the default on the
CPU): :class:`ThreadEngineClient` runs ``engine.step()`` in one dedicated thread; the event loop submits
and aborts, never steps. Each step's news goes to the event loop at once, one wake-up per step."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque

from tritune.model.serve.client import EngineClient, Seq, engine_load, note_news
from tritune.model.serve.steps import StepCollector

log = logging.getLogger("tritune.serve")


class ThreadEngineClient(StepCollector, EngineClient):
    """Runs ``engine.step()`` in one dedicated thread; the event loop submits and aborts, never steps.
    (``live`` and ``dirty`` belong to the engine thread.)"""

    mode = "thread"

    def __init__(self, engine, metrics=None):
        super().__init__(engine)
        self.dirty: list = []               # requests with news since the last hand-over
        self.metrics = metrics
        self.load = engine_load(engine)     # replaced (not mutated) after each step: readers need no lock
        self.in_flight = 0                  # event-loop side: submitted and not yet ended
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread = None
        self._loop = None

    # -- event-loop side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tritune-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @contextlib.contextmanager
    def paused(self):
        """The engine to the caller's thread for a while: the loop thread stops after its step, and
        starts again afterwards (requests submitted meanwhile wait in the inbox)."""
        loop = self._loop
        self.stop()
        try:
            yield self.engine
        finally:
            self.start(loop)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def config(self):
        return self.engine.config

    @property
    def max_num_seqs(self) -> int:
        return getattr(self.engine, "max_num_seqs", 256)

    def describe(self) -> dict:
        return dict(self.engine.describe(), engine="thread")

    async def stats(self, timeout: float = 10.0) -> dict:
        """The engine's account as of its last step (read without stopping it: the counters are ints)."""
        extra = getattr(self.engine, "stats", None)
        return {**self.load, "steps": self.steps, "live": len(self.live), "in_flight": self.in_flight,
                "engine_stats": dict(extra) if isinstance(extra, dict) else None}

    def submit(self, items) -> None:
        """``items``: (seq, prompt ids, SamplingParams); each is accepted or rejected on the sink."""
        for seq, ids, sampling in items:
            self._inbox.append(("add", seq, ids, sampling))
            self.in_flight += 1
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        if not seq.done:
            self._inbox.append(("abort", seq))
            self._wake.set()

    def _deliver(self, batch) -> None:
        for seq, accepted, tokens, finish, error in batch:
            if finish is not None:
                seq.done = True
                self.in_flight -= 1
            seq.sink.put_nowait((seq.index, accepted, tokens, finish, error))

    # -- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            try:
                if not self._inbox and not eng.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._drain()
                if eng.has_unfinished():
                    self.step_once()
                self.load = engine_load(eng)
                self._flush()
            except Exception:  # noqa: BLE001 (a thread that died would leave every request waiting forever)
                log.exception("engine loop error")
                time.sleep(0.01)

    def _drain(self) -> None:
        eng = self.engine
        while self._inbox:
            op = self._inbox.popleft()
            seq = op[1]
            if op[0] == "abort":
                if seq.finish is None and seq.accepted:
                    self._abort(seq.id)
                continue
            _, _, ids, sampling = op
            try:
                req = eng.add_request(ids, sampling, request_id=seq.id)
            except (ValueError, TypeError) as e:
                seq.finish, seq.error = "rejected", str(e)
            except Exception as e:  # noqa: BLE001 (the engine's fault, not the request's: a 500 for it alone)
                log.exception("add_request failed")
                seq.finish, seq.error = "error", f"{type(e).__name__}: {e}"
            else:
                seq.accepted, seq.n_prompt, seq.req = True, len(req.prompt_ids), req
                self.live[seq.id] = seq
                if self.metrics:
                    self.metrics.prompt_tokens.inc(seq.n_prompt)
            self._mark(seq)

    def _mark(self, seq: Seq) -> None:
        if not seq.dirty:
            seq.dirty = True
            self.dirty.append(seq)

    def _tokens(self, seq: Seq, tokens: list) -> None:
        seq.new += tokens
        self._mark(seq)

    def _ended(self, seq: Seq, finish: str, error, n_out: int) -> None:
        if seq.finish is None:
            seq.finish, seq.error = finish, error
        seq.n_out = n_out
        self._mark(seq)

    def _flush(self) -> None:
        if not self.dirty:
            return
        now, m = time.perf_counter(), self.metrics
        batch = []
        for seq in self.dirty:
            seq.dirty = False
            tokens, seq.new = seq.new, []
            note_news(seq, m, now, len(tokens), seq.finish, seq.n_out)
            accepted = None     # the prompt's length, once, when the engine took the request
            if seq.accepted and not seq.announced:
                seq.announced, accepted = True, seq.n_prompt
            batch.append((seq, accepted, tokens, seq.finish, seq.error))
        self.dirty = []
        try:
            self._loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:    # the event loop has closed (shutting down)
            pass


EngineLoop = ThreadEngineClient     # its name before the engine clients had one interface
