"""Timing, rotating input sets, the roofline, and the per-kernel benchmark loop.

Every time reported is the median of ``triton.testing.do_bench`` after its warm-up (so compilation is
never timed). When one input set fits in L2, several independent sets are generated and the timed
function cycles through them, so the numbers are DRAM numbers, not cache numbers.
"""
from __future__ import annotations

import datetime
import functools
import itertools
import json
import math
import platform
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.testing

from tritune.harness import compare as cmp
from tritune.harness import device as dev


_WARM = [False]


def warm_gpu(seconds: float = 0.5) -> None:
    """Keep the GPU busy for a moment so its clocks leave the idle state before the first timing
    (an idle H100 sits at 345 MHz; the first small kernel timed cold read up to 1.7x slow)."""
    import time

    dev.ceilings()  # measured (once per GPU type) now, not in the middle of the first row
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    # The first do_bench of a process read 16% slow (attention, H100): spend it on nothing we report.
    triton.testing.do_bench(lambda: a.add_(1), warmup=5, rep=20)
    _WARM[0] = True


def median_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, calls_before: int = 2) -> float:
    """Median milliseconds of ``fn`` (do_bench: warm-up excluded, L2 flushed between calls). The first
    call in a process warms the GPU up first.

    ``fn`` is called ``calls_before`` times before do_bench (for a function that cycles through input
    sets: twice its cycle). do_bench sizes its warm-up and repetitions from the time of 5 calls after a
    single first call; a compilation or first-use cost met in those 5 calls (an input set whose pointers or
    strides specialise the kernel differently, a peer's lazy set-up) would make it run a handful of
    repetitions and report a time dominated by that one-off cost."""
    if dev.interpreted():
        import time

        fn()  # the interpreter has no compilation, but keep the same shape: one untimed call
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return sorted(ts)[1]
    if not _WARM[0]:
        warm_gpu()
    for _ in range(max(calls_before, 2 * getattr(fn, "cycle", 1))):
        fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


@functools.lru_cache(maxsize=None)
def l2_bytes() -> int:
    if dev.interpreted():
        return 0
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def rotation(spec, problem, dtype, device, seed: int, layout: str = "contiguous"):
    """Input sets to cycle through: one if a set is larger than 2x L2, else enough to exceed 4x L2."""
    first = spec.make_inputs(problem, dtype, device, seed, layout)
    n = 1
    if l2_bytes():
        per = max(first.nbytes(), 1)
        if per < 2 * l2_bytes():
            n = min(16, math.ceil(4 * l2_bytes() / per))
    return [first] + [spec.make_inputs(problem, dtype, device, seed + i, layout) for i in range(1, n)]


def cycling(cases, make_call: Callable) -> Callable[[], object]:
    """A zero-argument function that calls ``make_call(case)()`` for each case in turn; its ``cycle``
    attribute is the number of cases (median_ms runs the whole cycle twice before timing)."""
    calls = itertools.cycle([make_call(c) for c in cases])

    def call():
        return next(calls)()

    call.cycle = len(cases)
    return call


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


def graph_ms(fn: Callable[[], object]) -> float:
    """Median GPU milliseconds of ``fn`` replayed from a CUDA graph (triton.testing.do_bench_cudagraph):
    no host time and no L2 flush (inputs rotate past L2 instead), as the engine runs its decode step. The
    flush of do_bench leaves ~50 MB of dirty lines that the timed kernel must write back (about 12 µs on
    an H100 for a kernel reading >= 50 MB: paged attention at B=64 read 77% of copy bandwidth under
    do_bench and 91.5% here)."""
    if dev.interpreted():  # no CUDA graphs: the interpreter's own timing (tests of the tuning path)
        return median_ms(fn)
    from tritune import kernels as K

    fn()
    torch.cuda.synchronize()
    # Without programmatic dependent launch: the graph repeats one launch back to back, and with it each
    # repeat would overlap the one before (a chain of the same kernel, not its own time).
    saved, K.PDL = K.PDL, False
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))
    finally:
        K.PDL = saved


# Short problems (median under SHORT_MS) are timed in ROUNDS_SHORT alternating rounds (ours, the vendor,
# each peer, then again), each path's time the median of its rounds: a one-off (a slow host moment, a clock
# step) in one path's single do_bench moved a 9 µs row by 30% (H100, gemm M=1: 12.1 against 9.1 µs in
# the call before), and at that size such noise decides a ratio. Five rounds: do_bench's median of a ~9 µs
# kernel is bimodal between calls (H100: 8.5-8.7 or 9.1-9.3 µs, cuBLAS and ours alike; lab/probes/gemm_c_attn_small_m.py), so
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


def problem_label(problem) -> str:
    fields = getattr(problem, "__dataclass_fields__", None)
    if not fields:
        return str(problem)
    return " ".join(f"{k}={getattr(problem, k)}" for k in fields)


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
                try:
                    gms = graph_ms(ours)
                    row["graph_us"] = gms * 1e3
                    row["pct_roofline_graph"] = roofline(spec.cost(problem, dtype), dtype, gms).get("pct_roofline")
                except Exception as e:  # a launcher that cannot be captured says so in the row
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:200]
                    torch.cuda.synchronize()
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


def environment() -> dict:
    return {
        "gpu": dev.gpu_name(),
        "slug": dev.gpu_slug(),
        "interpreter": dev.interpreted(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": dev.ceilings(),
    }


def write_results(rows: list[dict], results_dir: Path, name: str, merge: bool = False) -> Path:
    """Write the rows (each stamped with its date). ``merge``: rows already in the file for other
    (problem, dtype) pairs stay, in their order, with the new rows in place of the ones they re-measure."""
    d = Path(results_dir) / dev.gpu_slug()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    env = environment()
    rows = [{**r, "measured": r.get("measured", env["date"])} for r in rows]
    if merge and path.exists():
        old = json.loads(path.read_text()).get("rows", [])
        new = {(r.get("problem"), r.get("dtype")): r for r in rows}
        merged = [new.pop((r.get("problem"), r.get("dtype")), r) for r in old]
        rows = merged + list(new.values())
    path.write_text(json.dumps({"environment": env, "rows": rows}, indent=1, default=str))
    return path
