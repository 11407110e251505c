"""Batch-invariant serving: a request's logits, bit for bit, do not depend on what shares its steps.

A kernel's reduction order normally follows the step's shape: the tuned config of a GEMM is chosen per
bucket of M (tile sizes, split-K), the decode linears switch from gemv to gemm past a few rows, paged
attention's split-KV partition follows the batch and the block-table width, prefill attention is a
different kernel from decode attention, and torch's CPU matmul itself picks its blocking by M (measured:
fp32 ``addmm`` of a row alone differs from the same row inside a 37-row product). In this mode every
reduction a row takes depends only on that row:

- linears: one ``gemm`` config per (N, K, dtype), whatever M is (the heuristic default of the M=16
  bucket: 16-row tiles are the largest a 1-row problem accepts, and the kernel's masked rows make its
  per-element order independent of M; split-K fixed per (N, K) for the 1-row case, its slices summed in
  slice order: :func:`gemm_config`); quantized weights: one ``quant_matmul`` config
  likewise (fp32 activations: the weight dequantized once, then the same gemm);
- LayerNorm: in the prologue of the linear it feeds (``ln_linear``: ln_1 + qkv, ln_2 + MLP-in, ln_f + LM
  head, as the default mode's gemv fuses them), the row's statistics over K in chunks fixed by K and the
  pinned config, every row and every split-K slice computing its own; and the qkv projection writes K/V
  to the cache in its epilogue when the step asks (the decode step), the same bits ``write_kv`` would copy.
  So a decode step has the default step's launches. Where a linear does not take it (quantized weights
  on ``quant_matmul``) LayerNorm runs as its own kernel, one row per program (``ROWS=1``), the row's
  block pinned;
- RMSNorm (the Llama family): its own kernel, one row a program (``ROWS=1``), the row's block pinned;
  rotary and SwiGLU are elementwise (on the torch backend row by row, as GELU below);
- attention, prefill and decode alike: every row (prefill tokens and decode tokens of one step) attends
  through ``paged_attention`` over the KV cache, its context its own position + 1, with one config per
  model (fixed KV partition in tokens, so the chunks and their merge order follow only the row's own
  length) and block tables always ``ceil(n_positions / block_size)`` wide (the kernel's merge blocking
  follows the width). So a token's logits are the same whether it was prefilled or decoded: a
  preempted request recomputed by prefill continues exactly where it was;
- the torch backend: every op row by row, each row a fresh contiguous tensor (``_fresh``): LayerNorm, the
  linear (``addmm`` at M=1) with its GELU and residual, attention over the row's own context. A whole-batch
  call is not invariant even for elementwise ops: on the CPU, ``F.gelu`` over (T, 4E) splits into one chunk
  per thread, each chunk's tail computed by the scalar tanh (other bits than the vector one), so an element's
  bits followed T and the thread count (measured: 5, 7 or 16 threads, a 99-row step). A row alone also keeps
  the library's choice of kernel by pointer alignment (cuBLAS, CUDA LayerNorm's vectorized path) the same
  for every row, on the GPU as on the CPU;
- sampling: the argmax is exact; a seeded request draws from its own generator (``sampling.Sampler``).
  A sampled request without a seed draws from the global generator: not reproducible, in any mode.

The boundary this pins: bitwise equality holds between runs of this mode on the same device, dtype,
backend and tritune/triton/torch versions (the configs are per (N, K, dtype) and the GPU's SM count), and on
the CPU the same ``torch.get_num_threads()`` (a row wider than a thread's grain is still split by threads). It does
not make this mode equal to the default mode, nor the triton backend equal to the torch backend.

CUDA graphs are kept: the decode step captures these same ops. The cost: prefill attention reads the
cache per query row (O(n²) bytes instead of a flash kernel's O(n)), every linear runs 16-row tiles, and
a fused LayerNorm's statistics are computed by every program of its linear (from L2: a few KB a row).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from tritune.model.gpt2 import model as G
from tritune.references import quant as RQ
from tritune.kernels import num_sms

PARTITION_TOKENS = 256      # split-KV chunk of paged attention, in tokens (at most a quarter of the capacity)


# ---------------------------------------------------------------------------------------------------
# Pinned configs: functions of the problem's N, K (or heads, head dim, capacity) and dtype, never of M
# ---------------------------------------------------------------------------------------------------
# K tiles one split-K slice of a pinned gemm takes at most: one fill of the default's 4-stage pipeline, so a
# 1-row problem has its whole weight in flight at once instead of streaming it through a few programs
SLICE_K_TILES = 3


@functools.lru_cache(maxsize=None)
def gemm_config(N: int, K: int, trans_b: bool, bias: bool, act, residual: bool, dtype, ln: bool = False,
                kv: bool = False) -> dict:
    """The M=16 bucket's default (16-row tiles: the largest a 1-row problem accepts; the kernel's masked
    rows keep each element's order independent of M), with SPLIT_K chosen for one row, then pinned.

    Batch-1 decode is what this mode costs most (17% on the H100 with no split): a 16x64-tile grid over a
    narrow N has few programs (GPT-2-small-like c_proj at M=1: 12; the packaged model's: 4), each
    streaming K/BLOCK_K tiles one after another. SPLIT_K slices K so that each slice fits one pipeline
    fill (``SLICE_K_TILES``), while the grid at M=1 stays under half a wave. The split is invariant too:
    each slice accumulates its K tiles in order and the last program sums the slices in slice order
    (``kernels/gemm.py``), so an element's reduction order is a function of (N, K, config), never of M.

    ``ln``: the LayerNorm prologue (pointer operands: never TMA or persistent, which this pins off anyway).
    ``kv`` does not change the config (only checked valid with it): the qkv product gives the same bits
    whether it writes the cache (the captured decode step) or ``write_kv`` does (an eager step)."""
    from tritune.kernels import gemm as G

    p = G.Problem(16, N, K, trans_b=trans_b, bias=bias, act=act, residual=residual, ln=ln)
    cfg = dict(G.default_config(p, dtype), GROUP_M=1, TMA=False, PERSISTENT=False)
    assert cfg["BLOCK_M"] == 16, cfg     # valid for every M >= 1 (the space refuses BLOCK_M > max(16, M))
    k_tiles = -(-K // cfg["BLOCK_K"])
    tiles = -(-N // cfg["BLOCK_N"])      # at M = 1
    split = 1
    while (split < 8 and 2 * split <= k_tiles and -(-k_tiles // split) > SLICE_K_TILES
           and tiles * split * 2 <= num_sms()):
        split *= 2
    cfg["SPLIT_K"] = split
    p = G.Problem(16, N, K, trans_b=trans_b, bias=bias, act=act, residual=residual, ln=ln, kv=kv)
    why = G.SPEC.space.why_invalid(cfg, p, dtype)
    assert why is None, f"gemm: pinned {cfg} invalid for {p}: {why}"
    return cfg


@functools.lru_cache(maxsize=None)
def quant_config(N: int, K: int, bits: int, group: int, bias: bool, dtype) -> dict:
    from tritune.kernels import quant_matmul as QM

    p = QM.Problem(16, N, K, bits=bits, group=group, bias=bias)
    return dict(QM.default_config(p, dtype), SPLIT_K=1)


@functools.lru_cache(maxsize=None)
def layer_norm_config(N: int, dtype) -> dict:
    from tritune.kernels import layer_norm as LN

    return dict(LN.default_config(LN.Problem(1, N), dtype), ROWS=1)


@functools.lru_cache(maxsize=None)
def rms_norm_config(N: int, dtype) -> dict:
    from tritune.kernels import rms_norm as RN

    return dict(RN.default_config(RN.Problem(1, N), dtype), ROWS=1)


@functools.lru_cache(maxsize=None)
def paged_config(Hq: int, Hkv: int, D: int, block_size: int, capacity: int, dtype) -> dict:
    """The default of one sequence at full capacity, its partition fixed at PARTITION_TOKENS (or none
    when the whole capacity fits one chunk)."""
    from tritune.kernels import paged_attention as PA

    p = PA.Problem(1, Hq, Hkv, D, capacity, block_size)
    cfg = PA.default_config(p, dtype)
    # a quarter of the capacity at most: a short-context model still splits a long row's keys
    part = min(PARTITION_TOKENS, 1 << (p.capacity.bit_length() - 3))
    part = part if 16 <= part < p.capacity else 0
    pinned = PA.with_partition(cfg, part, p, dtype)
    assert pinned is not None, f"paged_attention: no valid config with PARTITION={part} from {cfg} for {p}"
    return pinned


# ---------------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------------
def _quant_dense(w: RQ.QuantizedWeight, dtype, cache: dict) -> torch.Tensor:
    """fp32 activations on a quantized weight: its (K, N) dequantized copy, made once per weight."""
    hit = cache.get(id(w))
    if hit is None or hit[0] is not w:
        hit = cache[id(w)] = (w, w.dequantize(torch.float32).to(dtype).t().contiguous())
    return hit[1]


class TritonInvariantOps:
    """The triton backend's steps with pinned configs; ``ln_linear`` fuses the LayerNorm (and the qkv's
    K/V-cache write) into the pinned gemm, so a step has as many launches as the default mode's."""

    def __init__(self, base, n_positions: int):
        from tritune.kernels import paged_attention as PA
        from tritune.kernels.gemm import gemm
        from tritune.kernels.layer_norm import layer_norm
        from tritune.kernels.quant_matmul import quant_matmul
        from tritune.kernels.rms_norm import rms_norm

        if not getattr(base, "capturable", False):
            raise ValueError("batch_invariant: the triton backend needs the paged-attention kernel for this "
                             "head dim")
        self.base, self.n_positions = base, n_positions
        self._gemm, self._ln, self._qmm, self._pa, self._write_kv = (gemm, layer_norm, quant_matmul,
                                                                      PA.paged_attention, PA.write_kv)
        self.capturable = True
        self.quant = getattr(base, "quant", None)
        self._dense: dict = {}
        self._rms = rms_norm
        self.steps = dict(getattr(base, "steps", {}))
        if "rmsnorm" in self.steps:      # the Llama family: its norms and rotary (elementwise: invariant as is)
            self.steps["rmsnorm"] = "kernel tritune.kernels.rms_norm, one row a program (batch-invariant)"
            self.steps["swiglu"] = "elementwise after the pinned gemm"
        self.steps.update({
            "layernorm": "fused into the linear after it (kernel tritune.kernels.gemm, ln=; the qkv's KV-cache "
                         "write in its epilogue); kernel tritune.kernels.layer_norm, one row a program, before a "
                         "quant_matmul (batch-invariant)",
            "linear": "kernel tritune.kernels.gemm, one config per (N, K, dtype), 16-row tiles, split-K "
                      "fixed per (N, K) (batch-invariant)" + (f"; {self.quant}: quant_matmul likewise" if self.quant else ""),
            "attention prefill": "kernel tritune.kernels.paged_attention over the cache, per query row "
                                 "(batch-invariant)",
            "attention decode": f"kernel tritune.kernels.paged_attention, {PARTITION_TOKENS}-token KV chunks "
                                "(batch-invariant)",
        })
        self.steps.pop("decode linears", None)

    def layer_norm(self, x, w, b, eps):
        return self._ln(x, w, b, eps, config=layer_norm_config(x.shape[-1], x.dtype))

    def rms_norm(self, x, w, eps):
        return self._rms(x, w, eps, config=rms_norm_config(x.shape[-1], x.dtype))

    def rotary(self, q, k, cos, sin, positions):
        return self.base.rotary(q, k, cos, sin, positions)

    def swiglu(self, gu):
        return self.base.swiglu(gu)

    def linear(self, x, w, b=None, activation=None, residual=None):
        if isinstance(w, RQ.QuantizedWeight):
            if x.dtype in (torch.float16, torch.bfloat16):
                cfg = quant_config(w.N, w.K, w.bits, w.group_size if w.bits == 4 else 128, b is not None,
                                   x.dtype)
                y = self._qmm(x, w, b, config=cfg)
                if activation == "gelu_tanh":
                    y = F.gelu(y, approximate="tanh")      # elementwise: invariant
                return y if residual is None else y + residual.reshape(y.shape)
            w = _quant_dense(w, x.dtype, self._dense)
        cfg = gemm_config(w.shape[1], w.shape[0], w.stride(1) != 1, b is not None, activation,
                          residual is not None, x.dtype)
        return self._gemm(x, w, b, activation=activation, residual=residual, config=cfg)

    def ln_linear(self, x, ln_w, ln_b, eps, w, b=None, activation=None, kv=None):
        """linear(layer_norm(x)) in one pinned gemm launch (the LayerNorm in its prologue), with ``kv``
        (k_cache, v_cache, slots) the qkv output's k and v written to the cache in its epilogue. Returns
        (y, whether the cache was written). A quantized weight on quant_matmul: the two ops apart."""
        if isinstance(w, RQ.QuantizedWeight):
            if x.dtype in (torch.float16, torch.bfloat16):
                return self.linear(self.layer_norm(x, ln_w, ln_b, eps), w, b, activation=activation), False
            w = _quant_dense(w, x.dtype, self._dense)
        # positional: a benchmark may swap gemm_config for a wrapper taking *args
        cfg = gemm_config(w.shape[1], w.shape[0], w.stride(1) != 1, b is not None, activation, False, x.dtype,
                          True, kv is not None)
        y = self._gemm(x, w, b, activation=activation, ln=(ln_w, ln_b, eps), kv=kv, config=cfg)
        return y, kv is not None

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        return self._write_kv(k, v, k_cache, v_cache, slot_mapping, validate=False)

    def attn_rows(self, q, k_cache, v_cache, block_tables, context_lens):
        """Each row of q against its first context_lens tokens of the cache (prefill rows and decodes)."""
        bs = k_cache.shape[1]
        cfg = paged_config(q.shape[1], k_cache.shape[2], q.shape[2], bs, block_tables.shape[1] * bs, q.dtype)
        return self._pa(q, k_cache, v_cache, block_tables, context_lens, validate=False, config=cfg)

    attn_decode = attn_rows

    def attn_prefill(self, q, k, v, seq_lens, cu_seqlens, max_seqlen):
        """Outside the engine (``GPT2.prefill``): the new k, v as a cache of one-token blocks."""
        tables, ctx = _prefill_rows(seq_lens, self.n_positions, q.device)
        return self.attn_rows(q, k[:, None], v[:, None], tables, ctx)


