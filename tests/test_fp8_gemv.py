"""fp8_gemv beyond the contract (which tests/test_kernels.py runs for it like every kernel): both inner loops
(one row on CUDA cores, up to 16 rows on fp16 dots) and split-K on odd shapes with every scale form and the
epilogues, the engine's weight layout and other strides, ``out=`` (in place on the residual), the refusal of
more than 16 rows, and the torch op."""
from __future__ import annotations

import math

import pytest
import torch

from tritune.kernels import fp8_gemm as FG
from tritune.kernels import fp8_gemv as F
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S
from tritune.references import fp8 as ref

DEV = dev.device()
ONE_ROW = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 2, "num_stages": 1}
DOT = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 1, "num_stages": 2}
SPLIT = {"one-row split": dict(ONE_ROW, SPLIT_K=4), "dot split": dict(DOT, SPLIT_K=2)}
CONFIGS = {"default": None, "one-row": ONE_ROW, "dot": DOT, **SPLIT}


def _case(p: F.Problem, dtype=torch.float16, seed=0, layout="contiguous"):
    return F.SPEC.make_inputs(p, dtype, DEV, seed, layout)


def _check(case, got, what=""):
    dtype = case.kwargs["out_dtype"]
    cmp.check(got, F.SPEC.reference(*case.args, **case.kwargs), dtype, F.SPEC.accumulation(dtype), what=what)


def _valid(config, p):
    """The config, or None (the launcher's own) where the space refuses it for this problem."""
    if config is None or F.SPACE.why_invalid(config, p, torch.float16):
        return None
    return config


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m", [1, 3, 8])
def test_odd_shapes_every_scale_form_and_the_epilogues(m, name):
    """N=200, K=300 (neither a multiple of a tile nor of the 128-blocks): per-row / per-tensor A scales
    against per-channel, per-tensor and 128x128-block B scales, with bias + GELU + residual on some."""
    forms = [("row", "channel", False), ("tensor", "block", True), ("row", "tensor", True), ("row", "block", False)]
    for i, (sa, sb, epi) in enumerate(forms):
        p = F.Problem(m, 200, 300, sa, sb, epi, "gelu_tanh" if epi else "none", epi)
        case = _case(p, seed=i)
        cmp.poison(case.out)
        config = _valid(CONFIGS[name], p)
        got = F.fp8_gemv(*case.args, out=case.out, config=config, **case.kwargs)
        assert got is case.out
        _check(case, got, f"{p} {config}")


@pytest.mark.parametrize("m", [1, 5])
def test_the_engines_weights_and_other_layouts(m):
    """Fp8Weight.b (the (K, N) transpose of a row-major (N, K) e4m3 tensor, K contiguous) with its channel
    and block scales, as Fp8Ops passes them; then B with N contiguous, B a strided view with NaN around it,
    A with padded rows, a_scale (M, 1) and a strided a_scale, a strided bias: each the same product."""
    from tritune.model.quant.fp8 import quantize_weight

    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 272, generator=g) * 3).to(DEV)
    dense = (torch.randn(272, 160, generator=g) / math.sqrt(272)).to(DEV)
    a, sa = ref.quantize_rows(x)
    bias = torch.randn(160, generator=g).to(DEV, torch.bfloat16)
    for block in (False, True):
        w = quantize_weight(dense, block=block)
        assert w.b.stride(0) == 1     # the layout this kernel is fast for
        got = F.fp8_gemv(a, w.b, sa, w.b_scale, bias, out_dtype=torch.bfloat16)
        want = ref.fp8_gemm(a, w.b, sa, w.b_scale, bias)
        cmp.check(got, want, torch.bfloat16)
        cmp.check(FG.fp8_gemm(a, w.b, sa, w.b_scale, bias, out_dtype=torch.bfloat16), want, torch.bfloat16)
        b, sb = w.b, w.b_scale
        for b2 in (b.contiguous(), S.restride(b, flip=True, pad=5, offset=16),
                   S.restride(b, pad=3, offset=16)):
            got = F.fp8_gemv(a, b2, sa, sb, bias, out_dtype=torch.bfloat16)
            cmp.check(got, want, torch.bfloat16, what=f"b strides {b2.stride()}")
        a2 = S.restride(a, pad=7, offset=16)
        sa2 = torch.stack([sa, torch.full_like(sa, float("nan"))], 1)[:, 0]     # stride 2
        bias2 = torch.stack([bias, torch.full_like(bias, float("nan"))], 1)[:, 0]
        for a_scale in (sa[:, None], sa2):
            got = F.fp8_gemv(a2, b, a_scale, sb, bias2, out_dtype=torch.bfloat16)
            cmp.check(got, want, torch.bfloat16, what=f"a_scale {tuple(a_scale.shape)} {a_scale.stride()}")


