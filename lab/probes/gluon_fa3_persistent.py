"""Probe (issue #28): does a persistent version of attention's Gluon FA3 kernel close the short-sequence gap?

On the H200 the registered Gluon path (kernels/_attention_gluon.py, attention's WARP_SPEC 3-5) is at
0.97x cuDNN at the median of FA3's grid but 0.88-0.92x at 1k-2k tokens
(lab/logs/h200/attention_fa3_grid_gluon_2026-11-28_d9eae70). There a CTA owns one 128-row tile: at 1k tokens
it streams 8 key tiles, and its prologue (Q load, first QK^T) and epilogue (normalise, O store) are hidden
behind nothing. FA3 runs persistent CTAs, so the producer loads the next tile's Q and K/V while the
consumers finish the current one.

This kernel: one CTA per SM, looping over (query tile, batch-head) work items (causal: the heaviest query
tiles first across the whole grid); the registered kernel's partitions (two 64-row consumer warpgroups, a
one-warp TMA producer) and GEMM schedules 1 and 2 (FA3's order; with ping-pong); the K/V ring's slot and
phase, and the ping-pong turn, carried across items by running counts; Q **double-buffered** per
warpgroup (``q_free`` barriers: the producer loads the next item's Q while the consumers still hold this
one's buffer, which carries O out). 4-D descriptors over the tensors' (B, H, T, D) strides (any lengths,
head dims up to 256 padded, strided views). Registered since as attention's WARP_SPEC 6-7: the kernel timed here is
``kernels/_attention_gluon.py``'s ``_fa3_fwd_persistent``.

    python lab/probes/gluon_fa3_persistent.py --compile      # offline sm90 compile (triton only, no torch)
    python lab/probes/gluon_fa3_persistent.py --out F.json   # GPU: checks against float64, then FA3's grid
                                                             # beside the registered Gluon path and SDPA

Every point is checked first (poisoned output, float64 reference, the harness's tolerance), each schedule
in a child process (a barrier deadlock is killed after 150 s); only checked schedules are timed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys

import triton
from triton.experimental.gluon import language as gl

_spec = importlib.util.spec_from_file_location(
    "_attention_gluon", pathlib.Path(__file__).resolve().parents[2] / "kernels" / "_attention_gluon.py")
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)
LOG2E = 1.4426950408889634
SCHEDULES = (1, 2)


# The kernel is the registered one (kernels/_attention_gluon.py: attention's WARP_SPEC 6-7), which began here.
_fa3_persistent = G._fa3_fwd_persistent


def smem_bytes(D: int, BN: int, stages: int) -> int:
    """Four Q buffers (two warpgroups, double-buffered) and a K and a V tile per stage, bf16/fp16."""
    return G.smem_bytes(D, BN, stages, persistent=True)


def tiles(D: int) -> list[tuple[int, int]]:
    """(BN, STAGES) points within 227 KB: 128-key tiles up to D=128 (64 past it), 2-4 stages."""
    Dp = triton.next_power_of_2(D)
    return [(bn, st) for bn in ((128, 64) if Dp <= 128 else (64,)) for st in (2, 3, 4)
            if smem_bytes(D, bn, st) <= 227 * 1024]


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------
def prepare(q, k, v, causal: bool, BN: int = 128, STAGES: int = 2, SCHEDULE: int = 2, sms: int | None = None):
    """(o, a callable launching the persistent kernel into o, descriptors built once). q (B, H, Tq, D),
    k/v (B, H_KV, Tk, D), bf16/fp16, TMA-readable strides, causal needs Tq <= Tk."""
    import torch

    B, H, Tq, D = q.shape
    H_KV, Tk = k.shape[1], k.shape[2]
    if causal and Tq > Tk:
        raise ValueError("causal needs Tq <= Tk")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    descs, _, _ = G.descriptors(q, k, v, o, BN, rank=4)
    sms = sms or torch.cuda.get_device_properties(q.device).multi_processor_count
    n_items = triton.cdiv(Tq, G.ROWS) * B * H
    grid = (max(1, min(n_items, sms)),)
    scale = LOG2E / math.sqrt(D)

    def launch():
        _fa3_persistent[grid](*descs, scale, Tq, Tk, H, H_KV, o, 0, 0, 0, B, STAGES=STAGES, CAUSAL=causal,
                              SCHEDULE=SCHEDULE, STORE_LSE=False,
                              num_warps=4, maxnreg=G.MAXNREG)
    return o, launch


def compile_offline(Ds=(64, 128, 256), causal=(False, True)) -> dict:
    """Compile every (D, BN, STAGES, causal, schedule) for sm90 without a GPU: shared memory and ptxas's
    registers and spills."""
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    out = {}
    for D in Ds:
        Dp = triton.next_power_of_2(D)
        for BN, STAGES in tiles(D):
            for c in causal:
                for sch in SCHEDULES:
                    lq = gl.NVMMASharedLayout.get_default_for([1, 1, G.BM, Dp], gl.bfloat16)
                    lkv = gl.NVMMASharedLayout.get_default_for([1, 1, BN, Dp], gl.bfloat16)
                    dq = f"tensordesc<bf16[1, 1, {G.BM}, {Dp}],{lq!r}>"
                    dkv = f"tensordesc<bf16[1, 1, {BN}, {Dp}],{lkv!r}>"
                    sig = {"q_desc": dq, "k_desc": dkv, "v_desc": dkv, "o_desc": dq, "qk_scale": "fp32", "Tq": "i32",
                           "Tk": "i32", "H": "i32", "H_KV": "i32", "LSE": "*fp32", "stride_lb": "i32",
                           "stride_lh": "i32", "stride_lm": "i32", "B": "i32", "STAGES": "constexpr",
                           "CAUSAL": "constexpr", "SCHEDULE": "constexpr", "STORE_LSE": "constexpr",
                           "num_warps": "constexpr"}
                    names = list(sig)
                    consts = {(names.index("STAGES"),): STAGES, (names.index("CAUSAL"),): c,
                              (names.index("SCHEDULE"),): sch, (names.index("STORE_LSE"),): False,
                              (names.index("num_warps"),): 4}
                    key = f"D={D},BN={BN},STAGES={STAGES},causal={int(c)},schedule={sch}"
                    try:
                        kern = triton.compile(GluonASTSource(_fa3_persistent, sig, constexprs=consts),
                                              target=GPUTarget("cuda", 90, 32),
                                              options={"num_warps": 4, "maxnreg": G.MAXNREG})
                    except Exception as e:  # noqa: BLE001 - a failed compile is the answer
                        out[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                        print(key, out[key]["error"][:300], flush=True)
                        continue
                    with tempfile.TemporaryDirectory() as tmp:
                        f = os.path.join(tmp, "k.ptx")
                        with open(f, "w") as fh:
                            fh.write(kern.asm["ptx"])
                        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f, "-o", os.path.join(tmp, "k.cubin")],
                                           capture_output=True, text=True)
                    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
                    out[key] = {"shared_bytes": kern.metadata.shared,
                                "spill_stores": int(m.group(1)) if m else None,
                                "spill_loads": int(m.group(2)) if m else None}
                    print(key, out[key], flush=True)
    return out


def check(schedule: int) -> list[dict]:
    """One schedule against float64 on poisoned outputs, both dtypes: ragged lengths, GQA, causal Tq < Tk,
    (B, T, H, D) views, every head-dim class, and grids with many items per CTA (few SMs given)."""
    import torch

    from tritune.harness.compare import tolerance

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from gluon_fa3_attention import _reference, poisoned_check

    torch.manual_seed(0)
    rows = []
    shapes = ((1, 3, 3, 256, 256, 64, False, False, None), (2, 4, 2, 384, 384, 128, True, False, None),
              (2, 4, 2, 200, 333, 80, False, False, None), (1, 3, 1, 77, 77, 32, True, False, None),
              (1, 2, 2, 130, 260, 256, True, False, None), (1, 4, 4, 256, 256, 128, True, True, None),
              (4, 8, 2, 1000, 1000, 128, True, False, 7), (3, 5, 5, 700, 900, 64, False, True, 5),
              (2, 4, 4, 1024, 1024, 128, False, False, 3))
    for dtype in (torch.bfloat16, torch.float16):
        for (B, H, HKV, Tq, Tk, D, c, bthd, sms) in shapes:
            if bthd:
                q = torch.randn(B, Tq, H, D, device="cuda", dtype=dtype).transpose(1, 2)
                k, v = (torch.randn(B, Tk, HKV, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
            else:
                q = torch.randn(B, H, Tq, D, device="cuda", dtype=dtype)
                k, v = (torch.randn(B, HKV, Tk, D, device="cuda", dtype=dtype) for _ in range(2))
            ref = _reference(q, k, v, c)
            tol = tolerance(dtype)
            for BN, STAGES in tiles(D):
                rel, good, err = poisoned_check(
                    lambda: prepare(q, k, v, c, BN=BN, STAGES=STAGES, SCHEDULE=schedule, sms=sms), ref, tol)
                what = (f"schedule {schedule} B={B} H={H}/{HKV} T={Tq}x{Tk}{' (B,T,H,D)' if bthd else ''} D={D} "
                        f"causal={int(c)} BN={BN} stages={STAGES} sms={sms or 'all'} {str(dtype)[6:]}")
                print(f"check {what}: rel {rel:.2e} (tol {tol:.1e}) {'ok' if good else 'WRONG'}"
                      f"{' ' + err if err else ''}", flush=True)
                rows.append({"check": what, "rel_err": rel, "tol": tol, "ok": good, **({"error": err} if err else {})})
    return rows


def run_gpu(out_path: str | None, quick: bool, seqlens=None, tile_list=None, checks: bool = True) -> int:
    import torch
    import torch.nn.functional as F

    from tritune.kernels import attention as A

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from gluon_fa3_attention import run_checks, write_rows

    rows, good = run_checks(__file__, SCHEDULES) if checks else ([], list(SCHEDULES))
    print(f"correct schedules: {good}" + ("" if checks else " (not checked in this run)"), flush=True)
    if good:
        seqlens = seqlens or ((1024, 2048, 4096) if quick else (1024, 2048, 4096, 8192, 16384))
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16):
            for D in (64, 128):
                H = 2048 // D
                for causal in (False, True):
                    for T in seqlens:
                        B = 16384 // T
                        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(3))
                        flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
                        r = {"B": B, "H": H, "T": T, "D": D, "causal": causal, "dtype": str(dtype)}
                        fns = {f"persistent_s{sch}_bn{bn}_st{st}": prepare(q, k, v, causal, BN=bn, STAGES=st,
                                                                         SCHEDULE=sch)[1]
                               for sch in good for bn, st in (tile_list or tiles(D))}
                        for w in (4, 5):   # the registered Gluon path, its grid's winning tile
                            cfg = dict(A.default_config(A.Problem(B, H, H, T, T, D, causal), dtype), BLOCK_M=128,
                                       num_warps=4, HEADS_INNER=0, TMA=2, LAZY_RESCALE=0, WARP_SPEC=w, BLOCK_N=128,
                                       num_stages=3)
                            fns[f"registered_ws{w}"] = (lambda cfg=cfg: A.attention(q, k, v, causal=causal, config=cfg))
                        fns["sdpa_default"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        for name, fn in fns.items():
                            try:
                                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                                r[name + "_us"] = round(ms * 1e3, 2)
                                r[name + "_tflops"] = round(flops / ms / 1e9, 1)
                            except Exception as e:  # noqa: BLE001
                                r[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
                        pers = min((v_ for k_, v_ in r.items() if k_.startswith("persistent") and k_.endswith("_us")),
                                   default=None)
                        reg = min((v_ for k_, v_ in r.items() if k_.startswith("registered") and k_.endswith("_us")),
                                  default=None)
                        if pers and "sdpa_default_us" in r:
                            r["persistent_vs_sdpa"] = round(r["sdpa_default_us"] / pers, 3)
                        if pers and reg:
                            r["persistent_vs_registered"] = round(reg / pers, 3)
                        rows.append(r)
                        print({k_: v_ for k_, v_ in r.items() if not k_.endswith("tflops")}, flush=True)
    write_rows(out_path, rows)
    return 0 if good else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="bf16 and 1k-4k tokens only")
    ap.add_argument("--compile", action="store_true", help="compile every point for sm90 offline and stop")
    ap.add_argument("--check-schedule", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlens", default=None, help="comma-separated sequence lengths to time (e.g. 1024,2048)")
    ap.add_argument("--tiles", default=None, help="comma-separated BNxSTAGES points to time (e.g. 128x2,128x3)")
    ap.add_argument("--no-checks", action="store_true",
                    help="time without checking first (only for schedules a logged run checked)")
    a = ap.parse_args(argv)
    if a.compile:
        res = compile_offline()
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if all("error" not in r for r in res.values()) else 1
    if a.check_schedule is not None:
        rows = check(a.check_schedule)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return 0 if all(r["ok"] for r in rows) else 1
    return run_gpu(a.out, a.quick, tuple(int(x) for x in a.seqlens.split(",")) if a.seqlens else None,
                   [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")] if a.tiles else None,
                   not a.no_checks)


if __name__ == "__main__":
    sys.exit(main())
