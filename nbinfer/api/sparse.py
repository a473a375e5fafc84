"""FlashInfer's ``BlockSparseAttentionWrapper``: attention over the stored blocks of a BSR pattern.

The pattern is a BSR matrix ``(M, N)`` of ``(R, C)`` blocks over queries x keys. It runs on the
prefill tile kernel with no data movement: every block row is a "request" (its ``<= R`` query
rows), every stored block column is a "page" of ``C`` consecutive keys of ``k [N, Hkv, D]``, so
the page table is the BSR's own ``indptr`` / ``indices`` (columns sorted per row; the partial last
column, when ``N % C``, ends its row with ``last_page_len = N - col * C``). Masks and positional
encodings see physical positions: query ``i`` at ``i + N - M`` (bottom-right, as the reference
engine), key ``j`` at ``j``. A per-block element mask ``[nnz, R, C]`` becomes each block row's
custom mask.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from .._checks import check_positive_int
from ..formats import BSR
from ..reference.sparse import _element_mask
from ..variants import compose, from_flashinfer_args
from ..variants import resolve as resolve_variant
from . import arrays, binding
from .base import write_reference
from .prefill import PrefillWrapperBase, check_kv

__all__ = ["BlockSparseAttentionWrapper"]


class BlockSparseAttentionWrapper(PrefillWrapperBase):
    """Block-sparse attention with FlashInfer's plan/run interface.

    Parameters
    ----------
    float_workspace_buffer : array on the device that runs the kernels
    backend : {"auto", "cuda", "sim", "reference"}
    """

    def __init__(self, float_workspace_buffer, *, backend: str = "auto"):
        super().__init__(float_workspace_buffer, "NHD", backend=backend)

    def plan(self, indptr, indices, M: int, N: int, R: int, C: int, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, *, mask=None, packed_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, variant=None) -> None:
        """``indptr [ceil(M/R)+1]``, ``indices [nnz]`` (block columns in ``[0, ceil(N/C))``, at most
        once per row, any order); ``mask [nnz, R, C]`` bool or ``packed_mask`` (flattened,
        little bit order)."""
        self._install(self._build, indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads,
                      head_dim, mask=mask, packed_mask=packed_mask, causal=causal,
                      pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                      logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                      rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                      variant=variant)

    def _build(self, indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads, head_dim, *, mask,
               packed_mask, causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
               rope_scale, rope_theta, q_data_type, kv_data_type, variant):
        for name, val in (("M", M), ("N", N), ("R", R), ("C", C)):
            check_positive_int(name, val)
        bsr = BSR(arrays.host_int32(indptr, "indptr"), arrays.host_int32(indices, "indices"),
                  (R, C), (M, N))
        elem = _element_mask(arrays.host_mask(mask), arrays.host_mask(packed_mask),
                             bsr.nnz_blocks, R, C)
        if elem is not None:
            elem = binding.frozen(elem)  # a snapshot: later changes to mask reach no backend
        rows = bsr.indptr.size - 1
        qo_indptr = np.minimum(np.arange(rows + 1) * R, M).astype(np.int32)
        # Columns sorted within each row (softmax does not care about order), so that the
        # partial last column, if stored, ends its row. Under causal, a block column that starts
        # after the block row's last query position (``qo_indptr[i + 1] - 1 + N - M``) is masked
        # for every row of it: it is left out of the row's pages (the work the planner's causal
        # trim saves for ordinary requests, which cannot be used here: see below).
        see = qo_indptr[1:].astype(np.int64) - 1 + N - M
        kept = []  # per block row: its stored blocks (positions in bsr.indices), sorted
        for i in range(rows):
            lo, hi = bsr.indptr[i], bsr.indptr[i + 1]
            srt = lo + np.argsort(bsr.indices[lo:hi], kind="stable")
            if causal:
                srt = srt[bsr.indices[srt].astype(np.int64) * C <= see[i]]
            kept.append(srt)
        counts = np.array([s.size for s in kept], dtype=np.int64)
        indptr = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(counts, out=indptr[1:])
        order = np.concatenate(kept).astype(np.int64) if rows else np.zeros(0, np.int64)
        cols = bsr.indices[order].astype(np.int32)
        tail = N - (N - 1) // C * C  # keys in the last block column
        last = np.full(rows, C, dtype=np.int32)
        for i in np.flatnonzero(counts):
            if cols[indptr[i + 1] - 1] == (N - 1) // C:
                last[i] = tail
        kv_lens = np.where(counts > 0, (counts - 1) * C + last, 0).astype(np.int64)
        masks = None
        if elem is not None:
            masks = []
            for i in range(rows):
                nrow = int(qo_indptr[i + 1] - qo_indptr[i])
                blocks = elem[order[indptr[i]:indptr[i + 1]], :nrow, :]  # [n, rows, C]
                full = np.transpose(blocks, (1, 0, 2)).reshape(nrow, -1)
                masks.append(np.ascontiguousarray(full[:, :kv_lens[i]]))
        # ``causal`` goes in as a mask of the variant only. The prefill planner's own causal
        # flag means "bottom-right over the request's *sequence* index": it would cut each query
        # tile's KV range at ``kv_len - qo_len + qo_end`` keys, but a block row's keys sit at
        # their columns' physical positions, so that cut drops keys the tile's rows can see
        # whenever a block row spans more than one query tile (R x G > tile_q).
        var = from_flashinfer_args(causal=True) if causal else None
        extra = resolve_variant(variant)
        if extra is not None:
            var = extra if var is None else compose(var, extra)
        table = tuple(binding.frozen(a) for a in (indptr, cols, last))
        return self._make_step(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim, C,
                               table, custom_mask=None, packed_custom_mask=None, causal=False,
                               pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                               rope_scale=rope_scale, rope_theta=rope_theta,
                               q_data_type=q_data_type, kv_data_type=kv_data_type,
                               fixed_split_size=None, variant=var,
                               masks=masks if masks is not None else [None] * rows,
                               q_pos0=(qo_indptr[:-1] + N - M).astype(np.int32),
                               extra=dict(bsr=bsr, mask=elem, causal=causal, shape=(M, N)))

    def run(self, q, k, v, *, out=None, lse=None, return_lse: bool = False):
        """``q [M, Hq, D]``, ``k, v [N, Hkv, D]`` (views with a contiguous last dimension are
        read in place). Returns ``out [M, Hq, D]`` (q's kind and dtype) and, with
        ``return_lse``, ``lse [M, Hq]`` (natural log; -inf for empty rows)."""
        step = self._slot.get()
        self._check_q(step, q)
        M, N = step.extra["shape"]
        Hkv, D, C = step.num_kv_heads, step.head_dim, step.page_size
        check_kv(k, v, (N, Hkv, D), "N, num_kv_heads, head_dim planned", step.kv_dtype)
        binding.same_device(q=q, k=k, v=v, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            bsr = step.extra["bsr"]
            res = reference.block_sparse_attention(
                arrays.to_host(q), arrays.kv_values(k, step.kv_dtype),
                arrays.kv_values(v, step.kv_dtype), bsr.indptr, bsr.indices, *bsr.block_shape,
                mask=step.extra["mask"], variant=step.variant, sm_scale=step.sm_scale,
                return_lse=return_lse or lse is not None)
            return write_reference(res, out, lse, q, (M, step.num_qo_heads, D), step.q_dtype,
                                   return_lse)
        # One block column = one "page" of C keys: page stride C tokens.
        return self._launch(step, q, (k, v), ("k", "v"), lambda s: (C * s[0], s[0], s[1]),
                            out, lse, return_lse)
