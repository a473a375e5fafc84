"""Compile nbinfer's GPU kernels on a machine without a GPU: PTX to read, count and time.

Numba lowers a kernel for a given architecture without any device, but two of its steps still
ask the machine: ``compile_ptx`` asks NVRTC which architectures exist, and a device function
(typed and lowered at its first call site, :func:`~.primitives.device_jit`) asks the driver for
the current device's compute capability. :func:`assume_device` answers both, so that lesson 05,
``bench/sass_stats.py`` and ``bench/compile_cpu.py`` compile for an H200 on a laptop. What is
needed is NVVM and libdevice (the CUDA toolkit); never call this in a process that launches
kernels.
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

__all__ = ["OfflineKernel", "assume_device", "images_only"]


def assume_device(cc: tuple[int, int] = (9, 0)) -> None:
    """Make this process's Numba compile for compute capability ``cc`` with no driver: device
    functions see a device of ``cc``, and NVRTC's list of architectures is not asked for."""
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    import numba.cuda.codegen as codegen
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda
    from numba.cuda import cuda_paths
    from numba.cuda.cudadrv import nvrtc

    from ..variants.precision import register

    register("cuda")  # the hooks' as_type_of, as kernels.compiled does before a compile
    major, minor = cc
    device = SimpleNamespace(compute_capability=(major, minor))
    dispatcher.get_current_device = lambda: device
    # ... and so does the api's choice of a kernel (the warpgroup kernels need sm_90)
    cuda.get_current_device = lambda: device
    # cuda.jit(signature) lowers at once and asks the current context's device for the
    # architecture of that first PTX (codegen's _ensure_cc)
    codegen.devices = SimpleNamespace(get_context=lambda: SimpleNamespace(device=device))
    # ... and then loads the cubin into that context (_Kernel.bind): here it only links
    dispatcher._Kernel.bind = lambda self: self._codelibrary.get_cubin()
    # the target Numba asks for: compute_90, or compute_90a for the architecture-specific one
    nvrtc.get_arch_option = lambda mj=major, mn=minor, arch="": f"compute_{mj}{mn}{arch}"
    try:
        cuda_paths._get_nvrtc_path()
    except Exception:  # noqa: BLE001 - any failure to find NVRTC: it is not needed here
        cuda_paths._get_nvrtc_path = lambda: ("none", None)


class OfflineKernel:
    """What a kernel builder returns inside :func:`images_only`: the compiled image, stored in
    the disk cache, with no driver function (nothing can launch it)."""

    def __init__(self, image):
        self.image, self.name, self.key = image, image.name, image.key
        self.from_cache, self.timings = image.from_cache, image.timings
        self.dynamic_shared = 0

    def use_dynamic_shared(self, nbytes: int) -> None:
        self.dynamic_shared = int(nbytes)


@contextlib.contextmanager
def images_only(cc: tuple[int, int] = (9, 0)):
    """Inside, nbinfer's kernel builders (``build_decode_kernel(spec)`` and the others) compile
    for compute capability ``cc`` into the disk cache (:func:`~.compiled.kernel_image`) and
    return :class:`OfflineKernel` stubs instead of loading anything: how
    ``bench/prebuild_cache.py`` fills a GPU machine's cache on a machine without one (after
    :func:`assume_device`). The builders memoise per spec, so the stubs outlive the block:
    like :func:`assume_device`, for processes that never launch a kernel."""
    from . import compiled

    def offline(kind, spec, signature, build, options, module):
        kernel = OfflineKernel(compiled.kernel_image(kind, spec, signature, build, options,
                                                     module, cc))
        compiled.LOADED.append((kind, spec, kernel))
        return kernel

    saved = compiled.gpu_kernel
    compiled.gpu_kernel = offline
    try:
        yield
    finally:
        compiled.gpu_kernel = saved
