#!/usr/bin/env bash
# Session 31's fifth device call (the Q stager without float64): the one-launch cascade's
# schedule and stages again (bench/cascade_sweep.py: 32-key tiles with two or three stages, the
# planner's chunks or 512, LPT's per-item cost default / 64 / 256 tokens, the dependent merge
# on), and the cascade kernel's per-region samples after the fix (bench/ncu_stalls.py --blocks).
#   KEEP_R=1 bash bench/session31e.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout 300 python3 bench/cascade_sweep.py --tiles 32s168m,32s168x3m --splits 0,512 \
  --overheads=-,64,256 --pdl 1 --out "$OUT/r/cascade_sweep_stager_$tag.json" \
  >"$OUT/r/sweep.log" 2>&1 || status=1
grep -v Warning "$OUT/r/sweep.log" | tail -16 | cut -c1-200
echo "sweep: $((SECONDS - t0)) s"
if command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none -k "regex:prefill_mma" -c 1 --launch-skip 3 \
    --section SourceCounters --section SpeedOfLight --import-source yes \
    --export "$OUT/r/ncu_cascade_stager" --force-overwrite \
    python3 bench/cascade_timeline.py --cascade-only >"$OUT/r/ncu.log" 2>&1 || status=1
  ncu -i "$OUT/r/ncu_cascade_stager.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/r/ncu_cascade_stager_sass.csv" 2>&1 && gzip -f "$OUT/r/ncu_cascade_stager_sass.csv"
  grep -E "Duration|Elapsed Cycles" "$OUT/r/ncu.log"
  python3 bench/ncu_stalls.py --top 0 --blocks "$OUT/r/ncu_cascade_stager_sass.csv.gz" 2>&1 \
    | tail -18 | cut -c1-150
fi
session_end
