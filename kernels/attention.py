"""Fused attention forward for prefill: out = softmax(q kᵀ · scale + mask) v, flash-attention style.

One program owns BLOCK_M query rows of one head and streams the keys and values past them in BLOCK_N
blocks with an online softmax: running row max m_i, running denominator l_i and output accumulator acc,
all float32; no Tq × Tk matrix ever reaches memory. Scores are kept in base 2 (scale · log2 e folded in,
exp2 instead of exp). Both dots run in the input dtype with float32 accumulation; P is cast to the input
dtype before the P·V dot. fp32 dots follow ``torch.get_float32_matmul_precision()``: IEEE fp32 under
"highest" (torch's default), tf32 tensor cores under "high"/"medium".

The key loop is split in two: blocks every row of the tile sees in full run without a single mask,
then the few blocks on the causal diagonal or past the end of the keys run masked. Fully masked blocks
(above the diagonal) are never visited. Causal alignment puts the queries at the end of the keys:
query i sees key j when j <= i + Tk − Tq. A row that sees no key (Tq > Tk, or an empty key sequence)
outputs 0 and its lse is −inf.

The Hopper path (config keys, tuned like the rest): TMA=1 reads Q/K/V and writes O through per-(sequence,
head) tensor descriptors made on the device (TMA zero-fills the row tail and the head dim padded to a
power of two, and clips the store); TMA=2 through 4-D (B, H, T, D) descriptors made once on the host
(dense only: no per-program descriptor writes and fences, which cost the short sequences most).
WARP_SPEC picks the unmasked key loop's schedule: 1 asks Triton to warp-specialize it (TMA producer /
MMA consumer), 2 issues each key block's scores one block ahead, so q·kᵀ of block j+1 runs on the
tensor cores while block j's exponentials run. LAZY_RESCALE=1 rescales acc only when a row max grew
by more than 2^8. A layout TMA cannot read (D not unit-stride, rows or bases not 16-byte aligned) runs
the pointer path. WARP_SPEC 3, 4, 5 (sm90 only, fp16/bf16) run another kernel: FlashAttention-3's
structure written in Gluon (``kernels/_attention_gluon.py``: two consumer warpgroups, or three with
BLOCK_M=192 (FA3's CTA at D <= 64), and a one-warp TMA producer in warp-specialized partitions, schedule
WARP_SPEC − 3), dense or packed (varlen: descriptors made on the device per sequence and head);
WARP_SPEC 6, 7 run its persistent form (dense only: one CTA per SM looping over the work items, schedule 1
or 2), which hides each tile's prologue and epilogue behind the next tile's loads (short sequences); a call
it does not take (a scale <= 0, a layout or base TMA cannot read, a dense call without keys, the interpreter)
runs the plain kernel with the default config instead.

GQA/MQA: query head h reads kv head h // (Hq / Hkv). Packed variable-length batches (``attention_varlen``)
take the same kernel with per-sequence offsets read from cu_seqlens.

Host time: a call's checks, config and launch arguments are planned once per metadata signature; after a
plan's first launch through triton the compiled kernel is called directly (``kernels.launch_cached``) and
host descriptors are copied from the plan's first (``kernels.DescriptorMaker``). H200, B=8 H=12 T=1k:
33-34 us a call on the TMA=2 and Gluon paths, against 120-135 through triton's own launch
(``lab/probes/attention_host_cost.py``).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune import kernels as K
from tritune.kernels.runtime import strategies as S
from tritune.kernels import _attention_gluon as G
from tritune.references import attention as ref

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_kv(src, start_n, cols, offs_d, mask_d, seqlen_k, stride_n, b, kvh,
             MASKED: tl.constexpr, PAD_D: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """Key/value rows start_n..start_n+BLOCK_N. TMA=2: a host-built (B, H, T, D) descriptor, TMA=1: the
    program's own (T, D) descriptor (both zero-fill rows past the sequence and columns past D), else pointers."""
    if TMA == 2:
        x = src.load([b, kvh, start_n, 0]).reshape([BLOCK_N, BLOCK_D])
    elif TMA == 1:
        x = src.load([start_n, 0])
    else:
        ptrs = src + cols[:, None] * stride_n + offs_d[None, :]
        if MASKED:
            kv_mask = (cols < seqlen_k)[:, None]
            if PAD_D:
                kv_mask = kv_mask & mask_d[None, :]
            x = tl.load(ptrs, mask=kv_mask, other=0.0)
        elif PAD_D:
            x = tl.load(ptrs, mask=mask_d[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _softmax_step(s, acc, l_i, m_i, offs_m, cols, seqlen_k, delta, qk_scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, LAZY_RESCALE: tl.constexpr):
    """Fold raw scores s (one key block) into the running max and denominator: returns p (base-2
    exponentials against the new reference max) and acc, l_i rescaled to that max."""
    if MASKED:
        visible = (cols < seqlen_k)[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + delta)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet keeps m = −inf: subtract 0 instead (exp2(−inf − −inf) is NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    elif LAZY_RESCALE:
        # Rescale only when some row's max grew by more than 8 (a factor 2^8): otherwise keep the
        # stale max as the reference; p <= 2^8 stays exact enough in fp16/bf16 and l, acc cannot
        # overflow float32. Most blocks past the first few skip the multiply of the whole acc tile.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.math.exp2(s * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    return p, acc, l_i, m_i


@triton.jit
def _attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                lo, hi, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAD_D: tl.constexpr, IEEE: tl.constexpr,
                TMA: tl.constexpr, WARP_SPEC: tl.constexpr, LAZY_RESCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Fold keys lo..hi (lo a multiple of BLOCK_N) into (acc, l_i, m_i). k_src/v_src are tensor
    descriptors under TMA (rows past the sequence and columns past D arrive as zeros), else base pointers."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_kv(k_src, start_n, cols, offs_dk, mask_d, seqlen_k, stride_kn, b, kvh,
                     MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        v = _load_kv(v_src, start_n, cols, offs_dv, mask_d, seqlen_k, stride_vn, b, kvh,
                     MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        s = _dot(q, tl.trans(k), None, IEEE)
        p, acc, l_i, m_i = _softmax_step(s, acc, l_i, m_i, offs_m, cols, seqlen_k, delta, qk_scale,
                                         MASKED, CAUSAL, LAZY_RESCALE)
        acc = _dot(p.to(v.dtype), v, acc, IEEE)
    return acc, l_i, m_i


@triton.jit
def _attn_inner_ahead(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                      hi, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                      PAD_D: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The unmasked keys 0..hi (hi >= BLOCK_N, a multiple of it) with the scores one block ahead: block
    j+1's q·kᵀ is issued before block j's softmax, so the tensor cores work on it while the exp2s of
    block j run (FA3's intra-warpgroup overlap, written out instead of left to the scheduler). Costs a
    second score tile in registers."""
    k = _load_kv(k_src, 0, offs_n, offs_dk, mask_d, seqlen_k, stride_kn, b, kvh,
                 False, PAD_D, TMA, BLOCK_N, BLOCK_D)
    s = _dot(q, tl.trans(k), None, IEEE)
    for start_n in tl.range(0, hi - BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        nxt = start_n + BLOCK_N
        k = _load_kv(k_src, nxt, nxt + offs_n, offs_dk, mask_d, seqlen_k, stride_kn, b, kvh,
                     False, PAD_D, TMA, BLOCK_N, BLOCK_D)
        s_next = _dot(q, tl.trans(k), None, IEEE)
        p, acc, l_i, m_i = _softmax_step(s, acc, l_i, m_i, offs_m, start_n + offs_n, seqlen_k, delta, qk_scale,
                                         False, False, LAZY_RESCALE)
        v = _load_kv(v_src, start_n, start_n + offs_n, offs_dv, mask_d, seqlen_k, stride_vn, b, kvh,
                     False, PAD_D, TMA, BLOCK_N, BLOCK_D)
        acc = _dot(p.to(v.dtype), v, acc, IEEE)
        s = s_next
    last = hi - BLOCK_N
    p, acc, l_i, m_i = _softmax_step(s, acc, l_i, m_i, offs_m, last + offs_n, seqlen_k, delta, qk_scale,
                                     False, False, LAZY_RESCALE)
    v = _load_kv(v_src, last, last + offs_n, offs_dv, mask_d, seqlen_k, stride_vn, b, kvh,
                 False, PAD_D, TMA, BLOCK_N, BLOCK_D)
    acc = _dot(p.to(v.dtype), v, acc, IEEE)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, CuQ, CuK, DescQ, DescK, DescV, DescO,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_lm,
              Hq, group, seqlen_q_all, seqlen_k_all, num_m_blocks, num_bh, qk_scale,
              D: tl.constexpr, VARLEN: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, HEADS_INNER: tl.constexpr,
              D_CONTIG: tl.constexpr, IEEE: tl.constexpr, NEG_SCALE: tl.constexpr,
              TMA: tl.constexpr, WARP_SPEC: tl.constexpr, LAZY_RESCALE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    if HEADS_INNER:  # neighbouring programs share a kv head (L2 reuse of K/V), all heads' row block at once
        bh = pid % num_bh
        mb = pid // num_bh
    else:
        mb = pid % num_m_blocks
        bh = pid // num_m_blocks
    # the last row blocks first: under causal masking they are the longest, so the tail is short
    start_m = (num_m_blocks - 1 - mb) * BLOCK_M
    b = bh // Hq
    h = bh % Hq
    kvh = h // group
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh
    k_base = K + b64 * stride_kb + kvh64 * stride_kh
    v_base = V + b64 * stride_vb + kvh64 * stride_vh
    o_base = O + b64 * stride_ob + h64 * stride_oh
    l_base = LSE + b64 * stride_lb + h64 * stride_lh
    if VARLEN:
        # packed: the sequence's rows start at cu_seqlens[b] (the batch strides are 0). seqlen_*_all are
        # the packed totals here: a sequence is clamped to them, so bad cu_seqlens values (not validated
        # on the hot path) can give wrong rows but never an access outside q, k, v, out.
        q_start = tl.minimum(tl.maximum(tl.load(CuQ + b), 0), seqlen_q_all)
        seqlen_q = tl.minimum(tl.maximum(tl.load(CuQ + b + 1) - q_start, 0), seqlen_q_all - q_start)
        k_start = tl.minimum(tl.maximum(tl.load(CuK + b), 0), seqlen_k_all)
        seqlen_k = tl.minimum(tl.maximum(tl.load(CuK + b + 1) - k_start, 0), seqlen_k_all - k_start)
        q_base += q_start.to(tl.int64) * stride_qm
        k_base += k_start.to(tl.int64) * stride_kn
        v_base += k_start.to(tl.int64) * stride_vn
        o_base += q_start.to(tl.int64) * stride_om
        l_base += q_start.to(tl.int64) * stride_lm
    else:
        seqlen_q = seqlen_q_all
        seqlen_k = seqlen_k_all
    if start_m >= seqlen_q:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    PAD_D: tl.constexpr = BLOCK_D != D
    mask_d = offs_d < D
    mask_m = offs_m < seqlen_q
    if D_CONTIG:  # a literal unit stride lets loads vectorise
        offs_dq = offs_d
        offs_dk = offs_d
        offs_dv = offs_d
        offs_do = offs_d
    else:
        offs_dq = offs_d * stride_qd
        offs_dk = offs_d * stride_kd
        offs_dv = offs_d * stride_vd
        offs_do = offs_d * stride_od

    if TMA == 2:
        # Descriptors built once on the host over the whole (B, H, T, D) tensors (dense launches only):
        # no per-program descriptor writes and fences; the T and D bounds still zero-fill and clip.
        k_src = DescK
        v_src = DescV
        q = DescQ.load([b, h, start_m, 0]).reshape([BLOCK_M, BLOCK_D])
    elif TMA == 1:
        # One 2-D descriptor per (sequence, head): its bounds are the sequence's rows and D, so TMA
        # zero-fills the tail rows and the padded head dim (BLOCK_D > D) and clips the store.
        # The launcher checks the 16-byte alignment TMA needs (base and row strides).
        desc_q = tl.make_tensor_descriptor(q_base, shape=[seqlen_q, D], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_src = tl.make_tensor_descriptor(k_base, shape=[tl.maximum(seqlen_k, 1), D], strides=[stride_kn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_base, shape=[tl.maximum(seqlen_k, 1), D], strides=[stride_vn, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        q = desc_q.load([start_m, 0])
    else:
        k_src = k_base
        v_src = v_base
        q_mask = mask_m[:, None]
        if PAD_D:
            q_mask = q_mask & mask_d[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_dq[None, :], mask=q_mask, other=0.0)
    if NEG_SCALE:  # scale·(q·k) = |scale|·(−q)·k: the unmasked loop's max(s)·scale needs scale >= 0
        q = -q

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    delta = seqlen_k - seqlen_q  # query i sits at key position i + delta
    full_blocks = seqlen_k // BLOCK_N
    if CAUSAL:
        # key blocks wholly at or before the tile's first row's diagonal: no mask at all
        full_blocks = tl.minimum(full_blocks, tl.maximum(start_m + delta + 1, 0) // BLOCK_N)
        hi = tl.minimum(seqlen_k, tl.maximum(start_m + BLOCK_M + delta, 0))
    else:
        hi = seqlen_k
    lo = full_blocks * BLOCK_N
    # stage 1: the blocks every row sees in full, no mask; stage 2: the diagonal and the key tail, masked
    if WARP_SPEC == 2:
        if lo > 0:
            acc, l_i, m_i = _attn_inner_ahead(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv,
                                              mask_d, lo, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                              PAD_D, IEEE, TMA, LAZY_RESCALE, BLOCK_N, BLOCK_D)
    else:
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                                    0, lo, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                    False, CAUSAL, PAD_D, IEEE, TMA, WARP_SPEC == 1, LAZY_RESCALE, BLOCK_N, BLOCK_D)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                                lo, hi, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                True, CAUSAL, PAD_D, IEEE, TMA, False, False, BLOCK_N, BLOCK_D)

    # rows that saw no key: l = 0, acc = 0 -> output 0 (not 0/0)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if TMA == 2:
        DescO.store([b, h, start_m, 0], acc.to(O.dtype.element_ty).reshape([1, 1, BLOCK_M, BLOCK_D]))
    elif TMA == 1:
        desc_o = tl.make_tensor_descriptor(o_base, shape=[seqlen_q, D], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        desc_o.store([start_m, 0], acc.to(O.dtype.element_ty))
    else:
        o_mask = mask_m[:, None]
        if PAD_D:
            o_mask = o_mask & mask_d[None, :]
        tl.store(o_base + offs_m[:, None] * stride_om + offs_do[None, :], acc.to(O.dtype.element_ty), mask=o_mask)
    if STORE_LSE:
        # natural log: (m + log2 l) · ln 2; a row that saw nothing has m = −inf and log2 0 = −inf
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(l_base + offs_m * stride_lm, lse, mask=mask_m)


# ---------------------------------------------------------------------------------------------------
_CONSTEXPRS = K.constexpr_params(_attn_fwd)  # what a direct launch passes after the runtime arguments


@dataclass(frozen=True)
class Problem:
    B: int                 # batch
    Hq: int                # query heads
    Hkv: int               # key/value heads (Hq a multiple)
    Tq: int                # query length
    Tk: int                # key length
    D: int                 # head dim
    causal: bool = False


@dataclass(frozen=True)
class PackedProblem(Problem):
    """A packed launch as its launcher sees it without reading cu_seqlens: the batch, and the longest query
    and key sequences as Tq and Tk (a sequence may have more queries than keys where Tq <= Tk)."""


@dataclass(frozen=True)
class VarlenProblem:
    seqlens_q: tuple       # per-sequence query lengths (0 allowed)
    seqlens_k: tuple       # per-sequence key lengths
    Hq: int
    Hkv: int
    D: int
    causal: bool = False

    # What a launcher sees without reading cu_seqlens: the batch and the longest lengths.
    @property
    def B(self) -> int:
        return len(self.seqlens_q)

    @property
    def Tq(self) -> int:
        return max(self.seqlens_q, default=0)

    @property
    def Tk(self) -> int:
        return max(self.seqlens_k, default=0)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 224, 256)  # flash-attn's, plus 80


def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def _check_qkv(q, k, v, ndim: int):
    """Shared checks; returns (Hq, Hkv, D)."""
    K.check_tensor("q", q, ndim=ndim, dtypes=DTYPES)
    K.check_device("q", q)
    for name, t in (("k", k), ("v", v)):
        K.check_tensor(name, t, ndim=ndim)
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {_name(t.dtype)} does not match q's {_name(q.dtype)}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    D = q.shape[-1]
    if k.shape[-1] != D:
        raise ValueError(f"k: head dim {k.shape[-1]} does not match q's {D}")
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head dim {D} not supported (expected one of {HEAD_DIMS})")
    Hq, Hkv = q.shape[1], k.shape[1]  # (B, H, T, D) and (total, H, D) both keep heads at dim 1
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q: {Hq} heads is not a multiple of k/v's {Hkv} heads")
    return Hq, Hkv, D


def _check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number or None, got {scale!r}")


@dataclass
class _Plan:
    """What a launch needs beyond the tensors, computed once per metadata signature."""
    out_shape: tuple
    grid: tuple = ()                 # () when there is nothing to launch
    strides: tuple = ()              # q, k, v, out, lse (dense plans only)
    scalars: tuple = ()              # Hq, group, Tq, Tk, num_m_blocks, num_bh, qk_scale
    meta: dict = field(default_factory=dict)  # constexprs, num_warps, num_stages
    cfg: dict | None = None
    cfg_key: tuple | None = None     # the config-cache key a tuned/default config came from (K.PlanCache)
    meta_ptr: dict = field(default_factory=dict)  # meta on the pointer path (TMA refused by the addresses)
    gluon: dict | None = None        # the Gluon FA3 kernel's launch arguments (WARP_SPEC 3-7), else None
    fallback: "_Plan | None" = None  # with gluon: the plain kernel's plan (default config) for bases TMA refuses
    # host time: the constexprs of a direct launch (K.launch_cached) under meta / meta_ptr, the compiled
    # kernels it keeps (None: always through triton), TMA=2's descriptor makers (q, k, v, out), and the
    # Gluon launch's own cache (its descriptors' geometry and compiled kernels)
    consts: tuple = ()
    consts_ptr: tuple = ()
    kernels: dict | None = None
    descs: tuple = ()
    gluon_cache: dict | None = None


def _plan(spec, p, config, dtype, scale, d_contig: bool, varlen: bool, store_lse: bool,
          tma_ok: bool = False, host_ok: bool = False) -> _Plan:
    """Config, grid and launch parameters for problem ``p`` (B, Hq, Hkv, Tq, Tk, D, causal). ``tma_ok``:
    the strides allow TMA (see :func:`_tma_strides_ok`); a config asking for TMA on a layout that does
    not allow it runs the pointer path (``meta_ptr``), as does a launch whose base pointers are not
    16-byte aligned (checked per launch: the plan is keyed on strides, not addresses). ``host_ok``: the
    4-D (B, H, T, D) views also suit host-built descriptors (dense, no zero stride); else TMA=2 runs TMA=1."""
    cfg = spec.config_for(p, dtype, config)
    if cfg["WARP_SPEC"] >= 3:
        return _gluon_plan(spec, p, cfg, config, dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    num_m = triton.cdiv(p.Tq, block_m)
    num_bh = p.B * p.Hq
    scale = 1.0 / math.sqrt(p.D) if scale is None else float(scale)
    meta = dict(D=p.D, VARLEN=varlen, CAUSAL=p.causal, STORE_LSE=store_lse, HEADS_INNER=bool(cfg["HEADS_INNER"]),
                D_CONTIG=d_contig, IEEE=dtype == torch.float32 and K.fp32_precision() == "ieee", NEG_SCALE=scale < 0,
                # TMA=2 (host-built descriptors over (B, H, T, D)) needs the dense layout: a packed batch's
                # sequences are no descriptor dimension, so varlen takes the per-program descriptors instead;
                # so does a broadcast (zero-stride) batch or head dim, which the 2-D per-program ones never see
                TMA=(cfg["TMA"] if host_ok else min(cfg["TMA"], 1)) if tma_ok else 0,
                WARP_SPEC=cfg["WARP_SPEC"] if cfg["WARP_SPEC"] != 1 or tma_ok else 0,
                LAZY_RESCALE=bool(cfg["LAZY_RESCALE"]),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(p.D),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    meta_ptr = dict(meta, TMA=0, WARP_SPEC=0 if meta["WARP_SPEC"] == 1 else meta["WARP_SPEC"]) if meta["TMA"] else meta
    return _Plan(
        out_shape=(), grid=(num_m * num_bh,), cfg=cfg,
        cfg_key=None if config is not None else spec.config_key(p, dtype),
        scalars=(p.Hq, p.Hq // p.Hkv, p.Tq, p.Tk, num_m, num_bh, abs(scale) * LOG2E),
        # scale < 0: the kernel negates q and takes |scale| (negating fp16/bf16/fp32 is exact)
        meta=meta, meta_ptr=meta_ptr, consts=tuple(meta[c] for c in _CONSTEXPRS),
        consts_ptr=tuple(meta_ptr[c] for c in _CONSTEXPRS))


def _gluon_runs_here() -> bool:
    """Gluon kernels run on a GPU, never in the interpreter (whose WARP_SPEC 3-7 points run the plain kernel)."""
    from tritune.kernels.runtime import device as dev

    return not dev.interpreted()


def _gluon_plan(spec, p, cfg, config, dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok) -> _Plan:
    """A WARP_SPEC 3-7 config: the Gluon kernel where it takes the call, else the plain kernel with the
    default config (the interpreter, a scale <= 0, strides TMA cannot read, a dense call without keys, or a
    problem of the config's bucket that the Gluon kernel does not take: dense causal Tq > Tk, too many heads)."""
    scale_f = 1.0 / math.sqrt(p.D) if scale is None else float(scale)
    plain = _plan(spec, p, spec.default_config(p, dtype), dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok)
    plain.cfg_key = None if config is not None else spec.config_key(p, dtype)
    # the config cache is per bucket, so a config that came from it was checked against the bucket's first
    # problem only: this problem's own limits (causal Tq <= Tk, the grid's batch x heads) are checked here
    # not a zero scale either: the Gluon softmax scales masked (-inf) scores, and -inf x 0 is NaN; a packed
    # batch takes descriptors made on the device (host_ok is the host-built 4-D descriptors' condition)
    if (not _gluon_runs_here() or scale_f <= 0 or not tma_ok or not (varlen or host_ok)
            or _gluon_constraint(cfg, p, dtype) is not None):
        return plain
    schedule, persistent = _GLUON_POINTS[cfg["WARP_SPEC"]]
    return _Plan(out_shape=(), grid=(triton.cdiv(p.Tq, cfg["BLOCK_M"]), p.B * p.Hq), cfg=cfg, cfg_key=plain.cfg_key,
                 gluon=dict(causal=p.causal, qk_scale=scale_f * LOG2E, BN=cfg["BLOCK_N"], stages=cfg["num_stages"],
                            schedule=schedule, rows=cfg["BLOCK_M"], **({} if varlen else {"persistent": persistent})),
                 fallback=plain)


# WARP_SPEC -> (the Gluon kernel's GEMM schedule, its persistent form)
_GLUON_POINTS = {3: (0, False), 4: (1, False), 5: (2, False), 6: (1, True), 7: (2, True)}


def _tma_strides_ok(e: int, *tensor_strides) -> bool:
    """TMA reads rows of a 2-D (rows, D) view: unit stride along D, every other stride a multiple of
    16 bytes (so each (batch, head, sequence) base stays 16-byte aligned)."""
    return all(st[-1] == 1 and all((x * e) % 16 == 0 for x in st[:-1]) for st in tensor_strides)


def _aligned(*ts) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


_ALLOCATOR_SET = threading.local()


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need a global scratch buffer per launch, which Triton asks of the
    allocator set with ``triton.set_allocator`` (a context variable: per thread). Set a torch-backed one
    in this thread, unless the caller set their own."""
    if getattr(_ALLOCATOR_SET, "done", False):
        return
    try:
        from triton.runtime import _allocation

        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_torch_scratch)
    except (ImportError, AttributeError):
        triton.set_allocator(_torch_scratch)
    _ALLOCATOR_SET.done = True


def problem_of(q, k, v, *, causal=False, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], bool(causal))


_PLANS = K.PlanCache()


def _dense_plan(q, k, v, causal, scale, return_lse, out, config) -> _Plan:
    """Every metadata check (errors name the argument), then the launch plan."""
    Hq, Hkv, D = _check_qkv(q, k, v, 4)
    B, _, Tq, _ = q.shape
    _, _, Tk, _ = k.shape
    if k.shape[0] != B:
        raise ValueError(f"k: batch {k.shape[0]} does not match q's {B}")
    _check_scale(scale)
    shape = (B, Hq, Tq, D)
    if out is not None:
        K.check_out(out, shape, q.dtype, q.device)
    if B * Hq * Tq == 0:
        return _Plan(out_shape=shape)
    # a fresh out / lse is contiguous: its strides follow from its shape
    out_strides = out.stride() if out is not None else (Hq * Tq * D, Tq * D, D, 1)
    lse_strides = (Hq * Tq, Tq, 1) if return_lse else (0, 0, 0)
    d_contig = q.stride(-1) == k.stride(-1) == v.stride(-1) == out_strides[-1] == 1
    tma_ok = _tma_strides_ok(q.element_size(), q.stride(), k.stride(), v.stride(), out_strides)
    # and no empty dimension: a descriptor's shape must be positive (Tk = 0: no keys, every row outputs 0)
    host_ok = (all(x > 0 for st in (q.stride(), k.stride(), v.stride(), out_strides) for x in st[:-1])
               and min(B, Hq, Hkv, Tq, Tk) > 0)
    plan = _plan(SPEC, Problem(B, Hq, Hkv, Tq, Tk, D, bool(causal)), config, q.dtype, scale, d_contig,
                 False, bool(return_lse), tma_ok, host_ok)
    for pl in (plan, plan.fallback) if plan.fallback is not None else (plan,):
        pl.out_shape = shape
        pl.strides = (*q.stride(), *k.stride(), *v.stride(), *out_strides, *lse_strides)
        _host_caches(pl, q)
        if pl.meta.get("TMA") == 2:   # descriptors over the 4-D tensors: their bounds zero-fill and clip
            bm, bn, bd = pl.meta["BLOCK_M"], pl.meta["BLOCK_N"], pl.meta["BLOCK_D"]
            pl.descs = tuple(K.DescriptorMaker(TensorDescriptor, shp, st, [1, 1, rows, bd])
                             for shp, st, rows in ((q.shape, q.stride(), bm), (k.shape, k.stride(), bn),
                                                   (v.shape, v.stride(), bn), (shape, out_strides, bm)))
    return plan


def _host_caches(pl: _Plan, q) -> None:
    """A plan's host-side caches: compiled kernels for direct launches (CUDA only), the Gluon launch's."""
    pl.kernels = {} if K.DIRECT_LAUNCH and q.is_cuda else None
    if pl.gluon is not None:
        pl.gluon_cache = {}


def _launch_meta(plan, q, k, v, out) -> dict:
    """The plan's constexprs for this launch: the TMA variant only where every tensor is TMA-readable (unit
    stride along D, 16-byte aligned rows and bases), with the descriptors' allocator set; else the pointer path."""
    meta = plan.meta
    if meta["TMA"]:
        meta = meta if _aligned(q, k, v, out) else plan.meta_ptr
        if meta["TMA"] == 1 and q.is_cuda:
            _ensure_allocator()
    return meta


def _descs(plan, meta, q, k, v, out) -> tuple:
    """The kernel's DescQ/K/V/O arguments: under TMA=2 host-built descriptors over the 4-D (B, H, T, D)
    tensors (their T and D bounds zero-fill a tile's tail and clip the store, as the per-program ones
    do; made by the plan's makers), else the tensors themselves (unused)."""
    if meta["TMA"] != 2:
        return q, k, v, out
    mq, mk, mv, mo = plan.descs
    return mq(q), mk(k), mv(v), mo(out)


def attention(q, k, v, *, causal: bool = False, scale=None, return_lse: bool = False, out=None,
              config: dict | None = None):
    """Attention over (B, H, T, D) tensors of any strides. Returns out (B, Hq, Tq, D) in q's dtype, or
    (out, lse) with lse (B, Hq, Tq) float32, the natural log of each row's softmax denominator.

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D) with Hq a multiple of Hkv; D in HEAD_DIMS (32 to 256);
    fp16, bf16 or fp32. ``scale`` defaults to 1/sqrt(D). ``causal``: query i sees keys j <= i + Tk − Tq.
    ``out`` may be any strided view of the right shape (e.g. a (B, T, H, D) buffer transposed).
    """
    # The checks, the config and the launch parameters depend only on metadata: computed once per
    # signature. A GPT-2 prefill runs ~50 µs; the uncached host path (checks, config validation) cost
    # ~30 µs more on the host, enough to leave the GPU idle between launches.
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device,
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               causal, scale, type(scale), return_lse, None if config is None else tuple(config.items()),
               K.precision_key(q.dtype))
    except (AttributeError, TypeError):  # not tensors: the checks will say
        key = None
    plan = _PLANS.get_or_make(key, lambda: _dense_plan(q, k, v, causal, scale, return_lse, out, config))
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k", k), ("v", v)))
    lse = torch.empty(plan.out_shape[:3], dtype=torch.float32, device=q.device) if return_lse else None
    if plan.gluon is not None:
        if _aligned(q, k, v, out):
            G.launch(q, k, v, out, lse=lse, cache=plan.gluon_cache, **plan.gluon)
            return (out, lse) if return_lse else out
        plan = plan.fallback   # a base TMA cannot read (e.g. a view one element in)
    if plan.grid:
        meta = _launch_meta(plan, q, k, v, out)
        lse_arg = out if lse is None else lse
        args = (q, k, v, out, lse_arg, q, q, *_descs(plan, meta, q, k, v, out), *plan.strides, *plan.scalars)
        K.launch_cached(_attn_fwd, plan.kernels, plan.grid, args, meta,
                        plan.consts if meta is plan.meta else plan.consts_ptr, meta is plan.meta,
                        (q, k, v, out, lse_arg))
    return (out, lse) if return_lse else out


def _check_cu_meta(name, cu, device):
    K.check_tensor(name, cu, ndim=1, dtypes=(torch.int32,))
    if cu.device != device:
        raise ValueError(f"{name}: on {cu.device}, but q is on {device}")
    if cu.shape[0] < 1:
        raise ValueError(f"{name}: expected batch + 1 >= 1 entries, got none")


def _longest(name, cu, total) -> int:
    """The values of cu_seqlens checked (one device-to-host copy); returns the longest sequence."""
    vals = cu.tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}: must start at 0, starts at {vals[0]}")
    lens = [b - a for a, b in zip(vals, vals[1:])]
    if any(n < 0 for n in lens):
        i = next(i for i, n in enumerate(lens) if n < 0)
        raise ValueError(f"{name}: decreases at entry {i + 1} ({vals[i]} -> {vals[i + 1]}); must be non-decreasing")
    if vals[-1] != total:
        raise ValueError(f"{name}: last entry {vals[-1]} does not match the {total} packed tokens")
    return max(lens, default=0)


# cu_seqlens tensors whose values were checked: id -> (weak reference, version counter, total, longest).
# A tensor launched again unmodified (same object, same version) is not read back again: the launch
# stays free of host syncs (a benchmark loop, a model's layers sharing one cu_seqlens).
_CHECKED: dict = {}


def _longest_cached(name, cu, total, always: bool) -> int:
    import weakref

    # An inference tensor (made under torch.inference_mode) has no version counter, so an in-place change
    # could not be seen: such a tensor is checked on every launch (pass validate=False to skip it).
    always = always or cu.is_inference()
    hit = None if always else _CHECKED.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version and hit[2] == total:
        return hit[3]
    longest = _longest(name, cu, total)
    if not always:
        key = id(cu)
        if len(_CHECKED) > 1024:
            _CHECKED.clear()
        _CHECKED[key] = (weakref.ref(cu, lambda _r, key=key: _CHECKED.pop(key, None)), cu._version, total, longest)
    return longest


def varlen_problem_of(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, **_):
    """The shape a launcher configures for: batch and longest lengths (no need to read cu_seqlens)."""
    return PackedProblem(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], int(max_seqlen_q), int(max_seqlen_k),
                         q.shape[2], bool(causal))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                     scale=None, return_lse: bool = False, out=None, config: dict | None = None,
                     validate: bool | None = None):
    """Attention over packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D); sequence b owns rows
    cu_seqlens[b]:cu_seqlens[b+1] (int32, batch + 1 entries, from 0, non-decreasing). Empty sequences
    are allowed. Returns out (total_q, Hq, D), or (out, lse) with lse (total_q, Hq) float32.

    ``max_seqlen_q/k`` come from the caller and must bound the lengths: they size the grid, so the
    launch never reads cu_seqlens on the host. The values of cu_seqlens and those bounds are checked
    (ValueError naming the argument) according to ``validate``:
    None (default): the first time a cu_seqlens tensor is launched with (one device-to-host copy), not
    again while that tensor is unmodified; True: every launch; False: never (the engine's hot path).
    A CUDA-graph capture never checks. Unchecked bad values give wrong rows, but the kernel clamps every
    sequence to the packed tensors, so memory outside them is never touched.
    """
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, cu_seqlens_q.shape, cu_seqlens_q.dtype, cu_seqlens_q.device,
               cu_seqlens_k.shape, cu_seqlens_k.dtype, cu_seqlens_k.device, max_seqlen_q, type(max_seqlen_q),
               max_seqlen_k, type(max_seqlen_k),
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               causal, scale, type(scale), return_lse, None if config is None else tuple(config.items()),
               K.precision_key(q.dtype))
    except (AttributeError, TypeError):  # not tensors: the checks will say
        key = None
    plan = _VARLEN_PLANS.get_or_make(key, lambda: _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                               max_seqlen_k, causal, scale, return_lse, out, config))
    if validate is not False and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        always = validate is True or not q.is_cuda  # on the CPU reading the values costs no sync
        if _longest_cached("cu_seqlens_q", cu_seqlens_q, q.shape[0], always) > max_seqlen_q:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} is less than the longest query sequence "
                             f"{_longest('cu_seqlens_q', cu_seqlens_q, q.shape[0])}")
        if _longest_cached("cu_seqlens_k", cu_seqlens_k, k.shape[0], always) > max_seqlen_k:
            raise ValueError(f"max_seqlen_k: {max_seqlen_k} is less than the longest key sequence "
                             f"{_longest('cu_seqlens_k', cu_seqlens_k, k.shape[0])}")
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                               ("cu_seqlens_k", cu_seqlens_k)))
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    if plan.gluon is not None:
        if _aligned(q, k, v, out):
            _ensure_allocator()   # the kernel makes its descriptors on the device
            G.launch_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, lse=lse, cache=plan.gluon_cache,
                            **plan.gluon)
            return (out, lse) if return_lse else out
        plan = plan.fallback
    if plan.grid:
        meta = _launch_meta(plan, q, k, v, out)
        lse_arg = out if lse is None else lse
        args = (q, k, v, out, lse_arg, cu_seqlens_q, cu_seqlens_k, q, k, v, out, *plan.strides, *plan.scalars)
        K.launch_cached(_attn_fwd, plan.kernels, plan.grid, args, meta,
                        plan.consts if meta is plan.meta else plan.consts_ptr, meta is plan.meta,
                        (q, k, v, out, lse_arg, cu_seqlens_q, cu_seqlens_k))
    return (out, lse) if return_lse else out


