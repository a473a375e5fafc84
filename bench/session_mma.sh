#!/usr/bin/env bash
# One device call for the tensor-core decode (DecodeSpec.mma, issue 13 req 5): the FP8 cases
# against fp16 with the API's defaults (FP8 caches on tensor cores), then the sanitizer
# (bench/memcheck.sh, which has the tensor-core and FP8 decode cases) with the FP8 and
# tensor-core decode gpu tests beside it in a second process.
#   OUT=$OUT bash bench/session_mma.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
python3 bench/decode.py --fp8 --out "$OUT/r/decode_fp8.json" >"$OUT/r/decode_fp8.log" 2>&1 \
  || status=1
echo "decode --fp8: $((SECONDS - t0)) s"
timeout "${TEST_S:-300}" python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_gpu_fp8.py \
  tests/test_gpu_decode.py -k "fp8 or mma" >"$OUT/r/gpu_mma.log" 2>&1 &
tests=$!
OUT="$OUT/r" bash bench/memcheck.sh >"$OUT/r/memcheck.log" 2>&1 || status=1
wait "$tests" || status=1
echo "gpu tests: $(grep -c PASSED "$OUT/r/gpu_mma.log") passed, $(grep -c FAILED \
  "$OUT/r/gpu_mma.log") failed; $(tail -1 "$OUT/r/gpu_mma.log" | cut -c1-90)"
grep -h "FAILED" "$OUT/r/gpu_mma.log" | head -10
tail -5 "$OUT/r/memcheck.log"
grep -v -i warn "$OUT/r/decode_fp8.log" | tail -7
KEEP_R=1 session_end
