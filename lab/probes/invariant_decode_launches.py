"""Does one batch-1 decode step of the batch-invariant mode launch as many kernels as the default mode's,
and what does a step take in a CUDA graph in each mode? (Issue #30: the mode's batch-1 cost came from
24 LayerNorm and 12 write_kv launches more a step on GPT-2 small; gemm's ln=/kv= fusions remove them.)

For each mode, GPT2.decode at batch 1 (the step the engine captures, context 64 of the packaged model):
CUDA kernels of one eager step counted by name with torch.profiler, then the step captured in a CUDA graph
(kernels warmed first under pdl_forced, as the runner does) and replayed: median microseconds a step.

    python lab/probes/invariant_decode_launches.py --out DIR [--model DIR] [--dtype bf16] [--reps 300]

Writes DIR/invariant_decode_launches.json (commit, date, device, each mode's kernels and step time) and
prints one line a mode. About 1 minute on an H100 (compiles included).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import labgit  # noqa: E402  (lab/: the commit a run measured)


def step_inputs(model, ctx: int):
    import torch

    dev = model.device
    cache = model.new_cache(ctx + 16, block_size=16)
    with torch.inference_mode():
        model.prefill(torch.arange(ctx, device=dev) % 100, [ctx], kv_cache=cache,
                      slot_mapping=torch.arange(ctx, device=dev))
    ids, pos, slots = (torch.tensor([v], device=dev) for v in (7, ctx, ctx))
    tables = torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None]
    lens = torch.tensor([ctx + 1], dtype=torch.int32, device=dev)
    return lambda: model.decode(ids, pos, cache, slots, tables, lens)


def kernels_of(step) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"total": len(names), "by_name": dict(collections.Counter(names).most_common())}


def graph_us(step, reps: int) -> float:
    import torch

    from tritune import kernels as K

    with torch.inference_mode():
        with K.pdl_forced():            # compile and load the capture's kernel variants outside the capture
            for _ in range(3):
                step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("invariant_decode_launches: needs a CUDA GPU", file=sys.stderr)
        return 2
    from tritune.model import invariant
    from tritune.model.cli import default_model_dir
    from tritune.model.gpt2 import GPT2

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    base = GPT2.from_pretrained(args.model or default_model_dir(), backend="triton", dtype=dtype)
    res = {"commit": labgit.commit() or "?", "date": datetime.date.today().isoformat(),
           "device": torch.cuda.get_device_name(), "dtype": args.dtype, "ctx": args.ctx, "modes": {}}
    for name, model in (("default", base), ("invariant", invariant.invariant_model(base))):
        step = step_inputs(model, args.ctx)
        r = res["modes"][name] = kernels_of(step)
        r["graph_step_us"] = graph_us(step, args.reps)
        print(f"{name}: {r['total']} kernels a step, {r['graph_step_us']:.1f} us a step in a graph; "
              f"layer_norm/write_kv launches: "
              f"{sum(v for k, v in r['by_name'].items() if 'layer_norm' in k or 'write_kv' in k)}", flush=True)
    d, i = res["modes"]["default"], res["modes"]["invariant"]
    res["extra_kernels"] = i["total"] - d["total"]
    res["step_cost"] = 1 - d["graph_step_us"] / i["graph_step_us"]
    print(f"invariant - default: {res['extra_kernels']} kernels a step; tok/s cost {100 * res['step_cost']:.1f}%")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "invariant_decode_launches.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
