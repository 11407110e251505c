"""Test configuration: interpreter on CPU-only machines, hypothesis profiles and time budgets, slow tests.

A fast suite (``python -m pytest -n auto``, slow tests deselected by pyproject's addopts) and a slow one
(``python -m pytest -n auto -m slow``) that together run every test:

- every hypothesis test on a GPU stops launching once ``TRITUNE_TEST_BUDGET`` seconds are
  spent (default 5), after at least two examples (a failure found is still shrunk in full); the examples are drawn
  afresh each run, so the runs together cover what one long run would. The kernels' contract tests
  (tritune.testing.contract) budget themselves the same way, and their deep variant is marked slow.
- the tests in SLOW below, by node id (so their files need no edit), are marked slow; those in GPU_SLOW only
  on a GPU, where 16 workers share the CPU: CLI flows in subprocesses, killed sweeps, statistical tests and
  inductor compiles (the CPU suite still runs them, in CI).
- on a GPU, the fast suite runs a pairwise covering subset of each ``pairwise``-marked test's items (every two
  parameter values still meet in one; tests/pairwise.py) and marks the rest slow, for ``-m slow`` to run.
"""
import json
import os
import sys

import tritune.kernels.runtime  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
import pytest
from hypothesis import HealthCheck, settings

from tritune.kernels.runtime import device as dev

sys.path.insert(0, os.path.dirname(__file__))  # the helpers beside the tests
from pairwise import mark_beyond_pairwise  # noqa: E402

# The interpreter runs every program instance in Python: few, small examples. On a GPU: many, larger.
settings.register_profile("interpreter", max_examples=int(os.environ.get("TRITUNE_EXAMPLES", 12)),
                          deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                          print_blob=True)
settings.register_profile("gpu", max_examples=int(os.environ.get("TRITUNE_EXAMPLES", 60)), deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.load_profile("interpreter" if dev.interpreted() else "gpu")


def pytest_configure(config):
    """On a GPU under xdist, each worker's torch uses its share of the host's cores: the default, every
    core in each of 16 workers, oversubscribes the host (spinning OpenMP threads) in the tests' host-side
    work (CPU references, transformers on the host), which slows the compiles beside them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers >= 2 and not dev.interpreted():
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if os.environ.get("TRITUNE_COMPILE_LOG") and not dev.interpreted():
        log_compiles(os.environ["TRITUNE_COMPILE_LOG"])


def log_compiles(path):
    """Each Triton/Gluon compile in this process (a miss of the in-memory cache: from source, or from the disk
    cache in a fraction of a second) as a line "<seconds>s <kernel> <key hash> <test>" in ``path``: where a
    cold suite's compile time goes, and which variants two workers compiled at once."""
    import hashlib
    import time

    from triton.runtime.jit import JITFunction

    inner = JITFunction._do_compile

    def timed(self, key, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, key, *args, **kwargs)
        finally:
            test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
            digest = hashlib.sha1(f"{self.cache_key}{key}".encode()).hexdigest()[:10]
            with open(path, "a") as f:
                f.write(f"{time.perf_counter() - t0:8.3f}s {self.fn.__name__} {digest} {test}\n")

    JITFunction._do_compile = timed


def pytest_report_header(config):
    return (f"tritune: {'Triton interpreter (CPU)' if dev.interpreted() else dev.gpu_name()}, "
            f"slug {dev.gpu_slug()}")


# The expensive sweeps and compiles, from the H100 runs' per-test durations: each is still run, by the
# slow suite.
SLOW = (
    "tests/test_engine.py::test_compiled_decode_equals_alone",            # torch.compile of the decode: 125 s
    "tests/test_attention.py::test_every_head_dim_and_layout[float32-",   # fp32 head dims x layouts: 27-44 s each
    "tests/test_tuning.py::test_real_gelu_sweep_through_the_cli",         # a real sweep through the CLI: 37 s
    "tests/test_engine.py::test_graphs_stress_many_generations_and_engines_in_one_process",  # 50 runs: 252 s cold
    "tests/test_torch_ops.py::test_compile_gpt2_inductor_gpu[",            # inductor compiles of GPT-2: 41-71 s
    "tests/test_sweeps.py::test_a_sweep_killed_mid_trial_completes_its_count_on_rerun[sqlite]",  # 77 s on a GPU
    "tests/test_hf_patch.py::test_gpt2_small_compiled_gpu[",              # inductor, GPT-2 small: > 200 s
)


# From a cold H100 run of the fast suite (16 workers): each 40-190 s, most of it host work.
GPU_SLOW = (
    "tests/test_plugins.py::test_plugin_kernel_through_every_command",     # 187 s: info/bench/tune --workers 2
    "tests/test_plugins.py::test_pytest_tritune_kernel_option",            # 40 s: a pytest in a subprocess
    "tests/test_spec_decode.py::test_rejection_sampling_keeps_the_target_distribution",  # 153 s: statistics
    "tests/test_quantize.py::test_deterministic_with_seed",                # 79 s: GPTQ/AWQ twice on the host
    "tests/test_prefix_cache.py::test_eviction_under_memory_pressure_and_preemption",  # 79 s
    "tests/test_sweeps.py::",                                              # 36-77 s each: sweeps killed for real
    "tests/test_tuning.py::test_two_workers_share_one_study",              # 36 s
    "tests/test_tuning.py::test_dying_worker_is_restarted_and_the_sweep_goes_on",  # 46 s
    "tests/test_hf_patch.py::test_compiled_forward_static_cache_generate",  # 51 s: inductor
    "tests/test_hf_patch.py::test_compile_fullgraph_no_recompile",         # 46 s: inductor
    "tests/test_torch_ops.py::test_explain_reports_no_graph_break",        # 44 s: dynamo
    "tests/test_plugins.py::test_example_package_cli_flow",                # 55 s: test, tune, bench in subprocesses
    "tests/test_plugins.py::test_user_kernel_and_patch_work_whatever_was_imported_first",  # transformers in a
    # subprocess; what it checks (functions decorated before the interpreter's switch) is the CPU's case
    "tests/test_precision.py::test_fp32_tiny_gpt2_greedy_matches_transformers",  # 21 s: the CPU stand-in of
    # test_fp32_gpt2_greedy_and_logits_match_transformers, which runs the same procedure at full size
)


@pytest.hookimpl(hookwrapper=True)  # around every other implementation: marks before -m deselects, order after
def pytest_collection_modifyitems(config, items):
    mark_slow_and_gpu(items)
    yield
    order_long_first(items)


def mark_slow_and_gpu(items):
    slow = SLOW if dev.interpreted() else SLOW + GPU_SLOW
    for item in items:
        if item.nodeid.startswith(slow):
            item.add_marker(pytest.mark.slow)
    if not dev.interpreted():
        mark_beyond_pairwise(items)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine runs kernels through the Triton interpreter)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A time budget for each hypothesis test on a GPU (through the interpreter only when
    TRITUNE_TEST_BUDGET is set: CI keeps its fixed examples)."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    explicit = os.environ.get("TRITUNE_TEST_BUDGET")
    if handle is None or (dev.interpreted() and not explicit) or item.get_closest_marker("slow"):
        yield
        return
    from tritune.testing.contract import budgeted, default_budget, ended_by_budget

    inner = handle.inner_test
    handle.inner_test = wrapped = budgeted(inner, default_budget())  # per item: parametrized items share it
    try:
        outcome = yield
        excinfo = outcome.excinfo
        if excinfo is not None and ended_by_budget(excinfo[1], wrapped.state):
            outcome.force_result(None)   # the budget ended the run: the examples so far passed
    finally:
        handle.inner_test = inner


