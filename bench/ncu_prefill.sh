#!/usr/bin/env bash
# Nsight Compute on one warm prefill launch per configuration (bench/profile_prefill.py), with
# the memory, stall and per-instruction sections: where the prefill kernel the plan's rule picks
# (KERNEL, a regex of its name: default prefill_wgmma, the lean warpgroup kernel) waits.
#   OUT=$OUT bash bench/ncu_prefill.sh ["--batch 16 --length 1024" "--batch 4 --length 4096" ...]
# Each argument is a list of profile_prefill.py options. Writes $OUT/ncu_prefill_<n>.txt, the
# report $OUT/ncu_prefill_<n>.ncu-rep and its SASS page as $OUT/ncu_prefill_<n>_sass.csv
# (python3 bench/ncu_stalls.py reads it anywhere), and prints the key lines of each.
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
ncu_start
[ $# -gt 0 ] || set -- "--batch 16 --length 1024" "--batch 4 --length 4096"
n=0
for cfg in "$@"; do
  n=$((n + 1))
  f="$OUT/ncu_prefill_$n.txt"
  read -r -a words <<<"$cfg"  # profile_prefill.py's options (no globbing)
  (cd bench && ncu --clock-control none -k "regex:${KERNEL:-prefill_wgmma}" -c 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters \
    --import-source yes --export "$OUT/ncu_prefill_$n" --force-overwrite \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,lts__t_sector_hit_rate.pct \
    python3 profile_prefill.py "${words[@]}") >"$f" 2>&1 || status=1
  if [ -f "$OUT/ncu_prefill_$n.ncu-rep" ]; then
    ncu -i "$OUT/ncu_prefill_$n.ncu-rep" --page source --csv --print-source sass \
      >"$OUT/ncu_prefill_${n}_sass.csv" 2>&1 || status=1
    gzip -f "$OUT/ncu_prefill_${n}_sass.csv"
  fi
  echo "== $cfg"
  ncu_summary "$f"
done
exit $status
