"""Serving over a tensor-parallel group: the scheduler on rank 0, the same forward on every rank.

Rank 0 runs the engine as on one device (scheduler, block pool, sampling) with its shard of the model;
:func:`lead` makes its runner broadcast every forward's metadata (token ids, positions, slots, block
tables, context lengths: the arguments of :meth:`~tritune.model.engine.runner.ModelRunner.eager`) before
running it. Every other rank runs :func:`follow`: a block pool of the same blocks (its own KV heads), and
for each broadcast step the same forward, whose collectives meet rank 0's. Only rank 0 allocates blocks;
the others write the slots they are given, so every rank's cache holds its heads of the same blocks.

CUDA graphs: the device-side decode step (:class:`~tritune.model.engine.graphs.DecodeGraphs`) is captured by
every rank at once, in :func:`lead` / :func:`follow` (the same buckets and widths, in the same order, so the
captured all-reduces pair up), and each load, replay and fed-back token of rank 0's graphs is broadcast
before it runs (:class:`LeadGraphs`): the ranks replay the same graphs on the same state.

Metadata travels as one pickled object per step (``broadcast_object_list``). A rank that dies surfaces on
rank 0 as a failed collective (or its timeout), raised as the launcher's
:class:`~tritune.model.parallel.launch.RankFailed` when the watchdog has seen the exit; the group is then
unusable (every later step raises at once) and the step's requests end with the error.

Two ways to run it:

- rank 0 starts the others (one host): ``local = start(model, n)`` spawns ranks 1..n-1, each rebuilding the
  model from the weights sent to it and keeping its shard; an engine built on ``local`` leads them
  (:func:`engine_lead`, which the engine calls).
- every rank runs the same script (``torchrun``, one host or several)::

      group = tritune.model.parallel.group.init_from_env()
      local = tensor_parallel(load_model(path, backend=..., dtype=...), group)
      if group.rank == 0:
          engine = Engine(local, ...)            # it leads the group (engine_lead)
          ...                                    # serve
          engine.close()                         # the followers return
      else:
          follow(group, local)
      teardown()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tritune.model.engine.kv_cache import BlockPool
from tritune.model.engine.runner import ModelRunner
from tritune.model.parallel import launch as L
from tritune.model.parallel.group import (DEFAULT_TIMEOUT_S, TEARDOWN_TIMEOUT_S, TPGroup, init_from_env, teardown,
                                          torchrun_rank)
from tritune.model.parallel.model import move, tensor_parallel
from tritune.model.parallel.plan import Shard, plan_for

STEP, STOP, SETUP, GRAPH = "step", "stop", "setup", "graph"
# the positional arguments of ModelRunner.eager, by name (tables travel as lists of block ids)
EAGER_ARGS = ("prefill_ids", "prefill_slots", "decode_ids", "decode_positions", "decode_slots", "context_lens",
              "tables")


class Table:
    """A block table as the followers get it: the block ids only (what the forward reads)."""

    __slots__ = ("blocks",)

    def __init__(self, blocks):
        self.blocks = list(blocks)


@dataclass
class Ledger:
    """What a rank saw of the KV blocks: forwards run, every block a step wrote to or read from."""
    steps: int = 0
    blocks: set = field(default_factory=set)

    def record(self, kw: dict, block_size: int) -> None:
        self.steps += 1
        for name in ("prefill_slots", "decode_slots"):
            for s in _flat(kw.get(name) or ()):
                if s >= 0:
                    self.blocks.add(int(s) // block_size)
        for name in ("tables", "prefill_tables"):
            for t in kw.get(name) or ():
                self.blocks.update(int(b) for b in t.blocks)

    def summary(self) -> dict:
        return {"steps": self.steps, "blocks": sorted(self.blocks)}


def _flat(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from x
        else:
            yield x


def pack(args: tuple, kw: dict) -> dict:
    """An eager call's arguments as plain data (tables as :class:`Table`)."""
    if len(args) > len(EAGER_ARGS):
        raise TypeError(f"eager: at most {len(EAGER_ARGS)} positional arguments, got {len(args)}")
    out = dict(zip(EAGER_ARGS, args), **kw)
    for name in ("tables", "prefill_tables"):
        if out.get(name) is not None:
            out[name] = [Table(t.blocks) for t in out[name]]
    return out


