"""The harness: comparison, strategies, timing, roofline, device facts, reports, CLI.

Importing any ``tritune`` subpackage goes through here first (kernels import the harness), so this is
where the Triton interpreter is switched on for machines without a GPU: ``TRITON_INTERPRET`` must be
set before ``triton`` is imported anywhere in the process.
"""
from tritune.harness.device import setup_interpreter

setup_interpreter()
