"""The serving engine on a tiny random GPT-2 (CPU, fp32, torch backend mostly; one triton-backend run
through the interpreter): continuous batching changes no request's greedy output, blocks never leak,
bad requests are refused without disturbing the others, preemption recomputes to the same outputs."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import queue
from dataclasses import replace

import pytest
import torch

from tritune.model.gpt2 import weights as W
from tritune.model.gpt2.config import GPT2Config
from tritune.model.gpt2 import model as G
from tritune.model.engine.engine import Engine
from tritune.model.gpt2.model import GPT2
from tritune.model.quant.ops import quantize_weights
from tritune.model.engine.runner import forward_step
from tritune.model.engine.scheduler import ContextLimitError, SamplingParams

VOCAB = 101


def tiny_model(backend="torch", n_layer=2, n_embd=64, n_head=2, n_positions=96, seed=3, device=None,
               dtype=torch.float32):
    """Random weights with a wide init, so greedy outputs vary from token to token."""
    g = torch.Generator().manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=VOCAB,
                     eos_token_id=VOCAB - 1, bos_token_id=VOCAB - 1)
    E, Fd = n_embd, 4 * n_embd
    state = {"wte.weight": torch.randn(VOCAB, E, generator=g), "wpe.weight": torch.randn(n_positions, E, generator=g),
             "ln_f.weight": 1 + 0.1 * torch.randn(E, generator=g), "ln_f.bias": 0.1 * torch.randn(E, generator=g)}
    for i in range(n_layer):
        h = f"h.{i}."
        for name, shape, std in (("ln_1.weight", (E,), 0.1), ("ln_1.bias", (E,), 0.1),
                                 ("attn.c_attn.weight", (E, 3 * E), 0.3), ("attn.c_attn.bias", (3 * E,), 0.1),
                                 ("attn.c_proj.weight", (E, E), 0.2), ("attn.c_proj.bias", (E,), 0.1),
                                 ("ln_2.weight", (E,), 0.1), ("ln_2.bias", (E,), 0.1),
                                 ("mlp.c_fc.weight", (E, Fd), 0.2), ("mlp.c_fc.bias", (Fd,), 0.1),
                                 ("mlp.c_proj.weight", (Fd, E), 0.1), ("mlp.c_proj.bias", (E,), 0.1)):
            t = std * torch.randn(shape, generator=g)
            state[h + name] = t + 1 if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") else t
    if device is None:      # the triton backend runs where the kernels do (the GPU, or the interpreter's CPU)
        device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return GPT2(cfg, W.to_layout(cfg, state, dtype, device), backend=backend)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompts(n, seed=1, lo=1, hi=30):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB - 1, (k,), generator=g).tolist() for k in lens]


@torch.inference_mode()
def alone(model, p, max_new):
    """The same request alone, greedy, through the model's own prefill and decode over a private cache
    (blocks in order): an implementation independent of the engine's scheduler, runner and graphs."""
    dev = model.device
    cache = model.new_cache(len(p) + max_new, 4)
    table = torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None, :]
    logits = model.prefill(torch.tensor(p, device=dev), [len(p)], kv_cache=cache,
                           slot_mapping=torch.arange(len(p), device=dev))
    out = [int(logits[0].argmax())]
    for n in range(len(p), len(p) + max_new - 1):
        pos = torch.tensor([n], device=dev)
        logits = model.decode(torch.tensor([out[-1]], device=dev), pos, cache, pos, table,
                              torch.tensor([n + 1], dtype=torch.int32, device=dev))
        out.append(int(logits[0].argmax()))
    return out


def test_tiny_model_outputs_vary(model):
    out = alone(model, [1, 2, 3], 12)
    assert len(set(out)) > 3, out       # otherwise the equality tests below would prove little


def test_continuous_batching_equals_alone_with_arrivals_mid_run(model):
    ps = prompts(9)
    news = [5 + (7 * i) % 17 for i in range(9)]
    eng = Engine(model, num_blocks=200, block_size=4, max_num_seqs=4, cuda_graphs=False)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps[:4], news[:4])]
    steps = 0
    while eng.has_unfinished() or len(reqs) < 9:
        if len(reqs) < 9 and steps % 3 == 2:     # a new request joins every third step
            i = len(reqs)
            reqs.append(eng.add_request(ps[i], SamplingParams(max_new_tokens=news[i], ignore_eos=True)))
        eng.step()
        steps += 1
        used = sum(len(r.table.blocks) for r in eng.scheduler.running)
        assert eng.pool.num_used == used          # every used block belongs to a running request
    assert eng.stats["mixed_steps"] > 0           # prefills and decodes did share a forward
    for p, n, r in zip(ps, news, reqs):
        assert r.finish_reason == "length" and r.output_ids == alone(model, p, n)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_prefill_batching_defers_admission_but_changes_no_output(model):
    ps = prompts(10, seed=10)
    news = [3 + (5 * i) % 13 for i in range(10)]
    eng = Engine(model, num_blocks=200, block_size=4, max_num_seqs=4, cuda_graphs=False, prefill_batching=True,
                 prefill_min_seats=3, prefill_max_wait=4)
    res = eng.generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news])
    for p, n, r in zip(ps, news, res):
        assert r.token_ids == alone(model, p, n)
    assert eng.stats["mixed_steps"] < eng.stats["steps"] and eng.pool.num_free == eng.pool.num_blocks


