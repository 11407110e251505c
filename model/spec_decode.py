"""Speculative decoding: a proposer drafts k tokens per sequence, the target model checks them all in one
forward (k + 1 query rows per sequence attending to its paged cache: the runner's context prefill), and
rejection sampling keeps the target's distribution exactly.

Verification, per sequence with draft tokens d_1..d_k drawn from q_1..q_k and target distributions
p_1..p_{k+1} (after temperature, top-k, top-p): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
at the first rejection draw the replacement from max(0, p_j - q_j) renormalised and stop; if all k are
accepted, draw a bonus token from p_{k+1}. Every emitted token is then distributed as the target alone
would draw it (Leviathan et al. 2023, Chen et al. 2023). Greedy requests: accept while d_j is p_j's
argmax, then emit the argmax: exactly the target's greedy tokens. A deterministic proposer (n-gram
prompt lookup) has q_j a point mass on d_j.

Proposers:
- :class:`NgramProposer`: finds the latest earlier occurrence of the sequence's last n tokens
  (n = n_max..n_min) and proposes the k tokens that followed it. No model, no cache.
- :class:`DraftModelProposer`: a smaller GPT-2 with the same tokenizer (distilgpt2 for gpt2, or the
  packaged pair), with its own block pool: it catches up on the tokens it has not seen, then drafts k
  tokens one decode at a time (sampled requests draw from the draft's distribution at the same settings).

The engine runs a speculative step when a step only decodes and no request has stop strings (checked on
the text after every token); with CUDA graphs, speculative steps bypass the captured decode step (the
verification has k + 1 rows per sequence) and run eagerly.
"""
from __future__ import annotations

import torch

from tritune.model.kv_cache import BlockPool, BlockTable
from tritune.model.runner import ModelRunner
from tritune.model.sampling import probs


# ---------------------------------------------------------------------------------------------------
# Distributions and the acceptance rule
# ---------------------------------------------------------------------------------------------------
def _draw(p: torch.Tensor, generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator)[0])


def verify(target_logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, sampling,
           generator=None) -> list[int]:
    """The tokens a sequence emits: the accepted prefix of ``draft`` and one more (1 to k + 1 tokens).

    target_logits (k + 1, V): the target's logits after the last token and after each draft token;
    draft_probs (k, V) or None (the proposer's choice is deterministic: a point mass on each token).
    """
    k = len(draft)
    if sampling.temperature == 0:
        best = target_logits.argmax(dim=-1).tolist()
        out = []
        for j in range(k):
            if draft[j] != best[j]:
                break
            out.append(draft[j])
        return out + [best[len(out)]]
    p = probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p)
    u = torch.rand(k, generator=generator, device=p.device).tolist() if k else []
    out = []
    for j, d in enumerate(draft):
        pd = float(p[j, d])
        qd = 1.0 if draft_probs is None else float(draft_probs[j, d])
        if qd > 0 and u[j] * qd < pd:        # accept with probability min(1, p/q)
            out.append(d)
            continue
        resid = p[j].clone()
        if draft_probs is None:
            resid[d] = 0.0
        else:
            resid = (resid - draft_probs[j]).clamp_min_(0.0)
        s = float(resid.sum())
        # p == q up to rounding (nothing left to correct toward): p itself is the right draw
        return out + [_draw(resid / s if s > 1e-12 else p[j], generator)]
    return out + [_draw(p[k], generator)]


# ---------------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the last n tokens."""

    def __init__(self, k: int = 4, n_max: int = 3, n_min: int = 1):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected an int >= 1, got {k!r}")
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n_min, n_max: expected 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.k, self.n_max, self.n_min = k, n_max, n_min
        self.name = f"ngram(k={k}, n={n_min}..{n_max})"

    def attach(self, engine) -> None:
        pass

    def lookup(self, ids: list[int], k: int) -> list[int]:
        L = len(ids)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            tail = ids[L - n:]
            for s in range(L - n - 1, -1, -1):       # the latest match first
                if ids[s:s + n] == tail:
                    return ids[s + n:s + n + k]
        return []

    def propose(self, reqs, ks, gens=None):
        return [(self.lookup(r.all_ids, k) if k else [], None) for r, k in zip(reqs, ks)]

    def accepted(self, req, n_before: int, k: int, a: int) -> None:
        pass


