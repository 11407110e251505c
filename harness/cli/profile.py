"""``tritune profile [--ncu] [--warmup N] COMMAND ...``: run another tritune command under torch.profiler and
print where the device time went: a per-kernel table (calls, total and mean time, share, tritune's or not),
the device's busy time against the span of the work (the gap is time the GPU waited for the host), a
Chrome/Perfetto trace, and with ``--ncu`` Nsight Compute's counters per tritune kernel (DRAM throughput, SM
and tensor-pipe use, occupancy, registers, shared memory). Rows go into ``results/<gpu>/profile.json``.

The command runs ``--warmup`` times unprofiled first (compilation, autotuned plans, CUDA graphs), so the
table shows the steady state. Needs a CUDA GPU (the interpreter's times are the CPU's): refused otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tritune.kernels.runtime.args import UsageError, int_at_least

TOP = 25


def add_parser(subparsers, name: str) -> None:
    s = subparsers.add_parser(name, help="run a tritune command under torch.profiler: a per-kernel table, "
                                         "host gaps, a Chrome trace; --ncu adds Nsight Compute counters")
    s.add_argument("--warmup", type=int_at_least(0), default=1, help="unprofiled runs first (default 1)")
    s.add_argument("--trace", default=None, help="Chrome/Perfetto trace path (default: results dir)")
    s.add_argument("--ncu", action="store_true", help="also Nsight Compute counters per tritune kernel")
    s.add_argument("--ncu-launches", type=int_at_least(1), default=40, help="launches ncu profiles (default 40)")
    s.add_argument("--results-dir", default="results", help="where profile.json goes (default ./results)")
    s.add_argument("--top", type=int_at_least(1), default=TOP, help=f"rows of the table (default {TOP})")
    s.add_argument("cmd", nargs=argparse.REMAINDER, metavar="COMMAND", help="the tritune command and its arguments, e.g. "
                   "generate 'ROMEO:' --max-new-tokens 64 ")
    s.set_defaults(func=run)


def _run_command(argv: list[str]) -> int:
    from tritune.harness.cli import main

    return main(list(argv))


def run(args) -> int:
    import torch

    from tritune.harness import profiling
    from tritune.kernels.runtime import device as dev

    if dev.interpreted() or not torch.cuda.is_available():
        raise UsageError("profile needs a CUDA GPU (without one the kernels run in Triton's interpreter, on "
                         "the CPU, and their times say nothing about a GPU)")
    if not args.cmd:
        raise UsageError("profile: name the command to profile, e.g. tritune profile generate 'ROMEO:'")
    if args.cmd[0] == "profile":
        raise UsageError("profile: the command to profile cannot be profile itself")
    if args.ncu and shutil.which("ncu") is None:
        raise UsageError("--ncu: Nsight Compute's `ncu` is not on PATH")
    for _ in range(args.warmup):
        _run_command(args.cmd)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        rc = _run_command(args.cmd)
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6
    out_dir = Path(args.results_dir) / dev.gpu_slug()
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = Path(args.trace) if args.trace else out_dir / f"trace-{args.cmd[0]}.json"
    prof.export_chrome_trace(str(trace))
    rows, summary = profiling.kernel_table(profiling.events_of(prof), profiling.tritune_kernel_names())
    summary["wall_us"] = wall_us
    _print_table(rows[: args.top], summary)
    ncu_rows = _ncu(args, rows) if args.ncu else None
    path = _write(out_dir, args.cmd, rows, summary, ncu_rows, trace)
    print(f"trace: {trace}\nwrote {path}")
    return rc


def _print_table(rows: list[dict], summary: dict) -> None:
    from tabulate import tabulate

    table = [[r["kernel"][:60], "yes" if r["tritune"] else "", r["calls"], f"{r['total_us'] / 1e3:.3f}",
              f"{r['mean_us']:.2f}", f"{100 * r['share']:.1f}%"] for r in rows]
    print(tabulate(table, headers=["kernel", "tritune", "calls", "total ms", "mean us", "share"]))
    print(f"\ndevice busy {summary['busy_us'] / 1e3:.2f} ms of a {summary['span_us'] / 1e3:.2f} ms span "
          f"(host gaps {summary['gap_us'] / 1e3:.2f} ms); wall {summary['wall_us'] / 1e3:.1f} ms; "
          f"tritune kernels {100 * summary['tritune_share']:.1f}% of kernel time")


def _ncu(args, rows: list[dict]) -> list[dict]:
    import re

    from tritune.harness import profiling

    ours = sorted({r["kernel"] for r in rows if r["tritune"]})
    if not ours:
        print("ncu: no tritune kernel ran; nothing to count")
        return []
    regex = "|".join(re.escape(n) for n in ours)
    cmd = profiling.ncu_command(args.cmd, regex, args.ncu_launches, sys.executable)
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    got = profiling.parse_ncu_csv(p.stdout)
    if not got:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        print("ncu: no counters read (" + " | ".join(tail) + ")", file=sys.stderr)
        return []
    _print_ncu(got)
    return got


def _print_ncu(got: list[dict]) -> None:
    from tabulate import tabulate
    from tritune.kernels.runtime import device as dev

    bw = (dev.ceilings().get("copy_bytes_per_s") or 0) / 1e9  # GB/s
    table = []
    for r in got:
        ach = r.get("dram_bytes", 0) / max(r.get("duration_ns", 0), 1)  # GB/s
        roof = f"{100 * ach / bw:.0f}%" if bw else ""
        table.append([r["kernel"][:50], r["launches"], f"{r.get('duration_ns', 0) / 1e3:.1f}", f"{ach:.0f}", roof,
                      f"{r.get('sm_pct', 0):.0f}", f"{r.get('tensor_pct', 0):.0f}",
                      f"{r.get('occupancy_pct', 0):.0f}", int(r.get("registers", 0)),
                      int(r.get("smem_dynamic", 0) + r.get("smem_static", 0))])
    print(tabulate(table, headers=["kernel", "n", "us", "DRAM GB/s", "of copy bw", "SM %", "tensor %",
                                   "occupancy %", "regs", "smem B"]))


def _write(out_dir: Path, cmd, rows, summary, ncu_rows, trace) -> Path:
    import datetime

    import torch
    import triton
    from tritune.tuning.timing import source_commit
    from tritune.kernels.runtime import device as dev

    path = out_dir / "profile.json"
    data = json.loads(path.read_text()) if path.is_file() else {"rows": []}
    key = " ".join(cmd)
    data["rows"] = [r for r in data["rows"] if r.get("command") != key]
    data["rows"].append({"command": key, "gpu": dev.gpu_name(), "date": datetime.date.today().isoformat(),
                         "commit": source_commit(), "torch": torch.__version__,
                         "triton": triton.__version__, "summary": summary, "kernels": rows,
                         "ncu": ncu_rows, "trace": trace.name})
    path.write_text(json.dumps(data, indent=1))
    return path
