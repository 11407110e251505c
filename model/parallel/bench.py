"""Batch-1 decode latency of a tensor-parallel model, and the collectives' share of it.

``python -m tritune.model.parallel.bench --tp 1 2 4 --sizes llama-8b --dtype bf16`` spawns each rank count
(NCCL on GPUs, gloo on the CPU), builds a random-init Llama of those sizes on every rank (the same seed, so
the same model), keeps each rank's shard, prefills a prompt and times ``--steps`` decode steps (the
model's own ``decode`` over a paged cache). On a GPU the step is captured as a CUDA graph on every rank
(its all-reduces and gather inside) and replayed, as the engine runs it; ``--eager`` (and the CPU) times
eager steps. Each count runs twice: with its collectives, and with them replaced by local no-ops (wrong
numbers, the same kernels), so ``1 - without / with`` is what the all-reduces and the gather cost a step.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from tritune.model.parallel.group import TPGroup
from tritune.model.parallel.launch import launch
from tritune.model.parallel.model import tensor_parallel

SIZES = {
    "llama-8b": dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, d_mlp=14336, vocab_size=128256, head_dim=128),
    "tiny": dict(n_layer=2, n_head=8, n_kv_head=2, n_embd=64, d_mlp=96, vocab_size=1000, head_dim=8),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def random_llama(sizes: dict, dtype, device, backend: str, seed: int = 0, n_positions: int = 4096):
    """A Llama of ``sizes`` with random weights made on ``device`` (std 0.02, norms 1)."""
    from tritune.model.llama import weights as W
    from tritune.model.llama.config import LlamaConfig
    from tritune.model.llama.model import Llama

    c = LlamaConfig(model_type="llama", n_positions=n_positions, **sizes)
    g = torch.Generator(device=device).manual_seed(seed)
    E, F, D, Hq, Hk, V = c.n_embd, c.d_mlp, c.head_dim, c.n_head, c.n_kv_head, c.vocab_size

    def r(*shape):
        return (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)

    def one():
        return torch.ones(E, dtype=dtype, device=device)

    layers = [W.LayerWeights(ln1_w=one(), w_qkv=r(E, (Hq + 2 * Hk) * D), b_qkv=None, w_o=r(Hq * D, E), b_o=None,
                             ln2_w=one(), w_gu=r(E, 2 * F), b_gu=None, w_down=r(F, E), b_down=None)
              for _ in range(c.n_layer)]
    w = W.LlamaWeights(wte=r(V, E), layers=layers, lnf_w=one(), lm_head=r(V, E).t())
    return Llama(c, w, backend=backend)


@dataclass(frozen=True)
class LocalOnly(TPGroup):
    """The group's shapes without its communication (the timing's baseline)."""

    def all_reduce(self, x):
        return x

    def all_gather_last(self, x):
        return torch.cat([x] * self.world_size, dim=-1)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def decode_seconds(model, steps: int, prompt: int, warmup: int = 4) -> float:
    """Seconds per batch-1 decode step after a ``prompt``-token prefill."""
    dev = model.device
    cache = model.new_cache(prompt + steps + warmup + 1)
    ids = torch.randint(0, model.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1)).to(dev)
    tok = model.prefill(ids, [prompt], kv_cache=cache, slot_mapping=torch.arange(prompt, device=dev)).argmax(-1)
    tables = torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None]
    t0 = None
    for i in range(warmup + steps):
        if i == warmup:
            _sync(dev)
            t0 = time.perf_counter()
        p = torch.tensor([prompt + i], device=dev)
        tok = model.decode(tok, p, cache, p, tables, (p + 1).to(torch.int32)).argmax(-1)
    _sync(dev)
    return (time.perf_counter() - t0) / steps


def graph_decode_seconds(model, steps: int, prompt: int, warmup: int = 3) -> float:
    """Seconds per batch-1 decode step after a ``prompt``-token prefill, the step replayed from a CUDA graph
    (its inputs fixed: the same token at the same position each replay, which times the same work)."""
    dev = model.device
    cache = model.new_cache(prompt + 2)
    ids = torch.randint(0, model.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1)).to(dev)
    tok = model.prefill(ids, [prompt], kv_cache=cache, slot_mapping=torch.arange(prompt, device=dev)).argmax(-1)
    tables = torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None]
    p = torch.tensor([prompt], device=dev)
    ctx = (p + 1).to(torch.int32)

    def step():
        return model.decode(tok, p, cache, p, tables, ctx)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(warmup):
        g.replay()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        g.replay()
    _sync(dev)
    return (time.perf_counter() - t0) / steps


def rank_bench(group: TPGroup, sizes: dict, dtype, backend: str, steps: int, prompt: int, graphs: bool = True) -> dict:
    local = tensor_parallel(random_llama(sizes, dtype, group.device, backend), group)
    cuda = torch.device(group.device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    timer = graph_decode_seconds if graphs and cuda else decode_seconds
    group.barrier()
    with_comm = timer(local, steps, prompt)
    quiet = LocalOnly(group.rank, group.world_size, group.backend, group.device)
    local.ops.group = local.tp.group = quiet
    group.barrier()
    without = timer(local, steps, prompt)
    why = (group.fast.get("why") or {}).get(local.dtype, "not set up (CPU)")
    return {"rank": group.rank, "step_s": with_comm, "local_step_s": without,
            "mode": "cuda graph" if graphs and cuda else "eager",
            "all_reduce": "one-shot (symmetric memory)" if why is None else f"backend ({why})"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tritune.model.parallel.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sizes", choices=sorted(SIZES), default="llama-8b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--backend", choices=("triton", "torch"), default="triton")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--eager", action="store_true", help="time eager steps (default on a GPU: CUDA graphs)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--all-reduce", nargs="+", choices=("nccl", "one-shot"), default=["nccl"],
                    help="one-shot: the one-shot kernel over symmetric memory where it serves (two NCCL ranks)")
    a = ap.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    base, rows = None, []
    for n in a.tp:
        for ar in (a.all_reduce if n > 1 else a.all_reduce[:1]):
            os.environ["TRITUNE_TP_ALL_REDUCE"] = ar       # the spawned ranks read it
            res = launch(n, rank_bench, SIZES[a.sizes], DTYPES[a.dtype], a.backend, a.steps, a.prompt, not a.eager,
                         backend=backend, timeout_s=600, threads=None)
            step = max(r["step_s"] for r in res)
            local = max(r["local_step_s"] for r in res)
            base = base or step
            rows.append({"tp": n, "backend": backend, "sizes": a.sizes, "dtype": a.dtype, "kernels": a.backend,
                         "mode": res[0]["mode"], "all_reduce": res[0]["all_reduce"], "ms_per_token": step * 1e3,
                         "local_ms_per_token": local * 1e3, "speedup_vs_first": base / step,
                         "collective_share": max(0.0, 1 - local / step)})
            print(f"tp={n} ({backend}, {a.sizes}, {a.dtype}, {a.backend}, {res[0]['mode']}, all-reduce "
                  f"{res[0]['all_reduce']}): {step * 1e3:.3f} ms/token, {base / step:.2f}x tp={a.tp[0]}; "
                  f"collectives {max(0.0, 1 - local / step):.0%} of the step")
    os.environ.pop("TRITUNE_TP_ALL_REDUCE", None)
    if a.out:
        import json

        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
