"""fp32 follows torch.get_float32_matmul_precision(); bf16 is right (or refused) under the interpreter.

- "highest" (torch's default): IEEE fp32 dots (``input_precision="ieee"``), held to the "ieee" fp32
  tolerance; "high"/"medium": tf32 allowed, the "tf32" tolerance, and tuned configs keyed "tfloat32".
- the launch plans and the config cache follow a change of the setting between calls.
- bf16 through the interpreter computes what the GPU computes (kernels/_interpret_bf16.py), or a launch
  raises an error naming the limitation.
- on a GPU: a GPT-2-small-sized fp32 model greedy-decodes as transformers fp32 does, logits within 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from tritune import kernels as K
from tritune.kernels.runtime import compare as cmp
from tritune.kernels.runtime import device as dev
from tritune.kernels import attention as A
from tritune.kernels import gemm as G
from tritune.kernels import paged_attention as PA

DEVICE = dev.device()


@pytest.fixture
def precision():
    """Set torch's fp32 matmul precision for one test; restored after."""
    old = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("setting, want, key, acc", [("highest", "ieee", "float32", "ieee"),
                                                     ("high", "tf32", "tfloat32", "tf32"),
                                                     ("medium", "tf32", "tfloat32", "tf32")])
def test_setting_names_dot_precision_store_key_and_tolerance(precision, setting, want, key, acc):
    precision(setting)
    assert K.fp32_precision() == want
    assert K.store_dtype(torch.float32) == key
    assert K.store_dtype(torch.bfloat16) == "bfloat16" and K.store_dtype(torch.float16) == "float16"
    for spec in (G.SPEC, A.SPEC, A.VARLEN_SPEC, PA.SPEC):
        assert spec.accumulation(torch.float32) == acc, spec.name
        assert spec.accumulation(torch.bfloat16) == "ieee", spec.name


def _gemm_plan(a, b):
    G.gemm(a, b)
    key = next(k for k in G._PLANS if k[0] == a.shape and k[4] == b.shape and k[-1] == K.precision_key(a.dtype))
    return G._PLANS[key]


def test_gemm_launch_follows_the_setting_between_calls(precision):
    a = torch.randn(5, 24, device=DEVICE)
    b = torch.randn(24, 7, device=DEVICE)
    precision("highest")
    p1 = _gemm_plan(a, b)
    precision("high")
    p2 = _gemm_plan(a, b)
    precision("highest")
    p3 = _gemm_plan(a, b)
    assert p1.kws[0][0]["PRECISION"] == "ieee" and p3 is p1
    assert p2.kws[0][0]["PRECISION"] == "tf32" and p2 is not p1
    assert p1.cfg_key[2] == "float32" and p2.cfg_key[2] == "tfloat32"
    # half precision operands: the setting changes nothing
    h = a.half(), b.half()
    precision("high")
    ph = _gemm_plan(*h)
    assert ph.kws[0][0]["PRECISION"] == "ieee" and ph.cfg_key[2] == "float16"


def test_attention_and_paged_launches_follow_the_setting(precision):
    q = torch.randn(1, 2, 17, 32, device=DEVICE)
    k = torch.randn(1, 2, 20, 32, device=DEVICE)
    for setting, ieee in (("highest", True), ("high", False)):
        precision(setting)
        A._PLANS.clear()   # the plan read below is this call's (an earlier test may hold one under its key)
        A.attention(q, k, k)
        plan = list(A._PLANS.values())[-1]
        assert plan.meta["IEEE"] is ieee
    case = PA.SPEC.make_inputs(PA.SPEC.small_problems[0], torch.float32, DEVICE, 0)
    for setting, want in (("highest", "ieee"), ("medium", "tf32")):
        precision(setting)
        PA._PLANS.clear()
        PA.SPEC.run(*case.args, **case.kwargs)
        plan = list(PA._PLANS.values())[-1]
        assert plan.meta["PRECISION"] == want


def test_store_lookup_is_keyed_by_precision(precision, monkeypatch):
    from tritune.kernels.runtime import store

    asked = []
    monkeypatch.setattr(store, "lookup", lambda kernel, bucket, dtype, *a, **k: asked.append(dtype))
    K.clear_config_cache()
    p = G.Problem(3, 40, 24)
    try:
        for setting in ("highest", "high"):
            precision(setting)
            G.SPEC.config_for(p, torch.float32)
        G.SPEC.config_for(p, torch.bfloat16)
    finally:
        K.clear_config_cache()
    assert asked == ["float32", "tfloat32", "bfloat16"]


@pytest.mark.parametrize("name", ["gemm", "attention", "attention_varlen", "paged_attention"])
def test_fp32_highest_matches_float64_at_ieee_tolerance(precision, name):
    precision("highest")
    spec = K.get(name)
    for problem in spec.small_problems:
        case = spec.make_inputs(problem, torch.float32, DEVICE, 3)
        if isinstance(case.out, torch.Tensor):
            cmp.poison(case.out)
        got = spec.run(*case.args, out=case.out, **case.kwargs)
        cmp.check(got, spec.reference(*case.args, **case.kwargs), torch.float32, "ieee", what=f"{name} {problem}")


