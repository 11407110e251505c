"""Engine(run_ahead=True), the batch-1 engine of ``generate``/``tritune generate``: a step of decodes only
returns with its device-side steps queued, and the next step reads their tokens. The caller's per-token
work (streaming, detokenizing, printing) then overlaps the GPU instead of following it; no token, finish
reason or block count may change, aborts while steps are queued included. The device-side step runs
eagerly (cuda_graphs="eager": the host logic of the captured graphs), on the GPU where there is one."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import pytest

from tests.test_engine import STEP_DEVICE, VOCAB, alone, prompts, tiny_model
from tritune.model.engine.engine import Engine
from tritune.model.engine.generate import engine_for, generate, stream
from tritune.model.engine.scheduler import SamplingParams


@pytest.fixture(scope="module")
def model():
    # the device-side step's two kernels run where triton does: the GPU (steps truly queued), else the
    # interpreter on the CPU
    return tiny_model(device=STEP_DEVICE)


def engine(model, run_ahead, **kw):
    kw.setdefault("prefill_batching", False)
    return Engine(model, cuda_graphs="eager", graph_buckets=(1, 2, 4, 8), num_blocks=200, block_size=4,
                  run_ahead=run_ahead, **kw)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_run_ahead_changes_no_token(model, decode_steps):
    """Greedy and seeded-sampled rows, EOS on the device and drawn, arrivals between steps: the same
    tokens and finish reasons with the steps queued ahead as without, and every block back."""
    ps = prompts(6, seed=21, hi=12)
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 4, 8)] + [
        SamplingParams(max_new_tokens=6, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_new_tokens=7, temperature=1.0, top_k=7, seed=6),
        SamplingParams(max_new_tokens=7)]
    runs = []
    for ahead in (False, True):
        eng = engine(model, ahead, max_num_seqs=4, decode_steps=decode_steps)
        reqs = [eng.add_request(p, s) for p, s in zip(ps[:3], sps[:3])]
        for _ in range(2):
            eng.step()
        reqs += [eng.add_request(p, s) for p, s in zip(ps[3:], sps[3:])]
        eng.run()
        assert eng.pool.num_free == eng.pool.num_blocks
        runs.append([(r.output_ids, r.finish_reason) for r in reqs])
    assert runs[0] == runs[1]
    for p, s, (ids, _) in zip(ps[:3], sps[:3], runs[1]):
        assert ids == alone(model, p, s.max_new_tokens)


def test_queued_steps_land_at_the_next_step_and_overlap_the_consumer(model):
    """A decode-only step returns before its tokens are read; the consumer of a TokenStream handles one
    batch of tokens while the next batch is already queued on the device (each launch but the first
    comes before the tokens of the batch before it are handed over)."""
    p = prompts(1, seed=22)[0]
    eng = engine(model, True, max_num_seqs=1, decode_steps=5)
    log = []
    launch, collect = eng.runner.graph_launch, eng.runner.graph_collect
    eng.runner.graph_launch = lambda *a, **k: log.append("launch") or launch(*a, **k)
    eng.runner.graph_collect = lambda h: log.append("collect") or collect(h)
    ts = eng.stream(p, SamplingParams(max_new_tokens=16, ignore_eos=True))
    toks = []
    for t in ts:
        toks.append(t)
        log.append("token")
    assert toks == alone(model, p, 16)
    # prefill: token 1; then batches of 5, 5, 5 tokens. Launch k+1 precedes batch k's tokens.
    assert log == ["token", "launch", "collect", "launch"] + ["token"] * 5 + ["collect", "launch"] + \
        ["token"] * 5 + ["collect"] + ["token"] * 5
    assert eng.stats["decode_tokens"] == 15 and eng.timings["tokens"] == 15


def test_abort_while_steps_are_queued(model):
    """A request aborted with steps of it queued gets none of their tokens, its blocks come back, and the
    engine serves the next request exactly (the queued steps land first)."""
    ps = prompts(3, seed=23)
    eng = engine(model, True, max_num_seqs=2, decode_steps=8)
    a = eng.add_request(ps[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    b = eng.add_request(ps[1], SamplingParams(max_new_tokens=30, ignore_eos=True))
    eng.step()                              # the prefills
    eng.step()                              # 8 decode steps queued, not read
    assert len(a.output_ids) == 1 and eng.has_unfinished()
    eng.abort(a.id)
    eng.step()                              # lands: b gets its 8 tokens, a none
    assert a.finish_reason == "abort" and a.output_ids == alone(model, ps[0], 1)
    assert b.output_ids == alone(model, ps[1], 9)
    eng.abort(b.id)
    assert not eng.has_unfinished()         # steps of b may still be queued: the next step lands them
    r = eng.generate([ps[2]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert r.token_ids == alone(model, ps[2], 12)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_generate_engine_runs_ahead_with_the_same_tokens(model):
    """generate()'s batch-1 engine runs ahead; its tokens equal the plain loop's, greedy and sampled, and a
    generation dropped mid-stream leaves the engine exact for the next."""
    p = [5, 17, 3, 44]
    eng = engine_for(model, cuda_graph=True)
    assert eng.run_ahead and eng.describe()["run_ahead"]
    assert generate(model, p, max_new_tokens=12, eos_token_id=None, cuda_graph=True).tokens == alone(model, p, 12)
    kw = dict(max_new_tokens=8, temperature=0.8, top_k=20, seed=3, eos_token_id=None)
    assert (generate(model, p, cuda_graph=True, **kw).tokens == generate(model, p, cuda_graph=False, **kw).tokens)
    g = stream(model, p, max_new_tokens=40, eos_token_id=None, cuda_graph=True)
    for i, _ in enumerate(g):
        if i == 3:
            break
    g.close()
    q = [VOCAB - 2, 1]
    assert generate(model, q, max_new_tokens=10, eos_token_id=None, cuda_graph=True).tokens == alone(model, q, 10)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_run_ahead_is_inert_without_a_device_side_step(model):
    """Without the device-side decode step (cuda_graphs=False) every step is synchronous as before."""
    p = prompts(1, seed=24)[0]
    eng = Engine(model, cuda_graphs=False, num_blocks=100, block_size=4, run_ahead=True)
    r = eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
    eng.step()
    eng.step()
    assert len(r.output_ids) == 2
    eng.run()
    assert r.output_ids == alone(model, p, 6)
