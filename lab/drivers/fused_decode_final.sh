#!/usr/bin/env bash
# One device call for the fused decode step: the config sweep at GPT-2 small batch 1 (every variant's stage split),
# the fused step's GPU tests, then GPT-2 small batch 8 and GPT-2 medium batch 1 (default and lm64), exported
# to a store under $OUT/store (copied into tuning/configs/<gpu>/ when committed).   FD_CFG=<job file> bash lab/drivers/fused_decode_final.sh
set -uo pipefail
: "${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { tail -5 /tmp/install.log; exit 1; }
export TRITON_CACHE_DIR=/tmp/tcache TRITUNE_COMMIT=$(cat .commit 2>/dev/null)
cfg=$(grep -v '^#' ${FD_CFG:?})
timeout ${B1_LIM:-110} python lab/bench_fused_decode.py $OUT/sweep --time-limit $(( ${B1_LIM:-110} - 30 )) --models gpt2-small --batches 1 \
  --variants auto --configs "$cfg" --stage-split all --reps 3 --steps 128 --export --export-root $OUT/store > $OUT/sweep.log 2>&1
echo "sweep rc=$?"; grep -v Warn $OUT/sweep.log | tail -14
TRITUNE_TEST_LOG=$OUT/tests_lines.log timeout ${T_LIM:-110} python -m pytest -n 8 -q -p no:cacheprovider -m gpu tests/test_fused_decode.py > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/tests.log
lm=$(echo "$cfg" | tr ';' '\n' | grep '^lm64=')
for row in "gpt2-small 8" "gpt2-medium 1"; do set -- $row
  timeout ${B2_LIM:-55} python lab/bench_fused_decode.py $OUT/$1_b$2 --time-limit $(( ${B2_LIM:-55} - 15 )) --models $1 --batches $2 \
    --variants auto --configs "$lm" --reps 3 --steps 128 --export --export-root $OUT/store > $OUT/$1_b$2.log 2>&1
  echo "$1 b$2 rc=$?"; grep -v Warn $OUT/$1_b$2.log | tail -6
done
