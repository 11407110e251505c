"""The host side of attention's Gluon FA3 kernel (:mod:`.gluon`): its TMA descriptors (their geometry kept by
a launch plan, made over each launch's tensors) and its dense, persistent and packed launches."""
import functools

import torch
import triton

from tritune import kernels as K
from tritune.kernels.attention import gluon as G


def flat_ok(q, k, v, out, BN: int, rows: int = G.ROWS) -> bool:
    """The 2-D (B*H*T, D) descriptors apply: every tensor contiguous, no tile crossing a head."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    return (all(t.is_contiguous() for t in (q, k, v, out)) and Tq % rows == 0 and Tk % BN == 0
            and D == triton.next_power_of_2(D))


def descriptor_makers(q, k, v, out, BN: int, rank: int | None = None, rows: int = G.ROWS) -> tuple:
    """(makers of the q, k, v, o descriptors, rank, grid) for (B, H, T, D) tensors TMA can read, CTAs of
    ``rows`` query rows: ``rank`` 2 (the flat form over (B*H*T, D), where :func:`flat_ok`), 4 (over the
    tensors' own strides), or None: 2 where it applies. The geometry depends only on the tensors' metadata: a
    launch plan keeps the makers (kernels.DescriptorMaker), and each launch makes the four descriptors over its
    own tensors."""
    B, H, Tq, D = q.shape
    Dp = triton.next_power_of_2(D)
    dt = G.gl.bfloat16 if q.dtype == torch.bfloat16 else G.gl.float16
    rank = rank or (2 if flat_ok(q, k, v, out, BN, rows) else 4)
    if rank == 2:   # the base is the tensor itself (contiguous): the flat view's address and dtype
        lq, lkv = _layout((G.BM, D), dt), _layout((BN, D), dt)
        makers = tuple(K.DescriptorMaker(G.GluonDescriptor, [t.numel() // D, D], [D, 1], [rows, D], lay)
                       for t, rows, lay in ((q, G.BM, lq), (k, BN, lkv), (v, BN, lkv), (out, G.BM, lq)))
    else:
        lq, lkv = _layout((1, 1, G.BM, Dp), dt), _layout((1, 1, BN, Dp), dt)
        makers = tuple(K.DescriptorMaker(G.GluonDescriptor, t.shape, t.stride(), [1, 1, rows, Dp], lay)
                       for t, rows, lay in ((q, G.BM, lq), (k, BN, lkv), (v, BN, lkv), (out, G.BM, lq)))
    return makers, rank, (triton.cdiv(Tq, rows), B * H)


def descriptors(q, k, v, out, BN: int, rank: int | None = None, rows: int = G.ROWS) -> tuple:
    """(q, k, v, o descriptors, rank, grid): :func:`descriptor_makers` applied to these tensors."""
    makers, rank, grid = descriptor_makers(q, k, v, out, BN, rank, rows)
    return tuple(m(t) for m, t in zip(makers, (q, k, v, out))), rank, grid


def launch(q, k, v, out, *, causal: bool, qk_scale: float, BN: int, stages: int, schedule: int,
           persistent: bool = False, rows: int = G.ROWS, lse=None, cache: dict | None = None) -> None:
    """Write attention(q, k, v) into ``out`` (all (B, H, T, D), TMA-readable, checked by the caller), and each
    row's log-sum-exp into ``lse`` (B, H, Tq) float32 if given. ``qk_scale``: the softmax scale times log2(e),
    positive. ``persistent``: the persistent form (4-D descriptors, a CTA per SM over the work items).
    ``rows``: query rows a CTA, 128 (two consumer warpgroups) or 192 (three).
    ``cache``: a launch plan's dict (the same shapes, strides, dtypes and arguments every call): it keeps the
    descriptors' geometry and, for direct launches (kernels.launch_cached), the compiled kernel."""
    st = cache.get("dense") if cache is not None else None
    if st is None:
        nwg = _nwg(rows)
        makers, rank, grid = descriptor_makers(q, k, v, out, BN, 4 if persistent else None, rows)
        kws = dict(STORE_LSE=lse is not None, STAGES=stages, CAUSAL=causal, SCHEDULE=schedule, NWG=nwg, num_warps=4,
                   maxnreg=G.MAXNREG[nwg])
        if persistent:   # one CTA per SM, at most one per work item; the batch size after the lse strides
            fn, grid, tail = G.fa3_fwd_persistent, (max(1, min(grid[0] * grid[1], K.num_sms())),), (q.shape[0],)
        else:
            fn, tail = G.fa3_fwd, ()
            kws["RANK"] = rank
        st = (fn, makers, grid, (qk_scale, q.shape[2], k.shape[2], q.shape[1], k.shape[1]),
              (lse.stride() if lse is not None else (0, 0, 0)) + tail, kws,
              tuple(kws[c] for c in K.constexpr_params(fn)), {} if K.DIRECT_LAUNCH else None)
        if cache is not None:
            cache["dense"] = st
    fn, makers, grid, scalars, ls, kws, consts, kernels = st
    lse_arg = out if lse is None else lse
    args = (makers[0](q), makers[1](k), makers[2](v), makers[3](out), *scalars, lse_arg, *ls)
    K.launch_cached(fn, kernels, grid, args, kws, consts, 0, (lse_arg,))


def _nwg(rows: int) -> int:
    """Consumer warpgroups of a CTA of ``rows`` query rows."""
    if rows not in (2 * G.BM, 3 * G.BM):
        raise ValueError(f"rows: the Gluon kernel's CTAs take {2 * G.BM} or {3 * G.BM} query rows, not {rows}")
    return rows // G.BM


@functools.lru_cache(maxsize=None)
def _layout(block: tuple, dtype):
    """The shared-memory layout of a TMA tile (made once per shape and dtype, not per launch)."""
    return G.gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def varlen_layouts(dtype, D: int, BN: int) -> tuple:
    """(D padded to a power of two, Q/O tile layout, K/V tile layout) of the packed kernel's descriptors."""
    Dp = triton.next_power_of_2(D)
    return Dp, _layout((G.BM, Dp), dtype), _layout((BN, Dp), dtype)


def launch_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, causal: bool, qk_scale: float,
                  BN: int, stages: int, schedule: int, rows: int = G.ROWS, lse=None, cache: dict | None = None) -> None:
    """Write attention_varlen(q, k, v, ...) into ``out`` (q, out (total_q, H, D), k, v (total_k, H_KV, D), unit
    stride along D, 16-byte aligned bases and strides: checked by the caller, as is the allocator the device
    descriptors need), and each row's log-sum-exp into ``lse`` (total_q, H) float32 if given. ``qk_scale``: the
    softmax scale times log2(e), positive. ``rows``, ``cache``: as :func:`launch`'s."""
    st = cache.get("varlen") if cache is not None else None
    if st is None:
        total_q, H, D = q.shape
        total_k, H_KV, _ = k.shape
        Dp, lq, lkv = varlen_layouts(G.gl.bfloat16 if q.dtype == torch.bfloat16 else G.gl.float16, D, BN)
        ls = (lse.stride(1), lse.stride(0)) if lse is not None else (0, 0)   # (per head, per row)
        nwg = _nwg(rows)
        grid = (triton.cdiv(max_seqlen_q, rows), (cu_seqlens_q.shape[0] - 1) * H)
        kws = dict(D=D, DP=Dp, BN=BN, LQ=lq, LKV=lkv, STAGES=stages, CAUSAL=causal, SCHEDULE=schedule,
                   STORE_LSE=lse is not None, NWG=nwg, num_warps=4, maxnreg=G.MAXNREG[nwg])
        tail = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
                out.stride(1), qk_scale, total_q, total_k, H, H_KV)
        st = (grid, tail, ls, kws, tuple(kws[c] for c in K.constexpr_params(G.fa3_fwd_varlen)),
              {} if K.DIRECT_LAUNCH else None)
        if cache is not None:
            cache["varlen"] = st
    grid, tail, ls, kws, consts, kernels = st
    lse_arg = out if lse is None else lse
    args = (q, k, v, out, cu_seqlens_q, cu_seqlens_k, *tail, lse_arg, *ls)
    K.launch_cached(G.fa3_fwd_varlen, kernels, grid, args, kws, consts, 0,
                    (q, k, v, out, cu_seqlens_q, cu_seqlens_k, lse_arg))
