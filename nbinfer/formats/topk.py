"""Query-aware top-k page selection (Quest): sparse decode over a page table, as a page table.

Quest keeps, for every KV page, the elementwise minimum and maximum of its keys. For a query
``q`` the logit of any key ``k`` in the page is bounded by

    q . k  <=  sum_d max(q_d * kmin_d, q_d * kmax_d),

so pages with the largest bound are the ones that can matter. Decode then reads only the top-k
pages of each request: a new page table whose indices are a subset of the old one (no KV copied,
just fewer indices), i.e. a BSR with ``(1, page_size)`` blocks.

The last page of a request is always kept and stays last, so ``kv_last_page_len`` carries over
unchanged: every other kept page is a full page, exactly as the page table format requires.
Kept pages stay in logical order. Positions are not preserved (the kept tokens read as one
shorter sequence), so keys must already be rotated (RoPE applied before caching), as in Quest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import check_choice, check_float, check_ndim, check_positive_int
from .paged import PageTable

__all__ = ["TopKPages", "page_key_summaries", "quest_page_scores", "select_topk_pages"]


def _table(table):
    if not isinstance(table, PageTable):
        raise TypeError(f"table must be a PageTable (PageTable(kv_indptr, kv_indices, "
                        f"kv_last_page_len, page_size, num_pages)), got {type(table).__name__}")
    return table


def page_key_summaries(k_cache, table, *, kv_layout: str = "NHD"):
    """Elementwise min and max of the valid keys of every physical page.

    Parameters
    ----------
    k_cache : array of float, shape [num_pages, page_size, Hkv, D] (NHD) or
        [num_pages, Hkv, page_size, D] (HND); or a whole paged cache with K/V axis 1
        (``[num_pages, 2, ...]``), of which the keys are used.
    table : PageTable
        Tells which slots hold tokens: all of a page, except where the page is only ever some
        request's partly filled last page.
    kv_layout : {"NHD", "HND"}

    Returns
    -------
    kmin, kmax : numpy.ndarray of float64, shape [num_pages, Hkv, D]
        Zero for pages no request lists (they are never scored).
    """
    table = _table(table)
    check_choice("kv_layout", kv_layout, ("NHD", "HND"))
    check_float("k_cache", k_cache)
    check_ndim("k_cache", k_cache, (4, 5))
    k = np.asarray(k_cache, dtype=np.float64)
    k = k[:, 0] if k.ndim == 5 else k
    k = k.transpose(0, 2, 1, 3) if kv_layout == "HND" else k
    if k.shape[:2] != (table.num_pages, table.page_size):
        raise ValueError(f"k_cache must hold table.num_pages={table.num_pages} pages of "
                         f"table.page_size={table.page_size} slots, got shape {k.shape} (NHD)")
    filled = np.zeros(table.num_pages, dtype=np.int64)  # slots used by any request
    fill = np.full(table.indices.size, table.page_size, dtype=np.int64)
    has = np.diff(table.indptr) > 0
    fill[table.indptr[1:][has] - 1] = table.last_page_len[has]
    np.maximum.at(filled, table.indices, fill)
    valid = (np.arange(table.page_size)[None, :] < filled[:, None])[:, :, None, None]
    with np.errstate(invalid="ignore"):
        kmin = np.where(valid, k, np.inf).min(axis=1)
        kmax = np.where(valid, k, -np.inf).max(axis=1)
    unused = (filled == 0)[:, None, None]
    return np.where(unused, 0.0, kmin), np.where(unused, 0.0, kmax)


def quest_page_scores(q, kmin, kmax, table, *, per_kv_head: bool = False) -> np.ndarray:
    """Quest's upper bound of every (request, page) entry of a page table.

    Parameters
    ----------
    q : array of float, shape [B, Hq, D]
        One decode query per request; ``Hq`` a multiple of ``Hkv`` (GQA).
    kmin, kmax : array of float, shape [num_pages, Hkv, D]
        Per-page key summaries (see :func:`page_key_summaries`).
    table : PageTable
        ``B`` requests.
    per_kv_head : bool
        False: one score per entry, summed over all query heads. True: one per kv head, summed
        over the query heads of its group.

    Returns
    -------
    numpy.ndarray of float64, shape [nnz_pages] or [nnz_pages, Hkv]
        ``sum_h sum_d max(q[b, h, d] * kmin[p, g(h), d], q[b, h, d] * kmax[p, g(h), d])``.
    """
    table = _table(table)
    for name, arr in (("q", q), ("kmin", kmin), ("kmax", kmax)):
        check_float(name, arr)
        check_ndim(name, arr, 3)
    lo, hi = np.asarray(kmin, np.float64), np.asarray(kmax, np.float64)
    q = np.asarray(q, np.float64)
    if lo.shape != hi.shape or lo.shape[0] != table.num_pages:
        raise ValueError(f"kmin and kmax must both have shape [num_pages={table.num_pages}, "
                         f"Hkv, D], got {lo.shape} and {hi.shape}")
    b, hq, d = q.shape
    hkv = lo.shape[1]
    if b != table.batch_size or d != lo.shape[2] or hq % hkv:
        raise ValueError(f"q must have shape [B={table.batch_size}, Hq (a multiple of "
                         f"Hkv={hkv}), D={lo.shape[2]}], got {q.shape}")
    req = np.repeat(np.arange(b), np.diff(table.indptr))
    qq = q[req].reshape(req.size, hkv, hq // hkv, d)
    lo, hi = lo[table.indices][:, :, None, :], hi[table.indices][:, :, None, :]
    bound = np.maximum(qq * lo, qq * hi).sum(axis=(2, 3))  # [nnz, Hkv]
    return bound if per_kv_head else bound.sum(axis=1)


@dataclass(frozen=True, eq=False)
class TopKPages:
    """A top-k selection: the kept pages as a page table over the same physical pool.

    Attributes
    ----------
    table : PageTable
        ``B`` rows (one selection per request), or ``B * Hkv`` rows (row ``b * Hkv + g`` is kv
        head ``g`` of request ``b``). ``last_page_len`` is the source table's, per request.
    logical : int32 array, shape [table.indices.size]
        Logical page number (position in its request) of every kept entry.
    request : int32 array, shape [table.batch_size]
        Source request of each row.
    num_kv_heads : int or None
        ``Hkv`` for per-kv-head selections, else None.
    """

    table: PageTable
    logical: np.ndarray
    request: np.ndarray
    num_kv_heads: int | None = None

    @property
    def bsr(self):
        """The selection as a BSR with ``(1, page_size)`` blocks (``PageTable.to_bsr``)."""
        return self.table.to_bsr()

    def for_kv_head(self, g: int) -> PageTable:
        """Rows of kv head ``g`` (one per request): decode it on the cache's head ``g``."""
        if self.num_kv_heads is None:
            raise ValueError("for_kv_head needs a per_kv_head selection")
        g = check_positive_int("g", g, minimum=0)
        if g >= self.num_kv_heads:
            raise ValueError(f"g must be < num_kv_heads={self.num_kv_heads}, got {g}")
        t, rows = self.table, np.arange(g, self.table.batch_size, self.num_kv_heads)
        counts = np.diff(t.indptr)[rows]
        idx = np.concatenate([np.zeros(0, np.int32)] +
                             [t.indices[t.indptr[r]:t.indptr[r + 1]] for r in rows])
        return PageTable(np.concatenate([[0], np.cumsum(counts)]), idx, t.last_page_len[rows],
                         t.page_size, t.num_pages)

    def token_mask(self, row: int, kv_len: int) -> np.ndarray:
        """Bool ``[kv_len]`` over row ``row``'s source request: True for tokens of kept pages."""
        row = check_positive_int("row", row, minimum=0)
        if row >= self.table.batch_size:
            raise ValueError(f"row must be < {self.table.batch_size}, got {row}")
        kept = np.zeros(-(-check_positive_int("kv_len", kv_len, minimum=0) //
                          self.table.page_size), dtype=bool)
        kept[self.logical[self.table.indptr[row]:self.table.indptr[row + 1]]] = True
        return np.repeat(kept, self.table.page_size)[:kv_len]

    def plot(self, ax=None):
        """Draw rows x logical pages: kept pages solid (labelled with their physical id), dropped
        pages pale, white past a request's last page. Returns the figure."""
        t = self.table
        width = int(self.logical.max()) + 1 if self.logical.size else 1
        grid = np.arange(width)[None, :] <= self.logical[np.maximum(t.indptr[1:] - 1, 0)][:, None]
        grid = np.where(grid & (np.diff(t.indptr) > 0)[:, None], 0.35, 0.0)
        fig, ax = (ax.figure, ax) if ax is not None else _subplots(width, t.batch_size)
        for r in range(t.batch_size):
            for k in range(t.indptr[r], t.indptr[r + 1]):
                grid[r, self.logical[k]] = 1.0
                ax.text(self.logical[k], r, str(t.indices[k]), ha="center", va="center",
                        fontsize=7, color="white")
        ax.imshow(grid, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_yticks(range(t.batch_size))
        ax.set_xlabel("logical page")
        ax.set_ylabel("request" if self.num_kv_heads is None else "request x kv head")
        ax.set_title("top-k pages (label: physical page)", fontsize=10)
        return fig


def _subplots(width, height):
    from ..viz import subplots
    return subplots(figsize=(1.5 + 0.4 * width, 1.2 + 0.35 * height))


def select_topk_pages(table, scores, top_k: int) -> TopKPages:
    """Keep the ``top_k`` highest-scoring pages of every request (or request x kv head).

    Parameters
    ----------
    table : PageTable
        The full page table, ``B`` requests.
    scores : array of float, shape [nnz_pages] or [nnz_pages, Hkv]
        A score per entry of ``table.indices`` (e.g. :func:`quest_page_scores`); a second axis
        selects separately per kv head.
    top_k : int
        Pages kept per row, >= 1; a request with at most ``top_k`` pages keeps all of them.

    Returns
    -------
    TopKPages
        Per row: the request's last page, plus the ``top_k - 1`` best others, ties broken by the
        lower logical page number; kept pages in logical order.
    """
    table = _table(table)
    top_k = check_positive_int("top_k", top_k)
    check_float("scores", scores)
    check_ndim("scores", scores, (1, 2))
    s = np.asarray(scores, dtype=np.float64)
    if s.shape[0] != table.indices.size or not np.all(np.isfinite(s)):
        raise ValueError(f"scores must be finite with shape[0] = {table.indices.size} "
                         f"(entries of table.indices), got shape {s.shape}")
    heads = s.shape[1] if s.ndim == 2 else None
    s = s.reshape(s.shape[0], -1)
    counts, rows, logical, request = np.diff(table.indptr), [], [], []
    for b in range(table.batch_size):
        a, n = int(table.indptr[b]), int(counts[b])
        for g in range(s.shape[1]):
            others = np.lexsort((np.arange(n - 1), -s[a:a + n - 1, g]))[:max(top_k - 1, 0)]
            keep = np.sort(np.append(others, n - 1)) if n else np.zeros(0, np.int64)
            rows.append(keep.size)
            logical.append(keep)
            request.append(b)
    logical = np.concatenate([np.zeros(0, np.int64)] + logical)
    req = np.asarray(request, dtype=np.int32)
    start = np.repeat(table.indptr[:-1][req].astype(np.int64), rows)
    kept = PageTable(np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]), table.indices[start + logical],
                     table.last_page_len[req], table.page_size, table.num_pages)
    return TopKPages(kept, logical.astype(np.int32), req, heads)
