"""FlashInfer-compatible batch decode: ``BatchDecodeWithPagedKVCacheWrapper`` and single decode.

``plan()`` runs on the CPU once per generation step: it validates the page table, splits long
requests into KV chunks so that every SM has work, and builds the work list and the merge map.
``run()`` launches the decode kernel (and, when some request was split, the merge kernel) and is
called once per layer with the same plan.
"""

from __future__ import annotations

import numpy as np

from .. import reference, scheduler
from .._checks import (
    KV_LAYOUTS,
    check_choice,
    check_dim,
    check_heads,
    check_ndim,
    check_positive_int,
    check_sm_scale,
)
from ..kernels.decode import DecodeSpec
from ..scheduler import PlanLayout
from ..variants import compose, from_flashinfer_args
from . import arrays, binding
from .decode_fast import TorchFastPath, run_fast
from .decode_launch import ARG, DecodeLaunch
from .dtypes import normalize_dtype
from .workspace import WorkspaceLayout, item_merge_lists


def persistent_ctas(backend: str, per_sm: int = 0) -> int:
    """The fixed grid: ``per_sm`` resident CTAs per SM (default four 128-thread decode CTAs, which
    the register cap allows); two in the simulator, where every CTA is a set of OS threads."""
    if backend != "cuda":
        return 2
    from numba import cuda

    return cuda.get_current_device().MULTIPROCESSOR_COUNT * (per_sm or CTAS_PER_SM)


# A chunk shorter than this costs more in merge traffic than it gains in parallelism; chunk
# boundaries are multiples of it (the scheduler's granule).
MIN_CHUNK = 256
CTAS_PER_SM = 4


