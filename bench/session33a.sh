#!/usr/bin/env bash
# Session 33's first device call: the whole gpu check on the landed main (every gpu test,
# decode against cuDNN, req 1's prefill rows and the cascade, decode on an fp8 cache), then the
# engine's gpu tests once more under bench/capture_probe.py (no collection inside a capture
# after defer_frees' thread-safe count) and one round of its script (on the tests' helpers
# now), then, on an H200 with time left, req 1's other rows.
#   KEEP_R=1 bash bench/session33a.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
# (an H100 skips fp8 unless CHECKS says: its figure there is known, 1.85x, session 28)
checks=${CHECKS:-prefill fp8}
[ "$tag" = h200 ] || checks=${CHECKS:-prefill}
# shellcheck disable=SC2086
OUT="$OUT/r" SUITE_S=${SUITE_S:-240} bash bench/gpu_check.sh $checks || status=1
echo "gpu check: $((SECONDS - t0)) s"
PYTHONPATH="$PWD/bench:$PWD${PYTHONPATH:+:$PYTHONPATH}" CAPTURE_PROBE_OUT="$OUT/r/probe_engine.json" \
  timeout 120 python3 -P -m pytest -q -m gpu -p no:cacheprovider -p capture_probe \
  tests/test_engine_gpu.py >"$OUT/r/engine_probe.log" 2>&1 || status=1
grep -E "passed|failed|capture probe|^collection in" "$OUT/r/engine_probe.log" | tail -4 | cut -c1-250
timeout 90 python3 bench/capture_probe.py --rounds 1 --out "$OUT/r/capture_probe_$tag.json" \
  >"$OUT/r/probe.log" 2>&1 || status=1
grep -v -i warn "$OUT/r/probe.log" | tail -3 | cut -c1-250
echo "probe: $((SECONDS - t0)) s"
if [ "$tag" = h200 ] && [ $((SECONDS - t0)) -lt 400 ]; then
  GRID=1 session_prefill_grid 32 s33 || true
fi
session_end