def test_generate_batch_and_preemption_under_tiny_pool(model):
    ps = prompts(8, seed=2, lo=3, hi=20)
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    # 14 blocks of 4 tokens: at most ~2 sequences fit at full length, so the newest keep being preempted
    eng = Engine(model, num_blocks=14, block_size=4, cuda_graphs=False)
    res = eng.generate(ps, sp)
    assert eng.stats["preemptions"] > 0
    assert eng.pool.peak_used <= 14 and eng.pool.num_free == 14
    for p, r in zip(ps, res):
        assert r.token_ids == alone(model, p, 16), r
        assert r.ttft_s >= 0 and r.latency_s >= r.ttft_s


def test_bad_requests_rejected_without_disturbing_others(model):
    ps = prompts(3, seed=3)
    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False)
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    good = [eng.add_request(p, sp) for p in ps]
    eng.step()
    eng.step()
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], sp)
    with pytest.raises(ValueError, match="context"):
        eng.add_request(list(range(97)), sp)                       # n_positions is 96
    with pytest.raises(ContextLimitError, match="exceeds the model's context"):
        eng.add_request([1] * 90, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request([1, 2], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request([1, VOCAB + 5], sp)
    with pytest.raises(TypeError, match="tokenizer"):
        eng.add_request("text without a tokenizer", sp)
    small = Engine(model, num_blocks=8, block_size=4, cuda_graphs=False)
    with pytest.raises(ValueError, match="more than the whole pool"):
        small.add_request([1] * 30, SamplingParams(max_new_tokens=10))
    eng.run()
    for p, r in zip(ps, good):
        assert r.output_ids == alone(model, p, 10)
    assert eng.pool.num_free == eng.pool.num_blocks

    # generate(): errors="raise" names the prompt and runs nothing; errors="return" runs the others
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        eng.generate([ps[0], [], ps[1]], sp)
    assert not eng.has_unfinished() and eng.pool.num_free == eng.pool.num_blocks
    res = eng.generate([ps[0], [], ps[1]], sp, errors="return")
    assert res[1].finish_reason == "error" and "empty" in res[1].error
    assert res[0].token_ids == alone(model, ps[0], 10) and res[2].token_ids == alone(model, ps[1], 10)


def test_streaming_iterator_queue_and_abort(model):
    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False)
    p1, p2, p3 = prompts(3, seed=4)
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    q = queue.Queue()
    r2 = eng.add_request(p2, sp, stream=q)
    r3 = eng.add_request(p3, SamplingParams(max_new_tokens=50, ignore_eos=True))
    ts = eng.stream(p1, sp)
    toks = list(ts)                        # drives the engine: the others advance too
    assert toks == alone(model, p1, 8) == ts.request.output_ids
    eng.abort(r3.id)
    eng.run()
    got = []
    while (t := q.get_nowait()) is not None:
        got.append(t)
    assert got == r2.output_ids == alone(model, p2, 8)
    assert r3.finish_reason == "abort" and eng.pool.num_free == eng.pool.num_blocks


def test_seeded_sampling_is_reproducible(model):
    ps = prompts(4, seed=5)
    sps = [SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=i, ignore_eos=True) for i in range(4)]
    runs = [[r.token_ids for r in Engine(model, num_blocks=64, block_size=4, cuda_graphs=False).generate(ps, sps)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != [alone(model, p, 10) for p in ps]       # not greedy


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_engine_runs_the_dequantized_weights(model, quant):
    """Weight-only quant changes only the weights: the engine's logits equal a dense model's on the
    dequantized weights (whichever path, kernel or reference, runs the quantized linears)."""
    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False, quant=quant, group_size=32)
    qw = quantize_weights(model.w, quant, 32)

    def deq(t):
        return t.dequantize(torch.float32).t().contiguous() if hasattr(t, "dequantize") else t

    from dataclasses import replace
    dense_w = replace(qw, lm_head=deq(qw.lm_head), layers=[
        replace(L, w_qkv=deq(L.w_qkv), w_o=deq(L.w_o), w_fc=deq(L.w_fc), w_proj=deq(L.w_proj)) for L in qw.layers])
    dense = GPT2(model.config, dense_w, backend="torch")
    ids = torch.tensor(prompts(1, seed=6)[0])
    T = len(ids)
    pos = torch.arange(T)
    slots = torch.arange(T)
    want = dense.prefill(ids, [T], all_logits=True)
    got = forward_step(eng.model, eng.pool, ids, pos, slots, seq_lens=[T],
                       cu_seqlens=torch.tensor([0, T], dtype=torch.int32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert any(quant in n for n in eng.notes)
    res = eng.generate(prompts(3, seed=7), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert all(len(r.token_ids) == 6 for r in res) and eng.pool.num_free == eng.pool.num_blocks


def test_engine_options_validated(model):
    with pytest.raises(ValueError, match="quant"):
        Engine(model, num_blocks=8, quant="int3")
    with pytest.raises(ValueError, match="at most one"):
        Engine(model, num_blocks=8, kv_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="fraction"):
        Engine(model, kv_memory_fraction=0.5)                    # a fraction of GPU memory, on the CPU
    eng = Engine(model, kv_memory_bytes=1 << 20, block_size=8)
    assert eng.pool.num_blocks == (1 << 20) // eng.pool.bytes_per_block
    assert any("cuda_graphs off" in n for n in eng.notes)


@pytest.mark.slow
def test_compiled_decode_equals_alone(model):
    """compile=True: the torch ops' layer and head under torch.compile (one compile for all layers and
    every batch size: batches of 1..4 and contexts that grow, no recompile)."""
    import torch._dynamo

    torch._dynamo.reset()
    eng = Engine(model, num_blocks=200, block_size=4, max_num_seqs=4, cuda_graphs=False, compile=True)
    ps = prompts(6, seed=20)
    news = [3, 9, 1, 14, 6, 11]
    res = eng.generate(ps, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news])
    for p, n, r in zip(ps, news, res):
        assert r.token_ids == alone(model, p, n)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3        # layer in, layer out, head


def test_warm_up_compiles_without_writing_the_cache():
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    eng = Engine(m, num_blocks=16, block_size=4, cuda_graphs=False, max_batch_tokens=40, max_num_seqs=4)
    assert eng.warm_up() > 0
    assert not eng.pool.cache.any() and eng.pool.num_free == 16      # every slot was -1
    assert Engine(tiny_model(), num_blocks=8, cuda_graphs=False).warm_up() == 0.0   # torch: nothing to compile


def test_triton_backend_mixed_steps_match_alone():
    """The kernels (through the interpreter) in a step that mixes a prefill with decodes."""
    m = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    ref = tiny_model("torch", n_layer=1, n_embd=32, n_head=2, n_positions=32)
    eng = Engine(m, num_blocks=16, block_size=4, cuda_graphs=False)
    ps = prompts(2, seed=8, lo=2, hi=7)
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    r0 = eng.add_request(ps[0], sp)
    eng.step()
    r1 = eng.add_request(ps[1], sp)        # joins beside r0's decode
    eng.run()
    assert eng.stats["mixed_steps"] >= 1
    assert r0.output_ids == alone(ref, ps[0], 4) and r1.output_ids == alone(ref, ps[1], 4)
    assert eng.pool.num_free == eng.pool.num_blocks


# The device-step tests run the torch backend where the step's Triton kernels can run: the GPU when there
# is one (no interpreter then), else the CPU through the interpreter.
STEP_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def step_model():
    return tiny_model(device=STEP_DEVICE)


def device_step_engine(model, buckets=(1, 2, 4, 8), **kw):
    """An engine whose decode runs the device-side step without capture (cuda_graphs="eager"; the CPU has
    no CUDA graphs): embedding, slots, argmax, feedback, stop/EOS, and the multi-step host logic."""
    kw.setdefault("prefill_batching", False)
    return Engine(model, cuda_graphs="eager", graph_buckets=buckets, **kw)


@pytest.mark.parametrize("decode_steps", [1, 5, 16])
def test_multi_step_decode_equals_alone(step_model, decode_steps):
    """Several decode steps per host round trip (tokens fed back on the device, rows that finish turn
    to padding mid-run, batches that need padding rows, arrivals between round trips) change no token."""
    ps = prompts(7, seed=11)
    news = [1, 2, 9, 17, 30, 4, 23]
    eng = device_step_engine(step_model, num_blocks=200, block_size=4, max_num_seqs=8, decode_steps=decode_steps)
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in news]
    reqs = [eng.add_request(p, s) for p, s in zip(ps[:5], sp[:5])]
    for _ in range(3):
        eng.step()
    reqs += [eng.add_request(p, s) for p, s in zip(ps[5:], sp[5:])]
    eng.run()
    for p, n, r in zip(ps, news, reqs):
        assert r.finish_reason == "length" and r.output_ids == alone(step_model, p, n)
    assert eng.pool.num_free == eng.pool.num_blocks
    assert (eng.stats["multi_steps"] > 0) == (decode_steps > 1)
    assert eng.stats["decode_tokens"] == sum(news) - len(news)


def test_multi_step_decode_stops_at_eos_and_falls_back(step_model):
    """EOS ends a row on the device mid-run; a sampled request beside greedy ones, and a pool too small
    to reserve several steps ahead, fall back to one step per round trip, with the same outputs."""
    p = prompts(1, seed=12)[0]
    free = alone(step_model, p, 20)
    eos = free[6]
    m = GPT2(replace(step_model.config, eos_token_id=eos), step_model.w, backend="torch")
    eng = device_step_engine(m, num_blocks=200, block_size=4, decode_steps=8)
    r = eng.generate([p], SamplingParams(max_new_tokens=20))[0]
    assert r.token_ids == free[:free.index(eos) + 1] and r.finish_reason == "stop"

    # sampled rows beside greedy ones: drawn on the device between steps, several steps per round trip,
    # the same tokens as the plain path's host-side draws from the same seeds; a drawn EOS ends its row
    ps = prompts(3, seed=13)
    sps = [SamplingParams(max_new_tokens=12, ignore_eos=True),
           SamplingParams(max_new_tokens=12, temperature=0.9, seed=1, ignore_eos=True),
           SamplingParams(max_new_tokens=12, temperature=1.0, top_k=5, top_p=0.9, seed=2)]
    plain = Engine(step_model, num_blocks=200, block_size=4, cuda_graphs=False).generate(ps, sps)
    eng = device_step_engine(step_model, num_blocks=200, block_size=4, decode_steps=8)
    res = eng.generate(ps, sps)
    assert res[0].token_ids == alone(step_model, ps[0], 12)
    assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    assert eng.stats["multi_steps"] > 0 and eng.pool.num_free == eng.pool.num_blocks
    drawn = plain[1].token_ids
    m_eos = GPT2(replace(step_model.config, eos_token_id=drawn[4]), step_model.w, backend="torch")
    r = device_step_engine(m_eos, num_blocks=200, block_size=4, decode_steps=8).generate(
        [ps[1]], SamplingParams(max_new_tokens=12, temperature=0.9, seed=1))[0]
    assert r.token_ids == drawn[:drawn.index(drawn[4]) + 1] and r.finish_reason == "stop"

    ps = prompts(3, seed=14, lo=3, hi=8)
    eng = device_step_engine(step_model, num_blocks=9, block_size=4, decode_steps=8)  # little room to reserve
    res = eng.generate(ps, SamplingParams(max_new_tokens=9, ignore_eos=True))
    for p, r in zip(ps, res):
        assert r.token_ids == alone(step_model, p, 9)
    assert eng.pool.num_free == 9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_decode_matches_eager_and_padding_writes_nothing():
    m = tiny_model("triton", device="cuda")
    eng = Engine(m, num_blocks=64, block_size=4, cuda_graphs=True, max_num_seqs=8)
    assert eng.graphs is not None and eng.graphs.buckets[:4] == [1, 2, 4, 8]   # (then the prefill rows' buckets)
    ps = prompts(3, seed=9)
    for p in ps:                                 # 3 decodes run in the bucket of 4: one padding row
        eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
    eng.step()                                   # the prefills
    checked = 0
    while eng.has_unfinished():
        out = eng.scheduler.schedule()
        before = eng.pool.cache.clone()
        eager = eng.runner.eager([], [], out.decode_ids, out.decode_positions, out.decode_slots, out.context_lens,
                           out.decode_tables)
        torch.cuda.synchronize()
        after_eager = eng.pool.cache.clone()
        eng.pool.cache.copy_(before)
        pos = out.decode_positions
        eng.graphs.load(out.decode_ids, pos, [p + 1 for p in pos], [-1] * len(pos), out.decode_tables)
        graph = eng.graphs.run(len(pos), 1)
        greedy = eng.graphs.tokens(pos, 1)[0]
        torch.cuda.synchronize()
        # the graph wrote exactly what eager wrote (padding rows, slot -1, wrote nothing) ...
        assert torch.equal(eng.pool.cache, after_eager)
        # ... and its logits match eager's (the same kernels at another M: tf32 rounding may differ)
        torch.testing.assert_close(graph, eager, rtol=2e-3, atol=2e-3 * float(eager.abs().max()))
        assert greedy == graph.argmax(-1).tolist()
        eng.scheduler.update(out, greedy)
        checked += 1
    assert checked >= 10 and eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_multi_step_engine_equals_alone():
    """The captured path end to end: several replays per round trip, padding rows, arrivals, EOS."""
    m = tiny_model("triton", device="cuda")
    ps = prompts(6, seed=15)
    news = [3, 25, 8, 40, 1, 17]
    eng = Engine(m, num_blocks=200, block_size=4, cuda_graphs=True, max_num_seqs=8, decode_steps=8)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps[:4], news[:4])]
    eng.step()
    eng.step()
    reqs += [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps[4:], news[4:])]
    eng.run()
    assert eng.stats["multi_steps"] > 0
    for p, n, r in zip(ps, news, reqs):
        assert r.output_ids == alone(m, p, n), (p, n)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_step_out_argmax_takes_the_first_maximum_across_chunks():
    """The step's argmax runs in several programs per row: a maximum tied across chunks must give the
    first index (torch.argmax's), a padding row (pos -1) must stay as it is, and the tickets end at zero."""
    from tritune.model.engine import graphs as E

    dev, V, chunks, block = STEP_DEVICE, 100, 4, 32
    logits = torch.randn(3, V, device=dev)
    logits[0, 70] = logits[0, 40] = 9.0           # tie in chunks 2 and 1: index 40
    logits[1, 99] = 7.0                           # the last, partial chunk
    logits[2, 5] = 8.0                            # a padding row: nothing changes
    ids = torch.zeros(3, dtype=torch.int32, device=dev)
    pos = torch.tensor([3, 4, -1], dtype=torch.int32, device=dev)
    stop = torch.tensor([10, 5, 10], dtype=torch.int32, device=dev)
    eos = torch.full((3,), -1, dtype=torch.int32, device=dev)
    hist = torch.zeros((3, 4), dtype=torch.int32, device=dev)
    pv = torch.empty(3 * chunks, device=dev)
    pi = torch.empty(3 * chunks, dtype=torch.int32, device=dev)
    tickets = torch.zeros(3, dtype=torch.int32, device=dev)
    E._step_out_kernel[(3, chunks)](logits, logits.stride(0), V, ids, pos, stop, eos, hist, 4, pv, pi, tickets,
                                    CHUNKS=chunks, CHUNKS_P2=chunks, BLOCK_V=block, PDL=False)
    assert ids.tolist() == [40, 99, 0] and pos.tolist() == [4, -1, -1]   # row 1 reached its stop
    assert hist[0, 0].item() == 40 and hist[1, 1].item() == 99 and tickets.tolist() == [0, 0, 0]


