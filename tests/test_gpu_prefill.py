"""Prefill, block-sparse and cascade wrappers on a real GPU vs the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer.api import prefill as prefill_api
from nbinfer.api.cascade import MultiLevelCascadeAttentionWrapper
from nbinfer.api.launch import defer_frees
from nbinfer.api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
)
from nbinfer.api.sparse import BlockSparseAttentionWrapper
from nbinfer.formats import PageTable

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _ws():
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def _t(x, dtype):
    return torch.from_numpy(np.ascontiguousarray(x)).to("cuda", getattr(torch, dtype))


def _np(t):
    return t.float().cpu().numpy()


PAGED_CASES = [
    ([1, 37, 512], [100, 700, 2048], 32, 8, 128, 16, "float16", "NHD", dict(causal=True)),
    ([64, 3], [64, 4000], 32, 4, 64, 1, "bfloat16", "HND", dict(causal=True, window_left=100)),
    ([16], [3000], 16, 16, 256, 7, "float32", "NHD", dict(pos_encoding_mode="ROPE_LLAMA")),
    ([100, 20], [5000, 300], 32, 8, 128, 16, "float16", "NHD",
     dict(logits_soft_cap=30.0, fixed_split_size=512)),
    ([33, 1], [2000, 17], 32, 8, 128, 16, "float16", "HND",
     dict(pos_encoding_mode="ROPE_LLAMA", causal=True)),
    ([40, 7], [900, 77], 32, 32, 64, 5, "bfloat16", "NHD", dict(pos_encoding_mode="ALIBI")),
    ([300], [300], 64, 8, 128, 16, "bfloat16", "NHD", dict(causal=True)),
]


@pytest.mark.parametrize("qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw", PAGED_CASES)
def test_paged_prefill_gpu(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw):
    _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))


@pytest.mark.parametrize("qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw",
                         [c for c in PAGED_CASES if c[6] != "float32"])
def test_paged_prefill_gpu_64_key_tiles(rng, monkeypatch, qo_lens, kv_lens, hq, hkv, d, ps,
                                        dtype, layout, kw):
    # The tensor-core kernel with 64-key tiles: Q read from shared memory per k-step, and at
    # D 128 its 87 KiB of shared memory allocated at launch (past the static 48 KiB).
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", 64)
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    assert w.step_plan.spec.kv_tile == 64
    assert (w.step_plan.launch.launch.shared > 48 * 1024) == (d == 128)


@pytest.mark.parametrize("qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw",
                         [PAGED_CASES[i] for i in (0, 3, 4)])
def test_paged_prefill_gpu_q_shared_capped(rng, monkeypatch, qo_lens, kv_lens, hq, hkv, d, ps,
                                           dtype, layout, kw):
    # 32-key tiles with Q in shared memory under a 168-register cap: three CTAs per SM
    # (52 KiB of shared memory each at D 128, allocated at launch).
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", 32)
    monkeypatch.setattr(prefill_api, "MMA_Q_SHARED", True)
    monkeypatch.setattr(prefill_api, "MMA_MAX_REGISTERS", 168)
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    spec = w.step_plan.spec
    assert spec.q_in_shared and spec.max_registers == 168
    assert w.step_plan.launch.launch.kernel.regs <= 168


@pytest.mark.parametrize("kv_tile, stages, case", [(32, 3, 0), (32, 4, 3), (64, 3, 1)])
def test_paged_prefill_gpu_deeper_pipelines(rng, monkeypatch, kv_tile, stages, case):
    # 3 or 4 KV stages in shared memory (tiles i + 1 .. i + stages - 1 in flight): causal D 128,
    # chunks merged in the kernel (split 512), D 64 bf16 at page size 1 with a window.
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", kv_tile)
    monkeypatch.setattr(prefill_api, "MMA_STAGES", stages)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = PAGED_CASES[case]
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    assert w.step_plan.spec.stages == stages


@pytest.mark.parametrize("case", [0, 3, 5])
def test_paged_prefill_gpu_merge_launch(rng, monkeypatch, case):
    # Split rows merged by a launch of their own after the kernel (defer_merge): a causal plan
    # with the planner's chunks, fixed chunks of 512 with a soft cap, ALiBi at D 64.
    monkeypatch.setattr(prefill_api, "MMA_DEFER_MERGE", True)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = PAGED_CASES[case]
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    assert w.step_plan.spec.defer_merge


@pytest.mark.parametrize("case", [0, 1, 3])
def test_paged_prefill_gpu_eight_warps(rng, monkeypatch, case):
    # 8 warps per CTA (128 packed rows share each KV tile; one CTA per SM).
    monkeypatch.setattr(prefill_api, "MMA_WARPS", 8)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = PAGED_CASES[case]
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    assert w.step_plan.spec.num_warps == 8


@pytest.mark.parametrize("case", [0, 1, 3, 4, 5, 6])
def test_paged_prefill_gpu_wgmma(rng, monkeypatch, case):
    # The tensor-core kernel's products on Hopper's warpgroup MMA: two warpgroups of 64 packed
    # rows, tiles in the canonical layouts, every variant of the grid (causal, window, RoPE,
    # soft cap, ALiBi; GQA 1-8, pages of 1, 5 and 16, NHD / HND, fp16 / bf16, D 64 / 128).
    # (The causal cases 0 and 6 would take the lean kernel: here its general form.)
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    monkeypatch.setattr(prefill_api, "MMA_WGMMA_LEAN", False)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = PAGED_CASES[case]
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    spec = w.step_plan.spec
    assert spec.wgmma and spec.num_warps == 8 and spec.kv_tile == 64 and not spec.lean


LEAN_PAGED = [PAGED_CASES[0], PAGED_CASES[6],
              ([5, 200, 64], [5, 900, 64], 32, 8, 64, 16, "bfloat16", "HND", {}),
              ([130, 1], [2500, 7], 16, 16, 128, 1, "float16", "NHD",
               dict(causal=True, fixed_split_size=512)),
              ([77, 300], [1000, 300], 32, 4, 64, 5, "float16", "NHD",
               dict(sm_scale=-0.05, fixed_split_size=256))]


# (LEAN_PREFETCH, LEAN_LAZY_RESCALE, LEAN_QK_AHEAD, LEAN_SWIZZLE) per form of the lean kernel
LEAN_FORMS = {"plain": (False, False, False, True), "prefetch": (True, False, False, True),
              "lazy": (False, True, False, True), "ahead": (False, False, True, True),
              "prefetch_ahead": (True, False, True, True),
              "canonical": (False, False, True, False)}


@pytest.mark.parametrize("form", list(LEAN_FORMS))
@pytest.mark.parametrize("case", range(len(LEAN_PAGED)))
def test_paged_prefill_gpu_wgmma_lean(rng, monkeypatch, case, form):
    # The lean warpgroup kernel (kernels/prefill_wgmma.py) on paged KV: causal and not, GQA 1-8,
    # pages of 1 / 5 / 16, NHD / HND, fp16 / bf16, D 64 / 128, split rows (merge launch), and a
    # negative scale (each score scaled before the maximum; with the per-item overlap, Q through
    # the stager: cp.async cannot negate). "prefetch": LEAN_PREFETCH, the per-item overlap (Q by
    # cp.async, the next item's first KV tile and Q requested during the last tile); "lazy":
    # LEAN_LAZY_RESCALE, the rescale only when a row's maximum grows by more than 2^8;
    # "ahead": LEAN_QK_AHEAD, each tile's S = Q K^T issued before the ring's refill; all but
    # "canonical" with K and V in the 128-byte swizzled layout (LEAN_SWIZZLE).
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    for knob, on in zip(("LEAN_PREFETCH", "LEAN_LAZY_RESCALE", "LEAN_QK_AHEAD", "LEAN_SWIZZLE"),
                        LEAN_FORMS[form], strict=True):
        monkeypatch.setattr(prefill_api, knob, on)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = LEAN_PAGED[case]
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    spec = w.step_plan.spec
    assert spec.lean and spec.wgmma and spec.defer_merge and spec.max_registers == 128
    assert (spec.prefetch, spec.lazy_rescale, spec.qk_ahead, spec.swizzle) == LEAN_FORMS[form]
    assert w.step_plan.launch.launch.kernel.regs <= 128


@pytest.mark.parametrize("aligned, lazy, ahead", [(True, False, False), (False, False, False),
                                                   (True, True, False), (True, False, True),
                                                   (False, False, True)])
def test_ragged_prefill_gpu_wgmma_lean_prefetch(rng, monkeypatch, aligned, lazy, ahead):
    # Ragged causal G 4 with tails against the 128-row tile; q 16-byte aligned (Q by
    # cp.async) or a view one element in (the stager); with the lazy rescale or S = Q K^T
    # ahead of the refill too. Items without a tile among the others: a request with no KV,
    # and one with more queries than keys (bottom-right causal: its first 200 rows see no key).
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    monkeypatch.setattr(prefill_api, "LEAN_PREFETCH", True)
    monkeypatch.setattr(prefill_api, "LEAN_LAZY_RESCALE", lazy)
    monkeypatch.setattr(prefill_api, "LEAN_QK_AHEAD", ahead)
    qo_lens, kv_lens = [1, 129, 300, 64, 40, 300], [1, 700, 300, 2000, 0, 100]
    hq, hkv, d = 32, 8, 128
    qo, kv = (np.concatenate([[0], np.cumsum(x)]) for x in (qo_lens, kv_lens))
    q = rng.standard_normal((int(qo[-1]), hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((int(kv[-1]), hkv, d)).astype(np.float32) for _ in range(2))
    tq, tk, tv = (_t(x, "float16") for x in (q, k, v))
    if not aligned:
        tq = torch.empty(tq.numel() + 1, dtype=tq.dtype, device="cuda")[1:].view(tq.shape)
        tq.copy_(_t(q, "float16"))
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo, kv, hq, hkv, d, causal=True, q_data_type="float16")
    assert w.step_plan.spec.lean and w.step_plan.spec.prefetch
    assert w.step_plan.spec.qk_ahead == ahead
    out, lse = w.run(tq, tk, tv, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        _np(tq), _np(tk), _np(tv), qo, kv, causal=True, return_lse=True)
    assert np.isneginf(ref_lse).sum() == (40 + 200) * hq  # the rows that see no key
    assert rel_err(_np(out), ref) <= TOLERANCE["float16"]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=5e-3)


@pytest.mark.parametrize("causal, dtype, d, hkv, ahead", [(True, "float16", 128, 32, False),
                                                          (False, "bfloat16", 128, 4, False),
                                                          (True, "bfloat16", 64, 8, False),
                                                          (False, "float16", 64, 32, False),
                                                          (True, "float16", 128, 32, True),
                                                          (False, "bfloat16", 128, 4, True)])
def test_ragged_prefill_gpu_wgmma_lean(rng, monkeypatch, causal, dtype, d, hkv, ahead):
    # Ragged KV, the benchmark's path: tails of every length against 128-row tiles, a request
    # whose KV is longer than its queries (bottom-right causal), and the LSE; ahead:
    # LEAN_QK_AHEAD.
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    monkeypatch.setattr(prefill_api, "LEAN_QK_AHEAD", ahead)
    qo_lens, kv_lens, hq = [1, 129, 300, 64], [1, 700, 300, 2000], 32
    qo, kv = (np.concatenate([[0], np.cumsum(x)]) for x in (qo_lens, kv_lens))
    q = rng.standard_normal((int(qo[-1]), hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((int(kv[-1]), hkv, d)).astype(np.float32) for _ in range(2))
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo, kv, hq, hkv, d, causal=causal, q_data_type=dtype)
    assert w.step_plan.spec.lean and w.step_plan.spec.qk_ahead == ahead
    tq, tk, tv = (_t(x, dtype) for x in (q, k, v))
    out, lse = w.run(tq, tk, tv, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        _np(tq), _np(tk), _np(tv), qo, kv, causal=causal, return_lse=True)
    assert rel_err(_np(out), ref) <= TOLERANCE[dtype]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=5e-3)


@pytest.mark.parametrize("case", [0, 5])
def test_paged_prefill_gpu_wgmma_one_warpgroup(rng, monkeypatch, case):
    # One warpgroup per CTA (64 packed rows) under a 168-register cap: three CTAs per SM, the
    # mma.sync kernel's shape (bench/NOTES.md, session 16: the shape to measure next).
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    monkeypatch.setattr(prefill_api, "MMA_WARPS", 4)
    monkeypatch.setattr(prefill_api, "MMA_MAX_REGISTERS", 168)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = PAGED_CASES[case]
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    spec = w.step_plan.spec
    assert spec.wgmma and spec.num_warps == 4 and spec.max_registers == 168


DECODE_LIKE = {  # one query row per request: the GQA group's 8 or 16 rows in one item
    "decode-g8": ([1] * 40, list(range(7, 40 * 97, 97)), 32, 4, 128, 16, "float16", "NHD", {}),
    "decode-g16-d64": ([1] * 24, list(range(0, 24 * 131, 131)), 32, 2, 64, 16, "bfloat16",
                       "HND", dict(fixed_split_size=256)),
}


@pytest.mark.parametrize("tiles, case", [("64", 0), ("64", "decode-g8"), ("32s168", 4),
                                         ("32s168", "decode-g16-d64")])
def test_paged_prefill_gpu_kv_split(rng, monkeypatch, tiles, case):
    # kv_split: items of at most 16 packed rows (request 0 of case 0; request 1 and the 1-row
    # tail of request 0 of case 4; every decode-like item) split each KV tile's keys over the 4
    # warps (64-key tiles: 16 each) or 2 (32-key tiles), merged at the item's end; the other
    # items keep the row tile.
    monkeypatch.setattr(prefill_api, "MMA_KV_SPLIT", True)
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", int(tiles[:2]))
    if tiles == "32s168":
        monkeypatch.setattr(prefill_api, "MMA_Q_SHARED", True)
        monkeypatch.setattr(prefill_api, "MMA_MAX_REGISTERS", 168)
    qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw = (
        DECODE_LIKE[case] if isinstance(case, str) else PAGED_CASES[case])
    w = _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, dict(kw))
    assert w.step_plan.spec.kv_split


def _paged_case(rng, qo_lens, kv_lens, hq, hkv, d, ps, dtype, layout, kw):
    pt = PageTable.from_kv_lens(kv_lens, ps, rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(np.float32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float32)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), layout)
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
           q_data_type=dtype, **kw)
    # fp16/bf16 at head_dim 64/128 run on tensor cores, the rest on the CUDA-core tile kernel.
    mma = dtype != "float32" and d in (64, 128)
    assert (type(w.step_plan.spec).__name__ == "MmaPrefillSpec") == mma
    out, lse = w.run(_t(q, dtype), _t(cache, dtype), return_lse=True)
    torch.cuda.synchronize()
    kw.pop("fixed_split_size", None)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        _np(_t(q, dtype)), qo_indptr, _np(_t(cache, dtype)), pt.indptr, pt.indices,
        pt.last_page_len, kv_layout=layout, return_lse=True, **kw)
    assert rel_err(_np(out), ref) <= TOLERANCE[dtype]
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, atol=5e-3)
    return w


@pytest.mark.parametrize("wgmma", [False, True])
def test_ragged_and_single_prefill_gpu(rng, monkeypatch, wgmma):
    # wgmma: the custom mask's plan runs the value scan, the warpgroup kernel and its guarded
    # twin on mma.sync; the single causal prefill the lean warpgroup kernel.
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", wgmma)
    qo_indptr, kv_indptr = np.array([0, 300, 333]), np.array([0, 900, 1933])
    q = rng.standard_normal((333, 32, 128)).astype(np.float32)
    k = rng.standard_normal((1933, 8, 128)).astype(np.float32)
    v = rng.standard_normal((1933, 8, 128)).astype(np.float32)
    mask = rng.random(300 * 900 + 33 * 1033) < 0.5
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, 32, 8, 128, custom_mask=mask, q_data_type="float16")
    tq, tk, tv = (_t(x, "float16") for x in (q, k, v))
    assert w.step_plan.spec.wgmma == wgmma
    out = w.run(tq, tk, tv)
    ref = reference.batch_prefill_with_ragged_kv_cache(_np(tq), _np(tk), _np(tv), qo_indptr,
                                                       kv_indptr, custom_mask=mask)
    assert rel_err(_np(out), ref) <= TOLERANCE["float16"]
    one = single_prefill_with_kv_cache(tq[:300], tk[:900], tv[:900], causal=True)
    ref = reference.single_prefill_with_kv_cache(_np(tq[:300]), _np(tk[:900]), _np(tv[:900]),
                                                 causal=True)
    assert rel_err(_np(one), ref) <= TOLERANCE["float16"]


@pytest.mark.parametrize("R, C", [(16, 16), (64, 64), (1, 16), (16, 1)])
def test_block_sparse_gpu(rng, R, C):
    M, N = 1000, 1300
    mb, nb = -(-M // R), -(-N // C)
    dense = rng.random((mb, nb)) < min(0.3, 40 / nb)
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int32)
    indices = np.concatenate([np.flatnonzero(r) for r in dense]).astype(np.int32)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((M, 32, 128), (N, 8, 128), (N, 8, 128)))
    tq, tk, tv = (_t(x, "float16") for x in (q, k, v))
    w = BlockSparseAttentionWrapper(_ws())
    w.plan(indptr, indices, M, N, R, C, 32, 8, 128, causal=True, q_data_type="float16")
    out = w.run(tq, tk, tv)
    ref = reference.block_sparse_attention(_np(tq), _np(tk), _np(tv), indptr, indices, R, C,
                                           causal=True)
    assert rel_err(_np(out), ref) <= TOLERANCE["float16"]


@pytest.mark.parametrize("kv_split, d", [(False, 128), (True, 128), ("levels", 128),
                                         ("levels-prefetch", 128), (False, 64),
                                         ("prefetch", 128), ("prefetch", 64)])
def test_cascade_gpu(rng, monkeypatch, kv_split, d):
    # (kv_split: the own level's items, one row of 4 packed heads each, split by keys;
    # "levels": CASCADE_LAUNCH = "levels", the prefix level on the prefill rule's kernel (the
    # lean one on sm_90: 64 packed rows per KV head), the own level on the decode kernel;
    # d 64: the one launch's 64-key tiles, mma_tiles(all_split=True); "prefetch": the one
    # launch with MMA_PREFETCH, the same bits as without it)
    from nbinfer.api import cascade as cascade_api

    prefetch = kv_split == "prefetch"
    if prefetch:
        kv_split = False
    monkeypatch.setattr(prefill_api, "MMA_PREFETCH", prefetch)
    levels = str(kv_split).startswith("levels")
    if not levels:  # (any knob set, even False, turns the lean kernel's rule off)
        monkeypatch.setattr(prefill_api, "MMA_KV_SPLIT", kv_split)
    monkeypatch.setattr(prefill_api, "LEAN_PREFETCH", kv_split == "levels-prefetch")
    monkeypatch.setattr(cascade_api, "CASCADE_LAUNCH", "levels" if levels else None)
    batch, prefix_pages, own_pages, ps = 16, 64, 4, 16
    pool = rng.permutation(prefix_pages + batch * own_pages)
    prefix, own = pool[:prefix_pages], pool[prefix_pages:].reshape(batch, own_pages)
    qo = [np.array([0, batch]), np.arange(batch + 1)]
    indptr = [np.array([0, prefix_pages]), np.arange(batch + 1) * own_pages]
    indices = [prefix, own.ravel()]
    last = [np.array([ps]), rng.integers(1, ps + 1, size=batch)]
    cache = rng.standard_normal((pool.size, 2, ps, 8, d)).astype(np.float32)
    q = rng.standard_normal((batch, 32, d)).astype(np.float32)
    tq, tc = _t(q, "float16"), _t(cache, "float16")
    w = MultiLevelCascadeAttentionWrapper(2, _ws())
    w.plan(qo, indptr, indices, last, 32, 8, d, ps, q_data_type="float16")
    if levels:
        assert w.last_level_on_decode
        spec = w._wrappers[0].step_plan.spec
        assert spec.prefetch == (kv_split == "levels-prefetch") and spec.lean
    else:
        spec = w._fused.step_plan.spec
        assert spec.kv_split == kv_split and spec.prefetch == prefetch
        assert spec.kv_tile == (64 if d == 64 else prefill_api.CASCADE_TILES["kv_tile"])
    out = w.run(tq, tc)
    ref = reference.multi_level_cascade_attention(_np(tq), qo, _np(tc), indptr, indices, last)
    assert rel_err(_np(out), ref) <= TOLERANCE["float16"]
    if prefetch:
        import torch

        monkeypatch.setattr(prefill_api, "MMA_PREFETCH", False)
        plain = MultiLevelCascadeAttentionWrapper(2, _ws())
        plain.plan(qo, indptr, indices, last, 32, 8, d, ps, q_data_type="float16")
        assert not plain._fused.step_plan.spec.prefetch
        assert torch.equal(plain.run(tq, tc), out)
    if levels:  # level by level, merges included, replays in a CUDA graph (it once failed to
        # capture: merge_state_in_place allocated and launched on Numba's default stream)
        import torch

        graph, replayed = _capture(lambda: w.run(tq, tc))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, out)


@pytest.mark.parametrize("kind", ["cascade", "lean-split"])
def test_dependent_merge_launch_equals_the_serial_one(rng, monkeypatch, kind):
    # PREFILL_PDL: the merge of split rows as a programmatic dependent launch, its CTAs
    # started before the prefill (or its guarded twin, lean-split: causal) has finished and
    # waiting for it in griddepcontrol.wait. The result is bit for bit the serial launch's
    # (the same reduction map), eagerly and replayed from a CUDA graph.
    import torch

    batch, ps, hq, hkv, d = 16, 16, 32, 8, 128
    if kind == "cascade":
        prefix_pages, own_pages = 64, 4
        pool = rng.permutation(prefix_pages + batch * own_pages)
        lv = ([np.array([0, batch]), np.arange(batch + 1)],
              [np.array([0, prefix_pages]), np.arange(batch + 1) * own_pages],
              [pool[:prefix_pages], pool[prefix_pages:]],
              [np.array([ps]), rng.integers(1, ps + 1, size=batch)])
        cache = _t(rng.standard_normal((pool.size, 2, ps, hkv, d)).astype(np.float32),
                   "float16")
        q = _t(rng.standard_normal((batch, hq, d)).astype(np.float32), "float16")
        ref = reference.multi_level_cascade_attention(_np(q), lv[0], _np(cache), *lv[1:])

        def make():  # (the wrapper that plans the one launch, and the call)
            w = MultiLevelCascadeAttentionWrapper(2, _ws())
            w.plan(*lv, hq, hkv, d, ps, q_data_type="float16")
            return w._fused, (lambda: w.run(q, cache))
    else:
        monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
        qo_lens, kv_lens = [130, 1], [2500, 7]
        pt = PageTable.from_kv_lens(kv_lens, ps, rng=rng)
        qo = np.concatenate([[0], np.cumsum(qo_lens)])
        cache = _t(rng.standard_normal((pt.num_pages, 2, ps, hkv, d)).astype(np.float32),
                   "float16")
        q = _t(rng.standard_normal((int(qo[-1]), hq, d)).astype(np.float32), "float16")
        ref = reference.batch_prefill_with_paged_kv_cache(
            _np(q), qo, _np(cache), pt.indptr, pt.indices, pt.last_page_len, causal=True)

        def make():
            w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
            w.plan(qo, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, causal=True,
                   q_data_type="float16", fixed_split_size=512)
            return w, (lambda: w.run(q, cache))

    monkeypatch.setattr(prefill_api, "PREFILL_PDL", False)
    _, serial = make()
    want = serial().clone()
    monkeypatch.setattr(prefill_api, "PREFILL_PDL", None)  # the default: on for sm_90
    w, run = make()
    assert w.step_plan.spec.defer_merge and w.schedule.num_merge_rows > 0
    assert (kind == "lean-split") == w.step_plan.spec.lean
    assert w.step_plan.launch._after[-1].dependent
    out = run()
    assert rel_err(_np(out), ref) <= TOLERANCE["float16"]
    assert torch.equal(out, want)
    graph, replayed = _capture(run)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, want)


def _capture(fn):
    """``(graph, fn's result in the graph's memory)``: ``fn`` warmed up on a side stream (what
    torch asks before a capture), then captured."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with defer_frees(), torch.cuda.graph(graph):
        result = fn()
    return graph, result


