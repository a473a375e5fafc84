"""FlashInfer-compatible batch decode: ``BatchDecodeWithPagedKVCacheWrapper`` and single decode.

``plan()`` runs on the CPU once per generation step: it validates the page table, splits long
requests into KV chunks so that every SM has work, and builds the work list and the merge map.
``run()`` launches the decode kernel (and, when some request was split, the merge kernel) and is
called once per layer with the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import reference
from .._checks import (
    KV_LAYOUTS,
    check_choice,
    check_dim,
    check_heads,
    check_indptr,
    check_ndim,
    check_positive_int,
    check_range,
    check_sm_scale,
)
from ..kernels.decode import (
    WORK_FIELDS,
    DecodeSpec,
    build_decode_kernel,
    decode_launch_config,
    decode_signature,
)
from ..kernels.launch import PreparedLaunch
from ..kernels.merge import MergeSpec, build_merge_rows, merge_launch_config, merge_rows_signature
from ..variants import compose, from_flashinfer_args
from . import arrays, binding
from .decode_fast import TorchFastPath
from .dtypes import normalize_dtype

MIN_CHUNK = 256


@dataclass(frozen=True)
class SplitPlan:
    """Work items and merge map of one decode step (host arrays, int32).

    ``work [W, 5]``: (request, kv_head, kv_start, kv_end, partial_row or -1 for a direct write).
    ``merge_rows [M]``: output rows that were split; ``merge_indptr [M+1]`` / ``merge_indices``:
    their partial rows, in KV order (the fixed reduction order).
    """

    work: np.ndarray
    merge_rows: np.ndarray
    merge_indptr: np.ndarray
    merge_indices: np.ndarray
    num_partials: int
    chunk: int


def split_kv_plan(kv_lens, num_kv_heads: int, *, target_ctas: int, granule: int) -> SplitPlan:
    """Split long requests' KV into near-equal chunks so that the batch fills ``target_ctas``.

    The ideal chunk is the total KV work divided by ``target_ctas``; request ``b`` is cut into
    ``round(len_b / ideal)`` pieces (at least one) of equal size rounded up to ``granule`` tokens
    (what a CTA consumes per round). A batch that already fills the GPU is not split at all, and
    a request is never cut into a long piece plus a sliver. (The LPT scheduler of
    :mod:`nbinfer.scheduler` balances mixed lengths properly; this is the simple policy.)
    """
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    total = int(kv_lens.sum()) * num_kv_heads
    # Below MIN_CHUNK tokens a piece costs more in merge traffic and launch than it saves.
    ideal = max(granule, MIN_CHUNK, total / max(target_ctas, 1))
    nchunks = np.maximum(1, np.rint(kv_lens / ideal)).astype(np.int64)
    piece = _ceil_div(_ceil_div(kv_lens, nchunks), granule) * granule
    nchunks = np.maximum(1, _ceil_div(kv_lens, np.maximum(piece, 1)))
    work, rows, indptr, indices = [], [], [0], []
    prow = 0
    for b, (n, length, size) in enumerate(zip(nchunks, kv_lens, piece, strict=True)):
        split = n > 1
        for c in range(n):
            lo, hi = c * size, min((c + 1) * size, int(length))
            for hk in range(num_kv_heads):
                work.append((b, hk, lo, hi, prow + c if split else -1))
        if split:
            rows.append(b)
            indices.extend(range(prow, prow + n))
            indptr.append(len(indices))
            prow += n
    return SplitPlan(
        work=np.asarray(work, dtype=np.int32).reshape(-1, WORK_FIELDS),
        merge_rows=np.asarray(rows, dtype=np.int32),
        merge_indptr=np.asarray(indptr, dtype=np.int32),
        merge_indices=np.asarray(indices, dtype=np.int32),
        num_partials=prow,
        chunk=int(piece.max()) if piece.size else granule,
    )


def _ceil_div(a, b):
    return -(-a // b)


def _target_ctas(backend: str) -> int:
    if backend != "cuda":
        return 2
    from numba import cuda

    # Four resident 128-thread CTAs per SM keep enough loads in flight on Hopper.
    return cuda.get_current_device().MULTIPROCESSOR_COUNT * 4


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

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", *, backend: str = "auto"):
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        self._backend = arrays.resolve_backend(backend)
        arrays.array_kind(float_workspace_buffer)
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._plan = None

    # ------------------------------------------------------------------------------------------
    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
             variant=None) -> None:
        """Validate the page table and build the work list for this step (CPU only).

        ``indptr [B+1]``, ``indices [nnz_pages]``, ``last_page_len [B]`` are int32 page-table
        arrays as in FlashInfer; ``variant`` is an extra :class:`~nbinfer.variants.Variant`
        composed after the one the keyword flags describe.
        """
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim", head_dim)
        page_size = check_positive_int("page_size", page_size)
        indptr = check_indptr("indptr", arrays.host_int32(indptr, "indptr"))
        batch = indptr.size - 1
        indices = arrays.host_int32(indices, "indices")
        if indices.size != indptr[-1]:
            raise ValueError(f"indices must have length indptr[-1]={indptr[-1]}, got {indices.size}")
        check_range("indices", indices, 0, np.iinfo(np.int32).max)
        last = arrays.host_int32(last_page_len, "last_page_len")
        if last.shape != (batch,):
            raise ValueError(f"last_page_len must have shape ({batch},), got {last.shape}")
        pages = np.diff(indptr)
        check_range("last_page_len", last[pages > 0], 1, page_size + 1)
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        var = from_flashinfer_args(window_left=window_left, logits_soft_cap=logits_soft_cap,
                                   pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                   rope_theta=rope_theta, num_qo_heads=num_qo_heads)
        if variant is not None:
            var = compose(var, variant)
        kv_lens = np.where(pages > 0, (pages - 1) * page_size + last, 0).astype(np.int64)
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
            split = split_kv_plan(kv_lens, num_kv_heads, target_ctas=_target_ctas(self._backend),
                                  granule=spec.tokens_per_group * 4)
            need = split.num_partials * num_qo_heads * (head_dim + 1) * 4
            have = binding.nbytes(self._workspace)
            if need > have:
                raise ValueError(f"float_workspace_buffer holds {have} bytes, this plan needs {need}")
            plan.update(spec=spec, split=split, **self._prepare_launches(spec, split, plan))
            if self._backend == "cuda" and arrays.array_kind(self._workspace) == "torch":
                plan["fast"] = TorchFastPath(plan, self._kv_layout, self._workspace.device)
        self._plan = plan

    def _prepare_launches(self, spec, split, p):
        """Bind everything a plan fixes (page table, work list, workspace, scalars) into the
        decode and merge launches, so that run() only adds q, the cache and the outputs."""
        be, sim = self._backend, self._backend == "sim"
        dev = _upload(be, p["indptr"], p["indices"], p["last"], split)
        ws = binding.workspace_f32(self._workspace, be)
        hq, d = p["num_qo_heads"], p["head_dim"]
        nt = split.num_partials * hq
        tmp_o, tmp_lse = ws[: max(nt * d, 1)], ws[nt * d: nt * d + max(nt, 1)]
        grid, block = decode_launch_config(split.work.shape[0])
        dec = PreparedLaunch(build_decode_kernel(spec), decode_signature(spec), grid[0], block[0],
                             sim=sim)
        for i, arr in ((3, dev["indptr"]), (4, dev["indices"]), (5, dev["last"]),
                       (6, dev["work"]), (9, tmp_o), (10, tmp_lse)):
            dec.set_array(i, arr)
        dec.set_scalar(11, p["num_kv_heads"])
        dec.set_scalar(13, 0)
        dec.set_scalar(14, p["sm_scale"])
        merge = None
        m = split.merge_rows.size
        if m:
            mspec = MergeSpec("float32", p["q_dtype"], p["variant"], sim)
            total = m * hq * d
            g, bl = merge_launch_config(total)
            merge = PreparedLaunch(build_merge_rows(mspec), merge_rows_signature(mspec), g[0],
                                   bl[0], sim=sim)
            for i, arr in ((0, tmp_o), (1, tmp_lse), (2, dev["merge_indptr"]),
                           (3, dev["merge_indices"]), (4, dev["merge_rows"])):
                merge.set_array(i, arr)
            for i, val in ((7, hq), (8, d), (9, total)):
                merge.set_scalar(i, val)
        return dict(launch=dec, merge_launch=merge, dev=dev)

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
        fast = p.get("fast")
        if fast is not None:
            res = fast(q, paged_kv_cache, out, lse)
            if res is not None:
                return res if return_lse else res[0]
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
        dec = p["launch"]
        binding.bind(dec, 0, q, be)
        if combined:
            page_stride = 2 * PS * Hkv * D
            binding.bind(dec, 1, paged_kv_cache, be)
            binding.bind(dec, 2, paged_kv_cache, be, offset=PS * Hkv * D)
        else:
            page_stride = PS * Hkv * D
            binding.bind(dec, 1, k_cache, be)
            binding.bind(dec, 2, v_cache, be)
        dec.set_scalar(12, page_stride)
        binding.bind(dec, 7, out_k, be)
        binding.bind(dec, 8, lse_k, be)
        stream = arrays.current_stream(q)
        if p["split"].work.shape[0]:
            dec(stream)
        if p["merge_launch"] is not None:
            binding.bind(p["merge_launch"], 5, out_k, be)
            binding.bind(p["merge_launch"], 6, lse_k, be)
            p["merge_launch"](stream)
        out_user = arrays.finish(kind, out_user, out_k, be)
        if return_lse:
            return out_user, arrays.finish(kind, lse_user, lse_k, be)
        return out_user


def _upload(backend, indptr, indices, last, split):
    host = dict(indptr=indptr, indices=indices if indices.size else np.zeros(1, np.int32),
                last=last if last.size else np.zeros(1, np.int32),
                work=split.work.reshape(-1) if split.work.size else np.zeros(WORK_FIELDS, np.int32),
                merge_rows=split.merge_rows, merge_indptr=split.merge_indptr,
                merge_indices=split.merge_indices)
    if backend == "sim":
        return {k: np.array(v, dtype=np.int32) for k, v in host.items()}  # writable copies
    from numba import cuda

    return {k: cuda.to_device(np.ascontiguousarray(v, dtype=np.int32)) for k, v in host.items()}


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
    def host(a):
        kind = arrays.array_kind(a)
        if kind == "torch":
            return a.detach().float().cpu().numpy()
        if kind == "cupy":
            return a.get()
        if kind == "numba":
            return a.copy_to_host()
        return np.asarray(a)

    res = reference.batch_decode_with_paged_kv_cache(
        host(q), (host(cache[0]), host(cache[1])), p["indptr"], p["indices"], p["last"],
        kv_layout=layout, variant=p["variant"], sm_scale=p["sm_scale"], return_lse=return_lse)
    return res


__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "SplitPlan", "split_kv_plan"]
