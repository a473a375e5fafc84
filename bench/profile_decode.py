"""One decode step at (batch, kv_len) = (64, 4096) by default, for Nsight Compute: three calls of
``run()``, so ``--launch-skip 2 -c 1`` profiles a warm one. ``--stages``: the KV ring's depth
(default the API's); ``--kv-dtype``: the cache's dtype (``float8_e4m3fn`` / ``float8_e5m2``:
the FP8 codes of the same random cache, scales 0.5 / 0.25, as ``bench/decode.py --fp8``);
``--mma 0/1``: ``DecodeSpec.mma`` (default the API's: tensor cores for FP8 only).

    ncu --clock-control none -k regex:decode -c 1 --launch-skip 2 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy python3 bench/profile_decode.py [--stages 3]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

import torch  # noqa: E402
from decode import FP8_SCALES, fp8_cache, paged_case  # noqa: E402

from nbinfer.api import decode as decode_api  # noqa: E402
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--kv-dtype", default="float16",
                    choices=("float16", "float8_e4m3fn", "float8_e5m2"))
    ap.add_argument("--mma", choices=("0", "1"), default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv-len", type=int, default=4096)
    args = ap.parse_args()
    decode_api.DECODE_STAGES = args.stages
    decode_api.DECODE_MMA = None if args.mma is None else args.mma == "1"
    hq, hkv, d, ps = 32, 8, 128, 16
    pt, cache, q = paged_case(args.batch, args.kv_len, hq=hq, hkv=hkv, d=d, ps=ps)
    kw = {}
    if args.kv_dtype != "float16":
        cache = fp8_cache(cache, args.kv_dtype)
        kw = dict(zip(("k_scale", "v_scale"), FP8_SCALES, strict=True))
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=torch.float16,
           kv_data_type=cache.dtype)
    for _ in range(3):
        w.run(q, cache, **kw)
    torch.cuda.synchronize()
    spec = w.step_plan.spec
    print(f"profiled: {args.kv_dtype} B{args.batch} L{args.kv_len}, stages {spec.stages}, "
          f"mma {spec.mma}, {w.schedule.num_ctas} CTAs")
