"""Decode kernels vs the float64 reference: simulator at tiny shapes, the H200 at real ones."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer import variants as V
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper, split_kv_plan
from nbinfer.formats import PageTable


def _case(rng, kv_lens, hq, hkv, d, ps, dtype, layout, tuple_cache=False):
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 2,
                                rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(dtype)
    if tuple_cache:
        cache = (np.ascontiguousarray(cache[:, 0]), np.ascontiguousarray(cache[:, 1]))
    q = rng.standard_normal((len(kv_lens), hq, d)).astype(dtype)
    return pt, cache, q


def _run(pt, cache, q, hkv, ps, layout, **plan_kw):
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, q.shape[1], hkv, q.shape[2], ps,
           q_data_type=q.dtype, **plan_kw)
    return w, w.run(q, cache, return_lse=True)


@pytest.mark.parametrize(
    "kv_lens, hq, hkv, d, ps, dtype, layout, tuple_cache",
    [
        ([5, 200], 4, 1, 64, 3, np.float16, "NHD", False),  # request 1 is split: merge kernel
        ([1, 17], 2, 2, 64, 1, np.float32, "HND", True),
        ([0, 9], 8, 2, 128, 16, np.float16, "NHD", False),  # an empty request
        ([3, 9], 2, 2, 256, 7, np.float32, "HND", False),  # rows of 64 16-byte chunks
    ],
)
def test_decode_matches_reference(rng, kv_lens, hq, hkv, d, ps, dtype, layout, tuple_cache):
    pt, cache, q = _case(rng, kv_lens, hq, hkv, d, ps, dtype, layout, tuple_cache)
    _, (out, lse) = _run(pt, cache, q, hkv, ps, layout)
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, kv_layout=layout, return_lse=True)
    assert out.dtype == q.dtype
    assert rel_err(out, ref) <= TOLERANCE[np.dtype(dtype).name]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)
    assert np.all(lse[~finite] == -np.inf) and np.all(out[~finite] == 0)


@pytest.mark.parametrize(
    "plan_kw",
    [
        dict(logits_soft_cap=5.0, window_left=7),
        dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0),
        dict(pos_encoding_mode="ALIBI"),
        dict(variant=V.sigmoid_attention(0.7, -0.5)),
        dict(variant=V.attention_sink([0.5, -1.0, 2.0, 0.0])),
    ],
    ids=["softcap+window", "rope", "alibi", "sigmoid", "sink"],
)
def test_decode_variants(rng, plan_kw):
    pt, cache, q = _case(rng, [3, 30], 4, 2, 64, 4, np.float32, "NHD")
    _, (out, _) = _run(pt, cache, q, 2, 4, "NHD", **plan_kw)
    ref = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, **plan_kw)
    assert rel_err(out, ref) <= 1e-4


def test_split_plan_covers_every_token_once():
    lens = np.array([1, 1000, 37, 0, 513])
    plan = split_kv_plan(lens, 2, target_ctas=16, granule=32)
    for b, n in enumerate(lens):
        for hk in range(2):
            items = plan.work[(plan.work[:, 0] == b) & (plan.work[:, 1] == hk)]
            covered = np.concatenate([np.arange(s, e) for s, e in items[:, 2:4]])
            assert np.array_equal(np.sort(covered), np.arange(n))
    split_rows = set(plan.merge_rows.tolist())
    pieces = np.bincount(plan.work[plan.work[:, 1] == 0, 0], minlength=lens.size)
    assert split_rows == {b for b in range(lens.size) if pieces[b] > 1}
    assert np.all(plan.work[~np.isin(plan.work[:, 0], list(split_rows)), 4] == -1)
    # chunks of one request are equal up to the last one (no long piece plus a sliver)
    for b in split_rows:
        sizes = np.diff(plan.work[(plan.work[:, 0] == b) & (plan.work[:, 1] == 0)][:, 2:4]).ravel()
        assert np.all(sizes[:-1] == sizes[0]) and sizes[-1] > 0


def test_split_plan_does_not_split_a_batch_that_fills_the_gpu():
    plan = split_kv_plan(np.full(64, 4096), 8, target_ctas=528, granule=32)
    assert plan.work.shape[0] == 512 and plan.merge_rows.size == 0
    plan = split_kv_plan(np.full(16, 32768), 8, target_ctas=528, granule=32)
    assert plan.work.shape[0] == 512 and plan.merge_rows.size == 16


def test_run_errors(rng):
    pt, cache, q = _case(rng, [3, 5], 4, 2, 64, 4, np.float16, "NHD")
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 16, np.uint8), "NHD")
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, cache)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 4, q_data_type="float16")
    with pytest.raises(ValueError, match="batch_size"):
        w.run(q[:1], cache)
    with pytest.raises(TypeError, match="q must have dtype float16"):
        w.run(q.astype(np.float32), cache)
    with pytest.raises(ValueError, match="page_size"):
        w.run(q, np.zeros((pt.num_pages, 2, 8, 2, 64), np.float16))
    with pytest.raises(ValueError, match="indices values"):
        w.run(q, cache[:2])
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 3, 2, 64, 4)
    with pytest.raises(ValueError, match="last_page_len"):
        w.plan(pt.indptr, pt.indices, np.array([0, 9]), 4, 2, 64, 4)
    with pytest.raises(ValueError, match="kv_layout"):
        BatchDecodeWithPagedKVCacheWrapper(np.zeros(16, np.uint8), "NDH")
