"""nbinfer: FlashInfer's attention engine rebuilt in Python with Numba-CUDA kernels."""

from . import formats, reference, variants
from .formats import BSR
from .variants import Variant, compose

__version__ = "0.1.0"

__all__ = ["BSR", "Variant", "compose", "formats", "reference", "variants", "__version__"]
