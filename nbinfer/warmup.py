"""Warm-up: compile, ahead of time, every kernel a model configuration needs, into the disk cache.

A kernel compiles in 8-17 s the first time any process on a machine needs it, then loads from
the persistent cache (:mod:`nbinfer.kernels.cache`) in milliseconds. ``warmup`` pays the first
part ahead of time and in parallel: it lists the kernels of a configuration (head dims, group
sizes, page sizes, dtypes, layouts, attention options), runs each one once on a tiny problem
through the public API in a pool of worker processes (so what is compiled is exactly what
``plan()`` would compile), shows a progress bar, and returns a summary of what was compiled and
what was already cached.

From the shell::

    python -m nbinfer.warmup --head-dim 128 --groups 4 --page-size 16 --dtype float16 \\
        --causal --window 4096 --jobs 8

or from Python::

    nbinfer.warmup(head_dims=[128], group_sizes=[4], options=[{}, {"causal": True}])
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import types
from dataclasses import dataclass

from ._progress import ProgressBar

KINDS = ("decode", "prefill", "ragged", "single_decode", "append", "merge", "cascade", "layers")
NUM_KV_HEADS = 8  # of the tiny warm-up problems; kernels depend on the group size, not on it


@dataclass(frozen=True)
class Task:
    """One public call that compiles (or loads) the kernels of one configuration."""

    kind: str
    head_dim: int
    group_size: int
    page_size: int
    dtype: str
    kv_layout: str
    options: tuple = ()  # FlashInfer plan flags as sorted (name, value) pairs

    @property
    def label(self) -> str:
        opts = " ".join(f"{k}={v}" for k, v in self.options)
        return (f"{self.kind} D{self.head_dim} G{self.group_size} P{self.page_size} "
                f"{self.dtype} {self.kv_layout}" + (f" {opts}" if opts else ""))


def tasks(head_dims=(128,), group_sizes=(4,), page_sizes=(16,), dtypes=("float16",),
          kv_layouts=("NHD",), options=({},), kinds=KINDS) -> list[Task]:
    """The warm-up calls of a configuration: every combination, each kind once per distinct
    kernel (decode ignores ``causal``; append and merge take no attention options; the
    one-launch cascade, its own kernel and merge launch, takes only ``logits_soft_cap``;
    ``layers``, the torch model's layer kernels around attention, depends on the head dim and
    dtype only)."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kinds: unknown kind {kind!r}; accepted: {', '.join(KINDS)}")
    for name, values in (("head_dims", head_dims), ("group_sizes", group_sizes),
                         ("page_sizes", page_sizes), ("dtypes", dtypes),
                         ("kv_layouts", kv_layouts), ("options", options)):
        if isinstance(values, (str, int, dict)) or not len(values):
            raise ValueError(f"{name} must be a non-empty sequence, got {values!r}")
    out = []
    seen = set()
    for kind, d, g, ps, dt, lay, opt in itertools.product(kinds, head_dims, group_sizes,
                                                          page_sizes, dtypes, kv_layouts,
                                                          options):
        if not isinstance(opt, dict):
            raise TypeError(f"options: each entry must be a dict of plan flags, got {opt!r}")
        opt = dict(opt)
        if kind in ("decode", "single_decode"):
            opt.pop("causal", None)
        if kind in ("append", "merge", "layers"):
            opt, g = {}, 1
        if kind == "cascade":  # position-dependent flags are not the cascade's
            opt = {k: v for k, v in opt.items() if k == "logits_soft_cap"}
        if kind in ("ragged", "single_decode", "merge", "layers"):
            ps = 1
        if kind in ("merge", "layers"):
            lay = "NHD"
        task = Task(kind, int(d), int(g), int(ps), str(dt), str(lay), tuple(sorted(opt.items())))
        if task not in seen:
            seen.add(task)
            out.append(task)
    return out


