"""GPT-2 on tritune: loading, the forward against ``transformers``, generation, the CLI, bad checkpoints.

The truth is ``transformers``' GPT2LMHeadModel with random (seeded) weights, saved with save_pretrained
and loaded by tritune. Two configs: "small" (GPT-2 small's sizes on a GPU; a 2-layer model of the same
shape kind under the interpreter) and "odd" (n_head 3, n_embd 96, a vocab that is not a multiple of 64).

Tolerances: fp32 with exact fp32 arithmetic (the torch backend; the triton backend under the
interpreter) is held to the table's (fp32, "ieee") entry for the whole model. Where the arithmetic is
rounded (bf16; fp32 GEMMs through tf32 tensor cores on a GPU), rounding errors compound over the layers,
so a single op's table entry says nothing about a 12-layer model; the yardstick is ``transformers``
itself at the same precision: our error against the fp32 truth may be at most twice transformers' own
(and never has to beat the table's entry).
"""
from __future__ import annotations

import contextlib
import json
import shutil

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import pytest
import torch

from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime.compare import rel_error, tolerance

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tritune.model.gpt2 import model as G  # noqa: E402
from tritune.model.gpt2.config import GPT2Config, UnsupportedModelError  # noqa: E402
from tritune.model.engine.generate import engine_for, generate, stream  # noqa: E402
from tritune.model.engine.sampling import check_sampling, sample  # noqa: E402
from tritune.model.engine.scheduler import ContextLimitError  # noqa: E402
from tritune.model.tokenizer import Tokenizer  # noqa: E402

GPU = not dev.interpreted() and torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BACKENDS = ("torch", "triton")

# GPU: GPT-2 small itself. Interpreter: every kernel runs in Python, so 2 layers and a few hundred tokens.
CONFIGS = {
    "small": (dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257) if GPU else
              dict(n_layer=2, n_head=2, n_embd=64, n_positions=128, vocab_size=320)),
    "odd": dict(n_layer=4 if GPU else 2, n_head=3, n_embd=96, n_positions=256 if GPU else 128,
                vocab_size=5003 if GPU else 1001),
}
# transformers' default init (0.02) makes near-uniform logits and a greedy run that repeats one token;
# 0.1 gives varied tokens, so the greedy comparison means something ("small" keeps the default).
INIT = {"small": 0.02, "odd": 0.1}
PROMPT_LENS = [33, 1, 100, 17] if GPU else [7, 1, 12]
DECODE_STEPS = 8 if GPU else 3
BLOCK_SIZE = 16 if GPU else 4


def greedy_tokens(backend: str) -> int:
    return 64 if GPU or backend == "torch" else 10


# ---------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------
def _hf_model(sizes: dict, init: float, seed: int = 0, **extra):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(**sizes, initializer_range=init, bos_token_id=0, eos_token_id=0, **extra)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, the fp32 transformers model on DEVICE)."""
    out = {}
    for name, sizes in CONFIGS.items():
        d = tmp_path_factory.mktemp(f"gpt2-{name}")
        hf = _hf_model(sizes, INIT[name])
        hf.save_pretrained(d)
        out[name] = (d, hf.to(DEVICE))
    return out


_models = {}


def load(d, backend, dtype=torch.float32):
    key = (str(d), backend, dtype)
    if key not in _models:
        _models[key] = G.GPT2.from_pretrained(d, backend=backend, dtype=dtype, device=DEVICE)
    return _models[key]


@contextlib.contextmanager
def hf_tf32(on: bool):
    if not GPU:
        yield
        return
    m = torch.backends.cuda.matmul
    old = m.allow_tf32
    m.allow_tf32 = on
    try:
        yield
    finally:
        m.allow_tf32 = old


@torch.no_grad()
def hf_logits(hf, seqs, tf32=False):
    with hf_tf32(tf32):
        return [hf(torch.tensor([s], device=DEVICE)).logits[0].float() for s in seqs]


def accumulation(backend: str, dtype) -> str:
    """'tf32' where our fp32 GEMMs run on tf32 tensor cores: the triton backend's gemm on a GPU."""
    if backend == "triton" and dtype == torch.float32 and GPU and G.ops_for("triton")._gemm is not None:
        return "tf32"
    return "ieee"


