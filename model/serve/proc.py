"""The serving engine in a process of its own: the API process parses, detokenizes and formats; the engine
process only steps.

Why: in one process the engine's host work (scheduling, sampling, the per-token stream callbacks) and the
event loop's (HTTP parsing, detokenizing, SSE formatting) take turns on one GIL, and each slows the other
(on an H100, HTTP served 37% of the in-process tokens/s that way). Split, each has a core of its own.

The shape (the idea of vLLM's AsyncLLM / EngineCore split, written for this engine):

- :class:`EngineProcess` (API process) spawns the engine process (``spawn``: CUDA does not survive a
  fork), which builds the engine from plain data (``builder``: "module:function" and its keyword
  arguments), reports the engine's config, warms it up, and then steps while anything is unfinished.
- Two Unix socket pairs, one per direction (``multiprocessing`` connections: pickled lists of
  operations). Each side writes through a sender thread, so neither blocks on the other: the engine never
  waits for HTTP (when the API process reads late, the steps queued meanwhile go out as one message), and
  the event loop never waits for the engine between its steps. The API process reads its end with a
  frame reader of its own, not ``Connection.recv``: uvloop (libuv's poll) puts a watched descriptor in
  non-blocking mode, and ``recv`` of a message whose body had not all arrived then raised
  ``BlockingIOError``, which read as the engine process's death (an H100 serve run lost 256 streams that
  way while the engine process was alive). A direction of its own per socket keeps the API's writes
  blocking on a descriptor the loop never touches.
- The event loop hands each operation to its sender thread at once; what piles up while the sender waits
  for the GIL or writes goes out as one message.
- API -> engine: ``add`` (request id: a small int, prompt ids, SamplingParams), ``abort`` (request id),
  ``stats``, ``call`` (run a function of the engine between steps, for benchmarks), ``stop``.
- Engine -> API: one ``step`` message per engine step, compact (:class:`_Core`: arrays of request ids,
  token counts and tokens; acceptances and ends beside them), and the engine's load (running, waiting, KV
  blocks in use). The API process keeps its Prometheus metrics from these: a scrape costs no round trip.
- Admission: while requests arrive, the engine process runs short decode runs and reads its pipe between
  them (``arrival_steps``), then goes back to the engine's ``decode_steps``.
- The engine process dying (a crash, the OOM killer, a kill) is seen at once (the socket's end of file and
  the process sentinel, both on the event loop): every open request ends with an error, new ones answer
  503, ``/health`` says why; the server stays up. Why is never silent: the engine process sends an
  exception that ends its loop (type, message, traceback) before it exits, ``faulthandler`` writes a fatal
  signal's stacks to a file the API process reads, and the exit code or the signal goes into ``/health``,
  the requests' error events and the log. The engine process ignores SIGINT (a terminal's Ctrl-C
  reaches the whole process group: the API process decides) and exits on ``stop`` or when the API process
  is gone (end of file), so no orphan is left behind.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import faulthandler
import importlib
import itertools
import logging
import math
import os
import pickle
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import weakref
from array import array

from tritune.model.serve.client import EngineClient, engine_load, error_text, note_news
from tritune.model.serve.steps import StepCollector

log = logging.getLogger("tritune.serve")

BUFFER = 4 << 20    # socket buffers: a step's message or a burst of prompts fits without a blocked write
TRACE = 4096        # admission trace: the last this many requests' times (API submit, engine add)


def resolve(path: str):
    """``"package.module:attr"`` -> the object (what crosses to a spawned process is a name, not code)."""
    mod, _, attr = path.partition(":")
    if not mod or not attr:
        raise ValueError(f"builder: expected 'module:function', got {path!r}")
    obj = importlib.import_module(mod)
    for a in attr.split("."):
        obj = getattr(obj, a)
    return obj


class _Sender:
    """Writes lists of operations on a connection from a thread of its own: ``put`` never blocks on the
    peer; what piles up while a write is in progress goes out as one message."""

    def __init__(self, conn, name: str):
        self.conn = conn
        self.ops: list = []
        self.cv = threading.Condition()
        self.closed = False
        self.broken = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, op) -> None:
        with self.cv:
            self.ops.append(op)
            self.cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.ops and not self.closed:
                    self.cv.wait()
                if not self.ops:
                    return
                ops, self.ops = self.ops, []
            try:
                self.conn.send(ops)
            except (OSError, ValueError):   # the peer is gone: its side notices on its own
                self.broken = True
                return


class _Frames:
    """Reads ``multiprocessing.Connection`` messages from a non-blocking descriptor: whatever has arrived,
    whole messages out, a partial one kept for the next call (``Connection.recv`` cannot: it raises
    ``BlockingIOError`` midway through a message and loses its place)."""

    CHUNK = 1 << 20

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()
        self.eof = False

    def read(self) -> list:
        """The messages complete so far (each a list of operations); ``eof`` is set at the end of file."""
        while True:
            try:
                chunk = os.read(self.fd, self.CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:         # ECONNRESET: the peer is gone
                self.eof = True
                break
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
            if len(chunk) < self.CHUNK:
                break
        out, buf, pos = [], self.buf, 0
        while len(buf) - pos >= 4:
            (n,), head = struct.unpack_from("!i", buf, pos), 4
            if n == -1:     # Connection's header for a message over 2 GiB
                if len(buf) - pos < 12:
                    break
                (n,), head = struct.unpack_from("!Q", buf, pos + 4), 12
            if len(buf) - pos < head + n:
                break
            out.append(pickle.loads(buf[pos + head:pos + head + n]))
            pos += head + n
        if pos:
            del buf[:pos]
        return out


def _big_buffers(*conns) -> None:
    for c in conns:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(c.fileno()))
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
            finally:
                s.close()


# ---------------------------------------------------------------------------------------------------
# The engine process
# ---------------------------------------------------------------------------------------------------
class _Req:
    __slots__ = ("id", "req", "sent")

    def __init__(self, rid, req):
        self.id, self.req, self.sent = rid, req, 0


ARRIVAL_STEPS = 2       # decode steps a run while requests are arriving (the pipe is read between runs)
ARRIVAL_QUIET_S = 0.02  # ... until no request has arrived for this long; then the engine's own decode_steps


class _Core(StepCollector):
    """The engine process's loop: take operations between steps, step while anything is unfinished, send
    one message per step.

    A step's message is ``("step", rids, counts, tokens, extras, load, steps)``: for each entry j, request
    ``rids[j]`` (the API process's integer id) got ``counts[j]`` tokens, the next ones of the flat
    ``tokens`` (arrays: pickled as bytes, no Python object per token); ``extras`` ({j: (prompt length when
    accepted, finish reason, error, output length)}) only for the entries with an acceptance or an end. A
    request may have several entries in one message (accepted, then its first tokens): in order.

    While requests arrive (one came within ``arrival_quiet_s``), decode runs are ``arrival_steps`` long,
    so that the next arrivals wait one short run for their ``add_request``, not a run of ``decode_steps``
    (an H100 run: 100-190 ms from the API's submit to the engine's add while 16-step runs went on)."""

    def __init__(self, engine, conn, out: _Sender, *, arrival_steps: int | None = ARRIVAL_STEPS,
                 arrival_quiet_s: float = ARRIVAL_QUIET_S):
        super().__init__(engine)
        self.conn, self.out = conn, out
        self.load = None
        self.adds: collections.deque = collections.deque(maxlen=TRACE)   # (request id, monotonic time)
        self._new_message()
        full = getattr(engine, "decode_steps", None)
        self.full_steps = full if isinstance(full, int) and not isinstance(full, bool) else None
        self.arrival_steps = None if self.full_steps is None or not arrival_steps else min(arrival_steps, full)
        self.arrival_quiet_s = arrival_quiet_s
        self.t_add = -math.inf
        self.short_runs = 0     # steps taken with arrival_steps

    def _new_message(self) -> None:
        self.rids, self.counts, self.toks, self.extras = array("q"), array("i"), array("i"), {}

    def run(self) -> None:
        eng = self.engine
        while True:
            busy = eng.has_unfinished()
            if self.conn.poll(0 if busy else 0.5) and not self._drain():
                return
            if eng.has_unfinished():
                self._run_length()
                self.step_once()
            self._flush()

    def _run_length(self) -> None:
        """The next decode run's length: short while requests arrive, the engine's own otherwise."""
        if self.arrival_steps is not None:
            short = time.monotonic() - self.t_add < self.arrival_quiet_s
            self.engine.decode_steps = self.arrival_steps if short else self.full_steps
            self.short_runs += short

    def _drain(self) -> bool:
        """Every operation waiting on the connection; False: stop (asked to, or the API process is gone)."""
        try:
            while self.conn.poll(0):
                for op in self.conn.recv():
                    if not self._op(op):
                        return False
        except (EOFError, OSError):
            return False
        return True

    # -- news into this step's message ---------------------------------------------------------------------
    def _collect(self, finished) -> None:
        """:meth:`StepCollector._collect` with the tokens written straight into the message's arrays (this
        runs for every running request after every step)."""
        live = self.live
        if not live:
            return
        rids, counts, toks = self.rids.append, self.counts.append, self.toks.extend
        for req in self._stepped(finished):
            r = live.get(req.id)
            if r is None:
                continue
            out = req.output_ids
            n = len(out)
            if n > r.sent:
                rids(r.id)
                counts(n - r.sent)
                toks(out[r.sent:])
                r.sent = n
            if req.finish_reason is not None:
                self._end(r, req.finish_reason, None if req.error is None else error_text(req.error))

    def _tokens(self, r, tokens) -> None:
        self.rids.append(r.id)
        self.counts.append(len(tokens))
        self.toks.extend(tokens)

    def _ended(self, r, finish, error, n_out) -> None:
        j = len(self.rids) - 1
        if j < 0 or self.rids[j] != r.id:   # no tokens in this step: an entry of its own
            self.rids.append(r.id)
            self.counts.append(0)
            j += 1
        self.extras[j] = (None, finish, error, n_out)

    def _event(self, rid, accepted, finish=None, error=None) -> None:
        self.extras[len(self.rids)] = (accepted, finish, error, 0)
        self.rids.append(rid)
        self.counts.append(0)

    def _op(self, op) -> bool:
        kind, eng = op[0], self.engine
        if kind == "add":
            _, rid, ids, sampling = op
            self.t_add = now = time.monotonic()
            self.adds.append((rid, now))
            try:
                req = eng.add_request(ids, sampling, request_id=rid)
            except (ValueError, TypeError) as e:
                self._event(rid, None, "rejected", str(e))
            except Exception as e:  # noqa: BLE001 (the engine's fault, not the request's: a 500 for it alone)
                log.exception("add_request failed")
                self._event(rid, None, "error", error_text(e))
            else:
                self.live[rid] = _Req(rid, req)
                self._event(rid, len(req.prompt_ids))
        elif kind == "abort":
            self._abort(op[1])
        elif kind == "stats":
            self._flush()       # what it reports is at least as new as the last step message
            self.out.put(("stats", op[1], self.stats()))
        elif kind == "trace":
            self.out.put(("stats", op[1], list(self.adds)))
        elif kind == "call":
            _, token, fn, args = op
            self._flush()
            try:
                self.out.put(("result", token, True, resolve(fn)(eng, *args)))
            except Exception as e:  # noqa: BLE001 (the caller gets the error)
                self.out.put(("result", token, False, error_text(e)))
        elif kind == "stop":
            return False
        return True

    def stats(self) -> dict:
        eng = self.engine
        extra = getattr(eng, "stats", None)
        return {**engine_load(eng), "steps": self.steps, "live": len(self.live), "pid": os.getpid(),
                "unfinished": bool(eng.has_unfinished()), "short_runs": self.short_runs,
                "engine_stats": dict(extra) if isinstance(extra, dict) else None}

    def _flush(self) -> None:
        load = engine_load(self.engine)
        if not self.rids and load == self.load:
            return
        self.load = load
        msg = ("step", self.rids, self.counts, self.toks, self.extras, load, self.steps)
        self._new_message()
        self.out.put(msg)


def _engine_main(conn, out_conn, builder: str, kwargs: dict, warm_up: str | None, fault_path: str,
                 core_kw: dict | None = None) -> None:
    """The engine process's entry point: ``conn`` brings operations, ``out_conn`` takes what it sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="engine process: %(levelname)s %(message)s")
    # A fatal signal (SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL) writes every thread's stack here; the API
    # process reads it when this process is gone, logs it (stderr) and says it on /health.
    fault = open(fault_path, "w")   # noqa: SIM115 (open for the process's life: faulthandler keeps its fd)
    faulthandler.enable(file=fault, all_threads=True)
    out = _Sender(out_conn, "tritune-engine-send")
    code = 0
    try:
        try:
            engine = resolve(builder)(**kwargs)
        except BaseException as e:  # noqa: BLE001 (reported to the API process, which says it once)
            out.put(("failed", type(e).__name__, str(e)))
            return
        out.put(("info", {"config": engine.config, "max_num_seqs": getattr(engine, "max_num_seqs", 256),
                          "describe": engine.describe(), "backend": getattr(engine.model, "backend", None),
                          "pid": os.getpid(), "load": engine_load(engine)}))
        core = _Core(engine, conn, out, **(core_kw or {}))
        if warm_up:
            try:
                resolve(warm_up)(engine)
            except Exception as e:  # noqa: BLE001 (the server says so on /health, and answers 503)
                log.exception("warm-up failed")
                out.put(("warm_failed", error_text(e)))
                while core._drain():    # stats and stop only: no request is ever sent to a failed engine
                    conn.poll(0.5)
                return
        out.put(("ready", engine_load(engine)))
        core.run()
    except BaseException as e:  # noqa: BLE001 (anything that ends the loop: said, then the process exits 1)
        code = 1
        tb = traceback.format_exc()
        with contextlib.suppress(Exception):
            fault.write(tb)
            fault.flush()
        sys.stderr.write(f"engine process: the loop ended with {type(e).__name__}\n{tb}")
        out.put(("fatal", type(e).__name__, str(e), tb))
    finally:
        out.close()
    if code:
        # the loop failed: exit at once, without the interpreter's teardown (torch's, the engine's threads),
        # which under load took seconds before the API process could read the exit code
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            fault.flush()
        os._exit(code)


