"""Prefill rows inside the device-side decode step (runner.graph_prefill_tokens): a step's short prefill
(a chunk of a long prompt, a prefix-cache suffix, a recompute after preemption) runs as decode rows of the
captured step beside the decodes. Greedy fp32 tokens equal those of the eager prefill path and of each
request alone; every block comes back. On the CPU the device-side step runs without capture
(cuda_graphs="eager"), on the torch ops and on the Triton kernels through the interpreter."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import collections

import pytest
import torch

from tritune.model.engine.engine import Engine
from tritune.model.engine.runner import prefill_buckets
from tritune.model.engine.scheduler import SamplingParams
from tests.test_engine import STEP_DEVICE, VOCAB, alone, prompts, tiny_model

GRAPH_PATHS = ("graph-mixed", "graph-prefill")


@pytest.fixture(scope="module")
def model():
    # the torch backend where the device-side step's Triton kernels run: the GPU when there is one (no
    # interpreter then: CPU tensors would reach a compiled kernel), else the CPU through the interpreter
    return tiny_model(device=STEP_DEVICE)


def spy_paths(eng):
    """Count the forward's path labels, and check each prefill step's rows fit the graph cap."""
    seen = collections.Counter()
    orig = eng.runner.forward

    def forward(out):
        logits, path = orig(out)
        seen[path] += 1
        if path in GRAPH_PATHS:
            assert sum(map(len, out.prefill_ids)) <= eng.runner.graph_prefill_tokens
            assert logits.shape[0] == len(out.requests)
        return logits, path
    eng.runner.forward = forward
    return seen


def run_arrivals(eng, ps, news, gap=2):
    reqs = []
    for p, n in zip(ps, news):
        reqs.append(eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        for _ in range(gap):
            if eng.has_unfinished():
                eng.step()
    eng.run()
    return reqs


def engines(model, graph_tokens, **kw):
    """The same engine with prefill rows on the graph (``graph_tokens``) and without (0)."""
    base = dict(cuda_graphs="eager", graph_buckets=(1, 2, 4, 8), prefill_batching=False, block_size=4)
    base.update(kw)
    return Engine(model, graph_prefill_tokens=graph_tokens, **base), Engine(model, graph_prefill_tokens=0, **base)


def test_prefill_buckets():
    assert prefill_buckets([1, 2, 4, 8], 8 + 64) == [1, 2, 4, 8, 32, 64, 80]
    assert prefill_buckets([1, 2, 4, 8, 16, 32, 64], 64 + 64) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert prefill_buckets([1, 2, 4, 8, 16, 32, 64, 128, 256], 256 + 64) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 320]
    assert prefill_buckets([4], 4) == [4]


def test_graph_prefill_tokens_validated(model):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="graph_prefill_tokens"):
            Engine(model, num_blocks=16, block_size=4, cuda_graphs="eager", graph_prefill_tokens=bad)
    eng = Engine(model, num_blocks=16, block_size=4, cuda_graphs=False, graph_prefill_tokens=32)
    assert eng.runner.graph_prefill_tokens == 0      # no device-side step: nothing to ride in


def test_chunk_cap_validated_and_applied(model):
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        Engine(model, num_blocks=32, block_size=4, cuda_graphs=False, long_prefill_token_threshold=8)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            Engine(model, num_blocks=32, block_size=4, cuda_graphs=False, enable_chunked_prefill=True,
                   long_prefill_token_threshold=bad)
    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False, enable_chunked_prefill=True,
                 max_batch_tokens=64, long_prefill_token_threshold=5, enable_prefix_caching=False)
    sizes = []
    orig = eng.runner.forward

    def forward(out):
        sizes.extend(map(len, out.prefill_ids))
        return orig(out)
    eng.runner.forward = forward
    ps = prompts(3, seed=41, lo=12, hi=30)
    reqs = run_arrivals(eng, ps, [4, 4, 4], gap=0)    # all three admitted in one step, each capped
    assert max(sizes) == 5 and len(sizes) > len(ps)
    for r, p in zip(reqs, ps):
        assert r.output_ids == alone(model, p, 4)
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("budget,cap", [(24, 6), (64, 9)])
def test_chunked_prefill_on_graph_equals_eager(model, budget, cap):
    """Long prompts chunked (at most ``cap`` tokens a step each) beside running decodes: the chunks ride in
    the device-side step (graph-mixed steps), the tokens are those of the eager prefill and of each alone."""
    ps = prompts(6, seed=42, lo=20, hi=60)
    news = [7, 3, 12, 5, 9, 4]
    outs = []
    for eng in engines(model, 12, num_blocks=160, max_num_seqs=4, enable_chunked_prefill=True,
                       max_batch_tokens=budget, long_prefill_token_threshold=cap, enable_prefix_caching=False):
        seen = spy_paths(eng)
        outs.append([r.output_ids for r in run_arrivals(eng, ps, news)])
        assert eng.pool.num_free == eng.pool.num_blocks
        if eng.runner.graph_prefill_tokens:
            assert seen["graph-mixed"] > 0 and seen["graph-prefill"] > 0
            assert eng.path_counts["graph-mixed"] == seen["graph-mixed"]
        else:
            assert not any(seen[k] for k in GRAPH_PATHS)
    assert outs[0] == outs[1] == [alone(model, p, n) for p, n in zip(ps, news)]


@pytest.mark.parametrize("work", [None, 100])
def test_chunks_beside_decodes_stay_on_graph(model, work):
    """A step budget larger than the device-side step's prefill rows (no long_prefill_token_threshold):
    while sequences decode, a step takes at most ``graph_prefill_tokens`` prompt tokens, so every chunk
    rides in the captured step and no decode waits on an eager prefill; a step with no decodes keeps the
    whole budget. With ``graph_prefill_work``, the rows' context positions (each row reads its context)
    stay within it, past the one row a step always gets. Tokens equal the eager-prefill engine's and each
    alone; every block comes back."""
    from tritune.model.engine.scheduler import _work

    ps = prompts(4, seed=51, lo=24, hi=44)
    news = [9, 12, 5, 7]
    outs = []
    for eng in engines(model, 8, num_blocks=200, max_num_seqs=4, enable_chunked_prefill=True,
                       max_batch_tokens=48, enable_prefix_caching=False, graph_prefill_work=work):
        seen = spy_paths(eng)
        sizes = []
        orig = eng.scheduler.schedule

        def schedule(*a, _orig=orig, _sizes=sizes, _sched=eng.scheduler, **k):
            out = _orig(*a, **k)
            w = sum(_work(s, len(t)) for s, t in zip(out.prefill_starts, out.prefill_ids))
            _sizes.append((len(out.decode), sum(map(len, out.prefill_ids))))
            if _sched.decode_step_prefill_work and out.decode and out.prefill:
                assert w <= work or sum(map(len, out.prefill_ids)) == 1, (w, out.prefill_starts)
            return out
        eng.scheduler.schedule = schedule
        outs.append([r.output_ids for r in run_arrivals(eng, ps, news, gap=1)])
        assert eng.pool.num_free == eng.pool.num_blocks
        if eng.runner.graph_prefill_tokens:
            assert eng.scheduler.decode_step_prefill_cap == 8
            assert all(p <= 8 for d, p in sizes if d), sizes
            assert any(p > 8 for d, p in sizes if not d), sizes      # alone, a prompt takes the budget
            if work:
                assert any(0 < p < 8 for d, p in sizes if d), sizes  # late chunks got fewer rows
            assert seen["graph-mixed"] > 0 and seen["graph"] + seen["graph-mixed"] + seen["graph-prefill"] \
                + seen["eager"] == sum(seen.values()), seen            # no eager prefill beside decodes
            assert eng.scheduler.decode_step_prefill_work == work
        else:
            assert eng.scheduler.decode_step_prefill_cap is None
            assert any(p > 8 for d, p in sizes if d), sizes
    assert outs[0] == outs[1] == [alone(model, p, n) for p, n in zip(ps, news)]


def test_prefix_cache_hits_on_graph(model):
    """Requests sharing a prefix: the later ones find it cached and prefill only their suffix, in the
    device-side step (several suffixes in one step too); tokens as without the path, blocks all back."""
    g = torch.Generator().manual_seed(43)
    prefix = torch.randint(0, VOCAB - 1, (21,), generator=g).tolist()
    ps = [prefix + torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 9, 1, 6, 12, 2, 5)]
    news = [6, 4, 9, 3, 5, 8, 2]
    outs = []
    for eng in engines(model, 24, num_blocks=96, max_num_seqs=8):
        seen = spy_paths(eng)
        first = eng.add_request(ps[0], SamplingParams(max_new_tokens=news[0], ignore_eos=True))
        eng.step()                                    # the prefix computed (and cached) by the first
        reqs = [first] + [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True))
                          for p, n in zip(ps[1:4], news[1:4])]
        eng.step()                                    # three suffixes in one step, beside a decode
        reqs += run_arrivals(eng, ps[4:], news[4:], gap=1)
        outs.append([r.output_ids for r in reqs])
        assert all(r.num_cached_tokens >= 20 for r in reqs[1:])
        assert eng.pool.num_free == eng.pool.num_blocks
        if eng.runner.graph_prefill_tokens:
            assert seen["graph-mixed"] >= 2
    assert outs[0] == outs[1] == [alone(model, p, n) for p, n in zip(ps, news)]


def test_preemption_recompute_on_graph(model):
    """A pool too small for every sequence: preempted sequences are recomputed (prompt + generated) by
    prefills that ride in the device-side step when short enough; tokens unchanged, no block lost."""
    ps = prompts(6, seed=44, lo=5, hi=14)
    news = [20, 18, 22, 16, 19, 21]
    outs = []
    for eng in engines(model, 32, num_blocks=20, max_num_seqs=6, enable_prefix_caching=False):
        seen = spy_paths(eng)
        reqs = run_arrivals(eng, ps, news, gap=0)
        outs.append([r.output_ids for r in reqs])
        assert sum(r.num_preemptions for r in reqs) > 0
        assert eng.pool.num_free == eng.pool.num_blocks
        if eng.runner.graph_prefill_tokens:
            assert seen["graph-mixed"] > 0
    assert outs[0] == outs[1] == [alone(model, p, n) for p, n in zip(ps, news)]


def test_mixed_steps_with_prefix_cache_and_chunks(model):
    """Everything at once: chunked long prompts (capped), prefix hits, arrivals between steps and multi-step
    decode runs in between (decode_steps): the rows a graph-mixed step loads do not disturb the decode-only
    steps' rows (their block tables are cached per row)."""
    g = torch.Generator().manual_seed(45)
    prefix = torch.randint(0, VOCAB - 1, (17,), generator=g).tolist()
    ps = [prefix + torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (30, 2, 45, 7)]
    ps += prompts(2, seed=46, lo=3, hi=40)
    news = [6, 9, 4, 7, 8, 5]
    outs = []
    for eng in engines(model, 12, num_blocks=200, max_num_seqs=4, enable_chunked_prefill=True, max_batch_tokens=40,
                       long_prefill_token_threshold=10, decode_steps=4):
        seen = spy_paths(eng)
        outs.append([r.output_ids for r in run_arrivals(eng, ps, news, gap=3)])
        assert eng.pool.num_free == eng.pool.num_blocks
        if eng.runner.graph_prefill_tokens:
            assert seen["graph-mixed"] > 0 and eng.path_counts["graph"] > 0
    assert outs[0] == outs[1] == [alone(model, p, n) for p, n in zip(ps, news)]


