"""``tritune serve-bench --url``: serve-bench's workload against any OpenAI-compatible server, over HTTP.

The same workload generator as the in-process serve-bench (``make_workload``: lengths drawn from ranges or
read from a JSONL file, Poisson arrivals at ``--rate``), sent as token-id prompts to ``POST
/v1/completions`` with ``stream: true``, greedy, ``ignore_eos`` (a vLLM-style extension, so each request
runs to its output length where the server honours it), at most ``--max-concurrency`` in flight. Measured
per request from its scheduled arrival: TTFT (the first chunk with output), inter-token latency (each
gap between chunks, divided evenly over the tokens it brought: a server that sends several tokens per
chunk is not flattered by zero gaps), end-to-end latency, output tokens (the usage block, else the
chunks' ``token_ids``, else one per chunk); overall: output and total tok/s, req/s, errors.
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


async def _one(client, url, item, model, t0, sem, extra) -> Outcome:
    o = Outcome()
    body = {"model": model, "prompt": item.prompt_ids, "max_tokens": item.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "return_token_ids": True, **extra}
    delay = t0 + item.arrival - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    arrival = t0 + item.arrival
    async with sem:
        o.start = time.perf_counter()
        last, chunks, usage = None, 0, None
        try:
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    o.error = f"HTTP {r.status_code}: {text[:200]}"
                    return o
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        o.error = f"stream error: {ev['error']}"[:300]
                        return o
                    if ev.get("usage"):
                        usage = ev["usage"]
                    for ch in ev.get("choices") or ():
                        k = len(ch["token_ids"]) if ch.get("token_ids") is not None else (1 if ch.get("text") else 0)
                        if not k:
                            continue
                        now = time.perf_counter()
                        if last is None:
                            o.ttft = now - arrival
                        else:
                            o.gaps.append(now - last)
                            o.itl.extend([(now - last) / k] * k)
                        last = now
                        chunks += k
                if not done:
                    o.error = "the stream ended without data: [DONE]"
                    return o
        except Exception as e:  # noqa: BLE001 (one request's failure is a data point, not the end of the run)
            o.error = f"{type(e).__name__}: {e}"[:300]
            return o
        o.end = time.perf_counter()
        o.e2e = o.end - arrival
        o.out_tokens = int(usage["completion_tokens"]) if usage else chunks
        o.prompt_tokens = int(usage["prompt_tokens"]) if usage else len(item.prompt_ids)
        o.ok = True
        return o


async def bench_async(url: str, items, *, model: str, max_concurrency: int = 256, api_key=None,
                      timeout: float = 600.0, extra: dict | None = None) -> dict:
    """Drive ``items`` (workload.Item: prompt_ids, output_len, arrival) against ``url``; the run's metrics."""
    import httpx

    from tritune.model.workload import percentiles

    sem = asyncio.Semaphore(max_concurrency)
    endpoint = url.rstrip("/") + "/v1/completions"
    # Connection pools of POOL connections each: httpx's pool scans all of its connections on every
    # request and release, which at hundreds of streams costs the client more than the server.
    n_pools = math.ceil(max_concurrency / POOL)
    limits = httpx.Limits(max_connections=math.ceil(max_concurrency / n_pools),
                          max_keepalive_connections=math.ceil(max_concurrency / n_pools))
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(None, connect=30), headers=_headers(api_key)))
            for _ in range(n_pools)]
        t0 = time.perf_counter() + 0.05
        tasks = [asyncio.ensure_future(_one(clients[i % n_pools], endpoint, it, model, t0, sem, extra or {}))
                 for i, it in enumerate(items)]
        finished, pending = await asyncio.wait(tasks, timeout=timeout)
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
    ok = [o for o in outs if o.ok]
    ends = [o.end for o in ok]
    elapsed = (max(ends) - t0) if ends else float("nan")
    out_tok, in_tok = sum(o.out_tokens for o in ok), sum(o.prompt_tokens for o in ok)
    errors = [o.error for o in outs if not o.ok]
    return {"url": url, "model": model, "requests": len(items), "completed": len(ok), "errors": len(errors),
            "error_samples": sorted(set(errors))[:5], "max_concurrency": max_concurrency, "elapsed_s": elapsed,
            "prompt_tokens": in_tok, "output_tokens": out_tok,
            "output_tok_s": out_tok / elapsed if ok else 0.0, "total_tok_s": (in_tok + out_tok) / elapsed if ok else 0.0,
            "req_s": len(ok) / elapsed if ok else 0.0,
            "ttft_ms": percentiles([o.ttft for o in ok]), "itl_ms": percentiles([x for o in ok for x in o.itl]),
            "chunk_gap_ms": percentiles([x for o in ok for x in o.gaps]),
            "tpot_ms": percentiles([(o.e2e - o.ttft) / (o.out_tokens - 1) for o in ok if o.out_tokens > 1]),
            "e2e_ms": percentiles([o.e2e for o in ok])}


def bench(url, items, **kw) -> dict:
    return asyncio.run(bench_async(url, items, **kw))


def _fmt(p):
    return "n/a" if p["p50"] is None else f"{p['p50']:.1f}/{p['p95']:.1f}/{p['p99']:.1f}"


def run_url(args) -> int:
    """``tritune serve-bench --url``: the workload against a running server; prints and writes JSON."""
    from tritune.model.workload import make_workload

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
    r = bench(url, items, model=model, max_concurrency=args.max_concurrency, api_key=api_key,
              timeout=args.timeout)
    print(f"{r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s, {r['req_s']:.2f} req/s; "
          f"TTFT p50/p95/p99 {_fmt(r['ttft_ms'])} ms, ITL {_fmt(r['itl_ms'])} ms; {r['completed']} completed, "
          f"{r['errors']} errors" + (f" (e.g. {r['error_samples'][0]})" if r["errors"] else ""), flush=True)
    if args.out:
        res = {"url": url, "model": model, "workload": w, "run": r,
               "command": "tritune serve-bench " + " ".join(sys.argv[2:]),
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")
    return 1 if r["errors"] else 0
