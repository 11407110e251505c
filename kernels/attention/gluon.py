"""The attention kernel's FlashAttention-3-structured Hopper path, written in Gluon (sm90 only).

Attention runs this for its configs ``IMPL="gluon"`` (``PERSISTENT=1``: the persistent form), tuned like every
other point of its space; its descriptors and launches are in :mod:`.gluon_launch`, everything else about the
call (checks, plan cache, fallbacks) in the package's launch modules. A CTA's state travels between its
partitions in named aggregates (:class:`Descs`, :class:`Ring`, :class:`Work`; the persistent kernel's
:class:`PersistentRing`, :class:`Items`).

One CTA owns 128 query rows of one (batch, head) as **two consumer warpgroups of 64 rows**, each in its own
``gl.warp_specialize`` partition, so one warpgroup's softmax runs under the other's tensor-core work; or, NWG=3
(attention's BLOCK_M=192, FA3's CTA at D <= 64), 192 rows as three, 160 registers each, taking their turns
round robin under schedule 2 (the spilling points, found by compiling every point for sm90, are refused by
the config space; docs/findings.md). A
**one-warp producer** TMA-loads every warpgroup's Q once and K, V tiles into a ``STAGES``-deep ring (K and V
on separate barriers, so QK^T starts as soon as K lands; a slot is freed when every consumer finished its
P @ V). P @ V takes P from registers (wgmma's A operand). ``SCHEDULE`` orders a consumer's GEMMs (attention's
config names them "ahead", "intra_wg" and "pingpong"): 0, QK^T of tile j+1 issued before the softmax of tile j;
1, FA3's intra-warpgroup order (QK^T of j+1 and P_j @ V_j issued together, the softmax of j+1 under P_j @ V_j);
2, 1 plus FA3's ping-pong (the warpgroups take turns issuing their GEMM pair, ordered by one mbarrier each).
Causal: heaviest query tiles first, keys past the CTA's last diagonal never loaded; query i sees key j when
j <= i + Tk - Tq (Tq <= Tk).

Descriptors (``RANK``): 2-D over (B*H*T, D) where the tensors are contiguous, Tq a multiple of the CTA's
rows, Tk of the key tile and D a power of two; else 4-D over the tensors' own (B, H, T, D) strides, blocks
[1, 1, rows, D padded to a power of two] (TMA zero-fills rows past T and columns past D on loads and clips
them on stores). The launcher only comes here for fp16/bf16, D a multiple of 16 up to
256, a positive scale, every stride TMA-readable and every base 16-byte aligned; an lse output is written by
the consumers beside O (``STORE_LSE``).

Packed batches (``attention_varlen``: ``fa3_fwd_varlen``) run the same partitions over 2-D descriptors that
each CTA makes on the device for its (sequence, head), bounded by the sequence's rows: TMA zero-fills past
a sequence's end and clips the store there, so no tile reads or writes another sequence's rows. A
sequence may have more queries than keys (causal): rows that see no key output 0 (``GUARD``).

Persistent form (``fa3_fwd_persistent``, dense calls, 4-D descriptors): one CTA per SM loops over (query
tile, batch-head) work items, causal heaviest first; the same partitions, with each warpgroup's Q buffer
doubled so the producer loads the next item's Q and K/V while the consumers finish the current one and
store its O (``q_free``); the ring's slot and phase and the ping-pong turn run on across items. At 1k-2k
tokens it hides the per-tile prologue and epilogue that a CTA per tile pays with nothing to overlap.
What each form measured before it was registered: docs/findings.md.
"""

import triton

try:  # Gluon is triton's; a build without it (or without its Hopper module) has no such path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor  # noqa: F401
    try:   # public from triton 3.8; triton's own Gluon kernels reach it here before that
        from triton.experimental.gluon import aggregate
    except ImportError:
        from triton.language.core import _aggregate as aggregate
    AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means: not available here
    AVAILABLE = False

BM = 64            # query rows a consumer warpgroup
ROWS = 2 * BM      # query rows a CTA of two consumer warpgroups (the default)
ROWS3 = 3 * BM     # ... of three (FA3's CTA at D <= 64)
# the launch's register cap (the whole register file over the CTA's warpgroups, the producer's padded to one)
# and the consumer workers' setmaxnreg, by consumer warpgroups: two 240 / 24, three 160 / 24 (FA3's split)
MAXNREG = {2: 168, 3: 128}


def smem_bytes(D: int, BN: int, stages: int, elem: int = 2, persistent: bool = False, rows: int = ROWS) -> int:
    """Q of every consumer warpgroup (``rows`` in all; it holds O on the way out; double-buffered in the
    persistent kernel) and a K and a V tile for every stage."""
    Dp = triton.next_power_of_2(max(D, 16))
    return elem * ((2 if persistent else 1) * rows * Dp + 2 * stages * BN * Dp) + 1024   # + barriers, alignment