def pack_load(ids, positions, stops, eos, tables) -> tuple:
    """A decode-graph load's arguments as plain data (tables as :class:`Table`, one per distinct table)."""
    seen: dict = {}
    packed = [seen.setdefault(id(t), Table(t.blocks if hasattr(t, "blocks") else t)) for t in tables]
    return (list(ids), list(positions), list(stops), [e if isinstance(e, int) else list(e) for e in eos], packed)


class LeadGraphs:
    """Rank 0's decode graphs (:class:`~tritune.model.engine.graphs.DecodeGraphs`) with every call that moves
    the device-side state (``load``, ``run``, ``feed``) sent to the followers first, so that each rank
    replays the same graphs on the same state and their collectives meet. A load travels with the next run
    (one broadcast a replay); a sampled token fed back follows its message as a tensor broadcast. Reads
    (``tokens``, ``bucket``, the buffers) are the wrapped graphs' own."""

    def __init__(self, graphs, lead: "Lead"):
        self.graphs, self.lead, self.pending = graphs, lead, []

    def __getattr__(self, name):
        if name in ("graphs", "lead", "pending"):
            raise AttributeError(name)
        return getattr(self.graphs, name)

    def load(self, ids, positions, stops, eos, tables):
        self.pending.append(("load", pack_load(ids, positions, stops, eos, tables)))
        return self.graphs.load(ids, positions, stops, eos, tables)

    def run(self, B, steps: int = 1):
        ops, self.pending = self.pending + [("run", (B, steps))], []
        self.lead.send((GRAPH, ops))
        return self.graphs.run(B, steps)

    def feed(self, row: int, token, position: int, step: int) -> None:
        ops, self.pending = self.pending + [("feed", (row, position, step, str(token.dtype).split(".")[-1]))], []
        self.lead.send((GRAPH, ops), token)
        self.graphs.feed(row, token, position, step)


def replay_graph_ops(graphs, group: TPGroup, ops) -> None:
    """A follower's side of :class:`LeadGraphs`: the same loads, replays and fed tokens, in order."""
    for name, args in ops:
        if name == "load":
            graphs.load(*args)
        elif name == "run":
            graphs.run(*args)
        elif name == "feed":
            row, position, step, dtype = args
            token = group.broadcast_tensor(torch.empty(1, dtype=getattr(torch, dtype), device=graphs.device))
            graphs.feed(row, token, position, step)
        else:
            raise RuntimeError(f"tensor_parallel: unknown decode-graph call {name!r} from rank 0")


class Lead:
    """Rank 0's side: the runner's ``eager`` replaced by one that broadcasts each call first, and its decode
    graphs (if any) by :class:`LeadGraphs`."""

    def __init__(self, runner: ModelRunner, group: TPGroup, workers=None):
        self.runner, self.group, self.workers = runner, group, workers
        self.ledger = Ledger()
        self.broken: BaseException | None = None
        self._eager = runner.eager
        runner.eager = self.eager       # an instance attribute: the runner's own calls come here too
        if runner.graphs is not None:
            runner.graphs = LeadGraphs(runner.graphs, self)

    def send(self, msg, tensor=None) -> None:
        """Broadcast ``msg`` (and ``tensor``, after it) to the followers; a failure marks the group broken."""
        if self.broken is not None:
            raise RuntimeError(f"tensor-parallel group unusable after an earlier failure: {self.broken!r}")
        try:
            self.group.broadcast_object(msg)
            if tensor is not None:
                self.group.broadcast_tensor(tensor)
        except BaseException as e:
            self.fail(e)
            raise

    def eager(self, *args, **kw):
        kw = pack(args, kw)
        self.send((STEP, kw))
        try:
            self.ledger.record(kw, self.runner.pool.block_size)
            return self._eager(**kw)
        except BaseException as e:
            self.fail(e)
            raise

    def fail(self, e: BaseException) -> None:
        """Mark the group broken by ``e`` (the ranks may have stopped inside different collectives: nothing
        after this can pair up); raise the launcher's RankFailed instead when the watchdog saw a rank die."""
        self.broken = e
        if self.workers is not None:
            try:
                self.workers.wait_failure()     # RankFailed (the dead rank, its exit code) when one died
            except L.RankFailed as dead:
                self.broken = dead
                raise dead from e

    def close(self) -> None:
        """Tell the followers to return (once; not after a failure, when they may be gone)."""
        if self.broken is None and self.runner.eager == self.eager:
            self.group.broadcast_object((STOP, None))
            self.runner.eager = self._eager
        if isinstance(self.runner.graphs, LeadGraphs):
            self.runner.graphs = self.runner.graphs.graphs
            self.runner.graphs.release()    # (they hold the NCCL communicator the group's teardown frees)


