"""GPTQ-layout INT8 / INT4 checkpoints of the Llama family: `tritune quantize` writes them (rtn, gptq), the
family's loader runs them on the quant kernels, with q/k/v and gate/up fused as the dense model fuses them."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.harness.cli import main as cli  # noqa: E402
from tritune.model.llama.model import Llama, load_model  # noqa: E402
from tritune.model.load import load_model as load_any  # noqa: E402
from tritune.model.quant import llama_hf  # noqa: E402
from tritune.model.quant import ops as quant_ops  # noqa: E402
from tritune.model.quant import quantize as QZ  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside the tests
from llama_helpers import VOCAB, prompt, randomize  # noqa: E402


def _checkpoint(tmp_path_factory, kind, seed, **fields):
    """A random 2-layer checkpoint written by transformers (every K a multiple of 32: int4 groups)."""
    cfg_cls, cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if kind == "qwen2"
                    else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    cfg = cfg_cls(hidden_size=64, vocab_size=VOCAB, max_position_embeddings=64, num_attention_heads=4,
                  num_hidden_layers=2, intermediate_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  **fields)
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    randomize(m)
    d = tmp_path_factory.mktemp(kind)
    m.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A random Qwen2 (q/k/v biases, GQA 2, untied head), every K a multiple of 32 (int4 groups)."""
    return _checkpoint(tmp_path_factory, "qwen2", seed=0, num_key_value_heads=2, tie_word_embeddings=False)


def dequantized_reference(dense_dir, quantized, dense_state: bool = False):
    """The dense model with each fused linear replaced by the quantized one's exact weight (``dense_state``:
    ``dense_dir`` is the quantized checkpoint: its norms and biases, the linears from ``quantized``)."""
    if dense_state:
        ref = Llama(quantized.config, quantized.w, backend="torch")
    else:
        ref = load_model(dense_dir, backend="torch", dtype=torch.float32, device="cpu")
    layers = []
    for Ld, Lq in zip(ref.w.layers, quantized.w.layers):
        layers.append(type(Ld)(**{**vars(Ld), **{k: getattr(Lq, k).dequantize(torch.float32).t().contiguous()
                                                  for k in llama_hf.FUSED}}))
    return ref.with_weights(type(ref.w)(**{**vars(ref.w), "layers": layers}))


@pytest.mark.parametrize("bits", [4, 8])
def test_rtn_checkpoint_runs_exactly_its_quantized_weights(qwen2, tmp_path, bits):
    out = llama_hf.quantize_checkpoint(qwen2, tmp_path / "q", QZ.QuantSpec("rtn", bits, 32), progress=False)
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["bits"], q["lm_head"]) == ("gptq", bits, False)
    m = load_any(out, backend="torch", dtype=torch.float32, device="cpu")
    assert type(m).__name__ == "Llama" and m.w.layers[0].w_qkv.N == (4 + 2 * 2) * 16
    ids = torch.tensor(prompt(20, 1))
    got = m.prefill(ids, [20], all_logits=True)
    want = dequantized_reference(qwen2, m).prefill(ids, [20], all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # round to nearest per output row: the same codes as the engine's load-time swap of the dense model
    # (the swap also rounds the LM head, which the checkpoint keeps dense)
    dense = load_model(qwen2, backend="torch", dtype=torch.float32, device="cpu")
    w = quant_ops.quantize_weights(dense.w, f"int{bits}", 32)
    swapped = quant_ops.with_quantized_weights(dense, type(w)(**{**vars(w), "lm_head": dense.w.lm_head}))
    torch.testing.assert_close(got, swapped.prefill(ids, [20], all_logits=True), rtol=1e-5, atol=1e-5)


def test_gptq_on_the_packaged_llama_and_the_cli(tmp_path):
    """GPTQ int4 through the CLI on the packaged model's calibration text (its intermediate size, 704, takes
    64-wide groups): closer to the dense model than round-to-nearest, within 1% of its perplexity."""
    from tritune.model.eval import evaluate

    out = tmp_path / "g4"
    assert cli(["quantize", "llama", "--method", "gptq", "--n-samples", "8", "--seq-len", "64", "--out", str(out),
                "--quiet"]) == 0
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"]) == ("gptq", 4, 128)
    res = evaluate("llama", ["fp32", "int4-rtn", str(out)], max_windows=4, decode=False, progress=False,
                   act_dtype=torch.float32)
    ppl = {r["row"]: r["perplexity"] for r in res["rows"]}
    assert ppl[str(out)] <= ppl["int4-rtn"] and abs(ppl[str(out)] / ppl["fp32"] - 1) < 0.01, ppl


def test_fusing_refuses_projections_that_disagree(qwen2, tmp_path):
    out = llama_hf.quantize_checkpoint(qwen2, tmp_path / "q", QZ.QuantSpec("rtn", 4, 32), progress=False)
    c, w, _ = llama_hf.load(out)
    a = w.layers[0].w_o
    b = llama_hf.load(llama_hf.quantize_checkpoint(qwen2, tmp_path / "q8", QZ.QuantSpec("rtn", 8), progress=False))[1]
    with pytest.raises(ValueError, match="differ in bits"):
        llama_hf.fuse([a, b.layers[0].w_o], "layers.0.w_x")


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def llama(request, tmp_path_factory):
    """A random Llama, grouped KV heads or not (AWQ folds v into o only without grouping)."""
    return _checkpoint(tmp_path_factory, "llama", seed=1, num_key_value_heads=request.param, tie_word_embeddings=True)


def test_awq_folds_scales_and_runs_exactly_what_it_wrote(llama, tmp_path):
    """AWQ int4 on calibration windows: the checkpoint (AWQ's gemm layout, folded norms) runs exactly its
    dense tensors and dequantized linears, and its error against the dense model is no larger than
    round-to-nearest's on held-out prompts."""
    spec = QZ.QuantSpec("awq", 4, 32)
    ids = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(3))
    qws, dense = llama_hf.quantize_layers(llama, spec, ids, progress=False)
    out = llama_hf.write(tmp_path / "awq", llama, dense, qws, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                               "zero_point": True, "version": "gemm", "lm_head": False})
    m = load_any(out, backend="torch", dtype=torch.float32, device="cpu")
    ids = torch.tensor(prompt(24, 5))
    got = m.prefill(ids, [24], all_logits=True)
    torch.testing.assert_close(got, dequantized_reference(out, m, dense_state=True).prefill(ids, [24], all_logits=True),
                               rtol=1e-4, atol=1e-4)
    base = load_model(llama, backend="torch", dtype=torch.float32, device="cpu").prefill(ids, [24], all_logits=True)
    rtn = load_any(llama_hf.quantize_checkpoint(llama, tmp_path / "rtn", QZ.QuantSpec("rtn", 4, 32), progress=False),
                   backend="torch", dtype=torch.float32, device="cpu").prefill(ids, [24], all_logits=True)
    err = lambda x: float((x - base).norm() / base.norm())   # noqa: E731
    assert err(got) <= 1.05 * err(rtn), (err(got), err(rtn))


