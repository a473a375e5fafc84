"""The torch model over nbinfer's kernels on a GPU: the engine's runner for real runs.

Same contract as :class:`~nbinfer.engine.runners.NumpyRunner` (one paged cache per layer,
``[num_pages, 2, page_size, Hkv, D]`` NHD, in the model's dtype); attention goes through
nbinfer's public API as :class:`~nbinfer.engine.runners.StepAttention` drives it: per step one
``plan()`` (decode, causal prefill or cascade) and one append plan, per layer the append's and
the attention's ``run()``.

With ``cuda_graphs=True`` a plain decode step (one token per sequence, no cascade) of up to
the largest bucket's batch is captured once per bucket size (1, 2, 4, ... rows) and replayed:
each step plans the bucket's decode and append wrappers (their CUDA-graph mode: fixed buffers
at fixed addresses), copies the tokens in and replays the whole forward pass, every layer's
GEMMs, append and attention in one graph launch. A batch smaller than its bucket is padded
with one-token sequences on a scratch page nobody else uses. With ``cascade_graphs=True`` a
cascade decode step (the engine's levels) replays a graph of its own per bucket and level count,
over
:class:`~nbinfer.MultiLevelCascadeAttentionWrapper`'s CUDA-graph mode; its padding rows form one
more level-0 segment and one segment each below, on the scratch page.

torch is an optional dependency: importing this module needs it, the rest of nbinfer does not.
"""

from __future__ import annotations

import numpy as np
import torch

from ..api.append import PagedKVAppendWrapper
from ..api.cascade import MultiLevelCascadeAttentionWrapper
from ..api.decode import BatchDecodeWithPagedKVCacheWrapper
from ..api.dtypes import normalize_dtype
from ..api.launch import defer_frees
from .runners import StepAttention
from .torch_model import TorchLlama

__all__ = ["TorchRunner"]


