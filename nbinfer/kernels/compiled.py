"""A kernel ready to launch on the GPU: loaded from the disk cache, or compiled and stored there.

:func:`gpu_kernel` is the one place nbinfer compiles a kernel for a GPU. It looks the kernel up
in the persistent cache (:mod:`.cache`) by its spec, signature and options; on a miss it builds
the Python source, compiles it with Numba (typing and lowering, NVVM to PTX, the linker to a
cubin), stores the cubin and loads it. Either way the result is a :class:`CompiledKernel`:
the cubin loaded into the current context, with its function handle for
:class:`~.launch.PreparedLaunch` and ``kernel[grid, block](*args)`` for one-off launches.

The compile phases are timed (``kernel.timings``: ``lower`` for Numba's compile call, ``ptx``
and ``link`` for what NVVM and the linker add after it, ``load`` for the driver) so
``bench/compile.py`` can say where cold-start time goes. ``cuda.jit(signature)`` itself runs
NVVM and links a cubin for the device's own target, which :func:`kernel_image` asks for, so
``lower`` holds all three and ``ptx`` / ``link`` are ~0 (they were separate passes, run twice,
until 2026-12-04).

A kernel's registers and shared memory fix how many of its CTAs an SM holds at once
(:meth:`CompiledKernel.resident_ctas`), which the persistent grids are sized by.
"""

from __future__ import annotations

import threading
import time

from .cache import KernelStore, Unkeyable, cache_dir, kernel_key

_LOCK = threading.Lock()
# Every kernel this process loaded, in order: ``(kind, spec, CompiledKernel)`` (warm-up and
# bench/compile.py read it to say what was compiled and what came from the cache).
LOADED: list = []


class CompiledKernel:
    """One loaded kernel.

    Attributes
    ----------
    name : str
        The entry point's (mangled) name in the cubin.
    signature : numba signature (arguments: 1-D C arrays and scalars)
    handle : int
        The driver's function handle, as ``cuLaunchKernel`` takes it.
    regs, local_bytes, shared_bytes : int
        Registers per thread, local (spill) bytes per thread, static shared bytes per block.
    max_registers : int or None
        The register cap it was linked under.
    from_cache : bool
        Whether the cubin came from the disk cache (else it was compiled in this process).
    key : str or None
        The cache key (None: not cacheable, compiled only).
    timings : dict
        Seconds per phase: ``lower`` (Numba's compile, NVVM and link included), ``ptx``,
        ``link`` (what is left of those two: ~0), all 0 on a cache hit; ``load``, ``total``.
    """

    def __init__(self, function, signature, *, from_cache: bool, key, timings: dict):
        self.function = function  # keeps the module loaded
        self.name = function.name
        self.signature = signature
        self.handle = int(getattr(function.handle, "value", None) or int(function.handle))
        attrs = function.attrs
        self.regs, self.local_bytes, self.shared_bytes = attrs.regs, attrs.local, attrs.shared
        self.from_cache, self.key, self.timings = from_cache, key, timings
        self.max_registers = None
        self.dynamic_shared = 0  # bytes each launch asks for (:meth:`use_dynamic_shared`)
        self._prepared = {}  # (grid, block) -> the PreparedLaunch one-off launches reuse
        self._lock = threading.Lock()

    def __getitem__(self, config):
        """``kernel[grid, block]`` or ``kernel[grid, block, stream]``: a one-off launch of
        device arrays (anything with ``__cuda_array_interface__``, 1-D and contiguous) and
        scalars, in signature order, like a Numba dispatcher's."""
        from .launch import PreparedLaunch

        grid, block = config[0], config[1]
        stream = config[2] if len(config) > 2 else 0
        handle = getattr(stream, "handle", stream)
        handle = int(getattr(handle, "value", None) or int(handle)) if handle else 0

        def launch(*args):
            if len(args) != len(self.signature.args):
                raise TypeError(f"{self.name}: expected {len(self.signature.args)} arguments, "
                                f"got {len(args)}")
            # Every argument is bound below, so one argument block per launch shape serves
            # every call (building one costs more than the launch itself); a lock keeps two
            # threads off one block, and the arguments are let go once launched (the driver
            # copied them), as a block built per call would.
            key = (str(grid), str(block))
            with self._lock:
                p = self._prepared.get(key)
                if p is None:
                    if len(self._prepared) >= 64:
                        self._prepared.clear()
                    p = self._prepared[key] = PreparedLaunch(self, self.signature, grid, block,
                                                             sim=False)
                try:
                    for i, a in enumerate(args):
                        if hasattr(a, "__cuda_array_interface__"):
                            p.set_array(i, a)
                        elif hasattr(a, "shape") and getattr(a, "ndim", 0) > 0:
                            raise TypeError(f"{self.name}: argument {i} must be a device "
                                            f"array, got {type(a).__name__}")
                        else:
                            p.set_scalar(i, a)
                    p(handle)
                finally:
                    p.release()

        return launch

    def use_dynamic_shared(self, nbytes: int) -> None:
        """Launch with ``nbytes`` of dynamic shared memory (the kernel declares
        ``cuda.shared.array(0, ...)``); the function is opted in to that size once here (needed
        past 48 KiB, harmless below)."""
        from .launch import _driver

        _driver().allow_dynamic_shared(self.handle, nbytes, self.function.device.id)
        self.dynamic_shared = int(nbytes)

    def resident_ctas(self, threads: int) -> int:
        """CTAs of ``threads`` threads one SM runs at once (the driver's occupancy calculator,
        counting the dynamic shared memory each launch asks for)."""
        from numba import cuda

        from .launch import _driver

        cuda.current_context()  # the calling thread may have none current yet (kernel cached)
        return _driver().resident_blocks(self.handle, threads, self.dynamic_shared)

    def __repr__(self):
        src = "cache" if self.from_cache else "compiled"
        return f"<CompiledKernel {self.name[:40]} ({src}, {self.regs} regs)>"


