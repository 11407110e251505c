"""``tritune tune`` and ``tritune configs`` (plugged into the main CLI by harness/cli.py).

    tritune tune layer_norm --dtype bf16 --trials 40                  # TPE over the standard problems
    tritune tune gelu --problems "numel=6291456;numel=6291456,approximate=tanh" --sampler grid
    tritune tune all --trials 0 --export                              # write the user store from the studies
    tritune tune all --budget 30m --export                            # a new GPU type in one command, every GPU
    tritune tune all --budget 30m --stop-after 8m --export            # the same in calls of 8 min (rerun resumes)
    tritune tune all --budget 30m --dry-run --as-gpu nvidia-h200      # its studies, budget split and wall estimate
    tritune tune layer_norm --compare-samplers --dtype bf16           # search-efficiency experiment
    tritune configs                                                   # what is stored for this GPU

``--problems``: problems separated by ``;``, each ``field=value`` pairs separated by ``,`` (or spaces),
named after the kernel's Problem dataclass; omitted fields take their defaults, values are converted to
the field's type (int, float, bool, str).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from tritune.tuning.ledger import fmt  # one number format for every table
from tritune.kernels.runtime.args import (int_at_least, nonnegative_number, parse_dtype, parse_duration,
                                           positive_number)


def _problem_class(spec):
    for p in list(spec.standard_problems) + list(spec.small_problems):
        if dataclasses.is_dataclass(p):
            return type(p), p
    raise ValueError(f"{spec.name}: no example Problem to learn the fields from")


def _convert(text: str, like, ftype: str):
    if isinstance(like, bool) or ftype == "bool":
        low = text.strip().lower()
        if low in ("1", "true", "yes", "y", "on"):
            return True
        if low in ("0", "false", "no", "n", "off"):
            return False
        raise ValueError(f"expected a boolean, got {text!r}")
    if isinstance(like, int) or ftype == "int":
        return math.prod(_int(t) for t in text.split("*"))  # numel=8192*768 reads as the product
    if isinstance(like, float) or ftype == "float":
        return float(text)
    return text


def _int(t: str) -> int:
    try:
        return int(t)
    except ValueError:
        return int(t, 0)


def parse_problems(spec, text: str) -> list:
    """``"M=8192,N=768;M=64,N=768"`` -> [Problem(8192, 768), Problem(64, 768)] for the spec's Problem."""
    cls, example = _problem_class(spec)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for chunk in text.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        kw = {}
        for part in chunk.replace(",", " ").split():
            k, sep, v = part.partition("=")
            if not sep:
                raise ValueError(f"--problems: {part!r} is not field=value (fields of {spec.name}: "
                                 f"{', '.join(fields)})")
            if k not in fields:
                raise ValueError(f"--problems: {spec.name} problems have no field {k!r} (fields: {', '.join(fields)})")
            f = fields[k]
            if v == "None" and "None" in str(f.type):   # an optional field left out (as bench labels write it)
                kw[k] = None
                continue
            try:
                kw[k] = _convert(v, getattr(example, k), str(f.type))
            except ValueError as e:
                raise ValueError(f"--problems: {k}={v!r}: {e}") from None
        try:
            out.append(cls(**kw))
        except TypeError as e:
            raise ValueError(f"--problems: {chunk!r}: {e}") from None
    if not out:
        raise ValueError("--problems: no problem given")
    return out


def _cfg(c) -> str:
    return "" if not c else " ".join(f"{k}={v}" for k, v in c.items())


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def failures_label(kinds: dict | None) -> str:
    """Failed trials by kind, the most frequent first: 'compile error x3, wrong answer x1'."""
    return ", ".join(f"{k} x{n}" for k, n in sorted((kinds or {}).items(), key=lambda kv: (-kv[1], kv[0])))


def failures_summary(rows: list[dict]) -> str:
    """One line: every study's failed trials by kind (compile error, wrong answer: a mismatch against the
    reference, out of resources, timeout, ...), or nothing when none failed."""
    import collections

    total = collections.Counter()
    for r in rows:
        total.update(r.get("failure_kinds") or {})
    return f"failed trials by kind: {failures_label(dict(total))}" if total else ""


