"""Does the decode lose its last few percent to the grid's load balance? (issue 13, req 3)

At the issue's three decode shapes LPT leaves the persistent grid 3.1 % out of balance: 512
items of 4096 tokens on 528 CTAs (16 idle; 116 SMs run four items, 16 run three) at (64, 4096)
and (16, 32768) (chunks of 8192), 2048 items of 1024 on 528 CTAs at (256, 1024) (464 CTAs run
four, 64 run three). If the kernel is bound per SM (issue slots, the LSU) rather than by HBM
alone, the busiest SMs set the time and the step is ~3 % longer than its bytes need.

Two measurements, each against cuDNN SDPA (contiguous KV) in the same run:

1. **Batch 66 and 264 beside 64 and 256**: 528 and 2112 items, exactly four per SM. If the
   per-SM bound holds, nbinfer's time grows less than the bytes (~0 % instead of 3.1 %) while
   cuDNN's grows with them.
2. **A stream-K plan** (``probe_plans.stream_plan``): the (request, kv head) pairs laid end to end, cut
   into ``num_ctas`` equal spans at page boundaries, one span per CTA; a pair cut in two or
   three writes partial states that the kernel's fused merge combines (one merge list per cut
   pair: the fused merge already merges per (list, kv head)). Every CTA then reads the same
   bytes within a page. The plan goes through the wrapper's own NumPy planning
   path (the planner swapped for this one), so the kernel, layout and launch are the API's.

3. **The layout** (``--layouts``): the same kernel and LPT plan on the paged caches and on
   cuDNN's own layout, one page per request in HND (``HND:4096`` at L 4096: every head's K and
   V one contiguous 1 MiB run, as SDPA's ``[B, H, L, D]``), so that what paging costs the
   decode itself is measured beside cuDNN.

4. **The queues' order** (``--kinds`` with any of ``probe_plans.ORDERS``): LPT's own plan with its CTA
   queues permuted or reversed (``probe_plans.reordered``), the same loads and bitwise the same output,
   so that only the order in which the grid meets the items and which queues share an SM vary.

    python3 bench/balance_probe.py --out bench/results/issue13/balance_probe.json
    python3 bench/balance_probe.py --kinds lpt,rev,shuffle,stride,headmajor,within
    python3 bench/balance_probe.py --layouts NHD:16,HND:16,HND:4096 --cases 64:4096
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import decode as bench  # noqa: E402  (bench/decode.py: timing helpers, cases)
from probe_plans import planner  # noqa: E402

from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402


def wrapper_for(kind, pt, hq, hkv, d, ps, layout="NHD"):
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    with planner(kind):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
               q_data_type=torch.float16)
    return w


def check_stream():
    """The stream-K plan against the float64 reference on ragged lengths (an empty request
    too): bench/decode.py's own check, planned by ``probe_plans.stream_plan``."""
    kv_lens = [4096, 17, 0, 1000, 2500, 8000, 33]
    with planner("stream"):
        err, lerr = bench.check(len(kv_lens), kv_lens, 32, 8, 128, 16, torch.float16, "NHD")
    return dict(kv_lens=kv_lens, rel_err=err, lse_err=lerr)