@pytest.mark.parametrize("config", [None, ONE_ROW, SPLIT["one-row split"]], ids=["default", "one-row", "split"])
def test_out_given_strided_and_in_place_on_the_residual(config):
    p = F.Problem(1, 72, 200, "row", "channel", True, "none", True)
    case = _case(p, torch.bfloat16, seed=3)
    want = F.SPEC.reference(*case.args, **case.kwargs)
    buf = torch.full((3, 2 * 72), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = buf[1:2, ::2]                                    # strided rows and columns
    got = F.fp8_gemv(*case.args, out=out, config=config, **case.kwargs)
    assert got is out
    cmp.check(out, want, torch.bfloat16)
    assert torch.isnan(buf[0]).all() and torch.isnan(buf[1, 1::2]).all()    # nothing else written
    res = case.kwargs["residual"]
    got = F.fp8_gemv(*case.args, out=res, config=config, **case.kwargs)   # the residual updated in place
    assert got is res
    cmp.check(res, want, torch.bfloat16)


def test_split_k_is_deterministic_and_resets_its_counters():
    for config, m in ((SPLIT["one-row split"], 2), (SPLIT["dot split"], 7)):
        case = _case(F.Problem(m, 40, 400, "tensor", "block", True, "gelu_tanh", True), seed=4)
        ys = [F.fp8_gemv(*case.args, config=config, **case.kwargs) for _ in range(3)]
        assert all(torch.equal(ys[0], y) for y in ys[1:])
        _check(case, ys[0])
        for buf in F._locks.buffers.values():
            assert int(buf.abs().sum()) == 0


def test_empty_and_k_zero():
    """No rows or no columns: an empty output; K = 0: the epilogue of a zero sum (bias + residual)."""
    for m, n in ((0, 24), (3, 0)):
        case = _case(F.Problem(m, n, 64, "row", "channel", True, "none", True), seed=5)
        assert F.fp8_gemv(*case.args, **case.kwargs).shape == (m, n)
    a = torch.empty(2, 0, dtype=ref.E4M3, device=DEV)
    b = torch.empty(0, 24, dtype=ref.E4M3, device=DEV)
    bias, res = torch.randn(24, device=DEV).half(), torch.randn(2, 24, device=DEV).half()
    one = torch.ones((), device=DEV)
    got = F.fp8_gemv(a, b, one, torch.ones(24, device=DEV), bias, residual=res, out_dtype=torch.float16)
    cmp.check(got, ref.fp8_gemm(a, b, one, one, bias, residual=res), torch.float16)


def test_more_than_16_rows_are_refused_towards_fp8_gemm():
    case = FG.SPEC.make_inputs(F.Problem(17, 32, 64), torch.bfloat16, DEV, 0)
    with pytest.raises(ValueError, match="at most 16.*fp8_gemm"):
        F.fp8_gemv(*case.args, **case.kwargs)
    assert "at most 16" in F.SPACE.constraint(F.default_config(F.Problem(16, 32, 64), torch.bfloat16),
                                               F.Problem(17, 32, 64), torch.bfloat16)


def test_bad_inputs_name_the_argument():
    case = _case(F.Problem(2, 32, 64, "row", "channel", True, "none", True), torch.bfloat16)
    a, b, sa, sb, bias = case.args
    res = case.kwargs["residual"]
    bad = [
        (lambda: F.fp8_gemv(a, b, sa, sb, bias.half()), TypeError, "bias"),
        (lambda: F.fp8_gemv(a, b, sa, sb, residual=res.half()), TypeError, "residual"),
        (lambda: F.fp8_gemv(a, b, sa, sb, out=torch.empty(2, 32, device=DEV)), TypeError, "out_dtype"),
        (lambda: F.fp8_gemv(a, b, sa, sb.double()), TypeError, "b_scale"),
        (lambda: F.fp8_gemv(a, b, sa[None], sb), ValueError, "a_scale"),
        (lambda: F.fp8_gemv(a, b.to(torch.float8_e5m2), sa, sb), TypeError, "b"),
        (lambda: F.fp8_gemv(a[0], b, sa, sb), ValueError, "a"),
        (lambda: F.fp8_gemv(a, b, sa, sb, bias, out=bias.view(1, -1).expand(2, 32)), ValueError, "out"),
        (lambda: F.fp8_gemv(a, b, sa, sb, config=dict(ONE_ROW, BLOCK_N=12)), ValueError, "BLOCK_N"),
        (lambda: F.fp8_gemv(a, b, sa, sb, config=dict(DOT, BLOCK_N=8)), ValueError, "BLOCK_N >= 16"),
    ]
    for thunk, exc, name in bad:
        with pytest.raises(exc, match=name):
            thunk()


def test_block_scales_keep_a_program_in_one_scale_block():
    p = F.Problem(1, 512, 512, "row", "block")
    assert "scale block" in F.SPACE.constraint(dict(ONE_ROW, BLOCK_N=256), p, torch.bfloat16)
    assert "scale block" in F.SPACE.constraint(dict(DOT, BLOCK_K=256, num_warps=4), F.Problem(4, 512, 512, "row",
                                                                                             "block"), torch.bfloat16)
    for q in F.SPEC.standard_problems:
        c = F.default_config(q, torch.bfloat16)
        assert c["BLOCK_M"] == (1 if q.M == 1 else 16) and F.SPACE.constraint(c, q, torch.bfloat16) is None


def test_torch_op_matches_and_passes_opcheck(monkeypatch):
    from tritune.kernels import torch_ops  # noqa: F401  (registers torch.ops.tritune.*)

    allclose = torch.allclose

    def bitwise(x, y, *args, **kwargs):   # opcheck compares float8 inputs before and after: by their bytes
        if x.dtype == torch.float8_e4m3fn:
            return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        return allclose(x, y, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", bitwise)
    case = _case(F.Problem(3, 40, 96, "row", "block", True, "gelu_tanh", True), torch.bfloat16, seed=6)
    a, b, sa, sb, bias = case.args
    args = (a, b, sa, sb, bias, "gelu_tanh", case.kwargs["residual"], torch.bfloat16)
    op = torch.ops.tritune.fp8_gemv
    torch.library.opcheck(op.default, args)
    _check(case, op(*args))
