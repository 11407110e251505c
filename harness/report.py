"""Tables (tabulate) from benchmark rows and results files.

``tritune report`` writes docs/results.md (every table, from results/<gpu-slug>/*.json and the tuned
store) and rewrites the README's headline table between its markers: nothing in either is typed by hand.
"""
from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from tritune.tuning.ledger import fmt as _fmt  # one number format for every table


def bench_table(rows: list[dict], fmt: str = "simple", regressed: dict | None = None) -> str:
    """``regressed``: (problem, dtype) -> :class:`Regression` of the rows to mark "↓"."""
    regressed = regressed or {}
    peers = sorted({k[:-3] for r in rows for k in r if k.endswith("_us") and not k.endswith("_graph_us")
                    and k not in ("ours_us", "vendor_us", "host_us", "graph_us")})
    graphs = [p for p in ["vendor"] + peers if any(f"vs_{p}_graph" in r for r in rows)]  # ratios in a CUDA graph
    headers = ["kernel", "problem", "dtype", "ours µs", "host µs", "GB/s", "TFLOP/s", "% roofline", "graph µs",
               "% roofline (graph)", "vendor µs", "vs vendor"]
    headers += [h for p in peers for h in (f"{p} µs", f"vs {p}")] + [f"vs {p} (graph)" for p in graphs]
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
        line += [_fmt(r.get(f"vs_{p}_graph"), 2) + ("x" if r.get(f"vs_{p}_graph") else "") for p in graphs]
        if not r.get("correct", True):
            line[3] += " (WRONG)"
        if (r.get("problem"), r.get("dtype")) in regressed:
            line[3] += " ↓"
        table.append(line)
    return tabulate(table, headers=headers, tablefmt=fmt, disable_numparse=True)


def is_bench(data: dict) -> bool:
    """Whether a results file holds kernel benchmark rows (``tritune profile``'s profile.json has rows too:
    one per profiled command)."""
    rows = data.get("rows")
    return isinstance(rows, list) and all(isinstance(r, dict) and "command" not in r for r in rows)


# ---------------------------------------------------------------------------------------------------
# Rows that regressed against the committed baseline
# ---------------------------------------------------------------------------------------------------
MIN_SLOWDOWN = 0.05   # a row is marked slower only beyond its recorded noise or this, whichever is larger


@dataclass(frozen=True)
class Regression:
    base_us: float
    now_us: float
    limit: float        # the relative slowdown allowed: max(recorded noise, MIN_SLOWDOWN)

    @property
    def slowdown(self) -> float:
        return self.now_us / self.base_us - 1


def _git(cwd: Path, *argv: str) -> str | None:
    """A git command's stdout in ``cwd``; None when git is missing or the command fails."""
    try:
        p = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def baseline_rows(path: Path, rev: str | None = None) -> tuple[str | None, list[dict] | None]:
    """(revision, rows) of a results file at the baseline revision: ``rev``, else the last commit that
    changed the file when the working copy differs from it (new results not yet committed), else the
    commit before that (``git log -n 2 --format=%h -- FILE``). (None, None) outside a git work tree, for a
    file the revision does not hold, or one without kernel rows there."""
    path = Path(path).resolve()
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if not top:
        return None, None
    top = Path(top.strip()).resolve()
    rel = path.relative_to(top).as_posix()
    if rev is None:
        revs = (_git(top, "log", "-n", "2", "--format=%h", "--", rel) or "").split()
        if revs and _git(top, "show", f"{revs[0]}:{rel}") != path.read_text():
            rev = revs[0]   # the working copy holds results not yet committed: the last commit is the baseline
        elif len(revs) == 2:
            rev = revs[1]
        else:
            return None, None
    text = _git(top, "show", f"{rev}:{rel}")
    try:
        data = json.loads(text) if text is not None else None
    except ValueError:
        return rev, None
    return rev, (data["rows"] if isinstance(data, dict) and is_bench(data) else None)