class DraftModelProposer:
    """A draft GPT-2 (same vocabulary as the target) drafting k tokens per sequence on its own paged cache.

    ``num_blocks``: the draft's pool (default: as many blocks as the target's pool when attached)."""

    def __init__(self, model, k: int = 4, *, num_blocks: int | None = None, block_size: int = 16):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k: expected an int >= 1, got {k!r}")
        self.model, self.k, self.block_size = model, k, block_size
        self.num_blocks = num_blocks
        self.pool = self.runner = None
        self.state: dict = {}           # request id -> [request, table, tokens whose draft K/V are cached]
        self.name = f"draft({model.config.n_layer} layers, k={k})"

    def attach(self, engine) -> None:
        c, t = self.model.config, engine.config
        if c.vocab_size != t.vocab_size:
            raise ValueError(f"draft model: vocabulary of {c.vocab_size} tokens, the target's has {t.vocab_size} "
                             "(the two must share a tokenizer)")
        if c.n_positions < t.n_positions:
            raise ValueError(f"draft model: context of {c.n_positions} tokens, shorter than the target's "
                             f"{t.n_positions}")
        if torch.device(self.model.device) != engine.device:
            raise ValueError(f"draft model on {self.model.device}, the target on {engine.device}")
        n = self.num_blocks or engine.pool.num_blocks
        self.pool = BlockPool(c.n_layer, c.n_head, c.head_dim, self.block_size, self.model.dtype,
                              self.model.device, num_blocks=n)
        self.runner = ModelRunner(self.model, self.pool, max_num_seqs=engine.max_num_seqs, cuda_graphs=False)
        self.live = engine.scheduler.requests

    def _gc(self, keep):
        """Free the draft cache of requests that finished (or whose id now names another request)."""
        for rid in list(self.state):
            req, table, _ = self.state[rid]
            if self.live.get(rid) is not req or (keep is not None and rid not in keep and self.pool.num_free == 0):
                table.free()
                del self.state[rid]

    def propose(self, reqs, ks, gens=None):
        self._gc(None)
        bs = self.pool.block_size
        rows = []           # (i, request, state) of the sequences drafting this step
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if not k:
                continue
            st = self.state.get(r.id)
            if st is None or st[0] is not r:
                st = self.state[r.id] = [r, BlockTable(self.pool), 0]
            L = r.num_tokens
            if st[1].blocks_needed(L + k - 1) > self.pool.num_free:
                self._gc({x.id for x in reqs})
                if st[1].blocks_needed(L + k - 1) > self.pool.num_free:
                    continue        # no room in the draft cache: this sequence decodes plainly
            st[1].ensure_capacity(L + k - 1)
            rows.append((i, r, st))
        drafts = [([], None) for _ in reqs]
        if not rows:
            return drafts
        # catch up on the tokens the draft has not seen; the last row's logits give each first draft
        ids, slots, starts, tables = [], [], [], []
        for i, r, (_, table, done) in rows:
            ids.append(r.all_ids[done:])
            slots.append(table.slots(done, r.num_tokens))
            starts.append(done)
            tables.append(table)
        logits = self.runner.eager(ids, slots, [], [], [], [], [], prefill_starts=starts, prefill_tables=tables)
        toks = {i: [] for i, _, _ in rows}
        qs = {i: [] for i, _, _ in rows}
        live = rows
        for j in range(max(ks[i] for i, _, _ in rows)):
            for (i, r, st), lg in zip(live, logits):
                s = r.sampling
                if s.temperature == 0:
                    toks[i].append(int(lg.argmax()))
                else:
                    q = probs(lg, s.temperature, s.top_k, s.top_p)
                    toks[i].append(_draw(q, gens[i] if gens else None))
                    qs[i].append(q)
            live = [(i, r, st) for i, r, st in live if len(toks[i]) < ks[i]]
            if not live:
                break
            pos = [r.num_tokens - 1 + len(toks[i]) for i, r, _ in live]
            logits = self.runner.eager([], [], [toks[i][-1] for i, _, _ in live], pos,
                                       [st[1].slot(p) for (_, _, st), p in zip(live, pos)],
                                       [p + 1 for p in pos], [st[1] for _, _, st in live])
        for i, r, st in rows:
            st[2] = r.num_tokens        # the draft's K/V now hold every token before the drafts
            drafts[i] = (toks[i], torch.stack(qs[i]) if qs[i] else None)
        return drafts

    def accepted(self, req, n_before: int, k: int, a: int) -> None:
        """``a`` of the ``k`` drafts after position ``n_before - 1`` were accepted: the draft's K/V of the
        accepted ones it fed (all but the last draft) stay valid."""
        st = self.state.get(req.id)
        if st is not None and st[0] is req and k:
            st[2] = n_before + min(a, k - 1)


