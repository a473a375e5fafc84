"""Batch decode over a paged (or contiguous) KV cache: the CUDA-core gather microkernel.

One CTA handles one work item ``(request b, kv head hk, kv range [start, end))`` and all ``G``
query heads of that KV head's GQA group, so each KV byte is read from HBM once per group.

Layout (4 warps, 128 threads). Lane ``l`` owns head-dimension slice ``[l*NV, (l+1)*NV)``,
``NV = D / 32``. A warp processes groups of ``TG`` tokens; warp ``w`` takes groups ``w, w+4, ...``
so the four warps stream disjoint tokens and never wait for each other inside the loop:

1. gather: every lane ``cp.async``-copies its slice of the group's K and V rows from the pages the
   page table names (sparse) or from a contiguous range (dense) into the warp's shared-memory stage.
   Two stages per warp: the copy of group ``i+1`` is in flight while group ``i`` is computed.
2. scores: a lane forms partial dot products for ``TG`` tokens x ``G`` heads from its slice; one
   warp reduce-scatter turns the ``N = TG * G`` partials into whole logits, one per slot, where the
   variant's logits transform and mask run once per (token, head).
3. online softmax per head on the gathered logits, then ``acc += p * v`` on the lane's V slice.
4. the four warps' states ``(m, l, acc)`` merge through shared memory (the merge operator again),
   and the CTA writes either the final output (request not split) or a partial state ``(O, LSE)``
   for the merge kernel.

Bytes and FLOPs per token and KV head: ``2 * D * itemsize`` bytes (K and V) against
``4 * G * D`` FLOPs, i.e. ``G`` FLOP/byte for fp16: decode is bound by HBM, so the kernel's job is
to keep enough bytes in flight (4 warps x 2 stages x 2 * TG rows per CTA) and spend few
instructions per byte.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int16, int32, int64, types
from numba.core.types import float16

from ..variants import Variant
from .hooks import device_hooks
from .primitives import LN2, LOG2E, primitives
from .warp import slot_layout, warp_collectives

NUM_WARPS = 4
NUM_THREADS = 32 * NUM_WARPS
STAGES = 2
HEAD_DIMS = (64, 128, 256)
KV_DTYPES = ("float16", "bfloat16", "float32")
# Numba storage type of each dtype: bf16 travels as its raw bits.
STORAGE = {"float16": float16, "bfloat16": int16, "float32": float32}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
WORK_FIELDS = 5  # (request, kv_head, kv_start, kv_end, partial_row or -1)


@dataclass(frozen=True)
class DecodeSpec:
    """Everything that is compiled into one decode kernel (hashable: the kernel cache key)."""

    head_dim: int
    group_size: int
    page_size: int
    kv_dtype: str
    q_dtype: str
    kv_layout: str
    variant: Variant
    sparse: bool = True
    sim: bool = False

    def __post_init__(self):
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if not 1 <= self.group_size <= 32:
            raise ValueError(f"group size (num_qo_heads // num_kv_heads) must be in [1, 32], "
                             f"got {self.group_size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        for name in ("kv_dtype", "q_dtype"):
            if getattr(self, name) not in KV_DTYPES:
                raise ValueError(f"{name} must be one of {KV_DTYPES}, got {getattr(self, name)!r}")
        if self.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {self.kv_layout!r}")

    @property
    def tokens_per_group(self) -> int:
        # 4 KiB of K+V per warp and stage: 8 fp16 tokens at D=128.
        return max(1, 2048 // (self.head_dim * ITEMSIZE[self.kv_dtype]))

    @property
    def slots(self) -> int:
        return self.tokens_per_group * _next_pow2(self.group_size)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _converter(prims, dtype):
    return {"float16": prims.f16, "bfloat16": prims.bf16, "float32": prims.f32}[dtype]


def decode_signature(spec: DecodeSpec):
    """The explicit Numba signature the kernel is compiled with (eagerly)."""
    kv = types.Array(STORAGE[spec.kv_dtype], 1, "C")
    qo = types.Array(STORAGE[spec.q_dtype], 1, "C")
    i32 = types.Array(int32, 1, "C")
    f32 = types.Array(float32, 1, "C")
    return types.void(qo, kv, kv, i32, i32, i32, i32, qo, f32, f32, f32,
                      int32, int64, int64, int64, float32)


@functools.cache
def build_decode_kernel(spec: DecodeSpec):
    """Compile (once per spec) the decode kernel; returns the Numba kernel object.

    Kernel arguments, all 1-D contiguous: ``q [B*Hq*D]``, ``k``, ``v`` (flat KV storage; for a
    combined ``[P, 2, ...]`` cache both are the same buffer and ``v_off`` is the K->V distance),
    ``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` (int32), ``work [W*5]`` (int32),
    ``o [B*Hq*D]``, ``lse [B*Hq]`` (float32, natural log), ``tmp_o [P*Hq*D]``,
    ``tmp_lse [P*Hq]`` (float32 partial states), then scalars ``num_kv_heads``, ``v_off``,
    ``page_stride`` (elements between pages, paged only), ``head_stride`` (HND dense only),
    ``sm_scale``.
    """
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    D = spec.head_dim
    HALF = D // 2
    G = spec.group_size
    GP = _next_pow2(G)
    PS = spec.page_size
    NV = D // 32
    GNV = G * NV  # local-array sizes must be single captured constants, not expressions
    TG = spec.tokens_per_group
    N = TG * GP
    R, REP, _ = slot_layout(N)
    NW = NUM_WARPS
    NT = NUM_THREADS
    STAGE = TG * D  # storage elements of one K (or V) buffer of one warp and stage
    WARP_SMEM = STAGES * 2 * STAGE
    KV_SMEM = NW * WARP_SMEM
    MERGE_SMEM = NW * (D + 2)
    coll = warp_collectives(N, NW, sim)
    SCRATCH = coll.scratch_size
    # Numba captures functions, not namespaces: bind every device function to a plain name.
    reduce_scatter, gather_slots = coll.reduce_scatter, coll.gather_slots
    hook_query, hook_key, hook_logits = hooks.query, hooks.key, hooks.logits
    hook_mask, hook_output = hooks.mask, hooks.output
    KV_T = STORAGE[spec.kv_dtype]
    cp_async = prims.make_cp_async(NV, ITEMSIZE[spec.kv_dtype])
    commit = prims.commit
    wait_one = prims.wait(1)
    exp2, log2 = prims.exp2, prims.log2
    kv_cvt = _converter(prims, spec.kv_dtype)
    q_cvt = _converter(prims, spec.q_dtype)
    to_bf16 = prims.from_f32_bf16
    Q_IS_BF16 = spec.q_dtype == "bfloat16"
    SOFTMAX = hooks.use_softmax
    HAS_Q, HAS_K = hooks.has_query, hooks.has_key
    HAS_LOGITS, HAS_MASK, HAS_OUT = hooks.has_logits, hooks.has_mask, hooks.has_output
    # Without a logits hook, fold log2(e) into q so that exp2 can be used directly.
    Q_LOG2E = float32(LOG2E if (SOFTMAX and not HAS_LOGITS) else 1.0)
    POST_LOG2E = float32(LOG2E if (SOFTMAX and HAS_LOGITS) else 1.0)
    NEG_INF = float32(-np.inf)
    ZERO = float32(0.0)
    F_LN2 = float32(LN2)
    SPARSE = spec.sparse
    NHD = spec.kv_layout == "NHD"
    jit_dev = cuda.jit(device=True) if sim else cuda.jit(device=True, inline="always")
    @jit_dev
    def syncwarp():
        # The simulator has no __syncwarp; every thread reaches this point, so a block barrier
        # serves (resolved at call time: the simulator binds cuda.* inside a running kernel).
        if sim:
            cuda.syncthreads()
        else:
            cuda.syncwarp()

    to_f32, q_to_f32 = kv_cvt, q_cvt

    @jit_dev
    def request_kv_len(kv_indptr, kv_last, b):
        if SPARSE:
            pages = kv_indptr[b + 1] - kv_indptr[b]
            return (pages - 1) * PS + kv_last[b] if pages > 0 else 0
        return kv_indptr[b + 1] - kv_indptr[b]

    @jit_dev
    def token_offset(kv_indptr, kv_indices, b, pos, hk, hkv, page_stride, head_stride):
        # The loading module: the only code that differs between sparse and dense addressing.
        if SPARSE:
            page = int64(kv_indices[kv_indptr[b] + pos // PS])
            slot = pos % PS
            if NHD:
                return page * page_stride + (slot * hkv + hk) * D
            return page * page_stride + (hk * PS + slot) * D
        tok = int64(kv_indptr[b] + pos)
        if NHD:
            return (tok * hkv + hk) * D
        return hk * head_stride + tok * D

    @jit_dev
    def issue_group(smem, sbase, k, v, kv_indptr, kv_indices, b, hk, hkv, gstart, last, lane,
                    v_off, page_stride, head_stride):
        for t in range(TG):
            # Tokens past the range re-read the last valid token; their logits are masked later.
            pos = min(gstart + t, last)
            off = token_offset(kv_indptr, kv_indices, b, pos, hk, hkv, page_stride, head_stride)
            off += lane * NV
            cp_async(smem, sbase + t * D + lane * NV, k, off)
            cp_async(smem, sbase + STAGE + t * D + lane * NV, v, off + v_off)
        commit()

    @jit_dev
    def store(o, i, x):
        if Q_IS_BF16:
            o[i] = to_bf16(x)
        else:
            o[i] = x

    def decode_kernel(q, k, v, kv_indptr, kv_indices, kv_last, work, o, lse, tmp_o, tmp_lse,
                      hkv, v_off, page_stride, head_stride, sm_scale):
        smem = cuda.shared.array(KV_SMEM, KV_T)
        msmem = cuda.shared.array(MERGE_SMEM, float32)
        scratch = cuda.shared.array(SCRATCH, float32)
        part = cuda.local.array(N, float32)
        sc = cuda.local.array(R, float32)
        s_all = cuda.local.array(N, float32)
        qv = cuda.local.array(GNV, float32)
        acc = cuda.local.array(GNV, float32)
        kf = cuda.local.array(NV, float32)
        m = cuda.local.array(G, float32)
        lsum = cuda.local.array(G, float32)

        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        w0 = cuda.blockIdx.x * WORK_FIELDS
        b = work[w0]
        hk = work[w0 + 1]
        start = work[w0 + 2]
        end = work[w0 + 3]
        prow = work[w0 + 4]
        hq = hkv * G
        kv_len = request_kv_len(kv_indptr, kv_last, b)
        q_pos = kv_len - 1
        d0 = lane * NV
        qscale = sm_scale * Q_LOG2E

        for h in range(G):
            qo_head = hk * G + h
            qbase = (b * hq + qo_head) * D
            for e in range(NV):
                x = q_to_f32(q[qbase + d0 + e])
                if HAS_Q:
                    xp = q_to_f32(q[qbase + (d0 + e + HALF) % D])
                    x = float32(hook_query(x, xp, d0 + e, D, q_pos, qo_head))
                qv[h * NV + e] = x * qscale
                acc[h * NV + e] = ZERO
            m[h] = NEG_INF
            lsum[h] = ZERO

        n_groups = (end - start + TG - 1) // TG
        rounds = (n_groups + NW - 1) // NW
        wbase = warp * WARP_SMEM
        last = end - 1
        if rounds > 0:
            issue_group(smem, wbase, k, v, kv_indptr, kv_indices, b, hk, hkv,
                        start + warp * TG, last, lane, v_off, page_stride, head_stride)
        for r in range(rounds):
            if r + 1 < rounds:
                issue_group(smem, wbase + ((r + 1) % STAGES) * 2 * STAGE, k, v, kv_indptr,
                            kv_indices, b, hk, hkv, start + ((r + 1) * NW + warp) * TG, last,
                            lane, v_off, page_stride, head_stride)
            else:
                commit()  # an empty group keeps "wait for all but the newest" uniform
            wait_one()
            if HAS_K:
                syncwarp()  # the key transform reads its partner element from another lane
            sb = wbase + (r % STAGES) * 2 * STAGE
            gstart = start + (r * NW + warp) * TG

            # Partial q.k over this lane's slice, for TG tokens x GP heads (padding heads are 0).
            for t in range(TG):
                for e in range(NV):
                    x = to_f32(smem[sb + t * D + d0 + e])
                    if HAS_K:
                        xp = to_f32(smem[sb + t * D + (d0 + e + HALF) % D])
                        x = float32(hook_key(x, xp, d0 + e, D, gstart + t, hk))
                    kf[e] = x
                for h in range(GP):
                    dot = ZERO
                    if h < G:
                        for e in range(NV):
                            dot += qv[h * NV + e] * kf[e]
                    part[h * TG + t] = dot
            reduce_scatter(part, sc, lane, warp, scratch)

            # Each slot now holds one whole logit: run the variant on it exactly once.
            for rr in range(R):
                slot = (lane // REP) * R + rr
                h = slot // TG
                pos = gstart + slot % TG
                s = sc[rr]
                keep = pos < end and h < G
                if HAS_LOGITS:
                    s = float32(hook_logits(s, q_pos, pos, hk * G + h)) * POST_LOG2E
                if HAS_MASK:
                    keep = keep and hook_mask(q_pos, pos, hk * G + h)
                if SOFTMAX:
                    sc[rr] = s if keep else NEG_INF
                else:
                    sc[rr] = s if keep else ZERO
            gather_slots(sc, s_all, lane, warp, scratch)

            if SOFTMAX:
                for h in range(G):
                    mt = m[h]
                    for t in range(TG):
                        mt = max(mt, s_all[h * TG + t])
                    # An all-masked head keeps m = -inf; use 0 as the reference so no NaN appears.
                    mref = mt if mt > NEG_INF else ZERO
                    alpha = exp2(m[h] - mref)
                    ls = lsum[h] * alpha
                    for e in range(NV):
                        acc[h * NV + e] *= alpha
                    for t in range(TG):
                        p = exp2(s_all[h * TG + t] - mref)
                        ls += p
                        s_all[h * TG + t] = p
                    m[h] = mt
                    lsum[h] = ls
            for t in range(TG):
                for e in range(NV):
                    kf[e] = to_f32(smem[sb + STAGE + t * D + d0 + e])
                for h in range(G):
                    p = s_all[h * TG + t]
                    for e in range(NV):
                        acc[h * NV + e] += p * kf[e]

        # Merge the four warps' states, one head at a time (4 KiB of shared memory).
        for h in range(G):
            for e in range(NV):
                msmem[warp * (D + 2) + d0 + e] = acc[h * NV + e]
            if lane == 0:
                msmem[warp * (D + 2) + D] = m[h]
                msmem[warp * (D + 2) + D + 1] = lsum[h]
            cuda.syncthreads()
            qo_head = hk * G + h
            for d in range(tid, D, NT):
                mmax = NEG_INF
                for w in range(NW):
                    mmax = max(mmax, msmem[w * (D + 2) + D])
                mref = mmax if mmax > NEG_INF else ZERO
                total = ZERO
                num = ZERO
                for w in range(NW):
                    if SOFTMAX:
                        scale = exp2(msmem[w * (D + 2) + D] - mref)
                        total += msmem[w * (D + 2) + D + 1] * scale
                        num += msmem[w * (D + 2) + d] * scale
                    else:
                        num += msmem[w * (D + 2) + d]
                if SOFTMAX:
                    out = num / total if total > ZERO else ZERO
                    lse_val = (mmax + log2(total)) * F_LN2 if total > ZERO else NEG_INF
                else:
                    out = num
                    lse_val = ZERO
                if prow < 0:
                    if HAS_OUT:
                        out = float32(hook_output(out, lse_val, qo_head))
                    store(o, (b * hq + qo_head) * D + d, out)
                    if d == 0:
                        lse[b * hq + qo_head] = lse_val
                else:
                    tmp_o[(prow * hq + qo_head) * D + d] = out
                    if d == 0:
                        tmp_lse[prow * hq + qo_head] = lse_val
            cuda.syncthreads()

    if sim:
        return cuda.jit(decode_kernel)
    return cuda.jit(decode_signature(spec), fastmath=True)(decode_kernel)


def decode_launch_config(num_work_items: int):
    """(grid, block) for a decode launch: one CTA per work item."""
    return (max(int(num_work_items), 1),), (NUM_THREADS,)


__all__ = ["DecodeSpec", "build_decode_kernel", "decode_launch_config", "decode_signature",
           "WORK_FIELDS", "NUM_THREADS", "HEAD_DIMS", "KV_DTYPES"]
