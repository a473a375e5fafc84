"""The lessons' exercises: each has a solution (here, so CI proves it solvable) and each check
fails on wrong solutions with a message that points at the mistake."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numba import cuda, float32  # module globals: the simulator swaps them inside kernels

from nbinfer import exercises
from nbinfer.exercises import ExerciseFailed, gload, sload


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
    with pytest.raises(ExerciseFailed, match="is the window mask there"):
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


# -- lesson 04: the gather kernel within a read budget (simulator) ---------------------------------
def _gather_factory(share: bool, rescale: bool = True):
    """v2 of lesson 04 through the counted loads; ``share=False`` has every query-head thread
    read K and V from global memory itself (v1's traffic); ``rescale=False`` drops alpha."""
    def make(head_dim, group, page_size, num_threads):
        @cuda.jit
        def kernel(q, kv, kv_indptr, kv_indices, kv_last, o, lse, sm_scale, reads):
            k_tile = cuda.shared.array((page_size, head_dim), float32)
            v_tile = cuda.shared.array((page_size, head_dim), float32)
            hkv = kv.shape[3]
            b, hk = cuda.blockIdx.x // hkv, cuda.blockIdx.x % hkv
            tid = cuda.threadIdx.x
            me = cuda.blockIdx.x * cuda.blockDim.x + tid
            h = hk * group + tid
            first = kv_indptr[b]
            num_pages = kv_indptr[b + 1] - first
            acc = cuda.local.array(head_dim, float32)
            for d in range(head_dim):
                acc[d] = 0.0
            m, den = -math.inf, 0.0
            for j in range(num_pages):
                page = kv_indices[first + j]
                rows = page_size if j < num_pages - 1 else kv_last[b]
                if share:
                    for i in range(tid, rows * head_dim, num_threads):
                        r, d = i // head_dim, i % head_dim
                        k_tile[r, d] = gload(kv, page, 0, r, hk, d, reads, me)
                        v_tile[r, d] = gload(kv, page, 1, r, hk, d, reads, me)
                cuda.syncthreads()
                if tid < group:
                    for r in range(rows):
                        s = 0.0
                        for d in range(head_dim):
                            kd = sload(k_tile, r, d, reads, me) if share else \
                                gload(kv, page, 0, r, hk, d, reads, me)
                            s += q[b, h, d] * kd
                        s *= sm_scale
                        m_new = max(m, s)
                        alpha = math.exp(m - m_new) if rescale else 1.0
                        p = math.exp(s - m_new)
                        den = den * alpha + p
                        for d in range(head_dim):
                            vd = sload(v_tile, r, d, reads, me) if share else \
                                gload(kv, page, 1, r, hk, d, reads, me)
                            acc[d] = acc[d] * alpha + p * vd
                        m = m_new
                cuda.syncthreads()
            if tid < group:
                for d in range(head_dim):
                    o[b, h, d] = acc[d] / den
                lse[b, h] = m + math.log(den)

        return kernel

    return make


def test_gather_kernel_exercise():
    from numba.core import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("the kernel exercise runs in Numba's CUDA simulator")
    assert "match" in exercises.check_gather_kernel(_gather_factory(share=True))
    with pytest.raises(ExerciseFailed, match="global reads, the footprint"):
        exercises.check_gather_kernel(_gather_factory(share=False))
    with pytest.raises(ExerciseFailed, match="rescale"):
        exercises.check_gather_kernel(_gather_factory(share=True, rescale=False))
