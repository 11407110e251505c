"""The ``attention`` spec: attention over (B, H, T, D) tensors, its launcher, vendor path and peers.

The launcher checks the call, plans it once per metadata signature (:mod:`.launch`) and runs the Triton
kernel (:mod:`.triton_fwd`) or, for an ``IMPL="gluon"`` config on an sm90 GPU, the Gluon FA3 kernel
(:mod:`.gluon`); a call the Gluon kernel does not take (a scale <= 0, a layout or base TMA cannot read, a
dense call without keys, the interpreter) runs the Triton kernel with the default config instead.
"""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tritune import kernels as K
from tritune.kernels.attention import gluon_launch as GL
from tritune.kernels.attention import launch as L
from tritune.kernels.attention import peers
from tritune.kernels.attention.problem import (DTYPES, Problem, bucket, check_qkv, check_scale,  # noqa: F401
                                               check_window, cost, make_inputs, problems)
from tritune.kernels.attention.space import SPACE, default_config, gluon_seeds
# the jitted code the spec launches, held by name: the store's staleness hash reads the jitted functions of
# the spec's module (store.module_hash)
from tritune.kernels.attention.triton_fwd import (attn_fwd, attn_inner, attn_inner_ahead, dot,  # noqa: F401
                                                  load_kv, softmax_step)
from tritune.references import attention as ref


def problem_of(q, k, v, *, causal=False, window=None, **_) -> Problem:
    return Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], bool(causal), window)


PLANS = K.PlanCache()


def _dense_plan(q, k, v, causal, scale, return_lse, out, config, window=None) -> L.Plan:
    """Every metadata check (errors name the argument), then the launch plan."""
    Hq, Hkv, D = check_qkv(q, k, v, 4)
    B, _, Tq, _ = q.shape
    _, _, Tk, _ = k.shape
    if k.shape[0] != B:
        raise ValueError(f"k: batch {k.shape[0]} does not match q's {B}")
    check_scale(scale)
    win = check_window(window, causal)
    shape = (B, Hq, Tq, D)
    if out is not None:
        K.check_out(out, shape, q.dtype, q.device)
    if B * Hq * Tq == 0:
        return L.Plan(out_shape=shape)
    # a fresh out / lse is contiguous: its strides follow from its shape
    out_strides = out.stride() if out is not None else (Hq * Tq * D, Tq * D, D, 1)
    lse_strides = (Hq * Tq, Tq, 1) if return_lse else (0, 0, 0)
    d_contig = q.stride(-1) == k.stride(-1) == v.stride(-1) == out_strides[-1] == 1
    tma_ok = L.tma_strides_ok(q.element_size(), q.stride(), k.stride(), v.stride(), out_strides)
    # and no empty dimension: a descriptor's shape must be positive (Tk = 0: no keys, every row outputs 0)
    host_ok = (all(x > 0 for st in (q.stride(), k.stride(), v.stride(), out_strides) for x in st[:-1])
               and min(B, Hq, Hkv, Tq, Tk) > 0)
    plan = L.plan(SPEC, Problem(B, Hq, Hkv, Tq, Tk, D, bool(causal)), config, q.dtype, scale, d_contig,
                  False, bool(return_lse), tma_ok, host_ok, win)
    for pl in (plan, plan.fallback) if plan.fallback is not None else (plan,):
        pl.out_shape = shape
        pl.strides = (*q.stride(), *k.stride(), *v.stride(), *out_strides, *lse_strides)
        L.host_caches(pl, q)
        if pl.meta.get("TMA") == 2:   # descriptors over the 4-D tensors: their bounds zero-fill and clip
            bm, bn, bd = pl.meta["BLOCK_M"], pl.meta["BLOCK_N"], pl.meta["BLOCK_D"]
            pl.descs = tuple(K.DescriptorMaker(TensorDescriptor, shp, st, [1, 1, rows, bd])
                             for shp, st, rows in ((q.shape, q.stride(), bm), (k.shape, k.stride(), bn),
                                                   (v.shape, v.stride(), bn), (shape, out_strides, bm)))
    return plan


