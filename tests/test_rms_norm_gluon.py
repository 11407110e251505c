"""rms_norm's Gluon kernel for long rows (kernels/rms_norm_gluon.py, config gluon=1): on a CUDA GPU of compute
capability 9 or more, against the float64 reference with the table's tolerance (every row on its own as well as
the whole); everywhere, that a gluon=1 config falls back to the Triton kernel where the Gluon kernel does not take
the call, and that the interpreter never tries it."""
import pytest
import torch

from tritune import kernels as K
from tritune.kernels import rms_norm_gluon as RG
from tritune.kernels.rms_norm import SPEC, Problem, rms_norm
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S
from tritune.references import rms_norm as ref

gpu = pytest.mark.skipif(not RG.runs_here(), reason="the Gluon kernel runs on CUDA GPUs of capability 9 or more")
EPS = 1e-6


def gluon_cfg(chunk=8192, warps=8) -> dict:
    return {"BLOCK_N": chunk, "ROWS": 1, "num_warps": warps, "num_stages": 1, "gluon": 1}


@pytest.fixture
def launches(monkeypatch):
    """The chunk of each Gluon launch rms_norm makes (the kernel still runs)."""
    calls, real = [], RG.launch

    def spy(*args, **kwargs):
        calls.append(kwargs["chunk"])
        return real(*args, **kwargs)

    monkeypatch.setattr(RG, "launch", spy)
    return calls


def _inputs(M, N, dtype, affine, seed, device=None):
    device = device or dev.device()
    x = S.randn((M, N), dtype, device, seed, scale=2.0, shift=0.3)
    w = S.randn((N,), dtype, device, seed + 1, scale=0.5, shift=1.0) if affine else None
    return x, w


def _check_rows(y, want, dtype, what="y"):
    """The whole output against the reference (poison, NaN, the table's tolerance), then each row alone."""
    cmp.check(y, want, dtype, what=what)
    d = y.reshape(-1, y.shape[-1]).double()
    r = want.reshape(-1, want.shape[-1]).to(d.device)
    err = (d - r).norm(dim=-1) / r.norm(dim=-1)
    worst = int(err.argmax())
    assert err[worst].item() <= cmp.tolerance(dtype), f"{what}: row {worst} rel error {err[worst].item():.3e}"


def _sliced(M, N, dtype, seed, pad):
    """x (M, N) as a view of an (M, N + pad) buffer whose padding is NaN (a read past the row shows)."""
    x, _ = _inputs(M, N, dtype, False, seed)
    buf = torch.full((M, N + pad), float("nan"), dtype=dtype, device=x.device)
    buf[:, :N] = x
    return buf[:, :N]


# ---------------------------------------------------------------------------------------------------
# On the GPU: the Gluon kernel itself
@gpu
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [16400, 20000, 32768, 65536])
@pytest.mark.parametrize("M", [1, 3, 133, 300])
def test_gluon_matches_reference(M, N, dtype, affine, launches):
    x, w = _inputs(M, N, dtype, affine, M + N)
    y = cmp.poison(torch.empty_like(x))
    assert rms_norm(x, w, EPS, out=y, config=gluon_cfg()) is y
    assert launches == [8192]
    _check_rows(y, ref.rms_norm(x, w, EPS), dtype)


