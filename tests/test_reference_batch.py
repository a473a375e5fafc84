"""Batch decode and batch prefill (paged and ragged) against the brute-force oracle."""

from __future__ import annotations

import math

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

from nbinfer.formats import segment_packbits
from nbinfer.reference import (
    batch_decode_with_paged_kv_cache,
    batch_prefill_with_paged_kv_cache,
    batch_prefill_with_ragged_kv_cache,
)
from nbinfer.variants import attention_sink, soft_cap

HKV, D = 2, 8
SINK = attention_sink([0.3, -0.2, 1.0, 0.0, 0.1, 0.2, -0.5, 0.7])


def _tol(variant):
    return "float32" if hooks_round_to_float32(variant) else "float64"


def _close_lse(lse, lse_ref, dtype="float64"):
    fin = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], lse_ref[fin], dtype)


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_batch_decode(rng, page_size, layout, as_tuple, group):
    kv_lens = [0, 1, page_size, int(rng.integers(2, 40))]
    hq = HKV * group
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, page_size, HKV, D,
                                                      kv_layout=layout, as_tuple=as_tuple,
                                                      dtype=np.float32)
    q = rng.standard_normal((len(kv_lens), hq, D)).astype(np.float16)
    o, lse = batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last, kv_layout=layout,
                                              return_lse=True)
    assert o.shape == (len(kv_lens), hq, D) and o.dtype == np.float64
    for b in range(len(kv_lens)):
        k, v = request_kv(cache, layout, indptr, indices, last, page_size, b)
        assert k.shape[0] == kv_lens[b]
        o_ref, lse_ref = dense_attention(q[b:b + 1], k, v)
        assert_close(o[b], o_ref[0], what=f"request {b}")
        _close_lse(lse[b], lse_ref[0])
    assert np.all(o[0] == 0) and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("flags", [
    dict(pos_encoding_mode="ROPE_LLAMA", window_left=4),
    dict(pos_encoding_mode="ALIBI", logits_soft_cap=4.0, sm_scale=0.5),
])
def test_batch_decode_flags_and_variant(rng, flags):
    kv_lens, page_size, hq = [3, 17, 9], 4, 8
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, page_size, HKV, D)
    q = rng.standard_normal((3, hq, D))
    o, lse = batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last, variant=SINK,
                                              return_lse=True, lse_base=2, **flags)
    sm_scale = flags.pop("sm_scale", None)
    variant = flag_variant(hq, SINK, **flags)
    for b in range(3):
        k, v = request_kv(cache, "NHD", indptr, indices, last, page_size, b)
        o_ref, lse_ref = dense_attention(q[b:b + 1], k, v, sm_scale=sm_scale, variant=variant)
        assert_close(o[b], dense_output(o_ref, lse_ref, variant)[0], _tol(variant))
        assert_close(lse[b], lse_ref[0] / math.log(2), _tol(variant))


def _requests(rng, kv_lens, max_qo=6):
    # Any qo_len, including 0 and qo_len > kv_len (causal then hides every key from early rows).
    return [int(rng.integers(0, max_qo + 1)) for _ in kv_lens]


def _prefill_masks(rng, qo_lens, kv_lens):
    masks = [rng.random((a, b)) < 0.7 for a, b in zip(qo_lens, kv_lens, strict=True)]
    flat = np.concatenate([m.ravel() for m in masks]) if masks else np.zeros(0, bool)
    sizes = np.array([m.size for m in masks])
    packed, mask_indptr = segment_packbits(flat, np.concatenate([[0], np.cumsum(sizes)]),
                                           bitorder="little")
    return masks, flat, packed, mask_indptr


