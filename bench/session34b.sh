#!/usr/bin/env bash
# Session 34's second device call: what paging costs the decode itself, beside cuDNN
# (bench/balance_probe.py --layouts: NHD / HND with 16-token pages at random, and one page per
# request, HND being SDPA's own [B, H, L, D] runs), issue 13 req 3; then on an H200 only the
# decode, fp8 and prefill rows of bench/session33d.sh.
#   KEEP_R=1 bash bench/session34b.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout "${PROBE_S:-240}" python3 bench/balance_probe.py --cases 64:4096 --rounds 2 \
  --layouts NHD:16,NHD:4096,HND:16,HND:4096 --out "$OUT/r/layout_probe_$tag.json" \
  >"$OUT/r/layout_probe.log" 2>&1 || status=1
tail -4 "$OUT/r/layout_probe.log" | cut -c1-220
echo "probe: $((SECONDS - t0)) s"
session_h200_rows
session_end