_VARLEN_PLANS = K.PlanCache()


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, out,
                 config) -> _Plan:
    """Every metadata check of a packed launch (errors name the argument), then its plan."""
    Hq, Hkv, D = _check_qkv(q, k, v, 3)
    _check_scale(scale)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name}: expected a non-negative int, got {m!r}")
    _check_cu_meta("cu_seqlens_q", cu_seqlens_q, q.device)
    _check_cu_meta("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(f"cu_seqlens_k: {cu_seqlens_k.shape[0]} entries, but cu_seqlens_q has "
                         f"{cu_seqlens_q.shape[0]} (both batch + 1)")
    total_q, total_k = q.shape[0], k.shape[0]
    shape = (total_q, Hq, D)
    if out is not None:
        K.check_out(out, shape, q.dtype, q.device)
    B = cu_seqlens_q.shape[0] - 1
    if not (B > 0 and max_seqlen_q > 0 and total_q > 0):
        return _Plan(out_shape=shape)
    out_strides = out.stride() if out is not None else (Hq * D, D, 1)
    lse_strides = (Hq, 1) if return_lse else (0, 0)
    problem = PackedProblem(B, Hq, Hkv, max_seqlen_q, max_seqlen_k, D, bool(causal))
    d_contig = q.stride(-1) == k.stride(-1) == v.stride(-1) == out_strides[-1] == 1
    tma_ok = _tma_strides_ok(q.element_size(), q.stride(), k.stride(), v.stride(), out_strides)
    plan = _plan(VARLEN_SPEC, problem, config, q.dtype, scale, d_contig, True, bool(return_lse), tma_ok)
    for pl in (plan, plan.fallback) if plan.fallback is not None else (plan,):
        pl.out_shape = shape
        # packed tensors have no batch stride: the sequence offset comes from cu_seqlens
        pl.strides = (0, q.stride(1), q.stride(0), q.stride(2), 0, k.stride(1), k.stride(0), k.stride(2),
                      0, v.stride(1), v.stride(0), v.stride(2), 0, out_strides[1], out_strides[0], out_strides[2],
                      0, lse_strides[1], lse_strides[0])
        # the kernel clamps each sequence to the packed totals (passed where the dense launch passes Tq, Tk)
        if pl.scalars:   # the plain kernel's (a Gluon plan passes its own)
            pl.scalars = (pl.scalars[0], pl.scalars[1], total_q, total_k, *pl.scalars[4:])
        _host_caches(pl, q)
    return plan


