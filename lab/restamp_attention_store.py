"""One-off: the attention stores after the TMA=2 / WARP_SPEC=2 change (kernel source 06048ecedd65 -> bbb8dc378f48).
Entries whose launch compiles to the same PTX under triton 3.6 (lab/probes/same_code_restamp.py, log in
lab/logs/cpu/attention_same_code_2026-11-25_94ab3d7/) get the new source stamp; the others, whose code moved,
are dropped (the heuristic default or a fresh entry serves them); the H100 also takes the FA3-grid sweep's
winners measured on the new code (lab/logs/h100/attention_fa3_grid_sweep_new_2026-11-25_12718f8/store), the
faster entry where both have a bucket.   python lab/restamp_attention_store.py VERDICTS.json"""
import json
import sys
from pathlib import Path

verdicts = json.loads(Path(sys.argv[1]).read_text())
new_hash = verdicts["new_hash"]
same = {(v["file"], v["bucket"], v["dtype"]) for v in verdicts["entries"] if v["verdict"] == "same"}
fresh = json.loads(Path("lab/logs/h100/attention_fa3_grid_sweep_new_2026-11-25_12718f8/store/attention.json")
                   .read_text())["entries"]
for f in sorted({v["file"] for v in verdicts["entries"]} | {"tuning/configs/nvidia-h100-80gb-hbm3/attention.json"}):
    path = Path(f)
    data = json.loads(path.read_text())
    keep = {}
    for e in data["entries"]:
        if (f, e["bucket"], e["dtype"]) in same:
            keep[(e["bucket"], e["dtype"])] = {**e, "source": new_hash}
    n_same = len(keep)
    n_fresh = 0
    if "nvidia-h100" in f and path.name == "attention.json":
        for e in fresh:
            k = (e["bucket"], e["dtype"])
            if k not in keep or e["time_us"] < keep[k]["time_us"]:
                keep[k] = e
                n_fresh += 1
    print(f"{f}: {len(data['entries'])} entries -> {n_same} restamped (same PTX), "
          f"{len(data['entries']) - n_same} dropped (code moved), {n_fresh} from the new sweep")
    if not keep:
        path.unlink()
        print(f"  {f}: no entry left; removed")
        continue
    data["entries"] = sorted(keep.values(), key=lambda e: (e["dtype"], e["bucket"]))
    path.write_text(json.dumps(data, indent=1) + "\n")
