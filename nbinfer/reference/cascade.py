"""Multi-level cascade attention (FlashInfer's MultiLevelCascadeAttentionWrapper), reference form.

Cascade attention splits each query's key sequence into levels: level 0 is typically a prefix
shared by every request (one qo segment covering all queries), deeper levels are shared by fewer
queries, and the last level holds each request's own tokens. Level ``l`` partitions the query
rows into segments by ``qo_indptr_arr[l]``; segment ``s`` attends to the pages of entry ``s`` of
that level's page table. A query's per-level states are combined with the merge operator, which
is exact because the levels' key sets are disjoint pieces of one concatenated sequence.

Positions follow the concatenation: keys of level ``l`` start after the query's keys in levels
``< l``, and the query sits at ``total_kv_len - qo_len + i`` where ``qo_len`` and ``i`` refer to
its last-level segment. ``causal`` masks only within the last level; earlier levels are prefixes
that every query of the segment sees in full. Other masks (e.g. ``window_left``) and positional
encodings see the concatenated positions.
"""

from __future__ import annotations

import math

import numpy as np

from ._batch import check_qo_indptr, epilogue, paged_requests, run_requests
from ._common import build_variant
from .merge import merge_state
from .paged import _prepare_paged, check_page_table

__all__ = ["multi_level_cascade_attention"]


# The names of MultiLevelCascadeAttentionWrapper.plan()'s arguments (FlashInfer's), which are the
# names errors use: the api's plan() and the reference entry point both call _check_levels.
LEVEL_NAMES = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr",
               "paged_kv_last_page_len")


def _check_levels(nnz, qo_indptr_arr, indptr_arr, indices_arr, last_arr):
    """Check that the per-level lists agree with each other; return ``(levels, qo_ptrs)``.

    Every list holds one entry per level; each ``qo_indptr_arr[l]`` ends at ``nnz`` (the query
    rows) and coarsens ``qo_indptr_arr[l + 1]``; level ``l``'s page table has one request per qo
    segment (``len(paged_kv_indptr_arr[l]) == len(qo_indptr_arr[l])`` and as many
    ``paged_kv_last_page_len[l]`` entries as segments). The page tables' values are checked by
    the caller (it knows the pool). Errors name the plan() arguments, e.g.
    ``paged_kv_last_page_len[1]``.
    """
    lists = (qo_indptr_arr, indptr_arr, indices_arr, last_arr)
    for name, lst in zip(LEVEL_NAMES, lists, strict=True):
        if not isinstance(lst, (list, tuple)):
            raise TypeError(f"{name} must be a list with one array per level, "
                            f"got {type(lst).__name__}")
    levels = len(qo_indptr_arr)
    if levels == 0:
        raise ValueError("qo_indptr_arr must hold at least one level, got an empty list")
    for name, lst in zip(LEVEL_NAMES[1:], lists[1:], strict=True):
        if len(lst) != levels:
            raise ValueError(f"{name} must have one entry per level ({levels}, the length of "
                             f"qo_indptr_arr), got {len(lst)}")
    qo_ptrs = [check_qo_indptr(p, nnz, name=f"qo_indptr_arr[{lvl}]")
               for lvl, p in enumerate(qo_indptr_arr)]
    for lvl in range(levels - 1):
        # every boundary of this level among the next level's (both sorted: a binary search
        # each, which a serving step's plan() pays per level instead of a set difference)
        here, below = qo_ptrs[lvl], qo_ptrs[lvl + 1]
        at = np.minimum(np.searchsorted(below, here), below.size - 1)
        missing = here[below[at] != here]
        if missing.size:
            raise ValueError(
                f"qo_indptr_arr[{lvl}] must be a coarsening of qo_indptr_arr[{lvl + 1}] (every "
                f"segment boundary of a level is a boundary of the next level), but boundary "
                f"{int(missing[0])} of level {lvl} is missing from level {lvl + 1}")
    for lvl, ptr in enumerate(qo_ptrs):
        segments = ptr.size - 1
        for name, arr, want in ((LEVEL_NAMES[1], indptr_arr[lvl], segments + 1),
                                (LEVEL_NAMES[3], last_arr[lvl], segments)):
            if np.ndim(arr) != 1 or np.size(arr) != want:
                raise ValueError(
                    f"{name}[{lvl}] must have length {want} (one request per qo segment of level "
                    f"{lvl}: len(qo_indptr_arr[{lvl}]) = {ptr.size}), got shape {np.shape(arr)}")
    return levels, qo_ptrs


