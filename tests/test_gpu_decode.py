"""Batch decode kernels on a real GPU against the float64 reference (skipped without a GPU).

The matrix covers head_dim 64/128/256, GQA group sizes 1/4/8, page sizes 1, 16 and odd ones,
fp16/bf16/fp32, NHD/HND, every built-in variant, kv lengths from 1 to 16384 and batch 1 to 128,
on fresh random data, chosen so that each value of each axis appears at least once without a
full cross product. Plus the array kinds (torch, cupy, numba, numpy) and the errors that only a
GPU can raise (devices, alignment).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer import variants as V
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper
from nbinfer.formats import PageTable

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

TORCH_DTYPE = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}

# (batch, max_len, hq, hkv, d, page_size, dtype, layout, plan keywords)
MATRIX = [
    (1, 1, 8, 8, 128, 16, "float16", "NHD", {}),
    (1, 16384, 32, 8, 128, 16, "float16", "NHD", {}),
    (128, 600, 32, 8, 128, 16, "float16", "HND", {}),
    (7, 3000, 32, 4, 64, 1, "bfloat16", "NHD", {}),
    (5, 2000, 16, 16, 256, 7, "float32", "HND", {}),
    (9, 1500, 64, 8, 256, 16, "bfloat16", "NHD", {}),
    (4, 5000, 8, 1, 64, 13, "float16", "HND", {}),  # group 8
    (3, 2500, 32, 8, 128, 16, "float16", "NHD", dict(logits_soft_cap=30.0)),
    (3, 2500, 32, 8, 128, 5, "bfloat16", "NHD", dict(window_left=300)),
    (3, 2500, 32, 8, 128, 16, "float16", "HND", dict(pos_encoding_mode="ROPE_LLAMA",
                                                     rope_theta=5e5)),
    (3, 2500, 32, 4, 64, 16, "float32", "NHD", dict(pos_encoding_mode="ALIBI")),
    (3, 2500, 32, 8, 128, 1, "float16", "NHD", dict(variant=V.sigmoid_attention(0.5, -1.0))),
    (3, 2500, 32, 8, 128, 16, "float16", "NHD",
     dict(variant=V.attention_sink(np.linspace(-1.0, 2.0, 32)))),
    (3, 2500, 32, 8, 128, 16, "float16", "NHD", dict(variant=V.causal())),
]


def _case(rng, batch, max_len, hkv, hq, d, ps, dtype, layout):
    lens = rng.integers(1, max_len + 1, size=batch)
    lens[0] = max_len
    pt = PageTable.from_kv_lens(lens, ps, rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    tdt = getattr(torch, dtype)
    cache = torch.randn(shape, device="cuda").to(tdt)
    q = torch.randn(batch, hq, d, device="cuda").to(tdt)
    return pt, cache, q


def _reference(q, cache, pt, layout, **kw):
    return reference.batch_decode_with_paged_kv_cache(
        q.float().cpu().numpy(), cache.float().cpu().numpy(), pt.indptr, pt.indices,
        pt.last_page_len, kv_layout=layout, return_lse=True, **kw)


@pytest.mark.parametrize("batch, max_len, hq, hkv, d, ps, dtype, layout, kw", MATRIX)
def test_decode_matrix(rng, batch, max_len, hq, hkv, d, ps, dtype, layout, kw):
    pt, cache, q = _case(rng, batch, max_len, hkv, hq, d, ps, dtype, layout)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q.dtype, **kw)
    out, lse = w.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    assert isinstance(out, torch.Tensor) and out.dtype == q.dtype and out.is_cuda
    ref, ref_lse = _reference(q, cache, pt, layout, **kw)
    assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE[dtype]
    if "variant" not in kw or kw["variant"].use_softmax:
        np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=0, atol=5e-3)


@pytest.mark.parametrize("hq", [32, 64])
def test_grid_follows_occupancy(rng, hq):
    """The persistent grid holds as many CTAs per SM as the driver's occupancy calculator says
    are resident at once, at most four: the decode kernel under its 128-register cap holds four
    at groups 4 and 8 (a larger grid would run its last CTAs as a second wave)."""
    pt, cache, q = _case(rng, 6, 3000, 8, hq, 128, 16, "float16", "NHD")
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, 8, 128, 16, q_data_type=q.dtype)
    kernel = w.step_plan.launch.launch.kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kernel.max_registers == 128 and kernel.regs <= 128
    assert kernel.resident_ctas(128) == 4 and w.schedule.num_ctas == sms * 4
    out = w.run(q, cache)
    torch.cuda.synchronize()
    ref, _ = _reference(q, cache, pt, "NHD")
    assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE["float16"]


@pytest.mark.parametrize("stages, d, dtype, layout, per_sm, mma", [
    (3, 128, "float16", "NHD", 4, False), (3, 64, "bfloat16", "HND", 4, False),
    (4, 128, "float16", "NHD", 3, False),
    # tensor cores on a ring allocated at launch: their XOR addressing needs its 256-B alignment
    (3, 128, "float16", "HND", 4, True)])
def test_decode_deeper_kv_ring(rng, monkeypatch, stages, d, dtype, layout, per_sm, mma):
    """A KV ring of three or four groups per warp (allocated at launch: 48 / 64 KiB per CTA)
    matches the reference; the grid follows the occupancy it leaves (four CTAs per SM at three
    stages, three at four)."""
    from nbinfer.api import decode as decode_api

    monkeypatch.setattr(decode_api, "DECODE_STAGES", stages)
    monkeypatch.setattr(decode_api, "DECODE_MMA", mma)
    pt, cache, q = _case(rng, 9, 5000, 8, 32, d, 16, dtype, layout)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, d, 16, q_data_type=q.dtype)
    kernel = w.step_plan.launch.launch.kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert w.step_plan.spec.stages == stages and kernel.dynamic_shared == stages * 16 * 1024
    assert w.step_plan.spec.mma == mma
    assert w.schedule.num_ctas == sms * per_sm
    out, lse = w.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, pt, layout)
    assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE[dtype]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=0, atol=5e-3)


@pytest.mark.parametrize("batch, max_len, hq, hkv, d, ps, dtype, layout, fmt", [
    (64, 4096, 32, 8, 128, 16, "float16", "NHD", None),  # the benchmark's shape
    (16, 20000, 32, 8, 128, 16, "float16", "HND", None),  # split rows
    (9, 3000, 64, 8, 128, 16, "bfloat16", "NHD", None),  # group 8
    (7, 3000, 32, 4, 64, 32, "float16", "HND", None),  # 16-token groups, two per page
    (8, 3000, 32, 8, 128, 16, "float16", "NHD", "float8_e4m3fn"),  # FP8: 16-token groups
    (5, 2500, 32, 8, 128, 5, "float16", "NHD", None),  # pages smaller than a group
])
def test_decode_page_groups_gpu(rng, monkeypatch, batch, max_len, hq, hkv, d, ps, dtype, layout,
                                fmt):
    """DecodeSpec.page_groups (one page-table read per token group inside a page) gives the same
    bits as the general addressing, and matches the reference."""
    from nbinfer.api import decode as decode_api

    pt, cache, q = _case(rng, batch, max_len, hkv, hq, d, ps, dtype, layout)
    kw = {}
    if fmt:
        cache, kw = cache.to(getattr(torch, fmt)), dict(kv_data_type=fmt)
    outs = []
    for flag in (False, True):
        monkeypatch.setattr(decode_api, "DECODE_PAGE_GROUPS", flag)
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                           device="cuda"), layout)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q.dtype,
               **kw)
        assert w.step_plan.spec.page_groups == flag
        outs.append(w.run(q, cache, return_lse=True))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref, _ = _reference(q, cache, pt, layout)
    assert rel_err(outs[1][0].float().cpu().numpy(), ref) <= TOLERANCE[dtype]


# DecodeSpec(mma=True): q.k and p.v of the CUDA-core decode's pipeline on tensor cores. Both
# head dims, groups 1-8, page sizes 1, 16 and odd, both layouts, fp16/bf16 and both FP8 formats,
# the variants it takes (soft cap, sigmoid, sinks), a long request split over CTAs.
MMA_MATRIX = [
    (9, 3000, 32, 8, 128, 16, "float16", "NHD", None, {}),
    (1, 16384, 32, 8, 128, 16, "float16", "HND", None, {}),
    (7, 2000, 64, 8, 128, 1, "bfloat16", "HND", None, {}),  # group 8
    (5, 2500, 16, 8, 64, 16, "float16", "HND", None, {}),  # group 2
    (6, 1800, 8, 8, 64, 5, "bfloat16", "NHD", None, {}),  # group 1
    (8, 3000, 32, 8, 128, 16, "float16", "NHD", "float8_e4m3fn", {}),
    (5, 2500, 64, 8, 128, 16, "float16", "HND", "float8_e5m2", {}),
    (4, 2000, 32, 8, 64, 1, "float16", "NHD", "float8_e4m3fn", {}),
    (3, 2500, 32, 8, 128, 16, "float16", "NHD", None, dict(logits_soft_cap=30.0)),
    (3, 2500, 32, 8, 128, 1, "float16", "NHD", None,
     dict(variant=V.sigmoid_attention(0.5, -1.0))),
    (3, 2500, 32, 8, 128, 16, "float16", "NHD", None,
     dict(variant=V.attention_sink(np.linspace(-1.0, 2.0, 32)))),
]


@pytest.mark.parametrize("batch, max_len, hq, hkv, d, ps, dtype, layout, fmt, kw", MMA_MATRIX)
def test_decode_mma_gpu(rng, monkeypatch, batch, max_len, hq, hkv, d, ps, dtype, layout, fmt,
                        kw):
    """DecodeSpec(mma=True) matches the float64 reference (on the dequantised cache for FP8),
    output and LSE, within the CUDA-core path's tolerance."""
    from nbinfer.api import decode as decode_api

    monkeypatch.setattr(decode_api, "DECODE_MMA", True)
    pt, cache, q = _case(rng, batch, max_len, hkv, hq, d, ps, dtype, layout)
    plan_kw = dict(kw)
    if fmt:
        cache, plan_kw["kv_data_type"] = cache.to(getattr(torch, fmt)), fmt
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), layout)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q.dtype,
           **plan_kw)
    assert w.step_plan.spec.mma
    out, lse = w.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, pt, layout, **kw)
    assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE[dtype]
    assert np.allclose(lse.cpu().numpy(), ref_lse, atol=1e-3, rtol=0)


