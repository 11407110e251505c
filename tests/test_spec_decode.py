"""Speculative decoding (CPU, fp32, tiny GPT-2s): greedy outputs equal the target alone exactly with a
draft model and with n-gram lookup, under continuous batching and preemption; rejection sampling keeps
the target's distribution (a toy bigram target and draft on a 4-token vocabulary, the joint distribution
of two emitted tokens against the exact one); blocks of both caches come back."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

from dataclasses import replace

import pytest
import torch

from tritune.model.engine.engine import Engine
from tritune.model.engine.scheduler import SamplingParams
from tritune.model.engine.spec_decode import DraftModelProposer, NgramProposer, acceptance_rate, verify
from tests.test_engine import alone, prompts, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def draft():
    return tiny_model(n_layer=1, n_embd=32, seed=5)


# The device-side speculative step launches Triton kernels (even with cuda_graphs="eager"): on a GPU machine
# its models live on the GPU (Triton compiles for the device there; the interpreter runs host tensors here).
_STEP_DEV = "cuda" if torch.cuda.is_available() else None


@pytest.fixture(scope="module")
def dmodel():
    return tiny_model(device=_STEP_DEV)


@pytest.fixture(scope="module")
def ddraft():
    return tiny_model(n_layer=1, n_embd=32, seed=5, device=_STEP_DEV)


# ----------------------------------------------------------------------------------------------- verify
def _bigram(V, seed, sharp):
    g = torch.Generator().manual_seed(seed)
    return (sharp * torch.randn(V, V, generator=g)).softmax(-1)


def blocks_back_and_self_accepted(eng, prop, kind):
    """After a speculative run: the target drafting for itself had every draft accepted, and every block of
    the target's pool (and of the draft model's own) came back."""
    if kind == "self":
        assert acceptance_rate(eng.stats) == 1.0
    assert eng.pool.num_free == eng.pool.num_blocks
    if kind != "ngram":
        prop.drop_finished(None)
        assert prop.pool.num_free == prop.pool.num_blocks


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_rejection_sampling_keeps_the_target_distribution(proposer):
    """Target: a bigram chain T; draft: another chain Q (or a fixed point-mass guess). The first two
    emitted tokens after token 0 must be distributed as T[0, x1] T[x1, x2]."""
    V, k, N = 4, 2, 2500
    T, Q = _bigram(V, 1, 1.5), _bigram(V, 2, 1.5)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V)
    for _ in range(N):
        seq = [0]
        while len(seq) < 3:
            if proposer == "draft":
                d, qs = [], []
                for _ in range(k):
                    q = Q[(d or seq)[-1]]
                    d.append(int(torch.multinomial(q, 1, generator=gen)))
                    qs.append(q)
                qs = torch.stack(qs)
            else:
                d, qs = [(seq[-1] + 1) % V, (seq[-1] + 2) % V], None
            ctx = seq[-1:] + d
            logits = torch.log(T[ctx])              # the target after each fed token
            seq += verify(logits, d, qs, sp, gen)
        counts[seq[1], seq[2]] += 1
    exact = T[0][:, None] * T
    sigma = (exact * (1 - exact) / N).sqrt()
    # each cell within 4.5 standard deviations (a wrong acceptance or residual rule moves cells by > 0.05)
    assert ((counts / N - exact).abs() <= 4.5 * sigma + 1e-3).all(), (counts / N, exact)


def test_verify_greedy_accepts_the_argmax_prefix():
    logits = torch.tensor([[0., 5, 0], [0, 0, 5], [5, 0, 0], [0, 5, 0]])
    sp = SamplingParams()
    assert verify(logits, [1, 2, 0], None, sp) == [1, 2, 0, 1]      # all accepted + bonus
    assert verify(logits, [1, 0, 0], None, sp) == [1, 2]            # first mismatch replaced by the argmax
    assert verify(logits[:1], [], None, sp) == [1]


def test_ngram_lookup_takes_the_latest_longest_match():
    p = NgramProposer(k=3, n_max=2)
    assert p.lookup([5, 6, 7, 8, 5, 6, 9, 9, 5, 6], 3) == [9, 9, 5]
    assert p.lookup([1, 2, 3], 3) == []
    assert p.lookup([4, 1, 2, 4], 2) == [1, 2]
    with pytest.raises(ValueError, match="k: expected an int >= 1"):
        NgramProposer(k=0)


# ----------------------------------------------------------------------------------------------- engine
def _loopy(n, seed):
    """Prompts that repeat themselves, so prompt lookup finds matches."""
    return [(p * 4)[:len(p) * 3] for p in prompts(n, seed=seed, lo=3, hi=9)]


@pytest.mark.parametrize("kind", ["ngram", "draft", "self"])
def test_greedy_speculation_equals_target_alone(model, draft, kind):
    prop = {"ngram": lambda: NgramProposer(k=3), "draft": lambda: DraftModelProposer(draft, k=3, block_size=4),
            "self": lambda: DraftModelProposer(model, k=4, block_size=4)}[kind]()
    eng = Engine(model, num_blocks=128, block_size=4, cuda_graphs=False, speculative=prop)
    ps = _loopy(5, seed=31)
    sp = SamplingParams(max_new_tokens=14, ignore_eos=True)
    reqs = []
    for p in ps:                                  # arrivals between steps: continuous batching
        reqs.append(eng.add_request(p, sp))
        eng.step()
    eng.run()
    for r, p in zip(reqs, ps):
        assert r.output_ids == alone(model, p, 14)
    st = eng.stats
    assert st["spec_steps"] > 0 and st["spec_proposed"] > 0
    blocks_back_and_self_accepted(eng, prop, kind)


def test_speculation_under_preemption_and_stop_conditions(model, draft):
    """A small pool (preemption, recompute), EOS and max_new_tokens mid-draft, an abort."""
    prop = DraftModelProposer(draft, k=4, block_size=4)
    eng = Engine(model, num_blocks=20, block_size=4, cuda_graphs=False, speculative=prop, max_num_seqs=4)
    ps = _loopy(6, seed=32)
    lens = [3, 17, 9, 22, 5, 12]
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
    eng.step()
    eng.step()
    eng.abort(reqs[4].id)
    eng.run()
    assert eng.stats["preemptions"] > 0
    for i, (r, p, n) in enumerate(zip(reqs, ps, lens)):
        if i != 4:
            assert r.output_ids == alone(model, p, n)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_sampled_speculation_runs_and_is_reproducible(model, draft):
    outs = []
    for _ in range(2):
        eng = Engine(model, num_blocks=64, block_size=4, cuda_graphs=False,
                     speculative=DraftModelProposer(draft, k=3, block_size=4))
        sps = [SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(3)]
        res = eng.generate(_loopy(3, seed=33), sps)
        outs.append([c.token_ids for c in res])
        assert all(len(t) == 10 for t in outs[-1]) and eng.stats["spec_steps"] > 0
    assert outs[0] == outs[1]


def test_draft_model_must_share_the_vocabulary(model):
    other = tiny_model(n_layer=1, n_embd=32)
    other.config = replace(other.config, vocab_size=50)
    with pytest.raises(ValueError, match="share a tokenizer"):
        Engine(model, num_blocks=16, block_size=4, cuda_graphs=False, speculative=DraftModelProposer(other))


@pytest.mark.gpu
def test_gpu_graph_engine_with_every_feature_equals_plain():
    """On the GPU (triton backend, fp32, CUDA graphs): prefix caching + chunked prefill + n-gram and draft
    speculation give the tokens of the plain graph engine; speculative steps bypass the decode graph."""
    m = tiny_model("triton", n_layer=2, n_embd=64, n_head=2, n_positions=96, device="cuda")
    d = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=96, seed=5, device="cuda")
    ps = [p[:40] + q for p, q in zip(_loopy(6, seed=40) * 2, prompts(12, seed=41, lo=2, hi=12))]
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True)
    plain = Engine(m, num_blocks=256, block_size=16, enable_prefix_caching=False)
    want = [c.token_ids for c in plain.generate(ps, sp)]
    for prop in (NgramProposer(k=4), DraftModelProposer(d, k=4)):
        eng = Engine(m, num_blocks=256, block_size=16, enable_chunked_prefill=True, max_batch_tokens=32,
                     speculative=prop)
        assert eng.graphs is not None
        assert [c.token_ids for c in eng.generate(ps, sp)] == want
        assert eng.stats["spec_steps"] > 0 and eng.scheduler.stats["cached_tokens"] > 0
        assert eng.pool.num_free == eng.pool.num_blocks


# --------------------------------------------------------------------- the device-side speculative step
def _cut_at_eos(ids, eos):
    return ids[:ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("kind", ["ngram", "draft", "self"])
def test_device_speculation_equals_target_alone(dmodel, ddraft, kind):
    model, draft = dmodel, ddraft
    """The device-side step (run eagerly here, captured on a GPU): greedy tokens are the target's alone,
    under continuous batching, EOS and max_new_tokens cut mid-draft, with one host sync per run of up to
    decode_steps speculative steps, and every block back."""
    prop = {"ngram": lambda: NgramProposer(k=3), "draft": lambda: DraftModelProposer(draft, k=3, block_size=4),
            "self": lambda: DraftModelProposer(model, k=2, block_size=4)}[kind]()
    eng = Engine(model, num_blocks=128, block_size=4, cuda_graphs="eager", speculative=prop, max_num_seqs=4)
    assert eng.spec.graphs is not None and eng.spec.graphs.buckets == [1, 2, 4]
    ps = _loopy(6, seed=34)
    lens = [14, 5, 11, 3, 16, 9]
    eos = model.config.eos_token_id
    reqs = []
    for i, (p, n) in enumerate(zip(ps, lens)):
        reqs.append(eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=i % 2 == 0)))
        eng.step()
    eng.run()
    for i, (r, p, n) in enumerate(zip(reqs, ps, lens)):
        want = alone(model, p, n)
        assert r.output_ids == (want if i % 2 == 0 else _cut_at_eos(want, eos)), i
    st = eng.stats
    assert st["spec_graph_replays"] >= st["spec_steps"] > 0
    assert st["spec_syncs"] == eng.spec.graphs.reads and st["spec_syncs"] < st["spec_steps"]
    blocks_back_and_self_accepted(eng, prop, kind)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_device_speculation_widths_follow_the_longest_table(dmodel, ddraft, kind, monkeypatch):
    """The speculative step runs at the narrowest captured block-table width holding its rows' tables (the
    draft's as wide in tokens); greedy tokens are still the target's alone."""
    from tritune.model.engine import graphs as GR

    monkeypatch.setattr(GR, "MIN_WIDTH_TOKENS", 16)     # block_size 4: widths 4, 16, then the whole context
    model, draft = dmodel, ddraft
    prop = NgramProposer(k=3) if kind == "ngram" else DraftModelProposer(draft, k=3, block_size=4)
    eng = Engine(model, num_blocks=128, block_size=4, cuda_graphs="eager", speculative=prop, max_num_seqs=4,
                 decode_steps=2)
    sg = eng.spec.graphs
    assert len(sg.widths) >= 3 and sg.widths[-1] == sg.mb, sg.widths
    used = []
    orig = sg._run
    monkeypatch.setattr(sg, "_run", lambda b, w=None: (used.append(w), orig(b, w))[1])
    ps = _loopy(3, seed=36)
    lens = [40, 6, 30]
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
    eng.run()
    assert [r.output_ids for r in reqs] == [alone(model, p, n) for p, n in zip(ps, lens)]
    assert len(set(used)) >= 2, used
    assert eng.pool.num_free == eng.pool.num_blocks


def test_device_speculation_under_preemption_and_context_end(dmodel, ddraft):
    model, draft = dmodel, ddraft
    """A pool too small for every sequence (preemption, the graph step falling back to the eager one when
    blocks run short) and sequences running to the end of the context."""
    prop = DraftModelProposer(draft, k=3, block_size=4)
    eng = Engine(model, num_blocks=24, block_size=4, cuda_graphs="eager", speculative=prop, max_num_seqs=4)
    n_pos = model.config.n_positions
    ps = _loopy(5, seed=35)
    lens = [n_pos - len(ps[0]), 13, 20, 7, 18]
    reqs = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
    eng.run()
    for r, p, n in zip(reqs, ps, lens):
        assert r.output_ids == alone(model, p, n)
    assert eng.stats["spec_graph_replays"] > 0
    assert eng.pool.num_free == eng.pool.num_blocks


def test_device_ngram_proposals_match_the_host_lookup():
    """The lookup kernel proposes what NgramProposer.lookup finds, continued with the match's period."""
    from tritune.model.engine.spec_decode import _ngram_kernel

    g = torch.Generator().manual_seed(3)
    HL, K = 64, 5
    host = NgramProposer(k=K, n_max=3)
    for trial in range(12):
        L = int(torch.randint(2, HL, (1,), generator=g))
        ids = torch.randint(0, 4 if trial % 2 else 9, (L,), generator=g).tolist()
        dev = _STEP_DEV or "cpu"
        hist = torch.zeros((1, HL), dtype=torch.int32, device=dev)
        hist[0, :L] = torch.tensor(ids)
        drafts = torch.zeros((1, K), dtype=torch.int32, device=dev)
        _ngram_kernel[(1,)](hist, HL, torch.tensor([L], dtype=torch.int32, device=dev),
                            torch.ones(1, dtype=torch.int32, device=dev), drafts,
                            K, HL, K=K, N_MIN=1, N_MAX=3, BLOCK_H=HL)
        want = host.lookup(ids, K)
        got = drafts[0].tolist()
        if want:
            assert got[:len(want)] == want, (ids, got, want)
            period = len(want) if len(want) < K else None
            if period:       # the continuation repeats the tokens after the match
                assert got == [want[j % period] for j in range(K)]
        else:
            assert got == [ids[-1]] * K


