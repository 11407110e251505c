"""The timers tuning needs: how a config is timed (CUDA-graph replay for short problems, do_bench's flushed
median for long ones), the rotating input sets it is timed on, and the environment a result is stamped with.

Every trial of a study, the re-time of its front runners before export and ``tritune bench`` time a
config through :func:`timing_mode` and :func:`time_ms`: one quantity everywhere. When one input set fits
in L2, several independent sets are generated and the timed function cycles through them, so the numbers
are DRAM numbers, not cache numbers.
"""
from __future__ import annotations

import datetime
import functools
import itertools
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.testing

from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime.launch import pdl_off


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


def graph_ms(fn: Callable[[], object]) -> float:
    """Median GPU milliseconds of ``fn`` replayed from a CUDA graph (triton.testing.do_bench_cudagraph):
    no host time and no L2 flush (inputs rotate past L2 instead), as the engine runs its decode step. The
    flush of do_bench leaves ~50 MB of dirty lines that the timed kernel must write back (about 12 µs on
    an H100 for a kernel reading >= 50 MB: paged attention at B=64 read 77% of copy bandwidth under
    do_bench and 91.5% here)."""
    if dev.interpreted():  # no CUDA graphs: the interpreter's own timing (tests of the tuning path)
        return median_ms(fn)
    fn()
    torch.cuda.synchronize()
    # Without programmatic dependent launch: the graph repeats one launch back to back, and with it each
    # repeat would overlap the one before (a chain of the same kernel, not its own time).
    with pdl_off():
        return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"))


# ---------------------------------------------------------------------------------------------------
# The tuner's one timer: every trial of a study and the re-time of its front runners time a config
# through tuning.evaluate.Evaluator, which calls timing_mode() and time_ms() below and nothing else.
#
# Why two modes. do_bench brackets each call with events after a 256 MB zero-fill of L2 (~60-80 us of GPU
# time). That hides the launcher's host time (20-90 us of Python and triton launch a call) only while the
# host stays ahead of the GPU; when it does not (a slower or busier host, a launcher with more host work),
# the GPU waits between the start event and the kernel and the "kernel time" is host time: the same
# committed configs re-timed in two processes on one H200 differed up to 9x on short problems, and within
# 1% for every kernel over 100 us. Short problems are therefore timed by replaying a CUDA graph of many
# launches (no host time at all, as the engine's captured decode step runs them) on input sets cycled past
# L2 (DRAM numbers, no flush); long ones keep do_bench's flushed median, where host time cannot show.
# ---------------------------------------------------------------------------------------------------
GRAPH_FLOOR_US = 50.0
# Fixed, nominal Hopper-class rates for the floor (not the measured ceilings: the mode must not depend
# on a measurement, or two processes could time one problem two ways).
NOMINAL_BYTES_PER_S = 3.0e12
NOMINAL_FLOPS_PER_S = 6.0e14
GRAPH_L2_MULTIPLE = 3      # graph mode: input sets cycled through total at least this many times L2
GRAPH_MAX_SETS = 512
GRAPH_TARGET_MS = 2.0      # GPU time of one replay (launches per graph = this / one launch's time)
GRAPH_MAX_LAUNCHES = 4000
GRAPH_REPLAYS = 10         # timed replays; the time is their median per launch
TIMING_MODES = ("graph", "flush")


def floor_us(spec, problem, dtype) -> float | None:
    """The problem's roofline floor in µs at the nominal rates; None when the spec's cost fails."""
    try:
        c = spec.cost(problem, dtype)
        return max(c.bytes / NOMINAL_BYTES_PER_S, c.flops / NOMINAL_FLOPS_PER_S) * 1e6
    except Exception:
        return None


def timing_mode(spec, problem, dtype, force: str | None = None) -> str:
    """How a problem's configs are timed: "graph" (CUDA-graph replay, see :func:`replay_ms`) when its
    roofline floor at nominal rates is under GRAPH_FLOOR_US (or unknown), else "flush" (:func:`median_ms`).
    A function of the problem alone (never of the config or of a measurement), so every config of a
    study, its re-time and the side-by-side comparison are timed the same way. ``force``: "graph" or
    "flush" (``tritune tune --timer``), "auto"/None for the rule."""
    if force in TIMING_MODES:
        return force
    if force not in (None, "auto"):
        raise ValueError(f"timer: expected auto, graph or flush, got {force!r}")
    f = floor_us(spec, problem, dtype)
    return "graph" if f is None or f < GRAPH_FLOOR_US else "flush"


