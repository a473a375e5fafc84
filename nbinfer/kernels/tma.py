"""Hopper's Tensor Memory Accelerator (TMA) for 16-bit row tiles: one thread copies a whole K or
V tile into shared memory, already in a layout the warpgroup MMA reads.

A ``cp.async`` copy costs the warp that issues it one instruction per 16 bytes; a TMA copy is
one instruction per tile, moved by the SM's copy engine and signalled on an mbarrier
(:mod:`.mbarrier`): the thread arms the stage's barrier with the tile's byte count
(``expect_tx``) and each copy completes part of it. Built for the warp-specialised standalone
tile (bench/wgmma_attention.py's ``build_ws``), where a producer warpgroup on ``cp.async`` ran
at 249 TFLOP/s causal against 399 without any copies (bench/NOTES.md, session 30).

**The layout trick.** A tiled tensor map copies a box whose first dimension is contiguous in
shared memory. Viewing a ``[rows, D]`` tensor (rows ``row_stride`` bytes apart) as three
dimensions ``(8 elements, rows, D / 8 chunks)`` with strides ``(2, row_stride, 16)`` bytes, a
box ``(8, R, D / 8)`` lands as ``[chunk][row][8 elements]``: every 8-row x 16-byte core matrix
is 128 contiguous bytes, the core matrix of row block ``rb`` and chunk ``c`` at ``c R 16 + rb
128``. That is the MN-major V layout the P V product already reads (LBO 128 between key
blocks, SBO ``R / 8 x 128`` between column chunks), and a K-major layout for K with LBO ``R x
16`` (K-neighbours: the next chunk) and SBO 128 (the next 8 rows). No swizzle, so the
descriptors stay the ones :mod:`.wgmma` documents; the price is a 16-byte first box dimension,
and that price decided it: copies in 16-byte row pieces fed the SMs no faster than ``cp.async``
did (~2.2 TB/s). :func:`swizzled_tile_map` is the other form: boxes of 64 elements (one
128-byte line per row) in the 128-byte swizzled layout (:func:`.wgmma.swizzled_offset`),
which moved 8-12 TB/s in the same test (bench/NOTES.md, session 30).

The tensor map is 128 bytes built on the host (``cuTensorMapEncodeTiled`` through ctypes) and
read by the copies from global memory (Numba cannot declare a ``__grid_constant__`` kernel
parameter): a device array of maps, 64-byte aligned, passed to the kernel like any array.

GPU only (sm_90); tests/test_tma.py (gpu) checks both layouts against NumPy. The lean
prefill itself reaches the swizzled layout without TMA (whole-line ``cp.async`` copies,
:func:`.wgmma.swizzled_slot`); these serve bench/wgmma_attention.py's warp-specialised tile.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np

MAP_BYTES = 128  # sizeof(CUtensorMap)
MAP_WORDS = MAP_BYTES // 8  # one map as int64 words of a device array
_UINT16 = 1  # CU_TENSOR_MAP_DATA_TYPE_UINT16: the copy moves bits, fp16 or bf16 alike
_L2_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B: a row's 16-byte pieces share lines
_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B


@functools.cache
def _encode_tiled():
    # the driver's entry point, looked up once
    import ctypes

    fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    return fn


def _encode(address: int, dims, strides, box, swizzle: int) -> np.ndarray:
    # cuTensorMapEncodeTiled through ctypes: dims / box innermost first, strides in bytes of
    # every dimension but the first; 16-bit elements, no interleave, L2 promotion of 256 bytes,
    # zero fill out of bounds. The map as 16 int64 words.
    import ctypes

    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    n = len(dims)
    fn = _encode_tiled()
    out = np.zeros(MAP_WORDS, np.int64)
    res = fn(out.ctypes.data_as(ctypes.c_void_p), _UINT16, u32(n), ctypes.c_void_p(address),
             (u64 * n)(*dims), (u64 * (n - 1))(*strides), (u32 * n)(*box), (u32 * n)(*[1] * n),
             0, swizzle, _L2_256B, 0)
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {res} (dims {dims}, "
                           f"strides {strides}, box {box}, swizzle {swizzle})")
    return out


def _check_rows(name, address, rows, row_stride, box_rows):
    if address % 16 or row_stride % 16 or row_stride <= 0:
        raise ValueError(f"{name}: address and row_stride must be multiples of 16 (row_stride "
                         f"positive), got {address:#x} and {row_stride}")
    if not 1 <= box_rows <= 256 or rows < 1:
        raise ValueError(f"{name}: box_rows must be 1..256 and rows >= 1, got {box_rows} and "
                         f"{rows}")


def core_tile_map(address: int, rows: int, row_stride: int, head_dim: int,
                  box_rows: int) -> np.ndarray:
    """The tensor map (128 bytes, as 16 int64) of a ``[rows, head_dim]`` 16-bit tensor at device
    ``address`` whose rows are ``row_stride`` bytes apart, for boxes of ``box_rows`` rows that
    land in the canonical no-swizzle core-matrix layout (module docstring); a copy's
    coordinates are ``(0, first row, 0)`` (``tma_intrinsics().load``).

    Parameters
    ----------
    address : int
        Device address of element ``[0, 0]``; 16-byte aligned.
    rows : int
        Rows of the tensor (a box past the last row is zero-filled by the copy).
    row_stride : int
        Bytes between consecutive rows; a multiple of 16.
    head_dim : int
        Elements per row copied: a multiple of 8, at most 2048.
    box_rows : int
        Rows per copy, 1-256.
    """
    _check_rows("core_tile_map", address, rows, row_stride, box_rows)
    if head_dim % 8 or not 8 <= head_dim <= 2048:
        raise ValueError(f"core_tile_map: head_dim must be a multiple of 8 in 8..2048, got "
                         f"{head_dim}")
    return _encode(address, (8, rows, head_dim // 8), (row_stride, 16),
                   (8, box_rows, head_dim // 8), 0)


def swizzled_tile_map(address: int, rows: int, row_stride: int, head_dim: int,
                      box_rows: int) -> np.ndarray:
    """The tensor map of the same ``[rows, head_dim]`` tensor for boxes of ``box_rows`` rows x 64
    elements (128 bytes) in the 128-byte swizzled layout (FlashAttention-3's): row ``r`` of a
    box at ``128 r`` bytes, its 16-byte chunk ``c`` at chunk ``c ^ (r % 8)``. A copy's
    coordinates are ``(first column, first row)`` (``tma_intrinsics().load2d``); a head dim of
    128 takes two copies, columns 0 and 64. Arguments as :func:`core_tile_map`'s, with
    ``head_dim`` a multiple of 64."""
    _check_rows("swizzled_tile_map", address, rows, row_stride, box_rows)
    if head_dim % 64 or not 64 <= head_dim <= 2048:
        raise ValueError(f"swizzled_tile_map: head_dim must be a multiple of 64 in 64..2048, "
                         f"got {head_dim}")
    return _encode(address, (head_dim, rows), (row_stride,), (64, box_rows), _SWIZZLE_128B)


@functools.cache
def tma_intrinsics() -> SimpleNamespace:
    """The device side, as a namespace:

    - ``expect_tx(bar, nbytes)``: one arrival on the mbarrier at shared address ``bar`` that
      also expects ``nbytes`` more bytes of copies in its current phase;
    - ``load(dst, maps, i, row, bar)``: the box of map ``i`` of the int64 device array
      ``maps`` (:func:`core_tile_map`'s words, map ``i`` at ``maps[16 i]``) starting at ``row``
      into shared address ``dst``, completing its bytes on ``bar``;
    - ``load2d(dst, maps, i, col, row, bar)``: the same for a :func:`swizzled_tile_map` box
      whose first element is ``[row, col]`` (``dst`` 1024-byte aligned: the swizzle pattern
      follows the address bits, as the warpgroup MMA reads it);
    - ``prefetch(maps, i)``: map ``i`` fetched into the SM's descriptor cache."""
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    from .mbarrier import u32_asm

    U32 = types.uint32
    i32, i64 = ir.IntType(32), ir.IntType(64)

    def map_address(context, builder, aryty, ary, idx):
        arr = context.make_array(aryty)(context, builder, value=ary)
        i = builder.mul(context.cast(builder, idx, types.intp, types.intp),
                        context.get_constant(types.intp, MAP_WORDS))
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, [i], wraparound=False)
        return builder.ptrtoint(ptr, i64)

    def bulk_codegen(coords: str, ncoords: int):
        # cp.async.bulk.tensor of map args[2] of the array args[1] into shared address args[0],
        # its coordinates the next ncoords arguments ("$2" ..), completing on the barrier last
        dims = len(coords.split(","))
        bar = f"${2 + ncoords}"
        asm = ir.InlineAsm(
            ir.FunctionType(ir.VoidType(), [i32, i64] + [i32] * ncoords + [i32]),
            "{.reg .b32 z; mov.b32 z, 0; "
            f"cp.async.bulk.tensor.{dims}d.shared::cluster.global.mbarrier::complete_tx::bytes "
            f"[$0], [$1, {{{coords}}}], [{bar}];}}",
            ",".join(["r", "l"] + ["r"] * ncoords + ["r", "~{memory}"]), side_effect=True)

        def codegen(context, builder, sig, args):
            m = map_address(context, builder, sig.args[1], args[1],
                            context.cast(builder, args[2], sig.args[2], types.intp))
            xs = [context.cast(builder, args[3 + k], sig.args[3 + k], types.int32)
                  for k in range(ncoords)]
            d = context.cast(builder, args[0], sig.args[0], U32)
            b = context.cast(builder, args[-1], sig.args[-1], U32)
            builder.call(asm, [d, m, *xs, b])
            return context.get_dummy_value()

        return codegen

    load3d_codegen = bulk_codegen("z, $2, z", 1)  # core_tile_map's (0, row, 0)
    load2d_codegen = bulk_codegen("$2, $3", 2)  # swizzled_tile_map's (col, row)

    @intrinsic
    def load(typingctx, dst, maps, i, row, bar):
        return types.void(dst, maps, i, row, bar), load3d_codegen

    @intrinsic
    def load2d(typingctx, dst, maps, i, col, row, bar):
        return types.void(dst, maps, i, col, row, bar), load2d_codegen

    @intrinsic
    def prefetch(typingctx, maps, i):
        def codegen(context, builder, sig, args):
            m = map_address(context, builder, sig.args[0], args[0],
                            context.cast(builder, args[1], sig.args[1], types.intp))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i64]), "prefetch.tensormap [$0];",
                               "l,~{memory}", side_effect=True)
            builder.call(asm, [m])
            return context.get_dummy_value()

        return types.void(maps, i), codegen

    expect_tx = u32_asm(
        "{.reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;}", 2)
    return SimpleNamespace(expect_tx=expect_tx, load=load, load2d=load2d, prefetch=prefetch)


__all__ = ["MAP_BYTES", "MAP_WORDS", "core_tile_map", "swizzled_tile_map", "tma_intrinsics"]
