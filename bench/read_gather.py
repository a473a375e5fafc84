"""How fast can a kernel only *read* a decode step's KV, page by page? The ceiling for issue 13
req 3 (decode at or above cuDNN), measured per KV layout and per load instruction.

The decode kernel moves 4.33 TB/s of KV at (64, 4096) and cuDNN's decode 4.44-4.57 TB/s over
contiguous KV (bench/NOTES.md, issue 13). Before changing the decode kernel, this measures what
a kernel that does nothing but read the same bytes in the same order reaches:

- layouts: ``contiguous`` (cuDNN's ``[B, Hkv, L, D]`` K and V tensors), paged ``NHD``
  (``[P, 2, page, Hkv, D]``: one KV head's 16 tokens are 16 rows of 256 B, 2 KiB apart) and
  paged ``HND`` (``[P, 2, Hkv, page, D]``: one KV head's page is 4 KiB in one piece), pages
  drawn at random from the pool as a running allocator hands them out (``PageTable.from_kv_lens``
  with a generator), and ``NHD`` with pages in order (``NHD-seq``);
- loads: ``ld.global.nc.v4`` with ``U`` K rows and ``U`` V rows in flight per thread, without and
  with an L2 prefetch-size hint (``.L2::128B`` / ``.L2::256B``), and ``cp.async.cg`` 16-byte
  copies into a two-stage shared ring (the decode kernel's way), without and with the hint
  (``--stages`` deep; ``stages x U`` at most 12: the ring is ``stages x 2U x 2 KiB`` of static
  shared memory).

Each CTA reads ``--tokens`` tokens (256 by default; 0: a request's whole KV head, one CTA per
(request, KV head) pair as the decode's plan makes them at these cases, which leaves the
hardware no small blocks to even out the SMs' finishing times).

The cp.async ring can also stand in for the decode kernel's loop: ``--order after`` waits for
a group before issuing the next (the decode's order; ``ahead`` issues first), and ``--work N``
adds N dependent FMAs per group and thread after its wait (the decode's arithmetic between
rounds, as latency), to see what computing between groups costs a reader of this pattern.

Each CTA (128 threads: 16 lanes per 256-byte row, 8 rows per pass) reads its tokens of one
(request, KV head) pair; every loaded word is folded into a register that is written out only
under a condition the compiler cannot decide, so no load is dead. Bytes counted: K and V of every
token and KV head, once. GPU time of 10 launches back to back between two events, median of 5.

    python3 bench/read_gather.py --out bench/results/issue13/read_gather_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nbinfer.formats import PageTable  # noqa: E402

SOURCE = r"""
// LAYOUT: 0 contiguous [B, H, L, D] K and V; 1 paged NHD [P, 2, PS, H, D];
//         2 paged HND [P, 2, H, PS, D]   (D = HEAD_DIM)
// MODE: 0 ld.global.nc.v4; 1 + .L2::128B; 2 + .L2::256B; 3 cp.async.cg; 4 + .L2::128B; 5 + .L2::256B
#define ROW16 (HEAD_DIM / 8)            // 16-byte pieces of one fp16 row (16 at D 128)
#define ROWS_PER_PASS (128 / ROW16)

__device__ __forceinline__ long long row_of(const int* indptr, const int* indices, int b, int h,
                                            int t, int kv, int H, int L, int PS) {
#if LAYOUT == 0
    return ((long long)(b * H + h) * L + t) * ROW16;          // kv selects the tensor instead
#else
    int p = indices[indptr[b] + t / PS], s = t % PS;
#if LAYOUT == 1
    return ((((long long)p * 2 + kv) * PS + s) * H + h) * ROW16;
#else
    return ((((long long)p * 2 + kv) * H + h) * PS + s) * ROW16;
#endif
#endif
}

__device__ __forceinline__ uint4 load16(const uint4* p) {
    uint4 r;
#if MODE == 1
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#elif MODE == 2
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#else
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#endif
    return r;
}

__device__ __forceinline__ void copy16(uint4* s, const uint4* g) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(s);
#if MODE == 4
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" :: "r"(sa), "l"(g));
#elif MODE == 5
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" :: "r"(sa), "l"(g));
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(sa), "l"(g));
#endif
}

