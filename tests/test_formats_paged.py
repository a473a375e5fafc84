"""PageTable: lengths, token slots, the lossless PageTable <-> BSR round trip, allocation, and
check_page_table (any integer dtype, range checks before narrowing, FlashInfer's cut of indices)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbinfer.formats import BSR, PageTable, check_page_table

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


# ---------------------------------------------------------------------------------------------
# check_page_table: the one validator of FlashInfer-style page tables (api and formats)

# Request 0: pages 7, 2 (3 tokens on the last); request 1: none; request 2: page 2 again, full.
PTR, IND, LAST = [0, 2, 2, 3], [7, 2, 2], [3, 0, 4]


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64])
def test_check_page_table_takes_any_integer_dtype(dtype):
    ptr, ind, last, kv_lens = check_page_table(np.array(PTR, dtype), np.array(IND, dtype),
                                               np.array(LAST, dtype), 4, num_pages=8)
    for arr, want in ((ptr, PTR), (ind, IND), (last, LAST)):
        assert arr.dtype == np.int32
        np.testing.assert_array_equal(arr, want)
    assert kv_lens.dtype == np.int64
    np.testing.assert_array_equal(kv_lens, [7, 0, 4])  # 0 for the request without pages
    # Python lists too, and num_pages is optional.
    np.testing.assert_array_equal(check_page_table(PTR, IND, LAST, 4)[3], [7, 0, 4])


def test_check_page_table_reads_only_indptr_end_page_ids():
    # FlashInfer reads kv_indices[:kv_indptr[-1]]: a longer (preallocated) buffer is fine ...
    buffer = np.array(IND + [99, -5, 2**40], dtype=np.int64)  # the tail is never checked
    _, ind, _, _ = check_page_table(PTR, buffer, LAST, 4, num_pages=8)
    np.testing.assert_array_equal(ind, IND)
    table = PageTable(PTR, buffer, LAST, page_size=4, num_pages=8)
    np.testing.assert_array_equal(table.indices, IND)
    # ... a shorter one is an error naming indices.
    with pytest.raises(ValueError, match=r"^indices must have at least indptr\[-1\]=3 entries"):
        check_page_table(PTR, IND[:2], LAST, 4)
    with pytest.raises(ValueError, match=r"^kv_indices must have at least kv_indptr\[-1\]=3"):
        check_page_table(PTR, [], LAST, 4, names=("kv_indptr", "kv_indices", "kv_last_page_len"))


WIDE = 2**32 + 1  # wraps to 1 in int32: must raise, never become page 1


@pytest.mark.parametrize("args, kw, match", [
    ((PTR, [7, WIDE, 2], LAST, 4), {}, r"indices values must lie in \[0, 2147483648\), "
                                       r"got indices\[1\]=4294967297"),
    ((PTR, [7, WIDE, 2], LAST, 4), {"num_pages": 8}, r"indices values must lie in \[0, 8\), "
                                                     r"got indices\[1\]=4294967297"),
    ((PTR, [7, -WIDE, 2], LAST, 4), {}, r"indices values must lie in \[0, 2147483648\)"),
    ((PTR, np.array([7, 2**63 + 1, 2], np.uint64), LAST, 4), {}, r"indices\[1\]=9223372036854775809"),
    (([0, 2, WIDE + 1, 3], IND, LAST, 4), {}, r"indptr has values outside the int32 range"),
    (([0, 2, 2, 3], IND, [3, 0, WIDE + 2], 4), {}, r"last_page_len values must lie in \[1, 5\) "
                                                   r"for a request with pages"),
    (([0, 2, 2, 3], IND, [WIDE + 2, 0, 4], 4), {}, r"last_page_len\[0\]=4294967299"),
    (([0, 2, 2, 3], IND, [3, WIDE - 1, 4], 4), {}, r"last_page_len values must lie in \[0, 5\) "
                                                   r"for a request without pages"),
])
def test_check_page_table_range_checks_before_narrowing(args, kw, match):
    arrays = [np.asarray(a, dtype=np.int64) if not isinstance(a, np.ndarray) else a
              for a in args[:3]]
    with pytest.raises(ValueError, match=match):
        check_page_table(*arrays, args[3], **kw)


@pytest.mark.parametrize("change, error, match", [
    ({"indptr": [1, 2, 2, 3]}, ValueError, r"^kv_indptr\[0\] must be 0, got 1"),
    ({"indptr": [0, 3, 2, 3]}, ValueError, r"^kv_indptr must be non-decreasing"),
    ({"indptr": []}, ValueError, r"^kv_indptr must have at least one entry"),
    ({"indptr": [[0, 2, 2, 3]]}, ValueError, r"^kv_indptr must have 1 dimension"),
    ({"indptr": np.array(PTR, float)}, TypeError, r"^kv_indptr must be an integer array"),
    ({"indices": np.array(IND, float)}, TypeError, r"^kv_indices must be an integer array"),
    ({"indices": np.array(IND, bool)}, TypeError, r"^kv_indices must be an integer array"),
    # NumPy counts timedelta64 among its integer types; page ids are never durations
    ({"indices": np.array(IND, "m8[s]")}, TypeError, r"^kv_indices must be an integer array"),
    ({"last": np.array(LAST, np.float32)}, TypeError,
     r"^kv_last_page_len must be an integer array"),
    ({"last": [3, 0]}, ValueError, r"^kv_last_page_len must have length 3 \(batch size"),
    ({"indices": [7, 8, 2]}, ValueError, r"^kv_indices values must lie in \[0, 8\), "
                                         r"got kv_indices\[1\]=8"),
    ({"last": [0, 0, 4]}, ValueError, r"^kv_last_page_len values must lie in \[1, 5\).*"
                                      r"got kv_last_page_len\[0\]=0"),
    ({"page_size": 0}, ValueError, r"^page_size must be >= 1"),
    ({"page_size": 4.0}, TypeError, r"^page_size must be an int"),
    ({"num_pages": -1}, ValueError, r"^num_pages must be >= 0"),
])
def test_check_page_table_errors_name_the_argument(change, error, match):
    kw = {"indptr": PTR, "indices": IND, "last": LAST, "page_size": 4, "num_pages": 8, **change}
    with pytest.raises(error, match=match):
        check_page_table(kw["indptr"], kw["indices"], kw["last"], kw["page_size"],
                         num_pages=kw["num_pages"],
                         names=("kv_indptr", "kv_indices", "kv_last_page_len"))


def test_check_page_table_empty_batch_and_names_validated():
    ptr, ind, last, kv_lens = check_page_table([0], [], [], 16)
    assert ptr.tolist() == [0] and ind.size == last.size == kv_lens.size == 0
    with pytest.raises(TypeError, match="names"):
        check_page_table(PTR, IND, LAST, 4, names=("a", "b"))


def test_page_table_uses_the_validator():
    # PageTable takes any integer dtype, checks before narrowing, stores read-only int32.
    table = PageTable(np.array(PTR, np.uint32), np.array(IND, np.int64), np.array(LAST, np.uint8),
                      page_size=4, num_pages=8)
    assert all(a.dtype == np.int32 and not a.flags.writeable
               for a in (table.indptr, table.indices, table.last_page_len))
    np.testing.assert_array_equal(table.kv_lens(), [7, 0, 4])
    with pytest.raises(ValueError, match=r"indices values must lie in \[0, 8\)"):
        PageTable(PTR, np.array([7, WIDE, 2], np.int64), LAST, page_size=4, num_pages=8)
