"""Paged-attention sweep on the GPU (issue 6): configs per standard problem, timed like the harness
(do_bench, L2 flushed, rotating input sets) and GPU-only (do_bench_cudagraph over the same rotation),
plus a host-overhead probe. The run that used it (two device calls) ran, in one call:
  compile workers x8 beside `pytest tests/test_paged_attention.py -n 6`, then `time`, then `host`;
warm workers x4 fill inductor's cache before `tritune bench paged_attention` (flex compiles per shape).
Modes:
  compile --worker i --workers n   compile the sweep's kernels (small-batch inputs, same specialisation)
  warm --worker i --workers n      run the bench on a share of the standard problems (flex compile cache)
  time --out F                     time every config (jsonl, one line per config), then GPU-only for the best
  host --out F                     launcher host cost per call, vs the bare Triton launch
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import os

import torch

from tritune.harness import bench as hb
from tritune.harness import compare as cmp
from tritune.kernels import paged_attention as pa

P = pa.Problem
BF16 = torch.bfloat16
G2 = dict(Hq=12, Hkv=12, D=64)
LL = dict(Hq=32, Hkv=8, D=128)


def grid(bn, w, st, parts):
    return [{"BLOCK_N": a, "PARTITION": p, "USE_DOT": True, "num_warps": b, "num_stages": c}
            for p in parts for a in bn for b in w for c in st]


SWEEP = [
    (P(64, ctx=1024, **G2), grid([32, 64, 128], [1, 2, 4, 8], [2, 3, 4], [0, 512])
     + grid([32, 64], [2, 4], [2, 3], [256])),
    (P(64, ctx=512, **G2), grid([32, 64], [2, 4], [2, 3], [0, 256])),
    (P(256, ctx=1024, **G2), grid([32, 64, 128], [2, 4, 8], [2, 3], [0]) + grid([64], [2, 4], [2, 3], [512])),
    (P(256, ctx=128, **G2), grid([32, 64], [2, 4], [2, 3], [0])),
    (P(8, ctx=1024, **G2), grid([32, 64], [2, 4], [3], [64, 128, 256])),
    (P(8, ctx=512, **G2), grid([32, 64], [2, 4], [3], [0, 64, 128])),
    (P(1, ctx=1024, **G2), grid([32, 64], [2, 4], [3], [64, 128, 256])),
    (P(1, ctx=128, **G2), grid([32, 64], [2, 4], [2], [0, 32, 64])),
    (P(1, ctx=4096, **LL), grid([32, 64], [2, 4], [2, 3, 4], [64, 128, 256, 512])),
    (P(1, ctx=32768, **LL), grid([32, 64], [2, 4], [2, 3], [256, 512, 1024, 2048])),
    (P(32, ctx=4096, **LL), grid([32, 64], [4, 8], [2, 3], [0, 1024, 2048])),
    (P(128, ctx=4096, **LL), grid([32, 64], [4, 8], [2, 3], [0])),
]


def _d(p):
    return dict(pa.default_config(p, BF16))


DEV = "cuda"
if os.environ.get("PA_SWEEP_SMOKE"):  # a CPU smoke test of this script (interpreter, float32)
    BF16, DEV = torch.float32, "cpu"
    SWEEP = [(P(2, ctx=40, **G2), [dict(c, USE_DOT=False, num_stages=1) for c in grid([16], [2], [1], [0, 16])])]


def stored_configs(problem):
    """Configs the committed stores (H100, H200) hold for this problem's bucket."""
    from pathlib import Path
    key = ",".join(f"{k}={v}" for k, v in pa.bucket(problem).items())
    out = []
    for f in sorted(Path("tuning/configs").glob("*/paged_attention.json")):
        for e in json.loads(f.read_text())["entries"]:
            if e["bucket"] == key and e["dtype"] == "bfloat16":
                out.append((f.parent.name, e["config"]))
    return out


def configs_for(problem):
    cfgs = [("default", pa.default_config(problem, BF16))]
    cfgs += [(f"stored:{g}", c) for g, c in stored_configs(problem)]
    for _, grid_cfgs in [s for s in SWEEP if s[0] == problem]:
        cfgs += [("sweep", c) for c in grid_cfgs]
    seen, out = set(), []
    for tag, c in cfgs:
        k = tuple(sorted(c.items()))
        if k in seen or pa.SPACE.why_invalid(c, problem, BF16):
            continue
        seen.add(k)
        out.append((tag, c))
    return out


def problems():
    return [s[0] for s in SWEEP]


def call(c, cfg):
    return functools.partial(pa.paged_attention, *c.args, out=c.out, config=cfg, **c.kwargs)


