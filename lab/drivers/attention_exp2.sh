#!/usr/bin/env bash
# The EXP2 key on an sm90 machine in one call: its GPU tests (tests/test_attention.py -k exp2, plus TEST_K) on
# GPU 0 while FA3's grid sweeps it (bench_attention_fa3_grid.py --sweep exp2 --emit: ours, the default and
# the Gluon seeds at EXP2 0/1/2, beside every SDPA backend) on GPU 1 (one GPU: one after the other).
#   bash lab/drivers/attention_exp2.sh   (TEST_K, TEST_LIM, FA3_LIM, FA3_ARGS; $OUT/bundle.tgz)
set -uo pipefail
: "${OUT:?}"
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { cat $W/install.log; exit 1; }
export TRITON_CACHE_DIR=/tmp/tcache TRITUNE_COMMIT=$(cat .commit 2>/dev/null)
NG=$(nvidia-smi -L | wc -l); echo "gpus $NG commit $(cat .commit 2>/dev/null)" | tee $W/summary.txt
tests() { CUDA_VISIBLE_DEVICES=0 timeout ${TEST_LIM:-300} python -m pytest -q -p no:cacheprovider -n 8 --dist worksteal \
            tests/test_attention.py -k "${TEST_K:-exp2}" --durations=5 > $W/tests.log 2>&1
          echo "tests rc=$?" >> $W/summary.txt; grep -E "^(FAILED|ERROR)" $W/tests.log | cut -c1-300 | head -20 >> $W/summary.txt
          tail -4 $W/tests.log >> $W/summary.txt; }
grid() { CUDA_VISIBLE_DEVICES=$(( NG > 1 ? 1 : 0 )) timeout $(( ${FA3_LIM:-330} + 40 )) python lab/bench_attention_fa3_grid.py \
            $W/fa3 --sweep exp2 --emit --peers cudnn --budget-s ${FA3_LIM:-330} ${FA3_ARGS:-} > $W/fa3.log 2>&1
         echo "fa3 rc=$?" >> $W/summary.txt; grep -E "^(bf16|fp16) D=" $W/fa3.log >> $W/summary.txt; tail -22 $W/fa3.log >> $W/summary.txt; }
if [ "$NG" -gt 1 ]; then tests & grid & wait; else tests; grid; fi
tar -czf $OUT/bundle.tgz -C $OUT w && cp $W/summary.txt $OUT/summary.txt && cut -c1-260 $OUT/summary.txt | tail -70
