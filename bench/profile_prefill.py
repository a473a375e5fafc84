"""One causal prefill launch (B 4, L 4096, H 32, D 128, fp16, ragged KV), for Nsight Compute:

    ncu --clock-control none -k regex:prefill_mma -c 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        python3 bench/profile_prefill.py [--length 4096] [--batch 4]

The first launch whose name matches is the tensor-core kernel (the causal spec's value scan runs
before it under another name; its guarded twin after it).
"""

from __future__ import annotations

import argparse
import contextlib
import os

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prefill import tile_config  # noqa: E402

from nbinfer.api.prefill import BatchPrefillWithRaggedKVCacheWrapper  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--non-causal", action="store_true")
    ap.add_argument("--kv-tile", default=None,
                    help="the kernel's tile config, as bench/prefill.py --kv-tiles takes it "
                         "(64, 32, 32s168)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        if args.kv_tile:
            stack.enter_context(tile_config(args.kv_tile))
        profile(args)


def profile(args):
    B, L, H, D = args.batch, args.length, args.heads, args.head_dim
    q = torch.randn(B * L, H, D, device="cuda").half()
    k, v = torch.randn_like(q), torch.randn_like(q)
    ptr = np.arange(B + 1) * L
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8,
                                                         device="cuda"))
    w.plan(ptr, ptr, H, H, D, causal=not args.non_causal, q_data_type="float16")
    w.run(q, k, v)
    torch.cuda.synchronize()
    print(f"profiled: B {B} L {L} H {H} D {D}, {'non-causal' if args.non_causal else 'causal'}, "
          f"kv_tile {w.step_plan.spec.kv_tile}, {w.schedule.num_ctas} CTAs, "
          f"{w.schedule.num_work} work items")


if __name__ == "__main__":
    main()
