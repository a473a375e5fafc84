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
- :func:`pack_compiled`: exactly :meth:`PlanLayout.pack` into a given buffer;
- :func:`cascade_compiled`: :func:`nbinfer.scheduler.cascade_plan` (its virtual requests'
  plan, whose partial rows and reduction map are rebuilt over the real rows) and the items'
  merge lists;
- :func:`check_levels_fast` and :func:`check_stage_append`: the cascade wrapper's agreement of
  its per-level lists, and the append wrapper's index checks with the staging of its kernel's
  sections.

The rare inputs the loops do not take (cost keys that could pass 2**61, counts past int32) go
to the NumPy planner, so the result is always the definition's.
"""

from __future__ import annotations

import functools

import numpy as np

from .layout import STEP_FIELDS, STEP_FIELDS_AT, PlanLayout
from .lpt import integer_weights
from .planner import INT32_MAX, plan
from .schedule import WORK_FIELDS, Plan

__all__ = ["PendingPlan", "cascade_compiled", "check_and_plan",
           "check_levels_fast", "check_page_table_fast", "check_stage_append",
           "item_merge_compiled", "load", "loaded", "pack_compiled", "plan_compiled"]

_OK = 0  # _loops.schedule returns 1 for the steps it hands to the NumPy planner


@functools.cache
def _kernels():
    """The compiled loops (from Numba's disk cache after the first process); numba is imported
    here, never by ``import nbinfer``."""
    from . import _loops

    return (_loops.schedule, _loops.pack, _loops.check_table, _loops.check_and_schedule,
            _loops.check_schedule_pack, _loops.item_merge,
            _loops.cascade_schedule, _loops.check_levels, _loops.check_stage_append)


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
    schedule, pack, check = _kernels()[:3]
    # Numba types a read-only array apart from a writable one: load every variant the wrappers
    # pass (page tables from torch or NumPy, writable or frozen; decode's frozen qo_indptr and
    # the check's frozen KV lengths), so none is loaded inside a later plan().
    for frozen in (False, True):
        one = _frozen(np.ones(1, dtype=np.int32), frozen)
        check(_frozen(np.array([0, 1], dtype=np.int32), frozen), one, one, 1)
        qo = _frozen(np.arange(2, dtype=np.int32), frozen)
        plan_compiled(qo, _frozen(np.array([8], dtype=np.int64), frozen), 1, 1, 1)
        plan_compiled(np.arange(2), np.array([8]), 1, 1, 1)
        for speculate in (None, _NO_FIT):  # decode's plan() with and without a layout guess
            check_and_plan(_frozen(np.array([0, 1], dtype=np.int32), frozen), one, one, 1,
                           "abc", _frozen(np.arange(2, dtype=np.int32), True), 1, 1, 1,
                           speculate=speculate)
    # the cascade's plan (scheduler.cascade_plan) and the items' merge lists of a plan
    base, _ = plan_compiled(np.arange(2), np.array([8]), 1, 1, 1)
    item_merge_compiled(base)
    check_levels_fast([np.arange(2, dtype=np.int32)] * 2, [np.arange(2)] * 2, [np.ones(1)] * 2)
    i32 = np.int32
    for frozen in (False, True):  # the engine's arrays (writable) or snapshots
        one = _frozen(np.ones(1, dtype=i32), frozen)
        check_stage_append(_frozen(np.zeros(1, dtype=i32), frozen), one,
                           _frozen(np.array([0, 1], dtype=i32), frozen), one, one, 4, 2,
                           np.zeros(8, dtype=i32), (0, 1, 2, 4))
    for frozen in (False, True):  # the cascade wrapper's snapshots (frozen) or callers' arrays
        cascade_compiled([_frozen(np.arange(2, dtype=np.int32), frozen)] * 2,
                         _frozen(np.array([8, 8], dtype=np.int64), frozen), 1, 1, 1)
    layout = PlanLayout(1, 1, 0, 0)
    sched, item_merge = plan_compiled(np.arange(2, dtype=np.int32), np.array([8]), 1, 1, 1)
    pack_compiled(layout, sched, np.empty(layout.size, dtype=np.int32))
    n = layout.size
    for frozen in (False, True):  # page tables: snapshots (frozen) or the caller's arrays
        table = tuple(_frozen(np.zeros(k, dtype=np.int32), frozen) for k in (2, 1, 1))
        pack_compiled(layout, sched, np.empty(n + 8, dtype=np.int32), zero_end=n + 4,
                      item_merge=item_merge, item_merge_offset=n, page_table=table,
                      table_offsets=(n + 4, n + 6, n + 7))
    _LOADED[0] = True


def _frozen(a: np.ndarray, frozen: bool) -> np.ndarray:
    a.flags.writeable = not frozen
    return a


_LOADED = [False]


def _int32_vectors(*arrays) -> bool:
    """Whether every one of ``arrays`` is a 1-D int32 NumPy array (what the loops take)."""
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != _I32 or a.ndim != 1:
            return False
    return True


def check_page_table_fast(indptr, indices, last_page_len, page_size: int, names):
    """:func:`nbinfer.formats.paged.check_page_table`'s result for int32 host arrays, checked
    and copied in one compiled pass; other dtypes, and any table the pass rejects, go through
    the NumPy validator (which raises its descriptive error). Returns read-only snapshots
    ``(indptr, indices, last_page_len, kv_lens)`` and the number of pages the table needs the
    cache to hold (largest page id + 1)."""
    if _int32_vectors(indptr, indices, last_page_len) and indptr.size:
        table = _kernels()[2](indptr, indices, last_page_len, page_size)
        if table[0] == _OK:
            return _table_of(table)
    from ..formats.paged import check_page_table

    ptr, idx, last, kv_lens = (np.array(a) for a in check_page_table(
        indptr, indices, last_page_len, page_size, names=names))
    for a in (ptr, idx, last, kv_lens):
        a.flags.writeable = False
    return ptr, idx, last, kv_lens, (int(idx.max()) + 1 if idx.size else 0)


def _table_of(table) -> tuple:
    """``(indptr, indices, last_page_len, kv_lens, pages)`` from ``_loops.check_table``'s
    accepted result: read-only views of its one snapshot buffer."""
    _, snap, kv_lens, pages = table
    snap.flags.writeable = False
    kv_lens.flags.writeable = False
    batch = kv_lens.size
    return (snap[:batch + 1], snap[batch + 1:snap.size - batch], snap[snap.size - batch:],
            kv_lens, int(pages))


def sched_views(blob: np.ndarray, num_work: int, num_ctas: int, merge_rows: int,
                num_partials: int) -> tuple:
    """The seven arrays of ``_loops.schedule``'s result (``work [W, 7]``, ``cta_indptr``,
    ``cta_work``, ``merge_rows``, ``merge_indptr``, ``merge_indices``, ``item_merge``) as
    read-only views of its one buffer, carved as ``_loops.sched_views`` carves it."""
    blob.flags.writeable = False
    a = num_work * WORK_FIELDS
    b = a + num_ctas + 1
    c = b + num_work
    d = c + merge_rows
    e = d + merge_rows + 1
    f = e + num_partials
    return (blob[:a].reshape(num_work, WORK_FIELDS), blob[a:b], blob[b:c], blob[c:d],
            blob[d:e], blob[e:f], blob[f:f + num_work])


def plan_compiled(qo_indptr: np.ndarray, kv_lens: np.ndarray, num_qo_heads: int,
                  num_kv_heads: int, num_ctas: int, *, granule: int = 16, alpha: float = 1.0,
                  beta: float = 1.0, fixed_split_size: int | None = None, causal: bool = False,
                  tile_q: int | None = None, item_overhead: int = 0) -> tuple[Plan, np.ndarray]:
    """``(plan(...), item_merge)`` for arguments the caller has already validated.

    ``qo_indptr`` and ``kv_lens`` are valid int32 or int64 host arrays, the integers positive
    and ``num_qo_heads`` a multiple of ``num_kv_heads`` (the wrappers check all of it first).
    ``item_merge [W]`` int32 is the merge list each work item's partial rows belong to (-1: the
    item writes its output directly), as :func:`nbinfer.api.workspace.item_merge_lists` gives.
    """
    args = (qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, granule, alpha, beta,
            fixed_split_size, causal, tile_q, item_overhead)
    return _plan_of(_schedule(*args), *args)


def _schedule(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, granule, alpha, beta,
              fixed_split_size, causal, tile_q, item_overhead) -> tuple:
    """``_loops.schedule``'s raw result for :func:`plan_compiled`'s arguments."""
    wq, wkv = _weights(alpha, beta)
    return _kernels()[0](qo_indptr, kv_lens, num_kv_heads, num_qo_heads // num_kv_heads,
                         num_ctas, granule, wq, wkv, fixed_split_size or 0, bool(causal),
                         tile_q or 0, int(item_overhead))


class PendingPlan:
    """A decode step's schedule as :func:`check_and_plan` leaves it: the counts a workspace
    layout needs, read at once, and the :class:`Plan` with its ``item_merge``, built from the
    compiled loops' one buffer on first use (a steady-state decode ``plan()`` packs the step
    in the same compiled call and never needs them: ~5 us of Python saved per step).

    Attributes
    ----------
    num_ctas, num_work, num_merge_rows, num_merge_nnz : int
    """

    __slots__ = ("num_ctas", "num_work", "num_merge_rows", "num_merge_nnz", "_args", "_built")

    def __init__(self, res, args):
        """``res``: ``_loops.schedule``'s result for ``args``, :func:`_schedule`'s arguments."""
        self.num_ctas = args[4]
        self._args, self._built = (res, *args), None
        if res[0] == _OK:
            self.num_work, self.num_merge_rows, self.num_merge_nnz = res[2], res[3], res[4]
        else:  # the NumPy planner's turn: nothing to defer
            self._built = _plan_of(*self._args)
            sched = self._built[0]
            self.num_work, self.num_merge_rows = sched.num_work, sched.num_merge_rows
            self.num_merge_nnz = sched.num_merge_nnz

    def get(self) -> tuple[Plan, np.ndarray]:
        """``(plan, item_merge)`` (built once)."""
        if self._built is None:
            self._built = _plan_of(*self._args)
        return self._built

    def plan(self) -> Plan:
        return self.get()[0]


def _plan_of(res, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, granule, alpha,
             beta, fixed_split_size, causal, tile_q, item_overhead) -> tuple[Plan, np.ndarray]:
    """``(Plan, item_merge)`` from ``_loops.schedule``'s result, or from the NumPy planner for
    the steps the loops hand back."""
    if res[0] != _OK:  # counts past int32 (plan raises) or huge cost keys (plan handles them)
        from ..api.workspace import item_merge_lists

        sched = plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, granule=granule,
                     alpha=alpha, beta=beta, fixed_split_size=fixed_split_size, causal=causal,
                     tile_q=tile_q, item_overhead=item_overhead)
        return sched, item_merge_lists(sched)
    _, blob, num_work, merge_rows_n, num_partials, tile_q_used, tile_rows, kv_chunk = res
    work, cta_indptr, cta_work, merge_rows, merge_indptr, merge_indices, item_merge = \
        sched_views(blob, num_work, num_ctas, merge_rows_n, num_partials)
    sched = Plan._from_scheduler(
        work=work, cta_indptr=cta_indptr, cta_work=cta_work, merge_rows=merge_rows,
        merge_indptr=merge_indptr, merge_indices=merge_indices, num_partials=int(num_partials),
        batch_size=qo_indptr.size - 1, num_qo_rows=int(qo_indptr[-1]),
        num_qo_heads=int(num_qo_heads), num_kv_heads=int(num_kv_heads), tile_q=int(tile_q_used),
        tile_rows=int(tile_rows), kv_chunk=int(kv_chunk), granule=int(granule),
        causal=bool(causal), fixed_split_size=fixed_split_size, alpha=float(alpha),
        beta=float(beta), item_overhead=int(item_overhead))
    return sched, item_merge


def _flat_levels(arrays) -> tuple[np.ndarray, np.ndarray]:
    """Per-level arrays as the loops take them: concatenated, and the int64 offset of each
    level's first entry (one past the last level's last)."""
    off = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.size for a in arrays], out=off[1:])
    return np.concatenate(arrays), off


def cascade_compiled(qo_indptr_levels, kv_lens: np.ndarray, num_qo_heads: int,
                     num_kv_heads: int, num_ctas: int, *, granule: int = 16,
                     alpha: float = 1.0, beta: float = 1.0,
                     fixed_split_size: int | None = None, tile_q: int | None = None,
                     item_overhead: int = 0):
    """:func:`nbinfer.scheduler.cascade_plan`'s ``(plan, qo_start, qo_end, level)`` and the
    plan's ``item_merge``, in one compiled call (``_loops.cascade_schedule``: the virtual
    requests, their schedule, the rebuild over the real rows, the merge list of every item)
    for arguments the caller has validated: ``qo_indptr_levels`` int arrays that agree (every
    level ends at the same row), ``kv_lens`` the levels' KV lengths concatenated (int64).
    Returns None when the step needs the NumPy planner (counts past int32, huge cost keys)."""
    qo_all, qo_off = _flat_levels(qo_indptr_levels)
    wq, wkv = _weights(alpha, beta)
    (res, qo_start, qo_end, level, work, num_partials, merge_rows, merge_indptr, merge_indices,
     item_merge) = _kernels()[6](qo_all, qo_off, kv_lens, num_kv_heads,
                                 num_qo_heads // num_kv_heads, num_ctas, granule, wq, wkv,
                                 fixed_split_size or 0, tile_q or 0, int(item_overhead))
    if res[0] != _OK:
        return None
    _, blob, num_work, merge_rows_n, base_partials, tile_q_used, tile_rows, kv_chunk = res
    cta_indptr, cta_work = sched_views(blob, num_work, num_ctas, merge_rows_n,
                                       base_partials)[1:3]
    sched = Plan._from_scheduler(
        work=work, cta_indptr=cta_indptr, cta_work=cta_work, merge_rows=merge_rows,
        merge_indptr=merge_indptr, merge_indices=merge_indices,
        num_partials=int(num_partials), batch_size=qo_start.size,
        num_qo_rows=int(qo_all[qo_off[1] - 1]), num_qo_heads=int(num_qo_heads),
        num_kv_heads=int(num_kv_heads), tile_q=int(tile_q_used), tile_rows=int(tile_rows),
        kv_chunk=int(kv_chunk), granule=int(granule), causal=False,
        fixed_split_size=fixed_split_size, alpha=float(alpha), beta=float(beta),
        item_overhead=int(item_overhead))
    i32 = np.int32
    return sched, qo_start.astype(i32), qo_end.astype(i32), level, item_merge


def check_levels_fast(qo_indptr_levels, indptr_levels, last_levels) -> bool:
    """Whether a cascade's per-level lists agree (int32 query indptrs, validated page tables):
    :func:`nbinfer.reference.cascade._check_levels`'s rules in one compiled pass. False: the
    caller runs that check, which names what is wrong."""
    qo_all, qo_off = _flat_levels(qo_indptr_levels)
    if qo_all.dtype != _I32:
        return False
    return bool(_kernels()[7](qo_all, qo_off,
                              np.array([p.size for p in indptr_levels], dtype=np.int64),
                              np.array([x.size for x in last_levels], dtype=np.int64)))


def check_stage_append(batch_indices, positions, kv_indptr, kv_indices, kv_last_page_len,
                       page_size: int, num_pages: int, out: np.ndarray, offsets) -> bool:
    """An append's indices checked (:func:`nbinfer.api.append.append_paged_kv_cache`'s rules)
    and staged for its kernel in one compiled pass: ``batch_indices``, ``positions``,
    ``kv_indptr`` and the first ``kv_indptr[-1]`` page ids (one 0 when there are none) written
    to ``out`` (int32) at the four word ``offsets``. The five arrays are 1-D int32 host
    arrays. False, with ``out`` unspecified, when a rule fails: the caller's NumPy check then
    names it."""
    return bool(_kernels()[8](batch_indices, positions, kv_indptr, kv_indices,
                              kv_last_page_len, page_size, num_pages, out,
                              word_offsets(*offsets)))


def item_merge_compiled(plan: Plan) -> np.ndarray:
    """:func:`nbinfer.api.workspace.item_merge_lists` of ``plan`` in one compiled pass."""
    return _kernels()[5](plan.work[:, 6], plan.merge_indptr, plan.merge_indices,
                         plan.num_partials)


def check_and_plan(indptr, indices, last_page_len, page_size: int, names, qo_indptr,
                   num_qo_heads: int, num_kv_heads: int, num_ctas: int, *, granule: int = 16,
                   fixed_split_size: int | None = None, speculate=None):
    """:func:`check_page_table_fast` and then :func:`plan_compiled` over the table's KV
    lengths (decode: one query row per request, ``alpha = beta = 1``, not causal), in one
    compiled call for int32 host tables. Returns ``(indptr, indices, last_page_len, kv_lens,
    pages, pending, packed)``, ``pending`` a :class:`PendingPlan` (the plan and its
    ``item_merge``, built on first use); a table the loops reject goes through the NumPy
    validator, which raises its descriptive error.

    ``speculate``: ``(out, caps, offsets, header, step_at, item_merge_offset, table_offsets)``
    (:meth:`nbinfer.api.workspace.WorkspaceLayout.pack_args` after ``out``) of the layout the
    caller expects this step to take: when the plan fits it, the same call packs plan, merge
    lists and page table into ``out`` as :func:`pack_compiled` would, and ``packed`` is True.
    The caller uses ``out`` only if it then chooses that layout.
    """
    table, packed = None, False
    if _int32_vectors(indptr, indices, last_page_len) and indptr.size == qo_indptr.size > 0:
        wq, wkv = _weights(1.0, 1.0)
        args = (indptr, indices, last_page_len, page_size, qo_indptr, num_kv_heads,
                num_qo_heads // num_kv_heads, num_ctas, granule, wq, wkv,
                fixed_split_size or 0, False, 0)
        if speculate is None:
            table, res = _kernels()[3](*args)
        else:
            out, caps, _, head, _, _, table_off = speculate
            # the loop trusts these: the layout's grid, and room for its page-table sections
            if head[1] != num_ctas or out.size < table_off[2] + caps[3] or out.dtype != _I32:
                raise ValueError(f"speculate: a layout of {head[1]} CTAs and {out.size} int32 "
                                 f"words does not take a {num_ctas}-CTA plan ending at word "
                                 f"{table_off[2] + caps[3]}")
            table, res, packed = _kernels()[4](*args, *speculate)
    checked = table is not None and table[0] == _OK
    if checked:
        ptr, idx, last, kv_lens, pages = _table_of(table)
    else:
        # other dtypes or kinds, or a table the loops reject: the validator (which raises the
        # descriptive error), then the planner
        ptr, idx, last, kv_lens, pages = check_page_table_fast(indptr, indices, last_page_len,
                                                               page_size, names)
    args = (qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, granule, 1.0, 1.0,
            fixed_split_size, False, None, 0)
    if not checked:
        res = _schedule(*args)
    return ptr, idx, last, kv_lens, pages, PendingPlan(res, args), bool(packed)


_EMPTY = np.empty(0, dtype=np.int32)


# check_and_plan's ``speculate`` with the argument types WorkspaceLayout.pack_args gives, for a
# one-CTA layout whose capacities nothing fits (load() compiles that signature with it)
_NO_FIT = (np.zeros(8, dtype=np.int32), _frozen(np.zeros(7, dtype=np.int64), True),
           _frozen(np.zeros(6, dtype=np.int64), True),
           _frozen(np.array([0, 1] + [0] * 22, dtype=np.int32), True), STEP_FIELDS_AT, 0,
           _frozen(np.zeros(3, dtype=np.int64), True))
_I32 = np.dtype(np.int32)
_weights = functools.lru_cache(maxsize=16)(integer_weights)


@functools.lru_cache(maxsize=64)
def section_offsets(layout: PlanLayout) -> np.ndarray:
    """The word offsets of ``layout``'s six plan sections, in the order the pack loop takes
    them (int64, read-only)."""
    off = layout.offsets()
    return word_offsets(*(off[n] for n in ("work", "cta_indptr", "cta_work", "merge_rows",
                                           "merge_indptr", "merge_indices")))


@functools.lru_cache(maxsize=256)
def word_offsets(*offsets: int) -> np.ndarray:
    """``offsets`` as the loops take them: an int64 array, read-only (one per distinct tuple)."""
    out = np.array(offsets, dtype=np.int64)
    out.flags.writeable = False
    return out


def pack_compiled(layout: PlanLayout, sched: Plan, out: np.ndarray, *, zero_end: int = 0,
                  item_merge: np.ndarray | None = None, item_merge_offset: int = 0,
                  page_table=None, table_offsets=(0, 0, 0)) -> np.ndarray:
    """:meth:`PlanLayout.pack` of ``sched`` into ``out[:layout.size]`` in one compiled pass.

    ``out`` (int32, at least ``layout.size`` words) may be a whole staging buffer: then, in the
    same pass, ``out[layout.size:zero_end]`` is zeroed, ``item_merge`` (int32) copied to word
    ``item_merge_offset`` and the int32 arrays of ``page_table`` (``kv_indptr, kv_indices,
    kv_last_page_len``) to the word offsets ``table_offsets`` (the workspace's other sections).
    """
    size = layout.size
    if not layout.fits(sched) or out.ndim != 1 or out.size < max(size, zero_end) \
            or out.dtype != _I32:
        raise ValueError(f"the plan ({sched.num_work} items, {sched.num_merge_rows} merge rows, "
                         f"{sched.num_merge_nnz} entries, {sched.num_ctas} CTAs) or out "
                         f"({out.dtype} {out.shape}) does not fit {layout}")
    im = _EMPTY if item_merge is None else item_merge
    (ptr, idx, last), (o_ptr, o_idx, o_last) = (
        (_EMPTY, _EMPTY, _EMPTY) if page_table is None else page_table), table_offsets
    n = out.size  # (plain comparisons: this runs in every decode plan())
    if (min(item_merge_offset, o_ptr, o_idx, o_last) < 0 or item_merge_offset + im.size > n
            or o_ptr + ptr.size > n or o_idx + idx.size > n or o_last + last.size > n
            or im.dtype != _I32 or ptr.dtype != _I32 or idx.dtype != _I32
            or last.dtype != _I32):
        raise ValueError(f"item_merge and the page table (int32, at words {item_merge_offset} "
                         f"and {list(table_offsets)}) do not fit out ({n} words)")
    _kernels()[1](out, size, section_offsets(layout), layout.header(sched), sched.work,
                  sched.cta_indptr, sched.cta_work, sched.merge_rows, sched.merge_indptr,
                  sched.merge_indices, layout.max_merge_rows, max(zero_end, size), im,
                  item_merge_offset, ptr, idx, last, word_offsets(o_ptr, o_idx, o_last))
    return out


# the loops hard-code these
assert WORK_FIELDS == 7 and INT32_MAX == 2147483647
assert STEP_FIELDS == ("num_work", "num_merge_rows", "num_merge_nnz", "num_partials",
                       "batch_size", "num_qo_rows", "tile_q", "tile_rows", "kv_chunk")