# use_tensor_cores=True: page sizes 1 and 16, D 64/128 (tensor cores) and 256 (the CUDA-core
# prefill kernel), groups 1-8, both layouts, fp16 and bf16, every built-in variant
TENSOR_CORE_MATRIX = [
    (9, 3000, 32, 8, 128, 16, "float16", "NHD", {}),
    (7, 3000, 32, 4, 64, 1, "bfloat16", "HND", {}),
    (5, 1500, 8, 8, 128, 16, "bfloat16", "NHD", dict(logits_soft_cap=30.0)),  # group 1
    (4, 5000, 16, 2, 64, 16, "float16", "HND", dict(window_left=300)),  # group 8
    (3, 2500, 32, 8, 128, 1, "float16", "NHD", dict(pos_encoding_mode="ROPE_LLAMA",
                                                    rope_theta=5e5)),
    (3, 2500, 32, 4, 64, 16, "bfloat16", "NHD", dict(pos_encoding_mode="ALIBI")),
    (3, 2500, 32, 8, 128, 16, "float16", "HND", dict(variant=V.sigmoid_attention(0.5, -1.0))),
    (3, 2500, 32, 8, 128, 16, "float16", "NHD",
     dict(variant=V.attention_sink(np.linspace(-1.0, 2.0, 32)))),
    (3, 2000, 16, 4, 256, 16, "float16", "NHD", dict(variant=V.causal())),
]


