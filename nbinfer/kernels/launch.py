"""Launch a compiled Numba kernel from a pre-built argument block.

A Numba launch (``kernel[grid, block](*args)``) re-types and re-converts every argument on every
call: 47-146 us of Python per launch on the H200 host, far more than a decode step's GPU time at
small batch. :class:`PreparedLaunch` does that work once. It lays out the kernel's parameter block
the way Numba's ABI expects it (a 1-D array is seven 8-byte fields: meminfo, parent, nitems,
itemsize, data, shape, stride; a scalar is one field), keeps it in a NumPy buffer, and per call only
patches the fields that changed (data pointers of q, the cache, the outputs) before a single
``cuLaunchKernelEx`` (the driver's, through ctypes).

Under the simulator there are no pointers: the same object stores the argument arrays and calls
the kernel the ordinary way, so callers have one code path.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import types

ARRAY_FIELDS = 7  # meminfo, parent, nitems, itemsize, data, shape[0], strides[0]


class PreparedLaunch:
    """One kernel, one grid, an argument block patched in place between launches.

    Parameters
    ----------
    kernel : :class:`~.compiled.CompiledKernel` for ``signature`` (or a simulator kernel)
    signature : numba signature whose arguments are 1-D C arrays and scalars
    grid, block : int or tuple of up to 3 ints
        Launch configuration.
    sim : bool
        Simulator: keep arrays and launch through Numba.

    The kernel's dynamic shared memory (bytes) is its ``dynamic_shared`` attribute (0 if it has
    none): a kernel whose tiles outgrow the 48 KiB of static shared memory declares
    ``cuda.shared.array(0, ...)`` and its builder sets the attribute.
    """

    def __init__(self, kernel, signature, grid: int, block: int, *, sim: bool):
        self.kernel, self.sim = kernel, sim
        self.grid, self.block = _dim3(grid), _dim3(block)
        self.dependent = False  # a programmatic dependent launch (sharing(dependent=True))
        self.shared = dynamic_shared(kernel)
        self._types = tuple(signature.args)
        self._slot = []
        n = 0
        for ty in self._types:
            if isinstance(ty, types.Array):
                if ty.ndim != 1:
                    raise TypeError(f"PreparedLaunch supports 1-D array arguments, got {ty}")
            elif not isinstance(ty, (types.Integer, types.Float)):
                raise TypeError(f"PreparedLaunch supports arrays, integers and floats, got {ty}")
            self._slot.append(n)
            n += ARRAY_FIELDS if isinstance(ty, types.Array) else 1
        if sim:
            self._args = [None] * len(self._types)
            return
        self._func = kernel.handle
        # One 8-byte cell per field; cuLaunchKernel reads each through its own pointer, so
        # 4-byte scalars sit in the low half of their cell (little endian).
        self._vals = np.zeros(max(n, 1), dtype=np.int64)
        self._bind_cells()
        self._keep = {}
        for i, ty in enumerate(self._types):
            if isinstance(ty, types.Array):
                s = self._slot[i]
                self._vals[s + 3] = ty.dtype.bitwidth // 8
                self._vals[s + 6] = ty.dtype.bitwidth // 8

    def with_kernel(self, kernel) -> PreparedLaunch:
        """A copy bound to the same arguments but launching ``kernel`` (same signature): lets a
        benchmark compare compiled variants of one kernel on identical inputs."""
        twin = object.__new__(PreparedLaunch)
        twin.__dict__.update(self.__dict__)
        twin.kernel = kernel
        if self.sim:
            twin._args = list(self._args)
            return twin
        twin._vals = self._vals.copy()
        twin._func = kernel.handle
        twin.shared = dynamic_shared(kernel)
        twin._bind_cells()
        twin._keep = dict(self._keep)
        return twin

    def _bind_cells(self) -> None:
        # A memoryview writes one cell in ~0.1 us (a NumPy item assignment costs more); the
        # pointer array and the foreign call's arguments are built once, for the last stream.
        raw = memoryview(self._vals).cast("B")
        self._cells, self._cells_i32, self._cells_f32 = raw.cast("q"), raw.cast("i"), raw.cast("f")
        base = self._vals.ctypes.data
        self._ptrs = np.array([base + 8 * i for i in range(self._vals.size)], dtype=np.uint64)
        self._params = self._ptrs.ctypes.data
        self._stream = None
        self._bound = None

    def sharing(self, kernel, grid=None, dependent: bool = False) -> PreparedLaunch:
        """A launch of ``kernel`` (same signature and block; this grid unless ``grid`` is given)
        that shares this one's argument block: every later ``set_*`` on either binds both.
        Kernels that run around another over the same arguments (the value scan and guarded
        twin of the tensor-core prefill) use it. ``dependent``: a programmatic dependent
        launch (:mod:`.dependent`; the kernel must wait with ``griddepcontrol.wait`` before it
        reads what the kernel before it writes), where the driver has ``cuLaunchKernelEx``."""
        twin = object.__new__(PreparedLaunch)
        twin.__dict__.update(self.__dict__)  # the same _vals / _args objects, not copies
        twin.kernel = kernel
        twin.shared = dynamic_shared(kernel)
        twin.dependent = bool(dependent)
        if grid is not None:
            twin.grid = _dim3(grid)
        if not self.sim:
            twin._func = kernel.handle
            twin._stream = twin._bound = None  # its own foreign-call arguments (same cells)
        return twin

    def set_array(self, i: int, arr) -> None:
        """Bind argument ``i`` to a 1-D device array (numba) or, in the simulator, a NumPy array."""
        if self.sim:
            self._args[i] = arr
            return
        self._keep[i] = arr  # the launch must not outlive a temporary device copy
        cai = arr.__cuda_array_interface__
        self.set_pointer(i, cai["data"][0], int(np.prod(cai["shape"])))

    def release(self) -> None:
        """Let go of the arrays :meth:`set_array` kept alive: after a one-off launch, whose
        arguments the driver has already copied."""
        if not self.sim:
            self._keep.clear()

    def set_pointer(self, i: int, ptr: int, nitems: int) -> None:
        """Bind argument ``i`` (an array) to ``nitems`` elements at device address ``ptr``."""
        s = self._slot[i]
        c = self._cells
        c[s + 2] = nitems
        c[s + 4] = ptr
        c[s + 5] = nitems

    def set_data(self, i: int, ptr: int) -> None:
        """Rebind only the data pointer of array argument ``i`` (its length unchanged): the
        per-call write of run()'s fast paths."""
        self._cells[self._slot[i] + 4] = ptr

    def set_scalar(self, i: int, value) -> None:
        ty = self._types[i]
        if self.sim:
            self._args[i] = np.dtype(str(ty)).type(value)
            return
        s = self._slot[i]
        if ty.bitwidth == 64:
            self._cells[s] = int(value) if isinstance(ty, types.Integer) else 0
            if isinstance(ty, types.Float):
                self._vals[s:s + 1].view(np.float64)[0] = value
            return
        # a 4-byte scalar in the low half of its cell, the high half zero
        self._cells[s] = 0
        if isinstance(ty, types.Float):
            self._cells_f32[2 * s] = float(value)
        else:
            self._cells_i32[2 * s] = int(value)

    def __call__(self, stream: int = 0) -> None:
        """Launch on the CUDA stream with handle ``stream`` (0: the legacy default stream)."""
        if self.sim:
            self.kernel[self.grid, self.block, 0, self.shared](*self._args)
            return
        if stream != self._stream:
            self._bound = _driver().bind_launch(self._func, self.grid, self.block, stream,
                                                self._params, self.shared, self.dependent)
            self._stream = stream
        fn, args, _ = self._bound
        err = fn(*args)
        if err:
            raise RuntimeError(f"kernel launch failed with CUresult {err}")

    def launch_grid(self, grid, stream: int = 0) -> None:
        """Launch on a grid given per call (``grid`` a 3-tuple), the argument block as bound:
        for kernels sized by their input (the layer ops' one CTA per token). The driver's
        launch configuration is kept per (grid, stream), at most 64 of them."""
        if self.sim:
            self.kernel[grid, self.block, 0, self.shared](*self._args)
            return
        # twins (sharing, with_kernel) share this dict: keyed by function and argument block
        key = (self._func, self._params, grid, stream)
        grids = self.__dict__.setdefault("_grids", {})
        bound = grids.get(key)
        if bound is None:
            if len(grids) >= 64:
                grids.clear()
            bound = grids[key] = _driver().bind_launch(self._func, grid, self.block, stream,
                                                       self._params, self.shared)
        fn, args, _ = bound
        err = fn(*args)
        if err:
            raise RuntimeError(f"kernel launch failed with CUresult {err}")


