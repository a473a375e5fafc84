"""Block-sparse and multi-level cascade attention against the brute-force oracle."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close
from dense import (
    dense_attention,
    dense_output,
    flag_variant,
    hooks_round_to_float32,
    random_paged_cache,
    request_kv,
)

from nbinfer.formats import packbits
from nbinfer.reference import block_sparse_attention, multi_level_cascade_attention
from nbinfer.variants import attention_sink, sigmoid_attention

HKV, D = 2, 8


def _tol(variant):
    return "float32" if hooks_round_to_float32(variant) else "float64"


def _random_bsr(rng, m, n, r, c, density=0.5):
    rows, cols = -(-m // r), -(-n // c)
    per_row = [rng.permutation(cols)[:int(rng.binomial(cols, density))] for _ in range(rows)]
    indptr = np.concatenate([[0], np.cumsum([p.size for p in per_row])]).astype(np.int32)
    indices = (np.concatenate(per_row) if per_row else np.zeros(0)).astype(np.int32)
    return indptr, indices


def _oracle_visible(m, n, r, c, indptr, indices, elem):
    stored = {}
    for br in range(indptr.size - 1):
        for kk in range(indptr[br], indptr[br + 1]):
            stored[(br, int(indices[kk]))] = kk
    vis = np.zeros((m, n), dtype=bool)
    for i in range(m):
        for j in range(n):
            kk = stored.get((i // r, j // c))
            vis[i, j] = kk is not None and (elem is None or bool(elem[kk, i % r, j % c]))
    return vis


@pytest.mark.parametrize("rc", [(1, 1), (16, 1), (1, 16), (4, 4), (16, 16)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "packed"])
def test_block_sparse(rng, rc, mask_kind):
    r, c = rc
    m, n = int(rng.integers(1, 24)), int(rng.integers(1, 40))
    if m % r == 0 and r > 1:
        m += 1  # keep a partial last block row
    indptr, indices = _random_bsr(rng, m, n, r, c)
    hq = 2 * HKV
    q = rng.standard_normal((m, hq, D))
    k, v = rng.standard_normal((n, HKV, D)), rng.standard_normal((n, HKV, D))
    elem = rng.random((indices.size, r, c)) < 0.7
    kw = {None: {}, "bool": dict(mask=elem),
          "packed": dict(packed_mask=packbits(elem.ravel(), "little"))}[mask_kind]
    o, lse = block_sparse_attention(q, k, v, indptr, indices, r, c, return_lse=True, **kw)
    vis = _oracle_visible(m, n, r, c, indptr, indices, None if mask_kind is None else elem)
    o_ref, lse_ref = dense_attention(q, k, v, visible=vis)
    assert_close(o, o_ref)
    fin = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], lse_ref[fin])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_block_sparse_causal_flags(rng, layout):
    # Bottom-right causal: row i sits at position i + N - M.
    m, n, r, c = 10, 23, 4, 3
    indptr, indices = _random_bsr(rng, m, n, r, c, density=0.8)
    q = rng.standard_normal((m, 4, D))
    k, v = rng.standard_normal((n, HKV, D)), rng.standard_normal((n, HKV, D))
    flags = dict(causal=True, pos_encoding_mode="ALIBI", window_left=9)
    args = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    o = block_sparse_attention(q, *args, indptr, indices, r, c, kv_layout=layout, **flags)
    vis = _oracle_visible(m, n, r, c, indptr, indices, None)
    o_ref, _ = dense_attention(q, k, v, variant=flag_variant(4, **flags), visible=vis)
    assert_close(o, o_ref)


# -- cascade ---------------------------------------------------------------------------------------

def _cascade_case(rng, level_segments, page_size, qo_lens, as_tuple=False, layout="NHD"):
    """Random cascade: level_segments[l] lists, per level-l segment, the last-level requests it
    covers; returns cache, per-level tables, qo_indptr_arr and per-level kv lengths."""
    kv_lens = [[int(rng.integers(0, 14)) for _ in segs] for segs in level_segments]
    kv_lens[0][0] = max(kv_lens[0][0], 1)
    flat = [n for lvl in kv_lens for n in lvl]
    cache, indptr, indices, last = random_paged_cache(rng, flat, page_size, HKV, D,
                                                      kv_layout=layout, as_tuple=as_tuple)
    qo_ptr_last = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    tables, qo_arr, start = [], [], 0
    for segs in level_segments:
        end = start + len(segs)
        ptr = indptr[start:end + 1] - indptr[start]
        tables.append((ptr, indices[indptr[start]:indptr[end]], last[start:end]))
        qo_arr.append(np.array([0] + [qo_ptr_last[s[-1] + 1] for s in segs], dtype=np.int32))
        start = end
    return cache, tables, qo_arr, kv_lens


def _cascade_oracle(q, cache, layout, page_size, tables, qo_arr, level_segments, variant,
                    causal):
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    nreq = qo_arr[-1].size - 1
    for b in range(nreq):
        a, e = qo_arr[-1][b], qo_arr[-1][b + 1]
        ks, vs = [], []
        for lvl, segs in enumerate(level_segments):
            s = next(i for i, seg in enumerate(segs) if b in seg)
            k, v = request_kv(cache, layout, *tables[lvl], page_size, s)
            ks.append(k)
            vs.append(v)
        k, v = np.concatenate(ks), np.concatenate(vs)
        total, own, qo_len = k.shape[0], ks[-1].shape[0], e - a
        q_pos = np.arange(qo_len) + total - qo_len
        vis = np.ones((qo_len, total), dtype=bool)
        if causal:  # only the last level's keys are masked
            vis[:, total - own:] = np.arange(total - own, total)[None, :] <= q_pos[:, None]
        o_ref, lse_ref = dense_attention(q[a:e], k, v, variant=variant, visible=vis)
        out[a:e], lse[a:e] = dense_output(o_ref, lse_ref, variant), lse_ref
    return out, lse


LEVELS = {
    "two": [[[0, 1, 2]], [[0], [1], [2]]],
    "three": [[[0, 1, 2, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]]],
}


@pytest.mark.parametrize("levels", list(LEVELS))
@pytest.mark.parametrize("page_size", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_cascade_vs_concatenated(rng, levels, page_size, causal):
    segs = LEVELS[levels]
    nreq = len(segs[-1])
    qo_lens = [int(rng.integers(0, 5)) for _ in range(nreq)]
    qo_lens[0] = 3
    layout = "HND" if page_size == 5 else "NHD"
    cache, tables, qo_arr, _ = _cascade_case(rng, segs, page_size, qo_lens,
                                             as_tuple=causal, layout=layout)
    hq = 2 * HKV
    q = rng.standard_normal((qo_arr[0][-1], hq, D))
    flags = dict(pos_encoding_mode="ROPE_LLAMA", window_left=12)
    o, lse = multi_level_cascade_attention(
        q, qo_arr, cache, [t[0] for t in tables], [t[1] for t in tables],
        [t[2] for t in tables], causal=causal, kv_layout=layout, return_lse=True, **flags)
    o_ref, lse_ref = _cascade_oracle(q, cache, layout, page_size, tables, qo_arr, segs,
                                     flag_variant(hq, **flags), causal)
    assert_close(o, o_ref)
    fin = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], lse_ref[fin])


@pytest.mark.parametrize("extra", [attention_sink([0.1, 0.4, -0.3, 1.2]),
                                   sigmoid_attention(0.8, 0.1)])
def test_cascade_output_transform_and_sigmoid(rng, extra):
    segs = LEVELS["two"]
    cache, tables, qo_arr, _ = _cascade_case(rng, segs, 4, [2, 3, 1])
    q = rng.standard_normal((6, 4, D))
    o = multi_level_cascade_attention(q, qo_arr, cache, [t[0] for t in tables],
                                      [t[1] for t in tables], [t[2] for t in tables],
                                      causal=True, variant=extra)
    variant = flag_variant(4, extra)
    o_ref, _ = _cascade_oracle(q, cache, "NHD", 4, tables, qo_arr, segs, variant, True)
    assert_close(o, o_ref, _tol(variant))


def test_cascade_single_level_is_batch_prefill(rng):
    from nbinfer.reference import batch_prefill_with_paged_kv_cache

    cache, indptr, indices, last = random_paged_cache(rng, [5, 9], 3, HKV, D)
    qo_indptr = np.array([0, 2, 6])
    q = rng.standard_normal((6, 2, D))
    o1 = multi_level_cascade_attention(q, [qo_indptr], cache, [indptr], [indices], [last],
                                       causal=True)
    o2 = batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last,
                                           causal=True)
    assert_close(o1, o2)


def _sub_table(indptr, indices, last, reqs):
    """The page table of the listed requests only."""
    pages = [indices[indptr[r]:indptr[r + 1]] for r in reqs]
    ptr = np.concatenate([[0], np.cumsum([p.size for p in pages])]).astype(np.int32)
    return ptr, np.concatenate(pages).astype(np.int32), last[list(reqs)]


def test_cascade_empty_segment_is_skipped(rng):
    # A repeated boundary makes an empty qo segment; its pages are read by no query.
    cache, indptr, indices, last = random_paged_cache(rng, [6, 4, 3, 5], 3, HKV, D)
    q = rng.standard_normal((6, 2, D))
    lvl0 = _sub_table(indptr, indices, last, [0])
    runs = []
    for qo1, reqs in (([0, 3, 3, 6], [1, 2, 3]), ([0, 3, 6], [1, 3])):
        lvl1 = _sub_table(indptr, indices, last, reqs)
        runs.append(multi_level_cascade_attention(
            q, [np.array([0, 6]), np.array(qo1)], cache, [lvl0[0], lvl1[0]], [lvl0[1], lvl1[1]],
            [lvl0[2], lvl1[2]], causal=True))
    assert_close(runs[0], runs[1])
