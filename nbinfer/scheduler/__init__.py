"""The CPU scheduler: query tiles, KV chunks, LPT assignment to CTAs and the reduction map.

``plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas)`` is pure NumPy and returns a
:class:`Plan` (frozen, int32 arrays) that every layer of a step reuses; :class:`PlanLayout` packs
it into one fixed-size int32 buffer so a CUDA graph can replay with a new plan written in place.

Modules: :mod:`.planner` (``plan``), :mod:`.schedule` (``Plan``), :mod:`.lpt` (heap assignment),
:mod:`.reduction` (partial rows, merge map), :mod:`.layout` (packing), :mod:`.draw` (pictures),
:mod:`.compiled` (the same plan, page-table check and packing as Numba CPU loops in
:mod:`._loops`, for the wrappers' per-step ``plan()``; imported on demand, equal array for array).
"""

from .layout import HEADER_FIELDS, HEADER_WORDS, PlanLayout
from .lpt import lpt_assign
from .planner import choose_tile_q, plan
from .reduction import assign_partials, reduction_map
from .schedule import WORK_COLUMNS, WORK_FIELDS, Plan

__all__ = [
    "HEADER_FIELDS",
    "HEADER_WORDS",
    "WORK_COLUMNS",
    "WORK_FIELDS",
    "Plan",
    "PlanLayout",
    "assign_partials",
    "choose_tile_q",
    "lpt_assign",
    "plan",
    "reduction_map",
]
