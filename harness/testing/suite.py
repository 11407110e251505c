"""The contract tests of every registered kernel (built-in and plugin), one class per kernel.

What ``tritune test`` runs where there is no tests/ folder (a pip install), and what
``pytest --tritune-kernel NAME`` collects; ``-m NAME`` picks one kernel.
"""
from tritune import kernels
from tritune.testing import pytest_plugin
from tritune.testing.contract import contract_tests

_wanted = [n for n in pytest_plugin.selected_kernels() if n != "all"]
for _spec in [kernels.get(n) for n in _wanted] if _wanted else kernels.all_specs():
    globals()[f"Test_{_spec.name}"] = contract_tests(_spec)
del _spec, _wanted
