"""Host cost of a decode step: plan() per batch size and run() at batch 1 (H200 host, torch).

    python bench/host.py --out bench/results/issue14/host_h200.json [--profile]

What is timed (CPU wall time; nothing here waits for the GPU except where stated):

- ``plan()`` of a decode step (Hq 32, Hkv 8, D 128, page 16, fp16) for 1-256 requests, with the
  page table given as pinned host int32 tensors and as CUDA int32 tensors (FlashInfer's plan
  takes host arrays; device ones cost a device-to-host copy and so a synchronisation). KV
  lengths are drawn uniformly from [512, 4096] with a fixed seed (mixed lengths: the scheduler
  splits some requests and not others). Median of ``--calls`` calls, each timed alone, in ten
  rounds that take every case in turn (the host's speed drifts).
- a wrapper's first ``plan()`` (the NumPy planner: the compiled one loads on the second), on
  fresh wrappers;
- ``run()`` at batch 1 (KV 512, split in two and merged inside the kernel): median per call over
  30 rounds of 200 back-to-back calls, with and without ``out=``; beside it, in the same rounds, the
  prepared launch alone (``cuLaunchKernel`` on a ready argument block: the floor run() builds
  on) and torch SDPA on the same problem (contiguous KV). The GPU finishes a batch-1 step in a
  few us, faster than the host issues them, so the queue never fills and the host time is what
  is measured.
- the layer kernels' api calls (``fused_add_rmsnorm``, ``silu_and_mul``,
  ``apply_rope_with_cos_sin_cache``) at a Llama-3.2-1B decode step of 64 rows in bf16, beside
  the torch operations they replace in the torch model, interleaved the same way.

``--profile`` adds cProfile listings of plan() (batch 1, 64 and 256, pinned inputs) to the output.
The last lines are a table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from nbinfer.formats import PageTable  # noqa: E402

HQ, HKV, D, PS = 32, 8, 128, 16
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def page_tables(batch, seed=0):
    """Pinned host and CUDA int32 copies of one page table with lengths in [512, 4096]."""
    rng = np.random.default_rng(seed + batch)
    lens = rng.integers(512, 4097, size=batch)
    pt = PageTable.from_kv_lens(lens, PS, rng=rng)
    host = tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).pin_memory()
                 for a in (pt.indptr, pt.indices, pt.last_page_len))
    dev = tuple(t.to("cuda") for t in host)
    return pt, host, dev


def per_call_us(fn, calls):
    """Median wall time of ``calls`` calls of ``fn``, each timed alone, in us."""
    times = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times[i] = time.perf_counter_ns() - t0
    return float(np.median(times)) / 1e3


def interleaved_us(fns: dict, rounds=30, calls=200) -> dict:
    """Median over ``rounds`` of the mean time of ``calls`` back-to-back calls, in us, for each
    function, the functions taking turns round by round (the host's speed drifts by tens of
    per cent within a run, so figures compared with each other are measured interleaved)."""
    for fn in fns.values():
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    means = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            means[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
            torch.cuda.synchronize()
    return {name: float(np.median(m)) for name, m in means.items()}


def plan_costs(ws, calls, profile, rounds=10):
    """plan() per batch size and table kind: ``rounds`` rounds, each timing ``calls / rounds``
    calls of every (batch, kind) in turn, the median over all of them. The host's speed drifts
    by tens of per cent over seconds; timing one batch size after another put that drift
    between batch sizes (session 7: batch 16 slower than 32, CUDA tables at 64 slower than at
    128), taking turns spreads it over all of them. One wrapper per batch size, as a serving
    loop's consecutive steps keep theirs."""
    cases, listings = {}, {}
    for batch in BATCHES:
        pt, host, dev = page_tables(batch)
        w = BatchDecodeWithPagedKVCacheWrapper(ws)
        for kind, table in (("pinned", host), ("device", dev)):
            def plan(w=w, table=table):
                w.plan(*table, HQ, HKV, D, PS, q_data_type=torch.float16)
            plan()  # the first call compiles or loads the kernel
            plan()  # the second loads the compiled planner
            cases[batch, kind] = (int(pt.indices.size), plan, [], table)
    per_round = max(calls // rounds, 1)
    for _ in range(rounds):
        for _, fn, samples, _ in cases.values():
            t = np.empty(per_round)
            for i in range(per_round):
                t0 = time.perf_counter_ns()
                fn()
                t[i] = time.perf_counter_ns() - t0
            samples.extend(t / 1e3)
    rows = []
    for batch in BATCHES:
        pages, _, pinned, host = cases[batch, "pinned"]
        row = {"batch": batch, "pages": pages, "plan_pinned_us": float(np.median(pinned)),
               "plan_device_us": float(np.median(cases[batch, "device"][2]))}
        # a wrapper's first plan(): the NumPy planner (the compiled one is loaded on the second)
        fresh = [BatchDecodeWithPagedKVCacheWrapper(ws) for _ in range(30)]
        it = iter(fresh)
        row["plan_first_us"] = per_call_us(
            lambda it=it, host=host: next(it).plan(*host, HQ, HKV, D, PS,
                                                   q_data_type=torch.float16), 30)
        rows.append(row)
        if profile and batch in (1, 64, 256):
            w = BatchDecodeWithPagedKVCacheWrapper(ws)
            for _ in range(3):
                w.plan(*host, HQ, HKV, D, PS, q_data_type=torch.float16)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                w.plan(*host, HQ, HKV, D, PS, q_data_type=torch.float16)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            listings[f"plan_b{batch}"] = s.getvalue()
    return rows, listings


def run_costs(ws):
    kv_len = 512
    pt = PageTable.from_kv_lens([kv_len], PS, rng=np.random.default_rng(1))
    cache = torch.randn(pt.num_pages, 2, PS, HKV, D, dtype=torch.float16, device="cuda")
    q = torch.randn(1, HQ, D, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    w = BatchDecodeWithPagedKVCacheWrapper(ws)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type=torch.float16)
    launch = w.step_plan.launch
    stream = torch.cuda.current_stream().cuda_stream
    # torch SDPA on the same problem, contiguous KV (the anchor the issue names)
    k = torch.randn(1, HKV, kv_len, D, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    q4 = q.view(1, HQ, 1, D)
    res = interleaved_us({
        "run_us": lambda: w.run(q, cache),
        "run_out_us": lambda: w.run(q, cache, out=out),
        "empty_like_us": lambda: torch.empty_like(q),  # the output run() allocates
        "launch_only_us": lambda: launch(stream),
        "sdpa_us": lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v,
                                                                            enable_gqa=True)})
    return res


def layer_costs():
    """Host time per call of the layer kernels (nbinfer.api.layers) at a Llama-3.2-1B decode
    step of 64 rows (bf16), beside the torch operations they replace in ``TorchLlama``'s torch
    form, interleaved: what the fused model costs the host in an eager step."""
    import nbinfer
    from nbinfer.engine.torch_model import TorchLlama
    from nbinfer.reference.layers import cos_sin_cache

    n, hidden, inter, hq, hk, d = 64, 2048, 8192, 32, 8, 64
    bf = torch.bfloat16
    x = torch.randn(n, hidden, device="cuda").to(bf)
    r = torch.randn(n, hidden, device="cuda").to(bf)
    w = torch.ones(hidden, device="cuda")
    gu = torch.randn(n, 2 * inter, device="cuda").to(bf)
    qkv = torch.randn(n, (hq + 2 * hk) * d, device="cuda").to(bf)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
    pos = torch.arange(1000, 1000 + n, device="cuda")
    inv = 1.0 / 500000.0 ** (np.arange(0, d, 2) / d)
    table = torch.as_tensor(cos_sin_cache(inv, 4096), device="cuda")
    ang = pos[:, None].float() * torch.as_tensor(inv, dtype=torch.float32, device="cuda")[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    rms = torch.nn.functional.rms_norm

    def torch_add_norm():
        s = r + x
        return rms(s.float(), (hidden,), w, 1e-5).to(bf)

    return interleaved_us({
        "fused_add_rmsnorm_us": lambda: nbinfer.fused_add_rmsnorm(x, r, w, 1e-5),
        "torch_add_rmsnorm_us": torch_add_norm,
        "silu_and_mul_us": lambda: nbinfer.silu_and_mul(gu),
        "torch_silu_mul_us": lambda: torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:],
        "rope_us": lambda: nbinfer.apply_rope_with_cos_sin_cache(pos, q, k, d, table),
        "torch_rope_us": lambda: (TorchLlama._rotate(q.view(n, hq, d), cos, sin),
                                  TorchLlama._rotate(k.view(n, hk, d), cos, sin))},
        rounds=10, calls=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    rows, listings = plan_costs(ws, args.calls, args.profile)
    run = run_costs(ws)
    layers = layer_costs()
    result = {"device": torch.cuda.get_device_name(), "problem": {"Hq": HQ, "Hkv": HKV, "D": D,
              "page_size": PS, "dtype": "float16", "kv_lens": "uniform in [512, 4096], seed 0"},
              "plan": rows, "run_batch1": run, "layer_ops_batch64_bf16": layers,
              "profiles": listings}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for name, text in listings.items():
        print(f"--- {name}\n{text}")
    print("batch  pages  plan pinned us  plan device us  first plan us")
    for r in rows:
        print(f"{r['batch']:5d} {r['pages']:6d} {r['plan_pinned_us']:15.1f} "
              f"{r['plan_device_us']:15.1f} {r['plan_first_us']:14.1f}")
    print("run() batch 1: " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()))
    print("layer ops, batch 64: " + ", ".join(f"{k} {v:.1f}" for k, v in layers.items()))


if __name__ == "__main__":
    main()
