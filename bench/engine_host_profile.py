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

from engine import engine_run, gpu_breakdown, make_requests  # noqa: E402 (this folder)

from nbinfer.engine import named_config  # noqa: E402
from nbinfer.engine.torch_model import TorchLlama  # noqa: E402


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


def profiled(model, reqs, warm, *, prefix, cascade, top=25):
    """bench/engine.py's engine run (graphs, overlap) with its main thread's stack sampled over
    the timed run: its statistics and the run's wall time split over the functions the
    samples found (ms per decode step, innermost frame and inclusive)."""
    sampler = StackSampler(threading.get_ident())
    res, _ = engine_run(model, reqs, warm, graphs=True, prefix=prefix, cascade=cascade,
                        step_tokens=8192, overlap=True, around=lambda: sampler)
    per = res["wall_s"] * 1e3 / max(sampler.samples, 1) / res["decode_steps"]

    def table(counts):
        return [dict(fn=k, ms_per_step=v * per)
                for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]

    return res | dict(samples=sampler.samples, top_leaf=table(sampler.leaf),
                      top_inclusive=table(sampler.inclusive))


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
              f"host p50 {r['decode_host_ms_p50']:.2f} ms, fetch wait "
              f"{r['decode_fetch_ms_mean']:.2f} ms per step, {r['samples']} samples")
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
