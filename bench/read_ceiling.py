"""The H200's read-only HBM bandwidth, beside the copy ceiling the decode figures have used.

Decode only reads its KV; a copy both reads and writes. cuDNN's decode reached 4.57 TB/s of KV
reads (issue 13, session 5), above the 4.22 TB/s measured for a copy, so the copy is not the
decode's ceiling. Measured here with torch's reductions, which read every byte once and write
almost nothing: a 4 GiB fp16 tensor (70x the 60 MB L2, so each call streams from HBM), GPU time
of 10 calls back to back, median of 5 rounds; and a same-size device-to-device copy.

    python3 bench/read_ceiling.py --out bench/results/issue13/read_ceiling_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import gpu_ms, save_json  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    n = int(args.gib * (1 << 30)) // 2
    x = torch.randn(n, dtype=torch.float16, device="cuda")
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    rows = {}
    for name, fn, moved in (("sum", lambda: x.sum(dtype=torch.float32), nbytes),
                            ("amax", lambda: x.amax(), nbytes),
                            ("copy", lambda: y.copy_(x), 2 * nbytes)):
        ms = gpu_ms(fn, reps=10, rounds=5)
        rows[name] = dict(ms=ms, bytes=moved, tbps=moved / ms / 1e9)
        print(f"{name:5s} {ms:7.3f} ms  {moved / ms / 1e9:5.2f} TB/s", flush=True)
    save_json(args.out, read_ceiling=rows, gib=args.gib)


if __name__ == "__main__":
    main()
