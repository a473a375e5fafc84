"""Small helpers shared by the reference entry points: dtype/shape checks, LSE bases, variants.

Nothing here computes attention; these functions turn user arguments into validated float64 arrays
and one :class:`~nbinfer.variants.Variant`, so every entry point checks its inputs the same way.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .._checks import (
    KV_LAYOUTS,
    check_choice,
    check_dim,
    check_float,
    check_heads,
    check_ndim,
    check_positive_int,
    check_sm_scale,
)
from ..variants import Variant, compose, from_flashinfer_args, resolve

LSE_BASES = (math.e, 2.0)


def check_lse_base(lse_base) -> float:
    """Return ``lse_base`` as a float; only ``math.e`` (natural log) and ``2`` are supported.

    The two bases are the ones kernels produce (natural, and FlashInfer's base 2); rejecting the
    rest keeps the reference and the kernels interchangeable.
    """
    if isinstance(lse_base, bool) or not isinstance(lse_base, numbers.Real):
        raise TypeError(f"lse_base must be math.e or 2, got {type(lse_base).__name__}")
    if float(lse_base) not in LSE_BASES:
        raise ValueError(f"lse_base must be math.e or 2, got {lse_base!r}")
    return float(lse_base)


def lse_to_base(lse: np.ndarray, lse_base: float) -> np.ndarray:
    """Convert a natural-log LSE to ``lse_base`` (``-inf`` stays ``-inf``)."""
    if lse_base == math.e:
        return lse
    return lse / math.log(lse_base)


def lse_from_base(lse: np.ndarray, lse_base: float) -> np.ndarray:
    """Convert an LSE in ``lse_base`` back to the natural log."""
    if lse_base == math.e:
        return lse
    return lse * math.log(lse_base)


def as_f64(name: str, a, ndim) -> np.ndarray:
    """Validate a floating array of rank ``ndim`` and return it as float64.

    Integer and boolean arrays are rejected (a TypeError naming ``name``) instead of silently
    converted: an int query is almost always a mix-up of arguments.
    """
    check_float(name, a)
    check_ndim(name, a, ndim)
    return np.asarray(a, dtype=np.float64)


def check_layout(kv_layout) -> str:
    """Require ``"NHD"`` or ``"HND"``."""
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    return kv_layout


def contiguous_kv_to_nhd(k, v, kv_layout: str, *, k_name: str = "k", v_name: str = "v"):
    """Validate non-paged ``k``/``v`` and return float64 NHD views ``[kv_len, Hkv, D]``.

    NHD input is ``[kv_len, Hkv, D]``; HND input is ``[Hkv, kv_len, D]`` and is transposed.
    """
    check_layout(kv_layout)
    k = as_f64(k_name, k, 3)
    v = as_f64(v_name, v, 3)
    if v.shape != k.shape:
        raise ValueError(f"{v_name}.shape must equal {k_name}.shape {k.shape}, got {v.shape}")
    if kv_layout == "HND":
        k, v = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    return k, v


def check_q_kv(q: np.ndarray, num_kv_heads: int, head_dim: int, *, kv_name: str = "k") -> int:
    """Check that ``q`` (``[..., Hq, D]``) matches the KV heads and head dim; return the group."""
    check_positive_int("head_dim", head_dim)
    check_dim("q", q, q.ndim - 1, head_dim, f"head_dim of {kv_name}")
    return check_heads(q.shape[-2], num_kv_heads)


def check_contiguous(q, k, v, kv_layout, lse_base, *, q_ndim: int = 3):
    """Shared input checks of the contiguous-KV entry points (same order and messages in each).

    Returns ``(lse_base, q, k, v)``: float64 arrays, ``q`` of rank ``q_ndim``, ``k``/``v`` in NHD.
    """
    lse_base = check_lse_base(lse_base)
    q = as_f64("q", q, q_ndim)
    k, v = contiguous_kv_to_nhd(k, v, kv_layout)
    check_q_kv(q, k.shape[1], k.shape[2])
    return lse_base, q, k, v


def _prepare_contiguous(q, k, v, kv_layout, sm_scale, lse_base):
    """Shared input checks of the 3-D contiguous-KV entry points with an explicit scale.

    Returns ``(lse_base, q, k, v, scale)`` with ``k``/``v`` in NHD.
    """
    lse_base, q, k, v = check_contiguous(q, k, v, kv_layout, lse_base)
    return lse_base, q, k, v, check_sm_scale(sm_scale, k.shape[2])


def build_variant(*, num_qo_heads: int, causal=False, window_left=-1, logits_soft_cap=None,
                  pos_encoding_mode="NONE", rope_scale=None, rope_theta=None,
                  variant=None) -> Variant:
    """The variant FlashInfer's flags describe, composed with an optional user ``variant``.

    ``variant`` is None, a :class:`~nbinfer.variants.Variant` or the name of a parameter-free
    built-in (``"causal"``, ``"sigmoid"`` ...), as :func:`nbinfer.variants.resolve` reads it.
    """
    variant = resolve(variant)
    base = from_flashinfer_args(
        causal=causal, window_left=window_left, logits_soft_cap=logits_soft_cap,
        pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale, rope_theta=rope_theta,
        num_qo_heads=num_qo_heads,
    )
    return base if variant is None else compose(base, variant)
