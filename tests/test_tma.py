"""Hopper's TMA from Numba (nbinfer.kernels.tma): a tensor map built on the host and one copy
of a box of rows, landing in the canonical no-swizzle core-matrix layout or in the 128-byte
swizzled one. The copies need the GPU; the maps' argument checks do not."""

from __future__ import annotations

import numpy as np
import pytest


def _box_kernel(box_rows: int, d: int, swizzled: bool = False):
    from numba import cuda, int16, types

    from nbinfer.kernels.mbarrier import mbarrier_intrinsics
    from nbinfer.kernels.primitives import primitives
    from nbinfer.kernels.tma import tma_intrinsics

    U32 = types.uint32
    mb, tma = mbarrier_intrinsics(), tma_intrinsics()
    init, fence_init, wait_parity = mb.init, mb.fence_init, mb.wait_parity
    expect_tx, load, load2d, prefetch = tma.expect_tx, tma.load, tma.load2d, tma.prefetch
    shared_addr = primitives(False).shared_addr
    N = box_rows * d
    NBYTES = 2 * N
    BAR = NBYTES  # the barrier's byte offset, past the box (a multiple of 16)
    SMEM = N + 8  # (an array size: one captured constant)
    HALF = box_rows * 128  # swizzled: bytes of one 64-column box

    @cuda.jit
    def box(maps, row, out):
        # thread 0 copies the box of map 1 (map 0 is a decoy: a wrong index reads other rows)
        # starting at `row`; every thread then writes shared memory out as it lies
        smem = cuda.shared.array(SMEM, int16, alignment=1024)
        tid = cuda.threadIdx.x
        base = shared_addr(smem, 0)
        if tid == 0:
            init(base + U32(BAR), U32(1))
            fence_init()
        cuda.syncthreads()
        if tid == 0:
            prefetch(maps, 1)
            expect_tx(base + U32(BAR), U32(NBYTES))
            if swizzled:
                for h in range(d // 64):
                    load2d(base + U32(h * HALF), maps, 1, 64 * h, row, base + U32(BAR))
            else:
                load(base, maps, 1, row, base + U32(BAR))
        wait_parity(base + U32(BAR), U32(0))
        for i in range(tid, N, cuda.blockDim.x):
            out[i] = smem[i]

    return box


def _copied_box(rng, box_rows, d, row_pad, swizzled):
    """``(shared memory as the box left it, the rows it must hold)``: rows ``row_pad`` elements
    longer than ``d`` (a strided view: KV rows of one head inside [tokens, heads, D]), the box
    starting 50 rows before the tensor's end (rows past it must come back as zeros), copied by
    map 1 of two (map 0, with other boxes, a decoy: a wrong map index reads other bytes)."""
    from numba import cuda

    from nbinfer.kernels.tma import MAP_WORDS, core_tile_map, swizzled_tile_map

    rows, first = 200, 150
    width = d + row_pad
    src = rng.integers(-(2**15), 2**15, size=(rows, width)).astype(np.int16)
    dsrc = cuda.to_device(src)
    addr = dsrc.device_ctypes_pointer.value
    encode = swizzled_tile_map if swizzled else core_tile_map
    maps = np.concatenate([encode(addr, rows, width * 2, d, 8),
                           encode(addr, rows, width * 2, d, box_rows)])
    assert maps.size == 2 * MAP_WORDS
    out = cuda.to_device(np.zeros(box_rows * d, np.int16))
    _box_kernel(box_rows, d, swizzled)[1, 128](cuda.to_device(maps), first, out)
    want = np.zeros((box_rows, d), np.int16)
    n = min(box_rows, rows - first)
    want[:n] = src[first:first + n, :d]
    return out.copy_to_host(), want


@pytest.mark.gpu
@pytest.mark.parametrize("box_rows, d, row_pad", [(64, 128, 0), (64, 64, 8), (128, 128, 16)])
def test_a_box_lands_as_core_matrices(rng, box_rows, d, row_pad):
    # The box's core matrix (row block rb, chunk c) holds rows 8 rb .. 8 rb + 7, elements
    # 8 c .. 8 c + 7, at c * box_rows * 16 + rb * 128 bytes.
    got, want = _copied_box(rng, box_rows, d, row_pad, False)
    got = got.reshape(d // 8, box_rows, 8)  # [chunk][row][element]
    assert np.array_equal(got.transpose(1, 0, 2).reshape(box_rows, d), want)


@pytest.mark.gpu
@pytest.mark.parametrize("box_rows, d, row_pad", [(64, 128, 0), (64, 64, 8)])
def test_a_swizzled_box_lands_in_the_128_byte_pattern(rng, box_rows, d, row_pad):
    # Each 64-column half of the rows a box of its own (box_rows x 128 bytes); inside it row r
    # at 128 r bytes and its 16-byte chunk c at chunk c ^ (r % 8): FlashAttention-3's layout,
    # which the warpgroup MMA reads with swizzle mode 1.
    got, want = _copied_box(rng, box_rows, d, row_pad, True)
    got = got.reshape(d // 64, box_rows, 8, 8)  # [half][row][slot][element]
    r = np.arange(box_rows)[:, None]
    chunk = np.arange(8)[None, :]
    for h in range(d // 64):
        unswizzled = got[h][r, chunk ^ (r % 8)]  # chunk c of row r from slot c ^ (r % 8)
        assert np.array_equal(unswizzled.reshape(box_rows, 64), want[:, 64 * h:64 * h + 64])


def test_a_tensor_map_refuses_what_the_copy_cannot_address():
    from nbinfer.kernels.tma import core_tile_map, swizzled_tile_map

    with pytest.raises(ValueError, match="multiples of 16"):
        core_tile_map(0x1008, 64, 256, 128, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        core_tile_map(0x1000, 64, 250, 128, 64)
    with pytest.raises(ValueError, match="head_dim"):
        core_tile_map(0x1000, 64, 256, 100, 64)
    with pytest.raises(ValueError, match="box_rows"):
        core_tile_map(0x1000, 64, 256, 128, 512)
    with pytest.raises(ValueError, match="multiple of 64"):
        swizzled_tile_map(0x1000, 64, 256, 96, 64)
