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

import os
from types import SimpleNamespace

__all__ = ["assume_device"]


def assume_device(cc: tuple[int, int] = (9, 0)) -> None:
    """Make this process's Numba compile for compute capability ``cc`` with no driver: device
    functions see a device of ``cc``, and NVRTC's list of architectures is not asked for."""
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda import cuda_paths
    from numba.cuda.cudadrv import nvrtc

    from ..variants.precision import register

    register("cuda")  # the hooks' as_type_of, as kernels.compiled does before a compile
    major, minor = cc
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(major, minor))
    nvrtc.get_arch_option = lambda *_: f"compute_{major}{minor}"
    try:
        cuda_paths._get_nvrtc_path()
    except Exception:  # noqa: BLE001 - any failure to find NVRTC: it is not needed here
        cuda_paths._get_nvrtc_path = lambda: ("none", None)
