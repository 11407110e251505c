"""Attention-specific tests, on top of the generic property tests every spec gets (tests/test_kernels.py).

Odd lengths (1, 17, 1000 on a GPU), Tq != Tk with causal alignment (queries are the last Tq positions),
every head dim, GQA ratios down to MQA, packed batches with empty and length-1 sequences, rows that see
no key (causal with Tq > Tk, empty key sequences), the log-sum-exp, custom scales of either sign, strided
outputs, the config space's corners, and bad inputs. Outputs are poisoned with NaN first, so an unwritten
row fails; outputs go to the float64 reference under the dtype's tolerance, lse under float32's.
"""
from __future__ import annotations

import math

import pytest
import torch

from tritune import kernels as K
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels import attention as A
from tritune.kernels.attention import migrate as M
from tritune.references import attention as ref

DEV = dev.device()
GPU = not dev.interpreted()
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])
P = A.Problem
VP = A.VarlenProblem


def _id(x):
    return str(x).split(".")[-1] if isinstance(x, torch.dtype) else str(x)


def _check_lse(lse, want, what):
    """lse is float32 whatever the inputs: finite entries held to float32's tolerance, −inf exactly where
    the reference row saw no key."""
    want = want.to(lse.device)
    finite = torch.isfinite(want)
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    assert torch.equal(torch.isneginf(lse), ~finite), f"{what}: lse is −inf on other rows than the reference's"
    if finite.any():
        cmp.check(lse[finite], want[finite], torch.float32, "ieee", what=f"{what} lse")


def _fitted(problem, dtype, **over):
    """(the default config with ``over``, fewer stages where the space asks; why it is refused, or None)."""
    cfg = dict(A.default_config(problem, dtype), **over)
    why = A.SPACE.why_invalid(cfg, problem, dtype)
    while why and "num_stages" not in over and cfg["num_stages"] > 1:  # e.g. SCHEDULE='ahead''s deeper buffers
        cfg["num_stages"] -= 1
        why = A.SPACE.why_invalid(cfg, problem, dtype)
    return cfg, why


def _config(problem, dtype, **over):
    if not over:
        return None
    cfg, why = _fitted(problem, dtype, **over)
    if why:
        pytest.skip(f"config {cfg} not in the space for {problem}: {why}")
    return cfg


def _dense(problem: P, dtype, *, scale=None, layout="contiguous", seed=0, config=None, lse=True):
    """Run the kernel on make_inputs' case, check out and lse against the reference; return both."""
    case = A.make_inputs(problem, dtype, DEV, seed, layout)
    cmp.poison(case.out)
    what = f"{problem} {_id(dtype)} {layout} scale={scale} cfg={config}"
    got = A.attention(*case.args, out=case.out, scale=scale, return_lse=lse, config=config, **case.kwargs)
    want = ref.attention(*case.args, scale=scale, return_lse=True, **case.kwargs)
    out, lse_ = got if lse else (got, None)
    assert out is case.out
    cmp.check(out, want[0], dtype, A.SPEC.accumulation(dtype), what=what)
    if lse:
        assert lse_.shape == (problem.B, problem.Hq, problem.Tq) and lse_.dtype == torch.float32
        _check_lse(lse_, want[1], what)
    return case, out, lse_


def _varlen(problem: VP, dtype, *, scale=None, layout="contiguous", seed=0, config=None, lse=True):
    case = A.make_varlen_inputs(problem, dtype, DEV, seed, layout)
    cmp.poison(case.out)
    what = f"{problem} {_id(dtype)} {layout} scale={scale} cfg={config}"
    got = A.attention_varlen(*case.args, out=case.out, scale=scale, return_lse=lse, config=config, **case.kwargs)
    out, lse_ = got if lse else (got, None)
    want_out, want_lse = ref.attention_varlen(*case.args, scale=scale, return_lse=True, **case.kwargs)
    assert out is case.out
    cmp.check(out, want_out, dtype, A.SPEC.accumulation(dtype), what=what)
    if lse:
        assert lse_.shape == (sum(problem.seqlens_q), problem.Hq)
        _check_lse(lse_, want_lse, what)
    return case, out, lse_


