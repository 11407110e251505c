"""Summarise every tritune study in an Optuna storage as JSON: trials, failures, best, default, workers.

    python scripts/study_report.py STORAGE [--out FILE]

Used after a multi-worker sweep to show that every worker's trials landed in the same studies.
"""
from __future__ import annotations

import argparse
import json
import sys

from tritune.tuning import search


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("storage", help="journal file path or RDB URL")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    storage = search.open_storage(a.storage)
    rows = [search.study_stats(st) for st in search.tuned_studies(storage)]
    text = json.dumps(rows, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    for r in rows:
        print(f"{r['study']}: {r['trials']} evaluated ({r['failed']} failed) by {len(r['workers'])} workers "
              f"{r['workers']}; best {r['best_us']} us vs default {r['default_us']} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
