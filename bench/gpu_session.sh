#!/usr/bin/env bash
# One H200 session: gpu tests, the kernel-variant sweep, the decode benchmark. Results go to $OUT.
#   bash bench/gpu_session.sh [tests|sweep|bench|host|sched|prefill|memcheck]...
#   (default: tests sweep bench)
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
mkdir -p "$OUT"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
steps=${*:-tests sweep bench}
for step in $steps; do
  case $step in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider --ignore=tests/test_lessons.py tests/ 2>&1 | tail -25 ;;
    sched) python3 bench/scheduler.py --out "$OUT/scheduler_h200.json" ;;
    sweep) python3 bench/decode_sweep.py --max-registers 0 160 128 112 --out "$OUT/sweep.json" ;;
    bench) python3 bench/decode.py --out "$OUT/decode_h200.json" ;;
    host) python3 bench/host_profile.py 2>&1 | head -60 ;;
    prefill) python3 bench/prefill.py --out "$OUT/prefill_h200.json" ;;
    memcheck) bash bench/memcheck.sh ;;
  esac
done
