"""Compiled kernels shared across launch plans (kernels/runtime/specialize.py): the key is triton's own
specialisation, never coarser.

On the CPU: :func:`arg_spec` against the installed triton's ``native_specialize_impl`` (two arguments get
the same key exactly where triton specialises them alike), the key's do_not_specialize handling, and
``launch_cached`` run against a stand-in for triton's launch that keeps one "compiled kernel" per key of
triton's own binder: every launch, direct or not, runs the kernel triton would. On a GPU: gemm and fp8_gemm
over many M with ``TRITUNE_CHECK_SHARED_KERNELS``' check on (triton asked on every shared hit), each output
against the reference.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from tritune.kernels.runtime import launch as L
from tritune.kernels.runtime import specialize as S
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev

BIG = [2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**32, 2**63 - 16, 2**63, 2**64 - 16, 2**64 - 1]
INTS = [0, 1, 2, 15, 16, 17, 32, 33, -1, -16, -17, 4096, 4097] + BIG


def _buf():
    return torch.empty(64, dtype=torch.float32)


def _values():
    """Runtime arguments of every kind a launcher passes: ints around each of triton's edges, bools, floats,
    None, tensors of several dtypes at 16-byte aligned and unaligned addresses, host descriptors."""
    base = _buf()
    half = torch.empty(64, dtype=torch.float16)
    tensors = [base, base[1:], base[4:], half, half[1:], half[8:], torch.empty(8, dtype=torch.int32),
               torch.nn.Parameter(torch.empty(8))]
    descs = []
    if S.TensorDescriptor is not None:
        t = torch.empty(64, 64, dtype=torch.float16)
        descs = [S.TensorDescriptor.from_tensor(t, [16, 32]), S.TensorDescriptor.from_tensor(t[:32], [16, 32]),
                 S.TensorDescriptor.from_tensor(t, [32, 32]),
                 S.TensorDescriptor.from_tensor(torch.empty(64, 64, dtype=torch.bfloat16), [16, 32])]
    return INTS + [True, False, 0.5, 1.0, 2.0, None] + tensors + descs


def _triton_spec(arg, specialize=True, align=True):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, arg, False, specialize, align)


def test_arg_spec_separates_what_triton_specialises():
    keys = {v: S.arg_spec(v) for v in INTS}
    assert keys[1] != keys[2] and keys[1] == ("constexpr", 1)
    assert keys[16] != keys[17] and keys[16] == keys[32] and keys[17] == keys[33] == keys[4097] != keys[4096]
    assert keys[2**31] != keys[33] and keys[2**31] == ("i64", "D") and keys[2**31 - 1] == ("i32", "")
    assert keys[2**63] == ("u64", "D") and S.arg_spec(2**64) is None and S.arg_spec(-2**63 - 1) is None
    base = _buf()
    assert S.arg_spec(base) == (torch.float32, "D") and S.arg_spec(base[1:]) == (torch.float32, "")
    assert S.arg_spec(base[4:]) == S.arg_spec(base) != S.arg_spec(base.half())
    assert S.arg_spec(True) == S.arg_spec(False) == ("u1", None) != S.arg_spec(1)
    assert S.arg_spec(0.5) == S.arg_spec(2.0) == ("fp32", None)
    # do_not_specialize: the type only (no 1, no 16-divisibility); on alignment only: never "D"
    assert S.arg_spec(1, False) == S.arg_spec(16, False) == ("i32", None) != S.arg_spec(2**40, False)
    assert S.arg_spec(16, True, False) == S.arg_spec(17, True, False) == ("i32", "")
    assert S.arg_spec(base, False) == S.arg_spec(base[1:], False) == (torch.float32, None)
    assert S.arg_spec(base, True, False) == S.arg_spec(base[1:], True, False)
    import numpy as np

    for unknown in (np.int64(3), (1, 2), object(), torch.float16, triton.language.constexpr(4)):
        assert S.arg_spec(unknown) is None


@pytest.mark.parametrize("specialize,align", [(True, True), (False, True), (True, False), (False, False)])
def test_arg_spec_keys_pairs_exactly_as_the_installed_triton(specialize, align):
    """For every pair of values: the same arg_spec iff the same triton specialisation."""
    vals = _values()

    def theirs(v):
        return _triton_spec(v, specialize, align)

    for a, b in itertools.combinations(vals, 2):
        ours_same = S.arg_spec(a, specialize, align) == S.arg_spec(b, specialize, align)
        assert ours_same == (theirs(a) == theirs(b)), (a, b)
    for v in INTS:  # the very values, not only the classes
        assert S.arg_spec(v, specialize, align) == theirs(v), v
    for v in (True, 0.5, None):
        assert S.arg_spec(v, specialize, align) == theirs(v), v


def _toy(X, Y, n, m, scale, flag, BLOCK: tl.constexpr):
    pass


def _jit(**kw):
    return JITFunction(_toy, **kw)


def test_key_follows_do_not_specialize_and_refuses_what_it_does_not_know(monkeypatch):
    monkeypatch.setattr(S.SHARED, "on", True)
    fn, dns = _jit(), _jit(do_not_specialize=["n"])
    x, y = _buf(), _buf()

    def key(f, *ints, kws=None, args=None):
        return S.SHARED.key(f, args or (x, y, *ints, 0.5, True), kws or {"BLOCK": 16, "num_warps": 4}, 0, 0)

    assert key(fn, 17, 3) == key(fn, 33, 3) != key(fn, 16, 3)
    assert key(fn, 17, 3) != key(fn, 1, 3) and key(fn, 17, 3) != key(fn, 2**31 + 1, 3)
    assert key(dns, 17, 3) == key(dns, 16, 3) == key(dns, 1, 3) != key(dns, 2**31, 3)
    assert key(fn, 17, 3) != key(dns, 17, 3)  # the function itself is in the key
    assert key(fn, 17, 3) != key(fn, 17, 3, args=(x[1:], y, 17, 3, 0.5, True))
    assert key(fn, 17, 3) != key(fn, 17, 3, args=(x.half(), y, 17, 3, 0.5, True))
    assert key(fn, 17, 3) == key(fn, 17, 3, args=(x, y, 17, 3, 2.0, False))
    assert key(fn, 17, 3) != key(fn, 17, 3, kws={"BLOCK": 32, "num_warps": 4})
    assert key(fn, 17, 3, kws={"BLOCK": True}) != key(fn, 17, 3, kws={"BLOCK": 1})  # equal in Python
    assert key(fn, 17, 3) != S.SHARED.key(fn, (x, y, 17, 3, 0.5, True), {"BLOCK": 16, "num_warps": 4}, 1, 0)
    assert key(fn, 17, 3, args=(x, y, 17, 3, 0.5, (1, 2))) is None  # a tuple: the slow path
    assert key(fn, 17, 3, kws={"BLOCK": [16]}) is None  # unhashable
    assert S.SHARED.key(fn, (x, y, 17), {"BLOCK": 16}, 0, 0) is None  # not every runtime argument
    assert S.SHARED.key(_toy, (x, y, 17, 3, 0.5, True), {}, 0, 0) is None  # no triton reading of the params
    monkeypatch.setattr(S.SHARED, "on", False)
    assert key(fn, 17, 3) is None


class _Kernel:
    """A stand-in compiled kernel: what keepable() asks for."""

    def __init__(self, name):
        self.name, self.run, self.packed_metadata = name, None, None


class _Triton:
    """triton's launch of one JITFunction, with triton's own binder and cache key (its real code on a CPU
    backend) and a "compiled kernel" per key: records which kernel each launch ran."""

    def __init__(self, fn):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        self.binder = create_function_from_signature(fn.signature, fn.params, BaseBackend)
        self.key, self.cache, self.ran, self.kernels = compute_cache_key, {}, [], {}

    def lookup(self, args, kws):
        _, spec, options = self.binder(*args, **kws)
        key = self.key(self.kernels, spec, options)
        return self.cache.setdefault(key, _Kernel(key))

    def run(self, *args, grid, warmup, **kws):
        kern = self.lookup(args, kws)
        if not warmup:
            self.ran.append(kern)
        return kern


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0


def test_launch_cached_runs_the_kernel_triton_would_for_each_new_plan(monkeypatch):
    fn = _jit(do_not_specialize=["m"])
    fake = _Triton(fn)
    monkeypatch.setattr(fn, "run", fake.run)
    monkeypatch.setattr(fn, "warmup", lambda *a, grid, **k: fake.run(*a, grid=grid, warmup=True, **k))
    direct = []
    monkeypatch.setattr(L, "launch_direct", lambda kern, grid, stream, args: direct.append(kern))
    monkeypatch.setattr(S, "SHARED", S.SharedKernels())
    monkeypatch.setattr(L, "SHARED", S.SHARED)
    S.SHARED.on = S.SHARED.check = True
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    x = _buf()
    for n, m, off, block in itertools.product([1, 7, 16, 17, 33, 48, 2**31 + 3, 2**33], [1, 5, 32], [0, 1, 4],
                                              [16, 32]):
        plan = {}  # a new plan per launch: its first launch is the shared cache's or triton's
        args = (x[off:], x, n, m, 0.5, False)
        kws = {"BLOCK": block, "num_warps": 4}
        want = fake.lookup(args, kws)
        ran, launched = len(fake.ran), len(direct)
        L.launch_cached(fn, plan, (1,), args, kws, (block,), 0, (args[0], x))
        assert len(fake.ran) - ran + len(direct) - launched == 1
        assert (fake.ran[-1] if len(fake.ran) > ran else direct[-1]) is want, (n, m, off, block)
    assert S.SHARED.hits == len(direct) > 0 and len(fake.ran) == len(fake.cache)


def test_a_wrong_shared_kernel_is_caught_by_the_check(monkeypatch):
    fn = _jit()
    fake = _Triton(fn)
    monkeypatch.setattr(fn, "warmup", lambda *a, grid, **k: fake.run(*a, grid=grid, warmup=True, **k))
    x = _buf()
    args, kws = (x, x, 17, 3, 0.5, False), {"BLOCK": 16}
    S.check_hit(fn, (1,), args, kws, fake.lookup(args, kws))
    with pytest.raises(RuntimeError, match="compiled for other arguments"):
        S.check_hit(fn, (1,), (x, x, 16, 3, 0.5, False), kws, fake.lookup(args, kws))


# ---------------------------------------------------------------------------------------------------
# On a GPU: real kernels, every shared hit checked against triton's own pick, outputs against the reference
# ---------------------------------------------------------------------------------------------------
# the brief's M values and, beside each, one of the same power-of-two bucket and 16-divisibility (a shared hit)
GPU_MS = [1, 7, 5, 16, 33, 35, 64, 48, 100, 97, 1000, 1001, 4096, 4000]
GPU_NK = [(768, 3072), (3072, 768)]


@pytest.fixture
def checked(monkeypatch):
    monkeypatch.setattr(S.SHARED, "on", True)
    monkeypatch.setattr(S.SHARED, "check", True)
    hits = S.SHARED.hits
    yield
    assert S.SHARED.hits > hits, "no launch found a shared kernel: the check never ran"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (direct launches of compiled kernels)")
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias+gelu+residual"])
def test_gpu_gemm_new_m_values_share_kernels_and_match_the_reference(checked, epilogue):
    from tritune.kernels import gemm as G

    for (n, k), m in itertools.product(GPU_NK, GPU_MS):
        p = G.Problem(m, n, k, bias=epilogue, act="gelu_tanh" if epilogue else None, residual=epilogue)
        case = G.make_inputs(p, torch.bfloat16, "cuda", m)
        cmp.poison(case.out)
        got = G.gemm(*case.args, out=case.out, **case.kwargs)
        cmp.check(got, G.ref.gemm(*case.args, **case.kwargs), torch.bfloat16,
                  G.SPEC.accumulation(torch.bfloat16), what=f"gemm {p}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (direct launches of compiled kernels)")
@pytest.mark.parametrize("epilogue", [False, True], ids=["plain", "bias+gelu+residual"])
def test_gpu_fp8_gemm_new_m_values_share_kernels_and_match_the_reference(checked, epilogue):
    from tritune.kernels import fp8_gemm as F

    for (n, k), m in itertools.product(GPU_NK, GPU_MS):
        p = F.Problem(m, n, k, "row", "channel", epilogue, "gelu_tanh" if epilogue else "none", epilogue)
        case = F.SPEC.make_inputs(p, torch.bfloat16, "cuda", seed=m)
        got = F.fp8_gemm(*case.args, **case.kwargs)
        cmp.check(got, F.SPEC.reference(*case.args, **case.kwargs), torch.bfloat16,
                  F.SPEC.accumulation(torch.bfloat16), what=f"fp8_gemm {p}")


def test_interpreter_launches_take_triton_path():
    """Under the interpreter a plan keeps no compiled kernels (kernels=None): nothing is shared."""
    if not dev.interpreted():
        pytest.skip("the interpreter's path")
    before = len(S.SHARED)
    from tritune.kernels import gemm as G

    case = G.make_inputs(G.Problem(5, 16, 16), torch.float32, "cpu", 0)
    G.gemm(*case.args, **case.kwargs)
    assert len(S.SHARED) == before
