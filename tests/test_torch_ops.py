"""torch.ops.tritune.*: every kernel as a custom op (opcheck: schema, fake tensors, dynamic shapes), its
results held to the float64 references, and torch.compile(fullgraph=True) of a GPT-2 built on the ops
with no graph break and no recompilation across sequence lengths.

CPU runs use the aot_eager backend (the graph is what dynamo captures; the ops run through the
interpreter); the GPU tests compile with inductor, with and without CUDA graphs (reduce-overhead).
"""
from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from tritune import kernels as K
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S
from tritune.kernels import paged_attention as pa
from tritune.kernels import quant_matmul as qmm
from tritune.kernels import torch_ops
from tritune.references import attention as ref_attn
from tritune.references import gelu as ref_gelu
from tritune.references import gemm as ref_gemm
from tritune.references import gemv as ref_gemv
from tritune.references import layer_norm as ref_ln
from tritune.references import paged_attention as ref_pa
from tritune.references import quant as Q
from tritune.references import quant_matmul as ref_qmm

DEVICE = dev.device()
OPS = torch.ops.tritune
FP = [torch.float32, torch.float16]  # no bf16 on the CPU: the interpreter's bf16 tl.dot is wrong


def _r(shape, dtype, seed, scale=1.0):
    return S.randn(shape, dtype, DEVICE, seed, scale=scale)


def _case(name, dtype):
    """(args, kwargs, float64 reference, accumulation) for one small problem of the op."""
    acc = "tf32" if dtype == torch.float32 and name in ("gemm", "gemv", "linear", "linear_rows") and not dev.interpreted() else "ieee"
    if name == "layer_norm":
        x, w, b = _r((3, 5, 40), dtype, 0), _r((40,), dtype, 1), _r((40,), dtype, 2)
        return (x, w, b, 1e-5), {}, ref_ln.layer_norm(x, w, b, 1e-5), acc
    if name == "gemm":
        a = _r((2, 7, 48), dtype, 0)
        b = _r((40, 48), dtype, 1, 1 / math.sqrt(48)).t()  # a transposed view, as a Linear weight is
        bias, res = _r((40,), dtype, 2), _r((2, 7, 40), dtype, 3)
        return ((a, b, bias, "gelu_tanh", res), {},
                ref_gemm.gemm(a, b, bias, activation="gelu_tanh", residual=res), acc)
    if name == "gelu":
        x = _r((6, 33), dtype, 0, 3.0)
        return (x, "tanh"), {}, ref_gelu.gelu(x, "tanh"), acc
    if name == "gemv":
        x, w = _r((3, 64), dtype, 0, 2.0), _r((64, 24), dtype, 1, 1 / 8)
        bias, lw, lb = _r((24,), dtype, 2), _r((64,), dtype, 3, 0.2), _r((64,), dtype, 4, 0.1)
        want = ref_gemv.gemv(x, w, bias, activation="gelu_tanh", ln=(lw, lb, 1e-5))
        return (x, w, bias, "gelu_tanh", None, lw, lb, 1e-5), {}, want, acc
    if name in ("linear", "linear_rows"):  # gemv (3 rows) and layer_norm + gemm (2 x 7 rows) inside one op
        x = _r((3, 64) if name == "linear" else (2, 7, 64), dtype, 0, 2.0)
        w, bias, res = _r((64, 24), dtype, 1, 1 / 8), _r((24,), dtype, 2), _r((*x.shape[:-1], 24), dtype, 5)
        lw, lb = _r((64,), dtype, 3, 0.2), _r((64,), dtype, 4, 0.1)
        want = ref_gemv.gemv(x, w, bias, activation="gelu_tanh", residual=res, ln=(lw, lb, 1e-5))
        return (x, w, bias, "gelu_tanh", res, lw, lb, 1e-5), {}, want, acc
    if name == "attention":
        q, k, v = _r((2, 2, 9, 32), dtype, 0), _r((2, 2, 13, 32), dtype, 1), _r((2, 2, 13, 32), dtype, 2)
        return (q, k, v, True, 0.2), {}, ref_attn.attention(q, k, v, causal=True, scale=0.2), acc
    if name == "attention_varlen":
        lens = [5, 0, 8]
        cu = torch.tensor([0, 5, 5, 13], dtype=torch.int32, device=DEVICE)
        q, k, v = (_r((13, 2, 32), dtype, s) for s in range(3))
        return ((q, k, v, cu, cu, max(lens), max(lens), True), {},
                ref_attn.attention_varlen(q, k, v, cu, cu, 8, 8, causal=True), acc)
    if name == "paged_attention":
        c = pa.make_inputs(pa.Problem(2, 4, 2, 32, 19, 8), dtype, DEVICE, 0)
        return (*c.args, c.kwargs["scale"], False), {}, ref_pa.paged_attention(*c.args, **c.kwargs), acc
    if name == "quant_matmul":
        c = qmm.make_inputs(qmm.Problem(3, 24, 64, 4, 32, True), torch.float16, DEVICE, 0)
        x, qw, b = c.args
        words = Q.sz_words(qw)
        assert words is not None  # the packed form, which the op takes as one tensor
        return ((x, qw.data, words, None, qw.bits, qw.N, qw.K, qw.group_size, b), {},
                ref_qmm.quant_matmul(x, qw, b), acc)
    if name.startswith("fp8_"):
        return _fp8_case(name, dtype) + (acc,)
    if name in ("rms_norm", "rms_norm_add"):  # a 3-D input (rows are every leading dim), a 130-wide row
        from tritune.references import rms_norm as ref_rms

        x, w, r = _r((2, 3, 130), dtype, 0, 2.0), _r((130,), dtype, 1, 0.5), _r((2, 3, 130), dtype, 2)
        if name == "rms_norm":
            return (x, w, 1e-6), {}, ref_rms.rms_norm(x, w, 1e-6), acc
        return (x, r, w, 1e-5), {}, ref_rms.rms_norm(x, w, 1e-5, r), acc
    if name == "rotary":  # partial rotary (R 32 of D 48), GQA, positions in any order
        from tritune.kernels import rotary as rot

        c = rot.SPEC.make_inputs(rot.Problem(7, 4, 2, 48, 32), dtype, DEVICE, 0)
        return (*c.args, True), {}, rot.SPEC.reference(*c.args), acc
    raise KeyError(name)


