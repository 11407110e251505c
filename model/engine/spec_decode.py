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

import logging
import math

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import torch
import triton
import triton.language as tl

from tritune.model.engine.graphs import capture_buckets, embed_row, embedding_tables, table_widths
from tritune.model.engine.kv_cache import BlockPool, BlockTable
from tritune.model.engine.runner import ModelRunner
from tritune.model.engine.sampling import probs

log = logging.getLogger(__name__)


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
        self.name = f"draft({model.n_layers} layers, k={k})"

    def attach(self, engine) -> None:
        m, t = self.model, engine.model
        if m.vocab_size != t.vocab_size:
            raise ValueError(f"draft model: vocabulary of {m.vocab_size} tokens, the target's has {t.vocab_size} "
                             "(the two must share a tokenizer)")
        if m.max_context < t.max_context:
            raise ValueError(f"draft model: context of {m.max_context} tokens, shorter than the target's "
                             f"{t.max_context}")
        if torch.device(self.model.device) != engine.device:
            raise ValueError(f"draft model on {self.model.device}, the target on {engine.device}")
        n = self.num_blocks or engine.pool.num_blocks
        self.pool = BlockPool(m.n_layers, m.n_kv_heads, m.head_dim, self.block_size, self.model.dtype,
                              self.model.device, num_blocks=n)
        self.runner = ModelRunner(self.model, self.pool, max_num_seqs=engine.max_num_seqs, cuda_graphs=False)
        self.live = engine.scheduler.requests

    def drop_finished(self, keep):
        """Free the draft cache of requests that finished (or whose id now names another request)."""
        for rid in list(self.state):
            req, table, _ = self.state[rid]
            if self.live.get(rid) is not req or (keep is not None and rid not in keep and self.pool.num_free == 0):
                table.free()
                del self.state[rid]

    def propose(self, reqs, ks, gens=None):
        self.drop_finished(None)
        rows = []           # (i, request, state) of the sequences drafting this step
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if not k:
                continue
            st = self.state.get(r.id)
            if st is None or st[0] is not r:
                st = self.state[r.id] = [r, BlockTable(self.pool), 0]
            L = r.num_tokens
            if st[1].blocks_needed(L + k - 1) > self.pool.num_free:
                self.drop_finished({x.id for x in reqs})
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
# Speculative steps on the device, one CUDA graph per (batch bucket, k)
# ---------------------------------------------------------------------------------------------------
# Past this batch the verify forward (B x (k + 1) rows) stops being launch-bound: plain graph decode wins
SPEC_MAX_BATCH = 16


