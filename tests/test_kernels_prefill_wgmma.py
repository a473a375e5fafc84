"""The lean warpgroup prefill kernel (:mod:`nbinfer.kernels.prefill_wgmma`) in the simulator.

The simulator has no warpgroup MMA; the lean kernel's simulator form runs its two products on
the ``mma.sync`` twins (the same per-lane fragments) and everything else as the H200 runs it:
the plan's work items, the clear and masked tile loops, the two-stage KV ring, GQA packing,
bottom-right causal positions, the LSE, the non-finite rule's running minimum, split rows and
their merge launch. The products' shared-memory layouts and descriptors are the GPU's alone
(tests/test_wgmma.py checks them against NumPy on the H200, tests/test_gpu_prefill.py the
kernel). A CTA is 256 simulated threads, so the shapes stay small.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer.api import prefill as prefill_api
from nbinfer.api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)
from nbinfer.formats import PageTable


def _ws():
    return np.zeros(1 << 22, np.uint8)


# the lean kernel's rungs per form: (LEAN_PREFETCH, LEAN_LAZY_RESCALE, LEAN_QK_AHEAD). Each
# issues S = Q K^T before the ring's refill, as the default does ("plain"); the old order
# (LEAN_QK_AHEAD False) runs in the gpu tests' forms plain / prefetch / lazy.
FORMS = {"plain": (False, False, True), "prefetch": (True, False, True),
         "lazy": (False, True, True)}


def _form(monkeypatch, form):
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    for knob, on in zip(("LEAN_PREFETCH", "LEAN_LAZY_RESCALE", "LEAN_QK_AHEAD"), FORMS[form],
                        strict=True):
        monkeypatch.setattr(prefill_api, knob, on)


def _lean(w, form=None):
    # (form None: the rungs the api's knobs choose by default)
    spec = w.step_plan.spec
    assert spec.lean and spec.wgmma and spec.sim and spec.num_warps == 8
    want = FORMS[form] if form else tuple(bool(getattr(prefill_api, k)) for k in (
        "LEAN_PREFETCH", "LEAN_LAZY_RESCALE", "LEAN_QK_AHEAD"))
    assert (spec.prefetch, spec.lazy_rescale, spec.qk_ahead) == want
    return spec


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf - inf, on purpose
@pytest.mark.parametrize("form", FORMS)
def test_lean_ragged_causal_gqa_and_the_nonfinite_rule(rng, monkeypatch, form):
    # G 4: 128 packed rows are 32 query rows, so request 1's 40 rows take two items (a tail of
    # 8); its KV is longer than its queries (bottom-right causal: clear tiles, then masked
    # ones). A -inf in K (request 1, key 70, kv head 1) is kept by rows 10.. of that request
    # (running minimum -> NaN); a NaN in q poisons its row and nothing else. Key 80 of
    # request 1, kv head 0, is 30x the others: rows 20.. see their maximum jump by far more
    # than 2^8 in the second tile (the lazy rescale's branch), the others keep theirs.
    _form(monkeypatch, form)
    hq, hkv, d = 8, 2, 64
    # (request 2 has no KV: items without a tile, which request no Q)
    qo_indptr, kv_indptr = np.array([0, 3, 43, 45]), np.array([0, 150, 250, 250])
    q = rng.standard_normal((45, hq, d)).astype(np.float16)
    k = rng.standard_normal((250, hkv, d)).astype(np.float16)
    v = rng.standard_normal((250, hkv, d)).astype(np.float16)
    k[150 + 70, 1, 5] = -np.inf
    k[150 + 80, 0] *= 30
    q[1, 2, 7] = np.nan
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, q_data_type="float16", causal=True)
    _lean(w, form)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, causal=True, return_lse=True)
    # rows of request 1 at or past key 70's diagonal (40 rows over 100 keys: rows 10..39),
    # kv head 1's four query heads, and (row 1, head 2)
    assert np.isnan(ref_lse).sum() == 30 * 4 + 1
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    fin = ~np.isnan(ref)
    assert rel_err(out[fin], ref[fin]) <= TOLERANCE["float16"]
    ok = ~np.isnan(ref_lse)
    np.testing.assert_allclose(lse[ok], ref_lse[ok], atol=2e-3)


@pytest.mark.parametrize("form, scale", [("plain", -0.07), ("prefetch", -0.07),
                                         ("prefetch", 0.07), ("lazy", -0.07)])
def test_lean_paged_non_causal_split_rows_scale_sign_and_an_empty_kv(rng, monkeypatch, form,
                                                                     scale):
    # D 128, HND pages of 5 (a tile's 64 keys cross 13 pages), G 1, requests 0 and 2 in chunks
    # of 64 keys (split rows: partial states merged by the merge launch; each CTA's items
    # change request and head, so a Q left from the item before shows), request 1 with no KV
    # (zeros, LSE -inf). A negative scale: the kernel negates Q as it stages it; a
    # positive one with the overlap: paged, each item copies its Q by cp.async as it starts,
    # its first KV tile requested by the item before. (bf16 runs on the H200 only: NumPy has no
    # bf16 the kernels take.)
    _form(monkeypatch, form)
    hq = hkv = 2
    d, ps = 128, 5
    qo_lens, kv_lens = [3, 2, 4], [150, 0, 90]
    pt = PageTable.from_kv_lens(kv_lens, ps, num_pages=sum(-(-n // ps) for n in kv_lens) + 1,
                                rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, hkv, ps, d)).astype(np.float16)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = rng.standard_normal((9, hq, d)).astype(np.float16)
    w = BatchPrefillWithPagedKVCacheWrapper(_ws(), "HND")
    w.plan(qo_indptr, pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
           q_data_type="float16", sm_scale=scale, fixed_split_size=64)
    _lean(w, form)
    assert w.schedule.num_merge_rows > 0
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, pt.indptr, pt.indices, pt.last_page_len, kv_layout="HND",
        sm_scale=scale, return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    kept = np.r_[0:3, 5:9]
    np.testing.assert_allclose(lse[kept], ref_lse[kept], atol=2e-3)
    assert np.all(lse[3:5] == -np.inf) and np.all(out[3:5] == 0)


def test_the_simulator_takes_the_lean_kernel_only_when_asked(rng, monkeypatch):
    # The rule (MMA_WGMMA None) keeps the simulator on two-warp mma.sync; MMA_WGMMA True takes
    # the lean kernel for the plans it computes, and mma.sync for the others (a custom mask).
    ptr = np.array([0, 5])
    kw = dict(q_data_type="float16")
    w = BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD")
    w.plan(ptr, ptr, 2, 2, 64, causal=True, **kw)
    assert not w.step_plan.spec.wgmma and w.step_plan.spec.num_warps == 2
    monkeypatch.setattr(prefill_api, "MMA_WGMMA", True)
    w.plan(ptr, ptr, 2, 2, 64, causal=True, **kw)
    _lean(w)
    w.plan(ptr, ptr, 2, 2, 64, custom_mask=np.tril(np.ones((5, 5), bool)).ravel(), **kw)
    spec = w.step_plan.spec
    assert not spec.wgmma and not spec.lean and spec.num_warps == 2
    monkeypatch.setattr(prefill_api, "MMA_WGMMA_LEAN", False)  # the warpgroup form: GPU only
    w.plan(ptr, ptr, 2, 2, 64, causal=True, **kw)
    assert not w.step_plan.spec.wgmma
    # A forced warp count other than the lean kernel's 8 asks for the warpgroup form too (the
    # rule once built a lean spec with 4 warps, which the spec refused)
    monkeypatch.setattr(prefill_api, "MMA_WGMMA_LEAN", None)
    monkeypatch.setattr(prefill_api, "MMA_WARPS", 4)
    assert prefill_api.wgmma_choice(True, False, True, 128.0) == (False, False)
    monkeypatch.setattr(prefill_api, "MMA_WARPS", 8)
    assert prefill_api.wgmma_choice(True, False, True, 128.0) == (True, True)