def _level_names(lvl: int) -> tuple:
    """Error names of level ``lvl``'s page table: ``paged_kv_indptr_arr[lvl]`` ..."""
    return tuple(f"{name}[{lvl}]" for name in LEVEL_NAMES[1:])


def _segment_of_rows(qo_ptr: np.ndarray, nnz: int) -> np.ndarray:
    # The last segment starting at or before each row: with empty segments (repeated boundaries)
    # this is the non-empty one that contains the row.
    return np.searchsorted(qo_ptr, np.arange(nnz), side="right") - 1


def multi_level_cascade_attention(q, qo_indptr_arr, paged_kv_cache, paged_kv_indptr_arr,
                                  paged_kv_indices_arr, paged_kv_last_page_len, *,
                                  causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                  window_left=-1, logits_soft_cap=None, sm_scale=None,
                                  rope_scale=None, rope_theta=None, variant=None,
                                  return_lse=False, lse_base=math.e):
    """Attention over KV split into levels of shared prefixes, merged per query.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [nnz_qo, num_qo_heads, head_dim]
    qo_indptr_arr : list of arrays of int32, one ``[B_l + 1]`` per level
        Query segments of each level; each ends at ``nnz_qo``, and every boundary of level ``l``
        is also a boundary of level ``l + 1``.
    paged_kv_cache : ndarray or (ndarray, ndarray)
        The one cache all levels read (see :func:`~nbinfer.reference.paged.split_paged_kv_cache`).
    paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len : lists of arrays
        One page table per level, with ``B_l`` requests (one per qo segment). The names are those
        of FlashInfer's ``MultiLevelCascadeAttentionWrapper.plan()``, which errors use.
    causal : bool
        Bottom-right aligned causal mask inside the last level only.
    kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
    variant, return_lse, lse_base
        As in :func:`~nbinfer.reference.prefill.single_prefill_with_kv_cache`.

    Returns
    -------
    o : ndarray, float64, shape [nnz_qo, num_qo_heads, head_dim]
    lse : ndarray, float64, shape [nnz_qo, num_qo_heads]
        LSE over all levels' keys; only with ``return_lse``.
    """
    lse_base, q, k_cache, v_cache, num_pages, page_size, d, scale = _prepare_paged(
        q, paged_kv_cache, kv_layout, sm_scale, lse_base)
    nnz, hq, _ = q.shape
    levels, qo_ptrs = _check_levels(nnz, qo_indptr_arr, paged_kv_indptr_arr,
                                    paged_kv_indices_arr, paged_kv_last_page_len)
    lens, get_kvs = [], []  # per level: kv length and KV getter of each request (qo segment)
    for lvl in range(levels):
        table = check_page_table(paged_kv_indptr_arr[lvl], paged_kv_indices_arr[lvl],
                                 paged_kv_last_page_len[lvl], num_pages, page_size,
                                 names=_level_names(lvl))
        kv_lens, get_kv = paged_requests(k_cache, v_cache, table, page_size)
        lens.append(kv_lens)
        get_kvs.append(get_kv)

    flags = dict(num_qo_heads=hq, window_left=window_left, logits_soft_cap=logits_soft_cap,
                 pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                 rope_theta=rope_theta, variant=variant)
    prefix_var = build_variant(causal=False, **flags)
    last_var = build_variant(causal=causal, **flags)

    # Per query row: kv length of each level it reads, its keys' offset per level, its position.
    seg = [_segment_of_rows(p, nnz) for p in qo_ptrs]
    row_len = np.stack([lens[lvl][seg[lvl]] for lvl in range(levels)])  # [levels, nnz]
    offset = np.cumsum(row_len, axis=0) - row_len
    last_ptr = qo_ptrs[-1]
    qo_len_last = (last_ptr[1:] - last_ptr[:-1])[seg[-1]]
    within = np.arange(nnz) - last_ptr[seg[-1]]
    q_pos = row_len.sum(axis=0) - qo_len_last + within

    o = np.zeros((nnz, hq, d))
    lse = np.full((nnz, hq), -np.inf)
    for lvl in range(levels):
        var = last_var if lvl == levels - 1 else prefix_var
        o_l, lse_l = run_requests(q, qo_ptrs[lvl], get_kvs[lvl], var, scale, q_pos=q_pos,
                                  kv_start=offset[lvl])
        if not last_var.use_softmax:
            o, lse = o + o_l, lse_l  # without softmax, states add and carry no LSE
        elif lvl == 0:
            o, lse = o_l, lse_l
        else:
            o, lse = merge_state(o, lse, o_l, lse_l)
    return epilogue(o, lse, last_var, return_lse, lse_base)
