"""The layer kernels (RMSNorm, fused add + RMSNorm, SiLU-and-multiply, RoPE from a cos/sin
table) on the GPU with torch tensors at a Llama-3.2-1B decode step's shapes, against the
float64 reference: every dtype, rows strided as views of a fused projection, in place, and
replayed from a CUDA graph with new data (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

from nbinfer import reference
from nbinfer.reference.layers import cos_sin_cache

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import nbinfer  # noqa: E402

N, HIDDEN, INTER, HQ, HK, D = 64, 2048, 8192, 32, 8, 64


def _np(t):
    return t.float().cpu().numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_layer_ops_on_torch_tensors(dtype):
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(dt)

    w32 = torch.rand(HIDDEN, generator=g, device="cuda") + 0.5
    x, r = rand(N, HIDDEN), rand(N, HIDDEN, scale=3.0)
    ref_n, ref_t = reference.layers.fused_add_rmsnorm(_np(x), _np(r), _np(w32), 1e-5,
                                                      dtype=dtype)
    nbinfer.fused_add_rmsnorm(x, r, w32, 1e-5)
    assert np.array_equal(_np(r), ref_t)
    assert_close(_np(x), ref_n, dtype, "fused_add_rmsnorm")
    wide = rand(N, HIDDEN + 64)
    out = nbinfer.rmsnorm(wide[:, 32:32 + HIDDEN], w32.to(dt), 1e-5)
    assert_close(_np(out), reference.layers.rmsnorm(_np(wide[:, 32:32 + HIDDEN]),
                                                    _np(w32.to(dt)), 1e-5), dtype, "rmsnorm")
    gu = rand(N, 2 * INTER, scale=2.0)
    assert_close(_np(nbinfer.silu_and_mul(gu)), reference.layers.silu_and_mul(_np(gu)), dtype,
                 "silu_and_mul")
    inv = 1.0 / 500000.0 ** (np.arange(0, D, 2) / D)
    table = torch.as_tensor(cos_sin_cache(inv, 4096), device="cuda")
    qkv = rand(N, (HQ + 2 * HK) * D)
    pos = torch.randint(0, 4096, (N,), generator=g, device="cuda")
    q, k = qkv[:, :HQ * D], qkv[:, HQ * D:(HQ + HK) * D]
    ref_q, ref_k = reference.layers.apply_rope_with_cos_sin_cache(_np(pos), _np(q), _np(k), D,
                                                                  table.cpu().numpy())
    qr, kr = nbinfer.apply_rope_with_cos_sin_cache(pos, q, k, D, table)
    assert qr.is_contiguous() and kr.is_contiguous()
    assert_close(_np(qr), ref_q, dtype, "rope q")
    v_before = qkv[:, (HQ + HK) * D:].clone()
    nbinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, table)
    assert torch.equal(q, qr) and torch.equal(k, kr)
    assert torch.equal(qkv[:, (HQ + HK) * D:], v_before)


def test_layer_ops_replay_from_a_cuda_graph():
    dt = torch.bfloat16
    x = torch.randn(N, HIDDEN, device="cuda").to(dt)
    r = torch.randn(N, HIDDEN, device="cuda").to(dt)
    w = torch.ones(HIDDEN, device="cuda")
    gu = torch.randn(N, 2 * INTER, device="cuda").to(dt)
    nbinfer.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-5)  # compiled before the capture
    nbinfer.silu_and_mul(gu)
    graph = torch.cuda.CUDAGraph()
    with nbinfer.defer_frees(), torch.cuda.graph(graph):
        nbinfer.fused_add_rmsnorm(x, r, w, 1e-5)
        m = nbinfer.silu_and_mul(gu)
    for _ in range(2):  # new data in the captured buffers, then replay
        x.copy_(torch.randn(N, HIDDEN, device="cuda").to(dt))
        r.copy_(torch.randn(N, HIDDEN, device="cuda").to(dt))
        gu.copy_(torch.randn(N, 2 * INTER, device="cuda").to(dt))
        ref_n, _ = reference.layers.fused_add_rmsnorm(_np(x), _np(r), np.ones(HIDDEN), 1e-5,
                                                      dtype="bfloat16")
        ref_m = reference.layers.silu_and_mul(_np(gu))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(_np(x), ref_n, "bfloat16", "replayed norm")
        assert_close(_np(m), ref_m, "bfloat16", "replayed silu")


def test_a_capture_survives_numba_frees_inside_defer_frees():
    # Numba flushes its queue of pending frees once it holds more than
    # CUDA_DEALLOCS_COUNT (10) entries; a cuMemFree during a capture invalidates it. Twelve
    # device arrays dropped mid-capture (what a collected wrapper's plan memory does) must
    # leave a capture inside nbinfer.defer_frees() intact, and the frees run after it.
    import gc

    from numba import cuda

    dt = torch.bfloat16
    x, r = (torch.randn(N, HIDDEN, device="cuda").to(dt) for _ in range(2))
    w = torch.ones(HIDDEN, device="cuda")
    nbinfer.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-5)  # compiled before the capture
    ctx = cuda.current_context()
    # (numba-cuda 0.30 queues the frees on its memory manager's list, not the context's)
    pending = getattr(ctx.memory_manager, "deallocations", ctx.deallocations)
    pending.clear()
    doomed = [cuda.device_array(1024, dtype=np.int32) for _ in range(12)]
    x0, r0 = x.clone(), r.clone()
    graph = torch.cuda.CUDAGraph()
    gc.collect()  # earlier tests' garbage (CUDA graphs, events) freed before the capture
    with nbinfer.defer_frees(), torch.cuda.graph(graph):
        nbinfer.fused_add_rmsnorm(x, r, w, 1e-5)
        doomed.clear()
        gc.collect()  # (their memory pointers are collected by the cycle collector)
        assert len(pending) >= 12  # twelve frees queued, none flushed
    x.copy_(x0)
    r.copy_(r0)
    graph.replay()
    torch.cuda.synchronize()
    ref_n, _ = reference.layers.fused_add_rmsnorm(_np(x0), _np(r0), np.ones(HIDDEN), 1e-5,
                                                  dtype="bfloat16")
    assert_close(_np(x), ref_n, "bfloat16", "replayed norm")
    pending.clear()  # outside: flushed
    assert len(pending) == 0


def test_fast_and_careful_paths_agree_bitwise(monkeypatch):
    # torch CUDA tensors take api/layers_fast.py; the careful path must give the same bits
    # (out=, partial rotary with its copied dimensions, int32 and int64 positions, 2-D and 3-D
    # operands included), and the fast path must be the one that ran when it is on
    import nbinfer.api.layers as layers

    taken = []

    def spy(name):
        fn = getattr(layers, name)

        def call(*args):
            res = fn(*args)
            if res is not None and res is not False:
                taken.append(name)
            return res
        return call

    for name in ("fast_rmsnorm", "fast_fused_add_rmsnorm", "fast_silu_and_mul", "fast_rope"):
        monkeypatch.setattr(layers, name, spy(name))

    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    w = torch.rand(HIDDEN, generator=g, device="cuda") + 0.5
    wide, gu, qkv = rand(N, HIDDEN + 64), rand(N, 2 * INTER + 8), rand(N, (HQ + 2 * HK) * D)
    x, r = rand(N, HIDDEN), rand(N, HIDDEN)
    inv = 1.0 / 500000.0 ** (np.arange(0, D, 2) / D)
    table = torch.as_tensor(cos_sin_cache(inv, 4096), device="cuda")
    pos = torch.randint(0, 4096, (N,), generator=g, device="cuda", dtype=torch.int32)
    # cos | sin of a rotary part of D / 2 dimensions (the first D / 4 frequencies)
    half = torch.cat([table[:, :D // 4], table[:, D // 2:D // 2 + D // 4]], 1).contiguous()
    results = []
    for fast in (True, False):
        monkeypatch.setattr(layers, "FAST_PATH", fast)
        xs, rs, qkvs = x.clone(), r.clone(), qkv.clone()
        nbinfer.fused_add_rmsnorm(xs, rs, w, 1e-5)
        q, k = qkvs[:, :HQ * D], qkvs[:, HQ * D:(HQ + HK) * D]
        rot = nbinfer.apply_rope_with_cos_sin_cache(pos, q, k.view(N, HK, D), D, table)
        part = nbinfer.apply_rope_with_cos_sin_cache(pos.long(), q.view(N, HQ, D), k, D, half,
                                                     False)
        nbinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, table)
        normed = torch.empty(N, HIDDEN, device="cuda", dtype=dt)
        nbinfer.rmsnorm(wide[:, 64:], w, 1e-5, out=normed)
        results.append((xs, rs, normed, nbinfer.silu_and_mul(gu[:, 8:]), *rot, *part, qkvs))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    # each call once on the fast path (the first pass), none on the careful one
    assert sorted(taken) == sorted(["fast_fused_add_rmsnorm", "fast_rope", "fast_rope",
                                    "fast_rope", "fast_rmsnorm", "fast_silu_and_mul"])
