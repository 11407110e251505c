"""Compiled kernels shared across launch plans: triton's own specialisation rule, read in Python.

A launcher keeps its compiled kernels per launch plan (exact shapes and strides), so a plan made for a new
shape (every prefill brings a new token count M) went through triton's launch once more (5-25 us more host time than a direct launch on
the H200 machine; the plan itself costs more: docs/findings.md), although the kernel it compiles to usually exists: triton compiles one kernel per
(constexprs and launch options, the specialisation of each runtime argument), and M moves few of those.
:data:`SHARED` keeps compiled kernels process-wide under that same key, so a new plan whose kernel exists
launches directly from its first call (:func:`tritune.kernels.runtime.launch.launch_cached`).

The key must never be coarser than triton's (that would launch a kernel specialised for other arguments:
silent garbage); finer only costs a hit. :func:`arg_spec` is triton's ``specialize_impl`` (3.5 to 3.9, the
C++ ``native_specialize_impl``) for the argument types the launchers pass, and None, the slow path, for
any other. ``TRITUNE_SHARED_KERNELS=0`` turns the cache off; ``TRITUNE_CHECK_SHARED_KERNELS=1`` asks triton
on every hit which kernel it would have launched (:func:`check_hit`) and raises where it is another.
"""
from __future__ import annotations

import os

import torch

try:  # triton's host descriptor types, specialised on dtype and block shape (and a Gluon one's layout)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # pragma: no cover
    GluonDescriptor = None


def arg_spec(arg, specialize: bool = True, align: bool = True):
    """``(type, key)`` of a runtime argument as triton's ``specialize_impl(backend, arg, is_const, specialize,
    align)`` gives it, where ``specialize`` is False for a ``do_not_specialize`` parameter and ``align`` False
    for a ``do_not_specialize_on_alignment`` one. A tensor's type is its torch dtype (triton's "*bf16" names
    it; "*k" for a const parameter is fixed per parameter). None for any other argument (the caller's slow
    path): a subclass of int, a numpy scalar, a tuple, a constexpr or a jit function in a runtime slot."""
    kind = type(arg)
    if kind is int:
        if specialize and arg == 1:  # a 1 is compiled in as a constant
            return "constexpr", 1
        if -2**31 <= arg < 2**31:
            kind = "i32"
        elif -2**63 <= arg < 2**63:
            kind = "i64"
        elif 0 <= arg < 2**64:
            kind = "u64"
        else:
            return None  # triton raises OverflowError
        return kind, ("D" if align and arg % 16 == 0 else "") if specialize else None
    if kind is bool:  # its own type in triton too (not an int): never specialised on its value
        return "u1", None
    if kind is float:
        return "fp32", None
    if arg is None:
        return "constexpr", None
    if isinstance(arg, torch.Tensor):  # a subclass too: triton takes anything with data_ptr() as a pointer
        return arg.dtype, ("D" if align and arg.data_ptr() % 16 == 0 else "") if specialize else None
    if kind is TensorDescriptor or kind is GluonDescriptor:
        block = tuple(arg.block_shape)
        if not all(type(b) is int for b in block):  # triton keys on str(list(block)): 64 and 64.0 differ there
            return None
        layout = repr(arg.layout) if kind is GluonDescriptor else None
        return "tensordesc", arg.base.dtype, block, layout
    return None


def runtime_rules(jit_fn) -> tuple | None:
    """``(specialize, align)`` of each runtime parameter of a @triton.jit function, in order, from triton's
    own reading (``JITFunction.params``); None where that reading is missing (the interpreter's wrapper) or
    a constexpr comes before a runtime parameter (a direct launch passes the runtime arguments first)."""
    params = getattr(jit_fn, "params", None)
    if not params or not all(hasattr(p, "do_not_specialize") and hasattr(p, "is_constexpr") for p in params):
        return None
    flags = [p.is_constexpr for p in params]
    runtime = flags.index(True) if True in flags else len(flags)
    if any(not c for c in flags[runtime:]):
        return None
    return tuple((not p.do_not_specialize, not p.do_not_specialize_on_alignment) for p in params[:runtime])


def knobs_state():
    """What triton's launch adds to every kernel's options from its global knobs (debug, instrumentation,
    3.9's fp sanitizer casts); None while a stages-inspection hook is set (it adds to triton's key on each
    launch: nothing is shared then)."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover
        return None
    if getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None:
        return None
    comp = knobs.compilation
    return (knobs.runtime.debug, getattr(comp, "instrumentation_mode", None),
            getattr(comp, "fpsan_homomorphic_casts", None))


class SharedKernels(dict):
    """Compiled kernels by :meth:`key`, for the whole process. ``on`` (``TRITUNE_SHARED_KERNELS``, default
    1) and ``check`` (``TRITUNE_CHECK_SHARED_KERNELS``, default 0) are read when a plan misses, so a
    benchmark or a test may flip them; ``hits`` counts the launches a shared kernel served."""

    def __init__(self):
        super().__init__()
        self.on = os.environ.get("TRITUNE_SHARED_KERNELS", "1").strip() != "0"
        self.check = os.environ.get("TRITUNE_CHECK_SHARED_KERNELS", "0").strip() not in ("", "0")
        self.hits = 0
        # id(jit_fn) -> (jit_fn, its runtime_rules): a key names the function by id (hashing a JITFunction
        # computes its source hash), and holding it here keeps that id from naming another function
        self.rules: dict = {}

    def key(self, jit_fn, args: tuple, kws: dict, variant, device):
        """The key of a launch ``jit_fn[grid](*args, **kws)`` on ``device``: the jitted function, every
        keyword (constexprs and launch options) with its type (True and 1 are equal keys otherwise), the
        caller's ``variant``, triton's global knobs and :func:`arg_spec` of each runtime argument. None when
        the cache is off or the launch has anything the rule does not know (an unhashable keyword too)."""
        if not self.on or getattr(jit_fn, "pre_run_hooks", None):
            return None
        held = self.rules.get(id(jit_fn))
        if held is None:
            held = self.rules[id(jit_fn)] = (jit_fn, runtime_rules(jit_fn))
        rules = held[1]
        if rules is None or len(rules) != len(args):
            return None
        specs = tuple(arg_spec(a, s, al) for a, (s, al) in zip(args, rules))
        state = knobs_state()
        if None in specs or state is None:
            return None
        key = (id(jit_fn), variant, device, state, tuple((k, type(v), v) for k, v in kws.items()), specs)
        try:
            hash(key)
        except TypeError:
            return None
        return key


SHARED = SharedKernels()


def check_hit(jit_fn, grid, args: tuple, kws: dict, kern) -> None:
    """Raise unless ``kern`` (a shared kernel about to run) is the compiled kernel triton's own launch of
    ``jit_fn[grid](*args, **kws)`` would run: triton's lookup without a launch (``warmup``, which compiles
    where triton's key differs and nothing is cached under it)."""
    want = jit_fn.warmup(*args, grid=grid, **kws)
    if want is not kern:
        name = getattr(getattr(jit_fn, "fn", jit_fn), "__name__", jit_fn)
        raise RuntimeError(f"shared kernel cache: {name} would launch a kernel compiled for other arguments "
                           f"(triton picks another one); arguments' specialisation "
                           f"{[arg_spec(a) for a in args]}, keywords {kws}")
