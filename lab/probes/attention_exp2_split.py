"""Probe (CPU, no GPU needed): the attention kernels' EXP2 key compiled for sm90 — how many exponentials
each consumer thread's SASS runs on the MUFU (``MUFU.EX2``) against the FMA pipes (``FFMA``), registers and
spills, for EXP2 0 / 1 / 2 (kernels/_attention_gluon.py's module doc). Runs under triton alone (no torch):
the Gluon module is loaded from its file.

    python lab/probes/attention_exp2_split.py [--dims 64,128] [--out FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path


def load_gluon():
    path = Path(__file__).resolve().parents[2] / "kernels" / "_attention_gluon.py"
    spec = importlib.util.spec_from_file_location("_attention_gluon_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def compile_row(G, D: int, causal: bool, schedule: int, exp2: int, BN: int = 128, stages: int = 2) -> dict:
    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    Dp = triton.next_power_of_2(D)
    lq = gl.NVMMASharedLayout.get_default_for([G.BM, Dp], gl.bfloat16)
    lkv = gl.NVMMASharedLayout.get_default_for([BN, Dp], gl.bfloat16)
    dq, dkv = f"tensordesc<bf16[{G.BM}, {Dp}],{lq!r}>", f"tensordesc<bf16[{BN}, {Dp}],{lkv!r}>"
    sig = {"q_desc": dq, "k_desc": dkv, "v_desc": dkv, "o_desc": dq, "qk_scale": "fp32", "Tq": "i32", "Tk": "i32",
           "H": "i32", "H_KV": "i32", "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32", "stride_lm": "i32"}
    vals = dict(STAGES=stages, CAUSAL=causal, SCHEDULE=schedule, RANK=2, STORE_LSE=False, EXP2=exp2, num_warps=4)
    full = sig | {n: "constexpr" for n in vals}
    names = list(full)
    consts = {(names.index(n),): v for n, v in vals.items()}
    try:
        k = triton.compile(GluonASTSource(G._fa3_fwd, full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": G.MAXNREG})
    except Exception as e:  # noqa: BLE001 - a failed compile is the answer
        return {"error": f"{type(e).__name__}: {e}"[:1500]}
    bindir = os.path.join(os.path.dirname(nv.__file__), "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cub = os.path.join(tmp, "k.cubin")
        Path(cub).write_bytes(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cub], capture_output=True, text=True).stdout
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(k.asm["ptx"])
        r = subprocess.run([os.path.join(bindir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", cub],
                           capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    g = re.search(r"Used (\d+) registers", r.stderr)
    return {"mufu_ex2": len(re.findall(r"MUFU\.EX2", sass)), "ffma": len(re.findall(r"\bFFMA\b", sass)),
            "fadd": len(re.findall(r"\bFADD\b", sass)), "shf_or_iadd": len(re.findall(r"\b(SHF|IADD3|IMAD\.SHL|LEA)\b", sass)),
            "registers": int(g.group(1)) if g else None,
            "spill_stores": int(m.group(1)) if m else None, "spill_loads": int(m.group(2)) if m else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    G = load_gluon()
    rows = {}
    for D in (int(d) for d in args.dims.split(",")):
        for causal in (False, True):
            for schedule in (1, 2):
                for exp2 in (0, 1, 2):
                    key = f"D={D},causal={int(causal)},schedule={schedule},EXP2={exp2}"
                    rows[key] = compile_row(G, D, causal, schedule, exp2)
                    print(key, rows[key], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