def _noise(row: dict) -> float:
    """A row's recorded relative noise (``noise``: the spread of its timing rounds), 0 when it has none."""
    v = row.get("noise")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else 0.0


def regressions(rows: list[dict], base: list[dict], min_slowdown: float = MIN_SLOWDOWN) -> dict:
    """(problem, dtype) -> :class:`Regression` for each row whose ``ours_us`` is slower than the same
    (problem, dtype) row of ``base`` by more than the larger of either row's recorded noise and
    ``min_slowdown``. Rows without a time on either side (errors, wrong answers) are not compared."""
    def timed(r):
        t = r.get("ours_us")
        return ("error" not in r and r.get("correct", True) and isinstance(t, (int, float)) and t > 0
                and math.isfinite(t))

    before = {(r.get("problem"), r.get("dtype")): r for r in base if isinstance(r, dict) and timed(r)}
    out = {}
    for r in rows:
        b = before.get((r.get("problem"), r.get("dtype")))
        if b is None or not timed(r):
            continue
        limit = max(_noise(r), _noise(b), min_slowdown)
        if r["ours_us"] > b["ours_us"] * (1 + limit):
            out[(r["problem"], r["dtype"])] = Regression(float(b["ours_us"]), float(r["ours_us"]), limit)
    return out


def regression_note(slower: dict, rev: str | None) -> str:
    """The footnote under a table with marked rows."""
    lines = [f"↓ slower than at `{rev}` (the baseline) by more than the row's recorded noise or "
             f"{100 * MIN_SLOWDOWN:.0f}%, whichever is larger:"]
    for (problem, dtype), g in sorted(slower.items(), key=lambda kv: -kv[1].slowdown):
        lines.append(f"- {problem} {dtype}: {_fmt(g.base_us)} → {_fmt(g.now_us)} µs "
                     f"(+{100 * g.slowdown:.1f}%, allowed {100 * g.limit:.0f}%)")
    return "\n".join(lines) + "\n"


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
        sp = r.get("spread") or {}   # --runs N: the median run, with the runs' range
        tok = _fmt(r.get("output_tok_s"), 0) + (f" ({_fmt(sp['output_tok_s_min'], 0)}-{_fmt(sp['output_tok_s_max'], 0)}, "
                                                 f"{sp['runs']} runs)" if sp else "")
        out.append([label, name, tok, _fmt(r.get("total_tok_s"), 0), _fmt(r.get("req_s")),
                    f"{q('ttft_ms', 'p50')} / {q('ttft_ms', 'p99')}", f"{q('tpot_ms', 'p50')} / {q('tpot_ms', 'p99')}",
                    _fmt(b1.get("decode_tok_s"), 0), r.get("peak_kv_blocks", "")])
    return out


def _sweep_rows(modes: dict) -> list:
    out = []
    for name, m in modes.items():
        for b, r in sorted((m.get("batch_sweep") or {}).items(), key=lambda kv: int(kv[0])):
            t = r.get("tpot_ms") or {}
            ttft = (r.get("ttft_ms") or {}).get("p50")
            out.append([name, b, r.get("requests", ""), _fmt(r.get("output_tok_s"), 0),
                        f"{_fmt(t.get('p50'), 2)} / {_fmt(t.get('p99'), 2)}", _fmt(ttft, 0)])
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
    sweep = _sweep_rows(d.get("modes", {}))
    if sweep:
        text += "\n\nBatch sweep (the first requests at each max batch):\n\n" + tabulate(
            sweep, headers=["mode", "max batch", "requests", "output tok/s", "TPOT p50/p99 ms", "TTFT p50 ms"],
            tablefmt=fmt, disable_numparse=True)
    if d.get("command"):
        text += f"\n\n`{d['command']}`"
    if d.get("note"):
        text += f"\n\n{d['note']}"
    return text


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
            from tritune.kernels.runtime import store

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


