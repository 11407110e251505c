"""Probe (CPU, no GPU needed): does an edit of kernels/_attention_gluon.py change the machine code of any of its
kernels? Every Gluon attention kernel (dense ranks 2 and 4, schedules 0-2, causal or not, with and without lse;
the persistent form; the packed kernel) at D=64 and 128 is compiled for sm90 under the installed triton from the
module's source at ``--old`` (a git revision) and from the working tree; the SASS (cuobjdump, addresses and
encodings dropped) is hashed and compared. The same SASS means the same kernel on the GPU.

    PYTHONPATH=DIR python lab/probes/gluon_attention_same_sass.py --old HEAD [--out FILE]   # DIR: triton only
"""
import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "kernels/_attention_gluon.py"


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sass_hashes(G) -> dict:
    """kernel variant -> hash of its SASS instructions : their count."""
    import triton
    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def comp(fn, sig, vals):
        if "NWG" in fn.arg_names:   # CTAs of two consumer warpgroups: the kernels there were before three
            vals = {n: v for n, v in vals.items() if n != "num_warps"} | {"NWG": 2, "num_warps": vals["num_warps"]}
        full = sig | {n: "constexpr" for n in vals}
        names = list(full)
        consts = {(names.index(n),): v for n, v in vals.items()}
        k = triton.compile(GluonASTSource(fn, full, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": G.MAXNREG[2] if isinstance(G.MAXNREG, dict)
                                                                          else G.MAXNREG})
        with tempfile.TemporaryDirectory() as t:
            f = os.path.join(t, "k.cubin")
            Path(f).write_bytes(k.asm["cubin"])
            sass = subprocess.run([os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump"), "-sass", f],
                                  capture_output=True, text=True).stdout
        ins = [re.sub(r"/\*[0-9a-f]+\*/", "", line).split(";")[0].strip() for line in sass.splitlines()
               if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
        return hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16] + f":{len(ins)}"

    res = {}
    for D, BN, ST in ((64, 128, 3), (128, 128, 2)):
        Dp = triton.next_power_of_2(D)
        for rank in (2, 4):
            lead = [1, 1] if rank == 4 else []
            lq = gl.NVMMASharedLayout.get_default_for(lead + [64, Dp], gl.bfloat16)
            lkv = gl.NVMMASharedLayout.get_default_for(lead + [BN, Dp], gl.bfloat16)
            bq, bkv = ", ".join(map(str, lead + [64, Dp])), ", ".join(map(str, lead + [BN, Dp]))
            dq, dkv = f"tensordesc<bf16[{bq}],{lq!r}>", f"tensordesc<bf16[{bkv}],{lkv!r}>"
            sig = {"q_desc": dq, "k_desc": dkv, "v_desc": dkv, "o_desc": dq, "qk_scale": "fp32", "Tq": "i32",
                   "Tk": "i32", "H": "i32", "H_KV": "i32", "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32",
                   "stride_lm": "i32"}
            for c in (False, True):
                for sch in (0, 1, 2):
                    for lse in (False, True):
                        key = f"dense,D={D},rank={rank},causal={c},sch={sch},lse={lse}"
                        res[key] = comp(G._fa3_fwd, sig, dict(STAGES=ST, CAUSAL=c, SCHEDULE=sch, RANK=rank,
                                                              STORE_LSE=lse, num_warps=4))
            if rank == 4:
                sigp = sig | {"B": "i32"}
                st = 4 if D == 64 else 2
                for c in (False, True):
                    for sch in (1, 2):
                        for lse in (False, True):
                            key = f"persistent,D={D},causal={c},sch={sch},lse={lse}"
                            res[key] = comp(G._fa3_fwd_persistent, sigp, dict(STAGES=st, CAUSAL=c, SCHEDULE=sch,
                                                                              STORE_LSE=lse, num_warps=4))
        Dp_, lq, lkv = G.varlen_layouts(gl.bfloat16, D, BN)
        sig = {n: "*bf16" for n in ("Q", "K", "V", "O")} | {"CuQ": "*i32", "CuK": "*i32"}
        sig |= {f"stride_{t}{d}": "i32" for t in "qkvo" for d in "mh"}
        sig |= {"qk_scale": "fp32", "total_q": "i32", "total_k": "i32", "H": "i32", "H_KV": "i32", "LSE": "*fp32",
                "stride_lh": "i32", "stride_lm": "i32"}
        for c in (False, True):
            for sch in (0, 1, 2):
                key = f"varlen,D={D},causal={c},sch={sch}"
                res[key] = comp(G._fa3_fwd_varlen, sig, dict(D=D, DP=Dp_, BN=BN, LQ=lq, LKV=lkv, STAGES=ST, CAUSAL=c,
                                                             SCHEDULE=sch, STORE_LSE=True, num_warps=4))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision of the module to compare against")
    ap.add_argument("--out", help="JSON of both versions' hashes")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        old = os.path.join(t, "old_gluon.py")
        Path(old).write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{a.old}:{MODULE}"], check=True,
                                            capture_output=True, text=True).stdout)
        before = sass_hashes(load(old, "_gluon_old"))
    after = sass_hashes(load(str(ROOT / MODULE), "_gluon_new"))
    differ = [k for k in before if before[k] != after.get(k)]
    for k in differ:
        print(f"DIFFERENT {k}: {before[k]} -> {after.get(k)}")
    print(f"{len(before) - len(differ)} of {len(before)} kernels the same SASS")
    if a.out:
        Path(a.out).write_text(json.dumps({"old": a.old, "before": before, "after": after}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
