"""FlashInfer-compatible prefill: paged and ragged batch wrappers, and single prefill.

``plan()`` validates the batch, builds the attention variant from FlashInfer's flags, packs any
custom mask, schedules query tiles x KV chunks over the fixed grid (:mod:`nbinfer.scheduler`,
causal-aware), and copies plan, page table / KV offsets and mask into the workspace in one
transfer. ``run()`` binds q, the KV and the outputs and launches the tile kernel
(:mod:`nbinfer.kernels.prefill`) once; split rows are merged inside it.

A custom mask is AND-ed with the flags' masks, as in the reference engine (FlashInfer ignores
``causal`` when a custom mask is given: pass ``causal=False`` for its behaviour).
"""

from __future__ import annotations

import numpy as np

from .. import reference, scheduler
from .._checks import (
    KV_LAYOUTS,
    check_choice,
    check_dim,
    check_heads,
    check_indptr,
    check_ndim,
    check_positive_int,
    check_sm_scale,
)
from ..formats import segment_packbits
from ..kernels.prefill import NUM_THREADS as PREFILL_THREADS
from ..kernels.prefill import PLAN_OFFSETS, PrefillSpec, build_prefill_kernel, prefill_signature
from ..kernels.prefill_mma import MmaPrefillSpec, build_prefill_mma_kernel, mma_eligible
from ..reference._batch import batch_masks
from ..scheduler import PlanLayout
from ..variants import compose, from_flashinfer_args
from . import arrays, binding
from .decode import MIN_CHUNK, persistent_ctas
from .decode_fast import TorchFastPath, run_fast
from .decode_launch import ARG, DecodeLaunch
from .dtypes import normalize_dtype
from .workspace import WorkspaceLayout, item_merge_lists

# The tensor-core kernel needs up to 255 registers x 128 threads: two CTAs fit an SM's 64 Ki.
MMA_CTAS_PER_SM = 2

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "single_prefill_with_kv_cache"]


