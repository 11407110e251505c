"""The FP8 GEMM's warp-specialized Hopper kernel, written in Gluon (sm90 only): DeepGEMM's structure with the
promotion's wait overlapped.

``fp8_gemm`` runs it for its configs ``IMPL="gluon"`` (``PERSISTENT=1``: one CTA per SM over the output tiles),
tuned like every other point of its space; it computes what ``fp8_gemm``'s Triton kernels compute, in the same
fp32 operations: each K tile's product fresh (``use_acc=False``) and added into an fp32 accumulator (times
the tile's 128x128 block scale for block-scaled B), then ``_fp8_epilogue``'s math (row or tensor A scale,
tensor or channel B scale, bias, GELU (tanh), residual), stored in the output's dtype.

Why Gluon: Triton keeps a wgmma in flight only when its result feeds the next dot's accumulator, so each
promoted K tile ends in ``wgmma.wait_group 0`` (docs/findings.md). Here a consumer warpgroup holds two
fresh-product register sets and alternates between them (the loop is unrolled by two, so neither set is
copied while its wgmma runs): tile k+1's wgmma is issued before tile k's is waited on with
``warpgroup_mma_wait(1)``, and tile k's product is scaled and added while tile k+1's runs.

One CTA computes ``NWG`` x 64 rows x ``BN`` (64 or 128) columns: ``NWG`` (1 or 2) consumer warpgroups of 64
rows, each in its own ``gl.warp_specialize`` partition (its accumulator and two products: 1.5 x BN fp32
registers a thread), and a one-warp producer that TMA-loads every warpgroup's A tile (64 x 128) and the
shared B tile (BN x 128, B being K-major (N, K)) into a ``STAGES``-deep ring; a slot is released when every
consumer's wgmma on it has completed. A and B must be K-major with 16-byte aligned bases and rows (the
launcher checks; out-of-bounds parts of a box read as zeros, so M, N and K need no multiple). The epilogue
runs in the wgmma's register layout, its row and channel scales loaded before the tile's K loop; it writes the
tile into the warpgroup's shared output tile and stores it by TMA, which runs on under the next tile's K loop
(the box clips the edges), where the output takes TMA (16-bit, unit column stride, 16-byte aligned base and
rows); any other output, and the residual, go through masked stores and loads. Stored from registers with
masks, the epilogue cost ~3.8 µs a tile at 8192x4096 with nothing overlapping it (docs/findings.md). The CTAs take
their tiles grouped by GROUP_M along M; the persistent form (grid = SMs) walks the tiles with a stride of
the grid, its ring's slot and phase running on across tiles, so the producer loads the next tile while the
consumers finish the last one.

Not taken (``fp8_gemm``'s constraint refuses them for IMPL="gluon"): BLOCK_K other than 128, tiles other than
those above (a 64 x 256 warpgroup tile needs 384 registers for its accumulator and two products), and at
128 x 128 the epilogue of bias, GELU and residual together (it spills beside two warpgroups: sm90 SASS,
triton 3.6). Operands that are not K-major or not 16-byte aligned take the Triton kernel with the same config.
"""
import functools

import torch

from tritune import kernels as K

try:  # Gluon is triton's; a build without it (or without its Hopper module) has no such path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    try:   # public from triton 3.8; triton's own Gluon kernels reach it here before that
        from triton.experimental.gluon import aggregate
    except ImportError:
        from triton.language.core import _aggregate as aggregate
    AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means: not available here
    AVAILABLE = False

WG_ROWS = 64       # rows a consumer warpgroup (one wgmma M)
TILE_K = 128       # K a ring slot: one 128x128 scale block of B, four k32 wgmmas
TILES_N = (64, 128)
# the launch's register cap (the register file over the CTA's warpgroups, the producer warp's padded to one)
# and the workers' setmaxnreg, by consumer warpgroups: two 240 / 24 (one CTA an SM); one: two CTAs an SM
MAXNREG = {1: 128, 2: 168}
WORKER_REGS = {1: [24], 2: [240, 24]}


def smem_bytes(block_m: int, block_n: int, stages: int) -> int:
    """The ring (an A and a B tile of 128 e4m3 columns a stage), the output tile the TMA store reads (16-bit
    values) and the barriers."""
    return stages * (block_m + block_n) * TILE_K + block_m * block_n * 2 + 1024


