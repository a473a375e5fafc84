"""Programmatic dependent launch (PDL), the device side: a kernel launched right after another
on the same stream may start before that one has finished, and waits for it only where it must.

A launch with CUDA's programmatic-stream-serialization attribute (the host side:
:meth:`~.launch.PreparedLaunch.sharing`'s ``dependent``) lets the driver start the dependent
grid once every CTA of the kernel before it has either executed ``griddepcontrol
.launch_dependents`` (:func:`dependent_launch`'s ``trigger``) or exited. Its CTAs then take
the SMs that kernel's last CTAs free, while those still run, and stop at ``griddepcontrol.wait``
(``wait``) until that kernel has completed and its memory is visible. What this buys is the
launch gap and the dependent's start, hidden under the tail of the kernel before it.

nbinfer uses it for one pair: the tensor-core prefill (or its guarded twin) and the merge of
its split rows (:mod:`.split_merge`), whose launch follows it in every cascade step. The
prefill kernels trigger as they start (a persistent grid: all its CTAs are resident from the
start, so the dependents wait for SMs to free up, not for the trigger) and the merge waits
before it reads anything. Both instructions need sm_90; for an older target and in the
simulator they compile to nothing, and without the launch attribute ``wait`` returns at once
and ``trigger`` does nothing.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda


def _min_sm90() -> bool:
    # asked at lowering time: the device the kernel is compiled for (kernels.offline patches
    # this for a machine without a GPU)
    return tuple(cuda.get_current_device().compute_capability) >= (9, 0)


@functools.cache
def dependent_launch(sim: bool) -> SimpleNamespace:
    """``wait()`` (``griddepcontrol.wait``: the kernel before this one on the stream has
    completed and its writes are visible) and ``trigger()`` (``griddepcontrol
    .launch_dependents``: this CTA no longer holds back a dependent launch), as device
    functions; both no-ops in the simulator and below sm_90."""
    if sim:
        @cuda.jit(device=True)
        def nothing():
            pass

        return SimpleNamespace(wait=nothing, trigger=nothing)
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def make(text: str):
        @intrinsic
        def op(typingctx):
            def codegen(context, builder, sig, args):
                if _min_sm90():
                    fnty = ir.FunctionType(ir.VoidType(), [])
                    # a memory clobber: no load may move above the wait
                    builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return types.void(), codegen

        return op

    return SimpleNamespace(wait=make("griddepcontrol.wait;"),
                           trigger=make("griddepcontrol.launch_dependents;"))


__all__ = ["dependent_launch"]
