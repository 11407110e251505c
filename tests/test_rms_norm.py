"""The built-in RMSNorm (fused residual add): the shipped contract, and what it promises beyond it."""
import pytest
import torch

from tritune.kernels.rms_norm import SPEC, rms_norm
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.references import rms_norm as ref
from tritune.testing import contract_tests

Test_rms_norm = contract_tests(SPEC)


def _data(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(dev.device())


@pytest.mark.parametrize("config", [None, {"BLOCK_N": 32, "ROWS": 2, "num_warps": 1}])
def test_residual_in_place_over_a_3d_stream(config):
    """The residual stream updated in place (vLLM's fused_add_rms_norm), leading dims merged, one-pass and
    looped (BLOCK_N 32 < N)."""
    x, r, w = _data((2, 3, 80), 1), _data((2, 3, 80), 2), _data((80,), 3)
    want_y, want_s = ref.rms_norm(x, w, 1e-5, residual=r)
    y = torch.empty_like(x)
    got_y, got_s = rms_norm(x, w, 1e-5, r, out=(y, r), config=config)
    assert got_s is r and got_y is y
    cmp.check((y, r), (want_y, want_s), torch.float32)


def test_sum_rounded_to_the_storage_type_before_the_norm():
    """s = x + residual is what a model adding in its dtype holds: the stored sum is exactly the bf16 add."""
    x, r = _data((4, 64), 4, torch.bfloat16), _data((4, 64), 5, torch.bfloat16)
    _, s = rms_norm(x, None, 1e-6, r)
    assert torch.equal(s, x + r)


def test_no_weight_and_empty_rows():
    x = _data((0, 16), 6)
    assert rms_norm(x).shape == (0, 16)
    x = _data((3, 16), 7)
    cmp.check(rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6), torch.float32)


def test_out_sum_may_not_overlap_y():
    x, r = _data((4, 16), 8), _data((4, 16), 9)
    y = torch.empty_like(x)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, None, 1e-6, r, out=(y, y))
