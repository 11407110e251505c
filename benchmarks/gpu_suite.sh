#!/usr/bin/env bash
# The test suite on a GPU machine, from the repository root:
#   OUT=/some/dir bash benchmarks/gpu_suite.sh   # TEST_K="fp8 or rms" narrows it (pytest -k); TEST_ARGS adds flags
# Installs the wheels carried in .whl/ (the machine has no network) into /tmp/site, tritune editable on top,
# then runs `python -m pytest -n 16`. Under $OUT: install.log, tests.log (one line per test as it finishes:
# TRITUNE_TEST_LOG, so a run cut by TEST_BUDGET keeps what finished), compiles.log (each Triton compile, timed,
# with its test: TRITUNE_COMPILE_LOG), pytest.log (the summary) and gpu.csv.
set -uo pipefail
: "${OUT:?OUT must be set (the folder the results go to)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache} TRITUNE_COMPILE_LOG=${TRITUNE_COMPILE_LOG-$OUT/compiles.log}
# the commit measured: $TRITUNE_COMMIT, else .commit (a copied tree's .git may be stale), else git's HEAD
export TRITUNE_COMMIT=${TRITUNE_COMMIT:-$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)}
. benchmarks/install_wheels.sh
install_wheels "$OUT/install.log" && install_tree "$OUT/install.log" . || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv >"$OUT/gpu.csv" 2>&1
echo "commit $TRITUNE_COMMIT, GPU slug $(python -c 'from tritune.kernels.runtime import device; print(device.gpu_slug())')"
# shellcheck disable=SC2086  (TEST_ARGS: several pytest arguments)
TRITUNE_TEST_LOG="$OUT/tests.log" timeout "${TEST_BUDGET:-540}" \
  python -m pytest -n "${WORKERS:-16}" --dist worksteal -q -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} ${TEST_ARGS:-} 2>&1 \
  | tee "$OUT/pytest_full.log" | tail -60 >"$OUT/pytest.log"
rc=${PIPESTATUS[0]}
grep -v PytestBenchmarkWarning "$OUT/pytest.log" | tail -40
exit "$rc"
