"""Probe (issue #28): FlashAttention-3's forward structure written in Gluon (triton 3.6) for sm90.

The registered attention kernel (kernels/attention.py, plain Triton) reaches 0.93x cuDNN at the median of
FA3's grid on the H100 and 0.75x at its worst point (lab/logs/h100/attention_fa3_grid_sweep_new_
2026-11-25_12718f8); Triton's own warp specialization (``tl.range(warp_specialize=True)``) is one of its
configs. What Triton's pipeliner does not give is FA3's structure, which Gluon can state directly:

- one CTA per 128 query rows, as **two consumer warpgroups of 64 rows each, in separate partitions**
  (``gl.warp_specialize``), so one warpgroup's softmax can run under the other's tensor-core work;
- a **one-warp producer** partition that TMA-loads Q once and K, V tiles into a ``STAGES``-deep ring
  (separate K and V barriers, so QK^T starts as soon as K lands; a slot is freed when both consumers
  have finished its P @ V);
- P @ V with P from registers (wgmma's A operand), and three schedules of a consumer's GEMMs
  (``SCHEDULE``): 0, QK^T of tile j+1 issued before the softmax of tile j; 1, FA3's intra-warpgroup
  order (QK^T of j+1 and P_j @ V_j issued together, the softmax of j+1 under P_j @ V_j); 2, FA3's
  ping-pong on top of 1 (the warpgroups take turns issuing their GEMM pair, ordered by two mbarriers);
- causal: heaviest query tiles first, the diagonal tile masked, later tiles never loaded.

Two descriptor forms (``RANK``): 2-D over (B*H*T, D) where the tensors are contiguous, Tq a multiple of
128, Tk of the key tile and D a power of two (FA3's grid); else 4-D over the tensors' own (B, H, T, D)
strides with blocks [1, 1, rows, D padded to a power of two] (TMA zero-fills the rows past T and the
columns past D on loads and clips them on stores; the shared tiles are viewed as 2-D for wgmma with
``.reshape``; the last key tile's columns past Tk are masked). Head dims: multiples of 16 up to 256
(``plan``: 128-key tiles up to D 128, 64-key tiles above, so shared memory stays <= 192 KB and the
consumers' registers hold S, the next S, P and the output); GQA; causal aligned bottom-right (key j
visible to query i when j <= i + Tk - Tq), Tq <= Tk. Not yet: varlen, the LSE output, dropout.

    python lab/probes/gluon_fa3_attention.py --compile          # offline sm90 compile, any machine (no torch)
    python lab/probes/gluon_fa3_attention.py --out F.json       # GPU: check against float64, time at FA3's grid

On a GPU each point is checked against a float64 reference (the harness's bf16/fp16 tolerance) before it
is timed (``triton.testing.do_bench`` medians; the probe's launch with its TMA descriptors built once)
beside torch's default SDPA (cuDNN on an H100/H200), SDPA's flash backend and tritune's registered
attention with its stored config.
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

# The kernel is the registered one's (kernels/_attention_gluon.py, attention's WARP_SPEC 3-5), loaded by path
# so that --compile runs without torch (a triton-only environment).
_spec = importlib.util.spec_from_file_location(
    "_attention_gluon", pathlib.Path(__file__).resolve().parents[2] / "kernels" / "_attention_gluon.py")
G = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(G)
_fa3_fwd = G._fa3_fwd
BM = G.BM          # query rows a consumer warpgroup
SCHEDULES = (0, 1, 2)   # see the module's docstring
CONSUMERS = 2      # consumer warpgroups a CTA (128 query rows)
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------
def fa3_attention(q, k, v, causal: bool, sm_scale: float | None = None, **kw):
    """q (B, H, Tq, D), k and v (B, H_KV, Tk, D), bf16/fp16. Returns o (B, H, Tq, D)."""
    o, launch = prepare(q, k, v, causal, sm_scale, **kw)
    launch()
    return o


def _pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def plan(D: int) -> tuple[int, int, int]:
    """(D padded to a power of two, BN, STAGES) for a head dim: shared memory <= 192 KB, and at D 256 a
    64-key tile so the consumers' 240 registers hold S, the next S, P and the output."""
    Dp = _pow2(D)
    return Dp, (128 if Dp <= 128 else 64), (3 if Dp <= 64 else 2)