def lead(runner: ModelRunner, group: TPGroup, workers=None) -> Lead:
    """Make rank 0's ``runner`` (an engine's, over its shard of the model) lead the group: its block pool's
    size and its decode graphs' shape go to the followers (each rank then captures the same graphs, here,
    together), then each forward's metadata before the forward. Compile and the batch-invariant mode are
    refused (ValueError); graphs must come uncaptured (``ModelRunner(..., defer_capture=True)``)."""
    if runner.compiled is not None:
        raise ValueError("tensor_parallel: the compiled decode does not broadcast its steps yet; use compile=False")
    if runner.invariant:
        raise ValueError("tensor_parallel: batch_invariant is not supported with tensor parallelism yet")
    g = runner.graphs
    if g is not None and g.graphs:
        raise ValueError("tensor_parallel: the runner's decode graphs are captured already (every rank must "
                         "capture them together: ModelRunner(..., defer_capture=True))")
    pool = runner.pool
    shape = None if g is None else {"buckets": g.buckets, "widths": g.widths, "hist": g.R, "n_eos": g.NE,
                                    "max_blocks": g.mb, "capture": runner.device.type == "cuda"}
    group.broadcast_object((SETUP, {"num_blocks": pool.num_blocks, "block_size": pool.block_size,
                                    "max_num_seqs": 1, "graphs": shape}))
    if shape is not None and shape["capture"]:
        g.capture()
    return Lead(runner, group, workers)


def follow(group: TPGroup, model) -> tuple[Ledger, BlockPool]:
    """A follower rank's loop over its shard ``model``: the pool rank 0 announces, then one eager forward per
    broadcast step, until rank 0 stops the group. Returns the ledger and the pool (for the caller to
    inspect: the tests compare caches)."""
    kind, setup = group.broadcast_object(None)
    if kind != SETUP:
        raise RuntimeError(f"tensor_parallel: expected the pool setup from rank 0, got {kind!r}")
    pool = BlockPool(model.n_layers, model.n_kv_heads, model.head_dim, setup["block_size"], model.dtype,
                     model.device, num_blocks=setup["num_blocks"])
    runner = ModelRunner(model, pool, max_num_seqs=setup["max_num_seqs"], cuda_graphs=False)
    graphs = follower_graphs(model, pool, setup.get("graphs"))
    ledger = Ledger()
    with torch.inference_mode():
        while True:
            kind, kw = group.broadcast_object(None)
            if kind == STOP:
                break
            if kind == GRAPH:
                replay_graph_ops(graphs, group, kw)
                continue
            ledger.record(kw, pool.block_size)
            runner.eager(**kw)
    if graphs is not None:
        graphs.release()        # (they hold the NCCL communicator the group's teardown frees)
    return ledger, pool


def follower_graphs(model, pool, shape):
    """A follower's decode graphs of the shape rank 0 announced (None: none), captured now, as rank 0 captures
    its own."""
    if shape is None:
        return None
    from tritune.model.engine.graphs import DecodeGraphs

    g = DecodeGraphs(model.with_ops(model.ops), pool, shape["max_blocks"], shape["buckets"], hist=shape["hist"],
                     capture=False, n_eos=shape["n_eos"], widths=shape["widths"])
    if shape["capture"]:
        g.capture()
    return g


