"""Arrays in, arrays out: numpy, Numba device arrays, torch and cupy CUDA tensors.

Kernels see 1-D Numba arrays (device arrays on the GPU, NumPy arrays in the simulator). This module
converts whatever the caller passed, zero-copy where the array already lives on the GPU
(``__cuda_array_interface__``), and hands results back as the caller's kind.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
from numba import cuda

from .._checks import as_index_array, dtype_name
from .dtypes import FP8_DTYPES, normalize_dtype

BACKENDS = ("auto", "cuda", "sim", "reference")
_SAID = []  # the one-time note of backend="auto" falling back to the reference engine


def array_kind(x, name: str | None = None) -> str:
    """``"numpy"``, ``"numba"``, ``"torch"`` or ``"cupy"``; a TypeError (naming ``name``) for
    anything else."""
    mod = type(x).__module__.split(".")[0]
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod == "torch":
        return "torch"
    if mod == "cupy":
        return "cupy"
    if hasattr(x, "copy_to_host") or (not _sim() and cuda.is_cuda_array(x)):
        return "numba"
    what = f"{name} must be" if name else "expected"
    raise TypeError(f"{what} a numpy array, numba device array, torch or cupy tensor, "
                    f"got {type(x).__name__}")


def _sim() -> bool:
    from ..kernels.primitives import simulator

    return simulator()


def resolve_backend(backend: str) -> str:
    """Validate the name and map ``"auto"``: the simulator when it is active
    (``NUMBA_ENABLE_CUDASIM=1``), else the GPU when one is usable, else the float64 reference
    engine (said once on stderr: the kernels need a GPU or the simulator)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if _sim():
            return "sim"
        if cuda.is_available():
            return "cuda"
        if not _SAID:
            _SAID.append(True)
            print("nbinfer: no CUDA GPU and no simulator (NUMBA_ENABLE_CUDASIM=1 before importing "
                  "nbinfer): backend='auto' runs the float64 reference engine", file=sys.stderr)
        return "reference"
    if backend == "sim" and not _sim():
        raise ValueError("backend='sim' needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")
    if backend == "cuda" and (_sim() or not cuda.is_available()):
        raise ValueError("backend='cuda' needs a CUDA GPU (and NUMBA_ENABLE_CUDASIM unset)")
    return backend


def storage_dtype(x, name: str = "array", *, kv: bool = False) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"`` for a float array of any kind; a TypeError
    naming the argument otherwise (float64 included: the kernels store 16 or 32 bits).

    With ``kv`` (a KV cache or keys and values to append) also the FP8 formats: a torch
    ``float8_e4m3fn`` / ``float8_e5m2`` tensor gives its name, and any ``uint8`` array
    ``"uint8"``: raw FP8 codes, whose format the plan's ``kv_data_type`` names
    (:func:`check_kv_dtype`)."""
    dt = dtype_name(x)
    if kv and (dt in FP8_DTYPES or dt == "uint8"):
        return dt
    if dt in ("float16", "bfloat16", "float32"):
        if isinstance(x, np.ndarray) and dt == "bfloat16":
            # ml_dtypes' NumPy bfloat16 would reach the kernels as values, not as the bits.
            raise TypeError(f"{name}: NumPy bfloat16 arrays are not supported; pass torch "
                            f"bfloat16 tensors or float16/float32 arrays")
        return dt
    allowed = ("float16, bfloat16, float32, float8_e4m3fn, float8_e5m2 or uint8 (FP8 codes)"
               if kv else "float16, bfloat16 or float32")
    raise TypeError(f"{name} must have dtype {allowed}, got {dt}")


def same_kv_storage(a: str, b: str) -> bool:
    """Whether two KV dtypes (:func:`storage_dtype` with ``kv``) hold the same bits: equal, or
    ``uint8`` codes beside a named FP8 format."""
    return a == b or (a == "uint8" and b in FP8_DTYPES) or (b == "uint8" and a in FP8_DTYPES)


def check_kv_dtype(name: str, x, kv_dtype: str, what: str = "planned kv_data_type") -> None:
    """Require a KV array of dtype ``kv_dtype``; an FP8 plan also takes ``uint8`` codes."""
    dt = storage_dtype(x, name, kv=True)
    if not same_kv_storage(dt, kv_dtype):
        codes = " (or uint8 codes)" if kv_dtype in FP8_DTYPES else ""
        raise TypeError(f"{name} must have dtype {kv_dtype}{codes} ({what}), got {dt}")


def single_kv_dtype(k, v, kv_data_type=None) -> str:
    """The KV dtype of a single-request call's ``k`` and ``v``: ``kv_data_type`` when given
    (``uint8`` codes need it to name their FP8 format), else ``k``'s own; ``v`` must match."""
    if kv_data_type is None:
        kv_dtype = storage_dtype(k, "k", kv=True)
        if kv_dtype == "uint8":
            raise TypeError("k: uint8 arrays are FP8 codes; pass kv_data_type='float8_e4m3fn' "
                            "or 'float8_e5m2' to name their format")
    else:
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type, kv=True)
    what = "k's dtype" if kv_data_type is None else "kv_data_type"
    for name, x in (("k", k), ("v", v)):
        check_kv_dtype(name, x, kv_dtype, what)
    return kv_dtype


