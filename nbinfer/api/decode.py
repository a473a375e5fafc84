"""FlashInfer-compatible batch decode: ``BatchDecodeWithPagedKVCacheWrapper``.

``plan()`` runs on the CPU once per generation step: it validates the page table, splits long
requests into KV chunks so that every SM has work, and builds the work list and the merge map
into a :class:`~nbinfer.api.step.StepPlan`. ``run()`` launches the decode kernel (split rows
merged inside it) and is called once per layer with the same plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import reference, scheduler
from .._checks import check_dim, check_heads, check_ndim, check_positive_int, check_sm_scale
from ..kernels.decode import DecodeSpec
from ..scheduler import PlanLayout
from ..variants import compose, from_flashinfer_args
from ..variants import resolve as resolve_variant
from . import arrays, binding
from .base import WrapperBase, kv_strides, write_reference
from .dtypes import normalize_dtype
from .fast_path import TorchFastPath, run_fast
from .launch import AttentionLaunch
from .step import StepPlan
from .workspace import WorkspaceLayout, item_merge_lists

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "MIN_CHUNK", "persistent_ctas", "split_cache"]

# A chunk shorter than this costs more in merge traffic than it gains in parallelism; chunk
# boundaries are multiples of it (the scheduler's granule).
MIN_CHUNK = 256
CTAS_PER_SM = 4


def persistent_ctas(backend: str, per_sm: int = 0) -> int:
    """The fixed grid: ``per_sm`` resident CTAs per SM (default four 128-thread decode CTAs, which
    the register cap allows); two in the simulator, where every CTA is a set of OS threads."""
    if backend != "cuda":
        return 2
    from numba import cuda

    return cuda.get_current_device().MULTIPROCESSOR_COUNT * (per_sm or CTAS_PER_SM)


def attention_variant(num_qo_heads, variant, **flags):
    """The variant FlashInfer's flags describe, composed with a user ``variant`` (a Variant, a
    built-in name or None)."""
    var = from_flashinfer_args(num_qo_heads=num_qo_heads, **flags)
    extra = resolve_variant(variant)
    return var if extra is None else compose(var, extra)


class BatchDecodeWithPagedKVCacheWrapper(WrapperBase):
    """Batch decode attention over a paged KV cache, with FlashInfer's plan/run interface.

    Parameters
    ----------
    float_workspace_buffer : array (uint8 or any dtype), on the device that runs the kernels
        Scratch for partial states of split requests (FlashInfer suggests 128 MiB); any number
        of wrappers may share one (each keeps its plan in memory of its own).
    kv_layout : {"NHD", "HND"}
    use_cuda_graph : bool
        Fixed buffers for the page table (the ``paged_kv_*_buffer`` arguments) and a fixed
        workspace layout, so that a captured ``run()`` replays correctly after any ``plan()``.
    backend : {"auto", "cuda", "sim", "reference"}
        ``"auto"``: the simulator when active, else the GPU, else the reference engine.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, *, backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout, backend=backend)
        if use_tensor_cores:
            raise NotImplementedError("use_tensor_cores: nbinfer's decode runs on CUDA cores only")
        buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                 "paged_kv_last_page_len_buffer")
        if use_cuda_graph and any(b is None for b in buffers):
            raise ValueError("use_cuda_graph=True needs paged_kv_indptr_buffer, "
                             "paged_kv_indices_buffer and paged_kv_last_page_len_buffer (fixed "
                             "addresses the captured kernel reads every step)")
        if use_cuda_graph:
            for name, buf in zip(names, buffers, strict=True):
                arrays.array_kind(buf, name)
                check_ndim(name, buf, 1)
                if arrays.dtype_name(buf) != "int32":
                    raise TypeError(f"{name} must be int32, got {arrays.dtype_name(buf)}")
        self._graph_buffers = buffers if use_cuda_graph else None
        self._graph_layout = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph_buffers is not None

    # ------------------------------------------------------------------------------------------
    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
             fixed_split_size: int | None = None, variant=None) -> None:
        """Validate the page table and build the work list for this step (CPU only).

        ``indptr [B+1]``, ``indices [>= indptr[-1]]`` (only the first ``indptr[-1]`` are read),
        ``last_page_len [B]``: the page table as in FlashInfer, any integer dtype (range-checked
        before narrowing to int32) and array kind; ``variant`` is an extra
        :class:`~nbinfer.variants.Variant` (or a built-in name) composed after the one the
        keyword flags describe. ``fixed_split_size`` cuts every request's KV into chunks of
        exactly that many tokens, so a request's output bits do not depend on the rest of the
        batch (batch invariance).

        The work list comes from :func:`nbinfer.scheduler.plan` (LPT over a fixed persistent
        grid); it is copied into the wrapper's plan memory with the page table in one transfer
        on the current stream, and serves every run() until the next plan(). A failed plan()
        leaves no plan: run() raises until plan() succeeds.
        """
        self._install(self._build, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                      head_dim, page_size, pos_encoding_mode=pos_encoding_mode,
                      window_left=window_left, logits_soft_cap=logits_soft_cap,
                      sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                      q_data_type=q_data_type, kv_data_type=kv_data_type,
                      fixed_split_size=fixed_split_size, variant=variant)

    def _build(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
               page_size, *, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
               rope_scale, rope_theta, q_data_type, kv_data_type, fixed_split_size, variant):
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim", head_dim)
        page_size = check_positive_int("page_size", page_size)
        if fixed_split_size is not None:
            check_positive_int("fixed_split_size", fixed_split_size)
        indptr, indices, last, kv_lens = binding.page_table(indptr, indices, last_page_len,
                                                            page_size)
        batch = indptr.size - 1
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        var = attention_variant(num_qo_heads, variant, window_left=window_left,
                                logits_soft_cap=logits_soft_cap,
                                pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                rope_theta=rope_theta)
        step = StepPlan(batch, batch, num_qo_heads, num_kv_heads, head_dim, page_size, q_dtype,
                        kv_dtype, sm_scale, var, binding.frozen(np.arange(batch + 1, dtype=np.int32)),
                        indptr, indices, last, kv_lens)
        if self._backend == "reference":
            return step
        spec = DecodeSpec(head_dim=head_dim, group_size=group, page_size=page_size,
                          kv_dtype=kv_dtype, q_dtype=q_dtype, kv_layout=self._kv_layout,
                          variant=var, sparse=True, sim=self._backend == "sim")
        num_ctas = persistent_ctas(self._backend)
        sched = scheduler.plan(np.arange(batch + 1), kv_lens, num_qo_heads, num_kv_heads,
                               num_ctas, granule=max(MIN_CHUNK, spec.tokens_per_group * 4),
                               fixed_split_size=fixed_split_size)
        layout = self._layout_for(sched, batch, indices.size, num_qo_heads, num_kv_heads,
                                  head_dim, page_size, fixed_split_size)
        launch = AttentionLaunch(spec, self._workspace, layout, self._backend, num_ctas,
                                 sm_scale, self._memory, self._graph_buffers)
        table = (indptr, indices, last)
        staged = layout.stage(sched, item_merge_lists(sched),
                              None if self._graph_buffers else table)
        launch.upload(staged, table, arrays.current_stream(self._workspace))
        fast = None
        if self._backend == "cuda" and arrays.array_kind(self._workspace) == "torch":
            fast = TorchFastPath(step, launch, self._kv_layout, self._workspace.device)
        if self._graph_buffers is not None:
            self._graph_layout = layout
        return dataclasses.replace(step, schedule=sched, spec=spec, launch=launch, fast=fast)

    def _layout_for(self, sched, batch, pages, hq, hkv, d, page_size, fixed_split_size):
        """The plan's own layout, or in CUDA-graph mode one fixed layout for every step."""
        if self._graph_buffers is None:
            return WorkspaceLayout(PlanLayout.for_plan(sched), hkv, hq, d, batch, pages)
        layout = self._graph_layout
        if layout is None:  # fixed by the first plan() that succeeds (_build sets it)
            max_batch = int(self._graph_buffers[2].shape[0])
            max_pages = int(self._graph_buffers[1].shape[0])
            # With fixed chunks the item count grows with the KV: bound it by the page buffer.
            max_kv = max_pages * page_size if fixed_split_size else None
            plan_layout = PlanLayout.bound(sched.num_ctas, max_batch, hq, hkv, max_kv_len=max_kv,
                                           fixed_split_size=fixed_split_size)
            layout = WorkspaceLayout(plan_layout, hkv, hq, d, max_batch, max_pages)
        if (layout.num_kv_heads, layout.num_qo_heads, layout.head_dim) != (hkv, hq, d):
            raise ValueError("a CUDA-graph wrapper keeps its head counts and head_dim: planned "
                             f"{(hq, hkv, d)}, first plan had "
                             f"{(layout.num_qo_heads, layout.num_kv_heads, layout.head_dim)}")
        if not layout.fits(sched, batch, pages):
            raise ValueError(f"this step does not fit the CUDA-graph buffers: batch {batch} "
                             f"(max {layout.max_batch}), {pages} pages (max {layout.max_pages})")
        return layout

    # ------------------------------------------------------------------------------------------
    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False):
        """Decode attention for the planned batch.

        Parameters
        ----------
        q : array [batch_size, num_qo_heads, head_dim], dtype ``q_data_type``; a strided view
            (contiguous last dimension) is read in place.
        paged_kv_cache : array ``[num_pages, 2, page_size, Hkv, D]`` (NHD) /
            ``[num_pages, 2, Hkv, page_size, D]`` (HND), or a ``(k_cache, v_cache)`` pair of
            ``[num_pages, page_size, Hkv, D]`` / ``[num_pages, Hkv, page_size, D]``; views with a
            contiguous last dimension and 16-byte strides are read in place.
        out, lse : optional outputs ([B, Hq, D] in q's dtype, [B, Hq] float32), C-contiguous,
            writable, on q's device: the result is written into them.
        return_lse : bool

        Returns
        -------
        out [B, Hq, D] of q's kind and dtype, and ``lse [B, Hq]`` float32 (natural log) if
        ``return_lse``.
        """
        step = self._slot.get()
        res = run_fast(step, q, paged_kv_cache, out, lse, return_lse)
        if res is not None:
            return res
        B, Hq, D = step.batch_size, step.num_qo_heads, step.head_dim
        check_q("q", q, (B, Hq, D), ("batch_size planned", "num_qo_heads", "head_dim"),
                step.q_dtype)
        k_cache, v_cache, _ = split_cache(paged_kv_cache, self._kv_layout, step)
        binding.same_device(q=q, paged_kv_cache=k_cache, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            host = arrays.to_host
            res = reference.batch_decode_with_paged_kv_cache(
                host(q), (host(k_cache), host(v_cache)), *step.page_table,
                kv_layout=self._kv_layout, variant=step.variant, sm_scale=step.sm_scale,
                return_lse=return_lse or lse is not None)
            return write_reference(res, out, lse, q, (B, Hq, D), step.q_dtype, return_lse)
        names = ("paged_kv_cache", "paged_kv_cache") if not isinstance(
            paged_kv_cache, (tuple, list)) else ("k_cache", "v_cache")
        return self._launch(step, q, (k_cache, v_cache), names,
                            kv_strides(self._kv_layout, paged=True), out, lse, return_lse)


def check_q(name, q, shape, what, dtype):
    """Require ``q`` of ``shape`` (``what`` names each axis) and the planned dtype."""
    check_ndim(name, q, len(shape))
    for axis, n in enumerate(shape):
        check_dim(name, q, axis, n, what[axis])
    if arrays.storage_dtype(q, name) != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (planned q_data_type), "
                        f"got {arrays.storage_dtype(q, name)}")


