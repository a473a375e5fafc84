"""Boolean masks and their packed-bit form (FlashInfer's ``packbits`` / ``segment_packbits``).

FlashInfer stores custom attention masks as bits: request ``i``'s ``[qo_len_i, kv_len_i]`` mask is
flattened row-major, the flat masks are concatenated, and each request's segment is packed into
bytes separately (``segment_packbits``), in little-endian bit order by default for kernels.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_choice, check_indptr

BIT_ORDERS = ("big", "little")


def _as_bool_1d(name: str, x) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != np.bool_:
        raise TypeError(f"{name} must be a boolean array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def packbits(x, bitorder: str = "big") -> np.ndarray:
    """Pack a 1-D bool array into uint8, 8 elements per byte (zero-padded at the end)."""
    check_choice("bitorder", bitorder, BIT_ORDERS)
    return np.packbits(_as_bool_1d("x", x), bitorder=bitorder)


def segment_packbits(x, indptr, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` into its own whole bytes.

    Returns ``(packed uint8 [sum ceil(len_i / 8)], packed_indptr int32 [n + 1])``.
    """
    check_choice("bitorder", bitorder, BIT_ORDERS)
    x = _as_bool_1d("x", x)
    indptr = check_indptr("indptr", indptr, total=x.size)
    lens = np.diff(indptr)
    packed_indptr = np.zeros_like(indptr)
    np.cumsum((lens + 7) // 8, out=packed_indptr[1:])
    out = np.zeros(int(packed_indptr[-1]), dtype=np.uint8)
    for i in range(lens.size):
        out[packed_indptr[i]:packed_indptr[i + 1]] = np.packbits(
            x[indptr[i]:indptr[i + 1]], bitorder=bitorder)
    return out, packed_indptr


def unpackbits(packed, length: int, bitorder: str = "big") -> np.ndarray:
    """Inverse of :func:`packbits`: the first ``length`` bits of ``packed`` as bool."""
    check_choice("bitorder", bitorder, BIT_ORDERS)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise TypeError(f"packed must be a 1-D uint8 array, got {packed.dtype} with shape {packed.shape}")
    if packed.size * 8 < length:
        raise ValueError(f"packed holds {packed.size * 8} bits, fewer than length={length}")
    return np.unpackbits(packed, count=length, bitorder=bitorder).astype(bool)


def segment_unpackbits(packed, packed_indptr, lengths, bitorder: str = "big") -> np.ndarray:
    """Inverse of :func:`segment_packbits` given each segment's bit length; returns flat bool."""
    lengths = np.asarray(lengths, dtype=np.int64)
    packed_indptr = check_indptr("packed_indptr", packed_indptr, length=lengths.size + 1)
    want = (lengths + 7) // 8
    have = np.diff(packed_indptr)
    if np.any(have != want):
        i = int(np.argmax(have != want))
        raise ValueError(f"segment {i} holds {have[i]} bytes, but length {lengths[i]} needs {want[i]}")
    parts = [unpackbits(np.asarray(packed)[packed_indptr[i]:packed_indptr[i + 1]], int(lengths[i]),
                        bitorder) for i in range(lengths.size)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
