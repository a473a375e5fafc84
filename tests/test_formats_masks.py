"""Element masks, their BSR cover, per-block masks, and FlashInfer's packed-bit layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbinfer.formats import (
    BSR,
    PageTable,
    block_element_mask,
    bsr_from_mask,
    causal_bsr,
    causal_mask,
    packbits,
    ragged_mask,
    segment_packbits,
    segment_unpackbits,
    sliding_window_mask,
    unpackbits,
)

SETTINGS = settings(max_examples=60, deadline=None)
seeds = st.integers(0, 2**32 - 1)


def random_mask(seed, m, n):
    rng = np.random.default_rng(seed)
    return rng.random((m, n)) < rng.choice([0.02, 0.2, 0.7])


@pytest.mark.parametrize("m,n", [(1, 1), (4, 4), (3, 7), (7, 3), (0, 5), (5, 0)])
def test_causal_and_window_masks_by_definition(m, n):
    i, j = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
    np.testing.assert_array_equal(causal_mask(m, n), j <= i + n - m)
    for w in (0, 1, 3):
        np.testing.assert_array_equal(sliding_window_mask(m, n, w), j >= i + n - m - w)


def test_square_causal_window_keeps_window_plus_one_keys():
    assert np.array_equal(causal_mask(5, 5), np.tri(5, dtype=bool))
    both = causal_mask(6, 6) & sliding_window_mask(6, 6, 2)
    np.testing.assert_array_equal(both.sum(axis=1), [1, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(np.nonzero(both[5])[0], [3, 4, 5])


def test_causal_bsr_is_block_lower_triangular():
    bsr = causal_bsr(8, 8, (4, 4))
    np.testing.assert_array_equal(bsr.to_dense(), [[1, 0], [1, 1]])
    # Bottom-right alignment with extra KV: 2 queries after 6 cached keys see every block.
    assert causal_bsr(2, 8, (2, 4)).to_dense().all()


@SETTINGS
@given(seeds, st.integers(0, 13), st.integers(0, 13), st.integers(1, 5), st.integers(1, 5))
def test_bsr_from_mask_stores_exactly_the_nonempty_blocks(seed, m, n, br, bc):
    mask = random_mask(seed, m, n)
    bsr = bsr_from_mask(mask, (br, bc))
    assert bsr.shape == (m, n) and bsr.last_block_len is None
    assert not (mask & ~bsr.to_dense_mask()).any()
    elem = block_element_mask(bsr, mask)
    assert elem.shape == (bsr.nnz_blocks, br, bc)
    assert elem.any(axis=(1, 2)).all()
    assert elem.sum() == mask.sum()  # each True element sits in exactly one stored block
    # Scattering the per-block masks back rebuilds the element mask.
    rebuilt = np.zeros((bsr.num_block_rows * br, bsr.num_block_cols * bc), dtype=bool)
    for k, i in enumerate(bsr.block_row_ids()):
        j = bsr.indices[k]
        rebuilt[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = elem[k]
    np.testing.assert_array_equal(rebuilt[:m, :n], mask)


def test_block_element_mask_clips_the_matrix_edge_and_last_page():
    # A 1 x 10 all-True mask over pages of 4 slots: page 2 is cut by the edge (2 valid columns)
    # and page 0, the row's last page, holds 3 tokens.
    bsr = BSR([0, 2], [2, 0], (1, 4), (1, 10), last_block_len=[3])
    elem = block_element_mask(bsr, np.ones((1, 10), dtype=bool))
    np.testing.assert_array_equal(elem[:, 0, :], [[1, 1, 0, 0], [1, 1, 1, 0]])
    # A page table's own element mask, cut into blocks, is all True up to each page's fill.
    table = PageTable.from_kv_lens([5, 3], 4, num_pages=6, rng=3)
    pbsr = table.to_bsr()
    elem = block_element_mask(pbsr, pbsr.to_dense_mask())
    np.testing.assert_array_equal(elem.sum(axis=(1, 2)), pbsr.block_col_lens())


def test_packbits_known_bytes():
    bits = np.array([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=bool)
    np.testing.assert_array_equal(packbits(bits), [0x81, 0x80])
    np.testing.assert_array_equal(packbits(bits, bitorder="little"), [0x81, 0x01])
    assert packbits(np.zeros(0, dtype=bool)).size == 0


@SETTINGS
@given(seeds, st.integers(0, 50), st.sampled_from(["big", "little"]))
def test_packbits_round_trip(seed, n, bitorder):
    x = np.random.default_rng(seed).random(n) < 0.5
    packed = packbits(x, bitorder=bitorder)
    assert packed.dtype == np.uint8 and packed.size == -(-n // 8)
    np.testing.assert_array_equal(unpackbits(packed, n, bitorder=bitorder), x)


@SETTINGS
@given(seeds, st.lists(st.integers(0, 30), max_size=6), st.sampled_from(["big", "little"]))
def test_segment_packbits_layout_and_round_trip(seed, lens, bitorder):
    x = np.random.default_rng(seed).random(sum(lens)) < 0.5
    seg = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    packed, packed_indptr = segment_packbits(x, seg, bitorder=bitorder)
    # FlashInfer's layout: each segment starts on a fresh byte and takes ceil(len / 8) bytes.
    np.testing.assert_array_equal(np.diff(packed_indptr), [-(-n // 8) for n in lens])
    for i, n in enumerate(lens):
        np.testing.assert_array_equal(packed[packed_indptr[i]:packed_indptr[i + 1]],
                                      np.packbits(x[seg[i]:seg[i] + n], bitorder=bitorder))
    np.testing.assert_array_equal(
        segment_unpackbits(packed, packed_indptr, lens, bitorder=bitorder), x)


def test_segment_packbits_of_a_ragged_custom_mask():
    # FlashInfer's custom_mask: each request's [qo_len, kv_len] mask flattened row-major, then
    # packed per request. Unpacking and reshaping gives back the diagonal blocks.
    qo_lens, kv_lens = [2, 3, 1], [5, 3, 9]
    qo, kv = np.cumsum([0] + qo_lens), np.cumsum([0] + kv_lens)
    full = ragged_mask(qo, kv, causal=True)
    blocks = [full[qo[b]:qo[b + 1], kv[b]:kv[b + 1]] for b in range(3)]
    sizes = [q * k for q, k in zip(qo_lens, kv_lens, strict=True)]
    flat = np.concatenate([blk.ravel() for blk in blocks])
    packed, packed_indptr = segment_packbits(flat, np.cumsum([0] + sizes), bitorder="little")
    np.testing.assert_array_equal(packed_indptr, [0, 2, 4, 6])
    out = segment_unpackbits(packed, packed_indptr, sizes, bitorder="little")
    starts = np.cumsum([0] + sizes)
    for b in range(3):
        np.testing.assert_array_equal(
            out[starts[b]:starts[b + 1]].reshape(qo_lens[b], kv_lens[b]), causal_mask(
                qo_lens[b], kv_lens[b]))
