"""nbinfer: FlashInfer's attention engine rebuilt in Python with Numba-CUDA kernels.

Flat public API. The float64 reference engine lives in :mod:`nbinfer.reference` (same names as
the GPU entry points), KV layouts in :mod:`nbinfer.formats`, attention variants in
:mod:`nbinfer.variants`.
"""

from . import formats, reference, scheduler, variants
from .api.decode import BatchDecodeWithPagedKVCacheWrapper
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
    "PageTable",
    "Plan",
    "PlanLayout",
    "Variant",
    "__version__",
    "bsr_from_mask",
    "bsr_from_ragged",
    "compose",
    "formats",
    "packbits",
    "reference",
    "scheduler",
    "segment_packbits",
    "variants",
]
