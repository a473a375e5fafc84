"""Evaluate a variant's hooks on the CPU in float64, over whole NumPy arrays.

The reference engine needs the same scalar hooks that kernels inline, applied to arrays of
logits. Each hook is compiled once with ``numba.vectorize`` into a float64 NumPy ufunc (fast,
broadcasting, and the identical Python source the GPU compiles), then chained in spec order.
"""

from __future__ import annotations

import numpy as np

from .spec import Variant, _function_key

_SIGNATURES = {
    "query_transform": "float64(float64, float64, int64, int64, int64, int64)",
    "key_transform": "float64(float64, float64, int64, int64, int64, int64)",
    "logits_transform": "float64(float64, int64, int64, int64)",
    "logits_mask": "boolean(int64, int64, int64)",
    "output_transform": "float64(float64, float64, int64)",
}


# Compiled ufuncs keyed by (signature, hook key): the key is the hook's code, captured values and
# globals (``spec._function_key``), not the function object, so the closures that two calls of
# one factory return share one compilation (and a RoPE hook used for queries and keys, too).
_UFUNCS: dict = {}


def _ufunc(kind: str, fn):
    key = (_SIGNATURES[kind], _function_key(fn))
    uf = _UFUNCS.get(key)
    if uf is None:
        import numba  # on first use: a reference run without hooks never loads it

        from .precision import register

        register("cpu")
        uf = _UFUNCS[key] = numba.vectorize([_SIGNATURES[kind]])(fn)
    return uf


def transform_vectors(variant: Variant, kind: str, x: np.ndarray, pos: np.ndarray,
                      heads: np.ndarray) -> np.ndarray:
    """Apply the query or key transforms of ``variant`` to ``x`` [L, H, D] (float64).

    ``pos`` is [L] absolute positions, ``heads`` is [H] head indices.
    """
    if kind not in ("query_transform", "key_transform"):
        raise ValueError(f"kind must be 'query_transform' or 'key_transform', got {kind!r}")
    fns = getattr(variant, kind)
    if not fns:
        return x
    head_dim = x.shape[-1]
    d = np.arange(head_dim, dtype=np.int64)[None, None, :]
    p = np.asarray(pos, dtype=np.int64)[:, None, None]
    h = np.asarray(heads, dtype=np.int64)[None, :, None]
    for fn in fns:
        pair = np.roll(x, -(head_dim // 2), axis=-1)  # pair[d] = x[(d + D/2) % D]
        x = _ufunc(kind, fn)(x, pair, d, head_dim, p, h)
    return x


def transform_logits(variant: Variant, s: np.ndarray, q_pos, kv_pos, qo_head) -> np.ndarray:
    """Apply the logits transforms to ``s`` (broadcast with the integer index arrays)."""
    for fn in variant.logits_transform:
        s = _ufunc("logits_transform", fn)(s, q_pos, kv_pos, qo_head)
    return s


def logits_keep(variant: Variant, q_pos, kv_pos, qo_head) -> np.ndarray | None:
    """Boolean keep-mask from the variant's mask hooks, or ``None`` when it has none."""
    keep = None
    for fn in variant.logits_mask:
        m = _ufunc("logits_mask", fn)(q_pos, kv_pos, qo_head)
        keep = m if keep is None else keep & m
    return keep


def transform_output(variant: Variant, o: np.ndarray, lse: np.ndarray, qo_head) -> np.ndarray:
    """Apply the output transforms to ``o`` [..., D] given ``lse`` [...] and head indices."""
    for fn in variant.output_transform:
        o = _ufunc("output_transform", fn)(o, lse[..., None], qo_head)
    return o
