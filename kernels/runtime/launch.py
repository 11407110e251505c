"""Launch machinery shared by the launchers: buffers kept across launches, programmatic dependent launch
(PDL), direct launches of compiled kernels, TMA descriptors, the SM count."""
from __future__ import annotations

import contextlib
import functools
import contextvars
import os
from typing import Callable

import torch
import triton

from tritune.kernels.runtime.checks import kernel_device
from tritune.kernels.runtime.specialize import SHARED, check_hit

def _outside_graph_pools(device, make):
    """``make()``, a buffer kept across launches (counters, workspace), from the caching allocator's
    ordinary pool. torch.compile's CUDA graphs (mode="reduce-overhead", cudagraph trees) run their warm-up
    with every allocation of the warming thread routed to the graph's private pool: a buffer first sized
    there would be memory of that pool the graph does not own (refused: "tensor(s) in the cudagraph pool
    not tracked as outputs", and the pool may hand it out again). The allocator routes by thread, so the
    buffer is made on a short-lived thread, on a stream of its own (work on the legacy default stream
    would break a capture running elsewhere), finished before it is returned. Buffers grow a few times a
    process. Inside a stream capture the buffer is made in place, as before (the capture's pool keeps it)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    import threading

    if device.index is None:  # the caller's current device, which a new thread does not inherit
        device = torch.device("cuda", torch.cuda.current_device())

    made: dict = {}

    def run():
        try:
            with torch.cuda.device(device):
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    made["t"] = make()
                stream.synchronize()
        except BaseException as e:  # re-raised in the caller's thread
            made["e"] = e

    worker = threading.Thread(target=run, name="tritune-buffer", daemon=True)
    worker.start()
    worker.join()
    if "e" in made:
        raise made["e"]
    return made["t"]


class Counters:
    """Per-device int32 tile counters for split-K reductions, kept zero between launches (a kernel resets
    the ones it used). One buffer per device and owner: two launches of the same owner must not run
    concurrently on different streams."""

    def __init__(self, minimum: int = 1024):
        self.minimum = minimum
        self.buffers: dict = {}
        self.retired: list = []  # outgrown buffers stay alive: a captured CUDA graph may still use them

    def __call__(self, device, n: int) -> torch.Tensor:
        t = self.buffers.get(device)
        if t is None or t.numel() < n:
            if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
                # torch.zeros in a capture only records the fill: the buffer would stay uninitialised for
                # every eager launch until the graph first replays (garbage tickets, outputs never stored)
                raise RuntimeError("split-K/split-KV tile counters must grow outside CUDA graph capture: "
                                   "run the launch once (same shapes) before capturing it")
            if t is not None:
                self.retired.append(t)
            size = max(n, self.minimum)
            t = _outside_graph_pools(device, lambda: torch.zeros(size, dtype=torch.int32, device=device))
            self.buffers[device] = t
        return t


class Workspace:
    """Per-device float32 scratch (split-K and split-KV partial results) shared by every launch of its
    owner: like the counters, two launches must not run concurrently on different streams. It only grows
    (at least doubling), and a buffer it outgrows is kept alive, so a CUDA graph that captured it stays
    valid."""

    def __init__(self, minimum: int = 1 << 16):
        self.minimum = minimum
        self.buffers: dict = {}
        self.retired: list = []

    def __call__(self, device, n: int) -> torch.Tensor:
        t = self.buffers.get(device)
        if t is None or t.numel() < n:
            if t is not None:
                self.retired.append(t)
            size = max(n, 2 * t.numel() if t is not None else 0, self.minimum)
            t = _outside_graph_pools(device, lambda: torch.empty(size, dtype=torch.float32, device=device))
            self.buffers[device] = t
        return t


# aten op -> the SDPA backend it is (what torch's dispatch picked for a call)
_SDPA_OPS = {"aten::_scaled_dot_product_cudnn_attention": "cudnn",
             "aten::_scaled_dot_product_flash_attention": "flash",
             "aten::_scaled_dot_product_efficient_attention": "efficient",
             "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
             "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu flash",
             "aten::_scaled_dot_product_attention_math": "math"}


def sdpa_backend(fn: Callable[[], object]) -> str:
    """Which backend ``F.scaled_dot_product_attention`` ran inside ``fn()`` (one call, profiled on the
    host: the aten op it dispatched to): "cudnn", "flash", "efficient", "math", ...; "unknown" when no
    SDPA op shows. A vendor column is labelled with what really ran, not with what was asked for."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    return next((label for op, label in _SDPA_OPS.items() if op in names), "unknown")


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (132, an H100's, under the interpreter)."""
    if kernel_device() == "cpu":
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _is_constexpr(annotation) -> bool:
    """Triton's own rule (``KernelParam.is_constexpr``): "constexpr" in the annotation's name, whether the
    module's annotations are strings (``from __future__ import annotations``) or the class itself."""
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return "constexpr" in name


def jit_params(jit_fn) -> tuple:
    """``(name, is_constexpr)`` for each parameter of a @triton.jit function, in order: triton's own
    reading where the function has it (a JITFunction; the interpreter's wrapper has none), else the same
    rule applied to the signature."""
    params = getattr(jit_fn, "params", None)
    if params is not None and all(hasattr(p, "is_constexpr") for p in params):
        return tuple((p.name, bool(p.is_constexpr)) for p in params)
    import inspect

    fn = getattr(jit_fn, "fn", jit_fn)
    return tuple((n, _is_constexpr(p.annotation)) for n, p in inspect.signature(fn).parameters.items())


def constexpr_params(jit_fn) -> tuple:
    """Names of a @triton.jit function's tl.constexpr parameters, in order: the values a direct launch
    passes after the runtime arguments (read off the signature, so they cannot drift from it)."""
    return tuple(n for n, c in jit_params(jit_fn) if c)


@functools.lru_cache(maxsize=None)
def _param_counts(jit_fn) -> tuple:
    ps = jit_params(jit_fn)
    return len(ps), sum(c for _, c in ps)


def check_direct_args(jit_fn, args: tuple, consts: tuple) -> None:
    """A direct launch passes every parameter of ``jit_fn`` (triton's compiled launcher takes the
    constexprs too, and refuses any other count with a bare "function takes exactly N arguments"): the
    runtime ``args`` then ``consts``, one value per constexpr. TypeError naming the kernel otherwise."""
    n, nc = _param_counts(jit_fn)
    if len(args) + len(consts) != n or len(consts) != nc:
        name = getattr(getattr(jit_fn, "fn", jit_fn), "__name__", jit_fn)
        raise TypeError(f"direct launch of {name}: {len(args)} runtime arguments + {len(consts)} constexprs, "
                        f"the kernel has {n - nc} + {nc}")


# ---------------------------------------------------------------------------------------------------
# Programmatic dependent launch (sm90+): a launch may start while the one before it in the stream ends
# ---------------------------------------------------------------------------------------------------
# TRITUNE_PDL: "1" (default) every kernel that has it, "0" none, or a comma-separated list of kernels
# (e.g. "gemv"): the decode benchmark's A/B
_PDL_ENV = os.environ.get("TRITUNE_PDL", "1").strip()
PDL = _PDL_ENV != "0"
PDL_KERNELS = None if _PDL_ENV in ("0", "1", "") else frozenset(k.strip() for k in _PDL_ENV.split(","))


@functools.lru_cache(maxsize=None)
def _pdl_supported() -> bool:
    try:
        import dataclasses

        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions

        return (any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))
                and hasattr(tl.extra.cuda, "gdc_wait"))
    except Exception:  # pragma: no cover - another backend or an older triton
        return False


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device) -> bool:
    """Whether launches on ``device`` can use programmatic dependent launch: a CUDA device of compute
    capability 9 or more and a triton that has it (``launch_pdl``, ``tl.extra.cuda.gdc_wait``). A kernel
    launched so calls ``gdc_launch_dependents`` early (the next PDL launch may start) and ``gdc_wait``
    before it reads anything an earlier launch wrote or writes anything at all."""
    device = torch.device(device)
    if device.type != "cuda" or not _pdl_supported():
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_variants(plan, device, constexprs: tuple) -> None:
    """Fill a plan's launch variants from ``plan.kws``: ``kws_pdl`` (the same launch with programmatic dependent
    launch, taken while a CUDA graph is captured: :func:`pdl_now`), ``kernels`` (the compiled kernels of direct
    launches, :func:`launch_direct`, after the first) and ``consts``/``consts_pdl`` (every constexpr a direct
    launch passes after the runtime arguments, in ``constexprs``' order)."""
    plan.kws_pdl = dict(plan.kws, PDL=True, launch_pdl=True) if pdl(device) else None
    plan.kernels = {} if DIRECT_LAUNCH and torch.device(device).type == "cuda" else None
    plan.consts = tuple(plan.kws[c] for c in constexprs)
    plan.consts_pdl = tuple(plan.kws_pdl[c] for c in constexprs) if plan.kws_pdl is not None else None


