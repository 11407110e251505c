"""FP8 prefill attention's FlashAttention-3-structured Hopper path, in Gluon (sm90 only): ``fp8_attention``
runs it for its configs ``IMPL="gluon"``. The structure is attention's Gluon kernel (kernels/attention/gluon.py),
in e4m3:

One CTA owns 128 query rows of one (batch, head) as **two consumer warpgroups of 64 rows**, each in its own
``gl.warp_specialize`` partition; a **one-warp producer** TMA-loads each warpgroup's Q once and K, V tiles into a
``STAGES``-deep ring (K and V on separate barriers; a slot is freed when both consumers finished its P @ V).
``SCHEDULE`` orders a consumer's GEMMs as attention's: 0 ("ahead"), QK^T of tile j+1 issued before the softmax
of tile j; 1 ("intra_wg"), QK^T of j+1 and P_j @ V_j issued together, the softmax of j+1 under P_j @ V_j; 2
("pingpong"), 1 with the warpgroups taking turns to issue (one mbarrier each). Causal: heaviest query tiles
first, keys past the CTA's last diagonal never loaded; query i sees key j when j <= i + Tk - Tq (Tq <= Tk).

FP8 (FA3's recipe, and the Triton kernel's arithmetic, which the float64 reference reproduces): Q·K^T on e4m3 Q
and K (both K-major: D contiguous); base-2 scores scaled by q_descale · k_descale · scale · log2 e; the running
row maximum m rounded up to an integer; P = 2^(s − m + 8) in float32, its top entries in (2^7, 2^8], rounded to
e4m3 for P @ V, the denominator summing P before rounding; each tile's P @ V into a zeroed accumulator, added to
O in float32 (FP8 wgmma keeps its accumulator to ~14 significant bits: chained over every key tile, O drifted
toward zero); V's descale and 1 / l applied to the finished row. Hopper's FP8 wgmma takes B K-major only: V comes
as its token-contiguous copy, a (B, Hkv, D, Tk) tensor whose (D, BN) tiles are permuted into the (BN, D) K-major
operand; P is wgmma's register A operand (the e4m3 dot-operand layout, k_width 4: the layout change from the
accumulator is Triton's). O leaves through a bf16/fp16 shared buffer a warpgroup and a TMA store (clipped at Tq).
Descriptors are 4-D over the tensors' own strides (TMA zero-fills rows past T on loads).
"""
import functools

import torch
import triton

from tritune import kernels as K
from tritune.kernels.runtime import device as dev

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

BM = 64            # query rows a consumer warpgroup
ROWS = 2 * BM      # query rows a CTA (two consumer warpgroups)
MAXNREG = 168      # the launch's register cap; the consumers' setmaxnreg 240, the producer's 24


def smem_bytes(D: int, BN: int, stages: int, out_bytes: int = 2) -> int:
    """Both warpgroups' e4m3 Q, their O staging buffers, and a K and a V tile every stage."""
    return ROWS * D * (1 + out_bytes) + 2 * stages * BN * D + 1024   # + barriers, alignment


