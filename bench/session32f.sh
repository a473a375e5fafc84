#!/usr/bin/env bash
# Session 32's check of its last edits on a GPU: the layer ops' and engine's gpu tests with
# defer_frees' thread-safe count (the engine's under bench/capture_probe.py as a pytest plugin:
# no collection inside a capture), then one round of the probe as a script and of
# bench/l2_window_probe.py after the review's fixes to both.
#   KEEP_R=1 bash bench/session32f.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_defer_frees.py \
  >"$OUT/r/defer_frees.log" 2>&1 || status=1
tail -1 "$OUT/r/defer_frees.log"
PYTHONPATH="$PWD/bench:$PWD${PYTHONPATH:+:$PYTHONPATH}" CAPTURE_PROBE_OUT="$OUT/r/probe_tests.json" \
  timeout 300 python3 -P -m pytest -q -m gpu -p no:cacheprovider -p capture_probe \
  tests/test_gpu_layers.py tests/test_engine_gpu.py >"$OUT/r/tests.log" 2>&1 || status=1
grep -E "passed|failed|capture probe|^capture [0-9]" "$OUT/r/tests.log" | tail -6 | cut -c1-250
echo "tests: $((SECONDS - t0)) s"
timeout 120 python3 bench/capture_probe.py --rounds 2 --out "$OUT/r/capture_probe_$tag.json" \
  >"$OUT/r/probe.log" 2>&1 || status=1
grep -v -i warn "$OUT/r/probe.log" | tail -4 | cut -c1-250
timeout 150 python3 bench/l2_window_probe.py --rounds 1 --out "$OUT/r/l2_window_$tag.json" \
  >"$OUT/r/l2.log" 2>&1 || status=1
grep -v -i warn "$OUT/r/l2.log" | tail -5 | cut -c1-250
echo "probes: $((SECONDS - t0)) s"
session_end
