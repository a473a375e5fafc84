"""``Plan``: the scheduler's output, a frozen dataclass of int32 arrays that kernels consume.

One plan describes one generation step and serves every layer of it (the lengths, hence the
work, are the same in every layer). Its arrays are read-only; the same inputs always give an
array-equal plan, which is what makes the output bitwise reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["WORK_COLUMNS", "WORK_FIELDS", "Plan"]

WORK_COLUMNS = ("request", "kv_head", "qo_start", "qo_end", "kv_start", "kv_end", "partial_row")
WORK_FIELDS = len(WORK_COLUMNS)
_ARRAYS = ("work", "cta_indptr", "cta_work", "merge_rows", "merge_indptr", "merge_indices")


@dataclass(frozen=True, eq=False, repr=False)
class Plan:
    """Work items, CTA queues and reduction map of one step (host arrays, int32).

    Attributes
    ----------
    work : ndarray [W, 7], int32
        One row per work item: ``(request, kv_head, qo_start, qo_end, kv_start, kv_end,
        partial_row)``. Query rows ``qo_start:qo_end`` of the request (offsets inside it), KV
        tokens ``kv_start:kv_end`` of it, query heads ``kv_head * G .. kv_head * G + G - 1``.
        ``partial_row == -1``: the item sees all the KV of its rows and writes the output rows
        ``qo_indptr[request] + qo_start + j`` directly. Otherwise it writes partial rows
        ``partial_row + j`` (``j < qo_end - qo_start``); a partial row holds all
        ``num_qo_heads`` heads of one query row for one KV chunk.
    cta_indptr : ndarray [num_ctas + 1], int32
        CTA ``c`` runs items ``cta_work[cta_indptr[c]:cta_indptr[c + 1]]``, in that order.
    cta_work : ndarray [W], int32
        Indices into ``work`` (a permutation of ``range(W)``), grouped by CTA.
    merge_rows : ndarray [M], int32
        Global output query row (``qo_indptr[b] + i``) of every split row, increasing.
    merge_indptr : ndarray [M + 1], int32
        Row ``merge_rows[i]`` merges partial rows ``merge_indices[merge_indptr[i]:merge_indptr[i+1]]``.
    merge_indices : ndarray [nnz], int32
        Partial rows, in increasing ``kv_start`` order per output row (the fixed merge order).
        The attention kernels' fused merge (:mod:`nbinfer.kernels.fused_merge`) reads these.
    num_partials : int
        Partial rows the workspace must hold (``num_partials x num_qo_heads`` states).
    batch_size, num_qo_rows, num_qo_heads, num_kv_heads : int
        The batch the plan was made for.
    tile_q, tile_rows : int
        Query tile height in packed rows (query rows x G), and query rows per tile.
    kv_chunk : int
        Largest KV chunk (``L_kv``), or ``fixed_split_size`` when that was given.
    granule : int
    causal : bool
    fixed_split_size : int or None
    alpha, beta : float
        Cost model ``alpha * l_q + beta * (l_kv + item_overhead)`` used for the assignment.
    item_overhead : int
        KV tokens of cost every item carries beyond its own (0: the byte model).
    """

    work: np.ndarray
    cta_indptr: np.ndarray
    cta_work: np.ndarray
    merge_rows: np.ndarray
    merge_indptr: np.ndarray
    merge_indices: np.ndarray
    num_partials: int
    batch_size: int
    num_qo_rows: int
    num_qo_heads: int
    num_kv_heads: int
    tile_q: int
    tile_rows: int
    kv_chunk: int
    granule: int
    causal: bool
    fixed_split_size: int | None
    alpha: float
    beta: float
    item_overhead: int = 0

    def __post_init__(self):
        # Shape checks only (O(1)): plan() builds consistent arrays, this guards hand-made ones.
        for name in _ARRAYS:
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int32:
                raise TypeError(f"Plan.{name} must be an int32 ndarray, got "
                                f"{getattr(arr, 'dtype', type(arr).__name__)}")
            arr.flags.writeable = False  # a frozen plan: nobody edits a plan that kernels share
        w = self.work
        if w.ndim != 2 or w.shape[1] != WORK_FIELDS:
            raise ValueError(f"Plan.work must have shape [W, {WORK_FIELDS}], got {w.shape}")
        if self.cta_work.shape != (w.shape[0],):
            raise ValueError(f"Plan.cta_work must have shape ({w.shape[0]},), got {self.cta_work.shape}")
        if self.cta_indptr.ndim != 1 or self.cta_indptr.size < 2:
            raise ValueError("Plan.cta_indptr must have num_ctas + 1 >= 2 entries")
        m = self.merge_rows.size
        if self.merge_indptr.shape != (m + 1,) or self.merge_indptr[-1] != self.merge_indices.size:
            raise ValueError(f"Plan.merge_indptr must have {m + 1} entries ending at "
                             f"{self.merge_indices.size}, got {self.merge_indptr.shape}")

    @classmethod
    def _from_scheduler(cls, **fields) -> Plan:
        """A plan from arrays the scheduler built consistent by construction: the shape checks
        of ``__post_init__`` skipped (a few us of a serving step), the arrays still frozen."""
        plan = object.__new__(cls)
        plan.__dict__.update(fields)
        for name in _ARRAYS:
            fields[name].flags.writeable = False
        return plan

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_ctas(self) -> int:
        return self.cta_indptr.size - 1

    @property
    def num_work(self) -> int:
        return self.work.shape[0]

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def num_merge_rows(self) -> int:
        return self.merge_rows.size

    @property
    def num_merge_nnz(self) -> int:
        return self.merge_indices.size

    # -- costs ---------------------------------------------------------------------------------
    def item_costs(self) -> np.ndarray:
        """Cost of every work item, ``alpha * l_q + beta * (l_kv + item_overhead)`` (float64
        [W])."""
        w = self.work.astype(np.int64)
        l_q = (w[:, 3] - w[:, 2]) * self.group_size
        return self.alpha * l_q + self.beta * (w[:, 5] - w[:, 4] + self.item_overhead)

    def item_cta(self) -> np.ndarray:
        """CTA that runs every work item (int32 [W])."""
        owner = np.empty(self.num_work, dtype=np.int32)
        owner[self.cta_work] = np.repeat(np.arange(self.num_ctas, dtype=np.int32),
                                         np.diff(self.cta_indptr))
        return owner

    def cta_loads(self) -> np.ndarray:
        """Summed item cost of every CTA (float64 [num_ctas])."""
        return np.bincount(self.item_cta(), weights=self.item_costs(), minlength=self.num_ctas)

    def cta_kv_tokens(self) -> np.ndarray:
        """KV tokens every CTA's items cover (int64 [num_ctas]): what a decode CTA reads, where
        :meth:`cta_loads` sums the cost model's units (query rows and item overhead too)."""
        return np.bincount(self.item_cta(), weights=self.work[:, 5] - self.work[:, 4],
                           minlength=self.num_ctas).astype(np.int64)

    def lower_bound(self) -> float:
        """No schedule beats ``max(total / num_ctas, largest item)``."""
        costs = self.item_costs()
        if costs.size == 0:
            return 0.0
        return float(max(costs.sum() / self.num_ctas, costs.max()))

    # -- text ----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        split = int(np.count_nonzero(self.work[:, 6] >= 0))
        return (f"Plan(batch={self.batch_size}, rows={self.num_qo_rows}, "
                f"heads={self.num_qo_heads}/{self.num_kv_heads}, ctas={self.num_ctas}, "
                f"tile_q={self.tile_q} ({self.tile_rows} rows), kv_chunk={self.kv_chunk}, "
                f"work={self.num_work} ({split} partial), merge_rows={self.num_merge_rows}, "
                f"partials={self.num_partials})")

    def summary(self, max_items: int = 8) -> str:
        """Readable multi-line description: sizes, load balance, the first work items."""
        loads = self.cta_loads()
        lb = self.lower_bound()
        per_cta = np.diff(self.cta_indptr)
        split = self.work[:, 6] >= 0
        mode = f"fixed {self.fixed_split_size}" if self.fixed_split_size else "adaptive"
        lines = [
            repr(self),
            f"  tiles      : T_q={self.tile_q} packed rows = {self.tile_rows} query rows x "
            f"G={self.group_size}{', causal' if self.causal else ''}",
            f"  kv chunks  : L_kv={self.kv_chunk} ({mode}, granule {self.granule})",
            f"  work items : {self.num_work} ({int(split.sum())} write partials, "
            f"{int((~split).sum())} write outputs)",
            f"  cost model : {self.alpha:g} * l_q + {self.beta:g} * (l_kv + "
            f"{self.item_overhead})" if self.item_overhead else
            f"  cost model : {self.alpha:g} * l_q + {self.beta:g} * l_kv",
        ]
        if self.num_work:
            mean = loads.mean()
            lines += [
                f"  CTA load   : max {loads.max():.6g}, mean {mean:.6g}, min {loads.min():.6g} "
                f"(max/mean {loads.max() / mean:.3f}, max/lower bound {loads.max() / lb:.3f})",
                f"  items/CTA  : {per_cta.min()}..{per_cta.max()}, "
                f"{int(np.count_nonzero(per_cta == 0))} idle CTAs",
            ]
        lines.append(f"  merge      : {self.num_merge_rows} rows from {self.num_merge_nnz} partial "
                     f"rows (workspace: {self.num_partials} x {self.num_qo_heads} states)")
        if self.num_work:
            lines.append("  " + " ".join(f"{c:>11}" for c in ("item", *WORK_COLUMNS)))
            for i in range(min(max_items, self.num_work)):
                lines.append("  " + " ".join(f"{v:>11}" for v in (i, *self.work[i].tolist())))
            if self.num_work > max_items:
                lines.append(f"  ... {self.num_work - max_items} more")
        return "\n".join(lines)

    # -- equality ------------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return all(np.array_equal(getattr(self, n), getattr(other, n)) for n in _ARRAYS) and all(
            getattr(self, f) == getattr(other, f) for f in self.__dataclass_fields__
            if f not in _ARRAYS)

    __hash__ = None  # arrays are mutable in principle; plans are compared, not hashed

    # -- workspace -----------------------------------------------------------------------------
    def pack(self, layout, *, out: np.ndarray | None = None) -> np.ndarray:
        """Write the plan into one int32 buffer of ``layout.size`` words (see :class:`PlanLayout`)."""
        return layout.pack(self, out=out)

    @classmethod
    def unpack(cls, buf: np.ndarray, layout) -> Plan:
        """Rebuild a plan from a buffer written by :meth:`pack` with the same ``layout``."""
        return layout.unpack(buf)

    # -- pictures ------------------------------------------------------------------------------
    def plot_gantt(self, ax=None, **kwargs):
        """CTA queues as a Gantt chart; see :func:`nbinfer.scheduler.draw.plot_gantt`."""
        from .draw import plot_gantt

        return plot_gantt(self, ax=ax, **kwargs)

    def plot_reduction_map(self, ax=None, **kwargs):
        """Partial rows -> output rows; see :func:`nbinfer.scheduler.draw.plot_reduction_map`."""
        from .draw import plot_reduction_map

        return plot_reduction_map(self, ax=ax, **kwargs)