def bound(hf, d, seqs, dtype, acc, truth):
    """The allowed relative error of our logits against ``truth`` (see the module docstring)."""
    if dtype == torch.float32 and acc == "ieee":
        return tolerance(torch.float32, "ieee"), None
    if dtype == torch.float32:  # tf32: transformers with tf32 matmuls
        theirs = hf_logits(hf, seqs, tf32=True)
    else:
        hfl = transformers.GPT2LMHeadModel.from_pretrained(d, dtype=dtype).to(DEVICE).eval()
        theirs = hf_logits(hfl, seqs)
    hf_err = rel_error(torch.cat(theirs), torch.cat(truth))
    return max(tolerance(dtype, acc), 2 * hf_err), hf_err


def skip_unsupported(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and not GPU:
        pytest.skip("bf16 on the triton backend needs a GPU: tl.dot on bf16 operands returns garbage under "
                    "the Triton interpreter (triton 3.9)")


# ---------------------------------------------------------------------------------------------------
# logits: a batch of prompts of different lengths, packed prefill, then batched decode steps that read
# the paged cache through shuffled block tables
# ---------------------------------------------------------------------------------------------------
def _block_tables(lens, block_size, seed):
    """Each sequence's blocks, drawn from one shuffled pool (interleaved, out of order)."""
    need = [-(-n // block_size) for n in lens]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()  # a few blocks never used
    tables, i = [], 0
    for k in need:
        tables.append(perm[i:i + k])
        i += k
    return tables, sum(need) + 3


def _slot(table, pos, bs):
    return table[pos // bs] * bs + pos % bs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, name, backend, dtype):
    skip_unsupported(backend, dtype)
    d, hf = checkpoints[name]
    m = load(d, backend, dtype)
    V, bs = m.config.vocab_size, BLOCK_SIZE
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in PROMPT_LENS]
    fed = [torch.randint(0, V, (DECODE_STEPS,), generator=g).tolist() for _ in PROMPT_LENS]
    full = [p + f for p, f in zip(prompts, fed)]
    tables, num_blocks = _block_tables([len(s) for s in full], bs, seed=2)
    cache = G.PagedKVCache(m.config, num_blocks, bs, m.dtype, m.device)
    dev_ = m.device

    # prefill: the prompts packed into one call, every position's logits
    slots = [_slot(t, p, bs) for t, pr in zip(tables, prompts) for p in range(len(pr))]
    pre = m.prefill(torch.tensor([t for p in prompts for t in p], device=dev_), [len(p) for p in prompts],
                    kv_cache=cache, slot_mapping=torch.tensor(slots, device=dev_), all_logits=True)
    ours = list(pre.float().split([len(p) for p in prompts]))
    # decode: one token per sequence per step
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev_)
    steps = []
    for j in range(DECODE_STEPS):
        pos = [len(p) + j for p in prompts]
        logits = m.decode(torch.tensor([f[j] for f in fed], device=dev_), torch.tensor(pos, device=dev_), cache,
                          torch.tensor([_slot(t, p, bs) for t, p in zip(tables, pos)], device=dev_), bt,
                          torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev_))
        steps.append(logits.float())
    # prefill gave positions 0..P-1, decode step j position P+j: every position of the full sequences
    for b in range(len(prompts)):
        ours[b] = torch.cat([ours[b]] + [s[b:b + 1] for s in steps])
    truth = hf_logits(hf, full)
    assert [o.shape for o in ours] == [t.shape for t in truth]
    err = rel_error(torch.cat(ours), torch.cat(truth))
    tol, hf_err = bound(hf, d, full, dtype, accumulation(backend, dtype), truth)
    per_seq = [rel_error(o, t) for o, t in zip(ours, truth)]
    msg = (f"{name} {backend} {dtype}: logits rel error {err:.3e} (bound {tol:.1e}"
           f"{'' if hf_err is None else f'; transformers at this precision: {hf_err:.3e}'}), "
           f"per sequence {[f'{e:.1e}' for e in per_seq]}")
    print(msg)
    assert err <= tol, msg
    # the next-token choice agrees wherever transformers' top two are not a near tie
    truth_all, ours_all = torch.cat(truth), torch.cat(ours)
    top2 = truth_all.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (ours_all - truth_all).abs().max()
    assert torch.equal(ours_all.argmax(-1)[clear], truth_all.argmax(-1)[clear]), msg


# ---------------------------------------------------------------------------------------------------
# greedy generation against transformers.generate
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(checkpoints, name, backend):
    d, hf = checkpoints[name]
    m = load(d, backend)
    n = greedy_tokens(backend)
    prompt = torch.randint(0, m.config.vocab_size, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = generate(m, prompt, max_new_tokens=n, eos_token_id=None)
    assert ours.finish_reason == "length" and len(ours.tokens) == n
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    if accumulation(backend, torch.float32) == "ieee":
        assert ours.tokens == theirs, f"{name} {backend}: greedy tokens differ from transformers'"
        return
    # fp32 GEMMs on tf32 tensor cores: equal, except that a step where transformers' top two logits lie
    # within our measured logit error of each other may pick the other one (and the texts part there).
    seq = prompt + ours.tokens
    truth = hf_logits(hf, [seq[:-1]])[0][len(prompt) - 1:]
    mine = m.forward([seq[:-1]])[0].float()[len(prompt) - 1:]
    tol, _ = bound(hf, d, [seq[:-1]], torch.float32, "tf32", [hf_logits(hf, [seq[:-1]])[0]])
    assert rel_error(mine, truth) <= tol
    for i, tok in enumerate(ours.tokens):
        gap = float(truth[i].max() - truth[i, tok])
        err = float((mine[i] - truth[i]).abs().max())
        assert gap <= 2 * err, (f"{name} {backend}: step {i} chose {tok}, transformers' logit for it is "
                                f"{gap:.3e} below the max, more than twice our max logit error {err:.3e}")
    same = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs)) if a != b), n)
    print(f"{name} {backend} (tf32): identical to transformers for {same} of {n} tokens")


