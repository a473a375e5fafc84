"""The engine's own host time per decode step, on a CPU (a stand-in device of 0 ms).

    python3 bench/engine_host_cpu.py [--requests 64] [--prompt 1024] [--new 256]
                                     [--shared 0.9] [--rounds 3] [--out FILE.json]

``bench/engine.py``'s run (64 requests x (1024 prompt + 256 new tokens), pages of 16, all
arriving at once) through the real :class:`nbinfer.engine.Engine` with overlap, on
``bench/engine_overlap_cpu.py``'s stand-in device (a worker thread that returns tokens at once,
so each step's wall time is the host's: scheduling, allocation, the batch's tables, sampling's
bookkeeping, the prefix cache). Three rows: no prefix cache; the prefix cache with
``--shared`` of every prompt in common; the same with the cascade, the stand-in claiming to
replay cascade steps as the GPU runner does under CUDA graphs (so the engine's rule takes them).
The attention plans are the runner's, not timed here (``bench/plan_ab.py --kind cascade``).
Reported per row: the median and 90th percentile of the decode steps' wall time (best of
``--rounds`` runs; a step's wall time less its wait in ``fetch()`` for the stand-in's worker
thread, whose hand-off is not the engine's work; the wall time's median too), the decode
steps, cascade steps and prefix hit rate. On the H200's host
Python runs ~2-3.5x slower than on the 2-core VM these were first measured on, and with
overlap a step whose host time passes its GPU time is host-bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_overlap_cpu import VOCAB, StandInDevice, time_fetch  # noqa: E402

from nbinfer.engine import Engine, Request  # noqa: E402

PAGE = 16


class CascadeStandIn(StandInDevice):
    """The stand-in device, replaying decode and cascade steps as TorchRunner does under CUDA
    graphs (every batch fits; levels of any size)."""

    @staticmethod
    def replays_decode(batch: int) -> bool:
        return True

    @staticmethod
    def replays_cascade(batch: int, levels=None) -> bool:
        return True


def requests(n: int, prompt: int, new: int, shared: float, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    common = list(rng.integers(0, VOCAB, size=int(round(prompt * shared))))
    return [Request(common + list(rng.integers(0, VOCAB, size=prompt - len(common))), new)
            for _ in range(n)]


def run_once(reqs: list, prefix: bool, cascade: bool) -> dict:
    runner = (CascadeStandIn if cascade else StandInDevice)(0.0)
    pages = len(reqs) * -(-(len(reqs[0].prompt) + reqs[0].max_new_tokens) // PAGE) + 64
    engine = Engine(runner, pages, PAGE, max_step_tokens=8192, max_batch=len(reqs),
                    prefix_cache=prefix, cascade="auto" if cascade else "off", overlap=True)
    for r in reqs:
        engine.add_request(r)
    # the wait in fetch() for the stand-in's worker thread (a thread hand-off, tens of us on
    # this VM, not the engine's work) is taken out of each step's time, as bench/engine.py does
    waited = time_fetch(runner)
    times, walls = [], []
    while engine.has_work:
        waited[0] = 0.0
        t0 = time.perf_counter()
        report = engine.step()
        dt = time.perf_counter() - t0
        if report is not None and report.scheduled and \
                report.num_tokens == len(report.scheduled):  # a decode step
            times.append((dt - waited[0]) * 1e3)
            walls.append(dt * 1e3)
    runner.close()
    times = np.array(times)
    return dict(p50_ms=float(np.median(times)), p90_ms=float(np.percentile(times, 90)),
                wall_p50_ms=float(np.median(walls)),
                decode_steps=int(times.size), cascade_steps=int(engine.cascade_steps),
                hit_rate=float(engine.prefix_hit_rate))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--shared", type=float, default=0.9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = {}
    for name, shared, prefix, cascade in (("no prefix cache", 0.0, False, False),
                                          ("prefix cache", a.shared, True, False),
                                          ("prefix cache + cascade", a.shared, True, True)):
        reqs = requests(a.requests, a.prompt, a.new, shared)
        runs = [run_once(reqs, prefix, cascade) for _ in range(a.rounds)]
        rows[name] = min(runs, key=lambda r: r["p50_ms"])
    result = dict(requests=a.requests, prompt=a.prompt, new_tokens=a.new, shared=a.shared,
                  page_size=PAGE, rounds=a.rounds, rows=rows)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'row':<24} {'p50 ms':>7} {'p90 ms':>7} {'wall p50':>8} {'decode':>7} "
          f"{'cascade':>8} {'hit':>6}")
    for name, r in rows.items():
        print(f"{name:<24} {r['p50_ms']:7.3f} {r['p90_ms']:7.3f} {r['wall_p50_ms']:8.3f} "
              f"{r['decode_steps']:7d} {r['cascade_steps']:8d} {r['hit_rate']:6.3f}")


if __name__ == "__main__":
    main()
