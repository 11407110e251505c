"""fp8_qgemv beyond the contract (which tests/test_kernels.py runs for it like every kernel's): the same numbers
as the two launches it replaces (fp8_quant, then fp8_gemv on its rows and scales) in every mode, with and
without split-K, on odd K and N, every scale form and the epilogues; x strided and sliced, the norm weight
strided, the engine's weights, ``out=`` (in place on the residual); the inputs kept clear of e4m3 rounding
midpoints; refusals that name the argument."""
from __future__ import annotations

import math

import pytest
import torch

from tritune.kernels import fp8_gemv as FGV
from tritune.kernels import fp8_qgemv as F
from tritune.kernels import fp8_quant as FQ
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8 as ref

DEV = dev.device()
ONE = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 2, "num_stages": 1}
CONFIGS = {"one tile a step": ONE, "split": dict(ONE, SPLIT_K=4), "wide": dict(ONE, BLOCK_N=32, BLOCK_K=128,
                                                                               num_warps=4, SPLIT_K=2)}
FORMS = [("channel", False), ("block", True), ("tensor", True)]   # (b_scale, bias + GELU + residual)


def _case(p: F.Problem, dtype=torch.bfloat16, seed=0, layout="contiguous"):
    return F.SPEC.make_inputs(p, dtype, DEV, seed, layout)


def _check(case, got, what=""):
    dtype = case.args[0].dtype
    cmp.check(got, F.SPEC.reference(*case.args, **case.kwargs), dtype, F.SPEC.accumulation(dtype), what=what)


def _quant_kwargs(case):
    return {k: case.kwargs[k] for k in ("norm", "swiglu") if k in case.kwargs}


def _two_launches(case, config):
    """fp8_quant then fp8_gemv's one-row loop with the same tile (so the same float32 sums in the same order)."""
    x, b, sb, bias = case.args
    a, sa = FQ.fp8_quant(x, **_quant_kwargs(case))
    return a, sa, FGV.fp8_gemv(a, b, sa, sb, bias, activation=case.kwargs["activation"],
                               residual=case.kwargs["residual"], out_dtype=x.dtype, config=dict(config, BLOCK_M=1))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", F.MODES)
def test_the_two_launches_it_replaces(mode, name):
    """N=200, K=300 (neither a multiple of a tile nor of the 128-blocks), 1 and 3 rows, every B scale form,
    bias + GELU + residual on some: fp8_quant's codes are the reference's (the inputs are clear of
    midpoints), and the output is fp8_gemv's on them bit for bit (interpreted), but under RMSNorm, whose
    rstd sums the squares in another order (its last bit reaches the scale: an output may differ by its
    last bit)."""
    config = CONFIGS[name]
    for i, (sb, epi) in enumerate(FORMS):
        m = 1 if i % 2 == 0 else 3
        p = F.Problem(m, 200, 300, mode, sb, epi, "gelu_tanh" if epi else "none", epi, weight=i != 2)
        case = _case(p, torch.float16 if i == 1 else torch.bfloat16, seed=i)
        a, sa, want = _two_launches(case, config)
        codes, scale = ref.fp8_quant(case.args[0], **_quant_kwargs(case))
        assert torch.equal(a.double(), codes)
        assert torch.allclose(sa.double(), scale, rtol=2.0**-18, atol=0)   # float32 sums of squares
        cmp.poison(case.out)
        got = F.fp8_qgemv(*case.args, out=case.out, config=config, **case.kwargs)
        assert got is case.out
        if mode == "rms" or not dev.interpreted():   # a GPU compile may contract a multiply-add the other way
            assert torch.allclose(got.double(), want.double(), rtol=2.0 * torch.finfo(got.dtype).eps, atol=0)
        else:
            assert torch.equal(got, want), f"{p} {config}"
        _check(case, got, f"{p} {config}")


def test_default_configs_and_layouts_match_the_reference():
    for i, p in enumerate(F.SPEC.small_problems + [F.Problem(4, 37, 200, "rms", "block", True, "none", True, False)]):
        for layout in F.SPEC.layouts:
            case = _case(p, seed=10 + i, layout=layout)
            cmp.poison(case.out)
            _check(case, F.fp8_qgemv(*case.args, out=case.out, **case.kwargs), f"{p} {layout}")