def _bits_view(t):
    """A torch tensor whose dtype the kernels cannot take as itself, viewed as its bits: bf16
    as int16, FP8 as uint8 (a view: same memory)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


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
        if not x.is_contiguous():
            raise ValueError("torch tensors must be contiguous")
        t = _bits_view(x).reshape(-1)
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


def element_strides(x) -> tuple[int, ...]:
    """Strides of ``x`` (any kind) in elements."""
    kind = array_kind(x)
    if kind == "torch":
        return tuple(int(s) for s in x.stride())
    if kind == "numba":
        cai = x.__cuda_array_interface__
        if cai.get("strides") is None:
            return contiguous_strides(x.shape)
        return tuple(int(s) // np.dtype(cai["typestr"]).itemsize for s in cai["strides"])
    item = np.dtype(x.dtype).itemsize
    if any(int(s) % item for s in x.strides):
        raise ValueError(f"array strides must be multiples of its item size ({item} bytes), got "
                         f"{tuple(x.strides)} bytes")
    return tuple(int(s) // item for s in x.strides)


def contiguous_strides(shape) -> tuple[int, ...]:
    out, n = [], 1
    for dim in reversed(tuple(shape)):
        out.append(n)
        n *= int(dim)
    return tuple(reversed(out))


def span(shape, strides) -> int:
    """Elements from an array's first element to its last, inclusive (0 if it is empty)."""
    if any(int(n) == 0 for n in shape):
        return 0
    return 1 + sum((int(n) - 1) * int(s) for n, s in zip(shape, strides, strict=True))


def check_strided(name: str, x) -> tuple[int, ...]:
    """Require a layout the kernels can read in place: non-negative strides and a contiguous
    last dimension (FlashInfer's rule); return the element strides."""
    st = element_strides(x)
    if any(s < 0 for s in st) or (x.shape[-1] > 1 and st[-1] != 1):
        raise ValueError(f"{name} must have a contiguous last dimension and non-negative strides, "
                         f"got strides {st} (elements) for shape {tuple(x.shape)}")
    return st


def kernel_view(x, backend: str, name: str):
    """``(view, strides)``: ``x`` as the kernels read it, without a copy where possible.

    ``view`` is a 1-D array starting at ``x``'s first element and covering its span (the
    simulator: a NumPy view; the GPU: a device array, or ``(pointer, nitems)`` for memory already
    on the device) and ``strides`` are the element strides the kernel must use: ``x``'s own,
    or contiguous ones when ``x`` had to be copied (host memory on the GPU backend).
    """
    kind = array_kind(x)
    st = check_strided(name, x)
    if backend == "cuda" and on_device(x):
        if kind == "torch":
            return (x.data_ptr(), span(x.shape, st)), st
        cai = x.__cuda_array_interface__
        return (cai["data"][0], span(x.shape, st)), st
    if backend == "cuda":
        host = np.ascontiguousarray(to_host_exact(x))
        return cuda.to_device(host.reshape(-1)), contiguous_strides(host.shape)
    host = to_host_exact(x)
    if not host.flags.writeable:  # the simulator copies every argument back after a launch
        host = np.ascontiguousarray(host).copy()
        st = contiguous_strides(host.shape)
    n = span(host.shape, st)
    flat = np.lib.stride_tricks.as_strided(host, shape=(max(n, 1),), strides=(host.itemsize,))
    return (flat if n else flat[:0]), st


def to_host_exact(x) -> np.ndarray:
    """``x`` as host NumPy memory with its bits unchanged (torch bf16 as its int16 bits, FP8 as
    its uint8 codes), a view where ``x`` already is host memory."""
    kind = array_kind(x)
    if kind == "torch":
        t = _bits_view(x.detach())
        return t.cpu().numpy() if t.device.type != "cpu" else t.numpy()
    if kind == "cupy":
        return x.get()
    if kind == "numba":
        return x.copy_to_host()
    return x


def is_contiguous(x) -> bool:
    """True when ``x`` (any array kind) is C-contiguous (strides of size-1 axes ignored)."""
    kind = array_kind(x)
    if kind == "torch":
        return x.is_contiguous()
    if kind == "numba":
        return x.is_c_contiguous()
    return x.flags.c_contiguous  # numpy and cupy


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