def gpu_kernel(kind: str, spec, signature, build, options: dict, module: str) -> CompiledKernel:
    """The kernel ``kind`` of ``spec``: from the disk cache, or ``build()`` (a zero-argument
    function returning the Python kernel, whose source is in ``module``) compiled with Numba
    for ``signature`` and ``options`` (keyword arguments of ``cuda.jit``), then stored."""
    from numba import cuda

    ctx = cuda.current_context()
    cc = ctx.device.compute_capability
    image = kernel_image(kind, spec, signature, build, options, module, cc)
    try:
        kernel = _load(ctx, image, signature)
    except Exception as exc:
        if not (image.from_cache and refused_image(exc)):
            raise  # out of memory, a context broken earlier, ...: not the entry's fault
        # A stored cubin this driver refuses (one built elsewhere: bench/prebuild_cache.py)
        # is dropped and the kernel compiled here instead; the fresh cubin is not retried.
        image.discard()
        image = kernel_image(kind, spec, signature, build, options, module, cc)
        kernel = _load(ctx, image, signature)
    kernel.max_registers = options.get("max_registers")
    LOADED.append((kind, spec, kernel))
    return kernel


# The driver's answers to an image it cannot use (cuda.h): INVALID_IMAGE, INVALID_SOURCE,
# NO_BINARY_FOR_GPU, INVALID_PTX, JIT_COMPILER_NOT_FOUND, UNSUPPORTED_PTX_VERSION, NOT_FOUND
# (no such entry point in the module).
_IMAGE_ERRORS = {200: "INVALID_IMAGE", 300: "INVALID_SOURCE", 209: "NO_BINARY_FOR_GPU",
                 218: "INVALID_PTX", 221: "JIT_COMPILER_NOT_FOUND",
                 222: "UNSUPPORTED_PTX_VERSION", 500: "NOT_FOUND"}


def refused_image(exc: BaseException) -> bool:
    """Whether a failed module load says the image itself is unusable (by its CUresult code
    or name), as opposed to the device or context failing (out of memory, an earlier fault)."""
    code = getattr(exc, "code", None)
    code = getattr(code, "value", code)
    if isinstance(code, int) and code in _IMAGE_ERRORS:
        return True
    text = str(exc)
    return any(name in text for name in _IMAGE_ERRORS.values())


