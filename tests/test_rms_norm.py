"""The built-in RMSNorm (fused residual add): the shipped contract, and what it promises beyond it."""
import pytest
import torch

from tritune.kernels.rms_norm import SPEC, Problem, rms_norm
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



@pytest.mark.parametrize("problem,layout", [(Problem(9, 100, True, True), "transposed"),
                                            (Problem(33, 33, False, True), "sliced")])
def test_every_config_point_matches(problem, layout):
    """Every point of the space the tuner (and the contract) may pick, on rows short enough to run each
    through the interpreter: one-pass and looped, ROWS > 1 tiles with masked rows past M and masked columns
    past N, idle lanes of small tiles."""
    for i, cfg in enumerate(SPEC.space.points(problem, torch.float32)):
        case = SPEC.make_inputs(problem, torch.float32, dev.device(), i, layout)
        for o in case.out if isinstance(case.out, tuple) else (case.out,):
            cmp.poison(o)
        got = rms_norm(*case.args, out=case.out, config=cfg, **case.kwargs)
        cmp.check(got, ref.rms_norm(*case.args, **case.kwargs), torch.float32, what=f"{problem} cfg={cfg}")


@pytest.mark.parametrize("over", ["residual", "x"])
@pytest.mark.parametrize("config", [{"BLOCK_N": 8192, "ROWS": 4, "num_warps": 16},
                                    {"BLOCK_N": 16384, "ROWS": 2, "num_warps": 32}])
def test_longest_rows_two_pass_in_place(over, config):
    """N = MAX_N through the two-pass loop with ROWS > 1 (rows past M masked), the sum written over the
    residual or over x while the second pass reads it back: the stored sum is exactly the bf16 add, y
    matches the reference of that sum."""
    N = 65536
    x, r, w = (_data((3, N), 20 + i, torch.bfloat16) for i in range(3))
    w = w[0]
    want_y, want_s = ref.rms_norm(x, w, 1e-6, residual=r)
    add = x + r
    y = torch.empty_like(x)
    s = r if over == "residual" else x
    rms_norm(x, w, 1e-6, r, out=(y, s), config=config)
    assert torch.equal(s, add) and torch.equal(s.double(), want_s)
    cmp.check(y, want_y, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_reference_sum_is_the_kernels_sum(dtype):
    """The reference's s is the add in x's dtype (what the kernel stores and normalises), bit for bit, on
    the one-pass and the looped path; far-apart magnitudes make the rounding matter."""
    x = _data((5, 1000), 30, dtype) * 64
    r = _data((5, 1000), 31, dtype) / 64
    want_y, want_s = ref.rms_norm(x, None, 1e-6, residual=r)
    for cfg in (None, {"BLOCK_N": 128, "ROWS": 2, "num_warps": 2}):
        y, s = rms_norm(x, None, 1e-6, r, config=cfg)
        assert torch.equal(s.double(), want_s)
        cmp.check(y, want_y, dtype)


@pytest.mark.parametrize("stages", [1, 3, 4])
@pytest.mark.parametrize("residual", [False, True])
def test_pipelined_chunks_match(stages, residual):
    """The looped form with its loads pipelined (num_stages > 1) and without; a stored config from before the
    key existed is the plain loop's point and runs."""
    p = Problem(3, 200, residual)
    c = SPEC.make_inputs(p, torch.float32, dev.device(), 7)
    cfg = {"BLOCK_N": 64, "ROWS": 1, "num_warps": 1, "num_stages": stages}
    assert SPEC.space.why_invalid(cfg, p, torch.float32) is None
    cmp.check(rms_norm(*c.args, **c.kwargs, config=cfg), SPEC.reference(*c.args, **c.kwargs), torch.float32)
    legacy = {k: v for k, v in cfg.items() if k != "num_stages"}
    assert SPEC.space.why_malformed(legacy) is None and SPEC.space.full(legacy)["num_stages"] == 1
    assert "fits one" in SPEC.space.why_invalid(dict(cfg, BLOCK_N=256, num_stages=3), p, torch.float32)
