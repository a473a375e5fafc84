"""Partial rows and the reduction map: which partial states merge into which output row.

A query tile whose KV range is cut into ``n > 1`` chunks writes partial states instead of its
output. Chunk ``c`` of a tile with ``r`` query rows owns the ``r`` consecutive partial rows
``base + c * r .. base + c * r + r - 1`` (one partial row holds every query head of one query row,
so the work items of all KV heads of that chunk share them, each writing its own head group).
Output row ``j`` of the tile then merges partial rows ``base + j, base + r + j, base + 2 r + j ...``:
increasing chunk index, hence increasing ``kv_start``, which is the fixed merge order that makes
the result bitwise reproducible.

Everything is vectorised: no Python loop over tiles or rows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["assign_partials", "reduction_map"]


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def assign_partials(rows: np.ndarray, nchunks: np.ndarray) -> tuple[np.ndarray, int]:
    """First partial row of every split tile.

    Parameters
    ----------
    rows : ndarray [T], int64
        Query rows of each tile (``qo_end - qo_start``).
    nchunks : ndarray [T], int64
        KV chunks of each tile (``>= 1``).

    Returns
    -------
    base : ndarray [T], int64
        First partial row of the tile, ``-1`` for a tile of one chunk (it writes its output
        directly and needs no partial rows).
    num_partials : int
        Total partial rows (``sum(rows * nchunks)`` over split tiles).
    """
    split = nchunks > 1
    need = np.where(split, rows * nchunks, 0)
    start = _exclusive_cumsum(need)
    base = np.where(split, start[:-1], -1)
    return base, int(start[-1])


def reduction_map(out_row0: np.ndarray, rows: np.ndarray, nchunks: np.ndarray,
                  base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The index map that contracts partial rows into output rows.

    Parameters
    ----------
    out_row0 : ndarray [T], int64
        Global output row of each tile's first query row (``qo_indptr[b] + qo_start``).
    rows, nchunks : ndarray [T], int64
        Query rows and KV chunks of each tile.
    base : ndarray [T], int64
        First partial row of each tile, ``-1`` when the tile is not split
        (from :func:`assign_partials`).

    Returns
    -------
    merge_rows : ndarray [M], int32
        Output row (global query row) produced by each merge list, in increasing order.
    merge_indptr : ndarray [M + 1], int32
        Merge list ``i`` is ``merge_indices[merge_indptr[i]:merge_indptr[i + 1]]``.
    merge_indices : ndarray [nnz], int32
        Partial rows, in increasing ``kv_start`` order within each list.
    """
    split = np.flatnonzero(base >= 0)
    r, n, b0, o0 = rows[split], nchunks[split], base[split], out_row0[split]
    # One merge list per query row of a split tile: expand tiles to rows.
    row_tile = np.repeat(np.arange(split.size), r)
    row_start = _exclusive_cumsum(r)
    j = np.arange(row_tile.size) - row_start[row_tile]  # row offset inside its tile
    merge_rows = o0[row_tile] + j
    row_len = n[row_tile]
    merge_indptr = _exclusive_cumsum(row_len)
    # Expand rows to entries: entry c of row j of a tile is partial row base + c * r + j.
    entry_row = np.repeat(np.arange(row_tile.size), row_len)
    c = np.arange(entry_row.size) - merge_indptr[entry_row]
    entry_tile = row_tile[entry_row]
    merge_indices = b0[entry_tile] + c * r[entry_tile] + j[entry_row]
    return (merge_rows.astype(np.int32), merge_indptr.astype(np.int32),
            merge_indices.astype(np.int32))
