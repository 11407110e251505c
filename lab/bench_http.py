"""What HTTP costs: ``tritune serve`` against the same engine in-process (GPU; bounded time).

  python lab/bench_http.py OUTDIR [--model DIR] [--requests 512] [--clients 256] [--time-limit 540]
  python lab/bench_http.py OUTDIR --stub [--stub-rate 55000] [--decode-steps 16]   (any machine: no model)

``--stub``: model/serve_stub.py's engine makes tokens at a fixed rate, so what is measured is the HTTP
path alone (parsing, detokenizing, SSE, sockets, the GIL shared by the event loop and the engine thread).
The client is serve-bench --url over several processes (aiohttp where installed, connections opened
before the clock starts); each reports its CPU busy share, and this process's CPU over the run is the
server's (near 100%: the server is the ceiling; a client near 100%: the client is, add --client-procs).

1. One engine (triton backend, CUDA graphs, bf16; GPT-2 small's config with random weights unless
   ``--model``), warmed up as serve-bench does. Without ``--model`` there is no tokenizer, so a word-level
   ``tokenizers`` vocabulary of the model's size stands in (decoding costs what a Rust decode costs).
2. The workload (serve-bench's generator: ``--requests`` requests, prompt and output lengths uniform in
   the ranges, ``--rate`` Poisson arrivals, greedy, EOS ignored), ``--rounds`` times alternately:
   in-process (``add_request`` with a stream callback; TTFT from the arrival, inter-token latency as
   serve-bench --url defines it: each gap between deliveries split evenly over the tokens it brought)
   and over HTTP (the server in a thread of this process, as ``tritune serve`` runs it; the client is
   ``tritune serve-bench --url`` in a subprocess, so it does not share this process's GIL). Reported: the
   HTTP/in-process ratio of output tok/s (target: HTTP costs <= 10%).
3. ``--clients`` concurrent streaming clients, twice (1024 requests, shorter outputs), then as many
   streams that disconnect after their first chunk: errors, KV blocks in use afterwards (must be 0),
   process RSS and GPU memory before and after each (flat: no growth from one round to the next).
JSON: OUTDIR/bench_http_<date>_<commit>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tritune.model import serve as S
from tritune.model.http_bench import Outcome  # noqa: F401  (fails early when the serve extra is missing)
from tritune.model.scheduler import SamplingParams
from tritune.model.server import create_app


def _git(*a) -> str:
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory() -> dict:
    if not torch.cuda.is_available():
        return {"rss_mb": round(rss_mb(), 1)}
    free, total = torch.cuda.mem_get_info()
    return {"rss_mb": round(rss_mb(), 1), "gpu_allocated_mb": round(torch.cuda.memory_allocated() / 2**20, 1),
            "gpu_reserved_mb": round(torch.cuda.memory_reserved() / 2**20, 1),
            "gpu_used_mb": round((total - free) / 2**20, 1)}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def stand_in_tokenizer(vocab: int):
    """A word-level tokenizer of ``vocab`` entries (w0, w1, ...) for random-weight models."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from tritune.model.tokenizer import Tokenizer

    return Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0")))


# ---------------------------------------------------------------------------------------------------
def run_inprocess(engine, items) -> dict:
    """The workload through the engine in this thread; metrics defined as http_bench defines them."""
    n = len(items)
    deliveries = [[] for _ in range(n)]      # (time, tokens) per request, one entry per step that fed it
    touched: dict = {}

    def cb(i, req, tok):
        if tok is not None:
            touched[i] = touched.get(i, 0) + 1

    pending = sorted(range(n), key=lambda i: items[i].arrival)
    reqs = [None] * n
    _sync()
    t0 = time.perf_counter()
    k = 0
    while k < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while k < n and items[pending[k]].arrival <= now:
            i = pending[k]
            it = items[i]
            reqs[i] = engine.add_request(it.prompt_ids, SamplingParams(max_new_tokens=it.output_len, ignore_eos=True),
                                         stream=lambda req, tok, i=i: cb(i, req, tok), arrival_time=t0 + it.arrival)
            k += 1
        if engine.has_unfinished():
            engine.step()
            t = time.perf_counter()
            for i, c in touched.items():
                deliveries[i].append((t, c))
            touched.clear()
        elif k < n:
            time.sleep(max(0.0, items[pending[k]].arrival - (time.perf_counter() - t0)))
    elapsed = time.perf_counter() - t0
    ttft, itl, gaps, tpot = [], [], [], []
    for i, d in enumerate(deliveries):
        ttft.append(d[0][0] - (t0 + items[i].arrival))
        for (ta, _), (tb, c) in zip(d, d[1:]):
            gaps.append(tb - ta)
            itl.extend([(tb - ta) / c] * c)
        m = sum(c for _, c in d)
        if m > 1:
            tpot.append((d[-1][0] - d[0][0]) / (m - 1))
    out = sum(len(r.output_ids) for r in reqs)
    inp = sum(len(r.prompt_ids) for r in reqs)
    P = S.percentiles
    return {"requests": n, "elapsed_s": elapsed, "prompt_tokens": inp, "output_tokens": out,
            "output_tok_s": out / elapsed, "total_tok_s": (inp + out) / elapsed, "req_s": n / elapsed,
            "ttft_ms": P(ttft), "itl_ms": P(itl), "chunk_gap_ms": P(gaps), "tpot_ms": P(tpot)}


