"""Host time of an eager launch at a new M: gemm and fp8_gemm, with and without the shared kernel cache.

Serving brings a new token count M with most prefills, so each linear makes a new launch plan: its checks and
config lookup, then a first call through triton's launch. With the process-wide cache of compiled kernels keyed
on triton's own specialisation (``kernels/runtime/specialize.py``; ``TRITUNE_SHARED_KERNELS=0`` turns it off, as
this script's "off" mode does) that first call launches the kernel another M compiled, directly. Run it in two
trees (``--label before|after``) to time a change of the plan itself.

Per case (Llama-3.2-1B-ish linears: N = K = 2048 and N = 6144, K = 2048; bf16 gemm, and fp8_gemm with per-row
and per-channel scales): every M is run once first (compiles every kernel, fills triton's and the shared
cache, as a server's warm-up would), then for each mode, ``--rounds`` times: the launch plans are dropped
and the FIRST call at each of ``--ms`` new M values in 17..4000 is timed on the host (``time.perf_counter``
around the call, ``torch.cuda.synchronize`` outside it); the median over all of them is reported with the
10th/90th percentiles, and the steady-state host time of a call at one repeated M (the plan's direct launch).
Rows go to ``results/<gpu-slug>/host_launch.json``, one per (case, mode, what). Needs a CUDA GPU:

    python benchmarks/bench_host_launch.py [--ms 50] [--rounds 3] [--steady 200] [--results results]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

CASES = [("gemm", 2048, 2048), ("gemm", 6144, 2048), ("fp8_gemm", 2048, 2048), ("fp8_gemm", 6144, 2048)]
STEADY_M = 512
M_RANGE = (17, 4000)


def make_call(kernel: str, n: int, k: int, m_max: int):
    """``call(m)``: one eager launch of ``kernel`` on the first m rows of an (m_max, K) activation against a
    fixed (K, N) weight (fp8: e4m3, row scales for A, channel scales for B), output allocated by the call."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m_max, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
    if kernel == "gemm":
        from tritune.kernels.gemm import gemm

        b = w.t().contiguous()
        return lambda m: gemm(x[:m], b)
    from tritune.kernels.fp8_gemm import fp8_gemm
    from tritune.references import fp8 as ref

    a, sa = ref.quantize_rows(x.float())
    bq, sb = ref.quantize_channels(w.t().float())
    bq = bq.t().contiguous().t()  # K-major, as a checkpoint's (N, K) weight passed as w.t()
    return lambda m: fp8_gemm(a[:m], bq, sa[:m], sb, out_dtype=torch.bfloat16)


def drop_plans() -> None:
    """Forget every launch plan of both launchers (their compiled kernels go with them; triton's own cache
    and the shared one stay): the next call at any M is a new plan's first."""
    from tritune.kernels import fp8_gemm as F
    from tritune.kernels import gemm as G

    G._PLANS.clear()
    F._PLANS.clear()


def host_us(call, m: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call(m)
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e6


def summary(us: list[float]) -> dict:
    q = statistics.quantiles(us, n=10) if len(us) > 1 else us * 9
    return {"host_us_median": round(statistics.median(us), 2), "host_us_p10": round(q[0], 2),
            "host_us_p90": round(q[-1], 2), "samples": len(us)}


def measure(call, ms: list[int], rounds: int, steady: int) -> dict:
    """{mode: {"first_call": [us...], "steady": [us...], "hits": shared hits}} for modes "on" and "off",
    rounds interleaved so drift hits both alike."""
    try:
        from tritune.kernels.runtime.specialize import SHARED
    except ImportError:   # a tree from before the shared cache (a before/after run): its one mode is "off"
        SHARED = None
    modes = ("on", "off") if SHARED is not None else ("off",)
    out = {mode: {"first_call": [], "steady": [], "hits": 0} for mode in modes}
    for m in ms + [STEADY_M]:  # warm-up: every kernel compiled and loaded, both caches full
        call(m)
    for _ in range(rounds):
        for mode in modes:
            if SHARED is not None:
                SHARED.on = mode == "on"
            drop_plans()
            gc.collect()
            gc.disable()
            hits = SHARED.hits if SHARED is not None else 0
            try:
                out[mode]["first_call"] += [host_us(call, m) for m in ms]
                out[mode]["hits"] += (SHARED.hits if SHARED is not None else 0) - hits
                out[mode]["steady"] += [host_us(call, STEADY_M) for _ in range(steady)][1:]
            finally:
                gc.enable()
    if SHARED is not None:
        SHARED.on = True
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", type=int, default=50, help="new M values per round, drawn from 17..4000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steady", type=int, default=200, help="calls at one repeated M per round")
    p.add_argument("--results", default="results")
    p.add_argument("--label", default="", help="recorded in each row (e.g. 'before' / 'after' for two trees)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_host_launch: needs a CUDA GPU (host time of direct launches)", file=sys.stderr)
        return 2
    ms = random.Random(0).sample([m for m in range(*M_RANGE) if m != STEADY_M], args.ms)
    rows = []
    for kernel, n, k in CASES:
        res = measure(make_call(kernel, n, k, M_RANGE[1]), ms, args.rounds, args.steady)
        for mode, r in res.items():
            for what in ("first_call", "steady"):
                row = {"kernel": kernel, "N": n, "K": k, "shared_kernels": mode == "on", "timed": what,
                       **({"label": args.label} if args.label else {}),
                       **summary(r[what])}
                if what == "first_call":
                    row.update(shared_hits=r["hits"], m_values=f"{len(ms)} in {M_RANGE[0]}..{M_RANGE[1] - 1}")
                rows.append(row)
                print(f"{kernel:8s} N={n:5d} K={k:5d} shared={mode:3s} {what:10s} "
                      f"median {row['host_us_median']:7.1f} us  p10 {row['host_us_p10']:7.1f}  "
                      f"p90 {row['host_us_p90']:7.1f}" + (f"  hits {r['hits']}" if what == "first_call" else ""))
    path = write_rows("host_launch", rows, args.results, command=" ".join(["bench_host_launch.py", *sys.argv[1:]]),
                      m_values=ms, steady_m=STEADY_M)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
