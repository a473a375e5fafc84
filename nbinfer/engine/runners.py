"""Model runners: the KV memory of a model and one forward pass over a step's batch.

A runner owns one paged cache per layer (``[num_pages, 2, page_size, Hkv, D]``, NHD) and runs
a step given the batch the engine built: the new tokens, their positions, the query rows of
each sequence (``qo_indptr``) and the page table *after* this step's tokens are appended. In
every layer it appends the step's keys and values to their pages, then runs causal attention of
the new rows over each sequence's pages.

- :class:`NumpyRunner`: the definition, attention straight from :mod:`nbinfer.reference`;
- :class:`ApiRunner`: the same NumPy model over nbinfer's public wrappers, the way a serving
  system drives them (:class:`StepAttention`: one ``plan()`` per step for every layer,
  ``run()`` per layer), on the reference engine or in the simulator;
- :class:`~nbinfer.engine.torch_runner.TorchRunner` (needs torch): the torch model on a GPU
  over the same :class:`StepAttention`, with CUDA graphs.
"""

from __future__ import annotations

import time

import numpy as np

from .model import NumpyLlama

__all__ = ["ApiRunner", "HostSampling", "NumpyRunner", "StepAttention"]


class HostSampling:
    """Greedy sampling for runners whose logits are host arrays, in the two halves the engine's
    overlap uses (:class:`~nbinfer.engine.Engine`): :meth:`sample` keeps the step's tokens
    (where a GPU runner would leave them on the device), :meth:`fetch` hands them over, and
    :meth:`resolve` replaces a batch's placeholders (``-1 - j``: row ``j`` of the last
    sample) by those tokens."""

    _sampled = np.zeros(0, dtype=np.int64)

    def sample(self, logits) -> np.ndarray:
        self._sampled = np.argmax(logits, axis=-1)
        return self._sampled

    @staticmethod
    def fetch(handle) -> list:
        return handle.tolist()

    @staticmethod
    def argmax(logits) -> list:
        """Greedy token of each row of ``logits``."""
        return np.argmax(logits, axis=-1).tolist()

    def resolve(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size and tokens.min() < 0:
            tokens = np.where(tokens >= 0, tokens, self._sampled[np.maximum(-1 - tokens, 0)])
        return tokens


class NumpyRunner(HostSampling):
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
                levels=None, rows=None):
        """Logits ``[len(rows), vocab]`` of one step (see the module docstring), for the token
        rows ``rows`` (default all); with ``levels``
        (:class:`~nbinfer.formats.radix.CascadeLevels` of a decode step) attention runs as a
        cascade over them instead of over the page table. A negative token is a placeholder
        for a token of the last :meth:`sample` (:meth:`resolve`)."""
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

        return self.model.forward(self.resolve(tokens), np.asarray(positions), attend, rows=rows)


