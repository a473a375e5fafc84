"""The lessons' exercises: each has a solution (here, so CI proves it solvable) and each check
fails on wrong solutions with a message that points at the mistake."""

from __future__ import annotations

import numpy as np
import pytest

from nbinfer import exercises
from nbinfer.exercises import ExerciseFailed


# -- lesson 01: merge two attention states ----------------------------------------------------
def merge(o_a, lse_a, o_b, lse_b):
    m = np.maximum(lse_a, lse_b)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # both empty: keep exp() away from -inf - -inf
    w_a, w_b = np.exp(lse_a - m_safe), np.exp(lse_b - m_safe)
    den = w_a + w_b
    o = (w_a[..., None] * o_a + w_b[..., None] * o_b) / np.where(den > 0, den, 1)[..., None]
    return o, np.where(den > 0, m_safe + np.log(np.where(den > 0, den, 1)), -np.inf)


def merge_naive(o_a, lse_a, o_b, lse_b):  # exp(lse) directly: overflows near 1000
    with np.errstate(all="ignore"):
        w_a, w_b = np.exp(lse_a), np.exp(lse_b)
        return ((w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None],
                np.log(w_a + w_b))


def merge_unguarded(o_a, lse_a, o_b, lse_b):  # right until both states are empty
    with np.errstate(all="ignore"):
        m = np.maximum(lse_a, lse_b)
        w_a, w_b = np.exp(lse_a - m), np.exp(lse_b - m)
        return ((w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None],
                m + np.log(w_a + w_b))


def merge_average(o_a, lse_a, o_b, lse_b):  # the mistake lesson 01 opens with
    return (o_a + o_b) / 2, np.logaddexp(lse_a, lse_b)


def test_merge_exercise():
    assert "match" in exercises.check_merge(merge)
    for wrong, says in ((merge_naive, "1000"), (merge_unguarded, "both states empty"),
                        (merge_average, "random")):
        with pytest.raises(ExerciseFailed, match=says):
            exercises.check_merge(wrong)


# -- lesson 02: the slots a request reads -------------------------------------------------------
def token_slots(indptr, indices, last_page_len, page_size, b):
    pages = indices[indptr[b]:indptr[b + 1]]
    n = (len(pages) - 1) * page_size + last_page_len[b] if len(pages) else 0
    t = np.arange(n)
    return pages[t // page_size].astype(np.int64) * page_size + t % page_size


def token_slots_all_full(indptr, indices, last_page_len, page_size, b):
    pages = indices[indptr[b]:indptr[b + 1]]
    return (pages[:, None] * page_size + np.arange(page_size)).ravel()


def token_slots_sorted(indptr, indices, last_page_len, page_size, b):
    return np.sort(token_slots(indptr, indices, last_page_len, page_size, b))


def token_slots_logical(indptr, indices, last_page_len, page_size, b):  # ignores the table
    n = len(token_slots(indptr, indices, last_page_len, page_size, b))
    return np.arange(n) + indptr[b] * page_size


def test_token_slots_exercise():
    assert "match" in exercises.check_token_slots(token_slots)
    for wrong, says in ((token_slots_all_full, "last_page_len"),
                        (token_slots_sorted, "wrong order"),
                        (token_slots_logical, "wrong slots")):
        with pytest.raises(ExerciseFailed, match=says):
            exercises.check_token_slots(wrong)


# -- lesson 05: a variant from two hooks -------------------------------------------------------
def distance_penalty(slope, window):
    from numba import float32

    from nbinfer.variants import Variant

    a, w = float32(slope), int(window)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return s - a * (q_pos - kv_pos)

    def logits_mask(q_pos, kv_pos, qo_head):
        return kv_pos + w >= q_pos

    return Variant(f"distance_penalty_{slope:g}_{w}", params=(("slope", slope), ("window", w)),
                   logits_transform=logits_transform, logits_mask=logits_mask)


def distance_penalty_no_window(slope, window):
    from nbinfer.variants import Variant

    a = float(slope)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return s - a * (q_pos - kv_pos)

    return Variant(f"penalty_{slope:g}", params=(("slope", slope),),
                   logits_transform=logits_transform)


_made = [0]


def distance_penalty_numbered(slope, window):  # right numbers, but a new name every call
    _made[0] += 1
    v = distance_penalty(slope, window)
    from nbinfer.variants import Variant

    return Variant(f"{v.name}_{_made[0]}", params=v.params,
                   logits_transform=v.logits_transform, logits_mask=v.logits_mask)


def test_distance_penalty_exercise():
    assert "match" in exercises.check_distance_penalty(distance_penalty)
    with pytest.raises(ExerciseFailed, match="window"):
        exercises.check_distance_penalty(distance_penalty_no_window)
    with pytest.raises(ExerciseFailed, match="equal arguments"):
        exercises.check_distance_penalty(distance_penalty_numbered)


def test_a_stub_is_pending_and_a_started_solution_is_checked():
    def my_merge(*args):
        raise NotImplementedError

    assert "not done yet" in exercises.attempt(exercises.check_merge, my_merge)
    assert "match" in exercises.attempt(exercises.check_merge, merge)
    with pytest.raises(ExerciseFailed, match="raised ZeroDivisionError"):
        exercises.attempt(exercises.check_token_slots, lambda *a: 1 / 0)
