"""The paged KV cache and the continuous-batching scheduler, driven by a fake model (CPU, no kernels).

The fake model's next token is a hash of the whole sequence so far, so a request's output does not
depend on what else ran beside it, or on being preempted and recomputed: every request must end with
exactly the tokens it gets when run alone. It also keeps a fake KV cache (slot -> (position, every token
up to it): what a real K/V depends on) and, at each prefill chunk and decode, reads back every earlier
position through the block table, so a wrong slot, a block wrongly shared (prefix caching), a stale
block or a chunk that skipped a position shows up as a mismatch.
"""
import queue
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tritune.model.engine.kv_cache import BlockPool, BlockTable, OutOfBlocks, block_tables_tensor
from tritune.model.engine.scheduler import RUNNING, WAITING, SamplingParams, Scheduler

EOS = 0


def next_token(ids, vocab):
    return zlib.crc32(repr(list(ids)).encode()) % vocab


def run_alone(prompt, sampling, vocab, eos=EOS):
    ids, out = list(prompt), []
    while True:
        t = next_token(ids, vocab)
        ids.append(t)
        out.append(t)
        if (t == eos and not sampling.ignore_eos) or t in sampling.stop_token_ids:
            return out, "stop"
        if len(out) == sampling.max_new_tokens:
            return out, "length"


