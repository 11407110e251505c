"""The open issues' benchmark targets, checked against the committed results (never typed by hand).

Each target names a GPU, a results file (kernel), the rows it covers (a subset of a row's problem
fields) and how the rows combine (each row, the minimum, or the geometric mean) against a threshold.
``tritune report`` renders the table at the top of the README's results; a target whose rows are missing
says so instead of passing.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

H100 = "nvidia-h100-80gb-hbm3"


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    kernel: str
    match: tuple          # ((field, value), ...) every covered row has
    metric: str           # a row key: vs_vendor, pct_copy_bw, ...
    combine: str          # "each" (the worst row is shown), "geomean"
    threshold: float
    also: tuple = ()      # alternative matches (rows covered by any of them)
    gpu: str = H100


def _gpt2(m_values, lm_head: bool = True):
    shapes = [("2304", "768", "True", "None", "False"), ("768", "768", "True", "None", "True"),
              ("3072", "768", "True", "gelu_tanh", "False"), ("768", "3072", "True", "None", "True")]
    out = []
    for m in m_values:
        for n, k, bias, act, res in shapes:
            out.append((("M", str(m)), ("N", n), ("K", k), ("bias", bias), ("act", act), ("residual", res)))
        if lm_head:
            out.append((("M", str(m)), ("N", "50257"), ("K", "768"), ("trans_b", "True")))
    return tuple(out)


def _pa(b, hq, hkv, d, ctx):
    return (("B", str(b)), ("Hq", str(hq)), ("Hkv", str(hkv)), ("D", str(d)), ("ctx", str(ctx)))


def _qm(m, bits):
    return (("M", str(m)), ("N", "28672"), ("K", "8192"), ("bits", str(bits)))


TARGETS = [
    Target(4, "GPT-2 linears at M >= 512, fused epilogue, geomean vs cuBLAS + torch epilogue", "gemm", (), "vs_vendor",
           "geomean", 1.0, also=_gpt2([512, 8192])),
    Target(4, "the same without the LM head (x @ wte.T, where cuBLAS is slow on the transposed operand)", "gemm", (),
           "vs_vendor", "geomean", 1.0, also=_gpt2([512, 8192], lm_head=False)),
    Target(4, "8192^3 plain vs cuBLAS", "gemm", (("M", "8192"), ("N", "8192"), ("K", "8192")), "vs_vendor", "each", 0.9),
    Target(4, "GPT-2 linears at M <= 64, each vs cuBLAS", "gemm", (), "vs_vendor", "each", 1.0,
           also=_gpt2([1, 8, 64])),
    Target(6, "large batch, % of copy bandwidth: B=128 Llama ctx 4096, B=256 GPT-2 ctx 1024", "paged_attention", (),
           "pct_copy_bw", "each", 85.0, also=(_pa(128, 32, 8, 128, 4096), _pa(256, 12, 12, 64, 1024))),
    Target(6, "B=64 GPT-2 ctx 1024 (the issue's SDPA reference point), % of copy bandwidth", "paged_attention",
           _pa(64, 12, 12, 64, 1024), "pct_copy_bw", "each", 85.0),
    Target(6, "B=1 Llama, ctx >= 4096, % of copy bandwidth", "paged_attention", (), "pct_copy_bw", "each", 50.0,
           also=tuple(_pa(1, 32, 8, 128, c) for c in (4096, 8192, 16384, 32768))),
    Target(7, "int4 M=1 on (8192, 28672) vs bf16 F.linear", "quant_matmul", _qm(1, 4), "vs_vendor", "each", 3.0),
    Target(7, "int4 M=16 on (8192, 28672) vs bf16 F.linear", "quant_matmul", _qm(16, 4), "vs_vendor", "each", 2.0),
    Target(7, "int8 M=1 on (8192, 28672) vs bf16 F.linear", "quant_matmul", _qm(1, 8), "vs_vendor", "each", 1.7),
    Target(7, "never slower than bf16 at M <= 64 on (8192, 28672)", "quant_matmul", (), "vs_vendor", "each", 1.0,
           also=tuple(_qm(m, b) for b in (4, 8) for m in (1, 16, 64))),
]


def parse_label(label: str) -> dict:
    """'M=1 N=2304 bias=True' -> {'M': '1', 'N': '2304', 'bias': 'True'}."""
    return dict(part.split("=", 1) for part in label.split() if "=" in part)


def _covers(fields: dict, match: tuple) -> bool:
    return all(fields.get(k) == v for k, v in match)


def evaluate(target: Target, rows: list[dict]) -> dict:
    """{'value', 'met', 'rows', 'worst'} for the target over the results rows (bf16 rows only)."""
    matches = target.also or (target.match,)
    picked = []
    for m in matches:
        hit = [r for r in rows if r.get("dtype") == "bfloat16" and _covers(parse_label(r.get("problem", "")), m)
               and isinstance(r.get(target.metric), (int, float))]
        if not hit:
            return {"value": None, "met": False, "rows": len(picked), "missing": " ".join(f"{k}={v}" for k, v in m)}
        picked.append(hit[-1])
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
