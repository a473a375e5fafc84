#!/usr/bin/env bash
# The whole GPU check of a change in one device call: every gpu test (three pytest processes in
# parallel, so the kernel specs compile on three cores at once), then the decode benchmark alone
# on the GPU (nothing else running while it times), then the optional benchmarks named, each
# alone too. Logs and JSON go to $OUT.
#   bash bench/gpu_check.sh [prefill] [sched]
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
mkdir -p "$OUT"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
run() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
run tests/test_gpu_decode.py tests/test_api_state.py tests/test_api_append.py >"$OUT/gpu_a.log" 2>&1 &
a=$!
run tests/test_gpu_prefill.py tests/test_gpu_scheduler.py >"$OUT/gpu_b.log" 2>&1 &
b=$!
run tests/test_gpu_trust.py >"$OUT/gpu_c.log" 2>&1 &
c=$!
status=0
for p in $a $b $c; do wait "$p" || status=1; done
python3 bench/decode.py --out "$OUT/decode_h200.json" >"$OUT/decode.log" 2>&1 || status=1
for extra in "$@"; do
  case $extra in
    prefill) python3 bench/prefill.py --out "$OUT/prefill_h200.json" >"$OUT/prefill.log" 2>&1 || status=1 ;;
    sched) python3 bench/scheduler.py --out "$OUT/scheduler_h200.json" >"$OUT/scheduler.log" 2>&1 || status=1 ;;
    *) echo "unknown benchmark: $extra (prefill, sched)"; status=1 ;;
  esac
done
for f in gpu_a gpu_b gpu_c; do echo "$f: $(tail -1 "$OUT/$f.log")"; done
for f in "$@"; do [ "$f" = sched ] && f=scheduler; tail -4 "$OUT/$f.log" 2>/dev/null; done
tail -6 "$OUT/decode.log"
exit $status
