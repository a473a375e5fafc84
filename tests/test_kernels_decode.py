"""Decode kernels vs the float64 reference: simulator at tiny shapes, the H200 at real ones."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer import variants as V
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper
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


@pytest.mark.parametrize("variant", [None, V.sigmoid_attention(0.7, -0.5),
                                     V.attention_sink([0.5, -1.0, 2.0, 0.0])],
                         ids=["softmax", "sigmoid", "sink"])
def test_persistent_grid_runs_many_items_per_cta_and_merges_in_kernel(rng, variant):
    # Two CTAs in the simulator, a long request split into several chunks whose last CTA
    # merges them: the fused merge must equal the reference (for a softmax variant, one without
    # softmax, and one with an output hook), and leave every counter at zero.
    pt, cache, q = _case(rng, [700, 3, 40], 4, 2, 64, 8, np.float16, "NHD")
    w, (out, lse) = _run(pt, cache, q, 2, 8, "NHD", fixed_split_size=256, variant=variant)
    sched = w.schedule
    assert sched.num_merge_rows >= 1 and sched.num_work > sched.num_ctas
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True, variant=variant)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    if variant is None or variant.use_softmax:
        np.testing.assert_allclose(lse, ref_lse, atol=1e-4)
    launch = w.step_plan.launch
    words = launch.layout.words
    assert not launch.ints[words["counters"]:words["kv_indptr"]].any()


@pytest.mark.parametrize("stages, d, dtype", [(3, 128, np.float16), (4, 64, np.float32)])
def test_decode_deeper_kv_ring(rng, monkeypatch, stages, d, dtype):
    # stages - 1 groups per warp in flight: a request shorter than the ring (its commits are
    # empty) and one of several rounds, split so the fused merge runs too. A group is 4 KiB of
    # K and V whatever D and dtype, so four warps' ring is 16 KiB per stage: past two stages it
    # passes the static limit and is allocated at launch.
    from nbinfer.api import decode as decode_api
    from nbinfer.kernels.decode import build_decode_kernel, dynamic_ring_bytes

    monkeypatch.setattr(decode_api, "DECODE_STAGES", stages)
    pt, cache, q = _case(rng, [5, 200], 4, 2, d, 16, dtype, "NHD")
    w, (out, lse) = _run(pt, cache, q, 2, 16, "NHD", fixed_split_size=64)
    spec = w.step_plan.spec
    assert spec.stages == stages and w.schedule.num_merge_rows >= 1
    assert build_decode_kernel(spec).dynamic_shared == dynamic_ring_bytes(spec)
    assert dynamic_ring_bytes(spec) == stages * 16 * 1024
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE[np.dtype(dtype).name]
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


def _count_page_table_reads(request, monkeypatch):
    """A list that grows by one per call of the loading module's ``token_offset`` (a page-table
    read on a paged cache) in decode kernels built from here on (simulator: device functions
    are Python); decode kernels built meanwhile are dropped again at the test's end."""
    from types import SimpleNamespace

    from nbinfer.kernels import decode as decode_kernels

    calls, real = [], decode_kernels.loading_module

    def counting(sparse, page_size, sim):
        mod = real(sparse, page_size, sim)

        def token_offset(*args):
            calls.append(1)
            return mod.token_offset(*args)

        return SimpleNamespace(request_kv_len=mod.request_kv_len, request_base=mod.request_base,
                               token_offset=token_offset)

    monkeypatch.setattr(decode_kernels, "loading_module", counting)
    decode_kernels.build_decode_kernel.cache_clear()
    request.addfinalizer(decode_kernels.build_decode_kernel.cache_clear)
    return calls


