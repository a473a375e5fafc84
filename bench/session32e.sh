#!/usr/bin/env bash
# Session 32's last device call: the whole gpu check on the session's last source
# (bench/gpu_check.sh: every gpu test, decode against cuDNN, and the prefill rows of issue 13
# req 1 and the cascade's), then the engine's gpu tests SAVEALL_RUNS times with the last
# revision's nbinfer (.ab_old, before defer_frees switched the collector off) under
# bench/capture_probe.py with CAPTURE_PROBE_SAVEALL=1: what a collection inside a capture finds.
#   rm -rf .ab_old && mkdir .ab_old && git archive 1fc473d | tar -x -C .ab_old  # carry it
#   KEEP_R=1 bash bench/session32e.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
OUT="$OUT/r" SUITE_S=${SUITE_S:-300} bash bench/gpu_check.sh ${CHECKS:-prefill} || status=1
echo "gpu check: $((SECONDS - t0)) s"
for run in $(seq "${SAVEALL_RUNS:-2}"); do
  # (python3 -P: `python -m` would put the working tree first on sys.path)
  PYTHONPATH="$PWD/.ab_old:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" CAPTURE_PROBE_SAVEALL=1 \
    CAPTURE_PROBE_OUT="$OUT/r/engine_saveall_$run.json" timeout 150 \
    python3 -P -m pytest -q -m gpu -p no:cacheprovider -p capture_probe tests/test_engine_gpu.py \
    >"$OUT/r/engine_saveall_$run.log" 2>&1 || true  # (the old tree may fail: that is the point)
  echo "== engine, old tree, SAVEALL, run $run"
  grep -E "passed|failed|capture probe|^capture [0-9]|^collection in" \
    "$OUT/r/engine_saveall_$run.log" | tail -8 | cut -c1-400
done
echo "probe: $((SECONDS - t0)) s"
session_end
