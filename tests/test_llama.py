"""The Llama family (Llama, Qwen2, Qwen3, Mistral) against transformers on random-init checkpoints written with
``save_pretrained``: fp32 logits within the fp32 tolerance, greedy generation token for token where the
choice is clear, every rope scaling type, GQA ratios 1/2/4, tied and untied heads; the triton backend
(interpreter) on the smallest config; the engine running the model unchanged; bad configs refused by name."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import json

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.kernels.runtime import compare as cmp  # noqa: E402
from tritune.kernels.runtime import device as runtime_device  # noqa: E402
from tritune.model.llama import rope  # noqa: E402
from tritune.model.llama.config import LlamaConfig, UnsupportedModelError  # noqa: E402
from tritune.model.llama.model import load_model  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside the tests
from llama_helpers import VOCAB, assert_same_greedy, greedy, hf_greedy, prompt, randomize  # noqa: E402

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
# name -> (family, config overrides): hidden 64, 4 heads, GQA ratio 4 / KV heads
CASES = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa2-tied-linear": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-gqa4-dynamic": ("llama", dict(num_key_value_heads=1, max_position_embeddings=16,
                                         rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama-llama3-bias": ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, num_hidden_layers=1,
                                        max_position_embeddings=160,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 16})),
    "llama-yarn": ("llama", dict(num_key_value_heads=2, num_hidden_layers=1,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16})),
    "qwen2-gqa2-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-gqa7": ("qwen2", dict(hidden_size=112, num_attention_heads=7, num_key_value_heads=1, num_hidden_layers=1,
                                 max_position_embeddings=160)),
    "mistral-gqa4-window": ("mistral", dict(num_key_value_heads=1, sliding_window=48)),
    "qwen3-qk-norm": ("qwen3", dict(num_key_value_heads=2, head_dim=16, num_hidden_layers=1)),
    # head dim 32: the triton backend's attention kernels take it (16 stays on PyTorch)
    "llama-triton": ("llama", dict(num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                                   intermediate_size=64)),
}


def _hf_config(name):
    family, kw = CASES[name]
    args = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    args.update(kw)
    return getattr(transformers, FAMILIES[family][0])(**args), FAMILIES[family][1]


_MADE: dict = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (transformers model, checkpoint directory): random weights wide enough that greedy outputs
    vary, written once per module."""
    def make(name):
        if name not in _MADE:
            cfg, arch = _hf_config(name)
            torch.manual_seed(sorted(CASES).index(name))
            m = getattr(transformers, arch)(cfg).eval()
            randomize(m)
            d = tmp_path_factory.mktemp(name)
            m.save_pretrained(d)
            _MADE[name] = (m, d)
        return _MADE[name]

    yield make
    _MADE.clear()


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in CASES if n != "llama-triton"])
def test_fp32_logits_match_transformers(checkpoint, name):
    hf, d = checkpoint(name)
    model = load_model(d, backend="torch")
    seqs = [prompt(13, 1), prompt(5, 2)]
    got = model.forward(seqs)
    for s, g in zip(seqs, got):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0]
        cmp.check(g, want.double(), torch.float32, what=name)


@pytest.mark.parametrize("name", ["llama-mha", "llama-gqa4-dynamic", "qwen2-gqa2-tied", "mistral-gqa4-window",
                                  "llama-yarn", "qwen3-qk-norm"])
def test_greedy_matches_transformers_generate(checkpoint, name):
    """Prefill then paged decode; the dynamic case decodes past max_position_embeddings=16, where transformers
    grows the rope base token by token as the tables do."""
    hf, d = checkpoint(name)
    model = load_model(d, backend="torch")
    p = prompt(7, 3)
    n = 24
    theirs, clear = hf_greedy(hf, p, n)
    ours = greedy(model, p, n)
    assert len(set(ours)) > 3, ours       # varied outputs, or the equality proves little
    assert_same_greedy(ours, theirs, clear)


@pytest.mark.parametrize("name", ["qwen2-gqa7", "llama-llama3-bias"])
def test_greedy_128_tokens_match_transformers(checkpoint, name):
    hf, d = checkpoint(name)
    model = load_model(d, backend="torch")
    p = prompt(16, 5)
    n = min(128, model.config.n_positions - len(p))
    theirs, clear = hf_greedy(hf, p, n)
    assert_same_greedy(greedy(model, p, n), theirs, clear)


