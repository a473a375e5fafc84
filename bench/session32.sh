#!/usr/bin/env bash
# Session 32's A/B of the working tree against the last revision in one call (bench/ab_tree.sh:
# the one-launch cascade under graph replay and per call, alternated; call 1: the merge's plan
# reads before its PDL wait, taken back; call 7: the short lists merged by warps), on an H200
# also decode against cuDNN and FP8 decode (issue 13 reqs 3, 5), then (unless SKIP_PROBE) the
# engine's capture probe (bench/capture_probe.py) in the old tree, whose kernels the carried
# cache holds.
#   rm -rf .ab_old && mkdir .ab_old && git archive HEAD~N | tar -x -C .ab_old
#   cp bench/capture_probe.py .ab_old/bench/   # carry .ab_old too
#   KEEP_R=1 bash bench/session32.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
OUT="$OUT" ROUNDS=${ROUNDS:-2} timeout "${AB_S:-330}" bash bench/ab_tree.sh python3 \
  bench/cascade_sweep.py --tiles 32s168m --splits 0 --overheads=- --pdl 1 || status=1
echo "a/b: $((SECONDS - t0)) s"
old_path="$PWD/.ab_old${PYTHONPATH:+:$PYTHONPATH}"
(cd .ab_old && export PYTHONPATH=$old_path && session_h200_decode && exit "$status") || status=1
if [ -z "${SKIP_PROBE:-}" ]; then
  (cd .ab_old && export PYTHONPATH=$old_path && timeout "${PROBE_S:-200}" python3 bench/capture_probe.py \
    --rounds "${PROBE_ROUNDS:-4}" --out "$OUT/r/capture_probe_$tag.json") \
    >"$OUT/r/probe.log" 2>&1 || status=1
  grep -v -i warn "$OUT/r/probe.log" | tail -25 | cut -c1-220
  echo "probe: $((SECONDS - t0)) s"
fi
session_end
