"""``tritune plot``: PNG pictures with matplotlib (the ``plot`` extra).

- A roofline per GPU from ``results/<gpu-slug>/<kernel>.json``: every benchmark row at its arithmetic
  intensity (FLOP per byte of the fewest bytes moved) and achieved TFLOP/s, under the measured ceilings
  recorded with the rows (copy bandwidth, matmul peak per dtype), and beside it each kernel's achieved
  bandwidth against the copy bandwidth.
- The Nsight Compute counters ``tritune profile --ncu`` wrote into ``results/<gpu-slug>/profile.json``: one
  bar chart per profiled command (DRAM, SM, tensor-pipe, occupancy % per tritune kernel; registers and
  shared memory per CTA).
- A tuning study's history from an Optuna storage: Optuna's own matplotlib views (optimization history,
  parameter importances).

:func:`render_all` and :func:`render_counters` are what ``tritune report`` calls to embed the pictures in
docs/results.md.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

_MARKERS = {"bfloat16": "o", "float16": "s", "float32": "^", "int4": "D"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("tritune plot needs matplotlib: pip install 'tritune[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    return plt


def load_rows(gpu_dir: Path) -> tuple[list[dict], dict, str]:
    """The benchmark rows of one GPU's results folder, its measured ceilings and the GPU's name."""
    rows, ceilings, gpu = [], {}, gpu_dir.name
    for path in sorted(gpu_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue  # decode, serve, studies: not kernel rows
        env = data.get("environment") or {}
        ceilings = env.get("ceilings") or ceilings
        gpu = env.get("gpu") or gpu
        rows += [r for r in data["rows"] if r.get("tflops") and r.get("gbps") and "error" not in r]
    return rows, ceilings, gpu


def roofline(gpu_dir: Path, out: Path) -> Path | None:
    """One PNG for one GPU (None when the folder has no kernel rows)."""
    rows, ceil, gpu = load_rows(gpu_dir)
    if not rows:
        return None
    plt = _pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [3, 2]})
    kernels = sorted({r["kernel"] for r in rows})
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # gray is for the dtype key
    colors = {k: palette[i % len(palette)] for i, k in enumerate(kernels)}

    ai = [r["tflops"] * 1e3 / r["gbps"] for r in rows]  # FLOP per byte
    lo, hi = min(ai) / 2, max(ai) * 2
    bw = ceil.get("copy_bytes_per_s")
    peaks = {k.rsplit("_", 1)[-1]: v for k, v in ceil.items() if k.startswith("matmul_flops_per_s_")}
    if bw:
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        top = max(peaks.values()) if peaks else float("inf")
        ax.plot(xs, [min(x * bw, top) / 1e12 for x in xs], color="black", lw=1.5,
                label=f"copy bandwidth {bw / 1e12:.2f} TB/s")
        last = None
        for name, peak in sorted(peaks.items(), key=lambda kv: -kv[1]):
            knee = peak / bw
            ax.hlines(peak / 1e12, max(knee, lo), hi, colors="gray", linestyles="--", lw=1)
            near = last is not None and last / peak < 1.25  # two peaks close together: labels above and below
            ax.text(hi, peak / 1e12, f" {name} matmul {peak / 1e12:.0f} TFLOP/s", fontsize=8,
                    va="top" if near else "bottom")
            last = peak
    for r, x in zip(rows, ai):
        ax.scatter(x, r["tflops"], color=colors[r["kernel"]], marker=_MARKERS.get(r.get("dtype"), "o"), s=28,
                   alpha=0.8, edgecolors="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved, fewest bytes)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"{gpu}: roofline of every benchmark row")
    ax.grid(True, which="both", alpha=0.25)
    handles = [plt.Line2D([], [], color=colors[k], marker="o", ls="", label=k) for k in kernels]
    handles += [plt.Line2D([], [], color="gray", marker=m, ls="", label=d, mfc="none") for d, m in _MARKERS.items()
                if any(r.get("dtype") == d for r in rows)]
    if bw:
        handles.insert(0, ax.get_lines()[0])
    ax.legend(handles=handles, fontsize=8, loc="upper left")

    # the memory-bound view: achieved bandwidth of each row, per kernel, against the copy bandwidth
    for i, k in enumerate(kernels):
        ys = [r["gbps"] / 1e3 for r in rows if r["kernel"] == k]
        bx.scatter([i + (j % 7 - 3) * 0.05 for j in range(len(ys))], ys, color=colors[k], s=22, alpha=0.8)
    if bw:
        bx.axhline(bw / 1e12, color="black", lw=1.5)
        bx.text(len(kernels) - 0.5, bw / 1e12, "copy bandwidth", ha="right", va="bottom", fontsize=8)
    bx.set_xticks(range(len(kernels)))
    bx.set_xticklabels(kernels, rotation=30, ha="right")
    bx.set_ylabel("achieved TB/s (fewest bytes / time)")
    bx.set_ylim(bottom=0)
    bx.set_title("bandwidth per kernel")
    bx.grid(True, axis="y", alpha=0.25)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def render_all(results_dir, out_dir) -> list[Path]:
    """A roofline PNG per GPU folder of ``results_dir`` that has kernel rows: ``out_dir/roofline-<slug>.png``."""
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    paths = []
    for gpu_dir in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        p = roofline(gpu_dir, out_dir / f"roofline-{gpu_dir.name}.png")
        if p is not None:
            paths.append(p)
    return paths


# ---------------------------------------------------------------------------------------------------
# Nsight Compute counters of `tritune profile --ncu` (results/<gpu>/profile.json)
# ---------------------------------------------------------------------------------------------------
COUNTERS = (("dram_pct", "DRAM throughput"), ("sm_pct", "SM throughput"), ("tensor_pct", "tensor pipe"),
            ("occupancy_pct", "achieved occupancy"))


def profile_rows(gpu_dir: Path) -> list[dict]:
    """The rows of a GPU folder's profile.json that hold Nsight Compute counters (one per profiled command)."""
    try:
        data = json.loads((Path(gpu_dir) / "profile.json").read_text())
    except (OSError, ValueError):
        return []
    rows = data.get("rows") if isinstance(data, dict) else None
    return [r for r in rows or [] if isinstance(r, dict) and r.get("command") and isinstance(r.get("ncu"), list)
            and any(isinstance(k, dict) and k.get("kernel") for k in r["ncu"])]


