#!/usr/bin/env bash
# The engine's GPU check in one device call: its gpu tests and the append wrapper's (four pytest
# processes at once, so their kernel specs compile in parallel, with a small benchmark run that
# loads the benchmark's own specs), then bench/engine.py alone on the GPU. Logs, JSON, the plot
# and the kernels compiled here (cache_new.tgz, to carry next time) go to $OUT.
#   [SMALL=1] bash bench/engine_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/nbinfer-out}
mkdir -p "$OUT"
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
export NBINFER_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}
# bytecode for the carried wheels and nbinfer (bench/session_lib.sh says why)
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
bytecode_ready
mkdir -p "$NBINFER_CACHE_DIR/kernels"
touch "$OUT/.start"
t0=$(date +%s)
run() { python3 -m pytest -q -m gpu -p no:cacheprovider -s "$@"; }
pids=()
run tests/test_engine_gpu.py -k fp32 >"$OUT/engine_a.log" 2>&1 &
pids+=($!)
run tests/test_engine_gpu.py -k "bf16 or generate or hugging or fused or rope_table" >"$OUT/engine_b.log" 2>&1 &
pids+=($!)
run tests/test_engine_gpu.py -k graph >"$OUT/engine_c.log" 2>&1 &
pids+=($!)
run tests/test_api_append.py tests/test_gpu_decode.py tests/test_api_state.py tests/test_gpu_layers.py >"$OUT/engine_d.log" 2>&1 &
pids+=($!)
python3 bench/engine.py --small --out "$OUT/engine_small.json" >"$OUT/engine_small.log" 2>&1 &
pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
echo "tests and warm-up: $(($(date +%s) - t0)) s" | tee "$OUT/engine_time.log"
if [ -z "${SMALL:-}" ]; then
  # if the run on nbinfer's layer kernels fails, the same benchmark on the torch form, so that
  # one failure does not cost the call its figures
  python3 bench/engine.py --out "$OUT/engine_h200.json" --plot "$OUT/engine_h200.png" \
    >"$OUT/engine.log" 2>&1 || {
    status=1
    python3 bench/engine.py --layer-ops torch --out "$OUT/engine_h200_torch_ops.json" \
      --plot "$OUT/engine_h200_torch_ops.png" >"$OUT/engine_torch_ops.log" 2>&1
    tail -16 "$OUT/engine_torch_ops.log"
  }
fi
(cd "$NBINFER_CACHE_DIR" && find kernels -newer "$OUT/.start" -name '*.nbk' | tar czf "$OUT/cache_new.tgz" -T -)
for f in engine_a engine_b engine_c engine_d; do echo "$f: $(tail -1 "$OUT/$f.log")"; done
grep -h "bf16 max" "$OUT"/engine_*.log
tail -3 "$OUT/engine_small.log"
tail -16 "$OUT/engine.log" 2>/dev/null
exit $status