@pytest.mark.parametrize("kv_lens, hkv, d, ps, dtype, layout, kv_dtype, one_page", [
    ([5, 200, 40], 2, 128, 16, np.float16, "NHD", None, True),  # 8-token groups, 16-token pages
    ([33, 150], 1, 64, 32, np.float32, "HND", None, True),  # 8-token groups, two per page
    ([70, 9], 2, 128, 16, np.float16, "HND", "float8_e4m3fn", True),  # FP8: 16-token groups
    ([30, 61], 2, 64, 5, np.float16, "NHD", None, False),  # pages smaller than a group
    ([3, 40], 1, 256, 16, np.float32, "NHD", None, False),  # rows of 64 chunks
])
def test_decode_page_groups_equal_the_general_addressing(request, rng, monkeypatch, kv_lens, hkv,
                                                         d, ps, dtype, layout, kv_dtype,
                                                         one_page):
    # DecodeSpec.page_groups changes only how a group's copies are addressed (one page-table
    # read per group inside a page), so the outputs are the same bits as the general path's,
    # tail groups and split rows (fixed_split_size) included. Counting the page-table reads
    # shows which path ran: fewer with page_groups where groups fit their pages, the same
    # number where they cannot (a page smaller than a group; fp32 D 256's 64-chunk rows).
    from nbinfer.api import decode as decode_api

    calls = _count_page_table_reads(request, monkeypatch)
    pt, cache, q = _case(rng, kv_lens, 4 * hkv, hkv, d, ps, dtype, layout)
    kw = dict(fixed_split_size=64)
    if kv_dtype:
        from nbinfer.reference import fp8

        cache = fp8.encode(cache, kv_dtype)
        kw["kv_data_type"] = kv_dtype
    outs, reads = [], []
    for flag in (False, True):
        monkeypatch.setattr(decode_api, "DECODE_PAGE_GROUPS", flag)
        before = len(calls)
        w, (out, lse) = _run(pt, cache, q, hkv, ps, layout, **kw)
        reads.append(len(calls) - before)
        assert w.step_plan.spec.page_groups == flag
        outs.append((out, lse))
    assert reads[0] > 0
    assert (reads[1] < reads[0]) if one_page else (reads[1] == reads[0])
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    kv = fp8.decode(cache, kv_dtype) if kv_dtype else cache
    ref = reference.batch_decode_with_paged_kv_cache(q, kv, pt.indptr, pt.indices,
                                                     pt.last_page_len, kv_layout=layout)
    assert rel_err(outs[1][0], ref) <= TOLERANCE[np.dtype(dtype).name]


def test_fixed_split_size_is_batch_invariant(rng):
    # The same request decoded alone and inside a batch gives the same bits.
    pt, cache, q = _case(rng, [600, 50, 900], 2, 1, 64, 16, np.float32, "NHD")
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 2, 1, 64, 16, q_data_type=q.dtype,
           fixed_split_size=256)
    batch_out = w.run(q, cache)
    one = PageTable(np.array([0, pt.indptr[3] - pt.indptr[2]]), pt.indices[pt.indptr[2]:],
                    pt.last_page_len[2:], 16, pt.num_pages)
    w.plan(one.indptr, one.indices, one.last_page_len, 2, 1, 64, 16, q_data_type=q.dtype,
           fixed_split_size=256)
    alone = w.run(q[2:], cache)
    assert np.array_equal(alone[0], batch_out[2])


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
    base = np.zeros((1 << 16) + 16, np.uint8)
    skew = (16 - base.ctypes.data % 16) % 16 + 4  # 4 bytes past a 16-byte boundary
    w = BatchDecodeWithPagedKVCacheWrapper(base[skew:skew + (1 << 16)], "NHD")
    with pytest.raises(ValueError, match="float_workspace_buffer must start at a 16-byte"):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 4, q_data_type="float16")


def test_fused_merge_walks_more_partials_than_fit_in_shared_memory(rng):
    # G=8, D=64: the merge block holds 26 partial rows; 300 tokens in chunks of 8 give 38, so
    # the running (m, den) rescaling across blocks is exercised.
    pt, cache, q = _case(rng, [300], 8, 1, 64, 4, np.float32, "HND")
    w, (out, lse) = _run(pt, cache, q, 1, 4, "HND", fixed_split_size=8)
    assert w.schedule.num_merge_nnz == 38
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, kv_layout="HND", return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("layout, dtype, kw", [
    ("NHD", np.float16, {}),
    ("HND", np.float32, dict(pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=5.0)),
])
def test_single_decode_dense_addressing(rng, layout, dtype, kw):
    # The decode kernel's affine (non-paged) loading: one request over contiguous K/V.
    from nbinfer.api.single import single_decode_with_kv_cache

    kv_len, hq, hkv, d = 300, 4, 2, 64
    shape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    q = rng.standard_normal((hq, d)).astype(dtype)
    k = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    out, lse = single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True, **kw)
    ref, ref_lse = reference.single_decode_with_kv_cache(q, k, v, kv_layout=layout,
                                                         return_lse=True, **kw)
    assert out.shape == (hq, d) and out.dtype == q.dtype
    assert rel_err(out, ref) <= TOLERANCE[np.dtype(dtype).name]
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


