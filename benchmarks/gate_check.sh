#!/usr/bin/env bash
# The regression gate (`tritune bench KERNEL --compare BASELINE`, harness/regress.py) checked on a GPU, from
# the repository root:
#   OUT=/some/dir bash benchmarks/gate_check.sh       # KERNEL=gemv P="M=1,N=3072,..." DTYPE=bf16 ROUNDS=5
# (a) baseline: `tritune bench $KERNEL --problems "$P" --dtype $DTYPE --no-peers --results-dir $OUT/base`;
# (b) `tritune bench $KERNEL --compare $OUT/base/<slug>/$KERNEL.json` twice on the unchanged tree: both must
#     exit 0 (no false alarm);
# (c) a deliberately slowed kernel: a copy of the packaged store ($OUT/slow) where the entry of P's bucket
#     holds a much worse config (gemv: BLOCK_M 1, BLOCK_N 16, BLOCK_K 16, SPLIT_K 1, 1 warp, 1 stage;
#     SLOW_CONFIG='{"BLOCK_N": ...}' for another; other kernels: the valid point with the fewest warps and
#     smallest tiles), checked against the spec's space and stamped with the kernel's current code hash, and
#     checked to be what today's lookup returns under TRITUNE_CONFIGS=$OUT/slow; then that --compare must exit
#     1 and flag the row SLOWER. The gate re-times the baseline row's recorded config against today's lookup
#     (spec.config_for), so the slowdown must be in the store that lookup reads, as here.
# Every step runs with an empty user store (TRITUNE_CONFIG_DIR=$OUT/user-store: a user store's entry would
# override the store under test) and tuning on a miss off. The store under test: $TRITUNE_CONFIGS where set,
# else tuning/configs. Installs the wheels carried in .whl/ and tritune editable first (INSTALL=0 skips it).
# Under $OUT: a.log, b1.log, b2.log, c.log (each command's output), base/, slow/, gate.txt (one line:
# PASS/FAIL/SKIP of each check) and results/<slug>/regression_gate.json (keyed rows, benchmarks/rows.py;
# RESULTS=dir for another root). Exit 0 when all three pass, 1 when one fails, 3 when none failed but some
# were skipped (no CUDA GPU: --compare refuses the interpreter with exit 2; on a CPU use a small P, e.g.
# P="M=1,N=96,K=80,bias=True,act=gelu_tanh,ln=True", to check the plumbing).
set -uo pipefail
: "${OUT:?OUT must be set (the folder the results go to)}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
export TRITUNE_COMMIT=${TRITUNE_COMMIT:-$(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)}
if [ "${INSTALL:-1}" != 0 ]; then
  . benchmarks/install_wheels.sh
  install_wheels "$OUT/install.log" && install_tree "$OUT/install.log" . || exit 1
fi
KERNEL=${KERNEL:-gemv}
P=${P:-M=1,N=3072,K=768,bias=True,act=gelu_tanh,ln=True}
DTYPE=${DTYPE:-bf16}
ROUNDS=${ROUNDS:-5}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
RESULTS=${RESULTS:-$OUT/results}
STORE=$(cd "${TRITUNE_CONFIGS:-tuning/configs}" && pwd) || { echo "no store at ${TRITUNE_CONFIGS:-tuning/configs}"; exit 1; }
export TRITUNE_CONFIGS=$STORE TRITUNE_CONFIG_DIR=$OUT/user-store
unset TRITUNE_TUNE_ON_MISS
rm -rf "$OUT/user-store" "$OUT/base" "$OUT/slow" "$OUT/c-store.json"
mkdir -p "$OUT/user-store"
read -r SLUG GPU < <(python -c 'from tritune.kernels.runtime import device as d; d.setup_interpreter(); print(d.gpu_slug(), 0 if d.interpreted() else 1)')
echo "commit $TRITUNE_COMMIT, GPU slug $SLUG, $KERNEL [$P] $DTYPE, store $STORE"
[ "$GPU" = 1 ] || echo "note: no CUDA GPU: (a) runs on the interpreter; --compare refuses it, so (b) and (c) can only be SKIP"
BASE=$OUT/base/$SLUG/$KERNEL.json

status_of() {  # rc, wanted rc, log, [pattern the log must hold] -> PASS / FAIL / SKIP
  if [ "$1" = 2 ] && [ "$GPU" != 1 ] && grep -q "needs a CUDA GPU" "$3"; then echo SKIP
  elif [ "$1" = "$2" ] && { [ -z "${4:-}" ] || grep -q "$4" "$3"; }; then echo PASS
  else echo FAIL; fi
}

echo "== (a) baseline"
timeout "$STEP_TIMEOUT" tritune bench "$KERNEL" --problems "$P" --dtype "$DTYPE" --no-peers --results-dir "$OUT/base" \
  >"$OUT/a.log" 2>&1
RC_A=$?
tail -8 "$OUT/a.log"
A=$(status_of "$RC_A" 0 "$OUT/a.log")
python - "$BASE" <<'EOF' || A=FAIL
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
assert len(rows) == 1 and rows[0].get("config") and rows[0].get("correct"), f"baseline rows: {rows}"
print(f"baseline row: {rows[0]['problem']} {rows[0]['dtype']} config {rows[0]['config']} ours_us {rows[0].get('ours_us')}")
EOF
echo "(a) baseline: $A (exit $RC_A)"

B=PASS; RC_B=""
for i in 1 2; do
  echo "== (b) --compare on the unchanged tree, run $i"
  timeout "$STEP_TIMEOUT" tritune bench "$KERNEL" --compare "$BASE" --dtype "$DTYPE" --rounds "$ROUNDS" >"$OUT/b$i.log" 2>&1
  rc=$?; RC_B="$RC_B $rc"
  tail -6 "$OUT/b$i.log"
  s=$(status_of "$rc" 0 "$OUT/b$i.log")
  [ "$s" = PASS ] || { [ "$B" = FAIL ] || B=$s; }
