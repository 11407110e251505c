"""``tritune serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one shared :class:`Engine`.

The engine runs in a process of its own (:mod:`tritune.model.serve.proc`, ``--engine process``, the
default on a GPU: the engine's host work and the event loop's do not share a GIL), or in a thread of this
process (:class:`EngineLoop`, ``--engine thread``): either takes new requests and aborts between steps, runs
``engine.step()`` while anything is unfinished, and hands each step's new tokens to the event loop at once
(one wake-up per step, not one per token). Continuous batching across HTTP requests is the engine's own;
handlers only parse, tokenize, detokenize and format, and never touch the engine. A stream's writer sends
everything its request got since it last wrote as one chunk: when the server falls behind, chunks grow
(several tokens each) instead of the engine waiting for HTTP.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (when the checkpoint's
``tokenizer_config.json`` has a chat template), ``GET /v1/models``, ``GET /health`` (JSON, with the KV blocks
in use: a leak shows there), ``GET /metrics`` (Prometheus text).
Start-up: the port opens at once; a warm-up (on a GPU: compiling the kernel variants, capturing the CUDA
graphs, minutes on a cold compile cache) runs beside it, and until it has finished ``/health`` and every
generation answer 503 ("warming up", with Retry-After), so a client or a load balancer waits on /health. Beyond OpenAI's fields: ``top_k``,
``ignore_eos``, and ``return_token_ids`` (each choice, and each streamed chunk, carries its token ids).
A client that disconnects aborts its requests at the engine's next step, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import secrets
import sys
import threading
import time
import uuid
from collections import deque

from tritune.model.serve.proc import StepCollector, engine_load, note_news

log = logging.getLogger("tritune.serve")

OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}   # the API's defaults for absent fields
MAX_STOPS = 16


class APIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, *, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------------------------------
# The engine thread
# ---------------------------------------------------------------------------------------------------
class Seq:
    """One engine request of an HTTP request (a prompt of a list has one each); what the engine thread
    collected for it since the last hand-over."""
    __slots__ = ("id", "key", "index", "sink", "new", "accepted", "finish", "error", "n_prompt", "n_out",
                 "t_arrival", "t_first", "dirty", "announced", "done", "req", "sent")

    def __init__(self, rid: str, index: int, sink: asyncio.Queue, t_arrival: float):
        self.id, self.index, self.sink, self.t_arrival = rid, index, sink, t_arrival
        self.new: list[int] = []
        self.accepted = False       # set once by the engine thread, handed over once
        self.finish = self.error = None
        self.n_prompt = self.n_out = 0
        self.t_first = None
        self.dirty = False
        self.announced = False      # its acceptance has been handed over
        self.done = False           # event-loop side: its end has been delivered
        self.key = rid              # the engine process's id for it (an int: serve_proc.EngineProcess.submit)
        self.req = None             # the engine's request (engine thread)
        self.sent = 0               # its output tokens collected so far (engine thread)




class EngineLoop(StepCollector):
    """Runs ``engine.step()`` in one dedicated thread; the event loop submits and aborts, never steps.
    (``live`` and ``dirty`` belong to the engine thread.)"""

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


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics in a registry of their own (several apps may live in one process)."""

    def __init__(self, server: "Server"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("tritune_requests", "Engine requests ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.http_errors = Counter("tritune_http_errors", "Requests answered with an error, by status", ["status"],
                                   registry=r)
        self.prompt_tokens = Counter("tritune_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("tritune_generation_tokens", "Tokens generated", registry=r)
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("tritune_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=lat, registry=r)
        self.tpot = Histogram("tritune_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28),
                              registry=r)
        for name, doc, key in (("tritune_requests_running", "Requests in the running batch", "running"),
                               ("tritune_requests_waiting", "Requests queued in the engine", "waiting"),
                               ("tritune_kv_blocks_used", "KV cache blocks in use", "kv_blocks_used"),
                               ("tritune_kv_blocks_total", "KV cache blocks in the pool", "kv_blocks_total")):
            Gauge(name, doc, registry=r).set_function(lambda k=key: server.loop.load.get(k) or 0)
        Gauge("tritune_requests_in_flight", "Engine requests submitted and not ended (the queue bound counts "
              "these)", registry=r).set_function(lambda: server.loop.in_flight)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---------------------------------------------------------------------------------------------------
# Text out: incremental detokenization and stop strings
# ---------------------------------------------------------------------------------------------------
class TextOut:
    """One choice's text as its tokens arrive: drops EOS; cuts at the first stop string, holding back any
    tail that could begin one. Decodes a window of tokens that grows to WINDOW and then restarts a few
    tokens back (context for tokenizers whose first token decodes differently), so a token costs O(1),
    not O(length), and a delivery costs one decode: the text of the window decoded last time is its
    emitted prefix (a window ending in an incomplete character is not taken until it completes)."""

    WINDOW, CONTEXT = 64, 4

    def __init__(self, tokenizer, stops=(), eos: int | None = None):
        self.tok, self.stops, self.eos = tokenizer, tuple(stops), eos
        self.ids: list[int] = []
        self.prefix = 0         # the window: ids[prefix:]
        self.done = 0           # characters of the window's text already taken
        self.pending = ""
        self.stopped = False

    def feed(self, tokens) -> str:
        if self.stopped:
            return ""
        if self.eos is not None and self.eos in tokens:
            tokens = tokens[:tokens.index(self.eos)]
        if not tokens:
            return ""
        self.ids.extend(tokens)
        return self._emit(self._piece(final=False), final=False)

    def finish(self) -> str:
        """The rest at the end (a trailing incomplete character included, as the replacement char)."""
        return "" if self.stopped else self._emit(self._piece(final=True), final=True)

    def _piece(self, final: bool) -> str:
        full = self.tok.decode(self.ids[self.prefix:])
        if len(full) <= self.done or (full.endswith("\ufffd") and not final):
            return ""
        piece, self.done = full[self.done:], len(full)
        if len(self.ids) - self.prefix > self.WINDOW:     # restart the window a few tokens back
            self.prefix = len(self.ids) - self.CONTEXT
            self.done = len(self.tok.decode(self.ids[self.prefix:]))
        return piece

    def _emit(self, piece: str, final: bool) -> str:
        self.pending += piece
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        keep = 0 if final else max((k for s in self.stops for k in range(1, min(len(s), len(self.pending) + 1))
                                    if self.pending.endswith(s[:k])), default=0)
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out


def load_chat_template(directory) -> str | None:
    """The chat template of a checkpoint (``tokenizer_config.json``'s ``chat_template``), if any."""
    from pathlib import Path

    if directory is None:
        return None
    f = Path(directory) / "tokenizer_config.json"
    try:
        t = json.loads(f.read_text()).get("chat_template") if f.is_file() else None
    except (OSError, ValueError):
        return None
    if isinstance(t, list):     # named templates: take the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t.strip() else None


# ---------------------------------------------------------------------------------------------------
# Request bodies (pydantic, built on first use so `tritune` runs without the serve extra)
# ---------------------------------------------------------------------------------------------------
@functools.cache
def _bodies():
    from pydantic import BaseModel, ConfigDict

    class Common(BaseModel):
        # strict: "5" is not a number; unknown fields are ignored (clients send fields of newer APIs)
        model_config = ConfigDict(strict=True, extra="ignore")
        model: str | None = None
        max_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None            # extension
        stop: str | list[str] | None = None
        seed: int | None = None
        n: int | None = 1
        stream: bool | None = False
        stream_options: dict | None = None
        presence_penalty: float | None = 0.0
        frequency_penalty: float | None = 0.0
        logit_bias: dict | None = None
        user: str | None = None
        ignore_eos: bool | None = False     # extension: run to max_tokens
        return_token_ids: bool | None = False   # extension

    class Completion(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        logprobs: int | None = None
        echo: bool | None = False
        best_of: int | None = None
        suffix: str | None = None

    class Message(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        role: str
        content: str | list[dict] | None = None

    class Chat(Common):
        messages: list[Message]
        max_completion_tokens: int | None = None
        logprobs: bool | None = False
        top_logprobs: int | None = None
        tools: list | None = None
        tool_choice: str | dict | None = None
        response_format: dict | None = None

    return Completion, Chat


def _validation_error(e) -> APIError:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    got = f" (got {err['input']!r})" if "input" in err and err.get("type") != "missing" else ""
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{err.get('msg', 'invalid value')}{got}"[:500], param)


def _forbid_nan(s):
    raise ValueError(f"{s} is not valid JSON")


# ---------------------------------------------------------------------------------------------------
# The server state and one HTTP request's run
# ---------------------------------------------------------------------------------------------------
class Server:
    """What the routes share: the engine loop, the tokenizer, limits, the model's name."""

    def __init__(self, engine, tokenizer, model_name: str = "tritune", *, chat_template: str | None = None,
                 api_key: str | None = None, max_queue: int = 1024, sampling_defaults: dict | None = None):
        if tokenizer is None:
            raise ValueError("tokenizer: the server needs one (text prompts, streamed text, stop strings)")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue: expected an int >= 0, got {max_queue!r}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.config = engine.config
        self.chat_template, self.api_key = chat_template, api_key
        self.defaults = dict(OPENAI_SAMPLING, **(sampling_defaults or {}))
        # The queue bound: every seat of the running batch, plus max_queue waiting.
        self.max_pending = getattr(engine, "max_num_seqs", 256) + max_queue
        self.created = int(time.time())
        self._warming: str | None = None    # the thread mode's warm-up
        # The engine in a process of its own (serve_proc.EngineProcess: it is its own loop), or in a
        # thread of this one.
        self.loop = engine if getattr(engine, "is_engine_process", False) else EngineLoop(engine)
        self.metrics = Metrics(self)
        self.loop.metrics = self.metrics

    @property
    def warming(self) -> str | None:
        """"warming up" or "warm-up failed: ..." until the engine takes requests, else None."""
        return self._warming or getattr(self.loop, "warming", None)

    @warming.setter
    def warming(self, value) -> None:
        self._warming = value

    @property
    def mode(self) -> str:
        return "process" if getattr(self.loop, "is_engine_process", False) else "thread"

    def check_ready(self) -> None:
        if self.warming is not None:
            raise APIError(503, f"the server is not ready: {self.warming}; retry shortly (GET /health says when "
                           "it is)", type="server_error", code="warming_up", headers={"Retry-After": "5"})

    # -- parsing ---------------------------------------------------------------------------------------
    def check_model(self, name) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                           code="model_not_found")

    def prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif not prompt:
            raise APIError(400, "prompt: is empty", "prompt")
        elif isinstance(prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        vocab = self.config.vocab_size
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not ids:
                raise APIError(400, f"{where}: is empty (no tokens)", "prompt")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
        return prompts

    def chat_ids(self, messages) -> list[list[int]]:
        if self.chat_template is None:
            raise APIError(400, f"model {self.model_name!r} has no chat template (no chat_template in its "
                           "tokenizer_config.json); use /v1/completions", "messages", code="chat_template_missing")
        if not messages:
            raise APIError(400, "messages: is empty", "messages")
        msgs = []
        for i, m in enumerate(messages):
            c = m.content
            if isinstance(c, list):
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in c):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
                c = "".join(p["text"] for p in c)
            msgs.append({"role": m.role, "content": c or ""})
        try:
            text = _render_chat(self.chat_template, msgs)
        except Exception as e:  # noqa: BLE001 (a template error is the request's or the template's: say which)
            raise APIError(400, f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from None
        return self.prompt_ids(text)

    def sampling(self, body, n_prompt: int, chat: bool):
        from tritune.model.engine.scheduler import SamplingParams

        for name, bad in (("n", body.n not in (None, 1)), ("presence_penalty", bool(body.presence_penalty)),
                          ("frequency_penalty", bool(body.frequency_penalty)), ("logit_bias", bool(body.logit_bias))):
            if bad:
                raise APIError(400, f"{name}: not supported by this server (only its default)", name)
        if chat:
            if body.logprobs or body.top_logprobs is not None:
                raise APIError(400, "logprobs: not supported by this server", "logprobs")
            if body.tools or body.tool_choice not in (None, "none"):
                raise APIError(400, "tools: not supported by this server", "tools")
            if body.response_format and body.response_format.get("type", "text") != "text":
                raise APIError(400, "response_format: only text is supported", "response_format")
        else:
            for name, bad in (("logprobs", body.logprobs is not None), ("echo", bool(body.echo)),
                              ("best_of", body.best_of not in (None, 1)), ("suffix", body.suffix is not None)):
                if bad:
                    raise APIError(400, f"{name}: not supported by this server", name)
        ctx = self.config.n_positions
        max_tokens = body.max_tokens if body.max_tokens is not None else (
            getattr(body, "max_completion_tokens", None))
        param = "max_tokens"
        if max_tokens is None:
            max_tokens = ctx - n_prompt if chat else 16
        if max_tokens < 1:
            raise APIError(400, f"max_tokens: must be >= 1, got {max_tokens}", param)
        if n_prompt + max_tokens > ctx:
            raise APIError(400, f"prompt of {n_prompt} tokens + max_tokens={max_tokens} exceeds the context "
                           f"({ctx} tokens); shorten the prompt or lower max_tokens", "prompt" if n_prompt >= ctx
                           else param, code="context_length_exceeded")
        d = self.defaults
        t = d["temperature"] if body.temperature is None else body.temperature
        top_p = d["top_p"] if body.top_p is None else body.top_p
        top_k = d["top_k"] if body.top_k is None else body.top_k
        if not (math.isfinite(t) and t >= 0):
            raise APIError(400, f"temperature: must be a finite number >= 0 (0 is greedy), got {t}", "temperature")
        if not (0 < top_p <= 1):
            raise APIError(400, f"top_p: must be in (0, 1], got {top_p}", "top_p")
        if top_k == -1:     # vLLM's spelling of "no top-k"
            top_k = 0
        if top_k < 0:
            raise APIError(400, f"top_k: must be >= 0 (0 or -1 disables it), got {top_k}", "top_k")
        if body.seed is not None and not 0 <= body.seed < 2 ** 63:
            raise APIError(400, f"seed: must be in [0, 2**63), got {body.seed}", "seed")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops) or len(stops) > MAX_STOPS:
            raise APIError(400, f"stop: expected up to {MAX_STOPS} non-empty strings, got {body.stop!r}", "stop")
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=float(t), top_k=top_k, top_p=float(top_p),
                                  seed=body.seed, stop=tuple(stops), ignore_eos=bool(body.ignore_eos))
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None

    # -- running ---------------------------------------------------------------------------------------
    async def start(self, prompts, samplings, t_arrival: float, prefix: str) -> "Job":
        n = len(prompts)
        self.check_ready()
        if not self.loop.alive:
            why = getattr(self.loop, "down", None) or "the engine loop is not running"
            raise APIError(503, why, type="server_error", code="engine_down")
        if self.loop.in_flight + n > self.max_pending:
            raise APIError(429, f"the server's queue is full ({self.loop.in_flight} requests in flight, bound "
                           f"{self.max_pending}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        job = Job(self, n, prefix, t_arrival)
        self.loop.submit([(s, ids, sp) for s, ids, sp in zip(job.seqs, prompts, samplings)])
        await job.accepted()
        return job


class Job:
    """One HTTP request's engine requests: acceptance, then merged per-choice events, then the abort of
    whatever has not ended when the response ends (the client went away, or a stop string was found)."""

    def __init__(self, server: Server, n: int, prefix: str, t_arrival: float):
        self.server = server
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.sink: asyncio.Queue = asyncio.Queue()
        self.seqs = [Seq(f"{self.id}-{i}", i, self.sink, t_arrival) for i in range(n)]
        self.early: list = []       # events that came in while waiting for the acceptances
        self.n_prompt = [0] * n
        self.n_out = [0] * n

    async def accepted(self) -> None:
        left = len(self.seqs)
        try:
            while left:
                ev = await self.sink.get()
                i, accepted, _, finish, error = ev
                if finish is not None and accepted is None and not self.n_prompt[i]:
                    if finish == "rejected":
                        raise APIError(400, error or "rejected by the engine", "prompt")
                    raise APIError(500, f"the engine could not take the request: {error}", type="server_error")
                if accepted is not None:
                    self.n_prompt[i] = accepted
                    left -= 1
                self.early.append(ev)
        except BaseException:
            self.close()
            raise

    async def events(self):
        """Batches of (index, tokens, finish, error), merged per choice: one await per wake-up. A None
        in the sink (the disconnect watcher's) yields None and ends."""
        ended = 0
        n = len(self.seqs)
        while ended < n:
            evs, self.early = self.early, []
            if not evs:
                evs.append(await self.sink.get())
            while not self.sink.empty():
                evs.append(self.sink.get_nowait())
            if None in evs:
                yield None
                return
            merged: dict = {}
            for i, _, tokens, finish, error in evs:
                if i in merged:
                    merged[i][0].extend(tokens)
                    if finish is not None:
                        merged[i][1:] = [finish, error]
                else:
                    merged[i] = [list(tokens), finish, error]
            out = []
            for i, (tokens, finish, error) in merged.items():
                self.n_out[i] += len(tokens)
                ended += finish is not None
                out.append((i, tokens, finish, error))
            yield out

    def close(self) -> None:
        for s in self.seqs:
            self.server.loop.abort(s)

    def usage(self) -> dict:
        p, c = sum(self.n_prompt), sum(self.n_out)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _render_chat(template: str, messages) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token="",
                                            eos_token="")


FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


async def _run_request(server: Server, request, chat: bool):
    """Parse, validate, submit; a streaming or a whole response."""
    from pydantic import ValidationError
    from starlette.responses import JSONResponse

    t_arrival = time.perf_counter()
    server.check_ready()    # first: nothing of a request runs beside a warm-up (a CUDA graph capture)
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_forbid_nan)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    Completion, Chat = _bodies()
    try:
        body = (Chat if chat else Completion).model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    server.check_model(body.model)
    prompts = server.chat_ids(body.messages) if chat else server.prompt_ids(body.prompt)
    samplings = [server.sampling(body, len(p), chat) for p in prompts]
    eos = None if body.ignore_eos else server.config.eos_token_id
    outs = [TextOut(server.tokenizer, samplings[0].stop, eos) for _ in prompts]
    job = await server.start(prompts, samplings, t_arrival, "chatcmpl" if chat else "cmpl")
    fmt = _Format(server, job, chat, bool(body.return_token_ids))
    if body.stream:
        opts = body.stream_options or {}
        return _SSE(job, _stream(server, job, outs, fmt, bool(opts.get("include_usage"))))
    return JSONResponse(await _whole(server, job, outs, fmt, request))


class _Format:
    """OpenAI's response and chunk shapes."""

    def __init__(self, server, job, chat, token_ids):
        self.server, self.job, self.chat, self.token_ids = server, job, chat, token_ids
        self.created = int(time.time())
        self.head = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": self.created, "model": server.model_name}
        # A streamed chunk is the head, the choices and the tail: only the choices are encoded per chunk.
        self.pre = "data: " + json.dumps(self.head, separators=(",", ":"))[:-1] + ',"choices":['

    def chunk(self, choices: list[str], include_usage: bool) -> str:
        return self.pre + ",".join(choices) + ('],"usage":null}\n\n' if include_usage else "]}\n\n")

    def choice_text(self, i, text, finish, ids) -> str:
        """One streamed choice, as JSON text (the hot path: one per choice per engine step)."""
        fin = "null" if finish is None else json.dumps(finish)
        ids = f',"token_ids":[{",".join(map(str, ids))}]' if self.token_ids else ""
        if self.chat:
            delta = '{"content":%s}' % json.dumps(text) if text or not finish else "{}"
            return f'{{"index":{i},"delta":{delta},"logprobs":null,"finish_reason":{fin}{ids}}}'
        return f'{{"index":{i},"text":{json.dumps(text)},"logprobs":null,"finish_reason":{fin}{ids}}}'

    def choice(self, i, text, finish, ids, first=False):
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish
                                                                            else {})
            c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if self.token_ids:
            c["token_ids"] = ids
        return c

    def whole(self, texts, finishes, ids) -> dict:
        choices = []
        for i, (text, fin) in enumerate(zip(texts, finishes)):
            if self.chat:
                c = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": fin}
            else:
                c = {"index": i, "text": text, "logprobs": None, "finish_reason": fin}
            if self.token_ids:
                c["token_ids"] = ids[i]
            choices.append(c)
        return {"id": self.job.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": choices,
                "usage": self.job.usage()}


def _finish_of(out: TextOut, finish):
    return "stop" if out.stopped else FINISH.get(finish, finish)


async def _whole(server, job, outs, fmt, request) -> dict:
    n = len(outs)
    texts, ids, finishes = [""] * n, [[] for _ in range(n)], [None] * n

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.sink.put_nowait(None)       # wakes the consumer below

    watcher = asyncio.ensure_future(disconnected())
    try:
        async for batch in job.events():
            if batch is None:
                return {}               # the client went away; nobody reads this
            for i, tokens, finish, error in batch:
                ids[i] += tokens
                texts[i] += outs[i].feed(tokens)
                if outs[i].stopped and finish is None:
                    server.loop.abort(job.seqs[i])
                if finish is not None:
                    if finish == "error":
                        raise APIError(500, f"generation failed: {error}", type="server_error")
                    texts[i] += outs[i].finish()
                    finishes[i] = _finish_of(outs[i], finish)
        return fmt.whole(texts, finishes, ids)
    finally:
        watcher.cancel()
        job.close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(server, job, outs, fmt, include_usage: bool):
    head = fmt.head
    extra = {"usage": None} if include_usage else {}
    try:
        if fmt.chat:     # the role first, as OpenAI does
            yield _sse({**head, "choices": [fmt.choice(i, "", None, [], first=True) for i in range(len(outs))],
                        **extra})
        async for batch in job.events():
            choices = []
            for i, tokens, finish, error in batch:
                if finish == "error":
                    yield _sse({"error": APIError(500, f"generation failed: {error}", type="server_error").body()
                                ["error"]})
                    yield "data: [DONE]\n\n"
                    return
                text = outs[i].feed(tokens)
                if outs[i].stopped and finish is None:
                    server.loop.abort(job.seqs[i])
                if finish is not None:
                    text += outs[i].finish()
                    finish = _finish_of(outs[i], finish)
                if text or finish or (fmt.token_ids and tokens):
                    choices.append(fmt.choice_text(i, text, finish, tokens))
            if choices:
                yield fmt.chunk(choices, include_usage)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"
    finally:
        job.close()


@functools.cache
def _sse_response_class():
    from starlette.responses import StreamingResponse

    class SSE(StreamingResponse):
        """Aborts the job's unfinished requests however the response ends (a disconnect cancels the
        streaming task, possibly while the generator is suspended, where its own finally would wait)."""

        def __init__(self, job, gen):
            super().__init__(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.job.close()

    return SSE


def _SSE(job, gen):
    return _sse_response_class()(job, gen)


# ---------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------
def create_app(engine, tokenizer, model_name: str = "tritune", *, warm_up=None, **kw):
    """The ASGI app over ``engine``: an engine object (stepped by a thread of this process, started with
    the app's lifespan) or a :class:`tritune.model.serve.proc.EngineProcess` (the engine in a process of its
    own; the lifespan attaches it to the event loop and stops it at shutdown). ``kw``: see
    :class:`Server` (chat_template, api_key, max_queue, sampling_defaults). ``app.state.server`` is the
    :class:`Server`. ``warm_up``: None, or ``warm_up(engine)`` run on a thread of its own once the app
    starts, before the engine loop: meanwhile the server listens and answers 503 "warming up" (uvicorn
    opens the port only after the lifespan's start-up, so the warm-up cannot run inside it)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response

    server = Server(engine, tokenizer, model_name, **kw)
    if warm_up is not None and server.mode == "process":
        raise ValueError("warm_up: an engine process warms itself up (EngineProcess(..., warm_up=...))")

    @asynccontextmanager
    async def lifespan(app):
        aloop = asyncio.get_running_loop()
        if warm_up is None:
            server.loop.start(aloop)
        else:
            _start_warm_up(server, warm_up, aloop)
        try:
            yield
        finally:
            server.loop.stop()

    app = FastAPI(title="tritune", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    def error(e: APIError):
        server.metrics.http_errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    class KeyCheck:
        """--api-key on every request (plain ASGI: BaseHTTPMiddleware would wrap every streamed chunk)."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            key = server.api_key
            if scope["type"] == "http" and key is not None:
                got = dict(scope["headers"]).get(b"authorization", b"")
                if not secrets.compare_digest(got, f"Bearer {key}".encode()):
                    await error(APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                         code="invalid_api_key"))(scope, receive, send)
                    return
            await self.app(scope, receive, send)

    app.add_middleware(KeyCheck)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return error(_validation_error(e))

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        return error(APIError(e.status_code, str(e.detail), type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(request, e):
        log.exception("unhandled error")
        return error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    # Plain Starlette routes: each takes the Request and parses its own body (strict OpenAI errors).
    async def completions(request):
        return await _run_request(server, request, chat=False)

    async def chat_completions(request):
        return await _run_request(server, request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "tritune",
            "max_model_len": server.config.n_positions, "vocab_size": server.config.vocab_size}]})

    async def health(request):
        warming = server.warming
        ok = warming is None and server.loop.alive
        down = getattr(server.loop, "down", None)
        body = {"status": "ok" if ok else warming or down or "engine loop stopped", **server.loop.load,
                "in_flight": server.loop.in_flight, "steps": server.loop.steps, "engine": server.mode}
        if server.mode == "process":
            body["engine_pid"] = server.loop.pid
            if server.loop.death is not None:   # exit code / signal, the loop's exception, fatal-signal stacks
                body["engine_death"] = server.loop.death
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    for path, fn, method in (("/v1/completions", completions, "POST"), ("/v1/chat/completions", chat_completions,
                             "POST"), ("/v1/models", models, "GET"), ("/health", health, "GET"),
                             ("/metrics", metrics, "GET")):
        app.router.add_route(path, fn, methods=[method])
    return app


