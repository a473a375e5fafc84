"""Launch a compiled Numba kernel from a pre-built argument block.

A Numba launch (``kernel[grid, block](*args)``) re-types and re-converts every argument on every
call: 47-146 us of Python per launch on the H200 host, far more than a decode step's GPU time at
small batch. :class:`PreparedLaunch` does that work once. It lays out the kernel's parameter block
the way Numba's ABI expects it (a 1-D array is seven 8-byte fields: meminfo, parent, nitems,
itemsize, data, shape, stride; a scalar is one field), keeps it in a NumPy buffer, and per call only
patches the fields that changed (data pointers of q, the cache, the outputs) before a single
``cuLaunchKernel`` (the driver's, through ctypes).

Under the simulator there are no pointers: the same object stores the argument arrays and calls
the kernel the ordinary way, so callers have one code path.
"""

from __future__ import annotations

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
    """

    def __init__(self, kernel, signature, grid: int, block: int, *, sim: bool):
        self.kernel, self.sim = kernel, sim
        self.grid, self.block = _dim3(grid), _dim3(block)
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
        base = self._vals.ctypes.data
        self._ptrs = np.array([base + 8 * i for i in range(n)], dtype=np.uint64)
        self._params = self._ptrs.ctypes.data
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
        base = twin._vals.ctypes.data
        twin._ptrs = np.array([base + 8 * i for i in range(self._ptrs.size)], dtype=np.uint64)
        twin._params = twin._ptrs.ctypes.data
        twin._func = kernel.handle
        twin._keep = dict(self._keep)
        return twin

    def sharing(self, kernel, grid=None) -> PreparedLaunch:
        """A launch of ``kernel`` (same signature and block; this grid unless ``grid`` is given)
        that shares this one's argument block: every later ``set_*`` on either binds both.
        Kernels that run around another over the same arguments (the value scan and guarded
        twin of the tensor-core prefill) use it."""
        twin = object.__new__(PreparedLaunch)
        twin.__dict__.update(self.__dict__)  # the same _vals / _args objects, not copies
        twin.kernel = kernel
        if grid is not None:
            twin.grid = _dim3(grid)
        if not self.sim:
            twin._func = kernel.handle
        return twin

    def set_array(self, i: int, arr) -> None:
        """Bind argument ``i`` to a 1-D device array (numba) or, in the simulator, a NumPy array."""
        if self.sim:
            self._args[i] = arr
            return
        self._keep[i] = arr  # the launch must not outlive a temporary device copy
        cai = arr.__cuda_array_interface__
        self.set_pointer(i, cai["data"][0], int(np.prod(cai["shape"])))

    def set_pointer(self, i: int, ptr: int, nitems: int) -> None:
        """Bind argument ``i`` (an array) to ``nitems`` elements at device address ``ptr``."""
        s = self._slot[i]
        v = self._vals
        v[s + 2] = nitems
        v[s + 4] = ptr
        v[s + 5] = nitems

    def set_scalar(self, i: int, value) -> None:
        ty = self._types[i]
        if self.sim:
            self._args[i] = np.dtype(str(ty)).type(value)
            return
        s = self._slot[i]
        cell = self._vals[s:s + 1]
        cell[0] = 0
        cell.view(np.dtype(str(ty)))[0] = value

    def __call__(self, stream: int = 0) -> None:
        """Launch on the CUDA stream with handle ``stream`` (0: the legacy default stream)."""
        if self.sim:
            self.kernel[self.grid, self.block](*self._args)
            return
        err = _cu_launch_kernel()(self._func, *self.grid, *self.block, 0, stream, self._params,
                                  None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUresult {err}")


def _dim3(dims) -> tuple[int, int, int]:
    """A grid or block size as three ints (missing dimensions are 1)."""
    dims = tuple(int(x) for x in (dims if isinstance(dims, (tuple, list)) else (dims,)))
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"launch dimensions must be 1-3 positive ints, got {dims}")
    return dims + (1,) * (3 - len(dims))


_LAUNCH = []


def _cu_launch_kernel():
    # The driver's cuLaunchKernel through ctypes: one foreign call (~1 us) instead of the
    # cuda.bindings wrapper's argument objects and result enum.
    if not _LAUNCH:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernel
        u32, ptr = ctypes.c_uint, ctypes.c_void_p
        fn.argtypes = [ptr, u32, u32, u32, u32, u32, u32, u32, ptr, ptr, ptr]
        fn.restype = ctypes.c_int
        _LAUNCH.append(fn)
    return _LAUNCH[0]


__all__ = ["PreparedLaunch", "ARRAY_FIELDS"]
