"""A first attention forward on Hopper's warpgroup MMA, standalone: is the wgmma path worth
wiring into nbinfer's prefill (issue 13 req 1 and its stretch)?

Contiguous ``[B, H, L, D]`` fp16/bf16 Q, K, V (no paging, no GQA, no variants): one CTA of one
warpgroup (128 threads) per 64 query rows, a loop over 64-key tiles (causal: up to the
diagonal), built from :mod:`nbinfer.kernels.wgmma`:

- Q (64 x D) and each K and V tile staged by cp.async straight into the canonical no-swizzle
  layouts: a 16-byte chunk of a row is one core-matrix row, so every copy is one
  ``cp.async.cg`` (Q and K K-major, V MN-major);
- ``S = Q K^T``: D / 16 ``wgmma.m64n64k16`` from shared memory (32 accumulators per thread);
- the online softmax on S's fragments (a row's 16 values per thread, the row's four lanes
  combined by two shuffles), in log2 units;
- ``O += P V``: 4 ``wgmma.m64nDk16`` with P packed from S's registers (no shared memory) and
  V MN-major through the transpose flag (D / 2 accumulators per thread).

One K/V stage (48 KiB of static shared memory with Q) and each product waited for before the
next step: no overlap inside a CTA beyond what three resident CTAs per SM give each other. This
is the measurement that decides the next rungs (two stages, a producer warp, swizzled layouts,
ping-pong between warpgroups), not a finished kernel. FLOPs counted as SDPA's benchmarks count
them: 4 B H L^2 D (halved when causal).

    python3 bench/wgmma_attention.py --out bench/results/issue13/wgmma_attention.json

It first checks the kernel against torch SDPA (math backend, float32) on small shapes and stops
if that fails; then times B4 L4096 H32 D128 (causal and not) against SDPA flash and cuDNN in the
same process.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench/decode.py's gpu_ms; nbinfer
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

BM = BN = 64  # query rows per CTA (one warpgroup's wgmma M) and keys per tile
# relative error allowed against SDPA in float32 (the test suite's table, tests/conftest.py)
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
NT = 128  # one warpgroup


@functools.cache
def build(d: int, causal: bool, dtype: str, overlap: bool = False):
    """The kernel ``attn[(L / 64, B H), 128](q, k, v, o32, L, scale_log2)`` for head dim ``d``
    (64 or 128): q, k, v int16 views of contiguous ``[B, H, L, D]`` tensors, o32 an int32 view
    of the output (two 16-bit values per word), L a multiple of 64.

    ``overlap``: the same 48 KiB, but the next tile's K is copied while this tile's softmax
    and ``P V`` run, and its V while the next ``Q K^T`` and softmax run (each buffer is
    refilled as soon as the product that reads it is done); else both are copied, and waited
    for, at the top of each tile."""
    from numba import cuda, float32, int16, int32, types

    from nbinfer.kernels.mma import _gpu_mma_intrinsics
    from nbinfer.kernels.primitives import primitives
    from nbinfer.kernels.wgmma import (
        WGMMA_KINDS,
        core_offset,
        core_offset_mn,
        smem_descriptor,
        wgmma_intrinsics,
    )

    U32, U64 = types.uint32, types.uint64
    kind = WGMMA_KINDS[dtype]
    intr, prims = wgmma_intrinsics(), primitives(False)
    mma_qk, mma_pv = intr.mma[(BN, kind)], intr.mma_rs[(d, kind)]
    hold_s, hold_o = intr.hold[BN // 2], intr.hold[d // 2]
    fence, commit_wg, wait_wg, proxy_fence = intr.fence, intr.commit, intr.wait0, intr.proxy_fence
    cp16, commit = prims.cp_async16_to, prims.commit
    wait_all, wait_but_one = prims.wait(0), prims.wait(1)
    shared_addr, exp2 = prims.shared_addr, prims.exp2
    pack = _gpu_mma_intrinsics().pack[kind]
    descriptor = cuda.jit(device=True)(smem_descriptor)
    offset, offset_mn = cuda.jit(device=True)(core_offset), cuda.jit(device=True)(core_offset_mn)
    CH = d // 8  # 16-byte chunks per row
    LBO = 128  # K-adjacent core matrices contiguous
    SBO_QK = CH * 128  # Q and K (K-major): an 8-row block holds all its K core matrices
    SBO_V = BN // 8 * 128  # V (MN-major): an 8-column block holds all its key core matrices
    Q_BYTES = BM * d * 2
    KV_BYTES = BN * d * 2
    SMEM_ELEMS = (Q_BYTES + 2 * KV_BYTES) // 2  # 48 KiB at D 128: the static limit
    COPIES = BM * CH // NT  # 16-byte copies per thread per 64-row block
    SACC, OACC = BN // 2, d // 2
    DSTEPS, KSTEPS = d // 16, BN // 16
    A_WORDS = 4 * KSTEPS
    NEG_INF = float32(-np.inf)
    CAUSAL, OVERLAP = causal, overlap

    @cuda.jit(device=True)
    def stage_rows(smem, sbase, src, row0, tid, mn_major):
        # rows row0 .. row0 + 63 of a [*, D] tensor: chunk ch of row r to its core-matrix row.
        # Eight consecutive threads take one chunk of eight consecutive rows: their 16-byte
        # destinations are one core matrix, 128 contiguous bytes (no bank conflict), and a
        # warp still reads whole 32-byte sectors (rows' chunks ch .. ch + 3).
        for i in range(COPIES):
            c = tid + NT * i
            blk, idx = c // (8 * CH), c % (8 * CH)
            r, ch = 8 * blk + idx % 8, idx // 8
            if mn_major:  # V: keys along K, the head dim along N
                dst = offset_mn(r, 8 * ch, SBO_V, LBO)
            else:
                dst = offset(r, 8 * ch, SBO_QK, LBO)
            cp16(smem, sbase + U32(dst), src, (row0 + r) * d + ch * 8)

    @cuda.jit(lineinfo=False)
    def attn(q, k, v, o32, seq_len, scale_log2):
        smem = cuda.shared.array(SMEM_ELEMS, int16, alignment=1024)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        qt = cuda.gridDim.x - 1 - cuda.blockIdx.x if CAUSAL else cuda.blockIdx.x  # long first
        row0 = cuda.blockIdx.y * seq_len  # this (batch, head)'s first row
        q0 = qt * BM
        ntiles = qt + 1 if CAUSAL else seq_len // BN
        sq = shared_addr(smem, 0)
        sk = sq + U32(Q_BYTES)
        sv = sk + U32(KV_BYTES)
        stage_rows(smem, sq, q, row0 + q0, tid, False)
        if OVERLAP:  # groups in flight: (Q, K 0), then V 0
            stage_rows(smem, sk, k, row0, tid, False)
            commit()
            stage_rows(smem, sv, v, row0, tid, True)
            commit()
        sacc = cuda.local.array(SACC, float32)
        oacc = cuda.local.array(OACC, float32)
        pw = cuda.local.array(A_WORDS, U32)  # P as the PV product's A fragments
        m = cuda.local.array(2, float32)
        den = cuda.local.array(2, float32)
        for i in range(OACC):
            oacc[i] = 0.0
        for h in range(2):
            m[h] = NEG_INF
            den[h] = 0.0
        t2 = 2 * (lane % 4)
        rq = q0 + 16 * warp + lane // 4  # this lane's first row (and rq + 8)
        for t in range(ntiles):
            if OVERLAP:
                wait_but_one()  # K t has landed; V t (the newest group) may still fly
            else:
                stage_rows(smem, sk, k, row0 + t * BN, tid, False)
                stage_rows(smem, sv, v, row0 + t * BN, tid, True)
                commit()
                wait_all()
            proxy_fence()  # cp.async's stores, visible to the tensor cores' reads
            cuda.syncthreads()
            for i in range(SACC):
                sacc[i] = 0.0
            hold_s(sacc)  # registers a wgmma reads are written before its fence
            fence()
            for kk in range(DSTEPS):
                mma_qk(U64(descriptor(sq + U32(kk * 2 * LBO), LBO, SBO_QK)),
                       U64(descriptor(sk + U32(kk * 2 * LBO), LBO, SBO_QK)), sacc)
            commit_wg()
            wait_wg()
            hold_s(sacc)  # and its results are read only after its wait
            if OVERLAP:
                cuda.syncthreads()  # every warp's Q K^T is done with the K buffer
                if t + 1 < ntiles:
                    stage_rows(smem, sk, k, row0 + (t + 1) * BN, tid, False)
                commit()  # possibly empty: the wait counts below stay uniform
            diagonal = CAUSAL and t == ntiles - 1
            for h in range(2):
                mx = NEG_INF
                for j in range(BN // 8):
                    for c in range(2):
                        x = sacc[4 * j + 2 * h + c]
                        if diagonal and t * BN + 8 * j + t2 + c > rq + 8 * h:
                            x = NEG_INF
                            sacc[4 * j + 2 * h + c] = x
                        mx = max(mx, x)
                mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1))
                mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 2))
                m_new = max(m[h], mx * scale_log2)  # a diagonal row always keeps a key
                alpha = exp2(m[h] - m_new)
                m[h] = m_new
                rs = float32(0.0)
                for j in range(BN // 8):
                    for c in range(2):
                        p = exp2(sacc[4 * j + 2 * h + c] * scale_log2 - m_new)
                        sacc[4 * j + 2 * h + c] = p
                        rs += p
                den[h] = den[h] * alpha + rs
                for j in range(d // 8):
                    for c in range(2):
                        oacc[4 * j + 2 * h + c] *= alpha
            # P's A fragment for keys 16 kk .. 16 kk + 15 is S's column blocks 2 kk, 2 kk + 1:
            # sacc[8 kk .. 8 kk + 7] as a0 (row g), a1 (row g + 8), a2, a3 (columns + 8)
            for w in range(A_WORDS):
                pw[w] = pack(sacc[2 * w], sacc[2 * w + 1])
            if OVERLAP:
                wait_but_one()  # V t has landed; K t + 1 may still fly
                proxy_fence()
                cuda.syncthreads()
            hold_o(oacc)  # rescaled by ordinary instructions: before the fence
            fence()
            for kk in range(KSTEPS):
                mma_pv(pw[4 * kk], pw[4 * kk + 1], pw[4 * kk + 2], pw[4 * kk + 3],
                       U64(descriptor(sv + U32(kk * 2 * LBO), LBO, SBO_V)), oacc)
            commit_wg()
            wait_wg()
            hold_o(oacc)
            cuda.syncthreads()  # every warp is done with this tile before the next one lands
            if OVERLAP:
                if t + 1 < ntiles:
                    stage_rows(smem, sv, v, row0 + (t + 1) * BN, tid, True)
                commit()
        for h in range(2):
            s = den[h]
            s += cuda.shfl_xor_sync(0xFFFFFFFF, s, 1)
            s += cuda.shfl_xor_sync(0xFFFFFFFF, s, 2)
            inv = float32(1.0) / s
            base = (row0 + rq + 8 * h) * d
            for j in range(d // 8):
                o32[(base + 8 * j + t2) // 2] = int32(
                    pack(oacc[4 * j + 2 * h] * inv, oacc[4 * j + 2 * h + 1] * inv))

    return attn


def run(q, k, v, causal, out=None, overlap=False):
    """O for torch CUDA tensors ``[B, H, L, D]`` (contiguous, fp16/bf16, L % 64 == 0)."""
    import torch
    from numba import cuda

    B, H, L, D = q.shape
    if L % BM or D not in (64, 128) or not all(t.is_contiguous() for t in (q, k, v)):
        raise ValueError("wgmma_attention: contiguous [B, H, L, D], L % 64 == 0, D 64 or 128")
    dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype]
    out = torch.empty_like(q) if out is None else out
    kern = build(D, causal, dtype, overlap)
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    kern[(L // BM, B * H), NT, stream](
        cuda.as_cuda_array(q.view(torch.int16).reshape(-1)),
        cuda.as_cuda_array(k.view(torch.int16).reshape(-1)),
        cuda.as_cuda_array(v.view(torch.int16).reshape(-1)),
        cuda.as_cuda_array(out.view(torch.int32).reshape(-1)),
        np.int32(L), np.float32(math.log2(math.e) / math.sqrt(D)))
    return out


def check(torch, F):
    """Max relative error against SDPA's math backend in float32, per small case."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, H, L, D, causal, dt in [(1, 2, 256, 128, True, torch.float16),
                                   (2, 3, 192, 128, False, torch.float16),
                                   (1, 2, 320, 64, True, torch.bfloat16),
                                   (1, 1, 128, 64, False, torch.bfloat16),
                                   (1, 2, 192, 64, True, torch.float16),
                                   (1, 2, 256, 128, False, torch.bfloat16)]:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", generator=g).to(dt) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        for overlap in (False, True):
            o = run(q, k, v, causal, overlap=overlap).float()
            err = float((o - ref).norm() / ref.norm())
            tol = TOLERANCE[str(dt).split(".")[-1]]
            rows.append(dict(B=B, H=H, L=L, D=D, causal=causal, dtype=str(dt),
                             overlap=overlap, rel_err=err, tolerance=tol))
            print(f"check B{B} H{H} L{L} D{D} {'causal' if causal else 'full'} {dt}"
                  f"{' overlap' if overlap else ''}: rel err {err:.2e}", flush=True)
    return rows


