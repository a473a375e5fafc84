"""Data-type names: FlashInfer passes torch dtypes or strings; nbinfer speaks strings."""

from __future__ import annotations

import numpy as np

from ..reference.fp8 import FORMATS as FP8_DTYPES  # a KV cache may also hold FP8 codes

DTYPES = ("float16", "bfloat16", "float32")
KV_DTYPES = DTYPES + FP8_DTYPES
_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
            "fp32": "float32", "fp8_e4m3": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2"}


def normalize_dtype(name: str, value, *, kv: bool = False) -> str:
    """Return the dtype's name (``"float16"``, ``"bfloat16"``, ``"float32"``; with ``kv`` also
    ``"float8_e4m3fn"``, ``"float8_e5m2"``) for a string, NumPy or torch dtype."""
    allowed = KV_DTYPES if kv else DTYPES
    text = str(value).replace("torch.", "")
    text = _ALIASES.get(text, text)
    if text not in allowed:
        try:
            text = np.dtype(value).name
        except TypeError:
            pass
    if text not in allowed:
        raise TypeError(f"{name} must be one of {allowed}, got {value!r}")
    return text