def test_triton_kernels_graph_prefill():
    """The Triton kernels (interpreter): chunks and a prefix hit as rows of the device-side step."""
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=48)
    ref = tiny_model("torch", n_layer=1, n_embd=32, n_head=2, n_positions=48)
    ps = prompts(2, seed=47, lo=14, hi=22)
    ps.append(ps[0][:12] + [5, 6])
    eng = Engine(m, num_blocks=40, block_size=4, cuda_graphs="eager", graph_buckets=(1, 2, 4), max_num_seqs=3,
                 prefill_batching=False, enable_chunked_prefill=True, max_batch_tokens=16,
                 long_prefill_token_threshold=6, graph_prefill_tokens=8, fused_decode=False)
    seen = spy_paths(eng)
    reqs = run_arrivals(eng, ps, [3, 4, 3], gap=2)
    assert seen["graph-mixed"] > 0 and reqs[2].num_cached_tokens == 12
    assert [r.output_ids for r in reqs] == [alone(ref, p, n) for p, n in zip(ps, [3, 4, 3])]
    assert eng.pool.num_free == eng.pool.num_blocks


# ---------------------------------------------------------------------------------------------------
# On the GPU: the captured step
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_graph_prefill_taken_and_tokens_equal(fused):
    """Captured graphs (fp32, triton): chunked long prompts, prefix hits and short prompts beside decodes
    take the graph-mixed / graph-prefill paths, and every token equals the run with prefills eager."""
    m = tiny_model("triton", n_layer=2, n_embd=128, n_head=2, n_positions=256, device="cuda")
    g = torch.Generator().manual_seed(48)
    prefix = torch.randint(0, VOCAB - 1, (40,), generator=g).tolist()
    ps = [prefix + torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (5, 150, 20, 9)]
    ps += prompts(4, seed=49, lo=3, hi=60)
    news = [30, 12, 25, 40, 18, 33, 21, 9]
    outs, counts = [], []
    for tokens in (64, 0):
        eng = Engine(m, num_blocks=400, block_size=16, max_num_seqs=8, prefill_batching=False, decode_steps=4,
                     enable_chunked_prefill=True, max_batch_tokens=256, long_prefill_token_threshold=48,
                     graph_prefill_tokens=tokens, fused_decode=fused)
        assert eng.graphs is not None and bool(eng.graphs.graphs)      # captured
        outs.append([r.output_ids for r in run_arrivals(eng, ps, news, gap=2)])
        counts.append(dict(eng.path_counts))
        assert eng.pool.num_free == eng.pool.num_blocks
    assert counts[0].get("graph-mixed", 0) > 0 and counts[0].get("graph-prefill", 0) > 0, counts
    assert not counts[1].get("graph-mixed") and not counts[1].get("graph-prefill"), counts
    assert outs[0] == outs[1]


