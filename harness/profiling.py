"""Where the device time of a tritune command goes: torch.profiler's kernel table, the host gaps between
launches, and (on request) Nsight Compute's counters per tritune kernel.

The table is built from plain records (name, start, duration in microseconds), so it is the same function
for a profiler trace and for a test's hand-made events. A kernel is "tritune" when its name is one of the
jitted functions of the registered kernels (Triton names a launched kernel after its jitted function).
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelEvent:
    name: str
    start_us: float
    dur_us: float


def tritune_kernel_names() -> set[str]:
    """Names of every jitted function of the registered kernels' modules (Triton and Gluon)."""
    import sys

    from tritune import kernels

    specs = kernels.all_specs()
    names = set()
    mods = {getattr(s.run, "__module__", None) for s in specs}
    prefixes = tuple(m.rsplit(".", 1)[0] + "." for m in mods if m)
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname in mods or modname.startswith(prefixes)):
            continue
        for obj in vars(mod).values():
            fn = getattr(obj, "fn", None)
            if callable(fn) and type(obj).__module__.startswith("triton"):
                names.add(fn.__name__)
    return names


def is_tritune(name: str, ours: set[str]) -> bool:
    base = re.sub(r"_\d+d(_\d+d)*$", "", name)  # some Triton versions suffix the name with the grid rank
    return name in ours or base in ours


def busy_us(events: list[KernelEvent]) -> float:
    """Device time covered by at least one kernel (overlapping kernels counted once)."""
    total, end = 0.0, None
    for e in sorted(events, key=lambda e: e.start_us):
        s, t = e.start_us, e.start_us + e.dur_us
        if end is None or s >= end:
            total += e.dur_us
            end = t
        elif t > end:
            total += t - end
            end = t
    return total


def kernel_table(events: list[KernelEvent], ours: set[str]) -> tuple[list[dict], dict]:
    """Per kernel name: calls, total and mean device time, share of all kernel time, tritune or not; and a
    summary: device busy time, the span from the first launch to the last kernel's end, the gaps (span minus
    busy: time the device waited for the host), tritune's share."""
    by: dict[str, list[float]] = {}
    for e in events:
        by.setdefault(e.name, []).append(e.dur_us)
    total = sum(sum(v) for v in by.values()) or 1.0
    rows = [{"kernel": k, "tritune": is_tritune(k, ours), "calls": len(v), "total_us": sum(v),
             "mean_us": sum(v) / len(v), "share": sum(v) / total} for k, v in by.items()]
    rows.sort(key=lambda r: -r["total_us"])
    span = (max(e.start_us + e.dur_us for e in events) - min(e.start_us for e in events)) if events else 0.0
    busy = busy_us(events)
    summary = {"kernels": len(events), "kernel_us": sum(r["total_us"] for r in rows), "busy_us": busy,
               "span_us": span, "gap_us": max(span - busy, 0.0),
               "tritune_share": sum(r["total_us"] for r in rows if r["tritune"]) / total if rows else 0.0}
    return rows, summary


def events_of(prof, device_type=None) -> list[KernelEvent]:
    """The device kernels (``device_type``, default CUDA) of a finished ``torch.profiler.profile``, read from
    kineto's raw records: ``prof.events()`` builds every host op's tree first, minutes for a serving run's
    million events."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if device_type is None else device_type
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is None:   # a profiler without kineto's records
        return [KernelEvent(e.name, float(e.time_range.start), float(e.time_range.elapsed_us()))
                for e in prof.events() if e.device_type == want and e.time_range.elapsed_us() >= 0]
    return [KernelEvent(e.name(), e.start_ns() / 1e3, e.duration_ns() / 1e3)
            for e in raw.events() if e.device_type() == want and e.duration_ns() >= 0]


# Nsight Compute: a few counters per kernel launch. Hopper's tensor pipe is the GMMA one.
NCU_METRICS = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__bytes.sum": "dram_bytes",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block_dynamic": "smem_dynamic",
    "launch__shared_mem_per_block_static": "smem_static",
}


def ncu_command(argv: list[str], kernel_regex: str, launches: int, python: str) -> list[str]:
    return ["ncu", "--clock-control", "none", "--target-processes", "all", "--csv", "--page", "raw",
            "--kernel-name", f"regex:{kernel_regex}", "--launch-count", str(launches),
            "--metrics", ",".join(NCU_METRICS), python, "-m", "tritune.harness.cli", *argv]


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's raw CSV page (one row per launch; a units row after the header) -> rows with our short names,
    averaged per kernel name."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    reader = list(csv.DictReader(io.StringIO("\n".join(lines))))
    per: dict[str, list[dict]] = {}
    for r in reader:
        name = r.get("Kernel Name") or r.get("Function Name") or ""
        vals = {}
        for metric, short in NCU_METRICS.items():
            v = (r.get(metric) or "").replace(",", "")
            try:
                vals[short] = float(v)
            except ValueError:
                pass
        if vals:  # the units row has none
            per.setdefault(name, []).append(vals)
    out = []
    for name, rs in per.items():
        keys = set().union(*rs)
        out.append({"kernel": name, "launches": len(rs),
                    **{k: sum(r.get(k, 0.0) for r in rs) / len(rs) for k in sorted(keys)}})
    return out
