"""serve-bench's workload: requests with prompt token ids, output lengths and arrival times (Poisson or all
at once, lengths drawn from ranges or read from a JSONL file), and the latency percentiles of a run. Shared
by the in-process serve-bench (:mod:`tritune.model.bench.serve_bench`) and the HTTP one
(:mod:`tritune.model.bench.http`)."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Item:
    prompt_ids: list
    output_len: int
    arrival: float = 0.0


# ---------------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------------
def parse_range(s: str) -> tuple[int, int]:
    try:
        lo, _, hi = s.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (or N), got {s!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {s!r}")
    return lo, hi


def make_workload(n, prompt_len, output_len, vocab, seed=0, rate=math.inf, jsonl=None) -> list[Item]:
    import numpy as np

    rng = np.random.default_rng(seed)
    items = []
    if jsonl:
        for i, line in enumerate(Path(jsonl).read_text().splitlines()):
            if not line.strip():
                continue
            d = json.loads(line)
            if "prompt_ids" in d:
                ids = [int(t) for t in d["prompt_ids"]]
            elif "prompt_len" in d:
                ids = rng.integers(0, vocab - 1, int(d["prompt_len"])).tolist()
            else:
                raise ValueError(f"{jsonl}:{i + 1}: expected prompt_ids or prompt_len")
            out = d.get("output_len", d.get("max_new_tokens"))
            if out is None:
                raise ValueError(f"{jsonl}:{i + 1}: expected output_len or max_new_tokens")
            items.append(Item(ids, int(out), float(d["arrival"]) if "arrival" in d else None))
        items = items[:n] if n else items
    else:
        for _ in range(n):
            p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
            o = int(rng.integers(output_len[0], output_len[1] + 1))
            items.append(Item(rng.integers(0, vocab - 1, p).tolist(), o, None))
    t = 0.0
    for it in items:
        if it.arrival is None:
            if math.isfinite(rate):
                t += float(rng.exponential(1.0 / rate))
            it.arrival = t
    return items


def percentiles(xs) -> dict:
    import numpy as np

    xs = [x for x in xs if x == x]
    if not xs:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    a = np.asarray(xs) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


# ---------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------