def _fp8_case(name, dtype):
    """(args, kwargs, float64 reference) of an FP8 op: the kernel's own small inputs (e4m3 operands and
    scales from the reference quantizers), the launcher's arguments flattened as the op's schema takes them."""
    from tritune.kernels import fp8_attention as fa
    from tritune.kernels import fp8_gemm as fg
    from tritune.kernels import fp8_paged_attention as fpa
    from tritune.kernels import fp8_quant as fq

    if name.startswith("fp8_gemm"):  # per-row A, per-channel B (a weight stored (N, K)); or 128x128 blocks
        p = (fg.Problem(5, 40, 96, "row", "channel", True, "gelu_tanh", True) if name == "fp8_gemm"
             else fg.Problem(9, 136, 160, "tensor", "block", False, "none", True))
        c = fg.SPEC.make_inputs(p, dtype, DEVICE, 0, "transposed")
        a, b, sa, sb, bias = c.args
        kw = c.kwargs
        return (a, b, sa, sb, bias, kw["activation"], kw["residual"], dtype), {}, fg.SPEC.reference(*c.args, **kw)
    if name.startswith("fp8_quant"):  # fp8_quant/<mode>: the norm tuple travels as (norm, weight, bias, eps)
        mode = name.split("/")[1]
        c = fq.SPEC.make_inputs(fq.Problem(5, 96 if mode != "layer" else 130, mode), dtype, DEVICE, 1)
        norm = c.kwargs.get("norm")
        flat = (None, None, None, 1e-6) if norm is None else (
            (norm[0], norm[1], None, norm[2]) if norm[0] == "rms" else norm)
        return (*c.args, *flat, mode == "swiglu"), {}, fq.SPEC.reference(*c.args, **c.kwargs)
    if name.startswith("fp8_qgemv"):  # fp8_qgemv/<mode>: the norm tuple travels as (norm, weight, eps)
        from tritune.kernels import fp8_qgemv as fqg

        mode = name.split("/")[1]
        p = (fqg.Problem(3, 40, 96, "rms", "block", True, "gelu_tanh", True) if mode == "rms"
             else fqg.Problem(2, 72, 64, "swiglu", "channel", False, "none", True))
        c = fqg.SPEC.make_inputs(p, dtype, DEVICE, 0, "transposed")
        kw = c.kwargs
        norm = kw.get("norm")
        flat = (None, None, 1e-6) if norm is None else norm
        return ((*c.args, *flat, kw.get("swiglu", False), kw["activation"], kw["residual"]), {},
                fqg.SPEC.reference(*c.args, **kw))
    if name == "fp8_attention":  # (Hkv,) descales (seed 1), GQA, causal, Tq < Tk
        c = fa.SPEC.make_inputs(fa.Problem(1, 2, 1, 9, 13, 64, True), dtype, DEVICE, 1)
        return (*c.args, True, 0.2, dtype), {}, fa.SPEC.reference(*c.args, causal=True, scale=0.2)
    if name == "fp8_paged_attention":
        c = fpa.SPEC.make_inputs(fpa.Problem(2, 4, 2, 32, 19, 8, True), dtype, DEVICE, 0)
        return (*c.args, c.kwargs["scale"], False), {}, fpa.SPEC.reference(*c.args, **c.kwargs)
    raise KeyError(name)


FP8 = ["fp8_gemm", "fp8_gemm_block", "fp8_quant/none", "fp8_quant/rms", "fp8_quant/layer", "fp8_quant/swiglu",
       "fp8_qgemv/rms", "fp8_qgemv/swiglu", "fp8_attention", "fp8_paged_attention"]
PURE = ["layer_norm", "gemm", "gelu", "gemv", "linear", "linear_rows", "attention", "attention_varlen",
        "paged_attention", "quant_matmul", "rms_norm", "rms_norm_add", "rotary"] + FP8


def _op_of(name):
    """The op a case name runs: "linear_rows" is linear, "fp8_quant/rms" fp8_quant, "fp8_gemm_block" fp8_gemm."""
    return getattr(OPS, name.split("/")[0].replace("_rows", "").replace("_block", ""))


