"""Prefix caching, chunked prefill and speculative decoding on the GPU, each against its baseline (bounded).

  python benchmarks/bench_serving_features.py [--results DIR] [--time-limit 240]
                                              [--parts shared-prefix,mixed,speculative] [--graph-tokens 64,128]
                                              [--model DIR] [--spec-model DIR] [--draft DIR] [--smoke]

Each part runs in its own process under its share of ``--time-limit`` (what one leaves unused goes to the
next), so a part that fails or hangs costs only its own result: its error lands in the summary. One keyed
row per part (benchmarks/rows.py: commit, date, GPU, versions; the part's runs and its exit status) is
appended to results/<gpu-slug>/serving_features.json, the summary (targets met or not, errors) as its
top-level fields; the summary, compact, goes to stdout. Triton backend, bf16, CUDA graphs.

1. shared-prefix (serve-bench's workload, driven here): 512 requests, a 192-token common prefix + 16-64 token
   suffixes, 128 output tokens each, all arriving at once; GPT-2 small's config with random weights
   (``--model`` to change); serve-bench's engine settings (256 seats, 8192 tokens a step, KV 40% of the GPU).
   Runs: ``cache_off`` and ``cache_on`` with every prefill eager (``graph_prefill_tokens=0``: the baseline
   of the target), ``cache_on_graph`` (the defaults: suffix prefills of at most ``--graph-tokens`` tokens a
   step ride in the captured decode step) and ``cache_on_graph_chunked`` (chunked prefill, at most
   ``--graph-tokens`` prompt tokens a step beside the decodes: admissions trickle in through the graph
   instead of one eager step of ~1300 tokens). Targets: >= 70% fewer prefill tokens computed, >= 1.5x output
   tok/s (cache_on's best over cache_off; TTFT P50/P99 reported).
2. mixed: 32 requests decoding (64-token prompts, 256 new tokens) while 4 prompts of 2048 tokens arrive, one
   every 8 steps; inter-token latency of the decoding requests, one step per host sync (serve-bench's
   measure), and the long prompts' TTFT. Runs: ``unchunked``, ``chunked`` (512 tokens a step, chunks eager:
   the old path) and ``chunked_graph_<P>`` for each P of ``--graph-tokens`` (chunks of at most P tokens,
   ``long_prefill_token_threshold``, riding in the captured decode step). The packaged model's context (256)
   and GPT-2's (1024) are too short for 2048-token prompts, so the model is GPT-2 small's config with 2560
   positions and random weights, written to a temporary checkpoint first. Target: chunked P99 <= 2x the
   decode-only P50 (the best chunked run).
   Both parts report each run's steps per path (``paths``: the engine's ``path_counts`` over the timed run:
   "graph" decode-only replays, "graph-mixed" / "graph-prefill" prefill rows in the captured step,
   "graph+eager" a decode step beside an eager prefill forward, "eager", ...).
3. speculative (in this file): batch 1 on the packaged model (``model/default``) on Shakespeare passages
   from plays held out of its training (4 prompts of 48 tokens, 128 new tokens, greedy): plain decode on the
   CUDA-graph path (what ``tritune generate`` runs) and eager, against n-gram lookup (k = 4), the packaged
   draft (``model/default/draft``, distilled from the target by model/train.py; k = 2, its default, and 4)
   and an early-exit draft (the target's first 2 layers, k = 2); the draft also sampled (T 0.8, top-k 50,
   k = 2). Acceptance rate (accepted / proposed), tokens per speculative step, decode tok/s
   and speedup over plain (graphs; over eager too). Target: >= 1.5x. Greedy speculative steps run on
   the device, captured (spec_decode.SpecGraphs: graph replays and host syncs reported); sampled ones eagerly.

``--smoke``: tiny sizes on the CPU (torch backend, fp32) to show the driver runs end to end (a minute).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("shared-prefix", "mixed", "speculative")
SHARE = {"shared-prefix": 0.4, "mixed": 0.35, "speculative": 0.25}

# Speculative prompts: openings of speeches from the plays held out of the packaged model's training
# (model/train.py: Twelfth Night and Julius Caesar for validation, Macbeth and The Merchant of Venice for
# test), in the cleaned text's form (speaker headings as "NAME:" lines). Public domain.
PASSAGES = (
    "MACBETH:\nTo-morrow, and to-morrow, and to-morrow,\nCreeps in this petty pace from day to day,\n"
    "To the last syllable of recorded time;\nAnd all our yesterdays have lighted fools\nThe way to dusty death. "
    "Out, out, brief candle!\n",
    "PORTIA:\nThe quality of mercy is not strain'd,\nIt droppeth as the gentle rain from heaven\n"
    "Upon the place beneath. It is twice blest;\nIt blesseth him that gives and him that takes.\n",
    "ANTONY:\nFriends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n"
    "The evil that men do lives after them;\nThe good is oft interred with their bones;\n",
    "DUKE:\nIf music be the food of love, play on;\nGive me excess of it, that, surfeiting,\n"
    "The appetite may sicken, and so die.\nThat strain again! it had a dying fall:\n",
)


def _git(*a) -> str:
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------
# Parts 1 and 2: serve-bench workloads
# ---------------------------------------------------------------------------------------------------
def write_random_gpt2(directory: Path, *, n_positions: int, tiny: bool = False) -> Path:
    """A GPT-2 small config (or a tiny one) with ``n_positions`` positions and random weights, saved as a
    Hugging Face checkpoint (fp16 safetensors): serve-bench's --model for prompts longer than GPT-2's 1024."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    kw = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=4096, bos_token_id=4095, eos_token_id=4095) if tiny else {}
    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_positions=n_positions, n_ctx=n_positions, **kw))
    m.half().save_pretrained(str(directory), safe_serialization=True)
    return directory


