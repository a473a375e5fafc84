"""A radix tree of token sequences over a paged KV pool, and the cascade levels of a batch.

A serving system keeps the KV of every sequence it has seen in pages of one pool and shares the
pages of common prefixes (RadixAttention). Sharing is page-granular: an edge of the tree holds
whole pages (``page_size`` tokens each), nodes split only at page boundaries, and a partly
filled last page belongs to exactly one sequence (a "tail" hanging off the node it follows).

:meth:`RadixTree.cascade_levels` turns a batch of requests into the per-level page tables of
:func:`nbinfer.reference.multi_level_cascade_attention`: level ``l`` holds the shared nodes at
depth ``l`` of the batch's prefix tree, one qo segment per node (its pages listed once, never
copied), and the last level holds each request's private pages. Requests are reordered so the
requests below a node are contiguous rows (``CascadeLevels.order``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._checks import as_index_array, check_positive_int

__all__ = ["CascadeLevels", "RadixTree"]


class _Node:
    __slots__ = ("tokens", "pages", "children", "tails", "terminal", "stamp")

    def __init__(self, tokens=(), pages=(), stamp=0):
        self.tokens, self.pages = list(tokens), list(pages)
        self.children = {}  # tokens of the child's first page (tuple) -> _Node
        self.tails = {}  # tokens of a partial last page (tuple) -> its page id
        self.terminal = False  # a stored sequence ends exactly here
        self.stamp = stamp  # when a match or insert last went through it (for eviction)


@dataclass(frozen=True, eq=False)
class CascadeLevels:
    """Per-level page tables of a batch, in the argument format of
    :func:`nbinfer.reference.multi_level_cascade_attention` (lists, one int32 array per level).

    Attributes
    ----------
    qo_indptr_arr : list of int32 arrays, ``[B_l + 1]`` each
    paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len_arr : lists of int32 arrays
        Level ``l``'s page table, one entry per qo segment (empty segments: no pages, len 0).
    order : int64 array, shape [B]
        ``order[i]`` is the batch request whose queries are the ``i``-th request of the levels.
    qo_indptr : int32 array, shape [B + 1]
        Query rows of the reordered requests (equal to ``qo_indptr_arr[-1]``).
    rows : int64 array, shape [nnz_qo]
        Row of the caller's batch-ordered ``q`` for each level row: ``q_levels = q[rows]``,
        ``o[rows] = o_levels``.
    """

    qo_indptr_arr: list
    paged_kv_indptr_arr: list
    paged_kv_indices_arr: list
    paged_kv_last_page_len_arr: list
    order: np.ndarray
    qo_indptr: np.ndarray
    rows: np.ndarray

    @property
    def num_levels(self) -> int:
        """Number of levels (shared depths + the private level)."""
        return len(self.qo_indptr_arr)

    def plot(self, ax=None):
        """Draw query rows x pages, each block coloured by the level that reads it."""
        cols = np.unique(np.concatenate(self.paged_kv_indices_arr))
        grid = np.full((int(self.qo_indptr[-1]), cols.size), -1.0)
        for lvl in range(self.num_levels):
            qo, kv = self.qo_indptr_arr[lvl], self.paged_kv_indptr_arr[lvl]
            for s in range(qo.size - 1):
                pages = self.paged_kv_indices_arr[lvl][kv[s]:kv[s + 1]]
                grid[qo[s]:qo[s + 1], np.searchsorted(cols, pages)] = lvl
        fig, ax = _axes(ax, (1.5 + 0.35 * cols.size, 1.5 + 0.3 * grid.shape[0]))
        from matplotlib.colors import ListedColormap
        cmap = ListedColormap(["white"] + [f"C{i % 10}" for i in range(self.num_levels)])
        ax.imshow(grid, cmap=cmap, vmin=-1.5, vmax=self.num_levels - 0.5, aspect="auto",
                  interpolation="nearest")
        for y in self.qo_indptr[1:-1]:
            ax.axhline(y - 0.5, color="k", linewidth=0.6)
        ax.set_xticks(range(cols.size), labels=[str(c) for c in cols], fontsize=7)
        ax.set(xlabel="physical page", ylabel="query row (reordered batch)")
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(color=f"C{i % 10}", label=f"level {i}")
                           for i in range(self.num_levels)], fontsize=7, loc="best")
        ax.set_title(f"cascade: {self.num_levels} levels (colour = level)", fontsize=10)
        return fig


def _axes(ax, figsize):
    if ax is None:
        from ..viz import subplots
        return subplots(figsize=figsize)
    return ax.figure, ax


class RadixTree:
    """Token sequences whose KV lives in pages of a shared pool, shared by whole pages.

    Parameters
    ----------
    page_size : int
        Tokens per page, >= 1.
    """

    def __init__(self, page_size: int):
        self.page_size = check_positive_int("page_size", page_size)
        self._root = _Node()
        self._held = set()  # every page id the tree holds
        self._count = 0
        self._clock = 0  # advances with every match and insert: the eviction order

    def __len__(self) -> int:
        """Number of distinct stored sequences."""
        return self._count

    def __contains__(self, tokens) -> bool:
        return self._find(self._tokens(tokens)) is not None

    # -- walking ---------------------------------------------------------------------------
    def _tokens(self, tokens, name="tokens") -> list:
        toks = as_index_array(name, tokens).tolist()
        if not toks:
            raise ValueError(f"{name} must hold at least one token, got an empty sequence")
        return toks

    def _descend(self, toks):
        """Follow whole pages: (last node fully matched, partly matched child or None, pages
        matched in that child, tokens matched, page ids matched)."""
        ps, node, pos, pages = self.page_size, self._root, 0, []
        while pos + ps <= len(toks):
            child = node.children.get(tuple(toks[pos:pos + ps]))
            if child is None:
                break
            n = len(child.pages)
            if toks[pos:pos + n * ps] == child.tokens:  # the whole edge: one list comparison
                j = n
            else:  # the first page that differs (or runs past the tokens)
                j = 1  # (the key matched page 0)
                while j < n and toks[pos + j * ps:pos + (j + 1) * ps] == \
                        child.tokens[j * ps:(j + 1) * ps]:
                    j += 1
            pages += child.pages[:j]
            if j < len(child.pages):
                return node, child, j, pos + j * ps, pages
            node, pos = child, pos + j * ps
        return node, None, 0, pos, pages

    def _find(self, toks, descent=None):
        """The pages of the stored sequence ``toks`` (None if it is not stored); ``descent``:
        :meth:`_descend`'s result for ``toks`` when the caller has it."""
        node, child, _, pos, pages = descent or self._descend(toks)
        rest = tuple(toks[pos:])
        if child is None and not rest and node.terminal:
            return pages
        if child is None and 0 < len(rest) < self.page_size and rest in node.tails:
            return pages + [node.tails[rest]]
        return None

    # -- public API ------------------------------------------------------------------------
    def match(self, tokens):
        """Longest page-aligned prefix of ``tokens`` whose pages the tree holds.

        Parameters
        ----------
        tokens : array of int, shape [n]
            Token ids, n >= 1.

        Returns
        -------
        num_matched_tokens : int
            A multiple of ``page_size`` (partial pages are never shared).
        pages : int32 array, shape [num_matched_tokens // page_size]
            The tree's page ids holding those tokens, in logical order.
        """
        toks = self._tokens(tokens)
        _, _, _, pos, pages = self._descend(toks)
        self._touch(toks)
        return pos, np.asarray(pages, dtype=np.int32)

    def _touch(self, toks) -> None:
        """Stamp every node on the path of ``toks`` as just used."""
        self._clock += 1
        ps, node, pos = self.page_size, self._root, 0
        node.stamp = self._clock  # the root's tails (sequences shorter than a page) too
        while pos + ps <= len(toks):
            node = node.children.get(tuple(toks[pos:pos + ps]))
            if node is None:
                return
            node.stamp = self._clock
            if toks[pos:pos + len(node.tokens)] != node.tokens:
                return  # the path leaves this edge part-way
            pos += len(node.pages) * ps

    @property
    def num_pages(self) -> int:
        """Pages the tree holds."""
        return len(self._held)

    def evict(self, num_pages: int, evictable=None) -> list[int]:
        """Drop least recently used leaves until ``num_pages`` pages are out (or none is left).

        A leaf is a partial tail page or a node with no children and no tails; the one whose
        path was matched or inserted longest ago goes first (a tail before its node). Only
        leaves whose every page passes ``evictable(page)`` are taken (a serving engine passes
        "no running sequence holds it"). Sequences that ended in a dropped leaf are no longer
        stored; their prefixes above it still match.

        Parameters
        ----------
        num_pages : int
            Pages wanted, >= 0.
        evictable : callable, optional
            ``evictable(page_id) -> bool``; default every page.

        Returns
        -------
        list of int
            The page ids dropped, which the caller may free.
        """
        want = check_positive_int("num_pages", num_pages, minimum=0)
        ok = evictable or (lambda page: True)
        freed = []
        while len(freed) < want:
            best, stack = None, [(self._root, None, None)]
            while stack:
                node, parent, key = stack.pop()
                cands = [((node.stamp, 0, len(freed)), (node, tail, [page]))
                         for tail, page in node.tails.items()]
                if parent is not None and not node.children and not node.tails:
                    cands.append(((node.stamp, 1, 0), (parent, key, node.pages)))
                for rank, cand in cands:
                    if (best is None or rank < best[0]) and all(ok(p) for p in cand[2]):
                        best = (rank, cand)
                stack.extend((c, node, k) for k, c in node.children.items())
            if best is None:
                break
            (_, kind, _), (owner, key, pages) = best
            if kind == 0:  # a tail: one stored sequence ends in it
                del owner.tails[key]
                self._count -= 1
            else:
                leaf = owner.children.pop(key)
                self._count -= leaf.terminal
            self._held.difference_update(pages)
            freed += pages
        return freed

    def lookup(self, tokens) -> np.ndarray:
        """All pages (int32 ``[ceil(n / page_size)]``) of a stored sequence; KeyError if absent."""
        pages = self._find(self._tokens(tokens))
        if pages is None:
            raise KeyError("tokens is not a sequence stored in the tree (insert it first)")
        return np.asarray(pages, dtype=np.int32)

    def _check_pages(self, toks, pages, name, descent):
        pg = as_index_array(name, pages).tolist()
        want = -(-len(toks) // self.page_size)
        if len(pg) != want:
            raise ValueError(f"{name} must have ceil(len(tokens) / page_size) = {want} page ids, "
                             f"got {len(pg)}")
        if (pg and min(pg) < 0) or len(set(pg)) != len(pg):
            raise ValueError(f"{name} must hold distinct page ids >= 0, got {pg}")
        # A page the tree holds may only stand where the tree keeps it for these tokens.
        known = self._find(toks, descent) or descent[4]
        for i, p in enumerate(pg):
            if p in self._held and (i >= len(known) or known[i] != p):
                raise ValueError(f"{name}[{i}]={p} is a page the tree holds for other tokens")
        return pg

    def insert(self, tokens, pages) -> int:
        """Store ``tokens`` whose KV lives in ``pages``; split a node where they diverge.

        Parameters
        ----------
        tokens : array of int, shape [n]
            Token ids, n >= 1.
        pages : array of int, shape [ceil(n / page_size)]
            Distinct page ids holding the tokens in logical order; only the last may be partial.

        Returns
        -------
        int
            Tokens already in the tree. Their pages stay the tree's (``match`` gives them); the
            caller's pages for them are not stored and may be freed.
        """
        toks = self._tokens(tokens)
        descent = self._descend(toks)  # one walk serves the check and the insert
        pg = self._check_pages(toks, pages, "pages", descent)
        ps = self.page_size
        self._clock += 1
        node, child, j, pos, _ = descent
        if child is not None:  # diverge (or end) inside child's edge: split at page j
            upper = _Node(child.tokens[:j * ps], child.pages[:j])
            child.tokens, child.pages = child.tokens[j * ps:], child.pages[j:]
            upper.children[tuple(child.tokens[:ps])] = child
            node.children[tuple(upper.tokens[:ps])] = upper
            node = upper
        full = (len(toks) - pos) // ps  # new whole pages, then maybe a partial tail page
        tail = tuple(toks[pos + full * ps:])
        if full:
            new = _Node(toks[pos:pos + full * ps], pg[pos // ps:pos // ps + full], self._clock)
            node.children[tuple(toks[pos:pos + ps])] = new
            self._held.update(new.pages)
            node = new
        self._touch(toks)
        if (tail in node.tails) if tail else node.terminal:
            return len(toks)  # the very same sequence is stored already
        if tail:
            node.tails[tail] = pg[-1]
            self._held.add(pg[-1])
        else:
            node.terminal = True
        self._count += 1
        return pos

    def cascade_levels(self, batch, qo_lens=None, *, causal: bool = False) -> CascadeLevels:
        """Cascade levels of a batch: shared prefixes once per level, private pages last.

        Parameters
        ----------
        batch : sequence of requests
            Each a token sequence stored in the tree, or a pair ``(tokens, pages)`` (e.g.
            ``match`` pages plus fresh ones). Requests share a level segment exactly where
            their page lists agree (same physical pages, same fill).
        qo_lens : array of int, shape [B], optional
            Query tokens per request, >= 0; default 1 each (decode).
        causal : bool
            Check that every request's queries fit the causal mask of the last level, i.e. its
            private tokens are at least ``qo_len - 1`` (a request that ends inside a prefix it
            shares with another request has none).

        Returns
        -------
        CascadeLevels
        """
        if isinstance(batch, (str, bytes)) or not hasattr(batch, "__len__") or not len(batch):
            raise ValueError("batch must be a non-empty sequence of requests")
        chains = []  # per request: keys (page id, filled slots), logical order
        for b, item in enumerate(batch):
            if isinstance(item, tuple) and len(item) == 2 and np.ndim(item[0]) == 1:
                toks = self._tokens(item[0], f"batch[{b}][0] (tokens)")
                pg = self._check_pages(toks, item[1], f"batch[{b}][1] (pages)",
                                       self._descend(toks))
            else:
                toks = self._tokens(item, f"batch[{b}]")
                pg = self._find(toks)
                if pg is None:
                    raise ValueError(f"batch[{b}] is not stored in the tree; insert it or pass "
                                     f"(tokens, pages)")
            fill = [self.page_size] * len(pg)
            fill[-1] = len(toks) - (len(pg) - 1) * self.page_size
            chains.append(list(zip(pg, fill, strict=True)))
        nb = len(chains)
        qo = np.ones(nb, np.int64) if qo_lens is None else as_index_array("qo_lens", qo_lens)
        if qo.size != nb or (qo.size and qo.min() < 0):
            raise ValueError(f"qo_lens must hold {nb} (batch size) values >= 0, got {qo.tolist()}")
        shared, private = [], [0] * nb
        order = np.asarray(_group(chains, list(range(nb)), 0, 0, shared, private), np.int64)
        slot = np.argsort(order)
        own = [chains[b][private[b]:] for b in range(nb)]
        own_len = np.array([sum(f for _, f in keys) for keys in own])
        if causal and np.any(own_len < qo - 1):
            b = int(np.argmax(own_len < qo - 1))
            raise ValueError(f"qo_lens[{b}]={qo[b]}: request {b} has only {own_len[b]} private "
                             f"tokens, so its queries do not fit the causal last level")
        qo_ptr = np.concatenate([[0], np.cumsum(qo[order])]).astype(np.int32)
        levels, bounds = [], {0, nb}
        for lvl in range(1 + max((d for d, _, _ in shared), default=-1)):
            nodes = {(int(slot[grp].min()), int(slot[grp].max()) + 1): keys  # rows of the node
                     for d, grp, keys in shared if d == lvl}
            bounds |= {x for span in nodes for x in span}
            cuts = sorted(bounds)  # every boundary of a shallower level stays: a coarsening
            levels.append((cuts, [nodes.get(s, []) for s in zip(cuts[:-1], cuts[1:], strict=True)]))
        levels.append((list(range(nb + 1)), [own[b] for b in order]))
        arrs = ([], [], [], [])
        for cuts, segs in levels:
            arrs[0].append(qo_ptr[cuts].astype(np.int32))
            arrs[1].append(np.cumsum([0] + [len(s) for s in segs]).astype(np.int32))
            arrs[2].append(np.asarray([p for s in segs for p, _ in s], dtype=np.int32))
            arrs[3].append(np.asarray([s[-1][1] if s else 0 for s in segs], dtype=np.int32))
        start = np.concatenate([[0], np.cumsum(qo)])
        rows = np.concatenate([np.zeros(0, np.int64)] +
                              [np.arange(start[b], start[b + 1]) for b in order])
        return CascadeLevels(*arrs, order=order, qo_indptr=qo_ptr, rows=rows)

    def plot(self, ax=None):
        """Draw the tree: a box per node with its page ids, tails (partial pages) as
        ``p<id>(<filled>)`` under ``+``. Returns the figure."""
        xy, edges, leaves = {}, [], [0]

        def place(node, depth):
            xs = [place(c, depth + 1) for c in node.children.values()]
            edges.extend((node, c) for c in node.children.values())
            if not xs:
                xs, leaves[0] = [leaves[0]], leaves[0] + 1
            xy[node] = (float(np.mean(xs)), depth)
            return xy[node][0]

        place(self._root, 0)
        height = 1 + max(y for _, y in xy.values())
        fig, ax = _axes(ax, (1.5 + 1.3 * leaves[0], 1.0 + 0.9 * height))
        for a, b in edges:
            ax.plot([xy[a][0], xy[b][0]], [xy[a][1], xy[b][1]], color="0.5", zorder=1)
        for node, (x, y) in xy.items():
            text = " ".join(f"p{p}" for p in node.pages) or "root"
            tails = " ".join(f"p{p}({len(t)})" for t, p in node.tails.items())
            ax.text(x, y, text + (f"\n+ {tails}" if tails else ""), ha="center", va="center",
                    fontsize=8, zorder=2, bbox=dict(boxstyle="round", fc="#dde8f6"))
        ax.set(xlim=(-0.8, leaves[0] - 0.2), ylim=(height - 0.4, -0.6))
        ax.axis("off")
        ax.set_title(f"radix tree, page_size={self.page_size}, {len(self)} sequences", fontsize=10)
        return fig


def _group(chains, members, pos, depth, shared, private):
    """Split ``members`` (sharing chains[:pos]) by their next page; return them in DFS order.

    Shared runs are appended to ``shared`` as (depth, members, keys); ``private[b]`` is where
    request b's own pages start. Groups are visited in order of their smallest member, so an
    already grouped batch keeps its order."""
    items = {}
    for b in members:
        key = ("end", b) if len(chains[b]) == pos else chains[b][pos]
        items.setdefault(key, []).append(b)
    order = []
    for key, grp in sorted(items.items(), key=lambda kv: kv[1][0]):
        if key[0] == "end" or len(grp) == 1:
            private[grp[0]] = pos
            order += grp
            continue
        end = pos + 1
        while all(len(chains[b]) > end for b in grp) and \
                len({chains[b][end] for b in grp}) == 1:
            end += 1
        shared.append((depth, np.asarray(grp), chains[grp[0]][pos:end]))
        order += _group(chains, grp, end, depth + 1, shared, private)
    return order