def _bitwise_float8(monkeypatch):
    """opcheck's schema check tells a mutated input by torch.allclose(before, after), which has no float8
    kernel on the CPU; its intent, bitwise equality, compares float8 tensors by their bytes."""
    allclose = torch.allclose

    def bitwise(a, b, *args, **kwargs):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype == a.dtype:
            return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                      b.contiguous().view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", bitwise)


def _half_only(name, dtype):
    """quant_matmul and the FP8 ops take (or give) fp16/bf16 activations; no float32 case."""
    if dtype == torch.float32 and (name == "quant_matmul" or name.startswith("fp8_")):
        pytest.skip(f"{name} takes fp16/bf16 activations")


def _builtin_specs() -> dict:
    """name -> spec of every kernel the package itself defines: the KernelSpecs held by the modules of
    tritune.kernels. The registry also holds what other code registered in this process (a plugin's
    kernels, the toy specs of the sweep tests when they share an xdist worker), which are not ours."""
    import importlib
    import pkgutil

    import tritune.kernels

    specs = {}
    for mod in pkgutil.iter_modules(tritune.kernels.__path__):
        if not mod.name.startswith("_"):
            m = importlib.import_module(f"tritune.kernels.{mod.name}")
            specs.update((v.name, v) for v in vars(m).values() if isinstance(v, K.KernelSpec))
    return specs


def test_every_kernel_is_an_op():
    specs = _builtin_specs()
    assert {"layer_norm", "gemm", "gemv", "attention", "paged_attention"} <= set(specs), sorted(specs)
    assert all(K.get(name) is spec for name, spec in specs.items())  # what launches is what is checked here
    assert set(specs) <= set(torch_ops.OPS), f"kernels without an op: {sorted(set(specs) - set(torch_ops.OPS))}"
    for name in torch_ops.OPS:
        assert hasattr(OPS, name)


def test_mutated_arguments_are_never_defaulted():
    # torch <= 2.11 indexes a mutating custom op's call arguments by schema position after the dispatcher
    # dropped those left at their defaults: an omitted mutated Optional raised IndexError on every call
    # (pytorch/pytorch#176078). The torch of a CPU run may have the fix; the schema rule holds everywhere.
    for name in torch_ops.OPS:
        for arg in getattr(OPS, name).default._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                assert not arg.has_default_value(), f"{name}: mutated argument {arg.name} has a default"


