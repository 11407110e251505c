"""Probe of 2026-11-23 (GPU only): what the open targets are up against, timed three ways
(flush_timing.flush_row: zero-fill do_bench, clean-flush do_bench, CUDA graph) on rotating inputs.
Sections (--only, comma-separated):

  copy     the ceiling at the open problems' byte counts: dst.copy_(src) moving B bytes (B/2 read, B/2
           written), so "% of copy bandwidth" can be read against what the copy reaches at that size
  read     a read-only Triton kernel over the same byte counts (the read ceiling)
  gemm     M=1 and M=64 c_attn (2304 x 768, bias): gemm's stored config, gemv kernel configs (the same
           epilogue), cuBLAS (addmm)
  int4 M=1 on (8192, 28672), each against the stored config and bf16 F.linear:
  quant    stock configs; an experimental copy of the swapped tl.dot tile (_swap4x) on row-major codes,
           scales row- or group-major, the scale folded into the dot operand or not
  quant2   _swap4x on codes in panels of BLOCK_N rows against row-major codes (group-major scales)
  quant3   stock configs the tuner's TPE did not reach
  quant4   the committed 64-row panels with scales and zero points in the same panels
  quant5   the next group's operands loaded by hand before this group's math (_swap4p)
  quant6   register caps (maxnreg)

The experimental variants run on the first input set (the int4 weight is larger than 2x L2: one set).
Sections quant and quant2 ran before the panel layout was committed; they rebuild row-major codes from
the panels (references.quant.from_panels), so they measure the same thing today.

  python lab/probes/ceilings_int4_variants.py --out $OUT/ceilings_int4_variants.json [--only copy,gemm,quant]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from tritune import kernels
from tritune.harness import bench, compare

import flush_timing  # noqa: E402  (beside this probe)
from tritune.kernels import gemv as gv
from tritune.kernels import quant_matmul as qm
from tritune.kernels.quant_matmul import _finish, _k_slice, _nibbles
from tritune.references import quant as Q
from tritune.tuning.cli import parse_problems

INT4_M1 = "M=1,N=28672,K=8192,bits=4,group=128"

@triton.jit
def _swap_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The swapped int4 tile's program: (pid_m, pid_n, pid_k, offs_m, offs_n, mask_m, mask_n), M tiles
    fastest (the programs of one weight panel run together)."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_m, pid_n, tl.program_id(1), offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _swap_store(acc, pid_m, pid_n, pid_k, offs_m, offs_n, mask_m, mask_n, Y, Work, Locks, M, N, s_ym,
                BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_M) accumulator transposed and stored through quant_matmul's _finish (split-K
    partials included; no bias, no per-channel scale)."""
    _finish(tl.trans(acc), offs_m, offs_n, mask_m, mask_n, Y, Y, Y, Work, Locks,
            pid_m * tl.cdiv(N, BLOCK_N) + pid_n, pid_k, M, N, s_ym, False, False, SPLIT_K)