@pytest.mark.parametrize("batch, max_len, hq, hkv, d, ps, dtype, layout, kw",
                         TENSOR_CORE_MATRIX)
def test_decode_on_tensor_cores(rng, batch, max_len, hq, hkv, d, ps, dtype, layout, kw):
    pt, cache, q = _case(rng, batch, max_len, hkv, hq, d, ps, dtype, layout)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), layout,
                                           use_tensor_cores=True)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, q_data_type=q.dtype, **kw)
    assert type(w.step_plan.spec).__name__ == ("MmaPrefillSpec" if d <= 128 else "PrefillSpec")
    out, lse = w.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = _reference(q, cache, pt, layout, **kw)
    assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE[dtype]
    if "variant" not in kw or kw["variant"].use_softmax:
        np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=0, atol=5e-3)


def test_plan_reused_across_layers_and_out_buffers(rng):
    pt, cache, q = _case(rng, 6, 3000, 8, 32, 128, 16, "float16", "NHD")
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16, q_data_type="float16")
    out = torch.empty_like(q)
    lse = torch.empty(6, 32, device="cuda")
    for _layer in range(3):  # a new cache and q per layer, one plan
        cache = torch.randn_like(cache)
        q = torch.randn_like(q)
        res, res_lse = w.run(q, cache, out=out, lse=lse, return_lse=True)
        assert res.data_ptr() == out.data_ptr() and res_lse.data_ptr() == lse.data_ptr()
        ref, _ = _reference(q, cache, pt, "NHD")
        assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE["float16"]


