#!/usr/bin/env bash
# Session 24's device script (after bench/session_state_engine.sh found the engine's graph
# capture invalidated by a Numba free): the capture guard's gpu tests (nbinfer.defer_frees, the
# layer ops' graph replays, the engine's 11); where the engine's replayed cascade step spends
# its host time against the paged one's (bench/engine_host_profile.py); the shared-prefix
# cascade by KV chunk size (bench/cascade_levels_sweep.py: the prefix level alone on the lean
# kernel, level by level, one launch); with DECODE=1 bench/decode.py (against cuDNN) and its
# FP8 rows; with HOST=1 bench/host.py and bench/launch_cost.py; with L2AB=1 the tensor-core
# prefill's L2 order A/B (plain lean kernel against 16 and 32 MiB sections, SDPA flash / cuDNN
# in the same process); with MEMCHECK=1 memcheck / racecheck / the planted read (no kernel
# changed since session 23's clean run on an H100). Session 25: ENGINE=1 runs
# bench/engine.py --shared-only first (each row's replayed step by kernel kind) and its decode
# step's attention alone (bench/prefill.py --shared, random and sorted pages); FP8=1 only the
# FP8 decode rows of DECODE=1; LAYERS=1 bench/layer_kernels.py; NO_PROFILE=1
# and NO_SWEEP=1 skip the host profile and the cascade sweep; SWEEP_ARGS are the sweep's.
# Session 26: CASCADE_TESTS=1 adds the cascade's gpu tests, TESTS replaces the test files,
# PROMPTS lists the engine's prompt lengths (default 1024), MEMCHECK_ONLY passes memcheck.py
# --only patterns.
#   CACHE_BACK=1 bash bench/session24.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
# CASCADE_TESTS=1 (session 26): the cascade's gpu tests too (the one launch's 64-key tiles at D 64)
cascade_tests=()
[ -n "${CASCADE_TESTS:-}" ] && cascade_tests=(tests/test_gpu_prefill.py::test_cascade_gpu
  tests/test_gpu_prefill.py::test_cuda_graph_cascade_replays_later_plans)
# TESTS (session 26): the test files to run instead of the capture tests
# shellcheck disable=SC2086
timeout "${TEST_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests/test_gpu_layers.py tests/test_engine_gpu.py} "${cascade_tests[@]}" \
  >"$OUT/r/gpu_capture.log" 2>&1 || status=1
echo "capture tests: $(tail -1 "$OUT/r/gpu_capture.log") ($((SECONDS - t0)) s)"
if [ -n "${LAYERS:-}" ]; then  # issue 12: the layer kernels' GPU time, the norm's two forms
  timeout 120 python3 bench/layer_kernels.py --out "$OUT/r/layer_kernels.json" \
    >"$OUT/r/layer_kernels.log" 2>&1 || status=1
  grep -v -i warn "$OUT/r/layer_kernels.log" | tail -9
fi
if [ -n "${ENGINE:-}" ]; then  # issue 12: the shared-prefix rows, each replayed step profiled
  # PROMPTS (session 26): prompt lengths, one --shared-only run each (4096: the cascade
  # rule's side of the crossover)
  for prompt in ${PROMPTS:-1024}; do
    sfx=$([ "$prompt" = 1024 ] && echo "" || echo "_p$prompt")
    timeout 300 python3 bench/engine.py --shared-only --prompt "$prompt" \
      --out "$OUT/r/engine_shared${sfx}_h200.json" >"$OUT/r/engine_shared$sfx.log" 2>&1 || status=1
    grep -v -i warn "$OUT/r/engine_shared$sfx.log" | tail -24 | cut -c1-220
    echo "engine (prompt $prompt): $((SECONDS - t0)) s"
  done
  # the attention of its decode step alone: 64 x (912 shared + 240 own), D 64
  for order in random sorted; do
    timeout 120 python3 bench/prefill.py --shared "64,912,240,64,$order" \
      --out "$OUT/r/shared_engine_shape_$order.json" >"$OUT/r/shared_engine_shape_$order.log" \
      2>&1 || status=1
    tail -1 "$OUT/r/shared_engine_shape_$order.log" | cut -c1-400
  done
  echo "engine shape: $((SECONDS - t0)) s"
fi
if [ -z "${NO_PROFILE:-}" ]; then
  timeout 240 python3 bench/engine_host_profile.py --out "$OUT/r/engine_host_profile.json" \
    >"$OUT/r/host_profile.log" 2>&1 || status=1
  grep -E "^==|gpu ms/step" "$OUT/r/host_profile.log"
  echo "profile: $((SECONDS - t0)) s"
fi
if [ -z "${NO_SWEEP:-}" ]; then
  # shellcheck disable=SC2086  # (SWEEP_ARGS: several words, e.g. "--orders random,sorted")
  timeout 200 python3 bench/cascade_levels_sweep.py ${SWEEP_ARGS:-} \
    --out "$OUT/r/cascade_levels_sweep.json" \
    >"$OUT/r/cascade_sweep.log" 2>&1 || status=1
  grep -v -i warn "$OUT/r/cascade_sweep.log" | tail -14 | cut -c1-200
  echo "cascade sweep: $((SECONDS - t0)) s"
fi
if [ -n "${DECODE:-}" ]; then  # issue 13 req 3: decode against cuDNN
  timeout 150 python3 bench/decode.py --out "$OUT/r/decode_h200.json" >"$OUT/r/decode.log" 2>&1 \
    || status=1
  tail -6 "$OUT/r/decode.log" | cut -c1-200
fi
if [ -n "${DECODE:-}${FP8:-}" ]; then  # issue 13 req 5: FP8 against fp16 (FP8=1: only this)
  timeout 150 python3 bench/decode.py --fp8 --out "$OUT/r/decode_fp8_h200.json" \
    >"$OUT/r/fp8.log" 2>&1 || status=1
  tail -8 "$OUT/r/fp8.log" | cut -c1-200
  echo "decode: $((SECONDS - t0)) s"
fi
if [ -n "${HOST:-}" ]; then  # issue 14 req 5-6: run() and plan() host cost on this host
  { timeout 150 python3 bench/host.py --profile --out "$OUT/r/host_h200.json" &&
    timeout 60 python3 bench/launch_cost.py --out "$OUT/r/launch_cost.json"; } \
    >"$OUT/r/host.log" 2>&1 || status=1
  tail -24 "$OUT/r/host.log" | cut -c1-200
  echo "host: $((SECONDS - t0)) s"
fi
if [ -n "${L2AB:-}" ]; then
  python3 bench/prefill.py --kv-tiles "${TILES:-64w8gl,64w8glo16,64w8glo32}" \
    --out "$OUT/r/prefill_l2_order.json" >"$OUT/r/l2.log" 2>&1 || status=1
  grep -v -i warn "$OUT/r/l2.log" | tail -6 | cut -c1-300
fi
if [ -n "${MEMCHECK:-}" ]; then
  # MEMCHECK_ONLY (session 26): memcheck.py's --only patterns (default every case)
  # shellcheck disable=SC2046
  OUT="$OUT/r" bash bench/memcheck.sh $([ -n "${MEMCHECK_ONLY:-}" ] && echo --only "$MEMCHECK_ONLY") \
    >"$OUT/r/memcheck.out" 2>&1 || status=1
  tail -4 "$OUT/r/memcheck.out"
  echo "memcheck: $((SECONDS - t0)) s"
fi
session_end
