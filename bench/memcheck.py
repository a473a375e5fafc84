"""Every GPU kernel path once, at small shapes, checked against the float64 reference: the workload
that ``bench/memcheck.sh`` runs under compute-sanitizer (memcheck, racecheck).

    python3 bench/memcheck.py                   # all cases (GPU: torch CUDA tensors, backend="cuda")
    python3 bench/memcheck.py --only 'decode_*' # the cases whose names match (fnmatch, comma list)
    python3 bench/memcheck.py --list            # case names, grouped by the kernel spec they compile
    python3 bench/memcheck.py --dry             # no GPU: build every case with NumPy, run the public
                                                # API with backend="reference", compare to the reference
    python3 bench/memcheck.py --plant-oob       # the control: one deliberate out-of-bounds read

Public API only (``import nbinfer``; torch CUDA tensors in and out). Each line: case name, the
largest relative error (||out - ref|| / ||ref|| over finite entries, as tests/conftest.py; NaN or a
misplaced inf counts as infinite) over the case's outputs, ok / WRONG / ERROR, seconds. Exit status
1 when any case is not ok.

Every page table's pages sit at random positions of a pool with spare pages, and every slot that
no request reads (spare pages, the tail of each last page, block columns that no block row stores)
holds NaN: a kernel that reads a wrong slot gives NaN, a wrong result, even where the sanitizer
sees an in-bounds access. The reference is given the same arrays with NaN -> 0 (the slots it must
not read). Each wrapper gets the smallest workspace its plan accepts (the size is read from the
plan's own ValueError), so that a write past the plan's sections leaves the allocation.

Cases share kernel specs where they can: each spec compiles once per process (8-17 s, more under a
sanitizer). ``--list`` shows the grouping; ~12 attention specs in all.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import re
import sys
import time
from typing import NamedTuple

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nbinfer  # noqa: E402
from nbinfer import reference  # noqa: E402

# ||out - ref|| / ||ref|| allowed, by storage dtype (tests/conftest.py's table); LSEs are float32
# sums of float32 exponentials whatever the storage dtype.
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
LSE_TOL = 5e-4
EXACT = 0.0  # copies (append) and integers: bit-exact

# Shapes shared by most cases: GQA group 4.
HQ, HKV = 8, 2


# ---------------------------------------------------------------------------------------------
# Arrays: storage values are built in NumPy (float32 holding values exact in the storage dtype),
# then moved to torch CUDA tensors, or, under --dry, kept as NumPy arrays for backend="reference".
def store(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` and held as float32 (NaN stays NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits
        u = x.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.astype(np.uint32).view(np.float32)
    return x


def clean(x):
    """The reference's copy: NaN (slots nobody may read) -> 0."""
    if isinstance(x, tuple):
        return tuple(clean(a) for a in x)
    return np.where(np.isnan(x), np.float32(0), x)


def randn(rng, *shape, dtype="float16"):
    return store(rng.standard_normal(shape), dtype)


