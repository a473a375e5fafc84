#!/usr/bin/env bash
# One device call for the tensor-core prefill on warpgroup MMA (MmaPrefillSpec(wgmma=True),
# issue 13 req 1): its gpu tests (the paged grid at 8 warps and at 4 under a 168 cap, ragged +
# custom mask + single, the non-finite rule: three processes side by side, each compiling its
# own kernels), then, if they pass, bench/prefill.py's A/B of the mma.sync kernel (64-key
# tiles) and the warpgroup shapes (TILES, default 64,64w8g,64s128w8g,64s168w4g) with SDPA flash
# / cuDNN in the same process. GRID=1 adds the req 1 grid for 64w8g.
#   OUT=$OUT bash bench/session_wgmma_prefill.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
t() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
w=tests/test_gpu_prefill.py::test_paged_prefill_gpu_wgmma
t "$w[0]" "$w[1]" "$w[3]" >"$OUT/r/gpu_w1.log" 2>&1 &
a=$!
t "$w[4]" "$w[5]" "$w[6]" "${w}_one_warpgroup[0]" "${w}_one_warpgroup[5]" \
  >"$OUT/r/gpu_w2.log" 2>&1 &
b=$!
t tests/test_gpu_prefill.py::test_ragged_and_single_prefill_gpu \
  tests/test_gpu_trust.py::test_prefill_nan_rule_on_the_tensor_core_kernel >"$OUT/r/gpu_w3.log" 2>&1 &
c=$!
for p in $a $b $c; do wait "$p" || status=1; done
for f in gpu_w1 gpu_w2 gpu_w3; do echo "$f: $(tail -1 "$OUT/r/$f.log")"; done
echo "gpu tests: $((SECONDS - t0)) s"
if [ $status = 0 ] || [ -n "${FORCE:-}" ]; then
  python3 bench/prefill.py --kv-tiles "${TILES:-64,64w8g,64s128w8g,64s168w4g}" \
    --out "$OUT/r/prefill_wgmma_ab.json" \
    >"$OUT/r/ab.log" 2>&1 || status=1
  grep -v -i warn "$OUT/r/ab.log" | tail -4
  if [ -n "${GRID:-}" ]; then
    timeout "${GRID_S:-240}" python3 bench/prefill.py --grid --kv-tiles 64w8g \
      --out "$OUT/r/prefill_wgmma_grid.json" >"$OUT/r/grid.log" 2>&1 || status=1
    grep -v -i warn "$OUT/r/grid.log" | tail -26
  fi
else
  grep -h -E "FAILED|Error|assert" "$OUT"/r/gpu_w*.log | head -30
fi
KEEP_R=1 session_end
