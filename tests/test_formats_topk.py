"""Quest top-k page selection: summaries, scores and selection vs brute force, and decode over the
selected pages == dense attention with the matching element mask."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from conftest import assert_close
from dense import dense_attention, random_paged_cache, request_kv

from nbinfer.formats import BSR, PageTable
from nbinfer.formats.topk import (
    TopKPages,
    page_key_summaries,
    quest_page_scores,
    select_topk_pages,
)
from nbinfer.reference import batch_decode_with_paged_kv_cache

matplotlib.use("Agg")
HQ, HKV, D = 4, 2, 8


def random_batch(rng, page_size):
    """A paged cache with random lengths, plus a request reading request 0's first full pages."""
    kv_lens = [int(n) for n in rng.integers(1, 9 * page_size, 4)] + [0]
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, page_size, HKV, D)
    shared = int(rng.integers(0, (kv_lens[0] - 1) // page_size + 1))
    if shared:  # pages of request 0 that are full, listed again by a sixth request
        indices = np.concatenate([indices, indices[:shared]])
        indptr = np.append(indptr, indptr[-1] + shared)
        last = np.append(last, page_size)
    return cache, PageTable(indptr, indices, last, page_size, cache.shape[0])


def brute_summaries(cache, t):
    kmin = np.zeros((t.num_pages, HKV, D))
    kmax = np.zeros((t.num_pages, HKV, D))
    seen = {}
    for b in range(t.batch_size):
        pages = t.indices[t.indptr[b]:t.indptr[b + 1]]
        for i, p in enumerate(pages):
            fill = t.last_page_len[b] if i == len(pages) - 1 else t.page_size
            for s in range(fill):
                seen.setdefault(int(p), []).append(cache[p, 0, s])
    for p, keys in seen.items():
        kmin[p], kmax[p] = np.min(keys, axis=0), np.max(keys, axis=0)
    return kmin, kmax


def brute_scores(q, kmin, kmax, t, per_kv_head):
    group = HQ // HKV
    out = []
    for b in range(t.batch_size):
        for p in t.indices[t.indptr[b]:t.indptr[b + 1]]:
            per = np.zeros(HKV)
            for h in range(HQ):
                g = h // group
                per[g] += sum(max(q[b, h, d] * kmin[p, g, d], q[b, h, d] * kmax[p, g, d])
                              for d in range(D))
            out.append(per if per_kv_head else per.sum())
    return np.array(out).reshape(-1, HKV) if per_kv_head else np.array(out)


def brute_select(scores, t, top_k):
    """Per row: (logical page list) by sorting (-score, position), the last page forced in."""
    s = scores.reshape(scores.shape[0], -1)
    rows = []
    for b in range(t.batch_size):
        a, n = t.indptr[b], t.indptr[b + 1] - t.indptr[b]
        for g in range(s.shape[1]):
            ranked = sorted(range(n - 1), key=lambda i: (-s[a + i, g], i))
            rows.append(sorted(ranked[:top_k - 1] + ([n - 1] if n else [])))
    return rows


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_selection_vs_brute_force(rng, page_size, per_kv_head):
    cache, t = random_batch(rng, page_size)
    kmin, kmax = page_key_summaries(cache, t)
    bmin, bmax = brute_summaries(cache, t)
    assert_close(kmin, bmin, what="kmin")
    assert_close(kmax, bmax, what="kmax")
    hnd = page_key_summaries(cache[:, 0].transpose(0, 2, 1, 3), t, kv_layout="HND")
    np.testing.assert_array_equal(hnd[0], kmin)
    np.testing.assert_array_equal(hnd[1], kmax)
    q = rng.standard_normal((t.batch_size, HQ, D))
    scores = quest_page_scores(q, kmin, kmax, t, per_kv_head=per_kv_head)
    assert_close(scores, brute_scores(q, kmin, kmax, t, per_kv_head), what="scores")
    for top_k in (1, 2, 3, 50):
        sel = select_topk_pages(t, scores, top_k)
        want = brute_select(scores, t, top_k)
        got = [sel.logical[sel.table.indptr[r]:sel.table.indptr[r + 1]].tolist()
               for r in range(sel.table.batch_size)]
        assert got == want
        rows_req = np.repeat(np.arange(t.batch_size), HKV if per_kv_head else 1)
        assert sel.request.tolist() == rows_req.tolist()
        # Indices only: the kept entries are the source table's, last page kept with its length.
        for r, b in enumerate(rows_req):
            src = t.indices[t.indptr[b]:t.indptr[b + 1]]
            assert sel.table.indices[sel.table.indptr[r]:sel.table.indptr[r + 1]].tolist() == \
                src[want[r]].tolist()
        np.testing.assert_array_equal(sel.table.last_page_len, t.last_page_len[rows_req])
        assert isinstance(sel.bsr, BSR) and sel.bsr.block_shape == (1, page_size)


def test_bound_holds_and_ties_go_to_earlier_pages(rng):
    cache, t = random_batch(rng, 3)
    kmin, kmax = page_key_summaries(cache, t)
    q = rng.standard_normal((t.batch_size, HKV, D))  # group size 1: per-kv-head = per-head
    bound = quest_page_scores(q, kmin, kmax, t, per_kv_head=True)
    for b in range(t.batch_size):
        k, _ = request_kv(cache, "NHD", t.indptr, t.indices, t.last_page_len, 3, b)
        for tok in range(k.shape[0]):
            entry = t.indptr[b] + tok // 3
            assert np.all(np.einsum("hd,hd->h", q[b], k[tok]) <= bound[entry] + 1e-12)
    sel = select_topk_pages(t, np.zeros(t.indices.size), 3)
    for r in range(t.batch_size):
        n = t.indptr[r + 1] - t.indptr[r]
        want = sorted(set(range(min(2, n - 1))) | {n - 1}) if n else []
        assert sel.logical[sel.table.indptr[r]:sel.table.indptr[r + 1]].tolist() == want


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_decode_over_selection_equals_masked_dense(rng, per_kv_head):
    ps = 2
    cache, t = random_batch(rng, ps)
    q = rng.standard_normal((t.batch_size, HQ, D))
    sel = select_topk_pages(t, quest_page_scores(q, *page_key_summaries(cache, t), t,
                                                 per_kv_head=per_kv_head), 3)
    assert isinstance(sel, TopKPages)
    group, lens = HQ // HKV, t.kv_lens()
    want = np.zeros_like(q)
    for r in range(sel.table.batch_size):
        b = int(sel.request[r])
        k, v = request_kv(cache, "NHD", t.indptr, t.indices, t.last_page_len, ps, b)
        heads = slice(None) if not per_kv_head else slice((r % HKV) * group,
                                                          (r % HKV + 1) * group)
        visible = sel.token_mask(r, int(lens[b]))[None, :]
        o, _ = dense_attention(q[b][None], k, v, visible=visible)
        want[b, heads] = o[0, heads]
    if per_kv_head:
        got = np.zeros_like(q)
        for g in range(HKV):
            tg, heads = sel.for_kv_head(g), slice(g * group, (g + 1) * group)
            got[:, heads] = batch_decode_with_paged_kv_cache(
                q[:, heads], cache[:, :, :, g:g + 1], tg.indptr, tg.indices, tg.last_page_len)
    else:
        got = batch_decode_with_paged_kv_cache(q, cache, sel.table.indptr, sel.table.indices,
                                               sel.table.last_page_len)
    assert_close(got, want, what="top-k decode")


def test_validation_names_the_argument(rng):
    cache, t = random_batch(rng, 2)
    kmin, kmax = page_key_summaries(cache, t)
    q = rng.standard_normal((t.batch_size, HQ, D))
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        select_topk_pages(t, np.zeros(t.indices.size), 0)
    with pytest.raises(ValueError, match="scores must be finite with shape"):
        select_topk_pages(t, np.zeros(t.indices.size + 1), 2)
    with pytest.raises(TypeError, match="table must be a PageTable"):
        select_topk_pages((t.indptr, t.indices), np.zeros(t.indices.size), 2)
    with pytest.raises(ValueError, match="k_cache must hold table.num_pages"):
        page_key_summaries(cache[:-1], t)
    with pytest.raises(ValueError, match="q must have shape"):
        quest_page_scores(q[:, :3], kmin, kmax, t)
    with pytest.raises(ValueError, match="kmin and kmax must both"):
        quest_page_scores(q, kmin[:-1], kmax, t)
    with pytest.raises(ValueError, match="for_kv_head needs a per_kv_head selection"):
        select_topk_pages(t, np.zeros(t.indices.size), 2).for_kv_head(0)
    assert select_topk_pages(t, np.zeros(t.indices.size), 2).plot() is not None
