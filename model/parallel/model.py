"""A family's model as one rank of a tensor-parallel group runs it: the rank's weight shards, the family's
own forward, the collectives inserted where the plan (:mod:`~tritune.model.parallel.plan`) says.

The family's layer stack runs unchanged on the rank's heads and columns; three things change:

- the linears go through :class:`TPOps`, which wraps the family's ops: a row-parallel linear (attention
  out, MLP down) computes its partial product (rank 0's with the bias and the residual in its epilogue) and
  all-reduces it, the one collective per projection; the LM head computes the rank's vocabulary columns
  and all-gathers them (every rank ends with the whole logits). Every other step (norms, column-parallel
  projections, attention on the rank's heads, the KV-cache write) is the family's op as it is.
- ``embed`` looks up the rank's rows of the vocabulary (ids outside them read as zeros) and all-reduces:
  exactly one rank contributes each token, so the sum is the whole embedding, bit for bit.
- the config reports the rank's head counts (:class:`ShardConfig`), so the KV cache the engine sizes from
  the model (``n_kv_heads``) holds the rank's heads only.

The entry points (``prefill``, ``decode``) and the engine's contract are the family's: the engine's
runner calls them on every rank with the same step, and gets the same logits on every rank.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import fields, is_dataclass, replace

import torch

from tritune.model.parallel import plan as P
from tritune.model.parallel.group import TPGroup


class ShardConfig:
    """The family's config as one rank sees it: its query and KV head counts, everything else (head dim,
    widths, vocabulary) the whole model's."""

    def __init__(self, base, shard: P.Shard, kv_field: str):
        self.base, self.shard = base, shard
        self.n_head = shard.local_heads
        if kv_field != "n_head":
            setattr(self, kv_field, shard.local_kv_heads)

    def __getattr__(self, name):
        if name in ("base", "shard"):       # (not set yet: unpickling, copy)
            raise AttributeError(name)
        return getattr(self.base, name)

    def __repr__(self):
        return f"{self.base!r}[tensor-parallel rank {self.shard.rank} of {self.shard.world}]"


class TPOps:
    """The family's ops with the collectives of the row-parallel linears and the LM head
    (``special``: {id(weight): (role, weight)} from :func:`~tritune.model.parallel.plan.shard_weights`)."""

    def __init__(self, base, group: TPGroup, special: dict, vocab_size: int):
        self.base, self.group, self.special, self.vocab_size = base, group, special, vocab_size
        self.steps = {**getattr(base, "steps", {}), "tensor parallel": (
            f"{group.world_size} ranks over {group.backend}: all-reduce after attention out and MLP down, "
            "all-gather of the LM head's vocabulary shards, vocab-parallel embedding")}

    def __getattr__(self, name):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def linear(self, x, w, b=None, activation=None, residual=None):
        role = self.special.get(id(w), (None,))[0]
        if role is None or self.group.world_size == 1:
            return self.base.linear(x, w, b, activation=activation, residual=residual)
        if role == P.ROW:
            if activation is not None:
                raise ValueError(f"activation: a row-parallel linear takes none (got {activation!r})")
            # rank 0's partial product carries the bias and the residual (the GEMV's / GEMM's epilogue), so the
            # all-reduce's sum is the whole output: no add kernels after it
            if self.group.rank == 0:
                return self.group.all_reduce(self.base.linear(x, w, b, residual=residual))
            return self.group.all_reduce(self.base.linear(x, w))
        return self.gather_vocab(self.base.linear(x, w, b, activation=activation))

    def gather_vocab(self, y):
        """The whole logits from the ranks' vocabulary shards (the padding of the last shard dropped)."""
        y = self.group.all_gather_last(y)
        return y if y.shape[-1] == self.vocab_size else y[..., :self.vocab_size].contiguous()

    def rms_linear(self, x, norm_w, eps, w, b=None, activation=None):
        """linear(rms_norm(x)): the base ops' fused kernel (RMSNorm in the GEMV's prologue, SwiGLU in its
        epilogue) on the rank's columns where the base has one, the LM head's shards then gathered; else the
        steps. A row-parallel weight never follows a norm: steps, through :meth:`linear`'s all-reduce."""
        role = self.special.get(id(w), (None,))[0]
        if role == P.ROW or not hasattr(type(self.base), "rms_linear"):
            y = self.linear(self.base.rms_norm(x, norm_w, eps), w, b)
            return self.base.swiglu(y) if activation == "swiglu" else y
        y = self.base.rms_linear(x, norm_w, eps, w, b, activation=activation)
        return y if role is None or self.group.world_size == 1 else self.gather_vocab(y)

    def ln_linear(self, x, ln_w, ln_b, eps, w, b=None, activation=None, kv=None):
        """The family's fused norm + linear where no collective follows; else the two steps."""
        fused = getattr(self.base, "ln_linear", None)
        if fused is not None and id(w) not in self.special:
            return fused(x, ln_w, ln_b, eps, w, b, activation=activation, kv=kv)
        return self.linear(self.base.layer_norm(x, ln_w, ln_b, eps), w, b, activation=activation), False


