"""The roofline, timing rounds against peers, and the per-kernel benchmark loop.

The timers themselves (do_bench's median, CUDA-graph replay, rotating input sets) are tuning's
(:mod:`tritune.tuning.timing`): a benchmark row and a tuning trial measure one quantity.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import torch

from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.tuning.timing import (cycling, environment, graph_ms, median_ms, problem_label, rotation,
                                   source_commit)


def roofline(cost, dtype: torch.dtype, ms: float) -> dict:
    """Achieved rates and % of the floor set by measured ceilings (max of compute and memory time)."""
    s = ms * 1e-3
    out = {"gbps": cost.bytes / s / 1e9, "tflops": cost.flops / s / 1e12}
    c = dev.ceilings()
    if not c:
        return out
    bw = c["copy_bytes_per_s"]
    peak = c.get(f"matmul_flops_per_s_{str(dtype).split('.')[-1]}", c["matmul_flops_per_s_bfloat16"])
    floor = max(cost.bytes / bw, cost.flops / peak)
    out["pct_roofline"] = 100.0 * floor / s
    out["pct_copy_bw"] = 100.0 * (cost.bytes / s) / bw
    out["bound"] = "memory" if cost.bytes / bw >= cost.flops / peak else "compute"
    return out


# Short problems (median under SHORT_MS) are timed in ROUNDS_SHORT alternating rounds (ours, the vendor,
# each peer, then again), each path's time the median of its rounds: a one-off (a slow host moment, a clock
# step) in one path's single do_bench moved a 9 µs row by 30% (H100, gemm M=1: 12.1 against 9.1 µs in
# the call before), and at that size such noise decides a ratio. Five rounds: do_bench's median of a ~9 µs
# kernel is bimodal between calls (H100: 8.5-8.7 or 9.1-9.3 µs, cuBLAS and ours alike), so
# three rounds could take two from the slow mode for one path and two from the fast for the other.
SHORT_MS = 0.1
ROUNDS_SHORT = 5


def time_rounds(paths: dict) -> tuple[dict, int]:
    """{name: fn} -> ({name: median ms over the rounds, or the error text}, rounds). The first path (ours)
    decides the number of rounds: ROUNDS_SHORT when its first time is under SHORT_MS (GPU only), else
    one. An error in the first path propagates; another path's error is its entry."""
    import statistics

    times: dict = {k: [] for k in paths}
    errors: dict = {}
    rounds, r = 1, 0
    first = next(iter(paths))
    while r < rounds:
        for name, fn in paths.items():
            if name in errors:
                continue
            try:
                times[name].append(median_ms(fn))
            except Exception as e:
                if name == first:
                    raise
                errors[name] = f"{type(e).__name__}: {e}"[:200]
        if r == 0 and not dev.interpreted() and times[first][0] < SHORT_MS:
            rounds = ROUNDS_SHORT
        r += 1
    out = {k: statistics.median(v) for k, v in times.items() if v and k not in errors}
    out.update(errors)
    return out, rounds


def peer_calls(spec, cases) -> tuple[dict, dict]:
    """({peer name: a function cycling through its calls on ``cases``}, {peer name: why it could not be
    set up}). A peer that answers None for a case (it does not support it) is left out silently."""
    calls, errors = {}, {}
    for name, peer in spec.peers.items():
        try:
            fns = [peer(c) for c in cases]
            if all(f is not None for f in fns):
                calls[name] = cycling(fns, lambda f: f)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:200]
    return calls, errors


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host (CPU) microseconds per call of ``fn``: launches are queued without synchronising, so this is
    the launcher's own cost. do_bench hides host time only up to its L2 flush (~85 µs of GPU time on an
    H100, less do_bench's own ~19 µs per iteration): a launcher slower than that is timed as GPU time."""
    import time

    if dev.interpreted():
        return float("nan")
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def graph_columns(row: dict, spec, problem, dtype, paths: dict, times: dict) -> None:
    """Each path replayed from a CUDA graph beside its do_bench median: ``graph_us`` (ours, with its %
    of the roofline), ``<name>_graph_us`` and ``vs_<name>_graph`` (theirs / ours) for the vendor path and
    the peers that timed; a path that cannot be captured says so (``<name>_graph_error``)."""
    gms = None
    for name, fn in paths.items():
        if name != "ours" and not isinstance(times.get(name), float):
            continue
        key = "graph" if name == "ours" else f"{name}_graph"
        try:
            ms = graph_ms(fn)
        except Exception as e:  # a launcher that cannot be captured says so in the row
            row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]
            torch.cuda.synchronize()
            continue
        row[f"{key}_us"] = ms * 1e3
        if name == "ours":
            gms = ms
            row["pct_roofline_graph"] = roofline(spec.cost(problem, dtype), dtype, ms).get("pct_roofline")
        elif gms:
            row[f"vs_{name}_graph"] = ms / gms


