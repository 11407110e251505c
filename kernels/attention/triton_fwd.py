"""The Triton kernel of attention's ``IMPL="triton"`` points: flash-attention forward with an online softmax.

One program owns BLOCK_M query rows of one head and streams the keys and values past them in BLOCK_N
blocks: running row max m_i, running denominator l_i and output accumulator acc, all float32; no Tq × Tk
matrix ever reaches memory. Scores are kept in base 2 (scale · log2 e folded in, exp2 instead of exp).
Both dots run in the input dtype with float32 accumulation; P is cast to the input dtype before the P·V dot.

The key loop is split in two: blocks every row of the tile sees in full run without a single mask, then the
few blocks on the causal diagonal or past the end of the keys run masked. Fully masked blocks (above the
diagonal) are never visited. ``SCHEDULE`` orders the unmasked loop: "pipelined" (Triton's pipeliner alone),
"warp_specialized" (Triton splits it into TMA producer and MMA consumer warps), "ahead" (each key block's
scores issued one block ahead of its softmax). ``TMA`` picks how Q/K/V/O move (0 pointers, 1 descriptors
made by each program, 2 host-built 4-D descriptors).
"""
import triton
import triton.language as tl

@triton.jit
def load_kv(src, start_n, cols, offs_d, mask_d, seqlen_k, stride_n, b, kvh,
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
def dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def softmax_step(s, acc, l_i, m_i, offs_m, cols, seqlen_k, delta, qk_scale,
                 MASKED: tl.constexpr, CAUSAL: tl.constexpr, LAZY_RESCALE: tl.constexpr, WINDOW: tl.constexpr = 0):
    """Fold raw scores s (one key block) into the running max and denominator: returns p (base-2
    exponentials against the new reference max) and acc, l_i rescaled to that max. ``WINDOW`` > 0: each row
    sees only the WINDOW keys up to its diagonal (masked blocks only: the caller keeps the rest inside it)."""
    if MASKED:
        visible = (cols < seqlen_k)[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + delta)
        if WINDOW > 0:
            visible = visible & (cols[None, :] > offs_m[:, None] + delta - WINDOW)
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
def attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
               lo, hi, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAD_D: tl.constexpr, IEEE: tl.constexpr,
               TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, LAZY_RESCALE: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, WINDOW: tl.constexpr = 0):
    """Fold keys lo..hi (lo a multiple of BLOCK_N) into (acc, l_i, m_i). k_src/v_src are tensor
    descriptors under TMA (rows past the sequence and columns past D arrive as zeros), else base pointers."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = load_kv(k_src, start_n, cols, offs_dk, mask_d, seqlen_k, stride_kn, b, kvh,
                     MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        v = load_kv(v_src, start_n, cols, offs_dv, mask_d, seqlen_k, stride_vn, b, kvh,
                     MASKED, PAD_D, TMA, BLOCK_N, BLOCK_D)
        s = dot(q, tl.trans(k), None, IEEE)
        p, acc, l_i, m_i = softmax_step(s, acc, l_i, m_i, offs_m, cols, seqlen_k, delta, qk_scale,
                                        MASKED, CAUSAL, LAZY_RESCALE, WINDOW)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
    return acc, l_i, m_i


@triton.jit
def attn_inner_ahead(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                      hi, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                      PAD_D: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, LAZY_RESCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The unmasked keys 0..hi (hi >= BLOCK_N, a multiple of it) with the scores one block ahead: block
    j+1's q·kᵀ is issued before block j's softmax, so the tensor cores work on it while the exp2s of
    block j run (FA3's intra-warpgroup overlap, written out instead of left to the scheduler). Costs a
    second score tile in registers."""
    k = load_kv(k_src, 0, offs_n, offs_dk, mask_d, seqlen_k, stride_kn, b, kvh,
                 False, PAD_D, TMA, BLOCK_N, BLOCK_D)
    s = dot(q, tl.trans(k), None, IEEE)
    for start_n in tl.range(0, hi - BLOCK_N, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        nxt = start_n + BLOCK_N
        k = load_kv(k_src, nxt, nxt + offs_n, offs_dk, mask_d, seqlen_k, stride_kn, b, kvh,
                     False, PAD_D, TMA, BLOCK_N, BLOCK_D)
        s_next = dot(q, tl.trans(k), None, IEEE)
        p, acc, l_i, m_i = softmax_step(s, acc, l_i, m_i, offs_m, start_n + offs_n, seqlen_k, delta, qk_scale,
                                         False, False, LAZY_RESCALE)
        v = load_kv(v_src, start_n, start_n + offs_n, offs_dv, mask_d, seqlen_k, stride_vn, b, kvh,
                     False, PAD_D, TMA, BLOCK_N, BLOCK_D)
        acc = dot(p.to(v.dtype), v, acc, IEEE)
        s = s_next
    last = hi - BLOCK_N
    p, acc, l_i, m_i = softmax_step(s, acc, l_i, m_i, offs_m, last + offs_n, seqlen_k, delta, qk_scale,
                                     False, False, LAZY_RESCALE)
    v = load_kv(v_src, last, last + offs_n, offs_dv, mask_d, seqlen_k, stride_vn, b, kvh,
                 False, PAD_D, TMA, BLOCK_N, BLOCK_D)
    acc = dot(p.to(v.dtype), v, acc, IEEE)
    return acc, l_i, m_i


@triton.jit
def attn_fwd(Q, K, V, O, LSE, CuQ, CuK, DescQ, DescK, DescV, DescO,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_lm,
              Hq, group, seqlen_q_all, seqlen_k_all, num_m_blocks, num_bh, qk_scale,
              D: tl.constexpr, VARLEN: tl.constexpr, CAUSAL: tl.constexpr, STORE_LSE: tl.constexpr, HEADS_INNER: tl.constexpr,
              D_CONTIG: tl.constexpr, IEEE: tl.constexpr, NEG_SCALE: tl.constexpr,
              TMA: tl.constexpr, SCHEDULE: tl.constexpr, LAZY_RESCALE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr = 0):
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
    if WINDOW > 0:
        # local attention (causal): row r sees keys r + delta - WINDOW < j <= r + delta. Blocks wholly left
        # of the tile's first row's window are skipped, those crossing some row's window edge run masked
        # first, then the blocks inside every row's window and left of the diagonal unmasked
        first = tl.maximum(start_m + delta - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        inside = tl.minimum(tl.cdiv(tl.maximum(start_m + BLOCK_M + delta - WINDOW, 0), BLOCK_N) * BLOCK_N, lo)
        acc, l_i, m_i = attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                                   first, inside, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                   True, CAUSAL, PAD_D, IEEE, TMA, False, False, BLOCK_N, BLOCK_D, WINDOW)
        acc, l_i, m_i = attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                                   inside, lo, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                   False, CAUSAL, PAD_D, IEEE, TMA, False, LAZY_RESCALE, BLOCK_N, BLOCK_D)
        lo = tl.maximum(lo, first)
    elif SCHEDULE == "ahead":
        if lo > 0:
            acc, l_i, m_i = attn_inner_ahead(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv,
                                             mask_d, lo, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                             PAD_D, IEEE, TMA, LAZY_RESCALE, BLOCK_N, BLOCK_D)
    else:
        acc, l_i, m_i = attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                                   0, lo, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                                   False, CAUSAL, PAD_D, IEEE, TMA, SCHEDULE == "warp_specialized", LAZY_RESCALE,
                                   BLOCK_N, BLOCK_D)
    acc, l_i, m_i = attn_inner(acc, l_i, m_i, q, k_src, v_src, offs_m, offs_n, offs_dk, offs_dv, mask_d,
                               lo, hi, seqlen_k, delta, stride_kn, stride_vn, qk_scale, b, kvh,
                               True, CAUSAL, PAD_D, IEEE, TMA, False, False, BLOCK_N, BLOCK_D, WINDOW)

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