# Durations (s) of the GPU suite's long tests on an H200 under 16 workers with a cold Triton cache: {node id:
# seconds} of the tests over 8 s, from a per-test log (TRITUNE_TEST_LOG: "<seconds>s <outcome> <node id>" a
# line, as benchmarks/gpu_suite.sh writes them); a test split since into several items gives each its share.
DURATIONS = os.path.join(os.path.dirname(__file__), "gpu_durations.json")


def order_long_first(items):
    """On a GPU under xdist, each worker's share starts with its part of the long tests.

    ``--dist worksteal`` hands worker i the i-th of W equal contiguous slices of the collection and lets idle
    workers steal the back half of the longest queue. In file order the long tests of a file (engines, CLI
    flows, inductor compiles) land in one or two slices, run one after the other on one worker and set the
    wall clock. Here the known long tests are spread longest-first over the slices (each to the least
    loaded one with room) and put at each slice's front; the short tests keep their file order behind them,
    where stealing balances them. The order depends only on the collection and W, so every worker collects
    the same list. ``TRITUNE_TEST_ORDER=0`` keeps the file order."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or dev.interpreted() or os.environ.get("TRITUNE_TEST_ORDER", "1") == "0":
        return
    try:
        with open(DURATIONS) as f:
            known = json.load(f)
    except (OSError, ValueError):
        return
    items[:] = spread_long_first(items, known, workers)


def spread_long_first(items, known: dict, workers: int) -> list:
    n = len(items)
    sizes = []
    for i in range(workers):  # xdist's split: each idle node gets len(pending) // nodes_remaining
        sizes.append((n - sum(sizes)) // (workers - i))
    long = sorted((it for it in items if it.nodeid in known), key=lambda it: -known[it.nodeid])
    slices = [[] for _ in range(workers)]
    load = [0.0] * workers
    for it in long:
        room = [i for i in range(workers) if len(slices[i]) < sizes[i]]
        i = min(room, key=lambda i: (load[i], i))
        slices[i].append(it)
        load[i] += known[it.nodeid]
    chosen = {id(it) for it in long}
    rest = iter([it for it in items if id(it) not in chosen])
    for i in range(workers):
        slices[i] += [next(rest) for _ in range(sizes[i] - len(slices[i]))]
    return [it for s in slices for it in s]


def pytest_runtest_logreport(report):
    """With TRITUNE_TEST_LOG=FILE, each failure's traceback and each test's duration go to FILE as they
    happen (the controller under xdist). A GPU run that ends at a time limit keeps what it learned;
    pytest prints failures and --durations only at the very end."""
    path = os.environ.get("TRITUNE_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or report.when == "teardown" and report.passed:
        return
    with open(path, "a") as f:
        if report.failed:
            f.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
        elif report.when == "call":
            f.write(f"{report.duration:8.2f}s {report.outcome} {report.nodeid}\n")
