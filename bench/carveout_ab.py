"""Does the driver's shared-memory carveout cost the kernels that allocate shared memory at
launch? A/B in one process: each kernel timed with the driver's own choice (-1, the default)
and with the largest shared carveout asked for (100 %), on the same inputs.

Why (issue 13, session 12): the decode kernel with a three-stage KV ring (48 KiB at launch, four
CTAs per SM by the occupancy calculator) ran 30 % slower than with two (static), with the same
code in its hot loop; 1.33x is what a grid of 528 CTAs costs when only three of them fit per SM.

    python3 bench/carveout_ab.py --out bench/results/issue13/carveout_ab_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import CASES, gpu_ms, paged_case, save_json  # noqa: E402
from prefill import graph_ms, shared_prefix_case  # noqa: E402

from nbinfer.api import decode as decode_api  # noqa: E402
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from nbinfer.api.prefill import BatchPrefillWithRaggedKVCacheWrapper  # noqa: E402
from nbinfer.kernels.launch import _driver  # noqa: E402

CARVEOUTS = (-1, 100)


def kernels_of(launch):
    """The compiled kernels an AttentionLaunch fires (main, then its before / after twins)."""
    return [launch.launch.kernel] + [t.kernel for t in (*launch._before, *launch._after)]


def set_carveout(kernels, percent):
    for k in kernels:
        _driver().prefer_shared(k.handle, percent, k.function.device.id)


def ab(kernels, fn, timer):
    """``{carveout: ms}`` of ``fn`` under each carveout, in CARVEOUTS order, then the first
    again (an order effect would show as a difference between the two)."""
    out = {}
    for pct in (*CARVEOUTS, CARVEOUTS[0]):
        set_carveout(kernels, pct)
        out[f"{pct}" if f"{pct}" not in out else f"{pct}_again"] = timer(fn)
    return out


def decode_rows(stages_list):
    rows = []
    for stages in stages_list:
        decode_api.DECODE_STAGES = stages
        for batch, kv_len in CASES:
            pt, cache, q = paged_case(batch, kv_len)
            w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                               device="cuda"), "NHD")
            w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16,
                   q_data_type=torch.float16)
            out = torch.empty_like(q)
            ks = kernels_of(w.step_plan.launch)
            ms = ab(ks, lambda w=w, q=q, c=cache, o=out: w.run(q, c, out=o), gpu_ms)
            rows.append(dict(kernel="decode", stages=stages, batch=batch, kv_len=kv_len,
                             ctas=int(w.schedule.num_ctas),
                             dynamic_shared=[int(k.dynamic_shared) for k in ks], ms=ms))
            print(rows[-1], flush=True)
            del cache, w
            torch.cuda.empty_cache()
    decode_api.DECODE_STAGES = None
    return rows


def prefill_rows():
    rows = []
    B, L, H, d = 4, 4096, 32, 128
    q = torch.randn(B * L, H, d, device="cuda").half()
    k, v = torch.randn_like(q), torch.randn_like(q)
    ptr = np.arange(B + 1) * L
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8,
                                                         device="cuda"))
    for causal in (True, False):
        w.plan(ptr, ptr, H, H, d, causal=causal, q_data_type="float16")
        ks = kernels_of(w.step_plan.launch)
        flops = 4 * B * H * d * L * ((L + 1) / 2 if causal else L)
        ms = ab(ks, lambda: w.run(q, k, v), lambda f: gpu_ms(f, reps=5, rounds=5))
        rows.append(dict(kernel="prefill", causal=causal, ctas=int(w.schedule.num_ctas),
                         dynamic_shared=[int(x.dynamic_shared) for x in ks], ms=ms,
                         tflops={c: flops / t / 1e9 for c, t in ms.items()}))
        print(rows[-1], flush=True)
    return rows


def cascade_rows():
    case = shared_prefix_case()
    casc, plain, q, cache = case["casc"], case["plain"], case["q"], case["cache"]
    casc.plan(*case["levels"], *case["heads"], q_data_type="float16")
    ks = kernels_of(casc.fused_wrapper.step_plan.launch)
    plain_ms = graph_ms(lambda: plain.run(q, cache))
    ms = ab(ks, lambda: casc.run(q, cache), graph_ms)
    row = dict(kernel="cascade", ctas=int(casc.fused_wrapper.schedule.num_ctas),
               dynamic_shared=[int(x.dynamic_shared) for x in ks], graph_ms=ms,
               plain_graph_ms=plain_ms, x_graph={c: plain_ms / t for c, t in ms.items()})
    print(row, flush=True)
    return [row]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--stages", default="2,3,4", help="decode KV ring depths")
    ap.add_argument("--only", default="decode,prefill,cascade")
    args = ap.parse_args()
    parts = args.only.split(",")
    rows = []
    if "decode" in parts:
        rows += decode_rows([int(s) for s in args.stages.split(",")])
    if "prefill" in parts:
        rows += prefill_rows()
    if "cascade" in parts:
        rows += cascade_rows()
    save_json(args.out, carveout_ab=rows)
    print("\nkernel                       ctas  dyn KiB   ms at carveout " +
          "  ".join(f"{c:>7}" for c in (*CARVEOUTS, "again")))
    for r in rows:
        name = (f"decode S{r['stages']} B{r['batch']} L{r['kv_len']}" if r["kernel"] == "decode"
                else f"prefill {'causal' if r['causal'] else 'full'}" if r["kernel"] == "prefill"
                else "cascade (graph)")
        ms = r.get("ms") or r["graph_ms"]
        print(f"{name:28s} {r['ctas']:5d} {max(r['dynamic_shared']) / 1024:7.0f}   "
              + "  ".join(f"{v:7.3f}" for v in ms.values()))


if __name__ == "__main__":
    main()
