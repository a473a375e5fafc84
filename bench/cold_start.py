"""Where a second process's first call goes (issue 14, requirement 1): a profile of the warm child.

    python bench/cold_start.py [--out PROFILE.txt]

Runs the child of ``tests/test_gpu_cache.py`` (import nbinfer, a decode plan + run, a merge, an
append, all from the kernel disk cache) in a fresh cache folder: once cold (compiling, to fill
the folder), then three times warm, the last under cProfile from the child's clock start to its
end. Prints the warm elapsed times and the profile's top entries by cumulative and by own time,
and ``python -X importtime``'s slowest imports of ``import nbinfer`` + the first call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_gpu_cache import CHILD as TEST_CHILD  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from compile import FROM_SOURCE_PROBE  # noqa: E402

# the test's child, counting the modules it compiles from source (bench/compile.py)
CHILD = FROM_SOURCE_PROBE + TEST_CHILD.replace(
    'print(json.dumps({"elapsed": elapsed,',
    'import sys\nprint(json.dumps({"elapsed": elapsed, "from_source": dict(_from_source), '
    '"dont_write_bytecode": sys.flags.dont_write_bytecode,', 1)
PROFILED = CHILD.replace(
    "t0 = time.perf_counter()\n",
    "t0 = time.perf_counter()\nimport cProfile, pstats, sys\n_pr = cProfile.Profile()\n"
    "_pr.enable()\n", 1).replace(
    "elapsed = time.perf_counter() - t0\n",
    "elapsed = time.perf_counter() - t0\n_pr.disable()\n"
    "pstats.Stats(_pr, stream=sys.stderr).sort_stats('cumulative').print_stats(40)\n"
    "pstats.Stats(_pr, stream=sys.stderr).sort_stats('tottime').print_stats(25)\n", 1)


def child(code, cache, *extra):
    env = dict(os.environ, NBINFER_CACHE_DIR=str(cache), NBINFER_CACHE="1")
    out = subprocess.run([sys.executable, *extra, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=600)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    assert "_pr.enable()" in PROFILED and "_pr.disable()" in PROFILED
    assert '"from_source"' in CHILD
    with tempfile.TemporaryDirectory() as cache:
        cold, _ = child(CHILD, cache)
        warm_runs = [child(CHILD, cache)[0] for _ in range(2)]
        warm = [r["elapsed"] for r in warm_runs]
        _, importtime = child(CHILD, cache, "-X", "importtime")
        prof, profile = child(PROFILED, cache)
    rows = []
    for line in importtime.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    text = (f"cold {cold['elapsed']:.3f} s; warm {', '.join(f'{t:.3f}' for t in warm)} s; "
            f"profiled {prof['elapsed']:.3f} s\nmodules compiled from source in the warm "
            f"process: {warm_runs[-1]['from_source'] or 'none'} (dont_write_bytecode "
            f"{warm_runs[-1]['dont_write_bytecode']})\n\nslowest imports (cumulative us):\n"
            + "\n".join(f"{us:9d} {name}" for us, name in rows[:30]) + "\n\n" + profile)
    if a.out:
        Path(a.out).write_text(text)
    print(text[:6000])
    print(f"\ncold {cold['elapsed']:.3f} s, warm best {min(warm):.3f} s")


if __name__ == "__main__":
    main()
