"""GPU probe (issue #28): does moving part of attention's exponentials off the MUFU unit pay on Hopper?

Per score, attention's forward does 4·D tensor-core flops and one exp2. On an H100 SXM a multiprocessor
does ~4096 dense bf16 flops a clock but only 16 MUFU ex2 a clock: at D=64 the exps take as long as the
two matmuls (0.0625 clock a score each), at D=128 half as long. FlashAttention-3 hides them by
ping-ponging two warpgroups, which Triton cannot schedule by hand. Another way to cut MUFU time is to
compute some of the exps on the FMA pipes instead: 2^x = 2^j · p(f), j = floor(x), f = x - j, p a
degree-3 polynomial (relative error 7.7e-5, far under the bf16/fp16 rounding of P that the second matmul
takes), 2^j added into the exponent bits.

One minimal non-causal forward kernel (one (batch, head, BLOCK_M rows) tile a program, K/V streamed in
BLOCK_N blocks, online softmax in the exp2 domain), three variants:

  EMU 0   every exp2 on MUFU (tl.exp2)
  EMU 1   half the scores' exps (every other column) on the FMA pipes
  EMU 2   all of them on the FMA pipes

Each is checked against a float64 reference and timed (CUDA-graph replays) at FA3's grid points
(batch x seqlen = 16k tokens, heads x D = 2048) beside torch's default SDPA, in TF/s. The kernel is a
probe, not tritune's attention (kernels/attention.py): what it measures is the difference between EMU 0
and EMU 1/2 in one kernel; a gain here is worth porting there (after the H200 budgeted tune has
finished: a change to a registered kernel makes its stored configs stale).

    python lab/probes/attention_exp_split.py --out F.json [--dtype bf16] [--seqlens 1024,4096,16384]
    TRITON_INTERPRET=1 python lab/probes/attention_exp_split.py --check    # CPU: the math, fp16, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

# 2^f on [0, 1): least-squares fit on Chebyshev nodes, relative error <= 7.8e-5
C0 = tl.constexpr(0.9999278266445146)
C1 = tl.constexpr(0.6957770964274215)
C2 = tl.constexpr(0.2262331941998577)
C3 = tl.constexpr(0.07790716377386592)


@triton.jit
def _exp2_fma(x):
    """2^x for x <= 0 (-inf -> 0) without MUFU: the integer part into the exponent bits, the fraction by a
    cubic (Horner: three FMAs)."""
    x = tl.maximum(x, -126.0)
    j = tl.floor(x)
    f = x - j
    p = C0 + f * (C1 + f * (C2 + f * C3))
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_mixed(x, BM: tl.constexpr, BN: tl.constexpr, EMU: tl.constexpr):
    if EMU == 0:
        return tl.exp2(x)
    elif EMU == 2:
        return _exp2_fma(x)
    else:   # even columns on MUFU, odd ones on the FMA pipes (a column pair sits in one thread's registers)
        a, b = tl.split(tl.reshape(x, (BM, BN // 2, 2)))
        return tl.reshape(tl.join(tl.exp2(a), _exp2_fma(b)), (BM, BN))


@triton.jit
def _fwd(Q, K, V, O, T, H, qk_scale,
         D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EMU: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    base = bh * T * D
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    m_i = tl.full((BM,), -float("inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    for start in range(0, T, BN):
        cols = start + offs_n
        k = tl.load(K + base + cols[None, :] * D + offs_d[:, None], mask=cols[None, :] < T, other=0.0)
        s = tl.dot(q, k) * qk_scale
        s = tl.where(cols[None, :] < T, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = _exp2_mixed(s - m_new[:, None], BM, BN, EMU)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + base + cols[:, None] * D + offs_d[None, :], mask=cols[:, None] < T, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=offs_m[:, None] < T)


@triton.jit
def _exp2_probe(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, _exp2_fma(tl.load(X + offs, mask=offs < n, other=0.0)), mask=offs < n)


def run(q, k, v, emu: int, bm: int, bn: int, warps: int, stages: int):
    B, H, T, D = q.shape
    o = torch.empty_like(q)
    grid = (triton.cdiv(T, bm), B * H)
    _fwd[grid](q, k, v, o, T, H, D ** -0.5 * 1.4426950408889634, D=D, BM=bm, BN=bn, EMU=emu,
               num_warps=warps, num_stages=stages)
    return o


def reference(q, k, v):
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v.double()


def rel_err(o, ref):
    return ((o.double() - ref).norm() / ref.norm()).item()


def check_cpu() -> int:
    """The three variants' math on the interpreter (fp16: the interpreter's bf16 dot is wrong)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g).to(torch.float16) for _ in range(3))
    ref = reference(q, k, v)
    worst = 0.0
    for emu in (0, 1, 2):
        e = rel_err(run(q, k, v, emu, 16, 16, 4, 1), ref)
        print(f"EMU {emu}: {e:.2e} off float64")
        worst = max(worst, e)
    x = torch.linspace(-126, 0, 100001)
    y = torch.empty_like(x)
    _exp2_probe[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    e2 = ((y.double() - 2.0 ** x.double()) / 2.0 ** x.double()).abs().max().item()
    print(f"exp2 on the FMA pipes: max relative error {e2:.2e} on [-126, 0]")
    worst = max(worst, e2)
    return 0 if worst < 2e-3 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true", help="the math on the interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--heads-dims", default="32x64,16x128", help="HxD pairs (FA3's grid: H x D = 2048)")
    a = ap.parse_args(argv)
    if a.check:
        return check_cpu()
    if not torch.cuda.is_available():
        print("attention_exp_split: needs a CUDA GPU (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from tritune.model.fused_tune import time_us

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    res = {"device": torch.cuda.get_device_name(), "dtype": a.dtype, "rows": []}
    for hd in a.heads_dims.split(","):
        H, D = map(int, hd.split("x"))
        for T in map(int, a.seqlens.split(",")):
            B = max(1, 16384 // T)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g).to(dt) for _ in range(3))
            flops = 4 * B * H * T * T * D
            small = tuple(x[:1, :2] for x in (q, k, v))   # the float64 check on one batch row, two heads
            ref = reference(*small)
            sdpa_us = time_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 10)
            row = {"B": B, "H": H, "T": T, "D": D, "sdpa_us": round(sdpa_us, 2),
                   "sdpa_tflops": round(flops / sdpa_us / 1e6, 1), "variants": []}
            for emu in (0, 1, 2):
                best = None
                for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3)):
                    try:
                        err = rel_err(run(*small, emu, bm, bn, warps, stages), ref)
                        us = time_us(lambda: run(q, k, v, emu, bm, bn, warps, stages), 10)
                    except Exception as e:  # noqa: BLE001  (a config that does not fit is a row, not a crash)
                        row["variants"].append({"emu": emu, "config": [bm, bn, warps, stages], "error": str(e)[:200]})
                        continue
                    r = {"emu": emu, "config": [bm, bn, warps, stages], "us": round(us, 2),
                         "tflops": round(flops / us / 1e6, 1), "rel_err": err}
                    row["variants"].append(r)
                    if best is None or us < best["us"]:
                        best = r
                if best:
                    row[f"emu{emu}_best_tflops"] = best["tflops"]
            res["rows"].append(row)
            print({k_: v_ for k_, v_ in row.items() if k_ != "variants"}, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
