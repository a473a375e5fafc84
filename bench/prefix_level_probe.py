"""The shared-prefix cascade's prefix level in several KV forms: where its time goes.

    python3 bench/prefix_level_probe.py [--forms paged,prefetch,hnd,ragged] [--out JSON]
    python3 bench/prefix_level_probe.py --once FORM      (for ncu: 4 calls of FORM, nothing timed)

The prefix level of bench/prefill.py's shared-prefix case: 64 queries (Hq 32, Hkv 8: 256 packed
rows per KV head) over one 8192-token prefix, D 128, fp16, non-causal; 8.6 GFLOP (q.k and p.v)
and 33.5 MB of K and V. At the lean kernel's 450 TFLOP/s (non-causal, B4 L4096 on an H100) the
FLOPs take ~19 us, the bytes ~10 us at 3.35 TB/s; session 30 measured 58.4 us under graph
replay (256 items of 512 keys, two 128-row tiles per KV head, the merge launch included):
~1.1 TB/s of K and V requested, a rate that did not grow with the items running at once
(session 24). Each form plans the same problem and is timed under graph replay; every output is
checked against the paged form's:

- ``paged``: the case's pages (16 tokens, NHD, random pool order), the api's rule (lean);
- ``prefetch``: the same with ``LEAN_PREFETCH`` (the next item's Q and first K / V tile
  requested during this item's last tile);
- ``hnd``: the same pages in the HND layout (a head's 16 rows of a page one 4 KiB run instead
  of 16 rows 2 KiB apart);
- ``ragged``: the prefix as contiguous K and V ``[8192, Hkv, D]`` (no page ids at all);
- ``split1024`` / ``split2048``: the paged form with fixed KV chunks (fewer, longer items).
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

from nbinfer.api import prefill as prefill_api  # noqa: E402
from nbinfer.api.prefill import (  # noqa: E402
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)

FORMS = ("paged", "prefetch", "hnd", "ragged", "split1024", "split2048")


def build(form, case, ws):
    """``(call, overrides)`` for ``form``: a planned zero-argument call and the api overrides
    it runs under."""
    hq, hkv, d, ps = case["heads"]
    q, cache, pre = case["q"], case["cache"], case["pre"]
    batch = q.shape[0]
    qo = np.array([0, batch])
    over = dict(LEAN_PREFETCH=True) if form == "prefetch" else {}
    with api_overrides(prefill_api, **over):
        if form == "ragged":
            idx = torch.as_tensor(pre, device=q.device, dtype=torch.long)
            k = cache[idx, 0].reshape(-1, hkv, d).contiguous()
            v = cache[idx, 1].reshape(-1, hkv, d).contiguous()
            w = BatchPrefillWithRaggedKVCacheWrapper(ws)
            w.plan(qo, np.array([0, k.shape[0]]), hq, hkv, d, q_data_type="float16")
            return (lambda: w.run(q, k, v)), over, w
        layout = "HND" if form == "hnd" else "NHD"
        kv = cache.transpose(2, 3).contiguous() if form == "hnd" else cache
        split = int(form[5:]) if form.startswith("split") else None
        w = BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=layout)
        w.plan(qo, np.array([0, pre.size]), pre, np.array([ps]), hq, hkv, d, ps,
               q_data_type="float16", fixed_split_size=split)
        return (lambda: w.run(q, kv)), over, w


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--once", default=None, help="run FORM four times untimed (ncu)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    case = shared_prefix_case()
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    forms = [a.once] if a.once else a.forms.split(",")
    for f in forms:
        if f not in FORMS:
            raise SystemExit(f"unknown form {f!r}; forms: {', '.join(FORMS)}")
    if a.once:
        call, over, _ = build(a.once, case, ws)
        with api_overrides(prefill_api, **over):
            for _ in range(4):
                call()
        torch.cuda.synchronize()
        return
    flops = 4 * case["q"].shape[0] * case["heads"][0] * case["pre"].size * case["heads"][3] \
        * case["heads"][2]
    kv_bytes = 2 * case["pre"].size * case["heads"][3] * case["heads"][1] * case["heads"][2] * 2
    results = dict(device=torch.cuda.get_device_name(), flops=flops, kv_bytes=kv_bytes, rows=[])
    ref = None
    print(f"prefix level: {flops / 1e9:.2f} GFLOP, {kv_bytes / 1e6:.1f} MB of K and V")
    print(f"{'form':>10} {'kernel':>22} {'items':>6} {'graph us':>9} {'gpu us':>8} "
          f"{'TFLOP/s':>8} {'KV TB/s':>8} {'max diff':>9}")
    for form in forms:
        call, over, w = build(form, case, ws)
        with api_overrides(prefill_api, **over):
            out = call().float()
            ref = out if ref is None else ref
            diff = float((out - ref).abs().max())
            g = graph_ms(call)
            b = back_to_back_ms(call)
        step = w.step_plan
        spec = step.spec
        kernel = type(spec).__name__ + ("(lean)" if getattr(spec, "lean", False) else "") \
            + ("+pf" if getattr(spec, "prefetch", False) else "")
        row = dict(form=form, kernel=kernel, items=int(step.schedule.num_work), graph_ms=g,
                   gpu_ms=b, tflops=flops / g / 1e9, kv_tbs=kv_bytes / g / 1e9, max_diff=diff)
        results["rows"].append(row)
        print(f"{form:>10} {kernel:>22} {row['items']:6d} {g * 1e3:9.1f} {b * 1e3:8.1f} "
              f"{row['tflops']:8.1f} {row['kv_tbs']:8.2f} {diff:9.2e}", flush=True)
        if not diff < 1e-2:
            raise SystemExit(f"{form}: max |diff| {diff} against the paged form")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
