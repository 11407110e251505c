"""GPU probe (issue #27): how fast can a GEMV stage laid out as the fused decode step lays it out (one
program per SM looping over column tiles, M = 1, bf16 weights) stream its weights, by inner-loop design?

The fused step's GEMV stages ran at ~15% of the copy bandwidth on the H200 (lab/logs/h200/
benches_2026-11-24_9812291/fused.log: the LM head, 77 MB, 123 us), while tritune's own gemv kernel reads
the same LM head in 22.7 us. Designs, each over block sizes, warps and ``tl.range`` pipelining stages:

  fma_acc2   float32 products kept in a (BK, BN) accumulator, reduced once a tile (the fused step's M=1 path)
  fma_sum    the products reduced over K every step: a (BN,) accumulator, fewer registers, bigger tiles
  dot16      x as row 0 of a 16-row tile through tl.dot (mma.sync; the loads feed a dot, so the pipeliner
             stages them through shared memory)
  dot64      the same with a 64-row tile (wgmma on sm90)

Grids: ``persistent`` (programs = SMs x --occupancy, each looping over tiles, as the fused step) and ``grid``
(one program a tile: what a standalone kernel does). Baselines in the same run: tritune's gemv launcher
(its tuned config), torch.mv-equivalent ``x @ w`` (cuBLAS), and a device copy of the weight bytes.
Every variant's output is checked against x.double() @ w.double() before it is timed. Times are CUDA-graph
replays (``triton.testing.do_bench_cudagraph``), no L2 flush: the weights (>= 1.2 MB) are read from HBM
only where they exceed L2, so the rows report both the 77 MB LM head and the layer shapes.

    python lab/probes/persistent_gemv_bandwidth.py --out OUT/persistent_gemv.json --quick [--time-limit 170]
    (--quick: 26 configs x 3 grids a shape, ~2.5 min on an H100 with a cold Triton cache)
    TRITON_INTERPRET=1 python lab/probes/persistent_gemv_bandwidth.py --check   # the variants' math, tiny shapes
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

MODES = {"fma_acc2": 0, "fma_sum": 1, "dot16": 2, "dot64": 3}


@triton.jit
def _xw(X, W, k0, offs_k0, offs_n, nm, N, K):
    """x[k0:k0+BK] as float32 and the (BK, BN) weight block at (k0, offs_n), zeros outside."""
    ok = k0 + offs_k0
    km = ok < K
    x = tl.load(X + ok, mask=km, other=0.0).to(tl.float32)
    w = tl.load(W + ok[:, None].to(tl.int64) * N + offs_n[None, :], mask=km[:, None] & nm[None, :], other=0.0)
    return x, w


@triton.jit
def _pgemv(X, W, Y, N, K, P, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, STAGES: tl.constexpr):
    """y (N,) = x (K,) @ W (K, N), W row-major (N contiguous); program pid takes tiles pid, pid + P, ..."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    offs_k0 = tl.arange(0, BK)
    offs_n0 = tl.arange(0, BN)
    for tile in range(pid, n_tiles, P):
        offs_n = tile * BN + offs_n0
        nm = offs_n < N
        if MODE == 0:
            acc2 = tl.zeros((BK, BN), dtype=tl.float32)
            for k0 in tl.range(0, K, BK, num_stages=STAGES):
                x, w = _xw(X, W, k0, offs_k0, offs_n, nm, N, K)
                acc2 += x[:, None] * w.to(tl.float32)
            acc = tl.sum(acc2, axis=0)
        elif MODE == 1:
            acc = tl.zeros((BN,), dtype=tl.float32)
            for k0 in tl.range(0, K, BK, num_stages=STAGES):
                x, w = _xw(X, W, k0, offs_k0, offs_n, nm, N, K)
                acc += tl.sum(x[:, None] * w.to(tl.float32), axis=0)
        else:
            BM: tl.constexpr = 16 if MODE == 2 else 64
            rows = tl.arange(0, BM)
            acc_t = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in tl.range(0, K, BK, num_stages=STAGES):
                x, w = _xw(X, W, k0, offs_k0, offs_n, nm, N, K)
                xt = tl.where(rows[:, None] == 0, x[None, :], 0.0).to(w.dtype)   # x as row 0 of the tile
                acc_t = tl.dot(xt, w, acc_t)
            acc = tl.sum(tl.where(rows[:, None] == 0, acc_t, 0.0), axis=0)
        tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=nm)


def run(x, w, y, cfg, programs):
    K, N = w.shape
    n_tiles = triton.cdiv(N, cfg["BN"])
    P = min(programs, n_tiles) if programs else n_tiles
    _pgemv[(P,)](x, w, y, N, K, P, BN=cfg["BN"], BK=cfg["BK"], MODE=MODES[cfg["mode"]], STAGES=cfg["stages"],
                 num_warps=cfg["warps"])