@pytest.mark.gpu
def test_gpu_captured_speculation_equals_plain_greedy():
    """On the GPU, captured graphs (fp32): n-gram and draft speculation on the device give the plain graph
    engine's greedy tokens, on a tiny pair at batches 1-6 and on the packaged model with its draft at batch
    1; each run of speculative steps syncs once."""
    m = tiny_model("triton", n_layer=2, n_embd=64, n_head=2, n_positions=96, device="cuda")
    d = tiny_model("triton", n_layer=1, n_embd=32, n_head=2, n_positions=96, seed=5, device="cuda")
    ps = _loopy(6, seed=42)
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [c.token_ids for c in Engine(m, num_blocks=128, block_size=16).generate(ps, sp)]
    for prop in (NgramProposer(k=4), DraftModelProposer(d, k=3)):
        eng = Engine(m, num_blocks=128, block_size=16, max_num_seqs=8, speculative=prop)
        assert eng.spec.graphs is not None and eng.spec.graphs.graphs, eng.notes
        assert [c.token_ids for c in eng.generate(ps, sp)] == want
        st = eng.stats
        assert st["spec_graph_replays"] > 0 and st["spec_syncs"] < st["spec_steps"]
        assert eng.pool.num_free == eng.pool.num_blocks
    pm = _packaged()
    from tritune.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(pm.directory)
    pp = [tok.encode(s) for s in SPEECHES]
    sp = SamplingParams(max_new_tokens=96, ignore_eos=True)
    plain = Engine(pm, num_blocks=40, max_num_seqs=1)
    want = [c.token_ids for c in plain.generate(pp, sp)]
    for name in ("ngram", "draft"):
        eng = Engine(pm, num_blocks=40, max_num_seqs=1, speculative=name)
        assert eng.spec.graphs is not None and eng.spec.graphs.graphs, eng.notes
        assert [c.token_ids for c in eng.generate(pp, sp)] == want, name
        assert eng.stats["spec_graph_replays"] > 0


