"""Decode tok/s of the fused step (one persistent launch: tritune.model.engine.fused_decode) against today's
per-op step and against the memory floor, all in one run; and where each path's time goes.

    python benchmarks/bench_fused_decode.py [--results DIR] [--steps 256] [--reps 5] [--time-limit 230] [--export]
                                            [--models gpt2-small] [--batches 1] [--variants auto,off,uniform,stream]
                                            [--configs 'NAME={"block_k": 256, "block_n": 64};...'] [--stage-split first]

Rows: GPT-2 small (random init), the packaged model (model/default) and GPT-2 medium (random init), bf16,
batch 1 and 8. For each: the device-side decode step as the engine runs it (tritune.model.engine.graphs:
embedding, model, greedy argmax fed back, one CUDA graph replayed ``--steps`` times from position 64),
timed with CUDA events over ``--reps`` runs (median), per-op and fused; the floor is the weight bytes a
step reads (every layer and the LM head once) over the copy bandwidth measured here (1 GiB device copy).
Per-stage time of the fused step: launches that stop after stage k (``FusedDecode(..., stages=k)``), each
replayed in a CUDA graph, differences summed by stage kind (and each kind's median stage). Per-kernel time of the per-op step: torch.profiler over graph replays.
The greedy tokens of both paths are compared (``tokens_equal``: the fraction of equal steps).
``--variants``: the fused step timed once per split variant of its GEMV stages (``VARIANTS``: "off", each
program whole column tiles over the full K; "uniform", K slices by shape; "stream", stream-K everywhere;
"auto", the default plan), each with its own stage split, against the one per-op measurement of the row.
``--configs``: more named variants, each a JSON object of Config overrides (tile sizes, warps, poll...):
a config sweep in one run (each distinct tile/warp/poll combination is one compile). ``--stage-split``:
the per-stage split for the first variant only (default), every variant, or none.

Appends each row, keyed (benchmarks/rows.py: commit, date, GPU, versions), to
results/<gpu-slug>/fused_decode.json as soon as it is measured (a cut-off run keeps what it measured) and
prints a table.
``--export``: also writes the measured verdict (``faster``) with the config into the user store's
``fused_decode.json`` (``$TRITUNE_CONFIG_DIR`` or the user cache; ``--export-root`` another store root),
which ``Engine(fused_decode="auto")`` follows.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rows import commit, write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

import torch

DEV = "cuda"     # (a dry run of the plumbing on the interpreter swaps it)


def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def copy_bandwidth() -> float:
    import triton.testing

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def random_gpt2(n_layer, n_embd, n_head, n_positions=1024, vocab=50257, dtype=torch.bfloat16, seed=0):
    from tritune.model.gpt2 import weights as W
    from tritune.model.gpt2.config import GPT2Config
    from tritune.model.gpt2.model import GPT2

    g = torch.Generator(device=DEV).manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions, vocab_size=vocab)
    E, F = n_embd, 4 * n_embd
    state = {"wte.weight": 0.02 * torch.randn(vocab, E, generator=g, device=DEV),
             "wpe.weight": 0.01 * torch.randn(n_positions, E, generator=g, device=DEV),
             "ln_f.weight": torch.ones(E, device=DEV), "ln_f.bias": torch.zeros(E, device=DEV)}
    for i in range(n_layer):
        for name, shape in (("attn.c_attn.weight", (E, 3 * E)), ("attn.c_attn.bias", (3 * E,)),
                            ("attn.c_proj.weight", (E, E)), ("attn.c_proj.bias", (E,)),
                            ("mlp.c_fc.weight", (E, F)), ("mlp.c_fc.bias", (F,)),
                            ("mlp.c_proj.weight", (F, E)), ("mlp.c_proj.bias", (E,))):
            state[f"h.{i}.{name}"] = 0.02 * torch.randn(shape, generator=g, device=DEV)
        for ln in ("ln_1", "ln_2"):
            state[f"h.{i}.{ln}.weight"] = 1 + 0.1 * torch.randn(E, generator=g, device=DEV)
            state[f"h.{i}.{ln}.bias"] = 0.1 * torch.randn(E, generator=g, device=DEV)
    return GPT2(cfg, W.to_layout(cfg, state, dtype, DEV), backend="triton")


def packaged(dtype=torch.bfloat16):
    from tritune.model.load import default_model_dir
    from tritune.model.gpt2.model import GPT2

    return GPT2.from_pretrained(default_model_dir(), backend="triton", dtype=dtype, device=DEV)


def time_graph(g, B, start, steps, reps, block_size):
    """Median seconds per step of ``steps`` replays from position ``start``, and the greedy tokens."""
    tables = [list(range(r * g.mb, (r + 1) * g.mb)) for r in range(B)]
    times, toks = [], None
    for rep in range(reps + 1):
        g.load([(11 * r + 5) % 1000 for r in range(B)], [start] * B, [10 ** 6] * B, [-1] * B, tables)
        ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev[0].record()
        g.run(B, steps)
        ev[1].record()
        torch.cuda.synchronize()
        if rep:     # the first run warms up
            times.append(ev[0].elapsed_time(ev[1]) / 1e3 / steps)
        toks = g.tokens([start] * B, min(steps, g.R))
    return statistics.median(times), toks


def profile_graph(g, B, steps=10):
    """us per step by kernel name over ``steps`` graph replays (the per-op step's split)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.run(B, steps)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            out[e.key[:60]] = round(t / steps, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def stage_split(fd, x, slots, bt, ctx, n_layer, reps=10):
    """us per step by stage kind of the fused step: launches stopping after stage k, each captured in a CUDA
    graph with a copy of the input rows (the step overwrites them) and replayed ``reps`` times (median),
    differenced. (Eager launches carried 110-260 us of launch cost whose spread swamped the stages.)"""
    kinds = ["qkv+ln1+kv write", "attention", "out-proj+residual", "fc+ln2+gelu", "proj+residual"]
    xx = x.clone()

    def body(k):
        xx.copy_(x)
        fd(xx, slots, bt, ctx, stages=k)

    def t(k):
        from tritune.model.engine.fused_tune import time_us

        return time_us(lambda: body(k), reps)

    n = 5 * n_layer + 1
    tk = [t(k) for k in range(0, n + 1)]     # tk[0]: the launch with no stage (counter reset, the copy)
    per = [b - a for a, b in zip(tk, tk[1:])]
    split = dict.fromkeys(kinds + ["lm head+lnf"], 0.0)
    for s, us in enumerate(per):
        split["lm head+lnf" if s == n - 1 else kinds[s % 5]] += us
    split = {k: round(v, 1) for k, v in split.items()}
    split["launch, no stage (graph)"] = round(tk[0], 1)
    split["whole step (graph)"] = round(tk[-1], 1)
    split["layer stages us each, median by kind"] = {
        kinds[j]: round(statistics.median(per[j:n - 1:5]), 2) for j in range(5)}
    return split


# Split variants of the fused step's GEMV stages (--variants): overrides of the config the step would take
# (tuned store or default). All share one compiled kernel (splits are runtime arguments).
VARIANTS = {
    "auto": {},                                   # per stage by shape (kernels.fused_decode.plan_splits)
    "off": {"split_qkv": 1, "split_o": 1, "split_fc": 1, "split_proj": 1, "stream_k": 1},   # whole K a program
    "uniform": {"stream_k": 1},                   # uniform K slices by shape, never stream-K
    "stream": {"stream_k": 2},                    # stream-K in every stage, the LM head included
}


def fused_variant(model, kv, B, base, overrides, args, s_op, tok_op, floor, deadline, mb, start, steps, bs,
                  want_split=True):
    from tritune.model.engine import fused_decode as FD
    from tritune.model.engine.graphs import DecodeGraphs

    c = model.config
    fm = FD.fused_model(model.with_ops(model.ops), kv, max_rows=B, config=dict(base, **overrides))
    fd = fm.fused
    plan = fd._plan(B)
    v = {"config": dataclasses.asdict(plan[0]), "programs": plan[1], "splits": list(plan[2]), "kv_split": plan[3]}
    fused = DecodeGraphs(fm, kv, mb, [B], hist=max(16, steps))
    s_fd, tok_fd = time_graph(fused, B, start, steps, args.reps, bs)
    fd.check()
    v["fused_tok_s"] = round(B / s_fd, 1)
    v["fused_us_per_step"] = round(s_fd * 1e6, 1)
    v["speedup"] = round(s_op / s_fd, 3)
    v["tokens_equal"] = round(sum(a == b for a, b in zip(tok_op, tok_fd)) / max(1, len(tok_op)), 3)
    v["fused_of_floor"] = round(floor / s_fd, 3)
    v["weight_bytes"] = fd.weight_bytes
    if want_split and time.time() < deadline - 20:
        x = torch.randn(B, c.n_embd, device=DEV, dtype=model.dtype)
        v["fused_stage_us"] = stage_split(fd, x, fused.slots[:B], fused.bt[:B], fused.ctx[:B].clone(), c.n_layer,
                                          reps=3 if c.n_layer > 12 else 5)
        fd.check()
    del fused, fm, fd
    torch.cuda.empty_cache()
    return v


def bench_row(name, model, B, args, bw, deadline):
    from tritune.model.engine import fused_decode as FD
    from tritune.model.gpt2.model import PagedKVCache
    from tritune.model.engine.graphs import DecodeGraphs

    c = model.config
    bs = 16
    mb = -(-c.n_positions // bs)
    kv = PagedKVCache(c, B * mb, bs, model.dtype, DEV)
    start = min(64, c.n_positions // 4)
    steps = min(args.steps, c.n_positions - start - 1)
    row = {"model": name, "batch": B, "layers": c.n_layer, "width": c.n_embd, "context": [start, start + steps]}
    t0 = time.time()
    per_op = DecodeGraphs(model.with_ops(model.ops), kv, mb, [B], hist=max(16, steps))
    s_op, tok_op = time_graph(per_op, B, start, steps, args.reps, bs)
    row["per_op_tok_s"] = round(B / s_op, 1)
    row["per_op_us_per_step"] = round(s_op * 1e6, 1)
    row["per_op_kernels_us"] = profile_graph(per_op, B)
    del per_op
    row["bucket"] = FD.bucket(c, B, model.dtype)
    row["dtype"] = str(model.dtype).replace("torch.", "")
    fd0 = FD.FusedDecode(model, kv, max_rows=B)     # the config the step takes here (store or default)
    base, wb = dataclasses.asdict(fd0.config_for(B)), fd0.weight_bytes
    del fd0
    floor = wb / bw
    row["weight_bytes"] = wb
    row["floor_us_per_step"] = round(floor * 1e6, 1)
    row["floor_tok_s"] = round(B / floor, 1)
    row["variants"] = {}
    for i, vname in enumerate(args.variants):
        want_split = args.stage_split == "all" or (args.stage_split == "first" and i == 0)
        if time.time() > deadline - 15:
            row["variants"][vname] = {"error": "time limit"}
            continue
        try:
            row["variants"][vname] = fused_variant(model, kv, B, base, VARIANTS[vname], args, s_op, tok_op, floor, deadline,
                                                   mb, start, steps, bs, want_split)
        except Exception as e:  # noqa: BLE001  (a variant that fails is recorded; the others still run)
            row["variants"][vname] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    ok = {k: v for k, v in row["variants"].items() if "error" not in v}
    if not ok:
        raise RuntimeError("every fused variant failed: " + "; ".join(v["error"][:300] for v in row["variants"].values()))
    # the row's fused figures: the first variant asked for (the step as the engine takes it by default: "auto")
    first = next(iter(ok.values()))
    row.update({k: first[k] for k in ("config", "programs", "splits", "kv_split", "fused_tok_s", "fused_us_per_step",
                                      "speedup", "tokens_equal", "fused_of_floor") if k in first})
    if "fused_stage_us" in first:
        row["fused_stage_us"] = first["fused_stage_us"]
    row["best_variant"] = max(ok, key=lambda k: ok[k]["fused_tok_s"])
    row["seconds"] = round(time.time() - t0, 1)
    del kv
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="results root (default: results)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=230.0, help="seconds; rows not started by then are skipped")
    ap.add_argument("--models", default="gpt2-small,packaged,gpt2-medium")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--variants", default="auto",
                    help="comma-separated split variants of the fused step's GEMV stages, timed in turn in one "
                         f"row (first: the row's figures): {', '.join(VARIANTS)}")
    ap.add_argument("--configs", default="",
                    help="more variants: 'NAME=JSON;NAME=JSON', each JSON an object of Config overrides")
    ap.add_argument("--stage-split", default="first", choices=["first", "all", "none"],
                    help="which variants get the per-stage split (launches stopping after each stage)")
    ap.add_argument("--export", action="store_true", help="store the measured verdict for fused_decode='auto'")
    ap.add_argument("--export-root", default=None, help="store root for --export (default: the user store)")
    a = ap.parse_args(argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for item in filter(None, (c.strip() for c in a.configs.split(";"))):
        name, _, js = item.partition("=")
        try:
            over = json.loads(js)
            from tritune.kernels.fused_decode import Config
            Config.from_dict(over)
        except (ValueError, TypeError) as e:
            print(f"bench_fused_decode: --configs: {name}: {e}", file=sys.stderr)
            return 2
        VARIANTS[name.strip()] = over
        a.variants.append(name.strip())
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad or not a.variants:
        print(f"bench_fused_decode: --variants: unknown {bad or '(none)'}; choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_fused_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    deadline = t_start + a.time_limit
    res = {"dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
           "device": torch.cuda.get_device_name(), "rows": [], "skipped": []}
    bw = copy_bandwidth()
    res["copy_bytes_per_s"] = bw
    builders = {"gpt2-small": lambda: random_gpt2(12, 768, 12), "packaged": packaged,
                "gpt2-medium": lambda: random_gpt2(24, 1024, 16, seed=1)}
    for name in a.models.split(","):
        model = None
        for B in (int(b) for b in a.batches.split(",")):
            if time.time() > deadline - 30:
                res["skipped"].append(f"{name} batch {B}: time limit")
                continue
            try:
                model = model or builders[name]()
                res["rows"].append(bench_row(name, model, B, a, bw, deadline))
            except Exception as e:  # noqa: BLE001  (a row that fails is recorded; the others still run)
                res["rows"].append({"model": name, "batch": B, "error": f"{type(e).__name__}: {e}"[:2000]})
            res["seconds"] = round(time.time() - t_start, 1)
            write_rows("fused_decode", res["rows"][-1:], a.results, copy_bytes_per_s=bw, dirty=res["dirty"],
                       skipped=res["skipped"], seconds=res["seconds"], command=" ".join(sys.argv))
        del model
        torch.cuda.empty_cache()
    res["seconds"] = round(time.time() - t_start, 1)
    path = write_rows("fused_decode", [], a.results, copy_bytes_per_s=bw, dirty=res["dirty"],  # the fields alone
                      skipped=res["skipped"], seconds=res["seconds"], command=" ".join(sys.argv))
    print(f"wrote {path}")
    print(f"{res['device']}  copy {bw / 1e12:.2f} TB/s  commit {commit()}  ({res.get('seconds', 0)} s)")
    print(f"{'model':<12} {'B':>2} {'per-op tok/s':>13} {'fused tok/s':>12} {'x':>6} {'floor tok/s':>12} "
          f"{'of floor':>8} {'tokens eq':>9}")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['model']:<12} {r['batch']:>2}  error: {r['error'][:150]}")
            continue
        print(f"{r['model']:<12} {r['batch']:>2} {r['per_op_tok_s']:>13.0f} {r['fused_tok_s']:>12.0f} "
              f"{r['speedup']:>6.2f} {r['floor_tok_s']:>12.0f} {r['fused_of_floor']:>8.2f} {r['tokens_equal']:>9.2f}")
        for vn, v in r["variants"].items():
            if "error" in v:
                print(f"    {vn:<8} error: {v['error'][:150]}")
                continue
            print(f"    {vn:<8} fused {v['fused_tok_s']:>8.0f} tok/s  x{v['speedup']:.2f}  of floor {v['fused_of_floor']:.2f}"
                  f"  tokens eq {v['tokens_equal']:.2f}  splits {v['splits']}")
            if "fused_stage_us" in v:
                print("             stages (us/step): " + ", ".join(f"{k} {x}" for k, x in v["fused_stage_us"].items()))
        print("    per-op kernels (us/step): " + ", ".join(f"{k.split('_kernel')[0]} {v}"
                                                         for k, v in list(r["per_op_kernels_us"].items())[:5]))
    for s in res["skipped"]:
        print("skipped:", s)
    if a.export:
        from tritune.model.engine import fused_decode as FD
        from tritune.kernels.runtime import store

        # the fastest variant's config: the same plan again on this GPU (split and stream_k keys as timed)
        best = [(r, r["variants"][r["best_variant"]]) for r in res["rows"] if "error" not in r]
        entries = [{"bucket": r["bucket"], "dtype": r["dtype"], "config": dict(v["config"], faster=int(v["speedup"] > 1.0)),
                    "time_us": v["fused_us_per_step"], "default_us": r["per_op_us_per_step"]} for r, v in best]
        if entries:
            p = store.write(FD.KERNEL, entries, root=Path(a.export_root) if a.export_root else None)
            print(f"exported {len(entries)} entries to {p}")
    return 0 if all("error" not in r and all("error" not in v for v in r["variants"].values())
                    for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