def test_generate_matches_own_forward(checkpoints):
    """The paged decode path and a full recompute pick the same tokens (triton: the decode kernels)."""
    d, _ = checkpoints["odd"]
    for backend in BACKENDS:
        m = load(d, backend)
        r = generate(m, [1, 2, 3], max_new_tokens=4, eos_token_id=None)
        seq = [1, 2, 3]
        for t in r.tokens:
            assert int(m.forward([seq])[0][-1].argmax()) == t
            seq.append(t)


@pytest.mark.parametrize("backend", BACKENDS if GPU else ("torch",))
def test_graph_decode_equals_plain_loop(checkpoints, backend):
    """The device-side decode step (a CUDA graph with the triton backend on the GPU, the same step run
    eagerly otherwise), one step ahead of the host, picks the plain loop's tokens: greedy, seeded
    sampling (drawn between replays), EOS mid-run (the step already queued is dropped), a full context."""
    m = load(checkpoints["odd"][0], backend)
    n_pos = m.config.n_positions
    for kw in (dict(), dict(temperature=0.8, top_k=40, seed=7), dict(temperature=1.0, top_p=0.9, seed=8)):
        for prompt in ([3, 1, 4], list(range(n_pos - 5))):
            n = min(20, n_pos - len(prompt))       # the second prompt runs up to the full context
            a = generate(m, prompt, max_new_tokens=n, eos_token_id=None, cuda_graph=False, **kw)
            b = generate(m, prompt, max_new_tokens=n, eos_token_id=None, cuda_graph=True, **kw)
            assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), kw
    free = generate(m, [9, 8, 7], max_new_tokens=16, eos_token_id=None, cuda_graph=True).tokens
    eos = free[5]
    r = generate(m, [9, 8, 7], max_new_tokens=16, eos_token_id=eos, cuda_graph=True)
    assert r.tokens == free[:free.index(eos) + 1] and r.finish_reason == "eos"
    if GPU and backend == "triton":
        assert engine_for(m).graphs is not None and engine_for(m).graphs.graphs   # captured, not eager


