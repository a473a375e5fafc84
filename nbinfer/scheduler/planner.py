"""``plan()``: from the lengths of one step's requests to the work of every CTA (pure NumPy, CPU).

Four decisions, each a few vectorised NumPy lines:

1. Query tile. FlashInfer packs the GQA group into the query tile (a CTA serving KV head ``hk``
   holds ``qo_len * G`` query rows x heads), and picks the tile height ``T_q`` from the mean packed
   length: ``> 64 -> 128``, ``> 16 -> 64``, else ``16``. A tile then covers ``T_q // G`` query rows
   (at least 1, at most the longest request), so decode (``qo_len == 1``) gets tiles of 1 row.
2. KV chunk. ``L_kv = ceil(total KV work / num_ctas)``, rounded up to ``granule`` tokens: were every
   item exactly ``L_kv`` long, every CTA would get one. A tile whose KV is longer than ``L_kv`` is
   cut into ``n = ceil(kv / L_kv)`` chunks of equal size (rounded up to ``granule``, so each is
   ``<= L_kv`` and every boundary is a multiple of ``granule``); a tile that fits is not split and
   writes its output directly. ``fixed_split_size`` replaces this: chunks of exactly that many
   tokens (the last one shorter), independent of the rest of the batch (batch invariance).
3. LPT assignment of the ``(request, kv_head, tile, chunk)`` items, with cost
   ``alpha * l_q + beta * (l_kv + item_overhead)`` (:mod:`.lpt`; ``item_overhead`` is 0 for the
   byte model, a few KV tiles on the tensor-core kernel, where an item's start and end are real
   time the bytes do not show).
4. Partial rows and the reduction map (:mod:`.reduction`).

Causal masking (bottom-right aligned, as everywhere in nbinfer): query row ``i`` of a request with
``qo_len`` rows and ``kv_len`` tokens sees tokens ``[0, kv_len - qo_len + i + 1)``. With
``causal=True`` a tile's KV range stops at what its *last* row sees, so the tiles of a long prompt
get shorter, cheaper items and the chunk size counts only visible tokens. Inside a tile the rows
still see different prefixes: the kernel applies the mask, and a chunk a row cannot see leaves an
empty partial (LSE ``-inf``) that the merge skips. Nothing finer than that is modelled.
"""

from __future__ import annotations

import numbers

import numpy as np

from .._checks import as_index_array, check_heads, check_indptr, check_positive_int
from .lpt import integer_costs, lpt_assign
from .reduction import assign_partials, reduction_map
from .schedule import WORK_FIELDS, Plan

__all__ = ["choose_tile_q", "plan"]

TILE_Q_CHOICES = (16, 64, 128)
INT32_MAX = int(np.iinfo(np.int32).max)


def choose_tile_q(mean_packed_qo_len: float) -> int:
    """FlashInfer's query tile height (in packed rows = query rows x GQA group) for a batch.

    Parameters
    ----------
    mean_packed_qo_len : float
        Mean query length over the requests times the GQA group size.

    Returns
    -------
    int
        128 above 64 packed rows, 64 above 16, else 16.
    """
    if mean_packed_qo_len > 64:
        return 128
    if mean_packed_qo_len > 16:
        return 64
    return 16


