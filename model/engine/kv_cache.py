"""Paged KV cache: a pool of fixed-size blocks, and per-sequence block tables grown on demand.

The cache of layer ``l`` is ``pool.k_caches[l]`` / ``pool.v_caches[l]``, each ``(num_blocks, block_size,
H, D)`` (an FP8 pool's V: ``(num_blocks, H, D, block_size)``, transposed within each block;
:mod:`tritune.model.engine.kv_fp8`). Token ``pos`` of a sequence lives in block
``table.blocks[pos // block_size]`` at offset ``pos % block_size``; its flat *slot* is
``block * block_size + offset`` (what ``write_kv`` takes; a negative slot means "skip"). Memory is reserved
once, when the pool is built; sequences take blocks only as they grow, so no sequence holds room for a
maximum length it may never reach.

Prefix caching: a *full* block whose K/V are computed (or scheduled to be, in the step that admits it)
is keyed by a chained hash of its tokens: hash(parent block's hash, its block_size token ids), the root
being the pool's ``cache_salt`` (the model, dtype and quantization: K/V of another model never match).
A request whose prompt starts with cached blocks takes them (a reference each) and computes only the
rest. Blocks are reference counted; a cached block whose count drops to 0 stays cached and counts as
free: ``allocate`` takes never-cached blocks first, then evicts cached ones least recently freed first.
Only full blocks are cached, so the partial block a sequence writes into is never shared.
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict

import torch

from tritune.model.engine.kv_fp8 import alloc_scales, layer_caches


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler checks first, so this is a bug)."""