def results_table(rows: list[dict]) -> str:
    from tabulate import tabulate

    table = []
    for r in rows:
        note = ""
        if r.get("default_error"):
            note = "default: " + str(r["default_error"])[:60]
        elif r.get("trials") and r.get("best_us") is None:
            note = "no verified config"
        table.append([r.get("kernel"), r.get("bucket"), r.get("dtype"), fmt(r.get("default_us")),
                      fmt(r.get("best_us")), (fmt(r.get("speedup"), 2) + "x") if r.get("speedup") else "",
                      r.get("trials", 0), r.get("failed", 0), failures_label(r.get("failure_kinds")),
                      _cfg(r.get("config")), note])
    text = tabulate(table, headers=["kernel", "bucket", "dtype", "default µs", "tuned µs", "speedup", "trials",
                                    "failed", "why failed", "config", ""], disable_numparse=True)
    kernels = sorted({r.get("kernel") for r in rows if r.get("speedup")})
    lines = [text]
    for k in kernels:
        g = _geomean([r["speedup"] for r in rows if r.get("kernel") == k])
        lines.append(f"{k}: geomean speedup of tuned over default {g:.3f}x over "
                     f"{sum(1 for r in rows if r.get('kernel') == k and r.get('speedup'))} buckets")
    if failures_summary(rows):
        lines.append(failures_summary(rows))
    return "\n".join(lines)


def where_winners_are(storage, slug: str, configs_dir: str | None = None) -> str:
    """Without --export: the winners are in the storage's studies, not yet in the store the kernels read."""
    from tritune.kernels.runtime import store

    root = Path(configs_dir) if configs_dir else store.user_root()
    return (f"the winners are in the studies of {storage} (not yet used by the kernels): re-run with --export "
            f"(e.g. --trials 0 --export) to write them to the store, {root / slug}")


class UsageError(Exception):
    """A user error: the CLI prints its message on one line and exits 2."""


def _fail(msg: str) -> int:
    print(f"tune: {msg}", file=sys.stderr)
    return 2


def _read_seed_configs(path: str, specs) -> list[dict]:
    from tritune.tuning import search

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--seed-configs {path}: cannot read it: {e.strerror or e}") from None
    try:
        seeds = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--seed-configs {path}: not JSON: {e}") from None
    try:
        search.check_seed_configs(specs, seeds)
    except ValueError as e:
        raise UsageError(f"--seed-configs {path}: {e}") from None
    return seeds


def cmd_tune(args) -> int:
    try:
        return _tune(args)
    except UsageError as e:
        return _fail(str(e))


def _check_budget_args(args) -> tuple[float | None, float | None]:
    """(--budget, --stop-after) in seconds, after the checks of the options that go with them."""
    if args.trials is not None and args.trials < 0:
        raise UsageError(f"--trials {args.trials}: expected a whole number >= 0")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: expected at least 1")
    budget = None
    if args.budget is not None:
        try:
            budget = parse_duration(args.budget)
        except ValueError as e:
            raise UsageError(f"--budget: {e}") from None
        if args.compare_samplers:
            raise UsageError("--budget runs no sampler comparison: give one of --budget, --compare-samplers")
        if args.patience < 1:
            raise UsageError(f"--patience {args.patience}: expected a whole number >= 1")
        if args.precompile is not None and args.precompile < 0:
            raise UsageError(f"--precompile {args.precompile}: expected a number of helper processes >= 0")
        if not 0.0 <= args.min_gain < 1.0:
            raise UsageError(f"--min-gain {args.min_gain}: expected a fraction in [0, 1), e.g. 0.02")
    for opt in ("dry_run", "stop_after", "as_gpu", "no_fill", "host"):
        if getattr(args, opt, None) and budget is None:
            raise UsageError(f"--{opt.replace('_', '-')} goes with --budget")
    stop_after = None
    if getattr(args, "stop_after", None):
        try:
            stop_after = parse_duration(args.stop_after)
        except ValueError as e:
            raise UsageError(f"--stop-after: {e}") from None
    if getattr(args, "as_gpu", None) and not args.dry_run:
        raise UsageError("--as-gpu plans for another GPU type: it goes with --dry-run")
    return budget, stop_after