def _gpu_label(data: dict, slug: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'; the slug when the file does not name its GPU."""
    name = (data.get("environment") or {}).get("gpu") or data.get("gpu") or slug
    return name.replace("NVIDIA ", "").split()[0]


def _gpu_dirs(results_dir: Path) -> list[Path]:
    """GPU result folders (the interpreter's hold no times worth a headline)."""
    return [d for d in sorted(Path(results_dir).iterdir()) if d.is_dir() and d.name != "triton-interpreter"]


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _span(vals: list[float], fmt: str) -> str:
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if len(vals) == 1 or fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


_MODE = {"triton-graphs": "bf16", "triton-int4": "int4 weights", "triton-int8": "int8 weights"}


def headline_rows(results_dir: Path) -> tuple[list[str], list[list[str]]]:
    """One row per kernel: the vendor path and, per GPU, the geometric mean of ours-vs-vendor over the
    kernel's bf16 rows (their range) and the median % of the hardware limit (copy bandwidth or matmul peak,
    whichever bounds the problem; their range); then batch-1 decode and serving throughput."""
    gpus = _gpu_dirs(results_dir)
    labels, kernels = {}, {}
    for g in gpus:
        for path in sorted(g.glob("*.json")):
            data = _load(path)
            if isinstance(data, dict) and data.get("rows") and is_bench(data):
                labels.setdefault(g.name, _gpu_label(data, g.name))
                kernels.setdefault(path.stem, {})[g.name] = data["rows"]
            elif isinstance(data, dict):
                labels.setdefault(g.name, _gpu_label(data, g.name))
    head = ["kernel", "vendor path"]
    for g in gpus:
        head += [f"{labels.get(g.name, g.name)} vs vendor", f"{labels.get(g.name, g.name)} % of limit"]
    table = []
    for name, by_gpu in sorted(kernels.items()):
        vendors = [r.get("vendor") for rows in by_gpu.values() for r in rows if r.get("vendor")]
        line = [name, max(set(vendors), key=vendors.count) if vendors else "none"]
        for g in gpus:
            rows = [r for r in by_gpu.get(g.name, []) if r.get("dtype") == "bfloat16" and "error" not in r
                    and r.get("correct", True)]
            ratios = [r["vs_vendor"] for r in rows if isinstance(r.get("vs_vendor"), (int, float)) and r["vs_vendor"] > 0]
            pcts = [r["pct_roofline"] for r in rows if isinstance(r.get("pct_roofline"), (int, float))]
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
            line += [f"{geo:.2f}x ({_span(ratios, '{:.2f}')})" if ratios else "",
                     f"{statistics.median(pcts):.0f}% ({_span(pcts, '{:.0f}')})" if pcts else ""]
        table.append(line)
    decode, serve = ["GPT-2 small batch-1 decode, tok/s", ""], ["serving, output tok/s", ""]
    hf_rates = []
    for g in gpus:
        d, s = _load(g / "decode.json") or {}, _load(g / "serve.json") or {}
        d, s = (d if isinstance(d, dict) else {}), (s if isinstance(s, dict) else {})
        best = d.get("results", {}).get("engine") or d.get("results", {}).get("triton-graph") or {}
        decode += [_fmt(best.get("decode_tok_s"), 0), ""]
        out = {m: (v.get("run") or {}).get("output_tok_s") for m, v in s.get("modes", {}).items() if isinstance(v, dict)}
        serve += [", ".join(f"{_fmt(v, 0)} ({_MODE.get(m, m)})" for m, v in out.items() if v), ""]
        if s.get("workload"):
            serve[0] = f"serving {s['workload'].get('requests', '?')} requests, output tok/s"
        if (s.get("transformers") or {}).get("output_tok_s"):
            hf_rates.append(f"{_fmt(s['transformers']['output_tok_s'], 0)} ({labels.get(g.name, g.name)})")
    if hf_rates:
        serve[1] = "transformers, static batch: " + ", ".join(hf_rates)
    return head, table + [decode, serve]


def headline_table(results_dir: Path, fmt: str = "github") -> str:
    head, rows = headline_rows(Path(results_dir))
    return tabulate(rows, headers=head, tablefmt=fmt, disable_numparse=True)


def results_tables(results_dir: Path, fmt: str = "github", configs_dir: Path | None = None,
                   baseline: str | None = None) -> str:
    """Every results file's table, one section per GPU slug and file in a stable order; then the
    tuned-config store. A kernel table marks "↓" the rows slower than at the baseline revision
    (:func:`regressions`; ``baseline`` None: each file's previous commit), with a footnote."""
    parts = []
    for path in sorted(Path(results_dir).glob("*/*.json")):
        data = _load(path)
        if not isinstance(data, dict):
            continue
        if is_bench(data):
            env = data.get("environment", {})
            parts.append(f"### {path.parent.name} / {path.stem}  ({env.get('gpu', '?')}, triton {env.get('triton', '?')}, "
                         f"torch {env.get('torch', '?')}, {env.get('date', '?')[:10]})\n")
            rev, base = baseline_rows(path, baseline)
            slower = regressions(data["rows"], base) if base else {}
            parts.append(bench_table(data["rows"], fmt, slower) + "\n")
            if slower:
                parts.append(regression_note(slower, rev) + "\n")
        elif data.get("benchmark") == "gpt2 single-request decode":
            parts.append(f"### {path.parent.name} / {path.stem}: GPT-2 ({data.get('model', {}).get('n_layer', '?')} layers, "
                         f"{data.get('model', {}).get('weights', '')} weights) batch {data.get('batch')}, prompt "
                         f"{data.get('prompt_tokens')}, {data.get('new_tokens')} new tokens, {data.get('dtype')}, "
                         f"{data.get('date', '?')}\n")
            parts.append(_decode_table(data, fmt) + "\n")
        elif "modes" in data and "workload" in data:
            parts.append(f"### {path.parent.name} / {path.stem}: serving ({data.get('model', '')}, {data.get('dtype', '')})\n")
            parts.append(_serve_table(data, fmt) + "\n")
        elif "experiments" in data:
            env = data.get("environment", {})
            parts.append(f"### {path.parent.name} / {path.stem}: search efficiency ({env.get('gpu', '?')})\n")
            parts.append(_efficiency_table(data, fmt) + "\n")
    if configs_dir is None:
        from tritune.kernels.runtime import store

        configs_dir = store.PACKAGE_CONFIGS
    if Path(configs_dir).is_dir():
        parts.append("### Tuned configs in the store (`tuning/configs/`): tuned vs heuristic default, timed in the sweep\n")
        parts.append(tuning_table(Path(configs_dir), fmt) + "\n")
    return "\n".join(parts)


RESULTS_INTRO = """# Results

Generated by `tritune report` from `results/<gpu-slug>/*.json` and `tuning/configs/`; never edit by hand.
How each number is taken, and how far to trust it: [measuring.md](measuring.md).

Columns of the kernel tables: `ours µs` is the median of `triton.testing.do_bench` (L2 flushed before each
call, warm-up excluded, inputs rotated when they fit in L2): the number the ratios use. `host µs` is the
launcher's CPU time per call. `graph µs` is the GPU time of the same rotating calls replayed from a CUDA
graph (no host time, no write-back of the flush's dirty lines), as the engine runs its decode step.
`% roofline` is against the copy bandwidth or the matmul peak measured on that GPU, whichever bounds the
problem. `vendor` is the path PyTorch takes by default (named in each file's rows); peers have their own
columns. Rows under 100 µs are timed in alternating rounds (`rounds` in the JSON); rows measured before a
column existed leave it blank.

## Headline (bf16)

Per kernel and GPU: the geometric mean of ours vs the vendor path over the kernel's rows (their range),
and the median % of the hardware limit (their range).

"""


def write_results_md(results_dir: Path, path: Path, baseline: str | None = None) -> bool:
    """docs/results.md: the headline table, then every table (rows slower than at ``baseline``, default
    each file's previous commit, marked "↓"). True when the file changed."""
    path = Path(path)
    text = (RESULTS_INTRO + headline_table(results_dir) + _plots_section(results_dir, path.parent / "img")
            + "\n\n## All results\n\n" + results_tables(results_dir, baseline=baseline))
    old = path.read_text() if path.exists() else None
    if old != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return old != text


def _plots_section(results_dir: Path, img_dir: Path) -> str:
    """Rooflines per GPU (tritune.harness.plot), embedded as images beside docs/results.md. matplotlib is the
    ``plot`` extra: without it the section says how to get the pictures instead."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "\n\n## Rooflines\n\n(`pip install \"tritune[plot]\"` and re-run `tritune report` for the pictures.)\n"
    from tritune.harness import plot

    paths = plot.render_all(results_dir, img_dir)
    counters = plot.render_counters(results_dir, img_dir)
    lines = []
    if paths:
        lines += ["", "", "## Rooflines", "",
                  "Each kernel's rows against the measured copy bandwidth and matmul peak (`tritune plot` draws "
                  "them; `tritune plot --storage URL` adds a study's optimization history and parameter "
                  "importances, and `optuna-dashboard URL` browses the same studies).", ""]
        lines += [f"![{p.stem}](img/{p.name})" for p in paths]
    if counters:
        lines += ["", "", "## Nsight Compute counters", "",
                  "Per tritune kernel of each command `tritune profile --ncu` profiled (results/<gpu>/profile.json): "
                  "DRAM throughput, SM and tensor-pipe use, achieved occupancy (% of peak), registers per thread "
                  "and shared memory per CTA.", ""]
        lines += [f"![{p.stem}](img/{p.name})" for p in counters]
    return "\n".join(lines) + "\n" if lines else ""


BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"


def update_readme(readme: Path, results_dir: Path) -> bool:
    """Replace the text between the README's headline markers with the headline table. True when changed."""
    text = Path(readme).read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme}: no {BEGIN} ... {END} markers")
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END),
                 lambda m: f"{BEGIN}\n{headline_table(results_dir)}\n{END}", text, flags=re.S)
    Path(readme).write_text(new)
    return new != text