def _engine_model(args, model_dir):
    """(model, vocab, context) for parts 1 and 2: serve-bench's loading (random GPT-2 small weights when
    ``model_dir`` is None), triton bf16 on a GPU, the torch backend fp32 on the CPU (--smoke)."""
    import torch

    from tritune.model.bench import serve_bench as S

    gpu = torch.cuda.is_available()
    backend, dtype, device = ("triton", torch.bfloat16, "cuda") if gpu else ("torch", torch.float32, "cpu")
    config, state, _ = S.load_models(str(model_dir) if model_dir else None, dtype, device, need_hf=False)
    model = S.build_model(config, state, backend, dtype, device)
    return model, config.vocab_size, config.n_positions, gpu


def _make_engine(model, gpu, vocab, ctx, warm=True, **kw):
    """An engine as serve-bench's triton-graphs mode builds it (on the CPU: the device-side step run
    eagerly), warmed up the same way."""
    from tritune.model.bench import serve_bench as S
    from tritune.model.engine.engine import Engine

    base = dict(block_size=16, cuda_graphs=True if gpu else "eager")
    if gpu:
        base["kv_memory_fraction"] = 0.4
    base.update(kw)
    eng = Engine(model, **base)
    if warm:
        S.warm_up(eng, vocab, min(512, ctx - 8))
    return eng


def _paths_since(eng, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in sorted(eng.path_counts.items()) if v - before.get(k, 0)}


