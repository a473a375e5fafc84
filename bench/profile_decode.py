"""One decode launch at (batch 64, kv_len 4096), for Nsight Compute (``--stages``: the KV ring's
depth, default the API's):

    ncu --clock-control none -k regex:decode -c 1 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python3 bench/profile_decode.py [--stages 3]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from decode import bench_case  # noqa: E402

from nbinfer.api import decode as decode_api  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=None)
    decode_api.DECODE_STAGES = ap.parse_args().stages
    print(bench_case(64, 4096, sdpa=False))
