"""bench/probe_plans.py: the balance probe's plans (issue 13, req 3) are valid decode plans.

The probe times them on the GPU against LPT; these tests check on the CPU that they are what
the probe says they are (a reordering keeps every CTA's queue, a stream-K plan reads every
pair's tokens exactly once in equal spans), and in the simulator that the decode wrapper runs
them to the float64 reference.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference, scheduler
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper
from nbinfer.formats import PageTable

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("probe_plans", ROOT / "bench" / "probe_plans.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

SHAPES = [(64, 4096), (256, 1024), (16, 32768)]


def _lpt(batch, kv_len, ctas=528):
    return scheduler.plan(np.arange(batch + 1), np.full(batch, kv_len), 32, 8, ctas)


def _queues(plan):
    return [plan.cta_work[plan.cta_indptr[c]:plan.cta_indptr[c + 1]].tolist()
            for c in range(plan.num_ctas)]


@pytest.mark.parametrize("kind", probe.ORDERS)
@pytest.mark.parametrize("batch, kv_len", SHAPES)
def test_reordered_moves_whole_queues(batch, kv_len, kind):
    plan = _lpt(batch, kv_len)
    new = probe.reordered(plan, kind)
    old_q, new_q = _queues(plan), _queues(new)
    assert new.num_ctas == plan.num_ctas and new.num_work == plan.num_work
    if kind == "within":
        assert new_q == [q[::-1] for q in old_q]
    else:  # a permutation of whole queues: every CTA's load is one of LPT's
        assert sorted(map(tuple, new_q)) == sorted(map(tuple, old_q))
    assert sorted(new.cta_kv_tokens()) == sorted(plan.cta_kv_tokens())


def test_reordered_placements():
    plan = _lpt(64, 4096)
    old_q, c = _queues(plan), plan.num_ctas
    assert _queues(probe.reordered(plan, "rev")) == old_q[::-1]
    stride = _queues(probe.reordered(plan, "stride"))
    for s in range(132):  # CTAs s, s + 132, ... run queues 4 s .. 4 s + 3
        assert [stride[s + 132 * k] for k in range(c // 132)] == old_q[4 * s:4 * s + 4]
    heads = [plan.work[q[0], 1] for q in _queues(probe.reordered(plan, "headmajor")) if q]
    assert heads == sorted(heads)
    assert _queues(probe.reordered(plan, "shuffle")) != old_q
    with pytest.raises(ValueError, match="unknown order"):
        probe.reordered(plan, "sideways")


@pytest.mark.parametrize("kv_lens, ctas", [([4096] * 64, 528), ([4096, 17, 0, 1000, 2500], 7)])
def test_stream_plan_reads_each_pair_once_in_equal_spans(kv_lens, ctas):
    hkv, step = 8, 16
    plan = probe.stream_plan(np.arange(len(kv_lens) + 1), kv_lens, 32, hkv, ctas, step=step)
    w = plan.work  # (b, hk, _, _, kv_start, kv_end, partial row)
    for b, n in enumerate(kv_lens):
        for h in range(hkv):
            mine = w[(w[:, 0] == b) & (w[:, 1] == h)]
            mine = mine[np.argsort(mine[:, 4])]
            assert mine[0, 4] == 0 and mine[-1, 5] == n
            assert (mine[1:, 4] == mine[:-1, 5]).all()  # contiguous, no token twice
            if len(mine) > 1:  # a cut pair: its own merge list over its pieces, in kv order
                ml = int(np.flatnonzero(
                    np.isin(plan.merge_indices, mine[:, 6]))[0])
                lo = plan.merge_indptr[np.searchsorted(plan.merge_indptr, ml, side="right") - 1]
                assert plan.merge_indices[lo:lo + len(mine)].tolist() == mine[:, 6].tolist()
            else:
                assert mine[0, 6] == -1
    loads = plan.cta_kv_tokens()
    assert loads.max() - loads.min() <= 2 * step  # equal spans, moved to page boundaries


@pytest.mark.parametrize("kind", ["stream", "rev"])
def test_probe_plans_run_to_the_reference(rng, kind):
    # The probe swaps its plan in for the wrapper's (the NumPy path); the decode must still
    # match the float64 reference, and a reordering of LPT must give LPT's bits.
    kv_lens, hq, hkv, d, ps = [300, 17, 0, 90], 4, 2, 64, 16
    pt = PageTable.from_kv_lens(kv_lens, ps, rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, ps, hkv, d)).astype(np.float16)
    q = rng.standard_normal((len(kv_lens), hq, d)).astype(np.float16)
    def run(kind):
        w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD")
        with probe.planner(kind):
            w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, d, ps,
                   q_data_type=q.dtype)
        return w, w.run(q, cache, return_lse=True)

    w, (out, lse) = run(kind)
    if kind == "stream":
        assert w.schedule.merge_rows.size >= 1  # some pair was cut and merged in the kernel
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float16"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-4)
    if kind != "stream":
        _, (out_lpt, _) = run("lpt")
        assert np.array_equal(out, out_lpt)