class Ctx:
    """Where a case's arrays live and which backend runs: torch CUDA + "cuda", or NumPy +
    "reference" (``dry``)."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.backend = "reference" if dry else "cuda"
        if not dry:
            import torch

            self.torch = torch

    def dt(self, dtype: str) -> str:
        """The dtype name to plan with (NumPy has no bfloat16: float32 stands in under --dry)."""
        return "float32" if self.dry and dtype == "bfloat16" else dtype

    def dev(self, x, dtype: str, dense_reference=False):
        """A float array of storage values in ``dtype`` (a tuple: each of its arrays).
        ``dense_reference``: under --dry the API's reference path reads every slot of this array
        (block-sparse), so it gets the NaN-free copy there."""
        if isinstance(x, tuple):
            return tuple(self.dev(a, dtype, dense_reference) for a in x)
        if self.dry:
            x = clean(x) if dense_reference else x
            return x.astype(np.float16 if dtype == "float16" else np.float32)
        t = self.torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to("cuda")
        return t.to(getattr(self.torch, dtype)).contiguous()

    def f32(self, x):
        return self.dev(np.asarray(x, np.float32), "float32")

    def idx(self, x):
        x = np.ascontiguousarray(x, dtype=np.int32)
        return x if self.dry else self.torch.from_numpy(x).to("cuda")

    def flag(self, x):
        x = np.ascontiguousarray(x, dtype=bool)
        return x if self.dry else self.torch.from_numpy(x).to("cuda")

    def host(self, x):
        """Any result as a NumPy array (floats as float64); tuples elementwise."""
        if isinstance(x, tuple):
            return tuple(self.host(a) for a in x)
        if not isinstance(x, np.ndarray):
            x = x.detach()
            x = (x.float() if x.is_floating_point() else x).cpu().numpy()
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x

    def workspace(self, nbytes: int):
        if self.dry:
            return np.zeros(nbytes, np.uint8)
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")

    def sync(self):
        if not self.dry:
            self.torch.cuda.synchronize()


def planned(ctx: Ctx, make, plan, levels: int = 1):
    """``make(workspace)`` then ``plan(wrapper)``, with the smallest workspace the plan takes:
    start small and grow to the size the plan's ValueError names (``levels`` x that for the
    cascade, whose levels share the buffer)."""
    size = 4096
    while True:
        w = make(ctx.workspace(size))
        try:
            plan(w)
            return w
        except ValueError as exc:
            msg = str(exc)
            if "workspace" not in msg.lower() or size >= 1 << 30:
                raise
            m = re.search(r"needs (\d+)", msg)
            grown = levels * (-(-int(m.group(1)) // 256) * 256 + 256) if m else 0
            size = grown if grown > size else 2 * size


# ---------------------------------------------------------------------------------------------
# Page tables over a shared pool with spare pages at random positions, NaN where nobody reads.
class Table(NamedTuple):
    indptr: np.ndarray
    indices: np.ndarray
    last: np.ndarray


def allocate(rng, tables_kv_lens, page_size: int, spare: int = 5):
    """One pool for several page tables: ``(tables, num_pages, used [num_pages, page_size])``."""
    pages = [[-(-int(n) // page_size) for n in lens] for lens in tables_kv_lens]
    total = sum(sum(p) for p in pages)
    num_pages = total + spare
    ids = rng.permutation(num_pages)[:total].astype(np.int32)
    used = np.zeros((num_pages, page_size), dtype=bool)
    tables, at = [], 0
    for lens, npg in zip(tables_kv_lens, pages, strict=True):
        indptr = np.concatenate([[0], np.cumsum(npg)]).astype(np.int32)
        indices = ids[at:at + indptr[-1]]
        at += int(indptr[-1])
        last = np.array([n - (p - 1) * page_size if p else 0 for n, p in zip(lens, npg, strict=True)],
                        dtype=np.int32)
        for b, n in enumerate(lens):
            for j, page in enumerate(indices[indptr[b]:indptr[b + 1]]):
                used[page, :min(page_size, int(n) - j * page_size)] = True
        tables.append(Table(indptr, indices, last))
    return tables, num_pages, used


def paged_cache(rng, used, hkv, d, layout, dtype, pair=False):
    """Random K/V where ``used``, NaN elsewhere: NHD ``[P, 2, ps, Hkv, D]`` / HND
    ``[P, 2, Hkv, ps, D]``, or a ``(k, v)`` pair of ``[P, ps, Hkv, D]`` / ``[P, Hkv, ps, D]``."""
    p, ps = used.shape
    body = (ps, hkv, d) if layout == "NHD" else (hkv, ps, d)
    m = used[:, :, None, None] if layout == "NHD" else used[:, None, :, None]
    kv = [np.where(m, randn(rng, p, *body, dtype=dtype), np.float32(np.nan)) for _ in range(2)]
    return (kv[0], kv[1]) if pair else np.ascontiguousarray(np.stack(kv, axis=1))


def random_masks(rng, qo_lens, kv_lens):
    """Flat custom mask (FlashInfer's concatenation of row-major ``[qo, kv]`` masks), density 0.6,
    with request 0's first row all False (an empty row: O = 0, LSE = -inf)."""
    masks = [rng.random((q, k)) < 0.6 for q, k in zip(qo_lens, kv_lens, strict=True)]
    masks[0][0] = False
    return np.concatenate([m.ravel() for m in masks]), masks


def indptr_of(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def state(out, lse, ref, dtype):
    """The (out, lse) comparisons of an attention result against ``ref = (o, lse)``."""
    return [("out", out, ref[0], TOL[dtype]), ("lse", lse, ref[1], LSE_TOL)]


# ---------------------------------------------------------------------------------------------
# Cases. Each returns [(what, result, reference, tolerance)]; results of any kind (ctx.host).
def batch_decode(ctx, rng, kv_lens, layout, fmt=None):
    """fp16, Hq 8 Hkv 2 D 128, page 16, permuted pages; every request under 256 tokens runs
    unsplit, a long one is cut into KV chunks merged inside the kernel. ``fmt``: an FP8 cache
    of that format (values rounded to it first; fp16 under --dry)."""
    d, ps, dt = 128, 16, "float16"
    (t,), _, used = allocate(rng, [kv_lens], ps)
    cache = paged_cache(rng, used, HKV, d, layout, dt)
    kw, kv_dt = {}, dt
    if fmt and not ctx.dry:
        from nbinfer.reference import fp8

        cache, kw, kv_dt = fp8.decode(fp8.encode(cache, fmt), fmt), dict(kv_data_type=fmt), fmt
    q = randn(rng, len(kv_lens), HQ, d, dtype=dt)
    ref = reference.batch_decode_with_paged_kv_cache(q, clean(cache), *t, kv_layout=layout,
                                                     return_lse=True)
    w = planned(ctx, lambda ws: nbinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, layout, backend=ctx.backend),
        lambda w: w.plan(*t, HQ, HKV, d, ps, q_data_type=ctx.dt(dt), **kw))
    out, lse = w.run(ctx.dev(q, dt), ctx.dev(cache, kv_dt), return_lse=True)
    return state(out, lse, ref, dt)


def decode_with(ctx, rng, kv_lens, layout, fmt=None, **settings):
    """:func:`batch_decode` with ``nbinfer.api.decode``'s module settings overridden, e.g.
    ``DECODE_STAGES=3`` (a deeper KV ring, 48 KiB at three stages, allocated at launch) or
    ``DECODE_MMA=True`` (q.k and p.v on tensor cores; ``False``: CUDA cores, which FP8 caches
    otherwise leave by default)."""
    from unittest import mock

    from nbinfer.api import decode as decode_api

    with mock.patch.multiple(decode_api, **settings):
        return batch_decode(ctx, rng, kv_lens, layout, fmt)


def prefill_with(settings: dict, fn, *args, **kw):
    """``fn(*args, **kw)`` (a prefill case) with ``nbinfer.api.prefill``'s module settings
    overridden, e.g. ``MMA_WGMMA=True`` (the lean warpgroup kernel on sm_90, whatever the rows
    per request) and ``LEAN_PREFETCH=True`` (its per-item overlap)."""
    from unittest import mock

    from nbinfer.api import prefill as prefill_api

    with mock.patch.multiple(prefill_api, **settings):
        return fn(*args, **kw)


LEAN = dict(MMA_WGMMA=True)
LEAN_PF = dict(MMA_WGMMA=True, LEAN_PREFETCH=True)
PLAIN_LENS = [1, 16, 17, 0, 100, 255, 33, 64]  # 0: an empty request (O = 0, LSE = -inf)
SPLIT_LENS = [20000, 7, 300, 1, 513]


def graph_decode(ctx, rng):
    """The CUDA-graph mode of the decode wrapper (no graph captured): the kernel reads the page
    table from the caller's fixed buffers (room for 8 requests and 40 spare pages, each its own
    allocation) through a workspace laid out for those bounds."""
    d, ps, dt, layout = 128, 16, "float16", "NHD"
    (t,), _, used = allocate(rng, [SPLIT_LENS], ps)
    cache = paged_cache(rng, used, HKV, d, layout, dt)
    q = randn(rng, len(SPLIT_LENS), HQ, d, dtype=dt)
    ref = reference.batch_decode_with_paged_kv_cache(q, clean(cache), *t, kv_layout=layout,
                                                     return_lse=True)
    bufs = (ctx.idx(np.zeros(9)), ctx.idx(np.zeros(t.indices.size + 40)), ctx.idx(np.zeros(8)))
    w = planned(ctx, lambda ws: nbinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, layout, use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
        backend=ctx.backend),
        lambda w: w.plan(*t, HQ, HKV, d, ps, q_data_type=ctx.dt(dt)))
    out, lse = w.run(ctx.dev(q, dt), ctx.dev(cache, dt), return_lse=True)
    return state(out, lse, ref, dt)


