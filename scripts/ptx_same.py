"""Does gemm's jitted code at another commit compile to the same PTX as the working tree's, for the
launches that take PRE_EPI = 0 (split-K, persistent programs with several tiles)? No GPU needed: it
compiles for sm_90 (Triton's own ptxas) and compares the instructions (debug line info dropped).
A store entry whose launch compiles identically keeps its timing when the source hash moves on
(scripts/restamp_gemm.py); any other entry is re-tuned.

  TRITON_INTERPRET=0 python scripts/ptx_same.py 592d085
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import tritune.kernels.gemm as NEW  # noqa: E402


def old_module(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:kernels/gemm.py"], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    src = src.replace("SPEC = K.register(K.KernelSpec(", "SPEC = (lambda s: s)(K.KernelSpec(")  # not registered twice
    path = os.path.join(tempfile.mkdtemp(), "gemm_old.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("gemm_old", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gemm_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def ptx(mod, consts: dict, warps: int, stages: int) -> list[str]:
    fn = mod._gemm_kernel
    names = fn.arg_names
    ptrs = ["A", "B", "C", "Bias", "R", "W", "Locks"]
    sig = {p: "*bf16" for p in ptrs}
    sig["W"], sig["Locks"] = "*fp32", "*i32"
    c = {k: v for k, v in consts.items() if k in names}
    unit = {"s_ak": 1, "s_bn": 1, "s_cn": 1, "s_bias": 1, "s_rn": 1, "s_a0": 0}
    for i in ("M", "N", "K", "M1", "s_a0", "s_am", "s_ak", "s_bk", "s_bn", "s_cm", "s_cn", "s_bias", "s_rm", "s_rn"):
        if i in unit:
            c[i] = unit[i]
        else:
            sig[i] = "i32"
    for k in c:
        sig[k] = "constexpr"
    # TMA descriptors: mode 1 the operand's own box, mode 2 its transpose's (a column-major view)
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    if c.get("A_MODE"):
        sig["A"] = f"tensordesc<bf16[{bm}, {bk}]>" if c["A_MODE"] == 1 else f"tensordesc<bf16[{bk}, {bm}]>"
    if c.get("B_MODE"):
        sig["B"] = f"tensordesc<bf16[{bk}, {bn}]>" if c["B_MODE"] == 1 else f"tensordesc<bf16[{bn}, {bk}]>"
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, t in sig.items() if t in ("*bf16", "*fp32", "*i32", "i32")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in c.items()}, attrs=attrs)
    text = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
    out = []
    for line in text.split("\n"):
        s = line.strip()
        if s.startswith((".loc", ".file", "//")):
            continue
        if s.startswith(".section") and "debug" in s:
            break
        out.append(re.sub(r"//.*", "", line).rstrip())
    return out


BASE = dict(HAS_BIAS=True, ACT=0, HAS_RES=True, GROUP_M=8, EVEN_K=True, A_3D=False, A_M_CONTIG=False, B_N_CONTIG=True,
            INT64=False, PRECISION="ieee", FLATTEN=True, WARP_SPEC=False, PRE_EPI=0, SPLIT_K=1, A_MODE=0, B_MODE=0,
            PERSISTENT=False, PDL=False)
CASES = {
    "persistent TMA 128x256 bias+GELU+residual": (dict(BASE, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, A_MODE=1, B_MODE=1,
                                                       PERSISTENT=True, ACT=1), 8, 3),
    "persistent TMA 128x256 plain": (dict(BASE, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, A_MODE=1, B_MODE=1, PERSISTENT=True,
                                          HAS_BIAS=False, HAS_RES=False), 8, 4),
    "persistent TMA 128x128 bias": (dict(BASE, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, A_MODE=1, B_MODE=1, PERSISTENT=True,
                                         HAS_RES=False), 8, 4),
    "persistent pointers 128x128 bias+residual": (dict(BASE, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, PERSISTENT=True), 8, 4),
    "persistent TMA 128x256, B transposed": (dict(BASE, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, A_MODE=1, B_MODE=2,
                                                  PERSISTENT=True, HAS_BIAS=False, HAS_RES=False, B_N_CONTIG=False), 8, 3),
    "split-K 4, 64x32": (dict(BASE, BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, SPLIT_K=4, GROUP_M=1), 4, 4),
    "split-K 8, 16x32": (dict(BASE, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=8, GROUP_M=1), 2, 4),
    "split-K 16, 16x16, B transposed": (dict(BASE, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SPLIT_K=16, GROUP_M=1,
                                             B_N_CONTIG=False), 2, 3),
}


def main() -> int:
    old = old_module(sys.argv[1] if len(sys.argv) > 1 else "HEAD")
    bad = 0
    for name, (consts, warps, stages) in CASES.items():
        same = ptx(old, consts, warps, stages) == ptx(NEW, consts, warps, stages)
        bad += not same
        print(f"{name}: {'identical' if same else 'DIFFERENT'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
