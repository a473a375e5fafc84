"""Arrays in, arrays out: numpy, Numba device arrays, torch and cupy CUDA tensors.

Kernels see 1-D Numba arrays (device arrays on the GPU, NumPy arrays in the simulator). This module
converts whatever the caller passed, zero-copy where the array already lives on the GPU
(``__cuda_array_interface__``), and hands results back as the caller's kind.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from .._checks import dtype_name

BACKENDS = ("auto", "cuda", "sim", "reference")


def array_kind(x) -> str:
    """``"numpy"``, ``"numba"``, ``"torch"`` or ``"cupy"``; raises TypeError for anything else."""
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if hasattr(x, "copy_to_host") or (not _sim() and cuda.is_cuda_array(x)):
        return "numba"
    raise TypeError(f"expected a numpy array, numba device array, torch or cupy tensor, "
                    f"got {type(x).__name__}")


def _sim() -> bool:
    from ..kernels.primitives import simulator

    return simulator()


def resolve_backend(backend: str) -> str:
    """Map ``"auto"`` to ``"cuda"`` when a GPU is usable, else ``"sim"``; validate the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "sim" if _sim() or not cuda.is_available() else "cuda"
    if backend == "sim" and not _sim():
        raise ValueError("backend='sim' needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")
    if backend == "cuda" and (_sim() or not cuda.is_available()):
        raise ValueError("backend='cuda' needs a CUDA GPU (and NUMBA_ENABLE_CUDASIM unset)")
    return backend


def storage_dtype(x) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"`` for a float array of any kind."""
    name = dtype_name(x)
    if name in ("float16", "bfloat16", "float32"):
        return name
    raise TypeError(f"expected a float16, bfloat16 or float32 array, got {name}")


def device_of(x):
    """A comparable device tag: ``"host"`` or ``("cuda", index)``."""
    kind = array_kind(x)
    if kind == "numpy":
        return "host"
    if kind == "torch":
        return "host" if x.device.type == "cpu" else ("cuda", x.device.index or 0)
    if kind == "cupy":
        return ("cuda", x.device.id)
    return ("cuda", 0)


def to_kernel(x, backend: str):
    """A flat (1-D, contiguous) Numba-usable view or copy of ``x`` for a kernel argument.

    bf16 tensors become their int16 bit pattern. On ``"cuda"`` host arrays are copied to the
    device; on ``"sim"`` everything must be host memory.
    """
    kind = array_kind(x)
    if kind == "torch":
        import torch

        if not x.is_contiguous():
            raise ValueError("torch tensors must be contiguous")
        t = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        t = t.reshape(-1)
        if backend == "sim":
            return t.cpu().numpy()
        return cuda.as_cuda_array(t.detach())
    if kind == "cupy":
        if backend == "sim":
            raise ValueError("cupy arrays need backend='cuda'")
        return cuda.as_cuda_array(x.reshape(-1))
    if kind == "numba":
        if backend == "sim":
            return x.copy_to_host().reshape(-1)
        return x.reshape(-1) if x.is_c_contiguous() else None
    arr = np.ascontiguousarray(x).reshape(-1)
    if backend == "sim":
        # The simulator copies every argument back after the launch, so it needs writable memory.
        return arr if arr.flags.writeable else arr.copy()
    return cuda.to_device(arr)


def device_pointer(x):
    """``(address, nitems, itemsize)`` of a contiguous device array of any kind, without copying.

    Only arrays already on the GPU qualify (torch/cupy CUDA tensors, Numba device arrays); the
    caller falls back to :func:`to_kernel` for host arrays.
    """
    kind = array_kind(x)
    if kind == "torch":
        if not x.is_contiguous():
            raise ValueError("torch tensors must be contiguous")
        return x.data_ptr(), x.numel(), x.element_size()
    cai = x.__cuda_array_interface__
    if cai.get("strides") is not None and not _c_contiguous(cai):
        raise ValueError("device arrays must be C-contiguous")
    n = int(np.prod(cai["shape"]))
    return cai["data"][0], n, np.dtype(cai["typestr"]).itemsize


def _c_contiguous(cai) -> bool:
    expect = np.dtype(cai["typestr"]).itemsize
    for dim, stride in zip(reversed(cai["shape"]), reversed(cai["strides"]), strict=True):
        if dim > 1 and stride != expect:
            return False
        expect *= dim
    return True


def on_device(x) -> bool:
    """True when ``x`` is GPU memory (so its pointer can be passed straight to a kernel)."""
    kind = array_kind(x)
    if kind == "torch":
        return x.device.type == "cuda"
    return kind in ("cupy", "numba")


def current_stream(x) -> int:
    """The CUDA stream handle the caller's framework would launch on for ``x`` (0 otherwise)."""
    kind = array_kind(x)
    if kind == "torch" and x.device.type == "cuda":
        import torch

        return torch.cuda.current_stream(x.device).cuda_stream
    if kind == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().ptr
    return 0


def to_host(x) -> np.ndarray:
    """An array of any kind as a host NumPy array (torch bf16, which NumPy lacks, as float32)."""
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    kind = array_kind(x)
    if kind == "torch":
        import torch

        t = x.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if kind == "cupy":
        return x.get()
    if kind == "numba":
        return x.copy_to_host()
    return np.asarray(x)


def host_int32(x, name: str) -> np.ndarray:
    """An index array (any kind) as a host int32 NumPy array."""
    arr = to_host(x)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return arr.astype(np.int32, copy=False)


def empty_like_kind(kind: str, template, shape, dtype: str, backend: str):
    """Allocate an output of the caller's kind: returns ``(user_array, kernel_view)``."""
    if kind == "torch":
        import torch

        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        t = torch.empty(shape, dtype=tdt, device=template.device)
        return t, to_kernel(t, backend)
    if kind == "cupy":
        import cupy

        a = cupy.empty(shape, dtype=dtype)
        return a, to_kernel(a, backend)
    npdt = np.int16 if dtype == "bfloat16" else np.dtype(dtype)
    if backend == "sim" or kind == "numpy":
        host = np.empty(shape, dtype=npdt)
        if backend == "sim":
            return host, host.reshape(-1)
        dev = cuda.device_array(int(np.prod(shape)), dtype=npdt)
        return host, dev
    dev = cuda.device_array(shape, dtype=npdt)
    return dev, dev.reshape(-1)


def finish(kind: str, user, kernel_view, backend: str):
    """Copy a device result back into a host output when the caller passed NumPy."""
    if kind == "numpy" and backend == "cuda":
        kernel_view.copy_to_host(user.reshape(-1))
    return user
