#!/usr/bin/env bash
# One device call for the wgmma rung (issue 13 req 1's stretch): the building blocks' gpu tests
# (tests/test_wgmma.py: the Q K^T and P V tile products against NumPy), then the standalone
# attention forward (bench/wgmma_attention.py: its own check against SDPA, then B4 L4096 H32
# D128 against SDPA flash and cuDNN), if the tests pass.
#   OUT=$OUT [WGMMA_ARGS=--ablations] bash bench/session_wgmma.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
timeout "${TEST_S:-240}" python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_wgmma.py \
  >"$OUT/r/gpu_wgmma.log" 2>&1 || status=1
echo "wgmma tests: $(grep -c PASSED "$OUT/r/gpu_wgmma.log") passed, $(grep -c FAILED \
  "$OUT/r/gpu_wgmma.log") failed ($((SECONDS - t0)) s)"
grep -h "FAILED\|Error\|error" "$OUT/r/gpu_wgmma.log" | head -12
if [ "$status" = 0 ] || [ -n "${FORCE:-}" ]; then
  # shellcheck disable=SC2086  # WGMMA_ARGS: options, split on purpose
  timeout "${BENCH_S:-300}" python3 bench/wgmma_attention.py \
    --out "$OUT/r/wgmma_attention.json" ${WGMMA_ARGS:-} >"$OUT/r/wgmma_attention.log" 2>&1 \
    || status=1
  grep -v -i warn "$OUT/r/wgmma_attention.log" | tail -40
fi
KEEP_R=1 session_end
