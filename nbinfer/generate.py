"""Generate with the engine: ``python -m nbinfer.generate [options]``.

With no arguments: the ``tiny`` model with random weights, six requests of 24-token prompts and
16 new tokens each, arriving at once, on whatever is present: on a GPU the torch model in
float32 over nbinfer's kernels (paged pool, one plan per step for every layer, CUDA graphs
optional), else on the CPU the NumPy model in float64 (attention from :mod:`nbinfer.reference`).
Prints each request's token ids, a summary (output tokens/s, step latency p50/p99, pool
occupancy, prefix hit rate, preemptions, cascade steps, the share of step time spent in
attention) and the check against running every request alone through the NumPy reference
model without paging. ``--help`` lists the options; a bad option gets a one-line error.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

__all__ = ["main", "make_requests"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, naming the option (argparse's own text does)
        self.exit(2, f"nbinfer.generate: error: {message}\n")


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value
    return parse


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    from .engine.config import CONFIGS

    p = _Parser(prog="python -m nbinfer.generate",
                description="Serve random or checkpoint requests with nbinfer's engine.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default="tiny", choices=sorted(CONFIGS),
                     help="named model shape, random weights (default tiny)")
    src.add_argument("--checkpoint", default=None, metavar="DIR",
                     help="local Hugging Face folder (config.json + *.safetensors)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"],
                   help="auto: the GPU when torch sees one, else the CPU")
    p.add_argument("--dtype", default=None,
                   choices=["float64", "float32", "float16", "bfloat16"],
                   help="compute dtype (default float64 on the CPU, float32 on the GPU; the "
                        "CPU takes float64/float32, the GPU float32/float16/bfloat16)")
    p.add_argument("--requests", type=_positive(int), default=6)
    p.add_argument("--prompt-len", type=_positive(int), default=24)
    p.add_argument("--output-len", type=_positive(int), default=16)
    p.add_argument("--arrival", default="all", choices=["all", "poisson"],
                   help="all at step 0, or Poisson arrivals at --rate requests per step")
    p.add_argument("--rate", type=_positive(float), default=0.5)
    p.add_argument("--shared-prefix", type=_fraction, default=0.0, metavar="F",
                   help="share of each prompt that every request has in common")
    p.add_argument("--pool-pages", type=_positive(int), default=256)
    p.add_argument("--page-size", type=_positive(int), default=4)
    p.add_argument("--max-step-tokens", type=_positive(int), default=64)
    p.add_argument("--prefix-cache", default="on", choices=["on", "off"])
    p.add_argument("--cascade", default="auto", choices=["auto", "always", "off"],
                   help="decode steps whose requests share pages run as a cascade: when the "
                        "engine's rule says it pays (auto), whenever pages are shared "
                        "(always), or never (off)")
    p.add_argument("--cuda-graphs", default="off", choices=["on", "off"],
                   help="GPU only: capture decode steps once per batch bucket and replay them")
    p.add_argument("--overlap", default="off", choices=["on", "off"],
                   help="launch each step before the previous step's tokens reach the host")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true",
                   help="skip the comparison with each request run alone")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def make_requests(rng, n, prompt_len, output_len, vocab, shared_prefix=0.0, arrival="all",
                  rate=0.5):
    """``n`` requests of random prompts, a common first ``shared_prefix`` share, arriving at
    step 0 or as a Poisson process of ``rate`` requests per step."""
    from .engine import Request

    common = list(rng.integers(0, vocab, size=int(prompt_len * shared_prefix)))
    steps = np.zeros(n, dtype=int) if arrival == "all" else \
        np.floor(np.cumsum(rng.exponential(1.0 / rate, size=n))).astype(int)
    return [Request(common + list(rng.integers(0, vocab, size=prompt_len - len(common))),
                    output_len, arrival=int(s)) for s in steps]


def _gpu_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _error(option: str, message: str) -> int:
    print(f"nbinfer.generate: error: argument {option}: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    from . import reference  # noqa: F401  (loaded before the clock: the first step's latency)
    from ._progress import ProgressBar
    from .engine import Engine, NumpyLlama, NumpyRunner, generate_alone, init_weights, named_config
    from .engine.checkpoint import load_checkpoint

    gpu = a.device == "gpu" or (a.device == "auto" and _gpu_present())
    if a.device == "gpu" and not _gpu_present():
        return _error("--device", "no CUDA GPU visible to torch (or torch is not installed)")
    dtype_name = a.dtype or ("float32" if gpu else "float64")
    if gpu and dtype_name == "float64":
        return _error("--dtype", "the GPU model runs float32, float16 or bfloat16")
    if not gpu and dtype_name in ("float16", "bfloat16"):
        return _error("--dtype", "the CPU model runs float64 or float32")
    if a.cuda_graphs == "on" and not gpu:
        return _error("--cuda-graphs", "CUDA graphs need the GPU engine (--device gpu)")
    try:
        if a.checkpoint:
            cfg, weights = load_checkpoint(a.checkpoint)
        else:
            cfg = named_config(a.config)
            weights = init_weights(cfg, seed=a.seed)
    except (OSError, ValueError) as exc:
        return _error("--checkpoint", str(exc))
    reference_model = NumpyLlama(cfg, weights, dtype=np.float64 if gpu else dtype_name)
    rng = np.random.default_rng(a.seed)
    requests = make_requests(rng, a.requests, a.prompt_len, a.output_len, cfg.vocab_size,
                             a.shared_prefix, a.arrival, a.rate)
    if gpu:
        import torch

        from .engine.torch_model import TorchLlama
        from .engine.torch_runner import TorchRunner
        from .kernels.common import HEAD_DIMS

        if cfg.head_dim not in HEAD_DIMS:
            return _error("--config", f"the GPU kernels take head_dim {HEAD_DIMS}, the model "
                                      f"has {cfg.head_dim}")
        model = TorchLlama(cfg, weights, device="cuda", dtype=getattr(torch, dtype_name))
        runner = TorchRunner(model, a.pool_pages, a.page_size, timing=True,
                             cuda_graphs=a.cuda_graphs == "on")
        where = f"GPU torch {dtype_name} over nbinfer's kernels" + (
            ", CUDA graphs" if a.cuda_graphs == "on" else "")
    else:
        runner = NumpyRunner(reference_model, a.pool_pages, a.page_size)
        where = f"CPU NumPy {dtype_name}"
    engine = Engine(runner, a.pool_pages, a.page_size, max_step_tokens=a.max_step_tokens,
                    prefix_cache=a.prefix_cache == "on", cascade=a.cascade,
                    overlap=a.overlap == "on")
    print(f"engine: {cfg.name} ({cfg.num_parameters() / 1e6:.2f} M weights), {where}, "
          f"{a.pool_pages} pages of {a.page_size} tokens, {a.requests} requests, "
          f"prompt {a.prompt_len} (shared {a.shared_prefix:.0%}), output {a.output_len}")
    if a.cascade == "auto":
        print(f"attention rule: {Engine.CASCADE_RULE}")
    bar = ProgressBar(a.requests * a.output_len, None if a.quiet else sys.stderr)
    latency, occupancy, t_prev = [], [], [time.perf_counter()]

    def on_step(report):
        now = time.perf_counter()
        latency.append(now - t_prev[0])
        t_prev[0] = now
        occupancy.append(report.pages_in_use / a.pool_pages)
        bar.step(f"step {report.step}: {report.num_tokens} tokens", n=len(report.sampled))

    t0 = time.perf_counter()
    try:
        outputs = engine.run(requests, on_step=on_step)
    except ValueError as exc:
        bar.close()
        return _error("--pool-pages", str(exc))
    wall = time.perf_counter() - t0
    bar.close()
    for i, out in enumerate(outputs):
        print(f"request {i}: {out}")
    lat = np.array(latency) * 1e3
    n_out = sum(len(o) for o in outputs)
    print(f"{n_out} output tokens in {wall:.2f} s: {n_out / wall:.1f} tokens/s over "
          f"{engine.steps} steps; step latency p50 {np.percentile(lat, 50):.1f} ms, "
          f"p99 {np.percentile(lat, 99):.1f} ms")
    print(f"pool occupancy mean {np.mean(occupancy):.0%}, peak {max(occupancy):.0%}; prefix hit "
          f"rate {engine.prefix_hit_rate:.0%}; preemptions {engine.preemptions}; evicted pages "
          f"{engine.evicted_pages}; cascade steps {engine.cascade_steps} of {engine.steps}; "
          f"attention {runner.attention_seconds / wall:.0%} of the time")
    if a.no_check:
        return 0
    alone = [generate_alone(reference_model, r.prompt, r.max_new_tokens) for r in requests]
    same = sum(o == w for o, w in zip(outputs, alone, strict=True))
    print(f"check: {same}/{len(outputs)} requests give the same greedy tokens as each run alone "
          f"through the NumPy model without paging ({reference_model.dtype.name})")
    if dtype_name in ("float16", "bfloat16"):
        print("(16-bit weights and activations round differently from the float64 reference: "
              "tokens may part ways after a near tie; only float32 and float64 must agree)")
        return 0
    return 0 if same == len(outputs) else 1


if __name__ == "__main__":
    sys.exit(main())