# ---------------------------------------------------------------------------------------------------
# Config space (shared by both specs: their problems both answer B, Hq, Hkv, Tq, Tk, D, causal)
SPACE = K.Space(
    params={
        # 192: the Gluon kernel's CTA of three consumer warpgroups (FA3's tile at D <= 64), that kernel's only
        "BLOCK_M": [16, 32, 64, 128, 192],
        "BLOCK_N": [16, 32, 64, 128],
        "num_warps": [2, 4, 8],
        "num_stages": [1, 2, 3, 4, 5],
        "HEADS_INNER": [0, 1],
        # The Hopper path: Q/K/V/O through TMA tensor descriptors (sm90+; 1: made by each program on the
        # device, 2: made once on the host over the (B, H, T, D) tensors, no per-program cost), the
        # unmasked key loop's schedule (WARP_SPEC 0: Triton's pipeliner alone, 1: warp-specialized into
        # TMA producer and MMA consumer warps, needs TMA, 2: each block's scores issued one block ahead of
        # its softmax), and lazy softmax rescaling. The loop schedule shares one key so that configs
        # stored before schedule 2 existed stay points of the space.
        "TMA": [0, 1, 2],
        # 3, 4, 5: the Gluon FA3-structured kernel (kernels/_attention_gluon.py), its GEMM schedule 0, 1, 2
        # (2: the consumer warpgroups ping-pong); its CTAs are 128 rows of 4 + 4 + 1 warps or 192 rows of
        # 4 + 4 + 4 + 1 (BLOCK_M), over host-built descriptors;
        # 6, 7: its persistent form (one CTA per SM over the work items), schedule 1, 2, dense calls only
        "WARP_SPEC": [0, 1, 2, 3, 4, 5, 6, 7],
        "LAZY_RESCALE": [0, 1],
    },
)


