"""Ragged batches: the element mask by brute force, and the BSR cover of it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nbinfer.formats import block_element_mask, bsr_from_mask, bsr_from_ragged, ragged_mask

SETTINGS = settings(max_examples=80, deadline=None)


def mask_by_loops(qo_lens, kv_lens, causal):
    """Each request's [qo_len, kv_len] block placed on the diagonal, one element at a time."""
    out = np.zeros((sum(qo_lens), sum(kv_lens)), dtype=bool)
    q0 = k0 = 0
    for qo_len, kv_len in zip(qo_lens, kv_lens, strict=True):
        for q in range(qo_len):
            for k in range(kv_len):
                out[q0 + q, k0 + k] = (not causal) or k <= q + kv_len - qo_len
        q0, k0 = q0 + qo_len, k0 + kv_len
    return out


ragged_batches = st.integers(0, 6).flatmap(
    lambda b: st.tuples(st.lists(st.integers(0, 9), min_size=b, max_size=b),
                        st.lists(st.integers(0, 12), min_size=b, max_size=b)))


def indptr(lens):
    return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])


@SETTINGS
@given(ragged_batches, st.booleans())
def test_ragged_mask_matches_loops(batch, causal):
    qo_lens, kv_lens = batch
    mask = ragged_mask(indptr(qo_lens), indptr(kv_lens), causal=causal)
    np.testing.assert_array_equal(mask, mask_by_loops(qo_lens, kv_lens, causal))


@SETTINGS
@given(ragged_batches, st.integers(1, 5), st.integers(1, 5), st.booleans())
def test_bsr_from_ragged_covers_exactly_the_mask(batch, br, bc, causal):
    qo, kv = indptr(batch[0]), indptr(batch[1])
    mask = ragged_mask(qo, kv, causal=causal)
    bsr = bsr_from_ragged(qo, kv, (br, bc), causal=causal)
    assert bsr.shape == mask.shape and bsr.block_shape == (br, bc)
    # Covers: every True element lies in a stored block.
    assert not (mask & ~bsr.to_dense_mask()).any()
    # Tight: every stored block holds at least one True element.
    assert block_element_mask(bsr, mask).any(axis=(1, 2)).all()
    # Hence it is the same block set the dense route finds, in the same (sorted) order.
    dense_route = bsr_from_mask(mask, (br, bc))
    np.testing.assert_array_equal(bsr.indptr, dense_route.indptr)
    np.testing.assert_array_equal(bsr.indices, dense_route.indices)


def test_causal_prefill_with_a_cached_prefix():
    # One request: 2 new queries after 3 cached tokens -> kv_len 5, bottom-right aligned.
    mask = ragged_mask([0, 2], [0, 5], causal=True)
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # More queries than keys: the first rows see nothing.
    mask = ragged_mask([0, 3], [0, 2], causal=True)
    np.testing.assert_array_equal(mask, [[0, 0], [1, 0], [1, 1]])
    bsr = bsr_from_ragged([0, 3], [0, 2], (1, 1), causal=True)
    np.testing.assert_array_equal(bsr.indptr, [0, 0, 1, 3])


def test_block_straddling_two_requests_is_stored_once():
    # Requests of 1 query/2 keys and 1 query/2 keys; Br = 2 puts both queries in one block row
    # and Bc = 3 puts key 2 (request 1) in the block column that holds keys 0-1 (request 0).
    bsr = bsr_from_ragged([0, 1, 2], [0, 2, 4], (2, 3))
    np.testing.assert_array_equal(bsr.indptr, [0, 2])
    np.testing.assert_array_equal(bsr.indices, [0, 1])
    elem = block_element_mask(bsr, ragged_mask([0, 1, 2], [0, 2, 4]))
    np.testing.assert_array_equal(elem[0], [[1, 1, 0], [0, 0, 1]])
    np.testing.assert_array_equal(elem[1], [[0, 0, 0], [1, 0, 0]])
