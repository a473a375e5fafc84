"""Binding caller arrays to prepared launches: outputs, pointers, workspace, device checks.

Shared by the plan/run wrappers. Arrays of every kind arrive here; on the GPU, device arrays are
bound by address (no conversion), host arrays are copied; in the simulator everything is NumPy.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_dim, check_ndim
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


__all__ = ["bind", "nbytes", "output", "same_device", "workspace_f32"]
