"""The decode step on the device, captured as one CUDA graph per batch bucket, and the guard that keeps
Triton compiles out of captures.

:class:`DecodeGraphs`: the whole decode step, state included. The graph reads each row's token, position
and block table from persistent device buffers, derives slots and context lengths, runs the model, takes
the greedy argmax and feeds it back as the next input, advancing the position (two small kernels of this
module bracket the model). The host writes the state with one copy per load; ``run(B, steps)`` replays the
graph ``steps`` times back to back and :meth:`DecodeGraphs.tokens` reads every row's tokens with one sync.
A row that reaches its stop position or EOS turns to padding on the device. A batch of B runs in the
smallest bucket >= B; padding rows have position -1: slot -1 (``write_kv`` skips negative slots), context
length 1 and a valid block id, so they write nothing; their logits are dropped.

A compile (or a module load) inside a capture invalidates it, and can take the CUDA context with it
(``cudaErrorStreamCaptureInvalidated`` at ``capture_end``). So before capturing, :func:`prepare_capture`
runs every bucket's step eagerly with the variants a capture takes (PDL included: ``kernels.pdl_forced``),
then once more under :func:`no_compiles`: a kernel that still compiles on that identical second pass is a
:class:`CompileInCapture` error naming it, raised before any capture starts; the capture itself runs
under the same guard.
"""
from __future__ import annotations

import contextlib
import time

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import numpy as np
import torch
import triton
import triton.language as tl

from tritune import kernels as K


# ---------------------------------------------------------------------------------------------------
# No compile inside a capture
# ---------------------------------------------------------------------------------------------------
class CompileInCapture(RuntimeError):
    """A Triton kernel variant met where no compile may happen (a CUDA-graph capture, or the dry pass
    before one)."""


def _kernel_label(kwargs) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
    comp = kwargs.get("compile") if isinstance(kwargs.get("compile"), dict) else {}
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
    consts = []
    for k, v in (comp.get("constants") or {}).items():   # keyed by (argument index,) paths
        i = k[0] if isinstance(k, tuple) and k and isinstance(k[0], int) else None
        if isinstance(v, (int, float, bool, str)):
            consts.append(f"{names[i] if i is not None and i < len(names) else k}={v}")
    detail = ", ".join(consts + ([f"num_warps={comp['num_warps']}"] if comp.get("num_warps") else []))
    return f"{name}[{detail}]" if detail else name


@contextlib.contextmanager
def no_compiles(where: str):
    """Any Triton JIT cache miss (a compile, or a load from the on-disk cache) while active raises
    :class:`CompileInCapture` naming the kernel and its constexprs, before triton compiles anything.
    A hook already installed (e.g. serve-bench's compile log) still sees the miss first."""
    knobs = triton.knobs.runtime
    outer = knobs.jit_cache_hook

    def hook(*args, **kwargs):
        if outer is not None:
            outer(*args, **kwargs)
        raise CompileInCapture(
            f"Triton kernel {_kernel_label(kwargs)} would compile during {where}: the warm-up before "
            "CUDA-graph capture did not run this variant (a compile or module load inside a capture "
            "invalidates it and can lose the CUDA context)")

    knobs.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.jit_cache_hook = outer


def prepare_capture(buckets, run) -> None:
    """Before capturing ``run(b)`` for each bucket: run each once with the variants a capture takes (PDL
    forced: compiled, loaded, run), then once more under :func:`no_compiles`, so a variant the capture
    would still compile is an error now, outside any capture."""
    with K.pdl_forced():
        for b in buckets:
            run(b)
        with no_compiles("a second warm-up pass (the dry run before CUDA-graph capture)"):
            for b in buckets:
                run(b)


