#!/usr/bin/env bash
# One device call that does a lot: install from carried wheels, then the phases named in $PHASES
# (space-separated): tune, compare, test, bench, decode, serve, probe, variants, py. Everything lands under $OUT.
#   PHASES="tune" TUNE_BUDGET=420 bash lab/drivers/gpu_call.sh
# A journal carried in .tune/studies.journal is resumed (studies continue, no finished trial lost).
set -uo pipefail
: "${OUT:?OUT must be set}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . || exit 1
slug=$(python -c "from tritune.harness import device; print(device.gpu_slug())")
echo "GPU slug: $slug"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.csv"
KERNELS=${KERNELS:-all}
run_phase() {
  local phase=$1
  case $phase in
    tune)
      [ -f .tune/studies.journal ] && [ ! -f "$OUT/studies.journal" ] && cp .tune/studies.journal "$OUT/"
      # TUNE_JOBS: a file of lines "kernel|budget s|trials|problems[|timer]" (problems empty: the standard
      # set; timer do_bench or graph, default $TUNE_TIMER or do_bench; '#' starts a comment); without it,
      # $KERNELS over their standard problems with $TUNE_BUDGET and $TRIALS. TUNE_ARGS: more tritune tune
      # options for every job (e.g. --seed-configs FILE).
      if [ -n "${TUNE_JOBS:-}" ]; then jobs=$(grep -v '^#' "$TUNE_JOBS"); else jobs="$KERNELS|${TUNE_BUDGET:-400}|${TRIALS:-24}|"; fi
      tuned=""
      while IFS='|' read -r jk jb jt jp jtimer; do
        [ -z "$jk" ] && continue
        tuned="$tuned $jk"
        echo "--- tune $jk (budget ${jb}s, ${jt} trials) $(date -u +%T)" | tee -a "$OUT/tune.log"
        # TUNE_PDL=0: gemv trials without programmatic dependent launch (a graph of one kernel replayed
        # back to back overlaps each launch with the next: it would time a chain of the same launch, not
        # the decode step's chain of different ones)
        TRITUNE_PDL=${TUNE_PDL:-${TRITUNE_PDL:-1}} timeout "$jb" tritune tune $jk --dtype bf16 --trials "$jt" ${jp:+--problems "$jp"} --timer "${jtimer:-${TUNE_TIMER:-do_bench}}" \
          --time-budget "$(( jb - 30 ))" --workers "${WORKERS:-1}" --storage "$OUT/studies.journal" --quiet ${TUNE_ARGS:-} \
          2>&1 | tee -a "$OUT/tune.log"
      done <<< "$jobs"
      KERNELS=$(echo $tuned | tr ' ' '\n' | sort -u | tr '\n' ' ')
      # the exported store starts as the packaged one: kernels not tuned here keep their entries
      mkdir -p "$OUT/configs" && cp -r tuning/configs/. "$OUT/configs/"
      tritune tune $KERNELS --dtype bf16 --trials 0 --export --storage "$OUT/studies.journal" --configs-dir "$OUT/configs" \
        2>&1 | tee -a "$OUT/tune.log"
      python scripts/study_report.py "$OUT/studies.journal" --out "$OUT/studies.json" > /dev/null
      ;;
    compare)
      # a journal carried in .tune/compare.journal is resumed: the grid goes on where it stopped
      [ -f .tune/compare.journal ] && [ ! -f "$OUT/compare.journal" ] && cp .tune/compare.journal "$OUT/"
      timeout "${COMPARE_BUDGET:-300}" tritune tune ${COMPARE_KERNEL:-paged_attention} --dtype bf16 --compare-samplers \
        --problems "${COMPARE_PROBLEM:?}" --storage "$OUT/compare.journal" --results-dir "$OUT/results" \
        --repeats 20 2>&1 | tee "$OUT/compare.log" ;;
    test)
      # failures and durations land in tests.log as they happen (a run cut off by its budget keeps them)
      TRITUNE_TEST_LOG="$OUT/tests.log" eval "timeout ${TEST_BUDGET:-300} python -m pytest -n 16 -q -p no:cacheprovider ${TEST_ARGS:-}" \
        2>&1 | tail -60 | tee "$OUT/pytest.log" ;;
    decode)
      timeout "${DECODE_BUDGET:-150}" python scripts/bench_decode.py --profile --reps 2 --methods "${DECODE_METHODS:-triton-graph,engine}" \
        --out "$OUT/decode.json" 2>&1 | tail -60 | tee "$OUT/decode.log"
      # DECODE_AB=1: the same again with TRITUNE_PDL=$DECODE_AB_PDL (default 0: programmatic dependent
      # launch off; or a list of kernels, e.g. gemv), for the A/B
      if [ -n "${DECODE_AB:-}" ]; then
        TRITUNE_PDL=${DECODE_AB_PDL:-0} timeout "${DECODE_BUDGET:-150}" python scripts/bench_decode.py --profile --reps 2 \
          --methods "${DECODE_METHODS:-triton-graph,engine}" --out "$OUT/decode_nopdl.json" 2>&1 | tail -60 \
          | tee "$OUT/decode_nopdl.log"
      fi ;;
    serve)
      timeout "${SERVE_BUDGET:-300}" tritune serve-bench ${SERVE_ARGS:--n 512} --out "$OUT/serve.json" 2>&1 | tail -80 \
        | tee "$OUT/serve.log" ;;
    variants)
      timeout "${VARIANTS_BUDGET:-300}" python lab/probes/config_variants_evict_hint.py --out "$OUT/variants.json" \
        ${VARIANTS_ONLY:+--only "$VARIANTS_ONLY"} 2>&1 | tee "$OUT/variants.log" ;;
    py)
      # PY_SCRIPT: a probe script that takes --out (e.g. lab/probes/ceilings_int4_variants.py), with $PY_ARGS
      timeout "${PY_BUDGET:-300}" python "${PY_SCRIPT:?}" --out "$OUT/$(basename "${PY_SCRIPT%.py}").json" ${PY_ARGS:-} \
        2>&1 | tee "$OUT/$(basename "${PY_SCRIPT%.py}").log" ;;
    probe)
      timeout "${PROBE_BUDGET:-150}" python lab/probes/l2_flush_cost.py --out "$OUT/l2_flush_cost.json" 2>&1 | tee "$OUT/probe.log" ;;
    bench)
      # BENCH_JOBS: a file of lines "kernel|budget s|problems" (problems empty: the standard set), each run
      # in turn and merged into $OUT/results; without it, $BENCH_KERNELS over their standard problems
      if [ -n "${BENCH_JOBS:-}" ]; then
        mkdir -p "$OUT/results" && cp -r results/. "$OUT/results/"   # subsets merge into the committed rows
        grep -v '^#' "$BENCH_JOBS" | while IFS='|' read -r bk bb bp; do
          [ -z "$bk" ] && continue
          echo "--- bench $bk (budget ${bb}s) $(date -u +%T)" | tee -a "$OUT/bench.log"
          timeout "$bb" tritune bench $bk --dtype bf16 ${bp:+--problems "$bp"} --results-dir "$OUT/results" \
            2>&1 | tee -a "$OUT/bench.log"
        done
      else
        timeout "${BENCH_BUDGET:-300}" tritune bench ${BENCH_KERNELS:-} --dtype bf16 --results-dir "$OUT/results" \
          2>&1 | tee "$OUT/bench.log"
      fi ;;
  esac
}
# Each phase runs as its own process group, killed whole when the phase ends: a phase cut by its timeout
# must not leave pytest-xdist or tuning workers running on the GPU into the next phase's timings.
set -m
for phase in ${PHASES:-test bench}; do
  echo "=== $phase ($(date -u +%T))"
  run_phase "$phase" &
  pg=$!
  wait "$pg"
  kill -9 -- "-$pg" 2>/dev/null
  # later phases (bench, decode, serve) run on the configs just tuned
  [ "$phase" = tune ] && [ -d "$OUT/configs" ] && export TRITUNE_CONFIGS="$OUT/configs"
done
set +m
# The device returns at most 8 files: everything goes back in one archive.
echo "=== done ($(date -u +%T))"
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz bundle.tgz)
