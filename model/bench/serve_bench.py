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
sequence re-run for every token). Without ``--model``, GPT-2 small's config with random weights.

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
from dataclasses import dataclass
from pathlib import Path
from tritune.model.bench.workload import Item, make_workload, parse_range, percentiles  # noqa: F401  (re-exported)

# The defaults without a GPU (see the module docstring); a flag given explicitly always wins.
GPU_DEFAULTS = {"modes": "triton-graphs", "prompt_len": (64, 512), "output_len": (64, 512), "decode_tokens": 512,
                "naive_requests": 2, "naive_tokens": 64}
# GPT-2 small in fp32 on a few CPU cores: a forward of 64 tokens takes 0.1 s to seconds, and the naive
# baseline re-runs the whole sequence per token (the old defaults: over 300 s before any output)
CPU_DEFAULTS = {"modes": "torch", "prompt_len": (16, 64), "output_len": (16, 64), "decode_tokens": 32,
                "naive_requests": 1, "naive_tokens": 8}

MODES = {
    "torch": dict(backend="torch", cuda_graphs=False),
    "torch-compile": dict(backend="torch", cuda_graphs=False, compile=True),
    "triton": dict(backend="triton", cuda_graphs=False),
    "triton-graphs": dict(backend="triton", cuda_graphs=True),
    "triton-int8": dict(backend="triton", cuda_graphs=True, quant="int8"),
    "triton-int4": dict(backend="triton", cuda_graphs=True, quant="int4"),
}


def load_models(model_dir, dtype, device, need_hf=True):
    """(our config, state dict on the CPU, HF model or None). Random GPT-2 small without model_dir."""
    import torch

    from tritune.model.gpt2 import weights as W
    from tritune.model.gpt2.config import GPT2Config

    if model_dir:
        directory = W.resolve(model_dir)
        config = GPT2Config.from_file(directory / "config.json")
        state = W.load_state_dict(directory)
        W.check_state(config, state, str(directory))
        hf = None
        if need_hf:
            from transformers import GPT2LMHeadModel

            hf = GPT2LMHeadModel.from_pretrained(str(directory), torch_dtype=dtype)
    else:
        from transformers import GPT2Config as HFConfig, GPT2LMHeadModel

        torch.manual_seed(0)
        hc = HFConfig()
        hf = GPT2LMHeadModel(hc)
        state = {k[len("transformer."):] if k.startswith("transformer.") else k: v
                 for k, v in hf.state_dict().items()}
        config = GPT2Config.from_dict(hc.to_dict(), "transformers GPT2Config()")
        if not need_hf:
            hf = None
    if hf is not None:
        hf = hf.to(device=device, dtype=dtype).eval()
    return config, state, hf


