"""The lessons' exercises: a task, a stub the student fills in, and a check that says what is
wrong.

Each lesson with an exercise ends with a stub (a function that raises ``NotImplementedError``)
and :func:`attempt` of its ``check_*`` here. A check runs the student's function on fresh cases, the
hard ones included (empty states, huge logits, partly filled pages, hooks that must compose),
compares with nbinfer's float64 reference, and raises :class:`ExerciseFailed` naming the first
case that breaks and what to look at; it returns a short report when everything passes. The
solutions live in ``tests/test_exercises.py``, which also feeds every check a wrong solution, so
CI proves each exercise solvable and each check able to fail.

- lesson 01, :func:`check_merge`: merge two attention states;
- lesson 02, :func:`check_token_slots`: the physical slots a request reads, from a page table;
- lesson 04, :func:`check_gather_kernel`: the shared-memory gather kernel (v2) in the
  simulator, within a budget of global and shared reads counted by :func:`gload` and
  :func:`sload`;
- lesson 05, :func:`check_distance_penalty`: a variant from two hooks (a logits transform and a
  mask) closed over its constants.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ExerciseFailed", "attempt", "check_distance_penalty", "check_gather_kernel",
           "check_merge", "check_token_slots", "gload", "sload"]


class ExerciseFailed(AssertionError):
    """A check found a case the student's function gets wrong (the message says which)."""


def attempt(check, fn) -> str:
    """Run ``check(fn)``: its report when ``fn`` passes, a reminder while ``fn`` is still the
    lesson's stub (raises NotImplementedError); :class:`ExerciseFailed` when it is wrong."""
    try:
        return check(fn)
    except NotImplementedError:
        return (f"{fn.__name__}: not done yet (it raises NotImplementedError); fill it in and "
                f"run this cell again")


def _fail(case: str, hint: str):
    raise ExerciseFailed(f"{case}: {hint}")


# -- lesson 01 ---------------------------------------------------------------------------------
def check_merge(merge, *, seed: int = 0) -> str:
    """Check ``merge(o_a, lse_a, o_b, lse_b) -> (o, lse)``, the merge operator of lesson 01.

    Inputs are float64 ``o [N, H, D]`` and ``lse [N, H]`` (natural log, ``-inf`` for a state
    over no keys); the result must equal :func:`nbinfer.reference.merge_state` to 1e-12
    relative, on random states, with an empty state on either side or both, with LSEs near
    1000 (where ``exp(lse)`` overflows), and merged in either order.
    """
    from . import reference

    rng = np.random.default_rng(seed)
    n, h, d = 3, 2, 8

    def state(scale=1.0, shift=0.0):
        return rng.standard_normal((n, h, d)), rng.standard_normal((n, h)) * scale + shift

    empty = (np.zeros((n, h, d)), np.full((n, h), -np.inf))
    cases = [("two random states", state(), state(), "check the weights exp(lse_a - lse) and "
              "exp(lse_b - lse)"),
             ("states of very different weight", state(), state(shift=30.0),
              "the heavier state should dominate"),
             ("LSEs near 1000", state(shift=1000.0), state(shift=1000.0),
              "exp(1000) overflows: subtract the larger LSE before exponentiating"),
             ("the second state empty (LSE = -inf)", state(), empty,
              "merging an empty state must change nothing (weight exp(-inf) = 0)"),
             ("the first state empty", empty, state(), "the empty state is the identity on "
              "either side"),
             ("both states empty", empty, empty, "the result is the empty state (O = 0, "
              "LSE = -inf), not NaN: guard the max of two -inf")]
    for name, (oa, sa), (ob, sb), hint in cases:
        want_o, want_s = reference.merge_state(oa, sa, ob, sb)
        try:
            got = merge(oa.copy(), sa.copy(), ob.copy(), sb.copy())
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - tell the student which case raised
            _fail(name, f"raised {type(exc).__name__}: {exc}")
        if not (isinstance(got, tuple) and len(got) == 2):
            _fail(name, "return a pair (o, lse)")
        o, s = (np.asarray(x, dtype=np.float64) for x in got)
        if o.shape != want_o.shape or s.shape != want_s.shape:
            _fail(name, f"shapes {o.shape}, {s.shape}; expected {want_o.shape}, {want_s.shape}")
        if np.isnan(o).any() or np.isnan(s).any():
            _fail(name, f"NaN in the result; {hint}")
        if not np.array_equal(np.isneginf(s), np.isneginf(want_s)) or not np.allclose(
                s[np.isfinite(want_s)], want_s[np.isfinite(want_s)], rtol=1e-12, atol=1e-12):
            _fail(name, f"LSE wrong (max error {np.nanmax(np.abs(s - want_s)):.3g}); {hint}")
        if not np.allclose(o, want_o, rtol=1e-12, atol=1e-12):
            _fail(name, f"O wrong (max error {np.abs(o - want_o).max():.3g}); {hint}")
    oa, sa = state()
    ob, sb = state()
    try:
        ab, ba = merge(oa, sa, ob, sb), merge(ob, sb, oa, sa)
    except Exception as exc:  # noqa: BLE001
        _fail("a ⊕ b against b ⊕ a", f"raised {type(exc).__name__}: {exc}")
    if not (np.allclose(ab[0], ba[0], rtol=1e-12, atol=1e-12)
            and np.allclose(ab[1], ba[1], rtol=1e-12, atol=1e-12)):
        _fail("a ⊕ b against b ⊕ a", "the merge must be commutative (O and LSE)")
    return f"merge: all {len(cases) + 1} cases match the reference"