if AVAILABLE:
    @aggregate
    class Descs:
        """The TMA descriptors of Q, K, V and O."""
        q: tma.tensor_descriptor
        k: tma.tensor_descriptor
        v: tma.tensor_descriptor
        o: tma.tensor_descriptor

        @gluon.constexpr_function
        def __init__(self, q, k, v, o):
            self.q = q
            self.k = k
            self.v = v
            self.o = o

    @aggregate
    class Ring:
        """A CTA's shared memory: every consumer warpgroup's Q buffer, the K/V ring; and its barriers: Q landed
        (one a warpgroup), K and V landed and the slot free again (one each a ring slot), and the ping-pong
        turns (one a warpgroup)."""
        q_smem: gl.shared_memory_descriptor
        k_bufs: gl.shared_memory_descriptor
        v_bufs: gl.shared_memory_descriptor
        q_bar: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        sched: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, empty, sched):
            self.q_smem = q_smem
            self.k_bufs = k_bufs
            self.v_bufs = v_bufs
            self.q_bar = q_bar
            self.k_ready = k_ready
            self.v_ready = v_ready
            self.empty = empty
            self.sched = sched

    @aggregate
    class PersistentRing:
        """:class:`Ring` of the persistent kernel: Q buffers (and their barriers) doubled, by item parity, and
        ``q_free``: an item's O has left its Q buffer."""
        q_smem: gl.shared_memory_descriptor
        k_bufs: gl.shared_memory_descriptor
        v_bufs: gl.shared_memory_descriptor
        q_bar: gl.shared_memory_descriptor
        q_free: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        sched: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, q_smem, k_bufs, v_bufs, q_bar, q_free, k_ready, v_ready, empty, sched):
            self.q_smem = q_smem
            self.k_bufs = k_bufs
            self.v_bufs = v_bufs
            self.q_bar = q_bar
            self.q_free = q_free
            self.k_ready = k_ready
            self.v_ready = v_ready
            self.empty = empty
            self.sched = sched

    @aggregate
    class Work:
        """A CTA's query tile: its first row in the descriptors' row space (``q_row0``; the K/V rows' ``kv_row0``),
        the key tiles to stream, the softmax scale (times log2 e), the sequence's lengths, its batch, head and
        kv head, the tile's first query position in its sequence, and where its lse rows start."""
        q_row0: gl.tensor
        kv_row0: gl.tensor
        n_tiles: gl.tensor
        qk_scale: gl.tensor
        Tq: gl.tensor
        Tk: gl.tensor
        b: gl.tensor
        h: gl.tensor
        hk: gl.tensor
        q_start: gl.tensor
        lse_row0: gl.tensor
        lse_stride: gl.tensor

        @gluon.constexpr_function
        def __init__(self, q_row0, kv_row0, n_tiles, qk_scale, Tq, Tk, b, h, hk, q_start, lse_row0, lse_stride):
            self.q_row0 = q_row0
            self.kv_row0 = kv_row0
            self.n_tiles = n_tiles
            self.qk_scale = qk_scale
            self.Tq = Tq
            self.Tk = Tk
            self.b = b
            self.h = h
            self.hk = hk
            self.q_start = q_start
            self.lse_row0 = lse_row0
            self.lse_stride = lse_stride

    @aggregate
    class Items:
        """The persistent kernel's work: ``n_items`` (query tile, batch-head) items, ``n_m`` query tiles over
        ``BHn`` batch-heads; the problem's heads, lengths and softmax scale; the lse tensor and its strides."""
        n_items: gl.tensor
        n_m: gl.tensor
        BHn: gl.tensor
        H: gl.tensor
        H_KV: gl.tensor
        Tq: gl.tensor
        Tk: gl.tensor
        qk_scale: gl.tensor
        LSE: gl.tensor
        stride_lb: gl.tensor
        stride_lh: gl.tensor
        stride_lm: gl.tensor

        @gluon.constexpr_function
        def __init__(self, n_items, n_m, BHn, H, H_KV, Tq, Tk, qk_scale, LSE, stride_lb, stride_lh, stride_lm):
            self.n_items = n_items
            self.n_m = n_m
            self.BHn = BHn
            self.H = H
            self.H_KV = H_KV
            self.Tq = Tq
            self.Tk = Tk
            self.qk_scale = qk_scale
            self.LSE = LSE
            self.stride_lb = stride_lb
            self.stride_lh = stride_lh
            self.stride_lm = stride_lm

    @gluon.jit
    def _work(q_row0, kv_row0, n_tiles, qk_scale, Tq, Tk, b, h, hk, q_start, lse_row0, lse_stride):
        """A :class:`Work` of these values, each a tensor: triton specializes an integer argument equal to 1 (a
        unit lse stride, one query row) and the packed kernel's K/V rows count from 0, and the partitions
        take every field as an argument either way."""
        return Work(gl.to_tensor(q_row0), gl.to_tensor(kv_row0), gl.to_tensor(n_tiles), gl.to_tensor(qk_scale),
                    gl.to_tensor(Tq), gl.to_tensor(Tk), gl.to_tensor(b), gl.to_tensor(h), gl.to_tensor(hk),
                    gl.to_tensor(q_start), gl.to_tensor(lse_row0), gl.to_tensor(lse_stride))

    @gluon.jit
    def _items(n_items, n_m, BHn, H, H_KV, Tq, Tk, qk_scale, LSE, stride_lb, stride_lh, stride_lm):
        """An :class:`Items` of these values, each a tensor (as :func:`_work`)."""
        return Items(gl.to_tensor(n_items), gl.to_tensor(n_m), gl.to_tensor(BHn), gl.to_tensor(H),
                     gl.to_tensor(H_KV), gl.to_tensor(Tq), gl.to_tensor(Tk), gl.to_tensor(qk_scale), gl.to_tensor(LSE),
                     gl.to_tensor(stride_lb), gl.to_tensor(stride_lh), gl.to_tensor(stride_lm))

    @gluon.jit
    def _tile(buf, RANK: gl.constexpr):
        """A (rows, D) view of a TMA tile: the buffer (2-D descriptors) or its (1, 1, rows, D) view reshaped."""
        if RANK == 4:
            return buf.reshape([buf.type.shape[2], buf.type.shape[3]])
        else:
            return buf

    @gluon.jit
    def _loader(d, r, w, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, RANK: gl.constexpr, WG: gl.constexpr):
        """The producer (one warp): Q of every consumer once, then K and V tiles into the ring."""
        STAGES: gl.constexpr = r.k_bufs.type.shape[0]
        NWG: gl.constexpr = r.q_smem.type.shape[0]
        BMc: gl.constexpr = r.q_smem.type.shape[RANK - 1]
        BN: gl.constexpr = r.k_bufs.type.shape[RANK - 1]
        for i in gl.static_range(NWG):
            mbarrier.expect(r.q_bar.index(i), d.q.block_type.nbytes)
            if RANK == 4:
                tma.async_copy_global_to_shared(d.q, [w.b, w.h, w.q_start + i * BMc, 0], r.q_bar.index(i),
                                                r.q_smem.index(i))
            else:
                tma.async_copy_global_to_shared(d.q, [w.q_row0 + i * BMc, 0], r.q_bar.index(i), r.q_smem.index(i))
        for j in range(w.n_tiles):
            s = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(r.empty.index(s), ph ^ 1)          # every consumer done with the slot's last tile
            mbarrier.expect(r.k_ready.index(s), d.k.block_type.nbytes)
            if RANK == 4:
                tma.async_copy_global_to_shared(d.k, [w.b, w.hk, j * BN, 0], r.k_ready.index(s), r.k_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(d.k, [w.kv_row0 + j * BN, 0], r.k_ready.index(s), r.k_bufs.index(s))
            mbarrier.expect(r.v_ready.index(s), d.v.block_type.nbytes)
            if RANK == 4:
                tma.async_copy_global_to_shared(d.v, [w.b, w.hk, j * BN, 0], r.v_ready.index(s), r.v_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(d.v, [w.kv_row0 + j * BN, 0], r.v_ready.index(s), r.v_bufs.index(s))

    @gluon.jit
    def _softmax(S, j, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL: gl.constexpr, GUARD: gl.constexpr,
                 dtype: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
        """Online softmax of S tile j: keys past Tk masked (a ragged last tile), and when causal the keys past
        each row's diagonal. ``GUARD``: some rows may have seen no key yet (a packed sequence with more
        queries than keys): their max stays -inf and must not turn the exponentials into NaN. Returns (P as
        wgmma's register A operand, the rescale factor in the output's row layout, m, l)."""
        BMc: gl.constexpr = S.type.shape[0]
        BN: gl.constexpr = S.type.shape[1]
        cols = j * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        if CAUSAL:
            if (j + 1) * BN > q_first + offset:   # the tile crosses the diagonal of some row of this warpgroup
                rows = q_first + offset + gl.arange(0, BMc, layout=gl.SliceLayout(1, s_layout))
                S = gl.where(cols[None, :] > rows[:, None], -float("inf"), S)
        else:
            if (j + 1) * BN > Tk:
                S = gl.where(cols[None, :] >= Tk, -float("inf"), S)
        m_new = gl.maximum(m_i, gl.max(S, axis=1) * qk_scale)
        if GUARD:
            m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = gl.exp2(S * qk_scale - m_use[:, None])
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
        return p_op, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_new, l_i

    @gluon.jit
    def _attend(q, r, it, g, n_tiles, qk_scale, q_first, Tk, offset, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                RANK: gl.constexpr, WG: gl.constexpr, GUARD: gl.constexpr, s_layout: gl.constexpr,
                o_layout: gl.constexpr):
        """One consumer warpgroup's 64 query rows (``q``) against key tiles it .. it + n_tiles - 1 of the ring
        ``r`` (counted from the CTA's first: a persistent CTA's ring position, and its ping-pong turn ``g``, run
        on across items), in GEMM order ``SCHEDULE`` (module doc). Returns (acc after the last P @ V, m, l)."""
        STAGES: gl.constexpr = r.k_bufs.type.shape[0]
        NWG: gl.constexpr = r.sched.type.shape[0]
        D: gl.constexpr = r.k_bufs.type.shape[RANK]
        BN: gl.constexpr = r.k_bufs.type.shape[RANK - 1]
        BMc: gl.constexpr = q.type.shape[0]
        dt: gl.constexpr = r.v_bufs.dtype
        m_i = gl.full([BMc], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BMc], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BMc, D], gl.float32, o_layout)
        s0 = gl.zeros([BMc, BN], gl.float32, s_layout)

        mbarrier.wait(r.k_ready.index(it % STAGES), (it // STAGES) & 1)
        S = warpgroup_mma(q, _tile(r.k_bufs.index(it % STAGES), RANK).permute((1, 0)), s0, use_acc=False,
                          is_async=True)
        S = warpgroup_mma_wait(num_outstanding=0, deps=(S,))
        if SCHEDULE == 0:
            for j in range(n_tiles - 1):
                c = it + j
                n = c + 1
                mbarrier.wait(r.k_ready.index(n % STAGES), (n // STAGES) & 1)
                S_next = warpgroup_mma(q, _tile(r.k_bufs.index(n % STAGES), RANK).permute((1, 0)), s0,
                                       use_acc=False, is_async=True)
                p_op, alpha, m_i, l_i = _softmax(S, j, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL, GUARD, dt,
                                                 s_layout, o_layout)
                acc = acc * alpha[:, None]
                mbarrier.wait(r.v_ready.index(c % STAGES), (c // STAGES) & 1)
                acc = warpgroup_mma(p_op, _tile(r.v_bufs.index(c % STAGES), RANK), acc, is_async=True)
                S_next, acc = warpgroup_mma_wait(num_outstanding=0, deps=(S_next, acc))
                mbarrier.arrive(r.empty.index(c % STAGES), count=1)
                S = S_next
            p_op, alpha, m_i, l_i = _softmax(S, n_tiles - 1, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL, GUARD,
                                             dt, s_layout, o_layout)
            acc = acc * alpha[:, None]
        else:
            p_op, alpha, m_i, l_i = _softmax(S, 0, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL, GUARD, dt,
                                             s_layout, o_layout)
            for j in range(n_tiles - 1):
                c = it + j
                n = c + 1
                mbarrier.wait(r.k_ready.index(n % STAGES), (n // STAGES) & 1)
                mbarrier.wait(r.v_ready.index(c % STAGES), (c // STAGES) & 1)
                if SCHEDULE == 2:   # this warpgroup's turn to issue, round robin (the first warpgroup's first is free)
                    mbarrier.wait(r.sched.index(WG), ((g + j) & 1) ^ (1 if WG == 0 else 0))
                S_next = warpgroup_mma(q, _tile(r.k_bufs.index(n % STAGES), RANK).permute((1, 0)), s0,
                                       use_acc=False, is_async=True)
                acc = warpgroup_mma(p_op, _tile(r.v_bufs.index(c % STAGES), RANK), acc, is_async=True)
                if SCHEDULE == 2:
                    mbarrier.arrive(r.sched.index((WG + 1) % NWG), count=1)
                S_next = warpgroup_mma_wait(num_outstanding=1, deps=(S_next,))   # QK^T done, P_j @ V_j running
                p_op, alpha, m_i, l_i = _softmax(S_next, j + 1, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL,
                                                 GUARD, dt, s_layout, o_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(r.empty.index(c % STAGES), count=1)
                acc = acc * alpha[:, None]
        c = it + n_tiles - 1
        mbarrier.wait(r.v_ready.index(c % STAGES), (c // STAGES) & 1)
        acc = warpgroup_mma(p_op, _tile(r.v_bufs.index(c % STAGES), RANK), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(r.empty.index(c % STAGES), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _finish(acc, m_i, l_i, q, q_first, Tq, lse_row0, lse_stride, GUARD: gl.constexpr, STORE_LSE: gl.constexpr,
                s_layout: gl.constexpr, o_layout: gl.constexpr):
        """The lse output (natural log of each row's softmax denominator; a row that saw no key: -inf), then
        O = acc / l into the warpgroup's Q buffer (its own: it carries O out), fenced for the TMA store."""
        BMc: gl.constexpr = q.type.shape[0]
        if STORE_LSE:
            rows = q_first + gl.arange(0, BMc, layout=gl.SliceLayout(1, s_layout))
            gl.store(lse_row0 + rows.to(gl.int64) * lse_stride, (m_i + gl.log2(l_i)) * 0.6931471805599453,
                     mask=rows < Tq)
        if GUARD:   # rows that saw no key: l = 0 and acc = 0, output 0 (not 0/0)
            l_i = gl.where(l_i == 0.0, 1.0, l_i)
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        q.store(out.to(q.dtype))
        fence_async_shared()

    @gluon.jit
    def _consumer(d, r, w, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, RANK: gl.constexpr, WG: gl.constexpr,
                  GUARD: gl.constexpr, STORE_LSE: gl.constexpr):
        """One consumer warpgroup: 64 query rows against every K/V tile of the ring (schedules: module doc)."""
        D: gl.constexpr = r.k_bufs.type.shape[RANK]
        BN: gl.constexpr = r.k_bufs.type.shape[RANK - 1]
        BMc: gl.constexpr = r.q_smem.type.shape[RANK - 1]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        q_first = w.q_start + WG * BMc   # this warpgroup's first query position in its sequence

        q = _tile(r.q_smem.index(WG), RANK)
        mbarrier.wait(r.q_bar.index(WG), 0)
        acc, m_i, l_i = _attend(q, r, 0, 0, w.n_tiles, w.qk_scale, q_first, w.Tk, w.Tk - w.Tq, CAUSAL, SCHEDULE,
                                RANK, WG, GUARD, s_layout, o_layout)
        _finish(acc, m_i, l_i, q, q_first, w.Tq, w.lse_row0, w.lse_stride, GUARD, STORE_LSE, s_layout, o_layout)
        if RANK == 4:   # rows past Tq and columns past D are clipped by the descriptor
            tma.async_copy_shared_to_global(d.o, [w.b, w.h, q_first, 0], r.q_smem.index(WG))
        else:
            tma.async_copy_shared_to_global(d.o, [w.q_row0 + WG * BMc, 0], r.q_smem.index(WG))
        tma.store_wait(pendings=0)

    @gluon.jit
    def _barriers(N: gl.constexpr, COUNT: gl.constexpr):
        """N mbarriers, each completing after COUNT arrivals."""
        bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N):
            mbarrier.init(bars.index(i), count=COUNT)
        return bars

    @gluon.jit
    def _kv_ring(k_desc, v_desc, STAGES: gl.constexpr, NWG: gl.constexpr):
        """The K/V ring: STAGES K and V tiles, a ready barrier for each (the producer's TMA), and an empty
        barrier for each slot that all NWG consumers release."""
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        return k_bufs, v_bufs, _barriers(STAGES, 1), _barriers(STAGES, 1), _barriers(STAGES, NWG)

    @gluon.jit
    def _partitions(d, w, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, RANK: gl.constexpr,
                    GUARD: gl.constexpr, STORE_LSE: gl.constexpr, NWG: gl.constexpr):
        """A CTA's shared memory (every warpgroup's Q, the K/V ring) and barriers, then its partitions: the NWG
        (2 or 3) consumer warpgroups and the producer warp, over the descriptors ``d`` and the tile ``w``."""
        q_smem = gl.allocate_shared_memory(d.q.dtype, [NWG] + d.q.block_type.shape, d.q.layout)
        q_bar = _barriers(NWG, 1)
        sched = _barriers(NWG, 1)
        k_bufs, v_bufs, k_ready, v_ready, empty = _kv_ring(d.k, d.v, STAGES, NWG)
        r = Ring(q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, empty, sched)
        if NWG == 2:
            gl.warp_specialize([
                (_consumer, (d, r, w, CAUSAL, SCHEDULE, RANK, 0, GUARD, STORE_LSE)),
                (_consumer, (d, r, w, CAUSAL, SCHEDULE, RANK, 1, GUARD, STORE_LSE)),
                (_loader, (d, r, w, CAUSAL, SCHEDULE, RANK, 1)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (d, r, w, CAUSAL, SCHEDULE, RANK, 0, GUARD, STORE_LSE)),
                (_consumer, (d, r, w, CAUSAL, SCHEDULE, RANK, 1, GUARD, STORE_LSE)),
                (_consumer, (d, r, w, CAUSAL, SCHEDULE, RANK, 2, GUARD, STORE_LSE)),
                (_loader, (d, r, w, CAUSAL, SCHEDULE, RANK, 1)),
            ], [4, 4, 1], [160, 160, 24])

    @gluon.jit
    def _tile_coords(pid_m, bh, H, H_KV, Tq, Tk, BMc: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
                     NWG: gl.constexpr):
        """Query tile ``pid_m`` (NWG x BMc rows) of batch-head ``bh`` -> (b, h, kv head, the tile's first query
        row, key tiles to stream: causal, up to the diagonal of the tile's last row, bottom-right aligned)."""
        b = bh // H
        h = bh % H
        hk = h // (H // H_KV)
        q_start = pid_m * (NWG * BMc)
        if CAUSAL:
            n_tiles = gl.cdiv(gl.minimum(Tk, q_start + NWG * BMc + Tk - Tq), BN)
        else:
            n_tiles = gl.cdiv(Tk, BN)
        return b, h, hk, q_start, n_tiles

    @gluon.jit
    def fa3_fwd(q_desc, k_desc, v_desc, o_desc, qk_scale, Tq, Tk, H, H_KV, LSE, stride_lb, stride_lh, stride_lm,
                STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, RANK: gl.constexpr,
                STORE_LSE: gl.constexpr, NWG: gl.constexpr, num_warps: gl.constexpr):
        """The dense kernel: a CTA a (query tile, batch-head), over host-built descriptors of ``RANK`` 2 or 4."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        BMc: gl.constexpr = q_desc.block_type.shape[RANK - 2]
        BN: gl.constexpr = k_desc.block_type.shape[RANK - 2]
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        if CAUSAL:   # the longest rows first
            pid_m = gl.num_programs(0) - 1 - pid_m
        b, h, hk, q_start, n_tiles = _tile_coords(pid_m, bh, H, H_KV, Tq, Tk, BMc, BN, CAUSAL, NWG)
        q_row0 = bh * Tq + q_start
        kv_row0 = (b * H_KV + hk) * Tk

        lse_row0 = LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
        w = _work(q_row0, kv_row0, n_tiles, qk_scale, Tq, Tk, b, h, hk, q_start, lse_row0, stride_lm)
        _partitions(Descs(q_desc, k_desc, v_desc, o_desc), w, STAGES, CAUSAL, SCHEDULE, RANK, False, STORE_LSE, NWG)


if AVAILABLE:
    @gluon.jit
    def _item(item, n_m, BHn, H, H_KV, Tq, Tk, BMc: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
              NWG: gl.constexpr):
        """The persistent kernel's work item -> :func:`_tile_coords`. Causal: the heaviest query tiles first over
        every batch-head."""
        if CAUSAL:
            pid_m = n_m - 1 - item // BHn
        else:
            pid_m = item // BHn
        return _tile_coords(pid_m, item % BHn, H, H_KV, Tq, Tk, BMc, BN, CAUSAL, NWG)

    @gluon.jit
    def _p_loader(d, r, w, CAUSAL: gl.constexpr):
        """The persistent producer: for each of the CTA's items ``w``, every warpgroup's Q into the item's Q
        buffers (once the item two before has stored its O from them), then the item's K/V tiles into the ring."""
        STAGES: gl.constexpr = r.k_bufs.type.shape[0]
        NWG: gl.constexpr = r.q_smem.type.shape[0] // 2
        BMc: gl.constexpr = r.q_smem.type.shape[3]
        BN: gl.constexpr = r.k_bufs.type.shape[3]
        it = 0   # K/V tiles loaded so far (the ring's running position)
        t = 0    # items so far (the Q buffers' running position)
        for item in range(gl.program_id(0), w.n_items, gl.num_programs(0)):
            b, h, hk, q_start, n_tiles = _item(item, w.n_m, w.BHn, w.H, w.H_KV, w.Tq, w.Tk, BMc, BN, CAUSAL, NWG)
            for i in gl.static_range(NWG):
                slot = (t % 2) * NWG + i
                mbarrier.wait(r.q_free.index(slot), ((t // 2) & 1) ^ 1)
                mbarrier.expect(r.q_bar.index(slot), d.q.block_type.nbytes)
                tma.async_copy_global_to_shared(d.q, [b, h, q_start + i * BMc, 0], r.q_bar.index(slot),
                                                r.q_smem.index(slot))
            for j in range(n_tiles):
                s = it % STAGES
                mbarrier.wait(r.empty.index(s), ((it // STAGES) & 1) ^ 1)   # every consumer done with the slot
                mbarrier.expect(r.k_ready.index(s), d.k.block_type.nbytes)
                tma.async_copy_global_to_shared(d.k, [b, hk, j * BN, 0], r.k_ready.index(s), r.k_bufs.index(s))
                mbarrier.expect(r.v_ready.index(s), d.v.block_type.nbytes)
                tma.async_copy_global_to_shared(d.v, [b, hk, j * BN, 0], r.v_ready.index(s), r.v_bufs.index(s))
                it += 1
            t += 1

    @gluon.jit
    def _p_consumer(d, r, w, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, WG: gl.constexpr,
                    STORE_LSE: gl.constexpr):
        """One persistent consumer warpgroup over the CTA's items: 64 query rows of each against its key
        tiles, QK^T of tile j+1 and P_j @ V_j issued together (SCHEDULE 2: the warpgroups take turns)."""
        NWG: gl.constexpr = r.q_smem.type.shape[0] // 2
        BMc: gl.constexpr = r.q_smem.type.shape[3]
        BN: gl.constexpr = r.k_bufs.type.shape[3]
        D: gl.constexpr = r.k_bufs.type.shape[4]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        it = 0   # K/V tiles consumed so far
        g = 0    # GEMM-pair turns taken so far (the ping-pong's running count)
        t = 0    # items so far
        for item in range(gl.program_id(0), w.n_items, gl.num_programs(0)):
            b, h, hk, q_start, n_tiles = _item(item, w.n_m, w.BHn, w.H, w.H_KV, w.Tq, w.Tk, BMc, BN, CAUSAL, NWG)
            q_first = q_start + WG * BMc
            slot = (t % 2) * NWG + WG
            q = _tile(r.q_smem.index(slot), 4)
            mbarrier.wait(r.q_bar.index(slot), (t // 2) & 1)
            acc, m_i, l_i = _attend(q, r, it, g, n_tiles, w.qk_scale, q_first, w.Tk, w.Tk - w.Tq, CAUSAL, SCHEDULE,
                                    4, WG, False, s_layout, o_layout)
            lse_row0 = w.LSE + b.to(gl.int64) * w.stride_lb + h.to(gl.int64) * w.stride_lh
            _finish(acc, m_i, l_i, q, q_first, w.Tq, lse_row0, w.stride_lm, False, STORE_LSE, s_layout, o_layout)
            tma.async_copy_shared_to_global(d.o, [b, h, q_first, 0], r.q_smem.index(slot))
            tma.store_wait(pendings=0)
            mbarrier.arrive(r.q_free.index(slot), count=1)   # the producer may load the item two ahead into it
            it += n_tiles
            g += n_tiles - 1
            t += 1

    @gluon.jit
    def fa3_fwd_persistent(q_desc, k_desc, v_desc, o_desc, qk_scale, Tq, Tk, H, H_KV, LSE, stride_lb, stride_lh,
                           stride_lm, B, STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                           STORE_LSE: gl.constexpr, NWG: gl.constexpr, num_warps: gl.constexpr):
        """The persistent form (attention's PERSISTENT=1, dense only, 4-D descriptors): one CTA per SM loops
        over (query tile, batch-head) work items, so the producer loads the next item's Q and K/V while the
        consumers finish the current one (Q double-buffered per warpgroup: ``q_free`` says an item's O has left
        its buffer); the K/V ring's slot and phase and the ping-pong turn run on across items."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        BMc: gl.constexpr = q_desc.block_type.shape[2]
        n_m = gl.cdiv(Tq, NWG * BMc)
        BHn = B * H
        n_items = n_m * BHn
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NWG] + q_desc.block_type.shape, q_desc.layout)
        q_bar = _barriers(2 * NWG, 1)     # (double buffer) x (warpgroup): Q landed
        q_free = _barriers(2 * NWG, 1)    # ... its O stored, the buffer free
        sched = _barriers(NWG, 1)
        k_bufs, v_bufs, k_ready, v_ready, empty = _kv_ring(k_desc, v_desc, STAGES, NWG)
        d = Descs(q_desc, k_desc, v_desc, o_desc)
        r = PersistentRing(q_smem, k_bufs, v_bufs, q_bar, q_free, k_ready, v_ready, empty, sched)
        w = _items(n_items, n_m, BHn, H, H_KV, Tq, Tk, qk_scale, LSE, stride_lb, stride_lh, stride_lm)
        if NWG == 2:
            gl.warp_specialize([
                (_p_consumer, (d, r, w, CAUSAL, SCHEDULE, 0, STORE_LSE)),
                (_p_consumer, (d, r, w, CAUSAL, SCHEDULE, 1, STORE_LSE)),
                (_p_loader, (d, r, w, CAUSAL)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_p_consumer, (d, r, w, CAUSAL, SCHEDULE, 0, STORE_LSE)),
                (_p_consumer, (d, r, w, CAUSAL, SCHEDULE, 1, STORE_LSE)),
                (_p_consumer, (d, r, w, CAUSAL, SCHEDULE, 2, STORE_LSE)),
                (_p_loader, (d, r, w, CAUSAL)),
            ], [4, 4, 1], [160, 160, 24])


if AVAILABLE:
    @gluon.jit
    def fa3_fwd_varlen(Q, K, V, O, CuQ, CuK, stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh,
                        stride_om, stride_oh, qk_scale, total_q, total_k, H, H_KV, LSE, stride_lh, stride_lm,
                        D: gl.constexpr, DP: gl.constexpr, BN: gl.constexpr, LQ: gl.constexpr, LKV: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, STORE_LSE: gl.constexpr,
                        NWG: gl.constexpr, num_warps: gl.constexpr):
        """Packed sequences: q (total_q, H, D), k/v (total_k, H_KV, D); sequence b owns rows
        cu_seqlens[b]:cu_seqlens[b+1]. The partitions are the dense kernel's, over 2-D descriptors made on
        the device for this CTA's (sequence, head): their bounds are the sequence's rows and D, so TMA
        zero-fills past a sequence's end (never another sequence's rows) and clips the store at it. Causal
        is bottom-right aligned per sequence; a sequence with more queries than keys has rows that see no
        key: they output 0 (the plain kernel's answer), and a CTA all of whose rows see none writes its
        zeros without loading anything. Each sequence is clamped to the packed totals, as in the plain
        kernel, so unchecked cu_seqlens can give wrong rows but no access outside the tensors."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        BMc: gl.constexpr = 64   # BM: query rows a consumer warpgroup
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // (H // H_KV)
        qs = gl.minimum(gl.maximum(gl.load(CuQ + b), 0), total_q)
        Tq = gl.minimum(gl.maximum(gl.load(CuQ + b + 1) - qs, 0), total_q - qs)
        ks = gl.minimum(gl.maximum(gl.load(CuK + b), 0), total_k)
        Tk = gl.minimum(gl.maximum(gl.load(CuK + b + 1) - ks, 0), total_k - ks)
        n_m = gl.cdiv(Tq, NWG * BMc)
        if pid_m >= n_m:   # the grid is sized by the longest sequence
            return
        if CAUSAL:   # the sequence's longest rows first
            pid_m = n_m - 1 - pid_m
        q_start = pid_m * (NWG * BMc)
        if CAUSAL:
            n_tiles = gl.cdiv(gl.maximum(gl.minimum(Tk, q_start + NWG * BMc + Tk - Tq), 0), BN)
        else:
            n_tiles = gl.cdiv(Tk, BN)
        o_base = O + qs.to(gl.int64) * stride_om + h.to(gl.int64) * stride_oh
        lse_row0 = LSE + qs.to(gl.int64) * stride_lm + h.to(gl.int64) * stride_lh
        if n_tiles == 0:   # no row of this CTA sees a key: out 0, lse -inf
            zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            ZR: gl.constexpr = 2 * BMc if NWG == 2 else BMc   # rows a store (a power of two)
            cols = gl.arange(0, DP, layout=gl.SliceLayout(0, zl))
            for i in gl.static_range(NWG * BMc // ZR):
                rows = q_start + i * ZR + gl.arange(0, ZR, layout=gl.SliceLayout(1, zl))
                gl.store(o_base + rows.to(gl.int64)[:, None] * stride_om + cols[None, :],
                         gl.zeros([ZR, DP], O.dtype.element_ty, zl),
                         mask=(rows < Tq)[:, None] & (cols < D)[None, :])
                if STORE_LSE:
                    gl.store(lse_row0 + rows.to(gl.int64) * stride_lm,
                             gl.full([ZR], -float("inf"), gl.float32, gl.SliceLayout(1, zl)), mask=rows < Tq)
            return
        q_desc = tma.make_tensor_descriptor(Q + qs.to(gl.int64) * stride_qm + h.to(gl.int64) * stride_qh,
                                            shape=[Tq, D], strides=[stride_qm, 1], block_shape=[BMc, DP], layout=LQ)
        k_desc = tma.make_tensor_descriptor(K + ks.to(gl.int64) * stride_km + hk.to(gl.int64) * stride_kh,
                                            shape=[Tk, D], strides=[stride_km, 1], block_shape=[BN, DP], layout=LKV)
        v_desc = tma.make_tensor_descriptor(V + ks.to(gl.int64) * stride_vm + hk.to(gl.int64) * stride_vh,
                                            shape=[Tk, D], strides=[stride_vm, 1], block_shape=[BN, DP], layout=LKV)
        o_desc = tma.make_tensor_descriptor(o_base, shape=[Tq, D], strides=[stride_om, 1], block_shape=[BMc, DP],
                                            layout=LQ)

        # the descriptors are the sequence's own: rows count from its start (q_row0 = q_start, kv_row0 = 0)
        w = _work(q_start, 0, n_tiles, qk_scale, Tq, Tk, b, h, hk, q_start, lse_row0, stride_lm)
        _partitions(Descs(q_desc, k_desc, v_desc, o_desc), w, STAGES, CAUSAL, SCHEDULE, 2, CAUSAL, STORE_LSE, NWG)
