"""The serving engine: a paged KV block pool, the continuous-batching scheduler, and one step loop.

Each :meth:`Engine.step`:

1. ``schedule()`` picks the step's work: one decode token for every running sequence, plus whole
   prefills of newly admitted (or preempted, recomputed) requests while blocks and the token budget last.
2. One forward runs it. Without a fast decode path, prefills and decodes share a *single* forward over
   their packed tokens: LayerNorm and every linear are per token, so they run once over all rows; only
   attention splits (varlen causal attention over the prefill rows, paged attention over the decode
   rows), and ``write_kv`` stores every new K/V at once. With CUDA graphs (or ``torch.compile``) the decode
   rows go through the captured graph of their batch-size bucket and the prefill rows through an eager
   forward of their own: a graph cannot hold the prefills' shapes, which change every step.
3. Sampling (greedy rows by one argmax; others per request, with its own seeded generator), then
   ``update()`` appends the tokens, streams them, and retires finished requests, freeing their blocks.

CUDA graphs (:class:`DecodeGraphs`): one graph per bucket (1, 2, 4, ..., 256, up to ``max_num_seqs``)
of the *whole* decode step, state included: the graph reads each row's token, position and block table
from persistent device buffers, derives slots and context lengths, runs the model, takes the greedy
argmax and feeds it back as the next input, advancing the position (two small kernels of this module
bracket the model). The host writes the state with one copy per load. A step that only decodes greedy
requests therefore replays the graph up to ``decode_steps`` times back to back, with blocks reserved
ahead, and reads every row's tokens with a single sync; a row that reaches its length or EOS turns to
padding on the device. Steps with prefills, sampled requests or stop strings run one step at a time.
A batch of B runs in the smallest bucket >= B; padding rows have position -1: slot -1 (``write_kv``
skips negative slots), context length 1 and a valid block id, so they write nothing; their logits are
dropped.

Weight-only quantization (``quant="int8" | "int4"``): every linear (qkv, attention out, MLP in/out and
the tied lm_head) holds a :class:`~tritune.references.quant.QuantizedWeight` and runs through
``tritune.kernels.quant_matmul.quant_linear`` when that kernel has landed, else through the reference
path (dequantize to the model dtype, then a dense matmul: correct, not fast); ``Engine.notes`` says which.
"""
from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass, replace

import tritune.harness  # noqa: F401  (interpreter switch before triton loads)
import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritune import kernels as K
from tritune.model import gpt2 as G
from tritune.model.generate import sample
from tritune.model.kv_cache import BlockPool
from tritune.model.scheduler import FINISHED, Request, SamplingParams, Scheduler, SchedulerOutput

QUANT_MODES = (None, "int8", "int4")
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CPU_KV_BYTES = 256 << 20          # default KV budget without a GPU


# ---------------------------------------------------------------------------------------------------
# Ops the engine needs beyond gpt2's
# ---------------------------------------------------------------------------------------------------
def _index_write_kv(k, v, k_cache, v_cache, slot_mapping):
    """write_kv for the torch backend without the boolean mask of gpt2.torch_write_kv (a host sync and a
    graph break): the engine only calls it with real slots (no padding rows outside CUDA graphs)."""
    idx = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, idx, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, idx, v)


class _TorchEngineOps(G.TorchOps):
    write_kv = staticmethod(_index_write_kv)


# The decode step of the torch backend in pieces for torch.compile. A piece takes tensors only, so one
# compile serves every layer (regional compilation: a layer's compile, not the whole model's, which took
# minutes); the cache write stays outside (an in-place write into a compiled graph's input).
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


class _CompiledDecode:
    """GPT2's decode forward on the torch ops, its layer and head compiled (dynamic shapes)."""

    def __init__(self, model, kv):
        self.model, self.kv = model, kv
        self.layer_in = torch.compile(_layer_in, dynamic=True)
        self.layer_out = torch.compile(_layer_out, dynamic=True)
        self.head = torch.compile(_head, dynamic=True)

    def __call__(self, ids, pos, slots, block_tables, context_lens):
        from torch.fx.experimental import _config as fx_config

        m, kv = self.model, self.kv
        c = m.config
        eps = c.layer_norm_epsilon
        x = m._embed(ids, pos)
        # no duck sizing: a batch that happens to equal another dim (3, the head count, ...) on the first
        # call would tie the two and force a recompile at the next batch size
        with fx_config.patch(use_duck_shape=False):
            for i, L in enumerate(m.w.layers):
                kc, vc = kv.k_caches[i], kv.v_caches[i]
                qkv = self.layer_in(x, L.ln1_w, L.ln1_b, L.w_qkv, L.b_qkv, eps, c.n_head)
                _index_write_kv(qkv[:, 1], qkv[:, 2], kc, vc, slots)
                x = self.layer_out(x, qkv, kc, vc, block_tables, context_lens, L.w_o, L.b_o, L.ln2_w, L.ln2_b,
                                   L.w_fc, L.b_fc, L.w_proj, L.b_proj, eps)
            return self.head(x, m.w.lnf_w, m.w.lnf_b, m.w.lm_head, eps)


def quant_linear_impl():
    """(quant_linear or None, how linears run) for the quantized mode."""
    try:
        from tritune.kernels.quant_matmul import quant_linear
    except ImportError as e:
        why = ("kernel not landed" if getattr(e, "name", None) == "tritune.kernels.quant_matmul"
               else f"kernel import failed: {type(e).__name__}: {e}")
        return None, f"reference path: dequantize to the model dtype + dense matmul ({why})"
    return quant_linear, ("kernel tritune.kernels.quant_matmul.quant_linear for fp16/bf16 activations "
                          "(fp32: the reference path, dequantize + dense matmul)")


