"""The ``tritune`` command: info, bench, test, report, and the commands other subpackages plug in."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# Commands that live beside the code they drive. Each module defines add_arguments(parser) and
# run(args) -> int; a module that has not landed yet simply leaves its commands out.
PLUGINS = {
    "tune": "tritune.tuning.cli",
    "configs": "tritune.tuning.cli",
    "generate": "tritune.model.cli",
    "serve-bench": "tritune.model.serve",
    "serve": "tritune.model.server",
    "quantize": "tritune.model.quantize",
    "eval": "tritune.model.eval",
}

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
          "bf16": "bfloat16", "bfloat16": "bfloat16"}


def parse_dtype(s: str):
    import torch

    try:
        return getattr(torch, DTYPES[s.lower()])
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {s!r}; expected one of {sorted(DTYPES)}") from None


def cmd_info(args) -> int:
    import torch
    import triton
    from tabulate import tabulate

    from tritune import kernels
    from tritune.harness import device as dev

    rows = [["GPU", dev.gpu_name()], ["GPU slug", dev.gpu_slug()],
            ["Triton interpreter", "yes (no CUDA GPU: kernels run on the CPU, small problems only)"
             if dev.interpreted() else "no"],
            ["torch", torch.__version__], ["triton", triton.__version__],
            ["python", sys.version.split()[0]]]
    print(tabulate(rows, tablefmt="plain"))
    print()
    try:
        from tritune.tuning import store

        files = store.files_for(dev.gpu_slug())
    except ImportError:
        files = {}
    table = []
    for spec in kernels.all_specs():
        f = files.get(spec.name)
        table.append([spec.name, spec.description, str(f) if f else "none (heuristic defaults)"])
    print(tabulate(table, headers=["kernel", "what", f"tuned configs for {dev.gpu_slug()}"]))
    try:
        from tritune.model import gpt2

        print()
        print(gpt2.backend_report())
    except (ImportError, AttributeError):
        pass
    return 0


def cmd_bench(args) -> int:
    from tritune import kernels
    from tritune.harness import bench, device as dev, report

    specs = [kernels.get(n) for n in args.kernels] if args.kernels else kernels.all_specs()
    if dev.interpreted():
        print("note: no CUDA GPU; running through the Triton interpreter on small problems "
              "(times are the interpreter's, not a GPU's)\n", flush=True)
    all_rows = []
    for spec in specs:
        dtypes = args.dtype or [d for d in spec.dtypes if not (dev.interpreted() and d in spec.interpreter_skip)]
        rows = []

        problems = spec.small_problems if args.small else None
        if args.problems:
            from tritune.tuning.cli import parse_problems

            problems = parse_problems(spec, args.problems)
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


def cmd_test(args) -> int:
    import pytest

    extra = list(args.pytest_args)
    if not any(not a.startswith("-") for a in extra):
        here = Path.cwd() / "tests"
        if here.is_dir():
            extra.insert(0, str(here))
    return pytest.main(extra)


def cmd_report(args) -> int:
    from tritune.harness import report

    return report.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritune", description="Triton kernel tuning and correctness harness")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="GPU, versions, interpreter or not, tuned-config files that apply")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("bench", help="benchmark registered kernels against the vendor path and peers")
    s.add_argument("kernels", nargs="*", help="kernel names (default: all)")
    s.add_argument("--dtype", action="append", type=parse_dtype, help="repeatable; default: each supported")
    s.add_argument("--results-dir", default="results", help="where the JSON goes (default: ./results)")
    s.add_argument("--no-save", action="store_true")
    s.add_argument("--no-peers", action="store_true")
    s.add_argument("--problems", default=None,
                   help='only these problems (one kernel; as for tune: "M=1,N=2304,K=768,bias=True;..."); their rows '
                        "replace the same problems' rows in the kernel's results file, the other rows stay")
    s.add_argument("--small", action="store_true", help="the small problems the interpreter runs (a quick smoke "
                   "test on a GPU; default there: the standard problems)")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("test", help="run the test suite (arguments pass through to pytest)")
    s.add_argument("pytest_args", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_test)

    s = sub.add_parser("report", help="docs/results.md and the README's headline table from results/*/*.json")
    from tritune.harness import report

    report.add_arguments(s)
    s.set_defaults(func=cmd_report)

    for name, modname in PLUGINS.items():
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            if not modname.startswith(getattr(e, "name", None) or "\0"):
                raise  # a real import error inside a landed module
            continue
        adder = getattr(mod, "add_parser", None)
        if adder is not None:
            adder(sub, name)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["test"]:  # everything after `test` belongs to pytest, flags included
        return cmd_test(argparse.Namespace(pytest_args=argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
