"""GEMM-specific tests, on top of the generic property tests every spec gets (tests/test_kernels.py).

Edge sizes (1 in each dim), every transposition and epilogue combination, batched and non-mergeable
3-D A, split-K (uneven and empty slices, counters reset, deterministic), TMA descriptors and their
pointer fallback, the 64-bit offset path, and the config space itself; the fusions: the LayerNorm and
RMSNorm prologues, the KV-cache write, the SwiGLU epilogue over a [gate | up] weight.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels import gemm as G

DEV = dev.device()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(p: G.Problem, dtype, config=None, layout="contiguous", seed=0):
    case = G.make_inputs(p, dtype, DEV, seed, layout)
    cmp.poison(case.out)
    if config is not None:
        config = dict(G.default_config(p, dtype), **config)
        why = G.SPACE.why_invalid(config, p, dtype)
        assert why is None, why
    got = G.gemm(*case.args, out=case.out, config=config, **case.kwargs)
    assert got is case.out
    ref = G.ref.gemm(*case.args, **case.kwargs)
    return cmp.check(got, ref, dtype, G.SPEC.accumulation(dtype), what=f"gemm {p} {config} {layout}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mnk", [(1, 1, 1), (1, 37, 29), (23, 1, 29), (23, 37, 1), (1, 1, 300), (1, 130, 1)])
def test_unit_dims(mnk, dtype):
    _check(G.Problem(*mnk, bias=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("tma", [False, True])
def test_transposed_operands(trans_a, trans_b, tma, dtype):
    # 48 x 40 x 64: aligned strides, so TMA=True really takes descriptors in both orientations
    _check(G.Problem(48, 40, 64, trans_a=trans_a, trans_b=trans_b), dtype, {"TMA": tma})
    # odd sizes: unaligned strides, TMA falls back to pointers
    _check(G.Problem(19, 27, 33, trans_a=trans_a, trans_b=trans_b), dtype, {"TMA": tma})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias,act,residual", list(itertools.product([False, True], G.ACTIVATIONS, [False, True])))
def test_epilogues(bias, act, residual, dtype):
    _check(G.Problem(33, 46 if act == "swiglu" else 45, 70, bias=bias, act=act, residual=residual), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp(+big) = inf
def test_gelu_epilogue_is_tanh_gelu_and_finite_at_extremes():
    a = torch.tensor([[1.0], [-1.0], [30.0], [-30.0], [0.0]], device=DEV)
    b = torch.tensor([[1.0, 100.0, -100.0]], device=DEV)
    got = G.gemm(a, b, activation="gelu_tanh", config=dict(G.default_config(G.Problem(5, 3, 1), torch.float32)))
    want = torch.nn.functional.gelu((a.double() @ b.double()), approximate="tanh")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_batched_a(dtype):
    # merges into (M, K): the plain 2-D path, output keeps A's leading dims
    p = G.Problem(12, 20, 24, bias=True, residual=True, batch=3)
    case = G.make_inputs(p, dtype, DEV, 0)
    assert case.args[0].shape == (3, 4, 24) and case.out.shape == (3, 4, 20)
    _check(p, dtype)
    # per-batch transposed: rows do not merge into one stride, the kernel takes two row strides
    p = G.Problem(12, 20, 24, trans_a=True, act="gelu_tanh", batch=3)
    a = G.make_inputs(p, dtype, DEV, 0).args[0]
    with pytest.raises(RuntimeError):
        a.view(12, 24)
    _check(p, dtype)
    _check(p, dtype, {"SPLIT_K": 2, "GROUP_M": 1, "BLOCK_K": 16})


def test_residual_of_flat_shape_and_in_place():
    a = torch.randn(2, 3, 16, device=DEV)
    b = torch.randn(16, 8, device=DEV)
    r = torch.randn(6, 8, device=DEV)
    ref = G.ref.gemm(a, b, residual=r)
    cmp.check(G.gemm(a, b, residual=r), ref, torch.float32, G.SPEC.accumulation(torch.float32))
    # residual stream updated in place: out aliases residual (each element read before it is written)
    x = r.view(2, 3, 8).clone()
    G.gemm(a, b, residual=x, out=x)
    cmp.check(x, ref, torch.float32, G.SPEC.accumulation(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [2, 4, 8, 16])
def test_split_k(split, dtype):
    # K = 200 with BLOCK_K = 16: 13 K tiles in uneven slices (8 slices: 2 tiles each, the last one 0);
    # 16 slices would leave 3 without work and 13 K tiles < 16 prunes that point: check it does
    p = G.Problem(9, 40, 200, bias=True, act="gelu_tanh", residual=True)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": split, "GROUP_M": 1, "num_warps": 2,
           "TMA": False}
    if split > 13:
        assert "slices" in G.SPACE.why_invalid(dict(G.default_config(p, dtype), **cfg), p, dtype)
        return
    _check(p, dtype, cfg)


def test_split_k_empty_slices_counters_and_determinism():
    # 5 K tiles over 4 slices: 2 tiles each, the fourth slice has none and still counts in
    p = G.Problem(17, 33, 80, bias=True)
    cfg = dict(G.default_config(p, torch.float32), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=4, GROUP_M=1,
               num_warps=2)
    case = G.make_inputs(p, torch.float32, DEV, 3)
    first = G.gemm(*case.args, config=cfg, **case.kwargs)
    tiles = 2 * 3
    assert int(G._locks.buffers[case.args[0].device][:tiles].abs().sum()) == 0, "split-K counters not reset"
    again = G.gemm(*case.args, config=cfg, **case.kwargs)
    assert torch.equal(first, again), "split-K is not deterministic"
    cmp.check(first, G.ref.gemm(*case.args, **case.kwargs), torch.float32, G.SPEC.accumulation(torch.float32))
    # and TMA descriptors with split-K (aligned sizes)
    _check(G.Problem(16, 32, 256, trans_b=True), torch.float32, {"SPLIT_K": 4, "GROUP_M": 1, "TMA": True,
                                                               "BLOCK_K": 32})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tma", [False, True])
def test_persistent_programs_stride_over_tiles(monkeypatch, tma, dtype):
    # 2 SMs: each program runs several tiles (grouped order, edge tiles, every epilogue on the way)
    monkeypatch.setattr(G, "_num_sms", lambda: 2)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 4, "SPLIT_K": 1, "num_warps": 2,
           "PERSISTENT": True, "TMA": tma}
    _check(G.Problem(37, 50, 40, bias=True, act="gelu_tanh", residual=True), dtype, cfg)
    _check(G.Problem(48, 64, 32, trans_a=True, trans_b=True), dtype, cfg)
    _check(G.Problem(12, 40, 24, trans_a=True, batch=3, residual=True), dtype, cfg)
    # persistent and split-K do not combine
    p = G.Problem(37, 50, 40)
    assert "split-K" in G.SPACE.why_invalid(dict(G.default_config(p, dtype), **dict(cfg, SPLIT_K=2)), p, dtype)


def test_int64_offsets(monkeypatch):
    monkeypatch.setattr(G, "INT32_LIMIT", 1)
    _check(G.Problem(21, 19, 40, trans_a=True, bias=True, residual=True), torch.float16)
    _check(G.Problem(21, 19, 40, trans_b=True, batch=3), torch.float32, {"SPLIT_K": 2, "GROUP_M": 1, "BLOCK_K": 16})
    _check(G.Problem(12, 19, 40, trans_a=True, batch=3), torch.float32)
    _check(G.Problem(21, 19, 40, bias=True), torch.float32, {"PERSISTENT": True, "GROUP_M": 1})


@pytest.mark.parametrize("layout", ["sliced"])
def test_strided_views_never_read_padding(layout):
    # the sliced layout pads rows with NaN: any read past a row end poisons the result
    for p in (G.Problem(20, 24, 40), G.Problem(20, 24, 40, trans_a=True, trans_b=True)):
        _check(p, torch.float32, layout=layout)
        _check(p, torch.float32, {"TMA": True}, layout=layout)


def test_empty_m_and_out_argument():
    a = torch.randn(0, 8, device=DEV)
    b = torch.randn(8, 5, device=DEV)
    assert G.gemm(a, b).shape == (0, 5)
    a = torch.randn(3, 8, device=DEV)
    out = torch.empty(3, 5, device=DEV)
    assert G.gemm(a, b, out=out) is out
    # a 1-D A is one row: (K,) @ (K, N) -> (N,)
    v = torch.randn(8, device=DEV)
    cmp.check(G.gemm(v, b), G.ref.gemm(v, b), torch.float32, G.SPEC.accumulation(torch.float32))


def test_launch_plans_are_reused_only_where_they_apply():
    # The launcher caches one plan per (shapes, strides, dtypes, devices, epilogue, config): new data with
    # the same layout reuses it; a base pointer that lost its 16-byte alignment drops the TMA descriptor
    # for that launch; anything invalid still raises, hit or not.
    p = G.Problem(32, 48, 64, bias=True, residual=True)
    cfg = dict(G.default_config(p, torch.float32), TMA=True, SPLIT_K=1, BLOCK_K=16, GROUP_M=1)
    G._PLANS.clear()
    for seed in (0, 1, 2):  # on a GPU the later launches skip triton's binding (direct launch)
        case = G.make_inputs(p, torch.float32, DEV, seed)
        got = G.gemm(*case.args, config=cfg, **case.kwargs)
        cmp.check(got, G.ref.gemm(*case.args, **case.kwargs), torch.float32, G.SPEC.accumulation(torch.float32), what=f"seed {seed}")
    assert len(G._PLANS) == 1
    if DEV == "cuda":
        assert len(next(iter(G._PLANS.values())).kernels) == 1
    a, b, bias = G.make_inputs(p, torch.float32, DEV, 2).args
    buf = torch.empty(a.numel() + 1, device=DEV)
    a_off = buf[1:].view_as(a).copy_(a)  # same shape and strides, base 4 bytes past 16-byte alignment
    assert a_off.data_ptr() % 16 and a_off.stride() == a.stride()
    for x in (a, a_off, a):
        cmp.check(G.gemm(x, b, bias, config=cfg), G.ref.gemm(x, b, bias), torch.float32, G.SPEC.accumulation(torch.float32))
    assert len(G._PLANS) == 2  # one more plan (no residual), shared by both alignments
    with pytest.raises(ValueError, match="activation"):
        G.gemm(a, b, bias, activation="relu", config=cfg)
    with pytest.raises(TypeError, match="b: dtype"):
        G.gemm(a, b.half(), bias, config=cfg)
    # config=None plans follow the config cache: cleared (a store written) means looked up again
    G.gemm(a, b, bias)
    from tritune import kernels as K
    K.clear_config_cache()
    cmp.check(G.gemm(a, b, bias), G.ref.gemm(a, b, bias), torch.float32, G.SPEC.accumulation(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extra", [{}, {"SPLIT_K": 4, "GROUP_M": 1}, {"TMA": True, "PERSISTENT": True},
                                   {"TMA": True, "SPLIT_K": 2, "GROUP_M": 1}], ids=str)
def test_repeated_launches_with_new_data(extra, dtype):
    # the launches after a plan's first go straight to its compiled kernel on a GPU: new pointers (an
    # output allocated per call, in-place residual), every epilogue, split-K's shared workspace, TMA
    p = G.Problem(40, 64, 96, bias=True, act="gelu_tanh", residual=True)
    cfg = dict(G.default_config(p, dtype), BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=2, **extra)
    assert G.SPACE.why_invalid(cfg, p, dtype) is None
    for seed in range(3):
        a, b, bias = G.make_inputs(p, dtype, DEV, seed).args
        r = G.make_inputs(p, dtype, DEV, seed).kwargs["residual"]
        ref = G.ref.gemm(a, b, bias, activation="gelu_tanh", residual=r)
        cmp.check(G.gemm(a, b, bias, activation="gelu_tanh", residual=r, config=cfg), ref, dtype,
                  G.SPEC.accumulation(dtype), what=f"seed {seed}")
        G.gemm(a, b, bias, activation="gelu_tanh", residual=r, out=r, config=cfg)  # in place
        cmp.check(r, ref, dtype, G.SPEC.accumulation(dtype), what=f"in place, seed {seed}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("prefetch,per_thread", [(True, 32), (True, 0), (False, 32)],
                         ids=["bias+residual", "bias", "off"])
def test_epilogue_prefetch(monkeypatch, prefetch, per_thread, dtype):
    # PRE_EPI: bias (and a small residual tile) loaded before the main loop; every mode gives the same
    # C, in place too (each program reads its residual tile before it writes that tile)
    monkeypatch.setattr(G, "PREFETCH_EPILOGUE", prefetch)
    monkeypatch.setattr(G, "RES_PREFETCH_PER_THREAD", per_thread)
    p = G.Problem(37, 45, 70, bias=True, act="gelu_tanh", residual=True)
    cfg = dict(G.default_config(p, dtype), BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT_K=1, num_warps=2,
               PERSISTENT=False)
    a, b, bias = G.make_inputs(p, dtype, DEV, 3).args
    r = G.make_inputs(p, dtype, DEV, 3).kwargs["residual"]
    ref = G.ref.gemm(a, b, bias, activation="gelu_tanh", residual=r)
    plan = G._make_plan(a, b, bias, "gelu_tanh", r, None, cfg)
    assert plan.kws[0][0]["PRE_EPI"] == (0 if not prefetch else 2 if per_thread else 1)
    cmp.check(G.gemm(a, b, bias, activation="gelu_tanh", residual=r, config=cfg), ref, dtype,
              G.SPEC.accumulation(dtype))
    G.gemm(a, b, bias, activation="gelu_tanh", residual=r, out=r, config=cfg)
    cmp.check(r, ref, dtype, G.SPEC.accumulation(dtype), what="in place")


@pytest.mark.parametrize("sms", [132, 2], ids=["program per tile", "programs take several tiles"])
def test_epilogue_prefetch_only_whole_tiles(monkeypatch, sms):
    # split-K's epilogue runs in the last program of a tile: no prefetch. A persistent grid prefetches
    # only with a program per tile (a program that takes several tiles compiles as it did without it).
    monkeypatch.setattr(G, "_num_sms", lambda: sms)
    p = G.Problem(37, 45, 70, bias=True, residual=True)
    a, b, bias = G.make_inputs(p, torch.float32, DEV, 0).args
    r = G.make_inputs(p, torch.float32, DEV, 0).kwargs["residual"]
    ref = G.ref.gemm(a, b, bias, residual=r)
    base = dict(G.default_config(p, torch.float32), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=2, GROUP_M=1,
                TMA=False)
    for extra, want in (({"SPLIT_K": 2}, 0), ({"PERSISTENT": True, "SPLIT_K": 1}, 2 if sms > 2 else 0),
                        ({"SPLIT_K": 1}, 2)):
        cfg = dict(base, **extra)
        assert G.SPACE.why_invalid(cfg, p, torch.float32) is None
        assert G._make_plan(a, b, bias, None, r, None, cfg).kws[0][0]["PRE_EPI"] == want, extra
        cmp.check(G.gemm(a, b, bias, residual=r, config=cfg), ref, torch.float32, G.SPEC.accumulation(torch.float32), what=str(extra))


@pytest.mark.parametrize("label,thunk_args,exc,match", [
    ("inner", lambda d: ((torch.randn(4, 8, device=d), torch.randn(7, 5, device=d)), {}), ValueError, "inner sizes"),
    ("dtype", lambda d: ((torch.randn(4, 8, device=d), torch.randn(8, 5, device=d).half()), {}), TypeError, "b: dtype"),
    ("device", lambda d: ((torch.randn(4, 8, device="meta"), torch.randn(8, 5, device=d)), {}), ValueError, "a: expected"),
    ("bias", lambda d: ((torch.randn(4, 8, device=d), torch.randn(8, 5, device=d), torch.randn(4, device=d)), {}),
     ValueError, "bias"),
    ("residual", lambda d: ((torch.randn(4, 8, device=d), torch.randn(8, 5, device=d)),
                            {"residual": torch.randn(5, 4, device=d)}), ValueError, "residual"),
    ("activation", lambda d: ((torch.randn(4, 8, device=d), torch.randn(8, 5, device=d)), {"activation": "gelu"}),
     ValueError, "activation"),
])
def test_bad_inputs_name_the_argument(label, thunk_args, exc, match):
    args, kwargs = thunk_args(DEV)
    with pytest.raises(exc, match=match):
        G.gemm(*args, **kwargs)


def test_space_is_wide_at_large_shapes_and_tight_at_small_ones():
    big = G.SPACE.points(G.Problem(8192, 8192, 8192), torch.bfloat16)
    assert len(big) >= 300, len(big)
    tiny = G.SPACE.points(G.Problem(5, 7, 9), torch.float32)
    assert tiny and all(c["BLOCK_M"] == 16 and c["BLOCK_N"] == 16 and c["BLOCK_K"] == 16 for c in tiny)
    # shared memory budget respected everywhere
    for c in big:
        assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 * c["num_stages"] <= G.SMEM_BUDGET


def test_default_config_shapes():
    # small M: split-K when the tiles are few and K is long (GPT-2 c_proj), none at K = 768
    assert G.default_config(G.Problem(1, 768, 768), torch.bfloat16)["SPLIT_K"] == 1
    assert G.default_config(G.Problem(1, 768, 3072), torch.bfloat16)["SPLIT_K"] == 8
    assert G.default_config(G.Problem(64, 768, 3072), torch.bfloat16)["SPLIT_K"] == 4
    assert G.default_config(G.Problem(1, 768, 16384), torch.bfloat16)["SPLIT_K"] > 1
    big = G.default_config(G.Problem(8192, 8192, 8192), torch.bfloat16)
    assert big["BLOCK_M"] >= 128 and big["BLOCK_N"] >= 128
    for p in G.SPEC.standard_problems:
        for dt in G.DTYPES:
            assert G.SPACE.why_invalid(G.default_config(p, dt), p, dt) is None


def test_default_config_is_valid_for_every_shape_class():
    # Narrow N with M > 64 once had no default at all (a crash on a valid input): sweep the classes.
    sizes = [1, 2, 7, 13, 16, 17, 33, 64, 65, 127, 128, 129, 511, 1000, 4096, 8192, 50257]
    for m in sizes:
        for n in sizes:
            for k in (1, 7, 64, 768, 3072):
                p = G.Problem(m, n, k)
                for dt in G.DTYPES:
                    cfg = G.default_config(p, dt)
                    assert G.SPACE.why_invalid(cfg, p, dt) is None, (p, dt, cfg)


def test_narrow_n_with_many_rows_runs():
    a, b, bias = torch.randn(65, 7, device=DEV), torch.randn(7, 13, device=DEV), torch.randn(13, device=DEV)
    cmp.check(G.gemm(a, b, bias), G.SPEC.reference(a, b, bias), torch.float32,
              G.SPEC.accumulation(torch.float32))


# ---------------------------------------------------------------------------------------------------
# The LayerNorm prologue (ln=) and the KV-cache write (kv=): gemv's arguments on the gemm
# ---------------------------------------------------------------------------------------------------
def _check_cache(case, y):
    """The caches hold each live row's k and v columns of y bit for bit, and nothing else (NaN elsewhere)."""
    kc, vc, slots = case.kwargs["kv"]
    c = kc.shape[2] * kc.shape[3]
    y2 = y.reshape(-1, 3 * c)
    fk, fv = kc.view(-1, c), vc.view(-1, c)
    live = [(i, s) for i, s in enumerate(slots.tolist()) if s >= 0]
    for i, s in live:
        assert torch.equal(fk[s], y2[i, c:2 * c]) and torch.equal(fv[s], y2[i, 2 * c:]), (i, s)
    dead = sorted(set(range(fk.shape[0])) - {s for _, s in live})
    assert fk[dead].isnan().all() and fv[dead].isnan().all()