def bench_spec(spec, dtype: torch.dtype, problems=None, peers: bool = True, config=None,
               seed: int = 0, on_row: Callable[[dict], object] | None = None) -> list[dict]:
    """Time ours, the vendor path and each available peer on each problem, after checking correctness.
    The vendor path is what a PyTorch user gets by default (torch's own dispatch), recorded in the row by
    what actually ran (a vendor call's ``label``, e.g. "sdpa (cudnn)"); forced alternatives (each SDPA
    backend) are peers. ``on_row`` sees each row as soon as it is measured (the CLI saves as it goes)."""
    device = dev.device()
    if problems is None:
        problems = spec.small_problems if dev.interpreted() else spec.standard_problems
    rows = []
    for problem in problems:
        row = {"kernel": spec.name, "problem": problem_label(problem), "dtype": str(dtype).split(".")[-1]}
        try:
            cases = rotation(spec, problem, dtype, device, seed)
            c0 = cases[0]
            cfg = spec.config_for(problem, dtype, config)
            row["config"] = cfg
            # correctness of exactly what is timed
            cmp.poison(c0.out) if isinstance(c0.out, torch.Tensor) else [cmp.poison(o) for o in c0.out]
            got = spec.run(*c0.args, out=c0.out, config=cfg, **c0.kwargs)
            ref = spec.reference(*c0.args, **c0.kwargs)
            comp = cmp.compare(got if isinstance(got, torch.Tensor) else got[0],
                               ref if isinstance(ref, torch.Tensor) else ref[0], dtype, spec.accumulation(dtype))
            row["rel_error"] = comp.error
            row["correct"] = comp.ok
            del got, ref
            ours = cycling(cases, lambda c: functools.partial(spec.run, *c.args, out=c.out, config=cfg, **c.kwargs))
            paths = {"ours": ours}
            vendor_label = spec.vendor_name
            if spec.vendor is not None:
                try:
                    vfns = [spec.vendor(c) for c in cases]
                    if any(f is None for f in vfns):
                        raise LookupError(f"{spec.vendor_name} has no form for this problem")
                    paths["vendor"] = cycling(vfns, lambda f: f)
                    # the path torch's default dispatch took, named by what ran (e.g. "sdpa (cudnn)")
                    vendor_label = getattr(vfns[0], "label", None) or spec.vendor_name
                except Exception as e:  # the vendor path may not support a case; say so
                    row["vendor_error"] = f"{type(e).__name__}: {e}"[:200]
            if peers:
                calls, errors = peer_calls(spec, cases)
                paths.update(calls)
                row.update({f"{name}_error": why for name, why in errors.items()})
            times, rounds = time_rounds(paths)
            ms = times.pop("ours")
            row["ours_us"] = ms * 1e3
            if rounds > 1:
                row["rounds"] = rounds
            if not dev.interpreted():
                row["host_us"] = host_us(ours)
                graph_columns(row, spec, problem, dtype, paths, times)
            row.update(roofline(spec.cost(problem, dtype), dtype, ms))
            for name, t in times.items():
                if isinstance(t, str):
                    row[f"{name}_error"] = t
                    continue
                if name == "vendor":
                    row["vendor"] = vendor_label
                row[f"{name}_us"] = t * 1e3
                row[f"vs_{name}"] = t / ms
            del cases
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        if not dev.interpreted():
            torch.cuda.empty_cache()
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def write_results(rows: list[dict], results_dir: Path, name: str, merge: bool = False) -> Path:
    """Write the rows, each stamped with its date and the commit measured (:func:`source_commit`). ``merge``:
    rows already in the file for other (problem, dtype) pairs stay, in their order, with the new rows in place
    of the ones they re-measure."""
    d = Path(results_dir) / dev.gpu_slug()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    env = environment()
    commit = source_commit()
    rows = [{**r, "measured": r.get("measured", env["date"]), "commit": r.get("commit", commit)} for r in rows]
    if merge and path.exists():
        old = json.loads(path.read_text()).get("rows", [])
        new = {(r.get("problem"), r.get("dtype")): r for r in rows}
        merged = [new.pop((r.get("problem"), r.get("dtype")), r) for r in old]
        rows = merged + list(new.values())
    path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1, default=str))
    return path
