"""cascade_plan: all levels of a cascade in one plan, merged per real output row."""

from __future__ import annotations

import numpy as np
import pytest

from nbinfer.api.workspace import item_merge_lists
from nbinfer.scheduler import compiled
from nbinfer.scheduler.cascade import cascade_plan


def _random_levels(rng, rows):
    # Level l's boundaries are a subset of level l + 1's (a coarsening), as in a radix tree.
    fine = np.unique(np.concatenate([[0, rows], rng.integers(1, rows, size=rows // 2)]))
    coarse = np.unique(np.concatenate([[0, rows], rng.choice(fine, size=2)]))
    ptrs = [coarse, fine]
    kvs = [rng.integers(0, 3000, size=p.size - 1) for p in ptrs]
    return ptrs, kvs


@pytest.mark.parametrize("hkv, ctas", [(1, 8), (4, 132), (2, 3)])
def test_every_row_merges_every_level_once(rng, hkv, ctas):
    ptrs, kvs = _random_levels(rng, int(rng.integers(4, 40)))
    plan, qs, qe, level = cascade_plan(ptrs, kvs, 4 * hkv, hkv, ctas, granule=256, tile_q=16)
    w = plan.work.astype(np.int64)
    assert np.all(w[:, 6] >= 0)  # every item writes partial rows
    np.testing.assert_array_equal(np.sort(plan.cta_work), np.arange(plan.num_work))
    rows = int(ptrs[0][-1])
    np.testing.assert_array_equal(plan.merge_rows, np.arange(rows))
    # Each partial row belongs to exactly one list, and that list is its real row.
    assert np.unique(plan.merge_indices).size == plan.merge_indices.size
    owner = np.repeat(np.arange(rows), np.diff(plan.merge_indptr))
    chunks = w[::hkv]
    covered = np.zeros((rows, len(ptrs)), dtype=np.int64)
    for b, _, s, e, ks, ke, prow in chunks:
        for r in range(e - s):
            i = int(np.flatnonzero(plan.merge_indices == prow + r)[0])
            real = qs[b] + s + r
            assert owner[i] == real
            covered[real, level[b]] += ke - ks
    # Summed over its chunks, every row sees each level's full KV of its segment.
    for lvl, (p, kv) in enumerate(zip(ptrs, kvs, strict=True)):
        seg = np.searchsorted(p, np.arange(rows), side="right") - 1
        np.testing.assert_array_equal(covered[:, lvl], kv[seg])


@pytest.mark.parametrize("case", range(24))
def test_the_compiled_loops_give_the_definitions_plan(rng, case):
    # every option, three levels half the time, empty segments and rows without queries
    rows = int(rng.integers(1, 30))
    ptrs, kvs = _random_levels(rng, rows)
    if case % 2:
        ptrs = [ptrs[0], ptrs[1], np.union1d(ptrs[1], rng.integers(0, rows + 1, size=3))]
        kvs = kvs + [rng.integers(0, 300, size=ptrs[2].size - 1)]
    if case % 3 == 0:  # a level of repeated boundaries: segments without rows
        ptrs[-1] = np.sort(np.concatenate([ptrs[-1], ptrs[-1][:2]]))
        kvs[-1] = rng.integers(0, 300, size=ptrs[-1].size - 1)
    hq, hkv = [(4, 1), (8, 2), (32, 8), (6, 6)][case % 4]
    kw = dict(granule=int(rng.choice([1, 16, 64])), tile_q=[None, 16, 64][case % 3],
              fixed_split_size=[None, 40][case % 2], alpha=[1.0, 3.0][case % 2],
              item_overhead=[0, 128][case // 12])
    ctas = int(rng.integers(1, 300))
    want = cascade_plan(ptrs, kvs, hq, hkv, ctas, **kw)
    got = cascade_plan(ptrs, kvs, hq, hkv, ctas, compiled=True, **kw)
    assert got[0] == want[0]
    for a, b in zip(got[1:], want[1:], strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert got[0].cta_work.flags.writeable is False  # frozen like every plan
    trusted = cascade_plan([np.asarray(p, np.int64) for p in ptrs],
                           [np.asarray(k, np.int64) for k in kvs], hq, hkv, ctas,
                           compiled=True, trusted=True, **kw)
    assert trusted[0] == want[0]
    # the one compiled call the wrappers' plan() takes, and the merge list of every item
    direct = compiled.cascade_compiled([np.asarray(p, np.int32) for p in ptrs],
                                       np.concatenate(kvs).astype(np.int64), hq, hkv, ctas, **kw)
    assert direct is not None and direct[0] == want[0]
    np.testing.assert_array_equal(direct[4], item_merge_lists(want[0]))


def test_cascade_plan_errors():
    with pytest.raises(ValueError, match="non-empty"):
        cascade_plan([], [], 4, 1, 8)
    with pytest.raises(ValueError, match="kv_lens_levels"):
        cascade_plan([np.array([0, 2])], [], 4, 1, 8)
    with pytest.raises(ValueError, match="same rows"):
        cascade_plan([np.array([0, 2]), np.array([0, 1, 3])], [np.array([5]), np.array([1, 1])],
                     4, 1, 8)


def test_item_overhead_spreads_short_items():
    # bench/prefill.py's shared prefix on 264 CTAs (the 64-key kernel's grid, where this was
    # first measured): 192 prefix chunks of ~1344 tokens and 512 own items of 256. The byte
    # model parks the own items on the 72 CTAs the prefix leaves free (7 each); counted with a
    # per-item start and end they spread over all CTAs. Items per CTA is what the overhead
    # changes (the work is the same: every item keeps its KV range).
    qo = [np.array([0, 64]), np.arange(65)]
    kv = [np.array([8192]), np.full(64, 256)]
    plans = [cascade_plan(qo, kv, 32, 8, 264, granule=16, tile_q=64, item_overhead=o)[0]
             for o in (0, 256)]
    np.testing.assert_array_equal(plans[0].work, plans[1].work)
    assert plans[1].item_overhead == 256 and plans[0].item_overhead == 0

    def tiles(p):  # per CTA: KV tiles of 64 plus 3 tiles of start and end per item
        cost = -(-(p.work[:, 5] - p.work[:, 4]) // 64) + 3
        return np.bincount(p.item_cta(), weights=cost, minlength=p.num_ctas)

    before, after = tiles(plans[0]), tiles(plans[1])
    assert before.sum() == after.sum()
    assert after.max() <= 0.85 * before.max()
    assert np.array_equal(plans[1].cta_loads(), np.bincount(
        plans[1].item_cta(), weights=plans[1].item_costs(), minlength=264))


@pytest.mark.parametrize("case", range(40))
def test_the_compiled_level_check_agrees_with_the_definition(rng, case):
    # compiled.check_levels_fast passes exactly the lists _check_levels accepts: valid levels
    # and one corruption of each kind (an indptr that decreases, starts off zero, ends off the
    # rows; a boundary missing from the next level; a page table of the wrong length)
    from nbinfer.reference.cascade import _check_levels

    rows = int(rng.integers(1, 30))
    ptrs, _ = _random_levels(rng, rows)
    qo = [np.asarray(p, np.int32) for p in ptrs]
    kv_ptrs = [np.zeros(p.size, np.int32) for p in qo]
    lasts = [np.ones(p.size - 1, np.int32) for p in qo]
    kind, lvl = case % 8, int(rng.integers(0, 2))
    if kind == 1 and qo[lvl].size > 2:
        qo[lvl][1], qo[lvl][2] = qo[lvl][2], qo[lvl][1] - (qo[lvl][1] == qo[lvl][2])
    elif kind == 2:
        qo[lvl][0] = 1
    elif kind == 3:
        qo[lvl][-1] += 1
    elif kind == 4:  # a coarse boundary the fine level lacks
        qo[0] = np.union1d(qo[0], [int(rng.integers(1, rows + 1))]).astype(np.int32)
        kv_ptrs[0], lasts[0] = np.zeros(qo[0].size, np.int32), np.ones(qo[0].size - 1, np.int32)
    elif kind == 5:
        kv_ptrs[lvl] = kv_ptrs[lvl][:-1]
    elif kind == 6:
        lasts[lvl] = np.ones(lasts[lvl].size + 1, np.int32)
    try:
        _check_levels(int(qo[-1][-1]), qo, kv_ptrs, [np.zeros(0, np.int32)] * 2, lasts)
        want = True
    except ValueError:
        want = False
    assert compiled.check_levels_fast(qo, kv_ptrs, lasts) is want
