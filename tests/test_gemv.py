"""gemv beyond the spec-generated tests: the KV-cache write, LayerNorm statistics on rows far from zero
mean, the RMSNorm prologue and the SwiGLU epilogue, split-K counters and determinism, and the decode step
that uses it."""
from __future__ import annotations

import pytest
import torch

from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels import gemv as G
from tritune import kernels as K

DEV = dev.device()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ONE_ROW = {"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 2, "num_warps": 1, "num_stages": 2}
DOT = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SPLIT_K": 1, "num_warps": 1, "num_stages": 2}


def _kv_case(m, heads, hd, dtype, seed=0, block_size=4, num_blocks=7):
    c = heads * hd
    case = G.make_inputs(G.Problem(m, 3 * c, 40, bias=True, ln=True), dtype, DEV, seed)
    kc = torch.randn(num_blocks, block_size, heads, hd, device=DEV).to(dtype)
    vc = torch.randn(num_blocks, block_size, heads, hd, device=DEV).to(dtype)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:m].to(torch.int32)
    if m > 1:
        slots[1] = -1  # a padding row: writes nothing
    return case, kc, vc, slots.to(DEV)


@pytest.mark.parametrize("config", [None, ONE_ROW, DOT], ids=["default", "one-row", "dot"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_write_lands_in_each_rows_slot_and_nowhere_else(config, dtype):
    m = 3 if config is not ONE_ROW else 1
    case, kc, vc, slots = _kv_case(m, heads=2, hd=5, dtype=dtype)
    k0, v0 = kc.clone(), vc.clone()
    cmp.poison(case.out)
    y = G.gemv(*case.args, out=case.out, config=config, kv=(kc, vc, slots), **case.kwargs)
    cmp.check(y, G.ref.gemv(*case.args, **case.kwargs), dtype, "ieee")
    c = 10
    fk, fv, f0k, f0v = kc.view(-1, c), vc.view(-1, c), k0.view(-1, c), v0.view(-1, c)
    live = [int(s) for s in slots.tolist() if s >= 0]
    for row, s in enumerate(slots.tolist()):
        if s >= 0:  # exactly the values of y's k and v columns
            assert torch.equal(fk[s], y[row, c:2 * c]) and torch.equal(fv[s], y[row, 2 * c:])
    others = [i for i in range(fk.shape[0]) if i not in live]
    assert torch.equal(fk[others], f0k[others]) and torch.equal(fv[others], f0v[others])


@pytest.mark.parametrize("config", [ONE_ROW, DOT, {**DOT, "BLOCK_K": 64, "SPLIT_K": 1}], ids=["one-row", "dot", "dot-wide"])
def test_layer_norm_of_rows_far_from_zero_mean(config):
    """fp32 rows with |mean| ≫ std over several LN chunks: shifted sums keep the variance (plain
    E[x²] − E[x]² would lose it) and the result holds the fp32 tolerance."""
    m, k, n = 2, 300, 24
    x = (1000.0 + torch.randn(m, k, generator=torch.Generator().manual_seed(1))).to(DEV)
    w = (torch.randn(k, n, generator=torch.Generator().manual_seed(2)) / k ** 0.5).to(DEV)
    ln = (torch.rand(k, device=DEV) + 0.5, torch.randn(k, device=DEV) * 0.1, 1e-5)
    if config["BLOCK_M"] == 1:
        x = x[:1]
    y = G.gemv(x, w, ln=ln, config=config)
    cmp.check(y, G.ref.gemv(x, w, ln=ln), torch.float32, "ieee")


def test_ln_without_weight_or_bias():
    case = G.make_inputs(G.Problem(3, 20, 33, ln=True), torch.float32, DEV, 5)
    x, w, _ = case.args
    for lw, lb in ((None, None), (case.kwargs["ln"][0], None), (None, case.kwargs["ln"][1])):
        y = G.gemv(x, w, ln=(lw, lb, 1e-5))
        cmp.check(y, G.ref.gemv(x, w, ln=(lw, lb, 1e-5)), torch.float32, "ieee")


@pytest.mark.parametrize("config", [ONE_ROW, {**DOT, "SPLIT_K": 4}], ids=["one-row", "dot"])
def test_split_k_is_deterministic_and_resets_its_counters(config):
    m = 1 if config["BLOCK_M"] == 1 else 5
    case = G.make_inputs(G.Problem(m, 70, 100, bias=True, act="gelu_tanh", residual=True, ln=True),
                         torch.float32, DEV, 3)
    ys = [G.gemv(*case.args, config=config, **case.kwargs) for _ in range(3)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    cmp.check(ys[0], G.ref.gemv(*case.args, **case.kwargs), torch.float32, "ieee")
    for buf in G._locks.buffers.values():
        assert int(buf.abs().sum()) == 0


def test_batched_leading_dims_and_strided_rows():
    x = torch.randn(2, 3, 50, device=DEV)[:, :, 5:45]       # rows with a stride, leading dims flattened
    w = torch.randn(40, 30, device=DEV) / 40 ** 0.5
    y = G.gemv(x, w)
    assert y.shape == (2, 3, 30)
    cmp.check(y, G.ref.gemv(x, w), torch.float32, "ieee")


def test_decode_on_gemv_matches_the_unfused_ops():
    """The GPT-2 decode step with its linears on gemv (LN and the KV write fused) gives the logits and the
    cache contents of the same step with gemv switched off (layer_norm + gemm + write_kv)."""
    from tritune.model.gpt2 import model as GP
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_engine_tests", Path(__file__).with_name("test_engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tiny_model = mod.tiny_model

    m = tiny_model(backend="triton")
    ops = m.ops
    assert ops._gemv is not None
    B, bs = 3, 4
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    results = []
    for use_gemv in (True, False):
        saved = ops._gemv
        ops._gemv = saved if use_gemv else None
        try:
            cache = m.new_cache(64, bs)
            # each sequence owns blocks [4i, 4i + 4): slot = 16 i + position
            for i, p in enumerate(prompts):
                m.prefill(torch.tensor(p), [len(p)], kv_cache=cache,
                          slot_mapping=torch.arange(len(p)) + 16 * i)
            pos = torch.tensor([len(p) for p in prompts], device=m.device)
            ids = torch.tensor([11, 12, 13], device=m.device)
            tables = torch.arange(16, dtype=torch.int32, device=m.device).view(4, 4)[:B].contiguous()
            slots = (pos + 16 * torch.arange(B, device=m.device)).to(torch.int32)
            logits = m.decode(ids, pos, cache, slots, tables, (pos + 1).to(torch.int32))
            results.append((logits, cache.k.clone(), cache.v.clone()))
        finally:
            ops._gemv = saved
    (l1, k1, v1), (l2, k2, v2) = results
    # the unfused side's gemm follows torch's fp32 matmul precision (tf32 under "high"); gemv's fp32 is
    # IEEE fp32 always
    acc = K.get("gemm").accumulation(torch.float32) if m.dtype == torch.float32 else "ieee"
    cmp.check(l1, l2.double(), m.dtype, acc)
    cmp.check(k1, k2.double(), m.dtype, acc)
    cmp.check(v1, v2.double(), m.dtype, acc)
    assert GP.TritonOps.GEMV_MAX_M >= B


@pytest.mark.skipif(dev.interpreted(), reason="programmatic dependent launch needs a CUDA GPU (sm90+)")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_chained_launches_each_read_the_one_before(graph):
    """A chain of gemv launches where each reads the previous one's output (x, residual) and writes a buffer
    an earlier launch read: with programmatic dependent launch a launch starts early, so any read or write
    before its gdc_wait would show here as a wrong link in the chain."""
    torch.manual_seed(0)
    E, steps = 256, 24
    ws = [torch.randn(E, E, device="cuda") / E ** 0.5 for _ in range(steps)]
    ln = (torch.rand(E, device="cuda") + 0.5, torch.randn(E, device="cuda") * 0.1, 1e-5)
    x0 = torch.randn(1, E, device="cuda")
    bufs = [torch.empty(1, E, device="cuda") for _ in range(3)]
    configs = [{"BLOCK_M": 1, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 2, "num_stages": 2},
               {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 4, "num_warps": 4, "num_stages": 3}]

    def chain():
        x = x0
        for i, w in enumerate(ws):  # out cycles through 3 buffers: it overwrites what launch i-2 read
            out = bufs[i % 3]
            G.gemv(x, w, ln=ln if i % 2 else None, residual=x if i % 3 == 0 else None, out=out,
                   config=configs[i % 2])
            x = out
        return x

    want = x0.double()
    for i, w in enumerate(ws):
        h = G.ref.gemv(want, w, ln=ln if i % 2 else None)
        want = h + want if i % 3 == 0 else h
    chain()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = chain()
        for _ in range(3):
            bufs[0].fill_(float("nan")), bufs[1].fill_(float("nan")), bufs[2].fill_(float("nan"))
            g.replay()
    else:
        for b in bufs:
            b.fill_(float("nan"))
        got = chain()
    torch.cuda.synchronize()
    cmp.check(got, want, torch.float32, "ieee")


@pytest.mark.parametrize("config", [ONE_ROW, {**DOT, "SPLIT_K": 2}], ids=["one-row", "dot"])
def test_int64_offsets(monkeypatch, config):
    """The 64-bit offset path (taken for weights or workspaces of 2^31 elements or more), forced on a small
    problem by lowering the limit."""
    monkeypatch.setattr(G, "INT32_LIMIT", 1)
    m = 1 if config["BLOCK_M"] == 1 else 3
    for trans in (False, True):
        case = G.make_inputs(G.Problem(m, 37, 70, trans_w=trans, bias=True, residual=True, ln=True),
                             torch.float32, DEV, 7)
        cmp.poison(case.out)
        got = G.gemv(*case.args, out=case.out, config=config, **case.kwargs)
        cmp.check(got, G.ref.gemv(*case.args, **case.kwargs), torch.float32, "ieee")


# ---------------------------------------------------------------------------------------------------
# SwiGLU (activation="swiglu": w the [gate | up] weight) and the RMSNorm prologue (rms=)
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [None, ONE_ROW, {**ONE_ROW, "SPLIT_K": 1, "BLOCK_K": 32}, DOT, {**DOT, "SPLIT_K": 2}],
                         ids=["default", "one-row split-K", "one-row", "dot", "dot split-K"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_and_rms(config, dtype):
    m = 1 if config is not None and config["BLOCK_M"] == 1 else 5
    for p, layout in ((G.Problem(m, 2 * 37, 70, bias=True, act="swiglu", residual=True, rms=True), "contiguous"),
                      (G.Problem(m, 2 * 24, 33, trans_w=True, act="swiglu"), "sliced"),
                      (G.Problem(m, 30, 70, bias=True, act="gelu_tanh", rms=True), "sliced")):
        case = G.make_inputs(p, dtype, DEV, 4, layout)
        cmp.poison(case.out)
        y = G.gemv(*case.args, out=case.out, config=config, **case.kwargs)
        assert y.shape == (m, p.n_out)
        cmp.check(y, G.ref.gemv(*case.args, **case.kwargs), dtype, "ieee", what=f"{p} {config}")


def test_rms_without_weight_split_k_determinism_and_rows_independent_of_m():
    p = G.Problem(5, 2 * 35, 100, bias=True, act="swiglu", residual=True, rms=True)
    case = G.make_inputs(p, torch.float32, DEV, 3)
    x, w, bias = case.args
    config = {**DOT, "SPLIT_K": 4}
    for rms in ((None, 1e-6), (case.kwargs["rms"][0], 0.25)):
        kw = dict(case.kwargs, rms=rms)
        ys = [G.gemv(x, w, bias, config=config, **kw) for _ in range(3)]
        assert all(torch.equal(ys[0], y) for y in ys[1:])
        cmp.check(ys[0], G.ref.gemv(x, w, bias, **kw), torch.float32, "ieee")
    for buf in G._locks.buffers.values():
        assert int(buf.abs().sum()) == 0
    res = case.kwargs["residual"]
    for i in (0, 4):   # a row alone gives the same bits as in the batch
        one = G.gemv(x[i:i + 1].clone(), w, bias, activation="swiglu", residual=res[i:i + 1].clone(), rms=rms,
                     config=config)
        assert torch.equal(one[0], ys[0][i])


def test_swiglu_and_rms_buckets_space_and_defaults():
    assert G.bucket(G.Problem(1, 2304, 768, bias=True, ln=True)) == {"M": 1, "N": 2304, "K": 768, "ln": 1}
    assert G.bucket(G.Problem(1, 16384, 2048, act="swiglu", rms=True)) == {"M": 1, "N": 16384, "K": 2048, "ln": 0,
                                                                            "rms": 1, "swiglu": 1}
    for p in G.SPEC.standard_problems + G.SPEC.small_problems:
        for dt in DTYPES:
            assert G.SPACE.why_invalid(G.default_config(p, dt), p, dt) is None, (p, dt)
    sw = G.Problem(1, 16384, 2048, act="swiglu")
    for c in G.SPACE.points(sw, torch.bfloat16):   # both W tiles counted
        assert c["BLOCK_M"] > 1 or 2 * c["BLOCK_K"] * c["BLOCK_N"] <= 64 * 32 * c["num_warps"]
    assert "even N" in G.SPACE.why_invalid(G.default_config(G.Problem(1, 8, 8), torch.float32),
                                           G.Problem(1, 7, 8, act="swiglu"), torch.float32)


@pytest.mark.parametrize("rows", [1, 5, 12], ids=["gemv one row", "gemv rows", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_rms_linear_is_rms_norm_then_linear_then_swiglu(rows, dtype):
    """The Llama triton backend's fused RMSNorm + linear (+ SwiGLU), on gemv at <= GEMV_MAX_M rows and
    rms_norm + gemm above, gives what the steps one by one give; an ops wrapper that forwards what it lacks
    to its base (``__getattr__``) takes the steps through its own ``linear``."""
    from tritune.model.llama import model as LM

    ops = LM.TritonOps()
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 40, generator=g) * 2 + 0.5).to(DEV, dtype)
    nw = (1 + 0.2 * torch.randn(40, generator=g)).to(DEV, dtype)
    w_gu = (torch.randn(40, 2 * 24, generator=g) / 40 ** 0.5).to(DEV, dtype)
    b_gu = (0.5 * torch.randn(2 * 24, generator=g)).to(DEV, dtype)
    for w, b, act in ((w_gu, b_gu, "swiglu"), (w_gu, None, None)):
        y = LM.rms_linear(ops, x, nw, 1e-6, w, b, activation=act)
        h = LM.torch_rms_norm(x, nw, 1e-6)
        want = LM.swiglu(h.double() @ w.double() + (0 if b is None else b.double())) if act else h.double() @ w.double()
        # the fused prologue's normalised rows are the kernel's (fp32, one rounding) not transformers' (two)
        cmp.check(y, want, dtype, "ieee", what=f"rows={rows} {act}")

    class Forwarding:   # tensor parallel / fp8 ops: their own linear, the rest forwarded
        def __init__(self, base):
            self.base, self.calls = base, 0

        def __getattr__(self, name):
            return getattr(self.base, name)

        def linear(self, *args, **kwargs):
            self.calls += 1
            return self.base.linear(*args, **kwargs)

    fw = Forwarding(ops)
    torch.testing.assert_close(LM.rms_linear(fw, x, nw, 1e-6, w_gu, b_gu, activation="swiglu"),
                               LM.swiglu(ops.linear(ops.rms_norm(x, nw, 1e-6), w_gu, b_gu)))
    assert fw.calls == 1
