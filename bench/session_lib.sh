# Sourced by the one-call device scripts (bench/session_*.sh): the environment every call sets up
# and the packing every call ends with. Not run on its own.
#   source "$(dirname "$0")/session_lib.sh"; session_start; ...; session_end   (exits $status)

# OUT (the folder whose files come back; /tmp/nbinfer-out off the device), $OUT/r for logs and
# JSON, the kernel cache in the checkout, t0 for elapsed times, status 0 until something fails.
session_start() {
  set -uo pipefail
  OUT=${OUT:-/tmp/nbinfer-out}
  mkdir -p "$OUT/r"
  export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PYTHONUNBUFFERED=1
  export NBINFER_CACHE_DIR=${NBINFER_CACHE_DIR:-$PWD/.nbinfer-cache}
  t0=$SECONDS
  status=0
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
