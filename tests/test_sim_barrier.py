"""The simulator's blocking barrier (tests/sim_barrier.py) keeps the simulator's semantics.

Every test but the first passes on Numba's own polling scheduler too (``NBINFER_SIM_POLL=1``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import SIMULATOR
from numba import cuda, int32

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="the simulator's scheduler only")


# The kernels sit at module level: the simulator swaps a kernel's global `cuda` for its fake
# module, which a closure's captured `cuda` would escape.


@cuda.jit
def rounds(out, n_rounds):
    # Each round every thread writes t * (round + 1) into its shared slot, which its neighbour
    # reads after the barrier: a missing or early barrier shows as a wrong sum.
    sm = cuda.shared.array(64, int32)
    t = cuda.threadIdx.x
    acc = 0
    for r in range(n_rounds):
        sm[t] = t * (r + 1)
        cuda.syncthreads()
        acc += sm[(t + 1) % cuda.blockDim.x]
        cuda.syncthreads()
    out[cuda.blockIdx.x, t] = acc


@cuda.jit
def early_exit(out):
    # Threads past the first half return before the barrier; the rest must still pass it.
    sm = cuda.shared.array(64, int32)
    t = cuda.threadIdx.x
    half = cuda.blockDim.x // 2
    if t >= half:
        return
    sm[t] = t
    cuda.syncthreads()
    out[t] = sm[half - 1 - t]


@cuda.jit
def counts(out):
    t = cuda.threadIdx.x
    out[t] = cuda.syncthreads_count(t % 3 == 0)


@cuda.jit
def fails(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 5:
        out[1000] = 1  # out of bounds: the simulator raises IndexError in this thread
    cuda.syncthreads()
    out[t] = t


@pytest.mark.skipif(os.environ.get("NBINFER_SIM_POLL") == "1", reason="Numba's own, asked for")
def test_the_barrier_is_installed():
    from numba.cuda.simulator import kernel as sim

    assert getattr(sim.BlockManager, "_nbinfer_barrier", False)


def test_rounds_of_barriers_in_every_block():
    out = np.zeros((3, 64), np.int32)
    rounds[3, 64](out, 4)
    expect = ((np.arange(64) + 1) % 64) * sum(r + 1 for r in range(4))
    np.testing.assert_array_equal(out, np.broadcast_to(expect, (3, 64)))


def test_threads_that_returned_do_not_hold_the_barrier():
    out = np.full(64, -1, np.int32)
    early_exit[1, 64](out)
    np.testing.assert_array_equal(out[:32], np.arange(32)[::-1])
    assert np.all(out[32:] == -1)


def test_syncthreads_count():
    out = np.zeros(48, np.int32)
    counts[1, 48](out)
    assert np.all(out == 16)


def test_the_failing_threads_error_is_raised_not_an_abort():
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\]"):
        fails[1, 32](np.zeros(32, np.int32))