def do_compile(worker, workers):
    jobs = [(p, c) for p in problems() for _, c in configs_for(p)]
    mine = jobs[worker::workers]
    cases = {}
    t0 = time.time()
    for p, cfg in mine:
        small = P(min(p.B, 2), p.Hq, p.Hkv, p.D, p.ctx, p.block_size)
        if small not in cases:
            cases = {small: pa.make_inputs(small, BF16, DEV, 0)}
        try:
            call(cases[small], cfg)()
        except Exception as e:  # noqa: BLE001
            print("compile failed", p, cfg, type(e).__name__, str(e)[:200], flush=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    print(f"worker {worker}: {len(mine)} kernels in {time.time() - t0:.0f}s", flush=True)


def do_warm(worker, workers):
    """Compile flex_attention (inductor's on-disk caches) and our default for a share of the bench."""
    ps = pa.SPEC.standard_problems[worker::workers]
    t0 = time.time()
    for p in ps:
        cases = hb.rotation(pa.SPEC, p, BF16, DEV, 0)
        call(cases[0], None)()
        for c in cases:
            try:
                pa._flex(c)()
            except Exception as e:  # noqa: BLE001
                print("flex", p, type(e).__name__, str(e)[:200], flush=True)
                break
        print(f"warm {worker}: {hb.problem_label(p)} at {time.time() - t0:.0f}s", flush=True)
        del cases


def gpu_only_ms(cases, cfg):
    """do_bench_cudagraph over one pass through the rotation, per call."""
    import triton.testing as tt
    fns = [call(c, cfg) for c in cases]

    def one_pass():
        for f in fns:
            f()
    return tt.do_bench_cudagraph(one_pass, rep=30, return_mode="median") / len(cases)


def do_time(out_path, budget_s):
    t_start = time.time()
    f = open(out_path, "a")
    for p in problems():
        if time.time() - t_start > budget_s:
            print("budget spent before", p, flush=True)
            break
        cases = hb.rotation(pa.SPEC, p, BF16, DEV, 0)
        c0 = cases[0]
        ref = pa.SPEC.reference(*c0.args, **c0.kwargs)
        cost = pa.cost(p, BF16)
        rows = []
        for tag, cfg in configs_for(p):
            row = {"problem": hb.problem_label(p), "tag": tag, "config": cfg, "sets": len(cases)}
            try:
                cmp.poison(c0.out)
                got = call(c0, cfg)()
                comp = cmp.compare(got, ref, BF16, pa.SPEC.accumulation(BF16))
                row["ok"], row["err"] = comp.ok, comp.error
                ms = hb.median_ms(hb.cycling(cases, lambda c: call(c, cfg)), warmup=10, rep=40)
                row["us"] = ms * 1e3
                row["pct_bw"] = hb.roofline(cost, BF16, ms).get("pct_copy_bw")
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
        timed = sorted([r for r in rows if "us" in r and r["ok"]], key=lambda r: r["us"])
        pick = timed[:3] + [r for r in rows if r["tag"] != "sweep" and r not in timed[:3] and "us" in r]
        for r in pick:
            try:
                g = gpu_only_ms(cases, r["config"]) * 1e3
                rec = {"problem": r["problem"], "tag": r["tag"] + ":graph", "config": r["config"], "us": g,
                       "pct_bw": 100.0 * cost.bytes / (g * 1e-6) / hb.dev.ceilings()["copy_bytes_per_s"]}
            except Exception as e:  # noqa: BLE001
                rec = {"problem": r["problem"], "tag": r["tag"] + ":graph", "error": str(e)[:200]}
            f.write(json.dumps(rec) + "\n")
            f.flush()
        try:
            vms = hb.median_ms(hb.cycling(cases, pa.SPEC.vendor), warmup=10, rep=40)
            f.write(json.dumps({"problem": hb.problem_label(p), "tag": "sdpa", "us": vms * 1e3}) + "\n")
        except Exception as e:  # noqa: BLE001
            print("sdpa", p, e, flush=True)
        best = timed[0] if timed else None
        print(f"{hb.problem_label(p)}: {len(rows)} configs, best {best and round(best['us'], 1)}us "
              f"{best and best['config']} ({time.time() - t_start:.0f}s)", flush=True)
        del cases, c0, ref
        torch.cuda.empty_cache()


def do_host(out_path):
    """Host microseconds per call, the GPU far ahead: wall time of N calls / N (the kernels are shorter
    than the host work, so the stream never holds the host back)."""
    res = {}
    for p, cfg in [(P(1, ctx=128, **G2), None), (P(1, ctx=4096, **LL), None)]:
        c = pa.make_inputs(p, BF16, "cuda", 0)
        fn = call(c, cfg)
        fn()
        torch.cuda.synchronize()
        plan = next(v for v in pa._PLANS.values() if v.grid[0] == p.B and v.meta["D"] == p.D)
        q, kc, vc, bt, cl = c.args
        ws = pa._workspace(q.device, plan.ws_numel) if plan.ws_numel else c.out

        def bare():
            pa._paged_attention_fwd[plan.grid](q, kc, vc, bt, cl, c.out, ws, cl if plan.locks is None else plan.locks,
                                               *plan.args, **plan.meta)

        def noop():
            pass

        out = {}
        for name, f in [("launcher", fn), ("triton_launch", bare), ("python_loop", noop)]:
            for _ in range(200):
                f()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(1000):
                    f()
                ts.append((time.perf_counter() - t0) * 1e3)  # ms per 1000 = us per call
                torch.cuda.synchronize()
            out[name + "_us"] = sorted(ts)[2]
        out["config"] = plan.cfg
        res[hb.problem_label(p)] = out
        print(hb.problem_label(p), out, flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["compile", "warm", "time", "host", "count"])
    ap.add_argument("--worker", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="sweep.jsonl")
    ap.add_argument("--budget", type=float, default=1e9)
    a = ap.parse_args()
    if a.mode == "count":
        print({hb.problem_label(p): len(configs_for(p)) for p in problems()},
              sum(len(configs_for(p)) for p in problems()))
        sys.exit(0)
    {"compile": lambda: do_compile(a.worker, a.workers), "warm": lambda: do_warm(a.worker, a.workers),
     "time": lambda: do_time(a.out, a.budget), "host": lambda: do_host(a.out)}[a.mode]()