def test_the_triton_backend_runs_the_fused_quantized_linears(tmp_path):
    """q/k/v and gate/up fused from their GPTQ tensors, on the quant kernels (the GPU's, or the interpreter's on a
    machine without one)."""
    from tritune.kernels.runtime import device as dev

    cfg = transformers.Qwen2Config(hidden_size=64, vocab_size=VOCAB, max_position_embeddings=64, num_attention_heads=2,
                                   num_key_value_heads=1, num_hidden_layers=1, intermediate_size=96, head_dim=32,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(2)
    m = transformers.Qwen2ForCausalLM(cfg).eval()
    randomize(m)
    m.save_pretrained(tmp_path / "dense")
    out = llama_hf.quantize_checkpoint(tmp_path / "dense", tmp_path / "q", QZ.QuantSpec("rtn", 4, 32), progress=False)
    ids = torch.tensor(prompt(10, 1))
    want = load_any(out, backend="torch", dtype=torch.float32, device="cpu").prefill(ids, [10], all_logits=True)
    got = load_any(out, backend="triton", dtype=torch.float32, device=dev.device()).prefill(ids.to(dev.device()), [10],
                                                                                     all_logits=True)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_with_a_quantized_lm_head(tmp_path):
    """GPTQ checkpoints written with "lm_head": true: the head runs quantized, as the load-time swap's."""
    from tritune.model.llama import weights as LW
    from tritune.model.quant import hf as hf_quant

    cfg = transformers.Qwen2Config(hidden_size=64, vocab_size=96, max_position_embeddings=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=1, intermediate_size=96,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(4)
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    randomize(hf)
    qwen2 = tmp_path / "dense"
    hf.save_pretrained(qwen2)
    qws, _ = llama_hf.quantize_layers(qwen2, QZ.QuantSpec("rtn", 8), None, progress=False)
    dense = LW.load_state_dict(qwen2)
    qws["lm_head"] = QZ.rtn(dense["lm_head.weight"].float(), QZ.QuantSpec("rtn", 8), 64)
    out = llama_hf.write(tmp_path / "h", qwen2, dense, qws, {"quant_method": "gptq", "bits": 8, "group_size": -1,
                                                          "checkpoint_format": "gptq", "lm_head": True})
    m = load_any(out, backend="torch", dtype=torch.float32, device="cpu")
    assert isinstance(m.w.lm_head, hf_quant.Q.QuantizedWeight)
    base = load_model(qwen2, backend="torch", dtype=torch.float32, device="cpu")
    swapped = quant_ops.quantize_model(base, "int8")
    ids = torch.tensor(prompt(12, 4))
    torch.testing.assert_close(m.prefill(ids, [12], all_logits=True), swapped.prefill(ids, [12], all_logits=True),
                               rtol=1e-5, atol=1e-5)
