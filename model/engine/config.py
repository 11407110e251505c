"""The engine's settings in one place: :class:`EngineConfig`, every field checked in ``__post_init__``.

``Engine(model, config)`` takes one; ``Engine(model, **keywords)`` builds one from the same names (the
keywords the engine always took), and ``Engine(model, config, **keywords)`` overrides fields of ``config``.
What each setting does is written on :class:`~tritune.model.engine.engine.Engine`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from tritune.kernels.runtime.checks import BLOCK_SIZES, is_block_size
from tritune.model.quant import ops as Q

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Prefill rows a step may run inside the captured decode step (0: none). A prefill row costs what a decode
# row costs in every linear (on the H100, GPT-2 small's linears stay bound by their weight reads well past
# 100 rows, so 64 more rows add little), but its attention reads its whole context through paged attention
# (per query row): 64 rows of a 2048-token context re-read that sequence's K/V 64 times per layer (mostly
# from L2). 64 keeps a chunk near the cost of one decode step while taking prefix-cache suffixes (16-64
# tokens) whole; the scheduler's long_prefill_token_threshold cuts long prompts to fit.
GRAPH_PREFILL_TOKENS = 64
GRAPH_PREFILL_WORK = 16384     # context positions the prefill rows of a step beside decodes read
POLICIES = ("fcfs", "priority", "spf")
MAX_DECODE_STEPS = 64
KV_CACHE_DTYPES = (None, "auto", "fp8")    # None/"auto": the model's dtype; "fp8": e4m3, per-token scales


def _int(name: str, v, lo: int, hi: int | None = None, none: bool = False) -> None:
    if v is None and none:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected {rng}{' or None' if none else ''}, got {v!r}")


def _choice(name: str, v, options) -> None:
    if not any(v is o or (type(v) is type(o) and v == o) for o in options):
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, options))}, got {v!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Every setting of an :class:`~tritune.model.engine.engine.Engine` but the model and tokenizer."""
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    block_size: int = 16
    max_batch_tokens: int | None = None
    max_num_seqs: int = 256
    cuda_graphs: bool | str = True
    compile: bool = False
    quant: str | None = None
    group_size: int = 128
    fp8_block: bool = False
    kv_cache_dtype: str | None = None
    graph_buckets: tuple = GRAPH_BUCKETS
    prefill_batching: bool | None = None
    prefill_min_seats: int | None = None
    prefill_max_wait: int = 8
    decode_steps: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = False
    policy: str = "fcfs"
    speculative: Any = None
    batch_invariant: bool = False
    run_ahead: bool = False
    fused_decode: bool | str = "auto"
    graph_prefill_tokens: int = GRAPH_PREFILL_TOKENS
    graph_prefill_work: int | None = GRAPH_PREFILL_WORK
    long_prefill_token_threshold: int | None = None
    tensor_parallel: int = 1

    def __post_init__(self):
        self._check_kv()
        _int("max_batch_tokens", self.max_batch_tokens, 1, none=True)
        _int("max_num_seqs", self.max_num_seqs, 1)
        _choice("cuda_graphs", self.cuda_graphs, (True, False, "eager"))
        _choice("compile", self.compile, (True, False))
        if self.cuda_graphs and self.compile:
            raise ValueError("cuda_graphs and compile: pick one fast decode path")
        Q.check_mode(self.quant)
        _int("group_size", self.group_size, 1)
        self._check_fp8()
        buckets = tuple(self.graph_buckets)
        if not buckets:
            raise ValueError("graph_buckets: expected at least one batch size")
        for b in buckets:
            _int("graph_buckets", b, 1)
        object.__setattr__(self, "graph_buckets", buckets)
        _choice("prefill_batching", self.prefill_batching, (None, True, False))
        _int("prefill_min_seats", self.prefill_min_seats, 1, none=True)
        _int("prefill_max_wait", self.prefill_max_wait, 0)
        _int("decode_steps", self.decode_steps, 1, MAX_DECODE_STEPS)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "batch_invariant", "run_ahead"):
            _choice(name, getattr(self, name), (True, False))
        _choice("policy", self.policy, POLICIES)
        if self.batch_invariant and self.compile:
            raise ValueError("batch_invariant and compile: the compiled decode's reductions follow the batch")
        _choice("fused_decode", self.fused_decode, (True, False, "auto"))
        _int("graph_prefill_tokens", self.graph_prefill_tokens, 0)
        _int("graph_prefill_work", self.graph_prefill_work, 1, none=True)
        _int("long_prefill_token_threshold", self.long_prefill_token_threshold, 1, none=True)
        _int("tensor_parallel", self.tensor_parallel, 1)
        if self.long_prefill_token_threshold is not None and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold: cuts prompts into chunks; it needs "
                             "enable_chunked_prefill=True")

    def _check_fp8(self) -> None:
        _choice("fp8_block", self.fp8_block, (True, False))
        if self.fp8_block and self.quant != "fp8":
            raise ValueError(f"fp8_block: block-scaled weights need quant='fp8', got quant={self.quant!r}")
        if self.quant == "fp8" and self.batch_invariant:
            raise ValueError("quant: 'fp8' does not run with batch_invariant (its pinned kernels take dense or "
                             "int8/int4 weights)")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype == "fp8":
            for name in ("speculative", "batch_invariant", "compile"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"kv_cache_dtype: 'fp8' does not run with {name} (its paths read a dense cache)")

    def _check_kv(self) -> None:
        given = [n for n in ("num_blocks", "kv_memory_bytes", "kv_memory_fraction") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of num_blocks, kv_memory_bytes, kv_memory_fraction (got {given})")
        _int("num_blocks", self.num_blocks, 1, none=True)
        _int("kv_memory_bytes", self.kv_memory_bytes, 1, none=True)
        f = self.kv_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"kv_memory_fraction: expected a number in (0, 1], got {f!r}")
        _int("block_size", self.block_size, 1, 256)
        if not is_block_size(self.block_size):
            raise ValueError(f"block_size: expected {BLOCK_SIZES}, got {self.block_size}")

    @classmethod
    def build(cls, config: "EngineConfig | None" = None, **kwargs) -> "EngineConfig":
        """``config`` (default: the defaults) with the fields in ``kwargs`` replaced; TypeError naming a
        keyword that is no field."""
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config: expected an EngineConfig, got {type(config).__name__}")
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kwargs) - names)
        if bad:
            raise TypeError(f"Engine() got unexpected keyword argument(s) {', '.join(map(repr, bad))}")
        return replace(config, **kwargs) if config is not None else cls(**kwargs)