def test_every_op_is_an_explicit_inductor_fallback(monkeypatch):
    """Inductor has a lowering (our fallback, made before any graph lowers: at the first fake call) for
    every op, so it never takes its implicit-fallback path, whose log text torch <= 2.11 builds at every
    op by printing the arguments' IR recursively (exponential on a residual stream: test_hf_patch's
    test_deep_patched_model_compiles)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    monkeypatch.setitem(torch_ops._FALLBACKS, "done", False)
    monkeypatch.setattr(torch_ops, "inductor_fallbacks", lambda: calls.append(1))
    with FakeTensorMode():
        OPS.gelu(torch.empty(4, 8))
    assert calls == [1], "a fake call did not register the fallbacks"
    monkeypatch.undo()
    assert torch_ops.inductor_fallbacks()
    from torch._inductor import lowering

    missing = [n for n in torch_ops.OPS if getattr(OPS, n).default not in lowering.lowerings]
    assert not missing, f"no inductor lowering for {missing}"


@pytest.mark.parametrize("dtype", FP, ids=str)
def test_mutating_ops_called_with_defaults_left_out(dtype):
    """gemv_kv and write_kv called with every optional argument omitted (the call that raised IndexError)."""
    C = 64
    x, w = _r((2, C), dtype, 0), _r((C, 3 * C), dtype, 1, 1 / 8)
    kc, vc = _r((3, 4, 2, 32), dtype, 2), _r((3, 4, 2, 32), dtype, 3)
    slots = torch.tensor([5, -1], dtype=torch.int32, device=DEVICE)
    y = OPS.gemv_kv(x, w, kc, vc, slots)
    cmp.check(y, ref_gemm.gemm(x, w), dtype)
    assert torch.equal(kc.view(-1, C)[5], y[0, C:2 * C])
    k, v = _r((2, 2, 32), dtype, 4), _r((2, 2, 32), dtype, 5)
    assert OPS.write_kv(k, v, kc, vc, slots) is None
    assert torch.equal(kc.view(-1, C)[5], k[0].reshape(C))


@pytest.mark.parametrize("dtype", FP, ids=str)
@pytest.mark.parametrize("name", PURE)
def test_opcheck(name, dtype, monkeypatch):
    _half_only(name, dtype)
    _bitwise_float8(monkeypatch)
    args, kwargs, _, _ = _case(name, dtype)
    torch.library.opcheck(_op_of(name).default, args, kwargs)


@pytest.mark.parametrize("dtype", FP, ids=str)
@pytest.mark.parametrize("name", PURE)
def test_matches_reference(name, dtype):
    _half_only(name, dtype)
    args, kwargs, want, acc = _case(name, dtype)
    got = _op_of(name)(*args, **kwargs)
    out_dtype = dtype if isinstance(got, tuple) else got.dtype  # a pair (fp8_quant's q and scale): the input's
    cmp.check(got, want, out_dtype, acc, what=name)


def _kv_case(dtype):
    k, v = _r((5, 2, 32), dtype, 0), _r((5, 2, 32), dtype, 1)
    kc, vc = _r((4, 8, 2, 32), dtype, 2), _r((4, 8, 2, 32), dtype, 3)
    slots = torch.tensor([3, 17, -1, 8, 30], dtype=torch.int32, device=DEVICE)
    return k, v, kc, vc, slots


@pytest.mark.parametrize("dtype", FP, ids=str)
def test_write_kv_mutates_caches(dtype):
    k, v, kc, vc, slots = _kv_case(dtype)
    torch.library.opcheck(OPS.write_kv.default, (k, v, kc.clone(), vc.clone(), slots, True))
    want_k, want_v = ref_pa.write_kv(k, v, kc, vc, slots)
    before = kc._version, vc._version, k._version
    assert OPS.write_kv(k, v, kc, vc, slots) is None
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # the caches' version counters move as for any in-place op (the autograd fast path bumps them, as
    # custom_op's ADInplaceOrView kernel would), with and without grad mode; the inputs' do not
    assert kc._version > before[0] and vc._version > before[1] and k._version == before[2]
    with torch.no_grad():
        seen = kc._version
        OPS.write_kv(k, v, kc, vc, slots)
        assert kc._version > seen


@pytest.mark.parametrize("name", FP8)
def test_fp8_ops_in_bf16(name, monkeypatch):
    """The FP8 ops with bf16 activations and outputs (the serving dtype): opcheck and the reference."""
    _bitwise_float8(monkeypatch)
    args, kwargs, want, acc = _case(name, torch.bfloat16)
    torch.library.opcheck(_op_of(name).default, args, kwargs)
    cmp.check(_op_of(name)(*args, **kwargs), want, torch.bfloat16, acc, what=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp8_kv_write_mutates_caches(dtype, monkeypatch):
    """fp8_kv_write quantizes into the four cache tensors in place (declared mutated, none defaulted):
    opcheck, the float64 reference, the caches' version counters, and a call with validate left out."""
    from tritune.kernels import fp8_kv_write as fkw

    _bitwise_float8(monkeypatch)
    c = fkw.WRITE_SPEC.make_inputs(fkw.WriteProblem(2 * 8 + 1, 2, 32, 8, 1), dtype, DEVICE, 1)
    k, v, slots = c.args
    caches = tuple(t.zero_() for t in c.out)
    torch.library.opcheck(OPS.fp8_kv_write.default, (k, v, slots, *(t.clone() for t in caches), True))
    before = tuple(t._version for t in caches) + (k._version,)
    assert OPS.fp8_kv_write(k, v, slots, *caches) is None
    cmp.check(caches, fkw.WRITE_SPEC.reference(*c.args, **c.kwargs), dtype, what="fp8_kv_write")
    assert all(t._version > b for t, b in zip(caches, before)) and k._version == before[-1]


@pytest.mark.parametrize("dtype", FP, ids=str)
def test_rotary_kv_writes_the_caches(dtype):
    """rotary_kv: the rotated k and v written to the paged caches at each token's slot (-1 skipped), the
    caches declared mutated (opcheck), the rotation itself the reference's."""
    from tritune.kernels import rotary as rot

    c = rot.SPEC.make_inputs(rot.Problem(5, 4, 2, 32, 32), dtype, DEVICE, 1)
    q, k, cos, sin, pos = c.args
    v = _r((5, 2, 32), dtype, 9)
    kc, vc = torch.zeros(3, 4, 2, 32, dtype=dtype, device=DEVICE), torch.zeros(3, 4, 2, 32, dtype=dtype, device=DEVICE)
    slots = torch.tensor([6, 0, -1, 11, 3], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(OPS.rotary_kv.default, (q, k, cos, sin, pos, kc.clone(), vc.clone(), slots, v, True))
    before = kc._version
    qo, ko = OPS.rotary_kv(q, k, cos, sin, pos, kc, vc, slots, v)
    cmp.check((qo, ko), rot.SPEC.reference(*c.args), dtype, what="rotary_kv")
    assert kc._version > before
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc.view(-1, 2, 32)[s], ko[t]) and torch.equal(vc.view(-1, 2, 32)[s], v[t])
    assert not kc.view(-1, 2, 32)[[1, 2, 4, 5, 7, 8, 9, 10]].any()


