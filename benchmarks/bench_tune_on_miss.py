"""Tuning on a miss (tuning/on_miss.py) measured on a GPU: what the first launch of an unstored bucket costs,
and how good the config its budgeted study finds is against the one committed in the packaged store.

    python benchmarks/bench_tune_on_miss.py [--kernels gemv,layer_norm] [--limit N] [--budget 30]
                                           [--trials N] [--rounds 5] [--dtype bfloat16] [--warm-cache]
                                           [--results DIR] [--small]

Problems: for each kernel, buckets that HAVE an entry of ``--dtype`` in the committed packaged store for this
GPU (``tuning/configs/<gpu-slug>/<kernel>.json``, or ``$TRITUNE_CONFIGS`` where the caller sets it): the
spec's standard problems in those buckets first (GPT-2 decode for gemv), then the other entries' recorded
problems; ``--limit`` of them per kernel (default 3 for gemv, 1 for the others).

Each problem runs in a fresh process (a user's first launch) with TRITUNE_CONFIGS at an empty folder (the
packaged store moved aside, so every bucket misses and no committed winner seeds the study),
TRITUNE_CONFIG_DIR at a fresh user store, TRITUNE_STUDIES at a fresh journal, TRITUNE_TUNE_ON_MISS=1,
TRITUNE_TUNE_ON_MISS_BUDGET=--budget (TRITUNE_TUNE_ON_MISS_TRIALS=--trials where given, else the package's
24) and, unless ``--warm-cache``, a fresh TRITON_CACHE_DIR (every compile cold, as on a fresh install). The
process measures: the wall time of the first launch (CUDA context and the measured ceilings are set up
before it; the tuner's import, the study and its compiles are in it) and of the second; whether the first
launch's output is right; whether a user-store entry was written and which config the launch used; then the
winner, the committed entry's config and the heuristic default re-timed in ``--rounds`` interleaved rounds
with two timers: do_bench's flushed median on rotating input sets (``tuning.timing.median_ms``) and the
tuner's own timer (``tuning.timing.time_ms``: CUDA-graph replay for short problems). Ratios winner /
committed under each; the study's own numbers from the entry beside them.

``--small``: the spec's small problems on whatever runs here (on a CPU the Triton interpreter: every time
is the interpreter's, not a GPU's); the committed column is filled only where the store holds their bucket.
Without ``--small`` and without a GPU it says so and exits 2. Exit 1 when a problem wrote no entry, launched
wrong output or failed. Appends one keyed row per problem to ``results/<gpu-slug>/tune_on_miss.json``.
On an H200: about 40-60 s per problem at the default 30 s budget (process start, study, compiles, re-times).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rows import write_rows  # noqa: E402  (benchmarks/: keyed rows into results/<gpu-slug>/)

DEFAULT_LIMITS = {"gemv": 3}   # problems per kernel when --limit is not given; other kernels: 1


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="gemv,layer_norm", help="comma-separated (default gemv,layer_norm)")
    ap.add_argument("--limit", type=int, default=None, help="problems per kernel (default: 3 gemv, 1 others)")
    ap.add_argument("--budget", type=float, default=30.0, help="TRITUNE_TUNE_ON_MISS_BUDGET seconds (default 30)")
    ap.add_argument("--trials", type=int, default=None, help="TRITUNE_TUNE_ON_MISS_TRIALS (default: the package's)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    ap.add_argument("--dtype", default="bfloat16", help="bf16 (default), fp16, fp32 ...")
    ap.add_argument("--warm-cache", action="store_true", help="keep the caller's TRITON_CACHE_DIR (default: fresh)")
    ap.add_argument("--small", action="store_true", help="the spec's small problems (the interpreter's)")
    ap.add_argument("--results", default="results", help="root of the keyed rows (default results)")
    ap.add_argument("--child", nargs=2, metavar=("KERNEL", "PROBLEM"), help=argparse.SUPPRESS)
    ap.add_argument("--committed", default="null", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# The parent: which problems, one process each, the table and the rows
# ---------------------------------------------------------------------------------------------------
def committed_entries(spec, slug: str) -> tuple[list[dict], Path]:
    """The committed store's entries of a kernel for this GPU (the caller's TRITUNE_CONFIGS or the packaged
    store), and the file read; [] when there is none or it is unusable."""
    from tritune.kernels.runtime import store

    path = store.package_root() / slug / f"{spec.name}.json"
    try:
        return (store.read(path, spec.name, slug) if path.is_file() else []), path
    except store.StoreError as e:
        print(f"{spec.name}: {path} unusable ({e}); no committed entries", file=sys.stderr)
        return [], path


def pick(spec, entries: list[dict], dtype_key: str, small: bool, limit: int) -> list[tuple]:
    """Up to ``limit`` (problem, committed entry or None), one per bucket: standard problems in stored buckets,
    then other entries' recorded problems; ``small``: the small problems, those with an entry first."""
    import tritune.kernels as K
    from tritune.kernels.runtime import store

    stored = {e["bucket"]: e for e in entries if e["dtype"] == dtype_key}
    if small:
        pool = [(p, stored.get(K.bucket_key(spec.bucket(p)))) for p in spec.small_problems]
        pool.sort(key=lambda t: t[1] is None)
    else:
        pool = [(p, stored.get(K.bucket_key(spec.bucket(p)))) for p in spec.standard_problems]
        pool = [(store.problem_of_entry(spec, e) if e.get("problem_fields") else p, e) for p, e in pool if e]
        pool += [(store.problem_of_entry(spec, e), e) for e in stored.values()]
    out, seen = [], set()
    for p, e in pool:
        b = None if p is None else K.bucket_key(spec.bucket(p))
        if b is None or b in seen:
            continue
        seen.add(b)
        out.append((p, e))
    return out[:limit]


