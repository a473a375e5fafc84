#!/usr/bin/env bash
# The host-cost check of a change in one device call: the gpu tests that drive the decode
# wrapper's plan/run path (decode, state/append, CUDA-graph scheduler, trust, cache; three
# pytest processes), then bench/host.py (plan() per batch size, run() at batch 1, with
# cProfile listings) and bench/launch_cost.py, alone on the machine. Few files come back.
#   bash bench/host_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
mkdir -p "$OUT"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
export NBINFER_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}
# bytecode for the carried wheels and nbinfer (bench/session_lib.sh says why)
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
bytecode_ready
run() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
t0=$(date +%s)
run tests/test_gpu_decode.py tests/test_api_state.py tests/test_api_append.py >"$OUT/gpu_decode.log" 2>&1 &
a=$!
run tests/test_gpu_scheduler.py tests/test_gpu_trust.py >"$OUT/gpu_sched_trust.log" 2>&1 &
b=$!
run tests/test_gpu_cache.py >"$OUT/gpu_cache.log" 2>&1 &
c=$!
status=0
for p in $a $b $c; do wait "$p" || status=1; done
echo "gpu tests: $(( $(date +%s) - t0 )) s"
for f in gpu_decode gpu_sched_trust gpu_cache; do echo "$f: $(tail -1 "$OUT/$f.log")"; done
{ python3 bench/host.py --profile --out "$OUT/host_h200.json" &&
  python3 bench/launch_cost.py --out "$OUT/launch_cost.json"; } >"$OUT/host.log" 2>&1 || status=1
tail -80 "$OUT/host.log"
exit $status
