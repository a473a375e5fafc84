"""``single_decode_with_kv_cache``: one query token against one contiguous K/V, on the decode kernel.

The decode kernel's dense (affine) addressing: request 0's tokens are ``k[0:kv_len]`` (NHD
``[kv_len, Hkv, D]``) or ``k[:, 0:kv_len]`` (HND ``[Hkv, kv_len, D]``); ``kv_indptr = [0, kv_len]``
holds token offsets instead of pages. The scheduler still cuts a long KV into chunks that fill
the GPU, merged inside the kernel. The workspace is allocated here, of q's kind.
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
    check_scales,
    check_sm_scale,
)
from ..kernels.common import ARG
from ..kernels.decode import NUM_THREADS, DecodeSpec, build_decode_kernel
from ..scheduler import PlanLayout
from . import arrays, binding
from .decode import MIN_CHUNK, attention_variant, kernel_ctas
from .launch import AttentionLaunch, PlanMemory
from .workspace import WorkspaceLayout, item_merge_lists

__all__ = ["single_decode_with_kv_cache"]


def single_decode_with_kv_cache(q, k, v, *, kv_layout: str = "NHD",
                                pos_encoding_mode: str = "NONE", window_left: int = -1,
                                logits_soft_cap: float | None = None,
                                sm_scale: float | None = None, rope_scale: float | None = None,
                                rope_theta: float | None = None, return_lse: bool = False,
                                q_scale: float | None = None, k_scale: float | None = None,
                                v_scale: float | None = None, kv_data_type=None,
                                backend: str = "auto"):
    """Decode attention of one query token.

    Parameters
    ----------
    q : array [num_qo_heads, head_dim]
    k, v : array [kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] (HND);
        views with a contiguous last dimension (16-byte strides) are read in place
    kv_layout, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
    rope_theta : as in :class:`~nbinfer.BatchDecodeWithPagedKVCacheWrapper`
    q_scale, k_scale, v_scale : float, optional
        as in the wrapper's run(): FP8 K and V are torch ``float8_e4m3fn`` / ``float8_e5m2``
        tensors, or ``uint8`` codes with ``kv_data_type`` naming their format
    return_lse : bool
    backend : {"auto", "cuda", "sim", "reference"}

    Returns
    -------
    out [num_qo_heads, head_dim] of q's kind and dtype, and ``lse [num_qo_heads]`` (float32,
    natural log) with ``return_lse``.
    """
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    for name, a, nd in (("q", q, 2), ("k", k, 3), ("v", v, 3)):
        arrays.array_kind(a, name)
        check_ndim(name, a, nd)
    hq, d = q.shape
    kv_len, hkv = (k.shape[0], k.shape[1]) if kv_layout == "NHD" else (k.shape[1], k.shape[0])
    check_heads(hq, hkv)
    check_dim("k", k, 2, d, "head_dim of q")
    for axis in range(3):
        check_dim("v", v, axis, k.shape[axis], "k's shape")
    q_dtype, kv_dtype = arrays.storage_dtype(q, "q"), arrays.single_kv_dtype(k, v, kv_data_type)
    qk_scale, v_scale = check_scales(q_scale, k_scale, v_scale)
    binding.same_device(q=q, k=k, v=v)
    scale = check_sm_scale(sm_scale, d)
    var = attention_variant(hq, None, window_left=window_left, logits_soft_cap=logits_soft_cap,
                            pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                            rope_theta=rope_theta)
    be = arrays.resolve_backend(backend)
    if be == "reference":
        return reference.single_decode_with_kv_cache(
            arrays.to_host(q), arrays.kv_values(k, kv_dtype),
            arrays.kv_values(v, kv_dtype, v_scale), kv_layout=kv_layout, variant=var,
            sm_scale=scale * qk_scale, return_lse=return_lse)
    spec = DecodeSpec(head_dim=d, group_size=hq // hkv, page_size=1, kv_dtype=kv_dtype,
                      q_dtype=q_dtype, kv_layout=kv_layout, variant=var, sparse=False,
                      sim=be == "sim")
    num_ctas = kernel_ctas(be, be == "cuda" and build_decode_kernel(spec), NUM_THREADS)
    sched = scheduler.plan(np.arange(2), [kv_len], hq, hkv, num_ctas, granule=MIN_CHUNK)
    layout = WorkspaceLayout(PlanLayout.for_plan(sched), hkv, hq, d, 1, 0)
    workspace = binding.workspace_like(q, layout.nbytes, be)
    launch = AttentionLaunch(spec, workspace, layout, be, num_ctas, scale, PlanMemory(be))
    table = (np.array([0, kv_len], np.int32), np.zeros(0, np.int32), np.array([kv_len], np.int32))
    launch.upload(layout.stage(sched, item_merge_lists(sched), table), table,
                  arrays.current_stream(q))
    launch.scale(qk_scale, v_scale)
    kind = arrays.array_kind(q)
    out_user, out_k = binding.output(None, "out", kind, q, (hq, d), q_dtype, be)
    lse_user, lse_k = binding.output(None, "lse", kind, q, (hq,), "float32", be)
    L = launch.launch
    sq = binding.bind_view(L, ARG["q"], q, be, "q")
    sk = binding.bind_kv(L, k, v, be, ("k", "v"))
    n_axis, h_axis = (0, 1) if kv_layout == "NHD" else (1, 0)
    launch.set_strides(0, sk[n_axis], sk[h_axis], 0, sq[0])
    binding.bind(L, ARG["o"], out_k, be)
    binding.bind(L, ARG["lse"], lse_k, be)
    launch(arrays.current_stream(q))
    out_user = arrays.finish(kind, out_user, out_k, be)
    return (out_user, arrays.finish(kind, lse_user, lse_k, be)) if return_lse else out_user
