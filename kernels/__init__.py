"""The kernel spec and the registry.

Every kernel module in this package registers one :class:`KernelSpec`. Tests, benchmarks, tuning and the
CLI iterate :func:`all_specs`; none of them branches on a kernel's name. Adding a kernel is one file
here, one in ``references/`` and its spec: modules are discovered, not listed.
"""
from __future__ import annotations

import functools
import importlib
import os
import itertools
import math
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import tritune.harness  # noqa: F401  (switches on the interpreter before triton loads)
import torch
import triton

from tritune.harness import device as _dev

if _dev.interpreted():  # the interpreter's bf16 arithmetic is wrong: computed in fp32 and rounded instead
    from tritune.kernels import _interpret_bf16

    _interpret_bf16.apply()


# ---------------------------------------------------------------------------------------------------
# Problems, cases, costs, spaces
# ---------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """Inputs for one launch: ``run(*args, out=out, **kwargs)`` and ``reference(*args, **kwargs)``.

    ``out`` is preallocated by ``make_inputs`` (right shape and dtype, contents irrelevant): the harness
    poisons it before each launch. A kernel with several outputs takes a tuple.
    """
    args: tuple
    kwargs: dict = field(default_factory=dict)
    out: Any = None

    def tensors(self) -> Iterator[torch.Tensor]:
        for a in itertools.chain(self.args, self.kwargs.values()):
            if isinstance(a, torch.Tensor):
                yield a
            elif callable(getattr(a, "tensors", None)):  # a container such as a QuantizedWeight
                yield from (t for t in a.tensors() if isinstance(t, torch.Tensor))

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors())


@dataclass(frozen=True)
class Cost:
    flops: float          # floating-point operations
    bytes: float          # fewest bytes moved through device memory (each input read once, outputs once)


@dataclass
class Space:
    """Tunable parameters with their choices, and the constraint that prunes impossible points.

    ``constraint(config, problem, dtype)`` returns ``None`` when the point is valid, else a short reason
    (shared-memory budget, block larger than the problem, ...). Optuna draws from ``params``; the grid
    sampler enumerates :meth:`points`.
    """
    params: dict[str, list]
    constraint: Callable[[dict, Any, torch.dtype], str | None] = lambda c, p, d: None

    def why_malformed(self, config: dict) -> str | None:
        """What makes ``config`` no point of the space for any problem (unknown, missing or unlisted values)."""
        for k, v in config.items():
            if k not in self.params:
                return f"unknown parameter {k!r}"
            if v not in self.params[k]:
                return f"{k}={v!r} not among {self.params[k]}"
        missing = set(self.params) - set(config)
        if missing:
            return f"missing parameters {sorted(missing)}"
        return None

    def why_invalid(self, config: dict, problem, dtype) -> str | None:
        return self.why_malformed(config) or self.constraint(config, problem, dtype)

    def points(self, problem=None, dtype=None) -> list[dict]:
        """Every valid point (all points when no problem is given)."""
        keys = list(self.params)
        pts = [dict(zip(keys, vals)) for vals in itertools.product(*(self.params[k] for k in keys))]
        if problem is None:
            return pts
        return [p for p in pts if self.constraint(p, problem, dtype) is None]

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.params.values())


# ---------------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------------
@dataclass
class KernelSpec:
    name: str
    run: Callable                                   # run(*args, out=None, config=None, **kwargs)
    reference: Callable                             # reference(*args, **kwargs) in float64
    make_inputs: Callable                           # make_inputs(problem, dtype, device, seed, layout)
    problems: Callable                              # problems(cap) -> hypothesis strategy of problems
    space: Space
    default_config: Callable                        # default_config(problem, dtype) -> dict
    bucket: Callable                                # bucket(problem) -> dict[str, int | str]
    cost: Callable                                  # cost(problem, dtype) -> Cost
    problem_of: Callable                            # problem_of(*args, **kwargs) -> problem
    standard_problems: list                         # GPU benchmark / tuning set
    small_problems: list                            # interpreter benchmark set
    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    layouts: tuple = ("contiguous",)
    accumulation: Callable = lambda dtype: "ieee"   # the tolerance key a dtype's result is held to
    vendor: Callable | None = None                  # vendor(case) -> zero-arg callable (torch/cuBLAS/SDPA)
    vendor_name: str = "torch"
    peers: dict = field(default_factory=dict)       # name -> peer(case) -> zero-arg callable or None
    bad_inputs: Callable | None = None              # bad_inputs(device) -> [(label, thunk, exc_type)]
    interpreter_skip: dict = field(default_factory=dict)  # dtype -> reason it cannot run interpreted
    # seeds(problem, dtype) -> [config]: points every tuning study tries first, beside the default and the
    # stored entry: the way into a region of the space that one-step moves do not reach (attention's Gluon
    # kernel fixes five keys at once); invalid ones are skipped
    seeds: Callable | None = None
    description: str = ""

    def config_for(self, problem, dtype, config: dict | None = None) -> dict:
        """explicit > tuned store > heuristic default, validated against the space."""
        if dtype == torch.bfloat16 and _dev.interpreted():
            _interpret_bf16.require(self.name)  # computes bf16 right, or says clearly that it cannot
        if config is not None:
            why = self.space.why_invalid(config, problem, dtype)
            if why:
                raise ValueError(f"{self.name}: config {config} is invalid for {problem}: {why}")
            return config
        return _lookup(self, bucket_key(self.bucket(problem)), dtype, problem)

    def config_key(self, problem, dtype) -> tuple:
        """The config cache's key of a tuned/default config: (kernel, bucket, store dtype key)."""
        return self.name, bucket_key(self.bucket(problem)), store_dtype(dtype)

    def config_and_key(self, problem, dtype, config: dict | None = None) -> tuple[dict, tuple | None]:
        """:meth:`config_for`, and the config cache's key when the config came from it (None for an
        explicit one): a cached launch plan holding that config is stale once the cache drops it."""
        cfg = self.config_for(problem, dtype, config)
        return cfg, None if config is not None else self.config_key(problem, dtype)


