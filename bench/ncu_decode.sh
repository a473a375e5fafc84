#!/usr/bin/env bash
# Nsight Compute on one warm decode step per configuration (bench/profile_decode.py), with the
# memory and stall sections: where the fp16 and FP8 decode kernels wait.
#   OUT=$OUT [SOURCE=1] bash bench/ncu_decode.sh ["float16" "float8_e4m3fn" "float16 --mma 1" ...]
# Each argument is the --kv-dtype value and any further profile_decode.py options. Writes
# $OUT/ncu_decode_<n>.txt per configuration and prints the key lines of each. SOURCE=1 adds the
# per-instruction stall sampling (SourceCounters, and $OUT/ncu_decode_<n>.ncu-rep to open in
# Nsight Compute's source view, and its SASS page as $OUT/ncu_decode_<n>_sass.csv).
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
ncu_start
[ $# -gt 0 ] || set -- "float16" "float8_e4m3fn"
n=0
for cfg in "$@"; do
  n=$((n + 1))
  f="$OUT/ncu_decode_$n.txt"
  read -r -a words <<<"$cfg"  # the dtype, then options (no globbing)
  [ ${#words[@]} -gt 0 ] || { echo "ncu_decode.sh: empty configuration $n"; status=1; continue; }
  dtype=${words[0]}
  extra=()
  [ -n "${SOURCE:-}" ] && extra=(--section SourceCounters --import-source yes
                                 --export "$OUT/ncu_decode_$n" --force-overwrite)
  ncu --clock-control none -k regex:decode -c 1 --launch-skip 2 "${extra[@]}" --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,lts__t_sector_hit_rate.pct \
    python3 bench/profile_decode.py --kv-dtype "$dtype" "${words[@]:1}" >"$f" 2>&1 || status=1
  if [ -n "${SOURCE:-}" ] && [ -f "$OUT/ncu_decode_$n.ncu-rep" ]; then
    # The per-instruction table (SASS with its stall samples by reason) as CSV, so that the
    # hot instructions can be read without the GUI.
    ncu -i "$OUT/ncu_decode_$n.ncu-rep" --page source --csv --print-source sass \
      >"$OUT/ncu_decode_${n}_sass.csv" 2>&1 || status=1
  fi
  echo "== $cfg"
  ncu_summary "$f"
done
exit $status
