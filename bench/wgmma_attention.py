"""Attention forwards on Hopper's warpgroup MMA, standalone: is the wgmma path worth wiring into
nbinfer's prefill (issue 13 req 1 and its stretch)?

Contiguous ``[B, H, L, D]`` fp16/bf16 Q, K, V (no paging, no GQA, no variants, no LSE), built
from :mod:`nbinfer.kernels.wgmma`, two kernels:

- :func:`build`, the first tile (session 15): one CTA of one warpgroup (128 threads) per 64
  query rows, Q and one K / V tile in 48 KiB of static shared memory, each copy waited for;
- :func:`build_pipe`, the pipelined one (session 16): ``wgs`` warpgroups per CTA (64 query
  rows each) sharing every K / V tile, a ring of ``stages`` K / V buffers in dynamic shared
  memory, ``bn`` keys per tile (bench/NOTES.md, "Issue 13, session 16": its rungs).

Both: Q and each K and V tile staged by cp.async straight into the canonical no-swizzle
layouts (a 16-byte chunk of a row is one core-matrix row, so every copy is one ``cp.async.cg``;
Q and K K-major, V MN-major); ``S = Q K^T`` by D / 16 ``wgmma.m64nNk16`` from shared memory;
the online softmax on S's fragments (a row's values per thread, the row's four lanes combined
by two shuffles), in log2 units; ``O += P V`` by ``wgmma.m64nDk16`` with P packed from S's
registers (no shared memory) and V through the transpose flag. FLOPs counted as SDPA's
benchmarks count them: 4 B H L^2 D (halved when causal).

    python3 bench/wgmma_attention.py --out bench/results/issue13/wgmma_attention.json
    python3 bench/wgmma_attention.py --variants "2wg-n64-s2 r128" --shapes "4,32,4096,64" \
        --dtypes float16,bfloat16 [--ablations]

It first checks every variant against torch SDPA (math backend, float32) on small shapes and
times only those that pass; then times the shapes (causal and not) against SDPA flash and
cuDNN in the same process.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from types import SimpleNamespace

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # bench/decode.py's gpu_ms; nbinfer
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

BM = BN = 64  # query rows per CTA (one warpgroup's wgmma M) and keys per tile
# relative error allowed against SDPA in float32 (the test suite's table, tests/conftest.py)
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
NT = 128  # one warpgroup
WS_MAX_REGISTERS = 168  # build_ws: 65536 / 384 threads, rounded down to a multiple of 8
_MAPS = {}  # run(): the tensor maps of each (K, V) pair it was given


@functools.cache
def _parts(d: int, bn: int, dtype: str, nt: int):
    """The device functions both kernels share, for head dim ``d``, ``bn`` keys per tile and
    ``nt`` threads per CTA: ``stage`` (cp.async of rows into a canonical layout), ``softmax``
    (the online softmax on S's fragments, leaving P packed as the P V product's A words),
    ``reset`` (the empty state), ``store`` (O's rows, normalised, as 16-bit pairs), and the two
    products ``qk`` / ``pv`` (the package's warpgroup tile ops: ``qk_smem``, ``pv_words``)."""
    from numba import cuda, float32, int32, types

    from nbinfer.kernels.mma import _gpu_mma_intrinsics
    from nbinfer.kernels.primitives import primitives
    from nbinfer.kernels.wgmma import WGMMA_KINDS, copy_slot, wgmma_tile_ops

    U32 = types.uint32
    prims = primitives(False)
    cp16, exp2 = prims.cp_async16_to, prims.exp2
    pack = _gpu_mma_intrinsics().pack[WGMMA_KINDS[dtype]]
    CH = d // 8  # 16-byte chunks per row
    LBO = 128  # K-adjacent core matrices contiguous
    NEG_INF = float32(-np.inf)
    SACC_BLOCKS, OACC_BLOCKS = bn // 8, d // 8
    A_WORDS = bn // 4

    slot = cuda.jit(device=True)(copy_slot)

    @cuda.jit(device=True)
    def stage(smem, sbase, src, row0, nrows, tid, mn_major, sbo):
        # rows row0 .. row0 + nrows - 1 of a [*, D] tensor into the canonical layout, each
        # 16-byte chunk by one cp.async (nbinfer.kernels.wgmma.copy_slot: where to, and the
        # one add per further copy)
        r, ch, dst, rstep, dstep = slot(tid, nt, d, mn_major, sbo, LBO, 2)
        at = (row0 + r) * d + ch * 8
        for i in range(nrows // rstep):
            cp16(smem, sbase + U32(dst + i * dstep), src, at + i * rstep * d)

    @cuda.jit(device=True)
    def softmax(sacc, oacc, pw, m, den, key0, rq, t2, diagonal, scale_log2, skip):
        # rows rq and rq + 8 of this lane (h 0, 1), keys key0 + 8 j + t2 + c of S's fragments;
        # diagonal: keys past the row are masked. skip (an ablation, timing only): P = S.
        if diagonal:  # a pass of its own: 11 registers fewer than a select in the max loop
            lim = rq - key0 - t2
            for h in range(2):
                for j in range(SACC_BLOCKS):
                    for c in range(2):
                        if 8 * j + c > lim + 8 * h:
                            sacc[4 * j + 2 * h + c] = NEG_INF
        if not skip:
            for h in range(2):
                mx = NEG_INF
                for j in range(SACC_BLOCKS):
                    for c in range(2):
                        mx = max(mx, sacc[4 * j + 2 * h + c])
                mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1))
                mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 2))
                m_new = max(m[h], mx * scale_log2)  # a row always keeps a key of its tile 0
                alpha = exp2(m[h] - m_new)
                m[h] = m_new
                rs = float32(0.0)
                for j in range(SACC_BLOCKS):
                    for c in range(2):
                        p = exp2(sacc[4 * j + 2 * h + c] * scale_log2 - m_new)
                        sacc[4 * j + 2 * h + c] = p
                        rs += p
                den[h] = den[h] * alpha + rs
                for j in range(OACC_BLOCKS):
                    for c in range(2):
                        oacc[4 * j + 2 * h + c] *= alpha
        # P's A fragment for keys 16 kk .. 16 kk + 15 is S's column blocks 2 kk, 2 kk + 1:
        # sacc[8 kk .. 8 kk + 7] as a0 (row g), a1 (row g + 8), a2, a3 (columns + 8)
        for w in range(A_WORDS):
            pw[w] = pack(sacc[2 * w], sacc[2 * w + 1])

    @cuda.jit(device=True)
    def reset(oacc, m, den):
        # the empty state: O = 0, the rows' maxima -inf and sums 0
        for i in range(OACC_BLOCKS * 4):
            oacc[i] = 0.0
        for h in range(2):
            m[h] = NEG_INF
            den[h] = 0.0

    @cuda.jit(device=True)
    def store(o32, oacc, den, row_base, t2):
        # row_base: the flat row of this lane's first row (rq); the row's four lanes sum den
        for h in range(2):
            s = den[h]
            s += cuda.shfl_xor_sync(0xFFFFFFFF, s, 1)
            s += cuda.shfl_xor_sync(0xFFFFFFFF, s, 2)
            inv = float32(1.0) / s
            base = (row_base + 8 * h) * d
            for j in range(OACC_BLOCKS):
                o32[(base + 8 * j + t2) // 2] = int32(
                    pack(oacc[4 * j + 2 * h] * inv, oacc[4 * j + 2 * h + 1] * inv))

    # the two products: the package's warpgroup tile ops (the tensor-core prefill's), whose Q /
    # K and V layouts are this file's: K-major with SBO_QK, V MN-major with SBO_V
    ops = wgmma_tile_ops(d, bn, dtype, nt // 32)
    return SimpleNamespace(stage=stage, softmax=softmax, reset=reset, store=store, LBO=LBO,
                           qk=ops.qk_smem, pv=ops.pv_words, proxy_fence=ops.publish,
                           commit=prims.commit, shared_addr=prims.shared_addr, pack=pack,
                           SBO_QK=CH * 128, SBO_V=bn // 8 * 128, A_WORDS=A_WORDS)


@functools.cache
def build(d: int, causal: bool, dtype: str, overlap: bool = False):
    """The kernel ``attn[(L / 64, B H), 128](q, k, v, o32, L, scale_log2)`` for head dim ``d``
    (64 or 128): q, k, v int16 views of contiguous ``[B, H, L, D]`` tensors, o32 an int32 view
    of the output (two 16-bit values per word), L a multiple of 64.

    ``overlap``: the same 48 KiB, but the next tile's K is copied while this tile's softmax
    and ``P V`` run, and its V while the next ``Q K^T`` and softmax run (each buffer is
    refilled as soon as the product that reads it is done); else both are copied, and waited
    for, at the top of each tile."""
    from numba import cuda, float32, int16, types

    from nbinfer.kernels.primitives import primitives

    U32 = types.uint32
    prims = primitives(False)
    p = _parts(d, BN, dtype, NT)
    stage, softmax, reset, store = p.stage, p.softmax, p.reset, p.store
    qk, pv, proxy_fence = p.qk, p.pv, p.proxy_fence
    commit, shared_addr = p.commit, p.shared_addr
    wait_all, wait_but_one = prims.wait(0), prims.wait(1)
    SBO_QK, SBO_V = p.SBO_QK, p.SBO_V
    Q_BYTES = BM * d * 2
    KV_BYTES = BN * d * 2
    SMEM_ELEMS = (Q_BYTES + 2 * KV_BYTES) // 2  # 48 KiB at D 128: the static limit
    SACC, OACC = BN // 2, d // 2
    A_WORDS = p.A_WORDS
    CAUSAL, OVERLAP = causal, overlap

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
        stage(smem, sq, q, row0 + q0, BM, tid, False, SBO_QK)
        if OVERLAP:  # groups in flight: (Q, K 0), then V 0
            stage(smem, sk, k, row0, BN, tid, False, SBO_QK)
            commit()
            stage(smem, sv, v, row0, BN, tid, True, SBO_V)
            commit()
        sacc = cuda.local.array(SACC, float32)
        oacc = cuda.local.array(OACC, float32)
        pw = cuda.local.array(A_WORDS, U32)  # P as the PV product's A fragments
        m = cuda.local.array(2, float32)
        den = cuda.local.array(2, float32)
        reset(oacc, m, den)
        t2 = 2 * (lane % 4)
        rq = q0 + 16 * warp + lane // 4  # this lane's first row (and rq + 8)
        for t in range(ntiles):
            if OVERLAP:
                wait_but_one()  # K t has landed; V t (the newest group) may still fly
            else:
                stage(smem, sk, k, row0 + t * BN, BN, tid, False, SBO_QK)
                stage(smem, sv, v, row0 + t * BN, BN, tid, True, SBO_V)
                commit()
                wait_all()
            proxy_fence()  # cp.async's stores, visible to the tensor cores' reads
            cuda.syncthreads()
            qk(smem, sk, sq, 0, 0, sacc)  # S = Q K^T (the one warpgroup's Q at sq), waited for
            if OVERLAP:
                cuda.syncthreads()  # every warp's Q K^T is done with the K buffer
                if t + 1 < ntiles:
                    stage(smem, sk, k, row0 + (t + 1) * BN, BN, tid, False, SBO_QK)
                commit()  # possibly empty: the wait counts below stay uniform
            softmax(sacc, oacc, pw, m, den, t * BN, rq, t2, CAUSAL and t == ntiles - 1,
                    scale_log2, False)
            if OVERLAP:
                wait_but_one()  # V t has landed; K t + 1 may still fly
                proxy_fence()
                cuda.syncthreads()
            pv(pw, sv, oacc)  # O += P V, waited for
            cuda.syncthreads()  # every warp is done with this tile before the next one lands
            if OVERLAP:
                if t + 1 < ntiles:
                    stage(smem, sv, v, row0 + (t + 1) * BN, BN, tid, True, SBO_V)
                commit()
        store(o32, oacc, den, row0 + rq, t2)

    return attn


@functools.cache
def _swizzled(d: int, bn: int, dtype: str, nt: int, k_layout: str = "swizzled"):
    """K and V tiles of ``bn`` rows in the 128-byte swizzled layout (session 30), for a CTA of
    ``nt`` copying threads, through the package's own swizzled tile ops
    (:func:`nbinfer.kernels.wgmma.wgmma_tile_ops` with ``swizzle=True``, the lean prefill's):
    each 64-column half of a tile is ``bn`` rows of 128 bytes, row r's 16-byte chunk c at chunk
    ``c ^ (r % 8)`` (what a ``SWIZZLE_128B`` TMA box writes). ``k_layout="core"``: K's product
    reads instead the layout a no-swizzle TMA box of 16-byte rows writes
    (:mod:`nbinfer.kernels.tma`'s ``core_tile_map``: LBO ``bn x 16``, SBO 128).

    - ``stage(smem, sbase, src, row0, tid)``: the tile's rows by ``cp.async`` on the ops'
      ``copy_map`` (eight consecutive threads one 128-byte line);
    - ``qk_issue(smem, kbase, qa, sacc)`` (``S = Q K^T`` issued and committed, Q canonical as
      :func:`_parts` stages it) and ``qk`` (the same, waited for); ``pv(pw, vbase, o)`` (``O +=
      P V``, waited for: the ops' ``pv_words``);
    - ``v_desc(vbase, kk)``: V's descriptor for keys ``16 kk ..``, for a ``P V`` left in flight
      (the ops only have the product waited for)."""
    from numba import cuda, types

    from nbinfer.kernels.primitives import primitives
    from nbinfer.kernels.wgmma import (
        WGMMA_KINDS,
        smem_descriptor,
        swizzled_slot,
        wgmma_intrinsics,
        wgmma_tile_ops,
    )

    U32, U64 = types.uint32, types.uint64
    cp16 = primitives(False).cp_async16_to
    ops = wgmma_tile_ops(d, bn, dtype, nt // 32, swizzle=True)
    pv = ops.pv_words
    intr = wgmma_intrinsics()
    kind = WGMMA_KINDS[dtype]
    mma_qk0, mma_qk = intr.mma_fresh[(bn, kind)], intr.mma[(bn, kind)]
    fence, commit, wait0, hold_s = intr.fence, intr.commit, intr.wait0, intr.hold[bn // 2]
    LBO_Q, SBO_Q = 128, d // 8 * 128  # Q in the canonical layout, as _parts stages it
    descriptor = cuda.jit(device=True)(smem_descriptor)
    RSTEP = nt // (d // 8)  # rows one pass of the CTA's copies covers (a multiple of 8)
    HALF = bn * 128

    slot = cuda.jit(device=True)(swizzled_slot)

    @cuda.jit(device=True)
    def stage(smem, sbase, src, row0, tid):
        r, ch, dst, _, dst_step = slot(tid, nt, d, bn, 2)
        for i in range(bn // RSTEP):
            cp16(smem, sbase + U32(dst + i * dst_step), src, (row0 + r + i * RSTEP) * d + ch * 8)

    if k_layout == "core":
        @cuda.jit(device=True)
        def qk_issue(smem, kbase, qa, sacc):
            # K chunk-major: the next 16 head-dim elements 2 x bn x 16 bytes on
            fence()
            mma_qk0(U64(descriptor(qa, LBO_Q, SBO_Q)), U64(descriptor(kbase, bn * 16, 128)),
                    sacc)
            for ks in range(1, d // 16):
                mma_qk(U64(descriptor(qa + U32(ks * 2 * LBO_Q), LBO_Q, SBO_Q)),
                       U64(descriptor(kbase + U32(ks * 2 * bn * 16), bn * 16, 128)), sacc)
            commit()
    else:
        ops_issue = ops.qk_issue

        @cuda.jit(device=True)
        def qk_issue(smem, kbase, qa, sacc):
            ops_issue(smem, kbase, qa, 0, 0, sacc)  # (qa: the warpgroup's own rows already)

    @cuda.jit(device=True)
    def qk(smem, kbase, qa, sacc):
        qk_issue(smem, kbase, qa, sacc)
        wait0()
        hold_s(sacc)

    SW128 = U64(1 << 62)  # the descriptor's swizzle mode 1: 128 bytes

    @cuda.jit(device=True)
    def v_desc(vbase, kk):
        return U64(descriptor(vbase + U32(kk * 2048), HALF, 1024)) | SW128

    return SimpleNamespace(stage=stage, v_desc=v_desc, qk_issue=qk_issue, qk=qk, pv=pv,
                           HALF=HALF)


@functools.cache
def build_pipe(d: int, causal: bool, dtype: str, bn: int = 64, stages: int = 2, wgs: int = 2,
               ablate: str = "", swizzle: bool = False):
    """``(attn, signature)``: the Python source of the pipelined kernel, launched (once
    compiled for the signature, :func:`pipe_kernel`) as ``attn[(L / (64 wgs), B H), 128 wgs,
    stream, smem_bytes(...)](q, k, v, o32, L, scale_log2)``, the arguments of :func:`build`'s.

    ``wgs`` warpgroups per CTA, each owning 64 query rows, share every K / V tile, so a CTA
    copies each tile once for ``64 wgs`` rows (the one-warpgroup kernel copies it per 64);
    ``stages`` K / V buffers in dynamic shared memory form a ring: at the top of tile t, after
    the one barrier of the tile (every warp is done with tile t - 1), tile ``t + stages - 1``
    is requested into the buffer tile t - 1 used, so each tile's copies have ``stages - 1``
    tiles of compute to land in. ``bn`` keys per tile (64 or 128: wgmma's N of ``Q K^T``).
    Causal: the tiles wholly before the CTA's first row run in a loop of their own, with no
    mask (the non-causal kernel's loop); the tiles that cross the diagonal follow, masked.

    ``swizzle`` (session 30): K and V in the 128-byte swizzled layout (:func:`_swizzled`),
    copied a half row per eight threads, read with swizzle-mode descriptors; Q as before.

    ``ablate`` (timing only, the result is wrong): ``"copy"`` requests only the prologue's
    tiles and reuses their buffers (no K / V traffic after them); ``"softmax"`` packs S as P
    without the exponentials, maxima and rescaling."""
    from numba import cuda, float32, int16, int32, types

    from nbinfer.kernels.primitives import primitives

    if stages < 2 or wgs not in (1, 2) or bn not in (64, 128):
        raise ValueError(f"build_pipe: stages >= 2, wgs 1 or 2, bn 64 or 128; got {stages}, "
                         f"{wgs}, {bn}")
    U32 = types.uint32
    nt = 128 * wgs
    p = _parts(d, bn, dtype, nt)
    stage, softmax, reset, store = p.stage, p.softmax, p.reset, p.store
    qk, pv, proxy_fence = p.qk, p.pv, p.proxy_fence
    sw = _swizzled(d, bn, dtype, nt)
    stage_sw, qk_sw, pv_sw = sw.stage, sw.qk, sw.pv
    SWIZZLE = swizzle
    commit, shared_addr = p.commit, p.shared_addr
    wait_ring = primitives(False).wait(stages - 2)
    SBO_QK, SBO_V = p.SBO_QK, p.SBO_V
    BMP = 64 * wgs
    Q_BYTES = BMP * d * 2
    KV_BYTES = bn * d * 2
    STAGE_BYTES = 2 * KV_BYTES
    SACC, OACC = bn // 2, d // 2
    A_WORDS = p.A_WORDS
    CAUSAL, S = causal, stages
    NO_COPY, NO_SOFTMAX = "copy" in ablate, "softmax" in ablate

    @cuda.jit(device=True)
    def stage_kv(smem, buf, k, v, row, tid):
        # tile rows row .. row + bn - 1 of K and V into the stage at buf
        if SWIZZLE:
            stage_sw(smem, buf, k, row, tid)
            stage_sw(smem, buf + U32(KV_BYTES), v, row, tid)
        else:
            stage(smem, buf, k, row, bn, tid, False, SBO_QK)
            stage(smem, buf + U32(KV_BYTES), v, row, bn, tid, True, SBO_V)

    @cuda.jit(device=True)
    def step(smem, k, v, t, ntiles, row0, ring, sqw, tid, masked, sacc, oacc, pw, m, den, rq,
             t2, scale_log2):
        # one tile: wait for it, refill the ring, S = Q K^T, the softmax (masked: the tile
        # crosses the diagonal), O += P V
        wait_ring()  # tile t's group has landed (S - 2 newer ones may fly)
        proxy_fence()
        cuda.syncthreads()  # ... for every thread; and every warp is done with tile t - 1
        nxt = t + S - 1
        if nxt < ntiles and not (NO_COPY and nxt >= S - 1):
            buf = ring + U32((nxt % S) * STAGE_BYTES)  # tile t - 1's buffer
            stage_kv(smem, buf, k, v, row0 + nxt * bn, tid)
        commit()
        sk = ring + U32((t % S) * STAGE_BYTES)
        if SWIZZLE:
            qk_sw(smem, sk, sqw, sacc)
        else:
            qk(smem, sk, sqw, 0, 0, sacc)  # this warpgroup's 64 rows of Q at sqw
        softmax(sacc, oacc, pw, m, den, t * bn, rq, t2, masked, scale_log2, NO_SOFTMAX)
        if SWIZZLE:
            pv_sw(pw, sk + U32(KV_BYTES), oacc)
        else:
            pv(pw, sk + U32(KV_BYTES), oacc)

    def attn(q, k, v, o32, seq_len, scale_log2):
        smem = cuda.shared.array(0, int16)  # Q, then the ring: smem_bytes(d, bn, stages, wgs)
        tid = cuda.threadIdx.x
        wg, warp, lane = tid // 128, (tid // 32) % 4, tid % 32
        qt = cuda.gridDim.x - 1 - cuda.blockIdx.x if CAUSAL else cuda.blockIdx.x  # long first
        row0 = cuda.blockIdx.y * seq_len  # this (batch, head)'s first row
        q0 = qt * BMP
        ntiles = (q0 + BMP + bn - 1) // bn if CAUSAL else seq_len // bn
        clear = q0 // bn if CAUSAL else ntiles  # tiles wholly before the CTA's first row
        qw = q0 + 64 * wg  # this warpgroup's first row
        sq = shared_addr(smem, 0)
        if SWIZZLE:  # (1024-byte aligned: the swizzle pattern follows the address bits)
            sq = (sq + U32(1023)) & U32(0xFFFFFC00)
        sqw = sq + U32(wg * 64 * d * 2)
        ring = sq + U32(Q_BYTES)
        stage(smem, sq, q, row0 + q0, BMP, tid, False, SBO_QK)  # in the first group
        for s in range(S - 1):
            if s < ntiles:
                stage_kv(smem, ring + U32(s * STAGE_BYTES), k, v, row0 + s * bn, tid)
            commit()  # possibly empty: every thread counts S - 1 groups before the loop
        sacc = cuda.local.array(SACC, float32)
        oacc = cuda.local.array(OACC, float32)
        pw = cuda.local.array(A_WORDS, U32)
        m = cuda.local.array(2, float32)
        den = cuda.local.array(2, float32)
        reset(oacc, m, den)
        t2 = 2 * (lane % 4)
        rq = qw + 16 * warp + lane // 4
        for t in range(clear):
            step(smem, k, v, t, ntiles, row0, ring, sqw, tid, False, sacc, oacc, pw, m, den, rq,
                 t2, scale_log2)
        # causal only: the tiles crossing the diagonal. Every warpgroup computes each of them,
        # even one wholly past its rows (masked to P = 0: a 3 % share of the causal work at
        # L 4096), because a warpgroup-uniform skip around the wgmma costs 32 registers
        # (161 -> 129 at bn 64, D 128), the difference between one CTA per SM and two.
        for t in range(clear, ntiles):
            step(smem, k, v, t, ntiles, row0, ring, sqw, tid, True, sacc, oacc, pw, m, den, rq,
                 t2, scale_log2)
        store(o32, oacc, den, row0 + rq, t2)

    return attn, types.void(int16[::1], int16[::1], int16[::1], int32[::1], int32, float32)


@functools.cache
def build_ws(d: int, causal: bool, dtype: str, stages: int = 4, overlap: bool = False,
             ablate: str = "", tma: bool = False, swizzle: str = ""):
    """``(attn, signature)``: the warp-specialised kernel (session 30), launched as
    ``attn[(L / 128, B H), 384, stream, ws_smem_bytes(d, stages)](q, k, v, o32, L,
    scale_log2, maps)``, the arguments of :func:`build`'s and the tensor maps of K and V
    (:func:`tile_maps`; read only with ``tma``).

    Three warpgroups per CTA: warpgroup 0 only copies, warpgroups 1 and 2 only compute (64
    query rows each, :func:`build_pipe`'s tile). The producer's 128 threads copy Q, then K / V
    tile t into stage ``t % stages`` of a ring, each thread arriving on the stage's *full*
    mbarrier once its own copies have landed (``cp.async.mbarrier.arrive.noinc``: 16 copies
    of 16 bytes and one arrival per thread and 32 KiB tile at D 128); before refilling a
    stage it waits for the stage's *empty* mbarrier, on which each consumer warp arrives when
    its products have read the stage. There is no CTA barrier after the prologue, so the two
    consumer warpgroups drift apart and one's softmax can overlap the other's products, and
    no copy instruction is issued by a warp that multiplies (session 16's ablation: those
    copies cost 274 -> 362 TFLOP/s causal, 306 -> 509 non-causal). One CTA of 384 threads per
    SM (ptxas's cap: 168 registers), a ring of ``stages`` 32 KiB stages (4: 160 KiB with Q).

    ``overlap``: FlashAttention-3's pipelining inside a warpgroup: tile t's ``S = Q K^T`` and
    tile t - 1's ``O += P V`` are issued together, the softmax of tile t runs on S while the
    tensor cores still multiply P V, and only the rescale of O and the packing of P wait for
    that product (one more S in registers: 32 per thread).

    ``tma``: the producer's thread 0 copies each K and V tile by one TMA copy
    (:mod:`nbinfer.kernels.tma`: boxes of 64 rows in the core-matrix layout, K then K-major with
    LBO 1024 and SBO 128), arming the stage's full barrier (count 1) with the tile's 32 KiB,
    instead of 128 threads issuing 16 ``cp.async`` each (measured first: the ``cp.async``
    producer fed the consumers no faster than ``r128``'s own copies did).

    ``swizzle`` (with ``tma``; ``"kv"``, or ``"k"`` / ``"v"`` for that operand alone, which
    tells a wrong descriptor from the other): K and V tiles in the 128-byte swizzled layout, each 64-column
    half one copy of 64 rows x 128 bytes (:func:`nbinfer.kernels.tma.swizzled_tile_map`), read
    by the products with swizzle mode 1: K K-major (SBO 1024, a k-step 32 bytes on inside a
    half), V MN-major (SBO 1024 between 8-key groups, LBO 8 KiB between the halves). Measured
    second: TMA copies of 16-byte box rows fed the consumers no faster than ``cp.async``.

    ``ablate`` (timing only, the result is wrong): ``"copy"``: the producer copies only the
    first ``stages`` tiles and then re-arms each stage's full barrier without copying;
    ``"math"``: the consumers release each stage as soon as it has landed (the copies alone:
    what the memory side can deliver in this order)."""
    from numba import cuda, float32, int16, int32, int64, types

    from nbinfer.kernels.mbarrier import mbarrier_intrinsics
    from nbinfer.kernels.primitives import primitives
    from nbinfer.kernels.tma import tma_intrinsics
    from nbinfer.kernels.wgmma import (
        WGMMA_KINDS,
        wgmma_intrinsics,
        wgmma_tile_ops,
    )

    if stages < 2 or swizzle not in ("", "k", "v", "kv") or (swizzle not in ("", "kv")
                                                               and not tma):
        raise ValueError(f"build_ws: stages >= 2, and one operand swizzled only with tma; got "
                         f"{stages}, swizzle={swizzle}, tma={tma}")
    U32, U64 = types.uint32, types.uint64
    bn = 64
    p = _parts(d, bn, dtype, 128)  # the producer's copies: 128 threads
    stage, softmax, reset, store = p.stage, p.softmax, p.reset, p.store
    qk, pv, proxy_fence = p.qk, p.pv, p.proxy_fence
    shared_addr = p.shared_addr
    mb = mbarrier_intrinsics()
    intr = wgmma_intrinsics()
    ops = wgmma_tile_ops(d, bn, dtype, 4)
    qk_issue = ops.qk_issue
    kind = WGMMA_KINDS[dtype]
    mma_pv, hold_s, hold_o = intr.mma_rs[(d, kind)], intr.hold[bn // 2], intr.hold[d // 2]
    wgmma_fence, wgmma_commit, wgmma_wait0 = intr.fence, intr.commit, intr.wait0
    wait1 = intr.wait1
    init, fence_init, arrive = mb.init, mb.fence_init, mb.arrive
    cp_arrive, wait_parity = mb.cp_arrive_noinc, mb.wait_parity
    tmi = tma_intrinsics()
    expect_tx, tma_load, tma_load2d, tma_prefetch = tmi.expect_tx, tmi.load, tmi.load2d, tmi.prefetch
    wait_copies = primitives(False).wait(0)
    exp2 = primitives(False).exp2
    pack = p.pack
    SBO_QK, SBO_V, LBO = p.SBO_QK, p.SBO_V, p.LBO
    # V's descriptors as wgmma_tile_ops' pv_words builds them (K-steps 2 LBO bytes apart)
    STEP, LO_LBO, HI_V = 2 * LBO >> 4, U32((LBO >> 4) << 16), U64((SBO_V >> 4) << 32)
    Q_BYTES = 128 * d * 2
    KV_BYTES = bn * d * 2
    STAGE_BYTES = 2 * KV_BYTES
    BAR0 = Q_BYTES + stages * STAGE_BYTES  # full[s] at BAR0 + 8 s, empty[s] + 8 stages, Q's
    SACC, OACC = bn // 2, d // 2
    A_WORDS = p.A_WORDS
    CAUSAL, S, OVERLAP = causal, stages, overlap
    NO_COPY, NO_MATH = "copy" in ablate, "math" in ablate
    TMA = tma
    FULL_COUNT = 1 if TMA else 128
    SW_K, SW_V = "k" in swizzle, "v" in swizzle
    # the producer warpgroup's swizzled copies (without TMA), and K's products in whichever
    # layout the producer writes (swizzled, or a no-swizzle TMA box's)
    sw = _swizzled(d, bn, dtype, 128, "swizzled" if SW_K else "core")
    sw_stage, sw_v_desc, HALF = sw.stage, sw.v_desc, sw.HALF
    qk_issue_tma, sw_qk, sw_pv = sw.qk_issue, sw.qk, sw.pv
    NEG_INF = float32(-np.inf)

    @cuda.jit(device=True)
    def scores_to_p(sacc, m, den, alpha, key0, rq, t2, diagonal, scale_log2):
        # the online softmax's first half (overlap): S -> P in place, the rows' maxima and
        # sums; the rescale of O by alpha and P's packing wait for the P V product in flight
        if diagonal:
            lim = rq - key0 - t2
            for h in range(2):
                for j in range(SACC // 4):
                    for c in range(2):
                        if 8 * j + c > lim + 8 * h:
                            sacc[4 * j + 2 * h + c] = NEG_INF
        for h in range(2):
            mx = NEG_INF
            for j in range(SACC // 4):
                for c in range(2):
                    mx = max(mx, sacc[4 * j + 2 * h + c])
            mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 1))
            mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, 2))
            m_new = max(m[h], mx * scale_log2)  # a row always keeps a key of its tile 0
            alpha[h] = exp2(m[h] - m_new)
            m[h] = m_new
            rs = float32(0.0)
            for j in range(SACC // 4):
                for c in range(2):
                    x = exp2(sacc[4 * j + 2 * h + c] * scale_log2 - m_new)
                    sacc[4 * j + 2 * h + c] = x
                    rs += x
            den[h] = den[h] * alpha[h] + rs

    @cuda.jit(device=True)
    def rescale_pack(sacc, oacc, pw, alpha):
        # the second half: O *= alpha per row, P packed as the P V product's A words
        for h in range(2):
            for j in range(OACC // 4):
                for c in range(2):
                    oacc[4 * j + 2 * h + c] *= alpha[h]
        for w in range(A_WORDS):
            pw[w] = pack(sacc[2 * w], sacc[2 * w + 1])

    @cuda.jit(device=True)
    def pv_issue(pw, vbase, o):
        # O += P V issued and committed, not waited for (the caller fenced before it)
        lv = (U32(vbase) >> U32(4)) | LO_LBO
        for kk in range(bn // 16):
            if SW_V:
                dv = sw_v_desc(vbase, kk)
            else:
                dv = HI_V | U64(lv + U32(kk * STEP))
            mma_pv(pw[4 * kk], pw[4 * kk + 1], pw[4 * kk + 2], pw[4 * kk + 3], dv, o)
        wgmma_commit()

    @cuda.jit(device=True)
    def pv_tile(pw, vbase, o):
        # O += P V, waited for
        if SW_V:
            sw_pv(pw, vbase, o)
        else:
            pv(pw, vbase, o)

    @cuda.jit(device=True)
    def qk_tile(smem, kbase, sqw, sacc):
        if TMA or SW_K:
            sw_qk(smem, kbase, sqw, sacc)
        else:
            qk(smem, kbase, sqw, 0, 0, sacc)

    @cuda.jit(device=True)
    def qk_start(smem, kbase, sqw, sacc):
        if TMA or SW_K:
            qk_issue_tma(smem, kbase, sqw, sacc)
        else:
            qk_issue(smem, kbase, sqw, 0, 0, sacc)

    @cuda.jit(device=True)
    def producer(smem, q, k, v, maps, row0, q0, ntiles, sq, ring, bars, tid):
        stage(smem, sq, q, row0 + q0, 128, tid, False, SBO_QK)
        cp_arrive(bars + U32(16 * S))
        if TMA:
            if tid == 0:
                tma_prefetch(maps, 0)
                tma_prefetch(maps, 1)
                for t in range(ntiles):
                    s = t % S
                    full = bars + U32(8 * s)
                    if t >= S:
                        wait_parity(bars + U32(8 * (S + s)), U32((t // S - 1) & 1))
                    if NO_COPY and t >= S:
                        arrive(full)
                    else:
                        buf = ring + U32(s * STAGE_BYTES)
                        expect_tx(full, U32(STAGE_BYTES))
                        if SW_K:
                            for h in range(d // 64):
                                tma_load2d(buf + U32(h * HALF), maps, 0, 64 * h, row0 + t * bn,
                                           full)
                        else:
                            tma_load(buf, maps, 0, row0 + t * bn, full)
                        if SW_V:
                            for h in range(d // 64):
                                tma_load2d(buf + U32(KV_BYTES + h * HALF), maps, 1, 64 * h,
                                           row0 + t * bn, full)
                        else:
                            tma_load(buf + U32(KV_BYTES), maps, 1, row0 + t * bn, full)
            wait_copies()
            return
        for t in range(ntiles):
            s = t % S
            if t >= S:  # the consumers' release of this stage's previous fill
                wait_parity(bars + U32(8 * (S + s)), U32((t // S - 1) & 1))
            if not (NO_COPY and t >= S):
                buf = ring + U32(s * STAGE_BYTES)
                if SW_K:  # (both: swizzle "kv" without TMA)
                    sw_stage(smem, buf, k, row0 + t * bn, tid)
                    sw_stage(smem, buf + U32(KV_BYTES), v, row0 + t * bn, tid)
                else:
                    stage(smem, buf, k, row0 + t * bn, bn, tid, False, SBO_QK)
                    stage(smem, buf + U32(KV_BYTES), v, row0 + t * bn, bn, tid, True, SBO_V)
            cp_arrive(bars + U32(8 * s))
        wait_copies()  # (no thread leaves with copies in flight)

    @cuda.jit(device=True)
    def consumer(smem, o32, row0, q0, ntiles, clear, sq, ring, bars, ctid, scale_log2):
        cwg, warp, lane = ctid // 128, (ctid // 32) % 4, ctid % 32
        sqw = sq + U32(cwg * 64 * d * 2)
        sacc = cuda.local.array(SACC, float32)
        oacc = cuda.local.array(OACC, float32)
        pw = cuda.local.array(A_WORDS, U32)
        m = cuda.local.array(2, float32)
        den = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        reset(oacc, m, den)
        t2 = 2 * (lane % 4)
        rq = q0 + 64 * cwg + 16 * warp + lane // 4
        wait_parity(bars + U32(16 * S), U32(0))  # Q
        proxy_fence()  # cp.async wrote through the generic proxy; wgmma reads async
        if NO_MATH:  # the ring alone: each stage released as soon as it has landed
            for t in range(ntiles):
                s = t % S
                wait_parity(bars + U32(8 * s), U32((t // S) & 1))
                if lane == 0:
                    arrive(bars + U32(8 * (S + s)))
        elif not OVERLAP:
            for t in range(ntiles):
                s = t % S
                wait_parity(bars + U32(8 * s), U32((t // S) & 1))
                if not TMA:
                    proxy_fence()  # (TMA writes through the async proxy itself)
                sk = ring + U32(s * STAGE_BYTES)
                qk_tile(smem, sk, sqw, sacc)
                softmax(sacc, oacc, pw, m, den, t * bn, rq, t2, t >= clear, scale_log2, False)
                pv_tile(pw, sk + U32(KV_BYTES), oacc)
                if lane == 0:
                    arrive(bars + U32(8 * (S + s)))
        else:
            # tile 0 alone: S, then P (O is zero: its rescale by alpha = 0 is harmless)
            wait_parity(bars, U32(0))
            if not TMA:
                proxy_fence()
            qk_tile(smem, ring, sqw, sacc)
            scores_to_p(sacc, m, den, alpha, 0, rq, t2, 0 >= clear, scale_log2)
            rescale_pack(sacc, oacc, pw, alpha)
            for t in range(1, ntiles):
                s = t % S
                sp = (t - 1) % S
                wait_parity(bars + U32(8 * s), U32((t // S) & 1))
                if not TMA:
                    proxy_fence()
                hold_o(oacc)  # rescaled and P packed before the fence in qk_issue
                qk_start(smem, ring + U32(s * STAGE_BYTES), sqw, sacc)
                pv_issue(pw, ring + U32(sp * STAGE_BYTES + KV_BYTES), oacc)
                wait1()  # S = Q K^T of tile t done; P V of tile t - 1 may still run
                hold_s(sacc)
                scores_to_p(sacc, m, den, alpha, t * bn, rq, t2, t >= clear, scale_log2)
                wgmma_wait0()
                hold_o(oacc)
                if lane == 0:
                    arrive(bars + U32(8 * (S + sp)))
                rescale_pack(sacc, oacc, pw, alpha)
            last = (ntiles - 1) % S
            hold_o(oacc)
            wgmma_fence()
            pv_issue(pw, ring + U32(last * STAGE_BYTES + KV_BYTES), oacc)
            wgmma_wait0()
            hold_o(oacc)
        store(o32, oacc, den, row0 + rq, t2)

    def attn(q, k, v, o32, seq_len, scale_log2, maps):
        smem = cuda.shared.array(0, int16)  # Q, the ring, the barriers: ws_smem_bytes(d, S)
        tid = cuda.threadIdx.x
        qt = cuda.gridDim.x - 1 - cuda.blockIdx.x if CAUSAL else cuda.blockIdx.x  # long first
        row0 = cuda.blockIdx.y * seq_len
        q0 = qt * 128
        ntiles = (q0 + 128 + bn - 1) // bn if CAUSAL else seq_len // bn
        clear = q0 // bn if CAUSAL else ntiles
        # (1024-byte aligned: the swizzle pattern follows the address bits)
        sq = (shared_addr(smem, 0) + U32(1023)) & U32(0xFFFFFC00)
        ring = sq + U32(Q_BYTES)
        bars = sq + U32(BAR0)
        if tid == 0:
            for s in range(S):
                init(bars + U32(8 * s), U32(FULL_COUNT))  # full: producer threads (or TMA)
                init(bars + U32(8 * (S + s)), U32(8))  # empty: the consumers' warps
            init(bars + U32(16 * S), U32(128))  # Q
            fence_init()
        cuda.syncthreads()
        if tid < 128:
            producer(smem, q, k, v, maps, row0, q0, ntiles, sq, ring, bars, tid)
        else:
            consumer(smem, o32, row0, q0, ntiles, clear, sq, ring, bars, tid - 128,
                     scale_log2)

    return attn, types.void(int16[::1], int16[::1], int16[::1], int32[::1], int32, float32,
                            int64[::1])


def tile_maps(k, v, swizzle=""):
    """The device array of :func:`build_ws`'s two tensor maps (K's, then V's) for contiguous
    ``[B, H, L, D]`` torch tensors: 64-row boxes of the ``[B H L, D]`` rows, swizzled for the
    operands ``swizzle`` names (``"k"``, ``"v"``)."""
    import torch

    from nbinfer.kernels.tma import core_tile_map, swizzled_tile_map

    B, H, L, D = k.shape
    maps = [(swizzled_tile_map if name in swizzle else core_tile_map)(
        t.data_ptr(), B * H * L, D * 2, D, 64) for name, t in (("k", k), ("v", v))]
    return torch.from_numpy(np.concatenate(maps)).to(k.device)


def ws_smem_bytes(d: int, stages: int) -> int:
    """Dynamic shared memory of :func:`build_ws`'s kernel: Q's 128 rows, the K / V ring,
    ``2 stages + 1`` mbarriers of 8 bytes, and 1 KiB to align the rest to 1024 bytes."""
    return 128 * d * 2 + stages * 2 * 64 * d * 2 + 8 * (2 * stages + 1) + 1024


def smem_bytes(d: int, bn: int, stages: int, wgs: int, swizzle: bool = False) -> int:
    """Dynamic shared memory of :func:`build_pipe`'s kernel: Q's rows and the K / V ring (and 1
    KiB to align them to 1024 bytes when swizzled)."""
    return 64 * wgs * d * 2 + stages * 2 * bn * d * 2 + (1024 if swizzle else 0)


# The timed variants: name -> build options ("pipe": build_pipe's keywords; else build's)
VARIANTS = {
    "one-stage": dict(overlap=False),
    "overlap": dict(overlap=True),
    "2wg-n64-s2": dict(pipe=dict(wgs=2, bn=64, stages=2)),
    "2wg-n64-s3": dict(pipe=dict(wgs=2, bn=64, stages=3)),
    "2wg-n128-s2": dict(pipe=dict(wgs=2, bn=128, stages=2)),
    "1wg-n64-s3": dict(pipe=dict(wgs=1, bn=64, stages=3)),
    "2wg-n64-s2 r128": dict(pipe=dict(wgs=2, bn=64, stages=2, maxreg=128)),
    "2wg-n64-s2 r128 sw": dict(pipe=dict(wgs=2, bn=64, stages=2, maxreg=128, swizzle=True)),
    "2wg-n64-s2 sw": dict(pipe=dict(wgs=2, bn=64, stages=2, swizzle=True)),
    # warp-specialised (build_ws): a producer warpgroup, two consumers, mbarriers
    "ws-s4": dict(ws=dict(stages=4)),
    "ws-s4-ov": dict(ws=dict(stages=4, overlap=True)),
    "ws-s2": dict(ws=dict(stages=2)),
    "ws-s2-ov": dict(ws=dict(stages=2, overlap=True)),
    "ws-tma-s4": dict(ws=dict(stages=4, tma=True)),
    "ws-tma-s4-ov": dict(ws=dict(stages=4, overlap=True, tma=True)),
    "ws-tma-s2-ov": dict(ws=dict(stages=2, overlap=True, tma=True)),
    "ws-sw-s4": dict(ws=dict(stages=4, tma=True, swizzle="kv")),
    "ws-sw-s4-ov": dict(ws=dict(stages=4, overlap=True, tma=True, swizzle="kv")),
    "ws-sw-s5-ov": dict(ws=dict(stages=5, overlap=True, tma=True, swizzle="kv")),
    "ws-swk-s4-ov": dict(ws=dict(stages=4, overlap=True, tma=True, swizzle="k")),
    "ws-swv-s4-ov": dict(ws=dict(stages=4, overlap=True, tma=True, swizzle="v")),
    "ws-cpsw-s4-ov": dict(ws=dict(stages=4, overlap=True, swizzle="kv")),
}
# ablations of one pipelined variant (timing only: their output is not attention)
ABLATIONS = {
    "2wg-n64-s2 no-copy": dict(pipe=dict(wgs=2, bn=64, stages=2, ablate="copy")),
    "2wg-n64-s2 no-softmax": dict(pipe=dict(wgs=2, bn=64, stages=2, ablate="softmax")),
    "2wg-n64-s2 no-copy no-softmax": dict(pipe=dict(wgs=2, bn=64, stages=2,
                                                     ablate="copy softmax")),
    "ws-s4 no-copy": dict(ws=dict(stages=4, ablate="copy")),
    "ws-s4-ov no-copy": dict(ws=dict(stages=4, overlap=True, ablate="copy")),
    "ws-tma-s4-ov no-copy": dict(ws=dict(stages=4, overlap=True, tma=True, ablate="copy")),
    "ws-s4 no-math": dict(ws=dict(stages=4, ablate="math")),
    "ws-tma-s4 no-math": dict(ws=dict(stages=4, tma=True, ablate="math")),
    "ws-sw-s4 no-math": dict(ws=dict(stages=4, tma=True, swizzle="kv", ablate="math")),
}


def run(q, k, v, causal, out=None, variant="one-stage"):
    """O for torch CUDA tensors ``[B, H, L, D]`` (contiguous, fp16/bf16, L a multiple of the
    variant's rows per CTA and keys per tile) by one of :data:`VARIANTS` (or
    :data:`ABLATIONS`)."""
    import torch
    from numba import cuda

    B, H, L, D = q.shape
    opts = {**VARIANTS, **ABLATIONS}[variant]
    pipe, ws = opts.get("pipe"), opts.get("ws")
    rows, keys = (64 * pipe["wgs"], pipe["bn"]) if pipe else (128, 64) if ws else (BM, BN)
    if L % rows or L % keys or D not in (64, 128) or not all(
            t.is_contiguous() for t in (q, k, v)):
        raise ValueError(f"wgmma_attention {variant}: contiguous [B, H, L, D], L % {rows} == 0 "
                         f"and L % {keys} == 0, D 64 or 128")
    dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype]
    out = torch.empty_like(q) if out is None else out
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    args = (cuda.as_cuda_array(q.view(torch.int16).reshape(-1)),
            cuda.as_cuda_array(k.view(torch.int16).reshape(-1)),
            cuda.as_cuda_array(v.view(torch.int16).reshape(-1)),
            cuda.as_cuda_array(out.view(torch.int32).reshape(-1)),
            np.int32(L), np.float32(math.log2(math.e) / math.sqrt(D)))
    if pipe:
        kern = pipe_kernel(D, causal, dtype, **pipe)
        nbytes = smem_bytes(D, pipe["bn"], pipe["stages"], pipe["wgs"],
                            pipe.get("swizzle", False))
        kern[(L // rows, B * H), 128 * pipe["wgs"], stream, nbytes](*args)
    elif ws:
        kern = ws_kernel(D, causal, dtype, **ws)
        sw = ws.get("swizzle", "")
        key = (k.data_ptr(), v.data_ptr(), tuple(k.shape), sw)
        if key not in _MAPS:  # (built once per pair of tensors: the timing loops reuse them)
            _MAPS[key] = tile_maps(k, v, sw)
        maps = cuda.as_cuda_array(_MAPS[key])
        kern[(L // rows, B * H), 384, stream, ws_smem_bytes(D, ws["stages"])](*args, maps)
    else:
        build(D, causal, dtype, opts["overlap"])[(L // BM, B * H), NT, stream](*args)
    return out


@functools.cache
def pipe_kernel(d, causal, dtype, wgs, bn, stages, ablate="", maxreg=None, swizzle=False):
    """:func:`build_pipe`'s kernel, opted in to its dynamic shared memory (past 48 KiB a
    function must ask the driver for it); ``maxreg``: ptxas's register cap (128 lets two
    CTAs of 256 threads share an SM)."""
    from numba import cuda

    fn, sig = build_pipe(d, causal, dtype, bn, stages, wgs, ablate, swizzle)
    return _opted_in(cuda.jit(sig, lineinfo=False,
                              **({"max_registers": maxreg} if maxreg else {}))(fn),
                     smem_bytes(d, bn, stages, wgs, swizzle))


@functools.cache
def ws_kernel(d, causal, dtype, stages, overlap=False, ablate="", tma=False, swizzle=""):
    """:func:`build_ws`'s kernel under ptxas's cap for one CTA of 384 threads per SM (168
    registers), opted in to its dynamic shared memory."""
    from numba import cuda

    fn, sig = build_ws(d, causal, dtype, stages, overlap, ablate, tma, swizzle)
    return _opted_in(cuda.jit(sig, lineinfo=False, max_registers=WS_MAX_REGISTERS)(fn),
                     ws_smem_bytes(d, stages))


def _opted_in(kern, nbytes):
    # a kernel past 48 KiB of dynamic shared memory must ask the driver for it
    from numba import cuda

    from nbinfer.kernels.launch import _driver

    (overload,) = kern.overloads.values()
    fn = overload._codelibrary.get_cufunc()
    handle = int(getattr(fn.handle, "value", None) or int(fn.handle))
    _driver().allow_dynamic_shared(handle, nbytes, cuda.get_current_device().id)
    return kern


def kernel_regs(variant, d, causal, dtype="float16"):
    """Registers per thread of a variant's kernel (compiled by an earlier :func:`run`)."""
    opts = {**VARIANTS, **ABLATIONS}[variant]
    pipe, ws = opts.get("pipe"), opts.get("ws")
    kern = (pipe_kernel(d, causal, dtype, **pipe) if pipe else
            ws_kernel(d, causal, dtype, **ws) if ws else
            build(d, causal, dtype, opts["overlap"]))
    return kern.get_regs_per_thread()


def check(torch, F, variants):
    """Max relative error against SDPA's math backend in float32, per small case."""
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, H, L, D, causal, dt in [(1, 2, 256, 128, True, torch.float16),
                                   (2, 3, 384, 128, False, torch.float16),
                                   (1, 2, 384, 64, True, torch.bfloat16),
                                   (1, 1, 128, 64, False, torch.bfloat16),
                                   (1, 2, 256, 64, True, torch.float16),
                                   (1, 2, 256, 128, False, torch.bfloat16)]:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", generator=g).to(dt) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        for variant in variants:
            o = run(q, k, v, causal, variant=variant).float()
            err = float((o - ref).norm() / ref.norm())
            tol = TOLERANCE[str(dt).split(".")[-1]]
            rows.append(dict(B=B, H=H, L=L, D=D, causal=causal, dtype=str(dt),
                             variant=variant, rel_err=err, tolerance=tol))
            print(f"check B{B} H{H} L{L} D{D} {'causal' if causal else 'full'} {dt} "
                  f"{variant}: rel err {err:.2e}", flush=True)
    return rows


def tflops(fn, flops):
    """TFLOP/s of ``fn`` from its GPU time back to back (bench/decode.py's gpu_ms)."""
    from decode import gpu_ms  # imports torch: here, so that build() needs none

    return flops / (gpu_ms(fn) * 1e-3) / 1e12


def time_shape(torch, F, q, k, v, variants):
    """Rows of TFLOP/s (causal and not) for ``variants`` and SDPA flash / cuDNN on q, k, v."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, L, D = q.shape
    dtype = str(q.dtype).split(".")[-1]
    out = torch.empty_like(q)
    rows = []
    for causal in (True, False):
        flops = 4 * B * H * L * L * D / (2 if causal else 1)
        row = dict(B=B, H=H, L=L, D=D, dtype=dtype, causal=causal)
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION),
                         ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(be):
                row[f"sdpa_{name}_tflops"] = tflops(
                    lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c), flops)
        fl = row["sdpa_flash_tflops"]
        label = f"{'causal' if causal else 'full'} B{B} H{H} L{L} D{D} {dtype}"
        print(f"{label}: SDPA flash {fl:.1f} TFLOP/s, cuDNN {row['sdpa_cudnn_tflops']:.1f}",
              flush=True)
        row["wgmma_tflops"], row["regs"] = {}, {}
        for variant in variants:
            tf = tflops(lambda c=causal, w=variant: run(q, k, v, c, out, variant=w), flops)
            row["wgmma_tflops"][variant] = tf
            regs = row["regs"][variant] = kernel_regs(variant, D, causal, dtype)
            print(f"{label}: {variant:32s} {tf:6.1f} TFLOP/s ({tf / fl:.2f}x flash), {regs} regs",
                  flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="4,32,4096,128",
                    help="B,H,L,D of the timed cases, several separated by ';'")
    ap.add_argument("--dtypes", default="float16", help="float16 and/or bfloat16, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {list(VARIANTS)} (checked, then timed) or "
                         f"{list(ABLATIONS)} (timed only)")
    ap.add_argument("--ablations", action="store_true",
                    help=f"also time {list(ABLATIONS)} (not checked: not attention)")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS and v not in ABLATIONS]
    if bad:
        ap.error(f"--variants: unknown {bad}")
    checks = check(torch, F, [v for v in variants if v in VARIANTS])
    failed = sorted({r["variant"] for r in checks if not r["rel_err"] <= r["tolerance"]})
    if failed:
        print(f"wgmma_attention: the check failed for {failed}; not timing them")
    timed_variants = [v for v in variants if v not in failed]  # (named ablations unchecked)
    if args.ablations:
        timed_variants += [v for v in ABLATIONS if v not in timed_variants]
    timed = []
    for shape in args.shapes.split(";"):
        B, H, L, D = (int(x) for x in shape.split(","))
        for dtype in args.dtypes.split(","):
            dt = getattr(torch, dtype)
            q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dt) for _ in range(3))
            timed += time_shape(torch, F, q, k, v, timed_variants)
            del q, k, v
    result = dict(checks=checks, failed=failed, timed=timed)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), **result), f, indent=2)


if __name__ == "__main__":
    main()
