"""``tritune tune --budget`` on 1 GPU against every GPU of the host: the same studies, each run from an empty
storage with ``--no-fill`` (so a run ends when its studies converge, not when the budget does), its wall time
taken around the command; then each study's winner on N GPUs against its winner on one (re-timed by each run's
own tuner, so the ratio carries both runs' noise). Rows to ``results/<gpu>/tune_spread.json``: per run the GPU
count, wall seconds and studies converged; per study the two winners' µs and their ratio.

    python benchmarks/bench_tune_spread.py gemv --problems "M=1,N=6144,K=4096,rms=1;..." --budget 10m
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)


def run_tune(kernel, problems, dtype, budget, gpus: list[str], storage: Path) -> tuple[float, int]:
    """(wall seconds, exit code) of one ``tritune tune`` on ``gpus``."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
    cmd = ["tritune", "tune", kernel, "--dtype", dtype, "--budget", budget, "--no-fill", "--storage", str(storage)]
    if problems:
        cmd += ["--problems", problems]
    print("$", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    return time.perf_counter() - t0, rc


def study_rows(kernel, problems, dtype, storage: Path) -> dict:
    from tritune.harness.cli.tune import parse_problems
    from tritune.kernels.runtime import device as dev
    from tritune.tuning import budget as tb
    from tritune.tuning.study import plan, resolve_specs

    specs = resolve_specs([kernel])
    probs = parse_problems(specs[0], problems) if problems else None
    jobs = plan(specs, probs, [dtype], dev.gpu_slug(), lambda m: None)
    return {r["study"]: r for r in tb.study_rows(jobs, str(storage))}


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel")
    ap.add_argument("--problems", default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--budget", default="10m")
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="GPU counts to run (default 1 and all)")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    visible = [str(i) for i in range(torch.cuda.device_count())]
    counts = a.gpus or sorted({1, max(1, len(visible))})
    runs, winners = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            storage = Path(tmp) / f"gpus{n}.journal"
            wall, rc = run_tune(a.kernel, a.problems, a.dtype, a.budget, visible[:n], storage)
            rows = study_rows(a.kernel, a.problems, a.dtype, storage)
            done = sum((r.get("ledger") or {}).get("stop") == "converged" for r in rows.values())
            runs.append({"part": "run", "gpus": n, "wall_s": wall, "exit": rc, "studies": len(rows), "converged": done,
                         "budget": a.budget, "kernel": a.kernel})
            winners[n] = {k: r.get("best_us") for k, r in rows.items()}
    base, rows = counts[0], list(runs)
    for n in counts[1:]:
        runs_n = next(r for r in runs if r["gpus"] == n)
        runs_n["speedup_vs_1"] = runs[0]["wall_s"] / runs_n["wall_s"]
        for study, us in winners[n].items():
            one = winners[base].get(study)
            rows.append({"part": "winner", "gpus": n, "study": study, "us": us, "us_1": one,
                         "ratio_to_1": us / one if us and one else None})
    for r in runs:
        print(r)
    print(write_rows("tune_spread", rows, a.results_dir, command=" ".join(sys.argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