@pytest.mark.pairwise
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extra", [{}, {"SPLIT_K": 2, "GROUP_M": 1, "BLOCK_K": 16},
                                   {"SPLIT_K": 4, "GROUP_M": 1, "BLOCK_K": 16}, {"BLOCK_N": 16, "num_warps": 2}],
                         ids=["default", "split-K 2", "split-K 4", "16x16"])
@pytest.mark.parametrize("prob", [dict(M=7, N=48, K=40, bias=True, ln=True, kv=True),
                                  dict(M=37, N=33, K=70, act="gelu_tanh", residual=True, ln=True, trans_a=True),
                                  dict(M=12, N=24, K=64, ln=True, kv=True, batch=3, trans_a=True),
                                  dict(M=5, N=21, K=33, trans_b=True, kv=True),
                                  dict(M=7, N=48, K=40, bias=True, rms=True, kv=True),
                                  dict(M=37, N=34, K=70, act="swiglu", residual=True, rms=True, trans_a=True),
                                  dict(M=12, N=24, K=64, act="swiglu", ln=True, batch=3, trans_b=True)],
                         ids=["qkv", "mlp-in", "3-D A", "kv only", "rms qkv", "rms swiglu", "ln swiglu 3-D A"])
def test_ln_prologue_and_kv_write(prob, extra, dtype):
    # every K slice computes the rows' statistics itself; the cache gets the rounded output's k, v columns
    p = G.Problem(**prob)
    cfg = dict(G.default_config(p, dtype), **extra)
    if G.SPACE.why_invalid(cfg, p, dtype):
        pytest.skip(G.SPACE.why_invalid(cfg, p, dtype))
    for layout in ("contiguous", "sliced"):
        case = G.make_inputs(p, dtype, DEV, 5, layout)
        cmp.poison(case.out)
        y = G.gemm(*case.args, out=case.out, config=cfg, **case.kwargs)
        cmp.check(y, G.ref.gemm(*case.args, **case.kwargs), dtype, G.SPEC.accumulation(dtype), what=f"{p} {cfg}")
        if p.kv:
            _check_cache(case, y)


