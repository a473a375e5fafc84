"""Where a score sits: key positions and packed custom-mask bits, shared by the prefill kernels.

Built once per (page size, BSR mode) and inlined. In BSR mode a "page" is a block column of the
key matrix, so the position masks and RoPE see is the key's physical column
(``page id * C + slot``); otherwise it is the key's index in its request's sequence.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda, int64


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
    jit_dev = cuda.jit(device=True) if sim else cuda.jit(device=True, inline="always")

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


__all__ = ["position_module"]
