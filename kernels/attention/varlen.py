"""The ``attention_varlen`` spec: attention over packed variable-length sequences (``cu_seqlens``), its
launcher, the checks of the sequence offsets, and the vendor path.

The same kernels as dense attention (:mod:`.triton_fwd`, and :mod:`.gluon`'s packed kernel for an
``IMPL="gluon"`` config on an sm90 GPU), with per-sequence offsets read from cu_seqlens on the device.
"""
from __future__ import annotations

import torch

from tritune import kernels as K
from tritune.kernels.attention import gluon_launch as GL
from tritune.kernels.attention import launch as L
from tritune.kernels.attention import peers
from tritune.kernels.attention.dense import COMMON, bad_inputs as dense_bad_inputs
from tritune.kernels.attention.problem import (PackedProblem, VarlenProblem, check_qkv, check_scale, check_window,
                                               make_varlen_inputs, varlen_problems)
from tritune.kernels.attention.space import varlen_default_config
# the jitted code the spec launches, held by name: the store's staleness hash reads the jitted functions of
# the spec's module (store.module_hash)
from tritune.kernels.attention.triton_fwd import (attn_fwd, attn_inner, attn_inner_ahead, dot,  # noqa: F401
                                                  load_kv, softmax_step)
from tritune.references import attention as ref


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
CHECKED: dict = {}


def longest_cached(name, cu, total, always: bool) -> int:
    import weakref

    # An inference tensor (made under torch.inference_mode) has no version counter, so an in-place change
    # could not be seen: such a tensor is checked on every launch (pass validate=False to skip it).
    always = always or cu.is_inference()
    hit = None if always else CHECKED.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == cu._version and hit[2] == total:
        return hit[3]
    longest = _longest(name, cu, total)
    if not always:
        key = id(cu)
        if len(CHECKED) > 1024:
            CHECKED.clear()
        CHECKED[key] = (weakref.ref(cu, lambda _r, key=key: CHECKED.pop(key, None)), cu._version, total, longest)
    return longest