_CAP = []


def capability() -> tuple:
    """The GPU's compute capability; the interpreter counts as a Hopper (it runs the TMA path)."""
    from tritune.kernels.runtime import device as dev

    if not _CAP:
        _CAP.append((9, 0) if dev.interpreted() else tuple(torch.cuda.get_device_capability()))
    return _CAP[0]


def _smem_budget() -> int:
    from tritune.kernels.runtime import device as dev

    if dev.interpreted():
        return 227 * 1024  # the interpreter has no limit; prune as for an H100
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


_SMEM = []


def _smem_limit() -> int:
    """This device's shared memory per block (measured once)."""
    if not _SMEM:
        _SMEM.append(_smem_budget())
    return _SMEM[0]


def smem_bytes(c, D: int, dtype) -> int:
    """Shared memory the kernel needs, by the pipeliner's rule: Q once, K and V tiles for each load in
    flight (num_stages − 1, at least 1), and a P tile for the layout change before the second dot; the
    TMA path also stages O in shared memory for its store. Scores one block ahead (WARP_SPEC=2) keep a K and a
    V tile for every stage (measured on the H200: 128 x 128 tiles, D=128, 3 stages need 262,144 B, 8 tiles)."""
    e = torch.finfo(dtype).bits // 8
    bd = triton.next_power_of_2(D)
    buffers = c["num_stages"] if c.get("WARP_SPEC") == 2 else max(1, c["num_stages"] - 1)
    o_stage = c["BLOCK_M"] * bd if c.get("TMA") else 0
    return e * (c["BLOCK_M"] * bd + 2 * buffers * c["BLOCK_N"] * bd + c["BLOCK_M"] * c["BLOCK_N"] + o_stage)