# ---------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------
def test_sample_top_k_top_p_restrict_support():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 2
    many = logits.repeat(300, 1)                 # 300 draws per row in one call
    draws = sample(many, 1.5, top_k=3, generator=g).view(300, 6)
    top3 = logits.topk(3, dim=-1).indices
    for r in range(6):
        assert set(draws[:, r].tolist()) == set(top3[r].tolist())   # only the top 3, and all of them
    p = 0.6
    probs = logits.softmax(-1)
    draws = sample(many, 1.0, top_p=p, generator=g).view(300, 6)
    for r in range(6):
        sp, order = probs[r].sort(descending=True)
        k = int((sp.cumsum(0) - sp < p).sum())      # the smallest head reaching p
        assert set(draws[:, r].tolist()) <= set(order[:k].tolist())
        assert len(set(draws[:, r].tolist())) > 1 or k == 1
    assert torch.equal(sample(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(sample(logits, 5.0, top_p=1e-6, generator=g), logits.argmax(-1))
    assert torch.equal(sample(logits, 0.0), logits.argmax(-1))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=True), dict(top_k=-1), dict(top_k=1.5),
                                 dict(top_p=0), dict(top_p=1.5)])
def test_bad_sampling_args(bad):
    args = dict(temperature=1.0, top_k=0, top_p=1.0) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        check_sampling(**args)


def test_seeded_sampling_repeats(checkpoints):
    m = load(checkpoints["odd"][0], "torch")
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, eos_token_id=None)
    a = generate(m, [5, 6, 7], seed=123, **kw).tokens
    b = generate(m, [5, 6, 7], seed=123, **kw).tokens
    c = generate(m, [5, 6, 7], seed=124, **kw).tokens
    assert a == b and a != c


# ---------------------------------------------------------------------------------------------------
# stopping, context, streaming (torch backend: the loop, not the kernels)
# ---------------------------------------------------------------------------------------------------
def test_stop_on_eos(checkpoints):
    m = load(checkpoints["odd"][0], "torch")
    free = generate(m, [9, 8, 7], max_new_tokens=12, eos_token_id=None).tokens
    eos = free[4]
    k = free.index(eos)
    r = generate(m, [9, 8, 7], max_new_tokens=12, eos_token_id=eos)
    assert r.tokens == free[:k + 1] and r.finish_reason == "eos"


def test_max_new_tokens(checkpoints):
    m = load(checkpoints["odd"][0], "torch")
    for n in (1, 2, 7):
        r = generate(m, [4], max_new_tokens=n, eos_token_id=None)
        assert len(r.tokens) == n and r.finish_reason == "length"
        assert r.timings.new_tokens == n
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            generate(m, [4], max_new_tokens=bad)