class QuantOps:
    """The model's ops, with linears whose weight is a QuantizedWeight run weight-only quantized."""

    def __init__(self, base, qlinear):
        self.base, self.qlinear = base, qlinear
        self.layer_norm, self.attn_prefill = base.layer_norm, base.attn_prefill
        self.write_kv, self.attn_decode = base.write_kv, base.attn_decode
        self.steps = dict(getattr(base, "steps", {}))

    def linear(self, x, w, b=None, activation=None, residual=None):
        from tritune.references.quant import QuantizedWeight

        if not isinstance(w, QuantizedWeight):
            return self.base.linear(x, w, b, activation=activation, residual=residual)
        x2 = x.reshape(-1, x.shape[-1])
        if self.qlinear is not None and x.dtype in (torch.float16, torch.bfloat16):   # the kernel's dtypes
            y = self.qlinear(x2, w, b)
        else:
            wd = w.dequantize(torch.float32).to(x.dtype).t()
            y = torch.mm(x2, wd) if b is None else torch.addmm(b, x2, wd)
        if activation == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        if residual is not None:
            y = y + residual.reshape(y.shape)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def quantize_weights(w, quant: str, group_size: int = 128):
    """A copy of GPT2Weights with every linear weight quantized (embeddings and norms kept as they are).

    Our projections are stored (K, N) for gemm; the quantizers take the nn.Linear (N, K) layout, hence .t().
    """
    from tritune.references import quant as Q

    bits = {"int8": 8, "int4": 4}[quant]
    if bits == 4 and group_size not in Q.INT4_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {Q.INT4_GROUP_SIZES}, got {group_size!r}")

    def q(t):
        K = t.shape[0]
        g = group_size
        if bits == 4 and K % g:   # a narrow model: the largest supported group that divides K
            g = next((s for s in sorted(Q.INT4_GROUP_SIZES, reverse=True) if s <= group_size and K % s == 0), None)
            if g is None:
                raise ValueError(f"int4: K={K} is not a multiple of any group size in {Q.INT4_GROUP_SIZES}")
        return Q.quantize(t.t().contiguous(), bits, g)

    layers = [replace(L, w_qkv=q(L.w_qkv), w_o=q(L.w_o), w_fc=q(L.w_fc), w_proj=q(L.w_proj)) for L in w.layers]
    return replace(w, layers=layers, lm_head=q(w.lm_head))


# ---------------------------------------------------------------------------------------------------
# The forward of one step
# ---------------------------------------------------------------------------------------------------
def forward_step(model, ops, kv, ids, positions, slots, *, seq_lens=(), cu_seqlens=None, block_tables=None,
                 context_lens=None, logit_rows=None, x=None):
    """One forward over packed tokens: ``sum(seq_lens)`` prefill rows first, then one row per decode.

    ids, positions, slots (T,) on the device; cu_seqlens (P+1,) int32 of the prefills; block_tables
    (Td, max_blocks) and context_lens (Td,) int32 of the decodes. ``x`` (T, E): the embedded tokens, when
    the caller embedded them (then ids and positions are not read). Returns the logits of ``logit_rows``
    (all rows when None). Nothing here syncs with the host when there are no prefills.
    """
    Tp = int(sum(seq_lens))
    T = slots.shape[0]
    max_seqlen = max(seq_lens) if Tp else 0

    def attend(i, q, k, v, written=False):
        kc, vc = kv.k_caches[i], kv.v_caches[i]
        if not written:
            ops.write_kv(k, v, kc, vc, slots)
        if Tp == T:
            return ops.attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen)
        if Tp == 0:
            return ops.attn_decode(q, kc, vc, block_tables, context_lens)
        return torch.cat((ops.attn_prefill(q[:Tp], k[:Tp], v[:Tp], seq_lens, cu_seqlens, max_seqlen),
                          ops.attn_decode(q[Tp:], kc, vc, block_tables, context_lens)))

    saved = model.ops
    model.ops = ops         # _blocks/_logits read model.ops
    try:
        kv_for = (lambda i: (kv.k_caches[i], kv.v_caches[i], slots)) if Tp == 0 else None
        x = model._blocks(model._embed(ids, positions) if x is None else x, attend, kv_for)
        if logit_rows is not None:
            x = x[logit_rows]
        return model._logits(x)
    finally:
        model.ops = saved


