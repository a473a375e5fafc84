"""FlashInfer's ``MultiLevelCascadeAttentionWrapper``: shared-prefix levels merged exactly.

Each level is a paged prefill over the same physical pages (its own query segmentation and page
table: indices only, no KV copied). A shared prefix's tile serves every query of its segment
(rows = queries x GQA group), which is where cascade saves HBM traffic: the prefix is read once
per KV head and query tile, not once per request.

By default all levels run as **one launch** (:func:`nbinfer.scheduler.cascade_plan`): every
(level, segment) is a virtual request of one prefill plan, the levels' page tables are
concatenated, and each output row's states from every level and KV chunk are merged by the
kernel's fused merge, in level order. Where that cannot express the masks (``causal`` with a
last level of more than one row per segment, whose mask depends on positions inside the level),
the levels run one after another with ``return_lse`` and are merged by ``merge_state_in_place``.

Positions inside a level are relative to the level, so the wrapper accepts only the flags whose
result does not depend on absolute positions: ``causal`` (applied to the last level, where the
relative and absolute masks coincide), ``logits_soft_cap`` and ``sm_scale``. RoPE, ALiBi and
sliding windows across levels raise an error (the reference engine,
:func:`nbinfer.reference.multi_level_cascade_attention`, handles them).
"""

from __future__ import annotations

import math

import numpy as np

from .. import reference
from .._checks import KV_LAYOUTS, check_choice, check_heads, check_positive_int, check_sm_scale
from ..reference.cascade import _check_levels
from ..scheduler.cascade import cascade_plan
from ..variants import from_flashinfer_args
from . import arrays, binding
from .decode import MIN_CHUNK
from .dtypes import normalize_dtype
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .state import merge_state_in_place

__all__ = ["MultiLevelCascadeAttentionWrapper"]


class MultiLevelCascadeAttentionWrapper:
    """Attention over KV split into shared-prefix levels.

    Parameters
    ----------
    num_levels : int
    float_workspace_buffer : array on the device that runs the kernels (split between levels)
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "cuda", "sim", "reference"}
    """

    def __init__(self, num_levels: int, float_workspace_buffer, kv_layout: str = "NHD", *,
                 backend: str = "auto"):
        self._levels = check_positive_int("num_levels", num_levels)
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        self._backend = arrays.resolve_backend(backend)
        nbytes = binding.nbytes(float_workspace_buffer)
        share = nbytes // self._levels // 256 * 256
        self._kv_layout = kv_layout
        self._wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(_byte_slice(float_workspace_buffer, i * share,
                                                            (i + 1) * share), kv_layout,
                                                backend=self._backend)
            for i in range(self._levels)]
        self._fused = _FusedCascade(float_workspace_buffer, kv_layout, backend=self._backend)
        self._plan = None

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
             paged_kv_last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, causal: bool = False, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None) -> None:
        """One list entry per level (``num_levels`` of them): ``qo_indptr_arr[l]`` segments the
        query rows (each level a coarsening of the next), and level ``l``'s page table gives one
        entry per segment. ``causal`` masks inside the last level only."""
        if pos_encoding_mode != "NONE" or window_left != -1:
            raise ValueError("MultiLevelCascadeAttentionWrapper supports position-independent "
                             "flags only (pos_encoding_mode='NONE', window_left=-1); positions "
                             "across levels are in nbinfer.reference.multi_level_cascade_attention")
        tables = [paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len]
        if isinstance(qo_indptr_arr, (list, tuple)) and len(qo_indptr_arr) != self._levels:
            raise ValueError(f"qo_indptr_arr must have num_levels={self._levels} entries, got "
                             f"{len(qo_indptr_arr)}")
        qo = [arrays.host_int32(p, f"qo_indptr_arr[{i}]") for i, p in enumerate(qo_indptr_arr)]
        host = [[arrays.host_int32(a, "page table") for a in t] if isinstance(t, (list, tuple))
                else t for t in tables]
        nnz = int(qo[-1][-1]) if qo and qo[-1].size else 0
        _check_levels(nnz, qo, *host)
        fused = self._backend != "reference" and (
            not causal or int(np.diff(qo[-1]).max(initial=0)) <= 1)
        self._plan = None
        if fused:  # one launch; a single query row per last-level segment sees every key
            self._fused.plan_levels(qo, host, num_qo_heads, num_kv_heads, head_dim, page_size,
                                    logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                                    q_data_type=q_data_type, kv_data_type=kv_data_type)
        for lvl, w in enumerate([] if fused else self._wrappers):
            w.plan(qo[lvl], host[0][lvl], host[1][lvl], host[2][lvl], num_qo_heads, num_kv_heads,
                   head_dim, page_size, causal=causal and lvl == self._levels - 1,
                   logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                   q_data_type=q_data_type, kv_data_type=kv_data_type)
        self._plan = dict(qo=qo, tables=host, causal=causal, logits_soft_cap=logits_soft_cap,
                          sm_scale=sm_scale, fused=fused)

    def run(self, q, paged_kv_cache, *, return_lse: bool = False):
        """``q [nnz_qo, Hq, D]``; ``paged_kv_cache`` as in decode. Returns ``out`` (q's kind and
        dtype) and, with ``return_lse``, the LSE over all levels (natural log)."""
        p = self._plan
        if p is None:
            raise RuntimeError("run() called before plan()")
        if self._backend == "reference":
            cache = paged_kv_cache
            cache = tuple(arrays.to_host(c) for c in cache) if isinstance(cache, (tuple, list)) else \
                arrays.to_host(cache)
            return reference.multi_level_cascade_attention(
                arrays.to_host(q), p["qo"], cache, *p["tables"], causal=p["causal"],
                kv_layout=self._kv_layout, logits_soft_cap=p["logits_soft_cap"],
                sm_scale=p["sm_scale"], return_lse=return_lse)
        if p["fused"]:
            return self._fused.run(q, paged_kv_cache, return_lse=return_lse)
        out, lse = self._wrappers[0].run(q, paged_kv_cache, return_lse=True)
        for w in self._wrappers[1:]:
            o_l, s_l = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, o_l, s_l, lse_base=math.e, backend=self._backend)
        return (out, lse) if return_lse else out