def test_prompt_longer_than_context(checkpoints):
    m = load(checkpoints["odd"][0], "torch")
    P = m.config.n_positions
    long = [(7 * i) % m.config.vocab_size for i in range(P + 5)]
    with pytest.raises(ContextLimitError, match="n_positions"):
        generate(m, long, max_new_tokens=3)
    r = generate(m, long, max_new_tokens=3, truncate=True, eos_token_id=None)
    assert r.truncated == len(long) - (P - 3) and r.prompt_ids == long[-(P - 3):]   # room for the 3 new tokens
    assert r.tokens == generate(m, long[-(P - 3):], max_new_tokens=3, eos_token_id=None).tokens
    assert r.finish_reason == "length"
    with pytest.raises(ValueError, match="empty"):
        generate(m, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(m, [m.config.vocab_size], max_new_tokens=3)


def test_context_limit_is_the_engines(checkpoints):
    """prompt + max_new_tokens must fit n_positions: generate() refuses what the engine refuses, with the
    same error, instead of stopping early; at the limit it runs to max_new_tokens."""
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams

    m = load(checkpoints["odd"][0], "torch")
    P = m.config.n_positions
    with pytest.raises(ContextLimitError, match="lower it to max_new_tokens=3") as alone:
        generate(m, list(range(P - 3)), max_new_tokens=50)
    with pytest.raises(ContextLimitError) as engine:
        Engine(m, num_blocks=64, cuda_graphs=False).add_request(list(range(P - 3)), SamplingParams(max_new_tokens=50))
    assert str(alone.value) == str(engine.value)
    with pytest.raises(ContextLimitError, match="leaves no room"):
        generate(m, [1, 2], max_new_tokens=P, truncate=True)
    r = generate(m, list(range(P - 3)), max_new_tokens=3, eos_token_id=None)
    assert r.finish_reason == "length" and len(r.tokens) == 3


def test_streaming_yields_as_produced(checkpoints):
    """Each token is yielded as soon as the engine's step that made it returns: the first after the
    prefill step alone, the next after one decode step (the torch backend steps one token at a time)."""
    m = load(checkpoints["odd"][0], "torch")
    g = stream(m, [1, 2], max_new_tokens=5, eos_token_id=None)
    steps = g.engine.stats
    s0 = steps["steps"]
    it = iter(g)
    first = next(it)
    assert g.result.tokens == [first.token] and steps["steps"] - s0 == 1
    second = next(it)
    assert steps["steps"] - s0 == 2 and second.token == g.result.tokens[1]
    rest = list(it)
    assert steps["steps"] - s0 == 5 and [e.token for e in rest] == g.result.tokens[2:]
    with pytest.raises(RuntimeError):
        iter(g)
    assert not g.engine.has_unfinished()


# ---------------------------------------------------------------------------------------------------
# text: a tiny byte-level BPE tokenizer, stop strings, streamed text, the CLI
# ---------------------------------------------------------------------------------------------------
CORPUS = ["the quick brown fox jumps over the lazy dog. " * 3, "hello world, hello tritune! ",
          "GPT-2 on triton kernels: layer norm, gemm, attention, paged attention. ",
          "caf\u00e9 na\u00efve \u00fcber \u2014 \u20ac 5 \U0001F600 "] * 4


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2-text")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=330, min_frequency=1, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save(str(d / "tokenizer.json"))
    V = bpe.get_vocab_size()
    eos = bpe.token_to_id("<|endoftext|>")
    torch.manual_seed(5)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=V,
                                  initializer_range=0.1, bos_token_id=eos, eos_token_id=eos)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    return d


def test_tokenizer_roundtrip(text_model):
    tok = Tokenizer.from_dir(text_model)
    for s in CORPUS[:4] + ["unseen w\u00f6rds \u4e2d\u6587"]:
        assert tok.decode(tok.encode(s)) == s


def test_stop_string_and_streamed_text(text_model):
    m = load(text_model, "torch")
    tok = Tokenizer.from_dir(text_model)
    g = stream(m, "hello world", tokenizer=tok, max_new_tokens=40, eos_token_id=None)
    pieces = [e.text for e in g]
    full = g.result
    assert "".join(pieces) == full.text == tok.decode(full.tokens)
    assert len(full.text) > 12
    stop = full.text[9:12]
    cut = full.text.index(stop)
    g = stream(m, "hello world", tokenizer=tok, max_new_tokens=40, eos_token_id=None, stop=[stop, "\x00"])
    pieces = [e.text for e in g]
    r = g.result
    assert r.finish_reason == "stop" and r.text == full.text[:cut] == "".join(pieces)
    assert r.tokens == full.tokens[:len(r.tokens)] and len(r.tokens) < len(full.tokens)
    assert stop in tok.decode(r.tokens)     # the token that completed the stop string is the last one
    with pytest.raises(ValueError, match="stop"):
        stream(m, [1, 2], stop=["x"])           # stop strings need a tokenizer
    with pytest.raises(ValueError, match="stop"):
        stream(m, "hi", tokenizer=tok, stop=[""])


