"""``tritune serve-bench --url``: serve-bench's workload against any OpenAI-compatible server, over HTTP.

The same workload generator as the in-process serve-bench (``make_workload``: lengths drawn from ranges or
read from a JSONL file, Poisson arrivals at ``--rate``), sent as token-id prompts to ``POST
/v1/completions`` with ``stream: true``, greedy, ``ignore_eos`` (a vLLM-style extension, so each request
runs to its output length where the server honours it), at most ``--max-concurrency`` in flight. Measured
per request from its scheduled arrival: TTFT (the first chunk with output), inter-token latency (each
gap between chunks, divided evenly over the tokens it brought: a server that sends several tokens per
chunk is not flattered by zero gaps), end-to-end latency, output tokens (the usage block, else the
chunks' ``token_ids``, else one per chunk); overall: output and total tok/s, req/s, errors. The load comes
from several client processes (``--client-procs``; default one per 32 streams, up to half the cores), each
reporting its CPU time over the run's wall time: a saturated client measures itself, not the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path


POOL = 32      # connections per httpx client


class Outcome:
    __slots__ = ("ok", "error", "ttft", "itl", "gaps", "e2e", "out_tokens", "prompt_tokens", "start", "end")

    def __init__(self):
        self.ok, self.error = False, None
        self.ttft = self.e2e = None
        self.itl: list[float] = []
        self.gaps: list[float] = []
        self.out_tokens = self.prompt_tokens = 0
        self.start = self.end = None


def _headers(api_key):
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def server_info(url: str, api_key=None) -> dict:
    """The first model of ``GET /v1/models`` (``id``, and ``max_model_len`` / ``vocab_size`` where given)."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(url.rstrip("/") + "/v1/models", headers=_headers(api_key))
        r.raise_for_status()
        data = r.json().get("data") or []
    if not data:
        raise ValueError(f"{url}/v1/models lists no model")
    return data[0]


