"""The CUDA-core prefill kernel on a grid of four CTAs per SM (the old fixed grid) against the
grid the driver's occupancy calculator gives (the kernel's registers allow three per SM).

Counted first: with four per SM but three resident, a quarter of the CTAs start only when a
resident one has finished its whole queue; LPT balanced the queues for one wave, so the step
should take about 4/3 of the time on the old grid (up to 1.33x faster on the new one).

fp32 (the CUDA-core kernel's main use: fp32 inputs, or head_dim 256), causal and not, ragged KV,
B 4, L 2048, H 32, D 128; GPU time per run() back to back, median of 5 rounds; each output
compared with torch SDPA (math backend, fp32) and the two grids' outputs with each other.

    python3 bench/prefill_grid_ab.py --out bench/results/issue13/prefill_grid_ab_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import gpu_ms, save_json  # noqa: E402

import nbinfer.api.prefill as api_prefill  # noqa: E402
from nbinfer.api.decode import persistent_ctas  # noqa: E402


def fixed_grid(backend, kernel, threads, most):
    return persistent_ctas(backend, most)


def run_case(grid, causal, B=4, L=2048, H=32, d=128, dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B * L, H, d, device="cuda", generator=gen, dtype=dtype)
    k = torch.randn(q.shape, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(q.shape, device="cuda", generator=gen, dtype=dtype)
    ptr = np.arange(B + 1) * L
    original = api_prefill.kernel_ctas
    if grid == "fixed 4 per SM":
        api_prefill.kernel_ctas = fixed_grid
    try:
        w = api_prefill.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(512 << 20, dtype=torch.uint8, device="cuda"))
        w.plan(ptr, ptr, H, H, d, causal=causal, q_data_type=dtype)
    finally:
        api_prefill.kernel_ctas = original
    out = torch.empty_like(q)
    ms = gpu_ms(lambda: w.run(q, k, v, out=out), reps=5)
    # the anchor: torch SDPA in fp32 (math backend) on the same tensors
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q4, k4, v4 = (x.view(B, L, H, d).transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
    err = float((out.view(B, L, H, d).transpose(1, 2) - ref).abs().max())
    flops = 4 * B * H * d * (L * (L + 1) / 2 if causal else L * L)
    kern = w.step_plan.launch.launch.kernel
    return dict(grid=grid, causal=causal, num_ctas=w.schedule.num_ctas, regs=kern.regs,
                max_abs_err_vs_sdpa_math=err,
                resident_per_sm=kern.resident_ctas(128), ms=ms, tflops=flops / ms / 1e9), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for causal in (True, False):
        outs = []
        for grid in ("fixed 4 per SM", "occupancy"):
            row, out = run_case(grid, causal)
            err = row["max_abs_err_vs_sdpa_math"]
            outs.append(out)
            rows.append(row)
            print(f"causal={causal!s:5s} {grid:15s}: {row['num_ctas']} CTAs ({row['regs']} regs,"
                  f" {row['resident_per_sm']} resident per SM) {row['ms']:.3f} ms, "
                  f"{row['tflops']:.1f} TFLOP/s, max |err| vs SDPA math {err:.1e}", flush=True)
        rows[-1]["max_abs_diff"] = float((outs[0] - outs[1]).abs().max())
        rows[-1]["speedup"] = rows[-2]["ms"] / rows[-1]["ms"]
        print(f"  speedup {rows[-1]['speedup']:.2f}x, max |diff| {rows[-1]['max_abs_diff']:.1e}")
    save_json(args.out, prefill_grid_ab=rows)


if __name__ == "__main__":
    main()
