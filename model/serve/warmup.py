"""The serving warm-up: every kernel variant a serving run meets compiled and the CUDA graphs captured
before the first request (``tritune serve`` runs it beside a listening port; ``serve-bench`` before its
timed runs)."""
from __future__ import annotations

import sys
import time


def warm_up(engine, vocab: int, max_len: int) -> None:
    """The engine's own warm-up (the prefill and eager decode variants of every step size), then a burst
    of requests over a ladder of prompt lengths up to ``max_len`` (block boundaries, the graphs' batch
    sizes) run to completion."""
    import random

    from tritune.model.engine.scheduler import SamplingParams

    engine.warm_up()
    rnd = random.Random(0)
    lens = [1, 2, 15, 16, 17, 63, 64, 100, 129, min(max_len, 511), min(max_len, 512)]
    n = min(len(lens) * 3, engine.max_num_seqs + 8)
    for i in range(n):
        p = lens[i % len(lens)]
        engine.add_request([rnd.randrange(vocab - 1) for _ in range(p)],
                           SamplingParams(max_new_tokens=3 + i % 5, ignore_eos=True))
    engine.run()


def serve_warm_up(engine) -> None:
    """``tritune serve``'s warm-up (in the engine's thread or process): :func:`warm_up` over half the
    context, its time on stderr."""
    t0 = time.perf_counter()
    warm_up(engine, engine.config.vocab_size, engine.config.n_positions // 2)
    print(f"warm-up: {time.perf_counter() - t0:.1f} s; ready", file=sys.stderr, flush=True)