def add_arguments(s) -> None:
    s.add_argument("--results-dir", default="results", help="where the JSON is (default: ./results)")
    s.add_argument("--docs", default="docs/results.md", help="the full tables go here (default: docs/results.md)")
    s.add_argument("--readme", default="README.md",
                   help="its headline table (between the headline markers) is rewritten; skipped when the file "
                        "does not exist (default: README.md)")
    s.add_argument("--print", action="store_true", dest="print_only", help="print every table; write nothing")
    s.add_argument("--baseline", default=None, metavar="REV",
                   help="mark (↓) kernel rows slower than in the same results file at git revision REV by more "
                        "than their recorded noise or 5%% (default: each file's previous commit)")


def run(args) -> int:
    results = Path(args.results_dir)
    if not results.is_dir():
        print(f"error: --results-dir {results}: no such folder (run from the repository, or name it)", file=sys.stderr)
        return 2
    baseline = getattr(args, "baseline", None)
    if baseline is not None and not _git(results, "rev-parse", "--verify", "--quiet", f"{baseline}^{{commit}}"):
        print(f"error: --baseline {baseline}: not a commit of the git repository holding {results}", file=sys.stderr)
        return 2
    if args.print_only:
        print(headline_table(results) + "\n\n" + results_tables(results, baseline=baseline))
        return 0
    changed = write_results_md(results, Path(args.docs), baseline=baseline)
    print(f"{args.docs}: {'updated' if changed else 'unchanged'}")
    readme = Path(args.readme)
    if readme.exists():
        try:
            changed = update_readme(readme, results)
        except ValueError as e:
            print(f"error: --readme {e}", file=sys.stderr)
            return 2
        print(f"{readme}: {'updated' if changed else 'unchanged'}")
    else:
        print(f"{readme}: not found, skipped")
    return 0
