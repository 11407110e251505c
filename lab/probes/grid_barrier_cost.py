"""GPU probe (issue #27): what does one grid barrier cost in a persistent launch (one program per SM), by
how the programs arrive and spin, against a kernel boundary inside a CUDA graph?

The fused decode step (kernels/fused_decode.py) separates its 61 stages (GPT-2 small) by grid barriers and
ran at ~7.8 us a stage on the H100 (475 us a step), against ~5.3 us a kernel of the per-op step: if one
barrier costs several microseconds, no tiling of the stages reaches the issue's 166 us a step.

Variants (all programs resident, ``--warps`` warps each), N barriers in a loop, each on its own counter:

  atomic   arrival atomic_add(release), spin on atomic_add(0, acquire)   (the fused step's poll=0)
  ldacq    arrival atomic_add(release), spin on ld.acquire.gpu            (the fused step's poll=1)
  relaxed  arrival atomic_add(relaxed), spin on ld.acquire.gpu            (no release fence on arrival)
  volatile arrival atomic_add(release), spin on a volatile load, one acquire atomic after the spin

Each is timed as CUDA-graph replays of a launch with N barriers and of one with none (the difference over N
is a barrier); a graph of N empty-kernel launches gives a kernel boundary's cost for comparison.

    python lab/probes/grid_barrier_cost.py --out OUT/grid_barrier.json [--n 64] [--warps 8 4]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from tritune.model.fused_tune import time_us

VARIANTS = {"atomic": 0, "ldacq": 1, "relaxed": 2, "volatile": 3}


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _barriers(Bar, Err, n_bar, MODE: tl.constexpr):
    P = tl.num_programs(0)
    spins = tl.program_id(0) * 0
    for i in range(0, n_bar):
        tl.debug_barrier()
        if MODE == 2:
            tl.atomic_add(Bar + i, 1, sem="relaxed", scope="gpu")
        else:
            tl.atomic_add(Bar + i, 1, sem="release", scope="gpu")
        if MODE == 0:
            while (tl.atomic_add(Bar + i, 0, sem="acquire", scope="gpu") < P) & (spins < 4194304):
                spins += 1
        elif MODE == 3:
            while (tl.load(Bar + i, volatile=True) < P) & (spins < 4194304):
                spins += 1
            tl.atomic_add(Bar + i, 0, sem="acquire", scope="gpu")
        else:
            while (_ld_acquire(Bar + i) < P) & (spins < 4194304):
                spins += 1
        tl.debug_barrier()
    if spins >= 4194304:
        tl.atomic_max(Err, 1)


@triton.jit
def _empty(Err):
    if tl.program_id(0) < 0:
        tl.store(Err, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=64, help="barriers a launch")
    ap.add_argument("--warps", type=int, nargs="+", default=[8, 4])
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("grid_barrier_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    P = torch.cuda.get_device_properties(0).multi_processor_count
    bar = torch.zeros(a.n + 1, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    res = {"device": torch.cuda.get_device_name(), "programs": P, "n": a.n, "rows": []}
    for warps in a.warps:
        for name, mode in VARIANTS.items():
            def run(n):
                def f():
                    bar.zero_()
                    _barriers[(P,)](bar, err, n, MODE=mode, num_warps=warps)
                return f
            t0 = time_us(run(0), 20)
            tn = time_us(run(a.n), 20)
            row = {"variant": name, "warps": warps, "us_per_barrier": round((tn - t0) / a.n, 3),
                   "launch_us": round(t0, 2), "timed_out": int(err.item())}
            res["rows"].append(row)
            print(row, flush=True)

    def empties():
        for _ in range(a.n):
            _empty[(P,)](err, num_warps=8)
    t_empty = time_us(empties, 20)
    res["kernel_boundary_us"] = round(t_empty / a.n, 3)
    print({"kernel_boundary_us (empty kernel, 1 program/SM, in a graph)": res["kernel_boundary_us"]})
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