class PlanCache(dict):
    """Launch plans of one launcher, keyed on everything its checks and its config depend on (shapes,
    strides, dtypes, devices, scalar arguments, an explicit config). A hit means the same metadata passed
    the checks before, so the hot path is a dict lookup and the launch. A plan records the config it
    holds (``cfg``) and where it came from (``cfg_key``, None for an explicit config): once the config
    cache has dropped that entry (a tuned store was written), :meth:`get` misses and the plan is made again."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def get(self, key, default=None):
        plan = super().get(key)
        if plan is not None and plan.cfg_key is not None and _CONFIG_CACHE.get(plan.cfg_key) is not plan.cfg:
            return default
        return plan if plan is not None else default

    def put(self, key, plan) -> None:
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan

    def get_or_make(self, key, make, keep=None):
        """The plan under ``key``, else ``make()`` (which validates the arguments and names a bad one),
        kept under ``key`` unless the key is None or unhashable (metadata that did not come from tensors)
        or ``keep(plan)`` is false."""
        try:
            plan = None if key is None else self.get(key)
        except TypeError:
            key = plan = None
        if plan is None:
            plan = make()
            if key is not None and (keep is None or keep(plan)):
                self.put(key, plan)
        return plan


def bucket_key(bucket: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in bucket.items())


# ---------------------------------------------------------------------------------------------------
# fp32 follows torch.get_float32_matmul_precision(), as torch's own matmul does
# ---------------------------------------------------------------------------------------------------
def fp32_precision() -> str:
    """``input_precision`` of an fp32 ``tl.dot`` now: "ieee" (IEEE fp32 products) under torch's
    "highest" (its default), "tf32" (tf32 tensor cores allowed) under "high" and "medium"."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def precision_key(dtype):
    """What a launch plan of ``dtype`` inputs depends on through the precision setting (it can change
    between calls): the setting for float32, None otherwise. Cheap: plan-cache keys call it per launch."""
    return torch.get_float32_matmul_precision() if dtype is torch.float32 else None


