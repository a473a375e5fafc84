"""The loops of :mod:`.compiled`, at module level so that Numba's on-disk cache keeps them
(``cache=True``: compiled once per machine, loaded in milliseconds by later processes).

Imported only by :func:`nbinfer.scheduler.compiled._kernels`, the first time a wrapper plans:
``import nbinfer`` never imports numba.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_OK, _FALLBACK = 0, 1
jit = njit(cache=True, nogil=True)


@jit
def blob_size(num_work, num_ctas, merge_rows, num_partials):
    # schedule()'s buffer: work [W, 7], cta_indptr [C + 1], cta_work [W], merge_rows [M],
    # merge_indptr [M + 1], merge_indices [P], item_merge [W], in that order
    return num_work * 9 + num_ctas + 1 + merge_rows * 2 + 1 + num_partials


@jit
def sched_views(blob, num_work, num_ctas, merge_rows, num_partials):
    # the seven arrays of schedule()'s result, as views of its buffer (compiled.sched_views is
    # the same carving in Python)
    a = num_work * 7
    b = a + num_ctas + 1
    c = b + num_work
    d = c + merge_rows
    e = d + merge_rows + 1
    f = e + num_partials
    return (blob[:a].reshape((num_work, 7)), blob[a:b], blob[b:c], blob[c:d], blob[d:e],
            blob[e:f], blob[f:f + num_work])


@jit
def table_views(snap, batch):
    # check_table()'s snapshot as (indptr [B + 1], indices [nnz], last_page_len [B]) views
    # (compiled._table_of is the same carving in Python)
    return snap[:batch + 1], snap[batch + 1:snap.size - batch], snap[snap.size - batch:]


@jit
def schedule(qo_indptr, kv, hkv, group, num_ctas, granule, wq, wkv, fixed, causal, tile_q,
             overhead):
    batch = qo_indptr.size - 1
    num_rows = qo_indptr[batch]
    # 1. query tiles
    if tile_q == 0:
        mean = num_rows / batch * group if batch else 0.0
        tile_q = 128 if mean > 64 else (64 if mean > 16 else 16)
    max_qo = 1
    if batch:
        max_qo = 0
        for b in range(batch):
            max_qo = max(max_qo, qo_indptr[b + 1] - qo_indptr[b])
    tile_rows = max(1, min(tile_q // group, max_qo))
    ntiles = 0
    for b in range(batch):
        ntiles += (qo_indptr[b + 1] - qo_indptr[b] + tile_rows - 1) // tile_rows
    t_req = np.empty(ntiles, np.int64)
    t_qs = np.empty(ntiles, np.int64)
    t_rows = np.empty(ntiles, np.int64)
    t_eff = np.empty(ntiles, np.int64)
    t = 0
    eff_sum = 0
    for b in range(batch):
        qo_len = qo_indptr[b + 1] - qo_indptr[b]
        for i in range((qo_len + tile_rows - 1) // tile_rows):
            qs = i * tile_rows
            qe = min(qs + tile_rows, qo_len)
            eff = kv[b]
            if causal:
                eff = min(max(kv[b] - qo_len + qe, 0), kv[b])
            t_req[t] = b
            t_qs[t] = qs
            t_rows[t] = qe - qs
            t_eff[t] = eff
            eff_sum += eff
            t += 1
    # 2. KV chunks, and 4a. partial rows
    if fixed > 0:
        kv_chunk = fixed
    else:
        kv_chunk = max(1, (hkv * eff_sum + num_ctas - 1) // num_ctas)
        kv_chunk = (kv_chunk + granule - 1) // granule * granule
    t_size = np.empty(ntiles, np.int64)
    t_nch = np.empty(ntiles, np.int64)
    t_base = np.empty(ntiles, np.int64)
    nchunks = 0
    num_partials = 0
    merge_rows_n = 0
    for t in range(ntiles):
        eff = t_eff[t]
        if fixed > 0:
            size = fixed
        else:
            n0 = max(1, (eff + kv_chunk - 1) // kv_chunk)
            size = max(granule, ((eff + n0 - 1) // n0 + granule - 1) // granule * granule)
        n = max(1, (eff + size - 1) // size)
        t_size[t], t_nch[t] = size, n
        if n > 1:
            t_base[t] = num_partials
            num_partials += t_rows[t] * n
            merge_rows_n += t_rows[t]
        else:
            t_base[t] = -1
        nchunks += n
    num_work = nchunks * hkv
    if max(num_work, num_partials, num_rows) > 2147483647:
        return (_FALLBACK, np.empty(0, np.int32), 0, 0, 0, tile_q, tile_rows, kv_chunk)
    # every array of the result is a view of one buffer: the caller boxes one array, not seven
    # (boxing costs ~1.5 us per array on a serving host, more than this whole loop at batch 1)
    blob = np.empty(blob_size(num_work, num_ctas, merge_rows_n, num_partials), np.int32)
    work, cta_indptr, cta_work, merge_rows, merge_indptr, merge_indices, item_merge = \
        sched_views(blob, num_work, num_ctas, merge_rows_n, num_partials)
    costs = np.empty(num_work, np.int64)
    w = 0
    for t in range(ntiles):
        for c in range(t_nch[t]):
            ks = c * t_size[t]
            ke = min(ks + t_size[t], t_eff[t])
            prow = t_base[t] + c * t_rows[t] if t_base[t] >= 0 else -1
            cost = wq * (t_rows[t] * group) + wkv * (ke - ks + overhead)
            for h in range(hkv):
                work[w, 0] = t_req[t]
                work[w, 1] = h
                work[w, 2] = t_qs[t]
                work[w, 3] = t_qs[t] + t_rows[t]
                work[w, 4] = ks
                work[w, 5] = ke
                work[w, 6] = prow
                costs[w] = cost
                w += 1
    # 3. LPT: largest first (stable), each to the least-loaded CTA (least (load, cta))
    # The hkv items of a chunk are adjacent and cost the same, so sorting the chunks (stably)
    # and expanding each to its heads gives the items' stable order at 1/hkv of the sort. The
    # stable sort is a sort of unique keys, (largest cost - cost) * nchunks + chunk: values sort
    # faster than an argsort, and need no stable one. The CTAs' keys below are
    # load << bits | cta (2**bits >= num_ctas) and reach cost * num_work * 2**bits: past 2**61
    # the NumPy planner takes the step (it never does for a real one), which also keeps the
    # sort's keys in range.
    bits = 0
    while (1 << bits) < num_ctas:
        bits += 1
    max_cost = 0
    for c in range(nchunks):
        max_cost = max(max_cost, costs[c * hkv])
    if max_cost * 1.0 * num_work * (1 << bits) >= 2.0**61:
        return (_FALLBACK, blob[:0], 0, 0, 0, tile_q, tile_rows, kv_chunk)
    keys = np.empty(nchunks, np.int64)
    for c in range(nchunks):
        keys[c] = (max_cost - costs[c * hkv]) * nchunks + c
    keys.sort()
    order = np.empty(num_work, np.int64)
    for k in range(nchunks):
        c = keys[k] % nchunks
        for h in range(hkv):
            order[k * hkv + h] = c * hkv + h
    owner = np.empty(num_work, np.int64)
    positive = 0
    for k in range(num_work):
        if costs[order[k]] > 0:
            positive += 1
    first = min(num_ctas, positive)
    for k in range(first):
        owner[k] = k
    if first < num_work:
        # A winner tree over the CTAs: leaf size + c holds CTA c's key load << bits | c (the
        # order of (load, cta), as the definition's heap of load * num_ctas + cta; keys are
        # unique, so any exact minimum gives the same owners), each inner node the least key
        # below it, the root the least-loaded CTA. An update rewrites one leaf-to-root path of
        # bits levels; the sibling read at each level does not wait on a comparison, where a
        # heap's sift-down waits on one per level (2048 items on 528 CTAs: 20 -> 10 us on a
        # 2-core VM, bench/NOTES.md, session 22).
        size = 1 << bits
        mask = size - 1
        tree = np.empty(2 * size, np.int64)
        for k in range(size):
            if k < first:
                tree[size + k] = (costs[order[k]] << bits) | k
            elif k < num_ctas:
                tree[size + k] = k  # an empty CTA (fewer positive items than CTAs)
            else:
                tree[size + k] = 9223372036854775807  # padding, never the least
        for i in range(size - 1, 0, -1):
            tree[i] = min(tree[2 * i], tree[2 * i + 1])
        for k in range(first, num_work):
            top = tree[1]
            c = top & mask
            owner[k] = c
            v = top + (costs[order[k]] << bits)
            i = size + c
            tree[i] = v
            while i > 1:
                v = min(v, tree[i ^ 1])
                i >>= 1
                tree[i] = v
    cta_indptr[:] = 0
    for k in range(num_work):
        cta_indptr[owner[k] + 1] += 1
    for c in range(num_ctas):
        cta_indptr[c + 1] += cta_indptr[c]
    fill = cta_indptr[:-1].copy()
    for k in range(num_work):
        cta_work[fill[owner[k]]] = order[k]
        fill[owner[k]] += 1
    # 4b. reduction map, and the merge list of every item's partial rows
    merge_indptr[0] = 0
    list_of = np.full(max(num_partials, 1), -1, np.int32)
    m = 0
    e = 0
    for t in range(ntiles):
        if t_base[t] < 0:
            continue
        r = t_rows[t]
        for j in range(r):
            merge_rows[m] = qo_indptr[t_req[t]] + t_qs[t] + j
            for c in range(t_nch[t]):
                p = t_base[t] + c * r + j
                merge_indices[e] = p
                list_of[p] = m
                e += 1
            merge_indptr[m + 1] = e
            m += 1
    for w in range(num_work):
        p = work[w, 6]
        item_merge[w] = list_of[p] if p >= 0 else -1
    return (_OK, blob, num_work, merge_rows_n, num_partials, tile_q, tile_rows, kv_chunk)


@jit
def copy_into(dst, src):
    # dst[:src.size] = src as a loop over a view from index 0: LLVM vectorises it (a slice
    # assignment, or an index with an offset added, gets a wraparound check per element and a
    # temporary copy: 4-6x slower on 38k pages)
    for i in range(src.size):
        dst[i] = src[i]


@jit
def fill_with(dst, value):
    for i in range(dst.size):
        dst[i] = value


@jit
def pack(out, plan_words, off, head, work, cta_indptr, cta_work, merge_rows, merge_indptr,
         merge_indices, max_merge_rows, zero_end, item_merge, item_merge_off, kv_indptr,
         kv_indices, kv_last, table_off):
    # the plan in PlanLayout.pack's format, zeros up to zero_end, the work items' merge lists
    # at item_merge_off, then the page table's three arrays at table_off[0..2] (empty arrays:
    # nothing copied)
    fill_with(out[:plan_words], -1)
    copy_into(out, head)
    copy_into(out[off[0]:], work.reshape(-1))
    copy_into(out[off[1]:], cta_indptr)
    copy_into(out[off[2]:], cta_work)
    copy_into(out[off[3]:], merge_rows)
    copy_into(out[off[4]:], merge_indptr)
    copy_into(out[off[5]:], merge_indices)
    last = merge_indptr[merge_indptr.size - 1]
    fill_with(out[off[4] + merge_indptr.size:off[4] + max_merge_rows + 1], last)
    fill_with(out[plan_words:zero_end], 0)
    copy_into(out[item_merge_off:], item_merge)
    copy_into(out[table_off[0]:], kv_indptr)
    copy_into(out[table_off[1]:], kv_indices)
    copy_into(out[table_off[2]:], kv_last)


@jit
def check_table(indptr, indices, last, page_size):
    # (0, snapshot, every request's KV length, largest page id + 1) when the table is valid
    # (FlashInfer's rules, as check_page_table states them), (1, ...) if not; the snapshot is
    # one buffer holding indptr [B + 1], indices [nnz], last_page_len [B] (one array to box)
    batch = indptr.size - 1
    kv_lens = np.zeros(max(batch, 0), np.int64)
    nnz = indptr[batch] if batch >= 0 else 0
    bad = (1, indptr[:0].copy(), kv_lens, 0)
    if batch < 0 or indptr[0] != 0 or last.size != batch:
        return bad
    for b in range(batch):
        if indptr[b + 1] < indptr[b]:
            return bad
    if indices.size < nnz:
        return bad
    snap = np.empty(2 * batch + 1 + nnz, np.int32)
    ptr, idx, lst = table_views(snap, batch)
    copy_into(ptr, indptr)
    # the copy with its min and max, no early exit: one loop LLVM vectorises (10k pages: ~1 us)
    lo, hi = 0, -1
    if nnz:
        lo, hi = indices[0], indices[0]
    for i in range(nnz):
        x = indices[i]
        idx[i] = x
        lo = min(lo, x)
        hi = max(hi, x)
    if lo < 0:
        return bad
    for b in range(batch):
        n = indptr[b + 1] - indptr[b]
        x = last[b]
        lst[b] = x
        if x < (1 if n > 0 else 0) or x > page_size:
            return bad
        kv_lens[b] = (n - 1) * page_size + x if n > 0 else 0
    return (0, snap, kv_lens, hi + 1)


@jit
def check_and_schedule(indptr, indices, last, page_size, qo_indptr, hkv, group, num_ctas,
                       granule, wq, wkv, fixed, causal, tile_q):
    # check_table, then schedule over its KV lengths: one call from Python instead of two
    # (a dispatch and the boxing of its results cost more than the check itself)
    # (a rejected table schedules an empty batch: the caller re-checks it and raises)
    table = check_table(indptr, indices, last, page_size)
    if table[0] != _OK or table[2].size != qo_indptr.size - 1:
        return table, schedule(qo_indptr[:1], table[2][:0], hkv, group, num_ctas, granule, wq,
                               wkv, fixed, causal, tile_q, 0)
    return table, schedule(qo_indptr, table[2], hkv, group, num_ctas, granule, wq, wkv, fixed,
                           causal, tile_q, 0)


@jit
def check_schedule_pack(indptr, indices, last, page_size, qo_indptr, hkv, group, num_ctas,
                        granule, wq, wkv, fixed, causal, tile_q, out, caps, off, head, step_at,
                        item_merge_off, table_off):
    # check_and_schedule, then, when the schedule fits the capacities ``caps`` (max_work,
    # max_merge_rows, max_merge_nnz, max_batch, max_pages, plan words, zero_end) of the layout
    # the caller expects, pack it into ``out`` as pack() would with that layout: ``head`` is
    # its header template, ``step_at`` where this step's counts go (layout.STEP_FIELDS).
    # Returns (table, schedule, packed).
    table, res = check_and_schedule(indptr, indices, last, page_size, qo_indptr, hkv, group,
                                    num_ctas, granule, wq, wkv, fixed, causal, tile_q)
    batch = qo_indptr.size - 1
    num_work, merge_rows_n, num_partials = res[2], res[3], res[4]
    ptr, idx, lst = table_views(table[1], batch)
    if (table[0] != _OK or res[0] != _OK or num_work > caps[0] or merge_rows_n > caps[1]
            or num_partials > caps[2] or batch > caps[3] or idx.size > caps[4]):
        return table, res, False
    work, cta_indptr, cta_work, merge_rows, merge_indptr, merge_indices, item_merge = \
        sched_views(res[1], num_work, num_ctas, merge_rows_n, num_partials)
    h = head.copy()
    h[step_at[0]] = num_work
    h[step_at[1]] = merge_rows_n
    h[step_at[2]] = num_partials  # num_merge_nnz: every partial row is in one merge list
    h[step_at[3]] = num_partials
    h[step_at[4]] = batch
    h[step_at[5]] = qo_indptr[batch]  # num_qo_rows
    h[step_at[6]] = res[5]  # tile_q
    h[step_at[7]] = res[6]  # tile_rows
    h[step_at[8]] = res[7]  # kv_chunk
    pack(out, caps[5], off, h, work, cta_indptr, cta_work, merge_rows, merge_indptr,
         merge_indices, caps[1], caps[6], item_merge, item_merge_off, ptr, idx, lst, table_off)
    return table, res, True


@jit
def cascade_map(work, hkv, num_partials, qo_start, nnz):
    # cascade_plan's rebuild of a base plan over virtual requests: every chunk that wrote its
    # rows directly gets partial rows after the planner's own, and the reduction map is rebuilt
    # over the real rows (virtual request v's rows start at real row qo_start[v]), each row's
    # entries in the order the chunks come (level, then KV start: what cascade_plan's lexsort
    # gives). Returns (work with the new partial rows, partial rows in all, merge_rows,
    # merge_indptr, merge_indices).
    nch = work.shape[0] // hkv
    out = work.copy()
    prow = np.empty(nch, np.int64)
    total = num_partials
    count = np.zeros(nnz + 1, np.int64)
    for c in range(nch):
        w = c * hkv
        rows = work[w, 3] - work[w, 2]
        p = work[w, 6]
        if p < 0:
            p = total
            total += rows
        prow[c] = p
        for h in range(hkv):
            out[w + h, 6] = p
        first = qo_start[work[w, 0]] + work[w, 2]
        for j in range(rows):
            count[first + j + 1] += 1
    m = 0
    for r in range(nnz):
        if count[r + 1] > 0:
            m += 1
    merge_rows = np.empty(m, np.int32)
    merge_indptr = np.empty(m + 1, np.int32)
    merge_indptr[0] = 0
    m = 0
    for r in range(nnz):
        if count[r + 1] > 0:
            merge_rows[m] = r
            merge_indptr[m + 1] = merge_indptr[m] + count[r + 1]
            m += 1
        count[r + 1] += count[r]  # now the first entry of row r + 1
    merge_indices = np.empty(count[nnz], np.int32)
    for c in range(nch):
        w = c * hkv
        first = qo_start[work[w, 0]] + work[w, 2]
        for j in range(work[w, 3] - work[w, 2]):
            r = first + j
            merge_indices[count[r]] = prow[c] + j
            count[r] += 1
    return out, total, merge_rows, merge_indptr, merge_indices


@jit
def item_merge(prow, merge_indptr, merge_indices, num_partials):
    # api.workspace.item_merge_lists: the merge list of every work item's (first) partial row,
    # -1 for an item that writes its output directly
    owner = np.full(max(num_partials, 1), -1, np.int32)
    for m in range(merge_indptr.size - 1):
        for e in range(merge_indptr[m], merge_indptr[m + 1]):
            owner[merge_indices[e]] = m
    out = np.empty(prow.size, np.int32)
    for w in range(prow.size):
        out[w] = owner[prow[w]] if prow[w] >= 0 else -1
    return out


@jit
def cascade_schedule(qo_all, qo_off, kv, hkv, group, num_ctas, granule, wq, wkv, fixed, tile_q,
                     overhead):
    # scheduler.cascade_plan in one call: level l's query indptr is qo_all[qo_off[l]:qo_off[l +
    # 1]]; every segment of every level is a virtual request (level-major) with KV length
    # kv[v]; schedule() over them, then cascade_map()'s rebuild over the real rows and
    # item_merge() of the result. Returns (schedule's result, qo_start, qo_end, level, the
    # rebuilt work, partial rows, merge_rows, merge_indptr, merge_indices, item_merge); when
    # schedule hands the step to the NumPy planner (its first field not _OK) the rebuild's
    # fields are empty.
    levels = qo_off.size - 1
    nv = qo_off[levels] - qo_off[0] - levels
    qo_start = np.empty(nv, np.int64)
    qo_end = np.empty(nv, np.int64)
    level = np.empty(nv, np.int32)
    virt = np.zeros(nv + 1, np.int64)
    v = 0
    for lvl in range(levels):
        for s in range(qo_off[lvl], qo_off[lvl + 1] - 1):
            qo_start[v] = qo_all[s]
            qo_end[v] = qo_all[s + 1]
            level[v] = lvl
            virt[v + 1] = virt[v] + qo_all[s + 1] - qo_all[s]
            v += 1
    nnz = qo_all[qo_off[1] - 1]
    res = schedule(virt, kv, hkv, group, num_ctas, granule, wq, wkv, fixed, False, tile_q,
                   overhead)
    empty = np.zeros(0, np.int32)
    if res[0] != _OK:
        return (res, qo_start, qo_end, level, np.zeros((0, 0), np.int32), 0, empty, empty,
                empty, empty)
    num_work, num_partials = res[2], res[4]
    work = sched_views(res[1], num_work, num_ctas, res[3], num_partials)[0]
    out, total, merge_rows, merge_indptr, merge_indices = cascade_map(work, hkv, num_partials,
                                                                      qo_start, nnz)
    owners = item_merge(out[:, 6], merge_indptr, merge_indices, total)
    return (res, qo_start, qo_end, level, out, total, merge_rows, merge_indptr, merge_indices,
            owners)


@jit
def check_levels(qo_all, qo_off, ptr_sizes, last_sizes):
    # reference.cascade._check_levels' rules over level l's query indptr qo_all[qo_off[l]:
    # qo_off[l + 1]]: each starts at 0, never decreases and ends where level 0 does; each
    # level's boundaries are among the next level's (a coarsening); level l's page table has
    # ptr_sizes[l] = segments + 1 indptr entries and last_sizes[l] = segments last-page
    # lengths. True when every rule holds (the caller's NumPy check names a broken one).
    levels = qo_off.size - 1
    if levels < 1:
        return False
    nnz = qo_all[qo_off[1] - 1] if qo_off[1] > qo_off[0] else -1
    for lvl in range(levels):
        a, b = qo_off[lvl], qo_off[lvl + 1]
        if b <= a or qo_all[a] != 0 or qo_all[b - 1] != nnz:
            return False
        if ptr_sizes[lvl] != b - a or last_sizes[lvl] != b - a - 1:
            return False
        for i in range(a, b - 1):
            if qo_all[i + 1] < qo_all[i]:
                return False
    for lvl in range(levels - 1):
        # both sorted: one merge-like walk over the finer level per coarse level
        j, end = qo_off[lvl + 1], qo_off[lvl + 2]
        for i in range(qo_off[lvl], qo_off[lvl + 1]):
            x = qo_all[i]
            while j < end and qo_all[j] < x:
                j += 1
            if j == end or qo_all[j] != x:
                return False
    return True


@jit
def check_stage_append(bi, pos, indptr, indices, last, page_size, num_pages, out, off):
    # api.append._check_indices' rules (check_table's page table with page ids below
    # num_pages, every batch index a request of it, every position inside its request's KV)
    # and the staging of what the append kernel reads: bi, pos, indptr and the first
    # indptr[-1] page ids (at least one word: an empty list stages a 0) at out[off[0..3]].
    # True when every rule holds (out is then written); False: the caller's NumPy check names
    # the broken rule.
    table = check_table(indptr, indices, last, page_size)
    if table[0] != _OK or table[3] > num_pages or pos.size != bi.size:
        return False
    kv_len = table[2]
    batch = kv_len.size
    for t in range(bi.size):
        b = bi[t]
        if b < 0 or b >= batch or pos[t] < 0 or pos[t] >= kv_len[b]:
            return False
    ptr, idx, _ = table_views(table[1], batch)
    copy_into(out[off[0]:], bi)
    copy_into(out[off[1]:], pos)
    copy_into(out[off[2]:], ptr)
    copy_into(out[off[3]:], idx)
    if idx.size == 0:
        out[off[3]] = 0
    return True
