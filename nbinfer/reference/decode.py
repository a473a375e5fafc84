"""Decode attention (one new query token per request) in the reference engine.

A decode query sits at the last position of its request, ``kv_len - 1``, so it sees every key and
no causal mask is needed; ``window_left`` still limits how far back it looks.
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import check_dim
from ._batch import epilogue, prepare_paged_batch, run_batch
from ._common import build_variant, check_contiguous
from .attention import attention_state

__all__ = ["batch_decode_with_paged_kv_cache", "single_decode_with_kv_cache"]


def single_decode_with_kv_cache(q, k, v, *, kv_layout="NHD", pos_encoding_mode="NONE",
                                window_left=-1, logits_soft_cap=None, sm_scale=None,
                                rope_scale=None, rope_theta=None, variant=None, return_lse=False,
                                lse_base=math.e):
    """Attention of one query token (all heads) over one request's contiguous KV.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [num_qo_heads, head_dim]
    k, v : ndarray, float16/32/64
        NHD ``[kv_len, num_kv_heads, head_dim]`` or HND ``[num_kv_heads, kv_len, head_dim]``.
    kv_layout : {"NHD", "HND"}
    pos_encoding_mode : {"NONE", "ROPE_LLAMA", "ALIBI"}
    window_left : int
        Keys at positions ``>= kv_len - 1 - window_left`` are kept; ``-1`` keeps all.
    logits_soft_cap : float, optional
        ``cap * tanh(s / cap)`` on the logits when > 0.
    sm_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    rope_scale, rope_theta : float, optional
        Rotary embedding parameters (defaults 1 and 1e4) for ``"ROPE_LLAMA"``.
    variant : Variant or str, optional
        Extra variant composed after the one the flags describe; a str names a parameter-free
        built-in (``"causal"``, ``"sigmoid"`` ...; see :func:`nbinfer.variants.resolve`).
    return_lse : bool
        Also return the LSE.
    lse_base : float
        ``math.e`` (default) or ``2``.

    Returns
    -------
    o : ndarray, float64, shape [num_qo_heads, head_dim]
    lse : ndarray, float64, shape [num_qo_heads]
        Only with ``return_lse``; ``-inf`` when kv_len is 0.
    """
    lse_base, q, k, v = check_contiguous(q, k, v, kv_layout, lse_base, q_ndim=2)
    var = build_variant(num_qo_heads=q.shape[0], window_left=window_left,
                        logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                        rope_scale=rope_scale, rope_theta=rope_theta, variant=variant)
    o, lse = attention_state(q[None], k, v, sm_scale=sm_scale, variant=var)
    res = epilogue(o, lse, var, return_lse, lse_base)
    return (res[0][0], res[1][0]) if return_lse else res[0]


def batch_decode_with_paged_kv_cache(q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len,
                                     *, kv_layout="NHD", pos_encoding_mode="NONE",
                                     window_left=-1, logits_soft_cap=None, sm_scale=None,
                                     rope_scale=None, rope_theta=None, variant=None,
                                     return_lse=False, lse_base=math.e):
    """Decode attention for a batch of requests whose KV lives in a paged cache.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [batch_size, num_qo_heads, head_dim]
        One query token per request.
    paged_kv_cache : ndarray or (ndarray, ndarray)
        See :func:`~nbinfer.reference.paged.split_paged_kv_cache`.
    kv_indptr : array of int32, shape [batch_size + 1]
    kv_indices : array of int32, shape [nnz_pages]
    kv_last_page_len : array of int32, shape [batch_size]
        The page table (see :func:`~nbinfer.reference.paged.check_page_table`).
    kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
    variant, return_lse, lse_base
        As in :func:`single_decode_with_kv_cache`.

    Returns
    -------
    o : ndarray, float64, shape [batch_size, num_qo_heads, head_dim]
    lse : ndarray, float64, shape [batch_size, num_qo_heads]
        Only with ``return_lse``.
    """
    lse_base, q, scale, kv_lens, get_kv = prepare_paged_batch(
        q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout, sm_scale, lse_base)
    check_dim("q", q, 0, kv_lens.size, "batch_size = len(kv_indptr) - 1")
    var = build_variant(num_qo_heads=q.shape[1], window_left=window_left,
                        logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                        rope_scale=rope_scale, rope_theta=rope_theta, variant=variant)
    return run_batch(q, np.arange(q.shape[0] + 1), get_kv, var, scale, None, return_lse, lse_base)
