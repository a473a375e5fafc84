#!/usr/bin/env bash
# Session 31's fourth device call: the Q stager without float64 index arithmetic (every
# tensor-core prefill kernel's source changed, so most of them compile here): the whole gpu
# suite, then the shared-prefix cascade (bench/cascade_levels_sweep.py at the planner's chunks:
# plain decode, the prefix level, level by level, one launch, under graph replay), the cascade's
# per-call figure and req 1's B4 L4096 rows (bench/prefill.py's default run).
#   KEEP_R=1 CACHE_BACK=1 [SUITE_S=300] bash bench/session31d.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${SUITE_S:-270}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 14 --dist worksteal \
  --ignore=tests/test_lessons.py tests >"$OUT/r/suite.log" 2>&1 || status=1
tail -3 "$OUT/r/suite.log" | cut -c1-250
echo "suite: $((SECONDS - t0)) s"
timeout 200 python3 bench/cascade_levels_sweep.py --splits 0 \
  --out "$OUT/r/cascade_levels_stager_$tag.json" >"$OUT/r/levels.log" 2>&1 || status=1
grep -v Warning "$OUT/r/levels.log" | tail -4 | cut -c1-200
timeout 200 python3 bench/prefill.py --out "$OUT/r/prefill_stager_$tag.json" \
  >"$OUT/r/prefill.log" 2>&1 || status=1
grep -E "prefill B4|cascade|TFLOP|shared" "$OUT/r/prefill.log" | cut -c1-250
echo "bench: $((SECONDS - t0)) s"
session_end
