"""Probe (CPU, no GPU needed): do the Gluon attention kernels fit their registers? Every CTA shape (two or three
consumer warpgroups) x head dim x key tile x schedule x form (dense, persistent, packed) is compiled for sm90
under the installed triton; printed per kernel: the register-spill instructions in its SASS (STL/LDL: local
memory), the setmaxnreg values in its PTX, and its instruction count. A kernel with spills is a point the config
space should refuse.

    PYTHONPATH=DIR python lab/probes/gluon_attention_spills.py [--out FILE]   # DIR: triton 3.6 only
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON of the results")
    ap.add_argument("--nwg", default="2,3")
    ap.add_argument("--dims", default="32,64,128")
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("_gluon", ROOT / "kernels/_attention_gluon.py")
    G = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(G)
    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def comp(fn, sig, vals, nwg):
        full = sig | {n: "constexpr" for n in vals}
        names = list(full)
        consts = {(names.index(n),): v for n, v in vals.items()}
        k = triton.compile(GluonASTSource(fn, full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": G.MAXNREG[nwg]})
        with tempfile.TemporaryDirectory() as t:
            f = os.path.join(t, "k.cubin")
            Path(f).write_bytes(k.asm["cubin"])
            sass = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-sass", f],
                                  capture_output=True, text=True).stdout
        ins = [line for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
        spills = sum(1 for line in ins if re.search(r"\b(STL|LDL)\b", line))
        regs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])))
        return {"spill_instructions": spills, "setmaxnreg": regs, "instructions": len(ins),
                "shared": k.metadata.shared}

    res = {}
    for nwg in map(int, a.nwg.split(",")):
        for D in map(int, a.dims.split(",")):
            for BN in (64, 128):
                Dp = triton.next_power_of_2(D)
                lq = gl.NVMMASharedLayout.get_default_for([1, 1, 64, Dp], gl.bfloat16)
                lkv = gl.NVMMASharedLayout.get_default_for([1, 1, BN, Dp], gl.bfloat16)
                dq = f"tensordesc<bf16[1, 1, 64, {Dp}],{lq!r}>"
                dkv = f"tensordesc<bf16[1, 1, {BN}, {Dp}],{lkv!r}>"
                sig = {"q_desc": dq, "k_desc": dkv, "v_desc": dkv, "o_desc": dq, "qk_scale": "fp32", "Tq": "i32",
                       "Tk": "i32", "H": "i32", "H_KV": "i32", "LSE": "*fp32", "stride_lb": "i32",
                       "stride_lh": "i32", "stride_lm": "i32"}
                for c in (False, True):
                    for sch in (0, 1, 2):
                        key = f"dense,nwg={nwg},D={D},BN={BN},causal={c},sch={sch}"
                        try:
                            res[key] = comp(G._fa3_fwd, sig, dict(STAGES=2, CAUSAL=c, SCHEDULE=sch, RANK=4,
                                                                  STORE_LSE=True, NWG=nwg, num_warps=4), nwg)
                        except Exception as e:  # noqa: BLE001 - a compile failure is a result here
                            res[key] = {"error": str(e).splitlines()[0][:200]}
                        print(key, res[key], flush=True)
                    for sch in (1, 2):
                        key = f"persistent,nwg={nwg},D={D},BN={BN},causal={c},sch={sch}"
                        try:
                            res[key] = comp(G._fa3_fwd_persistent, sig | {"B": "i32"},
                                            dict(STAGES=2, CAUSAL=c, SCHEDULE=sch, STORE_LSE=True, NWG=nwg,
                                                 num_warps=4), nwg)
                        except Exception as e:  # noqa: BLE001
                            res[key] = {"error": str(e).splitlines()[0][:200]}
                        print(key, res[key], flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
