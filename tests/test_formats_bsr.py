"""BSR: the paper's Figure 2 example, dense views against brute force, round trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbinfer.formats import BSR, PageTable

SETTINGS = settings(max_examples=60, deadline=None)


def dense_mask_by_loops(bsr: BSR) -> np.ndarray:
    """The element occupancy written as the obvious loops, independent of BSR.to_dense_mask."""
    (m, n), (br, bc) = bsr.shape, bsr.block_shape
    out = np.zeros((m, n), dtype=bool)
    for i in range(bsr.num_block_rows):
        start, end = int(bsr.indptr[i]), int(bsr.indptr[i + 1])
        for k in range(start, end):
            width = bc
            if bsr.last_block_len is not None and k == end - 1:
                width = int(bsr.last_block_len[i])
            for r in range(i * br, min((i + 1) * br, m)):
                for c in range(int(bsr.indices[k]) * bc, int(bsr.indices[k]) * bc + width):
                    if c < n:
                        out[r, c] = True
    return out


@st.composite
def bsrs(draw, with_last=None):
    """Random BSRs: partial edge blocks, unsorted rows, optional last_block_len."""
    br, bc = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    m, n = draw(st.integers(0, 20)), draw(st.integers(0, 20))
    rows, cols = -(-m // br), -(-n // bc)
    counts = [draw(st.integers(0, cols)) for _ in range(rows)]
    indices = [c for k in counts for c in draw(st.permutations(range(cols)))[:k]]
    indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    use_last = draw(st.booleans()) if with_last is None else with_last
    last = None
    if use_last:
        last = np.array([draw(st.integers(1, bc)) if k else 0 for k in counts], dtype=np.int64)
    return BSR(indptr, np.array(indices, dtype=np.int64), (br, bc), (m, n), last_block_len=last)


def test_figure2_index_arrays_give_the_drawn_occupancy():
    # Seed section V.1: tile 0 reads pages P3, P5, P1 and tile 1 reads P2, P4; Br = 4, Bc = 1.
    bsr = BSR([0, 3, 5], [3, 5, 1, 2, 4], (4, 1), (8, 6))
    expected = np.array([[0, 1, 0, 1, 0, 1],
                         [0, 0, 1, 0, 1, 0]], dtype=bool)
    np.testing.assert_array_equal(bsr.to_dense(), expected)
    assert bsr.nnz_blocks == 5 and bsr.num_block_rows == 2 and bsr.num_block_cols == 6
    # Logical order is kept: the kernel visits P3 -> P5 -> P1, not sorted.
    np.testing.assert_array_equal(bsr.row_blocks(0), [3, 5, 1])
    # All four query rows of a tile read the same three KV slots.
    np.testing.assert_array_equal(bsr.to_dense_mask(), np.repeat(expected, 4, axis=0))
    np.testing.assert_array_equal(bsr.row_kv_len(), [3, 2])
    # The same arrays as a page table of one-token pages.
    table = PageTable([0, 3, 5], [3, 5, 1, 2, 4], [1, 1], page_size=1, num_pages=6)
    np.testing.assert_array_equal(table.to_bsr(rows_per_request=4).to_dense(), expected)
    np.testing.assert_array_equal(table.token_slots(0), [3, 5, 1])
    np.testing.assert_array_equal(table.kv_lens(), [3, 2])


def test_partial_edge_and_last_block_lengths():
    # N = 10 with Bc = 4: block column 2 holds only 2 columns; row 0's last block holds 3.
    bsr = BSR([0, 2, 3], [2, 0, 2], (2, 4), (3, 10), last_block_len=[3, 4])
    np.testing.assert_array_equal(bsr.block_col_lens(), [2, 3, 2])
    np.testing.assert_array_equal(bsr.row_kv_len(), [5, 2])
    mask = bsr.to_dense_mask()
    assert mask.shape == (3, 10)
    np.testing.assert_array_equal(mask[0], [1, 1, 1, 0, 0, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(mask[2], [0] * 8 + [1, 1])


def test_empty_matrices():
    bsr = BSR([0], [], (3, 2), (0, 0))
    assert bsr.to_dense().shape == (0, 0) and bsr.to_dense_mask().shape == (0, 0)
    bsr = BSR([0, 0, 0], np.zeros(0, np.int32), (2, 2), (4, 0), last_block_len=[0, 0])
    assert not bsr.to_dense_mask().any() and bsr.row_kv_len().tolist() == [0, 0]


def test_a_block_row_stores_a_column_once():
    # Unsorted columns within a row and one column in many rows (shared pages) are fine ...
    bsr = BSR([0, 3, 5], [2, 0, 1, 0, 2], (1, 1), (2, 3))
    np.testing.assert_array_equal(bsr.row_blocks(0), [2, 0, 1])
    # ... a column twice in one row is not (a kernel would count those keys twice).
    with pytest.raises(ValueError, match=r"^indices must list each block column at most once "
                                         r"per block row, but block row 1 stores column 0 twice: "
                                         r"indices\[3\] and indices\[5\]"):
        BSR([0, 3, 6], [2, 0, 1, 0, 2, 0], (1, 1), (2, 3))
    with pytest.raises(ValueError, match=r"block row 0 stores column 4 twice: indices\[0\] and "
                                         r"indices\[1\] \(indices\[0:2\] = \[4, 4\]\)"):
        BSR([0, 2], [4, 4], (2, 3), (2, 15), last_block_len=[2])
    # Every consumer that builds a BSR gets the check: a page table listing a page twice in one
    # request cannot become a BSR.
    table = PageTable([0, 2], [1, 1], [3], page_size=4, num_pages=2)
    with pytest.raises(ValueError, match="indices"):
        table.to_bsr()


def test_arrays_are_copied_and_frozen():
    indptr = np.array([0, 1], dtype=np.int32)
    indices = np.array([0], dtype=np.int32)
    bsr = BSR(indptr, indices, (1, 1), (1, 1))
    assert indptr.flags.writeable and indices.flags.writeable  # the caller's arrays untouched
    indptr[1] = 0
    assert bsr.indptr[1] == 1
    with pytest.raises(ValueError):
        bsr.indices[0] = 0
    assert bsr.indptr.dtype == np.int32 and bsr.indices.dtype == np.int32


@SETTINGS
@given(bsrs())
def test_dense_mask_matches_loops(bsr):
    np.testing.assert_array_equal(bsr.to_dense_mask(), dense_mask_by_loops(bsr))
    np.testing.assert_array_equal(bsr.to_dense_mask().sum(axis=1),
                                  np.repeat(bsr.row_kv_len(), bsr.block_shape[0])[:bsr.shape[0]])


@SETTINGS
@given(bsrs(with_last=False))
def test_from_dense_round_trip(bsr):
    occ = bsr.to_dense()
    again = BSR.from_dense(occ, bsr.block_shape, bsr.shape)
    np.testing.assert_array_equal(again.to_dense(), occ)
    assert again.shape == bsr.shape and again.block_shape == bsr.block_shape
    # from_dense stores columns sorted; that is the only thing it changes.
    for i in range(bsr.num_block_rows):
        np.testing.assert_array_equal(again.row_blocks(i), np.sort(bsr.row_blocks(i)))
    # And a sorted BSR survives the trip unchanged, array for array.
    twice = BSR.from_dense(again.to_dense(), again.block_shape, again.shape)
    np.testing.assert_array_equal(twice.indptr, again.indptr)
    np.testing.assert_array_equal(twice.indices, again.indices)


@SETTINGS
@given(st.integers(0, 6), st.integers(0, 6), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 2**32 - 1))
def test_from_dense_default_shape(rows, cols, br, bc, seed):
    occ = np.random.default_rng(seed).random((rows, cols)) < 0.4
    bsr = BSR.from_dense(occ, (br, bc))
    assert bsr.shape == (rows * br, cols * bc)
    np.testing.assert_array_equal(bsr.to_dense(), occ)
    assert bsr.nnz_blocks == occ.sum()
