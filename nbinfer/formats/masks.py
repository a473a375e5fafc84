"""Boolean masks: element masks, their BSR cover, and their packed-bit form.

Element masks are bool ``[M, N]`` arrays, True where query row ``i`` may attend to KV column
``j``. :func:`bsr_from_mask` turns one into the blocks a kernel must visit, and
:func:`block_element_mask` cuts it into the per-block masks FlashInfer's
``BlockSparseAttentionWrapper`` takes for blocks that are only partly attended.

FlashInfer stores custom masks as bits: request ``i``'s ``[qo_len_i, kv_len_i]`` mask is
flattened row-major, the flat masks are concatenated, and each request's segment is packed into
whole bytes separately (``segment_packbits``); kernels read little-endian bit order.
"""

from __future__ import annotations

import numpy as np

from .._checks import as_index_array, check_choice, check_indptr, check_positive_int
from .bsr import BSR, check_block_shape

BIT_ORDERS = ("big", "little")


def _as_bool(name: str, x, ndim: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != np.bool_:
        raise TypeError(f"{name} must be a boolean array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr


# -- element masks ---------------------------------------------------------------------------
def causal_mask(M: int, N: int) -> np.ndarray:
    """Bottom-right aligned causal mask, bool ``[M, N]``: ``j <= i + N - M``.

    The last query row sees all ``N`` keys (the queries are the last ``M`` tokens of a sequence
    of length ``N``); with ``M > N`` the first ``M - N`` rows see nothing.
    """
    m, n = check_positive_int("M", M, minimum=0), check_positive_int("N", N, minimum=0)
    return np.arange(n)[None, :] <= np.arange(m)[:, None] + (n - m)


def sliding_window_mask(M: int, N: int, window_left: int) -> np.ndarray:
    """Left edge of a sliding window, bool ``[M, N]``: ``j >= i + N - M - window_left``.

    Row ``i`` (at sequence position ``i + N - M``) keeps itself and the ``window_left`` keys
    before it, and everything to the right; combine with :func:`causal_mask` (``&``) for the
    usual causal sliding window of ``window_left + 1`` keys. FlashInfer's ``window_left=-1``
    (no window) is not a mask: simply leave this mask out.
    """
    m, n = check_positive_int("M", M, minimum=0), check_positive_int("N", N, minimum=0)
    w = check_positive_int("window_left", window_left, minimum=0)
    return np.arange(n)[None, :] >= np.arange(m)[:, None] + (n - m - w)


def _block_view(bsr_shape, block_shape, mask: np.ndarray) -> np.ndarray:
    # Pad with False to whole blocks and expose [block_row, Br, block_col, Bc].
    (m, n), (br, bc) = bsr_shape, block_shape
    rows, cols = -(-m // br), -(-n // bc)
    padded = np.zeros((rows * br, cols * bc), dtype=bool)
    padded[:m, :n] = mask
    return padded.reshape(rows, br, cols, bc)


def bsr_from_mask(mask, block_shape) -> BSR:
    """The BSR storing exactly the blocks of ``mask`` that hold at least one True.

    Parameters
    ----------
    mask : array of bool, shape [M, N]
        Element mask; ``M`` and ``N`` need not be multiples of the block shape.
    block_shape : (int, int)
        ``(Br, Bc)``.

    Returns
    -------
    BSR
        Shape ``(M, N)``, block columns sorted within each row, no ``last_block_len``.
    """
    mask = _as_bool("mask", mask, 2)
    br, bc = check_block_shape(block_shape)
    occupancy = _block_view(mask.shape, (br, bc), mask).any(axis=(1, 3))
    return BSR.from_dense(occupancy, (br, bc), mask.shape)


def block_element_mask(bsr: BSR, mask) -> np.ndarray:
    """Per-stored-block element masks: bool ``[nnz_blocks, Br, Bc]``.

    Entry ``[k, r, c]`` is ``mask[i * Br + r, indices[k] * Bc + c]`` for stored block ``k`` in
    block row ``i``. Elements outside the matrix, or past a block's valid columns (the
    ``last_block_len`` of a paged row), are False. This is the ``mask`` argument of FlashInfer's
    ``BlockSparseAttentionWrapper.plan`` before packing.

    Parameters
    ----------
    bsr : BSR
        The block structure.
    mask : array of bool, shape bsr.shape
        Element mask over the whole matrix.
    """
    if not isinstance(bsr, BSR):
        raise TypeError(f"bsr must be a BSR, got {type(bsr).__name__}")
    mask = _as_bool("mask", mask, 2)
    if mask.shape != bsr.shape:
        raise ValueError(f"mask must have shape {bsr.shape} (bsr.shape), got {mask.shape}")
    view = _block_view(bsr.shape, bsr.block_shape, mask)
    blocks = view[bsr.block_row_ids(), :, bsr.indices, :]  # advanced indices first: [nnz, Br, Bc]
    valid = np.arange(bsr.block_shape[1]) < bsr.block_col_lens()[:, None]
    return blocks & valid[:, None, :]


def causal_bsr(M: int, N: int, block_shape) -> BSR:
    """``bsr_from_mask(causal_mask(M, N), block_shape)``: the blocks a causal tile loop visits."""
    return bsr_from_mask(causal_mask(M, N), block_shape)


# -- packed bits -----------------------------------------------------------------------------
def packbits(x, bitorder: str = "big") -> np.ndarray:
    """Pack a bool array into bytes.

    Parameters
    ----------
    x : array of bool, shape [n]
    bitorder : {"big", "little"}
        Which end of each byte holds the first of its 8 elements.

    Returns
    -------
    numpy.ndarray of uint8, shape [ceil(n / 8)]
        The tail of the last byte is zero.
    """
    check_choice("bitorder", bitorder, BIT_ORDERS)
    return np.packbits(_as_bool("x", x, 1), bitorder=bitorder)


def segment_packbits(x, indptr, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i + 1]]`` into its own whole bytes.

    Parameters
    ----------
    x : array of bool, shape [indptr[-1]]
        Concatenated segments (e.g. flattened per-request masks).
    indptr : array of int, shape [num_segments + 1]
    bitorder : {"big", "little"}

    Returns
    -------
    packed : numpy.ndarray of uint8, shape [sum ceil(len_i / 8)]
    packed_indptr : numpy.ndarray of int32, shape [num_segments + 1]
        Segment ``i`` is ``packed[packed_indptr[i]:packed_indptr[i + 1]]``.
    """
    check_choice("bitorder", bitorder, BIT_ORDERS)
    x = _as_bool("x", x, 1)
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
    """Inverse of :func:`packbits`: the first ``length`` bits of ``packed`` (uint8 [n]) as bool."""
    check_choice("bitorder", bitorder, BIT_ORDERS)
    length = check_positive_int("length", length, minimum=0)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}")
    if packed.ndim != 1:
        raise ValueError(f"packed must be 1-D, got shape {packed.shape}")
    if packed.size * 8 < length:
        raise ValueError(f"length must be <= {packed.size * 8} (bits in packed), got {length}")
    return np.unpackbits(packed, count=length, bitorder=bitorder).astype(bool)


def segment_unpackbits(packed, packed_indptr, lengths, bitorder: str = "big") -> np.ndarray:
    """Inverse of :func:`segment_packbits`.

    Parameters
    ----------
    packed : array of uint8, shape [packed_indptr[-1]]
    packed_indptr : array of int, shape [num_segments + 1]
    lengths : array of int, shape [num_segments]
        Bits in each segment (the byte counts only give them up to a multiple of 8).
    bitorder : {"big", "little"}

    Returns
    -------
    numpy.ndarray of bool, shape [sum(lengths)]
    """
    check_choice("bitorder", bitorder, BIT_ORDERS)
    lengths = as_index_array("lengths", lengths).astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths must be >= 0, got {int(lengths.min())}")
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}")
    packed_indptr = check_indptr("packed_indptr", packed_indptr, length=lengths.size + 1,
                                 total=packed.size)
    want = (lengths + 7) // 8
    have = np.diff(packed_indptr)
    if np.any(have != want):
        i = int(np.argmax(have != want))
        raise ValueError(
            f"packed_indptr: segment {i} holds {have[i]} bytes, but lengths[{i}]={lengths[i]} "
            f"needs {want[i]}")
    parts = [unpackbits(packed[packed_indptr[i]:packed_indptr[i + 1]], int(lengths[i]), bitorder)
             for i in range(lengths.size)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