# -- lesson 02 ---------------------------------------------------------------------------------
def check_token_slots(token_slots, *, seed: int = 0) -> str:
    """Check ``token_slots(indptr, indices, last_page_len, page_size, b) -> slots``: the
    physical slot ids ``page * page_size + offset`` of request ``b``'s tokens, in logical
    order (int array of ``kv_len`` entries), against :meth:`nbinfer.PageTable.token_slots`;
    pages in random places of the pool, partly filled last pages, page size 1, an empty
    request.
    """
    from .formats import PageTable

    rng = np.random.default_rng(seed)
    tables = [("random pool, page size 4", PageTable.from_kv_lens([9, 4, 13], 4, rng=rng)),
              ("page size 1", PageTable.from_kv_lens([3, 5], 1, rng=rng)),
              ("full last pages", PageTable.from_kv_lens([8, 16], 8, rng=rng)),
              ("an empty request", PageTable(np.array([0, 2, 2, 3]), np.array([5, 1, 7]),
                                             np.array([3, 0, 2]), 4, 8))]
    for name, pt in tables:
        for b in range(pt.batch_size):
            want = pt.token_slots(b)
            case = f"{name}, request {b}"
            try:
                got = np.asarray(token_slots(pt.indptr.copy(), pt.indices.copy(),
                                             pt.last_page_len.copy(), pt.page_size, b))
            except NotImplementedError:
                raise
            except Exception as exc:  # noqa: BLE001
                _fail(case, f"raised {type(exc).__name__}: {exc}")
            if got.shape != want.shape:
                hint = ("the last page holds only last_page_len tokens" if got.size > want.size
                        else "every page before the last is full")
                _fail(case, f"{got.size} slots, expected {want.size}: {hint}")
            if not np.array_equal(np.sort(got), np.sort(want)):
                _fail(case, "wrong slots: page kv_indices[kv_indptr[b] + t // page_size], "
                            "offset t % page_size")
            if not np.array_equal(got, want):
                _fail(case, "the right slots in the wrong order: logical token order")
    return f"token_slots: all requests of {len(tables)} page tables match"