# ---------------------------------------------------------------------------------------------------
# The engine's speculative step
# ---------------------------------------------------------------------------------------------------
class SpeculativeDecoder:
    """Runs a decode-only engine step speculatively: propose, verify in one target forward, accept.

    ``proposer``: a proposer object, or "ngram" / "draft" (:func:`make_proposer`: "draft" is the
    checkpoint's packaged draft, ``<model dir>/draft/``)."""

    def __init__(self, proposer, engine):
        if isinstance(proposer, str):
            proposer = make_proposer(proposer, engine.model)
        if not hasattr(proposer, "propose"):
            raise TypeError(f"speculative: expected a proposer (NgramProposer, DraftModelProposer), "
                            f"got {type(proposer).__name__}")
        self.proposer, self.k = proposer, proposer.k
        proposer.attach(engine)
        engine.notes.append(f"speculative decoding: {proposer.name}; speculative steps run eagerly "
                            "(not on the captured decode step)")
        engine.stats.update(spec_steps=0, spec_proposed=0, spec_accepted=0)

    def applies(self, engine, out) -> bool:
        return bool(out.decode) and not out.prefill and not (
            engine.tokenizer is not None and any(r.sampling.stop for r in out.decode))

    def step(self, engine, out):
        sch, pool = engine.scheduler, engine.pool
        reqs = out.decode
        n_pos = engine.config.n_positions
        # k per sequence: no more than the tokens it may still emit (k accepted + 1), nor past the context
        ks = [max(0, min(self.k, r.max_new_tokens - len(r.output_ids) - 1, n_pos - r.num_tokens)) for r in reqs]
        gens = [_generator(engine.sampler, r) for r in reqs]
        drafts = self.proposer.propose(reqs, ks, gens)
        ks = [len(d) for d, _ in drafts]
        # room for the drafts' K/V (all or nothing: short of blocks, this step decodes plainly)
        need = sum(r.table.blocks_needed(r.num_tokens + k) for r, k in zip(reqs, ks))
        if need > pool.num_free:
            drafts, ks = [([], None)] * len(reqs), [0] * len(reqs)
        for r, k in zip(reqs, ks):
            r.table.ensure_capacity(r.num_tokens + k)
        ids = [[r.all_ids[-1]] + d for r, (d, _) in zip(reqs, drafts)]
        starts = [r.num_tokens - 1 for r in reqs]
        slots = [r.table.slots(s, s + len(x)) for r, s, x in zip(reqs, starts, ids)]
        logits = engine.runner.eager(ids, slots, [], [], [], [], [], prefill_starts=starts,
                                     prefill_tables=[r.table for r in reqs], all_logits=True)
        emitted, row = [], 0
        for r, (d, q), gen in zip(reqs, drafts, gens):
            toks = verify(logits[row:row + len(d) + 1], d, q, r.sampling, gen)
            row += len(d) + 1
            emitted.append(toks)
        before = [r.num_tokens for r in reqs]
        finished = sch.update_tokens(out, emitted)
        for r, n, k, toks in zip(reqs, before, ks, emitted):
            self.proposer.accepted(r, n, k, len(toks) - 1)
        st = engine.stats
        st["spec_steps"] += 1
        st["steps"] += 1
        st["spec_proposed"] += sum(ks)
        st["spec_accepted"] += sum(len(t) - 1 for t in emitted)
        st["decode_tokens"] += sum(len(r.output_ids) for r in reqs) - sum(b - len(r.prompt_ids) for r, b in
                                                                           zip(reqs, before))
        return finished