def test_compile_log_names_each_jit_compile_and_restores_the_hook():
    """serve-bench's CompileLog: a Triton JIT cache miss inside a timed run is recorded (kernel, constexprs
    by name) and the run says so; the previous hook is back afterwards."""
    import triton

    from tritune.model.bench.serve_bench import CompileLog

    class _JF:
        arg_names = ["X", "N", "MODE"]

    class _Info:
        name = "tritune.kernels.x._k"
        jit_function = _JF()

    before = triton.knobs.runtime.jit_cache_hook
    with CompileLog() as log:
        skip = triton.knobs.runtime.jit_cache_hook(key=1, repr="_k[...]", fn=_Info(), is_manual_warmup=False,
                                                   compile={"constants": {(1,): 16, (2,): "ieee"}, "num_warps": 4},
                                                   already_compiled=False)
        assert skip is False  # never skips the compile
    assert triton.knobs.runtime.jit_cache_hook is before
    s = log.summary()
    assert s["count"] == 1 and s["by_kernel"] == {"_k": 1}
    assert s["first"][0]["constexprs"] == {"N": 16, "MODE": "ieee"} and s["first"][0]["num_warps"] == 4


# ---------------------------------------------------------------------------------------------------
# No compile inside a CUDA-graph capture
# ---------------------------------------------------------------------------------------------------
class _JitInfo:
    """What triton passes its jit_cache_hook as ``fn`` (name and argument names)."""

    def __init__(self, name):
        self.name = f"tritune.kernels.fake.{name}"
        self.jit_function = type("JF", (), {"arg_names": ["X", "N", "PDL"]})()