def split_cache(paged_kv_cache, layout, step, indices_name="indices"):
    """Validate a paged cache against the plan; return ``(k, v, combined)`` 4-D K and V views.
    Every page id of the plan must lie in the cache."""
    PS, Hkv, D, kv_dtype = step.page_size, step.num_kv_heads, step.head_dim, step.kv_dtype
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache tuple must be (k_cache, v_cache), "
                             f"got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        for name, a in (("k_cache", k), ("v_cache", v)):
            arrays.array_kind(a, name)
            check_ndim(name, a, 4)
            _check_page_dims(name, a, 1, layout, PS, Hkv, D, kv_dtype)
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs "
                             f"{tuple(v.shape)}")
        out = (k, v, False)
    else:
        arrays.array_kind(paged_kv_cache, "paged_kv_cache")
        check_ndim("paged_kv_cache", paged_kv_cache, 5)
        check_dim("paged_kv_cache", paged_kv_cache, 1, 2, "K and V")
        _check_page_dims("paged_kv_cache", paged_kv_cache, 2, layout, PS, Hkv, D, kv_dtype)
        out = (paged_kv_cache[:, 0], paged_kv_cache[:, 1], True)
    num_pages = int(out[0].shape[0])
    indices = step.kv_indices
    if indices.size and int(indices.max()) >= num_pages:
        raise ValueError(f"{indices_name} values must lie in [0, {num_pages}) (pages in "
                         f"paged_kv_cache), got {int(indices.max())}")
    return out


def _check_page_dims(name, a, first, layout, page_size, num_kv_heads, head_dim, kv_dtype):
    ps_axis, h_axis = (first, first + 1) if layout == "NHD" else (first + 1, first)
    check_dim(name, a, ps_axis, page_size, "page_size planned")
    check_dim(name, a, h_axis, num_kv_heads, "num_kv_heads")
    check_dim(name, a, first + 2, head_dim, "head_dim")
    if arrays.storage_dtype(a, name) != kv_dtype:
        raise TypeError(f"{name} must have dtype {kv_dtype} (planned kv_data_type), "
                        f"got {arrays.storage_dtype(a, name)}")
