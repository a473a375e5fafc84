#!/usr/bin/env bash
# Fetch into .whl/ (at the repository root) the wheels a GPU machine needs beside its own Python:
# numpy 2.4.x for CPython 3.12 on manylinux x86-64. numba-cuda 0.30.4 breaks with numpy 2.5, which
# the H200 machine ships; installing this wheel into /tmp/site and putting that first on PYTHONPATH
# fixes it without touching the machine's packages. Also pytest-xdist (and execnet, its one
# dependency), pure Python: bench/gpu_check.sh spreads the gpu tests over its workers. Run it
# here (it needs the network), copy .whl/ along with the repository to the GPU machine, and
# start every command there with the line this script prints last.
#   bash bench/gpu_wheels.sh            # numpy, pytest-xdist, execnet
#   bash bench/gpu_wheels.sh PKG==VER   # more pinned wheels, same platform tags
set -euo pipefail
cd "$(dirname "$0")/.."

mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl numpy==2.4.6 pytest-xdist==3.8.0 execnet==2.1.2 "$@"

# Keep the wheels out of git without touching the tracked .gitignore.
if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi

echo
ls -1 .whl
echo
echo "Start every command on the GPU machine (from the repository root, .whl/ copied along) with:"
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;'
