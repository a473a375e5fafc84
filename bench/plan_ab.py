"""A decode plan()'s host cost on this CPU: the working tree against an earlier commit.

    python3 bench/plan_ab.py [--against REV] [--batches 1,8,64,256] [--rounds 60]
                             [--kind decode|decode-graph|append|cascade] [--out FILE.json]

A small VM's speed drifts by tens of per cent between runs, more than most host-cost changes
move, so the two versions run in one process and take turns: the one at ``REV`` (default
HEAD) is a copy of the package taken with ``git archive`` into a temporary folder and renamed
``nbinfer_old`` (its imports rewritten). Simulator backend, the grid forced to the H200's 528
CTAs, page tables as int32 NumPy arrays with KV lengths uniform in [512, 4096] (Hq 32, Hkv 8,
D 128, page 16: ``bench/host.py``'s problem), a wrapper per batch size planned 200 times first;
then ``--rounds`` rounds of 40 plans per version and batch size. Reported: the best round
(least disturbed) and the 25th percentile, in us per plan(). The last lines are a table.

``--kind cascade``: the plan() of a two-level ``MultiLevelCascadeAttentionWrapper`` in CUDA-graph
mode at the engine benchmark's shared-prefix decode step instead (Llama-3.2-1B heads: Hq 32,
Hkv 8, D 64, bf16, pages of 16; a prefix of 57 pages shared by the whole batch, 102-358 own
tokens per request), the one-launch kernel's H200 grid of 396 CTAs forced.

``--kind decode-graph`` and ``--kind append``: the two other plans of a replayed decode step in
``TorchRunner`` (``nbinfer.engine.torch_runner``), on the decode problem above: the decode
wrapper in CUDA-graph mode and the append wrapper reserved, both with the capacities a graph
bucket of ``batch`` rows gets over a pool of the table's pages (every row may hold the whole
pool: ``batch x (pages + 1)`` page ids), the append of one token per request at its last slot.
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
CASCADE_GRID = 396  # the one-launch cascade's: 132 SMs x 3 CTAs
CASCADE_PREFIX_PAGES = 57  # 922 shared tokens: 90 % of the engine benchmark's 1024


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


def cascade_levels(batch: int, seed: int = 0):
    """The engine benchmark's shared-prefix decode step as the four per-level plan() lists."""
    rng = np.random.default_rng(seed + batch)
    own_lens = rng.integers(102, 359, size=batch)
    own_pages = -(-own_lens // PS)
    pool = rng.permutation(CASCADE_PREFIX_PAGES + int(own_pages.sum())).astype(np.int32)
    i32 = np.int32
    return ([np.array([0, batch], i32), np.arange(batch + 1, dtype=i32)],
            [np.array([0, CASCADE_PREFIX_PAGES], i32),
             np.concatenate([[0], np.cumsum(own_pages)]).astype(i32)],
            [pool[:CASCADE_PREFIX_PAGES], pool[CASCADE_PREFIX_PAGES:]],
            [np.array([PS], i32), (own_lens - (own_pages - 1) * PS).astype(i32)])


def planner(mod, kind: str, batch: int, ws):
    """A wrapper of module ``mod`` for ``kind``, warmed up, and a function that plans it."""
    if kind in ("decode", "decode-graph", "append"):
        table = tables(batch)
        cap = batch * (int(table[1].size) + 1)  # TorchRunner's bucket: rows x (pool + 1)
    if kind == "decode":
        w = mod.BatchDecodeWithPagedKVCacheWrapper(ws, backend="sim")
        w._grid = lambda cfg: GRID

        def plan_once():
            w.plan(*table, HQ, HKV, D, PS, q_data_type="float16")
    elif kind == "decode-graph":
        bufs = (np.zeros(batch + 1, np.int32), np.zeros(cap, np.int32),
                np.zeros(batch, np.int32))
        w = mod.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
            paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
            backend="sim")
        w._grid = lambda cfg: GRID

        def plan_once():
            w.plan(*table, HQ, HKV, D, PS, q_data_type="float16")
    elif kind == "append":
        indptr, indices, last = table
        cache = np.zeros((int(indices.size), 2, PS, HKV, 8), np.float16)  # (only its shape)
        w = mod.PagedKVAppendWrapper(cache, "NHD", backend="sim")
        w.reserve(batch, batch, cap)
        rows = np.arange(batch, dtype=np.int32)
        pos = ((np.diff(indptr) - 1) * PS + last - 1).astype(np.int32)

        def plan_once():
            w.plan(rows, pos, indices, indptr, last)
    else:
        levels = cascade_levels(batch)
        bufs = dict(qo_indptr_buf_arr=[np.zeros(batch + 1, np.int32)] * 2,
                    paged_kv_indptr_buf_arr=[np.zeros(batch + 1, np.int32)] * 2,
                    paged_kv_indices_buf_arr=[np.zeros(64 * batch + 64, np.int32)] * 2,
                    paged_kv_last_page_len_buf_arr=[np.zeros(batch, np.int32)] * 2)
        w = mod.MultiLevelCascadeAttentionWrapper(2, ws, "NHD", True, backend="sim", **bufs)
        kernel = w._fused._kernel
        w._fused._kernel = lambda step, group: (*kernel(step, group)[:-1], CASCADE_GRID)

        def plan_once():
            w.plan(*levels, 32, 8, 64, PS, q_data_type="bfloat16")
    for _ in range(200):  # the first loads (or compiles) the compiled planner
        plan_once()
    return plan_once, int((levels[2][0].size + levels[2][1].size) if kind == "cascade" else
                          table[1].size)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default="HEAD")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--kind", choices=("decode", "decode-graph", "append", "cascade"),
                    default="decode")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="nbinfer-ab-")
    old_package(args.against, tmp)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, tmp)
    module = {"cascade": "api.cascade", "append": "api.append"}.get(args.kind, "api.decode")
    versions = {"new": importlib.import_module(f"nbinfer.{module}"),
                "old": importlib.import_module(f"nbinfer_old.{module}")}
    ws = np.zeros(64 << 20, np.uint8)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        plans = {}
        for name, mod in versions.items():
            plans[name], pages = planner(mod, args.kind, batch, ws)
        per_round = {name: [] for name in versions}
        for _ in range(args.rounds):
            for name, plan_once in plans.items():
                t0 = time.perf_counter_ns()
                for _ in range(40):
                    plan_once()
                per_round[name].append((time.perf_counter_ns() - t0) / 40e3)
        row = {"batch": batch, "pages": pages}
        for name, us in per_round.items():
            row[f"{name}_best_us"] = float(min(us))
            row[f"{name}_p25_us"] = float(np.percentile(us, 25))
        rows.append(row)
    result = {"against": subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.against],
                                        check=True, capture_output=True,
                                        text=True).stdout.strip(),
              "kind": args.kind,
              "problem": {"Hq": HQ, "Hkv": HKV, "D": D, "page_size": PS, "grid": GRID,
                          "backend": "sim", "rounds": args.rounds} if args.kind != "cascade" else
              {"Hq": 32, "Hkv": 8, "D": 64, "page_size": PS, "grid": CASCADE_GRID,
               "prefix_pages": CASCADE_PREFIX_PAGES, "own_tokens": "102-358",
               "backend": "sim", "rounds": args.rounds}, "plan": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{args.kind} plan() us per call, working tree (new) against {args.against} (old)")
    print("batch  pages  new best  old best  new p25  old p25")
    for r in rows:
        print(f"{r['batch']:5d} {r['pages']:6d} {r['new_best_us']:9.1f} {r['old_best_us']:9.1f} "
              f"{r['new_p25_us']:8.1f} {r['old_p25_us']:8.1f}")


if __name__ == "__main__":
    main()
