"""What every family's forward (``gpt2/``, ``llama/``) does the same way, written once: the backends and the
choice of ops, the single-request paged KV cache, and :class:`FamilyModel`, the base of each family's model
class, with the engine contract's shared sizes, the weight and ops swaps, loading, and the packed entry
points (``prefill``, ``decode``, ``forward``) over the family's own ``embed``, ``blocks`` and ``logits``.

A family's model class sets three class attributes (``ops_for``, ``load_weights``, ``cache_type``) and may
override two hooks: :meth:`FamilyModel.window_kw` (sliding-window attention) and
:meth:`FamilyModel.decode_positions` (positions a decode step derives itself).
"""
from __future__ import annotations

import copy
import functools
import math
from typing import Callable

import tritune.kernels.runtime  # noqa: F401  (interpreter switch before triton loads)
import torch

from tritune.model.packed import packed

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("triton", "torch")


def default_device(backend: str) -> str:
    if backend == "triton":
        from tritune.kernels.runtime.device import device

        return device()
    return "cuda" if torch.cuda.is_available() else "cpu"


def ops_chooser(triton_ops: Callable, torch_ops) -> Callable:
    """A family's ``ops_for(backend, head_dim=None)``: for "triton", ``triton_ops(head_dim)``, built once per
    head dim; for "torch", ``torch_ops`` itself; any other name, a ValueError naming :data:`BACKENDS`."""
    triton = functools.lru_cache(maxsize=None)(triton_ops)

    def ops_for(backend: str, head_dim: int | None = None):
        if backend == "triton":
            return triton(head_dim)
        if backend == "torch":
            return torch_ops
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")

    return ops_for