class FakeModel:
    def __init__(self, pool, vocab):
        self.pool, self.vocab = pool, vocab
        self.cache = {}                        # slot -> (request order, position, token)

    def _read_back(self, req, blocks, ctx):
        bs = self.pool.block_size
        for p in range(ctx):            # what attention would read
            slot = int(blocks[p // bs]) * bs + p % bs
            assert self.cache.get(slot) == (p, tuple(req.all_ids[:p + 1])), (req.id, p)

    def __call__(self, out):
        toks = []
        # every new K/V is written before any attention reads (as in each layer of the real forward)
        for req, ids, slots, start in zip(out.prefill, out.prefill_ids, out.prefill_slots, out.prefill_starts):
            assert len(ids) == len(slots) and ids == req.all_ids[start:start + len(ids)]
            assert start == req.num_computed and start + len(ids) <= req.num_tokens
            for p, s in enumerate(slots, start):
                self.cache[s] = (p, tuple(req.all_ids[:p + 1]))
        for i, req in enumerate(out.decode):
            self.cache[out.decode_slots[i]] = (out.decode_positions[i], tuple(req.all_ids))
        for req, ids, start, table, last in zip(out.prefill, out.prefill_ids, out.prefill_starts,
                                                out.prefill_tables, out.prefill_sample):
            assert table is req.table and last == (start + len(ids) == req.num_tokens)
            self._read_back(req, table.blocks, start + len(ids))
            if last:
                toks.append(next_token(req.all_ids, self.vocab))
        if out.decode:
            tables = block_tables_tensor(out.decode_tables, max_blocks=self.pool.num_blocks)
            for i, req in enumerate(out.decode):
                pos, ctx = out.decode_positions[i], out.context_lens[i]
                assert out.decode_ids[i] == req.all_ids[pos] and ctx == req.num_tokens
                self._read_back(req, tables[i], ctx)
                toks.append(next_token(req.all_ids, self.vocab))
        return toks


def make(num_blocks=64, block_size=4, n_positions=64, vocab=50, enable_prefix_caching=False, **kw):
    """The scheduler without the prefix cache unless asked (these tests count blocks and prefill tokens)."""
    pool = BlockPool(1, 1, 1, block_size, torch.float32, num_blocks=num_blocks)
    return pool, Scheduler(pool, n_positions, eos_token_id=EOS, vocab_size=vocab,
                           enable_prefix_caching=enable_prefix_caching, **kw), FakeModel(pool, vocab)


def check_invariants(sched):
    pool = sched.pool
    held = [b for r in sched.running for b in r.table.blocks]
    for r in sched.running:
        assert len(set(r.table.blocks)) == len(r.table.blocks)
    if not pool.enable_caching:
        assert len(held) == len(set(held)), "a block is shared by two running sequences"
    for b in set(held):
        assert pool._ref[b] == held.count(b), f"block {b}: {pool._ref[b]} references, {held.count(b)} holders"
    assert pool.num_free + len(set(held)) == pool.num_blocks, "blocks leaked"
    assert all(r.table is None and r.state == WAITING for r in sched.waiting)
    assert all(r.state == RUNNING and r.table.capacity >= r.num_computed for r in sched.running)
    assert [sched._key(r) for r in sched.running] == sorted(sched._key(r) for r in sched.running)
    assert [sched._key(r) for r in sched.waiting] == sorted(sched._key(r) for r in sched.waiting)
    assert len(sched.running) <= sched.max_num_seqs


def step(sched, model):
    out = sched.schedule()
    if out:
        sched.update(out, model(out))
    check_invariants(sched)
    return out


def run_all(sched, model, max_steps=10_000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched, model)
    raise AssertionError("did not finish")


def prompt(n, start=1):
    return [(start + i) % 49 + 1 for i in range(n)]   # no EOS in prompts


# ----------------------------------------------------------------------------------------------- pool
def test_pool_allocate_free_and_errors():
    pool = BlockPool(2, 3, 4, 4, torch.float32, num_blocks=5)
    assert pool.k_caches[1].shape == (5, 4, 3, 4) and len(pool.v_caches) == 2
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 2 and pool.peak_used == 3
    with pytest.raises(OutOfBlocks, match="asked for 3 blocks, 2 of 5 are free"):
        pool.allocate(3)
    pool.free(a[:1])
    with pytest.raises(ValueError, match="block 0 is not allocated"):
        pool.free([0])
    with pytest.raises(ValueError, match="block 1 is not allocated"):
        pool.free([1, 1])                   # twice in one call: nothing is freed
    with pytest.raises(ValueError, match="block id 7 is not in this pool"):
        pool.free([2, 7])
    assert pool.num_free == 3 and pool.peak_used == 3
    pool.free([1, 2])
    assert pool.num_free == 5


def test_pool_sizing():
    per = 2 * 3 * 4 * 2 * 8 * 2            # K and V, 3 layers, block 4, H 2, D 8, fp16
    pool = BlockPool(3, 2, 8, 4, torch.float16, memory=10 * per + per - 1)
    assert pool.bytes_per_block == per and pool.num_blocks == 10
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool(3, 2, 8, 4, torch.float16, memory=per - 1)
    with pytest.raises(ValueError, match="fraction of free GPU memory, but the device is cpu"):
        BlockPool(3, 2, 8, 4, torch.float16, memory=0.5)
    with pytest.raises(ValueError, match="exactly one of num_blocks or memory"):
        BlockPool(3, 2, 8, 4, torch.float16)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockPool(3, 2, 8, 0, torch.float16, num_blocks=4)


def test_block_table_grows_on_demand_and_tensor():
    pool = BlockPool(1, 1, 1, 4, torch.float32, num_blocks=8)
    t = BlockTable(pool)
    t.ensure_capacity(1)
    assert t.blocks == [0]
    t.ensure_capacity(4)
    assert t.blocks == [0]                  # still fits
    pool.allocate(1)                        # someone else takes block 1
    t.ensure_capacity(5)
    assert t.blocks == [0, 2] and t.slots(3, 6) == [3, 8, 9]
    with pytest.raises(IndexError, match="position 8 is outside"):
        t.slot(8)
    bt = block_tables_tensor([t, [5]], max_blocks=4, batch=3)
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, 2, 0, 0], [5, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="max_blocks=1 is less than the longest"):
        block_tables_tensor([t], max_blocks=1)
    t.free()
    assert t.blocks == [] and pool.num_free == 7


# ----------------------------------------------------------------------------------------------- admission
def test_admission_respects_max_num_seqs():
    pool, sched, model = make(max_num_seqs=2)
    reqs = [sched.add_request(prompt(3, i), SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(3)]
    out = step(sched, model)
    assert out.prefill == reqs[:2] and not out.decode and reqs[2].state == WAITING
    out = step(sched, model)
    assert out.decode == reqs[:2] and not out.prefill
    run_all(sched, model)
    assert all(len(r.output_ids) == 4 for r in reqs) and pool.num_free == pool.num_blocks


def test_admission_respects_token_budget_fifo():
    pool, sched, model = make(n_positions=16, max_num_batched_tokens=16)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    a, b, c = (sched.add_request(prompt(n), sp) for n in (10, 10, 6))
    out = step(sched, model)
    assert out.prefill == [a] and out.num_tokens == 10  # b does not fit in 6, and c may not skip ahead of b
    out = step(sched, model)
    assert out.decode == [a] and out.prefill == [b]      # 1 decode + 10 <= 16; c (6) does not fit in 5
    out = step(sched, model)
    assert out.decode == [a, b] and out.prefill == [c]


def test_admission_respects_free_blocks():
    pool, sched, model = make(num_blocks=4, block_size=4, n_positions=16)
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
    a = sched.add_request(prompt(8), sp)           # 2 blocks (3 by the end)
    b = sched.add_request(prompt(9), sp)           # 3 blocks
    out = step(sched, model)
    assert out.prefill == [a] and pool.num_free == 2 and b.state == WAITING
    run_all(sched, model)
    assert a.finish_reason == b.finish_reason == "length" and pool.num_free == 4 and pool.peak_used == 3


def test_dynamic_injection_joins_next_step_beside_decodes():
    pool, sched, model = make()
    a = sched.add_request(prompt(5), SamplingParams(max_new_tokens=10, ignore_eos=True))
    step(sched, model)
    step(sched, model)
    b = sched.add_request(prompt(7, 3), SamplingParams(max_new_tokens=10, ignore_eos=True))
    out = step(sched, model)
    assert out.decode == [a] and out.prefill == [b]   # prefill and decode in one step
    run_all(sched, model)
    for r in (a, b):
        assert (r.output_ids, r.finish_reason) == run_alone(r.prompt_ids, r.sampling, 50)


def test_finished_leave_at_once():
    pool, sched, model = make()
    a = sched.add_request(prompt(5), SamplingParams(max_new_tokens=1))
    b = sched.add_request(prompt(6), SamplingParams(max_new_tokens=5, ignore_eos=True))
    out = sched.schedule()
    done = sched.update(out, model(out))
    assert done == [a] and a.finished and a.finish_reason == "length" and a.table is None
    assert pool.num_free == pool.num_blocks - 2    # b's two blocks only
    assert sched.schedule().decode == [b]


def test_stop_tokens_eos_and_ignore_eos():
    vocab = 50
    p = prompt(4)
    seq, _ = run_alone(p, SamplingParams(max_new_tokens=20, ignore_eos=True), vocab)
    stop_tok = seq[5]
    pool, sched, model = make(vocab=vocab)
    a = sched.add_request(p, SamplingParams(max_new_tokens=20, stop_token_ids=(stop_tok,), ignore_eos=True))
    sched2 = Scheduler(pool, 64, eos_token_id=stop_tok, vocab_size=vocab)
    b = sched2.add_request(p, SamplingParams(max_new_tokens=20))
    c = sched2.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True))
    run_all(sched, model)
    run_all(sched2, model)
    assert a.output_ids == b.output_ids == seq[:seq.index(stop_tok) + 1]
    assert a.finish_reason == b.finish_reason == "stop"
    assert c.output_ids == seq and c.finish_reason == "length"
    assert pool.num_free == pool.num_blocks


