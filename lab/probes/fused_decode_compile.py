"""Does the fused decode kernel compile for sm90 with this Triton, and at what register cost? Offline: no
GPU needed (Triton's own ptxas), so a Triton version the GPU machine runs can be checked from a CPU box.

    python lab/probes/fused_decode_compile.py [--dtype bf16] [--block-m 1 64] [--block-k 128] [--block-n 32]
                                              [--warps 8] [--debug 0]

Prints, per variant: compiled or the error, registers and spill bytes (ptxas -v), and the weight loads'
widths (16-byte ``ld.global.v4`` vs scalar ``b16``). Integer arguments that Triton would specialise as
multiples of 16 at a real launch (n_embd, MLP width, head dim, block size, strides) are declared so.
Found with it: at 16-row tiles triton 3.6's TritonGPUPrefetch pass fails on the kernel's loop (hence
64-row wgmma tiles for 16-bit rows, kernels.fused_decode.block_m); loop-carried strides and bounds take
no tl.multiple_of hint, so the kernel rounds them to multiples of 8 (scalar b16 loads otherwise).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

KERNEL_FILE = Path(__file__).resolve().parents[2] / "kernels" / "fused_decode.py"
I32_PTRS = {"Slots", "BT", "Ctx", "Tick", "ATick", "Bar", "Dbg"}
F32_PTRS = {"Work", "AWork"}
SIZES = {"M", "L", "E", "F", "V", "H", "D", "SPLIT_QKV", "SPLIT_O", "SPLIT_FC", "SPLIT_PROJ", "SPLIT_LM"}  # ints, not pointers
DIV16 = {"E", "F", "D", "block_size", "s_kv_layer", "s_bt", "s_ln", "s_log"}


def load_kernel():
    try:
        import torch  # noqa: F401  (the kernel module names torch dtypes; a Triton-only venv gets a stub)
    except ImportError:
        import types

        sys.modules["torch"] = types.ModuleType("torch")
    spec = importlib.util.spec_from_file_location("fused_decode_probe", KERNEL_FILE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod._fused_decode_kernel


def compile_one(fn, dtype, block_m, block_k, block_n, warps, debug, a_ln=1024, lm_n=0, lm_k=0):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, LM_BLOCK_N=lm_n or block_n,
                  LM_BLOCK_K=lm_k or block_k, LN_BLOCK=a_ln, BLOCK_T=32, BLOCK_D=64,
                  LM_KMAJOR=True, SYNC=True, DEBUG=debug)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in I32_PTRS:
            sig[n] = "*i32"
        elif n in F32_PTRS:
            sig[n] = "*fp32"
        elif n in ("eps", "qk_scale"):
            sig[n] = "fp32"
        elif n[0].isupper() and n not in SIZES:
            sig[n] = "*" + dtype
        else:
            sig[n] = "i32"
    div = [i for i, n in enumerate(names) if sig[n].startswith("*") or n in DIV16]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
    return k.asm["ptx"]


def ptxas_info(ptx: str) -> str:
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    # a newer Triton may emit a PTX ISA version its bundled ptxas does not know: 8.4 has what sm90 needs
    ptx = re.sub(r"^\.version \d+\.\d+", ".version 8.4", ptx, count=1, flags=re.M)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(p), "-o", str(Path(d) / "k.cubin")],
                           capture_output=True, text=True)
    info = " ".join(l.strip() for l in r.stderr.splitlines() if "registers" in l or "spill" in l)
    return info or r.stderr.strip()[-300:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--block-m", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=32)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--debug", type=int, default=0)
    ap.add_argument("--lm-block-n", type=int, default=0, help="the LM head's block (0: --block-n)")
    ap.add_argument("--lm-block-k", type=int, default=0, help="the LM head's block (0: --block-k)")
    ap.add_argument("--ln-block", type=int, default=1024, help="next power of 2 of n_embd (1024: GPT-2 small)")
    a = ap.parse_args(argv)
    import triton

    fn = load_kernel()
    print(f"triton {triton.__version__}, sm90, BLOCK_K {a.block_k}, BLOCK_N {a.block_n}, {a.warps} warps")
    bad = 0
    for dt in a.dtype:
        for bm in a.block_m:
            try:
                ptx = compile_one(fn, dt, bm, a.block_k, a.block_n, a.warps, a.debug, a.ln_block, a.lm_block_n, a.lm_block_k)
            except Exception as e:  # noqa: BLE001  (a failing variant is the answer, not a crash)
                print(f"{dt} BLOCK_M={bm}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                bad += 1
                continue
            loads = {w: len(re.findall(rf"ld\.global\.{w}\b", ptx)) for w in ("v4.b32", "b16")}
            print(f"{dt} BLOCK_M={bm}: ok; {ptxas_info(ptx)}; weight loads v4 {loads['v4.b32']}, "
                  f"scalar b16 {loads['b16']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