def test_cuda_graph_cascade_replays_later_plans(rng):
    # MultiLevelCascadeAttentionWrapper(use_cuda_graph=True): run() captured once after the
    # first plan; each later plan (other groups, other pages, fewer segments) is replayed by the
    # same graph and equals the reference and an eager run of a fresh wrapper, bit for bit.
    import torch

    batch, ps, hq, hkv, d, num_pages = 24, 16, 32, 8, 128, 400
    bufs = dict(qo_indptr_buf_arr=[torch.zeros(batch + 1, dtype=torch.int32, device="cuda")] * 2,
                paged_kv_indptr_buf_arr=[torch.zeros(batch + 1, dtype=torch.int32,
                                                     device="cuda")] * 2,
                paged_kv_indices_buf_arr=[torch.zeros(num_pages, dtype=torch.int32,
                                                      device="cuda")] * 2,
                paged_kv_last_page_len_buf_arr=[torch.zeros(batch, dtype=torch.int32,
                                                            device="cuda")] * 2)
    w = MultiLevelCascadeAttentionWrapper(2, _ws(), "NHD", True, **bufs)
    cache = _t(rng.standard_normal((num_pages, 2, ps, hkv, d)).astype(np.float32), "float16")
    q = _t(rng.standard_normal((batch, hq, d)).astype(np.float32), "float16")

    def levels(groups, prefix_pages, own_pages):
        pool = iter(rng.permutation(num_pages).tolist())
        sizes = np.diff(np.linspace(0, batch, groups + 1).astype(int))
        pre = [[next(pool) for _ in range(prefix_pages)] for _ in sizes]
        own = [[next(pool) for _ in range(own_pages)] for _ in range(batch)]
        return ([np.concatenate([[0], np.cumsum(sizes)]), np.arange(batch + 1)],
                [np.arange(groups + 1) * prefix_pages, np.arange(batch + 1) * own_pages],
                [np.array(sum(pre, [])), np.array(sum(own, []))],
                [np.full(groups, ps), rng.integers(1, ps + 1, size=batch)])

    graph = None
    for groups, prefix_pages, own_pages in ((1, 12, 4), (3, 8, 2), (6, 4, 5), (2, 10, 1)):
        lv = levels(groups, prefix_pages, own_pages)
        w.plan(*lv, hq, hkv, d, ps, q_data_type="float16")
        if graph is None:
            graph, out = _capture(lambda: w.run(q, cache))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.multi_level_cascade_attention(_np(q), lv[0], _np(cache), *lv[1:])
        assert rel_err(_np(out), ref) <= TOLERANCE["float16"], (groups, prefix_pages)
        eager = MultiLevelCascadeAttentionWrapper(2, _ws())
        eager.plan(*lv, hq, hkv, d, ps, q_data_type="float16")
        assert torch.equal(out, eager.run(q, cache)), (groups, prefix_pages)