def torch_device_index(x) -> int | None:
    """The CUDA device index of a torch CUDA tensor ``x``; None for anything else."""
    if array_kind(x) != "torch" or x.device.type != "cuda":
        return None
    if x.device.index is not None:
        return x.device.index
    import torch

    return torch.cuda.current_device()


def stream_getter(x):
    """A zero-argument function returning the CUDA stream handle :func:`current_stream` gives
    for arrays on ``x``'s device (one C call for torch, where that is most of plan()'s need)."""
    if array_kind(x) == "torch" and x.device.type == "cuda":
        import torch

        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return lambda: raw(index)
    return lambda: current_stream(x)


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


def kv_values(x, kv_dtype: str, scale: float = 1.0) -> np.ndarray:
    """A KV array of any kind as the float64 values attention reads: FP8 codes decoded
    (:func:`nbinfer.reference.fp8.decode`), times ``scale`` (the per-call ``k_scale`` or
    ``v_scale``). What the reference backend computes with."""
    if kv_dtype in FP8_DTYPES:
        from ..reference import fp8

        return fp8.decode(np.asarray(to_host_exact(x)).view(np.uint8), kv_dtype, scale)
    values = to_host(x).astype(np.float64)
    return values * scale if scale != 1.0 else values


def host_mask(mask):
    """A mask of any array kind (FlashInfer passes CUDA tensors) as host memory, or None; masks
    are read on the host at plan()."""
    if mask is None or isinstance(mask, (list, tuple, np.ndarray)):
        return mask
    return to_host(mask)


def host_index(x, name: str) -> np.ndarray:
    """An index array of any kind and integer dtype as a fresh host NumPy array of its own
    integer dtype (a snapshot: later changes to ``x`` do not reach it). Range checks come
    before any narrowing to int32 (:func:`host_int32`, :mod:`nbinfer.formats.paged`)."""
    if isinstance(x, (list, tuple)):
        arr = np.array(x)
        if arr.size == 0:
            arr = arr.astype(np.int32)
    else:
        arr = np.array(to_host(x), copy=True)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return arr


def host_view(x, name: str) -> np.ndarray:
    """An index array of any kind and integer dtype as a host NumPy array, without a copy
    where the memory already is on the host (the caller snapshots what it keeps)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (list, tuple)):
        return host_index(x, name)
    elif type(x).__module__.startswith("torch") and x.is_cpu and x.dtype in _torch_ints():
        # a host tensor (pinned or not) of integers, which cannot require grad: a view, none
        # of to_host's round trip (plan() takes three of these per step)
        return x.numpy()
    else:
        arr = to_host(x)
    if arr.dtype.kind not in "iu":  # not bool, float or object
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    return arr


@functools.cache
def _torch_ints() -> frozenset:
    import torch

    return frozenset((torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))


def host_int32(x, name: str) -> np.ndarray:
    """An index array (any kind, any integer dtype) as a fresh host int32 NumPy array; values
    outside int32 raise a ValueError naming ``name`` (never wrapped)."""
    arr = host_index(x, name)
    return as_index_array(name, arr, arr.ndim)  # a fresh array: host_index copied


def empty_kind(kind: str, template, shape, dtype: str, backend: str):
    """An uninitialised output of the caller's kind: a torch tensor on ``template``'s device, a
    cupy array, a Numba device array, or host NumPy memory (for NumPy callers, the simulator and
    the reference engine; bfloat16 as its int16 bits)."""
    if kind == "torch":
        import torch

        tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
        return torch.empty(shape, dtype=tdt, device=template.device)
    if kind == "cupy":
        import cupy

        return cupy.empty(shape, dtype=dtype)
    npdt = np.int16 if dtype == "bfloat16" else np.dtype(dtype)
    if backend in ("sim", "reference") or kind == "numpy":
        return np.empty(shape, dtype=npdt)
    return cuda.device_array(shape, dtype=npdt)


def empty_like_kind(kind: str, template, shape, dtype: str, backend: str):
    """Allocate an output of the caller's kind: returns ``(user_array, kernel_view)`` (for a
    NumPy caller on the GPU, the view is device memory that :func:`finish` copies back)."""
    user = empty_kind(kind, template, shape, dtype, backend)
    if kind == "numpy" and backend == "cuda":
        return user, cuda.device_array(user.size, dtype=user.dtype)
    if isinstance(user, np.ndarray):
        return user, user.reshape(-1)
    return user, to_kernel(user, backend)


def finish(kind: str, user, kernel_view, backend: str):
    """Copy a device result back into a host output when the caller passed NumPy."""
    if kind == "numpy" and backend == "cuda":
        kernel_view.copy_to_host(user.reshape(-1))
    return user
