#!/usr/bin/env bash
# Session 29's device call (issue 13 reqs 1 and 2; on an H200 also reqs 3 and 5): the lean
# prefill's gpu tests with S = Q K^T ahead of the ring's refill (LEAN_QK_AHEAD, alone and with
# the per-item overlap), the warpgroup products' own checks and the merge as a programmatic
# dependent launch (PREFILL_PDL); then the rung's A/B on B4 L4096 H32 D128 fp16, causal and
# not, in two processes whose token orders are reversed (the L2 order on in every token, as it
# is by default); the shared-prefix cascade with and without PREFILL_PDL (two alternated
# rounds); NCU=1 adds one Nsight Compute pass of the causal kernel with the rung; on an H200
# also decode against cuDNN and FP8 decode.
#   CACHE_BACK=1 KEEP_R=1 bash bench/session29.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${TESTS_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 -n 12 \
  --dist worksteal tests/test_gpu_prefill.py -k "wgmma or dependent" tests/test_wgmma.py \
  >"$OUT/r/tests.log" 2>&1 || status=1
tail -4 "$OUT/r/tests.log" | cut -c1-300
echo "tests: $((SECONDS - t0)) s"
ab=(64w8glo16 64w8glqo16 64w8glpo16 64w8glpqo16)
for round in 1 2; do
  tokens=$(IFS=,; echo "${ab[*]}")
  timeout 240 python3 bench/prefill.py --kv-tiles "$tokens" \
    --out "$OUT/r/qk_ahead_${tag}_round$round.json" >"$OUT/r/ab$round.log" 2>&1 || status=1
  grep "prefill B4" "$OUT/r/ab$round.log" | cut -c1-300
  echo "round $round: $((SECONDS - t0)) s"
  ab=(64w8glpqo16 64w8glpo16 64w8glqo16 64w8glo16)  # the second round in reverse
done
timeout 240 python3 bench/cascade_sweep.py --tiles 32s168m --splits 0 --overheads - --pdl 0,1 \
  --rounds 2 --out "$OUT/r/cascade_pdl_$tag.json" >"$OUT/r/cascade_pdl.log" 2>&1 || status=1
tail -6 "$OUT/r/cascade_pdl.log" | cut -c1-200
echo "cascade: $((SECONDS - t0)) s"
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  (cd bench && ncu --clock-control none -k "regex:prefill_wgmma" -c 1 --section WarpStateStats \
    --section SourceCounters --import-source yes --export "$OUT/r/ncu_qk_ahead" \
    --force-overwrite python3 profile_prefill.py --kv-tile 64w8glqo16) \
    >"$OUT/r/ncu.log" 2>&1 || status=1
  ncu -i "$OUT/r/ncu_qk_ahead.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/r/ncu_qk_ahead_sass.csv" 2>&1 && gzip -f "$OUT/r/ncu_qk_ahead_sass.csv"
  python3 bench/ncu_stalls.py --top 12 "$OUT/r/ncu_qk_ahead_sass.csv.gz" 2>&1 | cut -c1-160
  echo "ncu: $((SECONDS - t0)) s"
fi
session_h200_decode
session_end