# ----------------------------------------------------------------------------------------------- preemption
def test_preemption_picks_newest_and_it_resumes():
    # 6 blocks of 2 tokens; three requests of 3-token prompts growing to 10 tokens cannot all fit.
    pool, sched, model = make(num_blocks=6, block_size=2, n_positions=16)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [sched.add_request(prompt(3, 5 * i), sp) for i in range(3)]
    preempted = []
    while sched.has_unfinished():
        out = step(sched, model)
        for v in out.preempted:
            running_orders = [r.order for r in sched.running]
            assert all(v.order > o for o in running_orders)   # nothing newer is left running
            assert v.output_ids and v.table is None and v.state == WAITING
            assert sched.waiting[0] is v or sched.waiting[0].order < v.order
        preempted += out.preempted
    assert preempted and reqs[0] not in preempted      # the oldest always advances
    assert sched.num_preemptions == len(preempted) == sum(r.num_preemptions for r in reqs)
    for r in reqs:
        assert (r.output_ids, r.finish_reason) == run_alone(r.prompt_ids, sp, 50)
    assert pool.num_free == pool.num_blocks and pool.peak_used == 6


def test_preempted_request_recomputes_prompt_plus_generated():
    pool, sched, model = make(num_blocks=4, block_size=2, n_positions=16)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    a = sched.add_request(prompt(3), sp)
    b = sched.add_request(prompt(3, 9), sp)
    while not b.num_preemptions:
        step(sched, model)
    generated = list(b.output_ids)
    assert generated and sched.waiting[0] is b
    while True:
        out = step(sched, model)
        if b in out.prefill:
            i = out.prefill.index(b)
            assert out.prefill_ids[i][:len(b.prompt_ids) + len(generated)] == b.prompt_ids + generated
            break
    run_all(sched, model)
    assert b.output_ids[:len(generated)] == generated and len(b.output_ids) == 6