class BlockPool:
    """Per-layer K and V cache tensors carved into blocks, reference counts, the free list and the
    prefix cache (``enable_caching``; ``cache_salt``: what else the K/V depend on besides the tokens).

    Size it with exactly one of ``num_blocks``, or ``memory``: bytes (an ``int``), or a fraction in
    (0, 1] of the free memory of ``device`` (a ``float``; CUDA only, read via ``torch.cuda.mem_get_info``).
    """

    def __init__(self, n_layer: int, n_kv_heads: int, head_dim: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float16, device="cpu", *, num_blocks: int | None = None,
                 memory: int | float | None = None, enable_caching: bool = False, cache_salt: str = ""):
        for name, v in (("n_layer", n_layer), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.device = torch.device(device)
        self.n_layer, self.n_kv_heads, self.head_dim = n_layer, n_kv_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        self.bytes_per_block = bytes_per_block(n_layer, n_kv_heads, head_dim, block_size, dtype)
        if (num_blocks is None) == (memory is None):
            raise ValueError("give exactly one of num_blocks or memory (bytes, or a fraction of free GPU memory)")
        if num_blocks is None:
            num_blocks = blocks_for_budget(memory, self.bytes_per_block, self.device)
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # One allocation for everything; zeroed so a kernel bug reading an unwritten slot sees 0, not NaN.
        self.cache = torch.zeros(2, n_layer, num_blocks, block_size, n_kv_heads, head_dim, dtype=dtype,
                                 device=self.device)
        self.k_caches = list(self.cache[0].unbind(0))
        self.v_caches = list(self.cache[1].unbind(0))
        # an FP8 (e4m3) pool: V's blocks transposed, a float32 scale per (token, kv head) beside each
        # (tritune.model.engine.kv_fp8)
        self.k_scales = self.v_scales = None
        if dtype == torch.float8_e4m3fn:
            self.k_caches, self.v_caches = layer_caches(self.cache)
            self.scales = alloc_scales(n_layer, num_blocks, block_size, n_kv_heads, self.device)
            self.k_scales, self.v_scales = list(self.scales[0].unbind(0)), list(self.scales[1].unbind(0))
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: allocate() hands out 0, 1, 2, ... first
        self._ref = [0] * num_blocks
        self.peak_used = 0
        # prefix cache: hash -> block, block -> hash, and the cached blocks nobody holds (LRU first)
        self.enable_caching = bool(enable_caching)
        self.root_hash = hashlib.blake2b(f"tritune-kv|{cache_salt}".encode(), digest_size=16).digest()
        # a block's tokens as 4-byte little-endian ints in one call (a block is hashed per block_size decoded tokens)
        self._pack_block = struct.Struct(f"<{block_size}I").pack
        self._cached: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.stats = {"hit_blocks": 0, "queried_blocks": 0, "evicted": 0}

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: never-cached ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} of {self.num_blocks} are free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:                           # evict the least recently freed cached block
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of[b]]
                self._hash_of[b] = None
                self.stats["evicted"] += 1
            self._ref[b] = 1
            blocks.append(b)
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def free(self, blocks) -> None:
        """Drop one reference to each of ``blocks``; a block nobody holds goes back to the pool (a cached
        one stays cached until evicted). Checks every id first, so a bad call changes nothing."""
        blocks = list(blocks)
        seen = set()
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b!r} is not in this pool (ids 0..{self.num_blocks - 1})")
            if not self._ref[b] or b in seen:
                raise ValueError(f"block {b} is not allocated (double free?)")
            seen.add(b)
        for b in reversed(blocks):  # a sequence's last blocks are evicted first: its prefix is worth more
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash_of[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # ---------------------------------------------------------------------------------- prefix cache
    def hash_blocks(self, token_ids, start: int, end: int, parent: bytes | None = None) -> list[bytes]:
        """Chained hashes of the full blocks ``start .. end-1`` of ``token_ids``; ``parent``: block
        ``start - 1``'s hash (the root for block 0)."""
        bs = self.block_size
        h = self.root_hash if parent is None else parent
        out = []
        for i in range(start, end):
            toks = token_ids[i * bs:(i + 1) * bs]
            if len(toks) != bs:
                raise ValueError(f"block {i} is not full ({len(toks)} of {bs} tokens)")
            h = hashlib.blake2b(h + self._pack_block(*toks), digest_size=16).digest()
            out.append(h)
        return out

    def match(self, hashes) -> list[int]:
        """The cached blocks holding the longest prefix of ``hashes`` (no reference taken)."""
        blocks = []
        if self.enable_caching:
            for h in hashes:
                b = self._cached.get(h)
                if b is None:
                    break
                blocks.append(b)
            self.stats["queried_blocks"] += len(hashes)
            self.stats["hit_blocks"] += len(blocks)
        return blocks

    def num_evictable(self, blocks) -> int:
        """How many of ``blocks`` nobody holds (taking them uses up free blocks)."""
        return sum(self._ref[b] == 0 for b in blocks)

    def acquire(self, blocks) -> None:
        """Take a reference to each of ``blocks`` (cached blocks a new sequence starts with)."""
        for b in blocks:
            if self._ref[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is neither held nor cached")
                del self._evictable[b]
            self._ref[b] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def cache_block(self, block: int, h: bytes) -> None:
        """Key the full, held ``block`` by ``h`` (nothing when caching is off, or another block holds
        ``h`` already: that one stays the copy others find)."""
        if not self.enable_caching or h in self._cached or self._hash_of[block] is not None:
            return
        self._cached[h] = block
        self._hash_of[block] = h

    def uncache(self, blocks) -> None:
        """Forget the hashes of ``blocks`` (their K/V were never computed: the step that would have failed)."""
        for b in blocks:
            h = self._hash_of[b]
            if h is not None:
                del self._cached[h]
                self._hash_of[b] = None
                if b in self._evictable:
                    del self._evictable[b]
                    self._free.append(b)

    def reset_cache(self) -> None:
        """Drop every cached block nobody holds (and forget the hashes of held ones)."""
        self.uncache([b for b in range(self.num_blocks) if self._hash_of[b] is not None])

    def __repr__(self):
        return (f"BlockPool({self.num_blocks} blocks x {self.block_size} tokens, {self.n_layer} layers, "
                f"H={self.n_kv_heads}, D={self.head_dim}, {self.dtype}, {self.device}; "
                f"{self.num_free} free, peak {self.peak_used} used)")


def bytes_per_block(n_layer, n_kv_heads, head_dim, block_size, dtype) -> int:
    """K and V of every layer for ``block_size`` tokens (an e4m3 cache: with its float32 per-token scales)."""
    if dtype == torch.float8_e4m3fn:
        return 2 * n_layer * block_size * n_kv_heads * (head_dim + 4)
    return 2 * n_layer * block_size * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def blocks_for_budget(memory: int | float, block_bytes: int, device: torch.device) -> int:
    if isinstance(memory, bool) or not isinstance(memory, (int, float)):
        raise TypeError(f"memory must be bytes (int) or a fraction of free GPU memory (float), got {memory!r}")
    if isinstance(memory, float):
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"memory as a fraction of free GPU memory must be in (0, 1], got {memory}")
        if device.type != "cuda":
            raise ValueError(f"memory={memory} is a fraction of free GPU memory, but the device is {device}; "
                             "give bytes (an int) instead")
        free, _total = torch.cuda.mem_get_info(device)
        memory = int(free * memory)
    num_blocks = memory // block_bytes
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {memory} bytes holds no block ({block_bytes} bytes each)")
    return num_blocks


class BlockTable:
    """The blocks of one sequence, in order; grows (``ensure_capacity``) as the sequence does."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.hashes: list[bytes] = []       # of the leading full blocks keyed in the prefix cache

    def adopt(self, blocks, hashes) -> None:
        """Start with cached ``blocks`` (their ``hashes``), a reference taken on each."""
        if self.blocks:
            raise ValueError("adopt: the table already holds blocks")
        self.pool.acquire(blocks)
        self.blocks, self.hashes = list(blocks), list(hashes)

    def cache_full(self, token_ids, n_tokens: int) -> None:
        """Key every full block among the first ``n_tokens`` of ``token_ids`` (their K/V computed or
        computed in the step being scheduled) in the prefix cache."""
        pool = self.pool
        if not pool.enable_caching:
            return
        full = min(n_tokens // pool.block_size, len(self.blocks))
        k = len(self.hashes)
        if full <= k:
            return
        new = pool.hash_blocks(token_ids, k, full, self.hashes[-1] if self.hashes else None)
        for b, h in zip(self.blocks[k:full], new):
            pool.cache_block(b, h)
        self.hashes += new

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks to add so that ``n_tokens`` tokens fit."""
        return max(0, math.ceil(n_tokens / self.pool.block_size) - len(self.blocks))

    def ensure_capacity(self, n_tokens: int) -> None:
        """Allocate just the blocks needed to hold ``n_tokens`` tokens (raises OutOfBlocks if the pool can't)."""
        need = self.blocks_needed(n_tokens)
        if need:
            self.blocks += self.pool.allocate(need)

    def slot(self, pos: int) -> int:
        if not 0 <= pos < self.capacity:
            raise IndexError(f"position {pos} is outside this sequence's {self.capacity} allocated slots")
        bs = self.pool.block_size
        return self.blocks[pos // bs] * bs + pos % bs

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions ``start .. end-1`` (the new tokens' ``slot_mapping``)."""
        return [self.slot(p) for p in range(start, end)]

    def free(self, uncache: bool = False) -> None:
        """Release the blocks; ``uncache``: their K/V are not what their hashes say (a failed step)."""
        if uncache:
            self.pool.uncache(self.blocks)
        self.pool.free(self.blocks)
        self.blocks, self.hashes = [], []


def block_tables_tensor(tables, max_blocks: int | None = None, batch: int | None = None, pad: int = 0,
                        device=None) -> torch.Tensor:
    """(batch, max_blocks) int32 from BlockTables (or lists of block ids), padded with ``pad``.

    ``max_blocks`` defaults to the longest table; fix it (e.g. ``ceil(n_positions / block_size)``) and
    ``batch`` (a CUDA-graph bucket >= len(tables)) for shapes that do not change from step to step.
    Padding is a valid block id (0) by default: kernels read only ``context_lens`` tokens, so it is never
    used, but a stray read stays in bounds.
    """
    rows = [t.blocks if isinstance(t, BlockTable) else list(t) for t in tables]
    longest = max((len(r) for r in rows), default=0)
    max_blocks = longest if max_blocks is None else max_blocks
    if longest > max_blocks:
        raise ValueError(f"max_blocks={max_blocks} is less than the longest block table ({longest})")
    batch = len(rows) if batch is None else batch
    if batch < len(rows):
        raise ValueError(f"batch={batch} is less than the number of block tables ({len(rows)})")
    out = torch.full((batch, max_blocks), pad, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return out.to(device) if device is not None else out
