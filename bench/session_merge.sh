#!/usr/bin/env bash
# One device call for a change to the merge of split rows (kernels/fused_merge.py's merge_list,
# the split-merge launch): the cascade's timing first (bench/cascade_sweep.py on the default
# kernel, with plain decode in the same run, and the per-kernel timeline), then the gpu tests
# that run merges, in four processes, each cut off at TEST_S seconds (a cold cache compiles
# every kernel spec again). Logs and JSON in $OUT/results.tgz; CACHE_BACK=1 returns the cache.
#   TEST_S=330 CACHE_BACK=1 bash bench/session_merge.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
python3 bench/cascade_sweep.py --tiles 32s168m --splits 0 --overheads=- \
  --out "$OUT/r/cascade_sweep.json" >"$OUT/r/sweep.log" 2>&1 || status=1
grep -v Warn "$OUT/r/sweep.log" | tail -3
python3 bench/cascade_timeline.py --out "$OUT/r/cascade_timeline.json" >"$OUT/r/timeline.log" \
  2>&1 || status=1
grep -v -i warn "$OUT/r/timeline.log" | head -9
echo "benchmarks: $((SECONDS - t0)) s"
t() { timeout "${TEST_S:-330}" python3 -m pytest -v -m gpu -p no:cacheprovider "$@"; }
t tests/test_gpu_prefill.py -k "cascade or merge_launch or kv_split" >"$OUT/r/gpu_m1.log" 2>&1 &
a=$!
t tests/test_gpu_prefill.py -k "paged_prefill_gpu and not (64_key or deeper or eight_warps or \
kv_split or merge_launch or q_shared)" >"$OUT/r/gpu_m2.log" 2>&1 &
b=$!
t tests/test_gpu_decode.py >"$OUT/r/gpu_m3.log" 2>&1 &
c=$!
t tests/test_gpu_trust.py tests/test_gpu_scheduler.py >"$OUT/r/gpu_m4.log" 2>&1 &
d=$!
for p in $a $b $c $d; do wait "$p" || status=1; done  # a failure or a cut-off (124)
for f in gpu_m1 gpu_m2 gpu_m3 gpu_m4; do
  echo "$f: $(grep -c PASSED "$OUT/r/$f.log") passed, $(grep -c FAILED "$OUT/r/$f.log") failed;" \
    "$(tail -1 "$OUT/r/$f.log" | cut -c1-90)"
done
grep -h "FAILED" "$OUT"/r/gpu_m*.log | head -10
session_end
