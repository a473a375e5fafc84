"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page.

Reads the CSV that ``ncu -i REPORT --page source --csv --print-source sass`` writes (plain or
gzipped; ``bench/ncu_decode.sh`` with ``SOURCE=1`` makes one per configuration) and prints the
warp-state samples summed by stall reason over the whole kernel, then the instructions that
hold the most samples with their leading reasons. Runs anywhere (no GPU, no ncu):

    python3 bench/ncu_stalls.py bench/results/issue13/session15/call2/ncu_decode_1_sass.csv.gz

Each sample is one warp's state at one sampling tick, so a reason's share is the share of
warp-time spent in it; ``selected`` is issuing, ``long_sb`` is waiting on an L1TEX result (a
global or local load, or ``DEPBAR`` on the cp.async scoreboard), ``wait`` a fixed-latency
dependency, ``short_sb`` shared memory / MUFU / shuffles.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io

ALL = "Warp Stall Sampling (All Samples)"


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and instruction rows of the CSV's per-instruction table."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Address"]
    if not starts:
        raise ValueError(f"{path}: no 'Address' header row (not an ncu source-page CSV?)")
    return rows[starts[0]], rows[starts[0] + 1:]


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:
        return 0.0


def summarise(header: list[str], rows: list[list[str]], top: int = 15):
    """``(total samples, [(reason, samples)], [(address, share, source, [(samples, reason)])])``:
    the reasons over the kernel, most first, and the ``top`` instructions by samples."""
    col = {c: i for i, c in enumerate(header)}
    if ALL not in col:
        raise ValueError(f"no '{ALL}' column: was SourceCounters collected?")
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    by_reason: collections.Counter = collections.Counter()
    total = 0.0
    for r in rows:
        total += _num(r[col[ALL]])
        for c in reasons:
            by_reason[c[6:]] += _num(r[col[c]])
    hot = []
    for r in sorted(rows, key=lambda r: -_num(r[col[ALL]]))[:top]:
        lead = sorted(((_num(r[col[c]]), c[6:]) for c in reasons), reverse=True)[:3]
        hot.append((r[0], _num(r[col[ALL]]) / max(total, 1.0), r[1].strip(), lead))
    return total, by_reason.most_common(), hot


KINDS = ("HGMMA", "HMMA", "LDGSTS", "LDG", "STG", "ST.E", "LDL", "STL", "LDS", "STS", "BAR",
         "MUFU", "SHFL", "DSETP", "DADD", "F2I.S64.F64")


def blocks(header: list[str], rows: list[list[str]], least: float = 0.01):
    """Runs of consecutive instructions with one execution count (a basic block, or several
    that run equally often), each ``(first address, executions, instructions, share of the
    samples, [(samples, reason)] leading, sorted kinds of memory / tensor / barrier
    instructions in it)``, for the runs holding at least ``least`` of the samples: where a
    kernel's time goes by code region (the tile loop runs once per tile and warp, an item's
    start and epilogue once per item)."""
    col = {c: i for i, c in enumerate(header)}
    ex = col["Instructions Executed"]
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    runs, cur = [], None
    for r in rows:
        if not r[ex].strip():
            continue
        n = int(_num(r[ex]))
        if cur is None or cur["n"] != n:
            cur = dict(addr=r[0], n=n, count=0, samples=0.0, why=collections.Counter(),
                       kinds=set())
            runs.append(cur)
        cur["count"] += 1
        cur["samples"] += _num(r[col[ALL]])
        for c in reasons:
            cur["why"][c[6:]] += _num(r[col[c]])
        words = r[1].split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else \
            (words[0] if words else "")
        cur["kinds"].update(k for k in KINDS if op.startswith(k))
    total = max(sum(x["samples"] for x in runs), 1.0)
    return [(x["addr"], x["n"], x["count"], x["samples"] / total,
             [(v, k) for k, v in x["why"].most_common(3) if v], sorted(x["kinds"]))
            for x in runs if x["samples"] / total >= least]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu source-page CSV files (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=15, help="instructions to list per file")
    ap.add_argument("--blocks", action="store_true",
                    help="also the samples by code region (runs of one execution count)")
    args = ap.parse_args()
    for path in args.csv:
        total, reasons, hot = summarise(*read_rows(path), top=args.top)
        print(f"== {path}: {total:.0f} samples")
        for name, n in reasons[:10]:
            print(f"  {name:20s} {n:8.0f}  {100 * n / max(total, 1.0):5.1f} %")
        for addr, share, src, lead in hot:
            why = ", ".join(f"{reason} {n:.0f}" for n, reason in lead if n)
            print(f"  {addr[-5:]} {100 * share:5.1f} %  {src[:56]:56s} {why}")
        if args.blocks:
            print("  by region: first address, executions, instructions, share, reasons, kinds")
            for addr, n, count, share, lead, kinds in blocks(*read_rows(path)):
                why = ", ".join(f"{reason} {v:.0f}" for v, reason in lead)
                print(f"  {addr[-5:]} x{n:7d} {count:5d} {100 * share:5.1f} %  {why:44s} "
                      f"{' '.join(kinds)}")


if __name__ == "__main__":
    main()
