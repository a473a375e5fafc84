"""KV layouts as block-sparse (BSR) index arrays over one physical KV pool (pure NumPy).

- :class:`BSR`: the one format every kernel reads (indptr, indices, block shape, shape).
- :class:`PageTable`: a paged KV cache (FlashInfer's kv_indptr / kv_indices / last_page_len).
- :func:`bsr_from_ragged`, :func:`ragged_mask`: padding-free batches (qo_indptr / kv_indptr).
- :func:`bsr_from_mask`, :func:`block_element_mask`, :func:`causal_mask`,
  :func:`sliding_window_mask`, :func:`causal_bsr`: element masks and their block cover.
- :func:`packbits`, :func:`segment_packbits` and inverses: FlashInfer's packed custom masks.
"""

from .bsr import BSR
from .masks import (
    block_element_mask,
    bsr_from_mask,
    causal_bsr,
    causal_mask,
    packbits,
    segment_packbits,
    segment_unpackbits,
    sliding_window_mask,
    unpackbits,
)
from .paged import PageTable
from .ragged import bsr_from_ragged, ragged_mask

__all__ = [
    "BSR",
    "PageTable",
    "block_element_mask",
    "bsr_from_mask",
    "bsr_from_ragged",
    "causal_bsr",
    "causal_mask",
    "packbits",
    "ragged_mask",
    "segment_packbits",
    "segment_unpackbits",
    "sliding_window_mask",
    "unpackbits",
]