if AVAILABLE:
    @aggregate
    class Descs:
        """The TMA descriptors of Q, K, V^T (the token-contiguous V) and O."""
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
        """A CTA's shared memory: each warpgroup's Q and O buffers, the K/V ring; and its barriers: Q landed (one
        a warpgroup), K and V landed and the slot free again (one each a slot), the ping-pong turns."""
        q_smem: gl.shared_memory_descriptor
        o_smem: gl.shared_memory_descriptor
        k_bufs: gl.shared_memory_descriptor
        v_bufs: gl.shared_memory_descriptor
        q_bar: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        sched: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, q_smem, o_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, empty, sched):
            self.q_smem = q_smem
            self.o_smem = o_smem
            self.k_bufs = k_bufs
            self.v_bufs = v_bufs
            self.q_bar = q_bar
            self.k_ready = k_ready
            self.v_ready = v_ready
            self.empty = empty
            self.sched = sched

    @aggregate
    class Work:
        """A CTA's query tile: batch, head, kv head, first query row, the key tiles to stream, the lengths, the
        descaled softmax scale (base 2) and V's descale."""
        b: gl.tensor
        h: gl.tensor
        hk: gl.tensor
        q_start: gl.tensor
        n_tiles: gl.tensor
        Tq: gl.tensor
        Tk: gl.tensor
        qk_scale: gl.tensor
        v_descale: gl.tensor

        @gluon.constexpr_function
        def __init__(self, b, h, hk, q_start, n_tiles, Tq, Tk, qk_scale, v_descale):
            self.b = b
            self.h = h
            self.hk = hk
            self.q_start = q_start
            self.n_tiles = n_tiles
            self.Tq = Tq
            self.Tk = Tk
            self.qk_scale = qk_scale
            self.v_descale = v_descale

    @gluon.jit
    def _tile(buf):
        """The 2-D view of a (1, 1, rows, cols) TMA tile."""
        return buf.reshape([buf.type.shape[2], buf.type.shape[3]])

    @gluon.jit
    def _loader(d, r, w):
        """The producer (one warp): both warpgroups' Q once, then K and V^T tiles into the ring."""
        STAGES: gl.constexpr = r.k_bufs.type.shape[0]
        BMc: gl.constexpr = r.q_smem.type.shape[3]
        BN: gl.constexpr = r.k_bufs.type.shape[3]
        for i in gl.static_range(2):
            mbarrier.expect(r.q_bar.index(i), d.q.block_type.nbytes)
            tma.async_copy_global_to_shared(d.q, [w.b, w.h, w.q_start + i * BMc, 0], r.q_bar.index(i),
                                            r.q_smem.index(i))
        for j in range(w.n_tiles):
            s = j % STAGES
            mbarrier.wait(r.empty.index(s), ((j // STAGES) & 1) ^ 1)   # both consumers done with the slot
            mbarrier.expect(r.k_ready.index(s), d.k.block_type.nbytes)
            tma.async_copy_global_to_shared(d.k, [w.b, w.hk, j * BN, 0], r.k_ready.index(s), r.k_bufs.index(s))
            mbarrier.expect(r.v_ready.index(s), d.v.block_type.nbytes)
            tma.async_copy_global_to_shared(d.v, [w.b, w.hk, 0, j * BN], r.v_ready.index(s), r.v_bufs.index(s))

    @gluon.jit
    def _softmax(S, j, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
                 o_layout: gl.constexpr):
        """Online softmax of score tile j (raw q·k) with the integer running maximum: keys past Tk masked, and
        when causal those past each row's diagonal. Every row sees key 0 (Tq <= Tk), so m is finite from the
        first tile on. Returns (P in e4m3 as wgmma's register A operand, the rescale in the output's row
        layout, m, l)."""
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
        # an integer maximum: every rescale is a power of two, and P's rounding does not depend on BLOCK_N
        m_new = gl.maximum(m_i, gl.ceil(gl.max(S, axis=1) * qk_scale))
        # P = 2^(s - m + 8) in (0, 256]: e4m3's range, FA3's fixed scale (references/fp8_attention.P_OFFSET)
        p = gl.exp2(S * qk_scale - (m_new - 8.0)[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(gl.float8e4nv), gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                                          k_width=4))
        return p_op, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_new, l_i

    @gluon.jit
    def _attend(q, r, n_tiles, qk_scale, q_first, Tk, offset, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr,
                WG: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
        """One consumer warpgroup's 64 query rows (``q``) against the ring's key tiles 0 .. n_tiles - 1, in GEMM
        order ``SCHEDULE`` (module doc). Returns (acc after the last P @ V, l).

        Each P_j @ V_j runs into a zeroed accumulator and is added to ``acc`` in float32 (acc = acc · alpha_j +
        P_j V_j), as the Triton kernel does: Hopper's FP8 wgmma keeps its accumulator to ~14 significant bits,
        truncated, so chaining acc through the MMA over every key tile biased O toward zero by ~2^-15 a k-step
        (-0.3% at 4k keys, -1.1% at 16k in an emulation: the tuner's wrong answers)."""
        STAGES: gl.constexpr = r.k_bufs.type.shape[0]
        D: gl.constexpr = r.k_bufs.type.shape[4]
        BN: gl.constexpr = r.k_bufs.type.shape[3]
        BMc: gl.constexpr = q.type.shape[0]
        m_i = gl.full([BMc], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BMc], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BMc, D], gl.float32, o_layout)
        o0 = gl.zeros([BMc, D], gl.float32, o_layout)
        s0 = gl.zeros([BMc, BN], gl.float32, s_layout)

        mbarrier.wait(r.k_ready.index(0), 0)
        S = warpgroup_mma(q, _tile(r.k_bufs.index(0)).permute((1, 0)), s0, use_acc=False, is_async=True)
        S = warpgroup_mma_wait(num_outstanding=0, deps=(S,))
        if SCHEDULE == 0:
            for j in range(n_tiles - 1):
                n = j + 1
                mbarrier.wait(r.k_ready.index(n % STAGES), (n // STAGES) & 1)
                S_next = warpgroup_mma(q, _tile(r.k_bufs.index(n % STAGES)).permute((1, 0)), s0, use_acc=False,
                                       is_async=True)
                p_op, alpha, m_i, l_i = _softmax(S, j, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL, s_layout,
                                                 o_layout)
                mbarrier.wait(r.v_ready.index(j % STAGES), (j // STAGES) & 1)
                pv = warpgroup_mma(p_op, _tile(r.v_bufs.index(j % STAGES)).permute((1, 0)), o0, use_acc=False,
                                   is_async=True)
                S_next, pv = warpgroup_mma_wait(num_outstanding=0, deps=(S_next, pv))
                mbarrier.arrive(r.empty.index(j % STAGES), count=1)
                acc = acc * alpha[:, None] + pv
                S = S_next
            p_op, alpha, m_i, l_i = _softmax(S, n_tiles - 1, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL,
                                             s_layout, o_layout)
        else:
            p_op, alpha, m_i, l_i = _softmax(S, 0, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL, s_layout,
                                             o_layout)
            for j in range(n_tiles - 1):
                n = j + 1
                mbarrier.wait(r.k_ready.index(n % STAGES), (n // STAGES) & 1)
                mbarrier.wait(r.v_ready.index(j % STAGES), (j // STAGES) & 1)
                if SCHEDULE == 2:   # this warpgroup's turn to issue, round robin (the first warpgroup's first is free)
                    mbarrier.wait(r.sched.index(WG), (j & 1) ^ (1 if WG == 0 else 0))
                S_next = warpgroup_mma(q, _tile(r.k_bufs.index(n % STAGES)).permute((1, 0)), s0, use_acc=False,
                                       is_async=True)
                pv = warpgroup_mma(p_op, _tile(r.v_bufs.index(j % STAGES)).permute((1, 0)), o0, use_acc=False,
                                   is_async=True)
                if SCHEDULE == 2:
                    mbarrier.arrive(r.sched.index(1 - WG), count=1)
                S_next = warpgroup_mma_wait(num_outstanding=1, deps=(S_next,))   # QK^T done, P_j @ V_j running
                p_op, alpha_n, m_i, l_i = _softmax(S_next, n, m_i, l_i, qk_scale, q_first, Tk, offset, CAUSAL,
                                                   s_layout, o_layout)
                pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
                mbarrier.arrive(r.empty.index(j % STAGES), count=1)
                acc = acc * alpha[:, None] + pv   # tile j's rescale, then its product (both at tile j's max)
                alpha = alpha_n
        c = n_tiles - 1
        mbarrier.wait(r.v_ready.index(c % STAGES), (c // STAGES) & 1)
        pv = warpgroup_mma(p_op, _tile(r.v_bufs.index(c % STAGES)).permute((1, 0)), o0, use_acc=False,
                           is_async=True)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
        mbarrier.arrive(r.empty.index(c % STAGES), count=1)
        acc = acc * alpha[:, None] + pv
        return acc, l_i

    @gluon.jit
    def _consumer(d, r, w, CAUSAL: gl.constexpr, SCHEDULE: gl.constexpr, WG: gl.constexpr):
        """One consumer warpgroup: 64 query rows against every K/V tile of the ring, then O = acc · v_descale / l
        through its O buffer and a TMA store (rows past Tq clipped)."""
        BMc: gl.constexpr = r.q_smem.type.shape[3]
        D: gl.constexpr = r.k_bufs.type.shape[4]
        BN: gl.constexpr = r.k_bufs.type.shape[3]
        # FP8 wgmma: K = 32 an instruction
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BN, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 32])
        q_first = w.q_start + WG * BMc   # this warpgroup's first query row
        q = _tile(r.q_smem.index(WG))
        mbarrier.wait(r.q_bar.index(WG), 0)
        acc, l_i = _attend(q, r, w.n_tiles, w.qk_scale, q_first, w.Tk, w.Tk - w.Tq, CAUSAL, SCHEDULE, WG, s_layout,
                           o_layout)
        scale = w.v_descale / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o_buf = r.o_smem.index(WG)
        _tile(o_buf).store((acc * scale[:, None]).to(o_buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(d.o, [w.b, w.h, q_first, 0], o_buf)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _barriers(N: gl.constexpr, COUNT: gl.constexpr):
        """N mbarriers, each completing after COUNT arrivals."""
        bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N):
            mbarrier.init(bars.index(i), count=COUNT)
        return bars

    @gluon.jit
    def fp8_fa3_fwd(q_desc, k_desc, v_desc, o_desc, QD, KD, VD, s_qdb, s_qdh, s_kdb, s_kdh, s_vdb, s_vdh,
                    sm_scale_log2, Tq, Tk, H, H_KV, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    SCHEDULE: gl.constexpr, num_warps: gl.constexpr):
        """A CTA a (query tile of 128 rows, batch-head): q/k (B, H, T, D) e4m3, v^T (B, H_KV, D, Tk) e4m3
        (token-contiguous), o (B, H, Tq, D) bf16/fp16; descales float32 at QD/KD/VD + b·s_*db + kv head·s_*dh."""
        gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
        BN: gl.constexpr = k_desc.block_type.shape[2]
        ROWS_C: gl.constexpr = 2 * q_desc.block_type.shape[2]
        pid_m = gl.program_id(0)
        bh = gl.program_id(1)
        if CAUSAL:   # the longest rows first
            pid_m = gl.num_programs(0) - 1 - pid_m
        b = bh // H
        h = bh % H
        hk = h // (H // H_KV)
        q_start = pid_m * ROWS_C
        if CAUSAL:
            n_tiles = gl.cdiv(gl.minimum(Tk, q_start + ROWS_C + Tk - Tq), BN)
        else:
            n_tiles = gl.cdiv(Tk, BN)
        qk_scale = sm_scale_log2 * gl.load(QD + b * s_qdb + hk * s_qdh) * gl.load(KD + b * s_kdb + hk * s_kdh)
        v_descale = gl.load(VD + b * s_vdb + hk * s_vdh)
        w = Work(gl.to_tensor(b), gl.to_tensor(h), gl.to_tensor(hk), gl.to_tensor(q_start), gl.to_tensor(n_tiles),
                 gl.to_tensor(Tq), gl.to_tensor(Tk), gl.to_tensor(qk_scale), gl.to_tensor(v_descale))

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        r = Ring(q_smem, o_smem, k_bufs, v_bufs, _barriers(2, 1), _barriers(STAGES, 1), _barriers(STAGES, 1),
                 _barriers(STAGES, 2), _barriers(2, 1))
        d = Descs(q_desc, k_desc, v_desc, o_desc)
        gl.warp_specialize([
            (_consumer, (d, r, w, CAUSAL, SCHEDULE, 0)),
            (_consumer, (d, r, w, CAUSAL, SCHEDULE, 1)),
            (_loader, (d, r, w)),
        ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------------
# The host side: where it runs, which calls it takes, the token-contiguous V, the descriptors and the launch
def runs_here() -> bool:
    """Gluon present and an sm90 GPU to run it (never the interpreter: Gluon does not run there)."""
    return AVAILABLE and dev.hopper()


@functools.lru_cache(maxsize=None)
def smem_limit() -> int:
    """This device's shared memory per block (opt-in)."""
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


def tma_strides_ok(*tensors) -> bool:
    """TMA reads each tensor: unit last stride, every other stride positive and a multiple of 16 bytes."""
    return all(t.stride(-1) == 1 and all(s > 0 and (s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])
               for t in tensors)


def v_major(v):
    """V (B, H, T, D) as the (B, H, D, T) view of a token-contiguous tensor TMA reads: V itself where it is one
    (the "v_t" layout, T's rows 16-byte aligned), else a copy whose rows are padded to 16 bytes (TMA zero-fills
    tokens past T, so the padding is never read as keys)."""
    vt = v.transpose(2, 3)
    if tma_strides_ok(vt) and K.aligned(vt):
        return vt
    B, H, D, T = vt.shape
    buf = torch.empty(B, H, D, triton.cdiv(T, 16) * 16, dtype=v.dtype, device=v.device)
    buf[..., :T].copy_(vt)
    return buf[..., :T]


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, torch_dtype):
    """The shared-memory layout of a TMA tile (made once per shape and dtype, not per launch)."""
    dt = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[torch_dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), dt)


def _state(q, k, vt, out, BN: int, stages: int, causal: bool, schedule: int) -> tuple:
    """(descriptor makers of q, k, v^T, o, grid, launch keywords, constexprs, compiled kernels) of one geometry."""
    B, H, Tq, D = q.shape
    blocks = ((q, [1, 1, BM, D]), (k, [1, 1, BN, D]), (vt, [1, 1, D, BN]), (out, [1, 1, BM, D]))
    makers = tuple(K.DescriptorMaker(GluonDescriptor, t.shape, t.stride(), blk, _layout(tuple(blk), t.dtype))
                   for t, blk in blocks)
    kws = dict(STAGES=stages, CAUSAL=causal, SCHEDULE=schedule, num_warps=4, maxnreg=MAXNREG)
    return (makers, (triton.cdiv(Tq, ROWS), B * H), kws, tuple(kws[c] for c in K.constexpr_params(fp8_fa3_fwd)),
            {} if K.DIRECT_LAUNCH and q.is_cuda else None)


def launch(q, k, v, out, descales, *, causal: bool, sm_scale_log2: float, BN: int, stages: int, schedule: int,
           cache: dict) -> None:
    """Write fp8_attention(q, k, v, ...) into ``out``: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) e4m3 and out
    (B, Hq, Tq, D) bf16/fp16, q/k/out TMA-readable and 16-byte aligned, Tq <= Tk when causal (checked by the
    caller); ``descales``: three (float32 tensor, batch stride, kv-head stride). ``cache``: the launch plan's
    dict (descriptor geometry and compiled kernels, per layout of V^T)."""
    vt = v_major(v)
    st = cache.get(vt.stride())
    if st is None:
        st = cache[vt.stride()] = _state(q, k, vt, out, BN, stages, causal, schedule)
    makers, grid, kws, consts, kernels = st
    (qd, *qs), (kd, *ks), (vd, *vs) = descales
    args = (makers[0](q), makers[1](k), makers[2](vt), makers[3](out), qd, kd, vd, *qs, *ks, *vs, sm_scale_log2,
            q.shape[2], k.shape[2], q.shape[1], k.shape[1])
    K.launch_cached(fp8_fa3_fwd, kernels, grid, args, kws, consts, 0, (qd, kd, vd))
