"""``tritune.patch`` on Hugging Face Llama and Qwen2 models: RMSNorm, rotary, the fused qkv and SwiGLU
projections and causal attention on tritune's kernels, module by module. A tiny random model (fp32; head dim
32, so attention runs on tritune's kernel where no mask is built) against its unpatched float64 copy, within
the tolerance table's fp32 entry; greedy ``generate`` equal (dynamic and static caches, a left-padded batch
that takes the model's own attention with its mask)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.kernels.runtime import compare as cmp  # noqa: E402
from tritune.kernels.runtime import device as dev  # noqa: E402
from tritune.model import patch as hf_patch  # noqa: E402
from tritune.model import patch_llama as PL  # noqa: E402

DEVICE = dev.device()
TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny_dir(request, tmp_path_factory):
    cfg_cls, cls = FAMILIES[request.param]
    torch.manual_seed(0)
    extra = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}} if request.param == "llama" else {}
    model = cls(cfg_cls(**TINY, **extra))
    with torch.no_grad():  # RMSNorm weights are ones and Qwen2's qkv biases zeros at init: make them count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model.save_pretrained(path)
    return path


def _load(path, dtype=torch.float32):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """(patched fp32 model, unpatched float64 reference)."""
    return hf_patch.patch(_load(tiny_dir)), _load(tiny_dir, torch.float64)


def _ids(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, TINY["vocab_size"], (b, t), generator=g).to(DEVICE)


@torch.no_grad()
def test_logits_match_unpatched(pair, monkeypatch):
    model, ref = pair
    calls = []
    for name in ("linear", "attention"):
        monkeypatch.setitem(PL._ops(), name, _counting(PL._ops()[name], calls, name))
    ids = _ids(2, 11, 0)
    cmp.check(model(ids).logits, ref(ids).logits, torch.float32, what="prefill logits")
    # per layer: qkv, o_proj, gate/up (SwiGLU), down on the linear op; attention on tritune's
    L = TINY["num_hidden_layers"]
    assert calls.count("linear") == 4 * L and calls.count("attention") == L, calls


def _counting(fn, calls, name):
    def wrapped(*a, **k):
        calls.append(name)
        return fn(*a, **k)
    return wrapped


def test_patch_swaps_modules_in_place(tiny_dir):
    m = _load(tiny_dir)
    assert hf_patch.patch(m) is m and hf_patch.patch(m) is m  # idempotent
    layer = m.model.layers[0]
    assert layer.self_attn.forward.__func__ is PL._attn_forward
    assert layer.mlp.forward.__func__ is PL._mlp_forward
    assert layer.input_layernorm.forward.__func__ is PL._rms_forward
    assert m.model.norm.forward.__func__ is PL._rms_forward


def _generate(model, ids, **kw):
    out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_generate_matches_unpatched(pair, cache):
    model, ref = pair
    ids = _ids(3, 6, 1)
    kw = {} if cache == "dynamic" else {"cache_implementation": "static", "disable_compile": True}
    seq, logits = _generate(model, ids, **kw)
    want_seq, want = _generate(ref, ids, **kw)
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what=f"generate logits ({cache} cache)")


@torch.no_grad()
def test_generate_left_padded_batch(pair):
    model, ref = pair
    ids = _ids(2, 7, 2)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    seq, logits = _generate(model, ids, attention_mask=mask)
    want_seq, want = _generate(ref, ids, attention_mask=mask)
    assert torch.equal(seq, want_seq)
    cmp.check(logits, want, torch.float32, what="left-padded generate logits")


def test_training_and_grad_take_the_original_forward(tiny_dir):
    """Autograd on: the modules' own forwards (the kernels have no backward), so gradients are transformers'."""
    m, plain = hf_patch.patch(_load(tiny_dir)), _load(tiny_dir)
    ids = _ids(1, 5, 3)
    loss = m(ids, labels=ids).loss
    loss.backward()
    want = plain(ids, labels=ids).loss
    want.backward()
    assert torch.equal(loss, want)
    g, gw = m.model.layers[0].mlp.gate_proj.weight.grad, plain.model.layers[0].mlp.gate_proj.weight.grad
    assert torch.equal(g, gw)


@torch.no_grad()
def test_a_weight_edited_after_patch_is_seen(tiny_dir):
    m, plain = hf_patch.patch(_load(tiny_dir)), _load(tiny_dir)
    ids = _ids(1, 6, 4)
    m(ids)                                        # the concatenated weights made
    for model in (m, plain):
        model.model.layers[1].mlp.up_proj.weight.mul_(1.5)
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)
    cmp.check(m(ids).logits, plain(ids).logits, torch.float32, what="logits after an in-place edit")


def test_unsupported_options_refused_by_name():
    cfg = transformers.LlamaConfig(**{**TINY, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act"):
        hf_patch.patch(transformers.LlamaForCausalLM(cfg))
