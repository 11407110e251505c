"""Probe of 2026-11-23 (GPU): GPT-2 c_attn at M = 64 (K=768, N=2304, bias), the last #4 row under cuBLAS.

Sections (--only, comma-separated):

  names  the kernels cuBLAS (torch.addmm) and gemm launch for the problem, with their mean GPU time
         (torch.profiler, no flush): what tile and split cuBLAS picks
  grid   gemm over a structured grid of configs the space did not hold or the tuner did not reach:
         BLOCK_M 16/32/64, BLOCK_N 16-128, split-K 1-6 (3 and 6 added), num_stages up to 6 (every K step
         in flight); programs between 60 and 300. Phase 1 times each in a CUDA graph (GPU time only);
         phase 2 times the 16 fastest three ways (zero-fill do_bench, clean do_bench, graph) between
         cuBLAS rows, then re-times the front runners with TMA and other warp counts.

  python lab/probes/gemm_c_attn_small_m.py --out $OUT/gemm_c_attn_small_m.json [--only names,grid] [--problem M=64,N=2304,K=768,bias=True]
"""
from __future__ import annotations

import argparse
import sys

import torch

from tritune import kernels
from tritune.harness import bench, compare
from tritune.kernels import gemm as G
from tritune.tuning.cli import parse_problems

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ceilings_int4_variants import config_label, run_sections, timed, variant  # noqa: E402

PROBLEM = ["M=64,N=2304,K=768,bias=True"]


def _setup():
    spec = kernels.get("gemm")
    problem = parse_problems(spec, PROBLEM[0])[0]
    cases = bench.rotation(spec, problem, torch.bfloat16, "cuda", 0)
    return spec, problem, cases


def names(rows):
    from torch.profiler import ProfilerActivity, profile

    spec, problem, cases = _setup()
    c = cases[0]
    paths = {"cuBLAS addmm": spec.vendor(c), "gemm store": lambda: spec.run(*c.args, out=c.out, **c.kwargs)}
    for who, fn in paths.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0):
                row = {"kernel": "gemm", "problem": PROBLEM[0], "who": who, "name": ev.key[:300],
                       "count": ev.count, "mean_us": ev.self_device_time_total / max(1, ev.count)}
                print(row, flush=True)
                rows.append(row)


def _widen():
    """num_stages 6 and split-K 3 and 6 in the space (this process only)."""
    p = G.SPACE.params
    p["num_stages"] = sorted(set(p["num_stages"]) | {6})
    p["SPLIT_K"] = sorted(set(p["SPLIT_K"]) | {3, 6})


