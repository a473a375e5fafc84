"""Attention variants: hashable specs of scalar hooks (see :mod:`nbinfer.variants.spec`).

:func:`resolve` turns a ``variant=`` argument (None, a Variant, or the name of a parameter-free
built-in such as ``"causal"``) into a Variant.
"""

from .builtins import (
    PARAMETER_FREE,
    POS_ENCODING_MODES,
    alibi,
    alibi_slopes,
    attention_sink,
    causal,
    from_flashinfer_args,
    resolve,
    rope_llama,
    sigmoid_attention,
    sliding_window,
    soft_cap,
    standard,
)
from .precision import as_type_of
from .spec import HOOK_KINDS, Variant, compose

__all__ = [
    "HOOK_KINDS",
    "PARAMETER_FREE",
    "POS_ENCODING_MODES",
    "Variant",
    "alibi",
    "alibi_slopes",
    "as_type_of",
    "attention_sink",
    "causal",
    "compose",
    "from_flashinfer_args",
    "resolve",
    "rope_llama",
    "sigmoid_attention",
    "sliding_window",
    "soft_cap",
    "standard",
]