def prepare(q, k, v, causal: bool, sm_scale: float | None = None, BN: int | None = None, STAGES: int | None = None,
            SCHEDULE: int = 2, maxnreg: int = 168, rank: int | None = None):
    """(o, a callable launching the kernel into o with descriptors built once): what the timing runs.
    ``rank`` 2: descriptors over (B*H*T, D) (contiguous tensors, Tq a multiple of 128, Tk of BN, D a power
    of two); 4: over (B, H, T, D) with the tensors' strides (any T, D a multiple of 16 up to 256, any
    strides TMA takes); default: 2 where it applies."""
    import torch

    B, H, Tq, D = q.shape
    H_KV, Tk = k.shape[1], k.shape[2]
    Dp, bn, st = plan(D)
    BN, STAGES = BN or bn, STAGES or st
    why = None
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        why = "bf16 or fp16, one dtype"
    elif D % 16 or D > 256 or H % H_KV or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        why = "D a multiple of 16 up to 256, H a multiple of H_KV, k and v alike"
    elif causal and Tq > Tk:
        why = "causal with Tq <= Tk"
    elif any(t.stride(-1) != 1 or any((st_ * t.element_size()) % 16 for st_ in t.stride()[:-1]) for t in (q, k, v)):
        why = "the last dim contiguous and the other strides 16-byte multiples (TMA)"
    if why:
        raise ValueError(f"gluon_fa3_attention: unsupported q {tuple(q.shape)} {tuple(q.stride())}, "
                         f"k {tuple(k.shape)}: {why}")
    flat = all(t.is_contiguous() for t in (q, k, v)) and Tq % (CONSUMERS * BM) == 0 and Tk % BN == 0 and D == Dp
    rank = rank or (2 if flat else 4)
    if rank == 2 and not flat:
        raise ValueError("gluon_fa3_attention: rank 2 needs contiguous tensors, Tq % 128 == 0, Tk % BN == 0, "
                         "D a power of two")
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    (q_desc, k_desc, v_desc, o_desc), rank, grid = G.descriptors(q, k, v, o, BN, rank)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)) * LOG2E

    def launch():
        _fa3_fwd[grid](q_desc, k_desc, v_desc, o_desc, scale, Tq, Tk, H, H_KV, o, 0, 0, 0, STAGES=STAGES,
                       CAUSAL=causal, SCHEDULE=SCHEDULE, RANK=rank, STORE_LSE=False, num_warps=4, maxnreg=maxnreg)
    return o, launch


def compile_offline(points=((2, 64), (2, 128), (4, 32), (4, 80), (4, 128), (4, 192), (4, 256)),
                    causal=(False, True), schedules=(0, 1, 2), maxnreg=168, tiles=None, lse: bool = False) -> dict:
    """Compile for sm90 without a GPU: (descriptor rank, D) points (``plan(D)``'s tiles, or each of
    ``tiles(D)``'s (BN, STAGES)) x causal x schedules; ``lse``: with the lse output. Shared memory, the wgmma /
    setmaxnreg / TMA counts in the PTX, and ptxas's registers and spills."""
    from triton.experimental.gluon._runtime import GluonASTSource

    out = {}
    for rank, D, BN, STAGES in [(r, d, *t) for r, d in points for t in (tiles(d) if tiles else [plan(d)[1:]])]:
        Dp = plan(D)[0]
        lead = [1, 1] if rank == 4 else []
        for c in causal:
            for sch in schedules:
                lq = gl.NVMMASharedLayout.get_default_for(lead + [BM, Dp], gl.bfloat16)
                lkv = gl.NVMMASharedLayout.get_default_for(lead + [BN, Dp], gl.bfloat16)
                bq, bkv = ", ".join(map(str, lead + [BM, Dp])), ", ".join(map(str, lead + [BN, Dp]))
                dq, dkv = f"tensordesc<bf16[{bq}],{lq!r}>", f"tensordesc<bf16[{bkv}],{lkv!r}>"
                sig = {"q_desc": dq, "k_desc": dkv, "v_desc": dkv, "o_desc": dq, "qk_scale": "fp32", "Tq": "i32",
                       "Tk": "i32", "H": "i32", "H_KV": "i32", "LSE": "*fp32", "stride_lb": "i32", "stride_lh": "i32",
                       "stride_lm": "i32", "STAGES": "constexpr", "CAUSAL": "constexpr", "SCHEDULE": "constexpr",
                       "RANK": "constexpr", "STORE_LSE": "constexpr", "num_warps": "constexpr"}
                names = list(sig)
                consts = {(names.index("STAGES"),): STAGES, (names.index("CAUSAL"),): c,
                          (names.index("SCHEDULE"),): sch, (names.index("RANK"),): rank,
                          (names.index("STORE_LSE"),): lse, (names.index("num_warps"),): 4}
                key = (f"rank={rank},D={D},BN={BN},STAGES={STAGES},causal={int(c)},schedule={sch}"
                       + (",lse=1" if lse else ""))
                out[key] = _compile_row(GluonASTSource(_fa3_fwd, sig, constexprs=consts), maxnreg)
    return out