def fp32_accumulation(dtype) -> str:
    """The tolerance key (harness.compare) of a kernel whose fp32 dots follow the precision setting:
    "tf32" for fp32 while tf32 is allowed, else "ieee"."""
    return "tf32" if dtype == torch.float32 and fp32_precision() == "tf32" else "ieee"


def store_dtype(dtype) -> str:
    """The tuned store's dtype key: "float32" for IEEE fp32 dots, "tfloat32" for fp32 with tf32 allowed
    (a config timed on tf32 tensor cores says little about IEEE fp32, which runs on the FMA units);
    "bfloat16", "float16" as they are."""
    name = str(dtype).replace("torch.", "")
    if name == "float32" and fp32_precision() == "tf32":
        return "tfloat32"
    return name


def _lookup(spec: KernelSpec, key: str, dtype, problem) -> dict:
    # The hot path: one dict lookup after the first launch of a (kernel, bucket, precision).
    sd = store_dtype(dtype)
    cache = _CONFIG_CACHE
    hit = cache.get((spec.name, key, sd))
    if hit is not None:
        return hit
    from tritune.tuning import store

    cfg = store.lookup(spec.name, key, sd)
    if cfg is not None:
        why = spec.space.why_invalid(cfg, problem, dtype)
        if why is not None:
            # this bucket's own entry, or any entry that is no point of the space, is reported; a
            # neighbouring bucket's sound config that does not fit this problem is just not used
            if spec.space.why_malformed(cfg) or store.entry_config(spec.name, key, sd) == cfg:
                _report_invalid(spec.name, key, sd, cfg, why)
            cfg = None
    if cfg is None:
        cfg = spec.default_config(problem, dtype)
    cache[(spec.name, key, sd)] = cfg
    return cfg


_CONFIG_CACHE: dict = {}
_REPORTED: set = set()  # (kernel, bucket, dtype) whose invalid stored config was already reported


def _report_invalid(kernel: str, bucket: str, dtype: str, cfg: dict, why: str) -> None:
    """A stored config that is no valid point of the space for this problem (a hand edit, a space that
    shrank, a neighbouring bucket's config that does not fit): never launched, said once per process."""
    import warnings

    if (kernel, bucket, dtype) in _REPORTED:
        return
    _REPORTED.add((kernel, bucket, dtype))
    warnings.warn(f"tritune: the tuned config stored for kernel {kernel!r}, bucket {bucket}, dtype {dtype} is "
                  f"invalid ({why}): {cfg}; using the heuristic default instead", stacklevel=4)


def clear_config_cache() -> None:
    _CONFIG_CACHE.clear()


# ---------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------
REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in REGISTRY and REGISTRY[spec.name] is not spec:
        raise ValueError(f"kernel {spec.name!r} registered twice")
    REGISTRY[spec.name] = spec
    return spec


@functools.lru_cache(maxsize=None)
def _discover() -> None:
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


def _load_plugins() -> None:
    # kernels of other packages (entry points) and TRITUNE_PLUGINS: here, so every process that looks a
    # kernel up has them (tuning workers included)
    from tritune.harness import plugins

    plugins.load(register, KernelSpec)


def all_specs() -> list[KernelSpec]:
    _discover()
    _load_plugins()
    return [REGISTRY[k] for k in sorted(REGISTRY)]


def get(name: str) -> KernelSpec:
    if name not in REGISTRY:  # a kernel's module is named after it: import just that one when it exists
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    if name not in REGISTRY:
        _discover()
    if name not in REGISTRY:
        _load_plugins()
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None


