"""The scheduler as one compiled call, for the wrappers' ``plan()`` on a serving host.

:func:`nbinfer.scheduler.plan` is the definition: four decisions written as about sixty
vectorised NumPy operations, easy to read and to draw. On the host of a GPU server each NumPy call
has a fixed cost of one to two microseconds, and the LPT heap loop costs ~0.2 us per item in the
interpreter, so a one-request decode step spent ~0.3 ms in it, more than the step's attention.
Here the same decisions run as plain loops in one Numba CPU function (compiled on first use and
kept in Numba's on-disk cache), together with the page-table check the wrappers need and the
packing of the plan into the staging buffer (:meth:`PlanLayout.pack`'s format):

- :func:`check_page_table_fast`: the fast path of :func:`nbinfer.formats.paged.check_page_table`
  (int32 tables; any failure re-runs the NumPy validator, which raises the descriptive error);
- :func:`plan_compiled`: exactly :func:`nbinfer.scheduler.plan`'s :class:`Plan` (every array
  equal; ``tests/test_scheduler_compiled.py`` compares them on random batches), plus each work
  item's merge list;
- :func:`pack_compiled`: exactly :meth:`PlanLayout.pack` into a given buffer.

The rare inputs the loops do not take (cost keys that could pass 2**61, counts past int32) go
to the NumPy planner, so the result is always the definition's.
"""

from __future__ import annotations

import functools

import numpy as np

from .layout import PlanLayout
from .lpt import integer_weights
from .planner import INT32_MAX, plan
from .schedule import WORK_FIELDS, Plan

__all__ = ["check_page_table_fast", "load", "loaded", "pack_compiled", "plan_compiled"]

_OK = 0  # _loops.schedule returns 1 for the steps it hands to the NumPy planner


@functools.cache
def _kernels():
    """The compiled loops (from Numba's disk cache after the first process); numba is imported
    here, never by ``import nbinfer``."""
    from . import _loops

    return _loops.schedule, _loops.pack, _loops.check_table


def loaded() -> bool:
    """Whether the compiled loops are ready in this process (:func:`load` ran)."""
    return _LOADED[0]


def load() -> None:
    """Load the compiled loops (compiling them the first time on a machine).

    Costs once per process what Numba's CPU target needs to start (~0.3 s on a laptop-class
    CPU, about twice that on the H200 host) plus reading the cached machine code, so the
    wrappers use the NumPy planner for a wrapper's first ``plan()`` (a script that plans once
    never pays it) and these loops from the second on; :func:`nbinfer.warmup` loads them ahead.
    """
    if _LOADED[0]:
        return
    schedule, pack, check = _kernels()
    # Numba types a read-only array apart from a writable one: load every variant the wrappers
    # pass (page tables from torch or NumPy, writable or frozen; decode's frozen qo_indptr and
    # the check's frozen KV lengths), so none is loaded inside a later plan().
    for frozen in (False, True):
        one = _frozen(np.ones(1, dtype=np.int32), frozen)
        check(_frozen(np.array([0, 1], dtype=np.int32), frozen), one, one, 1)
        qo = _frozen(np.arange(2, dtype=np.int32), frozen)
        plan_compiled(qo, _frozen(np.array([8], dtype=np.int64), frozen), 1, 1, 1)
        plan_compiled(np.arange(2), np.array([8]), 1, 1, 1)
    layout = PlanLayout(1, 1, 0, 0)
    sched, item_merge = plan_compiled(np.arange(2, dtype=np.int32), np.array([8]), 1, 1, 1)
    pack_compiled(layout, sched, np.empty(layout.size, dtype=np.int32))
    pack_compiled(layout, sched, np.empty(layout.size + 4, dtype=np.int32),
                  zero_end=layout.size + 4, extras=(item_merge,), extra_offsets=(layout.size,))
    _LOADED[0] = True


def _frozen(a: np.ndarray, frozen: bool) -> np.ndarray:
    a.flags.writeable = not frozen
    return a


_LOADED = [False]


def check_page_table_fast(indptr, indices, last_page_len, page_size: int, names):
    """:func:`nbinfer.formats.paged.check_page_table`'s result for int32 host arrays, checked
    and copied in one compiled pass; other dtypes, and any table the pass rejects, go through
    the NumPy validator (which raises its descriptive error). Returns read-only snapshots
    ``(indptr, indices, last_page_len, kv_lens)`` and the number of pages the table needs the
    cache to hold (largest page id + 1)."""
    i32 = _I32
    if (type(indptr) is np.ndarray and type(indices) is np.ndarray
            and type(last_page_len) is np.ndarray and indptr.dtype == i32
            and indices.dtype == i32 and last_page_len.dtype == i32 and indptr.ndim == 1
            and indices.ndim == 1 and last_page_len.ndim == 1 and indptr.size):
        ok, ptr, idx, last, kv_lens, pages = _kernels()[2](indptr, indices, last_page_len,
                                                           page_size)
    else:
        ok = 1
    if ok != _OK:
        from ..formats.paged import check_page_table

        ptr, idx, last, kv_lens = (np.array(a) for a in check_page_table(
            indptr, indices, last_page_len, page_size, names=names))
        pages = int(idx.max()) + 1 if idx.size else 0
    for a in (ptr, idx, last, kv_lens):
        a.flags.writeable = False
    return ptr, idx, last, kv_lens, int(pages)


