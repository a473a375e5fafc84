"""An attention kernel bound to a plan: what plan() prepares and run() fires.

:class:`AttentionLaunch` owns one :class:`~nbinfer.kernels.launch.PreparedLaunch` of a persistent
attention kernel (decode, or either prefill kernel) whose plan, counters and page-table
arguments point into the wrapper's own :class:`PlanMemory` and whose partial-state arguments
point into the caller's float workspace, at the offsets of one
:class:`~nbinfer.api.workspace.WorkspaceLayout`. ``upload`` copies a staged plan there on the
caller's stream (one transfer per step); ``run()`` then only binds q, the KV, their strides and
the outputs. The grid never depends on the batch, so a CUDA graph that captured one launch
replays correctly after any later ``upload`` into the same layout.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import numpy as np

from ..kernels.common import ARG, DECODE_PLAN_SECTIONS
from ..kernels.decode import NUM_THREADS, build_decode_kernel, decode_signature
from ..kernels.launch import PreparedLaunch, _driver, check
from . import arrays, binding
from .workspace import WorkspaceLayout

__all__ = ["ARG", "AttentionLaunch", "PlanMemory", "TableReader", "defer_frees"]

STRIDE_ARGS = ("page_stride", "kv_stride_n", "kv_stride_h", "q_stride_n", "q_stride_h")


# defer_frees' hold on the cyclic collector: the collector is process-wide, so nested and
# concurrent blocks share one count; the first to enter switches it off, the last to leave
# switches it back on if it was on.
_COLLECTOR = {"depth": 0, "was_on": False}
_COLLECTOR_LOCK = threading.Lock()


@contextlib.contextmanager
def defer_frees():
    """Hold back, while inside, Numba's queued frees and Python's cyclic collector, either of
    which can break a CUDA-graph capture at a moment nobody chooses.

    A capture (``cudaStreamCaptureModeGlobal``, torch's default) is invalidated by any call
    it forbids made meanwhile, such as a ``cuMemFree``; the next launch then returns 901
    (``CUDA_ERROR_STREAM_CAPTURE_INVALIDATED``). Two things make such calls on their own
    schedule:

    - Numba queues the frees of collected device and pinned host arrays (a wrapper's plan
      memory and staging buffers) and flushes the queue once it holds more than a few entries;
      held back here by Numba's ``defer_cleanup``, they run at its next flush after this;
    - Python's cyclic collector runs when allocations pass its threshold and frees whatever
      cyclic garbage it finds, such as the CUDA graphs and events of an engine dropped long
      before, whose destructors free graphs and memory. It is switched off while inside, so
      that garbage waits for the next collection after the block. Measured: a generation-1
      collection of 2570 objects, torch CUDA graphs and events among them, at the first
      launch of an engine's decode capture invalidated it, in 1 of 3 runs of the engine's gpu
      tests (bench/NOTES.md, session 32).

    What this cannot hold back is a destructor run by a plain reference drop inside the block
    (the last reference to a CUDA graph or event let go there) or an explicit ``gc.collect()``:
    inside a capture, do neither. Nestable, and across threads (the collector is switched off
    while any thread is inside); in the simulator only the collector is switched off.

    Examples
    --------
    >>> with nbinfer.defer_frees(), torch.cuda.graph(graph):  # doctest: +SKIP
    ...     out = wrapper.run(q, kv_cache)
    """
    from numba import cuda

    with _COLLECTOR_LOCK:
        if _COLLECTOR["depth"] == 0:
            _COLLECTOR["was_on"] = gc.isenabled()
            gc.disable()
        _COLLECTOR["depth"] += 1
    try:
        with cuda.defer_cleanup():
            yield
    finally:
        with _COLLECTOR_LOCK:
            _COLLECTOR["depth"] -= 1
            if _COLLECTOR["depth"] == 0 and _COLLECTOR["was_on"]:
                gc.enable()


class TableReader:
    """Reads plan()'s page table back to the host when it is given as CUDA int32 tensors.

    The three tensors are copied asynchronously on the caller's stream into one pinned buffer
    (reused from step to step), then the stream is waited for once; torch's ``.cpu()`` would
    allocate, copy and wait per tensor. plan() needs the values on the host (so does
    FlashInfer's), so one wait is the floor. The returned views are valid until the next read:
    plan() snapshots what it keeps.
    """

    def __init__(self):
        self._buf = None
        self._address = 0

    @staticmethod
    def accepts(tensors, device_index: int | None) -> bool:
        """Whether every one of ``tensors`` is a 1-D contiguous int32 torch tensor on CUDA
        device ``device_index`` (the workspace's: its stream orders the copies); anything else
        goes through the general path, which names what is wrong."""
        if device_index is None:
            return False
        for t in tensors:
            if not (type(t).__module__.startswith("torch") and t.is_cuda and t.dim() == 1
                    and str(t.dtype) == "torch.int32" and t.is_contiguous()
                    and t.get_device() == device_index):
                return False
        return True

    def read(self, tensors, stream: int) -> tuple[np.ndarray, ...]:
        """Host int32 copies of ``tensors`` (as :meth:`accepts` requires), 1-D."""
        sizes = [t.numel() for t in tensors]
        starts = np.cumsum([0] + [-(-n // 4) * 4 for n in sizes]).tolist()
        if self._buf is None or self._buf.size < starts[-1]:
            from numba import cuda

            self._buf = cuda.pinned_array(max(2 * starts[-1], 4096), dtype=np.int32)
            self._address = self._buf.ctypes.data
        drv = _driver()
        for t, n, start in zip(tensors, sizes, starts, strict=False):
            if n:
                check(drv.memcpy_dtoh_async(self._address + 4 * start, t.data_ptr(), 4 * n,
                                            stream), "cuMemcpyDtoHAsync")
        check(drv.stream_synchronize(stream), "cuStreamSynchronize")
        return tuple(self._buf[start:start + n] for n, start in zip(sizes, starts, strict=False))


class PlanMemory:
    """A wrapper's own int32 memory for its plans (device memory; NumPy in the simulator).

    Grows when a plan needs more words; a CUDA-graph wrapper sizes it once for its fixed layout,
    so the captured kernel's pointers stay valid. ``generation`` counts the buffers it has had:
    a launch bound to an older one rebinds.
    """

    def __init__(self, backend: str):
        self.backend = backend
        self._buf = None
        self.address = 0
        self.generation = 0
        self._staging = self._last_view = None
        self.staging_address = 0
        self.event = None  # recorded after each upload; the staging buffer is free once it fires

    def staging(self, words: int) -> np.ndarray:
        """A host int32 buffer of ``words`` to stage the next upload in (pinned memory on the
        GPU), free to write: the previous upload out of it has finished."""
        if self.backend == "cuda":
            drv = _driver()
            if self.event is None:
                self.event = drv.event()
            else:
                check(drv.event_synchronize(self.event), "cuEventSynchronize")
        if self._staging is None or self._staging.size < words:
            if self.backend == "sim":
                self._staging = np.zeros(max(words, 64), dtype=np.int32)
            else:
                from numba import cuda

                self._staging = cuda.pinned_array(max(2 * words, 1024), dtype=np.int32)
            self.staging_address = self._staging.ctypes.data
        self._last_view = self._staging[:words]
        return self._last_view

    def is_staged(self, words: np.ndarray) -> bool:
        """Whether ``words`` is the buffer :meth:`staging` last returned (filled in place):
        a view of the staging buffer from its first word."""
        if words is self._last_view:  # (the common case: no ``ndarray.ctypes`` object built)
            return True
        return (words.base is not None and words.base is self._staging
                and words.ctypes.data == self.staging_address)

    def __del__(self):
        if self.event is not None:
            try:
                _driver().event_destroy(self.event)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass

    def reserve(self, words: int) -> None:
        """Make room for ``words`` (a new, larger buffer when needed; ``generation`` counts)."""
        if self._buf is None or self._buf.size < words:
            self.get(words)

    def get(self, words: int):
        """The first ``words`` of the buffer (grown when needed). On the GPU a view costs tens
        of us of Numba bookkeeping: the launch path uses ``address`` and :meth:`reserve`."""
        if self._buf is None or self._buf.size < words:
            n = max(int(words), 4)
            if self.backend == "sim":
                self._buf = np.zeros(n, dtype=np.int32)
            else:
                from numba import cuda

                self._buf = cuda.device_array(n, dtype=np.int32)
                self.address = self._buf.__cuda_array_interface__["data"][0]
            self.generation += 1
        return self._buf[:words]


class AttentionLaunch:
    """A launch whose plan-side arguments live in ``memory`` and ``workspace`` at ``layout``.

    Built once per kernel and rebound (:meth:`bind`) to each step's layout, which on the GPU is
    a few pointer and offset writes into the prepared argument block.

    Parameters
    ----------
    spec : DecodeSpec or PrefillSpec
    workspace : the caller's float workspace buffer (any array kind; NumPy in the simulator)
    layout : WorkspaceLayout
    backend : {"cuda", "sim"}
    num_ctas : int
        The fixed grid.
    sm_scale : float
    memory : PlanMemory
        The wrapper's own plan memory.
    page_table_buffers : tuple of 3 device arrays, optional
        Caller-owned ``(indptr, indices, last_page_len)`` buffers (CUDA-graph mode); by default
        the page table is copied into the plan memory with the plan.
    kernel : ``(compiled, signature, plan sections)``, optional
        Default: the decode kernel of ``spec``.
    before, after : sequences of ``(compiled kernel, grid or None)``, optional
        Kernels of the same signature launched, in order, before and after it on the same
        arguments (and on its grid where ``None``): the tensor-core prefill's value scan (its own
        grid), guarded twin (this grid) and deferred merge of split rows (its own grid). An
        entry of ``after`` may add a third field, ``True`` for a programmatic dependent launch
        (:mod:`nbinfer.kernels.dependent`: the merge, with ``PREFILL_PDL``).
    """

    def __init__(self, spec, workspace, layout: WorkspaceLayout, backend: str, num_ctas: int,
                 sm_scale: float, memory: PlanMemory, page_table_buffers=None, *, kernel=None,
                 num_threads: int = NUM_THREADS, before=(), after=()):
        self.backend, self.memory = backend, memory
        self.last_layout = None  # the layout of the last step planned for it (decode's guess)
        compiled, signature, self._sections = kernel or (
            build_decode_kernel(spec), decode_signature(spec), DECODE_PLAN_SECTIONS)
        self.launch = PreparedLaunch(compiled, signature, num_ctas, num_threads,
                                     sim=backend == "sim")
        self._f32 = binding.workspace_f32(workspace, backend)
        cai = getattr(self._f32, "__cuda_array_interface__", None)
        self._f32_addr = cai["data"][0] if cai is not None else self._f32.ctypes.data
        if self._f32_addr % 16:
            # The prefill kernels' fused merge copies partial states 16 bytes at a time.
            raise ValueError(f"float_workspace_buffer must start at a 16-byte aligned address, "
                             f"got one {self._f32_addr % 16} bytes past it")
        self.page_table_buffers = page_table_buffers
        self._table_ptrs = None
        if page_table_buffers is not None:
            for name, buf in zip(("kv_indptr", "kv_indices", "kv_last_page_len"),
                                 page_table_buffers, strict=True):
                binding.bind(self.launch, ARG[name], buf, backend)
            if backend == "cuda" and all(arrays.on_device(b) for b in page_table_buffers):
                self._table_ptrs = tuple(arrays.device_pointer(b)[0] for b in page_table_buffers)
        self._bound = None
        self._strides = None
        self._sm_scale = self._scales = None
        self.unit_scales = False  # the kernel's scales are the plan's own (run() checks this)
        self.fast = None  # run()'s fast path for torch tensors (the wrapper attaches it)
        self.bind(layout, sm_scale)
        self._before = tuple(self.launch.sharing(k, grid) for k, grid in before)
        self._after = tuple(self.launch.sharing(*entry) for entry in after)

    def bind(self, layout: WorkspaceLayout, sm_scale: float) -> None:
        """Point the plan-side arguments at ``layout``'s sections (a no-op when they already
        are): plan memory, page-table sections, partial states, the section offsets."""
        w = layout.words
        self.memory.reserve(w["end"])
        key = (layout, sm_scale, self.memory.generation)
        if key == self._bound:
            return
        ints = self.memory.get(w["end"])
        if self._f32.size * 4 < layout.nbytes:
            raise ValueError(f"float_workspace_buffer holds {self._f32.size * 4} bytes, this "
                             f"plan needs {layout.nbytes}")
        self.layout, self.ints = layout, ints
        L = self.launch
        sizes = {"plan": w["end"], "counters": w["kv_indptr"] - w["counters"]}
        if self.page_table_buffers is None:
            sizes.update(kv_indptr=layout.max_batch + 1, kv_indices=layout.max_pages,
                         kv_last_page_len=layout.max_batch)
        o_off, s_off = layout.float_offsets()
        o_n, s_n = layout.partial_elems
        if self.backend == "cuda":
            base = self.memory.address
            for name, n in sizes.items():
                L.set_pointer(ARG[name], base + 4 * (0 if name == "plan" else w[name]), max(1, n))
            L.set_pointer(ARG["tmp_o"], self._f32_addr + 4 * o_off, max(o_n, 1))
            L.set_pointer(ARG["tmp_lse"], self._f32_addr + 4 * s_off, max(s_n, 1))
        else:
            for name, n in sizes.items():
                start = 0 if name == "plan" else w[name]
                L.set_array(ARG[name], ints[start:start + max(1, n)])
            L.set_array(ARG["tmp_o"], self._f32[o_off:o_off + max(o_n, 1)])
            L.set_array(ARG["tmp_lse"], self._f32[s_off:s_off + max(s_n, 1)])
        L.set_scalar(ARG["num_kv_heads"], layout.num_kv_heads)
        self._sm_scale, self._scales = sm_scale, None
        self.scale(1.0, 1.0)
        offsets = layout.plan_offsets
        first = len(ARG)
        for i, name in enumerate(self._sections):
            L.set_scalar(first + i, offsets[name] if name in offsets else w[name])
        self._bound = key

    def scale(self, qk_scale: float, v_scale: float) -> None:
        """This call's scales (:func:`nbinfer._checks.check_scales`): the kernel's ``sm_scale``
        becomes the planned one times ``qk_scale`` (``q_scale * k_scale``) and its ``v_scale``
        ``v_scale``; written only when they change. A captured CUDA graph keeps the values of
        its capture (kernel arguments are copied into the graph)."""
        if (qk_scale, v_scale) != self._scales:
            self.launch.set_scalar(ARG["sm_scale"], self._sm_scale * qk_scale)
            self.launch.set_scalar(ARG["v_scale"], v_scale)
            self._scales = (qk_scale, v_scale)
            self.unit_scales = qk_scale == 1.0 and v_scale == 1.0

    def set_strides(self, page_stride: int, kv_stride_n: int, kv_stride_h: int,
                    q_stride_n: int, q_stride_h: int) -> None:
        """The element strides of this call's KV and q (patched only when they change)."""
        st = (page_stride, kv_stride_n, kv_stride_h, q_stride_n, q_stride_h)
        if st != self._strides:
            for name, value in zip(STRIDE_ARGS, st, strict=True):
                self.launch.set_scalar(ARG[name], value)
            self._strides = st

    def staging(self, words: int) -> np.ndarray:
        """Where to stage the next plan (:meth:`PlanMemory.staging`)."""
        return self.memory.staging(words)

    def upload(self, staged: np.ndarray, page_table, stream: int) -> None:
        """Copy the staged int32 words (and, in graph mode, the page table into the caller's
        buffers) to the device, ordered on ``stream`` after the work already queued there."""
        # With the caller's page-table buffers (CUDA-graph mode) the layout's own table
        # sections are never read: they are sized for the buffers' capacity (a graph bucket of
        # 64 over a 5000-page pool: 331k words, 1.3 MB) and are not copied, only the words
        # before and after them.
        if self.page_table_buffers is None:
            skip = (staged.size, staged.size)
        else:
            w = self.layout.words
            skip = (w["kv_indptr"], w["qo_indptr"])
        if self.backend == "sim":
            self.ints[:skip[0]] = staged[:skip[0]]
            if skip[1] < staged.size:
                self.ints[skip[1]:staged.size] = staged[skip[1]:]
            if self.page_table_buffers is not None:
                for buf, host in zip(self.page_table_buffers, page_table, strict=True):
                    arrays.to_kernel(buf, "sim")[: host.size] = host
            return
        tables = () if self.page_table_buffers is None else page_table
        extra = sum(t.size for t in tables) if self._table_ptrs is not None else 0
        if extra == 0 and self.memory.is_staged(staged):
            buf = staged  # packed in place after staging() waited for the previous upload
        else:
            buf = self.staging(staged.size + extra)
            buf[: staged.size] = staged
        drv = _driver()
        ptr = self.memory.staging_address
        for a, b in ((0, skip[0]), (skip[1], staged.size)):
            if b > a:
                check(drv.memcpy_htod_async(self.memory.address + 4 * a, ptr + 4 * a,
                                            4 * (b - a), stream), "cuMemcpyHtoDAsync")
        if self._table_ptrs is not None:
            pos = staged.size
            for dst, host in zip(self._table_ptrs, tables, strict=True):
                buf[pos:pos + host.size] = host
                check(drv.memcpy_htod_async(dst, ptr + 4 * pos, 4 * host.size, stream),
                      "cuMemcpyHtoDAsync")
                pos += host.size
        elif tables:
            from numba import cuda

            s = cuda.external_stream(stream) if stream else cuda.default_stream()
            for dst, host in zip(self.page_table_buffers, tables, strict=True):
                dev = arrays.to_kernel(dst, "cuda")
                dev[: host.size].copy_to_device(np.ascontiguousarray(host, dtype=np.int32),
                                                stream=s)
        check(drv.event_record(self.memory.event, stream), "cuEventRecord")

    def __call__(self, stream: int) -> None:
        """Launch the kernel (and the kernels around it) on ``stream``."""
        for twin in self._before:
            twin(stream)
        self.launch(stream)
        for twin in self._after:
            twin(stream)
