"""Which entries of a kernel cache folder still match this checkout's kernel sources.

An entry's key includes a digest of the kernel module it was built from (and every module of
the kernel package that one imports), so any edit there, comments included, makes the entries
built from it unreachable. Before carrying ``.nbinfer-cache/`` to a device call, this says how
many entries are current for the sources and which kernel kinds will compile again. It checks
the source digest only: an entry whose variant hooks, library versions or compute capability
differ from what a call asks for is counted here and still not loaded there.

    python3 bench/cache_status.py [folder] [--prune]  # default: $NBINFER_CACHE_DIR or .nbinfer-cache

``--prune`` deletes the stale entries (they can never load again), so that the folder carried
to a device call stays small.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

from nbinfer.kernels import cache


def entries(folder: Path):
    """``(path, header)`` of every readable entry in ``folder``."""
    for path in sorted(folder.glob("*.nbk")):
        header = cache.read_header(path.read_bytes())
        if header is not None:
            yield path, header


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prune = "--prune" in argv
    argv = [a for a in argv if a != "--prune"]
    root = Path(argv[0] if argv else os.environ.get("NBINFER_CACHE_DIR", ".nbinfer-cache"))
    folder = root / "kernels" if (root / "kernels").is_dir() else root
    if not folder.is_dir():
        print(f"no cache folder at {folder}")
        return 1
    valid, stale = collections.Counter(), collections.Counter()
    for path, header in entries(folder):
        meta = header["meta"]
        fresh = cache._source_digest(meta["module"]) == meta["source"]
        (valid if fresh else stale)[meta["kind"]] += 1
        if prune and not fresh:
            path.unlink()
    for name, counter in (("source-current", valid), ("stale", stale)):
        if prune and name == "stale":
            name = "stale, deleted"
        print(f"{name}: {sum(counter.values())}  " +
              ", ".join(f"{k} {v}" for k, v in sorted(counter.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
