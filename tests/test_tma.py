"""Hopper's TMA from Numba (nbinfer.kernels.tma): a tensor map built on the host and one copy
of a box of rows, landing in the canonical no-swizzle core-matrix layout. Needs the GPU."""

from __future__ import annotations

import numpy as np
import pytest


def _box_kernel(box_rows: int, d: int):
    from numba import cuda, int16, types

    from nbinfer.kernels.mbarrier import mbarrier_intrinsics
    from nbinfer.kernels.primitives import primitives
    from nbinfer.kernels.tma import tma_intrinsics

    U32 = types.uint32
    mb, tma = mbarrier_intrinsics(), tma_intrinsics()
    init, fence_init, wait_parity = mb.init, mb.fence_init, mb.wait_parity
    expect_tx, load, prefetch = tma.expect_tx, tma.load, tma.prefetch
    shared_addr = primitives(False).shared_addr
    N = box_rows * d
    NBYTES = 2 * N
    BAR = NBYTES  # the barrier's byte offset, past the box (a multiple of 16)
    SMEM = N + 8  # (an array size: one captured constant)

    @cuda.jit
    def box(maps, row, out):
        # thread 0 copies the box of map 1 (map 0 is a decoy: a wrong index reads other rows)
        # starting at `row`; every thread then writes shared memory out as it lies
        smem = cuda.shared.array(SMEM, int16, alignment=128)
        tid = cuda.threadIdx.x
        base = shared_addr(smem, 0)
        if tid == 0:
            init(base + U32(BAR), U32(1))
            fence_init()
        cuda.syncthreads()
        if tid == 0:
            prefetch(maps, 1)
            expect_tx(base + U32(BAR), U32(NBYTES))
            load(base, maps, 1, row, base + U32(BAR))
        wait_parity(base + U32(BAR), U32(0))
        for i in range(tid, N, cuda.blockDim.x):
            out[i] = smem[i]

    return box


@pytest.mark.gpu
@pytest.mark.parametrize("box_rows, d, row_pad", [(64, 128, 0), (64, 64, 8), (128, 128, 16)])
def test_a_box_lands_as_core_matrices(rng, box_rows, d, row_pad):
    # Rows row_pad elements longer than d (a strided view: KV rows of one head inside
    # [tokens, heads, D]); the box's core matrix (row block rb, chunk c) must hold rows
    # 8 rb .. 8 rb + 7, elements 8 c .. 8 c + 7, at c * box_rows * 16 + rb * 128 bytes, and
    # rows past the tensor's end must come back as zeros.
    from numba import cuda

    from nbinfer.kernels.tma import MAP_WORDS, core_tile_map

    rows, first = 200, 150
    width = d + row_pad
    src = rng.integers(-(2**15), 2**15, size=(rows, width)).astype(np.int16)
    dsrc = cuda.to_device(src)
    addr = dsrc.device_ctypes_pointer.value
    maps = np.concatenate([core_tile_map(addr, rows, width * 2, d, 8),
                           core_tile_map(addr, rows, width * 2, d, box_rows)])
    assert maps.size == 2 * MAP_WORDS
    out = cuda.to_device(np.zeros(box_rows * d, np.int16))
    _box_kernel(box_rows, d)[1, 128](cuda.to_device(maps), first, out)
    got = out.copy_to_host().reshape(d // 8, box_rows, 8)  # [chunk][row][element]
    want = np.zeros((box_rows, d), np.int16)
    n = min(box_rows, rows - first)
    want[:n] = src[first:first + n, :d]
    assert np.array_equal(got.transpose(1, 0, 2).reshape(box_rows, d), want)


def test_a_tensor_map_refuses_what_the_copy_cannot_address():
    from nbinfer.kernels.tma import core_tile_map

    with pytest.raises(ValueError, match="multiples of 16"):
        core_tile_map(0x1008, 64, 256, 128, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        core_tile_map(0x1000, 64, 250, 128, 64)
    with pytest.raises(ValueError, match="head_dim"):
        core_tile_map(0x1000, 64, 256, 100, 64)
    with pytest.raises(ValueError, match="box_rows"):
        core_tile_map(0x1000, 64, 256, 128, 512)
