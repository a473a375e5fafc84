"""Where a replayed decode step's host time goes, paged against cascade, on the GPU's host.

    python3 bench/engine_host_profile.py [--out JSON] [--top 25]

bench/engine.py's shared-prefix rows (Llama-3.2-1B shapes, bf16, 64 x (1024 + 256), 90 %
shared, CUDA graphs, overlap) measure the host half of a decode step (``decode_host_ms_p50``,
a step's wall time less its wait in ``fetch()``): on the H200's host in session 24 0.71 ms for
the paged step and 1.95 ms for the cascade step, but 1.06 ms for the same cascade plans when
the layers were torch operations (a slower GPU step, 2.89 against 2.04 ms). So ~0.9 ms of the
first figure looks like a wait on the GPU somewhere other than ``fetch()``, which shows only
when the GPU is barely behind the host. A deterministic profiler would slow the host and hide
it; this samples the main thread's stack from a second thread instead (``sys._current_frames``
about every 0.2 ms; a call blocked in the driver or in torch releases the GIL, so the sampler
sees it) over the timed run of each row, and prints, per decode step, the milliseconds spent in
each function (innermost frame, and anywhere on the stack). Then the GPU side: each row eager
under torch.profiler, kernel time per decode step by kind (bench/engine.py's
``gpu_breakdown``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from engine import PAGE, gpu_breakdown, make_requests  # noqa: E402 (this folder)
from engine_overlap_cpu import time_fetch  # noqa: E402

from nbinfer.engine import Engine, named_config  # noqa: E402
from nbinfer.engine.torch_model import TorchLlama  # noqa: E402
from nbinfer.engine.torch_runner import TorchRunner  # noqa: E402


class StackSampler:
    """Samples one thread's Python stack from a daemon thread every ``interval`` seconds:
    ``leaf`` counts the innermost frame, ``inclusive`` every distinct frame on the stack."""

    def __init__(self, thread_id: int, interval: float = 2e-4, depth: int = 40):
        self.tid, self.interval, self.depth = thread_id, interval, depth
        self.leaf: dict[str, int] = {}
        self.inclusive: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _name(frame) -> str:
        code = frame.f_code
        return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_name}"

    def _run(self):
        while not self._stop.is_set():
            time.sleep(self.interval)
            frame = sys._current_frames().get(self.tid)
            if frame is None:
                continue
            self.samples += 1
            leaf = self._name(frame)
            self.leaf[leaf] = self.leaf.get(leaf, 0) + 1
            seen = set()
            for _ in range(self.depth):
                if frame is None:
                    break
                seen.add(self._name(frame))
                frame = frame.f_back
            for name in seen:
                self.inclusive[name] = self.inclusive.get(name, 0) + 1

    def __enter__(self):
        # the sampler needs the GIL to look: a shorter switch interval than the default 5 ms
        # lets it in while the main thread runs Python (on a 2-core VM a busy loop was then
        # sampled at 60 % of the rate of a sleep, against 2 % at 5 ms)
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)


def profiled(model, reqs, warm, *, prefix, cascade, graphs=True, overlap=True, top=25):
    """One engine run (after a warm-up on the same runner) with its main thread's stack
    sampled: per decode step host ms (wall less the fetch wait), the run's wall time split
    over the functions the samples found (ms per decode step, innermost and inclusive)."""
    pages = sum(-(-(len(r.prompt) + r.max_new_tokens) // PAGE) for r in reqs) + 64
    runner = TorchRunner(model, pages, PAGE, cuda_graphs=graphs,
                         graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64), cascade_graphs=cascade)

    def engine():
        return Engine(runner, pages, PAGE, max_step_tokens=8192, max_batch=len(reqs),
                      prefix_cache=prefix, cascade="auto" if cascade else "off",
                      overlap=overlap)

    engine().run(warm)
    eng = engine()
    waited = time_fetch(runner)
    steps, last = [], [0.0]

    def on_step(rep):
        now = time.perf_counter()
        decode = all(n == 1 for _, n in rep.scheduled)
        steps.append((now - last[0], decode, waited[0]))
        last[0], waited[0] = now, 0.0

    torch.cuda.synchronize()
    last[0] = t0 = time.perf_counter()
    with StackSampler(threading.get_ident()) as sampler:
        eng.run(reqs, on_step=on_step)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    host = [(s - w) * 1e3 for s, d, w in steps if d]
    n = len(host)
    per = wall * 1e3 / max(sampler.samples, 1) / n  # ms per decode step of one sample

    def table(counts):
        return [dict(fn=k, ms_per_step=v * per)
                for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]

    return dict(decode_steps=n, cascade_steps=eng.cascade_steps, wall_s=wall,
                samples=sampler.samples, host_ms_p50_sampled=float(np.median(host)),
                fetch_ms_per_step=float(np.mean([w for _, d, w in steps if d])) * 1e3,
                top_leaf=table(sampler.leaf), top_inclusive=table(sampler.inclusive))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    cfg = named_config("llama-3.2-1b")
    model = TorchLlama.random(cfg, "cuda", torch.bfloat16, seed=0)
    rng = np.random.default_rng(0)
    shared = make_requests(rng, 64, 1024, 256, 0.9, cfg.vocab_size)
    warm = make_requests(rng, 64, 48, 4, 0.75, cfg.vocab_size)
    res = dict(device=torch.cuda.get_device_name())
    for name, kw in (("paged", dict(prefix=False, cascade=False)),
                     ("cascade", dict(prefix=True, cascade=True))):
        res[name] = profiled(model, shared, warm, top=a.top, **kw)
        res[name + " gpu"] = gpu_breakdown(model, shared, 8192, top=12, **kw)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    for name in ("paged", "cascade"):
        r = res[name]
        print(f"== {name}: {r['decode_steps']} decode steps ({r['cascade_steps']} cascade), "
              f"host p50 {r['host_ms_p50_sampled']:.2f} ms, fetch wait "
              f"{r['fetch_ms_per_step']:.2f} ms per step, {r['samples']} samples")
        print(f"{'ms/step':>8}  innermost frame")
        for row in r["top_leaf"]:
            print(f"{row['ms_per_step']:8.3f}  {row['fn']}")
        print(f"{'ms/step':>8}  anywhere on the stack")
        for row in r["top_inclusive"]:
            print(f"{row['ms_per_step']:8.3f}  {row['fn']}")
        g = res[name + " gpu"]
        ms = {k: round(v, 3) for k, v in g.items() if isinstance(v, float)}
        print(f"  gpu ms/step {json.dumps(ms)} ({g['cascade_steps']} cascade steps)")
        for k, v in g["top kernels us"].items():
            print(f"  {v:9.1f} us  {k}")


if __name__ == "__main__":
    main()