def child_env(tmp: Path, i: int, args) -> dict:
    env = dict(os.environ)
    (tmp / "packaged").mkdir(exist_ok=True)
    env.update(TRITUNE_CONFIGS=str(tmp / "packaged"), TRITUNE_CONFIG_DIR=str(tmp / f"user-{i}"),
               TRITUNE_STUDIES=str(tmp / f"studies-{i}.journal"), TRITUNE_TUNE_ON_MISS="1",
               TRITUNE_TUNE_ON_MISS_BUDGET=f"{args.budget:g}", PYTHONUNBUFFERED="1")
    if args.trials:
        env["TRITUNE_TUNE_ON_MISS_TRIALS"] = str(args.trials)
    if not args.warm_cache:
        env["TRITON_CACHE_DIR"] = str(tmp / f"triton-{i}")
    return env


def run_problem(spec, problem, entry, i: int, tmp: Path, args) -> dict:
    """One problem in a fresh process; its row (an ``error`` field when it failed)."""
    import dataclasses

    from tritune.tuning.timing import problem_label

    out = tmp / f"row-{i}.json"
    committed = None if entry is None else entry["config"]
    # the fields as JSON, not the label: harness.cli.tune.parse_problems reads "act=None" as the string 'None'
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", spec.name, json.dumps(dataclasses.asdict(problem)),
           "--dtype", args.dtype, "--rounds", str(args.rounds), "--committed", json.dumps(committed),
           "--child-out", str(out)]
    print(f"== {spec.name} {problem_label(problem)} (budget {args.budget:g} s)", flush=True)
    limit = 2 * args.budget + 240   # a trial past the deadline, process start, compiles, the re-times
    try:
        rc = subprocess.run(cmd, env=child_env(tmp, i, args), timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = f"timed out after {limit:g} s"
    row = json.loads(out.read_text()) if out.is_file() else {}
    if rc != 0 and "error" not in row:
        row["error"] = f"measuring process exited: {rc}"
    base = {"kernel": spec.name, "problem": problem_label(problem), "dtype": args.dtype, "budget_s": args.budget,
            "trials_cap": args.trials, "committed_config": committed,
            "committed_study_us": None if entry is None else entry.get("time_us")}
    return {**base, **row}


def fmt(x, spec=".2f"):
    return "" if x is None else format(x, spec)


def report(rows: list[dict], interpreted: bool) -> str:
    from tabulate import tabulate

    table = [[r["kernel"], r.get("bucket", r["problem"])[:34], fmt(r.get("first_launch_s")),
              fmt(r.get("study_s"), ".1f"), r.get("trials", ""), "yes" if r.get("stored") else "NO",
              fmt(r.get("winner_us")), fmt(r.get("committed_us")), fmt(r.get("default_us")),
              fmt(r.get("winner_vs_committed"), ".3f"), fmt(r.get("winner_vs_committed_tuner"), ".3f"),
              fmt(r.get("winner_vs_default"), ".3f"),
              r["error"][:60] if "error" in r else ("ok" if r.get("correct") else "WRONG")]
             for r in rows]
    unit = "interpreter us" if interpreted else "us"
    text = tabulate(table, headers=["kernel", "bucket", "1st launch s", "study s", "trials", "stored",
                                    f"winner {unit}", f"committed {unit}", f"default {unit}", "win/comm",
                                    "win/comm (tuner)", "win/default", "launch"])
    for r in rows:
        text += (f"\n{r['kernel']} {r.get('bucket', r['problem'])}: winner {r.get('winner_config')}; committed "
                 f"{r.get('committed_config')}; default {r.get('default_config')}")
    return text


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main_parent(args) -> int:
    from tritune.kernels.runtime import device as dev

    interpreted = dev.setup_interpreter()   # before triton is imported; the children inherit it
    if interpreted and not args.small:
        print("bench_tune_on_miss: no CUDA GPU (the interpreter cannot time a study); --small runs the small "
              "problems on the interpreter", file=sys.stderr)
        return 2
    import tritune.kernels as K
    from tritune.kernels.runtime.args import parse_dtype

    try:
        dtype = parse_dtype(args.dtype)
        specs = [K.get(k) for k in args.kernels.split(",") if k]
    except (KeyError, argparse.ArgumentTypeError) as e:
        print(f"bench_tune_on_miss: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    args.dtype = str(dtype).replace("torch.", "")   # the store's key ("bf16" -> "bfloat16")
    slug = dev.gpu_slug()
    if interpreted:
        print("note: no CUDA GPU; the Triton interpreter on the small problems (every time below is the "
              "interpreter's, not a GPU's)\n", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tune-on-miss-") as tmp:
        for spec in specs:
            if dtype not in spec.dtypes or (interpreted and dtype in spec.interpreter_skip):
                print(f"{spec.name}: {args.dtype} does not run here; skipped", file=sys.stderr)
                continue
            entries, path = committed_entries(spec, slug)
            chosen = pick(spec, entries, args.dtype, args.small, args.limit or DEFAULT_LIMITS.get(spec.name, 1))
            if not chosen:
                print(f"{spec.name}: no {args.dtype} entry in {path}: no problem to measure", file=sys.stderr)
            for problem, entry in chosen:
                rows.append(run_problem(spec, problem, entry, len(rows), Path(tmp), args))
    if not rows:
        return 2
    print()
    print(report(rows, interpreted))
    summary = {"problems": len(rows), "stored": sum(bool(r.get("stored")) for r in rows),
               "geomean_winner_vs_committed": geomean([r.get("winner_vs_committed") for r in rows]),
               "geomean_winner_vs_committed_tuner": geomean([r.get("winner_vs_committed_tuner") for r in rows]),
               "interpreter": interpreted}
    print(f"\n{summary}")
    path = write_rows("tune_on_miss", rows, args.results, command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                      summary=summary)
    print(f"wrote {path}")
    bad = [r for r in rows if "error" in r or not r.get("stored") or not r.get("correct")]
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------------
# The child: one problem's first launch, its stored entry, and the re-times
# ---------------------------------------------------------------------------------------------------
def sync():
    import torch

    from tritune.kernels.runtime import device as dev

    if not dev.interpreted():
        torch.cuda.synchronize()


def first_launch(spec, problem, dtype) -> dict:
    """The first launch (it tunes the bucket) and the second, timed on the wall clock; the output checked."""
    from tritune.kernels.runtime import compare as cmp
    from tritune.kernels.runtime import device as dev

    case = spec.make_inputs(problem, dtype, dev.device(), seed=0)
    sync()
    t0 = time.perf_counter()
    got = spec.run(*case.args, out=case.out, **case.kwargs)
    sync()
    first = time.perf_counter() - t0
    got = got if isinstance(got, (tuple, list)) else (got,)
    got = [g.clone() for g in got]
    ref = spec.reference(*case.args, **case.kwargs)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    comp = cmp.compare(got[0], ref[0], dtype, spec.accumulation(dtype))
    t0 = time.perf_counter()
    spec.run(*case.args, out=case.out, **case.kwargs)
    sync()
    return {"first_launch_s": first, "second_launch_ms": 1e3 * (time.perf_counter() - t0),
            "rel_error": comp.error, "correct": bool(comp.ok)}


def user_entry(spec, bucket: str, dtype_key: str) -> dict | None:
    """This bucket's entry in the user store (TRITUNE_CONFIG_DIR), as tuning on a miss wrote it."""
    from tritune.kernels.runtime import store

    path = store.path_for(spec)
    if not path.is_file():
        return None
    es = [e for e in store.read(path, spec.name) if e["bucket"] == bucket and e["dtype"] == dtype_key]
    return es[0] if es else None


def retime(spec, problem, dtype, configs: dict, rounds: int) -> dict:
    """{name: (do_bench median us, tuner-timer us)} of each config, in interleaved rounds (medians); a config
    equal to an earlier one is timed once."""
    import statistics

    from tritune.kernels.runtime import device as dev
    from tritune.tuning import timing

    mode = timing.timing_mode(spec, problem, dtype)
    flushed = timing.rotation(spec, problem, dtype, dev.device(), 0)
    replayed = timing.timing_cases(spec, problem, dtype, dev.device(), 0, mode)

    def calls(cases, cfg):
        return timing.cycling(cases, lambda c: functools.partial(spec.run, *c.args, out=c.out, config=cfg, **c.kwargs))

    distinct = {}
    for name, cfg in configs.items():
        distinct.setdefault(json.dumps(cfg, sort_keys=True), name)
    fns = {name: (calls(flushed, configs[name]), calls(replayed, configs[name])) for name in distinct.values()}
    times = {name: ([], []) for name in fns}
    for _ in range(rounds):
        for name, (a, b) in fns.items():
            times[name][0].append(1e3 * timing.median_ms(a))
            times[name][1].append(1e3 * timing.time_ms(b, mode))
    out = {name: (statistics.median(times[name][0]), statistics.median(times[name][1])) for name in fns}
    return {name: out[distinct[json.dumps(cfg, sort_keys=True)]] for name, cfg in configs.items()} | {"mode": mode}


def measure(args) -> dict:
    import torch

    import tritune.kernels as K
    from tritune.kernels.runtime import device as dev
    from tritune.kernels.runtime import store

    spec = K.get(args.child[0])
    problem = store.problem_of_entry(spec, {"problem_fields": json.loads(args.child[1]), "bucket": None})
    if problem is None:
        raise ValueError(f"{spec.name}: no problem with the fields {args.child[1]}")
    dtype = store.torch_dtype(args.dtype)
    bucket, key = K.bucket_key(spec.bucket(problem)), K.store_dtype(dtype)
    torch.zeros(1, device=dev.device())   # the CUDA context (and the measured ceilings, once per machine)
    dev.ceilings()
    sync()
    row = {"bucket": bucket, "interpreter": dev.interpreted(), **first_launch(spec, problem, dtype)}
    launched = K.CONFIG_CACHE.get(spec.config_key(problem, dtype))
    e = user_entry(spec, bucket, key)
    row.update(stored=e is not None, launched_config=launched, default_config=spec.default_config(problem, dtype))
    if e is not None:
        row.update(winner_config=e["config"], study_s=(e.get("tuned_on_miss") or {}).get("seconds"),
                   trials=e.get("trials"), failed=e.get("failed"), study_us=e.get("time_us"),
                   study_default_us=e.get("default_us"), launched_winner=launched == e["config"])
    configs = {"winner": e["config"] if e else None, "committed": json.loads(args.committed),
               "default": row["default_config"]}
    for name, cfg in list(configs.items()):
        why = None if cfg is None else spec.space.why_invalid(cfg, problem, dtype)
        if cfg is None or why:
            configs.pop(name)
            if why:
                row[f"{name}_invalid"] = why
    times = retime(spec, problem, dtype, configs, args.rounds)
    row["tuner_timer"] = times.pop("mode")
    for name, (flush_us, tuner_us) in times.items():
        row[f"{name}_us"], row[f"{name}_tuner_us"] = flush_us, tuner_us
    for other in ("committed", "default"):
        for suffix in ("", "_tuner"):
            w, o = row.get(f"winner{suffix}_us"), row.get(f"{other}{suffix}_us")
            row[f"winner_vs_{other}{suffix}"] = w / o if w and o else None
    return row


def main_child(args) -> int:
    import traceback

    from tritune.kernels.runtime import device as dev

    dev.setup_interpreter()   # before triton is imported (the parent's choice is inherited as well)
    try:
        row = measure(args)
        rc = 0
    except Exception as e:  # the parent reports it in the row
        traceback.print_exc()
        row, rc = {"error": f"{type(e).__name__}: {e}"[:300]}, 1
    Path(args.child_out).write_text(json.dumps(row, default=str))
    return rc


if __name__ == "__main__":
    a = parse_args()
    sys.exit(main_child(a) if a.child else main_parent(a))