def _miss(name, **consts):
    """Triton's JIT on a kernel-cache miss: the hook first (which may veto or raise), then the compile."""
    import triton

    hook = triton.knobs.runtime.jit_cache_hook
    if hook is not None:
        hook(key=name, repr=f"{name}[...]", fn=_JitInfo(name), is_manual_warmup=False, already_compiled=False,
             compile={"constants": {(i + 1,): v for i, v in enumerate(consts.values())}, "num_warps": 4})


def _pdl_now():
    """kernels.pdl_now() on any torch: a CPU-only build cannot ask whether a stream is capturing (no
    stream is)."""
    from tritune import kernels as K

    try:
        return K.pdl_now("engine")
    except RuntimeError:
        return False


class _FakeStep:
    """A decode step whose launches go through a simulated JIT cache: a variant (bucket, PDL or not, and
    ``drift`` extra keys) compiles on first use. ``drift``: buckets whose variant changes on each call
    (a launch that specialises on something the warm-up cannot repeat)."""

    def __init__(self, drift=()):
        self.cache, self.calls, self.drift, self.pdl_seen = set(), {}, set(drift), []

    def __call__(self, b):
        from tritune import kernels as K

        pdl = _pdl_now()
        self.pdl_seen.append(pdl)
        self.calls[b] = self.calls.get(b, 0) + 1
        key = (b, pdl, self.calls[b] if b in self.drift else 0)
        if key not in self.cache:
            _miss("_step_kernel", N=b, PDL=pdl)
            self.cache.add(key)


