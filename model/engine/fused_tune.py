"""``tritune tune-decode``: the fused decode step's launch config, searched and stored per GPU like every
kernel's (``tuning/configs/<gpu>/fused_decode.json``, user store over packaged).

The step (:mod:`tritune.model.engine.fused_decode`) takes a whole model, so it is no ``KernelSpec``; its config
(:class:`tritune.kernels.fused_decode.Config`: weight tiles, K splits, stream-K, the LM head's blocks, KV
chunks) is keyed by the model's shape and the row count (``E=..,F=..,H=..,M=..``). For each row count the
command times today's per-op step and the fused step at the current config (stored or default) and at
``--points`` more points of a grid, each first verified: one step's logits against the float64 reference
within the tolerance, or no worse than the per-op step's own error plus a quarter of it (the rule of
tests/test_fused_decode.py); a point that fails to compile, to verify or to finish its barriers is
recorded, never fatal. Times are CUDA-graph replays of the step (median of ``--reps``); the stored entry
carries ``faster`` (fused faster than per-op here), which ``Engine(fused_decode="auto")`` follows.

    tritune tune-decode [--model DIR | --shape gpt2-small] [--batches 1,8] [--points 12] [--export]

Under the Triton interpreter (no GPU) it runs the same checks on a tiny model; its times are the
interpreter's and mean nothing about a GPU.
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time

SHAPES = {"tiny": (2, 64, 2), "gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16),
          "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
# the points tried beside the current config (each key's values are Config.SPACE's)
GRID = {"block_n": [16, 32, 64], "block_k": [64, 128, 256, 512], "lm_block_n": [0, 32, 64],
        "stream_k": [0, 2], "kv_split": [0, 2, 4], "kv_min_chunk": [1, 32]}


def random_model(n_layer, n_embd, n_head, dtype, device, *, n_positions=1024, vocab=50257, seed=0):
    """GPT-2 of these sizes with random weights (the step's time depends on shapes, not values)."""
    import torch

    from tritune.model.gpt2 import weights as W
    from tritune.model.gpt2.config import GPT2Config
    from tritune.model.gpt2.model import GPT2

    g = torch.Generator().manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab)
    E, F = n_embd, 4 * n_embd
    s = E ** -0.5
    state = {"wte.weight": torch.randn(vocab, E, generator=g), "wpe.weight": 0.5 * torch.randn(n_positions, E, generator=g),
             "ln_f.weight": 1 + 0.1 * torch.randn(E, generator=g), "ln_f.bias": 0.1 * torch.randn(E, generator=g)}
    for i in range(n_layer):
        for name, shape, std in (("ln_1.weight", (E,), 0.1), ("ln_1.bias", (E,), 0.1),
                                 ("attn.c_attn.weight", (E, 3 * E), 2 * s), ("attn.c_attn.bias", (3 * E,), 0.1),
                                 ("attn.c_proj.weight", (E, E), s), ("attn.c_proj.bias", (E,), 0.1),
                                 ("ln_2.weight", (E,), 0.1), ("ln_2.bias", (E,), 0.1),
                                 ("mlp.c_fc.weight", (E, F), s), ("mlp.c_fc.bias", (F,), 0.1),
                                 ("mlp.c_proj.weight", (F, E), 0.5 * s), ("mlp.c_proj.bias", (E,), 0.1)):
            t = std * torch.randn(shape, generator=g)
            state[f"h.{i}.{name}"] = t + 1 if name.startswith("ln_") and name.endswith("weight") else t
    return GPT2(cfg, W.to_layout(cfg, state, dtype, device), backend="triton")


def candidates(current: dict, points: int, seed: int) -> list[dict]:
    """The current config, then up to ``points`` distinct grid points (each the current config with the
    grid's keys replaced), drawn in a seeded order."""
    from tritune.kernels.fused_decode import Config

    keys = list(GRID)
    rng = random.Random(seed)
    seen = {tuple(sorted(current.items()))}
    out = [dict(current)]
    tries = 0
    while len(out) < points + 1 and tries < 50 * (points + 1):
        tries += 1
        c = dict(current, **{k: rng.choice(GRID[k]) for k in keys})
        key = tuple(sorted(c.items()))
        if key in seen:
            continue
        seen.add(key)
        Config.from_dict(c)   # the grid is the space's: a bad point here is a bug in GRID
        out.append(c)
    return out


