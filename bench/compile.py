"""Cold start per kernel: where the seconds go (Numba lowering, NVVM -> PTX, link, load) and what
the persistent cache leaves of them.

Each kernel is compiled in a fresh process against an empty cache folder (cold), then loaded in
another fresh process from that folder (warm). Per kernel: the compile phases from
``CompiledKernel.timings`` (``lower``: Numba's compile call; ``ptx``: NVVM; ``link``: PTX ->
cubin; ``load``: the driver; since 2026-12-04 Numba's call runs NVVM and the link for the
target nbinfer asks for, so ``lower`` holds all three), the child's wall time from before
``import nbinfer`` to the end of its first call, and the same for the warm child, with the
modules it compiled from source. ``--warm-from DIR`` skips the cold compiles and times warm
processes only (best of three) against a cache folder already filled.

    python3 bench/compile.py --out bench/results/issue14/compile_h200.json
    python3 bench/compile.py --warm-from .nbinfer-cache --out ...   (warm processes only)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (label, warm-up task fields): decode, both prefill kernels, append, merges.
CASES = [
    ("decode fp16 D128 G4", dict(kind="decode", dtype="float16")),
    ("prefill mma fp16 D128 G4 causal", dict(kind="prefill", dtype="float16",
                                              options=(("causal", True),))),
    ("prefill cuda-core fp32 D128 G4 causal", dict(kind="prefill", dtype="float32",
                                                    options=(("causal", True),))),
    ("append fp16 D128", dict(kind="append", dtype="float16", group_size=1)),
    ("merge fp16 D128 (pair + stack)", dict(kind="merge", dtype="float16", group_size=1,
                                             page_size=1)),
]

# Counts the modules this process compiles from source (no usable bytecode), by top-level
# package: a wheel installed with ``pip --no-compile`` where bytecode is never written (the
# device's numpy, session 22) is compiled again by every process, which a normal install is not.
FROM_SOURCE_PROBE = """
import collections, importlib.machinery
_from_source = collections.Counter()
_source_to_code = importlib.machinery.SourceFileLoader.source_to_code
def _counted(self, *args, **kwargs):
    _from_source[(self.name or "?").split(".")[0]] += 1
    return _source_to_code(self, *args, **kwargs)
importlib.machinery.SourceFileLoader.source_to_code = _counted
"""

CHILD = FROM_SOURCE_PROBE + """
import json, sys, time
import torch
torch.zeros(1, device="cuda")
t0 = time.perf_counter()
from nbinfer.warmup import Task, run_task
from nbinfer.kernels import compiled
task = Task(**json.loads(sys.argv[1]))
run_task(task)
wall = time.perf_counter() - t0
print(json.dumps({"wall": wall, "from_source": dict(_from_source),
                  "dont_write_bytecode": sys.flags.dont_write_bytecode, "kernels": [
    {"kind": kind, "from_cache": k.from_cache, "regs": k.regs, "timings": k.timings}
    for kind, _, k in compiled.LOADED]}))
"""


def child(fields: dict, cache: str) -> dict:
    env = dict(os.environ, NBINFER_CACHE_DIR=cache, NBINFER_CACHE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    task = dict(dict(kind="decode", head_dim=128, group_size=4, page_size=16,
                     dtype="float16", kv_layout="NHD", options=()), **fields)
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(task)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm_row(label: str, warm: dict) -> dict:
    """The warm child's half of a row: its wall time, what it loaded, what it compiled."""
    return dict(case=label, warm_process_s=warm["wall"],
                warm_from_cache=all(w["from_cache"] for w in warm["kernels"]),
                warm_from_source=warm["from_source"],
                dont_write_bytecode=warm["dont_write_bytecode"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--warm-from", default=None, metavar="CACHE_DIR",
                    help="no cold compiles: time only warm processes (best of three) against "
                         "this kernel cache folder (e.g. the carried .nbinfer-cache), for "
                         "requirement 1 in a few seconds of device time")
    args = ap.parse_args()
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, fields in CASES:
            if args.warm_from:
                warm = min((child(fields, args.warm_from) for _ in range(3)),
                           key=lambda r: r["wall"])
                rows.append(dict(warm_row(label, warm), kernels=[
                    dict(kernel=k["kind"], from_cache=k["from_cache"],
                         load_s=k["timings"]["load"]) for k in warm["kernels"]]))
                print(f"{label}: warm {warm['wall']:.2f} s, from cache "
                      f"{rows[-1]['warm_from_cache']} (modules compiled from source: "
                      f"{warm['from_source'] or 'none'})", flush=True)
                continue
            cache = os.path.join(tmp, label.split()[0] + str(len(rows)))
            cold = child(fields, cache)
            warm = min((child(fields, cache) for _ in range(2)), key=lambda r: r["wall"])
            for k in cold["kernels"]:
                t = k["timings"]
                rows.append(dict(warm_row(label, warm), kernel=k["kind"], regs=k["regs"],
                                 lower_s=t["lower"], ptx_s=t["ptx"], link_s=t["link"],
                                 load_s=t["load"], cold_total_s=t["total"],
                                 cold_process_s=cold["wall"],
                                 warm_load_s=sum(w["timings"]["load"] for w in warm["kernels"]
                                                 if w["kind"] == k["kind"])))
            print(f"{label}: cold {cold['wall']:.2f} s, warm {warm['wall']:.2f} s (modules "
                  f"compiled from source in the warm process: {warm['from_source'] or 'none'})",
                  flush=True)
    command = "python3 bench/compile.py" + (" --warm-from CACHE" if args.warm_from else "")
    result = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                  command=command, rows=rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.warm_from:
        print(f"\n{'case':<40} {'warm proc':>9} {'cached':>6}")
        for r in rows:
            print(f"{r['case']:<40} {r['warm_process_s']:9.2f} {str(r['warm_from_cache']):>6}")
        return
    print(f"\n{'case':<40} {'kernel':<12} {'regs':>4} {'lower':>6} {'ptx':>6} {'link':>6} "
          f"{'load':>6} {'cold proc':>9} {'warm proc':>9}")
    for r in rows:
        print(f"{r['case']:<40} {r['kernel']:<12} {r['regs']:>4} {r['lower_s']:6.2f} "
              f"{r['ptx_s']:6.2f} {r['link_s']:6.2f} {r['load_s']:6.3f} "
              f"{r['cold_process_s']:9.2f} {r['warm_process_s']:9.2f}")


if __name__ == "__main__":
    main()
