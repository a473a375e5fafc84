"""The decode kernel bound to a workspace: what plan() prepares and run() fires.

:class:`DecodeLaunch` owns one :class:`~nbinfer.kernels.launch.PreparedLaunch` of the persistent
decode kernel whose plan, counters, page table and partial-state arguments point into fixed
sections of the caller's workspace (:class:`~nbinfer.api.workspace.WorkspaceLayout`). ``upload``
copies a staged plan there on the caller's stream (one transfer per step); ``run()`` then only
binds q, the cache and the outputs. The grid never depends on the batch, so a CUDA graph that
captured one launch replays correctly after any later ``upload`` into the same layout.
"""

from __future__ import annotations

import numpy as np

from ..kernels.decode import (
    NUM_THREADS,
    PLAN_OFFSETS,
    build_decode_kernel,
    decode_signature,
)
from ..kernels.launch import PreparedLaunch
from . import arrays, binding
from .workspace import WorkspaceLayout

__all__ = ["DecodeLaunch", "ARG"]

# Argument positions of the decode kernel (see nbinfer.kernels.decode.build_decode_kernel).
ARG = dict(q=0, k=1, v=2, kv_indptr=3, kv_indices=4, kv_last_page_len=5, plan=6, o=7, lse=8,
           tmp_o=9, tmp_lse=10, counters=11, num_kv_heads=12, page_stride=13, head_stride=14,
           sm_scale=15, offsets=16)


class DecodeLaunch:
    """A decode launch whose plan-side arguments live in ``workspace`` at ``layout``'s offsets.

    Parameters
    ----------
    spec : DecodeSpec
    workspace : the caller's workspace buffer (any array kind; NumPy in the simulator)
    layout : WorkspaceLayout
    backend : {"cuda", "sim"}
    num_ctas : int
        The fixed grid.
    sm_scale : float
    page_table_buffers : tuple of 3 device arrays, optional
        Caller-owned ``(indptr, indices, last_page_len)`` buffers (CUDA-graph mode); by default
        the page table is copied into the workspace with the plan.
    """

    def __init__(self, spec, workspace, layout: WorkspaceLayout, backend: str, num_ctas: int,
                 sm_scale: float, page_table_buffers=None, *, kernel=None,
                 num_threads: int = NUM_THREADS):
        self.backend, self.layout = backend, layout
        sim = backend == "sim"
        # The decode kernel by default; the prefill kernel shares the leading arguments and
        # reads three more plan sections (``kernel = (compiled, signature, offset names)``).
        compiled, signature, offset_names = kernel or (build_decode_kernel(spec),
                                                       decode_signature(spec), PLAN_OFFSETS)
        self.launch = PreparedLaunch(compiled, signature, num_ctas, num_threads, sim=sim)
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
        self.ints = f32[: w["end"]].view(np.int32)
        L = self.launch
        L.set_array(ARG["plan"], self.ints)
        L.set_array(ARG["counters"], self.ints[w["counters"]:w["kv_indptr"]])
        self.page_table_buffers = page_table_buffers
        if page_table_buffers is None:
            for name in ("kv_indptr", "kv_indices", "kv_last_page_len"):
                L.set_array(ARG[name], self.ints[w[name]:w[name] + max(1, _section(layout, name))])
        else:
            for name, buf in zip(("kv_indptr", "kv_indices", "kv_last_page_len"),
                                 page_table_buffers, strict=True):
                binding.bind(L, ARG[name], buf, backend)
        o_off, s_off = layout.float_offsets()
        o_n, s_n = layout.partial_elems
        L.set_array(ARG["tmp_o"], f32[o_off:o_off + max(o_n, 1)])
        L.set_array(ARG["tmp_lse"], f32[s_off:s_off + max(s_n, 1)])
        L.set_scalar(ARG["num_kv_heads"], layout.num_kv_heads)
        L.set_scalar(ARG["head_stride"], 0)
        L.set_scalar(ARG["sm_scale"], sm_scale)
        offsets = layout.plan.offsets()
        for i, name in enumerate(offset_names):
            L.set_scalar(ARG["offsets"] + i, offsets[name] if name in offsets else w[name])
        self._event = None
        self._staging = None

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
        self.launch(stream)


def _section(layout: WorkspaceLayout, name: str) -> int:
    return {"kv_indptr": layout.max_batch + 1, "kv_indices": layout.max_pages,
            "kv_last_page_len": layout.max_batch}[name]
