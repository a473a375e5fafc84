#!/usr/bin/env bash
# Session 32's third device call: the engine's gpu tests under bench/capture_probe.py as a
# pytest plugin, RUNS times with the working tree (nbinfer.defer_frees now keeps the cyclic
# collector off during a capture), then SAVEALL_RUNS times with the old tree's nbinfer and
# CAPTURE_PROBE_SAVEALL=1 (what a collection during a capture finds, by type).
#   (carry .ab_old too)
#   KEEP_R=1 bash bench/session32c.sh
# (python3 -P: `python -m` puts the working directory first on sys.path, which imports the
# working tree's nbinfer whatever PYTHONPATH says. Call 3 ran this script without it, so its
# two "old" runs were the working tree's too: its results are engine_new_1..6.)
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
engine_runs() {  # $1: side (new / old), $2: runs; extra environment from the caller
  local path=$PWD/bench:$PWD
  [ "$1" = old ] && path=$PWD/.ab_old:$PWD/bench
  for run in $(seq "$2"); do
    PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" \
      CAPTURE_PROBE_OUT="$OUT/r/engine_probe_$1_$run.json" timeout "${ENGINE_S:-150}" \
      python3 -P -m pytest -q -m gpu -p no:cacheprovider -p capture_probe tests/test_engine_gpu.py \
      >"$OUT/r/engine_$1_$run.log" 2>&1 || status=1
    echo "== engine, $1 tree, run $run"
    grep -E "passed|failed|capture probe|^capture [0-9]|^collection in" \
      "$OUT/r/engine_$1_$run.log" | tail -8 | cut -c1-300
  done
}
engine_runs new "${RUNS:-4}"
CAPTURE_PROBE_SAVEALL=1 engine_runs old "${SAVEALL_RUNS:-2}"
echo "engine: $((SECONDS - t0)) s"
session_end