def test_cli_generate(text_model, capsys):
    from tritune.harness.cli import main

    rc = main(["generate", "hello world", "--model", str(text_model), "--backend", "torch", "--dtype", "fp32",
               "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("hello world")
    assert "prefill" in err and "tok/s" in err and "stopped: " in err
    rc = main(["generate", "hi", "--model", str(text_model / "nope"), "--backend", "torch"])
    out, err = capsys.readouterr()
    assert rc == 2 and "nope" in err


def test_cli_generate_prompt_that_is_not_utf8(text_model, capsys):
    """An argument that was not UTF-8 (Python escapes its bytes as lone surrogates): one line naming the
    prompt and the byte, exit 2, before the model loads; the tokenizer refuses such text by name too."""
    from tritune.harness.cli import main
    from tritune.model.tokenizer import Tokenizer

    bad = b"\xff\xfe ROMEO".decode("utf-8", "surrogateescape")
    rc = main(["generate", bad, "--model", str(text_model / "nope"), "--backend", "torch"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "prompt: not valid Unicode text (byte 0xff at character 0 is not UTF-8)" in err
    with pytest.raises(ValueError, match="lone surrogate U\\+D800"):
        Tokenizer.from_dir(text_model).encode("a\ud800")
    with pytest.raises(TypeError, match="prompt: expected text"):
        Tokenizer.from_dir(text_model).encode(b"ROMEO")


def test_cli_generate_context_limit(text_model, capsys):
    """The engine's context rule, in the command line's terms: one line naming the flags, exit 2."""
    from tritune.harness.cli import main

    base = ["generate", "hello world", "--model", str(text_model), "--backend", "torch", "--dtype", "fp32"]
    rc = main(base + ["--max-new-tokens", "300"])           # the context is 64
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--max-new-tokens 300 exceeds the model's context of 64" in err and "lower it to --max-new-tokens" in err
    rc = main(base[:1] + ["hello world, " * 40] + base[2:] + ["--max-new-tokens", "8"])
    out, err = capsys.readouterr()
    assert rc == 2 and "--truncate" in err and "truncate=True" not in err
    rc = main(base[:1] + ["hello world, " * 40] + base[2:] + ["--max-new-tokens", "8", "--truncate"])
    out, err = capsys.readouterr()
    assert rc == 0 and "prompt truncated" in err and "stopped: length" in err
    rc = main(base + ["--max-new-tokens", "64", "--truncate"])
    out, err = capsys.readouterr()
    assert rc == 2 and "--max-new-tokens 64 leaves no room" in err and "--max-new-tokens 63" in err


# ---------------------------------------------------------------------------------------------------
# checkpoints: other formats, bad files
# ---------------------------------------------------------------------------------------------------
def _copy(src, dst, *skip):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    return dst


def _edit_config(d, **kv):
    c = json.loads((d / "config.json").read_text())
    c.update(kv)
    (d / "config.json").write_text(json.dumps(c))


def test_pytorch_bin_loads_the_same(checkpoints, tmp_path):
    from safetensors.torch import load_file

    src = checkpoints["odd"][0]
    d = _copy(src, tmp_path / "bin", "model.safetensors")
    torch.save(load_file(str(src / "model.safetensors")), d / "pytorch_model.bin")
    a = G.GPT2.from_pretrained(src, backend="torch", device="cpu").forward([[1, 2, 3]])[0]
    b = G.GPT2.from_pretrained(d, backend="torch", device="cpu").forward([[1, 2, 3]])[0]
    assert torch.equal(a, b)


def test_bad_checkpoints(checkpoints, tmp_path):
    src = checkpoints["odd"][0]
    c = GPT2Config.from_file(src / "config.json")

    def bad(d, exc, match):
        with pytest.raises(exc, match=match):
            G.GPT2.from_pretrained(d, backend="torch", device="cpu")

    bad(tmp_path / "missing", FileNotFoundError, "no such checkpoint directory")
    bad(_copy(src, tmp_path / "noconfig", "config.json"), FileNotFoundError, "config.json")
    bad(_copy(src, tmp_path / "noweights", "model.safetensors"), FileNotFoundError, "no weights file")
    d = _copy(src, tmp_path / "file")
    bad(d / "config.json", NotADirectoryError, "checkpoint directory")
    d = _copy(src, tmp_path / "llama")
    _edit_config(d, model_type="llama")
    bad(d, UnsupportedModelError, "model_type is 'llama'")
    d = _copy(src, tmp_path / "relu")
    _edit_config(d, activation_function="relu")
    bad(d, UnsupportedModelError, "activation_function='relu'")
    d = _copy(src, tmp_path / "cross")
    _edit_config(d, add_cross_attention=True)
    bad(d, UnsupportedModelError, "add_cross_attention")
    d = _copy(src, tmp_path / "wide")
    _edit_config(d, n_embd=c.n_embd * 2)
    bad(d, ValueError, "has shape .* but config.json implies")
    d = _copy(src, tmp_path / "deeper")
    _edit_config(d, n_layer=c.n_layer + 1)
    bad(d, ValueError, f"'h.{c.n_layer}.ln_1.weight' is missing")
    d = _copy(src, tmp_path / "shallower")
    _edit_config(d, n_layer=c.n_layer - 1)
    bad(d, ValueError, rf"has layer\(s\) \[{c.n_layer - 1}\]")
    d = _copy(src, tmp_path / "vocab")
    _edit_config(d, vocab_size=c.vocab_size + 1)
    bad(d, ValueError, "wte.weight")
    d = _copy(src, tmp_path / "heads")
    _edit_config(d, n_head=5)
    bad(d, ValueError, "not divisible by n_head")
    d = _copy(src, tmp_path / "nokey")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["n_embd"]
    (d / "config.json").write_text(json.dumps(cfg))
    bad(d, ValueError, "n_embd")
    d = _copy(src, tmp_path / "badjson")
    (d / "config.json").write_text("{not json")
    bad(d, ValueError, "not valid JSON")
    d = _copy(src, tmp_path / "garbage")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    bad(d, ValueError, "model.safetensors")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        Tokenizer.from_dir(src)
    with pytest.raises(ValueError, match="backend"):
        G.GPT2.from_pretrained(src, backend="cuda")
    with pytest.raises(TypeError, match="dtype"):
        G.GPT2.from_pretrained(src, backend="torch", dtype=torch.int8)


# ---------------------------------------------------------------------------------------------------
# which step runs where
# ---------------------------------------------------------------------------------------------------
def test_backend_report_and_unsupported_head_dim(tmp_path):
    rep = G.backend_report()
    for step in ("layernorm", "linear", "gelu", "attention prefill", "attention decode", "embedding"):
        assert step in rep
    assert ("kernel" in rep) and ("head dim 64" in rep)
    # head dim 16: the prefill attention kernel does not take it; the model still runs, and says so
    hf = _hf_model(dict(n_layer=1, n_head=3, n_embd=48, n_positions=32, vocab_size=67), 0.1)
    hf.save_pretrained(tmp_path)
    m = G.GPT2.from_pretrained(tmp_path, backend="triton", device=DEVICE)
    assert "head dim 16 not in the kernel's" in m.backend_report()
    ours = m.forward([[1, 2, 3, 4, 5]])[0]
    with torch.no_grad():
        ref = hf.to(DEVICE)(torch.tensor([[1, 2, 3, 4, 5]], device=DEVICE)).logits[0]
    assert rel_error(ours, ref) <= tolerance(torch.float32, accumulation("triton", torch.float32))
    assert "plain PyTorch" in G.GPT2.from_pretrained(tmp_path, backend="torch", device=DEVICE).backend_report()


def test_sampling_defaults_come_from_generation_config(tmp_path):
    from tritune.model import load as mcli

    assert mcli.sampling_defaults(tmp_path) == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}  # no file: greedy
    (tmp_path / "generation_config.json").write_text('{"do_sample": true, "temperature": 0.8, "top_k": 50}')
    assert mcli.sampling_defaults(tmp_path) == {"temperature": 0.8, "top_k": 50, "top_p": 1.0}
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.8}')
    assert mcli.sampling_defaults(tmp_path)["temperature"] == 0.0
    (tmp_path / "generation_config.json").write_text("not json")
    assert mcli.sampling_defaults(tmp_path)["temperature"] == 0.0  # a broken file is ignored with a note
    assert mcli.default_model_dir() is not None  # the packaged checkpoint ships with the package
