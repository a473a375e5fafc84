"""Plan/run on the GPU: CUDA-graph replay across steps, bitwise determinism, batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper
from nbinfer.api.launch import defer_frees
from nbinfer.formats import PageTable

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

HQ, HKV, D, PS = 32, 8, 128, 16


def _reference(q, cache, pt):
    return reference.batch_decode_with_paged_kv_cache(
        q.float().cpu().numpy(), cache.float().cpu().numpy(), pt.indptr, pt.indices,
        pt.last_page_len)


def test_cuda_graph_replays_new_plans(rng):
    batch, num_pages = 8, 4096
    cache = torch.randn(num_pages, 2, PS, HKV, D, device="cuda").half()
    q = torch.randn(batch, HQ, D, device="cuda").half()
    out = torch.empty_like(q)
    bufs = (torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
            torch.empty(num_pages, dtype=torch.int32, device="cuda"),
            torch.empty(batch, dtype=torch.int32, device="cuda"))
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD", use_cuda_graph=True,
                                           paged_kv_indptr_buffer=bufs[0],
                                           paged_kv_indices_buffer=bufs[1],
                                           paged_kv_last_page_len_buffer=bufs[2])
    steps = [
        [4096] * batch,  # uniform
        [30000, 7, 100, 1, 5000, 64, 2, 900],  # skewed: the long one is split and merged
        [0, 0, 1500, 0, 12000, 3, 0, 0],  # padding rows (empty requests)
        list(rng.integers(1, 8000, size=batch)),
    ]
    graph = None
    for step, lens in enumerate(steps):
        pt = PageTable.from_kv_lens(lens, PS, num_pages=num_pages, rng=rng)
        w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16")
        q.copy_(torch.randn_like(q))
        if graph is None:
            w.run(q, cache, out=out)  # warm-up outside capture (compiles nothing new)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with defer_frees(), torch.cuda.graph(graph):
                w.run(q, cache, out=out)
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(q, cache, pt)
        assert rel_err(out.float().cpu().numpy(), ref) <= TOLERANCE["float16"], f"step {step}"


def test_bitwise_deterministic_over_100_runs(rng):
    lens = [40000, 17, 3000, 600, 9000, 1, 2500, 128]
    pt = PageTable.from_kv_lens(lens, PS, rng=rng)
    cache = torch.randn(pt.num_pages, 2, PS, HKV, D, device="cuda").half()
    q = torch.randn(len(lens), HQ, D, device="cuda").half()
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16")
    assert w.schedule.num_merge_rows > 0  # the fused merge is exercised
    first, first_lse = w.run(q, cache, return_lse=True)
    for _ in range(99):
        o, lse = w.run(q, cache, return_lse=True)
        assert torch.equal(o, first) and torch.equal(lse, first_lse)
    sched = w.schedule
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16")
    assert w.schedule == sched  # same lengths -> same plan
    assert torch.equal(w.run(q, cache), first)


def test_fixed_split_size_makes_a_request_batch_invariant(rng):
    lens = [20000, 300, 7000, 50]
    pt = PageTable.from_kv_lens(lens, PS, rng=rng)
    cache = torch.randn(pt.num_pages, 2, PS, HKV, D, device="cuda").half()
    q = torch.randn(len(lens), HQ, D, device="cuda").half()
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8,
                                                       device="cuda"), "NHD")
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type="float16",
           fixed_split_size=2048)
    in_batch = w.run(q, cache)
    b = 2
    alone = PageTable(np.array([0, pt.indptr[b + 1] - pt.indptr[b]]),
                      pt.indices[pt.indptr[b]:pt.indptr[b + 1]], pt.last_page_len[b:b + 1], PS,
                      pt.num_pages)
    w.plan(alone.indptr, alone.indices, alone.last_page_len, HQ, HKV, D, PS,
           q_data_type="float16", fixed_split_size=2048)
    assert torch.equal(w.run(q[b:b + 1].contiguous(), cache)[0], in_batch[b])
