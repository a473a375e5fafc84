"""The main job: a small random paged batch decode, computed three ways and checked.

1. the float64 reference engine through the page table (``nbinfer.reference``);
2. plain dense attention over each request's keys, gathered by hand from the page table;
3. nbinfer's decode kernels (``BatchDecodeWithPagedKVCacheWrapper``): on the GPU when there is one,
   else in Numba's CUDA simulator (set by ``bash dev.sh demo`` when no GPU is present).

Run: ``bash dev.sh demo`` (or ``python -m nbinfer.demo --help``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from . import reference
from .api.decode import BatchDecodeWithPagedKVCacheWrapper
from .formats import PageTable


def dense_decode(q, k, v, sm_scale):
    """Softmax attention of one request, written out plainly: q [Hq, D], k/v [L, Hkv, D]."""
    hq, hkv = q.shape[0], k.shape[1]
    out = np.zeros(q.shape)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        s = kh @ q[h] * sm_scale
        w = np.exp(s - s.max())
        out[h] = w @ vh / w.sum()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kv-lens", type=int, nargs="+", default=[5, 37, 18], help="KV length per request")
    ap.add_argument("--num-qo-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    hq, hkv, d, ps = args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size
    pages_needed = sum(-(-n // ps) for n in args.kv_lens)
    pt = PageTable.from_kv_lens(args.kv_lens, ps, num_pages=pages_needed + 3, rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, ps, hkv, d)).astype(np.float16)
    q = rng.standard_normal((pt.batch_size, hq, d)).astype(np.float16)
    sm_scale = 1.0 / np.sqrt(d)

    print(f"paged batch decode: {pt.batch_size} requests, kv_lens {list(args.kv_lens)}, "
          f"Hq={hq} Hkv={hkv} D={d}, page_size={ps}, {pt.num_pages} physical pages (permuted)")
    print(f"  kv_indptr      {pt.indptr.tolist()}")
    print(f"  kv_indices     {pt.indices.tolist()}")
    print(f"  last_page_len  {pt.last_page_len.tolist()}")

    ref_o, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True)
    dense = np.stack([
        dense_decode(q[b].astype(np.float64),
                     cache[:, 0].reshape(-1, hkv, d)[pt.token_slots(b)].astype(np.float64),
                     cache[:, 1].reshape(-1, hkv, d)[pt.token_slots(b)].astype(np.float64),
                     sm_scale)
        for b in range(pt.batch_size)])
    err_ref = float(np.abs(ref_o - dense).max())

    ws = np.zeros(16 << 20, dtype=np.uint8)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    backend = wrapper.backend
    if backend == "cuda":
        from numba import cuda

        ws = cuda.device_array(16 << 20, dtype=np.uint8)
        wrapper = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    wrapper.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type="float16")
    t0 = time.perf_counter()
    out, lse = wrapper.run(q, cache, return_lse=True)
    elapsed = time.perf_counter() - t0
    out = np.asarray(out, dtype=np.float64)
    err_kernel = float(np.linalg.norm(out - ref_o) / np.linalg.norm(ref_o))
    err_lse = float(np.abs(np.asarray(lse) - ref_lse).max())

    print(f"\nreference engine (float64) vs dense attention: max |diff| = {err_ref:.2e}")
    where = {"cuda": "decode kernel on the GPU",
             "sim": "decode kernel in the CUDA simulator (no GPU here)",
             "reference": "reference engine (no GPU and no simulator)"}[backend]
    print(f"{where}: {elapsed * 1e3:.1f} ms, rel. error vs reference "
          f"{err_kernel:.2e}, max LSE error {err_lse:.2e}")
    print(f"output[0, 0, :4] = {np.round(out[0, 0, :4], 4).tolist()}  "
          f"(reference {np.round(ref_o[0, 0, :4], 4).tolist()})")
    ok = err_ref < 1e-9 and err_kernel < 2e-3 and err_lse < 1e-3
    print("CHECK PASSED" if ok else "CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
