"""Regressions from reading the issue-11 api: masks are snapshots, a rejected output writes
nothing, K and V views of one pool append correctly in the simulator, odd byte strides raise."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SIMULATOR, TOLERANCE, rel_err

import nbinfer
from nbinfer import reference
from nbinfer.formats import PageTable

BACKENDS = ["reference"] + (["sim"] if SIMULATOR else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_mask_is_snapshotted_at_plan(rng, backend):
    qo, kv = np.array([0, 3]), np.array([0, 5])
    q = rng.standard_normal((3, 2, 64)).astype(np.float32)
    k = rng.standard_normal((5, 1, 64)).astype(np.float32)
    v = rng.standard_normal((5, 1, 64)).astype(np.float32)
    mask = rng.random(15) < 0.7
    mask[::5] = True
    want = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo, kv, custom_mask=mask)
    w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(np.zeros(1 << 22, np.uint8),
                                                     backend=backend)
    w.plan(qo, kv, 2, 1, 64, custom_mask=mask, q_data_type="float32")
    mask[:] = ~mask  # the caller reuses its buffer after plan()
    assert rel_err(w.run(q, k, v), want) <= TOLERANCE["float32"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_sparse_mask_is_snapshotted_at_plan(rng, backend):
    q = rng.standard_normal((4, 1, 64)).astype(np.float32)
    k = rng.standard_normal((4, 1, 64)).astype(np.float32)
    v = rng.standard_normal((4, 1, 64)).astype(np.float32)
    indptr, indices = np.array([0, 2, 3]), np.array([1, 0, 1])
    mask = rng.random((3, 2, 2)) < 0.6
    mask[:, :, 0] = True
    want = reference.block_sparse_attention(q, k, v, indptr, indices, 2, 2, mask=mask)
    w = nbinfer.BlockSparseAttentionWrapper(np.zeros(1 << 22, np.uint8), backend=backend)
    w.plan(indptr, indices, 4, 4, 2, 2, 1, 1, 64, mask=mask, q_data_type="float32")
    mask[:] = ~mask
    assert rel_err(w.run(q, k, v), want) <= TOLERANCE["float32"]


def test_reference_backend_rejected_lse_leaves_out_untouched(rng):
    pt = PageTable.from_kv_lens([9, 4], 4, rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, 4, 1, 64)).astype(np.float32)
    q = rng.standard_normal((2, 2, 64)).astype(np.float32)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8),
                                                   backend="reference")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 4, q_data_type="float32")
    out = np.full((2, 2, 64), 7.0, np.float32)
    with pytest.raises(TypeError, match="lse"):
        w.run(q, cache, out=out, lse=np.zeros((2, 2), np.float64))
    assert np.all(out == 7.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_into_k_and_v_views_of_one_pool(rng, backend):
    pt = PageTable.from_kv_lens([6, 3], 4, rng=rng)
    pool = rng.standard_normal((pt.num_pages, 2, 4, 1, 64)).astype(np.float32)
    want = pool.copy()
    key = rng.standard_normal((2, 1, 64)).astype(np.float32)
    value = rng.standard_normal((2, 1, 64)).astype(np.float32)
    bi, pos = np.array([0, 1], np.int32), np.array([5, 2], np.int32)
    reference.append_paged_kv_cache(key, value, bi, pos, want, pt.indices, pt.indptr,
                                    pt.last_page_len)
    nbinfer.append_paged_kv_cache(key, value, bi, pos, (pool[:, 0], pool[:, 1]), pt.indices,
                                  pt.indptr, pt.last_page_len, backend=backend)
    np.testing.assert_array_equal(pool, want)


def test_byte_strides_that_are_not_whole_elements_raise(rng):
    rec = np.zeros((2, 2, 64), dtype=[("x", np.float32), ("pad", np.uint8)])
    q = rec["x"]  # strides of 5-byte records: not whole float32 elements
    pt = PageTable.from_kv_lens([3, 2], 4, rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, 4, 1, 64)).astype(np.float32)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8),
                                                   backend="sim" if SIMULATOR else "reference")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 4, q_data_type="float32")
    if SIMULATOR:
        with pytest.raises(ValueError, match="strides"):
            w.run(q, cache)


def test_a_trusted_step_plan_equals_a_constructed_one(rng):
    # decode's plan() builds its StepPlan without the frozen __init__: the same object, frozen
    import dataclasses

    from nbinfer.api.step import StepPlan

    pt = PageTable.from_kv_lens([40, 7], 16, rng=rng)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend="sim"
                                                   if SIMULATOR else "reference")
    for _ in range(2):  # the second plan() takes the compiled path
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 16)
    step = w.step_plan
    values = {f.name: getattr(step, f.name) for f in dataclasses.fields(StepPlan)}
    assert StepPlan(**values) == step == StepPlan._trusted(**values)
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.batch_size = 3
    with pytest.raises(TypeError, match="missing.*kv_lens"):
        StepPlan._trusted(**{k: v for k, v in values.items() if k != "kv_lens"})
    with pytest.raises(TypeError, match="unknown.*kv_len"):
        StepPlan._trusted(**values, kv_len=5)
