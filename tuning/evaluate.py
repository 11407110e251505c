"""One evaluation, the objective of a trial: compile a config, run it on fresh random inputs, compare with
the float64 reference within the dtype's tolerance, then time it on fixed rotating inputs.

The time is :func:`tritune.tuning.timing.time_ms` in the problem's mode; every trial, the re-time of the
front runners and ``tritune bench`` measure this one quantity. A failure is a result, never an exception:
``{"ok": False, "error": "<kind>: ..."}`` with the kind from :func:`classify` (compile error, out of
resources, wrong answer, ...), which the tables count by kind.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------------
# One evaluation: compile, run, check against the reference, time
# ---------------------------------------------------------------------------------------------------
@dataclass
class Task:
    kernel: str
    problem: Any
    dtype: Any
    config: dict
    seed: int
    spec: Any = None        # the spec itself for in-process evaluation; None across processes (by name)
    module: str | None = None   # the module that registers the spec: a worker process imports it first
    verify: bool = True     # False: time only (re-timing configs the sweep verified)
    fp32_precision: str | None = None  # torch.get_float32_matmul_precision() of the process that asked

    def __post_init__(self):
        if self.module is None and self.spec is not None:
            self.module = getattr(self.spec.run, "__module__", None)
        if self.fp32_precision is None:
            import torch

            self.fp32_precision = torch.get_float32_matmul_precision()

    def spec_or_lookup(self):
        if self.spec is not None:
            return self.spec
        import importlib

        from tritune import kernels

        if self.kernel not in kernels.REGISTRY and self.module and self.module != "__main__":
            try:  # a plugin's or a test's kernel: registered when its module is imported
                importlib.import_module(self.module)
            except ImportError:
                pass
        return kernels.get(self.kernel)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (tuple, list)) else [x]


# Messages of errors after which the CUDA context is unusable: the worker answers, then exits.
_FATAL = ("illegal memory access", "illegal instruction", "misaligned address", "unspecified launch failure",
          "device-side assert", "CUDA error", "cudaErrorLaunchFailure", "an illegal")


def classify(e: BaseException) -> tuple[str, bool]:
    """(reason, fatal): a one-line reason for a failed evaluation, and whether the CUDA context is gone."""
    name = type(e).__name__
    text = " ".join(str(e).split())
    if len(text) > 400:
        text = text[:400] + "..."
    mod = type(e).__module__ or ""
    if "OutOfResources" in name:
        kind = "out of resources"
    elif "CompilationError" in name or mod.startswith("triton.compiler"):
        kind = "compile error"
    elif "OutOfMemory" in name:
        kind = "out of memory"
    else:
        kind = "error"
    fatal = any(s in text for s in _FATAL)
    if fatal:
        kind = "CUDA context error (worker restarted)"
    return f"{kind}: {name}: {text}", fatal


class Evaluator:
    """The default evaluation: validate, launch on fresh inputs, compare, then time on rotating inputs.

    Returns ``{"ok": True, "ms": float, "timer": mode}`` or ``{"ok": False, "error": reason}``; a result
    with ``"restart": True`` tells a worker process to exit after answering (the CUDA context is gone).
    The time is :func:`tritune.harness.timing.time_ms` in the problem's mode
    (:func:`tritune.harness.timing.timing_mode`; ``mode`` "graph" or "flush" forces one for every
    problem). ``timer(fn) -> ms`` replaces it (the tests' fake timers).
    """

    TIMING_SEED = 20240611   # timing inputs are fixed per problem (cached); the correctness inputs are not

    def __init__(self, timer: Callable | None = None, mode: str = "auto"):
        if mode not in ("auto", "graph", "flush"):
            raise ValueError(f"mode: expected auto, graph or flush, got {mode!r}")
        self.timer = timer
        self.mode = mode
        self._rotation_key = None
        self._rotation = None

    def __getstate__(self):  # the rotation cache never crosses a process boundary
        return {"timer": self.timer, "mode": self.mode, "_rotation_key": None, "_rotation": None}

    def __setstate__(self, state):
        self.__dict__.update({"mode": "auto", **state})

    def __call__(self, task: Task) -> dict:
        import torch

        from tritune.kernels.runtime import device as dev

        try:
            return self._evaluate(task)
        except Exception as e:
            reason, fatal = classify(e)
            self._rotation_key = self._rotation = None
            return {"ok": False, "error": reason, **({"restart": True} if fatal else {})}
        finally:
            if not dev.interpreted():
                try:
                    torch.cuda.empty_cache()
                except Exception:
                    pass

    def _evaluate(self, task: Task) -> dict:
        import torch

        from tritune.kernels.runtime import compare as cmp
        from tritune.kernels.runtime import device as dev
        from tritune.tuning import timing

        spec = task.spec_or_lookup()
        problem, dtype, config = task.problem, task.dtype, dict(task.config)
        if task.fp32_precision and torch.get_float32_matmul_precision() != task.fp32_precision:
            torch.set_float32_matmul_precision(task.fp32_precision)  # a worker follows its parent's setting
        why = spec.space.why_invalid(config, problem, dtype)
        if why:
            return {"ok": False, "error": f"invalid config: {why}"}
        device = dev.device()
        worst = None
        clock = time.perf_counter
        phases = {}   # seconds: the first launch (compiles the config), the reference and the check, the timing
        if task.verify:
            worst = 0.0
            case = spec.make_inputs(problem, dtype, device, task.seed)
            for o in _as_list(case.out):
                cmp.poison(o)
            t = clock()
            got = spec.run(*case.args, out=case.out, config=config, **case.kwargs)
            if not dev.interpreted():
                torch.cuda.synchronize()  # surface asynchronous launch errors inside this trial
            phases["launch_s"], t = clock() - t, clock()
            ref = spec.reference(*case.args, **case.kwargs)
            got_l, ref_l = _as_list(got), _as_list(ref)
            if len(got_l) != len(ref_l):
                return {"ok": False, "error": f"wrong answer: {len(got_l)} outputs, reference has {len(ref_l)}"}
            for i, (o, r) in enumerate(zip(got_l, ref_l)):
                c = cmp.compare(o, r, dtype, spec.accumulation(dtype), what=f"out[{i}]" if len(got_l) > 1 else "out")
                if not c.ok:
                    return {"ok": False, "error": f"wrong answer: {c}"}
                worst = max(worst, c.error)
            del case, got, ref, got_l, ref_l
            phases["check_s"] = clock() - t
        t = clock()
        mode = timing.timing_mode(spec, problem, dtype, force=self.mode)
        key = (spec.name, repr(problem), str(dtype), mode)
        if self._rotation_key != key:
            self._rotation = None
            self._rotation = timing.timing_cases(spec, problem, dtype, device, self.TIMING_SEED, mode)
            self._rotation_key = key
        fn = timing.cycling(self._rotation, lambda c: functools.partial(
            spec.run, *c.args, out=c.out, config=config, **c.kwargs))
        if self.timer is not None:
            ms, mode = float(self.timer(fn)), getattr(self.timer, "__name__", "custom")
        else:
            ms = float(timing.time_ms(fn, mode))
        if not (ms > 0 and math.isfinite(ms)):
            return {"ok": False, "error": f"timer returned {ms!r}"}
        phases["time_s"] = clock() - t
        return {"ok": True, "ms": ms, "timer": mode, "phases": {k: round(v, 4) for k, v in phases.items()},
                **({} if worst is None else {"rel_error": worst})}
