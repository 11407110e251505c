"""Test configuration: interpreter on CPU-only machines, hypothesis profiles per machine kind."""
import os

import tritune.harness  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
import pytest
from hypothesis import HealthCheck, settings

from tritune.harness import device as dev

# The interpreter runs every program instance in Python: few, small examples. On a GPU: many, larger.
settings.register_profile("interpreter", max_examples=int(os.environ.get("TRITUNE_EXAMPLES", 12)),
                          deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                          print_blob=True)
settings.register_profile("gpu", max_examples=int(os.environ.get("TRITUNE_EXAMPLES", 60)), deadline=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.load_profile("interpreter" if dev.interpreted() else "gpu")


def pytest_report_header(config):
    return (f"tritune: {'Triton interpreter (CPU)' if dev.interpreted() else dev.gpu_name()}, "
            f"slug {dev.gpu_slug()}")


def pytest_collection_modifyitems(config, items):
    if dev.interpreted():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (this machine runs kernels through the Triton interpreter)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


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