# ----------------------------------------------------------------------------------------------- bad requests
def test_bad_requests_raise_and_others_continue():
    pool, sched, model = make(num_blocks=7, block_size=4, n_positions=32)
    good = [sched.add_request(prompt(4, i), SamplingParams(max_new_tokens=6, ignore_eos=True)) for i in range(2)]
    step(sched, model)
    bad = [
        (ValueError, "already in use", lambda: sched.add_request([1], SamplingParams(), request_id=good[0].id)),
        (ValueError, "prompt is empty", lambda: sched.add_request([], SamplingParams())),
        (ValueError, "longer than the model.s context", lambda: sched.add_request(prompt(33), SamplingParams())),
        (ValueError, "max_new_tokens: expected an int >= 1", lambda: SamplingParams(max_new_tokens=0)),
        (ValueError, "exceeds the model.s context", lambda: sched.add_request(prompt(30), SamplingParams(max_new_tokens=3))),
        (ValueError, "more than the whole pool", lambda: sched.add_request(prompt(30), SamplingParams(max_new_tokens=2))),
        (ValueError, "no room for the prompt", lambda: sched.add_request(prompt(3), SamplingParams(max_new_tokens=32),
                                                                         truncate=True)),
        (ValueError, "outside the vocabulary", lambda: sched.add_request([1, 50], SamplingParams())),
        (TypeError, "not text", lambda: sched.add_request("hello", SamplingParams())),
        (TypeError, "must be ints", lambda: sched.add_request([1, 2.5], SamplingParams())),
        (TypeError, "must be ints", lambda: sched.add_request([1, True], SamplingParams())),
        (ValueError, "token id -1 .*outside the vocabulary", lambda: sched.add_request([3, -1, 2], SamplingParams())),
        (TypeError, "stream must be", lambda: sched.add_request([1], SamplingParams(), stream="stdout")),
        (ValueError, "top_p: expected a number in", lambda: SamplingParams(top_p=0)),
        (ValueError, "temperature: expected a finite number >= 0", lambda: SamplingParams(temperature=-1.0)),
    ]
    for exc, msg, call in bad:
        with pytest.raises(exc, match=msg):
            call()
        step(sched, model)
    run_all(sched, model)
    for r in good:
        assert (r.output_ids, r.finish_reason) == run_alone(r.prompt_ids, r.sampling, 50)
    assert pool.num_free == pool.num_blocks


def test_truncate_keeps_the_end_of_the_prompt():
    pool, sched, model = make(num_blocks=16, block_size=4, n_positions=32)
    p = prompt(40)
    r = sched.add_request(torch.tensor(p), SamplingParams(max_new_tokens=5), truncate=True)
    assert r.prompt_ids == p[-27:] and r.truncated == 13 and all(type(t) is int for t in r.prompt_ids)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16 is less than the context"):
        Scheduler(pool, 32, max_num_batched_tokens=16)


# ----------------------------------------------------------------------------------------------- streams, abort
def test_streams_abort_and_failing_consumer():
    pool, sched, model = make()
    q = queue.Queue()
    seen = []
    a = sched.add_request(prompt(3), SamplingParams(max_new_tokens=4, ignore_eos=True), stream=q)
    b = sched.add_request(prompt(4), SamplingParams(max_new_tokens=4, ignore_eos=True),
                          stream=lambda req, tok: seen.append(tok))

    def broken(req, tok):
        if len(req.output_ids) == 2:
            raise RuntimeError("consumer went away")
    c = sched.add_request(prompt(5), SamplingParams(max_new_tokens=4, ignore_eos=True), stream=broken)
    d = sched.add_request(prompt(6), SamplingParams(max_new_tokens=9, ignore_eos=True))
    step(sched, model)
    step(sched, model)
    assert c.finish_reason == "error" and isinstance(c.error, RuntimeError) and c.table is None
    sched.abort(d.id)
    assert d.finish_reason == "abort" and d.table is None
    with pytest.raises(KeyError):
        sched.abort(d.id)
    run_all(sched, model)
    assert [q.get_nowait() for _ in range(5)] == a.output_ids + [None]
    assert seen == b.output_ids + [None]
    assert pool.num_free == pool.num_blocks


