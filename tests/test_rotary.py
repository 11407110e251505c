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


def test_out_of_place_after_in_place_copies_the_pass_through_dims():
    """A launch plan made for an in-place call (pass-through dims left where they are) is not reused for an
    out-of-place call of the same shapes, which must copy them."""
    p = R.Problem(T=3, Hq=2, Hk=2, D=16, R=8)
    case = R.make_inputs(p, torch.float32, dev.device(), 5)
    q, k, cos, sin, pos = case.args
    want = ref.rotary(q, k, cos, sin, pos)
    q2, k2 = q.clone(), k.clone()
    R.rotary(q2, k2, cos, sin, pos, out=(q2, k2))
    outs = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")))
    R.rotary(q, k, cos, sin, pos, out=outs)
    cmp.check(outs, want, torch.float32)
    cmp.check((q2, k2), want, torch.float32)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_kv_cache_write_fused(rotary_dim):
    """With ``kv`` the rotated k (pass-through dims included) and v land in the paged caches at each token's
    slot, the same values as the returned k; slot -1 writes nothing."""
    p = R.Problem(T=6, Hq=4, Hk=2, D=16, R=rotary_dim)
    case = R.make_inputs(p, torch.float16, dev.device(), 6, layout="fused")
    q, k, cos, sin, pos = case.args
    qkv = q._base
    v = qkv[:, 6:]
    kc = torch.zeros(3, 4, 2, 16, dtype=torch.float16, device=dev.device())
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, 0, -1, 11, 2, 7], device=dev.device())
    want = ref.rotary(q, k, cos, sin, pos)
    R.rotary(q, k, cos, sin, pos, out=(q, k), kv=(kc, vc, slots, v))
    cmp.check((q, k), want, torch.float16)
    live = slots >= 0
    assert torch.equal(kc.view(-1, 2, 16)[slots[live]], k[live])
    assert torch.equal(vc.view(-1, 2, 16)[slots[live]], v[live])
    untouched = torch.ones(12, dtype=torch.bool, device=kc.device)
    untouched[slots[live]] = False
    assert not kc.view(-1, 2, 16)[untouched].any() and not vc.view(-1, 2, 16)[untouched].any()
