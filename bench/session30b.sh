#!/usr/bin/env bash
# Session 30's device call 5: the lean prefill with K and V in the 128-byte swizzled layout
# (LEAN_SWIZZLE, now the api's default on the GPU): its gpu tests (every lean form swizzled,
# and "canonical" for the old layout) with the TMA / mbarrier / wgmma building blocks; then
# bench/prefill.py's A/B at B4 L4096 H32 D128 fp16 causal and not (64w8glqo16, the old
# default, against 64w8glqyo16) and, with GRID=1, req 1's other rows with both tokens.
#   KEEP_R=1 [GRID=1] bash bench/session30b.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 \
  --dist worksteal tests/test_gpu_prefill.py -k "wgmma or lean or dependent" tests/test_wgmma.py \
  tests/test_tma.py tests/test_mbarrier.py >"$OUT/r/tests.log" 2>&1 || status=1
grep -E "passed|failed|error" "$OUT/r/tests.log" | tail -12 | cut -c1-250
echo "tests: $((SECONDS - t0)) s"
timeout 200 python3 bench/prefill.py --kv-tiles 64w8glqo16,64w8glqyo16 \
  --out "$OUT/r/swizzle_$tag.json" >"$OUT/r/ab.log" 2>&1 || status=1
grep -E "prefill B4|cascade|TFLOP" "$OUT/r/ab.log" | cut -c1-250
echo "a/b: $((SECONDS - t0)) s"
session_prefill_grid 64w8glqo16,64w8glqyo16 swizzle
session_end