def test_rope_types_change_the_tables(checkpoint):
    """Each scaling type's tables differ from the default rope's (so the cases above test the scaling)."""
    base = LlamaConfig.from_file(checkpoint("llama-mha")[1] / "config.json")
    c0, _ = rope.tables(base, 40)
    for name in ("llama-gqa2-tied-linear", "llama-llama3-bias", "llama-yarn", "llama-gqa4-dynamic"):
        c = LlamaConfig.from_file(checkpoint(name)[1] / "config.json")
        cos, _ = rope.tables(c, 40)
        assert not torch.allclose(cos[:, :4], c0[:, :4]), name
    dyn = LlamaConfig.from_file(checkpoint("llama-gqa4-dynamic")[1] / "config.json")
    assert dyn.n_positions == 32 and torch.equal(rope.tables(dyn, 16)[0], rope.tables(base, 16)[0])


def test_config_reads_the_family_options(checkpoint):
    c = LlamaConfig.from_file(checkpoint("mistral-gqa4-window")[1] / "config.json")
    assert (c.n_kv_head, c.sliding_window, c.layer_windows, c.n_positions) == (1, 48, (48, 48), 64)
    c = LlamaConfig.from_file(checkpoint("qwen2-gqa2-tied")[1] / "config.json")
    assert c.qkv_bias and not c.o_bias and c.tie_word_embeddings and c.sliding_window is None
    c = LlamaConfig.from_file(checkpoint("qwen3-qk-norm")[1] / "config.json")
    assert c.qk_norm and c.head_dim == 16


def test_tied_head_shares_the_embedding(checkpoint):
    model = load_model(checkpoint("qwen2-gqa2-tied")[1], backend="torch")
    assert model.w.lm_head.data_ptr() == model.w.wte.data_ptr()


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d.update(model_type="gemma"), "model_type"),
    (lambda d: d.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "longrope"),
    (lambda d: d.update(rope_scaling={"type": "mystery", "factor": 2.0}, rope_parameters=None), "mystery"),
    (lambda d: d.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (lambda d: d.update(quantization_config={"quant_method": "gptq"}), "quantization_config"),
])
def test_unsupported_options_refused_by_name(checkpoint, edit, match):
    d = json.loads((checkpoint("llama-mha")[1] / "config.json").read_text())
    edit(d)
    with pytest.raises(UnsupportedModelError, match=match):
        LlamaConfig.from_dict(d)


def test_old_style_rope_scaling_keys():
    """Checkpoints written before transformers 5: rope_theta at the top, rope_scaling with "type"."""
    d = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             vocab_size=VOCAB, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
    c = LlamaConfig.from_dict(d)
    assert (c.rope.type, c.rope.theta, c.rope.factor) == ("linear", 5e5, 4.0)


def test_missing_tensor_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoint("llama-mha")[1]
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ValueError, match="up_proj"):
        load_model(tmp_path, backend="torch")


@pytest.mark.parametrize("name", ["llama-triton", "llama-gqa2-tied-linear"])
def test_triton_backend_matches_transformers(checkpoint, name):
    """The smallest config on the kernels (interpreter): rms_norm, rotary, gemm / gemv, varlen attention with
    2 query heads per KV head, the paged KV write and paged attention; at head dim 16, which the attention
    kernels do not take, the same through PyTorch's attention with the KV groups repeated."""
    hf, d = checkpoint(name)
    model = load_model(d, backend="triton", device=runtime_device.device())
    assert "kernel tritune.kernels.rotary" in model.backend_report()
    p = prompt(9, 4)
    with torch.no_grad():
        want = hf(torch.tensor([p])).logits[0]
    cmp.check(model.forward([p])[0], want.double(), torch.float32, what="triton prefill")
    theirs, clear = hf_greedy(hf, p, 6)
    assert_same_greedy(greedy(model, p, 6), theirs, clear)


