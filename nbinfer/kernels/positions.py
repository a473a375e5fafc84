"""Where a score sits: key positions and packed custom-mask bits, shared by the prefill kernels.

Built once per (page size, BSR mode) and inlined. In BSR mode a "page" is a block column of the
key matrix, so the position masks and RoPE see is the key's physical column
(``page id * C + slot``); otherwise it is the key's index in its request's sequence.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import int64

from .common import WORK_FIELDS
from .loading import loading_module
from .primitives import device_jit


@functools.cache
def position_module(page_size: int, block_positions: bool, sim: bool):
    """Device functions, as a namespace:

    ``key_position(kv_indptr, kv_indices, b, pos)``
        The position of request ``b``'s key ``pos`` (int).
    ``mask_bit(plan, mask_indptr_off, mask_words_off, b, row, kv_len, pos)``
        Bit ``row * kv_len + pos`` of request ``b``'s packed custom mask (little bit order;
        ``plan[mask_indptr_off + b]`` is the byte offset of its segment in the int32 words at
        ``mask_words_off``): 1 keeps the score.
    """
    PS = page_size
    jit_dev = device_jit(sim)

    @jit_dev
    def key_position(kv_indptr, kv_indices, b, pos):
        if block_positions:
            return kv_indices[kv_indptr[b] + pos // PS] * PS + pos % PS
        return pos

    @jit_dev
    def mask_bit(plan, mask_indptr_off, mask_words_off, b, row, kv_len, pos):
        bit = int64(plan[mask_indptr_off + b]) * 8 + int64(row) * kv_len + pos
        word = plan[mask_words_off + bit // 32]
        return (word >> (bit % 32)) & 1

    return SimpleNamespace(key_position=key_position, mask_bit=mask_bit)


@functools.cache
def prefill_item_reader(sparse: bool, page_size: int, block_positions: bool, sim: bool):
    """``read_item(plan, item, work_off, qo_indptr_off, qo_end_off, q_pos0_off, kv_indptr,
    kv_last, kv_stride_n, kv_stride_h)``: one prefill work item decoded, as the tuple
    ``(b, hk, qs, nrows, start, end, prow, q0, kv_len, ib, row_stride, head_off, pos0)``:
    request, kv head, first query row in the request and row count, KV range, partial row
    (-1: direct), the request's first query row, its KV length, the loading module's base
    (:func:`.loading.loading_module`) and the position of the item's first query row
    (bottom-right aligned; BSR: given by ``q_pos0``)."""
    loader = loading_module(sparse, page_size, sim)
    request_kv_len, request_base = loader.request_kv_len, loader.request_base
    jit_dev = device_jit(sim)

    @jit_dev
    def read_item(plan, item, work_off, qo_indptr_off, qo_end_off, q_pos0_off, kv_indptr,
                  kv_last, kv_stride_n, kv_stride_h):
        w0 = work_off + item * WORK_FIELDS
        b = plan[w0]
        hk = plan[w0 + 1]
        qs = plan[w0 + 2]
        q0 = plan[qo_indptr_off + b]
        qo_len = plan[qo_end_off + b] - q0
        kv_len = request_kv_len(kv_indptr, kv_last, b)
        ib, row_stride, head_off = request_base(kv_indptr, b, hk, kv_stride_n, kv_stride_h)
        pos0 = (plan[q_pos0_off + b] if block_positions else kv_len - qo_len) + qs
        return (b, hk, qs, plan[w0 + 3] - qs, plan[w0 + 4], plan[w0 + 5], plan[w0 + 6], q0,
                kv_len, ib, row_stride, head_off, pos0)

    return read_item


__all__ = ["position_module", "prefill_item_reader"]
