#!/usr/bin/env bash
# One device call for the lean warpgroup prefill (kernels/prefill_wgmma.py, issue 13 req 1):
# its gpu tests (paged, ragged, single, the non-finite rule, each plain, with LEAN_PREFETCH
# and with LEAN_LAZY_RESCALE, and the tensor-core kernel's warpgroup form, whose products it
# shares; three processes side by side, each compiling its own kernels), then, if they pass,
# bench/prefill.py's A/B of the mma.sync kernel and the lean kernel, plain, with its per-item
# overlap, its lazy rescale, and both (TILES, default 64,64w8gl,64w8glp,64w8glz,64w8glpz) with
# SDPA flash / cuDNN in the same process, then (GRID=1) the req 1 rows GRID_SHAPES with the
# plan's rule (nbinfer's default kernel), then (NCU=1) bench/ncu_prefill.sh at B4 L4096 causal
# (NCU_ARGS="--kv-tile 64w8glp": a rung's kernel instead of the rule's). SKIP_TESTS=1 goes
# straight to the timing (a second call, once the tests passed and the cache came back).
#   OUT=$OUT bash bench/session_wgmma_lean.sh
# shellcheck source=bench/session_lib.sh
source "$(dirname "$0")/session_lib.sh"
session_start
t() { python3 -m pytest -q -m gpu -p no:cacheprovider "$@"; }
p=tests/test_gpu_prefill.py
tn="tests/test_gpu_trust.py::test_prefill_nan_rule_on_the_tensor_core_kernel"
if [ -z "${SKIP_TESTS:-}" ]; then  # five processes side by side: compiling is the long pole
  pids=()
  for form in plain prefetch lazy; do  # the paged cases, one process per form
    t "$p::test_paged_prefill_gpu_wgmma_lean" -k "$form" >"$OUT/r/gpu_l_$form.log" 2>&1 &
    pids+=($!)
  done
  t "$p::test_ragged_prefill_gpu_wgmma_lean" "$tn[lean]" "$tn[lean-prefetch]" "$tn[lean-lazy]" \
    "$p::test_ragged_prefill_gpu_wgmma_lean_prefetch" >"$OUT/r/gpu_l_ragged.log" 2>&1 &
  pids+=($!)
  t "$p::test_ragged_and_single_prefill_gpu[True]" "$p::test_paged_prefill_gpu_wgmma[0]" \
    "$p::test_paged_prefill_gpu_wgmma[5]" >"$OUT/r/gpu_l_other.log" 2>&1 &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for f in "$OUT"/r/gpu_l_*.log; do echo "$(basename "$f" .log): $(tail -1 "$f")"; done
  echo "gpu tests: $((SECONDS - t0)) s"
fi
if [ $status = 0 ] || [ -n "${FORCE:-}" ]; then
  python3 bench/prefill.py --kv-tiles "${TILES:-64,64w8gl,64w8glp,64w8glz,64w8glpz}" \
    --out "$OUT/r/prefill_lean_ab.json" >"$OUT/r/ab.log" 2>&1 || status=1
  grep -v -i warn "$OUT/r/ab.log" | tail -4
  echo "a/b: $((SECONDS - t0)) s"
  if [ -n "${GRID:-}" ]; then
    timeout "${GRID_S:-240}" python3 bench/prefill.py --grid --grid-shapes \
      "${GRID_SHAPES:-bfloat16:128:4096,float16:64:4096,float16:128:1024,float16:128:16384}" \
      --out "$OUT/r/prefill_lean_grid.json" >"$OUT/r/grid.log" 2>&1 || status=1
    grep -v -i warn "$OUT/r/grid.log" | tail -10
  fi
  if [ -n "${NCU:-}" ]; then  # where the lean kernel's warps wait, per instruction
    # (NCU_ARGS: more profile_prefill.py options, e.g. "--kv-tile 64w8glp" for a rung)
    OUT="$OUT/r" bash bench/ncu_prefill.sh "--batch 4 --length 4096 ${NCU_ARGS:-}" \
      >"$OUT/r/ncu.log" 2>&1 || true
    rm -f "$OUT"/r/*.ncu-rep
  fi
else
  grep -h -E "FAILED|Error|assert" "$OUT"/r/gpu_l_*.log | head -30
fi
KEEP_R=1 session_end
