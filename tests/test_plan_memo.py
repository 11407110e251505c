"""A new M's launch plan (gemm, fp8_gemm) takes its bucket's config, and gemm its launch keywords, from memos:
the same plan as one made with the memos empty, the keywords shared (never copied per plan), and a config the
config cache replaces or drops looked up again, as PlanCache.get re-checks a plan. No kernel runs."""
from __future__ import annotations

import pytest
import torch

from tritune import kernels as K
from tritune.kernels import fp8_gemm as F
from tritune.kernels import gemm as G
from tritune.kernels.runtime import device as dev

DEV = dev.device()
SKIP = {"kernels", "locks"}   # a plan's own compiled kernels; the per-device split-K counters


def _fields(plan) -> dict:
    return {k: getattr(plan, k) for k in type(plan).__slots__ if k not in SKIP}


def _gemm_plan(m: int, kind: str, config=None):
    g = torch.Generator().manual_seed(m)
    a = torch.randn(m, 64, generator=g).to(DEV)
    b = torch.randn(64, 96, generator=g).to(DEV)
    bias, r, out, rms = torch.randn(96).to(DEV), torch.randn(m, 96).to(DEV), None, None
    if kind == "plain":
        bias = r = None
    elif kind == "rms":
        rms, r = (torch.randn(64).to(DEV), 1e-5), None
    elif kind == "out":
        out = torch.empty(m, 96).to(DEV)
    elif kind == "3d":
        a, r = torch.randn(m, 2, 64).to(DEV).transpose(0, 1), None   # rows that do not merge into one stride
    return G._make_plan(a, b, bias, "gelu_tanh" if kind == "bias+res" else None, r, out, config, rms=rms)


@pytest.fixture(autouse=True)
def _fresh_config_cache():
    K.clear_config_cache()
    yield
    K.clear_config_cache()


@pytest.mark.parametrize("kind", ["plain", "bias+res", "rms", "out", "3d"])
def test_a_gemm_plan_from_the_memos_is_the_plan_made_without_them(kind):
    ms = (5, 33, 40, 64, 65, 100, 128)
    memo = [_gemm_plan(m, kind) for m in ms]
    for m, got in zip(ms, memo):
        G._CONFIGS.clear()
        G._variants.cache_clear()
        assert _fields(got) == _fields(_gemm_plan(m, kind)), m
    assert memo[1].kws is memo[2].kws and memo[1].consts is memo[2].consts   # one bucket: shared, not copied
    p = _gemm_plan(40, kind, config=dict(memo[2].cfg))
    assert p.cfg is p.cfg_key is None and p.kws == memo[2].kws   # an explicit config: the same launch


def test_a_config_the_cache_replaces_or_drops_reaches_a_new_m_of_a_known_bucket():
    first = _gemm_plan(33, "plain")
    other = dict(first.cfg, GROUP_M=4 if first.cfg["GROUP_M"] != 4 else 1)
    assert G.SPACE.why_invalid(other, G.Problem(40, 96, 64), torch.float32) is None
    K.CONFIG_CACHE[first.cfg_key] = other   # what a store written since (or tuning on a miss) leaves
    p = _gemm_plan(40, "plain")
    assert p.cfg is other and p.kws[0][0]["GROUP_M"] == other["GROUP_M"]
    K.clear_config_cache()
    p = _gemm_plan(50, "plain")
    assert p.cfg == first.cfg and K.CONFIG_CACHE[p.cfg_key] is p.cfg


def test_an_explicit_gemm_config_is_validated_per_bucket():
    cfg = dict(_gemm_plan(40, "plain").cfg, BLOCK_M=64, SPLIT_K=1, GROUP_M=1, num_warps=4)
    assert _gemm_plan(40, "plain", cfg).kws[0][0]["BLOCK_M"] == 64
    with pytest.raises(ValueError, match="BLOCK_M larger than M"):
        _gemm_plan(20, "plain", cfg)
    assert _gemm_plan(50, "plain", cfg).kws[0][0]["BLOCK_M"] == 64


def _fp8_plan(m: int, config=None):
    case = F.make_inputs(F.Problem(m, 96, 64, bias=True), torch.bfloat16, DEV, m)
    a, b, sa, sb, bias = case.args
    return F._plan(a, b, sa, sb, bias, "none", None, None, torch.bfloat16, config)


def test_an_fp8_plan_from_the_memo_is_the_plan_made_without_it():
    ms = (5, 33, 40, 64, 100)
    memo = [_fp8_plan(m) for m in ms]
    for m, got in zip(ms, memo):
        F._CONFIGS.clear()
        assert _fields(got) == _fields(_fp8_plan(m)), m
    seen = _fp8_plan(33)   # the memo holds bucket 64's config again
    K.CONFIG_CACHE[seen.cfg_key] = other = dict(seen.cfg, GROUP_M=8 if seen.cfg["GROUP_M"] != 8 else 1)
    assert _fp8_plan(40).cfg is other
    with pytest.raises(ValueError, match="not among"):   # an unhashable explicit config: refused by name
        _fp8_plan(40, dict(memo[2].cfg, BLOCK_M=[64]))
