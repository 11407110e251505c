"""serve-bench's feature workloads (``--workload``): prefix caching (a shared prefix, cache on vs off),
chunked prefill (decodes while long prompts arrive, chunked vs not) and speculative decoding (batch 1,
plain vs n-gram and a draft), each against its own baseline on one model and mode."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tritune.model.bench.runs import MODES, build_model, fill_defaults, load_models, run_engine, say, sync
from tritune.model.bench.workload import Item, percentiles
from tritune.model.serve.warmup import warm_up

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


def itl_run(eng, n_decodes, decode_prompt, long_prompt, n_long, output_len, vocab, every, seed=0):
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
    sync()
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
        itl_run(eng, n_decodes, decode_prompt, long_prompt, 1, 4 * every + 8, vocab, every, seed=1)
        res[name] = itl_run(eng, n_decodes, decode_prompt, long_prompt, n_long, output_len, vocab, every)
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
    from tritune.kernels.runtime import device as hdev

    res = {"gpu": hdev.gpu_name() if gpu else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "model": args.model or "GPT-2 small config, random weights", "mode": mode_name,
           "workload": args.workload, "torch": torch.__version__,
           "command": "tritune serve-bench " + " ".join(sys.argv[2:])}
    make_engine = _engine_maker(args, model, mode, gpu)
    if args.workload == "shared-prefix":
        _shared_prefix_workload(args, make_engine, config, res)
    elif args.workload == "mixed":
        _mixed_workload(args, make_engine, config, res)
    else:
        _speculative_workload(args, make_engine, model, draft, config, res)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


def _engine_maker(args, model, mode: dict, gpu: bool):
    """``make_engine(**overrides)``: an engine on ``model`` with the run's settings, warmed up."""
    from tritune.model.engine.engine import Engine

    V, ctx = model.config.vocab_size, model.config.n_positions

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

    return make_engine


def _shared_prefix_workload(args, make_engine, config, res: dict) -> None:
    out_len = args.output_len[0]
    items = shared_prefix_items(args.num_requests, args.prefix_len, args.prompt_len, out_len, config.vocab_size,
                                args.seed)
    res["shape"] = {"requests": len(items), "prefix_len": args.prefix_len, "suffix_len": list(args.prompt_len),
                    "output_len": out_len}
    res["results"] = r = run_shared_prefix(make_engine, items, show_progress=not args.quiet)
    say(f"shared prefix: {r['prefill_token_reduction']:.0%} fewer prefill tokens, output tok/s "
        f"{r['cache_off']['output_tok_s']:.0f} -> {r['cache_on']['output_tok_s']:.0f} "
        f"({r['output_tok_s_speedup']:.2f}x)")


def _mixed_workload(args, make_engine, config, res: dict) -> None:
    ctx = config.n_positions
    long_prompt = min(args.long_prompt, ctx - 4)
    out_len = min(args.output_len[0], ctx - 64)
    res["shape"] = {"decodes": args.num_requests, "decode_prompt": 64, "long_prompt": long_prompt,
                    "long_prompts": args.long_prompts, "output_len": out_len, "chunk": args.chunk}
    res["results"] = run_mixed(make_engine, n_decodes=args.num_requests, decode_prompt=64,
                               long_prompt=long_prompt, n_long=args.long_prompts, output_len=out_len,
                               vocab=config.vocab_size, chunk=args.chunk, every=8)
    for k, r in res["results"].items():
        say(f"mixed {k}: decode-only ITL P50 {r['itl_decode_only_ms']['p50']} ms, with long prompts P99 "
            f"{r['itl_with_long_prompts_ms']['p99']} ms ({r['p99_over_decode_p50']})")


def _speculative_workload(args, make_engine, model, draft, config, res: dict) -> None:
    import numpy as np

    from tritune.model.engine import spec_decode as SD

    V, ctx = config.vocab_size, config.n_positions
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
        say(f"speculative {name}: {r['decode_tok_s']:.0f} tok/s"
            + (f", acceptance {r['acceptance_rate']:.0%}, {r['speedup']:.2f}x plain, outputs equal plain: "
               f"{r['outputs_equal_plain']}" if name != "plain" else ""))
