"""Prefill / append attention (many query tokens per request) in the reference engine.

Query ``i`` of a request with ``qo_len`` queries and ``kv_len`` keys sits at absolute position
``i + kv_len - qo_len`` (the new tokens are the last ones of the sequence), so ``causal=True`` is
FlashInfer's bottom-right aligned causal mask. A custom mask is AND-ed with the variant's masks
(causal and window included). FlashInfer instead ignores ``causal`` when a custom mask is given;
pass ``causal=False`` with a custom mask to get its behaviour exactly.
"""

from __future__ import annotations

import math

from ._batch import (
    batch_masks,
    check_qo_indptr,
    epilogue,
    prepare_paged_batch,
    run_batch,
    single_mask,
)
from ._common import _prepare_contiguous, build_variant, check_contiguous
from .attention import attention_state

__all__ = [
    "batch_prefill_with_paged_kv_cache",
    "batch_prefill_with_ragged_kv_cache",
    "single_prefill_with_kv_cache",
]

_FLAGS_DOC = """
    causal : bool
        Bottom-right aligned causal mask.
    kv_layout : {"NHD", "HND"}
    pos_encoding_mode : {"NONE", "ROPE_LLAMA", "ALIBI"}
    window_left : int
        Keep keys at positions ``>= q_pos - window_left``; ``-1`` keeps all.
    logits_soft_cap : float, optional
        ``cap * tanh(s / cap)`` when > 0.
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
        ``math.e`` (default) or ``2``."""


def _variant(num_qo_heads, causal, window_left, logits_soft_cap, pos_encoding_mode, rope_scale,
             rope_theta, variant):
    return build_variant(num_qo_heads=num_qo_heads, causal=causal, window_left=window_left,
                         logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                         rope_scale=rope_scale, rope_theta=rope_theta, variant=variant)


def single_prefill_with_kv_cache(q, k, v, *, custom_mask=None, packed_custom_mask=None,
                                 causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                                 window_left=-1, logits_soft_cap=None, sm_scale=None,
                                 rope_scale=None, rope_theta=None, variant=None,
                                 return_lse=False, lse_base=math.e):
    """Attention of one request's queries over its contiguous KV.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [qo_len, num_qo_heads, head_dim]
    k, v : ndarray, float16/32/64
        NHD ``[kv_len, num_kv_heads, head_dim]`` or HND ``[num_kv_heads, kv_len, head_dim]``.
    custom_mask : ndarray of bool, shape [qo_len, kv_len], optional
        ``True`` keeps a pair.
    packed_custom_mask : ndarray of uint8, shape [ceil(qo_len * kv_len / 8)], optional
        The flattened custom mask packed little-endian bitwise (``packbits(..., "little")``).
    {flags}

    Returns
    -------
    o : ndarray, float64, shape [qo_len, num_qo_heads, head_dim]
    lse : ndarray, float64, shape [qo_len, num_qo_heads]
        Only with ``return_lse``.
    """
    lse_base, q, k, v = check_contiguous(q, k, v, kv_layout, lse_base)
    mask = single_mask(custom_mask, packed_custom_mask, q.shape[0], k.shape[0])
    var = _variant(q.shape[1], causal, window_left, logits_soft_cap, pos_encoding_mode,
                   rope_scale, rope_theta, variant)
    o, lse = attention_state(q, k, v, sm_scale=sm_scale, variant=var, mask=mask)
    return epilogue(o, lse, var, return_lse, lse_base)