def cudnn_times(q, hkv, kv_len):
    """cuDNN SDPA on contiguous ``[B, Hkv, L, D]`` K and V of ``q``'s shape: GPU and call ms."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa_fn

    batch, hq, d = q.shape
    k = torch.randn(batch, hkv, kv_len, d, dtype=q.dtype, device="cuda")
    v = torch.randn_like(k)
    q4 = q.view(batch, hq, 1, d)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fn = lambda: sdpa_fn(q4, k, v, enable_gqa=True)  # noqa: E731
        return dict(gpu_ms=bench.gpu_ms(fn), call_ms=bench.median_ms(fn))


def print_table(rows, names):
    """Each row's GPU ms per name, cuDNN's, and cuDNN / name in GPU time and per call."""
    print(f"\n{'case':14s} {'round':5s} " + " ".join(f"{n + ' ms':>12s}" for n in names)
          + f" {'cuDNN ms':>9s} " + " ".join(f"{n + ' x':>11s}" for n in names)
          + " " + " ".join(f"{n + ' call x':>14s}" for n in names))
    for row in rows:
        cu = row["cudnn"]
        print(f"B{row['batch']:<4d} L{row['kv_len']:<7d} {row['round']:5d} "
              + " ".join(f"{row[n]['gpu_ms']:12.4f}" for n in names)
              + f" {cu['gpu_ms']:9.4f} "
              + " ".join(f"{cu['gpu_ms'] / row[n]['gpu_ms']:11.3f}" for n in names)
              + " " + " ".join(f"{cu['call_ms'] / row[n]['call_ms']:14.3f}" for n in names))


def case(batch, kv_len, kinds):
    hkv, hq, d, ps = 8, 32, 128, 16
    pt, cache, q = bench.paged_case(batch, kv_len, hq=hq)
    kv_bytes = bench.kv_bytes_of(batch, kv_len, hkv, d)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")
    row = dict(batch=batch, kv_len=kv_len, kv_bytes=kv_bytes)
    ref = None
    for kind in kinds:
        w = wrapper_for(kind, pt, hq, hkv, d, ps)
        loads = w.schedule.cta_kv_tokens()
        run = lambda w=w: w.run(q, cache, out=out, lse=lse)  # noqa: E731
        run()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
            diff = 0.0
        else:
            diff = float((out.float() - ref.float()).abs().max())
        row[kind] = dict(gpu_ms=bench.gpu_ms(run), call_ms=bench.median_ms(run),
                         items=int(w.schedule.num_work), max_load=int(loads.max()),
                         mean_load=float(loads.mean()),
                         merge_lists=int(w.schedule.merge_rows.size), max_abs_diff=diff)
        del w
    row["cudnn"] = cudnn_times(q, hkv, kv_len)
    return row


def layout_row(batch, kv_len, layouts):
    """GPU and call time of the LPT plan on each ``(layout, page_size)``, cuDNN beside them."""
    hkv, hq, d = 8, 32, 128
    kv_bytes = bench.kv_bytes_of(batch, kv_len, hkv, d)
    q = torch.randn(batch, hq, d, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")
    row = dict(batch=batch, kv_len=kv_len, kv_bytes=kv_bytes)
    for layout, ps in layouts:
        rng = np.random.default_rng(0)
        # pages at random for page-sized runs; one page per request is contiguous by itself
        pt = bench.PageTable.from_kv_lens([kv_len] * batch, ps, rng=rng if ps < kv_len else None)
        shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
        cache = torch.randn(shape, dtype=torch.float16, device="cuda")
        w = wrapper_for("lpt", pt, hq, hkv, d, ps, layout)
        run = lambda w=w, cache=cache: w.run(q, cache, out=out, lse=lse)  # noqa: E731
        row[f"{layout}:{ps}"] = dict(gpu_ms=bench.gpu_ms(run), call_ms=bench.median_ms(run))
        del w, cache
        torch.cuda.empty_cache()
    row["cudnn"] = cudnn_times(q, hkv, kv_len)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="64:4096,66:4096,256:1024,264:1024,16:32768")
    ap.add_argument("--kinds", default="lpt,stream")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the cases (drift check)")
    ap.add_argument("--layouts", default="",
                    help="instead of the plans: LAYOUT:PAGE_SIZE pairs (NHD / HND) under LPT")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    if args.layouts:
        layouts = [(x.split(":")[0], int(x.split(":")[1])) for x in args.layouts.split(",")]
        names = [f"{lay}:{ps}" for lay, ps in layouts]
        rows = [dict(layout_row(b, L, layouts), round=r) for r in range(args.rounds)
                for b, L in cases]
        bench.save_json(args.out, layouts=rows)
        print_table(rows, names)
        return
    kinds = args.kinds.split(",")
    checks = check_stream() if "stream" in kinds else None
    print("stream plan check:", checks, flush=True)
    rows = []
    for r in range(args.rounds):
        for b, L in cases:
            row = dict(case(b, L, kinds), round=r)
            torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    bench.save_json(args.out, check=checks, rows=rows)
    print_table(rows, kinds)


if __name__ == "__main__":
    main()
