"""The split rows' merge as a launch of its own, after a tensor-core prefill that deferred it.

The fused merge (:mod:`.fused_merge`) contracts a row's partial states in the CTA that finishes
the row's last chunk. That costs no launch, but when every CTA runs one chunk and all finish
together (a cascade's shared-prefix level: 256 chunks of 1024 keys on 264 CTAs), each 64-row
tile's merge (8 partials x 64 rows x D floats: 256 KiB at D = 128) runs on the one CTA that
finished last, while the other CTAs of that tile idle: the merges become a tail on a few SMs
(bench/NOTES.md, "Issue 13, session 9": the H200's SMs were active 53 % of that kernel's time).

With ``MmaPrefillSpec(defer_merge=True)`` the prefill kernel only writes the partial states,
and this kernel, launched after it on the same arguments (on a grid of its own, as many CTAs as
fit), spreads the reduction map's ``(list, kv head)`` pairs over every CTA: pair ``u`` merges
list ``u // Hkv`` for the G query heads of kv head ``u % Hkv`` with
:func:`~.fused_merge.build_merge_list`'s ``merge_list`` (the map's order, so the result is
bitwise reproducible, whichever CTA takes a pair). The number of lists is read from the
packed plan's header, so a CUDA graph that replays the two launches follows every re-planned
step. The launch may be a programmatic dependent one (:mod:`.dependent`,
``nbinfer.api.prefill.PREFILL_PDL``): its CTAs then start on the SMs the prefill's last CTAs
free and wait there for the prefill to complete.
"""

from __future__ import annotations

import functools

from numba import cuda, float32

from ..scheduler.layout import HEADER_FIELDS
from .common import compile_kernel
from .dependent import dependent_launch
from .fused_merge import build_merge_list

# Shared floats of a merge block: ``merge_list`` takes (4096 - 3 GP) // (G + 1) partials per
# block (819 at G 4), so a list of any length merges in one or a few blocks.
MERGE_FLOATS = 4096
MERGE_ROWS_WORD = HEADER_FIELDS.index("num_merge_rows")  # the header starts at word 0


def split_merge_spec(spec):
    """The spec the merge of ``spec`` compiles for: the merge depends on the group size, head
    dim, CTA size, dtypes (the signature) and variant (its output hook), not on the KV
    addressing, masks or tiles, so those take fixed values and every such spec shares one
    kernel."""
    return spec.on_mma_sync(page_size=1, kv_layout="NHD", sparse=True, custom_mask=False,
                            block_positions=False, value_guard=False, defer_merge=True,
                            kv_tile=32, q_shared=False, max_registers=None, stages=2,
                            kv_split=False)


@functools.cache
def build_split_merge_kernel(spec):
    """Compile (once per :func:`split_merge_spec`) the merge launch of a prefill ``spec`` with
    ``defer_merge=True``; arguments as the prefill kernels' (:func:`.prefill.prefill_signature`),
    launched with the same block on any grid. Reads ``plan`` (header, ``merge_rows``,
    ``merge_indptr``, ``merge_indices``), ``tmp_o`` and ``tmp_lse``; writes the merged rows of
    ``o`` and ``lse``."""
    from .prefill import prefill_signature

    spec = split_merge_spec(spec)
    return compile_kernel("split_merge", spec, prefill_signature(spec),
                          lambda: split_merge_source(spec), __name__)


def split_merge_source(spec):
    G = spec.group_size
    merge = build_merge_list(G, spec.head_dim, spec.num_threads, MERGE_FLOATS, spec.variant,
                             spec.q_dtype, spec.sim)
    merge_list, OUTS = merge.merge_list, merge.OUTS
    wait_for_previous = dependent_launch(spec.sim).wait

    def split_merge(q, k, v, kv_indptr, kv_indices, kv_last, plan, o, lse, tmp_o, tmp_lse,
                    counters, hkv, page_stride, kv_stride_n, kv_stride_h, q_stride_n,
                    q_stride_h, sm_scale, v_scale, work_off, cta_indptr_off, cta_work_off,
                    merge_rows_off, merge_indptr_off, merge_indices_off, item_merge_off,
                    qo_indptr_off, mask_indptr_off, mask_words_off, q_pos0_off, qo_end_off,
                    value_flags_off):
        # Launched as a dependent (PREFILL_PDL), this kernel may start while the prefill
        # before it still runs: nothing it reads, the plan included, is read before the wait.
        wait_for_previous()
        msmem = cuda.shared.array(MERGE_FLOATS, float32)
        num = cuda.local.array(OUTS, float32)
        tid = cuda.threadIdx.x
        lists = plan[MERGE_ROWS_WORD]  # as value_scan reads the batch size
        for u in range(cuda.blockIdx.x, lists * hkv, cuda.gridDim.x):
            ml = u // hkv
            merge_list(plan, tmp_o, tmp_lse, o, lse, ml, u - ml * hkv, hkv * G, tid,
                       merge_rows_off, merge_indptr_off, merge_indices_off, msmem, num)
            cuda.syncthreads()  # msmem is the next pair's

    return split_merge


__all__ = ["MERGE_FLOATS", "build_split_merge_kernel", "split_merge_source", "split_merge_spec"]
