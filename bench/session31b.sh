#!/usr/bin/env bash
# Session 31's second device call: where the shared-prefix cascade's time goes, kernel by kernel
# (bench/cascade_timeline.py: the one launch, the level-by-level form, each prefix-level form,
# plain decode), and Nsight Compute's per-instruction stall samples of the prefix level's lean
# kernel (paged form; its SASS page as CSV, summed by bench/ncu_stalls.py).
#   KEEP_R=1 bash bench/session31b.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout 200 python3 bench/cascade_timeline.py --out "$OUT/r/cascade_timeline_$tag.json" \
  >"$OUT/r/timeline.log" 2>&1 || status=1
grep -v Warning "$OUT/r/timeline.log" | tail -40 | cut -c1-160
echo "timeline: $((SECONDS - t0)) s"
if command -v ncu >/dev/null; then
  timeout 150 ncu --clock-control none -k regex:prefill_wgmma -c 1 --launch-skip 3 \
    --section SourceCounters --section WarpStateStats --section InstructionStats \
    --import-source yes --export "$OUT/r/ncu_prefix_src" --force-overwrite \
    python3 bench/prefix_level_probe.py --once paged >"$OUT/r/ncu_src.log" 2>&1 || status=1
  ncu -i "$OUT/r/ncu_prefix_src.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/r/ncu_prefix_sass.csv" 2>&1 && gzip -f "$OUT/r/ncu_prefix_sass.csv"
  python3 bench/ncu_stalls.py --top 25 "$OUT/r/ncu_prefix_sass.csv.gz" 2>&1 | cut -c1-170
  echo "ncu: $((SECONDS - t0)) s"
fi
session_end
