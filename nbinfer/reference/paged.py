"""Paged KV cache in the reference engine: layouts, page tables, gathering and appending.

A paged KV cache stores keys and values in fixed-size pages of one pool; request ``b`` owns the
physical pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` in logical order, and only the first
``kv_last_page_len[b]`` slots of its last page are filled. Token ``t`` of the request lives in page
``kv_indices[kv_indptr[b] + t // page_size]`` at slot ``t % page_size``. The reference engine
gathers each request's keys into a contiguous array (a copy; kernels read pages in place).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._checks import (
    FLOAT_DTYPES,
    as_index_array,
    check_dim,
    check_float,
    check_indptr,
    check_ndim,
    check_positive_int,
    check_range,
    check_sm_scale,
)
from ._common import as_f64, check_layout, check_lse_base, check_q_kv

# The append also takes a cache of FP8 codes (uint8), which it copies into.
_CODES = FLOAT_DTYPES + (np.dtype(np.uint8),)

__all__ = [
    "append_paged_kv_cache",
    "check_page_table",
    "gather_kv",
    "get_batch_indices_positions",
    "kv_lengths",
    "split_paged_kv_cache",
]

PAGE_TABLE_NAMES = ("kv_indptr", "kv_indices", "kv_last_page_len")


class _PagedInputs(NamedTuple):
    lse_base: float
    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    num_pages: int
    page_size: int
    head_dim: int
    scale: float


def _prepare_paged(q, paged_kv_cache, kv_layout, sm_scale, lse_base) -> _PagedInputs:
    """Shared input checks of the paged entry points (same order and messages in each)."""
    lse_base = check_lse_base(lse_base)
    q = as_f64("q", q, 3)
    k_cache, v_cache = split_paged_kv_cache(paged_kv_cache, kv_layout)
    num_pages, page_size, hkv, d = k_cache.shape
    check_q_kv(q, hkv, d, kv_name="paged_kv_cache")
    scale = check_sm_scale(sm_scale, d)
    return _PagedInputs(lse_base, q, k_cache, v_cache, num_pages, page_size, d, scale)


def split_paged_kv_cache(paged_kv_cache, kv_layout: str = "NHD", *, codes: bool = False):
    """Return ``(k_cache, v_cache)`` as NHD views ``[num_pages, page_size, Hkv, D]``.

    Parameters
    ----------
    paged_kv_cache : ndarray or (ndarray, ndarray)
        One float array, NHD ``[num_pages, 2, page_size, Hkv, D]`` or HND
        ``[num_pages, 2, Hkv, page_size, D]`` (index 0 of axis 1 is K, 1 is V); or a pair
        ``(k_cache, v_cache)`` each NHD ``[num_pages, page_size, Hkv, D]`` or HND
        ``[num_pages, Hkv, page_size, D]``.
    kv_layout : {"NHD", "HND"}

    Returns
    -------
    k_cache, v_cache : ndarray, shape [num_pages, page_size, Hkv, D], dtype of the input
        Views (no copy), so writes through them reach the cache.
    """
    check_layout(kv_layout)
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache as a tuple must be (k_cache, v_cache), "
                             f"got {len(paged_kv_cache)} items")
        k_cache, v_cache = paged_kv_cache
        for name, arr in (("paged_kv_cache[0] (k_cache)", k_cache),
                          ("paged_kv_cache[1] (v_cache)", v_cache)):
            check_float(name, arr, _CODES if codes else FLOAT_DTYPES)
            check_ndim(name, arr, 4)
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"paged_kv_cache[1] (v_cache) shape must equal k_cache's "
                             f"{k_cache.shape}, got {v_cache.shape}")
        k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    else:
        check_float("paged_kv_cache", paged_kv_cache, _CODES if codes else FLOAT_DTYPES)
        check_ndim("paged_kv_cache", paged_kv_cache, 5)
        check_dim("paged_kv_cache", paged_kv_cache, 1, 2, "K and V")
        cache = np.asarray(paged_kv_cache)
        k_cache, v_cache = cache[:, 0], cache[:, 1]
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(0, 2, 1, 3), v_cache.transpose(0, 2, 1, 3)
    return k_cache, v_cache


def _as_int64(name: str, a) -> np.ndarray:
    """A 1-D integer array as int64, exactly: any integer dtype, uint64 only below ``2**63``.

    The reference engine checks every index in int64 and narrows nothing, so no value wraps.
    """
    arr = np.asarray(a)
    if arr.size == 0 and not isinstance(a, np.ndarray):
        arr = arr.astype(np.int64)  # an empty Python list is an empty index list
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    check_ndim(name, arr, 1)
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        b = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise ValueError(f"{name} values must fit in int64, got {name}[{b}]={int(arr[b])}")
    return arr.astype(np.int64)


def _first_outside(name: str, arr: np.ndarray, low, high, what: str) -> None:
    """Raise naming ``name[i]`` for the first element outside ``[low, high)`` (bounds may be
    per-element arrays)."""
    bad = (arr < low) | (arr >= high)
    if np.any(bad):
        i = int(np.argmax(bad))
        lo = low if np.ndim(low) == 0 else low[i]
        hi = high if np.ndim(high) == 0 else high[i]
        raise ValueError(f"{name} values must lie in [{lo}, {hi}) ({what}), "
                         f"got {name}[{i}]={arr[i]}")


def check_page_table(kv_indptr, kv_indices, kv_last_page_len, num_pages: int, page_size: int,
                     *, names=PAGE_TABLE_NAMES):
    """Validate a page table and return it as int32 arrays.

    Every value is checked in int64 before anything is narrowed to int32, so an int64 page id
    ``2**32 + 1`` raises instead of wrapping to page 1.

    Parameters
    ----------
    kv_indptr : array of int, shape [batch_size + 1]
        Non-decreasing, starts at 0, at most ``len(kv_indices)`` at the end.
    kv_indices : array of int, shape [>= kv_indptr[-1]]
        Physical page ids in ``[0, num_pages)``, any order. Only the first ``kv_indptr[-1]``
        entries are read (as FlashInfer does): the rest of a longer array is ignored.
    kv_last_page_len : array of int, shape [batch_size]
        Filled slots of each request's last page, in ``[1, page_size]`` (a request with no pages
        has kv_len 0 and its entry may be anything in ``[0, page_size]``).
    num_pages, page_size : int
        Size of the pool and of a page.
    names : tuple of 3 str
        Argument names used in error messages (e.g. ``"paged_kv_indptr_arr[1]"``).

    Returns
    -------
    (kv_indptr, kv_indices, kv_last_page_len) : int32 ndarrays
        ``kv_indices`` cut to ``kv_indptr[-1]`` entries.
    """
    n_ptr, n_idx, n_last = names
    indptr = _as_int64(n_ptr, kv_indptr)
    indices = _as_int64(n_idx, kv_indices)
    last = _as_int64(n_last, kv_last_page_len)
    if indptr.size == 0:
        raise ValueError(f"{n_ptr} must have batch_size + 1 >= 1 entries, got an empty array")
    if indptr[0] != 0:
        raise ValueError(f"{n_ptr}[0] must be 0, got {indptr[0]}")
    drop = np.diff(indptr) < 0
    if np.any(drop):
        b = int(np.argmax(drop)) + 1
        raise ValueError(f"{n_ptr} must be non-decreasing, got {n_ptr}[{b}]={indptr[b]} < "
                         f"{n_ptr}[{b - 1}]={indptr[b - 1]}")
    if indptr[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{n_ptr}[-1] must fit in int32, got {indptr[-1]}")
    if indptr[-1] > indices.size:
        raise ValueError(f"{n_idx} must have at least {n_ptr}[-1]={indptr[-1]} entries (the "
                         f"pages {n_ptr} counts), got {indices.size}")
    indices = indices[:indptr[-1]]
    batch = indptr.size - 1
    if last.size != batch:
        raise ValueError(f"{n_last} must have length batch_size={batch} "
                         f"(len({n_ptr}) - 1), got {last.size}")
    _first_outside(n_idx, indices, 0, num_pages, f"page ids of a pool of {num_pages} pages")
    low = np.where(np.diff(indptr) > 0, 1, 0)
    _first_outside(n_last, last, low, page_size + 1,
                   "1 <= last_page_len <= page_size for a request with pages")
    # Every value is now in [0, len(kv_indices)] or [0, max(num_pages, page_size)]: int32 is exact.
    return indptr.astype(np.int32), indices.astype(np.int32), last.astype(np.int32)


def kv_lengths(kv_indptr, kv_last_page_len, page_size: int) -> np.ndarray:
    """KV length of every request: ``(pages - 1) * page_size + last_page_len``, 0 without pages.

    Parameters
    ----------
    kv_indptr : array of int, shape [batch_size + 1]
    kv_last_page_len : array of int, shape [batch_size]
        A validated page table (see :func:`check_page_table`).
    page_size : int

    Returns
    -------
    ndarray, int64, shape [batch_size]
    """
    pages = np.diff(np.asarray(kv_indptr, dtype=np.int64))
    last = np.asarray(kv_last_page_len, dtype=np.int64)
    return np.where(pages > 0, (pages - 1) * page_size + last, 0)


def gather_kv(k_cache, v_cache, kv_indices_of_request, kv_len: int):
    """Copy one request's keys and values out of the pages into contiguous float64 arrays.

    Parameters
    ----------
    k_cache, v_cache : ndarray, shape [num_pages, page_size, Hkv, D] (NHD view)
    kv_indices_of_request : array of int, shape [pages]
        The request's physical pages in logical order.
    kv_len : int
        Number of valid tokens, at most ``pages * page_size``.

    Returns
    -------
    k, v : ndarray, float64, shape [kv_len, Hkv, D]
    """
    pages = np.asarray(kv_indices_of_request, dtype=np.int64)
    _, page_size, hkv, d = k_cache.shape
    if kv_len > pages.size * page_size:
        raise ValueError(f"kv_len={kv_len} exceeds the {pages.size} pages of {page_size} slots")
    k = np.asarray(k_cache[pages], dtype=np.float64).reshape(-1, hkv, d)[:kv_len]
    v = np.asarray(v_cache[pages], dtype=np.float64).reshape(-1, hkv, d)[:kv_len]
    return k, v


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    """Request and position of every appended token (FlashInfer's definition).

    Parameters
    ----------
    append_indptr : array of int, shape [batch_size + 1]
        Request ``b`` appends tokens ``append_indptr[b]:append_indptr[b + 1]``.
    seq_lens : array of int, shape [batch_size]
        KV length of each request *after* appending (at least its append length).
    nnz : int
        Total appended tokens, ``append_indptr[-1]``.

    Returns
    -------
    batch_indices : ndarray, int32, shape [nnz]
        Request of each token.
    positions : ndarray, int32, shape [nnz]
        Position in its request: ``seq_lens[b] - append_len_b + j`` for the ``j``-th new token.
    """
    nnz = check_positive_int("nnz", nnz, minimum=0)
    indptr = check_indptr("append_indptr", append_indptr, total=nnz)
    lens = as_index_array("seq_lens", seq_lens)
    batch = indptr.size - 1
    if lens.size != batch:
        raise ValueError(f"seq_lens must have length batch_size={batch}, got {lens.size}")
    append_len = np.diff(indptr)
    short = lens < append_len
    if np.any(short):
        b = int(np.argmax(short))
        raise ValueError(f"seq_lens[{b}]={lens[b]} is smaller than request {b}'s append length "
                         f"{append_len[b]} (seq_lens count tokens after appending)")
    batch_indices = np.repeat(np.arange(batch, dtype=np.int32), append_len)
    within = np.arange(nnz, dtype=np.int64) - np.repeat(indptr[:-1].astype(np.int64), append_len)
    start = np.repeat((lens - append_len).astype(np.int64), append_len)
    return batch_indices, (start + within).astype(np.int32)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):
    """Write new keys/values into their pages, in place (FlashInfer semantics).

    The page table must already describe the requests *after* the append (pages allocated,
    ``kv_last_page_len`` updated); token ``t`` is written at position ``positions[t]`` of request
    ``batch_indices[t]``.

    Parameters
    ----------
    append_key, append_value : ndarray, float, shape [nnz, Hkv, D]
        New keys and values (cast to the cache dtype on write); uint8 FP8 codes for a cache of
        codes (copied).
    batch_indices, positions : array of int, shape [nnz]
        Request and position of each token (see :func:`get_batch_indices_positions`).
    paged_kv_cache : ndarray or (ndarray, ndarray)
        The cache (see :func:`split_paged_kv_cache`); modified in place.
    kv_indices, kv_indptr, kv_last_page_len : array of int
        The page table after the append.
    kv_layout : {"NHD", "HND"}

    Returns
    -------
    None
    """
    k_cache, v_cache = split_paged_kv_cache(paged_kv_cache, kv_layout, codes=True)
    for name, arr in (("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache)):
        if not arr.flags.writeable:
            raise ValueError(f"{name} must be a writeable NumPy array (it is updated in place)")
    num_pages, page_size, hkv, d = k_cache.shape
    indptr, indices, last = check_page_table(kv_indptr, kv_indices, kv_last_page_len,
                                             num_pages, page_size)
    for name, arr in (("append_key", append_key), ("append_value", append_value)):
        if k_cache.dtype == np.uint8:  # FP8 codes are copied, never cast from floats
            if getattr(arr, "dtype", None) != np.uint8:
                raise TypeError(f"{name} must be uint8 FP8 codes, as paged_kv_cache holds "
                                f"(nbinfer.reference.fp8.encode quantises), got "
                                f"{getattr(arr, 'dtype', type(arr).__name__)}")
        else:
            check_float(name, arr)
        check_ndim(name, arr, 3)
        check_dim(name, arr, 1, hkv, "num_kv_heads of paged_kv_cache")
        check_dim(name, arr, 2, d, "head_dim of paged_kv_cache")
    nnz = append_key.shape[0]
    check_dim("append_value", append_value, 0, nnz, "nnz of append_key")
    bi = _as_int64("batch_indices", batch_indices)  # int64: checked below, never narrowed
    pos = _as_int64("positions", positions)
    if bi.size != nnz:
        raise ValueError(f"batch_indices must have length nnz={nnz}, got {bi.size}")
    if pos.size != nnz:
        raise ValueError(f"positions must have length nnz={nnz}, got {pos.size}")
    check_range("batch_indices", bi, 0, indptr.size - 1)
    lens = kv_lengths(indptr, last, page_size)
    beyond = (pos < 0) | (pos >= lens[bi])
    if np.any(beyond):
        t = int(np.argmax(beyond))
        raise ValueError(f"positions[{t}]={pos[t]} must lie in [0, kv_len) of request "
                         f"{bi[t]} (kv_len {lens[bi[t]]} from the page table)")
    page = indices[indptr[bi] + pos // page_size]
    slot = pos % page_size
    # Fancy-index assignment writes through the NHD views into the caller's arrays.
    k_cache[page, slot] = np.asarray(append_key)
    v_cache[page, slot] = np.asarray(append_value)
