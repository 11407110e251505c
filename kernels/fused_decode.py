"""GPT-2's whole decode step (1 to 8 rows) in one persistent launch: every layer's stages, then the LM head.

Per layer, five stages over the residual stream x (M, E), M <= 8 rows::

    0  qkv = LN1(x) @ W_qkv + b_qkv          k, v also written to the paged cache at each row's slot
    1  a   = attention(q, K/V cache)          per (row, head, KV chunk); chunks merged by the last arrival
    2  x  += a @ W_o + b_o
    3  h   = gelu(LN2(x) @ W_fc + b_fc)
    4  x  += h @ W_proj + b_proj

and one final stage ``logits = LN_f(x) @ lm_head``. Stage s of layer l is number 5·l + kind.

Why one launch: at batch 1 a GPT-2-small step reads 249 MB of weights (83 us at 3 TB/s) but ran as ~60
kernels, each paying a launch, a ramp-up and a tail. Here the grid is one program per SM, all resident at
once; a stage's programs split its work (GEMV stages: BLOCK_N-column tiles, optionally cut into uniform
K slices, or stream-K: each program one contiguous range of the stage's (tile, K block) units, so every
program has work whatever the tile count; attention: (row, head, KV chunk)), and stages are separated by a grid barrier in global memory: an
arrival counter per stage (``atomic_add(.., 1, sem="release")`` after a program's stores), on which every
program then spins with acquire loads until all P have arrived. Before it spins, a program issues the
loads of its first weight block of the next GEMV stage, so the weight stream overlaps the barrier wait
(the loads' results sit in registers, carried into the next stage). LayerNorm is recomputed by every
program that needs the normalized rows (M x E floats from L2: cheaper than a stage of its own).

Counters: the last program to leave (an exit ticket) zeroes every counter, so the next launch (a CUDA
graph replay) finds them at zero without a memset. Split-K, stream-K and split-KV partial results are merged
by the last arrival of each tile (a per-tile ticket, reset by that program), in a fixed order (K order):
for a given config and program count the logits do not depend on which program finishes first.

Data written inside the launch by other programs (x, qkv, a, h, the new K/V, partials) is read with
``cache_modifier=".cg"`` (L2, never a stale L1 line).

``SYNC=False`` compiles the barriers out and runs the stages [stage_lo, stage_hi) of every program in
order: the host then launches one stage per launch (the interpreter, where programs run one after
another and a spinning program would never be joined by the others). ``DEBUG``: 1 removes the barrier
waits (arrivals kept), 2 also delays the stores of odd programs (a spin on a scratch counter): the
wrong-dependency tests show that results then go wrong, so a missing dependency cannot pass unseen.

The grid must fit on the GPU at once (P <= SMs, one program per SM, nothing else running): otherwise the
barrier never completes. The model-level driver (``tritune.model.engine.fused_decode``) guarantees that.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------------
# Stage descriptors
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _gemv_params(s, L, E, F, WQKV, WO, WFC, WPROJ, BQKV, BO, BFC, BPROJ,
                 SPLIT_QKV, SPLIT_O, SPLIT_FC, SPLIT_PROJ):
    """(weights, bias, stride along K, stride along N, N, K, split) of layer GEMV stage s < 5·L (kind 1 =
    attention is never asked: its caller skips to the next stage; the LM head has its own call site, with
    its own weight layout). split 0: stream-K (see _unit)."""
    layer = s // 5 + tl.zeros((), dtype=tl.int64)   # s is a plain int in the interpreter
    kind = s % 5
    z = s * 0                   # every branch assigns tensors: an int argument equal to 1 arrives as a constant
    if kind == 0:
        w = WQKV + layer * E * 3 * E
        b = BQKV + layer * 3 * E
        s_wk = z + 3 * E
        s_wn = z + 1
        n = z + 3 * E
        k = z + E
        split = z + SPLIT_QKV
    elif kind == 3:
        w = WFC + layer * E * F
        b = BFC + layer * F
        s_wk = z + F
        s_wn = z + 1
        n = z + F
        k = z + E
        split = z + SPLIT_FC
    elif kind == 4:
        w = WPROJ + layer * F * E
        b = BPROJ + layer * E
        s_wk = z + E
        s_wn = z + 1
        n = z + E
        k = z + F
        split = z + SPLIT_PROJ
    else:                       # kind 2 (and 1, mapped to 2 by the caller)
        w = WO + layer * E * E
        b = BO + layer * E
        s_wk = z + E
        s_wn = z + 1
        n = z + E
        k = z + E
        split = z + SPLIT_O
    return w, b, s_wk, s_wn, n, k, split


@triton.jit
def _load_w(w, offs_k, offs_n, k_bound, n_bound, s_wk, s_wn, IS_LM: tl.constexpr, LM_KMAJOR: tl.constexpr):
    """A weight block (zeros outside [0, k_bound) x [0, n_bound)). The unit stride is a literal (not a
    runtime stride of 1), and strides and bounds are rounded down to multiples of 8, which they are (the
    driver requires n_embd and the MLP width % 8 == 0): the compiler then knows 16-byte alignment and the
    loads vectorise (tl.multiple_of cannot mark these values: they are loop-carried). Layer weights run
    along N; the LM head along K when it is the tied wte^T view (its V columns are no multiple of 8).
    IS_LM is a compile-time switch: the two layouts in one code path (a runtime branch) cost a layout
    conversion of every block and ~40 registers a thread (sm90 ptxas: 16 KB blocks spilled)."""
    ok = offs_k.to(tl.int64)
    on = offs_n.to(tl.int64)
    kb = (k_bound // 8) * 8
    if IS_LM:
        mask = (offs_k < kb)[:, None] & (offs_n < n_bound)[None, :]
        if LM_KMAJOR:   # the column stride is n_embd, a multiple of 8
            v = tl.load(w + ok[:, None] + on[None, :] * ((s_wn // 8) * 8), mask=mask, other=0.0)
        else:
            v = tl.load(w + ok[:, None] * s_wk + on[None, :] * s_wn, mask=mask, other=0.0)
    else:
        mask = (offs_k < kb)[:, None] & (offs_n < (n_bound // 8) * 8)[None, :]
        v = tl.load(w + ok[:, None] * ((s_wk // 8) * 8) + on[None, :], mask=mask, other=0.0)
    return v


@triton.jit
def _unit(t, pid, P, split, n, k, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(column tile, K block, last block of its segment) of step t of program pid in a GEMV stage, and the
    program's step count. Two decompositions of the (tile, K block) grid:

    split >= 1 (uniform split-K): work item = (tile, one of ``split`` K slices); program pid takes items
      pid, pid + P, ...: a stage has tiles x split equal items, so a shape whose tile count is no multiple
      of P leaves programs idle (GPT-2 small's qkv: 72 tiles on 132 SMs).
    split == 0 (stream-K): the tiles' K blocks in one row-major sequence of U = tiles x kb units, cut into
      Pe = min(P, U) contiguous ranges [pid·U // Pe, (pid+1)·U // Pe): every program has floor(U/Pe) or
      one more, whatever the shape; a range may begin or end inside a tile (a partial, merged in _finish)."""
    kbt = tl.cdiv(k, BLOCK_K)
    tiles = tl.cdiv(n, BLOCK_N)
    sp = tl.maximum(split, 1)
    kt = tl.cdiv(kbt, sp)                       # K blocks of a uniform slice
    U = tiles * kbt
    Pe = tl.minimum(P, U)
    lo = pid * U // Pe
    hi = tl.where(pid < Pe, (pid + 1) * U // Pe, lo)
    u = lo + t
    item = pid + (t // kt) * P
    stream = split == 0
    tile = tl.where(stream, u // kbt, item // sp)
    kblk = tl.where(stream, u % kbt, (item % sp) * kt + t % kt)
    steps = tl.where(stream, hi - lo, tl.maximum(tl.cdiv(tiles * sp - pid, P), 0) * kt)
    last = tl.where(stream, (kblk == kbt - 1) | (t == steps - 1), t % kt == kt - 1)
    return tile, kblk, last, steps


@triton.jit
def _first_block(pid, P, w, s_wk, s_wn, n, k, split,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_LM: tl.constexpr, LM_KMAJOR: tl.constexpr):
    """The first weight block of program pid's first step in a GEMV stage (zeros when it has none):
    loaded before a barrier wait, consumed after it."""
    tile, kblk, last, steps = _unit(0, pid, P, split, n, k, BLOCK_N, BLOCK_K)
    offs_k = kblk * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = tl.where(steps > 0, n, 0)   # (a scalar condition in the mask: the interpreter's masks go int32)
    return _load_w(w, offs_k, offs_n, k, n_live, s_wk, s_wn, IS_LM, LM_KMAJOR)


@triton.jit
def _next_gemv_stage(s, L):
    """The GEMV stage whose weights a program prefetches after stage s (attention, kind 1, has none)."""
    t = s + 1
    if t < 5 * L:
        if t % 5 == 1:
            t = s + 2
    return t


# ---------------------------------------------------------------------------------------------------
# LayerNorm statistics, recomputed by each program that needs them
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _row_stats(X, M, E, eps, BLOCK_M: tl.constexpr, LN_BLOCK: tl.constexpr):
    """(mean, rstd) of the M rows of X (M, E) contiguous, float32. Each row is read once, whole
    (LN_BLOCK >= E): one L2 round trip a row, the variance from the registers (a chunked two-pass read
    would chain six round trips at n_embd 768, ~3 us on every LayerNorm stage)."""
    offs_m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, LN_BLOCK)
    km = kk < E
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for m in range(0, M):
        v = tl.load(X + m * E + kk, mask=km, other=0.0, cache_modifier=".cg").to(tl.float32)
        mu = tl.sum(v, axis=0) / E
        d = tl.where(km, v - mu, 0.0)
        r = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / E + eps)
        mean = tl.where(offs_m == m, mu, mean)
        rstd = tl.where(offs_m == m, r, rstd)
    return mean, rstd


@triton.jit
def _load_x(Xin, rows, s_x, offs_k, k_bound, mm, has_ln, LnW, LnB):
    """A K block of the input rows (raw) and of the LayerNorm's weight and bias (float32; zeros without
    LN), zeros outside [0, k_bound): loaded one step ahead of their use, like the weight blocks."""
    km = offs_k < k_bound
    xv = tl.load(Xin + rows[:, None] * s_x + offs_k[None, :], mask=mm[:, None] & km[None, :], other=0.0,
                 cache_modifier=".cg")
    if has_ln:
        lw = tl.load(LnW + offs_k, mask=km, other=0.0).to(tl.float32)
        lb = tl.load(LnB + offs_k, mask=km, other=0.0).to(tl.float32)
    else:
        lw = tl.zeros(offs_k.shape, dtype=tl.float32)
        lb = tl.zeros(offs_k.shape, dtype=tl.float32)
    return xv, lw, lb


# ---------------------------------------------------------------------------------------------------
# A GEMV stage
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _gemv_stage(pid, P, wpre, s, kind, M, E, F, eps, Xin, s_x, has_ln, LnW, LnB,
                w, bias, s_wk, s_wn, n, k, split,
                X, QKV, Hb, Logits, s_log, KC, VC, Slots, C, Work, Tick, Dbg, debug_spin,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LN_BLOCK: tl.constexpr,
                IS_LM: tl.constexpr, LM_KMAJOR: tl.constexpr, DEBUG: tl.constexpr):
    """y = epilogue(LN?(xin) @ w): program pid takes work items pid, pid + P, ... (item = (column tile,
    K slice)); its first weight block is ``wpre``, every later one is loaded a step ahead of its use."""
    offs_m = tl.arange(0, BLOCK_M)
    mm = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_kb = tl.arange(0, BLOCK_K)
    offs_nb = tl.arange(0, BLOCK_N)
    # Issued together, before anything waits on them: the first input block, the first tile's bias and (one
    # row) its residual, then the LayerNorm's rows (each load a round trip to L2 or HBM; one after the other
    # they were a chain of ~0.5-1 us steps at the head of every stage)
    tile0, kblk0, last0, steps = _unit(0, pid, P, split, n, k, BLOCK_N, BLOCK_K)
    wv = wpre
    k0 = tl.where(steps > 0, k, 0)
    xr, lw, lb = _load_x(Xin, rows, s_x, kblk0 * BLOCK_K + offs_kb, k0, mm, has_ln, LnW, LnB)
    cols0 = tile0 * BLOCK_N + offs_nb
    # (scalar conditions as bounds, not in the masks: the interpreter's masks would turn int32)
    b0 = tl.load(bias + cols0, mask=cols0 < tl.where((steps > 0) & (kind != 5), n, 0), other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        n_res = tl.where((steps > 0) & ((kind == 2) | (kind == 4)), n, 0)
        r0 = tl.load(X + cols0[None, :], mask=(cols0 < n_res)[None, :], other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        r0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if has_ln:
        mean, rstd = _row_stats(Xin, M, E, eps, BLOCK_M, LN_BLOCK)
    else:
        mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
        rstd = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, steps):
        tile, kblk, last, steps_ = _unit(t, pid, P, split, n, k, BLOCK_N, BLOCK_K)
        offs_k = kblk * BLOCK_K + offs_kb
        km = offs_k < k
        # the next step's weight block and input rows, issued before this step's math
        t1 = t + 1
        tile1, kblk1, last1, steps1 = _unit(t1, pid, P, split, n, k, BLOCK_N, BLOCK_K)
        offs_k1 = kblk1 * BLOCK_K + offs_kb
        offs_n1 = tile1 * BLOCK_N + offs_nb
        n1 = tl.where(t1 < steps, n, 0)
        w_next = _load_w(w, offs_k1, offs_n1, k, n1, s_wk, s_wn, IS_LM, LM_KMAJOR)
        k1 = tl.where(t1 < steps, k, 0)
        xr_next, lw_next, lb_next = _load_x(Xin, rows, s_x, offs_k1, k1, mm, has_ln, LnW, LnB)
        xm = mm[:, None] & km[None, :]
        xv = xr.to(tl.float32)
        if has_ln:
            xv = (xv - mean[:, None]) * rstd[:, None] * lw[None, :] + lb[None, :]
            xv = tl.where(xm, xv, 0.0)
        xr = xr_next
        lw = lw_next
        lb = lb_next
        if BLOCK_M == 1:    # one row: float32 products in registers, reduced over K once per item
            acc2 += tl.sum(xv, axis=0)[:, None] * wv.to(tl.float32)
        else:               # a few rows: tensor cores (the normalised rows rounded to the weights' dtype)
            acc = tl.dot(xv.to(wv.dtype), wv, acc, input_precision="ieee")
        wv = w_next
        if last:
            if BLOCK_M == 1:
                acc = tl.sum(acc2, axis=0)[None, :]
                acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
            _gemv_finish(acc, tile, kblk, t, split, kind, s, M, n, k, rows, mm, bias, X, QKV, Hb, Logits, s_log,
                         KC, VC, Slots, C, Work, Tick, E, F, Dbg, debug_spin, pid, P, tile0, b0, r0,
                         BLOCK_M, BLOCK_N, BLOCK_K, DEBUG)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _gemv_finish(acc, tile, kblk, t, split, kind, s, M, n, k, rows, mm, bias, X, QKV, Hb, Logits, s_log,
                 KC, VC, Slots, C, Work, Tick, E, F, Dbg, debug_spin, pid, P, tile0, b0, r0,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEBUG: tl.constexpr):
    """A segment's partial product (its last K block is kblk, reached at step t): alone (split 1, or a
    stream-K range covering the whole tile), or stored and, by the tile's last arrival, summed over the
    tile's segments in a fixed order (K order: the sum does not depend on arrival order); then the epilogue.
    ``b0``, ``r0``: the bias and (one row) residual of the program's first tile ``tile0``, loaded at the
    stage's start."""
    offs_b = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    done = kblk >= 0
    if split == 0:
        # stream-K: program p owns units [lo(p), lo(p+1)), lo(p) = p·U // Pe. Tile `tile` (units [u0, u1)) has
        # the segments of programs owner(u0)..owner(u1 - 1), owner(u) = ((u + 1)·Pe - 1) // U (the largest p
        # with lo(p) <= u; no program in between is empty since Pe <= U). A program's partials go to one of
        # two slots: 0 for the segment its range begins with, 1 for the one it ends with (only the first
        # program of a tile can have begun before it; every later one begins in it).
        kbt = tl.cdiv(k, BLOCK_K)
        U = tl.cdiv(n, BLOCK_N) * kbt
        Pe = tl.minimum(P, U)
        lo = pid * U // Pe
        hi = (pid + 1) * U // Pe
        u0 = tile * kbt
        u1 = u0 + kbt
        seg_lo = tl.maximum(lo, u0)
        if (seg_lo != u0) | (hi < u1):
            live = (offs_b // BLOCK_N) < M
            slot = tl.where(seg_lo == lo, 0, 1)
            tl.store(Work + (pid * 2 + slot).to(tl.int64) * BLOCK_M * BLOCK_N + offs_b, acc, mask=live)
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            p0 = ((u0 + 1) * Pe - 1) // U
            p1 = (u1 * Pe - 1) // U
            ticket = tl.atomic_add(Tick + tile, 1, sem="acq_rel", scope="gpu")
            done = ticket == p1 - p0
            if done:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for i in range(p0, p1 + 1):
                    sl = tl.where((i == p0) & (i * U // Pe < u0), 1, 0)
                    acc += tl.load(Work + (i * 2 + sl).to(tl.int64) * BLOCK_M * BLOCK_N + offs_b, mask=live,
                                   other=0.0, cache_modifier=".cg")
                tl.store(Tick + tile, 0)
    elif split > 1:
        ks = kblk // tl.cdiv(tl.cdiv(k, BLOCK_K), split)
        base = Work + tile.to(tl.int64) * split * BLOCK_M * BLOCK_N
        live = (offs_b // BLOCK_N) < M       # only the real rows' partials travel through L2
        tl.store(base + ks * BLOCK_M * BLOCK_N + offs_b, acc, mask=live)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(Tick + tile, 1, sem="acq_rel", scope="gpu")
        done = ticket == split - 1
        if done:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for i in range(0, split):  # fixed order: the sum does not depend on arrival order
                acc += tl.load(base + i * BLOCK_M * BLOCK_N + offs_b, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(Tick + tile, 0)
    if done:
        if DEBUG == 2:
            _debug_delay(Dbg, pid, debug_spin)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = cols < n
        mask = mm[:, None] & nm[None, :]
        y = acc
        first = tile == tile0
        if kind != 5:
            if first:
                y += b0[None, :]
            else:
                y += tl.load(bias + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
        if kind == 3:       # tanh GELU as x·sigmoid(2z): no tanh, no overflow
            z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
            y = y / (1.0 + tl.exp(-2.0 * z))
        if (kind == 2) | (kind == 4):
            if first & (BLOCK_M == 1):
                y += r0
            else:
                y += tl.load(X + rows[:, None] * E + cols[None, :], mask=mask, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
        if kind == 0:
            out = y.to(QKV.dtype.element_ty)
            tl.store(QKV + rows[:, None] * n + cols[None, :], out, mask=mask)
            slot = tl.load(Slots + rows, mask=mm, other=-1).to(tl.int64)
            live = mask & (slot >= 0)[:, None]
            at = slot[:, None] * C + cols[None, :]
            is_v = cols >= 2 * C
            tl.store(KC + at - C, out, mask=live & ((cols >= C) & ~is_v)[None, :])
            tl.store(VC + at - 2 * C, out, mask=live & is_v[None, :])
        elif kind == 3:
            tl.store(Hb + rows[:, None] * F + cols[None, :], y.to(Hb.dtype.element_ty), mask=mask)
        elif kind == 5:
            tl.store(Logits + rows[:, None] * s_log + cols[None, :], y.to(Logits.dtype.element_ty), mask=mask)
        else:
            tl.store(X + rows[:, None] * E + cols[None, :], y.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _debug_delay(Dbg, pid, debug_spin):
    """Odd programs wait (a chain of atomic reads of a scratch counter, ~1 us each) before storing: with
    the barrier waits removed, readers then run ahead of these writers."""
    if pid % 2 == 1:
        acc = tl.zeros((), dtype=tl.int32)
        for i in range(0, debug_spin):
            acc += tl.atomic_add(Dbg, 0, sem="relaxed", scope="gpu")
        if acc == -1:   # never true: keeps the chain from being optimised away
            tl.store(Dbg, 1)


# ---------------------------------------------------------------------------------------------------
# The attention stage
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _attn_stage(pid, P, M, H, D, C, n_split, kv_min_chunk, qk_scale, QKV, A, KC, VC, BT, s_bt, Ctx, block_size,
                AWork, ATick, Dbg, debug_spin,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, DEBUG: tl.constexpr):
    """a[m, head h] = softmax(q·K^T·scale)·V over row m's ctx[m] cached tokens (the new one included:
    written by the qkv stage). Work item (m, h, chunk): chunk c of a row's n_eff equal token ranges
    (multiples of BLOCK_T), n_eff = min(n_split, ceil(ctx[m] / kv_min_chunk)) read at run time: a short
    context is one chunk, stored directly, with no partials and no ticket (that merge is a chain of L2
    round trips: a partial's store, the ticket, the last arrival's loads); with n_eff > 1 the chunks'
    (max, sum, acc) are merged by the last arrival, in order. Items with c >= n_eff do nothing."""
    offs_d = tl.arange(0, BLOCK_D)
    dm = offs_d < D
    offs_t = tl.arange(0, BLOCK_T)
    items = M * H * n_split
    for item in range(pid, items, P):
        m = item // (H * n_split)
        h = (item // n_split) % H
        c = item % n_split
        ctx = tl.load(Ctx + m)
        n_eff = tl.maximum(tl.minimum(n_split, tl.cdiv(ctx, kv_min_chunk)), 1)
        if c < n_eff:                   # (a short context needs fewer chunks: the other items do nothing)
            chunk = tl.cdiv(tl.cdiv(ctx, n_eff), BLOCK_T) * BLOCK_T
            t_lo = c * chunk
            t_hi = tl.minimum(ctx, t_lo + chunk)
            q = tl.load(QKV + m * 3 * C + h * D + offs_d, mask=dm, other=0.0, cache_modifier=".cg").to(tl.float32)
            q = q * qk_scale
            m_i = tl.full((), float("-inf"), tl.float32)
            l_i = tl.zeros((), dtype=tl.float32)
            acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for t0 in range(t_lo, t_hi, BLOCK_T):
                tt = t0 + offs_t
                tm = tt < t_hi
                blk = tl.load(BT + m * s_bt + tt // block_size, mask=tm, other=0).to(tl.int64)
                at = (blk * block_size + tt % block_size) * C + h * D
                kvm = tm[:, None] & dm[None, :]
                kk = tl.load(KC + at[:, None] + offs_d[None, :], mask=kvm, other=0.0, cache_modifier=".cg")
                vv = tl.load(VC + at[:, None] + offs_d[None, :], mask=kvm, other=0.0, cache_modifier=".cg")
                sc = tl.sum(q[None, :] * kk.to(tl.float32), axis=1)
                sc = tl.where(tm, sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=0))
                p = tl.exp2(sc - m_new)
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p[:, None] * vv.to(tl.float32), axis=0)
                m_i = m_new
            row = (m * H + h).to(tl.int64)
            if n_eff == 1:
                if DEBUG == 2:
                    _debug_delay(Dbg, pid, debug_spin)
                tl.store(A + m * C + h * D + offs_d, (acc / l_i).to(A.dtype.element_ty), mask=dm)
            else:
                part = AWork + (row * n_split + c) * (BLOCK_D + 2)
                tl.store(part + offs_d, acc)
                tl.store(part + BLOCK_D, m_i)
                tl.store(part + BLOCK_D + 1, l_i)
                tl.debug_barrier()
                ticket = tl.atomic_add(ATick + row, 1, sem="acq_rel", scope="gpu")
                if ticket == n_eff - 1:
                    base = AWork + row * n_split * (BLOCK_D + 2)
                    mx = tl.full((), float("-inf"), tl.float32)
                    for i in range(0, n_eff):
                        mx = tl.maximum(mx, tl.load(base + i * (BLOCK_D + 2) + BLOCK_D, cache_modifier=".cg"))
                    tot = tl.zeros((), dtype=tl.float32)
                    o = tl.zeros((BLOCK_D,), dtype=tl.float32)
                    for i in range(0, n_eff):   # an empty chunk has max -inf and weight exp2(-inf) = 0
                        pi = base + i * (BLOCK_D + 2)
                        wgt = tl.exp2(tl.load(pi + BLOCK_D, cache_modifier=".cg") - mx)
                        tot += wgt * tl.load(pi + BLOCK_D + 1, cache_modifier=".cg")
                        o += wgt * tl.load(pi + offs_d, cache_modifier=".cg")
                    tl.store(ATick + row, 0)
                    if DEBUG == 2:
                        _debug_delay(Dbg, pid, debug_spin)
                    tl.store(A + m * C + h * D + offs_d, (o / tot).to(A.dtype.element_ty), mask=dm)


# ---------------------------------------------------------------------------------------------------
# The grid barrier's wait
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _barrier_wait(bar, P, spins, Dbg, DEBUG: tl.constexpr):
    """Spin until all P programs have arrived at counter ``bar`` (acquire: their stores are then visible).
    Bounded over the whole launch: a grid that is not all resident (it must be) sets an error flag and
    runs on with wrong results instead of hanging the GPU (2^22 polls, a few seconds; a normal step polls
    a few hundred times). DEBUG >= 1: no wait (the wrong-dependency tests). The poll, an atomic add of 0 with
    acquire semantics, compiles to a plain ``ld.global.gpu.acquire`` (PTX, triton 3.6 and 3.9), issued by
    one thread: an inline-asm acquire load measured the same (docs/findings.md); the arrival is a
    ``red.global.gpu.release.add``."""
    if DEBUG == 0:
        while (tl.atomic_add(bar, 0, sem="acquire", scope="gpu") < P) & (spins < 4194304):
            spins += 1
        if spins >= 4194304:
            tl.atomic_max(Dbg + 1, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()
    return spins


# ---------------------------------------------------------------------------------------------------
# The persistent kernel
# ---------------------------------------------------------------------------------------------------
# Sizes that change between models or steps but say nothing about alignment stay runtime values: each
# specialisation (a value == 1 or divisible by 16) would be another compile of a large kernel.
@triton.jit(do_not_specialize=["s_log", "stage_lo", "stage_hi", "M", "L", "V", "H", "SPLIT_QKV", "SPLIT_O",
                               "SPLIT_FC", "SPLIT_PROJ", "SPLIT_LM", "n_split", "kv_min_chunk",
                               "debug_spin"])
def _fused_decode_kernel(
        X, QKV, A, Hb, Logits, s_log,
        LN1W, LN1B, WQKV, BQKV, WO, BO, LN2W, LN2B, WFC, BFC, WPROJ, BPROJ, LNFW, LNFB, LMH, s_lk, s_ln,
        KC, VC, s_kv_layer, Slots, BT, s_bt, Ctx, block_size,
        Work, Tick, AWork, ATick, Bar, Dbg,
        stage_lo, stage_hi, M, L, E, F, V, H, D, eps, qk_scale,
        SPLIT_QKV, SPLIT_O, SPLIT_FC, SPLIT_PROJ, SPLIT_LM, n_split, kv_min_chunk, debug_spin,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LM_BLOCK_N: tl.constexpr,
        LM_BLOCK_K: tl.constexpr, LN_BLOCK: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, LM_KMAJOR: tl.constexpr, SYNC: tl.constexpr,
        DEBUG: tl.constexpr):
    """logits = LM head of GPT-2's layers over x (M, E) (see the module docstring): stages
    [stage_lo, stage_hi) of 5·L + 1, separated by grid barriers when SYNC."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    n_stages = 5 * L + 1
    layers_hi = tl.minimum(stage_hi, 5 * L)     # the layer stages [stage_lo, layers_hi); the LM head after
    g = stage_lo + pid * 0
    if g < 5 * L:
        if g % 5 == 1:
            g = stage_lo + 1 + pid * 0
    if g >= 5 * L:      # no layer stage runs (the LM head alone): a valid block, never used
        g = 5 * L - 1 + pid * 0
    w, b, s_wk, s_wn, n, k, split = _gemv_params(g, L, E, F, WQKV, WO, WFC, WPROJ, BQKV, BO, BFC, BPROJ,
                                                 SPLIT_QKV, SPLIT_O, SPLIT_FC, SPLIT_PROJ)
    wpre = _first_block(pid, P, w, s_wk, s_wn, n, k, split, BLOCK_N, BLOCK_K, False, LM_KMAJOR)
    spins = pid * 0
    for s in range(stage_lo, layers_hi):
        kind = s % 5
        layer = s // 5 + tl.zeros((), dtype=tl.int64)   # s is a plain int in the interpreter
        if kind == 1:
            _attn_stage(pid, P, M, H, D, E, n_split, kv_min_chunk, qk_scale, QKV, A, KC + layer * s_kv_layer,
                        VC + layer * s_kv_layer, BT, s_bt, Ctx, block_size, AWork, ATick, Dbg, debug_spin,
                        BLOCK_T, BLOCK_D, DEBUG)
        else:
            w, b, s_wk, s_wn, n, k, split = _gemv_params(s, L, E, F, WQKV, WO, WFC, WPROJ, BQKV, BO, BFC,
                                                         BPROJ, SPLIT_QKV, SPLIT_O, SPLIT_FC, SPLIT_PROJ)
            # the rows this stage reads, and the LayerNorm before it (kinds 0, 3)
            xin = X
            s_x = E
            has_ln = (kind == 0) | (kind == 3)
            lnw = LN1W + layer * E
            lnb = LN1B + layer * E
            if kind == 3:
                lnw = LN2W + layer * E
                lnb = LN2B + layer * E
            elif kind == 2:
                xin = A
            elif kind == 4:
                xin = Hb
                s_x = F
            _gemv_stage(pid, P, wpre, s, kind, M, E, F, eps, xin, s_x, has_ln, lnw, lnb,
                        w, b, s_wk, s_wn, n, k, split,
                        X, QKV, Hb, Logits, s_log, KC + layer * s_kv_layer, VC + layer * s_kv_layer, Slots, E,
                        Work, Tick, Dbg, debug_spin, BLOCK_M, BLOCK_N, BLOCK_K, LN_BLOCK, False, LM_KMAJOR, DEBUG)
        if s + 1 < stage_hi:
            if SYNC:
                tl.debug_barrier()      # all of this program's stores are issued before its arrival
                tl.atomic_add(Bar + s, 1, sem="release", scope="gpu")
            if kind != 1:               # after attention, the o-proj block is already in registers
                g = _next_gemv_stage(s, L)
                if g < 5 * L:           # (the LM head's first block is loaded after the wait: another layout)
                    w, b, s_wk, s_wn, n, k, split = _gemv_params(g, L, E, F, WQKV, WO, WFC, WPROJ, BQKV, BO,
                                                                 BFC, BPROJ, SPLIT_QKV, SPLIT_O, SPLIT_FC,
                                                                 SPLIT_PROJ)
                    wpre = _first_block(pid, P, w, s_wk, s_wn, n, k, split, BLOCK_N, BLOCK_K, False, LM_KMAJOR)
            if SYNC:
                spins = _barrier_wait(Bar + s, P, spins, Dbg, DEBUG)
    if stage_hi > 5 * L:    # the LM head: logits = LN_f(x) @ lm_head, (E, V) with any strides
        s = 5 * L + pid * 0
        zero = pid * 0
        wlm = _first_block(pid, P, LMH, zero + s_lk, zero + s_ln, zero + V, zero + E, zero + SPLIT_LM,
                           LM_BLOCK_N, LM_BLOCK_K, True, LM_KMAJOR)
        _gemv_stage(pid, P, wlm, s, zero + 5, M, E, F, eps, X, E, True, LNFW, LNFB,
                    LMH, BO, zero + s_lk, zero + s_ln, zero + V, zero + E, zero + SPLIT_LM,
                    X, QKV, Hb, Logits, s_log, KC, VC, Slots, E,
                    Work, Tick, Dbg, debug_spin, BLOCK_M, LM_BLOCK_N, LM_BLOCK_K, LN_BLOCK, True, LM_KMAJOR, DEBUG)
    if SYNC:  # the last program out zeroes the counters for the next launch
        tl.debug_barrier()
        ticket = tl.atomic_add(Bar + n_stages, 1, sem="acq_rel", scope="gpu")
        if ticket == P - 1:
            for i in range(0, n_stages + 1, 256):
                offs = i + tl.arange(0, 256)
                tl.store(Bar + offs, tl.zeros((256,), dtype=tl.int32), mask=offs < n_stages + 1)


# ---------------------------------------------------------------------------------------------------
# Launch configuration: plain data
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """How a step is split. ``programs`` 0: one per SM. ``split_*`` >= 1: that many uniform K slices per
    column tile (1: none); 0: picked by shape (:func:`plan_splits`). ``stream_k`` (for the stages whose
    split is 0, the LM head included): 0 picks per stage whichever of stream-K and the best uniform split
    has the lighter busiest program; 1 never stream-K (uniform splits only); 2 always stream-K."""
    block_n: int = 32
    block_k: int = 128
    block_t: int = 32
    num_warps: int = 4
    programs: int = 0
    split_qkv: int = 0
    split_o: int = 0
    split_fc: int = 0
    split_proj: int = 0
    kv_split: int = 0
    # tokens: a row's context is cut into min(kv_split, ceil(ctx / this)) chunks. 1: always kv_split. One
    # chunk a head (no merge) is slower on short contexts: its steps of tokens in one program are a longer
    # chain than the split's merge (docs/findings.md)
    kv_min_chunk: int = 1
    lm_block_n: int = 0     # the LM head's weight blocks (its own call site, after the layers' loop: its
    lm_block_k: int = 0     # registers are not live beside theirs); 0: block_n / block_k
    stream_k: int = 0
    faster: int = 0         # measured faster than the per-op path here (what fused_decode="auto" follows)

    SPACE = {"block_n": [16, 32, 64, 128], "block_k": [32, 64, 128, 256, 512], "block_t": [16, 32, 64],
             "num_warps": [2, 4, 8], "programs": [0], "split_qkv": [0, 1, 2, 4], "split_o": [0, 1, 2, 4, 8],
             "split_fc": [0, 1, 2], "split_proj": [0, 1, 2, 4, 8], "kv_split": [0, 1, 2, 4, 8, 16],
             "kv_min_chunk": [1, 16, 32, 64, 128, 256, 512], "lm_block_n": [0, 16, 32, 64, 128],
             "lm_block_k": [0, 64, 128, 256, 512],
             "stream_k": [0, 1, 2], "faster": [0, 1]}

    @property
    def lm_bn(self) -> int:
        return self.lm_block_n or self.block_n

    @property
    def lm_bk(self) -> int:
        return self.lm_block_k or self.block_k

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        unknown = set(d) - set(cls.SPACE)
        if unknown:
            raise ValueError(f"config: unknown fused_decode parameter(s) {sorted(unknown)}")
        for key, v in d.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"config: {key} must be a non-negative int, got {v!r}")
            if (key.startswith("block_") or key.startswith("lm_block_")) and v & (v - 1):
                raise ValueError(f"config: {key} must be a power of two, got {v}")
        if d.get("kv_min_chunk", 1) < 1:
            raise ValueError(f"config: kv_min_chunk must be >= 1 (tokens), got {d['kv_min_chunk']}")
        if d.get("stream_k", 0) > 2:
            raise ValueError(f"config: stream_k must be 0 (auto), 1 (off) or 2 (on), got {d['stream_k']}")
        return cls(**d)


def auto_split(n: int, k: int, block_n: int, block_k: int, programs: int, want: int = 0) -> int:
    """K slices per column tile: ``want`` when set, else the split that minimises the busiest program's
    time, ceil(items / programs) * (ceil(K blocks / split) + 1.5 with a split), in weight-block loads; the
    1.5 is a split item's ticket (an L2 atomic round trip the program waits on) and partial store. A
    stage is as slow as its busiest program: on 132 programs GPT-2 small's proj (24 tiles x 24 blocks of
    128) takes split 5 (120 items of 5 blocks), its out-proj split 3, qkv and fc none."""
    kb = triton.cdiv(k, block_k)
    if want:
        return max(1, min(want, kb))
    tiles = triton.cdiv(n, block_n)

    return min(range(1, min(kb, 16) + 1), key=lambda sp: (split_cost(n, k, block_n, block_k, programs, sp), sp))


TICKET = 1.5    # a partial's store + ticket (an L2 atomic round trip the program waits on), in block loads


def split_cost(n: int, k: int, block_n: int, block_k: int, programs: int, split: int) -> float:
    """The busiest program's time in a GEMV stage, in weight-block loads: uniform ``split`` >= 1,
    ceil(items / P) x (blocks a slice + a ticket when split); stream-K (0), ceil(U / P) blocks + a ticket
    for each end of its range that falls inside a tile (none when the ranges are whole tiles)."""
    kb, tiles = triton.cdiv(k, block_k), triton.cdiv(n, block_n)
    if split:
        return triton.cdiv(tiles * split, programs) * (triton.cdiv(kb, split) + (TICKET if split > 1 else 0.0))
    units = tiles * kb
    pe = min(programs, units)
    per = triton.cdiv(units, pe)
    aligned = units % pe == 0 and per % kb == 0
    return per + (0 if aligned else (2 if per > 1 else 1)) * TICKET


def plan_splits(E: int, F: int, V: int, cfg: "Config", programs: int) -> tuple:
    """The five GEMV stages' splits (qkv, out-proj, fc, proj, LM head) as the kernel takes them: >= 1
    uniform K slices, 0 stream-K. The LM head takes 1 or stream-K (a uniform split's scratch would be
    vocab-sized)."""
    P = programs
    out = []
    for n, k, want in ((3 * E, E, cfg.split_qkv), (E, E, cfg.split_o), (F, E, cfg.split_fc),
                       (E, F, cfg.split_proj), (V, E, -1)):
        bn, bk = (cfg.lm_bn, cfg.lm_bk) if want < 0 else (cfg.block_n, cfg.block_k)
        if want > 0:
            out.append(auto_split(n, k, bn, bk, P, want))
            continue
        best = 1 if want < 0 else auto_split(n, k, bn, bk, P)
        if cfg.stream_k == 2 or (cfg.stream_k == 0 and split_cost(n, k, bn, bk, P, 0) < split_cost(n, k, bn, bk, P, best)):
            best = 0
        out.append(best)
    return tuple(out)


def work_floats(splits: tuple, E: int, F: int, V: int, cfg: "Config", programs: int, block_m_: int) -> int:
    """float32 scratch the split partials need: tiles x split tiles for a uniform split, two tiles a
    program for stream-K (tiles of the LM head's own width there)."""
    sizes = [1]
    for i, (n, s) in enumerate(zip((3 * E, E, F, E, V), splits)):
        bn = cfg.lm_bn if i == 4 else cfg.block_n
        if s > 1:
            sizes.append(triton.cdiv(n, bn) * s * bn)
        elif s == 0:
            sizes.append(2 * programs * bn)
    return max(sizes) * block_m_


def kv_split(M: int, H: int, programs: int, want: int = 0) -> int:
    """KV chunks per (row, head): enough for the attention stage's items to cover the programs."""
    if want:
        return want
    return max(1, min(16, programs // max(1, M * H)))


def block_m(M: int, dtype) -> int:
    """Rows of a GEMV tile: 1 (float32 FMA products, M = 1) or a tensor-core tile. 16-bit rows go in
    64-row tiles: wgmma on sm90; at 16 rows triton 3.6 takes the mma.sync path, whose TritonGPUPrefetch
    pass fails on this kernel's loop (compiled offline for sm90; docs/findings.md). float32 stays at 16
    (64 spills)."""
    if M == 1:
        return 1
    return 16 if dtype == torch.float32 else 64


def launch(args: dict, *, M: int, L: int, E: int, F: int, V: int, H: int, D: int, eps: float,
           cfg: Config, programs: int, splits: tuple, n_split: int, sync: bool, stage_lo: int = 0,
           stage_hi: int | None = None, debug: int = 0, debug_spin: int = 0) -> None:
    """One launch of the kernel over stages [stage_lo, stage_hi) (default: all). ``args``: the tensors
    and strides by name (the driver in ``tritune.model.engine.fused_decode`` builds them once)."""
    n_stages = 5 * L + 1
    hi = n_stages if stage_hi is None else stage_hi
    BLOCK_M = block_m(M, args["X"].dtype)
    a = args
    _fused_decode_kernel[(programs,)](
        a["X"], a["QKV"], a["A"], a["Hb"], a["Logits"], a["s_log"],
        a["LN1W"], a["LN1B"], a["WQKV"], a["BQKV"], a["WO"], a["BO"], a["LN2W"], a["LN2B"], a["WFC"], a["BFC"],
        a["WPROJ"], a["BPROJ"], a["LNFW"], a["LNFB"], a["LMH"], a["s_lk"], a["s_ln"],
        a["KC"], a["VC"], a["s_kv_layer"], a["Slots"], a["BT"], a["s_bt"], a["Ctx"], a["block_size"],
        a["Work"], a["Tick"], a["AWork"], a["ATick"], a["Bar"], a["Dbg"],
        stage_lo, hi, M, L, E, F, V, H, D, eps, LOG2E / D ** 0.5,
        *splits, n_split, cfg.kv_min_chunk, debug_spin,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, LM_BLOCK_N=cfg.lm_bn, LM_BLOCK_K=cfg.lm_bk,
        LN_BLOCK=triton.next_power_of_2(E),
        BLOCK_T=cfg.block_t, BLOCK_D=triton.next_power_of_2(D), LM_KMAJOR=a["s_lk"] == 1, SYNC=sync, DEBUG=debug,
        num_warps=cfg.num_warps, num_stages=1)
