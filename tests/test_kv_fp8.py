"""FP8 KV caches (e4m3fn, e5m2) with FlashInfer's q/k/v scales, on the simulator's kernels.

The expected values come from the float64 reference engine run on the dequantised cache
(:func:`nbinfer.reference.fp8.decode` times the scale), never from the API's own reference
backend, so the scale semantics are checked independently: logits ``q.k * sm_scale * q_scale *
k_scale``, output times ``v_scale``. FP8 values are exact in float32, so the tolerance is the
query dtype's (the output is rounded to it).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

import nbinfer
from nbinfer import reference
from nbinfer import variants as V
from nbinfer.formats import PageTable
from nbinfer.reference import fp8

FORMATS = ("float8_e4m3fn", "float8_e5m2")


def _codes(rng, shape, fmt, spread=2.0):
    """Random FP8 codes of values ~ N(0, spread^2): no NaN, no infinity."""
    return fp8.encode(rng.standard_normal(shape) * spread, fmt)


def _paged(rng, kv_lens, hkv, d, ps, layout, fmt):
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 3,
                                rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    return pt, _codes(rng, shape, fmt)


def _dequant(cache, fmt, k_scale, v_scale):
    return fp8.decode(cache[:, 0], fmt, k_scale), fp8.decode(cache[:, 1], fmt, v_scale)


@pytest.mark.parametrize(
    "fmt, kv_lens, hq, hkv, d, ps, q_dtype, layout, plan_kw",
    [
        ("float8_e4m3fn", [5, 300], 4, 1, 64, 16, "float16", "NHD", {}),  # G 4, a split request
        ("float8_e5m2", [1, 40], 2, 2, 64, 1, "float16", "HND", {}),
        ("float8_e4m3fn", [0, 33], 8, 8, 128, 5, "float16", "HND",
         dict(logits_soft_cap=20.0)),  # an empty request
        ("float8_e5m2", [70], 8, 1, 64, 16, "float32", "NHD",
         dict(pos_encoding_mode="ROPE_LLAMA")),  # G 8, RoPE on the decoded keys
    ],
)
def test_decode_fp8_matches_reference(rng, fmt, kv_lens, hq, hkv, d, ps, q_dtype, layout,
                                      plan_kw):
    pt, cache = _paged(rng, kv_lens, hkv, d, ps, layout, fmt)
    q = rng.standard_normal((len(kv_lens), hq, d)).astype(q_dtype)
    k_scale, v_scale = 0.25 + rng.random(), 0.5 + rng.random()
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), layout,
                                                   backend="sim")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q_dtype,
           kv_data_type=fmt, **plan_kw)
    out, lse = w.run(q, cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)
    assert out.dtype == q.dtype
    kw = {k: v for k, v in plan_kw.items()}
    ref_o, ref_s = reference.batch_decode_with_paged_kv_cache(
        q.astype(np.float64), _dequant(cache, fmt, k_scale, v_scale), pt.indptr, pt.indices,
        pt.last_page_len, kv_layout=layout, return_lse=True, **kw)
    assert rel_err(out, ref_o) <= TOLERANCE[q_dtype]
    finite = np.isfinite(ref_s)
    assert rel_err(lse[finite], ref_s[finite]) <= TOLERANCE["float32"]
    assert np.array_equal(np.isfinite(lse), finite)  # the empty request's -inf too


def test_scales_follow_each_run_and_reset(rng):
    """One plan, three runs: the scales are per call (a run without them is unscaled again)."""
    fmt, hq, hkv, d, ps = "float8_e4m3fn", 4, 2, 64, 4
    pt, cache = _paged(rng, [9, 20], hkv, d, ps, "NHD", fmt)
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend="sim")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, kv_data_type=fmt)
    for ks, vs in ((2.0, 3.0), (None, None), (0.5, None)):
        out = w.run(q, cache, k_scale=ks, v_scale=vs)
        want = reference.batch_decode_with_paged_kv_cache(
            q.astype(np.float64), _dequant(cache, fmt, ks or 1.0, vs or 1.0), pt.indptr,
            pt.indices, pt.last_page_len)
        assert rel_err(out, want) <= TOLERANCE["float16"], (ks, vs)
    # q_scale folds into the logits exactly as k_scale does
    a = w.run(q, cache, q_scale=4.0, k_scale=0.5)
    b = w.run(q, cache, k_scale=2.0)
    assert rel_err(a, b) <= TOLERANCE["float16"]


def test_nan_code_poisons_only_the_rows_that_keep_it(rng):
    """e4m3fn's NaN code decodes to NaN: the request holding it gets NaN rows (the non-finite
    rule), the other request is untouched."""
    fmt, hq, hkv, d, ps = "float8_e4m3fn", 2, 1, 64, 4
    pt, cache = _paged(rng, [6, 7], hkv, d, ps, "NHD", fmt)
    page0 = pt.indices[pt.indptr[0]]
    cache[page0, 1, 1, 0, 3] = 0x7F  # V of request 0, token 1
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend="sim")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, kv_data_type=fmt)
    out, lse = w.run(q, cache, return_lse=True)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
    assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_and_ragged_prefill_fp8(rng, fmt):
    hq, hkv, d, ps = 4, 2, 64, 4
    kv_lens, qo_lens = [11, 6], [4, 6]
    pt, cache = _paged(rng, kv_lens, hkv, d, ps, "NHD", fmt)
    qo = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((qo[-1], hq, d)).astype(np.float16)
    ks, vs = 0.6, 1.7
    w = nbinfer.BatchPrefillWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend="sim")
    w.plan(qo, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, causal=True,
           kv_data_type=fmt)
    out = w.run(q, cache, k_scale=ks, v_scale=vs)
    want = reference.batch_prefill_with_paged_kv_cache(
        q.astype(np.float64), qo, _dequant(cache, fmt, ks, vs), pt.indptr, pt.indices,
        pt.last_page_len, causal=True)
    assert rel_err(out, want) <= TOLERANCE["float16"]

    kv = np.concatenate([[0], np.cumsum(kv_lens)])
    k, v = _codes(rng, (kv[-1], hkv, d), fmt), _codes(rng, (kv[-1], hkv, d), fmt)
    r = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend="sim")
    r.plan(qo, kv, hq, hkv, d, causal=True, kv_data_type=fmt, q_data_type="float16")
    out = r.run(q, k, v, q_scale=2.0, v_scale=vs)
    want = reference.batch_prefill_with_ragged_kv_cache(
        q.astype(np.float64), fp8.decode(k, fmt, 2.0), fp8.decode(v, fmt, vs), qo, kv,
        causal=True)
    assert rel_err(out, want) <= TOLERANCE["float16"]


def test_single_decode_and_prefill_take_codes_with_their_format(rng):
    fmt, hq, hkv, d, n = "float8_e5m2", 4, 2, 64, 29
    k, v = _codes(rng, (n, hkv, d), fmt), _codes(rng, (n, hkv, d), fmt)
    q1 = rng.standard_normal((hq, d)).astype(np.float32)
    out = nbinfer.single_decode_with_kv_cache(q1, k, v, k_scale=0.3, v_scale=2.5,
                                              kv_data_type=fmt, backend="sim")
    want = reference.single_decode_with_kv_cache(q1.astype(np.float64), fp8.decode(k, fmt, 0.3),
                                                 fp8.decode(v, fmt, 2.5))
    assert rel_err(out, want) <= TOLERANCE["float32"]
    q = rng.standard_normal((5, hq, d)).astype(np.float16)
    out = nbinfer.single_prefill_with_kv_cache(q, k, v, scale_k=0.3, scale_v=2.5, causal=True,
                                               kv_data_type=fmt, backend="sim")
    want = reference.single_prefill_with_kv_cache(q.astype(np.float64), fp8.decode(k, fmt, 0.3),
                                                  fp8.decode(v, fmt, 2.5), causal=True)
    assert rel_err(out, want) <= TOLERANCE["float16"]


@pytest.mark.parametrize("backend", ["sim", "reference"])
def test_append_copies_codes(rng, backend):
    fmt, hkv, d, ps = "float8_e4m3fn", 2, 64, 4
    kv_lens = [6, 9]
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=8, rng=rng)
    cache = np.zeros((pt.num_pages, 2, ps, hkv, d), np.uint8)
    nnz = sum(kv_lens)
    bi, pos = nbinfer.get_batch_indices_positions(np.array([0, 6, 15]), np.array(kv_lens), nnz)
    ak, av = _codes(rng, (nnz, hkv, d), fmt), _codes(rng, (nnz, hkv, d), fmt)
    nbinfer.append_paged_kv_cache(ak, av, bi, pos, cache, pt.indices, pt.indptr,
                                  pt.last_page_len, backend=backend)
    for t in range(nnz):
        b, p = bi[t], pos[t]
        page = pt.indices[pt.indptr[b] + p // ps]
        assert np.array_equal(cache[page, 0, p % ps], ak[t])
        assert np.array_equal(cache[page, 1, p % ps], av[t])
    with pytest.raises(TypeError, match="append_key"):
        nbinfer.append_paged_kv_cache(ak.astype(np.float16), av, bi, pos, cache, pt.indices,
                                      pt.indptr, pt.last_page_len, backend=backend)


def test_fp8_errors_name_the_argument(rng):
    ws = np.zeros(1 << 20, np.uint8)
    pt, cache = _paged(rng, [5], 1, 64, 4, "NHD", "float8_e4m3fn")
    q = rng.standard_normal((1, 2, 64)).astype(np.float16)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(ws, backend="sim")
    with pytest.raises(TypeError, match="q_data_type"):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 4, q_data_type="e4m3")
    with pytest.raises(TypeError, match="kv_data_type"):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 4, kv_data_type="int8")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 4, kv_data_type="fp8_e4m3")
    with pytest.raises(TypeError, match="k_scale"):
        w.run(q, cache, k_scale=True)
    with pytest.raises(ValueError, match="v_scale"):
        w.run(q, cache, v_scale=float("nan"))
    with pytest.raises(TypeError, match="paged_kv_cache must have dtype float8_e4m3fn"):
        w.run(q, cache.astype(np.float16))
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 4)  # fp16 plan: codes refused
    with pytest.raises(TypeError, match="paged_kv_cache must have dtype float16"):
        w.run(q, cache)
    k = cache[:, 0].reshape(-1, 1, 64)
    with pytest.raises(TypeError, match="kv_data_type"):
        nbinfer.single_decode_with_kv_cache(q[0], k, k, backend="sim")
    with pytest.raises(TypeError, match="v must have dtype"):
        nbinfer.single_decode_with_kv_cache(q[0], k, k.astype(np.float16),
                                            kv_data_type="float8_e4m3fn", backend="sim")


def test_reference_backend_and_sim_agree_with_a_variant(rng):
    """The API's reference backend dequantises the same way (a sliding window on top)."""
    fmt, hq, hkv, d, ps = "float8_e5m2", 4, 1, 64, 4
    pt, cache = _paged(rng, [13, 2], hkv, d, ps, "NHD", fmt)
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    outs = []
    for be in ("sim", "reference"):
        w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), backend=be)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, kv_data_type=fmt,
               variant=V.sliding_window(5))
        outs.append(w.run(q, cache, k_scale=1.5, v_scale=0.25))
    assert rel_err(outs[0], outs[1]) <= TOLERANCE["float16"]


