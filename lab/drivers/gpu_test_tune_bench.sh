#!/usr/bin/env bash
# A last device call: GPU test suite (failures and durations logged as they happen),
# a grid tune of the kernels named in TUNE, then a bench of BENCH on the configs just tuned.
set -uo pipefail
: "${OUT:?}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || exit 1
mkdir -p "$OUT/r"
TRITUNE_EXAMPLES=${EXAMPLES:-10} TRITUNE_TEST_LOG="$OUT/r/tests.log" timeout "${TEST_BUDGET:-200}" \
  python -m pytest -n 16 -q -p no:cacheprovider --maxfail=20 2>&1 | tail -5 | tee "$OUT/r/pytest_tail.log"
for k in ${TUNE:-}; do
  timeout 90 tritune tune "$k" --dtype bf16 --sampler grid --trials 400 --time-budget 75 --storage "$OUT/r/j.journal" --quiet 2>&1 | tail -15
done
if [ -n "${TUNE:-}" ]; then
  cp -r tuning/configs "$OUT/r/configs"  # the export merges into the committed store
  tritune tune ${TUNE} --dtype bf16 --trials 0 --export --storage "$OUT/r/j.journal" --configs-dir "$OUT/r/configs" 2>&1 | tail -20
  export TRITUNE_CONFIGS="$OUT/r/configs"
fi
timeout "${BENCH_BUDGET:-150}" tritune bench ${BENCH:-gelu layer_norm} --dtype bf16 --results-dir "$OUT/r/results" 2>&1 | tee "$OUT/r/bench.log"
cd "$OUT" && tar czf bundle.tgz r && rm -rf r
