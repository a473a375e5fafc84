#!/usr/bin/env bash
# Session 31's device call: on an H200, issue 13's figures that need it (decode against cuDNN
# and FP8 decode: reqs 3 and 5; bench/prefill.py's default JSON: req 1's rows, the cascade of
# req 2 and the roofline's prefill point, req 6); on any GPU, the cascade's prefix level in
# several KV forms (bench/prefix_level_probe.py) and, with NCU=1, Nsight Compute's memory and
# stall sections of its lean kernel in the paged and ragged forms.
#   KEEP_R=1 [NCU=1] [FORMS=paged,ragged,...] bash bench/session31.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
session_h200_decode
if [ "$tag" = h200 ]; then
  timeout 200 python3 bench/prefill.py --out "$OUT/r/prefill_h200_v7.json" \
    >"$OUT/r/prefill.log" 2>&1 || status=1
  grep -E "prefill B4|cascade|TFLOP" "$OUT/r/prefill.log" | cut -c1-250
  echo "prefill: $((SECONDS - t0)) s"
fi
timeout 240 python3 bench/prefix_level_probe.py ${FORMS:+--forms "$FORMS"} \
  --out "$OUT/r/prefix_level_$tag.json" >"$OUT/r/probe.log" 2>&1 || status=1
grep -v Warning "$OUT/r/probe.log" | tail -10 | cut -c1-200
echo "probe: $((SECONDS - t0)) s"
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  for form in ${NCU_FORMS:-paged ragged}; do
    f="$OUT/r/ncu_prefix_$form.txt"
    timeout 120 ncu --clock-control none -k regex:prefill_wgmma -c 1 --launch-skip 3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,lts__t_bytes.sum \
      python3 bench/prefix_level_probe.py --once "$form" >"$f" 2>&1 || status=1
    echo "== ncu $form"
    ncu_summary "$f"
    grep -E "dram__bytes_read.sum|lts__t_bytes.sum" "$f"
  done
  echo "ncu: $((SECONDS - t0)) s"
fi
session_end
