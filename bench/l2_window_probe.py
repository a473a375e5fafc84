"""Does the cascade's merge tail shrink when its partial states stay in L2? (diagnostic)

The one-launch cascade of bench/prefill.py's shared-prefix case (64 x (8192 + 256), Hq 32,
Hkv 8, D 128, fp16) writes 9 partial states per output row (9.4 MB of float32) during its
tensor-core kernel, while ~100 MB of K and V stream through the 50 MB L2; the split-row merge
after it then reads them back, likely from DRAM, and ends ~8 us after the kernel
(bench/cascade_timeline.py, session 32). This probe marks the partial-state region of the
workspace as an L2 access-policy window (``hitProp`` persisting, a persisting set-aside of
``--set-aside-mib``) on the streams that run and capture the cascade, and measures, window off
and on alternately: the merge's tail after the kernel and the kernel's time (torch.profiler,
20 eager calls) and the step under CUDA-graph replay (captured on a stream carrying the
window, which its kernel nodes take).

    python3 bench/l2_window_probe.py [--rounds 2] [--set-aside-mib 16] [--out $OUT/l2_window.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from cuda.bindings import runtime as rt

sys.path.insert(0, os.path.dirname(__file__))
from cascade_timeline import timeline  # noqa: E402
from prefill import graph_ms, shared_prefix_case  # noqa: E402


def check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime error {err}")
    return result


def set_window(stream, base: int, nbytes: int, hit_ratio: float = 1.0) -> None:
    """The L2 access-policy window of ``stream`` (``nbytes`` 0: none): ``hit_ratio`` of its
    lines persisting (at most the set-aside's share, or they evict each other)."""
    value = rt.cudaStreamAttrValue()
    w = value.accessPolicyWindow
    w.base_ptr = base
    w.num_bytes = nbytes
    w.hitRatio = hit_ratio if nbytes else 0.0
    w.hitProp = rt.cudaAccessProperty.cudaAccessPropertyPersisting if nbytes else \
        rt.cudaAccessProperty.cudaAccessPropertyNormal
    w.missProp = rt.cudaAccessProperty.cudaAccessPropertyStreaming if nbytes else \
        rt.cudaAccessProperty.cudaAccessPropertyNormal
    check(rt.cudaStreamSetAttribute(stream.cuda_stream,
                                    rt.cudaStreamAttrID.cudaLaunchAttributeAccessPolicyWindow,
                                    value))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set-aside-mib", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    case = shared_prefix_case()
    casc, plain, q, cache = case["casc"], case["plain"], case["q"], case["cache"]
    run = lambda: casc.run(q, cache)  # noqa: E731
    run()
    launch = casc.fused_wrapper.step_plan.launch
    base, nbytes = launch._f32_addr, launch.layout.nbytes  # the partial states
    dev = torch.cuda.current_device()
    _, max_window = check(rt.cudaDeviceGetAttribute(
        rt.cudaDeviceAttr.cudaDevAttrMaxAccessPolicyWindowSize, dev))
    _, max_persist = check(rt.cudaDeviceGetAttribute(
        rt.cudaDeviceAttr.cudaDevAttrMaxPersistingL2CacheSize, dev))
    set_aside = min(args.set_aside_mib << 20, max_persist)
    check(rt.cudaDeviceSetLimit(rt.cudaLimit.cudaLimitPersistingL2CacheSize, set_aside))
    window = min(nbytes, max_window)
    print(f"partial states: {nbytes / 2**20:.1f} MiB at {base:#x}; window {window / 2**20:.1f} "
          f"MiB (device max {max_window / 2**20:.0f}), persisting set-aside "
          f"{set_aside / 2**20:.0f} MiB (max {max_persist / 2**20:.0f})")
    eager, capture = torch.cuda.current_stream(), torch.cuda.Stream()
    rows = []
    for r in range(args.rounds):
        for on in (False, True):
            for s in (eager, capture):
                set_window(s, base, window if on else 0, min(1.0, set_aside / window))
            check(rt.cudaCtxResetPersistingL2Cache())
            t = timeline(run)
            kernel = max(t["kernels"], key=lambda k: k["mean_us"] if "prefill" in k["kernel"]
                         else 0)
            row = dict(round=r, window=on, graph_us=1e3 * graph_ms(run, stream=capture),
                       merge_tail_us=t["merge_tail_us"], kernel_us=kernel["mean_us"])
            rows.append(row)
            tail = row["merge_tail_us"]
            print(f"round {r}, window {'on ' if on else 'off'}: graph {row['graph_us']:.1f} us, "
                  f"kernel {row['kernel_us']:.1f} us, "
                  + ("no merge" if tail is None else f"the merge ends {tail:.1f} us after it"))
    for s in (eager, capture):
        set_window(s, base, 0)
    plain_graph = 1e3 * graph_ms(lambda: plain.run(q, cache), stream=capture)
    print(f"plain decode under graph replay: {plain_graph:.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, plain_graph_us=plain_graph, window_bytes=window,
                           set_aside_bytes=set_aside), f, indent=1)


if __name__ == "__main__":
    main()
