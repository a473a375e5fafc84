"""The merge operator on attention states (FlashInfer's ``merge_state`` family), in float64.

An attention state over a key set ``I`` is ``(O(I), LSE(I))`` with ``LSE(I) = log sum_{j in I}
exp(s_j)`` and ``O(I)`` the softmax-weighted mean of the values. For disjoint ``I`` and ``J``

    LSE(I u J) = log(exp(LSE(I)) + exp(LSE(J)))
    O(I u J)   = (exp(LSE(I)) O(I) + exp(LSE(J)) O(J)) / exp(LSE(I u J)),

which is associative and commutative, so keys can be split anywhere (chunks of one long sequence,
a shared prefix and a suffix, pages on different CTAs) and the pieces combined exactly. An empty
key set has ``LSE = -inf`` and is the identity: its ``O`` is never read (even a NaN there is
ignored). Exponentials are taken relative to the larger LSE, so logits of any size neither
overflow nor lose the smaller state.

Non-finite LSEs (the rule on every backend): a state whose LSE is NaN or ``+inf`` is poisoned,
and merging it with anything gives NaN in every entry of that (row, head)'s ``O`` and in its LSE;
a poisoned state is what attention returns for a row that read a NaN (see
:mod:`nbinfer.reference.attention`), so the NaN survives every merge instead of vanishing. NaN or
infinite values in the ``O`` of a state with a finite LSE follow IEEE arithmetic.
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import check_ndim
from ._common import as_f64, check_lse_base, lse_from_base, lse_to_base

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


def _check_pair(v_name, v, s_name, s):
    """Validate one state: v [seq_len, num_heads, head_dim], s [seq_len, num_heads]."""
    v64 = as_f64(v_name, v, 3)
    s64 = as_f64(s_name, s, 2)
    if s64.shape != v64.shape[:2]:
        raise ValueError(f"{s_name}.shape must be {v_name}.shape[:2] = {v64.shape[:2]}, "
                         f"got {s64.shape}")
    return v64, s64


def _combine(v_a, s_a, v_b, s_b, axis_states=None):
    """Merge natural-log states; with ``axis_states`` reduce along that axis of stacked states.

    ``s`` has the shape of ``v`` without its last axis. Returns float64 ``(v, s)``. An LSE of NaN
    or ``+inf`` in any merged state makes the (row, head) NaN; ``-inf`` states add nothing.
    """
    if axis_states is None:
        v = np.stack([v_a, v_b], axis=0)
        s = np.stack([s_a, s_b], axis=0)
        axis_states = 0
    else:
        v, s = v_a, s_a
    poisoned = np.isnan(s) | (s == np.inf)
    bad = np.any(poisoned, axis=axis_states)
    empty = np.isneginf(s) | poisoned  # neither adds to the sum; `bad` overrides the result
    s = np.where(empty, -np.inf, s)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(s, axis=axis_states, initial=-np.inf)
        # All-empty rows have m = -inf; shifting by 0 instead keeps exp(-inf - 0) = 0, not NaN.
        m_safe = np.where(np.isfinite(m), m, 0.0)
        w = np.exp(s - np.expand_dims(m_safe, axis_states))
        total = w.sum(axis=axis_states)
        has = total > 0
        denom = np.where(has, total, 1.0)
        # An empty state's O is never read: 0 * NaN would be NaN.
        part = np.where(empty[..., None], 0.0, w[..., None] * v)
        out = part.sum(axis=axis_states) / denom[..., None]
        lse = np.where(has, m_safe + np.log(denom), -np.inf)
    out[bad] = np.nan
    return out, np.where(bad, np.nan, lse)


def merge_state(v_a, s_a, v_b, s_b, *, lse_base=math.e):
    """Merge two attention states computed over disjoint key sets.

    Parameters
    ----------
    v_a, v_b : ndarray, float, shape [seq_len, num_heads, head_dim]
        Outputs of the two states.
    s_a, s_b : ndarray, float, shape [seq_len, num_heads]
        Their LSEs in ``lse_base`` (``-inf`` for an empty key set; NaN or ``+inf`` makes the
        merged row and head NaN, see the module docstring).
    lse_base : float
        ``math.e`` (default) or ``2`` (FlashInfer's convention).

    Returns
    -------
    v : ndarray, float64, shape [seq_len, num_heads, head_dim]
    s : ndarray, float64, shape [seq_len, num_heads]
        The state over the union of the key sets, LSE in ``lse_base``; NaN (all of ``v[i, h]``
        and ``s[i, h]``) where either LSE is NaN or ``+inf``.
    """
    base = check_lse_base(lse_base)
    v_a, s_a = _check_pair("v_a", v_a, "s_a", s_a)
    v_b, s_b = _check_pair("v_b", v_b, "s_b", s_b)
    if v_b.shape != v_a.shape:
        raise ValueError(f"v_b.shape must equal v_a.shape {v_a.shape}, got {v_b.shape}")
    v, s = _combine(v_a, lse_from_base(s_a, base), v_b, lse_from_base(s_b, base))
    return v, lse_to_base(s, base)


def merge_state_in_place(v, s, v_other, s_other, mask=None, *, lse_base=math.e):
    """Merge ``(v_other, s_other)`` into ``(v, s)``, overwriting ``v`` and ``s``.

    Parameters
    ----------
    v : ndarray, float, shape [seq_len, num_heads, head_dim]
        Output of the state to update; written in place (rounded to its own dtype).
    s : ndarray, float, shape [seq_len, num_heads]
        Its LSE in ``lse_base``; written in place. A merged row and head whose LSE (here or in
        ``s_other``) is NaN or ``+inf`` becomes NaN in ``v`` and ``s``.
    v_other, s_other : ndarray
        The other state, same shapes.
    mask : ndarray of bool, shape [seq_len], optional
        Only rows with ``True`` are merged; the others keep their values.
    lse_base : float
        ``math.e`` (default) or ``2``.

    Returns
    -------
    None
    """
    base = check_lse_base(lse_base)
    for name, arr in (("v", v), ("s", s)):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array (it is updated in place), "
                            f"got {type(arr).__name__}")
        if not arr.flags.writeable:
            raise ValueError(f"{name} must be writeable (it is updated in place)")
    v64, s64 = _check_pair("v", v, "s", s)
    vo, so = _check_pair("v_other", v_other, "s_other", s_other)
    if vo.shape != v64.shape:
        raise ValueError(f"v_other.shape must equal v.shape {v64.shape}, got {vo.shape}")
    rows = np.ones(v64.shape[0], dtype=bool)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask must be a boolean array, got dtype {mask.dtype}")
        check_ndim("mask", mask, 1)
        if mask.shape[0] != v64.shape[0]:
            raise ValueError(f"mask must have length seq_len={v64.shape[0]}, got {mask.shape[0]}")
        rows = mask
    nv, ns = _combine(v64[rows], lse_from_base(s64[rows], base),
                      vo[rows], lse_from_base(so[rows], base))
    v[rows] = nv
    s[rows] = lse_to_base(ns, base)


def merge_states(v, s, *, lse_base=math.e):
    """Merge ``num_states`` attention states per row into one.

    Parameters
    ----------
    v : ndarray, float, shape [seq_len, num_states, num_heads, head_dim]
        Outputs of the states.
    s : ndarray, float, shape [seq_len, num_states, num_heads]
        Their LSEs in ``lse_base``; ``-inf`` states are empty, and one NaN or ``+inf`` LSE makes
        the merged row and head NaN.
    lse_base : float
        ``math.e`` (default) or ``2``.

    Returns
    -------
    v_merged : ndarray, float64, shape [seq_len, num_heads, head_dim]
    s_merged : ndarray, float64, shape [seq_len, num_heads]
        With ``num_states == 0`` every row is empty: ``v = 0``, ``s = -inf``.
    """
    base = check_lse_base(lse_base)
    v64 = as_f64("v", v, 4)
    s64 = as_f64("s", s, 3)
    if s64.shape != v64.shape[:3]:
        raise ValueError(f"s.shape must be v.shape[:3] = {v64.shape[:3]}, got {s64.shape}")
    out, lse = _combine(v64, lse_from_base(s64, base), None, None, axis_states=1)
    return out, lse_to_base(lse, base)
