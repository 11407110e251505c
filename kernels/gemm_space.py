"""GEMM's config space: its parameters, the constraint that keeps a point valid (shared memory, registers,
split-K and persistence, TMA, the fusions' pointer operands), the heuristic default config, the store's bucket
and the cost model. The kernel and its launcher are in :mod:`tritune.kernels.gemm`, which registers the spec.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from tritune import kernels as K
from tritune.kernels.gemm_cases import Problem

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


SMEM_BUDGET = 200 * 1024         # H100 has 227 KiB per block; the margin covers the epilogue's scratch
SMEM_PER_SM = 228 * 1024


@functools.lru_cache(maxsize=None)
def tma_capable(device_index: int) -> bool:
    if TensorDescriptor is None:
        return False
    if K.kernel_device() == "cpu":  # the interpreter emulates descriptors
        return True
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pipeline_smem(c: dict, dtype, b_tiles: int = 1) -> int:
    """Bytes of shared memory the operand pipeline takes (``b_tiles`` B tiles a K step: 2 with SwiGLU)."""
    return (c["BLOCK_M"] + b_tiles * c["BLOCK_N"]) * c["BLOCK_K"] * _ELEM[dtype] * c["num_stages"]


def ctas_per_sm(c: dict, dtype, b_tiles: int = 1) -> int:
    """Programs resident per SM, by shared memory and registers (64K per SM, ~up to 255 a thread);
    ``b_tiles`` B tiles and accumulators a program (2 with SwiGLU)."""
    by_smem = SMEM_PER_SM // (pipeline_smem(c, dtype, b_tiles) + 8 * 1024)
    acc = b_tiles * c["BLOCK_M"] * c["BLOCK_N"]
    by_regs = 65536 // (32 * c["num_warps"] * max(64, 2 * acc // (32 * c["num_warps"])))
    return max(1, min(by_smem, by_regs, 4))


SPACE = K.Space(
    params={
        "BLOCK_M": [16, 32, 64, 128, 256],
        "BLOCK_N": [16, 32, 64, 128, 256],
        "BLOCK_K": [16, 32, 64, 128, 256],
        "GROUP_M": [1, 4, 8],
        "SPLIT_K": [1, 2, 4, 8, 16],
        "num_warps": [2, 4, 8],
        "num_stages": [2, 3, 4, 5, 6],  # 6: every K step of a K=768 problem in flight (128-deep)
        "TMA": [False, True],
        "PERSISTENT": [False, True],
    },
)


_ELEM = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, None: 2}


def _elem(dtype) -> int:
    return _ELEM[dtype]


@functools.lru_cache(maxsize=4096)
def _limits(p: Problem) -> tuple:
    """Tile limits: M, C's columns and K to powers of two (at least 16)."""
    return tuple(max(16, K.next_power_of_2(v)) for v in (p.M, p.n_out, p.K))


def constraint(c, p: Problem, dtype) -> str | None:
    # plain Python only: the space is enumerated point by point (tens of thousands per problem)
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    m2, n2, k2 = _limits(p)
    # tiles no larger than the problem (also what keeps the interpreter fast on tiny problems)
    if bm > m2:
        return "BLOCK_M larger than M"
    if bn > n2:
        return "BLOCK_N larger than N"
    if bk > k2:
        return "BLOCK_K larger than K"
    # SwiGLU: a gate and an up tile of B per K step, two accumulators
    tiles = 2 if p.act == "swiglu" else 1
    smem = pipeline_smem(c, dtype, tiles)
    if dtype == torch.float32:
        # fp32 (tf32) tiles also take an fp32 scratch of the whole accumulator for the epilogue's layout
        # change, not shared with the pipeline: 128x256x32 in 3 stages asked for 278552 bytes on an H100
        smem += tiles * bm * bn * 4
    if smem > SMEM_BUDGET:
        return f"{smem // 1024} KiB of shared memory for the pipeline"
    threads = 32 * c["num_warps"]
    if tiles * bm * bn > 128 * threads:
        return f"{tiles * bm * bn // threads} accumulator registers per thread"
    if bm * bn < 4 * threads:
        return "idle warps"
    split = c["SPLIT_K"]
    if split > 1 and c["PERSISTENT"]:
        return "persistent programs take whole tiles (no split-K)"
    if split > 1:
        if split > K.cdiv(p.K, bk):
            return "more K slices than K tiles"
        if c["GROUP_M"] > 1:
            return "split-K tiles are few: no grouping"
    if c["TMA"] and not tma_capable(0):
        return "no TMA on this GPU"
    if (p.ln or p.rms or p.kv) and (c["TMA"] or c["PERSISTENT"]):
        # the norm statistics read A's rows through pointers, and the fused entry takes one tile a program
        return "the LayerNorm prologue and the KV-cache write take pointer operands, one tile a program (no TMA, no persistent grid)"
    if p.act == "swiglu" and (p.kv or p.N % 2):
        return "SwiGLU takes an even N ([gate | up]) and no KV-cache write"
    return None


