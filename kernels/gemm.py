"""GEMM with a fused epilogue: C = act(norm(A) @ B + bias) + residual.

A (..., K) with its leading dims flattened into M, B (K, N); either may be a transposed or strided view
(both strides go to the kernel; nothing is copied). fp16/bf16 accumulate in fp32 on tensor cores; fp32
follows ``torch.get_float32_matmul_precision()`` as torch's matmul does: "highest" (torch's default)
IEEE fp32 products, "high"/"medium" tf32 tensor cores on the GPU (``input_precision="tf32"``, 10-bit
mantissa operands: the "tf32" tolerance; exact fp32 under the interpreter). The epilogue runs in fp32 on the accumulator and
the output is rounded once to the input dtype. activation "gelu_tanh" is evaluated as x·sigmoid(2z),
z = √(2/π)(x + 0.044715x³): the same function as x/2·(1 + tanh z) with no tanh and no overflow.

activation "swiglu" (a Llama-family MLP's gate/up projection): B is the concatenated [gate | up] weight
(K, 2F) as a checkpoint's two linears stack, bias (2F,) likewise, and C has F columns, silu(g)·u. Each
program loads two B tiles per K step, the gate's columns n and the up's columns F + n, into two fp32
accumulators, so a C tile's gate and up columns meet in the epilogue with no weight reordering (the
stored weight stays what every other consumer reads: the torch backend, tensor-parallel shards,
quantizers) and no cross-lane shuffle of the accumulator; silu(g) = g·sigmoid(g) in fp32, finite for
any g. The two B tiles are BLOCK_N wide each: a tile reads the bytes and runs the MMAs of a plain
GEMM tile 2·BLOCK_N wide (the space counts both for shared memory and registers).

Prologues (pointer operands, one tile a program): ``ln`` a LayerNorm of each row of A, ``rms`` an RMSNorm
(no mean subtracted), their row statistics over all of K (:mod:`tritune.kernels.rows`) computed before the
main loop and applied to each A tile as it is loaded.

Operands are read either through pointers (any strides, masked edges) or, with ``TMA=True`` on a GPU
that has it (sm90+), through host-built TMA tensor descriptors when the view allows one (16-byte
aligned base and strides, one unit stride); a view that does not allow one falls back to pointers.

Split-K (``SPLIT_K > 1``, for small M and large K): the K tiles are cut into SPLIT_K slices, one program
each; every program writes its fp32 partial tile to a workspace, then takes a ticket from a per-tile
counter. The program holding the last ticket sums the SPLIT_K partials in slice order (deterministic,
whatever the arrival order), applies the epilogue once, stores C and resets the counter to zero for the
next launch. One launch, no zero-fill, no second kernel. The counters are per device and reset by the
kernel itself, so two split-K GEMMs must not run concurrently on different streams.

The problem type, the cases and the peers are in :mod:`tritune.kernels.gemm_cases`, the config space and
its heuristic default in :mod:`tritune.kernels.gemm_space`; their public names are re-exported here.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.kernels.gemm_cases import (ACTIVATIONS, Problem, bad_inputs, flag_gems, gpt2, gpt2_fused,  # noqa: F401
                                        llama_swiglu, make_inputs, problem_of, problems, vendor)
from tritune.kernels.gemm_space import (SMEM_BUDGET, SMEM_PER_SM, SPACE, bucket, cost, ctas_per_sm,  # noqa: F401
                                        default_config, tma_capable)
from tritune.kernels.rows import check_rms
from tritune.kernels.rows import prologue as _prologue
from tritune.kernels.rows import row_rms as _row_rms
from tritune.kernels.rows import row_stats as _row_stats
from tritune.references import gemm as ref

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _epilogue_store(acc, rows, cols, mask_m, mask_n, C, Bias, R, s_cm, s_cn, s_bias, s_rm, s_rn,
                    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                    bias_v=None, res_v=None, PRE_EPI: tl.constexpr = 0,
                    KC=None, VC=None, Slots=None, C_KV=0, HAS_KV: tl.constexpr = False, acc_up=None, N=0):
    """acc (fp32) -> act(acc + bias) + residual -> C, rounded once. PRE_EPI >= 1: the bias was loaded
    before the main loop (``bias_v``); 2: the residual tile too (``res_v``). HAS_KV: columns [C_KV, 2 C_KV)
    and [2 C_KV, 3 C_KV) of each row also go to the (slots, C_KV) caches KC / VC at the row's slot (< 0:
    not written), the same rounded values as C. ACT 2 (SwiGLU): ``acc`` is the gate, ``acc_up`` the up
    accumulator, whose bias is at Bias[N + col]."""
    if HAS_BIAS:
        if PRE_EPI >= 1:
            acc += bias_v.to(tl.float32)[None, :]
        else:
            acc += tl.load(Bias + cols * s_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # gelu_tanh: x·sigmoid(2z); exp overflow to inf gives x/inf = -0, never NaN
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc / (1.0 + tl.exp(-2.0 * z))
    if ACT == 2:  # swiglu: silu(g)·u, silu(g) = g·sigmoid(g) (exp overflow: g/inf = -0, never NaN)
        if HAS_BIAS:
            acc_up += tl.load(Bias + (cols + N) * s_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        if PRE_EPI == 2:
            acc += res_v.to(tl.float32)
        else:
            acc += tl.load(R + rows[:, None] * s_rm + cols[None, :] * s_rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(C + rows[:, None] * s_cm + cols[None, :] * s_cn, acc.to(C.dtype.element_ty), mask=mask)
    if HAS_KV:
        out = acc.to(C.dtype.element_ty)
        slot = tl.load(Slots + rows, mask=mask_m, other=-1).to(tl.int64)
        live = mask & (slot >= 0)[:, None]
        at = slot[:, None] * C_KV + cols[None, :]
        is_v = cols >= 2 * C_KV
        tl.store(KC + at - C_KV, out, mask=live & ((cols >= C_KV) & ~is_v)[None, :])
        tl.store(VC + at - 2 * C_KV, out, mask=live & is_v[None, :])


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), grouped: GROUP_M row-tiles in a row share the B columns they read
    while those are in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile % num_pid_in_group) % group_size_m
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _b_tile(B, b_ptrs, k, n0, k_hi, offs_k, mask_n, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            B_MODE: tl.constexpr, B_N_CONTIG: tl.constexpr):
    """The BLOCK_K x BLOCK_N tile of B at (k, n0): through a descriptor (B_MODE 1, 2: of B's transpose) or
    the pointer tile ``b_ptrs`` (rows past k_hi, and past N along a unit-stride N, read as zero)."""
    if B_MODE == 1:
        b = B.load([k, n0])
    elif B_MODE == 2:
        b = B.load([n0, k]).T
    else:
        if EVEN_K and B_N_CONTIG:
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        elif EVEN_K:
            b = tl.load(b_ptrs)
        else:
            in_k = offs_k[:, None] < k_hi - k
            b = tl.load(b_ptrs, mask=in_k & mask_n[None, :] if B_N_CONTIG else in_k, other=0.0)
    return b


@triton.jit
def _gemm_tile(A, B, C, Bias, R, W, Locks, M, N, K, M1, pid_m, pid_n, pid_k, num_pid_n,
               s_a0, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, s_rm, s_rn,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr,
               A_3D: tl.constexpr, A_M_CONTIG: tl.constexpr, B_N_CONTIG: tl.constexpr, INT64: tl.constexpr,
               PRECISION: tl.constexpr, PRE_EPI: tl.constexpr,
               LnW=None, LnB=None, KC=None, VC=None, Slots=None, C_KV=0, eps=0.0,
               HAS_LN: tl.constexpr = False, HAS_LN_W: tl.constexpr = False, HAS_LN_B: tl.constexpr = False,
               HAS_KV: tl.constexpr = False, LN_BLOCK: tl.constexpr = 16, RMS: tl.constexpr = False):
    """One BLOCK_M x BLOCK_N tile of C over K slice pid_k of SPLIT_K. PRE_EPI (whole-K tiles only): the
    epilogue's bias (1), and its residual tile (2), are loaded before the main loop, so their latency
    hides under it instead of following it. HAS_LN (pointer operands only): each A tile is normalised
    as it is loaded, with its rows' statistics over all of K (every K slice computes them itself), and
    rounded to A's dtype before the dot, as a LayerNorm kernel's output would be; RMS: an RMSNorm
    (x·rstd·LnW, no mean, no LnB) instead. HAS_KV: the epilogue also writes the K/V columns to the
    caches. ACT 2 (SwiGLU): B has 2N columns; the up tile (columns N + n) goes into a second accumulator,
    and split-K's workspace holds its partials after the gate's."""
    # this program's K slice: whole BLOCK_K tiles, the last slice cut at K
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = pid_k * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + tiles_per_split * BLOCK_K)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Operand rows/columns past the edge: along a strided dim they wrap (m % M: in bounds, no mask in the
    # loop, the rows are dropped at the store); along a unit-stride dim wrapping would break vector
    # loads, so those are masked instead.
    if A_M_CONTIG:
        a_m = offs_m
    else:
        a_m = offs_m % M
    if B_N_CONTIG:
        b_n = offs_n
    else:
        b_n = offs_n % N
    if INT64:  # some tensor spans 2^31 elements or more: 64-bit offsets (zero + s also widens a
        # stride the JIT specialised to the constant 1)
        zero = pid_m.to(tl.int64) * 0
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        a_m = a_m.to(tl.int64)
        b_n = b_n.to(tl.int64)
        kk = (k_lo + offs_k).to(tl.int64)
        s_ak = zero + s_ak
        s_bk = zero + s_bk
        slab = (zero + M) * N
    else:
        rows = offs_m
        cols = offs_n
        kk = k_lo + offs_k
        slab = M * N

    if A_MODE == 0:
        if A_3D:
            a_rows = (a_m // M1) * s_a0 + (a_m % M1) * s_am
        else:
            a_rows = a_m * s_am
        a_ptrs = A + a_rows[:, None] + kk[None, :] * s_ak
    b_ptrs = B  # descriptor modes: unused
    bu_ptrs = B
    if B_MODE == 0:
        b_ptrs = B + kk[:, None] * s_bk + b_n[None, :] * s_bn
        if ACT == 2:  # the up half: columns N + n (b_n + N < 2N, in bounds whatever the wrap)
            bu_ptrs = B + kk[:, None] * s_bk + (b_n + N)[None, :] * s_bn

    if HAS_LN:  # A_MODE == 0: the rows' statistics read A through the same (wrapped) row offsets
        # gemv's statistics (K read in LN_BLOCK chunks in order: a row's depend on the row, K and LN_BLOCK
        # only); rows outside get rstd 0, finite whatever eps
        row_ok = mask_m if A_M_CONTIG else offs_m >= 0
        if RMS:
            rstd = _row_rms((A + a_rows)[:, None], row_ok, K, s_ak, eps, BLOCK_M, LN_BLOCK)
        else:
            shift, m1, rstd = _row_stats((A + a_rows)[:, None], row_ok, K, s_ak, eps, BLOCK_M, LN_BLOCK)
        rstd = tl.where(row_ok, rstd, 0.0)
    bias_v = None
    res_v = None
    if PRE_EPI >= 1 and HAS_BIAS:
        bias_v = tl.load(Bias + cols * s_bias, mask=mask_n, other=0.0)
    if PRE_EPI == 2 and HAS_RES:
        res_v = tl.load(R + rows[:, None] * s_rm + cols[None, :] * s_rn, mask=mask_m[:, None] & mask_n[None, :],
                        other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = None
    if ACT == 2:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if A_MODE == 1:
            a = A.load([pid_m * BLOCK_M, k])
        elif A_MODE == 2:
            a = A.load([k, pid_m * BLOCK_M]).T
        else:
            if EVEN_K and A_M_CONTIG:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            elif EVEN_K:
                a = tl.load(a_ptrs)
            else:
                in_k = offs_k[None, :] < k_hi - k
                a = tl.load(a_ptrs, mask=in_k & mask_m[:, None] if A_M_CONTIG else in_k, other=0.0)
            a_ptrs += BLOCK_K * s_ak
            if HAS_LN:
                if RMS:
                    af = a.to(tl.float32) * rstd[:, None]
                else:
                    af = ((a.to(tl.float32) - shift[:, None]) - m1[:, None]) * rstd[:, None]
                k_ln = k + offs_k
                if HAS_LN_W:
                    af = af * tl.load(LnW + k_ln, mask=k_ln < k_hi, other=0.0).to(tl.float32)[None, :]
                if HAS_LN_B:
                    af = af + tl.load(LnB + k_ln, mask=k_ln < k_hi, other=0.0).to(tl.float32)[None, :]
                if not EVEN_K:  # past K: zero, as the unnormalised tile's masked load gave
                    af = tl.where((k_ln < k_hi)[None, :], af, 0.0)
                a = af.to(a.dtype)
        b = _b_tile(B, b_ptrs, k, pid_n * BLOCK_N, k_hi, offs_k, mask_n, BLOCK_K, EVEN_K, B_MODE, B_N_CONTIG)
        if ACT == 2:
            b_up = _b_tile(B, bu_ptrs, k, N + pid_n * BLOCK_N, k_hi, offs_k, mask_n, BLOCK_K, EVEN_K, B_MODE,
                           B_N_CONTIG)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
            if B_MODE == 0:
                bu_ptrs += BLOCK_K * s_bk
        if B_MODE == 0:
            b_ptrs += BLOCK_K * s_bk
        acc = tl.dot(a, b, acc, input_precision=PRECISION)

    if SPLIT_K == 1:
        _epilogue_store(acc, rows, cols, mask_m, mask_n, C, Bias, R, s_cm, s_cn, s_bias, s_rm, s_rn,
                        HAS_BIAS, ACT, HAS_RES, bias_v, res_v, PRE_EPI, KC, VC, Slots, C_KV, HAS_KV, acc_up, N)
    else:
        mask = mask_m[:, None] & mask_n[None, :]
        w_tile = W + rows[:, None] * N + cols[None, :]
        tl.store(w_tile + pid_k * slab, acc, mask=mask)
        if ACT == 2:  # the up partials: SPLIT_K slabs after the gate's
            tl.store(w_tile + (SPLIT_K + pid_k) * slab, acc_up, mask=mask)
        # every thread's partial is written before the ticket is taken (the atomic releases them)
        tl.debug_barrier()
        tile = pid_m * num_pid_n + pid_n
        ticket = tl.atomic_add(Locks + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on arrival order
                acc += tl.load(w_tile + s * slab, mask=mask, other=0.0, cache_modifier=".cg")
            if ACT == 2:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):
                    acc_up += tl.load(w_tile + (SPLIT_K + s) * slab, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(Locks + tile, 0)
            _epilogue_store(acc, rows, cols, mask_m, mask_n, C, Bias, R, s_cm, s_cn, s_bias, s_rm, s_rn,
                            HAS_BIAS, ACT, HAS_RES, KC=KC, VC=VC, Slots=Slots, C_KV=C_KV, HAS_KV=HAS_KV,
                            acc_up=acc_up, N=N)


@triton.jit
def _gemm_kernel(A, B, C, Bias, R, W, Locks,
                 M, N, K, M1,
                 s_a0, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, s_rm, s_rn,
                 HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                 A_MODE: tl.constexpr, B_MODE: tl.constexpr, A_3D: tl.constexpr,
                 A_M_CONTIG: tl.constexpr, B_N_CONTIG: tl.constexpr, INT64: tl.constexpr,
                 PRECISION: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
                 WARP_SPEC: tl.constexpr, PRE_EPI: tl.constexpr, PDL: tl.constexpr):
    """C[m, n] = act(sum_k A[m, k] B[k, n] + bias[n]) + R[m, n].

    Grid (tiles, SPLIT_K): one tile and K slice per program; or, PERSISTENT, a fixed grid whose
    programs stride over the tiles (the pipeline runs on across tile boundaries when FLATTEN).
    A_MODE / B_MODE: 0 pointers, 1 a TMA descriptor of the operand as it is, 2 a TMA descriptor of its
    transpose (the operand is a column-major view). A_3D: A is (M / M1, M1, K) with rows that do not
    merge into one stride: row m sits at (m // M1)·s_a0 + (m % M1)·s_am.
    PDL (launched with programmatic dependent launch, inside a CUDA graph): the next launch may start at
    once, and this one waits for the launch before it to finish before anything else.
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN,
                             warp_specialize=WARP_SPEC):
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            _gemm_tile(A, B, C, Bias, R, W, Locks, M, N, K, M1, pid_m, pid_n, 0, num_pid_n,
                       s_a0, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, s_rm, s_rn,
                       HAS_BIAS, ACT, HAS_RES, BLOCK_M, BLOCK_N, BLOCK_K, 1, EVEN_K, A_MODE, B_MODE,
                       A_3D, A_M_CONTIG, B_N_CONTIG, INT64, PRECISION, PRE_EPI)
    else:
        pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        _gemm_tile(A, B, C, Bias, R, W, Locks, M, N, K, M1, pid_m, pid_n, tl.program_id(1), num_pid_n,
                   s_a0, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, s_rm, s_rn,
                   HAS_BIAS, ACT, HAS_RES, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, EVEN_K, A_MODE, B_MODE,
                   A_3D, A_M_CONTIG, B_N_CONTIG, INT64, PRECISION, PRE_EPI)


@triton.jit
def _gemm_fused_kernel(A, B, C, Bias, R, W, Locks, LnW, LnB, KC, VC, Slots,
                       M, N, K, M1, C_KV, eps,
                       s_a0, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, s_rm, s_rn,
                       HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RES: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, A_3D: tl.constexpr,
                       A_M_CONTIG: tl.constexpr, B_N_CONTIG: tl.constexpr, INT64: tl.constexpr,
                       PRECISION: tl.constexpr, PRE_EPI: tl.constexpr,
                       HAS_LN: tl.constexpr, HAS_LN_W: tl.constexpr, HAS_LN_B: tl.constexpr,
                       HAS_KV: tl.constexpr, LN_BLOCK: tl.constexpr, PDL: tl.constexpr, RMS: tl.constexpr = False):
    """C[m, n] = act(sum_k LN(A)[m, k] B[k, n] + bias[n]) + R[m, n], LN(A) = (A - mean) · rstd · LnW + LnB
    over each row of A (RMS: A · rstd · LnW, RMSNorm); with HAS_KV the K/V columns of C also go to the
    caches at Slots[m].

    ``_gemm_kernel``'s tile with the fusions the decode step takes (a LayerNorm before the qkv, MLP-in and
    LM-head products; the qkv output's KV-cache write), on its own entry so the plain kernel compiles as
    it did: pointer operands, one tile and K slice per program (grid (tiles, SPLIT_K)). PDL as there."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    _gemm_tile(A, B, C, Bias, R, W, Locks, M, N, K, M1, pid_m, pid_n, tl.program_id(1), num_pid_n,
               s_a0, s_am, s_ak, s_bk, s_bn, s_cm, s_cn, s_bias, s_rm, s_rn,
               HAS_BIAS, ACT, HAS_RES, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, EVEN_K, 0, 0,
               A_3D, A_M_CONTIG, B_N_CONTIG, INT64, PRECISION, PRE_EPI,
               LnW, LnB, KC, VC, Slots, C_KV, eps, HAS_LN, HAS_LN_W, HAS_LN_B, HAS_KV, LN_BLOCK, RMS)


# ---------------------------------------------------------------------------------------------------
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_LIMIT = 2**31             # offsets at or past this take the 64-bit path (tests lower it)
# Persistent loop options (module switches, not tuned: measured once on the H100, see default_config):
# FLATTEN lets the software pipeline run across tile boundaries (the next tile's loads overlap this
# tile's epilogue); WARP_SPEC asks for automatic warp specialisation (loads and MMAs in separate warps).
FLATTEN = True
WARP_SPEC = False
# Epilogue operands loaded before the main loop (PRE_EPI) when every program takes one whole tile (no
# split-K; a persistent grid only when it has a program per tile): the bias always, the residual tile
# while it is at most RES_PREFETCH_PER_THREAD elements a thread (registers). H100, bf16, GPT-2 c_attn at
# M = 64: 5.23 -> 4.70 us in a CUDA graph (cuBLAS 5.04); the bias load no longer waits on the loop.
# Programs with several tiles or K slices compile exactly as they did without it (PRE_EPI = 0).
PREFETCH_EPILOGUE = True
RES_PREFETCH_PER_THREAD = 32


@functools.lru_cache(maxsize=None)
def _device_type() -> str:
    return K.kernel_device()


# What a new M of a known bucket takes from earlier plans instead of working it out again: the config and its
# cache key (an explicit config: validated once a bucket), and the launch variants (_variants, cached)
_CONFIGS = K.BucketConfigs()


_num_sms = K.num_sms  # a module name: tests narrow the persistent grid through it


_locks = K.Counters(minimum=1024)  # split-K tile counters, per device


def _tma_layout(rows: int, cols: int, s_r: int, s_c: int, e: int, block_rows: int, block_cols: int):
    """(mode, shape, strides, block) of a TMA descriptor of the 2-D view (rows x cols, strides s_r, s_c):
    mode 1 the view as it is, 2 its transpose (a column-major view); None when no descriptor fits (the
    pointer path). The base pointer's 16-byte alignment is checked per launch."""
    if rows == 0 or cols == 0:
        return None
    if s_c == 1 and (s_r * e) % 16 == 0 and s_r > 0:
        return 1, [rows, cols], [s_r, 1], [block_rows, block_cols]
    if s_r == 1 and (s_c * e) % 16 == 0 and s_c > 0:
        return 2, [cols, rows], [s_c, 1], [block_cols, block_rows]
    return None


class _Plan:
    """Everything a launch needs that depends only on the arguments' shapes, strides, dtypes and
    devices, the activation and the config: worked out (and the arguments validated) once per such
    combination; a launch with the same combination does the per-call work only (the output
    allocation, TMA descriptors, the launch itself)."""
    __slots__ = ("out_shape", "empty", "m", "n", "k", "a_copy", "r_copy", "grid", "ints", "work_numel",
                 "locks", "kws", "consts", "kernels", "a_tma", "b_tma", "cfg", "cfg_key", "extents", "fused",
                 "kws_pdl", "consts_pdl")


_PLANS = K.PlanCache()

# Direct launch (kernels.launch_direct): after a plan's first launch through triton, the compiled kernel
# is kept per (TMA modes, pointer alignments, device) and later launches call it directly.
DIRECT_LAUNCH = K.DIRECT_LAUNCH
_CONSTEXPRS = K.constexpr_params(_gemm_kernel)  # what a direct launch passes after the runtime arguments
_FUSED_CONSTEXPRS = K.constexpr_params(_gemm_fused_kernel)


_workspace = K.Workspace()
_meta = K.tensor_meta


def gemm(a, b, bias=None, *, activation=None, residual=None, ln=None, rms=None, kv=None, out=None,
         config: dict | None = None):
    """C = act(norm(a) @ b + bias) + residual. a (..., K), b (K, N), bias (N,), residual (..., N) or (M, N).

    activation: None, "gelu_tanh" or "swiglu": b the [gate | up] weight (K, 2F), bias (2F,), and C (and
    the residual) F columns, silu(a @ b_gate + bias_gate) · (a @ b_up + bias_up).
    ln: None or (weight (K,) or None, bias (K,) or None, eps): a LayerNorm of each row of a over K first
    (float32 statistics; the normalised rows rounded to a's dtype before the product). rms: None or
    (weight (K,) or None, eps): an RMSNorm instead (a · rsqrt(mean(a²) + eps) · weight; not with ln). kv: None or
    (k_cache, v_cache, slot_mapping): with N = 3·C, columns C..2C and 2C..3C of row m also go to k_cache /
    v_cache (num_blocks, block_size, heads, head_dim; heads·head_dim = C, contiguous) at flat slot
    slot_mapping[m] (< 0: skipped). The same arguments as ``gemv``'s.
    Returns C of shape a.shape[:-1] + (N,) (N / 2 with SwiGLU) in a's dtype (written into ``out`` when
    given). ``out`` may be ``residual`` itself (the residual stream updated in place); any other overlap
    with an input is refused.
    """
    ln_w, ln_b, eps, is_rms = _prologue(ln, rms)
    if kv is not None and (not isinstance(kv, (tuple, list)) or len(kv) != 3):
        raise TypeError("kv: expected (k_cache, v_cache, slot_mapping)")
    kc, vc, slots = kv if kv is not None else (None, None, None)
    # Hot path: one dict lookup on everything the plan depends on (validation included: a hit means the
    # same shapes, strides, dtypes and devices passed the checks before). Anything odd (not tensors,
    # unhashable values) takes the slow path, which raises the error that names the argument.
    try:
        key = (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device, _meta(bias),
               _meta(residual), _meta(out), activation, None if config is None else tuple(config.items()),
               INT32_LIMIT, FLATTEN, WARP_SPEC, PREFETCH_EPILOGUE, RES_PREFETCH_PER_THREAD, _num_sms,
               ln is not None, is_rms, _meta(ln_w), _meta(ln_b), eps, _meta(kc), _meta(vc), _meta(slots),
               K.precision_key(a.dtype))
    except (AttributeError, TypeError, ValueError):
        key = None
    plan = _PLANS.get_or_make(key, lambda: _make_plan(a, b, bias, activation, residual, out, config, ln, kv, rms))

    if out is None:
        out = torch.empty(plan.out_shape, dtype=a.dtype, device=a.device)
    else:  # out=residual (the residual stream updated in place) is the one overlap allowed
        K.check_no_alias(out, (("a", a), ("b", b), ("bias", bias), ("residual", residual), ("ln weight", ln_w),
                               ("ln bias", ln_b), ("k_cache", kc), ("v_cache", vc), ("slot_mapping", slots)),
                         "residual", plan.extents)
    if plan.empty:
        return out
    if plan.a_copy:  # > 3 dims that do not merge into rows: one copy
        a = a.reshape(plan.m, plan.k)
    r_arg = out if residual is None else (residual.reshape(plan.m, plan.n) if plan.r_copy else residual)
    if plan.work_numel:
        work, locks = _workspace(a.device, plan.work_numel), plan.locks
    else:  # no split-K: the workspace and counters are never touched
        work = locks = out
    if plan.fused:  # the norm prologues / KV-cache write: pointer operands, one tile a program
        args = (a, b, out, out if bias is None else bias, r_arg, work, locks, out if ln_w is None else ln_w,
                out if ln_b is None else ln_b, out if kc is None else kc, out if vc is None else vc,
                out if slots is None else slots, *plan.ints[:4], plan.ints[4], float(eps), *plan.ints[5:])
        pdl = plan.kws_pdl is not None and K.pdl_now("gemm")
        K.launch_cached(_gemm_fused_kernel, plan.kernels, plan.grid, args, plan.kws_pdl if pdl else plan.kws,
                        plan.consts_pdl if pdl else plan.consts, pdl, args[:12])
        return out
    a_mode = b_mode = 0
    a_arg, b_arg = a, b
    if plan.a_tma is not None and a.data_ptr() % 16 == 0:
        a_mode, shape, strides, block = plan.a_tma
        a_arg = TensorDescriptor(a, shape, strides, block)
    if plan.b_tma is not None and b.data_ptr() % 16 == 0:
        b_mode, shape, strides, block = plan.b_tma
        b_arg = TensorDescriptor(b, shape, strides, block)
    # every tensor goes in as it is (only its data pointer is used: the strides are in plan.ints)
    args = (a_arg, b_arg, out, out if bias is None else bias, r_arg, work, locks, *plan.ints)
    # descriptors (TMA modes) carry no pointer alignment: only plain operands count
    ptrs = args[2:7] + ((a,) if not a_mode else ()) + ((b,) if not b_mode else ())
    pdl = plan.kws_pdl is not None and K.pdl_now("gemm")
    kws, consts = (plan.kws_pdl, plan.consts_pdl) if pdl else (plan.kws, plan.consts)
    K.launch_cached(_gemm_kernel, plan.kernels, plan.grid, args, kws[a_mode][b_mode], consts[a_mode][b_mode],
                    (a_mode, b_mode, pdl), ptrs)
    return out


def launch_shape(cfg: dict, m: int, n: int, dtype, sms: int, b_tiles: int = 1) -> tuple[tuple[int, int], int]:
    """(grid, PRE_EPI) of a launch of ``cfg`` on an (m, n) output with ``sms`` SMs (``b_tiles``: 2 with
    SwiGLU, whose programs hold two B tiles and accumulators)."""
    tiles = K.cdiv(m, cfg["BLOCK_M"]) * K.cdiv(n, cfg["BLOCK_N"])
    split = cfg["SPLIT_K"]
    grid = (min(tiles, sms * ctas_per_sm(cfg, dtype, b_tiles)), 1) if cfg["PERSISTENT"] else (tiles, split)
    pre_epi = 0
    if PREFETCH_EPILOGUE and split == 1 and tiles <= grid[0]:  # one tile a program, all of K
        pre_epi = 2 if cfg["BLOCK_M"] * cfg["BLOCK_N"] <= RES_PREFETCH_PER_THREAD * 32 * cfg["num_warps"] else 1
    return grid, pre_epi


def _check_fusions(ln, kv, m: int, n: int, kdim: int, a) -> int:
    """Validate ``ln`` and ``kv`` (see :func:`gemm`); returns C (the caches' heads·head_dim; 0 without kv)."""
    c_kv = K.check_fusions(ln, kv, m, n, kdim, a, "a", "b")
    if kv is not None and kv[0].numel() >= INT32_LIMIT:
        raise ValueError(f"k_cache: {kv[0].numel()} elements; the cache write takes fewer than 2^31")
    return c_kv


def ln_block(kdim: int, cfg: dict) -> int:
    """Chunk along K of the LayerNorm statistics: at most 32 float32 values a thread per chunk. A function
    of K and the config only, so a row's statistics never depend on M."""
    per = 32 * 32 * cfg["num_warps"] // cfg["BLOCK_M"]
    return max(16, min(K.next_power_of_2(kdim), 1 << max(0, per.bit_length() - 1)))


def _check_epilogue(a, b, bias, activation, kv) -> int:
    """Validate the activation and the bias (errors name the argument); returns C's columns (N, or N / 2
    with SwiGLU)."""
    n = b.shape[1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if bias is not None:
        K.check_tensor("bias", bias, ndim=1)
        if bias.dtype != a.dtype:
            raise TypeError(f"bias: dtype {bias.dtype} differs from a's {a.dtype}")
        if bias.shape[0] != n:
            raise ValueError(f"bias: expected shape ({n},) to match b's N, got {tuple(bias.shape)}")
        if bias.device != a.device:
            raise ValueError(f"bias: on {bias.device}, but a is on {a.device}")
    if activation != "swiglu":
        return n
    if n % 2:
        raise ValueError(f"b: activation='swiglu' takes the [gate | up] weight, an even N; got N={n}")
    if kv is not None:
        raise ValueError("kv: the KV-cache write takes a qkv projection, not activation='swiglu'")
    return n // 2


def _check_args(a, b, bias, activation, residual, out, ln, kv, rms=None) -> tuple:
    """Validate the arguments (errors name the argument): (out_shape, m, n, K, C of the kv fusion); n is
    C's columns."""
    K.check_tensor("a", a, dtypes=DTYPES)
    if a.device.type != _device_type():
        K.check_device("a", a)
    K.check_tensor("b", b, ndim=2, dtypes=DTYPES)
    if a.dim() == 0:
        raise ValueError("a: expected at least 1 dim (..., K), got a scalar")
    if b.dtype != a.dtype:
        raise TypeError(f"b: dtype {b.dtype} differs from a's {a.dtype}")
    if b.device != a.device:
        raise ValueError(f"b: on {b.device}, but a is on {a.device}")
    kdim, n = b.shape
    if a.shape[-1] != kdim:
        raise ValueError(f"a, b: inner sizes differ: a is {tuple(a.shape)} (K={a.shape[-1]}), "
                         f"b is {tuple(b.shape)} (K={kdim})")
    n = _check_epilogue(a, b, bias, activation, kv)
    out_shape = (*a.shape[:-1], n)
    m = math.prod(a.shape[:-1])
    if residual is not None:
        K.check_tensor("residual", residual)
        if residual.dtype != a.dtype:
            raise TypeError(f"residual: dtype {residual.dtype} differs from a's {a.dtype}")
        if tuple(residual.shape) not in (out_shape, (m, n)):
            raise ValueError(f"residual: expected shape {out_shape} or {(m, n)}, got {tuple(residual.shape)}")
        if residual.device != a.device:
            raise ValueError(f"residual: on {residual.device}, but a is on {a.device}")
    c_kv = _check_fusions(ln, kv, m, n, kdim, a)
    check_rms(rms, kdim, a, "a")
    if out is not None:
        K.check_out(out, out_shape, a.dtype, a.device)
    return out_shape, m, n, kdim, c_kv


def _row_views(p: _Plan, a, residual, out, m: int, n: int, kdim: int) -> tuple:
    """A, the residual and the output as (m, ·) views where their rows merge into one stride (never a
    copy); A 3-D with two row strides otherwise; beyond 3 dims that do not merge, one copy per launch.
    Returns (a2, a_3d, (s_a0, s_am, s_ak), r2, c2, (s_cm, s_cn)) and sets the plan's copy flags."""
    if out is None:
        s_cm, s_cn = n, 1
    else:
        try:
            s_cm, s_cn = out.view(m, n).stride()
        except RuntimeError:
            raise ValueError(f"out: its strides {out.stride()} do not flatten to ({m}, {n})") from None
    c2 = out.view(m, n) if out is not None else None
    a_3d = p.a_copy = False
    try:
        a2 = a.view(m, kdim)
        s_a0, s_am, s_ak = 0, a2.stride(0), a2.stride(1)
    except RuntimeError:
        if a.dim() == 3:
            a2, a_3d = a, True
            s_a0, s_am, s_ak = a.stride()
        else:
            a2, p.a_copy = a.reshape(m, kdim), True
            s_a0, s_am, s_ak = 0, a2.stride(0), a2.stride(1)
    p.r_copy = False
    r2 = None
    if residual is not None:
        try:
            r2 = residual.view(m, n)
        except RuntimeError:
            r2, p.r_copy = residual.reshape(m, n), True
    return a2, a_3d, (s_a0, s_am, s_ak), r2, c2, (s_cm, s_cn)


def _make_plan(a, b, bias, activation, residual, out, config, ln=None, kv=None, rms=None) -> _Plan:
    """Validate the arguments and work out the launch (see _Plan). Raises the errors that name the
    argument."""
    out_shape, m, n, kdim, c_kv = _check_args(a, b, bias, activation, residual, out, ln, kv, rms)
    p = _Plan()
    p.out_shape, p.m, p.n, p.k = out_shape, m, n, kdim
    ln_w, ln_b, _, _ = _prologue(ln, rms)
    kc, vc, slots = kv if kv is not None else (None, None, None)
    p.extents = None  # check_no_alias's, for a given out (whether out is given is part of the plan's key)
    if out is not None:
        p.extents = tuple(K.extent(t) for t in (out, a, b, bias, residual, ln_w, ln_b, kc, vc, slots))
    p.fused = ln is not None or rms is not None or kv is not None
    p.cfg = p.cfg_key = None
    p.empty = m == 0 or n == 0
    if p.empty:
        return p
    a2, a_3d, (s_a0, s_am, s_ak), r2, c2, (s_cm, s_cn) = _row_views(p, a, residual, out, m, n, kdim)

    fields = dict(N=b.shape[1], K=kdim, trans_a=s_ak != 1, trans_b=b.stride(1) != 1, bias=bias is not None,
                  act=activation, residual=residual is not None, ln=ln is not None, kv=kv is not None,
                  rms=rms is not None)  # the Problem's, but M
    key = (K.next_power_of_2(m), tuple(fields.values()), a.dtype, K.precision_key(a.dtype),
           None if config is None else tuple(config.items()))
    cfg, cfg_key = _CONFIGS.pair(key, lambda: SPEC.config_and_key(Problem(m, **fields), a.dtype, config))
    if cfg_key is not None:  # from the store or the defaults: re-checked per launch against the config cache
        p.cfg, p.cfg_key = cfg, cfg_key
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]

    e = a.element_size()
    p.a_tma = p.b_tma = None
    if cfg["TMA"] and not a_3d and tma_capable(a.device.index or 0):
        p.a_tma = _tma_layout(m, kdim, s_am, s_ak, e, bm, bk)
        p.b_tma = _tma_layout(kdim, b.shape[1], b.stride(0), b.stride(1), e, bk, bn)

    tiles = K.cdiv(m, bm) * K.cdiv(n, bn)
    accs = 2 if activation == "swiglu" else 1  # SwiGLU's split-K partials: the gate's, then the up's
    p.work_numel = accs * split * m * n if split > 1 else 0
    # the plan holds its counters: a buffer grown later for another plan stays alive for this one (and
    # for any CUDA graph that captured it)
    p.locks = _locks(a.device, tiles) if split > 1 else None
    int64 = (accs * split * m * n >= INT32_LIMIT or K.span(a2) >= INT32_LIMIT or K.span(b) >= INT32_LIMIT
             or m * n >= INT32_LIMIT or (c2 is not None and K.span(c2) >= INT32_LIMIT)
             or (r2 is not None and K.span(r2) >= INT32_LIMIT))
    p.grid, pre_epi = launch_shape(cfg, m, n, a.dtype, _num_sms(), accs)
    p.ints = (m, n, kdim, a.shape[1] if a_3d else m,
              s_a0, s_am, s_ak, b.stride(0), b.stride(1), s_cm, s_cn,
              bias.stride(0) if bias is not None else 0,
              r2.stride(0) if r2 is not None else 0, r2.stride(1) if r2 is not None else 0)
    base = dict(HAS_BIAS=bias is not None, ACT=ACTIVATIONS.index(activation), HAS_RES=r2 is not None,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], SPLIT_K=split,
                EVEN_K=kdim % bk == 0, A_3D=a_3d, A_M_CONTIG=s_ak != 1, B_N_CONTIG=b.stride(0) != 1,
                INT64=int64, PRECISION=K.fp32_precision() if a.dtype == torch.float32 else "ieee",
                PERSISTENT=cfg["PERSISTENT"], FLATTEN=FLATTEN, WARP_SPEC=WARP_SPEC, PRE_EPI=pre_epi, PDL=False,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _launch_variants(p, base, a.device, ln, kv, c_kv, kdim, cfg, rms)
    return p


def _launch_variants(p: _Plan, base: dict, device, ln, kv, c_kv: int, kdim: int, cfg: dict, rms=None) -> None:
    """The plan's keyword sets: the fused kernel's, or the plain kernel's per (A, B) TMA mode; each also
    with programmatic dependent launch, taken while a CUDA graph is captured (K.pdl_now). Kept by what they
    are made of and shared by every plan made of the same (a new M mostly): read only (launches unpack them);
    a plan's compiled kernels stay its own."""
    ln_w, ln_b, _, is_rms = _prologue(ln, rms)
    pdl = K.pdl(device)
    p.kernels = {} if DIRECT_LAUNCH and device.type == "cuda" else None
    fused = None
    if p.fused:  # ints: m, n, K, M1, C (eps goes in per call), then the strides
        p.ints = (*p.ints[:4], c_kv, *p.ints[4:])
        fused = dict(HAS_LN=ln is not None or is_rms, HAS_LN_W=ln_w is not None, HAS_LN_B=ln_b is not None,
                     HAS_KV=kv is not None, LN_BLOCK=ln_block(kdim, cfg), RMS=is_rms)
    p.kws, p.consts, p.kws_pdl, p.consts_pdl = _variants(tuple(base.items()), pdl,
                                                         None if fused is None else tuple(fused.items()))


@functools.lru_cache(maxsize=4096)
def _variants(base_items: tuple, pdl: bool, fused_items: tuple | None) -> tuple:
    """(kws, consts, kws_pdl, consts_pdl) of a plan (see _launch_variants): the fused kernel's keywords
    (``fused_items``: its prologue and KV flags), else the plain kernel's per (A, B) mode, nested tuples."""
    base, fused = dict(base_items), None if fused_items is None else dict(fused_items)
    if fused is not None:
        kws = {k: v for k, v in base.items() if k not in ("PERSISTENT", "FLATTEN", "WARP_SPEC")}
        kws.update(fused)
        kws_pdl = dict(kws, PDL=True, launch_pdl=True) if pdl else None
        return (kws, tuple(kws[c] for c in _FUSED_CONSTEXPRS), kws_pdl,
                tuple(kws_pdl[c] for c in _FUSED_CONSTEXPRS) if pdl else None)
    kws = tuple(tuple(dict(base, A_MODE=am, B_MODE=bmode) for bmode in range(3)) for am in range(3))
    kws_pdl = tuple(tuple(dict(kw, PDL=True, launch_pdl=True) for kw in row) for row in kws) if pdl else None
    return (kws, tuple(tuple(tuple(kw[c] for c in _CONSTEXPRS) for kw in row) for row in kws), kws_pdl,
            tuple(tuple(tuple(kw[c] for c in _CONSTEXPRS) for kw in row) for row in kws_pdl) if pdl else None)


SPEC = K.register(K.KernelSpec(
    name="gemm",
    description="GEMM with fused bias / GELU / SwiGLU / residual epilogue, split-K, TMA; LayerNorm / RMSNorm "
                "prologue, KV-cache write",
    run=gemm,
    reference=ref.gemm,
    make_inputs=make_inputs,
    problems=problems,
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    problem_of=problem_of,
    standard_problems=[p for m in (1, 8, 64, 512, 8192) for p in gpt2(m)]
    + [Problem(4096, 4096, 4096), Problem(8192, 8192, 8192)] + [p for m in (1, 8) for p in gpt2_fused(m)]
    + [llama_swiglu(m) for m in (1, 16, 128, 1024, 4096)],
    small_problems=[Problem(64, 96, 80, bias=True, act="gelu_tanh"),
                    Problem(5, 33, 47, trans_b=True, residual=True),
                    Problem(7, 48, 40, bias=True, ln=True, kv=True),
                    Problem(9, 64, 40, bias=True, act="swiglu", residual=True, rms=True)],
    layouts=("contiguous", "sliced"),
    accumulation=K.fp32_accumulation,
    vendor=vendor,
    vendor_name="cuBLAS+torch",
    peers={"flag_gems": flag_gems},
    bad_inputs=functools.partial(bad_inputs, gemm),
))
