"""MultiLevelCascadeAttentionWrapper vs the reference, simulator; levels from a radix tree."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer.api.cascade import MultiLevelCascadeAttentionWrapper
from nbinfer.kernels.common import ARG

PLAN_SIDE = ("kv_indptr", "kv_indices", "kv_last_page_len", "plan", "tmp_o", "tmp_lse",
             "counters", "num_kv_heads", "sm_scale", "v_scale")


def _two_levels(rng, ps):
    """A shared prefix of 3 pages for 3 requests, then 1-2 own pages each (decode: 1 query)."""
    prefix = [5, 1, 7]
    own = [[2], [0, 3], [4]]
    levels = dict(
        qo=[np.array([0, 3]), np.array([0, 1, 2, 3])],
        indptr=[np.array([0, 3]), np.array([0, 1, 3, 4])],
        indices=[np.array(prefix), np.array([p for r in own for p in r])],
        last=[np.array([ps]), np.array([2, ps, 1])],
    )
    return levels


@pytest.mark.parametrize("layout, dtype, kw", [("NHD", np.float32, {}),
                                               ("HND", np.float16,
                                                dict(causal=True, logits_soft_cap=4.0))])
def test_cascade_two_levels(rng, layout, dtype, kw):
    ps, hq, hkv, d = 4, 4, 2, 64
    lv = _two_levels(rng, ps)
    shape = (8, 2, ps, hkv, d) if layout == "NHD" else (8, 2, hkv, ps, d)
    cache = rng.standard_normal(shape).astype(dtype)
    q = rng.standard_normal((3, hq, d)).astype(dtype)
    w = MultiLevelCascadeAttentionWrapper(2, np.zeros(1 << 22, np.uint8), layout)
    w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
           q_data_type=dtype, **kw)
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.multi_level_cascade_attention(
        q, lv["qo"], cache, lv["indptr"], lv["indices"], lv["last"], kv_layout=layout,
        return_lse=True, **kw)
    assert rel_err(out, ref) <= TOLERANCE[np.dtype(dtype).name]
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3)


def test_cascade_errors(rng):
    lv = _two_levels(rng, 4)
    w = MultiLevelCascadeAttentionWrapper(2, np.zeros(1 << 20, np.uint8))
    with pytest.raises(ValueError, match="num_levels"):
        w.plan(lv["qo"][:1], lv["indptr"][:1], lv["indices"][:1], lv["last"][:1], 4, 2, 64, 4)
    with pytest.raises(ValueError, match="coarsening"):
        w.plan([np.array([0, 2, 3]), np.array([0, 1, 3])], lv["indptr"], lv["indices"],
               lv["last"], 4, 2, 64, 4)
    with pytest.raises(ValueError, match="position-independent"):
        w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], 4, 2, 64, 4,
               pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(RuntimeError, match="no valid plan"):
        w.run(np.zeros((3, 4, 64), np.float32), np.zeros((8, 2, 4, 2, 64), np.float32))


def test_cascade_levels_from_a_radix_tree_equal_plain_decode(rng):
    from nbinfer.formats import RadixTree

    t = RadixTree(4)
    a, b, c = list(range(10)), list(range(4)) + [9] * 5, list(range(8)) + [5] * 5
    for s, pages in ((a, [0, 1, 2]), (b, [0, 3, 4]), (c, [0, 1, 5, 6])):
        t.insert(s, pages)
    lv = t.cascade_levels([a, b, c])  # 3 levels: page 0 for all, page 1 for a and c, own pages
    hq, hkv, d = 4, 1, 64
    cache = rng.standard_normal((7, 2, 4, hkv, d)).astype(np.float32)
    q = rng.standard_normal((3, hq, d)).astype(np.float32)  # one decode query per request
    w = MultiLevelCascadeAttentionWrapper(lv.num_levels, np.zeros(1 << 22, np.uint8))
    w.plan(lv.qo_indptr_arr, lv.paged_kv_indptr_arr, lv.paged_kv_indices_arr,
           lv.paged_kv_last_page_len_arr, hq, hkv, d, 4, q_data_type="float32")
    out = w.run(q[lv.rows], cache)  # rows in the levels' order
    full = [t.lookup(s) for s in (a, b, c)]
    lens = [len(a), len(b), len(c)]
    indptr = np.concatenate([[0], np.cumsum([p.size for p in full])])
    last = np.array([n - (p.size - 1) * 4 for n, p in zip(lens, full, strict=True)])
    ref = reference.batch_decode_with_paged_kv_cache(q, cache, indptr, np.concatenate(full), last)
    assert rel_err(out, ref[lv.rows]) <= TOLERANCE["float32"]


def test_cascade_prefill_levels_one_launch_or_level_by_level(rng):
    # Two requests (2 and 4 query rows) share a 3-page prefix. Without causal all levels run as
    # one launch; causal with several rows per last-level segment runs level by level.
    ps, hq, hkv, d = 4, 4, 2, 64
    qo = [np.array([0, 6]), np.array([0, 2, 6])]
    indptr = [np.array([0, 3]), np.array([0, 2, 3])]
    indices = [np.array([5, 1, 7]), np.array([2, 0, 4])]
    last = [np.array([ps]), np.array([3, 2])]
    cache = rng.standard_normal((8, 2, ps, hkv, d)).astype(np.float16)
    q = rng.standard_normal((6, hq, d)).astype(np.float16)
    w = MultiLevelCascadeAttentionWrapper(2, np.zeros(1 << 22, np.uint8))
    for causal, fused in ((False, True), (True, False)):
        w.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=causal, q_data_type="float16")
        assert w.one_launch is fused
        out, lse = w.run(q, cache, return_lse=True)
        ref, ref_lse = reference.multi_level_cascade_attention(
            q, qo, cache, indptr, indices, last, causal=causal, return_lse=True)
        assert rel_err(out, ref) <= TOLERANCE["float16"]
        np.testing.assert_allclose(lse, ref_lse, atol=2e-3)


@pytest.mark.parametrize("kw", [{}, dict(causal=True, logits_soft_cap=4.0)])
def test_cascade_level_by_level_with_the_last_level_on_decode(rng, monkeypatch, kw):
    # CASCADE_LAUNCH = "levels": three levels (a prefix shared by all, one shared by requests
    # 1-2, each request's own pages) run one after another; the last, one query row per
    # request, on the decode kernel; merged in level order. A last level of several rows per
    # segment keeps the prefill wrapper.
    from nbinfer.api import cascade as cascade_api

    monkeypatch.setattr(cascade_api, "CASCADE_LAUNCH", "levels")
    ps, hq, hkv, d = 4, 4, 2, 64
    qo = [np.array([0, 3]), np.array([0, 1, 3]), np.array([0, 1, 2, 3])]
    indptr = [np.array([0, 2]), np.array([0, 0, 2]), np.array([0, 1, 3, 4])]
    indices = [np.array([5, 1]), np.array([7, 6]), np.array([2, 0, 3, 4])]
    last = [np.array([ps]), np.array([0, 3]), np.array([2, ps, 1])]
    cache = rng.standard_normal((8, 2, ps, hkv, d)).astype(np.float16)
    q = rng.standard_normal((3, hq, d)).astype(np.float16)
    w = MultiLevelCascadeAttentionWrapper(3, np.zeros(1 << 22, np.uint8))
    w.plan(qo, indptr, indices, last, hq, hkv, d, ps, q_data_type="float16", **kw)
    assert not w.one_launch and w.last_level_on_decode
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.multi_level_cascade_attention(
        q, qo, cache, indptr, indices, last, return_lse=True, **kw)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    np.testing.assert_allclose(lse, ref_lse, atol=2e-3)
    # two query rows in request 1's last segment: every level on the prefill wrapper
    qo2 = [np.array([0, 4]), np.array([0, 1, 4]), np.array([0, 1, 3, 4])]
    q2 = rng.standard_normal((4, hq, d)).astype(np.float16)
    w.plan(qo2, indptr, indices, last, hq, hkv, d, ps, q_data_type="float16", **kw)
    assert not w.one_launch and not w.last_level_on_decode
    ref2 = reference.multi_level_cascade_attention(q2, qo2, cache, indptr, indices, last, **kw)
    assert rel_err(w.run(q2, cache), ref2) <= TOLERANCE["float16"]
    monkeypatch.setattr(cascade_api, "CASCADE_LAUNCH", "split")
    with pytest.raises(ValueError, match="CASCADE_LAUNCH"):
        w.plan(qo, indptr, indices, last, hq, hkv, d, ps, q_data_type="float16")


def test_one_launch_cascade_with_split_levels(rng):
    # Chunks of 4 keys: every row merges 3 prefix chunks and 1-2 own chunks in one launch; an
    # LPT weight per packed row changes who runs what, never the result.
    ps, hq, hkv, d = 4, 4, 2, 64
    lv = _two_levels(rng, ps)
    cache = rng.standard_normal((8, 2, ps, hkv, d)).astype(np.float16)
    q = rng.standard_normal((3, hq, d)).astype(np.float16)
    w = MultiLevelCascadeAttentionWrapper(2, np.zeros(1 << 22, np.uint8))
    w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
           q_data_type="float16")
    ref = reference.multi_level_cascade_attention(q, lv["qo"], cache, lv["indptr"],
                                                  lv["indices"], lv["last"])
    for alpha in (1.0, 64.0):
        w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
               q_data_type="float16", fixed_split_size=4, alpha=alpha)
        sched = w.fused_wrapper.schedule
        assert np.diff(sched.merge_indptr).min() >= 4  # 3 prefix chunks + >= 1 own chunk
        assert rel_err(w.run(q, cache), ref) <= TOLERANCE["float16"]


def test_tile_merge_reads_only_written_partials(rng, monkeypatch):
    # Rows of one prefix tile with different list lengths (own KV of 1 or 2 chunks), merged
    # together by one CTA, in a workspace of NaN (as torch.empty may give): a row padded to the
    # longest list must not read another row's partial before it is written (0 * NaN is NaN).
    # The fused merge (the cascade's default is a merge launch of its own): only a cascade
    # gives one tile rows of different list lengths.
    import dataclasses

    from nbinfer.api import prefill as prefill_api
    from nbinfer.scheduler.cascade import cascade_plan

    monkeypatch.setattr(prefill_api, "MMA_DEFER_MERGE", False)

    ps, hq, hkv, d = 4, 2, 1, 64
    qo = [np.array([0, 2, 4]), np.array([0, 1, 2, 3, 4])]
    indptr = [np.array([0, 2, 4]), np.array([0, 1, 2, 3, 5])]
    indices = [np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7, 8])]
    last = [np.array([ps, ps]), np.array([ps, ps, ps, ps])]
    cache = rng.standard_normal((9, 2, ps, hkv, d)).astype(np.float16)
    q = rng.standard_normal((4, hq, d)).astype(np.float16)
    ws = np.zeros(1 << 22, np.uint8)
    w = MultiLevelCascadeAttentionWrapper(2, ws)
    w.plan(qo, indptr, indices, last, hq, hkv, d, ps, q_data_type="float16")
    fw = w.fused_wrapper
    assert not fw.step_plan.spec.defer_merge
    sched, qs, qe, _ = cascade_plan(qo, [np.array([8, 8]), np.array([4, 4, 4, 8])], hq, hkv, 2,
                                    granule=256, tile_q=fw.step_plan.spec.tile_q,
                                    fixed_split_size=4)
    assert sched.num_work == 9 and np.diff(sched.merge_indptr).tolist() == [3, 3, 3, 4]
    # Partial rows: items 0, 1 (prefix chunks of rows 0-1), 2, 3 (rows 2-3), 4-8 (own KV).
    assert sched.work[:, 6].tolist() == [0, 2, 4, 6, 10, 11, 12, 8, 9]
    # One legal GPU timing: rows 2 (3 partials) and 3 (4 partials) complete together, before
    # the items writing partial rows 0-3 have run.
    order = [6, 7, 8, 4, 5, 2, 3, 0, 1]
    sched = dataclasses.replace(sched, cta_indptr=np.array([0, 9, 9], np.int32),
                                cta_work=np.array(order, np.int32))
    fw.with_schedule(sched, qs, qe)
    ws.view(np.float32)[fw.step_plan.launch.layout.float_offsets()[0]:] = np.nan
    out = w.run(q, cache)
    ref = reference.multi_level_cascade_attention(q, qo, cache, indptr, indices, last)
    assert not np.isnan(out).any()
    assert rel_err(out, ref) <= TOLERANCE["float16"]


@pytest.mark.parametrize("causal", [False, True])
def test_cascade_with_the_merge_as_its_own_launch(rng, monkeypatch, causal):
    # MmaPrefillSpec(defer_merge=True): the tensor-core kernel only writes partial states and
    # the split-merge launch after it contracts every (list, kv head) pair over the grid, in a
    # workspace of NaN (a row it failed to merge would come out NaN or stale). Chunks of 4 keys
    # give every row 4-5 partials from both levels. A causal spec adds the value scan and the
    # guarded twin before the merge launch: an inf in the V of request 0's own key must poison
    # exactly the rows that keep it (request 0's heads of kv head 0). PREFILL_PDL asks for the
    # merge as a programmatic dependent launch, which the simulator launches as a plain one
    # (its griddepcontrol wait is a no-op there; tests/test_gpu_prefill.py runs it on the GPU).
    from nbinfer.api import prefill as prefill_api

    monkeypatch.setattr(prefill_api, "MMA_DEFER_MERGE", True)
    monkeypatch.setattr(prefill_api, "PREFILL_PDL", True)
    ps, hq, hkv, d = 4, 4, 2, 64
    lv = _two_levels(rng, ps)
    cache = rng.standard_normal((8, 2, ps, hkv, d)).astype(np.float16)
    if causal:
        cache[2, 1, 1, 0, 5] = np.inf  # page 2 = request 0's own page, token 1, V, kv head 0
    q = rng.standard_normal((3, hq, d)).astype(np.float16)
    ws = np.zeros(1 << 22, np.uint8)
    w = MultiLevelCascadeAttentionWrapper(2, ws)
    w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
           q_data_type="float16", fixed_split_size=4, causal=causal)
    step = w.fused_wrapper.step_plan
    assert step.spec.defer_merge and np.diff(step.schedule.merge_indptr).min() >= 4
    assert not step.launch._after[-1].dependent
    ws.view(np.float32)[step.launch.layout.float_offsets()[0]:] = np.nan
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.multi_level_cascade_attention(
        q, lv["qo"], cache, lv["indptr"], lv["indices"], lv["last"], causal=causal,
        return_lse=True)
    bad = np.isnan(ref).any(axis=-1)
    assert bad.sum() == (2 if causal else 0) and (not causal or bad[0, :2].all())
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), bad)
    np.testing.assert_array_equal(np.isnan(lse), bad)
    assert rel_err(out[~bad], ref[~bad]) <= TOLERANCE["float16"]
    np.testing.assert_allclose(lse[~bad], ref_lse[~bad], atol=2e-3)


def _random_levels(rng, batch, ps, num_pages):
    """A decode step of ``batch`` requests in groups sharing a prefix: level 0 one segment per
    group (1-3 prefix pages), level 1 each request's own 1-3 pages (the last one partial)."""
    sizes = []
    while sum(sizes) < batch:
        sizes.append(int(min(rng.integers(1, 4), batch - sum(sizes))))
    pool = iter(rng.permutation(num_pages).tolist())
    pre = [[next(pool) for _ in range(int(rng.integers(1, 4)))] for _ in sizes]
    own = [[next(pool) for _ in range(int(rng.integers(1, 4)))] for _ in range(batch)]
    return dict(
        qo=[np.concatenate([[0], np.cumsum(sizes)]), np.arange(batch + 1)],
        indptr=[np.concatenate([[0], np.cumsum([len(p) for p in pre])]),
                np.concatenate([[0], np.cumsum([len(p) for p in own])])],
        indices=[np.array(sum(pre, [])), np.array(sum(own, []))],
        last=[np.full(len(sizes), ps), rng.integers(1, ps + 1, size=batch)])


