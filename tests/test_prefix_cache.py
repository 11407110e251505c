"""Prefix caching on a tiny random GPT-2 (CPU, fp32; the torch backend, and the triton kernels through the
interpreter): requests that share a prefix skip its prefill and still produce exactly the tokens they
produce alone; blocks never leak (finish, abort, a failed step); cached blocks are evicted under pressure;
two requests admitted in one step share the blocks the first one computes in that step."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import pytest
import torch

from tritune.model.engine.engine import Engine
from tritune.model.engine.kv_cache import BlockPool, BlockTable
from tritune.model.engine.scheduler import SamplingParams
from tests.test_engine import VOCAB, alone, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def shared_prompts(n, prefix_len, seed=0, lo=1, hi=12):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB - 1, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, VOCAB - 1, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                   generator=g).tolist() for _ in range(n)]


def run(eng, ps, max_new, stagger=True):
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    reqs = []
    for p in ps:
        reqs.append(eng.add_request(p, sp))
        if stagger:
            eng.step()
    eng.run()
    return reqs


def check_no_leak(eng):
    pool = eng.pool
    assert pool.num_free == pool.num_blocks and pool.num_used == 0
    assert all(r == 0 for r in pool._ref)


def test_pool_refcounts_hashes_and_lru_eviction():
    pool = BlockPool(1, 1, 1, 2, torch.float32, num_blocks=4, enable_caching=True, cache_salt="a")
    ids = [1, 2, 3, 4, 5]
    t = BlockTable(pool)
    t.ensure_capacity(5)
    t.cache_full(ids, 5)                       # 2 full blocks keyed, the partial third never
    assert len(t.hashes) == 2 and pool.num_cached == 2
    hashes = pool.hash_blocks(ids, 0, 2)
    assert pool.match(hashes) == t.blocks[:2]
    assert pool.match(pool.hash_blocks([1, 2, 9, 9], 0, 2)) == t.blocks[:1]     # the chain breaks at block 1
    other = BlockPool(1, 1, 1, 2, torch.float32, num_blocks=4, enable_caching=True, cache_salt="b")
    assert other.hash_blocks(ids, 0, 2) != hashes          # another model/dtype/quant: other keys
    u = BlockTable(pool)
    u.adopt(pool.match(hashes), hashes)        # shared: 2 references each
    assert pool._ref[t.blocks[0]] == 2 and pool.num_used == 3
    t.free()
    u.free()
    assert pool.num_free == 4 and pool.num_cached == 2     # free, and still cached
    fresh = pool.allocate(2)                   # never-cached blocks go first
    assert pool.num_cached == 2
    pool.allocate(1)                           # then the least recently freed cached block
    assert pool.num_cached == 1 and pool.stats["evicted"] == 1
    pool.free(fresh)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(fresh[:1])


def test_shared_prefix_outputs_equal_alone_and_with_cache_off(model):
    ps = shared_prompts(6, 21, seed=1)
    on = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False)
    off = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False, enable_prefix_caching=False)
    r_on, r_off = run(on, ps, 6), run(off, ps, 6)
    for p, a, b in zip(ps, r_on, r_off):
        want = alone(model, p, 6)
        assert a.output_ids == want and b.output_ids == want
    # every request after the first finds the 20 prefix tokens of its 5 full blocks
    assert [r.num_cached_tokens for r in r_on] == [0] + [20] * 5
    assert on.stats["prefill_tokens"] == off.stats["prefill_tokens"] - 5 * 20
    assert off.pool.num_cached == 0
    check_no_leak(on)
    check_no_leak(off)


def test_two_requests_sharing_a_prefix_admitted_in_one_step(model):
    ps = shared_prompts(2, 13, seed=2)
    eng = Engine(model, num_blocks=32, block_size=4, cuda_graphs=False)
    a, b = run(eng, ps, 5, stagger=False)
    assert eng.stats["steps"] == 5            # one step admitted both
    assert b.num_cached_tokens == 12           # b read the blocks a wrote in that same step
    assert a.output_ids == alone(model, ps[0], 5) and b.output_ids == alone(model, ps[1], 5)
    check_no_leak(eng)


def test_identical_prompts_and_a_prompt_that_is_all_prefix(model):
    """A prompt made only of full cached blocks still computes its last token (its logits are needed)."""
    p = shared_prompts(1, 16, seed=3, lo=0, hi=1)[0]
    assert len(p) == 16
    eng = Engine(model, num_blocks=32, block_size=4, cuda_graphs=False)
    reqs = run(eng, [p, p, p[:8]], 4)
    assert [r.num_cached_tokens for r in reqs] == [0, 12, 4]
    assert all(r.output_ids == alone(model, q, 4) for r, q in zip(reqs, [p, p, p[:8]]))
    check_no_leak(eng)


def test_eviction_under_memory_pressure_and_preemption(model):
    """A pool too small for the workload: cached blocks are evicted, sequences preempted and recomputed
    (finding their own blocks), outputs unchanged, and every block comes back."""
    ps = shared_prompts(8, 9, seed=4, lo=4, hi=20) + shared_prompts(6, 12, seed=5, lo=1, hi=10)
    eng = Engine(model, num_blocks=14, block_size=4, cuda_graphs=False, max_num_seqs=4)
    reqs = run(eng, ps, 12, stagger=False)
    assert eng.pool.stats["evicted"] > 0 and eng.stats["preemptions"] > 0
    for r, p in zip(reqs, ps):
        assert r.output_ids == alone(model, p, 12)
    check_no_leak(eng)


def test_abort_and_failed_step_return_every_block(model, monkeypatch):
    ps = shared_prompts(4, 12, seed=6)
    eng = Engine(model, num_blocks=32, block_size=4, cuda_graphs=False)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [eng.add_request(p, sp) for p in ps]
    eng.step()
    eng.abort(reqs[1].id)
    eng.step()
    cached = eng.pool.num_cached

    def boom(out):
        raise RuntimeError("device fell over")
    monkeypatch.setattr(eng.runner, "forward", boom)
    late = eng.add_request(ps[0][:14], sp)
    with pytest.raises(RuntimeError, match="fell over"):
        eng.step()
    monkeypatch.undo()
    assert all(r.finish_reason in ("abort", "error") for r in reqs + [late])
    # the failed step's blocks are no longer keyed: their K/V were never written
    assert eng.pool.num_cached <= cached
    check_no_leak(eng)
    r = eng.add_request(ps[2], sp)              # the engine goes on
    eng.run()
    assert r.output_ids == alone(model, ps[2], 8)
    check_no_leak(eng)


def test_triton_kernels_read_the_cached_prefix():
    """The varlen kernel (through the interpreter) attends from the suffix to the gathered cached prefix."""
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    ref = tiny_model("torch", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    ps = shared_prompts(2, 9, seed=7, lo=2, hi=6)
    eng = Engine(m, num_blocks=16, block_size=4, cuda_graphs=False)
    reqs = run(eng, ps, 3)
    assert reqs[1].num_cached_tokens == 8
    assert [r.output_ids for r in reqs] == [alone(ref, p, 3) for p in ps]
    check_no_leak(eng)


class Recorder:
    """The engine's sampler, keeping every logits row it is handed, per request."""

    def __init__(self, base):
        self.base, self.logits = base, {}

    def __call__(self, reqs, logits):
        for r, row in zip(reqs, logits):
            self.logits.setdefault(r.id, []).append(row.float().cpu().clone())
        return self.base(reqs, logits)

    def __getattr__(self, name):
        return getattr(self.base, name)


