"""The model contract: what the engine, its runner, the device-side decode step and speculative decoding
use of a model. A family (``model/gpt2/``, ``model/llama/``) meets it and the engine runs it unchanged;
:mod:`tritune.model.families` maps a checkpoint's ``model_type`` to the family's loader.

The layer stack takes an attention *callback*, so the engine owns the KV cache and how attention reads it
(packed prefills, paged decodes, prefix-cache continuations, speculative verification, batch-invariant
rows) while the family owns everything else (norms, projections, positions, MLP):

- ``embed(ids, positions) -> x`` (T, E): token (and, where the family has them, learned position)
  embeddings of packed tokens.
- ``blocks(x, attend, kv_for=None) -> x``: every layer. For layer ``i`` the family computes q, k, v
  ((T, n_heads, head_dim) and (T, n_kv_heads, head_dim), positions already applied: RoPE and the like
  belong to the family) and calls ``attend(i, q, k, v, written)``, which writes k, v into the cache
  (unless ``written``) and returns the attention output (T, n_heads, head_dim). ``kv_for(i)``, when given,
  is (k_cache, v_cache, slots): a family whose ops fuse the cache write into the qkv projection writes
  there itself and passes ``written=True``.
- ``logits(x) -> (T, V)``: the final norm and the LM head, on the rows given.
- ``decode(ids, positions, kv_cache, slots, block_tables, context_lens, *, x=None)``: one token per
  sequence over a paged cache, with no host sync (the device-side step captures it in a CUDA graph);
  ``x`` the tokens already embedded.
- KV layout: the cache holds per layer (num_blocks, block_size, n_kv_heads, head_dim) tensors of
  ``dtype`` on ``device``; ``n_layers``, ``n_kv_heads``, ``head_dim`` size it (``n_heads``: query heads), ``max_context`` bounds a
  sequence, ``vocab_size`` and ``eos_token_id`` the tokens; ``eos_token_ids`` (optional): every id that ends a
  request where the checkpoint lists several (Llama-3: end of text and end of turn), ``eos_token_id`` first.
- ``ops``: the step implementations the runner may wrap (``write_kv``, ``attn_prefill``, ``attn_decode``;
  ``capturable``: the decode step never syncs with the host), ``backend`` ("triton" or "torch"),
  ``with_ops(ops)``: the same model (weights shared) on other ops; ``config``: the family's config (part of
  the prefix cache's key, with ``directory`` and ``w``, the weights object).

- The device-side decode step (CUDA graphs, and the speculative step's) embeds on the device from
  ``w.wte`` (V, E), plus ``w.wpe`` where the family has learned positions (absent or None: rotary families,
  whose ``decode`` applies positions itself, taking each row's position as its context length - 1 when
  given ``positions=None``).
- ``quant=``: the weight-only swap quantizes the projections the family's weights module lists as
  ``LINEARS`` (``gpt2/weights`` or ``llama/weights``) and the LM head.

- ``compiled_decode(kv, write_kv)`` (optional): ``compile=True``'s decode over the paged cache ``kv``, a
  callable ``(ids, positions, slots, block_tables, context_lens) -> logits`` (None where the model's backend
  has none). GPT-2's is the runner's own :class:`~tritune.model.engine.runner.CompiledDecode`.

The fused persistent decode step (:mod:`~tritune.model.engine.fused_decode`) is GPT-2's layer, read by its
weights' names: refused for another family (said in the engine's notes), as ``compile=True`` is for a family
without ``compiled_decode``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

# attend(layer, q, k, v, written) -> attention output
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
KVFor = Callable[[int], tuple]


@runtime_checkable
class EngineModel(Protocol):
    """A model the engine can run (the module docstring says what each member means)."""

    config: Any
    dtype: torch.dtype
    device: Any
    backend: str
    ops: Any
    w: Any

    @property
    def n_layers(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> Optional[int]: ...

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def blocks(self, x: torch.Tensor, attend: Attend, kv_for: Optional[KVFor] = None) -> torch.Tensor: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, input_ids, positions, kv_cache, slot_mapping, block_tables, context_lens, *,
               x: Optional[torch.Tensor] = None) -> torch.Tensor: ...

    def with_ops(self, ops) -> "EngineModel": ...


def check(model) -> None:
    """TypeError naming what ``model`` lacks of :class:`EngineModel` (the engine's first check)."""
    missing = [n for n in ("config", "dtype", "device", "backend", "ops", "w", "n_layers", "n_heads", "n_kv_heads",
                           "head_dim", "max_context", "vocab_size", "eos_token_id", "embed", "blocks", "logits",
                           "decode", "with_ops") if not hasattr(model, n)]
    if missing:
        raise TypeError(f"model: {type(model).__name__} does not meet the engine's model contract "
                        f"(tritune.model.engine.contract.EngineModel); it lacks {', '.join(missing)}")


def eos_ids(model) -> tuple:
    """Every id that ends a request of ``model``: its ``eos_token_ids`` where it lists them, else its
    ``eos_token_id`` (none: ())."""
    out = [] if model.eos_token_id is None else [model.eos_token_id]
    for e in getattr(model, "eos_token_ids", None) or ():
        if e not in out:
            out.append(e)
    return tuple(out)
