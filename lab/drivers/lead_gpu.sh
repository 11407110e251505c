#!/usr/bin/env bash
# One device call, phases named in $PHASES run in order; everything lands in $OUT/bundle.tgz (+ summary.txt).
#   PHASES="cold warm" bash lab/drivers/lead_gpu.sh
# Phases: cold, warm (the default suite, cold then warm Triton cache), slow (the slow suite), tests (TEST_ARGS),
# paths (decode/serve before and after: .base holds the earlier tree), attn (attention bench bf16+fp16),
# rms (the example kernel's bench), hf (lab/bench_hf_patch.py; hfnopdl: the same with TRITUNE_PDL=0; genprof: its
# --part genprof), launches (lab/probes/invariant_decode_launches.py), retime (lab/probes/retime_timers.py), http (lab/bench_http.py), quant
# (lab/eval_quant.py), serving (lab/bench_serving_features.py), invariant (lab/bench_batch_invariance.py),
# fa3 (lab/bench_attention_fa3_grid.py), fused (lab/bench_fused_decode.py), pgemv (lab/probes/persistent_gemv_bandwidth.py), preflight (the attention Hopper-path tests),
# expsplit (lab/probes/attention_exp_split.py), chain (lab/probes/stage_chain_floor.py), gluon (lab/probes/gluon_staged_weights.py), gfa3 (lab/probes/gluon_fa3_attention.py), gpers (lab/probes/gluon_fa3_persistent.py), tunedecode (tritune tune-decode, exported under w/store),
# tuneall (tune all --budget $BUDGET warm-started from the H100 store, then compare_tune_all).
set -uo pipefail
: "${OUT:?}"
W=$OUT/w; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
if [ ! -f /tmp/installed ]; then
  python -m pip install -q --no-deps --no-build-isolation -e . >$W/install.log 2>&1 || { cat $W/install.log; exit 1; }
  python -m pip install -q --no-deps --no-build-isolation ./examples/rms_norm >>$W/install.log 2>&1 || exit 1
  touch /tmp/installed
fi
export TRITON_CACHE_DIR=/tmp/tcache TRITUNE_COMMIT=$(cat .commit 2>/dev/null)   # the benches stamp this commit (the device copy's .git is stale)
slug=$(python -c "from tritune.harness import device; print(device.gpu_slug())")
echo "slug $slug commit $(cat .commit 2>/dev/null)" | tee $W/summary.txt
t() { local name=$1 lim=$2; shift 2; local s=$(date +%s); timeout $lim "$@" > $W/$name.log 2>&1; local rc=$?
      echo "$name rc=$rc wall=$(( $(date +%s) - s ))s" | tee -a $W/summary.txt; tail -4 $W/$name.log | tee -a $W/summary.txt; }
