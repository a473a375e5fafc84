"""Block-sparse attention (FlashInfer's BlockSparseAttentionWrapper) in the reference engine.

The attention pattern is a BSR matrix of shape ``(M, N)`` with blocks ``(R, C)``: query row ``i``
attends to key ``j`` iff block ``(i // R, j // C)`` is stored, and, when an element mask is given,
that block's mask keeps ``(i % R, j % C)``. The reference engine expands the pattern to a dense
``[M, N]`` boolean mask and runs one dense attention; kernels instead visit only stored blocks.
"""

from __future__ import annotations

import math

import numpy as np

from ..formats import BSR
from ._batch import bool_or_packed_mask, epilogue
from ._common import _prepare_contiguous, build_variant
from .attention import attention_state

__all__ = ["block_sparse_attention", "block_sparse_dense_mask"]


def _element_mask(mask, packed_mask, nnz: int, r: int, c: int):
    return bool_or_packed_mask(mask, packed_mask, (nnz, r, c), ("nnz_blocks", "R", "C"),
                               names=("mask", "packed_mask"), packed_kind="a uint8 array")


def block_sparse_dense_mask(bsr: BSR, mask=None) -> np.ndarray:
    """Expand a BSR pattern (and optional per-block element mask) to bool ``[M, N]``.

    Parameters
    ----------
    bsr : BSR
        The block pattern (a BSR stores a block column at most once per block row).
    mask : ndarray of bool, shape [nnz_blocks, R, C], optional
        Element mask of every stored block; entries past the matrix edge are ignored.

    Returns
    -------
    ndarray of bool, shape [M, N]
    """
    (r, c), (m, n) = bsr.block_shape, bsr.shape
    dense = np.zeros((m, n), dtype=bool)
    for i in range(bsr.num_block_rows):
        r0, r1 = i * r, min((i + 1) * r, m)
        for kk in range(int(bsr.indptr[i]), int(bsr.indptr[i + 1])):
            c0 = int(bsr.indices[kk]) * c
            c1 = min(c0 + c, n)
            dense[r0:r1, c0:c1] = True if mask is None else mask[kk, :r1 - r0, :c1 - c0]
    return dense


def block_sparse_attention(q, k, v, indptr, indices, R, C, *, mask=None, packed_mask=None,
                           causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
                           window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
                           rope_theta=None, variant=None, return_lse=False, lse_base=math.e):
    """Attention restricted to the stored blocks of a BSR pattern.

    Parameters
    ----------
    q : ndarray, float16/32/64, shape [M, num_qo_heads, head_dim]
    k, v : ndarray, float16/32/64
        NHD ``[N, num_kv_heads, head_dim]`` or HND ``[num_kv_heads, N, head_dim]``.
    indptr : array of int32, shape [ceil(M / R) + 1]
    indices : array of int32, shape [nnz_blocks]
        Block columns in ``[0, ceil(N / C))``, at most once per block row (any order within a
        row); a repeated column raises a ValueError naming ``indices``.
    R, C : int
        Block shape. ``M`` and ``N`` need not be multiples of it.
    mask : ndarray of bool, shape [nnz_blocks, R, C], optional
        Element mask of every stored block (``True`` keeps).
    packed_mask : ndarray of uint8, shape [ceil(nnz_blocks * R * C / 8)], optional
        ``mask`` flattened and packed in little bit order.
    causal : bool
        Bottom-right aligned: query ``i`` sits at position ``i + N - M``, key ``j`` at ``j``.
    kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
    variant, return_lse, lse_base
        As in :func:`~nbinfer.reference.prefill.single_prefill_with_kv_cache`.

    Returns
    -------
    o : ndarray, float64, shape [M, num_qo_heads, head_dim]
    lse : ndarray, float64, shape [M, num_qo_heads]
        Only with ``return_lse``; ``-inf`` for a row with no stored block.
    """
    lse_base, q, k, v, scale = _prepare_contiguous(q, k, v, kv_layout, sm_scale, lse_base)
    bsr = BSR(indptr, indices, (R, C), (q.shape[0], k.shape[0]))
    elem = _element_mask(mask, packed_mask, bsr.nnz_blocks, *bsr.block_shape)
    dense = block_sparse_dense_mask(bsr, elem)
    var = build_variant(num_qo_heads=q.shape[1], causal=causal, window_left=window_left,
                        logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
                        rope_scale=rope_scale, rope_theta=rope_theta, variant=variant)
    o, lse = attention_state(q, k, v, sm_scale=scale, variant=var, mask=dense)
    return epilogue(o, lse, var, return_lse, lse_base)
