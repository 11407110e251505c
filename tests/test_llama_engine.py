"""Everything the engine does for GPT-2, on a Llama-family model (random-init checkpoints written with
transformers): continuous batching, prefix caching, chunked prefill, n-gram speculative decoding, the
device-side decode step run eagerly (``cuda_graphs="eager"``: the graph path's host and device logic on the
CPU), batch-invariant mode, int8/int4 weight-only quantization and several EOS ids, on the torch backend and
on the triton backend (interpreter). Each request's greedy tokens are those the model gives it alone through
its own prefill and paged decode."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import json
from dataclasses import replace

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.kernels.runtime import compare as cmp  # noqa: E402
from tritune.kernels.runtime.device import device as kernel_device  # noqa: E402
from tritune.model.engine import fused_decode as FD  # noqa: E402
from tritune.model.engine.engine import Engine, forward_step  # noqa: E402
from tritune.model.engine.scheduler import SamplingParams  # noqa: E402
from tritune.model.llama.model import load_model  # noqa: E402
from tritune.model.quant import ops as Q  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside the tests
from llama_helpers import VOCAB, greedy, prompt, randomize  # noqa: E402

# backend -> transformers config: GQA (2 query heads per KV head); head dim 16 on torch, 32 on triton (the
# attention kernels' smallest), one layer there to keep the interpreter quick
CONFIGS = {
    "torch": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2,
                                                      num_hidden_layers=2, intermediate_size=96)),
    "triton": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=2, num_key_value_heads=1,
                                                       num_hidden_layers=1, intermediate_size=64)),
}


def write_checkpoint(directory, backend, seed=0, generation_eos=None):
    """A random-init checkpoint (norms near 1, weights wide enough that greedy outputs vary)."""
    cfg_cls, arch, kw = CONFIGS[backend]
    cfg = getattr(transformers, cfg_cls)(hidden_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                         tie_word_embeddings=False, **kw)
    torch.manual_seed(seed)
    m = getattr(transformers, arch)(cfg).eval()
    randomize(m)
    m.save_pretrained(directory)
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return directory


@pytest.fixture(scope="module", params=["torch", "triton"])
def model(request, tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    # the Triton kernels (the triton backend's, and the device-side step's that cuda_graphs="eager" runs on
    # either backend) run where the model is: the kernels' device (the CPU under the interpreter)
    return load_model(d, backend=request.param, device=kernel_device())


def run_all(eng, ps, max_new, **sp):
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=max_new, ignore_eos=True, **sp)) for p in ps]
    eng.run()
    assert eng.pool.num_free == eng.pool.num_blocks
    return [r.output_ids for r in reqs]


# ---------------------------------------------------------------------------------------------------
def test_continuous_batching_and_the_device_side_step(model):
    """More requests than seats, on the eager forward and on the device-side decode step (run eagerly:
    the embedding from ``w.wte`` alone, positions from the context lengths, the greedy token fed back on
    the device for several steps per sync)."""
    ps = [prompt(n, 10 + n) for n in (3, 7, 5)]
    want = [greedy(model, p, 5) for p in ps]
    eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs=False)
    assert run_all(eng, ps, 5) == want
    eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs="eager", decode_steps=3)
    assert eng.runner.graphs is not None
    assert run_all(eng, ps, 5) == want


def test_prefix_cache_and_chunked_prefill(model):
    """Requests sharing a prefix hit the cache (2 query heads per KV head read the cached K/V), and a long
    prompt cut into chunks gets the tokens it gets alone."""
    shared = prompt(12, 20)
    ps = [shared + prompt(n, 30 + n) for n in (2, 5)]
    eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=1, cuda_graphs=False,
                 enable_chunked_prefill=True, max_batch_tokens=8)
    assert run_all(eng, ps, 4) == [greedy(model, p, 4) for p in ps]
    assert eng.pool.stats["hit_blocks"] > 0


def test_ngram_speculative_decoding(model):
    """Prompt-lookup speculation: host-side verification and the device-side speculative step (eager),
    both equal to plain greedy."""
    ps = [prompt(40, 50), prompt(30, 51)]       # long enough that the outputs' tokens occur in them
    want = [greedy(model, p, 6) for p in ps]
    for graphs in (False, "eager"):
        eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs=graphs, speculative="ngram")
        assert run_all(eng, ps, 6) == want, graphs
        assert eng.stats["spec_proposed"] > 0


def test_draft_model_speculative_decoding(model):
    """A Llama draft (the target's first layer: early exit; the checkpoint itself through ``make_proposer``,
    loaded by its family) on its own paged pool of the draft's KV heads, host-side and device-side (eager):
    the target's greedy tokens."""
    from tritune.model.engine.spec_decode import DraftModelProposer, early_exit_draft, make_proposer

    if model.n_layers < 2:
        pytest.skip("an early-exit draft needs two layers")
    ps = [prompt(10, 55), prompt(7, 56)]
    want = [greedy(model, p, 6) for p in ps]
    for graphs in (False, "eager"):
        for prop in (DraftModelProposer(early_exit_draft(model, 1), k=3, block_size=4),
                     make_proposer("draft", model, draft=model.directory, block_size=4)):
            eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs=graphs, speculative=prop)
            assert run_all(eng, ps, 6) == want, (graphs, prop.name)
            assert prop.pool.n_kv_heads == model.n_kv_heads
    assert eng.stats["spec_accepted"] == eng.stats["spec_proposed"] > 0     # the target drafting itself