@triton.jit
def _swap4x(X, Wq, Sc, Zp, Y, Work, Locks, M, N, K, s_xm, s_xk, s_wn, s_sn, s_sg, s_ym,
            GROUP: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, MAGIC: tl.constexpr, SCALE_IN: tl.constexpr,
            ASM: tl.constexpr, TILED: tl.constexpr = False, SC_PANEL: tl.constexpr = 0, PANEL: tl.constexpr = 0):
    """quant_matmul's swapped int4 tile (Yᵀ = dequant(W) · Xᵀ) with a group stride for the scales and zero
    points, and SCALE_IN: (q − z)·s rounded to x's dtype as the dot operand (one fp32 multiply-add a
    group fewer, the scale load feeding the dot so the pipeliner may prefetch it)."""
    pid_m, pid_n, pid_k, offs_m, offs_n, mask_m, mask_n = _swap_tile(M, N, BLOCK_M, BLOCK_N)
    DT: tl.constexpr = X.dtype.element_ty
    lo, hi = _k_slice(pid_k, K, GROUP, 4, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    x_cols = X + offs_m.to(tl.int64)[None, :] * s_xm
    n_groups = K // GROUP
    R: tl.constexpr = BLOCK_N if PANEL == 0 else PANEL
    if TILED:  # rows in R-row panels, each group's (R, H) bytes one contiguous block
        n64 = offs_n.to(tl.int64)
        w_rows = Wq + ((n64 // R) * (n_groups * R * H) + (n64 % R) * H)[:, None]
    else:
        w_rows = Wq + offs_n.to(tl.int64)[:, None] * s_wn
    offs_h = tl.arange(0, H)
    for blk in range(lo, hi):
        for j in tl.static_range(BLOCK_K // GROUP):
            grp = tl.minimum(blk * (BLOCK_K // GROUP) + j, n_groups - 1)
            k_lo = (blk * (BLOCK_K // GROUP) + j) * GROUP + offs_h
            if SC_PANEL > 0:  # scales and zero points in panels too: (N/P, G, P), a panel's run sequential
                sz_off = (offs_n // SC_PANEL) * (n_groups * SC_PANEL) + grp * SC_PANEL + offs_n % SC_PANEL
            else:
                sz_off = offs_n * s_sn + grp * s_sg
            s = tl.load(Sc + sz_off, mask=mask_n, other=0.0)
            z = tl.load(Zp + sz_off, mask=mask_n, other=0).to(tl.int16)
            zf = (z | MAGIC).to(DT, bitcast=True)
            if TILED:
                b = tl.load(w_rows + grp * (R * H) + offs_h[None, :], mask=mask_n[:, None], other=0)
            else:
                b = tl.load(w_rows + (grp * H + offs_h)[None, :], mask=mask_n[:, None], other=0)
            xm = (k_lo < K)[:, None] & mask_m[None, :]
            x_lo = tl.load(x_cols + k_lo[:, None] * s_xk, mask=xm, other=0.0)
            x_hi = tl.load(x_cols + (k_lo + H)[:, None] * s_xk, mask=xm, other=0.0)
            q_lo, q_hi = _nibbles(b, MAGIC, DT, ASM)
            if SCALE_IN:
                sd = s.to(DT)[:, None]
                acc = tl.dot(((q_lo - zf[:, None]) * sd).to(DT), x_lo, acc)
                acc = tl.dot(((q_hi - zf[:, None]) * sd).to(DT), x_hi, acc)
            else:
                part = tl.dot(q_lo - zf[:, None], x_lo)
                part = tl.dot(q_hi - zf[:, None], x_hi, part)
                acc += part * s.to(tl.float32)[:, None]
    _swap_store(acc, pid_m, pid_n, pid_k, offs_m, offs_n, mask_m, mask_n, Y, Work, Locks, M, N, s_ym, BLOCK_N,
                SPLIT_K)



@triton.jit
def _group_operands(Wq, Sc, Zp, x_cols, offs_n, mask_n, mask_m, offs_h, grp, K, n_groups, s_sn, s_sg, s_xk,
                    GROUP: tl.constexpr, H: tl.constexpr, R: tl.constexpr):
    """One group's operands for the swapped tile: codes (BN, H) from the 64-row panels, scale and zero
    point per row (group-major), and the group's two halves of x (H, BM)."""
    n64 = offs_n.to(tl.int64)
    b = tl.load(Wq + ((n64 // R) * (n_groups * R * H) + (n64 % R) * H + grp * (R * H))[:, None] + offs_h[None, :],
                mask=mask_n[:, None], other=0)
    s = tl.load(Sc + offs_n * s_sn + grp * s_sg, mask=mask_n, other=0.0)
    z = tl.load(Zp + offs_n * s_sn + grp * s_sg, mask=mask_n, other=0)
    k_lo = grp * GROUP + offs_h
    xm = (k_lo < K)[:, None] & mask_m[None, :]
    x_lo = tl.load(x_cols + k_lo[:, None] * s_xk, mask=xm, other=0.0)
    x_hi = tl.load(x_cols + (k_lo + H)[:, None] * s_xk, mask=xm, other=0.0)
    return b, s, z, x_lo, x_hi


@triton.jit
def _swap4p(X, Wq, Sc, Zp, Y, Work, Locks, M, N, K, s_xm, s_xk, s_sn, s_sg, s_ym,
            GROUP: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            SPLIT_K: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr, R: tl.constexpr):
    """The swapped int4 tile on the committed layout (64-row panels, group-major scales), one group an
    iteration, the next group's operands loaded into registers before this group's math (a software
    pipeline by hand: Triton does not pipeline these loads, whose bytes reach the dot through inline asm)."""
    pid_m, pid_n, pid_k, offs_m, offs_n, mask_m, mask_n = _swap_tile(M, N, BLOCK_M, BLOCK_N)
    DT: tl.constexpr = X.dtype.element_ty
    lo, hi = _k_slice(pid_k, K, GROUP, 4, GROUP, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    x_cols = X + offs_m.to(tl.int64)[None, :] * s_xm
    n_groups = K // GROUP
    offs_h = tl.arange(0, H)
    b, s, z, x_lo, x_hi = _group_operands(Wq, Sc, Zp, x_cols, offs_n, mask_n, mask_m, offs_h, lo, K, n_groups,
                                          s_sn, s_sg, s_xk, GROUP, H, R)
    for grp in range(lo, hi):
        nxt = tl.minimum(grp + 1, hi - 1)
        b2, s2, z2, xl2, xh2 = _group_operands(Wq, Sc, Zp, x_cols, offs_n, mask_n, mask_m, offs_h, nxt, K,
                                               n_groups, s_sn, s_sg, s_xk, GROUP, H, R)
        zf = (z.to(tl.int16) | MAGIC).to(DT, bitcast=True)
        q_lo, q_hi = _nibbles(b, MAGIC, DT, ASM)
        part = tl.dot(q_lo - zf[:, None], x_lo)
        part = tl.dot(q_hi - zf[:, None], x_hi, part)
        acc += part * s.to(tl.float32)[:, None]
        b, s, z, x_lo, x_hi = b2, s2, z2, xl2, xh2
    _swap_store(acc, pid_m, pid_n, pid_k, offs_m, offs_n, mask_m, mask_n, Y, Work, Locks, M, N, s_ym, BLOCK_N,
                SPLIT_K)


def swap4p(x, qw, out, cfg):
    """A launch of _swap4p. It reads the scales and zero points with one pair of strides: the layout before
    commit 5431d0c (separate tensors of equal strides). On the 4-byte words since then (bf16
    and uint8 views of different strides) it reads wrong zero points; rebuild them with
    ``qw.scales.contiguous()`` and ``qw.zeros.contiguous()`` first."""
    m, kdim = x.shape
    n = qw.N
    bm, bn, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["SPLIT_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    work = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    locks = torch.zeros(tiles, dtype=torch.int32, device=x.device)

    def run():
        _swap4p[(tiles, split)](x, qw.data, qw.scales, qw.zeros, out, work, locks, m, n, kdim, x.stride(0),
                                x.stride(1), qw.scales.stride(0), qw.scales.stride(1), out.stride(0),
                                GROUP=qw.group_size, H=qw.group_size // 2, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split,
                                MAGIC=0x6400 if x.dtype == torch.float16 else 0x4300, ASM=qm._ASM, R=64,
                                num_warps=cfg["num_warps"], num_stages=1)
        return out
    return run



@triton.jit
def _read_words(X, Out, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Each program sums ITERS * BLOCK int32 words (a read-only stream: the read roofline)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in tl.range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0)
    tl.store(Out + pid, tl.sum(acc))


def swap4x(x, qw, out, cfg, *, data, sc, zp, panel=None, scale_in=False, sc_panel=0, maxnreg=None):
    """A launch of _swap4x. data: row-major codes (N, K/2) (panel None) or panels of ``panel`` rows (0:
    BLOCK_N rows); sc, zp: (N, G) with any strides, or (sc_panel > 0) in panels of that many rows."""
    m, kdim = x.shape
    n = qw.N
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    work = torch.empty(split * m * n if split > 1 else 1, dtype=torch.float32, device=x.device)
    locks = torch.zeros(tiles, dtype=torch.int32, device=x.device)
    s_sn, s_sg = (0, 0) if sc_panel else sc.stride()
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}

    def run():
        _swap4x[(tiles, split)](x, data, sc, zp, out, work, locks, m, n, kdim, x.stride(0), x.stride(1),
                                data.stride(0), s_sn, s_sg, out.stride(0), GROUP=qw.group_size,
                                H=qw.group_size // 2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                                MAGIC=0x6400 if x.dtype == torch.float16 else 0x4300, SCALE_IN=scale_in, ASM=qm._ASM,
                                TILED=panel is not None, SC_PANEL=sc_panel, PANEL=panel or 0,
                                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)
        return out
    return run


def row_major(qw):
    """The weight as it was stored before the panels: codes (N, K/2), scales and zero points (N, G)."""
    return Q.from_panels(qw.data, qw.N), qw.scales.contiguous(), qw.zeros.contiguous()


def sz_panels(t, rows=64):
    """(N, G) scales or zero points -> (N/rows, G, rows) contiguous (N a multiple of rows)."""
    n, g = t.shape
    return t.reshape(n // rows, rows, g).permute(0, 2, 1).contiguous()


def timed(rows, kernel, problem, who, fn, err=None, nbytes=None):
    """One probe row; with ``nbytes``, the GB/s each timing gives."""
    row = flush_timing.flush_row(fn, kernel=kernel, problem=problem, who=who, rel_error=err)
    if nbytes:
        for k in ("zero_us", "clean_us", "graph_us"):
            if k in row:
                row[k.replace("_us", "_gbps")] = nbytes / (row[k] * 1e-6) / 1e9
    rows.append(row)


def variant(rows, kernel, problem, label, fn, out, want):
    """Check ``fn`` (its first call) against the reference, then time it; a failure is a row too."""
    try:
        compare.poison(out)
        err = compare.rel_error(fn(), want)
    except Exception as e:
        rows.append({"kernel": kernel, "problem": problem, "who": label, "error": f"{type(e).__name__}: {e}"[:300]})
        return
    timed(rows, kernel, problem, label, fn, err)


def config_label(cfg) -> str:
    return "store" if cfg is None else json.dumps(cfg, separators=(",", ":"))


def int4_section(rows, variants, text=INT4_M1):
    """An int4 problem (``text``, the M=1 one by default): the stored config, ``variants(spec, stock, x, qw, out)``'s (label, fn) pairs
    (``stock(cfg)``: quant_matmul with that config), then bf16 F.linear and tinygemm, each checked and
    timed."""
    spec = kernels.get("quant_matmul")
    problem = parse_problems(spec, text)[0]
    cases = bench.rotation(spec, problem, torch.bfloat16, "cuda", 0)
    c0 = cases[0]
    x, qw, _ = c0.args
    want = spec.reference(*c0.args, **c0.kwargs)

    def stock(cfg):
        return bench.cycling(cases, lambda c: lambda c=c: spec.run(*c.args, out=c.out, config=cfg, **c.kwargs))

    timed(rows, "quant_matmul", text, "store", stock(None))
    for label, fn in variants(spec, stock, x, qw, c0.out):
        variant(rows, "quant_matmul", text, label, fn, c0.out, want)
    timed(rows, "quant_matmul", text, spec.vendor_name, bench.cycling(cases, spec.vendor))
    calls, _ = bench.peer_calls(spec, cases)
    if "tinygemm" in calls:
        timed(rows, "quant_matmul", text, "tinygemm", calls["tinygemm"])


def q(bn, bk, split, w, s, bm=8):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "num_warps": w, "num_stages": s}


def copy_ladder(rows):
    l2 = bench.l2_bytes()
    for moved in (3_538_944, 16_777_216, 33_554_432, 67_108_864, 125_000_000, 201_326_592, 1 << 31):
        half = moved // 2
        sets = max(1, min(24, -(-4 * l2 // moved)))
        pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda").random_(),
                  torch.empty(half, dtype=torch.uint8, device="cuda")) for _ in range(sets)]
        timed(rows, "copy", f"bytes={moved}", "dst.copy_(src)",
              bench.cycling(pairs, lambda p: (lambda: p[1].copy_(p[0]))), nbytes=moved)
        del pairs
        torch.cuda.empty_cache()


def read_ladder(rows):
    l2 = bench.l2_bytes()
    for nbytes in (3_538_944, 16_777_216, 33_554_432, 67_108_864, 125_000_000, 201_326_592):
        words = nbytes // 4
        sets = max(1, min(24, -(-4 * l2 // nbytes)))
        bufs = [torch.randint(0, 1 << 20, (words,), dtype=torch.int32, device="cuda") for _ in range(sets)]
        for block, iters, warps, stages in ((2048, 4, 8, 2), (1024, 8, 4, 3), (4096, 2, 8, 1), (1024, 2, 4, 1)):
            grid = triton.cdiv(words, block * iters)
            out = torch.empty(grid, dtype=torch.int32, device="cuda")
            fn = bench.cycling(bufs, lambda b, block=block, iters=iters, warps=warps, stages=stages, grid=grid, out=out:
                               (lambda: _read_words[(grid,)](b, out, words, BLOCK=block, ITERS=iters,
                                                             num_warps=warps, num_stages=stages)))
            timed(rows, "read", f"bytes={nbytes}", f"read BLOCK={block} ITERS={iters} w={warps} s={stages}", fn,
                  nbytes=nbytes)
        del bufs
        torch.cuda.empty_cache()


def gemm_small(rows):
    spec = kernels.get("gemm")
    gcfg = lambda bm, bn, bk, split, w, s: {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                                            "num_warps": w, "num_stages": s}
    configs = {
        "M=1,N=2304,K=768,bias=True": [
            gcfg(1, 32, 64, 8, 2, 4), gcfg(1, 32, 128, 4, 2, 1), gcfg(1, 16, 256, 2, 2, 1), gcfg(1, 32, 256, 2, 4, 1),
            gcfg(1, 64, 128, 4, 4, 1), gcfg(1, 16, 128, 4, 1, 1), gcfg(1, 32, 128, 2, 2, 1), gcfg(1, 64, 64, 4, 2, 1),
            gcfg(1, 32, 64, 4, 2, 1), gcfg(1, 16, 64, 8, 1, 1), gcfg(1, 32, 256, 1, 4, 1), gcfg(1, 64, 256, 1, 4, 1),
            gcfg(1, 128, 64, 2, 4, 1), gcfg(1, 16, 1024, 1, 4, 1),
        ],
        "M=64,N=2304,K=768,bias=True": [
            gcfg(16, 32, 128, 1, 4, 3), gcfg(16, 64, 128, 1, 4, 3), gcfg(32, 32, 128, 1, 4, 3), gcfg(64, 32, 256, 1, 4, 3),
            gcfg(64, 64, 128, 1, 4, 3), gcfg(16, 32, 256, 1, 2, 3), gcfg(32, 64, 64, 1, 4, 4),
        ],
    }
    for text, cfgs in configs.items():
        problem = parse_problems(spec, text)[0]
        cases = bench.rotation(spec, problem, torch.bfloat16, "cuda", 0)
        c0 = cases[0]
        want = spec.reference(*c0.args, **c0.kwargs)
        variant(rows, "gemm", text, "gemm store", bench.cycling(cases, lambda c: lambda c=c: spec.run(
            *c.args, out=c.out, **c.kwargs)), c0.out, want)
        for cfg in cfgs:
            variant(rows, "gemm", text, "gemv " + config_label(cfg),
                    bench.cycling(cases, lambda c, cfg=cfg: lambda c=c: gv.gemv(*c.args, out=c.out, config=cfg,
                                                                                 **c.kwargs)), c0.out, want)
        timed(rows, "gemm", text, spec.vendor_name, bench.cycling(cases, spec.vendor))
        del cases
        torch.cuda.empty_cache()


def quant_int4(rows):
    def variants(spec, stock, x, qw, out):
        for cfg in (q(64, 256, 4, 2, 2), q(64, 512, 2, 4, 2), q(64, 256, 4, 2, 3), q(64, 256, 4, 2, 4),
                    q(64, 512, 4, 4, 2), q(128, 256, 4, 4, 2), q(128, 512, 2, 4, 2), q(32, 512, 4, 2, 2),
                    q(32, 1024, 2, 2, 2), q(64, 1024, 2, 4, 2), q(64, 256, 8, 2, 3)):
            yield config_label(cfg), stock(cfg)
        data, sc, zp = row_major(qw)
        sct, zpt = sc.t().contiguous().t(), zp.t().contiguous().t()  # group-major storage, (N, G) views
        for cfg in (q(64, 256, 4, 2, 2), q(64, 512, 2, 4, 2), q(128, 256, 4, 4, 2), q(64, 256, 4, 4, 3)):
            for gmajor in (False, True):
                for scale_in in (False, True):
                    yield (f"swap4x gmajor={gmajor} scale_in={scale_in} " + config_label(cfg),
                           swap4x(x, qw, out, cfg, data=data, sc=sct if gmajor else sc, zp=zpt if gmajor else zp,
                                  scale_in=scale_in))
    int4_section(rows, variants)
    torch.cuda.empty_cache()


def quant_tiled(rows):
    def variants(spec, stock, x, qw, out):
        data = Q.from_panels(qw.data, qw.N)
        panels = {}
        for cfg in (q(64, 256, 4, 2, 2), q(64, 512, 2, 4, 2), q(64, 512, 4, 4, 2), q(32, 512, 4, 2, 2),
                    q(128, 256, 4, 4, 2), q(64, 256, 4, 4, 3), q(64, 256, 2, 2, 2), q(64, 512, 1, 4, 2),
                    q(32, 256, 8, 2, 2), q(128, 512, 2, 8, 2)):
            bn = cfg["BLOCK_N"]
            if bn not in panels:
                panels[bn] = Q.to_panels(data, qw.group_size, bn)
            for tiled, scale_in in ((True, False), (True, True), (False, False)):
                yield (f"swap4x gmajor tiled={tiled} scale_in={scale_in} " + config_label(cfg),
                       swap4x(x, qw, out, cfg, data=panels[bn] if tiled else data, sc=qw.scales, zp=qw.zeros,
                              panel=0 if tiled else None, scale_in=scale_in))
    int4_section(rows, variants)
    torch.cuda.empty_cache()


def quant_configs(rows):
    def variants(spec, stock, x, qw, out):
        for cfg in (q(16, 256, 1, 1, 2), q(16, 256, 2, 1, 2), q(16, 256, 1, 1, 3), q(16, 512, 1, 1, 2),
                    q(16, 128, 2, 1, 3), q(64, 256, 2, 2, 2), q(64, 256, 2, 4, 2), q(32, 512, 2, 2, 2),
                    q(32, 256, 2, 1, 2), q(32, 256, 1, 2, 2), q(64, 256, 1, 2, 2), q(128, 256, 2, 4, 2)):
            yield config_label(cfg), stock(cfg)
    int4_section(rows, variants)
    torch.cuda.empty_cache()


def quant_scpanel(rows):
    def variants(spec, stock, x, qw, out):
        scp, zpp = sz_panels(qw.scales), sz_panels(qw.zeros)
        for cfg in (q(32, 256, 2, 2, 2), q(16, 256, 2, 1, 2), q(64, 256, 2, 4, 2), q(32, 256, 2, 2, 1),
                    q(64, 256, 4, 2, 2)):
            yield ("swap4x panels sz=gmajor " + config_label(cfg),
                   swap4x(x, qw, out, cfg, data=qw.data, sc=qw.scales, zp=qw.zeros, panel=Q.PANEL_ROWS))
            yield ("swap4x panels sz=scpanel " + config_label(cfg),
                   swap4x(x, qw, out, cfg, data=qw.data, sc=scp, zp=zpp, panel=Q.PANEL_ROWS, sc_panel=Q.PANEL_ROWS))
    int4_section(rows, variants)
    torch.cuda.empty_cache()


def quant_prefetch(rows):
    def variants(spec, stock, x, qw, out):
        p = lambda bn, split, w: {"BLOCK_M": 8, "BLOCK_N": bn, "SPLIT_K": split, "num_warps": w}
        for cfg in (p(32, 2, 2), p(32, 4, 2), p(64, 2, 2), p(64, 2, 4), p(64, 4, 4), p(32, 1, 2), p(16, 2, 1),
                    p(64, 1, 4), p(128, 2, 4), p(32, 8, 2)):
            yield "swap4p prefetch " + config_label(cfg), swap4p(x, qw, out, cfg)
    int4_section(rows, variants)
    torch.cuda.empty_cache()


def quant_maxnreg(rows):
    def variants(spec, stock, x, qw, out):
        for cfg, regs in ((q(32, 256, 2, 2, 2), None), (q(32, 256, 2, 2, 2), 56), (q(32, 256, 2, 2, 2), 48),
                          (q(32, 256, 2, 2, 2), 40), (q(32, 256, 2, 2, 2), 32), (q(64, 256, 2, 4, 2), None),
                          (q(64, 256, 2, 4, 2), 48), (q(64, 256, 2, 4, 2), 40), (q(32, 128, 2, 2, 2), 40),
                          (q(32, 256, 4, 2, 2), 40)):
            yield (f"swap4x panels maxnreg={regs} " + config_label(cfg),
                   swap4x(x, qw, out, cfg, data=qw.data, sc=qw.scales, zp=qw.zeros, panel=Q.PANEL_ROWS, maxnreg=regs))
    int4_section(rows, variants)
    torch.cuda.empty_cache()


SECTIONS = {"copy": copy_ladder, "read": read_ladder, "gemm": gemm_small, "quant": quant_int4, "quant2": quant_tiled,
            "quant3": quant_configs, "quant4": quant_scpanel, "quant5": quant_prefetch, "quant6": quant_maxnreg}


def run_sections(sections: dict, names: str, out: str) -> None:
    """Run the comma-separated ``names`` of ``sections`` in turn (a section's error is a row of its own),
    rewriting ``out`` after each: a call cut short keeps what it measured."""
    rows = []
    for name in names.split(","):
        try:
            sections[name](rows)
        except Exception as e:
            import traceback
            traceback.print_exc()
            rows.append({"section": name, "error": f"{type(e).__name__}: {e}"[:500]})
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="copy,gemm,quant")
    args = p.parse_args()
    run_sections(SECTIONS, args.only, args.out)


if __name__ == "__main__":
    sys.exit(main())