extern "C" __global__ void __launch_bounds__(128) gather_read(
        const uint4* __restrict__ k, const uint4* __restrict__ v, const int* __restrict__ indptr,
        const int* __restrict__ indices, int H, int L, int PS, int T, unsigned* out) {
    const int chunks = L / T, item = blockIdx.x;
    const int c = item % chunks, h = (item / chunks) % H, b = item / chunks / H;
    const int piece = threadIdx.x % ROW16, row = threadIdx.x / ROW16;
    unsigned acc = 0;
    const int t_begin = c * T, t_end = t_begin + T, step = ROWS_PER_PASS * UNROLL;
#if MODE < 3
    for (int t0 = t_begin; t0 < t_end; t0 += step) {
        uint4 kk[UNROLL], vv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int t = t0 + u * ROWS_PER_PASS + row;
            kk[u] = load16(k + row_of(indptr, indices, b, h, t, 0, H, L, PS) + piece);
            vv[u] = load16(v + row_of(indptr, indices, b, h, t, 1, H, L, PS) + piece);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= kk[u].x ^ kk[u].w ^ vv[u].y ^ vv[u].z;
    }
#else
    // STAGES-deep ring of thread-private 16-byte slots. AFTER 0: group i + STAGES - 1 is
    // issued before group i is waited for (STAGES - 1 groups in flight while it is read);
    // AFTER 1: the decode kernel's order, group i waited for first, then group i + STAGES - 1
    // issued (STAGES - 2 in flight at the wait, STAGES - 1 during the work). WORK: that many
    // dependent FMAs per group and thread on a value of the group (the decode's arithmetic
    // between its rounds, as latency; 0: a pure reader).
    __shared__ uint4 ring[STAGES][2 * UNROLL][128];
    const int n = (t_end - t_begin) / step;
    float f = 0.0f;
    for (int i = 0; i < n + STAGES - 1; ++i) {
        const int r = i - (STAGES - 1);  // the group whose copies must have landed now
        if (AFTER && r >= 0) asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
        if (i < n) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                int t = t_begin + i * step + u * ROWS_PER_PASS + row;
                copy16(&ring[i % STAGES][2 * u][threadIdx.x],
                       k + row_of(indptr, indices, b, h, t, 0, H, L, PS) + piece);
                copy16(&ring[i % STAGES][2 * u + 1][threadIdx.x],
                       v + row_of(indptr, indices, b, h, t, 1, H, L, PS) + piece);
            }
        }
        asm volatile("cp.async.commit_group;");
        if (r >= 0) {
            if (!AFTER) asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
#pragma unroll
            for (int u = 0; u < 2 * UNROLL; ++u) {
                uint4 x = ring[r % STAGES][u][threadIdx.x];
                acc ^= x.x ^ x.w;
            }
            f += __uint_as_float(acc & 0x3f7fffffu);  // the work depends on the group's data
#pragma unroll 16
            for (int w = 0; w < WORK; ++w) f = fmaf(f, 0.999f, 0.5f);
        }
    }
    asm volatile("cp.async.wait_group 0;");
    if (f == 1.2345f) acc ^= 1u;  // keeps the work live