def dynamic_shared(kernel) -> int:
    """Bytes of dynamic shared memory ``kernel`` is launched with (its ``dynamic_shared``
    attribute; 0 when it declares none)."""
    return int(getattr(kernel, "dynamic_shared", 0))


# Bytes of static shared memory a kernel may declare; a buffer past it is allocated at launch
# (:func:`use_dynamic_shared`). The kernel modules import it inside functions, so this host-side
# module stays out of their source keys (kernels/cache.py).
STATIC_SHARED_LIMIT = 48 * 1024


def use_dynamic_shared(kernel, nbytes: int, sim: bool):
    """Have every launch of ``kernel`` (which declares ``cuda.shared.array(0, ...)``) allocate
    ``nbytes`` of shared memory; nothing when ``nbytes`` is 0. On the GPU the function is also
    opted in to that size (:meth:`~.compiled.CompiledKernel.use_dynamic_shared`); the
    simulator's launch reads the attribute to size the array. Returns ``kernel``."""
    if nbytes:
        if sim:
            kernel.dynamic_shared = int(nbytes)
        else:
            kernel.use_dynamic_shared(nbytes)
    return kernel


_SHARED: dict = {}  # key -> (PreparedLaunch, lock): one argument block per small kernel


def launch_shared(key, make, grid, args, stream: int = 0, *, sim: bool) -> None:
    """Launch a small kernel (the layer ops, the state merges) through one prepared argument
    block per ``key``, shared by every caller, on ``stream``.

    ``make()`` returns ``(compiled kernel, signature, block)`` the first time ``key`` is seen;
    ``args`` follow the signature: for an array, the flat NumPy array (simulator) or
    ``(device address, elements)``; for a scalar, its value. Patching the block and launching
    hold a lock, so two threads' calls do not interleave (the driver copies the block at launch).
    Unlike Numba's dispatcher this neither converts arrays nor synchronises on their streams, so
    the launch can be captured in a CUDA graph.
    """
    entry = _SHARED.get(key)
    if entry is None:
        import threading

        kernel, signature, block = make()
        entry = _SHARED.setdefault(key, (PreparedLaunch(kernel, signature, 1, block, sim=sim),
                                         threading.Lock()))
    launch, lock = entry
    with lock:
        for i, (ty, value) in enumerate(zip(launch._types, args, strict=True)):
            if not isinstance(ty, types.Array):
                launch.set_scalar(i, value)
            elif sim:
                launch.set_array(i, value)
            else:
                launch.set_pointer(i, *value)
        launch.launch_grid(_dim3(grid), stream)
        if sim:
            launch._args = [None] * len(launch._args)  # keep no caller's array alive