@gpu
@pytest.mark.parametrize("chunk,warps", [(c, w) for c in RG.CHUNKS for w in RG.WARPS if c // (32 * w) <= 64])
@pytest.mark.parametrize("N", [16400, 65536])
def test_gluon_every_chunk_and_warp_count(N, chunk, warps, launches):
    """Every gluon point of the space (the tuner's), rows cut into chunks of 4096 to 16384."""
    x, w = _inputs(133, N, torch.bfloat16, True, 7)
    y = cmp.poison(torch.empty_like(x))
    rms_norm(x, w, EPS, out=y, config=gluon_cfg(chunk, warps))
    assert launches == [chunk]
    _check_rows(y, ref.rms_norm(x, w, EPS), torch.bfloat16)


@gpu
@pytest.mark.parametrize("N,chunk", [(16400, 4096), (20000, 8192), (65536, 8192), (65536, 16384)])
def test_gluon_many_rows_per_program(N, chunk, launches):
    """Dozens of rows a program: the ring's slots wrap many times, mid-row, and each slot's barrier phase
    alternates across the rows (a wrong phase reads a chunk before it lands, or hangs)."""
    M = 24 * K.num_sms() + 5
    x, w = _inputs(M, N, torch.bfloat16, True, 11)
    y = cmp.poison(torch.empty_like(x))
    rms_norm(x, w, EPS, out=y, config=gluon_cfg(chunk))
    assert launches == [chunk]
    _check_rows(y, ref.rms_norm(x, w, EPS), torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N", [16400, 20000, 65536])
def test_gluon_sliced_rows(N, dtype, launches):
    """x and y views of wider buffers (row stride > N, 16-byte aligned): TMA reads no column past N (the NaN
    padding would show), and nothing is written past N in y's rows (its padding keeps the poison)."""
    M, pad = 133, 24
    x = _sliced(M, N, dtype, 3, pad)
    w = S.randn((N,), dtype, "cuda", 4, scale=0.5, shift=1.0)
    ybuf = cmp.poison(torch.empty((M, N + pad), dtype=dtype, device="cuda"))
    y = ybuf[:, :N]
    rms_norm(x, w, EPS, out=y, config=gluon_cfg())
    assert launches == [8192]
    _check_rows(y, ref.rms_norm(x, w, EPS), dtype)
    assert bool(cmp.is_poison(ybuf[:, N:]).all()), "written past the row's end"


@gpu
def test_gluon_leading_dims_merged(launches):
    """A (2, 3, N) x: its rows are the merged leading dims, as for the Triton kernel."""
    x, w = _inputs(6, 32768, torch.bfloat16, True, 5)
    x = x.view(2, 3, 32768)
    y = rms_norm(x, w, EPS, config=gluon_cfg())
    assert launches == [8192] and y.shape == x.shape
    _check_rows(y, ref.rms_norm(x, w, EPS), torch.bfloat16)


@gpu
@pytest.mark.parametrize("case", ["unaligned row stride", "unaligned base", "transposed"])
def test_gluon_config_falls_back_where_tma_cannot_read(case, launches):
    """x whose rows TMA cannot read (a row stride or base not 16-byte aligned, a column-major x) takes the Triton
    kernel with the same config (the base is checked each call, the strides once per plan)."""
    M, N = 133, 20000
    if case == "unaligned row stride":
        x = _sliced(M, N, torch.bfloat16, 8, 3)
    elif case == "unaligned base":
        x = _sliced(M, N + 1, torch.bfloat16, 8, 15)[:, 1:]
    else:
        x = S.with_layout(_inputs(M, N, torch.bfloat16, False, 8)[0], "transposed")
    w = S.randn((N,), torch.bfloat16, "cuda", 9, scale=0.5, shift=1.0)
    y = cmp.poison(torch.empty((M, N), dtype=torch.bfloat16, device="cuda"))
    rms_norm(x, w, EPS, out=y, config=gluon_cfg())
    _check_rows(y, ref.rms_norm(x, w, EPS), torch.bfloat16)
    assert launches == []


@gpu
def test_gluon_refuses_ineligible_problems_by_name():
    """An explicit gluon=1 config on a problem the kernel does not take is refused, the reason named."""
    x, w = _inputs(4, 20000, torch.bfloat16, True, 1)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, EPS, x.clone(), config=gluon_cfg())
    with pytest.raises(ValueError, match="bf16 and fp16"):
        rms_norm(x.float(), w.float(), EPS, config=gluon_cfg())
    with pytest.raises(ValueError, match="longer than 16384"):
        rms_norm(x[:, :16384], w[:16384], EPS, config=gluon_cfg())


# ---------------------------------------------------------------------------------------------------
# Everywhere: where a gluon=1 config does not take the Gluon kernel
@pytest.mark.parametrize("case", ["residual", "float32"])
def test_forced_gluon_config_on_ineligible_input_falls_back(case, launches, monkeypatch):
    """A gluon=1 config that reaches a call the Gluon kernel does not take (the config cache holding it for the
    bucket, as a stored config would, past the constraint): the Triton kernel runs it, right."""
    M, N = 3, 16400
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x, w = _inputs(M, N, dtype, True, 21)
    r = S.randn((M, N), dtype, dev.device(), 23) if case == "residual" else None
    monkeypatch.setitem(K.CONFIG_CACHE, SPEC.config_key(Problem(M, N, r is not None, True), dtype), gluon_cfg())
    got = rms_norm(x, w, EPS, r)
    cmp.check(got, ref.rms_norm(x, w, EPS, r), dtype)
    assert launches == []


@pytest.mark.skipif(not dev.interpreted(), reason="the interpreter's path")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interpreter_never_tries_gluon(dtype, monkeypatch):
    """Under the interpreter a gluon=1 config is no point of the space (the constraint says why), none is
    seeded, and one that reaches a call anyway (the config cache) runs the Triton kernel: Gluon is never
    launched, compiled or asked about the device."""
    def refuse(*_, **__):
        raise AssertionError("the interpreter tried the Gluon kernel")

    monkeypatch.setattr(RG, "launch", refuse)
    monkeypatch.setattr(RG, "smem_limit", refuse)
    M, N = 3, 16400
    p = Problem(M, N, False, True)
    assert not RG.runs_here() and not RG.runs_on(torch.device("cpu"))
    assert "interpreter" in SPEC.space.why_invalid(gluon_cfg(), p, dtype)
    assert not any(c["gluon"] for c in SPEC.space.points(p, dtype))
    assert all(SPEC.space.why_invalid(c, p, dtype) for c in SPEC.seeds(p, dtype) if c.get("gluon"))
    x, w = _inputs(M, N, dtype, True, 31)
    monkeypatch.setitem(K.CONFIG_CACHE, SPEC.config_key(p, dtype), gluon_cfg())
    y = cmp.poison(torch.empty_like(x))
    rms_norm(x, w, EPS, out=y)
    cmp.check(y, ref.rms_norm(x, w, EPS), dtype)


def test_gluon_constraint(monkeypatch):
    """The space's gluon=1 points, as on an H200 (227 KiB of shared memory a block): 2-byte dtypes, no
    residual, rows past 16384; the chunk (BLOCK_N) and num_warps read, ROWS and num_stages fixed at 1; a
    stored config without the key is the Triton kernel's."""
    monkeypatch.setattr(RG, "runs_here", lambda: True)
    monkeypatch.setattr(RG, "smem_limit", lambda index=None: 227 * 1024)
    bf16, p = torch.bfloat16, Problem(4096, 65536)
    why = SPEC.space.why_invalid
    assert why(gluon_cfg(), p, bf16) is None and why(gluon_cfg(), p, torch.float16) is None
    assert "bf16 and fp16" in why(gluon_cfg(), p, torch.float32)
    assert "residual" in why(gluon_cfg(), Problem(4096, 65536, True), bf16)
    assert "longer than 16384" in why(gluon_cfg(), Problem(4096, 16384), bf16)
    assert why(gluon_cfg(), Problem(3, 16385), bf16) is None
    assert "ROWS=1" in why(dict(gluon_cfg(), ROWS=2), p, bf16)
    assert "ROWS=1" in why(dict(gluon_cfg(), num_stages=3), p, bf16)
    assert "chunk" in why(gluon_cfg(2048, 8), p, bf16) and "chunk" in why(gluon_cfg(8192, 32), p, bf16)
    assert "per thread" in why(gluon_cfg(16384, 4), p, bf16)   # the Triton kernel's own limit (its fallback)
    monkeypatch.setattr(RG, "smem_limit", lambda index=None: 99 * 1024)   # a GPU of 99 KiB a block
    assert "ring" in why(gluon_cfg(), p, bf16) and why(gluon_cfg(), Problem(8, 40000), bf16) is None
    monkeypatch.setattr(RG, "smem_limit", lambda index=None: 227 * 1024)
    points = [(c["BLOCK_N"], c["num_warps"]) for c in SPEC.space.points(p, bf16) if c["gluon"]]
    assert sorted(points) == sorted((c, w) for c in RG.CHUNKS for w in RG.WARPS if c // (32 * w) <= 64)
    seeded = [c for c in SPEC.seeds(p, bf16) if c.get("gluon") and why(c, p, bf16) is None]
    assert sorted((c["BLOCK_N"], c["num_warps"]) for c in seeded) == sorted(points)
    legacy = {"BLOCK_N": 8192, "ROWS": 1, "num_warps": 16, "num_stages": 1}
    assert why(legacy, p, bf16) is None and SPEC.space.full(legacy)["gluon"] == 0