for ph in ${PHASES:?}; do case $ph in
  cold) rm -rf $TRITON_CACHE_DIR; TRITUNE_TEST_LOG=$W/cold_tests.log t cold ${COLD_LIM:-400} python -m pytest -n 16 --dist worksteal -q -p no:cacheprovider --durations=12 ;;
  warm) TRITUNE_TEST_LOG=$W/warm_tests.log t warm ${WARM_LIM:-240} python -m pytest -n 16 --dist worksteal -q -p no:cacheprovider --durations=12 ;;
  slow) TRITUNE_TEST_LOG=$W/slow_tests.log t slow ${SLOW_LIM:-400} python -m pytest -n 16 --dist worksteal -q -p no:cacheprovider -m slow --durations=12 ;;
  tests) TRITUNE_TEST_LOG=$W/sel_tests.log t tests ${TESTS_LIM:-300} python -m pytest -n 16 --dist worksteal -q -p no:cacheprovider ${TEST_ARGS:?} ;;
  paths)
    cp -r model/default .base/model/ 2>/dev/null
    python -m pip install -q --no-deps --no-build-isolation --target /tmp/base_site ./.base >$W/base_install.log 2>&1
    python -m pip install -q --no-deps --no-build-isolation --target /tmp/new_site . >>$W/base_install.log 2>&1
    PATH=/tmp/base_site/bin:$PATH PYTHONPATH=/tmp/base_site:$PYTHONPATH t paths_before ${PATHS_LIM:-200} python lab/bench_decode_paths.py --out $W/paths_before ${PATHS_ARGS:-}
    PATH=/tmp/new_site/bin:$PATH PYTHONPATH=/tmp/new_site:$PYTHONPATH t paths_after ${PATHS_LIM:-200} python lab/bench_decode_paths.py --out $W/paths_after ${PATHS_ARGS:-} ;;
  basesite) cp -r model/default .base/model/ 2>/dev/null
    python -m pip install -q --no-deps --no-build-isolation --target /tmp/base_site ./.base >$W/base_install.log 2>&1
    python -m pip install -q --no-deps --no-build-isolation --target /tmp/new_site . >>$W/base_install.log 2>&1 ;;
  dpaths) for r in $(seq ${DP_ROUNDS:-1}); do for v in base new; do PATH=/tmp/${v}_site/bin:$PATH PYTHONPATH=/tmp/${v}_site:$PYTHONPATH \
      t decode_${v}_$r 120 python lab/bench_decode_paths.py --out $W/decode_${v}_$r --reps ${DP_REPS:-3} --serve-n 0; done; done ;;
  sbench) for v in base new; do PATH=/tmp/${v}_site/bin:$PATH PYTHONPATH=/tmp/${v}_site:$PYTHONPATH \
      t serve_$v 150 tritune serve-bench -n 512 --modes triton-graphs --naive-requests 0 --hf-requests -1 \
        --decode-tokens 0 --batch-sweep '' --out $W/serve_$v.json; done ;;
  attn) mkdir -p $W/results && cp -r results/. $W/results/
        t attn_bf16 200 tritune bench attention attention_varlen --dtype bf16 --results-dir $W/results ;;
  attn16) t attn_fp16 200 tritune bench attention --dtype fp16 --results-dir $W/results_fp16 --no-save ;;
  rms) t rms 120 tritune bench rms_norm --results-dir $W/results_rms ;;
  hf) t hf ${HF_LIM:-300} python lab/bench_hf_patch.py $W/hf ${HF_ARGS:-} ;;
  genprof) t genprof ${GP_LIM:-220} python lab/bench_hf_patch.py $W/genprof --part genprof --batches 32 --time-limit $(( ${GP_LIM:-220} - 20 )) ;;
  launches) t launches 120 python lab/probes/invariant_decode_launches.py --out $W/launches ;;
  retime) t retime 200 python lab/probes/retime_timers.py $W/retime ;;
  hflean) TRITUNE_LEAN_DISPATCH=1 t hf_lean ${HF_LIM:-300} python lab/bench_hf_patch.py $W/hf_lean ${HF_ARGS:-} ;;
  leantests) TRITUNE_LEAN_DISPATCH=1 TRITUNE_TEST_LOG=$W/lean_tests.log t leantests ${TESTS_LIM:-300} python -m pytest -n 16 --dist worksteal -q -p no:cacheprovider ${LEAN_TEST_ARGS:?} ;;
  hfnopdl) TRITUNE_PDL=0 t hf_nopdl ${HF_LIM:-300} python lab/bench_hf_patch.py $W/hf_nopdl ${HF_ARGS:-} ;;
  http) t http $(( ${HTTP_LIM:-270} + 30 )) python lab/bench_http.py $W/http --time-limit ${HTTP_LIM:-270} ${HTTP_ARGS:-} ;;
  quant) t quant 300 python lab/eval_quant.py --out $W/eval_quant.json ;;
  serving) t serving $(( ${SERV_LIM:-270} + 20 )) python lab/bench_serving_features.py $W/serving --time-limit ${SERV_LIM:-270} ${SERV_ARGS:-} ;;
  invariant) t invariant $(( ${INV_LIM:-200} + 30 )) python lab/bench_batch_invariance.py --out $W/invariant -n ${INV_N:-512} --budget-s ${INV_LIM:-200} ${INV_ARGS:-} ;;
  fa3) t fa3 $(( ${FA3_LIM:-180} + 40 )) python lab/bench_attention_fa3_grid.py $W/fa3 --budget-s ${FA3_LIM:-180} --emit ;;
  pgemv) t pgemv ${PG_LIM:-200} python lab/probes/persistent_gemv_bandwidth.py --out $W/pgemv.json --quick --time-limit $(( ${PG_LIM:-200} - 30 )) ;;
  fdsweep) # the fused step's config sweep (FD_CFG: a file of --configs), GPT-2 small batch 1, every variant's stage split;
    # then every model at batch 1 and 8 with the old default and FD_PICK's variants
    t fdsweep $(( ${FD_LIM:-150} + 40 )) python lab/bench_fused_decode.py $W/fdsweep --time-limit ${FD_LIM:-150} --models gpt2-small \
      --batches 1 --variants auto --configs "$(grep -v '^#' ${FD_CFG:?})" --stage-split all --reps 3 --steps 128
    t fdrows $(( ${FD_LIM2:-150} + 40 )) python lab/bench_fused_decode.py $W/fdrows --time-limit ${FD_LIM2:-150} \
      --models gpt2-small,gpt2-medium,packaged --batches 1,8 --variants auto --configs "$(grep -oE "(${FD_PICK:-k256n64p|k256n64})=[^;]*" ${FD_CFG} | paste -sd';')" \
      --reps 3 --steps 128 ;;
  fused) t fused $(( ${FD_LIM:-180} + 40 )) python lab/bench_fused_decode.py $W/fd --time-limit ${FD_LIM:-180} ${FD_ARGS:-} ;;
  expsplit) t expsplit ${ES_LIM:-240} python lab/probes/attention_exp_split.py --out $W/attention_exp_split.json ${ES_ARGS:-} ;;
  chain) for v in ${CH_VARIANTS:-4:8 1:8 2:8 1:16 2:16}; do   # warps:BN (E / BN programs, all resident)
           t chain_w${v%%:*}_bn${v##*:} ${CH_LIM:-150} python lab/probes/stage_chain_floor.py --warps ${v%%:*} --BN ${v##*:} \
             --out $W/stage_chain_floor_w${v%%:*}_bn${v##*:}.json; done ;;
  gluon) t gluon ${GL_LIM:-150} python lab/probes/gluon_staged_weights.py --out $W/gluon_staged_weights.json ;;
  gfa3) t gfa3 ${GF_LIM:-300} python lab/probes/gluon_fa3_attention.py --out $W/gluon_fa3.json ${GF_ARGS:-} ;;   # GF_ARGS=--quick|--check-only
  gpers) t gpers ${GP_LIM:-300} python lab/probes/gluon_fa3_persistent.py --out $W/gluon_fa3_persistent.json ${GPF_ARGS:-} ;;   # GPF_ARGS=--quick
  tunedecode) t tunedecode ${TD_LIM:-200} tritune tune-decode --shape gpt2-small --batches ${TD_BATCHES:-1,8} --points ${TD_POINTS:-8} \
      --export --configs-dir $W/store ;;
  rerun) mapfile -t NODES < ${RERUN_FILE:?}
    TRITUNE_TEST_LOG=$W/rerun_tests.log t rerun ${RERUN_LIM:-200} python -m pytest -n 16 --dist worksteal -q -p no:cacheprovider "${NODES[@]}" ;;
  preflight) t preflight ${PRE_LIM:-150} python -m pytest -x -q -p no:cacheprovider -n 16 tests/test_attention.py -k "hopper or tma" ;;
  tuneall) mkdir -p /tmp/pkg-h100 && ln -sf $PWD/tuning/configs/nvidia-h100-80gb-hbm3 /tmp/pkg-h100/
    TRITUNE_CONFIGS=/tmp/pkg-h100 TRITUNE_CONFIG_DIR=$W/h200-budget t tuneall $(( ${BUDGET_MIN:-7} * 60 + 90 )) tritune tune all --budget ${BUDGET_MIN:-7}m --export --storage $W/h200-budget.journal
    t tuneall_cmp 120 python lab/compare_tune_all.py --new $W/h200-budget/$slug --old tuning/configs/$slug --retime ;;
  *) echo "unknown phase $ph" ;;
esac; done
tar -czf $OUT/bundle.tgz -C $OUT w && cp $W/summary.txt $OUT/summary.txt
