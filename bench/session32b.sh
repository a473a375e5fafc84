#!/usr/bin/env bash
# Session 32's second device call: where the one-launch cascade's merge ends after its kernel
# (bench/cascade_timeline.py's merge tail) in the old tree and the new, then the engine's gpu
# tests (the intermittent capture failure) run RUNS times under bench/capture_probe.py as a
# pytest plugin, with the old tree's nbinfer (whose kernels the carried cache holds).
#   cp bench/cascade_timeline.py .ab_old/bench/   # carry .ab_old too
#   KEEP_R=1 bash bench/session32b.sh
# (python3 -P: `python -m` puts the working directory first on sys.path, which imports the
# working tree's nbinfer whatever PYTHONPATH says; call 2 ran without it, so its engine runs
# were the working tree's, which then had the revision's engine code.)
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
for side in old new; do
  dir=$PWD
  [ "$side" = old ] && dir=$PWD/.ab_old
  (cd "$dir" && export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" &&
    timeout 150 python3 bench/cascade_timeline.py --out "$OUT/r/timeline_${side}_$tag.json") \
    >"$OUT/r/timeline_$side.log" 2>&1 || status=1
  echo "== $side"; grep -E "^cascade:|split_merge|prefill_mma" "$OUT/r/timeline_$side.log" | head -4
done
echo "timelines: $((SECONDS - t0)) s"
for run in $(seq "${RUNS:-3}"); do
  PYTHONPATH="$PWD/.ab_old:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" \
    CAPTURE_PROBE_OUT="$OUT/r/engine_probe_$run.json" timeout "${ENGINE_S:-150}" \
    python3 -P -m pytest -q -m gpu -p no:cacheprovider -p capture_probe tests/test_engine_gpu.py \
    >"$OUT/r/engine_$run.log" 2>&1 || status=1
  echo "== engine run $run"; grep -E "passed|failed|capture probe|^capture [0-9]" \
    "$OUT/r/engine_$run.log" | tail -6 | cut -c1-220
done
echo "engine: $((SECONDS - t0)) s"
session_end