def test_page_tables_as_cuda_tensors(rng):
    # int32 CUDA tables are read back in one wait (TableReader); other dtypes take the general
    # path; both must plan exactly what host tables plan, and the plan keeps a snapshot
    pt, cache, q = _case(rng, 9, 2500, 8, 32, 128, 16, "float16", "NHD")
    ws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    host = BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    dev = BatchDecodeWithPagedKVCacheWrapper(torch.empty_like(ws), "NHD")
    args = (32, 8, 128, 16)
    for _ in range(2):  # the second plan() of a wrapper runs the compiled check and schedule
        host.plan(pt.indptr, pt.indices, pt.last_page_len, *args, q_data_type="float16")
        want = host.run(q, cache)
        for dtype in (torch.int32, torch.int64):
            tables = [torch.as_tensor(a, device="cuda").to(dtype)
                      for a in (pt.indptr, pt.indices, pt.last_page_len)]
            dev.plan(*tables, *args, q_data_type="float16")
            for t in tables:
                t.fill_(-5)  # the plan holds its own copy
            assert dev.step_plan.schedule == host.step_plan.schedule
            np.testing.assert_array_equal(dev.step_plan.kv_indices, pt.indices)
            assert torch.equal(dev.run(q, cache), want)
    bad = torch.as_tensor(pt.indices, device="cuda").to(torch.int32)
    bad[3] = -1
    with pytest.raises(ValueError, match="indices"):
        dev.plan(torch.as_tensor(pt.indptr, device="cuda").to(torch.int32), bad,
                 torch.as_tensor(pt.last_page_len, device="cuda").to(torch.int32), *args,
                 q_data_type="float16")


def test_array_kinds_round_trip(rng):
    cupy = pytest.importorskip("cupy")
    from numba import cuda

    pt, cache, q = _case(rng, 3, 700, 4, 16, 64, 8, "float16", "HND")
    ref, _ = _reference(q, cache, pt, "HND")
    k_t, v_t = cache[:, 0].contiguous(), cache[:, 1].contiguous()
    kinds = {
        "cupy": (cupy.asarray(q), cupy.asarray(cache)),
        "numba": (cuda.as_cuda_array(q), (cuda.as_cuda_array(k_t), cuda.as_cuda_array(v_t))),
        "numpy": (q.cpu().numpy(), cache.cpu().numpy()),
    }
    for name, (qq, cc) in kinds.items():
        w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8,
                                                           device="cuda"), "HND")
        if name == "numpy":
            w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "HND",
                                                   backend="cuda")
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 16, 4, 64, 8, q_data_type="float16")
        out = w.run(qq, cc)
        host = {"cupy": lambda a: a.get(), "numba": lambda a: a.copy_to_host(),
                "numpy": np.asarray}[name](out)
        assert type(out).__module__.split(".")[0] == type(qq).__module__.split(".")[0], name
        assert rel_err(host.astype(np.float32), ref) <= TOLERANCE["float16"], name


def test_gpu_errors(rng):
    pt, cache, q = _case(rng, 2, 100, 2, 4, 64, 16, "float16", "NHD")
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, 16, q_data_type="float16")
    with pytest.raises(ValueError, match="different devices"):
        w.run(q.cpu(), cache)
    flat = torch.empty(cache.numel() + 1, dtype=torch.float16, device="cuda")
    misaligned = flat[1:].view(cache.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(q, misaligned)


def test_fast_and_careful_paths_agree_bitwise(rng):
    pt, cache, q = _case(rng, 5, 4000, 8, 32, 128, 16, "bfloat16", "NHD")
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, 32, 8, 128, 16, q_data_type="bfloat16")
    assert w.step_plan.fast is not None
    fast_o, fast_lse = w.run(q, cache, return_lse=True)
    tuple_o = w.run(q, (cache[:, 0].contiguous(), cache[:, 1].contiguous()))
    # The careful path: a cache that is a view of a larger pool (strides read in place).
    pool = torch.empty((cache.shape[0] + 3, *cache.shape[1:]), dtype=cache.dtype,
                       device=cache.device)
    pool[1:1 + cache.shape[0]] = cache
    slow_o, slow_lse = w.run(q, pool[1:1 + cache.shape[0]], return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(fast_o, slow_o) and torch.equal(fast_lse, slow_lse)
    assert torch.equal(fast_o, tuple_o)


@pytest.mark.parametrize("layout, dtype", [("NHD", "float16"), ("HND", "bfloat16")])
def test_single_decode_gpu(rng, layout, dtype):
    from nbinfer.api.single import single_decode_with_kv_cache

    kv_len, hq, hkv, d = 20000, 32, 8, 128
    shape = (kv_len, hkv, d) if layout == "NHD" else (hkv, kv_len, d)
    tdt = getattr(torch, dtype)
    q = torch.randn(hq, d, device="cuda").to(tdt)
    k = torch.randn(shape, device="cuda").to(tdt)
    v = torch.randn(shape, device="cuda").to(tdt)
    out, lse = single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True,
                                           logits_soft_cap=30.0)
    ref, ref_lse = reference.single_decode_with_kv_cache(
        q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(),
        kv_layout=layout, logits_soft_cap=30.0, return_lse=True)
    assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE[dtype]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=5e-3)
