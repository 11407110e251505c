#!/usr/bin/env bash
# On a GPU machine, for the kernels named in KERNELS: their tests, a budgeted tuning run exported into a copy
# of the packaged store, then `tritune bench` on that store; everything packed into $OUT/tune_bench.tgz
# (configs/<slug>/<kernel>.json to merge into tuning/configs/, results/<slug>/<kernel>.json, the logs).
#   OUT=/dir KERNELS="rms_norm rotary" BUDGET=4m bash benchmarks/tune_and_bench.sh
# TEST_ARGS (default: -k over the kernel names) narrows the tests (TEST_BUDGET=0 skips them); BENCH_ARGS adds
# bench flags; each kernel's bench runs under its own BENCH_BUDGET seconds (rows are written as they finish).
set -uo pipefail
: "${OUT:?OUT must be set}" "${KERNELS:?KERNELS must name the kernels}"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
export TRITUNE_COMMIT=${TRITUNE_COMMIT:-$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)}
w=$OUT/w; mkdir -p "$w"
. benchmarks/install_wheels.sh
install_wheels "$w/install.log" && install_tree "$w/install.log" . || exit 1
k_expr=$(echo "$KERNELS" | sed 's/ \+/ or /g')
if [ "${TEST_BUDGET:-150}" != 0 ]; then
  echo "== tests: ${TEST_ARGS:--k \"$k_expr\"}"
  # shellcheck disable=SC2086
  timeout "${TEST_BUDGET:-150}" python -m pytest -n 16 -q -p no:cacheprovider ${TEST_ARGS:--k "$k_expr"} \
    tests/test_kernels.py ${TEST_FILES:-} 2>&1 | tail -15 | tee "$w/tests.log"
fi
cp -r tuning/configs "$w/configs"
echo "== tune ($BUDGET)"
# shellcheck disable=SC2086
timeout "${TUNE_TIMEOUT:-330}" tritune tune $KERNELS --dtype bf16 --budget "${BUDGET:-4m}" --storage "$w/studies.journal" \
  --export --configs-dir "$w/configs" 2>&1 | tail -25 | tee "$w/tune.log"
for k in $KERNELS; do
  echo "== bench $k"
  # shellcheck disable=SC2086
  TRITUNE_CONFIGS="$w/configs" timeout "${BENCH_BUDGET:-200}" tritune bench "$k" --dtype bf16 \
    --results-dir "$w/results" ${BENCH_ARGS:-} >"$w/bench-$k.log" 2>&1; tail -30 "$w/bench-$k.log"
done
(cd "$OUT" && tar czf tune_bench.tgz w && rm -rf w)
