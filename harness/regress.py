"""The regression gate: ``tritune bench KERNEL... --compare BASELINE``.

BASELINE is a results file (``results/<gpu>/<kernel>.json``), a folder of them, or a git revision (its
committed results for this GPU). Each baseline row names a problem, a dtype and the config it ran. The
gate launches that config and the one tritune picks now (explicit store lookup, else the default; tuning
on a miss off) in interleaved rounds on this GPU, each timed by the tuner's own timer
(``tuning.timing``: CUDA-graph replay over input sets that rotate past L2 for short problems, do_bench's
flushed median for long ones; a do_bench median of a 5 µs kernel is mostly host time, and its spread
hid a 2x slowdown on an H200). Each round gives a ratio now / baseline; a row is slower when the median
ratio exceeds both a floor (``--min-slowdown``, 3%) and three times the rounds' own scatter of that ratio
(its median absolute deviation): run-to-run noise never fails it, a worse stored config does. What the
baseline row recorded (``ours_us``, maybe from another machine) is shown beside, never judged.
"""
from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Verdict:
    kernel: str
    problem: str
    dtype: str
    now_us: float
    base_us: float
    ratio: float        # now / base: above 1 is slower
    noise: float        # relative spread of the rounds
    slower: bool
    same_config: bool
    recorded_us: float | None


def load_baseline(source: str, slug: str, kernels: list[str]) -> dict[str, list[dict]]:
    """kernel -> baseline rows, from a file, a folder, or a git revision's ``results/<slug>/``."""
    p = Path(source)
    out: dict[str, list[dict]] = {}
    for k in kernels:
        if p.is_file():
            data = json.loads(p.read_text())
        elif p.is_dir():
            f = p / f"{k}.json" if (p / f"{k}.json").is_file() else p / slug / f"{k}.json"
            data = json.loads(f.read_text()) if f.is_file() else {"rows": []}
        else:
            r = subprocess.run(["git", "show", f"{source}:results/{slug}/{k}.json"], capture_output=True, text=True)
            if r.returncode != 0 and "exists on disk, but not in" not in r.stderr and "does not exist" not in r.stderr:
                raise ValueError(f"--compare: {source!r} is no results file, folder or git revision ({r.stderr.strip()})")
            data = json.loads(r.stdout) if r.returncode == 0 else {"rows": []}
        out[k] = [row for row in data.get("rows", []) if row.get("kernel") == k and row.get("config")]
    return out


def rounds_of(fns: list, rounds: int, mode: str) -> list[list[float]]:
    """Times (us) of each callable by the tuner's timer in ``mode``, interleaved round by round."""
    from tritune.tuning import timing

    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(1e3 * timing.time_ms(fn, mode))
    return times


def scatter(ratios: list[float]) -> float:
    """The median absolute deviation of the per-round ratios, relative to their median."""
    m = statistics.median(ratios)
    return statistics.median(abs(r - m) for r in ratios) / m if m else 0.0


def compare_row(spec, row: dict, problem, dtype, *, rounds: int, min_slowdown: float) -> Verdict:
    import functools

    import torch

    from tritune.kernels.runtime import device as dev
    from tritune.kernels.runtime.spec import set_tune_on_miss
    from tritune.tuning import timing

    base_cfg = dict(row["config"])
    with set_tune_on_miss(False):
        now_cfg = spec.config_for(problem, dtype)
    mode = timing.timing_mode(spec, problem, dtype)
    cases = timing.timing_cases(spec, problem, dtype, dev.device(), 0, mode)

    def launch(cfg):
        return timing.cycling(cases, lambda c: functools.partial(spec.run, *c.args, out=c.out, config=cfg,
                                                                  **c.kwargs))

    now, base = rounds_of([launch(now_cfg), launch(base_cfg)], max(3, rounds), mode)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ratios = [n / b for n, b in zip(now, base)]
    ratio, noise = statistics.median(ratios), scatter(ratios)
    return Verdict(spec.name, row["problem"], row["dtype"], statistics.median(now), statistics.median(base),
                   ratio, noise, ratio > 1 + max(min_slowdown, 3 * noise), now_cfg == base_cfg,
                   row.get("ours_us"))


def table(verdicts: list[Verdict]) -> str:
    from tabulate import tabulate

    rows = [[v.kernel, v.problem[:72], v.dtype, f"{v.base_us:.2f}", f"{v.now_us:.2f}", f"{v.ratio:.3f}x",
             f"±{100 * v.noise:.1f}%", "same" if v.same_config else "changed",
             "" if v.recorded_us is None else f"{v.recorded_us:.2f}", "SLOWER" if v.slower else ""]
            for v in verdicts]
    return tabulate(rows, headers=["kernel", "problem", "dtype", "baseline us", "now us", "now/base", "noise",
                                   "config", "recorded us", ""])
