"""Issue 11 on a real GPU: strided views read in place, the non-finite rule, wrappers sharing
one float workspace, variants at group sizes that are not powers of two, append of strided keys.

Shapes reuse the kernel specs of the other gpu tests where they can (fp16, D 128, page 16), so
this file adds few compilations.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

import nbinfer
from nbinfer import reference
from nbinfer.api import prefill as prefill_api
from nbinfer.formats import PageTable

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

HQ, HKV, D, PS = 32, 8, 128, 16


def _host(t):
    return t.float().cpu().numpy()


def _pool(rng, lens, extra=3):
    pt = PageTable.from_kv_lens(lens, PS, num_pages=sum(-(-n // PS) for n in lens) + extra,
                                rng=rng)
    cache = torch.randn(pt.num_pages, 2, PS, HKV, D, device="cuda").half()
    return pt, cache


def test_decode_reads_strided_q_and_a_cache_view_in_place(rng):
    pt, cache = _pool(rng, [700, 33, 4000])
    qkv = torch.randn(3, HQ + 2 * HKV, D, device="cuda").half()  # a fused QKV projection
    q = qkv[:, :HQ]
    assert not q.is_contiguous()
    pool = torch.full((cache.shape[0] + 5, *cache.shape[1:]), float("nan"), device="cuda").half()
    pool[2:2 + cache.shape[0]] = cache
    view = pool[2:2 + cache.shape[0]]  # a slice of a larger pool, NaN around it
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16")
    out, lse = w.run(q, view, return_lse=True)
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        _host(q), _host(cache), pt.indptr, pt.indices, pt.last_page_len, return_lse=True)
    assert rel_err(_host(out), ref) <= TOLERANCE["float16"]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=2e-3)
    # The same call on contiguous copies gives the same bits (strides change no arithmetic).
    again = w.run(q.contiguous(), cache)
    assert torch.equal(out, again)


def test_prefill_reads_q_k_v_sliced_from_one_qkv_tensor(rng):
    lens = [300, 77]
    qkv = torch.randn(sum(lens), HQ + 2 * HKV, D, device="cuda").half()
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    ptr = np.concatenate([[0], np.cumsum(lens)])
    w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    w.plan(ptr, ptr, HQ, HKV, D, causal=True, q_data_type="float16")
    out = w.run(q, k, v)
    ref = reference.batch_prefill_with_ragged_kv_cache(_host(q), _host(k), _host(v), ptr, ptr,
                                                       causal=True)
    assert rel_err(_host(out), ref) <= TOLERANCE["float16"]


def test_nan_in_q_or_a_read_key_gives_nan_rows_and_unread_slots_never_leak(rng):
    pt, cache = _pool(rng, [500, 40])
    q = torch.randn(2, HQ, D, device="cuda").half()
    q[0, 3, 5] = float("nan")  # request 0, head 3
    page = int(pt.indices[pt.indptr[1]])  # request 1's first page: key 0, kv head 0
    cache[page, 0, 0, 0, 7] = float("nan")
    # Slots no request reads: the spare pages and request 1's last page past last_page_len.
    used = set(pt.indices.tolist())
    for p in range(cache.shape[0]):
        if p not in used:
            cache[p] = float("nan")
    last = int(pt.indices[pt.indptr[2] - 1])
    cache[last, :, int(pt.last_page_len[1]):] = float("nan")
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16")
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        _host(q), _host(cache), pt.indptr, pt.indices, pt.last_page_len, return_lse=True)
    o, s = _host(out), lse.cpu().numpy()
    np.testing.assert_array_equal(np.isnan(o), np.isnan(ref))
    np.testing.assert_array_equal(np.isnan(s), np.isnan(ref_lse))
    assert np.isnan(s[0, 3]) and np.isnan(s[1, :HQ // HKV]).all()
    assert np.isfinite(s[0, :3]).all() and np.isfinite(s[1, HQ // HKV:]).all()


def test_merge_rule_for_nan_and_inf_lse_matches_the_reference(rng):
    v = torch.randn(4, 2, 2, 64, device="cuda").half()
    s = torch.randn(4, 2, 2, device="cuda")
    s[0, 1, 0] = float("nan")
    s[1, 0, 1] = float("inf")
    s[2, :, 0] = float("-inf")
    vo, so = nbinfer.merge_states(v, s)
    rv, rs = reference.merge_states(_host(v), s.cpu().numpy())
    np.testing.assert_array_equal(np.isnan(_host(vo)), np.isnan(rv))
    np.testing.assert_array_equal(np.isnan(so.cpu().numpy()), np.isnan(rs))
    fin = np.isfinite(rs)
    np.testing.assert_allclose(so.cpu().numpy()[fin], rs[fin], atol=1e-3)


def test_wrappers_of_every_kind_share_one_float_workspace(rng):
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    pt, cache = _pool(rng, [3000, 900])
    dec = nbinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    pre = nbinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    qo = np.array([0, 5, 9])
    dec.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16")
    pre.plan(qo, pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, causal=True,
             q_data_type="float16")
    qd = torch.randn(2, HQ, D, device="cuda").half()
    qp = torch.randn(9, HQ, D, device="cuda").half()
    for _ in range(2):  # interleaved runs, each equal to the reference
        od = dec.run(qd, cache)
        op = pre.run(qp, cache)
        ref_d = reference.batch_decode_with_paged_kv_cache(_host(qd), _host(cache), pt.indptr,
                                                           pt.indices, pt.last_page_len)
        ref_p = reference.batch_prefill_with_paged_kv_cache(
            _host(qp), qo, _host(cache), pt.indptr, pt.indices, pt.last_page_len, causal=True)
        assert rel_err(_host(od), ref_d) <= TOLERANCE["float16"]
        assert rel_err(_host(op), ref_p) <= TOLERANCE["float16"]


@pytest.mark.parametrize("hq, hkv", [(3, 1), (6, 2)])
def test_alibi_and_window_at_group_sizes_that_are_not_powers_of_two(rng, hq, hkv):
    lens = [600, 20]
    pt = PageTable.from_kv_lens(lens, PS, rng=rng)
    cache = torch.randn(pt.num_pages, 2, PS, hkv, D, device="cuda").half()
    q = torch.randn(2, hq, D, device="cuda").half()
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(16 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    for kw in (dict(pos_encoding_mode="ALIBI"), dict(window_left=100)):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, D, PS, q_data_type="float16",
               **kw)
        ref = reference.batch_decode_with_paged_kv_cache(
            _host(q), _host(cache), pt.indptr, pt.indices, pt.last_page_len, **kw)
        assert rel_err(_host(w.run(q, cache)), ref) <= TOLERANCE["float16"]


def test_append_of_strided_keys_into_a_cache_view(rng):
    pt, cache = _pool(rng, [40, 17])
    pool = torch.zeros((cache.shape[0] + 2, *cache.shape[1:]), device="cuda").half()
    pool[1:1 + cache.shape[0]] = cache
    view = pool[1:1 + cache.shape[0]]
    want = _host(cache).astype(np.float16)
    qkv = torch.randn(5, HQ + 2 * HKV, D, device="cuda").half()
    k, v = qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:]
    bi = np.array([0, 0, 1, 1, 1], np.int32)
    pos = np.array([38, 39, 14, 15, 16], np.int32)
    nbinfer.append_paged_kv_cache(k, v, torch.from_numpy(bi).cuda(), torch.from_numpy(pos).cuda(),
                                  view, torch.from_numpy(pt.indices).cuda(),
                                  torch.from_numpy(pt.indptr).cuda(),
                                  torch.from_numpy(pt.last_page_len).cuda())
    reference.append_paged_kv_cache(_host(k).astype(np.float16), _host(v).astype(np.float16),
                                    bi, pos, want, pt.indices, pt.indptr, pt.last_page_len)
    np.testing.assert_array_equal(_host(view), want.astype(np.float32))
    assert torch.equal(pool[0], torch.zeros_like(pool[0]))  # nothing outside the view


@pytest.mark.parametrize("kw", [dict(pos_encoding_mode="ALIBI", causal=True),
                                dict(logits_soft_cap=20.0, window_left=50, causal=True)])
def test_prefill_variants_at_group_size_three(rng, kw):
    hq, hkv = 12, 4
    lens = [200, 37]
    qkv = torch.randn(sum(lens), hq + 2 * hkv, D, device="cuda").half()
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    ptr = np.concatenate([[0], np.cumsum(lens)])
    w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    w.plan(ptr, ptr, hq, hkv, D, q_data_type="float16", **kw)
    ref = reference.batch_prefill_with_ragged_kv_cache(_host(q), _host(k), _host(v), ptr, ptr,
                                                       **kw)
    assert rel_err(_host(w.run(q, k, v)), ref) <= TOLERANCE["float16"]


@pytest.mark.parametrize("wgmma", [False, True, "lean", "lean-prefetch", "lean-lazy"])
def test_prefill_nan_rule_on_the_tensor_core_kernel(rng, monkeypatch, wgmma):
    # wgmma: the same on the warpgroup-MMA tile (causal: its value scan and mma.sync twin);
    # "lean": on the lean warpgroup kernel (the -inf score found by its running minimum),
    # "lean-prefetch" with its per-item overlap, "lean-lazy" with its lazy rescale
    lean = str(wgmma).startswith("lean")
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", bool(wgmma))
    monkeypatch.setattr(prefill_api, "MMA_WGMMA_LEAN", lean)
    monkeypatch.setattr(prefill_api, "LEAN_PREFETCH", wgmma == "lean-prefetch")
    monkeypatch.setattr(prefill_api, "LEAN_LAZY_RESCALE", wgmma == "lean-lazy")
    lens = [300, 40]
    q = torch.randn(sum(lens), HQ, D, device="cuda").half()
    k = torch.randn(sum(lens), HKV, D, device="cuda").half()
    v = torch.randn(sum(lens), HKV, D, device="cuda").half()
    g = HQ // HKV
    q[5, 2, 1] = float("nan")  # row 5, head 2 (kv head 0)
    k[310, 1, 9] = float("-inf")  # request 1, key 10, kv head 1: causal rows 10.. keep it
    ptr = np.concatenate([[0], np.cumsum(lens)])
    w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    v[20, 0, 3] = float("nan")  # request 0, key 20, kv head 0: causal rows 20.. keep it
    v[339, 0, 7] = float("inf")  # request 1, key 39, kv head 0: causal, only its last row
    # (causal, NaN (row, head) pairs the rule predicts). Causal rows 0-19 of request 0 share
    # key 20's KV tile without keeping it: the value scan and guarded twin keep its NaN out.
    for causal, count in ((True, 1 + (30 + 280 + 1) * g), (False, 300 * g + 40 * g + 40 * g)):
        w.plan(ptr, ptr, HQ, HKV, D, causal=causal, q_data_type="float16")
        assert w.step_plan.spec.wgmma == bool(wgmma)
        assert w.step_plan.spec.lean == lean
        out, lse = w.run(q, k, v, return_lse=True)
        ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
            _host(q), _host(k), _host(v), ptr, ptr, causal=causal, return_lse=True)
        np.testing.assert_array_equal(np.isnan(lse.cpu().numpy()), np.isnan(ref_lse))
        np.testing.assert_array_equal(np.isnan(_host(out)), np.isnan(ref))
        assert np.isnan(ref_lse).sum() == count
        fin = ~np.isnan(ref)
        assert rel_err(_host(out)[fin], ref[fin]) <= TOLERANCE["float16"]


def test_unkept_keys_never_reach_a_row_through_their_values(rng):
    # Decode with a sliding window and a custom-mask prefill on both prefill kernels: NaN/inf in
    # the K and V of keys a row does not keep, in the same pages and KV tiles as kept keys,
    # never reach that row.
    pt, cache = _pool(rng, [70, 33])
    clean = cache.clone()

    def slot(b, t):
        return int(pt.indices[pt.indptr[b] + t // PS]), t % PS

    for t in range(10, 41):  # request 0: a window of 20 keeps tokens 49..69 only
        page, s = slot(0, t)
        cache[page, 0, s, t % HKV] = float("inf")
        cache[page, 1, s, t % HKV] = float("nan")
    q = torch.randn(2, HQ, D, device="cuda").half()
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, window_left=20,
           q_data_type="float16")
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        _host(q), _host(clean), pt.indptr, pt.indices, pt.last_page_len, window_left=20,
        return_lse=True)
    assert np.isfinite(_host(out)).all() and rel_err(_host(out), ref) <= TOLERANCE["float16"]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=2e-3)

    qo = np.array([0, 6, 9])
    qp = torch.randn(9, HQ, D, device="cuda")
    masks = [rng.random((6, 70)) < 0.6, rng.random((3, 33)) < 0.6]
    masks[0][:, 5] = False  # key 5 of request 0: kept by no row
    masks[0][:, 7] = [True, False, False, False, False, True]  # key 7: rows 0 and 5 only
    cache = clean.float()
    for t in (5, 7):
        page, s = slot(0, t)
        cache[page, 1, s, 1] = float("nan")  # V of kv head 1
    flat = torch.from_numpy(np.concatenate([m.ravel() for m in masks])).cuda()
    wp = nbinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    wp.plan(qo, pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, custom_mask=flat,
            q_data_type="float32", kv_data_type="float32")
    out = _host(wp.run(qp, cache))
    ref = reference.batch_prefill_with_paged_kv_cache(
        _host(qp), qo, _host(cache), pt.indptr, pt.indices, pt.last_page_len,
        custom_mask=flat.cpu().numpy())
    g = HQ // HKV
    want_nan = np.zeros(out.shape, bool)
    want_nan[[0, 5], g:2 * g] = True  # rows 0 and 5, the qo heads of kv head 1
    np.testing.assert_array_equal(np.isnan(ref), want_nan)
    np.testing.assert_array_equal(np.isnan(out), want_nan)
    assert rel_err(out[~want_nan], ref[~want_nan]) <= TOLERANCE["float32"]
    # The same on the tensor-core kernel (fp16), whose P.V takes whole KV tiles: the custom
    # mask makes it run the value scan and its guarded twin.
    wp.plan(qo, pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, custom_mask=flat,
            q_data_type="float16")
    out = _host(wp.run(qp.half(), cache.half()))
    ref = reference.batch_prefill_with_paged_kv_cache(
        _host(qp.half()), qo, _host(cache.half()), pt.indptr, pt.indices, pt.last_page_len,
        custom_mask=flat.cpu().numpy())
    np.testing.assert_array_equal(np.isnan(out), want_nan)
    assert rel_err(out[~want_nan], ref[~want_nan]) <= TOLERANCE["float16"]


def test_merge_never_reads_the_values_of_an_empty_state(rng):
    v_a = torch.randn(3, 4, 64, device="cuda").half()
    v_b = torch.full((3, 4, 64), float("nan"), device="cuda").half()
    s_a = torch.randn(3, 4, device="cuda")
    s_b = torch.full((3, 4), float("-inf"), device="cuda")
    v, s = nbinfer.merge_state(v_a, s_a, v_b, s_b)
    assert torch.equal(v, v_a) and torch.allclose(s, s_a)


def test_custom_masks_given_as_cuda_tensors(rng):
    # FlashInfer's tests pass masks as CUDA tensors: a flat bool mask for the paged prefill and
    # the 2-D [qo_len, kv_len] form for single prefill.
    pt, cache = _pool(rng, [70, 33])
    qo = np.array([0, 6, 9])
    q = torch.randn(9, HQ, D, device="cuda").half()
    masks = [rng.random((6, 70)) < 0.6, rng.random((3, 33)) < 0.6]
    flat = torch.from_numpy(np.concatenate([m.ravel() for m in masks])).cuda()
    w = nbinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    w.plan(qo, pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, custom_mask=flat,
           q_data_type="float16")
    ref = reference.batch_prefill_with_paged_kv_cache(
        _host(q), qo, _host(cache), pt.indptr, pt.indices, pt.last_page_len,
        custom_mask=flat.cpu().numpy())
    assert rel_err(_host(w.run(q, cache)), ref) <= TOLERANCE["float16"]
    k = torch.randn(70, HKV, D, device="cuda").half()
    v = torch.randn(70, HKV, D, device="cuda").half()
    out = nbinfer.single_prefill_with_kv_cache(q[:6], k, v,
                                               custom_mask=torch.from_numpy(masks[0]).cuda())
    ref = reference.single_prefill_with_kv_cache(_host(q[:6]), _host(k), _host(v),
                                                 custom_mask=masks[0])
    assert rel_err(_host(out), ref) <= TOLERANCE["float16"]
