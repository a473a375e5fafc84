"""Hopper's shared-memory barriers (``mbarrier``) as device intrinsics: the synchronisation of a
warp-specialised kernel, where some warps only copy and the others only compute.

A CTA-wide ``__syncthreads`` per K / V tile makes every warp wait for the slowest one, and the
warps that compute also issue the copies (bench/NOTES.md, session 16: without those copies the
standalone wgmma tile ran 274 -> 362 TFLOP/s causal, 306 -> 509 non-causal). With a ring of
stages guarded by mbarriers the two roles decouple:

- a *full* barrier per stage, expecting one arrival per producer thread: each producer thread
  issues its ``cp.async`` copies of the stage, then ``cp_arrive_noinc`` (``cp.async.mbarrier
  .arrive.noinc``), which arrives on the barrier once *its own* copies have landed; the
  consumers wait for the phase to complete (``wait_parity``) and then see the stage's bytes;
- an *empty* barrier per stage, expecting one arrival per consumer warp: a consumer warp
  arrives (``arrive``) once its tensor-core reads of the stage are done (after its
  ``wgmma.wait_group``), and the producer waits for that phase before refilling the stage.

Phases alternate parity: a barrier's phase n (n = 0, 1, ...) ends with its (n + 1)-th completion,
so a waiter for phase n (the n-th fill of a stage, counted from 0) waits with parity ``n & 1``.
Each barrier is 8 bytes of shared memory, addressed by its 32-bit shared address
(``primitives(False).shared_addr``); ``init`` by one thread, then ``fence_init`` and a CTA
barrier before any other thread uses it.

The consumers read the stage through the async proxy (``wgmma``), while ``cp.async`` writes it
through the generic one: after ``wait_parity`` a consumer issues ``fence.proxy.async`` before
its products (``wgmma_intrinsics().proxy_fence``).

GPU only (sm_90): the simulator has no mbarrier, and kernels built on these run on the device
(tests/test_mbarrier.py, marked gpu).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace


def u32_asm(text: str, nargs: int):
    """An intrinsic ``op(a0, ..)`` of ``nargs`` integer operands, each cast to a 32-bit register
    (``$0`` ..) of the volatile inline PTX ``text``, ordered against memory accesses (a
    ``memory`` clobber): the shape of every barrier operation here and of
    :mod:`.tma`'s ``expect_tx``."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    if nargs not in (1, 2):
        raise ValueError(f"u32_asm: nargs must be 1 or 2, got {nargs}")
    i32 = ir.IntType(32)
    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32] * nargs),
                       text, ",".join(["r"] * nargs + ["~{memory}"]), side_effect=True)

    def codegen(context, builder, sig, args):
        builder.call(asm, [context.cast(builder, a, t, types.uint32)
                           for a, t in zip(args, sig.args, strict=True)])
        return context.get_dummy_value()

    if nargs == 1:
        @intrinsic
        def op1(typingctx, a0):
            return types.void(a0), codegen

        return op1

    @intrinsic
    def op2(typingctx, a0, a1):
        return types.void(a0, a1), codegen

    return op2


@functools.cache
def mbarrier_intrinsics() -> SimpleNamespace:
    """The intrinsics, as a namespace (``addr``: a barrier's 32-bit shared address, uint32):

    - ``init(addr, count)``: the barrier expects ``count`` arrivals per phase (one thread);
    - ``fence_init()``: the inits visible to the CTA's other threads (before their first use,
      with a CTA barrier after it);
    - ``arrive(addr)``: one arrival;
    - ``cp_arrive_noinc(addr)``: one arrival, made once every ``cp.async`` the calling thread
      issued before it has completed (the arrival counts against ``init``'s count);
    - ``try_wait(addr, parity) -> uint32``: 1 once the phase of that parity has completed (the
      hardware may suspend the thread a while first), else 0;
    - ``wait_parity(addr, parity)``: ``try_wait`` until it returns 1."""
    from llvmlite import ir
    from numba import cuda, types
    from numba.cuda.extending import intrinsic

    from .primitives import _gpu_intrinsics

    U32 = types.uint32
    i32 = ir.IntType(32)
    make_void = _gpu_intrinsics().asm_void  # volatile, with a memory clobber

    @intrinsic
    def try_wait(typingctx, addr, parity):
        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], U32)
            p = context.cast(builder, args[1], sig.args[1], U32)
            asm = ir.InlineAsm(
                ir.FunctionType(i32, [i32, i32]),
                "{.reg .pred done; mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                "selp.u32 $0, 1, 0, done;}", "=r,r,r,~{memory}", side_effect=True)
            return builder.call(asm, [a, p])

        return U32(addr, parity), codegen

    @cuda.jit(device=True)
    def wait_parity(addr, parity):
        while try_wait(addr, parity) == U32(0):
            pass

    return SimpleNamespace(
        init=u32_asm("mbarrier.init.shared::cta.b64 [$0], $1;", 2),
        fence_init=make_void("fence.mbarrier_init.release.cluster;"),
        arrive=u32_asm("{.reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0];}", 1),
        cp_arrive_noinc=u32_asm("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", 1),
        try_wait=try_wait,
        wait_parity=wait_parity)


__all__ = ["mbarrier_intrinsics", "u32_asm"]