def test_schedule_twice_without_update_is_an_error():
    pool, sched, model = make()
    sched.add_request(prompt(3))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match="got 2 tokens for 1 scheduled"):
        sched.update(out, [1, 2])
    sched.update(out, model(out))
    run_all(sched, model)


# ----------------------------------------------------------------------------------------------- randomized
requests_st = st.lists(
    st.tuples(st.integers(0, 12),               # arrival step
              st.integers(1, 20),               # prompt length (some too long for the pool or context)
              st.integers(1, 20),               # max_new_tokens
              st.booleans(),                    # ignore_eos
              st.integers(0, 150)),             # abort this many steps after arrival (>= 30: never)
    min_size=8, max_size=40)


@settings(max_examples=150, deadline=None)
@given(reqs=requests_st, block_size=st.sampled_from([1, 2, 3, 4, 8]), num_blocks=st.integers(3, 20),
       max_num_seqs=st.integers(1, 8), extra_budget=st.integers(0, 40), vocab=st.integers(4, 30),
       seed=st.integers(0, 2**16), caching=st.booleans(), chunk_budget=st.sampled_from([None, 1, 3, 8, 20]),
       policy=st.sampled_from(["fcfs", "priority", "spf"]), shared=st.integers(0, 12))
def test_random_workload_matches_run_alone_and_never_leaks(reqs, block_size, num_blocks, max_num_seqs,
                                                           extra_budget, vocab, seed, caching, chunk_budget,
                                                           policy, shared):
    """Any mix of arrivals, aborts and preemptions, under each policy, with and without the prefix cache
    (prompts share their first ``shared`` tokens) and chunked prefill (a budget below the context)."""
    n_positions = 32
    pool, sched, model = make(num_blocks=num_blocks, block_size=block_size, n_positions=n_positions,
                              vocab=vocab, max_num_seqs=max_num_seqs, policy=policy,
                              enable_prefix_caching=caching, enable_chunked_prefill=chunk_budget is not None,
                              max_num_batched_tokens=chunk_budget or n_positions + extra_budget)
    accepted, aborted = [], set()
    for t in range(10_000):
        for i, (arrive, plen, max_new, ignore_eos, abort_after) in enumerate(reqs):
            if arrive == t:
                p = [(seed + 7 * (i if j >= shared else 0) + j) % (vocab - 1) + 1 for j in range(plen)]
                sp = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
                fits = plen + max_new <= n_positions and -(-(plen + max_new - 1) // block_size) <= num_blocks
                if fits:
                    accepted.append((sched.add_request(p, sp, priority=(i * 5) % 3), arrive, abort_after))
                else:
                    with pytest.raises(ValueError):
                        sched.add_request(p, sp)
        for r, arrive, abort_after in accepted:
            if not r.finished and abort_after < 30 and t == arrive + abort_after:
                sched.abort(r.id)
                aborted.add(r.id)
        if t > max(a for a, *_ in reqs) and not sched.has_unfinished():
            break
        out = step(sched, model)
        assert not out.prefill or out.num_tokens <= sched.max_num_batched_tokens
    else:
        raise AssertionError("workload did not finish")
    assert pool.num_free == pool.num_blocks and not sched.running and not sched.waiting
    for r, _, _ in accepted:
        assert r.finished and r.table is None
        want, reason = run_alone(r.prompt_ids, r.sampling, vocab)
        if r.id in aborted:
            assert r.finish_reason == "abort" and want[:len(r.output_ids)] == r.output_ids
        else:
            assert (r.output_ids, r.finish_reason) == (want, reason)


def test_abort_between_schedule_and_update():
    pool, sched, model = make()
    a = sched.add_request(prompt(3), SamplingParams(max_new_tokens=5, ignore_eos=True))
    b = sched.add_request(prompt(4), SamplingParams(max_new_tokens=5, ignore_eos=True))
    step(sched, model)
    out = sched.schedule()
    toks = model(out)
    sched.abort(a.id)
    assert sched.update(out, toks) == [] and len(a.output_ids) == 1 and len(b.output_ids) == 2
    run_all(sched, model)
    assert b.output_ids == run_alone(b.prompt_ids, b.sampling, 50)[0] and pool.num_free == pool.num_blocks


def test_reserve_is_all_or_nothing_and_update_steps_stops_each_request():
    """Multi-step decode: blocks for K steps of every sequence (at most its tokens left), or none at all;
    update_steps appends step by step and ignores a request's tokens after it finished."""
    pool = BlockPool(1, 1, 4, block_size=4, num_blocks=4)
    sch = Scheduler(pool, 64, max_num_seqs=4, eos_token_id=EOS, vocab_size=50)
    a = sch.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    b = sch.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=9))
    out = sch.schedule()
    sch.update(out, [11, 12])
    out = sch.schedule()                                  # decode: a at position 3, b at position 4
    used = pool.num_used
    assert not sch.reserve(out, 12) and pool.num_used == used      # 2 more blocks, 1 free
    assert sch.reserve(out, 4)
    assert a.table.capacity >= 3 - 1 + 3 and len(a.table.blocks) == 2 and b.table.capacity >= 4 + 4
    done = sch.update_steps(out, [[13, 14], [15, EOS], [16, 17], [18, 19]])
    assert a.output_ids == [11, 13, 15] and a.finish_reason == "length"
    assert b.output_ids == [12, 14, EOS] and b.finish_reason == "stop"
    assert set(done) == {a, b} and pool.num_free == pool.num_blocks


