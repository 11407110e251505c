"""Tables (tabulate) from benchmark rows and results files; README tables regenerated from JSON."""
from __future__ import annotations

import json
import re
from pathlib import Path

from tabulate import tabulate


def _fmt(v, digits=1):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def bench_table(rows: list[dict], fmt: str = "simple") -> str:
    peers = sorted({k[:-3] for r in rows for k in r if k.endswith("_us") and k not in ("ours_us", "vendor_us")})
    headers = ["kernel", "problem", "dtype", "ours µs", "GB/s", "TFLOP/s", "% roofline", "vendor µs", "vs vendor"]
    headers += [h for p in peers for h in (f"{p} µs", f"vs {p}")]
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["kernel"], r["problem"], r["dtype"], "error: " + r["error"][:60]] + [""] * (len(headers) - 4))
            continue
        line = [r["kernel"], r["problem"], r["dtype"], _fmt(r.get("ours_us")), _fmt(r.get("gbps"), 0),
                _fmt(r.get("tflops"), 1), _fmt(r.get("pct_roofline"), 0),
                _fmt(r.get("vendor_us")), _fmt(r.get("vs_vendor"), 2) + ("x" if r.get("vs_vendor") else "")]
        for p in peers:
            line += [_fmt(r.get(f"{p}_us")), _fmt(r.get(f"vs_{p}"), 2) + ("x" if r.get(f"vs_{p}") else "")]
        if not r.get("correct", True):
            line[3] += " (WRONG)"
        table.append(line)
    return tabulate(table, headers=headers, tablefmt=fmt, disable_numparse=True)


def results_tables(results_dir: Path, fmt: str = "github") -> str:
    """One section per GPU slug and results file, in a stable order."""
    parts = []
    for path in sorted(Path(results_dir).glob("*/*.json")):
        data = json.loads(path.read_text())
        if "rows" not in data:
            continue
        env = data.get("environment", {})
        parts.append(f"#### {path.parent.name} / {path.stem}  ({env.get('gpu', '?')}, triton {env.get('triton', '?')}, "
                     f"torch {env.get('torch', '?')}, {env.get('date', '?')[:10]})\n")
        parts.append(bench_table(data["rows"], fmt) + "\n")
    return "\n".join(parts)


def update_readme(readme: Path, results_dir: Path) -> bool:
    """Replace the text between the results markers of the README with tables from the JSON."""
    text = readme.read_text()
    begin, end = "<!-- results:begin -->", "<!-- results:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"{readme}: no {begin} ... {end} markers")
    new = re.sub(re.escape(begin) + ".*?" + re.escape(end),
                 lambda m: f"{begin}\n{results_tables(results_dir)}\n{end}", text, flags=re.S)
    readme.write_text(new)
    return new != text
