"""One decode launch at (batch 64, kv_len 4096), for Nsight Compute:

    ncu --clock-control none -k regex:decode -c 1 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python3 bench/profile_decode.py
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from decode import bench_case  # noqa: E402

if __name__ == "__main__":
    print(bench_case(64, 4096, sdpa=False))
