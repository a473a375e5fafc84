#!/usr/bin/env bash
# The whole GPU check of a change in one device call: every gpu test (pytest-xdist's workers, or
# seven pytest processes, so the kernel specs compile on many cores at once), then the decode
# benchmark alone on the GPU (nothing else running while it times), then the optional benchmarks
# named, each alone too. JSON goes to $OUT, the logs into $OUT/logs.tgz.
#   [SKIP_DECODE=1] [CACHE_BACK=1] [SUITE_S=540] [WORKERS=12] [REPEAT=1] \
#     bash bench/gpu_check.sh [prefill] [grid] [order] [sched] [host] [fp8]
# SUITE_S bounds each pass of the tests (seconds; none by default), so a cold-cache run that
# would outlast the device call still ends, packs its logs and returns the cache it built;
# REPEAT=1 runs the tests a second time on the cache the first pass left (cold, then warm).
# CACHE_BACK=1 also returns the kernel cache as $OUT/cache.tgz (a few MiB): unpacked into the
# checkout, it lets the next session's first device call start warm instead of compiling.
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
mkdir -p "$OUT"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
# The persistent kernel cache lives in the (git-ignored) checkout, so a later call on the same
# machine, or a later session that carries the folder, starts warm.
export NBINFER_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}
# bytecode for the carried wheels and nbinfer (bench/session_lib.sh says why)
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
bytecode_ready
# One pass of every gpu test. With pytest-xdist importable (bench/gpu_wheels.sh carries it in
# .whl/), one pytest over tests/ with WORKERS processes stealing work from each other (default
# 12 of the host's 16 cores: test_gpu_cache.py times child processes of its own against a
# bound of 1 s, which needs cores left free for them); a cold cache compiles on all of them
# until the last spec. Else (or WORKERS=0) seven processes by file group. Either way two
# processes that need one spec compile it once (the cache's lock); the other waits and loads
# it. $1 names the pass's logs.
suite() {
  local name=$1 workers=${WORKERS:-12} limit=() t0 t1 before after rc=0
  [ -n "${SUITE_S:-}" ] && limit=(timeout "$SUITE_S")
  before=$(ls "$NBINFER_CACHE_DIR/kernels" 2>/dev/null | grep -c '\.nbk$')
  t0=$(date +%s)
  if [ "$workers" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
    # (test_lessons.py has no gpu tests and imports nbformat, which the device image lacks)
    "${limit[@]}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=12 \
      -n "$workers" --dist worksteal --ignore=tests/test_lessons.py tests \
      >"$OUT/${name}-all.log" 2>&1 || rc=1
  else
    local pids=() p
    run() { "${limit[@]}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 "$@"; }
    run tests/test_gpu_decode.py tests/test_api_state.py tests/test_api_append.py \
      >"$OUT/${name}-a.log" 2>&1 & pids+=($!)
    run tests/test_gpu_prefill.py -k paged_prefill >"$OUT/${name}-b.log" 2>&1 & pids+=($!)
    run tests/test_gpu_prefill.py -k "not paged_prefill" >"$OUT/${name}-b2.log" 2>&1 & pids+=($!)
    run tests/test_gpu_scheduler.py tests/test_gpu_fp8.py tests/test_wgmma.py \
      >"$OUT/${name}-b3.log" 2>&1 & pids+=($!)
    run tests/test_gpu_trust.py tests/test_gpu_layers.py >"$OUT/${name}-c.log" 2>&1 & pids+=($!)
    # cold by design: fresh cache folders
    run tests/test_gpu_cache.py >"$OUT/${name}-d.log" 2>&1 & pids+=($!)
    run tests/test_engine_gpu.py >"$OUT/${name}-e.log" 2>&1 & pids+=($!)
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
  fi
  t1=$(date +%s)
  after=$(ls "$NBINFER_CACHE_DIR/kernels" 2>/dev/null | grep -c '\.nbk$')
  for f in "$OUT/${name}"-*.log; do echo "$(basename "$f" .log): $(tail -n 1 "$f")"; done
  echo "$name: $((t1 - t0)) s wall, cache entries $before -> $after" | tee -a "$OUT/gpu_time.log"
  return $rc
}
status=0
suite gpu || status=1
# REPEAT=1: the same pass again on the cache the first one left (a cold start's warm twin)
if [ -n "${REPEAT:-}" ]; then suite gpu_warm || status=1; fi
if [ -z "${SKIP_DECODE:-}" ]; then
  python3 bench/decode.py --out "$OUT/decode_h200.json" >"$OUT/decode.log" 2>&1 || status=1
fi
for extra in "$@"; do
  case $extra in
    prefill) python3 bench/prefill.py --out "$OUT/prefill_h200.json" >"$OUT/prefill.log" 2>&1 || status=1 ;;
    grid) python3 bench/prefill.py --grid --kv-tiles 32,64 --out "$OUT/prefill_grid_h200.json" >"$OUT/grid.log" 2>&1 || status=1 ;;
    order) python3 bench/order_probe.py --out "$OUT/order_probe_h200.json" >"$OUT/order.log" 2>&1 || status=1 ;;
    sched) python3 bench/scheduler.py --out "$OUT/scheduler_h200.json" >"$OUT/scheduler.log" 2>&1 || status=1 ;;
    fp8) python3 bench/decode.py --fp8 --out "$OUT/decode_fp8_h200.json" >"$OUT/fp8.log" 2>&1 || status=1 ;;
    host) { python3 bench/host.py --profile --out "$OUT/host_h200.json" &&
            python3 bench/launch_cost.py --out "$OUT/launch_cost.json"; } >"$OUT/host.log" 2>&1 || status=1 ;;
    *) echo "unknown benchmark: $extra (prefill, grid, order, sched, host, fp8)"; status=1 ;;
  esac
done
cat "$OUT/gpu_time.log"
for f in "$@"; do
  case $f in sched) tail -4 "$OUT/scheduler.log" ;; host) tail -32 "$OUT/host.log" ;;
    fp8) tail -8 "$OUT/fp8.log" ;; grid) tail -24 "$OUT/grid.log" ;; order) tail -3 "$OUT/order.log" ;;
    *) tail -4 "$OUT/$f.log" ;; esac 2>/dev/null
done
tail -6 "$OUT/decode.log" 2>/dev/null
# The device returns only a few files from $OUT: the logs travel as one archive, beside the
# JSON files (at most five), so that nothing is left behind.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
if [ -n "${CACHE_BACK:-}" ]; then
  tar czf "$OUT/cache.tgz" -C "$(dirname "$NBINFER_CACHE_DIR")" "$(basename "$NBINFER_CACHE_DIR")"
  echo "cache.tgz: $(du -h "$OUT/cache.tgz" | cut -f1)"
fi
exit $status
