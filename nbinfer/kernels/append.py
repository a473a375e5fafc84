"""Append kernel: write new keys and values into their page slots (``append_paged_kv_cache``).

New token ``i`` of request ``b = batch_indices[i]`` at position ``pos = positions[i]`` lands in
page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot ``pos % page_size``. The append and the
cache have the same dtype, so the kernel copies bits, not numbers: every row of ``D`` elements is
moved as ``row_words`` machine words of 2, 4 or 8 bytes (the widest that divides the row's bytes
and the arrays' addresses). fp16, bf16 and fp32 are therefore one kernel per word size.

One thread per (token, kv head, word) on a 2-D grid: block ``x`` is the token, block ``y`` a chunk
of its ``H * row_words`` words, so the head and word come from dividing by the compile-time
``row_words`` (64-bit divisions by run-time sizes would cost more than the copy). Consecutive
threads take consecutive words of a row, so each warp reads and writes whole 32-byte sectors.
The layouts are run-time strides (in words): the source's token and head strides (new keys and
values may be views into a fused QKV tensor), the cache's page, slot and head strides (NHD
``[page, slot, head, :]``, HND ``[page, head, slot, :]``, or a view of a larger pool); only the
last dimension must be contiguous.
Bytes per token: ``2 * H * D * itemsize`` read and written (K and V), plus 8 B of indices that
all threads of the token share through the cache. Pure bandwidth; no arithmetic besides indexing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, int32, int64, types

from .common import compile_kernel

APPEND_THREADS = 128
WORD_TYPES = {2: types.uint16, 4: types.uint32, 8: types.uint64}
WORD_DTYPES = {2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class AppendSpec:
    """What an append kernel is compiled for.

    ``word_bytes`` (2, 4 or 8) is the copy unit, ``row_words`` the words in one head's row of
    ``D`` elements, ``page_size`` fixes the slot arithmetic at compile time.
    ``combined``: K and V share one ``[P, 2, ...]`` array, passed as ``k_cache`` (the
    ``v_cache`` argument is then unused: the simulator copies each argument in and back out
    separately, so the same array passed twice would lose one side's writes).
    """

    word_bytes: int
    row_words: int
    page_size: int
    combined: bool = True
    sim: bool = False

    def __post_init__(self):
        if self.word_bytes not in WORD_TYPES:
            raise ValueError(f"word_bytes must be 2, 4 or 8, got {self.word_bytes}")
        if self.row_words < 1 or self.page_size < 1:
            raise ValueError(f"row_words and page_size must be >= 1, got {self.row_words}, "
                             f"{self.page_size}")


def choose_word_bytes(row_bytes: int, addresses) -> int:
    """The widest copy unit (8, 4 or 2 bytes) that divides a row and every base address.

    A contiguous slice of a larger buffer may start 2 bytes past an 8-byte boundary; an 8-byte
    load there would be misaligned, so such arrays fall back to narrower words.
    """
    for word in (8, 4, 2):
        if row_bytes % word == 0 and all(a % word == 0 for a in addresses):
            return word
    raise ValueError(f"rows of {row_bytes} bytes at addresses {list(addresses)} are not 2-byte "
                     f"aligned")


@functools.cache
def build_append_kernel(spec: AppendSpec):
    """Compile (once per spec) the append kernel.

    Arguments: ``k_src, v_src`` (words, from the first element of each), ``batch_indices [nnz],
    positions [nnz], kv_indptr [B+1], kv_indices [pages]`` (int32), ``k_cache, v_cache`` (words;
    a combined cache goes in ``k_cache`` and ``v_cache`` may be any word array), ``num_heads``
    (int32), then int64 word counts: ``v_offset`` (V's start in a combined cache), the cache's
    ``page_stride, slot_stride, head_stride`` and the sources' ``k_stride_n, k_stride_h,
    v_stride_n, v_stride_h``. Launch with :func:`append_launch_config`.

    The caller validates every index on the host before the launch; the kernel still skips a
    word whose slot would fall outside its cache array, so a bad index can never corrupt other
    memory.
    """
    RW = spec.row_words
    PS = spec.page_size
    COMBINED = spec.combined

    def append_kv(k_src, v_src, batch_indices, positions, kv_indptr, kv_indices, k_cache,
                  v_cache, num_heads, v_offset, page_stride, slot_stride, head_stride, k_stride_n,
                  k_stride_h, v_stride_n, v_stride_h):
        i = cuda.blockIdx.x  # token
        e = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x  # word of the token's H rows
        if e >= num_heads * RW:
            return
        h = e // RW
        w = e - h * RW
        b = batch_indices[i]
        pos = positions[i]
        page = int64(kv_indices[kv_indptr[b] + pos // PS])
        dst = page * page_stride + int64(pos % PS) * slot_stride + int64(h) * head_stride + w
        kt = int64(i) * k_stride_n + int64(h) * k_stride_h + w
        vt = int64(i) * v_stride_n + int64(h) * v_stride_h + w
        if dst >= 0 and dst < k_cache.size:
            k_cache[dst] = k_src[kt]
        if COMBINED:
            if dst >= 0 and v_offset + dst < k_cache.size:
                k_cache[v_offset + dst] = v_src[vt]
        elif dst >= 0 and dst < v_cache.size:
            v_cache[dst] = v_src[vt]

    wt = types.Array(WORD_TYPES[spec.word_bytes], 1, "C")
    i32 = types.Array(int32, 1, "C")
    sig = types.void(wt, wt, i32, i32, i32, i32, wt, wt, int32, *([int64] * 8))
    return compile_kernel("append", spec, sig, lambda: append_kv)


def append_launch_config(nnz: int, token_words: int):
    """(grid, block) for ``nnz`` tokens of ``token_words = H * row_words`` words each.

    Tokens go on grid x (up to 2^31 - 1 blocks); a block covers up to 128 words of one token,
    fewer (a multiple of 32) when the token is shorter.
    """
    block = min(APPEND_THREADS, -(-int(token_words) // 32) * 32)
    return (max(int(nnz), 1), max(-(-int(token_words) // block), 1)), (block,)
