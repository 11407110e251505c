#!/usr/bin/env bash
# attention's Gluon FA3 path (WARP_SPEC 3-5) on an sm90 machine, in one call: its tests on one GPU while FA3's
# grid (bench_attention_fa3_grid.py --sweep gluon --emit: the Gluon points beside the default, every SDPA
# backend, bf16 and fp16) runs on the other (on a one-GPU machine the two run one after the other); then
# `tritune tune attention attention_varlen --trials 4` for bf16 and fp16 (the default, the stored entry and the
# Gluon seeds of every standard bucket, dense and packed), exported under $W/store_<dtype> (TUNE=0 skips it);
# then `tritune bench attention attention_varlen --dtype bf16` on the committed store into $W/results (the
# maintained results/<gpu>/ files: copy them over; BENCH=0 skips it). After the tests, on their GPU, the
# persistent probe (lab/probes/gluon_fa3_persistent.py --quick; PERS=0 skips it, GP_LIM its limit).
#   bash lab/drivers/gluon_attention.sh   (TEST_K, TEST_LIM, FA3_LIM, FA3_ARGS, TUNE, TUNE_LIM, BENCH, BENCH_LIM, PERS,
#   GP_LIM; $OUT/bundle.tgz)
set -uo pipefail
source lab/drivers/setup.sh
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG commit $(cat .commit 2>/dev/null)" | tee $W/summary.txt
tests() { CUDA_VISIBLE_DEVICES=0 timeout ${TEST_LIM:-300} python -m pytest -q -p no:cacheprovider -n 8 --dist worksteal \
            tests/test_attention.py -k "${TEST_K:-gluon or hopper or head_dim}" --durations=8 > $W/tests.log 2>&1
          echo "tests rc=$?" >> $W/summary.txt; tail -15 $W/tests.log >> $W/summary.txt
          if [ "${PERS:-1}" = 1 ]; then   # the persistent probe (checks, then its quick grid) on the same GPU
            CUDA_VISIBLE_DEVICES=0 timeout ${GP_LIM:-300} python lab/probes/gluon_fa3_persistent.py \
              --out $W/gluon_fa3_persistent.json --quick > $W/persistent.log 2>&1
            echo "persistent rc=$?" >> $W/summary.txt; tail -20 $W/persistent.log | cut -c1-250 >> $W/summary.txt; fi; }
grid() { CUDA_VISIBLE_DEVICES=$(( NG > 1 ? 1 : 0 )) timeout $(( ${FA3_LIM:-380} + 40 )) python lab/bench_attention_fa3_grid.py \
            $W/fa3 --sweep gluon --emit --budget-s ${FA3_LIM:-380} ${FA3_ARGS:-} > $W/fa3.log 2>&1
         echo "fa3 rc=$?" >> $W/summary.txt; grep -E "^(bf16|fp16) D=" $W/fa3.log >> $W/summary.txt; tail -30 $W/fa3.log >> $W/summary.txt; }
tune() { CUDA_VISIBLE_DEVICES=$1 timeout ${TUNE_LIM:-150} tritune tune attention attention_varlen --dtype $2 --trials 4 --export \
           --configs-dir $W/store_$2 --storage $W/attn_$2.journal --quiet > $W/tune_$2.log 2>&1
         echo "tune $2 rc=$?" >> $W/summary.txt; grep -E "^attention|geomean" $W/tune_$2.log | cut -c1-200 >> $W/summary.txt; }
if [ "$NG" -gt 1 ]; then tests & grid & wait; else tests; grid; fi
if [ "${TUNE:-1}" = 1 ]; then if [ "$NG" -gt 1 ]; then tune 0 bf16 & tune 1 fp16 & wait; else tune 0 bf16; tune 0 fp16; fi; fi
if [ "${BENCH:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_LIM:-300} tritune bench attention attention_varlen --dtype bf16 \
    --results-dir $W/results > $W/bench.log 2>&1
  echo "bench rc=$?" >> $W/summary.txt; tail -25 $W/bench.log | cut -c1-220 >> $W/summary.txt
fi
tar -czf $OUT/bundle.tgz -C $OUT w && cp $W/summary.txt $OUT/summary.txt && cat $OUT/summary.txt | cut -c1-250 | tail -80