def test_ln_rows_do_not_depend_on_m():
    # a row's LayerNorm statistics and products follow the row and the config only: the same bits alone
    # and at any place in a batch (the batch-invariant mode's premise), split-K too
    p = G.Problem(37, 48, 160, bias=True, ln=True, kv=True)
    cfg = dict(G.default_config(G.Problem(16, 48, 160, bias=True, ln=True), torch.float32), SPLIT_K=2)
    case = G.make_inputs(p, torch.float32, DEV, 1)
    a, b, bias = case.args
    y = G.gemm(a, b, bias, ln=case.kwargs["ln"], config=cfg)
    for i in (0, 15, 16, 36):
        assert torch.equal(G.gemm(a[i:i + 1].clone(), b, bias, ln=case.kwargs["ln"], config=cfg)[0], y[i])
    kv = case.kwargs["kv"]
    assert torch.equal(G.gemm(a, b, bias, ln=case.kwargs["ln"], kv=kv, config=cfg), y)   # kv: the same bits


@pytest.mark.skipif(not dev.interpreted(), reason="the interpreter's dot (the GPU's tile shapes are fixed by the config)")
def test_interpreter_dot_rows_do_not_depend_on_the_blas(monkeypatch):
    """The interpreter's float tl.dot never goes to numpy's matmul, whose BLAS sums in an order that
    follows the tile's shape and the CPU: here a matmul whose rows change with the tile's row count
    (what another CPU's BLAS may do, in its last bits) leaves a row alone and in a batch the same."""
    import numpy as np

    real = np.matmul

    def shape_dependent(x, y, *args, **kwargs):
        out = real(x, y, *args, **kwargs)
        return out * (1 + 1e-3 * x.shape[-2]) if out.dtype.kind == "f" and np.ndim(x) >= 2 else out

    monkeypatch.setattr(np, "matmul", shape_dependent)
    p = G.Problem(37, 48, 160, bias=True)
    cfg = dict(G.default_config(G.Problem(16, 48, 160, bias=True), torch.float32), SPLIT_K=2)
    for dtype in (torch.float32, torch.float16):
        a, b, bias = G.make_inputs(p, dtype, DEV, 3).args
        y = G.gemm(a, b, bias, config=cfg)
        cmp.check(y, G.ref.gemm(a, b, bias), dtype, "ieee")
        for i in (0, 16, 36):
            assert torch.equal(G.gemm(a[i:i + 1].clone(), b, bias, config=cfg)[0], y[i]), (dtype, i)


