"""Attention variants: hashable specs of scalar hooks (see :mod:`nbinfer.variants.spec`)."""

from .builtins import (
    POS_ENCODING_MODES,
    alibi,
    alibi_slopes,
    attention_sink,
    causal,
    from_flashinfer_args,
    rope_llama,
    sigmoid_attention,
    sliding_window,
    soft_cap,
    standard,
)
from .spec import HOOK_KINDS, Variant, compose

__all__ = [
    "HOOK_KINDS",
    "POS_ENCODING_MODES",
    "Variant",
    "alibi",
    "alibi_slopes",
    "attention_sink",
    "causal",
    "compose",
    "from_flashinfer_args",
    "rope_llama",
    "sigmoid_attention",
    "sliding_window",
    "soft_cap",
    "standard",
]