def hit_and_miss_logits(m, ps, max_new, **kw):
    """Logits rows of ps[1]: after ps[0] left its prefix in the cache (a hit), and in an engine without the
    cache; the hit's cached token count."""
    out = []
    for caching in (True, False):
        eng = Engine(m, num_blocks=32, block_size=4, cuda_graphs=False, batch_invariant=True,
                     enable_prefix_caching=caching, **kw)
        eng.sampler = Recorder(eng.sampler)
        reqs = run(eng, ps, max_new)
        out.append((eng.sampler.logits[reqs[1].id], reqs[1].num_cached_tokens, reqs[1].output_ids))
        check_no_leak(eng)
    return out


@pytest.mark.parametrize("dtype,quant", [(torch.bfloat16, None), (torch.bfloat16, "int4"), (torch.float32, None)])
def test_deterministic_mode_cache_hit_gives_the_uncached_bits(dtype, quant):
    """Engine(batch_invariant=True) (``--deterministic``): a request whose prefix comes from the cache gets
    the logits, bit for bit, it gets computing its whole prompt (every row's reductions are its own)."""
    m = tiny_model("torch", n_layer=2, n_embd=64, n_head=2, n_positions=64, seed=8, dtype=dtype)
    ps = shared_prompts(2, 13, seed=9, lo=3, hi=8)
    kw = dict(quant=quant, group_size=32) if quant else {}
    (hit, n_hit, t_hit), (miss, n_miss, t_miss) = hit_and_miss_logits(m, ps, 6, **kw)
    assert n_hit == 12 and n_miss == 0
    assert t_hit == t_miss and len(hit) == len(miss) == 6
    assert all(torch.equal(a, b) for a, b in zip(hit, miss))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run (fp32; its bf16 dot is wrong)")
def test_deterministic_mode_cache_hit_gives_the_uncached_bits_triton_interpreter():
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=32, seed=10)
    ps = shared_prompts(2, 9, seed=7, lo=2, hi=6)
    (hit, n_hit, t_hit), (miss, _, t_miss) = hit_and_miss_logits(m, ps, 3)
    assert n_hit == 8 and t_hit == t_miss
    assert all(torch.equal(a, b) for a, b in zip(hit, miss))