def _gluon_constraint(c, p, dtype) -> str | None:
    """The Gluon path's points: one canonical value of every key it does not read, its own tiles."""
    from tritune.kernels.runtime import device as dev

    # the interpreter counts as a Hopper here too (stored sm90 entries stay valid points on a CPU); it cannot
    # run Gluon, so its launches take the plain kernel (_gluon_plan)
    if not dev.interpreted() and (not G.AVAILABLE or capability()[0] != 9):
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel) run on sm90 GPUs only"
    if dtype not in (torch.float16, torch.bfloat16):
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel): fp16 and bf16 only"
    # a packed sequence's rows that see no key are the kernel's own case (they output 0); a dense call's are not
    if p.causal and p.Tq > p.Tk and not isinstance(p, (VarlenProblem, PackedProblem)):
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel): dense causal needs Tq <= Tk"
    if p.B * p.Hq > 65535:   # its grid is (query tiles, batch x heads): CUDA caps the second dimension
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel): at most 65,535 batch x heads"
    if (c["num_warps"], c["HEADS_INNER"], c["TMA"], c["LAZY_RESCALE"]) != (4, 0, 2, 0):
        return ("WARP_SPEC 3-7 (the Gluon FA3 kernel) take num_warps=4, HEADS_INNER=0, TMA=2, "
                "LAZY_RESCALE=0 (the keys it does not read, fixed)")
    bd = triton.next_power_of_2(p.D)
    if c["BLOCK_M"] not in (G.ROWS, G.ROWS3):
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel): BLOCK_M 128 (two consumer warpgroups) or 192 (three)"
    if c["BLOCK_N"] not in ((64, 128) if bd <= 128 else (64,)):
        # two score tiles and the output per consumer thread: 240 registers hold 128-key tiles up to D=128
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel): BLOCK_N 64 or 128 up to D=128, 64 past it"
    if c["BLOCK_M"] == G.ROWS3 and (bd > 128 or (bd > 64 and (c["BLOCK_N"] > 64 or c["WARP_SPEC"] == 7))
                                    or (c["BLOCK_N"] > 64 and c["WARP_SPEC"] == 3)):
        # three consumer warpgroups leave each 160 registers; these points spill (sm90 SASS, triton 3.6:
        # lab/logs/cpu/gluon_attention_three_warpgroup_spills_2026-11-28)
        return ("WARP_SPEC 3-7 with BLOCK_M=192 (three consumer warpgroups, 160 registers each): up to D=64, "
                "BLOCK_N=64 up to D=128 but not WARP_SPEC 7 there, and not WARP_SPEC 3 with BLOCK_N=128")
    if c["num_stages"] < 2:   # deeper rings, up to the space's 5, where they fit in shared memory
        return "WARP_SPEC 3-7 (the Gluon FA3 kernel): 2 stages or more"
    persistent = _GLUON_POINTS[c["WARP_SPEC"]][1]
    if persistent and isinstance(p, (VarlenProblem, PackedProblem)):
        return "WARP_SPEC 6-7 (the persistent Gluon FA3 kernel): dense calls only"
    need = G.smem_bytes(p.D, c["BLOCK_N"], c["num_stages"], persistent=persistent, rows=c["BLOCK_M"])
    if need > _smem_limit():
        return f"needs {need} B of shared memory (budget {_smem_limit()})"
    return None


