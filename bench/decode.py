"""Batch decode on the GPU: correctness spot checks, then speed against torch SDPA.

Run on the H200 (bench/README.md gives the command prefix that bench/gpu_wheels.sh prepares):

    python bench/decode.py --out bench/results/decode_h200.json

Bytes counted per call: the K and V of every request and KV head, once (Q and O are < 0.1 %).
Bandwidth = bytes / median time. The floor is bytes / 4.22 TB/s (measured device copy ceiling).
Timing: CUDA events around each call, 5 warm-up calls, median of 30; the KV of each case is
larger than the 60 MB L2, so repeated calls stream from HBM.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import time
from unittest import mock

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

import nbinfer
from nbinfer import reference
from nbinfer.api import decode as decode_api
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper
from nbinfer.formats import PageTable

COPY_CEILING = 4.22e12
CASES = [(64, 4096), (256, 1024), (16, 32768)]


def kv_bytes_of(batch, kv_len, hkv, d, itemsize=2) -> int:
    """Bytes of K and V a decode step reads: every token of every request and KV head, once."""
    return batch * kv_len * hkv * d * 2 * itemsize


def save_json(path, **payload) -> None:
    """Write ``payload`` with the device's name to ``path`` (nothing when ``path`` is None)."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), **payload), f, indent=2)