def test_block_sparse_reads_fp8_codes(rng):
    """The BSR wrapper shares the CUDA-core prefill kernel: FP8 codes work there too (no scale
    arguments: FlashInfer's block-sparse run() has none), on the kernels and the reference."""
    fmt, hq, hkv, d, M, N, R, C = "float8_e5m2", 4, 2, 64, 6, 40, 2, 8
    indptr, indices = np.array([0, 2, 3, 5]), np.array([0, 3, 4, 1, 2])
    q = rng.standard_normal((M, hq, d)).astype(np.float16)
    k, v = _codes(rng, (N, hkv, d), fmt), _codes(rng, (N, hkv, d), fmt)
    outs = []
    for be in ("sim", "reference"):
        w = nbinfer.BlockSparseAttentionWrapper(np.zeros(1 << 20, np.uint8), backend=be)
        w.plan(indptr, indices, M, N, R, C, hq, hkv, d, kv_data_type=fmt)
        outs.append(w.run(q, k, v))
    dense = np.zeros((M, N), bool)
    for r in range(3):
        for c in indices[indptr[r]:indptr[r + 1]]:
            dense[r * R:(r + 1) * R, c * C:(c + 1) * C] = True
    want = reference.single_prefill_with_kv_cache(q.astype(np.float64), fp8.decode(k, fmt),
                                                  fp8.decode(v, fmt), custom_mask=dense)
    assert rel_err(outs[0], want) <= TOLERANCE["float16"]
    assert rel_err(outs[1], want) <= TOLERANCE["float16"]