def pdl_now(kernel: str | None = None) -> bool:
    """Whether a launch made now (on a device where :func:`pdl` holds) uses it: only while a CUDA graph is
    being captured, and not with TRITUNE_PDL=0 or ``PDL = False``. In a graph the launch attribute costs
    nothing at replay and each launch overlaps the end of the one before; an eager launch with it took
    ~25 us more host time through triton 3.6 (paged attention at B=1: 33 -> 58 us a call), more than a
    decode kernel runs, so eager launches go without."""
    if PDL_KERNELS is not None and kernel not in PDL_KERNELS or _PDL_OFF.get():
        return False
    return PDL and (_PDL_FORCED.get() or torch.cuda.is_current_stream_capturing())


_PDL_FORCED = contextvars.ContextVar("tritune_pdl_forced", default=False)
_PDL_OFF = contextvars.ContextVar("tritune_pdl_off", default=False)


@contextlib.contextmanager
def pdl_off():
    """No launch made in this context uses PDL, captured or not: a timer that replays one launch back to
    back (with PDL each repeat would overlap the one before: a chain of the kernel, not its own time)."""
    token = _PDL_OFF.set(True)
    try:
        yield
    finally:
        _PDL_OFF.reset(token)


@contextlib.contextmanager
def pdl_forced():
    """Eager launches take the variant :func:`pdl_now` gives inside a capture (PDL where it applies): the
    warm-up before a CUDA-graph capture compiles, loads and runs exactly the kernels the capture records
    (a compile or module load inside a capture invalidates it and can lose the CUDA context)."""
    token = _PDL_FORCED.set(True)
    try:
        yield
    finally:
        _PDL_FORCED.reset(token)


