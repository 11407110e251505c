"""The ``tritune`` command: info, bench, test, report, plot, and the commands other subpackages plug in.

Global option (before or after the command, except after ``test``, whose arguments are pytest's):
``--plugin MODULE`` (repeatable) loads a module that registers kernels (also: ``TRITUNE_PLUGINS``, and the
entry-point group ``tritune.kernels`` of installed packages); every command then sees its kernels, and so
do the processes a command spawns.

User errors (an unknown kernel, dtype or plugin, a path that cannot be used) print one line on stderr and
exit with status 2; no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from tritune.kernels.runtime.args import UsageError

# Commands that live beside the code they drive: each module defines add_parser(subparsers, name), which
# adds the command and sets its func(args) -> int.
COMMANDS = {
    "tune": "tritune.harness.cli.tune",
    "configs": "tritune.harness.cli.tune",
    "generate": "tritune.harness.cli.generate",
    "serve-bench": "tritune.model.bench.serve_bench",
    "serve": "tritune.model.serve.server",
    "eval": "tritune.model.eval",
    "quantize": "tritune.model.quant.cli",
    "tune-decode": "tritune.model.engine.fused_tune",
    "profile": "tritune.harness.cli.profile",
    "bench": "tritune.harness.cli.bench",
}


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (the usage stays under --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def resolve_kernels(names) -> list:
    """Specs for kernel names ('all' or none: every registered kernel); an unknown name is a UsageError
    listing the registered ones."""
    from tritune import kernels

    if not names or list(names) == ["all"]:
        return kernels.all_specs()
    out = []
    for n in names:
        try:
            out.append(kernels.get(n))
        except KeyError as e:
            raise UsageError(e.args[0]) from None
    return out


def cmd_info(args) -> int:
    import torch
    import triton
    from tabulate import tabulate

    from tritune import kernels
    from tritune.kernels.runtime import device as dev
    from tritune.model.gpt2 import model as gpt2
    from tritune.kernels.runtime import store

    rows = [["GPU", dev.gpu_name()], ["GPU slug", dev.gpu_slug()],
            ["Triton interpreter", "yes (no CUDA GPU: kernels run on the CPU, small problems only)"
             if dev.interpreted() else "no"],
            ["torch", torch.__version__], ["triton", triton.__version__],
            ["python", sys.version.split()[0]]]
    print(tabulate(rows, tablefmt="plain"))
    print()
    files = store.files_for(dev.gpu_slug())
    table = []
    for spec in kernels.all_specs():
        f = files.get(spec.name)
        where = getattr(spec.run, "__module__", "") or ""
        origin = "" if where.startswith("tritune.") else f" [{where}]"  # a plugin's kernel says where from
        table.append([spec.name + origin, spec.description, str(f) if f else "none (heuristic defaults)"])
    print(tabulate(table, headers=["kernel", "what", f"tuned configs for {dev.gpu_slug()}"]))
    for path, why in store.broken_files(dev.gpu_slug()):   # skipped by every lookup: say so here too
        print(f"warning: tuned-config file {path} is ignored (heuristic defaults instead): {why}", file=sys.stderr)
    print()
    print(gpt2.backend_report())
    return 0


def cmd_test(args) -> int:
    """pytest with the arguments given. With no path: ./tests in a checkout of tritune, else the shipped
    contract suite of every registered kernel (a pip install: built-in and plugin kernels; ``-m NAME``
    picks one)."""
    import pytest

    from tritune.testing import pytest_plugin

    extra = list(args.pytest_args)
    if "-h" in extra or "--help" in extra:
        print(pytest_plugin.TEST_HELP)   # tritune's own options first; pytest's long help follows
    if not _has_path(extra):
        here = Path.cwd() / "tests"
        if (here / "test_kernels.py").is_file() and (Path.cwd() / "kernels" / "__init__.py").is_file():
            extra.insert(0, str(here))  # a checkout of tritune: its own suite
        else:
            # the shipped suite; rootdir here, so nothing (.pytest_cache) is written into site-packages
            extra[:0] = [str(pytest_plugin.suite_path()), "--rootdir", str(Path.cwd()),
                         "--import-mode=importlib", "-p", "no:cacheprovider"]
    return pytest.main(_not_slow(extra))


def _not_slow(args: list[str]) -> list[str]:
    """Slow tests stay out unless asked for: ``-m gemm`` runs as ``-m "(gemm) and not slow"``; a marker
    expression that names ``slow`` is left as it is."""
    out, i, marked = [], 0, False
    while i < len(args):
        a = args[i]
        if a == "-m" and i + 1 < len(args):
            expr = args[i + 1]
            out += ["-m", expr if "slow" in expr else f"({expr}) and not slow"]
            marked = True
            i += 2
            continue
        out.append(a)
        i += 1
    return out if marked else out + ["-m", "not slow"]


def _has_path(args: list[str]) -> bool:
    """Whether pytest arguments name something to collect (a word that is neither an option nor an option's
    value; the options that take a value are the common ones)."""
    takes_value = {"-m", "-k", "-p", "-n", "-c", "-o", "-W", "--maxfail", "--rootdir", "--durations",
                   "--tritune-kernel", "--dist", "--tb", "--junitxml", "--basetemp", "--confcutdir",
                   "--deselect", "--ignore", "--import-mode", "--log-level", "-r"}
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in takes_value:
            skip = True
            continue
        if a.startswith("-"):
            continue
        return True
    return False


def cmd_report(args) -> int:
    from tritune.harness import report

    if not Path(args.results_dir).is_dir():
        raise UsageError(f"--results-dir {args.results_dir!r}: no such folder")
    return report.run(args)


def cmd_plot(args) -> int:
    from tritune.harness import plot

    return plot.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tritune", description="Triton kernel tuning and correctness harness")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import MODULE (a module name or a .py path) that registers kernels; repeatable "
                        "(also: TRITUNE_PLUGINS=a,b and the entry-point group tritune.kernels)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="GPU, versions, interpreter or not, tuned-config files that apply")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("test", help="run the tests (arguments pass through to pytest; no path: ./tests in a "
                                    "checkout, else the contract tests of every registered kernel, -m NAME for one)")
    s.add_argument("pytest_args", nargs=argparse.REMAINDER)
    s.set_defaults(func=cmd_test)

    s = sub.add_parser("report", help="docs/results.md and the README's headline table from results/*/*.json")
    from tritune.harness import report

    report.add_arguments(s)
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("plot", help="PNG pictures: a roofline per GPU from results/, the Nsight Compute counters "
                                    "of each command `profile --ncu` recorded, a tuning study's history "
                                    "(needs the plot extra: matplotlib)")
    from tritune.harness import plot

    plot.add_arguments(s)
    s.set_defaults(func=cmd_plot)

    for name, modname in COMMANDS.items():
        importlib.import_module(modname).add_parser(sub, name)
    return p


def _split_plugins(argv: list[str]) -> tuple[list[str], list[str]]:
    """``--plugin X`` / ``--plugin=X`` taken out of argv, anywhere up to a ``test`` command (every argument
    after ``test`` is pytest's)."""
    plugins, rest, i, command = [], [], 0, None
    while i < len(argv):
        a = argv[i]
        if command is None and not a.startswith("-"):
            command = a
            if a == "test":
                rest += argv[i:]
                break
        if a == "--plugin":
            if i + 1 >= len(argv):
                raise UsageError("--plugin: expected a module name or a .py path")
            plugins.append(argv[i + 1])
            i += 2
            continue
        if a.startswith("--plugin="):
            plugins.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    return plugins, rest


def main(argv=None) -> int:
    from tritune.kernels.runtime import device as dev, plugins

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        names, argv = _split_plugins(argv)
        if names:
            plugins.add(names)  # exported in TRITUNE_PLUGINS: spawned tuning workers load them too
        if argv[:1] == ["test"]:  # everything after `test` belongs to pytest, flags included
            return cmd_test(argparse.Namespace(pytest_args=argv[1:]))
        args = build_parser().parse_args(argv)
        if getattr(args, "kernels", None) and args.command in ("bench", "tune", "configs"):
            from tritune.kernels.runtime.store import CONFIG_KINDS

            # an unknown name: one line now, not a traceback later (`configs` also shows the stored
            # configs of launches that are no kernel: the fused decode step)
            names = [k for k in args.kernels if not (args.command == "configs" and k in CONFIG_KINDS)]
            if names:
                resolve_kernels(names)
        return int(args.func(args) or 0)
    except (UsageError, plugins.PluginError, dev.CacheError) as e:   # CacheError: an unwritable HOME, say
        print(f"tritune: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not e.filename:  # not about a path the user gave: a real failure, with its traceback
            raise
        print(f"tritune: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