def run_task(task: Task) -> list[dict]:
    """Run one warm-up call in this process; returns what it loaded (kind, cached, seconds)."""
    import numpy as np

    import nbinfer
    from nbinfer.formats import PageTable
    from nbinfer.kernels import compiled

    try:
        import torch
    except ImportError:  # NumPy inputs go to the GPU through the same API
        torch = None
    first = len(compiled.LOADED)
    t0 = time.perf_counter()
    d, g, ps, hkv = task.head_dim, task.group_size, task.page_size, NUM_KV_HEADS
    hq = g * hkv
    opts = dict(task.options)
    rng = np.random.default_rng(0)

    def arr(*shape):
        x = rng.standard_normal(shape).astype(np.float32)
        if torch is None:
            if task.dtype == "bfloat16":
                raise RuntimeError("warm-up of bfloat16 kernels needs torch")
            return x.astype(task.dtype)
        return torch.from_numpy(x).to("cuda", getattr(torch, task.dtype))

    ws = (torch.empty(32 << 20, dtype=torch.uint8, device="cuda") if torch is not None
          else _device_zeros(32 << 20))
    lens = [37, 5]
    pt = PageTable.from_kv_lens(lens, ps)
    shape = (pt.num_pages, 2, ps, hkv, d) if task.kv_layout == "NHD" else \
        (pt.num_pages, 2, hkv, ps, d)
    if task.kind == "decode":
        w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(ws, task.kv_layout)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=task.dtype,
               **opts)
        w.run(arr(len(lens), hq, d), arr(*shape))
    elif task.kind == "prefill":
        w = nbinfer.BatchPrefillWithPagedKVCacheWrapper(ws, task.kv_layout)
        qo = np.array([0, 3, 6], dtype=np.int32)
        w.plan(qo, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
               q_data_type=task.dtype, **opts)
        w.run(arr(6, hq, d), arr(*shape))
    elif task.kind == "ragged":
        w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, task.kv_layout)
        qo = np.array([0, 3, 6], dtype=np.int32)
        kv = np.array([0, 37, 42], dtype=np.int32)
        w.plan(qo, kv, hq, hkv, d, q_data_type=task.dtype, **opts)
        kv_shape = (42, hkv, d) if task.kv_layout == "NHD" else (hkv, 42, d)
        w.run(arr(6, hq, d), arr(*kv_shape), arr(*kv_shape))
    elif task.kind == "cascade":
        # two requests over one pool: a page both see (any page: the pool is only read),
        # then each one's own pages
        w = nbinfer.MultiLevelCascadeAttentionWrapper(2, ws, task.kv_layout)
        w.plan([np.array([0, 2], np.int32), np.arange(3, dtype=np.int32)],
               [np.array([0, 1], np.int32), pt.indptr], [pt.indices[:1], pt.indices],
               [np.array([ps], np.int32), pt.last_page_len], hq, hkv, d, ps,
               q_data_type=task.dtype, **opts)
        w.run(arr(2, hq, d), arr(*shape))
    elif task.kind == "single_decode":
        kv_shape = (37, hkv, d) if task.kv_layout == "NHD" else (hkv, 37, d)
        nbinfer.single_decode_with_kv_cache(arr(hq, d), arr(*kv_shape), arr(*kv_shape),
                                            kv_layout=task.kv_layout, **opts)
    elif task.kind == "append":
        cache = arr(*shape)
        new = PageTable.from_kv_lens([38, 5], ps)
        nbinfer.append_paged_kv_cache(arr(1, hkv, d), arr(1, hkv, d), np.array([0], np.int32),
                                      np.array([37], np.int32), cache, new.indices, new.indptr,
                                      new.last_page_len, task.kv_layout)
    elif task.kind == "merge":
        v = arr(3, 2, hkv, d)
        s = rng.standard_normal((3, 2, hkv)).astype(np.float32)
        if torch is not None:
            s = torch.from_numpy(s).cuda()
        nbinfer.merge_states(v, s)
        v0, s0 = nbinfer.merge_state(v[:, 0].contiguous(), s[:, 0].contiguous(),
                                     v[:, 1].contiguous(), s[:, 1].contiguous())
        # the in-place form is a kernel of its own (a barrier before the LSE write)
        nbinfer.merge_state_in_place(v0, s0, v[:, 1].contiguous(), s[:, 1].contiguous())
    elif task.kind == "layers":
        # what TorchLlama's fused form runs per layer: the residual add + RMSNorm (float32
        # weights), RMSNorm alone, SiLU-and-multiply, RoPE of q and k from a cos/sin table
        from nbinfer.api.arrays import resolve_backend
        from nbinfer.reference.layers import cos_sin_cache

        sim = resolve_backend("auto") == "sim"

        def dev(x):  # the layer kernels take device arrays on the GPU (host ones: simulator)
            x = np.ascontiguousarray(x)
            if sim:
                return x
            if torch is not None:
                return torch.from_numpy(x).cuda()
            from numba import cuda

            return cuda.to_device(x)

        def act(*shape):
            return arr(*shape) if torch is not None and not sim else dev(arr(*shape))

        w = dev(np.ones(2 * d, np.float32))
        nbinfer.fused_add_rmsnorm(act(3, 2 * d), act(3, 2 * d), w)
        nbinfer.rmsnorm(act(3, 2 * d), w)
        nbinfer.silu_and_mul(act(3, 4 * d))
        table = dev(cos_sin_cache(1.0 / 1e4 ** (np.arange(0, d, 2) / d), 8))
        nbinfer.apply_rope_with_cos_sin_cache(dev(np.arange(3, dtype=np.int64)), act(3, 2 * d),
                                              act(3, d), d, table)
    else:  # pragma: no cover - tasks() validates kinds
        raise ValueError(task.kind)
    if torch is not None:
        torch.cuda.synchronize()
    out = [dict(task=task.label, kernel=kind, cached=k.from_cache,
                seconds=round(k.timings["total"], 3))
           for kind, _, k in compiled.LOADED[first:]]
    if not out:  # everything this call needs was already loaded in this process
        out = [dict(task=task.label, kernel="-", cached=True,
                    seconds=round(time.perf_counter() - t0, 3))]
    return out


