"""The shared-prefix cascade by KV chunk size: its prefix level alone, level by level, one launch.

    python3 bench/cascade_levels_sweep.py [--splits 0,512,1024,2048,4096]
                                          [--orders random[,sorted]] [--out JSON]

bench/prefill.py's shared-prefix case (64 requests x (8192 shared + 256 own) tokens, Hq 32,
Hkv 8, D 128, fp16, pages of 16). On the H200 (session 24, call 1) the one-launch cascade took
0.0885 ms under graph replay (4.77x plain decode; issue 13 req 2 asks 5x), and the level-by-
level form 0.096-0.098 ms, of which the own level on the decode kernel is ~0.024 ms. The
prefix level is 8.6 GFLOP (64 queries x 32 heads x 8192 keys x D 128, q.k and p.v): at the
lean warpgroup kernel's 270 TFLOP/s of a non-causal prefill that is ~32 us, while the one-
level plan measured 67 us (352 items of 768 keys on 64-row tiles, one per CTA). Its chunking
decides how many items share the SMs: 256 packed rows per KV head are two 128-row tiles of the
lean kernel, so 8 heads x 2 tiles x (8192 / chunk) items: 1024-key chunks give 128 items, one
wave on 132 SMs. Each split (0: the planner's own) is timed as the prefix level alone (the
paged prefill wrapper's rule: the lean kernel on sm_90), the two-level cascade level by level
and the one-launch cascade, each under CUDA-graph replay against plain decode, every output
checked against plain decode.

``--orders random,sorted`` repeats the sweep with the pool's pages handed out in order (the
prefix's 512 pages consecutive) instead of randomly. Session 24 found the prefix level's time
per 64-key tile growing with the number of items running at once (2.5 us at 32 items, 2.9 at
64, 5.7 at 128: together never more than ~22 tiles per us, ~0.7 TB/s of K and V), which no
per-SM resource explains: if it is where the pages lie (translation misses on random 64 KiB
pages spread over the 100 MB pool), the sorted pool runs the 1024-key chunks at ~2 us a tile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from prefill import api_overrides, back_to_back_ms, graph_ms, shared_prefix_case  # noqa: E402

from nbinfer.api import cascade as cascade_api  # noqa: E402
from nbinfer.api.cascade import MultiLevelCascadeAttentionWrapper  # noqa: E402
from nbinfer.api.prefill import BatchPrefillWithPagedKVCacheWrapper  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", default="0,512,1024,2048,4096")
    ap.add_argument("--orders", default="random")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    results = dict(device=torch.cuda.get_device_name())
    for order in a.orders.split(","):
        results[order] = sweep(order, a.splits)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


def sweep(order, splits):
    """The sweep over ``splits`` on a pool of page ids in ``order``."""
    case = shared_prefix_case(order=order)
    casc, plain, q, cache, levels = (case[k] for k in ("casc", "plain", "q", "cache", "levels"))
    hq, hkv, d, ps = case["heads"]
    pre = case["pre"]
    batch = q.shape[0]
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    ref = plain.run(q, cache).float()
    plain_graph = graph_ms(lambda: plain.run(q, cache))
    rows = []
    print(f"pages in {order} order; plain decode under graph replay: {plain_graph * 1e3:.1f} us")
    print(f"{'split':>6} {'prefix kernel':>14} {'items':>6} {'prefix gpu us':>14} "
          f"{'prefix graph us':>16} {'levels graph us':>16} {'one launch us':>14} "
          f"{'x levels':>9} {'x one':>7}")
    for split in (int(s) for s in splits.split(",")):
        fixed = split or None
        pw = BatchPrefillWithPagedKVCacheWrapper(ws)
        pw.plan(np.array([0, batch]), np.array([0, pre.size]), pre, np.array([ps]), hq, hkv, d,
                ps, q_data_type="float16", fixed_split_size=fixed)
        step = pw.step_plan
        spec = step.spec
        kernel = type(spec).__name__ + ("(lean)" if getattr(spec, "lean", False) else "")
        row = dict(split=split, prefix_kernel=kernel, prefix_items=int(step.schedule.num_work),
                   prefix_gpu_ms=back_to_back_ms(lambda pw=pw: pw.run(q, cache)),
                   prefix_graph_ms=graph_ms(lambda pw=pw: pw.run(q, cache)))
        lv = MultiLevelCascadeAttentionWrapper(2, ws)
        with api_overrides(cascade_api, CASCADE_LAUNCH="levels"):
            lv.plan(*levels, hq, hkv, d, ps, q_data_type="float16", fixed_split_size=fixed)
        row["levels_max_abs_diff"] = float((lv.run(q, cache).float() - ref).abs().max())
        row["levels_graph_ms"] = graph_ms(lambda lv=lv: lv.run(q, cache))
        casc.plan(*levels, hq, hkv, d, ps, q_data_type="float16", fixed_split_size=fixed)
        row["one_launch_items"] = int(casc.fused_wrapper.schedule.num_work)
        row["one_launch_max_abs_diff"] = float((casc.run(q, cache).float() - ref).abs().max())
        row["one_launch_graph_ms"] = graph_ms(lambda: casc.run(q, cache))
        row["x_levels"] = plain_graph / row["levels_graph_ms"]
        row["x_one_launch"] = plain_graph / row["one_launch_graph_ms"]
        rows.append(row)
        print(f"{split:6d} {kernel:>14} {row['prefix_items']:6d} "
              f"{row['prefix_gpu_ms'] * 1e3:14.1f} {row['prefix_graph_ms'] * 1e3:16.1f} "
              f"{row['levels_graph_ms'] * 1e3:16.1f} {row['one_launch_graph_ms'] * 1e3:14.1f} "
              f"{row['x_levels']:9.2f} {row['x_one_launch']:7.2f}", flush=True)
        worst = max(row["levels_max_abs_diff"], row["one_launch_max_abs_diff"])
        if not worst < 1e-2:
            raise SystemExit(f"split {split}: max |diff| {worst} against plain decode")
    return dict(plain_graph_ms=plain_graph, rows=rows)


if __name__ == "__main__":
    main()
