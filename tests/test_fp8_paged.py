"""The FP8-cache decode's fp16 arithmetic (kernels/fp8_paged_attention.py) over scales and queries of wide range:
per-token k scales spread over 2^±40, v scales as wide as the output dtype holds, queries of 1e-25 and past fp16's
range (1e5), zero V rows. The weights of P·V stay in fp16's [0, 1] and the query enters fp16 scaled by a power of
two, so none of it over- or underflows.

The scores stay under 2^31 (base 2): past that no float32 online softmax keeps its top key. On a GPU the score's
scale multiply contracts into s - max(s) (one FMA), whose result for the top key is the rounding error of s, up to
half an ulp: 2^7 at 2^31, and 2^-128 underflows (the kernels/attention ones too; docs/findings.md)."""
import pytest
import torch

from tritune.kernels import fp8_paged_attention as PA
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev

DEV = dev.device()


@pytest.mark.parametrize("q_mag, k_spread", [(1e-25, 40), (1.0, 16), (1e5, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scales_and_queries_of_wide_range(q_mag, k_spread, dtype):
    if dtype == torch.float16 and q_mag != 1.0:
        q_mag = 1e-3 if q_mag < 1 else 3e3   # within fp16's range
    p = PA.Problem(2, 4, 2, 32, 70, 16, True)
    c = PA.SPEC.make_inputs(p, dtype, DEV, 3)
    q, k_cache, v_cache, k_scale, v_scale, tables, lens = c.args
    g = torch.Generator().manual_seed(7)
    spread = lambda e: torch.exp2(torch.randint(-e, e + 1, k_scale.shape, generator=g).float()).to(DEV)  # noqa: E731
    k_scale, v_scale = k_scale * spread(k_spread), v_scale * spread(40 if dtype == torch.bfloat16 else 8)
    v_scale[::3] = 0.0                                       # all-zero V rows weigh nothing
    q = (q.float() * q_mag).to(dtype)
    args = (q, k_cache, v_cache, k_scale, v_scale, tables, lens)
    want = PA.SPEC.reference(*args, **c.kwargs)
    for cfg in (None, {"BLOCK_N": 16, "PARTITION": 32, "num_warps": 1, "num_stages": 2}):
        cmp.check(PA.fp8_paged_attention(*args, **c.kwargs, config=cfg), want, dtype, what=f"q x {q_mag:g} {cfg}")


@pytest.mark.parametrize("partition", [32, 64, 128])
def test_split_kv_merges_in_the_kernel_and_resets_its_tickets(partition):
    """Split-KV: lengths of one chunk (finished by their first chunk), of several, and past the last chunk's
    start, in one batch; the program that takes a (sequence, kv head)'s last ticket merges. Launched twice with
    the same plan: the tickets are back at zero after each launch, so the second answer is the first."""
    p = PA.Problem(5, 8, 2, 64, 150, 16)   # every sequence's 150 tokens written: any shorter length reads them
    c = PA.SPEC.make_inputs(p, torch.bfloat16, DEV, 11)
    q, k_cache, v_cache, k_scale, v_scale, tables, _ = c.args
    lens = torch.tensor([1, partition, partition + 1, 150, min(2 * partition - 1, 150)], dtype=torch.int32, device=DEV)
    args = (q, k_cache, v_cache, k_scale, v_scale, tables, lens)
    want = PA.SPEC.reference(*args, **c.kwargs)
    cfg = {"BLOCK_N": 16, "PARTITION": partition, "num_warps": 1, "num_stages": 2}
    first = PA.fp8_paged_attention(*args, **c.kwargs, config=cfg)
    cmp.check(first, want, torch.bfloat16, what=f"PARTITION={partition}")
    out = torch.full_like(first, float("nan"))
    assert torch.equal(PA.fp8_paged_attention(*args, **c.kwargs, config=cfg, out=out), first)


def test_configs_stored_before_maxnreg_read_as_no_cap():
    """Entries tuned before the ``maxnreg`` key are points of the space with no register cap; every packaged
    entry stays valid for the problem it was tuned on."""
    import json

    from tritune.kernels.runtime import store

    p = PA.Problem(2, 4, 2, 32, 40)
    legacy = {"BLOCK_N": 16, "PARTITION": 0, "num_warps": 1, "num_stages": 2}
    assert PA.SPACE.why_invalid(legacy, p, torch.bfloat16) is None and PA.SPACE.full(legacy)["maxnreg"] == 0
    for path in store.package_root().glob("*/fp8_paged_attention.json"):
        for e in json.loads(path.read_text())["entries"]:
            assert PA.SPACE.why_malformed(e["config"]) is None, (path, e["config"])
            assert store.why_invalid(PA.SPEC, e) is None, (path, e["bucket"])
    c = PA.SPEC.make_inputs(p, torch.bfloat16, DEV, 2)
    capped = dict(legacy, maxnreg=128)   # a launch option (ignored by the interpreter): the same numbers
    cmp.check(PA.fp8_paged_attention(*c.args, **c.kwargs, config=capped), PA.SPEC.reference(*c.args, **c.kwargs),
              torch.bfloat16)