def plan_compiled(qo_indptr: np.ndarray, kv_lens: np.ndarray, num_qo_heads: int,
                  num_kv_heads: int, num_ctas: int, *, granule: int = 16, alpha: float = 1.0,
                  beta: float = 1.0, fixed_split_size: int | None = None, causal: bool = False,
                  tile_q: int | None = None) -> tuple[Plan, np.ndarray]:
    """``(plan(...), item_merge)`` for arguments the caller has already validated.

    ``qo_indptr`` and ``kv_lens`` are valid int32 or int64 host arrays, the integers positive
    and ``num_qo_heads`` a multiple of ``num_kv_heads`` (the wrappers check all of it first).
    ``item_merge [W]`` int32 is the merge list each work item's partial rows belong to (-1: the
    item writes its output directly), as :func:`nbinfer.api.workspace.item_merge_lists` gives.
    """
    group = num_qo_heads // num_kv_heads
    wq, wkv = _weights(alpha, beta)
    res = _kernels()[0](qo_indptr, kv_lens,
                        num_kv_heads, group, num_ctas, granule, wq, wkv, fixed_split_size or 0,
                        bool(causal), tile_q or 0)
    if res[0] != _OK:  # counts past int32 (plan raises) or huge cost keys (plan handles them)
        from ..api.workspace import item_merge_lists

        sched = plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, granule=granule,
                     alpha=alpha, beta=beta, fixed_split_size=fixed_split_size, causal=causal,
                     tile_q=tile_q)
        return sched, item_merge_lists(sched)
    (_, work, cta_indptr, cta_work, merge_rows, merge_indptr, merge_indices, item_merge,
     num_partials, tile_q_used, tile_rows, kv_chunk) = res
    sched = Plan._from_scheduler(
        work=work, cta_indptr=cta_indptr, cta_work=cta_work, merge_rows=merge_rows,
        merge_indptr=merge_indptr, merge_indices=merge_indices, num_partials=int(num_partials),
        batch_size=qo_indptr.size - 1, num_qo_rows=int(qo_indptr[-1]),
        num_qo_heads=int(num_qo_heads), num_kv_heads=int(num_kv_heads), tile_q=int(tile_q_used),
        tile_rows=int(tile_rows), kv_chunk=int(kv_chunk), granule=int(granule),
        causal=bool(causal), fixed_split_size=fixed_split_size, alpha=float(alpha),
        beta=float(beta))
    return sched, item_merge


_EMPTY = np.empty(0, dtype=np.int32)
_I32 = np.dtype(np.int32)
_weights = functools.lru_cache(maxsize=16)(integer_weights)


@functools.lru_cache(maxsize=64)
def _offsets(layout: PlanLayout) -> np.ndarray:
    off = layout.offsets()
    return np.array([off[n] for n in ("work", "cta_indptr", "cta_work", "merge_rows",
                                      "merge_indptr", "merge_indices")], dtype=np.int64)


def pack_compiled(layout: PlanLayout, sched: Plan, out: np.ndarray, *, zero_end: int = 0,
                  extras=(), extra_offsets=()) -> np.ndarray:
    """:meth:`PlanLayout.pack` of ``sched`` into ``out[:layout.size]`` in one compiled pass.

    ``out`` (int32, at least ``layout.size`` words) may be a whole staging buffer: then
    ``out[layout.size:zero_end]`` is zeroed and each int32 array of ``extras`` copied to its
    word offset in ``extra_offsets``, in the same pass (the rest of the workspace's sections).
    """
    size = layout.size
    if not layout.fits(sched) or out.ndim != 1 or out.size < max(size, zero_end) \
            or out.dtype != _I32:
        raise ValueError(f"the plan ({sched.num_work} items, {sched.num_merge_rows} merge rows, "
                         f"{sched.num_merge_nnz} entries, {sched.num_ctas} CTAs) or out "
                         f"({out.dtype} {out.shape}) does not fit {layout}")
    lengths = [a.size for a in extras]
    if len(extras) != len(extra_offsets) or any(
            o < 0 or o + n > out.size for n, o in zip(lengths, extra_offsets, strict=True)):
        raise ValueError(f"extra sections of {lengths} words at offsets "
                         f"{list(extra_offsets)} do not fit out ({out.size} words)")
    flat = _EMPTY if not extras else extras[0] if len(extras) == 1 else np.concatenate(extras)
    _kernels()[1](out, size, _offsets(layout), layout.header(sched), sched.work,
                  sched.cta_indptr, sched.cta_work, sched.merge_rows, sched.merge_indptr,
                  sched.merge_indices, layout.max_merge_rows, max(zero_end, size),
                  np.ascontiguousarray(flat, dtype=np.int32),
                  np.array(extra_offsets, dtype=np.int64), np.array(lengths, dtype=np.int64))
    return out


assert WORK_FIELDS == 7 and INT32_MAX == 2147483647  # the loops above hard-code both