def _describe_exit(code) -> str:
    if code is None:
        return "exit status not known yet"
    if code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-code).name
            hint = " (as the OOM killer ends a process: see dmesg)" if -code == signal.SIGKILL else ""
            return f"killed by signal {name} ({-code}){hint}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


# ---------------------------------------------------------------------------------------------------
# The API process's handle
# ---------------------------------------------------------------------------------------------------
class EngineStartError(RuntimeError):
    pass


def _reap(process, *conns) -> None:
    """At exit (or when the handle is dropped without stop()): no engine process outlives its server."""
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.close()
    if process.is_alive():
        process.join(2)
    if process.is_alive():
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join(5)


class EngineProcess(EngineClient):
    """The engine in a spawned process, behind the :class:`~tritune.model.serve.client.EngineClient`
    interface (the server's view of an engine wherever it runs).

    ``builder``: "module:function" called in the engine process with ``kwargs`` (plain data) to build the
    engine; ``warm_up``: "module:function" called there with the engine before the first request. The
    constructor returns once the engine is built (its config is needed to parse requests); the warm-up
    runs on while the server listens (``warming`` says so)."""

    is_engine_process = True
    mode = "process"

    def __init__(self, builder: str, kwargs: dict | None = None, *, warm_up: str | None = None,
                 start_timeout: float = 900.0, arrival_steps: int | None = ARRIVAL_STEPS,
                 arrival_quiet_s: float = ARRIVAL_QUIET_S):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child_in = ctx.Pipe(duplex=True)     # API -> engine (blocking on both ends)
        self._up, child_out = ctx.Pipe(duplex=True)      # engine -> API (non-blocking here once started)
        _big_buffers(self._conn, child_in, self._up, child_out)
        fd, self.fault_path = tempfile.mkstemp(prefix="tritune-engine-", suffix=".fault")
        os.close(fd)
        self.process = ctx.Process(target=_engine_main, args=(child_in, child_out, builder, dict(kwargs or {}),
                                                              warm_up, self.fault_path,
                                                              {"arrival_steps": arrival_steps,
                                                               "arrival_quiet_s": arrival_quiet_s}),
                                    name="tritune-engine")
        self.process.start()
        child_in.close()
        child_out.close()
        self._finalizer = weakref.finalize(self, _reap, self.process, self._conn, self._up)
        self.fatal: tuple | None = None     # (type, message, traceback) the engine process sent as it ended
        self.death: dict | None = None      # why it is gone: exit code, signal, error, stacks (/health)
        self._frames = None
        self.trace: collections.deque = collections.deque(maxlen=TRACE)  # (request id, arrival, submit)
        self.metrics = None
        self.in_flight = 0
        self.steps = 0
        self.down: str | None = None        # why the engine process is gone
        self.warming: str | None = "warming up" if warm_up else None
        self._seqs: dict = {}               # wire id -> client.Seq, until its end is delivered
        self._wire = itertools.count(1)     # the engine process's request ids: small ints (cheap to send)
        self._waiters: dict = {}            # token -> Future (stats, call)
        self._tokens = itertools.count()
        self._loop = None
        self._sender = None
        self._early: list = []              # operations read before the event loop took over
        info = self._wait_info(start_timeout)
        self.info = info
        self.config = info["config"]
        self.max_num_seqs = info["max_num_seqs"]
        self.pid = info["pid"]
        self.load = info["load"]

    # -- start-up and shutdown --------------------------------------------------------------------------
    def _wait_info(self, timeout: float) -> dict:
        t0 = time.monotonic()
        while True:
            if self._up.poll(0.2):
                try:
                    ops = self._up.recv()
                except (EOFError, OSError):
                    ops = []
                for op in ops:
                    if op[0] == "fatal":
                        self.fatal = op[1:]
                    if op[0] == "failed":
                        self._finalizer()
                        _, kind, msg = op
                        if kind in ("FileNotFoundError", "NotADirectoryError", "ValueError", "TypeError"):
                            raise ValueError(msg)
                        raise EngineStartError(f"the engine process could not build the engine: {kind}: {msg}")
                    if op[0] == "info":
                        self._early.extend(ops[ops.index(op) + 1:])
                        return op[1]
                if not ops and not self.process.is_alive():
                    break
            elif not self.process.is_alive():
                break
            if time.monotonic() - t0 > timeout:
                self._finalizer()
                raise EngineStartError(f"the engine process was not ready within {timeout:g} s")
        self.process.join(5)
        why = _describe_exit(self.process.exitcode)
        if self.fatal:
            why += f": {self.fatal[0]}: {self.fatal[1]}"
        stacks = self._fault_text()
        self._finalizer()
        raise EngineStartError(f"the engine process exited ({why}) before it was ready"
                               + (f"\n{stacks}" if stacks else ""))

    def _fault_text(self) -> str:
        """What faulthandler (a fatal signal's stacks) or the loop's last exception wrote to the file."""
        try:
            with open(self.fault_path, errors="replace") as f:
                return f.read(64 << 10).strip()
        except OSError:
            return ""

    def describe(self) -> dict:
        return dict(self.info["describe"], engine="process", engine_pid=self.pid)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take over the connection on ``loop`` (the server's lifespan start-up)."""
        self._loop = loop
        self._sender = _Sender(self._conn, "tritune-api-send")
        for op in self._early:
            self._handle(op)
        self._early = []
        os.set_blocking(self._up.fileno(), False)     # what uvloop does anyway; asyncio's loop the same
        self._frames = _Frames(self._up.fileno())
        loop.add_reader(self._up.fileno(), self._readable)
        loop.add_reader(self.process.sentinel, self._on_exit)
        self._readable()        # what came before the reader was installed

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop (after its step), then make sure it has: no orphan."""
        self._detach()
        if self._sender is not None:
            self._sender.put(("stop",))
            self._sender.close(2)
        else:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send([("stop",)])
        self.process.join(timeout if self.warming is None else 2)   # a warm-up reads nothing until done
        self._finalizer()
        if self.down is None:
            self.down = "stopped"
        self._fail_open("the server is shutting down")
        with contextlib.suppress(OSError):
            os.unlink(self.fault_path)

    def _detach(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._up.fileno())
            with contextlib.suppress(Exception):
                loop.remove_reader(self.process.sentinel)

    @property
    def alive(self) -> bool:
        return self.down is None and self._loop is not None and self.process.is_alive()

    def health(self) -> dict:
        out = {"engine_pid": self.pid}
        if self.death is not None:      # exit code / signal, the loop's exception, fatal-signal stacks
            out["engine_death"] = self.death
        return out

    # -- requests (event-loop thread) -------------------------------------------------------------------
    def submit(self, items) -> None:
        """``items``: (seq, prompt ids, SamplingParams); each is accepted or rejected on its sink."""
        now = time.perf_counter()
        for seq, ids, sampling in items:
            seq.key = wid = next(self._wire)
            self._seqs[wid] = seq
            self.in_flight += 1
            self._post(("add", wid, ids, sampling))
            self.trace.append((wid, seq.t_arrival, now))

    def abort(self, seq) -> None:
        if not seq.done and self._sender is not None and self.down is None:
            self._post(("abort", seq.key))

    def _post(self, op) -> None:
        """Hand ``op`` to the sender thread now. It writes whatever piled up while it waited for the GIL
        as one message: during a burst, the event loop's handlers hold the GIL and the sender sends every
        switch interval (5 ms). (Queued with ``call_soon`` for the end of the tick instead, the ops of a
        burst waited behind every handler the burst had made ready: 200 ms for 500 requests.)"""
        self._sender.put(op)

    async def stats(self, timeout: float = 10.0) -> dict:
        """A fresh account from the engine process (one round trip)."""
        return await self._ask(("stats",), timeout)

    async def call(self, fn: str, *args, timeout: float = 600.0):
        """``fn(engine, *args)`` in the engine process, between two steps ("module:function"; the
        arguments and the result are pickled)."""
        return await self._ask(("call", fn, args), timeout)

    async def admission_trace(self, timeout: float = 10.0) -> list:
        """The engine process's (request id, monotonic time of add_request) of its last requests; with
        ``trace`` (request id, arrival, submit: perf_counter, the same clock on Linux) the admission ramp."""
        return await self._ask(("trace",), timeout)

    def run_sync(self, coro, timeout: float = 700.0):
        """Run one of the coroutines above from a thread other than the event loop's."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _ask(self, op, timeout: float):
        if self.down is not None:
            raise RuntimeError(f"the engine process is down: {self.down}")
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._waiters[token] = fut
        self._post((op[0], token, *op[1:]))     # after the adds and aborts posted before it, in order
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._waiters.pop(token, None)

    # -- what the engine process sends (event-loop thread) ----------------------------------------------
    def _readable(self) -> None:
        for ops in self._frames.read():
            for op in ops:
                self._handle(op)
        if self._frames.eof:
            self._on_exit()

    def _handle(self, op) -> None:
        kind = op[0]
        if kind == "step":
            self._on_step(op[1], op[2], op[3], op[4])
            self.load, self.steps = op[5], op[6]
        elif kind == "stats":
            fut = self._waiters.get(op[1])
            if fut is not None and not fut.done():
                fut.set_result(op[2])
        elif kind == "result":
            fut = self._waiters.get(op[1])
            if fut is not None and not fut.done():
                if op[2]:
                    fut.set_result(op[3])
                else:
                    fut.set_exception(RuntimeError(op[3]))
        elif kind == "ready":
            self.warming = None
            self.load = op[1]
        elif kind == "warm_failed":
            self.warming = f"warm-up failed: {op[1]}"
        elif kind == "fatal":
            self.fatal = tuple(op[1:])
            log.error("the engine process's loop ended with %s: %s\n%s", *self.fatal)

    def _on_step(self, rids, counts, toks, extras) -> None:
        """One step's message (see :class:`_Core`): each request's tokens to its job's sink."""
        now, m, seqs = time.perf_counter(), self.metrics, self._seqs
        pos = 0
        for j, rid in enumerate(rids):
            k = counts[j]
            tokens = toks[pos:pos + k].tolist()
            pos += k
            seq = seqs.get(rid)
            if seq is None:
                continue
            accepted = finish = error = None
            n_out = 0
            if extras:
                x = extras.get(j)
                if x is not None:
                    accepted, finish, error, n_out = x
                    if accepted is not None:
                        seq.accepted, seq.n_prompt = True, accepted
                        if m:
                            m.prompt_tokens.inc(accepted)
            note_news(seq, m, now, k, finish, n_out)
            if finish is not None:
                del seqs[rid]
                seq.done = True
                self.in_flight -= 1
            seq.sink.put_nowait((seq.index, accepted, tokens, finish, error))

    def _on_exit(self) -> None:
        """The engine process has exited (its sentinel) or closed its connection (end of file; it is
        exiting): end everything open at once, with the reason; the exit status is added when known."""
        if self.death is not None:
            if self.death["exit_code"] is None and not self.process.is_alive():
                self.process.join(0.1)
                self._record_death()    # the sentinel after the end of file: now the exit status is known
            self._detach_conn()
            return
        if self._frames is not None:
            for ops in self._frames.read():    # its last messages first (a "fatal" among them)
                for op in ops:
                    self._handle(op)
        self.process.join(0.5)
        self._record_death()
        self._detach_conn()
        self._fail_open(self.down)

    def _record_death(self) -> None:
        code = self.process.exitcode
        stacks = self._fault_text()
        if self.fatal:
            error = f"{self.fatal[0]}: {self.fatal[1]}"
        else:
            lines = stacks.splitlines()
            error = lines[0] if lines and lines[0].startswith("Fatal Python error") else None
        sig = None
        if code is not None and code < 0:
            with contextlib.suppress(ValueError):
                sig = signal.Signals(-code).name
        self.death = {"exit_code": code, "signal": sig, "how": _describe_exit(code), "error": error,
                      "traceback": self.fatal[2] if self.fatal else None, "faulthandler": stacks or None}
        self.down = (f"the engine process died ({self.death['how']})" + (f": {error}" if error else "")
                     + "; restart the server")
        log.error("%s%s", self.down, f"\n{stacks}" if stacks else "")

    def _detach_conn(self) -> None:
        """Stop reading the connection (its end of file would fire the reader forever); the sentinel
        stays watched until the process has exited, for its exit status."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(Exception):
                loop.remove_reader(self._up.fileno())
            if not self.process.is_alive():
                with contextlib.suppress(Exception):
                    loop.remove_reader(self.process.sentinel)

    def _fail_open(self, error: str) -> None:
        for seq in list(self._seqs.values()):
            seq.done = True
            self.in_flight -= 1
            if self.metrics:
                self.metrics.requests.labels("error").inc()
            seq.sink.put_nowait((seq.index, None, [], "error", error))
        self._seqs.clear()
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(RuntimeError(error))


# ---------------------------------------------------------------------------------------------------
# Builders (what `tritune serve` and the benchmarks run in the engine process)
# ---------------------------------------------------------------------------------------------------
def model_engine(*, model: str, backend: str, dtype: str, engine: dict, tokenizer: bool = True):
    """An :class:`~tritune.model.engine.engine.Engine` over any family's checkpoint
    (:func:`tritune.model.load.load_model`: GPT-2, Llama, Qwen2/3, Mistral, quantized GPT-2) from plain data
    (``dtype``: a torch dtype's name)."""
    import torch

    import tritune.kernels.runtime  # noqa: F401  (the interpreter switch before triton loads, on the CPU)
    from tritune.model.engine.engine import Engine
    from tritune.model.load import load_model, set_cpu_threads
    from tritune.model.tokenizer import Tokenizer

    set_cpu_threads()       # the CPU's cores are shared with the API process
    m = load_model(model, backend=backend, dtype=getattr(torch, dtype))
    tok = Tokenizer.from_dir(m.directory) if tokenizer else None
    return Engine(m, tokenizer=tok, **engine)


gpt2_engine = model_engine      # the name engine processes were started by before other families ran


def stub_engine(**kw):
    """The stub engine (:class:`tritune.model.serve.stub.StubEngine`: tokens at a fixed rate, no model)."""
    from tritune.model.serve.stub import StubEngine

    return StubEngine(**kw)


def crash(engine, code: int = 1):
    """For tests: the engine process dies at once, between two steps, as a crash would end it."""
    os._exit(code)
