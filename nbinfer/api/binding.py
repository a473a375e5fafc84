"""Binding caller arrays to prepared launches: outputs, strided inputs, workspace, device checks.

Shared by the plan/run wrappers. Arrays of every kind arrive here; on the GPU, device arrays are
bound by address (no conversion, strides passed to the kernel), host arrays are copied; in the
simulator everything is NumPy.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_dim, check_ndim
from . import arrays


def output(given, name, kind, template, shape, dtype, backend):
    """``(user_array, kernel_array)`` for an output: the caller's array, checked, or a new one.

    A given ``out``/``lse`` must have exactly ``shape`` and ``dtype``, live where ``template``
    (q) lives, be writable and C-contiguous: the kernels write it in place, never a copy.
    """
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
    check_output(name, given, template, shape, dtype)
    if backend == "cuda" and arrays.on_device(given):
        return given, given
    return given, arrays.to_kernel(given, backend)


def check_output(name, given, template, shape, dtype) -> None:
    """The rules of a caller-provided output buffer (see :func:`output`)."""
    if arrays.array_kind(given, name) != arrays.array_kind(template):
        raise TypeError(f"{name} must be of q's kind ({arrays.array_kind(template)}), got "
                        f"{arrays.array_kind(given)}")
    check_ndim(name, given, len(shape))
    for axis, n in enumerate(shape):
        check_dim(name, given, axis, n, "expected")
    if arrays.dtype_name(given) != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {arrays.dtype_name(given)}")
    if arrays.device_of(given) != arrays.device_of(template):
        raise ValueError(f"{name} must be on q's device {arrays.device_of(template)}, got "
                         f"{arrays.device_of(given)}")
    if isinstance(given, np.ndarray) and not given.flags.writeable:
        raise ValueError(f"{name} must be writable (the result is written into it)")
    if not arrays.is_contiguous(given):
        raise ValueError(f"{name} must be C-contiguous (the kernels write it in place), got "
                         f"strides {arrays.element_strides(given)} (elements) for shape "
                         f"{tuple(given.shape)}")


def bind(launch, i, x, backend):
    """Bind array argument ``i`` to the contiguous array ``x`` (outputs, flat buffers)."""
    if backend == "cuda" and arrays.on_device(x):
        ptr, n, _ = arrays.device_pointer(x)
        launch.set_pointer(i, ptr, n)
        return
    flat = x if getattr(x, "ndim", 1) == 1 and arrays.array_kind(x) != "torch" else \
        arrays.to_kernel(x, backend)
    launch.set_array(i, flat)


def bind_view(launch, i, x, backend, name, *, align: int = 1) -> tuple[int, ...]:
    """Bind array argument ``i`` to ``x``, which may be a strided view (contiguous last
    dimension); return the element strides the kernel must use. ``align``: the byte alignment
    the kernel needs of the start and of every stride (16 for cp.async)."""
    view, st = arrays.kernel_view(x, backend, name)
    if isinstance(view, tuple):
        ptr, n = view
        itemsize = _itemsize(x)
        if align > 1 and ptr % align:
            raise ValueError(f"{name} must start at a {align}-byte aligned address (cp.async), "
                             f"got one {ptr % align} bytes past it")
        launch.set_pointer(i, ptr, n)
    else:
        itemsize = view.dtype.itemsize
        launch.set_array(i, view)
    if align > 1:
        bad = [s for s, n in zip(st[:-1], x.shape[:-1], strict=True) if n > 1 and s * itemsize % align]
        if bad:
            raise ValueError(f"{name} strides must be multiples of {align} bytes (cp.async), got "
                             f"strides {st} (elements of {itemsize} bytes)")
    return st


def bind_kv(launch, k, v, backend, names) -> tuple[int, ...]:
    """Bind the K and V views (16-byte aligned, for cp.async) and require the same strides of
    both (the kernels take one set); return them. ``names``: the caller's argument names."""
    from ..kernels.common import ARG

    sk = bind_view(launch, ARG["k"], k, backend, names[0], align=16)
    sv = bind_view(launch, ARG["v"], v, backend, names[1], align=16)
    if _used(sk, k.shape) != _used(sv, v.shape):
        raise ValueError(f"{names[1]} must have the same strides as {names[0]}: got {sv} and "
                         f"{sk} (elements)")
    return sk


