"""Probe (issue #27): can Triton 3.6 take the fused decode step's weight stream off its critical path?

The fused step (kernels/fused_decode.py, plain Triton) holds at most a block or two of weights per program
in registers: after each grid barrier a stage still waits on its own weight loads, and its stages cost
4.6-8.7 us each on the H100 against a 0.85 us barrier (lab/logs/h100/fused_decode_kv_chunks_lm_blocks_
2026-11-28_f1b7899, fused_decode_graph_stage_split_barrier_2026-11-28_9728556). Plain Triton has no
shared memory a program controls; Gluon (triton.experimental.gluon, in 3.6) has: ``allocate_shared_memory``,
``async_copy_global_to_shared`` (cp.async) with ``commit_group`` / ``wait_group``.

The kernel here is a chain of GEMV stages y_{s+1} = y_s @ W_s (W_s (E, E) bf16, one program per column
tile of BN columns over the full K, grid barriers between stages as in the fused step). ``STAGED``:

  1  the next stage's whole weight slice (E x BN) is copied into shared memory (cp.async) before the
     program waits at the barrier; after the wait it reads x and multiplies out of shared memory
  0  the same kernel with the copy issued after the wait (the dependent chain the fused step has)

    python lab/probes/gluon_staged_weights.py --compile        # offline: does it compile for sm90 (no GPU)?
    python lab/probes/gluon_staged_weights.py --out F.json     # GPU: check against float64, time both

``--compile`` runs on any machine with triton (no torch needed); it prints shared memory, registers and
whether the PTX holds cp.async. On a GPU each variant's chain is checked against float64 and timed as
CUDA-graph replays; a stage's cost is the difference of a long and a short chain over their stage count.
"""
from __future__ import annotations

import argparse
import json
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def _copy_slice(W, smem, slot, s, E, offs_k, offs_n, BK: gl.constexpr, UNITS: gl.constexpr):
    """Stage s's (E, BN) weight slice of this program, in UNITS blocks of BK rows, into ring slot ``slot``."""
    base = W + s.to(gl.int64) * E * E
    for u in gl.static_range(UNITS):
        ptrs = base + (u * BK + offs_k)[:, None] * E + offs_n[None, :]
        async_copy.async_copy_global_to_shared(smem.index(slot * UNITS + u), ptrs)
    async_copy.commit_group()


@gluon.jit
def _chain(W, X, Bar, n_stages, E, P, BK: gl.constexpr, BN: gl.constexpr, UNITS: gl.constexpr,
           STAGED: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    gl.static_assert(BN == 8, "one 16-byte row segment a thread")
    gl.static_assert(BK == 32 * num_warps, "a block is one row a thread")
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [num_warps, 1], [1, 0])
    sh: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 1, [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [2 * UNITS, BK, BN], sh)    # two stages' slices
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(1, blk))
    offs_n = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, blk))
    _copy_slice(W, ring, 0, pid * 0, E, offs_k, offs_n, BK, UNITS)
    spins = pid * 0
    for s in range(0, n_stages):
        slot = s % 2
        if STAGED:
            if s + 1 < n_stages:    # the next stage's slice flies while this program waits and computes
                _copy_slice(W, ring, 1 - slot, s + 1, E, offs_k, offs_n, BK, UNITS)
        if s > 0:                   # x_s is complete: every program has written its columns
            # (bounded: a grid that is not all resident gives wrong numbers, not a hung GPU)
            while (gl.atomic_add(Bar + s - 1, 0, sem="acquire", scope="gpu") < P) & (spins < 4194304):
                spins += 1
        if STAGED:
            if s + 1 < n_stages:
                async_copy.wait_group(1)    # this stage's slice has landed; the next one may still fly
            else:
                async_copy.wait_group(0)
        else:
            slot = 0
            if s > 0:               # the copy only now: the chain the register design has
                _copy_slice(W, ring, 0, s, E, offs_k, offs_n, BK, UNITS)
            async_copy.wait_group(0)
        gl.thread_barrier()
        acc = gl.zeros([BN], gl.float32, layout=gl.SliceLayout(0, blk))
        for u in gl.static_range(UNITS):
            w = ring.index(slot * UNITS + u).load(blk).to(gl.float32)
            xk = gl.load(X + s.to(gl.int64) * E + u * BK + offs_k).to(gl.float32)
            acc += gl.sum(w * xk[:, None], axis=0)
        gl.store(X + (s + 1).to(gl.int64) * E + offs_n, acc.to(gl.bfloat16))
        gl.thread_barrier()         # every thread's store (and read of the slot) before the arrival
        gl.atomic_add(Bar + s, 1, sem="release", scope="gpu")


