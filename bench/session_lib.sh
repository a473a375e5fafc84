# Sourced by the one-call device scripts (bench/session_*.sh): the environment every call sets up
# and the packing every call ends with. Not run on its own.
#   source "$(dirname "$0")/session_lib.sh"; session_start; ...; session_end   (exits $status)

# What every device script sets first: OUT (the folder whose files come back;
# /tmp/nbinfer-out off the device), the environment, the kernel cache in the checkout, status 0
# until something fails.
session_env() {
  set -uo pipefail
  OUT=${OUT:-/tmp/nbinfer-out}
  export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
  export NBINFER_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}
  bytecode_ready
  status=0
}

# This workplace sets PYTHONDONTWRITEBYTECODE=1 and the run prefix installs the carried wheels
# with --no-compile, so without this every Python process compiles numpy's and nbinfer's modules
# from source (numpy 0.18-0.21 s instead of 0.05 s, nbinfer's decode path 0.09 s instead of
# 0.02 s on the 2-core VM: bench/NOTES.md, session 22), which an installed package never does.
# Byte-compile them once per call, as a pip install does (compileall writes whatever the flag).
#
# Also the scheduler's compiled loops (Numba CPU functions, nbinfer/scheduler/_loops.py): Numba
# caches them beside their source, keyed by the file's mtime and size, which a fresh device
# machine's copy of the tree does not keep, so every fresh machine compiled them again (26 s on
# the 2-core VM, session 23). Their cache goes in the carried kernel cache instead, and the
# file's mtime is set from a hash of its content: the same source finds its cache on any machine
# (Numba keeps one entry per CPU model), an edited one misses.
bytecode_ready() {
  local dirs=(nbinfer)
  [ -d /tmp/site ] && dirs+=(/tmp/site)
  python3 -m compileall -q -j 0 "${dirs[@]}" >/dev/null 2>&1 || true
  export NUMBA_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}/numba-cpu
  local src=nbinfer/scheduler/_loops.py
  [ -f "$src" ] && touch -d "@$((16#$(sha1sum "$src" | cut -c1-7)))" "$src"
}

# session_env, $OUT/r for logs and JSON, t0 for elapsed times.
session_start() {
  session_env
  mkdir -p "$OUT/r"
  t0=$SECONDS
}

# Prints the GPU and sets tag (h200 or h100), which the scripts' file names carry.
session_gpu() {
  gpu=$(nvidia-smi -L | head -1)
  echo "$gpu"
  tag=h100
  case "$gpu" in *H200*) tag=h200 ;; esac
}

# With GRID set: req 1's other prefill rows (bf16, D 64, L 1024 / 16384) for the comma-separated
# tile tokens $1, into $OUT/r/grid_$2_$tag.json; a failure sets status.
session_prefill_grid() {
  [ -n "${GRID:-}" ] || return 0
  timeout 240 python3 bench/prefill.py --grid --grid-shapes \
    bfloat16:128:4096,float16:64:4096,float16:128:1024,float16:128:16384 \
    --kv-tiles "$1" --out "$OUT/r/grid_$2_$tag.json" >"$OUT/r/grid.log" 2>&1 || status=1
  grep "TFLOP" "$OUT/r/grid.log" | cut -c1-250
  echo "grid: $((SECONDS - t0)) s"
}

# On an H200 only: decode against cuDNN (bench/decode.py) and FP8 decode (--fp8), issue 13 reqs
# 3 and 5, into $OUT/r; a failure sets status.
session_h200_decode() {
  [ "$tag" = h200 ] || return 0
  timeout 150 python3 bench/decode.py --out "$OUT/r/decode_h200.json" >"$OUT/r/decode.log" \
    2>&1 || status=1
  tail -6 "$OUT/r/decode.log" | cut -c1-200
  timeout 150 python3 bench/decode.py --fp8 --out "$OUT/r/decode_fp8_h200.json" \
    >"$OUT/r/fp8.log" 2>&1 || status=1
  tail -8 "$OUT/r/fp8.log" | cut -c1-200
  echo "decode: $((SECONDS - t0)) s"
}

# On an H200 only: session_h200_decode, then bench/prefill.py (issue 13 reqs 1 and 2) into
# $OUT/r; a failure sets status.
session_h200_rows() {
  [ "$tag" = h200 ] || return 0
  session_h200_decode
  timeout 100 python3 bench/prefill.py --out "$OUT/r/prefill_h200.json" >"$OUT/r/prefill.log" \
    2>&1 || status=1
  tail -3 "$OUT/r/prefill.log" | cut -c1-200
}

# Packs $OUT/r into $OUT/results.tgz (KEEP_R=1 also leaves the files themselves), the kernel
# cache into $OUT/cache.tgz when CACHE_BACK is set, and exits with $status.
session_end() {
  echo "all: $((SECONDS - t0)) s, status $status"
  if [ -n "${KEEP_R:-}" ]; then
    (cd "$OUT" && tar czf results.tgz r)
  else
    (cd "$OUT" && tar czf results.tgz r && rm -rf r)
  fi
  if [ -n "${CACHE_BACK:-}" ]; then
    tar czf "$OUT/cache.tgz" -C "$(dirname "$NBINFER_CACHE_DIR")" \
      "$(basename "$NBINFER_CACHE_DIR")"
  fi
  exit "$status"
}

# The set-up of the Nsight Compute scripts (bench/ncu_*.sh): session_env, OUT created; exits
# when ncu is not on the PATH.
ncu_start() {
  session_env
  mkdir -p "$OUT"
  command -v ncu >/dev/null || { echo "ncu not found"; exit 1; }
}

# The key lines of one ncu report's text ($1): duration, throughputs, L2 hits, issue rate,
# registers, occupancy, and the stall reasons above 0.1 per issued instruction.
ncu_summary() {
  grep -E "profiled:|Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|lts__t_sector_hit|Issue Slots Busy|Executed Ipc A|Registers Per|Achieved Occ|Eligible Warps|Active Warps Per|issue_stalled_" \
    "$1" | awk '$NF+0 > 0.1 || !/issue_stalled/' | head -40
}