if AVAILABLE:
    @aggregate
    class Ring:
        """A CTA's shared memory: every consumer's A tile (slot s, warpgroup w at s * NWG + w) and the B tile of
        each stage; a stage's barriers: landed (the producer's TMA) and free again (every consumer done); each
        consumer's output tile (warpgroup w at w), which its TMA store reads."""
        a_bufs: gl.shared_memory_descriptor
        b_bufs: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        c_bufs: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, a_bufs, b_bufs, ready, empty, c_bufs):
            self.a_bufs = a_bufs
            self.b_bufs = b_bufs
            self.ready = ready
            self.empty = empty
            self.c_bufs = c_bufs

    @aggregate
    class Gemm:
        """The call: extents, the output, scale, bias and residual pointers and their strides."""
        M: gl.tensor
        N: gl.tensor
        KD: gl.tensor
        C: gl.tensor
        SA: gl.tensor
        SB: gl.tensor
        BIAS: gl.tensor
        RES: gl.tensor
        s_cm: gl.tensor
        s_cn: gl.tensor
        s_rm: gl.tensor
        s_rn: gl.tensor
        s_sbk: gl.tensor
        s_sbn: gl.tensor

        @gluon.constexpr_function
        def __init__(self, M, N, KD, C, SA, SB, BIAS, RES, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn):
            self.M = M
            self.N = N
            self.KD = KD
            self.C = C
            self.SA = SA
            self.SB = SB
            self.BIAS = BIAS
            self.RES = RES
            self.s_cm = s_cm
            self.s_cn = s_cn
            self.s_rm = s_rm
            self.s_rn = s_rn
            self.s_sbk = s_sbk
            self.s_sbn = s_sbn

    @gluon.jit
    def _gemm(M, N, KD, C, SA, SB, BIAS, RES, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn):
        """A :class:`Gemm` of these values, each a tensor: triton specializes an integer argument equal to 1
        (a unit stride) to a constant, and the partitions take every field as an argument either way."""
        return Gemm(gl.to_tensor(M), gl.to_tensor(N), gl.to_tensor(KD), gl.to_tensor(C), gl.to_tensor(SA),
                    gl.to_tensor(SB), gl.to_tensor(BIAS), gl.to_tensor(RES), gl.to_tensor(s_cm), gl.to_tensor(s_cn),
                    gl.to_tensor(s_rm), gl.to_tensor(s_rn), gl.to_tensor(s_sbk), gl.to_tensor(s_sbn))

    @gluon.jit
    def _tile_origin(t, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """Output tile ``t`` -> its first row and column, tiles grouped GROUP_M at a time along M (as the
        Triton kernels order their programs)."""
        num_pid_m = gl.cdiv(M, BM)
        num_pid_n = gl.cdiv(N, BN)
        group = GROUP_M * num_pid_n
        first_m = (t // group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (t % group) % size_m
        pid_n = (t % group) // size_m
        return pid_m * BM, pid_n * BN

    @gluon.jit
    def _producer(a_desc, b_desc, r, g, GROUP_M: gl.constexpr):
        """One warp: for each of the CTA's tiles, every consumer's A tile and the B tile of each K step into
        the ring, a slot once every consumer released it."""
        STAGES: gl.constexpr = r.b_bufs.type.shape[0]
        NWG: gl.constexpr = r.a_bufs.type.shape[0] // STAGES
        BMW: gl.constexpr = r.a_bufs.type.shape[1]
        BN: gl.constexpr = r.b_bufs.type.shape[1]
        BK: gl.constexpr = r.b_bufs.type.shape[2]
        n_k = gl.cdiv(g.KD, BK)
        n_tiles = gl.cdiv(g.M, NWG * BMW) * gl.cdiv(g.N, BN)
        nbytes: gl.constexpr = NWG * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        it = 0   # K steps loaded so far (the ring's running position)
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            m0, n0 = _tile_origin(t, g.M, g.N, NWG * BMW, BN, GROUP_M)
            for k in range(n_k):
                s = it % STAGES
                mbarrier.wait(r.empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(r.ready.index(s), nbytes)   # a box's bytes count whole, zero-filled parts too
                for w in gl.static_range(NWG):
                    tma.async_copy_global_to_shared(a_desc, [m0 + w * BMW, k * BK], r.ready.index(s),
                                                    r.a_bufs.index(s * NWG + w))
                tma.async_copy_global_to_shared(b_desc, [n0, k * BK], r.ready.index(s), r.b_bufs.index(s))
                it += 1

    @gluon.jit
    def _issue(r, c, WG: gl.constexpr, p):
        """Wait for ring position ``c`` to land and issue its fresh product into the registers of ``p``
        (``use_acc=False``: their values are not read), asynchronously."""
        STAGES: gl.constexpr = r.b_bufs.type.shape[0]
        NWG: gl.constexpr = r.a_bufs.type.shape[0] // STAGES
        s = c % STAGES
        mbarrier.wait(r.ready.index(s), (c // STAGES) & 1)
        return warpgroup_mma(r.a_bufs.index(s * NWG + WG), r.b_bufs.index(s).permute((1, 0)), p, use_acc=False,
                             is_async=True)

    @gluon.jit
    def _block_scale(g, k, n0, B_MODE: gl.constexpr, BK: gl.constexpr, SBLOCK: gl.constexpr):
        """The B scale of K step ``k`` for the tile's columns: one SBLOCK x SBLOCK block (a BK-deep K step and a
        tile of at most SBLOCK columns lie in one block); 1.0 (unused) for the other scale modes."""
        if B_MODE == 2:
            return gl.load(g.SB + ((k * BK) // SBLOCK) * g.s_sbk + (n0 // SBLOCK) * g.s_sbn)
        else:
            return 1.0

    @gluon.jit
    def _promote(acc, p, sb, B_MODE: gl.constexpr):
        """The promotion: a K step's fresh product into the fp32 accumulator (times its block scale, fused as the
        Triton kernel's ``acc += part * sb`` is). Written as inline PTX with side effects, so LLVM keeps it
        between the wait for ``p`` and the next wgmma issued into ``p``'s registers: sunk past that issue, it
        makes the old product outlive its registers, and the copies read a wgmma's registers in flight, which
        ptxas answers by serializing every wgmma (C7514)."""
        if B_MODE == 2:
            return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [p, sb, acc],
                                             dtype=gl.float32, is_pure=False, pack=1)
        else:
            return gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [p, acc], dtype=gl.float32,
                                             is_pure=False, pack=1)

    @gluon.jit
    def _mainloop(r, g, it, n0, WG: gl.constexpr, B_MODE: gl.constexpr, SBLOCK: gl.constexpr,
                  layout: gl.constexpr):
        """One consumer warpgroup's 64 x BN accumulator over the K steps at ring positions it, it + 1, ...:
        products alternate between the register sets ``pa`` (even steps) and ``pb`` (odd steps), step k+1's
        wgmma issued before step k's is waited on (``warpgroup_mma_wait(1)``) and promoted."""
        STAGES: gl.constexpr = r.b_bufs.type.shape[0]
        BMW: gl.constexpr = r.a_bufs.type.shape[1]
        BN: gl.constexpr = r.b_bufs.type.shape[1]
        BK: gl.constexpr = r.b_bufs.type.shape[2]
        n_k = gl.cdiv(g.KD, BK)
        acc = gl.zeros([BMW, BN], gl.float32, layout)
        pb = gl.zeros([BMW, BN], gl.float32, layout)
        pa = _issue(r, it, WG, gl.zeros([BMW, BN], gl.float32, layout))
        sa = _block_scale(g, 0, n0, B_MODE, BK, SBLOCK)
        sb = sa
        for j in range(1, n_k - 1, 2):   # steps j (pb) and j + 1 (pa), both before the last
            c = it + j
            pb = _issue(r, c, WG, pb)
            sb = _block_scale(g, j, n0, B_MODE, BK, SBLOCK)
            pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))   # step j - 1 done, step j running
            mbarrier.arrive(r.empty.index((c - 1) % STAGES), count=1)
            acc = _promote(acc, pa, sa, B_MODE)
            pa = _issue(r, c + 1, WG, pa)
            sa = _block_scale(g, j + 1, n0, B_MODE, BK, SBLOCK)
            pb = warpgroup_mma_wait(num_outstanding=1, deps=(pb,))   # step j done, step j + 1 running
            mbarrier.arrive(r.empty.index(c % STAGES), count=1)
            acc = _promote(acc, pb, sb, B_MODE)
        last = it + n_k - 1   # pa holds the step before the last (n_k even) or the last (n_k odd)
        if n_k % 2 == 0:   # (new names in the branches: pa stays the in-flight product it came in as)
            qb = _issue(r, last, WG, pb)
            s_last = _block_scale(g, n_k - 1, n0, B_MODE, BK, SBLOCK)
            qa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
            mbarrier.arrive(r.empty.index((last - 1) % STAGES), count=1)
            acc = _promote(acc, qa, sa, B_MODE)
            qb = warpgroup_mma_wait(num_outstanding=0, deps=(qb,))
            mbarrier.arrive(r.empty.index(last % STAGES), count=1)
            acc = _promote(acc, qb, s_last, B_MODE)
        else:
            qa = warpgroup_mma_wait(num_outstanding=0, deps=(pa,))
            mbarrier.arrive(r.empty.index(last % STAGES), count=1)
            acc = _promote(acc, qa, sa, B_MODE)
        return acc

    @gluon.jit
    def _scales(g, m0, n0, BMW: gl.constexpr, BN: gl.constexpr, A_ROW: gl.constexpr, B_MODE: gl.constexpr):
        """A warpgroup tile's A and B scales, loaded before its K loop so that their latency hides behind it: row
        and channel scales one value a thread (``flat``), not the wgmma layout's BN / 4 columns a thread; the
        epilogue moves them into that layout. 1.0 where the mode has no such scale (block scales: the loop's)."""
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        if A_ROW:
            rows = m0 + gl.arange(0, BMW, layout=flat)
            sa = gl.load(g.SA + rows, mask=rows < g.M, other=0.0)
        else:
            sa = gl.load(g.SA)
        if B_MODE == 0:
            sb = gl.load(g.SB)
        elif B_MODE == 1:
            cols = n0 + gl.arange(0, BN, layout=flat)
            sb = gl.load(g.SB + cols, mask=cols < g.N, other=0.0)
        else:
            sb = 1.0
        return sa, sb

    @gluon.jit
    def _epilogue(acc, g, r, c_desc, sa, sb, m0, n0, WG: gl.constexpr, A_ROW: gl.constexpr, B_MODE: gl.constexpr,
                  HAS_BIAS: gl.constexpr, GELU: gl.constexpr, HAS_RES: gl.constexpr, TMA_OUT: gl.constexpr,
                  layout: gl.constexpr):
        """``fp8_gemm._fp8_epilogue``'s math on a warpgroup's tile, in the wgmma's register layout: the A and B
        scales (``sa``, ``sb`` from :func:`_scales`), bias, GELU (tanh, as x·sigmoid(2z)), residual; in the
        output's dtype, stored by TMA from the warpgroup's shared tile (``TMA_OUT``: the store runs on while the
        next tile's K loop does; its box clips the edges) or by masked stores."""
        BMW: gl.constexpr = acc.type.shape[0]
        BN: gl.constexpr = acc.type.shape[1]
        offs_m = m0 + gl.arange(0, BMW, layout=gl.SliceLayout(1, layout))
        offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        mask_m = offs_m < g.M
        mask_n = offs_n < g.N
        if A_ROW:
            acc *= gl.convert_layout(sa, gl.SliceLayout(1, layout))[:, None]
        else:
            acc *= sa
        if B_MODE == 0:
            acc *= sb
        elif B_MODE == 1:
            acc *= gl.convert_layout(sb, gl.SliceLayout(0, layout))[None, :]
        if HAS_BIAS:
            acc += gl.load(g.BIAS + offs_n, mask=mask_n, other=0.0).to(gl.float32)[None, :]
        if GELU:
            z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = acc / (1.0 + gl.exp(-2.0 * z))
        mask = mask_m[:, None] & mask_n[None, :]
        if HAS_RES:
            acc += gl.load(g.RES + offs_m[:, None].to(gl.int64) * g.s_rm + offs_n[None, :] * g.s_rn, mask=mask,
                           other=0.0).to(gl.float32)
        if TMA_OUT:
            c_buf = r.c_bufs.index(WG)
            tma.store_wait(0)      # the last tile's store has read the buffer (it was issued by this warpgroup)
            gl.thread_barrier()
            c_buf.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [m0, n0], c_buf)
        else:
            gl.store(g.C + offs_m[:, None].to(gl.int64) * g.s_cm + offs_n[None, :] * g.s_cn,
                     acc.to(g.C.dtype.element_ty), mask=mask)

    @gluon.jit
    def _consumer(r, g, c_desc, WG: gl.constexpr, A_ROW: gl.constexpr, B_MODE: gl.constexpr,
                  HAS_BIAS: gl.constexpr, GELU: gl.constexpr, HAS_RES: gl.constexpr, TMA_OUT: gl.constexpr,
                  GROUP_M: gl.constexpr, SBLOCK: gl.constexpr):
        """One consumer warpgroup: rows WG*64 .. WG*64+63 of each of the CTA's tiles."""
        STAGES: gl.constexpr = r.b_bufs.type.shape[0]
        NWG: gl.constexpr = r.a_bufs.type.shape[0] // STAGES
        BMW: gl.constexpr = r.a_bufs.type.shape[1]
        BN: gl.constexpr = r.b_bufs.type.shape[1]
        BK: gl.constexpr = r.b_bufs.type.shape[2]
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BN, 32])
        n_k = gl.cdiv(g.KD, BK)
        n_tiles = gl.cdiv(g.M, NWG * BMW) * gl.cdiv(g.N, BN)
        it = 0   # K steps consumed so far
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            m0, n0 = _tile_origin(t, g.M, g.N, NWG * BMW, BN, GROUP_M)
            sa, sb = _scales(g, m0 + WG * BMW, n0, BMW, BN, A_ROW, B_MODE)
            acc = _mainloop(r, g, it, n0, WG, B_MODE, SBLOCK, layout)
            _epilogue(acc, g, r, c_desc, sa, sb, m0 + WG * BMW, n0, WG, A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES,
                      TMA_OUT, layout)
            it += n_k
        if TMA_OUT:
            tma.store_wait(0)

    @gluon.jit
    def _barriers(N: gl.constexpr, COUNT: gl.constexpr):
        """N mbarriers, each completing after COUNT arrivals."""
        bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N):
            mbarrier.init(bars.index(i), count=COUNT)
        return bars

    @gluon.jit
    def fp8_gemm_ws(a_desc, b_desc, c_desc, C, SA, SB, BIAS, RES, M, N, KD, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn,
                    A_ROW: gl.constexpr, B_MODE: gl.constexpr, HAS_BIAS: gl.constexpr, GELU: gl.constexpr,
                    HAS_RES: gl.constexpr, TMA_OUT: gl.constexpr, GROUP_M: gl.constexpr, SBLOCK: gl.constexpr,
                    STAGES: gl.constexpr, NWG: gl.constexpr, num_warps: gl.constexpr):
        """C = epilogue(sum over K steps of (A tile @ B tile) [x block scale]): ``a_desc`` over A (M, K) in
        (64, 128) boxes, ``b_desc`` over B's (N, K) view in (BN, 128) boxes, ``c_desc`` over C in (64, BN)
        boxes (``TMA_OUT``; else unused); a CTA per output tile, or fewer CTAs each walking the tiles (the
        persistent grid)."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * NWG] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        if TMA_OUT:
            c_bufs = gl.allocate_shared_memory(c_desc.dtype, [NWG] + c_desc.block_type.shape, c_desc.layout)
        else:
            c_bufs = a_bufs   # not read
        r = Ring(a_bufs, b_bufs, _barriers(STAGES, 1), _barriers(STAGES, NWG), c_bufs)
        g = _gemm(M, N, KD, C, SA, SB, BIAS, RES, s_cm, s_cn, s_rm, s_rn, s_sbk, s_sbn)
        if NWG == 2:
            gl.warp_specialize([
                (_consumer, (r, g, c_desc, 0, A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES, TMA_OUT, GROUP_M, SBLOCK)),
                (_consumer, (r, g, c_desc, 1, A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES, TMA_OUT, GROUP_M, SBLOCK)),
                (_producer, (a_desc, b_desc, r, g, GROUP_M)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (r, g, c_desc, 0, A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES, TMA_OUT, GROUP_M, SBLOCK)),
                (_producer, (a_desc, b_desc, r, g, GROUP_M)),
            ], [1], [24])


_OUT_TYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype: str = "float8e4nv"):
    """The shared-memory layout of a TMA tile (made once per shape and dtype, not per launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, dtype))


