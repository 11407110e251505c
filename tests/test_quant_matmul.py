"""Weight-only quantized matmul: kernel vs float64 reference on the dequantized weight, both paths, every
group size, bias or not, split-K; quantizer round trips and packing; quantization error (reported);
bad inputs. The generic property tests (tests/test_kernels.py) add random problems, layouts and configs.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels import quant_matmul as QM
from tritune.references import quant as Q
from tritune.references import quant_matmul as ref

DEV = dev.device()
FORMATS = [(8, 128), (4, 32), (4, 64), (4, 128)]  # (bits, group); int8 is per channel


def _weight(n, k, seed, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, k, generator=g, device=device) / math.sqrt(k)


def _x(shape, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(shape, generator=g, device=DEV).to(dtype)


# "gemv": BLOCK_M 1 (CUDA cores); "tiled8" / "tiled": BLOCK_M 8 / 16, int4 with the operands swapped (the
# weight is the MMA's A operand); "tiled32": BLOCK_M 32, x the A operand
PATHS = ["gemv", "tiled8", "tiled", "tiled32"]


def _config(path, bits, group, split, k):
    bk = group if bits == 4 else 32
    if path == "gemv":
        return dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=bk, SPLIT_K=split, num_warps=1, num_stages=1)
    bm = {"tiled8": 8, "tiled": 16, "tiled32": 32}[path]
    return dict(BLOCK_M=bm, BLOCK_N=16, BLOCK_K=bk, SPLIT_K=split, num_warps=1, num_stages=1)


# --- the kernel ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group", FORMATS, ids=[f"int{b}-g{g}" for b, g in FORMATS])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("split", [1, 2])
def test_matches_reference_fp16(bits, group, path, bias, split):
    """Odd M and N, K three groups (int8: an odd K), split-K over 3 blocks (uneven slices)."""
    m, n = (19 if path == "tiled32" else 3), 37
    k = 3 * group if bits == 4 else 101
    qw = Q.quantize(_weight(n, k, 1), bits, group)
    x = _x((m, k), torch.float16, 2)
    b = _x((n,), torch.float16, 3) if bias else None
    out = cmp.poisoned_like(torch.empty(m, n, dtype=torch.float16, device=DEV))
    got = QM.quant_matmul(x, qw, b, out=out, config=_config(path, bits, group, split, k))
    cmp.check(got, ref.quant_matmul(x, qw, b), torch.float16, what=f"int{bits} g{group} {path} split={split}")


@pytest.mark.parametrize("bits,group", FORMATS, ids=[f"int{b}-g{g}" for b, g in FORMATS])
@pytest.mark.parametrize("path", PATHS)
def test_matches_reference_bf16(bits, group, path):
    m, n, k = (21 if path == "tiled32" else 5), 29, (2 * group if bits == 4 else 64)
    qw = Q.quantize(_weight(n, k, 4), bits, group)
    x = _x((m, k), torch.bfloat16, 5)
    b = _x((n,), torch.bfloat16, 6)
    got = QM.quant_matmul(x, qw, b, config=_config(path, bits, group, 2, k))
    cmp.check(got, ref.quant_matmul(x, qw, b), torch.bfloat16, what=f"bf16 int{bits} g{group} {path}")


@pytest.mark.parametrize("bits", [8, 4])
def test_default_config_batched_x_and_quant_linear(bits):
    """x (2, 3, K) flattens to M = 6; quant_linear (the serving entry) is the same function."""
    n, k = 19, 128
    qw = Q.quantize(_weight(n, k, 7), bits, 64)
    x = _x((2, 3, k), torch.float16, 8)
    b = _x((n,), torch.float16, 9)
    y = QM.quant_linear(x, qw, b)
    assert y.shape == (2, 3, n) and y.dtype == torch.float16
    cmp.check(y, ref.quant_matmul(x, qw, b), torch.float16)


@pytest.mark.parametrize("bits", [8, 4])
def test_row_strided_and_column_major_x(bits):
    n, k, m = 21, 128, 4
    qw = Q.quantize(_weight(n, k, 10), bits, 32)
    base = _x((m, k + 8), torch.float16, 11)
    for x in (base[:, :k], base[:, :k].t().contiguous().t()):
        cmp.check(QM.quant_matmul(x, qw), ref.quant_matmul(x, qw), torch.float16)


@pytest.mark.parametrize("bits", [8, 4])
def test_launch_plan_reused_across_tensors(bits):
    """The launcher caches a plan per (shapes, strides, dtypes, devices, config): later calls with other
    tensors of the same meta must read those tensors (nothing but the layout is cached), split-K
    workspace included; an x whose dims cannot merge into rows (a copy) too."""
    n, k = 40, 128
    cfg = _config("tiled", bits, 64, 2, k)
    for seed in (30, 31):
        qw = Q.quantize(_weight(n, k, seed), bits, 64)
        x = _x((2, 3, k), torch.float16, seed + 10)
        for _ in range(2):
            cmp.check(QM.quant_matmul(x, qw, config=cfg), ref.quant_matmul(x, qw), torch.float16)
        xt = _x((3, 2, k), torch.float16, seed + 20).transpose(0, 1)  # (2, 3, K), rows do not merge
        cmp.check(QM.quant_matmul(xt, qw), ref.quant_matmul(xt, qw), torch.float16)
        out = torch.empty(2, 3, n, dtype=torch.float16, device=DEV)
        assert QM.quant_matmul(x, qw, out=out) is out


def test_split_k_counters_are_reset():
    """Two split-K launches in a row on the same tiles: the second must not see the first's tickets."""
    n, k, m = 33, 256, 2
    qw = Q.quantize(_weight(n, k, 12), 4, 32)
    x = _x((m, k), torch.float16, 13)
    cfg = _config("gemv", 4, 32, 4, k)
    want = ref.quant_matmul(x, qw)
    for _ in range(2):
        cmp.check(QM.quant_matmul(x, qw, config=cfg), want, torch.float16)


