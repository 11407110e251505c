"""The contract tests of every built-in kernel (and any plugin kernel loaded): tritune.testing.contract,
the same tests users run on their own specs. One class per kernel, marked with its name (-m gemm)."""
from tritune import kernels
from tritune.testing.contract import contract_tests

for _spec in kernels.all_specs():
    globals()[f"Test_{_spec.name}"] = contract_tests(_spec)
del _spec