def configs(quick: bool):
    out = []
    for mode, bn, bk, warps, stages in itertools.product(MODES, (32, 64, 128), (64, 128, 256), (4, 8), (1, 3, 4)):
        if mode == "fma_acc2" and bn * bk > 128 * 64:
            continue    # the (BK, BN) float32 accumulator spills beyond 8K elements a program
        if quick and (warps == 4 or stages == 3 or bn == 32 or bk == 64):
            continue
        out.append({"mode": mode, "BN": bn, "BK": bk, "warps": warps, "stages": stages})
    return out


def check() -> int:
    torch.manual_seed(0)
    bad = 0
    for mode in MODES:
        for K, N in ((96, 40), (64, 33)):
            x = torch.randn(K, dtype=torch.float32)
            w = torch.randn(K, N, dtype=torch.float32)
            y = torch.full((N,), float("nan"))
            run(x, w, y, {"mode": mode, "BN": 16, "BK": 32, "warps": 1, "stages": 1}, programs=2)
            want = (x.double() @ w.double()).float()
            err = ((y - want).norm() / want.norm()).item()
            ok = err < (2e-2 if mode.startswith("dot") else 1e-5)   # the dots round to tf32 on a GPU
            bad += not ok
            print(f"{mode:9s} K={K} N={N} rel err {err:.2e} {'ok' if ok else 'WRONG'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="the variants against float64 on tiny shapes")
    ap.add_argument("--quick", action="store_true", help="8 warps, 1 or 4 stages, BN and BK >= 64 / 128 only")
    ap.add_argument("--shapes", default="768x50257,768x3072,3072x768,768x768", help="KxN,...")
    ap.add_argument("--occupancy", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--time-limit", type=float, default=170.0)
    args = ap.parse_args(argv)
    if args.check:
        return check()
    from triton.testing import do_bench_cudagraph

    from tritune import kernels as TK
    from tritune.kernels import gemv as G

    t_end = time.time() + args.time_limit
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_ms = do_bench_cudagraph(lambda: big[: 1 << 29].copy_(big[1 << 29:]))
    bw = 2 * (1 << 29) / (copy_ms * 1e-3)
    del big
    print(f"{torch.cuda.get_device_name()}: {sms} SMs, copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for K, N in shapes:
        torch.manual_seed(K + N)
        x = torch.randn(K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(K, N, device=dev) * K ** -0.5).to(torch.bfloat16)
        y = torch.empty(N, device=dev, dtype=torch.bfloat16)
        want = x.double() @ w.double()
        nbytes = w.numel() * 2

        def row(name, fn, **extra):
            fn()
            with TK.pdl_forced():   # the variant a capture launches (tritune's gemv: PDL), compiled before it
                y.fill_(float("nan"))
                fn()
            err = ((y.double() - want).norm() / want.norm()).item()
            us = do_bench_cudagraph(fn) * 1e3 if err < 2e-2 else None
            r = {"K": K, "N": N, "variant": name, "us": us, "rel_err": err,
                 "of_copy": None if us is None else round(nbytes / (us * 1e-6) / bw, 3), **extra}
            rows.append(r)
            return r

        base = [row("cublas x@w", lambda: torch.matmul(x, w, out=y)),
                row("tritune gemv", lambda: G.gemv(x[None], w, out=y[None]))]
        print(f"K={K} N={N} ({nbytes / 1e6:.1f} MB): " + ", ".join(f"{r['variant']} {r['us']:.1f} us"
                                                                  f" ({r['of_copy']:.0%} of copy)" for r in base),
              flush=True)
        best = {}
        for cfg in configs(args.quick):
            for grid in [("persistent", occ) for occ in args.occupancy] + [("grid", 0)]:
                if time.time() > t_end:
                    break
                programs = sms * grid[1] if grid[0] == "persistent" else 0
                label = f"{grid[0]}{grid[1] or ''}"
                try:
                    r = row(cfg["mode"], lambda: run(x, w, y, cfg, programs), grid=label, **cfg)
                except Exception as e:  # a config that does not compile (shared memory, registers)
                    rows.append({"K": K, "N": N, "variant": cfg["mode"], "grid": label, **cfg,
                                 "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                key = (cfg["mode"], label)
                if r["us"] is not None and (key not in best or r["us"] < best[key]["us"]):
                    best[key] = r
        for (mode, label), r in sorted(best.items(), key=lambda kv: kv[1]["us"]):
            print(f"  {mode:9s} {label:12s} {r['us']:8.1f} us  {r['of_copy']:5.0%} of copy  "
                  f"BN {r['BN']} BK {r['BK']} w{r['warps']} s{r['stages']}", flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "copy_Bps": bw, "rows": rows}, f,
                          indent=1)
        if time.time() > t_end:
            print("time limit reached", flush=True)
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
