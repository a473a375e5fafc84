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
OUT=$(cd "$OUT" && pwd)  # the sides run in their own folders
old_dir=$(cd "$OLD" && pwd)
new_dir=$PWD
status=0
for round in $(seq "${ROUNDS:-2}"); do
  for side in old new; do
    dir=$new_dir
    [ "$side" = old ] && dir=$old_dir
    # Each side imports its own nbinfer: its folder first on the path (an editable install of
    # the working tree would otherwise serve both), and the log says which one it got.
    (cd "$dir" && export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" &&
      python3 -c "import nbinfer; print('nbinfer from', nbinfer.__file__)" &&
      "$@" --out "$OUT/r/${side}_$round.json") >"$OUT/r/${side}_$round.log" 2>&1 || status=1
    echo "== $side, round $round ($(head -1 "$OUT/r/${side}_$round.log"))"
    grep -v -i warn "$OUT/r/${side}_$round.log" | tail -3
  done
done
exit $status