def test_no_compiles_names_the_kernel_and_restores_the_hook():
    import triton

    from tritune.model.engine.graphs import CompileInCapture, no_compiles
    from tritune.model.bench.serve_bench import CompileLog

    before = triton.knobs.runtime.jit_cache_hook
    with CompileLog() as log:
        with pytest.raises(CompileInCapture, match=r"_gemv_kernel\[N=16, PDL=True, num_warps=4\].*capture"):
            with no_compiles("CUDA-graph capture of the decode step"):
                _miss("_gemv_kernel", N=16, PDL=True)
        assert log.summary()["by_kernel"] == {"_gemv_kernel": 1}     # the outer hook saw the miss first
        _miss("_other", N=1)                                          # outside the guard: compiles
    assert triton.knobs.runtime.jit_cache_hook is before
    assert log.summary()["count"] == 2


def test_prepare_capture_warms_the_pdl_variants_and_refuses_what_would_compile():
    """The warm-up runs what the capture records (PDL forced, as pdl_now gives inside a capture), so the
    capture compiles nothing; without forcing, the capture would have met the PDL variants (the crash this
    guards against); a variant that keeps changing is refused by the dry pass, before any capture."""
    from tritune import kernels as K
    from tritune.model.engine.graphs import CompileInCapture, no_compiles, prepare_capture

    if not K.PDL:
        pytest.skip("TRITUNE_PDL=0: no PDL variants")
    buckets = [1, 2, 4]
    step = _FakeStep()
    prepare_capture(buckets, step)
    assert step.pdl_seen == [True] * 6 and step.calls == {1: 2, 2: 2, 4: 2}   # warm-up, then the dry pass
    with K.pdl_forced(), no_compiles("capture"):      # the capture: pdl_now() holds inside it
        for b in buckets:
            step(b)
    assert not _pdl_now()                             # forcing ends with the warm-up

    old = _FakeStep()                                 # the warm-up before this guard: no PDL forced
    for b in buckets:
        old(b)
    with pytest.raises(CompileInCapture, match="PDL=True"):
        with K.pdl_forced(), no_compiles("capture"):
            old(1)

    with pytest.raises(CompileInCapture, match=r"_step_kernel\[N=2.*second warm-up pass"):
        prepare_capture(buckets, _FakeStep(drift={2}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graphs_stress_many_generations_and_engines_in_one_process():
    """generate() calls and engines with CUDA graphs, one process: prompt lengths, greedy and seeded
    sampling, bf16 / fp16 / fp32 and int4 weights (each a capture of its own); every call finishes and
    the CUDA context stays healthy (a capture that compiled inside itself used to invalidate it)."""
    from tritune.model.load import default_model_dir
    from tritune.model.engine.generate import generate
    from tritune.model.quant.ops import quantize_model

    models = {dt: tiny_model("triton", n_layer=2, n_embd=128, n_head=2, n_positions=256, device="cuda", dtype=dt)
              for dt in (torch.bfloat16, torch.float16, torch.float32)}
    models["int4"] = quantize_model(models[torch.bfloat16], "int4", group_size=64)
    d = default_model_dir()
    if d is not None:
        models["packaged bf16"] = GPT2.from_pretrained(d, backend="triton", dtype=torch.bfloat16, device="cuda")
    samplings = [dict(), dict(temperature=0.8, top_k=20, seed=1), dict(temperature=1.0, top_p=0.9, seed=2)]
    lens = [1, 7, 16, 33, 100, 200]
    calls = failures = 0
    for name, m in models.items():
        V = m.config.vocab_size
        for i in range(13 if name != "packaged bf16" else 8):
            P = lens[i % len(lens)]
            n = min(24, m.config.n_positions - P)
            p = [(7 * k + i) % (V - 1) for k in range(P)]
            try:
                r = generate(m, p, max_new_tokens=n, eos_token_id=None, **samplings[i % 3])
                assert len(r.tokens) == n and r.finish_reason == "length", (name, P, r.finish_reason)
                if i % 3 == 0 and i < 6:          # greedy: the same tokens again (a replayed graph)
                    assert generate(m, p, max_new_tokens=n, eos_token_id=None).tokens == r.tokens
            except Exception as e:  # noqa: BLE001 (count, then fail with every failure named)
                failures += 1
                print(f"FAILED generate {name} P={P}: {type(e).__name__}: {e}")
            calls += 1
        for quant in ((None, "int4") if name == torch.bfloat16 else (None,)):
            try:
                eng = Engine(m, num_blocks=256, block_size=16, max_num_seqs=8, cuda_graphs=True, quant=quant,
                             group_size=64)
                assert eng.graphs is not None and eng.graphs.graphs
                ps = [[(3 * k + j) % (V - 1) for k in range(lens[j % len(lens)])] for j in range(10)]
                sps = [SamplingParams(max_new_tokens=20, ignore_eos=True, **samplings[j % 3]) for j in range(10)]
                res = eng.generate(ps, sps)
                assert all(len(c.token_ids) == 20 for c in res) and eng.pool.num_free == eng.pool.num_blocks
                assert eng.stats["graph_steps"] > 0
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"FAILED engine {name} quant={quant}: {type(e).__name__}: {e}")
            calls += 1
    torch.cuda.synchronize()
    assert torch.ones(1, device="cuda").add(1).item() == 2      # the context is alive
    assert calls >= 50 and failures == 0, f"{failures} of {calls} calls failed"


def test_serve_bench_progress_and_cpu_defaults(monkeypatch):
    """serve-bench's bars: shown on a terminal, off under --quiet and when stdout is not a terminal; on
    the CPU the unset options take the CPU's defaults (the torch mode: the triton ones would run the
    kernels through the interpreter), explicit ones stay."""
    import argparse
    import sys

    from tritune.model.bench import serve_bench as S

    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert S.progress(10, "run", show=True).disable
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    with S.progress(10, "run", show=True) as bar:
        assert not bar.disable
    assert S.progress(10, "run", show=False).disable                # --quiet
    args = argparse.Namespace(modes=None, prompt_len=None, output_len=(5, 9), decode_tokens=None,
                              naive_requests=None, naive_tokens=None)
    S.fill_defaults(args, gpu=False)
    assert args.modes == "torch" and args.prompt_len == (16, 64) and args.output_len == (5, 9)
    assert args.decode_tokens == S.CPU_DEFAULTS["decode_tokens"] < S.GPU_DEFAULTS["decode_tokens"]


# ---------------------------------------------------------------------------------------------------
# One request's failure is its own
# ---------------------------------------------------------------------------------------------------
def test_generate_raise_keeps_the_context_limit_error(model):
    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False)
    sp = SamplingParams(max_new_tokens=4)
    with pytest.raises(ContextLimitError, match=r"prompts\[1\]: the prompt of 97 tokens") as e:
        eng.generate([[1, 2], list(range(97))], sp)
    assert e.value.prompt_len == 97 and "--truncate" in e.value.describe(truncate="--truncate")
    assert not eng.has_unfinished() and eng.pool.num_free == eng.pool.num_blocks


