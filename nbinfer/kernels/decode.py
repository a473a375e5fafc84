"""Batch decode over a paged (or contiguous) KV cache: the CUDA-core gather microkernel.

One CTA handles one work item ``(request b, kv head hk, kv range [start, end))`` and all ``G``
query heads of that KV head's GQA group, so each KV byte is read from HBM once per group.

Four warps stream disjoint groups of ``TG`` tokens (warp ``w`` takes groups ``w, w+4, ...``),
each through its own ``STAGES``-deep ring of shared-memory buffers, so warps never wait for each
other inside the loop. Per group, a warp:

1. gathers: each lane ``cp.async``-copies four 16-byte chunks of K and four of V (a group's K is
   always 2 KiB) from the pages the page table names (sparse) or a contiguous range (dense);
   ``STAGES - 1`` groups are in flight while one is computed.
2. scores: ``LPT`` lanes share a key row (``DPL = D / LPT`` dims each, one vector shared load);
   a lane forms partial dot products for its ``TPL`` tokens x ``G`` heads, and a reduce-scatter
   over the ``LPT`` lanes turns them into whole logits, one per lane, where the variant's logits
   transform and mask run exactly once per (token, head).
3. online softmax: the logits go through a warp-private shared buffer; every lane takes the new
   per-head maximum from it (vector loads) and rescales its accumulator, the owner lane of each
   logit turns it into ``p = exp2(s - m)`` and keeps the running sum ``l`` for its slot.
4. ``acc += p * v``: lane ``l`` owns dims ``[l * NV, (l + 1) * NV)``, ``NV = D / 32``.

At the end the four warps' states ``(m, l, acc)`` merge through shared memory (the merge operator
again) and the CTA writes the final output (request not split) or a partial state ``(O, LSE)``.

Bytes and FLOPs per token and KV head: ``2 * D * itemsize`` bytes (K and V) against
``4 * G * D`` FLOPs, i.e. ``G`` FLOP/byte for fp16. Decode is bound by HBM only if the SM issues
few instructions per byte: at 4.2 TB/s an H200 SM receives ~16 B/cycle, so a 4 KiB group
(K+V, fp16, D=128) must cost well under 1000 warp-instructions across its warp. The minimum is the
FMAs (``2 * G * D * TG / 32`` = 256 for G=4) plus one conversion per element (64); every shared
access therefore uses a 32-bit address plus an immediate and loads 8-16 bytes at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, types

from .common import (
    DECODE_PLAN_SECTIONS,
    F_INF,
    F_LN2,
    ITEMSIZE,
    STORAGE,
    WORK_FIELDS,
    AttentionSpec,
    attention_signature,
    compile_kernel,
    guards_masked_values,
    kept_weights,
    state_finalize,
)
from .decode_mma import ROW_ALIGN, decode_mma_ops, mma_decode_supported
from .fused_merge import build_merge_list
from .hooks import device_hooks
from .loading import loading_module
from .primitives import LOG2E, device_jit, primitives
from .warp import head_maxima, warp_collectives

NUM_WARPS = 4
NUM_THREADS = 32 * NUM_WARPS
GROUP_K_BYTES = 2048  # K bytes of one token group: 16-byte chunks x 32 lanes x 4


@dataclass(frozen=True)
class DecodeSpec(AttentionSpec):
    """Everything that is compiled into one decode kernel (hashable: the kernel cache key)."""

    # KV groups per warp's ring: stages - 1 groups (4 KiB each) in flight while one is computed.
    # Measured on the H200 at (64, 4096) with the ring 256-byte aligned: 3 stages 0.251 ms
    # against 0.248 at 2 (fp16), 0.145 against 0.138 (e4m3): more in flight does not pay.
    stages: int = 2
    # 65536 registers / (128 threads x 4 CTAs): four resident CTAs per SM. Measured on the H200
    # at (64, 4096): uncapped (140 regs, 3 CTAs/SM) 3.32 TB/s, 128 -> 4.00, 96 -> 3.28 (spills).
    max_registers: int | None = 128
    # A whole token group inside one page reads the page table once and steps a constant stride
    # per further chunk (596 instead of 639 hot-loop instructions per group, counted offline).
    # Measured on the H200 (bench/NOTES.md, issue 13, session 13): fp16 unchanged (within 1 %),
    # FP8 3-15 % faster (that kernel, 1178 instructions per 4 KiB group, is issue-bound).
    page_groups: bool = True
    # q.k and p.v on tensor cores (kernels/decode_mma.py): fp16/bf16 or FP8 KV at D 64/128,
    # G <= 8, variants without q/K transforms or masks (decode_mma.mma_decode_supported).
    mma: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.stages not in (2, 3, 4):
            raise ValueError(f"stages must be 2, 3 or 4, got {self.stages}")

    @property
    def tokens_per_group(self) -> int:
        """TG: tokens a warp gathers per stage (2 KiB of K: 8 fp16 tokens at D=128)."""
        return GROUP_K_BYTES // (self.head_dim * ITEMSIZE[self.kv_dtype])

    @property
    def lanes_per_token(self) -> int:
        """LPT: lanes that share one key row in q.k (fewer lanes -> shorter reduce-scatter).

        The smallest power of two whose slice keeps the lane's query registers (G * D / LPT)
        at or below 32 and its slice at or below 16 elements.
        """
        g, d, tg = self.group_size, self.head_dim, self.tokens_per_group
        for lpt in (4, 8, 16, 32):
            if g * d // lpt <= 32 and d // lpt <= 16 and 32 // lpt <= tg:
                return lpt
        return 32


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def ring_bytes(spec: DecodeSpec) -> int:
    """Bytes of the four warps' KV rings (``stages`` groups of K and V each)."""
    return NUM_WARPS * spec.stages * 2 * spec.tokens_per_group * spec.head_dim * \
        ITEMSIZE[spec.kv_dtype]