class _Reader:
    """One stream's SSE lines into an Outcome (the client's per-chunk work: a JSON parse, a clock read)."""
    __slots__ = ("o", "arrival", "last", "chunks", "usage", "done")

    def __init__(self, o: Outcome, arrival: float):
        self.o, self.arrival = o, arrival
        self.last, self.chunks, self.usage, self.done = None, 0, None, False

    def line(self, line: str) -> bool:
        """False once the stream is over ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return False
        ev = json.loads(data)
        if "error" in ev:
            self.o.error = f"stream error: {ev['error']}"[:300]
            return False
        if ev.get("usage"):
            self.usage = ev["usage"]
        o = self.o
        for ch in ev.get("choices") or ():
            k = len(ch["token_ids"]) if ch.get("token_ids") is not None else (1 if ch.get("text") else 0)
            if not k:
                continue
            now = time.perf_counter()
            if self.last is None:
                o.ttft = now - self.arrival
            else:
                o.gaps.append(now - self.last)
                o.itl.extend([(now - self.last) / k] * k)
            self.last = now
            self.chunks += k
        return True

    def end(self, item) -> Outcome:
        o = self.o
        if o.error is None and not self.done:
            o.error = "the stream ended without data: [DONE]"
        if o.error is not None:
            return o
        o.end = time.perf_counter()
        o.e2e = o.end - self.arrival
        o.out_tokens = int(self.usage["completion_tokens"]) if self.usage else self.chunks
        o.prompt_tokens = int(self.usage["prompt_tokens"]) if self.usage else len(item.prompt_ids)
        o.ok = True
        return o


async def _one(client, url, item, model, t0, sem, extra) -> Outcome:
    """One streamed request; ``client``: an aiohttp ClientSession or an httpx AsyncClient."""
    o = Outcome()
    body = {"model": model, "prompt": item.prompt_ids, "max_tokens": item.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "return_token_ids": True, **extra}
    delay = t0 + item.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rd = _Reader(o, t0 + item.arrival)
    async with sem:
        o.start = time.perf_counter()
        try:
            if hasattr(client, "ws_connect"):       # aiohttp
                async with client.post(url, json=body) as r:
                    if r.status != 200:
                        o.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:200]}"
                        return o
                    async for raw in r.content:
                        if not rd.line(raw.decode()):
                            break
            else:
                async with client.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        o.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                        return o
                    async for line in r.aiter_lines():
                        if not rd.line(line):
                            break
        except Exception as e:  # noqa: BLE001 (one request's failure is a data point, not the end of the run)
            o.error = f"{type(e).__name__}: {e}"[:300]
            return o
        return rd.end(item)


async def _warm(clients, url: str, n: int) -> None:
    """Open ``n`` keep-alive connections before the clock starts (n concurrent GET /health, whatever
    they answer): the in-process run it is compared with has no connections to open, and a server
    in service keeps its clients' (or its proxy's) connections open."""
    async def get(c):
        with contextlib.suppress(Exception):
            if hasattr(c, "ws_connect"):
                async with c.get(url + "/health") as r:
                    await r.read()
            else:
                await c.get(url + "/health")

    await asyncio.gather(*(get(clients[i % len(clients)]) for i in range(n)))


async def _drive(url: str, items, get_t0, *, model: str, max_concurrency: int, api_key=None,
                 timeout: float = 600.0, extra: dict | None = None, warm: bool = True) -> tuple:
    """Drive ``items`` at most ``max_concurrency`` at once from ``t0 = get_t0()`` (perf_counter; called once
    the connections are open); (t0, one Outcome each, the client's CPU seconds from t0). On aiohttp where it is installed: at hundreds of
    streams httpx's connection pool costs the client more than the server costs (an httpx client
    measured the client); httpx otherwise."""
    sem = asyncio.Semaphore(max_concurrency)
    endpoint = url.rstrip("/") + "/v1/completions"
    async with contextlib.AsyncExitStack() as stack:
        try:
            import aiohttp
        except ImportError:
            import httpx

            # Connection pools of POOL connections each: httpx's pool scans all of its connections on
            # every request and release.
            n_pools = math.ceil(max_concurrency / POOL)
            per = math.ceil(max_concurrency / n_pools)
            limits = httpx.Limits(max_connections=per, max_keepalive_connections=per)
            clients = [await stack.enter_async_context(httpx.AsyncClient(
                limits=limits, timeout=httpx.Timeout(None, connect=30), headers=_headers(api_key)))
                for _ in range(n_pools)]
        else:
            clients = [await stack.enter_async_context(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max_concurrency), headers=_headers(api_key),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30)))]
        if warm:
            await _warm(clients, url.rstrip("/"), min(max_concurrency, len(items)))
        t0 = get_t0()
        c0 = time.process_time()
        tasks = [asyncio.ensure_future(_one(clients[i % len(clients)], endpoint, it, model, t0, sem, extra or {}))
                 for i, it in enumerate(items)]
        finished, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + timeout - time.perf_counter()))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
    outs = []
    for t in tasks:
        if t in finished and not t.cancelled() and t.exception() is None:
            outs.append(t.result())
        else:
            o = Outcome()
            o.error = f"not finished within --timeout {timeout:g} s" if t in pending else repr(t.exception())
            outs.append(o)
    return t0, outs, time.process_time() - c0


def summarize(outs, t0: float, *, url: str, model: str, requests: int, max_concurrency: int) -> dict:
    """The run's metrics from its outcomes (times on one perf_counter clock, from ``t0``)."""
    from tritune.model.bench.workload import percentiles

    ok = [o for o in outs if o.ok]
    ends = [o.end for o in ok]
    elapsed = (max(ends) - t0) if ends else float("nan")
    out_tok, in_tok = sum(o.out_tokens for o in ok), sum(o.prompt_tokens for o in ok)
    errors = [o.error for o in outs if not o.ok]
    return {"url": url, "model": model, "requests": requests, "completed": len(ok), "errors": len(errors),
            "error_samples": sorted(set(errors))[:5], "max_concurrency": max_concurrency, "elapsed_s": elapsed,
            "prompt_tokens": in_tok, "output_tokens": out_tok,
            "output_tok_s": out_tok / elapsed if ok else 0.0, "total_tok_s": (in_tok + out_tok) / elapsed if ok else 0.0,
            "req_s": len(ok) / elapsed if ok else 0.0,
            "chunks": sum(len(o.gaps) + 1 for o in ok),
            "ttft_ms": percentiles([o.ttft for o in ok]), "itl_ms": percentiles([x for o in ok for x in o.itl]),
            "chunk_gap_ms": percentiles([x for o in ok for x in o.gaps]),
            "tpot_ms": percentiles([(o.e2e - o.ttft) / (o.out_tokens - 1) for o in ok if o.out_tokens > 1]),
            "e2e_ms": percentiles([o.e2e for o in ok])}


