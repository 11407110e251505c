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


# ---------------------------------------------------------------------------------------------------
# IMPL="gluon": the warp-specialized Gluon kernel (kernels/fp8_gemm_gluon.py), sm90 GPUs only
from tritune.kernels import fp8_gemm as F  # noqa: E402
from tritune.kernels import fp8_gemm_gluon as FGG  # noqa: E402

GLUON = (not dev.interpreted() and torch.cuda.is_available() and FGG.AVAILABLE
         and torch.cuda.get_device_capability()[0] == 9)
needs_gluon = pytest.mark.skipif(not GLUON, reason="the Gluon FP8 GEMM runs on sm90 GPUs only")


def _g(values) -> list:
    """A Gluon-only test's parameter values: all of them where the Gluon kernel runs, else the first (the test
    skips anyway)."""
    return list(values) if GLUON else list(values)[:1]


def test_gluon_points_are_refused_off_sm90_and_old_entries_stay_valid():
    """Without an sm90 GPU (the interpreter included) every IMPL="gluon" point is refused with the reason; a
    config stored before IMPL and PERSISTENT existed is the Triton kernel's point, valid and launched as such."""
    p = Problem(300, 520, 1040, "row", "block")
    cfg = dict(F.default_config(p, torch.bfloat16), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=4,
               num_stages=4, IMPL="gluon")
    why = F.SPACE.why_invalid(cfg, p, torch.bfloat16)
    assert (why is None) if GLUON else ("sm90" in why)
    assert "PERSISTENT=1" in F.SPACE.why_invalid(dict(cfg, IMPL="triton", PERSISTENT=1), p, torch.bfloat16)
    old = {k: v for k, v in F.default_config(p, torch.bfloat16).items() if k not in ("IMPL", "PERSISTENT")}
    assert F.SPACE.why_invalid(old, p, torch.bfloat16) is None
    small = Problem(5, 40, 96)
    case = SPEC.make_inputs(small, torch.bfloat16, DEV, seed=4)
    got = fp8_gemm(*case.args, **case.kwargs, config={k: v for k, v in F.default_config(small, torch.bfloat16).items()
                                                      if k not in ("IMPL", "PERSISTENT")})
    cmp.check(got, SPEC.reference(*case.args, **case.kwargs), torch.bfloat16)


GLUON_TILES = [(128, 128, 0), (128, 128, 1), (64, 128, 0), (128, 64, 1), (64, 64, 1)]   # BLOCK_M, BLOCK_N, PERSISTENT
GLUON_SCALES = [("row", "channel"), ("tensor", "tensor"), ("row", "block"), ("tensor", "block"), ("row", "tensor"),
                ("tensor", "channel")]
# odd M, N, K (33 K tiles, the last partial), an even count of K tiles, one K tile, and more tiles than SMs
# (the persistent grid walks several tiles a CTA)
GLUON_SHAPES = [(1000, 520, 4160), (257, 384, 512), (64, 72, 96), (2048, 1544, 1040)]


@pytest.mark.gpu
@pytest.mark.pairwise
@needs_gluon
@pytest.mark.parametrize("epilogue", _g(["none", "bias", "gelu+residual", "all"]))
@pytest.mark.parametrize("scales", _g(GLUON_SCALES), ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("tile", _g(GLUON_TILES), ids=lambda t: "x".join(map(str, t)))
def test_gluon_matches_float64(tile, scales, epilogue):
    """IMPL="gluon" against the float64 reference: every scale pairing, the epilogues, both output dtypes, and
    shapes with ragged edges in M, N and K; the Gluon kernel itself ran (not the Triton fallback)."""
    bm, bn, persistent = tile
    bias, act, res = epilogue in ("bias", "all"), epilogue in ("gelu+residual", "all"), epilogue != "none" and \
        epilogue != "bias"
    dtype = torch.float16 if epilogue == "gelu+residual" else torch.bfloat16
    ran = 0
    for i, (m, n, k) in enumerate(GLUON_SHAPES):
        p = Problem(m, n, k, *scales, bias, "gelu_tanh" if act else "none", res)
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, IMPL="gluon",
                   PERSISTENT=persistent)
        if SPEC.space.why_invalid(cfg, p, dtype):
            continue   # a tile over the problem, or the epilogue that spills at 128 x 128
        case = SPEC.make_inputs(p, dtype, "cuda", seed=i + 7)
        out = fp8_gemm(*case.args, **case.kwargs, config=cfg)
        cmp.check(out, SPEC.reference(*case.args, **case.kwargs), dtype, SPEC.accumulation(dtype),
                  what=f"gluon {tile} {p}")
        plan = next(pl for pl in F._PLANS.values() if pl.cfg == cfg and pl.problem == p)
        assert plan.gluon is not None and (True in plan.gluon or False in plan.gluon), "the Triton fallback ran"
        ran += 1
    if not ran:
        pytest.skip(f"no shape takes tile {tile} with epilogue {epilogue}")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("residual", [False, True])
def test_gluon_output_by_tma_and_by_masked_stores_agree(residual):
    """The Gluon kernel stores by TMA where the output takes it (16-bit, unit column stride, 16-byte aligned base
    and rows) and by masked stores otherwise: an output at an odd element offset, one with a row stride of an odd
    element count, and N not a multiple of 8 take the masked path; every path gives the same bits, and the
    reference's values."""
    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, IMPL="gluon",
               PERSISTENT=1)
    for m, n, k in ((1000, 520, 1040), (300, 100, 528)):
        p = Problem(m, n, k, "row", "channel", False, "none", residual)
        case = SPEC.make_inputs(p, torch.bfloat16, "cuda", seed=3)
        want = SPEC.reference(*case.args, **case.kwargs)
        outs = {}
        for name, (extra, off) in {"contiguous": (0, 0), "odd offset": (0, 1), "odd row stride": (3, 0)}.items():
            buf = torch.full((m * (n + extra) + off,), float("nan"), dtype=torch.bfloat16, device="cuda")
            out = buf[off:].view(m, n + extra)[:, :n]
            got = fp8_gemm(*case.args, **case.kwargs, out=out, config=cfg)
            cmp.check(got, want, torch.bfloat16, SPEC.accumulation(torch.bfloat16), what=f"{name} {p}")
            plan = next(pl for key, pl in F._PLANS.items() if pl.cfg == cfg and pl.problem == p
                        and key[7] is not None and key[7][1] == out.stride())   # key[7]: the output's metadata
            by_tma = name == "contiguous" and n % 8 == 0
            assert FGG.stores_by_tma(out) == (by_tma or name == "odd offset" and n % 8 == 0), name
            assert by_tma in plan.gluon, f"{name}: the {'TMA' if by_tma else 'masked'} store did not run"
            outs[name] = got.clone()
        for name, got in outs.items():
            assert torch.equal(got, outs["contiguous"]), f"{name} differs from the contiguous output's bits"