def test_sampling_params_are_checked_at_construction():
    from tritune.model.engine.sampling import TEMPERATURE_FLOOR

    bad = [(TypeError, "seed", dict(seed="abc")), (ValueError, "seed", dict(seed=2 ** 70)),
           (ValueError, "seed", dict(seed=-1)), (TypeError, "seed", dict(seed=True)),
           (TypeError, "seed", dict(seed=1.0)), (ValueError, "temperature", dict(temperature=float("inf"))),
           (ValueError, "temperature", dict(temperature=float("nan"))), (TypeError, "temperature", dict(temperature="1")),
           (TypeError, "top_k", dict(top_k=1.5)), (ValueError, "top_p", dict(top_p=1.5)),
           (TypeError, "top_p", dict(top_p=None)), (TypeError, "max_new_tokens", dict(max_new_tokens=2.0)),
           (ValueError, "stop", dict(stop=[""])), (TypeError, "stop", dict(stop=[3])),
           (TypeError, "stop_token_ids", dict(stop_token_ids=["a"])), (ValueError, "stop_token_ids", dict(stop_token_ids=[-2])),
           (TypeError, "ignore_eos", dict(ignore_eos="yes"))]
    for exc, name, kw in bad:
        with pytest.raises(exc, match=name):
            SamplingParams(**kw)
    assert SamplingParams(seed=2 ** 63 - 1).seed == 2 ** 63 - 1
    assert SamplingParams(temperature=1e-40).temperature == 0.0                 # below the floor: greedy
    assert SamplingParams(temperature=TEMPERATURE_FLOOR).temperature == TEMPERATURE_FLOOR
    assert SamplingParams(stop="x", stop_token_ids=[3]).stop == ("x",)