# ---------------------------------------------------------------------------------------------------
# The decode step on the device: its state in persistent buffers, captured once per batch bucket
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _step_in_kernel(Ids, Pos, BT, Wte, Wpe, X, Slots, Ctx, stride_bt, stride_wte, stride_wpe, E, max_pos,
                    BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Row b of a decode step: x = wte[ids[b]] + wpe[pos[b]], the new token's cache slot
    bt[b, pos // block_size] * block_size + pos % block_size and context length pos + 1.
    pos < 0 marks a padding row: slot -1 (write_kv skips it), context 1, position 0."""
    if PDL:  # the step's first gemv may start now (its weight tiles); our inputs come from the last step
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    tok = tl.load(Ids + b).to(tl.int64)
    pos = tl.load(Pos + b)
    p = tl.minimum(tl.maximum(pos, 0), max_pos)       # the clamp only keeps a host bug in bounds
    blk = tl.load(BT + b * stride_bt + p // BLOCK_SIZE)
    tl.store(Slots + b, tl.where(pos >= 0, blk * BLOCK_SIZE + p % BLOCK_SIZE, -1))
    tl.store(Ctx + b, p + 1)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    # the sum in fp32, rounded once: what torch's wte[ids] + wpe[pos] computes
    x = (tl.load(Wte + tok * stride_wte + offs, mask=mask).to(tl.float32)
         + tl.load(Wpe + p.to(tl.int64) * stride_wpe + offs, mask=mask).to(tl.float32))
    tl.store(X + b.to(tl.int64) * E + offs, x.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _step_out_kernel(Logits, stride_l, V, Ids, Pos, Stop, Eos, Hist, R, PartV, PartI, Tickets,
                     CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """Row b after a decode step, CHUNKS programs per row: the greedy token (the first maximum of its
    logits, as torch.argmax). Program c takes the maximum of chunk c and its first index; the last of the
    row's programs to finish (a ticket) takes the first chunk holding the overall maximum and finishes the
    row: for a live row (pos >= 0) the token becomes the next input and lands in the row's ring of the
    last R tokens at (pos + 1) % R, and pos advances; the row turns to padding (pos -1) once pos reaches
    stop[b] or the token is eos[b] (-1: none). The ticket is reset for the next step."""
    if PDL:  # launched while the LM head ends: wait for its logits
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(Logits + b.to(tl.int64) * stride_l + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(PartV + b * CHUNKS + c, m)
    tl.store(PartI + b * CHUNKS + c, c * BLOCK_V + i)
    tl.debug_barrier()
    ticket = tl.atomic_add(Tickets + b, 1, sem="acq_rel", scope="gpu")
    if ticket == CHUNKS - 1:
        cs = tl.arange(0, CHUNKS_P2)
        vals = tl.load(PartV + b * CHUNKS + cs, mask=cs < CHUNKS, other=float("-inf"), cache_modifier=".cg")
        _, j = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tok = tl.load(PartI + b * CHUNKS + j, cache_modifier=".cg")
        tl.store(Tickets + b, 0)
        pos = tl.load(Pos + b)
        if pos >= 0:
            tl.store(Ids + b, tok)
            tl.store(Hist + b * R + (pos + 1) % R, tok)
            stop = tl.load(Stop + b)
            eos = tl.load(Eos + b)
            tl.store(Pos + b, tl.where((pos + 1 >= stop) | (tok == eos), -1, pos + 1))


class DecodeGraphs:
    """The decode step with its metadata on the device, one CUDA graph per batch-size bucket.

    State (persistent device buffers, one int32 buffer filled by a single host-to-device copy per
    :meth:`load`): per row the input token, its position (-1: padding), the position at which the row
    stops, its EOS id, and its block table. A step (:meth:`run`) embeds the tokens and derives slots and
    context lengths on the device (one kernel), runs the model, takes the greedy argmax, and advances the
    state on the device (one kernel): the token becomes the next input and lands in a ring of the last
    ``hist`` tokens, the position moves on, a row that reached its stop or produced its EOS turns to
    padding. So ``run(B, steps)`` replays the graph ``steps`` times with no host work in between, and
    :meth:`tokens` reads every row's new tokens back with one sync.

    A batch of B runs in the smallest bucket >= B; padding rows (pos -1) have slot -1 (``write_kv``
    skips it), context length 1 and a valid block id in their table, so they write nothing and read one
    valid cache slot; their logits are dropped. ``capture=False`` runs the same step eagerly (no CUDA:
    tests of the host logic on the CPU).
    """

    OUT_CHUNKS = 8

    def __init__(self, model, ops, kv, max_blocks, buckets, *, hist: int = 16, capture: bool = True):
        self.model, self.ops, self.kv = model, ops, kv
        self.device = torch.device(model.device)
        self.buckets, self.Bmax, self.mb, self.R = list(buckets), buckets[-1], max_blocks, hist
        self.block_size = kv.k_caches[0].shape[1]
        self.max_pos = min(model.config.n_positions, max_blocks * self.block_size) - 1
        Bm, dev = self.Bmax, self.device
        pin = dev.type == "cuda"
        self.h = torch.zeros(4 * Bm + Bm * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.n = self.h.numpy()
        self.n[Bm:2 * Bm] = -1             # every row padding
        self.n[3 * Bm:4 * Bm] = -1         # no EOS
        self.d = self.h.to(dev)
        self.ids, self.pos, self.stop, self.eos = (self.d[i * Bm:(i + 1) * Bm] for i in range(4))
        self.bt = self.d[4 * Bm:].view(Bm, max_blocks)
        self.slots = torch.full((Bm,), -1, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(Bm, dtype=torch.int32, device=dev)
        self.hist = torch.zeros((Bm, hist), dtype=torch.int32, device=dev)
        # the argmax over the vocabulary in OUT_CHUNKS programs per row (a row alone in one program read
        # GPT-2's 50257 logits in 7 dependent 8192-wide steps: 9.4 us of a ~450 us batch-1 step)
        V = model.config.vocab_size
        self.out_block = max(16, triton.next_power_of_2(triton.cdiv(V, self.OUT_CHUNKS)))
        self.out_chunks = triton.cdiv(V, self.out_block)
        self.part_v = torch.empty(Bm * self.out_chunks, dtype=torch.float32, device=dev)
        self.part_i = torch.empty(Bm * self.out_chunks, dtype=torch.int32, device=dev)
        self.tickets = torch.zeros(Bm, dtype=torch.int32, device=dev)
        self.pdl_ok = K.pdl(dev)
        self._rows = [None] * Bm           # the block table each row's bt holds, and how many of its blocks
        self._row_len = [0] * Bm
        self.graphs, self.out = {}, {}
        self.capture_s = 0.0
        if capture:
            self._capture()

    def _run(self, b):
        pdl = {"PDL": True, "launch_pdl": True} if self.pdl_ok and K.pdl_now("engine") else {"PDL": False}
        m = self.model
        E = m.config.n_embd
        wte, wpe = m.w.wte, m.w.wpe
        x = torch.empty((b, E), dtype=m.dtype, device=self.device)
        _step_in_kernel[(b,)](self.ids, self.pos, self.bt, wte, wpe, x, self.slots, self.ctx, self.bt.stride(0),
                              wte.stride(0), wpe.stride(0), E, self.max_pos, BLOCK_SIZE=self.block_size,
                              BLOCK_E=triton.next_power_of_2(E), num_warps=4 if E >= 512 else 1, **pdl)
        logits = forward_step(m, self.ops, self.kv, None, None, self.slots[:b], block_tables=self.bt[:b],
                              context_lens=self.ctx[:b], x=x)
        V = logits.shape[1]
        _step_out_kernel[(b, self.out_chunks)](logits, logits.stride(0), V, self.ids, self.pos, self.stop, self.eos,
                                               self.hist, self.R, self.part_v, self.part_i, self.tickets,
                                               CHUNKS=self.out_chunks,
                                               CHUNKS_P2=triton.next_power_of_2(self.out_chunks),
                                               BLOCK_V=self.out_block,
                                               num_warps=8 if self.out_block >= 4096 else 4, **pdl)
        return logits

    def _capture(self):
        dev = self.device
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for b in self.buckets:      # compile + warm up every kernel variant before any capture
                self._run(b)            # (every row is padding: nothing is written)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.out[b] = self._run(b)
            pool = g.pool() if pool is None else pool
            self.graphs[b] = g
        torch.cuda.synchronize(dev)
        self.capture_s = time.perf_counter() - t0

    def bucket(self, B):
        return next((b for b in self.buckets if b >= B), None)

    def load(self, ids, positions, stops, eos, tables):
        """Set rows 0..B-1 (the rest of the bucket: padding): input token, its position, the position at
        which the row stops, its EOS id (-1: none), its block table (BlockTable or list of block ids)."""
        B = len(ids)
        b, Bm, n = self.bucket(B), self.Bmax, self.n
        n[:B] = ids
        n[Bm:Bm + B] = positions
        n[Bm + B:Bm + b] = -1
        n[2 * Bm:2 * Bm + B] = stops
        n[3 * Bm:3 * Bm + B] = eos
        bt = n[4 * Bm:].reshape(Bm, self.mb)
        rows, lens = self._rows, self._row_len
        for i, t in enumerate(tables):       # a row's table only grows: write just its new blocks
            blocks = t.blocks if hasattr(t, "blocks") else t
            k = len(blocks)
            if rows[i] is t:
                if k != lens[i]:
                    bt[i, lens[i]:k] = blocks[lens[i]:]
                    lens[i] = k
            else:
                bt[i, :k] = blocks
                rows[i], lens[i] = t, k
        # The previous load's copy is done: every caller syncs on its tokens before loading again.
        k = 4 * Bm + b * self.mb
        self.d[:k].copy_(self.h[:k], non_blocking=True)

    def run(self, B, steps: int = 1):
        """``steps`` decode steps of the loaded rows; the logits (B, V) of the last."""
        b = self.bucket(B)
        g = self.graphs.get(b)
        for _ in range(steps):
            if g is not None:
                g.replay()
            else:
                self.out[b] = self._run(b)
        return self.out[b][:B]

    def tokens(self, positions, steps: int) -> list[list[int]]:
        """The tokens of the last ``steps`` steps, per step, of the rows loaded at ``positions`` (one sync).
        A row that stopped early has stale values past its stop."""
        B, R = len(positions), self.R
        h = self.hist[:B].tolist()
        return [[h[i][(p + 1 + k) % R] for i, p in enumerate(positions)] for k in range(steps)]


# ---------------------------------------------------------------------------------------------------
# Results and streams
# ---------------------------------------------------------------------------------------------------
@dataclass
class Completion:
    request_id: object
    prompt_ids: list
    token_ids: list
    finish_reason: str | None
    text: str | None = None
    error: str | None = None          # why the request was rejected (generate(..., errors="return"))
    truncated: int = 0
    num_preemptions: int = 0
    ttft_s: float = float("nan")      # arrival -> first token
    tpot_s: float = float("nan")      # mean time per output token after the first
    latency_s: float = float("nan")   # arrival -> last token


def completion_of(req: Request, tokenizer=None) -> Completion:
    n = len(req.output_ids)
    ttft = req.first_token_time - req.arrival_time if req.first_token_time is not None else float("nan")
    lat = req.finish_time - req.arrival_time if req.finish_time is not None else float("nan")
    tpot = ((req.finish_time - req.first_token_time) / (n - 1)
            if n > 1 and req.finish_time is not None and req.first_token_time is not None else float("nan"))
    text = tokenizer.decode(req.output_ids) if tokenizer is not None else None
    return Completion(req.id, list(req.prompt_ids), list(req.output_ids), req.finish_reason, text,
                      repr(req.error) if req.error is not None else None, req.truncated, req.num_preemptions,
                      ttft, tpot, lat)


class TokenStream:
    """Iterate the tokens of one request as they are sampled; iterating drives ``engine.step()``
    (which advances every other request too). ``.request`` is the scheduler's Request."""

    def __init__(self, engine):
        self.engine = engine
        self.buffer: deque = deque()
        self.done = False
        self.request: Request | None = None

    def __call__(self, req, tok):
        if tok is None:
            self.done = True
        else:
            self.buffer.append(tok)

    def __iter__(self):
        return self

    def __next__(self) -> int:
        while not self.buffer:
            if self.done:
                raise StopIteration
            self.engine.step()
        return self.buffer.popleft()


# ---------------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------------
class Engine:
    """Continuous-batching GPT-2 serving on a paged KV cache.

    model: a :class:`tritune.model.gpt2.GPT2`. The KV pool is sized by exactly one of ``num_blocks``,
    ``kv_memory_bytes`` or ``kv_memory_fraction`` (of free GPU memory); default 0.5 on a GPU, 256 MiB on
    the CPU. ``max_batch_tokens``: tokens per step (prefill tokens + one per decode; >= n_positions, as
    prefills are not chunked). ``cuda_graphs``: capture the decode step per batch bucket (CUDA and the
    triton backend only; otherwise ignored and said in ``notes``). ``decode_steps``: on that path, a step
    that only decodes greedy requests runs up to this many graph replays back to back (the tokens fed
    back on the device), then reads all their tokens with one sync (1: one step per sync).
    ``compile``: torch.compile the decode forward instead (dynamic shapes). ``quant``: None, "int8" or
    "int4" weight-only for every linear.
    """

    def __init__(self, model, *, num_blocks: int | None = None, kv_memory_bytes: int | None = None,
                 kv_memory_fraction: float | None = None, block_size: int = 16,
                 max_batch_tokens: int | None = None, max_num_seqs: int = 256, cuda_graphs: bool = True,
                 compile: bool = False, quant: str | None = None, group_size: int = 128, tokenizer=None,
                 graph_buckets=GRAPH_BUCKETS, prefill_batching: bool | None = None, prefill_min_seats: int | None = None,
                 prefill_max_wait: int = 8, decode_steps: int = 16):
        if quant not in QUANT_MODES:
            raise ValueError(f"quant: expected one of {QUANT_MODES}, got {quant!r}")
        given = [n for n, v in (("num_blocks", num_blocks), ("kv_memory_bytes", kv_memory_bytes),
                                ("kv_memory_fraction", kv_memory_fraction)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of num_blocks, kv_memory_bytes, kv_memory_fraction (got {given})")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected an int >= 1, got {max_num_seqs!r}")
        if isinstance(decode_steps, bool) or not isinstance(decode_steps, int) or not 1 <= decode_steps <= 64:
            raise ValueError(f"decode_steps: expected an int in [1, 64], got {decode_steps!r}")
        self.decode_steps = decode_steps
        self.config = c = model.config
        self.device = torch.device(model.device)
        self.dtype = model.dtype
        self.tokenizer = tokenizer
        self.notes: list[str] = []
        self.block_size = block_size
        self.max_blocks = math.ceil(c.n_positions / block_size)

        # The model the engine runs: a shallow copy, so quantizing or swapping ops leaves the caller's alone.
        self.model = copy.copy(model)
        base_ops = _TorchEngineOps if model.backend == "torch" else model.ops
        self.quant = quant
        if quant:
            qlinear, how = quant_linear_impl()
            self.model.w = quantize_weights(model.w, quant, group_size)
            base_ops = QuantOps(base_ops, qlinear)
            self.notes.append(f"{quant} linears: {how}")
        self.ops = base_ops

        memory = None
        if num_blocks is None:
            if kv_memory_bytes is not None:
                memory = int(kv_memory_bytes)
            elif kv_memory_fraction is not None:
                memory = float(kv_memory_fraction)
            else:
                memory = 0.5 if self.device.type == "cuda" else CPU_KV_BYTES
        self.pool = BlockPool(c.n_layer, c.n_head, c.head_dim, block_size, self.dtype, self.device,
                              num_blocks=num_blocks, memory=memory)
        self.scheduler = Scheduler(self.pool, c.n_positions, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_batch_tokens, eos_token_id=c.eos_token_id,
                                   vocab_size=c.vocab_size)
        self.max_num_seqs = max_num_seqs
        self._generators: dict = {}
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "graph_steps": 0,
                      "multi_steps": 0, "mixed_steps": 0, "preemptions": 0}
        # host seconds per phase of step() (load/launch/wait: the graph path; forward: the others)
        self.timings = dict.fromkeys(("schedule_s", "forward_s", "load_s", "launch_s", "wait_s", "update_s"), 0.0)
        self.timings["tokens"] = 0
        self.gpu_timing = False     # True: CUDA events time the graph replays (stats["graph_gpu_s"])
        self.stats["graph_gpu_s"] = 0.0

        self.graphs = None
        self._compiled = None
        if cuda_graphs and compile:
            raise ValueError("cuda_graphs and compile: pick one fast decode path")
        if cuda_graphs:
            if self.device.type != "cuda":
                self.notes.append("cuda_graphs off: no CUDA device")
            elif model.backend != "triton":
                self.notes.append("cuda_graphs off: the torch backend's write_kv masks padding rows on the "
                                  "host; use backend='triton' (or compile=True)")
            else:
                buckets = [b for b in graph_buckets if b < max_num_seqs] + [min(
                    max_num_seqs, next((b for b in graph_buckets if b >= max_num_seqs), max_num_seqs))]
                self.graphs = DecodeGraphs(self.model, self.ops, self.pool, self.max_blocks, sorted(set(buckets)),
                                           hist=max(16, decode_steps))
                self.notes.append(f"cuda graphs for decode at batch {self.graphs.buckets} "
                                  f"(captured in {self.graphs.capture_s:.1f} s)")
        if compile:
            if model.backend != "torch" or quant:
                self.notes.append("compile off: it compiles the torch backend's ops (backend='torch', no quant)")
            else:
                self._compiled = _CompiledDecode(self.model, self.pool)
                self.notes.append("decode forward's layer and head under torch.compile(dynamic=True), one compile "
                                  "for all layers; KV write and prefill eager")
        # Prefill batching: with a fast decode path, a step that admits requests pays a whole eager forward
        # for its prefills (launch-bound: about as long as many graph decode steps), so while sequences are
        # decoding, admit only once enough seats are free for a batch of prefills (or after
        # prefill_max_wait steps of waiting). Without one, prefills ride in the decode forward: admit at once.
        fast = self.graphs is not None or self._compiled is not None
        self.prefill_batching = fast if prefill_batching is None else bool(prefill_batching)
        self.prefill_min_seats = max(1, max_num_seqs // 8) if prefill_min_seats is None else prefill_min_seats
        self.prefill_max_wait = prefill_max_wait
        self._waited = 0

    # -------------------------------------------------------------------------------------- requests
    def _ids(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt: text needs a tokenizer (Engine(..., tokenizer=...)) or pass token ids")
            return self.tokenizer.encode(prompt)
        return prompt

    def add_request(self, prompt, sampling: SamplingParams | None = None, *, request_id=None, stream=None,
                    truncate: bool = False, arrival_time: float | None = None) -> Request:
        """Queue a request (text with a tokenizer, or token ids); it joins at the next step.

        ``stream``: callable(request, token) (token None at the end) or a queue (``put``). A bad request
        raises ValueError/TypeError and leaves every other request as it was.
        """
        req = self.scheduler.add_request(self._ids(prompt), sampling, request_id=request_id, stream=stream,
                                         truncate=truncate, arrival_time=arrival_time)
        return req

    def stream(self, prompt, sampling: SamplingParams | None = None, **kw) -> TokenStream:
        """A :class:`TokenStream` over a new request's tokens (iterating it runs the engine)."""
        ts = TokenStream(self)
        ts.request = self.add_request(prompt, sampling, stream=ts, **kw)
        return ts

    def abort(self, request_id) -> Request:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, prompts, sampling=None, *, errors: str = "raise", truncate: bool = False) -> list[Completion]:
        """Run a batch of prompts to completion; one Completion per prompt, in order.

        ``sampling``: one SamplingParams for all, or a list (one per prompt). ``errors="raise"``: a bad
        prompt raises ValueError/TypeError naming its index, before anything runs; ``"return"``: it gets a
        Completion with finish_reason "error" and the message, and the others run.
        """
        if errors not in ("raise", "return"):
            raise ValueError(f"errors: expected 'raise' or 'return', got {errors!r}")
        prompts = list(prompts)
        if isinstance(sampling, (list, tuple)):
            if len(sampling) != len(prompts):
                raise ValueError(f"sampling: {len(sampling)} SamplingParams for {len(prompts)} prompts")
            samplings = list(sampling)
        else:
            samplings = [sampling] * len(prompts)
        reqs, results = [], [None] * len(prompts)
        for i, (p, s) in enumerate(zip(prompts, samplings)):
            try:
                reqs.append((i, self.add_request(p, s, truncate=truncate)))
            except (ValueError, TypeError) as e:
                if errors == "raise":
                    for _, r in reqs:
                        self.scheduler.abort(r.id)
                    raise type(e)(f"prompts[{i}]: {e}") from None
                results[i] = Completion(None, [], [], "error", error=f"{type(e).__name__}: {e}")
        while any(not r.finished for _, r in reqs):
            self.step()
        for i, r in reqs:
            results[i] = completion_of(r, self.tokenizer)
        return results

    def run(self) -> None:
        """Step until every queued request has finished."""
        while self.scheduler.has_unfinished():
            self.step()

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile the kernel variants a serving run meets, before it runs (seconds taken).

        The triton backend's kernels compile on first use of each variant, and their launch configs
        depend on the step's sizes (total prefill tokens, longest sequence, rows of logits, decode batch):
        a variant first met mid-run stalls that step for a compile (around a second each on the H100
        machine's host). So: eager prefill forwards over a ladder of total token counts (16, 17, 32, 33,
        ... up to the step budget, multiples of 16 and not), packed as sequences of the whole context and
        of 256 tokens; then B sequences of L tokens for B and L powers of two (and B − 1, L + 1: the same
        buckets, the other divisibility of the counts Triton specialises on), the buckets prefill attention
        picks its configs by; without CUDA graphs, decode forwards at every batch size
        of the same ladder. Every slot is -1: nothing is written to the cache. serve-bench reports any
        variant still compiled inside a timed run (``jit_compiles``).
        """
        t0 = time.perf_counter()
        if self.model.backend != "triton":
            return 0.0
        c = self.config
        budget = self.scheduler.max_num_batched_tokens
        sizes, n = [], 16
        while n <= budget:
            sizes += [n, n + 1] if n + 1 <= budget else [n]
            n *= 2
        for cap in sorted({c.n_positions, min(256, c.n_positions)}):
            for T in sizes:
                lens = [cap] * (T // cap) + ([T % cap] if T % cap else [])
                self._eager([[0] * k for k in lens], [[-1] * k for k in lens], [], [], [], [], [])
        # Prefill attention picks its config by (sequences, longest sequence) buckets and specialises on
        # its counts (tokens, sequences x heads: divisible by 16 or not): B sequences of L tokens for every
        # power of two of each, B - 1 and L + 1 too (serve-bench on the H100 met three variable-length
        # attention variants inside its timed run without this, one with B only: ~1 s of compiling each).
        L = 16
        while L <= c.n_positions:
            for n in sorted({L, min(L + 1, c.n_positions)}):
                B = 1
                while B * n <= budget and B <= self.max_num_seqs:
                    for b in sorted({B, max(1, B - 1)}):  # B - 1: same bucket, other divisibility of B·heads
                        self._eager([[0] * n] * b, [[-1] * n] * b, [], [], [], [], [])
                    B *= 2
            L *= 2
        if self.graphs is None:
            table = type("Table", (), {"blocks": [0]})()
            for B in [b for b in [1, 2, 3] + sizes if b <= self.max_num_seqs]:
                self._eager([], [], [0] * B, [0] * B, [-1] * B, [1] * B, [table] * B)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    # -------------------------------------------------------------------------------------- the step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Schedule, run one forward (or, on the graph path, up to ``decode_steps`` decode steps), sample,
        update. Returns the requests that finished."""
        tm = self.timings
        t0 = time.perf_counter()
        out = self.scheduler.schedule(admit=self._admit())
        if not out:
            return []
        t1 = time.perf_counter()
        tm["schedule_s"] += t1 - t0
        before = self.stats["decode_tokens"]
        try:
            if self._graph_only(out):
                finished = self._graph_decode(out)
            else:
                logits = self._forward(out)
                tokens = self._sample(out, logits)
                t2 = time.perf_counter()
                tm["forward_s"] += t2 - t1
                finished = self.scheduler.update(out, tokens)
                self.stats["steps"] += 1
                self.stats["decode_tokens"] += len(out.decode)
        except Exception as e:
            # The step's requests cannot go on (their caches are in an unknown state): end them with the
            # error, free their blocks, and leave the engine usable for the rest.
            self.scheduler._pending = False
            for req in out.requests:
                req.error = e
                self.scheduler.finish(req, "error")
            raise
        t3 = time.perf_counter()
        if self.tokenizer is not None:
            for req in out.requests:
                if req.sampling.stop and req.state != FINISHED:
                    text = self.tokenizer.decode(req.output_ids)
                    if any(s in text for s in req.sampling.stop):
                        self.scheduler.finish(req, "stop")
                        finished.append(req)
        for req in finished:
            self._generators.pop(req.id, None)
        st = self.stats
        if out.prefill:
            st["prefill_tokens"] += sum(map(len, out.prefill_ids))
        st["preemptions"] += len(out.preempted)
        tm["update_s"] += time.perf_counter() - t3
        tm["tokens"] += st["decode_tokens"] - before
        return finished

    def _admit(self) -> bool:
        sch = self.scheduler
        if not self.prefill_batching or not sch.running or not sch.waiting:
            self._waited = 0
            return True
        # (the scheduler's seat count, which a benchmark may lower after construction)
        seats = sch.max_num_seqs - len(sch.running)
        need = min(self.prefill_min_seats, max(1, sch.max_num_seqs // 8), len(sch.waiting))
        if seats >= need or self._waited >= self.prefill_max_wait:
            self._waited = 0
            return True
        self._waited += 1
        return False

    # -------------------------------------------------------------------------------------- graph decode
    def _graph_only(self, out: SchedulerOutput) -> bool:
        """A step of greedy decodes only, in a captured bucket: the device samples and feeds back."""
        return (self.graphs is not None and not out.prefill and self.graphs.bucket(len(out.decode)) is not None
                and all(r.sampling.temperature == 0 for r in out.decode))

    def _num_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps to run before the host looks at the tokens again."""
        reqs = out.decode
        K = self.decode_steps
        if K == 1 or (self.tokenizer is not None and any(r.sampling.stop for r in reqs)):
            return 1                    # stop strings are checked on the host after every token
        left = [r.max_new_tokens - len(r.output_ids) for r in reqs]
        K = min(K, max(left))           # rows that finish earlier turn to padding on the device
        sch = self.scheduler
        if sch.waiting:                 # admission decisions happen between host round trips
            if self.prefill_batching and len(sch.running) < sch.max_num_seqs:
                K = min(K, max(1, self.prefill_max_wait - self._waited))
            else:
                K = min(K, min(left))   # nobody can join before a seat frees: run until one does
        if K > 1 and not sch.reserve(out, K):
            K = 1                       # not enough free blocks to hold K tokens of every row
        return K

    def _graph_decode(self, out: SchedulerOutput) -> list[Request]:
        """Up to ``decode_steps`` greedy decode steps with one host sync; update with every token."""
        tm = self.timings
        t0 = time.perf_counter()
        K = self._num_steps(out)
        reqs, pos = out.decode, out.decode_positions
        eos = self.config.eos_token_id
        stops = [p + min(K, r.max_new_tokens - len(r.output_ids)) for r, p in zip(reqs, pos)]
        eoss = [-1 if eos is None or r.sampling.ignore_eos else eos for r in reqs]
        g = self.graphs
        g.load(out.decode_ids, pos, stops, eoss, out.decode_tables)
        t1 = time.perf_counter()
        if self.gpu_timing:
            ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev[0].record()
        g.run(len(reqs), K)
        if self.gpu_timing:
            ev[1].record()
        t2 = time.perf_counter()
        rows = g.tokens(pos, K)                       # the one sync
        t3 = time.perf_counter()
        if self.gpu_timing:
            self.stats["graph_gpu_s"] += ev[0].elapsed_time(ev[1]) / 1e3
        before = sum(len(r.output_ids) for r in reqs)
        finished = self.scheduler.update_steps(out, rows)
        st = self.stats
        st["decode_tokens"] += sum(len(r.output_ids) for r in reqs) - before
        st["steps"] += K
        st["graph_steps"] += K
        st["multi_steps"] += K > 1
        if K > 1 and self.scheduler.waiting and self.prefill_batching:
            self._waited += K - 1      # each replay was a step the queue waited
        tm["load_s"] += t1 - t0
        tm["launch_s"] += t2 - t1
        tm["wait_s"] += t3 - t2
        tm["update_s"] += time.perf_counter() - t3
        return finished

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        Td = len(out.decode)
        fast = None
        if Td and self.graphs is not None and self.graphs.bucket(Td) is not None:
            fast = "graph"
        elif Td and self._compiled is not None:
            fast = "compile"
        if fast is None:
            if out.prefill and Td:
                self.stats["mixed_steps"] += 1
            return self._eager(out.prefill_ids, out.prefill_slots, out.decode_ids, out.decode_positions,
                               out.decode_slots, out.context_lens, out.decode_tables)
        parts = []
        if out.prefill:
            parts.append(self._eager(out.prefill_ids, out.prefill_slots, [], [], [], [], []))
        if fast == "graph":
            self.stats["graph_steps"] += 1
            pos = out.decode_positions
            self.graphs.load(out.decode_ids, pos, [p + 1 for p in pos], [-1] * Td, out.decode_tables)
            parts.append(self.graphs.run(Td, 1))
        else:
            ids, pos, slots, bt, ctx = self._decode_inputs(out.decode_ids, out.decode_positions, out.decode_slots,
                                                           out.context_lens, out.decode_tables)
            parts.append(self._compiled(ids, pos, slots, bt, ctx)[:Td])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_inputs(self, ids, positions, slots, context_lens, tables):
        """Device inputs of the compiled decode: the batch padded to at least 2 rows (a copy of row 0,
        which writes the same K/V to the same slot) and the block tables to at least 2 columns, so one
        dynamic compile covers every step (a dim of size 1 would be specialised and compiled again)."""
        dev = self.device
        B = max(2, len(ids))
        ids, positions, slots = list(ids), list(positions), list(slots)
        context_lens, tables = list(context_lens), list(tables)
        while len(ids) < B:
            ids.append(ids[0]), positions.append(positions[0]), slots.append(slots[0])
            context_lens.append(context_lens[0]), tables.append(tables[0])
        h = torch.tensor(np.concatenate([np.asarray(ids, np.int64), np.asarray(positions, np.int64),
                                         np.asarray(slots, np.int64)]))
        mb = max(2, max(len(t.blocks) for t in tables))
        h32 = np.zeros((B, mb + 1), np.int32)
        h32[:, 0] = context_lens
        for i, t in enumerate(tables):
            h32[i, 1:1 + len(t.blocks)] = t.blocks
        d = h.to(dev, non_blocking=True)
        d32 = torch.from_numpy(h32).to(dev, non_blocking=True)
        return d[:B], d[B:2 * B], d[2 * B:], d32[:, 1:], d32[:, 0].contiguous()

    def _eager(self, prefill_ids, prefill_slots, decode_ids, decode_positions, decode_slots, context_lens, tables):
        """Prefills and decodes in one forward (see forward_step); logits in the same order."""
        dev = self.device
        seq_lens = [len(s) for s in prefill_ids]
        Tp, Td = sum(seq_lens), len(decode_ids)
        ids = np.fromiter((t for s in prefill_ids for t in s), np.int64, Tp)
        pos = np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens]) if seq_lens else np.zeros(0, np.int64)
        slots = np.fromiter((t for s in prefill_slots for t in s), np.int64, Tp)
        cu = np.zeros(len(seq_lens) + 1, np.int64)
        np.cumsum(seq_lens, out=cu[1:])
        rows = np.concatenate([cu[1:] - 1, Tp + np.arange(Td)])
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
            mb = max(len(t.blocks) for t in tables)
            h32 = np.zeros((Td, mb + 1), np.int32)
            h32[:, 0] = context_lens
            for i, t in enumerate(tables):
                h32[i, 1:1 + len(t.blocks)] = t.blocks
            d32 = torch.from_numpy(h32).to(dev, non_blocking=True)
            kw["block_tables"], kw["context_lens"] = d32[:, 1:], d32[:, 0].contiguous()
        logit_rows = None if Tp == 0 else d64[3 * T:]
        return forward_step(self.model, self.ops, self.pool, d64[:T], d64[T:2 * T], d64[2 * T:3 * T],
                            logit_rows=logit_rows, **kw)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[int]:
        reqs = out.requests
        greedy = logits.argmax(dim=-1)
        if all(r.sampling.temperature == 0 for r in reqs):
            return greedy.tolist()
        toks = greedy.tolist()
        for i, r in enumerate(reqs):
            s = r.sampling
            if s.temperature == 0:
                continue
            gen = self._generators.get(r.id)
            if gen is None and s.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(int(s.seed))
                self._generators[r.id] = gen
            toks[i] = int(sample(logits[i:i + 1], s.temperature, s.top_k, s.top_p, gen)[0])
        return toks

    # -------------------------------------------------------------------------------------- reports
    @property
    def peak_blocks(self) -> int:
        return self.pool.peak_used

    def describe(self) -> dict:
        return {"backend": self.model.backend, "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "quant": self.quant, "cuda_graphs": self.graphs is not None,
                "compile": self._compiled is not None, "num_blocks": self.pool.num_blocks,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs,
                "max_batch_tokens": self.scheduler.max_num_batched_tokens, "prefill_batching": self.prefill_batching,
                "prefill_min_seats": self.prefill_min_seats, "prefill_max_wait": self.prefill_max_wait,
                "notes": list(self.notes)}
