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
    peers = sorted({k[:-3] for r in rows for k in r if k.endswith("_us") and k not in ("ours_us", "vendor_us", "host_us", "graph_us")})
    headers = ["kernel", "problem", "dtype", "ours µs", "host µs", "GB/s", "TFLOP/s", "% roofline", "graph µs",
               "% roofline (graph)", "vendor µs", "vs vendor"]
    headers += [h for p in peers for h in (f"{p} µs", f"vs {p}")]
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["kernel"], r["problem"], r["dtype"], "error: " + r["error"][:60]] + [""] * (len(headers) - 4))
            continue
        line = [r["kernel"], r["problem"], r["dtype"], _fmt(r.get("ours_us")), _fmt(r.get("host_us"), 0), _fmt(r.get("gbps"), 0),
                _fmt(r.get("tflops"), 1), _fmt(r.get("pct_roofline"), 0), _fmt(r.get("graph_us")),
                _fmt(r.get("pct_roofline_graph"), 0), _fmt(r.get("vendor_us")), _fmt(r.get("vs_vendor"), 2) + ("x" if r.get("vs_vendor") else "")]
        for p in peers:
            line += [_fmt(r.get(f"{p}_us")), _fmt(r.get(f"vs_{p}"), 2) + ("x" if r.get(f"vs_{p}") else "")]
        if not r.get("correct", True):
            line[3] += " (WRONG)"
        table.append(line)
    return tabulate(table, headers=headers, tablefmt=fmt, disable_numparse=True)


def _decode_table(d: dict, fmt: str) -> str:
    rows = [[name, _fmt(r.get("decode_tok_s")), _fmt(r.get("prefill_ms")), r.get("same_tokens_as_transformers", "")]
            for name, r in d.get("results", {}).items()]
    return tabulate(rows, headers=["method", "decode tok/s", "prefill ms", "greedy tokens equal to transformers"],
                    tablefmt=fmt, disable_numparse=True)


def _serve_rows(modes: dict, label: str) -> list:
    out = []
    for name, m in modes.items():
        if "error" in m:
            out.append([label, name, "error: " + m["error"][:70]] + [""] * 6)
            continue
        r, b1 = m.get("run", {}), m.get("batch1_decode", {})
        q = lambda k, p: _fmt((r.get(k) or {}).get(p))  # noqa: E731
        out.append([label, name, _fmt(r.get("output_tok_s"), 0), _fmt(r.get("total_tok_s"), 0), _fmt(r.get("req_s")),
                    f"{q('ttft_ms', 'p50')} / {q('ttft_ms', 'p99')}", f"{q('tpot_ms', 'p50')} / {q('tpot_ms', 'p99')}",
                    _fmt(b1.get("decode_tok_s"), 0), r.get("peak_kv_blocks", "")])
    return out


def _serve_table(d: dict, fmt: str) -> str:
    runs = [("", d)] + [(k, v) for k, v in d.items() if isinstance(v, dict) and "modes" in v]
    rows = []
    for label, run in runs:
        w = run.get("workload", {})
        tag = label or f"{w.get('requests', '?')} requests"
        rows += _serve_rows(run.get("modes", {}), tag)
        hf, nv = run.get("transformers") or {}, run.get("naive") or {}
        if hf:
            rows.append([tag, f"transformers (static batch {hf.get('batch_size', '?')})", _fmt(hf.get("output_tok_s"), 0)] + [""] * 6)
        if nv:
            rows.append([tag, "naive (no KV cache, 1 request)", _fmt(nv.get("output_tok_s"), 1)] + [""] * 6)
    head = ["run", "mode", "output tok/s", "total tok/s", "req/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
            "batch-1 decode tok/s", "peak KV blocks"]
    text = tabulate(rows, headers=head, tablefmt=fmt, disable_numparse=True)
    if d.get("command"):
        text += f"\n\n`{d['command']}`"
    if d.get("note"):
        text += f"\n\n{d['note']}"
    return text


def _probe_table(rows: list, fmt: str) -> str:
    """scripts/flush_probe.py, probe_variants.py, probe_s7.py: each path timed after do_bench's zero-fill
    flush, after a flush that leaves L2 clean, and replayed in a CUDA graph (GB/s where the probe gave it:
    the copy and read ladders)."""
    rows = [r for r in rows if "who" in r]
    gbps = any("zero_gbps" in r for r in rows)
    table = [[r["kernel"], r["problem"], r["who"], _fmt(r.get("zero_us")), _fmt(r.get("clean_us")),
              _fmt(r.get("graph_us"))]
             + ([_fmt(r.get("zero_gbps"), 0), _fmt(r.get("graph_gbps"), 0)] if gbps else [])
             + [r.get("error", "")] for r in rows]
    headers = ["kernel", "problem", "path", "do_bench µs (zero-fill flush)", "do_bench µs (clean flush)", "graph µs"]
    headers += ["GB/s (do_bench)", "GB/s (graph)"] if gbps else []
    return tabulate(table, headers=headers + ["error"], tablefmt=fmt)


