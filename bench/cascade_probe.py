"""Where the prefix level's time goes (diagnostic for bench/prefill.py's shared-prefix case).

    python bench/cascade_probe.py --out $OUT/cascade_probe.json

The prefix level of the shared-prefix benchmark is 64 query rows x G=4 = 256 packed rows per KV
head against 8192 keys (8 KV heads, D 128, fp16): 8.6 GFLOP, 33.5 MB of KV. It runs as a paged
prefill. This probe times the same problem
  * paged (page 16) and ragged (contiguous KV), so the page-table gather's cost shows,
  * with fixed KV chunks of 512 ... 8192 tokens (8192 = no split, no merge: 32 items), so the
    per-item rate and the merge tail separate,
  * and a non-causal ragged prefill big enough for many waves (the kernel's steady rate).
GPU time: 20 back-to-back calls per event pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from prefill import back_to_back_ms  # noqa: E402

from nbinfer.api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,  # noqa: E402
    BatchPrefillWithRaggedKVCacheWrapper,  # noqa: E402
)

HQ, HKV, D, PS = 32, 8, 128, 16


def tflops(rows, keys, ms):
    return 4.0 * rows * keys * D * HQ / (ms * 1e9)


def probe(rows=64, keys=8192, splits=(512, 1024, 2048, 4096, 8192, None)):
    ws = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    q = torch.randn(rows, HQ, D, device="cuda").half()
    k = torch.randn(keys, HKV, D, device="cuda").half()
    v = torch.randn_like(k)
    pages = keys // PS
    perm = torch.randperm(pages, device="cuda")
    cache = torch.empty(pages, 2, PS, HKV, D, device="cuda").half()
    cache[perm, 0] = k.view(pages, PS, HKV, D)
    cache[perm, 1] = v.view(pages, PS, HKV, D)
    out = []
    for split in splits:
        rg = BatchPrefillWithRaggedKVCacheWrapper(ws[0])
        rg.plan([0, rows], [0, keys], HQ, HKV, D, q_data_type="float16", fixed_split_size=split)
        pg = BatchPrefillWithPagedKVCacheWrapper(ws[1])
        pg.plan([0, rows], [0, pages], perm.cpu().numpy(), [PS], HQ, HKV, D, PS,
                q_data_type="float16", fixed_split_size=split)
        a, b = rg.run(q, k, v), pg.run(q, cache)
        diff = float((a.float() - b.float()).abs().max())
        t_r = back_to_back_ms(lambda rg=rg: rg.run(q, k, v))
        t_p = back_to_back_ms(lambda pg=pg: pg.run(q, cache))
        sched = pg.schedule
        out.append(dict(split=split, items=int(sched.num_work), kv_chunk=int(sched.kv_chunk),
                        ragged_ms=t_r, paged_ms=t_p, ragged_tflops=tflops(rows, keys, t_r),
                        paged_tflops=tflops(rows, keys, t_p), max_abs_diff=diff))
    return out


def steady(B=4, L=4096):
    q = torch.randn(B * L, HQ, D, device="cuda").half()
    k = torch.randn(B * L, HKV, D, device="cuda").half()
    v = torch.randn_like(k)
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8,
                                                         device="cuda"))
    ptr = np.arange(B + 1) * L
    w.plan(ptr, ptr, HQ, HKV, D, q_data_type="float16")
    ms = back_to_back_ms(lambda: w.run(q, k, v), n=5)
    return dict(B=B, L=L, ms=ms, tflops=4.0 * B * L * L * D * HQ / (ms * 1e9))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = probe()
    st = steady()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), prefix=rows, steady=st), f,
                      indent=2)
    print(f"non-causal ragged B{st['B']} L{st['L']} Hkv {HKV}: {st['ms']:.3f} ms, "
          f"{st['tflops']:.1f} TFLOP/s")
    print(" split  items chunk  ragged ms TF/s   paged ms TF/s   max|diff|")
    for r in rows:
        print(f" {r['split']!s:>5} {r['items']:6d} {r['kv_chunk']:5d}  {r['ragged_ms']:.4f} "
              f"{r['ragged_tflops']:5.1f}   {r['paged_ms']:.4f} {r['paged_tflops']:5.1f}   "
              f"{r['max_abs_diff']:.1e}")


if __name__ == "__main__":
    main()
