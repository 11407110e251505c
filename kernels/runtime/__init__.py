"""The runtime a launch needs, the ground floor under every kernel: the device and the interpreter switch,
the kernel spec and its registry, input checks, launch machinery, the tuned store's lookup, the tolerance
table and the hypothesis strategies. Nothing here imports a kernel, tuning, the model or the harness.

Importing it switches on Triton's interpreter on a machine without a CUDA GPU (``TRITON_INTERPRET`` must be
set before triton compiles anything): every kernel module imports the runtime first.
"""
from tritune.kernels.runtime.device import setup_interpreter

setup_interpreter()
