"""A paged KV cache's page table (FlashInfer's ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``).

The KV pool is ``num_pages`` physical pages of ``page_size`` token slots each. Request ``b`` owns
the logical page chain ``indices[indptr[b]:indptr[b + 1]]``: logical page ``p`` of the request
lives in physical page ``indices[indptr[b] + p]``. Pages need not be adjacent or sorted, and two
requests may list the same physical page (a shared prefix). Only the last page of a request may
be partly filled; ``last_page_len[b]`` says how many of its slots hold tokens.

Read as a matrix with one row per request and one column per physical token slot, the table is a
BSR with blocks ``(1, page_size)`` (Figure 2 of the FlashInfer paper): :meth:`PageTable.to_bsr`
and :meth:`PageTable.from_bsr` convert without losing anything.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from .._checks import as_index_array, check_indptr, check_positive_int, check_range
from .bsr import BSR


@dataclass(frozen=True, eq=False)
class PageTable:
    """A validated page table for a batch of ``B`` requests.

    Parameters
    ----------
    indptr : array of int, shape [B + 1]
        FlashInfer's ``kv_indptr``: request ``b`` owns ``indices[indptr[b]:indptr[b + 1]]``.
    indices : array of int, shape [indptr[-1]]
        FlashInfer's ``kv_indices``: physical page ids in ``[0, num_pages)``, in logical order.
    last_page_len : array of int, shape [B]
        FlashInfer's ``kv_last_page_len``: filled slots of each request's last page, in
        ``[1, page_size]``; for a request with no pages it is ignored and may be 0.
    page_size : int
        Token slots per page (``Bc`` of the BSR view), >= 1.
    num_pages : int
        Physical pages in the KV pool, >= 0.

    Notes
    -----
    Index arrays are stored as read-only int32 copies. The KV length of request ``b`` is
    ``(pages_b - 1) * page_size + last_page_len[b]``, or 0 when it has no pages.
    """

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    page_size: int
    num_pages: int

    def __post_init__(self):
        page_size = check_positive_int("page_size", self.page_size)
        num_pages = check_positive_int("num_pages", self.num_pages, minimum=0)
        indices = as_index_array("indices", self.indices)
        indptr = check_indptr("indptr", self.indptr, total=indices.size)
        check_range("indices", indices, 0, num_pages)
        last = as_index_array("last_page_len", self.last_page_len)
        batch = indptr.size - 1
        if last.size != batch:
            raise ValueError(
                f"last_page_len must have length {batch} (batch size), got {last.size}")
        nonempty = np.diff(indptr) > 0
        check_range("last_page_len", np.where(nonempty, last, 1), 1, page_size + 1)
        check_range("last_page_len", last, 0, page_size + 1)
        for name, value in (("indptr", indptr), ("indices", indices), ("last_page_len", last)):
            frozen = np.array(value, dtype=np.int32, copy=True)  # never freeze the caller's array
            frozen.setflags(write=False)
            object.__setattr__(self, name, frozen)
        object.__setattr__(self, "page_size", page_size)
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
