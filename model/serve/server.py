"""``tritune serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one shared :class:`Engine`.

The server sees the engine through one interface (:class:`tritune.model.serve.client.EngineClient`): the
engine runs in a process of its own (:mod:`tritune.model.serve.proc`, ``--engine process``, the default on
a GPU: the engine's host work and the event loop's do not share a GIL), or in a thread of this process
(:mod:`tritune.model.serve.thread`, ``--engine thread``): either takes new requests and aborts between
steps, runs ``engine.step()`` while anything is unfinished, and hands each step's new tokens to the event
loop at once (one wake-up per step, not one per token). Continuous batching across HTTP requests is the
engine's own; handlers only parse, tokenize, detokenize and format, and never touch the engine. A stream's
writer sends everything its request got since it last wrote as one chunk: when the server falls behind,
chunks grow (several tokens each) instead of the engine waiting for HTTP.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (only for a checkpoint with a chat
template: GPT-2's has none, and the endpoint answers 400 saying so), ``GET /v1/models``, ``GET /health``
(JSON, with the KV blocks in use: a leak shows there), ``GET /metrics`` (Prometheus text).
Limits before work: a body over ``--max-body-bytes`` is a 413 before it is read; every short string field
is bounded (a 400 naming it); long text prompts are tokenized on worker threads with the GIL released, so
neither a large nor a slow request holds up ``/health`` or the other streams.
Start-up: the port opens at once; a warm-up (on a GPU: compiling the kernel variants, capturing the CUDA
graphs, minutes on a cold compile cache) runs beside it, and until it has finished ``/health`` and every
generation answer 503 ("warming up", with Retry-After), so a client or a load balancer waits on /health.
Beyond OpenAI's fields: ``top_k``, ``ignore_eos``, and ``return_token_ids`` (each choice, and each streamed
chunk, carries its token ids). A client that disconnects aborts its requests at the engine's next step,
which frees their KV blocks.
Models: any checkpoint :func:`tritune.model.load.load_model` runs (GPT-2 dense or quantized, Llama, Qwen2/3,
Mistral), or ``llama`` (the packaged Llama-style model); the chat template is the checkpoint's
(``chat_template`` of tokenizer_config.json), rendered as transformers' ``apply_chat_template`` does.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
import threading
import time

from tritune.model.serve.chat import load_chat_template, load_special_tokens, render_chat
from tritune.model.serve.client import EngineClient
from tritune.model.serve.metrics import Metrics
from tritune.model.serve.responses import Format, Job, sse_response, stream_response, whole_response
from tritune.model.serve.schema import (OPENAI_SAMPLING, APIError, body_too_large, check_text,
                                        default_max_body_bytes, parse_body, sampling_params, validation_error)
from tritune.model.serve.text import TextOut
from tritune.model.serve.thread import ThreadEngineClient

log = logging.getLogger("tritune.serve")

# Text prompts up to this many characters are tokenized on the event loop (tens of microseconds); longer
# ones on the tokenizer's threads, where the library releases the GIL (a 1 MiB prompt takes a second).
INLINE_TOKENIZE_CHARS = 4096
TOKENIZER_THREADS = 2   # at most this many long prompts tokenize at once; more wait their turn


# ---------------------------------------------------------------------------------------------------
# The server state and one HTTP request's run
# ---------------------------------------------------------------------------------------------------
class Server:
    """What the routes share: the engine client, the tokenizer, limits, the model's name.

    ``chat_template``: the checkpoint's Jinja chat template (None: /v1/chat/completions answers 400);
    ``chat_tokens``: the special tokens it may use (``bos_token``...); ``max_body_bytes``: the largest
    request body taken (None: :func:`tritune.model.serve.schema.default_max_body_bytes` of the context)."""

    def __init__(self, engine, tokenizer, model_name: str = "tritune", *, chat_template: str | None = None,
                 chat_tokens: dict | None = None, api_key: str | None = None, max_queue: int = 1024,
                 sampling_defaults: dict | None = None, max_body_bytes: int | None = None):
        if tokenizer is None:
            raise ValueError("tokenizer: the server needs one (text prompts, streamed text, stop strings)")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue: expected an int >= 0, got {max_queue!r}")
        # The engine in a process of its own (EngineProcess: a client itself), or in a thread of this one.
        self.loop = engine if isinstance(engine, EngineClient) else ThreadEngineClient(engine)
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.config = self.loop.config
        if max_body_bytes is None:
            max_body_bytes = default_max_body_bytes(self.config.n_positions)
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes: expected an int >= 1024, got {max_body_bytes!r}")
        self.max_body_bytes = max_body_bytes
        self.chat_template, self.chat_tokens, self.api_key = chat_template, dict(chat_tokens or {}), api_key
        self.defaults = dict(OPENAI_SAMPLING, **(sampling_defaults or {}))
        # The queue bound: every seat of the running batch, plus max_queue waiting.
        self.max_pending = self.loop.max_num_seqs + max_queue
        self.created = int(time.time())
        self._warming: str | None = None    # the thread mode's warm-up
        self.metrics = Metrics(self.loop)
        self.loop.metrics = self.metrics
        self.tokenize_pool = None           # created on first use, shut down with the app

    @property
    def warming(self) -> str | None:
        """"warming up" or "warm-up failed: ..." until the engine takes requests, else None."""
        return self._warming or self.loop.warming

    @warming.setter
    def warming(self, value) -> None:
        self._warming = value

    @property
    def client(self) -> EngineClient:
        """The engine client (``loop``: its older name)."""
        return self.loop

    @property
    def mode(self) -> str:
        return self.loop.mode

    def check_ready(self) -> None:
        if self.warming is not None:
            raise APIError(503, f"the server is not ready: {self.warming}; retry shortly (GET /health says when "
                           "it is)", type="server_error", code="warming_up", headers={"Retry-After": "5"})

    def close(self) -> None:
        if self.tokenize_pool is not None:
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            self.tokenize_pool = None

    # -- parsing ---------------------------------------------------------------------------------------
    def check_model(self, name) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                           code="model_not_found")

    async def encode(self, texts: list[str], param: str) -> list[list[int]]:
        """Token ids of each text: short ones here, long ones on the tokenizer's threads (the event loop
        goes on meanwhile)."""
        for i, t in enumerate(texts):
            check_text(t, param if len(texts) == 1 else f"{param}[{i}]")
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return [self.tokenizer.encode(t) for t in texts]
        if self.tokenize_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self.tokenize_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tritune-tokenize")
        tok = self.tokenizer
        batch = getattr(tok, "encode_batch", None) or (lambda ts: [tok.encode(t) for t in ts])
        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, batch, texts)
        except Exception as e:  # noqa: BLE001 (text the tokenizer refuses is the request's fault)
            raise APIError(400, f"{param}: the tokenizer could not read it: {type(e).__name__}: {e}"[:500],
                           param) from None

    async def prompt_ids(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = await self.encode([prompt], "prompt")
        elif not prompt:
            raise APIError(400, "prompt: is empty", "prompt")
        elif isinstance(prompt[0], str):
            prompts = await self.encode(list(prompt), "prompt")
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        self.check_ids(prompts)
        return prompts

    def check_ids(self, prompts) -> None:
        vocab, ctx = self.config.vocab_size, self.config.n_positions
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not ids:
                raise APIError(400, f"{where}: is empty (no tokens)", "prompt")
            if len(ids) >= ctx:     # before the vocabulary scan: no work on a prompt that cannot run
                raise APIError(400, f"{where}: {len(ids)} tokens leave no room in the context ({ctx} tokens)",
                               "prompt", code="context_length_exceeded")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")

    async def chat_ids(self, messages) -> list[list[int]]:
        if self.chat_template is None:
            raise APIError(400, f"model {self.model_name!r} has no chat template (its checkpoint has no "
                           "chat_template in tokenizer_config.json, as GPT-2's has none), so it has no chat format: "
                           "send the text to /v1/completions instead", "messages", code="chat_template_missing")
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
            text = render_chat(self.chat_template, msgs, **self.chat_tokens)
        except Exception as e:  # noqa: BLE001 (a template error is the request's or the template's: say which)
            raise APIError(400, f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from None
        prompts = await self.encode([text], "messages")
        self.check_ids(prompts)
        return prompts

    def sampling(self, body, n_prompt: int, chat: bool):
        return sampling_params(body, n_prompt, chat, self.config.n_positions, self.defaults, self.config.vocab_size)

    # -- running ---------------------------------------------------------------------------------------
    async def start(self, prompts, samplings, t_arrival: float, prefix: str) -> Job:
        n = len(prompts)
        self.check_ready()
        if not self.loop.alive:
            why = self.loop.down or "the engine loop is not running"
            raise APIError(503, why, type="server_error", code="engine_down")
        if self.loop.in_flight + n > self.max_pending:
            raise APIError(429, f"the server's queue is full ({self.loop.in_flight} requests in flight, bound "
                           f"{self.max_pending}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        job = Job(self.loop, n, prefix, t_arrival)
        self.loop.submit([(s, ids, sp) for s, ids, sp in zip(job.seqs, prompts, samplings)])
        await job.accepted()
        return job


async def run_request(server: Server, request, chat: bool):
    """Parse, validate, submit; a streaming or a whole response."""
    from starlette.responses import JSONResponse

    t_arrival = time.perf_counter()
    server.check_ready()    # first: nothing of a request runs beside a warm-up (a CUDA graph capture)
    body = parse_body(await request.body(), chat)
    server.check_model(body.model)
    prompts = await (server.chat_ids(body.messages) if chat else server.prompt_ids(body.prompt))
    samplings = [server.sampling(body, len(p), chat) for p in prompts]
    eos = None if body.ignore_eos else server.config.eos_token_id
    outs = [TextOut(server.tokenizer, samplings[0].stop, eos) for _ in prompts]
    job = await server.start(prompts, samplings, t_arrival, "chatcmpl" if chat else "cmpl")
    fmt = Format(server.model_name, job, chat, bool(body.return_token_ids))
    if body.stream:
        opts = body.stream_options or {}
        return sse_response(job, stream_response(job, outs, fmt, bool(opts.get("include_usage"))))
    return JSONResponse(await whole_response(job, outs, fmt, request))


# ---------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------
def error_response(server: Server, e: APIError):
    from starlette.responses import JSONResponse

    server.metrics.http_errors.labels(str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Gate:
    """What every request passes before any route reads it (plain ASGI: BaseHTTPMiddleware would wrap
    every streamed chunk): the API key (--api-key), and the body's size: a declared Content-Length over
    ``max_body_bytes`` is a 413 before a byte of the body is read; a body without one (chunked) is
    counted as it arrives and refused once past the bound."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        server, headers = self.server, dict(scope["headers"])
        key = server.api_key
        if key is not None and not secrets.compare_digest(headers.get(b"authorization", b""),
                                                          f"Bearer {key}".encode()):
            e = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
            return await error_response(server, e)(scope, receive, send)
        limit = server.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await error_response(server, body_too_large(limit))(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise body_too_large(limit)
            return msg

        await self.app(scope, counted, send)


def create_app(engine, tokenizer, model_name: str = "tritune", *, warm_up=None, **kw):
    """The ASGI app over ``engine``: an engine object (stepped by a thread of this process, started with
    the app's lifespan) or an :class:`~tritune.model.serve.client.EngineClient` such as
    :class:`tritune.model.serve.proc.EngineProcess` (the engine in a process of its own; the lifespan
    attaches it to the event loop and stops it at shutdown). ``kw``: see :class:`Server` (chat_template,
    chat_tokens, api_key, max_queue, sampling_defaults, max_body_bytes). ``app.state.server`` is the
    :class:`Server`. ``warm_up``: None, or ``warm_up(engine)`` run on a thread of its own once the app
    starts, before the engine loop: meanwhile the server listens and answers 503 "warming up" (uvicorn
    opens the port only after the lifespan's start-up, so the warm-up cannot run inside it)."""
    from fastapi import FastAPI

    server = Server(engine, tokenizer, model_name, **kw)
    if warm_up is not None and server.mode == "process":
        raise ValueError("warm_up: an engine process warms itself up (EngineProcess(..., warm_up=...))")
    app = FastAPI(title="tritune", lifespan=_lifespan(server, warm_up), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = server
    app.add_middleware(Gate, server=server)
    _error_handlers(app, server)
    for path, fn, method in _routes(server):
        app.router.add_route(path, fn, methods=[method])
    return app


def _lifespan(server: Server, warm_up):
    from contextlib import asynccontextmanager

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
            server.close()

    return lifespan


def _error_handlers(app, server: Server) -> None:
    """Every error in OpenAI's shape (and counted in /metrics by status)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def api_error(request, e: APIError):
        return error_response(server, e)

    async def request_validation(request, e):
        return error_response(server, validation_error(e))

    async def http_error(request, e):
        return error_response(server, APIError(e.status_code, str(e.detail), type="invalid_request_error"))

    async def internal_error(request, e):
        log.exception("unhandled error")
        return error_response(server, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    for exc, fn in ((APIError, api_error), (RequestValidationError, request_validation), (HTTPException, http_error),
                    (Exception, internal_error)):
        app.add_exception_handler(exc, fn)


def _routes(server: Server) -> list:
    """Plain Starlette routes: each takes the Request and parses its own body (strict OpenAI errors)."""
    from starlette.responses import JSONResponse, Response

    async def completions(request):
        return await run_request(server, request, chat=False)

    async def chat_completions(request):
        return await run_request(server, request, chat=True)

    async def models(request):
        return JSONResponse({"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": server.created, "owned_by": "tritune",
            "max_model_len": server.config.n_positions, "vocab_size": server.config.vocab_size}]})

    async def health(request):
        loop, warming = server.loop, server.warming
        ok = warming is None and loop.alive
        body = {"status": "ok" if ok else warming or loop.down or "engine loop stopped", **loop.load,
                "in_flight": loop.in_flight, "steps": loop.steps, "engine": server.mode, **loop.health()}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return [("/v1/completions", completions, "POST"), ("/v1/chat/completions", chat_completions, "POST"),
            ("/v1/models", models, "GET"), ("/health", health, "GET"), ("/metrics", metrics, "GET")]


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

    from tritune.kernels.runtime.args import block_size, parse_dtype

    s = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server on the engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or Hugging Face hub id of any family tritune loads (GPT-2, Llama, "
                        "Qwen2/3, Mistral; default: the packaged checkpoint; `llama`: the packaged Llama-style one)")
    s.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every request "
                   "(default: $TRITUNE_API_KEY if set)")
    s.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the "
                   "checkpoint directory's name)")
    s.add_argument("--backend", choices=("triton", "torch"), default=None,
                   help="default: triton with a CUDA GPU, torch without")
    s.add_argument("--dtype", type=parse_dtype, default=None, help="default bf16 on a GPU, fp32 on the CPU")
    s.add_argument("--quant", choices=("int8", "int4", "fp8"), default=None,
                   help="quantized linears: weight-only int8/int4, or fp8 (W8A8 e4m3, per-token activations)")
    s.add_argument("--fp8-block", action="store_true", help="--quant fp8: 128x128 block weight scales")
    s.add_argument("--kv-cache-dtype", choices=("fp8",), default=None,
                   help="fp8: the paged KV cache in e4m3 with per-token scales (about half the bytes)")
    s.add_argument("--max-num-seqs", type=int, default=256, help="the running batch's seats")
    s.add_argument("--max-queue", type=int, default=1024, help="requests waiting beyond the seats before "
                   "answering 429")
    s.add_argument("--max-batch-tokens", type=int, default=None)
    s.add_argument("--max-body-bytes", type=int, default=None, help="the largest request body taken; larger ones "
                   "answer 413 before they are read (default: 1 MiB, or 256 bytes per token of the context where "
                   "that is more)")
    s.add_argument("--kv-memory-fraction", type=float, default=None, help="of free GPU memory (default 0.5)")
    s.add_argument("--block-size", type=block_size, default=16)
    s.add_argument("--no-cuda-graphs", action="store_true")
    s.add_argument("--tp", type=int, default=1, help="tensor parallelism: split the model over this many GPUs "
                   "(one process each, NCCL; default 1)")
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
    """The serve arguments as plain data for :func:`tritune.model.serve.proc.model_engine` (built here in
    the thread mode, in the engine process otherwise)."""
    import torch

    from tritune.model.gpt2.weights import resolve
    from tritune.model.load import default_dtype, default_model_dir, packaged_or

    path = packaged_or(args.model) or default_model_dir()
    if path is None:
        raise ValueError("no packaged default checkpoint (model/default/config.json is missing); pass MODEL")
    gpu = torch.cuda.is_available()
    backend = args.backend or ("triton" if gpu else "torch")
    dtype = args.dtype or default_dtype()
    kv = {"kv_memory_fraction": args.kv_memory_fraction} if args.kv_memory_fraction is not None else {}
    return {"model": str(resolve(path)), "backend": backend, "dtype": str(dtype).removeprefix("torch."),
            "engine": dict(block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                           max_num_seqs=args.max_num_seqs, cuda_graphs=not args.no_cuda_graphs, quant=args.quant,
                           batch_invariant=getattr(args, "deterministic", False), **kv,
                           **({"tensor_parallel": args.tp} if getattr(args, "tp", 1) != 1 else {}),
                           **{k: v for k, v in (("fp8_block", getattr(args, "fp8_block", False)),
                                                ("kv_cache_dtype", getattr(args, "kv_cache_dtype", None))) if v})}


def build_engine(args):
    """(engine, tokenizer, model directory) from the serve arguments: the engine in this process."""
    from tritune.model.serve.proc import model_engine

    engine = model_engine(**engine_spec(args))
    return engine, engine.tokenizer, engine.model.directory


def _build_app(args, api_key):
    """(app, engine or engine process, engine mode, warming up) from the serve arguments."""
    from pathlib import Path

    import torch

    from tritune.model.load import sampling_defaults
    from tritune.model.serve.proc import EngineProcess
    from tritune.model.serve.warmup import serve_warm_up
    from tritune.model.tokenizer import Tokenizer

    mode = args.engine or ("process" if torch.cuda.is_available() else "thread")
    spec = engine_spec(args)
    warm = not args.no_warm_up and spec["backend"] == "triton"
    if mode == "process":
        directory = spec["model"]
        tok = Tokenizer.from_dir(directory)     # read before the engine process spends its start-up
        engine = EngineProcess("tritune.model.serve.proc:model_engine", spec,
                               warm_up="tritune.model.serve.warmup:serve_warm_up" if warm else None)
    else:
        engine, tok, directory = build_engine(args)
    defaults = {k: v for k, v in sampling_defaults(directory).items()
                if (Path(directory) / "generation_config.json").is_file()}
    if defaults.get("temperature") == 0.0:      # no do_sample: the API's own defaults
        defaults = {}
    name = args.served_model_name or (str(args.model) if args.model else "tritune-default")
    app = create_app(engine, tok, name, api_key=api_key, warm_up=serve_warm_up if warm and mode == "thread" else None,
                     chat_template=load_chat_template(directory), chat_tokens=load_special_tokens(directory),
                     max_queue=args.max_queue, sampling_defaults=defaults,
                     max_body_bytes=getattr(args, "max_body_bytes", None))
    return app, engine, mode, warm


def _follow(args) -> int:
    """``tritune serve --tp N`` on a torchrun rank other than 0: this rank's shard, following rank 0's engine
    until it stops."""
    import torch

    from tritune.model.load import load_model
    from tritune.model.parallel.group import use_local_gpu
    from tritune.model.parallel.serving import follow_torchrun

    try:
        spec = engine_spec(args)
        use_local_gpu()
        model = load_model(spec["model"], backend=spec["backend"], dtype=getattr(torch, spec["dtype"]))
    except (FileNotFoundError, NotADirectoryError, ValueError, TypeError) as e:
        return _fail(str(e))
    try:
        follow_torchrun(model)
    except KeyboardInterrupt:   # Ctrl-C reaches every rank: rank 0's server stops its engine, this rank ends
        return 130
    return 0


def run(args) -> int:
    import os

    try:
        import uvicorn

        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as e:
        return _fail(f"{e.name} is missing: install the serve extra (pip install 'tritune[serve]')")
    if not 0 <= args.port < 65536:
        return _fail(f"--port: expected 0..65535, got {args.port}")
    api_key = args.api_key or os.environ.get("TRITUNE_API_KEY") or None
    from tritune.model.serve.proc import EngineStartError

    if getattr(args, "tp", 1) > 1:
        from tritune.model.parallel.group import torchrun_rank

        env = torchrun_rank()
        if env is not None and env[1] == args.tp and env[0] != 0:
            return _follow(args)    # a torchrun rank other than 0: no server here, rank 0's engine leads it

    try:
        app, engine, mode, warm = _build_app(args, api_key)
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
