"""nbinfer: FlashInfer's attention engine rebuilt in Python with Numba-CUDA kernels.

Flat public API. The float64 reference engine lives in :mod:`nbinfer.reference` (same names as
the GPU entry points), KV layouts in :mod:`nbinfer.formats`, attention variants in
:mod:`nbinfer.variants`.
"""

from . import formats, reference, scheduler, variants
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

# The GPU entry points load on first use (PEP 562): ``import nbinfer`` stays NumPy-only and
# fast (the reference engine, formats, scheduler and variants need nothing else), and Numba's
# CUDA modules load when a wrapper, merge or append is first touched.
_LAZY = {
    "append_paged_kv_cache": "api.append",
    "PagedKVAppendWrapper": "api.append",
    "get_batch_indices_positions": "api.append",
    "MultiLevelCascadeAttentionWrapper": "api.cascade",
    "BatchDecodeWithPagedKVCacheWrapper": "api.decode",
    "BatchPrefillWithPagedKVCacheWrapper": "api.prefill",
    "BatchPrefillWithRaggedKVCacheWrapper": "api.prefill",
    "single_prefill_with_kv_cache": "api.prefill",
    "single_decode_with_kv_cache": "api.single",
    "BlockSparseAttentionWrapper": "api.sparse",
    "rmsnorm": "api.layers",
    "fused_add_rmsnorm": "api.layers",
    "silu_and_mul": "api.layers",
    "apply_rope_with_cos_sin_cache": "api.layers",
    "apply_rope_with_cos_sin_cache_inplace": "api.layers",
    "merge_state": "api.state",
    "merge_state_in_place": "api.state",
    "merge_states": "api.state",
    "StepPlan": "api.step",
    "defer_frees": "api.launch",
    "warmup": "warmup",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbinfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "BSR",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BlockSparseAttentionWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "PageTable",
    "PagedKVAppendWrapper",
    "Plan",
    "PlanLayout",
    "StepPlan",
    "Variant",
    "__version__",
    "append_paged_kv_cache",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "bsr_from_mask",
    "bsr_from_ragged",
    "compose",
    "defer_frees",
    "formats",
    "fused_add_rmsnorm",
    "get_batch_indices_positions",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "packbits",
    "reference",
    "rmsnorm",
    "scheduler",
    "segment_packbits",
    "silu_and_mul",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "variants",
    "warmup",
]