def test_serving_paged_config_splits_long_rows():
    """The engine's decode attention keeps a KV partition of at most SERVING_PARTITION tokens whatever the
    tuned entry says (its rows' lengths differ: unsplit, the longest row is the kernel's time), valid for
    the kernel's space, and still equal to the reference over rows of very different lengths."""
    from tritune.kernels.runtime import compare as cmp
    from tritune.kernels import paged_attention as PA
    from tritune.model.gpt2 import model as G

    assert G.serving_paged_config(4, 2, 2, 16, 128, 16, torch.float32) is None     # one chunk holds it all
    for B in (1, 8, 64, 256):
        cfg = G.serving_paged_config(B, 12, 12, 64, 2560, 16, torch.bfloat16)
        if cfg is not None:
            assert 0 < cfg["PARTITION"] <= G.SERVING_PARTITION and cfg["PARTITION"] % cfg["BLOCK_N"] == 0
            p = PA.Problem(B, 12, 12, 64, 2560, 16, mixed=True)
            assert PA.SPEC.space.why_invalid(cfg, p, torch.bfloat16) is None
    g = torch.Generator().manual_seed(5)
    B, H, D, bs, nb = 3, 2, 16, 16, 40
    cap = 32 * bs
    kc, vc = (torch.randn(nb, bs, H, D, generator=g).to(STEP_DEVICE) for _ in range(2))
    q = torch.randn(B, H, D, generator=g).to(STEP_DEVICE)
    tables = torch.stack([torch.randperm(nb, generator=g)[:32] for _ in range(B)]).to(torch.int32).to(STEP_DEVICE)
    lens = torch.tensor([cap, 5, 300], dtype=torch.int32, device=STEP_DEVICE)
    cfg = G.serving_paged_config(B, H, H, D, cap, bs, torch.float32) \
        or PA.SPEC.config_for(PA.Problem(B, H, H, D, cap, bs, mixed=True), torch.float32, None)
    assert 0 < cfg["PARTITION"] <= G.SERVING_PARTITION
    got = PA.paged_attention(q, kc, vc, tables, lens, config=cfg)
    ref = G.torch_attn_decode(q.double(), kc.double(), vc.double(), tables, lens)
    assert cmp.rel_error(got, ref) <= cmp.tolerance(torch.float32)


