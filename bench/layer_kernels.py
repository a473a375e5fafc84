"""GPU time of the engine's layer kernels at a Llama-3.2-1B decode step (64 tokens, bf16).

    python3 bench/layer_kernels.py [--out FILE.json]

Each kernel is captured 200 times in one CUDA graph (as the engine's replayed step holds it)
and the graph replayed between CUDA events: the median over 10 replays, per launch. Rows:

- ``fused_add_rmsnorm``: the rule's form (the row in registers, ``NormSpec.items``) and the
  strided loop (``items=0``, the form before session 25) on the same data: an A/B on one GPU;
- ``rmsnorm``, ``rope`` (q and k of a fused QKV output, in place), ``silu_and_mul``;
- ``floor``: the smallest kernel nbinfer launches the same way (``merge_state_in_place`` of
  one row), what any launch costs inside a graph.

Bytes per launch (what HBM could move them in at 3-4 TB/s: well under a microsecond): the fused
norm reads x, residual (2 x 256 KiB) and writes both; RoPE reads and writes 64 x 40 x 64 x 2 B
(320 KiB) and reads a 16 KiB slice of the table; SiLU reads 2 MiB and writes 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
sys.path.insert(0, os.path.dirname(__file__))

from prefill import graph_ms  # noqa: E402 (this folder: python3 bench/layer_kernels.py)

import nbinfer  # noqa: E402
from nbinfer.api import layers_fast  # noqa: E402
from nbinfer.kernels.layers import NormSpec  # noqa: E402
from nbinfer.reference.layers import cos_sin_cache  # noqa: E402

N, HIDDEN, INTER, HQ, HK, D = 64, 2048, 8192, 32, 8, 64
LAUNCHES = 200


def graph_us(fn, launches=LAUNCHES):
    """Per-launch GPU time of ``fn`` captured ``launches`` times in one graph (prefill.py's
    ``graph_ms``: the median over 10 replays, each between its own events)."""
    return graph_ms(lambda: [fn() for _ in range(launches)], n=1) * 1e3 / launches


def strided_norm(dtype, weight_dtype, fused, sim, hidden):
    """``norm_spec`` with the strided loop (``items=0``), for the A/B."""
    return NormSpec(dtype, weight_dtype, fused, sim, 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    bf = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, HIDDEN, device="cuda", generator=g).to(bf)
    r = torch.randn(N, HIDDEN, device="cuda", generator=g).to(bf)
    w = torch.rand(HIDDEN, device="cuda", generator=g) + 0.5
    gu = torch.randn(N, 2 * INTER, device="cuda", generator=g).to(bf)
    qkv = torch.randn(N, (HQ + 2 * HK) * D, device="cuda", generator=g).to(bf)
    q, k = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D]
    pos = torch.arange(1000, 1000 + N, device="cuda")
    table = torch.as_tensor(cos_sin_cache(1.0 / 500000.0 ** (np.arange(0, D, 2) / D), 4096),
                            device="cuda")
    silu_out = torch.empty(N, INTER, device="cuda", dtype=bf)
    normed = torch.empty_like(x)
    v_a = torch.randn(1, 1, D, device="cuda", generator=g).to(bf)
    s_a = torch.zeros(1, 1, device="cuda")
    v_b, s_b = v_a.clone(), s_a.clone()

    # the two norms on the same data, first to last alternately (x and r drift: the sums grow
    # by one add per launch, never to overflow over 200 x 13 launches of bf16 at these scales)
    def fused():
        nbinfer.fused_add_rmsnorm(x, r, w, 1e-5)

    rows = {}
    for name in ("registers", "strided", "registers_again", "strided_again"):
        if name.startswith("strided"):
            saved, layers_fast.norm_spec = layers_fast.norm_spec, strided_norm
            try:
                rows[f"fused_add_rmsnorm_{name}_us"] = graph_us(fused)
            finally:
                layers_fast.norm_spec = saved
        else:
            rows[f"fused_add_rmsnorm_{name}_us"] = graph_us(fused)
    rows["rmsnorm_us"] = graph_us(lambda: nbinfer.rmsnorm(x, w, 1e-5, out=normed))
    rows["rope_us"] = graph_us(lambda: nbinfer.apply_rope_with_cos_sin_cache_inplace(
        pos, q, k, D, table))
    rows["silu_and_mul_us"] = graph_us(lambda: nbinfer.silu_and_mul(gu, out=silu_out))
    try:
        rows["floor_us"] = graph_us(lambda: nbinfer.merge_state_in_place(v_a, s_a, v_b, s_b))
    except Exception as exc:  # recorded; the rows above stand
        rows["floor_error"] = f"{type(exc).__name__}: {exc}"[:300]
    result = dict(device=torch.cuda.get_device_name(), tokens=N, hidden=HIDDEN,
                  launches_per_graph=LAUNCHES, **rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    for key, value in rows.items():
        print(f"{key:36s} {value}")


if __name__ == "__main__":
    main()