SPACE.constraint = constraint


# Tile candidates for mid-sized problems (BLOCK_M, BLOCK_N, num_warps, num_stages for 16-bit operands)
# and their relative MMA efficiency per SM (a larger tile reuses each loaded byte more).
_MID_TILES = [(128, 256, 8, 3, 1.0), (128, 128, 8, 4, 0.85), (64, 128, 4, 4, 0.7), (64, 64, 4, 5, 0.5)]


def _estimate_s(bm: int, bn: int, split: int, eff: float, m: int, n: int, k: int, sms: int, e: int) -> float:
    """Rough seconds for a tiling: whole waves of tiles at a per-SM MMA rate, plus split-K's partials
    (written and read back in fp32, mostly through L2) and its ticket round trip."""
    progs = K.cdiv(m, bm) * K.cdiv(n, bn) * split
    rate = (3.2e12 if e == 2 else 1.6e12) * eff          # multiply-adds per second per SM, achieved
    t = K.cdiv(progs, sms) * bm * bn * K.cdiv(K.cdiv(k, split), 64) * 64 / rate
    if split > 1:
        t += 2.0 * split * m * n * 4 / 5e12 + 1.5e-6
    return t


def default_config(p: Problem, dtype) -> dict:
    """A sound heuristic that depends only on the bucket (M to a power of two, N, K) and the dtype.

    Measured on the H100 (bf16; a 686-point sweep over the standard problems, GPU time under CUDA
    graphs with inputs cycled past L2, then do_bench with L2 flushed for the front runners):
    - M <= 64 reads B and little else: 16-row tiles (M <= 16) or one tile of all rows, 64-wide column
      tiles for 16 rows and 32-wide for more (the accumulator stays small), 128-wide for a very wide N
      (an LM head), 128- or 256-long K steps, 4 warps, 4 stages. Split-K when K is long (>= 2048) and
      the tiles are few: up to 8 slices while the programs fit in one wave and each slice keeps 3 K
      steps (GPT-2 c_proj, 768 x 3072, at M = 1: 9.6 -> 5.6 us, at M = 64: 10.1 -> 7.3 us; at K = 768
      no split is as fast). TMA descriptors would save ~5% of GPU time here but cost more host time
      than the kernel takes; pointers.
    - Large problems (at least two 128x256 tiles per SM): 128x256x64, 8 warps, TMA descriptors, a
      persistent grid (the pipeline runs on across tiles): the fastest on every such problem to within
      a few percent (4096^3 780 TFLOP/s, GPT-2 c_fc at M = 8192 1.2x cuBLAS + GELU). With N too
      narrow for that (768) but two 128x128 tiles per SM: the same at 128x128 (M = 8192: 10% faster
      than 128x128 pointer tiles).
    - In between: the tiling (and split-K) that a wave model says finishes first, pointer loads.
    SwiGLU: the plain GEMM's tiling of all N = 2F columns of B, each tile's columns taken half from the
    gate and half from the up weight (BLOCK_N halved: the same B bytes, MMAs and registers a tile)."""
    if p.act == "swiglu":
        cfg = default_config(dataclasses.replace(p, act=None), dtype)
        cfg = dict(cfg, BLOCK_N=max(16, cfg["BLOCK_N"] // 2))
        return _fit(cfg, p, dtype)
    e = _elem(dtype)
    m2 = max(16, K.next_power_of_2(p.M))
    n2 = max(16, K.next_power_of_2(p.N))
    k2 = max(16, K.next_power_of_2(p.K))
    sms = K.num_sms()
    tma = tma_capable(0)
    if m2 <= 64:
        bm = 16 if m2 <= 16 else min(m2, 64)
        if K.cdiv(p.N, 128) >= sms:  # very wide N: enough 128-wide tiles for every SM
            bn, bk = 128, (128 if bm == 16 else 64)
        else:
            bn, bk = (64, 128) if bm == 16 else (32, 128 if p.K <= 1024 else 256)
        bn, bk = min(n2, bn), min(k2, bk if e == 2 else 64)
        tiles = K.cdiv(p.M, bm) * K.cdiv(p.N, bn)
        k_tiles = K.cdiv(p.K, bk)
        split = 1
        if p.K >= 2048:
            while split < 8 and tiles * split * 2 <= sms and k_tiles >= 6 * split:
                split *= 2
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "SPLIT_K": split,
               "num_warps": 4, "num_stages": 4, "TMA": False, "PERSISTENT": False}
    elif e == 2 and m2 >= 128 and n2 >= 256 and K.cdiv(p.M, 128) * K.cdiv(p.N, 256) >= 2 * sms:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": min(k2, 64 if e == 2 else 32), "GROUP_M": 8,
               "SPLIT_K": 1, "num_warps": 8, "num_stages": 3 if p.K <= 1024 or e == 4 else 4,
               "TMA": tma, "PERSISTENT": True}
    elif m2 >= 128 and n2 >= 128 and K.cdiv(p.M, 128) * K.cdiv(p.N, 128) >= 2 * sms:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": min(k2, 64 if e == 2 else 32), "GROUP_M": 8,
               "SPLIT_K": 1, "num_warps": 8, "num_stages": 4, "TMA": tma, "PERSISTENT": True}
    else:
        best = None
        for bm, bn, warps, stages, eff in _MID_TILES:
            if bm > m2 or bn > n2 or (e == 4 and bm * bn > 128 * 128):  # fp32: the epilogue scratch (constraint)
                continue
            for split in (1, 2, 4, 8):
                if split > 1 and (K.cdiv(p.M, bm) * K.cdiv(p.N, bn) >= sms or p.K // split < 256):
                    break
                t = _estimate_s(bm, bn, split, eff, m2, p.N, p.K, sms, e)
                if best is None or t < best[0] * 0.97:
                    best = (t, bm, bn, warps, stages, split)
        if best is None:  # N (or M) below every mid tile: a narrow tile, _fit below makes it valid
            best = (0.0, 64 if m2 >= 64 else m2, min(n2, 64), 4, 4, 1)
        _, bm, bn, warps, stages, split = best
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": min(k2, 64 if e == 2 else 32),
               "GROUP_M": 8 if split == 1 else 1, "SPLIT_K": split, "num_warps": warps, "num_stages": stages,
               "TMA": False, "PERSISTENT": False}
    if p.ln or p.rms or p.kv:  # the fused entry: pointer operands, one tile a program (see constraint)
        cfg = dict(cfg, TMA=False, PERSISTENT=False)
    return _fit(cfg, p, dtype)


