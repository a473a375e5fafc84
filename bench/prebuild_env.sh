#!/usr/bin/env bash
# An interpreter with the H200 image's versions, for bench/prebuild_cache.py (a cache entry's
# key holds the Python, numba, numba-cuda, cuda-bindings and cuda-core versions; a hook's key
# holds its bytecode, so the Python's minor version matters too). The versions are those the
# device's own entries record (bench/prebuild_cache.py --versions-from checks them), nvJitLink
# the version whose ptxas the device's cubins name (13.0.88). NVVM comes from the CUDA toolkit
# on this machine (CUDA_HOME, default /usr/local/cuda: 13.0, as on the device).
#   bash bench/prebuild_env.sh [/tmp/py312]
set -euo pipefail
venv=${1:-/tmp/py312}
# a Python 3.12: $PYTHON312, else pyenv's, else python3.12 on PATH (a pyenv shim may not run)
py=${PYTHON312:-}
if [ -z "$py" ]; then
  for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 "$(command -v python3.12)"; do
    if [ -x "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null
    then py=$c; break; fi
  done
fi
[ -n "$py" ] || { echo "prebuild_env.sh: no Python 3.12 found (set PYTHON312)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --no-deps numba==0.68.0 llvmlite==0.50.0 numba-cuda==0.30.4 \
  cuda-bindings==13.3.1 cuda-core==1.2.0 cuda-pathfinder numpy==2.4.6 packaging \
  "nvidia-nvjitlink==13.0.88"
"$venv/bin/python" -c "import numba, numba.cuda; print('ok:', numba.__version__)"
