"""Prefill tile kernel vs the float64 reference in the simulator (tiny shapes)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import LSE_TOLERANCE, TOLERANCE, rel_err

from nbinfer import reference
from nbinfer import variants as V
from nbinfer.api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
)
from nbinfer.formats import PageTable, segment_packbits


def _ws():
    return np.zeros(1 << 22, np.uint8)


def _paged(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout):
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 1,
                                rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(dtype)
    return pt, cache, qo_indptr, q


def _check(out, lse, ref, ref_lse, dtype, softmax=True):
    assert rel_err(out, ref) <= TOLERANCE[np.dtype(dtype).name]
    if softmax:
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite],
                                   atol=LSE_TOLERANCE[np.dtype(dtype).name])
        assert np.all(lse[~finite] == -np.inf)


@pytest.mark.parametrize(
    "qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw",
    [
        ([3, 5], [20, 9], 4, 2, 64, 4, np.float32, "NHD", dict(causal=True)),
        ([7], [7], 4, 1, 64, 16, np.float16, "HND", dict(causal=True)),  # 2 query tiles (G=4)
        ([2, 1], [30, 0], 2, 2, 64, 5, np.float32, "NHD", {}),  # an empty KV
        ([4], [40], 4, 2, 64, 8, np.float32, "NHD",
         dict(causal=True, fixed_split_size=16)),  # split tile: merged in the kernel
        ([3], [25], 4, 2, 64, 4, np.float32, "NHD",
         dict(pos_encoding_mode="ROPE_LLAMA", window_left=6, logits_soft_cap=3.0)),
        ([3], [25], 4, 2, 64, 4, np.float32, "HND", dict(pos_encoding_mode="ALIBI")),
    ],
    ids=["causal", "two-tiles-fp16-HND", "empty-kv", "split-merged", "rope-window-cap", "alibi"],
)
def test_paged_prefill(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw):
    pt, cache, qo_indptr, q = _paged(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), layout)
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
           q_data_type=q.dtype, **kw)
    if "fixed_split_size" in kw:
        assert w.schedule.num_merge_rows > 0
    out, lse = w.run(q, cache, return_lse=True)
    kw.pop("fixed_split_size", None)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, kv_layout=layout,
        return_lse=True, **kw)
    assert out.dtype == q.dtype
    _check(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("packed", [False, True])
def test_ragged_prefill_custom_mask_and_sigmoid(rng, packed):
    hq, hkv, d = 2, 1, 64  # qo lengths 3 and 2, kv lengths 6 and 11
    qo_indptr = np.array([0, 3, 5])
    kv_indptr = np.array([0, 6, 17])
    q = rng.standard_normal((5, hq, d)).astype(np.float32)
    k = rng.standard_normal((17, hkv, d)).astype(np.float32)
    v = rng.standard_normal((17, hkv, d)).astype(np.float32)
    mask = rng.random(3 * 6 + 2 * 11) < 0.6
    kw = dict(custom_mask=mask)
    if packed:
        sizes = np.array([18, 22])
        kw = dict(packed_custom_mask=segment_packbits(
            mask, np.concatenate([[0], np.cumsum(sizes)]), bitorder="little")[0])
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float32", **kw)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, custom_mask=mask, return_lse=True)
    _check(out, lse, ref, ref_lse, np.float32)

    sig = V.sigmoid_attention(0.5, -0.2)
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float32", causal=True, variant=sig)
    out = w.run(q, k, v)
    ref = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr,
                                                       causal=True, variant=sig)
    assert rel_err(out, ref) <= TOLERANCE["float32"]


def test_single_prefill_hnd(rng):
    q = rng.standard_normal((4, 4, 64)).astype(np.float16)
    k = rng.standard_normal((2, 13, 64)).astype(np.float16)
    v = rng.standard_normal((2, 13, 64)).astype(np.float16)
    out, lse = single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout="HND",
                                            return_lse=True)
    ref, ref_lse = reference.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout="HND",
                                                          return_lse=True)
    _check(out, lse, ref, ref_lse, np.float16)


def test_prefill_errors(rng):
    pt, cache, qo_indptr, q = _paged(rng, [2, 3], [5, 9], 4, 2, 64, 4, np.float32, "NHD")
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    with pytest.raises(RuntimeError, match="before plan"):
        w.run(q, cache)
    with pytest.raises(ValueError, match="qo_indptr"):
        w.plan(np.array([0, 2]), pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 4)
    with pytest.raises(ValueError, match="custom_mask"):
        w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 4,
               custom_mask=np.ones(7, bool))
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 4,
           q_data_type="float32")
    with pytest.raises(ValueError, match="qo_indptr"):
        w.run(q[:4], cache)
    with pytest.raises(TypeError, match="q must have dtype float32"):
        w.run(q.astype(np.float16), cache)
    with pytest.raises(ValueError, match="page_size"):
        w.run(q, np.zeros((pt.num_pages, 2, 8, 2, 64), np.float32))
