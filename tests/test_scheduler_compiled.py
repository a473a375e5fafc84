"""The compiled scheduler (nbinfer.scheduler.compiled) gives exactly the NumPy planner's plans."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from test_scheduler import batches

from nbinfer.api.workspace import item_merge_lists
from nbinfer.formats.paged import check_page_table
from nbinfer.scheduler import PlanLayout, plan
from nbinfer.scheduler.compiled import (
    PendingPlan,
    check_and_plan,
    check_page_table_fast,
    item_merge_compiled,
    pack_compiled,
    plan_compiled,
)

SETTINGS = settings(max_examples=150, deadline=None)
NAMES = ("indptr", "indices", "last_page_len")


def _same(kwargs):
    want = plan(**kwargs)
    got, item_merge = plan_compiled(np.asarray(kwargs.pop("qo_indptr")),
                                    np.asarray(kwargs.pop("kv_lens"), dtype=np.int64), **kwargs)
    assert got == want
    np.testing.assert_array_equal(item_merge, item_merge_lists(want))
    return want


@SETTINGS
@given(batches(max_batch=8, l2=False))
def test_equal_to_the_numpy_planner(kwargs):
    _same(kwargs)


@pytest.mark.parametrize("lens", [
    [4096] * 64,  # uniform decode: every item alike, so LPT ties everywhere
    [30000, 7, 100, 1, 5000, 64, 2, 900] * 4,  # skewed: splits, merges, heap
    [0, 0, 1500, 0, 12000, 3, 0, 0],  # empty requests
    [1024] * 300,  # more items than CTAs, all of one cost
])
def test_equal_on_decode_steps(lens, rng):
    b = len(lens)
    for ctas in (528, 7, 8, 1):  # the LPT tree's leaves: padded, exact, a single one
        p = _same(dict(qo_indptr=np.arange(b + 1), kv_lens=lens, num_qo_heads=32,
                       num_kv_heads=8, num_ctas=ctas, granule=256))
        assert p.num_work >= b * 8
    zipf = np.minimum(rng.zipf(1.3, size=128) * 64, 65536)
    _same(dict(qo_indptr=np.arange(129), kv_lens=zipf, num_qo_heads=32, num_kv_heads=8,
               num_ctas=528, granule=256))


def test_equal_on_prefill_steps(rng):
    qo = rng.integers(1, 600, size=12)
    kv = qo + rng.integers(0, 3000, size=12)
    for causal in (False, True):
        _same(dict(qo_indptr=np.concatenate(([0], np.cumsum(qo))), kv_lens=kv, num_qo_heads=32,
                   num_kv_heads=8, num_ctas=528, granule=64, causal=causal))


def test_huge_costs_fall_back_to_the_exact_planner():
    # KV weighted 2**20 : 3 against query rows: cost keys past 2**61, where the NumPy planner's
    # heap switches to Python ints; the compiled one hands such steps to it
    p = _same(dict(qo_indptr=np.arange(1101), kv_lens=[2**22] * 1100, num_qo_heads=1,
                   num_kv_heads=1, num_ctas=1024, alpha=3e-6, beta=1.0))
    assert int(p.work[:, 5].max()) * 2**20 * p.num_work * p.num_ctas >= 2**61


@SETTINGS
@given(batches(max_batch=8))
def test_item_merge_lists_compiled_equal_to_numpy(kwargs):
    p = plan(**kwargs)
    got = item_merge_compiled(p)
    # the NumPy form, which item_merge_lists takes before the compiled loops are loaded
    with mock.patch("nbinfer.scheduler.compiled.loaded", return_value=False):
        want = item_merge_lists(p)
    assert got.dtype == want.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@SETTINGS
@given(batches(max_batch=8, l2=False))
def test_pack_equal_to_layout_pack(kwargs):
    p = plan(**kwargs)
    layout = PlanLayout(p.num_ctas, p.num_work + 3, p.num_merge_rows + 2, p.num_merge_nnz + 1)
    want = layout.pack(p)
    got = pack_compiled(layout, p, np.zeros(layout.size, dtype=np.int32))
    np.testing.assert_array_equal(got, want)
    assert layout.unpack(got) == p


@pytest.mark.parametrize("table", [
    ([0, 2, 3], [5, 1, 9], [16, 3]),
    ([0, 0, 2], [4, 4, 7], [0, 1]),  # empty request: its last_page_len may be 0
    ([0, 2, 3], [5, 1, 9, 99, -7], [16, 3]),  # a longer indices buffer: only 3 are read
    ([0], [], []),
])
def test_page_table_fast_path_matches_the_validator(table):
    arrays = tuple(np.array(a, dtype=np.int32) for a in table)
    *got, pages = check_page_table_fast(*arrays, 16, NAMES)
    want = check_page_table(*arrays, 16)
    assert pages == (int(want[1].max()) + 1 if want[1].size else 0)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == w.dtype and not g.flags.writeable
    assert not np.shares_memory(got[1], arrays[1])  # a snapshot


@pytest.mark.parametrize("table, message", [
    (([1, 2], [0, 1], [1]), "indptr\\[0\\] must be 0"),
    (([0, 2, 1], [0, 1], [1, 1]), "non-decreasing"),
    (([0, 3], [0, 1], [1]), "at least indptr\\[-1\\]=3"),
    (([0, 2], [0, -1], [1]), "indices values must lie"),
    (([0, 2], [0, 1], [17]), "last_page_len values must lie"),
    (([0, 2], [0, 1], [0]), "last_page_len values must lie"),
    (([0, 2], [0, 1], [1, 1]), "must have length 1"),
])
def test_page_table_fast_path_raises_the_validators_errors(table, message):
    for dtype in (np.int32, np.int64):
        arrays = tuple(np.array(a, dtype=dtype) for a in table)
        with pytest.raises((ValueError, TypeError), match=message):
            check_page_table_fast(*arrays, 16, NAMES)


@pytest.mark.parametrize("lens", [[1, 700, 40000, 16], [0, 0, 33], [4096] * 40])
def test_check_and_plan_is_the_check_then_the_planner(lens, rng):
    from nbinfer.formats import PageTable

    pt = PageTable.from_kv_lens(lens, 16, rng=rng)
    table = tuple(np.array(a, dtype=np.int32) for a in (pt.indptr, pt.indices, pt.last_page_len))
    qo = np.arange(len(lens) + 1, dtype=np.int32)
    for split in (None, 64):
        *got_table, pending, packed = check_and_plan(
            *table, 16, NAMES, qo, 32, 8, 528, granule=16, fixed_split_size=split)
        assert not packed  # nothing to pack into without ``speculate``
        sched, item_merge = pending.get()
        assert (pending.num_ctas, pending.num_work, pending.num_merge_rows,
                pending.num_merge_nnz) == (sched.num_ctas, sched.num_work,
                                           sched.num_merge_rows, sched.num_merge_nnz)
        *want_table, pages = check_page_table_fast(*table, 16, NAMES)
        assert got_table[4] == pages
        for g, w in zip(got_table[:4], want_table, strict=True):
            np.testing.assert_array_equal(g, w)
            assert g.dtype == w.dtype and not g.flags.writeable
        want = plan(qo, want_table[3], 32, 8, 528, granule=16, fixed_split_size=split)
        assert sched == want
        np.testing.assert_array_equal(item_merge, item_merge_lists(want))


@pytest.mark.parametrize("table, message", [
    (([1, 2], [0, 1], [1]), "indptr\\[0\\] must be 0"),
    (([0, 2], [0, -1], [1]), "indices values must lie"),
    (([0, 2], [0, 1], [17]), "last_page_len values must lie"),
    (([0, 3], [0, 1], [1]), "at least indptr\\[-1\\]=3"),
])
def test_check_and_plan_raises_the_validators_errors(table, message):
    for dtype in (np.int32, np.int64):
        arrays = tuple(np.array(a, dtype=dtype) for a in table)
        with pytest.raises((ValueError, TypeError), match=message):
            check_and_plan(*arrays, 16, NAMES, np.arange(2, dtype=np.int32), 8, 2, 16)


def test_a_wrappers_plans_agree_across_the_switch_to_the_compiled_planner(rng):
    # plan() #1 runs the NumPy planner, #2 on the compiled loops: the same step must give the
    # same schedule and the same words in plan memory; a step of another batch size in the same
    # power-of-two bucket reuses the layout (no rebinding of the prepared launch)
    from nbinfer import BatchDecodeWithPagedKVCacheWrapper
    from nbinfer.formats import PageTable

    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(8 << 20, dtype=np.uint8), backend="sim")
    pt = PageTable.from_kv_lens(rng.integers(1, 3000, size=5), 16, rng=rng)
    args = (pt.indptr, pt.indices, pt.last_page_len, 8, 2, 64, 16)
    words = []
    for _ in range(2):
        w.plan(*args)
        step = w.step_plan
        words.append(step.launch.ints[:step.launch.layout.words["end"]].copy())
        if len(words) == 1:
            first = step.schedule
    assert step.schedule == first
    np.testing.assert_array_equal(words[0], words[1])
    for batch in (5, 6):  # 5 and 6 requests of 1000 tokens: the same buckets
        pt = PageTable.from_kv_lens([1000] * batch, 16, rng=rng)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 8, 2, 64, 16)
        if batch == 5:
            layout = w.step_plan.launch.layout
    assert w.step_plan.launch.layout is layout


def test_load_prepares_the_signatures_a_wrapper_uses(rng):
    # Numba types read-only arrays apart from writable ones; after load(), a wrapper's compiled
    # plan() (its second) must find every signature it needs already loaded
    from nbinfer import BatchDecodeWithPagedKVCacheWrapper
    from nbinfer.formats import PageTable
    from nbinfer.scheduler import _loops, compiled

    compiled.load()
    before = {f: len(f.signatures) for f in (_loops.schedule, _loops.check_table, _loops.pack,
                                             _loops.check_and_schedule,
                                             _loops.check_schedule_pack)}
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, dtype=np.uint8), backend="sim")
    for _ in range(3):
        pt = PageTable.from_kv_lens(rng.integers(1, 300, size=3), 16, rng=rng)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 8, 2, 64, 16)
        w.plan(pt.indptr.copy(), pt.indices.copy(), pt.last_page_len.copy(), 8, 2, 64, 16)
    assert {f: len(f.signatures) for f in before} == before


def test_head_counts_with_the_same_group_get_their_own_launch(rng):
    from nbinfer import BatchDecodeWithPagedKVCacheWrapper, reference
    from nbinfer.formats import PageTable

    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, dtype=np.uint8), backend="sim")
    pt = PageTable.from_kv_lens([40, 7], 16, rng=rng)
    for hq, hkv in ((4, 2), (8, 4)):  # group 2 both times: one kernel spec, two shapes
        cache = rng.standard_normal((pt.num_pages, 2, 16, hkv, 64)).astype(np.float32)
        q = rng.standard_normal((2, hq, 64)).astype(np.float32)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, 64, 16, q_data_type="float32")
        out = w.run(q, cache)
        ref = reference.batch_decode_with_paged_kv_cache(q, cache, pt.indptr, pt.indices,
                                                         pt.last_page_len)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    assert len(w._launches) == 2


def test_speculative_pack_writes_what_staging_writes(rng, monkeypatch):
    # From a wrapper's third plan() on, the compiled check-and-schedule call also packs the step
    # for the layout of the step before; whenever the step keeps that layout, those words are
    # uploaded instead of staging again. They must equal the NumPy staging of the same step.
    from nbinfer import BatchDecodeWithPagedKVCacheWrapper
    from nbinfer.api.workspace import WorkspaceLayout
    from nbinfer.formats import PageTable

    calls = []
    stage = WorkspaceLayout.stage
    monkeypatch.setattr(WorkspaceLayout, "stage",
                        lambda self, *a, **k: calls.append(1) or stage(self, *a, **k))
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(8 << 20, dtype=np.uint8), backend="sim")
    staged_steps = 0
    for lens in ([700, 30], [701, 31], [702, 32], [20, 900, 5], [21, 901, 6], [3] * 9,
                 [4] * 9):
        pt = PageTable.from_kv_lens(lens, 16, rng=rng)
        before = len(calls)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 8, 2, 64, 16, fixed_split_size=256)
        staged_steps += len(calls) > before
        step = w.step_plan
        launch = step.launch
        want = launch.layout.stage(step.schedule, item_merge_lists(step.schedule),
                                   step.page_table)
        np.testing.assert_array_equal(launch.ints[:want.size], want)
    assert staged_steps <= 4, staged_steps  # three or more steps took the speculative words


def test_decode_step_builds_its_schedule_on_first_read(rng):
    # A steady-state decode plan() packs the step in the compiled call and keeps the schedule
    # as the loops' one buffer (compiled.PendingPlan); reading step.schedule builds the Plan,
    # which is the NumPy planner's.
    from nbinfer import BatchDecodeWithPagedKVCacheWrapper
    from nbinfer.api.step import DeferredStepPlan, StepPlan
    from nbinfer.formats import PageTable

    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(8 << 20, dtype=np.uint8), backend="sim")
    pt = PageTable.from_kv_lens([900, 33, 4000], 16, rng=rng)
    for _ in range(3):
        w.plan(pt.indptr, pt.indices, pt.last_page_len, 8, 2, 64, 16)
    step = w.step_plan
    assert type(step) is DeferredStepPlan
    assert isinstance(step.__dict__["schedule"], PendingPlan)  # not built yet
    want = plan(np.arange(4, dtype=np.int32), step.kv_lens, 8, 2, step.schedule.num_ctas,
                granule=step.schedule.granule)
    assert step.schedule == want and w.schedule is step.schedule  # built once, then kept
    assert not step.schedule.work.flags.writeable
    assert StepPlan(**{f.name: getattr(step, f.name) for f in dataclasses.fields(StepPlan)}) \
        == step