def test_decode_graph_widths_follow_the_longest_table(model, monkeypatch):
    """The device-side step runs at the narrowest captured block-table width that holds every loaded row's
    table (paged attention takes its config from the table's capacity), growing as the rows grow; greedy
    tokens equal each request alone; the batch-invariant mode keeps one width."""
    from tritune.model.engine import graphs as GR

    monkeypatch.setattr(GR, "MIN_WIDTH_TOKENS", 8)      # block_size 4: widths 2, 8, then max_blocks
    assert GR.table_widths(24, 4) == [2, 8, 24] and GR.table_widths(2, 4) == [2] and GR.table_widths(1, 4) == [1]
    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs="eager", graph_buckets=(1, 2, 4),
                 max_num_seqs=4, prefill_batching=False, graph_prefill_tokens=0)
    g = eng.runner.graphs
    assert g.widths == GR.table_widths(g.mb, 4) and len(g.widths) >= 3, g.widths
    used = collections.Counter()
    orig = g._run

    def run(b, w=None):
        used[w] += 1
        return orig(b, w)
    monkeypatch.setattr(g, "_run", run)
    ps = prompts(3, seed=71, lo=2, hi=6)
    reqs = run_arrivals(eng, ps, [40, 12, 30], gap=1)
    assert [r.output_ids for r in reqs] == [alone(model, p, n) for p, n in zip(ps, [40, 12, 30])]
    assert len([w for w in used if w is not None]) >= 2, used     # short rows ran narrow, long rows wider
    assert eng.pool.num_free == eng.pool.num_blocks
    inv = Engine(model, num_blocks=64, block_size=4, cuda_graphs="eager", graph_buckets=(1, 2, 4),
                 max_num_seqs=4, batch_invariant=True)
    if inv.runner.graphs is not None:
        assert inv.runner.graphs.widths == [inv.runner.graphs.mb]
    with pytest.raises(ValueError, match="widths"):
        GR.DecodeGraphs(model, eng.pool, g.mb, [1, 2], capture=False, widths=[2, 4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_gpu_graph_widths_equal_one_width(monkeypatch):
    """Captured graphs per block-table width (fp32, triton, 1024 positions: widths 16, 64 blocks): greedy
    tokens equal those of the engine captured at the full width only."""
    from tritune.model.engine import graphs as GR

    m = tiny_model("triton", n_layer=2, n_embd=128, n_head=2, n_positions=1024, device="cuda")
    ps = prompts(6, seed=72, lo=3, hi=300)
    news = [40, 300, 25, 90, 18, 260]
    outs = []
    for min_tokens in (GR.MIN_WIDTH_TOKENS, 1 << 30):
        monkeypatch.setattr(GR, "MIN_WIDTH_TOKENS", min_tokens)
        eng = Engine(m, num_blocks=600, block_size=16, max_num_seqs=8, decode_steps=4)
        assert bool(eng.graphs.graphs) and eng.graphs.widths == ([16, 64] if min_tokens < 1024 else [64])
        outs.append([r.output_ids for r in run_arrivals(eng, ps, news, gap=2)])
        assert eng.pool.num_free == eng.pool.num_blocks
    assert outs[0] == outs[1]
