"""After an edit to gemm's jitted code: keep the store entries whose launch compiles exactly as before.

For each committed gemm entry (both GPUs), the launch's PRE_EPI is worked out as the launcher does
(132 SMs on the H100 and the H200), and the entry's launch is compiled at ``--old`` and in the working
tree (scripts/ptx_same.py). When the PTX is the same (PRE_EPI = 0: split-K, persistent programs that
take several tiles; or no bias and no residual to prefetch), its source hash is moved to the current one (its timing stands: the code did not change) and
``restamped`` records from which hash and why. Every other entry is printed as a tune job line
(``gemm|budget|trials|problem``) for re-tuning.

  TRITON_INTERPRET=0 python scripts/restamp_gemm.py --old 592d085 [--write] [--jobs FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ptx_same  # noqa: E402
from tritune.kernels import gemm as G  # noqa: E402
from tritune.kernels.runtime import store  # noqa: E402

SMS = 132


def problem_of(text: str) -> G.Problem:
    kw = {}
    for part in text.split():
        k, _, v = part.partition("=")
        kw[k] = None if v == "None" else v == "True" if v in ("True", "False") else v if k == "act" else int(v)
    return G.Problem(**kw)


def launch_consts(p: G.Problem, cfg: dict) -> tuple[dict, int]:
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    _, pre = G.launch_shape(cfg, p.M, p.N, None, SMS)
    a_strides = (1, p.M) if p.trans_a else (p.K, 1)
    b_strides = (1, p.K) if p.trans_b else (p.N, 1)
    a_tma = G._tma_layout(p.M, p.K, *a_strides, 2, bm, bk) if cfg["TMA"] else None
    b_tma = G._tma_layout(p.K, p.N, *b_strides, 2, bk, bn) if cfg["TMA"] else None
    consts = dict(ptx_same.BASE, HAS_BIAS=p.bias, ACT=1 if p.act else 0, HAS_RES=p.residual, BLOCK_M=bm, BLOCK_N=bn,
                  BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], SPLIT_K=cfg["SPLIT_K"], EVEN_K=p.K % bk == 0,
                  A_MODE=a_tma[0] if a_tma else 0, B_MODE=b_tma[0] if b_tma else 0, A_M_CONTIG=p.trans_a,
                  B_N_CONTIG=not p.trans_b, PERSISTENT=cfg["PERSISTENT"], PRE_EPI=pre)
    return consts, pre


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--jobs", help="write the re-tune job lines here")
    args = ap.parse_args()
    old = ptx_same.old_module(args.old)
    new_hash = store.source_hash("gemm")
    jobs = []
    for slug in ("nvidia-h100-80gb-hbm3", "nvidia-h200"):
        path = store.path_for("gemm", slug)
        data = json.loads(path.read_text())
        for e in data["entries"]:
            if e.get("source") == new_hash:
                continue
            p = problem_of(e["problem"])
            consts, pre = launch_consts(p, e["config"])
            # every entry is compiled both ways: PRE_EPI > 0 changes nothing without a bias or residual
            same = (ptx_same.ptx(old, consts, e["config"]["num_warps"], e["config"]["num_stages"])
                    == ptx_same.ptx(G, consts, e["config"]["num_warps"], e["config"]["num_stages"]))
            print(f"{slug} {e['bucket']}: PRE_EPI={pre} {'same PTX: kept' if same else 're-tune'}", flush=True)
            if same:
                e["restamped"] = {"from": e.get("source"), "commit": args.old,
                                  "why": "PRE_EPI=0: compiles to the same PTX (scripts/ptx_same.py)"}
                e["source"] = new_hash
            else:
                jobs.append((slug, e["bucket"], e["problem"]))
        if args.write:
            path.write_text(json.dumps(data, indent=1) + "\n")
    if args.jobs:
        with open(args.jobs, "w") as f:
            for slug, bucket, problem in jobs:
                f.write(f"{slug}|{bucket}|{problem}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
