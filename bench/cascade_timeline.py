"""Which kernels a cascade step launches, and how long each runs on the GPU (diagnostic).

    python bench/cascade_timeline.py [--out $OUT/cascade_timeline.json]
    ncu -k regex:prefill_mma -c 1 ... python bench/cascade_timeline.py --prefix-only
    ncu -k regex:'prefill_mma|split_merge' -c 2 ... python bench/cascade_timeline.py --cascade-only

The shared-prefix case of bench/prefill.py (64 requests x (8192 shared + 256 own) tokens, Hq 32,
Hkv 8, D 128, fp16, pages of 16): the cascade's prefix level alone should be ~16 KV tiles per
CTA of tensor-core work (8.6 GFLOP over 264 CTAs: ~15 us at the kernel's steady per-tile rate),
yet it measured ~0.10 ms. torch.profiler (CUPTI: it sees Numba's launches on the same stream)
lists every kernel of 20 calls of the cascade, of its prefix level alone and of plain decode, with
its count and mean duration, so that launches other than the attention kernel, and the gaps
between them, show.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from prefill import (  # noqa: E402
    api_overrides,
    back_to_back_ms,
    graph_ms,
    shared_prefix_case,
    tile_config,
)

from nbinfer.api import cascade as cascade_api  # noqa: E402
from nbinfer.api.cascade import MultiLevelCascadeAttentionWrapper  # noqa: E402
from nbinfer.api.prefill import BatchPrefillWithPagedKVCacheWrapper  # noqa: E402

CALLS = 20


def timeline(fn) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per = collections.defaultdict(list)
    for e in kernels:
        per[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    starts = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy = sum(end - start for start, end in starts)
    span = starts[-1][1] - starts[0][0] if starts else 0.0
    rows = [dict(kernel=name[:80], calls=len(ts), mean_us=float(np.mean(ts)),
                 total_us=float(np.sum(ts))) for name, ts in per.items()]
    rows.sort(key=lambda r: -r["total_us"])
    # The split-row merge's tail: how long after the kernel before it ends (the latest end
    # among the kernels started before it) the merge ends. As a programmatic dependent launch
    # it starts early and waits, so its own duration says nothing of what it adds to a step.
    tails, last_end = [], None
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        if "split_merge" in e.name:
            if last_end is not None:
                tails.append(e.time_range.end - last_end)
        else:
            last_end = e.time_range.end if last_end is None else max(last_end,
                                                                      e.time_range.end)
    return dict(kernels=rows, busy_us_per_call=busy / CALLS, span_us_per_call=span / CALLS,
                merge_tail_us=float(np.median(tails)) if tails else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--kv-tiles", default=None, metavar="T,T",
                    help="also time the cascade and its prefix level under these tensor-core "
                         "tile configs (as bench/prefill.py --kv-tiles: 64, 32x4, ...)")
    ap.add_argument("--prefix-only", action="store_true",
                    help="run the prefix level 5 times, no profiler (for ncu)")
    ap.add_argument("--cascade-only", action="store_true",
                    help="run the whole cascade 5 times, no profiler (for ncu)")
    args = ap.parse_args()
    case = shared_prefix_case()
    casc, plain, q, cache = case["casc"], case["plain"], case["q"], case["cache"]
    heads, ps, batch = case["heads"], case["heads"][3], q.shape[0]
    prefix_only = MultiLevelCascadeAttentionWrapper(
        1, torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))

    def plan_prefix():
        # the prefix level alone: every query row against the shared pages
        prefix_only.plan([np.array([0, batch])], [np.array([0, case["pre"].size])],
                         [case["pre"]], [np.array([ps])], *heads, q_data_type="float16")

    plan_prefix()
    if args.prefix_only or args.cascade_only:
        for _ in range(5):
            (prefix_only if args.prefix_only else casc).run(q, cache)
        torch.cuda.synchronize()
        return
    # The level-by-level form (CASCADE_LAUNCH "levels": the prefix level on the paged prefill
    # wrapper's rule, the lean kernel on sm_90, the own level on the decode kernel, then the
    # merge of the two) and the prefix level on the paged prefill wrapper alone.
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    levels = MultiLevelCascadeAttentionWrapper(2, ws)
    with api_overrides(cascade_api, CASCADE_LAUNCH="levels"):
        levels.plan(*case["levels"], *heads, q_data_type="float16")
    paged = BatchPrefillWithPagedKVCacheWrapper(ws)
    paged.plan(np.array([0, batch]), np.array([0, case["pre"].size]), case["pre"],
               np.array([ps]), *heads, q_data_type="float16")
    out = {}
    for name, fn in (("cascade", lambda: casc.run(q, cache)),
                     ("cascade_levels", lambda: levels.run(q, cache)),
                     ("prefix_level", lambda: prefix_only.run(q, cache)),
                     ("prefix_level_paged_prefill", lambda: paged.run(q, cache)),
                     ("plain_decode", lambda: plain.run(q, cache))):
        out[name] = timeline(fn)
        t = out[name]
        tail = t["merge_tail_us"]
        print(f"{name}: GPU busy {t['busy_us_per_call']:.1f} us per call, first to last kernel "
              f"{t['span_us_per_call']:.1f} us"
              + ("" if tail is None else f", the merge ends {tail:.1f} us after the kernel"))
        for r in t["kernels"]:
            print(f"    {r['calls']:4d} x {r['mean_us']:8.1f} us  {r['kernel']}")
    # The same problem under other tile configs (each planned inside its config): GPU time
    # back to back and, for the whole cascade, CUDA-graph replay as a serving step runs it.
    configs = []
    for token in (args.kv_tiles.split(",") if args.kv_tiles else []):
        with tile_config(token):
            casc.plan(*case["levels"], *heads, q_data_type="float16")
            plan_prefix()
        err = float((casc.run(q, cache).float() - plain.run(q, cache).float()).abs().max())
        row = dict(config=token, max_abs_diff=err,
                   prefix_gpu_ms=back_to_back_ms(lambda: prefix_only.run(q, cache)),
                   cascade_gpu_ms=back_to_back_ms(lambda: casc.run(q, cache)),
                   cascade_graph_ms=graph_ms(lambda: casc.run(q, cache)))
        configs.append(row)
        print(f"tiles {token}: prefix level {row['prefix_gpu_ms'] * 1e3:.1f} us, cascade "
              f"{row['cascade_gpu_ms'] * 1e3:.1f} us (graph {row['cascade_graph_ms'] * 1e3:.1f}),"
              f" max |cascade - plain| {err:.1e}")
    out["tile_configs"] = configs
    if configs:
        plain_graph = graph_ms(lambda: plain.run(q, cache))
        out["plain_graph_ms"] = plain_graph
        print(f"plain decode graph {plain_graph * 1e3:.1f} us: " + ", ".join(
            f"{r['config']} {plain_graph / r['cascade_graph_ms']:.2f}x" for r in configs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