def gpu_ms(fn, reps=20, rounds=5, warmup=3):
    """GPU time per call: ``reps`` calls issued back to back between two events (the host runs
    ahead of the GPU, so its launch cost is hidden), median over ``rounds``. This is the GPU
    time the issue compares; :func:`median_ms` times one call from an idle GPU, host included."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return float(np.median(times))


def median_ms(fn, warmup=5, iters=30):
    """Median over ``iters`` of one call between two events, each from an idle GPU (so the
    call's host cost before its kernels start is included)."""
    return gpu_ms(fn, reps=1, rounds=iters, warmup=warmup)


def paged_case(batch, kv_len, hq=32, hkv=8, d=128, ps=16, dtype=torch.float16, seed=0,
               layout="NHD"):
    rng = np.random.default_rng(seed)
    pt = PageTable.from_kv_lens([kv_len] * batch, ps, rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = torch.randn(shape, dtype=dtype, device="cuda")
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    return pt, cache, q


def check(batch, kv_lens, hq, hkv, d, ps, dtype, layout, variant=None, flags=None, seed=1):
    rng = np.random.default_rng(seed)
    pt = PageTable.from_kv_lens(kv_lens, ps, rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = torch.randn(shape, dtype=dtype, device="cuda")
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=dtype,
           variant=variant, **(flags or {}))
    torch.cuda.synchronize()
    o, lse = w.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q.float().cpu().numpy(), cache.float().cpu().numpy(), pt.indptr, pt.indices,
        pt.last_page_len, kv_layout=layout, variant=variant, return_lse=True, **(flags or {}))
    o = o.float().cpu().numpy()
    err = np.linalg.norm(o - ref_o) / max(np.linalg.norm(ref_o), 1e-30)
    lse = lse.cpu().numpy()
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
    return float(err), lerr


def kernel_resources(kernel):
    return dict(regs=int(kernel.regs), local_bytes=int(kernel.local_bytes),
                shared_bytes=int(kernel.shared_bytes))


def bench_case(batch, kv_len, sdpa=True, group=4, layout="NHD"):
    hkv, d, ps = 8, 128, 16
    hq = group * hkv
    pt, cache, q = paged_case(batch, kv_len, hq=hq, layout=layout)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=torch.float16)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")
    kv_bytes = kv_bytes_of(batch, kv_len, hkv, d)
    t = median_ms(lambda: w.run(q, cache, out=out, lse=lse))
    tg = gpu_ms(lambda: w.run(q, cache, out=out, lse=lse))
    res = dict(batch=batch, kv_len=kv_len, group=group, layout=layout,
               stages=int(w.step_plan.spec.stages),
               page_groups=bool(w.step_plan.spec.page_groups), mma=bool(w.step_plan.spec.mma),
               kv_bytes=kv_bytes, nbinfer_ms=t,
               nbinfer_tbps=kv_bytes / t / 1e9, nbinfer_gpu_ms=tg,
               nbinfer_gpu_tbps=kv_bytes / tg / 1e9, floor_ms=kv_bytes / COPY_CEILING * 1e3,
               work_items=int(w.schedule.num_work), chunk=int(w.schedule.kv_chunk),
               num_ctas=int(w.schedule.num_ctas),
               **kernel_resources(w.step_plan.launch.launch.kernel))
    # Host cost of one run() call (launch-bound: measured with the GPU idle between calls).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        w.run(q, cache, out=out, lse=lse)
    res["run_host_us"] = (time.perf_counter() - t0) / 20 * 1e6
    torch.cuda.synchronize()
    if sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa_fn

        k = torch.randn(batch, hkv, kv_len, d, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        q4 = q.view(batch, hq, 1, d)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    ts = median_ms(lambda: sdpa_fn(q4, k, v, enable_gqa=True))
                    tsg = gpu_ms(lambda: sdpa_fn(q4, k, v, enable_gqa=True))
                res[f"sdpa_{name}_ms"] = ts
                res[f"sdpa_{name}_tbps"] = kv_bytes / ts / 1e9
                res[f"sdpa_{name}_gpu_ms"] = tsg
            except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
                res[f"sdpa_{name}_error"] = str(exc)[:200]
        try:
            flex = _flex_attention()
            ts = median_ms(lambda: flex(q4, k, v, enable_gqa=True))
            res["flex_ms"], res["flex_tbps"] = ts, kv_bytes / ts / 1e9
        except Exception as exc:  # noqa: BLE001
            res["flex_error"] = str(exc)[:200]
        del k, v
    res["kernel_only_ms"] = kernel_only_ms(w, q, cache, out, lse)
    res["kernel_only_tbps"] = kv_bytes / res["kernel_only_ms"] / 1e9
    torch.cuda.empty_cache()
    return res


_FLEX = []


def _flex_attention():
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def kernel_only_ms(w, q, cache, out, lse, reps=20):
    """GPU time of the decode kernel alone: run() binds the arguments once, then the prepared
    launch is fired back to back between two events (no merge kernel, no host work)."""
    w.run(q, cache, out=out, lse=lse)
    return launch_ms(w.step_plan.launch.launch, reps)


def launch_ms(launch, reps=20):
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(3):
        launch(stream)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        launch(stream)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def host_overhead_us(n=200):
    """Wall time of run() per call for a batch-1 decode with torch tensors (kv_len 512): the GPU
    work (~10 us) is shorter than the host path, so calls queue no faster than Python issues them."""
    pt, cache, q = paged_case(1, 512)
    ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16, q_data_type=torch.float16)
    for _ in range(20):
        w.run(q, cache)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            w.run(q, cache)
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    from torch.nn.functional import scaled_dot_product_attention as sdpa_fn

    k = torch.randn(1, 8, 512, 128, dtype=torch.float16, device="cuda")
    q4 = q.view(1, 32, 1, 128)
    for _ in range(20):
        sdpa_fn(q4, k, k, enable_gqa=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        sdpa_fn(q4, k, k, enable_gqa=True)
    sdpa_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dict(run_us_median=float(np.median(times)), sdpa_default_us=sdpa_us)


def tensor_core_case(batch, kv_len, group, hkv=8, d=128, ps=16, kv_split=False):
    """The same decode step on the CUDA-core decode kernel and with ``use_tensor_cores=True``
    (a prefill of one row per request on the tensor-core kernel): GPU time of one run() each,
    fp16, and their largest difference. ``kv_split``: also the tensor-core kernel with its
    ``kv_split`` items forced on (key ``tensor_cores_kv_split``)."""
    from prefill import api_overrides  # (prefill.py imports this module at its top)

    hq = group * hkv
    pt, cache, q = paged_case(batch, kv_len, hq=hq, hkv=hkv, d=d, ps=ps)
    kv_bytes = kv_bytes_of(batch, kv_len, hkv, d)
    res = dict(batch=batch, kv_len=kv_len, group=group, hq=hq, hkv=hkv, kv_bytes=kv_bytes)
    outs = {}
    configs = [("cuda_cores", False, None), ("tensor_cores", True, None)]
    if kv_split:
        configs.append(("tensor_cores_kv_split", True, True))
    for name, tc, split in configs:
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                           device="cuda"), "NHD",
                                               use_tensor_cores=tc)
        with api_overrides(MMA_KV_SPLIT=split):
            w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
                   q_data_type=torch.float16)
        out = torch.empty_like(q)
        lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")
        t = median_ms(lambda w=w, out=out, lse=lse: w.run(q, cache, out=out, lse=lse))
        res[f"{name}_ms"], res[f"{name}_tbps"] = t, kv_bytes / t / 1e9
        res[f"{name}_kernel"] = type(w.step_plan.spec).__name__
        outs[name] = out
    res["max_abs_diff"] = float((outs["cuda_cores"].float() - outs["tensor_cores"].float())
                                .abs().max())
    res["tensor_cores_speedup"] = res["cuda_cores_ms"] / res["tensor_cores_ms"]
    if kv_split:
        res["kv_split_max_abs_diff"] = float((outs["cuda_cores"].float()
                                              - outs["tensor_cores_kv_split"].float()).abs().max())
    return res