def _constraint(c, p, dtype) -> str | None:
    if c["WARP_SPEC"] >= 3:
        return _gluon_constraint(c, p, dtype)
    bm, bn, w = c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]
    if bm != triton.next_power_of_2(bm):
        return "BLOCK_M=192 is the Gluon kernel's (WARP_SPEC 3-7: three consumer warpgroups)"
    if bm > max(16, triton.next_power_of_2(p.Tq)):
        return "BLOCK_M larger than the queries"
    if bn > max(16, triton.next_power_of_2(p.Tk)):
        return "BLOCK_N larger than the keys"
    if bm < 8 * w:
        return "idle warps (fewer than 8 rows a warp)"
    if c["WARP_SPEC"] == 1 and not c["TMA"]:
        return "WARP_SPEC needs TMA (the producer warps issue TMA loads)"
    if c["WARP_SPEC"] == 1 and c["TMA"] == 2:
        # triton's own Hopper attention (tutorial 06) makes its descriptors on the device when it
        # warp-specializes; host-built ones are not known to go through that pass
        return "WARP_SPEC=1 takes the per-program descriptors (TMA=1), not host-built ones"
    if c["TMA"] == 2 and isinstance(p, VarlenProblem):
        return "TMA=2: a packed batch's sequences are no descriptor dimension (varlen runs TMA=1)"
    if c["WARP_SPEC"] == 1 and c["num_warps"] < 8 and not c["LAZY_RESCALE"]:
        # triton 3.6 on sm90 aborts in its warp-specialization pass (TaskIdPropagation.cpp:162, "isa<scf::IfOp>
        # || isa<scf::ForOp>") for this combination (H100, D=64, 4 warps, 3 stages), in the GPU test suite
        return "WARP_SPEC with fewer than 8 warps needs LAZY_RESCALE (triton 3.6's warp-specialization pass aborts)"
    if c["TMA"] and capability() < (9, 0):
        return "TMA needs sm90 or newer"
    bd = triton.next_power_of_2(p.D)
    if dtype == torch.float32 and (bm > 64 or bn > 64):
        return "fp32 takes the FMA path (ieee dots): tiles of at most 64 x 64"
    # the accumulator and one score tile per thread; scores one block ahead hold a second score tile
    per_thread = (bm * bd + (2 if c["WARP_SPEC"] == 2 else 1) * bm * bn) // (32 * w)
    if per_thread > 192:
        return f"{per_thread} float32 accumulators/scores per thread (register spills)"
    if smem_bytes(c, p.D, dtype) > _smem_limit():
        return f"needs {smem_bytes(c, p.D, dtype)} B of shared memory (budget {_smem_limit()})"
    return None


SPACE.constraint = _constraint


def default_config(p, dtype) -> dict:
    """Measured on an H100 (bf16, triton 3.6): 128-row tiles on two warpgroups (8 warps), three stages;
    64-key blocks at D <= 64, 128-key blocks above. Fewer than ~4 waves of 128-row programs (one long
    sequence of a small model): 64-row tiles on one warpgroup, twice the programs. HEADS_INNER keeps all
    heads' row blocks together only while every head's K/V fits in L2 together; past that, one head's
    row blocks run side by side and share its K/V in L2 (1.3x at 4 x 32 heads x 4096, D=128). fp32 takes
    the FMA path (ieee dots): small tiles. Head dims past 128 (a 256-wide fp32 accumulator): 64-key
    blocks, two stages. On sm90+ fp16/bf16 takes the TMA path: host-built descriptors at D <= 128, per-program
    ones for 8k queries and more past that."""
    bd = triton.next_power_of_2(p.D)
    if dtype == torch.float32:
        bm, bn, warps, stages = 64, 32, 4, 2
    elif bd <= 64:
        bm, bn, warps, stages = 128, 64, 8, 3
        if p.B * p.Hq * triton.cdiv(p.Tq, 128) < 512:
            bm, warps = 64, 4
    elif bd <= 128:
        bm, bn, warps, stages = 128, 128, 8, 3
    else:
        bm, bn, warps, stages = 128, 64, 8, 2
    bm = min(bm, max(16, triton.next_power_of_2(p.Tq)))
    bn = min(bn, max(16, triton.next_power_of_2(p.Tk)))
    while warps > 2 and bm < 8 * warps:
        warps //= 2
    kv_bytes = 2 * p.B * p.Hkv * p.Tk * p.D * (torch.finfo(dtype).bits // 8)
    # Host-built descriptors (TMA=2) at D <= 128: they won 17 of the 20 rows of the H100 FA3-grid sweep
    # (lab/logs/h100/attention_fa3_grid_sweep_new_2026-11-25_12718f8: 1.02-1.16x over the pointer path, most at
    # D=128 and 1k-4k queries; the 3 others within 8%). Per-program descriptors (TMA=1) past D=128 only
    # where the earlier sweep picked them (lab/logs/h100/benches_2026-11-24_6b00e06/fa3.log): 8k+ queries.
    hopper = dtype != torch.float32 and capability() >= (9, 0)
    tma = (2 if bd <= 128 else int(p.Tq >= 8192)) if hopper else 0
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
           "HEADS_INNER": int(kv_bytes <= 32 << 20), "TMA": tma, "WARP_SPEC": 0, "LAZY_RESCALE": 0}
    while SPACE.constraint(cfg, p, dtype) and cfg["num_stages"] > 1:
        cfg["num_stages"] -= 1
    while SPACE.constraint(cfg, p, dtype) and cfg["BLOCK_N"] > 16:  # D=256 with few warps: smaller key blocks
        cfg["BLOCK_N"] //= 2
    return cfg


def gluon_config(p, dtype, schedule: int = 2, BLOCK_N: int | None = None, num_stages: int = 2,
                 persistent: bool = False, BLOCK_M: int = G.ROWS) -> dict:
    """The point of the space that runs the Gluon kernel with GEMM ``schedule`` (WARP_SPEC 3 + schedule; its
    persistent form, schedule 1 or 2: WARP_SPEC 5 + schedule), its key tile (default: 128 up to D=128, 64
    past it), ring depth and CTA rows (128: two consumer warpgroups, 192: three); the keys it does not read at
    their one value. Not checked against the problem (``SPACE.why_invalid`` says)."""
    ws = next((w for w, pt in _GLUON_POINTS.items() if pt == (schedule, persistent)), None)
    if ws is None:
        raise ValueError(f"schedule: the {'persistent ' if persistent else ''}Gluon kernel has no schedule {schedule}")
    bn = BLOCK_N or (128 if triton.next_power_of_2(p.D) <= 128 else 64)
    return dict(default_config(p, dtype), BLOCK_M=BLOCK_M, num_warps=4, HEADS_INNER=0, TMA=2, LAZY_RESCALE=0,
                WARP_SPEC=ws, BLOCK_N=bn, num_stages=num_stages)