def test_inputs_are_kept_clear_of_midpoints_and_the_scale_stays():
    """clear_of_ties moves only elements whose quotient lies within the margin of a rounding midpoint, by one
    ulp of x's dtype away from zero; afterwards none is near one and each row's largest element (the scale's)
    is the same."""
    for mode, norm_w in (("rms", True), ("rms", False), ("swiglu", True), ("none", True)):
        c = FQ.make_inputs(FQ.Problem(6, 4096, mode, norm_w), torch.bfloat16, DEV, 7)
        x, norm, sw = c.args[0], c.kwargs.get("norm"), c.kwargs.get("swiglu", False)
        near = ref.midpoint_distance(ref.quotients(x, norm, sw)) < F.TIE_MARGIN
        y = F.clear_of_ties(x, norm, sw)
        assert ref.midpoint_distance(ref.quotients(y, norm, sw)).min() >= F.TIE_MARGIN
        moved = y != x
        assert int(moved.sum()) == int(near.sum())
        assert near.any() or mode == "none" or not norm_w   # quotients x_k / x_max: prime mantissas, no near ties
        assert torch.equal(y.float().abs()[moved] > x.float().abs()[moved], torch.ones_like(y[moved], dtype=torch.bool))
        t0, t1 = ref.quotients(x, norm, sw), ref.quotients(y, norm, sw)
        assert torch.equal(t0.abs().argmax(dim=1), t1.abs().argmax(dim=1))   # the same largest element, not moved
    assert ref.midpoint_distance(torch.tensor([0.0, 448.0, 1.0, 1.0625, 2.0**-10, 3 * 2.0**-10])).tolist() == \
        [0.5, 0.5, 0.5, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", F.MODES)
def test_strided_x_norm_weight_and_the_engines_weights(mode):
    """x a column slice of a wider tensor, column-major, or with padded rows; the norm weight strided (the
    kernel reads it through its stride); B as Fp8Weight.b (K contiguous) with channel and block scales."""
    from tritune.model.quant.fp8 import quantize_weight

    k, n, m = 272, 160, 2
    g = torch.Generator().manual_seed(3)
    cols = 2 * k if mode == "swiglu" else k
    x = FQ.outlier_rows(torch.randn(m, cols, generator=g) * 2, torch.bfloat16, 5).to(DEV)
    w_norm = (1 + 0.2 * torch.randn(2 * k, generator=g)).to(DEV, torch.bfloat16)[::2] if mode == "rms" else None
    kw = {"swiglu": True} if mode == "swiglu" else {"norm": ("rms", w_norm, 1e-5)} if mode == "rms" else {}
    x = F.clear_of_ties(x, kw.get("norm"), mode == "swiglu")
    dense = (torch.randn(k, n, generator=g) / math.sqrt(k)).to(DEV)
    bias = torch.randn(n, generator=g).to(DEV, torch.bfloat16)
    for block in (False, True):
        wt = quantize_weight(dense, block=block)
        assert wt.b.stride(0) == 1
        want = ref.fp8_qgemv(x, wt.b, wt.b_scale, bias, **kw)
        wide = torch.full((m, cols + 24), float("nan"), dtype=x.dtype, device=DEV)
        wide[:, 8:8 + cols] = x
        for xs in (x, wide[:, 8:8 + cols], S.restride(x, flip=True, pad=3, offset=8), S.restride(x, pad=5)):
            for config in (None, CONFIGS["split"]):
                got = F.fp8_qgemv(xs, wt.b, wt.b_scale, bias, config=config, **kw)
                cmp.check(got, want, torch.bfloat16, what=f"x strides {xs.stride()} block={block} {config}")


@pytest.mark.parametrize("config", [None, ONE, CONFIGS["split"]], ids=["default", "one", "split"])
def test_out_given_strided_and_in_place_on_the_residual(config):
    p = F.Problem(1, 72, 200, "rms", "channel", True, "none", True)
    case = _case(p, seed=3)
    want = F.SPEC.reference(*case.args, **case.kwargs)
    buf = torch.full((3, 2 * 72), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = buf[1:2, ::2]
    assert F.fp8_qgemv(*case.args, out=out, config=config, **case.kwargs) is out
    cmp.check(out, want, torch.bfloat16)
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[1, 1::2]).all()    # nothing else written
    res = case.kwargs["residual"]
    assert F.fp8_qgemv(*case.args, out=res, config=config, **case.kwargs) is res   # in place
    cmp.check(res, want, torch.bfloat16)


def test_split_k_is_deterministic_and_resets_its_counters():
    case = _case(F.Problem(3, 40, 400, "swiglu", "block", True, "gelu_tanh", True), torch.float16, seed=4)
    ys = [F.fp8_qgemv(*case.args, config=CONFIGS["split"], **case.kwargs) for _ in range(3)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    _check(case, ys[0])
    for buf in F._locks.buffers.values():
        assert int(buf.abs().sum()) == 0


def test_empty_and_k_zero():
    """No rows or no columns: an empty output; K = 0: the epilogue of a zero sum (bias + residual)."""
    for m, n in ((0, 24), (3, 0)):
        case = _case(F.Problem(m, n, 64, "rms", "channel", True, "none", True), seed=5)
        assert F.fp8_qgemv(*case.args, **case.kwargs).shape == (m, n)
    bias, res = torch.randn(24, device=DEV).half(), torch.randn(2, 24, device=DEV).half()
    b = torch.empty(0, 24, dtype=ref.E4M3, device=DEV)
    for x, kw in ((torch.empty(2, 0, device=DEV).half(), {}), (torch.empty(2, 0, device=DEV).half(), {"swiglu": True})):
        got = F.fp8_qgemv(x, b, torch.ones(24, device=DEV), bias, residual=res, **kw)
        cmp.check(got, bias.double() + res.double(), torch.float16)


def test_more_than_16_rows_are_refused():
    case = _case(F.Problem(17, 32, 64, "rms"))
    with pytest.raises(ValueError, match="at most 16.*fp8_gemm"):
        F.fp8_qgemv(*case.args, **case.kwargs)
    assert "at most 16" in F.SPACE.constraint(F.default_config(F.Problem(16, 32, 64), torch.bfloat16),
                                               F.Problem(17, 32, 64), torch.bfloat16)


def test_bad_inputs_name_the_argument():
    case = _case(F.Problem(2, 32, 64, "rms", "channel", True, "none", True))
    x, b, sb, bias = case.args
    res, norm = case.kwargs["residual"], case.kwargs["norm"]
    bad = [
        (lambda: F.fp8_qgemv(x, b, sb, bias.half(), norm=norm), TypeError, "bias"),
        (lambda: F.fp8_qgemv(x, b, sb, residual=res.half()), TypeError, "residual"),
        (lambda: F.fp8_qgemv(x, b, sb, out=torch.empty(2, 32, device=DEV)), TypeError, "out"),
        (lambda: F.fp8_qgemv(x, b, sb.double()), TypeError, "b_scale"),
        (lambda: F.fp8_qgemv(x, b, sb[None]), ValueError, "b_scale"),
        (lambda: F.fp8_qgemv(x, b.to(torch.float8_e5m2), sb), TypeError, "b"),
        (lambda: F.fp8_qgemv(x, b.t(), sb), ValueError, "b"),
        (lambda: F.fp8_qgemv(x[0], b, sb), ValueError, "x"),
        (lambda: F.fp8_qgemv(x.to(ref.E4M3), b, sb), TypeError, "x"),
        (lambda: F.fp8_qgemv(x, b, sb, norm=("rms", norm[1], float("inf"))), ValueError, "eps"),
        (lambda: F.fp8_qgemv(x, b, sb, norm=("layer", norm[1], None, 1e-5)), ValueError, "norm"),
        (lambda: F.fp8_qgemv(x, b, sb, norm=("rms", norm[1].float(), 1e-5)), TypeError, "norm weight"),
        (lambda: F.fp8_qgemv(x, b, sb, swiglu=1), TypeError, "swiglu"),
        (lambda: F.fp8_qgemv(x, b[:32], sb, norm=norm, swiglu=True), ValueError, "norm"),
        (lambda: F.fp8_qgemv(x, b, sb, bias, activation="relu"), ValueError, "activation"),
        (lambda: F.fp8_qgemv(x, b, sb, bias, out=bias.view(1, -1).expand(2, 32)), ValueError, "out"),
        (lambda: F.fp8_qgemv(x, b, sb, config=dict(ONE, BLOCK_N=12)), ValueError, "BLOCK_N"),
        (lambda: F.fp8_qgemv(x, b, sb, config=dict(ONE, BLOCK_M=1)), ValueError, "BLOCK_M"),
    ]
    for thunk, exc, name in bad:
        with pytest.raises(exc, match=name):
            thunk()


def test_defaults_buckets_and_the_standard_problems():
    """Every standard problem's default is a point of the space; the buckets tell the modes and epilogues
    apart; block scales keep a program's columns in one scale block."""
    keys = set()
    for q in F.SPEC.standard_problems:
        c = F.default_config(q, torch.bfloat16)
        assert F.SPACE.constraint(c, q, torch.bfloat16) is None
        keys.add(F.SPEC.config_key(q, torch.bfloat16))
    assert len(keys) == len(F.SPEC.standard_problems)
    assert F.bucket(F.Problem(3, 64, 128, "swiglu", "block", True, "gelu_tanh", True)) == {
        "M": 4, "N": 64, "K": 128, "mode": "swiglu", "b_scale": "block", "epilogue": 7}
    assert "scale block" in F.SPACE.constraint(dict(ONE, BLOCK_N=256, BLOCK_K=16), F.Problem(1, 512, 512, "none",
                                                                                              "block"), torch.bfloat16)