class TorchRunner:
    """A :class:`TorchLlama` on a CUDA device over paged caches, attention from nbinfer.

    Parameters
    ----------
    model : TorchLlama
        On a CUDA device.
    num_pages, page_size : int
    workspace_bytes : int
        The float workspace the wrappers share (partial states of split KV).
    timing : bool
        Time each layer's append + attention with CUDA events (``attention_seconds``: the
        GPU clock from before the append to after the attention, summed; two event records
        per layer, read once they have completed, so that timing never waits for the GPU
        and the engine's overlap still overlaps).
    cuda_graphs : bool
        Capture plain decode steps once per batch bucket and replay them (module docstring).
    cascade_graphs : bool
        With ``cuda_graphs``, capture and replay cascade decode steps too (else they run
        eagerly, and :class:`~nbinfer.engine.Engine`'s rule keeps replayed steps paged). Off
        by default until it has run on the H200 (built in session 21 on a CPU).
    graph_batch_sizes : sequence of int
        The buckets: a decode step of ``B`` sequences replays the smallest bucket ``>= B``;
        larger batches run eagerly.
    """

    name = "torch"

    def __init__(self, model: TorchLlama, num_pages: int, page_size: int, *,
                 workspace_bytes: int = 128 << 20, timing: bool = False,
                 cuda_graphs: bool = False, graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                 cascade_graphs: bool = False):
        if not isinstance(model, TorchLlama):
            raise TypeError(f"model must be a TorchLlama, got {type(model).__name__}")
        if model.device.type != "cuda":
            raise ValueError(f"model must be on a CUDA device (nbinfer's kernels run there), "
                             f"got {model.device}")
        cfg = model.cfg
        self.model, self.page_size, self.timing = model, page_size, timing
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, page_size)
        self.num_pages, self.device = num_pages, model.device
        # what the engine's cascade rule weighs (Engine.cascade_pays): K and V of one token in
        # one layer, and the layers a step's plan serves
        self.kv_bytes_per_token = 2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
        self.num_layers = cfg.num_layers
        # one page past the pool: the scratch page of the padding rows of a graph bucket
        shape = (num_pages + 1, 2, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [torch.zeros(shape, dtype=model.dtype, device=self.device)
                       for _ in range(cfg.num_layers)]
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.attention = StepAttention(self.workspace, self.caches[0], self.heads,
                                       normalize_dtype("model.dtype", model.dtype))
        self.cuda_graphs = bool(cuda_graphs)
        self.cascade_graphs = self.cuda_graphs and bool(cascade_graphs)
        self.graph_batch_sizes = tuple(sorted(int(b) for b in graph_batch_sizes))
        # Pages one level of a replayed cascade step may hold (before its padding): a level's
        # pages are distinct but for a page some, not all, of a group share (the engine's two
        # levels allow that), so the pool plus one per sequence bounds what the engine makes.
        self.cascade_level_pages = num_pages + self.graph_batch_sizes[-1] + 1
        # (bucket, 0) a decode step's graph; (bucket, levels) a cascade step's
        self._graphs: dict[tuple, _DecodeGraph | _CascadeGraph] = {}
        self._rope_version = model.rope_version  # the RoPE table the graphs were captured on
        # The last sample()'s tokens at a fixed address (row j: placeholder -1 - j), so that a
        # captured decode step reads them in the graph itself (grown, and the graphs captured
        # again, only for a step that samples more rows).
        self._sampled = torch.zeros(max(4096, self.graph_batch_sizes[-1]), dtype=torch.int64,
                                    device=self.device)
        self._presampled = None  # the last replayed step's logits, whose tokens its graph took
        self.graph_replays = 0
        self._attention_ms = 0.0  # with timing=True (see above)
        self._events: list = []  # (start, end) pairs not yet read, oldest first

    @property
    def attention_seconds(self) -> float:
        """Seconds of GPU time in append + attention so far (``timing=True``; waits for the
        layers still queued)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._read_events()
        return self._attention_ms / 1e3

    @attention_seconds.setter
    def attention_seconds(self, value: float) -> None:
        self._events.clear()  # layers still queued count toward neither total
        self._attention_ms = float(value) * 1e3

    def _read_events(self) -> None:
        """Add the pairs whose end has completed (in order: the GPU runs them in order)."""
        done = 0
        for start, end in self._events:
            if not end.query():
                break
            self._attention_ms += start.elapsed_time(end)
            done += 1
        del self._events[:done]

    def replays_decode(self, batch: int) -> bool:
        """Whether a plain decode step of ``batch`` sequences replays a CUDA graph."""
        return self.cuda_graphs and batch <= self.graph_batch_sizes[-1]

    def replays_cascade(self, batch: int, levels=None) -> bool:
        """Whether a cascade decode step of ``batch`` sequences (``levels``, when known) replays
        a CUDA graph: no level may hold more than :attr:`cascade_level_pages` pages."""
        if not (self.cascade_graphs and batch <= self.graph_batch_sizes[-1]):
            return False
        return levels is None or all(int(p[-1]) <= self.cascade_level_pages
                                     for p in levels.paged_kv_indptr_arr)

    def _graph(self, batch: int, levels):
        """The graph of a decode step of ``batch`` sequences (a cascade's with ``levels``)."""
        size = next(b for b in self.graph_batch_sizes if b >= batch)
        key = (size, 0 if levels is None else levels.num_levels)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _DecodeGraph(self, size) if levels is None else \
                _CascadeGraph(self, size, levels.num_levels)
        return graph

    def forward(self, tokens, positions, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                levels=None, rows=None) -> torch.Tensor:
        """float32 logits ``[len(rows), vocab]`` (CUDA) of one step, as
        :meth:`NumpyRunner.forward`; the index arrays are host int32 arrays."""
        n, batch = len(tokens), len(qo_indptr) - 1
        if n and self.model.fused:  # (only the fused form reads a RoPE table)
            self.model.ensure_positions(int(np.max(positions)) + 1)
        if self._rope_version != self.model.rope_version:
            # the graphs read the RoPE table they were captured with: capture them again
            self._graphs.clear()
            self._rope_version = self.model.rope_version
        if n == batch and (self.replays_decode(batch) if levels is None
                           else self.replays_cascade(batch, levels)):
            graph = self._graph(batch, levels)
            self.graph_replays += 1
            logits = graph.step(tokens, positions, kv_indptr, kv_indices, kv_last_page_len,
                                levels)
            if rows is None or np.array_equal(rows, np.arange(batch)):  # every row samples
                # the graph took their greedy tokens already (into _sampled): sample() copies
                self._presampled = logits[:batch]
                return self._presampled
            return logits[self.to_device(rows)]
        attend_step = self.attention.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                          levels)
        timing = self.timing

        def attend(layer, q, k, v):
            if timing:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
            o = attend_step(q, k, v, self.caches[layer])
            if timing:
                end.record()
                self._events.append((start, end))
            return o

        logits = self.model.forward(self.resolve(tokens), self.to_device(positions), attend,
                                    rows=None if rows is None else self.to_device(rows))
        if self._events:
            self._read_events()  # those that have finished; never waits
        return logits

    @staticmethod
    def argmax(logits: torch.Tensor) -> list:
        """Greedy token of each row of ``logits`` (one device-to-host copy)."""
        return logits.argmax(-1).tolist()

    def sample(self, logits: torch.Tensor):
        """Greedy tokens of ``logits`` kept on the device (the next step's placeholders read
        them there) and copied to pinned host memory behind an event, without waiting: the
        handle for :meth:`fetch`."""
        n = logits.shape[0]
        if logits is self._presampled:  # a replayed step's: its graph wrote them at the end
            tokens = self._sampled[:n]
        else:
            tokens = logits.argmax(-1)
            if n > self._sampled.shape[0]:  # the graphs read the old buffer: capture again
                self._sampled = torch.zeros(2 * n, dtype=torch.int64, device=self.device)
                self._graphs.clear()
            self._sampled[:n].copy_(tokens)
        self._presampled = None
        host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the stream the copy is on
        return host, done

    @staticmethod
    def fetch(handle) -> list:
        """The tokens of a :meth:`sample` handle, once its copy has landed."""
        host, done = handle
        done.synchronize()
        return host.tolist()

    def resolve(self, tokens) -> torch.Tensor:
        """The step's token ids on the device, placeholders (``-1 - j``) replaced by row ``j``
        of the last :meth:`sample` there (no host round trip)."""
        host = np.asarray(tokens, dtype=np.int64)
        ids = self.to_device(host)
        if host.size and host.min() < 0:
            ids = self.placeholders(ids)
        return ids

    def placeholders(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (device int64) with each placeholder ``-1 - j`` replaced by row ``j`` of the
        last :meth:`sample`'s tokens: device work only, which a CUDA graph captures."""
        return torch.where(ids >= 0, ids, self._sampled[(-1 - ids).clamp(min=0)])

    def to_device(self, array) -> torch.Tensor:
        """A host int array on the device (int64) without waiting for the stream: staged in
        pinned memory and copied asynchronously. (A copy from pageable memory, what
        ``torch.as_tensor(x, device=...)`` makes, synchronises the stream: the host would wait
        for the step before, and the engine's overlap would not overlap.)"""
        host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).pin_memory()
        return host.to(self.device, non_blocking=True)


class _DecodeGraph:
    """The decode step of up to ``size`` sequences, captured once and replayed every step.

    Everything a replay reads lives at fixed addresses: the token and position inputs, the
    last sampled tokens (:attr:`TorchRunner._sampled`), the decode wrapper's page-table buffers
    and plan memory (its CUDA-graph mode), the append wrapper's reserved index memory. A step
    plans both wrappers on the host, writes its tokens (placeholders included) and positions
    into a pinned staging buffer, copies that in with one transfer and replays: the graph
    itself replaces the placeholders by the sampled tokens, and ends by taking the step's
    greedy tokens into that same buffer (:meth:`TorchRunner.sample` then only copies them to
    the host). Rows past the batch are padding: one token each, on the scratch page
    ``num_pages``.

    Host work per step outside the plans: one copy, one event, the replay (it was two pinned
    allocations and transfers, the placeholders' five small kernels, two copies and two fills,
    then the argmax and its copy: each a few microseconds of the host's launch path on the
    H200).
    """

    def __init__(self, runner: TorchRunner, size: int):
        self.runner, self.size = runner, size
        dev, i32 = runner.device, torch.int32
        # every sequence may hold the whole pool (shared prefix pages repeat per sequence)
        self.max_pages = size * (runner.num_pages + 1)
        self.buffers = (torch.empty(size + 1, dtype=i32, device=dev),
                        torch.empty(self.max_pages, dtype=i32, device=dev),
                        torch.empty(size, dtype=i32, device=dev))
        self.attention = self._wrapper()
        self.append = PagedKVAppendWrapper(runner.caches[0], "NHD")
        self.append.reserve(size, size, self.max_pages)
        # row 0: the step's token ids (placeholders -1 - j), row 1: their positions
        self.inputs = torch.zeros((2, size), dtype=torch.int64, device=dev)
        # two pinned staging buffers, used in turn; each free again once its copy has run
        self._stage = [torch.zeros((2, size), dtype=torch.int64, pin_memory=True)
                       for _ in range(2)]
        self._stage_host = [t.numpy() for t in self._stage]
        self._staged = [None, None]  # the event after each buffer's last copy
        self._turn = 0
        self.rows = np.arange(size, dtype=np.int32)
        self.graph, self.logits = None, None

    def _wrapper(self):
        return BatchDecodeWithPagedKVCacheWrapper(
            self.runner.workspace, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=self.buffers[0], paged_kv_indices_buffer=self.buffers[1],
            paged_kv_last_page_len_buffer=self.buffers[2])

    def _plan(self, indptr, indices, last, levels, batch) -> None:
        """Plan the attention of the padded step (``levels``: the cascade's, unpadded)."""
        self.attention.plan(indptr, indices, last, *self.runner.heads,
                            q_data_type=self.runner.attention.dtype)

    def _forward(self, take_tokens: bool = True):
        """The step's forward pass (captured, or the warm-up before the capture, which must
        not overwrite the sampled tokens its replay's placeholders read: ``take_tokens``)."""
        runner = self.runner
        append, attention = self.append.run, self.attention.run

        def attend(layer, q, k, v):
            cache = runner.caches[layer]
            append(k, v, cache)
            return attention(q, cache)

        tokens = runner.placeholders(self.inputs[0])
        logits = runner.model.forward(tokens, self.inputs[1], attend)
        if take_tokens:
            # the greedy tokens too, where the next step's placeholders read them (the padding
            # rows' as well: no placeholder names them)
            runner._sampled[:self.size].copy_(logits.argmax(-1))
        return logits

    def step(self, tokens, positions, kv_indptr, kv_indices, kv_last_page_len,
             levels=None) -> torch.Tensor:
        """float32 logits ``[size, vocab]`` of one decode step (the first ``len(tokens)`` rows
        are the batch's)."""
        runner = self.runner
        batch, pad = len(tokens), self.size - len(tokens)
        used = int(kv_indptr[-1])
        i32 = np.int32
        if pad:
            indptr = np.concatenate([kv_indptr, used + np.arange(1, pad + 1)]).astype(i32)
            indices = np.concatenate([kv_indices[:used], np.full(pad, runner.num_pages, i32)])
            last = np.concatenate([kv_last_page_len, np.ones(pad)]).astype(i32)
        else:  # a full bucket (the engine's tables are int32 already: no copies)
            indptr, indices, last = (np.asarray(kv_indptr, i32), np.asarray(kv_indices[:used], i32),
                                     np.asarray(kv_last_page_len, i32))
        # each row appends at the last slot of its KV (what the eager path derives the same way)
        pos = ((np.diff(indptr) - 1) * runner.page_size + last - 1).astype(np.int32)
        self._plan(indptr, indices, last, levels, batch)
        self.append.plan(self.rows, pos, indices, indptr, last)
        turn, self._turn = self._turn, self._turn ^ 1
        if self._staged[turn] is None:
            self._staged[turn] = torch.cuda.Event()
        else:
            self._staged[turn].synchronize()  # its last copy has run (long since, normally)
        host = self._stage_host[turn]
        host[0, :batch] = tokens
        host[1, :batch] = positions
        host[:, batch:] = 0
        self.inputs.copy_(self._stage[turn], non_blocking=True)
        self._staged[turn].record()
        if self.graph is None:
            # warm up on a side stream (what torch asks before a capture), then capture; the
            # warm-up computed this step already and the replay below recomputes it (the
            # append writes the same values to the same slots)
            side = torch.cuda.Stream(device=runner.device)
            side.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(side):
                self._forward(take_tokens=False)
            torch.cuda.current_stream(runner.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # (a collected wrapper's Numba memory, or a collected earlier graph, freed
            # mid-capture would invalidate it: defer_frees holds both back)
            with defer_frees(), torch.cuda.graph(self.graph):
                self.logits = self._forward()
        self.graph.replay()
        return self.logits


class _CascadeGraph(_DecodeGraph):
    """A cascade decode step of up to ``size`` sequences with ``num_levels`` levels, captured
    once and replayed: the cascade wrapper's CUDA-graph mode in place of decode's. The padding
    rows are one more segment of level 0 and one segment each in every level below, each on
    the scratch page (its values are never read back)."""

    def __init__(self, runner: TorchRunner, size: int, num_levels: int):
        self.num_levels = num_levels
        super().__init__(runner, size)

    def _wrapper(self):
        dev, i32, levels = self.runner.device, torch.int32, range(self.num_levels)
        n = self.size + 1  # segments of a level: at most one per row, and the padding's
        # what TorchRunner.replays_cascade admits, and a scratch page per padding segment
        pages = self.runner.cascade_level_pages + self.size
        ptrs = [torch.empty(n + 1, dtype=i32, device=dev) for _ in levels]
        return MultiLevelCascadeAttentionWrapper(
            self.num_levels, self.runner.workspace, "NHD", True, ptrs, ptrs,
            [torch.empty(pages, dtype=i32, device=dev) for _ in levels],
            [torch.empty(n, dtype=i32, device=dev) for _ in levels])

    def _plan(self, indptr, indices, last, levels, batch) -> None:
        pad, scratch, i32 = self.size - batch, self.runner.num_pages, np.int32
        if not pad:  # a full bucket: the levels as they are (~28 NumPy calls fewer)
            self.attention.plan(*(list(lst) for lst in (
                levels.qo_indptr_arr, levels.paged_kv_indptr_arr, levels.paged_kv_indices_arr,
                levels.paged_kv_last_page_len_arr)), *self.runner.heads,
                q_data_type=self.runner.attention.dtype)
            return
        qo, kv_ptr, kv_idx, kv_last = [], [], [], []
        for lvl in range(self.num_levels):
            # the padding rows' segment ends: one segment in level 0, one per row below
            ends = np.arange(1, pad + 1) if lvl else np.array([pad] if pad else [], np.int64)
            segs = ends.size
            p = levels.paged_kv_indptr_arr[lvl]
            qo.append(np.concatenate([levels.qo_indptr_arr[lvl], batch + ends]).astype(i32))
            kv_ptr.append(np.concatenate([p, p[-1] + np.arange(1, segs + 1)]).astype(i32))
            kv_idx.append(np.concatenate([levels.paged_kv_indices_arr[lvl][:p[-1]],
                                          np.full(segs, scratch)]).astype(i32))
            kv_last.append(np.concatenate([levels.paged_kv_last_page_len_arr[lvl],
                                           np.ones(segs)]).astype(i32))
        self.attention.plan(qo, kv_ptr, kv_idx, kv_last, *self.runner.heads,
                            q_data_type=self.runner.attention.dtype)
