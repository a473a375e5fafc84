"""Compare compiled variants of the decode kernel on identical inputs (H200 tuning aid).

    python bench/decode_sweep.py [--stages 2 3] [--max-registers 0 128 96 80]

For each benchmark case the wrapper plans once; every kernel variant then runs through a copy of
the same prepared launch (same page table, work list, q, cache and outputs), so only the compiled
code differs. Each variant is first checked against the default kernel's output (max abs diff),
then timed with CUDA events (median of 5 x 20 back-to-back launches). Prints one line per
(case, variant): time, TB/s, registers, shared memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import CASES, kernel_resources, kv_bytes_of, launch_ms, paged_case  # noqa: E402

from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from nbinfer.kernels.decode import build_decode_kernel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--max-registers", type=int, nargs="+", default=[0])
    ap.add_argument("--cases", type=int, default=len(CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for batch, kv_len in CASES[: args.cases]:
        pt, cache, q = paged_case(batch, kv_len)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        w = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16, q_data_type=torch.float16)
        out, lse = torch.empty_like(q), torch.empty(batch, 32, device="cuda")
        w.run(q, cache, out=out, lse=lse)
        base = w.step_plan.launch.launch
        torch.cuda.synchronize()
        ref = out.clone()
        kv_bytes = kv_bytes_of(batch, kv_len, 8, 128)
        for stages, regs in itertools.product(args.stages, args.max_registers):
            spec = dataclasses.replace(w.step_plan.spec, stages=stages, max_registers=regs or None)
            try:
                kernel = build_decode_kernel(spec)
            except Exception as exc:  # noqa: BLE001 - report, keep sweeping
                print(f"B{batch} L{kv_len} stages={stages} regs<={regs}: {exc!r}"[:300])
                continue
            launch = base.with_kernel(kernel)
            out.zero_()
            stream = torch.cuda.current_stream().cuda_stream
            launch(stream)
            torch.cuda.synchronize()
            diff = float((out.float() - ref.float()).abs().max())
            ms = float(np.median([launch_ms(launch) for _ in range(5)]))
            row = dict(batch=batch, kv_len=kv_len, stages=stages, max_registers=regs, ms=ms,
                       tbps=kv_bytes / ms / 1e9, max_abs_diff=diff, ctas=base.grid[0],
                       **kernel_resources(kernel))
            rows.append(row)
            print(f"B{batch:<4} L{kv_len:<6} stages={stages} regs<={regs:<3} -> {row['regs']:3d} regs "
                  f"{row['shared_bytes'] / 1024:5.1f} KiB  {ms:7.3f} ms  {row['tbps']:5.2f} TB/s  "
                  f"diff {diff:.1e}  ctas {base.grid[0]}", flush=True)
        del cache
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
