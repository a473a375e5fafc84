"""Batch prefill over a paged or ragged KV cache: a CUDA-core tile kernel.

One work item of the scheduler is ``(request b, kv head hk, query rows [qs, qe), kv range
[start, end))``. Its query rows and the ``G`` heads of the GQA group form ``PR = rows x G``
*packed rows* (query length fused with the head group, as in FlashInfer), held in shared memory
as float32, already transformed (RoPE) and scaled. The CTA then walks the KV range in tiles of
``BC`` tokens, gathered through the page table (paged) or a contiguous range (ragged) into shared
memory by the same loading rule as the decode kernel, and for each tile:

1. ``S = Q K^T`` for ``PR x BC`` scores: ``TPR = 128 / TQ`` threads per packed row, each
   ``BC / TPR`` scores over the full head dimension (rows padded by one word: no bank conflicts);
2. the variant's logits transform and masks (causal, window, custom bits, ...) per score, with
   the query position of the score's own row (bottom-right aligned);
3. online softmax per row (one thread per row);
4. ``O += P V``: each thread owns ``D / TPR`` dimensions of one packed row.

A chunk of a split row writes a partial state; the CTA that completes a tile's last chunk merges
its rows (:mod:`.fused_merge`). FLOPs per item: ``4 * PR * D * kv`` on CUDA cores; shared-memory
bound (one shared load per FMA in q.k). The tensor-core kernel (:mod:`.prefill_mma`) serves
fp16/bf16 at head_dim 64 and 128; this one is the general baseline (fp32, mixed dtypes, head_dim
256, any variant, mask, layout, page size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, types

from .common import (
    F_INF,
    F_LN2,
    PREFILL_PLAN_SECTIONS,
    AttentionSpec,
    attention_signature,
    compile_kernel,
    guards_masked_values,
    kept_weights,
    state_finalize,
)
from .fused_merge import build_merge_list
from .hooks import device_hooks
from .loading import loading_module
from .positions import position_module, prefill_item_reader
from .primitives import LOG2E, primitives

NUM_THREADS = 128


@dataclass(frozen=True)
class PrefillSpec(AttentionSpec):
    """What one prefill kernel is compiled for (hashable: the kernel cache key)."""

    custom_mask: bool = False
    # Block-sparse (BSR) mode: a "page" is a block column of the key matrix, so positions are
    # physical (page id * page_size + slot) and each query row's position comes from ``q_pos0``.
    block_positions: bool = False

    @property
    def max_group(self) -> int:
        return self.tile_q

    @property
    def tile_q(self) -> int:
        """Packed rows per tile (query rows x G): 32, or 16 at head_dim 256 (shared memory)."""
        return 32 if self.head_dim <= 128 else 16

    @property
    def tile_rows(self) -> int:
        return self.tile_q // self.group_size

    @property
    def tile_kv(self) -> int:
        return 16 if self.head_dim <= 128 else 8


def prefill_signature(spec: PrefillSpec):
    return attention_signature(spec.kv_dtype, spec.q_dtype, len(PREFILL_PLAN_SECTIONS))


@functools.cache
def build_prefill_kernel(spec: PrefillSpec):
    """Compile (once per spec) the prefill kernel. Arguments as the decode kernel's
    (:func:`nbinfer.kernels.decode.build_decode_kernel`), with six more plan sections:
    ``qo_indptr`` (query rows of each request), ``mask_indptr`` (byte offset of each request's
    packed custom mask), ``mask_words`` (the packed masks, little bit order, as int32),
    ``q_pos0`` (BSR mode: the position of each block row's first query), ``qo_end`` (one past
    each request's last query row: ``qo_indptr[1:]`` for a batch, where requests tile the rows;
    a cascade's requests of different levels overlap, so the end is stored on its own) and
    ``value_flags`` (``[B * Hkv * VALUE_SCAN_SPLITS]``: 1 where a part of a request's V holds a
    non-finite value; written by :mod:`.value_scan`, read only by the tensor-core kernel's
    guarded twin)."""
    return compile_prefill("prefill", spec, prefill_kernel_source)


def compile_prefill(kind: str, spec, source):
    """``source(spec)`` (the kernel source of either prefill kernel) compiled for ``spec`` with
    the shared signature (:func:`~.common.compile_kernel`)."""
    return compile_kernel(kind, spec, prefill_signature(spec), lambda: source(spec),
                          source.__module__)


def prefill_kernel_source(spec: PrefillSpec):
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    D = spec.head_dim
    HALF = D // 2
    G = spec.group_size
    TQ = spec.tile_q
    PR = spec.tile_rows * G  # packed rows of a full tile (<= TQ)
    BC = spec.tile_kv
    NT = NUM_THREADS
    TPR = NT // TQ  # threads per packed row
    SPT = BC // TPR  # scores per thread
    DPT = D // TPR  # output dims per thread
    PS = spec.page_size
    QS = D + 1  # padded row strides (float32 words)
    KS = D + 1
    SS = BC + 1
    Q_SMEM = TQ * QS
    K_SMEM = BC * KS
    V_SMEM = BC * D
    S_SMEM = TQ * SS
    MERGE_FLOATS = K_SMEM + V_SMEM  # K and V tiles are free once the item's loop is done
    FLAG_WORDS = 2 * TQ + 3  # the tile merge's row flags and lists (fused_merge)
    SMEM_ALIGN = prims.SMEM_ALIGN  # the merge's cp.async stage
    fused = build_merge_list(G, D, NT, MERGE_FLOATS, spec.variant, spec.q_dtype, sim)
    finish_split_tile, store, OUTS = fused.finish_split_tile, fused.store, fused.OUTS
    token_offset = loading_module(spec.sparse, PS, sim).token_offset
    read_item = prefill_item_reader(spec.sparse, PS, spec.block_positions, sim)
    pos_fns = position_module(PS, spec.block_positions, sim)
    key_position, mask_bit = pos_fns.key_position, pos_fns.mask_bit
    hook_query, hook_key, hook_logits = hooks.query, hooks.key, hooks.logits
    hook_mask, hook_output = hooks.mask, hooks.output
    SOFTMAX = hooks.use_softmax
    HAS_Q, HAS_K = hooks.has_query, hooks.has_key
    HAS_LOGITS, HAS_MASK, HAS_OUT = hooks.has_logits, hooks.has_mask, hooks.has_output
    CUSTOM = spec.custom_mask
    Q_LOG2E = float32(LOG2E if (SOFTMAX and not HAS_LOGITS) else 1.0)
    POST_LOG2E = float32(LOG2E if (SOFTMAX and HAS_LOGITS) else 1.0)
    NEG_INF = float32(-np.inf)
    NAN = float32(np.nan)
    ZERO = float32(0.0)
    finalize = state_finalize(sim)
    MASKED = NEG_INF if SOFTMAX else ZERO
    GUARD = guards_masked_values(hooks, CUSTOM)  # p.V skips unkept keys (common.KEPT_FLOOR)
    kept_logit, split_weight = kept_weights(SOFTMAX, sim)
    U32 = types.uint32
    exp2 = prims.exp2
    kv_f32, q_f32 = prims.convert[spec.kv_dtype], prims.convert[spec.q_dtype]

    def prefill_kernel(q, k, v, kv_indptr, kv_indices, kv_last, plan, o, lse, tmp_o, tmp_lse,
                       counters, hkv, page_stride, kv_stride_n, kv_stride_h, q_stride_n,
                       q_stride_h, sm_scale, v_scale, work_off,
                       cta_indptr_off, cta_work_off, merge_rows_off, merge_indptr_off,
                       merge_indices_off, item_merge_off, qo_indptr_off, mask_indptr_off,
                       mask_words_off, q_pos0_off, qo_end_off, value_flags_off):
        qs_ = cuda.shared.array(Q_SMEM, float32)
        # [K tile | V tile], the merge's scratch after the item's loop.
        kv_ = cuda.shared.array(MERGE_FLOATS, float32, alignment=SMEM_ALIGN)
        ss_ = cuda.shared.array(S_SMEM, float32)
        row_m = cuda.shared.array(TQ, float32)
        row_l = cuda.shared.array(TQ, float32)
        row_a = cuda.shared.array(TQ, float32)
        flags = cuda.shared.array(FLAG_WORDS, int32)
        sc = cuda.local.array(SPT, float32)
        acc = cuda.local.array(DPT, float32)
        mnum = cuda.local.array(OUTS, float32)

        tid = cuda.threadIdx.x
        r = tid // TPR  # this thread's packed row in q.k and p.v
        sub = tid % TPR
        hq = hkv * G
        c = cuda.blockIdx.x
        for wi in range(plan[cta_indptr_off + c], plan[cta_indptr_off + c + 1]):
            item = plan[cta_work_off + wi]
            (b, hk, qs, nrows, start, end, prow, q0, kv_len, ib, row_stride, head_off,
             pos0) = read_item(plan, item, work_off, qo_indptr_off, qo_end_off, q_pos0_off,
                               kv_indptr, kv_last, kv_stride_n, kv_stride_h)

            # Q tile: packed row p = (row p // G, head p % G), transformed and pre-scaled.
            for e in range(tid, TQ * D, NT):
                p = e // D
                d = e % D
                x = ZERO
                if p < PR and p // G < nrows:
                    base = (int64(q0 + qs + p // G) * q_stride_n
                            + int64(hk * G + p % G) * q_stride_h)
                    x = q_f32(q[base + d])
                    if HAS_Q:
                        xp = q_f32(q[base + (d + HALF) % D])
                        x = float32(hook_query(x, xp, d, D, pos0 + p // G, hk * G + p % G))
                    x = x * sm_scale * Q_LOG2E
                qs_[p * QS + d] = x
            if tid < TQ:
                row_m[tid] = NEG_INF
                row_l[tid] = ZERO
            for i in range(DPT):
                acc[i] = ZERO
            cuda.syncthreads()  # Q and the row states are in place (even if the range is empty)
            row_ok = r < PR and r // G < nrows
            q_pos = pos0 + r // G
            qo_head = hk * G + r % G

            for t0 in range(start, end, BC):
                cuda.syncthreads()  # every thread is done with the previous tile's K, V, S
                for e in range(tid, BC * D, NT):
                    j = e // D
                    d = e % D
                    pos = min(t0 + j, end - 1)  # past the range: re-read, masked below
                    off = token_offset(kv_indices, ib, U32(pos), row_stride, head_off,
                                       page_stride)
                    x = kv_f32(k[off + d])
                    if HAS_K:
                        kp = key_position(kv_indptr, kv_indices, b, pos)
                        x = float32(hook_key(x, kv_f32(k[off + (d + HALF) % D]), d, D, kp, hk))
                    kv_[j * KS + d] = x
                    kv_[K_SMEM + j * D + d] = kv_f32(v[off + d])
                cuda.syncthreads()
                for jj in range(SPT):
                    sc[jj] = ZERO
                for d in range(D):
                    qd = qs_[r * QS + d]
                    krow = sub * KS + d
                    for jj in range(SPT):
                        sc[jj] += qd * kv_[krow + TPR * KS * jj]
                for jj in range(SPT):
                    j = sub + TPR * jj
                    pos = t0 + j
                    s = sc[jj]
                    if s == NEG_INF:  # only inf in q or K gives it: poison, as NaN does
                        s = NAN
                    keep = row_ok and pos < end
                    kp = key_position(kv_indptr, kv_indices, b, min(pos, end - 1))
                    if HAS_LOGITS:
                        s = float32(hook_logits(s, q_pos, kp, qo_head)) * POST_LOG2E
                    if HAS_MASK:
                        keep = keep and hook_mask(q_pos, kp, qo_head)
                    if CUSTOM and keep:
                        keep = mask_bit(plan, mask_indptr_off, mask_words_off, b,
                                        qs + r // G, kv_len, pos) != 0
                    if GUARD and keep:  # p == 0 in p.V marks an unkept key (common)
                        s = kept_logit(s)
                    ss_[r * SS + j] = s if keep else MASKED
                cuda.syncthreads()
                if tid < TQ:  # one thread per packed row: the online softmax step
                    if SOFTMAX:
                        mold = row_m[tid]
                        mt = mold
                        for j in range(BC):
                            mt = max(mt, ss_[tid * SS + j])
                        mref = mt if mt > NEG_INF else ZERO
                        alpha = exp2(mold - mref)
                        lsum = row_l[tid] * alpha
                        for j in range(BC):
                            sj = ss_[tid * SS + j]
                            p = exp2(sj - mref)
                            p_pv = p
                            if GUARD:  # a kept key of weight 0 is still read in p.V
                                p, p_pv = split_weight(sj, p)
                            lsum += p
                            ss_[tid * SS + j] = p_pv
                        row_m[tid] = mt
                        row_l[tid] = lsum
                        row_a[tid] = alpha
                cuda.syncthreads()
                if SOFTMAX:
                    a = row_a[r]
                    for i in range(DPT):
                        acc[i] *= a
                # Tokens outside, dims inside: the inner loop has a constant trip count, so it
                # unrolls and acc stays in registers (indexed by constants only).
                for j in range(BC):
                    p = ss_[r * SS + j]
                    vrow = K_SMEM + j * D + sub
                    if not GUARD or p != ZERO:  # an unkept key's V may be NaN
                        for i in range(DPT):
                            acc[i] += p * kv_[vrow + TPR * i]

            # Finish the rows: the output (whole KV seen) or a partial state (a chunk).
            if SOFTMAX:
                inv, lse2 = finalize(row_m[r], row_l[r])
                inv *= v_scale
                lse_val = lse2 * F_LN2
            else:
                inv = v_scale
                lse_val = ZERO
            nan_row = False
            for i in range(DPT):
                acc[i] *= inv
                if not abs(acc[i]) < F_INF:
                    nan_row = True
            # The non-finite rule: a NaN or inf anywhere in a packed row's output (from q, or
            # the K or V row of a key it keeps) makes the whole row and its LSE NaN. The
            # row's TPR threads meet in row_a (free now: the loop is done with it).
            cuda.syncthreads()
            if tid < TQ:
                row_a[tid] = ZERO
            cuda.syncthreads()
            if nan_row:
                row_a[r] = float32(1.0)
            cuda.syncthreads()
            if row_a[r] != ZERO:
                lse_val = NAN
                for i in range(DPT):
                    acc[i] = NAN
            if row_ok:
                if prow < 0:
                    orow = q0 + qs + r // G
                    for i in range(DPT):
                        out = acc[i]
                        if HAS_OUT:
                            out = float32(hook_output(out, lse_val, qo_head))
                        store(o, (orow * hq + qo_head) * D + sub + TPR * i, out)
                    if sub == 0:
                        lse[orow * hq + qo_head] = lse_val
                else:
                    prw = prow + r // G
                    for i in range(DPT):
                        tmp_o[(prw * hq + qo_head) * D + sub + TPR * i] = acc[i]
                    if sub == 0:
                        tmp_lse[prw * hq + qo_head] = lse_val
            if prow >= 0:
                finish_split_tile(plan, counters, flags, tmp_o, tmp_lse, o, lse, item, hk,
                                  hkv, hq, nrows, tid, item_merge_off, merge_rows_off,
                                  merge_indptr_off, merge_indices_off, kv_, mnum)
            cuda.syncthreads()

    return prefill_kernel


__all__ = ["NUM_THREADS", "PrefillSpec", "build_prefill_kernel", "compile_prefill",
           "prefill_kernel_source", "prefill_signature"]
