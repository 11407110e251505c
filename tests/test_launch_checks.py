"""Launch-time refusals that keep a result from being silently wrong.

- an ``out`` that overlaps an input is refused with a ValueError naming it (``gemm(x, w, out=x)`` wrote
  tiles that other programs still read), except the documented in-place cases: ``out=residual`` for
  gemm and gemv, ``out=x`` for the elementwise gelu;
- a stored tuned config that is no valid point of the kernel's space is reported once per process (a
  warning naming the kernel, bucket, dtype and why) and the heuristic default runs instead.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tritune import kernels as K
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels import attention as A
from tritune.kernels import gelu as GE
from tritune.kernels import gemm as G
from tritune.kernels import gemv as GV
from tritune.kernels import layer_norm as LN
from tritune.kernels import paged_attention as PA
from tritune.kernels import quant_matmul as QM

DEV = dev.device()


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def test_gemm_refuses_out_aliasing_an_input_and_keeps_residual_in_place():
    x, w = _r(6, 16), _r(16, 16, seed=1) / 4
    with pytest.raises(ValueError, match=r"^out: overlaps a in memory"):
        G.gemm(x, w, out=x)
    with pytest.raises(ValueError, match=r"^out: overlaps b"):
        G.gemm(_r(16, 16, seed=5), w, out=w)
    buf = _r(7, 16, seed=2)  # out one row into a's buffer: a partial overlap
    with pytest.raises(ValueError, match=r"^out: overlaps a"):
        G.gemm(buf[:6], w, out=buf[1:])
    rbuf = _r(7, 16, seed=3)  # out one row past the residual in one buffer: not the residual itself
    with pytest.raises(ValueError, match=r"^out: overlaps residual .*or residual itself"):
        G.gemm(x, w, residual=rbuf[:6], out=rbuf[1:])
    r = _r(6, 16, seed=4)
    # the same view as residual: the residual stream updated in place
    want = G.ref.gemm(x, w, residual=r)
    assert G.gemm(x, w, residual=r, out=r) is r
    cmp.check(r, want, torch.float32, G.SPEC.accumulation(torch.float32))
    # a plan cached for separate buffers does not let an aliasing call through later
    out = torch.empty(6, 16, device=DEV)
    G.gemm(x, w, out=out)
    with pytest.raises(ValueError, match=r"^out: overlaps a"):
        G.gemm(x, w, out=x)


def test_gemv_refuses_out_aliasing_and_keeps_residual_in_place():
    x, w = _r(2, 16), _r(16, 16, seed=1) / 4
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        GV.gemv(x, w, out=x)
    r = _r(2, 16, seed=2)
    want = GV.ref.gemv(x, w, residual=r)
    GV.gemv(x, w, residual=r, out=r)
    cmp.check(r, want, torch.float32)


def test_elementwise_and_normalisation_outputs():
    x = _r(4, 33)
    want = GE.ref.gelu(x)
    assert GE.gelu(x, out=x) is x  # in place, elementwise
    cmp.check(x, want, torch.float32)
    flat = _r(96, seed=1)
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        GE.gelu(flat[:64], out=flat[32:])
    y = _r(4, 64, seed=1)
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        LN.layer_norm(y, out=y)
    buf = _r(4 * 64, seed=2)
    with pytest.raises(ValueError, match=r"^out: overlaps weight"):
        LN.layer_norm(y, buf[:64], out=buf.view(4, 64))


def test_attention_paged_and_quant_refuse_out_aliasing():
    q = _r(1, 2, 16, 32)
    k, v = _r(1, 2, 16, 32, seed=1), _r(1, 2, 16, 32, seed=2)
    with pytest.raises(ValueError, match=r"^out: overlaps q"):
        A.attention(q, k, v, out=q)
    with pytest.raises(ValueError, match=r"^out: overlaps v"):
        A.attention(q, k, v, out=v)
    qp, kp, vp = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"^out: overlaps k"):
        A.attention_varlen(qp, kp, vp, cu, cu, 16, 16, out=kp)
    case = PA.SPEC.make_inputs(PA.SPEC.small_problems[0], torch.float32, DEV, 0)
    qd = case.args[0]
    with pytest.raises(ValueError, match=r"^out: overlaps q"):
        PA.paged_attention(*case.args, **{**case.kwargs, "out": qd})
    qcase = QM.SPEC.make_inputs(QM.SPEC.small_problems[1], torch.float16, DEV, 0)
    xq = qcase.args[0]
    n = qcase.out.shape[-1]
    m, kq = xq.shape
    big = torch.empty(m * kq + m * n, dtype=torch.float16, device=DEV)  # x, then out starting inside x
    big[:m * kq] = xq.reshape(-1)
    with pytest.raises(ValueError, match=r"^out: overlaps x"):
        QM.quant_matmul(big[:m * kq].view(m, kq), *qcase.args[1:], out=big[8:8 + m * n].view(m, n))


def test_invalid_stored_config_is_reported_once_and_not_used(monkeypatch):
    from tritune.kernels.runtime import store

    p = G.Problem(9, 24, 40)
    bucket = K.bucket_key(G.bucket(p))
    absurd = dict(G.default_config(p, torch.float32), BLOCK_M=3, num_warps=0)
    monkeypatch.setattr(store, "lookup", lambda *a, **k: dict(absurd))
    monkeypatch.setattr(store, "entry_config", lambda *a, **k: dict(absurd))
    K.clear_config_cache()
    from tritune.kernels.runtime import spec as runtime_spec

    monkeypatch.setattr(runtime_spec, "_REPORTED", set())
    try:
        with pytest.warns(UserWarning, match=rf"kernel 'gemm', bucket {bucket}, dtype float32 is invalid "
                                             r"\(BLOCK_M=3 not among"):
            cfg = G.SPEC.config_for(p, torch.float32)
        assert cfg == G.default_config(p, torch.float32)
        a, b = _r(9, 40), _r(40, 24, seed=1)
        K.clear_config_cache()  # looked up again (a store reload): not reported a second time
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = G.gemm(a, b)
        cmp.check(got, G.ref.gemm(a, b), torch.float32, G.SPEC.accumulation(torch.float32))
    finally:
        K.clear_config_cache()


def test_neighbouring_bucket_config_that_does_not_fit_is_not_reported(monkeypatch):
    """The nearest-bucket fallback may hand a sound config that does not fit this problem (a tile larger
    than it): the default runs, and there is nothing to report about the store."""
    from tritune.kernels.runtime import store

    p = G.Problem(3, 24, 40)
    neighbour = dict(G.default_config(p, torch.float32), BLOCK_M=64)  # valid values, too large for M=3
    assert G.SPACE.why_invalid(neighbour, p, torch.float32)
    monkeypatch.setattr(store, "lookup", lambda *a, **k: dict(neighbour))
    monkeypatch.setattr(store, "entry_config", lambda *a, **k: None)
    K.clear_config_cache()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert G.SPEC.config_for(p, torch.float32) == G.default_config(p, torch.float32)
    finally:
        K.clear_config_cache()


def _signature(jit_fn):
    import inspect

    return list(inspect.signature(getattr(jit_fn, "fn", jit_fn)).parameters.values())


def test_direct_launch_arguments_match_each_kernels_signature(monkeypatch):
    """Triton's compiled launcher takes every parameter of the jitted function, constexprs included, in
    order; a direct launch passes ``args + consts``. Each launcher's tuple is checked here against the
    signature read independently (the runtime arguments, then one value per constexpr: the value its
    launch through triton gets), since the interpreter never launches directly and a GPU only refuses a
    wrong count with "function takes exactly N arguments"."""
    seen = {}
    real = K.launch_cached

    def recording(jit_fn, kernels, grid, args, kws, consts, variant, ptrs):
        params = _signature(jit_fn)
        name = getattr(getattr(jit_fn, "fn", jit_fn), "__name__", "?")
        assert len(args) + len(consts) == len(params), name
        tail = params[len(args):]
        assert all("constexpr" in str(p.annotation) for p in tail), name
        assert not any("constexpr" in str(p.annotation) for p in params[:len(args)]), name
        assert consts == tuple(kws.get(p.name, p.default) for p in tail), name
        seen[name] = seen.get(name, 0) + 1
        return real(jit_fn, kernels, grid, args, kws, consts, variant, ptrs)

    monkeypatch.setattr(K, "launch_cached", recording)
    q = _r(1, 2, 16, 32)
    k, v = _r(1, 2, 16, 32, seed=1), _r(1, 2, 16, 32, seed=2)
    A.attention(q, k, v, causal=True)
    A.attention(q, k, v, causal=True, window=4)
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    A.attention_varlen(qp, kp, vp, cu, cu, 16, 16)
    G.gemm(_r(6, 16), _r(16, 16, seed=1))
    G.gemm(_r(6, 32), _r(32, 16, seed=1), rms=(torch.ones(32, device=DEV), 1e-6))  # the fused-prologue kernel
    GV.gemv(_r(2, 16), _r(16, 16, seed=1))
    case = PA.SPEC.make_inputs(PA.SPEC.small_problems[0], torch.float32, DEV, 0)
    PA.paged_attention(*case.args, **case.kwargs)
    assert {"attn_fwd", "_gemm_kernel", "_gemm_fused_kernel", "_gemv_kernel", "_paged_attention_fwd"} <= set(seen), seen


def test_direct_launch_argument_count_is_checked():
    from tritune.kernels.attention import launch as AL
    from tritune.kernels.attention.triton_fwd import attn_fwd

    names = [p.name for p in _signature(attn_fwd) if "constexpr" in str(p.annotation)]
    assert AL.CONSTEXPRS == tuple(names) and "WINDOW" in names
    n = len(_signature(attn_fwd))
    K.runtime.launch.check_direct_args(attn_fwd, (0,) * (n - len(names)), (0,) * len(names))
    with pytest.raises(TypeError, match=r"^direct launch of attn_fwd: 37 runtime arguments \+ 0 constexprs"):
        K.runtime.launch.check_direct_args(attn_fwd, (0,) * (n - len(names)), ())
