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

import numpy as np

from ..kernels.common import ARG, DECODE_PLAN_SECTIONS
from ..kernels.decode import NUM_THREADS, build_decode_kernel, decode_signature
from ..kernels.launch import PreparedLaunch
from . import arrays, binding
from .workspace import WorkspaceLayout

__all__ = ["ARG", "AttentionLaunch", "PlanMemory"]

STRIDE_ARGS = ("page_stride", "kv_stride_n", "kv_stride_h", "q_stride_n", "q_stride_h")


class PlanMemory:
    """A wrapper's own int32 memory for its plans (device memory; NumPy in the simulator).

    Grows when a plan needs more words; a CUDA-graph wrapper sizes it once for its fixed layout,
    so the captured kernel's pointers stay valid.
    """

    def __init__(self, backend: str):
        self.backend = backend
        self._buf = None

    def get(self, words: int):
        if self._buf is None or self._buf.size < words:
            n = max(int(words), 4)
            if self.backend == "sim":
                self._buf = np.zeros(n, dtype=np.int32)
            else:
                from numba import cuda

                self._buf = cuda.device_array(n, dtype=np.int32)
        return self._buf[:words]


class AttentionLaunch:
    """A launch whose plan-side arguments live in ``memory`` and ``workspace`` at ``layout``.

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
        arguments (and on its grid where ``None``): the tensor-core prefill's value scan and
        guarded twin.
    """

    def __init__(self, spec, workspace, layout: WorkspaceLayout, backend: str, num_ctas: int,
                 sm_scale: float, memory: PlanMemory, page_table_buffers=None, *, kernel=None,
                 num_threads: int = NUM_THREADS, before=(), after=()):
        self.backend, self.layout = backend, layout
        compiled, signature, sections = kernel or (build_decode_kernel(spec),
                                                   decode_signature(spec), DECODE_PLAN_SECTIONS)
        self.launch = PreparedLaunch(compiled, signature, num_ctas, num_threads,
                                     sim=backend == "sim")
        f32 = binding.workspace_f32(workspace, backend)
        cai = getattr(f32, "__cuda_array_interface__", None)
        addr = cai["data"][0] if cai is not None else f32.ctypes.data
        if addr % 16:
            # The prefill kernels' fused merge copies partial states 16 bytes at a time.
            raise ValueError(f"float_workspace_buffer must start at a 16-byte aligned address, "
                             f"got one {addr % 16} bytes past it")
        if f32.size * 4 < layout.nbytes:
            raise ValueError(f"float_workspace_buffer holds {f32.size * 4} bytes, this plan "
                             f"needs {layout.nbytes}")
        w = layout.words
        self.ints = memory.get(w["end"])
        L = self.launch
        L.set_array(ARG["plan"], self.ints)
        L.set_array(ARG["counters"], self.ints[w["counters"]:w["kv_indptr"]])
        self.page_table_buffers = page_table_buffers
        if page_table_buffers is None:
            sizes = {"kv_indptr": layout.max_batch + 1, "kv_indices": layout.max_pages,
                     "kv_last_page_len": layout.max_batch}
            for name, n in sizes.items():
                L.set_array(ARG[name], self.ints[w[name]:w[name] + max(1, n)])
        else:
            for name, buf in zip(("kv_indptr", "kv_indices", "kv_last_page_len"),
                                 page_table_buffers, strict=True):
                binding.bind(L, ARG[name], buf, backend)
        o_off, s_off = layout.float_offsets()
        o_n, s_n = layout.partial_elems
        L.set_array(ARG["tmp_o"], f32[o_off:o_off + max(o_n, 1)])
        L.set_array(ARG["tmp_lse"], f32[s_off:s_off + max(s_n, 1)])
        L.set_scalar(ARG["num_kv_heads"], layout.num_kv_heads)
        L.set_scalar(ARG["sm_scale"], sm_scale)
        offsets = layout.plan.offsets()
        first = len(ARG)
        for i, name in enumerate(sections):
            L.set_scalar(first + i, offsets[name] if name in offsets else w[name])
        self._strides = None
        self._event = None
        self._staging = None
        self._before = tuple(L.sharing(k, grid) for k, grid in before)
        self._after = tuple(L.sharing(k, grid) for k, grid in after)

    def set_strides(self, page_stride: int, kv_stride_n: int, kv_stride_h: int,
                    q_stride_n: int, q_stride_h: int) -> None:
        """The element strides of this call's KV and q (patched only when they change)."""
        st = (page_stride, kv_stride_n, kv_stride_h, q_stride_n, q_stride_h)
        if st != self._strides:
            for name, value in zip(STRIDE_ARGS, st, strict=True):
                self.launch.set_scalar(ARG[name], value)
            self._strides = st

    def upload(self, staged: np.ndarray, page_table, stream: int) -> None:
        """Copy the staged int32 words (and, in graph mode, the page table into the caller's
        buffers) to the device, ordered on ``stream`` after the work already queued there."""
        if self.backend == "sim":
            self.ints[: staged.size] = staged
            if self.page_table_buffers is not None:
                for buf, host in zip(self.page_table_buffers, page_table, strict=True):
                    arrays.to_kernel(buf, "sim")[: host.size] = host
            return
        from numba import cuda

        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has left the staging buffer
        if self._staging is None or self._staging.size < staged.size:
            self._staging = cuda.pinned_array(staged.size, dtype=np.int32)
        self._staging[: staged.size] = staged
        s = cuda.external_stream(stream) if stream else cuda.default_stream()
        self.ints[: staged.size].copy_to_device(self._staging[: staged.size], stream=s)
        if self.page_table_buffers is not None:
            for buf, host in zip(self.page_table_buffers, page_table, strict=True):
                dev = arrays.to_kernel(buf, "cuda")
                dev[: host.size].copy_to_device(np.ascontiguousarray(host, dtype=np.int32), stream=s)
        self._event = cuda.event(timing=False)
        self._event.record(s)

    def __call__(self, stream: int) -> None:
        """Launch the kernel (and the kernels around it) on ``stream``."""
        for twin in self._before:
            twin(stream)
        self.launch(stream)
        for twin in self._after:
            twin(stream)
