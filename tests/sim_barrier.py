"""A blocking barrier for Numba's CUDA simulator, in place of its polling loop (tests only).

Numba-CUDA's simulator runs a block as one Python thread per CUDA thread. Its
``BlockManager.run`` finds out that every thread reached ``syncthreads()`` by polling: the
launching thread loops over all live threads, asking each ``is_alive()`` and whether it is
blocked, without ever sleeping. That loop competes for the GIL with the threads doing the
kernel's work: in a profile of one lean-prefill test (256 threads a block) the poll took about
half of the test's time (``threading.is_alive`` 2.3 million calls, 19.5 of 42.8 s).

:func:`install` swaps in a counting barrier with the same semantics and no polling:

- a thread arriving at ``syncthreads()`` counts itself under a lock and sleeps on a condition;
  the last of the block's live threads to arrive wakes them all (a new generation);
- a thread that returns leaves the count of live threads, so that the threads still waiting
  are released once every live thread has arrived (the simulator's rule too: an exited thread
  does not hold a barrier);
- a thread that raises sets the abort flag on every other thread and wakes them; each then
  raises at its barrier, as in the simulator, and the launch re-raises the first thread's
  exception (the one that failed, not an aborted one).

The launching thread only joins. Nothing in the kernels' results depends on the scheduler:
threads still run the same code against the same simulated memory, and memory ordering inside a
block is still only what its barriers give. ``syncthreads_count`` / ``_and`` / ``_or`` call
``syncthreads`` and keep working unchanged.
"""

from __future__ import annotations

import threading

import numpy as np


class _Barrier:
    __slots__ = ("cond", "live", "arrived", "generation", "failed")

    def __init__(self, live: int):
        self.cond = threading.Condition()
        self.live = live
        self.arrived = 0
        self.generation = 0
        self.failed = None  # the first thread that raised

    def release_if_complete(self):
        """Under ``cond``: open the barrier if every live thread waits at it."""
        if self.arrived and self.arrived >= self.live:
            self.arrived = 0
            self.generation += 1
            self.cond.notify_all()


def install() -> bool:
    """Replace the simulator's block scheduler (idempotent). Returns whether it was installed:
    False when the simulator's classes are not shaped as expected (then nothing changes)."""
    try:
        from numba.cuda.simulator import kernel as sim
    except ImportError:
        return False
    thread_cls, manager_cls = getattr(sim, "BlockThread", None), getattr(sim, "BlockManager", None)
    if thread_cls is None or manager_cls is None:
        return False
    if getattr(manager_cls, "_nbinfer_barrier", False):
        return True
    for name in ("syncthreads", "run"):
        if not callable(getattr(thread_cls, name, None)):
            return False
    if not callable(getattr(manager_cls, "run", None)):
        return False

    thread_run = thread_cls.run  # runs the target, keeps its exception in self.exception

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        bar = self._manager._barrier
        with bar.cond:
            generation = bar.generation
            bar.arrived += 1
            bar.release_if_complete()
            while bar.generation == generation and not self.abort:
                bar.cond.wait()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def run_thread(self):
        try:
            thread_run(self)
        finally:
            bar = self._manager._barrier
            with bar.cond:
                bar.live -= 1
                if self.exception is not None and bar.failed is None:
                    bar.failed = self
                    for other in self._manager._threads:
                        other.abort = True
                    bar.cond.notify_all()
                else:
                    bar.release_if_complete()

    def run_block(self, grid_point, *args):
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            threads.append(thread_cls(lambda: self._f(*args), self, grid_point, block_point,
                                      self._debug))
        self._threads = threads
        self._barrier = _Barrier(len(threads))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = self._barrier.failed
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])

    thread_cls.syncthreads = syncthreads
    thread_cls.run = run_thread
    manager_cls.run = run_block
    manager_cls._nbinfer_barrier = True
    return True
