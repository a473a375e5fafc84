"""KV layouts as block-sparse (BSR) index arrays over one physical KV pool (pure NumPy)."""

from .bsr import BSR

__all__ = ["BSR"]
