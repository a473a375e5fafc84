"""FlashInfer-compatible KV-cache append: ``append_paged_kv_cache`` and
``get_batch_indices_positions``.

A decode or prefill step first grows the page table (allocates pages, updates
``kv_last_page_len``), then writes the step's new keys and values into their slots with
:func:`append_paged_kv_cache`. :func:`get_batch_indices_positions` turns the ragged
``append_indptr`` into the per-token request and position that the append takes.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from .._checks import (
    KV_LAYOUTS,
    check_choice,
    check_dim,
    check_ndim,
    check_positive_int,
    check_range,
    dtype_name,
)
from ..formats.paged import check_page_table
from ..kernels.append import (
    WORD_DTYPES,
    AppendSpec,
    append_launch_config,
    build_append_kernel,
    choose_word_bytes,
)
from ..kernels.common import ITEMSIZE
from ..scheduler import compiled
from . import arrays
from .state import check_placement

__all__ = ["PagedKVAppendWrapper", "append_paged_kv_cache", "get_batch_indices_positions"]


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    """Request and position of every appended token.

    Parameters
    ----------
    append_indptr : int array [batch_size + 1]
        Request ``b`` appends tokens ``append_indptr[b]:append_indptr[b + 1]``.
    seq_lens : int array [batch_size]
        KV length of each request *after* the append.
    nnz : int
        Total appended tokens, ``append_indptr[-1]``.

    Returns
    -------
    batch_indices, positions : int32 arrays [nnz], of ``append_indptr``'s kind and device
        ``positions[i] = seq_lens[b] - append_len_b + j`` for the ``j``-th new token of ``b``.
        Computed on the host (a few integers per token) by the reference engine.
    """
    bi, pos = reference.get_batch_indices_positions(
        arrays.host_int32(append_indptr, "append_indptr"), arrays.host_int32(seq_lens, "seq_lens"),
        nnz)
    return _like(append_indptr, bi), _like(append_indptr, pos)


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout: str = "NHD", *,
                          backend: str = "auto") -> None:
    """Write new keys and values into their page slots, in place.

    The page table must already describe the requests *after* the append.

    Parameters
    ----------
    append_key, append_value : array [nnz, num_kv_heads, head_dim], the cache's dtype
        New keys and values (float16, bfloat16 or float32; an FP8 cache takes FP8 codes, of a
        torch FP8 dtype or uint8: the caller quantises, the append copies bits).
    batch_indices, positions : int array [nnz]
        Request and position (within the request's KV) of each new token, see
        :func:`get_batch_indices_positions`.
    paged_kv_cache : array or (array, array), views with a contiguous last dimension
        NHD ``[num_pages, 2, page_size, Hkv, D]`` / HND ``[num_pages, 2, Hkv, page_size, D]``, or
        a ``(k_cache, v_cache)`` pair of ``[num_pages, page_size, Hkv, D]`` /
        ``[num_pages, Hkv, page_size, D]``. Updated in place.
    kv_indices : int array [>= kv_indptr[-1]]
        Physical pages of every request, in logical order; values in ``[0, num_pages)``. Only
        the first ``kv_indptr[-1]`` entries are read.
    kv_indptr : int array [batch_size + 1]
        Request ``b`` owns ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
    kv_last_page_len : int array [batch_size]
        Filled slots of each request's last page, in ``[1, page_size]``.
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    Returns
    -------
    None

    Notes
    -----
    The index arrays (any integer dtype, range-checked before narrowing to int32) are copied to
    the host and checked there (every token's slot must lie in a page its request owns) before
    the launch, so a rejected append writes nothing; device index arrays cost a synchronising copy
    per call. The kernel then reads contiguous int32 device index arrays in place and uploads
    the checked host copies of any others.
    """
    be = arrays.resolve_backend(backend)
    caches, combined, k_cache, (num_pages, page_size, heads, dim), kind = _check_kv(
        append_key, append_value, paged_kv_cache, kv_layout, be)
    v_cache = k_cache if combined else caches["v_cache"]
    nnz = int(append_key.shape[0])
    table = _check_indices(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len,
                           nnz, num_pages, page_size)
    if be == "reference":
        bi, pos, indptr, indices, last = table
        reference.append_paged_kv_cache(append_key, append_value, bi, pos, paged_kv_cache,
                                        indices[:indptr[-1]], indptr, last, kv_layout=kv_layout)
        return None
    if be == "sim" and not combined and _pair_overlaps(k_cache, v_cache):
        # K and V are views of one pool: the simulator copies each kernel argument back after
        # the launch, so overlapping spans would undo one side's writes. Work on copies.
        return _append_on_copies(append_key, append_value, batch_indices, positions, caches,
                                 kv_indices, kv_indptr, kv_last_page_len, kv_layout)
    users = (batch_indices, positions, kv_indptr, kv_indices)
    idx = [_index_arg(u, h, be) for u, h in zip(users, table[:4], strict=True)]
    _launch(append_key, append_value, caches, combined, kv_layout, be, kind, idx, 0,
            (page_size, heads, dim))
    return None


class PagedKVAppendWrapper:
    """:func:`append_paged_kv_cache` split into a plan (the step's indices, validated and
    uploaded once) and a run per layer.

    A model appends the same step's tokens to every layer's cache: the indices are the same,
    only the keys, values and cache change. ``plan()`` checks the indices on the host (as the
    function does) and copies them to the wrapper's own device memory on the current stream,
    asynchronously; ``run()`` checks shapes and launches, with no copy and no synchronisation,
    so a captured run replays in a CUDA graph (after :meth:`reserve`, the memory never moves).

    Parameters
    ----------
    paged_kv_cache : array or (array, array)
        One of the caches the runs will write (every layer's has the same shape, dtype and
        device): fixes ``num_pages``, ``page_size``, the heads, ``head_dim`` and the dtype.
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "cuda", "sim", "reference"}
    """

    def __init__(self, paged_kv_cache, kv_layout: str = "NHD", *, backend: str = "auto"):
        from .launch import PlanMemory

        self._backend = arrays.resolve_backend(backend)
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        self._layout = kv_layout
        k_cache, _, self._combined = _split_cache(paged_kv_cache)
        self._num_pages, self._page_size, self._heads, self._dim = _cache_dims(k_cache,
                                                                              kv_layout)
        self._shape = tuple(k_cache.shape)
        self._memory = PlanMemory(self._backend) if self._backend != "reference" else None
        self._stream = arrays.stream_getter(k_cache) if self._backend == "cuda" else None
        self._fixed = None  # section capacities (tokens, tokens, batch + 1, pages) once reserved
        self._planned = None
        self._plans = 0  # plan() calls so far: the compiled loops serve from the second on
        self._compiled = False  # whether the last plan() took them (_plan_compiled)

    def reserve(self, max_tokens: int, max_batch: int, max_pages: int) -> None:
        """Fix the device memory for steps of up to these counts: one address and one section
        offset per index array whatever the step, so every run() launches with the same
        arguments (what a captured CUDA graph replays); a larger plan() then raises. The
        launch's grid follows the token count: a graph replays the ``nnz`` it was captured
        with, so plan only steps of that many tokens before replaying it."""
        caps = (check_positive_int("max_tokens", max_tokens),) * 2 + (
            check_positive_int("max_batch", max_batch) + 1,
            check_positive_int("max_pages", max_pages))
        if self._memory is not None:
            self._memory.reserve(sum(caps))
        self._fixed = caps
        self._planned = None  # the memory may have moved

    def plan(self, batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len) -> None:
        """Validate one step's indices (as :func:`append_paged_kv_cache` documents them) and
        upload them; every later :meth:`run` appends with them."""
        self._planned = None
        if self._backend != "reference" and self._plan_compiled(
                batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len):
            return
        nnz = int(arrays.host_int32(batch_indices, "batch_indices").size)
        table = _check_indices(batch_indices, positions, kv_indices, kv_indptr,
                               kv_last_page_len, nnz, self._num_pages, self._page_size)
        if self._backend == "reference":
            self._planned = (nnz, table)
            return
        bi, pos, indptr, indices = table[:4]
        sizes = [a.size for a in (bi, pos, indptr, indices)]
        if self._fixed is not None:  # fixed sections, each as long as its capacity
            if any(n > cap for n, cap in zip(sizes, self._fixed, strict=True)):
                raise ValueError(f"this step's append ({nnz} tokens, {indptr.size - 1} "
                                 f"requests, {indices.size} pages) does not fit the reserved "
                                 f"memory")
            sizes = list(self._fixed)
        words = sum(sizes)
        mem = self._memory
        staged = mem.staging(words)
        offsets = np.cumsum([0] + sizes)
        for a, o in zip((bi, pos, indptr, indices), offsets, strict=False):
            staged[o:o + a.size] = a
        self._upload(nnz, staged, sizes, offsets, int(offsets[3]) + indices.size)

    def _plan_compiled(self, bi, pos, indices, indptr, last) -> bool:
        """plan() in one compiled pass for 1-D int32 NumPy indices (a serving step's: the
        NumPy checks cost ~0.1 ms at 64 requests on a 2-core CPU), from the second plan of a
        process's compiled loops on; False (nothing planned) for any other input, or one the
        pass rejects, which plan()'s NumPy checks then name."""
        five = (bi, pos, indices, indptr, last)
        ready = self._plans or compiled.loaded()  # (a one-plan script never loads the loops)
        self._plans += 1
        self._compiled = False
        if not (ready and indptr.size and all(type(a) is np.ndarray and a.dtype == np.int32
                                              and a.ndim == 1 for a in five)):
            return False
        compiled.load()
        pages = max(int(indptr[-1]), 1)  # (words of the page section this step fills)
        sizes = [bi.size, pos.size, indptr.size, pages]
        if self._fixed is not None:
            if any(n > cap for n, cap in zip(sizes, self._fixed, strict=True)):
                return False  # (plan() raises once the indices are checked)
            sizes = list(self._fixed)
        offsets = [0, sizes[0], sizes[0] + sizes[1], sizes[0] + sizes[1] + sizes[2]]
        staged = self._memory.staging(offsets[3] + sizes[3])
        if not compiled.check_stage_append(bi, pos, indptr, indices, last, self._page_size,
                                           self._num_pages, staged, offsets):
            return False
        self._upload(bi.size, staged, sizes, offsets, offsets[3] + pages)
        self._compiled = True
        return True

    def _upload(self, nnz: int, staged: np.ndarray, sizes: list, offsets, used: int) -> None:
        """Copy the staged index sections (``sizes`` words at ``offsets`` of ``staged``, the
        staging buffer) to the device and keep their device views for run(); only the first
        ``used`` words (up to this step's last page id) are copied: a reserved page section
        holds the capacity of every request holding the whole pool (a CUDA-graph runner's
        64 x 5000 pages: 1.3 MB a step, where the step's own pages are ~20 KB)."""
        mem, words = self._memory, sum(sizes)
        if self._backend == "sim":
            buf = mem.get(words)
            buf[:used] = staged[:used]
            views = [buf[o:o + n] for o, n in zip(offsets, sizes, strict=False)]
        else:
            from ..kernels.launch import _driver, check

            mem.reserve(words)
            drv, stream = _driver(), self._stream()
            check(drv.memcpy_htod_async(mem.address, staged.ctypes.data, 4 * used, stream),
                  "cuMemcpyHtoDAsync")
            check(drv.event_record(mem.event, stream), "cuEventRecord")
            views = [_DeviceSpan(mem.address + 4 * int(o), n)
                     for o, n in zip(offsets, sizes, strict=False)]
        self._planned = (nnz, views)

    def run(self, append_key, append_value, paged_kv_cache) -> None:
        """Append ``append_key, append_value [nnz, Hkv, D]`` (the planned ``nnz``) to
        ``paged_kv_cache`` (the constructor's shape, dtype and device), in place."""
        if self._planned is None:
            raise RuntimeError("run() needs a successful plan() first")
        be = self._backend
        caches, combined, k_cache, dims, kind = _check_kv(append_key, append_value,
                                                          paged_kv_cache, self._layout, be)
        if tuple(k_cache.shape) != self._shape or combined != self._combined:
            raise ValueError(f"paged_kv_cache must have the planned shape {self._shape} "
                             f"({'combined' if self._combined else 'a (k, v) pair'}), got "
                             f"{tuple(k_cache.shape)}")
        nnz, views = self._planned
        check_dim("append_key", append_key, 0, nnz, "nnz planned")
        if be == "reference":
            bi, pos, indptr, indices, last = views
            reference.append_paged_kv_cache(append_key, append_value, bi, pos, paged_kv_cache,
                                            indices[:indptr[-1]], indptr, last,
                                            kv_layout=self._layout)
            return
        if be == "cuda" and kind == "numpy":
            raise TypeError("PagedKVAppendWrapper.run takes device arrays on the GPU backend")
        if be == "sim" and not combined and _pair_overlaps(*caches.values()):
            raise ValueError("k_cache and v_cache overlap: pass the combined [P, 2, ...] cache")
        _launch(append_key, append_value, caches, combined, self._layout, be, kind, views,
                self._stream() if self._stream is not None else 0, dims[1:])


class _DeviceSpan:
    """``n`` items of ``typestr`` at device address ``ptr``, as a kernel argument (no Numba
    device array: building one costs tens of microseconds)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, n: int, typestr: str = "<i4"):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None}


def _check_kv(append_key, append_value, paged_kv_cache, kv_layout, be):
    """The shape, dtype and placement checks of an append's keys, values and cache; returns
    ``(caches, combined, k_cache, (num_pages, page_size, heads, dim), kind)``."""
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    k_cache, v_cache, combined = _split_cache(paged_kv_cache)
    num_pages, page_size, heads, dim = _cache_dims(k_cache, kv_layout)
    kv_dtype = arrays.storage_dtype(k_cache, "paged_kv_cache", kv=True)
    for name, a in (("append_key", append_key), ("append_value", append_value)):
        check_ndim(name, a, 3)
        check_dim(name, a, 1, heads, "num_kv_heads of paged_kv_cache")
        check_dim(name, a, 2, dim, "head_dim of paged_kv_cache")
        got = arrays.storage_dtype(a, name, kv=True)
        if not arrays.same_kv_storage(got, kv_dtype):
            raise TypeError(f"{name} must have the cache's dtype {kv_dtype}, got {got}")
    nnz = int(append_key.shape[0])
    check_dim("append_value", append_value, 0, nnz, "nnz of append_key")
    caches = dict(paged_kv_cache=paged_kv_cache) if combined else dict(k_cache=k_cache,
                                                                        v_cache=v_cache)
    kind = check_placement(be, append_key=append_key, append_value=append_value, **caches)
    for name, a in caches.items():
        if isinstance(a, np.ndarray) and not a.flags.writeable:
            raise ValueError(f"{name} must be writable (it is updated in place)")
    return caches, combined, k_cache, (num_pages, page_size, heads, dim), kind


def _cache_dims(k_cache, kv_layout: str) -> tuple[int, int, int, int]:
    """``(num_pages, page_size, num_kv_heads, head_dim)`` of a K cache
    (NHD ``[P, PS, H, D]``, HND ``[P, H, PS, D]``)."""
    ps_axis, h_axis = (1, 2) if kv_layout == "NHD" else (2, 1)
    return tuple(int(k_cache.shape[a]) for a in (0, ps_axis, h_axis, 3))


def _pair_overlaps(k_cache, v_cache) -> bool:
    """Whether the spans the simulator's kernel views of K and V cover overlap (two views of
    one pool do, though no element is in both)."""
    (k, _), (v, _) = (arrays.kernel_view(a, "sim", n) for n, a in (("k_cache", k_cache),
                                                                   ("v_cache", v_cache)))
    return bool(np.shares_memory(k, v))


def _launch(append_key, append_value, caches, combined, kv_layout, be, kind, idx, stream,
            dims):
    """Launch the append kernel on ``stream`` over validated arguments; ``idx``: the kernel's
    views of batch_indices, positions, kv_indptr and kv_indices; ``dims``: the cache's
    ``(page_size, num_kv_heads, head_dim)``."""
    first_cache = next(iter(caches.values()))
    page_size, heads, dim = dims
    nnz = int(append_key.shape[0])
    if nnz == 0 or heads * dim == 0:
        return

    itemsize = ITEMSIZE.get(arrays.storage_dtype(first_cache, "paged_kv_cache", kv=True), 1)
    # Every array is read or written in place through its strides (last dimension contiguous):
    # the cache as the views it is, the new keys/values as the views they are.
    srcs = [arrays.kernel_view(a, be, name) for name, a in (("append_key", append_key),
                                                            ("append_value", append_value))]
    dsts = {name: arrays.kernel_view(a, be, name) for name, a in caches.items()}
    for name, (view, _) in dsts.items():
        if isinstance(view, np.ndarray) and not np.shares_memory(
                view, arrays.to_host_exact(caches[name])):
            raise ValueError(f"{name} must be writable memory the kernel can update in place")
    # Device views come as (pointer, elements): make them (pointer, bytes) for _words.
    srcs = [((v[0], v[1] * itemsize) if isinstance(v, tuple) else v, st) for v, st in srcs]
    dsts = {n: ((v[0], v[1] * itemsize) if isinstance(v, tuple) else v, st)
            for n, (v, st) in dsts.items()}
    views = [v for v, _ in (*srcs, *dsts.values())]
    strides = [st for _, st in (*srcs, *dsts.values())]
    word = choose_word_bytes(dim * itemsize, [_address(v) for v in views]
                             + [x * itemsize for st in strides for x in st[:-1]])
    per = word // itemsize  # elements per word
    rw = dim // per
    k_src, v_src = (_words(v, word, be) for v, _ in srcs)
    (ksn, ksh, _), (vsn, vsh, _) = (st for _, st in srcs)
    kst = next(iter(dsts.values()))[1]  # [P, (2,) PS, H, D] / [P, (2,) H, PS, D]
    first = 2 if combined else 1
    ps_axis, h_axis = (first, first + 1) if kv_layout == "NHD" else (first + 1, first)
    words = [_words(v, word, be) for v, _ in dsts.values()]
    if combined:
        # One page holds K then V: V starts kst[1] elements in. The kernel ignores v_cache then;
        # k_src stands in (never written, so the simulator's copy-back of it is harmless).
        k_words, v_words, v_offset = words[0], k_src, kst[1] // per
    else:
        vst = list(dsts.values())[1][1]
        if vst != kst:
            raise ValueError(f"v_cache must have the same strides as k_cache: got {vst} and "
                             f"{kst} (elements)")
        k_words, v_words, v_offset = words[0], words[1], 0
    kernel = build_append_kernel(AppendSpec(word, rw, page_size, combined, be == "sim"))
    grid, block = append_launch_config(nnz, heads * rw)
    scalars = (v_offset, kst[0] // per, kst[ps_axis] // per, kst[h_axis] // per, ksn // per,
               ksh // per, vsn // per, vsh // per)
    kernel[grid, block, stream](k_src, v_src, *idx, k_words, v_words, np.int32(heads),
                                *(np.int64(x) for x in scalars))
    if be == "cuda" and kind == "numpy":
        for user, (view, _) in zip(caches.values(), dsts.values(), strict=True):
            _copy_back(view, user)


def _append_on_copies(append_key, append_value, batch_indices, positions, caches, kv_indices,
                      kv_indptr, kv_last_page_len, kv_layout):
    """The simulator's append into contiguous copies of K and V, assigned back after."""
    k, v = (np.ascontiguousarray(arrays.to_host_exact(c)) for c in caches.values())
    append_paged_kv_cache(append_key, append_value, batch_indices, positions, (k, v), kv_indices,
                          kv_indptr, kv_last_page_len, kv_layout, backend="sim")
    for user, new in zip(caches.values(), (k, v), strict=True):
        arrays.to_host_exact(user)[...] = new
    return None