def test_ln_without_weight_or_bias_and_cached_plans():
    p = G.Problem(9, 24, 50, ln=True, kv=True)
    for seed in (1, 2, 1):   # one plan, each call's data (the eps of the call too)
        case = G.make_inputs(p, torch.float32, DEV, seed)
        for ln in ((None, None, 1e-5), (case.kwargs["ln"][0], None, 0.1), (None, case.kwargs["ln"][1], 0.0)):
            y = G.gemm(*case.args, ln=ln, kv=case.kwargs["kv"])
            cmp.check(y, G.ref.gemm(*case.args, ln=ln), torch.float32, "ieee", what=str(ln[2]))
            _check_cache(case, y)


def test_fusions_refuse_tma_and_persistent_and_keep_plain_buckets():
    for flag in ("TMA", "PERSISTENT"):
        for p in (G.Problem(64, 96, 64, ln=True), G.Problem(64, 96, 64, kv=True)):
            cfg = dict(G.default_config(p, torch.float16), **{flag: True})
            assert "pointer operands" in G.SPACE.why_invalid(cfg, p, torch.float16)
    # large fused problems: the default drops TMA and the persistent grid
    big = G.Problem(8192, 3072, 768, bias=True, act="gelu_tanh", ln=True)
    cfg = G.default_config(big, torch.bfloat16)
    assert not cfg["TMA"] and not cfg["PERSISTENT"] and G.SPACE.why_invalid(cfg, big, torch.bfloat16) is None
    # a plain problem's store key is what it was; fused ones have their own fields
    assert G.bucket(G.Problem(1, 2304, 768, bias=True)) == {"M": 1, "N": 2304, "K": 768}
    assert G.bucket(G.Problem(1, 2304, 768, ln=True, kv=True)) == {"M": 1, "N": 2304, "K": 768, "ln": 1, "kv": 1}
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(ValueError, match="pointer operands"):
        G.gemm(x, torch.randn(8, 6, device=DEV), ln=(None, None, 1e-5),
               config=dict(G.default_config(G.Problem(4, 6, 8, ln=True), torch.float32), PERSISTENT=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 GPT-2 decode shapes, direct launches)")
def test_gpu_fused_gpt2_rows_bitwise_alone_and_batched():
    # the batch-invariant mode's pinned configs in bf16 on GPT-2 small's fused linears: a row gives the same
    # bits alone and in a 37-row batch, repeated launches (direct, after the first) read each call's data,
    # and the qkv product writes the cache exactly
    from tritune.model.engine import invariant

    for p in G.gpt2_fused(37):
        cfg = invariant.gemm_config(p.N, p.K, p.trans_b, p.bias, p.act, False, torch.bfloat16, ln=True, kv=p.kv)
        for seed in (0, 1):
            case = G.make_inputs(p, torch.bfloat16, DEV, seed)
            y = G.gemm(*case.args, config=cfg, **case.kwargs)
            cmp.check(y, G.ref.gemm(*case.args, **case.kwargs), torch.bfloat16, "ieee", what=str(p))
            if p.kv:
                _check_cache(case, y)
            a, b, bias = case.args
            for i in (0, 1, 15, 16, 36):
                one = G.gemm(a[i:i + 1].clone(), b, bias, activation=p.act, ln=case.kwargs["ln"], config=cfg)
                assert torch.equal(one[0], y[i]), (p, i)


# ---------------------------------------------------------------------------------------------------
# SwiGLU (activation="swiglu": b the [gate | up] weight) and the RMSNorm prologue (rms=)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extra", [{}, {"SPLIT_K": 4, "GROUP_M": 1, "BLOCK_K": 16}, {"TMA": True},
                                   {"TMA": True, "PERSISTENT": True}, {"BLOCK_N": 16, "BLOCK_M": 16, "num_warps": 2}],
                         ids=["default", "split-K 4", "TMA", "persistent TMA", "16x16"])