#endif
    if (acc == 0x9e3779b9u) out[blockIdx.x * 128 + threadIdx.x] = acc;  // keeps every load live
}
"""

MODES = {"ld": 0, "ld.L2::128B": 1, "ld.L2::256B": 2, "cp.async": 3, "cp.async.L2::128B": 4,
         "cp.async.L2::256B": 5}
LAYOUTS = {"contiguous": 0, "NHD": 1, "NHD-seq": 1, "HND": 2}


def gpu_ms(cp, fn, reps=10, rounds=5, warmup=3):
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(rounds):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / reps)
    return float(np.median(times))


def prepare(cp, batch, kv_len, layout, hkv=8, d=128, ps=16, seed=0):
    """The step's K and V (random fp16, paged as ``layout`` says) and its page table."""
    rng = None if layout in ("contiguous", "NHD-seq") else np.random.default_rng(seed)
    pt = PageTable.from_kv_lens([kv_len] * batch, ps, rng=rng)
    if layout == "contiguous":
        k = cp.random.standard_normal((batch, hkv, kv_len, d), dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal(k.shape, dtype=cp.float32).astype(cp.float16)
    else:
        shape = ((pt.num_pages, 2, ps, hkv, d) if LAYOUTS[layout] == 1
                 else (pt.num_pages, 2, hkv, ps, d))
        k = v = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    return dict(k=k, v=v, indptr=cp.asarray(pt.indptr, cp.int32),
                indices=cp.asarray(pt.indices, cp.int32), hkv=hkv, d=d, ps=ps)


_KERNELS = {}


def kernel(cp, layout, mode, unroll, d, stages=2, work=0, after=False):
    key = (LAYOUTS[layout], MODES[mode], unroll, d, stages, work, after)
    if key not in _KERNELS:
        opts = ("-std=c++17", f"-DLAYOUT={key[0]}", f"-DMODE={key[1]}", f"-DUNROLL={unroll}",
                f"-DHEAD_DIM={d}", f"-DSTAGES={stages}", f"-DWORK={work}",
                f"-DAFTER={int(after)}")
        _KERNELS[key] = cp.RawModule(code=SOURCE, options=opts).get_function("gather_read")
    return _KERNELS[key]


def measure(cp, bufs, batch, kv_len, layout, mode, unroll, tokens=256, stages=2, work=0,
            after=False):
    """GPU ms and TB/s of reading every K and V row of a (batch, kv_len) decode step once,
    ``tokens`` per CTA (``kv_len``: one CTA per (request, KV head), as the decode plans these
    cases), ``stages`` deep for the cp.async modes, with ``work`` dependent FMAs per group and
    the next group issued ``after`` the wait (the decode's order) or before it."""
    hkv, d = bufs["hkv"], bufs["d"]
    tokens = min(tokens, kv_len)
    step = 128 // (d // 8) * unroll  # tokens one pass of the CTA's loop covers
    if kv_len % tokens or tokens % step:
        raise ValueError(f"tokens per CTA ({tokens}) must divide kv_len ({kv_len}) and be a "
                         f"multiple of {step} (rows per pass x unroll): the kernel has no tail")
    kern = kernel(cp, layout, mode, unroll, d, stages, work, after)
    grid = batch * hkv * (kv_len // tokens)
    out = cp.zeros(grid * 128, cp.uint32)
    args = (bufs["k"], bufs["v"], bufs["indptr"], bufs["indices"], np.int32(hkv),
            np.int32(kv_len), np.int32(bufs["ps"]), np.int32(tokens), out)
    ms = gpu_ms(cp, lambda: kern((grid,), (128,), args))
    nbytes = batch * kv_len * hkv * d * 2 * 2
    return dict(batch=batch, kv_len=kv_len, layout=layout, mode=mode, unroll=unroll,
                tokens=tokens, stages=stages if mode.startswith("cp.async") else None, ctas=grid,
                work=work, after=after, ms=ms, bytes=nbytes, tbps=nbytes / ms / 1e9,
                regs=int(kern.num_regs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="64x4096,256x1024,16x32768")
    ap.add_argument("--layouts", default="contiguous,NHD,NHD-seq,HND")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--unrolls", default="4,8")
    ap.add_argument("--tokens", default="256",
                    help="tokens per CTA, comma-separated (0: a whole request's KV head per CTA, "
                         "the decode plan's item at these cases)")
    ap.add_argument("--stages", default="2", help="cp.async ring depths, comma-separated")
    ap.add_argument("--work", default="0",
                    help="cp.async modes: dependent FMAs per group and thread after its wait "
                         "(the decode's arithmetic as latency), comma-separated")
    ap.add_argument("--order", default="ahead", type=lambda x: x.split(","),
                    help="cp.async modes: 'ahead' (the next group issued before the wait) "
                         "and/or 'after' (issued after it, as the decode kernel does)")
    args = ap.parse_args()
    if set(args.order) - {"ahead", "after"}:
        ap.error(f"--order: choose from ahead, after (got {','.join(args.order)})")
    import cupy as cp

    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    for name, choices in (("layouts", LAYOUTS), ("modes", MODES)):
        bad = [x for x in getattr(args, name).split(",") if x not in choices]
        if bad:
            ap.error(f"--{name}: unknown {bad}; choose from {', '.join(choices)}")
    rows = []
    for (b, l), lay in itertools.product(cases, args.layouts.split(",")):
        bufs = prepare(cp, b, l, lay)
        for mode, u, tok, st, work, order in itertools.product(
                args.modes.split(","), [int(x) for x in args.unrolls.split(",")],
                [int(x) for x in args.tokens.split(",")], [int(x) for x in args.stages.split(",")],
                [int(x) for x in args.work.split(",")], args.order):
            cpa = mode.startswith("cp.async")
            if not cpa and (st != 2 or work or order != "ahead"):
                continue  # stages, work and order are the cp.async ring's
            if cpa and st * u > 12:
                continue  # the ring must fit 48 KiB of static shared memory
            r = measure(cp, bufs, b, l, lay, mode, u, tok or l, st, work, order == "after")
            rows.append(r)
            print(f"B{b:<4} L{l:<6} {lay:10s} {mode:18s} U{u} T{r['tokens']:<5} S{st} "
                  f"W{work:<4} {order:5s} {r['ctas']:5d} CTAs {r['ms']:7.3f} ms  "
                  f"{r['tbps']:5.2f} TB/s  regs {r['regs']}", flush=True)
        del bufs
        cp.get_default_memory_pool().free_all_blocks()
    if args.out:
        import json

        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                           read_gather=rows), f, indent=2)
    print("\nbest TB/s per case and layout:")
    for (b, l), lay in itertools.product(cases, args.layouts.split(",")):
        sub = [r for r in rows if (r["batch"], r["kv_len"], r["layout"]) == (b, l, lay)]
        best = max(sub, key=lambda r: r["tbps"])
        print(f"  B{b:<4} L{l:<6} {lay:10s} {best['tbps']:5.2f} TB/s ({best['mode']}, "
              f"U{best['unroll']}, T{best['tokens']}, S{best['stages']})")


if __name__ == "__main__":
    main()