def varlen_problem_of(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, window=None,
                      **_):
    """The shape a launcher configures for: batch and longest lengths (no need to read cu_seqlens)."""
    return PackedProblem(cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], int(max_seqlen_q), int(max_seqlen_k),
                         q.shape[2], bool(causal), window)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal: bool = False,
                     scale=None, return_lse: bool = False, out=None, config: dict | None = None,
                     validate: bool | None = None, window: int | None = None):
    """Attention over packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D); sequence b owns rows
    cu_seqlens[b]:cu_seqlens[b+1] (int32, batch + 1 entries, from 0, non-decreasing). Empty sequences
    are allowed. Returns out (total_q, Hq, D), or (out, lse) with lse (total_q, Hq) float32.

    ``max_seqlen_q/k`` come from the caller and must bound the lengths: they size the grid, so the
    launch never reads cu_seqlens on the host. The values of cu_seqlens and those bounds are checked
    (ValueError naming the argument) according to ``validate``:
    None (default): the first time a cu_seqlens tensor is launched with (one device-to-host copy), not
    again while that tensor is unmodified; True: every launch; False: never (the engine's hot path).
    A CUDA-graph capture never checks. Unchecked bad values give wrong rows, but the kernel clamps every
    sequence to the packed tensors, so memory outside them is never touched. ``window`` (with ``causal``):
    local attention within each sequence, as :func:`attention`'s.
    """
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, cu_seqlens_q.shape, cu_seqlens_q.dtype, cu_seqlens_q.device,
               cu_seqlens_k.shape, cu_seqlens_k.dtype, cu_seqlens_k.device, max_seqlen_q, type(max_seqlen_q),
               max_seqlen_k, type(max_seqlen_k),
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               causal, scale, type(scale), return_lse, None if config is None else tuple(config.items()),
               K.precision_key(q.dtype), window, type(window))
    except (AttributeError, TypeError):  # not tensors: the checks will say
        key = None
    plan = VARLEN_PLANS.get_or_make(key, lambda: _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                               max_seqlen_k, causal, scale, return_lse, out, config,
                                                               window))
    if validate is not False and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        always = validate is True or not q.is_cuda  # on the CPU reading the values costs no sync
        if longest_cached("cu_seqlens_q", cu_seqlens_q, q.shape[0], always) > max_seqlen_q:
            raise ValueError(f"max_seqlen_q: {max_seqlen_q} is less than the longest query sequence "
                             f"{_longest('cu_seqlens_q', cu_seqlens_q, q.shape[0])}")
        if longest_cached("cu_seqlens_k", cu_seqlens_k, k.shape[0], always) > max_seqlen_k:
            raise ValueError(f"max_seqlen_k: {max_seqlen_k} is less than the longest key sequence "
                             f"{_longest('cu_seqlens_k', cu_seqlens_k, k.shape[0])}")
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                               ("cu_seqlens_k", cu_seqlens_k)))
    lse = torch.empty(plan.out_shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    if plan.gluon is not None:
        if K.aligned(q, k, v, out):
            L.ensure_allocator()   # the kernel makes its descriptors on the device
            GL.launch_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, lse=lse, cache=plan.gluon_cache,
                            **plan.gluon)
            return (out, lse) if return_lse else out
        plan = plan.fallback
    L.launch_triton(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    return (out, lse) if return_lse else out


VARLEN_PLANS = K.PlanCache()


def _varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, return_lse, out,
                 config, window=None) -> L.Plan:
    """Every metadata check of a packed launch (errors name the argument), then its plan."""
    Hq, Hkv, D = check_qkv(q, k, v, 3)
    check_scale(scale)
    win = check_window(window, causal)
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
        return L.Plan(out_shape=shape)
    out_strides = out.stride() if out is not None else (Hq * D, D, 1)
    lse_strides = (Hq, 1) if return_lse else (0, 0)
    problem = PackedProblem(B, Hq, Hkv, max_seqlen_q, max_seqlen_k, D, bool(causal))
    d_contig = q.stride(-1) == k.stride(-1) == v.stride(-1) == out_strides[-1] == 1
    tma_ok = L.tma_strides_ok(q.element_size(), q.stride(), k.stride(), v.stride(), out_strides)
    plan = L.plan(VARLEN_SPEC, problem, config, q.dtype, scale, d_contig, True, bool(return_lse), tma_ok,
                  window=win)
    for pl in (plan, plan.fallback) if plan.fallback is not None else (plan,):
        pl.out_shape = shape
        # packed tensors have no batch stride: the sequence offset comes from cu_seqlens
        pl.strides = (0, q.stride(1), q.stride(0), q.stride(2), 0, k.stride(1), k.stride(0), k.stride(2),
                      0, v.stride(1), v.stride(0), v.stride(2), 0, out_strides[1], out_strides[0], out_strides[2],
                      0, lse_strides[1], lse_strides[0])
        # the kernel clamps each sequence to the packed totals (passed where the dense launch passes Tq, Tk)
        if pl.scalars:   # the plain kernel's (a Gluon plan passes its own)
            pl.scalars = (pl.scalars[0], pl.scalars[1], total_q, total_k, *pl.scalars[4:])
        L.host_caches(pl, q)
    return plan




# ---------------------------------------------------------------------------------------------------
# The vendor path
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


# ---------------------------------------------------------------------------------------------------
def bad_inputs(device):
    """Calls of ``attention_varlen`` (and of ``attention``) that must raise, with the error they must raise."""
    qp, kp = torch.randn(10, 4, 32, device=device), torch.randn(12, 2, 32, device=device)
    i32 = torch.int32

    def cu(*vals):
        return torch.tensor(vals, dtype=i32, device=device)

    def va(**kw):
        a = dict(q=qp, k=kp, v=kp, cu_seqlens_q=cu(0, 4, 10), cu_seqlens_k=cu(0, 6, 12), max_seqlen_q=6,
                 max_seqlen_k=6)
        a.update(kw)
        return lambda: attention_varlen(**a)

    return dense_bad_inputs(device) + [
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


VARLEN_SPEC = K.register(K.KernelSpec(
    name="attention_varlen",
    description="fused attention forward over packed variable-length sequences",
    run=attention_varlen,
    reference=ref.attention_varlen,
    default_config=varlen_default_config,
    make_inputs=make_varlen_inputs,
    problems=varlen_problems,
    problem_of=varlen_problem_of,
    standard_problems=[VarlenProblem((1024, 37, 512, 2048, 1, 300, 880, 1000), (1024, 37, 512, 2048, 1, 300, 880, 1000),
                                     12, 12, 64, True)],
    small_problems=[VarlenProblem((5, 0, 17, 1), (5, 3, 17, 1), 4, 2, 64, True)],
    layouts=("contiguous", "sliced"),
    vendor=_varlen_vendor,
    vendor_name="torch.nn.attention.varlen.varlen_attn",
    peers={"fa4": peers.fa4_varlen},
    bad_inputs=bad_inputs,
    **COMMON,
))
