"""What HTTP costs: ``tritune serve`` against the same engine in-process, with the engine in its own
process and in a thread of the server (GPU; bounded time).

  python benchmarks/bench_http.py [--results DIR] [--model DIR] [--requests 512] [--clients 256] [--modes process,thread]
  python benchmarks/bench_http.py --stub [--stub-rate 55000] [--decode-steps 16] [--stub-host-ms 0]
                                                                        (any machine: no model)

``--stub``: model/serve/stub.py's engine makes tokens at a fixed rate, so what is measured is the HTTP
path alone (parsing, detokenizing, SSE, sockets; in the thread mode, the GIL shared by the event loop and
the engine thread: ``--stub-host-ms`` makes each stub step hold it as the engine's host work does).
The client is serve-bench --url over several processes (aiohttp where installed, connections opened
before the clock starts); each reports its CPU busy share (near 100%: the client is the ceiling, add
--client-procs), and the server's processes theirs (the API process; the engine process in that mode).

For each ``--modes`` entry (process: ``EngineProcess``, the engine in a spawned process; thread: the
engine stepped by a thread of the server's process), one after the other (one engine at a time on the GPU):
1. One engine (triton backend, CUDA graphs, bf16; GPT-2 small's config with random weights unless
   ``--model``, with a word-level stand-in tokenizer of the model's vocabulary), warmed up as serve-bench
   does, where it serves (in the engine process in the process mode).
2. The workload (serve-bench's generator: ``--requests`` requests, prompt and output lengths uniform in
   the ranges, ``--rate`` Poisson arrivals, greedy, EOS ignored), ``--rounds`` times alternately:
   in-process (``add_request`` with a stream callback, in the process that holds the engine, the server's
   loop parked meanwhile; TTFT from the arrival, inter-token latency as serve-bench --url defines it) and
   over HTTP (the server in a thread of this process, as ``tritune serve`` runs it; the client is
   ``tritune serve-bench --url`` in a subprocess). Reported: the HTTP/in-process ratio of output tok/s
   (target: HTTP costs <= 10%).
   ``--rounds`` in the process mode, ``--thread-rounds`` in the thread mode.
3. In the ``--soak-mode`` (default: the first mode): ``--clients`` concurrent streaming clients, twice
   (``--soak-requests`` each, ``--soak-len`` tokens), each time followed by as many streams that disconnect
   after their first chunk: errors, KV blocks in use afterwards (must be 0), memory of the server's
   processes before and after each (flat: the second round's growth over the first's).
The defaults fit ``--time-limit`` 280 s on an H100 (engine builds and warm-ups included).
One keyed row per mode (benchmarks/rows.py: commit, date, GPU, versions) appended to
results/<gpu-slug>/http.json (``--stub``: http_stub.json), the workload and the soak as its top-level fields;
the workload file and serve-bench's own JSON per round in a temporary folder (``--work`` to keep them).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

import torch

from tritune.model.bench import serve_bench as S
from tritune.model.bench.http import engine_memory, run_inprocess, stand_in_tokenizer
from tritune.model.serve.server import create_app


def _git(*a) -> str:
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return ""


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
    """CPU seconds of this process (all its threads: the server's event loop, and the engine's loop thread
    in the thread mode)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid) -> float:
    """CPU seconds of another process (the engine process)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client(url, jsonl: Path, n: int, concurrency: int, out: Path, timeout: float, procs: int | None = None,
           engine_pid=None) -> dict:
    """``tritune serve-bench --url`` in a subprocess (its own GIL; it spreads the streams over ``procs``
    client processes); its JSON, with ``server_cpu_busy`` (this process's CPU time over the run's wall) and
    ``engine_cpu_busy`` (the engine process's, in the process mode)."""
    cli = "import sys; from tritune.harness.cli import main; sys.exit(main())"     # `tritune` in this interpreter
    cmd = [sys.executable, "-c", cli, "serve-bench", "--url", url, "--jsonl", str(jsonl), "-n", str(n),
           "--max-concurrency", str(concurrency), "--timeout", str(max(10.0, timeout)), "--out", str(out)]
    cmd += ["--client-procs", str(procs)] if procs else []
    c0, e0, w0 = cpu_s(), proc_cpu_s(engine_pid), time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    c1, e1, w1 = cpu_s(), proc_cpu_s(engine_pid), time.perf_counter()
    print(p.stdout.strip(), p.stderr.strip()[-2000:], sep="\n", flush=True)
    if not out.is_file():
        return {"error": f"serve-bench --url exited {p.returncode} without results", "stderr": p.stderr[-2000:]}
    run = json.loads(out.read_text())["run"]
    # over the client's timed span (the server idles while the client starts)
    span = run.get("elapsed_s") or (w1 - w0)
    run["server_cpu_busy"] = round((c1 - c0) / span, 3)
    run["engine_cpu_busy"] = round((e1 - e0) / span, 3) if engine_pid is not None else None
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
class Served:
    """One mode's engine and server: ``mode`` "process" (EngineProcess) or "thread"."""

    def __init__(self, mode: str, spec: dict, tok, stack: str, start_timeout: float, arrival_steps: int = 2):
        from tritune.model.bench.http import bench_engine, warm_up_engine
        from tritune.model.serve.proc import EngineProcess

        self.mode = mode
        t0 = time.perf_counter()
        if mode == "process":
            sys.setswitchinterval(0.005)    # the API process alone: Python's default
            self.engine = EngineProcess("tritune.model.bench.http:bench_engine", spec,
                                        warm_up="tritune.model.bench.http:warm_up_engine",
                                        start_timeout=start_timeout, arrival_steps=arrival_steps or None)
        else:
            sys.setswitchinterval(0.001)    # as `tritune serve` runs the thread mode
            self.engine = bench_engine(**spec)
            warm_up_engine(self.engine)
        self.app = create_app(self.engine, tok, "bench", max_queue=8192)
        self.srv = self.app.state.server
        self.server = ThreadServer(self.app, stack)
        while self.srv.warming == "warming up":     # the engine process's warm-up
            if time.perf_counter() - t0 > start_timeout:
                raise RuntimeError(f"{mode}: the engine was not warm within {start_timeout:g} s")
            time.sleep(0.1)
        if self.srv.warming is not None:
            raise RuntimeError(f"{mode}: {self.srv.warming}")
        self.setup_s = time.perf_counter() - t0
        self.pid = self.engine.pid if mode == "process" else None
        self.describe = self.engine.describe()

    def inprocess(self, items, timeout: float) -> dict:
        """The workload through the engine where it lives, the server's loop parked (thread) or the engine
        process between two steps (process)."""
        tuples = [(it.prompt_ids, it.output_len, it.arrival) for it in items]
        if self.mode == "process":
            ep = self.engine
            return ep.run_sync(ep.call("tritune.model.bench.http:run_inprocess", tuples, timeout=timeout),
                               timeout + 10)
        with self.srv.loop.paused():    # the engine is not thread-safe: its loop thread parks meanwhile
            return run_inprocess(self.engine, tuples)

    def blocks_used(self):
        if self.mode == "process":
            if self.engine.down is not None:
                return None
            return self.engine.run_sync(self.engine.stats())["kv_blocks_used"]
        return self.engine.pool.num_used

    def ramp(self, n: int) -> dict | None:
        """The last HTTP round's admission ramp (process mode): from the first request's arrival in its
        handler to the n-th add_request in the engine process, split into arrival spread (accept, HTTP
        parse, body read), arrival -> submit (JSON, pydantic, tokenization), submit -> add (IPC, the engine
        between steps). perf_counter and monotonic are one clock on Linux."""
        if self.mode != "process" or self.engine.down is not None:
            return None
        api = list(self.engine.trace)[-n:]
        adds = dict(self.engine.run_sync(self.engine.admission_trace()))
        rows = [(a, s, adds[rid]) for rid, a, s in api if rid in adds]
        if not rows:
            return None
        arr, sub, add = (sorted(x[i] for x in rows) for i in range(3))
        t0 = arr[0]

        def q(xs, f):
            return round(1e3 * xs[min(len(xs) - 1, int(f * len(xs)))], 2)
        parse = sorted(s - a for a, s, _ in rows)
        ipc = sorted(d - s for _, s, d in rows)
        return {"requests": len(rows), "first_to_last_add_ms": round(1e3 * (add[-1] - t0), 1),
                "arrival_spread_ms": round(1e3 * (arr[-1] - t0), 1),
                "last_submit_ms": round(1e3 * (sub[-1] - t0), 1),
                "arrival_to_submit_ms": {"p50": q(parse, .5), "max": q(parse, 1)},
                "submit_to_add_ms": {"p50": q(ipc, .5), "max": q(ipc, 1)}}

    def compiles(self) -> dict:
        """Triton compiles in the engine since the last call (warm-up excluded): each one a step that
        waited for a compile (around a second on an H100's host)."""
        since = getattr(self, "_compiles_seen", 0)
        if self.mode == "process":
            if self.engine.down is not None:
                return {"count": None}
            r = self.engine.run_sync(self.engine.call("tritune.model.bench.http:jit_compiles", since))
        else:
            from tritune.model.bench.http import jit_compiles

            r = jit_compiles(self.engine, since)
        self._compiles_seen = r.get("total") or since
        return r

    def memory(self) -> dict:
        """The API process's RSS, and the engine's memory where it lives."""
        if self.mode == "process":
            eng = self.engine.run_sync(self.engine.call("tritune.model.bench.http:engine_memory"))
            return {"api_rss_mb": engine_memory()["rss_mb"], **{f"engine_{k}": v for k, v in eng.items()}}
        return engine_memory(self.engine)

    def close(self):
        self.server.close()
        if self.mode == "process":
            self.engine.stop()
        self.engine = self.app = self.srv = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def soak(sv: Served, args, config, out: Path, left) -> dict:
    """Many concurrent streaming clients, twice, each followed by as many disconnecting streams: errors,
    leaked blocks, memory."""
    lens = (min(args.soak_len[0], config.n_positions // 4), min(args.soak_len[1], config.n_positions // 4))
    many = S.make_workload(args.soak_requests * args.clients, lens, lens, config.vocab_size, 1)
    many_jsonl = out / "workload_clients.jsonl"
    write_jsonl(many_jsonl, many)
    res = {"mode": sv.mode, "clients": args.clients, "requests": len(many), "rounds": []}
    mem0 = sv.memory()
    for r in range(2):
        if left() < (10 if args.smoke else 40):
            res["note"] = "stopped early: time limit"
            break
        run = client(sv.server.url, many_jsonl, len(many), args.clients, out / f"clients_{sv.mode}_round{r}.json",
                     min(240, left() - 30), args.client_procs, sv.pid)
        waited = wait_idle(sv.srv)
        gone = asyncio.run(_disconnecting(sv.server.url, "bench", many[:args.clients]))
        waited += wait_idle(sv.srv)
        row = {"run": {k: run.get(k) for k in ("completed", "errors", "error_samples", "output_tok_s",
                                               "ttft_ms", "itl_ms", "server_cpu_busy", "engine_cpu_busy")},
               "disconnects": gone, "idle_wait_s": round(waited, 2), "kv_blocks_used_after": sv.blocks_used(),
               "in_flight_after": sv.srv.loop.in_flight, "memory_after": sv.memory()}
        print(f"[clients {sv.mode} {r}] {row['run']}, disconnects {gone}, KV blocks used after: "
              f"{row['kv_blocks_used_after']}, memory {row['memory_after']}", flush=True)
        res["rounds"].append(row)
    res["memory_before"] = mem0
    rows = res["rounds"]
    if rows:
        res["ok"] = all(x["run"].get("errors") == 0 and x["disconnects"]["errors"] == 0
                        and x["kv_blocks_used_after"] == 0 for x in rows)
        last = rows[-1]["memory_after"]
        res["growth"] = {k: round(last[k] - mem0[k], 1) for k in mem0 if k in last}
        if len(rows) > 1:
            res["growth_second_round"] = {k: round(last[k] - rows[0]["memory_after"][k], 1) for k in mem0
                                          if k in last}
    return res


# ---------------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="results", help="results root (default: results)")
    p.add_argument("--work", default=None, help="folder for the workload file and each round's serve-bench JSON "
                   "(default: a temporary one)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: GPT-2 small config, random)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-len", type=S.parse_range, default=(64, 512))
    p.add_argument("--output-len", type=S.parse_range, default=(64, 512))
    p.add_argument("--rate", type=float, default=math.inf)
    p.add_argument("--rounds", type=int, default=3, help="in-process / HTTP pairs in the process mode")
    p.add_argument("--thread-rounds", type=int, default=1, help="in-process / HTTP pairs in the thread mode")
    p.add_argument("--modes", default="process,thread", help="comma-separated: process, thread")
    p.add_argument("--soak-mode", default=None, help="the mode the clients' soak runs in (default: the first)")
    p.add_argument("--clients", type=int, default=256, help="the soak: concurrent streaming clients")
    p.add_argument("--soak-requests", type=int, default=2, help="the soak: requests per client, a round")
    p.add_argument("--soak-len", type=S.parse_range, default=(64, 128), help="the soak: prompt and output "
                   "lengths")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-memory-fraction", type=float, default=0.4)
    p.add_argument("--time-limit", type=float, default=280.0, help="seconds for everything (an H100: the "
                   "process mode's engine ready in about 70 s, a round 10-15 s, the thread mode's in about 40 s)")
    p.add_argument("--smoke", action="store_true", help="no GPU: the packaged model on the torch backend, a "
                   "tiny workload (checks this driver, measures nothing)")
    p.add_argument("--stub", action="store_true", help="no model: model/serve/stub.py's engine makes tokens at "
                   "--stub-rate (the HTTP path's own ceiling; runs on any machine)")
    p.add_argument("--stub-rate", type=float, default=55000.0, help="stub tokens/s in total (default 55000: "
                   "the engine's in-process rate on an H100 for GPT-2 small; inf: no pacing)")
    p.add_argument("--decode-steps", type=int, default=16, help="stub: tokens per request per step (the "
                   "engine's graph path gives 16)")
    p.add_argument("--stub-host-ms", type=float, default=0.0, help="stub: milliseconds each step holds the "
                   "GIL (the engine's host work per step)")
    p.add_argument("--arrival-steps", type=int, default=None, help="process mode: decode steps a run while "
                   "requests arrive (default: serve_proc's; 0: off, every run the engine's decode_steps)")
    p.add_argument("--client-procs", type=int, default=None, help="client processes (default: serve-bench's)")
    p.add_argument("--skip-clients", action="store_true", help="only the in-process / HTTP rounds")
    p.add_argument("--warmup-http", type=int, default=128, help="requests of the untimed HTTP burst before the "
                   "rounds (after an untimed in-process run of the whole workload; 0: none)")
    p.add_argument("--stack", default="auto", choices=("auto", "asyncio+h11", "uvloop+httptools"),
                   help="uvicorn's event loop + HTTP parser (auto: uvloop + httptools when installed)")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("process", "thread") for m in modes):
        print(f"bench_http: --modes: expected process and/or thread, got {args.modes!r}", file=sys.stderr)
        return 2
    soak_mode = args.soak_mode or modes[0]
    from tritune.model.serve.proc import ARRIVAL_STEPS

    arrival_steps = ARRIVAL_STEPS if args.arrival_steps is None else args.arrival_steps
    if args.smoke:
        args.requests, args.prompt_len, args.output_len, args.clients, args.rounds = 16, (4, 32), (4, 32), 8, 2
        args.soak_len = (4, 32)
    t_start = time.time()

    def left():
        return args.time_limit - (time.time() - t_start)

    gpu = torch.cuda.is_available() and not args.stub
    if not gpu and not (args.smoke or args.stub):
        print("bench_http: needs a CUDA GPU (or --smoke, or --stub)", file=sys.stderr)
        return 2
    out = Path(args.work or tempfile.mkdtemp(prefix="bench_http_"))
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "bench_http.json"      # the run so far (a cut-off run keeps it); results/ at the end
    from tritune.kernels.runtime import device as hdev
    from tritune.model.serve.server import http_stack

    res = {"device": hdev.gpu_name() if gpu else "cpu", "command": " ".join(sys.argv), "cpus": os.cpu_count(),
           "server_stack": http_stack() if args.stack == "auto" else args.stack, "modes": {}}

    def save():
        res_path.write_text(json.dumps(res, indent=2))

    # -- what the engine is (plain data: an engine process builds the same) --------------------------
    engine_kw = {"max_num_seqs": args.max_num_seqs, "max_batch_tokens": 8192, "cuda_graphs": True,
                 **({"kv_memory_fraction": args.kv_memory_fraction} if gpu else {"num_blocks": 1024})}
    if args.stub:
        from types import SimpleNamespace

        stub = dict(rate=args.stub_rate, decode_steps=args.decode_steps, max_num_seqs=args.max_num_seqs,
                    host_ms=args.stub_host_ms)
        spec = {"kind": "stub", "engine": {}, "stub": stub}
        config = SimpleNamespace(vocab_size=50257, n_positions=1024)
        tok = stand_in_tokenizer(config.vocab_size)
    elif args.model or args.smoke:
        from tritune.model.load import default_model_dir
        from tritune.model.gpt2.config import GPT2Config
        from tritune.model.tokenizer import Tokenizer
        from tritune.model.gpt2.weights import resolve

        directory = str(resolve(args.model or default_model_dir()))
        spec = {"kind": "checkpoint", "model": directory, "engine": engine_kw}
        config = GPT2Config.from_file(Path(directory) / "config.json")
        tok = Tokenizer.from_dir(directory)
    else:
        from types import SimpleNamespace

        spec = {"kind": "random", "engine": engine_kw}
        config = SimpleNamespace(vocab_size=50257, n_positions=1024)     # GPT-2 small's (serve.load_models)
        tok = stand_in_tokenizer(config.vocab_size)

    items = S.make_workload(args.requests, args.prompt_len, args.output_len, config.vocab_size, 0, args.rate)
    jsonl = out / "workload.jsonl"
    write_jsonl(jsonl, items)
    res["workload"] = {"requests": len(items), "prompt_len": list(args.prompt_len),
                       "output_len": list(args.output_len), "rate": None if math.isinf(args.rate) else args.rate,
                       "prompt_tokens": sum(len(it.prompt_ids) for it in items),
                       "output_tokens": sum(it.output_len for it in items)}
    try:
        for mode in modes:
            if left() < (20 if not gpu else 120):
                res["modes"][mode] = {"note": "not run: time limit"}
                continue
            try:
                sv = Served(mode, spec, tok, args.stack, max(60.0, left() - 60), arrival_steps)
            except Exception as e:  # noqa: BLE001 (recorded; the next mode runs)
                res["modes"][mode] = {"error": f"setup: {type(e).__name__}: {e}"}
                print(f"[{mode}] setup failed: {type(e).__name__}: {e}", flush=True)
                continue
            row = res["modes"][mode] = {"engine": sv.describe, "setup_s": sv.setup_s, "rounds": []}
            print(f"[{mode}] engine ready in {sv.setup_s:.1f} s: {sv.describe}", flush=True)
            try:
                # untimed: the workload once in-process and a burst of it over HTTP, so that the timed rounds
                # meet no first-use cost (kernel variants of the workload's prefill shapes, the allocator's
                # growth, the server's connection pools): every round after measured the same
                sv.inprocess(items, min(120, left() - 60))
                if args.warmup_http:
                    client(sv.server.url, jsonl, min(args.warmup_http, len(items)), min(args.warmup_http, len(items)),
                           out / f"http_{mode}_warmup.json", min(120, left() - 60), args.client_procs, sv.pid)
                with contextlib.suppress(Exception):
                    row["jit_compiles_untimed_warmup"] = sv.compiles()
                    print(f"[{mode}] Triton compiles after ready, in the untimed warm-up runs: "
                          f"{row['jit_compiles_untimed_warmup']}", flush=True)
                for r in range(args.rounds if mode == "process" else args.thread_rounds):
                    if left() < (10 if not gpu else 60):
                        row["note"] = f"stopped after {r} round(s): time limit"
                        break
                    wait_idle(sv.srv)
                    inproc = sv.inprocess(items, min(300, left() - 20))
                    try:
                        c_in = sv.compiles()
                    except Exception:  # noqa: BLE001 (a count, not the measurement)
                        c_in = {"count": None}
                    print(f"[{mode} {r}] in-process: {inproc['output_tok_s']:.0f} output tok/s, TTFT p50/p99 "
                          f"{_ms(inproc['ttft_ms'], 'p50', 'p99')} ms, ITL p50/p99 "
                          f"{_ms(inproc['itl_ms'], 'p50', 'p99')} ms", flush=True)
                    http = client(sv.server.url, jsonl, len(items), len(items), out / f"http_{mode}_round{r}.json",
                                  min(300, left() - 30), args.client_procs, sv.pid)
                    rr = {"in_process": inproc, "http": http}
                    with contextlib.suppress(Exception):
                        rr["jit_compiles"] = {"in_process": c_in, "http": sv.compiles()}
                        print(f"[{mode} {r}] Triton compiles: in-process {c_in.get('count')}, HTTP "
                              f"{rr['jit_compiles']['http'].get('count')} {rr['jit_compiles']['http'].get('by_kernel')}",
                              flush=True)
                    with contextlib.suppress(Exception):
                        rr["ramp"] = sv.ramp(len(items))
                    if rr.get("ramp"):
                        print(f"[{mode} {r}] admission ramp: {rr['ramp']}", flush=True)
                    if getattr(sv.engine, "down", None) is not None:
                        rr["engine_down"] = sv.engine.down
                        rr["engine_death"] = getattr(sv.engine, "death", None)
                        row["rounds"].append(rr)
                        raise RuntimeError(f"the engine died in round {r}: {sv.engine.down}")
                    if "output_tok_s" in http:
                        rr["http_over_in_process"] = http["output_tok_s"] / inproc["output_tok_s"]
                        rr["http_cost"] = 1 - rr["http_over_in_process"]
                        eng_cpu = "" if http["engine_cpu_busy"] is None else \
                            f", engine process CPU {http['engine_cpu_busy']:.0%}"
                        print(f"[{mode} {r}] HTTP: {http['output_tok_s']:.0f} output tok/s ({rr['http_cost']:+.1%} "
                              f"cost), {http['chunks_s']:.0f} SSE chunks/s, TTFT p50/p99 "
                              f"{_ms(http['ttft_ms'], 'p50', 'p99')} ms, ITL p50/p99 {_ms(http['itl_ms'], 'p50', 'p99')}"
                              f" ms, {http['errors']} errors; API process CPU {http['server_cpu_busy']:.0%}{eng_cpu}, "
                              f"clients {http['client']['procs']} x CPU max {max(http['client']['cpu_busy']):.0%}",
                              flush=True)
                    row["rounds"].append(rr)
                    save()
                costs = [x["http_cost"] for x in row["rounds"] if "http_cost" in x]
                if costs:
                    # the verdict on the median round (every round is in the JSON and the summary)
                    row["http_cost_best"] = min(costs)
                    row["http_cost_median"] = statistics.median(costs)
                    row["target_http_cost_le_10pct"] = row["http_cost_median"] <= 0.10
                wait_idle(sv.srv)
                row["kv_blocks_used_after_rounds"] = sv.blocks_used()
                if mode == soak_mode and not args.skip_clients:
                    res["clients"] = soak(sv, args, config, out, left)
            except Exception as e:  # noqa: BLE001 (an engine death or a failed round: recorded, next mode)
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"[{mode}] ERROR {row['error']}; going on with the next mode", flush=True)
                if getattr(sv.engine, "death", None):
                    row["engine_death"] = sv.engine.death
                    print(f"[{mode}] engine death: {sv.engine.death}", flush=True)
            finally:
                sv.close()
                save()
    finally:
        save()
        parts = []
        for mode, row in res["modes"].items():
            costs = [f"{x['http_cost']:+.1%}" for x in row.get("rounds", ()) if "http_cost" in x]
            best = max((x["http"]["output_tok_s"] for x in row.get("rounds", ()) if "http_cost" in x), default=None)
            ramps = [x["ramp"]["submit_to_add_ms"] for x in row.get("rounds", ()) if x.get("ramp")]
            ttft = [f"{x['http']['ttft_ms']['p50']:.0f}/{x['in_process']['ttft_ms']['p50']:.0f}"
                    for x in row.get("rounds", ()) if "http_cost" in x]
            jit = [f"{x['jit_compiles']['in_process'].get('count')}/{x['jit_compiles']['http'].get('count')}"
                   for x in row.get("rounds", ()) if x.get("jit_compiles")]
            parts.append(f"{mode}: " + (f"ERROR {row['error'][:200]}; " if row.get("error") else "")
                         + f"HTTP cost per round {costs}"
                         + (f", best HTTP {best:.0f} tok/s" if best else "")
                         + (f", TTFT p50 HTTP/in-process {ttft} ms" if ttft else "")
                         + (", submit->add p50/max " + str(["%.0f/%.0f" % (q["p50"], q["max"]) for q in ramps])
                            + " ms" if ramps else "")
                         + (f", Triton compiles after ready in-process/HTTP {jit}" if jit else "")
                         + (f", ready in {row['setup_s']:.0f} s" if row.get("setup_s") else "")
                         + (f", median {row['http_cost_median']:+.1%}" if "http_cost_median" in row else "")
                         + f" (target <= 10% on the median round: "
                         f"{'met' if row.get('target_http_cost_le_10pct') else 'NOT met'})")
        cl = res.get("clients", {})
        print(f"SUMMARY {res.get('server_stack')}: " + "; ".join(parts)
              + f"; {args.clients} clients ({cl.get('mode')}) ok: {cl.get('ok')}, KV blocks after "
              f"{[x['kv_blocks_used_after'] for x in cl.get('rounds', ())]}, memory growth {cl.get('growth')} "
              f"(2nd round {cl.get('growth_second_round')})", flush=True)
        path = write_rows("http_stub" if args.stub else "http", [{"mode": m, **r} for m, r in res["modes"].items()],
                          args.results, **{k: v for k, v in res.items() if k != "modes"})
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
