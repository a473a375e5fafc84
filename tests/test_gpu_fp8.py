"""FP8 KV caches on a real GPU (skipped without one): torch ``float8_e4m3fn`` / ``float8_e5m2``
tensors (and their ``uint8`` views) through decode, paged and ragged prefill, the single-request
functions and append, with FlashInfer's q/k/v scales, against the float64 reference on the
dequantised cache (FP8 values are exact in float32: the tolerance is the query dtype's).

The decode matrix covers page sizes 1 and 16, head_dim 64/128/256, groups 1/4/8, both layouts,
fp16 and bf16 queries and both formats, each value of each axis at least once.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

import nbinfer
from nbinfer import reference
from nbinfer.formats import PageTable
from nbinfer.reference import fp8

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

# (batch, max_len, hq, hkv, d, page_size, q dtype, layout, format, plan keywords)
MATRIX = [
    (16, 4096, 32, 8, 128, 16, "float16", "NHD", "float8_e4m3fn", {}),
    (9, 3000, 32, 8, 128, 16, "bfloat16", "HND", "float8_e5m2", {}),
    (7, 2000, 32, 4, 64, 1, "float16", "NHD", "float8_e5m2", {}),  # group 8, page 1
    (5, 2500, 8, 8, 256, 16, "bfloat16", "NHD", "float8_e4m3fn", {}),  # group 1, D 256
    (6, 1800, 16, 2, 64, 16, "float16", "HND", "float8_e4m3fn", dict(logits_soft_cap=30.0)),
    (3, 2500, 32, 8, 128, 1, "float16", "NHD", "float8_e4m3fn",
     dict(pos_encoding_mode="ROPE_LLAMA")),
]


def _fp8_cache(rng, shape, fmt, spread=3.0):
    """A torch FP8 cache on the GPU from random values (no NaN, no infinity)."""
    codes = fp8.encode(rng.standard_normal(shape) * spread, fmt)
    return torch.from_numpy(codes).cuda().view(getattr(torch, fmt))


def _dequant(cache, fmt, k_scale, v_scale):
    codes = cache.view(torch.uint8).cpu().numpy()
    return fp8.decode(codes[:, 0], fmt, k_scale), fp8.decode(codes[:, 1], fmt, v_scale)


def _ws():
    return torch.empty(64 << 20, dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("batch, max_len, hq, hkv, d, ps, q_dtype, layout, fmt, kw", MATRIX)
def test_decode_fp8_matrix(rng, batch, max_len, hq, hkv, d, ps, q_dtype, layout, fmt, kw):
    lens = rng.integers(1, max_len + 1, size=batch)
    lens[0] = max_len
    pt = PageTable.from_kv_lens(lens, ps, rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = _fp8_cache(rng, shape, fmt)
    q = torch.randn(batch, hq, d, device="cuda").to(getattr(torch, q_dtype))
    ks, vs = float(0.25 + rng.random()), float(0.5 + rng.random())
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(_ws(), layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q.dtype,
           kv_data_type=cache.dtype, **kw)
    out, lse = w.run(q, cache, k_scale=ks, v_scale=vs, return_lse=True)
    torch.cuda.synchronize()
    assert out.dtype == q.dtype
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q.double().cpu().numpy(), _dequant(cache, fmt, ks, vs), pt.indptr, pt.indices,
        pt.last_page_len, kv_layout=layout, return_lse=True, **kw)
    assert rel_err(out.double().cpu().numpy(), ref) <= TOLERANCE[q_dtype]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=0, atol=5e-3)
    # the same cache as uint8 codes (the careful path) gives the same bits
    again = w.run(q, cache.view(torch.uint8), k_scale=ks, v_scale=vs)
    assert torch.equal(again, out)


def test_scales_reach_the_fast_path(rng):
    """run()'s torch fast path launches the prepared argument block: a new k_scale / v_scale
    must reach it on every call, and a call without scales must be unscaled again."""
    fmt, hq, hkv, d, ps = "float8_e4m3fn", 32, 8, 128, 16
    pt = PageTable.from_kv_lens([700, 3000, 64], ps, rng=rng)
    cache = _fp8_cache(rng, (pt.num_pages, 2, ps, hkv, d), fmt)
    q = torch.randn(3, hq, d, device="cuda", dtype=torch.float16)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q.dtype,
           kv_data_type=fmt)
    out = torch.empty_like(q)
    for ks, vs in ((2.0, 0.5), (None, None), (0.25, 4.0), (None, 2.0)):
        w.run(q, cache, k_scale=ks, v_scale=vs, out=out)
        torch.cuda.synchronize()
        ref = reference.batch_decode_with_paged_kv_cache(
            q.double().cpu().numpy(), _dequant(cache, fmt, ks or 1.0, vs or 1.0), pt.indptr,
            pt.indices, pt.last_page_len)
        assert rel_err(out.double().cpu().numpy(), ref) <= TOLERANCE["float16"], (ks, vs)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_prefill_fp8_paged_ragged_single(rng, fmt):
    hq, hkv, d, ps = 32, 8, 128, 16
    kv_lens, qo_lens = [900, 2100, 37], [300, 128, 37]
    pt = PageTable.from_kv_lens(kv_lens, ps, rng=rng)
    cache = _fp8_cache(rng, (pt.num_pages, 2, ps, hkv, d), fmt)
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = torch.randn(int(qo[-1]), hq, d, device="cuda", dtype=torch.bfloat16)
    ks, vs = 0.75, 1.25
    w = nbinfer.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, causal=True,
           q_data_type=q.dtype, kv_data_type=fmt)
    out = w.run(q, cache, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    ref = reference.batch_prefill_with_paged_kv_cache(
        q.double().cpu().numpy(), qo, _dequant(cache, fmt, ks, vs), pt.indptr, pt.indices,
        pt.last_page_len, causal=True)
    assert rel_err(out.double().cpu().numpy(), ref) <= TOLERANCE["bfloat16"]

    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    k = _fp8_cache(rng, (int(kv[-1]), hkv, d), fmt)
    v = _fp8_cache(rng, (int(kv[-1]), hkv, d), fmt)
    r = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    r.plan(qo, kv, hq, hkv, d, causal=True, q_data_type=q.dtype, kv_data_type=fmt)
    out = r.run(q, k, v, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    kd = fp8.decode(k.view(torch.uint8).cpu().numpy(), fmt, ks)
    vd = fp8.decode(v.view(torch.uint8).cpu().numpy(), fmt, vs)
    ref = reference.batch_prefill_with_ragged_kv_cache(q.double().cpu().numpy(), kd, vd, qo,
                                                       kv, causal=True)
    assert rel_err(out.double().cpu().numpy(), ref) <= TOLERANCE["bfloat16"]

    n = kv_lens[1]
    k1, v1 = k[kv[1]:kv[2]], v[kv[1]:kv[2]]
    qd = q[qo[1]]
    out = nbinfer.single_decode_with_kv_cache(qd, k1, v1, k_scale=ks, v_scale=vs)
    ref = reference.single_decode_with_kv_cache(qd.double().cpu().numpy(), kd[kv[1]:kv[2]],
                                                vd[kv[1]:kv[2]])
    assert rel_err(out.double().cpu().numpy(), ref) <= TOLERANCE["bfloat16"]
    qp = q[qo[1]:qo[2]]
    out = nbinfer.single_prefill_with_kv_cache(qp, k1, v1, scale_k=ks, scale_v=vs, causal=True)
    ref = reference.single_prefill_with_kv_cache(qp.double().cpu().numpy(), kd[kv[1]:kv[2]],
                                                 vd[kv[1]:kv[2]], causal=True)
    assert rel_err(out.double().cpu().numpy(), ref) <= TOLERANCE["bfloat16"]
    assert n == k1.shape[0]


def test_append_fp8_then_decode(rng):
    """append_paged_kv_cache copies FP8 codes into a torch FP8 cache, bit for bit."""
    fmt, hkv, d, ps = "float8_e5m2", 8, 128, 16
    kv_lens = [40, 17, 100]
    pt = PageTable.from_kv_lens(kv_lens, ps, rng=rng)
    cache = torch.zeros(pt.num_pages, 2, ps, hkv, d, dtype=torch.uint8,
                        device="cuda").view(getattr(torch, fmt))
    nnz = sum(kv_lens)
    indptr = np.concatenate([[0], np.cumsum(kv_lens)])
    bi, pos = nbinfer.get_batch_indices_positions(indptr, np.array(kv_lens), nnz)
    ak, av = _fp8_cache(rng, (nnz, hkv, d), fmt), _fp8_cache(rng, (nnz, hkv, d), fmt)
    nbinfer.append_paged_kv_cache(ak, av, torch.as_tensor(bi, device="cuda"),
                                  torch.as_tensor(pos, device="cuda"), cache,
                                  torch.as_tensor(pt.indices, device="cuda"),
                                  torch.as_tensor(pt.indptr, device="cuda"),
                                  torch.as_tensor(pt.last_page_len, device="cuda"))
    torch.cuda.synchronize()
    host = cache.view(torch.uint8).cpu().numpy()
    page = pt.indices[pt.indptr[bi] + pos // ps]
    np.testing.assert_array_equal(host[page, 0, pos % ps], ak.view(torch.uint8).cpu().numpy())
    np.testing.assert_array_equal(host[page, 1, pos % ps], av.view(torch.uint8).cpu().numpy())
