"""PageTable: lengths, token slots, the lossless PageTable <-> BSR round trip, allocation."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nbinfer.formats import BSR, PageTable

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def page_tables(draw):
    """Random page tables: page sizes 1..17, permuted ids, pages shared across requests."""
    page_size = draw(st.integers(1, 17))
    num_pages = draw(st.integers(0, 12))
    batch = draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    counts = [draw(st.integers(0, num_pages)) for _ in range(batch)]
    # Distinct pages within a request, but any page may appear in several requests.
    indices = [rng.permutation(num_pages)[:k] for k in counts]
    last = [int(rng.integers(1, page_size + 1)) if k else 0 for k in counts]
    indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    flat = np.concatenate(indices) if indices else np.zeros(0, np.int64)
    return PageTable(indptr, flat, np.array(last, dtype=np.int64), page_size, num_pages)


@SETTINGS
@given(page_tables(), st.integers(1, 5))
def test_bsr_round_trip_loses_nothing(table, rows_per_request):
    bsr = table.to_bsr(rows_per_request)
    assert bsr.block_shape == (rows_per_request, table.page_size)
    assert bsr.shape == (table.batch_size * rows_per_request, table.num_pages * table.page_size)
    back = PageTable.from_bsr(bsr)
    for name in ("indptr", "indices", "last_page_len"):
        np.testing.assert_array_equal(getattr(back, name), getattr(table, name), err_msg=name)
        assert getattr(back, name).dtype == np.int32
    assert (back.page_size, back.num_pages) == (table.page_size, table.num_pages)


@SETTINGS
@given(page_tables(), st.integers(1, 3))
def test_bsr_element_mask_is_the_token_slots(table, rows_per_request):
    mask = table.to_bsr(rows_per_request).to_dense_mask()
    kv_lens = table.kv_lens()
    for b in range(table.batch_size):
        slots = table.token_slots(b)
        assert slots.dtype == np.int64 and slots.size == kv_lens[b]
        assert np.unique(slots).size == slots.size  # no slot read twice
        want = np.zeros(mask.shape[1], dtype=bool)
        want[slots] = True
        for r in range(b * rows_per_request, (b + 1) * rows_per_request):
            assert mask[r].sum() == kv_lens[b]
            np.testing.assert_array_equal(mask[r], want)
    np.testing.assert_array_equal(table.to_bsr().row_kv_len(), kv_lens)


def test_kv_lens_and_slots_by_hand():
    # Request 0: pages 7, 2 with 3 tokens on the last -> 4 + 3 = 7 tokens; request 1: empty;
    # request 2: page 2 again (shared), full.
    table = PageTable([0, 2, 2, 3], [7, 2, 2], [3, 0, 4], page_size=4, num_pages=8)
    np.testing.assert_array_equal(table.kv_lens(), [7, 0, 4])
    np.testing.assert_array_equal(table.token_slots(0), [28, 29, 30, 31, 8, 9, 10])
    assert table.token_slots(1).size == 0
    np.testing.assert_array_equal(table.token_slots(2), [8, 9, 10, 11])
    np.testing.assert_array_equal(table.num_pages_per_request(), [2, 0, 1])
    assert table.batch_size == 3


@SETTINGS
@given(st.lists(st.integers(0, 40), max_size=8), st.integers(1, 17), st.integers(0, 5),
       st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_from_kv_lens(kv_lens, page_size, spare, seed):
    needed = sum(-(-n // page_size) for n in kv_lens)
    table = PageTable.from_kv_lens(kv_lens, page_size, num_pages=needed + spare, rng=seed)
    np.testing.assert_array_equal(table.kv_lens(), kv_lens)
    assert table.num_pages == needed + spare and table.indices.size == needed
    assert np.unique(table.indices).size == needed  # fresh pages are never shared
    if seed is None:
        np.testing.assert_array_equal(table.indices, np.arange(needed))
    # Contiguous tables store each request's tokens back to back.
    if seed is None and page_size == 1:
        np.testing.assert_array_equal(
            np.concatenate([table.token_slots(b) for b in range(len(kv_lens))] or [[]]),
            np.arange(sum(kv_lens)))


def test_from_kv_lens_defaults_and_generator():
    table = PageTable.from_kv_lens(np.array([5, 0, 8]), 4)
    assert table.num_pages == 4
    np.testing.assert_array_equal(table.indptr, [0, 2, 2, 4])
    np.testing.assert_array_equal(table.last_page_len, [1, 0, 4])
    gen = np.random.default_rng(0)
    shuffled = PageTable.from_kv_lens([16] * 4, 2, num_pages=40, rng=gen)
    assert shuffled.indices.max() < 40 and np.unique(shuffled.indices).size == 32
    assert not np.array_equal(shuffled.indices, np.arange(32))


def test_from_bsr_accepts_a_hand_made_bsr():
    bsr = BSR([0, 1, 3], [4, 0, 1], (1, 3), (2, 15), last_block_len=[2, 3])
    table = PageTable.from_bsr(bsr)
    assert (table.page_size, table.num_pages) == (3, 5)
    np.testing.assert_array_equal(table.kv_lens(), [2, 6])
    np.testing.assert_array_equal(table.token_slots(0), [12, 13])