# ---------------------------------------------------------------------------------------------------
# bf16 under the interpreter
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not dev.interpreted(), reason="interpreter only")
def test_interpreter_bf16_arithmetic_is_right():
    from tritune.kernels.runtime import interpret_bf16 as I

    assert I.check() is None
    x = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, float("inf"), 1e-40])  # ties, sign, inf, subnormal
    assert torch.equal(torch.from_numpy(I.to_bf16(x.numpy()).view("int16")).view(torch.bfloat16), x.to(torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 50, generator=g).bfloat16()
    b = torch.randn(50, 29, generator=g).bfloat16()
    got = G.gemm(a, b, activation="gelu_tanh")
    cmp.check(got, G.ref.gemm(a, b, activation="gelu_tanh"), torch.bfloat16)


@pytest.mark.skipif(not dev.interpreted(), reason="interpreter only")
def test_interpreter_bf16_refused_clearly_when_it_cannot_be_computed(monkeypatch):
    from tritune.kernels.runtime import interpret_bf16 as I

    monkeypatch.setattr(I, "check", lambda: "a probe said so")
    a = torch.randn(4, 8).bfloat16()
    with pytest.raises(NotImplementedError, match=r"gemm: bfloat16 needs a GPU.*interpreter.*11584"):
        G.gemm(a, torch.randn(8, 8).bfloat16(), config=G.default_config(G.Problem(4, 8, 8), torch.bfloat16))


# ---------------------------------------------------------------------------------------------------
# GPU: fp32 GPT-2 (12 layers, 768 wide, random init std 0.1) greedy-decodes as transformers fp32
# ---------------------------------------------------------------------------------------------------
GREEDY_TOKENS = 128
TIE_GAP = 1e-3        # fp64's top-2 logit gap below which either token is a right answer
LOGITS_REL = 1e-4


def greedy_against_transformers(tmp_path, device, n_layer, n_embd, n_head, vocab, tokens):
    """Greedy-decode ``tokens`` tokens with our fp32 model (prefill, then decode steps through the paged
    cache) and with transformers' fp32 GPT2LMHeadModel on the same random init (std 0.1). Returns (first
    position where the tokens differ or None, fp64's top-2 logit gap there, the largest relative error of
    a decode step's logits against fp64, the same for a teacher-forced prefill of the whole sequence)."""
    import transformers

    from tritune.model.gpt2 import model as M

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=1024, vocab_size=vocab,
                                  initializer_range=0.1)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path)
    hf = hf.to(device)
    hf64 = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float64).to(device).eval()
    ours = M.GPT2.from_pretrained(tmp_path, backend="triton", dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (8,), generator=g).tolist()

    with torch.no_grad():  # transformers fp32, greedy
        ids = torch.tensor([prompt], device=device)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()

    total = len(prompt) + tokens
    cache = ours.new_cache(total, block_size=16)
    table = torch.arange(cache.num_blocks, dtype=torch.int32, device=device)[None]
    logits = ours.prefill(torch.tensor(prompt, device=device), [len(prompt)], kv_cache=cache,
                          slot_mapping=torch.arange(len(prompt), device=device))
    mine, step_logits = [], []
    for j in range(tokens):
        step_logits.append(logits[0].double())
        tok = int(logits[0].argmax())
        mine.append(tok)
        pos = len(prompt) + j
        if j + 1 < tokens:
            logits = ours.decode(torch.tensor([tok], device=device), torch.tensor([pos], device=device), cache,
                                 torch.tensor([pos], device=device), table,
                                 torch.tensor([pos + 1], dtype=torch.int32, device=device))

    with torch.no_grad():  # fp64 along our sequence: the truth for every step and the gap where we differ
        truth = hf64(torch.tensor([prompt + mine], device=device)).logits[0, len(prompt) - 1:-1]
    err = max(cmp.rel_error(s, t) for s, t in zip(step_logits, truth))
    full = ours.prefill(torch.tensor(prompt + mine, device=device), [total], all_logits=True)
    err_prefill = cmp.rel_error(full[len(prompt) - 1:-1].double(), truth)
    first = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    gap = None
    if first is not None:
        top2 = truth[first].topk(2).values
        gap = float(top2[0] - top2[1])
    print(f"fp32 GPT-2 {n_layer}x{n_embd} greedy: {tokens if first is None else first} of {tokens} tokens equal to "
          f"transformers'; first difference at {first} (fp64 top-2 gap {gap}); logits rel error vs fp64: "
          f"decode steps max {err:.2e}, prefill {err_prefill:.2e}")
    return first, gap, err, err_prefill


def test_fp32_tiny_gpt2_greedy_matches_transformers(precision, tmp_path):
    """The GPU test's procedure on a tiny model, through the interpreter on the CPU."""
    precision("highest")
    first, gap, err, err_prefill = greedy_against_transformers(tmp_path, "cpu" if dev.interpreted() else "cuda",
                                                               n_layer=1, n_embd=64, n_head=2, vocab=128, tokens=4)
    assert first is None or gap <= TIE_GAP
    assert err <= LOGITS_REL and err_prefill <= LOGITS_REL


@pytest.mark.gpu
def test_fp32_gpt2_greedy_and_logits_match_transformers(precision, tmp_path):
    """GPT-2 small's shape (12 layers, 768 wide, 50257 tokens), random init std 0.1, 128 greedy tokens under
    "highest": our tokens equal transformers' wherever fp64's top-2 gap exceeds 1e-3, logits within 1e-4
    of fp64 (relative)."""
    precision("highest")
    first, gap, err, err_prefill = greedy_against_transformers(tmp_path, "cuda", n_layer=12, n_embd=768, n_head=12,
                                                               vocab=50257, tokens=GREEDY_TOKENS)
    assert first is None or gap <= TIE_GAP, f"greedy token {first} differs where fp64's top-2 gap is {gap:.2e}"
    assert err <= LOGITS_REL and err_prefill <= LOGITS_REL, (err, err_prefill)