class FailingTokenizer:
    """decode() raises: only a request with stop strings is decoded by the engine."""

    def encode(self, text):
        return [1, 2, 3]

    def decode(self, ids):
        raise RuntimeError("cannot decode")


def _bad_request(kind):
    """(SamplingParams, stream) of one bad request of ``kind``."""
    if kind == "tiny-temperature":
        return SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1e-40), None
    if kind == "stop-string":
        return SamplingParams(max_new_tokens=8, ignore_eos=True, stop=("zz",)), None
    if kind == "stream":
        def stream(req, tok):
            if tok is not None and len(req.output_ids) == 3:
                raise RuntimeError("consumer failed")
        return SamplingParams(max_new_tokens=8, ignore_eos=True), stream
    assert kind == "non-finite"      # marked by top_k=7: the test's probs() returns nan for it
    return SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_k=7, seed=3), None


@pytest.mark.parametrize("cuda_graphs", [False, "eager"])
@pytest.mark.parametrize("kind", ["tiny-temperature", "stop-string", "stream", "non-finite"])
def test_a_bad_request_ends_alone_and_the_others_keep_their_bits(model, step_model, monkeypatch, kind, cuda_graphs):
    """The promise: the step's other rows go on bit for bit as they would have without the bad request. A
    row's bits follow what shares its step in the default mode (the GPU's GEMMs, the CPU's addmm pick their
    blocking by the batch), so the runs are batch-invariant: there a row's logits are its own whatever its
    neighbours are, and the run without the bad request is exactly what the others would have got."""
    from tritune.model.engine import invariant, sampling

    if cuda_graphs:     # the device-side step's kernels run where the model is: the GPU when there is one
        model = step_model

    real = sampling.probs

    def probs(logits, temperature, top_k=0, top_p=1.0):
        p = real(logits, temperature, top_k, top_p)
        return torch.full_like(p, float("nan")) if top_k == 7 else p

    monkeypatch.setattr(sampling, "probs", probs)
    ps = prompts(7, seed=11, lo=3, hi=12)
    # six good ones: greedy, and seeded sampling (their draws must not shift with the bad row's)
    good = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=100 + i)
            for i in range(6)]
    kw = dict(num_blocks=80, block_size=4, cuda_graphs=cuda_graphs, prefill_batching=False,
              tokenizer=FailingTokenizer(), decode_steps=4, batch_invariant=True)
    if cuda_graphs:
        kw["graph_buckets"] = (1, 2, 4, 8)

    def run(with_bad):
        eng = Engine(model, **kw)
        reqs = [eng.add_request(p, s) for p, s in zip(ps[:6], good)]
        bad = None
        if with_bad:
            sp, stream = _bad_request(kind)
            bad = eng.add_request(ps[6], sp, stream=stream)
        eng.run()
        assert eng.pool.num_free == eng.pool.num_blocks
        return [r.output_ids for r in reqs], bad, eng

    want, _, _ = run(False)
    got, bad, eng = run(True)
    assert got == want
    if kind == "tiny-temperature":
        assert bad.finish_reason == "length" and bad.output_ids == alone(invariant.invariant_model(model), ps[6], 8)
    else:
        assert bad.finish_reason == "error" and bad.error is not None, (bad.finish_reason, bad.error)
    if kind == "non-finite":
        assert "not finite" in str(bad.error) and eng.stats["request_errors"] == 1


