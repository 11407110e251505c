"""FP8 attention and the FP8 paged KV cache beyond the contract (tests/test_kernels.py runs fp8_attention,
fp8_kv_write and fp8_paged_attention like every kernel): the reference reproduces the kernel's rounding of P
whatever BLOCK_N, the format's error against attention of the unquantized inputs stays bounded, the descale
forms agree, scores far from 0 neither overflow nor underflow, and the cache round trip (quantizing write,
then decode) stays close to bf16 attention over the unquantized K/V."""
import math

import pytest
import torch

from tritune.kernels import fp8_attention as A
from tritune.kernels import fp8_kv_write as W
from tritune.kernels import fp8_paged_attention as PA
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.references import attention as ref_attn
from tritune.references import fp8_attention as ref

DEV = dev.device()
BF16 = torch.bfloat16
# e4m3 rounds each of q, k, v and P within 2^-4 (about 2^-5 typical): a few percent of the output's norm
FORMAT_BOUND = 0.08


@pytest.mark.parametrize("block_n", [32, 64])
def test_p_rounding_does_not_depend_on_the_key_block(block_n):
    """The integer running max makes P's e4m3 rounding independent of how the max grew: with any BLOCK_N
    the kernel sits at bf16 output rounding from the reference, far under the format's error."""
    p = A.Problem(1, 2, 1, 50, 64, 64, False)
    c = A.SPEC.make_inputs(p, BF16, DEV, 3)
    got = A.fp8_attention(*c.args, config={"BLOCK_M": 16, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 2},
                          **c.kwargs)
    assert cmp.rel_error(got, A.SPEC.reference(*c.args, **c.kwargs)) < 4e-3


@pytest.mark.parametrize("p", [A.Problem(1, 4, 2, 48, 48, 128, True), A.Problem(2, 2, 2, 33, 40, 64, False),
                               A.Problem(1, 2, 1, 64, 64, 64, True)])
def test_error_against_unquantized_attention_is_the_formats(p):
    c = A.SPEC.make_inputs(p, BF16, DEV, 7)
    got = A.fp8_attention(*c.args, **c.kwargs)
    err = cmp.rel_error(got, A.unquantized_attention(p, DEV, 7))
    assert err < FORMAT_BOUND, f"fp8 attention off the unquantized one by {err:.3f}"


