"""Tensor-core prefill kernel (fp16 operands) vs the float64 reference in the simulator.

The simulator runs the kernel's warp tile twins (:mod:`nbinfer.kernels.mma`): the same fragment
layouts, masks, online softmax and fused merge as the ``mma.sync`` path, two warps per CTA. The
H200 runs the real instructions in tests/test_gpu_prefill.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference, scheduler
from nbinfer import variants as V
from nbinfer.api import prefill as prefill_api
from nbinfer.api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)
from nbinfer.formats import PageTable
from nbinfer.kernels.prefill_mma import MmaPrefillSpec, mma_eligible


def _ws():
    return np.zeros(1 << 22, np.uint8)


def _check(w, out, lse, ref, ref_lse):
    assert isinstance(w.step_plan.spec, MmaPrefillSpec)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-3)
    assert np.all(lse[~finite] == -np.inf)


@pytest.mark.parametrize(
    "qo_lens, kv_lens, hq, hkv, d, ps, layout, kw",
    [
        ([3, 5], [20, 9], 4, 2, 64, 4, "NHD", dict(causal=True)),
        # 36 packed rows (G=4): two query tiles; chunks of 16 keys merged in the kernel.
        ([9], [40], 8, 2, 64, 16, "NHD",
         dict(causal=True, fixed_split_size=16, pos_encoding_mode="ROPE_LLAMA",
              logits_soft_cap=3.0, window_left=20)),
        ([3], [25], 4, 2, 128, 4, "HND", dict(pos_encoding_mode="ALIBI")),
        ([2, 1], [30, 0], 2, 2, 64, 5, "NHD", {}),  # an empty KV: lse -inf, output 0
    ],
    ids=["causal", "split-rope-cap-window", "alibi-d128-HND", "empty-kv"],
)
def test_paged_prefill_mma(rng, qo_lens, kv_lens, hq, hkv, d, ps, layout, kw):
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 1,
                                rng=rng)
    shape = (pt.num_pages, 2, ps, hkv, d) if layout == "NHD" else (pt.num_pages, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(np.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float16)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), layout)
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
           q_data_type="float16", **kw)
    if "fixed_split_size" in kw:
        assert w.schedule.num_merge_rows > 0
    out, lse = w.run(q, cache, return_lse=True)
    kw.pop("fixed_split_size", None)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, kv_layout=layout,
        return_lse=True, **kw)
    assert out.dtype == np.float16
    _check(w, out, lse, ref, ref_lse)


def test_l2_order_knob_sections_the_plan_and_keeps_the_result(rng, monkeypatch):
    # a section of 1 KiB of D 64 fp16 KV is 4 tokens: every (request, kv head) pair its own
    hq, hkv, d = 4, 2, 64
    qo_indptr, kv_indptr = np.array([0, 7, 9, 20]), np.array([0, 30, 41, 60])
    q = rng.standard_normal((20, hq, d)).astype(np.float16)
    k = rng.standard_normal((60, hkv, d)).astype(np.float16)
    v = rng.standard_normal((60, hkv, d)).astype(np.float16)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    args = (qo_indptr, kv_indptr, hq, hkv, d)
    w.plan(*args, q_data_type="float16", causal=True, fixed_split_size=8)
    plain = w.schedule
    monkeypatch.setattr(prefill_api, "PREFILL_L2_SECTION_MIB", 1 / 1024)
    w.plan(*args, q_data_type="float16", causal=True, fixed_split_size=8)
    assert prefill_api.l2_section_kv(w.step_plan.spec) == 4
    want = scheduler.plan(qo_indptr, np.diff(kv_indptr), hq, hkv, plain.num_ctas,
                          granule=plain.granule, causal=True, fixed_split_size=8,
                          tile_q=plain.tile_q, item_overhead=plain.item_overhead,
                          l2_section_kv=4)
    assert w.schedule == want and not np.array_equal(want.cta_work, plain.cta_work)
    assert np.array_equal(w.schedule.work, plain.work)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, causal=True, return_lse=True)
    _check(w, out, lse, ref, ref_lse)


def test_ragged_mma_custom_mask_and_sigmoid(rng):
    hq, hkv, d = 4, 2, 64
    qo_indptr, kv_indptr = np.array([0, 3, 5]), np.array([0, 6, 41])
    q = rng.standard_normal((5, hq, d)).astype(np.float16)
    k = rng.standard_normal((41, hkv, d)).astype(np.float16)
    v = rng.standard_normal((41, hkv, d)).astype(np.float16)
    mask = rng.random(3 * 6 + 2 * 35) < 0.6
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float16", custom_mask=mask)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, custom_mask=mask, return_lse=True)
    _check(w, out, lse, ref, ref_lse)
    # No softmax: P = sigmoid(logits), no max, no rescale, the output is P V itself.
    sig = V.sigmoid_attention(0.5, -0.2)
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float16", causal=True, variant=sig)
    out = w.run(q, k, v)
    ref = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr,
                                                       causal=True, variant=sig)
    assert rel_err(out, ref) <= TOLERANCE["float16"]


def test_kernel_choice_and_spec_errors():
    assert mma_eligible(128, "float16", "float16")
    assert mma_eligible(64, "bfloat16", "bfloat16")
    assert not mma_eligible(256, "float16", "float16")  # CUDA-core tile kernel
    assert not mma_eligible(128, "float16", "bfloat16")
    assert not mma_eligible(128, "float32", "float32")
    var = V.standard()
    with pytest.raises(ValueError, match="head_dim"):
        MmaPrefillSpec(256, 1, 16, "float16", "float16", "NHD", var)
    with pytest.raises(ValueError, match="same 16-bit"):
        MmaPrefillSpec(128, 1, 16, "float16", "float32", "NHD", var)
    with pytest.raises(ValueError, match="num_warps"):
        MmaPrefillSpec(128, 1, 16, "float16", "float16", "NHD", var, num_warps=3)
    with pytest.raises(ValueError, match="kv_tile"):
        MmaPrefillSpec(128, 1, 16, "float16", "float16", "NHD", var, kv_tile=48)
    with pytest.raises(ValueError, match="max_registers"):
        MmaPrefillSpec(128, 1, 16, "float16", "float16", "NHD", var, max_registers=300)
    assert MmaPrefillSpec(128, 4, 16, "float16", "float16", "NHD", var).tile_q == 64


def test_tile_merge_stage_batches_and_long_lists(rng):
    # The tile merge stages partial rows through shared memory (sim: D 64, 4096 floats, a
    # quarter for weights, 3072 for the stage = 48 partial slices). Request 0's 12 chunks per
    # row fit 4 (row, head) units per batch (2 batches for 3 rows x G 2); request 1's 49 chunks
    # do not fit at all and take the one-row path. Both must match the reference.
    qo_indptr, kv_indptr = np.array([0, 3, 5]), np.array([0, 48, 244])
    q = rng.standard_normal((5, 2, 64)).astype(np.float16)
    k = rng.standard_normal((244, 1, 64)).astype(np.float16)
    v = rng.standard_normal((244, 1, 64)).astype(np.float16)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, 2, 1, 64, q_data_type="float16", fixed_split_size=4)
    assert np.diff(w.schedule.merge_indptr).tolist() == [12] * 3 + [49] * 2
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr,
                                                                return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3)


@pytest.mark.parametrize("causal, kv_tile, q_shared",
                         [(True, 32, False), (False, 32, False), (True, 64, False),
                          (True, 32, True)])
def test_clear_tiles_take_the_short_path_exactly(rng, monkeypatch, causal, kv_tile, q_shared):
    # Query positions 60-99 and 63-69 (G 2: 8 query rows per 16-row warp): the 32-key tiles
    # 0-31 and 32-63 are kept whole by every warp's rows (a causal mask's last key is before the
    # warp's first row; without a mask every full tile is clear), so they skip the per-score
    # masks; the diagonal and the ragged last tile take the masked path. Request 1 leaves rows
    # of its tile empty (7 query rows). An infinite K element in a clear tile must still poison
    # the rows that keep its key (nbinfer's non-finite rule).
    hq, hkv, d = 4, 2, 64
    qo_indptr, kv_indptr = np.array([0, 40, 47]), np.array([0, 100, 170])
    q = rng.standard_normal((47, hq, d)).astype(np.float16)
    k = rng.standard_normal((170, hkv, d)).astype(np.float16)
    v = rng.standard_normal((170, hkv, d)).astype(np.float16)
    # 64-key tiles: Q read from shared memory (a 64-key tile at D 64 is clear for both
    # requests' first tile only)
    # (q_shared: Q read from shared memory at 32-key tiles too)
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", kv_tile)
    monkeypatch.setattr(prefill_api, "MMA_Q_SHARED", q_shared)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float16", causal=causal)
    assert w.step_plan.spec.kv_tile == kv_tile
    assert w.step_plan.spec.q_in_shared == (q_shared or kv_tile == 64)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, causal=causal, return_lse=True)
    _check(w, out, lse, ref, ref_lse)
    k[105, 1, 3] = np.inf  # request 1's key 5, kv head 1 (query heads 2 and 3)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, causal=causal, return_lse=True)
    poisoned = np.isnan(ref).any(axis=-1)
    assert poisoned[40:, 2:].all() and not poisoned[:40].any() and not poisoned[:, :2].any()
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), poisoned)
    np.testing.assert_array_equal(np.isnan(lse), poisoned)
    fine = ~poisoned
    assert rel_err(out[fine], ref[fine]) <= TOLERANCE["float16"]


def test_q_by_copies_equals_the_stager(rng, monkeypatch):
    # Q kept in shared memory without a query hook goes by 16-byte cp.async copies
    # (q_tile_copier), a q whose strides are not multiples of 8 elements by the stager; the
    # two must give the same bits. Request 1 leaves rows of its tile empty (5 query rows x G 2:
    # the copies repeat its last row there), request 2 has no KV (no tile waits for its Q).
    # (fp16: the GPU grid runs bf16 too)
    from nbinfer.kernels.mma import tile_ops
    from nbinfer.kernels.prefill_mma import q_tile_copier

    hq, hkv, d = 4, 2, 64
    qo_indptr, kv_indptr = np.array([0, 40, 45, 47]), np.array([0, 100, 130, 130])
    base = rng.standard_normal((47, hq, d + 1)).astype(np.float16)
    k = rng.standard_normal((130, hkv, d)).astype(np.float16)
    v = rng.standard_normal((130, hkv, d)).astype(np.float16)
    strided = base[..., :d]  # stride_h d + 1: the stager
    dense = np.ascontiguousarray(strided)  # the copies
    monkeypatch.setattr(prefill_api, "MMA_Q_SHARED", True)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float16", causal=True)
    spec = w.step_plan.spec
    ops = tile_ops(d, spec.tile_kv, "float16", spec.num_warps, True)
    assert spec.q_in_shared and q_tile_copier(spec, ops)[0] is not None
    out, lse = w.run(dense, k, v, return_lse=True)
    out_s, lse_s = w.run(strided, k, v, return_lse=True)
    np.testing.assert_array_equal(out.view(np.uint16), out_s.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_s)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        dense, k, v, qo_indptr, kv_indptr, causal=True, return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    assert np.all(lse[45:] == -np.inf) and np.all(out[45:].astype(np.float32) == 0)


def test_prefetch_of_the_next_item_changes_no_bit(rng, monkeypatch):
    # MMA_PREFETCH: the next work item's plan entries and first KV tile requested during an
    # item's last tile. Split rows (16-key chunks: many items per CTA, each of a few tiles),
    # pages of 5 (tiles that cross pages), a request without KV and one whose last chunk is a
    # single key; the same bits as without it, and the reference's values. (The cascade's
    # tiles: 32 keys, Q in shared memory; the GPU's cascade test runs 64-key tiles too.)
    q_shared, kv_tile = True, 32
    hq, hkv, d, ps = 4, 2, 64, 5
    qo_lens, kv_lens = [9, 3, 20, 2], [61, 0, 33, 17]
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 2,
                                rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, ps, hkv, d)).astype(np.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float16)
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", kv_tile)
    monkeypatch.setattr(prefill_api, "MMA_Q_SHARED", q_shared)
    monkeypatch.setattr(prefill_api, "MMA_DEFER_MERGE", True)
    runs = []
    for prefetch in (False, True):
        monkeypatch.setattr(prefill_api, "MMA_PREFETCH", prefetch)
        w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
        w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
               q_data_type="float16", causal=True, fixed_split_size=16)
        assert w.step_plan.spec.prefetch == prefetch
        assert w.schedule.num_merge_rows > 0
        runs.append(w.run(q, cache, return_lse=True))
        # several items on some CTA: the overlap has a next item to fetch for
        ctas = np.diff(np.asarray(w.schedule.cta_indptr))
        assert ctas.max() >= 3
    (out, lse), (out_p, lse_p) = runs
    np.testing.assert_array_equal(out.view(np.uint16), out_p.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_p)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, causal=True,
        return_lse=True)
    _check(w, out_p, lse_p, ref, ref_lse)


def test_prefetch_needs_its_tiles():
    # the mma.sync kernel's prefetch asks for Q in shared memory, two stages and the merge
    # deferred; the guarded twin drops it
    std = V.causal()
    ok = MmaPrefillSpec(64, 2, 16, "float16", "float16", "NHD", std, kv_tile=64, defer_merge=True,
                        prefetch=True)
    assert not ok.on_mma_sync(value_guard=True).prefetch
    for bad in (dict(kv_tile=32), dict(kv_tile=64, stages=3), dict(kv_tile=64, defer_merge=False),
                dict(kv_tile=64, kv_split=True)):
        kw = dict(defer_merge=True) | bad
        with pytest.raises(ValueError, match="prefetch=True on the mma.sync kernel"):
            MmaPrefillSpec(64, 2, 16, "float16", "float16", "NHD", std, prefetch=True, **kw)


def test_kv_tile_64_at_head_dim_128_takes_dynamic_shared_memory(rng, monkeypatch):
    # D 128 with 64-key tiles needs more than the 48 KiB of static shared memory a kernel may
    # declare (two stages of K and V plus Q: 78 KiB at the simulator's two warps, 87 KiB on
    # the GPU's four): the kernel allocates it at launch.
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", 64)
    qo_indptr, kv_indptr = np.array([0, 9]), np.array([0, 140])
    q = rng.standard_normal((9, 2, 128)).astype(np.float16)
    k = rng.standard_normal((140, 2, 128)).astype(np.float16)
    v = rng.standard_normal((140, 2, 128)).astype(np.float16)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, 2, 2, 128, q_data_type="float16", causal=True)
    assert w.step_plan.launch.launch.shared > 48 * 1024
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, causal=True, return_lse=True)
    _check(w, out, lse, ref, ref_lse)


@pytest.mark.parametrize("kv_tile", [32, 64])
def test_guarded_twin_marks_keys_past_32_in_a_tile(rng, monkeypatch, kv_tile):
    # The guarded twin keeps one bit per key of its KV tile: a 64-key tile needs two words.
    # An infinite V at key 39, which only the last causal row keeps, must make that row NaN
    # (the H200 caught the one-word mask dropping it) and no other row.
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", kv_tile)
    ptr = np.array([0, 40])
    q = rng.standard_normal((40, 4, 64)).astype(np.float16)
    k = rng.standard_normal((40, 2, 64)).astype(np.float16)
    v = rng.standard_normal((40, 2, 64)).astype(np.float16)
    v[39, 0, 7] = np.inf
    v[12, 1, 3] = np.nan
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(ptr, ptr, 4, 2, 64, q_data_type="float16", causal=True)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(q, k, v, ptr, ptr, causal=True,
                                                                return_lse=True)
    assert np.isnan(ref_lse).sum() == 2 + 28 * 2  # row 39 heads 0-1; rows 12-39 heads 2-3
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    fine = ~np.isnan(ref)
    assert rel_err(out[fine], ref[fine]) <= TOLERANCE["float16"]


@pytest.mark.parametrize("ps, split", [(8, None), (24, None), (16, 40), (128, None), (3, None)],
                         ids=["pages-in-tile", "page-24-last-page-partial", "split-off-page",
                              "tile-in-page", "page-3"])
def test_straight_tiles_address_every_page_layout(rng, monkeypatch, ps, split):
    # A full 64-key tile whose copies find their pages from their place in the tile (pages of
    # 8 or 16 tokens, a multiple of the rows one pass covers; or one 128-token page holding
    # the whole tile) takes the straight copy path; a chunk starting off a page boundary
    # (split 40 with pages of 16) or pages of 3 take the general one. Both must read the same
    # tokens. A -inf score in a clear tile (an inf in K against a query of mixed signs)
    # must still make the rows that keep that key NaN, in a partial state too.
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", 64)
    hq, hkv, d, kv_lens, qo_lens = 2, 1, 64, [200, 75], [2, 1]
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 2,
                                rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, ps, hkv, d)).astype(np.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float16)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    kw = dict(causal=True, q_data_type="float16")
    if split:
        kw["fixed_split_size"] = split
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps, **kw)
    kw.pop("fixed_split_size", None)
    kw.pop("q_data_type")

    def reference_of(cache):
        return reference.batch_prefill_with_paged_kv_cache(
            q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True,
            **kw)

    out, lse = w.run(q, cache, return_lse=True)
    _check(w, out, lse, *reference_of(cache))
    # request 0's key 20 (a clear tile for both its rows): page 20 // ps, slot 20 % ps; one
    # -inf element against positive queries gives a -inf score (not a NaN)
    page = pt.indices[pt.indptr[0] + 20 // ps]
    cache[page, 0, 20 % ps, 0, 3] = -np.inf
    q[:2, :, 3] = np.abs(q[:2, :, 3]) + np.float16(0.5)
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference_of(cache)
    poisoned = np.isnan(ref).any(axis=-1)
    assert poisoned[:2].all() and not poisoned[2:].any()
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), poisoned)
    np.testing.assert_array_equal(np.isnan(lse), poisoned)
    assert rel_err(out[2:], ref[2:]) <= TOLERANCE["float16"]


@pytest.mark.parametrize("kv_tile, stages", [(32, 3), (64, 4)])
def test_deeper_kv_pipelines(rng, monkeypatch, kv_tile, stages):
    # Tiles i + 1 .. i + stages - 1 in flight while tile i is computed: fewer tiles than
    # stages (request 1), more (request 0), chunks merged in the kernel (split 96), Q staged in
    # the last stage (32-key tiles) or in its own area (64).
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", kv_tile)
    monkeypatch.setattr(prefill_api, "MMA_STAGES", stages)
    kv_lens, qo_lens, ps = [230, 40], [3, 2], 16
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 1,
                                rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, ps, 2, 64)).astype(np.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), 4, 64)).astype(np.float16)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, 4, 2, 64, ps, causal=True,
           q_data_type="float16", fixed_split_size=96)
    assert w.step_plan.spec.stages == stages and w.schedule.num_merge_rows > 0
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, causal=True,
        return_lse=True)
    _check(w, out, lse, ref, ref_lse)


def test_eight_warps_share_each_kv_tile(rng, monkeypatch):
    # 8 warps (128 packed rows) per CTA: at D 64 the CTA's copies cover 32 token rows per pass,
    # so a 64-key tile takes 2 copies per thread (ragged KV: straight copies); request
    # 0's two chunks of 64 keys are merged in the kernel. (256 simulated threads: kept small.)
    monkeypatch.setattr(prefill_api, "MMA_WARPS", 8)
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", 64)
    qo_indptr, kv_indptr = np.array([0, 5, 7]), np.array([0, 100, 130])
    q = rng.standard_normal((7, 8, 64)).astype(np.float16)
    k = rng.standard_normal((130, 2, 64)).astype(np.float16)
    v = rng.standard_normal((130, 2, 64)).astype(np.float16)
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, 8, 2, 64, q_data_type="float16", causal=True,
           fixed_split_size=64)
    assert w.step_plan.spec.num_warps == 8 and w.step_plan.spec.tile_q == 128
    assert w.schedule.num_merge_rows > 0
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, causal=True, return_lse=True)
    _check(w, out, lse, ref, ref_lse)


@pytest.mark.parametrize(
    "kv_tile, warps, case",
    [(32, 2, "mixed-causal-rope-cap"), (64, 4, "decode-chunks-poison"),
     (32, 2, "sigmoid-mask-guard")])
def test_kv_split_items_share_each_tile_between_warps(rng, monkeypatch, kv_tile, warps, case):
    # kv_split: an item of at most 16 packed rows runs with every warp on its rows and a share
    # of each tile's keys (2 warps: 16 keys each of a 32-key tile; 4 warps: 16 each of a 64),
    # the warps' states merged at the item's end; larger items of the same launch keep the
    # row tile. G 4 with 2 warps (8 query rows per tile): a 1-row request (4 packed rows) and a
    # 3-row one (12) split; a 9-row one runs a row tile of 8 rows and a split item of 1.
    monkeypatch.setattr(prefill_api, "MMA_KV_SPLIT", True)
    monkeypatch.setattr(prefill_api, "MMA_KV_TILE", kv_tile)
    monkeypatch.setattr(prefill_api, "MMA_WARPS", warps)
    hq, hkv, d, ps = 8, 2, 64, 4
    kw, qo_lens, kv_lens = {}, [1, 3, 9], [45, 7, 70]
    if case == "mixed-causal-rope-cap":
        kw = dict(causal=True, pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=3.0,
                  window_left=30)
    elif case == "decode-chunks-poison":
        qo_lens, kv_lens = [1] * 4, [150, 0, 33, 64]  # an empty KV: lse -inf, output 0
        kw = dict(fixed_split_size=48)  # rows merged from chunks
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 1,
                                rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, ps, hkv, d)).astype(np.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((int(qo_indptr[-1]), hq, d)).astype(np.float16)
    if case == "sigmoid-mask-guard":
        # no softmax (the warps' outputs are summed), a custom mask, and a NaN V that only
        # request 0's row keeps (its mask bit set here): the guarded twin runs the flagged
        # pairs' items split too
        mask = rng.random(int(np.dot(qo_lens, kv_lens))) < 0.7
        mask[20] = True  # request 0 (one row, the mask's first 45 bits), key 20
        kw = dict(custom_mask=mask, variant=V.sigmoid_attention(0.5, -0.2))
        page, slot = divmod(20, ps)  # request 0's key 20, kv head 1
        cache[pt.indices[pt.indptr[0] + page], 1, slot, 1, 5] = np.nan
    if case == "decode-chunks-poison":
        cache[pt.indices[pt.indptr[2]], 0, 1, 0, 2] = np.inf  # request 2's key 1, kv head 0
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")

    def plan_and_run():
        w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
               q_data_type="float16", **kw)
        return w.run(q, cache, return_lse=True)

    out, lse = plan_and_run()
    spec = w.step_plan.spec
    assert spec.kv_split and spec.kv_tile == kv_tile and spec.num_warps == warps
    if case == "decode-chunks-poison":
        assert w.schedule.num_merge_rows > 0
        assert np.isneginf(lse[1]).all() and not out[1].any()
    kw.pop("fixed_split_size", None)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True, **kw)
    bad = np.isnan(ref).any(axis=-1)
    if case != "mixed-causal-rope-cap":
        assert bad.any() and not bad.all()  # the poison reached some rows, not all
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), bad)
    fine = ~bad
    assert rel_err(out[fine], ref[fine]) <= TOLERANCE["float16"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=2e-3)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    if case != "sigmoid-mask-guard":
        # The split path ran: its LSEs (float32) are summed in another order than the row
        # tile's, so some differ in their last bits.
        monkeypatch.setattr(prefill_api, "MMA_KV_SPLIT", False)
        _, lse_rows = plan_and_run()
        assert not w.step_plan.spec.kv_split
        assert not np.array_equal(lse[finite], lse_rows[finite])