def descriptor_makers(a, b, block_n: int) -> tuple:
    """Makers of A's (M, K) descriptor in (64, 128) boxes and of B's (N, K) view's in (block_n, 128) boxes, for
    K-major operands (``a`` row-major, ``b`` the (K, N) transpose of a row-major (N, K)); a launch plan keeps
    them and each launch makes the two descriptors over its own tensors."""
    bt = b.t()
    return (K.DescriptorMaker(GluonDescriptor, a.shape, a.stride(), [WG_ROWS, TILE_K], _layout((WG_ROWS, TILE_K))),
            K.DescriptorMaker(GluonDescriptor, bt.shape, bt.stride(), [block_n, TILE_K], _layout((block_n, TILE_K))))


def stores_by_tma(out) -> bool:
    """The output's geometry a TMA store takes: 16-bit values, unit column stride, 16-byte aligned rows (its base
    is checked at each launch)."""
    return (out.dtype in _OUT_TYPES and out.stride(1) == 1 and out.stride(0) * out.element_size() % 16 == 0
            and out.shape[0] > 0 and out.shape[1] > 0)


def takes(a, b) -> bool:
    """The operands this kernel reads: both K-major, rows 16-byte aligned, K > 0 (bases: :func:`launch`)."""
    return (a.shape[1] > 0 and a.stride(1) == 1 and b.stride(0) == 1 and a.stride(0) % 16 == 0
            and b.stride(1) % 16 == 0)