def _fit(cfg: dict, p: Problem, dtype) -> dict:
    """Shrink stages, then warps, until the point is valid (a default must always be)."""
    cfg = dict(cfg)
    for _ in range(16):
        why = SPACE.constraint(cfg, p, dtype)
        if why is None:
            return cfg
        if "shared memory" in why and cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif "shared memory" in why:
            cfg["BLOCK_K"] //= 2
        elif "idle warps" in why:
            cfg["num_warps"] //= 2
        elif "registers" in why:
            cfg["num_warps"] *= 2
        elif "slices" in why:
            cfg["SPLIT_K"] //= 2
        elif "TMA" in why:
            cfg["TMA"] = False
        else:
            break
    raise AssertionError(f"gemm: no valid default for {p}: {cfg}: {SPACE.constraint(cfg, p, dtype)}")


def bucket(p: Problem) -> dict:
    """M to a power of two, N, K; and ln=1 / kv=1 / rms=1 / swiglu=1 only when fused, so the keys of plain
    problems (and the store entries tuned under them) are what they were, and a fused problem never
    borrows a plain one's config (nearest-bucket lookups need the same fields)."""
    b = {"M": K.next_power_of_2(p.M), "N": p.N, "K": p.K}
    if p.ln:
        b["ln"] = 1
    if p.kv:
        b["kv"] = 1
    if p.rms:
        b["rms"] = 1
    if p.act == "swiglu":
        b["swiglu"] = 1
    return b


def cost(p: Problem, dtype) -> K.Cost:
    e = _elem(dtype)
    elems = p.M * p.K + p.K * p.N + p.M * p.n_out + (p.N if p.bias else 0) + (p.M * p.n_out if p.residual else 0)
    elems += (2 * p.K if p.ln else 0) + (p.K if p.rms else 0) + (2 * p.M * (p.N // 3) if p.kv else 0)
    return K.Cost(flops=2.0 * p.M * p.N * p.K, bytes=float(e * elems))
