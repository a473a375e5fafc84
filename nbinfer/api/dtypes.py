"""Data-type names: FlashInfer passes torch dtypes or strings; nbinfer speaks strings."""

from __future__ import annotations

import numpy as np

DTYPES = ("float16", "bfloat16", "float32")


def normalize_dtype(name: str, value) -> str:
    """Return ``"float16"``, ``"bfloat16"`` or ``"float32"`` for a string, NumPy or torch dtype."""
    text = str(value).replace("torch.", "")
    aliases = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
               "fp32": "float32"}
    text = aliases.get(text, text)
    if text not in DTYPES:
        try:
            text = np.dtype(value).name
        except TypeError:
            pass
    if text not in DTYPES:
        raise TypeError(f"{name} must be one of {DTYPES}, got {value!r}")
    return text
