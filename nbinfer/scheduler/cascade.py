"""``cascade_plan()``: the levels of a composable (cascade) format scheduled as one launch.

A cascade splits each query row's KV into levels: a shared prefix (level 0, one segment serving
many rows) and each request's own tokens (the last level), every level a BSR over the same pages.
Planned level by level, the levels would run as separate launches joined by a merge launch. Here
the levels become one batch of *virtual requests* ``(level, segment)`` whose query ranges
overlap: :func:`.planner.plan` splits and LPT-assigns all their chunks together, and the
reduction map is rebuilt over the *real* output rows, so each row's states from every level (and
every KV chunk of a level) are merged by the fused merge of the same launch, in a fixed order
(level, then KV start): bitwise reproducible, no second kernel.

Every item writes a partial state (a row is never complete after one level), so the map has one
list per covered output row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._checks import as_index_array, check_indptr
from .planner import plan as plan_batch

__all__ = ["cascade_plan"]


def cascade_plan(qo_indptr_levels, kv_lens_levels, num_qo_heads: int, num_kv_heads: int,
                 num_ctas: int, *, granule: int = 16, tile_q: int | None = None,
                 fixed_split_size: int | None = None, alpha: float = 1.0, beta: float = 1.0,
                 item_overhead: int = 0, compiled: bool = False, trusted: bool = False):
    """Schedule all levels of a cascade as one plan.

    Parameters
    ----------
    qo_indptr_levels : list of int arrays
        Level ``l`` segments the query rows by ``qo_indptr_levels[l]`` (``[n_l + 1]``, all ending
        at the same row count).
    kv_lens_levels : list of int arrays
        KV tokens of each segment of each level (``[n_l]``).
    num_qo_heads, num_kv_heads, num_ctas : int
    granule, tile_q, fixed_split_size, alpha, beta, item_overhead : optional
        As :func:`nbinfer.scheduler.plan` (chunking and the LPT cost model, over all levels).
    compiled : bool, optional
        Schedule with the compiled loops (:mod:`nbinfer.scheduler.compiled`: the same plan,
        ~20x less host time on a serving step; the wrappers ask for them from their second
        plan on). False: the NumPy definition below.
    trusted : bool, optional
        The arrays are already checked (int arrays that agree with each other: the cascade
        wrapper's plan() validates them under its own argument names): skip the checks.

    Returns
    -------
    plan : Plan
        ``work[:, 0]`` indexes the virtual requests (level-major), every ``partial_row >= 0``,
        ``merge_rows`` are real output rows.
    qo_start, qo_end : int32 arrays [V]
        Real query rows ``qo_start[v]:qo_end[v]`` of virtual request ``v``.
    level : int32 array [V]
        Level of each virtual request.
    """
    if trusted:
        ptrs, kvs = qo_indptr_levels, kv_lens_levels
    else:
        ptrs, kvs = _check(qo_indptr_levels, kv_lens_levels)
    if compiled:
        from . import compiled as loops

        loops.load()
        kv = kvs[0].astype(np.int64) if len(kvs) == 1 else np.concatenate(kvs).astype(np.int64)
        got = loops.cascade_compiled(ptrs, kv, num_qo_heads, num_kv_heads, num_ctas,
                                     granule=granule, tile_q=tile_q,
                                     fixed_split_size=fixed_split_size, alpha=alpha, beta=beta,
                                     item_overhead=item_overhead)
        if got is not None:
            return got[:4]
        # (counts past int32 or huge cost keys: the definition below, as plan() does)
    qo_start = np.concatenate([p[:-1] for p in ptrs]).astype(np.int64)
    qo_end = np.concatenate([p[1:] for p in ptrs]).astype(np.int64)
    level = np.concatenate([np.full(p.size - 1, i) for i, p in enumerate(ptrs)])
    kv = np.concatenate(kvs).astype(np.int64)
    virt = np.zeros(qo_start.size + 1, dtype=np.int64)
    np.cumsum(qo_end - qo_start, out=virt[1:])
    base = plan_batch(virt, kv, num_qo_heads, num_kv_heads, num_ctas, granule=granule,
                      tile_q=tile_q, fixed_split_size=fixed_split_size, alpha=alpha, beta=beta,
                      item_overhead=item_overhead)

    # One entry per chunk (heads are innermost in the work table and share partial rows).
    hkv = int(num_kv_heads)
    w = base.work.astype(np.int64)
    chunks = w[::hkv]
    req, qs, qe, ks, prow = chunks[:, 0], chunks[:, 2], chunks[:, 3], chunks[:, 4], chunks[:, 6]
    rows = qe - qs
    # Chunks that wrote their rows directly get partial rows after the planner's own.
    direct = prow < 0
    extra = np.zeros(direct.sum() + 1, dtype=np.int64)
    np.cumsum(rows[direct], out=extra[1:])
    prow = prow.copy()
    prow[direct] = base.num_partials + extra[:-1]
    num_partials = base.num_partials + int(extra[-1])

    # Reduction map over real rows: every (chunk, row) is one entry, sorted by
    # (real row, level, kv start).
    ent_chunk = np.repeat(np.arange(chunks.shape[0]), rows)
    ent_r = np.arange(ent_chunk.size) - np.repeat(np.cumsum(rows) - rows, rows)
    real = qo_start[req[ent_chunk]] + qs[ent_chunk] + ent_r
    order = np.lexsort((ks[ent_chunk], level[req[ent_chunk]], real))
    real_sorted = real[order]
    merge_rows, counts = np.unique(real_sorted, return_counts=True)
    merge_indptr = np.zeros(merge_rows.size + 1, dtype=np.int64)
    np.cumsum(counts, out=merge_indptr[1:])
    merge_indices = (prow[ent_chunk] + ent_r)[order]

    work = base.work.copy()  # the base plan's arrays are frozen
    work[:, 6] = np.repeat(prow, hkv)
    i32 = np.int32
    plan = dataclasses.replace(
        base, work=work, merge_rows=merge_rows.astype(i32),
        merge_indptr=merge_indptr.astype(i32), merge_indices=merge_indices.astype(i32),
        num_partials=num_partials, num_qo_rows=int(ptrs[0][-1]))
    return plan, qo_start.astype(i32), qo_end.astype(i32), level.astype(i32)


def _check(qo_indptr_levels, kv_lens_levels) -> tuple[list, list]:
    """:func:`cascade_plan`'s arguments checked: ``(qo indptrs, kv lengths)``, int arrays."""
    if not isinstance(qo_indptr_levels, (list, tuple)) or not qo_indptr_levels:
        raise ValueError("qo_indptr_levels must be a non-empty list of arrays")
    if not isinstance(kv_lens_levels, (list, tuple)) or len(kv_lens_levels) != len(
            qo_indptr_levels):
        raise ValueError(f"kv_lens_levels must be a list of {len(qo_indptr_levels)} arrays (one "
                         f"per level)")
    ptrs = [check_indptr(f"qo_indptr_levels[{i}]", p) for i, p in enumerate(qo_indptr_levels)]
    kvs = [as_index_array(f"kv_lens_levels[{i}]", k) for i, k in enumerate(kv_lens_levels)]
    for i, (p, k) in enumerate(zip(ptrs, kvs, strict=True)):
        if k.size != p.size - 1:
            raise ValueError(f"kv_lens_levels[{i}] must have {p.size - 1} entries, got {k.size}")
        if p[-1] != ptrs[0][-1]:
            raise ValueError(f"qo_indptr_levels[{i}] ends at {int(p[-1])}, level 0 at "
                             f"{int(ptrs[0][-1])}: every level covers the same rows")
    return ptrs, kvs
