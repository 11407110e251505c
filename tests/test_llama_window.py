"""Sliding-window attention in the Llama family against transformers: Mistral (every layer slides) and Qwen2
(``use_sliding_window``: the layers from ``max_window_layers`` on), on random-init checkpoints written with
``save_pretrained``, where prompt + generation run well past the window. The torch backend (SDPA with the
window's mask) and the triton backend (varlen prefill and paged decode with ``window``, interpreter)."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.kernels.runtime import compare as cmp  # noqa: E402
from tritune.kernels.runtime import device as runtime_device  # noqa: E402
from tritune.model.llama.config import LlamaConfig  # noqa: E402
from tritune.model.llama.model import load_model  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside the tests
from llama_helpers import VOCAB, assert_same_greedy, greedy, hf_greedy, prompt, randomize  # noqa: E402

# name -> (config class, model class, overrides); windows of 6 and 7 tokens: not a multiple of the cache's
# 4-token blocks, so a window starts inside a block
CASES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=7)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=True,
                                                       sliding_window=6, max_window_layers=1)),
    # head dim 32: the triton backend's attention kernels take it
    "mistral-triton": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=2, num_key_value_heads=1,
                                                                   num_hidden_layers=1, intermediate_size=64,
                                                                   sliding_window=6)),
}
_MADE: dict = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    def make(name):
        if name not in _MADE:
            cfg_cls, arch, kw = CASES[name]
            args = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
                        pad_token_id=None)
            args.update(kw)
            torch.manual_seed(sorted(CASES).index(name) + 11)
            m = getattr(transformers, arch)(getattr(transformers, cfg_cls)(**args)).eval()
            randomize(m)
            d = tmp_path_factory.mktemp(name)
            m.save_pretrained(d)
            _MADE[name] = (m, d)
        return _MADE[name]

    yield make
    _MADE.clear()


def _full_attention_logits(hf, seq):
    """transformers' logits with the window switched off: what a model without one would give."""
    saved, hf.config.sliding_window = hf.config.sliding_window, 10 ** 6
    try:
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0]
    finally:
        hf.config.sliding_window = saved


# ---------------------------------------------------------------------------------------------------
def test_layer_windows_from_the_config(checkpoint):
    m = LlamaConfig.from_file(checkpoint("mistral")[1] / "config.json")
    assert (m.sliding_window, m.layer_windows, m.n_positions) == (7, (7, 7), 64)
    q = LlamaConfig.from_file(checkpoint("qwen2")[1] / "config.json")
    assert (q.sliding_window, q.layer_windows, q.n_positions) == (6, (None, 6), 64)
    # an older config.json without layer_types: use_sliding_window + max_window_layers, as transformers
    base = dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, sliding_window=5, use_sliding_window=True)
    assert LlamaConfig.from_dict(dict(base, max_window_layers=2)).layer_windows == (None, None, 5)
    assert LlamaConfig.from_dict(dict(base, max_window_layers=3)).layer_windows == ()
    assert LlamaConfig.from_dict(dict(base, use_sliding_window=False)).layer_windows == ()
    # Llama has no window in transformers, whatever its config holds
    llama = dict(base, model_type="llama")
    assert LlamaConfig.from_dict(llama).layer_windows == () and LlamaConfig.from_dict(llama).sliding_window is None


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_fp32_logits_past_the_window_match_transformers(checkpoint, name):
    """Sequences three to five windows long, packed: every position's logits as transformers' (which differ
    from full attention's there, so the window is really applied)."""
    hf, d = checkpoint(name)
    model = load_model(d, backend="torch")
    seqs = [prompt(31, 1), prompt(9, 2), prompt(3, 3)]
    got = model.forward(seqs)
    for s, g in zip(seqs, got):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0]
        cmp.check(g, want.double(), torch.float32, what=name)
    assert not torch.allclose(got[0].cpu(), _full_attention_logits(hf, seqs[0]), atol=1e-3)


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_greedy_past_the_window_matches_transformers_generate(checkpoint, name):
    """A prompt of twice the window, then 24 tokens: the paged decode reads only each window's blocks."""
    hf, d = checkpoint(name)
    model = load_model(d, backend="torch")
    p = prompt(14, 5)
    theirs, clear = hf_greedy(hf, p, 24)
    assert_same_greedy(greedy(model, p, 24), theirs, clear)


def test_triton_backend_window_matches_transformers(checkpoint):
    """The kernels (interpreter): varlen prefill with window=6 over a 13-token prompt, paged decode with it."""
    hf, d = checkpoint("mistral-triton")
    model = load_model(d, backend="triton", device=runtime_device.device())
    seqs = [prompt(13, 7), prompt(4, 8)]
    for s, g in zip(seqs, model.forward(seqs)):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0]
        cmp.check(g, want.double(), torch.float32, what="triton prefill")
    p = prompt(11, 9)
    theirs, clear = hf_greedy(hf, p, 8)
    assert_same_greedy(greedy(model, p, 8), theirs, clear)
    torch_model = load_model(d, backend="torch")
    assert greedy(model, p, 8) == greedy(torch_model, p, 8)


def test_sequences_past_the_window_run_and_the_engine_stays_within_it(checkpoint):
    """prefill/decode take sequences up to n_positions (max_position_embeddings); the engine, whose
    attention callbacks pass no window yet, is told the smallest window as its longest context."""
    model = load_model(checkpoint("mistral")[1], backend="torch")
    assert model.config.n_positions == 64 and model.max_context == 7
    assert model.prefill(torch.zeros(64, dtype=torch.long), [64]).shape == (1, VOCAB)
    with pytest.raises(ValueError, match="n_positions=64"):
        model.prefill(torch.zeros(65, dtype=torch.long), [65])
