"""Paged attention's problems and cases: the problem type, the inputs the tests, the benchmark and the tuner
launch on (block pools whose unreadable slots hold NaN or ±max), the hypothesis strategy of problems, the
check of the lengths and block ids a launch is given (``validate=True``), and the vendor (SDPA) and peer
(flex_attention) it is timed against. The kernel, its launcher and its config
space are in :mod:`tritune.kernels.paged_attention`, which registers the spec; this module registers none.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tritune import kernels as K
from tritune.kernels.runtime import device as dev
from tritune.kernels.runtime import strategies as S


@dataclass(frozen=True)
class Problem:
    B: int                  # sequences (one query token each)
    Hq: int                 # query heads
    Hkv: int                # kv heads (Hq a multiple)
    D: int                  # head dim
    ctx: int                # context length (the longest, when mixed)
    block_size: int = 16    # tokens per cache block
    mixed: bool = False     # lengths drawn in [1, ctx] per sequence (tests); else all equal to ctx
    window: int | None = None   # sliding window: each query sees its sequence's last `window` tokens

    @property
    def capacity(self) -> int:
        """Tokens the block table can address: what a launcher sees without reading context_lens."""
        return -(-self.ctx // self.block_size) * self.block_size

    @property
    def span(self) -> int:
        """Tokens one query can attend to: the capacity, or the window where that is shorter (what the
        split-KV chunks cover, and the context the config is chosen for)."""
        return self.capacity if self.window is None else min(self.capacity, self.window)


def context_lengths(p: Problem, seed: int) -> list[int]:
    if not p.mixed:
        return [p.ctx] * p.B
    g = torch.Generator().manual_seed(seed)
    pick = [1, p.block_size, p.block_size + 1, p.ctx]
    lens = [pick[int(i)] if i < len(pick) else int(torch.randint(1, p.ctx + 1, (1,), generator=g))
            for i in torch.randint(0, 2 * len(pick), (p.B,), generator=g)]
    lens = [min(n, p.ctx) for n in lens]
    lens[int(torch.randint(0, p.B, (1,), generator=g))] = p.ctx  # the table is as wide as the longest
    return lens


def fill_garbage(k_cache, v_cache, block_tables, lens, window=None):
    """Put NaN / ±max in every slot no sequence may read: past each length, before its window (``window``
    tokens back from its length), and in unowned blocks.

    K gets NaN in odd blocks and +max in even ones (a leaked score is NaN or dominates the softmax),
    −max in unowned blocks; V gets NaN everywhere (even a zero-weighted V read shows: 0 · NaN = NaN).
    """
    num_blocks, bs = k_cache.shape[:2]
    tables = block_tables.long().cpu()
    pos = torch.arange(tables.shape[1] * bs).reshape(tables.shape[1], bs)           # token index per slot
    readable = torch.zeros(num_blocks, bs, dtype=torch.bool)
    owned = torch.zeros(num_blocks, dtype=torch.bool)
    for b, n in enumerate(lens):
        readable[tables[b]] = (pos < n) & (pos >= (0 if window is None else n - window))
        owned[tables[b]] = True
    big = torch.finfo(k_cache.dtype).max
    odd = (torch.arange(num_blocks) % 2 == 1)[:, None].expand(num_blocks, bs)
    k_bad = torch.full((num_blocks, bs), big, dtype=torch.float32)
    k_bad[odd] = float("nan")
    k_bad[~owned] = -big
    dev_ = k_cache.device
    hidden = (~readable).to(dev_)[:, :, None, None]
    k_cache.copy_(torch.where(hidden, k_bad.to(dev_, k_cache.dtype)[:, :, None, None], k_cache))
    v_cache.copy_(torch.where(hidden, torch.full((), float("nan"), dtype=v_cache.dtype, device=dev_), v_cache))


def make_inputs(p: Problem, dtype, device, seed: int, layout: str = "contiguous") -> K.Case:
    """Sequences own disjoint, randomly permuted blocks of a pool that has a few spare blocks; every slot
    not holding a context token (the tail of a sequence's last block, its blocks past its length, the
    spare blocks, and with ``p.window`` the tokens before each sequence's window) holds NaN or ±max so a
    read that should not happen shows in the output.

    layout "strided": q is a slice of a wider (B, 3·Hq, D) buffer (q of a fused QKV) and K/V are views
    of one (num_blocks, block_size, 2, Hkv, D) pool.
    """
    nb = -(-p.ctx // p.block_size)
    spare = 3
    num_blocks = p.B * nb + spare
    shape = (num_blocks, p.block_size, p.Hkv, p.D)
    if layout == "strided":
        pool = S.randn((num_blocks, p.block_size, 2, p.Hkv, p.D), dtype, device, seed + 1)
        k_cache, v_cache = pool[:, :, 0], pool[:, :, 1]
        qkv = S.randn((p.B, 3 * p.Hq, p.D), dtype, device, seed, scale=1.5)
        q = qkv[:, p.Hq: 2 * p.Hq]
    elif layout == "contiguous":
        k_cache = S.randn(shape, dtype, device, seed + 1)
        v_cache = S.randn(shape, dtype, device, seed + 2)
        q = S.randn((p.B, p.Hq, p.D), dtype, device, seed, scale=1.5)
    else:
        raise ValueError(f"layout: unknown {layout!r}; expected contiguous or strided")
    g = torch.Generator().manual_seed(seed + 3)
    block_tables = torch.randperm(num_blocks, generator=g)[: p.B * nb].reshape(p.B, nb).to(torch.int32)
    lens = context_lengths(p, seed)
    fill_garbage(k_cache, v_cache, block_tables, lens, p.window)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    kwargs = {"scale": 1.0 / math.sqrt(p.D) * (1.0 + 0.25 * (seed % 3)), "validate": False}
    if p.window is not None:
        kwargs["window"] = p.window
    return K.Case(args=(q, k_cache, v_cache, block_tables.to(device), context_lens), kwargs=kwargs,
                  out=torch.empty((p.B, p.Hq, p.D), dtype=dtype, device=device))


def problems(max_elems: int):
    from hypothesis import strategies as st

    small = dev.interpreted()

    @st.composite
    def draw(d):
        b = d(st.integers(1, 4 if small else 32))
        hkv = d(st.sampled_from([1, 2, 3] if small else [1, 2, 3, 4, 8]))
        group = d(st.sampled_from([1, 2, 3, 4] if small else [1, 2, 3, 4, 5, 8, 16]))
        if small:
            group = max(1, min(group, 4 // hkv))
        hd = d(st.sampled_from([16, 32, 64] if small else [16, 32, 64, 128, 256]))
        bs = d(st.sampled_from([8, 16, 32, 64]))
        top = max(1, min(100 if small else 4096, max_elems // (b * hkv * hd)))
        ctx = d(st.one_of(st.sampled_from([n for n in (1, bs, bs + 1, 2 * bs + 3) if n <= top] or [1]),
                          st.integers(1, top)))
        # a sliding window now and then: narrower than a block, than the context, or wider than it
        window = d(st.one_of(st.none(), st.integers(1, ctx + 2), st.sampled_from([1, bs, bs + 1])))
        return Problem(b, hkv * group, hkv, hd, ctx, bs, d(st.booleans()) and b > 1, window)

    return draw()


# ---------------------------------------------------------------------------------------------------
def validate_lengths(block_tables, context_lens, num_blocks, block_size):
    """Length range and block ids of the table entries in use, with one device-to-host sync."""
    max_blocks = block_tables.shape[1]
    lens = context_lens.long()
    used = torch.arange(max_blocks, device=lens.device)[None, :] < (lens[:, None] + block_size - 1) // block_size
    bad_id = used & ((block_tables < 0) | (block_tables >= num_blocks))
    flags = torch.stack([(lens < 1).any(), (lens > max_blocks * block_size).any(), bad_id.any()]).tolist()
    if flags[0]:
        i = int(torch.nonzero(lens < 1)[0, 0])
        raise ValueError(f"context_lens: sequence {i} has length {int(lens[i])}; lengths must be >= 1")
    if flags[1]:
        i = int(torch.nonzero(lens > max_blocks * block_size)[0, 0])
        raise ValueError(f"context_lens: sequence {i} has length {int(lens[i])}, more than its block table "
                         f"addresses ({max_blocks} blocks x {block_size} tokens)")
    if flags[2]:
        i, j = (int(x) for x in torch.nonzero(bad_id)[0])
        raise ValueError(f"block_tables: entry [{i}, {j}] = {int(block_tables[i, j])} is not a block id "
                         f"in [0, {num_blocks})")


def contiguous_kv(c: K.Case):
    """(B, Hkv, ctx, D) copies of the equal-length K and V (the vendor's input), built untimed."""
    q, k_cache, v_cache, block_tables, context_lens = c.args
    n = int(context_lens.max())
    if int(context_lens.min()) != n:
        return None
    B = q.shape[0]
    blocks = block_tables[:, : -(-n // k_cache.shape[1])].long()
    window = c.kwargs.get("window")
    lo = 0 if window is None else max(n - window, 0)   # a window: its tokens only (the vendor has no window)

    def gather(cache):
        return cache[blocks].reshape(B, -1, *cache.shape[2:])[:, lo:n].transpose(1, 2).contiguous()

    return gather(k_cache), gather(v_cache)


def vendor(c: K.Case):
    kv = contiguous_kv(c)
    if kv is None:
        raise ValueError("SDPA comparison needs equal context lengths")
    k, v = kv
    q4 = c.args[0][:, :, None, :]
    scale = c.kwargs["scale"]
    F = torch.nn.functional
    gqa = q4.shape[1] != k.shape[1]
    try:
        F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=gqa)
    except (RuntimeError, TypeError):  # no GQA support in this build: expand (reads K/V G times)
        g = q4.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), False
    def call():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=gqa)

    call.label = f"sdpa ({K.sdpa_backend(call)}), contiguous KV"  # the backend torch's dispatch ran
    return call


_FLEX: dict = {}


def flex(c: K.Case):
    """torch's flex_attention (compiled; its decode kernel) on the same contiguous K/V as SDPA."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    kv = contiguous_kv(c)
    if kv is None:
        return None
    k, v = kv
    q4 = c.args[0][:, :, None, :]
    key = (tuple(q4.shape), tuple(k.shape), q4.dtype)
    if key not in _FLEX:  # one compile per shape; dynamo's recompile limit would fall back to eager
        torch._dynamo.reset()
        _FLEX.clear()
        _FLEX[key] = torch.compile(flex_attention, dynamic=False)
    fn, scale, gqa = _FLEX[key], c.kwargs["scale"], q4.shape[1] != k.shape[1]
    return lambda: fn(q4, k, v, scale=scale, enable_gqa=gqa)