# ------------------------------------------------------------------------------------ the packaged draft
def _packaged():
    from tritune.model.load import default_model_dir
    from tritune.model.gpt2.model import GPT2
    from tritune.model.engine.spec_decode import default_draft_dir

    d = default_model_dir()
    if d is None or not (d / "draft" / "config.json").is_file():
        pytest.skip("no packaged checkpoint with a draft (model/default/draft)")
    gpu = torch.cuda.is_available()
    # fp32 on a GPU too: greedy tokens compared across verify (k + 1 rows) and decode (1 row) must not
    # hinge on bf16 rounding ties
    m = GPT2.from_pretrained(d, backend="triton" if gpu else "torch", dtype=torch.float32)
    assert default_draft_dir(m) == d / "draft"
    return m


# Held out of the packaged model's training (Macbeth and The Merchant of Venice are its test plays)
SPEECHES = ("MACBETH:\nTo-morrow, and to-morrow, and to-morrow,\nCreeps in this petty pace from day to day,\n"
            "To the last syllable of recorded time;\n",
            "PORTIA:\nThe quality of mercy is not strain'd,\nIt droppeth as the gentle rain from heaven\n"
            "Upon the place beneath. It is twice blest;\n")


def test_packaged_draft_shares_the_tokenizer_and_is_small():
    import hashlib
    import json

    m = _packaged()
    d = m.directory / "draft"
    meta = json.loads((d / "metrics.json").read_text())
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((m.directory / "tokenizer.json").read_bytes()).hexdigest()
    assert sum(f.stat().st_size for f in d.iterdir()) < 2 * 2**20


