"""Does the order of causal prefill work items matter through L2? (H200, one process.)

    python bench/order_probe.py [--out FILE] [--batch 4] [--length 4096]

The planner deals work items to CTAs largest first (LPT). For a causal prefill of equal-length
requests that means the CTAs running at any moment hold the same query tile of every
(request, head): B x H different K/V streams of L x D x 2 x 2 bytes each (4 x 32 x 2 MiB =
256 MiB at the benchmark's shape, against 60 MiB of L2), each read by about two CTAs at once.
Each 64-row tile re-reads its head's K/V from 0 to its diagonal, so about 8.7 GB of K/V reads
reach L2 per call, and Nsight Compute saw DRAM at 34 % of its peak while warps waited on long
scoreboard (bench/NOTES.md, "Issue 13, session 8").

The probe re-deals the same work items (the plan's own items, chunks and reduction map) in
head-major order: all items of (request, head) pairs 0, 1, ... in turn, each group largest first,
each item to the least-loaded CTA. Then the CTAs running together share a few heads' K/V, which
L2 holds, at the price of a worse balance (printed: each deal's makespan against the lower bound
``max(total / CTAs, largest item)``). Both deals run through ``with_schedule`` on the same inputs;
their outputs must be equal bit for bit (the same items compute the same rows). Prediction for
the first run: if DRAM latency is what the long-scoreboard stalls wait on, head-major is 5-15 %
faster; if not, equal within noise or slower by its imbalance.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))


def head_major_deal(plan):
    """``plan`` with its work items re-dealt to its CTAs in head-major order (see above)."""
    work = plan.work
    costs = plan.item_costs()
    order = np.lexsort((np.arange(plan.num_work), -costs, work[:, 1], work[:, 0]))
    loads = [(0.0, c) for c in range(plan.num_ctas)]
    queues = [[] for _ in range(plan.num_ctas)]
    for i in order:
        load, c = heapq.heappop(loads)
        queues[c].append(int(i))
        heapq.heappush(loads, (load + float(costs[i]), c))
    indptr = np.zeros(plan.num_ctas + 1, np.int32)
    indptr[1:] = np.cumsum([len(q) for q in queues])
    cta_work = np.array([i for q in queues for i in q], np.int32)
    return dataclasses.replace(plan, cta_indptr=indptr, cta_work=cta_work)


def makespan(plan) -> float:
    """Largest summed item cost over the CTAs, over the lower bound of any deal."""
    return float(plan.cta_loads().max() / plan.lower_bound())


def main():
    import torch
    from decode import median_ms, save_json

    from nbinfer.api.prefill import BatchPrefillWithRaggedKVCacheWrapper

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    args = ap.parse_args()
    B, L, H, D = args.batch, args.length, 32, 128
    flops = 4 * B * H * D * L * (L + 1) / 2
    q = torch.randn(B * L, H, D, device="cuda").half()
    k, v = torch.randn_like(q), torch.randn_like(q)
    ptr = np.arange(B + 1) * L
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8,
                                                         device="cuda"))
    w.plan(ptr, ptr, H, H, D, causal=True, q_data_type="float16")
    lpt = w.schedule
    deals = {"lpt": lpt, "head_major": head_major_deal(lpt)}
    res = dict(B=B, L=L, H=H, D=D, flops=flops, kv_tile=w.step_plan.spec.kv_tile,
               num_ctas=lpt.num_ctas, items=lpt.num_work)
    outs = {}
    for _ in range(2):  # two rounds, alternating, against drift
        for name, plan in deals.items():
            w.with_schedule(plan)
            outs[name] = w.run(q, k, v).clone()
            ms = median_ms(lambda: w.run(q, k, v), warmup=2, iters=10)
            res.setdefault(f"{name}_ms", []).append(ms)
    for name, plan in deals.items():
        res[f"{name}_makespan_over_bound"] = makespan(plan)
        res[f"{name}_tflops"] = flops / min(res[f"{name}_ms"]) / 1e9
    res["outputs_equal"] = bool(torch.equal(outs["lpt"], outs["head_major"]))
    save_json(args.out, order_probe=res)
    for name in deals:
        print(f"{name:10s}: {res[f'{name}_tflops']:.1f} TFLOP/s (ms {res[f'{name}_ms']}), "
              f"makespan / bound {res[f'{name}_makespan_over_bound']:.3f}")
    print(f"outputs equal bit for bit: {res['outputs_equal']}")


if __name__ == "__main__":
    main()
