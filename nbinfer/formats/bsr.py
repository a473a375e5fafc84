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


@dataclass(frozen=True, eq=False)
class BSR:
    """A validated block-sparse row matrix of shape ``(M, N)`` with blocks ``(Br, Bc)``.

    Parameters
    ----------
    indptr : array of int32, shape [ceil(M / Br) + 1]
        Block row ``i`` owns ``indices[indptr[i]:indptr[i + 1]]``.
    indices : array of int32, shape [nnz_blocks]
        Block column of each stored block, in ``[0, ceil(N / Bc))``. Order within a row is the
        order in which a kernel visits the blocks (for a page table: logical page order).
    block_shape : (int, int)
        ``(Br, Bc)``. Any positive sizes, ``(1, 1)`` included.
    shape : (int, int)
        ``(M, N)``; need not be multiples of the block shape (the last block row/column is partial).
    last_block_len : array of int32, shape [ceil(M / Br)], optional
        Valid columns in the last stored block of each non-empty block row, in ``[1, Bc]``.
        ``None`` means every stored block is full (up to the matrix edge ``N``).
    """

    indptr: np.ndarray
    indices: np.ndarray
    block_shape: tuple
    shape: tuple
    last_block_len: np.ndarray | None = None

    def __post_init__(self):
        if len(tuple(self.block_shape)) != 2:
            raise ValueError(f"block_shape must be (Br, Bc), got {self.block_shape!r}")
        if len(tuple(self.shape)) != 2:
            raise ValueError(f"shape must be (M, N), got {self.shape!r}")
        br = check_positive_int("block_shape[0] (Br)", self.block_shape[0])
        bc = check_positive_int("block_shape[1] (Bc)", self.block_shape[1])
        m = check_positive_int("shape[0] (M)", self.shape[0], minimum=0)
        n = check_positive_int("shape[1] (N)", self.shape[1], minimum=0)
        rows = -(-m // br)
        cols = -(-n // bc)
        indices = as_index_array("indices", self.indices)
        indptr = check_indptr("indptr", self.indptr, length=rows + 1, total=indices.size)
        check_range("indices", indices, 0, max(cols, 0) if cols else 0)
        last = None
        if self.last_block_len is not None:
            last = as_index_array("last_block_len", self.last_block_len)
            if last.size != rows:
                raise ValueError(f"last_block_len must have length {rows} (block rows), got {last.size}")
            nonempty = np.diff(indptr) > 0
            check_range("last_block_len", last[nonempty], 1, bc + 1)
        for name, value in (("block_shape", (br, bc)), ("shape", (m, n)), ("indptr", indptr),
                            ("indices", indices), ("last_block_len", last)):
            object.__setattr__(self, name, value)
        for arr in (indptr, indices, last):
            if arr is not None:
                arr.setflags(write=False)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_block_rows(self) -> int:
        return self.indptr.size - 1

    @property
    def num_block_cols(self) -> int:
        return -(-self.shape[1] // self.block_shape[1])

    @property
    def nnz_blocks(self) -> int:
        return int(self.indices.size)

    def row_blocks(self, i: int) -> np.ndarray:
        """Block columns stored in block row ``i``, in visiting order."""
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def block_col_lens(self) -> np.ndarray:
        """Valid columns of every stored block, int32 [nnz_blocks] (partial edge and last blocks)."""
        br, bc = self.block_shape
        lens = np.minimum(bc, self.shape[1] - self.indices.astype(np.int64) * bc).astype(np.int32)
        if self.last_block_len is not None:
            counts = np.diff(self.indptr)
            ends = self.indptr[1:][counts > 0] - 1
            lens[ends] = np.minimum(lens[ends], self.last_block_len[counts > 0])
        return lens

    def row_kv_len(self) -> np.ndarray:
        """Number of valid KV columns each block row reads, int64 [num_block_rows]."""
        csum = np.concatenate([[0], np.cumsum(self.block_col_lens(), dtype=np.int64)])
        return csum[self.indptr[1:]] - csum[self.indptr[:-1]]

    # -- dense views ---------------------------------------------------------------------------
    def to_dense(self) -> np.ndarray:
        """Block occupancy: bool ``[num_block_rows, num_block_cols]``, True where a block is stored."""
        occ = np.zeros((self.num_block_rows, self.num_block_cols), dtype=bool)
        rows = np.repeat(np.arange(self.num_block_rows), np.diff(self.indptr))
        occ[rows, self.indices] = True
        return occ

    def to_dense_mask(self) -> np.ndarray:
        """Element occupancy: bool ``[M, N]``; a stored block covers its rows and valid columns."""
        br, bc = self.block_shape
        m, n = self.shape
        mask = np.zeros((m, n), dtype=bool)
        lens = self.block_col_lens()
        for i in range(self.num_block_rows):
            r0, r1 = i * br, min((i + 1) * br, m)
            for k in range(self.indptr[i], self.indptr[i + 1]):
                c0 = int(self.indices[k]) * bc
                mask[r0:r1, c0:c0 + int(lens[k])] = True
        return mask

    @classmethod
    def from_dense(cls, occupancy, block_shape, shape=None) -> BSR:
        """Build from a block occupancy matrix (bool ``[rows, cols]``), blocks in column order."""
        occ = np.asarray(occupancy)
        if occ.ndim != 2:
            raise ValueError(f"occupancy must be 2-D, got shape {occ.shape}")
        br, bc = block_shape
        if shape is None:
            shape = (occ.shape[0] * br, occ.shape[1] * bc)
        rows, cols = np.nonzero(occ)
        indptr = np.zeros(occ.shape[0] + 1, dtype=np.int32)
        np.cumsum(np.bincount(rows, minlength=occ.shape[0]), out=indptr[1:])
        return cls(indptr, cols.astype(np.int32), (br, bc), tuple(shape))

    def __repr__(self):
        br, bc = self.block_shape
        return (f"BSR(shape={self.shape}, block_shape=({br}, {bc}), "
                f"block_rows={self.num_block_rows}, nnz_blocks={self.nnz_blocks})")
