"""The two buckets the H200 budgeted run lost (lab/logs/h200/tune_all_budget_2026-11-24_6870e9e): the
budgeted winner against the committed H200 config, timed by do_bench's flushed median (the old timer,
"flush") and by CUDA-graph replay (the new timer for short problems, "graph"), in interleaved rounds,
with the host quiet and then with every core kept busy by spinning processes (the host falling behind
do_bench's L2 flush is the suspected cause: flush times should inflate there, graph times should not).

    python lab/probes/retime_timers.py OUTDIR [--rounds 10] [--busy N]

Prints a table (median µs over the rounds, the spread as max/min, the host µs a launch) and writes
OUTDIR/retime_timers.json. About 2 minutes on an H100 or H200.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUDGET_STORE = ROOT / "lab/logs/h200/tune_all_budget_2026-11-24_6870e9e/store"
COMMITTED = ROOT / "tuning/configs/nvidia-h200"
BUCKETS = [("gemm", "M=8,N=768,K=768"), ("paged_attention", "B=8,Hq=12,Hkv=12,D=64,block_size=16,ctx=1024"),
           ("paged_attention", "B=8,Hq=12,Hkv=12,D=64,block_size=16,ctx=512"),  # same config both: a control
           ("quant_matmul", "w=int4,g=128,M=1,N=768,K=3072")]                  # 8.7 -> 78 us between runs


def _entry(d: Path, kernel: str, bucket: str) -> dict | None:
    p = d / f"{kernel}.json"
    if not p.exists():
        return None
    return next((e for e in json.loads(p.read_text())["entries"] if e["bucket"] == bucket
                 and e["dtype"] == "bfloat16"), None)


def _spin(stop):
    while not stop.is_set():
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--only", default=None, help="one kernel's buckets only")
    ap.add_argument("--busy", type=int, default=os.cpu_count() or 8, help="spinning processes in the busy phase")
    args = ap.parse_args(argv)
    import tritune.harness  # noqa: F401
    from tabulate import tabulate

    from tritune import kernels
    from tritune.harness import bench
    from tritune.tuning import search, store

    ev = {m: search.Evaluator(mode=m) for m in ("flush", "graph")}
    rows, out = [], []
    for host in ("quiet", "busy"):
        stop, spinners = None, []
        if host == "busy":
            ctx = multiprocessing.get_context("fork")
            stop = ctx.Event()
            spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
            for p in spinners:
                p.start()
        try:
            for kernel, bucket in [b for b in BUCKETS if args.only in (None, b[0])]:
                spec = kernels.get(kernel)
                new, old = _entry(BUDGET_STORE, kernel, bucket), _entry(COMMITTED, kernel, bucket)
                if new is None or old is None:
                    print(f"{kernel} {bucket}: no entry in {'the budgeted store' if new is None else 'the committed'}")
                    continue
                problem = store.problem_of_entry(spec, new) or store.problem_of_entry(spec, old)
                dtype = store.torch_dtype("bfloat16")
                cfgs = {"budgeted": new["config"], "committed": old["config"]}
                auto = bench.timing_mode(spec, problem, dtype)
                times = {(m, c): [] for m in ev for c in cfgs}
                for name, cfg in cfgs.items():  # verified (and compiled) once, both timers' input sets built
                    for m, e in ev.items():
                        r = e(search.Task(kernel, problem, dtype, cfg, 1, spec=spec, verify=(m == "flush")))
                        if not r.get("ok"):
                            print(f"{kernel} {bucket} {name} {m}: {r.get('error')}")
                t0 = time.time()
                for r in range(args.rounds):
                    order = [(m, c) for m in ev for c in cfgs]
                    for m, c in (order if r % 2 == 0 else order[::-1]):
                        res = ev[m](search.Task(kernel, problem, dtype, cfgs[c], 0, spec=spec, verify=False))
                        if res.get("ok"):
                            times[(m, c)].append(res["ms"] * 1e3)
                secs = time.time() - t0
                for (m, c), ts in times.items():
                    if not ts:
                        continue
                    med = statistics.median(ts)
                    rows.append([host, kernel, bucket, c, m + (" (auto)" if m == auto else ""), f"{med:.2f}",
                                 f"{max(ts) / min(ts):.2f}", f"{new.get('time_us') if c == 'budgeted' else old.get('time_us')}"])
                    out.append({"host": host, "kernel": kernel, "bucket": bucket, "config_of": c, "config": cfgs[c],
                                "timer": m, "auto_mode": auto, "median_us": med, "times_us": ts,
                                "stored_us": (new if c == "budgeted" else old).get("time_us"), "seconds": secs})
                for m in ev:
                    b, o = times[(m, "budgeted")], times[(m, "committed")]
                    if b and o:
                        rows.append([host, kernel, bucket, "ratio b/c", m, f"{statistics.median(b) / statistics.median(o):.3f}", "", ""])
        finally:
            if stop is not None:
                stop.set()
                for p in spinners:
                    p.join(5)
                    if p.is_alive():
                        p.kill()
    print(tabulate(rows, headers=["host", "kernel", "bucket", "config", "timer", "median µs", "max/min", "stored µs"],
                   disable_numparse=True))
    d = Path(args.outdir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "retime_timers.json").write_text(json.dumps({"environment": bench.environment(), "rounds": args.rounds,
                                                      "busy": args.busy, "rows": out}, indent=1, default=str))
    print(f"wrote {d / 'retime_timers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