def _ceil_div(a, b):
    return -(-a // b)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.size + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def check_weights(alpha, beta) -> tuple[float, float]:
    """The LPT cost weights ``alpha`` (per query row) and ``beta`` (per KV token): finite, >= 0,
    not both 0; returned as floats."""
    alpha, beta = _check_weight("alpha", alpha), _check_weight("beta", beta)
    if alpha == 0 and beta == 0:
        raise ValueError("alpha and beta must not both be 0 (every item would cost nothing)")
    return alpha, beta


def check_item_overhead(value) -> int:
    """``item_overhead``: an int ``>= 0`` (KV tokens of cost per item)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"item_overhead must be an int, got {type(value).__name__}")
    if not 0 <= value <= INT32_MAX:  # it sits in the packed plan's int32 header
        raise ValueError(f"item_overhead must be in [0, {INT32_MAX}], got {value}")
    return int(value)


def _check_weight(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return float(value)


def plan(qo_indptr, kv_lens, num_qo_heads: int, num_kv_heads: int, num_ctas: int, *,
         granule: int = 16, alpha: float = 1.0, beta: float = 1.0,
         fixed_split_size: int | None = None, causal: bool = False,
         tile_q: int | None = None, item_overhead: int = 0,
         l2_section_kv: int | None = None) -> Plan:
    """Schedule one step: split every (request, kv head, query tile) into KV chunks and assign
    the chunks to CTAs, longest first.

    Parameters
    ----------
    qo_indptr : array [B + 1], integer
        Query rows of request ``b`` are ``qo_indptr[b]:qo_indptr[b + 1]`` (decode:
        ``arange(B + 1)``). A request with no query rows gets no work.
    kv_lens : array [B], integer, ``>= 0``
        KV tokens of every request.
    num_qo_heads, num_kv_heads : int
        Head counts; ``num_qo_heads`` must be a multiple of ``num_kv_heads`` (GQA group ``G``).
    num_ctas : int
        CTAs of the (persistent) grid: SM count x CTAs per SM.
    granule : int, optional
        KV tokens a CTA consumes per round (e.g. a page or a multiple of it); adaptive chunk sizes
        and boundaries are multiples of it.
    alpha, beta : float, optional
        Cost model ``alpha * l_q + beta * l_kv`` (``l_q`` = query rows x ``G``, ``l_kv`` = KV
        tokens). The default 1 : 1 counts bytes: a packed query row is read once and written once
        (2 x D elements), a KV token is one K and one V row (2 x D elements).
    fixed_split_size : int, optional
        Cut every request into chunks of exactly this many tokens, whatever the batch looks like,
        so a request's chunks (hence its bits) do not depend on the other requests.
    causal : bool, optional
        Bottom-right causal mask: each tile's KV range stops at what its last row can see.
    tile_q : int, optional
        Force the query tile height (packed rows) instead of :func:`choose_tile_q`.
    item_overhead : int, optional
        KV tokens added to every item's ``l_kv`` in the cost model (not to its work): the fixed
        start and end of an item (query load, pipeline fill, state write), which the byte count
        misses. 0 (the default) is the byte model; the tensor-core wrappers pass about four KV
        tiles (``nbinfer.api.prefill.mma_item_overhead``).
    l2_section_kv : int, optional
        Order the assignment for the L2: the (request, kv head) pairs, in order, are grouped
        into sections of about this many KV tokens (summed over the pairs; a pair's own KV is
        its request's), and LPT takes the sections one after another
        (:func:`~.lpt.lpt_assign`'s ``sections``), so the items running at once read the KV of
        about one section (FlashAttention-3 orders its tiles for the L2 the same way). None
        (the default): plain LPT, whose first items span every pair at once. Changes which
        CTA runs what and when, never the work items.

    Returns
    -------
    Plan
        Work items, CTA queues and reduction map, all int32 (see :class:`Plan`).
    """
    qo_indptr = check_indptr("qo_indptr", qo_indptr)
    batch = qo_indptr.size - 1
    kv = as_index_array("kv_lens", kv_lens)
    if kv.size != batch:
        raise ValueError(f"kv_lens must have length {batch} (len(qo_indptr) - 1), got {kv.size}")
    if batch and kv.min() < 0:
        bad = int(np.argmax(kv < 0))
        raise ValueError(f"kv_lens values must be >= 0, got kv_lens[{bad}]={int(kv[bad])}")
    group = check_heads(num_qo_heads, num_kv_heads)
    num_ctas = check_positive_int("num_ctas", num_ctas)
    granule = check_positive_int("granule", granule)
    alpha, beta = check_weights(alpha, beta)
    if fixed_split_size is not None:
        fixed_split_size = check_positive_int("fixed_split_size", fixed_split_size)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    causal = bool(causal)
    if tile_q is not None:
        tile_q = check_positive_int("tile_q", tile_q)
    item_overhead = check_item_overhead(item_overhead)
    if l2_section_kv is not None:
        l2_section_kv = check_positive_int("l2_section_kv", l2_section_kv)
    hkv = int(num_kv_heads)

    # 1. query tiles ------------------------------------------------------------------------------
    qo_lens = np.diff(qo_indptr).astype(np.int64)
    kv = kv.astype(np.int64)
    num_rows = int(qo_indptr[-1])
    if tile_q is None:
        tile_q = choose_tile_q(num_rows / batch * group if batch else 0.0)
    max_qo = int(qo_lens.max()) if batch else 1
    tile_rows = max(1, min(tile_q // group, max_qo))
    ntiles = _ceil_div(qo_lens, tile_rows)
    tile_req = np.repeat(np.arange(batch), ntiles)
    tile_idx = np.arange(tile_req.size) - _exclusive_cumsum(ntiles)[tile_req]
    qo_len_t, kv_len_t = qo_lens[tile_req], kv[tile_req]
    qs = tile_idx * tile_rows
    qe = np.minimum(qs + tile_rows, qo_len_t)
    rows = qe - qs
    # KV a tile must read: all of it, or under the causal mask what its last row sees.
    eff = np.clip(kv_len_t - qo_len_t + qe, 0, kv_len_t) if causal else kv_len_t

    # 2. KV chunks -------------------------------------------------------------------------------
    if fixed_split_size is not None:
        kv_chunk = fixed_split_size
        size = np.full(eff.size, kv_chunk, dtype=np.int64)
    else:
        total = hkv * int(eff.sum())
        kv_chunk = max(1, _ceil_div(total, num_ctas))
        kv_chunk = _ceil_div(kv_chunk, granule) * granule
        # Even chunks instead of kv_chunk-sized ones plus a short tail: the items are as alike
        # as the granule allows, which is what LPT packs best.
        n0 = np.maximum(1, _ceil_div(eff, kv_chunk))
        size = np.maximum(granule, _ceil_div(_ceil_div(eff, n0), granule) * granule)
    nchunks = np.maximum(1, _ceil_div(eff, size))  # an empty tile still gets one (empty) item
    chunk_tile = np.repeat(np.arange(eff.size), nchunks)
    c = np.arange(chunk_tile.size) - _exclusive_cumsum(nchunks)[chunk_tile]
    ks = c * size[chunk_tile]
    ke = np.minimum(ks + size[chunk_tile], eff[chunk_tile])

    # 4a. partial rows (needed by the work table) ----------------------------------------------
    base, num_partials = assign_partials(rows, nchunks)
    base_c = base[chunk_tile]
    prow = np.where(base_c >= 0, base_c + c * rows[chunk_tile], -1)

    num_work = chunk_tile.size * hkv
    if max(num_work, num_partials, num_rows) > INT32_MAX:
        raise ValueError(f"the plan needs {num_work} work items and {num_partials} partial rows, "
                         f"more than int32 indices can address")

    # Work table: every chunk once per KV head, heads innermost (they share partial rows).
    work = np.empty((chunk_tile.size, hkv, WORK_FIELDS), dtype=np.int32)
    for col, values in enumerate((tile_req[chunk_tile], None, qs[chunk_tile], qe[chunk_tile],
                                  ks, ke, prow)):
        work[:, :, col] = np.arange(hkv) if values is None else values[:, None]
    work = work.reshape(num_work, WORK_FIELDS)

    # 3. LPT -------------------------------------------------------------------------------------
    chunk_cost = integer_costs(rows[chunk_tile] * group, ke - ks + item_overhead, alpha, beta)
    sections = None
    if l2_section_kv is not None:
        # section of pair (b, h) = b * hkv + h: where its KV starts in the pairs' running sum
        pair_kv = np.repeat(kv, hkv)
        pair_section = (np.cumsum(pair_kv) - pair_kv) // l2_section_kv
        sections = pair_section[(tile_req[chunk_tile] * hkv)[:, None] + np.arange(hkv)].ravel()
    cta_indptr, cta_work = lpt_assign(np.repeat(chunk_cost, hkv), num_ctas, sections=sections)

    # 4b. reduction map --------------------------------------------------------------------------
    merge_rows, merge_indptr, merge_indices = reduction_map(
        qo_indptr[tile_req].astype(np.int64) + qs, rows, nchunks, base)

    return Plan(work=work, cta_indptr=cta_indptr, cta_work=cta_work, merge_rows=merge_rows,
                merge_indptr=merge_indptr, merge_indices=merge_indices, num_partials=num_partials,
                batch_size=batch, num_qo_rows=num_rows, num_qo_heads=int(num_qo_heads),
                num_kv_heads=hkv, tile_q=tile_q, tile_rows=tile_rows, kv_chunk=int(kv_chunk),
                granule=granule, causal=causal, fixed_split_size=fixed_split_size, alpha=alpha,
                beta=beta, item_overhead=item_overhead)
