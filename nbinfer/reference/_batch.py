"""Shared machinery of the batch entry points: custom masks, paged KV setup, the per-request loop,
the epilogue.

A batch is a ragged list of requests; request ``b`` owns query rows
``qo_indptr[b]:qo_indptr[b + 1]`` and a key set of length ``kv_lens[b]``. The reference engine
simply runs :func:`~nbinfer.reference.attention.attention_state` once per request: clarity over
speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .._checks import check_indptr, check_ndim
from ..formats.masks import segment_unpackbits, unpackbits
from ._common import lse_to_base
from .attention import attention_state, finalize
from .paged import _prepare_paged, check_page_table, gather_kv, kv_lengths


def _as_bool(name: str, mask) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"{name} must be a boolean array (True = keep), got dtype {mask.dtype}")
    return mask


def _as_packed(name: str, packed, kind: str = "a uint8 array of packed bits") -> np.ndarray:
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"{name} must be {kind}, got dtype {packed.dtype}")
    check_ndim(name, packed, 1)
    return packed


def bool_or_packed_mask(mask, packed, shape: tuple, dims: tuple, *, names: tuple,
                        packed_kind: str = "a uint8 array of packed bits"):
    """The bool mask of ``shape`` from a bool ``mask`` or a ``packed`` (little bit order) one.

    At most one of the two may be given; ``None`` when neither is. ``names`` are the two
    arguments' names and ``dims`` the names of the axes of ``shape``, for the error messages.
    """
    mask_name, packed_name = names
    if mask is not None and packed is not None:
        raise ValueError(f"give {mask_name} or {packed_name}, not both")
    if mask is not None:
        mask = _as_bool(mask_name, mask)
        check_ndim(mask_name, mask, len(shape))
        if mask.shape != shape:
            raise ValueError(f"{mask_name} must have shape [{', '.join(dims)}] = {shape}, "
                             f"got {mask.shape}")
        return mask
    if packed is not None:
        packed = _as_packed(packed_name, packed, packed_kind)
        size = math.prod(shape)
        want = -(-size // 8)
        if packed.size != want:
            raise ValueError(f"{packed_name} must have ceil({' * '.join(dims)} / 8) = {want} "
                             f"bytes, got {packed.size}")
        return unpackbits(packed, size, "little").reshape(shape)
    return None


def single_mask(custom_mask, packed_custom_mask, qo_len: int, kv_len: int):
    """The ``[qo_len, kv_len]`` bool mask from a bool or a packed (little bit order) mask."""
    return bool_or_packed_mask(custom_mask, packed_custom_mask, (qo_len, kv_len),
                               ("qo_len", "kv_len"), names=("custom_mask", "packed_custom_mask"))


def batch_masks(custom_mask, packed_custom_mask, mask_indptr, qo_lens, kv_lens):
    """Per-request bool masks ``[qo_len_b, kv_len_b]`` (or ``None``) from FlashInfer's flat forms.

    ``custom_mask`` is the concatenation over requests of each row-major mask; the packed form
    packs each request's segment separately into whole bytes, little bit order
    (``segment_packbits``), with byte offsets ``mask_indptr`` (computed when not given).
    """
    if custom_mask is not None and packed_custom_mask is not None:
        raise ValueError("give custom_mask or packed_custom_mask, not both")
    sizes = np.asarray(qo_lens, dtype=np.int64) * np.asarray(kv_lens, dtype=np.int64)
    if custom_mask is not None:
        flat = _as_bool("custom_mask", custom_mask)
        check_ndim("custom_mask", flat, 1)
        if flat.size != sizes.sum():
            raise ValueError(f"custom_mask must have sum(qo_len * kv_len) = {int(sizes.sum())} "
                             f"elements, got {flat.size}")
        if mask_indptr is not None:
            check_indptr("mask_indptr", mask_indptr, length=sizes.size + 1, total=flat.size)
    elif packed_custom_mask is not None:
        packed = _as_packed("packed_custom_mask", packed_custom_mask)
        want = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum((sizes + 7) // 8, out=want[1:])
        if mask_indptr is None:
            ptr = want
        else:
            ptr = check_indptr("mask_indptr", mask_indptr, length=sizes.size + 1)
            if not np.array_equal(ptr, want):
                b = int(np.argmax(ptr != want))
                raise ValueError(f"mask_indptr must hold the byte offsets of each request's "
                                 f"packed mask, {want.tolist()}; got mask_indptr[{b}]={ptr[b]}")
        if packed.size != want[-1]:
            raise ValueError(f"packed_custom_mask must have {int(want[-1])} bytes "
                             f"(sum of ceil(qo_len * kv_len / 8)), got {packed.size}")
        flat = segment_unpackbits(packed, ptr, sizes, bitorder="little")
    else:
        return [None] * sizes.size
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [flat[starts[b]:starts[b + 1]].reshape(int(qo_lens[b]), int(kv_lens[b]))
            for b in range(sizes.size)]


def check_qo_indptr(qo_indptr, nnz_qo: int, *, name: str = "qo_indptr", batch=None):
    """Validate ``qo_indptr`` against the query rows (``qo_indptr[-1] == q.shape[0]``)."""
    length = None if batch is None else batch + 1
    return check_indptr(name, qo_indptr, length=length, total=nnz_qo)


def paged_requests(k_cache, v_cache, page_table, page_size: int):
    """``(kv_lens, get_kv)`` of a validated page table ``(kv_indptr, kv_indices, last_page_len)``.

    ``get_kv(b)`` gathers request ``b``'s keys and values out of the NHD caches (see
    :func:`~nbinfer.reference.paged.gather_kv`).
    """
    indptr, indices, last = page_table
    kv_lens = kv_lengths(indptr, last, page_size)

    def get_kv(b):
        return gather_kv(k_cache, v_cache, indices[indptr[b]:indptr[b + 1]], int(kv_lens[b]))

    return kv_lens, get_kv


class PagedBatch(NamedTuple):
    lse_base: float
    q: np.ndarray
    scale: float
    kv_lens: np.ndarray
    get_kv: Callable


def prepare_paged_batch(q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout,
                        sm_scale, lse_base) -> PagedBatch:
    """Shared input checks and KV access of the batch entry points over one paged cache.

    ``kv_lens`` has one entry per request of the page table (``len(kv_indptr) - 1``).
    """
    p = _prepare_paged(q, paged_kv_cache, kv_layout, sm_scale, lse_base)
    table = check_page_table(kv_indptr, kv_indices, kv_last_page_len, p.num_pages, p.page_size)
    kv_lens, get_kv = paged_requests(p.k_cache, p.v_cache, table, p.page_size)
    return PagedBatch(p.lse_base, p.q, p.scale, kv_lens, get_kv)


def run_requests(q, qo_indptr, get_kv, variant, sm_scale, masks=None, *, q_pos=None,
                 kv_start=None):
    """Attend every request to its own keys; return raw natural-log states for all query rows.

    ``get_kv(b)`` returns request ``b``'s contiguous float64 ``(k, v)`` ``[kv_len_b, Hkv, D]``;
    ``masks[b]`` (optional) is its ``[qo_len_b, kv_len_b]`` custom mask. Positions default to
    bottom-right alignment; ``q_pos`` (per query row) and ``kv_start`` (per query row: the
    position of its request's first key) give them explicitly.
    """
    nnz, hq, d = q.shape
    o = np.zeros((nnz, hq, d))
    lse = np.full((nnz, hq), -np.inf)
    for b in range(qo_indptr.size - 1):
        a, e = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if a == e:
            continue
        k, v = get_kv(b)
        o[a:e], lse[a:e] = attention_state(
            q[a:e], k, v, sm_scale=sm_scale, variant=variant,
            q_pos=None if q_pos is None else q_pos[a:e],
            kv_pos=None if kv_start is None else int(kv_start[a]) + np.arange(k.shape[0]),
            mask=None if masks is None else masks[b])
    return o, lse


def epilogue(o, lse, variant, return_lse: bool, lse_base: float):
    """Apply the output transform once, convert the LSE base, shape the return value."""
    out = finalize(o, lse, variant)
    if not return_lse:
        return out
    return out, lse_to_base(lse, lse_base)


def run_batch(q, qo_indptr, get_kv, variant, sm_scale, masks, return_lse: bool, lse_base: float):
    """:func:`run_requests`, then :func:`epilogue`: the whole of a batch entry point's work."""
    o, lse = run_requests(q, qo_indptr, get_kv, variant, sm_scale, masks)
    return epilogue(o, lse, variant, return_lse, lse_base)