# ---------------------------------------------------------------------------------------------------
# Direct launch of a compiled kernel
# ---------------------------------------------------------------------------------------------------
# Triton's own launch binds and specialises every argument on each call (~35 us of host time for a
# 40-argument kernel on the H100 machine's CPU, more than a decode kernel runs). What it specialises on is
# fixed by a launcher's plan (shapes, strides, dtypes, constexprs) except the 16-byte alignment of each
# pointer: so after a plan's first launch through triton, a launcher keeps the compiled kernel per
# (pointer alignments, device, variant) and later launches call it directly, with the arguments, launch
# metadata and hooks triton's launch would pass. A new plan first looks in the process-wide cache keyed on
# triton's own specialisation (kernels.runtime.specialize): a new M finds the kernel another M compiled. The
# compiled kernel's run() signature is triton's internal API, read on the sources of 3.5 to 3.9: other
# versions take triton's own launch.
try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None


def _direct_launch_ok() -> bool:
    import triton

    return _knobs is not None and (3, 5) <= tuple(int(v) for v in triton.__version__.split(".")[:2]) <= (3, 9)


DIRECT_LAUNCH = _direct_launch_ok()


def launch_direct(kern, grid, stream, args) -> None:
    """Launch compiled kernel ``kern`` (what ``jit_fn[grid](...)`` returned) on ``grid`` with ``args``: every
    parameter of the jitted function in order, constexprs included."""
    hooks = _knobs.runtime
    kern.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, kern.function,
             kern.packed_metadata, kern.launch_metadata(grid, stream, *args), hooks.launch_enter_hook,
             hooks.launch_exit_hook, *args)


