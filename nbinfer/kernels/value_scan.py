"""The value scan: which (request, kv head) has a non-finite value in its V, for the tensor-core
prefill's exact masked path.

nbinfer's non-finite rule says the masks alone decide which keys a row reads: a NaN or inf in the
V row of a key that a row does *not* keep must not reach that row. The tensor-core kernel
multiplies a whole 32-key tile of P by V in one ``mma``, where an unkept key's ``P = 0`` meets
its ``V = NaN`` and ``0 * NaN`` is NaN; every guard written inside its loop cost 12-54 % of
causal throughput (bench/NOTES.md). So a spec with a mask (a mask hook or a custom mask) runs as
three launches that share one argument block and grid:

1. this scan, on a grid of its own: each (request, kv head) pair's KV range (the loading rule of
   the kernel: paged or affine, any strides) in ``VALUE_SCAN_SPLITS`` parts, a part per CTA,
   read in 16-byte loads; ``value_flags[(b * Hkv + hk) * S + part]`` is 1 if any V element of
   the part is NaN or infinite (exponent bits all ones), else 0. It reads V once per kv head
   (for causal B4 L4096 Hkv8 D128 fp16, 33.5 MB: ~10 us at HBM speed against a ~4 ms
   prefill), far less than the prefill, which reads it once per query tile;
2. the fast tensor-core kernel, unchanged, over every work item;
3. its guarded twin (``MmaPrefillSpec(value_guard=True)``), which skips every item whose pair
   is not flagged and recomputes the flagged ones exactly, overwriting their outputs (and
   re-running their fused merge; the fast kernel leaves the counters at zero).

With finite values everywhere, steps 1 and 3 cost a scan and an empty launch.
"""

from __future__ import annotations

import functools

from numba import cuda, types

from ..scheduler.layout import HEADER_FIELDS
from ..variants import standard
from .common import (
    ITEMSIZE,
    PREFILL_PLAN_SECTIONS,
    VALUE_SCAN_SPLITS,
    compile_kernel,
    guards_masked_values,
)
from .hooks import device_hooks
from .loading import loading_module
from .primitives import device_jit, primitives

U32 = types.uint32
BATCH_WORD = HEADER_FIELDS.index("batch_size")  # the packed plan's header starts at word 0
# The scan's own fixed grid: it holds no shared memory and few registers, so many CTAs per SM
# keep enough 16-byte loads in flight to stream V near HBM speed.
SCAN_CTAS_PER_SM = 16


def scan_spec(spec):
    """The spec the scan of ``spec`` compiles for: only the addressing, page size, V dtype,
    head dim and CTA size matter, so every variant and group size shares one scan kernel."""
    return spec.on_mma_sync(variant=standard(), group_size=1, custom_mask=False,
                            block_positions=False, value_guard=False)


@functools.cache
def build_value_scan_kernel(spec):
    """Compile (once per :func:`scan_spec`) the scan; arguments as the prefill kernels'
    (:func:`.prefill.build_prefill_kernel`), launched with the same block on any fixed grid. It
    reads ``v``, the page table, the strides, ``plan`` (the batch size in the packed header)
    and writes ``plan[value_flags + (b * Hkv + hk) * VALUE_SCAN_SPLITS + part]``."""
    from .prefill import prefill_signature

    spec = scan_spec(spec)
    return compile_kernel("value_scan", spec, prefill_signature(spec),
                          lambda: value_scan_source(spec))


def value_guard_kernels(spec) -> tuple[tuple, tuple]:
    """``(before, after)``: the kernels a prefill launch of ``spec`` runs around its own, sharing
    its arguments and grid. For a tensor-core spec with a mask hook or a custom mask: the scan
    before and the guarded twin after; otherwise none."""
    from .prefill_mma import MmaPrefillSpec, build_prefill_mma_kernel

    if not isinstance(spec, MmaPrefillSpec) or spec.value_guard or \
            not guards_masked_values(device_hooks(spec.variant, spec.sim), spec.custom_mask):
        return (), ()
    # the twin cleans V in shared memory row by row: on mma.sync's padded rows
    # (the lean kernel's twin drops its register cap too: 8 warps of mma.sync need more)
    twin = spec.on_mma_sync(value_guard=True,
                            max_registers=None if spec.lean else spec.max_registers)
    return (build_value_scan_kernel(spec),), (build_prefill_mma_kernel(twin),)


def value_scan_source(spec):
    sim = spec.sim
    load16 = primitives(sim).load16
    loader = loading_module(spec.sparse, spec.page_size, sim)
    request_kv_len, request_base = loader.request_kv_len, loader.request_base
    token_offset = loader.token_offset
    NT = spec.num_threads
    S = VALUE_SCAN_SPLITS
    CH = 16 // ITEMSIZE[spec.kv_dtype]  # elements per 16-byte load
    CHUNKS = spec.head_dim // CH  # loads per token row (rows start 16-byte aligned)
    # Exponent bits all ones: inf or NaN. fp16 and bf16 hold two elements per 32-bit word.
    TWO = spec.kv_dtype != "float32"
    EXP = U32({"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000}[spec.kv_dtype])
    EXP_HI = U32(int(EXP) << 16) if TWO else EXP
    if len(PREFILL_PLAN_SECTIONS) != 13 or PREFILL_PLAN_SECTIONS[-1] != "value_flags":
        raise RuntimeError("value_scan takes the prefill plan sections in their order")
    jit_dev = device_jit(sim)

    @jit_dev
    def word_bad(w):
        return (w & EXP) == EXP or (w & EXP_HI) == EXP_HI

    def value_scan(q, k, v, kv_indptr, kv_indices, kv_last, plan, o, lse, tmp_o, tmp_lse,
                   counters, hkv, page_stride, kv_stride_n, kv_stride_h, q_stride_n,
                   q_stride_h, sm_scale, v_scale, work_off, cta_indptr_off, cta_work_off,
                   merge_rows_off, merge_indptr_off, merge_indices_off, item_merge_off,
                   qo_indptr_off, mask_indptr_off, mask_words_off, q_pos0_off, qo_end_off,
                   value_flags_off):
        tid = cuda.threadIdx.x
        units = plan[BATCH_WORD] * hkv * S
        # Unit u: part u % S of pair u // S = b * Hkv + hk, tokens [kv_len s / S, kv_len (s+1) / S).
        for u in range(cuda.blockIdx.x, units, cuda.gridDim.x):
            pair = u // S
            part = u - pair * S
            b = pair // hkv
            hk = pair - b * hkv
            kv_len = request_kv_len(kv_indptr, kv_last, b)
            t0 = kv_len * part // S
            ib, row_stride, head_off = request_base(kv_indptr, b, hk, kv_stride_n, kv_stride_h)
            bad = 0
            # Consecutive threads take consecutive 16-byte pieces of a token row: coalesced,
            # every byte of the part read once.
            for e in range(tid, (kv_len * (part + 1) // S - t0) * CHUNKS, NT):
                t = e // CHUNKS
                off = token_offset(kv_indices, ib, U32(t0 + t), row_stride, head_off,
                                   page_stride) + (e - t * CHUNKS) * CH
                w0, w1, w2, w3 = load16(v, off)
                if word_bad(w0) or word_bad(w1) or word_bad(w2) or word_bad(w3):
                    bad = 1
            bad = cuda.syncthreads_or(bad)
            if tid == 0:
                plan[value_flags_off + u] = 1 if bad else 0

    return value_scan


__all__ = ["BATCH_WORD", "SCAN_CTAS_PER_SM", "build_value_scan_kernel", "scan_spec",
           "value_guard_kernels", "value_scan_source"]
