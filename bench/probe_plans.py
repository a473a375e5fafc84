"""The plans of bench/balance_probe.py, NumPy only (so that the tests can build them without
torch): a stream-K decode plan and LPT's plan with its CTA queues reordered (issue 13, req 3).

Both return :class:`~nbinfer.scheduler.schedule.Plan` objects that the decode wrapper runs as
its own: :func:`planner` swaps them in for ``scheduler.plan``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import numpy as np

from nbinfer import scheduler
from nbinfer.scheduler import compiled as sched_compiled
from nbinfer.scheduler.schedule import Plan


def stream_plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas, *, step=16,
                **_ignored) -> Plan:
    """Decode plan whose CTAs read equal spans of the (request, kv head) stream.

    Pair ``k = b * Hkv + h`` occupies ``[P_k, P_k + kv_b)`` of the stream; CTA ``c`` takes
    ``[x_c, x_{c+1})`` with ``x_c = c * S / num_ctas`` moved to the nearest multiple of
    ``step`` (a page) inside its pair (the wrapper's ``granule``, 256, is ignored). A pair cut
    into ``f > 1`` pieces gets a merge list of its own (output row ``b``, merged for head
    group ``h`` only, as the fused merge does) over ``f`` partial rows of its own; an uncut
    pair writes its output directly.
    """
    kv = np.asarray(kv_lens, np.int64)
    batch, hkv = kv.size, int(num_kv_heads)
    pair_len = np.repeat(kv, hkv)
    start = np.concatenate([[0], np.cumsum(pair_len)])
    total = int(start[-1])
    cuts = [0]
    for c in range(1, num_ctas):
        x = c * total / num_ctas
        k = min(int(np.searchsorted(start, x, side="right") - 1), batch * hkv - 1)
        off = int(round((x - start[k]) / step)) * step
        off = min(max(off, 0), int(pair_len[k]))
        cuts.append(max(int(start[k]) + off, cuts[-1]))
    cuts.append(total)
    pieces = []  # (pair, ks, ke, cta) in stream order
    for c in range(num_ctas):
        a, e_c = cuts[c], cuts[c + 1]
        while a < e_c:
            k = int(np.searchsorted(start, a, side="right") - 1)
            e = min(e_c, int(start[k + 1]))
            pieces.append((k, a - int(start[k]), e - int(start[k]), c))
            a = e
    seen = {p[0] for p in pieces}
    for k in range(batch * hkv):  # an empty request still writes its (empty) output
        if k not in seen:
            pieces.append((k, 0, 0, int(k % num_ctas)))
    pieces.sort(key=lambda p: (p[0], p[1]))
    npieces = np.bincount([p[0] for p in pieces], minlength=batch * hkv)
    work, owner = [], []
    merge_rows, merge_indptr, merge_indices = [], [0], []
    nxt, last_pair = 0, -1
    for k, ks, ke, c in pieces:
        b, h = divmod(k, hkv)
        prow = -1
        if npieces[k] > 1:
            if k != last_pair:  # the pair's list: its pieces' partial rows, in kv order
                merge_rows.append(b)
                merge_indices.extend(range(nxt, nxt + int(npieces[k])))
                merge_indptr.append(len(merge_indices))
                j, last_pair = nxt, k
                nxt += int(npieces[k])
            prow, j = j, j + 1  # pieces are sorted by (pair, kv_start)
        work.append((b, h, 0, 1, ks, ke, prow))
        owner.append(c)
    work = np.asarray(work, np.int32).reshape(-1, 7)
    owner = np.asarray(owner)
    # a CTA's queue in stream order: sort by (owner, pair, kv_start); pieces are pair-sorted
    order = np.lexsort((np.arange(owner.size), owner))
    cta_indptr = np.zeros(num_ctas + 1, np.int64)
    np.add.at(cta_indptr, owner + 1, 1)
    cta_indptr = np.cumsum(cta_indptr)
    return Plan(work=work, cta_indptr=cta_indptr.astype(np.int32),
                cta_work=order.astype(np.int32),
                merge_rows=np.asarray(merge_rows, np.int32),
                merge_indptr=np.asarray(merge_indptr, np.int32),
                merge_indices=np.asarray(merge_indices, np.int32),
                num_partials=nxt, batch_size=batch, num_qo_rows=batch,
                num_qo_heads=int(num_qo_heads), num_kv_heads=hkv, tile_q=16, tile_rows=1,
                kv_chunk=int(-(-total // num_ctas)), granule=step, causal=False,
                fixed_split_size=None, alpha=1.0, beta=1.0, item_overhead=0)


# The LPT plan's CTA queues put on other CTAs (the same items, the same per-CTA loads): does the
# order in which the grid meets the items, or which queues share an SM, move the decode?
ORDERS = ("rev", "shuffle", "stride", "headmajor", "within")


def reordered(plan: Plan, kind: str, sms: int = 132) -> Plan:
    """``plan`` with its CTA queues permuted (or, ``within``, each queue reversed).

    ``rev``: queue ``q`` on CTA ``C - 1 - q``; ``shuffle``: a seeded random permutation;
    ``stride``: queues ``4 s .. 4 s + 3`` on CTAs ``s, s + sms, s + 2 sms, s + 3 sms`` (the
    CTAs that share an SM when the whole grid is resident and blocks go round-robin, so that an
    SM runs consecutive queues: the kv heads of one request); ``headmajor``: queues sorted by
    their first item's (kv head, request); ``within``: every queue run back to front.
    """
    c = plan.num_ctas
    queues = [plan.cta_work[plan.cta_indptr[i]:plan.cta_indptr[i + 1]] for i in range(c)]
    if kind == "within":
        queues = [qu[::-1] for qu in queues]
    else:
        if kind == "rev":
            src = np.arange(c)[::-1]
        elif kind == "shuffle":
            src = np.random.default_rng(0).permutation(c)
        elif kind == "stride":
            per = -(-c // sms)  # CTAs per SM
            slot = np.arange(c)
            sm, k = slot % sms, slot // sms  # CTA slot -> (SM position, its k-th CTA)
            src = np.argsort(np.argsort(sm * per + k, kind="stable"), kind="stable")
        elif kind == "headmajor":
            first = [(int(plan.work[qu[0], 1]), int(plan.work[qu[0], 0])) if qu.size
                     else (1 << 30, i) for i, qu in enumerate(queues)]
            src = np.array(sorted(range(c), key=lambda i: first[i]))
        else:
            raise ValueError(f"unknown order {kind!r}")
        queues = [queues[int(src[i])] for i in range(c)]
    sizes = np.array([qu.size for qu in queues], np.int64)
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    work = np.concatenate(queues).astype(np.int32) if sizes.sum() else plan.cta_work
    return dataclasses.replace(plan, cta_indptr=indptr, cta_work=work)


@contextlib.contextmanager
def planner(kind):
    """The decode wrapper's NumPy planning path with ``kind``'s planner: ``"lpt"`` nbinfer's
    own, ``"stream"`` :func:`stream_plan`, one of :data:`ORDERS` LPT's plan :func:`reordered`.
    A wrapper's ``plan()`` inside the block builds its schedule with it."""
    if kind == "lpt":
        fn = scheduler.plan
    elif kind in ORDERS:
        lpt = scheduler.plan
        fn = lambda *a, **kw: reordered(lpt(*a, **kw), kind)  # noqa: E731
    elif kind == "stream":
        fn = stream_plan
    else:
        raise ValueError(f"unknown planner {kind!r}")
    with mock.patch.object(sched_compiled, "loaded", return_value=False), \
            mock.patch("nbinfer.api.decode.scheduler.plan", fn):
        yield
