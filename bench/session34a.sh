#!/usr/bin/env bash
# Session 34's first device call: the decode's grid balance (bench/balance_probe.py: batch 66 /
# 264 beside 64 / 256, and a stream-K plan against LPT, each against cuDNN), issue 13 req 3;
# then on an H200 only, decode against cuDNN and on an fp8 cache (reqs 3 and 5) and
# bench/prefill.py (reqs 1 and 2), as bench/session33d.sh.
#   KEEP_R=1 bash bench/session34a.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${PROBE_S:-300}" python3 bench/balance_probe.py ${PROBE_ARGS:-} \
  --out "$OUT/r/balance_probe_$tag.json" >"$OUT/r/balance_probe.log" 2>&1 || status=1
grep -v "^{'batch'" "$OUT/r/balance_probe.log" | tail -14 | cut -c1-220
echo "probe: $((SECONDS - t0)) s"
session_h200_rows
session_end
