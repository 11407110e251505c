"""Merge a budgeted run's store into a committed store by the side-by-side re-timing of
``lab/compare_tune_all.py --retime --json`` (one process, interleaved rounds): per bucket the committed
entry is replaced only where the budgeted winner was faster by more than ``--margin`` (default 3%,
beyond the re-timing's spread); buckets the committed store lacks are added (each was verified against
the float64 reference and re-timed against the default in its study). Entries keep their own stamps.

    python lab/merge_store_by_retime.py COMPARE_JSON NEW_STORE_DIR tuning/configs/<gpu> [--margin 0.03]
"""
import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("compare_json")
    ap.add_argument("new_dir", type=Path)
    ap.add_argument("old_dir", type=Path)
    ap.add_argument("--margin", type=float, default=0.03)
    a = ap.parse_args()
    rows = json.loads(Path(a.compare_json).read_text())["rows"]
    faster = {(r["kernel"], r["bucket"], r["dtype"]) for r in rows
              if not r.get("same_config") and r.get("ratio") and r["ratio"] < 1.0 - a.margin}
    compared = {(r["kernel"], r["bucket"], r["dtype"]) for r in rows}
    for new_file in sorted(a.new_dir.glob("*.json")):
        new = json.loads(new_file.read_text())
        old_file = a.old_dir / new_file.name
        old = json.loads(old_file.read_text()) if old_file.exists() else dict(new, entries=[])
        index = {(e["bucket"], e["dtype"]): i for i, e in enumerate(old["entries"])}
        replaced = added = 0
        for e in new["entries"]:
            key = (new["kernel"], e["bucket"], e["dtype"])
            i = index.get((e["bucket"], e["dtype"]))
            if i is None and key not in compared:
                old["entries"].append(e)
                added += 1
            elif i is not None and key in faster:
                old["entries"][i] = e
                replaced += 1
        if replaced or added:
            old_file.write_text(json.dumps(old, indent=1) + "\n")
        print(f"{new_file.name}: {replaced} replaced (faster by > {a.margin:.0%}), {added} added")


if __name__ == "__main__":
    main()