def test_cuda_graph_cascade_keeps_its_kernel_arguments_across_plans(rng):
    # What a CUDA graph replays is the kernel arguments of its capture: a graph-mode cascade
    # binds every plan to the same plan memory, offsets and scratch (one launch object for its
    # lifetime), so the argument block after any later plan equals the captured one, and a
    # launch of it computes the new plan. (tests/test_gpu_prefill.py captures and replays.)
    ps, hq, hkv, d, batch, num_pages = 4, 4, 2, 64, 6, 64
    bufs = dict(qo_indptr_buf_arr=[np.zeros(batch + 1, np.int32)] * 2,
                paged_kv_indptr_buf_arr=[np.zeros(batch + 1, np.int32)] * 2,
                paged_kv_indices_buf_arr=[np.zeros(3 * batch, np.int32)] * 2,
                paged_kv_last_page_len_buf_arr=[np.zeros(batch, np.int32)] * 2)
    w = MultiLevelCascadeAttentionWrapper(2, np.zeros(1 << 22, np.uint8), "NHD", True, **bufs)
    assert w.is_cuda_graph_enabled
    cache = rng.standard_normal((num_pages, 2, ps, hkv, d)).astype(np.float32)
    q = rng.standard_normal((batch, hq, d)).astype(np.float32)
    captured = None
    for step in range(3):
        lv = _random_levels(rng, batch, ps, num_pages)
        w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
               q_data_type="float32")
        launch = w.fused_wrapper.step_plan.launch.launch
        # the plan side of the block: plan memory, tables, partial states, scalars, offsets
        args = [launch._args[ARG[n]] for n in PLAN_SIDE] + launch._args[len(ARG):]
        if captured is None:
            captured = (launch, args)
        assert launch is captured[0]
        for x, y in zip(args, captured[1], strict=True):
            assert x is y if isinstance(x, np.ndarray) else x == y
        out = w.run(q, cache)
        ref = reference.multi_level_cascade_attention(q, lv["qo"], cache, lv["indptr"],
                                                      lv["indices"], lv["last"])
        assert rel_err(out, ref) <= TOLERANCE["float32"], step
    lv = _random_levels(rng, batch + 1, ps, num_pages)
    with pytest.raises(ValueError, match="level 1 has 7 segments"):
        w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
               q_data_type="float32")
    lv = _random_levels(rng, batch, ps, num_pages)
    # one prefix segment; the last request's segment holds two query rows: 7 rows
    lv["qo"] = [np.array([0, batch + 1]), np.append(np.arange(batch), batch + 1)]
    lv["indptr"][0] = np.array([0, lv["indices"][0].size])
    lv["last"][0] = np.array([ps])
    with pytest.raises(ValueError, match="at most the first plan's 6 query rows, got 7"):
        w.plan(lv["qo"], lv["indptr"], lv["indices"], lv["last"], hq, hkv, d, ps,
               q_data_type="float32")
    with pytest.raises(ValueError, match="use_cuda_graph=True needs qo_indptr_buf_arr"):
        MultiLevelCascadeAttentionWrapper(2, np.zeros(1 << 20, np.uint8), "NHD", True)
