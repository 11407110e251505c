"""The ledger of ``tune all --budget``: per study, in its ``budget`` user attribute, the time spent (sweep
and re-timing, charged after every trial, so a kill loses one trial's worth) and why it stopped; and the
summary table of a budgeted run. ``fmt`` is the one number format of the tuning tables."""
from __future__ import annotations

import math
import time

LEDGER = "budget"    # the study user attribute holding the time spent and why the study stopped
DONE = ("converged", "exhausted", "trials", "no valid config")


def fmt(v, digits: int = 1) -> str:
    """A table cell: a float with ``digits`` decimals, anything else as text, None as empty."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def ledger(study) -> dict:
    """{"spent_s", "stop", "calls"} of a study (zeros for one the budgeted run never touched)."""
    d = study.user_attrs.get(LEDGER)
    return {"spent_s": 0.0, "stop": None, "calls": 0, **(d if isinstance(d, dict) else {})}


class Meter:
    """Adds wall time to a study's ledger as it goes (after every trial, so a kill loses one trial's)."""

    def __init__(self, study):
        self.study, self.mark = study, time.time()
        self.written = self.mark
        self.led = ledger(study)

    def charge(self, write: bool = False, **updates) -> None:
        """Add the time since the last charge; written after a trial was evaluated (``write``), with
        ``updates``, or when 0.5 s passed (free proposals, pruned or duplicates, come in bursts: a journal
        write per evaluated trial, not per proposal)."""
        now = time.time()
        self.led["spent_s"] = round(self.led["spent_s"] + (now - self.mark), 3)
        self.mark = now
        self.led.update(updates)
        if write or updates or now - self.written >= 0.5:
            self.study.set_user_attr(LEDGER, self.led)
            self.written = now


def spent_s(rows: list[dict]) -> float:
    return sum((r.get("ledger") or {}).get("spent_s", 0.0) for r in rows)


def summary_table(rows: list[dict], budget_s: float | None = None, wall_s: float | None = None) -> str:
    """Per study: trials (of them after the seeds), why it stopped, time spent, the default's, the best
    warm seed's and the tuned best's times (re-timed side by side where there were rivals), the winner;
    then the totals: studies by stop reason, budget spent, this call's wall time, the geomean gain."""
    import collections

    from tabulate import tabulate

    table = []
    for r in rows:
        rt = r.get("retimed") or {}
        t = rt.get("times_us", {})
        led = r.get("ledger") or {}
        win_us, def_us = rt.get("time_us", r.get("best_us")), rt.get("default_us", r.get("default_us"))
        winner = rt.get("winner") or ("tuned (not re-timed)" if r.get("config") else "-")
        if r.get("config") and not rt and led.get("retime_candidates") == 1:
            winner = "tuned (no rival)"
        pr = r.get("progress") or {}
        table.append([r.get("kernel"), r.get("bucket"), r.get("dtype"), r.get("trials", 0),
                      pr.get("sampler", ""), local_label(pr), r.get("failed", 0), stop_label(r),
                      f"{led.get('spent_s', 0.0):.1f}",
                      fmt(t.get("default", r.get("default_us"))), fmt(t.get("seed", r.get("seed_us"))),
                      fmt(t.get("tuned", r.get("best_us"))), winner,
                      f"{def_us / win_us:.2f}x" if win_us and def_us else ""])
    head = ["kernel", "bucket", "dtype", "trials", "after seeds", "local (gains)", "failed", "stopped", "spent s",
            "default µs",
            "warm seed µs", "tuned µs", "winner", "vs default"]
    text = tabulate(table, headers=head, disable_numparse=True)
    stops = collections.Counter(stop_label(r) for r in rows)
    text += "\nstudies: " + ", ".join(f"{n} {k}" for k, n in stops.most_common())
    tot = collections.Counter()
    for r in rows:
        tot.update({k: v for k, v in (r.get("progress") or {}).items() if k.startswith(("local", "bucket_seed"))})
    if tot["local"] or tot["bucket_seeds"]:
        text += (f"\nlocal search: {tot['local']} trials (one-step neighbours of a study's best) in "
                 f"{sum(1 for r in rows if (r.get('progress') or {}).get('local'))} studies, {tot['local_gains']} "
                 f"of them a gain; fill: {tot['bucket_seeds']} nearest-bucket winners tried, "
                 f"{tot['bucket_seed_gains']} of them a gain")
    spent = spent_s(rows)
    if budget_s:
        text += f"\nbudget: {spent / 60:.1f} of {budget_s / 60:.1f} min spent (all calls, in the storage)"
    if wall_s is not None:
        text += f"; this call's wall time {wall_s / 60:.1f} min"
    sp = [(r["retimed"] or {}).get("default_us", 0) / r["retimed"]["time_us"] for r in rows
          if (r.get("retimed") or {}).get("default_us") and r["retimed"].get("time_us")]
    if sp:
        g = math.exp(sum(map(math.log, sp)) / len(sp))
        text += f"\ngeomean of the winners over the default (re-timed side by side): {g:.3f}x over {len(sp)} studies"
    return text


def local_label(progress: dict) -> str:
    """A study's local-search trials (phase 2 and the fill), and how many of them were a gain: '17 (2)'."""
    n = progress.get("local", 0)
    return f"{n} ({progress.get('local_gains', 0)})" if n else ""


def stop_label(row: dict) -> str:
    """Why a study stopped; 'seeds only' when the budget ended before its search began."""
    stop = (row.get("ledger") or {}).get("stop")
    return stop or ("seeds only" if row.get("trials") else "not run")


def ledger_empty() -> dict:
    return {"spent_s": 0.0, "stop": None, "calls": 0}