class KernelImage:
    """A compiled kernel not yet loaded: its entry name and cubin, where it came from (the
    disk cache or this process's compile), its cache key (None: not cacheable) and the compile
    phases' seconds."""

    def __init__(self, name: str, cubin: bytes, from_cache: bool, key, timings: dict,
                 store=None, meta=None):
        self.name, self.cubin, self.from_cache = name, cubin, from_cache
        self.key, self.timings, self._store, self._meta = key, timings, store, meta

    def discard(self) -> None:
        """Delete this image's cache entry (the next lookup compiles), under the key's lock
        and only while it still holds this cubin (another process may have replaced it)."""
        if self._store is None or self.key is None:
            return
        with self._store.lock(self.key):
            hit = self._store.load(self.key, self._meta)
            if hit is not None and hit[1] == self.cubin:
                self._store.path(self.key).unlink(missing_ok=True)


def kernel_image(kind: str, spec, signature, build, options: dict, module: str,
                 cc) -> KernelImage:
    """The cubin of kernel ``kind`` of ``spec`` for compute capability ``cc``: read from the
    disk cache, or compiled (:func:`gpu_kernel`'s arguments) and stored. Needs no device, only
    the CUDA toolkit (NVVM and the linker): with :func:`~.offline.assume_device` it fills a
    cache for another machine."""
    from ..variants.precision import register

    register("cuda")  # the hooks' as_type_of, before any hook is typed
    cc = tuple(cc)
    root = cache_dir()
    try:
        key, meta = kernel_key(kind, spec, signature, options, cc, module)
    except Unkeyable:
        key = meta = None
    timings = {"lower": 0.0, "ptx": 0.0, "link": 0.0}
    # Numba-CUDA's own target for this device: cuda.jit(signature) has already lowered the
    # kernel to PTX and linked a cubin for it (on sm_90 and newer the architecture-specific
    # one, sm_90a, which warpgroup MMA needs), so asking for that target reuses both. Asking
    # for plain sm_90, as this did until 2026-12-04, ran NVVM and ptxas a second time for
    # the same SASS (bench/NOTES.md, issue 14: the cold compile).
    arch = (cc[0], cc[1], "a" if cc >= (9, 0) else "")
    if key is None or root is None:
        name, cubin, _ = _compile(build, signature, options, arch, timings)
        return KernelImage(name, cubin, False, key, timings)
    store = KernelStore(root)
    with _LOCK:  # threads of one process: one compile per key
        header, cubin, built = store.get_or_build(
            key, meta, lambda: _compile(build, signature, options, arch, timings))
    return KernelImage(header["name"], cubin, not built, key, timings, store, meta)


def _compile(build, signature, options, cc, timings):
    from numba import cuda

    t0 = time.perf_counter()
    dispatcher = cuda.jit(signature, **options)(build())
    overload = dispatcher.overloads[tuple(signature.args)]
    t1 = time.perf_counter()
    lib = overload._codelibrary
    lib.get_asm_strs(cc=cc)
    t2 = time.perf_counter()
    image = lib.get_cubin(cc=cc)
    t3 = time.perf_counter()
    timings.update(lower=t1 - t0, ptx=t2 - t1, link=t3 - t2)
    code = getattr(image, "code", image)
    if not isinstance(code, (bytes, bytearray)):
        raise RuntimeError(f"the linker returned {type(code).__name__}, not a cubin image")
    return lib._entry_name, bytes(code), {"cc": list(cc)}


def _load(ctx, image: KernelImage, signature) -> CompiledKernel:
    from cuda.core import ObjectCode

    timings = image.timings
    t0 = time.perf_counter()
    module = ctx.create_module_image(ObjectCode.from_cubin(image.cubin))
    function = module.get_function(image.name)
    timings["load"] = time.perf_counter() - t0
    timings["total"] = sum(timings[k] for k in ("lower", "ptx", "link", "load"))
    kernel = CompiledKernel(function, signature, from_cache=image.from_cache, key=image.key,
                            timings=timings)
    kernel.module = module
    return kernel


__all__ = ["LOADED", "CompiledKernel", "KernelImage", "gpu_kernel", "kernel_image",
           "refused_image"]
