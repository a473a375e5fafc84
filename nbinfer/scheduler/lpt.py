"""LPT (longest processing time first) assignment of work items to CTAs.

Sort the items by cost, largest first, and give each one to the CTA whose queue is currently the
lightest. Graham (1969) showed the longest queue is then at most ``4/3 - 1/(3 m)`` times the best
possible one on ``m`` CTAs, and it is never longer than ``total / m + max_item`` (any greedy
list schedule is within one item of the average).

Determinism is part of the contract: equal costs keep their item order (stable sort), and equal
loads go to the lower CTA index. Costs are integers (:func:`integer_costs` turns the float cost
model into them), so no floating-point summation order can change a decision: the same lengths
always give the same queues.

Speed: the heap holds one Python int per CTA, ``key = load * num_ctas + cta``, which orders
exactly like the pair ``(load, cta)`` but compares several times faster than a tuple; the loop is
a single list comprehension over ``heapreplace``.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from .._checks import check_positive_int

__all__ = ["integer_costs", "integer_weights", "lpt_assign"]

_INT64_SAFE = 2**62
WEIGHT_BITS = 20


def integer_costs(l_q: np.ndarray, l_kv: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """``alpha * l_q + beta * l_kv`` as int64 costs with the same order and (nearly) the same ratios.

    The weights are scaled so the larger one is ``2**WEIGHT_BITS`` and rounded, then divided by
    their gcd: the default 1 : 1 becomes exactly 1 : 1, and any other ratio is kept to 20 bits
    (a weight below ``2**-20`` of the other counts as 0). Integer loads make every comparison in
    the heap exact, so no floating-point rounding can flip a decision.

    Parameters
    ----------
    l_q, l_kv : ndarray [W], int64
        Packed query rows and KV tokens of every item.
    alpha, beta : float
        Non-negative weights, not both 0.

    Returns
    -------
    ndarray [W], int64
    """
    wq, wkv = integer_weights(alpha, beta)
    return wq * l_q + wkv * l_kv


def integer_weights(alpha: float, beta: float) -> tuple[int, int]:
    """The integer weights ``(w_q, w_kv)`` of :func:`integer_costs`: the larger weight scaled to
    ``2**WEIGHT_BITS`` and rounded, both divided by their gcd (1 : 1 stays 1 : 1)."""
    top = max(alpha, beta)
    ia = round(alpha / top * 2**WEIGHT_BITS)
    ib = round(beta / top * 2**WEIGHT_BITS)
    g = math.gcd(ia, ib)
    return ia // g, ib // g


def lpt_assign(costs: np.ndarray, num_ctas: int, *,
               sections: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Assign work items to ``num_ctas`` CTAs, longest first, each to the least-loaded CTA.

    Parameters
    ----------
    costs : ndarray [W], integer
        Non-negative cost of every work item (see :func:`integer_costs`).
    num_ctas : int
        Number of CTA queues (``>= 1``).
    sections : ndarray [W], integer, optional
        Take the items section by section (in increasing section number), longest first
        within each; the queues' loads carry over from one section to the next. Since every
        CTA runs its queue in order, the items running at any moment then come from about one
        section (:func:`nbinfer.scheduler.plan`'s ``l2_section_kv`` groups the items by the
        KV they read, so that the KV in use fits the L2). None: one section, plain LPT.

    Returns
    -------
    cta_indptr : ndarray [num_ctas + 1], int32
        CTA ``c`` runs ``cta_work[cta_indptr[c]:cta_indptr[c + 1]]``.
    cta_work : ndarray [W], int32
        Item indices, grouped by CTA, in execution order (the order they were assigned: each
        CTA runs its largest item first).
    """
    costs = np.asarray(costs)
    if costs.dtype.kind not in "iu":
        raise TypeError(f"costs must be integers (see integer_costs), got dtype {costs.dtype}")
    costs = costs.astype(np.int64, copy=False).reshape(-1)
    if costs.size and costs.min() < 0:
        raise ValueError(f"costs must be >= 0, got {int(costs.min())}")
    num_ctas = check_positive_int("num_ctas", num_ctas)
    num_items = costs.size
    if sections is None:
        order = np.argsort(-costs, kind="stable")  # largest first; ties keep item order
    else:
        sections = np.asarray(sections).reshape(-1)
        if sections.shape != costs.shape or sections.dtype.kind not in "iu":
            raise ValueError(f"sections must be {costs.size} integers (one per item), got "
                             f"{sections.dtype} {sections.shape}")
        order = np.lexsort((-costs, sections))  # by section, then largest first (stable)
    sorted_costs = costs[order]
    owner = np.empty(num_items, dtype=np.int64)  # owner[k]: CTA of the k-th item in ``order``

    # While some CTA is still empty, the least-loaded CTA is the lowest-indexed empty one, so the
    # first ``num_ctas`` positive-cost items go to CTAs 0, 1, 2 ... without touching a heap.
    # (A zero-cost item would leave its CTA at load 0, which breaks that shortcut, so stop at it.)
    zero = sorted_costs <= 0
    first = min(num_ctas, int(np.argmax(zero)) if zero.any() else num_items)
    owner[:first] = np.arange(first)

    if first < num_items:
        # Keys are load * num_ctas + cta; past int64 they must stay Python ints (still exact).
        wide = int(costs.max()) * num_items * num_ctas >= _INT64_SAFE
        head, rest = sorted_costs[:first], sorted_costs[first:]
        if wide:  # Python ints all the way: exact for any magnitude, a little slower
            heap = [int(c) * num_ctas + i for i, c in enumerate(head.tolist())]
            steps = [int(c) * num_ctas for c in rest.tolist()]
        else:
            heap = (head * num_ctas + np.arange(first)).tolist()
            steps = (rest * num_ctas).tolist()
        heap += range(first, num_ctas)  # empty CTAs: load 0, key = cta
        heapq.heapify(heap)
        replace = heapq.heapreplace
        # The only Python loop of the scheduler. heapreplace returns the key it popped: the
        # least-loaded CTA (key % num_ctas) before this item was added to it.
        popped = [replace(heap, heap[0] + s) for s in steps]
        if wide:
            owner[first:] = [k % num_ctas for k in popped]
        else:
            owner[first:] = np.array(popped, dtype=np.int64) % num_ctas

    # Group by CTA, keeping the assignment order inside each queue (stable sort).
    cta_work = order[np.argsort(owner, kind="stable")].astype(np.int32)
    cta_indptr = np.zeros(num_ctas + 1, dtype=np.int32)
    np.cumsum(np.bincount(owner, minlength=num_ctas), out=cta_indptr[1:])
    return cta_indptr, cta_work