def candidates(M, N, K):
    out = []
    for bm in (64, 32, 16) if M > 16 else (16,):
        for bn in (16, 32, 64, 128):
            for split in (1, 2, 3, 4, 6):
                progs = -(-M // bm) * -(-N // bn) * split
                if not 60 <= progs <= 300:
                    continue
                for bk in (64, 128, 256):
                    kt = -(-K // bk)
                    if kt % split or kt // split < 1:
                        continue
                    per = kt // split
                    stages = sorted({s for s in (2, 3, 4, min(per + 1, 6)) if 2 <= s <= 6 and s <= per + 1})
                    # small M (one 16-row tile): 2 and 4 warps, pointers and TMA descriptors
                    variants = [(w, t) for w in (2, 4) for t in (False, True)] if M <= 16 else [(4, False)]
                    for s in stages:
                        for warps, tma in variants:
                            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                                   "GROUP_M": 8 if split == 1 and bm < M else 1, "SPLIT_K": split, "num_warps": warps,
                                   "num_stages": s, "TMA": tma, "PERSISTENT": False}
                            if G.SPACE.constraint(cfg, parse_problems(kernels.get("gemm"), PROBLEM[0])[0],
                                                  torch.bfloat16):
                                continue
                            out.append(cfg)
    return out


def _compile(args):
    """Pool worker: launch each config once (Triton compiles it into the on-disk cache)."""
    text, cfgs = args
    PROBLEM[0] = text
    _widen()
    spec = kernels.get("gemm")
    problem = parse_problems(spec, text)[0]
    c = spec.make_inputs(problem, torch.bfloat16, "cuda", 0)
    for cfg in cfgs:
        try:
            G.gemm(*c.args, out=c.out, config=cfg, **c.kwargs)
        except Exception:
            pass
    torch.cuda.synchronize()
    return len(cfgs)


def precompile(cfgs, workers=8):
    import multiprocessing as mp

    chunks = [(PROBLEM[0], cfgs[i::workers]) for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile, chunks)


def grid(rows):
    _widen()
    spec, problem, cases = _setup()
    c0 = cases[0]
    want = spec.reference(*c0.args, **c0.kwargs)

    def call(cfg):
        return bench.cycling(cases, lambda c, cfg=cfg: lambda c=c: G.gemm(*c.args, out=c.out, config=cfg, **c.kwargs))

    cfgs = candidates(problem.M, problem.N, problem.K)
    store = spec.config_for(problem, torch.bfloat16)
    if store not in cfgs:
        cfgs.insert(0, store)
    print(f"{len(cfgs)} configs", flush=True)
    precompile(cfgs)
    g = []
    for cfg in cfgs:
        try:
            compare.poison(c0.out)
            err = compare.rel_error(G.gemm(*c0.args, out=c0.out, config=cfg, **c0.kwargs), want)
            ms = bench.graph_ms(call(cfg))
        except Exception as e:
            rows.append({"kernel": "gemm", "problem": PROBLEM[0], "who": config_label(cfg), "phase": 1,
                         "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        row = {"kernel": "gemm", "problem": PROBLEM[0], "who": config_label(cfg), "phase": 1,
               "rel_error": err, "graph_us": ms * 1e3}
        print(row, flush=True)
        rows.append(row)
        g.append((ms, cfg))
    g.sort(key=lambda t: t[0])
    vendor = bench.cycling(cases, spec.vendor)
    timed(rows, "gemm", PROBLEM[0], spec.vendor_name, vendor)
    timed(rows, "gemm", PROBLEM[0], "store " + config_label(store), call(store))
    top = [cfg for _, cfg in g[:16]]
    for i, cfg in enumerate(top):
        timed(rows, "gemm", PROBLEM[0], config_label(cfg), call(cfg))
        if i % 6 == 5:
            timed(rows, "gemm", PROBLEM[0], spec.vendor_name, vendor)
    # the front runners with TMA descriptors and other warp counts (small M: already in the grid)
    for cfg in top[:5] if problem.M > 16 else []:
        for change in ({"TMA": True}, {"num_warps": 2}, {"num_warps": 8}, {"TMA": True, "num_warps": 8}):
            v = dict(cfg, **change)
            if G.SPACE.constraint(v, problem, torch.bfloat16):
                continue
            variant(rows, "gemm", PROBLEM[0], config_label(v), call(v), c0.out, want)
    timed(rows, "gemm", PROBLEM[0], spec.vendor_name, vendor)


AB = [
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 6,
     "TMA": False, "PERSISTENT": False},
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4,
     "TMA": True, "PERSISTENT": False},
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 6,
     "TMA": True, "PERSISTENT": False},
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 1, "num_warps": 4, "num_stages": 6,
     "TMA": False, "PERSISTENT": False},
]
AB_ROUNDS = 9


def _rounds(rows, paths, vendor, section, rounds=None):
    """Interleaved rounds of do_bench (zero-fill flush) over ``paths``, then 3 rounds of graph timing:
    per path the median and each round's ratio to ``vendor``."""
    import statistics

    zero = {k: [] for k in paths}
    graph = {k: [] for k in paths}
    for _ in range(rounds or AB_ROUNDS):
        for k, fn in paths.items():
            zero[k].append(bench.median_ms(fn) * 1e3)
    for _ in range(3):
        for k, fn in paths.items():
            graph[k].append(bench.graph_ms(fn) * 1e3)
    for k in paths:
        row = {"kernel": "gemm", "problem": PROBLEM[0], "who": k, "section": section,
               "zero_us": statistics.median(zero[k]), "zero_rounds": zero[k],
               "graph_us": statistics.median(graph[k]), "graph_rounds": graph[k],
               "vs_vendor_zero": statistics.median(zero[vendor]) / statistics.median(zero[k]),
               "vs_vendor_paired": [zv / zk for zv, zk in zip(zero[vendor], zero[k])],
               "vs_vendor_graph": statistics.median(graph[vendor]) / statistics.median(graph[k])}
        print({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items() if "rounds" not in a
               and a != "vs_vendor_paired"}, flush=True)
        rows.append(row)


