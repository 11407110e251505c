#!/usr/bin/env bash
# The attention launch path on a GPU in one call: tests/test_attention.py in full plus the model/engine suites
# that run on it (direct launches, descriptor makers, the varlen vendor column), then, with nothing else
# running, `tritune bench attention attention_varlen --dtype bf16` into $W/results (copy to results/<gpu>/).
#   bash lab/drivers/verify_attention_launch.sh   (TEST_LIM, BENCH_LIM, BENCH=0 skips the bench; $OUT/bundle.tgz)
set -uo pipefail
source lab/drivers/setup.sh
echo "commit $(cat .commit 2>/dev/null) $(nvidia-smi -L | head -1)" | tee $W/summary.txt
timeout ${TEST_LIM:-330} python -m pytest -q -p no:cacheprovider -n 12 --dist worksteal --durations=8 \
  tests/test_attention.py tests/test_kernels.py tests/test_model.py tests/test_engine.py tests/test_chunked_prefill.py \
  tests/test_mixed_graphs.py tests/test_batch_invariance.py ${TEST_ARGS:-} > $W/tests.log 2>&1
echo "tests rc=$?" >> $W/summary.txt; grep -E "^(FAILED|ERROR)" $W/tests.log | head -20 >> $W/summary.txt; tail -12 $W/tests.log >> $W/summary.txt
if [ "${BENCH:-1}" = 1 ]; then
  timeout ${BENCH_LIM:-200} tritune bench attention attention_varlen --dtype bf16 --results-dir $W/results > $W/bench.log 2>&1
  echo "bench rc=$?" >> $W/summary.txt; tail -25 $W/bench.log | cut -c1-220 >> $W/summary.txt
fi
tar -czf $OUT/bundle.tgz -C $OUT w && cp $W/summary.txt $OUT/summary.txt && cut -c1-250 $OUT/summary.txt | tail -60
