"""A paged KV cache's page table (FlashInfer's ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``).

The KV pool is ``num_pages`` physical pages of ``page_size`` token slots each. Request ``b`` owns
the logical page chain ``indices[indptr[b]:indptr[b + 1]]``: logical page ``p`` of the request
lives in physical page ``indices[indptr[b] + p]``. Pages need not be adjacent or sorted, and two
requests may list the same physical page (a shared prefix). Only the last page of a request may
be partly filled; ``last_page_len[b]`` says how many of its slots hold tokens.

Read as a matrix with one row per request and one column per physical token slot, the table is a
BSR with blocks ``(1, page_size)`` (Figure 2 of the FlashInfer paper): :meth:`PageTable.to_bsr`
and :meth:`PageTable.from_bsr` convert without losing anything.

:func:`check_page_table` is the one validator of FlashInfer-style page tables: the api wrappers
and :class:`PageTable` both call it.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .._checks import (
    INT32_MAX,
    as_index_array,
    as_integer_array,
    check_indptr,
    check_positive_int,
    check_range,
)
from .bsr import BSR

PAGE_TABLE_NAMES = ("indptr", "indices", "last_page_len")


def check_page_table(indptr, indices, last_page_len, page_size, *, num_pages=None,
                     names=PAGE_TABLE_NAMES):
    """Validate a page table given as host arrays of any integer dtype; return it narrowed.

    Every value is range-checked in its own dtype *before* it is narrowed to int32, so an int64
    page id ``2**32 + 1`` raises instead of wrapping to page 1.

    Parameters
    ----------
    indptr : array of int, shape [batch_size + 1]
        FlashInfer's ``kv_indptr``: starts at 0, non-decreasing, fits int32.
    indices : array of int, shape [>= indptr[-1]]
        FlashInfer's ``kv_indices``. Only the first ``indptr[-1]`` entries are read (as FlashInfer
        does): a longer array (a preallocated buffer) is accepted and cut, a shorter one raises.
        Page ids lie in ``[0, num_pages)``, or in ``[0, 2**31)`` when ``num_pages`` is None.
    last_page_len : array of int, shape [batch_size]
        FlashInfer's ``kv_last_page_len``: in ``[1, page_size]`` for a request with pages; for a
        request without pages it is ignored and may be anything in ``[0, page_size]``.
    page_size : int
        Token slots per page, >= 1.
    num_pages : int, optional
        Pages in the KV pool, >= 0; ``None`` skips the upper bound of the page ids.
    names : tuple of 3 str
        The names of ``(indptr, indices, last_page_len)`` in error messages, e.g.
        ``("kv_indptr", "kv_indices", "kv_last_page_len")`` or ``("paged_kv_indptr_arr[1]", ...)``.

    Returns
    -------
    indptr : ndarray, int32, shape [batch_size + 1]
    indices : ndarray, int32, shape [indptr[-1]]
    last_page_len : ndarray, int32, shape [batch_size]
    kv_lens : ndarray, int64, shape [batch_size]
        Tokens of each request: ``(pages - 1) * page_size + last_page_len``, 0 without pages.

    The int32 arrays may share memory with the inputs when those already are contiguous int32.

    Raises
    ------
    TypeError
        An argument is not an integer array (or ``page_size`` / ``num_pages`` not an int).
    ValueError
        A value is out of range or a length disagrees; the message names the argument (from
        ``names``), the expected and the actual value.
    """
    if not (isinstance(names, tuple) and len(names) == 3 and all(isinstance(n, str)
                                                                  for n in names)):
        raise TypeError(f"names must be a tuple of 3 str, got {names!r}")
    n_ptr, n_idx, n_last = names
    page_size = check_positive_int("page_size", page_size)
    if num_pages is not None:
        num_pages = check_positive_int("num_pages", num_pages, minimum=0)
    ptr = check_indptr(n_ptr, indptr)  # range-checked against int32 before it is narrowed
    nnz = int(ptr[-1])
    idx = as_integer_array(n_idx, indices)
    if idx.size < nnz:
        raise ValueError(f"{n_idx} must have at least {n_ptr}[-1]={nnz} entries (the pages "
                         f"{n_ptr} refers to), got {idx.size}")
    idx = idx[:nnz]
    check_range(n_idx, idx, 0, INT32_MAX + 1 if num_pages is None else num_pages)
    last = as_integer_array(n_last, last_page_len)
    batch = ptr.size - 1
    if last.size != batch:
        raise ValueError(f"{n_last} must have length {batch} (batch size, len({n_ptr}) - 1), "
                         f"got {last.size}")
    pages = np.diff(ptr).astype(np.int64)
    for has_pages, low, what in ((True, 1, "a request with pages"),
                                 (False, 0, "a request without pages")):
        rows = np.flatnonzero((pages > 0) == has_pages)
        vals = last[rows]
        bad = (vals < low) | (vals > page_size)  # exact in the input's own dtype
        if np.any(bad):
            b = int(rows[np.argmax(bad)])
            raise ValueError(f"{n_last} values must lie in [{low}, {page_size + 1}) for {what} "
                             f"(page_size {page_size}), got {n_last}[{b}]={int(last[b])}")
    last = np.ascontiguousarray(last, dtype=np.int32)
    kv_lens = np.where(pages > 0, (pages - 1) * page_size + last, 0).astype(np.int64)
    return ptr, np.ascontiguousarray(idx, dtype=np.int32), last, kv_lens


@dataclass(frozen=True, eq=False)
class PageTable:
    """A validated page table for a batch of ``B`` requests.

    Parameters
    ----------
    indptr : array of int, shape [B + 1]
        FlashInfer's ``kv_indptr``: request ``b`` owns ``indices[indptr[b]:indptr[b + 1]]``.
    indices : array of int, shape [>= indptr[-1]]
        FlashInfer's ``kv_indices``: physical page ids in ``[0, num_pages)``, in logical order.
        Only the first ``indptr[-1]`` entries are kept (FlashInfer reads no more).
    last_page_len : array of int, shape [B]
        FlashInfer's ``kv_last_page_len``: filled slots of each request's last page, in
        ``[1, page_size]``; for a request with no pages it is ignored and may be 0.
    page_size : int
        Token slots per page (``Bc`` of the BSR view), >= 1.
    num_pages : int
        Physical pages in the KV pool, >= 0.

    Notes
    -----
    Index arrays of any integer dtype are validated by :func:`check_page_table` and stored as
    read-only int32 copies. The KV length of request ``b`` is
    ``(pages_b - 1) * page_size + last_page_len[b]``, or 0 when it has no pages.
    """

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    page_size: int
    num_pages: int

    def __post_init__(self):
        num_pages = check_positive_int("num_pages", self.num_pages, minimum=0)
        indptr, indices, last, _ = check_page_table(self.indptr, self.indices,
                                                    self.last_page_len, self.page_size,
                                                    num_pages=num_pages)
        for name, value in (("indptr", indptr), ("indices", indices), ("last_page_len", last)):
            frozen = np.array(value, dtype=np.int32, copy=True)  # never freeze the caller's array
            frozen.setflags(write=False)
            object.__setattr__(self, name, frozen)
        object.__setattr__(self, "page_size", int(self.page_size))
        object.__setattr__(self, "num_pages", num_pages)

    @property
    def batch_size(self) -> int:
        """Number of requests ``B``."""
        return self.indptr.size - 1

    def num_pages_per_request(self) -> np.ndarray:
        """Pages each request owns, int64 [B]."""
        return np.diff(self.indptr).astype(np.int64)

    def kv_lens(self) -> np.ndarray:
        """Tokens each request holds, int64 [B]: ``(pages - 1) * page_size + last_page_len``."""
        pages = self.num_pages_per_request()
        full = (pages - 1) * self.page_size + self.last_page_len
        return np.where(pages > 0, full, 0).astype(np.int64)

    def token_slots(self, b: int) -> np.ndarray:
        """Physical slot ids ``page * page_size + offset`` of request ``b``'s tokens.

        Returns int64 [kv_lens()[b]], in logical (token) order: indexing a flattened
        ``[num_pages * page_size, ...]`` K or V pool with them gathers the request's keys/values.
        """
        b = check_positive_int("b", b, minimum=0)
        if b >= self.batch_size:
            raise ValueError(f"b must be < batch_size={self.batch_size}, got {b}")
        pages = self.indices[self.indptr[b]:self.indptr[b + 1]].astype(np.int64)
        slots = (pages[:, None] * self.page_size + np.arange(self.page_size)).ravel()
        # Every page is full except the last, which holds last_page_len[b] tokens.
        unused = self.page_size - int(self.last_page_len[b]) if pages.size else 0
        return slots[:slots.size - unused]

    def to_bsr(self, rows_per_request: int = 1) -> BSR:
        """The page table as a BSR over ``[B * rows_per_request, num_pages * page_size]``.

        Parameters
        ----------
        rows_per_request : int
            ``Br``: query rows that share each request's pages (1 for decode; the query tile
            size for prefill). Every row of request ``b``'s block row reads the same pages.

        Returns
        -------
        BSR
            ``block_shape=(rows_per_request, page_size)``; ``indptr``, ``indices`` and
            ``last_block_len`` are this table's ``indptr``, ``indices`` and ``last_page_len``.
        """
        br = check_positive_int("rows_per_request", rows_per_request)
        return BSR(self.indptr, self.indices, (br, self.page_size),
                   (self.batch_size * br, self.num_pages * self.page_size),
                   last_block_len=self.last_page_len)

    @classmethod
    def from_bsr(cls, bsr: BSR) -> PageTable:
        """Invert :meth:`to_bsr`: one request per block row, ``page_size = Bc``.

        ``bsr`` must carry ``last_block_len`` and have ``N`` a multiple of ``Bc`` (a physical
        page is never cut by the matrix edge), so nothing is lost.
        """
        if not isinstance(bsr, BSR):
            raise TypeError(f"bsr must be a BSR, got {type(bsr).__name__}")
        if bsr.last_block_len is None:
            raise ValueError("bsr.last_block_len must be set to read it as a page table, got None")
        bc = bsr.block_shape[1]
        if bsr.shape[1] % bc:
            raise ValueError(
                f"bsr.shape[1] must be a multiple of block_shape[1]={bc} (whole pages), "
                f"got {bsr.shape[1]}")
        return cls(bsr.indptr, bsr.indices, bsr.last_block_len, bc, bsr.num_block_cols)

    @classmethod
    def from_kv_lens(cls, kv_lens, page_size: int, *, num_pages: int | None = None,
                     rng=None) -> PageTable:
        """Allocate fresh pages for requests of the given KV lengths.

        Parameters
        ----------
        kv_lens : array of int, shape [B]
            Tokens per request, >= 0. A request of length 0 gets no pages (``last_page_len`` 0).
        page_size : int
            Token slots per page, >= 1.
        num_pages : int, optional
            Size of the physical pool; default exactly the pages needed. Must be at least that.
        rng : numpy.random.Generator or int, optional
            ``None`` hands out pages ``0, 1, 2, ...`` in request order (contiguous KV). A
            generator (or a seed) draws distinct physical ids at random from the whole pool, as
            an allocator that has been running for a while would.

        Returns
        -------
        PageTable
        """
        lens = as_index_array("kv_lens", kv_lens).astype(np.int64)
        check_range("kv_lens", lens, 0, np.iinfo(np.int32).max)
        page_size = check_positive_int("page_size", page_size)
        pages = -(-lens // page_size)
        needed = int(pages.sum())
        if num_pages is None:
            num_pages = needed
        num_pages = check_positive_int("num_pages", num_pages, minimum=0)
        if num_pages < needed:
            raise ValueError(f"num_pages must be >= {needed} (pages the lengths need), "
                             f"got {num_pages}")
        if rng is None:
            indices = np.arange(needed)
        elif isinstance(rng, np.random.Generator) or (
                isinstance(rng, numbers.Integral) and not isinstance(rng, bool)):
            indices = np.random.default_rng(rng).choice(num_pages, size=needed, replace=False)
        else:
            raise TypeError(f"rng must be None, an int seed or a numpy Generator, "
                            f"got {type(rng).__name__}")
        indptr = np.concatenate([[0], np.cumsum(pages)])
        last = np.where(pages > 0, lens - (pages - 1) * page_size, 0)
        return cls(indptr, indices, last, page_size, num_pages)

    def __repr__(self):
        return (f"PageTable(batch_size={self.batch_size}, page_size={self.page_size}, "
                f"num_pages={self.num_pages}, tokens={int(self.kv_lens().sum())})")
