"""Warp reduce-scatter for the decode kernels, with a shared-memory twin for the simulator.

The decode microkernel splits the head dimension of a key row across ``width`` lanes (32 or 16),
so a dot product ``q_h . k_t`` ends as ``width`` lane partials. Reducing every (token, head) pair
with its own butterfly would cost ``2 * log2(width)`` instructions per pair; a *reduce-scatter*
instead halves a lane's list of ``N`` partials at each level (send one half to the partner, keep
and add the other), so ``N`` pairs cost about ``N`` shuffles in total, and each lane ends up
owning whole dot products.

Slot layout after :func:`reduce_scatter` (``N`` slots per group of ``width`` lanes,
``R = max(N // width, 1)`` slots per lane, ``REP = max(width // N, 1)`` lanes per slot): lane
``l`` (``u = l % width`` within its group) holds slots ``(u // REP) * R + r`` of its group.

On the GPU the collective is shuffles. The simulator has no shuffles, so the twin writes to a
shared scratch buffer and meets the other threads at ``syncthreads`` (two barriers per call).
Every thread of a block must therefore reach it the same number of times: kernels keep their
loops uniform across the block.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda, float32

from .primitives import device_jit

FULL_MASK = 0xFFFFFFFF


def _is_pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def slot_layout(n_slots: int, width: int = 32):
    """Return ``(R, REP, scatter_levels)`` for a reduce-scatter of ``n_slots`` over ``width`` lanes."""
    if not _is_pow2(n_slots):
        raise ValueError(f"n_slots must be a power of two, got {n_slots}")
    if width not in (2, 4, 8, 16, 32):
        raise ValueError(f"width must be a power of two in [2, 32], got {width}")
    r = max(n_slots // width, 1)
    rep = max(width // n_slots, 1)
    levels = min(n_slots.bit_length(), width.bit_length()) - 1
    return r, rep, levels


@functools.cache
def warp_collectives(n_slots: int, num_warps: int, sim: bool, width: int = 32):
    """Build ``reduce_scatter`` for ``n_slots`` partials per lane over groups of ``width`` lanes.

    Returns a namespace with ``reduce_scatter(part, out, lane, warp, scratch)`` (``part``: local
    float32 [n_slots], destroyed; ``out``: local float32 [R], the full sums of the lane's slots),
    ``scratch_size`` (float32 elements of shared scratch the simulator twin needs; 1 on the GPU),
    ``R`` and ``REP``.
    """
    R, REP, LEVELS = slot_layout(n_slots, width)
    N = n_slots
    if sim:
        return _sim_collectives(N, R, REP, num_warps, width)
    FIRST = width // 2

    @device_jit(False)
    def reduce_scatter(part, out, lane, warp, scratch):
        n = N
        off = FIRST
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
        # Levels left over when N < width: plain butterfly, the sum lands in REP lanes.
        while off >= 1:
            part[0] += cuda.shfl_xor_sync(FULL_MASK, part[0], off)
            off //= 2
        for r in range(R):
            out[r] = part[r]

    return SimpleNamespace(reduce_scatter=reduce_scatter, scratch_size=1, R=R, REP=REP)


def _sim_collectives(N, R, REP, num_warps, width):
    # Scratch layout: [warp][lane][slot], N slots per lane.
    W = 32 * N

    # Decorated so the simulator binds its fake ``cuda`` module (syncthreads) inside it.
    @cuda.jit(device=True)
    def reduce_scatter(part, out, lane, warp, scratch):
        base = warp * W
        for i in range(N):
            scratch[base + lane * N + i] = part[i]
        cuda.syncthreads()
        group = (lane // width) * width
        for r in range(R):
            slot = ((lane % width) // REP) * R + r
            acc = float32(0.0)
            for j in range(width):
                acc += scratch[base + (group + j) * N + slot]
            out[r] = acc
        cuda.syncthreads()

    return SimpleNamespace(reduce_scatter=reduce_scatter, scratch_size=num_warps * W, R=R, REP=REP)


@functools.cache
def head_maxima(num_heads: int, block: int, width: int, num_warps: int, sim: bool):
    """Build ``maxima(x, lane, warp, scratch, out)`` for the decode's online softmax.

    After :func:`reduce_scatter` the logits of head ``h`` sit in lanes ``u`` (``u = lane %
    width``) of ``[h * block, (h + 1) * block)`` in every group of ``width`` lanes, and no lane
    holds two heads. ``x`` is the maximum over the lane's own logits; ``out [num_heads]`` gets
    every head's maximum in every lane: a butterfly over the lanes of one head (``log2(32 /
    heads)`` shuffle-max steps), then one indexed shuffle per head. NaN propagates as with
    ``max``. The simulator twin goes through shared memory (``32 * num_warps`` floats).
    """
    if not (_is_pow2(block) and _is_pow2(width) and block <= width <= 32):
        raise ValueError(f"block and width must be powers of two, block <= width <= 32, got "
                         f"{block}, {width}")
    offsets = [o for o in (1, 2, 4, 8, 16) if o < block or (o >= width and o < 32)]
    G = num_heads
    if sim:
        @cuda.jit(device=True)
        def maxima(x, lane, warp, scratch, out):
            scratch[warp * 32 + lane] = x
            cuda.syncthreads()
            for h in range(G):
                m = scratch[warp * 32 + h * block]
                for j in range(32):
                    if ((j % width) // block) == h:
                        m = max(m, scratch[warp * 32 + j])
                out[h] = m
            cuda.syncthreads()

        return SimpleNamespace(maxima=maxima, scratch_size=32 * num_warps)

    OFFS = tuple(offsets)

    @device_jit(False)
    def maxima(x, lane, warp, scratch, out):
        for off in OFFS:
            x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, off))
        for h in range(G):
            out[h] = cuda.shfl_sync(FULL_MASK, x, h * block)

    return SimpleNamespace(maxima=maxima, scratch_size=1)