def launch_cached(jit_fn, kernels: dict | None, grid, args: tuple, kws: dict, consts: tuple, variant, ptrs) -> None:
    """Launch ``jit_fn`` on ``grid``: directly (:func:`launch_direct`, ``args + consts``) with the compiled
    kernel kept in ``kernels`` (a launch plan's dict) for (variant, 16-byte alignment of ``ptrs``, device),
    else with the one kept process-wide for the same specialisation (:data:`SHARED`: a new plan whose kernel
    exists, e.g. a new M), else through triton, keeping what it compiled in both. The alignment is what
    triton specialises a plan's pointers on; ``variant`` is whatever else picks another compiled kernel for
    the same plan (PDL, descriptor modes). ``kernels=None``: always through triton (the interpreter, or
    direct launches switched off)."""
    if kernels is None:
        # checked here too (the interpreter never launches directly), so a drift shows on the CPU
        check_direct_args(jit_fn, args, consts)
        jit_fn[grid](*args, **kws)
        return
    align = 0
    for t in ptrs:
        align = 2 * align + (t.data_ptr() % 16 == 0)
    drv = triton.runtime.driver.active
    device = drv.get_current_device()
    key = (variant, align, device)
    kern = kernels.get(key)
    if kern is not None:
        launch_direct(kern, grid, drv.get_current_stream(device), args + consts)
        return
    check_direct_args(jit_fn, args, consts)
    shared = SHARED.key(jit_fn, args, kws, variant, device)
    kern = SHARED.get(shared) if shared is not None else None
    if kern is not None:
        if SHARED.check:
            check_hit(jit_fn, grid, args, kws, kern)
        SHARED.hits += 1
        kernels[key] = kern
        launch_direct(kern, grid, drv.get_current_stream(device), args + consts)
        return
    kern = jit_fn[grid](*args, **kws)
    if keepable(kern):
        kernels[key] = kern
        if shared is not None:
            SHARED[shared] = kern


class DescriptorMaker:
    """Host tensor descriptors of one geometry (shape, strides, block shape, and a Gluon descriptor's
    layout), for a new base tensor each launch. The first is made by the descriptor class itself, which
    checks the geometry and the base (16-byte aligned base and strides, unit last stride, positive shape);
    later ones copy its fields with only the base changed (~4 us of checks a descriptor saved per launch).
    A launch plan keyed on shapes and strides keeps one: the caller checks each base's 16-byte alignment
    (and takes another path where it fails), the one check that depends on the tensor, not the plan."""
    __slots__ = ("cls", "args", "fields")

    def __init__(self, cls, shape, strides, block_shape, *extra):
        self.cls = cls
        self.args = (list(shape), list(strides), list(block_shape), *extra)
        self.fields = None

    def __call__(self, base):
        if self.fields is None:
            d = self.cls(base, *self.args)
            self.fields = {k: v for k, v in vars(d).items() if k != "base"}
            return d
        d = object.__new__(self.cls)
        vars(d).update(self.fields)
        d.base = base
        return d


def keepable(kern) -> bool:
    """Whether a value returned by a triton launch is a compiled kernel :func:`launch_direct` can run."""
    return hasattr(kern, "run") and hasattr(kern, "packed_metadata") and not hasattr(kern, "result")
