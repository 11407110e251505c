#!/usr/bin/env bash
# The fill's local search on the two H200 buckets the budgeted run missed, in ~4 min: gemm on 4 K=3072 buckets
# (90 s budget) and gemv on 3 (50 s), warm-started from the H100 store only (the H200 store moved aside), then the
# winners re-timed against OLD (default: the committed H200 store as of 9812291, carried in .tune/).
#   OUT=... bash lab/drivers/fill_smoke.sh
set -uo pipefail
: "${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
[ -f /tmp/installed ] || { python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 && touch /tmp/installed; } || exit 1
export TRITON_CACHE_DIR=/tmp/tcache TRITUNE_COMMIT=$(cat .commit 2>/dev/null)
D=$OUT/fill_smoke; G=bias=1,residual=1; OLD=${OLD:-.tune/old-h200-9812291/nvidia-h200}
mkdir -p $D/pkg && ln -sfn $PWD/tuning/configs/nvidia-h100-80gb-hbm3 $D/pkg/
( export TRITUNE_CONFIGS=$D/pkg TRITUNE_CONFIG_DIR=$D/user PYTHONUNBUFFERED=1
  timeout -s INT 130 tritune tune gemm --dtype bf16 --budget 90s --storage $D/fill.journal --export --quiet \
    --problems "M=8,N=768,K=3072,$G;M=64,N=768,K=3072,$G;M=512,N=768,K=3072,$G;M=8192,N=768,K=3072,$G" >$D/gemm.log 2>&1
  timeout -s INT 80 tritune tune gemv --dtype bf16 --budget 50s --storage $D/fill.journal --export --quiet \
    --problems "M=1,N=768,K=3072,$G;M=4,N=768,K=3072,$G;M=8,N=768,K=3072,$G" >$D/gemv.log 2>&1 )
grep -hE "fill|^kernel|^gem|^studies|^budget:|^geomean" $D/gemm.log $D/gemv.log
timeout 70 python lab/compare_tune_all.py --new $D/user/nvidia-h200 --old $OLD --retime --time-limit 25 \
  --storage $D/fill.journal --json $D/compare.json > $D/compare.log 2>&1; grep -v "did not export" $D/compare.log | tail -14
rm -rf $D/pkg
