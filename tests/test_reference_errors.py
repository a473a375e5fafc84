"""Bad input raises ValueError/TypeError naming the argument, before any work is done."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nbinfer import reference as R

P, PAGE, HKV, D = 6, 4, 2, 8
_gen = np.random.default_rng(0)  # fixed data: these tests only check validation
CACHE = _gen.standard_normal((P, 2, PAGE, HKV, D))
IND = np.array([0, 2, 3, 5], dtype=np.int32)
PTR = np.array([0, 1, 4], dtype=np.int32)
LAST = np.array([3, 2], dtype=np.int32)
QD = _gen.standard_normal((2, 4, D))  # decode: [batch, Hq, D]
QP = _gen.standard_normal((5, 4, D))  # prefill: [nnz_qo, Hq, D]
QO = np.array([0, 2, 5], dtype=np.int32)
K = _gen.standard_normal((7, HKV, D))


def decode(**kw):
    args = dict(q=QD, paged_kv_cache=CACHE, kv_indptr=PTR, kv_indices=IND, kv_last_page_len=LAST)
    args.update(kw)
    return lambda: R.batch_decode_with_paged_kv_cache(**args)


def prefill(**kw):
    args = dict(q=QP, qo_indptr=QO, paged_kv_cache=CACHE, kv_indptr=PTR, kv_indices=IND,
                kv_last_page_len=LAST)
    args.update(kw)
    return lambda: R.batch_prefill_with_paged_kv_cache(**args)


def single(**kw):
    args = dict(q=QP, k=K, v=K)
    args.update(kw)
    return lambda: R.single_prefill_with_kv_cache(**args)


def sparse(**kw):
    args = dict(q=QP, k=K, v=K, indptr=np.array([0, 1, 3]), indices=np.array([0, 0, 1]), R=4,
                C=4)
    args.update(kw)
    return lambda: R.block_sparse_attention(**args)


def cascade(qo_arr, **kw):
    ptr0, ind0, last0 = np.array([0, 1]), np.array([0]), np.array([4])
    ptr1, ind1, last1 = np.array([0, 1, 2]), np.array([1, 2]), np.array([2, 3])
    args = dict(q=QP, qo_indptr_arr=qo_arr, paged_kv_cache=CACHE,
                paged_kv_indptr_arr=[ptr0, ptr1], paged_kv_indices_arr=[ind0, ind1],
                paged_kv_last_page_len=[last0, last1])
    args.update(kw)
    return lambda: R.multi_level_cascade_attention(**args)


def append(key=None, bi=None, pos=None):
    cache = CACHE.copy()
    key = np.zeros((3, HKV, D)) if key is None else key
    bi = np.array([0, 1, 1]) if bi is None else bi
    pos = np.array([2, 5, 6]) if pos is None else pos
    return lambda: R.append_paged_kv_cache(key, np.zeros((3, HKV, D)), bi, pos, cache, IND, PTR,
                                           LAST)


def merge_in_place_readonly():
    v, s = np.zeros((2, 1, 4)), np.zeros((2, 1))
    v.setflags(write=False)
    return lambda: R.merge_state_in_place(v, s, np.zeros((2, 1, 4)), np.zeros((2, 1)))


ROPE_BAD = dict(pos_encoding_mode="ROPE")
CASES = {
    "non-monotonic kv_indptr": (decode(kv_indptr=np.array([0, 3, 1])), ValueError, "kv_indptr"),
    "kv_indptr wrong length": (decode(kv_indptr=np.array([0, 4])), ValueError, "kv_indptr"),
    "kv_indices shorter than kv_indptr[-1]": (decode(kv_indices=IND[:3]), ValueError,
                                              "kv_indices"),
    "int64 page id that wraps in int32": (decode(kv_indices=np.array([0, 2, 2**32 + 3, 5])),
                                          ValueError, "kv_indices"),
    "int64 kv_indptr beyond int32": (decode(kv_indptr=np.array([0, 1, 2**32 + 4])), ValueError,
                                     "kv_indptr"),
    "int64 last_page_len that wraps": (decode(kv_last_page_len=np.array([3, 2**32 + 2])),
                                       ValueError, "kv_last_page_len"),
    "uint64 page id beyond int64": (decode(kv_indices=np.array([0, 2, 2**64 - 1, 5], np.uint64)),
                                    ValueError, "kv_indices"),
    "negative page id": (decode(kv_indices=np.array([0, -2, 3, 5])), ValueError, "kv_indices"),
    "page id >= num_pages": (decode(kv_indices=np.array([0, 2, 3, P])), ValueError,
                             "kv_indices"),
    "last_page_len 0": (decode(kv_last_page_len=np.array([0, 2])), ValueError,
                        "kv_last_page_len"),
    "last_page_len > page_size": (decode(kv_last_page_len=np.array([3, PAGE + 1])), ValueError,
                                  "kv_last_page_len"),
    "last_page_len wrong length": (decode(kv_last_page_len=np.array([3])), ValueError,
                                   "kv_last_page_len"),
    "float page ids": (decode(kv_indices=IND.astype(float)), TypeError, "kv_indices"),
    "num_qo_heads not a multiple": (decode(q=np.zeros((2, 3, D))), ValueError, "num_qo_heads"),
    "head_dim mismatch": (decode(q=np.zeros((2, 4, D + 1))), ValueError, "q"),
    "int q": (decode(q=np.zeros((2, 4, D), dtype=np.int32)), TypeError, "q"),
    "bool q": (single(q=np.zeros((5, 4, D), dtype=bool)), TypeError, "q"),
    "q wrong rank": (decode(q=np.zeros((4, D))), ValueError, "q"),
    "q batch != len(kv_indptr) - 1": (decode(q=np.zeros((3, 4, D))), ValueError, "q"),
    "bad kv_layout": (decode(kv_layout="NDH"), ValueError, "kv_layout"),
    "paged cache axis 1 != 2": (decode(paged_kv_cache=np.zeros((P, 3, PAGE, HKV, D))),
                                ValueError, "paged_kv_cache"),
    "paged cache tuple shapes": (decode(paged_kv_cache=(CACHE[:, 0], CACHE[:, 1, :2])),
                                 ValueError, "paged_kv_cache"),
    "qo_indptr[-1] != q rows": (prefill(qo_indptr=np.array([0, 2, 4])), ValueError,
                                "qo_indptr"),
    "qo_indptr wrong length": (prefill(qo_indptr=np.array([0, 5])), ValueError, "qo_indptr"),
    "custom_mask wrong length": (prefill(custom_mask=np.ones(10, dtype=bool)), ValueError,
                                 "custom_mask"),
    "custom_mask not bool": (prefill(custom_mask=np.ones(2 * 3 + 3 * 14)), TypeError,
                             "custom_mask"),
    "packed_custom_mask wrong size": (prefill(packed_custom_mask=np.zeros(3, np.uint8)),
                                      ValueError, "packed_custom_mask"),
    "mask_indptr wrong offsets": (prefill(packed_custom_mask=np.zeros(7, np.uint8),
                                          mask_indptr=np.array([0, 2, 7])), ValueError,
                                  "mask_indptr"),
    "both masks": (single(custom_mask=np.ones((5, 7), bool),
                          packed_custom_mask=np.zeros(5, np.uint8)), ValueError, "custom_mask"),
    "single custom_mask shape": (single(custom_mask=np.ones((5, 6), bool)), ValueError,
                                 "custom_mask"),
    "v shape != k shape": (single(v=K[:5]), ValueError, "v"),
    "bad sm_scale": (single(sm_scale=float("nan")), ValueError, "sm_scale"),
    "bad lse_base": (single(lse_base=10), ValueError, "lse_base"),
    "unknown variant name": (single(variant="causl"), ValueError, "variant"),
    "parametrised variant by name": (single(variant="soft_cap"), ValueError, "variant"),
    "bad variant type": (single(variant=3), TypeError, "variant"),
    "negative logits_soft_cap": (single(logits_soft_cap=-30.0), ValueError, "logits_soft_cap"),
    "NaN logits_soft_cap": (single(logits_soft_cap=float("nan")), ValueError,
                            "logits_soft_cap"),
    "bad pos_encoding_mode": (single(**ROPE_BAD), ValueError, "pos_encoding_mode"),
    "bad window_left": (single(window_left=-2), ValueError, "window_left"),
    "block index out of range": (sparse(indices=np.array([0, 0, 2])), ValueError, "indices"),
    "block indptr wrong length": (sparse(indptr=np.array([0, 3])), ValueError, "indptr"),
    "duplicate block": (sparse(indices=np.array([0, 1, 1])), ValueError, "indices"),
    "duplicate block, unsorted row": (sparse(indptr=np.array([0, 0, 3]),
                                             indices=np.array([1, 0, 1])), ValueError, "indices"),
    "block mask shape": (sparse(mask=np.ones((3, 4, 3), bool)), ValueError, "mask"),
    "cascade not a coarsening": (cascade([np.array([0, 3, 5]), np.array([0, 2, 5])],
                                         paged_kv_indptr_arr=[np.array([0, 1, 1]),
                                                              np.array([0, 1, 2])],
                                         paged_kv_last_page_len=[np.array([4, 0]),
                                                                 np.array([2, 3])]),
                                 ValueError, "qo_indptr_arr[0]"),
    "cascade level end != nnz": (cascade([np.array([0, 5]), np.array([0, 2, 4])]), ValueError,
                                 "qo_indptr_arr[1]"),
    "cascade list lengths": (cascade([np.array([0, 5]), np.array([0, 2, 5])],
                                     paged_kv_indices_arr=[np.array([0])]), ValueError,
                             "paged_kv_indices_arr"),
    "cascade page table per level": (cascade([np.array([0, 5]), np.array([0, 2, 5])],
                                             paged_kv_indptr_arr=[np.array([0, 1]),
                                                                  np.array([0, 2])]),
                                     ValueError, "paged_kv_indptr_arr[1]"),
    "cascade last_page_len per level": (cascade([np.array([0, 5]), np.array([0, 2, 5])],
                                                paged_kv_last_page_len=[np.array([4]),
                                                                        np.array([2])]),
                                        ValueError, "paged_kv_last_page_len[1]"),
    "cascade last_page_len value": (cascade([np.array([0, 5]), np.array([0, 2, 5])],
                                            paged_kv_last_page_len=[np.array([4]),
                                                                    np.array([2, 5])]),
                                    ValueError, "paged_kv_last_page_len[1]"),
    "cascade page id": (cascade([np.array([0, 5]), np.array([0, 2, 5])],
                                paged_kv_indices_arr=[np.array([0]), np.array([1, P])]),
                        ValueError, "paged_kv_indices_arr[1]"),
    "cascade not a list": (cascade([np.array([0, 5]), np.array([0, 2, 5])],
                                   paged_kv_last_page_len=np.array([4, 2, 3])), TypeError,
                           "paged_kv_last_page_len"),
    "append key wrong heads": (append(key=np.zeros((3, HKV + 1, D))), ValueError,
                               "append_key"),
    "append batch_indices length": (append(bi=np.array([0, 1])), ValueError, "batch_indices"),
    "append batch index out of range": (append(bi=np.array([0, 1, 2])), ValueError,
                                        "batch_indices"),
    "append batch index that wraps": (append(bi=np.array([0, 1, 2**32 + 1])), ValueError,
                                      "batch_indices"),
    "append position that wraps": (append(pos=np.array([2, 5, 2**32 + 6])), ValueError,
                                   "positions"),
    "append position beyond kv_len": (append(pos=np.array([2, 5, 11])), ValueError,
                                      "positions"),
    "seq_lens shorter than append": (lambda: R.get_batch_indices_positions(
        np.array([0, 3, 4]), np.array([2, 5]), 4), ValueError, "seq_lens"),
    "append_indptr end != nnz": (lambda: R.get_batch_indices_positions(
        np.array([0, 3, 4]), np.array([3, 5]), 5), ValueError, "append_indptr"),
    "merge shapes": (lambda: R.merge_state(np.zeros((2, 1, 4)), np.zeros((2, 2)),
                                           np.zeros((2, 1, 4)), np.zeros((2, 1))),
                     ValueError, "s_a"),
    "merge_states rank": (lambda: R.merge_states(np.zeros((2, 1, 4)), np.zeros((2, 1))),
                          ValueError, "v"),
    "merge in place read-only": (merge_in_place_readonly(), ValueError, "v"),
    "merge in place mask length": (lambda: R.merge_state_in_place(
        np.zeros((2, 1, 4)), np.zeros((2, 1)), np.zeros((2, 1, 4)), np.zeros((2, 1)),
        np.ones(3, bool)), ValueError, "mask"),
    "attention_state q_pos length": (lambda: R.attention_state(QP, K, K, q_pos=np.arange(4)),
                                     ValueError, "q_pos"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_names_the_argument(case):
    fn, exc, name = CASES[case]
    # The name must appear as a whole token ("q" in "q.shape[2]", not in "qo_indptr").
    with pytest.raises(exc, match=r"(^|[^\w])" + re.escape(name) + r"([^\w]|$)"):
        fn()


def test_validation_happens_before_writing():
    # A bad append must leave the cache untouched (all checks run before the first write).
    cache = CACHE.copy()
    with pytest.raises(ValueError, match="positions"):
        R.append_paged_kv_cache(np.ones((3, HKV, D)), np.ones((3, HKV, D)), np.array([0, 1, 1]),
                                np.array([0, 1, 99]), cache, IND, PTR, LAST)
    np.testing.assert_array_equal(cache, CACHE)
