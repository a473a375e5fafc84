"""Binding caller arrays to prepared launches: outputs, pointers, workspace, device checks.

Shared by the plan/run wrappers. Arrays of every kind arrive here; on the GPU, device arrays are
bound by address (no conversion), host arrays are copied; in the simulator everything is NumPy.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_dim, check_indptr, check_ndim, check_range
from . import arrays


def output(given, name, kind, template, shape, dtype, backend):
    """``(user_array, kernel_array)`` for an output: the caller's array, checked, or a new one."""
    if given is None:
        if backend == "cuda" and arrays.on_device(template) and kind != "numba":
            if kind == "torch":
                import torch

                tdt = getattr(torch, dtype)
                t = torch.empty(shape, dtype=tdt, device=template.device)
            else:
                import cupy

                t = cupy.empty(shape, dtype=dtype)
            return t, t
        return arrays.empty_like_kind(kind, template, shape, dtype, backend)
    check_ndim(name, given, len(shape))
    for axis, n in enumerate(shape):
        check_dim(name, given, axis, n, "expected")
    if arrays.storage_dtype(given) != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {arrays.storage_dtype(given)}")
    if backend == "cuda" and arrays.on_device(given):
        return given, given
    return given, arrays.to_kernel(given, backend)


def bind(launch, i, x, backend, offset: int = 0):
    """Bind array argument ``i`` to ``x`` (any kind), starting ``offset`` elements in."""
    if backend == "cuda" and arrays.on_device(x):
        ptr, n, itemsize = arrays.device_pointer(x)
        if i in (1, 2) and (ptr + offset * itemsize) % 16:
            raise ValueError("the KV cache must start at a 16-byte aligned address (cp.async)")
        launch.set_pointer(i, ptr + offset * itemsize, n - offset)
        return
    flat = x if getattr(x, "ndim", 1) == 1 and arrays.array_kind(x) != "torch" else \
        arrays.to_kernel(x, backend)
    launch.set_array(i, flat[offset:] if offset else flat)


def nbytes(buf) -> int:
    kind = arrays.array_kind(buf)
    if kind == "torch":
        return buf.numel() * buf.element_size()
    return int(np.prod(buf.shape)) * np.dtype(buf.dtype).itemsize


def workspace_f32(buf, backend):
    flat = arrays.to_kernel(buf, backend)
    n = (flat.size * flat.dtype.itemsize) // 4
    byte_view = flat.view(np.uint8) if flat.dtype != np.uint8 else flat
    return byte_view[: n * 4].view(np.float32)


def same_device(**named):
    devices = {k: arrays.device_of(v) for k, v in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"arrays are on different devices: {devices}")


def page_table(indptr, indices, last_page_len, page_size: int,
               names=("indptr", "indices", "last_page_len")):
    """A FlashInfer page table (arrays of any kind) checked on the host: int32 ``indptr``,
    ``indices``, ``last_page_len`` and the int64 KV length of every request. ``names`` are the
    caller's argument names, used in the errors."""
    n_ptr, n_idx, n_last = names
    indptr = check_indptr(n_ptr, arrays.host_int32(indptr, n_ptr))
    indices = arrays.host_int32(indices, n_idx)
    if indices.size != indptr[-1]:
        raise ValueError(f"{n_idx} must have length {n_ptr}[-1]={indptr[-1]}, got {indices.size}")
    check_range(n_idx, indices, 0, np.iinfo(np.int32).max)
    last = arrays.host_int32(last_page_len, n_last)
    if last.shape != (indptr.size - 1,):
        raise ValueError(f"{n_last} must have shape ({indptr.size - 1},), got {last.shape}")
    pages = np.diff(indptr)
    check_range(n_last, last[pages > 0], 1, page_size + 1)
    kv_lens = np.where(pages > 0, (pages - 1) * page_size + last, 0).astype(np.int64)
    return indptr, indices, last, kv_lens


def workspace_like(template, nbytes: int, backend: str):
    """A new workspace of ``nbytes`` on the device (and of the kind) of ``template``."""
    kind = arrays.array_kind(template)
    if backend == "cuda" and kind == "torch" and template.is_cuda:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=template.device)
    if backend == "cuda" and kind == "cupy":
        import cupy

        return cupy.empty(nbytes, dtype=np.uint8)
    if backend == "cuda":
        from numba import cuda

        return cuda.device_array(nbytes, dtype=np.uint8)
    return np.zeros(nbytes, dtype=np.uint8)


__all__ = ["bind", "nbytes", "output", "page_table", "same_device", "workspace_f32",
           "workspace_like"]
