#!/usr/bin/env bash
# Session 29's second device call: every gpu test on the landed defaults (S = Q K^T ahead of
# the refill in the lean kernel, the merge of split rows as a dependent launch) and the lean
# kernel's own KV loader (LEAN_ROW_COPIES) among the lean forms; then the loader's A/B on B4
# L4096 H32 D128 fp16, causal and not (tokens 64w8glqo16, the default, against 64w8glqco16;
# two processes, the second in reverse order); GRID=1 adds the rest of req 1's rows with both
# tokens; on an H200 also decode against cuDNN and FP8 decode (issue 13 reqs 3 and 5).
#   KEEP_R=1 [SUITE_S=330] [GRID=1] bash bench/session29b.sh
# (The loader was measured slower and taken back: the A/B's token c needs
# `git apply bench/results/issue13/session29/call2/row_copies.patch` first.)
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${SUITE_S:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=8 -n 12 \
  --dist worksteal --ignore=tests/test_lessons.py tests >"$OUT/r/suite.log" 2>&1 || status=1
grep -E "passed|failed|error" "$OUT/r/suite.log" | tail -12 | cut -c1-250
echo "suite: $((SECONDS - t0)) s"
ab=(64w8glqo16 64w8glqco16)
for round in 1 2; do
  timeout 200 python3 bench/prefill.py --kv-tiles "$(IFS=,; echo "${ab[*]}")" \
    --out "$OUT/r/row_copies_${tag}_round$round.json" >"$OUT/r/ab$round.log" 2>&1 || status=1
  grep "prefill B4" "$OUT/r/ab$round.log" | cut -c1-250
  ab=(64w8glqco16 64w8glqo16)
done
echo "a/b: $((SECONDS - t0)) s"
session_prefill_grid 64w8glqo16,64w8glqco16 row_copies
session_h200_decode
session_end