def _efficiency_table(d: dict, fmt: str) -> str:
    rows = [[e["kernel"], e["problem"], e["dtype"], e["n_valid"], _fmt(e["grid_best_us"]),
             f"{e['tpe']['median']} ({100 * e['tpe']['median_fraction_of_grid']:.0f}%)",
             f"{e['random']['median']} ({100 * e['random']['median_fraction_of_grid']:.0f}%)"]
            for e in d.get("experiments", [])]
    return tabulate(rows, headers=["kernel", "problem", "dtype", "grid (valid points)", "grid best µs",
                                   f"TPE trials to {100 * d.get('threshold', 0.03):.0f}% (median)",
                                   "random trials (median)"], tablefmt=fmt, disable_numparse=True)


def tuning_table(configs_dir: Path, fmt: str = "github") -> str:
    """Tuned vs default per kernel and GPU, from the committed store."""
    import math

    rows = []
    for path in sorted(Path(configs_dir).glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        ent = [e for e in data.get("entries", []) if e.get("time_us") and e.get("default_us")]
        if not ent:
            continue
        sp = [e["default_us"] / e["time_us"] for e in ent]
        try:
            from tritune.tuning import store

            n_stale = len(store.stale(data.get("kernel", path.stem), data.get("entries", [])))
        except ImportError:
            n_stale = 0
        rows.append([path.parent.name, data.get("kernel", path.stem), len(data.get("entries", [])),
                     f"{math.exp(sum(map(math.log, sp)) / len(sp)):.3f}x", f"{max(sp):.2f}x",
                     sum(e.get("trials", 0) for e in ent), data.get("triton", ""), data.get("date", ""),
                     n_stale or "", data.get("note", "")])
    return tabulate(rows, headers=["GPU", "kernel", "buckets", "tuned vs default (geomean)", "best bucket",
                                   "trials", "triton", "date", "stale (kernel changed since; skipped)", "note"],
                    tablefmt=fmt, disable_numparse=True)


def results_tables(results_dir: Path, fmt: str = "github", configs_dir: Path | None = None) -> str:
    """The open issues' targets against the results; one section per GPU slug and results file, in a
    stable order; then the tuned-config store."""
    from tritune.harness import targets

    parts = ["#### The open issues' targets, from the rows below (`harness/targets.py`)\n",
             targets.table(Path(results_dir), fmt) + "\n"]
    for path in sorted(Path(results_dir).glob("*/*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        if "rows" in data and data["rows"] and "who" in data["rows"][0]:  # flush_probe.py, probe_variants.py
            parts.append(f"#### {path.parent.name} / {path.stem}: timed after do_bench's zero-fill flush, after a "
                         f"clean flush, in a CUDA graph ({data.get('gpu', '?')})\n")
            if data.get("note"):
                parts.append(data["note"] + "\n")
            parts.append(_probe_table(data["rows"], fmt) + "\n")
        elif "rows" in data:
            env = data.get("environment", {})
            parts.append(f"#### {path.parent.name} / {path.stem}  ({env.get('gpu', '?')}, triton {env.get('triton', '?')}, "
                         f"torch {env.get('torch', '?')}, {env.get('date', '?')[:10]})\n")
            parts.append(bench_table(data["rows"], fmt) + "\n")
        elif data.get("benchmark") == "gpt2 single-request decode":
            parts.append(f"#### {path.parent.name} / {path.stem}: GPT-2 ({data.get('model', {}).get('n_layer', '?')} layers, "
                         f"{data.get('model', {}).get('weights', '')} weights) batch {data.get('batch')}, prompt "
                         f"{data.get('prompt_tokens')}, {data.get('new_tokens')} new tokens, {data.get('dtype')}\n")
            parts.append(_decode_table(data, fmt) + "\n")
        elif "modes" in data and "workload" in data:
            parts.append(f"#### {path.parent.name} / {path.stem}: serving ({data.get('model', '')}, {data.get('dtype', '')})\n")
            parts.append(_serve_table(data, fmt) + "\n")
        elif "experiments" in data:
            env = data.get("environment", {})
            parts.append(f"#### {path.parent.name} / {path.stem}: search efficiency ({env.get('gpu', '?')})\n")
            parts.append(_efficiency_table(data, fmt) + "\n")
    if configs_dir is None:
        from tritune.tuning import store

        configs_dir = store.PACKAGE_CONFIGS
    if Path(configs_dir).is_dir():
        parts.append("#### Tuned configs in the store (`tuning/configs/`): tuned vs heuristic default, timed in the sweep\n")
        parts.append(tuning_table(Path(configs_dir), fmt) + "\n")
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