class _FusedCascade(BatchPrefillWithPagedKVCacheWrapper):
    """All levels of a cascade as one paged-prefill launch (virtual requests, one merge map)."""

    def plan_levels(self, qo, tables, num_qo_heads, num_kv_heads, head_dim, page_size, *,
                    logits_soft_cap, sm_scale, q_data_type, kv_data_type, **schedule):
        """``qo``: per-level query indptrs (validated); ``tables``: ``[indptrs, indices,
        last_page_lens]``, one array per level each; ``schedule``: ``fixed_split_size``,
        ``alpha``, ``beta`` for :func:`~nbinfer.scheduler.cascade_plan` (benchmarks sweep them;
        FlashInfer's plan() has no such arguments)."""
        group = check_heads(num_qo_heads, num_kv_heads)
        indptrs, kv_lens, indices, lasts, offset = [], [], [], [], 0
        for lvl in range(len(qo)):
            ptr, idx, last, lens = binding.page_table(
                tables[0][lvl], tables[1][lvl], tables[2][lvl], page_size,
                names=(f"paged_kv_indptr_arr[{lvl}]", f"paged_kv_indices_arr[{lvl}]",
                       f"paged_kv_last_page_len[{lvl}]"))
            indptrs.append(ptr[:-1] + offset)
            offset += int(ptr[-1])
            indices.append(idx)
            lasts.append(last)
            kv_lens.append(lens)
        table = (np.append(np.concatenate(indptrs), offset).astype(np.int32),
                 np.concatenate(indices).astype(np.int32), np.concatenate(lasts).astype(np.int32))
        nnz = int(qo[0][-1])
        batch = table[2].size
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        p = dict(qo_indptr=np.array([0, nnz], np.int32), kv_lens=np.concatenate(kv_lens),
                 table=table, batch=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, page_size=page_size, q_dtype=q_dtype,
                 kv_dtype=normalize_dtype("kv_data_type", kv_data_type or q_data_type),
                 sm_scale=check_sm_scale(sm_scale, head_dim),
                 variant=from_flashinfer_args(logits_soft_cap=logits_soft_cap,
                                              num_qo_heads=num_qo_heads),
                 masks=[None] * batch, custom=False, q_pos0=None)
        spec, kernel, threads, num_ctas = self._kernel(p, group)
        sched, qo_start, qo_end, _ = cascade_plan(qo, kv_lens, num_qo_heads, num_kv_heads,
                                                  num_ctas, granule=MIN_CHUNK,
                                                  tile_q=spec.tile_q, **schedule)
        p.update(self._upload(p, spec, kernel, threads, sched, qo_start, qo_end))
        self._plan = p


def _byte_slice(buf, lo: int, hi: int):
    """Bytes ``[lo, hi)`` of a workspace buffer of any kind, as a view of the same kind."""
    if arrays.array_kind(buf) == "torch":
        import torch

        return buf.reshape(-1).view(torch.uint8)[lo:hi]
    return buf.reshape(-1).view(np.uint8)[lo:hi]