# ---------------------------------------------------------------------------------------------------
# A group started by rank 0 (the engine's way)
# ---------------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """What a follower rebuilds the whole model from (then shards it): the family's class, config, weights
    (on the CPU; pickled to the follower through shared memory), backend and checkpoint directory."""
    cls: Any
    config: Any
    weights: Any
    backend: str
    directory: Any = None

    @classmethod
    def of(cls, model) -> "ModelSpec":
        return cls(type(model), model.config, move(model.w, "cpu"), model.backend, getattr(model, "directory", None))

    def build(self):
        """The whole model, on the CPU (its weights shared with the sender's copy)."""
        return self.cls(self.config, self.weights, backend=self.backend, directory=self.directory)


def follower_main(group: TPGroup, spec: ModelSpec) -> dict:
    """A follower rank started by :func:`start`: its shard of the model, then :func:`follow`."""
    model = tensor_parallel(spec.build(), group, device=group.device)     # cut on the CPU, the shard moved
    del spec
    ledger, _ = follow(group, model)
    return ledger.summary()


class Leadership:
    """Rank 0's handle on the group :func:`start` made: ``group``, the follower processes (``workers``, with
    their watchdog), and the :class:`Lead` of the one engine that runs the model (:meth:`lead`)."""

    def __init__(self, group: TPGroup, workers):
        self.group, self.workers = group, workers
        self.leader: Lead | None = None
        self.closed = False

    def lead(self, runner: ModelRunner) -> Lead:
        if self.leader is not None:
            raise ValueError("model: a tensor-parallel model started by start() serves one engine")
        self.workers.check()
        self.leader = lead(runner, self.group, self.workers)
        return self.leader

    def close(self, timeout_s: float = 30.0) -> dict:
        """Stop the followers (their ledgers back, {rank: summary}, when they end cleanly) and leave the group
        (once: later calls return {})."""
        if self.closed:
            return {}
        self.closed = True
        try:
            if self.leader is None:
                self.group.broadcast_object((SETUP, {"num_blocks": 1, "block_size": 1, "max_num_seqs": 1}))
                self.group.broadcast_object((STOP, None))
            else:
                self.leader.close()
            teardown(TEARDOWN_TIMEOUT_S)    # beside the followers, which leave the group once they read the stop
            return self.workers.results(timeout_s)
        except (L.RankFailed, RuntimeError, TimeoutError):
            return {}           # a follower died (its step already raised RankFailed): nothing to collect
        finally:
            self.workers.close()


def abort_on_death(err) -> None:
    """The watchdog's action when a follower dies (NCCL): abort the group's communicators, so that rank 0's
    collectives waiting on the dead rank return (a collective inside a replayed CUDA graph has no timeout of
    its own) and its next step raises the launcher's RankFailed instead of hanging. torch has no public
    abort; where this one is missing the collective timeout is the bound."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        try:
            abort()
        except Exception:  # noqa: BLE001  (best effort on a failure path; the step's own error follows)
            pass


def start(model, n: int, *, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Split ``model`` over ``n`` ranks: ranks 1..n-1 spawned (each rebuilds the model from the weights sent
    to it and keeps its shard), this process rank 0. Returns rank 0's shard, ``.tp.leadership`` its
    :class:`Leadership` (an engine built on the shard leads the group through it). ``backend``: gloo on the
    CPU, NCCL for a CUDA model (default by the model's device)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel: expected an int >= 1, got {n!r}")
    if hasattr(model, "tp"):
        raise ValueError("model: already one rank's shard of a tensor-parallel model")
    if n == 1:
        return model
    Shard.of(model.config, plan_for(model), 0, n)      # refuse a split the heads do not allow before spawning
    cuda = torch.device(model.device).type == "cuda"
    if cuda and n > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel: {n} ranks need {n} CUDA devices (one per rank), "
                         f"{torch.cuda.device_count()} visible")
    backend = backend or ("nccl" if cuda else "gloo")
    spec = ModelSpec.of(model)
    workers = L.Workers(n, follower_main, spec, backend=backend, timeout_s=timeout_s,
                        threads=1 if not cuda else None, on_failure=abort_on_death if backend == "nccl" else None)
    local = tensor_parallel(model, workers.group)
    local.tp.leadership = Leadership(workers.group, workers)
    return local


# ---------------------------------------------------------------------------------------------------
# What the engine calls
# ---------------------------------------------------------------------------------------------------
def engine_model(model, tensor_parallel: int = 1, **settings):
    """The model an engine runs for ``tensor_parallel`` ranks: ``model`` split by :func:`start` (n > 1), or
    as given when it is one rank's shard already (started here, or by the caller on every rank, e.g. under
    torchrun: then this must be rank 0). ``settings``: the engine's settings that have no tensor-parallel
    path yet (quant, compile, batch_invariant, speculative): a true one is refused by name."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel: expected an int >= 1, got {tensor_parallel!r}")
    tp = getattr(model, "tp", None)
    if tp is None and tensor_parallel == 1:
        return model
    bad = sorted(k for k, v in settings.items() if v)
    if bad:
        raise ValueError(f"tensor_parallel: not supported with {', '.join(bad)} yet")
    if tp is None:
        env = torchrun_rank()
        if env is not None and env[1] == tensor_parallel:   # every rank started by torchrun: join, don't spawn
            if env[0] != 0:
                raise ValueError(f"tensor_parallel: torchrun rank {env[0]} follows rank 0's engine "
                                 "(tritune.model.parallel.serving.follow_torchrun), it builds none")
            return join_from_env(model)
        return start(model, tensor_parallel)
    if tensor_parallel not in (1, tp.group.world_size):
        raise ValueError(f"tensor_parallel: {tensor_parallel}, but the model is a shard of "
                         f"{tp.group.world_size} ranks")
    if tp.group.rank != 0:
        raise ValueError(f"model: rank {tp.group.rank}'s shard; the engine runs on rank 0 (the other ranks "
                         "call tritune.model.parallel.serving.follow)")
    return model


