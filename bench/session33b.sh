#!/usr/bin/env bash
# Session 33's second device call: on an H200 the whole first call (bench/session33a.sh: the
# gpu suite, decode, prefill rows, cascade, fp8, the engine under the capture probe); on an
# H100 (whose figures call 1 took) the memory-safety check of every kernel on the landed
# source instead (bench/memcheck.sh: memcheck, racecheck, the planted read), which last ran in
# session 31, before session 32's refactors of the tensor-core prefill kernel.
#   KEEP_R=1 bash bench/session33b.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
session_gpu
if [ "$tag" = h200 ]; then
  OUT="$OUT/h200" KEEP_R=1 bash bench/session33a.sh || status=1
fi
if [ "$tag" != h200 ] || [ $((SECONDS - t0)) -lt 420 ]; then
  OUT="$OUT/r" timeout 240 bash bench/memcheck.sh 2>&1 | tail -8 || status=1
fi
echo "memcheck: $((SECONDS - t0)) s"
session_end
