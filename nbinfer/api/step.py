"""The typed step plan every wrapper builds in ``plan()`` and every ``run()`` reads.

A :class:`StepPlan` is frozen: ``plan()`` builds a complete one and installs it only when every
check passed, so a failed ``plan()`` leaves the wrapper with no plan (``run()`` then raises)
rather than with the previous step's. Its index arrays are read-only snapshots taken at
``plan()``: changing the caller's arrays afterwards changes nothing, on every backend.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import numpy as np

from ..scheduler.schedule import Plan
from ..variants import Variant

__all__ = ["DeferredStepPlan", "StepPlan", "PlanSlot"]


@dataclass(frozen=True)
class StepPlan:
    """One step's plan: the problem, the schedule and the prepared launch.

    Attributes
    ----------
    batch_size : int
        Requests (decode: query rows too).
    num_qo_rows : int
        Query rows of the step (``qo_indptr[-1]``; decode: ``batch_size``).
    num_qo_heads, num_kv_heads, head_dim, page_size : int
    q_dtype, kv_dtype : str
        ``"float16"``, ``"bfloat16"`` or ``"float32"``.
    sm_scale : float
    variant : Variant
        The attention variant the flags and ``variant=`` describe.
    qo_indptr : ndarray [batch_size + 1], int32, read-only
    kv_indptr, kv_indices, kv_last_page_len : ndarray, int32, read-only
        The page table (ragged KV: token offsets in ``kv_indptr``, the others empty).
    kv_lens : ndarray [batch_size], int64, read-only
    masks : tuple of (bool ndarray [qo_len, kv_len] or None), one per request
    schedule : nbinfer.scheduler.Plan or None
        The work list and reduction map (None on the reference backend).
    spec : the kernel spec (None on the reference backend)
    launch : AttentionLaunch or None
        The prepared launch (its ``launch`` attribute fires the kernel with the last bound
        arguments: benchmarks time it).
    extra : dict
        Wrapper-specific read-only facts (block-sparse pattern, cascade levels).
    """

    batch_size: int
    num_qo_rows: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: str
    kv_dtype: str
    sm_scale: float
    variant: Variant
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    kv_lens: np.ndarray
    masks: tuple = ()
    q_pos0: np.ndarray | None = None
    schedule: object = None
    spec: object = None
    launch: object = None
    fast: object = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def _trusted(cls, **fields) -> StepPlan:
        """A step plan from fields plan() has already validated and snapshotted: frozen like
        any other, built without the frozen ``__init__``'s per-field ``object.__setattr__``
        (a few us of a serving step's plan()). Omitted fields take their defaults."""
        if not _REQUIRED <= fields.keys() <= _ALL:
            raise TypeError(f"StepPlan fields missing: {sorted(_REQUIRED - fields.keys())}, "
                            f"unknown: {sorted(fields.keys() - _ALL)}")
        step = object.__new__(cls)
        step.__dict__.update({**_DEFAULTS, "extra": {}, **fields})
        return step

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def custom_mask(self) -> bool:
        """Whether a custom mask is part of the plan."""
        return bool(self.masks) and self.masks[0] is not None

    @property
    def page_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def flat_mask(self):
        """The custom masks concatenated row-major (the reference engine's form), or None."""
        return np.concatenate([m.ravel() for m in self.masks]) if self.custom_mask else None


class DeferredStepPlan(StepPlan):
    """A :class:`StepPlan` whose ``schedule`` field holds a
    :class:`~nbinfer.scheduler.compiled.PendingPlan`: the :class:`~nbinfer.scheduler.Plan` is
    built from the compiled planner's buffer on first read (decode's per-step ``plan()`` never
    reads it), and is then the same as an eager one's."""

    @property
    def schedule(self):
        pending = self.__dict__["schedule"]
        if isinstance(pending, Plan):  # built by an earlier read
            return pending
        plan = pending.plan()
        self.__dict__["schedule"] = plan
        return plan

    def __eq__(self, other):
        # equal to a StepPlan of the same fields (the dataclass __eq__ wants the same class)
        if not isinstance(other, StepPlan):
            return NotImplemented
        return (tuple(getattr(self, f) for f in _ALL_ORDERED)
                == tuple(getattr(other, f) for f in _ALL_ORDERED))

    __hash__ = StepPlan.__hash__


_DEFAULTS = {f.name: f.default for f in fields(StepPlan) if f.default is not MISSING}
_REQUIRED = frozenset(f.name for f in fields(StepPlan)
                      if f.default is MISSING and f.default_factory is MISSING)
_ALL = frozenset(f.name for f in fields(StepPlan))
_ALL_ORDERED = tuple(f.name for f in fields(StepPlan))


class PlanSlot:
    """Where a wrapper keeps its current :class:`StepPlan`: installed whole, or cleared with the
    reason when a ``plan()`` fails."""

    def __init__(self):
        self._plan = None
        self._why = "run() called before plan()"

    def install(self, step: StepPlan) -> StepPlan:
        self._plan = step
        return step

    def fail(self, exc: BaseException) -> None:
        self._plan = None
        self._why = f"the last plan() failed ({type(exc).__name__}: {exc})"

    def get(self) -> StepPlan:
        if self._plan is None:
            raise RuntimeError(f"no valid plan: {self._why}; call plan() again")
        return self._plan