def _start_warm_up(server: Server, warm_up, aloop) -> None:
    """Run ``warm_up(engine)`` on a thread; then start the engine loop (on the event loop's thread, where
    the loop is started and stopped). A failed warm-up leaves the server answering 503 with the error."""
    server.warming = "warming up"

    def ready():
        server.loop.start(aloop)
        server.warming = None

    def run():
        try:
            warm_up(server.engine)
        except BaseException as e:  # reported on /health and in the log; the process stays up to say so
            log.exception("warm-up failed")
            server.warming = f"warm-up failed: {type(e).__name__}: {e}"
            return
        with contextlib.suppress(RuntimeError):  # the server shut down while warming up: its loop is closed
            aloop.call_soon_threadsafe(ready)

    threading.Thread(target=run, name="tritune-warm-up", daemon=True).start()


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
def add_parser(subparsers, name: str) -> None:
    if name != "serve":
        return
    import argparse

    from tritune.kernels.runtime.args import parse_dtype

    s = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face hub id (default: the packaged checkpoint)")
    s.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request "
                   "(default: $TRITUNE_API_KEY if set)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                   "checkpoint directory's name)")
    s.add_argument("--backend", choices=("triton", "torch"), default=None,
                   help="default: triton with a CUDA GPU, torch without")
    s.add_argument("--dtype", type=parse_dtype, default=None, help="default bf16 on a GPU, fp32 on the CPU")
    s.add_argument("--quant", choices=("int8", "int4"), default=None, help="weight-only quantized linears")
    s.add_argument("--max-num-seqs", type=int, default=256, help="the running batch's seats")
    s.add_argument("--max-queue", type=int, default=1024, help="requests waiting beyond the seats before "
                   "answering 429")
    s.add_argument("--max-batch-tokens", type=int, default=None)
    s.add_argument("--kv-memory-fraction", type=float, default=None, help="of free GPU memory (default 0.5)")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--no-cuda-graphs", action="store_true")
    s.add_argument("--deterministic", action="store_true", help="batch-invariant kernels: each request's "
                   "tokens those it gets alone (tritune.model.engine.invariant)")
    s.add_argument("--no-warm-up", action="store_true", help="skip compiling the kernel variants at start")
    s.add_argument("--engine", choices=("process", "thread"), default=None,
                   help="where the engine runs: a process of its own (default on a GPU: the event loop and "
                   "the engine do not share a GIL) or a thread of the server's process (default on the CPU: "
                   "no second process to start)")
    s.add_argument("--engine-in-process", dest="engine", action="store_const", const="thread",
                   help="the same as --engine thread")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    s.set_defaults(func=run)


