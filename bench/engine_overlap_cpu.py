"""The engine's overlap on a CPU, against a stand-in device that takes a fixed time per step.

    python3 bench/engine_overlap_cpu.py --out bench/results/issue12/overlap_cpu.json

What ``Engine(overlap=True)`` buys is the host's work of one step done while the device runs
the one before. That needs no GPU to measure: the runner here queues each forward pass on one
worker thread (a stream: jobs run in order) that sleeps ``--device-ms`` and then "samples" a
token that depends on the step's inputs (a hash of token and position, so that a placeholder
filled wrongly changes every later token); ``sample()`` returns a future, ``fetch()`` waits
for it, placeholders are filled on the worker from the last sample, as the GPU runner fills
them on the device. The engine's own bookkeeping is the real one (64 requests, pages of 16).

Per run: wall time per decode step (median), against ``device_ms`` and the host's own time per
step (the same run with a device of 0 ms). Expected: without overlap a step costs device +
host, with it max(device, host) plus the thread hand-off. The tokens of the two modes must be
equal. The last lines are a table.
"""

from __future__ import annotations

import argparse
import json
import queue
import threading
import time
from concurrent.futures import Future

import numpy as np

from nbinfer.engine import Engine, Request

VOCAB = 50000


class StandInDevice:
    """A runner whose forward passes run, in order, on one worker thread that sleeps
    ``device_s`` per pass: the engine sees an asynchronous device (module docstring)."""

    name = "stand-in"

    def __init__(self, device_s: float):
        self.device_s = device_s
        self.jobs: queue.Queue = queue.Queue()
        self._sampled = np.zeros(1, dtype=np.int64)  # touched by the worker only
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def _work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()

    def close(self):
        self.jobs.put(None)
        self.worker.join()

    def forward(self, tokens, positions, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                levels=None, rows=None):
        tokens, positions = np.asarray(tokens, np.int64), np.asarray(positions, np.int64)
        rows = np.arange(len(qo_indptr) - 1) if rows is None else np.asarray(rows)
        out: Future = Future()

        def run():
            t = tokens
            if t.size and t.min() < 0:  # placeholders: the last sample, on the "device"
                t = np.where(t >= 0, t, self._sampled[np.maximum(-1 - t, 0)])
            if self.device_s:
                time.sleep(self.device_s)
            out.set_result((t[rows] * 31 + positions[rows] * 17 + 7) % VOCAB)

        self.jobs.put(run)
        return out

    def sample(self, logits: Future) -> Future:
        done: Future = Future()

        def run():
            self._sampled = logits.result()
            done.set_result(self._sampled)

        self.jobs.put(run)
        return done

    @staticmethod
    def fetch(handle: Future) -> list:
        return handle.result().tolist()


def time_fetch(runner) -> list:
    """Wrap ``runner.fetch`` (an instance attribute, which the engine looks up each step) so
    that its waits add up in the returned one-element list, in seconds (the caller zeroes it):
    with overlap a step's wall time less that wait is the host's work of the step."""
    waited, fetch = [0.0], runner.fetch

    def timed_fetch(handle):
        t = time.perf_counter()
        tokens = fetch(handle)
        waited[0] += time.perf_counter() - t
        return tokens

    runner.fetch = timed_fetch
    return waited


def run(device_ms: float, overlap: bool, requests, pages: int, page: int):
    runner = StandInDevice(device_ms / 1e3)
    engine = Engine(runner, pages, page, max_step_tokens=8192, max_batch=len(requests),
                    overlap=overlap)
    for r in requests:
        engine.add_request(r)
    times, t_prev = [], time.perf_counter()
    t0 = t_prev
    while engine.has_work:
        report = engine.step()
        now = time.perf_counter()
        if report is not None and report.num_tokens == len(report.scheduled) and \
                report.scheduled:  # a decode step (one token per sequence)
            times.append(now - t_prev)
        t_prev = now
    wall = time.perf_counter() - t0
    runner.close()
    outputs = [engine.finished[i] for i in range(len(requests))]
    return dict(wall_s=wall, steps=engine.steps, decode_step_ms_p50=float(np.median(times)) * 1e3,
                decode_steps=len(times)), outputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--device-ms", default="0,1,2.8", help="stand-in device time per step")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    requests = [Request(list(rng.integers(0, VOCAB, size=a.prompt)), a.new)
                for _ in range(a.requests)]
    page = 16
    pages = a.requests * -(-(a.prompt + a.new) // page) + 64
    results = dict(requests=a.requests, prompt=a.prompt, new_tokens=a.new, page_size=page,
                   runs={})
    for device_ms in [float(x) for x in a.device_ms.split(",")]:
        row = {}
        outs = {}
        for overlap in (False, True):
            row["overlap" if overlap else "serial"], outs[overlap] = run(device_ms, overlap,
                                                                         requests, pages, page)
        row["same_tokens"] = outs[False] == outs[True]
        results["runs"][str(device_ms)] = row
        print(device_ms, json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'device ms':>9s} {'serial step ms':>14s} {'overlap step ms':>15s} {'same tokens':>11s}")
    for k, row in results["runs"].items():
        print(f"{float(k):9.1f} {row['serial']['decode_step_ms_p50']:14.3f} "
              f"{row['overlap']['decode_step_ms_p50']:15.3f} {str(row['same_tokens']):>11s}")


if __name__ == "__main__":
    main()