# -- lesson 05 ---------------------------------------------------------------------------------
def check_distance_penalty(make_variant, *, seed: int = 0) -> str:
    """Check ``make_variant(slope, window) -> Variant``: logits lowered by
    ``slope * (q_pos - kv_pos)`` (a linear distance penalty, ALiBi-like with one slope for every
    head) and keys more than ``window`` positions left of the query masked out, both as hooks
    closed over float32 / int constants.

    Checked on causal prefill through :func:`nbinfer.reference.single_prefill_with_kv_cache`
    against the formula in NumPy, for two settings; equal arguments must give equal variants
    (one compiled kernel), different ones different variants.
    """
    from . import reference
    from .variants import Variant

    rng = np.random.default_rng(seed)
    qo_len, kv_len, h, d = 5, 12, 2, 16
    q = rng.standard_normal((qo_len, h, d))
    k, v = rng.standard_normal((kv_len, h, d)), rng.standard_normal((kv_len, h, d))
    scale = 1 / math.sqrt(d)
    for slope, window in ((0.5, 4), (0.125, 100)):
        case = f"slope {slope}, window {window}"
        try:
            var = make_variant(slope, window)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            _fail(case, f"raised {type(exc).__name__}: {exc}")
        if not isinstance(var, Variant):
            _fail(case, f"return a nbinfer.variants.Variant, got {type(var).__name__}")
        try:
            got = reference.single_prefill_with_kv_cache(q, k, v, causal=True, variant=var)
        except Exception as exc:  # noqa: BLE001 - hooks Numba cannot compile, for one
            _fail(case, f"the reference engine could not run the variant: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        q_pos = np.arange(kv_len - qo_len, kv_len)[:, None]  # queries are the last rows
        kv_pos = np.arange(kv_len)[None, :]
        s = np.einsum("qhd,khd->hqk", q, k) * scale - slope * (q_pos - kv_pos)
        keep = (kv_pos <= q_pos) & (kv_pos >= q_pos - window)
        s = np.where(keep, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)
        if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            window_drops = ((kv_pos <= q_pos) & (kv_pos < q_pos - window)).any()
            _fail(case, "output differs from softmax(q.k * sm_scale - slope * (q_pos - "
                        "kv_pos)) over keys with q_pos - window <= kv_pos <= q_pos"
                        + ("; is the window mask there?" if window_drops else ""))
    if make_variant(0.5, 4) != make_variant(0.5, 4):
        _fail("equal arguments", "two calls with the same slope and window must give equal "
                                 "variants (close over the values, not over mutable objects)")
    if make_variant(0.5, 4) == make_variant(0.25, 4) or \
            make_variant(0.5, 4) == make_variant(0.5, 8):
        _fail("different arguments", "a different slope or window must give a different "
                                     "variant (capture them in the hooks, and in params)")
    return "distance penalty: both settings match the formula; variants compare by value"


# -- lesson 04 ---------------------------------------------------------------------------------
def gload(kv, page, which, slot, head, d, reads, thread):
    """``kv[page, which, slot, head, d]`` (a global-memory load of K (``which`` 0) or V (1)),
    counted in ``reads[thread, 0]``. For the simulator: call it from the exercise's kernel."""
    reads[thread, 0] += 1
    return kv[page, which, slot, head, d]


def sload(tile, row, d, reads, thread):
    """``tile[row, d]`` (a shared-memory load), counted in ``reads[thread, 1]``."""
    reads[thread, 1] += 1
    return tile[row, d]


def check_gather_kernel(make_kernel, *, seed: int = 0) -> str:
    """Check lesson 04's exercise: ``make_kernel(head_dim, group, page_size, num_threads)``
    returns a simulator kernel ``(q, kv, kv_indptr, kv_indices, kv_last, o, lse, sm_scale,
    reads)`` launched with one block of ``num_threads`` per (request, KV head), block
    ``b * Hkv + hk``, that decodes every query head of the group.

    Every load of K or V from ``kv`` goes through :func:`gload` and every load from a shared
    tile through :func:`sload` (with ``thread = blockIdx.x * blockDim.x + threadIdx.x``); the
    check runs the kernel in Numba's CUDA simulator on two GQA groups and requires the float64
    reference's output and LSE (float32 tolerance), global reads equal to the KV footprint
    (each K and V element of each KV head once) and shared reads at most ``G`` times it.
    """
    from numba.core import config

    from . import reference
    from .formats import PageTable

    if not config.ENABLE_CUDASIM:
        raise RuntimeError("check_gather_kernel runs the kernel in Numba's CUDA simulator: set "
                           "NUMBA_ENABLE_CUDASIM=1 before numba loads (the lesson does)")
    rng = np.random.default_rng(seed)
    d, hkv, page, threads = 16, 2, 4, 8
    for group in (2, 4):
        hq = hkv * group
        pt = PageTable.from_kv_lens([5, 9], page, rng=rng)
        kv = rng.standard_normal((pt.num_pages, 2, page, hkv, d)).astype(np.float32)
        q = rng.standard_normal((pt.batch_size, hq, d)).astype(np.float32)
        want_o, want_lse = reference.batch_decode_with_paged_kv_cache(
            q, kv, pt.indptr, pt.indices, pt.last_page_len, return_lse=True)
        o = np.zeros_like(q)
        lse = np.zeros((pt.batch_size, hq), np.float32)
        blocks = pt.batch_size * hkv
        reads = np.zeros((blocks * threads, 2), np.int64)
        case = f"G = {group}"
        try:
            kernel = make_kernel(d, group, page, threads)
            kernel[blocks, threads](q, kv, *(np.array(a, np.int32) for a in (
                pt.indptr, pt.indices, pt.last_page_len)), o, lse, np.float32(1 / math.sqrt(d)),
                reads)
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001
            _fail(case, f"raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
        err = np.abs(o - want_o).max() / np.abs(want_o).max()
        if not err <= 1e-5:
            _fail(case, f"output off by {err:.2g} (relative): check the online-softmax update "
                        "(rescale the old state by exp(m_old - m_new)) and which rows each "
                        "thread owns")
        if not np.abs(lse - want_lse).max() <= 1e-4:
            _fail(case, "LSE wrong: lse = m + log(l)")
        footprint = int(pt.kv_lens().sum()) * hkv * 2 * d
        g, sh = int(reads[:, 0].sum()), int(reads[:, 1].sum())
        if g != footprint:
            _fail(case, f"{g} global reads, the footprint is {footprint} ({g / footprint:.2g} x):"
                        " copy each K and V element into shared memory once per block, and read"
                        " it from there" if g > footprint else
                        f"{g} global reads < footprint {footprint}: are all loads counted "
                        "(gload)?")
        if sh > group * footprint:
            _fail(case, f"{sh} shared reads, budget {group * footprint}: each query head needs "
                        "each K and V element of its group once")
        if sh == 0:
            _fail(case, "no shared reads counted: read the tiles through sload")
    return ("gather kernel: both groups match the reference; global reads = footprint, "
            "shared reads <= G x footprint")