async def bench_async(url: str, items, *, model: str, max_concurrency: int = 256, api_key=None,
                      timeout: float = 600.0, extra: dict | None = None) -> dict:
    """Drive ``items`` (workload.Item: prompt_ids, output_len, arrival) against ``url`` from this one
    process; the run's metrics."""
    t0, outs, cpu = await _drive(url, items, lambda: time.perf_counter() + 0.05, model=model,
                                 max_concurrency=max_concurrency, api_key=api_key, timeout=timeout, extra=extra)
    r = summarize(outs, t0, url=url, model=model, requests=len(items), max_concurrency=max_concurrency)
    r["client"] = {"procs": 1, "cpu_busy": [round(cpu / (time.perf_counter() - t0), 3)], "lib": client_lib()}
    return r


def _shard(conn, url, items, kw) -> None:
    """A client process: its share of the items, started at the parent's t0; outcomes back over ``conn``.
    (perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process of the machine.)"""
    from tritune.model.bench.workload import Item

    items = [Item(p, o, a) for p, o, a in items]

    def get_t0():
        conn.send("ready")
        return conn.recv()

    t0, outs, cpu = asyncio.run(_drive(url, items, get_t0, **kw))
    wall = time.perf_counter() - t0
    conn.send(([(o.ok, o.error, o.ttft, o.itl, o.gaps, o.e2e, o.out_tokens, o.prompt_tokens, o.start, o.end)
                for o in outs], cpu, wall))
    conn.close()


