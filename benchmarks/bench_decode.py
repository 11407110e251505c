"""Single-request decode speed: tritune's GPT-2 (triton and torch backends) against transformers.generate.

Batch 1, a prompt of --prompt tokens, --new greedy tokens (no EOS stop), random weights with GPT-2
small's config (or --model DIR), one dtype. Methods:

- ``triton-graph``: ``generate`` replaying the CUDA graph of the decode step, one step ahead of the host;
- ``engine``: the serving engine alone with one request (CUDA graphs, several replays per host sync);
- ``triton``, ``torch``: ``generate``'s plain per-step loop (eager kernels / PyTorch ops);
- ``transformers``: ``generate`` of transformers' GPT2LMHeadModel.

Each method runs once to warm up (compilation, allocator, graph capture), then --reps timed runs; the
table reports medians:

- decode tok/s: the tokens after the first over the time after the first (prefill excluded). For
  transformers that is (new - 1) / (t(new tokens) - t(1 token)), both timed through generate().
- end-to-end tok/s: new tokens over the whole call, prefill included.

``--profile``: also a torch.profiler trace of the engine's batch-1 decode: the kernels of one token
(count and GPU time each), GPU busy time against wall time, and the host's phases of ``Engine.step``.

Writes the table to stdout and appends one keyed row per method (benchmarks/rows.py: commit, date, GPU,
versions) to results/<gpu-slug>/decode.json (``--results`` another root), whose top-level fields (this
run's summary, ``benchmark``, ``results``) are what ``tritune report`` tabulates.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import torch
from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_tritune(directory, backend, dtype, prompt, new, reps, cuda_graph=False):
    from tritune.model.engine.generate import generate
    from tritune.model.gpt2.model import GPT2

    m = GPT2.from_pretrained(directory, backend=backend, dtype=dtype)
    kw = dict(max_new_tokens=new, eos_token_id=None, cuda_graph=cuda_graph)
    generate(m, prompt, **kw)          # warm-up: every shape compiles (and the graph is captured)
    runs = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        r = generate(m, prompt, **kw)
        sync()
        total = time.perf_counter() - t0
        assert len(r.tokens) == new
        runs.append(dict(decode_tok_s=r.timings.decode_tok_s, e2e_tok_s=new / total,
                         prefill_ms=r.timings.prefill_ms, tokens=r.tokens))
    steps = m.backend_report()
    del m
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return runs, steps


def _engine(directory, dtype, **kw):
    from tritune.model.engine.engine import Engine
    from tritune.model.gpt2.model import GPT2

    m = GPT2.from_pretrained(directory, backend="triton", dtype=dtype)
    return Engine(m, num_blocks=256, max_num_seqs=1, cuda_graphs=True, **kw)


def _engine_run(eng, prompt, new):
    from tritune.model.engine.scheduler import SamplingParams

    sync()
    t0 = time.perf_counter()
    req = eng.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    eng.run()
    sync()
    total = time.perf_counter() - t0
    return req, total


def bench_engine(directory, dtype, prompt, new, reps):
    """The serving engine with one request: CUDA graphs, up to decode_steps replays per host sync."""
    eng = _engine(directory, dtype)
    _engine_run(eng, prompt, new)
    runs = []
    for _ in range(reps):
        req, total = _engine_run(eng, prompt, new)
        dt = req.finish_time - req.first_token_time
        runs.append(dict(decode_tok_s=(new - 1) / dt, e2e_tok_s=new / total,
                         prefill_ms=(req.first_token_time - req.arrival_time) * 1e3, tokens=list(req.output_ids)))
    notes = eng.notes
    del eng
    torch.cuda.empty_cache()
    return runs, "; ".join(notes)


def _kernel_table(eng, prompt, new):
    """[(kernel name, launches per decode token, GPU us per decode token)] of one request's decode."""
    from torch.profiler import ProfilerActivity, profile

    from tritune.model.engine.scheduler import SamplingParams

    eng.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    eng.step()                      # the prefill, outside the trace
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.run()
        sync()
    n = new - 1
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                     and not any(w in e.name.lower() for w in ("memcpy", "memset"))),
                    key=lambda e: e.time_range.start)
    kernels = {}
    for e in events:
        k = kernels.setdefault(e.name, [0, 0.0])
        k[0] += 1
        k[1] += e.time_range.elapsed_us()
    return sorted(((name, c / n, t / n) for name, (c, t) in kernels.items()), key=lambda r: -r[2]), \
        _op_table(events)


