#!/usr/bin/env bash
# `tritune tune all --budget 30m` on a GPU with no store of its own, warm-started from the H100's store, in calls
# of at most ~9 minutes: each call resumes the same storage (kept in /tmp/tune while the machine stays warm; a
# cold machine restores it from the carried .tune/). The last call (STEP=compare) re-times the winners against
# the committed store of this GPU.  Everything lands in $OUT/tuneall/ (+ bundle.tgz).
#   STEP=tune|compare|last|timers|ab bash lab/drivers/tune_all_budget.sh   (timers: lab/probes/retime_timers.py, ~2 min)
# ab: the precompile helpers on and off (tuning/precompile.py), `tune gemv --budget ${AB_BUDGET:-75s}` each in a
# fresh storage and triton cache, the trial counts and each trial's phases compared (lab/probes/precompile_ab.py)
# A slice of it: KERNELS="gemm gemv" BUDGET=7m (a proportional budget); OLD=<store folder> compares against
# another store than the committed one (e.g. the committed store as of an earlier commit, carried in .tune/).
# RESUME=lab/logs/h200/<run> resumes a run whose journal (h200-budget.journal.xz) and store were committed there.
set -uo pipefail
: "${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
if [ ! -f /tmp/installed ]; then
  python -m pip install -q --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
  touch /tmp/installed
fi
export TRITON_CACHE_DIR=/tmp/tcache TRITUNE_COMMIT=$(cat .commit 2>/dev/null)   # the benches stamp this commit (the device copy's .git is stale)
S=/tmp/tune
if [ -n "${RESUME:-}" ] && [ ! -f $S/h200-budget.journal ]; then   # (not on the storage a warm machine holds)   # a committed run's journal (xz) and store: RESUME=lab/logs/<gpu>/<run>
  mkdir -p $S/h200-budget && cp -r $RESUME/store $S/h200-budget/nvidia-h200 \
  && python -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
       $RESUME/h200-budget.journal.xz $S/h200-budget.journal && echo "restored storage from $RESUME" || exit 1
fi
for T in .tune ../.tune; do if [ ! -f $S/h200-budget.journal ] && [ -d $T/h200-budget ]; then mkdir -p $S && cp -r $T/h200-budget $T/h200-budget.journal $S/; echo "restored storage from $T"; fi; done
mkdir -p $S/pkg-h100 $OUT/tuneall && ln -sfn $PWD/tuning/configs/nvidia-h100-80gb-hbm3 $S/pkg-h100/
slug=$(python -c "from tritune.harness import device; print(device.gpu_slug())")
echo "slug $slug commit $(cat .commit 2>/dev/null) step ${STEP:-tune}"
run_tune() { TRITUNE_CONFIGS=$S/pkg-h100 TRITUNE_CONFIG_DIR=$S/h200-budget PYTHONUNBUFFERED=1 timeout -s INT ${TUNE_LIM:-575} \
          tritune tune ${KERNELS:-all} --dtype bf16 --budget ${BUDGET:-30m} --stop-after ${STOP_AFTER:-540s} --export --storage $S/h200-budget.journal \
          --quiet > $OUT/tuneall/tune_$(date +%H%M%S).log 2>&1; echo "tune rc=$?"; tail -25 $OUT/tuneall/tune_*.log | tail -25; }
run_compare() { python lab/compare_tune_all.py --new $S/h200-budget/$slug --old ${OLD:-tuning/configs/$slug} --retime \
          --time-limit ${CMP_LIM:-240} --storage $S/h200-budget.journal --json $OUT/tuneall/compare.json \
          > $OUT/tuneall/compare.log 2>&1; echo "compare rc=$?"; tail -40 $OUT/tuneall/compare.log; }
case ${STEP:-tune} in
  tune) run_tune ;;
  compare) run_compare ;;
  last) run_tune; run_compare ;;   # the budget's last slice, then the comparison, in one call
  ab) for H in 0 default; do
        rm -rf /tmp/tcache_ab; mkdir -p $OUT/tuneall/ab_$H
        ( [ $H = 0 ] && export TRITUNE_PRECOMPILE=0; TRITON_CACHE_DIR=/tmp/tcache_ab TRITUNE_CONFIGS=$S/pkg-h100 \
          TRITUNE_CONFIG_DIR=$OUT/tuneall/ab_$H PYTHONUNBUFFERED=1 timeout -s INT 200 tritune tune ${AB_KERNELS:-gemv} \
          --dtype bf16 --budget ${AB_BUDGET:-75s} --storage $OUT/tuneall/ab_$H/journal --quiet > $OUT/tuneall/ab_$H.log 2>&1 )
        echo "ab $H rc=$?"; grep -E "precompile|studies:|local search|budget:" $OUT/tuneall/ab_$H.log
      done
      python lab/probes/precompile_ab.py $OUT/tuneall/ab_0/journal $OUT/tuneall/ab_default/journal | tee $OUT/tuneall/ab.txt ;;
  timers) python lab/probes/retime_timers.py $OUT/tuneall/timers > $OUT/tuneall/timers.log 2>&1; echo "timers rc=$?"
          tail -45 $OUT/tuneall/timers.log ;;
esac
cp -r $S/h200-budget $S/h200-budget.journal $OUT/tuneall/ 2>/dev/null
tar -czf $OUT/bundle.tgz -C $OUT tuneall