def build_model(config, state, backend, dtype, device):
    from tritune.model.gpt2 import weights as W
    from tritune.model.gpt2.model import GPT2

    return GPT2(config, W.to_layout(config, state, dtype, device), backend=backend)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def progress(total, desc: str, unit: str = "tok", show: bool = False):
    """A tqdm bar (rate and ETA) on stderr, or a silent one: ``show`` False (``--quiet``, library calls)
    or stdout not a terminal (a log file, a pipe: no carriage-return litter)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True,
                disable=not show or not sys.stdout.isatty())


# ---------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------
class CompileLog:
    """Triton JIT compilations (kernel-cache misses: a compile, or a load from the on-disk cache) while
    active: a timed run that meets one is timing a compile, so runs report ``jit_compiles`` (and the
    first few kernels' names and constexprs) and a warm-up that misses a variant shows here."""

    def __init__(self):
        self.events = []
        self._saved = None

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        comp = kwargs.get("compile") if isinstance(kwargs.get("compile"), dict) else {}
        names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []

        def label(k):  # constants are keyed by (argument index,) paths
            i = k[0] if isinstance(k, tuple) and k and isinstance(k[0], int) else None
            return names[i] if i is not None and i < len(names) else str(k)

        self.events.append({"kernel": name.rsplit(".", 1)[-1], "num_warps": comp.get("num_warps"),
                            "constexprs": {label(k): v for k, v in (comp.get("constants") or {}).items()
                                           if isinstance(v, (int, float, bool, str))}})
        return False  # never skip the compile

    def __enter__(self):
        try:
            import triton

            knobs = triton.knobs.runtime
            self._saved = knobs.jit_cache_hook
            knobs.jit_cache_hook = self._hook
        except Exception:  # a Triton without the hook: nothing is logged
            self._saved = False
        return self

    def __exit__(self, *exc):
        if self._saved is not False:
            import triton

            triton.knobs.runtime.jit_cache_hook = self._saved

    def summary(self, limit: int = 12) -> dict:
        from collections import Counter

        return {"count": len(self.events), "by_kernel": dict(Counter(e["kernel"] for e in self.events)),
                "first": self.events[:limit]}


def run_engine(engine, items, *, desc: str = "run", show_progress: bool = False) -> dict:
    """Serve ``items`` (arrivals relative to the start); metrics of the run (``jit_compiles``: the
    kernel variants first met inside the timed run; zero after a complete warm-up)."""
    with CompileLog() as log, progress(sum(it.output_len for it in items), desc, show=show_progress) as bar:
        r = _run_engine(engine, items, bar)
    r["jit_compiles"] = log.summary()
    if log.events:
        _print(f"warning: {len(log.events)} kernel variant(s) compiled inside the timed run "
               f"({r['jit_compiles']['by_kernel']}): the warm-up missed them, the run's time includes them")
    return r


def _run_engine(engine, items, bar=None) -> dict:
    from tritune.model.engine.scheduler import SamplingParams

    pending = sorted(range(len(items)), key=lambda i: items[i].arrival)
    reqs = [None] * len(items)
    steps0, pre0 = engine.stats["steps"], engine.stats["preemptions"]
    dec0 = engine.stats["decode_tokens"]
    multi0, tm0 = engine.stats["multi_steps"], dict(engine.timings)
    engine.pool.peak_used = engine.pool.num_used
    _sync()
    t0 = time.perf_counter()
    k = 0
    while k < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while k < len(pending) and items[pending[k]].arrival <= now:
            i = pending[k]
            it = items[i]
            reqs[i] = engine.add_request(it.prompt_ids, SamplingParams(max_new_tokens=it.output_len, ignore_eos=True),
                                         arrival_time=t0 + it.arrival)
            k += 1
        if engine.has_unfinished():
            engine.step()
            if bar is not None:     # decode tokens so far (each request's first token comes with its prefill)
                bar.update(engine.stats["decode_tokens"] - dec0 - bar.n)
        elif k < len(pending):
            time.sleep(max(0.0, items[pending[k]].arrival - (time.perf_counter() - t0)))
    _sync()
    elapsed = time.perf_counter() - t0
    out_tok = sum(len(r.output_ids) for r in reqs)
    in_tok = sum(len(r.prompt_ids) for r in reqs)
    ttft = [r.first_token_time - r.arrival_time for r in reqs]
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs if len(r.output_ids) > 1]
    return {"requests": len(reqs), "elapsed_s": elapsed, "prompt_tokens": in_tok, "output_tokens": out_tok,
            "output_tok_s": out_tok / elapsed, "total_tok_s": (in_tok + out_tok) / elapsed,
            "req_s": len(reqs) / elapsed, "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "peak_kv_blocks": engine.pool.peak_used, "kv_blocks": engine.pool.num_blocks,
            "steps": engine.stats["steps"] - steps0, "multi_steps": engine.stats["multi_steps"] - multi0,
            "preemptions": engine.stats["preemptions"] - pre0,
            "host_s": {k[:-2]: round(engine.timings[k] - tm0[k], 4) for k in tm0 if k.endswith("_s")}}