FP8_SCALES = (0.5, 0.25)  # k_scale, v_scale of the benchmarks' FP8 caches


def fp8_cache(cache16, fmt, scales=FP8_SCALES):
    """``cache16`` (``[P, 2, ...]``, K then V) quantised to ``fmt`` as a serving system stores a
    scaled cache: K / k_scale and V / v_scale."""
    ks, vs = scales
    scale = torch.tensor([1 / ks, 1 / vs], device=cache16.device).view(1, 2, 1, 1, 1)
    return (cache16.float() * scale).to(getattr(torch, fmt))


def fp8_case(batch, kv_len, fmt, hkv=8, d=128, ps=16, group=4, fp8_settings=None,
             layout="NHD"):
    """The same decode step over an fp16 cache and over its FP8 quantisation (``fmt``, with
    k_scale / v_scale): GPU time back to back and per call of each, the speedup, and the FP8
    output's error against the float64 reference on the dequantised cache (two requests).
    ``fp8_settings``: ``nbinfer.api.decode`` settings (``DECODE_STAGES=3``, ...) for the FP8
    plan only; the fp16 step, the speedup's base, keeps the API's defaults."""
    hq = group * hkv
    pt, cache16, q = paged_case(batch, kv_len, hq=hq, hkv=hkv, d=d, ps=ps, layout=layout)
    ks, vs = FP8_SCALES
    cache8 = fp8_cache(cache16, fmt)
    res = dict(batch=batch, kv_len=kv_len, group=group, format=fmt, layout=layout)
    outs = {}
    for name, cache, kv_dtype, run_kw in (
            ("fp16", cache16, torch.float16, {}),
            ("fp8", cache8, fmt, dict(k_scale=ks, v_scale=vs))):
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                           device="cuda"), layout)
        settings = (fp8_settings or {}) if name == "fp8" else {}
        with mock.patch.multiple(decode_api, **settings) if settings else contextlib.nullcontext():
            w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
                   q_data_type=torch.float16, kv_data_type=kv_dtype)
        out = torch.empty_like(q)
        lse = torch.empty(batch, hq, dtype=torch.float32, device="cuda")

        def call(w=w, cache=cache, out=out, lse=lse, kw=run_kw):
            return w.run(q, cache, out=out, lse=lse, **kw)

        kv_bytes = kv_bytes_of(batch, kv_len, hkv, d, cache.element_size())
        t, tg = median_ms(call), gpu_ms(call)
        res.update({f"{name}_ms": t, f"{name}_gpu_ms": tg, f"{name}_kv_bytes": kv_bytes,
                    f"{name}_gpu_tbps": kv_bytes / tg / 1e9,
                    f"{name}_regs": int(w.step_plan.launch.launch.kernel.regs),
                    f"{name}_mma": bool(w.step_plan.spec.mma),
                    f"{name}_ctas": int(w.schedule.num_ctas),
                    f"{name}_local_bytes": int(w.step_plan.launch.launch.kernel.local_bytes)})
        outs[name] = out
    res["speedup_gpu"] = res["fp16_gpu_ms"] / res["fp8_gpu_ms"]
    res["speedup_call"] = res["fp16_ms"] / res["fp8_ms"]
    # correctness of the timed FP8 output: two requests against the float64 reference
    from nbinfer.reference import fp8 as fp8_ref

    codes = cache8.view(torch.uint8).cpu().numpy()
    rows = [0, batch - 1]
    sub = PageTable.from_kv_lens([kv_len] * len(rows), ps)
    pages = np.concatenate([pt.indices[pt.indptr[b]:pt.indptr[b + 1]] for b in rows])
    kv = (fp8_ref.decode(codes[pages, 0], fmt, ks), fp8_ref.decode(codes[pages, 1], fmt, vs))
    ref = reference.batch_decode_with_paged_kv_cache(
        q[rows].double().cpu().numpy(), kv, sub.indptr, np.arange(pages.size), sub.last_page_len,
        kv_layout=layout)
    got = outs["fp8"][rows].double().cpu().numpy()
    res["fp8_rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="the three cases only, no spot checks (lesson 04's live sweep)")
    ap.add_argument("--group", type=int, default=4,
                    help="GQA group of the sweep (Hkv 8, Hq 8 x group)")
    ap.add_argument("--stages", default="",
                    help="--sweep / --fp8: the decode kernel's KV ring depths to run, "
                         "comma-separated (default: the API's)")
    ap.add_argument("--max-registers", default="",
                    help="--fp8: DecodeSpec.max_registers values to run, comma-separated (0: no "
                         "cap; default: the API's, 128)")
    ap.add_argument("--ctas-per-sm", default="",
                    help="--sweep / --fp8: the decode grid's most CTAs per SM, comma-separated "
                         "(default: the API's, 4; fewer leave more of the SM's 256 KiB to L1)")
    ap.add_argument("--cases", default="",
                    help="--sweep / --fp8: the cases to run as B:L, comma-separated (default: "
                         "(64, 4096), (256, 1024), (16, 32768))")
    ap.add_argument("--formats", default="float8_e4m3fn,float8_e5m2",
                    help="--fp8: the FP8 formats to run, comma-separated")
    ap.add_argument("--page-groups", default="",
                    help="--sweep / --fp8: DecodeSpec.page_groups values to run, comma-separated "
                         "0/1 (default: the API's)")
    ap.add_argument("--mma", default="",
                    help="--sweep / --fp8: DecodeSpec.mma values to run (q.k and p.v on tensor "
                         "cores), comma-separated 0/1 (default: the API's: FP8 caches only)")
    ap.add_argument("--layout", default="NHD", choices=("NHD", "HND"),
                    help="--sweep / --fp8: the paged KV layout (NHD: a page's token rows hold every KV "
                         "head; HND: one KV head's page is one contiguous block)")
    ap.add_argument("--tensor-cores", action="store_true",
                    help="only use_tensor_cores=True against the CUDA-core decode, groups 4 and 8")
    ap.add_argument("--kv-split", action="store_true",
                    help="--tensor-cores: also the tensor-core kernel with kv_split items")
    ap.add_argument("--fp8", action="store_true",
                    help="only FP8 caches (--formats) against fp16 (the API's defaults), the "
                         "three cases or --cases")
    args = ap.parse_args()
    # options only some modes read, and the modes that read them
    both = ("sweep", "fp8")
    for opt, modes in (("kv_split", ("tensor_cores",)), ("stages", both), ("max_registers",
                       ("fp8",)), ("ctas_per_sm", both), ("cases", both), ("page_groups", both),
                       ("mma", both), ("layout", both), ("formats", ("fp8",))):
        given = getattr(args, opt) != ap.get_default(opt)
        if given and not any(getattr(args, m) for m in modes):
            ap.error(f"--{opt.replace('_', '-')} goes with "
                     + " or ".join(f"--{m.replace('_', '-')}" for m in modes))

    def flags(option, text):
        # A comma-separated 0/1 list as booleans; empty: [None], the API's default.
        bad = [x for x in text.split(",") if x and x not in ("0", "1")]
        if bad:
            ap.error(f"{option}: values are 0 or 1, got {', '.join(bad)}")
        return [x == "1" for x in text.split(",") if x] or [None]

    def ints(option, text):
        # A comma-separated list of non-negative integers; empty: [None], the API's default.
        try:
            vals = [int(x) for x in text.split(",") if x]
        except ValueError:
            ap.error(f"{option}: comma-separated integers expected, got {text!r}")
        if any(v < 0 for v in vals):
            ap.error(f"{option}: values must be >= 0, got {text!r}")
        return vals or [None]

    page_groups, mmas = flags("--page-groups", args.page_groups), flags("--mma", args.mma)
    stage_list, reg_list = ints("--stages", args.stages), ints("--max-registers", args.max_registers)
    per_sm_list = ints("--ctas-per-sm", args.ctas_per_sm)
    if any(v not in (None, 2, 3, 4) for v in stage_list):
        ap.error(f"--stages: 2, 3 or 4 (DecodeSpec.stages), got {args.stages!r}")
    if any(v is not None and v < 1 for v in per_sm_list):
        ap.error(f"--ctas-per-sm: values must be >= 1, got {args.ctas_per_sm!r}")
    try:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",") if c] or CASES
    except ValueError:
        ap.error(f"--cases: B:L pairs expected, got {args.cases!r}")
    if any(len(c) != 2 or min(c) < 1 for c in cases):
        ap.error(f"--cases: B:L pairs of positive integers expected, got {args.cases!r}")
    formats = [f for f in args.formats.split(",") if f]
    if not formats or set(formats) - {"float8_e4m3fn", "float8_e5m2"}:
        ap.error(f"--formats: float8_e4m3fn and/or float8_e5m2, got {args.formats!r}")
    if args.fp8:
        rows = []
        # The settings apply to the FP8 step only: its speedup is over fp16 with the defaults.
        for stages, regs, per_sm, pg, mma in itertools.product(
                stage_list, reg_list, per_sm_list, page_groups, mmas):
            settings = dict(DECODE_PAGE_GROUPS=pg, DECODE_MMA=mma, DECODE_STAGES=stages,
                            DECODE_MAX_REGISTERS=regs,
                            CTAS_PER_SM=per_sm or decode_api.CTAS_PER_SM)
            rows += [dict(fp8_case(b, l, fmt, fp8_settings=settings, layout=args.layout),
                          page_groups=pg, stages=stages, max_registers=regs, ctas_per_sm=per_sm)
                     for fmt in formats for b, l in cases]
        save_json(args.out, fp8=rows, copy_ceiling=COPY_CEILING)
        print("format         layout case          pg     mma fp16/fp8  S  cap  fp16 gpu ms  "
              "fp8 gpu ms  speedup gpu (call)  fp8 TB/s  regs/local CTAs  rel err")
        for r in rows:
            print(f"{r['format']:14s} {r['layout']} B{r['batch']:<4} L{r['kv_len']:<6} "
                  f"pg {r['page_groups']!s:5s}"
                  f" {r['fp16_mma']!s:5s}/{r['fp8_mma']!s:5s} {r['stages'] or '-'!s:2s}"
                  f" {r['max_registers'] if r['max_registers'] is not None else '-'!s:4s}"
                  f" {r['fp16_gpu_ms']:10.3f} "
                  f"{r['fp8_gpu_ms']:11.3f} {r['speedup_gpu']:8.2f} ({r['speedup_call']:.2f})"
                  f"   {r['fp8_gpu_tbps']:9.2f}  {r['fp8_regs']}/{r['fp8_local_bytes']}"
                  f" {r['fp8_ctas']} CTAs"
                  f"   {r['fp8_rel_err']:.1e}")
        return
    if args.tensor_cores:
        rows = [tensor_core_case(b, l, g, kv_split=args.kv_split) for g in (4, 8)
                for b, l in ((64, 4096), (16, 32768))]
        save_json(args.out, tensor_cores=rows)
        for r in rows:
            split = (f", kv_split {r['tensor_cores_kv_split_ms']:.3f} ms "
                     f"({r['tensor_cores_kv_split_tbps']:.2f} TB/s, max |diff| "
                     f"{r['kv_split_max_abs_diff']:.1e})" if args.kv_split else "")
            print(f"G{r['group']} B{r['batch']} L{r['kv_len']}: CUDA cores {r['cuda_cores_ms']:.3f}"
                  f" ms ({r['cuda_cores_tbps']:.2f} TB/s), tensor cores {r['tensor_cores_ms']:.3f}"
                  f" ms ({r['tensor_cores_tbps']:.2f} TB/s, {r['tensor_cores_kernel']}), "
                  f"max |diff| {r['max_abs_diff']:.1e}{split}")
        return
    if args.sweep:
        rows = []
        for stages, per_sm, pg, mma in itertools.product(stage_list, per_sm_list, page_groups,
                                                         mmas):
            with mock.patch.multiple(decode_api, DECODE_STAGES=stages, DECODE_PAGE_GROUPS=pg,
                                     DECODE_MMA=mma,
                                     CTAS_PER_SM=per_sm or decode_api.CTAS_PER_SM):
                rows += [bench_case(b, l, group=args.group, layout=args.layout)
                         for b, l in cases]
        payload = dict(copy_ceiling=COPY_CEILING, decode=rows)
        save_json(args.out, **payload)
        for r in payload["decode"]:
            cud = r["kv_bytes"] / r.get("sdpa_cudnn_gpu_ms", float("nan")) / 1e9
            print(f"G{r['group']} B{r['batch']} L{r['kv_len']} {r['layout']} S{r['stages']}"
                  f"{' page groups' if r['page_groups'] else ''}{' mma' if r['mma'] else ''}: "
                  f"GPU time back to "
                  f"back: nbinfer {r['nbinfer_gpu_ms']:.3f} ms {r['nbinfer_gpu_tbps']:.2f} TB/s "
                  f"({r['regs']} regs, {r['num_ctas']} CTAs), cuDNN "
                  f"{r.get('sdpa_cudnn_gpu_ms', float('nan')):.3f} ms {cud:.2f} TB/s")
        return
    from nbinfer import variants as V

    checks = []
    configs = [
        (4, [1, 100, 1000, 4097], 32, 8, 128, 16, torch.float16, "NHD", None, None),
        (3, [7, 333, 2049], 8, 8, 64, 1, torch.float16, "HND", None, None),
        (3, [7, 333, 2049], 32, 4, 256, 5, torch.bfloat16, "NHD", None, None),
        (2, [50, 3000], 8, 1, 128, 16, torch.float32, "NHD", None, None),
        (2, [50, 3000], 32, 8, 128, 16, torch.float16, "NHD", None, dict(logits_soft_cap=30.0)),
        (2, [50, 3000], 32, 8, 128, 16, torch.float16, "NHD", None, dict(window_left=100)),
        (2, [50, 3000], 32, 8, 128, 16, torch.float16, "NHD", None,
         dict(pos_encoding_mode="ROPE_LLAMA")),
        (2, [50, 3000], 32, 8, 128, 16, torch.float16, "NHD", None,
         dict(pos_encoding_mode="ALIBI")),
        (2, [50, 3000], 32, 8, 128, 16, torch.float16, "NHD", V.sigmoid_attention(0.5, -1.0), None),
        (2, [50, 3000], 32, 8, 128, 16, torch.float16, "NHD",
         V.attention_sink(np.linspace(-1, 2, 32)), None),
    ]
    for cfg in configs:
        b, lens, hq, hkv, d, ps, dt, lay, var, flags = cfg
        try:
            err, lerr = check(b, lens, hq, hkv, d, ps, dt, lay, var, flags)
            checks.append(dict(cfg=f"B{b} Hq{hq} Hkv{hkv} D{d} ps{ps} {dt} {lay} "
                                   f"{var.name if var else ''} {flags or ''}", rel_err=err,
                               lse_err=lerr))
        except Exception as exc:  # noqa: BLE001
            checks.append(dict(cfg=str(cfg[:8]), error=repr(exc)[:500]))
        print(checks[-1], flush=True)
    results = [bench_case(b, l) for b, l in (CASES[:1] if args.quick else CASES)]
    host = host_overhead_us()
    save_json(args.out, nbinfer=nbinfer.__version__, checks=checks, decode=results,
              host_overhead=host, copy_ceiling=COPY_CEILING)
    # "call": one call from an idle GPU (host cost included); "gpu": back-to-back GPU time
    print("\ncase         call ms  gpu ms kernel ms  TB/s  %ceil | cudnn call ms gpu ms | "
          "ratio call gpu | flash TB/s | flex TB/s | regs")
    for r in results:
        cud = r.get("sdpa_cudnn_ms", float("nan"))
        cudg = r.get("sdpa_cudnn_gpu_ms", float("nan"))
        print(f"B{r['batch']:<4} L{r['kv_len']:<6} {r['nbinfer_ms']:7.3f} {r['nbinfer_gpu_ms']:7.3f} "
              f"{r['kernel_only_ms']:8.3f} "
              f"{r['kernel_only_tbps']:5.2f} {r['kernel_only_tbps'] / 4.22 * 100:5.1f} | "
              f"{cud:10.3f} {cudg:6.3f} | {cud / r['nbinfer_ms']:5.2f} {cudg / r['nbinfer_gpu_ms']:4.2f} | "
              f"{r.get('sdpa_flash_tbps', 0):10.2f} | {r.get('flex_tbps', 0):9.2f} | {r['regs']:4d}")
    print(f"run() host cost, batch 1, torch tensors: {host['run_us_median']:.1f} us per call "
          f"(torch SDPA call: {host['sdpa_default_us']:.1f} us)")
    bad = [c for c in checks if "error" in c or c["rel_err"] > 2e-2]
    print(f"checks: {len(checks) - len(bad)} ok, {len(bad)} bad")


if __name__ == "__main__":
    main()