def test_descale_forms_agree():
    p = A.Problem(2, 4, 2, 20, 20, 64, True)
    q, k, v = (t.to(DEV) for t in A.unquantized(p, DEV, 1))
    (q8, _), (k8, kd), (v8, vd) = (ref.quantize_heads(t, 2) for t in (q, k, v))
    qd = (q.abs().amax(dim=(0, 2, 3)).reshape(2, 2).amax(dim=1) / 448).float()   # one per kv head
    q8 = (q / qd.repeat_interleave(2)[None, :, None, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    per_head = A.fp8_attention(q8, k8, v8, qd, kd, vd, causal=True)
    per_batch = A.fp8_attention(q8, k8, v8, qd[None].expand(2, 2).contiguous(), kd, vd, causal=True)
    assert torch.equal(per_head, per_batch)
    ones = A.fp8_attention(q8, k8, v8, causal=True)
    want = ref.fp8_attention(q8, k8, v8, None, None, None, causal=True)
    cmp.check(ones, want, BF16)


def test_large_scores_neither_overflow_nor_vanish():
    """Scores of hundreds in base 2: P stays in (0, 256], rows dominated by one key come out right."""
    p = A.Problem(1, 1, 1, 16, 40, 64, False)
    c = A.SPEC.make_inputs(p, BF16, DEV, 2)
    q8, k8, v8, qd, kd, vd = c.args
    got = A.fp8_attention(q8, k8, v8, qd * 40, kd * 40, vd, out_dtype=BF16)
    cmp.check(got, ref.fp8_attention(q8, k8, v8, qd * 40, kd * 40, vd), BF16)


def test_rows_that_see_no_key_are_zero():
    p = A.Problem(1, 2, 1, 30, 10, 64, True)   # causal, more queries than keys: the first 20 rows see nothing
    c = A.SPEC.make_inputs(p, BF16, DEV, 0)
    out = A.fp8_attention(*c.args, **c.kwargs)
    assert not out[:, :, :20].float().any() and out[:, :, 20:].float().abs().sum() > 0


def test_vendor_and_peer_columns():
    p = A.Problem(1, 2, 1, 24, 24, 64, True)
    c = A.SPEC.make_inputs(p, BF16, DEV, 4)
    sdpa = A.SPEC.vendor(c)()
    assert "dequantized" in A.SPEC.vendor_name
    # SDPA on the dequantized tensors keeps P unrounded: close to ours, not equal
    assert cmp.rel_error(A.fp8_attention(*c.args, **c.kwargs), sdpa.double()) < 0.05
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        assert A.SPEC.peers["fa3_fp8"](c) is None


# ---------------------------------------------------------------------------------------------------
def _pool(nb, bs, hkv, d):
    """K (nb, bs, hkv, d), V transposed within each block (nb, hkv, d, bs), and their scales."""
    return (torch.zeros(nb, bs, hkv, d, device=DEV).to(torch.float8_e4m3fn),
            torch.zeros(nb, hkv, d, bs, device=DEV).to(torch.float8_e4m3fn),
            torch.ones(nb, bs, hkv, device=DEV), torch.ones(nb, bs, hkv, device=DEV))


def test_write_skips_padding_and_leaves_other_slots_alone():
    g = torch.Generator().manual_seed(0)
    caches = _pool(4, 8, 2, 32)
    for t in caches[:2]:
        t.view(torch.uint8).copy_(torch.randint(0, 120, t.shape, generator=g, dtype=torch.uint8))
    before = [t.clone() for t in caches]
    k = (torch.randn(5, 2, 32, generator=g) * 3).to(BF16).to(DEV)
    v = torch.randn(5, 2, 32, generator=g).to(BF16).to(DEV)
    slots = torch.tensor([3, -1, 17, 31, -1], dtype=torch.int64, device=DEV)
    W.fp8_write_kv(k, v, slots, *caches)
    want = ref.fp8_write_kv(k, v, slots, *before)
    for got, w in zip(caches, want):
        cmp.check(got, w, BF16)
    untouched = torch.ones(32, dtype=torch.bool, device=DEV)
    untouched[[3, 17, 31]] = False
    for i, (got, old) in enumerate(zip(caches, before)):
        if got.dtype == torch.float8_e4m3fn:
            got, old = got.view(torch.uint8), old.view(torch.uint8)
        if i == 1:      # V: (blocks, Hkv, D, block_size), token-major again for the slot rows
            got, old = ref.v_rows(got), ref.v_rows(old)
        assert torch.equal(got.reshape(32, -1)[untouched], old.reshape(32, -1)[untouched])


def test_write_lays_v_out_transposed_within_each_block():
    """V's cache is (blocks, Hkv, D, block_size): slot s's quantized row of head h lies along D at
    v_cache[s // bs, h, :, s % bs], tokens contiguous; K's stays (blocks, block_size, Hkv, D). Read back
    through the reference's view of the layout, the cache gives exactly the quantized rows."""
    g = torch.Generator().manual_seed(5)
    nb, bs, hkv, d = 3, 8, 2, 16
    caches = _pool(nb, bs, hkv, d)
    k = (torch.randn(nb * bs, hkv, d, generator=g) * 2).to(BF16).to(DEV)
    v = torch.randn(nb * bs, hkv, d, generator=g).to(BF16).to(DEV)
    slots = torch.randperm(nb * bs, generator=g).to(DEV)
    W.fp8_write_kv(k, v, slots, *caches)
    k8, ks = ref.quantize_kv(k.float())
    v8, vs = ref.quantize_kv(v.float())
    k_cache, v_cache, k_scale, v_scale = caches
    assert v_cache.stride() == (hkv * d * bs, d * bs, bs, 1)
    s = slots.long()
    for t in (0, 5, nb * bs - 1):
        blk, off = int(s[t]) // bs, int(s[t]) % bs
        assert torch.equal(v_cache[blk, :, :, off].view(torch.uint8), v8[t].view(torch.uint8))
        assert torch.equal(k_cache[blk, off].view(torch.uint8), k8[t].view(torch.uint8))
    want_v = torch.empty_like(v8.view(torch.uint8))
    want_v[s] = v8.view(torch.uint8)
    assert torch.equal(ref.v_rows(v_cache).reshape(nb * bs, hkv, d).view(torch.uint8), want_v)
    assert torch.equal(v_scale.view(-1, hkv)[s], vs) and torch.equal(k_scale.view(-1, hkv)[s], ks)
    # one sequence over the blocks in slot order: the reference reads the rows the write quantized
    table = torch.arange(nb, dtype=torch.int32, device=DEV)
    order = torch.argsort(s)
    got = ref.gather(ref.v_rows(v_cache), table, nb * bs).view(torch.uint8)
    assert torch.equal(got, v8[order].view(torch.uint8))


@pytest.mark.parametrize("call", ["write", "decode"])
def test_v_cache_in_the_old_layout_is_refused_by_name(call):
    """A V cache in K's token-major layout (the layout before V was transposed), or transposed but without
    contiguous (D, block_size) slabs, is refused with a ValueError naming v_cache and the layout expected."""
    nb, bs, hkv, d = 4, 8, 2, 32
    k_cache, v_cache, k_scale, v_scale = _pool(nb, bs, hkv, d)
    x = torch.randn(3, hkv, d, device=DEV, dtype=BF16)
    slots = torch.tensor([0, 9, -1], device=DEV)
    q = torch.randn(2, 2 * hkv, d, device=DEV, dtype=BF16)
    tables = torch.arange(nb, dtype=torch.int32, device=DEV).reshape(2, 2)
    lens = torch.tensor([5, 16], dtype=torch.int32, device=DEV)

    def run(vc):
        if call == "write":
            return W.fp8_write_kv(x, x, slots, k_cache, vc, k_scale, v_scale)
        return PA.fp8_paged_attention(q, k_cache, vc, k_scale, v_scale, tables, lens)

    with pytest.raises(ValueError, match=r"v_cache: expected shape \(4, 2, 32, 8\) \(num_blocks, Hkv, D, "
                                         r"block_size\).*token-major"):
        run(torch.zeros_like(k_cache))
    with pytest.raises(ValueError, match=r"v_cache: each block's \(D, block_size\) slab must be contiguous"):
        run(torch.zeros(nb, bs, hkv, d, device=DEV).to(torch.float8_e4m3fn).permute(0, 2, 3, 1))
    run(v_cache)   # the layout it expects


@pytest.mark.parametrize("bs, block_n, ctx", [(4, 32, 70), (8, 16, 33), (32, 16, 50), (16, 64, 64),
                                              (16, 64, 127), (64, 32, 97)])
def test_decode_whole_tiles_and_tail_against_the_reference(bs, block_n, ctx):
    """Whole BLOCK_N tiles load unmasked and the rest goes through masked 16-token tiles: block sizes
    below, at and above BLOCK_N, contexts ending on and off tile boundaries (mixed lengths, NaN in every
    slot no sequence may read), split-KV and not, all at the float64 reference over the transposed V."""
    p = PA.Problem(3, 4, 2, 32, ctx, bs, True)
    c = PA.SPEC.make_inputs(p, BF16, DEV, 1)
    want = PA.SPEC.reference(*c.args, **c.kwargs)
    cap = p.capacity
    for part in (0, 2 * block_n):
        if part and part >= cap:
            continue
        cfg = {"BLOCK_N": block_n, "PARTITION": part, "num_warps": 2, "num_stages": 2}
        cmp.check(PA.fp8_paged_attention(*c.args, **c.kwargs, config=cfg), want, BF16)


@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
def test_cache_round_trip_against_unquantized_attention(qdtype):
    """bf16 K/V written through the quantizing write, then decoded (split-KV and not): close to float64
    attention over the unquantized K/V, and equal to the float64 reference over the cache."""
    B, Hq, Hkv, D, bs, ctx = 2, 4, 2, 64, 8, 45
    g = torch.Generator().manual_seed(1)
    nb = B * math.ceil(ctx / bs)
    k = torch.randn(B, ctx, Hkv, D, generator=g) * torch.exp(torch.randn(B, ctx, Hkv, 1, generator=g))
    v = torch.randn(B, ctx, Hkv, D, generator=g) + 0.25
    k, v = k.to(qdtype).to(DEV), v.to(qdtype).to(DEV)
    q = (torch.randn(B, Hq, D, generator=g) * 0.5).to(qdtype).to(DEV)
    tables = torch.randperm(nb, generator=g).reshape(B, -1).to(torch.int32).to(DEV)
    pos = torch.arange(ctx, device=tables.device)
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    caches = _pool(nb, bs, Hkv, D)
    W.fp8_write_kv(k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D), slots.to(DEV), *caches)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    exact = ref_attn.attention(q.double()[:, :, None], k.double().transpose(1, 2), v.double().transpose(1, 2))[:, :, 0]
    for cfg in (None, {"BLOCK_N": 16, "PARTITION": 32, "num_warps": 2, "num_stages": 1}):
        out = PA.fp8_paged_attention(q, *caches, tables, lens, config=cfg)
        cmp.check(out, ref.fp8_paged_attention(q, *caches, tables, lens), qdtype)
        err = cmp.rel_error(out, exact)
        assert err < FORMAT_BOUND, f"fp8 cache off bf16 attention by {err:.3f}"