def test_completion_text_failure_is_that_requests_own(model):
    class Tok(FailingTokenizer):
        def decode(self, ids):
            if 5 in ids:
                raise RuntimeError("cannot decode")
            return "ok"

    eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False, tokenizer=Tok())
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ps = prompts(4, seed=12)
    res = eng.generate(ps, sp)
    for p, r in zip(ps, res):
        assert r.token_ids == alone(model, p, 6)
        assert (r.text is None and "detokenizing" in r.error) if 5 in r.token_ids else r.text == "ok"


def test_engine_config_object_and_keywords_agree(model):
    from tritune.model.engine.config import EngineConfig

    cfg = EngineConfig(num_blocks=32, block_size=4, cuda_graphs=False, decode_steps=3)
    a = Engine(model, cfg)
    b = Engine(model, num_blocks=32, block_size=4, cuda_graphs=False, decode_steps=3)
    assert a.engine_config == b.engine_config == cfg and a.describe() == b.describe()
    c = Engine(model, cfg, max_num_seqs=2)                # a keyword overrides the config's field
    assert c.engine_config.max_num_seqs == 2 and c.engine_config.num_blocks == 32
    with pytest.raises(TypeError, match="num_blockz"):
        Engine(model, num_blockz=3)
    for kw, name in ((dict(decode_steps=0), "decode_steps"), (dict(max_num_seqs=True), "max_num_seqs"),
                     (dict(policy="lifo"), "policy"), (dict(cuda_graphs="yes"), "cuda_graphs"),
                     (dict(block_size=0), "block_size"), (dict(block_size=3), "block_size: expected a power of two"),
                     (dict(block_size=512), "block_size"), (dict(prefill_max_wait=-1), "prefill_max_wait"),
                     (dict(fused_decode="sometimes"), "fused_decode"), (dict(graph_prefill_work=0), "graph_prefill_work")):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**kw)