def _check_batch(q, qo_indptr, kvs, o, lse, variant, masks=None, sm_scale=None):
    for b, (k, v) in enumerate(kvs):
        a, e = qo_indptr[b], qo_indptr[b + 1]
        if a == e:
            continue
        vis = None if masks is None else masks[b]
        o_ref, lse_ref = dense_attention(q[a:e], k, v, sm_scale=sm_scale, variant=variant,
                                         visible=vis)
        assert_close(o[a:e], dense_output(o_ref, lse_ref, variant), _tol(variant),
                     what=f"request {b}")
        _close_lse(lse[a:e], lse_ref, _tol(variant))


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("mask_kind", [None, "bool", "packed"])
def test_batch_prefill_paged(rng, page_size, layout, mask_kind):
    kv_lens = [int(rng.integers(0, 30)) for _ in range(3)] + [7]
    qo_lens = _requests(rng, kv_lens)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    hq = 2 * HKV
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, page_size, HKV, D,
                                                      kv_layout=layout,
                                                      as_tuple=page_size == 5)
    q = rng.standard_normal((qo_indptr[-1], hq, D))
    masks, flat, packed, mask_indptr = _prefill_masks(rng, qo_lens, kv_lens)
    kw = {None: {}, "bool": dict(custom_mask=flat),
          "packed": dict(packed_custom_mask=packed, mask_indptr=mask_indptr)}[mask_kind]
    o, lse = batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last,
                                               causal=True, kv_layout=layout, return_lse=True,
                                               **kw)
    kvs = [request_kv(cache, layout, indptr, indices, last, page_size, b)
           for b in range(len(kv_lens))]
    _check_batch(q, qo_indptr, kvs, o, lse, flag_variant(hq, causal=True),
                 masks=None if mask_kind is None else masks)


def test_batch_prefill_paged_packed_mask_without_indptr(rng):
    kv_lens, qo_lens, hq, page_size = [9, 4, 12], [3, 4, 1], 2, 3
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    cache, indptr, indices, last = random_paged_cache(rng, kv_lens, page_size, HKV, D)
    q = rng.standard_normal((qo_indptr[-1], hq, D))
    masks, _, packed, _ = _prefill_masks(rng, qo_lens, kv_lens)
    o, lse = batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last,
                                               packed_custom_mask=packed, window_left=3,
                                               logits_soft_cap=2.0, return_lse=True)
    kvs = [request_kv(cache, "NHD", indptr, indices, last, page_size, b) for b in range(3)]
    _check_batch(q, qo_indptr, kvs, o, lse, flag_variant(hq, window_left=3, logits_soft_cap=2.0),
                 masks=masks)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("mask_kind", [None, "packed"])
def test_batch_prefill_ragged(rng, layout, group, mask_kind):
    kv_lens = [int(rng.integers(0, 25)) for _ in range(4)]
    qo_lens = _requests(rng, kv_lens)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int64)
    hq = HKV * group
    q = rng.standard_normal((qo_indptr[-1], hq, D)).astype(np.float32)
    k = rng.standard_normal((kv_indptr[-1], HKV, D))
    v = rng.standard_normal((kv_indptr[-1], HKV, D))
    masks, _, packed, mask_indptr = _prefill_masks(rng, qo_lens, kv_lens)
    kw = {} if mask_kind is None else dict(packed_custom_mask=packed)
    flags = dict(causal=True, pos_encoding_mode="ROPE_LLAMA", rope_theta=100.0)
    args = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    o, lse = batch_prefill_with_ragged_kv_cache(q, *args, qo_indptr, kv_indptr, kv_layout=layout,
                                                return_lse=True, **flags, **kw)
    kvs = [(k[kv_indptr[b]:kv_indptr[b + 1]], v[kv_indptr[b]:kv_indptr[b + 1]])
           for b in range(4)]
    _check_batch(q, qo_indptr, kvs, o, lse, flag_variant(hq, **flags),
                 masks=None if mask_kind is None else masks)


def test_batch_prefill_ragged_soft_cap_variant(rng):
    qo_indptr, kv_indptr = np.array([0, 2, 5]), np.array([0, 6, 10])
    q = rng.standard_normal((5, 4, D))
    k, v = rng.standard_normal((10, 1, D)), rng.standard_normal((10, 1, D))
    variant = soft_cap(1.5)
    o, lse = batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, variant=variant,
                                                sm_scale=1.0, return_lse=True)
    kvs = [(k[:6], v[:6]), (k[6:], v[6:])]
    _check_batch(q, qo_indptr, kvs, o, lse, variant, sm_scale=1.0)
