"""Tensor parallelism on one host's GPUs: batch-1 decode latency and serving throughput at TP = 1, 2, (4).

- ``--part decode``: ``tritune.model.parallel.bench``'s measurement: a random-init Llama of ``--sizes``
  (default llama-8b: Llama-3.1-8B's shapes) on every rank, the batch-1 decode step captured as a CUDA graph
  per rank (its all-reduces inside) and replayed; each rank count also with its collectives replaced by
  no-ops, so ``collective_share`` = 1 - without / with.
- ``--part serve``: ``tritune serve-bench`` on a random-init checkpoint of ``--shape`` (written once with
  transformers, bf16) at each ``--tp``: output tok/s, TTFT and TPOT p50/p99, batch-1 decode tok/s (engine,
  CUDA graphs on every rank).

Rows go to ``results/<gpu>/tensor_parallel.json`` (``part``, ``tp``, the figures).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)


def decode_rows(tps, sizes, steps, prompt) -> list[dict]:
    from tritune.model.parallel import bench as B

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "tp.json"
        B.main(["--tp", *map(str, tps), "--sizes", sizes, "--steps", str(steps), "--prompt", str(prompt),
                "--all-reduce", "nccl", "one-shot", "--out", str(out)])
        return [{"part": "decode", **r} for r in json.loads(out.read_text())]


def serve_rows(tps, shape, extra: str, folder) -> list[dict]:
    import torch

    from tritune.model.bench.runs import random_checkpoint

    ckpt = Path(folder) / shape
    if not (ckpt / "config.json").is_file():
        random_checkpoint(shape, ckpt, torch.bfloat16)
    rows = []
    for n in tps:
        out = Path(folder) / f"serve_tp{n}.json"
        cmd = ["tritune", "serve-bench", "--model", str(ckpt), "--tp", str(n), "--out", str(out), *shlex.split(extra)]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc != 0 or not out.is_file():
            rows.append({"part": "serve", "tp": n, "shape": shape, "error": f"serve-bench exited {rc}"})
            continue
        res = json.loads(out.read_text())
        for mode, r in (res.get("modes") or res).items():
            if not isinstance(r, dict):
                continue
            if "run" not in r:
                rows.append({"part": "serve", "tp": n, "shape": shape, "mode": mode, "error": r.get("error")})
                continue
            m, b1 = r["run"], r.get("batch1_decode") or {}
            rows.append({"part": "serve", "tp": n, "shape": shape, "mode": mode, "command": " ".join(cmd),
                         "output_tok_s": m["output_tok_s"], "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"],
                         "spread": m.get("spread"), "batch1_decode_tok_s": b1.get("decode_tok_s"),
                         "batch1_gpu_ms_per_token": b1.get("gpu_ms_per_token"), "setup_s": r.get("setup_s")})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("decode", "serve", "both"), default="both")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sizes", default="llama-8b", help="the decode part's model sizes (tritune.model.parallel.bench)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--shape", default="llama-3.1-8b", help="the serve part's checkpoint shape (serve-bench --shape)")
    ap.add_argument("--serve-args", default="-n 512 --prompt-len 32:256 --output-len 32:256 --hf-requests -1 "
                    "--naive-requests 0 --batch-sweep '' --decode-tokens 128 --max-batch-tokens 16384")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and serve-bench's JSON go (default: a temp dir)")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    rows = []
    if a.part in ("decode", "both"):
        rows += decode_rows(a.tp, a.sizes, a.steps, a.prompt)
        print(write_rows("tensor_parallel", rows, a.results_dir))
    if a.part in ("serve", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            serve = serve_rows(a.tp, a.shape, a.serve_args, a.workdir or tmp)
        print(write_rows("tensor_parallel", serve, a.results_dir))
        rows += serve
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("command", "spread")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