def _prefill_rows(seq_lens, width: int, device):
    """Block tables (T, width) int32 over one-token blocks (token t of the packed k, v is block t) and
    context lengths (T,) for causal attention within each packed sequence."""
    T = int(sum(seq_lens))
    tables = np.zeros((T, width), np.int32)
    ctx = np.zeros(T, np.int32)
    s = 0
    for n in seq_lens:
        tables[s:s + n, :n] = np.arange(s, s + n, dtype=np.int32)
        ctx[s:s + n] = np.arange(1, n + 1)
        s += n
    return torch.from_numpy(tables).to(device), torch.from_numpy(ctx).to(device)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor holding ``t``: its base from the allocator (64-byte aligned on the CPU, 512 on
    CUDA), never a view at some offset into a bigger tensor. Library kernels pick their paths by pointer
    alignment (cuBLAS's algorithms, CUDA LayerNorm's vectorized loads, MKL's peeled loops), so a row sliced out
    of a batch could take another path than the same row alone."""
    return t.clone(memory_format=torch.contiguous_format)


class TorchInvariantOps:
    """The torch backend's steps computed one row at a time, each row a fresh tensor: every library call
    then sees the same shapes, strides and alignment whatever shares the step, so the kernel (and its
    reduction order, its vector/scalar split, its thread chunks) follows the row alone."""

    capturable = False

    def __init__(self, base, n_positions: int):
        self.base, self.n_positions = base, n_positions
        self.quant = getattr(base, "quant", None)
        self._dense: dict = {}
        norms = ("rmsnorm", "rotary", "swiglu") if hasattr(base, "rms_norm") else ("layernorm", "gelu")
        self.steps = {s: "plain PyTorch, row by row (batch-invariant)" for s in
                      (*norms, "linear", "attention prefill", "attention decode")}

    @staticmethod
    def layer_norm(x, w, b, eps):
        # per row although LayerNorm is row-parallel: CUDA's picks its vectorized path by the base
        # pointer's alignment, and a per-row call keeps the mode free of such implementation details
        x2 = x.reshape(-1, x.shape[-1])
        rows = [F.layer_norm(_fresh(r), (x.shape[-1],), w, b, eps) for r in x2.split(1)]
        return (torch.cat(rows) if rows else torch.empty_like(x2)).reshape(x.shape)

    def linear(self, x, w, b=None, activation=None, residual=None):
        if isinstance(w, RQ.QuantizedWeight):
            # every dtype dequantized once: the triton quant kernel under the interpreter would be slow, and
            # on the torch backend the weight it multiplies by is exactly this
            w = _quant_dense(w, x.dtype, self._dense)
        x2 = x.reshape(-1, x.shape[-1])
        res = residual.reshape(x2.shape[0], w.shape[1]) if residual is not None else None
        rows = []
        for i, r in enumerate(x2.split(1)):
            r = _fresh(r)
            y = torch.mm(r, w) if b is None else torch.addmm(b, r, w)
            if activation == "gelu_tanh":
                # per row, not over the (T, 4E) product: the CPU kernel splits a big tensor into one chunk
                # per thread and computes each chunk's tail (past a multiple of 2 vectors) with the scalar
                # tanh, whose bits differ from the vector one, so which elements got which followed T
                y = F.gelu(y, approximate="tanh")
            if res is not None:
                y = y + res[i:i + 1]          # an add rounds the same on any path
            rows.append(y)
        y = torch.cat(rows) if rows else x2.new_empty((0, w.shape[1]))
        return y.reshape(*x.shape[:-1], w.shape[1])

    def rms_norm(self, x, w, eps):
        x2 = x.reshape(-1, x.shape[-1])
        rows = [self.base.rms_norm(_fresh(r), w, eps) for r in x2.split(1)]
        return (torch.cat(rows) if rows else torch.empty_like(x2)).reshape(x.shape)

    def rotary(self, q, k, cos, sin, positions):
        # per row: the transcendental-free rotation still splits a big tensor into thread chunks
        outs = [self.base.rotary(_fresh(q[i:i + 1]), _fresh(k[i:i + 1]), cos, sin, positions[i:i + 1])
                for i in range(q.shape[0])]
        if not outs:
            return q, k
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def swiglu(self, gu):
        # per row, as GELU: silu's exp has a vector and a scalar path (module docstring)
        rows = [self.base.swiglu(_fresh(r)) for r in gu.reshape(-1, gu.shape[-1]).split(1)]
        f = gu.shape[-1] // 2
        return (torch.cat(rows) if rows else gu.new_empty((0, f))).reshape(*gu.shape[:-1], f)

    write_kv = staticmethod(G.torch_write_kv)

    def attn_rows(self, q, k_cache, v_cache, block_tables, context_lens):
        bs = k_cache.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]     # grouped-query attention: query head h reads KV head h // group
        for i, (table, n) in enumerate(zip(block_tables.tolist(), context_lens.tolist())):
            idx = torch.tensor(table[:-(-n // bs)], device=q.device)
            k = k_cache[idx].flatten(0, 1)[:n].float().repeat_interleave(group, 1).permute(1, 2, 0)  # (H, D, n)
            v = v_cache[idx].flatten(0, 1)[:n].float().repeat_interleave(group, 1).transpose(0, 1)   # (H, n, D)
            p = torch.softmax(torch.bmm(_fresh(q[i]).float()[:, None, :], k) * scale, dim=-1)
            out[i] = torch.bmm(p, v)[:, 0].to(q.dtype)
        return out

    attn_decode = attn_rows

    def attn_prefill(self, q, k, v, seq_lens, cu_seqlens, max_seqlen):
        tables, ctx = _prefill_rows(seq_lens, self.n_positions, q.device)
        return self.attn_rows(q, k[:, None], v[:, None], tables, ctx)


def is_invariant(model) -> bool:
    """Whether ``model`` runs on batch-invariant ops (maybe under another layer of ops: a quantized copy)."""
    ops = model.ops
    while ops is not None:
        if isinstance(ops, (TritonInvariantOps, TorchInvariantOps)):
            return True
        ops = getattr(ops, "base", None)
    return False


def invariant_model(model):
    """``model`` (any family's, maybe quantized) on batch-invariant ops; the caller's model is left as it is."""
    if isinstance(model.ops, (TritonInvariantOps, TorchInvariantOps)):
        return model
    cls = TritonInvariantOps if model.backend == "triton" else TorchInvariantOps
    return model.with_ops(cls(model.ops, model.max_context))


# ---------------------------------------------------------------------------------------------------
# The runner's eager forward in this mode: every row through the same attention over the cache
# ---------------------------------------------------------------------------------------------------
def eager(runner, prefill_ids, prefill_slots, decode_ids, decode_positions, decode_slots, context_lens, tables,
          *, prefill_starts=None, prefill_tables=None, sample=None, all_logits: bool = False):
    """What ``ModelRunner.eager`` computes (same arguments, logits in the same order), with every row's
    K/V written first (by the qkv product itself where the ops fuse it) and each row then attending over the
    cache up to its own position: prefill rows
    (whole, chunked, or after a cached prefix) and decode rows take the same kernel and reduction order."""
    model, kv, dev = runner.model, runner.pool, runner.device
    bs, width = kv.block_size, runner.max_blocks
    seq_lens = [len(s) for s in prefill_ids]
    Tp, Td = sum(seq_lens), len(decode_ids)
    T = Tp + Td
    starts = prefill_starts if prefill_starts is not None else [0] * len(seq_lens)
    ids = np.fromiter((t for s in prefill_ids for t in s), np.int64, Tp)
    pos = (np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, seq_lens)])
           if seq_lens else np.zeros(0, np.int64))
    slots = np.fromiter((t for s in prefill_slots for t in s), np.int64, Tp)
    bt = np.zeros((T, width), np.int32)
    r = 0
    for i, sl in enumerate(prefill_slots):
        if prefill_tables is not None:
            blocks = prefill_tables[i].blocks
        else:   # a whole prefill: its blocks from its slots (a -1 slot, the warm-up's: block 0)
            blocks = [max(0, sl[j]) // bs for j in range(0, len(sl), bs)]
        bt[r:r + len(sl), :len(blocks)] = blocks
        r += len(sl)
    for i, t in enumerate(tables):
        blocks = t.blocks if hasattr(t, "blocks") else t
        bt[Tp + i, :len(blocks)] = blocks
    pos = np.concatenate([pos, np.asarray(decode_positions, np.int64)])
    ctx = (pos + 1).astype(np.int32)
    cu, rows, empty = runner.logit_rows(seq_lens, Td, sample, all_logits)
    h64 = torch.from_numpy(np.concatenate([ids, np.asarray(decode_ids, np.int64), pos, slots,
                                           np.asarray(decode_slots, np.int64), rows]))
    d64 = h64.to(dev, non_blocking=True)
    d32 = torch.from_numpy(np.concatenate([ctx[:, None], bt], axis=1)).to(dev, non_blocking=True)
    ids_d, pos_d, slots_d = d64[:T], d64[T:2 * T], d64[2 * T:3 * T]
    bt_d, ctx_d = d32[:, 1:], d32[:, 0].contiguous()
    ops = model.ops

    def attend(i, q, k, v, written=False):
        kc, vc = kv.k_caches[i], kv.v_caches[i]
        if not written:
            ops.write_kv(k, v, kc, vc, slots_d)
        return ops.attn_rows(q, kc, vc, bt_d, ctx_d)

    def kv_for(i):   # every row's K/V (prefill and decode alike) from the qkv product's epilogue, where fused
        return kv.k_caches[i], kv.v_caches[i], slots_d

    x = model.blocks(model.embed(ids_d, pos_d), attend, kv_for)
    if Tp:
        x = x[d64[3 * T:]]
    logits = model.logits(x)
    return logits[:0] if empty else logits