# ----------------------------------------------------------------------------------------------- policies
@pytest.mark.parametrize("policy,want", [("fcfs", [0, 1, 2, 3]), ("priority", [2, 0, 3, 1]), ("spf", [3, 1, 0, 2])])
def test_policy_orders_admission(policy, want):
    pool, sched, model = make(max_num_seqs=1, policy=policy)
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
    reqs = [sched.add_request(prompt(n, i), sp, priority=pr) for i, (n, pr) in enumerate([(6, 1), (4, 3), (9, 0), (2, 2)])]
    admitted = []
    while sched.has_unfinished():
        admitted += [reqs.index(r) for r in step(sched, model).prefill]
    assert admitted == want
    assert all((r.output_ids, r.finish_reason) == run_alone(r.prompt_ids, sp, 50) for r in reqs)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "spf"])
def test_preemption_takes_the_last_in_policy_order(policy):
    """Blocks run out: the running request last in policy order is preempted; the first always advances,
    and everyone ends with the tokens they get alone."""
    pool, sched, model = make(num_blocks=6, block_size=2, n_positions=16, policy=policy)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    reqs = [sched.add_request(prompt(n, 5 * i), sp, priority=pr) for i, (n, pr) in enumerate([(3, 2), (2, 0), (4, 1)])]
    first = min(reqs, key=sched._key)
    preempted = []
    while sched.has_unfinished():
        out = step(sched, model)
        for v in out.preempted:
            assert all(sched._key(v) > sched._key(r) for r in sched.running)
        preempted += out.preempted
    assert preempted and first not in preempted
    for r in reqs:
        assert (r.output_ids, r.finish_reason) == run_alone(r.prompt_ids, sp, 50)
    assert pool.num_free == pool.num_blocks


def test_policy_and_priority_validated():
    pool = BlockPool(1, 1, 1, 4, torch.float32, num_blocks=8)
    with pytest.raises(ValueError, match="policy: expected one of"):
        Scheduler(pool, 32, policy="lifo")
    sched = Scheduler(pool, 32)
    with pytest.raises(TypeError, match="priority: expected an int"):
        sched.add_request([1, 2], priority=1.5)


def test_prompt_ids_of_other_int_types_become_ints():
    """numpy and torch integer ids are taken (and stored as Python ints); the plain-int path is the same."""
    import numpy as np

    pool = BlockPool(1, 1, 4, 4, torch.float32, "cpu", num_blocks=16, memory=None)
    sched = Scheduler(pool, 32, vocab_size=50)
    for ids in (np.array([3, 7, 49], np.int64), torch.tensor([3, 7, 49]), [np.int32(3), 7, 49], [3, 7, 49]):
        r = sched.add_request(ids, SamplingParams(max_new_tokens=2))
        assert r.prompt_ids == [3, 7, 49] and all(type(t) is int for t in r.prompt_ids)