def test_engine_speculative_draft_by_name_uses_the_packaged_draft():
    """Engine(speculative="draft") on the packaged model: its draft/ at k = 2, greedy tokens equal the target
    alone, and the distilled draft's guesses are accepted often (0.24 of them on these two speeches and on
    the CPU when it was trained; a draft of random weights: about none)."""
    from tritune.model.tokenizer import Tokenizer

    m = _packaged()
    tok = Tokenizer.from_dir(m.directory)
    ps = [tok.encode(s)[:48] for s in SPEECHES]
    sp = SamplingParams(max_new_tokens=32, ignore_eos=True)
    want = [c.token_ids for c in Engine(m, num_blocks=32, block_size=16, cuda_graphs=False).generate(ps, sp)]
    eng = Engine(m, num_blocks=32, block_size=16, cuda_graphs=False, speculative="draft")
    assert eng.spec.proposer.name == "draft(2 layers, k=2)"
    assert [c.token_ids for c in eng.generate(ps, sp)] == want
    assert acceptance_rate(eng.stats) > 0.15


def test_speculative_by_name_errors():
    from tritune.model.engine.spec_decode import make_proposer

    m = tiny_model()                      # no checkpoint directory: no packaged draft
    with pytest.raises(ValueError, match="no packaged draft"):
        make_proposer("draft", m)
    with pytest.raises(ValueError, match="speculative: expected one of"):
        Engine(m, num_blocks=16, block_size=4, cuda_graphs=False, speculative="medusa")
    with pytest.raises(ValueError, match="draft: only"):
        make_proposer("ngram", m, draft="x")
    assert make_proposer("ngram", m, k=2).k == 2