class _PrefillWrapper:
    """What the paged and ragged wrappers share: plan bookkeeping, the launch, run()."""

    _sparse = True
    # Whether plan() prepares the torch fast path of run() (the paged cache's run() takes it).
    _torch_fast_path = False

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", *, backend: str = "auto"):
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        self._backend = arrays.resolve_backend(backend)
        arrays.array_kind(float_workspace_buffer)
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._plan = None

    def _make_plan(self, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size,
                   table, *, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                   window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
                   kv_data_type, fixed_split_size, variant, masks=None, q_pos0=None):
        # ``masks`` (per-request bool masks, already validated) and ``q_pos0`` (BSR query
        # positions) come from BlockSparseAttentionWrapper.
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim_qk", head_dim)
        qo_indptr = check_indptr("qo_indptr", arrays.host_int32(qo_indptr, "qo_indptr"))
        batch = qo_indptr.size - 1
        if kv_lens.size != batch:
            raise ValueError(f"the KV index arrays describe {kv_lens.size} requests, qo_indptr "
                             f"{batch}")
        qo_lens = np.diff(qo_indptr)
        if masks is None:
            masks = batch_masks(custom_mask, packed_custom_mask, None, qo_lens, kv_lens)
        var = from_flashinfer_args(causal=causal, window_left=window_left,
                                   logits_soft_cap=logits_soft_cap,
                                   pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                   rope_theta=rope_theta, num_qo_heads=num_qo_heads)
        if variant is not None:
            var = compose(var, variant)
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type)
        p = dict(qo_indptr=qo_indptr, kv_lens=kv_lens, table=table, batch=batch,
                 num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                 sm_scale=check_sm_scale(sm_scale, head_dim), variant=var, masks=masks,
                 custom=masks[0] is not None if batch else False, q_pos0=q_pos0)
        if self._backend != "reference":
            p.update(self._prepare(p, group, causal, fixed_split_size))
        self._plan = p

    def _prepare(self, p, group, causal, fixed_split_size):
        spec, kernel, threads, num_ctas = self._kernel(p, group)
        sched = scheduler.plan(p["qo_indptr"], p["kv_lens"], p["num_qo_heads"],
                               p["num_kv_heads"], num_ctas, granule=MIN_CHUNK, causal=causal,
                               fixed_split_size=fixed_split_size, tile_q=spec.tile_q)
        return self._upload(p, spec, kernel, threads, sched, p["qo_indptr"],
                            np.ascontiguousarray(p["qo_indptr"][1:]))

    def _kernel(self, p, group):
        """The kernel for the planned problem: ``(spec, compiled, threads, grid CTAs)``."""
        sim = self._backend == "sim"
        args = (p["head_dim"], group, p["page_size"], p["kv_dtype"], p["q_dtype"],
                self._kv_layout, p["variant"])
        flags = dict(sparse=self._sparse, custom_mask=p["custom"],
                     block_positions=p["q_pos0"] is not None, sim=sim)
        if mma_eligible(p["head_dim"], p["q_dtype"], p["kv_dtype"]):
            # Tensor cores; two warps in the simulator (every simulated thread is an OS thread).
            spec = MmaPrefillSpec(*args, **flags, num_warps=2 if sim else 4)
            return (spec, build_prefill_mma_kernel(spec), spec.num_threads,
                    persistent_ctas(self._backend, MMA_CTAS_PER_SM))
        spec = PrefillSpec(*args, **flags)
        return spec, build_prefill_kernel(spec), PREFILL_THREADS, persistent_ctas(self._backend)

    def _upload(self, p, spec, kernel, threads, sched, qo_start, qo_end):
        """Lay out the workspace for ``sched`` and copy plan, page table, query ranges
        (``qo_start`` [B] or the indptr, ``qo_end`` [B]) and masks there."""
        mask_ptr, words = _packed_mask_words(p["masks"], p["batch"]) if p["custom"] else (None,
                                                                                         None)
        table = p["table"]
        layout = WorkspaceLayout(PlanLayout.for_plan(sched), p["num_kv_heads"],
                                 p["num_qo_heads"], p["head_dim"], p["batch"], table[1].size,
                                 0 if words is None else words.size)
        launch = DecodeLaunch(spec, self._workspace, layout, self._backend, sched.num_ctas,
                              p["sm_scale"], kernel=(kernel, prefill_signature(spec),
                                                     PLAN_OFFSETS), num_threads=threads)
        staged = layout.stage(sched, item_merge_lists(sched), table, qo_indptr=qo_start,
                              mask_indptr=mask_ptr, mask_words=words, q_pos0=p["q_pos0"],
                              qo_end=qo_end)
        launch.upload(staged, table, arrays.current_stream(self._workspace))
        res = dict(spec=spec, schedule=sched, layout=layout, launch=launch)
        if (self._torch_fast_path and self._backend == "cuda"
                and arrays.array_kind(self._workspace) == "torch"):
            # The paged cache's run() for torch tensors that match the plan: a few comparisons
            # and a prepared launch, like decode's.
            res["fast"] = TorchFastPath(dict(p, launch=launch), self._kv_layout,
                                        self._workspace.device, rows=int(p["qo_indptr"][-1]),
                                        indices=table[1])
        return res

    def _run(self, q, k, v, k_off, page_stride, head_stride, out, lse, return_lse):
        p = self._plan
        nnz = int(p["qo_indptr"][-1])
        shape = (nnz, p["num_qo_heads"], p["head_dim"])
        check_ndim("q", q, 3)
        for axis, what in enumerate(("qo_indptr[-1]", "num_qo_heads", "head_dim")):
            check_dim("q", q, axis, shape[axis], what)
        if arrays.storage_dtype(q) != p["q_dtype"]:
            raise TypeError(f"q must have dtype {p['q_dtype']} (planned q_data_type), "
                            f"got {arrays.storage_dtype(q)}")
        be = self._backend
        kind = arrays.array_kind(q)
        out_user, out_k = binding.output(out, "out", kind, q, shape, p["q_dtype"], be)
        lse_user, lse_k = binding.output(lse, "lse", kind, q, shape[:2], "float32", be)
        L = p["launch"].launch
        binding.bind(L, ARG["q"], q, be)
        binding.bind(L, ARG["k"], k, be)
        binding.bind(L, ARG["v"], v, be, offset=k_off)
        L.set_scalar(ARG["page_stride"], page_stride)
        L.set_scalar(ARG["head_stride"], head_stride)
        binding.bind(L, ARG["o"], out_k, be)
        binding.bind(L, ARG["lse"], lse_k, be)
        L(arrays.current_stream(q))
        out_user = arrays.finish(kind, out_user, out_k, be)
        return (out_user, arrays.finish(kind, lse_user, lse_k, be)) if return_lse else out_user

    def _require_plan(self):
        if self._plan is None:
            raise RuntimeError("run() called before plan()")
        return self._plan


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapper):
    """Prefill (or append) attention of a ragged batch of queries over a paged KV cache.

    Parameters
    ----------
    float_workspace_buffer : array on the device that runs the kernels (plan + partial states)
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "cuda", "sim", "reference"}
    """

    _torch_fast_path = True

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, *,
             custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, fixed_split_size: int | None = None,
             variant=None) -> None:
        """``qo_indptr [B+1]``: query rows of each request; the page table as in decode;
        ``custom_mask`` (bool, concatenated row-major ``[qo_len, kv_len]`` per request) or
        ``packed_custom_mask`` (``segment_packbits``, little bit order)."""
        page_size = check_positive_int("page_size", page_size)
        indptr, indices, last, kv_lens = binding.page_table(
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
            names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        self._make_plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                        (indptr, indices, last), custom_mask=custom_mask,
                        packed_custom_mask=packed_custom_mask, causal=causal,
                        pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                        rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                        fixed_split_size=fixed_split_size, variant=variant)

    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False):
        """``q [qo_indptr[-1], Hq, D]``; ``paged_kv_cache`` as in decode. Returns ``out``
        (q's kind and dtype) and, with ``return_lse``, ``lse [nnz_qo, Hq]`` (natural log)."""
        from .decode import _split_cache

        p = self._require_plan()
        res = run_fast(p, q, paged_kv_cache, out, lse, return_lse)
        if res is not None:
            return res
        D, PS, Hkv = p["head_dim"], p["page_size"], p["num_kv_heads"]
        k_cache, v_cache, combined = _split_cache(paged_kv_cache, self._kv_layout, PS, Hkv, D,
                                                  p["kv_dtype"])
        indices = p["table"][1]
        if indices.size and int(indices.max()) >= k_cache.shape[0]:
            raise ValueError(f"paged_kv_indices values must lie in [0, {k_cache.shape[0]}) "
                             f"(pages in the cache), got {int(indices.max())}")
        binding.same_device(q=q, paged_kv_cache=k_cache, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            host = arrays.to_host
            return reference.batch_prefill_with_paged_kv_cache(
                host(q), (host(k_cache), host(v_cache)), p["qo_indptr"], *p["table"],
                custom_mask=_flat_mask(p), kv_layout=self._kv_layout, variant=p["variant"],
                sm_scale=p["sm_scale"], return_lse=return_lse)
        page = PS * Hkv * D
        if combined:
            return self._run(q, paged_kv_cache, paged_kv_cache, page, 2 * page, 0, out, lse,
                             return_lse)
        return self._run(q, k_cache, v_cache, 0, page, 0, out, lse, return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    """Prefill attention of a ragged batch over ragged (contiguous per request) K and V."""

    _sparse = False

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, *, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, fixed_split_size: int | None = None,
             variant=None) -> None:
        """``qo_indptr [B+1]`` and ``kv_indptr [B+1]``: rows and keys of each request."""
        kv_ptr = check_indptr("kv_indptr", arrays.host_int32(kv_indptr, "kv_indptr"))
        kv_lens = np.diff(kv_ptr).astype(np.int64)
        empty = np.zeros(0, np.int32)
        self._make_plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, 1,
                        (kv_ptr, empty, empty), custom_mask=custom_mask,
                        packed_custom_mask=packed_custom_mask, causal=causal,
                        pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                        rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                        fixed_split_size=fixed_split_size, variant=variant)

    def run(self, q, k, v, *, out=None, lse=None, return_lse: bool = False):
        """``k, v``: NHD ``[nnz_kv, Hkv, D]`` or HND ``[Hkv, nnz_kv, D]``."""
        p = self._require_plan()
        nnz_kv = int(p["table"][0][-1])
        Hkv, D = p["num_kv_heads"], p["head_dim"]
        want = (nnz_kv, Hkv, D) if self._kv_layout == "NHD" else (Hkv, nnz_kv, D)
        for name, a in (("k", k), ("v", v)):
            check_ndim(name, a, 3)
            for axis, n in enumerate(want):
                check_dim(name, a, axis, n, f"{self._kv_layout} layout, planned")
            if arrays.storage_dtype(a) != p["kv_dtype"]:
                raise TypeError(f"{name} must have dtype {p['kv_dtype']} (planned "
                                f"kv_data_type), got {arrays.storage_dtype(a)}")
        binding.same_device(q=q, k=k, v=v, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            host = arrays.to_host
            return reference.batch_prefill_with_ragged_kv_cache(
                host(q), host(k), host(v), p["qo_indptr"], p["table"][0],
                custom_mask=_flat_mask(p), kv_layout=self._kv_layout, variant=p["variant"],
                sm_scale=p["sm_scale"], return_lse=return_lse)
        head_stride = nnz_kv * D if self._kv_layout == "HND" else 0
        return self._run(q, k, v, 0, 0, head_stride, out, lse, return_lse)


def single_prefill_with_kv_cache(q, k, v, *, custom_mask=None, packed_custom_mask=None,
                                 causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", window_left: int = -1,
                                 logits_soft_cap: float | None = None,
                                 sm_scale: float | None = None, rope_scale: float | None = None,
                                 rope_theta: float | None = None, return_lse: bool = False,
                                 backend: str = "auto"):
    """Prefill attention of one request: ``q [qo_len, Hq, D]``, ``k, v [kv_len, Hkv, D]`` (NHD)
    or ``[Hkv, kv_len, D]`` (HND). The workspace is allocated here (of q's kind)."""
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    check_ndim("q", q, 3)
    check_ndim("k", k, 3)
    kv_len = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    hkv = k.shape[1] if kv_layout == "NHD" else k.shape[0]
    be = arrays.resolve_backend(backend)
    size = 64 << 20
    while True:
        ws = binding.workspace_like(q, size, be)
        w = BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout, backend=be)
        try:
            w.plan(np.array([0, q.shape[0]]), np.array([0, kv_len]), q.shape[1], hkv, q.shape[2],
                   custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                   pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                   logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                   rope_theta=rope_theta, q_data_type=arrays.storage_dtype(q),
                   kv_data_type=arrays.storage_dtype(k))
            break
        except ValueError as exc:
            if "float_workspace_buffer holds" not in str(exc) or size > (1 << 34):
                raise
            size *= 4
    return w.run(q, k, v, return_lse=return_lse)


def _packed_mask_words(masks, batch):
    """Each request's mask packed separately (little bit order), as int32 words, and the byte
    offset of each request's segment (FlashInfer's mask_indptr)."""
    flat = np.concatenate([m.ravel() for m in masks]) if batch else np.zeros(0, bool)
    sizes = np.array([m.size for m in masks], dtype=np.int64)
    indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(sizes, out=indptr[1:])
    packed, byte_ptr = segment_packbits(flat, indptr, bitorder="little")
    padded = np.zeros(-(-max(packed.size, 1) // 4) * 4, dtype=np.uint8)
    padded[:packed.size] = packed
    return np.asarray(byte_ptr, dtype=np.int32), padded.view("<i4").astype(np.int32)


def _flat_mask(p):
    return np.concatenate([m.ravel() for m in p["masks"]]) if p["custom"] else None
