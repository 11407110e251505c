"""Tensor parallelism on GPUs (NCCL, the triton backend, CUDA graphs captured on every rank): two GPUs give one
GPU's greedy tokens, identical in fp32 and in bf16 up to the first step whose top-2 logit gap is within the
rounding limit (the harness's bf16 tolerance of the logits' scale). Skipped where fewer than two GPUs are
visible (the CPU's gloo tests are tests/test_tensor_parallel.py)."""
from __future__ import annotations

import pytest
import torch

from tritune.kernels.runtime.compare import tolerance
from tritune.model.engine.engine import Engine
from tritune.model.engine.sampling import SamplingParams
from tritune.model.llama import weights as LW
from tritune.model.llama.config import LlamaConfig
from tritune.model.llama.model import Llama
from tritune.model.load import default_model_dir
from tritune.model.gpt2.model import GPT2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

GREEDY = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=40, seed=11, ignore_eos=True)


def llama(dtype):
    """A random Llama-shaped model: GQA 16/4, an untied head, a vocabulary two ranks divide unevenly."""
    c = LlamaConfig(model_type="llama", n_layer=3, n_head=16, n_kv_head=4, n_embd=512, d_mlp=1408, n_positions=1024,
                    vocab_size=5001, head_dim=32)
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(s, generator=g) * 0.05 if len(s) > 1 else 1 + 0.1 * torch.randn(s, generator=g))
             for k, s in LW.expected_shapes(c).items()}
    return Llama(c, LW.to_layout(c, state, dtype, "cuda"), backend="triton")


def gpt2(dtype):
    d = default_model_dir()
    if d is None:
        pytest.skip("no packaged GPT-2 checkpoint")
    return GPT2.from_pretrained(d, backend="triton", dtype=dtype, device="cuda")


def prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (40, 7, 129)]


def run(model, tp, *params):
    """Each ``params``' tokens for the prompts, one engine of ``tp`` ranks, and the paths its steps took."""
    eng = Engine(model, tensor_parallel=tp, num_blocks=256, max_num_seqs=8)
    try:
        assert eng.runner.graphs is not None, eng.notes
        out = [[c.token_ids for c in eng.generate(prompts(model.vocab_size), p)] for p in params]
        return out, dict(eng.path_counts)
    finally:
        eng.close()


def first_gap_at_divergence(model, prompt, ours, ref):
    """The one-GPU model's top-2 logit gap, relative to its logits' largest magnitude, at the first token where
    the two runs differ (None: they do not)."""
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if i is None:
        return None
    ids = torch.tensor(prompt + ref[:i], device="cuda")
    logits = model.prefill(ids, [len(ids)]).float()[-1]
    top = torch.topk(logits, 2).values
    return float((top[0] - top[1]) / logits.abs().max())


@pytest.mark.parametrize("make", [llama, gpt2])
def test_fp32_two_gpus_give_one_gpus_tokens(make):
    model = make(torch.float32)
    one, _ = run(model, 1, GREEDY, SAMPLED)
    two, paths = run(model, 2, GREEDY, SAMPLED)
    assert two == one
    assert paths.get("graph", 0) > 0, paths


def test_bf16_two_gpus_match_one_gpu_up_to_a_tie():
    model = llama(torch.bfloat16)
    (one,), _ = run(model, 1, GREEDY)
    (two,), _ = run(model, 2, GREEDY)
    limit = tolerance(torch.bfloat16)
    for p, a, b in zip(prompts(model.vocab_size), two, one):
        gap = first_gap_at_divergence(model, p, a, b)
        assert gap is None or gap <= limit, f"diverged where the one-GPU top-2 gap is {gap:.3g} > {limit}"
