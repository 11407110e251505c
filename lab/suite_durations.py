"""Where a test suite's wall clock goes, from its per-test duration logs.

    python lab/suite_durations.py LOG [LOG ...] [--workers 16] [--top 10] [--write-durations FILE]

A LOG is what ``TRITUNE_TEST_LOG=FILE python -m pytest ...`` writes (tests/conftest.py): one line per test,
``<seconds>s <outcome> <node id>``, plus FAILED blocks (skipped here). For each log: the slowest tests, the
sum per file, and the two bounds on the wall clock of an xdist run: the critical path (the longest single
test: no schedule finishes before it) and the total work over the workers; then the makespan of a greedy
longest-first schedule over the workers, which is what conftest's ordering aims at. Two logs side by side
are before and after.

``--write-durations FILE`` writes the tests over ``--min-seconds`` (default 3) as JSON {node id: seconds}
(the largest time over the logs): tests/conftest.py starts those first on a GPU run under xdist.
"""
from __future__ import annotations

import argparse
import heapq
import json
import re
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([0-9.]+)s (passed|failed|skipped|error)\s+(\S.*)$")


def read_log(path: str) -> dict[str, tuple[float, str]]:
    """{node id: (seconds, outcome)}; a test logged twice (a rerun) keeps its last line."""
    out = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line.rstrip("\n"))
            if m:
                out[m.group(3)] = (float(m.group(1)), m.group(2))
    return out


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def greedy_makespan(durations: list[float], workers: int) -> float:
    """Longest processing time first onto the least loaded worker (within 4/3 of the best schedule)."""
    loads = [0.0] * workers
    for d in sorted(durations, reverse=True):
        heapq.heapreplace(loads, loads[0] + d)
    return max(loads)


def summarize(path: str, tests: dict, workers: int, top: int) -> dict:
    secs = [s for s, _ in tests.values()]
    total = sum(secs)
    outcomes = defaultdict(int)
    per_file = defaultdict(float)
    for nodeid, (s, outcome) in tests.items():
        outcomes[outcome] += 1
        per_file[file_of(nodeid)] += s
    slowest = sorted(tests.items(), key=lambda kv: -kv[1][0])[:top]
    crit = slowest[0][1][0] if slowest else 0.0
    print(f"== {path}")
    print(f"{len(tests)} tests ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}); "
          f"sum of test time {total:.0f} s")
    print(f"-- {len(slowest)} slowest")
    for nodeid, (s, outcome) in slowest:
        print(f"{s:8.1f} s  {outcome:7s} {nodeid}")
    print("-- per file (sum, tests, longest)")
    for name, s in sorted(per_file.items(), key=lambda kv: -kv[1]):
        longest = max(v[0] for k, v in tests.items() if file_of(k) == name)
        n = sum(1 for k in tests if file_of(k) == name)
        print(f"{s:8.1f} s  {n:4d}  {longest:7.1f}  {name}")
    lpt = greedy_makespan(secs, workers) if secs else 0.0
    print(f"-- wall clock bounds over {workers} workers: critical path (longest test) {crit:.1f} s, "
          f"work / workers {total / workers:.1f} s; longest-first schedule {lpt:.1f} s "
          f"(plus start-up; per-test times are as measured, under the logged run's contention)")
    return {"tests": len(tests), "sum": total, "critical": crit, "per_worker": total / workers, "lpt": lpt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", metavar="LOG")
    ap.add_argument("--workers", type=int, default=16, help="xdist workers of the run (default 16)")
    ap.add_argument("--top", type=int, default=10, help="how many slowest tests (default 10)")
    ap.add_argument("--write-durations", metavar="FILE", help="write {node id: seconds} of the slow tests")
    ap.add_argument("--min-seconds", type=float, default=3.0, help="threshold for --write-durations")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.top < 1:
        ap.error("--workers and --top must be at least 1")
    rows, merged = [], {}
    for path in args.logs:
        try:
            tests = read_log(path)
        except OSError as e:
            print(f"error: {path}: {e.strerror}", file=sys.stderr)
            return 2
        rows.append((path, summarize(path, tests, args.workers, args.top)))
        for nodeid, (s, _) in tests.items():
            merged[nodeid] = max(s, merged.get(nodeid, 0.0))
        print()
    if len(rows) > 1:
        print("-- side by side: tests, sum s, critical path s, sum/workers s, longest-first s")
        for path, r in rows:
            print(f"{r['tests']:5d} {r['sum']:8.0f} {r['critical']:8.1f} {r['per_worker']:8.1f} {r['lpt']:8.1f}  {path}")
    if args.write_durations:
        keep = {k: round(v, 1) for k, v in sorted(merged.items(), key=lambda kv: -kv[1]) if v >= args.min_seconds}
        with open(args.write_durations, "w") as f:
            json.dump(keep, f, indent=0)
            f.write("\n")
        print(f"wrote {len(keep)} durations >= {args.min_seconds} s to {args.write_durations}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