def decode_rate(engine, prompt_len=64, new_tokens=512, vocab=50257, *, desc: str = "batch-1 decode",
                show_progress: bool = False) -> dict:
    """One request alone: decode tokens/s after the first token, and where a token's time goes: on the
    graph path the GPU's share (CUDA events around the replays) and the host's phases of ``step()``."""
    import random

    from tritune.model.engine.scheduler import SamplingParams

    new_tokens = min(new_tokens, engine.config.n_positions - prompt_len)
    rnd = random.Random(1)
    engine.gpu_timing = engine.graphs is not None
    gpu0, tm0 = engine.stats["graph_gpu_s"], dict(engine.timings)
    req = engine.add_request([rnd.randrange(vocab - 1) for _ in range(prompt_len)],
                             SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    with progress(new_tokens, desc, show=show_progress) as bar:
        while engine.has_unfinished():
            engine.step()
            bar.update(len(req.output_ids) - bar.n)
    engine.gpu_timing = False
    dt = req.finish_time - req.first_token_time
    n = new_tokens - 1
    r = {"prompt_len": prompt_len, "new_tokens": new_tokens, "decode_tok_s": n / dt, "ms_per_token": dt / n * 1e3}
    tm = {k: engine.timings[k] - tm0[k] for k in tm0}
    r["host_us_per_token"] = {k[:-2]: v / n * 1e6 for k, v in tm.items() if k.endswith("_s") and v}
    if engine.graphs is not None:
        r["gpu_ms_per_token"] = (engine.stats["graph_gpu_s"] - gpu0) / n * 1e3
        r["decode_steps"] = engine.decode_steps
    return r


def warm_up(engine, vocab, max_len):
    """Compile the kernels' shape variants (and the compiled graph) before timing."""
    import random

    from tritune.model.engine.scheduler import SamplingParams

    engine.warm_up()        # the prefill (and eager decode) kernel variants of every step size
    rnd = random.Random(0)
    lens = [1, 2, 15, 16, 17, 63, 64, 100, 129, min(max_len, 511), min(max_len, 512)]
    n = min(len(lens) * 3, engine.max_num_seqs + 8)
    for i in range(n):
        p = lens[i % len(lens)]
        engine.add_request([rnd.randrange(vocab - 1) for _ in range(p)],
                           SamplingParams(max_new_tokens=3 + i % 5, ignore_eos=True))
    engine.run()


def run_hf(hf, items, batch_size, limit, *, show_progress: bool = False) -> dict:
    """transformers generate, static batches in arrival order, left-padded, each to its longest output."""
    import torch

    sub = items[:limit] if limit else items
    pad = 0
    useful = 0
    dev = next(hf.parameters()).device
    with torch.inference_mode():     # warm-up at the timed batch size: kernels, allocator, generate's setup
        w = [it.prompt_ids for it in sub[:batch_size]]
        L = max(map(len, w))
        hf.generate(input_ids=torch.tensor([[pad] * (L - len(p)) + p for p in w], device=dev),
                    attention_mask=torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in w], device=dev),
                    max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=pad)
    _sync()
    t0 = time.perf_counter()
    bar = progress(sum(it.output_len for it in sub), "transformers", show=show_progress)
    for s in range(0, len(sub), batch_size):
        batch = sub[s:s + batch_size]
        L = max(len(it.prompt_ids) for it in batch)
        new = max(it.output_len for it in batch)
        ids = torch.full((len(batch), L), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), L), dtype=torch.long)
        for i, it in enumerate(batch):
            ids[i, L - len(it.prompt_ids):] = torch.tensor(it.prompt_ids)
            mask[i, L - len(it.prompt_ids):] = 1
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=pad)
        useful += sum(it.output_len for it in batch)
        bar.update(sum(it.output_len for it in batch))
    bar.close()
    _sync()
    el = time.perf_counter() - t0
    out_tok_s = useful / el
    total = sum(it.output_len for it in items)
    return {"batch_size": batch_size, "requests_timed": len(sub), "elapsed_s": el, "output_tokens": useful,
            "output_tok_s": out_tok_s, "extrapolated_elapsed_s": total / out_tok_s,
            "note": None if len(sub) == len(items) else
            f"timed the first {len(sub)} of {len(items)} requests; elapsed for all extrapolated at that rate"}