def attention(q, k, v, *, causal: bool = False, scale=None, return_lse: bool = False, out=None,
              config: dict | None = None, window: int | None = None):
    """Attention over (B, H, T, D) tensors of any strides. Returns out (B, Hq, Tq, D) in q's dtype, or
    (out, lse) with lse (B, Hq, Tq) float32, the natural log of each row's softmax denominator.

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D) with Hq a multiple of Hkv; D in HEAD_DIMS (32 to 256);
    fp16, bf16 or fp32. ``scale`` defaults to 1/sqrt(D). ``causal``: query i sees keys j <= i + Tk − Tq.
    ``out`` may be any strided view of the right shape (e.g. a (B, T, H, D) buffer transposed).
    ``window`` (with ``causal``): local attention, query i sees only keys i + Tk − Tq − window < j.
    """
    # The checks, the config and the launch parameters depend only on metadata: computed once per
    # signature. A GPT-2 prefill runs ~50 µs; the uncached host path (checks, config validation) cost
    # ~30 µs more on the host, enough to leave the GPU idle between launches.
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device,
               None if out is None else (out.shape, out.stride(), out.dtype, out.device),
               causal, scale, type(scale), return_lse, None if config is None else tuple(config.items()),
               K.precision_key(q.dtype), window, type(window))
    except (AttributeError, TypeError):  # not tensors: the checks will say
        key = None
    plan = PLANS.get_or_make(key, lambda: _dense_plan(q, k, v, causal, scale, return_lse, out, config, window))
    if out is None:
        out = torch.empty(plan.out_shape, dtype=q.dtype, device=q.device)
    else:
        K.check_no_alias(out, (("q", q), ("k", k), ("v", v)))
    lse = torch.empty(plan.out_shape[:3], dtype=torch.float32, device=q.device) if return_lse else None
    if plan.gluon is not None:
        if K.aligned(q, k, v, out):
            GL.launch(q, k, v, out, lse=lse, cache=plan.gluon_cache, **plan.gluon)
            return (out, lse) if return_lse else out
        plan = plan.fallback   # a base TMA cannot read (e.g. a view one element in)
    L.launch_triton(plan, q, k, v, out, lse, q, q)
    return (out, lse) if return_lse else out



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
def bad_inputs(device):
    """Calls of ``attention`` that must raise, with the error they must raise."""
    q = torch.randn(1, 4, 8, 32, device=device)
    k = torch.randn(1, 2, 8, 32, device=device)
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
    ]


# what both specs share (their problems both answer B, Hq, Hkv, Tq, Tk, D, causal)
COMMON = dict(
    space=SPACE,
    bucket=bucket,
    cost=cost,
    dtypes=DTYPES,
    accumulation=K.fp32_accumulation,  # fp32 dots follow torch.get_float32_matmul_precision()
    seeds=gluon_seeds,
)

_GPT2 = [Problem(b, 12, 12, t, t, 64, c) for (b, t) in ((8, 1024), (16, 1024), (1, 4096)) for c in (True, False)]
_LARGE = [Problem(b, 32, 32, t, t, 128, c) for (b, t) in ((4, 4096), (1, 16384)) for c in (True, False)]

SPEC = K.register(K.KernelSpec(
    name="attention",
    description="fused attention forward (prefill): online softmax, causal, GQA",
    run=attention,
    reference=ref.attention,
    default_config=default_config,
    make_inputs=make_inputs,
    problems=problems,
    problem_of=problem_of,
    standard_problems=_GPT2 + _LARGE + [Problem(4, 32, 8, 4096, 4096, 128, True)],
    small_problems=[Problem(2, 4, 2, 40, 40, 64, True), Problem(1, 2, 1, 17, 33, 80, False)],
    layouts=("contiguous", "bthd", "sliced", "transposed"),
    vendor=_vendor,
    vendor_name="sdpa (torch's default dispatch)",
    peers={"sdpa_flash": _sdpa_peer("FLASH_ATTENTION"), "sdpa_efficient": _sdpa_peer("EFFICIENT_ATTENTION"),
           "sdpa_cudnn": _sdpa_peer("CUDNN_ATTENTION"), "flex": _flex, "fa4": peers.fa4_dense},
    bad_inputs=bad_inputs,
    **COMMON,
))