def tflops(fn, flops):
    """TFLOP/s of ``fn`` from its GPU time back to back (bench/decode.py's gpu_ms)."""
    from decode import gpu_ms  # imports torch: here, so that build() needs none

    return flops / (gpu_ms(fn) * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shape", default="4,32,4096,128", help="B,H,L,D of the timed cases")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    checks = check(torch, F)
    if any(not r["rel_err"] <= r["tolerance"] for r in checks):
        print("wgmma_attention: the check failed; not timing")
        result = dict(checks=checks)
    else:
        B, H, L, D = (int(x) for x in args.shape.split(","))
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
                   for _ in range(3))
        out = torch.empty_like(q)
        timed = []
        for causal in (True, False):
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            row = dict(B=B, H=H, L=L, D=D, causal=causal,
                       wgmma_tflops=tflops(lambda c=causal: run(q, k, v, c, out), flops),
                       wgmma_overlap_tflops=tflops(
                           lambda c=causal: run(q, k, v, c, out, overlap=True), flops))
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                             ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                with sdpa_kernel(be):
                    row[f"sdpa_{name}_tflops"] = tflops(
                        lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                        flops)
            timed.append(row)
            fl = row["sdpa_flash_tflops"]
            print(f"{'causal' if causal else 'full'} B{B} H{H} L{L} D{D}: wgmma "
                  f"{row['wgmma_tflops']:.1f} TFLOP/s ({row['wgmma_tflops'] / fl:.2f}x flash), "
                  f"overlapped {row['wgmma_overlap_tflops']:.1f} "
                  f"({row['wgmma_overlap_tflops'] / fl:.2f}x); SDPA flash {fl:.1f}, cuDNN "
                  f"{row['sdpa_cudnn_tflops']:.1f}", flush=True)
        result = dict(checks=checks, timed=timed)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), **result), f, indent=2)


if __name__ == "__main__":
    main()
