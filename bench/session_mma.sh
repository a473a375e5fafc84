#!/usr/bin/env bash
# One device call for the tensor-core decode (DecodeSpec.mma, issue 13 req 5): the FP8 cases
# against fp16 with the API's defaults (FP8 caches on tensor cores), then the sanitizer
# (bench/memcheck.sh, which has the tensor-core and FP8 decode cases) with the FP8 and
# tensor-core decode gpu tests beside it in a second process.
#   OUT=$OUT bash bench/session_mma.sh
# FP8_SWEEP: arguments of a second `bench/decode.py --fp8` run after the defaults' (e.g.
# "--stages 2,3 --max-registers 128,168 --cases 64:4096 --formats float8_e4m3fn"); MEMCHECK_ONLY:
# memcheck.sh's --only patterns (default: every case).
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
python3 bench/decode.py --fp8 --out "$OUT/r/decode_fp8.json" >"$OUT/r/decode_fp8.log" 2>&1 \
  || status=1
echo "decode --fp8: $((SECONDS - t0)) s"
if [ -n "${FP8_SWEEP:-}" ]; then
  # shellcheck disable=SC2086  # FP8_SWEEP is a list of arguments
  python3 bench/decode.py --fp8 $FP8_SWEEP --out "$OUT/r/decode_fp8_sweep.json" \
    >"$OUT/r/decode_fp8_sweep.log" 2>&1 || status=1
  echo "decode --fp8 $FP8_SWEEP: $((SECONDS - t0)) s"
fi
timeout "${TEST_S:-300}" python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_gpu_fp8.py \
  tests/test_gpu_decode.py -k "fp8 or mma" >"$OUT/r/gpu_mma.log" 2>&1 &
tests=$!
OUT="$OUT/r" bash bench/memcheck.sh ${MEMCHECK_ONLY:+--only "$MEMCHECK_ONLY"} \
  >"$OUT/r/memcheck.log" 2>&1 || status=1
wait "$tests" || status=1
echo "gpu tests: $(grep -c PASSED "$OUT/r/gpu_mma.log") passed, $(grep -c FAILED \
  "$OUT/r/gpu_mma.log") failed; $(tail -1 "$OUT/r/gpu_mma.log" | cut -c1-90)"
grep -h "FAILED" "$OUT/r/gpu_mma.log" | head -10
tail -5 "$OUT/r/memcheck.log"
grep -v -i warn "$OUT/r/decode_fp8.log" | tail -7
[ -n "${FP8_SWEEP:-}" ] && grep -v -i warn "$OUT/r/decode_fp8_sweep.log" | tail -9
KEEP_R=1 session_end
