"""Where a replayed decode step's host time goes, paged against cascade, on the GPU's host.

    python3 bench/engine_host_profile.py [--out JSON] [--top 25]

bench/engine.py's shared-prefix rows (Llama-3.2-1B shapes, bf16, 64 x (1024 + 256), 90 %
shared, CUDA graphs, overlap) measure the host half of a decode step (``decode_host_ms_p50``):
on the H200's host in session 24 0.70 ms for the paged step and 1.95 ms for the cascade step,
against 0.19 / 0.27 ms of engine work and 0.05 / 0.19 ms of plan() on the 2-core VM, where
the paged path is ~3x faster than that host and the cascade ~6x. This runs the two rows again
under cProfile (the timed run only; the warm-up loads kernels and captures the graphs) and
prints, per decode step, the functions with the most own time and the most cumulative time,
so the part of the cascade step that does not scale with the CPU's speed (a wait on the GPU,
a driver call) shows by name. Then the GPU side: the same rows eager under torch.profiler,
kernel time per decode step by kind (attention, append, layer kernels, GEMMs, other).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from engine import PAGE, make_requests  # noqa: E402 (this folder: python3 bench/...)
from engine_overlap_cpu import time_fetch  # noqa: E402

from nbinfer.engine import Engine, named_config  # noqa: E402
from nbinfer.engine.torch_model import TorchLlama  # noqa: E402
from nbinfer.engine.torch_runner import TorchRunner  # noqa: E402


def profiled(model, reqs, warm, *, prefix, cascade, graphs=True, overlap=True, top=25):
    """One engine run (after a warm-up on the same runner) under cProfile: per decode step
    host ms (wall less the fetch wait), and the top functions by own and cumulative time."""
    pages = sum(-(-(len(r.prompt) + r.max_new_tokens) // PAGE) for r in reqs) + 64
    runner = TorchRunner(model, pages, PAGE, cuda_graphs=graphs,
                         graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64), cascade_graphs=cascade)

    def engine():
        return Engine(runner, pages, PAGE, max_step_tokens=8192, max_batch=len(reqs),
                      prefix_cache=prefix, cascade="auto" if cascade else "off",
                      overlap=overlap)

    engine().run(warm)
    eng = engine()
    waited = time_fetch(runner)
    steps, last = [], [0.0]

    def on_step(rep):
        now = time.perf_counter()
        decode = all(n == 1 for _, n in rep.scheduled)
        steps.append((now - last[0], decode, waited[0]))
        last[0], waited[0] = now, 0.0

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    last[0] = time.perf_counter()
    prof.enable()
    eng.run(reqs, on_step=on_step)
    prof.disable()
    torch.cuda.synchronize()
    host = [(s - w) * 1e3 for s, d, w in steps if d]
    n = len(host)
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, ncalls, tt, ct, _) in st.stats.items():
        rows.append(dict(fn=f"{os.path.basename(file)}:{line}:{fn}", calls=ncalls / n,
                         own_us=tt / n * 1e6, cum_us=ct / n * 1e6))
    own = sorted(rows, key=lambda r: -r["own_us"])[:top]
    cum = sorted(rows, key=lambda r: -r["cum_us"])[:top]
    return dict(decode_steps=n, cascade_steps=eng.cascade_steps,
                host_ms_p50_profiled=float(np.median(host)), top_own=own, top_cum=cum)


def breakdown(model, reqs, *, prefix, cascade):
    """Kernel time per decode step by kind, eager, torch.profiler (bench/engine.py's kinds)."""
    from torch.profiler import ProfilerActivity, profile

    short = [type(r)(r.prompt, 8) for r in reqs]
    pages = sum(-(-(len(r.prompt) + 8) // PAGE) for r in short) + 64
    runner = TorchRunner(model, pages, PAGE)
    eng = Engine(runner, pages, PAGE, max_step_tokens=8192, max_batch=len(reqs),
                 prefix_cache=prefix, cascade="auto" if cascade else "off")
    for r in short:
        eng.add_request(r)
    while True:
        rep = eng.step()
        if not eng.waiting and all(k == 1 for _, k in rep.scheduled):
            break
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps = 0
        while eng.has_work:
            eng.step()
            steps += 1
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    for ev in prof.key_averages():
        name, us = ev.key.lower(), ev.self_device_time_total
        if not us:
            continue
        if "append" in name:
            kind = "append"
        elif any(k in name for k in ("rmsnorm", "silu_and_mul", "rope")):
            kind = "layer kernels"
        elif any(k in name for k in ("decode", "prefill", "value_scan", "attention", "merge")):
            kind = "attention"
        elif any(k in name for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul")):
            kind = "gemm"
        else:
            kind = "other"
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / steps
        names[ev.key[:80]] = us / steps
    top = dict(sorted(names.items(), key=lambda kv: -kv[1])[:12])
    return dict(steps=steps, ms_per_step=kinds, top_kernels_us_per_step=top,
                cascade_steps=eng.cascade_steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    cfg = named_config("llama-3.2-1b")
    model = TorchLlama.random(cfg, "cuda", torch.bfloat16, seed=0)
    rng = np.random.default_rng(0)
    shared = make_requests(rng, 64, 1024, 256, 0.9, cfg.vocab_size)
    warm = make_requests(rng, 64, 48, 4, 0.75, cfg.vocab_size)
    res = dict(device=torch.cuda.get_device_name())
    for name, kw in (("paged", dict(prefix=False, cascade=False)),
                     ("cascade", dict(prefix=True, cascade=True))):
        res[name] = profiled(model, shared, warm, top=a.top, **kw)
        res[name + " gpu"] = breakdown(model, shared, **kw)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for name in ("paged", "cascade"):
        r = res[name]
        print(f"== {name}: {r['decode_steps']} decode steps ({r['cascade_steps']} cascade), "
              f"host p50 {r['host_ms_p50_profiled']:.2f} ms under cProfile")
        print(f"{'own us/step':>12} {'cum us/step':>12} {'calls':>7}  function")
        for row in r["top_own"]:
            print(f"{row['own_us']:12.1f} {row['cum_us']:12.1f} {row['calls']:7.1f}  {row['fn']}")
        print("  by cumulative:")
        for row in r["top_cum"]:
            print(f"{row['own_us']:12.1f} {row['cum_us']:12.1f} {row['calls']:7.1f}  {row['fn']}")
        g = res[name + " gpu"]
        print(f"  gpu ms/step {json.dumps({k: round(v, 3) for k, v in g['ms_per_step'].items()})}")
        for k, v in g["top_kernels_us_per_step"].items():
            print(f"  {v:9.1f} us  {k}")


if __name__ == "__main__":
    main()
