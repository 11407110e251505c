"""fp8_quant beyond the contract (which tests/test_kernels.py runs like every kernel's): the interpreter's fp8
conversions are fixed or refused, every row's largest value lands on e4m3's edge, the quantized rows stay
within the format's half step of the unquantized ones (the format's error, apart from the kernel's), the
multi-pass path for long rows, and the output feeding fp8_gemm's row scales."""
import math

import pytest
import torch

from tritune.kernels import fp8_quant as Q
from tritune.kernels.fp8_gemm import fp8_gemm
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import interpret_fp8
from tritune.references import fp8 as ref

DEV = dev.device()


@pytest.mark.skipif(not dev.interpreted(), reason="the interpreter's conversions only")
def test_interpreter_fp8_conversions_are_right_or_refused():
    # the probe covers ties to even, a mantissa carry into the exponent, subnormals and saturation
    assert interpret_fp8.check() is None
    x = torch.tensor([0.4956, 31.04, 0.53125, 1e-3, 465.0, -1e4])
    assert torch.equal(torch.from_numpy(interpret_fp8.to_fp8(x.numpy(), "fp8e4nv")).view(torch.float8_e4m3fn).float(),
                       x.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def _case(mode, m=6, n=333, dtype=torch.bfloat16, seed=0):
    return Q.SPEC.make_inputs(Q.Problem(m, n, mode), dtype, DEV, seed)


@pytest.mark.parametrize("mode", Q.MODES)
def test_rows_reach_the_edge_and_stay_within_half_a_step(mode):
    c = _case(mode)
    q, s = Q.fp8_quant(*c.args, **c.kwargs)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((q.shape[0],), 448.0, device=q.device))
    y = ref.normalize(c.args[0], c.kwargs.get("norm"), c.kwargs.get("swiglu", False))
    back = q.double() * s.double()[:, None]
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value, or half a subnormal step (2^-10 · scale)
    assert ((back - y).abs() <= y.abs() * 2.0**-4 + s.double()[:, None] * 2.0**-10 + 1e-12).all()
    assert cmp.rel_error(back, y) < 2.0**-4


def test_zero_rows_get_the_smallest_scale_and_zeros():
    x = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEV)
    x[1] = 1.0
    q, s = Q.fp8_quant(x)
    s = s.cpu()  # pytest.approx reads a tensor through numpy (host memory only)
    assert s[0].item() == s[2].item() == pytest.approx(ref.MIN_SCALE) and s[1].item() == pytest.approx(1.0 / 448)
    assert not q[0].float().any() and torch.equal(q[1].float(), torch.full((64,), 448.0, device=q.device))


@pytest.mark.parametrize("mode", Q.MODES)
def test_long_rows_take_the_multi_pass_path(mode):
    c = _case(mode, m=3, n=1000, dtype=torch.float16, seed=4)
    got = Q.fp8_quant(*c.args, config={"BLOCK_M": 2, "BLOCK_N": 128, "num_warps": 2}, **c.kwargs)
    cmp.check(got, Q.SPEC.reference(*c.args, **c.kwargs), torch.float16)


def test_quantized_activations_feed_the_fp8_gemm():
    """RMSNorm -> per-token e4m3 -> fp8_gemm with per-channel weights: close to the unquantized product."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, 256, generator=g) * 3).to(torch.bfloat16).to(DEV)
    w_norm = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16).to(DEV)
    w = (torch.randn(256, 80, generator=g) / math.sqrt(256)).to(DEV)
    a, sa = Q.fp8_quant(x, norm=("rms", w_norm, 1e-6))
    b, sb = ref.quantize_channels(w)
    out = fp8_gemm(a, b, sa, sb, out_dtype=torch.bfloat16)
    exact = ref.normalize(x, ("rms", w_norm, 1e-6)) @ w.double()
    assert cmp.rel_error(out, exact) < 0.06   # ~2^-5 per operand, as fp8_gemm's own check


@pytest.mark.parametrize("bad", [("rms", None), ("layer", None, None), "rms"])
def test_malformed_norm_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="norm"):
        Q.fp8_quant(torch.randn(2, 32, device=DEV), norm=bad)