def wraps_tp(ops) -> bool:
    """Whether ``ops`` is, or wraps (``.base`` chain), a :class:`TPOps`."""
    seen = 0
    while ops is not None and seen < 16:
        if isinstance(ops, TPOps):
            return True
        ops, seen = ops.__dict__.get("base") if hasattr(ops, "__dict__") else None, seen + 1
    return False


def vocab_embed(wte: torch.Tensor, ids: torch.Tensor, shard: P.Shard, group: TPGroup) -> torch.Tensor:
    """Rows ``ids`` of the whole embedding from the ranks' shards: each rank reads the ids it holds (zeros
    for the others), the all-reduce adds the one non-zero contribution."""
    local = ids.long() - shard.vocab_start
    mine = (local >= 0) & (local < shard.vocab_real)
    x = wte[local.clamp(0, wte.shape[0] - 1)]
    x = torch.where(mine.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return group.all_reduce(x)


def _tp_embed(self, input_ids, positions):
    tp = self.tp
    return tp.plan.embed_rest(self, vocab_embed(self.w.wte, input_ids, tp.shard, tp.group), positions)


def _tp_with_ops(self, ops):
    """The family's ``with_ops``, keeping the collectives: ops that do not wrap :class:`TPOps` (an
    invariant or instrumented copy of the family's own) are wrapped in them."""
    if not wraps_tp(ops):
        ops = TPOps(ops, self.tp.group, self.tp.special, self.tp.shard.vocab)
    return super(type(self), self).with_ops(ops)


@functools.lru_cache(maxsize=None)
def _tp_class(cls):
    return type(f"TensorParallel{cls.__name__}", (cls,),
                {"embed": _tp_embed, "with_ops": _tp_with_ops, "__module__": __name__,
                 "__doc__": f"{cls.__name__}, one rank of a tensor-parallel group (tritune.model.parallel.model)."})


class TPState:
    """What the rank-local model keeps of its group: the group, the plan, its shard, the whole config."""

    def __init__(self, group: TPGroup, plan: P.Plan, shard: P.Shard, config, special: dict):
        self.group, self.plan, self.shard, self.full_config, self.special = group, plan, shard, config, special


def move(obj, device):
    """A weights dataclass (layers included) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [move(o, device) for o in obj]
    if is_dataclass(obj):
        return replace(obj, **{f.name: move(getattr(obj, f.name), device) for f in fields(obj)})
    return obj


def tensor_parallel(model, group: TPGroup, device=None):
    """Rank ``group.rank``'s shard of ``model`` (GPT-2 or the Llama family; weights dense): a model of the
    same family and contract whose forward, run on every rank of ``group`` with the same inputs, gives
    every rank the whole model's logits. ``model`` is left as it is (its weights can be dropped after).
    ``device``: where the shard goes (default the model's): cut where the whole model is (e.g. the CPU,
    when it fits no one GPU), then moved; the moved shard runs the family's default ops for its backend."""
    if not isinstance(group, TPGroup):
        raise TypeError(f"group: expected a TPGroup (tritune.model.parallel.init), got {type(group).__name__}")
    if hasattr(model, "tp"):
        raise ValueError("model: already one rank's shard of a tensor-parallel model")
    plan = P.plan_for(model)
    shard = P.Shard.of(model.config, plan, group.rank, group.world_size)
    weights = P.shard_weights(model.w, plan, shard)
    if device is not None and torch.device(device) != torch.device(model.device):
        # the family's constructor on the moved shard: it derives device, dtype and its tables from it
        model = type(model)(model.config, move(weights, device), backend=model.backend,
                            directory=getattr(model, "directory", None))
        weights = model.w
    if group.world_size > 1 and torch.device(model.device).type == "cuda":
        group.enable_fast_all_reduce(model.dtype)     # collective: every rank shards at this point
    m = copy.copy(model)
    m.__class__ = _tp_class(type(model))
    special = P.special_of(weights, plan)
    m.w, m.config = weights, ShardConfig(model.config, shard, plan.kv_heads)
    m.tp = TPState(group, plan, shard, model.config, special)
    m.ops = TPOps(model.ops, group, special, shard.vocab)
    return m
