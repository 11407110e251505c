"""Merge FA3-grid winners (``lab/bench_attention_fa3_grid.py --emit``) into a committed attention store: per
(bucket, dtype) the committed entry is replaced only where the grid's best config beat the launcher's own (the
committed entry, timed in the same process) by more than ``--margin`` (default 3%, beyond run-to-run spread).
Entries keep their own stamps; the file keeps its header.

    python lab/merge_fa3_grid_winners.py GRID_JSON EMITTED_STORE_JSON tuning/configs/<gpu>/attention.json \
        [--margin 0.03]
"""
import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("grid_json", type=Path)
    ap.add_argument("emitted", type=Path)
    ap.add_argument("store", type=Path)
    ap.add_argument("--margin", type=float, default=0.03)
    a = ap.parse_args()
    rows = json.loads(a.grid_json.read_text())["rows"]
    emitted = {(e["problem"], e["dtype"]): e for e in json.loads(a.emitted.read_text())["entries"]}
    store = json.loads(a.store.read_text())
    index = {(e["bucket"], e["dtype"]): i for i, e in enumerate(store["entries"])}
    names = {"bf16": "bfloat16", "fp16": "float16"}
    for r in rows:
        if not r.get("best_us") or not r.get("ours_us") or r["best_config"] == r["ours_config"]:
            continue
        gain = r["ours_us"] / r["best_us"]
        what = f"{r['dtype']} D={r['D']} {'causal' if r['causal'] else 'full'} T={r['T']}"
        if gain < 1 + a.margin:
            print(f"kept   {what}: best {gain:.3f}x the stored config (within {a.margin:.0%})")
            continue
        e = next((e for (prob, dt), e in emitted.items() if dt == names[r["dtype"]] and e["config"] == r["best_config"]
                  and f"D={r['D']} " in prob + " " and f"Tq={r['T']} " in prob and f"causal={r['causal']}" in prob),
                 None)
        if e is None:
            print(f"MISSING {what}: no emitted entry")
            continue
        key = (e["bucket"], e["dtype"])
        if key in index:
            store["entries"][index[key]] = e
        else:
            store["entries"].append(e)
        print(f"merged {what}: {r['ours_us']:.1f} -> {r['best_us']:.1f} us ({gain:.3f}x), "
              f"{r['best_us'] and r['sdpa_us'] / r['best_us']:.3f}x SDPA")
    a.store.write_text(json.dumps(store, indent=1) + "\n")


if __name__ == "__main__":
    main()