def _used(strides, shape):
    """Strides of the dimensions that have more than one element (the others are never used)."""
    return tuple(s for s, n in zip(strides, shape, strict=True) if n > 1)


def _itemsize(x) -> int:
    kind = arrays.array_kind(x)
    return x.element_size() if kind == "torch" else np.dtype(x.dtype).itemsize


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


def check_workspace(buf, backend: str):
    """``float_workspace_buffer``: an array of any kind, C-contiguous, where the kernels run."""
    kind = arrays.array_kind(buf, "float_workspace_buffer")
    if not arrays.is_contiguous(buf):
        raise ValueError("float_workspace_buffer must be C-contiguous")
    if backend == "cuda" and not arrays.on_device(buf) and kind != "numpy":
        raise ValueError("float_workspace_buffer must be GPU memory (or NumPy) for backend='cuda'")
    if backend == "sim" and arrays.device_of(buf) != "host":
        raise ValueError("backend='sim' needs a host (NumPy) float_workspace_buffer")
    return buf


def same_device(**named):
    devices = {k: arrays.device_of(v) for k, v in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"arrays are on different devices: {devices}")


def page_table(indptr, indices, last_page_len, page_size: int,
               names=("indptr", "indices", "last_page_len")):
    """A FlashInfer page table (arrays of any kind and integer dtype) checked on the host by the
    formats' validator: int32 ``indptr``, ``indices`` (its first ``indptr[-1]`` entries),
    ``last_page_len`` and the int64 KV length of every request; snapshots of the caller's
    arrays, read-only."""
    from ..formats.paged import check_page_table

    n_ptr, n_idx, n_last = names
    out = check_page_table(arrays.host_index(indptr, n_ptr), arrays.host_index(indices, n_idx),
                           arrays.host_index(last_page_len, n_last), page_size, names=names)
    return tuple(frozen(a) for a in out)


def host_tables(indptr, indices, last_page_len,
                names=("indptr", "indices", "last_page_len")) -> tuple[np.ndarray, ...]:
    """The three page-table arrays as host NumPy arrays, views where they already are host
    memory (:func:`nbinfer.api.arrays.host_view`): input of the compiled checks, which copy."""
    return (arrays.host_view(indptr, names[0]), arrays.host_view(indices, names[1]),
            arrays.host_view(last_page_len, names[2]))


def page_table_fast(indptr, indices, last_page_len, page_size: int,
                    names=("indptr", "indices", "last_page_len")):
    """:func:`page_table` in one compiled pass for int32 tables (the common case; any other
    dtype, and every error, goes through the same validator)."""
    from ..scheduler.compiled import check_page_table_fast

    return check_page_table_fast(*host_tables(indptr, indices, last_page_len, names), page_size,
                                 names)


def check_int32_buffer(name: str, buf) -> None:
    """A caller's fixed buffer of a CUDA-graph wrapper: an array nbinfer takes, 1-D, int32."""
    arrays.array_kind(buf, name)
    check_ndim(name, buf, 1)
    if arrays.dtype_name(buf) != "int32":
        raise TypeError(f"{name} must be int32, got {arrays.dtype_name(buf)}")


def frozen(a: np.ndarray) -> np.ndarray:
    """A read-only copy of ``a`` (plans hold snapshots, never the caller's arrays)."""
    a = np.array(a, copy=True)
    a.flags.writeable = False
    return a


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


__all__ = ["bind", "bind_view", "check_output", "check_workspace", "frozen", "nbytes", "output",
           "page_table", "page_table_fast", "same_device", "workspace_f32", "workspace_like"]