def test_batch_invariant(model):
    """A request's logits, bit for bit, alone and batched with others (rms_norm, rotary, SwiGLU and
    grouped-query attention row by row / on pinned configs)."""
    ps = [prompt(n, 60 + n) for n in (4, 6, 3)]
    logged = {}

    def engine():
        eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=3, cuda_graphs=False, batch_invariant=True)
        base = eng.sampler

        class Rec:
            def __call__(self, reqs, logits):
                for r, row in zip(reqs, logits):
                    logged.setdefault(tuple(r.prompt_ids), []).append(row.float().clone())
                return base(reqs, logits)

            def __getattr__(self, name):
                return getattr(base, name)

        eng.sampler = Rec()
        return eng

    batched = run_all(engine(), ps, 4)
    together = {k: v for k, v in logged.items()}
    logged.clear()
    alone = [run_all(engine(), [p], 4)[0] for p in ps]
    assert batched == alone == [greedy(model, p, 4) for p in ps]
    for p in ps:
        a, b = together[tuple(p)], logged[tuple(p)]
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_weight_only_quant(model, quant):
    """``quant=`` swaps the family's projections (LINEARS of llama.weights) and the LM head: the engine's
    logits are a dense model's on the dequantized weights, and its tokens the quantized model's greedy."""
    eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs=False, quant=quant, group_size=32)
    L = eng.model.w.layers[0]
    assert all(isinstance(getattr(L, k), Q.Q.QuantizedWeight) for k in ("w_qkv", "w_o", "w_gu", "w_down"))

    def deq(t):
        return t.dequantize(torch.float32).t().contiguous() if hasattr(t, "dequantize") else t

    qw = eng.model.w
    dense = model.with_weights(replace(qw, lm_head=deq(qw.lm_head), layers=[
        replace(L, **{k: deq(getattr(L, k)) for k in ("w_qkv", "w_o", "w_gu", "w_down")}) for L in qw.layers]))
    dev = model.device
    ids = torch.tensor(prompt(7, 70), device=dev)
    T = len(ids)
    want = dense.prefill(ids, [T], all_logits=True)
    got = forward_step(eng.model, eng.pool, ids, torch.arange(T, device=dev), torch.arange(T, device=dev),
                       seq_lens=[T], cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=dev))
    cmp.check(got.cpu(), want.double().cpu(), torch.float32, what=f"{quant} engine logits")
    ps = [prompt(n, 71 + n) for n in (3, 5)]
    assert run_all(eng, ps, 4) == [greedy(eng.model, p, 4) for p in ps]