def bench(url, items, *, procs: int = 1, max_concurrency: int = 256, **kw) -> dict:
    """The run's metrics; ``procs`` > 1 spreads the requests (round-robin) and the concurrency over that
    many client processes, so that one client's GIL is not the ceiling measured. ``client.cpu_busy``: each
    process's CPU time over the run's wall time (near 1.0: that client was saturated, the numbers are the
    client's, not the server's)."""
    if procs <= 1:
        return asyncio.run(bench_async(url, items, max_concurrency=max_concurrency, **kw))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")      # the caller may run threads (a server in-process): no fork
    procs = min(procs, len(items), max_concurrency)
    conc = [max_concurrency // procs + (k < max_concurrency % procs) for k in range(procs)]
    shards = [items[k::procs] for k in range(procs)]
    order = [i for k in range(procs) for i in range(k, len(items), procs)]
    workers = []
    for k in range(procs):
        a, b = ctx.Pipe()
        sk = [(it.prompt_ids, it.output_len, it.arrival) for it in shards[k]]
        p = ctx.Process(target=_shard, args=(b, url, sk, dict(kw, max_concurrency=conc[k])), daemon=True)
        p.start()
        workers.append((p, a))
    for _, a in workers:
        try:
            ok = a.poll(60) and a.recv() == "ready"
        except EOFError:    # it died (an import error, or the caller's __main__ is not import-safe)
            ok = False
        if not ok:
            for p, _ in workers:
                p.kill()
            raise RuntimeError("a client process did not start (spawned processes import the caller's "
                               "__main__: guard it with if __name__ == '__main__')")
    t0 = time.perf_counter() + 0.1
    for _, a in workers:
        a.send(t0)
    limit = kw.get("timeout", 600.0) + 60
    outs, busy = [], []
    for p, a in workers:
        if not a.poll(max(1.0, t0 + limit - time.perf_counter())):
            p.kill()
            raise RuntimeError("a client process did not finish")
        rows, cpu, wall = a.recv()
        p.join(10)
        busy.append(round(cpu / wall, 3))
        for r in rows:
            o = Outcome()
            (o.ok, o.error, o.ttft, o.itl, o.gaps, o.e2e, o.out_tokens, o.prompt_tokens, o.start, o.end) = r
            outs.append(o)
    outs = [o for _, o in sorted(zip(order, outs), key=lambda x: x[0])]
    r = summarize(outs, t0, url=url, model=kw["model"], requests=len(items), max_concurrency=max_concurrency)
    r["client"] = {"procs": procs, "cpu_busy": busy, "lib": client_lib()}
    return r


def client_lib() -> str:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


def default_procs(max_concurrency: int) -> int:
    """Client processes for a run: one per 32 streams, at most half the machine's cores (the rest are
    the server's)."""
    return max(1, min(math.ceil(max_concurrency / 32), (os.cpu_count() or 2) // 2))


def _fmt(p):
    return "n/a" if p["p50"] is None else f"{p['p50']:.1f}/{p['p95']:.1f}/{p['p99']:.1f}"


def run_url(args) -> int:
    """``tritune serve-bench --url``: the workload against a running server; prints and writes JSON."""
    from tritune.model.bench.workload import make_workload

    def fail(msg):
        print(f"tritune serve-bench: {msg}", file=sys.stderr)
        return 2

    try:
        import httpx
    except ImportError:
        return fail("--url needs httpx (pip install httpx)")
    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        return fail(f"--url: expected http://HOST:PORT, got {args.url!r}")
    if args.max_concurrency < 1:
        return fail(f"--max-concurrency: expected >= 1, got {args.max_concurrency}")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        info = asyncio.run(server_info(url, api_key))
    except (httpx.HTTPError, ValueError) as e:
        return fail(f"cannot reach {url}/v1/models: {e}")
    model = args.served_model or info["id"]
    vocab = args.vocab_size or info.get("vocab_size") or 50257
    try:
        items = make_workload(args.num_requests, args.prompt_len, args.output_len, vocab, args.seed, args.rate,
                              args.jsonl)
    except (OSError, ValueError) as e:
        return fail(str(e))
    ctx = info.get("max_model_len")
    too_long = [i for i, it in enumerate(items) if ctx and len(it.prompt_ids) + it.output_len > ctx]
    if too_long:
        return fail(f"{len(too_long)} request(s) exceed the server's context ({ctx}), e.g. #{too_long[0]}")
    w = {"requests": len(items), "prompt_len": list(args.prompt_len), "output_len": list(args.output_len),
         "jsonl": args.jsonl, "seed": args.seed, "rate": None if math.isinf(args.rate) else args.rate,
         "prompt_tokens": sum(len(it.prompt_ids) for it in items),
         "output_tokens": sum(it.output_len for it in items)}
    print(f"workload: {len(items)} requests, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens; "
          f"{url} ({model}), at most {args.max_concurrency} in flight", flush=True)
    procs = getattr(args, "client_procs", None) or default_procs(args.max_concurrency)
    if procs < 1:
        return fail(f"--client-procs: expected >= 1, got {procs}")
    r = bench(url, items, procs=procs, model=model, max_concurrency=args.max_concurrency, api_key=api_key,
              timeout=args.timeout)
    print(f"{r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s, {r['req_s']:.2f} req/s; "
          f"TTFT p50/p95/p99 {_fmt(r['ttft_ms'])} ms, ITL {_fmt(r['itl_ms'])} ms; {r['completed']} completed, "
          f"{r['errors']} errors" + (f" (e.g. {r['error_samples'][0]})" if r["errors"] else ""), flush=True)
    busy = r["client"]["cpu_busy"]
    print(f"client: {r['client']['procs']} {r['client']['lib']} process(es), CPU busy max {max(busy):.0%}"
          + (" (saturated: these numbers may be the client's, add --client-procs)" if max(busy) > 0.85 else ""),
          flush=True)
    if args.out:
        res = {"url": url, "model": model, "workload": w, "run": r,
               "command": "tritune serve-bench " + " ".join(sys.argv[2:]),
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return 1 if r["errors"] else 0


# ---------------------------------------------------------------------------------------------------
# The in-process side of an HTTP-vs-in-process comparison (run where the engine lives: this process, or
# an engine process through EngineProcess.call)
# ---------------------------------------------------------------------------------------------------
def run_inprocess(engine, items) -> dict:
    """``items`` ((prompt ids, output length, arrival) each) through ``engine`` in the calling thread,
    arrivals honoured; metrics defined as :func:`summarize` defines them over HTTP (TTFT from the arrival;
    inter-token latency: each gap between deliveries split evenly over the tokens it brought)."""
    from tritune.model.engine.scheduler import SamplingParams
    from tritune.model.bench.workload import percentiles

    items = [tuple(it) for it in items]
    n = len(items)
    deliveries = [[] for _ in range(n)]      # (time, tokens) per request, one entry per step that fed it
    touched: dict = {}

    def cb(i, req, tok):
        if tok is not None:
            touched[i] = touched.get(i, 0) + 1

    _sync()
    pending = sorted(range(n), key=lambda i: items[i][2])
    reqs = [None] * n
    t0 = time.perf_counter()
    k = 0
    while k < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while k < n and items[pending[k]][2] <= now:
            i = pending[k]
            ids, out_len, arrival = items[i]
            reqs[i] = engine.add_request(ids, SamplingParams(max_new_tokens=out_len, ignore_eos=True),
                                         stream=lambda req, tok, i=i: cb(i, req, tok), arrival_time=t0 + arrival)
            k += 1
        if engine.has_unfinished():
            engine.step()
            t = time.perf_counter()
            for i, c in touched.items():
                deliveries[i].append((t, c))
            touched.clear()
        elif k < n:
            time.sleep(max(0.0, items[pending[k]][2] - (time.perf_counter() - t0)))
    elapsed = time.perf_counter() - t0
    ttft, itl, gaps, tpot = [], [], [], []
    for i, d in enumerate(deliveries):
        ttft.append(d[0][0] - (t0 + items[i][2]))
        for (ta, _), (tb, c) in zip(d, d[1:]):
            gaps.append(tb - ta)
            itl.extend([(tb - ta) / c] * c)
        m = sum(c for _, c in d)
        if m > 1:
            tpot.append((d[-1][0] - d[0][0]) / (m - 1))
    out = sum(len(r.output_ids) for r in reqs)
    inp = sum(len(r.prompt_ids) for r in reqs)
    P = percentiles
    return {"requests": n, "elapsed_s": elapsed, "prompt_tokens": inp, "output_tokens": out,
            "output_tok_s": out / elapsed, "total_tok_s": (inp + out) / elapsed, "req_s": n / elapsed,
            "ttft_ms": P(ttft), "itl_ms": P(itl), "chunk_gap_ms": P(gaps), "tpot_ms": P(tpot)}


def _sync():
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_memory(engine=None) -> dict:
    """This process's RSS, and its GPU memory where it has CUDA (called where the engine lives)."""
    rss = float("nan")
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    out = {"rss_mb": round(rss, 1)}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        out.update(gpu_allocated_mb=round(torch.cuda.memory_allocated() / 2**20, 1),
                   gpu_reserved_mb=round(torch.cuda.memory_reserved() / 2**20, 1),
                   gpu_used_mb=round((total - free) / 2**20, 1))
    return out


def stand_in_tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` entries (w0, w1, ...) for models without one (random weights,
    the stub): decoding costs what a Rust decode costs."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from tritune.model.tokenizer import Tokenizer

    return Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0")))


def bench_engine(*, kind: str, engine: dict, stub: dict | None = None, model: str | None = None,
                 dtype: str = "bfloat16"):
    """The engine a benchmark serves, from plain data (so an engine process builds the same one):
    ``kind`` "stub" (stub.StubEngine(**stub)), "random" (GPT-2 small's config, random weights, triton
    backend on the GPU, with a stand-in tokenizer) or "checkpoint" (``model`` on the triton backend on a GPU,
    torch on the CPU; any family :func:`tritune.model.load.load_model` runs)."""
    import torch

    if kind == "stub":
        from tritune.model.serve.stub import StubEngine

        return StubEngine(**(stub or {}))
    from tritune.model.engine.engine import Engine
    from tritune.model.load import set_cpu_threads

    gpu = torch.cuda.is_available()
    dt = getattr(torch, dtype) if gpu else torch.float32
    set_cpu_threads()       # the cores are shared with the API process (see tritune.model.load)
    if kind == "random":
        from tritune.model.bench.runs import build_model, load_models

        config, state, _ = load_models(None, dt, "cuda", need_hf=False)
        model_ = build_model(config, state, "triton", dt, "cuda")
        tok = stand_in_tokenizer(config.vocab_size)
    elif kind == "checkpoint":
        from tritune.model.load import load_model
        from tritune.model.tokenizer import Tokenizer

        model_ = load_model(model, backend="triton" if gpu else "torch", dtype=dt)
        tok = Tokenizer.from_dir(model_.directory)
    else:
        raise ValueError(f"kind: expected 'stub', 'random' or 'checkpoint', got {kind!r}")
    return Engine(model_, tokenizer=tok, **engine)


def warm_up_engine(engine) -> None:
    """serve-bench's warm-up (every kernel variant compiled, the CUDA graphs captured): on a GPU only.
    Then a log of Triton compiles stays on (:func:`jit_compiles`): any variant met after the server said
    ready is a compile a request waited for."""
    import torch

    if torch.cuda.is_available() and getattr(engine.model, "backend", None) == "triton":
        from tritune.model.serve.warmup import warm_up

        t0 = time.perf_counter()
        warm_up(engine, engine.config.vocab_size, engine.config.n_positions // 2)
        engine.notes.append(f"warm-up {time.perf_counter() - t0:.1f} s")
    from tritune.model.bench.runs import CompileLog

    log = CompileLog()
    log.__enter__()     # on for the engine's life (this process serves nothing else)
    engine._compile_log = log


def jit_compiles(engine, since: int = 0) -> dict:
    """Triton compiles (kernel-cache misses) since the warm-up ended, from the ``since``-th on: count, by
    kernel, the first few with their constexprs (called where the engine lives)."""
    log = getattr(engine, "_compile_log", None)
    if log is None:
        return {"count": None}
    ev = log.events[since:]
    out = {"total": len(log.events), "count": len(ev), "by_kernel": {}, "first": ev[:4]}
    for e in ev:
        out["by_kernel"][e["kernel"]] = out["by_kernel"].get(e["kernel"], 0) + 1
    return out
