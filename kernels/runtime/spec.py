"""The kernel spec, its space, and the registry with the config lookup.

Every kernel module in ``tritune.kernels`` registers one :class:`KernelSpec`. Tests, benchmarks, tuning and
the CLI iterate :func:`all_specs`; none of them branches on a kernel's name. Adding a kernel is one file in
``kernels/``, one in ``references/`` and its spec: modules are discovered, not listed.
"""
from __future__ import annotations

import functools
import importlib
import itertools
import math
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_bf16, interpret_fp8
from tritune.kernels.runtime import plugins
from tritune.kernels.runtime import store

if dev.interpreted():
    interpret_bf16.apply()   # bf16 arithmetic, and float dots whose rows do not depend on the tile's row count
    interpret_bf16.adopt_compiled_functions()   # kernels decorated before the switch (triton imported first)
    interpret_fp8.apply()   # float -> e4m3 conversions rounded as the GPU rounds them

KERNELS_PACKAGE = "tritune.kernels"
KERNELS_PATH = [str(Path(__file__).resolve().parent.parent)]

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

    ``legacy``: keys added to the space after configs were stored, each with the value a config without it
    means (the code before the key existed); such a config stays a point, read through :meth:`full`.
    """
    params: dict[str, list]
    constraint: Callable[[dict, Any, torch.dtype], str | None] = lambda c, p, d: None
    legacy: dict = field(default_factory=dict)

    def full(self, config: dict) -> dict:
        """``config`` with the :attr:`legacy` keys it lacks filled in."""
        return {**self.legacy, **config} if self.legacy else config

    def why_malformed(self, config: dict) -> str | None:
        """What makes ``config`` no point of the space for any problem (unknown, missing or unlisted values)."""
        config = self.full(config)
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
    # borrow(config, problem, dtype) -> why a neighbouring bucket's stored config does not carry over to this
    # problem (None: it does): a store lookup that falls back to a neighbour asks it (gemv: a one-row tile
    # tuned at M=1 would read the weight once per row at M=4); the default runs instead
    borrow: Callable | None = None
    description: str = ""

    def config_for(self, problem, dtype, config: dict | None = None) -> dict:
        """explicit > tuned store > heuristic default, validated against the space."""
        if dtype == torch.bfloat16 and dev.interpreted():
            interpret_bf16.require(self.name)  # computes bf16 right, or says clearly that it cannot
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
        if plan is not None and plan.cfg_key is not None and CONFIG_CACHE.get(plan.cfg_key) is not plan.cfg:
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


class BucketConfigs(dict):
    """A launcher's (config, config cache key) pairs (:meth:`KernelSpec.config_and_key`) under a key that holds
    the problem with M replaced by its bucket, the dtype, the precision setting and the explicit config: a
    new M of a known bucket skips the bucket's string key and the lookup. While the config cache still holds
    the pair's config (checked as :meth:`PlanCache.get` checks a plan) it is what the lookup gives for any M of
    the bucket: the cache holds one config per bucket, whichever M made it. One it has dropped or replaced (a
    store written since, tuning on a miss) is looked up again. An explicit config is validated once a key and
    kept as a copy: only for a space whose constraint reads M through its bucket alone (gemm's, fp8_gemm's)."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def pair(self, key, make: Callable[[], tuple]) -> tuple:
        """The pair under ``key``, else ``make()``'s (the lookup; it validates an explicit config), kept."""
        try:
            hit = super().get(key)
        except TypeError:   # an unhashable explicit config: make() refuses it by name
            return make()
        if hit is not None and (hit[1] is None or CONFIG_CACHE.get(hit[1]) is hit[0]):
            return hit
        cfg, cfg_key = make()
        hit = (cfg if cfg_key is not None else dict(cfg)), cfg_key
        if len(self) >= self.limit:
            self.clear()
        self[key] = hit
        return hit


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
    cache = CONFIG_CACHE
    hit = cache.get((spec.name, key, sd))
    if hit is not None:
        return hit
    cfg = store.lookup(spec.name, key, sd)
    if cfg is not None:
        own = store.entry_config(spec.name, key, sd) == cfg
        why = spec.space.why_invalid(cfg, problem, dtype)
        if why is not None:
            # this bucket's own entry, or any entry that is no point of the space, is reported; a
            # neighbouring bucket's sound config that does not fit this problem is just not used
            if spec.space.why_malformed(cfg) or own:
                _report_invalid(spec.name, key, sd, cfg, why)
            cfg = None
        elif not own and spec.borrow is not None and spec.borrow(cfg, problem, dtype):
            cfg = None   # a neighbour's winner that does not carry over to this problem
    if tune_on_miss():   # opt-in: the handler may tune this bucket now (tuning/on_miss.py)
        cfg, keep = miss_handler()(spec, problem, dtype, key, sd, cfg)
        if not keep:     # nothing tuned now (a graph capture, tracing): ask again at the next launch
            return cfg if cfg is not None else spec.default_config(problem, dtype)
    if cfg is None:
        cfg = spec.default_config(problem, dtype)
    cache[(spec.name, key, sd)] = cfg
    return cfg


