#!/usr/bin/env bash
# Nsight Compute on a few kernels (GPU machine with hardware counters): reports land in $OUT as text.
set -uo pipefail
: "${OUT:?}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit 1
python -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
run() {  # label kernel-regex target [skip]
  timeout 150 "$NCU" --clock-control none --set full -k "regex:$2" --launch-skip "${4:-3}" --launch-count 1 \
    python lab/drivers/ncu_target.py "$3" > "$OUT/ncu_$1.txt" 2>&1
  echo "--- $1 rc=$?"; grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|L2 Hit|Compute \(SM\) Throughput|Waves Per SM|Shared Memory Configuration Size|Dynamic Shared" "$OUT/ncu_$1.txt" | head -20
}
# NCU_TARGETS: which to run (default the four kernels; "fused": the fused decode step, with its per-line
# stall sampling exported as CSV: which loads its warps wait on)
for t in ${NCU_TARGETS:-int4 int8 paged gemm64}; do case $t in
  int4) run int4 _qmm_dot int4 ;;
  int8) run int8 _qmm_gemv int8 ;;
  paged) run paged _paged_attention_fwd paged ;;
  gemm64) run gemm64 _gemm gemm64 ;;
  fused) timeout 200 "$NCU" --clock-control none --set full --import-source yes -k regex:_fused_decode_kernel \
           --launch-skip 3 --launch-count 1 -o "$OUT/ncu_fused" python lab/drivers/ncu_target.py fused > "$OUT/ncu_fused.log" 2>&1
         echo "--- fused rc=$?"
         "$NCU" --import "$OUT/ncu_fused.ncu-rep" --print-details all > "$OUT/ncu_fused.txt" 2>&1
         "$NCU" --import "$OUT/ncu_fused.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_fused_source.csv" 2>&1
         grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Stall" "$OUT/ncu_fused.txt" | head -20 ;;
esac; done
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz bundle.tgz)