def _generator(sampler, req):
    """The request's own seeded generator, as the engine's sampler keeps it (None: the global RNG)."""
    s = req.sampling
    if s.temperature == 0:
        return None
    gen = sampler.generators.get(req.id)
    if gen is None and s.seed is not None:
        gen = torch.Generator(device=sampler.device)
        gen.manual_seed(int(s.seed))
        sampler.generators[req.id] = gen
    return gen


def acceptance_rate(stats: dict) -> float:
    return stats["spec_accepted"] / stats["spec_proposed"] if stats.get("spec_proposed") else float("nan")


def early_exit_draft(model, n_layers: int):
    """A draft from the target itself: its first ``n_layers`` layers, then its final LayerNorm and LM head
    (weights shared, nothing trained; same tokenizer by construction). Useful where no smaller model of
    the family is at hand; a trained small draft accepts more."""
    from dataclasses import replace

    c = model.config
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or not 1 <= n_layers < c.n_layer:
        raise ValueError(f"n_layers: expected an int in [1, {c.n_layer - 1}], got {n_layers!r}")
    m = model.with_weights(replace(model.w, layers=model.w.layers[:n_layers]))
    m.config = replace(c, n_layer=n_layers)
    return m


# ---------------------------------------------------------------------------------------------------
# Proposers by name
# ---------------------------------------------------------------------------------------------------
SPECULATIVE = ("ngram", "draft")
# Draft tokens per step when not given. A draft model whose argmax agrees with the target's with
# probability a yields 1 + a + ... + a^k tokens per step for k draft forwards: the packaged draft (a about
# 0.4 on the target's own greedy text) gets 1.52 at k = 2 and 1.59 at k = 4, so k = 4 would pay two more
# draft forwards for 0.07 tokens. Lookup costs nothing per token: a longer guess is free.
DEFAULT_K = {"ngram": 4, "draft": 2}
DRAFT_SUBDIR = "draft"      # a checkpoint's own draft model: <checkpoint>/draft/ (the packaged model ships one)


def default_draft_dir(model):
    """``<model's checkpoint>/draft`` when it holds a checkpoint (``model/default/draft`` for the packaged
    model), else None."""
    from pathlib import Path

    d = getattr(model, "directory", None)
    if d is None:
        return None
    d = Path(d) / DRAFT_SUBDIR
    return d if (d / "config.json").is_file() else None


def load_draft(model, draft=None):
    """The draft GPT-2 for ``model``: ``draft`` (a directory or hub id), default :func:`default_draft_dir`;
    on the target's backend, dtype and device."""
    from tritune.model.gpt2 import GPT2

    path = draft if draft is not None else default_draft_dir(model)
    if path is None:
        raise ValueError(f"draft: {getattr(model, 'directory', None) or 'the model'} has no packaged draft "
                         f"({DRAFT_SUBDIR}/config.json); pass a draft checkpoint sharing its tokenizer")
    return GPT2.from_pretrained(path, backend=model.backend, dtype=model.dtype, device=model.device)


def make_proposer(name: str, model, *, k: int | None = None, draft=None, block_size: int = 16):
    """``"ngram"`` (prompt lookup) or ``"draft"`` (:func:`load_draft`: ``draft`` or the packaged draft);
    ``k`` draft tokens per step (default :data:`DEFAULT_K`)."""
    if name in DEFAULT_K and k is None:
        k = DEFAULT_K[name]
    if name == "ngram":
        if draft is not None:
            raise ValueError("draft: only speculative='draft' takes a draft model")
        return NgramProposer(k=k)
    if name == "draft":
        return DraftModelProposer(load_draft(model, draft), k=k, block_size=block_size)
    raise ValueError(f"speculative: expected one of {SPECULATIVE} or a proposer, got {name!r}")