def dynamic_ring_bytes(spec: DecodeSpec) -> int:
    """Bytes of dynamic shared memory the kernel is launched with: the KV ring when it passes
    the static limit (less a margin for the other buffers, logits, merge and scratch, ~3.5 KiB,
    which stay static), else 0: at three or four stages (48 / 64 KiB for four warps)."""
    from .launch import STATIC_SHARED_LIMIT  # host code: not part of the kernel's source key

    n = ring_bytes(spec)
    return n if n > STATIC_SHARED_LIMIT - 8 * 1024 else 0


def decode_signature(spec: DecodeSpec):
    """The explicit Numba signature the kernel is compiled with (eagerly)."""
    return attention_signature(spec.kv_dtype, spec.q_dtype, len(DECODE_PLAN_SECTIONS))


@functools.cache
def build_decode_kernel(spec: DecodeSpec):
    """Compile (once per spec) the decode kernel; returns the compiled kernel
    (:func:`~.common.compile_kernel`).

    Kernel arguments (:data:`~.common.ATTENTION_ARGS`), arrays 1-D: ``q`` (from its first
    element; row ``b``, head ``h`` at ``b * q_stride_n + h * q_stride_h``), ``k``, ``v`` (flat KV
    storage from the first element of each; a combined ``[P, 2, ...]`` cache is two views of one
    buffer), ``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` (int32), ``plan`` (int32: the
    scheduler's packed plan plus ``item_merge``, the merge list of every work item or -1),
    ``o [B*Hq*D]`` (contiguous), ``lse [B*Hq]`` (float32, natural log), ``tmp_o [P*Hq*D]``,
    ``tmp_lse [P*Hq]`` (float32 partial states), ``counters [M*Hkv]`` (int32, zero between
    launches: each launch leaves them zero), then scalars ``num_kv_heads``, the element strides
    ``page_stride`` (paged only), ``kv_stride_n``, ``kv_stride_h``, ``q_stride_n``,
    ``q_stride_h``, ``sm_scale`` (``k_scale`` folded in), ``v_scale`` and the word offsets in
    ``plan`` of the sections named in ``DECODE_PLAN_SECTIONS``. K/V base pointers and strides
    must be 16-byte aligned (cp.async).

    The grid is fixed (any number of CTAs): CTA ``c`` runs the work items
    ``cta_work[cta_indptr[c]:cta_indptr[c+1]]`` one after the other. An item that covers its
    request's whole KV writes the output; a chunk writes a partial state, and the CTA that
    completes the last chunk of a (merge list, kv head) contracts the list's partials in the
    map's order and writes the output: one launch, no atomics on data, bitwise reproducible.
    """
    from .launch import use_dynamic_shared  # host code: not part of the kernel's source key

    opts = {"max_registers": spec.max_registers} if spec.max_registers else {}
    kernel = compile_kernel("decode", spec, decode_signature(spec),
                            lambda: decode_kernel_source(spec), **opts)
    return use_dynamic_shared(kernel, dynamic_ring_bytes(spec), spec.sim)


