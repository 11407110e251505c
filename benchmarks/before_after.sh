#!/usr/bin/env bash
# Two trees measured side by side on one GPU, in one call: the checkout (after) and an earlier one copied to
# .before/ (e.g. `git archive <commit> | tar -x -C .before`; ignored by git, carried to the GPU machine).
# Rounds alternate the trees for the end-to-end figures (GPT-2 small batch-1 decode tok/s, serve-bench
# output tok/s), so drift of the machine lands on both; each kernel's bench rows once per tree.
#   OUT=/dir bash benchmarks/before_after.sh          # ROUNDS=2 KERNELS="gemm layer_norm" SERVE_N=512
# Under $OUT/<tree>/: bench/<slug>/<kernel>.json, decode-<round>.json, serve-<round>.json, logs.
set -uo pipefail
: "${OUT:?OUT must be set}"
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/wheels.log" 2>&1 || { cat "$OUT/wheels.log"; exit 1; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
root=$(pwd)
use() {  # install a tree editable; echo its decode script
  (cd "$1" && python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/$2/install.log" 2>&1) \
    || { cat "$OUT/$2/install.log"; return 1; }
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
    # shellcheck disable=SC2046  (the script and its output flag)
    (cd "$dir" && timeout "${DECODE_TIMEOUT:-150}" python $(decode_cmd "$dir" "$OUT/$t/decode-$r") --methods engine,triton-graph \
        --new 128 --reps 3 2>&1 | tail -8)
    (cd "$dir" && timeout "${SERVE_TIMEOUT:-200}" tritune serve-bench -n "${SERVE_N:-512}" --modes triton-graphs --hf-requests -1 \
        --naive-requests 0 --out "$OUT/$t/serve-$r.json" -q 2>&1 | tail -6)
    if [ "$r" = 1 ]; then
      (cd "$dir" && timeout "${BENCH_BUDGET:-240}" tritune bench ${KERNELS:-} --dtype bf16 --no-peers \
          --results-dir "$OUT/$t/bench" >"$OUT/$t/bench.log" 2>&1; tail -3 "$OUT/$t/bench.log")
    fi
  done
done
use "$root" after