def http_stack() -> str:
    """What uvicorn's "auto" picks: uvloop and httptools when installed (the serve extra), else asyncio and
    h11 (pure Python: a few times the per-chunk cost)."""
    import importlib.util

    loop = "uvloop" if sys.platform != "win32" and importlib.util.find_spec("uvloop") else "asyncio"
    return f"{loop}+{'httptools' if importlib.util.find_spec('httptools') else 'h11'}"


def _fail(msg: str) -> int:
    print(f"tritune serve: {msg}", file=sys.stderr)
    return 2


def engine_spec(args) -> dict:
    """The serve arguments as plain data for :func:`tritune.model.serve.proc.gpt2_engine` (built here in
    the thread mode, in the engine process otherwise)."""
    import torch

    from tritune.model.load import default_model_dir
    from tritune.model.gpt2.weights import resolve

    path = args.model or default_model_dir()
    if path is None:
        raise ValueError("no packaged default checkpoint (model/default/config.json is missing); pass MODEL")
    gpu = torch.cuda.is_available()
    backend = args.backend or ("triton" if gpu else "torch")
    dtype = args.dtype or (torch.bfloat16 if gpu else torch.float32)
    kv = {"kv_memory_fraction": args.kv_memory_fraction} if args.kv_memory_fraction is not None else {}
    return {"model": str(resolve(path)), "backend": backend, "dtype": str(dtype).removeprefix("torch."),
            "engine": dict(block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                           max_num_seqs=args.max_num_seqs, cuda_graphs=not args.no_cuda_graphs, quant=args.quant,
                           batch_invariant=getattr(args, "deterministic", False), **kv)}


