"""Budgeted tuning against the committed store: per bucket, the `tritune tune all --budget` winner's time
against the committed entry's, the geomean of the ratios, and the buckets more than 10% worse.

    python lab/compare_tune_all.py --new /tmp/h200-budget/configs/nvidia-h200 --old tuning/configs/nvidia-h200
    python lab/compare_tune_all.py --new ... --old ... --retime      # on the GPU: both configs re-timed now

Without --retime the times are those each store recorded (two runs: clocks and neighbours differ);
with --retime both configs of a bucket are verified once, then timed side by side in interleaved rounds
(the order alternating) in one worker process, and those medians are compared. The timing is the tuner's
own (tuning.search.Evaluator -> harness.bench.timing_mode/time_ms: CUDA-graph replay for short problems,
do_bench's flushed median for long ones; --timer as `tritune tune --timer`), so a budgeted winner is
judged by the quantity its study minimised; a bucket where both
stores hold the same config has ratio 1 (not timed). Targets (issue: a new GPU type in one command):
geomean within 3% of the committed entries, no bucket worse than 10%; 'INCOMPLETE' when committed buckets
were not compared. Exit status 0 only when MET. --json writes the rows and the verdict.
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


def retime_pair(kernel, new_e, old_e, runner, rounds, info: dict | None = None):
    """((new µs, old µs) medians over ``rounds`` interleaved rounds, "") or (None, why); ``info`` gets the
    timing mode the evaluator used ("timer")."""
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
                if info is not None and "timer" in res:
                    info["timer"] = res["timer"]
    if not times["new"] or not times["old"]:
        return None, "timing failed"
    return (statistics.median(times["new"]), statistics.median(times["old"])), ""


def ledger_summary(storage: str) -> dict:
    """From the budgeted run's storage: the time its studies spent (all calls) and why they stopped."""
    import collections

    import optuna

    from tritune.tuning import budget as tb, search

    st = search.open_storage(storage)
    spent, stops = 0.0, collections.Counter()
    for name in optuna.get_all_study_names(st):
        led = tb.ledger(optuna.load_study(study_name=name, storage=st))
        spent += led["spent_s"]
        stops[led["stop"] or "unfinished"] += 1
    return {"spent_min": round(spent / 60, 2), "studies": dict(stops)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", required=True, help="the budgeted run's store folder for the GPU (…/<slug>)")
    ap.add_argument("--old", required=True, help="the committed store folder (tuning/configs/<slug>)")
    ap.add_argument("--retime", action="store_true", help="re-time both configs side by side on this GPU")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timer", choices=("auto", "do_bench", "graph"), default="auto",
                    help="the tuner's timer: auto (default; as `tritune tune`), or one for every problem")
    ap.add_argument("--time-limit", type=float, default=240.0, metavar="S",
                    help="stop re-timing after S seconds; the buckets left are reported, not compared")
    ap.add_argument("--storage", help="the budgeted run's Optuna storage: its time spent and stop reasons")
    ap.add_argument("--json", dest="json_out", help="write the rows and the verdict here")
    ap.add_argument("--geomean-target", type=float, default=1.03)
    ap.add_argument("--worst-target", type=float, default=1.10)
    args = ap.parse_args(argv)
    import time

    from tabulate import tabulate

    from tritune.tuning import store

    new, old = load(Path(args.new)), load(Path(args.old))
    both = sorted(set(new) & set(old))
    if not both:
        print(f"no bucket in both {args.new} and {args.old}", file=sys.stderr)
        return 2
    runner = None
    if args.retime:
        import tritune.harness  # noqa: F401
        from tritune.tuning import search

        mode = {"do_bench": "flush"}.get(args.timer, args.timer)
        runner = search.make_runner(search.Evaluator(mode=mode), "process")
    rows, out_rows, ratios = [], [], []
    t_end = time.time() + args.time_limit
    try:
        for key in both:
            n, o = new[key], old[key]
            tn, to, note, info = n.get("time_us"), o.get("time_us"), "", {}
            same = n["config"] == o["config"]
            if runner is not None:
                if same:  # one config: the ratio is 1 by definition; timing it twice would only add noise
                    tn = to = None
                    note = "same config"
                elif time.time() > t_end:
                    tn = to = None
                    note = "not re-timed (time limit)"
                else:
                    got, note = retime_pair(key[0], n, o, runner, args.rounds, info)
                    tn, to = got if got else (None, None)
            ratio = 1.0 if same else (tn / to if tn and to else None)
            if ratio:
                ratios.append((ratio, key))
            flag = "WORSE >10%" if ratio and ratio > args.worst_target else ""
            rows.append([*key, f"{tn:.2f}" if tn else "", f"{to:.2f}" if to else "",
                         f"{ratio:.3f}" if ratio else "", "same" if same else "",
                         (n.get("retimed") or {}).get("winner", ""), info.get("timer", ""), flag or note])
            out_rows.append({"kernel": key[0], "bucket": key[1], "dtype": key[2], "new_us": tn, "old_us": to,
                             "ratio": ratio, "same_config": same, "new_config": n["config"],
                             "old_config": o["config"], "timer": info.get("timer"), "note": flag or note})
    finally:
        if runner is not None:
            runner.close()
    print(tabulate(rows, headers=["kernel", "bucket", "dtype", "budgeted µs", "committed µs", "ratio", "config",
                                  "budget winner", "timer", ""], disable_numparse=True))
    only_old = sorted(set(old) - set(new))
    # stored configs of launches that are no kernel (the fused decode step: `tritune tune-decode`, not `tune all`)
    apart = [k for k in only_old if k[0] in store.CONFIG_KINDS]
    only_old = [k for k in only_old if k[0] not in store.CONFIG_KINDS]
    if apart:
        print(f"\n{len(apart)} committed entries of launches that `tune all` does not tune (tritune tune-decode): "
              + ", ".join(f"{k} {b} {d}" for k, b, d in apart))
    if only_old:
        print(f"\n{len(only_old)} committed buckets the budgeted run did not export: "
              + ", ".join(f"{k} {b} {d}" for k, b, d in only_old[:12]) + (" ..." if len(only_old) > 12 else ""))
    verdict = {"compared": len(ratios), "committed": len(old) - len(apart), "missing": len(only_old) + len(both) - len(ratios),
               "how": "re-timed side by side, interleaved, one process" if args.retime else "recorded times"}
    if ratios:
        g = math.exp(sum(math.log(r) for r, _ in ratios) / len(ratios))
        worst, wkey = max(ratios)
        n_worse = sum(r > args.worst_target for r, _ in ratios)
        met = g <= args.geomean_target and not n_worse
        status = ("MET" if met else "NOT MET") if not verdict["missing"] else ("INCOMPLETE" if met else "NOT MET")
        verdict.update(geomean=round(g, 4), worst=round(worst, 4), worst_bucket=" ".join(wkey),
                       worse_than_target=n_worse, status=status)
        print(f"\ngeomean budgeted/committed {g:.4f} over {len(ratios)} of {verdict['committed']} committed buckets "
              f"({verdict['how']}); worst {worst:.3f} ({' '.join(wkey)}); {n_worse} bucket(s) worse than "
              f"{args.worst_target:.2f}; target: geomean <= {args.geomean_target:.2f}, none worse than "
              f"{args.worst_target:.2f} -> {status}")
    if args.storage:
        verdict["budget_run"] = ledger_summary(args.storage)
        print(f"budgeted run: {verdict['budget_run']['spent_min']} min spent; studies "
              + ", ".join(f"{n} {k}" for k, n in verdict["budget_run"]["studies"].items()))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"verdict": verdict, "rows": out_rows}, indent=1))
        print(f"wrote {args.json_out}")
    return 0 if verdict.get("status") == "MET" else 1


if __name__ == "__main__":
    sys.exit(main())
