"""Decode speed under each register cap, the grid following the kernel's occupancy.

The same step planned with the decode spec's register cap forced to 128 (four CTAs per SM,
the default) and to 168 (three; no spills at groups above 4), timed back to back (GPU time per
run()), at (64, 4096) fp16, Hkv 8, D 128. The committed JSON also has a third row per case, made
at 834757f where DecodeSpec tried the caps (128, 168) in order at link time.

    python3 bench/register_ab.py --out bench/results/issue13/register_ab_h200.json
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import gpu_ms, paged_case, save_json  # noqa: E402

import nbinfer.api.decode as api_decode  # noqa: E402
from nbinfer.kernels.decode import DecodeSpec  # noqa: E402

CASES = [("standard G4", 4, {}), ("standard G8", 8, {}),
         ("rope G4", 4, dict(pos_encoding_mode="ROPE_LLAMA"))]


def time_case(group, flags, caps, batch=64, kv_len=4096):
    hkv, d, ps = 8, 128, 16
    hq = group * hkv
    pt, cache, q = paged_case(batch, kv_len, hq=hq)
    api_decode.DecodeSpec = functools.partial(DecodeSpec, max_registers=caps)
    try:
        w = api_decode.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
               q_data_type=torch.float16, **flags)
    finally:
        api_decode.DecodeSpec = DecodeSpec
    out = torch.empty_like(q)
    ms = gpu_ms(lambda: w.run(q, cache, out=out))
    k = w.step_plan.launch.launch.kernel
    kv_bytes = batch * kv_len * hkv * d * 2 * 2
    return dict(group=group, flags=str(flags), caps=str(caps), chosen=k.max_registers,
                regs=k.regs, local_bytes=k.local_bytes, num_ctas=w.schedule.num_ctas, ms=ms,
                tbps=kv_bytes / ms / 1e9), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--case", default=None, help="one case by name, e.g. 'rope G4'")
    ap.add_argument("--caps", default="128,168", help="register caps to time, comma-separated")
    args = ap.parse_args()
    rows = []
    for name, group, flags in CASES:
        if args.case and name != args.case:
            continue
        outs = []
        for caps in (int(c) for c in args.caps.split(",")):
            row, out = time_case(group, flags, caps)
            rows.append(dict(case=name, **row))
            outs.append(out)
            print(f"{name:12s} caps {row['caps']:10s} -> {row['chosen']} ({row['regs']} regs, "
                  f"{row['local_bytes']} B local, {row['num_ctas']} CTAs): {row['ms']:.3f} ms, "
                  f"{row['tbps']:.2f} TB/s", flush=True)
        diff = max(float((o.float() - outs[0].float()).abs().max()) for o in outs)
        rows[-1]["max_abs_diff_between_caps"] = diff
    save_json(args.out, register_ab=rows)


if __name__ == "__main__":
    main()
