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
run int4 _qmm_dot int4
run int8 _qmm_gemv int8
run paged _paged_attention_fwd paged
run gemm64 _gemm gemm64
(cd "$OUT" && tar czf /tmp/bundle.tgz . && find . -mindepth 1 -delete && mv /tmp/bundle.tgz bundle.tgz)
