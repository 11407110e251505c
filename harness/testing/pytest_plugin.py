"""pytest plugin (entry point ``pytest11``): ``--tritune-kernel NAME`` and one marker per kernel.

Loaded in every pytest run of an environment where tritune is installed, so it imports nothing but
pytest until a tritune test asks for more: no torch, no triton, no interpreter switch for projects that
merely share the environment.
"""
from __future__ import annotations

from pathlib import Path

TEST_HELP = """usage: tritune test [-m KERNEL] [--tritune-fast] [pytest options] [path ...]

Runs pytest: with no path, ./tests in a checkout of tritune, else the contract tests of every registered
kernel (built-in and plugin). Slow tests stay out unless a -m expression names `slow`.

tritune's options:
  -m KERNEL             one kernel's tests (each kernel has its marker: -m gemm, -m my_rms_norm)
  --tritune-kernel NAME the contract tests of a registered kernel (repeatable; 'all': every one)
  --tritune-fast        the contract's fast mode, for the interpreter: few examples, a short budget, no
                        shrinking (a failing kernel fails in seconds); also TRITUNE_CONTRACT_FAST=1
environment:
  TRITUNE_EXAMPLES      hypothesis examples per (kernel, dtype) (12 interpreted, 40 on a GPU)
  TRITUNE_TEST_BUDGET   seconds per (kernel, dtype) after which the reference match stops launching
  TRITUNE_PLUGINS       modules that register kernels (as --plugin)

pytest's options follow.
"""

_CONFIG = None  # this pytest run's config: contract_tests() registers its kernel's marker through it


def pytest_addoption(parser):
    g = parser.getgroup("tritune")
    g.addoption("--tritune-kernel", action="append", default=[], metavar="NAME",
                help="run tritune's contract tests for this registered kernel (repeatable; 'all': every one)")
    g.addoption("--tritune-fast", action="store_true", default=False,
                help="the contract's fast mode (for the interpreter): few examples, a short budget, no "
                     "shrinking (also TRITUNE_CONTRACT_FAST=1)")


def pytest_load_initial_conftests(early_config, parser, args):
    # --tritune-kernel with nothing else to collect: the shipped suite is the test file. Appended here
    # (before the arguments are parsed) so it counts as a path given on the command line.
    if any(a == "--tritune-kernel" or a.startswith("--tritune-kernel=") for a in args):
        args.append(str(suite_path()))


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped, with the reason, on the interpreter)")
    config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")


def pytest_unconfigure(config):
    global _CONFIG
    if _CONFIG is config:
        _CONFIG = None


def selected_kernels() -> list[str]:
    """The kernels --tritune-kernel asked for ([] when it was not given)."""
    if _CONFIG is None:
        return []
    return list(_CONFIG.getoption("tritune_kernel", default=None) or [])


def fast_option() -> bool:
    """Whether --tritune-fast was given."""
    return bool(_CONFIG is not None and _CONFIG.getoption("tritune_fast", default=False))


def register_marker(name: str) -> None:
    """Register the kernel's marker before a test class is marked with it (no unknown-marker warning,
    and ``--strict-markers`` accepts it)."""
    if _CONFIG is not None and not any(m.split(":")[0].strip() == name for m in _CONFIG.getini("markers")):
        _CONFIG.addinivalue_line("markers", f"{name}: tritune's tests of the {name} kernel")


def suite_path() -> Path:
    return Path(__file__).with_name("suite.py")

