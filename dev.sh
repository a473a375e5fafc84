#!/usr/bin/env bash
# nbinfer's task runner: `bash dev.sh` (or `bash dev.sh help`) lists the tasks.
set -euo pipefail

usage() {
  cat <<'USAGE'
usage: bash dev.sh TASK [ARGS...]   (each task creates or reuses the virtual environment .venv/)
  demo       the main job: a small random paged batch decode, checked against dense attention
  test       the test suite (the simulator stands in for the GPU when there is none)
  figures    regenerate every figure under figures/ from the lessons
  notebooks  regenerate the executed lessons/*.ipynb from their lessons/*.py scripts
  lab        JupyterLab on lessons/
  lint       ruff
  help       this list
GPU benchmarks: bench/README.md
USAGE
}

cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.nbinfer-installed

ensure_venv() {
  # Reinstall only when pyproject.toml changed since the last install.
  local want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then return; fi
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e ".[dev,lessons]"
  echo "$want" > "$STAMP"
}

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# Without a GPU, Numba's CUDA simulator runs the kernels on the CPU.
use_sim_without_gpu() { has_gpu || export NUMBA_ENABLE_CUDASIM=1; }

task=${1:-help}
shift || true
case "$task" in
  demo)      ensure_venv; use_sim_without_gpu; exec "$VENV/bin/python" -m nbinfer.demo "$@" ;;
  # In the simulator the tests are CPU-bound and independent: two processes (CI has two cores),
  # idle ones taking work from busy ones. On a GPU one process (kernels compile on first use).
  test)      ensure_venv; use_sim_without_gpu
             exec "$VENV/bin/python" -m pytest -q ${NUMBA_ENABLE_CUDASIM:+-n 2 --dist worksteal} "$@" ;;
  figures)   ensure_venv; export NUMBA_ENABLE_CUDASIM=1 MPLBACKEND=Agg; exec "$VENV/bin/python" -m nbinfer.lessons_tool figures "$@" ;;
  notebooks) ensure_venv; export NUMBA_ENABLE_CUDASIM=1 MPLBACKEND=Agg; exec "$VENV/bin/python" -m nbinfer.lessons_tool notebooks "$@" ;;
  lint)      ensure_venv; exec "$VENV/bin/ruff" check nbinfer tests lessons bench "$@" ;;
  lab)       ensure_venv
             exec "$VENV/bin/jupyter" lab --notebook-dir=lessons "$@" ;;
  help|-h|--help) usage ;;
  *) echo "dev.sh: unknown task '$task'" >&2; usage >&2; exit 2 ;;
esac
