"""``nbinfer.defer_frees``: no cyclic collection runs inside it (a collection freeing an
earlier engine's CUDA graphs invalidated an engine's capture, bench/NOTES.md session 32), the
collector's state comes back after it, nested, across threads or on an error. Needs no GPU
(in the simulator, as CI runs it, Numba's ``defer_cleanup`` does nothing; on a GPU
tests/test_gpu_layers.py drops Numba arrays inside a guarded capture)."""

from __future__ import annotations

import gc
import threading

import pytest

from nbinfer.api.launch import defer_frees


def _cyclic_garbage(n: int) -> None:
    for _ in range(n):
        a = []
        a.append(a)


@pytest.fixture
def collections():
    runs = []

    def seen(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    was = gc.isenabled()
    gc.enable()
    gc.callbacks.append(seen)
    yield runs
    gc.callbacks.remove(seen)
    (gc.enable if was else gc.disable)()  # whatever a failed test left


def test_no_collection_runs_inside(collections):
    threshold = gc.get_threshold()[0]
    _cyclic_garbage(5 * threshold)
    assert collections, "the control: past the threshold the collector runs"
    collections.clear()
    with defer_frees():
        with defer_frees():  # nested: the inner exit leaves it off
            pass
        assert not gc.isenabled()
        _cyclic_garbage(5 * threshold)
        assert collections == []
    assert gc.isenabled()


def test_the_collector_comes_back_after_an_error_and_stays_off_if_it_was(collections):
    with pytest.raises(ValueError), defer_frees():
        raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    with defer_frees():
        pass
    assert not gc.isenabled()


def test_overlapping_blocks_of_two_threads(collections):
    # The collector is process-wide: the first block to leave must not switch it on while
    # the other thread's block is still inside.
    inside, leave = threading.Event(), threading.Event()

    def other():
        with defer_frees():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with defer_frees():
        pass
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()