def test_generate_cli_speculative_draft(capsys):
    from tritune.harness.cli import main

    _packaged()
    rc = main(["generate", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0", "--dtype", "fp32",
               "--speculative", "draft"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("ROMEO:")
    assert "draft(2 layers, k=2):" in err and "drafts accepted" in err
    rc = main(["generate", "ROMEO:", "--max-new-tokens", "12", "--temperature", "0", "--dtype", "fp32"])
    assert rc == 0 and capsys.readouterr()[0] == out       # greedy: the same text as without speculation
    assert main(["generate", "x", "--speculative", "draft", "--spec-k", "0"]) == 2
    assert "--spec-k: expected an int >= 1" in capsys.readouterr()[1]


# ---------------------------------------------------------------------- training a draft (model/train.py)
def test_train_a_draft_distilled_from_a_teacher(tmp_path):
    """--teacher reuses the teacher's tokenizer (no copy written; its hash recorded), --init starts from a
    checkpoint, the distillation loss lowers, the agreement with the teacher is measured, and the draft
    drafts for its teacher in the engine with greedy tokens unchanged."""
    import hashlib
    import json

    from tritune.model import train as T
    from tritune.model.gpt2.model import GPT2
    from tests.test_train import PLAY

    data = tmp_path / "texts"
    data.mkdir()
    for i, n in enumerate(["a_gut", "b_gut", "c_gut"]):
        (data / f"{n}.txt").write_text((PLAY * (4 + i)).replace("Verona", f"Verona {i}"))
    common = ["--data", str(data), "--n-positions", "32", "--dropout", "0", "--batch-size", "8", "--warmup", "2",
              "--lr", "3e-3", "--eval-every", "10", "--device", "cpu", "--sample-prompt", ""]
    teacher, start, draft = tmp_path / "teacher", tmp_path / "start", tmp_path / "draft"
    assert T.main([*common, "--out", str(teacher), "--vocab-size", "320", "--n-layer", "2", "--n-embd", "64",
                   "--n-head", "2", "--max-steps", "30"]) == 0
    small = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2"]
    assert T.main([*common, *small, "--out", str(start), "--tokenizer", str(teacher), "--max-steps", "5"]) == 0
    assert T.main([*common, *small, "--out", str(draft), "--teacher", str(teacher), "--init", str(start),
                   "--max-steps", "20"]) == 0
    assert not (draft / "tokenizer.json").exists() and not (start / "tokenizer.json").exists()
    m = json.loads((draft / "metrics.json").read_text())
    sha = hashlib.sha256((teacher / "tokenizer.json").read_bytes()).hexdigest()
    assert m["tokenizer"]["sha256"] == sha and m["init"]["checkpoint"] == str(start)
    agree = m["teacher"]["agreement_on_val"]
    assert 0 < agree["greedy_top1_agreement"] <= 1 and 0 < agree["sampled_acceptance_t1"] <= 1
    hist = m["training"]["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    tm = GPT2.from_pretrained(teacher, backend="torch", dtype=torch.float32)
    dm = GPT2.from_pretrained(draft, backend="torch", dtype=torch.float32)
    ps = [[5, 9, 11, 40, 7], [100, 3, 3, 60]]
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = [c.token_ids for c in Engine(tm, num_blocks=32, block_size=4, cuda_graphs=False).generate(ps, sp)]
    eng = Engine(tm, num_blocks=32, block_size=4, cuda_graphs=False, speculative=DraftModelProposer(dm, k=3))
    assert [c.token_ids for c in eng.generate(ps, sp)] == want


def test_distill_loss_is_kl_plus_cross_entropy():
    """The fused soft-target loss: alpha * KL(teacher || student) + (1 - alpha) * CE + the teacher's entropy."""
    import torch.nn.functional as F

    from tritune.model.train import distill_loss

    g = torch.Generator().manual_seed(0)
    s, t = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) for _ in range(2))
    y = torch.randint(0, 11, (2, 5), generator=g)
    ls, lt = F.log_softmax(s.flatten(0, 1), -1), F.log_softmax(t.flatten(0, 1), -1)
    kl = (lt.exp() * (lt - ls)).sum(-1).mean()
    ent = -(lt.exp() * lt).sum(-1).mean()
    want = 0.7 * (kl + ent) + 0.3 * F.nll_loss(ls, y.flatten())
    assert torch.allclose(distill_loss(s, y, t, 0.7).double(), want, rtol=1e-5)


def test_device_speculation_past_its_batch_limit_is_reported(dmodel, monkeypatch, caplog):
    """More decoding rows than the speculative step's largest batch: plain decode steps (the same tokens),
    counted in stats["spec_over_batch_steps"] and logged once."""
    import logging

    from tritune.model.engine import spec_decode

    monkeypatch.setattr(spec_decode, "SPEC_MAX_BATCH", 2)       # (16 on the real engine)
    eng = Engine(dmodel, num_blocks=128, block_size=4, cuda_graphs="eager", speculative=NgramProposer(k=3),
                 max_num_seqs=4, prefill_batching=False)
    assert eng.spec.graphs.buckets == [1, 2]
    ps = _loopy(4, seed=36)
    with caplog.at_level(logging.WARNING, logger=spec_decode.__name__):
        reqs = [eng.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True)) for p in ps]
        eng.run()
    assert [r.output_ids for r in reqs] == [alone(dmodel, p, 6) for p in ps]
    assert eng.stats["spec_over_batch_steps"] > 0
    assert sum("past its largest batch" in m for m in caplog.messages) == 1
