"""The merge operator: the paper's worked example, exactness of split-and-merge, edge cases,
and the non-finite rule (a NaN or +inf LSE poisons the merged row and head; -inf is empty)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from conftest import assert_close

from nbinfer.reference import attention_state, merge_state, merge_state_in_place, merge_states
from nbinfer.variants import alibi, causal, compose, rope_llama, standard

SPLIT_VARIANTS = (standard(), compose(rope_llama(), alibi(4), causal()))


def _paper_example():
    # One query [1, 0] and keys [1, 0] .. [4, 0] with sm_scale = 1: scores 1, 2, 3, 4.
    # Values carry 10, 20, 30, 40 in their first component.
    q = np.array([[[1.0, 0.0]]])
    k = np.array([[[s, 0.0]] for s in (1.0, 2.0, 3.0, 4.0)])
    v = 10.0 * k
    return q, k, v


def test_paper_worked_example():
    q, k, v = _paper_example()
    o_a, s_a = attention_state(q, k[:2], v[:2], sm_scale=1.0)
    o_b, s_b = attention_state(q, k[2:], v[2:], sm_scale=1.0)
    assert o_a[0, 0, 0] == pytest.approx(17.31, abs=5e-3)
    assert o_b[0, 0, 0] == pytest.approx(37.31, abs=5e-3)
    assert s_a[0, 0] == pytest.approx(2.313, abs=5e-4)
    assert s_b[0, 0] == pytest.approx(4.313, abs=5e-4)
    o, s = merge_state(o_a, s_a, o_b, s_b)
    assert o[0, 0, 0] == pytest.approx(34.93, abs=5e-3)
    # Averaging the partial outputs is wrong: it would give 27.31.
    assert (o_a[0, 0, 0] + o_b[0, 0, 0]) / 2 == pytest.approx(27.31, abs=5e-3)
    assert abs(o[0, 0, 0] - 27.31) > 7
    # And the merged state is exactly the state over all four keys.
    o_all, s_all = attention_state(q, k, v, sm_scale=1.0)
    assert_close(o, o_all)
    assert_close(s, s_all)


def _close_lse(lse, want):
    # Causal rows with no key (kv_len < qo_len) have LSE -inf in both: compare those exactly.
    fin = np.isfinite(want)
    np.testing.assert_array_equal(lse[~fin], want[~fin])
    assert_close(lse[fin], want[fin], what="merged lse")


def _random_split(rng, n, max_parts=5):
    parts = int(rng.integers(1, max_parts + 1))
    cuts = np.sort(rng.integers(0, n + 1, size=parts - 1))  # empty parts allowed
    return np.concatenate([[0], cuts, [n]])


@pytest.mark.parametrize("trial", range(4))
def test_split_anywhere_merge_in_any_order(rng, trial):
    lq, hq, hkv, d, lkv = 3, 4, 2, 8, int(rng.integers(1, 40))
    q = rng.standard_normal((lq, hq, d))
    k = rng.standard_normal((lkv, hkv, d))
    v = rng.standard_normal((lkv, hkv, d))
    # Positional hooks make the split meaningful: each part keeps its keys' absolute positions.
    variant = SPLIT_VARIANTS[trial % len(SPLIT_VARIANTS)]
    q_pos = np.arange(lkv - lq, lkv)
    o_all, s_all = attention_state(q, k, v, variant=variant)
    bounds = _random_split(rng, lkv)
    states = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        states.append(attention_state(q, k[a:b], v[a:b], variant=variant, q_pos=q_pos,
                                      kv_pos=np.arange(a, b)))
    order = rng.permutation(len(states))
    o, s = states[order[0]]
    for i in order[1:]:
        o, s = merge_state(o, s, *states[i])
    assert_close(o, o_all, what="merged output")
    _close_lse(s, s_all)
    # merge_states over the stacked states agrees with the sequential merges.
    vs = np.stack([st[0] for st in states], axis=1)
    ss = np.stack([st[1] for st in states], axis=1)
    o2, s2 = merge_states(vs, ss)
    assert_close(o2, o_all)
    _close_lse(s2, s_all)


def test_merge_is_commutative_and_associative(rng):
    n, h, d = 5, 3, 4
    sts = [(rng.standard_normal((n, h, d)), rng.standard_normal((n, h)) * 5) for _ in range(3)]
    ab = merge_state(*sts[0], *sts[1])
    ba = merge_state(*sts[1], *sts[0])
    assert_close(ab[0], ba[0])
    assert_close(ab[1], ba[1])
    left = merge_state(*ab, *sts[2])
    right = merge_state(*sts[0], *merge_state(*sts[1], *sts[2]))
    assert_close(left[0], right[0])
    assert_close(left[1], right[1])


def test_overflow_safe():
    # Logits near 1e4 overflow exp() in float64 unless the maximum is subtracted first.
    q = np.array([[[100.0, 0.0]]])
    k = np.array([[[100.0, 0.0]], [[99.9, 0.0]], [[99.0, 0.0]]])
    v = np.array([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o_all, s_all = attention_state(q, k, v, sm_scale=1.0)
        o_a, s_a = attention_state(q, k[:1], v[:1], sm_scale=1.0)
        o_b, s_b = attention_state(q, k[1:], v[1:], sm_scale=1.0)
        o, s = merge_state(o_a, s_a, o_b, s_b)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    assert s_all[0, 0] > 1e4 - 1
    assert_close(o, o_all)
    assert_close(s, s_all)


def test_empty_state_is_identity(rng):
    n, h, d = 4, 2, 8
    v = rng.standard_normal((n, h, d))
    s = rng.standard_normal((n, h))
    empty_v = rng.standard_normal((n, h, d))  # whatever the output, LSE -inf means "no keys"
    empty_v[0, 0, 0], empty_v[1, 1, 3], empty_v[2, 0, 1] = np.nan, np.inf, -np.inf  # never read
    empty_s = np.full((n, h), -np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mv, ms in (merge_state(v, s, empty_v, empty_s), merge_state(empty_v, empty_s, v, s)):
            np.testing.assert_array_equal(mv, v)
            np.testing.assert_array_equal(ms, s)
        both_v, both_s = merge_state(empty_v, empty_s, empty_v, empty_s)
        merged_v, merged_s = merge_states(np.zeros((n, 0, h, d)), np.zeros((n, 0, h)))
    assert np.all(both_v == 0) and np.all(both_s == -np.inf)
    assert np.all(merged_v == 0) and np.all(merged_s == -np.inf)
    in_v, in_s = v.copy(), s.copy()
    merge_state_in_place(in_v, in_s, empty_v, empty_s)
    np.testing.assert_array_equal(in_v, v)
    np.testing.assert_array_equal(in_s, s)


# ---------------------------------------------------------------------------------------------
# non-finite LSEs: NaN and +inf poison the (row, head); -inf is the empty state


def _poisoned_pair(rng, bad_value):
    """Two states of shape [4, 2, 8]; state b's LSE is ``bad_value`` at (1, 0), state a's at
    (2, 1); row 3 head 1 merges a poisoned state with an empty one."""
    n, h, d = 4, 2, 8
    va, vb = rng.standard_normal((2, n, h, d))
    sa, sb = rng.standard_normal((2, n, h))
    sb[1, 0] = bad_value
    sa[2, 1] = bad_value
    sa[3, 1], sb[3, 1] = bad_value, -np.inf
    bad = np.zeros((n, h), dtype=bool)
    bad[1, 0] = bad[2, 1] = bad[3, 1] = True
    return va, sa, vb, sb, bad


def _assert_poisoned(v, s, bad, want_v, want_s):
    assert np.all(np.isnan(v[bad])) and np.all(np.isnan(s[bad]))  # every head_dim entry
    # Every other (row, head) is the ordinary merge.
    np.testing.assert_allclose(v[~bad], want_v[~bad], rtol=1e-12)
    np.testing.assert_allclose(s[~bad], want_s[~bad], rtol=1e-12)


@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_nan_or_plus_inf_lse_poisons_the_merge(rng, bad_value):
    va, sa, vb, sb, bad = _poisoned_pair(rng, bad_value)
    clean = [np.where(bad, 0.0, x) for x in (sa, sb)]
    want_v, want_s = merge_state(va, clean[0], vb, clean[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning on the way either
        v, s = merge_state(va, sa, vb, sb)
        _assert_poisoned(v, s, bad, want_v, want_s)
        v2, s2 = merge_state(vb, sb, va, sa)  # either side
        _assert_poisoned(v2, s2, bad, want_v, want_s)
        # base 2: the same rule
        v2, s2 = merge_state(va, sa / math.log(2), vb, sb / math.log(2), lse_base=2)
        _assert_poisoned(v2, s2 * math.log(2), bad, want_v, want_s)
        # merge_states: one poisoned state among several
        vs, ss = np.stack([va, vb, va], axis=1), np.stack([sa, sb, np.full_like(sa, -np.inf)], 1)
        vm, sm = merge_states(vs, ss)
        _assert_poisoned(vm, sm, bad, want_v, want_s)
        # in place: only merged rows change, poisoned merged rows become NaN
        mask = np.array([True, False, True, True])
        v_in, s_in = va.copy(), sa.copy()
        merge_state_in_place(v_in, s_in, vb, sb, mask)
        _assert_poisoned(v_in[mask], s_in[mask], bad[mask], want_v[mask], want_s[mask])
        np.testing.assert_array_equal(v_in[1], va[1])  # row 1 is not merged: sb[1, 0] unused
        np.testing.assert_array_equal(s_in[1], sa[1])


def test_poisoned_attention_state_survives_merging(rng):
    # A NaN key in one chunk: the chunk's state is NaN, and so is the merge with the clean chunk,
    # exactly as attending to all keys at once gives.
    q = rng.standard_normal((3, 2, 8))
    k = rng.standard_normal((6, 1, 8))
    v = rng.standard_normal((6, 1, 8))
    k[4, 0, 5] = np.nan
    o_all, s_all = attention_state(q, k, v)
    o_a, s_a = attention_state(q, k[:3], v[:3])
    o_b, s_b = attention_state(q, k[3:], v[3:])
    assert np.all(np.isfinite(o_a)) and np.all(np.isnan(s_b))
    o, s = merge_state(o_a, s_a, o_b, s_b)
    assert np.all(np.isnan(o)) and np.all(np.isnan(s))
    assert np.all(np.isnan(o_all)) and np.all(np.isnan(s_all))


def test_non_finite_values_in_o_follow_ieee():
    # With finite LSEs, O is plain arithmetic: NaN and inf stay in their own entry.
    va = np.array([[[1.0, np.nan, 2.0]]])
    vb = np.array([[[3.0, 4.0, np.inf]]])
    v, s = merge_state(va, np.zeros((1, 1)), vb, np.zeros((1, 1)))
    assert v[0, 0, 0] == 2.0 and np.isnan(v[0, 0, 1]) and v[0, 0, 2] == np.inf
    assert s[0, 0] == pytest.approx(math.log(2))


def test_lse_base_two(rng):
    n, h, d = 6, 2, 8
    (va, sa), (vb, sb) = [(rng.standard_normal((n, h, d)), rng.standard_normal((n, h)))
                          for _ in range(2)]
    v_e, s_e = merge_state(va, sa, vb, sb)
    v_2, s_2 = merge_state(va, sa / math.log(2), vb, sb / math.log(2), lse_base=2)
    assert_close(v_2, v_e)
    assert_close(s_2, s_e / math.log(2))
    # attention_state's base-2 LSE is the natural one divided by ln 2.
    q = rng.standard_normal((3, 2, d))
    k = rng.standard_normal((7, 1, d))
    _, lse_e = attention_state(q, k, k)
    _, lse_2 = attention_state(q, k, k, lse_base=2)
    assert_close(lse_2, lse_e / math.log(2))
    vs = np.stack([va, vb], axis=1)
    ss = np.stack([sa, sb], axis=1) / math.log(2)
    vm, sm = merge_states(vs, ss, lse_base=2)
    assert_close(vm, v_e)
    assert_close(sm, s_e / math.log(2))


def test_merge_states_matches_sequential(rng):
    n, k_states, h, d = 5, 4, 3, 8
    v = rng.standard_normal((n, k_states, h, d)).astype(np.float32)
    s = (rng.standard_normal((n, k_states, h)) * 3).astype(np.float32)
    s[0, 1:] = -np.inf  # a row with a single non-empty state
    s[1] = -np.inf  # an all-empty row
    vm, sm = merge_states(v, s)
    acc_v, acc_s = v[:, 0], s[:, 0]
    for i in range(1, k_states):
        acc_v, acc_s = merge_state(acc_v, acc_s, v[:, i], s[:, i])
    assert vm.dtype == np.float64
    assert_close(vm, acc_v)
    np.testing.assert_array_equal(sm[1], -np.inf)
    assert_close(sm[[0, 2, 3, 4]], acc_s[[0, 2, 3, 4]])


def test_merge_state_in_place_with_mask(rng):
    n, h, d = 6, 2, 4
    v = rng.standard_normal((n, h, d))
    s = rng.standard_normal((n, h))
    vo = rng.standard_normal((n, h, d))
    so = rng.standard_normal((n, h))
    mask = np.array([True, False, True, True, False, False])
    want_v, want_s = merge_state(v, s, vo, so)
    v0, s0 = v.copy(), s.copy()
    assert merge_state_in_place(v, s, vo, so, mask) is None
    assert_close(v[mask], want_v[mask])
    assert_close(s[mask], want_s[mask])
    np.testing.assert_array_equal(v[~mask], v0[~mask])
    np.testing.assert_array_equal(s[~mask], s0[~mask])
    # Without a mask every row merges; float32 arrays are updated in their own dtype.
    v32, s32 = v0.astype(np.float32), s0.astype(np.float32)
    merge_state_in_place(v32, s32, vo, so)
    assert v32.dtype == np.float32
    assert_close(v32, want_v, dtype="float32")
    assert_close(s32, want_s, dtype="float32")
