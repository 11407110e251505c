"""The server's one view of an engine: :class:`EngineClient`, with two implementations, the engine in a
thread of the server's process (:class:`tritune.model.serve.thread.ThreadEngineClient`) and in a process of
its own (:class:`tritune.model.serve.proc.EngineProcess`).

The HTTP side never touches the engine: it submits (:class:`Seq`, prompt ids, SamplingParams) items and
aborts them; each item's news (accepted, tokens, end) arrives on its ``Seq.sink``, an ``asyncio.Queue``
of the event loop, as ``(index, accepted prompt length or None, tokens, finish reason or None, error)``:
that queue is the request's stream. Everything here runs on the event loop's thread except where a
class says otherwise.
"""
from __future__ import annotations

import abc
import asyncio


class Seq:
    """One engine request of an HTTP request (a prompt of a list has one each); what the engine side
    collected for it since the last hand-over."""
    __slots__ = ("id", "key", "index", "sink", "new", "accepted", "finish", "error", "n_prompt", "n_out",
                 "t_arrival", "t_first", "dirty", "announced", "done", "req", "sent")

    def __init__(self, rid: str, index: int, sink: asyncio.Queue, t_arrival: float):
        self.id, self.index, self.sink, self.t_arrival = rid, index, sink, t_arrival
        self.new: list[int] = []
        self.accepted = False       # set once by the engine side, handed over once
        self.finish = self.error = None
        self.n_prompt = self.n_out = 0
        self.t_first = None
        self.dirty = False
        self.announced = False      # its acceptance has been handed over
        self.done = False           # event-loop side: its end has been delivered
        self.key = rid              # the engine process's id for it (a small int: EngineProcess.submit)
        self.req = None             # the engine's request (engine thread)
        self.sent = 0               # its output tokens collected so far (engine thread)


class EngineClient(abc.ABC):
    """What the server uses of an engine, wherever it runs.

    Attributes every implementation keeps: ``mode`` ("thread" or "process"), ``config`` (the model's),
    ``max_num_seqs``, ``load`` (the engine's occupancy after its last step: ``running``, ``waiting``,
    ``kv_blocks_used``, ``kv_blocks_total``, and the engine counters of :data:`LOAD_COUNTERS` it has;
    replaced, never mutated, so a reader needs no lock), ``in_flight`` (submitted and not ended),
    ``steps``, ``metrics`` (the server's :class:`tritune.model.serve.metrics.Metrics`, set by the server),
    ``warming`` ("warming up", "warm-up failed: ..." or None) and ``down`` (why the engine is gone, or
    None)."""

    mode = "?"
    metrics = None
    warming: str | None = None
    down: str | None = None

    @abc.abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin stepping and delivering to ``loop`` (the app's lifespan start-up)."""

    @abc.abstractmethod
    def submit(self, items) -> None:
        """``items``: (Seq, prompt ids, SamplingParams); each is accepted or rejected on its sink."""

    @abc.abstractmethod
    def abort(self, seq: Seq) -> None:
        """End ``seq`` at the engine's next step (nothing if it has ended)."""

    @abc.abstractmethod
    async def stats(self, timeout: float = 10.0) -> dict:
        """A fresh account of the engine: its load, steps, and the engine's own ``stats`` dict."""

    @abc.abstractmethod
    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping (the app's lifespan shutdown); requests still open end."""

    def close(self) -> None:
        self.stop()

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether submitted requests will be served."""

    @abc.abstractmethod
    def describe(self) -> dict:
        """The engine's description (backend, dtype, device, ...)."""

    def health(self) -> dict:
        """Fields of this implementation for ``/health`` beyond the common ones."""
        return {}


# Engine counters (``engine.stats`` keys) that travel with the load after every step, for /metrics: a
# dict read per step, no round trip to the engine.
LOAD_COUNTERS = ("spec_skipped_rows", "spec_over_batch_steps", "request_errors")


def engine_load(engine) -> dict:
    """The engine's occupancy (requests running and waiting, KV blocks in use) and the counters of
    :data:`LOAD_COUNTERS` it keeps, read between steps."""
    pool, sch = getattr(engine, "pool", None), getattr(engine, "scheduler", None)
    load = {"running": len(getattr(sch, "running", ())), "waiting": len(getattr(sch, "waiting", ())),
            "kv_blocks_used": getattr(pool, "num_used", None), "kv_blocks_total": getattr(pool, "num_blocks", None)}
    stats = getattr(engine, "stats", None)
    if isinstance(stats, dict):
        for k in LOAD_COUNTERS:
            if k in stats:
                load[k] = stats[k]
    return load


def note_news(seq, metrics, now: float, n_tokens: int, finish, n_out: int) -> None:
    """A request's news from one step, on the API side: its first token's time (TTFT), its tokens, its end
    (by finish reason, with its mean time per token after the first). A request the engine rejected never
    ran: its 400 is counted among the HTTP errors, not here."""
    if n_tokens and seq.t_first is None:
        seq.t_first = now
        if metrics:
            metrics.ttft.observe(now - seq.t_arrival)
    if not metrics:
        return
    if n_tokens:
        metrics.generation_tokens.inc(n_tokens)
    if finish is not None and finish != "rejected":
        metrics.requests.labels(finish).inc()
        if seq.t_first is not None and n_out > 1:
            metrics.tpot.observe((now - seq.t_first) / (n_out - 1))


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