def batch_prefill_with_paged_kv_cache(q, qo_indptr, paged_kv_cache, kv_indptr, kv_indices,
                                      kv_last_page_len, *, custom_mask=None,
                                      packed_custom_mask=None, mask_indptr=None, causal=False,
                                      kv_layout="NHD", pos_encoding_mode="NONE", window_left=-1,
                                      logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                      rope_theta=None, variant=None, return_lse=False,
                                      lse_base=math.e):
    """Prefill attention for a ragged batch of queries over a paged KV cache.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [nnz_qo, num_qo_heads, head_dim]
        Queries of all requests, concatenated.
    qo_indptr : array of int32, shape [batch_size + 1]
        Request ``b`` owns rows ``qo_indptr[b]:qo_indptr[b + 1]``; ``qo_indptr[-1] == nnz_qo``.
    paged_kv_cache : ndarray or (ndarray, ndarray)
        See :func:`~nbinfer.reference.paged.split_paged_kv_cache`.
    kv_indptr, kv_indices, kv_last_page_len : arrays of int32
        The page table, ``batch_size`` requests.
    custom_mask : ndarray of bool, shape [sum_b qo_len_b * kv_len_b], optional
        Concatenation over requests of each row-major ``[qo_len_b, kv_len_b]`` mask.
    packed_custom_mask : ndarray of uint8, optional
        Each request's flat mask packed separately, little bit order (``segment_packbits``).
    mask_indptr : array of int32, shape [batch_size + 1], optional
        Byte offset of each request's packed mask; computed from the lengths when omitted.
    {flags}

    Returns
    -------
    o : ndarray, float64, shape [nnz_qo, num_qo_heads, head_dim]
    lse : ndarray, float64, shape [nnz_qo, num_qo_heads]
        Only with ``return_lse``.
    """
    lse_base, q, scale, kv_lens, get_kv = prepare_paged_batch(
        q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout, sm_scale, lse_base)
    qo_ptr = check_qo_indptr(qo_indptr, q.shape[0], batch=kv_lens.size)
    masks = batch_masks(custom_mask, packed_custom_mask, mask_indptr, qo_ptr[1:] - qo_ptr[:-1],
                        kv_lens)
    var = _variant(q.shape[1], causal, window_left, logits_soft_cap, pos_encoding_mode,
                   rope_scale, rope_theta, variant)
    return run_batch(q, qo_ptr, get_kv, var, scale, masks, return_lse, lse_base)


def batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, *, custom_mask=None,
                                       packed_custom_mask=None, mask_indptr=None, causal=False,
                                       kv_layout="NHD", pos_encoding_mode="NONE", window_left=-1,
                                       logits_soft_cap=None, sm_scale=None, rope_scale=None,
                                       rope_theta=None, variant=None, return_lse=False,
                                       lse_base=math.e):
    """Prefill attention for a ragged batch of queries over ragged (contiguous) KV.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [nnz_qo, num_qo_heads, head_dim]
    k, v : ndarray, float16/32/64
        NHD ``[nnz_kv, num_kv_heads, head_dim]`` or HND ``[num_kv_heads, nnz_kv, head_dim]``;
        request ``b`` owns keys ``kv_indptr[b]:kv_indptr[b + 1]``.
    qo_indptr : array of int32, shape [batch_size + 1]
        ``qo_indptr[-1] == nnz_qo``.
    kv_indptr : array of int32, shape [batch_size + 1]
        ``kv_indptr[-1] == nnz_kv``.
    custom_mask, packed_custom_mask, mask_indptr
        As in :func:`batch_prefill_with_paged_kv_cache`.
    {flags}

    Returns
    -------
    o : ndarray, float64, shape [nnz_qo, num_qo_heads, head_dim]
    lse : ndarray, float64, shape [nnz_qo, num_qo_heads]
        Only with ``return_lse``.
    """
    lse_base, q, k, v, scale = _prepare_contiguous(q, k, v, kv_layout, sm_scale, lse_base)
    qo_ptr = check_qo_indptr(qo_indptr, q.shape[0])
    kv_ptr = check_qo_indptr(kv_indptr, k.shape[0], name="kv_indptr", batch=qo_ptr.size - 1)
    kv_lens = kv_ptr[1:] - kv_ptr[:-1]
    masks = batch_masks(custom_mask, packed_custom_mask, mask_indptr, qo_ptr[1:] - qo_ptr[:-1],
                        kv_lens)
    var = _variant(q.shape[1], causal, window_left, logits_soft_cap, pos_encoding_mode,
                   rope_scale, rope_theta, variant)

    def get_kv(b):
        return k[kv_ptr[b]:kv_ptr[b + 1]], v[kv_ptr[b]:kv_ptr[b + 1]]

    return run_batch(q, qo_ptr, get_kv, var, scale, masks, return_lse, lse_base)


for _fn in (single_prefill_with_kv_cache, batch_prefill_with_paged_kv_cache,
            batch_prefill_with_ragged_kv_cache):
    if _fn.__doc__:  # None under python -OO
        _fn.__doc__ = _fn.__doc__.replace("    {flags}", _FLAGS_DOC.strip("\n"))
del _fn