def _naive(q, k, v, causal, scale):
    """Row by row from the definition (float64): query i of Tq sees key j of Tk when j <= i + Tk − Tq."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    B, Hq, Tq, D = q.shape
    g = Hq // k.shape[1]
    Tk = k.shape[2]
    out = torch.zeros(B, Hq, Tq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            for i in range(Tq):
                n = min(Tk, i + Tk - Tq + 1) if causal else Tk
                if n <= 0:
                    continue
                s = (k[b, h // g, :n] @ q[b, h, i]) * scale
                w = torch.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h // g, :n]
    return out


# ---------------------------------------------------------------------------------------------------
# Lengths
LENGTHS = [1, 17, 1000] if GPU else [1, 17, 67]


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_odd_lengths(T, causal, dtype):
    heads = (4, 2) if GPU else (2, 1)
    _dense(P(2 if GPU or T < 50 else 1, *heads, T, T, 64, causal), dtype, seed=T)


# (Tq, Tk): decode-like, Tq < Tk off and on block edges, Tq > Tk (rows that see no key), Tk = 0
TQ_TK = [(1, 37), (17, 64), (5, 33), (33, 16), (40, 7), (3, 0)] + ([(1000, 1537), (1537, 1000)] if GPU else [])


@pytest.mark.parametrize("tq,tk", TQ_TK, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_tq_ne_tk(tq, tk, causal, dtype):
    _, out, lse = _dense(P(2, 2, 1, tq, tk, 64, causal), dtype, seed=tq * 7 + tk)
    if causal and tq > tk:  # query i sees keys j <= i + tk − tq: the first tq − tk rows see none
        dead = slice(0, tq - tk)
        assert torch.all(out[:, :, dead] == 0), "rows that see no key must output 0"
        assert torch.all(torch.isneginf(lse[:, :, dead])), "rows that see no key must have lse = −inf"
        assert torch.isfinite(lse[:, :, tq - tk:]).all()


@pytest.mark.parametrize("tq,tk", [(5, 13), (13, 5), (9, 9)], ids=lambda x: str(x))
def test_causal_alignment_from_the_definition(tq, tk):
    """Kernel and reference both against a row-by-row loop: the queries are the last tq positions."""
    p = P(1, 2, 1, tq, tk, 32, True)
    case = A.make_inputs(p, torch.float32, DEV, 3)
    q, k, v = case.args
    want = _naive(q, k, v, True, 1 / math.sqrt(32))
    cmp.check(ref.attention(q, k, v, causal=True), want, torch.float64, what="reference vs definition")
    cmp.check(A.attention(q, k, v, causal=True), want, torch.float32, what="kernel vs definition")


def test_causal_tq_lt_tk_is_the_tail_of_the_square_problem():
    """Queries at the end of a prefix: the same rows of the square causal problem over all keys."""
    tk, tq = 45, 12
    p = P(1, 2, 2, tk, tk, 64, True)
    q, k, v = A.make_inputs(p, torch.float16, DEV, 11).args
    full = ref.attention(q, k, v, causal=True)
    tail = A.attention(q[:, :, tk - tq:], k, v, causal=True)
    cmp.check(tail, full[:, :, tk - tq:], torch.float16, what="tail rows")


# ---------------------------------------------------------------------------------------------------
# Head dims, layouts, GQA
@pytest.mark.pairwise
@pytest.mark.parametrize("D", A.HEAD_DIMS)
@pytest.mark.parametrize("layout", ["contiguous", "bthd", "sliced", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_every_head_dim_and_layout(D, layout, dtype):
    T = 200 if GPU else 24
    _dense(P(1, 2, 2, T, T + 5, D, True), dtype, layout=layout, seed=D)
    _dense(P(1, 2, 1, T - 3, T, D, False), dtype, layout=layout, seed=D + 1)


GQA = [(4, 4), (4, 2), (4, 1), (6, 3), (6, 1)] + ([(32, 8), (32, 1), (12, 4)] if GPU else [])


@pytest.mark.parametrize("hq,hkv", GQA, ids=lambda x: str(x))
@pytest.mark.parametrize("heads_inner", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_gqa_ratios(hq, hkv, heads_inner, dtype):
    T = 129 if GPU else 19
    p = P(2, hq, hkv, T, T, 64, True)
    _dense(p, dtype, seed=hq * 10 + hkv, config=_config(p, dtype, HEADS_INNER=heads_inner))


def test_gqa_matches_mha_with_repeated_heads():
    p = P(1, 4, 1, 21, 21, 32, True)
    q, k, v = A.make_inputs(p, torch.float16, DEV, 4).args
    mqa = A.attention(q, k, v, causal=True)
    mha = A.attention(q, k.expand(1, 4, 21, 32), v.expand(1, 4, 21, 32), causal=True)
    assert torch.equal(mqa, mha), "a kv head shared by 4 query heads is the same as 4 identical kv heads"


# ---------------------------------------------------------------------------------------------------
# Scale, lse, out
SCALES = [None, 0.5, 1 / 8, 4.0, 0.0, -0.3, -4.0]


@pytest.mark.parametrize("scale", SCALES, ids=_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_custom_scale(scale, causal):
    """Large |scale| makes the softmax nearly one-hot (and overflows a max taken on the wrong side);
    0 makes it uniform; a negative scale flips which key wins."""
    T = 300 if GPU else 40
    _dense(P(1, 2, 1, T, T, 64, causal), torch.float16, scale=scale, seed=5)
    _varlen(VP((9, 0, 33), (9, 4, 40), 2, 1, 64, causal), torch.float32, scale=scale, seed=6)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_lse_without_and_with(dtype):
    p = P(2, 2, 1, 31, 50, 80, True)
    case, out, lse = _dense(p, dtype, seed=8)
    alone = A.attention(*case.args, **case.kwargs)
    assert torch.equal(alone, out), "return_lse must not change the output"
    # lse is the log of the softmax denominator: exp(s − lse) sums to 1 over the visible keys
    q, k, _ = (t.double() for t in case.args)
    s = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, dim=1)) / math.sqrt(80)
    i = torch.arange(31, device=s.device)[:, None]
    j = torch.arange(50, device=s.device)[None, :]
    s = s.masked_fill(j > i + 19, float("-inf"))
    total = torch.exp(s - lse.double()[..., None]).sum(-1)
    torch.testing.assert_close(total, torch.ones_like(total), rtol=1e-5, atol=0)


def test_out_as_a_strided_view():
    """out may be a (B, T, H, D) buffer seen as (B, H, T, D): the rows land where the strides say."""
    p = P(2, 4, 2, 23, 23, 64, True)
    q, k, v = A.make_inputs(p, torch.float16, DEV, 9).args
    buf = torch.full((2, 23, 4, 64 + 8), float("nan"), dtype=torch.float16, device=DEV)
    view = buf[..., :64].transpose(1, 2)
    got = A.attention(q, k, v, causal=True, out=view)
    assert got is view
    cmp.check(got, ref.attention(q, k, v, causal=True), torch.float16, what="strided out")
    assert torch.isnan(buf[..., 64:]).all(), "wrote past D"


def test_empty_problems():
    q = torch.randn(2, 2, 0, 32, device=DEV)
    k = torch.randn(2, 1, 5, 32, device=DEV)
    out, lse = A.attention(q, k, k, return_lse=True)
    assert out.shape == (2, 2, 0, 32) and lse.shape == (2, 2, 0)
    out, lse = A.attention(torch.randn(0, 2, 4, 32, device=DEV), k[:0], k[:0], return_lse=True)
    assert out.shape == (0, 2, 4, 32)


def test_launch_plan_cache():
    """A second launch with the same metadata reuses the launch plan: the same result, a given out filled,
    lse on request; an argument the checks reject is rejected whatever was cached (scale=True hashes like
    scale=1); an explicit config or a reloaded tuned store is followed."""
    p = P(1, 2, 1, 33, 40, 64, True)
    case = A.make_inputs(p, torch.float32, DEV, 3)
    q, k, v = case.args
    want = ref.attention(q, k, v, causal=True, scale=1)
    first = A.attention(q, k, v, causal=True, scale=1)
    cmp.check(first, want, torch.float32, what="first launch")
    assert torch.equal(A.attention(q, k, v, causal=True, scale=1), first)
    out = torch.full_like(first, float("nan"))
    assert A.attention(q, k, v, causal=True, scale=1, out=out) is out and torch.equal(out, first)
    o, lse = A.attention(q, k, v, causal=True, scale=1, return_lse=True)
    assert torch.equal(o, first) and lse.shape == (1, 2, 33)
    with pytest.raises(ValueError, match=r"^scale:"):
        A.attention(q, k, v, causal=True, scale=True)
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        A.attention(q, k, v, causal=True, scale=1, out=out[..., :32])
    cfg = dict(A.default_config(p, torch.float32), BLOCK_M=16, BLOCK_N=16, num_warps=2)
    cmp.check(A.attention(q, k, v, causal=True, scale=1, config=cfg), want, torch.float32, what="explicit config")
    K.clear_config_cache()  # as a store reload does: the cached plan must pick the config again
    A.attention(q, k, v, causal=True, scale=1)
    lookup = A.SPEC.config_key(p, torch.float32)
    assert any(pl.cfg is K.CONFIG_CACHE[lookup] for pl in A._PLANS.values() if pl.cfg_key == lookup)


# ---------------------------------------------------------------------------------------------------
# Variable-length batches
VARLEN = [
    ((0, 1, 5, 0, 17), (0, 1, 5, 0, 17)),        # empty and length-1 sequences, square
    ((1, 1, 1), (7, 1, 30)),                     # decode-like rows after a prefix
    ((0, 9, 1), (3, 4, 0)),                      # Tq > Tk and an empty key sequence: rows that see no key
    ((40,), (40,)),                              # one sequence
    ((0, 0), (0, 0)),                            # nothing at all
    ((0, 0, 3), (2, 5, 0)),                      # keys but no queries, queries but no keys
] + ([((1000, 1, 0, 257, 513), (1000, 1, 0, 300, 513))] if GPU else [])


@pytest.mark.parametrize("lens", VARLEN, ids=lambda x: "-".join(map(str, x[0])) + "/" + "-".join(map(str, x[1])))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_varlen_batches(lens, causal, dtype):
    lq, lk = lens
    _varlen(VP(lq, lk, 4, 2, 64, causal), dtype, seed=sum(lq) + sum(lk))


def test_varlen_equals_dense_per_sequence():
    """Each packed sequence alone through the dense launcher: the same numbers (both from the kernel,
    with the same block boundaries relative to each sequence's start)."""
    p = VP((7, 0, 1, 20), (9, 3, 1, 20), 4, 1, 32, True)
    case = A.make_varlen_inputs(p, torch.float32, DEV, 12)
    q, k, v, cq, ck, mq, mk = case.args
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1, "HEADS_INNER": 0, "TMA": 0,
           "IMPL": "triton", "SCHEDULE": "pipelined", "PERSISTENT": 0, "LAZY_RESCALE": 0}
    out, lse = A.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True, config=cfg)
    cq, ck = cq.tolist(), ck.tolist()
    for b in range(p.B):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b] == cq[b + 1]:
            continue
        one = lambda t, s: t[s].transpose(0, 1)[None]  # noqa: E731  (T, H, D) -> (1, H, T, D)
        o, s_ = A.attention(one(q, qs), one(k, ks), one(v, ks), causal=True, return_lse=True,
                            config=cfg if ck[b] < ck[b + 1] else None)
        torch.testing.assert_close(out[qs], o[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[qs], s_[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


def test_varlen_max_seqlen_larger_than_needed():
    """max_seqlen only sizes the grid: a loose bound gives the same answer."""
    p = VP((5, 12), (6, 12), 2, 2, 32, True)
    case = A.make_varlen_inputs(p, torch.float16, DEV, 13)
    q, k, v, cq, ck, mq, mk = case.args
    want = ref.attention_varlen(q, k, v, cq, ck, causal=True)
    got = A.attention_varlen(q, k, v, cq, ck, 100, 200, causal=True)
    cmp.check(got, want, torch.float16, what="loose max_seqlen")


# ---------------------------------------------------------------------------------------------------
# The config space's corners: tiles smaller and larger than the diagonal, one key block, many
CORNERS = [(16, 16, 2, 1), (16, 64, 2, 2), (64, 16, 4, 2), (32, 32, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2)]


@pytest.mark.parametrize("bm,bn,warps,stages", CORNERS, ids=lambda x: str(x))
@pytest.mark.parametrize("tq,tk", [(70, 70), (37, 101), (101, 37)], ids=lambda x: str(x))
def test_config_corners_causal(bm, bn, warps, stages, tq, tk):
    if not GPU and bm * bn > 64 * 64:
        pytest.skip("large tiles are slow under the interpreter and add nothing the small ones test there")
    p = P(1, 2, 1, tq, tk, 64, True)
    dtype = torch.float16
    cfg = _config(p, dtype, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    _dense(p, dtype, seed=bm + bn, config=cfg)


# ---------------------------------------------------------------------------------------------------
# The Hopper path: TMA descriptors (per program, host-built), the key loop's schedules (warp-specialized,
# scores one block ahead), lazy rescaling; every valid combination of the three, dense and packed, on
# block edges and off, every head dim class (padded and not)
def _hopper_points():
    keys = ("TMA", "SCHEDULE", "LAZY_RESCALE")
    pts = [dict(zip(keys, (t, w, lz))) for t in (0, 1, 2) for w in A.SCHEDULES["triton"] for lz in (0, 1)
           if (t, w, lz) != (0, "pipelined", 0)   # the default, and combinations the space refuses
           and not (w == "warp_specialized" and t != 1)]
    return [pytest.param(p, id="-".join(f"{k.lower()}{v}" for k, v in p.items())) for p in pts]


def test_hopper_points_cover_the_space():
    """Every value of the three keys appears, and every omitted combination is one the space refuses."""
    p = P(2, 4, 2, 300, 517, 64, True)
    base = dict(A.default_config(p, torch.bfloat16), num_warps=8, BLOCK_M=128)
    listed = [tuple(x.values[0].values()) for x in _hopper_points()]
    for t in A.SPACE.params["TMA"]:
        for w in A.SPACE.params["SCHEDULE"]:
            for lz in A.SPACE.params["LAZY_RESCALE"]:
                if (t, w, lz) == (0, "pipelined", 0) or (t, w, lz) in listed:
                    continue
                cfg = dict(base, TMA=t, SCHEDULE=w, LAZY_RESCALE=lz)
                assert A.SPACE.why_invalid(cfg, p, torch.bfloat16), cfg


def _hopper_cases(hopper, D, causal):
    """(dtype, dense problem, packed problem, extra keys) of test_hopper_path_configs's point."""
    tq, tk = (300, 517) if GPU else (37, 53)
    small = {} if GPU else dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    vp = VP((tq // 3, 0, 1, tq), (tk // 3, 5, 1, tk), 4, 2, D, causal)
    return torch.bfloat16 if GPU else torch.float16, P(2, 4, 2, tq, tk, D, causal), vp, small


def _hopper_runs(hopper, D, causal):
    """Whether test_hopper_path_configs runs its point here (it skips a config the space refuses)."""
    dtype, p, vp, small = _hopper_cases(hopper, D, causal)
    return ((A.capability() >= (9, 0) or not hopper["TMA"]) and _fitted(p, dtype, **hopper, **small)[1] is None
            and _fitted(vp, dtype, **dict(hopper, TMA=min(hopper["TMA"], 1)), **small)[1] is None)


@pytest.mark.pairwise(runs=_hopper_runs)
@pytest.mark.parametrize("hopper", _hopper_points())
@pytest.mark.parametrize("D", [64, 80] if not GPU else [64, 80, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_path_configs(hopper, D, causal):
    if A.capability() < (9, 0) and hopper["TMA"]:
        pytest.skip("TMA needs sm90 or newer")
    dtype, p, vp, small = _hopper_cases(hopper, D, causal)
    _dense(p, dtype, seed=D, config=_config(p, dtype, **hopper, **small))
    _dense(p, dtype, seed=D + 1, layout="bthd", config=_config(p, dtype, **hopper, **small))
    # a packed batch has no host-built descriptors (TMA=2 is no point of its space; its launcher runs TMA=1)
    _varlen(vp, dtype, seed=D + 2, config=_config(vp, dtype, **dict(hopper, TMA=min(hopper["TMA"], 1)), **small))


def test_host_descriptors_on_a_packed_batch_run_the_per_program_ones():
    """An explicit TMA=2 config handed to attention_varlen (its dense Problem admits it) launches TMA=1."""
    vp = VP((7, 0, 19), (9, 3, 19), 4, 2, 64, True)
    cfg = dict(A.default_config(P(3, 4, 2, 19, 19, 64, True), torch.float16), TMA=2, BLOCK_M=16, BLOCK_N=16,
               num_warps=2, num_stages=1, SCHEDULE="pipelined")
    A._VARLEN_PLANS.clear()   # only this call's plans: a worker's earlier tests leave theirs (other TMA=2 configs)
    _varlen(vp, torch.float16, seed=5, config=cfg)
    plan = next(pl for pl in A._VARLEN_PLANS.values() if pl.cfg is not None and pl.cfg.get("TMA") == 2)
    assert plan.meta["TMA"] == 1
    assert A.SPACE.why_invalid(cfg, vp, torch.float16).startswith("TMA=2")


def test_host_descriptors_with_a_broadcast_head_run_the_per_program_ones():
    """k and v expanded over the heads (head stride 0): TMA=2's 4-D descriptors would carry that zero
    stride, so the launch takes TMA=1, whose per-(batch, head) descriptors never see it."""
    p = P(1, 4, 1, 24, 24, 32, True)
    q, k, v = A.make_inputs(p, torch.float16, DEV, 8).args
    ke, ve = k.expand(1, 4, 24, 32), v.expand(1, 4, 24, 32)
    cfg = _config(p, torch.float16, TMA=2, BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    got = A.attention(q, ke, ve, causal=True, config=cfg)
    cmp.check(got, ref.attention(q, ke, ve, causal=True), torch.float16, A.SPEC.accumulation(torch.float16),
              what="broadcast kv head, TMA=2")
    plan = next(pl for pl in A._PLANS.values() if pl.strides[4:8] == tuple(ke.stride()) and pl.cfg == cfg)
    assert plan.meta["TMA"] == 1


@pytest.mark.parametrize("tma", [0, 2])
@pytest.mark.parametrize("tk", [15, 16, 17, 32, 47, 80])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_scores_ahead_every_unmasked_block_count(tma, tk, causal):
    """SCHEDULE="ahead" (scores one block ahead): no unmasked block (the loop is skipped), exactly one (only
    the epilogue block), and several, with and without a masked key tail; queries shorter than the
    keys under causal alignment give tiles with different unmasked counts. fp32: exact enough to see
    a block folded twice or dropped."""
    p = P(1, 2, 1, min(tk, 20), tk, 32, causal)
    cfg = _config(p, torch.float32, BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1, SCHEDULE="ahead", TMA=tma)
    _dense(p, torch.float32, seed=tk, config=cfg)


@pytest.mark.parametrize("layout", ["sliced", "transposed", "offset"])
def test_tma_config_on_a_layout_tma_cannot_read_runs_the_pointer_path(layout):
    """TMA needs unit stride along D and 16-byte aligned rows and bases: a TMA config on any other
    layout (rows of odd length, D strided, a base one element off) still gives the right answer."""
    p = P(1, 2, 1, 29, 40, 64, True)
    dtype = torch.float16
    cfg = _config(p, dtype, TMA=1, BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    if layout != "offset":
        _dense(p, dtype, layout=layout, seed=21, config=cfg)
        return
    q, k, v = A.make_inputs(p, dtype, DEV, 21).args
    shifted = [_shifted(t) for t in (q, k, v)]
    got = A.attention(*shifted, causal=True, config=cfg)
    cmp.check(got, ref.attention(q, k, v, causal=True), dtype, A.SPEC.accumulation(dtype), what="offset base")


@pytest.mark.parametrize("lazy", [0, 1])
@pytest.mark.parametrize("scale", [None, 4.0, -4.0])
def test_lazy_rescale_with_growing_scores(lazy, scale):
    """Scores that climb along the keys (each key block's max above the last by far more than the
    2^8 the lazy rescale tolerates) and a peaked softmax: every block forces a rescale."""
    T = 260 if GPU else 48
    p = P(1, 2, 1, T, T, 64, False)
    case = A.make_inputs(p, torch.float16, DEV, 31)
    q, k, v = case.args
    # q rows share a direction u, key j lies ramp_j along it: score(i, j) ~ ramp_j·|u|² grows with j
    u = torch.ones(64, device=DEV)
    ramp = torch.linspace(0.0, 3.0, T, device=DEV)[None, None, :, None]
    q.copy_((q.float() * 0.3 + u).to(q.dtype))
    k.copy_((k.float() * 0.3 + ramp * u).to(k.dtype))
    small = {} if GPU else dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    cfg = _config(p, torch.float16, LAZY_RESCALE=lazy, **small)
    got, lse = A.attention(q, k, v, scale=scale, return_lse=True, config=cfg)
    want, want_lse = ref.attention(q, k, v, scale=scale, return_lse=True)
    cmp.check(got, want, torch.float16, A.SPEC.accumulation(torch.float16), what=f"lazy={lazy} scale={scale}")
    _check_lse(lse, want_lse, f"lazy={lazy} scale={scale}")


# ---------------------------------------------------------------------------------------------------
# IMPL="gluon": the Gluon FA3-structured kernel (kernels/attention/gluon.py), sm90 GPUs only
GLUON = GPU and A.G.AVAILABLE and A.capability()[0] == 9
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _g(values) -> list:
    """A Gluon-only test's parameter values: all of them where the Gluon kernel runs, else the first (the test
    skips anyway: one item says why, not hundreds)."""
    return list(values) if GLUON else list(values)[:1]
needs_gluon = pytest.mark.skipif(not GLUON, reason="the Gluon FA3 kernel runs on sm90 GPUs only")


def _gluon_cfg(p, dtype, schedule=2, persistent=False):
    cfg = A.gluon_config(p, dtype, schedule, persistent=persistent)
    why = A.SPACE.why_invalid(cfg, p, dtype)
    assert why is None, why
    return cfg


def _gluon_plan(cfg):
    return next(pl for pl in A._PLANS.values() if pl.cfg == cfg)


def test_gluon_points_are_refused_where_the_kernel_cannot_run():
    """On a GPU other than sm90 every IMPL="gluon" point is refused with the reason; the interpreter counts
    as a Hopper (stored sm90 entries stay valid) and runs such a point on the plain kernel, right. Everywhere
    only the canonical values of the keys the kernel does not read, fp16/bf16, and a dense causal call's
    Tq <= Tk (a packed batch's sequences may have more queries than keys: their rows see no key, output 0)."""
    p = P(2, 4, 2, 300, 517, 64, True) if GPU else P(1, 2, 1, 20, 37, 64, True)
    cfg = A.gluon_config(p, torch.float16, schedule=1, BLOCK_N=64)
    why = A.SPACE.why_invalid(cfg, p, torch.float16)
    if GPU and not GLUON:
        assert why and "sm90" in why
        with pytest.raises(ValueError, match="sm90"):
            A.attention(*A.make_inputs(p, torch.float16, DEV, 0).args, causal=True, config=cfg)
        return
    assert why is None
    if not GPU:
        _dense(p, torch.float16, seed=1, config=cfg, lse=False)
        assert all(pl.gluon is None for pl in A._PLANS.values())   # the plain kernel ran
    assert "fp16 and bf16" in A.SPACE.why_invalid(cfg, p, torch.float32)
    assert A.SPACE.why_invalid(cfg, VP((300, 7, 40), (517, 9, 0), 4, 2, 64, True), torch.float16) is None
    assert A.SPACE.why_invalid(cfg, A.PackedProblem(2, 4, 2, 517, 300, 64, True), torch.float16) is None
    assert "Tq <= Tk" in A.SPACE.why_invalid(cfg, P(2, 4, 2, 517, 300, 64, True), torch.float16)
    assert "65,535" in A.SPACE.why_invalid(cfg, P(4096, 32, 8, 300, 517, 64, True), torch.float16)
    assert "num_warps=4" in A.SPACE.why_invalid(dict(cfg, num_warps=8), p, torch.float16)
    assert "BLOCK_M 128" in A.SPACE.why_invalid(dict(cfg, BLOCK_M=64), p, torch.float16)
    assert "BLOCK_N 64" in A.SPACE.why_invalid(dict(cfg, BLOCK_N=128), P(1, 2, 2, 256, 256, 256, False),
                                               torch.float16)
    assert "shared memory" in A.SPACE.why_invalid(dict(cfg, BLOCK_N=128, num_stages=4), P(1, 2, 2, 256, 256, 128,
                                                                                           False), torch.float16)
    # the persistent form: dense calls only, its doubled Q buffers counted, schedules 1 and 2
    pers = A.gluon_config(p, torch.float16, schedule=1, BLOCK_N=64, persistent=True)
    assert (pers["IMPL"], pers["SCHEDULE"], pers["PERSISTENT"]) == ("gluon", "intra_wg", 1)
    assert A.SPACE.why_invalid(pers, p, torch.float16) is None
    assert "dense calls only" in A.SPACE.why_invalid(pers, VP((300, 7, 40), (517, 9, 0), 4, 2, 64, True),
                                                     torch.float16)
    assert "dense calls only" in A.SPACE.why_invalid(pers, A.PackedProblem(2, 4, 2, 517, 300, 64, True),
                                                     torch.float16)
    wide = P(1, 2, 2, 256, 256, 128, False)
    assert A.SPACE.why_invalid(dict(pers, PERSISTENT=0, BLOCK_N=128, num_stages=3), wide, torch.float16) is None
    assert "shared memory" in A.SPACE.why_invalid(dict(pers, BLOCK_N=128, num_stages=3), wide, torch.float16)
    with pytest.raises(ValueError, match="schedule"):
        A.gluon_config(p, torch.float16, schedule=0, persistent=True)


def test_three_warpgroup_points_of_the_space(monkeypatch):
    """BLOCK_M=192 is the Gluon kernel's CTA of three consumer warpgroups: refused to the plain kernel, and
    where its 160 registers a warpgroup spill (past D=64 with 128-key tiles, past D=128, the persistent
    ping-pong past D=64, schedule 0 with 128-key tiles); where admitted, the launch gets rows=192 and the
    grid counts 192-row tiles."""
    dt = torch.bfloat16
    p64, p128 = P(2, 4, 2, 300, 517, 64, True), P(2, 4, 2, 300, 517, 128, True)
    for (sch, pers), bn in ((("intra_wg", 0), 128), (("pingpong", 0), 128), (("intra_wg", 1), 128),
                            (("pingpong", 1), 128), (("ahead", 0), 64), (("pingpong", 0), 64), (("pingpong", 1), 64)):
        cfg = dict(A.gluon_config(p64, dt, BLOCK_M=192), SCHEDULE=sch, PERSISTENT=pers, BLOCK_N=bn)
        assert A.SPACE.why_invalid(cfg, p64, dt) is None, cfg
    for sch, pers in (("ahead", 0), ("intra_wg", 0), ("pingpong", 0), ("intra_wg", 1)):
        assert A.SPACE.why_invalid(dict(A.gluon_config(p128, dt, BLOCK_M=192, BLOCK_N=64), SCHEDULE=sch,
                                        PERSISTENT=pers), p128, dt) is None
    refused = [(p64, dict(SCHEDULE="ahead", BLOCK_N=128)), (p128, dict(SCHEDULE="pingpong", BLOCK_N=128)),
               (p128, dict(SCHEDULE="pingpong", PERSISTENT=1, BLOCK_N=64)),
               (P(1, 2, 2, 256, 256, 256, False), dict(SCHEDULE="pingpong", BLOCK_N=64))]
    for prob, keys in refused:
        cfg = dict(A.gluon_config(prob, dt, BLOCK_M=192), **keys)
        assert "BLOCK_M=192" in A.SPACE.why_invalid(cfg, prob, dt), (prob, keys)
    plain = dict(A.default_config(p64, dt), BLOCK_M=192)
    assert "Gluon kernel's" in A.SPACE.why_invalid(plain, p64, dt)
    seeds = A.gluon_seeds(p64, dt)
    assert any(c["BLOCK_M"] == 192 and A.SPACE.why_invalid(c, p64, dt) is None for c in seeds)

    calls = []

    def fake_launch(q, k, v, out, lse=None, cache=None, **kw):
        calls.append(kw)
        out.copy_(ref.attention(q, k, v, causal=kw["causal"]).to(out.dtype))

    monkeypatch.setattr(A.launch, "gluon_runs_here", lambda: True)
    monkeypatch.setattr(A.gluon_launch, "launch", fake_launch)
    A._PLANS.clear()
    try:
        small = P(1, 4, 2, 200, 260, 64, True)
        cfg = A.gluon_config(small, torch.float16, schedule=2, BLOCK_N=64, BLOCK_M=192)
        _dense(small, torch.float16, seed=2, config=cfg, lse=False)
        assert calls[-1]["rows"] == 192
        assert _gluon_plan(cfg).grid == (2, 4)   # 200 rows: two 192-row tiles, 1 x 4 batch-heads
    finally:
        A._PLANS.clear()
    with pytest.raises(ValueError, match="rows"):
        A.gluon_launch._nwg(256)


def test_which_calls_the_gluon_kernel_takes(monkeypatch):
    """The routing of an IMPL="gluon" config, on any machine (the Gluon launch replaced by a recorder that
    writes the reference): a plain dense call takes it with the schedule and tile of the config and the
    softmax scale in base 2, and so does a packed batch (with its longest query sequence, which sizes the
    grid), sequences with more queries than keys included; with an lse output the launch gets the lse
    tensor to write. A scale <= 0, a base one element off and a layout TMA cannot read run the plain kernel."""
    calls = []

    def fake_launch(q, k, v, out, lse=None, cache=None, **kw):
        calls.append(dict(kw, lse=lse is not None))
        want, want_lse = ref.attention(q, k, v, causal=kw["causal"], return_lse=True)
        out.copy_(want.to(out.dtype))
        if lse is not None:
            lse.copy_(want_lse)

    def fake_launch_varlen(q, k, v, out, cu_q, cu_k, max_q, lse=None, cache=None, **kw):
        calls.append(dict(kw, max_seqlen_q=max_q, lse=lse is not None))
        want, want_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=kw["causal"], return_lse=True)
        out.copy_(want.to(out.dtype))
        if lse is not None:
            lse.copy_(want_lse)

    p = P(1, 4, 2, 24, 40, 64, True)
    dtype = torch.float16
    cfg = A.gluon_config(p, dtype, schedule=2, BLOCK_N=64, num_stages=3)
    if A.SPACE.why_invalid(cfg, p, dtype):
        pytest.skip(f"no IMPL=gluon here: {A.SPACE.why_invalid(cfg, p, dtype)}")
    monkeypatch.setattr(A.launch, "gluon_runs_here", lambda: True)
    monkeypatch.setattr(A.gluon_launch, "launch", fake_launch)
    monkeypatch.setattr(A.gluon_launch, "launch_varlen", fake_launch_varlen)
    A._PLANS.clear()
    A._VARLEN_PLANS.clear()
    try:
        taken = dict(causal=True, qk_scale=pytest.approx(A.LOG2E / 8), BN=64, stages=3, schedule=2, rows=128,
                     persistent=False)
        _dense(p, dtype, seed=11, config=cfg, lse=False)
        _dense(p, dtype, seed=12, config=cfg, lse=True)
        assert calls == [dict(taken, lse=False), dict(taken, lse=True)]
        calls.clear()
        _dense(p, dtype, seed=13, config=cfg, scale=-0.3, lse=False)
        _dense(p, dtype, seed=13, config=cfg, scale=0.0, lse=False)
        _dense(p, dtype, seed=14, config=cfg, layout="transposed", lse=False)
        q, k, v = A.make_inputs(p, dtype, DEV, 15).args
        shifted = [_shifted(t) for t in (q, k, v)]
        cmp.check(A.attention(*shifted, causal=True, config=cfg), ref.attention(q, k, v, causal=True), dtype,
                  A.SPEC.accumulation(dtype), what="offset base")
        assert calls == []
        _varlen(VP((7, 24, 0), (9, 40, 5), 4, 2, 64, True), dtype, seed=16, config=cfg, lse=False)
        _varlen(VP((30, 5), (10, 12), 4, 2, 64, True), dtype, seed=18, config=cfg, lse=True)  # 30 queries, 10 keys
        packed = {k: v for k, v in taken.items() if k != "persistent"}   # no persistent packed kernel
        assert calls == [dict(packed, max_seqlen_q=24, lse=False), dict(packed, max_seqlen_q=30, lse=True)]
        calls.clear()
        case = A.make_varlen_inputs(VP((7, 24), (9, 40), 4, 2, 64, True), dtype, DEV, 20)
        q, k, v, *rest = case.args
        shifted = [_shifted(t) for t in (q, k, v)]
        cmp.check(A.attention_varlen(*shifted, *rest, causal=True, config=cfg),
                  ref.attention_varlen(q, k, v, *rest, causal=True), dtype, A.SPEC.accumulation(dtype),
                  what="varlen, offset base")
        assert calls == []
        # a config cached for its bucket from one problem, launched on another of the bucket that the Gluon
        # kernel does not take (causal with Tq > Tk: rows that see no key)
        wide = P(1, 4, 2, 60, 50, 64, True)
        assert A.SPEC.bucket(wide) == A.SPEC.bucket(P(1, 4, 2, 40, 60, 64, True))
        assert A.SPACE.why_invalid(cfg, P(1, 4, 2, 40, 60, 64, True), dtype) is None
        monkeypatch.setattr(A.SPEC, "config_for", lambda problem, dt, config=None: cfg if config is None else config)
        _dense(wide, dtype, seed=17, lse=False)
        assert calls == []
    finally:
        A._PLANS.clear()
        A._VARLEN_PLANS.clear()


def _every_head_dim_and_schedule(test):
    """The Gluon kernel's (schedule, head dim, causal, dtype) matrix, pairwise in the fast GPU suite."""
    marks = [pytest.mark.parametrize("dtype", _g([torch.bfloat16, torch.float16]), ids=_id),
             pytest.mark.parametrize("causal", _g(CAUSAL)), pytest.mark.parametrize("D", _g(A.HEAD_DIMS)),
             pytest.mark.parametrize("schedule", _g([0, 1, 2])), pytest.mark.pairwise, needs_gluon]
    for mark in marks:
        test = mark(test)
    return test


@_every_head_dim_and_schedule
def test_gluon_every_head_dim_schedule_and_layout(schedule, D, causal, dtype):
    """Every head dim and schedule, both dtypes: ragged lengths (4-D descriptors over the tensors'
    strides) with the lse output, (B, T, H, D) views, GQA, Tq < Tk causal, and FA3's flat case (2-D
    descriptors)."""
    p = P(2, 4, 2, 300, 517, D, causal)
    cfg = _gluon_cfg(p, dtype, schedule)
    _dense(p, dtype, seed=D + schedule, config=cfg, lse=True)
    assert _gluon_plan(cfg).gluon is not None
    _dense(p, dtype, seed=D + 7, layout="bthd", config=cfg, lse=False)
    flat = P(1, 3, 1, 256, 384, D, causal)
    _dense(flat, dtype, seed=D + 9, config=_gluon_cfg(flat, dtype, schedule), lse=False)


@_every_head_dim_and_schedule
def test_gluon_varlen_every_head_dim_and_schedule(schedule, D, causal, dtype):
    """Packed batches on the Gluon kernel (descriptors made on the device per sequence and head), both
    dtypes: ragged lengths across tile boundaries, an empty query sequence, an empty key sequence, more
    queries than keys (causal: rows that see no key output 0, lse -inf; a CTA none of whose rows sees
    one), the lse output, GQA, and views sliced from wider buffers."""
    vp = VP((300, 0, 129, 5, 77, 260), (517, 40, 0, 5, 30, 3), 4, 2, D, causal)
    cfg = _gluon_cfg(vp, dtype, schedule)
    _varlen(vp, dtype, seed=D + schedule, config=cfg, lse=True)
    assert next(pl for pl in A._VARLEN_PLANS.values() if pl.cfg == cfg).gluon is not None
    _varlen(vp, dtype, seed=D + 5, layout="sliced", config=cfg, lse=False)
    # q, k, v as views of one fused (total, Hq + 2 Hkv, D) projection: strided, and TMA-readable
    q, k, v, cq, ck, mq, mk = A.make_varlen_inputs(VP((300, 129, 5), (300, 129, 5), 4, 2, D, causal), dtype,
                                                   DEV, D + 6).args
    fused = torch.cat([q, k, v], dim=1)
    views = fused[:, :4], fused[:, 4:6], fused[:, 6:]
    got = cmp.poison(torch.empty_like(q))
    A.attention_varlen(*views, cq, ck, mq, mk, causal=causal, out=got, config=cfg)
    cmp.check(got, ref.attention_varlen(q, k, v, cq, ck, causal=causal), dtype, A.SPEC.accumulation(dtype),
              what=f"gluon varlen, fused qkv views, D={D}")


def _varlen_tile_case(D, st, bn, causal):
    vp = VP((1, 200, 64, 333), (40, 700, 64, 128), 2, 1, D, causal)
    return vp, A.gluon_config(vp, torch.bfloat16, schedule=2, BLOCK_N=bn, num_stages=st)


@needs_gluon
@pytest.mark.pairwise(runs=lambda **k: GLUON and not A.SPACE.why_invalid(*_varlen_tile_case(**k)[::-1],
                                                                         torch.bfloat16))
@pytest.mark.parametrize("D", _g([64, 128, 256]))
@pytest.mark.parametrize("st", _g(A.SPACE.params["num_stages"]))
@pytest.mark.parametrize("bn", _g(A.SPACE.params["BLOCK_N"]))
@pytest.mark.parametrize("causal", _g(CAUSAL))
def test_gluon_varlen_every_tile_and_stage_count(D, st, bn, causal):
    """Every (BLOCK_N, num_stages) the space admits on a packed batch, ping-pong schedule, causal and not.
    A test per point (one compiled variant), so that a parallel run spreads the compiles."""
    vp, cfg = _varlen_tile_case(D, st, bn, causal)
    if A.SPACE.why_invalid(cfg, vp, torch.bfloat16):
        pytest.skip(f"BLOCK_N={bn}, num_stages={st} is not a point of the Gluon space at D={D}")
    _varlen(vp, torch.bfloat16, seed=bn + st, config=cfg, lse=False)


@needs_gluon
def test_gluon_varlen_in_a_cuda_graph():
    """The packed kernel makes its descriptors from cu_seqlens at each launch: a captured launch replays
    on new lengths (same totals; one sequence now has more queries than keys) and new values; a
    max_seqlen_q above the longest only adds CTAs that exit."""
    dtype = torch.bfloat16
    vp = VP((200, 57, 0, 300), (256, 60, 9, 300), 4, 2, 128, True)
    cfg = _gluon_cfg(vp, dtype)
    q, k, v, cq, ck, mq, mk = A.make_varlen_inputs(vp, dtype, DEV, 21).args
    out = torch.empty_like(q)
    A.attention_varlen(q, k, v, cq, ck, mq + 100, mk, causal=True, out=out, config=cfg)
    acc = A.SPEC.accumulation(dtype)
    cmp.check(out, ref.attention_varlen(q, k, v, cq, ck, causal=True), dtype, acc, what="gluon varlen, eager")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.attention_varlen(q, k, v, cq, ck, mq + 100, mk, causal=True, out=out, config=cfg, validate=False)
    cq.copy_(A.cu_seqlens((100, 157, 0, 300), DEV))
    ck.copy_(A.cu_seqlens((56, 260, 9, 300), DEV))
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    cmp.poison(out)
    g.replay()
    cmp.check(out, ref.attention_varlen(q, k, v, cq, ck, causal=True), dtype, acc, what="gluon varlen in a CUDA graph")


def _tile_cases(D, st, bn, causal):
    """(key count, problem, config) of test_gluon_every_tile_and_stage_count's point that the space admits."""
    out = []
    for tk in ((128, 700) if causal else (40, 1000)):
        p = P(1, 2, 1, min(tk, 300), tk, D, causal)
        cfg = A.gluon_config(p, torch.bfloat16, schedule=2, BLOCK_N=bn, num_stages=st)
        if not A.SPACE.why_invalid(cfg, p, torch.bfloat16):
            out.append((tk, p, cfg))
    return out


@needs_gluon
@pytest.mark.pairwise(runs=lambda **k: GLUON and bool(_tile_cases(**k)))
@pytest.mark.parametrize("D", _g([32, 64, 80, 128, 256]))
@pytest.mark.parametrize("st", _g(A.SPACE.params["num_stages"]))
@pytest.mark.parametrize("bn", _g(A.SPACE.params["BLOCK_N"]))
@pytest.mark.parametrize("causal", _g(CAUSAL))
def test_gluon_every_tile_and_stage_count(D, st, bn, causal):
    """Every (BLOCK_N, num_stages) the space admits, with the ping-pong schedule, causal and not; key counts
    below, at and past a tile and the ring's depth. A test per point (one compiled variant), so that a
    parallel run spreads the compiles."""
    cases = _tile_cases(D, st, bn, causal)
    for tk, p, cfg in cases:
        _dense(p, torch.bfloat16, seed=bn + st + tk, config=cfg, lse=False)
    if not cases:
        pytest.skip(f"BLOCK_N={bn}, num_stages={st} is not a point of the Gluon space at D={D}")


@needs_gluon
def test_gluon_config_on_calls_it_does_not_take_runs_the_plain_kernel():
    """A negative scale, a base one element off, a layout TMA cannot read, no keys: the plain kernel with
    the default config, right answers (and an lse output, which the Gluon kernel writes)."""
    p = P(1, 4, 2, 200, 260, 64, True)
    dtype = torch.bfloat16
    cfg = _gluon_cfg(p, dtype)
    _dense(p, dtype, seed=3, config=cfg, lse=True)
    _dense(p, dtype, seed=4, config=cfg, scale=-0.2, lse=False)
    _dense(p, dtype, seed=5, config=cfg, layout="sliced", lse=False)
    q, k, v = A.make_inputs(p, dtype, DEV, 6).args
    shifted = [_shifted(t) for t in (q, k, v)]
    got = A.attention(*shifted, causal=True, config=cfg)
    cmp.check(got, ref.attention(q, k, v, causal=True), dtype, A.SPEC.accumulation(dtype), what="gluon, offset base")
    empty = P(1, 4, 2, 200, 0, 64, False)
    e_cfg = _gluon_cfg(P(1, 4, 2, 200, 128, 64, False), dtype)
    q, k, v = A.make_inputs(empty, dtype, DEV, 7).args
    assert torch.equal(A.attention(q, k, v, config=e_cfg), torch.zeros_like(q))


def _shifted(t):
    """t's values in a tensor of the same shape and strides whose base is one element past a 16-byte boundary."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)


@pytest.mark.skipif(not GPU, reason="direct launches are the CUDA launch path (the interpreter takes triton's own)")
@pytest.mark.parametrize("path", ["tma0", "tma1", "tma2", "gluon2", "gluon4", "gluon_persistent", "varlen",
                                  "varlen_gluon"])
def test_repeated_launches_read_each_calls_tensors(path):
    """After a plan's first launch through triton, later launches of the same metadata skip triton's binding
    (kernels.launch_cached) and copy their descriptors from the first's (kernels.DescriptorMaker): each launch
    must still read its own call's q, k, v (and cu_seqlens) and write its own out and lse. Then a base one
    element in (the same plan: shapes and strides alike, another alignment) takes triton's launch or the
    plain kernel, and a direct launch is taken again after it."""
    dtype = torch.bfloat16
    varlen = path.startswith("varlen")
    p = (VP((100, 7, 256), (130, 7, 300), 4, 2, 64, True) if varlen
         else P(2, 4, 2, 256, 256 if path != "gluon4" else 300, 64, True))
    if "gluon" in path:
        if not GLUON:
            pytest.skip("the Gluon FA3 kernel runs on sm90 GPUs only")
        cfg = _gluon_cfg(p, dtype, schedule=1, persistent=path.endswith("persistent"))
    else:
        tma = int(path[-1]) if not varlen else 1
        cfg = dict(A.default_config(p, dtype), TMA=tma, SCHEDULE="pipelined")
        if A.SPACE.why_invalid(cfg, p, dtype):
            pytest.skip(A.SPACE.why_invalid(cfg, p, dtype))
    A._PLANS.clear()
    A._VARLEN_PLANS.clear()
    run = _varlen if varlen else _dense
    for seed in range(3):
        run(p, dtype, seed=40 + seed, config=cfg, lse=True)
    plans = [pl for pl in (A._VARLEN_PLANS if varlen else A._PLANS).values() if pl.cfg == cfg]
    assert len(plans) == 1
    plan = plans[0]

    def compiled():
        if plan.gluon is not None:
            return sum(len(st[-1] or {}) for st in plan.gluon_cache.values())
        return len(plan.kernels or {})

    if K.DIRECT_LAUNCH:
        assert compiled() == 1, "the later launches did not run the kept compiled kernel"
    case = (A.make_varlen_inputs if varlen else A.make_inputs)(p, dtype, DEV, 50)
    args = list(case.args)
    for i in range(3):
        args[i] = _shifted(args[i])
    out = cmp.poison(_shifted(case.out))
    fn = A.attention_varlen if varlen else A.attention
    got, lse = fn(*args, out=out, return_lse=True, config=cfg, **case.kwargs)
    want, want_lse = (ref.attention_varlen if varlen else ref.attention)(*case.args, return_lse=True, **case.kwargs)
    cmp.check(got, want, dtype, A.SPEC.accumulation(dtype), what=f"{path}, bases one element in")
    _check_lse(lse, want_lse, f"{path}, bases one element in")
    run(p, dtype, seed=51, config=cfg, lse=True)


@needs_gluon
@pytest.mark.parametrize("persistent", [False, True], ids=["tiles", "persistent"])
def test_gluon_path_in_a_cuda_graph(persistent):
    """Host-built descriptors are launch parameters: a captured launch replays on new values."""
    p = P(2, 4, 2, 256, 256, 128, True)
    cfg = _gluon_cfg(p, torch.bfloat16, schedule=1 if persistent else 2, persistent=persistent)
    q, k, v = A.make_inputs(p, torch.bfloat16, DEV, 8).args
    out = torch.empty_like(q)
    A.attention(q, k, v, causal=True, out=out, config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        A.attention(q, k, v, causal=True, out=out, config=cfg)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    cmp.poison(out)
    g.replay()
    cmp.check(out, ref.attention(q, k, v, causal=True), torch.bfloat16, A.SPEC.accumulation(torch.bfloat16),
              what="gluon in a CUDA graph")


def test_varlen_checks_a_cu_seqlens_tensor_once(monkeypatch):
    """By default the values of a cu_seqlens tensor are read back once; launching with the same
    unmodified tensor again reads nothing (no host sync on the hot path); an in-place change, or
    validate=True, reads them again; validate=False never does."""
    p = VP((5, 12), (6, 12), 2, 2, 32, True)
    q, k, v, cq, ck, mq, mk = A.make_varlen_inputs(p, torch.float16, DEV, 13).args
    reads = []
    real = A.varlen._longest
    monkeypatch.setattr(A.varlen, "_longest", lambda name, cu, total: reads.append(name) or real(name, cu, total))
    assert A._longest_cached("cu_seqlens_q", cq, q.shape[0], False) == 12 and len(reads) == 1
    assert A._longest_cached("cu_seqlens_q", cq, q.shape[0], False) == 12 and len(reads) == 1
    cq[0] = 0  # an in-place write bumps the version counter: read again
    assert A._longest_cached("cu_seqlens_q", cq, q.shape[0], False) == 12 and len(reads) == 2
    assert A._longest_cached("cu_seqlens_q", cq, q.shape[0], True) == 12 and len(reads) == 3
    reads.clear()
    want = ref.attention_varlen(q, k, v, cq, ck, causal=True)
    got = A.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, validate=False)
    cmp.check(got, want, torch.float16, what="validate=False")
    assert reads == []
    # a cached tensor still has its bound checked against the new max_seqlen
    A._longest_cached("cu_seqlens_q", cq, q.shape[0], False)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: 11 is less than the longest query sequence 12"):
        A.attention_varlen(q, k, v, cq, ck, 11, mk, causal=True)


def test_varlen_bad_cu_seqlens_unchecked_stay_inside_the_tensors():
    """validate=False with cu_seqlens past the packed totals: rows may be wrong, but the kernel clamps
    every sequence to the tensors (no access outside them: on a GPU an out-of-bounds read would fault)."""
    p = VP((5, 7), (6, 7), 2, 1, 32, False)
    q, k, v, cq, ck, mq, mk = A.make_varlen_inputs(p, torch.float16, DEV, 17).args
    bad_q = torch.tensor([0, 5, 1000], dtype=torch.int32, device=DEV)
    bad_k = torch.tensor([-50, 6, 1 << 20], dtype=torch.int32, device=DEV)
    out = A.attention_varlen(q, k, v, bad_q, bad_k, 1000, 1 << 20, validate=False)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: last entry 1000"):
        A.attention_varlen(q, k, v, bad_q, bad_k, 1000, 1 << 20)


# ---------------------------------------------------------------------------------------------------
# Bad inputs: the errors name the argument and say what is wrong
def test_bad_inputs_have_clear_messages():
    q = torch.randn(1, 4, 8, 32, device=DEV)
    k = torch.randn(1, 2, 8, 32, device=DEV)
    with pytest.raises(ValueError, match=r"^k: head dim 64 does not match q's 32"):
        A.attention(q, torch.randn(1, 2, 8, 64, device=DEV), torch.randn(1, 2, 8, 64, device=DEV))
    with pytest.raises(ValueError, match=r"^q: 3 heads is not a multiple of k/v's 2 heads"):
        A.attention(torch.randn(1, 3, 8, 32, device=DEV), k, k)
    with pytest.raises(ValueError, match=r"^q: head dim 48 not supported"):
        A.attention(*(torch.randn(1, 2, 8, 48, device=DEV),) * 3)
    with pytest.raises(ValueError, match=r"^scale:"):
        A.attention(q, k, k, scale=float("inf"))
    with pytest.raises(ValueError, match=r"^scale:"):
        A.attention(q, k, k, scale=True)

    qp, kp = torch.randn(10, 4, 32, device=DEV), torch.randn(12, 2, 32, device=DEV)
    cu = lambda *x: torch.tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: decreases at entry 2 \(7 -> 5\)"):
        A.attention_varlen(qp, kp, kp, cu(0, 7, 5, 10), cu(0, 4, 6, 12), 7, 6)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: decreases"):
        A.attention_varlen(qp, kp, kp, cu(0, 4, 10), cu(0, 13, 12), 6, 13)
    with pytest.raises(ValueError, match=r"^k: head dim 64 does not match q's 32"):
        A.attention_varlen(qp, torch.randn(12, 2, 64, device=DEV), torch.randn(12, 2, 64, device=DEV),
                           cu(0, 4, 10), cu(0, 6, 12), 6, 6)
    with pytest.raises(ValueError, match=r"^q: 3 heads is not a multiple"):
        A.attention_varlen(torch.randn(10, 3, 32, device=DEV), kp, kp, cu(0, 4, 10), cu(0, 6, 12), 6, 6)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: 5 is less than the longest query sequence 6"):
        A.attention_varlen(qp, kp, kp, cu(0, 4, 10), cu(0, 6, 12), 5, 6)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q: dtype int64 not supported"):
        A.attention_varlen(qp, kp, kp, cu(0, 4, 10).long(), cu(0, 6, 12), 6, 6)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: last entry 9 does not match the 10 packed"):
        A.attention_varlen(qp, kp, kp, cu(0, 4, 9), cu(0, 6, 12), 6, 6)


def test_non_decreasing_cu_seqlens_are_accepted():
    """Repeated entries are empty sequences, not an error."""
    p = VP((4, 0, 0, 6), (6, 0, 2, 6), 4, 2, 32, False)
    _varlen(p, torch.float32, seed=14)


def test_varlen_vendor_is_torchs_varlen_attn_and_agrees_with_the_reference():
    """attention_varlen's vendor column is torch's own varlen_attn (FlashAttention's varlen kernel): on a GPU
    whose torch has it, it gives the reference's answer (causal aligned to the bottom right, GQA, an empty
    sequence, more keys than queries) within the dtype's tolerance, so the column times the same function;
    where it cannot run (the CPU, fp32, an older torch) it raises at set-up and the bench row says why."""
    for p, dtype in ((VP((5, 0, 17, 64), (9, 3, 17, 80), 4, 2, 64, True), torch.bfloat16),
                     (VP((33, 100), (33, 100), 2, 2, 128, False), torch.float16)):
        if not GPU:
            dtype = torch.float32
        case = A.make_varlen_inputs(p, dtype, DEV, 3)
        try:
            call = A.VARLEN_SPEC.vendor(case)
        except (ImportError, RuntimeError) as e:
            assert not GPU or "varlen" in str(e) or isinstance(e, ImportError), e
            continue
        assert call.label == "torch varlen_attn"
        cmp.check(call(), ref.attention_varlen(*case.args, **case.kwargs), dtype, A.SPEC.accumulation(dtype),
                  what=f"varlen_attn {p}")


def test_vendor_is_default_sdpa_named_by_the_backend_that_ran():
    """The vendor column is plain F.scaled_dot_product_attention (torch's own dispatch), labelled with
    the backend that really ran; forced backends are peers of their own."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    case = A.make_inputs(P(1, 4, 2, 16, 16, 32, True), torch.float32, DEV, 0)
    call = A.SPEC.vendor(case)
    assert call.label.startswith("sdpa (") and "unknown" not in call.label
    q, k, v = case.args

    def forced():
        with sdpa_kernel(SDPBackend.MATH):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    assert K.sdpa_backend(forced) == "math"
    assert {"sdpa_flash", "sdpa_efficient", "sdpa_cudnn"} <= set(A.SPEC.peers)


def _wg3_config(D, causal, ws):
    """The three-warpgroup config of WARP_SPEC ``ws`` at this head dim (key tile 128 up to D=64, else 64)."""
    _, schedule, persistent = M.WARP_SPEC[ws]
    bn = 128 if D <= 64 and ws != 3 else 64
    return A.gluon_config(P(2, 4, 2, 300, 517, D, causal), torch.bfloat16, schedule, BLOCK_N=bn, num_stages=3,
                          persistent=persistent, BLOCK_M=192)


@needs_gluon
@pytest.mark.pairwise(runs=lambda D, causal, ws: GLUON and not A.SPACE.why_invalid(
    _wg3_config(D, causal, ws), P(2, 4, 2, 300, 517, D, causal), torch.bfloat16))
@pytest.mark.parametrize("D", _g([d for d in A.HEAD_DIMS if d <= 128]))
@pytest.mark.parametrize("causal", _g(CAUSAL))
@pytest.mark.parametrize("ws", _g([5, 4, 3, 6, 7]))
def test_gluon_three_warpgroups_every_head_dim_schedule_and_form(D, causal, ws):
    """CTAs of three consumer warpgroups (BLOCK_M=192), every Gluon schedule and form at this head dim (the key tile the
    space admits: 128 up to D=64, 64 past it and for schedule 0). Each: ragged lengths (4-D descriptors, rows
    past Tq clipped mid-CTA) with the lse output; the persistent form over more items than SMs (the ring, the
    three-way ping-pong turn and the six Q buffers carried across items); the others FA3's flat case (2-D
    descriptors: Tq a multiple of 192) and a packed batch with empty sequences and more queries than keys.
    The ping-pong (SCHEDULE="pingpong") also in fp16, on (B, T, H, D) views with GQA. Ring depths: the FA3 grid's
    sweep checks each candidate against SDPA (benchmarks/bench_attention_fa3_grid.py --sweep wg3)."""
    p = P(2, 4, 2, 300, 517, D, causal)
    flat = P(1, 3, 1, 384, 512, D, causal)
    many = P(3, 16, 4, 700, 1000, D, causal)   # 3 x 16 x 4 = 192 items
    vp = VP((300, 0, 129, 5, 77, 260), (517, 40, 0, 5, 30, 3), 4, 2, D, causal)
    dt = torch.bfloat16
    persistent = M.WARP_SPEC[ws][2]
    cfg = _wg3_config(D, causal, ws)
    if A.SPACE.why_invalid(cfg, p, dt):
        assert D > 64 and ws == 7, A.SPACE.why_invalid(cfg, p, dt)
        pytest.skip("the persistent ping-pong has no three-warpgroup form past D=64")
    _dense(p, dt, seed=D + ws, config=cfg, lse=True)
    assert _gluon_plan(cfg).gluon["rows"] == 192
    if persistent:
        _dense(many, dt, seed=D + ws + 1, config=cfg, lse=True)
    else:
        _dense(flat, dt, seed=D + ws + 2, config=cfg, lse=False)
        _varlen(vp, dt, seed=D + ws + 3, config=cfg, lse=True)
    if ws == 5:
        _dense(p, torch.float16, seed=D + 9, layout="bthd", config=cfg, lse=False)


# ---------------------------------------------------------------------------------------------------
# The Gluon kernel's persistent form (PERSISTENT=1): one CTA per SM over (query tile, batch-head) items
def test_which_calls_the_persistent_gluon_kernel_takes(monkeypatch):
    """A PERSISTENT=1 config reaches the Gluon launch as its schedule (1, 2) with ``persistent``; a packed
    batch is refused it by the space (the persistent kernel has no packed form), naming the key."""
    calls = []

    def fake_launch(q, k, v, out, lse=None, cache=None, **kw):
        calls.append(kw)
        out.copy_(ref.attention(q, k, v, causal=kw["causal"]).to(out.dtype))

    p = P(1, 4, 2, 256, 300, 64, True)
    dtype = torch.float16
    monkeypatch.setattr(A.launch, "gluon_runs_here", lambda: True)
    monkeypatch.setattr(A.gluon_launch, "launch", fake_launch)
    A._PLANS.clear()
    try:
        for schedule in (1, 2):
            cfg = A.gluon_config(p, dtype, schedule=schedule, BLOCK_N=64, num_stages=4, persistent=True)
            assert A.SPACE.why_invalid(cfg, p, dtype) is None
            _dense(p, dtype, seed=schedule, config=cfg, lse=False)
            assert calls[-1]["persistent"] is True and calls[-1]["schedule"] == schedule
            assert calls[-1]["stages"] == 4 and calls[-1]["BN"] == 64
        vp = VP((7, 24), (9, 40), 4, 2, 64, True)
        with pytest.raises(ValueError, match="dense calls only"):
            A.attention_varlen(*A.make_varlen_inputs(vp, dtype, DEV, 3).args, causal=True, config=cfg)
    finally:
        A._PLANS.clear()


def _persistent_fits(schedule, D, causal, dtype):
    """Whether the persistent form's smallest ring fits in shared memory at this point (four Q buffers)."""
    p = P(2, 4, 2, 300, 517, D, causal)
    return "shared memory" not in (A.SPACE.why_invalid(A.gluon_config(p, dtype, schedule, persistent=True), p, dtype)
                                   or "")


@needs_gluon
@pytest.mark.pairwise(runs=lambda **k: GLUON and _persistent_fits(**k))
@pytest.mark.parametrize("schedule", _g([1, 2]))
@pytest.mark.parametrize("D", _g(A.HEAD_DIMS))
@pytest.mark.parametrize("causal", _g(CAUSAL))
@pytest.mark.parametrize("dtype", _g([torch.bfloat16, torch.float16]), ids=_id)
def test_gluon_persistent_every_head_dim_schedule_and_layout(schedule, D, causal, dtype):
    """Every head dim and both schedules, both dtypes: ragged lengths with the lse output, (B, T, H, D) views,
    GQA, Tq < Tk causal; and more work items than SMs, so each CTA runs several (the ring's slots and phases,
    the ping-pong turn and the doubled Q buffers carried from item to item)."""
    p = P(2, 4, 2, 300, 517, D, causal)
    if not _persistent_fits(schedule, D, causal, dtype):   # four Q buffers of D padded to 256
        assert D > 128
        pytest.skip("the persistent form's smallest ring does not fit in shared memory past D=128")
    cfg = _gluon_cfg(p, dtype, schedule, persistent=True)
    _dense(p, dtype, seed=D + schedule, config=cfg, lse=True)
    assert _gluon_plan(cfg).gluon["persistent"] is True
    _dense(p, dtype, seed=D + 7, layout="bthd", config=cfg, lse=False)
    many = P(3, 16, 4, 700, 1000, D, causal)   # 3 x 16 x 6 = 288 items
    _dense(many, dtype, seed=D + 9, config=_gluon_cfg(many, dtype, schedule, persistent=True), lse=True)


def _persistent_tile_cases(D, st, schedule):
    """(BLOCK_N, key count, problem, config) of test_gluon_persistent_every_tile_and_stage_count's point that the
    space admits."""
    out = []
    for bn in A.SPACE.params["BLOCK_N"]:
        for B, H, tk, causal in ((1, 2, 40, False), (1, 2, 128, True), (2, 8, 700, True), (40, 4, 300, False)):
            p = P(B, H, 1, min(tk, 300), tk, D, causal)
            cfg = A.gluon_config(p, torch.bfloat16, schedule=schedule, BLOCK_N=bn, num_stages=st,
                                 persistent=True)
            if not A.SPACE.why_invalid(cfg, p, torch.bfloat16):
                out.append((bn, tk, p, cfg))
    return out


@needs_gluon
@pytest.mark.pairwise(runs=lambda **k: GLUON and bool(_persistent_tile_cases(**k)))
@pytest.mark.parametrize("D", _g([32, 64, 80, 128, 256]))
@pytest.mark.parametrize("st", _g(A.SPACE.params["num_stages"]))
@pytest.mark.parametrize("schedule", _g([1, 2]))
def test_gluon_persistent_every_tile_and_stage_count(D, st, schedule):
    """Every (BLOCK_N, num_stages) the space admits for the persistent form, schedules 1 and 2, causal and not;
    key counts below, at and past a tile and the ring's depth, and more items than SMs. A test per point, so
    that a parallel run spreads the compiles."""
    cases = _persistent_tile_cases(D, st, schedule)
    for bn, tk, p, cfg in cases:
        _dense(p, torch.bfloat16, seed=bn + st + tk, config=cfg, lse=False)
    if not cases:
        pytest.skip(f"num_stages={st} is not a point of the persistent Gluon space at D={D}")


# ---------------------------------------------------------------------------------------------------
# The explicit keys (IMPL, SCHEDULE, PERSISTENT) and the one translation from the single WARP_SPEC key
def _old_point(ws: int, p, dtype) -> dict:
    """A config of the old space with WARP_SPEC=ws that the old constraint admitted for ``p``: the Triton
    schedules on 8-warp 128-row tiles (warp specialization with its per-program descriptors and lazy
    rescaling), the Gluon ones at the kernel's canonical keys (128-key tiles, 3 stages)."""
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "HEADS_INNER", "TMA")
    base = {k: v for k, v in A.default_config(p, dtype).items() if k in keys}
    if ws < 3:
        cfg = dict(base, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2, TMA=1 if ws == 1 else 2)
        return dict(cfg, WARP_SPEC=ws, LAZY_RESCALE=int(ws == 1))
    return dict(base, BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3, HEADS_INNER=0, TMA=2, WARP_SPEC=ws,
                LAZY_RESCALE=0)


@pytest.mark.parametrize("ws", range(8))
def test_every_warp_spec_translates_to_a_valid_point(ws):
    """Each old WARP_SPEC value names one (IMPL, SCHEDULE, PERSISTENT), put where WARP_SPEC stood, the rest
    of the config untouched; the translated point is valid where the old one was (dense, D=64, fp16)."""
    p = P(2, 4, 2, 512, 512, 64, True)
    old = _old_point(ws, p, torch.float16)
    new = M.translate(old)
    assert "WARP_SPEC" not in new and list(new)[list(old).index("WARP_SPEC"):][:3] == ["IMPL", "SCHEDULE", "PERSISTENT"]
    assert (new["IMPL"], new["SCHEDULE"], new["PERSISTENT"]) == M.WARP_SPEC[ws]
    assert {k: v for k, v in new.items() if k not in ("IMPL", "SCHEDULE", "PERSISTENT")} == \
        {k: v for k, v in old.items() if k != "WARP_SPEC"}
    assert A.SPACE.why_invalid(new, p, torch.float16) is None, new
    assert new["SCHEDULE"] in A.SCHEDULES[new["IMPL"]]
    if new["IMPL"] == "gluon":
        assert A.GLUON_SCHEDULES[new["SCHEDULE"]] == (ws - 3 if ws < 6 else ws - 5)


def test_the_translation_covers_the_space_once():
    """The eight old values reach eight distinct points, and every (IMPL, SCHEDULE, PERSISTENT) the space
    admits is one of them: nothing of the old space lost, nothing new."""
    assert len(set(M.WARP_SPEC.values())) == 8
    p = P(2, 4, 2, 512, 512, 64, True)
    admitted = set()
    for impl in A.SPACE.params["IMPL"]:
        for sch in A.SPACE.params["SCHEDULE"]:
            for pers in A.SPACE.params["PERSISTENT"]:
                ws = next((w for w, t in M.WARP_SPEC.items() if t == (impl, sch, pers)), None)
                cfg = dict(_old_point(ws if ws is not None else (0 if impl == "triton" else 4), p, torch.float16))
                cfg = dict(M.translate(cfg), IMPL=impl, SCHEDULE=sch, PERSISTENT=pers)
                if A.SPACE.why_invalid(cfg, p, torch.float16) is None:
                    admitted.add((impl, sch, pers))
    assert admitted == set(M.WARP_SPEC.values())
    with pytest.raises(ValueError, match="WARP_SPEC"):
        M.translate({"WARP_SPEC": 8})


def test_the_store_migration_is_idempotent(tmp_path):
    """A store file of old keys (every WARP_SPEC, config and default_config) is translated once; a second run
    changes nothing, byte for byte; a config already translated is returned as it is."""
    import json

    p = P(2, 4, 2, 512, 512, 64, True)
    entries = [{"bucket": f"b{ws}", "dtype": "float16", "config": _old_point(ws, p, torch.float16),
                "default_config": _old_point(0, p, torch.float16), "source": "old"} for ws in range(8)]
    path = tmp_path / "attention.json"
    path.write_text(json.dumps({"format": 1, "kernel": "attention", "entries": entries}, indent=1) + "\n")
    assert M.migrate_file(path, source="new") == 8
    once = path.read_text()
    assert "WARP_SPEC" not in once
    data = json.loads(once)
    assert [(e["config"]["IMPL"], e["config"]["SCHEDULE"], e["config"]["PERSISTENT"]) for e in data["entries"]] == \
        [M.WARP_SPEC[ws] for ws in range(8)]
    assert all(e["source"] == "new" for e in data["entries"])
    assert M.migrate_file(path, source="new") == 0 and path.read_text() == once
    for e in data["entries"]:
        assert M.translate(e["config"]) == e["config"]


def test_the_stored_entries_carry_the_explicit_keys():
    """The packaged store's attention entries were translated: no WARP_SPEC, each a valid point of the space
    for the problem it was tuned on (where the entry says which)."""
    from tritune.kernels.runtime import store

    for slug in store.slugs():
        for spec in (A.SPEC, A.VARLEN_SPEC):
            path = store.path_for(spec.name, slug, store.package_root())
            if not path.exists():
                continue
            for e in store.validate(__import__("json").loads(path.read_text()), spec.name, slug):
                for key in ("config", "default_config"):
                    assert "WARP_SPEC" not in e.get(key, {}), (path, e["bucket"])
                assert store.why_invalid(spec, e) is None, (path, e["bucket"], e["config"])


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 3), (4, 1)], ids=lambda x: str(x))
def test_gqa_each_kv_head_feeds_exactly_its_group(hq, hkv):
    """Query head h reads kv head h // (Hq / Hkv) and no other: a change to one kv head's K and V moves the
    outputs of its group's query heads, and leaves every other head's bit for bit; dense and packed."""
    g = hq // hkv
    p = P(1, hq, hkv, 19, 23, 32, True)
    q, k, v = A.make_inputs(p, torch.float32, DEV, 41).args
    base = A.attention(q, k, v, causal=True)
    vp = VP((19, 5), (23, 7), hq, hkv, 32, True)
    case = A.make_varlen_inputs(vp, torch.float32, DEV, 42)
    qp, kp, vp_, *rest = case.args
    base_p = A.attention_varlen(qp, kp, vp_, *rest, causal=True)
    for j in range(hkv):
        k2, v2 = k.clone(), v.clone()
        k2[:, j] += 1.0
        v2[:, j] -= 2.0
        out = A.attention(q, k2, v2, causal=True)
        kp2, vp2 = kp.clone(), vp_.clone()
        kp2[:, j] += 1.0
        vp2[:, j] -= 2.0
        out_p = A.attention_varlen(qp, kp2, vp2, *rest, causal=True)
        for h in range(hq):
            mine = h // g == j
            assert (not torch.equal(out[:, h], base[:, h])) == mine, (j, h)
            assert (not torch.equal(out_p[:, h], base_p[:, h])) == mine, (j, h)


# ---------------------------------------------------------------------------------------------------
# Sliding-window (local) attention: query i sees keys i + Tk - Tq - window < j <= i + Tk - Tq
@pytest.mark.parametrize("window", [1, 5, 16, 33, 200])
@pytest.mark.parametrize("tq,tk", [(37, 37), (20, 53), (53, 20)], ids=lambda x: str(x))
def test_window_dense(window, tq, tk):
    """Windows narrower than a key block, a block, several, and wider than the keys (plain causal), on the
    unmasked-block schedules ("ahead" takes the plain loop under a window) and lazy rescaling; with the lse."""
    p = P(2, 4, 2, tq, tk, 32, True)
    dtype = torch.float32
    case = A.make_inputs(p, dtype, DEV, window + tq)
    for over in ({}, dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1),
                 dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1, SCHEDULE="ahead", LAZY_RESCALE=1)):
        cfg = _config(p, dtype, **over)
        out, lse = A.attention(*case.args, causal=True, window=window, return_lse=True, config=cfg)
        want, want_lse = ref.attention(*case.args, causal=True, window=window, return_lse=True)
        cmp.check(out, want, dtype, A.SPEC.accumulation(dtype), what=f"window={window} cfg={cfg}")
        _check_lse(lse, want_lse, f"window={window}")
    if window >= tk:
        torch.testing.assert_close(out, A.attention(*case.args, causal=True, config=cfg), rtol=0, atol=0)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_window_varlen(window):
    vp = VP((19, 0, 1, 40), (23, 5, 1, 40), 4, 2, 32, True)
    case = A.make_varlen_inputs(vp, torch.float16, DEV, window)
    out = A.attention_varlen(*case.args, causal=True, window=window)
    cmp.check(out, ref.attention_varlen(*case.args, causal=True, window=window), torch.float16,
              A.SPEC.accumulation(torch.float16), what=f"varlen window={window}")


def test_window_skips_key_blocks_wholly_outside_it():
    """Keys in blocks before the first query's window (16-key blocks here) hold NaN: a window launch never
    reads them (a masked read would still give 0 · NaN = NaN through P·V), dense and packed, from the
    problems strategy's window field through make_inputs."""
    window, tq, tk = 20, 8, 100
    cfg_over = dict(BLOCK_M=16, BLOCK_N=16, num_warps=2, num_stages=1)
    skipped = (tk - tq - window + 1) // 16 * 16   # 64: keys [0, 64) are in no query's window's blocks
    p = P(2, 4, 2, tq, tk, 32, True, window)
    case = A.make_inputs(p, torch.float32, DEV, 3)
    assert case.kwargs == {"causal": True, "window": window}
    q, k, v = case.args
    want = ref.attention(q, k, v, **case.kwargs)
    k[:, :, :skipped], v[:, :, :skipped] = float("nan"), float("nan")
    out = A.attention(q, k, v, **case.kwargs, config=_config(p, torch.float32, **cfg_over))
    cmp.check(out, want, torch.float32, A.SPEC.accumulation(torch.float32), what="dense window skip")
    vp = VP((tq, 3), (tk, 40), 4, 2, 32, True, window)
    case = A.make_varlen_inputs(vp, torch.float32, DEV, 4)
    q, k, v, cu_q, cu_k, mq, mk = case.args
    want = ref.attention_varlen(*case.args, **case.kwargs)
    k[:skipped], v[:skipped] = float("nan"), float("nan")   # the first sequence's keys before its window
    vcfg = dict(A.VARLEN_SPEC.config_for(A.varlen_problem_of(*case.args, **case.kwargs), torch.float32), **cfg_over)
    out = A.attention_varlen(*case.args, **case.kwargs, config=vcfg)
    cmp.check(out, want, torch.float32, A.SPEC.accumulation(torch.float32), what="varlen window skip")


def test_window_is_checked():
    p = P(1, 2, 1, 8, 8, 32, True)
    q, k, v = A.make_inputs(p, torch.float32, DEV, 0).args
    for bad in (0, -3, 2.5, True, "4"):
        with pytest.raises(ValueError, match="window"):
            A.attention(q, k, v, causal=True, window=bad)
    with pytest.raises(ValueError, match="causal"):
        A.attention(q, k, v, window=4)


def test_the_package_registers_both_specs_from_a_fresh_process():
    """``kernels.get("attention_varlen")`` in a fresh interpreter: no module of that name, so the registry
    falls back to discovery, whose import of the package registers both specs."""
    import subprocess
    import sys

    code = ("import tritune.kernels as K; s = K.get('attention_varlen'); "
            "print(s.name, s.run.__module__, sorted(n for n in K.REGISTRY if n.startswith('attention')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["attention_varlen", "tritune.kernels.attention.varlen", "['attention',",
                                  "'attention_varlen']"]
