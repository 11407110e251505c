#!/usr/bin/env bash
# Two trees measured side by side on one GPU, in one call: the checkout (after) and an earlier one copied to
# .before/ (e.g. `git archive <commit> | tar -x -C .before`; ignored by git, carried to the GPU machine).
# Rounds alternate the trees (GPT-2 small batch-1 decode tok/s, serve-bench output tok/s, each kernel's bench
# rows), so drift of the machine lands on both; benchmarks/compare_trees.py then puts each figure's
# medians over the rounds side by side.
#   OUT=/dir bash benchmarks/before_after.sh   # ROUNDS=2 STEPS="decode serve bench" KERNELS="gemm layer_norm"
# STEPS: the measurements to run (default all three; e.g. STEPS=bench for a call of bench rounds only).
# Under $OUT/<tree>/: decode-<round>, serve-<round>.json, bench-<round>/<slug>/<kernel>.json, logs;
# $OUT/compare.txt and compare.json.
set -uo pipefail
: "${OUT:?OUT must be set}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
. benchmarks/install_wheels.sh
install_wheels "$OUT/wheels.log" || exit 1
root=$(pwd)
use() {  # install a tree editable
  install_tree "$OUT/$2/install.log" "$1"
}
# the decode benchmark and where it writes: benchmarks/ (--results DIR) or, in trees before it moved there,
# scripts/ (--out FILE)
decode_cmd() {
  if [ -f "$1/benchmarks/bench_decode.py" ]; then echo "$1/benchmarks/bench_decode.py --results $2"
  else echo "$1/scripts/bench_decode.py --out $2.json"; fi
}
mkdir -p "$OUT/before" "$OUT/after"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for t in before after; do
    dir=$root; [ "$t" = before ] && dir=$root/.before
    use "$dir" "$t" || exit 1
    echo "== round $r: $t ($(cd "$dir" && cat .commit 2>/dev/null || echo checkout))"
    steps=" ${STEPS:-decode serve bench} "
    # shellcheck disable=SC2046  (the script and its output flag)
    [[ $steps == *" decode "* ]] && (cd "$dir" && timeout "${DECODE_TIMEOUT:-150}" python $(decode_cmd "$dir" \
        "$OUT/$t/decode-$r") --methods engine,triton-graph --new 128 --reps 3 2>&1 | tail -8)
    [[ $steps == *" serve "* ]] && (cd "$dir" && timeout "${SERVE_TIMEOUT:-200}" tritune serve-bench -n "${SERVE_N:-512}" \
        --modes triton-graphs --hf-requests -1 --naive-requests 0 --out "$OUT/$t/serve-$r.json" -q 2>&1 | tail -6)
    # shellcheck disable=SC2086  (KERNELS: several names)
    [[ $steps == *" bench "* ]] && (cd "$dir" && timeout "${BENCH_BUDGET:-240}" tritune bench ${KERNELS:-} --dtype bf16 \
        --no-peers --results-dir "$OUT/$t/bench-$r" >"$OUT/$t/bench-$r.log" 2>&1; tail -3 "$OUT/$t/bench-$r.log")
  done
done
use "$root" after
python "$root/benchmarks/compare_trees.py" "$OUT" | tee "$OUT/compare.txt"
