#!/usr/bin/env bash
# Session 31's third device call: Nsight Compute's per-instruction stall samples of (1) the
# prefix level's lean kernel with LEAN_PREFETCH (Q by cp.async: where does the stager's time go
# when the stager is gone?) and (2) the one-launch cascade's tensor-core kernel (mma.sync, the
# CASCADE_TILES spec), each as a SASS CSV summed by bench/ncu_stalls.py.
#   KEEP_R=1 bash bench/session31c.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
src_profile() {  # $1 name, $2 kernel regex, then the command
  local name=$1 kre=$2
  shift 2
  timeout 150 ncu --clock-control none -k "regex:$kre" -c 1 --launch-skip 3 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --import-source yes --export "$OUT/r/ncu_$name" --force-overwrite "$@" \
    >"$OUT/r/ncu_$name.log" 2>&1 || status=1
  ncu -i "$OUT/r/ncu_$name.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/r/ncu_${name}_sass.csv" 2>&1 && gzip -f "$OUT/r/ncu_${name}_sass.csv"
  echo "== $name"
  grep -E "Duration|Elapsed Cycles|SM Active" "$OUT/r/ncu_$name.log"
  python3 bench/ncu_stalls.py --top 8 "$OUT/r/ncu_${name}_sass.csv.gz" 2>&1 | cut -c1-150
}
src_profile prefetch prefill_wgmma python3 bench/prefix_level_probe.py --once prefetch
src_profile cascade prefill_mma python3 bench/cascade_timeline.py --cascade-only
echo "ncu: $((SECONDS - t0)) s"
session_end
