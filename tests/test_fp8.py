"""FP8 beyond the contract (which tests/test_kernels.py runs for fp8_gemm like every kernel): the
quantizers put every value on the e4m3 grid without saturating, long K stays accurate (the promotion), and
the quantized product stays close to the unquantized one (the format's error, bounded separately from the
kernel's)."""
import math

import pytest
import torch

from tritune.kernels.fp8_gemm import Problem, SPEC, fp8_gemm
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.references import fp8 as ref

DEV = dev.device()


@pytest.mark.parametrize("quantize", [ref.quantize_rows, ref.quantize_tensor, ref.quantize_channels,
                                      ref.quantize_blocks])
def test_quantizers_round_once_and_never_saturate(quantize):
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0)) * 50
    q, s = quantize(x)
    assert q.dtype == ref.E4M3 and torch.isfinite(q.float()).all()
    assert q.float().abs().max() <= ref.E4M3_MAX
    k, n = x.shape
    back = q.double() * (ref.expand_b_scale(s, k, n) if quantize in (ref.quantize_channels, ref.quantize_blocks)
                         else ref.expand_a_scale(s, k).expand(k, n))
    # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 relative) of where it was
    assert ((back - x.double()).abs() <= x.double().abs() * 2.0**-4 + 1e-9 + s.double().max() * 2**-9).all()


@pytest.mark.parametrize("b_scale", ["channel", "block"])
def test_long_k_matches_float64(b_scale):
    p = Problem(4, 64, 1024 if dev.interpreted() else 16384, "row", b_scale)
    case = SPEC.make_inputs(p, torch.bfloat16, DEV, seed=1)
    out = fp8_gemm(*case.args, **case.kwargs)
    cmp.check(out, SPEC.reference(*case.args, **case.kwargs), torch.bfloat16)


def test_error_against_the_unquantized_product_is_the_formats():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 512, generator=g).to(DEV)
    w = (torch.randn(512, 96, generator=g) / math.sqrt(512)).to(DEV)
    a, sa = ref.quantize_rows(x)
    b, sb = ref.quantize_blocks(w)
    out = fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16)
    exact = x.double() @ w.double()
    err = cmp.rel_error(out, exact)
    assert err < 0.06, f"e4m3 product off the unquantized one by {err:.3f}"   # ~2^-5 per operand


@pytest.mark.gpu
@pytest.mark.skipif(dev.interpreted(), reason="GPU only: torch._scaled_mm needs CUDA")
@pytest.mark.parametrize("a_scale,b_scale", [("row", "channel"), ("tensor", "tensor"), ("row", "block")])
def test_vendor_scaled_mm_agrees(a_scale, b_scale):
    """The vendor column computes the same product (each scaling cuBLASLt has a form for)."""
    case = SPEC.make_inputs(Problem(64, 256, 512, a_scale, b_scale), torch.bfloat16, "cuda", seed=3)
    ours = fp8_gemm(*case.args, **case.kwargs)
    theirs = SPEC.vendor(case)()
    assert cmp.rel_error(ours, theirs.double()) < cmp.tolerance(torch.bfloat16)