@triton.jit
def _spec_in_kernel(Hist, stride_h, Len, Live, Drafts, stride_d, BT, stride_bt, BTR, stride_btr, Wte, Wpe, X,
                    Slots, Ctx, stride_wte, stride_wpe, E, MB, max_pos, R: tl.constexpr, FIRST: tl.constexpr,
                    COPY_BT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_MB: tl.constexpr, HAS_WPE: tl.constexpr = True):
    """Row r = b * R + j of a forward over R query tokens per sequence: the token at relative position
    rel = FIRST + j after the sequence's last token (rel <= 0: from its history, at position L - 1 + rel;
    rel >= 1: draft token rel), its embedding, cache slot and context length (pos + 1: causal within the
    step, since every row's K/V is written before any row attends). A dead sequence's rows are padding
    (slot -1, context 1). COPY_BT: the row's block table is its sequence's (paged attention takes one per
    query row)."""
    r = tl.program_id(0)
    b = r // R
    rel = FIRST + r % R
    L = tl.load(Len + b)
    live = tl.load(Live + b) != 0
    pos = L - 1 + rel
    p = tl.minimum(tl.maximum(pos, 0), max_pos)
    th = tl.load(Hist + b * stride_h + p)
    td = tl.load(Drafts + b * stride_d + tl.maximum(rel - 1, 0))
    tok = tl.where(rel <= 0, th, td).to(tl.int64)
    p = tl.where(live, p, 0)
    if COPY_BT:
        offs_mb = tl.arange(0, BLOCK_MB)
        row = tl.load(BT + b * stride_bt + offs_mb, mask=offs_mb < MB, other=0)
        tl.store(BTR + r * stride_btr + offs_mb, row, mask=offs_mb < MB)
    blk = tl.load(BT + b * stride_bt + p // BLOCK_SIZE)
    tl.store(Slots + r, tl.where(live, blk * BLOCK_SIZE + p % BLOCK_SIZE, -1))
    tl.store(Ctx + r, p + 1)
    embed_row(Wte, Wpe, X, r, tok, p, stride_wte, stride_wpe, E, BLOCK_E, HAS_WPE)


@triton.jit
def _argmax_row(Logits, row, stride_l, V, BLOCK_V: tl.constexpr):
    """The first maximum of a row of logits (torch.argmax's choice), BLOCK_V at a time."""
    offs = tl.arange(0, BLOCK_V)
    base = Logits + row.to(tl.int64) * stride_l
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best, idx = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    for c in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(base + c + offs, mask=c + offs < V, other=float("-inf")).to(tl.float32)
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = m > best                     # strictly: an equal maximum later is not the first
        idx = tl.where(take, c + i, idx)
        best = tl.where(take, m, best)
    return idx


@triton.jit
def _draft_out_kernel(Logits, stride_l, V, Drafts, stride_d, R: tl.constexpr, COL: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Sequence b's greedy draft token COL: the argmax after its last row of a draft forward."""
    b = tl.program_id(0)
    tl.store(Drafts + b * stride_d + COL, _argmax_row(Logits, b * R + R - 1, stride_l, V, BLOCK_V))


@triton.jit
def _ngram_kernel(Hist, stride_h, Len, Live, Drafts, stride_d, HL, K: tl.constexpr, N_MIN: tl.constexpr,
                  N_MAX: tl.constexpr, BLOCK_H: tl.constexpr):
    """Prompt lookup on the device: the latest earlier occurrence s of the last n tokens (n = N_MAX down
    to N_MIN, the longest that matches) and the K tokens after it, continued with the period L - n - s
    (the text after a loop's last turn repeats it). No match: the last token, K times (a guess the
    verification rejects at no cost to correctness)."""
    b = tl.program_id(0)
    L = tl.load(Len + b)
    offs = tl.arange(0, BLOCK_H)
    h = Hist + b * stride_h
    best_s = L * 0 - 1
    best_n = L * 0
    for nn in tl.static_range(N_MAX - N_MIN + 1):
        # n = N_MAX - nn written out: triton 3.6 refuses a constexpr assigned in a static_range body
        m = (offs <= L - (N_MAX - nn) - 1) & (offs < HL)
        for i in tl.static_range((N_MAX - nn)):
            tail = tl.load(h + tl.maximum(L - (N_MAX - nn) + i, 0))
            m = m & (tl.load(h + offs + i, mask=m, other=-1) == tail)
        s = tl.max(tl.where(m, offs, -1), axis=0)
        take = (best_s < 0) & (s >= 0)
        best_n = tl.where(take, (N_MAX - nn), best_n)
        best_s = tl.where(take, s, best_s)
    found = best_s >= 0
    period = tl.maximum(L - best_n - best_s, 1)
    for j in tl.static_range(K):
        idx = tl.where(found, best_s + best_n + j % period, L - 1)
        tl.store(Drafts + b * stride_d + j, tl.load(h + tl.minimum(tl.maximum(idx, 0), HL - 1)))


@triton.jit
def _accept_kernel(Logits, stride_l, V, Hist, stride_h, Len, Live, Stop, Eos, Cap, Drafts, stride_d, Acc, Steps,
                   K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Greedy verification of sequence b: with t_j the target's argmax after row j (the last token, then
    drafts d_1..d_K), d_j is accepted while every earlier one was and d_j == t_{j-1}; the emitted tokens are
    t_0..t_a (a accepted: t_j == d_{j+1} for j < a), exactly the target's own greedy tokens. They land in the
    history at L..L+a, cut at the row's stop and after its EOS; the row then dies if it reached either, or
    if another step could pass its allocated positions (L + K > cap)."""
    b = tl.program_id(0)
    if tl.load(Live + b) != 0:
        L = tl.load(Len + b)
        stop = tl.load(Stop + b)
        eos = tl.load(Eos + b)
        going = L < stop
        ended = L < 0
        n = L * 0
        a = L * 0
        for j in tl.static_range(K + 1):
            t = _argmax_row(Logits, b * (K + 1) + j, stride_l, V, BLOCK_V)
            emit = going & (L + j < stop) & (ended == 0)
            tl.store(Hist + b * stride_h + L + j, t, mask=emit)
            n += emit.to(tl.int32)
            ended = ended | (emit & (t == eos))
            if j < K:
                going = going & (tl.load(Drafts + b * stride_d + j) == t)
                a += going.to(tl.int32)
        L = L + n
        tl.store(Len + b, L)
        tl.store(Acc + b, tl.load(Acc + b) + a)
        tl.store(Steps + b, tl.load(Steps + b) + 1)
        tl.store(Live + b, ((L < stop) & (ended == 0) & (L + K <= tl.load(Cap + b))).to(tl.int32))


class SpecGraphs:
    """Greedy speculative steps with their state on the device, one CUDA graph per batch bucket (k fixed) and
    block-table width (``graphs.table_widths``: the narrowest that holds the loaded tables runs).

    State (one int32 buffer, written by one host-to-device copy per :meth:`load`, read back by one copy
    per :meth:`read`): per sequence its token count L, live flag, the count at which it stops, its EOS id,
    its allocated positions (cap), counters of accepted drafts and of steps, its whole token history, its
    block table (and the draft model's). A step: the proposer fills k draft tokens (n-gram lookup: one
    kernel; a draft model: k greedy draft forwards, the first over the last two tokens so that its cache
    catches up on what the last verification accepted), then the target's forward over k + 1 query rows
    per sequence through the paged decode path (``model.decode``: each row its own context length) and
    one kernel that accepts, appends the emitted tokens and advances L. :meth:`run` replays ``steps``
    steps back to back, no host sync. ``capture=False`` runs the same kernels eagerly (the CPU)."""

    def __init__(self, model, pool, k, buckets, *, draft=None, draft_pool=None, ngram=(1, 3), capture=True):
        self.model, self.pool, self.k = model, pool, k
        self.draft, self.dpool, self.ngram = draft, draft_pool, ngram
        self.device = dev = torch.device(model.device)
        self.buckets, self.Bmax = list(buckets), buckets[-1]
        self.n_pos = model.max_context
        self.bs = pool.k_caches[0].shape[1]
        self.mb = -(-self.n_pos // self.bs)
        self.dbs = draft_pool.k_caches[0].shape[1] if draft is not None else self.bs
        self.dmb = -(-self.n_pos // self.dbs) if draft is not None else 0
        self.widths = table_widths(self.mb, self.bs)   # block-table views captured (graphs.table_widths)
        self.width = self.mb                           # the one the loaded rows need (set by load)
        self.HL = self.n_pos
        Bm = self.Bmax
        self.NS = 7                        # Len, Live, Stop, Eos, Cap, Acc, Steps
        self.n_state = self.NS * Bm
        size = self.n_state + Bm * (self.HL + self.mb + self.dmb)
        self.h = torch.zeros(size, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.n = self.h.numpy()
        self.d = self.h.to(dev)
        (self.len, self.live, self.stop, self.eos, self.cap, self.acc,
         self.steps) = (self.d[i * Bm:(i + 1) * Bm] for i in range(self.NS))
        o = self.n_state
        self.hist = self.d[o:o + Bm * self.HL].view(Bm, self.HL)
        o += Bm * self.HL
        self.bt = self.d[o:o + Bm * self.mb].view(Bm, self.mb)
        o += Bm * self.mb
        self.dbt = self.d[o:o + Bm * self.dmb].view(Bm, self.dmb) if draft is not None else None
        self.drafts = torch.zeros((Bm, k), dtype=torch.int32, device=dev)
        self.scratch = {}                  # (model, rows per sequence, width) -> (slots, ctx, per-row tables)
        self.graphs = {}
        self.capture_s = 0.0
        self.replays = 0
        self.reads = 0
        if capture:
            self._capture()

    def _rows(self, tag, R, mb):
        s = self.scratch.get((tag, R, mb))
        if s is None:
            n = self.Bmax * R
            s = self.scratch[(tag, R, mb)] = (torch.full((n,), -1, dtype=torch.int32, device=self.device),
                                         torch.ones(n, dtype=torch.int32, device=self.device),
                                         torch.zeros((n, mb), dtype=torch.int32, device=self.device))
        return s

    def _forward(self, tag, m, kv, bt, b, R, first):
        """``m``'s forward over R query rows per sequence (relative positions first .. first + R - 1)."""
        slots, ctx, btr = self._rows(tag, R, bt.shape[1])
        wte, wpe, E = embedding_tables(m)
        x = torch.empty((b * R, E), dtype=m.dtype, device=self.device)
        bs = kv.k_caches[0].shape[1]
        _spec_in_kernel[(b * R,)](self.hist, self.hist.stride(0), self.len, self.live, self.drafts,
                                  self.drafts.stride(0), bt, bt.stride(0), btr, btr.stride(0), wte,
                                  wte if wpe is None else wpe, x, slots, ctx, wte.stride(0),
                                  0 if wpe is None else wpe.stride(0), E, bt.shape[1], self.n_pos - 1, R=R,
                                  FIRST=first, COPY_BT=R > 1, BLOCK_SIZE=bs, BLOCK_E=triton.next_power_of_2(E),
                                  BLOCK_MB=triton.next_power_of_2(bt.shape[1]), num_warps=4 if E >= 512 else 1,
                                  HAS_WPE=wpe is not None)
        tables = btr[:b * R] if R > 1 else bt[:b]
        return m.decode(None, None, kv, slots[:b * R], tables, ctx[:b * R], x=x)

    def _block_v(self, V):
        return min(8192, triton.next_power_of_2(V))

    def _run(self, b, w=None):
        """One speculative step of bucket b, the target's block tables seen ``w`` blocks wide (the draft's as
        wide in tokens)."""
        k, d = self.k, self.draft
        w = self.mb if w is None else w
        if d is not None:
            dbt = self.dbt[:, :min(self.dmb, -(-w * self.bs // self.dbs))]
            for s in range(k):             # s = 0: the last two tokens (catch-up), then one draft each
                lg = self._forward("draft", d, self.dpool, dbt, b, 2 if s == 0 else 1, -1 if s == 0 else s)
                V = lg.shape[1]
                _draft_out_kernel[(b,)](lg, lg.stride(0), V, self.drafts, self.drafts.stride(0), R=2 if s == 0 else 1,
                                        COL=s, BLOCK_V=self._block_v(V), num_warps=8)
        else:
            _ngram_kernel[(b,)](self.hist, self.hist.stride(0), self.len, self.live, self.drafts, self.drafts.stride(0),
                                self.HL, K=k, N_MIN=self.ngram[0], N_MAX=self.ngram[1],
                                BLOCK_H=triton.next_power_of_2(self.HL), num_warps=4)
        lg = self._forward("target", self.model, self.pool, self.bt[:, :w], b, k + 1, 0)
        V = lg.shape[1]
        _accept_kernel[(b,)](lg, lg.stride(0), V, self.hist, self.hist.stride(0), self.len, self.live, self.stop,
                             self.eos, self.cap, self.drafts, self.drafts.stride(0), self.acc, self.steps, K=k,
                             BLOCK_V=self._block_v(V), num_warps=8)

    def _capture(self):      # every sequence dead while it runs: nothing is written
        keys = [(b, w) for b in self.buckets for w in self.widths]
        self.graphs, _, self.capture_s = capture_buckets(keys, lambda key: self._run(*key), self.device,
                                                         "CUDA-graph capture of the speculative step")

    def bucket(self, B):
        return next((b for b in self.buckets if b >= B), None)

    def load(self, histories, stops, eos, caps, tables, draft_tables=None):
        """Rows 0..B-1 (the rest of the bucket dead): each sequence's tokens so far, the token count at which
        it stops, EOS id (-1: none), allocated positions, block table (and the draft's)."""
        B, Bm, n = len(histories), self.Bmax, self.n
        b = self.bucket(B)
        n[:self.n_state] = 0
        hist = n[self.n_state:self.n_state + Bm * self.HL].reshape(Bm, self.HL)
        o = self.n_state + Bm * self.HL
        bt = n[o:o + Bm * self.mb].reshape(Bm, self.mb)
        dbt = n[o + Bm * self.mb:o + Bm * (self.mb + self.dmb)].reshape(Bm, self.dmb)
        for i, ids in enumerate(histories):
            L = len(ids)
            n[i] = L
            n[Bm + i] = int(L < stops[i] and L + self.k <= caps[i])
            n[2 * Bm + i], n[3 * Bm + i], n[4 * Bm + i] = stops[i], eos[i], caps[i]
            hist[i, :L] = ids
            bt[i, :len(tables[i].blocks)] = tables[i].blocks
            if draft_tables is not None:
                dbt[i, :len(draft_tables[i].blocks)] = draft_tables[i].blocks
        need = max((len(t.blocks) for t in tables[:B]), default=1)
        self.width = next(w for w in self.widths if w >= need)
        self.d.copy_(self.h, non_blocking=True)     # the last read synced: the buffer is free
        return b

    def run(self, B, steps: int):
        key = (self.bucket(B), self.width)
        g = self.graphs.get(key)
        for _ in range(steps):
            g.replay() if g is not None else self._run(*key)
        self.replays += steps

    def read(self, B):
        """(token counts, accepted drafts, live steps, histories) of rows 0..B-1: the one host sync."""
        self.reads += 1
        Bm = self.Bmax
        h = self.d[:self.n_state + B * self.HL].cpu().numpy()
        hist = h[self.n_state:].reshape(B, self.HL)
        return h[:B], h[5 * Bm:5 * Bm + B], h[6 * Bm:6 * Bm + B], hist


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
        # spec_over_batch_steps: decode steps of more rows than the speculative step's largest batch, which ran
        # as plain decode steps (the server exposes it; a log line says so the first time)
        engine.stats.update(spec_steps=0, spec_proposed=0, spec_accepted=0, spec_graph_replays=0, spec_syncs=0,
                            spec_over_batch_steps=0)
        self._over_batch_logged = False
        self.graphs, why = self._make_graphs(engine)
        if self.graphs is not None:
            how = "captured" if self.graphs.graphs else "run eagerly (no capture)"
            engine.notes.append(f"speculative decoding: {proposer.name}; greedy steps on the device at batch "
                                f"{self.graphs.buckets} ({how}{f', {self.graphs.capture_s:.1f} s' if self.graphs.graphs else ''}"
                                "), sampled ones eagerly")
        else:
            engine.notes.append(f"speculative decoding: {proposer.name}; speculative steps run eagerly ({why})")
        self._tokens, self._row_steps = 0, 0      # the graph path's emitted tokens per sequence-step so far

    def _make_graphs(self, engine):
        """The device-side speculative step beside the engine's device-side decode step, or (None, why)."""
        g = engine.runner.graphs
        prop = self.proposer
        if g is None:
            return None, "no device-side decode step"
        if type(prop) not in (NgramProposer, DraftModelProposer):
            return None, f"{type(prop).__name__} has no device-side proposer"
        capture = bool(g.graphs)
        draft = getattr(prop, "model", None)
        if capture and draft is not None and (draft.backend != "triton"
                                              or not getattr(draft.ops, "capturable", False)):
            return None, "the draft model's decode step cannot be captured"
        buckets = [b for b in g.buckets if b <= SPEC_MAX_BATCH]
        dm = draft.with_ops(draft.ops) if draft is not None else None
        ngram = (prop.n_min, prop.n_max) if draft is None else (1, 1)
        return SpecGraphs(g.model, engine.pool, self.k, buckets, draft=dm, draft_pool=prop.pool if dm else None,
                          ngram=ngram, capture=capture), None

    def applies(self, engine, out) -> bool:
        if not out.decode or out.prefill or (engine.tokenizer is not None
                                             and any(r.sampling.stop for r in out.decode)):
            return False
        # past the device-side speculative step's batches the plain captured decode step is faster
        B = len(out.decode)
        if self.graphs is None or not engine.runner.graph_batch(B) or self.graphs.bucket(B) is not None:
            return True
        engine.stats["spec_over_batch_steps"] += 1
        if not self._over_batch_logged:
            self._over_batch_logged = True
            log.warning("speculative decoding: %d decoding rows is past its largest batch (%d): such steps run "
                        "as plain decode steps (counted in stats['spec_over_batch_steps'])", B,
                        max(self.graphs.buckets))
        return False

    def step(self, engine, out):
        if self.graphs is not None:
            finished = self._graph_step(engine, out)
            if finished is not None:
                return finished
        return self._eager_step(engine, out)

    def _graph_step(self, engine, out):
        """Up to ``decode_steps`` greedy speculative steps on the device, one host sync; None when this step
        cannot run there (sampled rows, a row near the context end, blocks short: the eager step runs)."""
        sg, sch, prop = self.graphs, engine.scheduler, self.proposer
        reqs = out.decode
        B, K = len(reqs), self.k
        n_pos = engine.model.max_context
        if sg.bucket(B) is None or any(r.sampling.temperature for r in reqs) or \
                any(r.num_tokens + K > n_pos for r in reqs):
            return None
        left = [r.tokens_left for r in reqs]
        tps = self._tokens / self._row_steps if self._row_steps else 1 + K / 2
        N = max(1, min(engine.decode_steps, math.ceil(max(left) / tps)))
        N = int(min(N, sch.seat_wait_left()))
        draft = isinstance(prop, DraftModelProposer)
        dtables = None
        if draft:
            prop.drop_finished(None)
            for r in reqs:
                st = prop.state.get(r.id)
                if st is None or st[0] is not r:
                    prop.state[r.id] = [r, BlockTable(prop.pool), 0]
            dtables = [prop.state[r.id][1] for r in reqs]
        while True:     # room for N steps (the verify's K/V past the accepted tokens included)
            caps = [min(n_pos, min(r.num_tokens + (N - 1) * (K + 1), r.num_tokens + n - 1) + K)
                    for r, n in zip(reqs, left)]
            need = sum(r.table.blocks_needed(c) for r, c in zip(reqs, caps))
            dneed = sum(t.blocks_needed(c) for t, c in zip(dtables, caps)) if draft else 0
            if need <= engine.pool.num_free and (not draft or dneed <= prop.pool.num_free):
                break
            if N == 1:
                return None
            N = 1
        for r, c in zip(reqs, caps):
            r.table.ensure_capacity(c)
        if draft:
            self._catch_up(reqs, caps, dtables)
        eos = engine.model.eos_token_id
        eoss = [-1 if eos is None or r.sampling.ignore_eos else eos for r in reqs]
        before = [r.num_tokens for r in reqs]
        sg.load([r.all_ids for r in reqs], [L + n for L, n in zip(before, left)], eoss, caps,
                [r.table for r in reqs], dtables)
        sg.run(B, N)
        lens, acc, steps, hist = sg.read(B)
        emitted = [hist[i, before[i]:lens[i]].tolist() for i in range(B)]
        n_out = [len(r.output_ids) for r in reqs]
        finished = sch.update_tokens(out, emitted)
        if draft:
            for r, L in zip(reqs, lens):
                st = prop.state.get(r.id)
                if st is not None and st[0] is r:
                    st[2] = max(0, int(L) - 2)     # the next step's first draft forward refeeds the last two
        st = engine.stats
        n = int(steps.max())
        st["spec_steps"] += n
        st["steps"] += n
        st["spec_graph_replays"] += N
        st["spec_syncs"] += 1
        st["spec_proposed"] += K * int(steps.sum())
        st["spec_accepted"] += int(acc.sum())
        st["decode_tokens"] += sum(len(r.output_ids) - b for r, b in zip(reqs, n_out))
        self._tokens += sum(map(len, emitted))
        self._row_steps += int(steps.sum())
        return finished

    def _catch_up(self, reqs, caps, tables):
        """The draft's cache up to two tokens before each sequence's end (its first forward in the graph
        feeds those two): an eager prefill of what it has not seen (the prompt, after a prefill)."""
        prop = self.proposer
        ids, slots, starts, tabs = [], [], [], []
        for r, c, t in zip(reqs, caps, tables):
            t.ensure_capacity(c)
            st = prop.state[r.id]
            end = r.num_tokens - 2
            if st[2] < end:
                ids.append(r.all_ids[st[2]:end])
                slots.append(t.slots(st[2], end))
                starts.append(st[2])
                tabs.append(t)
                st[2] = end
        if ids:
            prop.runner.eager(ids, slots, [], [], [], [], [], prefill_starts=starts, prefill_tables=tabs)

    def _eager_step(self, engine, out):
        sch, pool = engine.scheduler, engine.pool
        reqs = out.decode
        n_pos = engine.model.max_context
        # k per sequence: no more than the tokens it may still emit (k accepted + 1), nor past the context
        ks = [max(0, min(self.k, r.tokens_left - 1, n_pos - r.num_tokens)) for r in reqs]
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
        emitted, row, failed = [], 0, []
        for r, (d, q), gen in zip(reqs, drafts, gens):
            try:
                toks = verify(logits[row:row + len(d) + 1], d, q, r.sampling, gen)
            except RuntimeError as e:   # its distribution cannot be drawn from: this request alone ends
                toks = []
                failed.append((r, e))
            row += len(d) + 1
            emitted.append(toks)
        before = [r.num_tokens for r in reqs]
        for r, e in failed:
            engine.end_request(r, e)
        finished = [r for r, _ in failed] + sch.update_tokens(out, emitted)
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
    """The draft for ``model``: ``draft`` (a directory or hub id; any family, by its config.json), default
    :func:`default_draft_dir`; on the target's backend, dtype and device."""
    from tritune.model.load import load_model

    path = draft if draft is not None else default_draft_dir(model)
    if path is None:
        raise ValueError(f"draft: {getattr(model, 'directory', None) or 'the model'} has no packaged draft "
                         f"({DRAFT_SUBDIR}/config.json); pass a draft checkpoint sharing its tokenizer")
    return load_model(path, backend=model.backend, dtype=model.dtype, device=model.device)


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
