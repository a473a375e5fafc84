"""Hopper's mbarriers from Numba (nbinfer.kernels.mbarrier): a producer warp and a consumer warp
passing rounds of data through a two-stage ring of shared memory, as the warp-specialised
attention kernel does (bench/wgmma_attention.py, ``build_ws``). Needs the GPU (sm_90)."""

from __future__ import annotations

import numpy as np
import pytest

ROUNDS = 7  # odd and > 2 stages: each stage's barriers go through both parities, twice
STAGES = 2
WORDS = 32 * 4  # one round: a 16-byte copy per producer lane


def _ring_kernel():
    from numba import cuda, int32, types

    from nbinfer.kernels.mbarrier import mbarrier_intrinsics
    from nbinfer.kernels.primitives import primitives

    U32 = types.uint32
    mb = mbarrier_intrinsics()
    init, fence_init, arrive = mb.init, mb.fence_init, mb.arrive
    cp_arrive, wait_parity = mb.cp_arrive_noinc, mb.wait_parity
    prims = primitives(False)
    cp16, shared_addr, wait_copies = prims.cp_async16_to, prims.shared_addr, prims.wait(0)
    BARS = STAGES * WORDS * 4  # bytes: the ring, then full[s] and empty[s]
    SMEM_WORDS = STAGES * WORDS + 2 * STAGES * 2  # (an array size: one captured constant)

    @cuda.jit
    def ring(src, out):
        # warp 0 copies round r into stage r % 2 by cp.async and arrives on full[s] when its
        # own copies land; warp 1 waits for full[s], adds the round to every word it reads
        # (so a stale or early read shows) and releases the stage on empty[s]
        smem = cuda.shared.array(SMEM_WORDS, int32, alignment=16)
        tid = cuda.threadIdx.x
        lane = tid % 32
        base = shared_addr(smem, 0)
        bars = base + U32(BARS)
        if tid == 0:
            for s in range(STAGES):
                init(bars + U32(8 * s), U32(32))
                init(bars + U32(8 * (STAGES + s)), U32(1))
            fence_init()
        cuda.syncthreads()
        if tid < 32:
            for r in range(ROUNDS):
                s = r % STAGES
                if r >= STAGES:
                    wait_parity(bars + U32(8 * (STAGES + s)), U32((r // STAGES - 1) & 1))
                cp16(smem, base + U32(4 * (s * WORDS + 4 * lane)), src, r * WORDS + 4 * lane)
                cp_arrive(bars + U32(8 * s))
            wait_copies()
        else:
            for r in range(ROUNDS):
                s = r % STAGES
                wait_parity(bars + U32(8 * s), U32((r // STAGES) & 1))
                for i in range(4):
                    out[r * WORDS + 4 * lane + i] = smem[s * WORDS + 4 * lane + i] + r
                cuda.syncwarp()
                if lane == 0:
                    arrive(bars + U32(8 * (STAGES + s)))

    return ring


@pytest.mark.gpu
def test_a_two_stage_ring_passes_every_round_once(rng):
    from numba import cuda

    src = rng.integers(-(2**20), 2**20, size=ROUNDS * WORDS).astype(np.int32)
    out = cuda.to_device(np.full(ROUNDS * WORDS, -1, np.int32))
    _ring_kernel()[1, 64](cuda.to_device(src), out)
    expect = src.reshape(ROUNDS, WORDS) + np.arange(ROUNDS)[:, None]
    assert np.array_equal(out.copy_to_host().reshape(ROUNDS, WORDS), expect)
