"""append_paged_kv_cache and get_batch_indices_positions against simple loops."""

from __future__ import annotations

import numpy as np
import pytest
from dense import cache_token, random_paged_cache

from nbinfer.reference import (
    append_paged_kv_cache,
    batch_decode_with_paged_kv_cache,
    get_batch_indices_positions,
)

HKV, D = 2, 4


def _loop_batch_indices_positions(append_indptr, seq_lens):
    bi, pos = [], []
    for b in range(len(seq_lens)):
        n = append_indptr[b + 1] - append_indptr[b]
        for j in range(n):
            bi.append(b)
            pos.append(seq_lens[b] - n + j)
    return np.array(bi, dtype=np.int32), np.array(pos, dtype=np.int32)


def test_get_batch_indices_positions(rng):
    append_lens = rng.integers(0, 6, size=5)
    seq_lens = append_lens + rng.integers(0, 10, size=5)
    append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
    bi, pos = get_batch_indices_positions(append_indptr, seq_lens, int(append_indptr[-1]))
    want_bi, want_pos = _loop_batch_indices_positions(append_indptr, seq_lens)
    assert bi.dtype == np.int32 and pos.dtype == np.int32
    np.testing.assert_array_equal(bi, want_bi)
    np.testing.assert_array_equal(pos, want_pos)


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_append_matches_loop(rng, page_size, layout, as_tuple):
    old_lens = np.array([0, 3, int(rng.integers(1, 20)), 7])
    append_lens = np.array([2, 0, int(rng.integers(1, 9)), 1])
    new_lens = old_lens + append_lens
    cache, indptr, indices, last = random_paged_cache(rng, list(new_lens), page_size, HKV, D,
                                                      kv_layout=layout, as_tuple=as_tuple,
                                                      dtype=np.float32)
    before = tuple(c.copy() for c in cache) if as_tuple else cache.copy()
    append_indptr = np.concatenate([[0], np.cumsum(append_lens)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    key = rng.standard_normal((nnz, HKV, D))
    value = rng.standard_normal((nnz, HKV, D))
    bi, pos = get_batch_indices_positions(append_indptr, new_lens, nnz)
    append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last, kv_layout=layout)

    # Simple loop: where each token must land, and that nothing else changed.
    expected = tuple(c.copy() for c in before) if as_tuple else before.copy()
    for t in range(nnz):
        b, p = int(bi[t]), int(pos[t])
        page = int(indices[indptr[b] + p // page_size])
        k_slot, v_slot = cache_token(expected, layout, page, p % page_size)
        k_slot[...] = key[t]
        v_slot[...] = value[t]
    got = cache if as_tuple else (cache,)
    want = expected if as_tuple else (expected,)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


def test_append_then_decode_sees_new_token(rng):
    # Decode right after appending one token per request reads exactly the appended key/value.
    page_size, lens = 4, np.array([1, 5, 8])
    cache, indptr, indices, last = random_paged_cache(rng, list(lens), page_size, HKV, D)
    key = rng.standard_normal((3, HKV, D)) * 50  # dominates every logit of the query below
    value = rng.standard_normal((3, HKV, D))
    bi, pos = get_batch_indices_positions(np.arange(4), lens, 3)
    append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
    q = np.repeat(key[:, :1], 2, axis=1)  # 2 qo heads per kv head 0; aligned with the new key
    q = np.concatenate([q, np.repeat(key[:, 1:], 2, axis=1)], axis=1)
    o = batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last, sm_scale=1.0)
    np.testing.assert_allclose(o[:, 0], value[:, 0], atol=1e-8)
    np.testing.assert_allclose(o[:, 3], value[:, 1], atol=1e-8)
