"""Compile the configs a sweep will try next in helper processes, while the sweep times others.

On the H200 three quarters of a trial's time was its first launch, which compiles the config (1,456 trials
of ``tune all --budget 30m``; docs/findings.md). The sweep knows its next configs before it
evaluates them (every study's seeds before phase 1, the unevaluated neighbours of a study's best, the
nearest buckets' winners), so :class:`Precompiler` hands them to a pool of helper processes that run the
kernel's own launcher with every triton launch turned into a compile (``warmup=True``): each compiled
kernel lands in triton's cache directory, shared with the sweep, whose own first launch of that config then
loads it instead of compiling. Nothing a helper does is trusted: the sweep still launches, verifies and times
every config itself, and a config a helper has not finished (or failed on) is simply compiled by the sweep.

Helpers are ``spawn``ed processes (CUDA does not survive a fork) on the sweep's GPU: a launcher needs real
tensors of the problem (triton specialises on pointer alignment and integer values), so a helper builds a
study's inputs once (seed 0) and keeps the last few studies'. They launch no kernel of their own (the
launches are compiles); the inputs' random fill and a launcher's own torch ops (an output allocation, a
split-K buffer's zero fill) are the only GPU work, once per study. Under the interpreter there is nothing to
compile and no helper is started.

``TRITUNE_PRECOMPILE``: the number of helpers (default: the CPU cores less two, at most 8, and at most one
per 10 GiB of GPU memory; ``0`` turns it off)."""
from __future__ import annotations

import collections
import multiprocessing
import os

ENV = "TRITUNE_PRECOMPILE"
MAX_HELPERS = 8
_INPUTS_KEPT = 3   # studies whose inputs a helper keeps


GIB_PER_HELPER = 10   # of GPU memory a default helper may take: its CUDA context and a few studies' inputs


def _gpu_memory_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def helpers_wanted() -> int:
    """Helpers to start: ``TRITUNE_PRECOMPILE`` if set (0: none), else the CPU cores less two, at most 8
    and at most one per ``GIB_PER_HELPER`` GiB of GPU memory (each holds a CUDA context and the inputs of
    its last few studies, which must not crowd out the sweep's own trials: 7 on an 80 GB H100, 8 on an
    H200, 2 on a 24 GB card); none under the interpreter or without a GPU."""
    from tritune.kernels.runtime import device as dev

    raw = os.environ.get(ENV, "").strip()
    n = None
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{ENV}={raw!r}: expected a number of helper processes >= 0 (0 turns them off)")
    if dev.interpreted() or dev.device() != "cuda":
        return 0
    if n is not None:
        return min(64, n)
    return max(0, min(MAX_HELPERS, (os.cpu_count() or 1) - 2, int(_gpu_memory_gib() // GIB_PER_HELPER)))


# ---------------------------------------------------------------------------------------------------
# In a helper process
# ---------------------------------------------------------------------------------------------------
_inputs: collections.OrderedDict = collections.OrderedDict()


def _compile_only() -> None:
    """Every ``jit_fn[grid](...)`` in this process compiles (or loads from the cache) and launches nothing."""
    from triton.runtime import jit

    def getitem(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)

    jit.KernelInterface.__getitem__ = getitem


def _helper_init(guard: dict | None = None) -> None:
    """A helper's start: it dies with the sweep's process (``guard``: :func:`runners.worker_guard`)."""
    if guard:
        from tritune.tuning.runners import die_with_parent

        die_with_parent(**guard)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _compile_only()


def compile_task(task) -> tuple[str, str | None]:
    """Run ``task``'s config through its kernel's launcher with launches turned into compiles (in a helper).
    Returns (the config's key, an error or None); an error here only means the sweep compiles it itself."""
    key = _key(task)
    try:
        import torch

        from tritune.kernels.runtime import device as dev

        if task.fp32_precision and torch.get_float32_matmul_precision() != task.fp32_precision:
            torch.set_float32_matmul_precision(task.fp32_precision)  # a launcher may pick TF32 by it
        spec = task.spec_or_lookup()
        ik = (spec.name, repr(task.problem), str(task.dtype))
        case = _inputs.get(ik)
        if case is None:
            case = spec.make_inputs(task.problem, task.dtype, dev.device(), 0)
            _inputs[ik] = case
            while len(_inputs) > _INPUTS_KEPT:
                _inputs.popitem(last=False)
        _inputs.move_to_end(ik)
        spec.run(*case.args, out=case.out, config=dict(task.config), **case.kwargs)
        return key, None
    except Exception as e:  # noqa: BLE001 - a helper's failure is the sweep's compile, nothing more
        return key, f"{type(e).__name__}: {e}"[:300]


def _key(task) -> str:
    return f"{task.kernel}|{task.problem!r}|{task.dtype}|{sorted(dict(task.config).items())!r}"


# ---------------------------------------------------------------------------------------------------
# In the sweep
# ---------------------------------------------------------------------------------------------------
class Precompiler:
    """A pool of helper processes compiling submitted configs ahead of the sweep (first submitted, first
    compiled; each config once). ``helpers=0`` is a no-op pool. Use as a context manager, or ``close()``."""

    def __init__(self, helpers: int | None = None):
        self.helpers = helpers_wanted() if helpers is None else helpers
        self.submitted: set[str] = set()
        self.done: dict[str, str | None] = {}
        self._pool = None
        if self.helpers > 0:
            from tritune.tuning.runners import worker_guard

            self._pool = multiprocessing.get_context("spawn").Pool(self.helpers, initializer=_helper_init,
                                                                   initargs=(worker_guard(),))

    def submit(self, task) -> bool:
        """Queue ``task`` (a :class:`tritune.tuning.evaluate.Task`) unless it was queued before."""
        if self._pool is None:
            return False
        key = _key(task)
        if key in self.submitted:
            return False
        self.submitted.add(key)
        task = task.__class__(**{**task.__dict__, "spec": None})  # by name: a helper imports task.module
        try:
            self._pool.apply_async(compile_task, (task,), callback=self._done)
        except Exception:  # a closed or broken pool: the sweep compiles everything itself
            self.close()
            return False
        return True

    def _done(self, res) -> None:
        key, err = res
        self.done[key] = err

    def stats(self) -> dict:
        return {"helpers": self.helpers, "submitted": len(self.submitted),
                "compiled": sum(1 for e in self.done.values() if e is None),
                "failed": sum(1 for e in self.done.values() if e is not None)}

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                pool.terminate()
                pool.join()
            except Exception:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
