"""``tritune serve-bench``: a serving workload through the engine, beside ``transformers`` and naive inference.

The workload: N requests whose prompt and output lengths are drawn uniformly from ``--prompt-len`` and
``--output-len`` ranges with ``--seed`` (random token ids; EOS ignored so every request produces exactly
its output length), or read from a JSONL file (``{"prompt_len": 100, "output_len": 50}`` or
``{"prompt_ids": [...], "max_new_tokens": 50}``, optional ``"arrival"`` seconds). Arrivals: all at once
(``--rate inf``) or a Poisson process of ``--rate`` requests/s.

For each ``--modes`` entry (torch, torch-compile, triton, triton-graphs, triton-int8, triton-int4) the
engine serves the workload after a warm-up (kernels compiled, graphs captured); reported: output and
total tok/s, req/s, TTFT and TPOT P50/P95/P99, peak KV blocks, steps and preemptions, and the batch-1
decode rate. Baselines on the same workload and model: ``transformers`` ``generate`` with static batches
of ``--hf-batch-size`` (left-padded, each batch runs to its longest output; timed on the first
``--hf-requests`` requests and extrapolated), and naive single-request inference (no KV cache: the whole
sequence re-run for every token). ``--model``: a checkpoint of any family tritune loads (GPT-2, Llama,
Qwen2/3, Mistral); without it, a real model's shape (``--shape gpt2`` (GPT-2 small, the default) |
``qwen2.5-0.5b`` | ``llama-3.2-1b``) with transformers' random weights, written into a temporary directory.

Defaults fit the machine: on a GPU the triton-graphs mode and the workload above; without one (the triton
kernels would run through the Triton interpreter, minutes per step at GPT-2 small's sizes) the torch mode,
shorter prompts and outputs (16:64), a 32-token batch-1 decode and a naive baseline of one request's first
8 tokens. Each timed phase shows a progress bar
with an ETA (tqdm, on stderr), quiet under ``--quiet`` and when stdout is not a terminal.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

# re-exported: the names serve-bench's callers (benchmarks, tests) have always taken from here
from tritune.model.bench.baselines import run_hf, run_naive
from tritune.model.bench.features import (WORKLOADS, run_mixed, run_shared_prefix, run_speculative,  # noqa: F401
                                          run_workload, shared_prefix_items)
from tritune.model.bench.runs import (CPU_DEFAULTS, GPU_DEFAULTS, MODES, SHAPES, CompileLog,  # noqa: F401
                                      build_model, decode_rate, fill_defaults, load_models, progress, run_engine,
                                      run_engine_repeated, say)
from tritune.model.load import default_dtype
from tritune.model.bench.workload import Item, make_workload, parse_range, percentiles  # noqa: F401
from tritune.model.serve.warmup import warm_up


def progression(res) -> list[dict]:
    """One row per mode, in the order they ran: the same workload, the same run, the same baselines."""
    hf = res.get("transformers", {})
    rows = []
    for mode, r in res["modes"].items():
        if "run" not in r:
            rows.append({"mode": mode, "error": r.get("error")})
            continue
        b1 = r.get("batch1_decode", {})
        rows.append({"mode": mode, "batch1_decode_tok_s": b1.get("decode_tok_s"),
                     "output_tok_s": r["run"]["output_tok_s"], "total_tok_s": r["run"]["total_tok_s"],
                     "tpot_p50_ms": r["run"]["tpot_ms"]["p50"], "ttft_p50_ms": r["run"]["ttft_ms"]["p50"],
                     "vs_transformers": r.get("factors", {}).get("vs_transformers"),
                     "vs_naive_batch8": r.get("factors", {}).get("vs_naive_batch8"),
                     "vs_naive_best": r.get("factors", {}).get("vs_naive_best")})
    if hf:
        rows.append({"mode": f"transformers generate (static batch {hf['batch_size']})",
                     "output_tok_s": hf["output_tok_s"], "vs_transformers": 1.0})
    if res.get("naive"):
        rows.append({"mode": "naive (HF forward, no KV cache, batch 1)", "output_tok_s": res["naive"]["output_tok_s"]})
    return rows


def progression_table(res) -> str:
    from tabulate import tabulate

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    rows = [[r["mode"], f(r.get("batch1_decode_tok_s"), ".0f"), f(r.get("output_tok_s"), ".0f"),
             f(r.get("tpot_p50_ms"), ".2f"), f(r.get("vs_transformers"), ".1f"), f(r.get("vs_naive_batch8"), ".0f"),
             f(r.get("vs_naive_best"), ".0f"), r.get("error") or ""] for r in res["progression"]]
    w = res["workload"]
    head = (f"{w['requests']} requests (prompt {w['prompt_len'][0]}-{w['prompt_len'][1]}, output "
            f"{w['output_len'][0]}-{w['output_len'][1]} tokens), {res['dtype']}, {res['gpu']}")
    return head + "\n" + tabulate(rows, headers=["mode", "batch-1 decode tok/s", "output tok/s", "TPOT p50 ms",
                                                 "x transformers", "x naive (batch 8)", "x naive (best)", "error"])


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
def add_parser(subparsers, name: str) -> None:
    if name != "serve-bench":
        return
    from tritune.kernels.runtime.args import block_size, fraction, int_at_least, parse_dtype, positive_number

    s = subparsers.add_parser("serve-bench", help="serving throughput/latency of the engine vs transformers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", default=None, help="checkpoint directory or hub id, any family (default: --shape's "
                   "config with random weights)")
    s.add_argument("--shape", choices=tuple(SHAPES), default="gpt2",
                   help="without --model: the random-weight model's shape (default gpt2: GPT-2 small)")
    s.add_argument("-n", "--num-requests", type=int_at_least(1), default=512)
    s.add_argument("--prompt-len", type=parse_range, default=None, help="LO:HI, uniform (default 64:512 on a GPU, "
                   "16:64 on the CPU)")
    s.add_argument("--output-len", type=parse_range, default=None, help="LO:HI, uniform (default 64:512 on a GPU, "
                   "16:64 on the CPU)")
    s.add_argument("--jsonl", default=None, help="workload file instead of the drawn lengths")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--rate", type=positive_number, default=math.inf, help="Poisson arrivals, requests/s (default inf: "
                   "all at once)")
    s.add_argument("--modes", default=None,
                   help=f"comma-separated, from {','.join(MODES)} (default triton-graphs on a GPU, torch on the "
                        "CPU: the triton modes run the kernels through the Triton interpreter there)")
    s.add_argument("--dtype", type=parse_dtype, default=None, help="default bf16 on a GPU, fp32 on the CPU")
    s.add_argument("--max-num-seqs", type=int_at_least(1), default=256)
    s.add_argument("--tp", type=int_at_least(1), default=1, help="tensor parallelism: the engine's model split "
                   "over this many GPUs (default 1)")
    s.add_argument("--max-batch-tokens", type=int_at_least(1), default=8192,
                   help="tokens a step runs (default 8192); under the model's context, prefill runs in chunks")
    s.add_argument("--kv-memory-fraction", type=fraction, default=0.4)
    s.add_argument("--block-size", type=block_size, default=16)
    s.add_argument("--batch-sweep", default="8", help="also run the first requests at these max batch sizes "
                   "(comma-separated; '' for none), for the factor over naive")
    s.add_argument("--sweep-modes", default="triton-graphs,triton-int8,triton-int4",
                   help="the modes that run the batch sweep (comma-separated)")
    s.add_argument("--sweep-requests", type=int_at_least(1), default=64)
    s.add_argument("--decode-tokens", type=int_at_least(0), default=None,
                   help="batch-1 decode run length (0: skip; default 512 on a GPU, 32 on the CPU)")
    s.add_argument("--hf-batch-size", type=int_at_least(1), default=32)
    s.add_argument("--hf-requests", type=int_at_least(-1), default=64, help="requests timed through transformers "
                   "(0: all; -1: skip the transformers baseline)")
    s.add_argument("--naive-requests", type=int_at_least(0), default=None,
                   help="0: skip the naive baseline (default 2 on a GPU, 1 on the CPU)")
    s.add_argument("--naive-tokens", type=int_at_least(1), default=None, help="default 64 on a GPU, 8 on the CPU")
    s.add_argument("--runs", type=int_at_least(1), default=None, help="time the workload this many times on each "
                   "warm engine (prefix cache emptied before each) and report the median run with the spread "
                   "(default 3 on a GPU, 1 on the CPU)")
    s.add_argument("--out", default=None, help="write the results as JSON here")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars (they also stay off when stdout "
                   "is not a terminal)")
    w = s.add_argument_group("feature workloads (--workload; -n, --prompt-len and --output-len size them)")
    w.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="shared-prefix: a common --prefix-len prefix + --prompt-len suffixes, prefix cache on vs off; "
                   "mixed: -n decodes while --long-prompts prompts arrive, chunked (--chunk) vs not; speculative: "
                   "-n prompts alone, plain vs n-gram and a draft (--draft or --draft-layers)")
    w.add_argument("--prefix-len", type=int_at_least(1), default=192)
    w.add_argument("--long-prompt", type=int_at_least(1), default=2048,
                   help="mixed: long prompt tokens (at most the context)")
    w.add_argument("--long-prompts", type=int_at_least(0), default=4)
    w.add_argument("--chunk", type=int_at_least(1), default=512, help="mixed: the chunked run's token budget per step")
    w.add_argument("--spec-k", type=int_at_least(1), default=4, help="speculative: draft tokens per step")
    w.add_argument("--draft", default=None, help="speculative: draft checkpoint sharing the tokenizer")
    w.add_argument("--draft-layers", type=int_at_least(1), default=None,
                   help="speculative: draft from the target's first N layers")
    h = s.add_argument_group("over HTTP (--url: any OpenAI-compatible server; see tritune.model.bench.http)")
    h.add_argument("--url", default=None, help="drive the server at this URL (e.g. http://127.0.0.1:8000) "
                   "instead of an engine in this process")
    h.add_argument("--max-concurrency", type=int_at_least(1), default=256,
                   help="requests in flight at most (default 256)")
    h.add_argument("--served-model", default=None, help="the model name to send (default: the first of "
                   "/v1/models)")
    h.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    h.add_argument("--vocab-size", type=int_at_least(1), default=None, help="for drawn prompts (default: the server's "
                   "vocab_size in /v1/models, else 50257)")
    h.add_argument("--timeout", type=positive_number, default=600.0, help="seconds for the whole run (default 600)")
    h.add_argument("--client-procs", type=int_at_least(1), default=None, help="client processes (default: one per 32 "
                   "streams, up to half the cores)")
    s.set_defaults(func=run)


def run(args) -> int:
    if getattr(args, "url", None):
        from tritune.model.bench.http import run_url

        fill_defaults(args, gpu=True)   # the workload a server is benchmarked with, wherever this client runs
        return run_url(args)
    if getattr(args, "workload", "random") != "random":
        return run_workload(args)
    import torch

    gpu = torch.cuda.is_available()
    fill_defaults(args, gpu)
    setup = _setup(args, gpu)
    if isinstance(setup, int):
        return setup
    config, state, hf, items, dtype = setup
    res = _result_head(args, items, dtype, gpu)
    say(f"workload: {len(items)} requests, {res['workload']['prompt_tokens']} prompt + "
        f"{res['workload']['output_tokens']} output tokens; {res['dtype']} on {res['gpu']}")

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=2))

    if hf is not None:
        _run_baselines(args, hf, items, res)
        del hf
        _free(gpu)
        save()
    for mode in [m for m in args.modes.split(",") if m]:
        res["modes"][mode] = _run_mode(args, mode, config, state, items, dtype, gpu)
        _free(gpu)
        save()
    _factors(args, res)
    res["progression"] = progression(res)
    say(progression_table(res))
    save()
    if args.out:
        say(f"wrote {args.out}")
    return 1 if any("error" in r for r in res["modes"].values()) else 0


def _fail(msg: str) -> int:
    print(f"tritune serve-bench: {msg}", file=sys.stderr)
    return 2


def _free(gpu: bool) -> None:
    gc.collect()
    if gpu:
        import torch

        torch.cuda.empty_cache()


def _setup(args, gpu: bool):
    """(config, state, HF model or None, workload items, dtype), or an exit code (a message said why)."""
    import torch

    bad = [m for m in args.modes.split(",") if m and m not in MODES]
    if bad:
        return _fail(f"unknown mode(s) {bad}; expected from {list(MODES)}")
    dtype = args.dtype or default_dtype()
    need_hf = args.hf_requests >= 0 or args.naive_requests > 0
    try:
        config, state, hf = load_models(args.model, dtype, "cuda" if gpu else "cpu", need_hf,
                                        shape=getattr(args, "shape", "gpt2"))
        items = make_workload(args.num_requests, args.prompt_len, args.output_len, config.vocab_size, args.seed,
                              args.rate, args.jsonl)
    except (OSError, ValueError) as e:
        return _fail(str(e))
    too_long = [i for i, it in enumerate(items) if len(it.prompt_ids) + it.output_len > config.n_positions]
    if too_long:
        return _fail(f"{len(too_long)} request(s) exceed the context ({config.n_positions}), e.g. #{too_long[0]}")
    return config, state, hf if need_hf else None, items, dtype


def _result_head(args, items, dtype, gpu: bool) -> dict:
    import torch

    from tritune.kernels.runtime import device as hdev

    return {"gpu": hdev.gpu_name() if gpu else "cpu", "dtype": str(dtype).replace("torch.", ""),
            "model": args.model or f"{getattr(args, 'shape', 'gpt2')} config, random weights",
            "workload": {"requests": len(items), "prompt_len": list(args.prompt_len),
                         "output_len": list(args.output_len), "jsonl": args.jsonl, "seed": args.seed,
                         "rate": None if math.isinf(args.rate) else args.rate,
                         "prompt_tokens": sum(len(it.prompt_ids) for it in items),
                         "output_tokens": sum(it.output_len for it in items)},
            "torch": torch.__version__, "command": "tritune serve-bench " + " ".join(sys.argv[2:]), "modes": {}}


def _run_baselines(args, hf, items, res: dict) -> None:
    import torch

    show = not getattr(args, "quiet", False)
    if args.naive_requests > 0:
        say(f"naive baseline: {args.naive_requests} request(s), the first {args.naive_tokens} tokens each")
        res["naive"] = run_naive(hf, items, args.naive_requests, args.naive_tokens, show_progress=show)
        say(f"naive (no KV cache, one request): {res['naive']['output_tok_s']:.1f} tok/s")
    if args.hf_requests >= 0:
        say(f"transformers baseline: static batches of {args.hf_batch_size}")
        hf(torch.tensor([[1, 2, 3]], device=next(hf.parameters()).device))     # warm-up
        res["transformers"] = h = run_hf(hf, items, args.hf_batch_size, args.hf_requests, show_progress=show)
        say(f"transformers generate (static batch {h['batch_size']}, {h['requests_timed']} requests): "
            f"{h['output_tok_s']:.1f} output tok/s")


def _run_mode(args, mode: str, config, state, items, dtype, gpu: bool) -> dict:
    """One mode's engine: built, warmed up, its batch-1 decode rate, the workload, the batch sweep."""
    from tritune.model.engine.engine import Engine

    show = not getattr(args, "quiet", False)
    opts = dict(MODES[mode])
    backend = opts.pop("backend")
    r = {}
    try:
        say(f"[{mode}] building the engine and warming up (compiles every kernel variant on the triton "
            "backend; CUDA graphs captured)" if backend == "triton" else f"[{mode}] building the engine")
        model = build_model(config, state, backend, dtype, "cuda" if gpu else "cpu")
        t0 = time.perf_counter()
        kv = {"kv_memory_fraction": args.kv_memory_fraction} if gpu else {}
        if args.max_batch_tokens < config.n_positions:  # a whole-context prompt runs in chunks of that budget
            opts.setdefault("enable_chunked_prefill", True)
        if getattr(args, "tp", 1) > 1:
            opts["tensor_parallel"] = args.tp
        eng = Engine(model, block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                     max_num_seqs=args.max_num_seqs, **kv, **opts)
        # (on the CPU the workload's longest prompt: nothing compiles there, and long prompts take seconds)
        warm_up(eng, config.vocab_size, config.n_positions // 2 if gpu else max(len(it.prompt_ids) for it in items))
        r["setup_s"] = time.perf_counter() - t0
        r["engine"] = eng.describe()
        if args.decode_tokens:
            r["batch1_decode"] = _batch1(eng, mode, args.decode_tokens, config.vocab_size, show)
        r["run"] = m = run_engine_repeated(eng, items, getattr(args, "runs", None) or 1, desc=f"[{mode}] run", show_progress=show)
        sp = m.get("spread")
        rng = f" (median of {sp['runs']} runs: {sp['output_tok_s_min']:.0f}-{sp['output_tok_s_max']:.0f})" if sp else ""
        say(f"[{mode}] {m['output_tok_s']:.0f} output tok/s{rng}, {m['total_tok_s']:.0f} total tok/s, "
            f"{m['req_s']:.2f} req/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, TPOT p50 "
            f"{m['tpot_ms']['p50']:.2f} ms, peak KV blocks {m['peak_kv_blocks']}/{m['kv_blocks']}, "
            f"{m['steps']} steps, {m['preemptions']} preemptions")
        sweep = _batch_sweep(args, eng, mode, items, show)
        if sweep:
            r["batch_sweep"] = sweep
        if getattr(args, "tp", 1) > 1:
            eng.close()         # the other ranks' processes and GPUs, before the next mode's
        del eng, model
    except Exception as e:  # noqa: BLE001 (one mode failing must not lose the others' numbers)
        import traceback

        traceback.print_exc()
        r["error"] = f"{type(e).__name__}: {e}"
    return r


def _batch1(eng, mode: str, tokens: int, vocab: int, show: bool) -> dict:
    with CompileLog() as log:
        b = decode_rate(eng, 64, tokens, vocab, desc=f"[{mode}] batch-1 decode", show_progress=show)
    b["jit_compiles"] = log.summary()
    say(f"[{mode}] batch-1 decode: {b['decode_tok_s']:.0f} tok/s (GPU {b.get('gpu_ms_per_token', float('nan')):.3f} "
        f"ms/token; host us/token { {k: round(v, 1) for k, v in b['host_us_per_token'].items()} })")
    return b


def _batch_sweep(args, eng, mode: str, items, show: bool) -> dict:
    """The first requests again at each ``--batch-sweep`` max batch size (the modes of ``--sweep-modes``)."""
    sweep = {}
    for b in [int(x) for x in args.batch_sweep.split(",") if x and mode in args.sweep_modes.split(",")]:
        eng.scheduler.max_num_seqs = b
        sub = items[:max(args.sweep_requests, 0) or len(items)]
        eng.pool.reset_cache()   # the main run cached these prompts: each sweep run starts as cold as it did
        sweep[b] = run_engine(eng, sub, desc=f"[{mode}] max batch {b}", show_progress=show)
        say(f"[{mode}] max batch {b} ({len(sub)} requests): {sweep[b]['output_tok_s']:.0f} output tok/s")
    eng.scheduler.max_num_seqs = args.max_num_seqs
    return sweep


def _factors(args, res: dict) -> None:
    """Each mode's output rate over transformers' and over naive inference's (at batch 8 and its best)."""
    hf_rate = res.get("transformers", {}).get("output_tok_s")
    naive_rate = res.get("naive", {}).get("output_tok_s")
    for mode, r in res["modes"].items():
        if "run" not in r:
            continue
        f = {}
        if hf_rate:
            f["vs_transformers"] = r["run"]["output_tok_s"] / hf_rate
        if naive_rate:
            rates = {args.max_num_seqs: r["run"]["output_tok_s"]}
            rates.update({b: s["output_tok_s"] for b, s in r.get("batch_sweep", {}).items()})
            if 8 in rates:
                f["vs_naive_batch8"] = rates[8] / naive_rate
            best = max(rates, key=rates.get)
            f["vs_naive_best"] = rates[best] / naive_rate
            f["best_batch"] = best
        r["factors"] = f
        if f:
            say(f"[{mode}] " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in f.items()))