def test_gemv_writes_kv_through_the_op():
    """gemv's fused KV-cache write (op gemv_kv): the op declares the caches mutated; opcheck checks the
    declaration."""
    dtype = torch.float32
    C, H, D = 64, 2, 32
    x, w, b = _r((2, C), dtype, 0), _r((C, 3 * C), dtype, 1, 1 / 8), _r((3 * C,), dtype, 2)
    kc, vc = torch.zeros(3, 4, H, D, dtype=dtype, device=DEVICE), torch.zeros(3, 4, H, D, dtype=dtype, device=DEVICE)
    slots = torch.tensor([5, 9], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(OPS.gemv_kv.default, (x, w, kc.clone(), vc.clone(), slots, b))
    y = OPS.gemv_kv(x, w, kc, vc, slots, b)
    cmp.check(y, ref_gemm.gemm(x, w, b), dtype)
    flat_k = kc.view(-1, H * D)
    assert torch.equal(flat_k[5], y[0, C:2 * C]) and torch.equal(flat_k[9], y[1, C:2 * C])
    assert torch.equal(vc.view(-1, H * D)[9], y[1, 2 * C:])


def _plan_tensors():
    """(kernel module, tensor) for every tensor a launch plan holds that is not one of its module's
    persistent per-device buffers (split-K counters, workspace)."""
    import importlib
    import pkgutil

    import tritune.kernels

    found = []
    for mod in pkgutil.iter_modules(tritune.kernels.__path__):
        m = importlib.import_module(f"tritune.kernels.{mod.name}")
        owned = {id(t) for c in vars(m).values() if isinstance(c, (K.Counters, K.Workspace))
                 for t in (*c.buffers.values(), *c.retired)}
        for plan in list(getattr(m, "_PLANS", {}).values()):
            fields = (vars(plan).values() if hasattr(plan, "__dict__")
                      else [getattr(plan, f, None) for f in plan.__slots__])
            found += [(mod.name, t) for t in fields if isinstance(t, torch.Tensor) and id(t) not in owned]
    return found


def test_launch_plans_keep_no_tensor_of_a_call():
    """A plan outlives its call: a tensor it kept (paged_attention's held the first call's context_lens)
    stays alive in whatever memory it came from. Made in a cudagraph tree's warm-up (torch.compile
    "reduce-overhead"), that is the graph's pool, which refuses it: "tensor(s) in the cudagraph pool not
    tracked as outputs" (the GPU run of HF's static-cache generate on the patched model)."""
    for name in PURE:
        args, kwargs, _, _ = _case(name, torch.float16 if name == "quant_matmul" or name.startswith("fp8_")
                                   else torch.float32)
        _op_of(name)(*args, **kwargs)
    k, v, kc, vc, slots = _kv_case(torch.float32)
    OPS.write_kv(k, v, kc, vc, slots)
    held = _plan_tensors()
    assert not held, [(m, tuple(t.shape), t.dtype) for m, t in held]


@pytest.mark.gpu
@torch.no_grad()
def test_reduce_overhead_first_launches_inside_the_graph_warmup(monkeypatch):
    """Plans made and per-device buffers first sized inside a cudagraph tree's warm-up (fresh counters
    and workspace; a split-K gemv and a paged attention without split-KV, shapes no other test uses):
    three calls (warm-up, record, replay) pass inductor's pool checks and match the float64 references."""
    from tritune.kernels import gemv as gv

    monkeypatch.setattr(gv, "_locks", K.Counters())
    monkeypatch.setattr(gv, "_workspace", K.Workspace())
    dtype = torch.float16
    x, w, b = _r((3, 4032), dtype, 0), _r((4032, 72), dtype, 1, 4032 ** -0.5), _r((72,), dtype, 2)
    c = pa.make_inputs(pa.Problem(3, 4, 2, 64, 23, 1), dtype, DEVICE, 3)
    q, kc, vc, tables, lens = c.args

    def f(x, q):
        return OPS.gemv(x, w, b), OPS.paged_attention(q, kc, vc, tables, lens, 0.125, False)

    torch._dynamo.reset()
    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        y, a = compiled(x, q)
        cmp.check(y, ref_gemm.gemm(x, w, b), dtype, what="split-K gemv under reduce-overhead")
        cmp.check(a, ref_pa.paged_attention(q, kc, vc, tables, lens, scale=0.125), dtype,
                  what="paged attention under reduce-overhead")
    assert gv.SPEC.config_for(gv.problem_of(x, w, b), dtype)["SPLIT_K"] > 1  # the counters were used


def test_bad_input_names_the_argument():
    a, b = _r((4, 8), torch.float32, 0), _r((9, 5), torch.float32, 1)
    with pytest.raises(ValueError, match="inner sizes"):
        OPS.gemm(a, b)
    with pytest.raises(ValueError, match="activation"):
        OPS.gemm(a, _r((8, 5), torch.float32, 1), None, "relu")


# ---------------------------------------------------------------------------------------------------
# torch.compile over a GPT-2 written on the ops
# ---------------------------------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, C, H, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        p = lambda *s, scale=1.0: torch.nn.Parameter(torch.randn(*s, generator=g) * scale, requires_grad=False)
        self.H = H
        self.ln1_w, self.ln1_b, self.ln2_w, self.ln2_b = p(C, scale=0.2), p(C, scale=0.1), p(C, scale=0.2), p(C, scale=0.1)
        self.w_qkv, self.b_qkv = p(C, 3 * C, scale=C ** -0.5), p(3 * C, scale=0.1)
        self.w_o, self.b_o = p(C, C, scale=C ** -0.5), p(C, scale=0.1)
        self.w_fc, self.b_fc = p(C, 4 * C, scale=C ** -0.5), p(4 * C, scale=0.1)
        self.w_pr, self.b_pr = p(4 * C, C, scale=(4 * C) ** -0.5), p(C, scale=0.1)

    def forward(self, x):
        B, T, C = x.shape
        h = OPS.layer_norm(x, self.ln1_w, self.ln1_b, 1e-5)
        qkv = OPS.gemm(h, self.w_qkv, self.b_qkv)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in qkv.split(C, dim=2))
        a = OPS.attention(q, k, v, True, None).transpose(1, 2).reshape(B, T, C)
        x = OPS.gemm(a, self.w_o, self.b_o, None, x)
        h = OPS.layer_norm(x, self.ln2_w, self.ln2_b, 1e-5)
        f = OPS.gemm(h, self.w_fc, self.b_fc, "gelu_tanh")
        return OPS.gemm(f, self.w_pr, self.b_pr, None, x)


