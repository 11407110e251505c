"""The model side of an engine step: the forward over a step's packed tokens, the fast decode paths (CUDA
graphs of the whole decode step, or ``torch.compile``), and the warm-up that compiles every kernel variant
a serving run meets.

Without a fast decode path, prefills and decodes share a *single* forward over their packed tokens:
LayerNorm and every linear are per token, so they run once over all rows; only attention splits (varlen
causal attention over the prefill rows, paged attention over the decode rows), and ``write_kv`` stores
every new K/V at once. With CUDA graphs (or ``torch.compile``) the decode rows go through the captured
graph of their batch-size bucket (:class:`~tritune.model.engine.graphs.DecodeGraphs`) and the prefill rows
through an eager forward of their own: a graph cannot hold the prefills' shapes, which change every step.

Unless the prefill rows are few (``graph_prefill_tokens``): then they ride in the captured step as decode
rows. The device-side step already gives every row its own position, block table and context length, and
each layer writes every row's K/V before any row attends, so a prefill chunk of C tokens from position s
(the tokens before s in the cache: an earlier chunk, or a prefix-cache hit) is C rows at positions s ..
s + C - 1 with the sequence's table: row i attends to s + i + 1 tokens, rows < i of its own chunk included
(paged attention per query row, as speculative verification and the batch-invariant mode run it). A step of
decodes + a short chunk, or a short prefill alone, then costs one graph replay instead of an eager forward
(~100 launches from Python, several ms). The price: paged attention reads a row's whole context per query
row (O(C * context) bytes against a flash kernel's O(context)), which is why the rows are capped.
"""
from __future__ import annotations

import functools
import time

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import numpy as np
import torch

from tritune.model.gpt2 import model as G
from tritune.model.engine.config import GRAPH_BUCKETS, GRAPH_PREFILL_TOKENS, GRAPH_PREFILL_WORK  # noqa: F401
from tritune.model.engine.contract import eos_ids
from tritune.model.engine.graphs import DecodeGraphs
from tritune.model.quant.ops import is_quantized


# ---------------------------------------------------------------------------------------------------
# The forward of one step
# ---------------------------------------------------------------------------------------------------
def attn_context(model, q, k_cache, v_cache, seq_lens, cu_q, max_q, context):
    """Prefill attention of query rows that continue sequences already (partly) in the paged cache:
    sequence b's ``seq_lens[b]`` queries are its last positions, and it attends causally to all its
    ``ctx_lens[b]`` tokens, gathered from the cache (``context`` = (flat slots of every context token,
    (P+1,) int32 cu_seqlens of the contexts, the longest context, ctx_lens)): the new tokens' K/V were
    written first. Prefix-cache hits, prefill chunks and speculative verification all take this path."""
    idx, cu_k, max_k, ctx_lens = context
    gather = getattr(model.ops, "gather_kv", None)     # an FP8 cache: its rows dequantized (kv_fp8)
    if gather is not None:
        k, v = gather(k_cache, v_cache, idx, q.dtype)
    else:
        k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, idx)
        v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, idx)
    if model.backend == "triton":
        from tritune.kernels import attention

        if model.head_dim in attention.HEAD_DIMS:   # bottom-right causal: query i sees key j <= i + Tk - Tq
            return attention.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, validate=False)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sq = sk = 0
    for n, m in zip(seq_lens, ctx_lens):
        mask = torch.ones((n, m), dtype=torch.bool, device=q.device).tril(m - n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[sq:sq + n].transpose(0, 1), k[sk:sk + m].transpose(0, 1), v[sk:sk + m].transpose(0, 1), attn_mask=mask,
            enable_gqa=k.shape[1] != q.shape[1])   # grouped-query attention: Hkv < Hq
        out[sq:sq + n] = o.transpose(0, 1)
        sq, sk = sq + n, sk + m
    return out