def run_naive(hf, items, n, max_new, *, show_progress: bool = False) -> dict:
    """Single request, no KV cache: every token re-runs the whole sequence (HF forward, use_cache=False)."""
    import torch

    dev = next(hf.parameters()).device
    toks = 0
    p0 = items[0].prompt_ids
    with torch.inference_mode():     # warm-up: kernels and allocator at the lengths timed below
        for L in (len(p0), len(p0) + max_new):
            hf(torch.tensor([(p0 * (L // len(p0) + 1))[:L]], device=dev), use_cache=False)
    _sync()
    t0 = time.perf_counter()
    total = sum(min(max_new, it.output_len) for it in items[:n])
    with torch.inference_mode(), progress(total, "naive", show=show_progress) as bar:
        for it in items[:n]:
            ids = torch.tensor([it.prompt_ids], device=dev)
            for _ in range(min(max_new, it.output_len)):
                logits = hf(ids, use_cache=False).logits[:, -1]
                ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
                toks += 1
            int(ids[0, -1])
            bar.update(min(max_new, it.output_len))
    _sync()
    el = time.perf_counter() - t0
    return {"requests": min(n, len(items)), "tokens": toks, "elapsed_s": el, "output_tok_s": toks / el,
            "note": f"first {max_new} output tokens of each request (shorter sequences than the full outputs, "
                    "which flatters naive)"}


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
# ---------------------------------------------------------------------------------------------------
# Feature workloads (--workload): prefix caching, chunked prefill, speculative decoding
# ---------------------------------------------------------------------------------------------------
WORKLOADS = ("random", "shared-prefix", "mixed", "speculative")


def shared_prefix_items(n, prefix_len, suffix_len, output_len, vocab, seed=0) -> list[Item]:
    """n requests: one common prefix (a system prompt) + a suffix of its own each, arriving at once."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab - 1, prefix_len).tolist()
    return [Item(prefix + rng.integers(0, vocab - 1, int(rng.integers(suffix_len[0], suffix_len[1] + 1))).tolist(),
                 output_len, 0.0) for _ in range(n)]


def run_shared_prefix(make_engine, items, *, show_progress=False) -> dict:
    """The same shared-prefix workload with the prefix cache on and off: prefill tokens computed, TTFT,
    output tok/s."""
    res = {}
    for name, on in (("cache_off", False), ("cache_on", True)):
        eng = make_engine(enable_prefix_caching=on)
        eng.pool.reset_cache()                     # the warm-up's blocks: not part of the run
        p0, c0 = eng.stats["prefill_tokens"], eng.scheduler.stats["cached_tokens"]
        r = run_engine(eng, items, desc=f"shared-prefix {name}", show_progress=show_progress)
        r["prefill_tokens_computed"] = eng.stats["prefill_tokens"] - p0
        r["prefix_cached_tokens"] = eng.scheduler.stats["cached_tokens"] - c0
        res[name] = r
        del eng
    off, on = res["cache_off"], res["cache_on"]
    res["prefill_token_reduction"] = 1 - on["prefill_tokens_computed"] / max(1, off["prefill_tokens_computed"])
    res["output_tok_s_speedup"] = on["output_tok_s"] / off["output_tok_s"]
    return res


def _itl_run(eng, n_decodes, decode_prompt, long_prompt, n_long, output_len, vocab, every, seed=0):
    """n_decodes requests decode; once each has its first token (their own prefills are not measured),
    4 * ``every`` steps of decode only, then after every ``every``-th step one of n_long long prompts arrives
    (the decodes' output covers them all). Inter-token latencies of the decoding requests, split into steps
    before any long prompt arrived (decode only) and after; the long prompts' TTFT; steps per path."""
    import numpy as np

    from tritune.model.engine.scheduler import SamplingParams

    rng = np.random.default_rng(seed)
    times: dict = {}

    def stream(req, tok):
        if tok is not None:
            times.setdefault(req.id, []).append(time.perf_counter())

    paths0 = dict(eng.path_counts)
    for _ in range(n_decodes):
        eng.add_request(rng.integers(0, vocab - 1, decode_prompt).tolist(),
                        SamplingParams(max_new_tokens=output_len, ignore_eos=True), stream=stream)
    _sync()
    while len(times) < n_decodes and eng.has_unfinished():
        eng.step()
    t_ramp = time.perf_counter()
    steps, t_first_long, longs = 0, None, []
    while eng.has_unfinished():
        if steps >= 4 * every and steps % every == 0 and len(longs) < n_long:
            if t_first_long is None:
                t_first_long = time.perf_counter()
            longs.append(eng.add_request(rng.integers(0, vocab - 1, long_prompt).tolist(),
                                         SamplingParams(max_new_tokens=4, ignore_eos=True)))
        eng.step()
        steps += 1
    decode_only, mixed = [], []
    for ts in times.values():
        if len(ts) < 2 or len(ts) < output_len:     # the long prompts' own tokens are not counted
            continue
        for a, b in zip(ts, ts[1:]):
            if a >= t_ramp:
                (decode_only if t_first_long is None or b < t_first_long else mixed).append(b - a)
    ttft = [r.first_token_time - r.arrival_time for r in longs if r.first_token_time is not None]
    paths = {k: v - paths0.get(k, 0) for k, v in sorted(eng.path_counts.items()) if v - paths0.get(k, 0)}
    return {"itl_decode_only_ms": percentiles(decode_only), "itl_with_long_prompts_ms": percentiles(mixed),
            "long_prompt_ttft_ms": percentiles(ttft), "long_prompts": len(longs), "steps": steps, "paths": paths}


def run_mixed(make_engine, *, n_decodes, decode_prompt, long_prompt, n_long, output_len, vocab, chunk, every) -> dict:
    """Decodes running while long prompts arrive: P99 inter-token latency with and without chunked prefill
    (budget ``chunk`` tokens per step), against the decode-only P50."""
    res = {}
    for name, kw in (("unchunked", {}), ("chunked", {"enable_chunked_prefill": True, "max_batch_tokens": chunk})):
        eng = make_engine(prefill_batching=False, decode_steps=1, **kw)
        # the same pattern once, short, untimed: a long prompt's kernel variants (its prefill, or its chunks
        # beside the decodes) compile here; met first inside the timed run, each is a 1 s stall in the P99
        _itl_run(eng, n_decodes, decode_prompt, long_prompt, 1, 4 * every + 8, vocab, every, seed=1)
        res[name] = _itl_run(eng, n_decodes, decode_prompt, long_prompt, n_long, output_len, vocab, every)
        del eng
    for name in ("unchunked", "chunked"):
        r = res[name]
        p50 = r["itl_decode_only_ms"]["p50"]
        p99 = r["itl_with_long_prompts_ms"]["p99"]
        r["p99_over_decode_p50"] = p99 / p50 if p50 and p99 else None
    return res


def run_speculative(make_engine, proposers: dict, prompts, new_tokens) -> dict:
    """Batch 1: each prompt alone, plain decode against each proposer; tok/s after the first token and
    the acceptance rate (accepted / proposed draft tokens)."""
    from tritune.model.engine.scheduler import SamplingParams

    res = {}
    for name, prop in [("plain", None)] + list(proposers.items()):
        eng = make_engine(speculative=prop() if prop else None)
        dts, toks, out = 0.0, 0, []
        for p in prompts:
            req = eng.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            eng.run()
            dts += req.finish_time - req.first_token_time
            toks += len(req.output_ids) - 1
            out.append(req.output_ids)
        st = eng.stats
        res[name] = {"decode_tok_s": toks / dts, "outputs_equal_plain": None if name == "plain" else
                     out == res["plain"]["_out"], "_out": out}
        if prop:
            res[name].update(acceptance_rate=st["spec_accepted"] / max(1, st["spec_proposed"]),
                             proposed=st["spec_proposed"], accepted=st["spec_accepted"], steps=st["spec_steps"])
            res[name]["speedup"] = res[name]["decode_tok_s"] / res["plain"]["decode_tok_s"]
        del eng
    for r in res.values():
        r.pop("_out")
    return res


def run_workload(args) -> int:
    """``--workload shared-prefix | mixed | speculative``: the feature workloads on one model and mode
    (the first of ``--modes``), each against its own baseline; JSON to ``--out``."""
    import torch

    from tritune.model.engine import spec_decode as SD
    from tritune.model.engine.engine import Engine

    gpu = torch.cuda.is_available()
    fill_defaults(args, gpu)
    device = "cuda" if gpu else "cpu"
    dtype = args.dtype or (torch.bfloat16 if gpu else torch.float32)
    mode_name = args.modes.split(",")[0]
    if mode_name not in MODES:
        print(f"tritune serve-bench: unknown mode {mode_name!r}; expected one of {list(MODES)}", file=sys.stderr)
        return 2
    mode = MODES[mode_name]
    try:
        config, state, _ = load_models(args.model, dtype, device, need_hf=False)
        draft = None
        if args.workload == "speculative" and args.draft:
            dconf, dstate, _ = load_models(args.draft, dtype, device, need_hf=False)
            draft = build_model(dconf, dstate, mode["backend"], dtype, device)
    except (OSError, ValueError) as e:
        print(f"tritune serve-bench: {e}", file=sys.stderr)
        return 2
    model = build_model(config, state, mode["backend"], dtype, device)
    V, ctx = config.vocab_size, config.n_positions
    show = not args.quiet

    def make_engine(**kw):
        base = dict(max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens,
                    block_size=args.block_size, cuda_graphs=mode.get("cuda_graphs", False),
                    compile=mode.get("compile", False), quant=mode.get("quant"))
        if gpu:
            base["kv_memory_fraction"] = args.kv_memory_fraction
        base.update(kw)
        eng = Engine(model, **base)
        warm_up(eng, V, min(512, ctx - 8))
        return eng

    from tritune.kernels.runtime import device as hdev

    res = {"gpu": hdev.gpu_name() if gpu else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "model": args.model or "GPT-2 small config, random weights", "mode": mode_name,
           "workload": args.workload, "torch": torch.__version__,
           "command": "tritune serve-bench " + " ".join(sys.argv[2:])}
    if args.workload == "shared-prefix":
        out_len = args.output_len[0]
        items = shared_prefix_items(args.num_requests, args.prefix_len, args.prompt_len, out_len, V, args.seed)
        res["shape"] = {"requests": len(items), "prefix_len": args.prefix_len, "suffix_len": list(args.prompt_len),
                        "output_len": out_len}
        res["results"] = run_shared_prefix(make_engine, items, show_progress=show)
        r = res["results"]
        _print(f"shared prefix: {r['prefill_token_reduction']:.0%} fewer prefill tokens, output tok/s "
               f"{r['cache_off']['output_tok_s']:.0f} -> {r['cache_on']['output_tok_s']:.0f} "
               f"({r['output_tok_s_speedup']:.2f}x)")
    elif args.workload == "mixed":
        long_prompt = min(args.long_prompt, ctx - 4)
        out_len = min(args.output_len[0], ctx - 64)
        res["shape"] = {"decodes": args.num_requests, "decode_prompt": 64, "long_prompt": long_prompt,
                        "long_prompts": args.long_prompts, "output_len": out_len, "chunk": args.chunk}
        res["results"] = run_mixed(make_engine, n_decodes=args.num_requests, decode_prompt=64,
                                   long_prompt=long_prompt, n_long=args.long_prompts, output_len=out_len,
                                   vocab=V, chunk=args.chunk, every=8)
        for k, r in res["results"].items():
            _print(f"mixed {k}: decode-only ITL P50 {r['itl_decode_only_ms']['p50']} ms, with long prompts P99 "
                   f"{r['itl_with_long_prompts_ms']['p99']} ms ({r['p99_over_decode_p50']})")
    else:
        import numpy as np

        rng = np.random.default_rng(args.seed)
        plen = min(args.prompt_len[0], ctx // 2)
        new = min(args.output_len[0], ctx - plen)
        prompts = [rng.integers(0, V - 1, plen).tolist() for _ in range(args.num_requests)]
        k = args.spec_k
        props = {"ngram": lambda: SD.NgramProposer(k=k)}
        if draft is not None:
            props["draft"] = lambda: SD.DraftModelProposer(draft, k=k, block_size=args.block_size)
        elif args.draft_layers:
            dm = SD.early_exit_draft(model, args.draft_layers)
            props[f"early-exit-{args.draft_layers}"] = lambda: SD.DraftModelProposer(dm, k=k, block_size=args.block_size)
        res["shape"] = {"prompts": len(prompts), "prompt_len": plen, "new_tokens": new, "k": k,
                        "draft": args.draft, "draft_layers": args.draft_layers}
        res["results"] = run_speculative(make_engine, props, prompts, new)
        for name, r in res["results"].items():
            _print(f"speculative {name}: {r['decode_tok_s']:.0f} tok/s"
                   + (f", acceptance {r['acceptance_rate']:.0%}, {r['speedup']:.2f}x plain, outputs equal plain: "
                      f"{r['outputs_equal_plain']}" if name != "plain" else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


def add_parser(subparsers, name: str) -> None:
    if name != "serve-bench":
        return
    from tritune.kernels.runtime.args import parse_dtype

    s = subparsers.add_parser("serve-bench", help="serving throughput/latency of the engine vs transformers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", default=None, help="checkpoint directory or hub id (default: GPT-2 small config, "
                   "random weights)")
    s.add_argument("-n", "--num-requests", type=int, default=512)
    s.add_argument("--prompt-len", type=parse_range, default=None, help="LO:HI, uniform (default 64:512 on a GPU, "
                   "16:64 on the CPU)")
    s.add_argument("--output-len", type=parse_range, default=None, help="LO:HI, uniform (default 64:512 on a GPU, "
                   "16:64 on the CPU)")
    s.add_argument("--jsonl", default=None, help="workload file instead of the drawn lengths")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--rate", type=float, default=math.inf, help="Poisson arrivals, requests/s (default inf: "
                   "all at once)")
    s.add_argument("--modes", default=None,
                   help=f"comma-separated, from {','.join(MODES)} (default triton-graphs on a GPU, torch on the "
                        "CPU: the triton modes run the kernels through the Triton interpreter there)")
    s.add_argument("--dtype", type=parse_dtype, default=None, help="default bf16 on a GPU, fp32 on the CPU")
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-batch-tokens", type=int, default=8192)
    s.add_argument("--kv-memory-fraction", type=float, default=0.4)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--batch-sweep", default="8", help="also run the first requests at these max batch sizes "
                   "(comma-separated; '' for none), for the factor over naive")
    s.add_argument("--sweep-modes", default="triton-graphs,triton-int8,triton-int4",
                   help="the modes that run the batch sweep (comma-separated)")
    s.add_argument("--sweep-requests", type=int, default=64)
    s.add_argument("--decode-tokens", type=int, default=None, help="batch-1 decode run length (0: skip; default "
                   "512 on a GPU, 32 on the CPU)")
    s.add_argument("--hf-batch-size", type=int, default=32)
    s.add_argument("--hf-requests", type=int, default=64, help="requests timed through transformers "
                   "(0: all; -1: skip the transformers baseline)")
    s.add_argument("--naive-requests", type=int, default=None, help="0: skip the naive baseline (default 2 on a "
                   "GPU, 1 on the CPU)")
    s.add_argument("--naive-tokens", type=int, default=None, help="default 64 on a GPU, 8 on the CPU")
    s.add_argument("--out", default=None, help="write the results as JSON here")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bars (they also stay off when stdout "
                   "is not a terminal)")
    w = s.add_argument_group("feature workloads (--workload; -n, --prompt-len and --output-len size them)")
    w.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="shared-prefix: a common --prefix-len prefix + --prompt-len suffixes, prefix cache on vs off; "
                   "mixed: -n decodes while --long-prompts prompts arrive, chunked (--chunk) vs not; speculative: "
                   "-n prompts alone, plain vs n-gram and a draft (--draft or --draft-layers)")
    w.add_argument("--prefix-len", type=int, default=192)
    w.add_argument("--long-prompt", type=int, default=2048, help="mixed: long prompt tokens (at most the context)")
    w.add_argument("--long-prompts", type=int, default=4)
    w.add_argument("--chunk", type=int, default=512, help="mixed: the chunked run's token budget per step")
    w.add_argument("--spec-k", type=int, default=4, help="speculative: draft tokens per step")
    w.add_argument("--draft", default=None, help="speculative: draft checkpoint sharing the tokenizer")
    w.add_argument("--draft-layers", type=int, default=None, help="speculative: draft from the target's first N layers")
    h = s.add_argument_group("over HTTP (--url: any OpenAI-compatible server; see model/http_bench.py)")
    h.add_argument("--url", default=None, help="drive the server at this URL (e.g. http://127.0.0.1:8000) "
                   "instead of an engine in this process")
    h.add_argument("--max-concurrency", type=int, default=256, help="requests in flight at most (default 256)")
    h.add_argument("--served-model", default=None, help="the model name to send (default: the first of "
                   "/v1/models)")
    h.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    h.add_argument("--vocab-size", type=int, default=None, help="for drawn prompts (default: the server's "
                   "vocab_size in /v1/models, else 50257)")
    h.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default 600)")
    h.add_argument("--client-procs", type=int, default=None, help="client processes (default: one per 32 "
                   "streams, up to half the cores)")
    s.set_defaults(func=run)


def _print(*a):
    print(*a, flush=True)


def fill_defaults(args, gpu: bool) -> None:
    """Each option left unset takes the GPU's or the CPU's default (GPU_DEFAULTS, CPU_DEFAULTS)."""
    for k, v in (GPU_DEFAULTS if gpu else CPU_DEFAULTS).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def run(args) -> int:
    if getattr(args, "url", None):
        from tritune.model.bench.http import run_url

        fill_defaults(args, gpu=True)   # the workload a server is benchmarked with, wherever this client runs
        return run_url(args)
    if getattr(args, "workload", "random") != "random":
        return run_workload(args)
    import torch

    from tritune.model.engine.engine import Engine

    fill_defaults(args, torch.cuda.is_available())
    show = not getattr(args, "quiet", False)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"tritune serve-bench: unknown mode(s) {bad}; expected from {list(MODES)}", file=sys.stderr)
        return 2
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = args.dtype or (torch.bfloat16 if gpu else torch.float32)
    need_hf = args.hf_requests >= 0 or args.naive_requests > 0
    try:
        config, state, hf = load_models(args.model, dtype, device, need_hf)
        items = make_workload(args.num_requests, args.prompt_len, args.output_len, config.vocab_size, args.seed,
                              args.rate, args.jsonl)
    except (OSError, ValueError) as e:
        print(f"tritune serve-bench: {e}", file=sys.stderr)
        return 2
    too_long = [i for i, it in enumerate(items) if len(it.prompt_ids) + it.output_len > config.n_positions]
    if too_long:
        print(f"tritune serve-bench: {len(too_long)} request(s) exceed the context ({config.n_positions}), "
              f"e.g. #{too_long[0]}", file=sys.stderr)
        return 2
    from tritune.kernels.runtime import device as hdev

    res = {"gpu": hdev.gpu_name() if gpu else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "model": args.model or "GPT-2 small config, random weights",
           "workload": {"requests": len(items), "prompt_len": list(args.prompt_len),
                        "output_len": list(args.output_len), "jsonl": args.jsonl, "seed": args.seed,
                        "rate": None if math.isinf(args.rate) else args.rate,
                        "prompt_tokens": sum(len(it.prompt_ids) for it in items),
                        "output_tokens": sum(it.output_len for it in items)},
           "torch": torch.__version__, "command": "tritune serve-bench " + " ".join(sys.argv[2:]), "modes": {}}
    _print(f"workload: {len(items)} requests, {res['workload']['prompt_tokens']} prompt + "
           f"{res['workload']['output_tokens']} output tokens; {res['dtype']} on {res['gpu']}")

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(res, indent=2))

    if need_hf and hf is not None:
        if args.naive_requests > 0:
            _print(f"naive baseline: {args.naive_requests} request(s), the first {args.naive_tokens} tokens each")
            res["naive"] = run_naive(hf, items, args.naive_requests, args.naive_tokens, show_progress=show)
            _print(f"naive (no KV cache, one request): {res['naive']['output_tok_s']:.1f} tok/s")
        if args.hf_requests >= 0:
            _print(f"transformers baseline: static batches of {args.hf_batch_size}")
            hf(torch.tensor([[1, 2, 3]], device=device))     # warm-up
            res["transformers"] = run_hf(hf, items, args.hf_batch_size, args.hf_requests, show_progress=show)
            h = res["transformers"]
            _print(f"transformers generate (static batch {h['batch_size']}, {h['requests_timed']} requests): "
                   f"{h['output_tok_s']:.1f} output tok/s")
        del hf
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        save()

    for mode in modes:
        opts = dict(MODES[mode])
        backend = opts.pop("backend")
        r = {}
        try:
            _print(f"[{mode}] building the engine and warming up (compiles every kernel variant on the triton "
                   "backend; CUDA graphs captured)" if backend == "triton" else f"[{mode}] building the engine")
            model = build_model(config, state, backend, dtype, device)
            t0 = time.perf_counter()
            kv = {"kv_memory_fraction": args.kv_memory_fraction} if gpu else {}
            eng = Engine(model, block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                         max_num_seqs=args.max_num_seqs, **kv, **opts)
            # (on the CPU the workload's longest prompt: nothing compiles there, and long prompts take seconds)
            warm_up(eng, config.vocab_size, config.n_positions // 2 if gpu else max(len(it.prompt_ids) for it in items))
            r["setup_s"] = time.perf_counter() - t0
            r["engine"] = eng.describe()
            if args.decode_tokens:
                with CompileLog() as log:
                    r["batch1_decode"] = decode_rate(eng, 64, args.decode_tokens, config.vocab_size,
                                                     desc=f"[{mode}] batch-1 decode", show_progress=show)
                r["batch1_decode"]["jit_compiles"] = log.summary()
                _print(f"[{mode}] batch-1 decode: {r['batch1_decode']['decode_tok_s']:.0f} tok/s "
                       f"(GPU {r['batch1_decode'].get('gpu_ms_per_token', float('nan')):.3f} ms/token; host us/token "
                       f"{ {k: round(v, 1) for k, v in r['batch1_decode']['host_us_per_token'].items()} })")
            r["run"] = run_engine(eng, items, desc=f"[{mode}] run", show_progress=show)
            m = r["run"]
            _print(f"[{mode}] {m['output_tok_s']:.0f} output tok/s, {m['total_tok_s']:.0f} total tok/s, "
                   f"{m['req_s']:.2f} req/s, TTFT p50 {m['ttft_ms']['p50']:.0f} ms, TPOT p50 "
                   f"{m['tpot_ms']['p50']:.2f} ms, peak KV blocks {m['peak_kv_blocks']}/{m['kv_blocks']}, "
                   f"{m['steps']} steps, {m['preemptions']} preemptions")
            sweep = {}
            for b in [int(x) for x in args.batch_sweep.split(",") if x and mode in args.sweep_modes.split(",")]:
                eng.scheduler.max_num_seqs = b
                sub = items[:max(args.sweep_requests, 0) or len(items)]
                sweep[b] = run_engine(eng, sub, desc=f"[{mode}] max batch {b}", show_progress=show)
                _print(f"[{mode}] max batch {b} ({len(sub)} requests): {sweep[b]['output_tok_s']:.0f} output tok/s")
            eng.scheduler.max_num_seqs = args.max_num_seqs
            if sweep:
                r["batch_sweep"] = sweep
            del eng, model
        except Exception as e:  # noqa: BLE001 (one mode failing must not lose the others' numbers)
            import traceback

            traceback.print_exc()
            r["error"] = f"{type(e).__name__}: {e}"
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
        res["modes"][mode] = r
        save()

    # factors
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
            _print(f"[{mode}] " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in f.items()))
    res["progression"] = progression(res)
    _print(progression_table(res))
    save()
    if args.out:
        _print(f"wrote {args.out}")
    return 1 if any("error" in r for r in res["modes"].values()) else 0