class TinyGPT2(torch.nn.Module):
    def __init__(self, vocab=96, C=64, H=2, layers=2, ctx=64):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.wte = torch.nn.Parameter(torch.randn(vocab, C, generator=g) * 0.5, requires_grad=False)
        self.wpe = torch.nn.Parameter(torch.randn(ctx, C, generator=g) * 0.1, requires_grad=False)
        self.blocks = torch.nn.ModuleList(Block(C, H, 10 + i) for i in range(layers))
        self.lnf_w = torch.nn.Parameter(torch.ones(C), requires_grad=False)
        self.lnf_b = torch.nn.Parameter(torch.zeros(C), requires_grad=False)

    def forward(self, ids):
        x = F.embedding(ids, self.wte) + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return OPS.gemm(OPS.layer_norm(x, self.lnf_w, self.lnf_b, 1e-5), self.wte.t())


def _compile_and_check(model, inputs, dtype, backend, mode=None):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend) if mode is None else None
    compiled = torch.compile(model, backend=counter or backend, mode=mode, fullgraph=True, dynamic=True)
    first = None
    for x in inputs:
        got = compiled(x)
        first = first if first is not None or counter is None else counter.frame_count
        want = model(x)
        cmp.check(got, want.double(), dtype, "tf32" if dtype == torch.float32 and not dev.interpreted() else "ieee",
                  what=f"compiled vs eager {tuple(x.shape)}")
    if counter is not None:
        # one compile (dynamo may restart its analysis of the first call, which counts as a frame)
        assert counter.frame_count == first, f"recompiled: {counter.frame_count - first} more graphs after the first"
    return compiled


def test_compile_block_fullgraph_no_recompile():
    model = Block(64, 2, 0).to(DEVICE)
    xs = [_r((2, t, 64), torch.float32, t) for t in (5, 11, 17)]
    _compile_and_check(model, xs, torch.float32, "aot_eager")


def test_compile_gpt2_fullgraph_no_recompile():
    model = TinyGPT2().to(DEVICE)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (2, t), generator=g).to(DEVICE) for t in (3, 9, 16)]
    _compile_and_check(model, ids, torch.float32, "aot_eager")


class Fp8Linear(torch.nn.Module):
    """A W8A8 linear on the FP8 ops: RMSNorm fused into the per-token quantization, the scaled GEMM with a
    per-channel weight scale, bias and residual."""

    def __init__(self, C=96, N=40):
        super().__init__()
        from tritune.references import fp8 as ref_fp8

        g = torch.Generator().manual_seed(3)
        w8, ws = ref_fp8.quantize_channels(torch.randn(C, N, generator=g) / math.sqrt(C))
        self.register_buffer("w8", w8.t().contiguous())  # stored (N, K), passed transposed
        self.register_buffer("ws", ws)
        self.register_buffer("norm_w", (1 + 0.1 * torch.randn(C, generator=g)).half())
        self.register_buffer("bias", torch.randn(N, generator=g).half())

    def forward(self, x):
        q, s = OPS.fp8_quant(x, "rms", self.norm_w, None, 1e-6, False)
        return OPS.fp8_gemm(q, self.w8.t(), s, self.ws, self.bias, "none", x[:, : self.w8.shape[0]], torch.float16)


def test_compile_fp8_linear_fullgraph_no_recompile():
    model = Fp8Linear().to(DEVICE)
    xs = [_r((m, 96), torch.float16, m) for m in (5, 11, 17)]
    _compile_and_check(model, xs, torch.float16, "aot_eager")


def test_explain_reports_no_graph_break():
    model = TinyGPT2().to(DEVICE)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(torch.randint(0, 96, (1, 6)).to(DEVICE))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_compile_gpt2_inductor_gpu(mode, dtype):
    model = TinyGPT2(vocab=512, C=256, H=4, layers=2, ctx=512).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 512, (4, t), generator=g).to(DEVICE) for t in (7, 64, 200, 333)]
    _compile_and_check(model, ids, dtype, "inductor", mode)
    if mode is None:  # the counter checks recompilation with inductor too
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
        compiled(ids[0])
        first = counter.frame_count
        for x in ids[1:]:
            compiled(x)
        assert counter.frame_count == first


