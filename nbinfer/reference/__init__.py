"""The float64 NumPy reference engine: the specification that every kernel is tested against.

Names and argument conventions mirror the public API (and FlashInfer's): ``single_decode_...``,
``batch_prefill_...``, ``merge_state`` ... Everything is computed in float64 with plain NumPy,
one request at a time, so the code reads as the definition of each operation.
"""

from . import fp8, layers
from .attention import attention_state, finalize
from .cascade import multi_level_cascade_attention
from .decode import batch_decode_with_paged_kv_cache, single_decode_with_kv_cache
from .merge import merge_state, merge_state_in_place, merge_states
from .paged import (
    append_paged_kv_cache,
    check_page_table,
    gather_kv,
    get_batch_indices_positions,
    kv_lengths,
    split_paged_kv_cache,
)
from .prefill import (
    batch_prefill_with_paged_kv_cache,
    batch_prefill_with_ragged_kv_cache,
    single_prefill_with_kv_cache,
)
from .sparse import block_sparse_attention, block_sparse_dense_mask

__all__ = [
    "fp8",
    "layers",
    "append_paged_kv_cache",
    "attention_state",
    "batch_decode_with_paged_kv_cache",
    "batch_prefill_with_paged_kv_cache",
    "batch_prefill_with_ragged_kv_cache",
    "block_sparse_attention",
    "block_sparse_dense_mask",
    "check_page_table",
    "finalize",
    "gather_kv",
    "get_batch_indices_positions",
    "kv_lengths",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "multi_level_cascade_attention",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "split_paged_kv_cache",
]
