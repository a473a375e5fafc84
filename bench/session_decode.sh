#!/usr/bin/env bash
# One device call for decode work (issue 13 req 3: decode at or above cuDNN SDPA). Benchmarks
# first, one at a time, then the gpu tests (in parallel processes, cut off at TEST_S seconds):
#   1. bench/read_gather.py $GATHER_ARGS: the read-only ceiling of the decode step's bytes, per
#      KV layout, load instruction, CTA size and ring depth (NO_GATHER=1 skips);
#   2. bench/decode.py: spot checks against the float64 reference, the three cases against
#      cuDNN and flash SDPA, run() host cost (NO_FULL=1 skips);
#   3. bench/decode.py --sweep --stages $STAGES --page-groups $PAGE_GROUPS: the three cases per
#      KV ring depth and addressing (DecodeSpec.page_groups 0/1), cuDNN in the same run (when
#      STAGES is set); LAYOUT=HND for an HND cache; FP8=1 also runs --fp8 per addressing
#      (PAGE_GROUPS applies to these two runs only; MMA=0,1 likewise runs both DecodeSpec.mma);
#   4. tests/test_gpu_decode.py, two processes (the decode matrix; the rest of the file, or with
#      TEST_MMA=1 only test_decode_mma_gpu), and tests/test_gpu_fp8.py in a third (NO_TESTS=1
#      skips).
# Logs and JSON in $OUT/r and $OUT/results.tgz; CACHE_BACK=1 returns the kernel cache as
# $OUT/cache.tgz. Exit status non-zero when anything failed.
#   STAGES=2 PAGE_GROUPS=0,1 FP8=1 NO_GATHER=1 CACHE_BACK=1 bash bench/session_decode.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
if [ -z "${NO_GATHER:-}" ]; then
  # shellcheck disable=SC2086  # GATHER_ARGS is a list of options
  python3 bench/read_gather.py ${GATHER_ARGS:-} --out "$OUT/r/read_gather.json" \
    >"$OUT/r/gather.log" 2>&1 || status=1
  echo "read_gather: $((SECONDS - t0)) s"
fi
if [ -z "${NO_FULL:-}" ]; then
  python3 bench/decode.py --out "$OUT/r/decode.json" >"$OUT/r/decode.log" 2>&1 || status=1
  echo "decode: $((SECONDS - t0)) s"
fi
if [ -n "${STAGES:-}" ]; then
  python3 bench/decode.py --sweep --stages "$STAGES" --page-groups "${PAGE_GROUPS:-}" \
    --mma "${MMA:-}" --layout "${LAYOUT:-NHD}" --out "$OUT/r/decode_stages.json" >"$OUT/r/decode_stages.log" \
    2>&1 || status=1
  echo "decode --stages $STAGES: $((SECONDS - t0)) s"
fi
if [ -n "${FP8:-}" ]; then
  python3 bench/decode.py --fp8 --page-groups "${PAGE_GROUPS:-}" --mma "${MMA:-}" --out "$OUT/r/decode_fp8.json" \
    >"$OUT/r/decode_fp8.log" 2>&1 || status=1
  echo "decode --fp8: $((SECONDS - t0)) s"
fi
if [ -z "${NO_TESTS:-}" ]; then
  t() { timeout "${TEST_S:-330}" python3 -m pytest -v -m gpu -p no:cacheprovider "$@"; }
  t tests/test_gpu_decode.py -k "decode_matrix" >"$OUT/r/gpu_d1.log" 2>&1 &
  a=$!
  rest="not decode_matrix"
  [ -n "${TEST_MMA:-}" ] && rest="decode_mma"
  t tests/test_gpu_decode.py -k "$rest" >"$OUT/r/gpu_d2.log" 2>&1 &
  b=$!
  t tests/test_gpu_fp8.py >"$OUT/r/gpu_d3.log" 2>&1 &
  c=$!
  for p in $a $b $c; do wait "$p" || status=1; done  # a failure or a cut-off (124)
  for f in gpu_d1 gpu_d2 gpu_d3; do
    echo "$f: $(grep -c PASSED "$OUT/r/$f.log") passed, $(grep -c FAILED "$OUT/r/$f.log")" \
      "failed; $(tail -1 "$OUT/r/$f.log" | cut -c1-90)"
  done
  grep -h "FAILED" "$OUT"/r/gpu_d*.log | head -10
fi
[ -f "$OUT/r/gather.log" ] && sed -n '/^best/,$p' "$OUT/r/gather.log"
[ -f "$OUT/r/decode_fp8.log" ] && grep -v -i warn "$OUT/r/decode_fp8.log" | tail -13
[ -f "$OUT/r/decode_stages.log" ] && grep -v -i warn "$OUT/r/decode_stages.log" | tail -24
[ -f "$OUT/r/decode.log" ] && grep -v -i warn "$OUT/r/decode.log" | tail -7
KEEP_R=1 session_end
