"""GPU A/B (tuning/precompile.py): two `tune --budget` journals of one kernel, precompile helpers off and on.

Per journal: evaluated trials, their median and summed phases (first launch with the compile, reference and
check, timing), and the best time per study; then the ratio of the two runs' bests per study (a helper that
disturbed the timings would show as slower bests or a wider spread, not only as more trials).

    python lab/probes/precompile_ab.py OFF.journal ON.journal
"""
from __future__ import annotations

import statistics
import sys

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend


def load(path):
    st = JournalStorage(JournalFileBackend(path))
    out = {}
    for s in optuna.get_all_study_summaries(st):
        trials = [t for t in optuna.load_study(study_name=s.study_name, storage=st).trials
                  if isinstance(t.user_attrs.get("evaluated"), dict)]
        out[s.study_name.split(":")[1]] = trials
    return out


def main(off, on) -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    runs = {"off": load(off), "on": load(on)}
    for name, studies in runs.items():
        trials = [t for ts in studies.values() for t in ts]
        ph = {k: [t.user_attrs["evaluated"].get("phases", {}).get(k, 0.0) for t in trials]
              for k in ("launch_s", "check_s", "time_s")}
        print(f"{name}: {len(trials)} trials in {len(studies)} studies; medians launch {statistics.median(ph['launch_s']):.3f}"
              f" check {statistics.median(ph['check_s']):.3f} time {statistics.median(ph['time_s']):.3f} s; sums "
              + " ".join(f"{k} {sum(v):.1f}" for k, v in ph.items()))
    ratios = []
    for b in sorted(set(runs["off"]) & set(runs["on"])):
        bo = min((t.value for t in runs["off"][b] if t.value is not None), default=None)
        bn = min((t.value for t in runs["on"][b] if t.value is not None), default=None)
        if bo and bn:
            ratios.append(bn / bo)
            print(f"  {b:45s} off {bo:9.2f} us ({len(runs['off'][b])} trials)  on {bn:9.2f} us "
                  f"({len(runs['on'][b])} trials)  {bn / bo:.3f}")
    if ratios:
        print(f"best on/off: geomean {statistics.geometric_mean(ratios):.3f}, max {max(ratios):.3f}, min {min(ratios):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
