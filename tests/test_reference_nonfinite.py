"""The non-finite rule of the reference engine (the rule on every backend).

A NaN or infinity in a query row, or in the K or V row of a key that the row keeps, makes that
(row, head)'s whole output and its LSE NaN, whatever the key's weight; a masked key's K and V
never matter; keys outside the request's KV are never read; a row with no kept key stays O = 0,
LSE = -inf. Expected values come from the same computation on inputs with the NaN replaced by
finite numbers (or removed).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from nbinfer import reference as R
from nbinfer.formats import PageTable
from nbinfer.variants import Variant, causal, sigmoid_attention

LQ, LKV, HQ, HKV, D = 4, 6, 4, 2, 8  # GQA group 2: qo heads 0, 1 read kv head 0


def _inputs(rng):
    return (rng.standard_normal((LQ, HQ, D)), rng.standard_normal((LKV, HKV, D)),
            rng.standard_normal((LKV, HKV, D)))


def _check(o, lse, bad, o_want, lse_want):
    """``bad`` [LQ, HQ]: NaN everywhere there (every head_dim entry), ``*_want`` elsewhere."""
    assert np.all(np.isnan(o[bad])) and np.all(np.isnan(lse[bad]))
    np.testing.assert_allclose(o[~bad], o_want[~bad], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[~bad], lse_want[~bad], rtol=1e-12)


def test_nan_in_q_poisons_only_its_row_and_head(rng):
    q, k, v = _inputs(rng)
    o_want, lse_want = R.attention_state(q, k, v)
    q[2, 1, 3] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = R.attention_state(q, k, v)
    bad = np.zeros((LQ, HQ), bool)
    bad[2, 1] = True
    _check(o, lse, bad, o_want, lse_want)


@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_a_kept_key_poisons_the_rows_that_keep_it(rng, which):
    # Causal (bottom-right): query i sits at position i + 2 and keeps keys <= i + 2, so a NaN in
    # key 4 reaches rows 2 and 3 only, and only the qo heads of its kv head (GQA group).
    q, k, v = _inputs(rng)
    o_want, lse_want = R.attention_state(q, k, v, variant=causal())
    {"k": k, "v": v}[which][4, 1, 6] = np.nan  # one element of kv head 1's row
    o, lse = R.attention_state(q, k, v, variant=causal())
    bad = np.zeros((LQ, HQ), bool)
    bad[2:, 2:] = True  # rows 2, 3; qo heads 2, 3 (kv head 1)
    _check(o, lse, bad, o_want, lse_want)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_masked_keys_k_and_v_never_matter(rng, value):
    q, k, v = _inputs(rng)
    mask = np.ones((LQ, LKV), bool)
    mask[:, 1] = False  # key 1 masked for every row
    o_want, lse_want = R.attention_state(q, k, v, mask=mask)
    k[1], v[1] = value, value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, lse = R.attention_state(q, k, v, mask=mask)
    np.testing.assert_array_equal(o, o_want)
    np.testing.assert_array_equal(lse, lse_want)
    # The same through a variant's mask (sigmoid: no softmax, weights would be 0 * NaN).
    sig = sigmoid_attention(0.5, -1.0)
    q2, k2, v2 = _inputs(rng)
    o_want, _ = R.attention_state(q2, k2, v2, mask=mask, variant=sig)
    k2[1], v2[1] = value, value
    o, lse = R.attention_state(q2, k2, v2, mask=mask, variant=sig)
    np.testing.assert_array_equal(o, o_want)
    assert np.all(lse == 0)


def test_row_without_kept_keys_stays_empty_even_with_nan_q(rng):
    q, k, v = _inputs(rng)
    q[0] = np.nan  # row 0 keeps nothing
    k[0] = np.nan  # nor does any row keep key 0
    mask = np.ones((LQ, LKV), bool)
    mask[0], mask[:, 0] = False, False
    o, lse = R.attention_state(q, k, v, mask=mask)
    assert np.all(o[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(np.isfinite(o[1:])) and np.all(np.isfinite(lse[1:]))


def test_plus_inf_logit_and_infinite_inputs_of_a_kept_key_poison(rng):
    q, k, v = _inputs(rng)
    q = np.abs(q)
    k2 = k.copy()
    k2[3, 0] = np.inf  # q . k = +inf for qo heads 0, 1 (positive q): a kept +inf logit
    o, lse = R.attention_state(q, np.abs(k2), v)
    assert np.all(np.isnan(o[:, :2])) and np.all(np.isnan(lse[:, :2]))
    assert np.all(np.isfinite(o[:, 2:])) and np.all(np.isfinite(lse[:, 2:]))
    o_want, lse_want = R.attention_state(q, k, v)
    # -inf in K (a -inf logit from the inputs, not from the variant), +-inf in V or q: the rows
    # that keep the key (or own the query) are NaN, the rest unchanged.
    for name, where, bad_at in (("k", (2, 1, 5), np.s_[:, 2:]), ("v", (2, 1, 5), np.s_[:, 2:]),
                                ("v", (4, 0, 6), np.s_[:, :2]), ("q", (1, 3, 0), np.s_[1, 3])):
        for value in (np.inf, -np.inf):
            arrays = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
            arrays[name][where] = value
            o, lse = R.attention_state(arrays["q"], arrays["k"], arrays["v"])
            bad = np.zeros((LQ, HQ), bool)
            bad[bad_at] = True
            _check(o, lse, bad, o_want, lse_want)


NEG_INF = np.float32(-np.inf)


def _drop_key_1(s, q_pos, kv_pos, qo_head):
    return NEG_INF if kv_pos == 1 else s


def test_a_minus_inf_logit_from_the_variant_is_weight_0_not_a_mask(rng):
    # A softmax variant that returns -inf for key 1 gives it weight 0 (the result equals masking
    # it), but the masks decide what a row reads: a NaN or inf in key 1's V still poisons.
    var = Variant(name="drop_key_1", logits_transform=_drop_key_1)
    q, k, v = _inputs(rng)
    mask = np.ones((LQ, LKV), bool)
    mask[:, 1] = False
    o_want, lse_want = R.attention_state(q, k, v, mask=mask)
    o0, lse0 = R.attention_state(q, k, v, variant=var)
    np.testing.assert_allclose(o0, o_want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse0, lse_want, rtol=1e-12)
    for value in (np.nan, np.inf):
        v2 = v.copy()
        v2[1, 0] = value  # kv head 0: qo heads 0, 1
        o, lse = R.attention_state(q, k, v2, variant=var)
        bad = np.zeros((LQ, HQ), bool)
        bad[:, :2] = True
        _check(o, lse, bad, o0, lse0)
        o, lse = R.attention_state(q, k, v2, variant=var, mask=mask)  # masked as well: unread
        np.testing.assert_allclose(o, o_want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, lse_want, rtol=1e-12)


def test_no_softmax_variant_follows_the_rule(rng):
    sig = sigmoid_attention(0.5, -1.0)
    q, k, v = _inputs(rng)
    o_want, lse_want = R.attention_state(q, k, v, variant=sig)
    v[5, 0, 0] = np.nan
    o, lse = R.attention_state(q, k, v, variant=sig)
    bad = np.zeros((LQ, HQ), bool)
    bad[:, :2] = True
    _check(o, lse, bad, o_want, lse_want)


def test_paged_keys_outside_the_request_are_never_read(rng):
    # NaN in the unused slots of each last page, in pages no request lists, and in a page id
    # buffer past kv_indptr[-1]: the batch decode is exactly the clean one.
    page, hkv, d, hq = 4, 2, 8, 4
    table = PageTable.from_kv_lens([5, 7, 0], page, num_pages=8, rng=rng.integers(2**32))
    cache = rng.standard_normal((8, 2, page, hkv, d))
    q = rng.standard_normal((3, hq, d))
    o_want, lse_want = R.batch_decode_with_paged_kv_cache(
        q, cache, table.indptr, table.indices, table.last_page_len, return_lse=True)
    used = np.zeros((8, page), bool)
    for b in range(table.batch_size):
        slots = table.token_slots(b)
        used[slots // page, slots % page] = True
    dirty = cache.copy()
    np.moveaxis(dirty, 1, 2)[~used] = np.nan  # K and V of every slot no request reads
    buffer = np.concatenate([table.indices, [-7, 99]]).astype(np.int64)  # a longer buffer
    o, lse = R.batch_decode_with_paged_kv_cache(
        q, dirty, table.indptr, buffer, table.last_page_len, return_lse=True)
    np.testing.assert_array_equal(o, o_want)
    np.testing.assert_array_equal(lse, lse_want)
    assert np.all(o[2] == 0) and np.all(lse[2] == -np.inf)  # the empty request
    # A NaN in a slot that request 1 reads poisons request 1 only.
    s = table.token_slots(1)[3]
    dirty[s // page, 1, s % page, 0, 2] = np.nan  # V, kv head 0
    o, lse = R.batch_decode_with_paged_kv_cache(
        q, dirty, table.indptr, table.indices, table.last_page_len, return_lse=True)
    assert np.all(np.isnan(o[1, :2])) and np.all(np.isnan(lse[1, :2]))
    np.testing.assert_array_equal(o[[0, 2]], o_want[[0, 2]])
    np.testing.assert_array_equal(o[1, 2:], o_want[1, 2:])


def test_nan_reaches_the_cascade_output(rng):
    # Level 0 (shared prefix) holds a NaN key: every query row is NaN after the level merge.
    page, hkv, d, hq = 4, 1, 8, 2
    cache = rng.standard_normal((4, 2, page, hkv, d))
    cache[0, 0, 1, 0, 3] = np.nan
    q = rng.standard_normal((3, hq, d))
    o, lse = R.multi_level_cascade_attention(
        q, [np.array([0, 3]), np.array([0, 1, 3])], cache,
        [np.array([0, 1]), np.array([0, 1, 2])], [np.array([0]), np.array([1, 2])],
        [np.array([4]), np.array([2, 3])], return_lse=True)
    assert np.all(np.isnan(o)) and np.all(np.isnan(lse))


def test_string_variant_in_the_reference(rng):
    q, k, v = _inputs(rng)
    by_name = R.single_prefill_with_kv_cache(q, k, v, variant="causal", return_lse=True)
    by_flag = R.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    for a, b in zip(by_name, by_flag, strict=True):
        np.testing.assert_array_equal(a, b)
    o_sig = R.attention_state(q, k, v, variant="sigmoid")[0]
    np.testing.assert_array_equal(o_sig, R.attention_state(q, k, v,
                                                           variant=sigmoid_attention())[0])
    with pytest.raises(ValueError, match="variant"):
        R.attention_state(q, k, v, variant="window")
    with pytest.raises(ValueError, match="variant"):
        R.finalize(np.zeros((1, 2, 4)), np.zeros((1, 2)), "attention_sink")
