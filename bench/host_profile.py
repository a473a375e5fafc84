"""Where the host time of run() goes: cProfile over repeated batch-1 decode calls (torch tensors).

    python bench/host_profile.py [--calls 500]

Prints the wall time per call and the functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import paged_case  # noqa: E402

from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=500)
    args = ap.parse_args()
    pt, cache, q = paged_case(1, 512)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16, q_data_type=torch.float16)
    for _ in range(50):
        w.run(q, cache)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        w.run(q, cache)
    wall = (time.perf_counter() - t0) / args.calls * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        w.run(q, cache)
    prof.disable()
    torch.cuda.synchronize()
    print(f"run(): {wall:.1f} us per call (without the profiler)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