@pytest.mark.parametrize("trans_b", [False, True])
def test_swiglu_epilogue(trans_b, extra, dtype):
    # 48 x 2·40 x 64: aligned, so TMA=True takes descriptors (the up tile at column 40 of the same one)
    p = G.Problem(48, 80, 64, trans_b=trans_b, bias=True, act="swiglu", residual=True)
    cfg = dict(G.default_config(p, dtype), **extra)
    if G.SPACE.why_invalid(cfg, p, dtype):
        pytest.skip(G.SPACE.why_invalid(cfg, p, dtype))
    case = G.make_inputs(p, dtype, DEV, 2)
    assert case.out.shape == (48, 40)
    _check(p, dtype, extra)
    # odd sizes, strided views: pointer loads with masked edges (the wrap of the gate's columns never
    # reaches the up half)
    _check(G.Problem(19, 2 * 27, 70, trans_b=trans_b, act="swiglu"), dtype, dict(extra, TMA=False, PERSISTENT=False),
           layout="sliced")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy exp(+big) = inf
def test_swiglu_is_silu_of_the_gate_times_the_up_half_and_finite_at_extremes():
    a = torch.tensor([[1.0], [-1.0], [0.5]], device=DEV)
    wg, wu = torch.tensor([[1.0, 100.0, -100.0]], device=DEV), torch.tensor([[2.0, -1.0, 3.0]], device=DEV)
    got = G.gemm(a, torch.cat([wg, wu], dim=1), activation="swiglu")
    want = torch.nn.functional.silu(a.double() @ wg.double()) * (a.double() @ wu.double())
    assert got.shape == (3, 3) and torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