def ab(rows):
    """cuBLAS, the stored config and the AB configs, AB_ROUNDS interleaved rounds."""
    _widen()
    spec, problem, cases = _setup()
    store = spec.config_for(problem, torch.bfloat16)
    paths = {spec.vendor_name: bench.cycling(cases, spec.vendor),
             "store " + config_label(store): bench.cycling(cases, lambda c: lambda c=c: spec.run(
                 *c.args, out=c.out, **c.kwargs))}
    if problem.M > 16:
        for cfg in AB:
            if cfg != store and not G.SPACE.constraint(cfg, problem, torch.bfloat16):
                paths[config_label(cfg)] = bench.cycling(cases, lambda c, cfg=cfg: lambda c=c: G.gemm(
                    *c.args, out=c.out, config=cfg, **c.kwargs))
    _rounds(rows, paths, spec.vendor_name, "ab")


def stored_config(problem, dtype=torch.bfloat16):
    """The committed store's entry for the problem's bucket, stale or not (None if there is none)."""
    from tritune.kernels import bucket_key
    from tritune.tuning import store

    return store.entry_config("gemm", bucket_key(G.bucket(problem)), dtype)


def pre(rows):
    """The epilogue prefetch (PRE_EPI) on and off at the stored config (and the AB configs at M > 16),
    against cuBLAS, over PROBLEMS_PRE."""
    _widen()
    for text in PROBLEMS_PRE:
        PROBLEM[0] = text
        spec, problem, cases = _setup()
        cfgs = [stored_config(problem) or G.default_config(problem, torch.bfloat16)]
        if problem.M > 16:
            cfgs += [c for c in AB[:2] if c != cfgs[0] and not G.SPACE.constraint(c, problem, torch.bfloat16)]
        paths = {spec.vendor_name: bench.cycling(cases, spec.vendor)}
        for cfg in cfgs:
            for on in (True, False):
                def make(c, cfg=cfg, on=on):
                    def call():
                        G.PREFETCH_EPILOGUE = on
                        return G.gemm(*c.args, out=c.out, config=cfg, **c.kwargs)
                    return call
                paths[f"pre={on} " + config_label(cfg)] = bench.cycling(cases, make)
        _rounds(rows, paths, spec.vendor_name, "pre", rounds=7)
        G.PREFETCH_EPILOGUE = True


PROBLEMS_PRE = ["M=64,N=2304,K=768,bias=True", "M=1,N=2304,K=768,bias=True", "M=8,N=2304,K=768,bias=True",
                "M=64,N=768,K=768,bias=True,residual=True", "M=64,N=3072,K=768,bias=True,act=gelu_tanh"]


def ab_all(rows):
    """ab over each GPT-2 c_attn-like problem at M <= 64 (PROBLEMS_AB)."""
    for text in PROBLEMS_AB:
        PROBLEM[0] = text
        ab(rows)


PROBLEMS_AB = ["M=64,N=2304,K=768,bias=True", "M=1,N=2304,K=768,bias=True", "M=8,N=2304,K=768,bias=True"]

def grid_small(rows):
    """grid over the c_attn rows at M = 1 and 8 (one 16-row tile: warps and TMA varied too)."""
    for text in ("M=1,N=2304,K=768,bias=True", "M=8,N=2304,K=768,bias=True"):
        PROBLEM[0] = text
        grid(rows)


SECTIONS = {"names": names, "grid": grid, "grid_small": grid_small, "ab": ab, "ab_all": ab_all, "pre": pre}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="names,grid")
    p.add_argument("--problem", default=PROBLEM[0])
    args = p.parse_args()
    PROBLEM[0] = args.problem
    run_sections(SECTIONS, args.only, args.out)


if __name__ == "__main__":
    sys.exit(main())
