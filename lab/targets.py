"""Finished issues' benchmark targets (#4 gemm, #6 paged attention, #7 quant_matmul), checked against the
committed results: `python lab/targets.py [results]` prints the table (H100, bf16).

Each target names a GPU, a results file (kernel), the problems it covers (the kernels' own Problem
objects: a row is a problem's when its label is the bench's label of it) and how the rows combine (each row, the minimum, or the geometric mean) against a threshold.
A target whose rows are missing says so instead of passing.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

H100 = "nvidia-h100-80gb-hbm3"


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    kernel: str
    problems: Callable    # () -> the kernel's Problem objects the target covers (rows match by label)
    metric: str           # a row key: vs_vendor, pct_copy_bw, ...
    combine: str          # "each" (the lowest row is shown), "geomean"
    threshold: float
    gpu: str = H100


def _gemm(*m_values, lm_head: bool = True):
    """GPT-2 small's linears as gemm's standard problems define them (kernels.gemm._gpt2)."""
    def problems():
        from tritune.kernels import gemm

        return [p for m in m_values for p in gemm._gpt2(m) if lm_head or not p.trans_b]
    return problems


def _of(kernel: str, *fields_list):
    """Problems of ``kernel``'s Problem class from positional fields."""
    def problems():
        from tritune import kernels

        cls = type(kernels.get(kernel).standard_problems[0])
        return [cls(*f) for f in fields_list]
    return problems


TARGETS = [
    Target(4, "GPT-2 linears at M >= 512, fused epilogue, geomean vs cuBLAS + torch epilogue", "gemm",
           _gemm(512, 8192), "vs_vendor", "geomean", 1.0),
    Target(4, "the same without the LM head (x @ wte.T, where cuBLAS is slow on the transposed operand)", "gemm",
           _gemm(512, 8192, lm_head=False), "vs_vendor", "geomean", 1.0),
    Target(4, "8192^3 plain vs cuBLAS", "gemm", _of("gemm", (8192, 8192, 8192)), "vs_vendor", "each", 0.9),
    Target(4, "GPT-2 linears at M <= 64, each vs cuBLAS", "gemm", _gemm(1, 8, 64), "vs_vendor", "each", 1.0),
    Target(6, "large batch, % of copy bandwidth: B=128 Llama ctx 4096, B=256 GPT-2 ctx 1024", "paged_attention",
           _of("paged_attention", (128, 32, 8, 128, 4096), (256, 12, 12, 64, 1024)), "pct_copy_bw", "each", 85.0),
    Target(6, "B=64 GPT-2 ctx 1024 (the issue's SDPA reference point), % of copy bandwidth", "paged_attention",
           _of("paged_attention", (64, 12, 12, 64, 1024)), "pct_copy_bw", "each", 85.0),
    Target(6, "B=1 Llama, ctx >= 4096, % of copy bandwidth", "paged_attention",
           _of("paged_attention", *[(1, 32, 8, 128, c) for c in (4096, 8192, 16384, 32768)]), "pct_copy_bw",
           "each", 50.0),
    Target(7, "int4 M=1 on (8192, 28672) vs bf16 F.linear", "quant_matmul",
           _of("quant_matmul", (1, 28672, 8192, 4, 128)), "vs_vendor", "each", 3.0),
    Target(7, "int4 M=16 on (8192, 28672) vs bf16 F.linear", "quant_matmul",
           _of("quant_matmul", (16, 28672, 8192, 4, 128)), "vs_vendor", "each", 2.0),
    Target(7, "int8 M=1 on (8192, 28672) vs bf16 F.linear", "quant_matmul",
           _of("quant_matmul", (1, 28672, 8192, 8, 128)), "vs_vendor", "each", 1.7),
    Target(7, "never slower than bf16 at M <= 64 on (8192, 28672)", "quant_matmul",
           _of("quant_matmul", *[(m, 28672, 8192, b, 128) for b in (4, 8) for m in (1, 16, 64)]), "vs_vendor",
           "each", 1.0),
]


def evaluate(target: Target, rows: list[dict]) -> dict:
    """{'value', 'met', 'rows', 'worst', 'runs'} of the target over the results rows (bf16 rows; a row is
    a problem's when its label is ``bench.problem_label`` of it, as the bench writes it)."""
    from tritune.harness.bench import problem_label

    by_label = {r.get("problem"): r for r in rows
                if r.get("dtype") == "bfloat16" and isinstance(r.get(target.metric), (int, float))}
    picked = []
    for p in target.problems():
        r = by_label.get(problem_label(p))
        if r is None:
            return {"value": None, "met": False, "rows": len(picked), "missing": problem_label(p)}
        picked.append(r)
    # a row that carries several measurements of the metric (``<metric>_runs``) counts by their median
    vals = [statistics.median(r[f"{target.metric}_runs"]) if r.get(f"{target.metric}_runs") else r[target.metric]
            for r in picked]
    runs = max((len(r.get(f"{target.metric}_runs") or ()) for r in picked), default=0)
    if target.combine == "geomean":
        value = math.exp(sum(math.log(v) for v in vals) / len(vals))
        worst = None
    else:
        i = min(range(len(vals)), key=vals.__getitem__)
        value, worst = vals[i], picked[i]["problem"]
    return {"value": value, "met": value >= target.threshold, "rows": len(picked), "worst": worst, "runs": runs}


def table(results_dir: Path, fmt: str = "github") -> str:
    from tabulate import tabulate

    out = []
    cache: dict = {}
    for t in TARGETS:
        path = Path(results_dir) / t.gpu / f"{t.kernel}.json"
        if path not in cache:
            try:
                cache[path] = json.loads(path.read_text()).get("rows", [])
            except (OSError, ValueError):
                cache[path] = []
        ev = evaluate(t, cache[path])
        unit = "%" if t.metric.startswith("pct") else "x"
        shown = "" if ev["value"] is None else (f"{ev['value']:.1f}%" if unit == "%" else f"{ev['value']:.2f}x")
        need = f">= {t.threshold:g}{unit}"
        note = (f"no row for {ev['missing']}" if ev.get("missing")
                else f"lowest: {ev['worst']}" if ev.get("worst") and ev["rows"] > 1 else "")
        if ev.get("runs"):
            note = (note + "; " if note else "") + f"median of {ev['runs']} measurements (the row's *_runs)"
        out.append([f"#{t.issue}", t.what, need, shown, ev["rows"], "met" if ev["met"] else "not met", note])
    return tabulate(out, headers=["issue", "target (H100, bf16, do_bench)", "needs", "measured", "rows",
                                  "status", "note"], tablefmt=fmt, disable_numparse=True)


if __name__ == "__main__":
    import sys

    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else "results")))
