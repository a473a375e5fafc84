"""The tensor-core prefill's KV working set under plain LPT and under the L2 order (CPU only).

    python3 bench/l2_order.py [--sections 0,8,16,32] [--ctas 264]

For the prefill benchmark's problem (B4 L4096 H32 D128 fp16, 128-row tiles, causal and not),
plans each order with :func:`nbinfer.scheduler.plan` (``l2_section_kv`` from a section size in
MiB; 0: plain LPT) and replays the CTA queues with every item lasting its cost-model time (its
KV tiles of 64 keys plus the planner's four tiles of item overhead). At 200 moments it counts
the (request, head) pairs whose items are running and the KV bytes those items read (each
pair's KV up to the furthest key a running item of it reads). Reported: the makespan and mean
CTA load in tile times, the median and largest working set (MiB), the median pair count. The
H200's L2 holds 50 MB; what this cannot say is how much of a tile's time the L2 saves: that is
the device's A/B (``bench/prefill.py --kv-tiles 64w8gl,64w8glo16``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nbinfer.scheduler import plan  # noqa: E402

TILE, OVERHEAD_TILES = 64, 4


def replay(p, head_dim=128, itemsize=2, moments=200):
    """``(makespan, mean load, median MiB, max MiB, median pairs)`` of plan ``p``'s queues run
    with every item lasting its KV tiles plus the item overhead."""
    w = p.work.astype(np.int64)
    dur = -(-(w[:, 5] - w[:, 4]) // TILE) + OVERHEAD_TILES
    pair = w[:, 0] * p.num_kv_heads + w[:, 1]
    start, finish = np.zeros(len(w)), np.zeros(len(w))
    loads = np.zeros(p.num_ctas)
    for c in range(p.num_ctas):
        t = 0
        for item in p.cta_work[p.cta_indptr[c]:p.cta_indptr[c + 1]]:
            start[item], t = t, t + dur[item]
            finish[item] = t
        loads[c] = t
    mib, pairs = [], []
    for moment in np.linspace(0, loads.max(), moments, endpoint=False):
        running = (start <= moment) & (finish > moment)
        furthest = {}
        for q, ke in zip(pair[running].tolist(), w[running, 5].tolist(), strict=True):
            furthest[q] = max(furthest.get(q, 0), ke)
        mib.append(sum(furthest.values()) * 2 * head_dim * itemsize / 2**20)
        pairs.append(len(furthest))
    return loads.max(), loads.mean(), np.median(mib), max(mib), np.median(pairs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="0,8,16,32", help="section sizes in MiB (0: plain LPT)")
    ap.add_argument("--ctas", type=int, default=264, help="the grid (H200: 132 SMs x 2)")
    args = ap.parse_args()
    B, L, H, D = 4, 4096, 32, 128
    print(f"B{B} L{L} H{H} D{D} fp16 on {args.ctas} CTAs; times in tile times (64 keys)")
    print(f"{'mask':<10} {'section':>8} {'makespan':>9} {'mean':>7} {'MiB med':>8} "
          f"{'MiB max':>8} {'pairs':>6}")
    for causal in (True, False):
        for mib in (int(x) for x in args.sections.split(",")):
            p = plan(np.arange(B + 1) * L, np.full(B, L), H, H, args.ctas, granule=TILE,
                     causal=causal, tile_q=128, item_overhead=OVERHEAD_TILES * TILE,
                     l2_section_kv=(mib << 20) // (2 * D * 2) if mib else None)
            span, mean, med, top, pairs = replay(p, D)
            print(f"{'causal' if causal else 'full':<10} {mib or 'LPT':>8} {span:9.0f} "
                  f"{mean:7.0f} {med:8.0f} {top:8.0f} {pairs:6.0f}")


if __name__ == "__main__":
    main()
