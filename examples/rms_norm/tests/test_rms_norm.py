"""The whole tritune contract for the kernel, in one line (the kernel registers through its entry point)."""
from tritune.testing import contract_tests

TestRMSNorm = contract_tests("my_rms_norm")