def _launch_state(a, b, out, kws: dict, block_m: int, block_n: int, stages: int, persistent: bool, tma_out: bool):
    """A plan's launch state for one output path: descriptor makers (A, B, and C's (64, block_n) boxes where
    ``tma_out``), grid, launch keywords, constexpr values and the compiled-kernel cache."""
    m, n = a.shape[0], b.shape[1]
    nwg = block_m // WG_ROWS
    tiles = K.cdiv(m, block_m) * K.cdiv(n, block_n)
    # persistent: as many CTAs as fit on the GPU at once (one warpgroup's CTAs: two an SM, registers and
    # shared memory allowing)
    per_sm = 2 if nwg == 1 and smem_bytes(block_m, block_n, stages) <= 113 * 1024 else 1
    grid = (min(tiles, per_sm * K.num_sms()) if persistent else tiles,)
    ck = dict(A_ROW=kws["A_ROW"], B_MODE=kws["B_MODE"], HAS_BIAS=kws["HAS_BIAS"], GELU=kws["GELU"],
              HAS_RES=kws["HAS_RES"], TMA_OUT=tma_out, GROUP_M=kws["GROUP_M"], SBLOCK=kws["SBLOCK"], STAGES=stages,
              NWG=nwg, num_warps=4)
    makers = descriptor_makers(a, b, block_n)
    if tma_out:
        makers += (K.DescriptorMaker(GluonDescriptor, out.shape, out.stride(), [WG_ROWS, block_n],
                                     _layout((WG_ROWS, block_n), _OUT_TYPES[out.dtype])),)
    return (makers, grid, dict(ck, maxnreg=MAXNREG[nwg]), tuple(ck[c] for c in K.constexpr_params(fp8_gemm_ws)),
            {} if K.DIRECT_LAUNCH else None)