def file_stem(text: str, limit: int = 60) -> str:
    """A file name part from free text (a command line): letters, digits, '-', '_', '.', '='."""
    stem = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in text).strip("_")
    while "__" in stem:
        stem = stem.replace("__", "_")
    return stem[:limit] or "command"


def counters_chart(row: dict, out: Path, gpu: str = "") -> Path:
    """One PNG for one profiled command: per tritune kernel, its four utilisation counters (% of peak) as
    grouped bars, and beside them registers per thread and shared memory per CTA."""
    plt = _pyplot()
    ks = [k for k in row["ncu"] if isinstance(k, dict) and k.get("kernel")]
    names = [k["kernel"] if len(k["kernel"]) <= 40 else k["kernel"][:37] + "..." for k in ks]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 2.0 + 0.9 * len(ks)),
                                 gridspec_kw={"width_ratios": [3, 2]}, sharey=True)
    h = 0.8 / len(COUNTERS)
    for j, (key, label) in enumerate(COUNTERS):
        ys = [i - 0.4 + h * (j + 0.5) for i in range(len(ks))]
        vals = [k.get(key) if isinstance(k.get(key), (int, float)) else None for k in ks]
        ax.barh(ys, [v or 0.0 for v in vals], height=h, label=label)
        for y, v in zip(ys, vals):   # a counter ncu did not report is said so, not drawn as zero
            ax.text((v or 0.0) + 0.5, y, "n/a" if v is None else f"{v:.0f}", va="center", fontsize=7)
    ax.set_yticks(range(len(ks)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 110)
    ax.set_xlabel("% of peak")
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(COUNTERS), frameon=False)
    ax.grid(True, axis="x", alpha=0.25)
    regs = [float(k.get("registers") or 0.0) for k in ks]
    smem = [(float(k.get("smem_dynamic") or 0.0) + float(k.get("smem_static") or 0.0)) / 1024 for k in ks]
    bx.barh(range(len(ks)), regs, height=0.6, color="gray")
    for i, (r, m) in enumerate(zip(regs, smem)):
        bx.text(r + 1, i, f"{r:.0f} regs, {m:.1f} KiB smem, {int(ks[i].get('launches') or 0)} launches",
                va="center", fontsize=7)
    bx.set_xlim(0, max(regs + [1.0]) * 1.9)
    bx.set_xlabel("registers per thread (shared memory per CTA beside)")
    bx.grid(True, axis="x", alpha=0.25)
    cmd = row["command"] if len(row["command"]) <= 90 else row["command"][:87] + "..."
    fig.suptitle(f"{gpu or row.get('gpu', '')}: Nsight Compute counters of `tritune {cmd}`"
                 + (f" ({row['date']})" if row.get("date") else ""), fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def render_counters(results_dir, out_dir) -> list[Path]:
    """A counters PNG per profiled command of each GPU folder: ``out_dir/ncu-<slug>-<command>.png``."""
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    paths = []
    for gpu_dir in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        for row in profile_rows(gpu_dir):
            out = out_dir / f"ncu-{gpu_dir.name}-{file_stem(row['command'])}.png"
            paths.append(counters_chart(row, out, row.get("gpu") or gpu_dir.name))
    return paths


def study_plots(storage, out_dir, names: list[str] | None = None) -> list[Path]:
    """Optimization history and parameter importances of each study in ``storage`` whose name contains one
    of ``names`` (all when empty) and that has at least two completed trials."""
    import optuna
    from optuna.visualization import matplotlib as ov

    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from tritune.tuning import search

    store = search.open_storage(storage)
    summaries = optuna.get_all_study_summaries(store, include_best_trial=False)
    paths = []
    for s in sorted(summaries, key=lambda s: s.study_name):
        if names and not any(n in s.study_name for n in names):
            continue
        study = optuna.load_study(study_name=s.study_name, storage=store)
        done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
        if len(done) < 2:
            continue
        stem = "".join(c if c.isalnum() or c in "-_=." else "_" for c in s.study_name)
        for what, draw in (("history", ov.plot_optimization_history), ("importances", ov.plot_param_importances)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    ax = draw(study)
            except (ValueError, RuntimeError) as e:  # e.g. importances of a single-valued space
                print(f"plot: {s.study_name}: no {what}: {e}", file=sys.stderr)
                plt.close("all")
                continue
            fig = ax.figure
            fig.set_size_inches(9, 5)
            if what == "history":
                ax.set_ylabel("trial time (µs, verified configs)")
            ax.set_title(f"{s.study_name}: {what}", fontsize=9)
            fig.tight_layout()
            path = out_dir / f"study-{stem}-{what}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


def add_arguments(s) -> None:
    s.add_argument("--results-dir", default="results", help="benchmark results, one folder per GPU "
                                                            "(default: ./results)")
    s.add_argument("--out", default="docs/img", help="where the PNGs go (default: docs/img)")
    s.add_argument("--storage", default=None, help="also plot tuning studies from this Optuna storage (a journal "
                                                   "file or an RDB URL, as for tune)")
    s.add_argument("--study", action="append", default=[], metavar="TEXT",
                   help="only studies whose name contains TEXT (repeatable; with --storage)")


def run(args) -> int:
    from tritune.kernels.runtime.args import UsageError, writable_dir

    try:
        out = writable_dir(args.out)
    except Exception as e:
        raise UsageError(f"--out: {e}") from None
    results = Path(args.results_dir)
    if not results.is_dir():
        raise UsageError(f"--results-dir {args.results_dir!r}: no such folder")
    try:
        _pyplot()
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    paths = render_all(results, out) + render_counters(results, out)
    if args.storage:
        if "://" not in args.storage and not Path(args.storage).is_file():
            raise UsageError(f"--storage {args.storage!r}: no such file")
        paths += study_plots(args.storage, out, args.study)
    for p in paths:
        print(f"wrote {p}")
    if not paths:
        print(f"plot: nothing to draw (no kernel rows or profiled counters under {results}"
              + (", no study with two completed trials" if args.storage else "") + ")", file=sys.stderr)
    return 0