class StepAttention:
    """A step's attention through nbinfer's public API: the wrappers a runner keeps, planned
    once per step and run in every layer.

    One float workspace serves :class:`~nbinfer.BatchDecodeWithPagedKVCacheWrapper` (steps in
    which every sequence decodes one token), :class:`~nbinfer.BatchPrefillWithPagedKVCacheWrapper`
    (causal; steps with prompt chunks) and one :class:`~nbinfer.MultiLevelCascadeAttentionWrapper`
    per level count (cascade steps); :class:`~nbinfer.PagedKVAppendWrapper` appends the step's
    keys and values.

    Parameters
    ----------
    workspace : array
        The shared float workspace (on the device of the caches).
    cache : array
        One layer's cache ``[num_pages, 2, page_size, Hkv, D]`` (every layer's is alike).
    heads : (num_qo_heads, num_kv_heads, head_dim, page_size)
    dtype : str
        ``"float32"``, ``"float16"`` or ``"bfloat16"`` (q and the cache).
    backend : {"auto", "cuda", "sim", "reference"}
    """

    def __init__(self, workspace, cache, heads, dtype: str, *, backend: str = "auto"):
        from ..api.append import PagedKVAppendWrapper
        from ..api.decode import BatchDecodeWithPagedKVCacheWrapper
        from ..api.prefill import BatchPrefillWithPagedKVCacheWrapper

        self.workspace, self.heads, self.dtype, self.backend = workspace, heads, dtype, backend
        self.decode = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        self.prefill = BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
        self.cascades: dict = {}
        self.append = PagedKVAppendWrapper(cache, "NHD", backend=backend)
        self.plans = self.runs = 0  # plan() and attention run() calls, for the curious

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, levels=None):
        """Plan one step (host int32 arrays: the engine's batch, the page table after the
        append); returns ``attend(q, k, v, cache) -> o`` for every layer."""
        from .. import reference

        kv_lens = reference.kv_lengths(kv_indptr, kv_last_page_len, self.heads[3])
        batch_idx, pos = reference.get_batch_indices_positions(qo_indptr, kv_lens,
                                                               int(qo_indptr[-1]))
        self.append.plan(batch_idx, pos, kv_indices, kv_indptr, kv_last_page_len)
        self.plans += 1
        if levels is not None:
            from ..api.cascade import MultiLevelCascadeAttentionWrapper

            if not np.array_equal(levels.rows, np.arange(levels.rows.size)):
                raise ValueError("cascade levels must keep the batch's row order (the engine "
                                 "orders a cascade step's sequences by shared prefix)")
            wrapper = self.cascades.get(levels.num_levels)
            if wrapper is None:
                wrapper = self.cascades[levels.num_levels] = MultiLevelCascadeAttentionWrapper(
                    levels.num_levels, self.workspace, "NHD", backend=self.backend)
            wrapper.plan(levels.qo_indptr_arr, levels.paged_kv_indptr_arr,
                         levels.paged_kv_indices_arr, levels.paged_kv_last_page_len_arr,
                         *self.heads, q_data_type=self.dtype)
        elif np.all(np.diff(qo_indptr) == 1):
            wrapper = self.decode
            wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, *self.heads,
                         q_data_type=self.dtype)
        else:
            wrapper = self.prefill
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *self.heads,
                         causal=True, q_data_type=self.dtype)
        append, run = self.append.run, wrapper.run

        def attend(q, k, v, cache):
            append(k, v, cache)
            self.runs += 1
            return run(q, cache)
        return attend


class ApiRunner(HostSampling):
    """The NumPy model over paged caches through nbinfer's public wrappers
    (:class:`StepAttention`), on the reference engine or in Numba's simulator (its caches are
    host arrays; on a GPU the torch runner holds them on the device).

    Parameters
    ----------
    model : NumpyLlama
        In float32, the widest dtype the wrappers take.
    num_pages, page_size : int
    backend : {"reference", "sim"}
        Where attention runs: the float64 reference engine (default) or the simulator.
    workspace_bytes : int
    """

    name = "api"

    def __init__(self, model: NumpyLlama, num_pages: int, page_size: int, *,
                 backend: str = "reference", workspace_bytes: int = 16 << 20):
        if backend not in ("reference", "sim"):
            raise ValueError(f"backend must be 'reference' or 'sim' (host caches), got "
                             f"{backend!r}; on a GPU use engine.torch_runner.TorchRunner")
        if model.dtype != np.float32:
            raise TypeError(f"ApiRunner needs a float32 model (the wrappers' widest dtype), "
                            f"got {model.dtype}")
        cfg = model.cfg
        self.model, self.page_size = model, page_size
        shape = (num_pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [np.zeros(shape, dtype=np.float32) for _ in range(cfg.num_layers)]
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size)
        self.attention = StepAttention(np.zeros(workspace_bytes, np.uint8), self.caches[0],
                                       heads, "float32", backend=backend)
        self.attention_seconds = 0.0

    def forward(self, tokens, positions, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                levels=None, rows=None):
        """As :meth:`NumpyRunner.forward`: one plan, then append + attention in each layer."""
        t0 = time.perf_counter()
        attend_step = self.attention.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                          levels)
        self.attention_seconds += time.perf_counter() - t0

        def attend(layer, q, k, v):
            t0 = time.perf_counter()
            o = attend_step(np.ascontiguousarray(q), np.ascontiguousarray(k),
                            np.ascontiguousarray(v), self.caches[layer])
            self.attention_seconds += time.perf_counter() - t0
            return o

        return self.model.forward(self.resolve(tokens), np.asarray(positions), attend, rows=rows)