# ---------------------------------------------------------------------------------------------------
# The engine's compile mode on the triton backend: its decode pieces on these ops
# ---------------------------------------------------------------------------------------------------
def _engine_compile_matches_alone(monkeypatch, n_layer, n_embd, n_head, ps, news, max_num_seqs):
    """Engine(compile=True) on the triton backend: the decodes on the compiled pieces, whose attention is
    the paged-attention kernel (through torch.ops.tritune), each request's greedy tokens equal to the
    request alone through the torch backend's own prefill and decode, and one compile per piece over
    batches 1..max_num_seqs and growing contexts (no recompile)."""
    import torch._dynamo

    from tests.test_engine import alone, tiny_model
    from tritune.kernels import paged_attention as pa_mod
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    kw = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=64)
    m, ref = tiny_model("triton", **kw), tiny_model("torch", **kw)
    eng = Engine(m, num_blocks=64, block_size=4, max_num_seqs=max_num_seqs, cuda_graphs=False, compile=True)
    assert eng.runner.compiled is not None, eng.notes
    assert any("torch.ops.tritune" in n for n in eng.notes), eng.notes
    calls = []
    kernel = pa_mod.paged_attention    # the op's body calls it through the module: count the calls there
    monkeypatch.setattr(pa_mod, "paged_attention", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    res = eng.generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news])
    for p, n, r in zip(ps, news, res):
        assert r.token_ids == alone(ref, p, n)
    assert len(calls) >= n_layer * (max(news) - 1), f"paged attention ran {len(calls)} times"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3        # layer in, layer out, head


def test_engine_compile_mode_runs_the_kernels_as_ops(monkeypatch):
    from tests.test_engine import prompts

    _engine_compile_matches_alone(monkeypatch, 1, 32, 2, prompts(3, seed=21, lo=2, hi=7), [4, 2, 3], max_num_seqs=3)


@pytest.mark.gpu
def test_engine_compile_mode_runs_the_kernels_as_ops_gpu(monkeypatch):
    from tests.test_engine import prompts

    _engine_compile_matches_alone(monkeypatch, 2, 128, 2, prompts(6, seed=22, lo=2, hi=30), [3, 9, 1, 14, 6, 11],
                                  max_num_seqs=4)


# ---------------------------------------------------------------------------------------------------
# attention_varlen's validate through the op: None (check a cu_seqlens tensor once) unless told otherwise
def _varlen_counting_reads(monkeypatch, validate):
    """Calls the op twice with the same cu_seqlens tensors (``validate`` left out when it is "default");
    returns the launcher's validate argument of each call and how many times the cu_seqlens values were
    read back to the host (.tolist() / .item() on them), each result held to the float64 reference.

    On the CPU the launcher reads the values on every call (a read there costs no sync), so there the
    launcher's choice is made as on a GPU, from the validate it was given: what is counted is what the op
    would read back on a GPU."""
    from tritune.kernels import attention as A

    cq = torch.tensor([0, 5, 5, 13], dtype=torch.int32, device=DEVICE)
    ck = torch.tensor([0, 6, 9, 17], dtype=torch.int32, device=DEVICE)
    q, k, v = _r((13, 2, 32), torch.float16, 0), _r((17, 2, 32), torch.float16, 1), _r((17, 2, 32), torch.float16, 2)
    want = ref_attn.attention_varlen(q, k, v, cq, ck, 8, 9, causal=True)  # reads cu_seqlens: before counting
    given, reads = [], []
    launcher, cached = A.attention_varlen, A.varlen.longest_cached
    tolist, item = torch.Tensor.tolist, torch.Tensor.item

    def spy(*a, **kw):
        given.append(kw.get("validate", "missing"))
        return launcher(*a, **kw)

    def on_gpu(name, cu, total, always):
        return cached(name, cu, total, always if cu.is_cuda else given[-1] is True)

    def counted(real):
        def read(self, *a):
            if self is cq or self is ck:
                reads.append(real.__name__)
            return real(self, *a)
        return read

    monkeypatch.setattr(A, "attention_varlen", spy)
    monkeypatch.setattr(A.varlen, "longest_cached", on_gpu)
    monkeypatch.setattr(torch.Tensor, "tolist", counted(tolist))
    monkeypatch.setattr(torch.Tensor, "item", counted(item))
    A._CHECKED.clear()  # no tensor of an earlier test whose id these reuse
    kw = {} if validate == "default" else {"validate": validate}
    for _ in range(2):
        cmp.check(OPS.attention_varlen(q, k, v, cq, ck, 8, 9, True, **kw), want, torch.float16, what=str(validate))
    return given, reads


@pytest.mark.parametrize("validate, launcher_gets, reads", [("default", None, 2), (True, True, 4), (False, False, 0)])
def test_varlen_op_reads_cu_seqlens_once_by_default(monkeypatch, validate, launcher_gets, reads):
    """The op's default is the launcher's (validate=None): the first call reads each cu_seqlens tensor
    back once, the second reads nothing (no host sync per call); True reads on every call, False never."""
    given, counted = _varlen_counting_reads(monkeypatch, validate)
    assert given == [launcher_gets] * 2
    assert len(counted) == reads, counted


def test_varlen_op_default_is_the_launchers():
    import inspect

    arg = next(a for a in OPS.attention_varlen.default._schema.arguments if a.name == "validate")
    assert str(arg.type) == "Optional[bool]" and arg.default_value is None, (arg.type, arg.default_value)
    assert inspect.signature(torch_ops.EAGER["attention_varlen"]).parameters["validate"].default is None


# --- the runtime path: the body at the device keys, an autograd fast path, custom_op for the rest --------
MUTATING = ("gemv_kv", "write_kv", "fp8_kv_write", "rotary_kv")


