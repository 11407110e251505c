"""Timing three ways for the L2-flush probes: do_bench with its zero-fill flush, do_bench with a flush
that leaves clean lines, and CUDA-graph replay (GPU only). Moved here from harness/bench.py: only
probes use it."""
from __future__ import annotations

from typing import Callable

import torch
import triton

from tritune.harness.bench import graph_ms, median_ms


_READER: list = []


def flush_timings(fn: Callable[[], object]) -> dict:
    """``fn`` timed three ways (GPU only):
    zero_us: do_bench as every table reports it (L2 flushed by a zero-fill, which leaves dirty lines);
    clean_us: do_bench with the zero-fill followed by a read of 128 MB (L2 left holding clean lines: still
    cold for ``fn``, but no write-back charged to it); graph_us: replayed in a CUDA graph."""
    drv = triton.runtime.driver.active
    zero_flush = drv.clear_cache
    if not _READER:
        _READER.append(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))

    def clean_flush(cache):
        zero_flush(cache)
        _READER[0].max()  # the dirty lines are written back here, outside the timed call

    row = {}
    try:
        row["zero_us"] = median_ms(fn) * 1e3
        drv.clear_cache = clean_flush
        row["clean_us"] = median_ms(fn) * 1e3
        drv.clear_cache = zero_flush
        row["graph_us"] = graph_ms(fn) * 1e3
    finally:
        drv.clear_cache = zero_flush
    return row


def flush_row(fn: Callable[[], object], **fields) -> dict:
    """``fields`` plus :func:`flush_timings` of ``fn`` (or the error that stopped it), printed as it is
    measured: one row of the flush and variant probes."""
    row = dict(fields)
    try:
        row.update(flush_timings(fn))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return row