class ThreadServer:
    def __init__(self, app, stack: str = "auto"):
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        loop, http = ("auto", "auto") if stack == "auto" else stack.split("+")
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, loop=loop, http=http))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if time.time() - t0 > 60 or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


def write_jsonl(path: Path, items) -> None:
    path.write_text("".join(json.dumps({"prompt_ids": it.prompt_ids, "max_new_tokens": it.output_len,
                                        "arrival": it.arrival}) + "\n" for it in items))


def cpu_s() -> float:
    """CPU seconds of this process (all its threads: the server's event loop and the engine's loop)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def client(url, jsonl: Path, n: int, concurrency: int, out: Path, timeout: float, procs: int | None = None) -> dict:
    """``tritune serve-bench --url`` in a subprocess (its own GIL; it spreads the streams over ``procs``
    client processes); its JSON, with ``server_cpu_busy``: this process's CPU time over the run's wall."""
    cmd = [sys.executable, "-m", "tritune.harness.cli", "serve-bench", "--url", url, "--jsonl", str(jsonl),
           "-n", str(n), "--max-concurrency", str(concurrency), "--timeout", str(max(10.0, timeout)),
           "--out", str(out)] + (["--client-procs", str(procs)] if procs else [])
    c0, w0 = cpu_s(), time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    c1, w1 = cpu_s(), time.perf_counter()
    print(p.stdout.strip(), p.stderr.strip()[-2000:], sep="\n", flush=True)
    if not out.is_file():
        return {"error": f"serve-bench --url exited {p.returncode} without results", "stderr": p.stderr[-2000:]}
    run = json.loads(out.read_text())["run"]
    # over the client's timed span (the server idles while the client starts: its loop waits on an event)
    run["server_cpu_busy"] = round((c1 - c0) / (run.get("elapsed_s") or (w1 - w0)), 3)
    run["chunks_s"] = run.get("chunks", 0) / run["elapsed_s"] if run.get("elapsed_s") else None
    return run


async def _disconnecting(url, model, items) -> dict:
    """One stream per item, each closed after its first chunk with output."""
    import httpx

    limits = httpx.Limits(max_connections=len(items), max_keepalive_connections=0)
    got, errors = 0, []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120, connect=30)) as c:
        async def one(it):
            nonlocal got
            body = {"model": model, "prompt": it.prompt_ids, "max_tokens": it.output_len, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            try:
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}")
                        return
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            got += 1
                            return      # leaving the block closes the connection mid-stream
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}"[:200])

        await asyncio.gather(*(one(it) for it in items))
    return {"streams": len(items), "got_first_chunk": got, "errors": len(errors), "error_samples": errors[:5]}


def _ms(p: dict, *keys) -> str:
    return "/".join("n/a" if p.get(k) is None else f"{p[k]:.2f}" for k in keys)


def wait_idle(server_state, timeout=60.0) -> float:
    t0 = time.time()
    while server_state.loop.in_flight or server_state.loop.load["running"] or server_state.loop.load["waiting"]:
        if time.time() - t0 > timeout:
            break
        time.sleep(0.05)
    return time.time() - t0


# ---------------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir")
    p.add_argument("--model", default=None, help="checkpoint directory (default: GPT-2 small config, random)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=S.parse_range, default=(64, 512))
    p.add_argument("--output-len", type=S.parse_range, default=(64, 512))
    p.add_argument("--rate", type=float, default=math.inf)
    p.add_argument("--rounds", type=int, default=2, help="in-process / HTTP pairs")
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-memory-fraction", type=float, default=0.4)
    p.add_argument("--time-limit", type=float, default=540.0, help="seconds for everything")
    p.add_argument("--smoke", action="store_true", help="no GPU: the packaged model on the torch backend, a "
                   "tiny workload (checks this driver, measures nothing)")
    p.add_argument("--stub", action="store_true", help="no model: model/serve_stub.py's engine makes tokens at "
                   "--stub-rate (the HTTP path's own ceiling; runs on any machine)")
    p.add_argument("--stub-rate", type=float, default=55000.0, help="stub tokens/s in total (default 55000: "
                   "the engine's in-process rate on an H100 for GPT-2 small; inf: no pacing)")
    p.add_argument("--decode-steps", type=int, default=16, help="stub: tokens per request per step (the "
                   "engine's graph path gives 16)")
    p.add_argument("--client-procs", type=int, default=None, help="client processes (default: serve-bench's)")
    p.add_argument("--skip-clients", action="store_true", help="only the in-process / HTTP rounds")
    p.add_argument("--stack", default="auto", choices=("auto", "asyncio+h11", "uvloop+httptools"),
                   help="uvicorn's event loop + HTTP parser (auto: uvloop + httptools when installed)")
    args = p.parse_args()
    if args.smoke:
        args.requests, args.prompt_len, args.output_len, args.clients, args.rounds = 16, (4, 32), (4, 32), 8, 1
    t_start = time.time()

    def left():
        return args.time_limit - (time.time() - t_start)

    gpu = torch.cuda.is_available() and not args.stub
    if not gpu and not (args.smoke or args.stub):
        print("bench_http: needs a CUDA GPU (or --smoke, or --stub)", file=sys.stderr)
        return 2
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    stamp = time.strftime("%Y-%m-%d")
    res_path = out / f"bench_http_{stamp}_{commit}.json"
    from tritune.harness import device as hdev

    dtype = torch.bfloat16
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "gpu": hdev.gpu_name() if gpu else "cpu",
           "torch": torch.__version__, "command": " ".join(sys.argv)}

    def save():
        res_path.write_text(json.dumps(res, indent=2))

    # -- the engine ---------------------------------------------------------------------------------
    from tritune.model.engine import Engine

    t0 = time.perf_counter()
    if args.stub:
        from tritune.model.serve_stub import StubEngine

        engine = StubEngine(rate=args.stub_rate, decode_steps=args.decode_steps, max_num_seqs=args.max_num_seqs)
        config = engine.config
        tok = stand_in_tokenizer(config.vocab_size)
    elif args.model or args.smoke:
        from tritune.model.cli import default_model_dir
        from tritune.model.gpt2 import GPT2
        from tritune.model.tokenizer import Tokenizer

        if not gpu:
            dtype = torch.float32
        model = GPT2.from_pretrained(args.model or default_model_dir(), backend="triton" if gpu else "torch",
                                     dtype=dtype)
        tok = Tokenizer.from_dir(model.directory)
        config = model.config
    else:
        config, state, _ = S.load_models(None, dtype, "cuda", need_hf=False)
        model = S.build_model(config, state, "triton", dtype, "cuda")
        tok = stand_in_tokenizer(config.vocab_size)
    if not args.stub:
        kv = {"kv_memory_fraction": args.kv_memory_fraction} if gpu else {"num_blocks": 1024}
        engine = Engine(model, max_num_seqs=args.max_num_seqs, max_batch_tokens=8192, cuda_graphs=True,
                        tokenizer=tok, **kv)
    if gpu:     # the kernels' variants compiled and the graphs captured before anything is timed
        S.warm_up(engine, config.vocab_size, config.n_positions // 2)
    from tritune.model.server import http_stack

    res["server_stack"] = http_stack() if args.stack == "auto" else args.stack
    res["engine"] = engine.describe()
    res["dtype"] = res["engine"]["dtype"]
    res["setup_s"] = time.perf_counter() - t0
    print(f"engine ready in {res['setup_s']:.1f} s: {res['engine']}", flush=True)

    items = S.make_workload(args.requests, args.prompt_len, args.output_len, config.vocab_size, 0, args.rate)
    jsonl = out / "workload.jsonl"
    write_jsonl(jsonl, items)
    res["workload"] = {"requests": len(items), "prompt_len": list(args.prompt_len),
                       "output_len": list(args.output_len), "rate": None if math.isinf(args.rate) else args.rate,
                       "prompt_tokens": sum(len(it.prompt_ids) for it in items),
                       "output_tokens": sum(it.output_len for it in items)}

    app = create_app(engine, tok, "bench", max_queue=8192)
    srv = app.state.server
    sys.setswitchinterval(0.001)        # as `tritune serve` runs
    server = ThreadServer(app, args.stack)
    try:
        # -- in-process vs HTTP, alternately ------------------------------------------------------
        res["rounds"] = []
        with srv.loop.paused():     # untimed: the first forwards of this process (allocator, lazy inits)
            run_inprocess(engine, items[:4])
        for r in range(args.rounds):
            if left() < (10 if args.smoke else 90):
                res["note"] = f"stopped after {r} round(s): time limit"
                break
            # the server's engine thread must be idle while this thread drives the engine directly
            wait_idle(srv)
            with srv.loop.paused():     # the engine is not thread-safe: its loop thread parks meanwhile
                inproc = run_inprocess(engine, items)
            print(f"[round {r}] in-process: {inproc['output_tok_s']:.0f} output tok/s, TTFT p50/p99 "
                  f"{_ms(inproc['ttft_ms'], 'p50', 'p99')} ms, ITL p50/p99 {_ms(inproc['itl_ms'], 'p50', 'p99')} ms",
                  flush=True)
            http = client(server.url, jsonl, len(items), len(items), out / f"http_round{r}.json", min(300, left() - 30),
                          args.client_procs)
            row = {"in_process": inproc, "http": http}
            if "output_tok_s" in http:
                row["http_over_in_process"] = http["output_tok_s"] / inproc["output_tok_s"]
                row["http_cost"] = 1 - row["http_over_in_process"]
                print(f"[round {r}] HTTP: {http['output_tok_s']:.0f} output tok/s ({row['http_cost']:+.1%} cost), "
                      f"{http['chunks_s']:.0f} SSE chunks/s, TTFT p50/p99 {_ms(http['ttft_ms'], 'p50', 'p99')} ms, "
                      f"ITL p50/p99 {_ms(http['itl_ms'], 'p50', 'p99')} ms, {http['errors']} errors; "
                      f"server CPU {http['server_cpu_busy']:.0%}, clients {http['client']['procs']} x CPU max "
                      f"{max(http['client']['cpu_busy']):.0%}", flush=True)
            res["rounds"].append(row)
            save()
        costs = [r["http_cost"] for r in res["rounds"] if "http_cost" in r]
        if costs:
            res["http_cost_best"] = min(costs)
            res["target_http_cost_le_10pct"] = min(costs) <= 0.10
        wait_idle(srv)
        res["kv_blocks_used_after_rounds"] = engine.pool.num_used
        if args.skip_clients:
            return 0

        # -- many concurrent streaming clients: errors, leaks, memory --------------------------------
        lens = (16, min(256, config.n_positions // 2))
        many = S.make_workload(4 * args.clients, lens, lens, config.vocab_size, 1)
        many_jsonl = out / "workload_clients.jsonl"
        write_jsonl(many_jsonl, many)
        res["clients"] = {"clients": args.clients, "requests": len(many), "rounds": []}
        _sync()
        mem0 = memory()
        for r in range(2):
            if left() < (10 if args.smoke else 60):
                res["clients"]["note"] = "stopped early: time limit"
                break
            run = client(server.url, many_jsonl, len(many), args.clients, out / f"clients_round{r}.json",
                         min(240, left() - 30), args.client_procs)
            waited = wait_idle(srv)
            gone = asyncio.run(_disconnecting(server.url, "bench", many[:args.clients]))
            waited += wait_idle(srv)
            _sync()
            row = {"run": {k: run.get(k) for k in ("completed", "errors", "error_samples", "output_tok_s",
                                                   "ttft_ms", "itl_ms")},
                   "disconnects": gone, "idle_wait_s": round(waited, 2), "kv_blocks_used_after": engine.pool.num_used,
                   "in_flight_after": srv.loop.in_flight, "memory_after": memory()}
            print(f"[clients {r}] {row['run']}, disconnects {gone}, KV blocks used after: "
                  f"{row['kv_blocks_used_after']}, memory {row['memory_after']}", flush=True)
            res["clients"]["rounds"].append(row)
            save()
        res["clients"]["memory_before"] = mem0
        rows = res["clients"]["rounds"]
        if rows:
            res["clients"]["ok"] = (all(x["run"].get("errors") == 0 and x["disconnects"]["errors"] == 0
                                        and x["kv_blocks_used_after"] == 0 for x in rows))
            last = rows[-1]["memory_after"]
            res["clients"]["growth"] = {k: round(last[k] - mem0[k], 1) for k in mem0}
            if len(rows) > 1:
                res["clients"]["growth_second_round"] = {k: round(last[k] - rows[0]["memory_after"][k], 1)
                                                         for k in mem0}
    finally:
        server.close()
        save()
        costs = [f"{r['http_cost']:+.1%}" for r in res.get("rounds", ()) if "http_cost" in r]
        cl = res.get("clients", {})
        print(f"SUMMARY {res.get('server_stack')}: HTTP cost per round {costs} (target <= 10%: "
              f"{'met' if res.get('target_http_cost_le_10pct') else 'NOT met'}); {args.clients} clients ok: "
              f"{cl.get('ok')}, KV blocks after {[x['kv_blocks_used_after'] for x in cl.get('rounds', ())]}, "
              f"memory growth {cl.get('growth')} (2nd round {cl.get('growth_second_round')})", flush=True)
        print(f"wrote {res_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
