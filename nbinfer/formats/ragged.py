"""Ragged (padding-free) batches as BSR: FlashInfer's ``qo_indptr`` / ``kv_indptr`` layout.

A ragged batch packs every request's query tokens into one ``[total_q, ...]`` tensor and every
request's keys/values into one ``[total_kv, ...]`` tensor, with no padding: request ``b`` owns
query rows ``qo_indptr[b]:qo_indptr[b + 1]`` and KV columns ``kv_indptr[b]:kv_indptr[b + 1]``.
The attention pattern is block diagonal (a query only sees its own request's keys), and with
``causal=True`` each diagonal block is lower triangular, aligned to the bottom-right corner so the
last query sees every key (``kv_idx <= q_idx + kv_len - qo_len``), as in FlashInfer.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_indptr
from .bsr import BSR, check_block_shape


def _check_ragged(qo_indptr, kv_indptr):
    qo = check_indptr("qo_indptr", qo_indptr).astype(np.int64)
    kv = check_indptr("kv_indptr", kv_indptr).astype(np.int64)
    if qo.size != kv.size:
        raise ValueError(f"kv_indptr must have length {qo.size} (the length of qo_indptr, "
                         f"batch size + 1), got {kv.size}")
    return qo, kv


def ragged_mask(qo_indptr, kv_indptr, *, causal: bool = False) -> np.ndarray:
    """The exact element mask of a ragged batch.

    Parameters
    ----------
    qo_indptr : array of int, shape [B + 1]
        Query rows of request ``b`` are ``qo_indptr[b]:qo_indptr[b + 1]``.
    kv_indptr : array of int, shape [B + 1]
        KV columns of request ``b`` are ``kv_indptr[b]:kv_indptr[b + 1]``.
    causal : bool
        Keep only ``kv_idx <= q_idx + kv_len - qo_len`` within each request (bottom-right).

    Returns
    -------
    numpy.ndarray of bool, shape [qo_indptr[-1], kv_indptr[-1]]
        True where query row ``i`` attends to KV column ``j``.
    """
    qo, kv = _check_ragged(qo_indptr, kv_indptr)
    qo_lens, kv_lens = np.diff(qo), np.diff(kv)
    batch = np.arange(qo_lens.size)
    row_req = np.repeat(batch, qo_lens)
    col_req = np.repeat(batch, kv_lens)
    mask = row_req[:, None] == col_req[None, :]
    if causal:
        rows = np.arange(int(qo[-1]))
        # Last KV column row i may see, in global column numbers (may lie before its request).
        limit = kv[row_req] + (rows - qo[row_req]) + kv_lens[row_req] - qo_lens[row_req]
        mask &= np.arange(int(kv[-1]))[None, :] <= limit[:, None]
    return mask


def bsr_from_ragged(qo_indptr, kv_indptr, block_shape, *, causal: bool = False) -> BSR:
    """The blocks of a ragged batch's attention pattern, without building the dense mask.

    Parameters
    ----------
    qo_indptr : array of int, shape [B + 1]
        Query rows of request ``b`` are ``qo_indptr[b]:qo_indptr[b + 1]``.
    kv_indptr : array of int, shape [B + 1]
        KV columns of request ``b`` are ``kv_indptr[b]:kv_indptr[b + 1]`` (contiguous KV).
    block_shape : (int, int)
        ``(Br, Bc)``; blocks may straddle request boundaries.
    causal : bool
        Bottom-right aligned causal pattern within each request.

    Returns
    -------
    BSR
        Shape ``(qo_indptr[-1], kv_indptr[-1])``, block columns sorted within each row. Block
        ``(i, j)`` is stored iff it holds at least one True of :func:`ragged_mask`: it covers the
        mask and no stored block is empty. Elements of a stored block that belong to another
        request (or lie above the diagonal) still need an element mask.
    """
    qo, kv = _check_ragged(qo_indptr, kv_indptr)
    br, bc = check_block_shape(block_shape)
    m, n = int(qo[-1]), int(kv[-1])
    rows, cols = -(-m // br), -(-n // bc)
    qo_lens, kv_lens = np.diff(qo), np.diff(kv)
    # Split every request's query range at block-row boundaries: one piece per (block row,
    # request) pair. Sorting the block-row starts into the request starts does the split.
    cuts = np.union1d(qo, np.arange(0, m, br))
    lo, hi = cuts[:-1], cuts[1:]
    lo, hi = lo[hi > lo], hi[hi > lo]
    req = np.searchsorted(qo, lo, side="right") - 1
    block_row = lo // br
    # The columns a piece may read form one interval [c_lo, c_hi): the whole request's KV, or
    # under causality the prefix its last row (hi - 1) sees, since each row sees a prefix.
    c_lo = kv[req]
    c_hi = kv[req + 1]
    if causal:
        last_q = hi - 1 - qo[req]
        c_hi = np.minimum(c_hi, c_lo + last_q + kv_lens[req] - qo_lens[req] + 1)
    keep = c_hi > c_lo
    block_row, c_lo, c_hi = block_row[keep], c_lo[keep], c_hi[keep]
    j_lo, j_hi = c_lo // bc, -(-c_hi // bc)
    # Expand each interval of block columns and drop the duplicates that neighbouring requests
    # sharing a block row (and a straddling block column) produce.
    count = j_hi - j_lo
    piece = np.repeat(np.arange(count.size), count)
    first = np.concatenate([[0], np.cumsum(count)])[:-1]
    j = j_lo[piece] + np.arange(piece.size) - first[piece]
    keys = np.unique(block_row[piece] * max(cols, 1) + j)
    out_rows, out_cols = keys // max(cols, 1), keys % max(cols, 1)
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(out_rows, minlength=rows), out=indptr[1:])
    return BSR(indptr, out_cols, (br, bc), (m, n))
