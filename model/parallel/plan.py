"""How a family's weights split over the ranks of a tensor-parallel group: one plan per family, as data.

A plan names, for every field of the family's weights object (and of each layer's), its *role*:

- ``QKV``: the fused [q | k | v] projection (weight (E, (Hq + 2 Hkv) D), or its bias): each rank keeps whole
  heads, Hq / N query heads and the KV heads those read. Under grouped-query attention the KV heads are
  divided when Hkv >= N (N divides Hkv), replicated when fewer (Hkv divides N: each rank keeps the one
  KV head its query heads share).
- ``COLUMN``: output columns divided (GPT-2's c_fc, its bias); ``COLUMN_PAIR``: a [gate | up] projection,
  each half divided (SwiGLU then runs on the rank's own columns).
- ``ROW``: input rows divided (attention out, MLP down): each rank's product is a partial sum, all-reduced
  once; ``AFTER_REDUCE``: that linear's bias, kept whole and added once, after the all-reduce.
- ``VOCAB``: the embedding's rows divided by token id (masked lookup, all-reduce); ``VOCAB_HEAD``: the LM
  head's columns the same way (local logits, all-gather). The vocabulary is padded to N * ceil(V / N) with
  zero rows so every rank's shard has one shape; the padded logits are cut off after the gather.
- ``REPLICATED``: norms, learned positions, per-head q/k norms: every rank holds the whole tensor.

The family-specific code left is what its ``embed`` adds after the token lookup (``embed_rest``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

QKV, COLUMN, COLUMN_PAIR, ROW, AFTER_REDUCE = "qkv", "column", "column_pair", "row", "after_reduce"
VOCAB, VOCAB_HEAD, REPLICATED = "vocab", "vocab_head", "replicated"
ROLES = (QKV, COLUMN, COLUMN_PAIR, ROW, AFTER_REDUCE, VOCAB, VOCAB_HEAD, REPLICATED)


def _gpt2_embed_rest(model, x, positions):
    return x + model.w.wpe[positions]           # learned positions: replicated, added once per rank


def _llama_embed_rest(model, x, positions):
    model.positions = positions                 # rotary reads them in blocks() (Llama.embed's contract)
    return x


@dataclass(frozen=True)
class Plan:
    family: str
    top: dict                   # field of the weights object -> role
    layer: dict                 # field of each layer's weights -> role
    kv_heads: str               # the config field holding the KV heads (GPT-2: n_head)
    embed_rest: Callable        # (model, token embeddings, positions) -> x: the family's embed after the lookup


GPT2_PLAN = Plan(
    family="gpt2",
    top={"wte": VOCAB, "wpe": REPLICATED, "lnf_w": REPLICATED, "lnf_b": REPLICATED, "lm_head": VOCAB_HEAD},
    layer={"ln1_w": REPLICATED, "ln1_b": REPLICATED, "w_qkv": QKV, "b_qkv": QKV, "w_o": ROW, "b_o": AFTER_REDUCE,
           "ln2_w": REPLICATED, "ln2_b": REPLICATED, "w_fc": COLUMN, "b_fc": COLUMN, "w_proj": ROW,
           "b_proj": AFTER_REDUCE},
    kv_heads="n_head", embed_rest=_gpt2_embed_rest)

LLAMA_PLAN = Plan(
    family="llama",
    top={"wte": VOCAB, "lnf_w": REPLICATED, "lm_head": VOCAB_HEAD},
    layer={"ln1_w": REPLICATED, "w_qkv": QKV, "b_qkv": QKV, "w_o": ROW, "b_o": AFTER_REDUCE, "ln2_w": REPLICATED,
           "w_gu": COLUMN_PAIR, "b_gu": COLUMN_PAIR, "w_down": ROW, "b_down": AFTER_REDUCE,
           "q_norm": REPLICATED, "k_norm": REPLICATED},
    kv_heads="n_kv_head", embed_rest=_llama_embed_rest)

# the model class (or a base of it) -> its plan; named, not imported, so this room needs no family's code
PLANS = {"GPT2": GPT2_PLAN, "Llama": LLAMA_PLAN}


def plan_for(model) -> Plan:
    for cls in type(model).__mro__:
        if cls.__name__ in PLANS:
            return PLANS[cls.__name__]
    raise TypeError(f"model: no tensor-parallel plan for {type(model).__name__} (plans: {', '.join(PLANS)})")


# ---------------------------------------------------------------------------------------------------
# One rank's slice of each role
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` for a model of ``n_head`` query and ``n_kv_head`` KV heads of ``head_dim``,
    vocabulary ``vocab``: which heads, columns and token ids it holds."""
    rank: int
    world: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config, plan: Plan, rank: int, world: int) -> "Shard":
        s = cls(rank, world, config.n_head, getattr(config, plan.kv_heads), config.head_dim, config.vocab_size)
        s.check()
        return s

    def check(self) -> None:
        N, Hq, Hk = self.world, self.n_head, self.n_kv_head
        if Hq % N:
            raise ValueError(f"tensor_parallel: {N} ranks do not divide the {Hq} attention heads")
        if (Hk >= N and Hk % N) or (Hk < N and N % Hk):
            raise ValueError(f"tensor_parallel: {N} ranks and {Hk} KV heads: one must divide the other "
                             "(KV heads divided over the ranks, or replicated when fewer)")

    @property
    def local_heads(self) -> int:
        return self.n_head // self.world

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.n_kv_head // self.world)

    def kv_first(self) -> int:
        """The first KV head this rank holds (replicated case: the one its query heads read)."""
        if self.n_kv_head >= self.world:
            return self.rank * self.local_kv_heads
        return self.rank // (self.world // self.n_kv_head)

    @property
    def vocab_local(self) -> int:
        """Rows of the padded vocabulary each rank holds."""
        return math.ceil(self.vocab / self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_local

    @property
    def vocab_real(self) -> int:
        """How many of this rank's rows are real token ids (the rest padding)."""
        return max(0, min(self.vocab, self.vocab_start + self.vocab_local) - self.vocab_start)


def _cols(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t[..., start:start + n]


def shard_qkv(t: torch.Tensor, s: Shard) -> torch.Tensor:
    D, Hq, Hk = s.head_dim, s.n_head, s.n_kv_head
    if t.shape[-1] != (Hq + 2 * Hk) * D:
        raise ValueError(f"qkv: expected {(Hq + 2 * Hk) * D} columns, got {t.shape[-1]}")
    q = _cols(t, s.rank * s.local_heads * D, s.local_heads * D)
    k = _cols(t, (Hq + s.kv_first()) * D, s.local_kv_heads * D)
    v = _cols(t, (Hq + Hk + s.kv_first()) * D, s.local_kv_heads * D)
    return torch.cat((q, k, v), dim=-1).contiguous()


def _split(n: int, s: Shard, what: str) -> int:
    if n % s.world:
        raise ValueError(f"tensor_parallel: {s.world} ranks do not divide {what}'s {n} columns/rows")
    return n // s.world


def shard_column(t: torch.Tensor, s: Shard, what: str = "a column-parallel linear") -> torch.Tensor:
    n = _split(t.shape[-1], s, what)
    return _cols(t, s.rank * n, n).contiguous()


def shard_column_pair(t: torch.Tensor, s: Shard) -> torch.Tensor:
    half = t.shape[-1] // 2
    a, b = _cols(t, 0, half), _cols(t, half, half)
    return torch.cat((shard_column(a, s, "gate"), shard_column(b, s, "up")), dim=-1).contiguous()


def shard_row(t: torch.Tensor, s: Shard) -> torch.Tensor:
    n = _split(t.shape[0], s, "a row-parallel linear")
    return t[s.rank * n:(s.rank + 1) * n].contiguous()


def shard_vocab(t: torch.Tensor, s: Shard) -> torch.Tensor:
    """Rows [vocab_start, vocab_start + vocab_local) of a (V, E) table, zero rows past V."""
    out = torch.zeros((s.vocab_local, t.shape[1]), dtype=t.dtype, device=t.device)
    out[:s.vocab_real] = t[s.vocab_start:s.vocab_start + s.vocab_real]
    return out


def shard_tensor(role: str, t, s: Shard):
    if t is None or role in (REPLICATED, AFTER_REDUCE):
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor_parallel: a {type(t).__name__} weight (quantized?) has no sharding; shard the "
                        "dense model, then quantize")
    if role == QKV:
        return shard_qkv(t, s)
    if role == COLUMN:
        return shard_column(t, s)
    if role == COLUMN_PAIR:
        return shard_column_pair(t, s)
    if role == ROW:
        return shard_row(t, s)
    if role == VOCAB:
        return shard_vocab(t, s)
    if role == VOCAB_HEAD:          # (E, V), kept as the transpose of a (V_local, E) tensor (see GPT2.__init__)
        return shard_vocab(t.t(), s).t()
    raise ValueError(f"role: expected one of {ROLES}, got {role!r}")


def _tied(w) -> bool:
    head, wte = w.lm_head, w.wte
    return (head.dim() == 2 and head.shape == wte.shape[::-1] and head.data_ptr() == wte.data_ptr()
            and head.stride() == wte.stride()[::-1])


def shard_weights(w, plan: Plan, s: Shard):
    """The weights object ``w`` (a dataclass of the family's fields) with every tensor cut to rank
    ``s.rank``'s shard (new tensors: the whole ones can be freed); a tied LM head stays the transpose of
    the embedding's shard."""
    layers = []
    for L in w.layers:
        unknown = sorted(set(vars(L)) - set(plan.layer))
        if unknown:
            raise ValueError(f"tensor_parallel: the {plan.family} plan has no role for layer field(s) {unknown}")
        layers.append(replace(L, **{f: shard_tensor(r, getattr(L, f), s) for f, r in plan.layer.items()
                                    if hasattr(L, f)}))
    unknown = sorted(set(vars(w)) - set(plan.top) - {"layers"})
    if unknown:
        raise ValueError(f"tensor_parallel: the {plan.family} plan has no role for weight field(s) {unknown}")
    tied = _tied(w)
    top = {f: shard_tensor(r, getattr(w, f), s) for f, r in plan.top.items() if not (tied and r == VOCAB_HEAD)}
    if tied:
        top["lm_head"] = top["wte"].t()
    return replace(w, layers=layers, **top)


def special_of(w, plan: Plan) -> dict:
    """{id(tensor): (role, tensor)} of the sharded weights ``w`` the forward treats specially: the
    row-parallel weights (all-reduce after) and the LM head (all-gather after)."""
    special = {id(getattr(L, f)): (ROW, getattr(L, f)) for L in w.layers for f, r in plan.layer.items() if r == ROW}
    special.update({id(getattr(w, f)): (VOCAB_HEAD, getattr(w, f)) for f, r in plan.top.items() if r == VOCAB_HEAD})
    return special