def _specs_and_problems(args) -> tuple[list, list | None]:
    from tritune.tuning import search

    try:
        specs = search.resolve_specs(args.kernels)
    except KeyError as e:
        raise UsageError(e.args[0] if e.args else str(e)) from None
    problems = None
    if args.problems:
        if len(specs) != 1:
            raise UsageError("--problems needs exactly one kernel (problems are in that kernel's fields)")
        try:
            problems = parse_problems(specs[0], args.problems)
        except ValueError as e:
            raise UsageError(str(e)) from None
    return specs, problems


def _tune(args) -> int:
    import time

    from tritune.kernels.runtime import device as dev
    from tritune.tuning import search

    budget, stop_after = _check_budget_args(args)
    specs, problems = _specs_and_problems(args)
    seeds = _read_seed_configs(args.seed_configs, specs) if args.seed_configs else None
    storage = args.storage or search.default_storage()
    if budget is not None and args.dry_run:  # reads the storage (if it exists), writes nothing
        from tritune.tuning import estimate

        print(estimate.dry_run(specs, budget, storage=storage, dtypes=args.dtype, problems=problems,
                               warm_from=args.warm_from, as_gpu=args.as_gpu, trials=args.trials,
                               patience=args.patience, rounds=args.retime_rounds))
        return 0
    if budget is not None and seeds:
        raise UsageError("--seed-configs and --budget: give one (--budget seeds the nearest GPU's winners)")
    try:
        search.open_storage(storage)
    except search.StorageError as e:
        raise UsageError(f"--storage: {e}") from None
    trials = args.trials if args.trials is not None else (None if budget else 40)
    slug = dev.gpu_slug()
    if dev.interpreted():
        print("note: no CUDA GPU; tuning through the Triton interpreter on small problems "
              "(times are the interpreter's, not a GPU's)", file=sys.stderr)
    print(f"tune: storage {storage}, GPU slug {slug}, sampler "
          f"{'grid + replayed tpe/random' if args.compare_samplers else args.sampler}", file=sys.stderr)
    common = dict(storage=storage, seed=args.seed, isolation=args.isolation, timeout=args.trial_timeout,
                  progress=not args.quiet)
    timer = getattr(args, "timer", "auto")
    if timer != "auto":  # the default evaluator picks the mode per problem (tuning.timing.timing_mode)
        common["evaluate"] = search.Evaluator(mode="flush" if timer == "do_bench" else timer)
    t0 = time.time()
    try:
        if args.compare_samplers:
            return _compare(args, specs, problems, common)
        if budget is not None:
            rows, workers_failed = _tune_budget(args, specs, problems, budget, stop_after, trials, slug, common, t0)
        else:
            workers_failed = False
            rows = search.tune(specs, problems, args.dtype, trials=trials, sampler=args.sampler,
                               workers=args.workers or 1, time_budget=args.time_budget, seed_configs=seeds, **common)
            print(results_table(rows))
    except KeyboardInterrupt:
        print(f"\ntune: interrupted; finished trials are kept in {storage}: run the same command to resume",
              file=sys.stderr)
        rows = search.tune(specs, problems, args.dtype, trials=0, storage=storage, progress=False)
        print(results_table(rows))
        return 130
    if args.export:
        print()
        search.export(storage, [s.name for s in specs], slug=slug, root=args.configs_dir)
    elif any(r.get("config") is not None for r in rows):
        print(where_winners_are(storage, slug, args.configs_dir))
    missing = [r for r in rows if (trials is None or trials > 0) and r.get("trials") and r.get("best_us") is None]
    return 1 if missing or workers_failed else 0


def _compare(args, specs, problems, common) -> int:
    from tritune.tuning import compare

    rows, path = compare.compare_samplers(specs, problems, args.dtype, repeats=args.repeats, workers=args.workers or 1,
                                          time_budget=args.time_budget, threshold=args.threshold,
                                          results_dir=args.results_dir, **common)
    print(efficiency_table(rows))
    if path:
        print(f"\nwrote {path}")
    return 0