@pytest.mark.parametrize(
    "kv_lens, hq, hkv, d, ps, layout, plan_kw",
    [
        ([5, 40], 8, 2, 64, 16, "NHD", {}),  # G 4 on the tensor-core kernel
        ([0, 33, 7], 8, 1, 128, 1, "HND", dict(logits_soft_cap=30.0)),  # G 8, an empty request
        ([19, 4], 2, 2, 64, 3, "NHD", dict(pos_encoding_mode="ROPE_LLAMA", window_left=6)),
        ([12, 2], 4, 2, 256, 16, "NHD", dict(variant=V.sigmoid_attention(0.7, -0.5))),
    ],
    ids=["g4", "g8-softcap-empty", "g1-rope-window", "d256-sigmoid"],
)
def test_decode_on_tensor_cores_matches_reference(rng, kv_lens, hq, hkv, d, ps, layout,
                                                  plan_kw):
    # use_tensor_cores=True: the step runs as a prefill of one row per request, on the
    # tensor-core kernel where it takes the head_dim (64, 128), else on the CUDA-core one
    pt, cache, q = _case(rng, kv_lens, hq, hkv, d, ps, np.float16, layout)
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), layout,
                                           use_tensor_cores=True)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type="float16",
           **plan_kw)
    assert type(w.step_plan.spec).__name__ == ("MmaPrefillSpec" if d <= 128 else "PrefillSpec")
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, kv_layout=layout, return_lse=True,
        **plan_kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    finite = np.isfinite(ref_lse)
    if "variant" not in plan_kw:  # sigmoid attention has no softmax, so no LSE to compare
        np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-3)
    assert np.all(out[~finite] == 0)


def test_decode_on_tensor_cores_errors(rng):
    pt, cache, q = _case(rng, [3, 5], 4, 2, 64, 4, np.float16, "NHD")
    with pytest.raises(NotImplementedError, match="use_cuda_graph"):
        BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 16, np.uint8), "NHD",
                                           use_cuda_graph=True, use_tensor_cores=True)
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD",
                                           use_tensor_cores=True)
    with pytest.raises(ValueError, match="last_page_len"):  # decode's argument names
        w.plan(pt.indptr, pt.indices, np.array([0, 9]), 4, 2, 64, 4)
    with pytest.raises(RuntimeError, match="plan"):  # the failed plan() left no plan
        w.run(q, cache)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 4, q_data_type="float16")
    with pytest.raises(ValueError, match="qo_indptr"):  # q's rows: one per request
        w.run(q[:1], cache)


def test_decode_on_tensor_cores_uses_the_paged_prefill_kernel(rng):
    # so `python -m nbinfer.warmup --kinds prefill` precompiles what use_tensor_cores runs
    from nbinfer.api.prefill import BatchPrefillWithPagedKVCacheWrapper

    pt = PageTable.from_kv_lens([37, 5], 16, rng=rng)
    args = (pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16)
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 22, np.uint8), use_tensor_cores=True)
    w.plan(*args, q_data_type="float16", logits_soft_cap=30.0)
    p = BatchPrefillWithPagedKVCacheWrapper(np.zeros(1 << 22, np.uint8))
    p.plan(np.array([0, 3, 6]), *args, q_data_type="float16", logits_soft_cap=30.0)
    assert w.step_plan.spec == p.step_plan.spec