def forward_step(model, kv, ids, positions, slots, *, seq_lens=(), cu_seqlens=None, block_tables=None,
                 context_lens=None, logit_rows=None, context=None):
    """One forward of ``model`` (on its ops) over packed tokens: ``sum(seq_lens)`` prefill rows first,
    then one row per decode.

    ids, positions, slots (T,) on the device; cu_seqlens (P+1,) int32 of the prefills; block_tables
    (Td, max_blocks) and context_lens (Td,) int32 of the decodes; ``context``: the prefills continue
    cached sequences (see :func:`attn_context`). Returns the logits of ``logit_rows`` (all rows when
    None). Nothing here syncs with the host when there are no prefills.
    """
    ops = model.ops
    Tp = int(sum(seq_lens))
    T = slots.shape[0]
    max_seqlen = max(seq_lens) if Tp else 0

    def attend(i, q, k, v, written=False):
        kc, vc = kv.k_caches[i], kv.v_caches[i]
        if not written:
            ops.write_kv(k, v, kc, vc, slots)
        if context is not None:
            a = attn_context(model, q[:Tp], kc, vc, seq_lens, cu_seqlens, max_seqlen, context)
            return a if Tp == T else torch.cat((a, ops.attn_decode(q[Tp:], kc, vc, block_tables, context_lens)))
        if Tp == T:
            return ops.attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen)
        if Tp == 0:
            return ops.attn_decode(q, kc, vc, block_tables, context_lens)
        return torch.cat((ops.attn_prefill(q[:Tp], k[:Tp], v[:Tp], seq_lens, cu_seqlens, max_seqlen),
                          ops.attn_decode(q[Tp:], kc, vc, block_tables, context_lens)))

    kv_for = (lambda i: (kv.k_caches[i], kv.v_caches[i], slots)) if Tp == 0 else None
    x = model.blocks(model.embed(ids, positions), attend, kv_for)
    if logit_rows is not None:
        x = x[logit_rows]
    return model.logits(x)


def _index_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """write_kv for the torch backend without the boolean mask of gpt2.torch_write_kv (a host sync and a
    graph break): the runner only calls it with real slots (no padding rows outside the device step)."""
    idx = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v)


class IndexWriteOps:
    """A model's ops with :func:`_index_write_kv` as write_kv (everything else theirs)."""

    write_kv = staticmethod(_index_write_kv)

    def __init__(self, base):
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)