def _device_zeros(nbytes):
    from numba import cuda

    return cuda.device_array(nbytes, dtype="uint8")


def _has_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # noqa: BLE001 - no driver, no toolkit: no GPU
        return False


def warmup(*, head_dims=(128,), group_sizes=(4,), page_sizes=(16,), dtypes=("float16",),
           kv_layouts=("NHD",), options=({}, {"causal": True}), kinds=KINDS,
           processes: int | None = None, progress: bool = True, file=None) -> list[dict]:
    """Compile (or find in the disk cache) every kernel of a configuration, in parallel.

    Parameters
    ----------
    head_dims, group_sizes, page_sizes : sequences of int
        Head dimensions, GQA group sizes (``num_qo_heads // num_kv_heads``) and page sizes.
    dtypes : sequence of {"float16", "bfloat16", "float32"}
        q and KV storage dtypes (one dtype for both).
    kv_layouts : sequence of {"NHD", "HND"}
    options : sequence of dict
        Attention options, each a dict of FlashInfer ``plan()`` flags: ``{}`` (plain),
        ``{"causal": True}``, ``{"window_left": 4096}``, ``{"logits_soft_cap": 30.0}``,
        ``{"pos_encoding_mode": "ROPE_LLAMA"}``, ``{"variant": "sigmoid"}``, or combinations.
    kinds : sequence of str
        Any of ``"decode"``, ``"prefill"`` (paged), ``"ragged"`` (ragged and single prefill),
        ``"single_decode"``, ``"append"``, ``"merge"``.
    processes : int, optional
        Worker processes (default: one per task, at most the CPU count and 8). ``1`` compiles
        in this process.
    progress : bool
        Draw a progress bar on ``file`` (default stderr).

    Returns
    -------
    list of dict
        One row per kernel: the warm-up call (``task``), the kernel kind, whether it came from
        the cache (``cached``) and the seconds it took to compile or load.

    Raises
    ------
    RuntimeError
        No CUDA GPU (kernels are compiled for a GPU; the simulator compiles nothing ahead).
    """
    todo = tasks(head_dims, group_sizes, page_sizes, dtypes, kv_layouts, options, kinds)
    if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int)
                                  or processes < 1):
        raise ValueError(f"processes must be a positive int, got {processes!r}")
    if not _has_gpu():
        raise RuntimeError("warmup compiles kernels for a CUDA GPU and none is available here "
                           "(the simulator and the reference engine compile nothing ahead)")
    file = sys.stderr if file is None else file
    n = processes or min(len(todo), os.cpu_count() or 1, 8)
    rows: list[dict] = []
    t0 = time.perf_counter()
    bar = ProgressBar(len(todo), file if progress else None)
    if n == 1:
        for task in todo:
            rows += run_task(task)
            bar.step(task.label)
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
        with ctx.Pool(n) as pool:
            for task, got in zip(todo, pool.imap(run_task, todo), strict=True):
                rows += got
                bar.step(task.label)
    bar.close()
    # The plan() side: the compiled scheduler, loaded into this process (and compiled into
    # Numba's disk cache the first time on this machine), so no step of a generation pays it.
    from .scheduler import compiled

    t1 = time.perf_counter()
    cached = compiled.loaded()
    compiled.load()
    rows.append({"task": "plan()", "kernel": "scheduler (CPU)", "cached": cached,
                 "seconds": time.perf_counter() - t1})
    if progress:
        print(summary(rows, time.perf_counter() - t0, n), file=file)
    return rows


