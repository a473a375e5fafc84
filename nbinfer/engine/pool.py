"""The engine's KV pool: page ids handed out and taken back, with reference counts.

The memory itself (one ``[num_pages, 2, page_size, Hkv, D]`` cache per layer) belongs to the
model runner; the pool only decides which page ids a sequence owns. A page returns to the free
list when its last owner lets go, so sequences that share a prefix can share its pages.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_positive_int

__all__ = ["PagePool", "pages_for_budget"]


class PagePool:
    """Page ids ``0 .. num_pages - 1`` with reference counts.

    Parameters
    ----------
    num_pages : int
        Pages in the pool (>= 1).
    page_size : int
        Token slots per page (>= 1).
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = check_positive_int("num_pages", num_pages)
        self.page_size = check_positive_int("page_size", page_size)
        self.refs = np.zeros(num_pages, dtype=np.int32)
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def occupancy(self) -> float:
        """Share of the pages in use."""
        return 1.0 - len(self._free) / self.num_pages

    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages (reference count 1), or None when fewer than ``n`` are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.refs[pages] = 1
        return pages

    def retain(self, pages) -> None:
        """One more owner for each of ``pages`` (all in use)."""
        pages = list(pages)
        if pages and np.any(self.refs[pages] < 1):
            raise ValueError("retain() of a free page")
        np.add.at(self.refs, pages, 1)

    def release(self, pages) -> None:
        """One owner fewer for each of ``pages``; pages nobody owns become free."""
        for p in pages:
            if self.refs[p] < 1:
                raise ValueError(f"release() of free page {p}")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)


def pages_for_budget(nbytes: int, kv_bytes_per_token: int, page_size: int) -> int:
    """How many pages of ``page_size`` tokens fit in ``nbytes`` of KV memory."""
    pages = int(nbytes) // (kv_bytes_per_token * page_size)
    if pages < 1:
        raise ValueError(f"a KV budget of {nbytes} bytes holds no page of {page_size} tokens "
                         f"({kv_bytes_per_token} bytes per token)")
    return pages
