"""Warp collectives for the decode kernels, with shared-memory twins for the simulator.

The decode microkernel gives each lane of a warp a slice of the head dimension, so a dot product
``q_h . k_t`` ends as 32 lane partials. Reducing every (token, head) pair with its own 5-step
butterfly would cost 10 instructions per pair; a *reduce-scatter* instead halves a lane's list of
N partials at each of 5 levels (send one half to the partner, keep and add the other), so N pairs
cost about N shuffles in total, and lane ``l`` ends up owning whole dot products.

Slot layout after :func:`reduce_scatter` (N slots, ``R = max(N // 32, 1)`` per lane,
``REP = max(32 // N, 1)`` lanes per slot): lane ``l`` holds slots ``(l // REP) * R + r``.

On the GPU the collectives are shuffles. The simulator has no shuffles, so each twin writes to a
shared scratch buffer and meets the other threads at ``syncthreads`` (two barriers per collective,
which is why the kernels call few, large collectives rather than many small ones). Every thread of
a block must therefore reach each collective the same number of times: kernels keep their loops
uniform across the block.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda, float32

FULL_MASK = 0xFFFFFFFF


def slot_layout(n_slots: int):
    """Return ``(R, REP, scatter_levels)`` for a reduce-scatter of ``n_slots`` (a power of two)."""
    if n_slots < 1 or n_slots & (n_slots - 1):
        raise ValueError(f"n_slots must be a power of two, got {n_slots}")
    r = max(n_slots // 32, 1)
    rep = max(32 // n_slots, 1)
    levels = min(n_slots.bit_length() - 1, 5)
    return r, rep, levels


@functools.cache
def warp_collectives(n_slots: int, num_warps: int, sim: bool):
    """Build the collectives for ``n_slots`` partials per lane in a block of ``num_warps`` warps.

    Returns a namespace with

    ``reduce_scatter(part, out, lane, warp, scratch)``
        ``part`` local float32 [n_slots] -> ``out`` local float32 [R]: full sums of the lane's slots.
    ``gather_slots(vals, out, lane, warp, scratch)``
        Every lane receives every slot: ``out`` local [n_slots] from the owners' ``vals`` [R].
    ``scratch_size``
        float32 elements of shared scratch the simulator twins need (1 on the GPU).
    """
    R, REP, LEVELS = slot_layout(n_slots)
    N = n_slots
    if sim:
        return _sim_collectives(N, R, REP, num_warps)

    @cuda.jit(device=True, inline="always")
    def reduce_scatter(part, out, lane, warp, scratch):
        n = N
        off = 16
        for _ in range(LEVELS):
            half = n // 2
            upper = (lane & off) != 0
            for i in range(half):
                a = part[i]
                b = part[i + half]
                send = a if upper else b
                keep = b if upper else a
                part[i] = keep + cuda.shfl_xor_sync(FULL_MASK, send, off)
            n = half
            off //= 2
        # Levels left over when N < 32: plain butterfly, the sum lands replicated in REP lanes.
        while off >= 1:
            part[0] += cuda.shfl_xor_sync(FULL_MASK, part[0], off)
            off //= 2
        for r in range(R):
            out[r] = part[r]

    @cuda.jit(device=True, inline="always")
    def gather_slots(vals, out, lane, warp, scratch):
        for i in range(N):
            out[i] = cuda.shfl_sync(FULL_MASK, vals[i % R], (i // R) * REP)

    return SimpleNamespace(reduce_scatter=reduce_scatter, gather_slots=gather_slots,
                           scratch_size=1, R=R, REP=REP)


def _sim_collectives(N, R, REP, num_warps):
    # Scratch layout: [warp][lane][slot], N slots per lane (enough for every collective below).
    W = 32 * N

    # Decorated so the simulator binds its fake ``cuda`` module (syncthreads) inside them.
    @cuda.jit(device=True)
    def reduce_scatter(part, out, lane, warp, scratch):
        base = warp * W
        for i in range(N):
            scratch[base + lane * N + i] = part[i]
        cuda.syncthreads()
        for r in range(R):
            slot = (lane // REP) * R + r
            acc = float32(0.0)
            for src in range(32):
                acc += scratch[base + src * N + slot]
            out[r] = acc
        cuda.syncthreads()

    @cuda.jit(device=True)
    def gather_slots(vals, out, lane, warp, scratch):
        base = warp * W
        for r in range(R):
            scratch[base + lane * N + r] = vals[r]
        cuda.syncthreads()
        for i in range(N):
            out[i] = scratch[base + ((i // R) * REP) * N + i % R]
        cuda.syncthreads()

    return SimpleNamespace(reduce_scatter=reduce_scatter, gather_slots=gather_slots,
                           scratch_size=num_warps * W, R=R, REP=REP)