@pytest.mark.skipif(not torch_ops.LEAN, reason="the lean dispatch path is off on this torch (TRITUNE_LEAN_DISPATCH=1 forces it)")
def test_the_device_keys_run_the_bodies_not_custom_ops_wrappers():
    """Structural form of the host-cost check: at CPU and CUDA the registered kernel is the op's body
    itself (torch_ops.EAGER), at AutogradCPU/AutogradCUDA the fast path; a mutating op keeps custom_op's
    ADInplaceOrView kernel (the version bump of what it writes) for the calls the fast path hands on."""
    for name in torch_ops.OPS:
        qual = f"tritune::{name}"
        for d in ("CPU", "CUDA"):
            assert torch_ops.registered(name, d) is torch_ops.EAGER[name], (name, d)
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, d)
            fast = torch_ops.registered(name, "Autograd" + d)
            assert fast is not None and fast.__name__ == f"{name}_autograd_fast", (name, d)
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Autograd" + d)
        if name in MUTATING:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "ADInplaceOrView")


def _stub_ops(tag):
    """Two custom ops over one stub body (counting its calls): ``plain`` as custom_op registers it,
    ``lean`` with torch_ops' registration on top."""
    calls = []
    out = torch.ones(4)

    def body(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        calls.append(type(x))
        return out.clone() if x.requires_grad else out.new_empty(0)

    ops, lib = {}, torch.library.Library(f"tritune_stub_{tag}", "FRAGMENT")
    for kind in ("plain", "lean"):
        op = torch.library.custom_op(f"tritune_stub_{tag}::{kind}", mutates_args=())(body)
        op.register_fake(lambda x, w, bias=None, residual=None: x.new_empty(4))
        if kind == "lean":
            torch_ops._lean(kind, op, body, mutating=False, lib=lib)
        ops[kind] = op
    return ops, calls, lib


def _python_calls(fn, args) -> int:
    """Python frames one call enters (sys.setprofile): the host layers a call goes through, counted, not
    timed, so a loaded machine cannot change the answer."""
    import sys

    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1

    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return n[0]


def test_host_cost_through_torch_ops_is_near_the_body_call():
    """A stub body (no launch): through torch.ops the lean op's call is the dispatcher's call into one Python
    kernel and the body, where custom_op's path goes through its Python layers (CPU, measured: ~2.6 against
    ~8.7 us a call). Counted in Python frames rather than timed (a timed bound breaks on a loaded 2-core
    machine): the lean op enters a few frames, under a third of custom_op's, and under inference_mode (no
    autograd kernel) no more than without it."""
    ops, calls, lib = _stub_ops("cost")
    x, w, b = torch.randn(16, 8), torch.randn(8, 8), torch.randn(8)
    plain, lean = ops["plain"]._opoverload, ops["lean"]._opoverload
    with torch.no_grad():
        lean(x, w, b, x)
        assert len(calls) == 1
        plain(x, w, b, x)
        n_plain, n_lean = _python_calls(plain, (x, w, b, x)), _python_calls(lean, (x, w, b, x))
    with torch.inference_mode():
        n_inf = _python_calls(lean, (x, w, b, x))
    assert n_lean * 3 <= n_plain, (n_lean, n_plain)
    assert n_inf <= n_lean, (n_inf, n_lean)
    lib._destroy()


def test_fast_path_hands_fakes_modes_and_grads_to_custom_op():
    """The fast path runs the body only for plain tensors with no gradient wanted: a fake tensor still
    gets the fake, a dispatch mode still sees the op, and an input that requires grad gets custom_op's
    grad_fn (whose backward says no formula is registered, as before)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    ops, calls, lib = _stub_ops("paths")
    lean = ops["lean"]._opoverload
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    with FakeTensorMode() as mode:
        y = lean(mode.from_tensor(x), mode.from_tensor(w))
    assert y.shape == (4,) and not calls  # the fake, never the body

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Log():
        lean(x, w)
    assert lean in seen and len(calls) == 1

    lean(x, w)  # grad mode on, nothing requires grad: the fast path, no grad_fn
    assert len(calls) == 2
    xg = x.clone().requires_grad_()
    y = lean(xg, w)
    assert len(calls) == 3 and y.grad_fn is not None
    with pytest.raises(RuntimeError, match="no autograd formula"):
        y.sum().backward()
    with torch.no_grad():
        assert lean(xg, w).grad_fn is None and len(calls) == 4
    lib._destroy()


def test_op_with_a_backward_still_differentiates():
    """An op given a backward after the lean registration (register_autograd): the slow path is
    custom_op's own autograd kernel, which reads the formula when the call comes."""
    def body(x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        return x * (2.0 if scale is None else scale)

    lib = torch.library.Library("tritune_stub_grad", "FRAGMENT")
    op = torch.library.custom_op("tritune_stub_grad::scale", mutates_args=())(body)
    op.register_fake(lambda x, scale=None: torch.empty_like(x))
    torch_ops._lean("scale", op, body, mutating=False, lib=lib)
    op.register_autograd(lambda ctx, g: (g * 3.0, None), setup_context=lambda ctx, inputs, output: None)
    x = torch.randn(5, requires_grad=True)
    op(x, 3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 3.0))
    torch.library.opcheck(op, (torch.randn(5), 3.0))
    lib._destroy()
