"""Attention's launch plans (shared by the dense and packed specs): a config turned into the Triton kernel's
constexprs and grid, or into the Gluon kernel's launch arguments with the Triton kernel's plan as its fallback;
the TMA checks, the descriptor allocator, and the launch of a plan.

Host time: a call's checks, config and launch arguments are planned once per metadata signature; after a
plan's first launch through triton the compiled kernel is called directly (``kernels.launch_cached``) and host
descriptors are copied from the plan's first (``kernels.DescriptorMaker``).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import triton

from tritune import kernels as K
from tritune.kernels.attention import space as SP
from tritune.kernels.attention.triton_fwd import attn_fwd

LOG2E = 1.4426950408889634

CONSTEXPRS = K.constexpr_params(attn_fwd)  # what a direct launch passes after the runtime arguments
GLUON_SCHEDULES = {"ahead": 0, "intra_wg": 1, "pingpong": 2}   # the Gluon kernel's SCHEDULE constexpr


@dataclass
class Plan:
    """What a launch needs beyond the tensors, computed once per metadata signature."""
    out_shape: tuple
    grid: tuple = ()                 # () when there is nothing to launch
    strides: tuple = ()              # q, k, v, out, lse (dense plans only)
    scalars: tuple = ()              # Hq, group, Tq, Tk, num_m_blocks, num_bh, qk_scale
    meta: dict = field(default_factory=dict)  # constexprs, num_warps, num_stages
    cfg: dict | None = None
    cfg_key: tuple | None = None     # the config-cache key a tuned/default config came from (K.PlanCache)
    meta_ptr: dict = field(default_factory=dict)  # meta on the pointer path (TMA refused by the addresses)
    gluon: dict | None = None        # the Gluon FA3 kernel's launch arguments (IMPL=gluon), else None
    fallback: "Plan | None" = None   # with gluon: the Triton kernel's plan (default config) for bases TMA refuses
    # host time: the constexprs of a direct launch (K.launch_cached) under meta / meta_ptr, the compiled
    # kernels it keeps (None: always through triton), TMA=2's descriptor makers (q, k, v, out), and the
    # Gluon launch's own cache (its descriptors' geometry and compiled kernels)
    consts: tuple = ()
    consts_ptr: tuple = ()
    kernels: dict | None = None
    descs: tuple = ()
    gluon_cache: dict | None = None


def triton_meta(cfg, p, dtype, scale: float, d_contig: bool, varlen: bool, store_lse: bool, tma_ok: bool,
                host_ok: bool, window: int = 0) -> dict:
    """The Triton kernel's constexprs (and num_warps, num_stages) for config ``cfg``; ``window``: the local
    attention window (0: none)."""
    sch = cfg["SCHEDULE"]
    return dict(D=p.D, VARLEN=varlen, CAUSAL=p.causal, STORE_LSE=store_lse, HEADS_INNER=bool(cfg["HEADS_INNER"]),
                D_CONTIG=d_contig, IEEE=dtype == torch.float32 and K.fp32_precision() == "ieee", NEG_SCALE=scale < 0,
                # TMA=2 (host-built descriptors over (B, H, T, D)) needs the dense layout: a packed batch's
                # sequences are no descriptor dimension, so varlen takes the per-program descriptors instead;
                # so does a broadcast (zero-stride) batch or head dim, which the 2-D per-program ones never see
                TMA=(cfg["TMA"] if host_ok else min(cfg["TMA"], 1)) if tma_ok else 0,
                # warp specialization splits off TMA producer warps: no TMA, no split
                SCHEDULE=sch if sch != "warp_specialized" or tma_ok else "pipelined",
                LAZY_RESCALE=bool(cfg["LAZY_RESCALE"]),
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=triton.next_power_of_2(p.D),
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], WINDOW=window)


def plan(spec, p, config, dtype, scale, d_contig: bool, varlen: bool, store_lse: bool,
         tma_ok: bool = False, host_ok: bool = False, window: int = 0) -> Plan:
    """Config, grid and launch parameters for problem ``p`` (B, Hq, Hkv, Tq, Tk, D, causal). ``tma_ok``:
    the strides allow TMA (see :func:`tma_strides_ok`); a config asking for TMA on a layout that does
    not allow it runs the pointer path (``meta_ptr``), as does a launch whose base pointers are not
    16-byte aligned (checked per launch: the plan is keyed on strides, not addresses). ``host_ok``: the
    4-D (B, H, T, D) views also suit host-built descriptors (dense, no zero stride); else TMA=2 runs TMA=1.
    ``window``: local attention (the Triton kernel only: an IMPL="gluon" config runs the default one)."""
    cfg = spec.config_for(p, dtype, config)
    if cfg["IMPL"] == "gluon":
        return gluon_plan(spec, p, cfg, config, dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok, window)
    num_m = triton.cdiv(p.Tq, cfg["BLOCK_M"])
    num_bh = p.B * p.Hq
    scale = 1.0 / math.sqrt(p.D) if scale is None else float(scale)
    meta = triton_meta(cfg, p, dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok, window)
    meta_ptr = dict(meta, TMA=0, SCHEDULE="pipelined" if meta["SCHEDULE"] == "warp_specialized"
                    else meta["SCHEDULE"]) if meta["TMA"] else meta
    return Plan(
        out_shape=(), grid=(num_m * num_bh,), cfg=cfg,
        cfg_key=None if config is not None else spec.config_key(p, dtype),
        scalars=(p.Hq, p.Hq // p.Hkv, p.Tq, p.Tk, num_m, num_bh, abs(scale) * LOG2E),
        # scale < 0: the kernel negates q and takes |scale| (negating fp16/bf16/fp32 is exact)
        meta=meta, meta_ptr=meta_ptr, consts=tuple(meta[c] for c in CONSTEXPRS),
        consts_ptr=tuple(meta_ptr[c] for c in CONSTEXPRS))


def gluon_runs_here() -> bool:
    """Gluon kernels run on a GPU, never in the interpreter (whose IMPL=gluon points run the Triton kernel)."""
    from tritune.kernels.runtime import device as dev

    return not dev.interpreted()


def gluon_plan(spec, p, cfg, config, dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok, window=0) -> Plan:
    """An IMPL=gluon config: the Gluon kernel where it takes the call, else the Triton kernel with the default
    config (the interpreter, a scale <= 0, strides TMA cannot read, a dense call without keys, or a problem of
    the config's bucket that the Gluon kernel does not take: dense causal Tq > Tk, too many heads; a window)."""
    scale_f = 1.0 / math.sqrt(p.D) if scale is None else float(scale)
    plain = plan(spec, p, spec.default_config(p, dtype), dtype, scale, d_contig, varlen, store_lse, tma_ok, host_ok,
                 window)
    plain.cfg_key = None if config is not None else spec.config_key(p, dtype)
    # the config cache is per bucket, so a config that came from it was checked against the bucket's first
    # problem only: this problem's own limits (causal Tq <= Tk, the grid's batch x heads) are checked here;
    # not a zero scale either: the Gluon softmax scales masked (-inf) scores, and -inf x 0 is NaN; a packed
    # batch takes descriptors made on the device (host_ok is the host-built 4-D descriptors' condition)
    if (window or not gluon_runs_here() or scale_f <= 0 or not tma_ok or not (varlen or host_ok)
            or SP.SPACE.constraint(cfg, p, dtype) is not None):
        return plain
    args = dict(causal=p.causal, qk_scale=scale_f * LOG2E, BN=cfg["BLOCK_N"], stages=cfg["num_stages"],
                schedule=GLUON_SCHEDULES[cfg["SCHEDULE"]], rows=cfg["BLOCK_M"])
    if not varlen:
        args["persistent"] = bool(cfg["PERSISTENT"])
    return Plan(out_shape=(), grid=(triton.cdiv(p.Tq, cfg["BLOCK_M"]), p.B * p.Hq), cfg=cfg, cfg_key=plain.cfg_key,
                gluon=args, fallback=plain)


def tma_strides_ok(e: int, *tensor_strides) -> bool:
    """TMA reads rows of a 2-D (rows, D) view: unit stride along D, every other stride a multiple of
    16 bytes (so each (batch, head, sequence) base stays 16-byte aligned)."""
    return all(st[-1] == 1 and all((x * e) % 16 == 0 for x in st[:-1]) for st in tensor_strides)


_ALLOCATOR_SET = threading.local()


def _torch_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
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


def host_caches(pl: Plan, q) -> None:
    """A plan's host-side caches: compiled kernels for direct launches (CUDA only), the Gluon launch's."""
    pl.kernels = {} if K.DIRECT_LAUNCH and q.is_cuda else None
    if pl.gluon is not None:
        pl.gluon_cache = {}


def launch_meta(plan, q, k, v, out) -> dict:
    """The plan's constexprs for this launch: the TMA variant only where every tensor is TMA-readable (unit
    stride along D, 16-byte aligned rows and bases), with the descriptors' allocator set; else the pointer path."""
    meta = plan.meta
    if meta["TMA"]:
        meta = meta if K.aligned(q, k, v, out) else plan.meta_ptr
        if meta["TMA"] == 1 and q.is_cuda:
            ensure_allocator()
    return meta


def descs(plan, meta, q, k, v, out) -> tuple:
    """The kernel's DescQ/K/V/O arguments: under TMA=2 host-built descriptors over the 4-D (B, H, T, D)
    tensors (their T and D bounds zero-fill a tile's tail and clip the store, as the per-program ones
    do; made by the plan's makers), else the tensors themselves (unused)."""
    if meta["TMA"] != 2:
        return q, k, v, out
    mq, mk, mv, mo = plan.descs
    return mq(q), mk(k), mv(v), mo(out)


def launch_triton(plan, q, k, v, out, lse, cu_q, cu_k) -> None:
    """Launch the Triton kernel of ``plan`` (``cu_q``/``cu_k``: the packed batch's cu_seqlens, else q)."""
    if not plan.grid:
        return
    meta = launch_meta(plan, q, k, v, out)
    lse_arg = out if lse is None else lse
    varlen = cu_q is not q
    dq, dk, dv, do = (q, k, v, out) if varlen else descs(plan, meta, q, k, v, out)
    args = (q, k, v, out, lse_arg, cu_q, cu_k, dq, dk, dv, do, *plan.strides, *plan.scalars)
    keep = (q, k, v, out, lse_arg, cu_q, cu_k) if varlen else (q, k, v, out, lse_arg)
    K.launch_cached(attn_fwd, plan.kernels, plan.grid, args, meta,
                    plan.consts if meta is plan.meta else plan.consts_ptr, meta is plan.meta, keep)