def decode_kernel_source(spec: DecodeSpec):
    """The kernel as a Python function with every constant and device function captured."""
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    D = spec.head_dim
    HALF = D // 2
    G = spec.group_size
    GP = _next_pow2(G)
    PS = spec.page_size
    IS = ITEMSIZE[spec.kv_dtype]
    TG = spec.tokens_per_group
    LPT = spec.lanes_per_token
    DPL = D // LPT  # q.k: dims per lane
    NH = 32 // LPT  # q.k: key rows a warp covers at once
    TPL = TG // NH  # q.k: tokens per lane and group
    NV = D // 32  # p.v: dims per lane
    N = TPL * GP  # partial dot products per lane and group
    GDPL = G * DPL  # local-array sizes must be single captured constants, not expressions
    GNV = G * NV
    GTG = G * TG
    NW = NUM_WARPS
    NT = NUM_THREADS
    S = spec.stages
    CE = 16 // IS  # elements per 16-byte chunk
    CR = D // CE  # chunks per key row
    CPL = GROUP_K_BYTES // 16 // 32  # K chunks per lane and group (and as many V chunks)
    K_BYTES = TG * D * IS
    STAGE_BYTES = 2 * K_BYTES
    WARP_ELEMS = S * 2 * TG * D
    KV_SMEM = NW * WARP_ELEMS
    KV_DECL = 0 if dynamic_ring_bytes(spec) else KV_SMEM  # 0: allocated at launch
    PB = GP * TG  # one probability buffer of one warp (float32)
    P_SMEM = NW * 2 * PB
    MERGE_SMEM = NW * (D + 2)
    coll = warp_collectives(N, NW, sim, LPT)
    R, REP, SCRATCH = coll.R, coll.REP, coll.scratch_size
    # After the reduce-scatter a lane's R logits belong to one head (GP <= LPT), and head h's
    # logits sit in lanes u of [h * HB, (h + 1) * HB) of every key row's lane group.
    HB = TPL * REP // R
    hmax = head_maxima(G, HB, LPT, NW, sim)
    head_max, HSCRATCH = hmax.maxima, hmax.scratch_size
    # Numba captures functions, not namespaces: bind every device function to a plain name.
    reduce_scatter = coll.reduce_scatter
    hook_query, hook_key, hook_logits = hooks.query, hooks.key, hooks.logits
    hook_mask, hook_output = hooks.mask, hooks.output
    KV_T = STORAGE[spec.kv_dtype]
    shared_addr, sts_f32, cp16 = prims.shared_addr, prims.sts_f32, prims.cp_async16_to
    lds_k = prims.make_lds(spec.kv_dtype, DPL)
    lds_v = prims.make_lds(spec.kv_dtype, NV)
    lds_p = prims.make_lds("float32", TG)  # a head's TG logits or probabilities at once
    commit = prims.commit
    wait_ready = prims.wait(S - 2)
    exp2 = prims.exp2
    q_to_f32 = prims.convert[spec.q_dtype]
    SOFTMAX = hooks.use_softmax
    HAS_Q, HAS_K = hooks.has_query, hooks.has_key
    HAS_LOGITS, HAS_MASK, HAS_OUT = hooks.has_logits, hooks.has_mask, hooks.has_output
    # Without a logits hook, fold log2(e) into q so that exp2 can be used directly.
    Q_LOG2E = float32(LOG2E if (SOFTMAX and not HAS_LOGITS) else 1.0)
    POST_LOG2E = float32(LOG2E if (SOFTMAX and HAS_LOGITS) else 1.0)
    NEG_INF = float32(-np.inf)
    NAN = float32(np.nan)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    MASKED = NEG_INF if SOFTMAX else ZERO
    GUARD = guards_masked_values(hooks)  # p.V skips unkept keys (common.KEPT_FLOOR)
    kept_logit, split_weight = kept_weights(SOFTMAX, sim)
    OD = -(-D // NUM_THREADS)  # output dims per thread in the epilogue
    SPARSE = spec.sparse
    finalize = state_finalize(sim)
    jit_dev = device_jit(sim)
    MMA = spec.mma
    if MMA and not mma_decode_supported(D, G, spec.kv_dtype, spec.q_dtype, spec.variant):
        raise ValueError(f"DecodeSpec(mma=True) does not support this spec: {spec}")
    if MMA:
        mo = decode_mma_ops(D, TG, spec.kv_dtype, spec.q_dtype, NW, sim)
        QFM, QFM_T, NSM, NOM, MSCR = mo.QF, mo.QF_T, mo.NS, mo.NO, mo.SCRATCH
        mma_scores, mma_pv, quad_max, quad_sum = mo.scores, mo.pv, mo.quad_max, mo.quad_sum
        head_alphas = mo.head_alphas
        load_qm, clear_qm, chunk_addr, out_dim = mo.load_q, mo.clear_q, mo.chunk_addr, mo.out_dim
    else:  # never called: the MMA branches below are compiled out
        QFM, QFM_T, NSM, NOM, MSCR = 1, float32, 1, 1, 1
        mma_scores = mma_pv = quad_max = quad_sum = load_qm = clear_qm = head_alphas = None
        chunk_addr = out_dim = None

    @jit_dev
    def syncwarp():
        # The simulator has no __syncwarp; every thread reaches this point, so a block barrier
        # serves (resolved at call time: the simulator binds cuda.* inside a running kernel).
        if sim:
            cuda.syncthreads()
        else:
            cuda.syncwarp()

    U32 = types.uint32

    # Rows between a lane's consecutive chunks when a row's chunks divide the warp (CR | 32:
    # every 16-bit D <= 256, FP8, fp32 D <= 128); 0 otherwise (fp32 D 256).
    ROW_STEP = 32 // CR if 32 % CR == 0 else 0
    IN_PAGE = max(PS - TG, 0)  # a group starting at page slot <= this ends in the same page
    # Groups can take the one-page path below: not when a page holds fewer tokens than a group.
    FAST_GROUPS = spec.page_groups and ROW_STEP > 0 and (not SPARSE or PS >= TG)

    @jit_dev
    def issue_group(kvs, sbase, k, v, kv_indices, ib, gstart, last, lane, row_stride, head_off,
                    page_stride, row_step):
        # Chunk ci = lane + 32 j of the group's K is row ci // CR, column (ci % CR) * CE; rows
        # are contiguous in shared memory, so its destination is simply sbase + 16 ci.
        # (U32(...) around sums and operands: Numba widens uint32 arithmetic to 64 bits, and a
        # signed operand makes `//` and `%` signed; truncated, LLVM keeps them 32-bit shifts.)
        whole = FAST_GROUPS and U32(gstart + U32(TG - 1)) <= U32(last)
        if SPARSE and whole:
            whole = U32(U32(gstart) % U32(PS)) <= U32(IN_PAGE)
        if whole:
            # The group's TG tokens are all valid and in one page (decode groups start at
            # multiples of TG, so with TG | page size always but at the step's end): one
            # page-table read and one 64-bit offset per group, then each chunk is ROW_STEP rows
            # past the last (row_step elements). Per chunk the general path below costs a
            # page-table read and ~25 instructions of 64-bit offset math (4 chunks per lane).
            off = token_offset(kv_indices, ib, U32(gstart + U32(lane // CR)), row_stride,
                               head_off, page_stride)
            for j in range(CPL):
                if MMA:  # the swizzled rows decode_mma reads
                    ci = lane + 32 * j
                    dst = chunk_addr(sbase, ci // CR, ci % CR)
                else:
                    dst = sbase + 16 * (lane + 32 * j)
                cp16(kvs, dst, k, off)
                cp16(kvs, dst + K_BYTES, v, off)
                off += row_step
        else:
            for j in range(CPL):
                ci = lane + 32 * j
                # Tokens past the range re-read the last valid token; their logits are masked.
                pos = min(gstart + U32(ci // CR), last)
                off = token_offset(kv_indices, ib, pos, row_stride, head_off, page_stride)
                # head_off holds column (lane % CR) * CE; rows wider than 32 chunks (fp32,
                # D=256) continue at column (lane + 32 j) % CR = lane % CR + (32 j) % CR.
                off += ((32 * j) % CR) * CE
                if MMA:
                    dst = chunk_addr(sbase, ci // CR, ci % CR)
                else:
                    dst = sbase + 16 * ci
                cp16(kvs, dst, k, off)
                cp16(kvs, dst + K_BYTES, v, off)

    SMEM_ALIGN = prims.SMEM_ALIGN
    # The ring 256-byte aligned: the tensor-core path derives its row addresses by XOR
    # (decode_mma.ROW_ALIGN), and a ring allocated at launch (3-4 stages) that followed the
    # static arrays at 16 bytes (48 mod 128) was slow, most likely because the L2 then served
    # each KV sector twice (ncu: 49 % L2 hits): 3 stages took 0.323 ms at (64, 4096) fp16
    # misaligned, 0.251 aligned (H200; bench/NOTES.md).
    KV_ALIGN = max(SMEM_ALIGN, ROW_ALIGN) if SMEM_ALIGN else SMEM_ALIGN
    fused = build_merge_list(G, D, NT, MERGE_SMEM, spec.variant, spec.q_dtype, sim)
    finish_split_item, store, OUTS = fused.finish_split_item, fused.store, fused.OUTS
    loader = loading_module(SPARSE, PS, sim)
    request_kv_len, request_base = loader.request_kv_len, loader.request_base
    token_offset = loader.token_offset

    def decode_kernel(q, k, v, kv_indptr, kv_indices, kv_last, plan, o, lse, tmp_o, tmp_lse,
                      counters, hkv, page_stride, kv_stride_n, kv_stride_h, q_stride_n, q_stride_h,
                      sm_scale, v_scale, work_off, cta_indptr_off, cta_work_off, merge_rows_off,
                      merge_indptr_off, merge_indices_off, item_merge_off):
        kvs = cuda.shared.array(KV_DECL, KV_T, alignment=KV_ALIGN)  # cp.async, ld.v4: 16 B
        pbuf = cuda.shared.array(P_SMEM, float32)
        msmem = cuda.shared.array(MERGE_SMEM, float32)
        scratch = cuda.shared.array(SCRATCH, float32)
        hscratch = cuda.shared.array(HSCRATCH, float32)
        part = cuda.local.array(N, float32)
        sc = cuda.local.array(R, float32)
        lpart = cuda.local.array(R, float32)
        gmax = cuda.local.array(G, float32)
        slot_h = cuda.local.array(R, int32)
        slot_t = cuda.local.array(R, int32)
        qv = cuda.local.array(GDPL, float32)
        kf = cuda.local.array(DPL, float32)
        acc = cuda.local.array(GNV, float32)
        pl = cuda.local.array(GTG, float32)
        m = cuda.local.array(G, float32)
        last_flag = cuda.shared.array(1, int32)
        mnum = cuda.local.array(OUTS, float32)
        outv = cuda.local.array(OD, float32)
        qm = cuda.local.array(QFM, QFM_T)  # MMA: this lane's Q fragment
        sm = cuda.local.array(NSM, float32)  # MMA: S, then P, of head lane // 4
        accm = cuda.local.array(NOM, float32)  # MMA: O^T, heads 2 (lane % 4) + (0, 1)
        mscr = cuda.shared.array(MSCR, float32)  # MMA: the simulator's cross-lane scratch

        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        half = lane // LPT  # which of the NH key rows this lane reads in q.k
        u = lane % LPT  # position within the row
        hq = hkv * G
        c = cuda.blockIdx.x
        for wi in range(plan[cta_indptr_off + c], plan[cta_indptr_off + c + 1]):
            item = plan[cta_work_off + wi]
            w0 = work_off + item * WORK_FIELDS
            b = plan[w0]
            hk = plan[w0 + 1]
            start = plan[w0 + 4]
            end = plan[w0 + 5]
            prow = plan[w0 + 6]
            kv_len = request_kv_len(kv_indptr, kv_last, b)
            q_pos = kv_len - 1
            qscale = sm_scale * Q_LOG2E

            gq = lane // 4  # MMA: this lane's head (rows >= G are padding)
            m_own = NEG_INF
            l_own = ZERO
            if MMA:
                if gq < G:
                    load_qm(q, int64(b) * q_stride_n + int64(hk * G + gq) * q_stride_h, lane,
                            qm)
                else:
                    clear_qm(qm)
                for e in range(NOM):
                    accm[e] = ZERO
            if not MMA:
                for h in range(G):
                    qbase = int64(b) * q_stride_n + int64(hk * G + h) * q_stride_h  # strided q
                    for e in range(DPL):
                        d = u * DPL + e
                        x = q_to_f32(q[qbase + d])
                        if HAS_Q:
                            xp = q_to_f32(q[qbase + (d + HALF) % D])
                            x = float32(hook_query(x, xp, d, D, q_pos, hk * G + h))
                        qv[h * DPL + e] = x * qscale
                    for e in range(NV):
                        acc[h * NV + e] = ZERO
                    m[h] = NEG_INF
            for r in range(R):
                slot = (u // REP) * R + r
                slot_h[r] = slot // TPL
                slot_t[r] = half + NH * (slot % TPL)
                lpart[r] = ZERO

            # Loop state is unsigned 32-bit and advanced incrementally: Numba's default int64
            # arithmetic would otherwise put 64-bit index math into every group.
            n_kv = U32(end - start)
            rounds = (n_kv + U32(NW * TG - 1)) // U32(NW * TG)
            last = U32(end - 1)
            ib, row_stride, head_off = request_base(kv_indptr, b, hk, kv_stride_n, kv_stride_h)
            head_off += (lane % CR) * CE  # this lane's column of its first chunk
            row_step = int64(ROW_STEP) * row_stride
            kv_base = shared_addr(kvs, warp * WARP_ELEMS)
            pa = shared_addr(pbuf, warp * 2 * PB)  # logits of the group
            pb = pa + U32(4 * PB)  # probabilities of the group
            g0 = U32(start) + U32(warp * TG)
            for g in range(S - 1):
                if g < rounds:
                    issue_group(kvs, kv_base + U32(g * STAGE_BYTES), k, v, kv_indices, ib,
                                g0 + U32(g * NW * TG), last, lane, row_stride, head_off,
                                page_stride, row_step)
                commit()  # possibly empty: keeps "wait until S-2 groups are pending" uniform
            gstart = g0
            sb = kv_base
            for r in range(rounds):
                wait_ready()
                # Publishes every lane's copies of group r, and frees the stage read in round r-1.
                syncwarp()
                if r + U32(S - 1) < rounds:
                    nb = sb + U32((S - 1) * STAGE_BYTES)
                    if nb >= kv_base + U32(S * STAGE_BYTES):
                        nb -= U32(S * STAGE_BYTES)
                    issue_group(kvs, nb, k, v, kv_indices, ib, gstart + U32((S - 1) * NW * TG),
                                last, lane, row_stride, head_off, page_stride, row_step)
                commit()

                if MMA:
                    # S of head gq for the group's tokens 8 nt + 2 (lane % 4) + i (unscaled).
                    mma_scores(kvs, sb, lane, qm, sm)
                    for idx in range(NSM):
                        pos = gstart + U32(8 * (idx // 2) + 2 * (lane % 4) + idx % 2)
                        # Scaled first, as the CUDA-core path's q is: with a negative scale a
                        # kept +inf q.k is -inf here, which only inf in q or K gives: poison.
                        s = sm[idx] * qscale
                        if s == NEG_INF:
                            s = NAN
                        keep = pos <= last and gq < G
                        if HAS_LOGITS:
                            s = float32(hook_logits(s, q_pos, pos, hk * G + min(gq, G - 1))) \
                                * POST_LOG2E
                        sm[idx] = s if keep else MASKED
                    if SOFTMAX:
                        lm = sm[0]
                        for idx in range(1, NSM):
                            lm = max(lm, sm[idx])
                        mt = max(m_own, quad_max(lm, lane, warp, mscr))
                        mref = mt if mt > NEG_INF else ZERO
                        # A head with no kept key yet (padding heads g >= G always) has l = 0
                        # and O = 0: factor 1, exact, so that the skip below can fire at G < 8.
                        alpha = ONE if mt == NEG_INF else exp2(m_own - mref)
                        m_own = mt
                        a_even, a_odd = head_alphas(alpha, lane, mscr)
                        # Once the maxima settle the factors are 1: skip the D / 4 multiplies
                        # (a branch, exact either way).
                        if a_even != ONE or a_odd != ONE:
                            for e in range(NOM // 2):
                                accm[2 * e] *= a_even
                                accm[2 * e + 1] *= a_odd
                        psum = ZERO
                        for idx in range(NSM):
                            p = exp2(sm[idx] - mref)
                            psum += p
                            sm[idx] = p
                        l_own = l_own * alpha + psum
                    mma_pv(kvs, sb + U32(K_BYTES), lane, sm, accm, mscr)
                else:
                    # q.k partials: TPL tokens x GP heads (padding heads are 0) over DPL dims.
                    for i in range(TPL):
                        t = half + NH * i
                        kx = lds_k(kvs, sb + (t * D + u * DPL) * IS)
                        if HAS_K:
                            kp = lds_k(kvs, sb + (t * D + (u * DPL + HALF) % D) * IS)
                        for e in range(DPL):
                            x = kx[e]
                            if HAS_K:
                                x = float32(hook_key(x, kp[e], u * DPL + e, D, gstart + t, hk))
                            kf[e] = x
                        for h in range(GP):
                            dot = ZERO
                            if h < G:
                                for e in range(DPL):
                                    dot += qv[h * DPL + e] * kf[e]
                            part[h * TPL + i] = dot
                    reduce_scatter(part, sc, lane, warp, scratch)

                    # Each lane now owns R whole logits: run the variant on each exactly once.
                    for rr in range(R):
                        h = slot_h[rr]
                        pos = gstart + slot_t[rr]
                        s = sc[rr]
                        if s == NEG_INF:  # only inf in q or K gives it: poison, as NaN does
                            s = NAN
                        keep = pos <= last and h < G
                        # Padding heads (h >= G when G is not a power of two) are masked; the hooks
                        # see a real head (a slope table has Hq entries).
                        hh = hk * G + min(h, G - 1)
                        if HAS_LOGITS:
                            s = float32(hook_logits(s, q_pos, pos, hh)) * POST_LOG2E
                        if HAS_MASK:
                            keep = keep and hook_mask(q_pos, pos, hh)
                        if GUARD and keep:  # p == 0 in p.V marks an unkept key (common)
                            s = kept_logit(s)
                        sc[rr] = s if keep else MASKED

                    if SOFTMAX:
                        # Every head's maximum of the group in every lane, by shuffles among the
                        # lanes that own the head's logits (no shared-memory round trip).
                        lm = sc[0]
                        for rr in range(1, R):
                            lm = max(lm, sc[rr])
                        head_max(lm, lane, warp, hscratch, gmax)
                        own = slot_h[0]  # the one head of this lane's logits (>= G: padding)
                        own_mref = ZERO
                        own_alpha = ONE
                        for h in range(G):
                            mt = max(m[h], gmax[h])
                            # An all-masked head keeps m = -inf; 0 as the reference avoids NaN.
                            mref = mt if mt > NEG_INF else ZERO
                            alpha = exp2(m[h] - mref)
                            m[h] = mt
                            for e in range(NV):
                                acc[h * NV + e] *= alpha
                            if own == h:
                                own_mref = mref
                                own_alpha = alpha
                        for rr in range(R):
                            p = exp2(sc[rr] - own_mref)
                            p_pv = p
                            if GUARD:  # a kept key of weight 0 is still read in p.V
                                p, p_pv = split_weight(sc[rr], p)
                            lpart[rr] = lpart[rr] * own_alpha + p
                            sc[rr] = p_pv
                    for rr in range(R):
                        sts_f32(pbuf, pb + 4 * (slot_h[rr] * TG + slot_t[rr]), sc[rr])
                    syncwarp()

                    # acc += p * v on this lane's NV dims (all G x TG probabilities loaded first:
                    # one straight-line block, no inner loop left for the compiler to keep
                    # rolled).
                    for h in range(G):
                        pv = lds_p(pbuf, pb + U32(4 * h * TG))
                        for j in range(TG):
                            pl[h * TG + j] = pv[j]
                    vb = sb + U32(K_BYTES + lane * NV * IS)
                    for t in range(TG):
                        vx = lds_v(kvs, vb + U32(t * D * IS))
                        for h in range(G):
                            p = pl[h * TG + t]
                            if not GUARD or p != ZERO:  # an unkept key's V may be NaN
                                for e in range(NV):
                                    acc[h * NV + e] += p * vx[e]
                gstart += U32(NW * TG)
                sb += U32(STAGE_BYTES)
                if sb >= kv_base + U32(S * STAGE_BYTES):
                    sb = kv_base

            # Per-head sums of the owners' running l (slots shared by REP lanes are written once
            # per address, so each slot counts once).
            if SOFTMAX:
                if MMA:
                    l_own = quad_sum(l_own, lane, warp, mscr)  # head gq's sum in its 4 lanes
                else:
                    for rr in range(R):
                        sts_f32(pbuf, pa + 4 * (slot_h[rr] * TG + slot_t[rr]), lpart[rr])
            syncwarp()

            # Merge the four warps' states, one head at a time.
            for h in range(G):
                if MMA:
                    if lane % 4 == h // 2:  # head h is column h % 2 of lanes 4g + h // 2
                        for i in range(NOM // 4):
                            for r in range(2):
                                msmem[warp * (D + 2) + out_dim(i, r, gq)] = \
                                    accm[4 * i + 2 * r + h % 2]
                    if gq == h:
                        if lane % 4 == 0:
                            msmem[warp * (D + 2) + D] = m_own
                            msmem[warp * (D + 2) + D + 1] = l_own
                else:
                    lsum = ZERO
                    if SOFTMAX:
                        sv = lds_p(pbuf, pa + U32(4 * h * TG))
                        for j in range(TG):
                            lsum += sv[j]
                    for e in range(NV):
                        msmem[warp * (D + 2) + lane * NV + e] = acc[h * NV + e]
                    if lane == 0:
                        msmem[warp * (D + 2) + D] = m[h]
                        msmem[warp * (D + 2) + D + 1] = lsum
                cuda.syncthreads()
                qo_head = hk * G + h
                mmax = NEG_INF
                for w in range(NW):
                    mmax = max(mmax, msmem[w * (D + 2) + D])
                mref = mmax if mmax > NEG_INF else ZERO
                total = ZERO
                if SOFTMAX:
                    for w in range(NW):
                        total += msmem[w * (D + 2) + D + 1] * exp2(msmem[w * (D + 2) + D] - mref)
                    inv, lse2 = finalize(mmax, total)
                    inv *= v_scale
                    lse_val = lse2 * F_LN2
                else:
                    inv = v_scale
                    lse_val = ZERO
                nan_row = 0
                for i in range(OD):
                    d = tid + i * NT
                    if d < D:
                        num = ZERO
                        for w in range(NW):
                            if SOFTMAX:
                                num += msmem[w * (D + 2) + d] * exp2(msmem[w * (D + 2) + D] - mref)
                            else:
                                num += msmem[w * (D + 2) + d]
                        outv[i] = num * inv
                        if not abs(outv[i]) < F_INF:
                            nan_row = 1
                # The non-finite rule: a NaN or inf anywhere in the head's output (from q, or the
                # K or V row of a key it keeps) makes its whole row and LSE NaN.
                if cuda.syncthreads_or(nan_row):
                    lse_val = NAN
                for i in range(OD):
                    d = tid + i * NT
                    if d < D:
                        out = outv[i] if lse_val == lse_val else NAN
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

            if prow >= 0:
                finish_split_item(plan, counters, last_flag, tmp_o, tmp_lse, o, lse, item, hk,
                                  hkv, hq, 1, tid, item_merge_off, merge_rows_off,
                                  merge_indptr_off, merge_indices_off, msmem, mnum)
            cuda.syncthreads()

    return decode_kernel


__all__ = ["DecodeSpec", "NUM_THREADS", "NUM_WARPS", "build_decode_kernel", "decode_kernel_source",
           "decode_signature"]
