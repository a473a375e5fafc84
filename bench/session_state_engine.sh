#!/usr/bin/env bash
# One device call for session 21's changes: the state merges on the caller's stream (captured in
# CUDA graphs), the layer ops on the shared prepared launch, the lean rule's forced warp count;
# then the shared-prefix cascade (bench/prefill.py: the level-by-level form under graph replay
# now that its merge can be captured) and the engine's shared-prefix rows (bench/engine.py
# --shared-only: the prefix cache's in-flight wait and decode steps that no longer walk the
# radix tree; since session 22 the cascade's plan() on the compiled loops). Then issue 14's
# requirement 1 in seconds: warm processes against the carried cache (bench/compile.py
# --warm-from), without and with bytecode for numpy and nbinfer (session 22: this workplace
# writes none, so every process compiled them from source). Session 23 added to the tests
# the decode wrapper's CUDA-graph replays of new plans (its upload now skips the layout's
# table sections) and the append wrapper's (its compiled check and partial upload); the
# engine's gpu tests check TorchRunner's staged inputs and in-graph placeholders. Logs and JSON
# in $OUT/results.tgz (KEEP_R=1 leaves the files too).
#   CACHE_BACK=1 KEEP_R=1 bash bench/session_state_engine.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
t() { timeout "${TEST_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
t tests/test_api_state.py tests/test_gpu_layers.py tests/test_gpu_scheduler.py \
  tests/test_api_append.py >"$OUT/r/gpu_s1.log" 2>&1 &
a=$!
t tests/test_gpu_prefill.py -k "cascade_gpu or one_warpgroup or cuda_graph_cascade" >"$OUT/r/gpu_s2.log" 2>&1 &
b=$!
t tests/test_engine_gpu.py >"$OUT/r/gpu_s3.log" 2>&1 &
c=$!
for p in $a $b $c; do wait "$p" || status=1; done
for f in gpu_s1 gpu_s2 gpu_s3; do echo "$f: $(tail -1 "$OUT/r/$f.log")"; done
echo "tests: $((SECONDS - t0)) s"
python3 bench/prefill.py --out "$OUT/r/prefill_h200.json" >"$OUT/r/prefill.log" 2>&1 || status=1
grep -E "shared prefix|levels|graph" "$OUT/r/prefill.log" | cut -c1-400
python3 bench/engine.py --shared-only --out "$OUT/r/engine_shared_h200.json" \
  >"$OUT/r/engine.log" 2>&1 || status=1
tail -6 "$OUT/r/engine.log"
for form in no_bytecode bytecode; do
  if [ $form = no_bytecode ]; then
    find nbinfer /tmp/site -name '*.pyc' -delete 2>/dev/null
  else
    bytecode_ready
  fi
  python3 bench/compile.py --warm-from "$NBINFER_CACHE_DIR" \
    --out "$OUT/r/compile_warm_$form.json" >"$OUT/r/compile_warm_$form.log" 2>&1 || status=1
  echo "$form:"; tail -6 "$OUT/r/compile_warm_$form.log"
done
session_end