def gluon_seeds(p, dtype) -> list[dict]:
    """Every tuning study's way into the Gluon kernel (WARP_SPEC 3-7 fix five keys at once, which no
    one-step move reaches): FA3's two schedules at the tile that won most of FA3's grid on the H200
    (the default key tile; 3 stages where they fit, else 2:
    lab/logs/h200/attention_fa3_grid_gluon_2026-11-28_d9eae70). The tuner skips those the problem refuses."""
    bn = gluon_config(p, dtype)["BLOCK_N"]
    stages = 3 if G.smem_bytes(p.D, bn, 3) <= _smem_limit() else 2
    # the persistent form (dense only): the deepest ring up to 4 that fits beside its four Q buffers (4 stages
    # won its 1k-2k rows at D=64: lab/logs/h200/gluon_fa3_persistent_deep_rings_2026-11-28_eaa684a)
    p_stages = max([st for st in (2, 3, 4) if G.smem_bytes(p.D, bn, st, persistent=True) <= _smem_limit()],
                   default=2)
    # FA3's CTA at D <= 64: three consumer warpgroups over 192 query rows, the ping-pong schedule
    return [gluon_config(p, dtype, schedule, num_stages=stages) for schedule in (1, 2)] + [
        gluon_config(p, dtype, 1, num_stages=p_stages, persistent=True),
        gluon_config(p, dtype, 2, num_stages=3, BLOCK_M=G.ROWS3)]


def varlen_default_config(p, dtype) -> dict:
    """As dense, but every sequence's last row blocks first (HEADS_INNER=1) whatever the K/V size: in a
    packed batch most programs of the short sequences exit at once, and the tail is set by the longest
    sequence's row blocks, which HEADS_INNER=0 would start late (the H100 benchmark batch took 219 µs
    with 0, 138 µs with 1 and 4 warps)."""
    # the pointer path: the engine's prefill batches (packed prompts of up to a few thousand tokens) are
    # where the serving numbers were measured with it; TMA for varlen is a config to tune, not a default
    return {**default_config(p, dtype), "HEADS_INNER": 1, "TMA": 0, "WARP_SPEC": 0}


def bucket(p) -> dict:
    return {"B": triton.next_power_of_2(max(1, p.B)), "Hq": p.Hq, "Hkv": p.Hkv,
            "Tq": triton.next_power_of_2(max(1, p.Tq)), "Tk": triton.next_power_of_2(max(1, p.Tk)),
            "D": p.D, "mask": "causal" if p.causal else "full"}


def _pairs(p) -> float:
    """Query-key pairs a row of heads computes: Tq·Tk, halved under causal masking (square case)."""
    if isinstance(p, VarlenProblem):
        return sum(q * k for q, k in zip(p.seqlens_q, p.seqlens_k)) * (0.5 if p.causal else 1.0)
    return p.B * p.Tq * p.Tk * (0.5 if p.causal else 1.0)


def cost(p, dtype) -> K.Cost:
    e = torch.finfo(dtype).bits // 8
    if isinstance(p, VarlenProblem):
        tq, tk = sum(p.seqlens_q), sum(p.seqlens_k)
    else:
        tq, tk = p.B * p.Tq, p.B * p.Tk
    # two dots of 2·D flops per query-key pair; bytes: q and o once, k and v once
    return K.Cost(flops=4.0 * p.Hq * p.D * _pairs(p), bytes=float(e * p.D * (2 * tq * p.Hq + 2 * tk * p.Hkv)))


# ---------------------------------------------------------------------------------------------------
# Inputs. Layouts: "contiguous" (B, H, T, D); "bthd": views of (B, T, H, D) buffers, k and v sharing one,
# as a model's projections produce them; "sliced": rows padded with NaN past D; "transposed": the
# head dim is not unit-stride.
def _qkv(shape_q, shape_kv, dtype, device, seed, layout):
    q = S.randn(shape_q, dtype, device, seed)
    k = S.randn(shape_kv, dtype, device, seed + 1)
    v = S.randn(shape_kv, dtype, device, seed + 2, scale=1.0, shift=0.25)
    if layout == "bthd":  # q from a (B, Tq, Hq, D) buffer, k and v from one fused (B, Tk, 2·Hkv, D) buffer
        hkv = shape_kv[1]
        kv = torch.cat([k, v], dim=1).transpose(1, 2).contiguous().transpose(1, 2)
        return q.transpose(1, 2).contiguous().transpose(1, 2), kv[:, :hkv], kv[:, hkv:]
    return tuple(S.with_layout(t, layout) for t in (q, k, v))


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    q, k, v = _qkv((p.B, p.Hq, p.Tq, p.D), (p.B, p.Hkv, p.Tk, p.D), dtype, device, seed, layout)
    return K.Case(args=(q, k, v), kwargs={"causal": p.causal},
                  out=torch.empty((p.B, p.Hq, p.Tq, p.D), dtype=dtype, device=device))