# ---------------------------------------------------------------------------------------------------
# KV cache for one or a few sequences
# ---------------------------------------------------------------------------------------------------
class PagedKVCache:
    """Per-layer K/V caches in the paged layout (num_blocks, block_size, H, D), no allocator; H is
    :meth:`kv_heads` of the config.

    Enough for single-request generation: the sequence takes blocks 0, 1, 2, ... in order, so its block
    table is ``arange(num_blocks)`` and a position's slot is the position itself.
    """

    def __init__(self, config, num_blocks: int, block_size: int, dtype, device):
        shape = (config.n_layer, num_blocks, block_size, self.kv_heads(config), config.head_dim)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_caches = list(self.k.unbind(0))
        self.v_caches = list(self.v.unbind(0))

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    def clone(self) -> "PagedKVCache":
        """A copy with its own K/V tensors (same values): one step's writes leave this cache as it is."""
        out = copy.copy(self)
        out.k, out.v = self.k.clone(), self.v.clone()
        out.k_caches, out.v_caches = list(out.k.unbind(0)), list(out.v.unbind(0))
        return out

    @staticmethod
    def kv_heads(config) -> int:
        """The KV heads a layer's cache holds: every attention head (no grouped-query attention)."""
        return config.n_head


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------
class FamilyModel:
    """The base of a family's model class (:class:`~tritune.model.gpt2.model.GPT2`,
    :class:`~tritune.model.llama.model.Llama`). The family sets:

    - ``ops_for``: its ``ops_for(backend, head_dim=None)`` (:func:`ops_chooser`), as a staticmethod;
    - ``load_weights``: its ``load(model, dtype, device) -> (config, weights, directory)``, as a staticmethod;
    - ``cache_type``: its :class:`PagedKVCache` (the KV heads its config names);

    and defines ``embed(input_ids, positions)``, ``blocks(x, attend, kv_for=None, positions=None)`` and
    ``logits(x)`` (the engine's contract, :mod:`tritune.model.engine.contract`), and the sizes that differ
    (``n_kv_heads``, ``max_context``).
    """

    ops_for: Callable
    load_weights: Callable
    cache_type: type

    def __init__(self, config, weights, *, backend: str = "triton", directory=None, ops=None):
        self.config, self.w, self.directory = config, weights, directory
        self.backend = backend
        # ops: the backend's, unless the caller swaps in its own (quantized linears, the engine's write_kv)
        self.ops = self.ops_for(backend, config.head_dim) if ops is None else ops
        self.dtype = weights.wte.dtype
        self.device = weights.wte.device

    # -- the engine's contract (tritune.model.engine.contract.EngineModel): sizes ----------------------
    @property
    def n_layers(self) -> int:
        return self.config.n_layer

    @property
    def n_heads(self) -> int:
        return self.config.n_head

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.config.eos_token_id

    def with_ops(self, ops):
        """The same model (weights shared) running on ``ops``: this one is left as it is."""
        m = copy.copy(self)
        m.ops = ops
        return m

    def with_weights(self, weights, ops=None):
        """The same architecture on other weights (e.g. quantized ones: any object with the fields of the
        family's weights class), with ``ops`` that run them (default: this model's)."""
        m = copy.copy(self)
        m.w = weights
        if ops is not None:
            m.ops = ops
        return m

    @classmethod
    def from_pretrained(cls, model, *, backend: str = "triton", dtype: torch.dtype = torch.float32, device=None):
        """Load a checkpoint directory or hub id. ``device`` defaults to where the backend runs."""
        cls.ops_for(backend)  # validate the backend name before reading gigabytes
        if dtype not in DTYPES:
            raise TypeError(f"dtype: expected one of {DTYPES}, got {dtype}")
        if device is None:
            device = default_device(backend)
        config, w, directory = cls.load_weights(model, dtype, device)
        return cls(config, w, backend=backend, directory=directory)

    def new_cache(self, num_tokens: int, block_size: int = 16) -> PagedKVCache:
        return self.cache_type(self.config, max(1, math.ceil(num_tokens / block_size)), block_size,
                               self.dtype, self.device)

    # -- the family's hooks -----------------------------------------------------------------------------
    def window_kw(self, i: int) -> dict:
        """The attention ops' keywords for layer i: none here (every layer attends to its whole context); a
        family with sliding windows names layer i's."""
        return {}

    def decode_positions(self, positions, context_lens, batch: int):
        """The positions a decode step embeds with and gives to :meth:`blocks`: here ``positions`` as given
        (read only when the step embeds the tokens itself)."""
        return positions

    # -- entry points -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids, seq_lens, *, positions=None, kv_cache=None, slot_mapping=None,
                all_logits: bool = False):
        """Whole sequences, packed: ``input_ids`` (T,) = the concatenation of ``seq_lens`` tokens each.

        Returns logits (len(seq_lens), V) of each sequence's last token, or (T, V) with ``all_logits``.
        With ``kv_cache``, every token's K/V goes to ``slot_mapping`` (T,) (flat slots; < 0 skips).
        """
        pk = packed(input_ids, seq_lens, positions, kv_cache, slot_mapping, device=self.device,
                    n_positions=self.config.n_positions)
        self._check_ids(pk.input_ids)
        input_ids, seq_lens, positions, slot_mapping = pk.input_ids, pk.seq_lens, pk.positions, pk.slot_mapping
        cu, cu_seqlens, max_seqlen = pk.cu, pk.cu_seqlens, pk.max_seqlen
        ops = self.ops

        def attend(i, q, k, v, written=False):
            if kv_cache is not None and not written:
                ops.write_kv(k, v, kv_cache.k_caches[i], kv_cache.v_caches[i], slot_mapping)
            return ops.attn_prefill(q, k, v, seq_lens, cu_seqlens, max_seqlen, **self.window_kw(i))

        x = self.blocks(self.embed(input_ids, positions), attend, positions=positions)
        if not all_logits:
            x = x[torch.tensor(cu[1:], device=self.device) - 1]
        return self.logits(x)

    @torch.inference_mode()
    def decode(self, input_ids, positions, kv_cache, slot_mapping, block_tables, context_lens, *, x=None):
        """One new token per sequence: input_ids, positions, slot_mapping (B,), block_tables (B, max_blocks)
        int32, context_lens (B,) int32 (tokens to attend to, the new one included). Returns logits (B, V).
        ``x`` (B, E): the tokens already embedded (then input_ids are not read); the positions the step
        takes: :meth:`decode_positions`.

        All on the model's device; nothing here syncs with the host (the engine may capture it in a graph).
        """
        B = slot_mapping.shape[0]
        ops = self.ops

        def attend(i, q, k, v, written=False):
            kc, vc = kv_cache.k_caches[i], kv_cache.v_caches[i]
            if not written:
                ops.write_kv(k, v, kc, vc, slot_mapping)
            return ops.attn_decode(q, kc, vc, block_tables, context_lens, **self.window_kw(i))

        def kv_for(i):
            return kv_cache.k_caches[i], kv_cache.v_caches[i], slot_mapping

        positions = self.decode_positions(positions, context_lens, B)
        if x is None:
            x = self.embed(input_ids.reshape(B), positions.reshape(B))
        return self.logits(self.blocks(x, attend, kv_for, positions=positions))

    @torch.inference_mode()
    def forward(self, sequences) -> list[torch.Tensor]:
        """Logits (len_i, V) of every position of each token-id list in ``sequences`` (no cache)."""
        seqs = [list(map(int, s)) for s in sequences]
        flat = [t for s in seqs for t in s]
        logits = self.prefill(torch.tensor(flat, dtype=torch.long), [len(s) for s in seqs], all_logits=True)
        return list(logits.split([len(s) for s in seqs]))

    def _check_ids(self, ids):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids: token ids must lie in [0, {self.config.vocab_size}), "
                             f"got min {int(ids.min())}, max {int(ids.max())}")
