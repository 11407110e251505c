"""GPU probe (issue #27): what does one dependent stage of a persistent decode step cost, piece by piece?

The fused decode step (kernels/fused_decode.py) runs GPT-2 small's 61 stages between grid barriers at
4.5-7.5 us a stage (H100 and H200, lab/logs/h200/fused_decode_h200_bench_gluon_tune_2026-11-28_e4a1d12).
The Gluon probe (lab/probes/gluon_staged_weights.py) took the weights off the chain (copied into shared
memory before the wait) and still measured 5.7 us a stage against 6.3 without (H200): the chain that is
left is the barrier and the dependent loads and stores around it. 166 us a step (the issue's 6,000 tok/s)
allows ~2.7 us a stage at today's 61 stages. This probe times the chain in pieces, each a chain of stages
x_{s+1} = f_s(x_s) over a row of E values, P = E / BN programs (all resident), BN columns each:

  barrier    the grid barrier alone (no loads or stores)
  x          + after the wait, the whole row x_s loaded; BN values of x_{s+1} (from its sum) stored
  gemv       + x_{s+1} = x_s @ W_s with the program's (E, BN) slice of W_s loaded into registers before
             the wait (prefetched a stage ahead, as the fused step does for its first block)
  gemv_late  the same, the slice loaded after the wait

each with two barriers:

  counter    arrival red.add.release on one counter a stage, the poll an acquire load of it (the fused step's)
  flags      each program stores its own flag (atom.exch.release) the poll acquire-loads all P flags at once
             (no arrivals serialised on one address; one load a poll)

Timed as CUDA-graph replays of a launch with 48 stages and one with 8; the difference over 40 is a stage.

    python lab/probes/stage_chain_floor.py --out F.json [--E 768] [--BN 8] [--warps 4]
    python lab/probes/stage_chain_floor.py --compile        # offline: compiles every variant for sm90
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if "--compile" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)

import triton
import triton.language as tl

MODES = {"barrier": 0, "x": 1, "gemv": 2, "gemv_late": 3}
SYNCS = {"counter": 0, "flags": 1}
SPIN_MAX = 4194304


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _wslice(W, s, E, offs_e, offs_n, em):
    """Program's (E, BN) slice of stage s's weight, float32."""
    return tl.load(W + s.to(tl.int64) * E * E + offs_e[:, None] * E + offs_n[None, :], mask=em[:, None],
                   other=0.0).to(tl.float32)


@triton.jit
def _chain(W, X, Bar, Flags, Err, n_stages, E, P,
           BN: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, MODE: tl.constexpr, SYNC: tl.constexpr):
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BE)
    em = offs_e < E
    offs_n = pid * BN + tl.arange(0, BN)
    offs_p = tl.arange(0, BP)
    pm = offs_p < P
    spins = pid * 0
    w = tl.zeros((BE, BN), dtype=tl.float32)
    if MODE == 2:
        w = _wslice(W, pid * 0, E, offs_e, offs_n, em)
    for s in range(0, n_stages):
        si = (s + pid * 0).to(tl.int64)     # (s is a plain int in the interpreter)
        if MODE == 3:
            w = _wslice(W, s + pid * 0, E, offs_e, offs_n, em)
        if MODE >= 1:
            x = tl.load(X + si * E + offs_e, mask=em, other=0.0, cache_modifier=".cg").to(tl.float32)
            if MODE == 1:
                y = tl.zeros((BN,), dtype=tl.float32) + tl.sum(x, axis=0) * (1.0 / E)
            else:
                y = tl.sum(x[:, None] * w, axis=0)
            tl.store(X + (si + 1) * E + offs_n, y.to(X.dtype.element_ty))
        if MODE == 2:       # the next stage's slice: its loads fly while this program waits
            w = _wslice(W, tl.minimum(si + 1, n_stages - 1), E, offs_e, offs_n, em)
        tl.debug_barrier()  # every thread's store issued before the arrival
        if SYNC == 0:
            tl.atomic_add(Bar + s, 1, sem="release", scope="gpu")
            while (tl.atomic_add(Bar + s, 0, sem="acquire", scope="gpu") < P) & (spins < 4194304):
                spins += 1
        else:
            tl.atomic_xchg(Flags + pid, s + 1, sem="release", scope="gpu")
            f = _ld_acquire(Flags + offs_p)
            while (tl.min(tl.where(pm, f, s + 1), axis=0) < s + 1) & (spins < 4194304):
                f = _ld_acquire(Flags + offs_p)
                spins += 1
        tl.debug_barrier()
    if spins >= 4194304:
        tl.atomic_max(Err, 1)


def compile_offline(E: int, BN: int, warps: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    BE, BP = triton.next_power_of_2(E), triton.next_power_of_2(E // BN)
    for mname, mode in MODES.items():
        for sname, sync in SYNCS.items():
            sig = {"W": "*bf16", "X": "*bf16", "Bar": "*i32", "Flags": "*i32", "Err": "*i32", "n_stages": "i32",
                   "E": "i32", "P": "i32", "BN": "constexpr", "BE": "constexpr", "BP": "constexpr",
                   "MODE": "constexpr", "SYNC": "constexpr"}
            consts = {"BN": BN, "BE": BE, "BP": BP, "MODE": mode, "SYNC": sync}
            names = list(sig)
            src = ASTSource(_chain, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ("W", "X", "Bar", "Flags", "E")})
            try:
                k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
                ptx = k.asm["ptx"]
                out[f"{mname}/{sname}"] = {"shared_bytes": k.metadata.shared,
                                           "ld_acquire": ptx.count("ld.global.acquire") + ptx.count("ld.acquire"),
                                           "atom_release": ptx.count(".release"), "ptx_lines": ptx.count("\n")}
            except Exception as e:  # noqa: BLE001  (a failed compile is the answer)
                out[f"{mname}/{sname}"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compile", action="store_true", help="compile every variant for sm90 offline and stop")
    ap.add_argument("--E", type=int, default=768)
    ap.add_argument("--BN", type=int, default=8)
    ap.add_argument("--warps", type=int, default=4)
    a = ap.parse_args(argv)
    if a.compile:
        res = compile_offline(a.E, a.BN, a.warps)
        for k, v in res.items():
            print(k, v)
        return 1 if any("error" in v for v in res.values()) else 0
    import torch

    if not torch.cuda.is_available():
        print("stage_chain_floor: needs a CUDA GPU (or --compile)", file=sys.stderr)
        return 2
    from tritune.model.fused_tune import time_us

    E, BN = a.E, a.BN
    P = E // BN
    if E % BN or P > torch.cuda.get_device_properties(0).multi_processor_count:
        print(f"stage_chain_floor: {P} programs (E / BN) must divide E and all be resident", file=sys.stderr)
        return 2
    BE, BP = triton.next_power_of_2(E), triton.next_power_of_2(P)
    n_long, n_short = 48, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    W = (torch.randn(n_long, E, E, device="cuda", generator=g) * E ** -0.5).to(torch.bfloat16)
    X = torch.zeros(n_long + 1, E, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(E, device="cuda", generator=g).to(torch.bfloat16)
    bar = torch.zeros(n_long, dtype=torch.int32, device="cuda")
    flags = torch.zeros(P, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    res = {"device": torch.cuda.get_device_name(), "E": E, "BN": BN, "programs": P, "warps": a.warps, "rows": []}
    for mname, mode in MODES.items():
        for sname, sync in SYNCS.items():
            def run(n, mode=mode, sync=sync):
                X[0].copy_(x0)
                bar.zero_()
                flags.zero_()
                _chain[(P,)](W, X, bar, flags, err, n, E, P, BN=BN, BE=BE, BP=BP, MODE=mode, SYNC=sync,
                             num_warps=a.warps)
            run(n_long)
            torch.cuda.synchronize()
            row = {"mode": mname, "sync": sname}
            if mode >= 2:   # every stage against float64 from its own (bf16) input
                errs = [((X[s + 1].double() - X[s].double() @ W[s].double()).norm()
                         / (X[s].double() @ W[s].double()).norm()).item() for s in range(n_long)]
                row["max_rel_error"] = max(errs)
            times = {n: time_us(lambda n=n: run(n), 20) for n in (n_short, n_long)}
            row["us_per_stage"] = round((times[n_long] - times[n_short]) / (n_long - n_short), 3)
            row["timed_out"] = int(err.item())
            res["rows"].append(row)
            print(row, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