def test_several_eos_ids(tmp_path):
    """generation_config.json's EOS list (Llama-3: end of text and end of turn) on top of config.json's
    single id: a request stops at any of them, on the eager path and the device-side step."""
    d = write_checkpoint(tmp_path, "torch", seed=3)
    model = load_model(d, backend="torch")
    p = prompt(5, 80)
    toks = greedy(model, p, 8)
    stop_at = next(i for i in range(2, 8) if toks[i] not in toks[:i])
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = (toks[0] + 1) % VOCAB if (toks[0] + 1) % VOCAB not in toks else VOCAB - 1
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [cfg["eos_token_id"], toks[stop_at]]}))
    model = load_model(d, backend="torch")
    assert model.eos_token_ids == (cfg["eos_token_id"], toks[stop_at])
    for graphs in (False, "eager"):
        eng = Engine(model, num_blocks=32, block_size=4, cuda_graphs=graphs, decode_steps=4)
        r = eng.add_request(p, SamplingParams(max_new_tokens=8))
        eng.run()
        assert r.output_ids == toks[:stop_at + 1] and r.finish_reason == "stop", graphs
    # the device-side step itself stops a row at any of its EOS ids (here the second)
    g = eng.runner.graphs
    assert g.NE == 2
    blocks = list(range(4))
    g.load([p[-1]], [len(p)], [len(p) + 4], [-1], [blocks])
    g.run(1, 1)
    first = g.tokens([len(p)], 1)[0][0]
    g.load([p[-1]], [len(p)], [len(p) + 4], [(VOCAB + 5, first)], [blocks])
    g.run(1, 3)
    assert int(g.pos[0]) == -1 and g.tokens([len(p)], 1)[0][0] == first


def test_fused_decode_says_not_for_this_family(model):
    """The fused persistent decode step is GPT-2's layer: refused by name, not an AttributeError."""
    assert "not for this family" in FD.why_not(model)
    assert FD.choose(model, None, True, 8)[0] is False
    eng = Engine(model, num_blocks=16, block_size=4, cuda_graphs="eager", fused_decode=True)
    assert any("fused decode off: not for this family" in n for n in eng.notes)


def test_compiled_decode(model):
    """``compile=True``: on the torch backend the family's own compiled decode (layer and head under
    torch.compile, rotary inside), the tokens greedy's; on the triton backend refused with a note."""
    eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs=False, compile=True)
    if model.backend == "triton":
        assert eng.runner.compiled is None and any("compile off" in n for n in eng.notes)
        return
    assert eng.runner.compiled is not None
    ps = [prompt(n, 95 + n) for n in (3, 6, 4)]
    assert run_all(eng, ps, 4) == [greedy(model, p, 4) for p in ps]


@pytest.mark.gpu
def test_captured_decode_graphs_on_the_gpu(tmp_path):
    """CUDA graphs of the decode step (and of the speculative step) on a Llama model: the captured
    embedding reads ``w.wte`` alone."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    d = write_checkpoint(tmp_path, "triton")
    model = load_model(d, backend="triton", device="cuda")
    ps = [prompt(n, 90 + n) for n in (3, 6, 4)]
    want = [greedy(model, p, 6) for p in ps]
    eng = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, cuda_graphs=True)
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs
    assert run_all(eng, ps, 6) == want
    eng = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, cuda_graphs=True, speculative="ngram")
    assert run_all(eng, ps, 6) == want


def test_gpt2s_quantizer_refuses_the_family_by_model_type(tmp_path):
    """GPT-2's quantizer calibrates through GPT-2's block: a Llama checkpoint is refused by its model_type
    before any work (the family's own is tritune.model.quant.llama_hf; tests/test_llama_quantize.py)."""
    from tritune.model.quant.quantize import QuantSpec, quantize_checkpoint

    d = write_checkpoint(tmp_path / "ckpt", "torch")
    for method in ("gptq", "awq"):
        with pytest.raises(ValueError, match="model_type"):
            quantize_checkpoint(d, tmp_path / method, QuantSpec(method=method), progress=False)
