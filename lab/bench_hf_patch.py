"""GPU driver: Hugging Face GPT-2 (small config, random init, bf16) with and without tritune.patch.

    python lab/bench_hf_patch.py RESULTS_DIR [--new 128] [--prompt 64] [--reps 3]

1. generate, static cache, batch 1 and 32: HF, HF + torch.compile, patched, patched + torch.compile
   (compile = the forward under torch.compile(mode="reduce-overhead", fullgraph=True), HF's own recipe for
   a static cache). tok/s = batch x new tokens / wall time of one generate (median of --reps, after a
   warm-up generate that compiles).
2. prefill of 8 x 1024 tokens (one forward, no cache): patched (eager and compiled), HF eager attention,
   HF sdpa eager, HF sdpa under torch.compile. Median ms over CUDA-event-timed reps.

Every measurement is in its own try/except: a failure is recorded (error and the traceback's last lines)
and the rest still run. Writes RESULTS_DIR/hf_patch_<date>_<commit>.json and prints a table.
Target: patched + compile >= 1.3x HF + compile at batch 32.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        return "unknown"


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:2000],
            "traceback": "".join(traceback.format_exception(e)[-6:])[-4000:]}


def _model(attn="sdpa"):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config()
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to("cuda", torch.bfloat16).eval()
    m.generation_config.pad_token_id = 0
    m.generation_config.disable_compile = True  # no automatic compile: the compiled variants compile explicitly
    return m


def _variant(base, patched: bool, compiled: bool):
    from tritune.model import hf_patch

    m = copy.deepcopy(base)
    if patched:
        hf_patch.patch(m)
    if compiled:
        m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    return m


@torch.no_grad()
def bench_generate(model, batch: int, prompt: int, new: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, 50257, (batch, prompt), generator=g).to("cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
    model.generate(ids, **kw)  # warm-up: compiles, captures graphs, fills the tuned-config caches
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    made = out.shape[1] - prompt
    s = statistics.median(times)
    return {"batch": batch, "prompt": prompt, "new_tokens": made, "s": s, "tok_s": batch * made / s,
            "runs_s": times}


@torch.no_grad()
def bench_prefill(fn, ids, reps: int) -> dict:
    for _ in range(3):
        fn(ids)
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(ids)
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return {"ms": statistics.median(ms), "runs_ms": ms, "tok_s": ids.numel() / statistics.median(ms) * 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", type=int, nargs=2, default=[8, 1024], metavar=("B", "T"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hf_patch: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    import transformers
    import triton

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    res = {"date": datetime.date.today().isoformat(), "commit": _commit(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
           "model": "GPT-2 small config, random init, bf16", "args": vars(args), "generate": {}, "prefill": {},
           "checks": {}}
    base = _model()

    # 0. the patched model's logits against HF's (bf16 both, float64 HF as the reference)
    try:
        from tritune.harness import compare as cmp

        ids = torch.randint(1, 50257, (2, 128), generator=torch.Generator().manual_seed(3)).to("cuda")
        with torch.no_grad():
            ref = copy.deepcopy(base).double()(ids).logits
            got = _variant(base, True, False)(ids).logits
            hf = base(ids).logits
        res["checks"] = {"patched_rel_err": cmp.rel_error(got, ref), "hf_bf16_rel_err": cmp.rel_error(hf, ref),
                         "tol_bf16": cmp.tolerance(torch.bfloat16)}
        del ref
    except Exception as e:
        res["checks"] = _error(e)

    # 1. generate tok/s
    for name, patched, compiled in (("hf", False, False), ("hf+compile", False, True),
                                    ("tritune", True, False), ("tritune+compile", True, True)):
        for b in args.batches:
            key = f"{name} b={b}"
            try:
                torch._dynamo.reset()
                m = _variant(base, patched, compiled)
                res["generate"][key] = bench_generate(m, b, args.prompt, args.new, args.reps)
            except Exception as e:
                res["generate"][key] = _error(e)
            finally:
                m = None
                torch.cuda.empty_cache()
            print(key, {k: v for k, v in res["generate"][key].items() if k in ("tok_s", "error")}, flush=True)

    # 2. prefill B x T, one forward without a cache
    B, T = args.prefill
    ids = torch.randint(1, 50257, (B, T), generator=torch.Generator().manual_seed(4)).to("cuda")
    def fwd(m):
        return lambda x: m(x, use_cache=False).logits

    prefill = (("tritune", lambda: fwd(_variant(base, True, False))),
               ("tritune+compile", lambda: torch.compile(fwd(_variant(base, True, False)), fullgraph=True)),
               ("hf eager-attention", lambda: fwd(_model("eager"))),
               ("hf sdpa", lambda: fwd(base)),
               ("hf sdpa+compile", lambda: torch.compile(fwd(base), fullgraph=True)))
    for name, make in prefill:
        try:
            torch._dynamo.reset()
            res["prefill"][name] = bench_prefill(make(), ids, max(args.reps, 10))
        except Exception as e:
            res["prefill"][name] = _error(e)
        torch.cuda.empty_cache()
        print("prefill", name, {k: v for k, v in res["prefill"][name].items() if k in ("ms", "error")}, flush=True)

    # ratios (the targets)
    g = res["generate"]
    ratios = {}
    for b in args.batches:
        for a, c in (("tritune+compile", "hf+compile"), ("tritune", "hf")):
            x, y = g.get(f"{a} b={b}", {}), g.get(f"{c} b={b}", {})
            if "tok_s" in x and "tok_s" in y:
                ratios[f"{a} / {c} b={b}"] = x["tok_s"] / y["tok_s"]
    p = res["prefill"]
    for a in ("tritune", "tritune+compile"):
        for c in ("hf eager-attention", "hf sdpa", "hf sdpa+compile"):
            if "ms" in p.get(a, {}) and "ms" in p.get(c, {}):
                ratios[f"prefill {a} vs {c} (speedup)"] = p[c]["ms"] / p[a]["ms"]
    res["ratios"] = ratios
    x = ratios.get("tritune+compile / hf+compile b=32")
    res["target_batch32_1.3x"] = None if x is None else x >= 1.3

    path = os.path.join(args.out_dir, f"hf_patch_{res['date']}_{res['commit']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("\ngenerate (static cache)      tok/s")
    for k, v in g.items():
        print(f"  {k:28s} {v.get('tok_s', float('nan')):10.1f}  {v.get('error', '')[:100]}")
    print(f"prefill {B} x {T}             ms")
    for k, v in p.items():
        print(f"  {k:28s} {v.get('ms', float('nan')):10.3f}  {v.get('error', '')[:100]}")
    for k, v in ratios.items():
        print(f"  {k:45s} {v:6.2f}x")
    print("checks", res["checks"] if "error" not in res["checks"] else res["checks"]["error"])
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
