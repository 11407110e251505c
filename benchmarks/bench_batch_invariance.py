"""What the batch-invariant mode costs (Engine(batch_invariant=True), tritune.model.engine.invariant), on the GPU:
output tok/s of a serve-bench-like run in process (N requests at once, prompt and output lengths drawn
uniformly, the packaged model, CUDA graphs) and batch-1 decode tok/s, mode off and on; and whether the
mode holds on that run (the first K requests each run alone too, tokens compared). Target: <= 15% cost.

    python benchmarks/bench_batch_invariance.py [--results DIR] [--model DIR] [--dtype bf16] [-n 256]
                                                [--budget-s 180] [--pins split,nosplit] [--rounds 5]

Every mode's engines are built first; then ``--rounds`` interleaved rounds (the order alternating), each
the serve-like run and a batch-1 decode per mode; medians of the rounds are compared.

``--pins``: the mode with its gemm pins as committed ("split": split-K fixed per (N, K) for one row,
``invariant.gemm_config``), and with every pin at SPLIT_K=1 ("nosplit", the earlier pins), so one run
says what the split buys at batch 1 and costs in serving.

Appends one keyed row per mode (benchmarks/rows.py: commit, date, GPU, versions; each measurement or its
error) to results/<gpu-slug>/batch_invariance.json, the costs and the alone check as its top-level fields.
Bounded: every
phase checks the time budget and the run stops early (saying so) once it is spent.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
import traceback

from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)


def workload(n, vocab, ctx, seed):
    """serve-bench's default shape scaled to the context: prompts and outputs of ctx/16 .. ctx/2 tokens."""
    from tritune.model.engine.scheduler import SamplingParams

    prompt = output = (max(1, ctx // 16), ctx // 2 - 1)
    rng = random.Random(seed)
    return [([rng.randrange(vocab - 1) for _ in range(rng.randint(*prompt))],
             SamplingParams(max_new_tokens=rng.randint(*output), ignore_eos=True)) for _ in range(n)]


def engine(model, inv, max_num_seqs=256, **kw):
    from tritune.model.engine.engine import Engine

    kw.setdefault("kv_memory_fraction", 0.4)
    eng = Engine(model, max_num_seqs=max_num_seqs, max_batch_tokens=8192, batch_invariant=inv, **kw)
    t0 = time.perf_counter()
    eng.warm_up()
    return eng, time.perf_counter() - t0


def throughput(eng, reqs):
    import torch

    hs = [eng.add_request(p, sp) for p, sp in reqs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.run()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = sum(len(h.output_ids) for h in hs)
    return {"requests": len(hs), "output_tokens": out, "seconds": dt, "output_tok_s": out / dt,
            "preemptions": eng.stats["preemptions"], "graph_steps": eng.stats["graph_steps"]}, [h.output_ids for h in hs]


def batch1_engine(model, inv):
    from tritune.model.engine.engine import Engine

    return Engine(model, num_blocks=-(-model.config.n_positions // 16), max_num_seqs=1, batch_invariant=inv)


def batch1_run(eng, model, new=400) -> float:
    """One batch-1 decode of ``new`` tokens after a 16-token prompt's prefill: decode tok/s."""
    import torch

    from tritune.model.engine.scheduler import SamplingParams

    prompt = [(7 * i) % (model.config.vocab_size - 1) for i in range(16)]
    new = min(new, model.config.n_positions - 32)
    h = eng.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    eng.step()                       # the prefill
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.run()
    torch.cuda.synchronize()
    return (len(h.output_ids) - 1) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="results root (default: results)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("-n", "--num-requests", type=int, default=256)
    ap.add_argument("--check", type=int, default=8, help="requests also run alone in the mode (tokens compared)")
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every mode (medians reported)")
    ap.add_argument("--pins", default="split,nosplit", help="invariant-mode gemm pins to measure (split, nosplit)")
    args = ap.parse_args(argv)
    pins = [p for p in args.pins.split(",") if p]
    if not set(pins) <= {"split", "nosplit"}:
        ap.error(f"--pins: expected split and/or nosplit, got {args.pins!r}")

    import torch

    from tritune.model.load import default_model_dir
    from tritune.model.gpt2.model import GPT2

    if not torch.cuda.is_available():
        print("bench_batch_invariance: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = GPT2.from_pretrained(args.model or default_model_dir(), backend="triton", dtype=dtype)
    res = {"dtype": args.dtype, "num_requests": args.num_requests, "results": {}}
    reqs = workload(args.num_requests, model.config.vocab_size, model.config.n_positions, seed=0)

    def left():
        return args.budget_s - (time.perf_counter() - t_start)

    from tritune.model.engine import invariant

    pinned = invariant.gemm_config

    @functools.lru_cache(maxsize=None)
    def nosplit(*a):
        return dict(pinned(*a), SPLIT_K=1)

    # Every mode's engines built first, then the measurements in interleaved rounds (the order alternating):
    # a GPU's or host's drift between two modes' turns lands on both, and each number is a median of rounds.
    keys = ["default"] + ["invariant" if p == "split" else f"invariant_{p}" for p in pins]
    toks, engs = {}, {}
    for key in keys:
        r = res["results"].setdefault(key, {})
        invariant.gemm_config = nosplit if key == "invariant_nosplit" else pinned
        try:
            eng, warm = engine(model, key != "default", kv_memory_fraction=0.7 / len(keys))
            r["warm_up_s"] = warm
            b1 = batch1_engine(model, key != "default")
            batch1_run(b1, model)                           # warm-up
            engs[key] = (eng, b1)
        except Exception as e:  # recorded, the other modes still run
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc()[-3000:]
        finally:
            invariant.gemm_config = pinned
    serve: dict = {k: [] for k in engs}
    b1s: dict = {k: [] for k in engs}
    for rnd in range(args.rounds):
        if left() < 20:
            res["note"] = f"stopped after {rnd} round(s): time budget"
            break
        for key in (list(engs) if rnd % 2 == 0 else list(engs)[::-1]):
            eng, b1 = engs[key]
            invariant.gemm_config = nosplit if key == "invariant_nosplit" else pinned
            try:
                row, toks[key] = throughput(eng, reqs)
                serve[key].append(row)
                b1s[key].append(batch1_run(b1, model))
            except Exception as e:  # recorded, the other modes still run
                res["results"][key]["error"] = f"{type(e).__name__}: {e}"
                res["results"][key]["traceback"] = traceback.format_exc()[-3000:]
            finally:
                invariant.gemm_config = pinned
    for key in engs:
        r = res["results"][key]
        if serve[key]:
            rows = sorted(serve[key], key=lambda x: x["output_tok_s"])
            r["serve"] = dict(rows[len(rows) // 2], output_tok_s_runs=[x["output_tok_s"] for x in serve[key]])
        if b1s[key]:
            r["batch1"] = {"decode_tok_s_runs": b1s[key], "decode_tok_s": sorted(b1s[key])[len(b1s[key]) // 2]}
    del engs
    torch.cuda.empty_cache()
    d = res["results"].get("default", {})
    for key, i in res["results"].items():
        sfx = key[len("invariant"):]
        if key == "default":
            continue
        if "serve" in d and "serve" in i:
            res["serve_cost" + sfx] = 1 - i["serve"]["output_tok_s"] / d["serve"]["output_tok_s"]
        if "batch1" in d and "batch1" in i:
            res["batch1_cost" + sfx] = 1 - i["batch1"]["decode_tok_s"] / d["batch1"]["decode_tok_s"]
    if "invariant" in toks and left() > 30:     # the mode holds on this run: the first requests alone
        eng = engine(model, True, max_num_seqs=1, kv_memory_fraction=None,
                     num_blocks=-(-model.config.n_positions // 16))[0]
        same = []
        for k, (p, sp) in enumerate(reqs[:args.check]):
            if left() < 10:
                break
            h = eng.add_request(p, sp)
            eng.run()
            same.append(h.output_ids == toks["invariant"][k])
        res["alone_equal"] = {"checked": len(same), "equal": sum(same)}
        if "default" in toks:
            res["default_vs_invariant_tokens_equal"] = sum(a == b for a, b in zip(toks["default"], toks["invariant"]))
    res["wall_s"] = time.perf_counter() - t_start
    path = write_rows("batch_invariance", [{"mode": k, **r} for k, r in res["results"].items()], args.results,
                      **{k: v for k, v in res.items() if k != "results"}, command=" ".join(sys.argv))
    print(f"wrote {path}")
    print(json.dumps({k: v for k, v in res.items() if k != "results"}, indent=2))
    for k, r in res["results"].items():
        print(k, {n: (v.get("output_tok_s") or v.get("decode_tok_s")) if isinstance(v, dict) else v
                  for n, v in r.items() if n in ("serve", "batch1", "error", "skipped")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