done
echo "(b) no false alarm: $B (exits$RC_B)"

echo "== (c) a deliberately slowed store: $OUT/slow"
cp -r "$STORE" "$OUT/slow"
python - "$KERNEL" "$P" "$DTYPE" "$OUT/slow" "$BASE" "${SLOW_CONFIG:-}" >"$OUT/c-store.log" 2>&1 <<'EOF'
import json, os, sys
from tritune.kernels.runtime import device as dev
dev.setup_interpreter()
import tritune.kernels as K
from tritune.harness.cli.tune import parse_problems
from tritune.kernels.runtime import store
from tritune.kernels.runtime.args import parse_dtype

kernel, text, dt, slow_root, base_file, slow_env = sys.argv[1:]
spec = K.get(kernel)
(problem,) = parse_problems(spec, text)
dtype = parse_dtype(dt)
bucket, key = K.bucket_key(spec.bucket(problem)), K.store_dtype(dtype)
if slow_env:
    slow = json.loads(slow_env)
elif kernel == "gemv":
    slow = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 1, "num_warps": 1, "num_stages": 1}
else:   # the fewest warps, then the smallest tiles: a valid point, most likely a slow one
    def size(c):
        return (c.get("num_warps", 0), sum(v for k, v in c.items() if k.startswith("BLOCK") and isinstance(v, int)))
    slow = min(spec.space.points(problem, dtype), key=size)
why = spec.space.why_invalid(slow, problem, dtype)
assert why is None, f"slow config {slow} is no valid point for {problem}: {why}"
base = json.load(open(base_file))["rows"][0]["config"] if os.path.isfile(base_file) else None
assert slow != base, f"slow config {slow} is the baseline's own"
old = [e for e in store.read(store.path_for(spec, root=slow_root), kernel) if e["bucket"] == bucket
       and e["dtype"] == key] if store.path_for(spec, root=slow_root).is_file() else []
entry = {**(old[0] if old else {"bucket": bucket, "dtype": key}), "config": slow,
         "source": store.source_hash(spec), "note": "gate_check.sh: deliberately slow"}
store.write(spec, [entry], root=slow_root)
os.environ["TRITUNE_CONFIGS"] = slow_root
store.clear_cache()
now = spec.config_for(problem, dtype)
assert now == slow, f"today's lookup under the slowed store gives {now}, not {slow}"
print(f"bucket {bucket} {key}: stored {old[0]['config'] if old else None} -> {slow}; baseline {base}; "
      f"today's lookup under TRITUNE_CONFIGS={slow_root}: {now}")
json.dump({"bucket": bucket, "dtype_key": key, "stored_config": old[0]["config"] if old else None,
           "slow_config": slow}, open(os.path.join(os.path.dirname(slow_root), "c-store.json"), "w"))
EOF
RC_STORE=$?
cat "$OUT/c-store.log"
if [ "$RC_STORE" = 0 ]; then
  TRITUNE_CONFIGS=$OUT/slow timeout "$STEP_TIMEOUT" tritune bench "$KERNEL" --compare "$BASE" --dtype "$DTYPE" \
    --rounds "$ROUNDS" >"$OUT/c.log" 2>&1
  RC_C=$?
  tail -8 "$OUT/c.log"
  C=$(status_of "$RC_C" 1 "$OUT/c.log" SLOWER)
else
  RC_C="store not made"; C=FAIL
fi
echo "(c) slowed store flagged: $C (exit $RC_C)"

LINE="gate $KERNEL [$P] $DTYPE on $SLUG at $TRITUNE_COMMIT: (a) baseline $A; (b) unchanged x2 $B (exits$RC_B); (c) slowed $C (exit $RC_C)"
echo "$LINE" | tee "$OUT/gate.txt"
python - "$RESULTS" "$KERNEL" "$P" "$DTYPE" "$OUT" "$BASE" "$A" "$B" "$C" "$LINE" <<'EOF' || echo "rows not written"
import json, re, sys
sys.path.insert(0, "benchmarks")
from rows import write_rows

results, kernel, problem, dtype, out, base, a, b, c, line = sys.argv[1:]
NUM = r"(\d+(?:\.\d+)?)"
VERDICT = re.compile(rf"{NUM}\s+{NUM}\s+{NUM}x\s+±{NUM}%\s+(same|changed)")


def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return {}


def parsed(log):   # the last verdict line of a --compare log: baseline us, now us, now/base, noise, config
    try:
        found = VERDICT.findall(open(f"{out}/{log}").read())
    except OSError:
        found = []
    if not found:
        return {}
    base_us, now_us, ratio, noise, same = found[-1]
    return {"baseline_us": float(base_us), "now_us": float(now_us), "ratio": float(ratio),
            "noise_pct": float(noise), "config_vs_baseline": same}


row = (load(base).get("rows") or [{}])[0]
key = {"kernel": kernel, "problem": problem, "dtype": dtype}
rows = [{**key, "check": "baseline", "status": a, "config": row.get("config"), "ours_us": row.get("ours_us")}]
rows += [{**key, "check": f"unchanged_{i}", "status": b, **parsed(f"b{i}.log")} for i in (1, 2)]
rows += [{**key, "check": "slowed", "status": c, **load(f"{out}/c-store.json"), **parsed("c.log")}]
print("wrote", write_rows("regression_gate", rows, results, command="benchmarks/gate_check.sh", summary=line))
EOF
case "$A$B$C" in
  PASSPASSPASS) exit 0 ;;
  *FAIL*) exit 1 ;;
  *) exit 3 ;;
esac
