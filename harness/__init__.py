"""The harness, the top floor: the CLI (one module per command), benchmarks and reports, plots, and the
shipped testing contract (``tritune.testing``). It imports every floor below it; nothing imports it."""
import tritune.kernels.runtime  # noqa: F401  (the interpreter switch, before anything imports triton)
