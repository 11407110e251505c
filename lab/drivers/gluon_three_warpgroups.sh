#!/usr/bin/env bash
# The Gluon attention kernel's CTAs of three consumer warpgroups (BLOCK_M=192) on an sm90 machine of two GPUs, in
# one call. GPU 0: their GPU tests (and the persistent form's: TEST_K), then `tritune tune attention` (bf16, 7
# trials: the default, the stored entry and the Gluon seeds, three-warpgroup seed included) on the benchmark's
# H=12 D=64 buckets (TUNE_PROBLEMS), exported under $W/store_tune (TUNE=0 skips it). GPU 1: FA3's grid, `--sweep
# wg3` (ROWS, DTYPES, FA3_LIM) with --emit (GRID=0 skips it); then, BENCH=1, `tritune bench attention
# attention_varlen --dtype bf16` into $W/results. On one GPU the two run one after the other.
#   bash lab/drivers/gluon_three_warpgroups.sh   ($OUT/bundle.tgz, $OUT/summary.txt)
set -uo pipefail
source lab/drivers/setup.sh
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG commit $(cat .commit 2>/dev/null)" | tee $W/summary.txt
P12="B=8,Hq=12,Hkv=12,Tq=1024,Tk=1024,D=64"; P16="B=16,Hq=12,Hkv=12,Tq=1024,Tk=1024,D=64"; P4="B=1,Hq=12,Hkv=12,Tq=4096,Tk=4096,D=64"
TUNE_PROBLEMS=${TUNE_PROBLEMS:-"$P12,causal=True;$P12,causal=False;$P16,causal=True;$P16,causal=False;$P4,causal=True;$P4,causal=False"}
gpu0() { CUDA_VISIBLE_DEVICES=0 timeout ${TEST_LIM:-330} python -m pytest -q -p no:cacheprovider -n 8 --dist worksteal \
           tests/test_attention.py -k "${TEST_K:-three_warpgroup or persistent}" -v --durations=12 > $W/tests.log 2>&1
         echo "tests rc=$?" >> $W/summary.txt; grep -E "PASSED|FAILED|ERROR" $W/tests.log | grep -v "^\[" | cut -c1-160 >> $W/summary.txt; tail -15 $W/tests.log >> $W/summary.txt
         if [ "${TUNE:-1}" = 1 ]; then
           CUDA_VISIBLE_DEVICES=0 timeout ${TUNE_LIM:-150} tritune tune attention --dtype bf16 --trials 7 --export \
             --problems "$TUNE_PROBLEMS" --configs-dir $W/store_tune --storage $W/tune.journal > $W/tune.log 2>&1
           echo "tune rc=$?" >> $W/summary.txt; tail -20 $W/tune.log | cut -c1-220 >> $W/summary.txt; fi; }
G1=$(( NG > 1 ? 1 : 0 ))
gpu1() { if [ "${GRID:-1}" = 1 ]; then
           CUDA_VISIBLE_DEVICES=$G1 timeout $(( ${FA3_LIM:-420} + 40 )) python lab/bench_attention_fa3_grid.py \
             $W/fa3 --sweep wg3 --emit --budget-s ${FA3_LIM:-420} --peers cudnn --dtypes ${DTYPES:-fp16,bf16} \
             --rows "${ROWS:-all}" > $W/fa3.log 2>&1
           echo "fa3 rc=$?" >> $W/summary.txt; grep -E "^(bf16|fp16) D=" $W/fa3.log >> $W/summary.txt; fi
         if [ "${BENCH:-0}" = 1 ]; then   # the maintained results/<gpu>/ files on the committed store: copy them over
           CUDA_VISIBLE_DEVICES=$G1 timeout ${BENCH_LIM:-300} tritune bench attention attention_varlen --dtype bf16 \
             --results-dir $W/results > $W/bench.log 2>&1
           echo "bench rc=$?" >> $W/summary.txt; tail -25 $W/bench.log | cut -c1-220 >> $W/summary.txt; fi; }
if [ "$NG" -gt 1 ]; then gpu0 & gpu1 & wait; else gpu0; gpu1; fi
tar -czf $OUT/bundle.tgz -C $OUT w && cp $W/summary.txt $OUT/summary.txt && cat $OUT/summary.txt | cut -c1-250 | tail -60
