#!/usr/bin/env bash
# Session 30's device call: the warp-specialised standalone attention kernel (a producer
# warpgroup copying K / V into a ring guarded by mbarriers, two consumer warpgroups with no CTA
# barrier; bench/wgmma_attention.py's build_ws; K / V by cp.async or by TMA) against session 16's best standalone form
# (2wg-n64-s2 r128) and SDPA flash / cuDNN, B4 L4096 H32 D128 fp16, causal and not; each
# variant checked against SDPA's math backend first. Then, on an H200 only, decode against cuDNN
# and FP8 decode (issue 13 reqs 3 and 5).
#   KEEP_R=1 [WS_VARIANTS=...] bash bench/session30.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mbarrier.py \
  tests/test_tma.py tests/test_wgmma.py >"$OUT/r/tests.log" 2>&1 || status=1
tail -3 "$OUT/r/tests.log" | cut -c1-250
echo "tests: $((SECONDS - t0)) s"
# (call 1 timed "2wg-n64-s2 r128,ws-s2,ws-s4,ws-s2-ov,ws-s4-ov,ws-s4 no-copy,ws-s4-ov no-copy";
# call 2 "2wg-n64-s2 r128,ws-s4-ov,ws-tma-s4,ws-tma-s4-ov,ws-tma-s2-ov,ws-tma-s4-ov no-copy";
# call 3 "2wg-n64-s2 r128,ws-tma-s4-ov,ws-sw-s4,ws-sw-s4-ov,ws-sw-s5-ov,ws-swk-s4-ov,ws-swv-s4-ov,
# ws-s4 no-math,ws-tma-s4 no-math,ws-sw-s4 no-math")
variants=${WS_VARIANTS:-"2wg-n64-s2 r128,2wg-n64-s2 r128 sw,ws-sw-s4-ov,ws-cpsw-s4-ov"}
shapes=${WS_SHAPES:-"4,32,4096,128;4,32,4096,64;16,32,1024,128;1,32,16384,128"}
timeout 520 python3 bench/wgmma_attention.py --variants "$variants" --shapes "$shapes" \
  --out "$OUT/r/ws_$tag.json" >"$OUT/r/ws.log" 2>&1 || status=1
grep -E "TFLOP|failed|Error" "$OUT/r/ws.log" | cut -c1-200
grep -c "rel err" "$OUT/r/ws.log"
echo "ws: $((SECONDS - t0)) s"
session_h200_decode
session_end
