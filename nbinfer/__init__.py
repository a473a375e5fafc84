"""nbinfer: FlashInfer's attention engine rebuilt in Python with Numba-CUDA kernels.

Flat public API. The float64 reference engine lives in :mod:`nbinfer.reference` (same names as
the GPU entry points), KV layouts in :mod:`nbinfer.formats`, attention variants in
:mod:`nbinfer.variants`.
"""

from . import formats, reference, scheduler, variants
from .api.append import append_paged_kv_cache, get_batch_indices_positions
from .api.cascade import MultiLevelCascadeAttentionWrapper
from .api.decode import BatchDecodeWithPagedKVCacheWrapper
from .api.prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
)
from .api.single import single_decode_with_kv_cache
from .api.sparse import BlockSparseAttentionWrapper
from .api.state import merge_state, merge_state_in_place, merge_states
from .api.step import StepPlan
from .formats import (
    BSR,
    PageTable,
    bsr_from_mask,
    bsr_from_ragged,
    packbits,
    segment_packbits,
)
from .scheduler import Plan, PlanLayout
from .variants import Variant, compose

__version__ = "0.1.0"

__all__ = [
    "BSR",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BlockSparseAttentionWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "PageTable",
    "Plan",
    "PlanLayout",
    "StepPlan",
    "Variant",
    "__version__",
    "append_paged_kv_cache",
    "bsr_from_mask",
    "bsr_from_ragged",
    "compose",
    "formats",
    "get_batch_indices_positions",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "packbits",
    "reference",
    "scheduler",
    "segment_packbits",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "variants",
]