def _words(view, word: int, backend: str):
    """A 1-D kernel view (NumPy, a Numba device array, or ``(pointer, nitems)`` of device
    memory) reinterpreted as ``word``-byte machine words, without a copy."""
    if not isinstance(view, tuple):
        n = view.size * view.dtype.itemsize // word
        return view.view(np.uint8)[: n * word].view(WORD_DTYPES[word])
    ptr, nbytes = view
    return _DeviceSpan(ptr, nbytes // word, np.dtype(WORD_DTYPES[word]).str)


def _copy_back(view, user: np.ndarray) -> None:
    """The device copy of a NumPy cache (backend 'cuda') back into the caller's array."""
    host = view.copy_to_host().view(user.dtype).reshape(user.shape)
    user[...] = host


def _split_cache(paged_kv_cache):
    """``(k, v, combined)``: 4-D K and V views of a combined cache or a validated pair."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache as a tuple must be (k_cache, v_cache), "
                             f"got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        check_ndim("k_cache", k, 4)
        check_ndim("v_cache", v, 4)
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"v_cache.shape must equal k_cache.shape {tuple(k.shape)}, "
                             f"got {tuple(v.shape)}")
        kd = arrays.storage_dtype(k, "k_cache", kv=True)
        vd = arrays.storage_dtype(v, "v_cache", kv=True)
        if not arrays.same_kv_storage(kd, vd):
            raise TypeError(f"v_cache must have k_cache's dtype {kd}, got {vd}")
        return k, v, False
    check_ndim("paged_kv_cache", paged_kv_cache, 5)
    check_dim("paged_kv_cache", paged_kv_cache, 1, 2, "K and V")
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1], True


def _check_indices(batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len, nnz,
                   num_pages, page_size):
    """Validate on the host; return the int32 arrays the kernel reads (same order as its args)."""
    bi = arrays.host_int32(batch_indices, "batch_indices")
    pos = arrays.host_int32(positions, "positions")
    for name, a in (("batch_indices", bi), ("positions", pos)):
        check_ndim(name, a, 1)
        check_dim(name, a, 0, nnz, "nnz of append_key")
    indptr, indices, last, kv_len = check_page_table(
        arrays.host_index(kv_indptr, "kv_indptr"), arrays.host_index(kv_indices, "kv_indices"),
        arrays.host_index(kv_last_page_len, "kv_last_page_len"), page_size, num_pages=num_pages,
        names=("kv_indptr", "kv_indices", "kv_last_page_len"))
    check_range("batch_indices", bi, 0, indptr.size - 1)
    beyond = (pos < 0) | (pos >= kv_len[bi])
    if np.any(beyond):
        t = int(np.argmax(beyond))
        raise ValueError(f"positions[{t}]={pos[t]} must lie in [0, kv_len) of request {bi[t]} "
                         f"(kv_len {kv_len[bi[t]]} from the page table)")
    # The kernel indexes kv_indices, so an empty table still needs one element to pass.
    return bi, pos, indptr, indices if indices.size else np.zeros(1, np.int32), last


def _index_arg(user, host: np.ndarray, backend: str):
    """Kernel view of a validated index array: the caller's own device memory when it already
    is contiguous int32 (no allocation, no upload: each costs more than this kernel's launch),
    else the checked host copy."""
    on_device = not isinstance(user, (list, tuple, np.ndarray)) and arrays.device_of(user) != "host"
    if backend == "cuda" and on_device and dtype_name(user) == "int32" and arrays.is_contiguous(user) \
            and host.size == int(np.prod(user.shape)) and int(np.prod(user.shape)) > 0:
        return arrays.to_kernel(user, backend)
    return arrays.to_kernel(host, backend)


def _address(a) -> int:
    """Base address of a kernel argument (device or host)."""
    if isinstance(a, tuple):
        return int(a[0])
    iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return int(iface["data"][0])


def _like(template, host: np.ndarray):
    """``host`` as an array of ``template``'s kind and device."""
    kind = "numpy" if isinstance(template, (list, tuple)) else arrays.array_kind(template)
    if kind == "torch":
        import torch

        return torch.from_numpy(host).to(template.device)
    if kind == "cupy":
        import cupy

        with template.device:
            return cupy.asarray(host)
    if kind == "numba":
        from numba import cuda

        return cuda.to_device(host)
    return host
