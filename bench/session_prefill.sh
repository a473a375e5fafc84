#!/usr/bin/env bash
# One device call for a tensor-core prefill change: its gpu tests, then the tile-config A/B of
# bench/prefill.py --kv-tiles and the cascade's timeline under the same configs, logs and JSON
# packed into two archives (the device returns only a few files).
#   [MEMCHECK=1] bash bench/session_prefill.sh 64,32x3,32x4
# MEMCHECK=1 runs bench/memcheck.sh (memcheck, racecheck, planted control) beside the tests and
# waits for it before anything is timed. CACHE_BACK=1 returns the kernel cache as
# $OUT/cache.tgz (unpacked into the checkout, the next device call starts warm). FULL=1 runs,
# instead of the A/B, bench/cascade_sweep.py over the tile configs and bench/prefill.py's
# default JSON (the committed defaults; BUDGET_S=0 leaves it out; SWEEP_OVH=-,64 sweeps the
# planner's item cost too). NO_AB=1 leaves out the prefill A/B (the cascade's
# timeline under the tile configs still runs).
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
tiles=${1:-64,32x4}
if [ -n "${MEMCHECK:-}" ]; then
  (OUT=$OUT/r bash bench/memcheck.sh >"$OUT/r/memcheck_summary.txt" 2>&1) &
  m=$!
fi
if [ -n "${FULL:-}" ]; then  # compile the sweep's kernels beside the tests (timings unused)
  (python3 bench/cascade_sweep.py --tiles "$tiles" --splits 0 --overheads - >"$OUT/r/precompile.log" 2>&1) &
  pc=$!
fi
t() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
opt="64_key or deeper or merge_launch or eight_warps or kv_split"  # non-default kernel options
t tests/test_gpu_prefill.py -k "paged_prefill and not ($opt)" >"$OUT/r/gpu_p1.log" 2>&1 &
a=$!
t tests/test_gpu_prefill.py -k "$opt" >"$OUT/r/gpu_p2.log" 2>&1 &
b=$!
t tests/test_gpu_prefill.py -k "not paged_prefill" >"$OUT/r/gpu_p3.log" 2>&1 &
c=$!
t tests/test_gpu_trust.py tests/test_gpu_decode.py -k "trust or tensor_cores" >"$OUT/r/gpu_t.log" 2>&1 &
d=$!
for p in $a $b $c $d; do wait "$p" || status=1; done
for f in gpu_p1 gpu_p2 gpu_p3 gpu_t; do echo "$f: $(tail -1 "$OUT/r/$f.log")"; done
echo "gpu tests: $((SECONDS - t0)) s"
if [ -n "${MEMCHECK:-}" ]; then
  wait "$m" || status=1
  tail -5 "$OUT/r/memcheck_summary.txt"
  echo "memcheck done: $((SECONDS - t0)) s"
fi
[ -n "${pc:-}" ] && wait "$pc"  # nothing else on the GPU while timing
if [ $status = 0 ] && [ -n "${FULL:-}" ]; then
  # the defaults as committed: the cascade's merge and cost model A/B, then bench/prefill.py's
  # own JSON (shared prefix, causal and non-causal prefill with their anchors)
  python3 bench/cascade_sweep.py --tiles "$tiles" --splits 0 --overheads="${SWEEP_OVH:--}" \
    --out "$OUT/r/cascade_sweep.json" 2>&1 | grep -v Warn | tee "$OUT/r/sweep.log" || status=1
  left=$((${BUDGET_S:-570} - (SECONDS - t0)))  # stop in time to pack what ran
  if [ "$left" -gt 60 ]; then
    timeout "$left" python3 bench/prefill.py --out "$OUT/r/prefill.json" >"$OUT/r/prefill.log" \
      2>&1 || status=1
  else
    echo "bench/prefill.py skipped: $left s left" | tee "$OUT/r/prefill.log"
  fi
  grep -v Warn "$OUT/r/prefill.log" | tail -12
elif [ $status = 0 ]; then
  if [ -z "${NO_AB:-}" ]; then
    python3 bench/prefill.py --kv-tiles "$tiles" --out "$OUT/r/prefill_ab.json" >"$OUT/r/ab.log" \
      2>&1 || status=1
    tail -2 "$OUT/r/ab.log"
  fi
  python3 bench/cascade_timeline.py --kv-tiles "$tiles" --out "$OUT/r/cascade_timeline.json" \
    >"$OUT/r/timeline.log" 2>&1 || status=1
  tail -30 "$OUT/r/timeline.log"
else
  grep -h -E "FAILED|Error" "$OUT"/r/gpu_*.log | head -20
fi
session_end