def host_share_arg(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    i, sep, n = text.partition("/")
    try:
        pair = (int(i), int(n))
    except ValueError:
        pair = None
    if not sep or pair is None or not 0 <= pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N (e.g. 0/2), got {text!r}")
    return pair


def _tune_budget(args, specs, problems, budget: float, stop_after, trials, slug: str, common: dict,
                 t0: float) -> tuple[list[dict], bool]:
    """The budgeted run: in this process on one GPU (or none), else one worker per visible GPU (or
    ``--workers``), each on its share of the studies with the whole budget. Returns (rows, whether a
    worker failed)."""
    import time

    from tritune.tuning import budget as tb, ledger, search, spread

    n = args.workers if args.workers is not None else max(1, len(search.visible_gpus()))
    kw = dict(trials=trials, dtypes=args.dtype, problems=problems, warm_from=args.warm_from,
              rounds=args.retime_rounds, patience=args.patience, min_gain=args.min_gain, stop_after=stop_after,
              fill=not getattr(args, "no_fill", False), precompile_helpers=args.precompile, **common)
    failed = False
    host = getattr(args, "host", None)
    if n <= 1:
        only = None
        if host is not None:
            from tritune.tuning.study import plan

            only = frozenset(j.name for j in spread.host_share(plan(specs, problems, args.dtype, slug, lambda m: None),
                                                               host, args.patience))
        rows, _ = tb.tune_budget(specs, budget, slug=slug, only=only, **kw)
    else:   # the workers' slug is their GPU's, checked against this one's
        rows, _, workers = spread.tune_budget_spread(specs, budget, workers=n, host=host, **kw)
        failed = any(w["exitcode"] for w in workers)
        n = len(workers)   # at most one per study
        if n > 1:
            print(f"tune: {n} workers, each with the {budget / 60:.1f} min budget: {n * budget / 60:.1f} "
                  "worker-minutes in all, the time spent below summed over them", file=sys.stderr)
    budget *= max(1, n)   # the studies' time spent sums over the workers that ran side by side
    print(ledger.summary_table(rows, budget, time.time() - t0))
    if failures_summary(rows):
        print(failures_summary(rows))
    if any((r.get("ledger") or {}).get("stop") not in ledger.DONE for r in rows) and ledger.spent_s(rows) < budget:
        print("budget left and studies unfinished: run the same command again to resume")
    if "all" in args.kernels:   # the model's fused decode step is stored beside the kernels but is no bucket
        print("the fused decode step (a model's launch, not a kernel bucket) is tuned apart: "
              "tritune tune-decode --shape gpt2-small --batches 1,8 --export")
    return rows, failed


def efficiency_table(rows: list[dict]) -> str:
    from tabulate import tabulate

    table = []
    for r in rows:
        if "incomplete" in r:
            table.append([r["kernel"], r["bucket"], r["dtype"], r["n_valid"], "", "", "", "", r["incomplete"]])
            continue
        t, rd = r["tpe"], r["random"]
        table.append([r["kernel"], r["bucket"], r["dtype"], r["n_valid"], fmt(r["grid_best_us"]),
                      f"{fmt(t['median'], 1)} ({fmt(t['median_fraction_of_grid'] * 100 if t['median'] else None, 0)}%)",
                      f"{fmt(rd['median'], 1)} ({fmt(rd['median_fraction_of_grid'] * 100 if rd['median'] else None, 0)}%)",
                      f"{fmt(t['max'])} / {fmt(rd['max'])}",
                      "TPE <= 25% of grid" if r["tpe_within_25pct_of_grid"] else ""])
    return tabulate(table, headers=["kernel", "bucket", "dtype", "grid trials (valid points)", "grid best µs",
                                    "TPE trials to 3% (median)", "random trials to 3% (median)", "worst TPE / random",
                                    ""], disable_numparse=True)


def cmd_configs(args) -> int:
    import os

    from tabulate import tabulate

    from tritune import kernels
    from tritune.kernels.runtime import device as dev
    from tritune.kernels.runtime import store

    if args.configs_dir:  # the user store to show (and layer over the packaged one)
        os.environ["TRITUNE_CONFIG_DIR"] = args.configs_dir
        store.clear_cache()
    slug = args.slug or dev.gpu_slug()
    files = store.files_for(slug)
    if args.kernels:
        files = {k: v for k, v in files.items() if k in args.kernels}
    roots = ", ".join(f"{name} {root / slug}" for name, root in store.layers())
    if not files:
        print(f"no tuned configs for {slug} (looked in: {roots})")
        return 0
    table = []
    n_bad = 0
    for kernel in files:
        try:
            spec = kernels.get(kernel)
        except KeyError:
            spec = None
        rows = store.layered(kernel, slug)
        old = {id(e) for e in store.stale(spec or kernel, [e for e, *_ in rows])}
        for e, layer, path, overridden in rows:
            t, d = e.get("time_us"), e.get("default_us")
            if spec is not None:
                why = store.why_invalid(spec, e)
            else:
                check = store.config_check(kernel)
                why = "no registered kernel of this name" if check is None else check(e["config"])
            if why:
                status = f"INVALID: {why} (never used: the heuristic default runs)"
                n_bad += 1
            elif overridden:
                status = "overridden by the user store"
            elif id(e) in old:
                status = "stale: kernel changed since (skipped)"
            else:
                status = "active"
            table.append([kernel, e["bucket"], e["dtype"], _cfg(e["config"]), fmt(t), fmt(d),
                          f"{d / t:.2f}x" if isinstance(t, (int, float)) and isinstance(d, (int, float)) and t else "",
                          fmt(e.get("trials")), layer, status])
    print(f"tuned configs for {slug} ({roots}):")
    print(tabulate(table, headers=["kernel", "bucket", "dtype", "config", "µs", "default µs", "speedup", "trials",
                                   "store", "status"], disable_numparse=True))
    if n_bad:
        print(f"\n{n_bad} invalid entries: fix or delete them in the files above, or re-tune")
    return 0


def _add_budget_options(s) -> None:
    """The options that go with --budget."""
    from tritune.tuning import retime, turn

    s.add_argument("--warm-from", default=None, metavar="SLUG",
                   help="with --budget: the GPU type whose stored winners seed the studies (default: the "
                        "nearest stored one, e.g. an H200 from the H100)")
    s.add_argument("--retime-rounds", type=int_at_least(1), default=retime.RETIME_ROUNDS, metavar="N",
                   help=f"with --budget: interleaved rounds of the side-by-side re-timing (default {retime.RETIME_ROUNDS})")
    s.add_argument("--patience", type=int_at_least(1), default=turn.PATIENCE, metavar="K",
                   help="with --budget: a study has converged after K trials (after its seeds: its best's "
                        f"one-step neighbours, then its sampler's) without a gain (default {turn.PATIENCE})")
    s.add_argument("--min-gain", type=nonnegative_number, default=turn.MIN_GAIN, metavar="F",
                   help="with --budget: a gain beats the study's best by more than this fraction, the timing "
                        f"noise (default {turn.MIN_GAIN})")
    s.add_argument("--no-fill", action="store_true",
                   help="with --budget: stop once every study converged (default: time left goes to the "
                        "converged studies again, with doubled patience per pass, the most promising first, "
                        "each searched around its best (one-step neighbours) and from its nearest buckets' "
                        "winners, until the budget is spent)")
    s.add_argument("--precompile", type=int, default=None, metavar="N",
                   help="with --budget: N helper processes compile the configs the sweep tries next (its "
                        "seeds, its best's neighbours) while it times others; 0: none (default: "
                        "$TRITUNE_PRECOMPILE, else the CPU cores less two, at most 8 and one per 10 GiB of GPU "
                        "memory; none on the interpreter)")
    s.add_argument("--stop-after", default=None, metavar="DURATION",
                   help="with --budget: this call stops after DURATION (e.g. 8m); the time spent is in the "
                        "storage and the same command resumes with what is left of the budget")
    s.add_argument("--dry-run", action="store_true",
                   help="with --budget: list the studies, their seeds and what the storage holds, the budget "
                        "split and the estimated wall time; runs nothing")
    s.add_argument("--as-gpu", default=None, metavar="SLUG",
                   help="with --dry-run: plan for that GPU type (its standard problems), e.g. nvidia-h200")


def add_parser(subparsers, name: str) -> None:
    from tritune.tuning import search

    if name == "tune":
        s = subparsers.add_parser("tune", help="search launch configs with Optuna (resumable, multi-GPU); --export "
                                              "writes the store")
        s.add_argument("kernels", nargs="+", metavar="KERNEL", help="kernel name(s), or 'all'")
        s.add_argument("--problems", help='e.g. "M=8192,N=768;M=64,N=768" (default: the kernel\'s standard '
                                          "problems on a GPU, its small problems on the interpreter)")
        s.add_argument("--dtype", action="append", type=parse_dtype, help="repeatable; default: each supported")
        s.add_argument("--trials", type=int, default=None,
                       help="evaluated trials per study, counting those already in the storage (default 40; with "
                            "--budget: as many as the budget allows); constraint-pruned and duplicate proposals "
                            "are free")
        s.add_argument("--budget", default=None, metavar="DURATION",
                       help="tune within this wall time (e.g. 30m, 1h, 90s): every study gets its share, warm-"
                            "started from the nearest stored GPU type's winners; the front runners are re-timed "
                            "side by side before --export; a summary table at the end")
        _add_budget_options(s)
        s.add_argument("--sampler", choices=search.SAMPLERS, default="tpe")
        s.add_argument("--storage", default=None,
                       help=search.STORAGE_HELP + "; default $TRITUNE_STUDIES or ~/.cache/tritune/tuning-studies.journal. "
                            "Several processes or machines on one storage share its studies")
        s.add_argument("--workers", type=int, default=None,
                       help="worker processes, one per visible GPU (default 1; with --budget: every visible GPU, "
                            "each worker on its share of the studies with the whole budget)")
        s.add_argument("--host", type=host_share_arg, default=None, metavar="I/N",
                       help="with --budget and a shared --storage: this host is host I of N (0-based); the hosts "
                            "tune disjoint shares of the studies, each over its own GPUs")
        s.add_argument("--time-budget", type=positive_number, default=None, metavar="S",
                       help="stop starting trials after S seconds (shared evenly among the studies)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--seed-configs", metavar="FILE", default=None,
                       help="a JSON list of (partial) configs every study evaluates first, e.g. a probe's "
                            "front runners (completed from the default; invalid ones skipped)")
        s.add_argument("--timer", choices=("auto", "do_bench", "graph"), default="auto",
                       help="what a trial's time is: auto (default): the GPU time of the launch replayed in a CUDA "
                            "graph on inputs cycled past L2 for problems whose roofline floor is under "
                            "50 µs (no host time in it), do_bench's median with L2 flushed for longer ones; "
                            "do_bench or graph: that one for every problem. The re-time before export uses "
                            "the same. Keep one timer per storage: a study mixes no timers")
        s.add_argument("--export", action="store_true", help="write the store from the studies afterwards "
                                                             "(with --trials 0: export only)")
        s.add_argument("--configs-dir", default=None,
                       help="export under DIR/<slug>/ instead of the user store ($TRITUNE_CONFIG_DIR or "
                            "~/.cache/tritune/configs)")
        s.add_argument("--isolation", choices=("auto", "process", "inline"), default="auto",
                       help="evaluate in a restartable worker process (auto, the default: a config that crashes "
                            "is one failed trial) or in this process")
        s.add_argument("--trial-timeout", type=positive_number, default=search.TASK_TIMEOUT, metavar="S",
                       help=f"kill the worker after S seconds on one trial (default {search.TASK_TIMEOUT:.0f})")
        s.add_argument("--compare-samplers", action="store_true",
                       help="complete the grid, then replay TPE and random on its measurements: trials to reach "
                            "within --threshold of the grid's best")
        s.add_argument("--repeats", type=int_at_least(1), default=10, help="seeds per sampler for --compare-samplers")
        s.add_argument("--threshold", type=nonnegative_number, default=0.03)
        s.add_argument("--results-dir", default="results", help="--compare-samplers writes "
                                                                "<dir>/<slug>/tuning_efficiency.json")
        s.add_argument("--quiet", action="store_true", help="no progress bars (none either when stderr is not a "
                                                                "terminal)")
        s.set_defaults(func=cmd_tune)
    elif name == "configs":
        s = subparsers.add_parser("configs", help="list the tuned configs stored for this GPU")
        s.add_argument("kernels", nargs="*", help="kernel names (default: all stored)")
        s.add_argument("--slug", default=None, help="another GPU type's slug")
        s.add_argument("--configs-dir", default=None, help="the user store to show over the packaged one "
                                                           "(default $TRITUNE_CONFIG_DIR or ~/.cache/tritune/configs)")
        s.set_defaults(func=cmd_configs)
    else:
        raise ValueError(f"tritune.harness.cli.tune provides 'tune' and 'configs', not {name!r}")


def main(argv=None) -> int:  # for `python -m tritune.harness.cli.tune tune ...`
    p = argparse.ArgumentParser(prog="tritune")
    sub = p.add_subparsers(dest="command", required=True)
    add_parser(sub, "tune")
    add_parser(sub, "configs")
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