def run_shared_prefix_part(args, out_path: Path) -> dict:
    from tritune.model.bench import serve_bench as S

    model, V, ctx, gpu = _engine_model(args, args.model if args.model or not args.smoke else ROOT / "model" / "default")
    n, plen, sfx, out_len, seqs = (16, 32, (4, 8), 8, 8) if args.smoke else (512, 192, (16, 64), 128, 256)
    P = int(args.graph_tokens.split(",")[0])
    items = S.shared_prefix_items(n, plen, sfx, out_len, V, 0)
    common = dict(max_num_seqs=seqs, max_batch_tokens=8192)
    runs = {"cache_off": dict(enable_prefix_caching=False, graph_prefill_tokens=0),
            "cache_on": dict(graph_prefill_tokens=0),
            "cache_on_graph": dict(graph_prefill_tokens=P),
            "cache_on_graph_chunked": dict(graph_prefill_tokens=P, enable_chunked_prefill=True,
                                           max_batch_tokens=seqs + P, long_prefill_token_threshold=P,
                                           prefill_batching=False)}
    res = {"shape": {"requests": n, "prefix_len": plen, "suffix_len": list(sfx), "output_len": out_len,
                     "max_num_seqs": seqs, "graph_tokens": P}, "runs": {k: v for k, v in runs.items()},
           "results": {}, "errors": {}}
    for name, kw in runs.items():
        try:
            eng = _make_engine(model, gpu, V, ctx, **{**common, **kw})
            eng.pool.reset_cache()                     # the warm-up's blocks: not part of the run
            p0, c0, paths0 = eng.stats["prefill_tokens"], eng.scheduler.stats["cached_tokens"], dict(eng.path_counts)
            r = S.run_engine(eng, items, desc=f"shared-prefix {name}")
            r["prefill_tokens_computed"] = eng.stats["prefill_tokens"] - p0
            r["prefix_cached_tokens"] = eng.scheduler.stats["cached_tokens"] - c0
            r["paths"] = _paths_since(eng, paths0)
            res["results"][name] = r
            print(f"  shared-prefix {name}: {r['output_tok_s']:.0f} tok/s, TTFT p50 {r['ttft_ms']['p50']} ms, "
                  f"prefill tokens {r['prefill_tokens_computed']}, paths {r['paths']}", flush=True)
            del eng
        except Exception as e:          # noqa: BLE001  one run's failure is a recorded result
            res["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        out_path.write_text(json.dumps(res, indent=2))
    rr = res["results"]
    if "cache_off" in rr and "cache_on" in rr:
        off = rr["cache_off"]
        res["prefill_token_reduction"] = 1 - rr["cache_on"]["prefill_tokens_computed"] / max(
            1, off["prefill_tokens_computed"])
        res["output_tok_s_speedup"] = {k: rr[k]["output_tok_s"] / off["output_tok_s"] for k in rr if k != "cache_off"}
    out_path.write_text(json.dumps(res, indent=2))
    return res


def _step_times(eng, run) -> dict:
    """Per path label: the steps' wall time (ms, P50/P99), the graph replay's GPU time (ms, P50/P99), the
    rows and prefill tokens (P50) and, for prefill steps, the P50 of their chunk's end position."""
    import numpy as np
    import torch

    g, rec, cur = eng.runner.graphs, {}, {}
    run0, step0, sched0 = g.run, eng.step, eng.scheduler.schedule

    def graph_run(B, steps=1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = run0(B, steps)
        e1.record()
        cur.setdefault("ev", []).append((e0, e1))
        return out

    def schedule(*a, **k):
        out = sched0(*a, **k)
        cur["rows"] = len(out.decode) + sum(map(len, out.prefill_ids))
        cur["prefill"] = sum(map(len, out.prefill_ids))
        cur["end"] = max((s + len(t) for s, t in zip(out.prefill_starts, out.prefill_ids)), default=0)
        return out

    def step():
        paths = dict(eng.path_counts)
        cur.clear()
        t0 = time.perf_counter()
        r = step0()
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
        path = next((k for k, v in eng.path_counts.items() if v != paths.get(k, 0)), "none")
        gpu = sum(a.elapsed_time(b) for a, b in cur.get("ev", ()))
        rec.setdefault(path, []).append((wall * 1e3, gpu, cur.get("rows", 0), cur.get("prefill", 0),
                                         cur.get("end", 0)))
        return r

    g.run, eng.step, eng.scheduler.schedule = graph_run, step, schedule
    try:
        run()
    finally:
        g.run, eng.step, eng.scheduler.schedule = run0, step0, sched0
    out = {}
    for path, rows in rec.items():
        a = np.asarray(rows)
        q = lambda col, p: round(float(np.percentile(a[:, col], p)), 3)  # noqa: E731
        out[path] = {"n": len(rows), "wall_ms": [q(0, 50), q(0, 99)], "gpu_ms": [q(1, 50), q(1, 99)],
                     "rows_p50": q(2, 50), "prefill_p50": q(3, 50), "chunk_end_p50": q(4, 50)}
    return out


def run_mixed_part(args, out_path: Path, model_dir: Path) -> dict:
    from tritune.model.bench.features import itl_run

    model, V, ctx, gpu = _engine_model(args, model_dir)
    if args.smoke:
        n_dec, long_prompt, n_long, out_len, chunk, seqs = 4, 400, 2, 40, 64, 8
    else:
        n_dec, long_prompt, n_long, out_len, chunk, seqs = 32, 2048, 4, 256, 512, 64
    long_prompt, out_len = min(long_prompt, ctx - 4), min(out_len, ctx - 64)
    Ps = [int(x) for x in args.graph_tokens.split(",") if x.strip()]
    chunked = dict(enable_chunked_prefill=True, max_batch_tokens=chunk)
    # the same budget: beside decodes the engine caps a step's prefill tokens at P, so every chunk (a long
    # prompt's, or several prompts' together) rides in the captured step instead of an eager prefill forward
    graph = {f"chunked_graph_{P}": dict(chunked, graph_prefill_tokens=P) for P in Ps}
    # the new path's first setting first: a part cut short by its time limit keeps it
    first = next(iter(graph))
    runs = {first: graph.pop(first), "chunked": dict(chunked, graph_prefill_tokens=0), **graph,
            "unchunked": dict(graph_prefill_tokens=0)}
    res = {"shape": {"decodes": n_dec, "decode_prompt": 64, "long_prompt": long_prompt, "long_prompts": n_long,
                     "output_len": out_len, "chunk": chunk, "max_num_seqs": seqs},
           "runs": runs, "results": {}, "errors": {}}
    for name, kw in runs.items():
        try:
            eng = _make_engine(model, gpu, V, ctx, max_num_seqs=seqs, prefill_batching=False, decode_steps=1, **kw)
            # the same pattern once, short, untimed: a long prompt's kernel variants compile here
            itl_run(eng, n_dec, 64, long_prompt, 1, 4 * 8 + 8, V, 8, seed=1)
            r = itl_run(eng, n_dec, 64, long_prompt, n_long, out_len, V, 8)
            p50, p99 = r["itl_decode_only_ms"]["p50"], r["itl_with_long_prompts_ms"]["p99"]
            r["p99_over_decode_p50"] = p99 / p50 if p50 and p99 else None
            if gpu and args.step_times:
                # where a step's time goes, by path: its wall time and its graph replay's GPU time (CUDA
                # events), in a third run of the same pattern (the events cost a little: not the timed one)
                r["step_times"] = _step_times(eng, lambda: itl_run(eng, n_dec, 64, long_prompt, n_long,
                                                                    out_len, V, 8, seed=2))
                print(f"  mixed {name} step times: {json.dumps(r['step_times'])}", flush=True)
            res["results"][name] = r
            print(f"  mixed {name}: decode-only ITL P50 {p50} ms, P99 with long prompts {p99} ms "
                  f"({_f(r['p99_over_decode_p50'])}x), long TTFT p50 {r['long_prompt_ttft_ms']['p50']} ms, "
                  f"paths {r['paths']}", flush=True)
            del eng
        except Exception as e:          # noqa: BLE001
            res["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        out_path.write_text(json.dumps(res, indent=2))
    return res


# ---------------------------------------------------------------------------------------------------
# Part 3: speculative decoding at batch 1 (run in its own process: --part speculative)
# ---------------------------------------------------------------------------------------------------
def run_speculative_part(args, out_path: Path) -> dict:
    import torch

    from tritune.model.engine import spec_decode as SD
    from tritune.model.engine.engine import Engine
    from tritune.model.gpt2.model import GPT2
    from tritune.model.engine.scheduler import SamplingParams
    from tritune.model.tokenizer import Tokenizer

    gpu = torch.cuda.is_available()
    backend, dtype = ("triton", torch.bfloat16) if gpu else ("torch", torch.float32)
    model = GPT2.from_pretrained(args.spec_model or ROOT / "model" / "default", backend=backend, dtype=dtype)
    tok = Tokenizer.from_dir(model.directory)
    n_prompts, plen, new = (2, 24, 24) if args.smoke else (4, 48, 128)
    prompts = [tok.encode(p)[:plen] for p in PASSAGES[:n_prompts]]
    draft_dir = Path(args.draft) if args.draft else SD.default_draft_dir(model)
    draft = SD.load_draft(model, args.draft)
    early = SD.early_exit_draft(model, 2)
    greedy = dict(temperature=0.0)
    sampled = dict(temperature=0.8, top_k=50, seed=0)
    runs = {        # name: (Engine keywords, sampling, the plain run it compares with)
        "plain": ({}, greedy, None),
        "plain-eager": ({"cuda_graphs": False}, greedy, "plain"),
        "ngram": ({"speculative": lambda: SD.NgramProposer(k=4)}, greedy, "plain"),
        "draft": ({"speculative": lambda: SD.DraftModelProposer(draft, k=2)}, greedy, "plain"),
        "draft-k4": ({"speculative": lambda: SD.DraftModelProposer(draft, k=4)}, greedy, "plain"),
        "early-exit-2": ({"speculative": lambda: SD.DraftModelProposer(early, k=2)}, greedy, "plain"),
        "plain-sampled": ({}, sampled, None),
        "draft-sampled": ({"speculative": lambda: SD.DraftModelProposer(draft, k=2)}, sampled, "plain-sampled"),
    }
    res = {"gpu": torch.cuda.get_device_name() if gpu else "cpu", "backend": backend,
           "dtype": str(dtype).replace("torch.", ""), "target": str(model.directory), "draft": str(draft_dir),
           "shape": {"prompts": len(prompts), "prompt_len": plen, "new_tokens": new, "batch": 1},
           "results": {}, "errors": {}}
    try:
        res["draft_metrics"] = json.loads((draft_dir / "metrics.json").read_text()).get("teacher")
    except (OSError, ValueError):
        pass
    outs = {}
    for name, (kw, sp, base) in runs.items():
        try:
            kw = {key: (v() if callable(v) else v) for key, v in kw.items()}
            eng = Engine(model, num_blocks=-(-model.config.n_positions // 16) + 2, block_size=16, max_num_seqs=1,
                         **kw)
            eng.warm_up()
            # an untimed pass: the verify step's shapes compile here, not in the timed runs
            eng.add_request(prompts[0], SamplingParams(max_new_tokens=min(new, 32), ignore_eos=True, **sp))
            eng.run()
            s0 = dict(eng.stats)
            toks, secs, out = 0, 0.0, []
            for p in prompts:
                req = eng.add_request(p, SamplingParams(max_new_tokens=new, ignore_eos=True, **sp))
                eng.run()
                secs += req.finish_time - req.first_token_time
                toks += len(req.output_ids) - 1
                out.append(req.output_ids)
            outs[name] = out
            r = {"decode_tok_s": round(toks / secs, 1), "sampling": sp}
            if eng.spec is not None:
                prop = eng.stats["spec_proposed"] - s0["spec_proposed"]
                acc = eng.stats["spec_accepted"] - s0["spec_accepted"]
                steps = eng.stats["spec_steps"] - s0["spec_steps"]
                r.update(proposer=eng.spec.proposer.name, acceptance_rate=round(acc / max(1, prop), 4),
                         proposed=prop, accepted=acc, tokens_per_step=round(toks / max(1, steps), 3),
                         graph_replays=eng.stats["spec_graph_replays"] - s0["spec_graph_replays"],
                         host_syncs=eng.stats["spec_syncs"] - s0["spec_syncs"],
                         on_device=eng.spec.graphs is not None and bool(eng.spec.graphs.graphs))
            if base and base in res["results"]:
                r["speedup"] = round(r["decode_tok_s"] / res["results"][base]["decode_tok_s"], 3)
                if sp is greedy:
                    r["outputs_equal_plain"] = out == outs[base]
                if name != "plain-eager" and "plain-eager" in res["results"] and sp is greedy:
                    r["speedup_vs_eager"] = round(r["decode_tok_s"] / res["results"]["plain-eager"]["decode_tok_s"],
                                                  3)
            res["results"][name] = r
            print(f"  speculative {name}: {r}", flush=True)
            del eng
        except Exception as e:          # noqa: BLE001  one configuration's failure is a recorded result
            res["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        out_path.write_text(json.dumps(res, indent=2))     # what is done so far survives a timeout
    return res


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------
def summarize(results: dict) -> dict:
    out = {}
    spr = results.get("shared-prefix") or {}
    sp = spr.get("results")
    if sp and "cache_off" in sp and "cache_on" in sp:
        best = max(spr["output_tok_s_speedup"].values())
        out["shared-prefix"] = {
            "prefill_tokens": {k: v["prefill_tokens_computed"] for k, v in sp.items()},
            "prefill_token_reduction": round(spr["prefill_token_reduction"], 3),
            "output_tok_s": {k: round(v["output_tok_s"]) for k, v in sp.items()},
            "output_tok_s_speedup": {k: round(v, 3) for k, v in spr["output_tok_s_speedup"].items()},
            "ttft_p50_ms": {k: v["ttft_ms"]["p50"] for k, v in sp.items()},
            "ttft_p99_ms": {k: v["ttft_ms"]["p99"] for k, v in sp.items()},
            # kernel variants compiled inside a timed run: each is about a second not spent serving
            "jit_compiles": {k: (v.get("jit_compiles") or {}).get("count") for k, v in sp.items()},
            "paths": {k: v.get("paths") for k, v in sp.items()},
            "met": spr["prefill_token_reduction"] >= 0.7 and best >= 1.5}
    mx = (results.get("mixed") or {}).get("results")
    if mx:
        out["mixed"] = {k: {"decode_only_p50_ms": v["itl_decode_only_ms"]["p50"],
                            "p99_with_long_prompts_ms": v["itl_with_long_prompts_ms"]["p99"],
                            "p99_over_decode_p50": v["p99_over_decode_p50"],
                            "long_prompt_ttft_p50_ms": v["long_prompt_ttft_ms"]["p50"],
                            "paths": v["paths"]} for k, v in mx.items()}
        out["mixed"]["long_prompt"] = (results["mixed"].get("shape") or {}).get("long_prompt")
        rs = [v["p99_over_decode_p50"] for k, v in mx.items() if k.startswith("chunked") and v["p99_over_decode_p50"]]
        out["mixed"]["met"] = bool(rs) and min(rs) <= 2.0
    spc = (results.get("speculative") or {}).get("results")
    if spc:
        keep = ("decode_tok_s", "acceptance_rate", "tokens_per_step", "speedup", "speedup_vs_eager",
                "outputs_equal_plain")
        out["speculative"] = {k: {kk: v[kk] for kk in keep if kk in v} for k, v in spc.items()}
        out["speculative"]["met"] = any((spc.get(k) or {}).get("speedup", 0) >= 1.5
                                        for k in ("ngram", "draft", "draft-k4"))
    return out


def _f(x, fmt="{:.3g}"):
    return "-" if x is None else fmt.format(x)


def compact(status: dict, summary: dict) -> str:
    """A few lines for the terminal: each part's status, its numbers against the targets."""
    lines = []
    for name, st in status.items():
        bad = "" if st.get("rc") == 0 and not st.get("errors") else \
            f"  FAILED {({k: v for k, v in st.items() if k != 'seconds'})}"
        lines.append(f"[{name}] {st['seconds']} s{bad}")
        sm = summary.get(name) or {}
        if name == "shared-prefix" and sm:
            pt, ts, sx = sm["prefill_tokens"], sm["output_tok_s"], sm["output_tok_s_speedup"]
            lines.append(f"  prefill tokens {pt['cache_off']} -> {pt['cache_on']} ({sm['prefill_token_reduction']:.0%} "
                         f"fewer, target >= 70%); met {sm['met']} (output tok/s target >= 1.5x cache_off)")
            for k in ts:
                lines.append(f"  {k}: {ts[k]} tok/s" + (f" ({sx[k]:.2f}x)" if k in sx else "")
                             + f", TTFT P50 {_f(sm['ttft_p50_ms'][k])} P99 {_f(sm['ttft_p99_ms'][k])} ms, "
                             f"jit {sm['jit_compiles'][k]}, paths {sm['paths'][k]}")
        elif name == "mixed" and sm:
            for k, r in sm.items():
                if k in ("long_prompt", "met"):
                    continue
                lines.append(f"  {k}: decode-only ITL P50 {_f(r['decode_only_p50_ms'])} ms, P99 with "
                             f"{sm['long_prompt']}-token prompts {_f(r['p99_with_long_prompts_ms'])} ms "
                             f"({_f(r['p99_over_decode_p50'])}x), long TTFT P50 {_f(r['long_prompt_ttft_p50_ms'])} ms; "
                             f"paths {r['paths']}")
            lines.append(f"  target chunked P99 <= 2x decode-only P50: met {sm['met']}")
        elif name == "speculative" and sm:
            for k, r in sm.items():
                if k == "met":
                    continue
                extra = "" if "acceptance_rate" not in r else \
                    f", acceptance {r['acceptance_rate']:.0%}, {r['tokens_per_step']} tok/step"
                lines.append(f"  {k}: {r['decode_tok_s']} tok/s{extra}"
                             + (f", {_f(r['speedup'])}x plain" if "speedup" in r else "")
                             + (f", {_f(r.get('speedup_vs_eager'))}x eager" if "speedup_vs_eager" in r else "")
                             + ("" if r.get("outputs_equal_plain") in (None, True) else ", OUTPUTS DIFFER"))
            lines.append(f"  target >= 1.5x plain (ngram or draft): met {sm['met']}")
    if "error" in summary:
        lines.append(f"summary: {summary['error']}")
    return "\n".join(lines)


def part_budget(left: float, name: str, pending: list[str]) -> float:
    """This part's share of the time left (a part that finished early leaves its slack to the others)."""
    return max(10.0, left * SHARE[name] / sum(SHARE[p] for p in pending))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="results root (default: results)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {','.join(PARTS)}")
    ap.add_argument("--model", default=None, help="shared-prefix and mixed model (default: GPT-2 small's config, "
                    "random weights; mixed: with 2560 positions)")
    ap.add_argument("--spec-model", default=None, help="speculative target (default model/default)")
    ap.add_argument("--draft", default=None, help="speculative draft (default: the target's draft/ checkpoint)")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for all parts (default 240)")
    ap.add_argument("--graph-tokens", default="64,128", help="prefill rows a step in the captured decode step "
                    "(graph_prefill_tokens; mixed: one run per value, shared-prefix: the first)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--step-times", action="store_true", help="mixed, on a GPU: a third run of each setting "
                    "timing each step (wall) and its graph replay (CUDA events), by path")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)    # internal: run one part in-process
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part == "speculative":
        run_speculative_part(args, Path(args.out))
        return 0
    if args.part == "shared-prefix":
        run_shared_prefix_part(args, Path(args.out))
        return 0
    if args.part == "mixed":
        run_mixed_part(args, Path(args.out), Path(args.model))
        return 0
    try:
        if not all(int(x) > 0 for x in args.graph_tokens.split(",")):
            raise ValueError
    except ValueError:
        print(f"--graph-tokens: expected comma-separated ints >= 1, got {args.graph_tokens!r}", file=sys.stderr)
        return 2
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        print(f"--parts: unknown {bad or parts}; expected some of {','.join(PARTS)}", file=sys.stderr)
        return 2
    results, status = {}, {}
    t_all = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="serving_features_"))
    try:
        for i, name in enumerate(parts):
            path = tmp / f"serving_{name.replace('-', '_')}.json"
            left = args.time_limit - (time.perf_counter() - t_all)
            limit = part_budget(left, name, parts[i:])
            t0 = time.perf_counter()
            try:
                cmd = [sys.executable, __file__, "--part", name, "--out", str(path),
                       "--graph-tokens", args.graph_tokens] + (["--smoke"] if args.smoke else []) \
                    + (["--step-times"] if args.step_times else [])
                if name == "speculative":
                    cmd += ["--spec-model", args.spec_model] if args.spec_model else []
                    cmd += ["--draft", args.draft] if args.draft else []
                else:
                    model = args.model
                    if name == "mixed" and model is None:
                        n_pos = 512 if args.smoke else 2560
                        model = write_random_gpt2(tmp / f"gpt2-{n_pos}", n_positions=n_pos, tiny=args.smoke)
                    cmd += ["--model", str(model)] if model else []
                print(f"[{name}] {' '.join(map(str, cmd[1:]))} (limit {limit:.0f} s)", flush=True)
                p = subprocess.run(cmd, timeout=limit, cwd=ROOT)
                status[name] = {"rc": p.returncode}
            except subprocess.TimeoutExpired:
                status[name] = {"rc": None, "timed_out": True}
            except Exception as e:      # noqa: BLE001  recorded, and the next part still runs
                status[name] = {"rc": None, "error": f"{type(e).__name__}: {e}"}
            status[name]["seconds"] = round(time.perf_counter() - t0, 1)
            if path.exists():
                try:
                    results[name] = json.loads(path.read_text())
                except ValueError as e:
                    status[name]["error"] = f"unreadable JSON: {e}"
            if (results.get(name) or {}).get("errors"):
                status[name]["errors"] = results[name]["errors"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        summary = summarize(results)
    except Exception as e:      # noqa: BLE001  a malformed part result must not lose the others' status
        summary = {"error": f"{type(e).__name__}: {e}"}
    rows = [{"part": name, "status": status[name], **(results.get(name) or {})} for name in status]
    path = write_rows("serving_features", rows, args.results, smoke=args.smoke,
                      seconds=round(time.perf_counter() - t_all, 1), summary=summary, command=" ".join(sys.argv))
    print(compact(status, summary))
    print(f"wrote {path}")
    return 0 if all(s.get("rc") == 0 and not s.get("errors") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