def test_rms_prologue_without_weight_cached_plans_and_rows_independent_of_m():
    p = G.Problem(37, 48, 160, bias=True, act="swiglu", rms=True)
    cfg = dict(G.default_config(G.Problem(16, 48, 160, bias=True, act="swiglu", rms=True), torch.float32), SPLIT_K=2)
    for seed in (1, 2, 1):   # one plan, each call's data and eps
        case = G.make_inputs(p, torch.float32, DEV, seed)
        a, b, bias = case.args
        for rms in ((None, 1e-6), (case.kwargs["rms"][0], 0.5)):
            y = G.gemm(a, b, bias, activation="swiglu", rms=rms, config=cfg)
            cmp.check(y, G.ref.gemm(a, b, bias, activation="swiglu", rms=rms), torch.float32, "ieee", what=str(rms[1]))
    # a row's statistics and products follow the row and the config only (the batch-invariant premise)
    for i in (0, 15, 36):
        assert torch.equal(G.gemm(a[i:i + 1].clone(), b, bias, activation="swiglu", rms=rms, config=cfg)[0], y[i])
    # the RMSNorm is not the LayerNorm: rows with a mean give different results
    ln = G.gemm(a, b, bias, activation="swiglu", ln=(rms[0], None, rms[1]), config=cfg)
    assert not torch.allclose(ln, y)