@pytest.mark.parametrize("kv_lens, hq, hkv, d, ps, dtype, layout, kv_dtype, kw", [
    ([5, 21], 4, 1, 128, 16, np.float16, "NHD", None, {}),  # fp16 D 128: one k8 step
    ([19], 2, 1, 128, 16, np.float16, "HND", "float8_e4m3fn", {}),  # FP8 16-token groups
    ([17, 3], 8, 1, 64, 8, np.float16, "NHD", "float8_e5m2", dict(logits_soft_cap=5.0)),
])
def test_decode_mma_matches_reference(rng, monkeypatch, kv_lens, hq, hkv, d, ps, dtype, layout,
                                      kv_dtype, kw):
    # DecodeSpec(mma=True) in the simulator: the twins compute each lane's fragment elements
    # directly, so this checks the swizzled gather, the masking, the per-quad softmax, the
    # factors of the O^T columns' heads and the epilogue's dim map (out_dim) against the
    # reference; the fragment layouts themselves are the gpu test's (test_decode_mma_gpu).
    from nbinfer.api import decode as decode_api

    monkeypatch.setattr(decode_api, "DECODE_MMA", True)
    pt, cache, q = _case(rng, kv_lens, hq, hkv, d, ps, dtype, layout)
    plan_kw = dict(kw, fixed_split_size=16)
    kv = cache
    if kv_dtype:
        from nbinfer.reference import fp8

        cache = fp8.encode(cache, kv_dtype)
        kv = fp8.decode(cache, kv_dtype)
        plan_kw["kv_data_type"] = kv_dtype
    w, (out, lse) = _run(pt, cache, q, hkv, ps, layout, **plan_kw)
    assert w.step_plan.spec.mma
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, kv, pt.indptr, pt.indices, pt.last_page_len, kv_layout=layout, return_lse=True, **kw)
    assert rel_err(out, ref) <= TOLERANCE[np.dtype(dtype).name]
    assert np.allclose(lse, ref_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("d, itemsize", [(64, 1), (128, 1), (64, 2), (128, 2)])
def test_decode_mma_xor_addresses_follow_the_swizzled_rows(d, itemsize):
    # The tensor-core path's GPU code derives a group's shared addresses from one per lane by
    # XOR and constant offsets (key_chunk_addr, next_row_addr, which decode_mma_ops compiles:
    # K's chunk 4 i + t of rows 8 nt + g, FP8 V's rows 2t, 2t + 1, +8, +16); the simulator's
    # twins address every element through the swizzle itself, so these identities are what
    # ties the two. chunk_addr is the ops' own (the function the GPU build compiles and the
    # gather writes through). Bases aligned as the kernel aligns its ring.
    from nbinfer.kernels.decode_mma import ROW_ALIGN, decode_mma_ops, key_chunk_addr, next_row_addr

    ce = 16 // itemsize
    cr, tg = d // ce, 2048 // (d * itemsize)
    cmask, row_bytes = min(cr, 8) - 1, 16 * cr
    kv_dtype = "float8_e4m3fn" if itemsize == 1 else "float16"
    chunk_addr = decode_mma_ops(d, tg, kv_dtype, "float16", 4, sim=True).chunk_addr

    for base in (0, ROW_ALIGN, 5 * ROW_ALIGN + 4096):
        for g in range(8):
            for t in range(4):
                a00 = chunk_addr(base, g, t)
                for nt in range(tg // 8):
                    for i in range(d * itemsize // 64):
                        assert key_chunk_addr(a00, i, nt, row_bytes) == \
                            chunk_addr(base, 8 * nt + g, 4 * i + t)
                if itemsize == 1:
                    vb = d // 8
                    ci, off = g * vb // 16, (g * vb) % 16
                    for r0 in range(0, tg, 16):
                        v0 = chunk_addr(base, r0 + 2 * t, ci) + off
                        v1 = next_row_addr(v0, row_bytes, cmask)
                        assert v1 == chunk_addr(base, r0 + 2 * t + 1, ci) + off
                        assert v0 + 8 * row_bytes == chunk_addr(base, r0 + 2 * t + 8, ci) + off
                        assert v1 + 8 * row_bytes == chunk_addr(base, r0 + 2 * t + 9, ci) + off


def test_decode_mma_refuses_what_it_cannot_run():
    from nbinfer.kernels.decode import DecodeSpec, decode_kernel_source
    from nbinfer.kernels.decode_mma import mma_decode_supported
    from nbinfer.variants import builtins

    std, rope = builtins.standard(), builtins.rope_llama()
    assert mma_decode_supported(128, 4, "float16", "float16", std)
    assert mma_decode_supported(64, 8, "float8_e4m3fn", "float16", std)
    assert not mma_decode_supported(256, 4, "float16", "float16", std)  # D 256
    assert not mma_decode_supported(128, 16, "float16", "float16", std)  # G > 8
    assert not mma_decode_supported(128, 4, "float32", "float32", std)
    assert not mma_decode_supported(128, 4, "float8_e4m3fn", "bfloat16", std)
    assert not mma_decode_supported(128, 4, "float16", "float16", rope)  # K transform
    assert not mma_decode_supported(128, 4, "float16", "float16", builtins.sliding_window(8))
    with pytest.raises(ValueError, match="mma"):
        decode_kernel_source(DecodeSpec(256, 4, 16, "float16", "float16", "NHD", std, sim=True,
                                        mma=True))


def test_decode_mma_non_finite_rule_with_a_negative_scale(rng, monkeypatch):
    # The tensor-core path scales q.k after the product; an inf in q must still poison its
    # head when the scale is negative (+inf q.k -> -inf logit), as on CUDA cores.
    from nbinfer.api import decode as decode_api

    monkeypatch.setattr(decode_api, "DECODE_MMA", True)
    pt, cache, q = _case(rng, [9, 20], 4, 1, 64, 16, np.float16, "NHD")
    q[1, 2, 7] = np.inf
    cache[:, 0, :, :, 7] = np.abs(cache[:, 0, :, :, 7]) + 0.5  # every q.k of that head is +inf
    w, (out, lse) = _run(pt, cache, q, 1, 16, "NHD", sm_scale=-0.1)
    assert w.step_plan.spec.mma
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, sm_scale=-0.1, return_lse=True)
    assert np.array_equal(np.isnan(lse), np.isnan(ref_lse)) and np.isnan(lse[1, 2])
    ok = ~np.isnan(ref_lse)
    assert np.allclose(lse[ok], ref_lse[ok], atol=1e-4, rtol=0)
    assert rel_err(out[0], ref[0]) <= TOLERANCE["float16"]


def test_cuda_graph_mode_runs_later_plans_from_the_callers_buffers(rng):
    # use_cuda_graph=True: every plan keeps one layout and reads its page table from the
    # caller's buffers (the layout's own table sections, sized for the buffers, are not
    # uploaded), so steps of other lengths and batch sizes run right on the same arguments
    num_pages, hq, hkv, d, ps, batch = 40, 4, 2, 64, 4, 3
    cache = rng.standard_normal((num_pages, 2, ps, hkv, d)).astype(np.float16)
    bufs = (np.zeros(batch + 1, np.int32), np.zeros(batch * num_pages, np.int32),
            np.zeros(batch, np.int32))
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD",
                                           use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                           paged_kv_indices_buffer=bufs[1],
                                           paged_kv_last_page_len_buffer=bufs[2])
    first = None
    for lens in ([30, 5, 61], [1, 90, 7], [12, 0, 33], [44, 45]):
        pt = PageTable.from_kv_lens(lens, ps, num_pages=num_pages, rng=rng)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type="float16")
        launch = w.step_plan.launch
        first = first or (launch, launch.layout, launch.ints)
        # the same launch, layout and plan memory (the kernel arguments), step after step
        assert launch is first[0] and launch.layout is first[1] and launch.ints is first[2]
        q = rng.standard_normal((len(lens), hq, d)).astype(np.float16)
        out = w.run(q, cache)
        ref = reference.batch_decode_with_paged_kv_cache(q, cache, pt.indptr, pt.indices,
                                                         pt.last_page_len)
        assert rel_err(out, ref) <= TOLERANCE["float16"], lens