def _compile_row(src, maxnreg: int) -> dict:
    """One sm90 compile: shared memory, global scratch (device-made descriptors), the wgmma / setmaxnreg /
    TMA counts in the PTX, ptxas's registers and spills; or the error."""
    import os
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv
    from triton.backends.compiler import GPUTarget

    try:
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
    except Exception as e:  # noqa: BLE001 - a failed compile is the answer
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    ptx = kern.asm["ptx"]
    row = {"shared_bytes": kern.metadata.shared, "scratch_bytes": kern.metadata.global_scratch_size,
           "wgmma": ptx.count("wgmma.mma_async"), "setmaxnreg": ptx.count("setmaxnreg"),
           "tma_loads": ptx.count("cp.async.bulk.tensor")}
    ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "k.ptx")
        with open(f, "w") as fh:
            fh.write(ptx)
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    g = re.search(r"Used (\d+) registers", r.stderr)
    row.update(spill_stores=int(m.group(1)) if m else None, spill_loads=int(m.group(2)) if m else None,
               registers=int(g.group(1)) if g else None)
    return row


def compile_varlen_offline(dims=(32, 64, 80, 96, 128, 160, 192, 224, 256), causal=(False, True), schedules=(0, 1, 2),
                           tiles=None, maxnreg: int = 168, lse: bool = False) -> dict:
    """The packed (varlen) kernel (``_fa3_fwd_varlen``: descriptors made on the device per sequence and head)
    compiled for sm90 without a GPU, bf16: each head dim at ``tiles(D)``'s (BN, STAGES) (default: the Gluon
    seeds' tile, 3 stages where they fit) x causal x schedules; ``lse``: with the lse output."""
    from triton.experimental.gluon._runtime import GluonASTSource

    def seed_tile(D):
        bn = 128 if _pow2(D) <= 128 else 64
        return [(bn, 3 if G.smem_bytes(D, bn, 3) <= 227 * 1024 else 2)]

    out = {}
    for D in dims:
        for BN, STAGES in (tiles or seed_tile)(D):
            Dp, lq, lkv = G.varlen_layouts(gl.bfloat16, D, BN)
            sig = {n: "*bf16" for n in ("Q", "K", "V", "O")} | {"CuQ": "*i32", "CuK": "*i32"}
            sig |= {f"stride_{t}{d}": "i32" for t in "qkvo" for d in "mh"}
            sig |= {"qk_scale": "fp32", "total_q": "i32", "total_k": "i32", "H": "i32", "H_KV": "i32", "LSE": "*fp32",
                    "stride_lh": "i32", "stride_lm": "i32"}
            for c in causal:
                for sch in schedules:
                    vals = dict(D=D, DP=Dp, BN=BN, LQ=lq, LKV=lkv, STAGES=STAGES, CAUSAL=c, SCHEDULE=sch,
                                STORE_LSE=lse, num_warps=4)
                    full = sig | {n: "constexpr" for n in vals}
                    names = list(full)
                    consts = {(names.index(n),): v for n, v in vals.items()}
                    key = (f"varlen,D={D},BN={BN},STAGES={STAGES},causal={int(c)},schedule={sch}"
                           + (",lse=1" if lse else ""))
                    out[key] = _compile_row(GluonASTSource(G._fa3_fwd_varlen, full, constexprs=consts), maxnreg)
                    print(key, out[key], flush=True)
    return out