CONFIG_CACHE: dict = {}
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
    CONFIG_CACHE.clear()


# ---------------------------------------------------------------------------------------------------
# Tuning on a miss (opt-in: TRITUNE_TUNE_ON_MISS=1 or set_tune_on_miss(True)). The runtime holds the switch
# and the hook; the handler is tuning's, a floor above, so it is loaded by name with importlib, and only
# once the switch is on: the one by-name load besides plugin discovery.
# ---------------------------------------------------------------------------------------------------
MISS_HANDLER = "tritune.tuning.on_miss:handle"   # handler(spec, problem, dtype, bucket, dtype key, stored)
MISS = {"on": None, "handler": None}   # on: None follows the env var; handler: set_miss_handler's or loaded


def tune_on_miss() -> bool:
    """Whether a launch of a bucket with no stored config tunes it first (set_tune_on_miss, else
    TRITUNE_TUNE_ON_MISS=1); off by default."""
    on = MISS["on"]
    if on is None:
        import os

        return os.environ.get("TRITUNE_TUNE_ON_MISS", "").strip().lower() in ("1", "true", "yes", "on")
    return on


class set_tune_on_miss:
    """Switch tuning on a miss on (True) or off (False) in this process, or back to TRITUNE_TUNE_ON_MISS
    (None); as a context manager (``with set_tune_on_miss(True): ...``), the setting before comes back at
    the end."""

    def __init__(self, on: bool | None = True):
        if on is not None and not isinstance(on, bool):
            raise TypeError(f"tune_on_miss: expected True, False or None, got {on!r}")
        if on and not tune_on_miss():
            clear_config_cache()   # buckets already launched with an untuned config get their miss again
        self.before, MISS["on"] = MISS["on"], on

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        MISS["on"] = self.before


def set_miss_handler(fn: Callable | None) -> None:
    """Replace the handler (``fn(spec, problem, dtype, bucket, dtype_key, stored) -> (config or None,
    keep)``); None: the default, loaded from MISS_HANDLER on the next miss."""
    MISS["handler"] = fn


def miss_handler() -> Callable:
    if MISS["handler"] is None:
        mod, _, attr = MISS_HANDLER.partition(":")
        MISS["handler"] = getattr(importlib.import_module(mod), attr)
    return MISS["handler"]


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
    for mod in pkgutil.iter_modules(KERNELS_PATH):
        if not mod.name.startswith("_") and mod.name != "runtime":
            importlib.import_module(f"{KERNELS_PACKAGE}.{mod.name}")


def _load_plugins() -> None:
    # kernels of other packages (entry points) and TRITUNE_PLUGINS: here, so every process that looks a
    # kernel up has them (tuning workers included)
    plugins.load(register, KernelSpec)


def all_specs() -> list[KernelSpec]:
    _discover()
    _load_plugins()
    return [REGISTRY[k] for k in sorted(REGISTRY)]


def get(name: str) -> KernelSpec:
    if name not in REGISTRY:  # a kernel's module is named after it: import just that one when it exists
        try:
            importlib.import_module(f"{KERNELS_PACKAGE}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{KERNELS_PACKAGE}.{name}":
                raise
    if name not in REGISTRY:
        _discover()
    if name not in REGISTRY:
        _load_plugins()
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None