def join_from_env(model):
    """This torchrun rank's shard of ``model`` (its group from torchrun's variables: NCCL for a CUDA model,
    gloo on the CPU; the shard on the rank's GPU)."""
    cuda = torch.device(model.device).type == "cuda"
    group = init_from_env("nccl" if cuda else "gloo")
    return tensor_parallel(model, group, device=group.device if cuda else None)


def follow_torchrun(model) -> dict:
    """A torchrun rank other than 0 of a command (``tritune generate|serve --tp N`` under torchrun): join the
    group, keep this rank's shard of ``model``, follow rank 0's engine until it stops, leave the group.
    Returns the ledger's summary."""
    local = join_from_env(model)
    ledger, _ = follow(local.tp.group, local)
    teardown(TEARDOWN_TIMEOUT_S)
    return ledger.summary()


def engine_lead(runner: ModelRunner, model) -> Lead | None:
    """Make an engine's runner lead the group of its tensor-parallel ``model`` (None: not tensor-parallel)."""
    tp = getattr(model, "tp", None)
    if tp is None or tp.group.world_size == 1:
        return None
    leadership = getattr(tp, "leadership", None)
    return leadership.lead(runner) if leadership is not None else lead(runner, tp.group)


def engine_close(model, leader: Lead | None) -> None:
    """End the group an engine's model leads: followers told to stop (and, when :func:`start` spawned them,
    collected, the group left)."""
    if leader is not None:
        leader.close()
    tp = getattr(model, "tp", None)
    leadership = getattr(tp, "leadership", None)
    if leadership is not None:
        leadership.close()
    elif tp is not None and torchrun_rank() is not None:    # joined from torchrun's variables: leave too
        teardown(TEARDOWN_TIMEOUT_S)