def _dim3(dims) -> tuple[int, int, int]:
    """A grid or block size as three ints (missing dimensions are 1)."""
    dims = tuple(int(x) for x in (dims if isinstance(dims, (tuple, list)) else (dims,)))
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"launch dimensions must be 1-3 positive ints, got {dims}")
    return dims + (1,) * (3 - len(dims))


class _Driver:
    """The few driver entry points the host path calls per step, through ctypes: one foreign
    call each (~1 us), instead of the Python wrappers' argument objects and result enums."""

    def __init__(self):
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        u32, ptr, size = ctypes.c_uint, ctypes.c_void_p, ctypes.c_size_t
        sig = {"cuLaunchKernel": [ptr, u32, u32, u32, u32, u32, u32, u32, ptr, ptr, ptr],
               "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, ptr, size, ptr],
               "cuMemcpyDtoHAsync_v2": [ptr, ctypes.c_uint64, size, ptr],
               "cuStreamSynchronize": [ptr],
               "cuEventCreate": [ptr, u32], "cuEventRecord": [ptr, ptr],
               "cuEventSynchronize": [ptr], "cuEventDestroy_v2": [ptr],
               "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ptr, ptr, ctypes.c_int, size],
               "cuKernelSetAttribute": [ctypes.c_int, ctypes.c_int, ptr, ctypes.c_int]}
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self.ctypes = ctypes
        self.launch = lib.cuLaunchKernel
        # cuLaunchKernelEx (CUDA 12.0+) takes the grid, block and stream as one struct built
        # once per stream: four foreign-call arguments instead of eleven, ~1 us less of ctypes
        # conversion per launch (measured on a C stub: 1.4-1.7 us -> 0.35 us).
        self.launch_ex = getattr(lib, "cuLaunchKernelEx", None)
        if self.launch_ex is not None:
            self.launch_ex.argtypes, self.launch_ex.restype = [ptr, ptr, ptr, ptr], ctypes.c_int

            self._config, self._attribute = launch_structs()
        self.memcpy_htod_async = lib.cuMemcpyHtoDAsync_v2
        self.memcpy_dtoh_async = lib.cuMemcpyDtoHAsync_v2
        self.stream_synchronize = lib.cuStreamSynchronize
        self._event_create, self.event_record = lib.cuEventCreate, lib.cuEventRecord
        self.event_synchronize, self.event_destroy = lib.cuEventSynchronize, lib.cuEventDestroy_v2
        self._occupancy = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
        self._set_attribute = lib.cuKernelSetAttribute

    def bind_launch(self, func: int, grid, block, stream: int, params: int, shared: int = 0,
                    dependent: bool = False):
        """``(fn, args, keep)``: ``fn(*args)`` launches ``func`` (grid and block as 3-tuples)
        on ``stream`` with the kernel-parameter pointer array at address ``params`` and
        ``shared`` bytes of dynamic shared memory; ``keep`` is what must stay alive while the
        tuple is used (the launch configuration). ``dependent``: with the attribute
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION set, a programmatic dependent
        launch (:mod:`.dependent`); ignored without ``cuLaunchKernelEx``."""
        if self.launch_ex is None:
            return self.launch, (func, *grid, *block, shared, stream, params, None), None
        attrs = None
        if dependent:
            attrs = self._attribute(PROGRAMMATIC_STREAM_SERIALIZATION, 0)
            attrs.value[0] = 1  # programmaticStreamSerializationAllowed
        cfg = self._config(*grid, *block, shared, stream or None,
                           None if attrs is None else self.ctypes.addressof(attrs),
                           0 if attrs is None else 1)
        return self.launch_ex, (self.ctypes.addressof(cfg), func, params, None), (cfg, attrs)

    def resident_blocks(self, func: int, threads: int, dynamic_shared: int = 0) -> int:
        """How many blocks of ``threads`` threads of ``func`` one SM holds at once (the driver's
        occupancy calculator: registers, shared memory and the per-SM block limit)."""
        n = self.ctypes.c_int()
        check(self._occupancy(self.ctypes.byref(n), func, threads, dynamic_shared),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return n.value

    def allow_dynamic_shared(self, kernel: int, nbytes: int, device: int) -> None:
        """Let ``kernel`` launch with ``nbytes`` of dynamic shared memory on ``device``: past
        48 KiB a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES). Kernels
        are loaded as libraries, so the handle is a ``CUkernel``: ``cuFuncSetAttribute``
        rejects it (CUDA_ERROR_INVALID_HANDLE), ``cuKernelSetAttribute`` takes it."""
        check(self._set_attribute(8, int(nbytes), kernel, int(device)), "cuKernelSetAttribute")

    def prefer_shared(self, kernel: int, percent: int, device: int) -> None:
        """Ask that ``kernel`` run with ``percent`` of each SM's unified L1 / shared memory as
        shared memory (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT; -1: the driver's
        own choice). A hint the driver may override; used by ``bench/carveout_ab.py``, which
        found no effect on nbinfer's kernels (the driver already picks a carveout that holds
        the resident CTAs the occupancy calculator promises)."""
        check(self._set_attribute(9, int(percent), kernel, int(device)), "cuKernelSetAttribute")

    def event(self) -> int:
        """A new event without timing (CU_EVENT_DISABLE_TIMING): cheap to record and wait."""
        handle = self.ctypes.c_void_p()
        check(self._event_create(self.ctypes.byref(handle), 2), "cuEventCreate")
        return handle.value


# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h's CUlaunchAttributeID)
PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.cache
def launch_structs():
    """``(CUlaunchConfig, CUlaunchAttribute)`` as ctypes structures (cuda.h's layouts: the
    config's six dims and shared bytes, then the stream, the attribute array and its length;
    an attribute's 4-byte id, 4 bytes of padding and a 64-byte value union)."""
    import ctypes

    u32, ptr = ctypes.c_uint, ctypes.c_void_p

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [(n, u32) for n in ("grid_x", "grid_y", "grid_z", "block_x", "block_y",
                                        "block_z", "shared_bytes")] + [
            ("stream", ptr), ("attrs", ptr), ("num_attrs", u32)]

    class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
        _fields_ = [("id", u32), ("pad", u32), ("value", ctypes.c_int32 * 16)]

    return LaunchConfig, LaunchAttribute


def check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUresult {err}")


@functools.cache
def _driver() -> _Driver:
    return _Driver()


__all__ = ["PreparedLaunch", "ARRAY_FIELDS", "STATIC_SHARED_LIMIT", "dynamic_shared",
           "use_dynamic_shared"]
