"""The server's start-up warm-up against a first burst of prefix-cache hits, on the CPU with the device
stubbed (the forward returns zero logits, the device-side step fixed tokens): every prefill attention
variant (:meth:`ModelRunner.prefill_variant`: what Triton compiles one kernel for) that the burst's eager
steps launch was launched by the warm-up before the server said ready.

Why: an H100 HTTP round's first burst of 512 requests (their prompts cached by the run before) waited
~1 s in the engine process for their add_request: its first steps compiled the context path's (short
query, long context) attention variants, which the warm-up's ladder of whole prompts never launched.
"""
import random

import pytest
import torch

from tritune.model.engine import runner as R
from tritune.model.gpt2 import weights as W
from tritune.model.engine.engine import Engine
from tritune.model.gpt2.model import GPT2, GPT2Config
from tritune.model.engine.graphs import DecodeGraphs
from tritune.model.engine.scheduler import SamplingParams

V = 512


def _stubbed_engine(monkeypatch):
    # GPT-2 small's heads and head dim (the variants depend on them), one layer, a small vocabulary
    cfg = GPT2Config(vocab_size=V, n_positions=1024, n_embd=768, n_layer=1, n_head=12)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v, generator=gen) * 0.02 for k, v in W.expected_shapes(cfg).items()}
    m = GPT2(cfg, W.to_layout(cfg, state, torch.float32, "cpu"), backend="torch")
    eng = Engine(m, num_blocks=8192, max_num_seqs=256, max_batch_tokens=8192, cuda_graphs="eager")

    class Stub(DecodeGraphs):
        def run(self, B, steps=1):
            return torch.zeros(B, V)

        def tokens(self, positions, steps):
            return [[(p + 1 + k) % (V - 1) + 1 for p in positions] for k in range(steps)]

    eng.runner.graphs.__class__ = Stub
    monkeypatch.setattr(R, "forward_step", lambda *a, logit_rows=None, **k: torch.zeros(
        a[-3].shape[0] if logit_rows is None else logit_rows.shape[0], V))
    # the triton backend's variants (its launches are stubbed: only the host logic runs)
    monkeypatch.setattr(eng.runner.model, "backend", "triton")
    return eng


def _record(runner) -> list:
    """Every eager step's prefill variant into the last set of the returned list (append one to start
    a new record)."""
    eager, sets = runner.eager, [set()]

    def rec(prefill_ids, prefill_slots, *a, prefill_starts=None, **kw):
        q = [len(s) for s in prefill_ids]
        if q:
            ctx = None if not prefill_starts or not any(prefill_starts) else \
                [s + n for s, n in zip(prefill_starts, q)]
            sets[-1].add(runner.prefill_variant(q, ctx))
        return eager(prefill_ids, prefill_slots, *a, prefill_starts=prefill_starts, **kw)

    runner.eager = rec
    return sets


def _burst(eng, items, rng) -> None:
    """The requests arrive a few at a time between steps, as the engine process drains its pipe."""
    k = 0
    while k < len(items) or eng.has_unfinished():
        n = rng.randint(1, 8)
        for p, o in items[k:k + n]:
            eng.add_request(p, SamplingParams(max_new_tokens=o, ignore_eos=True))
        k += n
        eng.step()


@pytest.mark.parametrize("warm_context", [True, False])
def test_prefix_hit_burst_meets_no_prefill_variant_after_warm_up(monkeypatch, warm_context):
    eng = _stubbed_engine(monkeypatch)
    if not warm_context:    # the warm-up as it was: the burst meets variants it never launched
        monkeypatch.setattr(eng.runner, "warm_context", lambda *a: 0)
    sets = _record(eng.runner)
    eng.warm_up()
    warmed = sets[-1]
    rng = random.Random(0)
    items = [([rng.randrange(1, V) for _ in range(rng.randint(64, 512))], rng.randint(4, 12)) for _ in range(384)]
    for p, o in items:      # an untimed run of the workload: its prompts in the prefix cache
        eng.add_request(p, SamplingParams(max_new_tokens=o, ignore_eos=True))
    sets.append(set())
    eng.run()
    met = set()
    sets.append(met)
    _burst(eng, items, rng)
    new = met - warmed - {None}
    assert any(k[0] for k in met), "the burst should hit the prefix cache (context-path prefills)"
    if warm_context:
        assert not new, f"{len(new)} prefill variant(s) first met after the warm-up: {sorted(new)[:4]}"
    else:
        assert any(k[0] for k in new)
