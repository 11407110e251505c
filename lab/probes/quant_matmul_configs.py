"""INT4/INT8 quant_matmul probe on one large shape: candidate configs at M = 1 and 16 (correctness
checked against the float64 reference, then do_bench median with L2 flushed, and do_bench_cudagraph
for the host-overhead-free time), next to F.linear on the dequantized weight and tinygemm.

  python lab/probes/quant_matmul_configs.py --out $OUT/probe.json [--precompile 6] [--store-dir DIR]

--precompile N compiles every candidate first in N worker processes (Triton's on-disk cache is shared),
so the timing loop meets no compilation. --store-dir writes the winner per (format, M) as tuned-store
entries (tuning/configs/<slug>/quant_matmul.json under DIR) with its time and the default's.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

# (bits, M, config) candidates: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
SHAPE = tuple(int(v) for v in os.environ.get("PROBE_SHAPE", "8192,28672").split(","))  # (K, N)
CANDIDATES = {
    # M = 1: BLOCK_M 8 (operands swapped). num_stages 1: unpipelined loads that keep the evict_first hint
    (4, 1): [(8, 64, 256, 4, 4, 3), (8, 64, 256, 2, 4, 3), (8, 64, 256, 8, 4, 3), (8, 64, 128, 4, 4, 3),
             (8, 64, 128, 8, 4, 3), (8, 64, 512, 4, 4, 2), (8, 64, 512, 2, 4, 2), (8, 64, 256, 4, 4, 4),
             (8, 32, 256, 4, 2, 3), (8, 32, 256, 2, 2, 3), (8, 64, 256, 4, 4, 1), (8, 128, 256, 4, 4, 1),
             (8, 128, 128, 4, 4, 1), (8, 64, 512, 4, 4, 1)],
    (4, 16): [(16, 32, 256, 4, 2, 3), (16, 32, 256, 8, 2, 3), (16, 32, 256, 2, 2, 3), (16, 32, 512, 4, 2, 2),
              (16, 32, 128, 4, 2, 3), (16, 32, 256, 4, 2, 4), (16, 16, 256, 4, 1, 3), (16, 64, 256, 8, 2, 3),
              (16, 32, 256, 4, 2, 1), (16, 64, 256, 4, 2, 1)],
    (8, 1): [(1, 32, 256, 2, 4, 1)],
    (8, 16): [(16, 64, 256, 4, 4, 3)],
}
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")


def cfg_of(t):
    return dict(zip(KEYS, t))


def _inputs(bits, m, seed=0):
    import torch
    from tritune.kernels import quant_matmul as QM
    k, n = SHAPE
    from tritune.harness import device as dev
    return QM.make_inputs(QM.Problem(m, n, k, bits, 128), torch.bfloat16, dev.device(), seed)


def _compile_worker(jobs):
    from tritune.kernels import quant_matmul as QM
    cases = {}
    for bits, m, t in jobs:
        if (bits, m) not in cases:
            cases[(bits, m)] = _inputs(bits, m)
        c = cases[(bits, m)]
        try:
            QM.quant_matmul(*c.args, out=c.out, config=cfg_of(t))
        except Exception as e:  # reported again (with the config) by the timing loop
            print(f"precompile {bits} {m} {t}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    import torch
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--precompile", type=int, default=0)
    ap.add_argument("--store-dir", default=None)
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--only", default=None, help="comma list of bits:M keys, e.g. 4:1,4:16")
    a = ap.parse_args()
    cands = CANDIDATES
    if a.only:
        want = {tuple(int(v) for v in s.split(":")) for s in a.only.split(",")}
        cands = {k: v for k, v in cands.items() if k in want}
    from tritune.kernels import quant_matmul as QM
    jobs = [(bits, m, t) for (bits, m), ts in cands.items() for t in ts]
    jobs += [(bits, m, tuple(QM.default_config(QM.Problem(m, SHAPE[1], SHAPE[0], bits, 128), None)[k] for k in KEYS))
             for (bits, m) in cands]
    t0 = time.time()
    if a.precompile:
        ctx = mp.get_context("spawn")
        chunks = [jobs[i::a.precompile] for i in range(a.precompile)]
        with ctx.Pool(a.precompile) as pool:
            pool.map(_compile_worker, chunks)
        print(f"precompiled {len(jobs)} configs in {time.time() - t0:.0f} s", flush=True)
    if a.precompile_only:
        return 0

    import torch
    import triton.testing
    from tritune.harness import bench as B
    from tritune.harness import compare as cmp
    from tritune.references import quant_matmul as ref

    rows = []
    if torch.cuda.is_available():
        B.warm_gpu()
    for (bits, m), ts in cands.items():
        case = _inputs(bits, m)
        x, qw, bias = case.args
        want = ref.quant_matmul(x, qw, bias)
        p = QM.Problem(m, SHAPE[1], SHAPE[0], bits, 128)
        dflt = QM.default_config(p, torch.bfloat16)
        cfgs = [cfg_of(t) for t in ts if QM.SPACE.why_invalid(cfg_of(t), p, torch.bfloat16) is None]
        if dflt not in cfgs:
            cfgs.append(dflt)
        k, n = SHAPE
        wbytes = QM.weight_bytes(p)

        def rec(name, fn, cfg=None, graph=False):
            row = {"bits": bits, "M": m, "name": name, "config": cfg}
            try:
                if cfg is not None:
                    out = cmp.poisoned_like(case.out)
                    got = fn(out)
                    c = cmp.compare(got, want, torch.bfloat16)
                    row["rel_error"], row["correct"] = c.error, c.ok
                    call = lambda: fn(case.out)  # noqa: E731
                else:
                    call = fn
                row["us"] = B.median_ms(call) * 1e3
                if graph and torch.cuda.is_available():
                    row["graph_us"] = float(triton.testing.do_bench_cudagraph(call, rep=100, return_mode="median")) * 1e3
                row["pct_copy_bw"] = 100.0 * (wbytes / (row["us"] * 1e-6)) / B.dev.ceilings()["copy_bytes_per_s"] \
                    if B.dev.ceilings() else None
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            return row

        lin = QM._vendor(case)
        rec("F.linear", lin, graph=True)
        if bits == 4 and torch.cuda.is_available():
            tg = QM._tinygemm(case)
            if tg is not None:
                rec("tinygemm", tg, graph=True)
        ours = []
        for cfg in cfgs:
            r = rec("default" if cfg == dflt else "ours", lambda o, cfg=cfg: QM.quant_matmul(x, qw, bias, out=o, config=cfg), cfg)
            if "us" in r and r.get("correct"):
                ours.append(r)
        ours.sort(key=lambda r: r["us"])
        for r in ours[:2]:  # the two best again, with the CUDA-graph time
            rec("best-graph", lambda o, cfg=r["config"]: QM.quant_matmul(x, qw, bias, out=o, config=cfg), r["config"], graph=True)
        del case, want, x, qw
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        c = r.get("config") or {}
        print(f"int{r['bits']} M={r['M']:<3} {r['name']:<10} {' '.join(str(c.get(k, '')) for k in KEYS):<24} "
              f"{r.get('us', float('nan')):8.1f} us  graph {r.get('graph_us', float('nan')):8.1f}  "
              f"{r.get('pct_copy_bw') or 0:5.1f}% bw  ok={r.get('correct', '-')} {r.get('error', '')[:80]}")
    if a.store_dir:
        write_store(rows, a.store_dir)
    print(f"probe done in {time.time() - t0:.0f} s", flush=True)


def write_store(rows, root):
    """The winner per (bits, M) as a store entry, beside the default's time (medians of this run)."""
    from pathlib import Path

    import torch
    from tritune import kernels as Kr
    from tritune.kernels import quant_matmul as QM
    from tritune.tuning import store
    entries = []
    for key in sorted({(r["bits"], r["M"]) for r in rows}):
        bits, m = key
        mine = [r for r in rows if (r["bits"], r["M"]) == key and r.get("config") and r.get("correct") and "us" in r
                and r["name"] in ("ours", "default")]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        d = [r for r in mine if r["name"] == "default"]
        p = QM.Problem(m, SHAPE[1], SHAPE[0], bits, 128)
        entries.append({
            "bucket": Kr.bucket_key(QM.bucket(p)),
            "dtype": "bfloat16", "config": best["config"], "time_us": round(best["us"], 3),
            "default_us": round(d[0]["us"], 3) if d else None,
            "default_config": QM.default_config(p, torch.bfloat16),
            "speedup": round(d[0]["us"] / best["us"], 4) if d else None,
            "trials": len(mine), "failed": 0, "problem": f"M={m} N={SHAPE[1]} K={SHAPE[0]} bits={bits} group=128 bias=False",
            "study": "lab/probes/quant_matmul_configs.py",
        })
    path = store.write("quant_matmul", entries, root=Path(root))
    print(f"store entries -> {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
