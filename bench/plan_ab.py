"""A decode plan()'s host cost on this CPU: the working tree against an earlier commit.

    python3 bench/plan_ab.py [--against REV] [--batches 1,8,64,256] [--rounds 60]
                             [--out FILE.json]

A small VM's speed drifts by tens of per cent between runs, more than most host-cost changes
move, so the two versions run in one process and take turns: the one at ``REV`` (default
HEAD) is a copy of the package taken with ``git archive`` into a temporary folder and renamed
``nbinfer_old`` (its imports rewritten). Simulator backend, the grid forced to the H200's 528
CTAs, page tables as int32 NumPy arrays with KV lengths uniform in [512, 4096] (Hq 32, Hkv 8,
D 128, page 16: ``bench/host.py``'s problem), a wrapper per batch size planned 200 times first;
then ``--rounds`` rounds of 40 plans per version and batch size. Reported: the best round
(least disturbed) and the 25th percentile, in us per plan(). The last lines are a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba loads: no GPU needed

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D, PS = 32, 8, 128, 16
GRID = 528  # the H200's decode grid: 132 SMs x 4 CTAs


def old_package(rev: str, where: str) -> None:
    """Unpack ``nbinfer/`` at ``rev`` into ``where/nbinfer_old``, its imports renamed."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "nbinfer"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    pkg = Path(where) / "nbinfer_old"
    (Path(where) / "nbinfer").rename(pkg)
    pattern = re.compile(r"\b(from|import) nbinfer\b")
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        path.write_text(pattern.sub(r"\1 nbinfer_old", text).replace('"nbinfer.',
                                                                    '"nbinfer_old.'))


def tables(batch: int, seed: int = 0):
    from nbinfer.formats import PageTable

    rng = np.random.default_rng(seed + batch)
    pt = PageTable.from_kv_lens(rng.integers(512, 4097, size=batch), PS, rng=rng)
    return tuple(np.ascontiguousarray(a, dtype=np.int32)
                 for a in (pt.indptr, pt.indices, pt.last_page_len))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="HEAD")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="nbinfer-ab-")
    old_package(args.against, tmp)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, tmp)
    versions = {"new": importlib.import_module("nbinfer.api.decode"),
                "old": importlib.import_module("nbinfer_old.api.decode")}
    ws = np.zeros(64 << 20, np.uint8)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        table = tables(batch)
        wrappers = {}
        for name, mod in versions.items():
            w = mod.BatchDecodeWithPagedKVCacheWrapper(ws, backend="sim")
            w._grid = lambda cfg: GRID
            for _ in range(200):  # the first loads (or compiles) the compiled planner
                w.plan(*table, HQ, HKV, D, PS, q_data_type="float16")
            wrappers[name] = w
        per_round = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, w in wrappers.items():
                t0 = time.perf_counter_ns()
                for _ in range(40):
                    w.plan(*table, HQ, HKV, D, PS, q_data_type="float16")
                per_round[name].append((time.perf_counter_ns() - t0) / 40e3)
        row = {"batch": batch, "pages": int(table[1].size)}
        for name, us in per_round.items():
            row[f"{name}_best_us"] = float(min(us))
            row[f"{name}_p25_us"] = float(np.percentile(us, 25))
        rows.append(row)
    result = {"against": subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.against],
                                        check=True, capture_output=True,
                                        text=True).stdout.strip(),
              "problem": {"Hq": HQ, "Hkv": HKV, "D": D, "page_size": PS, "grid": GRID,
                          "backend": "sim", "rounds": args.rounds}, "plan": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"plan() us per call, working tree (new) against {args.against} (old)")
    print("batch  pages  new best  old best  new p25  old p25")
    for r in rows:
        print(f"{r['batch']:5d} {r['pages']:6d} {r['new_best_us']:9.1f} {r['old_best_us']:9.1f} "
              f"{r['new_p25_us']:8.1f} {r['old_p25_us']:8.1f}")


if __name__ == "__main__":
    main()
