"""Table-driven fuzz of bad inputs and edge cases over every public entry point (issue 11).

Each case is a small function plus an expectation:

- ``Raises(names)``: a ValueError/TypeError (RuntimeError where the rule says so) whose message
  names one of ``names`` as a whole word (``out`` does not match ``output``, ``q`` does not match
  ``q_data_type``);
- ``MATCHES``: the function returns :class:`Cmp` objects, comparisons of what the entry point
  returned (or wrote) with the float64 reference engine, by relative error within the one
  tolerance table keyed by dtype (``conftest.TOLERANCE``), NaN and infinite positions exactly.
  Where an input holds NaN, the expectation is the reference on the clean input with NaN laid
  over the (row, head) entries that read it, so the reference's own NaN handling is tested
  through ``backend="reference"`` rather than trusted.

Case ids start with the rule of issue 11 they test: ``r1`` integers range-checked before the
int32 narrowing, ``r2`` output buffers, ``r3`` strided inputs, ``r4`` non-finite values, ``r5``
BSR formats, ``r6`` plan state, ``r7`` variants x GQA group sizes, ``r8`` errors that name the
argument, ``r9`` the backend name; ``x`` are ordinary bad inputs and ``fmt`` the formats' own
checks. Attention cases run on the kernels (``backend="sim"`` in the simulator) and on
``backend="reference"``. A failing case says which way it failed: ``NO ERROR``, ``WRONG ERROR``,
``WRONG RESULT``, ``RAISED`` (a result case that raised) or ``WROTE`` (a rejected call that
changed its in-place arguments).

Shapes are tiny (head_dim 64, page_size 4, a few tokens, 1-3 requests): a kernel launch costs
about a second in the simulator, and most error cases raise before any launch.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import SIMULATOR, TOLERANCE

import nbinfer
from nbinfer import formats, reference
from nbinfer import variants as V
from nbinfer.formats import BSR, PageTable, RadixTree

D, PS = 64, 4  # the smallest head_dim the kernels take; tokens per page
F32, F16 = np.float32, np.float16
KERNEL = "sim" if SIMULATOR else "cuda"
BOTH = (KERNEL, "reference")
NONE = (None,)  # entry points without a backend (formats, index helpers)
BIG = 2**32  # added to an int64 index, it survives a wrapping cast to int32 unchanged


# ---------------------------------------------------------------------------------------------
# The table and its expectations
@dataclass(frozen=True)
class Raises:
    names: tuple  # the message must name one of these
    types: tuple = (ValueError, TypeError)


MATCHES = "matches"


@dataclass(frozen=True)
class Case:
    id: str
    fn: Callable  # fn(backend, rng) -> list[Cmp] (MATCHES) or anything (Raises)
    expect: object
    backends: tuple


@dataclass
class Cmp:
    """``got`` must equal ``want`` within ``TOLERANCE[dtype]`` (``"exact"``: bit for bit).

    ``nan``: where ``got`` must be NaN (default: where ``want`` is); every other entry must be
    finite where ``want`` is, and equal to it. ``ignore``: entries not checked at all."""

    label: str
    got: object
    want: object
    dtype: str
    nan: object = None
    ignore: object = None

    def check(self):
        got = np.asarray(self.got)
        want = np.asarray(self.want)
        if got.shape != want.shape:
            raise AssertionError(f"WRONG RESULT: {self.label} has shape {got.shape}, the "
                                 f"reference {want.shape}")
        if self.dtype == "exact":
            if not np.array_equal(got, want, equal_nan=True):
                bad = np.argwhere(got != want)[:4].tolist()
                raise AssertionError(f"WRONG RESULT: {self.label} differs from the reference "
                                     f"at {bad}")
            return
        got, want = got.astype(np.float64), want.astype(np.float64)
        nan = np.isnan(want) if self.nan is None else np.broadcast_to(self.nan, want.shape)
        if self.ignore is not None:  # unchecked entries: made equal and finite
            ign = np.broadcast_to(self.ignore, want.shape)
            got, want, nan = np.where(ign, 0.0, got), np.where(ign, 0.0, want), nan & ~ign
        if not np.array_equal(np.isnan(got), nan):
            missing = np.argwhere(nan & ~np.isnan(got))[:4].tolist()
            extra = np.argwhere(~nan & np.isnan(got))[:4].tolist()
            raise AssertionError(f"WRONG RESULT: {self.label}: NaN expected but absent at "
                                 f"{missing}, NaN not expected but present at {extra}")
        keep = ~nan
        inf = np.isinf(want) & keep
        if not np.array_equal(np.isinf(got) & keep, inf) or \
                not np.array_equal(got[inf], want[inf]):
            raise AssertionError(f"WRONG RESULT: {self.label}: infinities differ from the "
                                 f"reference at {np.argwhere(np.isinf(got) != inf)[:4].tolist()}")
        fin = keep & ~inf
        num = np.linalg.norm(got[fin] - want[fin])
        den = np.linalg.norm(want[fin])
        err = num / den if den > 0 else num
        tol = TOLERANCE[self.dtype]
        if not err <= tol:
            raise AssertionError(f"WRONG RESULT: {self.label} relative error {err:.3e} > "
                                 f"{tol:.0e} ({self.dtype})")


CASES: list[Case] = []


def err(case_id, fn, *names, types=(ValueError, TypeError), backends=BOTH):
    CASES.append(Case(case_id, fn, Raises(names, types), backends))


def ok(case_id, fn, backends=BOTH):
    CASES.append(Case(case_id, fn, MATCHES, backends))


def _names(message: str, names) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message)
               for n in names)


def _summary(res) -> str:
    if isinstance(res, tuple):
        return "(" + ", ".join(_summary(r) for r in res) + ")"
    if isinstance(res, np.ndarray):
        return f"array{res.shape} {res.dtype}"
    return type(res).__name__


def _resolve(x, p):
    return x(p) if callable(x) else dict(x or {})


def _dt(dtype) -> str:
    return np.dtype(dtype).name


def _rand(rng, shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def _ws():
    return np.zeros(1 << 22, np.uint8)


def _pair(label, got, want, dtype, nan=None, lse=True, ignore_rows=None):
    """Comparisons of an ``(out, lse)`` result; ``nan`` marks NaN (row, head, d) entries,
    ``ignore_rows`` query rows left unchecked."""
    out, got_lse = got if isinstance(got, tuple) else (got, None)
    ref, ref_lse = want if isinstance(want, tuple) else (want, None)
    ign = None
    if ignore_rows is not None:
        ign = np.zeros(np.shape(ref)[0], bool)
        ign[list(ignore_rows)] = True
    cmps = [Cmp(f"{label} out", out, ref, _dt(dtype), nan,
                None if ign is None else ign[:, None, None])]
    if lse and got_lse is not None:
        lse_nan = None if nan is None else np.asarray(nan).any(axis=-1)
        cmps.append(Cmp(f"{label} lse", got_lse, ref_lse, "float32" if _dt(dtype) != "float16"
                        else "float16", lse_nan, None if ign is None else ign[:, None]))
    return cmps


def _same_buffer(res, buf) -> bool:
    return res is buf or (isinstance(res, np.ndarray) and res.shape == buf.shape
                          and np.shares_memory(res, buf))


# ---------------------------------------------------------------------------------------------
# Problems: small random inputs (never zeros) and valid calls of every entry point
def _decode(rng, kv_lens=(5, 7), hq=2, hkv=1, dtype=F32, extra=2):
    need = sum(-(-n // PS) for n in kv_lens)
    pt = PageTable.from_kv_lens(list(kv_lens), PS, num_pages=need + extra, rng=rng)
    return SimpleNamespace(
        indptr=np.array(pt.indptr), indices=np.array(pt.indices),
        last=np.array(pt.last_page_len), num_pages=pt.num_pages,
        cache=_rand(rng, (pt.num_pages, 2, PS, hkv, D), dtype),
        q=_rand(rng, (len(kv_lens), hq, D), dtype), hq=hq, hkv=hkv, dtype=dtype)


DECODE_PLAN = ("indptr", "indices", "last_page_len", "num_qo_heads", "num_kv_heads", "head_dim",
               "page_size")


def decode_plan(w, p, plan=None):
    a = dict(indptr=p.indptr, indices=p.indices, last_page_len=p.last, num_qo_heads=p.hq,
             num_kv_heads=p.hkv, head_dim=D, page_size=PS, q_data_type=_dt(p.dtype))
    a.update(plan or {})
    w.plan(*[a.pop(n) for n in DECODE_PLAN], **a)


def decode_run(p, backend, plan=None, run=None, ws=None, wrapper=None, layout="NHD"):
    w = wrapper or nbinfer.BatchDecodeWithPagedKVCacheWrapper(_ws() if ws is None else ws,
                                                              layout, backend=backend)
    decode_plan(w, p, plan)
    r = dict(return_lse=True)
    r.update(run or {})
    return w.run(r.pop("q", p.q), r.pop("paged_kv_cache", p.cache), **r)


def decode_ref(p, q=None, cache=None, indices=None, **kw):
    return reference.batch_decode_with_paged_kv_cache(
        p.q if q is None else q, p.cache if cache is None else cache, p.indptr,
        p.indices if indices is None else indices, p.last, return_lse=True, **kw)


def decode_err(plan=None, run=None, **problem):
    def fn(backend, rng):
        p = _decode(rng, **problem)
        return decode_run(p, backend, _resolve(plan, p), _resolve(run, p))
    return fn


def _prefill(rng, qo_lens=(2, 3), kv_lens=(5, 7), hq=2, hkv=1, dtype=F32, extra=2):
    p = _decode(rng, kv_lens, hq, hkv, dtype, extra)
    p.qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    p.q = _rand(rng, (int(p.qo_indptr[-1]), hq, D), dtype)
    return p


PREFILL_PLAN = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size")


def prefill_plan(w, p, plan=None):
    a = dict(qo_indptr=p.qo_indptr, paged_kv_indptr=p.indptr, paged_kv_indices=p.indices,
             paged_kv_last_page_len=p.last, num_qo_heads=p.hq, num_kv_heads=p.hkv,
             head_dim_qk=D, page_size=PS, q_data_type=_dt(p.dtype))
    a.update(plan or {})
    w.plan(*[a.pop(n) for n in PREFILL_PLAN], **a)


def prefill_run(p, backend, plan=None, run=None, ws=None, wrapper=None):
    w = wrapper or nbinfer.BatchPrefillWithPagedKVCacheWrapper(_ws() if ws is None else ws,
                                                               "NHD", backend=backend)
    prefill_plan(w, p, plan)
    r = dict(return_lse=True)
    r.update(run or {})
    return w.run(r.pop("q", p.q), r.pop("paged_kv_cache", p.cache), **r)


def prefill_ref(p, q=None, cache=None, indices=None, qo_indptr=None, last=None, **kw):
    return reference.batch_prefill_with_paged_kv_cache(
        p.q if q is None else q, p.qo_indptr if qo_indptr is None else qo_indptr,
        p.cache if cache is None else cache, p.indptr, p.indices if indices is None else indices,
        p.last if last is None else last, return_lse=True, **kw)


def prefill_err(plan=None, run=None, **problem):
    def fn(backend, rng):
        p = _prefill(rng, **problem)
        return prefill_run(p, backend, _resolve(plan, p), _resolve(run, p))
    return fn


def _ragged(rng, qo_lens=(2, 3), kv_lens=(4, 6), hq=2, hkv=1, dtype=F32):
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    return SimpleNamespace(qo_indptr=qo, kv_indptr=kv, q=_rand(rng, (int(qo[-1]), hq, D), dtype),
                           k=_rand(rng, (int(kv[-1]), hkv, D), dtype),
                           v=_rand(rng, (int(kv[-1]), hkv, D), dtype), hq=hq, hkv=hkv,
                           dtype=dtype)


RAGGED_PLAN = ("qo_indptr", "kv_indptr", "num_qo_heads", "num_kv_heads", "head_dim_qk")


def ragged_run(p, backend, plan=None, run=None, ws=None):
    w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(_ws() if ws is None else ws, "NHD",
                                                     backend=backend)
    a = dict(qo_indptr=p.qo_indptr, kv_indptr=p.kv_indptr, num_qo_heads=p.hq,
             num_kv_heads=p.hkv, head_dim_qk=D, q_data_type=_dt(p.dtype))
    a.update(plan or {})
    w.plan(*[a.pop(n) for n in RAGGED_PLAN], **a)
    r = dict(return_lse=True)
    r.update(run or {})
    return w.run(r.pop("q", p.q), r.pop("k", p.k), r.pop("v", p.v), **r)


def ragged_ref(p, q=None, k=None, v=None, **kw):
    return reference.batch_prefill_with_ragged_kv_cache(
        p.q if q is None else q, p.k if k is None else k, p.v if v is None else v, p.qo_indptr,
        p.kv_indptr, return_lse=True, **kw)


def ragged_err(plan=None, run=None, **problem):
    def fn(backend, rng):
        p = _ragged(rng, **problem)
        return ragged_run(p, backend, _resolve(plan, p), _resolve(run, p))
    return fn


def _sparse(rng, hq=2, hkv=1, dtype=F32):
    """M 6 queries x N 11 keys in (2, 4) blocks: 3 block rows, 3 block columns (last partial)."""
    return SimpleNamespace(indptr=np.array([0, 2, 3, 5], np.int32),
                           indices=np.array([0, 2, 1, 0, 2], np.int32), M=6, N=11, R=2, C=4,
                           q=_rand(rng, (6, hq, D), dtype), k=_rand(rng, (11, hkv, D), dtype),
                           v=_rand(rng, (11, hkv, D), dtype), hq=hq, hkv=hkv, dtype=dtype)


SPARSE_PLAN = ("indptr", "indices", "M", "N", "R", "C", "num_qo_heads", "num_kv_heads",
               "head_dim")


def sparse_plan(w, p, plan=None):
    a = dict(indptr=p.indptr, indices=p.indices, M=p.M, N=p.N, R=p.R, C=p.C, num_qo_heads=p.hq,
             num_kv_heads=p.hkv, head_dim=D, q_data_type=_dt(p.dtype))
    a.update(plan or {})
    w.plan(*[a.pop(n) for n in SPARSE_PLAN], **a)


def sparse_run(p, backend, plan=None, run=None, ws=None):
    w = nbinfer.BlockSparseAttentionWrapper(_ws() if ws is None else ws, backend=backend)
    sparse_plan(w, p, plan)
    r = dict(return_lse=True)
    r.update(run or {})
    return w.run(r.pop("q", p.q), r.pop("k", p.k), r.pop("v", p.v), **r)


def sparse_ref(p, q=None, k=None, v=None, indptr=None, indices=None, **kw):
    return reference.block_sparse_attention(
        p.q if q is None else q, p.k if k is None else k, p.v if v is None else v,
        p.indptr if indptr is None else indptr, p.indices if indices is None else indices,
        p.R, p.C, return_lse=True, **kw)


def sparse_err(plan=None, run=None, **problem):
    def fn(backend, rng):
        p = _sparse(rng, **problem)
        return sparse_run(p, backend, _resolve(plan, p), _resolve(run, p))
    return fn


def _cascade(rng, hq=2, hkv=1, dtype=F32):
    """Two decode rows sharing a prefix of 8 tokens (level 0), then 3 and 6 own tokens."""
    pages = rng.permutation(7).astype(np.int32)
    return SimpleNamespace(
        qo=[np.array([0, 2], np.int32), np.array([0, 1, 2], np.int32)],
        indptr=[np.array([0, 2], np.int32), np.array([0, 1, 3], np.int32)],
        indices=[pages[:2].copy(), pages[2:5].copy()],
        last=[np.array([4], np.int32), np.array([3, 2], np.int32)],
        cache=_rand(rng, (7, 2, PS, hkv, D), dtype), q=_rand(rng, (2, hq, D), dtype), hq=hq,
        hkv=hkv, dtype=dtype)


CASCADE_PLAN = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr",
                "paged_kv_last_page_len", "num_qo_heads", "num_kv_heads", "head_dim", "page_size")


def cascade_plan(w, p, plan=None):
    a = dict(qo_indptr_arr=p.qo, paged_kv_indptr_arr=p.indptr, paged_kv_indices_arr=p.indices,
             paged_kv_last_page_len=p.last, num_qo_heads=p.hq, num_kv_heads=p.hkv, head_dim=D,
             page_size=PS, q_data_type=_dt(p.dtype))
    a.update(plan or {})
    w.plan(*[a.pop(n) for n in CASCADE_PLAN], **a)


def cascade_run(p, backend, plan=None, ws=None, levels=2):
    w = nbinfer.MultiLevelCascadeAttentionWrapper(levels, _ws() if ws is None else ws, "NHD",
                                                  backend=backend)
    cascade_plan(w, p, plan)
    return w.run(p.q, p.cache, return_lse=True)


def cascade_ref(p):
    return reference.multi_level_cascade_attention(p.q, p.qo, p.cache, p.indptr, p.indices,
                                                   p.last, return_lse=True)


def cascade_err(plan=None, levels=2):
    def fn(backend, rng):
        p = _cascade(rng)
        return cascade_run(p, backend, _resolve(plan, p), levels=levels)
    return fn


def _append(rng, dtype=F32, hkv=1):
    """Two requests of 6 and 3 tokens after appending 2 and 3 of them; 5 pages, 2 unused."""
    pt = PageTable.from_kv_lens([6, 3], PS, num_pages=5, rng=rng)
    bi, pos = reference.get_batch_indices_positions(np.array([0, 2, 5]), np.array([6, 3]), 5)
    return SimpleNamespace(indptr=np.array(pt.indptr), indices=np.array(pt.indices),
                           last=np.array(pt.last_page_len), batch_indices=bi, positions=pos,
                           cache=_rand(rng, (5, 2, PS, hkv, D), dtype),
                           key=_rand(rng, (5, hkv, D), dtype), value=_rand(rng, (5, hkv, D), dtype),
                           dtype=dtype)


APPEND_ARGS = ("append_key", "append_value", "batch_indices", "positions", "paged_kv_cache",
               "kv_indices", "kv_indptr", "kv_last_page_len", "kv_layout")


def append_call(p, backend, **over):
    a = dict(append_key=p.key, append_value=p.value, batch_indices=p.batch_indices,
             positions=p.positions, paged_kv_cache=p.cache, kv_indices=p.indices,
             kv_indptr=p.indptr, kv_last_page_len=p.last, kv_layout="NHD")
    a.update(over)
    kw = {} if backend is None else dict(backend=backend)
    return nbinfer.append_paged_kv_cache(*[a.pop(n) for n in APPEND_ARGS], **kw, **a)


def append_ref(p, cache, indices=None, **over):
    """The reference append into ``cache`` (a copy the caller made)."""
    reference.append_paged_kv_cache(
        over.get("append_key", p.key), over.get("append_value", p.value), p.batch_indices,
        p.positions, cache, p.indices if indices is None else indices, p.indptr, p.last)


def append_rejected(over):
    """The append must raise, and leave every cache array bit-identical."""
    def fn(backend, rng):
        p = _append(rng)
        o = _resolve(over, p)
        cache = o.get("paged_kv_cache", p.cache)
        caches = list(cache) if isinstance(cache, (tuple, list)) else [cache]
        before = [c.tobytes() for c in caches]
        try:
            append_call(p, backend, **o)
        except Exception as e:
            if any(c.tobytes() != b for c, b in zip(caches, before, strict=True)):
                raise AssertionError(f"WROTE: the rejected append ({type(e).__name__}: {e}) "
                                     f"changed the cache") from e
            raise
        return None
    return fn


def _states(rng, rows=3, heads=2, dtype=F32, states=None):
    if states is None:
        return (_rand(rng, (rows, heads, D), dtype), (2 * rng.standard_normal((rows, heads))
                                                      ).astype(F32))
    return (_rand(rng, (rows, states, heads, D), dtype),
            (2 * rng.standard_normal((rows, states, heads))).astype(F32))


def merge_pair_err(change):
    def fn(backend, rng):
        a = dict(zip(("v_a", "s_a"), _states(rng), strict=True))
        a.update(zip(("v_b", "s_b"), _states(rng), strict=True))
        a.update(change(a))
        return nbinfer.merge_state(a["v_a"], a["s_a"], a["v_b"], a["s_b"], backend=backend)
    return fn


def merge_in_place_err(change, mask=None):
    def fn(backend, rng):
        a = dict(zip(("v", "s"), _states(rng), strict=True))
        a.update(zip(("v_other", "s_other"), _states(rng), strict=True))
        a.update(change(a))
        return nbinfer.merge_state_in_place(a["v"], a["s"], a["v_other"], a["s_other"],
                                            a.get("mask"), backend=backend)
    return fn


def merge_states_err(change):
    def fn(backend, rng):
        a = dict(zip(("v", "s"), _states(rng, states=3), strict=True))
        a.update(change(a))
        return nbinfer.merge_states(a["v"], a["s"], backend=backend)
    return fn


def _readonly(a):
    a = a.copy()
    a.setflags(write=False)
    return a


def _fortran(shape, dtype):
    return np.asfortranarray(np.random.default_rng(1).standard_normal(shape).astype(dtype))


def _strided(shape, dtype, axis=0):
    big = list(shape)
    big[axis] *= 2
    sl = [slice(None)] * len(shape)
    sl[axis] = slice(None, None, 2)
    return np.random.default_rng(2).standard_normal(big).astype(dtype)[tuple(sl)]


def _with(a, i, value, dtype=None):
    a = np.array(a, dtype=dtype or np.asarray(a).dtype)
    a[i] = value
    return a


# =============================================================================================
# Rule 1: integer index arrays of any dtype are range-checked before the int32 narrowing
err("r1-decode-indices-int64-2^32-wraps", decode_err(
    plan=lambda p: dict(indices=p.indices.astype(np.int64) + BIG)), "indices")
err("r1-decode-indices-negative", decode_err(
    plan=lambda p: dict(indices=_with(p.indices, 0, -1))), "indices")
err("r1-decode-indptr-int64-2^32-wraps", decode_err(
    plan=lambda p: dict(indptr=_with(p.indptr, -1, int(p.indptr[-1]) + BIG, np.int64))),
    "indptr")
err("r1-decode-last_page_len-int64-2^32-wraps", decode_err(
    plan=lambda p: dict(last_page_len=p.last.astype(np.int64) + BIG)), "last_page_len")
err("r1-decode-indices-uint32-above-int32-max", decode_err(
    plan=lambda p: dict(indices=_with(p.indices.astype(np.uint32), 0, 2**31 + 1))), "indices")
err("r1-prefill-qo_indptr-int64-2^32-wraps", prefill_err(
    plan=lambda p: dict(qo_indptr=_with(p.qo_indptr, -1, int(p.qo_indptr[-1]) + BIG,
                                        np.int64))), "qo_indptr")
err("r1-prefill-paged_kv_indices-int64-2^32-wraps", prefill_err(
    plan=lambda p: dict(paged_kv_indices=p.indices.astype(np.int64) + BIG)), "paged_kv_indices")
err("r1-ragged-kv_indptr-int64-2^32-wraps", ragged_err(
    plan=lambda p: dict(kv_indptr=_with(p.kv_indptr, -1, int(p.kv_indptr[-1]) + BIG,
                                        np.int64))), "kv_indptr")
err("r1-sparse-indices-int64-2^32-wraps", sparse_err(
    plan=lambda p: dict(indices=p.indices.astype(np.int64) + BIG)), "indices")
err("r1-cascade-paged_kv_indices_arr-int64-2^32-wraps", cascade_err(
    plan=lambda p: dict(paged_kv_indices_arr=[p.indices[0], p.indices[1].astype(np.int64) + BIG])),
    "paged_kv_indices_arr")
err("r1-append-positions-int64-2^32-wraps", append_rejected(
    lambda p: dict(positions=p.positions.astype(np.int64) + BIG)), "positions")
err("r1-append-batch_indices-int64-2^32-wraps", append_rejected(
    lambda p: dict(batch_indices=p.batch_indices.astype(np.int64) + BIG)), "batch_indices")
err("r1-append-kv_indices-int64-2^32-wraps", append_rejected(
    lambda p: dict(kv_indices=p.indices.astype(np.int64) + BIG)), "kv_indices")
err("r1-append-kv_indices-negative", append_rejected(
    lambda p: dict(kv_indices=_with(p.indices, 1, -3))), "kv_indices")
err("r1-append-kv_last_page_len-int64-2^32-wraps", append_rejected(
    lambda p: dict(kv_last_page_len=p.last.astype(np.int64) + BIG)), "kv_last_page_len")
err("r1-append-positions-negative", append_rejected(
    lambda p: dict(positions=_with(p.positions, 0, -1))), "positions")
err("r1-get_batch_indices_positions-seq_lens-int64-2^32-wraps",
    lambda be, rng: nbinfer.get_batch_indices_positions(
        np.array([0, 2, 5]), np.array([6, 3], np.int64) + BIG, 5), "seq_lens", backends=NONE)
err("r1-get_batch_indices_positions-append_indptr-int64-2^32-wraps",
    lambda be, rng: nbinfer.get_batch_indices_positions(
        np.array([0, 2, 5 + BIG], np.int64), np.array([6, 3]), 5), "append_indptr",
    backends=NONE)
err("r1-PageTable-indices-int64-2^32", lambda be, rng: PageTable(
    np.array([0, 2]), np.array([0, 1], np.int64) + BIG, np.array([3]), PS, 4), "indices",
    backends=NONE)
err("r1-BSR-indptr-int64-2^32", lambda be, rng: BSR(
    np.array([0, 1 + BIG], np.int64), np.array([0]), (1, 4), (1, 8)), "indptr", backends=NONE)
err("r1-BSR-last_block_len-int64-2^32", lambda be, rng: BSR(
    np.array([0, 1]), np.array([0]), (1, 4), (1, 8), last_block_len=np.array([2 + BIG])),
    "last_block_len", backends=NONE)
err("r1-PageTable.from_kv_lens-kv_lens-int64-2^32", lambda be, rng: PageTable.from_kv_lens(
    np.array([5, 3], np.int64) + BIG, PS), "kv_lens", backends=NONE)


def _r1_decode_dtypes(backend, rng):
    p = _decode(rng)
    got = decode_run(p, backend, plan=dict(indptr=p.indptr.astype(np.uint32),
                                           indices=p.indices.astype(np.int16),
                                           last_page_len=p.last.astype(np.uint8)))
    return _pair("decode", got, decode_ref(p), p.dtype)


def _r1_append_dtypes(backend, rng):
    p = _append(rng)
    want = p.cache.copy()
    append_ref(p, want)
    append_call(p, backend, batch_indices=p.batch_indices.astype(np.int16),
                positions=p.positions.astype(np.uint16), kv_indices=p.indices.astype(np.uint32),
                kv_indptr=p.indptr.astype(np.int64), kv_last_page_len=p.last.astype(np.int8))
    return [Cmp("cache", p.cache, want, "exact")]


ok("r1-decode-uint32-int16-uint8-index-arrays-ok", _r1_decode_dtypes)
ok("r1-append-int16-uint16-uint32-index-arrays-ok", _r1_append_dtypes)


# =============================================================================================
# Rule 2: out= / lse= exact shape, dtype, writable, C-contiguous; never a hidden copy
def _out(p, rows=None):
    return np.empty((p.q.shape[0] if rows is None else rows, p.hq, D), p.dtype)


err("r2-decode-out-wrong-shape", decode_err(
    run=lambda p: dict(out=np.empty((2, p.hq, D + 1), p.dtype))), "out")
err("r2-decode-out-wrong-dtype", decode_err(
    run=lambda p: dict(out=np.empty(p.q.shape, np.float64))), "out")
err("r2-decode-out-read-only", decode_err(run=lambda p: dict(out=_readonly(_out(p)))), "out")
err("r2-decode-out-fortran-order", decode_err(
    run=lambda p: dict(out=_fortran(p.q.shape, p.dtype))), "out")
err("r2-decode-out-strided-batch", decode_err(
    run=lambda p: dict(out=_strided(p.q.shape, p.dtype))), "out")
err("r2-decode-lse-wrong-dtype", decode_err(
    run=lambda p: dict(lse=np.empty(p.q.shape[:2], np.float64))), "lse")
err("r2-decode-lse-wrong-shape", decode_err(
    run=lambda p: dict(lse=np.empty((p.q.shape[0], p.hq + 1), F32))), "lse")
err("r2-decode-lse-read-only", decode_err(
    run=lambda p: dict(lse=_readonly(np.empty(p.q.shape[:2], F32)))), "lse")
err("r2-prefill-out-fortran-order", prefill_err(
    run=lambda p: dict(out=_fortran(p.q.shape, p.dtype))), "out")
err("r2-prefill-lse-strided-heads", prefill_err(
    run=lambda p: dict(lse=_strided(p.q.shape[:2], F32, axis=1))), "lse")
err("r2-ragged-out-read-only", ragged_err(run=lambda p: dict(out=_readonly(_out(p)))), "out")
err("r2-ragged-lse-wrong-dtype", ragged_err(
    run=lambda p: dict(lse=np.empty(p.q.shape[:2], F16))), "lse")
err("r2-sparse-out-wrong-shape", sparse_err(
    run=lambda p: dict(out=np.empty((p.M + 1, p.hq, D), p.dtype))), "out")
err("r2-sparse-lse-fortran-order", sparse_err(
    run=lambda p: dict(lse=_fortran((p.M, p.hq), F32))), "lse")


def _r2_decode_out_accepted(backend, rng):
    p = _decode(rng)
    out = _rand(rng, p.q.shape, p.dtype)  # garbage: must be overwritten
    lse = _rand(rng, p.q.shape[:2], F32)
    res = decode_run(p, backend, run=dict(out=out, lse=lse))
    assert _same_buffer(res[0], out), f"WRONG RESULT: returned out is not the caller's buffer " \
                                      f"({_summary(res[0])})"
    assert _same_buffer(res[1], lse), "WRONG RESULT: returned lse is not the caller's buffer"
    return _pair("decode (caller's out/lse)", (out, lse), decode_ref(p), p.dtype)


def _r2_prefill_out_accepted(backend, rng):
    p = _prefill(rng)
    out = _rand(rng, p.q.shape, p.dtype)
    res = prefill_run(p, backend, plan=dict(causal=True), run=dict(out=out, return_lse=False))
    assert _same_buffer(res, out), f"WRONG RESULT: returned out is not the caller's buffer " \
                                   f"({_summary(res)})"
    return _pair("prefill (caller's out)", out, prefill_ref(p, causal=True)[0], p.dtype)


ok("r2-decode-out-and-lse-accepted-written-in-place", _r2_decode_out_accepted)
ok("r2-prefill-out-accepted-written-in-place", _r2_prefill_out_accepted)


# =============================================================================================
# Rule 3: strided views in, 2-D single-prefill masks, page-index arrays longer than indptr[-1]
def _fused(rng, rows, heads, dtype=F32):
    """Views into one fused array [rows, sum(heads), D]: unit stride in the last axis only."""
    qkv = _rand(rng, (rows, sum(heads), D), dtype)
    edges = np.cumsum([0, *heads])
    return [qkv[:, a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _c(a):
    return np.ascontiguousarray(a)


def _r3_ragged_fused(backend, rng):
    p = _ragged(rng, qo_lens=(3, 4), kv_lens=(3, 4))
    p.q, p.k, p.v = _fused(rng, 7, (p.hq, p.hkv, p.hkv))
    got = ragged_run(p, backend, plan=dict(causal=True))
    want = ragged_ref(p, _c(p.q), _c(p.k), _c(p.v), causal=True)
    return _pair("ragged (fused qkv views)", got, want, p.dtype)


def _r3_single_prefill_fused(backend, rng):
    q, k, v = _fused(rng, 5, (2, 1, 1))
    got = nbinfer.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True,
                                               backend=backend)
    want = reference.single_prefill_with_kv_cache(_c(q), _c(k), _c(v), causal=True,
                                                  return_lse=True)
    return _pair("single prefill (fused qkv views)", got, want, F32)


def _r3_single_decode_strided(backend, rng):
    k, v = _fused(rng, 6, (1, 1))
    q = _rand(rng, (2, 3, D), F32)[:, 1]  # [Hq, D] rows 3 * D apart
    got = nbinfer.single_decode_with_kv_cache(q, k, v, return_lse=True, backend=backend)
    want = reference.single_decode_with_kv_cache(_c(q), _c(k), _c(v), return_lse=True)
    return _pair("single decode (strided k/v)", got, want, F32)


def _r3_decode_pool_slice(backend, rng):
    p = _decode(rng)
    pool = _rand(rng, (2 * p.num_pages,) + p.cache.shape[1:], p.dtype)
    p.cache = pool[::2]  # every other page of a larger pool
    return _pair("decode (strided page pool)", decode_run(p, backend),
                 decode_ref(p, cache=_c(p.cache)), p.dtype)


def _r3_decode_pool_slice_hnd(backend, rng):
    p = _decode(rng, hq=4, hkv=2)
    pool = _rand(rng, (2 * p.num_pages, 2, p.hkv, PS, D), p.dtype)
    p.cache = pool[1::2]
    return _pair("HND decode (strided page pool)", decode_run(p, backend, layout="HND"),
                 decode_ref(p, cache=_c(p.cache), kv_layout="HND"), p.dtype)


def _r3_prefill_pair_views(backend, rng):
    p = _prefill(rng)
    pool = _rand(rng, (2 * p.num_pages,) + p.cache.shape[1:], p.dtype)[1::2]
    pair = (pool[:, 0], pool[:, 1])
    got = prefill_run(p, backend, plan=dict(causal=True), run=dict(paged_kv_cache=pair))
    want = prefill_ref(p, cache=(_c(pair[0]), _c(pair[1])), causal=True)
    return _pair("prefill ((k, v) views of a strided pool)", got, want, p.dtype)


def _r3_sparse_fused(backend, rng):
    p = _sparse(rng)
    p.M = p.N = 8  # 4 block rows x 2 block columns
    p.indptr, p.indices = np.array([0, 1, 2, 4, 5], np.int32), np.array([0, 1, 1, 0, 1], np.int32)
    p.q, p.k, p.v = _fused(rng, 8, (p.hq, p.hkv, p.hkv))
    return _pair("block sparse (fused qkv views)", sparse_run(p, backend),
                 sparse_ref(p, _c(p.q), _c(p.k), _c(p.v)), p.dtype)


def _r3_single_prefill_2d_mask(backend, rng):
    q, k, v = _rand(rng, (3, 2, D)), _rand(rng, (5, 1, D)), _rand(rng, (5, 1, D))
    mask = rng.random((3, 5)) < 0.6
    mask[:, 0] = True
    got = nbinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True,
                                               backend=backend)
    want = reference.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, return_lse=True)
    return _pair("single prefill (2-D custom mask)", got, want, F32)


def _long(indices):
    return np.concatenate([indices, [-5, 10**9]]).astype(np.int64)


def _r3_decode_long_indices(backend, rng):
    p = _decode(rng)
    got = decode_run(p, backend, plan=dict(indices=_long(p.indices)))
    return _pair("decode (indices past indptr[-1])", got, decode_ref(p), p.dtype)


def _r3_prefill_long_indices(backend, rng):
    p = _prefill(rng)
    got = prefill_run(p, backend, plan=dict(paged_kv_indices=_long(p.indices)))
    return _pair("prefill (paged_kv_indices past indptr[-1])", got, prefill_ref(p), p.dtype)


def _r3_append_long_indices(backend, rng):
    p = _append(rng)
    want = p.cache.copy()
    append_ref(p, want)
    append_call(p, backend, kv_indices=_long(p.indices))
    return [Cmp("cache (kv_indices past kv_indptr[-1])", p.cache, want, "exact")]


def _r3_append_strided_keys(backend, rng):
    p = _append(rng)
    key, value = _fused(rng, 5, (1, 1))
    want = p.cache.copy()
    append_ref(p, want, append_key=_c(key), append_value=_c(value))
    append_call(p, backend, append_key=key, append_value=value)
    return [Cmp("cache (strided append_key/append_value)", p.cache, want, "exact")]


def _r3_append_pool_slice(backend, rng):
    p = _append(rng)
    pool = _rand(rng, (10,) + p.cache.shape[1:], p.dtype)
    want = pool.copy()
    append_ref(p, want[::2])
    append_call(p, backend, paged_kv_cache=pool[::2])
    return [Cmp("page pool (cache = pool[::2])", pool, want, "exact")]


ok("r3-ragged-q-k-v-views-of-fused-qkv", _r3_ragged_fused)
ok("r3-single_prefill-q-k-v-views-of-fused-qkv", _r3_single_prefill_fused)
ok("r3-single_decode-strided-q-k-v", _r3_single_decode_strided)
ok("r3-decode-cache-strided-slice-of-page-pool", _r3_decode_pool_slice)
ok("r3-decode-HND-cache-strided-slice-of-page-pool", _r3_decode_pool_slice_hnd)
ok("r3-prefill-k-v-pair-views-of-strided-pool", _r3_prefill_pair_views)
ok("r3-sparse-q-k-v-views-of-fused-qkv", _r3_sparse_fused)
ok("r3-single_prefill-2d-custom_mask", _r3_single_prefill_2d_mask)
ok("r3-decode-indices-longer-than-indptr-garbage-tail", _r3_decode_long_indices)
ok("r3-prefill-paged_kv_indices-longer-than-indptr-garbage-tail", _r3_prefill_long_indices)
ok("r3-append-kv_indices-longer-than-indptr-garbage-tail", _r3_append_long_indices)
ok("r3-append-strided-append_key-append_value", _r3_append_strided_keys)
ok("r3-append-cache-strided-slice-of-page-pool", _r3_append_pool_slice)


# =============================================================================================
# Rule 4: NaN reaches exactly the rows that read it; unread garbage never does; merges
def _r4_decode_nan_q(backend, rng):
    p = _decode(rng)
    clean = p.q.copy()
    p.q[0, 1, 5] = np.nan
    nan = np.zeros(p.q.shape, bool)
    nan[0, 1, :] = True
    return _pair("decode (NaN in q[0, head 1])", decode_run(p, backend), decode_ref(p, q=clean),
                 p.dtype, nan)


def _r4_decode_nan_k(backend, rng):
    p = _decode(rng, hq=4, hkv=2)
    clean = p.cache.copy()
    page = p.indices[p.indptr[1]]  # request 1, token 2, kv head 1
    p.cache[page, 0, 2, 1, 7] = np.nan
    nan = np.zeros(p.q.shape, bool)
    nan[1, 2:4, :] = True  # the qo heads of kv head 1
    return _pair("decode (NaN in a key request 1 reads)", decode_run(p, backend),
                 decode_ref(p, cache=clean), p.dtype, nan)


def _r4_decode_nan_v(backend, rng):
    p = _decode(rng, hq=4, hkv=2)
    clean = p.cache.copy()
    page = p.indices[p.indptr[0] + 1]  # request 0, token 4 (its last), kv head 0
    p.cache[page, 1, 0, 0, 11] = np.nan
    nan = np.zeros(p.q.shape, bool)
    nan[0, 0:2, :] = True  # rule 4 as written: all head_dim entries of the head, and its LSE
    return _pair("decode (NaN in a value request 0 reads)", decode_run(p, backend),
                 decode_ref(p, cache=clean), p.dtype, nan)


def _r4_ragged_nan_k_causal(backend, rng):
    p = _ragged(rng, qo_lens=(4, 2), kv_lens=(4, 3))
    clean = p.k.copy()
    p.k[3, 0, 9] = np.nan  # last key of request 0: under causal only its row 3 sees it
    nan = np.zeros(p.q.shape, bool)
    nan[3] = True
    got = ragged_run(p, backend, plan=dict(causal=True))
    return _pair("causal ragged (NaN in the key only row 3 sees)", got,
                 ragged_ref(p, k=clean, causal=True), p.dtype, nan)


def _garbage(rng, shape):
    g = np.where(rng.random(shape) < 0.5, np.nan, np.inf)
    return g * np.where(rng.random(shape) < 0.5, 1, -1)


def _r4_decode_unlisted_pages(backend, rng):
    p = _decode(rng, extra=3)
    clean = p.cache.copy()
    unused = np.setdiff1d(np.arange(p.num_pages), p.indices)
    p.cache[unused] = _garbage(rng, p.cache[unused].shape)
    return _pair("decode (NaN/inf in unlisted pages)", decode_run(p, backend),
                 decode_ref(p, cache=clean), p.dtype)


def _r4_ragged_fp16_nan_q(backend, rng):
    p = _ragged(rng, dtype=F16)
    clean = p.q.copy()
    p.q[1, 0, 30] = np.nan  # tensor-core path (fp16, head_dim 64)
    nan = np.zeros(p.q.shape, bool)
    nan[1, 0, :] = True
    return _pair("fp16 ragged (NaN in q[1, head 0])", ragged_run(p, backend),
                 ragged_ref(p, q=clean), p.dtype, nan)


def _r4_sparse_unstored(backend, rng):
    p = _sparse(rng)
    p.indices = np.array([0, 2, 0, 0, 2], np.int32)  # block column 1 (keys 4-7) never stored
    clean_k, clean_v = p.k.copy(), p.v.copy()
    p.k[4:8] = _garbage(rng, p.k[4:8].shape)
    p.v[4:8] = _garbage(rng, p.v[4:8].shape)
    return _pair("block sparse (NaN/inf in an unstored block column)", sparse_run(p, backend),
                 sparse_ref(p, k=clean_k, v=clean_v), p.dtype)


def _r4_cascade_unlisted_pages(backend, rng):
    p = _cascade(rng)
    want = cascade_ref(p)
    unused = np.setdiff1d(np.arange(7), np.concatenate(p.indices))
    p.cache[unused] = _garbage(rng, p.cache[unused].shape)
    return _pair("cascade (NaN/inf in unlisted pages)", cascade_run(p, backend), want, p.dtype)


def _past_last(p, rng):
    clean = p.cache.copy()
    for b in range(p.last.size):
        page, fill = p.indices[p.indptr[b + 1] - 1], p.last[b]
        p.cache[page, :, fill:] = _garbage(rng, p.cache[page, :, fill:].shape)
    return clean


def _r4_decode_past_last(backend, rng):
    p = _decode(rng)
    clean = _past_last(p, rng)
    return _pair("decode (NaN/inf past last_page_len)", decode_run(p, backend),
                 decode_ref(p, cache=clean), p.dtype)


def _r4_prefill_past_last(backend, rng):
    p = _prefill(rng, qo_lens=(3, 2), kv_lens=(6, 3))
    clean = _past_last(p, rng)
    got = prefill_run(p, backend, plan=dict(causal=True))
    return _pair("causal prefill (NaN/inf past last_page_len)", got,
                 prefill_ref(p, cache=clean, causal=True), p.dtype)


ok("r4-decode-nan-in-q-gives-nan-row-head-and-lse", _r4_decode_nan_q)
ok("r4-decode-nan-in-attended-k-gives-nan-rows-of-its-group", _r4_decode_nan_k)
ok("r4-decode-nan-in-attended-v-gives-nan-rows-of-its-group-and-lse", _r4_decode_nan_v)
ok("r4-ragged-causal-nan-in-k-reaches-only-rows-that-see-it", _r4_ragged_nan_k_causal)


def _r4_ragged_causal_future_key(dtype, value, which):
    # Key 3 of request 0 shares a KV tile with keys 0-2 but, under causal, only row 3 keeps it:
    # a NaN/inf in its V (or K and V) reaches row 3 and no other row (the CUDA-core kernel's
    # p.V product skips unkept keys; a K alone is masked on either kernel).
    def fn(backend, rng):
        p = _ragged(rng, qo_lens=(4, 2), kv_lens=(4, 3), hq=4, hkv=2, dtype=dtype)
        clean_k, clean_v = p.k.copy(), p.v.copy()
        for name in which:
            getattr(p, name)[3, 1, 9] = value
        nan = np.zeros(p.q.shape, bool)
        nan[3, 2:4] = True  # row 3, the qo heads of kv head 1
        got = ragged_run(p, backend, plan=dict(causal=True))
        return _pair(f"causal ragged ({value} in {which} of a key only row 3 keeps)", got,
                     ragged_ref(p, k=clean_k, v=clean_v, causal=True), p.dtype, nan)
    return fn


def _r4_decode_window_garbage(backend, rng):
    # A sliding window masks the first keys of request 1: garbage in their K and V (same pages,
    # same tiles as kept keys) never reaches the output.
    p = _decode(rng, kv_lens=(5, 7), hq=4, hkv=2)
    clean = p.cache.copy()
    page = p.indices[p.indptr[1]]  # request 1, tokens 0-3 (page size 4): outside window 2
    p.cache[page, :, 0:2] = _garbage(rng, p.cache[page, :, 0:2].shape)
    kw = dict(window_left=2)
    return _pair("decode window (NaN/inf in K and V of masked keys)",
                 decode_run(p, backend, plan=kw), decode_ref(p, cache=clean, **kw), p.dtype)


def _r4_inf_in_kept(dtype, name, value):
    # An infinity in q, or in the K or V of a key a row keeps, poisons the row like a NaN.
    def fn(backend, rng):
        p = _ragged(rng, qo_lens=(2, 3), kv_lens=(4, 6), dtype=dtype)
        clean = {"q": p.q.copy(), "k": p.k.copy(), "v": p.v.copy()}
        getattr(p, name)[1 if name != "q" else 3, 0, 5] = value  # request 0's key 1, or row 3
        nan = np.zeros(p.q.shape, bool)
        nan[(3, 0) if name == "q" else slice(0, 2)] = True  # q: row 3, head 0 only
        return _pair(f"ragged ({value} in {name})", ragged_run(p, backend),
                     ragged_ref(p, **clean), p.dtype, nan)
    return fn


_DROP_KEY_1_NEG_INF = np.float32(-np.inf)


def _drop_key_1(s, q_pos, kv_pos, qo_head):
    return _DROP_KEY_1_NEG_INF if kv_pos == 1 else s


def _r4_ragged_minus_inf_logit_still_read(dtype):
    # A variant that sets key 1's logit to -inf gives it weight 0 but does not mask it: a NaN in
    # its V poisons the rows that keep it (request 0: rows 1..; causal).
    def fn(backend, rng):
        p = _ragged(rng, qo_lens=(4, 2), kv_lens=(4, 3), dtype=dtype)
        clean = p.v.copy()
        p.v[1, 0, 3] = np.nan
        nan = np.zeros(p.q.shape, bool)
        nan[1:4] = True  # causal: query i keeps keys <= i
        var = V.Variant("drop_key_1", logits_transform=_drop_key_1)
        kw = dict(causal=True, variant=var)
        return _pair("causal ragged, a variant's -inf logit over a NaN value",
                     ragged_run(p, backend, plan=kw), ragged_ref(p, v=clean, **kw), p.dtype, nan)
    return fn


# fp32 runs the CUDA-core kernel, fp16 the tensor-core kernel (its masked specs add the value
# scan and the guarded twin: an unkept key's V shares the KV tile of kept ones).
ok("r4-ragged-fp32-causal-minus-inf-logit-of-kept-key-is-still-read",
   _r4_ragged_minus_inf_logit_still_read(F32))
ok("r4-ragged-fp16-causal-minus-inf-logit-of-kept-key-is-still-read",
   _r4_ragged_minus_inf_logit_still_read(F16))
ok("r4-ragged-fp32-causal-nan-in-v-of-future-key-reaches-only-row-3",
   _r4_ragged_causal_future_key(F32, np.nan, ("v",)))
ok("r4-ragged-fp16-causal-nan-in-v-of-future-key-reaches-only-row-3",
   _r4_ragged_causal_future_key(F16, np.nan, ("v",)))
ok("r4-ragged-fp32-causal-inf-in-k-and-v-of-future-key-reaches-only-row-3",
   _r4_ragged_causal_future_key(F32, -np.inf, ("k", "v")))
ok("r4-ragged-fp16-causal-inf-in-k-and-v-of-future-key-reaches-only-row-3",
   _r4_ragged_causal_future_key(F16, -np.inf, ("k", "v")))
ok("r4-ragged-fp16-causal-inf-in-k-of-future-key-reaches-only-row-3",
   _r4_ragged_causal_future_key(F16, np.inf, ("k",)))
ok("r4-decode-window-nan-inf-in-masked-keys-never-reach-output", _r4_decode_window_garbage)
ok("r4-ragged-fp16-minus-inf-in-kept-k-gives-nan-rows", _r4_inf_in_kept(F16, "k", -np.inf))
ok("r4-ragged-fp32-inf-in-kept-v-gives-nan-rows", _r4_inf_in_kept(F32, "v", np.inf))
ok("r4-ragged-fp16-inf-in-q-gives-nan-row", _r4_inf_in_kept(F16, "q", np.inf))
ok("r4-decode-nan-inf-in-unlisted-pages-never-reach-output", _r4_decode_unlisted_pages)
ok("r4-ragged-fp16-nan-in-q-gives-nan-row-head-and-lse", _r4_ragged_fp16_nan_q)
ok("r4-sparse-nan-inf-in-unstored-block-column-never-reaches-output", _r4_sparse_unstored)
ok("r4-cascade-nan-inf-in-unlisted-pages-never-reach-output", _r4_cascade_unlisted_pages)
ok("r4-decode-nan-inf-past-last_page_len-never-reach-output", _r4_decode_past_last)
ok("r4-prefill-nan-inf-past-last_page_len-never-reach-output", _r4_prefill_past_last)


def _merge_pair_nonfinite(bad_value, which):
    """``s_a`` or ``s_b`` holds ``bad_value`` at (1, 0): that (row, head) merges to NaN."""
    def fn(backend, rng):
        v_a, s_a = _states(rng)
        v_b, s_b = _states(rng)
        want = reference.merge_state(v_a, s_a, v_b, s_b)  # on the clean states
        (s_a if which == "a" else s_b)[1, 0] = bad_value
        got = nbinfer.merge_state(v_a, s_a, v_b, s_b, backend=backend)
        nan = np.zeros(v_a.shape, bool)
        nan[1, 0] = True
        return _pair("merge_state", got, want, F32, nan)
    return fn


def _merge_in_place_nan(backend, rng):
    v, s = _states(rng)
    v_o, s_o = _states(rng)
    want = reference.merge_state(v, s, v_o, s_o)
    s_o[2, 1] = np.nan
    nbinfer.merge_state_in_place(v, s, v_o, s_o, backend=backend)
    nan = np.zeros(v.shape, bool)
    nan[2, 1] = True
    return _pair("merge_state_in_place", (v, s), want, F32, nan)


def _merge_states_nonfinite(bad_value):
    def fn(backend, rng):
        v, s = _states(rng, states=3)
        want = reference.merge_states(v, s)
        s[0, 1, 1] = bad_value
        got = nbinfer.merge_states(v, s, backend=backend)
        nan = np.zeros((v.shape[0], v.shape[2], D), bool)
        nan[0, 1] = True
        return _pair("merge_states", got, want, F32, nan)
    return fn


def _merge_neginf_identity(backend, rng):
    v_a, s_a = _states(rng)
    v_b, s_b = _states(rng)
    s_a[:, 0] = -np.inf  # head 0 of a is empty: the merge is b
    s_b[0, 1] = -np.inf  # (0, 1) of b is empty: the merge is a
    v, s = nbinfer.merge_state(v_a, s_a, v_b, s_b, backend=backend)
    want_v, want_s = v_b.astype(np.float64), s_b.astype(np.float64)
    want_v[0, 1], want_s[0, 1] = v_a[0, 1], s_a[0, 1]
    cmps = [Cmp("merge_state out (identity)", np.asarray(v)[:, 0], want_v[:, 0], "float32"),
            Cmp("merge_state lse (identity)", np.asarray(s)[:, 0], want_s[:, 0], "float32"),
            Cmp("merge_state out (identity)", np.asarray(v)[0, 1], want_v[0, 1], "float32"),
            Cmp("merge_state lse (identity)", np.asarray(s)[0, 1], want_s[0, 1], "float32")]
    return cmps + _pair("merge_state", (v, s), reference.merge_state(v_a, s_a, v_b, s_b), F32)


def _merge_states_all_empty(backend, rng):
    v, s = _states(rng, states=3)
    s[1] = -np.inf
    got_v, got_s = nbinfer.merge_states(v, s, backend=backend)
    want_v, want_s = reference.merge_states(v, s)
    zeros = np.zeros((2, D))
    return [Cmp("empty row out", np.asarray(got_v)[1], zeros, "exact"),
            Cmp("empty row lse", np.asarray(got_s)[1], np.full(2, -np.inf), "exact"),
            *_pair("merge_states", (got_v, got_s), (want_v, want_s), F32)]


ok("r4-merge_state-nan-lse-gives-nan", _merge_pair_nonfinite(np.nan, "a"))
ok("r4-merge_state-posinf-lse-gives-nan", _merge_pair_nonfinite(np.inf, "b"))
ok("r4-merge_state_in_place-nan-lse-gives-nan", _merge_in_place_nan)
ok("r4-merge_states-nan-lse-gives-nan", _merge_states_nonfinite(np.nan))
ok("r4-merge_states-posinf-lse-gives-nan", _merge_states_nonfinite(np.inf))
ok("r4-merge_state-neginf-lse-is-identity", _merge_neginf_identity)
ok("r4-merge_states-all-neginf-row-is-empty-state", _merge_states_all_empty)


# =============================================================================================
# Rule 5: BSR formats at the block-sparse wrapper
def _r5_repeated_column(backend, rng):
    p = _sparse(rng)
    w = nbinfer.BlockSparseAttentionWrapper(_ws(), backend=backend)
    sparse_plan(w, p, dict(indices=np.array([0, 0, 1, 0, 2], np.int32)))  # row 0: column 0 twice


def _r5_unsorted(backend, rng):
    p = _sparse(rng)
    p.indptr, p.indices = np.array([0, 2, 5, 7], np.int32), np.array([2, 0, 1, 2, 0, 2, 1],
                                                                     np.int32)
    return _pair("block sparse (unsorted columns)", sparse_run(p, backend), sparse_ref(p), p.dtype)


err("r5-sparse-repeated-block-column-rejected-at-plan", _r5_repeated_column, "indices")
ok("r5-sparse-unsorted-block-columns-ok", _r5_unsorted)


# =============================================================================================
# Rule 6: plan state. A failed plan() leaves no plan; plan() snapshots its index arrays;
# wrappers of different kinds may share one workspace.
def _expect_rejected(call):
    try:
        call()
    except (ValueError, TypeError):
        return
    raise AssertionError("NO ERROR: the bad plan() was accepted (the case needs it to fail)")


def _r6_decode_failed(backend, rng):
    p = _decode(rng)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", backend=backend)
    decode_plan(w, p)
    _expect_rejected(lambda: decode_plan(w, p, dict(indptr=np.array([0, 3, 2], np.int32))))
    return w.run(p.q, p.cache)


def _r6_prefill_failed(backend, rng):
    p = _prefill(rng)
    w = nbinfer.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD", backend=backend)
    prefill_plan(w, p)
    _expect_rejected(lambda: prefill_plan(w, p, dict(qo_indptr=np.array([1, 2, 5], np.int32))))
    return w.run(p.q, p.cache)


def _r6_ragged_failed(backend, rng):
    p = _ragged(rng)
    w = nbinfer.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD", backend=backend)
    w.plan(p.qo_indptr, p.kv_indptr, p.hq, p.hkv, D, q_data_type="float32")
    _expect_rejected(lambda: w.plan(p.qo_indptr, np.array([0, 7, 6]), p.hq, p.hkv, D,
                                    q_data_type="float32"))
    return w.run(p.q, p.k, p.v)


def _r6_sparse_failed(backend, rng):
    p = _sparse(rng)
    w = nbinfer.BlockSparseAttentionWrapper(_ws(), backend=backend)
    sparse_plan(w, p)
    _expect_rejected(lambda: sparse_plan(w, p, dict(indptr=np.array([0, 2, 5], np.int32))))
    return w.run(p.q, p.k, p.v)


def _r6_cascade_failed(backend, rng):
    p = _cascade(rng)
    w = nbinfer.MultiLevelCascadeAttentionWrapper(2, _ws(), "NHD", backend=backend)
    cascade_plan(w, p)
    _expect_rejected(lambda: cascade_plan(w, p, dict(paged_kv_indptr_arr=p.indptr[:1])))
    return w.run(p.q, p.cache)


for _kind, _fn in (("decode", _r6_decode_failed), ("prefill", _r6_prefill_failed),
                   ("ragged", _r6_ragged_failed), ("sparse", _r6_sparse_failed),
                   ("cascade", _r6_cascade_failed)):
    err(f"r6-{_kind}-run-after-failed-plan-has-no-valid-plan", _fn, "no valid plan",
        types=(RuntimeError,))

err("r6-decode-run-before-plan", lambda be, rng: nbinfer.BatchDecodeWithPagedKVCacheWrapper(
    _ws(), "NHD", backend=be).run(_rand(rng, (1, 2, D)), _rand(rng, (2, 2, PS, 1, D))),
    "plan", types=(RuntimeError,))
err("r6-sparse-run-before-plan", lambda be, rng: nbinfer.BlockSparseAttentionWrapper(
    _ws(), backend=be).run(_rand(rng, (4, 2, D)), _rand(rng, (4, 1, D)), _rand(rng, (4, 1, D))),
    "plan", types=(RuntimeError,))
err("r6-cascade-run-before-plan", lambda be, rng: nbinfer.MultiLevelCascadeAttentionWrapper(
    2, _ws(), "NHD", backend=be).run(_rand(rng, (1, 2, D)), _rand(rng, (2, 2, PS, 1, D))),
    "plan", types=(RuntimeError,))


def _r6_decode_snapshot(backend, rng):
    p = _decode(rng)
    want = decode_ref(p)
    w = nbinfer.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", backend=backend)
    w.plan(p.indptr, p.indices, p.last, p.hq, p.hkv, D, PS, q_data_type="float32")
    p.indices[:] = p.indices[::-1].copy()  # still valid pages, other data
    p.last[:] = 1
    p.indptr[1] = 1
    return _pair("decode (index arrays mutated after plan)", w.run(p.q, p.cache,
                                                                   return_lse=True), want, F32)


def _r6_prefill_snapshot(backend, rng):
    p = _prefill(rng)
    want = prefill_ref(p, causal=True)
    w = nbinfer.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD", backend=backend)
    w.plan(p.qo_indptr, p.indptr, p.indices, p.last, p.hq, p.hkv, D, PS, causal=True,
           q_data_type="float32")
    p.qo_indptr[1] = 4
    p.last[:] = 2
    p.indices[:] = p.indices[::-1].copy()
    return _pair("prefill (index arrays mutated after plan)", w.run(p.q, p.cache,
                                                                    return_lse=True), want, F32)


def _r6_sparse_snapshot(backend, rng):
    p = _sparse(rng)
    want = sparse_ref(p, indptr=p.indptr.copy(), indices=p.indices.copy())
    w = nbinfer.BlockSparseAttentionWrapper(_ws(), backend=backend)
    sparse_plan(w, p)
    p.indices[:] = [1, 0, 2, 1, 0]
    return _pair("block sparse (indices mutated after plan)", w.run(p.q, p.k, p.v,
                                                                    return_lse=True), want, F32)


def _r6_shared_decode_prefill(backend, rng):
    ws = _ws()
    pd, pp = _decode(rng), _prefill(rng, qo_lens=(3, 1), kv_lens=(6, 2))
    wd = nbinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    wp = nbinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    wd.plan(pd.indptr, pd.indices, pd.last, pd.hq, pd.hkv, D, PS, q_data_type="float32")
    wp.plan(pp.qo_indptr, pp.indptr, pp.indices, pp.last, pp.hq, pp.hkv, D, PS, causal=True,
            q_data_type="float32")
    got_d = wd.run(pd.q, pd.cache, return_lse=True)
    got_p = wp.run(pp.q, pp.cache, return_lse=True)
    return (_pair("decode (shared workspace)", got_d, decode_ref(pd), F32)
            + _pair("prefill (shared workspace)", got_p, prefill_ref(pp, causal=True), F32))


def _r6_shared_sparse_cascade(backend, rng):
    ws = _ws()
    ps, pc = _sparse(rng), _cascade(rng)
    wc = nbinfer.MultiLevelCascadeAttentionWrapper(2, ws, "NHD", backend=backend)
    wsp = nbinfer.BlockSparseAttentionWrapper(ws, backend=backend)
    cascade_plan(wc, pc)
    sparse_plan(wsp, ps)
    got_c = wc.run(pc.q, pc.cache, return_lse=True)
    got_s = wsp.run(ps.q, ps.k, ps.v, return_lse=True)
    return (_pair("cascade (shared workspace)", got_c, cascade_ref(pc), F32)
            + _pair("block sparse (shared workspace)", got_s, sparse_ref(ps), F32))


ok("r6-decode-index-arrays-snapshotted-at-plan", _r6_decode_snapshot)
ok("r6-prefill-index-arrays-snapshotted-at-plan", _r6_prefill_snapshot)
ok("r6-sparse-indices-snapshotted-at-plan", _r6_sparse_snapshot)
ok("r6-decode-and-prefill-share-workspace-plan-plan-run-run", _r6_shared_decode_prefill)
ok("r6-cascade-and-sparse-share-workspace-plan-plan-run-run", _r6_shared_sparse_cascade)


# =============================================================================================
# Rule 7: every built-in variant at GQA group sizes that are not powers of two
def _r7_decode(hq, hkv, **flags):
    def fn(backend, rng):
        p = _decode(rng, kv_lens=(6, 9), hq=hq, hkv=hkv)
        kw = {k: (v(rng) if callable(v) else v) for k, v in flags.items()}
        return _pair("decode", decode_run(p, backend, plan=kw), decode_ref(p, **kw), p.dtype,
                     lse="variant" not in kw or kw["variant"].use_softmax)
    return fn


def _r7_prefill(hq, hkv, dtype=F32, **flags):
    def fn(backend, rng):
        p = _prefill(rng, qo_lens=(3, 2), kv_lens=(5, 9), hq=hq, hkv=hkv, dtype=dtype)
        kw = {k: (v(rng) if callable(v) else v) for k, v in flags.items()}
        return _pair("paged prefill", prefill_run(p, backend, plan=kw), prefill_ref(p, **kw),
                     dtype, lse="variant" not in kw or kw["variant"].use_softmax)
    return fn


def _r7_ragged(hq, hkv, **flags):
    def fn(backend, rng):
        p = _ragged(rng, qo_lens=(3, 2), kv_lens=(4, 6), hq=hq, hkv=hkv)
        kw = {k: (v(rng) if callable(v) else v) for k, v in flags.items()}
        return _pair("ragged prefill", ragged_run(p, backend, plan=kw), ragged_ref(p, **kw),
                     p.dtype, lse="variant" not in kw or kw["variant"].use_softmax)
    return fn


ok("r7-decode-alibi-G3-Hq3-Hkv1", _r7_decode(3, 1, pos_encoding_mode="ALIBI"))
ok("r7-decode-soft_cap-window-G3-Hq6-Hkv2",
   _r7_decode(6, 2, logits_soft_cap=4.0, window_left=3))
ok("r7-decode-rope_llama-G3-Hq3-Hkv1", _r7_decode(3, 1, pos_encoding_mode="ROPE_LLAMA"))
ok("r7-decode-attention_sink-G3-Hq3-Hkv1",
   _r7_decode(3, 1, variant=lambda rng: V.attention_sink(rng.standard_normal(3))))
ok("r7-prefill-causal-rope_llama-G3-Hq3-Hkv1",
   _r7_prefill(3, 1, causal=True, pos_encoding_mode="ROPE_LLAMA"))
ok("r7-prefill-fp16-causal-soft_cap-G3-Hq3-Hkv1",
   _r7_prefill(3, 1, F16, causal=True, logits_soft_cap=3.0))
ok("r7-ragged-causal-alibi-window-G3-Hq6-Hkv2",
   _r7_ragged(6, 2, causal=True, pos_encoding_mode="ALIBI", window_left=2))
ok("r7-ragged-sigmoid-G3-Hq3-Hkv1", _r7_ragged(3, 1, variant=V.sigmoid_attention(0.5, -1.0)))


def _r7_single_decode_alibi(backend, rng):
    q, k, v = _rand(rng, (3, D)), _rand(rng, (7, 1, D)), _rand(rng, (7, 1, D))
    got = nbinfer.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ALIBI",
                                              return_lse=True, backend=backend)
    want = reference.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ALIBI",
                                                 return_lse=True)
    return _pair("single decode ALiBi", got, want, F32)


def _r7_single_prefill_window(backend, rng):
    q, k, v = _rand(rng, (4, 6, D), F16), _rand(rng, (7, 2, D), F16), _rand(rng, (7, 2, D), F16)
    kw = dict(causal=True, window_left=3)
    got = nbinfer.single_prefill_with_kv_cache(q, k, v, return_lse=True, backend=backend, **kw)
    want = reference.single_prefill_with_kv_cache(q, k, v, return_lse=True, **kw)
    return _pair("single prefill fp16 causal window", got, want, F16)


ok("r7-single_decode-alibi-G3-Hq3-Hkv1", _r7_single_decode_alibi)
ok("r7-single_prefill-fp16-causal-window-G3-Hq6-Hkv2", _r7_single_prefill_window)


# =============================================================================================
# Rule 8: errors name the argument
err("r8-decode-logits_soft_cap-negative", decode_err(plan=dict(logits_soft_cap=-2.0)),
    "logits_soft_cap")
err("r8-single_prefill-logits_soft_cap-negative",
    lambda be, rng: nbinfer.single_prefill_with_kv_cache(
        _rand(rng, (2, 2, D)), _rand(rng, (3, 1, D)), _rand(rng, (3, 1, D)),
        logits_soft_cap=-1.0, backend=be), "logits_soft_cap")
err("r8-sparse-logits_soft_cap-negative", sparse_err(plan=dict(logits_soft_cap=-0.5)),
    "logits_soft_cap")
err("r8-decode-variant-not-a-variant", decode_err(plan=dict(variant=3)), "variant")


def _r8_variant_string(backend, rng):
    p = _ragged(rng)
    try:
        got = ragged_run(p, backend, plan=dict(variant="causal"))
    except TypeError as e:
        if _names(str(e), ("variant",)):
            return []  # rejected, naming the argument: allowed
        raise AssertionError(f"WRONG ERROR: TypeError {e!r} does not name variant") from e
    return _pair("ragged (variant='causal')", got, ragged_ref(p, variant=V.causal()), p.dtype)


ok("r8-ragged-variant-as-string-accepted-or-TypeError-naming-variant", _r8_variant_string)


def _single(fn, dtypes, **kw):
    def call(backend, rng):
        q = _rand(rng, (3, 2, D), dtypes[0])
        if fn is nbinfer.single_decode_with_kv_cache:
            q = q[0]
        return fn(q, _rand(rng, (4, 1, D), dtypes[1]), _rand(rng, (4, 1, D), dtypes[2]),
                  backend=backend, **kw)
    return call


err("r8-single_prefill-float64-q", _single(nbinfer.single_prefill_with_kv_cache,
                                           (np.float64, F32, F32)), "q", types=(TypeError,))
err("r8-single_prefill-float64-k", _single(nbinfer.single_prefill_with_kv_cache,
                                           (F32, np.float64, F32)), "k", types=(TypeError,))
err("r8-single_prefill-float64-v", _single(nbinfer.single_prefill_with_kv_cache,
                                           (F32, F32, np.float64)), "v", types=(TypeError,))
err("r8-single_decode-float64-q", _single(nbinfer.single_decode_with_kv_cache,
                                          (np.float64, F32, F32)), "q", types=(TypeError,))
err("r8-single_decode-float64-v", _single(nbinfer.single_decode_with_kv_cache,
                                          (F32, F32, np.float64)), "v", types=(TypeError,))
err("r8-decode-run-float64-q", decode_err(run=lambda p: dict(q=p.q.astype(np.float64))), "q",
    types=(TypeError,))
err("r8-ragged-run-float64-v", ragged_err(run=lambda p: dict(v=p.v.astype(np.float64))), "v",
    types=(TypeError,))
err("r8-decode-float_workspace_buffer-list", lambda be, rng:
    nbinfer.BatchDecodeWithPagedKVCacheWrapper([0] * 64, "NHD", backend=be),
    "float_workspace_buffer", types=(TypeError,))
err("r8-prefill-float_workspace_buffer-int", lambda be, rng:
    nbinfer.BatchPrefillWithPagedKVCacheWrapper(1 << 20, "NHD", backend=be),
    "float_workspace_buffer", types=(TypeError,))
err("r8-ragged-float_workspace_buffer-None", lambda be, rng:
    nbinfer.BatchPrefillWithRaggedKVCacheWrapper(None, "NHD", backend=be),
    "float_workspace_buffer", types=(TypeError,))
err("r8-sparse-float_workspace_buffer-list", lambda be, rng:
    nbinfer.BlockSparseAttentionWrapper([0.0] * 8, backend=be),
    "float_workspace_buffer", types=(TypeError,))
err("r8-cascade-float_workspace_buffer-int", lambda be, rng:
    nbinfer.MultiLevelCascadeAttentionWrapper(2, 4096, "NHD", backend=be),
    "float_workspace_buffer", types=(TypeError,))
err("r8-cascade-paged_kv_indptr_arr-one-level-short", cascade_err(
    plan=lambda p: dict(paged_kv_indptr_arr=p.indptr[:1])), "paged_kv_indptr_arr")
err("r8-cascade-qo_indptr_arr-wrong-level-count", cascade_err(
    plan=lambda p: dict(qo_indptr_arr=p.qo + [p.qo[-1]])), "qo_indptr_arr")
err("r8-cascade-qo_indptr_arr-not-a-coarsening", cascade_err(
    plan=lambda p: dict(qo_indptr_arr=[np.array([0, 1, 2]), np.array([0, 2])],
                        paged_kv_indptr_arr=[np.array([0, 1, 2]), np.array([0, 3])],
                        paged_kv_indices_arr=[p.indices[0], p.indices[1]],
                        paged_kv_last_page_len=[np.array([4, 4]), np.array([2])])),
    "qo_indptr_arr")
err("r8-cascade-paged_kv_indptr_arr-batch-disagrees-with-level", cascade_err(
    plan=lambda p: dict(paged_kv_indptr_arr=[np.array([0, 1, 2]), p.indptr[1]],
                        paged_kv_last_page_len=[np.array([4, 4]), p.last[1]])),
    "paged_kv_indptr_arr", "qo_indptr_arr")
err("r8-cascade-paged_kv_last_page_len-level-count", cascade_err(
    plan=lambda p: dict(paged_kv_last_page_len=p.last[:1])), "paged_kv_last_page_len")


# =============================================================================================
# Rule 9: unknown backend names
def _backend_cases():
    rng = np.random.default_rng(9)
    v, s = _states(rng)
    vs, ss = _states(rng, states=2)
    q, k = _rand(rng, (2, 2, D)), _rand(rng, (3, 1, D))
    p = _append(rng)
    return {
        "decode": lambda b: nbinfer.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", backend=b),
        "prefill": lambda b: nbinfer.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD", backend=b),
        "ragged": lambda b: nbinfer.BatchPrefillWithRaggedKVCacheWrapper(_ws(), "NHD", backend=b),
        "sparse": lambda b: nbinfer.BlockSparseAttentionWrapper(_ws(), backend=b),
        "cascade": lambda b: nbinfer.MultiLevelCascadeAttentionWrapper(2, _ws(), backend=b),
        "single_prefill": lambda b: nbinfer.single_prefill_with_kv_cache(q, k, k, backend=b),
        "single_decode": lambda b: nbinfer.single_decode_with_kv_cache(q[0], k, k, backend=b),
        "append": lambda b: append_call(p, b),
        "merge_state": lambda b: nbinfer.merge_state(v, s, v, s, backend=b),
        "merge_state_in_place": lambda b: nbinfer.merge_state_in_place(v.copy(), s.copy(), v, s,
                                                                       backend=b),
        "merge_states": lambda b: nbinfer.merge_states(vs, ss, backend=b),
    }


for _name in _backend_cases():
    err(f"r9-{_name}-backend-unknown-name",
        lambda be, rng, _n=_name: _backend_cases()[_n]("gpu"), "backend", backends=NONE)


# =============================================================================================
# Ordinary bad inputs
err("x-decode-q-wrong-ndim", decode_err(run=lambda p: dict(q=p.q[0])), "q")
err("x-decode-q-wrong-num_qo_heads", decode_err(run=lambda p: dict(q=_rand(
    np.random.default_rng(0), (2, 4, D)))), "q")
err("x-decode-q-wrong-head_dim", decode_err(run=lambda p: dict(q=_rand(
    np.random.default_rng(0), (2, 2, 2 * D)))), "q")
err("x-decode-q-dtype-differs-from-q_data_type", decode_err(
    run=lambda p: dict(q=p.q.astype(F16))), "q")
err("x-decode-q-batch-differs-from-plan", decode_err(run=lambda p: dict(q=p.q[:1])), "q")
err("x-decode-cache-wrong-ndim", decode_err(
    run=lambda p: dict(paged_kv_cache=p.cache[:, 0])), "paged_kv_cache")
err("x-decode-cache-page_size-differs", decode_err(
    run=lambda p: dict(paged_kv_cache=np.concatenate([p.cache, p.cache], axis=2))),
    "paged_kv_cache")
err("x-decode-cache-dtype-differs", decode_err(
    run=lambda p: dict(paged_kv_cache=p.cache.astype(F16))), "paged_kv_cache")
err("x-decode-cache-pair-shapes-differ", decode_err(
    run=lambda p: dict(paged_kv_cache=(p.cache[:, 0], p.cache[:-1, 1]))),
    "v_cache", "paged_kv_cache")
err("x-decode-num_qo_heads-not-multiple-of-num_kv_heads", decode_err(
    plan=dict(num_qo_heads=3, num_kv_heads=2)), "num_qo_heads", "num_kv_heads")
err("x-decode-indptr-non-monotone", decode_err(
    plan=dict(indptr=np.array([0, 3, 2], np.int32))), "indptr")
err("x-decode-indptr-first-not-zero", decode_err(
    plan=lambda p: dict(indptr=p.indptr + 1, indices=np.append(p.indices, 0))), "indptr")
err("x-decode-last_page_len-zero", decode_err(
    plan=lambda p: dict(last_page_len=_with(p.last, 0, 0))), "last_page_len")
err("x-decode-last_page_len-above-page_size", decode_err(
    plan=lambda p: dict(last_page_len=_with(p.last, 1, PS + 1))), "last_page_len")
err("x-decode-last_page_len-wrong-length", decode_err(
    plan=lambda p: dict(last_page_len=p.last[:1])), "last_page_len")
err("x-decode-indices-at-num_pages", decode_err(
    plan=lambda p: dict(indices=_with(p.indices, 0, p.num_pages))), "indices")
err("x-decode-kv_layout-unknown", lambda be, rng: nbinfer.BatchDecodeWithPagedKVCacheWrapper(
    _ws(), "NDH", backend=be), "kv_layout")
err("x-decode-page_size-zero", decode_err(plan=dict(page_size=0)), "page_size")
err("x-decode-page_size-negative", decode_err(plan=dict(page_size=-4)), "page_size")
err("x-decode-head_dim-zero", decode_err(plan=dict(head_dim=0)), "head_dim")
err("x-decode-sm_scale-inf", decode_err(plan=dict(sm_scale=float("inf"))), "sm_scale")
err("x-decode-window_left-below-minus-one", decode_err(plan=dict(window_left=-2)),
    "window_left")
err("x-decode-pos_encoding_mode-unknown", decode_err(plan=dict(pos_encoding_mode="ROPE")),
    "pos_encoding_mode")
err("x-decode-q_data_type-float64", decode_err(plan=dict(q_data_type="float64")),
    "q_data_type")
err("x-prefill-sm_scale-nan", prefill_err(plan=dict(sm_scale=float("nan"))), "sm_scale")
err("x-prefill-qo_indptr-first-not-zero", prefill_err(
    plan=dict(qo_indptr=np.array([1, 3, 5], np.int32))), "qo_indptr")
err("x-prefill-qo_indptr-batch-differs-from-page-table", prefill_err(
    plan=dict(qo_indptr=np.array([0, 1, 3, 5], np.int32))), "qo_indptr", "paged_kv_indptr")
err("x-prefill-paged_kv_indptr-non-monotone", prefill_err(
    plan=dict(paged_kv_indptr=np.array([0, 3, 2], np.int32))), "paged_kv_indptr")
err("x-prefill-paged_kv_last_page_len-zero", prefill_err(
    plan=lambda p: dict(paged_kv_last_page_len=_with(p.last, 1, 0))), "paged_kv_last_page_len")
err("x-prefill-paged_kv_indices-at-num_pages", prefill_err(
    plan=lambda p: dict(paged_kv_indices=_with(p.indices, 2, p.num_pages))), "paged_kv_indices")
err("x-prefill-custom_mask-wrong-length", prefill_err(
    plan=dict(custom_mask=np.ones(2 * 5 + 3 * 7 - 1, bool))), "custom_mask")
err("x-prefill-custom_mask-and-packed_custom_mask", prefill_err(
    plan=dict(custom_mask=np.ones(2 * 5 + 3 * 7, bool),
              packed_custom_mask=np.full(2 + 3, 255, np.uint8))),
    "custom_mask", "packed_custom_mask")
err("x-prefill-packed_custom_mask-wrong-bytes", prefill_err(
    plan=dict(packed_custom_mask=np.full(4, 255, np.uint8))), "packed_custom_mask")
err("x-prefill-custom_mask-not-bool", prefill_err(
    plan=dict(custom_mask=np.ones(2 * 5 + 3 * 7, np.int32))), "custom_mask")
err("x-prefill-q-rows-differ-from-qo_indptr", prefill_err(
    run=lambda p: dict(q=np.concatenate([p.q, p.q[:1]]))), "q")
err("x-prefill-num_kv_heads-zero", prefill_err(plan=dict(num_kv_heads=0)), "num_kv_heads")
err("x-ragged-kv_indptr-batch-differs-from-qo_indptr", ragged_err(
    plan=dict(kv_indptr=np.array([0, 4, 6, 10], np.int32))), "kv_indptr", "qo_indptr")
err("x-ragged-run-k-wrong-length", ragged_err(run=lambda p: dict(k=p.k[:-1])), "k")
err("x-ragged-run-v-shape-differs-from-k", ragged_err(
    run=lambda p: dict(v=np.concatenate([p.v, p.v], axis=1))), "v")
err("x-single_prefill-head_dim-differs", lambda be, rng: nbinfer.single_prefill_with_kv_cache(
    _rand(rng, (2, 2, D)), _rand(rng, (3, 1, 2 * D)), _rand(rng, (3, 1, 2 * D)), backend=be),
    "k", "head_dim")
err("x-single_prefill-heads-not-divisible", lambda be, rng: nbinfer.single_prefill_with_kv_cache(
    _rand(rng, (2, 3, D)), _rand(rng, (3, 2, D)), _rand(rng, (3, 2, D)), backend=be),
    "num_qo_heads", "num_kv_heads", "q", "k")
err("x-single_prefill-custom_mask-wrong-shape", lambda be, rng:
    nbinfer.single_prefill_with_kv_cache(
        _rand(rng, (2, 2, D)), _rand(rng, (3, 1, D)), _rand(rng, (3, 1, D)),
        custom_mask=np.ones((3, 2), bool), backend=be), "custom_mask")
err("x-single_prefill-kv_layout-unknown", _single(nbinfer.single_prefill_with_kv_cache,
                                                  (F32, F32, F32), kv_layout="nhd"), "kv_layout")
err("x-single_decode-q-wrong-ndim", lambda be, rng: nbinfer.single_decode_with_kv_cache(
    _rand(rng, (1, 2, D)), _rand(rng, (3, 1, D)), _rand(rng, (3, 1, D)), backend=be), "q")
err("x-single_decode-v-shape-differs", lambda be, rng: nbinfer.single_decode_with_kv_cache(
    _rand(rng, (2, D)), _rand(rng, (3, 1, D)), _rand(rng, (4, 1, D)), backend=be), "v")
err("x-sparse-mask-wrong-shape", sparse_err(plan=dict(mask=np.ones((5, 2, 2), bool))), "mask")
err("x-sparse-mask-and-packed_mask", sparse_err(
    plan=dict(mask=np.ones((5, 2, 4), bool), packed_mask=np.full(5, 255, np.uint8))),
    "mask", "packed_mask")
err("x-sparse-indices-column-out-of-range", sparse_err(
    plan=lambda p: dict(indices=_with(p.indices, 1, 3))), "indices")
err("x-sparse-indptr-wrong-length", sparse_err(
    plan=dict(indptr=np.array([0, 2, 5], np.int32))), "indptr")
err("x-sparse-R-zero", sparse_err(plan=dict(R=0)), "R")
err("x-sparse-run-k-wrong-N", sparse_err(run=lambda p: dict(k=p.k[:-1])), "k")
err("x-sparse-run-q-wrong-M", sparse_err(run=lambda p: dict(q=p.q[:-1])), "q")
err("x-cascade-num_levels-zero", lambda be, rng: nbinfer.MultiLevelCascadeAttentionWrapper(
    0, _ws(), "NHD", backend=be), "num_levels")
err("x-cascade-level-indices-at-num_pages", cascade_err(
    plan=lambda p: dict(paged_kv_indices_arr=[p.indices[0], _with(p.indices[1], 0, 7)])),
    "paged_kv_indices_arr")
err("x-merge_state-shapes-differ", merge_pair_err(
    lambda a: dict(v_b=a["v_b"][:2], s_b=a["s_b"][:2])), "v_b", "s_b")
err("x-merge_state-dtypes-differ", merge_pair_err(lambda a: dict(v_b=a["v_b"].astype(F16))),
    "v_b")
err("x-merge_state-s-float64", merge_pair_err(lambda a: dict(s_a=a["s_a"].astype(np.float64))),
    "s_a", types=(TypeError,))
err("x-merge_state-s-shape-differs-from-v", merge_pair_err(lambda a: dict(s_b=a["s_b"][:, :1])),
    "s_b")
err("x-merge_state-lse_base-unsupported", lambda be, rng: nbinfer.merge_state(
    *_states(rng), *_states(rng), lse_base=10.0, backend=be), "lse_base")
err("x-merge_state_in_place-v-read-only", merge_in_place_err(lambda a: dict(v=_readonly(a["v"]))),
    "v")
err("x-merge_state_in_place-s-fortran-order", merge_in_place_err(
    lambda a: dict(s=np.asfortranarray(a["s"]))), "s")
err("x-merge_state_in_place-mask-wrong-length", merge_in_place_err(
    lambda a: dict(mask=np.ones(a["v"].shape[0] + 1, bool))), "mask")
err("x-merge_state_in_place-mask-not-bool", merge_in_place_err(
    lambda a: dict(mask=np.ones(a["v"].shape[0], np.int32))), "mask")
err("x-merge_states-s-shape-differs", merge_states_err(lambda a: dict(s=a["s"][:, :2])), "s")
err("x-merge_states-v-wrong-ndim", merge_states_err(lambda a: dict(v=a["v"][:, 0])), "v")
err("x-append-positions-beyond-request-length", append_rejected(
    lambda p: dict(positions=_with(p.positions, 4, 3))), "positions")
err("x-append-batch_indices-out-of-range", append_rejected(
    lambda p: dict(batch_indices=_with(p.batch_indices, 0, 2))), "batch_indices")
err("x-append-positions-wrong-length", append_rejected(
    lambda p: dict(positions=p.positions[:-1])), "positions")
err("x-append-append_key-dtype-differs", append_rejected(
    lambda p: dict(append_key=p.key.astype(F16))), "append_key")
err("x-append-append_value-rows-differ", append_rejected(
    lambda p: dict(append_value=p.value[:-1])), "append_value")
err("x-append-cache-read-only", append_rejected(
    lambda p: dict(paged_kv_cache=_readonly(p.cache))), "paged_kv_cache")
err("x-append-kv_layout-unknown", append_rejected(lambda p: dict(kv_layout="HDN")),
    "kv_layout")
err("x-append-kv_indptr-non-monotone", append_rejected(
    lambda p: dict(kv_indptr=np.array([0, 3, 2], np.int32))), "kv_indptr")
err("x-get_batch_indices_positions-seq_lens-shorter-than-append", lambda be, rng:
    nbinfer.get_batch_indices_positions(np.array([0, 2, 5]), np.array([6, 2]), 5), "seq_lens",
    backends=NONE)
err("x-get_batch_indices_positions-nnz-differs", lambda be, rng:
    nbinfer.get_batch_indices_positions(np.array([0, 2, 5]), np.array([6, 3]), 4),
    "append_indptr", "nnz", backends=NONE)


# =============================================================================================
# Formats
def _fmt(case_id, call, *names, types=(ValueError, TypeError)):
    err(case_id, lambda be, rng: call(), *names, types=types, backends=NONE)


_fmt("fmt-BSR-indices-out-of-range", lambda: BSR([0, 1, 2], [0, 2], (1, 4), (2, 8)), "indices")
_fmt("fmt-BSR-indptr-wrong-length", lambda: BSR([0, 1], [0], (1, 4), (2, 8)), "indptr")
_fmt("fmt-BSR-block_shape-zero", lambda: BSR([0, 1], [0], (0, 4), (1, 8)), "block_shape")
_fmt("fmt-BSR-indices-float", lambda: BSR([0, 1], [0.0], (1, 4), (1, 8)), "indices")
_fmt("fmt-BSR-last_block_len-above-Bc", lambda: BSR([0, 1], [0], (1, 4), (1, 8),
                                                    last_block_len=[5]), "last_block_len")
_fmt("fmt-PageTable-last_page_len-above-page_size", lambda: PageTable(
    [0, 2], [0, 1], [PS + 1], PS, 4), "last_page_len")
_fmt("fmt-PageTable-page_size-zero", lambda: PageTable([0, 1], [0], [1], 0, 4), "page_size")
_fmt("fmt-PageTable-indices-at-num_pages", lambda: PageTable([0, 2], [0, 4], [1], PS, 4),
     "indices")
_fmt("fmt-PageTable-indptr-last-differs-from-indices", lambda: PageTable(
    [0, 3], [0, 1], [1], PS, 4), "indptr", "indices")
_fmt("fmt-bsr_from_ragged-kv_indptr-length-differs", lambda: formats.bsr_from_ragged(
    [0, 2, 4], [0, 3], (2, 4)), "kv_indptr")
_fmt("fmt-bsr_from_ragged-qo_indptr-non-monotone", lambda: formats.bsr_from_ragged(
    [0, 3, 2], [0, 3, 5], (2, 4)), "qo_indptr")
_fmt("fmt-bsr_from_mask-int-mask", lambda: formats.bsr_from_mask(np.ones((4, 4), np.int32),
                                                                 (2, 2)), "mask")
_fmt("fmt-bsr_from_mask-1d-mask", lambda: formats.bsr_from_mask(np.ones(4, bool), (2, 2)), "mask")
_fmt("fmt-packbits-bitorder-unknown", lambda: formats.packbits(np.ones(9, bool), "middle"),
     "bitorder")
_fmt("fmt-packbits-float-input", lambda: formats.packbits(np.ones(9)), "x")
_fmt("fmt-segment_packbits-indptr-total-differs", lambda: formats.segment_packbits(
    np.ones(9, bool), [0, 4, 8]), "indptr")
_fmt("fmt-unpackbits-length-beyond-bits", lambda: formats.unpackbits(
    np.zeros(1, np.uint8), 9), "length")
_fmt("fmt-RadixTree-page_size-zero", lambda: RadixTree(0), "page_size")
_fmt("fmt-RadixTree-insert-wrong-page-count", lambda: RadixTree(PS).insert(
    np.arange(9), [0, 1]), "pages")
_fmt("fmt-RadixTree-insert-repeated-page", lambda: RadixTree(PS).insert(
    np.arange(9), [0, 1, 1]), "pages")
_fmt("fmt-RadixTree-insert-empty-tokens", lambda: RadixTree(PS).insert([], []), "tokens")
_fmt("fmt-RadixTree-insert-page-id-int64-2^32", lambda: RadixTree(PS).insert(
    np.arange(5), np.array([0, 1], np.int64) + BIG), "pages")


def _fmt_roundtrips(backend, rng):
    pt = PageTable.from_kv_lens([5, 0, 9], PS, num_pages=8, rng=rng)
    back = PageTable.from_bsr(pt.to_bsr())
    bits = rng.random(21) < 0.5
    packed, ptr = formats.segment_packbits(bits, [0, 5, 21], bitorder="little")
    ragged = formats.bsr_from_ragged([0, 2, 5], [0, 3, 9], (2, 4), causal=True)
    cover = formats.bsr_from_mask(formats.ragged_mask([0, 2, 5], [0, 3, 9], causal=True), (2, 4))
    return [Cmp("PageTable.indices round trip", back.indices, pt.indices, "exact"),
            Cmp("PageTable.last_page_len round trip", back.last_page_len, pt.last_page_len,
                "exact"),
            Cmp("segment_packbits round trip", formats.segment_unpackbits(
                packed, ptr, [5, 16], bitorder="little"), bits, "exact"),
            Cmp("bsr_from_ragged vs bsr_from_mask", ragged.to_dense(), cover.to_dense(),
                "exact")]


ok("fmt-round-trips-page-table-packbits-ragged-cover", _fmt_roundtrips, backends=NONE)


# ---------------------------------------------------------------------------------------------
def _params():
    seen = set()
    for c in CASES:
        assert c.id not in seen, f"duplicate case id {c.id}"
        seen.add(c.id)
        for be in c.backends:
            yield pytest.param(c, be, id=c.id if be is None else f"{c.id}-{be}")


def test_table_covers_enough_classes():
    assert len(CASES) >= 70


@pytest.mark.parametrize("case, backend", list(_params()))
def test_fuzz(case: Case, backend):
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    if case.expect is MATCHES:
        try:
            cmps = case.fn(backend, rng)
        except AssertionError:
            raise
        except Exception as e:
            raise AssertionError(f"RAISED {type(e).__name__}: {e}") from e
        for c in cmps:
            c.check()
        return
    exp = case.expect
    want = f"{'/'.join(t.__name__ for t in exp.types)} naming {' or '.join(exp.names)}"
    try:
        res = case.fn(backend, rng)
    except AssertionError:
        raise
    except exp.types as e:
        if not _names(str(e), exp.names):
            raise AssertionError(f"WRONG ERROR: {type(e).__name__}({str(e)!r}) does not name "
                                 f"{' or '.join(exp.names)}") from e
        return
    except Exception as e:
        raise AssertionError(f"WRONG ERROR: {type(e).__name__}({str(e)!r}), expected "
                             f"{want}") from e
    raise AssertionError(f"NO ERROR: returned {_summary(res)}, expected {want}")
