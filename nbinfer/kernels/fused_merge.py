"""The contraction of split rows inside an attention kernel (the "fused merge").

A kernel that cuts a row's KV into chunks writes one partial state per chunk; the CTA that
finishes a row's last chunk (it learns so from an atomic counter) merges the row's partials in
the reduction map's order and writes the output. The result does not depend on which CTA was
last, so it is bitwise reproducible, and the step needs no second launch.

Per block of NB partial rows, the weights ``exp2(lse - m)`` of the row's G heads are computed
once into shared memory, then every output element sums NB independent L2 loads; a running
``(m, den)`` per head rescales across blocks, so any number of chunks fits.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, int32, types

from ..variants import Variant
from .common import F_LN2, state_finalize
from .hooks import device_hooks
from .primitives import LOG2E, device_jit, primitives


@functools.cache
def build_merge_list(G: int, D: int, NT: int, smem_floats: int, variant: Variant, out_dtype: str,
                     sim: bool):
    """Device functions of the fused merge, as a namespace: ``merge_list(plan, tmp_o, tmp_lse,
    o, lse, ml, hk, hq, tid, rows_off, indptr_off, indices_off, msmem, num)``,
    ``finish_split_item(...)`` (count a finished chunk; the last CTA merges), ``finish_split_tile``
    (the same for a prefill tile: every row counted, all rows completed here merged at once,
    in parallel over (row, head, dim), partial rows staged through shared memory by cp.async),
    ``store(o, i, x)`` (float32 -> ``out_dtype``) and ``OUTS``, the size of the per-thread
    ``num`` array the callers pass.

    Merges list ``ml`` of the reduction map stored in ``plan`` (word offsets ``rows_off`` etc.)
    for the G query heads of kv head ``hk``: partial states ``tmp_o [P*hq*D]``, ``tmp_lse [P*hq]``
    (natural log) -> ``o`` (``out_dtype``, row ``plan[rows_off + ml]``) and ``lse``. Every thread
    of the block calls it (it synchronises); ``msmem`` is ``smem_floats`` of free shared memory.
    """
    prims = primitives(sim)
    hooks = device_hooks(variant, sim)
    GP = 1 << (G - 1).bit_length()
    MERGE_SMEM = smem_floats
    SOFTMAX, HAS_OUT, hook_output = hooks.use_softmax, hooks.has_output, hooks.output
    exp2, load_cg, to_bf16 = prims.exp2, prims.load_cg, prims.from_f32_bf16
    finalize = state_finalize(sim)
    shared_addr, cp_async16_to = prims.shared_addr, prims.cp_async16_to
    commit, wait0 = prims.commit, prims.wait(0)
    U32 = types.uint32
    OUT_BF16 = out_dtype == "bfloat16"
    NEG_INF = float32(-np.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    F_LOG2E = float32(LOG2E)
    jit_dev = device_jit(sim)

    @jit_dev
    def store(o, i, x):
        if OUT_BF16:
            o[i] = to_bf16(x)
        else:
            o[i] = x

    # Block layout in msmem: [G*NB weights | NB partial rows | G m | G den | G scale].
    NB = (MERGE_SMEM - 3 * GP) // (G + 1)
    OUTS = -(-G * D // NT)  # output elements per thread (merge_list)
    IN_FLIGHT = max(1, min(4, 16 // OUTS))  # partial rows merge_list loads at once
    XS = IN_FLIGHT * OUTS
    # Tile merge (prefill): a quarter of msmem for the weights and partial-row indices of a
    # round of rows, the rest a 16-byte aligned stage for cp.async copies of partial rows.
    if D % 4:
        raise ValueError(f"the fused merge needs head_dim % 4 == 0, got {D}")
    DV = D // 4  # 16-byte copies per partial row slice (D float32)
    if NT % DV:
        raise ValueError(f"the fused merge needs a multiple of {DV} threads, got {NT}")
    TEAMS = NT // DV  # slices copied at once
    W_CAP = MERGE_SMEM // 4
    STAGE_OFF = -(-W_CAP // 4) * 4
    STAGE_CAP = MERGE_SMEM - STAGE_OFF
    W_ROWS = G * NB
    W_M = W_ROWS + NB
    W_DEN = W_M + G
    W_SCALE = W_DEN + G

    @jit_dev
    def merge_list(plan, tmp_o, tmp_lse, o, lse, ml, hk, hq, tid, merge_rows_off,
                   merge_indptr_off, merge_indices_off, msmem, num):
        # The merge operator over list ml's partial rows, in the map's order (so the result does
        # not depend on which CTA finished last), for the G heads of kv head hk. Partial states
        # written by other CTAs are read through L2 (ld.global.cg), never a stale L1 line.
        row = plan[merge_rows_off + ml]
        lo = plan[merge_indptr_off + ml]
        hi = plan[merge_indptr_off + ml + 1]
        xs = cuda.local.array(XS, float32)  # constant indices: registers
        for i in range(OUTS):
            num[i] = ZERO
        if tid < G:
            msmem[W_M + tid] = NEG_INF
            msmem[W_DEN + tid] = ZERO
        for blk in range(lo, hi, NB):
            nb = min(NB, hi - blk)
            for j in range(tid, nb, NT):
                msmem[W_ROWS + j] = float32(plan[merge_indices_off + blk + j])
            cuda.syncthreads()
            for idx in range(tid, G * nb, NT):
                h = idx // nb
                pr = int32(msmem[W_ROWS + idx % nb])
                x = load_cg(tmp_lse, pr * hq + hk * G + h)
                msmem[idx] = x * F_LOG2E if SOFTMAX else ONE
            cuda.syncthreads()
            if tid < G and SOFTMAX:
                mold = msmem[W_M + tid]
                mt = mold
                for j in range(nb):
                    mt = max(mt, msmem[tid * nb + j])
                mref = mt if mt > NEG_INF else ZERO
                msmem[W_SCALE + tid] = exp2(mold - mref)
                msmem[W_M + tid] = mt
            cuda.syncthreads()
            if SOFTMAX:
                for idx in range(tid, G * nb, NT):
                    mt = msmem[W_M + idx // nb]
                    msmem[idx] = exp2(msmem[idx] - (mt if mt > NEG_INF else ZERO))
                cuda.syncthreads()
                if tid < G:
                    den = msmem[W_DEN + tid] * msmem[W_SCALE + tid]
                    for j in range(nb):
                        den += msmem[tid * nb + j]
                    msmem[W_DEN + tid] = den
            if SOFTMAX:
                for i in range(OUTS):
                    idx = tid + i * NT
                    if idx < G * D:
                        num[i] *= msmem[W_SCALE + idx // D]
            # The partial rows' elements are read IN_FLIGHT rows at a time, every load issued
            # before the first is used, then added in the map's order (the same sum as one row
            # at a time, bitwise): one row per step waited an L2 round trip per partial and
            # output element, 12 x 4 in a row for a cascade's lists (the merge launch took 20
            # us of the cascade's 100 on the H200, at 7 % of its memory throughput).
            for j0 in range(0, nb, IN_FLIGHT):
                for u in range(IN_FLIGHT):
                    if j0 + u < nb:
                        pbase = int32(msmem[W_ROWS + j0 + u]) * hq * D + hk * G * D
                        for i in range(OUTS):
                            idx = tid + i * NT
                            if idx < G * D:
                                xs[u * OUTS + i] = load_cg(tmp_o, pbase + idx)
                for u in range(IN_FLIGHT):
                    if j0 + u < nb:
                        for i in range(OUTS):
                            idx = tid + i * NT
                            if idx < G * D:
                                num[i] += msmem[(idx // D) * nb + j0 + u] * xs[u * OUTS + i]
            cuda.syncthreads()
        for i in range(OUTS):
            idx = tid + i * NT
            if idx < G * D:
                h = idx // D
                d = idx % D
                qo_head = hk * G + h
                if SOFTMAX:
                    inv, lse2 = finalize(msmem[W_M + h], msmem[W_DEN + h])
                    out = num[i] * inv
                    lse_val = lse2 * F_LN2
                else:
                    out = num[i]
                    lse_val = ZERO
                if HAS_OUT:
                    out = float32(hook_output(out, lse_val, qo_head))
                store(o, (row * hq + qo_head) * D + d, out)
                if d == 0:
                    lse[row * hq + qo_head] = lse_val

    @jit_dev
    def finish_split_item(plan, counters, last_flag, tmp_o, tmp_lse, o, lse, item, hk, hkv, hq,
                          nrows, tid, item_merge_off, merge_rows_off, merge_indptr_off,
                          merge_indices_off, msmem, num):
        # Publish this chunk's partial state, then count it; the CTA that counts the last chunk
        # of (merge list, kv head) merges the lists of the item's nrows rows (consecutive lists,
        # since a tile's rows are consecutive output rows) and resets the counter.
        cuda.threadfence()
        cuda.syncthreads()
        if tid == 0:
            ml = plan[item_merge_off + item]
            n = plan[merge_indptr_off + ml + 1] - plan[merge_indptr_off + ml]
            done = cuda.atomic.add(counters, ml * hkv + hk, 1)
            last_flag[0] = ml if done == n - 1 else -1
        cuda.syncthreads()
        ml = last_flag[0]
        if ml >= 0:
            cuda.threadfence()
            for rr in range(nrows):
                merge_list(plan, tmp_o, tmp_lse, o, lse, ml + rr, hk, hq, tid, merge_rows_off,
                           merge_indptr_off, merge_indices_off, msmem, num)
                cuda.syncthreads()
            if tid == 0:
                counters[ml * hkv + hk] = 0  # ready for the next launch

    @jit_dev
    def finish_split_tile(plan, counters, flags, tmp_o, tmp_lse, o, lse, item, hk, hkv, hq,
                          nrows, tid, item_merge_off, merge_rows_off, merge_indptr_off,
                          merge_indices_off, msmem, num):
        # A prefill item's nrows partial rows belong to lists ml0 .. ml0 + nrows - 1 (its rows
        # are consecutive output rows). Each row is counted on its own: items of different
        # shapes may feed one row (a cascade's shared-prefix tile and a request's own KV), so
        # the CTA that completes a row's list is the one that merges it, whichever item it ran.
        # flags: shared int32 [2 nrows + 3]: per-row "completed here", compacted in place into
        # the rows merged as a tile; then their count, their longest list, the count of rows too
        # long for a tile round, and those rows. A row's path depends on its own list length
        # only, never on which rows finish with it: the result is bitwise reproducible.
        cuda.threadfence()
        cuda.syncthreads()
        ml0 = plan[item_merge_off + item]
        if tid < nrows:
            ml = ml0 + tid
            n = plan[merge_indptr_off + ml + 1] - plan[merge_indptr_off + ml]
            done = cuda.atomic.add(counters, ml * hkv + hk, 1)
            flags[tid] = 1 if done == n - 1 else 0
        cuda.syncthreads()
        if tid == 0:
            ns = 0
            nl = 0
            maxn = 0
            for rr in range(nrows):
                if flags[rr]:
                    ml = ml0 + rr
                    n = plan[merge_indptr_off + ml + 1] - plan[merge_indptr_off + ml]
                    if n * (G + 1) > W_CAP or n * D > STAGE_CAP:  # one row at a time
                        flags[nrows + 3 + nl] = rr
                        nl += 1
                    else:
                        flags[ns] = rr  # compact in place: ns <= rr
                        maxn = max(maxn, n)
                        ns += 1
                    counters[ml * hkv + hk] = 0  # ready for the next launch
            flags[nrows] = ns
            flags[nrows + 1] = maxn
            flags[nrows + 2] = nl
        cuda.syncthreads()
        nf = flags[nrows]
        maxn = flags[nrows + 1]
        nl = flags[nrows + 2]
        if nf + nl == 0:
            return
        cuda.threadfence()
        for k in range(nl):
            merge_list(plan, tmp_o, tmp_lse, o, lse, ml0 + flags[nrows + 3 + k], hk, hq, tid,
                       merge_rows_off, merge_indptr_off, merge_indices_off, msmem, num)
            cuda.syncthreads()
        if nf == 0:
            return
        # msmem per round: [weights: rb x G x maxn | partial rows: rb x maxn (as float32)
        # | ... | stage from STAGE_OFF].
        rb = W_CAP // (maxn * (G + 1))  # rows per round
        stage = shared_addr(msmem, STAGE_OFF)
        d4 = (tid % DV) * 4  # this thread's 16-byte chunk of every slice it copies
        for r0 in range(0, nf, rb):
            nr = min(rb, nf - r0)
            pbase = nr * G * maxn
            for idx in range(tid, nr * maxn, NT):  # the rows' partial-row indices, once
                k = idx // maxn
                j = idx % maxn
                ml = ml0 + flags[r0 + k]
                lo = plan[merge_indptr_off + ml]
                n = plan[merge_indptr_off + ml + 1] - lo
                # Past the row's list: its own first partial (written, finite) at weight 0; never
                # another row's partial, which may not be written yet (uninitialised memory).
                msmem[pbase + idx] = float32(plan[merge_indices_off + lo + (j if j < n else 0)])
            cuda.syncthreads()
            # Phase 1a: every (row, head, partial) LSE into the weight slots (log2 domain), a
            # few per thread: one L2 round trip each instead of maxn per (row, head) thread.
            for idx in range(tid, nr * G * maxn, NT):
                kh = idx // maxn  # the one division by a runtime value per element
                pr = int32(msmem[pbase + (kh // G) * maxn + idx - kh * maxn])
                msmem[idx] = load_cg(tmp_lse, pr * hq + hk * G + kh % G) * F_LOG2E if SOFTMAX \
                    else ZERO
            cuda.syncthreads()
            # Phase 1b, one thread per (row, head): normalised weights exp2(lse_j - m) / den of
            # the row's partials (map order; 0 past the row's own list), and the merged LSE;
            # the unit's output row x head goes to flags[nrows + 3 + idx] (free by now).
            for idx in range(tid, nr * G, NT):
                ml = ml0 + flags[r0 + idx // G]
                n = plan[merge_indptr_off + ml + 1] - plan[merge_indptr_off + ml]
                wb = idx * maxn
                mt = NEG_INF
                for j in range(n):
                    mt = max(mt, msmem[wb + j])
                mref = mt if mt > NEG_INF else ZERO
                den = ZERO
                for j in range(n):
                    e = exp2(msmem[wb + j] - mref) if SOFTMAX else ONE
                    msmem[wb + j] = e
                    den += e
                if SOFTMAX:
                    inv, lse2 = finalize(mt, den)
                    lse_val = lse2 * F_LN2
                else:
                    inv = ONE
                    lse_val = ZERO
                for j in range(maxn):
                    msmem[wb + j] = msmem[wb + j] * inv if j < n else ZERO
                rowhead = plan[merge_rows_off + ml] * hq + hk * G + idx % G  # < 2**31: int32
                lse[rowhead] = lse_val
                flags[nrows + 3 + idx] = rowhead
            cuda.syncthreads()
            # Phase 2, per batch of U (row, head) units: cp.async (16 B, through L2) every
            # partial's D floats of the units into the stage, then one thread per output element
            # sums weight x stage in list order. The copies hold no registers, so a batch keeps
            # U x maxn x D x 4 bytes in flight (tensor-core kernel, D 128, 8 partials: a 25.5 KiB
            # stage, 6 units, 24 KiB), where loads into registers kept 4 KiB: the merge of a
            # 64-row tile (8 x 64 x 128 x 4 = 256 KiB through one SM) takes ~11 round trips
            # instead of ~64. tmp_o rows are 16-byte aligned: D % 4 == 0, and the workspace
            # start is checked on the host (DecodeLaunch).
            # Thread tid copies chunk tid % DV of slices tid // DV, + TEAMS, ...: (unit, j) of a
            # slice advance by TEAMS without a division (a 64-bit division by the runtime maxn
            # costs ~100 instructions; three per copy took longer than the copies).
            U = STAGE_CAP // (maxn * D)
            nunits = nr * G
            for u0 in range(0, nunits, U):
                nu = min(U, nunits - u0)
                ku = 0
                j = tid // DV
                while j >= maxn:
                    j -= maxn
                    ku += 1
                for s in range(tid // DV, nu * maxn, TEAMS):
                    kh = u0 + ku
                    pr = int32(msmem[pbase + (kh // G) * maxn + j])
                    cp_async16_to(msmem, stage + U32((s * D + d4) * 4), tmp_o,
                                  pr * hq * D + (hk * G + kh % G) * D + d4)
                    j += TEAMS
                    while j >= maxn:
                        j -= maxn
                        ku += 1
                commit()
                wait0()
                cuda.syncthreads()
                for e in range(tid, nu * D, NT):
                    kh = u0 + e // D
                    wb = kh * maxn
                    sb = STAGE_OFF + (e // D) * maxn * D + e % D
                    acc = ZERO
                    for jj in range(maxn):
                        acc += msmem[wb + jj] * msmem[sb + jj * D]
                    rowhead = flags[nrows + 3 + kh]
                    if HAS_OUT:
                        acc = float32(hook_output(acc, lse[rowhead], hk * G + kh % G))
                    store(o, rowhead * D + e % D, acc)
                cuda.syncthreads()

    return SimpleNamespace(merge_list=merge_list, finish_split_item=finish_split_item,
                           finish_split_tile=finish_split_tile, store=store, OUTS=OUTS)


__all__ = ["build_merge_list"]
