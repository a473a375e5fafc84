"""Causal prefill and shared-prefix (cascade) decode on the H200.

    python bench/prefill.py --out bench/results/prefill_h200_v6.json
    python bench/prefill.py --grid [--kv-tiles 32,64] --out bench/results/issue13/prefill_grid_h200.json

a) Shared-prefix decode: 64 requests sharing an 8192-token prefix, 256 unique tokens each (fp16,
   Hq 32, Hkv 8, D 128, page 16): MultiLevelCascadeAttentionWrapper (2 levels) vs plain
   BatchDecodeWithPagedKVCacheWrapper over each request's full page list, same run, same pages.
   Byte model: plain reads 64 x 8448 tokens per KV head; cascade reads the prefix once per query
   tile of 64 packed rows (64 x 4 / 64 = 4 times) plus 64 x 256 own tokens; both levels run as
   one launch of the tensor-core prefill kernel.
b) Causal and non-causal prefill B=4, L=4096, H=32 (Hkv 32), D=128, fp16: TFLOP/s of the
   tensor-core prefill kernel (ragged KV) and torch SDPA flash / cuDNN on the same shapes, same
   run. FLOPs (causal) = 4 * B * H * D * L * (L + 1) / 2, non-causal 4 * B * H * D * L * L.
Timing: CUDA events, warm-up, median of 10 (b) / 30 (a) single calls (host time included);
(a) also 20 calls back to back per event pair (GPU time) and each path captured once in a CUDA
graph and replayed (``graph_speedup``: decode as a serving engine runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode import gpu_ms, median_ms, save_json  # noqa: E402

from nbinfer.api import prefill as prefill_api  # noqa: E402
from nbinfer.api.cascade import MultiLevelCascadeAttentionWrapper  # noqa: E402
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from nbinfer.api.launch import defer_frees  # noqa: E402
from nbinfer.api.prefill import BatchPrefillWithRaggedKVCacheWrapper  # noqa: E402


def shared_prefix_case(batch=64, prefix=8192, unique=256, hq=32, hkv=8, d=128, ps=16, seed=0,
                       order="random", dtype="float16"):
    """The shared-prefix problem, planned: a dict of the cascade and plain decode wrappers, q,
    the paged cache, the two levels' plan arguments, the page ids and ``heads``, the plan
    arguments ``(hq, hkv, d, ps)``. ``order``: the pool's page ids in random order (every
    page anywhere in the pool), or ``"sorted"`` (the prefix's pages consecutive, then each
    request's own: the order a fresh pool hands pages out in); ``dtype``: of q and the cache."""
    rng = np.random.default_rng(seed)
    pp, up = prefix // ps, unique // ps
    if order not in ("random", "sorted"):
        raise ValueError(f"order must be 'random' or 'sorted', got {order!r}")
    pool = (rng.permutation(pp + batch * up) if order == "random"
            else np.arange(pp + batch * up)).astype(np.int32)
    pre, own = pool[:pp], pool[pp:].reshape(batch, up)
    cache = torch.randn(pool.size, 2, ps, hkv, d, device="cuda").to(getattr(torch, dtype))
    q = torch.randn(batch, hq, d, device="cuda").to(getattr(torch, dtype))
    ws = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    casc = MultiLevelCascadeAttentionWrapper(2, ws)
    # Level 0: the prefix, one segment of every query; level 1: each request's own pages.
    levels = ([np.array([0, batch]), np.arange(batch + 1)],
              [np.array([0, pp]), np.arange(batch + 1) * up], [pre, own.ravel()],
              [np.array([ps]), np.full(batch, ps)])
    casc.plan(*levels, hq, hkv, d, ps, q_data_type=dtype)
    plain = BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8,
                                                           device="cuda"))
    full = np.concatenate([np.concatenate([pre, o]) for o in own])
    plain.plan(np.arange(batch + 1) * (pp + up), full, np.full(batch, ps), hq, hkv, d, ps,
               q_data_type=dtype)
    return dict(casc=casc, plain=plain, q=q, cache=cache, levels=levels, pre=pre, own=own,
                heads=(hq, hkv, d, ps))


