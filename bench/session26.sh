#!/usr/bin/env bash
# Session 26's last device call: on any GPU, run()'s host cost (bench/launch_cost.py,
# bench/host.py: issue 14 req 5-6 on another host), then the shared-prefix case of issue 13
# req 2 at D 128 (bench/prefill.py --shared 64,8192,256,128: the one launch at both KV tiles,
# level by level, plain decode over shared pages and over unshared copies); on an H200 also
# the FP8 decode rows (issue 13 req 5).
#   CACHE_BACK=1 KEEP_R=1 bash bench/session26.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout 120 python3 bench/launch_cost.py --out "$OUT/r/launch_cost_$tag.json" \
  >"$OUT/r/launch_cost.log" 2>&1 || status=1
grep -v -i warn "$OUT/r/launch_cost.log" | tail -26
timeout 150 python3 bench/host.py --out "$OUT/r/host_$tag.json" >"$OUT/r/host.log" 2>&1 || status=1
grep -A10 "^batch" "$OUT/r/host.log" | tail -11 | cut -c1-200
echo "host: $((SECONDS - t0)) s"
timeout 240 python3 bench/prefill.py --shared 64,8192,256,128 \
  --out "$OUT/r/shared_8192_d128_$tag.json" >"$OUT/r/shared_8192.log" 2>&1 || status=1
tail -1 "$OUT/r/shared_8192.log" | cut -c1-500
echo "shared: $((SECONDS - t0)) s"
if [ "$tag" = h200 ]; then
  timeout 150 python3 bench/decode.py --fp8 --out "$OUT/r/decode_fp8_h200.json" \
    >"$OUT/r/fp8.log" 2>&1 || status=1
  tail -8 "$OUT/r/fp8.log" | cut -c1-200
  echo "fp8: $((SECONDS - t0)) s"
fi
session_end
