"""The rotary kernel: the shipped contract, and what it promises beyond it (in place, partial rotary)."""
import pytest
import torch

from tritune.kernels import rotary as R
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.references import rotary as ref
from tritune.testing import contract_tests

Test_rotary = contract_tests(R.SPEC)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_in_place_on_fused_qkv_views(rotary_dim):
    """q and k rotated over themselves as column views of one qkv buffer; v untouched; with R < D the last
    dims keep their values."""
    p = R.Problem(T=7, Hq=4, Hk=2, D=16, R=rotary_dim)
    case = R.make_inputs(p, torch.float32, dev.device(), 3, layout="fused")
    q, k, cos, sin, pos = case.args
    qkv = q._base if q._base is not None else q
    v_before = qkv[:, 6:].clone()
    want = ref.rotary(q, k, cos, sin, pos)
    got = R.rotary(q, k, cos, sin, pos, out=(q, k))
    assert got[0] is q and got[1] is k
    cmp.check((q, k), want, torch.float32)
    assert torch.equal(qkv[:, 6:], v_before)


def test_positions_int32_and_scaled_tables():
    """Tables scaled as YaRN's attention factor does (cos and sin times m): the kernel only indexes them."""
    p = R.Problem(T=5, Hq=2, Hk=1, D=8, R=8)
    case = R.make_inputs(p, torch.float16, dev.device(), 4)
    q, k, cos, sin, pos = case.args
    cos, sin, pos = cos * 1.2, sin * 1.2, pos.int()
    cmp.check(R.rotary(q, k, cos, sin, pos), ref.rotary(q, k, cos, sin, pos), torch.float16)
