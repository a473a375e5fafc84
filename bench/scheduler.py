"""Load balance on the H200: skewed batches with the LPT plan vs a plan that never splits.

    python bench/scheduler.py --out bench/results/scheduler_h200.json

fp16, Hq 32, Hkv 8, D 128, page 16, pages randomly permuted. Cases:
a) one request of 32768 tokens plus 63 of 512; b) one request of 131072 tokens;
c) 128 requests with Zipf-distributed lengths (mean about 2000, capped at 32768).
For each: GPU time (the bound launch fired back to back, median) and run() time (CUDA events
around each call, host work included), effective bandwidth (KV bytes / GPU time), the same batch
with ``fixed_split_size`` = longest request (no request is split: one CTA per request and KV
head), and torch SDPA (cuDNN) on the batch padded to its longest request, all in one run.
Also the CPU cost of plan() for 256 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import COPY_CEILING, launch_ms, median_ms  # noqa: E402

from nbinfer import scheduler  # noqa: E402
from nbinfer.api.decode import MIN_CHUNK, BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from nbinfer.formats import PageTable  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16


def zipf_lengths(rng, n=128, mean=2000, cap=32768):
    """Zipf(1.3) lengths clipped to [16, cap], scaled so that the mean after clipping is ~mean."""
    raw = np.minimum(rng.zipf(1.3, size=n).astype(np.float64), 1e6)
    scale = mean / raw.mean()
    for _ in range(50):  # clipping lowers the mean: rescale until it settles
        lens = np.clip(np.rint(raw * scale), 16, cap)
        scale *= mean / lens.mean()
    return lens.astype(np.int64)


def cases(rng):
    return {
        "a_skewed_32768+63x512": np.array([32768] + [512] * 63),
        "b_single_131072": np.array([131072]),
        "c_zipf_128": zipf_lengths(rng),
    }


def sdpa_padded_ms(lens):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa_fn

    b, longest = len(lens), int(max(lens))
    k = torch.randn(b, HKV, longest, D, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(b, HQ, 1, D, dtype=torch.float16, device="cuda")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return median_ms(lambda: sdpa_fn(q, k, v, enable_gqa=True))


def bench_case(name, lens, rng):
    res = run_nbinfer(name, lens, rng)
    torch.cuda.empty_cache()
    res["sdpa_cudnn_padded_ms"] = sdpa_padded_ms(lens)
    torch.cuda.empty_cache()
    res["speedup_vs_nosplit"] = res["nosplit"]["ms"] / res["lpt"]["ms"]
    res["speedup_vs_sdpa_padded"] = res["sdpa_cudnn_padded_ms"] / res["lpt"]["ms"]
    return res


def run_nbinfer(name, lens, rng):
    pt = PageTable.from_kv_lens(lens, PS, rng=rng)
    cache = torch.randn(pt.num_pages, 2, PS, HKV, D, device="cuda").half()
    q = torch.randn(len(lens), HQ, D, device="cuda").half()
    out = torch.empty_like(q)
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    kv_bytes = int(np.sum(lens)) * HKV * D * 2 * 2
    res = dict(case=name, batch=len(lens), total_kv=int(np.sum(lens)), max_kv=int(max(lens)),
               kv_bytes=kv_bytes, floor_ms=kv_bytes / COPY_CEILING * 1e3)
    for label, fixed in (("lpt", None), ("nosplit", int(max(lens)))):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16",
               fixed_split_size=fixed)
        sched = w.schedule
        run_ms = median_ms(lambda: w.run(q, cache, out=out))
        # GPU time: the bound launch fired back to back (run() adds ~20 us of host work that a
        # serving loop overlaps with the previous layer's GPU time).
        ms = float(np.median([launch_ms(w.step_plan.launch.launch) for _ in range(5)]))
        loads = sched.cta_loads()
        bandwidth = kv_bytes / (ms * 1e-3)
        res[label] = dict(ms=ms, run_ms=run_ms, tbps=bandwidth / 1e12,
                          pct_ceiling=bandwidth / COPY_CEILING * 100,
                          work_items=sched.num_work, merge_rows=sched.num_merge_rows,
                          kv_chunk=sched.kv_chunk,
                          max_load_over_mean=float(loads.max() / max(loads.mean(), 1e-9)))
    return res


def plan_cost_us(rng, n=256, reps=200):
    lens = rng.integers(1, 8192, size=n)
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count * 4
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        scheduler.plan(np.arange(n + 1), lens, HQ, HKV, num_ctas, granule=MIN_CHUNK)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = [bench_case(name, lens, rng) for name, lens in cases(rng).items()]
    plan_us = plan_cost_us(rng)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), cases=rows,
                           plan_us_256_requests=plan_us, copy_ceiling=COPY_CEILING), f, indent=2)
    print("\ncase                      LPT ms  TB/s  %ceil | no-split ms TB/s | speedup | "
          "SDPA padded ms  x")
    for r in rows:
        a, n = r["lpt"], r["nosplit"]
        print(f"{r['case']:<25} {a['ms']:6.3f} {a['tbps']:5.2f} {a['pct_ceiling']:5.1f} | "
              f"{n['ms']:11.3f} {n['tbps']:4.2f} | {r['speedup_vs_nosplit']:7.2f} | "
              f"{r['sdpa_cudnn_padded_ms']:14.3f} {r['speedup_vs_sdpa_padded']:5.2f}")
    print(f"plan() for 256 requests: {plan_us:.0f} us")


if __name__ == "__main__":
    main()