class BatchDecodeWithPagedKVCacheWrapper:
    """Batch decode attention over a paged KV cache, with FlashInfer's plan/run interface.

    Parameters
    ----------
    float_workspace_buffer : array (uint8 or any dtype), on the device that runs the kernels
        Scratch for partial states of split requests (FlashInfer suggests 128 MiB).
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "cuda", "sim", "reference"}
        ``"auto"`` runs the CUDA kernels when a GPU is present, else the simulator.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, *, backend: str = "auto"):
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        self._backend = arrays.resolve_backend(backend)
        arrays.array_kind(float_workspace_buffer)
        if use_tensor_cores:
            raise NotImplementedError("use_tensor_cores: nbinfer's decode runs on CUDA cores only")
        buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph and any(b is None for b in buffers):
            raise ValueError("use_cuda_graph=True needs paged_kv_indptr_buffer, "
                             "paged_kv_indices_buffer and paged_kv_last_page_len_buffer (fixed "
                             "addresses the captured kernel reads every step)")
        if use_cuda_graph:
            for name, buf in zip(("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                  "paged_kv_last_page_len_buffer"), buffers, strict=True):
                check_ndim(name, buf, 1)
                if arrays.dtype_name(buf) != "int32":
                    raise TypeError(f"{name} must be int32, got {arrays.dtype_name(buf)}")
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._graph_buffers = buffers if use_cuda_graph else None
        self._graph_layout = None
        self._plan = None

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

        ``indptr [B+1]``, ``indices [nnz_pages]``, ``last_page_len [B]`` are int32 page-table
        arrays as in FlashInfer; ``variant`` is an extra :class:`~nbinfer.variants.Variant`
        composed after the one the keyword flags describe. ``fixed_split_size`` cuts every
        request's KV into chunks of exactly that many tokens, so a request's output bits do not
        depend on the rest of the batch (batch invariance).

        The work list comes from :func:`nbinfer.scheduler.plan` (LPT over a fixed persistent
        grid); it is copied into the workspace with the page table in one transfer on the
        current stream, and serves every run() until the next plan().
        """
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim", head_dim)
        page_size = check_positive_int("page_size", page_size)
        indptr, indices, last, kv_lens = binding.page_table(indptr, indices, last_page_len,
                                                            page_size)
        batch = indptr.size - 1
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        var = from_flashinfer_args(window_left=window_left, logits_soft_cap=logits_soft_cap,
                                   pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                   rope_theta=rope_theta, num_qo_heads=num_qo_heads)
        if variant is not None:
            var = compose(var, variant)
        plan = dict(indptr=indptr, indices=indices, last=last, batch=batch,
                    num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype, sm_scale=sm_scale,
                    variant=var, kv_lens=kv_lens,
                    flags=dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                               rope_scale=rope_scale, rope_theta=rope_theta))
        if self._backend != "reference":
            spec = DecodeSpec(head_dim=head_dim, group_size=group, page_size=page_size,
                              kv_dtype=kv_dtype, q_dtype=q_dtype, kv_layout=self._kv_layout,
                              variant=var, sparse=True, sim=self._backend == "sim")
            num_ctas = persistent_ctas(self._backend)
            sched = scheduler.plan(np.arange(batch + 1), kv_lens, num_qo_heads, num_kv_heads,
                                   num_ctas, granule=max(MIN_CHUNK, spec.tokens_per_group * 4),
                                   fixed_split_size=fixed_split_size)
            layout = self._layout_for(sched, batch, indices.size, num_qo_heads, num_kv_heads,
                                      head_dim, page_size, fixed_split_size)
            launch = DecodeLaunch(spec, self._workspace, layout, self._backend, num_ctas,
                                  sm_scale, self._graph_buffers)
            table = (indptr, indices, last)
            staged = layout.stage(sched, item_merge_lists(sched),
                                  None if self._graph_buffers else table)
            launch.upload(staged, table, arrays.current_stream(self._workspace))
            plan.update(spec=spec, schedule=sched, layout=layout, launch=launch)
            if self._backend == "cuda" and arrays.array_kind(self._workspace) == "torch":
                plan["fast"] = TorchFastPath(plan, self._kv_layout, self._workspace.device)
        self._plan = plan

    def _layout_for(self, sched, batch, pages, hq, hkv, d, page_size, fixed_split_size):
        """The plan's own layout, or in CUDA-graph mode one fixed layout for every step."""
        if self._graph_buffers is None:
            return WorkspaceLayout(PlanLayout.for_plan(sched), hkv, hq, d, batch, pages)
        if self._graph_layout is None:
            max_batch = int(self._graph_buffers[2].shape[0])
            max_pages = int(self._graph_buffers[1].shape[0])
            # With fixed chunks the item count grows with the KV: bound it by the page buffer.
            max_kv = max_pages * page_size if fixed_split_size else None
            plan_layout = PlanLayout.bound(sched.num_ctas, max_batch, hq, hkv, max_kv_len=max_kv,
                                           fixed_split_size=fixed_split_size)
            self._graph_layout = WorkspaceLayout(plan_layout, hkv, hq, d, max_batch, max_pages)
        layout = self._graph_layout
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
        q : array [batch_size, num_qo_heads, head_dim], dtype ``q_data_type``
        paged_kv_cache : array ``[num_pages, 2, page_size, Hkv, D]`` (NHD) /
            ``[num_pages, 2, Hkv, page_size, D]`` (HND), or a ``(k_cache, v_cache)`` pair of
            ``[num_pages, page_size, Hkv, D]`` / ``[num_pages, Hkv, page_size, D]``.
        out, lse : optional preallocated outputs ([B, Hq, D] in q's dtype, [B, Hq] float32)
        return_lse : bool

        Returns
        -------
        out [B, Hq, D] of q's kind and dtype, and ``lse [B, Hq]`` float32 (natural log) if
        ``return_lse``.
        """
        p = self._plan
        if p is None:
            raise RuntimeError("run() called before plan()")
        res = run_fast(p, q, paged_kv_cache, out, lse, return_lse)
        if res is not None:
            return res
        B, Hq, Hkv, D, PS = p["batch"], p["num_qo_heads"], p["num_kv_heads"], p["head_dim"], \
            p["page_size"]
        check_ndim("q", q, 3)
        check_dim("q", q, 0, B, "batch_size planned")
        check_dim("q", q, 1, Hq, "num_qo_heads")
        check_dim("q", q, 2, D, "head_dim")
        if arrays.storage_dtype(q) != p["q_dtype"]:
            raise TypeError(f"q must have dtype {p['q_dtype']} (planned q_data_type), "
                            f"got {arrays.storage_dtype(q)}")
        k_cache, v_cache, combined = _split_cache(paged_kv_cache, self._kv_layout, PS, Hkv, D,
                                                  p["kv_dtype"])
        num_pages = k_cache.shape[0]
        if p["indices"].size and int(p["indices"].max()) >= num_pages:
            raise ValueError(f"indices values must lie in [0, {num_pages}) (pages in the cache), "
                             f"got {int(p['indices'].max())}")
        binding.same_device(q=q, paged_kv_cache=k_cache, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            return _reference_decode(q, (k_cache, v_cache), p, self._kv_layout, return_lse)

        be = self._backend
        kind = arrays.array_kind(q)
        out_user, out_k = binding.output(out, "out", kind, q, (B, Hq, D), p["q_dtype"], be)
        lse_user, lse_k = binding.output(lse, "lse", kind, q, (B, Hq), "float32", be)
        dec = p["launch"].launch
        binding.bind(dec, ARG["q"], q, be)
        if combined:
            page_stride = 2 * PS * Hkv * D
            binding.bind(dec, ARG["k"], paged_kv_cache, be)
            binding.bind(dec, ARG["v"], paged_kv_cache, be, offset=PS * Hkv * D)
        else:
            page_stride = PS * Hkv * D
            binding.bind(dec, ARG["k"], k_cache, be)
            binding.bind(dec, ARG["v"], v_cache, be)
        dec.set_scalar(ARG["page_stride"], page_stride)
        binding.bind(dec, ARG["o"], out_k, be)
        binding.bind(dec, ARG["lse"], lse_k, be)
        dec(arrays.current_stream(q))
        out_user = arrays.finish(kind, out_user, out_k, be)
        if return_lse:
            return out_user, arrays.finish(kind, lse_user, lse_k, be)
        return out_user


def _split_cache(paged_kv_cache, layout, page_size, num_kv_heads, head_dim, kv_dtype):
    """Validate the cache's shape/dtype; return ``(k, v, combined)`` with 4-D k/v views."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache tuple must be (k_cache, v_cache), "
                             f"got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        for name, a in (("k_cache", k), ("v_cache", v)):
            check_ndim(name, a, 4)
            _check_page_dims(name, a, 1, layout, page_size, num_kv_heads, head_dim, kv_dtype)
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
        return k, v, False
    check_ndim("paged_kv_cache", paged_kv_cache, 5)
    check_dim("paged_kv_cache", paged_kv_cache, 1, 2, "K and V")
    _check_page_dims("paged_kv_cache", paged_kv_cache, 2, layout, page_size, num_kv_heads,
                     head_dim, kv_dtype)
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1], True


def _check_page_dims(name, a, first, layout, page_size, num_kv_heads, head_dim, kv_dtype):
    ps_axis, h_axis = (first, first + 1) if layout == "NHD" else (first + 1, first)
    check_dim(name, a, ps_axis, page_size, "page_size planned")
    check_dim(name, a, h_axis, num_kv_heads, "num_kv_heads")
    check_dim(name, a, first + 2, head_dim, "head_dim")
    if arrays.storage_dtype(a) != kv_dtype:
        raise TypeError(f"{name} must have dtype {kv_dtype} (planned kv_data_type), "
                        f"got {arrays.storage_dtype(a)}")


def _reference_decode(q, cache, p, layout, return_lse):
    host = arrays.to_host
    res = reference.batch_decode_with_paged_kv_cache(
        host(q), (host(cache[0]), host(cache[1])), p["indptr"], p["indices"], p["last"],
        kv_layout=layout, variant=p["variant"], sm_scale=p["sm_scale"], return_lse=return_lse)
    return res


__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "MIN_CHUNK", "persistent_ctas"]