# ---------------------------------------------------------------------------------------------------
# The torch backend's decode under torch.compile
# ---------------------------------------------------------------------------------------------------
# The decode step of the torch backend in pieces. A piece takes tensors only, so one compile serves every
# layer (regional compilation: a layer's compile, not the whole model's, which took minutes); the cache
# write stays outside (an in-place write into a compiled graph's input).
def _layer_in(x, ln_w, ln_b, w_qkv, b_qkv, eps: float, n_head: int):
    T, E = x.shape
    return G.torch_linear(G.torch_layer_norm(x, ln_w, ln_b, eps), w_qkv, b_qkv).view(T, 3, n_head, E // n_head)


def _layer_out(x, qkv, k_cache, v_cache, block_tables, context_lens, w_o, b_o, ln_w, ln_b, w_fc, b_fc,
               w_proj, b_proj, eps: float):
    T, E = x.shape
    a = G.torch_attn_decode(qkv[:, 0], k_cache, v_cache, block_tables, context_lens)
    x = G.torch_linear(a.reshape(T, E), w_o, b_o, residual=x)
    f = G.torch_linear(G.torch_layer_norm(x, ln_w, ln_b, eps), w_fc, b_fc, activation="gelu_tanh")
    return G.torch_linear(f, w_proj, b_proj, residual=x)


def _head(x, ln_w, ln_b, lm_head, eps: float):
    return G.torch_linear(G.torch_layer_norm(x, ln_w, ln_b, eps), lm_head)


# The same pieces for the triton backend, on torch.ops.tritune: each kernel an opaque op whose fake gives
# the compiler its output's shape, so the pieces compile whole (fullgraph) with the kernels inside, and
# the linear op picks gemv (LayerNorm fused) or layer_norm + gemm by the row count when it runs, not in
# the traced code (a branch there would be a guard: a recompile when the batch crosses 8 rows).
def _layer_in_ops(x, ln_w, ln_b, w_qkv, b_qkv, eps: float, n_head: int):
    T, E = x.shape
    return torch.ops.tritune.linear(x, w_qkv, b_qkv, None, None, ln_w, ln_b, eps).view(T, 3, n_head, E // n_head)


def _layer_out_ops(x, qkv, k_cache, v_cache, block_tables, context_lens, w_o, b_o, ln_w, ln_b, w_fc, b_fc,
                   w_proj, b_proj, eps: float):
    T, E = x.shape
    ops = torch.ops.tritune
    a = ops.paged_attention(qkv[:, 0], k_cache, v_cache, block_tables, context_lens, None, False)
    x = ops.linear(a.reshape(T, E), w_o, b_o, None, x)
    f = ops.linear(x, w_fc, b_fc, "gelu_tanh", None, ln_w, ln_b, eps)
    return ops.linear(f, w_proj, b_proj, None, x)


def _head_ops(x, ln_w, ln_b, lm_head, eps: float):
    return torch.ops.tritune.linear(x, lm_head, None, None, None, ln_w, ln_b, eps)


class CompiledDecode:
    """GPT2's decode forward, its layer and head compiled (dynamic shapes): on the torch ops (backend
    "torch"), or on the Triton kernels through torch.ops.tritune (backend "triton")."""

    def __init__(self, model, kv):
        self.model, self.kv = model, kv
        if model.backend == "triton":
            from tritune.kernels import torch_ops  # noqa: F401  (registers torch.ops.tritune)

            pieces, kw = (_layer_in_ops, _layer_out_ops, _head_ops), {"fullgraph": True}
            # validate=False: the slots come from the block pool (validation reads them back to the host)
            self.write_kv = functools.partial(torch_ops.EAGER["write_kv"], validate=False)
        else:
            pieces, kw = (_layer_in, _layer_out, _head), {}
            self.write_kv = _index_write_kv
        self.layer_in, self.layer_out, self.head = (torch.compile(f, dynamic=True, **kw) for f in pieces)

    def __call__(self, ids, pos, slots, block_tables, context_lens):
        from torch.fx.experimental import _config as fx_config

        m, kv = self.model, self.kv
        c = m.config
        eps = c.layer_norm_epsilon
        x = m.embed(ids, pos)
        # no duck sizing: a batch that happens to equal another dim (3, the head count, ...) on the first
        # call would tie the two and force a recompile at the next batch size
        with fx_config.patch(use_duck_shape=False):
            for i, L in enumerate(m.w.layers):
                kc, vc = kv.k_caches[i], kv.v_caches[i]
                qkv = self.layer_in(x, L.ln1_w, L.ln1_b, L.w_qkv, L.b_qkv, eps, c.n_head)
                self.write_kv(qkv[:, 1], qkv[:, 2], kc, vc, slots)
                x = self.layer_out(x, qkv, kc, vc, block_tables, context_lens, L.w_o, L.b_o, L.ln2_w, L.ln2_b,
                                   L.w_fc, L.b_fc, L.w_proj, L.b_proj, eps)
            return self.head(x, m.w.lnf_w, m.w.lnf_b, m.w.lm_head, eps)


# ---------------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------------
def _both_totals(b: int, n: int) -> list[list[int]]:
    """``b`` sequences of at most ``n`` tokens, packed to a total divisible by 16 and to one that is not
    (the last sequence shortened): varlen attention takes the packed totals as int arguments, which
    Triton specialises on, so each (sequences, longest) bucket has two variants by the total alone.
    One sequence: its total is ``n`` itself (the ladder's L and L + 1 give both)."""
    total = b * n
    if b == 1:
        return [[n]]
    cut = total % 16 or 1                 # to a multiple of 16, or off one
    return [[n] * b, [n] * (b - 1) + [n - cut]]


def prefill_buckets(buckets, max_rows: int) -> list[int]:
    """``buckets`` of the decode step extended to hold ``max_rows`` rows (decodes + prefill rows): the
    doublings of its largest bucket below that (from 32: a smaller one saves little), then ``max_rows``
    rounded up to 16."""
    top = max(buckets)
    ext, b = [], 2 * top
    while b < max_rows:
        if b >= 32:
            ext.append(b)
        b *= 2
    if max_rows > top:
        ext.append(-(-max_rows // 16) * 16)
    return sorted(set(buckets) | set(ext))


def _int_class(n: int) -> int:
    """How Triton tells an int argument's variants apart: 1, divisible by 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def _context_candidates(n_positions: int, max_seqs: int, budget: int, min_tokens: int):
    """(query lengths, context lengths) of prefills that continue cached sequences, one or more of every
    kind the prefill attention's variants depend on: sequences (every count to 64, which holds the default
    config's small-batch threshold for any head count from 8; past 64 each power-of-two bucket's first
    and last four, for the counts' residues), longest query (1..16, the suffixes of prefix-cache hits;
    past 16 each bucket's first two and last two), longest context (each bucket's first value past the
    query), the packed query total (as is, or the last query shortened to a multiple of 16 or off one).
    ``min_tokens``: steps with fewer prefill tokens never run eagerly (the device-side step takes them)."""
    def ends(lo, hi, k):
        out, b = set(range(1, min(lo, hi) + 1)), lo
        while b < hi:
            out |= {x for x in (*range(b + 1, b + 1 + k), *range(2 * b - k + 1, 2 * b + 1)) if x <= hi}
            b *= 2
        return sorted(out | {hi})

    Bs, Tqs = ends(64, max_seqs, 4), ends(16, n_positions - 1, 2)
    for Tq in Tqs:
        Tks, b = {Tq + 1}, 1
        while b < n_positions:
            if b + 1 > Tq + 1:
                Tks.add(b + 1)
            b *= 2
        for B in Bs:
            total = B * Tq
            if total - (Tq - 1) > budget:
                break
            cuts = {0, total % 16, 1}
            for cut in cuts:
                if cut >= Tq or total - cut > budget or total - cut <= min_tokens or (cut and B == 1):
                    continue
                q = [Tq] * (B - 1) + [Tq - cut]
                for Tk in sorted(Tks):
                    yield q, [Tk] * (B - 1) + [Tk - cut]


def _tables_array(context_lens, tables, min_blocks: int = 1) -> np.ndarray:
    """(B, 1 + max blocks) int32: each row's context length, then its block ids (zero-padded)."""
    mb = max(min_blocks, max(len(t.blocks) for t in tables))
    h32 = np.zeros((len(tables), mb + 1), np.int32)
    h32[:, 0] = context_lens
    for i, t in enumerate(tables):
        h32[i, 1:1 + len(t.blocks)] = t.blocks
    return h32


class ModelRunner:
    """Runs a model's steps over a KV block pool.

    ``cuda_graphs``: True captures the decode step per batch bucket (CUDA and the triton backend only;
    otherwise off, said in ``notes``); ``"eager"`` runs that same device-side step without capturing it
    (any device and backend: the host logic of the graph path, testable on the CPU); False: none.
    ``compile``: torch.compile the decode forward instead (the triton backend's through torch.ops.tritune).
    ``graph_prefill_tokens``: a step whose prefill rows number at most this (and fit the largest bucket with
    its decodes) runs them inside the device-side step (the module docstring); the buckets grow to hold
    ``max_num_seqs`` + this many rows. 0: prefills always eager. ``defer_capture``: build the graphs' state
    but capture nothing yet (``graphs.capture()`` later: a tensor-parallel group's ranks capture together).
    """

    def __init__(self, model, pool, *, max_num_seqs: int, cuda_graphs=True, compile: bool = False,
                 graph_buckets=GRAPH_BUCKETS, hist: int = 16, fused_decode="auto",
                 graph_prefill_tokens: int = GRAPH_PREFILL_TOKENS, invariant: bool = False,
                 defer_capture: bool = False):
        self.invariant = bool(invariant)    # batch-invariant mode (tritune.model.engine.invariant)
        if cuda_graphs not in (True, False, "eager"):
            raise ValueError(f"cuda_graphs: expected True, False or 'eager', got {cuda_graphs!r}")
        if isinstance(graph_prefill_tokens, bool) or not isinstance(graph_prefill_tokens, int) \
                or graph_prefill_tokens < 0:
            raise ValueError(f"graph_prefill_tokens: expected an int >= 0, got {graph_prefill_tokens!r}")
        if cuda_graphs and compile:
            raise ValueError("cuda_graphs and compile: pick one fast decode path")
        self.config = model.config
        self.device = torch.device(model.device)
        self.pool = pool
        self.max_blocks = -(-model.max_context // pool.block_size)
        self.notes: list[str] = []
        # eager forwards only write real slots, so the torch backend skips its masked write (a host sync)
        # (an FP8 cache keeps its own write: it quantizes)
        plain = model.backend == "torch" and getattr(model.ops, "gather_kv", None) is None
        self.model = model.with_ops(IndexWriteOps(model.ops)) if plain else model
        buckets = [b for b in graph_buckets if b < max_num_seqs] + [min(
            max_num_seqs, next((b for b in graph_buckets if b >= max_num_seqs), max_num_seqs))]
        buckets = sorted(set(buckets))
        self.graph_prefill_tokens = graph_prefill_tokens if cuda_graphs else 0
        if self.graph_prefill_tokens:
            buckets = prefill_buckets(buckets, max(buckets) + graph_prefill_tokens)
        self.graphs = None
        self.compiled = None
        # batch-invariant rows must not take their attention config from their neighbours' lengths: one width
        widths = [self.max_blocks] if self.invariant else None
        if cuda_graphs == "eager":
            # the model's own ops: padding rows (slot -1) go through write_kv, which must skip them
            self.graphs = DecodeGraphs(self._decode_model(model, fused_decode, buckets), pool, self.max_blocks,
                                       buckets, hist=hist, capture=False, n_eos=len(eos_ids(model)),
                                       widths=widths)
            self.notes.append(f"device-side decode step at batch {buckets}, run eagerly (no capture)")
        elif cuda_graphs:
            if self.device.type != "cuda":
                self.notes.append("cuda_graphs off: no CUDA device")
            elif model.backend != "triton":
                self.notes.append("cuda_graphs off: the torch backend's write_kv masks padding rows on the "
                                  "host; use backend='triton' (or compile=True)")
            elif not getattr(model.ops, "capturable", False):
                self.notes.append("cuda_graphs off: the decode step syncs with the host (no paged-attention "
                                  f"kernel for head dim {model.head_dim})")
            else:
                self.graphs = DecodeGraphs(self._decode_model(model, fused_decode, buckets), pool, self.max_blocks,
                                           buckets, hist=hist, n_eos=len(eos_ids(model)), widths=widths,
                                           capture=not defer_capture)
                when = ("captured when its group captures" if defer_capture
                        else f"captured in {self.graphs.capture_s:.1f} s")
                self.notes.append(f"cuda graphs for decode at batch {self.graphs.buckets} x block-table width "
                                  f"{self.graphs.widths} ({when})")
        if self.graphs is None:
            self.graph_prefill_tokens = 0
        elif self.graph_prefill_tokens:
            self.notes.append(f"prefill rows in the device-side step: up to {self.graph_prefill_tokens} a step")
        if compile:
            self._compile(model, pool)

    def _compile(self, model, pool) -> None:
        """``compile=True``: GPT-2's compiled decode (:class:`CompiledDecode`), or the family's own
        (``model.compiled_decode(kv, write_kv)``, None where its backend has none); else a note why not."""
        from tritune.model.gpt2.weights import GPT2Weights

        gpt2 = isinstance(model.w, GPT2Weights)
        family = None if gpt2 else getattr(self.model, "compiled_decode", None)
        if not gpt2 and family is None:
            self.notes.append(f"compile off: not for this family ({getattr(model.config, 'model_type', '?')}: the "
                              "compiled decode is GPT-2's layer, read by its weight names)")
        elif is_quantized(model):
            self.notes.append("compile off: quantized linears have no compiled decode")
        elif getattr(model.ops, "gather_kv", None) is not None:
            self.notes.append("compile off: the compiled decode reads a dense KV cache")
        elif model.backend == "triton" and not getattr(model.ops, "capturable", False):
            self.notes.append("compile off: no paged-attention kernel for head dim "
                              f"{model.head_dim}")
        else:
            self.compiled = CompiledDecode(self.model, pool) if gpt2 else family(pool, _index_write_kv)
            if self.compiled is None:
                self.notes.append(f"compile off: no compiled decode for this family on the {model.backend} backend")
                return
            on = "the Triton kernels as torch.ops.tritune" if model.backend == "triton" else "the torch ops"
            self.notes.append(f"decode forward's layer and head under torch.compile(dynamic=True) on {on}, "
                              "one compile for all layers; KV write and prefill eager")

    def _decode_model(self, model, fused_decode, buckets):
        """The model the device-side decode step runs: batches of up to 8 rows as one persistent launch
        (tritune.model.engine.fused_decode) when ``fused_decode`` (True, False, "auto": where measured faster on
        this GPU) picks it, today's per-op step otherwise (and for larger buckets)."""
        from tritune.model.engine import fused_decode as FD

        use, why = FD.choose(model, self.pool, fused_decode, max(buckets))
        self.notes.append(why)
        if not use:
            return model.with_ops(model.ops)
        return FD.fused_model(model.with_ops(model.ops), self.pool, max_rows=min(FD.MAX_ROWS, max(buckets)))

    @property
    def fast(self) -> bool:
        """Whether decodes have a path of their own (a prefill then costs a forward of its own)."""
        return self.graphs is not None or self.compiled is not None

    def graph_batch(self, B: int) -> bool:
        """Whether B decode rows fit a bucket of the device-side step."""
        return self.graphs is not None and self.graphs.bucket(B) is not None

    def graph_prefill(self, out) -> bool:
        """Whether a step's prefill rows ride in the device-side step: at most ``graph_prefill_tokens`` of
        them, fitting the largest bucket with the step's decodes."""
        P = self.graph_prefill_tokens
        if not P or not out.prefill:
            return False
        Tp = sum(map(len, out.prefill_ids))
        return Tp <= P and Tp + len(out.decode) <= self.graphs.Bmax

    # -------------------------------------------------------------------------------------- forwards
    def forward(self, out) -> tuple[torch.Tensor, str]:
        """The logits of a scheduled step (prefills' last tokens, then decodes), and the path it took:
        "eager" (one forward), "mixed" (one forward of prefills and decodes), "graph" or "compile" (the
        decodes on their fast path, prefills eager beside them), "graph-mixed" or "graph-prefill" (the
        prefill rows inside the device-side step, with the decodes or alone)."""
        if self.graph_prefill(out):
            return self._graph_rows(out), "graph-mixed" if out.decode else "graph-prefill"
        Td = len(out.decode)
        ctx = {"prefill_starts": out.prefill_starts, "prefill_tables": out.prefill_tables,
               "sample": out.prefill_sample}
        fast = None
        if Td and self.graph_batch(Td):
            fast = "graph"
        elif Td and self.compiled is not None:
            fast = "compile"
        if fast is None:
            logits = self.eager(out.prefill_ids, out.prefill_slots, out.decode_ids, out.decode_positions,
                                out.decode_slots, out.context_lens, out.decode_tables, **ctx)
            return logits, "mixed" if out.prefill and Td else "eager"
        parts = []
        if out.prefill:
            parts.append(self.eager(out.prefill_ids, out.prefill_slots, [], [], [], [], [], **ctx))
        if fast == "graph":
            pos = out.decode_positions
            self.graphs.load(out.decode_ids, pos, [p + 1 for p in pos], [-1] * Td, out.decode_tables)
            parts.append(self.graphs.run(Td, 1))
        else:
            parts.append(self._compiled_decode(out.decode_ids, out.decode_positions, out.decode_slots,
                                               out.context_lens, out.decode_tables)[:Td])
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), fast

    def _graph_rows(self, out) -> torch.Tensor:
        """A step's decodes and prefill rows as one step of the device-side graph: the decodes in rows
        0..Td-1 (the rows a decode-only step gives them, so their block tables stay loaded), then each
        prefill token a row of its own, the sequence's table shared. One step: every row stops after it.
        Logits in :meth:`forward`'s order: each sampled prefill's last row, then the decodes."""
        Td = len(out.decode)
        ids, pos, tables = list(out.decode_ids), list(out.decode_positions), list(out.decode_tables)
        last = []
        for toks, s, t, smp in zip(out.prefill_ids, out.prefill_starts, out.prefill_tables, out.prefill_sample):
            ids += toks
            pos += range(s, s + len(toks))
            tables += [t] * len(toks)
            if smp:
                last.append(len(ids) - 1)
        B = len(ids)
        self.graphs.load(ids, pos, [p + 1 for p in pos], [-1] * B, tables)
        logits = self.graphs.run(B, 1)
        if not last:
            return logits[:Td]
        rows = torch.from_numpy(np.asarray(last + list(range(Td)), np.int64)).to(self.device, non_blocking=True)
        return logits.index_select(0, rows)

    def graph_launch(self, ids, positions, stops, eos, tables, steps: int, gpu_timing: bool = False, draw=None):
        """``steps`` decode steps of these rows queued on the device-side step, no host sync: the handle
        :meth:`graph_collect` reads their tokens from (the host may do other work meanwhile, but loads nothing
        before that). ``draw(logits) -> [(row, token tensor)]``: rows whose token is drawn on the device
        after each step (sampling) instead of the greedy one the step feeds back."""
        g = self.graphs
        t0 = time.perf_counter()
        g.load(ids, positions, stops, eos, tables)
        t1 = time.perf_counter()
        ev = None
        if gpu_timing:
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
        if draw is None:
            g.run(len(ids), steps)
        else:
            for k in range(steps):
                for row, tok in draw(g.run(len(ids), 1)):
                    g.feed(row, tok, positions[row], k)
        if ev is not None:
            ev[1].record()
        return positions, steps, ev, {"load_s": t1 - t0, "launch_s": time.perf_counter() - t1}

    def graph_collect(self, launched):
        """The tokens of :meth:`graph_launch`'s steps (the one sync): (tokens per step per row, host seconds
        {load, launch, wait}, GPU seconds or None)."""
        positions, steps, ev, host = launched
        t2 = time.perf_counter()
        rows = self.graphs.tokens(positions, steps)
        host = {**host, "wait_s": time.perf_counter() - t2}
        return rows, host, (ev[0].elapsed_time(ev[1]) / 1e3 if ev is not None else None)

    def _compiled_decode(self, ids, positions, slots, context_lens, tables):
        """The compiled decode on the batch padded to at least 2 rows (a copy of row 0, which writes the
        same K/V to the same slot) and the block tables to at least 2 columns, so one dynamic compile covers
        every step (a dim of size 1 would be specialised and compiled again)."""
        dev = self.device
        B = max(2, len(ids))
        ids, positions, slots = list(ids), list(positions), list(slots)
        context_lens, tables = list(context_lens), list(tables)
        while len(ids) < B:
            ids.append(ids[0]), positions.append(positions[0]), slots.append(slots[0])
            context_lens.append(context_lens[0]), tables.append(tables[0])
        h = torch.tensor(np.concatenate([np.asarray(ids, np.int64), np.asarray(positions, np.int64),
                                         np.asarray(slots, np.int64)]))
        d = h.to(dev, non_blocking=True)
        d32 = torch.from_numpy(_tables_array(context_lens, tables, 2)).to(dev, non_blocking=True)
        return self.compiled(d[:B], d[B:2 * B], d[2 * B:], d32[:, 1:], d32[:, 0].contiguous())

    @staticmethod
    def logit_rows(seq_lens, n_decode: int, sample=None, all_logits: bool = False):
        """(cu_seqlens, rows, empty) of an eager step: the flat rows whose logits come back (each sampled
        prefill's last token, or every prefill token with ``all_logits``, then every decode row). A step
        of chunks that sample nothing gets one dummy row and ``empty`` (the forward just writes K/V)."""
        cu = np.zeros(len(seq_lens) + 1, np.int64)
        np.cumsum(seq_lens, out=cu[1:])
        Tp = int(cu[-1])
        last = np.arange(Tp) if all_logits else (cu[1:] - 1)[np.asarray(sample, bool)] if sample is not None \
            else cu[1:] - 1
        rows = np.concatenate([last, Tp + np.arange(n_decode)]).astype(np.int64)
        empty = len(rows) == 0
        if empty:
            rows = np.zeros(1, np.int64)
        return cu, rows, empty

    def eager(self, prefill_ids, prefill_slots, decode_ids, decode_positions, decode_slots, context_lens, tables,
              *, prefill_starts=None, prefill_tables=None, sample=None, all_logits: bool = False):
        """Prefills and decodes in one forward (see :func:`forward_step`); logits in the same order.

        ``prefill_starts``: each prefill's first position (the tokens before it are in the cache, read
        through ``prefill_tables``); ``sample``: which prefills get logits (their last row; default
        all); ``all_logits``: every prefill row's logits instead (speculative verification)."""
        if self.invariant:          # batch-invariant mode: every row through one attention over the cache
            from tritune.model.engine import invariant
            return invariant.eager(self, prefill_ids, prefill_slots, decode_ids, decode_positions, decode_slots,
                                   context_lens, tables, prefill_starts=prefill_starts,
                                   prefill_tables=prefill_tables, sample=sample, all_logits=all_logits)
        dev = self.device
        seq_lens = [len(s) for s in prefill_ids]
        Tp, Td = sum(seq_lens), len(decode_ids)
        starts = prefill_starts if prefill_starts is not None else [0] * len(seq_lens)
        ids = np.fromiter((t for s in prefill_ids for t in s), np.int64, Tp)
        pos = (np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, seq_lens)])
               if seq_lens else np.zeros(0, np.int64))
        slots = np.fromiter((t for s in prefill_slots for t in s), np.int64, Tp)
        cu, rows, empty = self.logit_rows(seq_lens, Td, sample, all_logits)
        h64 = torch.from_numpy(np.concatenate([ids, np.asarray(decode_ids, np.int64), pos,
                                               np.asarray(decode_positions, np.int64), slots,
                                               np.asarray(decode_slots, np.int64), rows]))
        T = Tp + Td
        d64 = h64.to(dev, non_blocking=True)
        kw = {}
        if Tp:
            kw["seq_lens"] = seq_lens
            kw["cu_seqlens"] = torch.from_numpy(cu.astype(np.int32)).to(dev, non_blocking=True)
        if Td:
            d32 = torch.from_numpy(_tables_array(context_lens, tables)).to(dev, non_blocking=True)
            kw["block_tables"], kw["context_lens"] = d32[:, 1:], d32[:, 0].contiguous()
        if any(starts):
            bs = self.pool.block_size
            ctx_lens = [s + n for s, n in zip(starts, seq_lens)]
            idx = np.concatenate([np.asarray(t.blocks, np.int64)[np.arange(m) // bs] * bs + np.arange(m) % bs
                                  for t, m in zip(prefill_tables, ctx_lens)])
            # the gathered K/V padded to a multiple of 16 rows (unread: cu_k bounds each context): Triton
            # specialises on the packed total, so an unpadded one would triple the variants to warm up
            idx = np.concatenate([idx, np.zeros(-len(idx) % 16, np.int64)])
            cu_k = np.zeros(len(ctx_lens) + 1, np.int32)
            np.cumsum(ctx_lens, out=cu_k[1:])
            kw["context"] = (torch.from_numpy(idx).to(dev, non_blocking=True),
                             torch.from_numpy(cu_k).to(dev, non_blocking=True), max(ctx_lens), ctx_lens)
        logit_rows = None if Tp == 0 else d64[3 * T:]
        logits = forward_step(self.model, self.pool, d64[:T], d64[T:2 * T], d64[2 * T:3 * T],
                              logit_rows=logit_rows, **kw)
        return logits[:0] if empty else logits

    # -------------------------------------------------------------------------------------- warm-up
    def prefill_variant(self, seq_lens, ctx_lens=None):
        """The prefill attention launch of a step's prefills (query lengths; context lengths where they
        continue cached sequences), as Triton tells its variants apart (each compiled on first use): the
        config of its (sequences, longest query, longest context) bucket, and the int arguments it
        specialises on (packed query and key totals, row blocks, sequences x heads). None: no kernel."""
        from tritune.kernels import attention as A

        m = self.model
        if m.backend != "triton" or m.head_dim not in A.HEAD_DIMS or not seq_lens:
            return None
        ctx = seq_lens if ctx_lens is None else ctx_lens
        B, Tq, Tk = len(seq_lens), max(seq_lens), max(ctx)
        cfg = A.VARLEN_SPEC.config_for(A.Problem(B, m.n_heads, m.n_kv_heads, Tq, Tk, m.head_dim, True), m.dtype)
        total_k = sum(ctx) if ctx_lens is None else -(-sum(ctx) // 16) * 16    # (eager pads the gather)
        return (ctx_lens is not None, tuple(sorted(cfg.items())),
                *map(_int_class, (sum(seq_lens), total_k, -(-Tq // cfg["BLOCK_M"]), B * m.n_heads)))

    @torch.inference_mode()
    def warm_context(self, budget: int, max_num_seqs: int) -> int:
        """Prefills that continue cached sequences (prefix-cache hits, prefill chunks, a preempted
        request's recompute) attend through the context path, whose (short query, long context) launches
        the ladder of whole prompts never makes: one eager prefill per variant (:meth:`prefill_variant`)
        of every kind a step can make (an H100 HTTP round met them in its first burst of prefix hits: ~1 s
        of compiling before its requests were added). Returns the prefills run."""
        if self.prefill_variant([1], [2]) is None:
            return 0
        table = type("Table", (), {"blocks": [0] * self.max_blocks})()
        seen, n = set(), 0
        for q, ctx in _context_candidates(self.model.max_context, max_num_seqs, budget, self.graph_prefill_tokens):
            key = self.prefill_variant(q, ctx)
            if key in seen:
                continue
            seen.add(key)
            self.eager([[0] * k for k in q], [[-1] * k for k in q], [], [], [], [], [],
                       prefill_starts=[m - k for k, m in zip(q, ctx)], prefill_tables=[table] * len(q))
            n += 1
        return n

    @torch.inference_mode()
    def warm_up(self, max_batch_tokens: int, max_num_seqs: int) -> float:
        """Compile the kernel variants a serving run meets, before it runs (seconds taken).

        The triton backend's kernels compile on first use of each variant, and their launch configs
        depend on the step's sizes (total prefill tokens, longest sequence, rows of logits, decode batch):
        a variant first met mid-run stalls that step for a compile (around a second each on the H100
        machine's host). So: eager prefill forwards over a ladder of total token counts (16, 17, 32, 33,
        ... up to the step budget, multiples of 16 and not), packed as sequences of the whole context and
        of 256 tokens; then B sequences of L tokens for B and L powers of two (and B − 1, L + 1: the same
        buckets, the other divisibility of the counts Triton specialises on; each packed once to a total of
        tokens divisible by 16 and once not, since varlen attention takes the packed totals as arguments),
        the buckets prefill attention picks its configs by; without a device-side decode step, decode
        forwards at every batch size of the same ladder. Every slot is -1: nothing is written to the cache. serve-bench reports any
        variant still compiled inside a timed run (``jit_compiles``).
        """
        t0 = time.perf_counter()
        if self.model.backend != "triton":
            return 0.0
        ctx_max = self.model.max_context
        budget = max_batch_tokens
        sizes, n = [], 16
        while n <= budget:
            sizes += [n, n + 1] if n + 1 <= budget else [n]
            n *= 2
        for cap in sorted({ctx_max, min(256, ctx_max)}):
            for T in sizes:
                lens = [cap] * (T // cap) + ([T % cap] if T % cap else [])
                self.eager([[0] * k for k in lens], [[-1] * k for k in lens], [], [], [], [], [])
        # Prefill attention picks its config by (sequences, longest sequence) buckets and specialises on
        # its counts (tokens, sequences x heads: divisible by 16 or not): B sequences of L tokens for every
        # power of two of each, B - 1 and L + 1 too (serve-bench on the H100 met three variable-length
        # attention variants inside its timed run without this, one with B only: ~1 s of compiling each).
        L = 16
        while L <= ctx_max:
            for n in sorted({L, min(L + 1, ctx_max)}):
                B = 1
                while B * n <= budget and B <= max_num_seqs:
                    for b in sorted({B, max(1, B - 1)}):  # B - 1: same bucket, other divisibility of B·heads
                        for lens in _both_totals(b, n):
                            self.eager([[0] * k for k in lens], [[-1] * k for k in lens], [], [], [], [], [])
                    B *= 2
            L *= 2
        self.warm_context(budget, max_num_seqs)
        if self.graphs is None:
            table = type("Table", (), {"blocks": [0]})()
            for B in [b for b in [1, 2, 3] + sizes if b <= max_num_seqs]:
                self.eager([], [], [0] * B, [0] * B, [-1] * B, [1] * B, [table] * B)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
