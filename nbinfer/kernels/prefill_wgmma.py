"""Batch prefill on Hopper's warpgroup MMA, lean: the plain variants only (FlashInfer's ``fa3``
backend has the same scope against its ``fa2``).

:mod:`.prefill_mma` with ``wgmma=True`` keeps every feature of the tensor-core kernel (hooks on
each score, custom masks, clear and masked paths per warp, row sums by a ones-``mma``, the fused
merge) and measured *slower* than its ``mma.sync`` form on the H200: 206 registers, one CTA of
8 warps per SM, and ~1060 instructions per warp and 64-key tile around 12 ``HGMMA``
(bench/NOTES.md, "Issue 13, session 16"). This kernel is the standalone tile that measured
0.86-0.95x SDPA flash (``bench/wgmma_attention.py``'s ``build_pipe``, ``r128``) grown to
nbinfer's work items, and nothing more:

- the same plan, arguments and companions as the tensor-core kernel (``prefill_signature``;
  the value scan before it and the ``mma.sync`` guarded twin after it when the variant masks,
  the merge launch after it for split rows: ``defer_merge``);
- a CTA of two warpgroups takes 128 packed rows (query rows x GQA group); Q is staged once per
  item, K / V tiles of 64 keys stream through a ring of two stages by ``cp.async``
  (:func:`.prefill_mma.kv_tile_loader`: ragged, single or paged), one barrier per tile;
- per tile each warpgroup runs ``S = Q K^T`` (``D / 16`` ``wgmma.m64n64k16``), the online
  softmax on S's registers, ``O += P V`` (4 ``wgmma.m64nDk16``, P from registers, V through
  the transpose flag);
- *clear* tiles (every key before the CTA's first row and inside the KV range) run in a loop
  of their own with no mask; the tiles that cross the diagonal or the KV end follow, with the
  mask as a pass of its own (a select inside the max loop cost 11 registers in the standalone);
- no hooks: the variant is causal or nothing (:func:`lean_eligible`), 16-bit q and KV of one
  type, D 64 / 128, no custom mask, no block positions; ptxas's cap of 128 registers lets two
  CTAs (2 x 256 threads) share an SM;
- three rungs, each off unless its spec flag asks: ``prefetch`` (Q by ``cp.async``; the next
  item's first K / V tile, and on ragged KV its Q, requested during this item's last tile),
  ``lazy_rescale`` (the accumulators rescaled only when a row's maximum grows by more than
  2^8), both measured in session 21 (+2 % and -8 %), and ``qk_ahead`` (each tile's ``S = Q
  K^T`` issued before the ring's refill: +1.5 to +4.8 % at most of req 1's rows in session 29,
  which the api turns on, ``LEAN_QK_AHEAD``); and ``swizzle`` (K and V tiles in the 128-byte
  swizzled layout, eight threads' copies one whole 128-byte line: B4 L4096 D128 fp16 229.6 ->
  363.5 TFLOP/s causal, 269.3 -> 453.9 non-causal on an H100, ``LEAN_SWIZZLE``, on).

Arithmetic per 64-key tile and warpgroup at D 128: 2 x 64 x 64 x 128 x 2 = 2.1 MFLOP on the
tensor cores, 32 scores and 64 accumulators per thread of element-wise work (one max, one min,
one FFMA + exp2 + add per score, 64 rescales); bytes: 32 KiB of K and V per tile for the CTA's
128 rows, 128 FLOP/byte. What K and V cost is not their bytes but their copy requests: in the
canonical layout eight threads copy 16-byte pieces of eight rows, and every kernel built that
way (cp.async from the computing warps, a producer warpgroup, or TMA boxes of 16-byte rows)
stopped at ~2.2 TB/s into the SMs, ~280 TFLOP/s here; whole 128-byte lines into the swizzled
layout moved 8-12 TB/s (L2 hits) in the same test (bench/NOTES.md, session 30).

In the simulator (``spec.sim``) the two products are the ``mma.sync`` twins of
:func:`nbinfer.kernels.mma.tile_ops`, whose per-lane fragments are the warpgroup's, over padded
rows: the rest of the kernel (items, ring, masks, softmax, epilogue) runs as the GPU runs it,
so tests/test_kernels_prefill_wgmma.py checks it in CI (``MMA_WGMMA = True`` asks for it).

The non-finite rule (nbinfer's, :mod:`.value_scan`): a NaN reaches the output by itself; a
``-inf`` score (inf in q or K) would vanish in ``exp2``, so each kept score also enters a
running minimum per row and a row whose minimum is ``-inf`` is made NaN at the end; a masked
key's non-finite V (``0 x NaN`` in the ``P V`` product) is the guarded twin's, run only on the
pairs the scan flags.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, types

from ..variants.builtins import is_causal_mask
from .common import F_INF, F_LN2, state_finalize
from .dependent import dependent_launch
from .fused_merge import build_merge_list
from .mma import FULL_MASK, _gpu_mma_intrinsics, tile_ops
from .positions import prefill_item_reader
from .prefill_mma import (
    array_addr_low,
    kv_tile_loader,
    q_row_offsetter,
    q_tile_stager,
    shared_layout,
)
from .primitives import LOG2E, device_jit, primitives
from .wgmma import WGMMA_KINDS, copy_slot, wgmma_intrinsics, wgmma_tile_ops

# The lean kernel's fixed shape: two warpgroups, 64-key tiles, two stages, ptxas's cap
LEAN_WARPS = 8
LEAN_KV_TILE = 64
LEAN_STAGES = 2
LEAN_MAX_REGISTERS = 128


def lean_eligible(variant, custom_mask: bool, block_positions: bool) -> bool:
    """Whether the lean warpgroup kernel computes this problem: softmax attention whose only
    mask is causal (or none), no query / key / logits / output hook, no custom mask, affine
    query positions (the dtype, head dim and device are the caller's to check)."""
    if (variant.query_transform or variant.key_transform or variant.logits_transform
            or variant.output_transform):
        return False
    if not variant.use_softmax or custom_mask or block_positions:
        return False
    return all(is_causal_mask(f) for f in variant.logits_mask)


def _target(spec, sim: bool):
    """The kernel's target-specific pieces, as a namespace: ``ops``, ``p_times_v(smem, vbase,
    tid, lane, s, pw, acc, scratch)``, ``qk_issue`` / ``qk_wait`` (``ops.qk_smem``'s two
    halves; in the simulator the whole product and nothing), ``warp_any(pred, tid, scratch)``
    (whether ``pred`` holds in any lane of the calling warp), ``opaque(x)``,
    ``addr_low(arr)``, ``store_u32`` and ``pack`` (two floats -> one b32 of the operand type;
    :func:`.wgmma.wgmma_intrinsics`).
    On the GPU: the warpgroup tile ops, ``O += P V`` from P packed into its A words. In the
    simulator (which has no warpgroup MMA and no warp votes): the ``mma.sync`` twins of
    :func:`.mma.tile_ops`, whose fragments are the same - warp ``w`` of the CTA holds packed
    rows ``16 w + lane // 4 (+ 8)``, ``s[4 j + 2 h + c]`` key ``8 j + 2 (lane % 4) + c`` - over
    padded rows instead of the canonical layouts (each product's layout is checked against
    NumPy on the H200 by tests/test_wgmma.py), a vote through shared memory (the twins'
    scratch, after ``quad_reduce``'s slots' use: each call meets the block at two barriers)
    and no 32-bit output stores; everything else runs as it is."""
    D, BC, NW = spec.head_dim, spec.tile_kv, spec.num_warps
    A_WORDS = BC // 4  # P as the P V product's A fragments
    addr_low = array_addr_low(sim)
    if sim:
        ops = tile_ops(D, BC, spec.q_dtype, NW, True)
        pv = ops.pv

        @device_jit(True)
        def p_times_v(smem, vbase, tid, lane, s, pw, acc, scratch):
            pv(smem, vbase, tid, lane, s, acc, scratch)  # rounds P to the operand type

        VOTE = NW * 32 * ops.NS  # quad_reduce's slots: [VOTE, VOTE + 2 NT)

        @cuda.jit(device=True)  # binds the simulator's syncthreads
        def warp_any(pred, tid, scratch):
            scratch[VOTE + 2 * tid] = 1.0 if pred else 0.0
            cuda.syncthreads()
            w0 = tid - tid % 32
            hit = False
            for u in range(32):
                hit = hit or scratch[VOTE + 2 * (w0 + u)] > 0.0
            cuda.syncthreads()
            return hit

        qk_smem = ops.qk_smem

        @device_jit(True)
        def qk_wait(s):
            pass  # the twin's product is done when it returns

        return SimpleNamespace(ops=ops, p_times_v=p_times_v, warp_any=warp_any, qk_issue=qk_smem,
                               qk_wait=qk_wait, opaque=lambda x: x, addr_low=addr_low,
                               store_u32=None, pack=None)
    ops = wgmma_tile_ops(D, BC, spec.q_dtype, NW, spec.swizzle)
    pv_words = ops.pv_words
    pack = _gpu_mma_intrinsics().pack[WGMMA_KINDS[spec.q_dtype]]  # two floats -> one b32
    intr = wgmma_intrinsics()

    @device_jit(False)
    def p_times_v(smem, vbase, tid, lane, s, pw, acc, scratch):
        # P's A fragment for keys 16 kk .. 16 kk + 15 is S's column blocks 2 kk, 2 kk + 1
        for w in range(A_WORDS):
            pw[w] = pack(s[2 * w], s[2 * w + 1])
        pv_words(pw, vbase, acc)

    @device_jit(False)
    def warp_any(pred, tid, scratch):
        return cuda.any_sync(FULL_MASK, pred)

    return SimpleNamespace(ops=ops, p_times_v=p_times_v, warp_any=warp_any,
                           qk_issue=ops.qk_issue, qk_wait=ops.qk_wait,
                           opaque=intr.opaque_u32, addr_low=addr_low,
                           store_u32=intr.store_u32, pack=pack)


def prefill_wgmma_kernel_source(spec):
    """The lean kernel's Python source for ``spec`` (an ``MmaPrefillSpec`` with ``lean=True``:
    8 warps, 64-key tiles, 2 stages, ``defer_merge``); launched like the tensor-core kernel.
    With ``spec.sim`` the products are the simulator's twins (:func:`_target`)."""
    sim = spec.sim
    prims = primitives(sim)
    D, G, NT, BC = spec.head_dim, spec.group_size, spec.num_threads, spec.tile_kv
    tgt = _target(spec, sim)
    ops, p_times_v, opaque = tgt.ops, tgt.p_times_v, tgt.opaque  # (opaque: Q's address)
    warp_any, qk_issue, qk_wait = tgt.warp_any, tgt.qk_issue, tgt.qk_wait
    qk_smem, publish = ops.qk_smem, ops.publish
    quad_reduce = ops.quad_reduce  # over the four lanes that hold a row (two shuffles)
    NS, NO = ops.NS, ops.NO  # a thread's scores (two rows) and output accumulators per tile
    A_WORDS = BC // 4  # P as the P V product's A fragments
    SCRATCH = max(ops.SCRATCH, 1)  # the simulator twins' exchange; unused on the GPU
    TILE_BYTES = ops.TILE_BYTES
    load_kv_tile = kv_tile_loader(spec, ops)
    stage_q = q_tile_stager(spec, ops)
    read_item = prefill_item_reader(spec.sparse, spec.page_size, False, sim)
    shared = shared_layout(spec)
    STAGE_BYTES, Q_BASE, NSTG = shared["stage"], shared["q_base"], spec.stages
    SMEM_DECL = 0 if shared["dynamic"] else shared["total"] // 4
    SMEM_ALIGN = 256 if prims.SMEM_ALIGN else None  # (the simulator's arrays take none)
    store = build_merge_list(G, D, NT, shared["total"] // 4, spec.variant, spec.q_dtype,
                             sim).store
    CAUSAL = bool(spec.variant.logits_mask)  # lean_eligible: the only mask is causal
    finalize = state_finalize(sim)
    exp2, shared_addr, commit = prims.exp2, prims.shared_addr, prims.commit
    wait_tile = prims.wait(NSTG - 2)  # at the top of tile i, tiles past i may still fly
    wait_all = prims.wait(0)
    U32 = types.uint32
    NEG_INF, POS_INF = float32(-np.inf), float32(np.inf)
    NAN, ZERO, ONE = float32(np.nan), float32(0.0), float32(1.0)
    PRE = float32(LOG2E)
    # spec.prefetch: a work item's fixed cost overlapped with the tiles around it. Q by
    # cp.async (each warpgroup its own 64 packed rows: D / 16 copies of 16 bytes per thread,
    # where the stager issued D / 4 dependent 16-bit loads); the next item's first KV tile
    # requested at the last tile's refill (the ring's free stage; the item after starts on
    # the other stage) and its Q after the last tile's P V; the output by one unrolled loop per
    # store path.
    PREFETCH = spec.prefetch
    # The next item's Q requested by the last tile too: ragged and single plans. Paged, the
    # request inside the tile loop put 6 more local-memory accesses on every tile's path
    # (ptxas; G 4 bf16: the page-table loader's registers), so there the item requests its Q
    # as it starts, by cp.async, its first KV tile still requested ahead.
    Q_AHEAD = PREFETCH and not spec.sparse
    # spec.lazy_rescale: the online softmax's rescale only when a row's maximum grows by more
    # than a factor 2^LAZY_LOG2 (FlashAttention-4's threshold): 64 FMUL of ~565 instructions
    # per tile, skipped on most tiles of a long row.
    LAZY, LAZY_LOG2 = spec.lazy_rescale, float32(8.0)
    # spec.qk_ahead: S = Q K^T issued right after the tile's barrier, the refill's copies
    # while it runs. Without it the refill's 16 cp.async per thread queue first, and the
    # chain's Q address (ptxas keeps it spilled under the cap) is reloaded behind them: that
    # reload and the add waiting on it were 17 % of the warps' samples (causal B4 L4096,
    # bench/NOTES.md, session 17, call 5).
    QK_AHEAD = spec.qk_ahead
    # spec.swizzle: K and V in the 128-byte swizzled layout, copied a whole line per eight
    # threads (the canonical layout's copies read 16-byte pieces of eight rows, which capped
    # K / V into the SMs at ~2.2 TB/s: session 30's standalone tile, 248 -> 437 TFLOP/s causal)
    SWIZZLE = spec.swizzle
    O_WORDS = PREFETCH and not sim  # pairs of outputs as one 32-bit store
    addr_low, store_u32, pack_o = tgt.addr_low, tgt.store_u32, tgt.pack  # (o: q's type)
    cp16 = prims.cp_async16_to
    slot = cuda.jit(device=True)(copy_slot)
    Q_STEP = 128 // (D // 8)  # packed rows one pass of a warpgroup's 16-byte copies covers
    Q_COPIES = 64 // Q_STEP
    # bytes between a thread's consecutive Q copies (Q_STEP rows on): whole 8-row core
    # matrices on the GPU, padded rows of 4-byte slots in the simulator
    Q_DST_STEP = Q_STEP * ops.RS if sim else Q_STEP // 8 * (D // 8 * 128)
    q_offset = ops.q_offset
    q_offset_of = q_row_offsetter(G, sim)
    let_dependents = dependent_launch(sim).trigger  # (defer_merge: always, on this kernel)

    @cuda.jit(device=True)
    def copy_q(smem, qbase, q, q0, qs, nrows, hk, q_stride_n, q_stride_h, tid):
        # The calling warpgroup's 64 packed rows of the item's Q tile, by cp.async (no commit):
        # eight consecutive threads one 16-byte chunk of eight rows (copy_slot: a core
        # matrix). Rows past nrows copy the last row: computed, never stored.
        r0, ch, _, _, _ = slot(tid % 128, 128, D, False, 0, 128, 2)
        p0 = U32(64 * (tid // 128) + r0)
        dst = qbase + q_offset(p0, U32(8 * ch))
        for i in range(Q_COPIES):
            off = q_offset_of(U32(p0 + U32(i * Q_STEP)), U32(8 * ch), q0, qs, nrows, hk,
                              q_stride_n, q_stride_h)
            cp16(smem, dst + U32(i * Q_DST_STEP), q, off)

    @cuda.jit(device=True)
    def tile(smem, base, k, v, kv_indices, kv_indptr, b, ib, row_stride, head_off, page_stride,
             it, n_tiles, start, end, hk, tid, warp, s, acc, pw, scratch, masked, qp0, qp1, t2,
             ks, m0, m1, den0, den1, lo0, lo1, phase, nxt_item, q_async, q, plan, work_off,
             qo_indptr_off, qo_end_off, q_pos0_off, kv_last, kv_stride_n, kv_stride_h,
             q_stride_n, q_stride_h):
        # One KV tile: wait for it, refill the ring, S = Q K^T, the mask (masked tiles only),
        # the online softmax, O += P V. Returns the rows' running state. The item's tile 0
        # is in stage ``phase`` (always 0 without PREFETCH); ``nxt_item``: the CTA's next
        # work item (-1: none), whose first tile and Q the last tile requests (PREFETCH).
        wait_tile()
        publish()  # cp.async's stores, visible to the tensor cores (the async proxy)
        cuda.syncthreads()  # tile it is in for every thread; every warp is done with it - 1
        kb = base + ((phase + U32(it)) % U32(NSTG)) * U32(STAGE_BYTES)
        # (Q's address through an opaque move: hoisted out of the loop, its 8 descriptors
        # held 16 registers, 153 instead of 128 with the rest of the tile)
        if QK_AHEAD:  # (the refill below writes the other stage, which no chain reads now)
            qk_issue(smem, kb, opaque(base + U32(Q_BASE)), warp, tid % 32, s)
        nxt = it + NSTG - 1
        # (stages by unsigned arithmetic: a signed % costs sign fix-ups)
        nb = base + ((phase + U32(nxt)) % U32(NSTG)) * U32(STAGE_BYTES)
        if nxt < n_tiles:
            load_kv_tile(smem, nb, k, v, kv_indices, kv_indptr, b, ib, row_stride, head_off,
                         page_stride, start + nxt * BC, end, hk, tid)
        elif PREFETCH and nxt_item >= 0:
            # the next item's tile 0 into the stage this item no longer needs
            (nb_, nhk, nqs, nrows_, nstart, nend, nprow, nq0, nkv_len, nib, nrow_stride,
             nhead_off, npos0) = read_item(plan, nxt_item, work_off, qo_indptr_off,
                                           qo_end_off, q_pos0_off, kv_indptr, kv_last,
                                           kv_stride_n, kv_stride_h)
            if nend > nstart:
                load_kv_tile(smem, nb, k, v, kv_indices, kv_indptr, nb_, nib, nrow_stride,
                             nhead_off, page_stride, nstart, nend, nhk, tid)
            else:
                commit()
        else:
            commit()  # an empty group keeps group i meaning tile i
        if QK_AHEAD:
            qk_wait(s)
        else:
            qk_smem(smem, kb, opaque(base + U32(Q_BASE)), warp, tid % 32, s)
        tk = start + it * BC + t2  # the key of this lane's first column
        # s[4 j + 2 h + c]: row h (qp0 / qp1), key tk + 8 j + c
        if masked:
            for j in range(NS // 4):
                for c in range(2):
                    key = tk + 8 * j + c
                    x0 = s[4 * j + c]
                    x1 = s[4 * j + 2 + c]
                    live = key < end
                    if live and (not CAUSAL or key <= qp0):
                        lo0 = min(lo0, x0)
                    else:
                        s[4 * j + c] = NEG_INF
                    if live and (not CAUSAL or key <= qp1):
                        lo1 = min(lo1, x1)
                    else:
                        s[4 * j + 2 + c] = NEG_INF
            mx0 = NEG_INF
            mx1 = NEG_INF
            for j in range(NS // 4):
                for c in range(2):
                    mx0 = max(mx0, s[4 * j + c])
                    mx1 = max(mx1, s[4 * j + 2 + c])
        else:
            mx0 = NEG_INF
            mx1 = NEG_INF
            for j in range(NS // 4):
                for c in range(2):
                    x0 = s[4 * j + c]
                    x1 = s[4 * j + 2 + c]
                    mx0 = max(mx0, x0)
                    mx1 = max(mx1, x1)
                    lo0 = min(lo0, x0)
                    lo1 = min(lo1, x1)
        mx0, mx1 = quad_reduce(mx0, mx1, True, tid, scratch)  # the row's 64 keys, 4 lanes
        t0 = mx0 * ks  # log2 units; ks >= 0 (a negative scale negated Q instead)
        t1 = mx1 * ks
        if LAZY:
            # A row's reference maximum moves only when the tile's exceeds it by more than
            # LAZY_LOG2 (any row of the warp: the branch stays warp-uniform), so most tiles
            # skip the 64 rescales; P is then at most 2^LAZY_LOG2, and O / den and the LSE are
            # exact whatever reference they share.
            grow = t0 > m0 + LAZY_LOG2 or t1 > m1 + LAZY_LOG2
            if warp_any(grow, tid, scratch):
                mn0 = max(m0, t0)
                mn1 = max(m1, t1)
                a0 = exp2(m0 - (mn0 if mn0 > NEG_INF else ZERO))
                a1 = exp2(m1 - (mn1 if mn1 > NEG_INF else ZERO))
                m0 = mn0
                m1 = mn1
                den0 *= a0
                den1 *= a1
                for j in range(NO // 4):
                    for c in range(2):
                        acc[4 * j + c] *= a0
                        acc[4 * j + 2 + c] *= a1
            mr0 = m0 if m0 > NEG_INF else ZERO  # a row with no kept key yet: exp2(-inf) = 0
            mr1 = m1 if m1 > NEG_INF else ZERO
            a0 = ONE
            a1 = ONE
        else:
            mn0 = max(m0, t0)
            mn1 = max(m1, t1)
            mr0 = mn0 if mn0 > NEG_INF else ZERO  # a row with no kept key yet: exp2(-inf) = 0
            mr1 = mn1 if mn1 > NEG_INF else ZERO
            a0 = exp2(m0 - mr0)
            a1 = exp2(m1 - mr1)
            m0 = mn0
            m1 = mn1
        r0 = ZERO
        r1 = ZERO
        for j in range(NS // 4):  # one FFMA and one exp2 per score
            for c in range(2):
                p0 = exp2(s[4 * j + c] * ks - mr0)
                p1 = exp2(s[4 * j + 2 + c] * ks - mr1)
                s[4 * j + c] = p0
                s[4 * j + 2 + c] = p1
                r0 += p0
                r1 += p1
        den0 = den0 * a0 + r0
        den1 = den1 * a1 + r1
        if not LAZY:
            for j in range(NO // 4):
                for c in range(2):
                    acc[4 * j + c] *= a0
                    acc[4 * j + 2 + c] *= a1
        p_times_v(smem, kb + U32(TILE_BYTES), tid, tid % 32, s, pw, acc, scratch)
        if PREFETCH and Q_AHEAD and q_async and nxt >= n_tiles and nxt_item >= 0:
            # The next item's Q, once every warp has read this item's: its Q K^T is done
            # (each warp waited for its P V since). A barrier per item: one per warpgroup
            # (bar.sync 1 + wg, 128) took a register for the id, ptxas then reserved all 16
            # barriers, and with immediate ids serialised the wgmma chains (registers).
            cuda.syncthreads()
            (nb_, nhk, nqs, nrows_, nstart, nend, nprow, nq0, nkv_len, nib, nrow_stride,
             nhead_off, npos0) = read_item(plan, nxt_item, work_off, qo_indptr_off,
                                           qo_end_off, q_pos0_off, kv_indptr, kv_last,
                                           kv_stride_n, kv_stride_h)
            copy_q(smem, base + U32(Q_BASE), q, nq0, nqs, nrows_, nhk, q_stride_n, q_stride_h,
                   tid)
            commit()
        return m0, m1, den0, den1, lo0, lo1

    def prefill_wgmma_kernel(q, k, v, kv_indptr, kv_indices, kv_last, plan, o, lse, tmp_o,
                             tmp_lse, counters, hkv, page_stride, kv_stride_n, kv_stride_h,
                             q_stride_n, q_stride_h, sm_scale, v_scale, work_off,
                             cta_indptr_off, cta_work_off, merge_rows_off, merge_indptr_off,
                             merge_indices_off, item_merge_off, qo_indptr_off, mask_indptr_off,
                             mask_words_off, q_pos0_off, qo_end_off, value_flags_off):
        # [stage 0 K|V, stage 1 K|V, Q]: 96 KiB at D 128, allocated at launch
        smem = cuda.shared.array(SMEM_DECL, float32, alignment=SMEM_ALIGN)
        let_dependents()  # the merge launch after this one may start as this kernel's CTAs end
        s = cuda.local.array(NS, float32)
        acc = cuda.local.array(NO, float32)
        pw = cuda.local.array(A_WORDS, U32)
        scratch = cuda.shared.array(SCRATCH, float32)
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        t2 = 2 * (lane % 4)
        base = shared_addr(smem, 0)
        if SWIZZLE:  # the stages on a 1024-byte boundary (shared_layout's extra KiB)
            base = (base + U32(1023)) & U32(0xFFFFFC00)
        hq = hkv * G
        # Scores come out unscaled: sm_scale and log2 e go into exp2's FFMA, and the row
        # maximum of raw scores, scaled, is the scaled maximum, for a scale >= 0. A negative
        # scale negates Q as it is staged instead (exact), so that the loop has one form: a
        # branch scaling each score first cost 22 registers across the loop (ptxas).
        ks = sm_scale * PRE
        sign = ONE
        if ks < ZERO:
            ks = -ks
            sign = -ONE
        # Q by cp.async (PREFETCH): 16-byte copies need q's base and strides 16-byte aligned,
        # and a positive scale (the copy cannot negate); else the stager.
        q_async = PREFETCH and (sign > ZERO and addr_low(q) % U32(16) == U32(0)
                                and q_stride_n % 8 == 0 and q_stride_h % 8 == 0)
        o_words = O_WORDS and addr_low(o) % U32(4) == U32(0)
        c = cuda.blockIdx.x
        w_hi = plan[cta_indptr_off + c + 1]
        phase = U32(0)  # the ring stage of the item's tile 0
        ready = False  # the item's tile 0 (and Q, q_async) requested by the one before
        for wi in range(plan[cta_indptr_off + c], w_hi):
            item = plan[cta_work_off + wi]
            nxt_item = plan[cta_work_off + wi + 1] if PREFETCH and wi + 1 < w_hi else -1
            (b, hk, qs, nrows, start, end, prow, q0, kv_len, ib, row_stride, head_off,
             pos0) = read_item(plan, item, work_off, qo_indptr_off, qo_end_off, q_pos0_off,
                               kv_indptr, kv_last, kv_stride_n, kv_stride_h)
            n_tiles = (end - start + BC - 1) // BC if end > start else 0
            # (Q_AHEAD: this item's Q was requested by the previous item's last tile)
            if not ready or not (q_async and Q_AHEAD):
                cuda.syncthreads()  # the previous item is done with shared memory
            if not ready:
                # Copies of Q may still fly into these bytes: the previous item had no tile to
                # wait for the Q its predecessor requested for it (PTX orders no two cp.async
                # to one address unless a wait separates them). At most once per item.
                if PREFETCH:
                    wait_all()
                if q_async:
                    copy_q(smem, base + U32(Q_BASE), q, q0, qs, nrows, hk, q_stride_n,
                           q_stride_h, tid)
                for pt in range(NSTG - 1):  # group i is tile i (empty past the last)
                    if pt < n_tiles:
                        load_kv_tile(smem, base + ((phase + U32(pt)) % U32(NSTG))
                                     * U32(STAGE_BYTES), k, v, kv_indices, kv_indptr, b, ib,
                                     row_stride, head_off, page_stride, start + pt * BC, end,
                                     hk, tid)
                    else:
                        commit()
            elif q_async and not Q_AHEAD:  # tile 0 requested ahead, Q now (its own group)
                copy_q(smem, base + U32(Q_BASE), q, q0, qs, nrows, hk, q_stride_n, q_stride_h,
                       tid)
                commit()
            if not q_async:
                stage_q(smem, base + U32(Q_BASE), q, q0, qs, nrows, hk, pos0, q_stride_n,
                        q_stride_h, tid, sign)
            # (published and waited for at the first tile's barrier)
            pr0 = 16 * warp + lane // 4  # this lane's packed rows: pr0 and pr0 + 8
            pr1 = pr0 + 8
            qp0 = pos0 + pr0 // G  # their query positions (bottom-right aligned)
            qp1 = pos0 + pr1 // G
            # Tiles wholly before the CTA's first row and inside the range need no mask.
            full = (end - start) // BC
            n_clear = full
            if CAUSAL:
                n_clear = min(full, (pos0 + 1 - start) // BC) if pos0 + 1 > start else 0
            m0 = NEG_INF
            m1 = NEG_INF
            den0 = ZERO
            den1 = ZERO
            lo0 = POS_INF
            lo1 = POS_INF
            for i in range(NO):
                acc[i] = ZERO
            for it in range(n_clear):
                m0, m1, den0, den1, lo0, lo1 = tile(
                    smem, base, k, v, kv_indices, kv_indptr, b, ib, row_stride, head_off,
                    page_stride, it, n_tiles, start, end, hk, tid, warp, s, acc, pw, scratch,
                    False, qp0, qp1, t2, ks, m0, m1, den0, den1, lo0, lo1, phase, nxt_item,
                    q_async, q, plan, work_off, qo_indptr_off, qo_end_off, q_pos0_off, kv_last,
                    kv_stride_n, kv_stride_h, q_stride_n, q_stride_h)
            # The tiles crossing the diagonal or the range's end, masked. Both warpgroups run
            # each (wgmma is warpgroup-wide, and a warpgroup-uniform skip cost the standalone
            # 32 registers); a warpgroup's rows before the tile keep none of its keys.
            for it in range(n_clear, n_tiles):
                m0, m1, den0, den1, lo0, lo1 = tile(
                    smem, base, k, v, kv_indices, kv_indptr, b, ib, row_stride, head_off,
                    page_stride, it, n_tiles, start, end, hk, tid, warp, s, acc, pw, scratch,
                    True, qp0, qp1, t2, ks, m0, m1, den0, den1, lo0, lo1, phase, nxt_item,
                    q_async, q, plan, work_off, qo_indptr_off, qo_end_off, q_pos0_off, kv_last,
                    kv_stride_n, kv_stride_h, q_stride_n, q_stride_h)
            if PREFETCH:  # the next item starts on the stage after this one's last tile
                phase = (phase + U32(n_tiles)) % U32(NSTG)
                ready = n_tiles > 0

            # The epilogue: a row's sum over its four lanes, O normalised, the non-finite rule.
            den0, den1 = quad_reduce(den0, den1, False, tid, scratch)
            inv0, lse0 = finalize(m0, den0)
            inv1, lse1 = finalize(m1, den1)
            inv0 *= v_scale
            inv1 *= v_scale
            lse0 *= F_LN2
            lse1 *= F_LN2
            # A -inf score among a row's kept keys, or a non-finite output: the row is NaN.
            f0 = ONE if lo0 == NEG_INF else ZERO
            f1 = ONE if lo1 == NEG_INF else ZERO
            for j in range(NO // 4):
                for cc in range(2):
                    x0 = acc[4 * j + cc] * inv0
                    x1 = acc[4 * j + 2 + cc] * inv1
                    acc[4 * j + cc] = x0
                    acc[4 * j + 2 + cc] = x1
                    if not abs(x0) < F_INF:
                        f0 = ONE
                    if not abs(x1) < F_INF:
                        f1 = ONE
            f0, f1 = quad_reduce(f0, f1, True, tid, scratch)
            if f0 > ZERO:
                lse0 = NAN
            if f1 > ZERO:
                lse1 = NAN
            split = prow >= 0
            ok0 = pr0 // G < nrows
            ok1 = pr1 // G < nrows
            row0 = (prow if split else q0 + qs) + pr0 // G
            row1 = (prow if split else q0 + qs) + pr1 // G
            head0 = hk * G + pr0 % G
            head1 = hk * G + pr1 % G
            ob0 = (row0 * hq + head0) * D + t2
            ob1 = (row1 * hq + head1) * D + t2
            # accumulators 4 j + (0, 1): row pr0's dims 8 j + t2 + (0, 1); + (2, 3) row pr1's
            if PREFETCH:
                # NaN rows first, then one store loop per path, each small enough to unroll
                # (one loop holding the three paths was not: its indices put acc in local
                # memory, bench/NOTES.md, session 17, call 6)
                for j in range(NO // 4):
                    for cc in range(2):
                        if f0 > ZERO:
                            acc[4 * j + cc] = NAN
                        if f1 > ZERO:
                            acc[4 * j + 2 + cc] = NAN
                if split:  # partial rows: the merge launch combines them
                    for j in range(NO // 4):
                        if ok0:
                            tmp_o[ob0 + 8 * j] = acc[4 * j]
                            tmp_o[ob0 + 8 * j + 1] = acc[4 * j + 1]
                        if ok1:
                            tmp_o[ob1 + 8 * j] = acc[4 * j + 2]
                            tmp_o[ob1 + 8 * j + 1] = acc[4 * j + 3]
                elif O_WORDS and o_words:  # each pair as one 32-bit store (ob0, ob1 even)
                    for j in range(NO // 4):
                        if ok0:
                            store_u32(o, ob0 + 8 * j, pack_o(acc[4 * j], acc[4 * j + 1]))
                        if ok1:
                            store_u32(o, ob1 + 8 * j, pack_o(acc[4 * j + 2], acc[4 * j + 3]))
                else:
                    for j in range(NO // 4):
                        if ok0:
                            store(o, ob0 + 8 * j, acc[4 * j])
                            store(o, ob0 + 8 * j + 1, acc[4 * j + 1])
                        if ok1:
                            store(o, ob1 + 8 * j, acc[4 * j + 2])
                            store(o, ob1 + 8 * j + 1, acc[4 * j + 3])
            else:
                for j in range(NO // 4):
                    for h in range(2):
                        if ok1 if h else ok0:
                            i = (ob1 if h else ob0) + 8 * j
                            bad = (f1 if h else f0) > ZERO
                            x0 = NAN if bad else acc[4 * j + 2 * h]
                            x1 = NAN if bad else acc[4 * j + 2 * h + 1]
                            if split:  # a partial row: the merge launch combines them
                                tmp_o[i] = x0
                                tmp_o[i + 1] = x1
                            else:
                                store(o, i, x0)
                                store(o, i + 1, x1)
            if t2 == 0:
                dst = tmp_lse if split else lse
                if ok0:
                    dst[row0 * hq + head0] = lse0
                if ok1:
                    dst[row1 * hq + head1] = lse1

        if PREFETCH:
            wait_all()  # no copy into shared memory outlives the CTA (an item without tiles)

    return prefill_wgmma_kernel


__all__ = ["LEAN_KV_TILE", "LEAN_MAX_REGISTERS", "LEAN_STAGES", "LEAN_WARPS", "lean_eligible",
           "prefill_wgmma_kernel_source"]