def test_engine_runs_the_model_unchanged(checkpoint):
    """Continuous batching over the paged pool (GQA: the pool holds the KV heads): each request's greedy
    tokens are those it gets alone."""
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    model = load_model(checkpoint("qwen2-gqa2-tied")[1], backend="torch")
    ps = [prompt(n, 10 + n) for n in (3, 11, 6, 9)]
    eng = Engine(model, num_blocks=64, block_size=4, max_num_seqs=3, cuda_graphs=False)
    assert eng.pool.n_kv_heads == 2
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in ps]
    while eng.has_unfinished():
        eng.step()
    for p, r in zip(ps, reqs):
        assert r.output_ids == greedy(model, p, 8)


def test_engine_prefix_cache_and_chunked_prefill(checkpoint):
    """Requests sharing a prefix (a prefix-cache hit attends to cached K/V of 2 query heads per KV head) and
    long prompts cut into chunks get the tokens they get alone."""
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    model = load_model(checkpoint("qwen2-gqa2-tied")[1], backend="torch")
    shared = prompt(12, 20)
    ps = [shared + prompt(n, 30 + n) for n in (2, 5, 3)]
    eng = Engine(model, num_blocks=64, block_size=4, max_num_seqs=2, cuda_graphs=False,
                 enable_chunked_prefill=True, max_batch_tokens=8)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in ps]
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.stats["hit_blocks"] > 0
    for p, r in zip(ps, reqs):
        assert r.output_ids == greedy(model, p, 6)


def test_families_registry_loads_every_model_type(checkpoint):
    from tritune.model.llama.model import Llama
    from tritune.model.load import load_model as load_any

    for name in ("llama-mha", "qwen2-gqa2-tied", "mistral-gqa4-window", "qwen3-qk-norm"):
        m = load_any(checkpoint(name)[1], backend="torch", dtype=torch.float32)
        assert isinstance(m, Llama) and m.config.model_type == CASES[name][0]


def test_engine_on_the_triton_backend(checkpoint):
    """The engine's eager steps on the kernels (interpreter): prefills and decodes sharing a forward."""
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    model = load_model(checkpoint("llama-triton")[1], backend="triton", device=runtime_device.device())
    ps = [prompt(5, 40), prompt(3, 41)]
    eng = Engine(model, num_blocks=32, block_size=4, max_num_seqs=2, cuda_graphs=False)
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in ps]
    while eng.has_unfinished():
        eng.step()
    for p, r in zip(ps, reqs):
        assert r.output_ids == greedy(model, p, 4)


def test_generate_cli_on_a_llama_checkpoint(tmp_path):
    """``tritune generate --model DIR`` on a Llama checkpoint with its tokenizer.json (byte-level BPE): the
    family is found by model_type, and the text is the model's own greedy tokens decoded; with
    ``--speculative ngram`` the same text."""
    import subprocess
    import sys

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainers.BpeTrainer(
        vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=64,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(7)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.25)
    hf.save_pretrained(tmp_path)
    prompt = "the quick brown"
    ids = tok.encode(prompt).ids
    want = prompt + tok.decode(greedy(load_model(tmp_path, backend="torch"), ids, 6))
    for extra in ([], ["--speculative", "ngram"]):
        r = subprocess.run([sys.executable, "-c", "import sys; from tritune.harness.cli import main; sys.exit(main())",
                            "generate", prompt, "--model", str(tmp_path), "--max-new-tokens", "6", "--temperature",
                            "0", "--backend", "torch", "--dtype", "fp32", *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.rstrip("\n") == want, (extra, r.stdout, want)


def test_qwen2_sliding_layers_recorded():
    """Qwen2 with use_sliding_window: the layers past max_window_layers slide (tests/test_llama_window.py runs
    them). Without use_sliding_window the window field is ignored, as transformers does."""
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   use_sliding_window=True, sliding_window=32, max_window_layers=1)
    c = LlamaConfig.from_dict(cfg.to_dict())
    assert (c.sliding_window, c.layer_windows, c.n_positions) == (32, (None, 32), 64)
    cfg.use_sliding_window = False
    cfg.layer_types = ["full_attention"] * 2
    c = LlamaConfig.from_dict(cfg.to_dict())
    assert (c.sliding_window, c.layer_windows, c.n_positions) == (None, (), 64)
