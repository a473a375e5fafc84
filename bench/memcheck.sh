#!/usr/bin/env bash
# Memory-safety check of nbinfer's GPU kernels under compute-sanitizer, on the GPU machine:
#   bash bench/memcheck.sh [bench/memcheck.py options, e.g. --only 'decode_*']
# Three runs of bench/memcheck.py, logs in ${OUT:-bench/results}/memcheck_{memcheck,racecheck,control}.log:
#   memcheck   every case          must report 0 errors, and every case must be ok
#   racecheck  every case          must report 0 hazard errors (warnings are counted, not fatal)
#   control    memcheck, --plant-oob (one deliberate out-of-bounds read): must REPORT it
# They run side by side (each process compiles its own kernels, ~2-3 min of one CPU core);
# MEMCHECK_SERIAL=1 runs them one after another. PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every torch
# tensor its own allocation, so a read past a tensor is not hidden inside torch's pool.
# --check-exit-code no keeps the sanitizer's counts to memory errors: the control's launch fails
# under memcheck, and a wrong case exits 1, which would otherwise add one "error" each. The cases'
# verdicts come from memcheck.py's own last line. Exit status: 0 only when all three pass.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-bench/results}
mkdir -p "$out"
cs=${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
if [ ! -x "$cs" ]; then
  cs=$(command -v compute-sanitizer) || { echo "compute-sanitizer not found" >&2; exit 2; }
fi
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
case ":${PYTHONPATH:-}:" in
  *":$PWD:"*) ;;
  *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD ;;
esac

common=(--report-api-errors no --check-exit-code no)
one() {  # name, then the sanitizer's arguments
  local name=$1 log="$out/memcheck_$1.log" start=$SECONDS
  shift
  "$cs" "$@" >"$log" 2>&1
  echo "memcheck.sh: exit status $? after $((SECONDS - start)) s" >>"$log"
}
runs=(
  "memcheck --tool memcheck ${common[*]} --print-limit 20 python3 bench/memcheck.py"
  "racecheck --tool racecheck ${common[*]} --print-limit 20 python3 bench/memcheck.py"
  "control --tool memcheck ${common[*]} python3 bench/memcheck.py --plant-oob"
)
start=$SECONDS
for r in "${runs[@]}"; do
  read -r -a argv <<<"$r"
  extra=()
  [ "${argv[0]}" != control ] && extra=("$@")
  echo "started: $cs ${argv[*]:1} ${extra[*]}"
  if [ "${MEMCHECK_SERIAL:-0}" = 1 ]; then
    one "${argv[@]}" "${extra[@]}"
  else
    one "${argv[@]}" "${extra[@]}" &
  fi
done
wait
echo "all runs done after $((SECONDS - start)) s; logs in $out/memcheck_*.log"

num() { grep -Eo "$1" "$2" | tail -1 | grep -Eo '[0-9]+' | sed -n "${3:-1}p"; }
cases() { grep -E '^memcheck.py: [0-9]+ cases, [0-9]+ ok, [0-9]+ wrong' "$1" | tail -1 |
  sed -E 's/^memcheck.py: ([0-9]+) cases, ([0-9]+) ok.*/\2\/\1 ok/'; }
cases_ok() { grep -Eq '^memcheck.py: [0-9]+ cases, [0-9]+ ok, 0 wrong' "$1"; }
excerpt() {  # the first reports of a failing run
  grep -E 'Invalid __|Race reported|Misaligned|Out-of-range|Program hit|Hardware exception|  (WRONG|ERROR)' \
    "$1" | head -8 | sed 's/^/    /'
}

status=0
rows=()
log="$out/memcheck_memcheck.log"
errs=$(num 'ERROR SUMMARY: [0-9]+ error' "$log")
if [ "${errs:-x}" = 0 ] && cases_ok "$log"; then v=PASS; else v=FAIL; status=1; fi
rows+=("memcheck|${errs:-n/a}|-|$(cases "$log")|$v")

log="$out/memcheck_racecheck.log"
line=$(grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazards? displayed \([0-9]+ errors?, [0-9]+ warnings?\)' \
  "$log" | tail -1)
if [ -n "$line" ]; then
  rerr=$(echo "$line" | sed -E 's/.*\(([0-9]+) errors?.*/\1/')
  rwarn=$(echo "$line" | sed -E 's/.*, ([0-9]+) warnings?.*/\1/')
else  # no racecheck summary: fall back to the generic one
  rerr=$(num 'ERROR SUMMARY: [0-9]+ error' "$log")
  rwarn=
fi
if [ "${rerr:-x}" = 0 ] && cases_ok "$log"; then v=PASS; else v=FAIL; status=1; fi
rows+=("racecheck|${rerr:-n/a}|${rwarn:-n/a}|$(cases "$log")|$v")

log="$out/memcheck_control.log"
cerr=$(num 'ERROR SUMMARY: [0-9]+ error' "$log")
if [ "${cerr:-0}" -ge 1 ] 2>/dev/null && grep -q 'Invalid __global__ read' "$log"; then
  v="CAUGHT (planted read reported)"
else
  v="MISSED (the planted read was not reported)"
  status=1
fi
rows+=("control --plant-oob|${cerr:-n/a}|-|-|$v")

echo
printf '%-20s %-8s %-9s %-12s %s\n' run errors warnings cases verdict
for r in "${rows[@]}"; do
  IFS='|' read -r a b c d e <<<"$r"
  printf '%-20s %-8s %-9s %-12s %s\n' "$a" "$b" "$c" "${d:-n/a}" "$e"
done
for r in "${rows[@]:0:2}"; do
  IFS='|' read -r a _ _ _ e <<<"$r"
  if [ "$e" = FAIL ]; then
    echo "first reports of $a ($out/memcheck_$a.log):"
    excerpt "$out/memcheck_$a.log"
  fi
done
exit $status