def _op_table(events) -> dict:
    """GPU us per token of each op of the GPT-2 decode step (the graph's kernels in launch order: step
    input, per layer ln_1 qkv write_kv attention [merge] attn_out ln_2 fc proj, then ln_f lm_head step
    output); gemms and layer norms told apart by their place in the step."""
    ops, steps = {}, 0
    gemm = ln = 0
    for e in events:
        name = e.name
        if name.startswith("_step_in"):
            steps += 1
            gemm = ln = 0
        if not steps:
            continue
        if name.startswith("_gemm"):
            label = "gemm " + ("lm_head" if gemm >= 48 else ("qkv", "attn_out", "fc", "proj")[gemm % 4])
            gemm += 1
        elif name.startswith("_layer_norm"):
            label = "layer_norm " + ("ln_f" if ln >= 24 else ("ln_1", "ln_2")[ln % 2])
            ln += 1
        else:
            label = name[:60]
        o = ops.setdefault(label, [0, 0.0])
        o[0] += 1
        o[1] += e.time_range.elapsed_us()
    return {k: {"per_token": round(c / max(steps, 1), 2), "us_per_token": round(t / max(steps, 1), 2),
                "us_each": round(t / max(c, 1), 2)} for k, (c, t) in sorted(ops.items(), key=lambda kv: -kv[1][1])}


def profile_engine(directory, dtype, prompt, new=128, top=30) -> dict:
    """Where a batch-1 token's time goes on the engine's graph path (decode_steps 1 and the default)."""
    out = {}
    for steps in (1, None):
        eng = _engine(directory, dtype, **({} if steps is None else {"decode_steps": steps}))
        _engine_run(eng, prompt, new)                    # warm
        tm0, gpu0 = dict(eng.timings), eng.stats["graph_gpu_s"]
        eng.gpu_timing = True
        req, total = _engine_run(eng, prompt, new)
        eng.gpu_timing = False
        n = new - 1
        wall = req.finish_time - req.first_token_time
        host = {k[:-2]: (eng.timings[k] - tm0[k]) / n * 1e6 for k in tm0 if k.endswith("_s")}
        rec = {"decode_steps": eng.decode_steps, "decode_tok_s": n / wall, "us_per_token": wall / n * 1e6,
               "gpu_us_per_token_events": (eng.stats["graph_gpu_s"] - gpu0) / n * 1e6,
               "host_us_per_token": host}
        if steps is None:       # the kernel table, from the default configuration's replays
            rows, ops = _kernel_table(eng, prompt, new)
            if not rows:        # the profiler saw no kernel inside the graphs: the same step, eagerly
                g = eng.graphs
                saved = g.graphs, dict(g.out)
                g.graphs = {}
                rows, ops = _kernel_table(eng, prompt, 32)
                g.graphs, g.out = saved
                rec["kernels_from"] = "eager run of the captured step (the profiler saw no graph kernels)"
            rec["ops"] = ops
            rec["kernels_per_token"] = round(sum(c for _, c, _ in rows), 2)
            rec["kernel_us_per_token"] = round(sum(t for _, _, t in rows), 2)
            rec["kernels"] = [{"name": nm[:120], "per_token": round(c, 2), "us_per_token": round(t, 2)}
                              for nm, c, t in rows[:top]]
        out[f"decode_steps={eng.decode_steps}"] = rec
        del eng
        torch.cuda.empty_cache()
    return out


