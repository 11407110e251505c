"""Chunked prefill on a tiny random GPT-2 (CPU, fp32): long prompts computed a chunk per step beside the
running decodes give exactly the tokens of an unchunked run (greedy, and seeded sampling: a request draws
only once its last chunk is in), with and without the prefix cache; the kernels through the interpreter."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import pytest

from tritune.model.engine.engine import Engine
from tritune.model.engine.scheduler import SamplingParams
from tests.test_engine import alone, prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def arrivals(eng, ps, sps, gap=2):
    reqs = []
    for p, sp in zip(ps, sps):
        reqs.append(eng.add_request(p, sp))
        for _ in range(gap):
            if eng.has_unfinished():
                eng.step()
    eng.run()
    return reqs


@pytest.mark.parametrize("budget,caching", [(7, False), (16, True), (4, False)])
def test_chunked_equals_unchunked_greedy(model, budget, caching):
    ps = prompts(5, seed=21, lo=20, hi=50)
    sp = [SamplingParams(max_new_tokens=6, ignore_eos=True)] * len(ps)
    eng = Engine(model, num_blocks=96, block_size=4, cuda_graphs=False, enable_chunked_prefill=True,
                 max_batch_tokens=budget, enable_prefix_caching=caching)
    steps_with_both = 0
    orig = eng.runner.forward

    def spy(out):
        nonlocal steps_with_both
        steps_with_both += bool(out.decode) and any(not s for s in out.prefill_sample)
        assert out.num_tokens <= max(budget, len(out.decode))
        return orig(out)
    eng.runner.forward = spy
    reqs = arrivals(eng, ps, sp)
    assert steps_with_both > 0         # chunks ran in the same steps as decodes
    for r, p in zip(reqs, ps):
        assert r.output_ids == alone(model, p, 6)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_chunked_seeded_sampling_equals_unchunked(model):
    ps = prompts(4, seed=22, lo=15, hi=50)
    sps = [SamplingParams(max_new_tokens=5, temperature=0.9, top_k=20, seed=100 + i, ignore_eos=True)
           for i in range(len(ps))]
    outs = []
    for kw in ({}, {"enable_chunked_prefill": True, "max_batch_tokens": 8}):
        eng = Engine(model, num_blocks=96, block_size=4, cuda_graphs=False, enable_prefix_caching=False, **kw)
        outs.append([r.output_ids for r in arrivals(eng, ps, sps)])
    assert outs[0] == outs[1]


def test_budget_below_context_needs_chunking(model):
    with pytest.raises(ValueError, match="enable_chunked_prefill=True"):
        Engine(model, num_blocks=32, block_size=4, cuda_graphs=False, max_batch_tokens=16)


def test_triton_kernels_chunked_prefill():
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    ref = tiny_model("torch", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    ps = prompts(2, seed=23, lo=12, hi=20)
    eng = Engine(m, num_blocks=16, block_size=4, cuda_graphs=False, enable_chunked_prefill=True,
                 max_batch_tokens=5)
    reqs = arrivals(eng, ps, [SamplingParams(max_new_tokens=3, ignore_eos=True)] * 2, gap=1)
    assert [r.output_ids for r in reqs] == [alone(ref, p, 3) for p in ps]
    assert eng.pool.num_free == eng.pool.num_blocks
