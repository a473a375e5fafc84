"""The loading module: where a request's KV tokens live, for every attention kernel.

The only code that differs between paged (sparse, through the page table) and ragged or
contiguous (dense, affine) KV: everything above the shared-memory load is the same. Built once
per (addressing, page size) and inlined into the decode and prefill kernels. The layout (NHD or
HND, contiguous or a strided view) is not compiled in: it is the run-time strides
``kv_stride_n`` (between consecutive tokens) and ``kv_stride_h`` (between KV heads), and
``page_stride`` (between pages), all in elements (:mod:`.common`).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import int64, types

from .primitives import device_jit

U32 = types.uint32


@functools.cache
def loading_module(sparse: bool, page_size: int, sim: bool):
    """Device functions, as a namespace:

    ``request_kv_len(kv_indptr, kv_last, b)``
        Tokens of request ``b``: from the page table, or ``kv_indptr`` of token offsets.
    ``request_base(kv_indptr, b, hk, kv_stride_n, kv_stride_h)``
        Per work item: ``(ib, row_stride, head_off)``: the request's first page (paged) or
        first token (dense) as uint32, the elements between consecutive tokens, and the offset
        of kv head ``hk``.
    ``token_offset(kv_indices, ib, pos, row_stride, head_off, page_stride)``
        Element offset of token ``pos`` (unsigned: ``//`` and ``%`` by the constant page size
        are shifts and the index needs no negative-wraparound code) of that head.
    """
    PS = page_size
    jit_dev = device_jit(sim)

    @jit_dev
    def request_kv_len(kv_indptr, kv_last, b):
        if sparse:
            pages = kv_indptr[b + 1] - kv_indptr[b]
            return (pages - 1) * PS + kv_last[b] if pages > 0 else 0
        return kv_indptr[b + 1] - kv_indptr[b]

    @jit_dev
    def request_base(kv_indptr, b, hk, kv_stride_n, kv_stride_h):
        return U32(kv_indptr[b]), int64(kv_stride_n), int64(hk) * int64(kv_stride_h)

    @jit_dev
    def token_offset(kv_indices, ib, pos, row_stride, head_off, page_stride):
        if sparse:
            page = int64(kv_indices[U32(ib + pos // PS)])
            return page * int64(page_stride) + int64(pos % PS) * row_stride + head_off
        return int64(ib + pos) * row_stride + head_off

    return SimpleNamespace(request_kv_len=request_kv_len, request_base=request_base,
                           token_offset=token_offset)


__all__ = ["loading_module"]
