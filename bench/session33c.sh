#!/usr/bin/env bash
# Session 33's third device call: the Q copies for computing warps only (prefill_mma's
# q_tile_copier). Every gpu test on the new source (bench/gpu_check.sh, no decode benchmark),
# then the one-launch cascade alternated against the last revision (.ab_old, HEAD before the
# change) with bench/ab_tree.sh; on an H200 also decode against cuDNN and on an fp8 cache
# (issue 13 reqs 3 and 5) and bench/prefill.py (reqs 1, 2) while time is left.
#   rm -rf .ab_old && mkdir .ab_old && git archive REV nbinfer bench pyproject.toml | tar -x -C .ab_old
#   KEEP_R=1 bash bench/session33c.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
OUT="$OUT/r" SKIP_DECODE=1 SUITE_S=${SUITE_S:-200} bash bench/gpu_check.sh || status=1
echo "suite: $((SECONDS - t0)) s"
OUT="$OUT" ROUNDS=${ROUNDS:-3} timeout "${AB_S:-260}" bash bench/ab_tree.sh python3 \
  bench/cascade_sweep.py --tiles 32s168m --splits 0 --overheads=- --pdl 1 || status=1
echo "a/b: $((SECONDS - t0)) s"
session_h200_decode
if [ "$tag" = h200 ] && [ $((SECONDS - t0)) -lt 470 ]; then
  timeout 100 python3 bench/prefill.py --out "$OUT/r/prefill_h200.json" >"$OUT/r/prefill.log" \
    2>&1 || status=1
  tail -4 "$OUT/r/prefill.log" | cut -c1-200
fi
session_end