def bench_transformers(directory, dtype, prompt, new, reps, device):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(directory, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def call(n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        sync()
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    call(new)
    call(1)
    # the 1-token call is short and noisy: its median over several calls is subtracted from each long one
    t1 = statistics.median(call(1)[0] for _ in range(max(5, reps)))
    runs = []
    for _ in range(reps):
        tn, toks = call(new)
        runs.append(dict(decode_tok_s=(new - 1) / (tn - t1) if tn > t1 else float("nan"), e2e_tok_s=new / tn,
                         prefill_ms=t1 * 1e3, tokens=toks))
    del hf
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: random GPT-2 small weights)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--methods", default="triton-graph,engine,triton,torch,transformers")
    p.add_argument("--profile", action="store_true", help="also profile the engine's batch-1 decode")
    p.add_argument("--results", default="results", help="results root (default: results)")
    args = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"

    directory = args.model
    if directory is None:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        directory = tempfile.mkdtemp(prefix="gpt2-small-random-")
        GPT2LMHeadModel(GPT2Config()).save_pretrained(directory)   # GPT-2 small's sizes, random weights
    from tritune.model.gpt2.config import GPT2Config as Cfg

    cfg = Cfg.from_file(Path(directory) / "config.json")
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()

    results, reports = {}, {}
    profile = None
    if args.profile:
        profile = profile_engine(directory, dtype, prompt)
        print(json.dumps(profile, indent=1), file=sys.stderr, flush=True)
    for method in args.methods.split(","):
        if method in ("triton", "torch"):
            runs, reports[method] = bench_tritune(directory, method, dtype, prompt, args.new, args.reps)
        elif method == "triton-graph":
            runs, reports[method] = bench_tritune(directory, "triton", dtype, prompt, args.new, args.reps,
                                                  cuda_graph=True)
        elif method == "engine":
            runs, reports[method] = bench_engine(directory, dtype, prompt, args.new, args.reps)
        elif method == "transformers":
            runs = bench_transformers(directory, dtype, prompt, args.new, args.reps, device)
        else:
            p.error(f"unknown method {method!r}")
        results[method] = runs
        print(f"{method}: decode tok/s {[round(r['decode_tok_s'], 1) for r in runs]}", file=sys.stderr, flush=True)

    from tritune.kernels.runtime import device as dev

    rows, summary = [], {}
    ref = results.get("transformers", [{}])[0].get("tokens")
    for method, runs in results.items():
        s = {k: statistics.median(r[k] for r in runs) for k in ("decode_tok_s", "e2e_tok_s", "prefill_ms")}
        # bf16 rounding differs between implementations, so greedy texts may part after a near tie
        toks = runs[0]["tokens"]
        s["same_tokens_as_transformers"] = (None if ref is None else
                                            next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), len(ref)))
        s["runs"] = [{k: v for k, v in r.items() if k != "tokens"} for r in runs]
        summary[method] = s
        rows.append([method, f"{s['decode_tok_s']:.1f}", f"{s['e2e_tok_s']:.1f}", f"{s['prefill_ms']:.2f}",
                     s["same_tokens_as_transformers"]])
    from tabulate import tabulate

    what = ("GPT-2 small config (random weights)" if args.model is None else
            f"{args.model} (n_layer {cfg.n_layer}, n_embd {cfg.n_embd})")
    print(f"{what}, {args.dtype}, batch 1, prompt {args.prompt}, "
          f"{args.new} new tokens, {dev.gpu_name()}")
    print(tabulate(rows, headers=["method", "decode tok/s", "end-to-end tok/s", "prefill ms",
                                  "tokens equal to transformers'"]))
    for r in reports.values():
        print(r)
    import transformers

    doc = dict(benchmark="gpt2 single-request decode", transformers=transformers.__version__, dtype=args.dtype,
               batch=1, prompt_tokens=args.prompt, new_tokens=args.new, reps=args.reps,
               model=dict(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, vocab_size=cfg.vocab_size,
                          weights="random" if args.model is None else str(args.model)),
               command="python benchmarks/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               backend_steps=reports, results=summary, profile=profile)
    row = {k: doc[k] for k in ("dtype", "batch", "prompt_tokens", "new_tokens", "reps", "model")}
    out = write_rows("decode", [dict(row, method=m, **s) for m, s in summary.items()], args.results, **doc)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
