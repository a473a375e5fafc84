"""The core of the reference engine: one attention state (O, LSE) over a contiguous key set.

Every reference entry point (decode, prefill, block-sparse, cascade) reduces to calls of
:func:`attention_state` on gathered keys, followed by :func:`~nbinfer.reference.merge.merge_state`
where a query's keys come in several pieces, and one :func:`finalize` at the end. The order of
operations is the specification that the GPU kernels follow:

1. query / key transforms of the variant (e.g. rotary embedding), at absolute positions;
2. logits ``s = sm_scale * (q . k)``;
3. logits transforms of the variant (soft-cap, ALiBi, sigmoid ...);
4. masks: the variant's ``logits_mask`` AND the caller's boolean ``mask``;
5. softmax over the kept keys, giving ``O`` and ``LSE = log sum_j exp(s_j)``; or, for a
   variant with ``use_softmax=False``, ``O = sum_j w_j v_j`` over kept keys and ``LSE = 0``.

The output transform (e.g. attention sink) needs the LSE of the *final* state, so it is not part
of :func:`attention_state`; :func:`finalize` applies it once after all merging.

Non-finite values (the rule on every backend): a NaN or infinity in a query row, or in the K or
V row of a key that the query keeps (after both masks), makes that (row, head)'s whole output
(every head_dim entry) and its LSE NaN; so does a kept logit that is NaN or ``+inf`` after the
variant's transforms. The masks alone decide which keys a row keeps: a kept key whose logit the
variant sets to ``-inf`` has weight 0 but is still read (a non-finite V there poisons the row, as
``0 * NaN`` would). A masked key's K and V never matter, and keys outside the given key set are
never read. A row with no kept key has ``O = 0`` and ``LSE = -inf``, whatever its query holds.
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import as_index_array, check_ndim, check_sm_scale
from ..variants import resolve, standard
from ..variants.host import logits_keep, transform_logits, transform_output, transform_vectors
from ._common import as_f64, check_lse_base, check_q_kv, lse_from_base, lse_to_base

__all__ = ["attention_state", "finalize"]


def _positions(name: str, pos, length: int, default_start: int) -> np.ndarray:
    if pos is None:
        return np.arange(default_start, default_start + length, dtype=np.int64)
    arr = as_index_array(name, pos).astype(np.int64)
    if arr.size != length:
        raise ValueError(f"{name} must have length {length}, got {arr.size}")
    return arr


def _check_mask(mask, lq: int, lkv: int) -> np.ndarray | None:
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array (True = keep), got dtype {mask.dtype}")
    check_ndim("mask", mask, 2)
    if mask.shape != (lq, lkv):
        raise ValueError(f"mask must have shape [qo_len, kv_len] = {(lq, lkv)}, got {mask.shape}")
    return mask


def attention_state(q, k, v, *, sm_scale=None, variant=None, q_pos=None, kv_pos=None, mask=None,
                    lse_base=math.e):
    """Attention state of every query over one contiguous key set, in float64.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [qo_len, num_qo_heads, head_dim]
        Queries.
    k, v : ndarray, float16/32/64, shape [kv_len, num_kv_heads, head_dim]
        Keys and values (NHD). ``num_qo_heads`` must be a multiple of ``num_kv_heads``; qo head
        ``h`` reads kv head ``h // (num_qo_heads // num_kv_heads)`` (GQA).
    sm_scale : float, optional
        Logit scale; ``None`` means ``1 / sqrt(head_dim)``.
    variant : Variant or str, optional
        Attention variant whose query/key/logits transforms and masks are applied. Its output
        transform is *not* applied (see :func:`finalize`). ``None`` means standard attention; a
        string names a parameter-free built-in (see :func:`nbinfer.variants.resolve`).
    q_pos : array of int, shape [qo_len], optional
        Absolute query positions given to the hooks. Default: bottom-right aligned,
        ``i + kv_len - qo_len``.
    kv_pos : array of int, shape [kv_len], optional
        Absolute key positions. Default ``0 .. kv_len - 1``.
    mask : ndarray of bool, shape [qo_len, kv_len], optional
        ``True`` keeps a (query, key) pair; AND-ed with the variant's mask.
    lse_base : float
        ``math.e`` (default) or ``2`` for the returned LSE.

    Returns
    -------
    o : ndarray, float64, shape [qo_len, num_qo_heads, head_dim]
        Softmax-weighted values; 0 for a query with no kept key; NaN (every entry of the row and
        head) under the non-finite rule of the module docstring.
    lse : ndarray, float64, shape [qo_len, num_qo_heads]
        Log-sum-exp of the kept logits in ``lse_base`` (``-inf`` for no kept key, NaN under the
        non-finite rule); zeros when the variant does not use softmax (NaN under the rule).
    """
    lse_base = check_lse_base(lse_base)
    q = as_f64("q", q, 3)
    k = as_f64("k", k, 3)
    v = as_f64("v", v, 3)
    lq, hq, d = q.shape
    lkv, hkv, _ = k.shape
    if v.shape != k.shape:
        raise ValueError(f"v.shape must equal k.shape {k.shape}, got {v.shape}")
    group = check_q_kv(q, hkv, k.shape[2])
    scale = check_sm_scale(sm_scale, d)
    variant = resolve(variant) or standard()
    qp = _positions("q_pos", q_pos, lq, lkv - lq)
    kp = _positions("kv_pos", kv_pos, lkv, 0)
    mask = _check_mask(mask, lq, lkv)

    # Non-finite inputs, per query row and per key row (the non-finite rule reads the inputs).
    q_bad = ~np.isfinite(q).all(axis=-1)
    k_bad = ~np.isfinite(k).all(axis=-1)
    v_bad = ~np.isfinite(v).all(axis=-1)
    q = transform_vectors(variant, "query_transform", q, qp, np.arange(hq))
    k = transform_vectors(variant, "key_transform", k, kp, np.arange(hkv))

    # Logits per qo head: [Hq, Lq, Lkv]. GQA is a reshape: the `group` qo heads that share a kv
    # head are adjacent, so q viewed as [Lq, Hkv, group, D] lines up with k's head axis.
    qg = q.reshape(lq, hkv, group, d)
    s = np.einsum("qhgd,khd->hgqk", qg, k).reshape(hq, lq, lkv) * scale
    heads = np.arange(hq, dtype=np.int64)[:, None, None]
    qpb, kpb = qp[None, :, None], kp[None, None, :]
    s = transform_logits(variant, s, qpb, kpb, heads)
    keep = logits_keep(variant, qpb, kpb, heads)
    keep = np.ones(s.shape, dtype=bool) if keep is None else np.broadcast_to(keep, s.shape)
    if mask is not None:
        keep = keep & mask[None, :, :]

    # The non-finite rule: a non-finite query, K or V row of a kept (query, key) pair poisons
    # that (row, head), whatever the key's weight.
    bad = _bad_pairs(q_bad, k_bad | v_bad, keep, group)
    if variant.use_softmax:
        p, lse, bad_logit = _softmax_weights(s, keep)
    else:
        p = np.where(keep, s, 0.0)
        lse = np.zeros((hq, lq))
        bad_logit = np.any(keep & np.isnan(s), axis=-1)
    bad |= bad_logit
    p = np.where(bad[..., None], 0.0, p)
    # Weights are 0 for masked keys, and rows that keep a non-finite V are poisoned: the
    # non-finite entries can be taken out of V before the contraction (0 * NaN would be NaN).
    o = np.einsum("hgqk,khd->qhgd", p.reshape(hkv, group, lq, lkv),
                  np.where(np.isfinite(v), v, 0.0)).reshape(lq, hq, d)
    o[bad.T] = np.nan  # every head_dim entry of a poisoned (row, head)
    lse = np.where(bad, np.nan, lse)
    return o, lse_to_base(lse.T.copy(), lse_base)


def _bad_pairs(q_bad, kv_bad, keep, group: int) -> np.ndarray:
    """bool ``[Hq, Lq]``: the (head, row) keeps a key while its query (``q_bad``, ``[Lq, Hq]``)
    or that key's K/V row (``kv_bad``, ``[Lkv, Hkv]``) is non-finite; ``keep`` is
    ``[Hq, Lq, Lkv]``."""
    kv_bad = np.repeat(kv_bad.T, group, axis=0)  # [Hq, Lkv]: qo head h reads kv head h // group
    return np.any(keep & (q_bad.T[:, :, None] | kv_bad[:, None, :]), axis=-1)


def _softmax_weights(s: np.ndarray, keep: np.ndarray):
    """Normalised softmax weights over kept entries of the last axis, the natural LSE, bad rows.

    Subtracting the row maximum keeps ``exp`` in range for any logit size. A row with no kept
    entry gets weights 0 and LSE ``-inf`` (not NaN: the max is replaced by 0 before use). A row
    that keeps a NaN or ``+inf`` logit is *bad*: weights 0 here, LSE NaN (the caller makes its
    output NaN). Returns ``(p, lse, bad)``.
    """
    bad = np.any(keep & (np.isnan(s) | (s == np.inf)), axis=-1)
    keep = keep & ~bad[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        masked = np.where(keep, s, -np.inf)
        m = np.max(masked, axis=-1, initial=-np.inf)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        e = np.where(keep, np.exp(masked - m_safe[..., None]), 0.0)
        l = e.sum(axis=-1)
        has = l > 0
        p = e / np.where(has, l, 1.0)[..., None]
        lse = np.where(has, m_safe + np.log(np.where(has, l, 1.0)), -np.inf)
    return p, np.where(bad, np.nan, lse), bad


def finalize(o, lse, variant, *, lse_base=math.e):
    """Apply the variant's output transforms to a final (fully merged) state.

    Parameters
    ----------
    o : ndarray, float, shape [..., num_qo_heads, head_dim]
        Merged attention output.
    lse : ndarray, float, shape [..., num_qo_heads]
        Its LSE in ``lse_base``; the hooks receive it as a natural log.
    variant : Variant, str or None
        Variant whose ``output_transform`` hooks run (head index = qo head). ``None`` or a
        variant without output hooks returns ``o`` unchanged (as float64).
    lse_base : float
        Base of ``lse``: ``math.e`` (default) or ``2``.

    Returns
    -------
    ndarray, float64, shape of ``o``
    """
    lse_base = check_lse_base(lse_base)
    o = as_f64("o", o, range(2, 8))
    lse = as_f64("lse", lse, range(1, 7))
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"lse.shape must be o.shape[:-1] = {o.shape[:-1]}, got {lse.shape}")
    variant = resolve(variant)
    if variant is None or not variant.output_transform:
        return o
    heads = np.arange(o.shape[-2], dtype=np.int64)[:, None]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return transform_output(variant, o, lse_from_base(lse, lse_base), heads)