class Step:
    """One decode step of M rows over a cache of random K/V, contexts spread up to ``ctx``: the inputs,
    the float64 reference and the per-op step's logits (computed once)."""

    def __init__(self, model, M: int, ctx: int, *, block_size=16, seed=1):
        import torch

        from tritune.model.gpt2.model import PagedKVCache
        from tritune.references.fused_decode import fused_decode as reference

        c, dev = model.config, model.device
        g = torch.Generator().manual_seed(seed)
        self.model, self.M = model, M
        self.mb = -(-c.n_positions // block_size)
        self.cache = PagedKVCache(c, M * self.mb, block_size, model.dtype, dev)
        self.cache.k.copy_(torch.randn(self.cache.k.shape, generator=g))
        self.cache.v.copy_(torch.randn(self.cache.v.shape, generator=g))
        lens = [max(1, min(c.n_positions, ctx - 37 * m)) for m in range(M)]
        pos = torch.tensor([n - 1 for n in lens])
        bt = torch.arange(M * self.mb, dtype=torch.int32).view(M, self.mb)
        self.slots = (bt[torch.arange(M), pos // block_size] * block_size + pos % block_size).to(torch.int32).to(dev)
        self.bt, self.pos = bt.to(dev), pos.to(dev)
        self.ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.ids = torch.randint(0, c.vocab_size, (M,), generator=g).to(dev)
        self.x = model.embed(self.ids, self.pos).contiguous()
        self.ref = reference(self.x, model.w, self.cache.k_caches, self.cache.v_caches, self.slots, self.bt,
                             self.ctx, n_head=c.n_head, eps=c.layer_norm_epsilon)
        self.per_op = model.decode(self.ids, self.pos, self.cache, self.slots, self.bt, self.ctx).clone()

    def per_op_fn(self):
        return lambda: self.model.decode(self.ids, self.pos, self.cache, self.slots, self.bt, self.ctx)


def time_us(fn, reps: int) -> float:
    """Median µs of ``fn``: CUDA-graph replays on a GPU, wall clock of single calls under the interpreter.
    One call a graph, with programmatic dependent launch as the engine has it: ``harness.bench.graph_ms``
    and ``replay_ms`` switch it off (they repeat one kernel back to back), and a decode step's own
    launches overlap through it."""
    import torch

    from tritune.kernels.runtime import device as dev

    if dev.interpreted() or not torch.cuda.is_available():
        ts = []
        for _ in range(max(1, reps)):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps + 1):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts[1:])


def try_point(step: Step, cfg: dict, reps: int) -> dict:
    """Verify one config on ``step``, then time it: a row of the table (``error`` set when it failed)."""
    from tritune.kernels.runtime.compare import rel_error, tolerance
    from tritune.model.engine.fused_decode import FusedDecode

    row = {"config": cfg}
    try:
        fd = FusedDecode(step.model, step.cache.clone(), max_rows=step.M, config=cfg)
        got = fd(step.x.clone(), step.slots, step.bt, step.ctx).clone()
        fd.check()
        tol = tolerance(step.model.dtype)
        err, err_op = rel_error(got, step.ref), rel_error(step.per_op, step.ref)
        row["rel_error"], row["per_op_rel_error"] = err, err_op
        if not err <= max(tol, err_op + tol / 4):
            row["error"] = f"logits {err:.3g} off float64 (per-op step {err_op:.3g}, tolerance {tol:g})"
            return row
        xx = step.x.clone()

        def fn():
            xx.copy_(step.x)
            fd(xx, step.slots, step.bt, step.ctx)
        row["us"] = time_us(fn, reps)
        fd.check()
    except Exception as e:  # noqa: BLE001  (a point that fails is recorded; the search goes on)
        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return row


def tune(model, batches, *, points=12, reps=10, seed=0, ctx=None, log=print) -> list[dict]:
    """Per row count: the per-op step's time and every point's row; returns one result per M with the
    best verified point (``best``: None when none verified)."""
    import torch

    from tritune.model.engine import fused_decode as FD
    from tritune.model.engine.fused_decode import FusedDecode

    c = model.config
    out = []
    for M in batches:
        step = Step(model, M, ctx or min(c.n_positions, 256))
        current = dataclasses.asdict(FusedDecode(model, step.cache, max_rows=M).config_for(M))
        current.pop("faster", None)
        t_op = time_us(step.per_op_fn(), reps)
        rows = []
        for i, cfg in enumerate(candidates(current, points, seed)):
            r = try_point(step, cfg, reps)
            rows.append(r)
            status = r.get("error") or f"{r['us']:.1f} us ({r['rel_error']:.2e} off float64)"
            log(f"  M={M} point {i}{' (current)' if i == 0 else ''}: {_short(cfg)}: {status}")
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        out.append({"M": M, "bucket": FD.bucket(c, M, model.dtype), "per_op_us": t_op, "rows": rows, "best": best,
                    "current_us": rows[0].get("us")})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _short(cfg: dict) -> str:
    from tritune.kernels.fused_decode import Config

    d = Config()
    return " ".join(f"{k}={v}" for k, v in cfg.items() if getattr(d, k, None) != v) or "(defaults)"


def add_parser(subparsers, name: str) -> None:
    from tritune.kernels.runtime.args import parse_dtype

    s = subparsers.add_parser(name, help="tune the fused decode step's launch config for a model shape on this GPU "
                                         "(verified against float64; --export stores it)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="a checkpoint directory (its shapes are what is tuned)")
    g.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a GPT-2 of these sizes with random weights (default gpt2-small; tiny under the interpreter)")
    s.add_argument("--batches", default="1", help="row counts to tune, comma-separated, 1..8 (default 1)")
    s.add_argument("--points", type=int, default=12, help="grid points tried beside the current config")
    s.add_argument("--reps", type=int, default=10, help="timed graph replays per point")
    s.add_argument("--ctx", type=int, default=None, help="the first row's context length (default 256)")
    s.add_argument("--dtype", type=parse_dtype, default=None, help="bf16 (default on a GPU), fp16 or fp32")
    s.add_argument("--seed", type=int, default=0, help="the order grid points are drawn in")
    s.add_argument("--export", action="store_true", help="store the best verified point for each row count")
    s.add_argument("--configs-dir", default=None, help="the store --export writes (default $TRITUNE_CONFIG_DIR or "
                                                       "the user cache)")
    s.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    import torch
    from tabulate import tabulate

    from tritune.kernels.runtime import device as dev
    from tritune.model.engine import fused_decode as FD
    from tritune.model.gpt2.model import GPT2
    from tritune.kernels.runtime import store
    from tritune.kernels.runtime.args import UsageError
    from tritune.model.load import default_dtype

    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise UsageError(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    if not batches or any(not 1 <= b <= FD.MAX_ROWS for b in batches):
        raise UsageError(f"--batches: row counts must be 1..{FD.MAX_ROWS}, got {args.batches!r}")
    if args.points < 0 or args.reps < 1:
        raise UsageError("--points must be >= 0 and --reps >= 1")
    gpu = not dev.interpreted() and torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = args.dtype or default_dtype(device)
    if args.model:
        try:
            model = GPT2.from_pretrained(args.model, backend="triton", dtype=dtype, device=device)
        except (OSError, ValueError) as e:
            raise UsageError(f"--model: {e}") from None
        name = str(args.model)
    else:
        name = args.shape or ("gpt2-small" if gpu else "tiny")
        L, E, H = SHAPES[name]
        model = random_model(L, E, H, dtype, device, n_positions=1024 if gpu else 64, vocab=50257 if gpu else 101)
    why = FD.why_not(model, None)
    if why:
        raise UsageError(f"this model cannot take the fused decode step: {why}")
    if not gpu:
        print("note: no CUDA GPU: the points run through the Triton interpreter; their times mean nothing "
              "about a GPU", file=sys.stderr)
    print(f"tune-decode {name} on {dev.gpu_slug()}, {str(dtype).replace('torch.', '')}, rows {batches}, "
          f"{args.points} points beside the current config")
    res = tune(model, batches, points=args.points, reps=args.reps, seed=args.seed, ctx=args.ctx)
    table, entries = [], []
    for r in res:
        b = r["best"]
        n_ok = sum("us" in x for x in r["rows"])
        table.append([r["bucket"], f"{r['per_op_us']:.1f}", _fmt(r["current_us"]), _fmt(b and b["us"]),
                      f"{r['per_op_us'] / b['us']:.2f}x" if b else "", f"{n_ok}/{len(r['rows'])}",
                      _short(b["config"]) if b else "none verified"])
        if b:
            entries.append({"bucket": r["bucket"], "dtype": store.dtype_name(dtype),
                            "config": dict(b["config"], faster=int(b["us"] < r["per_op_us"])),
                            "time_us": round(b["us"], 2), "default_us": round(r["per_op_us"], 2),
                            "trials": len(r["rows"])})
    print(tabulate(table, headers=["bucket", "per-op µs", "current µs", "best µs", "vs per-op", "verified",
                                   "best config"], disable_numparse=True))
    if args.export and entries:
        path = store.write(FD.KERNEL, entries, root=Path(args.configs_dir) if args.configs_dir else None)
        print(f"stored {len(entries)} entries in {path}")
    return 0 if entries else 1


def _fmt(v) -> str:
    return "" if v is None else f"{v:.1f}"