def capture_buckets(buckets, run, device, what: str) -> tuple[dict, dict, float]:
    """CUDA graphs of ``run(b)`` for each bucket ``b``: a dry run on a side stream (:func:`prepare_capture`;
    ``run`` must write nothing when its rows are padding or dead), then one capture per bucket, largest
    first so that the smaller graphs reuse its memory pool, under :func:`no_compiles` (``what`` names the
    capture in its error). Returns (graphs by bucket, each capture's return value by bucket, seconds)."""
    t0 = time.perf_counter()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        prepare_capture(buckets, run)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graphs, outs, pool = {}, {}, None
    with no_compiles(what):
        for b in sorted(buckets, reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                outs[b] = run(b)
            pool = g.pool() if pool is None else pool
            graphs[b] = g
    torch.cuda.synchronize(device)
    return graphs, outs, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------
# The two kernels that bracket the model in a decode step
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _step_in_kernel(Ids, Pos, BT, Wte, Wpe, X, Slots, Ctx, stride_bt, stride_wte, stride_wpe, E, max_pos,
                    BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr, HAS_WPE: tl.constexpr = True,
                    EMBED: tl.constexpr = True):
    """Row b of a decode step: x = wte[ids[b]] (+ wpe[pos[b]] where the family has learned positions), the
    new token's cache slot bt[b, pos // block_size] * block_size + pos % block_size and context length
    pos + 1. pos < 0 marks a padding row: slot -1 (write_kv skips it), context 1, position 0. Without
    ``EMBED`` x is left to the caller (a tensor-parallel rank holds a slice of the vocabulary)."""
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
    if EMBED:
        embed_row(Wte, Wpe, X, b, tok, p, stride_wte, stride_wpe, E, BLOCK_E, HAS_WPE)


@triton.jit
def embed_row(Wte, Wpe, X, row, tok, p, stride_wte, stride_wpe, E, BLOCK_E: tl.constexpr,
              HAS_WPE: tl.constexpr = True):
    """Row ``row`` of X = wte[tok] + wpe[p], the sum in fp32 rounded once: what torch's wte[ids] + wpe[pos]
    computes (shared by the decode step's and the speculative step's input kernels). Without ``HAS_WPE``
    (rotary families: positions applied inside the layers) X = wte[tok], copied as it is."""
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(Wte + tok * stride_wte + offs, mask=mask).to(tl.float32)
    if HAS_WPE:
        x = x + tl.load(Wpe + p.to(tl.int64) * stride_wpe + offs, mask=mask).to(tl.float32)
    tl.store(X + row.to(tl.int64) * E + offs, x.to(X.dtype.element_ty), mask=mask)


def embedding_tables(model):
    """(wte (V, E), wpe or None, width E) the device-side steps embed with: the token table and, for a
    family with learned positions, the position table (the contract's ``w.wte`` / ``w.wpe``)."""
    wte = model.w.wte
    wpe = getattr(model.w, "wpe", None)
    return wte, wpe, wte.shape[1]


@triton.jit
def _step_out_kernel(Logits, stride_l, V, Ids, Pos, Stop, Eos, Hist, R, PartV, PartI, Tickets,
                     CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
                     NE: tl.constexpr = 1, NE_P2: tl.constexpr = 2):
    """Row b after a decode step, CHUNKS programs per row: the greedy token (the first maximum of its
    logits, as torch.argmax). Program c takes the maximum of chunk c and its first index; the last of the
    row's programs to finish (a ticket) takes the first chunk holding the overall maximum and finishes the
    row: for a live row (pos >= 0) the token becomes the next input and lands in the row's ring of the
    last R tokens at (pos + 1) % R, and pos advances; the row turns to padding (pos -1) once pos reaches
    stop[b] or the token is one of the row's NE EOS ids eos[b, :] (-1: none). The ticket is reset for the next
    step."""
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
            es = tl.arange(0, NE_P2)
            eos = tl.load(Eos + b * NE + es, mask=es < NE, other=-1)
            hit = tl.max((eos == tok).to(tl.int32), axis=0) > 0
            tl.store(Pos + b, tl.where((pos + 1 >= stop) | hit, -1, pos + 1))


# ---------------------------------------------------------------------------------------------------
# The decode step with its state on the device, one CUDA graph per batch bucket and table width
# ---------------------------------------------------------------------------------------------------
MIN_WIDTH_TOKENS = 256   # the narrowest block table a decode graph is captured for, in tokens
WIDTH_STEP = 4           # each next width this many times the last, up to max_blocks


def table_widths(max_blocks: int, block_size: int = 16) -> list[int]:
    """The block-table widths (in blocks) decode graphs are captured at: from MIN_WIDTH_TOKENS of context,
    times WIDTH_STEP each, then ``max_blocks``. Paged attention picks its config by the table's capacity
    (it cannot read the lengths on the host inside a graph), so a step whose rows are all short runs a
    graph whose table view is narrow and gets the config tuned for short contexts, not the one for the
    model's whole context (for Llama-3's 131k positions: one split-KV chunk of 1024 tokens holding all of a
    160-token context, 8 programs doing the work)."""
    out, w = [], max(1, MIN_WIDTH_TOKENS // block_size)
    while w < max_blocks:
        out.append(w)
        w *= WIDTH_STEP
    return out + [max_blocks]


class DecodeGraphs:
    """The decode step with its metadata on the device, one CUDA graph per batch-size bucket and block-table
    width (:func:`table_widths`; ``widths=[max_blocks]``: one width, as the batch-invariant mode needs, where
    a row's config must not follow its neighbours' lengths).

    State (persistent device buffers, one int32 buffer filled by a single host-to-device copy per
    :meth:`load`): per row the input token, its position (-1: padding), the position at which the row
    stops, its EOS id, and its block table. A step (:meth:`run`) embeds the tokens and derives slots and
    context lengths on the device (one kernel), runs ``model.decode``, takes the greedy argmax, and
    advances the state on the device (one kernel): the token becomes the next input and lands in a ring
    of the last ``hist`` tokens, the position moves on, a row that reached its stop or produced its EOS
    turns to padding. ``capture=False`` runs the same step eagerly (no CUDA graphs: the CPU, and tests of
    the host logic). ``n_eos``: EOS ids a row may have (a model listing several, as Llama-3 does).
    """

    OUT_CHUNKS = 8

    def __init__(self, model, kv, max_blocks, buckets, *, hist: int = 16, capture: bool = True, n_eos: int = 1,
                 widths=None):
        self.model, self.kv = model, kv
        self.device = torch.device(model.device)
        self.buckets, self.Bmax, self.mb, self.R = list(buckets), buckets[-1], max_blocks, hist
        self.block_size = kv.k_caches[0].shape[1]
        self.widths = (table_widths(max_blocks, self.block_size) if widths is None
                       else sorted({min(int(w), max_blocks) for w in widths}))
        if not self.widths or self.widths[-1] != max_blocks:
            raise ValueError(f"widths: the widest must be max_blocks ({max_blocks}), got {widths}")
        self.width = self.widths[-1]       # the block-table width the loaded rows need (set by load)
        self.max_pos = min(model.max_context, max_blocks * self.block_size) - 1
        Bm, dev = self.Bmax, self.device
        pin = dev.type == "cuda"
        self.NE = NE = max(1, int(n_eos))
        self.top = (3 + NE) * Bm           # ids, positions, stops, EOS ids (NE a row); block tables after
        self.h = torch.zeros(self.top + Bm * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.n = self.h.numpy()
        self.n[Bm:2 * Bm] = -1             # every row padding
        self.n[3 * Bm:self.top] = -1       # no EOS
        self.d = self.h.to(dev)
        self.ids, self.pos, self.stop = (self.d[i * Bm:(i + 1) * Bm] for i in range(3))
        self.eos = self.d[3 * Bm:self.top]
        self.bt = self.d[self.top:].view(Bm, max_blocks)
        self.slots = torch.full((Bm,), -1, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(Bm, dtype=torch.int32, device=dev)
        self.hist = torch.zeros((Bm, hist), dtype=torch.int32, device=dev)
        # the argmax over the vocabulary in OUT_CHUNKS programs per row (a row alone in one program read
        # GPT-2's 50257 logits in 7 dependent 8192-wide steps: 9.4 us of a ~450 us batch-1 step)
        V = model.vocab_size
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
            self.capture()

    def _run(self, b, w=None):
        w = self.mb if w is None else w
        pdl = {"PDL": True, "launch_pdl": True} if self.pdl_ok and K.pdl_now("engine") else {"PDL": False}
        m = self.model
        wte, wpe, E = embedding_tables(m)
        x = torch.empty((b, E), dtype=m.dtype, device=self.device)
        sharded = getattr(m, "tp", None) is not None     # a tensor-parallel rank: its own vocabulary rows only
        _step_in_kernel[(b,)](self.ids, self.pos, self.bt, wte, wte if wpe is None else wpe, x, self.slots, self.ctx,
                              self.bt.stride(0), wte.stride(0), 0 if wpe is None else wpe.stride(0), E, self.max_pos,
                              BLOCK_SIZE=self.block_size, BLOCK_E=triton.next_power_of_2(E),
                              num_warps=4 if E >= 512 else 1, HAS_WPE=wpe is not None, EMBED=not sharded, **pdl)
        if sharded:   # the family's embedding over the group (vocab-parallel rows, one all-reduce)
            x = m.embed(self.ids[:b], self.ctx[:b] - 1)
        logits = m.decode(None, None, self.kv, self.slots[:b], self.bt[:b, :w], self.ctx[:b], x=x)
        V = logits.shape[1]
        _step_out_kernel[(b, self.out_chunks)](logits, logits.stride(0), V, self.ids, self.pos, self.stop, self.eos,
                                               self.hist, self.R, self.part_v, self.part_i, self.tickets,
                                               CHUNKS=self.out_chunks,
                                               CHUNKS_P2=triton.next_power_of_2(self.out_chunks),
                                               BLOCK_V=self.out_block, NE=self.NE,
                                               NE_P2=max(2, triton.next_power_of_2(self.NE)),
                                               num_warps=8 if self.out_block >= 4096 else 4, **pdl)
        return logits

    def capture(self):
        """Capture every (bucket, width) step (what ``capture=True`` does at construction; a tensor-parallel
        rank captures later, when every rank of its group captures the same steps in the same order)."""
        keys = [(b, w) for b in self.buckets for w in self.widths]
        self.graphs, self.out, self.capture_s = capture_buckets(keys, lambda k: self._run(*k), self.device,
                                                                "CUDA-graph capture of the decode step")

    def bucket(self, B):
        return next((b for b in self.buckets if b >= B), None)

    def release(self) -> None:
        """Drop the captured graphs (the steps run eagerly after this). A graph that captured an NCCL
        collective holds its communicator: leaving the process group waits until every such graph is gone."""
        if self.graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs, self.out = {}, {}

    def load(self, ids, positions, stops, eos, tables):
        """Set rows 0..B-1 (the rest of the bucket: padding): input token, its position, the position at
        which the row stops, its EOS id (-1: none; with ``n_eos`` > 1 a sequence of up to that many ids),
        its block table (BlockTable or list of block ids; rows of one prefill chunk pass the same object)."""
        B = len(ids)
        b, Bm, n = self.bucket(B), self.Bmax, self.n
        n[:B] = ids
        n[Bm:Bm + B] = positions
        n[Bm + B:Bm + b] = -1
        n[2 * Bm:2 * Bm + B] = stops
        if self.NE == 1:
            n[3 * Bm:3 * Bm + B] = eos
        else:
            e = n[3 * Bm:self.top].reshape(Bm, self.NE)
            e[:B] = -1
            for i, ids_i in enumerate(eos):
                if isinstance(ids_i, (int, np.integer)):
                    e[i, 0] = ids_i
                else:
                    e[i, :len(ids_i)] = ids_i
        bt = n[self.top:].reshape(Bm, self.mb)
        rows, lens = self._rows, self._row_len
        i = 0
        while i < B:                         # a row's table only grows: write just its new blocks
            t = tables[i]
            blocks = t.blocks if hasattr(t, "blocks") else t
            k = len(blocks)
            j = i + 1
            while j < B and tables[j] is t:  # rows sharing one table (a prefill chunk's tokens): one write
                j += 1
            if j > i + 1 and not all(rows[r] is t and lens[r] == k for r in range(i, j)):
                bt[i:j, :k] = np.asarray(blocks, np.int32)
                rows[i:j], lens[i:j] = [t] * (j - i), [k] * (j - i)
            elif rows[i] is t:
                if k != lens[i]:
                    bt[i, lens[i]:k] = blocks[lens[i]:]
                    lens[i] = k
            else:
                bt[i, :k] = blocks
                rows[i], lens[i] = t, k
            i = j
        need = max(lens[:B], default=1)
        self.width = next(w for w in self.widths if w >= need)
        # The previous load's copy is done: every caller syncs on its tokens before loading again.
        k = self.top + b * self.mb
        self.d[:k].copy_(self.h[:k], non_blocking=True)

    def run(self, B, steps: int = 1):
        """``steps`` decode steps of the loaded rows; the logits (B, V) of the last."""
        key = (self.bucket(B), self.width)
        g = self.graphs.get(key)
        for _ in range(steps):
            if g is not None:
                g.replay()
            else:
                self.out[key] = self._run(*key)
        return self.out[key][:B]

    def feed(self, row: int, token: torch.Tensor, position: int, step: int) -> None:
        """After step ``step`` (0-based) of a run from the rows loaded at ``position``: row ``row``'s next
        input and history entry become ``token`` (a (1,) device tensor, e.g. a sampled token) instead of
        the greedy one. Stream-ordered, no host sync."""
        self.ids[row:row + 1].copy_(token)
        col = (position + 1 + step) % self.R
        self.hist[row, col:col + 1].copy_(token)

    def tokens(self, positions, steps: int) -> list[list[int]]:
        """The tokens of the last ``steps`` steps, per step, of the rows loaded at ``positions`` (one sync).
        A row that stopped early has stale values past its stop."""
        B, R = len(positions), self.R
        h = self.hist[:B].tolist()
        return [[h[i][(p + 1 + k) % R] for i, p in enumerate(positions)] for k in range(steps)]