def _reference(q, k, v, causal):
    import torch
    g = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:   # bottom-right: key j visible to query i when j <= i + Tk - Tq
        Tq, Tk = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).triu(1 + Tk - Tq), float("-inf"))
    return torch.softmax(s, -1) @ vd


def poisoned_check(make, ref, tol) -> tuple[float, bool, str | None]:
    """``make()`` -> (output, launch): the output poisoned with NaN, launched, compared with the float64
    reference. (relative error, within ``tol``, the error message of a launch that raised)."""
    import torch

    err = None
    try:
        o, launch = make()
        o.fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        rel = ((o.double() - ref).norm() / ref.norm()).item()
    except Exception as e:  # noqa: BLE001 - a failed launch is a failed check
        rel, err = float("nan"), f"{type(e).__name__}: {e}"[:500]
    return rel, rel == rel and rel <= tol, err


def check(schedules) -> list[dict]:
    """Each schedule against float64, both dtypes, causal or not; the output poisoned with NaN before each
    launch (every element must be written). The flat path (rank 2) on small odd batches and heads and GQA;
    the general one (rank 4) on ragged lengths, every head-dim class, Tq < Tk and (B, T, H, D) views."""
    import torch

    from tritune.harness.compare import tolerance

    torch.manual_seed(0)
    rows = []
    shapes = ((1, 3, 3, 256, 256, 64, False, False), (2, 4, 2, 384, 384, 128, True, False),
              (1, 2, 1, 512, 512, 64, True, False), (3, 2, 2, 128, 128, 128, False, False),
              (2, 4, 2, 200, 333, 80, False, False), (1, 3, 1, 77, 77, 32, True, False),
              (1, 2, 2, 130, 260, 256, True, False), (2, 2, 1, 128, 192, 192, False, False),
              (1, 2, 2, 100, 100, 96, True, False), (1, 2, 2, 256, 129, 160, False, False),
              (1, 4, 4, 256, 256, 128, True, True), (2, 4, 2, 150, 300, 64, False, True))
    for dtype in (torch.bfloat16, torch.float16):
        for (B, H, HKV, Tq, Tk, D, c, btHd) in shapes:
            if btHd:   # (B, T, H, D) buffers seen as (B, H, T, D): strided, not contiguous
                q = torch.randn(B, Tq, H, D, device="cuda", dtype=dtype).transpose(1, 2)
                k, v = (torch.randn(B, Tk, HKV, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(2))
            else:
                q = torch.randn(B, H, Tq, D, device="cuda", dtype=dtype)
                k, v = (torch.randn(B, HKV, Tk, D, device="cuda", dtype=dtype) for _ in range(2))
            T = f"{Tq}x{Tk}{' (B,T,H,D)' if btHd else ''}"
            ref = _reference(q, k, v, c)
            tol = tolerance(dtype)
            for sch in schedules:
                rel, good, err = poisoned_check(lambda: prepare(q, k, v, c, SCHEDULE=sch), ref, tol)
                print(f"check schedule {sch} B={B} H={H}/{HKV} T={T} D={D} causal={int(c)} {str(dtype)[6:]}: "
                      f"rel {rel:.2e} (tol {tol:.1e}) {'ok' if good else 'WRONG'}{' ' + err if err else ''}", flush=True)
                rows.append({"check": True, "schedule": sch, "B": B, "H": H, "H_KV": HKV, "T": T, "D": D,
                             "Tq": Tq, "Tk": Tk, "strided": btHd, "causal": c, "dtype": str(dtype), "rel_err": rel,
                             "tol": tol, "ok": good,
                             **({"error": err} if err else {})})
    return rows


def run_checks(script: str, schedules) -> tuple[list[dict], list]:
    """Each schedule's ``--check-schedule`` run of ``script`` in its own process (a schedule whose barriers
    deadlock hangs only that process, killed after 150 s): (every check row, the schedules that passed)."""
    import subprocess
    import tempfile

    rows, good = [], []
    for sch in schedules:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            try:
                r = subprocess.run([sys.executable, script, "--check-schedule", str(sch), "--out", f.name],
                                   timeout=150, capture_output=True, text=True)
                print(r.stdout, end="", flush=True)
                got = json.load(open(f.name))["rows"] if r.returncode in (0, 1) else []
                if r.returncode not in (0, 1):
                    print(f"schedule {sch}: the check process failed (exit {r.returncode}): {r.stderr[-800:]}", flush=True)
            except subprocess.TimeoutExpired:
                print(f"schedule {sch}: the check did not finish in 150 s (a barrier deadlock?)", flush=True)
                got = [{"check": True, "schedule": sch, "ok": False, "error": "timeout 150 s"}]
        rows += got or [{"check": True, "schedule": sch, "ok": False, "error": "no result"}]
        if got and all(x["ok"] for x in got):
            good.append(sch)
    return rows, good


def run_gpu(out_path: str | None, quick: bool = False, check_only: bool = False) -> int:
    """Each schedule checked in its own process, then the correct ones timed at FA3's grid."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, good = run_checks(__file__, SCHEDULES)
    print(f"correct schedules: {good}", flush=True)
    if good and not check_only:
        from tritune.kernels.attention import attention as tritune_attention
        grid = [(16384 // T, T) for T in ((1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384))]
        for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16):
            for D in (64, 128):
                H = 2048 // D
                for causal in (False, True):
                    for B, T in grid:
                        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(3))
                        flops = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
                        r = {"B": B, "H": H, "T": T, "D": D, "causal": causal, "dtype": str(dtype)}
                        fns = {f"gluon_s{sch}": prepare(q, k, v, causal, SCHEDULE=sch)[1] for sch in good}
                        fns["sdpa_default"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                        def flash():
                            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        fns["sdpa_flash"] = flash
                        fns["tritune"] = lambda: tritune_attention(q, k, v, causal=causal)
                        for name, fn in fns.items():
                            try:
                                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                                r[name + "_us"] = ms * 1e3
                                r[name + "_tflops"] = flops / ms / 1e9
                            except Exception as e:  # noqa: BLE001
                                r[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
                        best = min((r[f"gluon_s{sch}_us"] for sch in good if f"gluon_s{sch}_us" in r), default=None)
                        if best and "sdpa_default_us" in r:
                            r["best_gluon_vs_sdpa_default"] = r["sdpa_default_us"] / best
                        rows.append(r)
                        print({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in r.items()}, flush=True)
    write_rows(out_path, rows)
    return 0 if good else 1


def write_rows(out_path: str | None, rows: list[dict]) -> None:
    """The GPU run's rows (checks and timings) as JSON, with the device's name."""
    import torch

    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="compile for sm90 offline and stop")
    ap.add_argument("--compile-space", action="store_true",
                    help="compile every tile/stage point of the registered space for sm90 offline and stop")
    ap.add_argument("--compile-varlen", action="store_true",
                    help="compile the packed (varlen) kernel for sm90 offline, every head dim, and stop")
    ap.add_argument("--lse", action="store_true", help="with --compile*: the kernels with the lse output")
    ap.add_argument("--quick", action="store_true", help="bf16 and three sequence lengths only")
    ap.add_argument("--check-only", action="store_true", help="the float64 checks only, no timing")
    ap.add_argument("--check-schedule", type=int, default=None, help=argparse.SUPPRESS)   # one schedule's checks
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.compile_varlen:
        res = compile_varlen_offline(lse=a.lse)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if all("error" not in r for r in res.values()) else 1
    if a.compile or a.compile_space:
        # --compile-space: every (BLOCK_N, num_stages) the registered space allows (attention's WARP_SPEC 3-5:
        # BLOCK_N 64/128 up to D 128, 64 past it; 2-4 stages within 227 KB of shared memory), causal, 3 schedules
        res = compile_offline(points=((4, 32), (4, 64), (4, 80), (4, 128), (4, 256)), causal=(True,),
                              tiles=lambda D: [(bn, st) for bn in ((64, 128) if D <= 128 else (64,))
                                               for st in (2, 3, 4) if G.smem_bytes(D, bn, st) <= 227 * 1024],
                              lse=a.lse) if a.compile_space else compile_offline(lse=a.lse)
        print(json.dumps(res, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if all("error" not in r for r in res.values()) else 1
    if a.check_schedule is not None:
        rows = check([a.check_schedule])
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return 0 if all(r["ok"] for r in rows) else 1
    return run_gpu(a.out, a.quick, a.check_only)


if __name__ == "__main__":
    sys.exit(main())