# ---------------------------------------------------------------------------------------------------
# Validation helpers for launchers: checks at the top, messages that name the argument.
# ---------------------------------------------------------------------------------------------------
def check_tensor(name: str, t, *, ndim: int | Iterable[int] | None = None, dtypes=None,
                 device: torch.device | str | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} not supported (expected {names})")
    if device is not None and t.device.type != torch.device(device).type:
        raise ValueError(f"{name}: expected a tensor on {torch.device(device).type}, got {t.device}")


def kernel_device() -> str:
    from tritune.harness.device import device

    return device()


def check_device(name: str, t: torch.Tensor) -> None:
    """Kernels run on CUDA tensors (CPU tensors under the interpreter)."""
    want = kernel_device()
    if t.device.type != want:
        raise ValueError(f"{name}: expected a tensor on {want}, got {t.device}")


def check_vec(name: str, t, n: int, dtype, device, src: str) -> None:
    """A 1-D operand of ``n`` elements of ``src``'s dtype, on its device (a bias, a LayerNorm weight)."""
    check_tensor(name, t, ndim=1)
    if t.dtype != dtype:
        raise TypeError(f"{name}: dtype {t.dtype} differs from {src}'s {dtype}")
    if t.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but {src} is on {device}")


def check_fusions(ln, kv, m: int, n: int, kdim: int, x, x_name: str, w_name: str) -> int:
    """The LayerNorm prologue and KV-cache write arguments of a linear (gemm's and gemv's ``ln``, ``kv``):
    ``ln`` (weight or None, bias or None, eps) over the K of ``x`` (m, kdim); ``kv`` (k_cache, v_cache,
    slot_mapping) for an N = 3·C output. Returns C (the caches' heads·head_dim; 0 without kv)."""
    if ln is not None:
        ln_w, ln_b, eps = ln
        for name, t in (("ln weight", ln_w), ("ln bias", ln_b)):
            if t is not None:
                check_vec(name, t, kdim, x.dtype, x.device, x_name)
                if t.stride(0) != 1:
                    raise ValueError(f"{name}: expected unit stride, got {t.stride(0)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0 or math.isinf(eps):
            raise ValueError(f"ln eps: expected a finite number >= 0, got {eps!r}")
    if kv is None:
        return 0
    kc, vc, slots = kv
    for name, t in (("k_cache", kc), ("v_cache", vc)):
        check_tensor(name, t, ndim=4)
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {x_name}'s {x.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but {x_name} is on {x.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous (num_blocks, block_size, heads, head_dim) cache")
    if kc.shape != vc.shape:
        raise ValueError(f"v_cache: shape {tuple(vc.shape)} differs from k_cache's {tuple(kc.shape)}")
    c_kv = kc.shape[2] * kc.shape[3]
    if n != 3 * c_kv:
        raise ValueError(f"kv: {w_name} has N={n} columns, expected 3 x heads x head_dim = {3 * c_kv} (q, k, v)")
    check_tensor("slot_mapping", slots, ndim=1, dtypes=(torch.int32, torch.int64))
    if slots.shape[0] != m:
        raise ValueError(f"slot_mapping: expected {m} slots (one per row of {x_name}), got {slots.shape[0]}")
    if slots.device != x.device:
        raise ValueError(f"slot_mapping: on {slots.device}, but {x_name} is on {x.device}")
    return c_kv


def check_out(out, shape: tuple, dtype: torch.dtype, device) -> None:
    check_tensor("out", out)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out: expected device {device}, got {out.device}")


def extent(t) -> int:
    """Bytes from ``t.data_ptr()`` that its view can reach (0 for None or an empty tensor): metadata
    only, so a launch plan can hold it for :func:`check_no_alias`."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0
    return span(t) * t.element_size()


def check_no_alias(out, inputs, in_place: str | None = None, extents: tuple | None = None) -> None:
    """Refuse an ``out`` whose memory overlaps an input's: a kernel that writes one tile while another
    program still reads it returns a silently wrong result (``gemm(x, w, out=x)``). ``inputs`` is
    ((name, tensor or None), ...). ``in_place`` names the one input ``out`` may be exactly (same data
    pointer, shape and strides: each element read by the program that writes it, before it writes it),
    the documented in-place case such as ``out=residual``. Byte ranges are compared (conservative: two
    interleaved views of one buffer count as overlapping). Called per launch, only when ``out`` is given;
    ``extents`` (out's, then each input's :func:`extent`) from a launch plan save working them out."""
    if extents is None:
        extents = (extent(out), *(extent(t) for _, t in inputs))
    if not extents[0]:
        return
    o0 = out.data_ptr()
    o1 = o0 + extents[0]
    for (name, t), ext in zip(inputs, extents[1:]):
        if not ext:
            continue
        t0 = t.data_ptr()
        if t0 < o1 and o0 < t0 + ext:
            if name == in_place and t0 == o0 and t.shape == out.shape and t.stride() == out.stride():
                continue
            also = f", or {name} itself (in place)" if name == in_place else ""
            raise ValueError(f"out: overlaps {name} in memory: the kernel would read values it has already "
                             f"overwritten; pass an output that shares no memory with the inputs{also}")


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


def span(t: torch.Tensor) -> int:
    """1 + the largest element offset of a view: what its addressing must reach (64-bit offsets past 2^31)."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))


@functools.lru_cache(maxsize=None)
def num_sms() -> int:
    """Streaming multiprocessors of the current GPU (132, an H100's, under the interpreter)."""
    if kernel_device() == "cpu":
        return 132
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def constexpr_params(jit_fn) -> tuple:
    """Names of a @triton.jit function's tl.constexpr parameters, in order: the values a direct launch
    passes after the runtime arguments (read off the signature, so they cannot drift from it)."""
    import inspect

    fn = getattr(jit_fn, "fn", jit_fn)
    return tuple(n for n, p in inspect.signature(fn).parameters.items()
                 if str(p.annotation).replace(" ", "").endswith("constexpr"))


def tensor_meta(t):
    """What a cached launch plan depends on for an optional tensor argument."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)



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


def pdl_now(kernel: str | None = None) -> bool:
    """Whether a launch made now (on a device where :func:`pdl` holds) uses it: only while a CUDA graph is
    being captured, and not with TRITUNE_PDL=0 or ``PDL = False``. In a graph the launch attribute costs
    nothing at replay and each launch overlaps the end of the one before; an eager launch with it took
    ~25 us more host time through triton 3.6 (paged attention at B=1: 33 -> 58 us a call), more than a
    decode kernel runs, so eager launches go without."""
    if PDL_KERNELS is not None and kernel not in PDL_KERNELS:
        return False
    return PDL and (_PDL_FORCED.get() or torch.cuda.is_current_stream_capturing())


import contextlib as _contextlib  # noqa: E402
import contextvars as _contextvars  # noqa: E402

_PDL_FORCED = _contextvars.ContextVar("tritune_pdl_forced", default=False)


@_contextlib.contextmanager
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
# metadata and hooks triton's launch would pass. The compiled kernel's run() signature is triton's
# internal API, read on the sources of 3.5 to 3.9: other versions take triton's own launch.
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
    """Launch ``jit_fn`` on ``grid``: through triton the first time for each (variant, 16-byte alignment of
    ``ptrs``, device), keeping the compiled kernel in ``kernels`` (a launch plan's dict), then directly
    (:func:`launch_direct`, ``args + consts``). The alignment is what triton specialises a pointer on;
    ``variant`` is whatever else picks another compiled kernel for the same plan (PDL, descriptor modes).
    ``kernels=None``: always through triton (the interpreter, or direct launches switched off)."""
    if kernels is None:
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
    else:
        kern = jit_fn[grid](*args, **kws)
        if keepable(kern):
            kernels[key] = kern


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
