#!/usr/bin/env bash
# The tensor-core prefill's KV tile A/B and its Nsight Compute profile, in one device call:
#   bash bench/prefill_ab.sh [32,64,32s168]
# The prefill gpu tests first (every tile size's kernels compiled and checked against the
# float64 reference before anything is timed), then bench/prefill.py --kv-tiles (JSON in
# $OUT/prefill_kv_tile_ab.json), then one ncu report per tile size ($OUT/ncu_prefill_kv<N>.txt).
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
mkdir -p "$OUT"
tiles=${1:-32,64,32s168}
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
export NBINFER_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}
status=0
# two processes, so that the two tile sizes' kernels compile at once
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_prefill.py \
  -k "paged_prefill and not 64_key" >"$OUT/gpu_prefill.log" 2>&1 &
a=$!
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_prefill.py -k "64_key" \
  >"$OUT/gpu_prefill64.log" 2>&1 || status=1
wait $a || status=1
tail -1 "$OUT/gpu_prefill.log" "$OUT/gpu_prefill64.log"
[ $status = 0 ] || { tail -30 "$OUT/gpu_prefill.log" "$OUT/gpu_prefill64.log"; exit 1; }
python3 bench/prefill.py --kv-tiles "$tiles" --out "$OUT/prefill_kv_tile_ab.json" || status=1
if command -v ncu >/dev/null; then
  for t in ${tiles//,/ }; do
    ncu --clock-control none -k regex:prefill_mma -c 1 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section SourceCounters \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      python3 bench/profile_prefill.py --kv-tile "$t" >"$OUT/ncu_prefill_kv$t.txt" 2>&1 || status=1
    grep -E "Duration|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occ|issue_stalled_" \
      "$OUT/ncu_prefill_kv$t.txt" | awk -v t="$t" '$NF+0 > 0.05 || !/issue_stalled/ {print "kv" t " " $0}' | head -30
  done
fi
exit $status