def test_zero_rows_and_empty_batch():
    qw = Q.quantize(_weight(8, 64, 14), 4, 32)
    y = QM.quant_matmul(torch.empty(0, 64, dtype=torch.float16, device=DEV), qw)
    assert y.shape == (0, 8)


# --- quantizers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", Q.INT4_GROUP_SIZES)
def test_int4_pack_round_trip_and_layout(group):
    g = torch.Generator().manual_seed(group)
    q = torch.randint(0, 16, (5, 3 * group), generator=g, dtype=torch.uint8)
    packed = Q.pack_int4(q, group)
    assert packed.shape == (5, 3 * group // 2) and packed.dtype == torch.uint8
    assert torch.equal(Q.unpack_int4(packed, group), q)
    h = group // 2  # the documented layout: byte i of group j = (k = j·g + i) | (k = j·g + h + i) << 4
    j, i = 1, 3
    assert int(packed[2, j * h + i]) == int(q[2, j * group + i]) | (int(q[2, j * group + h + i]) << 4)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130])
def test_int4_panels_layout(n):
    """The stored layout: byte i of group j of row n at data[n // R, j, n % R, i]; rows past N are zero;
    scales and zero points are (N, G) views of group-major 32-bit words (zero point in byte 0, the bf16
    scale in the high half); from_panels inverts to_panels."""
    group, R = 32, Q.PANEL_ROWS
    w = _weight(n, 3 * group, 21 + n, "cpu")
    qw = Q.quantize_int4(w, group)
    qw.validate()
    rowmajor = Q.pack_int4(qw.codes(), group)
    assert qw.data.shape == (-(-n // R), 3, R, group // 2)
    assert torch.equal(Q.from_panels(qw.data, n), rowmajor)
    r, j, i = n - 1, 2, 5
    assert int(qw.data[r // R, j, r % R, i]) == int(rowmajor[r, j * group // 2 + i])
    if n % R:
        assert int(qw.data[-1, :, n % R:].abs().max()) == 0
    assert qw.scales.shape == (n, 3) and qw.zeros.shape == (n, 3)
    words = Q.sz_words(qw)
    assert words is not None and words.shape == (3, n) and words.is_contiguous()
    assert torch.equal((words & 0xFF).t(), qw.zeros.to(torch.int32))
    assert torch.equal((words & -65536).view(torch.float32).t(), qw.scales.float())
    assert int((words & 0xFF00).abs().max()) == 0
    assert torch.equal(Q.pack_scale_zero(qw.scales.contiguous(), qw.zeros.contiguous()), words)


@pytest.mark.parametrize("path", PATHS)
def test_int4_scale_zero_layouts_agree(path):
    """Scales and zero points as views of packed words (the kernel's one 4-byte load), as group-major
    tensors of their own, or row-major: the same output, bit for bit, and it matches the reference."""
    m, n, group = (19 if path == "tiled32" else 3), 37, 64
    qw = Q.quantize_int4(_weight(n, 3 * group, 6), group)
    x = _x((m, 3 * group), torch.float16, 7)
    cfg = _config(path, 4, group, 2, 3 * group)
    outs = []
    for scales, zeros in ((qw.scales, qw.zeros), (qw.scales.t().contiguous().t(), qw.zeros.t().contiguous().t()),
                          (qw.scales.contiguous(), qw.zeros.contiguous())):
        q = replace(qw, scales=scales, zeros=zeros)
        assert (Q.sz_words(q) is not None) == (scales is qw.scales)
        out = cmp.poisoned_like(torch.empty(m, n, dtype=torch.float16, device=DEV))
        outs.append(QM.quant_matmul(x, q, out=out, config=cfg))
    cmp.check(outs[0], ref.quant_matmul(x, qw), torch.float16, what=f"int4 words {path}")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("bits,group", FORMATS, ids=[f"int{b}-g{g}" for b, g in FORMATS])
def test_quantize_round_trip_bounds(bits, group):
    """Every weight within half a step of its reconstruction (a hair more at int4's clamped ends: the
    scale is rounded to bf16); zero maps to zero exactly; codes in range; the weight validates."""
    w = _weight(24, 4 * group, 15, "cpu")
    w[3] = 0.0                      # an all-zero row: scale 1, codes 0
    w[5, :group] = 0.25             # a constant positive group
    qw = Q.quantize(w, bits, group)
    qw.validate()
    deq = qw.dequantize(torch.float64)
    assert torch.equal(Q.round_trip(w, bits, group), qw.dequantize(torch.float32))
    if bits == 8:
        step = qw.scales.double()[:, None]
        assert int(qw.data.abs().max()) <= 127
    else:
        step = qw.scales.double().repeat_interleave(group, dim=1)
        codes = qw.codes()
        assert int(codes.max()) <= 15 and int(qw.zeros.max()) <= 15
    assert bool(((w.double() - deq).abs() <= 0.5 * step * (1 + 2**-6)).all())
    assert torch.equal(deq[3], torch.zeros_like(deq[3]))
    assert (deq == 0).sum() >= (w == 0).sum()  # zeros survive exactly


def test_quantization_error_reported(record_property, capsys):
    """‖w − dequant(w)‖ / ‖w‖ for a Gaussian (8192 weights a row): reported, bounded loosely."""
    w = _weight(64, 1024, 16, "cpu")
    lines = []
    for bits, group in FORMATS:
        e = Q.quantization_error(w, Q.quantize(w, bits, group))
        record_property(f"quant_error_int{bits}_g{group}", e)
        lines.append(f"int{bits}{'' if bits == 8 else f' g{group}'}: {e:.4f}")
        assert e < (0.02 if bits == 8 else 0.2), (bits, group, e)
    with capsys.disabled():
        print("\nquantization error vs the float weight: " + ", ".join(lines))


def test_quantized_weight_to_and_nbytes():
    qw = Q.quantize_int4(_weight(8, 128, 17, "cpu"), 64)
    # bytes as stored: the 8 rows fill one panel of PANEL_ROWS (zero-padded), a 4-byte word per scale
    # and zero point
    assert qw.nbytes() == Q.PANEL_ROWS * 64 + 8 * 2 * 4
    moved = qw.to("cpu")
    moved.validate()
    assert Q.sz_words(moved) is not None  # still views of one set of words
    assert torch.equal(moved.dequantize(), qw.dequantize())


# --- bad inputs ---------------------------------------------------------------------------------------
def test_quantizer_bad_inputs():
    w = torch.randn(4, 96)
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_int4(torch.randn(4, 80), 64)       # K not a multiple of the group
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_int4(w, 48)
    with pytest.raises(ValueError, match="bits"):
        Q.quantize(w, 3)
    with pytest.raises(TypeError, match="w"):
        Q.quantize_int8(w.to(torch.int32))
    with pytest.raises(ValueError, match="w"):
        Q.quantize_int8(torch.randn(96))
    with pytest.raises(ValueError, match="NaN"):
        Q.quantize_int8(torch.full((2, 8), float("nan")))
    with pytest.raises(ValueError, match="q"):
        Q.pack_int4(torch.full((2, 64), 16, dtype=torch.uint8), 32)


def test_kernel_bad_inputs_name_the_argument():
    w = _weight(12, 64, 18)
    q4 = Q.quantize_int4(w, 32)
    x = _x((3, 64), torch.float16, 19)
    with pytest.raises(ValueError, match="qw: K=48 is not a multiple of group_size=32"):
        QM.quant_matmul(x, replace(q4, K=48))
    with pytest.raises(ValueError, match=r"qw.data: expected shape \(1, 2, 64, 16\)"):
        QM.quant_matmul(x, replace(q4, data=q4.data[:, :1].contiguous()))
    with pytest.raises(TypeError, match="qw.data: expected dtype uint8"):
        QM.quant_matmul(x, replace(q4, data=q4.data.view(torch.int8)))
    with pytest.raises(TypeError, match="x: dtype float32"):
        QM.quant_matmul(x.float(), q4)
    with pytest.raises(ValueError, match="x: last dim 32"):
        QM.quant_matmul(x[:, :32], q4)
    with pytest.raises(TypeError, match="qw: expected a QuantizedWeight"):
        QM.quant_matmul(x, w)
    with pytest.raises(ValueError, match="BLOCK_K not a multiple of the group"):
        QM.quant_matmul(x, Q.quantize_int4(w, 64), config=_config("gemv", 4, 32, 1, 64))


# --- GPU only: the peers compute the same product (so their times compare like with like) ----------
@pytest.mark.gpu
@pytest.mark.parametrize("group", Q.INT4_GROUP_SIZES)
def test_tinygemm_peer_agrees(group):
    p = QM.Problem(16, 256, 1024, 4, group)
    case = QM.make_inputs(p, torch.bfloat16, "cuda", 20)
    fn = QM._tinygemm(case)
    # tinygemm's zero, (8 − z)·s, is rounded to bf16: close to our weight, not identical
    c = cmp.compare(fn(), ref.quant_matmul(*case.args), torch.bfloat16)
    assert c.error < 2e-2, str(c)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
def test_gemlite_peer_agrees(bits):
    pytest.importorskip("gemlite")
    p = QM.Problem(16, 4096, 4096, bits, 128)  # the peer is offered for N·K >= 2^24 only
    case = QM.make_inputs(p, torch.float16, "cuda", 21)
    fn = QM._gemlite(case)
    c = cmp.compare(fn(), ref.quant_matmul(*case.args), torch.float16)
    assert c.error < 2e-2, str(c)