def test_swiglu_and_rms_buckets_space_and_defaults():
    # the old problems' store keys are what they were; the new fusions have their own fields
    assert G.bucket(G.Problem(8, 3072, 768, bias=True, act="gelu_tanh")) == {"M": 8, "N": 3072, "K": 768}
    assert G.bucket(G.Problem(8, 16384, 2048, act="swiglu")) == {"M": 8, "N": 16384, "K": 2048, "swiglu": 1}
    assert G.bucket(G.Problem(1, 3072, 2048, rms=True)) == {"M": 1, "N": 3072, "K": 2048, "rms": 1}
    sw = G.Problem(4096, 16384, 2048, act="swiglu")
    for c in G.SPACE.points(sw, torch.bfloat16):   # both B tiles and both accumulators counted
        assert (c["BLOCK_M"] + 2 * c["BLOCK_N"]) * c["BLOCK_K"] * 2 * c["num_stages"] <= G.SMEM_BUDGET
        assert 2 * c["BLOCK_M"] * c["BLOCK_N"] <= 128 * 32 * c["num_warps"]
    assert "even N" in G.SPACE.why_invalid(G.default_config(G.Problem(4, 8, 8), torch.float32),
                                           G.Problem(4, 7, 8, act="swiglu"), torch.float32)
    for flag in ("TMA", "PERSISTENT"):
        p = G.Problem(64, 96, 64, rms=True)
        assert "pointer operands" in G.SPACE.why_invalid(dict(G.default_config(p, torch.float16), **{flag: True}),
                                                         p, torch.float16)
    for m in (1, 16, 128, 1024, 4096):   # the Llama-3.2-1B projection's default: half-width tiles of the plain one
        p = G.llama_swiglu(m)
        assert p in G.SPEC.standard_problems
        plain = G.default_config(G.Problem(m, p.N, p.K), torch.bfloat16)
        assert G.default_config(p, torch.bfloat16)["BLOCK_N"] == plain["BLOCK_N"] // 2
    for m in (1, 7, 64, 129, 8192):
        for n in (2, 14, 130, 3072, 16384):
            for k in (1, 64, 2048):
                for dt in G.DTYPES:
                    for p in (G.Problem(m, n, k, act="swiglu"), G.Problem(m, n, k, rms=True, act="swiglu")):
                        assert G.SPACE.why_invalid(G.default_config(p, dt), p, dt) is None, (p, dt)


