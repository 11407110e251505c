"""Summarise every tritune study in an Optuna storage: trials, failures, best, default, workers.

    python benchmarks/study_report.py STORAGE [--results DIR]

Used after a multi-worker sweep to show that every worker's trials landed in the same studies. Appends one
keyed row per study (benchmarks/rows.py: commit, date, versions) to results/<gpu-slug>/tune_studies.json,
the slug the study's own (the GPU it was tuned on).
"""
from __future__ import annotations

import argparse
import sys

from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

from tritune.tuning import search


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("storage", help="journal file path or RDB URL")
    p.add_argument("--results", default="results", help="results root (default: results)")
    a = p.parse_args(argv)
    storage = search.open_storage(a.storage)
    rows = [search.study_stats(st) for st in search.tuned_studies(storage)]
    for slug in sorted({r.get("slug") or "" for r in rows}):
        path = write_rows("tune_studies", [r for r in rows if (r.get("slug") or "") == slug], a.results,
                          slug=slug or None, storage=a.storage)
        print(f"wrote {path}")
    for r in rows:
        print(f"{r['study']}: {r['trials']} evaluated ({r['failed']} failed) by {len(r['workers'])} workers "
              f"{r['workers']}; best {r['best_us']} us vs default {r['default_us']} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