def single_decode(ctx, rng):
    d, dt, kv_len = 128, "float16", 5000
    q = randn(rng, HQ, d, dtype=dt)
    k, v = randn(rng, kv_len, HKV, d, dtype=dt), randn(rng, kv_len, HKV, d, dtype=dt)
    ref = reference.single_decode_with_kv_cache(q, k, v, return_lse=True)
    out, lse = nbinfer.single_decode_with_kv_cache(ctx.dev(q, dt), ctx.dev(k, dt), ctx.dev(v, dt),
                                                   return_lse=True, backend=ctx.backend)
    return state(out, lse, ref, dt)


def paged_prefill(ctx, rng, qo_lens, kv_lens, d, dt, layout, causal=False, mask=False,
                  nan_v=None):
    """``nan_v = (request, token)``: a NaN in that key's V (kv head 0), which the rows that keep
    it must show and no other row may (the tensor-core kernel's value scan and guarded twin)."""
    ps = 16
    (t,), _, used = allocate(rng, [kv_lens], ps)
    cache = paged_cache(rng, used, HKV, d, layout, dt)
    qo_indptr = indptr_of(qo_lens)
    q = randn(rng, int(qo_indptr[-1]), HQ, d, dtype=dt)
    flat = random_masks(rng, qo_lens, kv_lens)[0] if mask else None
    ref_cache = clean(cache)
    if nan_v is not None:  # in both copies: the reference must see it too
        b, tok = nan_v
        page, slot = int(t[1][t[0][b] + tok // ps]), tok % ps
        at = (page, 1, slot, 0, 3) if layout == "NHD" else (page, 1, 0, slot, 3)
        cache[at] = ref_cache[at] = np.nan
    ref = reference.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, ref_cache, *t, custom_mask=flat, causal=causal, kv_layout=layout,
        return_lse=True)
    w = planned(ctx, lambda ws: nbinfer.BatchPrefillWithPagedKVCacheWrapper(
        ws, layout, backend=ctx.backend),
        lambda w: w.plan(qo_indptr, *t, HQ, HKV, d, ps, custom_mask=flat, causal=causal,
                         q_data_type=ctx.dt(dt)))
    out, lse = w.run(ctx.dev(q, dt), ctx.dev(cache, dt), return_lse=True)
    if nan_v is None:
        return state(out, lse, ref, dt)
    return nan_state(ctx, out, lse, ref, dt)


def nan_state(ctx, out, lse, ref, dtype):
    """:func:`state` for results with NaN rows: where they are must match exactly, and the
    finite values as usual."""
    ctx.sync()
    checks = []
    for what, got, want, tol in state(out, lse, ref, dtype):
        got, want = ctx.host(got), np.asarray(want, dtype=np.float64)
        checks.append((what + " NaN pattern", np.isnan(got).astype(np.float64),
                       np.isnan(want).astype(np.float64), 0.0))
        checks.append((what, np.where(np.isnan(got), 0.0, got),
                       np.where(np.isnan(want), 0.0, want), tol))
    if not np.isnan(ref[1]).any():
        raise AssertionError("the case planted no NaN that a row keeps")
    return checks


def ragged_kv(rng, n, d, layout, dt):
    shape = (n, HKV, d) if layout == "NHD" else (HKV, n, d)
    return randn(rng, *shape, dtype=dt), randn(rng, *shape, dtype=dt)


def ragged_prefill(ctx, rng, qo_lens, kv_lens, d, dt, layout, causal=False, mask=False):
    qo_indptr, kv_indptr = indptr_of(qo_lens), indptr_of(kv_lens)
    q = randn(rng, int(qo_indptr[-1]), HQ, d, dtype=dt)
    k, v = ragged_kv(rng, int(kv_indptr[-1]), d, layout, dt)
    flat = random_masks(rng, qo_lens, kv_lens)[0] if mask else None
    ref = reference.batch_prefill_with_ragged_kv_cache(
        q, k, v, qo_indptr, kv_indptr, custom_mask=flat, causal=causal, kv_layout=layout,
        return_lse=True)
    w = planned(ctx, lambda ws: nbinfer.BatchPrefillWithRaggedKVCacheWrapper(
        ws, layout, backend=ctx.backend),
        lambda w: w.plan(qo_indptr, kv_indptr, HQ, HKV, d, custom_mask=flat, causal=causal,
                         q_data_type=ctx.dt(dt)))
    out, lse = w.run(ctx.dev(q, dt), ctx.dev(k, dt), ctx.dev(v, dt), return_lse=True)
    return state(out, lse, ref, dt)


def single_prefill(ctx, rng, qo_len, kv_len, d, dt, layout, causal=False, mask=False):
    q = randn(rng, qo_len, HQ, d, dtype=dt)
    k, v = ragged_kv(rng, kv_len, d, layout, dt)
    m2 = random_masks(rng, [qo_len], [kv_len])[1][0] if mask else None
    ref = reference.single_prefill_with_kv_cache(q, k, v, custom_mask=m2, causal=causal,
                                                 kv_layout=layout, return_lse=True)
    args = (ctx.dev(q, dt), ctx.dev(k, dt), ctx.dev(v, dt))
    kw = dict(causal=causal, kv_layout=layout, return_lse=True, backend=ctx.backend)
    try:  # FlashInfer's form: [qo_len, kv_len]
        out, lse = nbinfer.single_prefill_with_kv_cache(*args, custom_mask=m2, **kw)
    except ValueError as exc:
        if m2 is None or "custom_mask" not in str(exc):
            raise
        print(f"    note: single_prefill_with_kv_cache rejected a [qo_len, kv_len] custom_mask "
              f"({exc}); the flat mask is used", flush=True)
        out, lse = nbinfer.single_prefill_with_kv_cache(*args, custom_mask=m2.ravel(), **kw)
    return state(out, lse, ref, dt)


def block_sparse(ctx, rng, M, N, R, C, causal=False, mask=False, empty_row=None):
    """fp16 D 128 (tensor cores). M, N not multiples of R, C: a partial last block row and
    column; the partial last column is stored by the first and the last block row; one block
    column (not the last) is stored by nobody and its keys are NaN; columns unsorted in a row."""
    d, dt = 128, "float16"
    mb, nb = -(-M // R), -(-N // C)
    dense = rng.random((mb, nb)) < 0.5
    free = int(rng.integers(0, nb - 1))
    dense[:, free] = False
    dense[0, nb - 1] = dense[mb - 1, nb - 1] = True
    if empty_row is not None:
        dense[empty_row] = False
    indptr = indptr_of(dense.sum(1))
    indices = np.concatenate([rng.permutation(np.flatnonzero(r)) for r in dense]).astype(np.int32)
    elem = rng.random((indices.size, R, C)) < 0.7 if mask else None
    q = randn(rng, M, HQ, d, dtype=dt)
    k, v = randn(rng, N, HKV, d, dtype=dt), randn(rng, N, HKV, d, dtype=dt)
    k[free * C:(free + 1) * C] = v[free * C:(free + 1) * C] = np.nan
    ref = reference.block_sparse_attention(q, clean(k), clean(v), indptr, indices, R, C,
                                           mask=elem, causal=causal, return_lse=True)
    w = planned(ctx, lambda ws: nbinfer.BlockSparseAttentionWrapper(ws, backend=ctx.backend),
                lambda w: w.plan(indptr, indices, M, N, R, C, HQ, HKV, d, mask=elem,
                                 causal=causal, q_data_type=ctx.dt(dt)))
    out, lse = w.run(ctx.dev(q, dt), ctx.dev(k, dt, True), ctx.dev(v, dt, True), return_lse=True)
    return state(out, lse, ref, dt)


def cascade(ctx, rng, causal, levels=False, d=128):
    """2 levels over one pool: a 100-token shared prefix (partial last page), then each request's
    own pages; several query rows per request. Not causal: all levels in one launch; causal with
    several rows per request: one launch per level, merged by merge_state_in_place. ``levels``:
    one query row per request, level by level (CASCADE_LAUNCH): the prefix level on the lean
    kernel (MMA_WGMMA), the own level on the decode kernel. ``d``: head_dim (64: the one
    launch's 64-key tiles)."""
    if levels:
        from unittest import mock

        from nbinfer.api import cascade as cascade_api
        from nbinfer.api import prefill as prefill_api

        with mock.patch.object(cascade_api, "CASCADE_LAUNCH", "levels"), \
                mock.patch.multiple(prefill_api, MMA_WGMMA=True, LEAN_PREFETCH=True):
            return _cascade(ctx, rng, causal, [1] * 40, d)
    return _cascade(ctx, rng, causal, [3, 1, 5, 7], d)


def _cascade(ctx, rng, causal, qo_lens, d):
    ps, dt, layout = 16, "float16", "NHD"
    own_lens = rng.integers(1, 50, len(qo_lens)).tolist() if len(qo_lens) > 4 \
        else [20, 1, 47, 16]
    (t0, t1), _, used = allocate(rng, [[100], own_lens], ps)
    cache = paged_cache(rng, used, HKV, d, layout, dt)
    nnz = sum(qo_lens)
    qo = [np.array([0, nnz], np.int32), indptr_of(qo_lens)]
    tables = [[t0.indptr, t1.indptr], [t0.indices, t1.indices], [t0.last, t1.last]]
    q = randn(rng, nnz, HQ, d, dtype=dt)
    ref = reference.multi_level_cascade_attention(q, qo, clean(cache), *tables, causal=causal,
                                                  kv_layout=layout, return_lse=True)
    w = planned(ctx, lambda ws: nbinfer.MultiLevelCascadeAttentionWrapper(
        2, ws, layout, backend=ctx.backend),
        lambda w: w.plan(qo, *tables, HQ, HKV, d, ps, causal=causal, q_data_type=ctx.dt(dt)),
        levels=2 if causal or len(qo_lens) > 4 else 1)  # one launch: the whole buffer
    out, lse = w.run(ctx.dev(q, dt), ctx.dev(cache, dt), return_lse=True)
    return state(out, lse, ref, dt)


def append(ctx, rng, layout, pair, dt, ps, d):
    """get_batch_indices_positions, then append_paged_kv_cache with the page table (after the
    append) and the token indices as int32 device tensors. Slots not yet written are NaN; the
    whole pool (NaN pattern and values) must come out as the reference's."""
    seq_lens, new_lens = [5, 40, 16, 33], [5, 3, 16, 1]
    (t,), num_pages, used = allocate(rng, [seq_lens], ps)
    before = np.zeros_like(used)
    for b, (n, new) in enumerate(zip(seq_lens, new_lens, strict=True)):
        for j, page in enumerate(t.indices[t.indptr[b]:t.indptr[b + 1]]):
            before[page, :max(0, min(ps, n - new - j * ps))] = True
    cache = paged_cache(rng, before, HKV, d, layout, dt, pair=pair)
    append_indptr = indptr_of(new_lens)
    nnz = int(append_indptr[-1])
    k_new, v_new = randn(rng, nnz, HKV, d, dtype=dt), randn(rng, nnz, HKV, d, dtype=dt)
    rbi, rpos = reference.get_batch_indices_positions(append_indptr, np.array(seq_lens), nnz)
    ref_cache = tuple(c.copy() for c in cache) if pair else cache.copy()
    reference.append_paged_kv_cache(k_new, v_new, rbi, rpos, ref_cache, t.indices, t.indptr,
                                    t.last, kv_layout=layout)
    bi, pos = nbinfer.get_batch_indices_positions(ctx.idx(append_indptr),
                                                  ctx.idx(seq_lens), nnz)
    dev_cache = ctx.dev(cache, dt)
    nbinfer.append_paged_kv_cache(ctx.dev(k_new, dt), ctx.dev(v_new, dt), bi, pos, dev_cache,
                                  ctx.idx(t.indices), ctx.idx(t.indptr), ctx.idx(t.last), layout,
                                  backend=ctx.backend)
    res = [("batch_indices", bi, rbi, EXACT), ("positions", pos, rpos, EXACT)]
    if pair:
        return res + [("k_cache", dev_cache[0], ref_cache[0], EXACT),
                      ("v_cache", dev_cache[1], ref_cache[1], EXACT)]
    return res + [("paged_kv_cache", dev_cache, ref_cache, EXACT)]


def merge_inputs(rng, shape, dt):
    """States with empty ones: LSE -inf on some (row, head)s, whose v is still finite."""
    v = randn(rng, *shape, dtype=dt)
    s = (3 * rng.standard_normal(shape[:-1])).astype(np.float32)
    s[rng.random(s.shape) < 0.15] = -np.inf
    return v, s


def merge_pair(ctx, rng):
    dt, shape = "float16", (37, HQ, 128)
    (va, sa), (vb, sb) = merge_inputs(rng, shape, dt), merge_inputs(rng, shape, dt)
    sa[5] = sb[5] = -np.inf  # a row empty in both: v = 0, s = -inf
    ref = reference.merge_state(va, sa, vb, sb)
    v, s = nbinfer.merge_state(ctx.dev(va, dt), ctx.f32(sa), ctx.dev(vb, dt), ctx.f32(sb),
                               backend=ctx.backend)
    return state(v, s, ref, dt)


def merge_in_place(ctx, rng):
    dt, shape = "float16", (37, HQ, 128)
    (va, sa), (vb, sb) = merge_inputs(rng, shape, dt), merge_inputs(rng, shape, dt)
    mask = rng.random(shape[0]) < 0.7
    ref_v, ref_s = va.astype(np.float64), sa.astype(np.float64)
    reference.merge_state_in_place(ref_v, ref_s, vb, sb, mask)
    v, s = ctx.dev(va, dt), ctx.f32(sa)
    nbinfer.merge_state_in_place(v, s, ctx.dev(vb, dt), ctx.f32(sb), ctx.flag(mask),
                                 backend=ctx.backend)
    return state(v, s, (ref_v, ref_s), dt)


def merge_stack(ctx, rng):
    dt, shape = "float16", (29, 5, HQ, 128)
    v, s = merge_inputs(rng, shape, dt)
    s[3] = -np.inf  # every state of row 3 empty
    ref = reference.merge_states(v, s, lse_base=2)
    out, lse = nbinfer.merge_states(ctx.dev(v, dt), ctx.f32(s), lse_base=2, backend=ctx.backend)
    return state(out, lse, ref, dt)


def layer_ops(ctx, rng):
    """The layer kernels on views of one fused projection output (rows strided): q and k
    rotated in place, the gate | up halves activated, the residual add + norm in place."""
    dt, n, d, hq, hk, hidden = "bfloat16", 37, 64, HQ, HKV, 320
    rot = 48  # partial rotary: the last 16 dimensions pass through
    qkv = randn(rng, n, (hq + 2 * hk) * d, dtype=dt)
    table = reference.layers.cos_sin_cache(1.0 / 1e4 ** (np.arange(0, rot, 2) / rot), 300)
    pos = rng.integers(0, 300, n)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
    ref_q, ref_k = reference.layers.apply_rope_with_cos_sin_cache(pos, q, k, d, table)
    dev = ctx.dev(qkv, dt)
    dq, dk = dev[:, :hq * d], dev[:, hq * d:(hq + hk) * d]
    nbinfer.apply_rope_with_cos_sin_cache_inplace(ctx.idx(pos), dq, dk, d, ctx.f32(table),
                                                  backend=ctx.backend)
    gu = randn(rng, n, 2 * hidden + 24, dtype=dt)
    act = nbinfer.silu_and_mul(ctx.dev(gu, dt)[:, :2 * hidden], backend=ctx.backend)
    x, r = randn(rng, n, hidden, dtype=dt), randn(rng, n, hidden, dtype=dt)
    w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    ref_n, ref_t = reference.layers.fused_add_rmsnorm(x, r, w, 1e-5)
    dx, dr = ctx.dev(x, dt), ctx.dev(r, dt)
    nbinfer.fused_add_rmsnorm(dx, dr, ctx.f32(w), 1e-5, backend=ctx.backend)
    return [("q", dq, ref_q, TOL[dt]), ("k", dk, ref_k, TOL[dt]),
            ("silu_and_mul", act, reference.layers.silu_and_mul(gu[:, :2 * hidden]), TOL[dt]),
            ("residual", dr, ref_t, TOL[dt]), ("normed", dx, ref_n, TOL[dt])]


# (name, kernel spec it compiles, function). Consecutive cases of one spec share its compile.
TC = "tensor-core prefill fp16 D128 NHD page 16"
CASES = [
    ("decode_plain_nhd", "decode fp16 D128 G4 page 16 NHD",
     lambda c, r: batch_decode(c, r, PLAIN_LENS, "NHD")),
    ("decode_split_nhd", "decode fp16 D128 G4 page 16 NHD",
     lambda c, r: batch_decode(c, r, SPLIT_LENS, "NHD")),
    ("decode_graph_nhd", "decode fp16 D128 G4 page 16 NHD", graph_decode),
    ("decode_deeper_ring", "decode fp16 D128 G4 page 16 NHD, 3 stages",
     lambda c, r: decode_with(c, r, SPLIT_LENS, "NHD", DECODE_STAGES=3)),
    ("decode_mma_split_nhd", "decode fp16 D128 G4 page 16 NHD, tensor cores",
     lambda c, r: decode_with(c, r, SPLIT_LENS, "NHD", DECODE_MMA=True)),
    ("decode_mma_fp8_hnd", "decode e4m3 D128 G4 page 16 HND, tensor cores",
     lambda c, r: decode_with(c, r, SPLIT_LENS, "HND", "float8_e4m3fn", DECODE_MMA=True)),
    ("decode_fp8_plain_nhd", "decode e5m2 D128 G4 page 16 NHD, CUDA cores",
     lambda c, r: decode_with(c, r, PLAIN_LENS, "NHD", "float8_e5m2", DECODE_MMA=False)),
    ("decode_plain_hnd", "decode fp16 D128 G4 page 16 HND",
     lambda c, r: batch_decode(c, r, PLAIN_LENS, "HND")),
    ("decode_split_hnd", "decode fp16 D128 G4 page 16 HND",
     lambda c, r: batch_decode(c, r, SPLIT_LENS, "HND")),
    ("single_decode", "decode fp16 D128 contiguous NHD", single_decode),
    ("prefill_paged_tc", TC,
     lambda c, r: paged_prefill(c, r, [1, 37, 70, 5], [100, 333, 17, 0], 128, "float16", "NHD")),
    ("cascade_fused", TC, lambda c, r: cascade(c, r, causal=False)),
    ("cascade_fused_d64", TC + " D64 (64-key tiles)",
     lambda c, r: cascade(c, r, causal=False, d=64)),
    ("cascade_levels_lean", "cascade level by level: lean prefill (overlap) + decode + merge",
     lambda c, r: cascade(c, r, causal=False, levels=True)),
    ("prefill_paged_tc_causal", TC + " causal",
     lambda c, r: paged_prefill(c, r, [1, 37, 70, 16], [100, 333, 70, 600], 128, "float16",
                                "NHD", causal=True)),
    ("cascade_causal", TC + " (+causal, merge_state_in_place)",
     lambda c, r: cascade(c, r, causal=True)),
    ("prefill_paged_tc_causal_nan_v", TC + " causal, NaN in a V that early rows leave out",
     lambda c, r: paged_prefill(c, r, [40, 16], [100, 70], 128, "float16", "NHD", causal=True,
                                nan_v=(0, 80))),
    ("prefill_paged_tc_mask", TC + " custom mask",
     lambda c, r: paged_prefill(c, r, [13, 40], [50, 170], 128, "float16", "NHD", mask=True)),
    ("prefill_ragged_tc_causal", "tensor-core prefill bf16 D64 ragged HND causal",
     lambda c, r: ragged_prefill(c, r, [50, 3, 17], [50, 400, 1000], 64, "bfloat16", "HND",
                                 causal=True)),
    ("single_prefill_tc_causal", "tensor-core prefill bf16 D64 ragged HND causal",
     lambda c, r: single_prefill(c, r, 45, 300, 64, "bfloat16", "HND", causal=True)),
    ("prefill_paged_lean_causal", "lean warpgroup prefill fp16 D128 NHD page 16 causal",
     lambda c, r: prefill_with(LEAN, paged_prefill, c, r, [1, 37, 170, 16], [100, 333, 170, 600],
                               128, "float16", "NHD", causal=True)),
    ("prefill_paged_lean_prefetch", "lean prefill, per-item overlap, fp16 D128 NHD page 16 causal",
     lambda c, r: prefill_with(LEAN_PF, paged_prefill, c, r, [1, 37, 170, 16],
                               [100, 333, 170, 600], 128, "float16", "NHD", causal=True)),
    ("prefill_ragged_lean_prefetch", "lean prefill, per-item overlap, bf16 D64 ragged HND causal",
     lambda c, r: prefill_with(LEAN_PF, ragged_prefill, c, r, [50, 3, 170], [50, 400, 1000], 64,
                               "bfloat16", "HND", causal=True)),
    ("prefill_paged_cc_causal", "CUDA-core prefill fp32 D128 HND page 16 causal",
     lambda c, r: paged_prefill(c, r, [9, 30], [40, 300], 128, "float32", "HND", causal=True)),
    ("prefill_ragged_cc_mask", "CUDA-core prefill fp16 D256 ragged NHD custom mask",
     lambda c, r: ragged_prefill(c, r, [7, 20], [33, 90], 256, "float16", "NHD", mask=True)),
    ("single_prefill_cc_mask", "CUDA-core prefill fp16 D256 ragged NHD custom mask",
     lambda c, r: single_prefill(c, r, 11, 60, 256, "float16", "NHD", mask=True)),
    ("bsr_16x16_causal", "block-sparse fp16 D128 C 16 causal",
     lambda c, r: block_sparse(c, r, 45, 70, 16, 16, causal=True)),
    ("bsr_1x16_causal", "block-sparse fp16 D128 C 16 causal",
     lambda c, r: block_sparse(c, r, 20, 50, 1, 16, causal=True)),
    ("bsr_16x1", "block-sparse fp16 D128 C 1",
     lambda c, r: block_sparse(c, r, 37, 23, 16, 1)),
    ("bsr_4x4_mask", "block-sparse fp16 D128 C 4 element mask",
     lambda c, r: block_sparse(c, r, 18, 27, 4, 4, mask=True, empty_row=1)),
    ("append_nhd", "append fp16 D128 page 16 NHD, one cache",
     lambda c, r: append(c, r, "NHD", False, "float16", 16, 128)),
    ("append_hnd_pair", "append bf16 D64 page 5 HND, (k, v) pair",
     lambda c, r: append(c, r, "HND", True, "bfloat16", 5, 64)),
    ("merge_state", "merge pair fp16 D128 base e", merge_pair),
    ("merge_state_in_place", "merge pair fp16 D128 base e", merge_in_place),
    ("merge_states", "merge stack fp16 D128 base 2", merge_stack),
    ("layer_ops", "RoPE (partial, in place), SiLU-and-multiply, fused add + RMSNorm, bf16",
     layer_ops),
]


# ---------------------------------------------------------------------------------------------
def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| over the finite entries of ``ref``; inf when the shapes differ, the
    NaN or inf entries differ, or ``out`` is not finite where ``ref`` is."""
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape:
        return math.inf
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isnan(out), np.isnan(ref)):
        return math.inf
    special = ~fin & ~np.isnan(ref)
    if not np.array_equal(out[special], ref[special]) or not np.all(np.isfinite(out[fin])):
        return math.inf
    num = float(np.linalg.norm(out[fin] - ref[fin]))
    den = float(np.linalg.norm(ref[fin]))
    return num / den if den > 0 else num


def run_case(ctx, name, fn, seed) -> bool:
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    t0 = time.perf_counter()
    try:
        checks = fn(ctx, rng)
        ctx.sync()
        errs = [(what, rel_err(ctx.host(res), ref), tol) for what, res, ref, tol in checks]
    except Exception as exc:  # one line per case, whatever went wrong
        print(f"{name:<26} {'-':>10}  ERROR  {type(exc).__name__}: {exc}", flush=True)
        return False
    worst = max(e for _, e, _ in errs)
    bad = [f"{what} {e:.2e} > {tol:.0e}" for what, e, tol in errs if not e <= tol]
    verdict = "ok" if not bad else "WRONG (" + "; ".join(bad) + ")"
    print(f"{name:<26} {worst:>10.2e}  {verdict}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return not bad


def plant_oob() -> int:
    """The control: a kernel compiled with an explicit signature reads ``a[i + n]`` from an array
    of ``n`` elements (numba does no bounds checks on the GPU). memcheck must report it."""
    @cuda.jit("void(float32[::1], float32[::1], int32)")
    def read_past_end(a, out, n):
        i = cuda.grid(1)
        if i < n:
            out[i] = a[i + n]

    n = 1000  # 4000 bytes: not a multiple of the allocation granularity
    out = cuda.device_array(n, dtype=np.float32)
    a = cuda.to_device(np.arange(n, dtype=np.float32))  # allocated last: nothing right after it
    try:
        read_past_end[(n + 127) // 128, 128](a, out, np.int32(n))
        cuda.synchronize()
        out.copy_to_host()
        print("plant-oob: launched a read of a[n:2n] from an array of n elements; no fault raised "
              "(expected without a sanitizer)", flush=True)
    except Exception as exc:  # under memcheck the launch fails: the point
        print(f"plant-oob: the out-of-bounds launch failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated case names or fnmatch patterns")
    ap.add_argument("--dry", action="store_true",
                    help="no GPU: NumPy inputs, public API with backend='reference'")
    ap.add_argument("--plant-oob", action="store_true",
                    help="instead of the cases, one deliberate out-of-bounds read (the control)")
    ap.add_argument("--list", action="store_true", help="print the cases and their kernel specs")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.plant_oob:
        return plant_oob()
    cases = CASES
    if args.only:
        pats = [p.strip() for p in args.only.split(",") if p.strip()]
        cases = [c for c in CASES if any(fnmatch.fnmatchcase(c[0], p) for p in pats)]
        if not cases:
            print(f"no case matches --only {args.only!r}; cases: {', '.join(c[0] for c in CASES)}")
            return 2
    if args.list:
        for name, spec, _ in cases:
            print(f"{name:<26} {spec}")
        print(f"{len(cases)} cases, {len({s for _, s, _ in cases})} spec groups")
        return 0
    ctx = Ctx(args.dry)
    mode = "dry (NumPy, backend='reference')" if args.dry else "torch CUDA tensors, backend='cuda'"
    print(f"memcheck.py: {len(cases)} cases, {mode}, seed {args.seed}", flush=True)
    print(f"{'case':<26} {'max rel err':>10}  verdict", flush=True)
    t0 = time.perf_counter()
    ok = sum(run_case(ctx, name, fn, args.seed) for name, _, fn in cases)
    print(f"memcheck.py: {len(cases)} cases, {ok} ok, {len(cases) - ok} wrong "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0 if ok == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