def time_ms(fn: Callable[[], object], mode: str) -> float:
    """THE timer of a config (tuning trials, re-times, comparisons): :func:`replay_ms` for "graph",
    :func:`median_ms` for "flush". ``fn`` cycles through the input sets of :func:`timing_cases`."""
    if mode == "graph":
        return replay_ms(fn)
    if mode == "flush":
        return median_ms(fn)
    raise ValueError(f"mode: expected one of {TIMING_MODES}, got {mode!r}")


def clone_case(case):
    """A copy of ``case`` on new storage with the same views: shapes, strides, storage offsets, and two
    arguments that share storage (K and V views of one pool) still share it. The copy specialises the
    kernel exactly as the original does (same alignment, strides), at the cost of a device copy."""
    import dataclasses

    memo: dict = {}

    def cl(x):
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            new = memo.get(st.data_ptr())
            if new is None:
                new = memo[st.data_ptr()] = st.clone()
            t = torch.empty(0, dtype=x.dtype, device=x.device)
            t.set_(new, x.storage_offset(), x.size(), x.stride())
            return t
        if isinstance(x, (list, tuple)):
            return type(x)(cl(v) for v in x)
        if isinstance(x, dict):
            return {k: cl(v) for k, v in x.items()}
        return x

    return dataclasses.replace(case, args=cl(case.args), kwargs=cl(case.kwargs), out=cl(case.out))


def timing_cases(spec, problem, dtype, device, seed: int, mode: str, l2: int | None = None) -> list:
    """The input sets a config is timed on: :func:`rotation`'s, and in graph mode (no flush between
    launches) copies of them (:func:`clone_case`) until the sets total GRAPH_L2_MULTIPLE x L2, so that
    each launch of the replay reads data evicted since its last use (at most GRAPH_MAX_SETS sets)."""
    cases = rotation(spec, problem, dtype, device, seed)
    l2 = l2_bytes() if l2 is None else l2
    if mode != "graph" or not l2:
        return cases
    per = max(cases[0].nbytes(), 1)
    want = min(GRAPH_MAX_SETS, max(len(cases), math.ceil(GRAPH_L2_MULTIPLE * l2 / per) + 1))
    base = len(cases)
    while len(cases) < want:
        cases.append(clone_case(cases[len(cases) % base]))
    return cases


def replay_ms(fn: Callable[[], object]) -> float:
    """Median GPU milliseconds of one call of ``fn``, from CUDA-graph replays of many calls back to back
    (host time is never in it: the launches are in the graph). Programmatic dependent launch is off
    while capturing (each launch would overlap the one before). The calls per graph are a whole number
    of ``fn.cycle`` (every input set as often) and about GRAPH_TARGET_MS of GPU time, sized from a first
    graph of one cycle (at least 8 calls). Under the interpreter: :func:`median_ms`."""
    if dev.interpreted():
        return median_ms(fn)
    import statistics

    if not _WARM[0]:
        warm_gpu()
    cycle = max(1, int(getattr(fn, "cycle", 1)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with pdl_off():   # no PDL: each replayed launch would overlap the one before
        try:
            with torch.cuda.stream(stream):
                for _ in range(2 * cycle):  # compile, module load, split-K counters: all outside the capture
                    fn()
            torch.cuda.synchronize()

            def capture(n):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    for _ in range(n):
                        fn()
                return g

            def replay(g, n):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    s.record()
                    g.replay()
                    e.record()
                e.synchronize()
                return s.elapsed_time(e) / n

            n0 = cycle * math.ceil(8 / cycle)
            g = capture(n0)
            replay(g, n0)
            est = replay(g, n0)
            del g
            n = max(n0, min(GRAPH_MAX_LAUNCHES, math.ceil(GRAPH_TARGET_MS / max(est, 1e-4))))
            n = cycle * math.ceil(n / cycle)
            g = capture(n)
            replay(g, n)  # the first replay uploads the graph
            times = [replay(g, n) for _ in range(GRAPH_REPLAYS)]
            del g
            return float(statistics.median(times))
        finally:
            torch.cuda.current_stream().wait_stream(stream)


def problem_label(problem) -> str:
    fields = getattr(problem, "__dataclass_fields__", None)
    if not fields:
        return str(problem)
    return " ".join(f"{k}={getattr(problem, k)}" for k in fields)


def source_commit() -> str | None:
    """The commit measured: ``$TRITUNE_COMMIT`` where set (a tree copied to a GPU machine may carry a stale
    ``.git``, or none), else ``git rev-parse --short HEAD`` of the checkout this package runs from; None where
    neither answers (an installed wheel)."""
    c = os.environ.get("TRITUNE_COMMIT", "").strip()
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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
