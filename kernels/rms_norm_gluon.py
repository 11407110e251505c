"""RMSNorm of long rows (N > 16384, 2-byte dtypes, no residual) in Gluon: each row read from HBM once, held in
shared memory between its two passes. ``rms_norm`` runs it for its configs ``gluon=1`` on CUDA GPUs of compute
capability 9 or more (never the interpreter: Gluon does not run there).

The Triton kernel's looped form reads a row twice (sum of squares, then normalise): at N = 65536 (128 KiB of
bf16 a row) the second read comes from L2 or HBM, and the kernel stays near 87% of the copy bandwidth. Here:

- a persistent grid (a CTA per SM, at most one per row): program ``pid`` takes rows pid, pid + G, ...;
- a row is CHUNK-element chunks (``BLOCK_N`` of the config: 4096, 8192 or 16384), each TMA-loaded into a slot
  of a shared-memory ring of SLOTS chunks (as many as the device's shared memory holds, at least a row's), each
  slot with its own mbarrier. The chunks of the program's rows form one stream: item c (row c // nch, chunk
  c % nch) lives in slot c % SLOTS and its load completes phase (c // SLOTS) & 1 of that slot's barrier;
- phase 1 waits for each chunk of the row, reads it from shared memory and accumulates the float32 squares;
  rstd = rsqrt(sum / N + eps);
- phase 2 reads each chunk again from shared memory, y = x * rstd (* w, the weight read from global memory /
  L2 a chunk ahead), stored with plain coalesced stores; once every thread has read the chunk (a CTA barrier)
  the slot is refilled with stream item c + SLOTS: the next rows' loads are in flight while this row is written.

The math is ``_rms_norm_fwd``'s looped form with BLOCK_N = CHUNK: squares summed elementwise across the chunks in
float32, then over the chunk; y = (x * rstd) * w in float32, rounded once to the output dtype.

TMA: x is an (M, N) view with a unit last stride, its row stride and base 16-byte aligned; a [1, CHUNK] box (the
lowering splits it into TMA boxes of at most 256 elements); columns past N read as zeros (a box's bytes count
whole on the barrier, zero-filled parts too). y: unit last stride (any row stride).
"""
import functools

import torch
import triton

from tritune import kernels as K
from tritune.kernels.runtime import device as dev

try:  # Gluon is triton's; a build without it (or without its Hopper module) has no such path
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means: not available here
    AVAILABLE = False

CHUNKS = (4096, 8192, 16384)     # a ring slot's elements (the config's BLOCK_N)
WARPS = (4, 8, 16)
MIN_N = 16385                    # rows up to 16384 take the Triton kernel's one pass
DTYPES = (torch.bfloat16, torch.float16)
SMEM_RESERVE = 4096              # beside the ring: its barriers, the reduction's scratch