def build_engine(args):
    """(engine, tokenizer, model directory) from the serve arguments: the engine in this process."""
    from tritune.model.serve.proc import gpt2_engine

    engine = gpt2_engine(**engine_spec(args))
    return engine, engine.tokenizer, engine.model.directory


def _warm_up(engine) -> None:
    """The CLI's warm-up: every kernel variant a serving run meets compiled, the CUDA graphs captured."""
    from tritune.model.bench.serve_bench import warm_up

    t0 = time.perf_counter()
    warm_up(engine, engine.config.vocab_size, engine.config.n_positions // 2)
    print(f"warm-up: {time.perf_counter() - t0:.1f} s; ready", file=sys.stderr, flush=True)


def run(args) -> int:
    import os
    from pathlib import Path

    try:
        import uvicorn

        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as e:
        return _fail(f"{e.name} is missing: install the serve extra (pip install 'tritune[serve]')")
    if not 0 <= args.port < 65536:
        return _fail(f"--port: expected 0..65535, got {args.port}")
    api_key = args.api_key or os.environ.get("TRITUNE_API_KEY") or None
    import torch

    from tritune.model.serve.proc import EngineProcess, EngineStartError
    from tritune.model.tokenizer import Tokenizer

    try:
        mode = args.engine or ("process" if torch.cuda.is_available() else "thread")
        spec = engine_spec(args)
        warm = not args.no_warm_up and spec["backend"] == "triton"
        if mode == "process":
            directory = spec["model"]
            tok = Tokenizer.from_dir(directory)     # read before the engine process spends its start-up
            engine = EngineProcess("tritune.model.serve.proc:gpt2_engine", spec,
                                   warm_up="tritune.model.serve.server:_warm_up" if warm else None)
        else:
            engine, tok, directory = build_engine(args)
        from tritune.model.load import sampling_defaults

        defaults = {k: v for k, v in sampling_defaults(directory).items()
                    if (Path(directory) / "generation_config.json").is_file()}
        if defaults.get("temperature") == 0.0:      # no do_sample: the API's own defaults
            defaults = {}
        name = args.served_model_name or (str(args.model) if args.model else "tritune-default")
        app = create_app(engine, tok, name, api_key=api_key, warm_up=_warm_up if warm and mode == "thread" else None,
                         chat_template=load_chat_template(directory), max_queue=args.max_queue,
                         sampling_defaults=defaults)
    except (FileNotFoundError, NotADirectoryError, ValueError, TypeError, EngineStartError) as e:
        return _fail(str(e))
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"note: listening on {args.host}: reachable from other machines"
              + ("" if api_key else " without an API key"), file=sys.stderr)
    if mode == "thread":
        # The engine thread waits for the GPU with the GIL released; a shorter switch interval gives it the
        # GIL back sooner when the event loop is busy formatting chunks.
        sys.setswitchinterval(0.001)
    d = engine.describe()
    print(f"serving {app.state.server.model_name!r} ({d['backend']}, {d['dtype']}, {d['device']}; engine in "
          f"{'its own process' if mode == 'process' else 'a thread'}; {http_stack()}) on "
          f"http://{args.host}:{args.port}"
          + (" (warming up: /health answers 503 until ready)" if warm else ""), file=sys.stderr, flush=True)
    # On shutdown, streams still open after 10 s are cancelled (which aborts their requests).
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    timeout_graceful_shutdown=10)
    finally:
        if mode == "process":   # the lifespan stops it; this covers a server that never started (port taken)
            engine.stop()
    return 0
