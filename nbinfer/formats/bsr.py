"""The block-sparse row (BSR) matrix: nbinfer's one representation of every KV layout.

Rows are query positions, columns are KV slots in a physical KV pool, and a stored block
``(block row i, block column j)`` means "the queries of block row i read the KV slots of block
column j". A BSR holds indices only: the KV bytes are never copied or reordered.

A paged KV cache is the special case ``Bc = page_size`` (one block column per physical page),
where the last page of a request may be partly filled: ``last_block_len[i]`` records how many
columns of block row ``i``'s last stored block are valid, exactly FlashInfer's ``last_page_len``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_index_array, check_indptr, check_positive_int, check_range


def check_block_shape(block_shape, name: str = "block_shape") -> tuple[int, int]:
    """Validate a ``(Br, Bc)`` pair of positive ints; return it as a tuple of Python ints."""
    try:
        pair = tuple(block_shape)
    except TypeError:
        raise TypeError(f"{name} must be a pair (Br, Bc), got {block_shape!r}") from None
    if len(pair) != 2:
        raise ValueError(f"{name} must be a pair (Br, Bc), got {block_shape!r}")
    return (check_positive_int(f"{name}[0] (Br)", pair[0]),
            check_positive_int(f"{name}[1] (Bc)", pair[1]))


def check_shape(shape, name: str = "shape") -> tuple[int, int]:
    """Validate an ``(M, N)`` pair of non-negative ints; return it as a tuple of Python ints."""
    try:
        pair = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must be a pair (M, N), got {shape!r}") from None
    if len(pair) != 2:
        raise ValueError(f"{name} must be a pair (M, N), got {shape!r}")
    return (check_positive_int(f"{name}[0] (M)", pair[0], minimum=0),
            check_positive_int(f"{name}[1] (N)", pair[1], minimum=0))


def _frozen_copy(arr: np.ndarray) -> np.ndarray:
    # Copy before freezing: as_index_array returns the caller's own array when it is already
    # contiguous int32, and marking that read-only would silently change the caller's data.
    out = np.array(arr, dtype=np.int32, copy=True)
    out.setflags(write=False)
    return out


def _check_no_repeated_block(indptr: np.ndarray, indices: np.ndarray) -> None:
    """A block row may store a block column once: a matrix entry is kept or not, never twice.

    (A kernel visiting the block twice would count its keys twice in the softmax.)
    """
    if indices.size < 2:
        return
    rows = np.repeat(np.arange(indptr.size - 1, dtype=np.int64), np.diff(indptr))
    order = np.lexsort((indices, rows))  # by row, then column; stable, so positions ascend
    same = (rows[order][1:] == rows[order][:-1]) & (indices[order][1:] == indices[order][:-1])
    if np.any(same):
        k = int(np.argmax(same))
        first, second = sorted((int(order[k]), int(order[k + 1])))
        row = int(rows[first])
        raise ValueError(
            f"indices must list each block column at most once per block row, but block row "
            f"{row} stores column {int(indices[first])} twice: indices[{first}] and "
            f"indices[{second}] (indices[{int(indptr[row])}:{int(indptr[row + 1])}] = "
            f"{indices[indptr[row]:indptr[row + 1]].tolist()})")


@dataclass(frozen=True, eq=False)
class BSR:
    """A validated block-sparse row matrix of shape ``(M, N)`` with blocks ``(Br, Bc)``.

    Parameters
    ----------
    indptr : array of int, shape [ceil(M / Br) + 1]
        Block row ``i`` owns ``indices[indptr[i]:indptr[i + 1]]``. Stored as int32.
    indices : array of int, shape [nnz_blocks]
        Block column of each stored block, in ``[0, ceil(N / Bc))``. Order within a row is the
        order in which a kernel visits the blocks (for a page table: logical page order), so it
        need not be sorted; a column may appear in many rows (shared pages) but at most once in
        a row (a ValueError naming ``indices`` otherwise). Stored as int32.
    block_shape : (int, int)
        ``(Br, Bc)``. Any positive sizes, ``(1, 1)`` included.
    shape : (int, int)
        ``(M, N)``; need not be multiples of the block shape (the last block row/column is partial).
    last_block_len : array of int, shape [ceil(M / Br)], optional
        Valid columns in the last stored block of each block row: in ``[1, Bc]`` for a non-empty
        row, in ``[0, Bc]`` (ignored) for an empty one. ``None`` means every stored block is full
        up to the matrix edge ``N``.

    Notes
    -----
    The arrays are copied and made read-only, so a BSR never changes after construction.
    """

    indptr: np.ndarray
    indices: np.ndarray
    block_shape: tuple
    shape: tuple
    last_block_len: np.ndarray | None = None

    def __post_init__(self):
        br, bc = check_block_shape(self.block_shape)
        m, n = check_shape(self.shape)
        rows, cols = -(-m // br), -(-n // bc)
        indices = as_index_array("indices", self.indices)
        indptr = check_indptr("indptr", self.indptr, length=rows + 1, total=indices.size)
        check_range("indices", indices, 0, cols)
        _check_no_repeated_block(indptr, indices)
        last = None
        if self.last_block_len is not None:
            last = as_index_array("last_block_len", self.last_block_len)
            if last.size != rows:
                raise ValueError(
                    f"last_block_len must have length {rows} (block rows), got {last.size}")
            nonempty = np.diff(indptr) > 0
            # Empty rows read nothing, so their entry is ignored; FlashInfer callers put 0 there.
            check_range("last_block_len", np.where(nonempty, last, 1), 1, bc + 1)
            check_range("last_block_len", last, 0, bc + 1)
            last = _frozen_copy(last)
        object.__setattr__(self, "block_shape", (br, bc))
        object.__setattr__(self, "shape", (m, n))
        object.__setattr__(self, "indptr", _frozen_copy(indptr))
        object.__setattr__(self, "indices", _frozen_copy(indices))
        object.__setattr__(self, "last_block_len", last)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_block_rows(self) -> int:
        """``ceil(M / Br)``."""
        return self.indptr.size - 1

    @property
    def num_block_cols(self) -> int:
        """``ceil(N / Bc)``."""
        return -(-self.shape[1] // self.block_shape[1])

    @property
    def nnz_blocks(self) -> int:
        """Number of stored blocks."""
        return int(self.indices.size)

    def row_blocks(self, i: int) -> np.ndarray:
        """Block columns stored in block row ``i`` (int32), in visiting order."""
        i = check_positive_int("i", i, minimum=0)
        if i >= self.num_block_rows:
            raise ValueError(f"i must be < num_block_rows={self.num_block_rows}, got {i}")
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def block_row_ids(self) -> np.ndarray:
        """Block row of every stored block, int64 [nnz_blocks] (the COO row of the CSR)."""
        return np.repeat(np.arange(self.num_block_rows, dtype=np.int64), np.diff(self.indptr))

    def block_col_lens(self) -> np.ndarray:
        """Valid columns of every stored block, int32 [nnz_blocks].

        A block is cut short by the matrix edge ``N`` and, if it is the last block of its row,
        by ``last_block_len``.
        """
        bc = self.block_shape[1]
        lens = np.minimum(bc, self.shape[1] - self.indices.astype(np.int64) * bc).astype(np.int32)
        if self.last_block_len is not None:
            nonempty = np.diff(self.indptr) > 0
            ends = self.indptr[1:][nonempty] - 1
            lens[ends] = np.minimum(lens[ends], self.last_block_len[nonempty])
        return lens

    def row_kv_len(self) -> np.ndarray:
        """Number of valid KV columns each block row reads, int64 [num_block_rows]."""
        csum = np.concatenate([[0], np.cumsum(self.block_col_lens(), dtype=np.int64)])
        return csum[self.indptr[1:]] - csum[self.indptr[:-1]]

    # -- dense views ---------------------------------------------------------------------------
    def to_dense(self) -> np.ndarray:
        """Block occupancy: bool ``[num_block_rows, num_block_cols]``, True where stored."""
        occ = np.zeros((self.num_block_rows, self.num_block_cols), dtype=bool)
        occ[self.block_row_ids(), self.indices] = True
        return occ

    def to_dense_mask(self) -> np.ndarray:
        """Element occupancy: bool ``[M, N]``; a stored block covers its rows and valid columns."""
        br, bc = self.block_shape
        m, n = self.shape
        lens = self.block_col_lens().astype(np.int64)
        # One entry per valid (block, column) pair: the block's row and the element's column.
        owner = np.repeat(np.arange(self.nnz_blocks), lens)
        starts = np.concatenate([[0], np.cumsum(lens)])[:-1]
        offset = np.arange(owner.size) - starts[owner]
        cols = self.indices.astype(np.int64)[owner] * bc + offset
        per_block_row = np.zeros((self.num_block_rows, n), dtype=bool)
        per_block_row[self.block_row_ids()[owner], cols] = True
        # Every row of a block row sees the same columns; the last block row may be partial.
        return np.repeat(per_block_row, br, axis=0)[:m]

    @classmethod
    def from_dense(cls, occupancy, block_shape, shape=None) -> BSR:
        """Build from a block occupancy matrix, storing blocks in increasing column order.

        Parameters
        ----------
        occupancy : array of bool, shape [num_block_rows, num_block_cols]
            True where a block is stored.
        block_shape : (int, int)
            ``(Br, Bc)``.
        shape : (int, int), optional
            ``(M, N)`` with ``ceil(M / Br), ceil(N / Bc)`` equal to ``occupancy.shape``;
            default ``(rows * Br, cols * Bc)``.

        Returns
        -------
        BSR
            Without ``last_block_len`` (every block full up to the matrix edge).
        """
        occ = np.asarray(occupancy)
        if occ.dtype != np.bool_:
            raise TypeError(f"occupancy must be a boolean array, got dtype {occ.dtype}")
        if occ.ndim != 2:
            raise ValueError(f"occupancy must be 2-D, got shape {occ.shape}")
        br, bc = check_block_shape(block_shape)
        if shape is None:
            shape = (occ.shape[0] * br, occ.shape[1] * bc)
        m, n = check_shape(shape)
        grid = (-(-m // br), -(-n // bc))
        if occ.shape != grid:
            raise ValueError(
                f"occupancy must have shape {grid} (ceil(shape / block_shape)), got {occ.shape}")
        rows, cols = np.nonzero(occ)
        indptr = np.zeros(occ.shape[0] + 1, dtype=np.int32)
        np.cumsum(np.bincount(rows, minlength=occ.shape[0]), out=indptr[1:])
        return cls(indptr, cols.astype(np.int32), (br, bc), (m, n))

    def __repr__(self):
        br, bc = self.block_shape
        return (f"BSR(shape={self.shape}, block_shape=({br}, {bc}), "
                f"block_rows={self.num_block_rows}, nnz_blocks={self.nnz_blocks})")
