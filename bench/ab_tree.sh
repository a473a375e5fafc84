#!/usr/bin/env bash
# A/B of the working tree against an exported revision in one device call: a benchmark command
# run alternately in OLD (a plain copy of the revision, e.g. made by
#   rm -rf .ab_old && mkdir .ab_old && git archive REV | tar -x -C .ab_old
# and carried to the device) and in the working tree, ROUNDS times each, each in its own process,
# so that both sides see the same machine state in turn.
#   OLD=.ab_old ROUNDS=2 OUT=$OUT bash bench/ab_tree.sh python3 bench/decode.py --fp8
# The command gets --out $OUT/r/<side>_<round>.json; its log's last three lines are printed.
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
OLD=${OLD:-.ab_old}
[ -d "$OLD" ] || { echo "ab_tree.sh: OLD=$OLD is not a directory"; exit 2; }
[ $# -gt 0 ] || { echo "ab_tree.sh: no command"; exit 2; }
mkdir -p "$OUT/r"
base=${PYTHONPATH:-}
root=$PWD
status=0
for round in $(seq "${ROUNDS:-2}"); do
  for side in old new; do
    dir=.
    [ "$side" = old ] && dir=$OLD
    # each side imports its own nbinfer (PYTHONPATH's checkout entry replaced by the side's)
    (cd "$dir" && PYTHONPATH=${base//$root/$root/$dir} "$@" --out "$OUT/r/${side}_$round.json" \
      >"$OUT/r/${side}_$round.log" 2>&1) || status=1
    echo "== $side, round $round"
    grep -v -i warn "$OUT/r/${side}_$round.log" | tail -3
  done
done
exit $status
