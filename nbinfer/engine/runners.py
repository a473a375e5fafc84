"""Model runners: the KV memory of a model and one forward pass over a step's batch.

A runner owns one paged cache per layer (``[num_pages, 2, page_size, Hkv, D]``, NHD) and runs
a step given the batch the engine built: the new tokens, their positions, the query rows of
each sequence (``qo_indptr``) and the page table *after* this step's tokens are appended. In
every layer it appends the step's keys and values to their pages, then runs causal attention of
the new rows over each sequence's pages.
"""

from __future__ import annotations

import time

import numpy as np

from .model import NumpyLlama

__all__ = ["NumpyRunner"]


class NumpyRunner:
    """The NumPy model over a paged cache, attention from :mod:`nbinfer.reference`.

    Parameters
    ----------
    model : NumpyLlama
    num_pages, page_size : int
    """

    name = "numpy"

    def __init__(self, model: NumpyLlama, num_pages: int, page_size: int):
        cfg = model.cfg
        self.model, self.page_size = model, page_size
        shape = (num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [np.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]
        self.attention_seconds = 0.0  # wall time inside append + attention, all steps

    def forward(self, tokens, positions, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                levels=None):
        """Logits ``[len(tokens), vocab]`` of one step (see the module docstring); with
        ``levels`` (:class:`~nbinfer.formats.radix.CascadeLevels` of a decode step) attention
        runs as a cascade over them instead of over the page table."""
        from .. import reference

        kv_lens = reference.kv_lengths(kv_indptr, kv_last_page_len, self.page_size)
        batch_idx, pos = reference.get_batch_indices_positions(qo_indptr, kv_lens, len(tokens))

        def attend(layer, q, k, v):
            t0 = time.perf_counter()
            cache = self.caches[layer]
            reference.append_paged_kv_cache(k, v, batch_idx, pos, cache, kv_indices, kv_indptr,
                                            kv_last_page_len)
            if levels is None:
                o = reference.batch_prefill_with_paged_kv_cache(
                    q, qo_indptr, cache, kv_indptr, kv_indices, kv_last_page_len, causal=True)
            else:
                o = np.empty(q.shape, dtype=np.float64)
                o[levels.rows] = reference.multi_level_cascade_attention(
                    q[levels.rows], levels.qo_indptr_arr, cache, levels.paged_kv_indptr_arr,
                    levels.paged_kv_indices_arr, levels.paged_kv_last_page_len_arr)
            self.attention_seconds += time.perf_counter() - t0
            return o

        return self.model.forward(np.asarray(tokens), np.asarray(positions), attend)