def compile_offline(E=768, BN=8, BK=128, warps=4):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    out = {}
    for staged in (1, 0):
        sig = {"W": "*bf16", "X": "*bf16", "Bar": "*i32", "n_stages": "i32", "E": "i32", "P": "i32",
               "BK": "constexpr", "BN": "constexpr", "UNITS": "constexpr", "STAGED": "constexpr", "num_warps": "constexpr"}
        names = list(sig)
        consts = {(names.index("BK"),): BK, (names.index("BN"),): BN, (names.index("UNITS"),): E // BK,
                  (names.index("STAGED"),): staged, (names.index("num_warps"),): warps}
        src = GluonASTSource(_chain, sig, constexprs=consts,
                             attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4)})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        except Exception as e:  # noqa: BLE001  (a failed compile is the answer)
            out[staged] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            continue
        ptx = k.asm["ptx"]
        out[staged] = {"shared_bytes": k.metadata.shared, "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                       "ld_shared": ptx.count("ld.shared")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="compile both variants for sm90 offline and stop")
    ap.add_argument("--out", default=None)
    ap.add_argument("--E", type=int, default=768)
    ap.add_argument("--BN", type=int, default=8)
    ap.add_argument("--BK", type=int, default=128, help="32 x --warps")
    ap.add_argument("--warps", type=int, default=4)
    a = ap.parse_args(argv)
    if a.compile:
        res = compile_offline(a.E, a.BN, a.BK, a.warps)
        print(f"triton {triton.__version__}, sm90, E={a.E} BN={a.BN} BK={a.BK} warps={a.warps}: {json.dumps(res)}")
        return 1 if any("error" in v for v in res.values()) else 0
    import torch

    if not torch.cuda.is_available():
        print("gluon_staged_weights: needs a CUDA GPU (or --compile)", file=sys.stderr)
        return 2
    E, BN, BK = a.E, a.BN, a.BK
    P = E // BN
    if P > torch.cuda.get_device_properties(0).multi_processor_count:
        print(f"gluon_staged_weights: {P} programs (E / BN) would not all be resident", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    n_long, n_short = 48, 8
    W = (torch.randn(n_long, E, E, device="cuda", generator=g) * E ** -0.5).to(torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(), "E": E, "BN": BN, "BK": BK, "programs": P, "rows": []}
    for staged in (1, 0):
        X = torch.zeros(n_long + 1, E, device="cuda", dtype=torch.bfloat16)
        x0 = torch.randn(E, device="cuda", generator=g).to(torch.bfloat16)
        bar = torch.zeros(n_long, dtype=torch.int32, device="cuda")

        def run(n):
            X[0].copy_(x0)
            bar.zero_()
            _chain[(P,)](W, X, bar, n, E, P, BK=BK, BN=BN, UNITS=E // BK, STAGED=staged, num_warps=a.warps)
        run(n_long)
        torch.cuda.synchronize()
        errs = []
        for s in range(n_long):   # each stage against float64 from the kernel's own (bf16) input
            want = X[s].double() @ W[s].double()
            errs.append(((X[s + 1].double() - want).norm() / want.norm()).item())
        from tritune.model.fused_tune import time_us

        times = {n: time_us(lambda n=n: run(n), 20) for n in (n_short, n_long)}
        per = (times[n_long] - times[n_short]) / (n_long - n_short)
        row = {"staged": staged, "us_per_stage": round(per, 3), "max_rel_error": max(errs),
               "weight_gb_s": round(E * E * 2 / (per * 1e-6) / 1e9, 1)}
        res["rows"].append(row)
        print(row, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