def summary(rows: list[dict], seconds: float, processes: int) -> str:
    """A table of the warm-up's kernels and a closing line."""
    compiled = [r for r in rows if not r["cached"]]
    width = max((len(r["task"]) for r in rows), default=10)
    lines = [f"{'call':<{width}}  {'kernel':<14} {'status':<9} {'s':>7}"]
    for r in rows:
        status = "cached" if r["cached"] else "compiled"
        lines.append(f"{r['task']:<{width}}  {r['kernel']:<14} {status:<9} {r['seconds']:7.2f}")
    lines.append(f"{len(rows)} kernels: {len(compiled)} compiled "
                 f"({sum(r['seconds'] for r in compiled):.1f} s of compile time), "
                 f"{len(rows) - len(compiled)} already cached; {seconds:.1f} s wall with "
                 f"{processes} process{'es' if processes > 1 else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nbinfer.warmup",
                                description="Compile a model configuration's kernels into the "
                                            "disk cache, in parallel.")
    p.add_argument("--head-dim", type=int, nargs="+", default=[128], metavar="D")
    p.add_argument("--groups", type=int, nargs="+", default=[4], metavar="G",
                   help="GQA group sizes (num_qo_heads // num_kv_heads)")
    p.add_argument("--page-size", type=int, nargs="+", default=[16], metavar="P")
    p.add_argument("--dtype", nargs="+", default=["float16"],
                   choices=["float16", "bfloat16", "float32"])
    p.add_argument("--layout", nargs="+", default=["NHD"], choices=["NHD", "HND"])
    p.add_argument("--causal", action="store_true", help="also the causal prefill kernels")
    p.add_argument("--window", type=int, nargs="*", default=[], metavar="W",
                   help="sliding windows (window_left)")
    p.add_argument("--soft-cap", type=float, nargs="*", default=[], metavar="C")
    p.add_argument("--rope", action="store_true", help="also fused RoPE (ROPE_LLAMA)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS),
                   help="which kernels (default all); prefill's also serve decode with "
                        "use_tensor_cores=True")
    p.add_argument("--jobs", type=int, default=None, help="worker processes")
    a = p.parse_args(argv)
    options = [{}]
    if a.causal:
        options.append({"causal": True})
    options += [{"window_left": w} for w in a.window]
    options += [{"logits_soft_cap": c} for c in a.soft_cap]
    if a.rope:
        options.append({"pos_encoding_mode": "ROPE_LLAMA"})
    import importlib

    # The package's module, not this __main__ copy: worker processes unpickle its functions.
    run = importlib.import_module("nbinfer.warmup").warmup
    try:
        run(head_dims=a.head_dim, group_sizes=a.groups, page_sizes=a.page_size,
            dtypes=a.dtype, kv_layouts=a.layout, options=options, kinds=a.kinds,
            processes=a.jobs)
    except (RuntimeError, ValueError, TypeError) as exc:
        print(f"nbinfer.warmup: {exc}", file=sys.stderr)
        return 2
    return 0


class _CallableModule(types.ModuleType):
    """``nbinfer.warmup`` is both this module (``python -m nbinfer.warmup``) and the function:
    calling the module calls :func:`warmup`."""

    def __call__(self, *args, **kwargs):
        return warmup(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["KINDS", "Task", "main", "run_task", "summary", "tasks", "warmup"]

if __name__ == "__main__":
    sys.exit(main())
