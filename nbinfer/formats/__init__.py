"""KV layouts as block-sparse (BSR) index arrays over one physical KV pool (pure NumPy).

- :class:`BSR`: the one format every kernel reads (indptr, indices, block shape, shape).
- :class:`PageTable`: a paged KV cache (FlashInfer's kv_indptr / kv_indices / last_page_len);
  :func:`check_page_table` validates such arrays (any integer dtype) for every consumer.
- :func:`bsr_from_ragged`, :func:`ragged_mask`: padding-free batches (qo_indptr / kv_indptr).
- :func:`bsr_from_mask`, :func:`block_element_mask`, :func:`causal_mask`,
  :func:`sliding_window_mask`, :func:`causal_bsr`: element masks and their block cover.
- :func:`packbits`, :func:`segment_packbits` and inverses: FlashInfer's packed custom masks.
- :class:`RadixTree`: shared prefixes of token sequences, page-granular; emits cascade levels.
- :func:`tree_mask` and friends: speculative-decoding token trees as custom masks.
- :func:`select_topk_pages`: Quest-style top-k page selection as a page table (indices only).
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
from .paged import PageTable, check_page_table
from .radix import CascadeLevels, RadixTree
from .ragged import bsr_from_ragged, ragged_mask
from .topk import TopKPages, page_key_summaries, quest_page_scores, select_topk_pages
from .tree_mask import (
    TreeMaskBatch,
    batch_tree_masks,
    plot_tree_mask,
    tree_ancestors,
    tree_depths,
    tree_mask,
    tree_positions,
)

__all__ = [
    "BSR",
    "CascadeLevels",
    "PageTable",
    "RadixTree",
    "TopKPages",
    "TreeMaskBatch",
    "batch_tree_masks",
    "page_key_summaries",
    "plot_tree_mask",
    "quest_page_scores",
    "select_topk_pages",
    "tree_ancestors",
    "tree_depths",
    "tree_mask",
    "tree_positions",
    "block_element_mask",
    "bsr_from_mask",
    "bsr_from_ragged",
    "causal_bsr",
    "causal_mask",
    "check_page_table",
    "packbits",
    "ragged_mask",
    "segment_packbits",
    "segment_unpackbits",
    "sliding_window_mask",
    "unpackbits",
]
