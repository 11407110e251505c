"""Two trees' figures side by side, from what ``benchmarks/before_after.sh`` wrote under OUT.

Per tree and round: GPT-2 batch-1 decode tok/s (each method), serve-bench output tok/s, each kernel's bench
rows (CUDA-graph and do_bench µs). Printed: the median over the rounds per tree, after / before, and each
figure's spread over its rounds; bench rows whose graph-time ratio is off by more than the larger of 5%
and twice their spread are marked. Problem labels are compared without the fields a newer tree added at
their defaults (``rms=False``, ``window=None``). Writes OUT/compare.json.

    python benchmarks/compare_trees.py OUT
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def decode_figures(path: Path) -> dict:
    """{method: decode tok/s} of a decode result (the script's older --out file or its keyed rows)."""
    d = json.loads(path.read_text())
    res = d.get("results") or (d.get("records") or [{}])[-1].get("results", {})
    return {m: r["decode_tok_s"] for m, r in res.items() if isinstance(r, dict) and "decode_tok_s" in r}


def tree_figures(tree: Path) -> dict:
    """{figure name: [value per round]} of one tree."""
    out: dict[str, list] = {}
    for p in sorted(tree.glob("decode-*")):
        f = p if p.is_file() else next(iter(p.glob("*/decode.json")), None)
        if f is not None:
            for m, v in decode_figures(f).items():
                out.setdefault(f"decode tok/s [{m}]", []).append(v)
    for p in sorted(tree.glob("serve-*.json")):
        for mode, r in json.loads(p.read_text()).get("modes", {}).items():
            if "run" in r:
                out.setdefault(f"serve output tok/s [{mode}]", []).append(r["run"]["output_tok_s"])
    for p in sorted(tree.glob("bench-*/*/*.json")):
        for row in json.loads(p.read_text()).get("rows", []):
            if "error" in row:
                continue
            key = f"{row['kernel']} {norm(row['problem'])} {row['dtype']}"
            for col in ("graph_us", "ours_us"):
                if row.get(col):
                    out.setdefault(f"{key} [{col}]", []).append(row[col])
    return out


def norm(label: str) -> str:
    return " ".join(t for t in label.split() if t not in ("rms=False", "window=None"))


def spread(vs: list) -> float:
    m = statistics.median(vs)
    return (max(vs) - min(vs)) / m if m and len(vs) > 1 else 0.0


def compare(out: Path) -> dict:
    before, after = tree_figures(out / "before"), tree_figures(out / "after")
    rows = []
    for k in sorted(set(before) & set(after)):
        b, a = statistics.median(before[k]), statistics.median(after[k])
        noise = max(spread(before[k]), spread(after[k]))
        ratio = a / b
        time_like = k.endswith("_us]")   # a time: above 1 is slower; a rate: below 1 is
        slower = ratio > 1 if time_like else ratio < 1
        moved = abs(ratio - 1) > max(0.05, 2 * noise)
        rows.append({"figure": k, "before": b, "after": a, "after_over_before": ratio, "noise": noise,
                     "rounds": [len(before[k]), len(after[k])], "flag": ("slower" if slower else "faster") if moved else ""})
    graph = [r["after_over_before"] for r in rows if r["figure"].endswith("[graph_us]")]
    summary = {"figures": len(rows), "flagged": sum(bool(r["flag"]) for r in rows),
               "bench_graph_geomean_after_over_before": math.exp(statistics.fmean(map(math.log, graph))) if graph else None,
               "only_before": sorted(set(before) - set(after)), "only_after": sorted(set(after) - set(before))}
    return {"summary": summary, "rows": rows}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python benchmarks/compare_trees.py OUT (the folder before_after.sh wrote)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    res = compare(out)
    from tabulate import tabulate

    print(tabulate([[r["figure"][:90], f"{r['before']:.2f}", f"{r['after']:.2f}", f"{r['after_over_before']:.3f}",
                     f"±{100 * r['noise']:.1f}%", r["flag"]] for r in res["rows"]],
                   headers=["figure", "before", "after", "after/before", "noise", ""]))
    print(json.dumps(res["summary"], indent=1))
    (out / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