if AVAILABLE:
    @gluon.jit
    def _issue(x_desc, ring, bars, c, pid, G, nch):
        """TMA-load stream item ``c`` (row pid + (c // nch) * G, chunk c % nch) into slot c % SLOTS."""
        SLOTS: gl.constexpr = ring.type.shape[0]
        CHUNK: gl.constexpr = x_desc.block_type.shape[1]
        s = c % SLOTS
        mbarrier.expect(bars.index(s), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [pid + (c // nch) * G, (c % nch) * CHUNK], bars.index(s),
                                        ring.index(s))

    @gluon.jit
    def _chunk(ring, bars, c, layout: gl.constexpr):
        """Stream item ``c`` from its slot (landed: its barrier's phase waited on), in float32."""
        SLOTS: gl.constexpr = ring.type.shape[0]
        s = c % SLOTS
        mbarrier.wait(bars.index(s), (c // SLOTS) & 1)
        return ring.index(s).load(layout).to(gl.float32)

    @gluon.jit
    def rms_norm_ring(x_desc, W, Y, M, N, stride_ym, eps, HAS_W: gl.constexpr, SLOTS: gl.constexpr,
                      num_warps: gl.constexpr):
        """y = x * rsqrt(mean(x^2) + eps) (* w) over the rows of ``x_desc`` ((M, N), [1, CHUNK] boxes) into Y
        (unit column stride, row stride ``stride_ym``); a grid of at most M programs."""
        CHUNK: gl.constexpr = x_desc.block_type.shape[1]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, num_warps], [1, 0])   # 16 bytes a lane
        ring = gl.allocate_shared_memory(x_desc.dtype, [SLOTS, 1, CHUNK], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(SLOTS):
            mbarrier.init(bars.index(i), count=1)
        pid = gl.program_id(0)
        G = gl.num_programs(0)
        nch = gl.cdiv(N, CHUNK)
        n_rows = gl.cdiv(M - pid, G)
        total = n_rows * nch   # stream items of this program
        for c in range(gl.minimum(total, SLOTS)):
            _issue(x_desc, ring, bars, c, pid, G, nch)
        offs = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        c0 = 0
        for r in range(n_rows):
            if HAS_W:   # the weight's first chunk, requested now: its latency (L2) passes under phase 1
                w = gl.load(W + offs, mask=offs < N, other=0.0, eviction_policy="evict_last")
            acc = gl.zeros([1, CHUNK], gl.float32, layout)
            for j in range(nch):
                x = _chunk(ring, bars, c0 + j, layout)
                acc += x * x
            rstd = gl.rsqrt(gl.sum(gl.sum(acc, axis=1), axis=0) / N + eps)
            rows_y = Y + (pid + r * G).to(gl.int64) * stride_ym
            for j in range(nch):
                cols = j * CHUNK + offs
                if HAS_W:   # the next chunk's weight, requested a chunk ahead (past N: masked, no traffic)
                    w_next = gl.load(W + CHUNK + cols, mask=cols + CHUNK < N, other=0.0, eviction_policy="evict_last")
                c = c0 + j
                x = _chunk(ring, bars, c, layout)   # landed: phase 1 waited on it (a completed phase waits no more)
                gl.thread_barrier()   # every thread has read slot c % SLOTS: refill it with stream item c + SLOTS
                if c + SLOTS < total:
                    _issue(x_desc, ring, bars, c + SLOTS, pid, G, nch)
                y = x * rstd
                if HAS_W:
                    y = y * w.to(gl.float32)[None, :]
                    w = w_next
                gl.store(rows_y + cols[None, :], y.to(Y.dtype.element_ty), mask=(cols < N)[None, :],
                         eviction_policy="evict_first")
            c0 += nch
        for i in gl.static_range(SLOTS):
            mbarrier.invalidate(bars.index(i))


# ---------------------------------------------------------------------------------------------------
# The host side: where it runs, what it takes, the descriptor and the launch
def runs_here() -> bool:
    """Gluon present and a CUDA GPU of compute capability 9 or more to run it (never the interpreter)."""
    return AVAILABLE and not dev.interpreted() and torch.cuda.is_available() and _capable(None)


def runs_on(device) -> bool:
    """:func:`runs_here`, and ``device`` (a torch.device) is such a GPU."""
    return runs_here() and device.type == "cuda" and _capable(device.index)


@functools.lru_cache(maxsize=None)
def _capable(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def smem_limit(index: int | None = None) -> int:
    """Shared memory a block may use on device ``index`` (None: the current one), opt-in, bytes."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024)


def slots(chunk: int, elem_bytes: int = 2, index: int | None = None) -> int:
    """Ring slots of ``chunk`` elements that the device's shared memory holds (beside SMEM_RESERVE)."""
    return (smem_limit(index) - SMEM_RESERVE) // (chunk * elem_bytes)


def problem_refusal(N: int, dtype, residual: bool, chunk: int, index: int | None = None) -> str | None:
    """Why the kernel does not take rows of ``N`` elements of ``dtype`` in ``chunk``-element slots on device
    ``index`` (None: it does, where :func:`runs_on` holds)."""
    if dtype not in DTYPES:
        return "gluon=1: bf16 and fp16 only"
    if residual:
        return "gluon=1: no residual (the fused add takes the Triton kernel)"
    if N < MIN_N:
        return f"gluon=1: rows longer than {MIN_N - 1} only (shorter ones take the Triton kernel's one pass)"
    if triton.cdiv(N, chunk) > slots(chunk, 2, index):
        return f"gluon=1: a row of {N} exceeds the shared-memory ring ({slots(chunk, 2, index)} x {chunk})"
    return None


def strides_ok(N: int, x_strides, y_strides, elem_bytes: int) -> bool:
    """x's (M, N) view TMA reads (unit last stride, rows that do not overlap, 16 bytes apart a multiple) and y's
    (M, N) view with a unit last stride (bases: :func:`aligned`, checked each launch)."""
    return (x_strides[1] == 1 and x_strides[0] >= N and (x_strides[0] * elem_bytes) % 16 == 0
            and y_strides[1] == 1)


def aligned(x2) -> bool:
    """x's base 16-byte aligned (TMA's rule: the one condition of a tensor, not of a launch plan)."""
    return x2.data_ptr() % 16 == 0


@functools.lru_cache(maxsize=None)
def _layout(chunk: int, torch_dtype):
    """The ring's shared layout: unswizzled rows (a [1, chunk] box; the loads read 16 contiguous bytes a lane)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=torch.finfo(torch_dtype).bits, rank=2)


def launch(x2, weight, y2, eps: float, *, chunk: int, num_warps: int, cache: dict) -> None:
    """Write rms_norm(x2, weight, eps) into ``y2``: x2 and y2 (M, N) whose strides :func:`strides_ok` takes, x2's
    base :func:`aligned` (checked by the caller), ``weight`` (N,) contiguous or None. ``cache``: the launch plan's
    dict (the same shapes, strides, dtypes and arguments every call): the descriptor's geometry, the grid
    (a program per SM, at most one per row), the compiled kernels."""
    st = cache.get("gluon")
    if st is None:
        M, N = x2.shape
        maker = K.DescriptorMaker(GluonDescriptor, [M, N], [x2.stride(0), 1], [1, chunk], _layout(chunk, x2.dtype))
        kws = dict(HAS_W=weight is not None, SLOTS=slots(chunk, x2.element_size(), x2.device.index),
                   num_warps=num_warps)
        st = (maker, (min(M, K.num_sms()),), kws, tuple(kws[c] for c in K.constexpr_params(rms_norm_ring)),
              {} if K.DIRECT_LAUNCH else None)
        cache["gluon"] = st
    maker, grid, kws, consts, kernels = st
    w = weight if weight is not None else y2
    args = (maker(x2), w, y2, x2.shape[0], x2.shape[1], y2.stride(0), eps)
    K.launch_cached(rms_norm_ring, kernels, grid, args, kws, consts, 0, (w, y2))