@pytest.mark.parametrize("label,call,exc,match", [
    ("odd N", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 5, device=d), activation="swiglu"),
     ValueError, "b: activation='swiglu'"),
    ("bias of C's width", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 6, device=d),
                                           torch.randn(3, device=d), activation="swiglu"), ValueError, "bias"),
    ("kv", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 6, device=d), activation="swiglu",
                            kv=(torch.zeros(3, 4, 1, 2, device=d),) * 2 + (torch.zeros(4, dtype=torch.int32, device=d),)),
     ValueError, "kv"),
    ("rms triple", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 6, device=d), rms=(None, None, 1.0)),
     TypeError, "rms"),
    ("rms and ln", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 6, device=d), rms=(None, 1e-6),
                                    ln=(None, None, 1e-5)), ValueError, "rms"),
    ("rms weight", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 6, device=d),
                                    rms=(torch.randn(6, device=d), 1e-6)), ValueError, "rms weight"),
    ("rms eps", lambda d: G.gemm(torch.randn(4, 8, device=d), torch.randn(8, 6, device=d), rms=(None, float("nan"))),
     ValueError, "rms eps"),
])
def test_swiglu_and_rms_bad_inputs_name_the_argument(label, call, exc, match):
    with pytest.raises(exc, match=match):
        call(DEV)