def launch(a, b, out, a_scale, b_scale, bias, residual, *, kws: dict, block_m: int, block_n: int, stages: int,
           persistent: bool, sbs: tuple, cache: dict) -> None:
    """Write fp8_gemm(a, b, ...) into ``out`` with the Gluon kernel: ``a`` (M, K) and ``b`` (K, N) e4m3 that
    :func:`takes`, 16-byte aligned bases (checked by the caller); ``kws``: the Triton kernel's epilogue and
    grouping constexprs (A_ROW, B_MODE, HAS_BIAS, GELU, HAS_RES, GROUP_M, SBLOCK); ``sbs``: the block scales'
    strides ((0, 0) otherwise). ``cache``: a launch plan's dict (same shapes, strides and arguments every call):
    each output path's launch state (a TMA store where the output takes one, masked stores otherwise)."""
    tma_out = cache.get("tma_geometry")
    if tma_out is None:
        tma_out = cache["tma_geometry"] = stores_by_tma(out)
    tma_out = tma_out and out.data_ptr() % 16 == 0
    st = cache.get(tma_out)
    if st is None:
        st = cache[tma_out] = _launch_state(a, b, out, kws, block_m, block_n, stages, persistent, tma_out)
    makers, grid, launch_kws, consts, kernels = st
    res = residual if residual is not None else out
    bias_arg = bias if bias is not None else out
    a_d, b_d = makers[0](a), makers[1](b.t())
    args = (a_d, b_d, makers[2](out) if tma_out else a_d, out, a_scale, b_scale, bias_arg, res, a.shape[0],
            b.shape[1], a.shape[1], out.stride(0), out.stride(1), res.stride(0), res.stride(1), *sbs)
    K.launch_cached(fp8_gemm_ws, kernels, grid, args, launch_kws, consts, 0, (out, a_scale, b_scale, bias_arg, res))