def shared_prefix(batch=64, prefix=8192, unique=256, hq=32, hkv=8, d=128, ps=16, seed=0,
                  order="random", unshared=False, dtype="float16"):
    case = shared_prefix_case(batch, prefix, unique, hq, hkv, d, ps, seed, order, dtype)
    casc, plain, q, cache = case["casc"], case["plain"], case["q"], case["cache"]
    levels, pre, own = case["levels"], case["pre"], case["own"]
    pp, up = prefix // ps, unique // ps
    a = casc.run(q, cache)
    b = plain.run(q, cache)
    diff = float((a.float() - b.float()).abs().max())
    t_c = median_ms(lambda: casc.run(q, cache))
    t_p = median_ms(lambda: plain.run(q, cache))
    # Where the time goes: each level alone (a one-level cascade), the own tokens also on the
    # decode kernel, and every path back to back (20 launches per event pair: GPU time, the
    # host's launch cost hidden behind it) next to the one-call medians above.
    ws1 = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    parts = {}
    for name, qo_l, ptr, idx, last in (
            ("prefix_level", np.array([0, batch]), np.array([0, pp]), pre, np.array([ps])),
            ("own_level", np.arange(batch + 1), np.arange(batch + 1) * up, own.ravel(),
             np.full(batch, ps))):
        one = MultiLevelCascadeAttentionWrapper(1, ws1)
        one.plan([qo_l], [ptr], [idx], [last], hq, hkv, d, ps, q_data_type=dtype)
        sched = one.fused_wrapper.schedule
        parts[name] = dict(ms=median_ms(lambda one=one: one.run(q, cache)),
                           gpu_ms=back_to_back_ms(lambda one=one: one.run(q, cache)),
                           items=int(sched.num_work), kv_chunk=int(sched.kv_chunk))
    own_dec = BatchDecodeWithPagedKVCacheWrapper(ws1)
    own_dec.plan(np.arange(batch + 1) * up, own.ravel(), np.full(batch, ps), hq, hkv, d, ps,
                 q_data_type=dtype)
    parts["own_on_decode_kernel"] = dict(ms=median_ms(lambda: own_dec.run(q, cache)),
                                         gpu_ms=back_to_back_ms(lambda: own_dec.run(q, cache)))
    parts["cascade_gpu_ms"] = back_to_back_ms(lambda: casc.run(q, cache))
    # The one-launch plan under other chunkings and LPT cost weights (alpha per packed row,
    # beta = 1 per KV token): does balancing, not the kernel, decide the cascade's time?
    sweep = []
    # (the engine's shape, ``unshared``: also short chunks, the prefix items being the one
    # launch's critical path there: 8 serial 32-key tiles each at the planner's chunks)
    for split in (None, 256, 512) + ((64, 128) if unshared else ()):
        for alpha in (1.0, 64.0):
            casc.plan(*levels, hq, hkv, d, ps, q_data_type=dtype, fixed_split_size=split,
                      alpha=alpha)
            err = float((casc.run(q, cache).float() - b.float()).abs().max())
            sweep.append(dict(fixed_split_size=split, alpha=alpha, max_abs_diff=err,
                              items=int(casc.fused_wrapper.schedule.num_work),
                              ms=median_ms(lambda: casc.run(q, cache)),
                              gpu_ms=back_to_back_ms(lambda: casc.run(q, cache))))
    parts["schedule_sweep"] = sweep
    casc.plan(*levels, hq, hkv, d, ps, q_data_type=dtype)  # back to the default schedule
    parts["plain_gpu_ms"] = back_to_back_ms(lambda: plain.run(q, cache))
    # Level by level (CASCADE_LAUNCH = "levels"): the prefix level on the prefill wrapper's
    # rule (the lean warpgroup kernel on sm_90: 256 packed rows per KV head), with and without
    # its per-item overlap, the own level on the decode kernel, merge_state_in_place between.
    from nbinfer.api import cascade as cascade_api

    for name, prefetch in (("levels", None), ("levels_prefetch", True)):
        lv = MultiLevelCascadeAttentionWrapper(2, ws1)
        with api_overrides(LEAN_PREFETCH=prefetch), \
                api_overrides(cascade_api, CASCADE_LAUNCH="levels"):
            lv.plan(*levels, hq, hkv, d, ps, q_data_type=dtype)
        spec0 = lv._wrappers[0].step_plan.spec
        parts[name] = dict(
            max_abs_diff=float((lv.run(q, cache).float() - b.float()).abs().max()),
            prefix_kernel=type(spec0).__name__, prefix_lean=bool(getattr(spec0, "lean", False)),
            prefix_prefetch=bool(getattr(spec0, "prefetch", False)),
            last_on_decode=lv.last_level_on_decode,
            ms=median_ms(lambda lv=lv: lv.run(q, cache)),
            gpu_ms=back_to_back_ms(lambda lv=lv: lv.run(q, cache)))
        try:
            parts[name]["graph_ms"] = graph_ms(lambda lv=lv: lv.run(q, cache))
        except Exception as exc:  # recorded, so the rows after it are still measured
            parts[name]["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
    # As a serving engine runs decode: each path captured once in a CUDA graph and replayed.
    parts["cascade_graph_ms"] = graph_ms(lambda: casc.run(q, cache))
    parts["plain_graph_ms"] = graph_ms(lambda: plain.run(q, cache))
    parts["graph_speedup"] = parts["plain_graph_ms"] / parts["cascade_graph_ms"]
    fused_spec = casc.fused_wrapper.step_plan.spec
    if unshared:
        # Plain decode with every request's own copy of the prefix (what an engine without a
        # prefix cache reads: batch x (prefix + unique) tokens from HBM, not the prefix from
        # the L2), on a pool of its own in random order.
        pages = batch * (pp + up)
        own_cache = torch.randn(pages, 2, ps, hkv, d, device="cuda").to(getattr(torch, dtype))
        ids = np.random.default_rng(seed + 1).permutation(pages).astype(np.int32)
        copy = BatchDecodeWithPagedKVCacheWrapper(ws1)
        copy.plan(np.arange(batch + 1) * (pp + up), ids, np.full(batch, ps), hq, hkv, d, ps,
                  q_data_type=dtype)
        parts["plain_unshared_graph_ms"] = graph_ms(lambda: copy.run(q, own_cache))
        del own_cache
        # The one launch with the other of the two KV tiles (32 or 64 keys) than the rule's
        # (mma_tiles: the stage's 16 KiB of K and V, 32 keys at D 128, 64 at D 64); session
        # 25's H100 JSON has the 64-key row as "one_launch_kv64", before the rule took it.
        other = 96 - int(fused_spec.kv_tile)
        alt = MultiLevelCascadeAttentionWrapper(2, ws1)
        with api_overrides(MMA_KV_TILE=other, MMA_Q_SHARED=True, MMA_MAX_REGISTERS=168):
            alt.plan(*levels, hq, hkv, d, ps, q_data_type=dtype)
        parts["one_launch_other_tile"] = dict(
            kv_tile=int(alt.fused_wrapper.step_plan.spec.kv_tile),
            max_abs_diff=float((alt.run(q, cache).float() - b.float()).abs().max()),
            graph_ms=graph_ms(lambda: alt.run(q, cache)))
    return dict(batch=batch, prefix=prefix, unique=unique, head_dim=d, order=order,
                cascade_ms=t_c, plain_ms=t_p,
                speedup=t_p / t_c, max_abs_diff=diff, one_launch=casc.one_launch,
                kernel=type(fused_spec).__name__, kv_tile=int(fused_spec.kv_tile),
                work_items=int(casc.fused_wrapper.schedule.num_work),
                partial_rows=int(casc.fused_wrapper.schedule.num_partials), breakdown=parts)


def back_to_back_ms(fn, n=20):
    """Per-call time of ``n`` calls between one event pair (GPU-bound: host cost overlapped)."""
    return gpu_ms(fn, reps=n, rounds=1)


def graph_ms(fn, n=20, stream=None):
    """Median over 10 event pairs of ``n`` replays of ``fn`` captured once in a CUDA graph,
    on ``stream`` (default: a new one; a stream's attributes, e.g. an L2 access-policy
    window, go with the captured kernels)."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with defer_frees(), torch.cuda.graph(graph, stream=stream):  # (defer_frees: no free inside)
        fn()
    return median_ms(lambda: [graph.replay() for _ in range(n)], warmup=2, iters=10) / n


@contextlib.contextmanager
def tile_config(token: str):
    """The tensor-core kernel's tiles from ``token``: keys per KV tile, then ``s`` for Q kept in
    shared memory, then a register cap (none without it), then ``x`` and the number of KV
    stages, then ``m`` for split rows merged by a launch of their own, then ``k`` for items of
    at most 16 packed rows split over the warps by keys, then ``w`` and the warps per CTA, then
    ``g`` for the products on warpgroup MMA, then ``l`` for the lean warpgroup kernel where
    the plan allows it, then ``p`` for its per-item overlap (``LEAN_PREFETCH``; without ``l``
    the ``mma.sync`` kernel's, ``MMA_PREFETCH``: ``"32s168mp"``), then ``z``
    for its lazy rescale (``LEAN_LAZY_RESCALE``), then ``q`` for its S = Q K^T ahead of the
    ring's refill (``LEAN_QK_AHEAD``), then ``y`` for its swizzled K / V tiles
    (``LEAN_SWIZZLE``), then ``o`` and MiB for the plan's L2 order
    (``PREFILL_L2_SECTION_MIB``) (``"64"``, ``"32"``, ``"32s168"``, ``"32x4"``, ``"64m"``,
    ``"64mk"``, ``"64w8"``, ``"64w8g"``, ``"64w8gl"``, ``"64w8glp"``, ``"64w8glz"``,
    ``"64w8glpz"``, ``"64w8glq"``, ``"64w8glqy"``, ``"64w8glo16"``; the lean kernel's own shape
    is fixed, ``s255`` lifts its 128-register cap). Every field is set, so a token names one
    kernel and order whatever the wrapper (the cascade's rule included)."""
    m = re.fullmatch(r"(\d+)(s(\d+)?)?(x(\d))?(m)?(k)?(w(\d))?(g)?(l)?(p)?(z)?(q)?(y)?(o(\d+))?",
                     str(token))
    if m is None or (m.group(11) and not m.group(10)) or (
            (m.group(13) or m.group(14) or m.group(15)) and not m.group(11)):
        raise ValueError(f"tile config must look like 64, 32, 32s168, 32x4, 64m, 64mk, 64w8, "
                         f"64w8g, 64w8gl, 64w8glp, 64w8glz, 64w8glq, 64w8glqy or 64w8glo16, got "
                         f"{token!r}")
    with api_overrides(MMA_KV_TILE=int(m.group(1)), MMA_Q_SHARED=bool(m.group(2)),
                       MMA_MAX_REGISTERS=int(m.group(3)) if m.group(3) else 0,
                       MMA_STAGES=int(m.group(5)) if m.group(5) else None,
                       MMA_DEFER_MERGE=bool(m.group(6)), MMA_KV_SPLIT=bool(m.group(7)),
                       MMA_WARPS=int(m.group(9)) if m.group(9) else None,
                       MMA_WGMMA=bool(m.group(10)), MMA_WGMMA_LEAN=bool(m.group(11)),
                       LEAN_PREFETCH=bool(m.group(12)) and bool(m.group(11)),
                       MMA_PREFETCH=bool(m.group(12)) and not m.group(11),
                       LEAN_LAZY_RESCALE=bool(m.group(13)),
                       LEAN_QK_AHEAD=bool(m.group(14)), LEAN_SWIZZLE=bool(m.group(15)),
                       PREFILL_L2_SECTION_MIB=int(m.group(17)) if m.group(17) else None):
        yield


@contextlib.contextmanager
def api_overrides(module=prefill_api, **values):
    """Module-level overrides of ``module`` (default ``nbinfer.api.prefill``: ``MMA_KV_TILE=64``,
    ...; ``nbinfer.api.cascade``: ``CASCADE_LAUNCH="levels"``) set inside, restored after."""
    saved = {n: getattr(module, n) for n in values}
    try:
        for n, x in values.items():
            setattr(module, n, x)
        yield
    finally:
        for n, x in saved.items():
            setattr(module, n, x)


def causal_prefill(B=4, L=4096, H=32, d=128, causal=True, dtype="float16", kv_tiles=()):
    """Prefill TFLOP/s of nbinfer (and, for each of ``kv_tiles``, the tensor-core kernel with
    that many keys per tile, keys ``kv_tile_<n>``) against SDPA flash and cuDNN, same inputs."""
    flops = 4 * B * H * d * L * ((L + 1) / 2 if causal else L)
    q = torch.randn(B * L, H, d, device="cuda").to(getattr(torch, dtype))
    k, v = torch.randn_like(q), torch.randn_like(q)
    ptr = np.arange(B + 1) * L
    w = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(512 << 20, dtype=torch.uint8,
                                                         device="cuda"))
    res = dict(B=B, L=L, H=H, D=d, causal=causal, dtype=dtype, flops=flops)
    for tile in kv_tiles:
        with tile_config(tile):
            w.plan(ptr, ptr, H, H, d, causal=causal, q_data_type=dtype)
            ms = median_ms(lambda: w.run(q, k, v), warmup=2, iters=10)
        res[f"kv_tile_{tile}_ms"], res[f"kv_tile_{tile}_tflops"] = ms, flops / ms / 1e9
    w.plan(ptr, ptr, H, H, d, causal=causal, q_data_type=dtype)
    res["kv_tile"] = getattr(w.step_plan.spec, "kv_tile", None)
    ms = median_ms(lambda: w.run(q, k, v), warmup=2, iters=10)
    res["nbinfer_ms"], res["nbinfer_tflops"] = ms, flops / ms / 1e9
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa_fn

    q4, k4, v4 = (x.view(B, L, H, d).transpose(1, 2) for x in (q, k, v))
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(be):
                t = median_ms(lambda: sdpa_fn(q4, k4, v4, is_causal=causal))
            res[f"sdpa_{name}_ms"], res[f"sdpa_{name}_tflops"] = t, flops / t / 1e9
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            res[f"sdpa_{name}_error"] = str(exc)[:200]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", default=None, metavar="L,L,...",
                    help="only the causal prefill, B 1, at these lengths (lesson 07's sweep)")
    ap.add_argument("--kv-tiles", default=None, metavar="T,T",
                    help="only prefill (causal and not, B4 L4096 D128 fp16), the tensor-core "
                         "kernel's tile configs side by side: keys per KV tile, 's' for Q in "
                         "shared memory, a register cap (64,32,32s168)")
    ap.add_argument("--grid", action="store_true",
                    help="only prefill, issue 13's grid: causal and not, fp16 and bf16, D 64 "
                         "and 128, L 1024 / 4096 / 16384 at 16384 tokens per batch (with "
                         "--kv-tiles: each tile size too)")
    ap.add_argument("--grid-shapes", default=None, metavar="DTYPE:D:L,...",
                    help="with --grid: only these (dtype, head dim, length) rows, causal and "
                         "not (e.g. bfloat16:128:4096,float16:64:4096,float16:128:1024)")
    ap.add_argument("--shared", default=None, metavar="B,PREFIX,UNIQUE,D[,sorted]",
                    help="only the shared-prefix comparison, bf16, at this shape (e.g. the "
                         "engine benchmark's decode step: 64,912,240,64), plain decode over "
                         "unshared copies of the prefix too")
    args = ap.parse_args()
    if args.shared:
        f = args.shared.split(",")
        a = shared_prefix(batch=int(f[0]), prefix=int(f[1]), unique=int(f[2]), d=int(f[3]),
                          order=f[4] if len(f) > 4 else "random", unshared=True,
                          dtype="bfloat16")  # (the engine's: its kernels are cached)
        save_json(args.out, shared_prefix=a)
        br = a["breakdown"]
        print(f"shared prefix {args.shared}: graph replay us: cascade (one launch, "
              f"{a['work_items']} items) {br['cascade_graph_ms'] * 1e3:.1f}, levels "
              f"{br['levels'].get('graph_ms', float('nan')) * 1e3:.1f}, plain decode (shared "
              f"pages) {br['plain_graph_ms'] * 1e3:.1f}, plain decode (unshared copies) "
              f"{br['plain_unshared_graph_ms'] * 1e3:.1f}; one launch at {a['kv_tile']}-key"
              f" tiles above, at {br['one_launch_other_tile']['kv_tile']}-key tiles "
              f"{br['one_launch_other_tile']['graph_ms'] * 1e3:.1f}; prefix level "
              f"{br['prefix_level']['gpu_ms'] * 1e3:.1f}, own level {br['own_level']['gpu_ms'] * 1e3:.1f}"
              f" (decode kernel {br['own_on_decode_kernel']['gpu_ms'] * 1e3:.1f})")
        return
    tiles = args.kv_tiles.split(",") if args.kv_tiles else []
    if args.grid:
        rows = []
        only = None if not args.grid_shapes else {
            (dt, int(d), int(L)) for dt, d, L in (x.split(":") for x in args.grid_shapes.split(","))}
        for dtype in ("float16", "bfloat16"):
            for d in (128, 64):
                for causal in (True, False):
                    for L in (1024, 4096, 16384):
                        if only is not None and (dtype, d, L) not in only:
                            continue
                        r = causal_prefill(B=16384 // L, L=L, H=32 * 128 // d, d=d,
                                           causal=causal, dtype=dtype, kv_tiles=tiles)
                        rows.append(r)
                        print(f"{dtype} D{d} {'causal' if causal else 'full'} B{r['B']} L{L} "
                              f"H{r['H']}: nbinfer {r['nbinfer_tflops']:.1f} TFLOP/s (tile "
                              f"{r['kv_tile']}), flash {r.get('sdpa_flash_tflops', 0):.1f} "
                              f"({r['nbinfer_tflops'] / r.get('sdpa_flash_tflops', 1e-9):.2f}x)"
                              + "".join(f", tile {t}: {r[f'kv_tile_{t}_tflops']:.1f}"
                                        for t in tiles), flush=True)
        save_json(args.out, prefill_grid=rows)
        return
    if args.kv_tiles:
        rows = [causal_prefill(causal=c, kv_tiles=tiles) for c in (True, False)]
        save_json(args.out, kv_tile_ab=rows)
        for r in rows:
            ab = ", ".join(f"tile {t}: {r[f'kv_tile_{t}_tflops']:.1f}" for t in tiles)
            print(f"{'causal' if r['causal'] else 'non-causal'} prefill B4 L4096 D128 fp16: "
                  f"{ab} TFLOP/s; SDPA flash {r.get('sdpa_flash_tflops', float('nan')):.1f}, "
                  f"cuDNN {r.get('sdpa_cudnn_tflops', float('nan')):.1f}")
        return
    if args.sweep:
        rows = [causal_prefill(B=1, L=int(x)) for x in args.sweep.split(",")]
        save_json(args.out, causal_sweep=rows)
        for r in rows:
            print(f"causal prefill B1 L{r['L']}: nbinfer {r['nbinfer_tflops']:.1f} TFLOP/s, "
                  f"SDPA flash {r.get('sdpa_flash_tflops', float('nan')):.1f}, cuDNN "
                  f"{r.get('sdpa_cudnn_tflops', float('nan')):.1f}")
        return
    a = shared_prefix()
    b = causal_prefill()
    c = causal_prefill(causal=False)
    save_json(args.out, shared_prefix=a, causal_prefill=b, non_causal_prefill=c)
    print(f"shared prefix: cascade {a['cascade_ms']:.3f} ms, plain decode {a['plain_ms']:.3f} ms,"
          f" speed-up {a['speedup']:.2f}x (max |diff| {a['max_abs_diff']:.1e}); one launch "
          f"{a['one_launch']}, {a['kernel']}, {a['work_items']} items")
    for k, v in a["breakdown"].items():
        if k not in ("schedule_sweep",):
            print(f"  {k}: {v}")
    for row in a["breakdown"]["schedule_sweep"]:
        print(f"  split {row['fixed_split_size']!s:>4} alpha {row['alpha']:4.0f}: "
              f"{row['ms']:.3f} ms, GPU {row['gpu_ms']:.3f} ms, {row['items']} items, "
              f"max |diff| {row['max_abs_diff']:.1e}")
    for name, r in (("causal", b), ("non-causal", c)):
        print(f"{name} prefill B4 L4096: nbinfer {r['nbinfer_tflops']:.1f} TFLOP/s (KV tile "
              f"{r['kv_tile']}), SDPA flash {r.get('sdpa_flash_tflops', float('nan')):.1f}, "
              f"cuDNN {r.get('sdpa_cudnn_tflops', float('nan')):.1f}")


if __name__ == "__main__":
    main()
