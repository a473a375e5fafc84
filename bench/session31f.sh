#!/usr/bin/env bash
# Session 31's device call for the tensor-core kernel's per-item overlap (MMA_PREFETCH): the
# tensor-core prefill and cascade gpu tests (the new "prefetch" cascade cases: bitwise the
# launch without it), then the one-launch cascade with and without it, alternated
# (bench/cascade_sweep.py --tiles 32s168m,32s168mp --rounds 2), and bench/prefill.py's row.
#   KEEP_R=1 bash bench/session31f.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 14 --dist worksteal \
  tests/test_gpu_prefill.py -k "cascade or dependent or paged_prefill" >"$OUT/r/tests.log" 2>&1 \
  || status=1
tail -3 "$OUT/r/tests.log" | cut -c1-250
echo "tests: $((SECONDS - t0)) s"
timeout 200 python3 bench/cascade_sweep.py --tiles 32s168m,32s168mp --splits 0 --overheads=- \
  --pdl 1 --rounds 2 --out "$OUT/r/cascade_sweep_prefetch_$tag.json" >"$OUT/r/sweep.log" 2>&1 \
  || status=1
grep -v Warning "$OUT/r/sweep.log" | tail -6 | cut -c1-200
echo "sweep: $((SECONDS - t0)) s"
session_end
