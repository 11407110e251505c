"""``tritune bench``: time registered kernels against the vendor path and peers, rows into
``results/<gpu>/<kernel>.json``; ``--compare BASELINE``: the regression gate (:mod:`tritune.harness.regress`)."""
from __future__ import annotations

from pathlib import Path

from tritune.kernels.runtime.args import UsageError, int_at_least, nonnegative_number, parse_dtype, writable_dir


def add_parser(subparsers, name: str) -> None:
    s = subparsers.add_parser(name, help="benchmark registered kernels against the vendor path and peers")
    s.add_argument("kernels", nargs="*", help="kernel names (default: all)")
    s.add_argument("--dtype", action="append", type=parse_dtype, help="repeatable; default: each supported")
    s.add_argument("--results-dir", default="results", type=writable_dir,
                   help="where the JSON goes (default: ./results)")
    s.add_argument("--no-save", action="store_true")
    s.add_argument("--no-peers", action="store_true")
    s.add_argument("--problems", default=None,
                   help='only these problems (one kernel; as for tune: "M=1,N=2304,K=768,bias=True;..."); their rows '
                        "replace the same problems' rows in the kernel's results file, the other rows stay")
    s.add_argument("--small", action="store_true", help="the small problems the interpreter runs (a quick smoke "
                   "test on a GPU; default there: the standard problems)")
    s.add_argument("--compare", default=None, metavar="BASELINE",
                   help="regression gate: re-time the configs of BASELINE's rows (a results file or folder, or a "
                        "git revision's results) against today's, interleaved; exit 1 when a row is slower "
                        "beyond its measured noise")
    s.add_argument("--rounds", type=int_at_least(2), default=5, help="--compare: interleaved rounds (default 5)")
    s.add_argument("--min-slowdown", type=nonnegative_number, default=0.03,
                   help="--compare: the smallest slowdown that counts (default 0.03: 3%%)")
    s.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from tritune.harness.cli import resolve_kernels

    if args.compare:
        return cmd_compare(args, resolve_kernels(args.kernels))
    from tritune.harness import bench, report
    from tritune.kernels.runtime import device as dev

    specs = resolve_kernels(args.kernels)
    if args.problems and len(specs) != 1:
        raise UsageError("--problems needs exactly one kernel (problems are in that kernel's fields)")
    if dev.interpreted():
        print("note: no CUDA GPU; running through the Triton interpreter on small problems "
              "(times are the interpreter's, not a GPU's)\n", flush=True)
    all_rows = []
    for spec in specs:
        dtypes = args.dtype or [d for d in spec.dtypes if not (dev.interpreted() and d in spec.interpreter_skip)]
        rows = []

        problems = spec.small_problems if args.small else None
        if args.problems:
            from tritune.harness.cli.tune import parse_problems

            try:
                problems = parse_problems(spec, args.problems)
            except ValueError as e:
                raise UsageError(str(e)) from None
        merge = bool(args.problems)  # a subset re-measured: its rows replace theirs, the others stay

        def save(row, rows=rows, spec=spec):  # after every problem: a later crash or timeout loses nothing
            rows.append(row)
            if not args.no_save:
                bench.write_results(rows, Path(args.results_dir), spec.name, merge=merge)

        for dt in dtypes:
            if dt not in spec.dtypes:
                print(f"{spec.name}: skipping dtype {dt} (supported: {spec.dtypes})")
                continue
            bench.bench_spec(spec, dt, problems=problems, peers=not args.no_peers, on_row=save)
        print(report.bench_table(rows), flush=True)
        print()
        all_rows += rows
        if rows and not args.no_save:
            path = bench.write_results(rows, Path(args.results_dir), spec.name, merge=merge)
            print(f"wrote {path}\n")
    bad = [r for r in all_rows if "error" in r or not r.get("correct", True)]
    return 1 if bad else 0


def cmd_compare(args, specs) -> int:
    """The regression gate: exit 1 when a baseline row's problem now runs slower beyond its noise."""
    import torch

    from tritune.harness import regress
    from tritune.harness.cli.tune import parse_problems
    from tritune.kernels.runtime import device as dev
    from tritune.kernels.runtime.store import torch_dtype

    if dev.interpreted() or not torch.cuda.is_available():
        raise UsageError("--compare times kernels: it needs a CUDA GPU")
    try:
        base = regress.load_baseline(args.compare, dev.gpu_slug(), [s.name for s in specs])
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    verdicts = []
    for spec in specs:
        for row in base[spec.name]:
            dtype = torch_dtype(row["dtype"])
            if args.dtype and dtype not in args.dtype:
                continue
            try:
                (problem,) = parse_problems(spec, row["problem"])
            except ValueError:
                continue   # a problem this version of the kernel no longer has
            verdicts.append(regress.compare_row(spec, row, problem, dtype, rounds=args.rounds,
                                                min_slowdown=args.min_slowdown))
            print(regress.table(verdicts[-1:]).splitlines()[-1], flush=True)
    if not verdicts:
        raise UsageError(f"--compare: no baseline rows for {', '.join(s.name for s in specs)} on {dev.gpu_slug()}")
    slower = [v for v in verdicts if v.slower]
    print()
    print(regress.table(slower) if slower else "no row is slower than its baseline beyond the noise")
    print(f"\n{len(verdicts)} rows compared, {len(slower)} slower")
    return 1 if slower else 0
