"""Budgeted tuning against the committed store: per bucket, the `tritune tune all --budget` winner's time
against the committed entry's, the geomean of the ratios, and the buckets more than 10% worse.

    python lab/compare_tune_all.py --new /tmp/h200-budget/configs/nvidia-h200 --old tuning/configs/nvidia-h200
    python lab/compare_tune_all.py --new ... --old ... --retime      # on the GPU: both configs re-timed now

Without --retime the times are those each store recorded (two sessions: clocks and neighbours differ);
with --retime both configs of a bucket are verified once, then timed side by side in interleaved rounds
(the order alternating) in one worker process, and those medians are compared. Targets (issue: a new GPU
type in one command): geomean within 3% of the committed entries, no bucket worse than 10%.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def load(d: Path) -> dict:
    out = {}
    for p in sorted(Path(d).glob("*.json")):
        data = json.loads(p.read_text())
        for e in data.get("entries", []):
            out[(data["kernel"], e["bucket"], e["dtype"])] = e
    return out


def retime_pair(kernel, new_e, old_e, runner, rounds):
    from tritune import kernels
    from tritune.tuning import search, store

    spec = kernels.get(kernel)
    problem = store.problem_of_entry(spec, new_e) or store.problem_of_entry(spec, old_e)
    if problem is None:
        return None, "no problem known for the bucket"
    dtype = store.torch_dtype(new_e["dtype"])
    cfgs = {"new": new_e["config"], "old": old_e["config"]}
    times = {"new": [], "old": []}
    for name, cfg in cfgs.items():  # verified once each
        why = spec.space.why_invalid(cfg, problem, dtype)
        if why:
            return None, f"{name} config invalid now: {why}"
        res = runner(search.Task(kernel, problem, dtype, cfg, 1, spec=spec))
        if not res.get("ok"):
            return None, f"{name} config: {res.get('error')}"
    for r in range(rounds):
        for name in (("new", "old") if r % 2 == 0 else ("old", "new")):
            res = runner(search.Task(kernel, problem, dtype, cfgs[name], 1, spec=spec, verify=False))
            if res.get("ok"):
                times[name].append(res["ms"] * 1e3)
    if not times["new"] or not times["old"]:
        return None, "timing failed"
    return (statistics.median(times["new"]), statistics.median(times["old"])), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", required=True, help="the budgeted run's store folder for the GPU (…/<slug>)")
    ap.add_argument("--old", required=True, help="the committed store folder (tuning/configs/<slug>)")
    ap.add_argument("--retime", action="store_true", help="re-time both configs side by side on this GPU")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    from tabulate import tabulate

    new, old = load(Path(args.new)), load(Path(args.old))
    both = sorted(set(new) & set(old))
    if not both:
        print(f"no bucket in both {args.new} and {args.old}", file=sys.stderr)
        return 2
    runner = None
    if args.retime:
        import tritune.harness  # noqa: F401
        from tritune.tuning import search

        runner = search.make_runner(None, "process")
    rows, ratios = [], []
    try:
        for key in both:
            n, o = new[key], old[key]
            tn, to, note = n.get("time_us"), o.get("time_us"), ""
            if runner is not None:
                got, note = retime_pair(key[0], n, o, runner, args.rounds)
                tn, to = got if got else (None, None)
            ratio = tn / to if tn and to else None
            if ratio:
                ratios.append(ratio)
            flag = "WORSE >10%" if ratio and ratio > 1.10 else ""
            rows.append([*key, f"{tn:.2f}" if tn else "", f"{to:.2f}" if to else "",
                         f"{ratio:.3f}" if ratio else "", "same" if n["config"] == o["config"] else "",
                         (n.get("retimed") or {}).get("winner", ""), flag or note])
    finally:
        if runner is not None:
            runner.close()
    print(tabulate(rows, headers=["kernel", "bucket", "dtype", "budgeted µs", "committed µs", "ratio", "config",
                                  "budget winner", ""], disable_numparse=True))
    only_old = sorted(set(old) - set(new))
    if only_old:
        print(f"\n{len(only_old)} committed buckets the budgeted run did not export: "
              + ", ".join(f"{k} {b} {d}" for k, b, d in only_old[:12]) + (" ..." if len(only_old) > 12 else ""))
    if ratios:
        g = math.exp(sum(map(math.log, ratios)) / len(ratios))
        worse = sum(r > 1.10 for r in ratios)
        print(f"\ngeomean budgeted/committed {g:.4f} over {len(ratios)} buckets "
              f"({'re-timed side by side' if args.retime else 'recorded times'}); {worse} bucket(s) worse than 10%; "
              f"target: geomean <= 1.03, none worse than 1.10 -> {'MET' if g <= 1.03 and not worse else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
