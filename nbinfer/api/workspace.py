"""Where a step's plan and partial states live: the wrapper's own plan memory and the caller's
workspace buffer.

Each wrapper owns its plan memory (as FlashInfer keeps a per-wrapper int workspace), an int32
device array::

    [plan (PlanLayout) | item_merge | counters | kv_indptr | kv_indices | last_page_len
     | qo_indptr | mask_indptr | mask_words | q_pos0 | qo_end]

and the caller's ``float_workspace_buffer`` holds only scratch, from its start::

    float32 [tmp_o: partials x Hq x D | tmp_lse: partials x Hq]

Partial states live for one launch (written and merged inside it), so any number of wrappers may
share one float workspace as long as their launches are ordered (one stream), while no wrapper
can read another's plan. ``plan()`` fills the int32 words on the host (a staging array) and
copies them to the device in one transfer on the caller's stream, so a step costs one H2D copy
however many layers reuse it. The counters (one per merge list and KV head) must be zero before
a launch; the staging copy writes zeros and every launch leaves them zero again. The page-table
sections are empty when the caller provides its own buffers (CUDA-graph mode).

With fixed capacities (a CUDA graph), every offset is the same for every step: the graph's kernel
arguments stay valid and only the bytes they point to change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..kernels.common import VALUE_SCAN_SPLITS
from ..scheduler import Plan, PlanLayout, compiled
from ..scheduler.compiled import pack_compiled, section_offsets, word_offsets
from ..scheduler.layout import STEP_FIELDS_AT

__all__ = ["WorkspaceLayout", "item_merge_lists"]


def _align4(n: int) -> int:
    return -(-int(n) // 4) * 4


@dataclass(frozen=True)
class WorkspaceLayout:
    """Capacities and offsets (int32 words, then float32 elements) of one workspace layout."""

    plan: PlanLayout
    num_kv_heads: int
    num_qo_heads: int
    head_dim: int
    max_batch: int
    max_pages: int
    max_mask_words: int = 0

    @functools.cached_property
    def words(self) -> dict[str, int]:
        """Word offsets of the int32 sections and ``"end"`` (16-byte aligned)."""
        sizes = (("plan", self.plan.size), ("item_merge", self.plan.max_work),
                 ("counters", self.plan.max_merge_rows * self.num_kv_heads),
                 ("kv_indptr", self.max_batch + 1), ("kv_indices", self.max_pages),
                 ("kv_last_page_len", self.max_batch), ("qo_indptr", self.max_batch + 1),
                 ("mask_indptr", self.max_batch + 1), ("mask_words", self.max_mask_words),
                 ("q_pos0", self.max_batch), ("qo_end", self.max_batch),
                 ("value_flags", self.max_batch * self.num_kv_heads * VALUE_SCAN_SPLITS))
        out, pos = {}, 0
        for name, n in sizes:
            out[name] = pos
            pos += _align4(max(n, 1))
        out["end"] = pos
        return out

    @functools.lru_cache(maxsize=16)  # noqa: B019 - layouts are few, frozen and hashable
    def pack_args(self, num_qo_heads: int, num_kv_heads: int, granule: int,
                  fixed_split_size: int | None) -> tuple:
        """What :func:`nbinfer.scheduler.compiled.check_and_plan` needs (after ``out``) to pack
        a decode step (alpha = beta = 1, not causal) with this layout in its compiled call:
        ``(caps, plan offsets, header template, step-field positions, item_merge offset,
        page-table offsets)``, as :meth:`stage` would lay them out."""
        p, w = self.plan, self.words
        caps = word_offsets(p.max_work, p.max_merge_rows, p.max_merge_nnz, self.max_batch,
                            self.max_pages, p.size, w["kv_indptr"])
        head = p.header_template(num_qo_heads, num_kv_heads, granule, False, fixed_split_size,
                                 1.0, 1.0)
        return (caps, section_offsets(p), head, STEP_FIELDS_AT, w["item_merge"],
                word_offsets(*self.table_offsets))

    @property
    def table_offsets(self) -> tuple[int, int, int]:
        """Word offsets of ``kv_indptr``, ``kv_indices`` and ``kv_last_page_len``."""
        w = self.words
        return w["kv_indptr"], w["kv_indices"], w["kv_last_page_len"]

    @functools.cached_property
    def plan_offsets(self) -> dict[str, int]:
        """Word offsets of the plan's sections inside the plan (:meth:`PlanLayout.offsets`)."""
        return self.plan.offsets()

    @property
    def partial_elems(self) -> tuple[int, int]:
        """(tmp_o, tmp_lse) float32 element counts: every partial row holds all Hq heads."""
        rows = self.plan.max_merge_nnz
        return rows * self.num_qo_heads * self.head_dim, rows * self.num_qo_heads

    @property
    def nbytes(self) -> int:
        """Bytes of the float workspace this layout needs (partial states)."""
        o, s = self.partial_elems
        return 4 * (_align4(max(o, 1)) + max(s, 1))

    def float_offsets(self) -> tuple[int, int]:
        """float32 element offsets of tmp_o and tmp_lse in the float workspace."""
        o, _ = self.partial_elems
        return 0, _align4(max(o, 1))

    def fits(self, plan: Plan, batch: int, pages: int) -> bool:
        return self.plan.fits(plan) and batch <= self.max_batch and pages <= self.max_pages

    def stage(self, plan: Plan, item_merge: np.ndarray, page_table=None,
              out: np.ndarray | None = None, *, compiled: bool = False,
              **sections) -> np.ndarray:
        """The int32 part of the workspace for ``plan`` (counters zero), ready to copy.

        ``page_table`` is ``(kv_indptr, kv_indices, kv_last_page_len)`` (omitted when the caller
        owns those buffers); ``sections`` may give ``qo_indptr``, ``mask_indptr``,
        ``mask_words``, ``q_pos0`` and ``qo_end`` (int32 arrays). ``compiled``: pack with
        :func:`nbinfer.scheduler.compiled.pack_compiled` (the same words in one call).
        """
        w = self.words
        buf = np.zeros(w["end"], dtype=np.int32) if out is None else out
        # plan, then zeros over item_merge and counters (every launch expects zero counters)
        if compiled and not sections and (page_table is None or all(
                a.dtype == np.int32 for a in page_table)):
            # all in one compiled pass (decode's step: no other section)
            pack_compiled(self.plan, plan, buf, zero_end=w["kv_indptr"], item_merge=item_merge,
                          item_merge_offset=w["item_merge"], page_table=page_table,
                          table_offsets=self.table_offsets)
            return buf
        if compiled:
            pack_compiled(self.plan, plan, buf, zero_end=w["kv_indptr"], item_merge=item_merge,
                          item_merge_offset=w["item_merge"])
        else:
            self.plan.pack(plan, out=buf[:self.plan.size])
            buf[w["item_merge"]:w["kv_indptr"]] = 0
            buf[w["item_merge"]:w["item_merge"] + item_merge.size] = item_merge
        if page_table is not None:
            sections.update(zip(("kv_indptr", "kv_indices", "kv_last_page_len"), page_table,
                                strict=True))
        for name, arr in sections.items():
            if arr is not None:
                buf[w[name]:w[name] + arr.size] = arr.view(np.int32) if arr.dtype.itemsize == 4 \
                    else arr
        return buf


def item_merge_lists(plan: Plan) -> np.ndarray:
    """For every work item, the merge list its partial rows belong to (-1: direct write).

    Decode items cover one query row, so an item's partial row lies in exactly one list (an
    item of several rows: the list of its first). Once the compiled planner is loaded, one
    compiled pass (:func:`~nbinfer.scheduler.compiled.item_merge_compiled`, the same lists).
    """
    if compiled.loaded():
        return compiled.item_merge_compiled(plan)
    prow = plan.work[:, 6]
    owner = np.full(max(plan.num_partials, 1), -1, dtype=np.int32)
    counts = np.diff(plan.merge_indptr)
    owner[plan.merge_indices] = np.repeat(np.arange(counts.size, dtype=np.int32), counts)
    return np.where(prow >= 0, owner[np.maximum(prow, 0)], -1).astype(np.int32)
