"""Prefill attention variants (what Triton compiles one kernel for: config + int specialisations, as
ModelRunner.prefill_variant tells them apart) that prefills continuing cached sequences can launch, for
GPT-2 small in bf16 and fp32 (H100 defaults: no tuned attention_varlen entries), and how many candidate
prefills the warm-up scans to find them (host only; no GPU).

  python lab/probes/serve_prefill_variants.py

Found on the CPU, 2026-11-24: the context path (prefix-cache hits: short queries over long contexts)
has 44 bf16 variants in 8 configs (24 in fp32) over 31544 candidates scanned in 0.6 s; the warm-up's
ladder of whole prompts launched none of its (BLOCK_M 16/32, BLOCK_N 64) configs. The H100 HTTP bench
repeats its prompts, so every timed round after the first in-process run is prefix hits: its first burst
of small prefill steps (requests arriving a few per step) met these variants and compiled them (~1 s,
the first round's submit -> add p50 of 919 ms). Without padding the gathered K/V to 16 rows: 95.
"""
import time
import types

import torch

import tritune.harness  # noqa: F401
from tritune.kernels import _interpret_bf16
from tritune.model import runner as R
from tritune.model.gpt2 import GPT2Config

_interpret_bf16.require = lambda *a, **k: None     # configs only: nothing runs in bf16 here


def main():
    cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    for dt in (torch.bfloat16, torch.float32):
        fake = types.SimpleNamespace(config=cfg, model=types.SimpleNamespace(backend="triton", dtype=dt))
        t0, seen, n = time.time(), set(), 0
        for q, c in R._context_candidates(cfg.n_positions, 256, 8192, R.GRAPH_PREFILL_TOKENS):
            seen.add(R.ModelRunner.prefill_variant(fake, q, c))
            n += 1
        print(f"{str(dt):15s} {n} candidates, {len(seen)} context variants in {len({k[1] for k in seen})} configs "
              f"({time.time() - t0:.2f} s)")


if __name__ == "__main__":
    main()