def _cu(lens, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_varlen_inputs(p: VarlenProblem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    tq, tk = sum(p.seqlens_q), sum(p.seqlens_k)
    q, k, v = _qkv((tq, p.Hq, p.D), (tk, p.Hkv, p.D), dtype, device, seed, layout)
    return K.Case(args=(q, k, v, _cu(p.seqlens_q, device), _cu(p.seqlens_k, device), p.Tq, p.Tk),
                  kwargs={"causal": p.causal}, out=torch.empty((tq, p.Hq, p.D), dtype=dtype, device=device))


def _heads(d, max_elems):
    from hypothesis import strategies as st

    small = max_elems <= 1 << 16  # the interpreter: few heads
    hkv = d(st.sampled_from([1, 2] if small else [1, 2, 3, 4]))
    group = d(st.sampled_from([1, 2, 4] if small else [1, 2, 4, 8]))
    return hkv * group, hkv


def problems(max_elems: int):
    """Attention is Tq·Tk per head: lengths up to 64 on the interpreter, 2048 on a GPU; the batch keeps
    q within max_elems and the float64 reference's scores within 4·max_elems."""
    from hypothesis import strategies as st

    t_max = 64 if max_elems <= 1 << 16 else 2048

    @st.composite
    def draw(d):
        D = d(st.sampled_from(HEAD_DIMS))
        hq, hkv = _heads(d, max_elems)
        tq = d(S.sizes(t_max))
        tk = d(st.one_of(st.just(tq), S.sizes(t_max)))
        b_max = max(1, min(4, max_elems // (hq * max(tq, tk) * D), 4 * max_elems // (hq * tq * tk)))
        return Problem(d(st.integers(1, b_max)), hq, hkv, tq, tk, D, d(st.booleans()))

    return draw()


def varlen_problems(max_elems: int):
    from hypothesis import strategies as st

    t_max = 48 if max_elems <= 1 << 16 else 1024

    @st.composite
    def draw(d):
        D = d(st.sampled_from(HEAD_DIMS))
        hq, hkv = _heads(d, max_elems)
        length = st.one_of(st.sampled_from([0, 1]), S.sizes(t_max))
        lq = d(st.lists(length, min_size=1, max_size=4))
        lk = tuple(lq) if d(st.booleans()) else tuple(d(st.lists(length, min_size=len(lq), max_size=len(lq))))
        return VarlenProblem(tuple(lq), lk, hq, hkv, D, d(st.booleans()))

    return draw()


# ---------------------------------------------------------------------------------------------------
# The vendor path and peers
def _vendor(c: K.Case):
    """What a user gets: plain ``F.scaled_dot_product_attention`` (torch's own dispatch; cuDNN for bf16 on
    an H100), labelled with the backend that ran (``call.label``, e.g. "sdpa (cudnn)")."""
    q, k, v = c.args
    causal = c.kwargs.get("causal", False)
    gqa = k.shape[1] != q.shape[1]
    F = torch.nn.functional

    def call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    call.label = f"sdpa ({K.sdpa_backend(call)})"
    return call


def _varlen_vendor(c: K.Case):
    """What a user gets for packed sequences: ``torch.nn.attention.varlen.varlen_attn`` (torch 2.9+,
    FlashAttention's varlen kernel; CUDA, fp16/bf16). Its signature moved between releases, read off it:
    causal as ``is_causal=True`` (2.9, 2.10) or ``window_size=(-1, 0)`` (later), both aligned to the
    bottom right as ours; GQA through ``enable_gqa`` where it has it (2.12+), else the kv heads expanded
    outside the timed call. Raises where it cannot run (no such function, the CPU, fp32): the row says why."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    q, k, v, cu_q, cu_k, max_q, max_k = c.args
    if q.device.type != "cuda":
        raise RuntimeError("varlen_attn runs on CUDA only")
    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if c.kwargs.get("causal", False):
        if "is_causal" in params:
            kw["is_causal"] = True
        elif "window_size" in params:
            kw["window_size"] = (-1, 0)
        else:
            raise RuntimeError("this torch's varlen_attn has no causal mask")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    def call():
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    call()   # a case it cannot run raises here, named in the row
    call.label = "torch varlen_attn"
    return call


def _sdpa_peer(backend: str):
    """SDPA forced to one backend (a peer column each): GQA heads expanded outside the timed call, so a
    backend without GQA support still runs. A backend that cannot run the case raises at set-up, and the
    row records why."""
    def peer(c: K.Case):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = c.args
        if q.device.type != "cuda":
            return None
        if k.shape[1] != q.shape[1]:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        causal = c.kwargs.get("causal", False)
        which = getattr(SDPBackend, backend)

        def call():
            with sdpa_kernel(which):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        call()  # not available for this case (dtype, head dim, GPU): raises here, named in the row
        return call

    return peer


_FLEX: dict = {}


def _causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _flex(c: K.Case):
    """flex_attention compiled by torch.compile; the block mask is built here, outside the timed call."""
    q, k, v = c.args
    causal = c.kwargs.get("causal", False)
    if q.device.type != "cuda" or (causal and q.shape[2] != k.shape[2]):
        return None
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "fn" not in _FLEX:
            import torch._dynamo

            # one compiled graph per benchmark shape: past dynamo's default limit of 8 recompiles,
            # flex_attention silently runs unfused (it did at the 10th shape: 66x slower than fused)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
        key = (q.shape[2], k.shape[2], causal)
        if key not in _FLEX:
            _FLEX[key] = create_block_mask(_causal_mask, None, None, q.shape[2], k.shape[2],
                                           device=q.device) if causal else None
        fn, mask, gqa = _FLEX["fn"], _FLEX[key], q.shape[1] != k.shape[1]
        call = lambda: fn(q, k, v, block_mask=mask, enable_gqa=gqa)  # noqa: E731
        call()
        return call
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------------
def _bad_inputs(device):
    q = torch.randn(1, 4, 8, 32, device=device)
    k = torch.randn(1, 2, 8, 32, device=device)
    qp, kp = torch.randn(10, 4, 32, device=device), torch.randn(12, 2, 32, device=device)
    i32 = torch.int32

    def cu(*vals):
        return torch.tensor(vals, dtype=i32, device=device)

    def va(**kw):
        a = dict(q=qp, k=kp, v=kp, cu_seqlens_q=cu(0, 4, 10), cu_seqlens_k=cu(0, 6, 12), max_seqlen_q=6,
                 max_seqlen_k=6)
        a.update(kw)
        return lambda: attention_varlen(**a)

    return [
        ("head dim mismatch q/k", lambda: attention(q, torch.randn(1, 2, 8, 64, device=device), k), ValueError),
        ("v shape differs from k", lambda: attention(q, k, torch.randn(1, 2, 9, 32, device=device)), ValueError),
        ("Hq not a multiple of Hkv", lambda: attention(torch.randn(1, 3, 8, 32, device=device), k, k), ValueError),
        ("unsupported head dim", lambda: attention(*(torch.randn(1, 2, 8, 48, device=device),) * 3), ValueError),
        ("k dtype differs from q", lambda: attention(q, k.half(), k.half()), TypeError),
        ("float64 q", lambda: attention(q.double(), k.double(), k.double()), TypeError),
        ("integer q", lambda: attention(q.int(), k.int(), k.int()), TypeError),
        ("q not a tensor", lambda: attention([1.0], k, k), TypeError),
        ("3-D q for attention", lambda: attention(q[0], k[0], k[0]), ValueError),
        ("batch mismatch", lambda: attention(q, torch.randn(2, 2, 8, 32, device=device),
                                             torch.randn(2, 2, 8, 32, device=device)), ValueError),
        ("q on the wrong device", lambda: attention(q.to("meta"), k, k), ValueError),
        ("k on the wrong device", lambda: attention(q, k.to("meta"), k), ValueError),
        ("scale not finite", lambda: attention(q, k, k, scale=float("nan")), ValueError),
        ("out of the wrong shape", lambda: attention(q, k, k, out=torch.empty(1, 4, 8, 31, device=device)), ValueError),
        ("out of the wrong dtype", lambda: attention(q, k, k, out=torch.empty(1, 4, 8, 32, device=device).half()),
         TypeError),
        ("varlen: cu_seqlens decreasing", va(cu_seqlens_q=cu(0, 7, 5, 10), cu_seqlens_k=cu(0, 4, 6, 12)), ValueError),
        ("varlen: cu_seqlens not from 0", va(cu_seqlens_q=cu(1, 4, 10)), ValueError),
        ("varlen: cu_seqlens_q total mismatch", va(cu_seqlens_q=cu(0, 4, 9)), ValueError),
        ("varlen: cu_seqlens_k total mismatch", va(cu_seqlens_k=cu(0, 6, 13)), ValueError),
        ("varlen: cu_seqlens lengths differ", va(cu_seqlens_k=cu(0, 12)), ValueError),
        ("varlen: int64 cu_seqlens", va(cu_seqlens_q=cu(0, 4, 10).long()), TypeError),
        ("varlen: 2-D cu_seqlens", va(cu_seqlens_q=cu(0, 4, 10)[None]), ValueError),
        ("varlen: max_seqlen_q too small", va(max_seqlen_q=5), ValueError),
        ("varlen: max_seqlen_k too small", va(max_seqlen_k=5), ValueError),
        ("varlen: negative max_seqlen", va(max_seqlen_k=-1), ValueError),
        ("varlen: head dim mismatch", va(k=torch.randn(12, 2, 64, device=device),
                                         v=torch.randn(12, 2, 64, device=device)), ValueError),
        ("varlen: Hq not a multiple of Hkv", va(q=torch.randn(10, 3, 32, device=device)), ValueError),
        ("varlen: cu_seqlens on the wrong device", va(cu_seqlens_q=cu(0, 4, 10).to("meta")), ValueError),
        ("varlen: dtype mismatch", va(q=qp.half()), TypeError),
    ]


_COMMON = dict(
    space=SPACE,
    default_config=default_config,
    bucket=bucket,
    cost=cost,
    dtypes=DTYPES,
    accumulation=K.fp32_accumulation,  # fp32 dots follow torch.get_float32_matmul_precision()
    bad_inputs=_bad_inputs,
)

_GPT2 = [Problem(b, 12, 12, t, t, 64, c) for (b, t) in ((8, 1024), (16, 1024), (1, 4096)) for c in (True, False)]
_LARGE = [Problem(b, 32, 32, t, t, 128, c) for (b, t) in ((4, 4096), (1, 16384)) for c in (True, False)]

SPEC = K.register(K.KernelSpec(
    name="attention",
    description="fused attention forward (prefill): online softmax, causal, GQA",
    run=attention,
    reference=ref.attention,
    make_inputs=make_inputs,
    problems=problems,
    problem_of=problem_of,
    standard_problems=_GPT2 + _LARGE + [Problem(4, 32, 8, 4096, 4096, 128, True)],
    small_problems=[Problem(2, 4, 2, 40, 40, 64, True), Problem(1, 2, 1, 17, 33, 80, False)],
    layouts=("contiguous", "bthd", "sliced", "transposed"),
    vendor=_vendor,
    vendor_name="sdpa (torch's default dispatch)",
    peers={"sdpa_flash": _sdpa_peer("FLASH_ATTENTION"), "sdpa_efficient": _sdpa_peer("EFFICIENT_ATTENTION"),
           "sdpa_cudnn": _sdpa_peer("CUDNN_ATTENTION"), "flex": _flex},
    seeds=gluon_seeds,
    **_COMMON,
))

VARLEN_SPEC = K.register(K.KernelSpec(
    name="attention_varlen",
    description="fused attention forward over packed variable-length sequences",
    run=attention_varlen,
    reference=ref.attention_varlen,
    make_inputs=make_varlen_inputs,
    problems=varlen_problems,
    problem_of=varlen_problem_of,
    standard_problems=[VarlenProblem((1024, 37, 512, 2048, 1, 300, 880, 1000), (1024, 37, 512, 2048, 1, 300, 880, 1000),
                                     12, 12, 64, True)],
    small_problems=[VarlenProblem((5, 0, 17, 1), (5, 3, 17, 1), 4, 2, 64, True)],
    layouts=("contiguous", "sliced"),
    vendor=_varlen_vendor,
    vendor_name="torch.nn.attention.varlen.varlen_attn",
    seeds=gluon_seeds,
    **{**_COMMON, "default_config": varlen_default_config},
))
