"""FlashInfer-compatible prefill: paged and ragged batch wrappers, and single prefill.

``plan()`` validates the batch, builds the attention variant from FlashInfer's flags, packs any
custom mask, schedules query tiles x KV chunks over the fixed grid (:mod:`nbinfer.scheduler`,
causal-aware), and copies plan, page table / KV offsets and mask into the wrapper's plan memory
in one transfer. ``run()`` binds q, the KV (strided views read in place) and the outputs and
launches the tile kernel once; split rows are merged inside it.

A custom mask is AND-ed with the flags' masks, as in the reference engine (FlashInfer ignores
``causal`` when a custom mask is given: pass ``causal=False`` for its behaviour).
"""

from __future__ import annotations

import functools

import numpy as np

from .. import reference, scheduler
from .._checks import (
    KV_LAYOUTS,
    check_choice,
    check_dim,
    check_heads,
    check_indptr,
    check_ndim,
    check_positive_int,
    check_scales,
    check_sm_scale,
)
from ..formats import segment_packbits
from ..kernels.common import ITEMSIZE, PREFILL_PLAN_SECTIONS
from ..kernels.prefill import NUM_THREADS as PREFILL_THREADS
from ..kernels.prefill import PrefillSpec, build_prefill_kernel, prefill_signature
from ..kernels.prefill_mma import (
    MmaPrefillSpec,
    build_prefill_mma_kernel,
    mma_eligible,
    mma_prefetch_allowed,
    q_in_shared_memory,
)
from ..kernels.prefill_wgmma import LEAN_MAX_REGISTERS, LEAN_STAGES, lean_eligible
from ..kernels.split_merge import build_split_merge_kernel
from ..kernels.value_scan import SCAN_CTAS_PER_SM, value_guard_kernels
from ..reference._batch import batch_masks
from ..scheduler import PlanLayout, compiled
from . import arrays, binding
from .base import WrapperBase, kv_strides, write_reference
from .decode import (
    CTAS_PER_SM,
    MIN_CHUNK,
    attention_variant,
    check_q,
    kernel_ctas,
    persistent_ctas,
    split_cache,
)
from .dtypes import normalize_dtype
from .fast_path import TorchFastPath, run_fast
from .launch import AttentionLaunch
from .step import StepPlan
from .workspace import WorkspaceLayout, item_merge_lists

# The tensor-core kernel needs up to 255 registers x 128 threads: two CTAs fit an SM's 64 Ki.
MMA_CTAS_PER_SM = 2
# The deferred merge's CTAs per SM at most (kernels/split_merge.py: 96 registers x 128 threads,
# 16 KiB of shared memory; the occupancy calculator decides how many fit).
MERGE_CTAS_PER_SM = 8
# Under a register cap (``max_registers``, e.g. 168 with Q in shared memory) up to three; the
# occupancy calculator decides how many actually fit.
MMA_CTAS_PER_SM_CAPPED = 3
# The tensor-core kernel's tiles (:class:`MmaPrefillSpec`'s ``kv_tile``, ``q_shared`` and
# ``max_registers``, 0 meaning no cap): 64-key tiles, measured faster than 32 on the H200 at
# head_dim 128 (4-11 %) and 64 (12-22 %) in fp16 and bf16 (bench/NOTES.md, "Issue 13, session
# 9"). A value other than None overrides the rule (tests and bench/prefill.py --kv-tiles).
MMA_KV_TILE = None
MMA_Q_SHARED = None
MMA_MAX_REGISTERS = None
MMA_STAGES = None  # KV stages in shared memory (None: 2)
# Split rows merged by a launch of their own after the kernel (kernels/split_merge.py) instead
# of the fused merge. None: the rule, deferred for the one-launch cascade (every row is split
# there: its shared-prefix level alone 103 -> 68 us on the H200) and fused elsewhere (a launch
# more for plans that split few rows; prefill B4 L4096 within 2 %), bench/NOTES.md "Issue 13,
# session 10".
MMA_DEFER_MERGE = None
# The one-launch cascade's kernel when nothing above overrides it: most of its items are short
# (a request's own pages, 4 live rows of 64) and wait on memory, so it takes the kernel that
# fits three CTAs per SM (32-key tiles, Q in shared memory, 168 registers) and merges in a
# launch of its own: 101.9 against 105.9 us under graph replay at 64 requests x (8192 + 256)
# tokens (4.52x against 4.35x plain decode; bench/results/issue13/session10/call4). At head_dim
# 64 the stage keeps its bytes: 64 keys (mma_tiles).
CASCADE_TILES = dict(kv_tile=32, q_shared=True, max_registers=168, defer_merge=True)
# LPT's cost of an item's start and end on the tensor-core kernel, in KV tokens (the planner's
# ``item_overhead``): None is four KV tiles (256 tokens at 64-key tiles, 128 at the cascade's
# 32). A 256-key own-level item of a cascade (4 live rows) runs about as long as 7 tiles of a
# full one, which the byte model calls 4: with 64-key tiles the cascade went 117 -> 105 us with
# it (128 to 512 tokens alike); with 32-key tiles 128 tokens measured best (101.9 us against
# 105.8 at 256).
MMA_ITEM_OVERHEAD = None
# The tensor-core kernel's per-item overlap (MmaPrefillSpec's ``prefetch`` on mma.sync: the next
# work item's plan entries read and its first KV tile requested during this item's last tile),
# where its tiles allow it (Q in shared memory, two stages, the merge deferred, no kv_split).
# None: off, until measured (bench/prefill.py's ``p`` token without ``l``); True: on where
# allowed; False: off.
MMA_PREFETCH = None
# Warps per CTA (16 packed rows each; None: 4 on the GPU, 2 in the simulator). 8 warps share
# each KV tile between 128 rows: half the copies per warp, one CTA per SM (registers). Needs
# 64-key tiles or Q in shared memory (128 Q rows do not fit the 32-key stage they would alias).
MMA_WARPS = None
# Hopper's warpgroup MMA (sm_90 only; the row tile's plans: not the one-launch cascade, not
# kv_split). None, the rule: the lean warpgroup kernel (kernels/prefill_wgmma.py: causal or no
# mask, no hooks, no custom mask) for the plans it computes whose queries fill its 128-row
# tile (at least LEAN_MIN_ROWS packed rows per request on average: a prefill, not a decode
# step) when no tile knob above is set, mma.sync for the rest: B4 L4096 H32 D128 fp16 causal
# 207.3 against 186.0 TFLOP/s, non-causal 278.4 against 225.5 (bench/NOTES.md, "Issue 13,
# session 17", call 4). True: the warpgroup products for every row-tile plan (the lean kernel where
# MMA_WGMMA_LEAN allows it, else the tensor-core kernel's warpgroup form: slower than
# mma.sync, session 16); False: never.
MMA_WGMMA = None
# With MMA_WGMMA True: None / True take the lean kernel where the plan allows it, False always
# the tensor-core kernel's warpgroup form (bench/prefill.py's ``g`` and ``gl`` tokens).
MMA_WGMMA_LEAN = None
LEAN_MIN_ROWS = 64
# The lean kernel's per-item overlap (MmaPrefillSpec's ``prefetch``: Q by cp.async, the next
# work item's first KV tile and Q requested during the last tile, unrolled stores). None: off,
# until it is measured against the form above (bench/prefill.py's ``glp`` token).
LEAN_PREFETCH = None
# The lean kernel's lazy rescale (MmaPrefillSpec's ``lazy_rescale``: the online softmax's 64
# rescales per tile only when a row's maximum grows by more than 2^8). None: off, until timed
# (bench/prefill.py's ``glz`` token).
LEAN_LAZY_RESCALE = None
# The deferred merge of split rows as a programmatic dependent launch (kernels/dependent.py):
# its CTAs start on the SMs the prefill's last CTAs free and wait there for it to complete,
# so its launch gap and start hide under the prefill's tail. The one-launch cascade 64 x
# (8192 + 256), H100, two alternated rounds: 90.5 / 89.5 -> 88.9 / 88.7 us under graph replay,
# 118.6 / 116.3 -> 114.4 / 114.0 us per call (bench/NOTES.md, session 29). None: on sm_90 and
# newer (griddepcontrol is Hopper's), True / False: always / never on the CUDA backend.
PREFILL_PDL = None
# The lean kernel's S = Q K^T ahead of the ring's refill (MmaPrefillSpec's ``qk_ahead``): on an
# H100, +1.5-4.8 % at 8 of req 1's 10 prefill rows, -0.8 % (D 64 causal) and -0.2 % (L 1024
# non-causal) at the other two (bench/NOTES.md, session 29; bench/prefill.py's ``q`` token).
LEAN_QK_AHEAD = True
# The lean kernel's K and V tiles in the 128-byte swizzled layout (MmaPrefillSpec's
# ``swizzle``; GPU only): every copy of eight threads one whole 128-byte line. Standalone, the
# same change took session 16's tile from 248 to 437 TFLOP/s causal and 283 to 475 non-causal
# at B4 L4096 D128 on an H100 (bench/NOTES.md, session 30; bench/prefill.py's ``y`` token).
LEAN_SWIZZLE = True
# The tensor-core kernels' work in L2 order (scheduler.plan's ``l2_section_kv``): LPT takes the
# (request, kv head) pairs in sections of about this many MiB of KV, so the items running at
# once read ~2 sections' KV (B4 L4096 H32 causal: ~32 MiB at 16, against 190 MiB for plain
# LPT, whose first items span all 128 pairs; the CTAs' loads as balanced, by the cost model:
# bench/NOTES.md, session 22). Timed in session 23 (H100, three rounds, bench/prefill.py's
# ``o`` token): the lean kernel +6.9-7.9 % causal, +4.0-4.9 % non-causal at 16 MiB, 32 MiB no
# better. None: plain LPT.
PREFILL_L2_SECTION_MIB = 16
# Items of at most 16 packed rows split each KV tile's keys over the warps (MmaPrefillSpec's
# ``kv_split``): off unless set. Measured slower than the row tile for the cascade's own items
# and for tensor-core decode at 64 x 4096, faster only for long items with few requests
# (bench/NOTES.md, "Issue 13, session 11").
MMA_KV_SPLIT = None


def mma_tiles(head_dim: int, *, all_split: bool = False) -> dict:
    """The tensor-core kernel's options for ``head_dim`` (tiles, stages, register cap, where
    split rows merge; see :data:`MMA_KV_TILE`): keyword arguments of :class:`MmaPrefillSpec`.
    ``all_split``: every output row is merged from several items (the one-launch cascade),
    which takes :data:`CASCADE_TILES`: its tile shape as a whole unless any of ``MMA_KV_TILE``,
    ``MMA_Q_SHARED``, ``MMA_MAX_REGISTERS`` is set (a measured shape, not a mix of two), its
    deferred merge unless ``MMA_DEFER_MERGE`` is; ``kv_split`` only when :data:`MMA_KV_SPLIT`
    sets it."""
    shape = dict(kv_tile=MMA_KV_TILE, q_shared=MMA_Q_SHARED, max_registers=MMA_MAX_REGISTERS)
    rule = dict(kv_tile=64, q_shared=False, max_registers=0)
    if all_split and all(v is None for v in shape.values()):
        rule = {k: CASCADE_TILES[k] for k in rule}
        # CASCADE_TILES' stage was measured at head_dim 128 (32 keys, 16 KiB of K and V); the
        # same bytes per stage at 64 are 64 keys: 5-12 % faster from 912 to 16384 shared tokens
        # (H100, 64 requests; bench/results/issue12/session25/, one_launch_kv64)
        rule["kv_tile"] = max(rule["kv_tile"], rule["kv_tile"] * 128 // head_dim)
    opts = {k: rule[k] if v is None else v for k, v in shape.items()}
    defer = all_split and CASCADE_TILES["defer_merge"] if MMA_DEFER_MERGE is None \
        else bool(MMA_DEFER_MERGE)
    stages = MMA_STAGES or 2
    prefetch = bool(MMA_PREFETCH) and mma_prefetch_allowed(
        q_in_shared_memory(opts["q_shared"], int(opts["kv_tile"])), stages, defer,
        kv_split=bool(MMA_KV_SPLIT))
    return dict(kv_tile=int(opts["kv_tile"]), q_shared=bool(opts["q_shared"]),
                max_registers=opts["max_registers"] or None, stages=stages,
                defer_merge=defer, kv_split=bool(MMA_KV_SPLIT), prefetch=prefetch)


def wgmma_choice(sim: bool, split: bool, lean_ok: bool, rows: float) -> tuple[bool, bool]:
    """``(wgmma, lean)`` for a tensor-core plan (:data:`MMA_WGMMA`): ``split`` (the one-launch
    cascade, kv_split items) stays on mma.sync; ``lean_ok``: the lean kernel computes the plan
    (:func:`~nbinfer.kernels.prefill_wgmma.lean_eligible`); ``rows``: packed query rows per
    request on average. Only on an sm_90 GPU; in the simulator, asked for by ``MMA_WGMMA =
    True``, the lean kernel's form over the ``mma.sync`` twins (the rule leaves the simulator's
    plans on two-warp ``mma.sync``: a lean CTA is 256 simulated threads)."""
    if split or MMA_WGMMA is False:
        return False, False
    # The lean kernel's shape is 8 warps: a forced warp count other than that (MMA_WARPS)
    # asks for the tensor-core kernel's warpgroup form.
    lean = lean_ok and MMA_WGMMA_LEAN is not False and MMA_WARPS in (None, 8)
    if sim:
        return (True, True) if MMA_WGMMA and lean else (False, False)
    if MMA_WGMMA is None:
        knobs = (MMA_KV_TILE, MMA_Q_SHARED, MMA_MAX_REGISTERS, MMA_STAGES, MMA_DEFER_MERGE,
                 MMA_WARPS, MMA_KV_SPLIT)
        if not (lean and rows >= LEAN_MIN_ROWS) or any(k is not None for k in knobs):
            return False, False
    from numba import cuda

    if cuda.get_current_device().compute_capability[0] != 9:
        return False, False
    return True, lean


def dependent_merge() -> bool:
    """Whether the merge of split rows is a programmatic dependent launch
    (:data:`PREFILL_PDL`; by default on a GPU of compute capability 9.0 or newer)."""
    if PREFILL_PDL is not None:
        return bool(PREFILL_PDL)
    from numba import cuda

    return tuple(cuda.get_current_device().compute_capability) >= (9, 0)


def mma_item_overhead(spec) -> int:
    """The planner's ``item_overhead`` for ``spec``'s kernel: :data:`MMA_ITEM_OVERHEAD`, by
    default four KV tiles on the tensor-core kernel, 0 (the byte model) on the CUDA-core one."""
    if not isinstance(spec, MmaPrefillSpec):
        return 0
    return 4 * spec.kv_tile if MMA_ITEM_OVERHEAD is None else int(MMA_ITEM_OVERHEAD)


def l2_section_kv(spec) -> int | None:
    """The planner's ``l2_section_kv`` for ``spec``'s kernel: :data:`PREFILL_L2_SECTION_MIB`
    of KV (K and V rows of ``head_dim`` elements) in tokens, on the tensor-core kernels; None
    (plain LPT) when the knob is off or on the CUDA-core kernel."""
    if not PREFILL_L2_SECTION_MIB or not isinstance(spec, MmaPrefillSpec):
        return None
    token_bytes = 2 * spec.head_dim * ITEMSIZE[spec.kv_dtype]
    return max(1, int(PREFILL_L2_SECTION_MIB * 2**20) // token_bytes)


__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "single_prefill_with_kv_cache"]


class PrefillWrapperBase(WrapperBase):
    """What the paged, ragged, block-sparse and cascade wrappers share: the step plan of a
    prefill, its kernel, its upload, and run()."""

    _sparse = True
    _indices_name = "paged_kv_indices"  # the plan() argument the page ids came from
    # Whether plan() prepares the torch fast path of run() (the paged cache's run() takes it).
    _torch_fast_path = False

    def _make_step(self, qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim, page_size,
                   table, *, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                   window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
                   kv_data_type, fixed_split_size, variant, masks=None, q_pos0=None,
                   extra=None) -> StepPlan:
        # ``masks`` (per-request bool masks, already validated) and ``q_pos0`` (BSR query
        # positions) come from BlockSparseAttentionWrapper.
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim", head_dim)
        if fixed_split_size is not None:
            check_positive_int("fixed_split_size", fixed_split_size)
        qo_indptr = binding.frozen(check_indptr("qo_indptr", arrays.host_int32(qo_indptr,
                                                                                "qo_indptr")))
        batch = qo_indptr.size - 1
        if kv_lens.size != batch:
            raise ValueError(f"the KV index arrays describe {kv_lens.size} requests, qo_indptr "
                             f"{batch}")
        qo_lens = np.diff(qo_indptr)
        if masks is None:
            masks = batch_masks(arrays.host_mask(custom_mask),
                                arrays.host_mask(packed_custom_mask), None, qo_lens, kv_lens)
        var = attention_variant(num_qo_heads, variant, causal=causal, window_left=window_left,
                                logits_soft_cap=logits_soft_cap,
                                pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                rope_theta=rope_theta)
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type, kv=True)
        masks = tuple(None if m is None else binding.frozen(m) for m in masks)  # snapshots
        step = StepPlan(batch, int(qo_indptr[-1]), num_qo_heads, num_kv_heads, head_dim,
                        page_size, q_dtype, kv_dtype, check_sm_scale(sm_scale, head_dim), var,
                        qo_indptr, *table, binding.frozen(kv_lens), masks,
                        None if q_pos0 is None else binding.frozen(q_pos0), extra=extra or {})
        if self._backend == "reference":
            return step
        spec, kernel, threads, companions, num_ctas = self._kernel(step, group)
        sched = scheduler.plan(step.qo_indptr, step.kv_lens, num_qo_heads, num_kv_heads,
                               num_ctas, granule=MIN_CHUNK, causal=causal,
                               fixed_split_size=fixed_split_size, tile_q=spec.tile_q,
                               item_overhead=mma_item_overhead(spec),
                               l2_section_kv=l2_section_kv(spec))
        return self._upload(step, spec, (kernel, companions), threads, sched, step.qo_indptr,
                            np.ascontiguousarray(step.qo_indptr[1:]))

    # Whether every output row of this wrapper's plans is split (the one-launch cascade).
    _all_split = False

    def _kernel(self, step, group):
        """The kernel for the planned problem: ``(spec, compiled, threads, companions, grid
        CTAs)`` (companions as :func:`_compiled` returns them)."""
        spec, most = self._spec(step, group)
        # The spec fixes the kernel and ``most`` its grid on this wrapper's device: found once
        # (on the GPU the grid is an occupancy query and two Numba device lookups, tens of us
        # of a serving step's plan() on a slow host; the kernel lookups hash the spec thrice).
        memo = self.__dict__.setdefault("_kernel_memo", {})
        found = memo.get((spec, most))
        if found is None:
            kernel, threads, companions = _compiled(spec)
            # as many CTAs per SM as are resident at once (the CUDA-core kernel's 168
            # registers: three), at most ``most``
            found = (kernel, threads, companions,
                     kernel_ctas(self._backend, kernel, threads, most))
            if len(memo) >= 32:
                memo.clear()
            memo[(spec, most)] = found
        return (spec, *found)

    def _spec(self, step, group):
        """``(spec, most CTAs per SM)`` of the kernel for the planned problem: the rule alone,
        compiling nothing (``bench/prebuild_cache.py`` asks it as the GPU backend would)."""
        sim = self._backend == "sim"
        args = (step.head_dim, group, step.page_size, step.kv_dtype, step.q_dtype,
                self._kv_layout, step.variant)
        flags = dict(sparse=self._sparse, custom_mask=step.custom_mask,
                     block_positions=step.q_pos0 is not None, sim=sim)
        if mma_eligible(step.head_dim, step.q_dtype, step.kv_dtype):
            # Tensor cores; two warps in the simulator (every simulated thread is an OS thread).
            tiles = mma_tiles(step.head_dim, all_split=self._all_split)
            wg, lean = wgmma_choice(
                sim, self._all_split or tiles["kv_split"],
                lean_eligible(step.variant, step.custom_mask, step.q_pos0 is not None),
                step.num_qo_rows * group / max(step.batch_size, 1))
            if wg:  # (the warpgroup form has no prefetch; the lean kernel its own below)
                tiles.update(kv_tile=64, q_shared=True, wgmma=True, prefetch=False)
            if lean:
                # its fixed shape; a register cap set by MMA_MAX_REGISTERS still applies
                tiles.update(lean=True, stages=LEAN_STAGES, defer_merge=True,
                             max_registers=tiles["max_registers"] or LEAN_MAX_REGISTERS,
                             prefetch=bool(LEAN_PREFETCH),
                             lazy_rescale=bool(LEAN_LAZY_RESCALE),
                             qk_ahead=bool(LEAN_QK_AHEAD),
                             swizzle=bool(LEAN_SWIZZLE) and not sim)
            warps = MMA_WARPS or (8 if wg else 2 if sim else 4)
            spec = MmaPrefillSpec(*args, **flags, num_warps=warps, **tiles)
            most = MMA_CTAS_PER_SM_CAPPED if spec.max_registers else MMA_CTAS_PER_SM
        else:
            spec, most = PrefillSpec(*args, **flags), CTAS_PER_SM
        return spec, most

    def _upload(self, step, spec, kernels, threads, sched, qo_start, qo_end, *, layout=None,
                keep=None) -> StepPlan:
        """Lay out the plan memory for ``sched`` and copy plan, page table, query ranges
        (``qo_start`` [B] or the indptr, ``qo_end`` [B]) and masks there. ``layout``: a fixed
        layout that holds the plan (CUDA-graph mode; default the plan's own); ``keep``: a dict
        whose ``"launch"`` is made once and reused by every later plan (CUDA-graph mode: a
        captured graph keeps the kernel arguments, and the scratch its fast path writes)."""
        mask_ptr, words = _packed_mask_words(step.masks, step.batch_size) if step.custom_mask \
            else (None, None)
        table = step.page_table
        if layout is None:
            layout = WorkspaceLayout(PlanLayout.for_plan(sched), step.num_kv_heads,
                                     step.num_qo_heads, step.head_dim, step.batch_size,
                                     table[1].size, 0 if words is None else words.size)
        launch = None if keep is None else keep.get("launch")
        if launch is not None:
            launch.bind(layout, step.sm_scale)
        else:
            kernel, (before, after) = kernels
            if before:  # the value scan runs on a grid of its own
                scan_grid = persistent_ctas(self._backend, SCAN_CTAS_PER_SM)
                before = tuple((k, scan_grid) for k in before)
            # the guarded twin runs the main kernel's items: its grid
            grids = [None] * len(after)
            if getattr(spec, "defer_merge", False):
                # The merge launch (last) takes one (list, kv head) pair per CTA: as many CTAs
                # as fit, so that a cascade's 512 pairs run in one round instead of two on the
                # main kernel's 396 CTAs.
                grids[-1] = _merge_grid(self._backend, after[-1], threads)
            # the merge (last) as a programmatic dependent launch (PREFILL_PDL)
            dep = self._backend == "cuda" and getattr(spec, "defer_merge", False) and \
                dependent_merge()
            pdl = [dep and i == len(after) - 1 for i in range(len(after))]
            launch = AttentionLaunch(spec, self._workspace, layout, self._backend,
                                     sched.num_ctas, step.sm_scale, self._memory,
                                     kernel=(kernel, prefill_signature(spec),
                                             PREFILL_PLAN_SECTIONS),
                                     num_threads=threads, before=before,
                                     after=tuple(zip(after, grids, pdl, strict=True)))
            if keep is not None:
                keep["launch"] = launch
        staged = layout.stage(sched, item_merge_lists(sched), table, qo_indptr=qo_start,
                              mask_indptr=mask_ptr, mask_words=words, q_pos0=step.q_pos0,
                              qo_end=qo_end, compiled=compiled.loaded())
        launch.upload(staged, table, self._stream())
        fast = launch.fast
        if fast is not None:  # (a kept launch: its fast path follows the new plan)
            fast.update(step.num_qo_rows, step.num_qo_heads, step.head_dim,
                        int(table[1].max()) + 1 if table[1].size else 0)
        elif (self._torch_fast_path and self._backend == "cuda"
                and arrays.array_kind(self._workspace) == "torch"):
            # The paged cache's run() for torch tensors that match the plan: a few comparisons
            # and a prepared launch, like decode's.
            fast = TorchFastPath(step, launch, self._kv_layout, self._workspace.device,
                                 rows=step.num_qo_rows, indices=table[1])
        # (``step`` is validated and snapshotted: its fields as they are, without the frozen
        # __init__ that dataclasses.replace would run again)
        return StepPlan._trusted(**{**step.__dict__, "schedule": sched, "spec": spec,
                                    "launch": launch, "fast": fast})

    def with_schedule(self, schedule, qo_start=None, qo_end=None) -> None:
        """Run the current plan's problem on ``schedule`` instead of the planner's (same
        requests, heads and kernel; any CTA assignment and chunking the kernels accept): for
        tests and lessons that study the fused merge under a chosen CTA order. ``qo_start`` /
        ``qo_end``: the query rows of each request (default: from the plan's ``qo_indptr``)."""
        step = self.step_plan
        if step.launch is None:
            raise ValueError("with_schedule needs a kernel backend ('cuda' or 'sim')")
        qo_start = step.qo_indptr if qo_start is None else np.asarray(qo_start, np.int32)
        qo_end = step.qo_indptr[1:] if qo_end is None else np.asarray(qo_end, np.int32)
        kernel, threads, companions = _compiled(step.spec)
        self._install(self._upload, step, step.spec, (kernel, companions), threads, schedule,
                      qo_start, np.ascontiguousarray(qo_end))

    def _check_q(self, step, q):
        check_q("q", q, (step.num_qo_rows, step.num_qo_heads, step.head_dim),
                ("qo_indptr[-1]", "num_qo_heads", "head_dim"), step.q_dtype)

    def _run_paged(self, q, paged_kv_cache, out, lse, return_lse, reference_fn, scales):
        """run() over a paged cache: ``scales`` as :func:`~nbinfer._checks.check_scales`
        returns them; ``reference_fn(step, q, (k, v), want_lse, sm_scale)`` on host float64."""
        step = self._slot.get()
        qk_scale, v_scale = scales
        if step.launch is not None:
            step.launch.scale(qk_scale, v_scale)
        res = run_fast(step, q, paged_kv_cache, out, lse, return_lse)
        if res is not None:
            return res
        self._check_q(step, q)
        k_cache, v_cache, _ = split_cache(paged_kv_cache, self._kv_layout, step,
                                          self._indices_name)
        binding.same_device(q=q, paged_kv_cache=k_cache, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            kv = (arrays.kv_values(k_cache, step.kv_dtype),
                  arrays.kv_values(v_cache, step.kv_dtype, v_scale))
            res = reference_fn(step, arrays.to_host(q), kv, return_lse or lse is not None,
                               step.sm_scale * qk_scale)
            return write_reference(res, out, lse, q, (step.num_qo_rows, step.num_qo_heads,
                                                      step.head_dim), step.q_dtype, return_lse)
        names = ("paged_kv_cache", "paged_kv_cache") if not isinstance(
            paged_kv_cache, (tuple, list)) else ("k_cache", "v_cache")
        return self._launch(step, q, (k_cache, v_cache), names,
                            kv_strides(self._kv_layout, paged=True), out, lse, return_lse)


class BatchPrefillWithPagedKVCacheWrapper(PrefillWrapperBase):
    """Prefill (or append) attention of a ragged batch of queries over a paged KV cache.

    Parameters
    ----------
    float_workspace_buffer : array on the device that runs the kernels (partial states;
        shareable with other wrappers)
    kv_layout : {"NHD", "HND"}
    backend : {"auto", "cuda", "sim", "reference"}
    """

    _torch_fast_path = True

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, *,
             custom_mask=None, packed_custom_mask=None, causal: bool = False,
             pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, fixed_split_size: int | None = None,
             variant=None) -> None:
        """``qo_indptr [B+1]``: query rows of each request; the page table as in decode;
        ``custom_mask`` (bool, concatenated row-major ``[qo_len, kv_len]`` per request, any
        array kind) or ``packed_custom_mask`` (``segment_packbits``, little bit order)."""
        self._install(self._build, qo_indptr, paged_kv_indptr, paged_kv_indices,
                      paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
                      custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                      causal=causal, pos_encoding_mode=pos_encoding_mode,
                      window_left=window_left, logits_soft_cap=logits_soft_cap,
                      sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                      q_data_type=q_data_type, kv_data_type=kv_data_type,
                      fixed_split_size=fixed_split_size, variant=variant)

    def _build(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
               num_qo_heads, num_kv_heads, head_dim_qk, page_size, **flags):
        page_size = check_positive_int("page_size", page_size)
        indptr, indices, last, kv_lens = binding.page_table(
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
            names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        return self._make_step(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk,
                               page_size, (indptr, indices, last), **flags)

    def run(self, q, paged_kv_cache, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out=None, lse=None,
            return_lse: bool = False):
        """``q [qo_indptr[-1], Hq, D]``; ``paged_kv_cache`` and the scales as in decode's
        run(). Returns ``out`` (q's kind and dtype) and, with ``return_lse``,
        ``lse [nnz_qo, Hq]`` (natural log)."""
        def ref(step, q, cache, want_lse, sm_scale):
            return reference.batch_prefill_with_paged_kv_cache(
                q, step.qo_indptr, cache, *step.page_table, custom_mask=step.flat_mask(),
                kv_layout=self._kv_layout, variant=step.variant, sm_scale=sm_scale,
                return_lse=want_lse)

        return self._run_paged(q, paged_kv_cache, out, lse, return_lse, ref,
                               check_scales(q_scale, k_scale, v_scale))


class BatchPrefillWithRaggedKVCacheWrapper(PrefillWrapperBase):
    """Prefill attention of a ragged batch over ragged (contiguous per request) K and V."""

    _sparse = False

    def plan(self, qo_indptr, kv_indptr, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, *, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE", window_left: int = -1,
             logits_soft_cap: float | None = None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             q_data_type="float16", kv_data_type=None, fixed_split_size: int | None = None,
             variant=None) -> None:
        """``qo_indptr [B+1]`` and ``kv_indptr [B+1]``: rows and keys of each request."""
        self._install(self._build, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                      head_dim_qk, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                      causal=causal, pos_encoding_mode=pos_encoding_mode,
                      window_left=window_left, logits_soft_cap=logits_soft_cap,
                      sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                      q_data_type=q_data_type, kv_data_type=kv_data_type,
                      fixed_split_size=fixed_split_size, variant=variant)

    def _build(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, **flags):
        kv_ptr = binding.frozen(check_indptr("kv_indptr", arrays.host_int32(kv_indptr,
                                                                             "kv_indptr")))
        kv_lens = np.diff(kv_ptr).astype(np.int64)
        empty = binding.frozen(np.zeros(0, np.int32))
        return self._make_step(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, head_dim_qk, 1,
                               (kv_ptr, empty, empty), **flags)

    def run(self, q, k, v, *, q_scale: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, out=None, lse=None, return_lse: bool = False):
        """``k, v``: NHD ``[nnz_kv, Hkv, D]`` or HND ``[Hkv, nnz_kv, D]`` (views with a
        contiguous last dimension are read in place); the scales as in decode's run()."""
        step = self._slot.get()
        qk_scale, v_scale = check_scales(q_scale, k_scale, v_scale)
        self._check_q(step, q)
        nnz_kv = int(step.kv_indptr[-1])
        Hkv, D = step.num_kv_heads, step.head_dim
        want = (nnz_kv, Hkv, D) if self._kv_layout == "NHD" else (Hkv, nnz_kv, D)
        check_kv(k, v, want, f"{self._kv_layout} layout, planned", step.kv_dtype)
        binding.same_device(q=q, k=k, v=v, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            res = reference.batch_prefill_with_ragged_kv_cache(
                arrays.to_host(q), arrays.kv_values(k, step.kv_dtype),
                arrays.kv_values(v, step.kv_dtype, v_scale), step.qo_indptr, step.kv_indptr,
                custom_mask=step.flat_mask(), kv_layout=self._kv_layout, variant=step.variant,
                sm_scale=step.sm_scale * qk_scale, return_lse=return_lse or lse is not None)
            return write_reference(res, out, lse, q, (step.num_qo_rows, step.num_qo_heads, D),
                                   step.q_dtype, return_lse)
        step.launch.scale(qk_scale, v_scale)
        return self._launch(step, q, (k, v), ("k", "v"), kv_strides(self._kv_layout, False),
                            out, lse, return_lse)


def check_kv(k, v, want, what, kv_dtype):
    """Require ragged ``k`` and ``v`` of shape ``want`` and the planned dtype."""
    for name, a in (("k", k), ("v", v)):
        arrays.array_kind(a, name)
        check_ndim(name, a, 3)
        for axis, n in enumerate(want):
            check_dim(name, a, axis, n, what)
        arrays.check_kv_dtype(name, a, kv_dtype)


def single_prefill_with_kv_cache(q, k, v, scale_q: float | None = None,
                                 scale_k: float | None = None, scale_v: float | None = None, *,
                                 custom_mask=None, packed_custom_mask=None,
                                 causal: bool = False, kv_layout: str = "NHD",
                                 pos_encoding_mode: str = "NONE", window_left: int = -1,
                                 logits_soft_cap: float | None = None,
                                 sm_scale: float | None = None, rope_scale: float | None = None,
                                 rope_theta: float | None = None, return_lse: bool = False,
                                 kv_data_type=None, backend: str = "auto"):
    """Prefill attention of one request: ``q [qo_len, Hq, D]``, ``k, v [kv_len, Hkv, D]`` (NHD)
    or ``[Hkv, kv_len, D]`` (HND). ``custom_mask``: bool ``[qo_len, kv_len]`` (or flattened);
    ``packed_custom_mask``: its ``packbits`` (little bit order). The workspace is allocated here
    (of q's kind).

    FP8 K and V: torch ``float8_e4m3fn`` / ``float8_e5m2`` tensors, or ``uint8`` codes with
    ``kv_data_type`` naming their format; ``scale_q``, ``scale_k``, ``scale_v`` (FlashInfer's
    names here; scalars, None meaning 1) as decode's ``q_scale``, ``k_scale``, ``v_scale``."""
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    scales = dict(q_scale=scale_q, k_scale=scale_k, v_scale=scale_v)
    check_scales(*scales.values())
    arrays.array_kind(q, "q")
    check_ndim("q", q, 3)
    q_dtype = arrays.storage_dtype(q, "q")
    for name, a in (("k", k), ("v", v)):
        arrays.array_kind(a, name)
        check_ndim(name, a, 3)
    kv_dtype = arrays.single_kv_dtype(k, v, kv_data_type)
    kv_len = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    hkv = k.shape[1] if kv_layout == "NHD" else k.shape[0]
    if custom_mask is not None and len(getattr(custom_mask, "shape", ())) == 2:
        mask_shape = (q.shape[0], kv_len)
        if tuple(custom_mask.shape) != mask_shape:
            raise ValueError(f"custom_mask must have shape [qo_len, kv_len] = {mask_shape} (or "
                             f"be flattened), got {tuple(custom_mask.shape)}")
        custom_mask = custom_mask.reshape(-1)
    be = arrays.resolve_backend(backend)
    size = 64 << 20
    while True:
        ws = binding.workspace_like(q, size, be)
        w = BatchPrefillWithRaggedKVCacheWrapper(ws, kv_layout, backend=be)
        try:
            w.plan(np.array([0, q.shape[0]]), np.array([0, kv_len]), q.shape[1], hkv, q.shape[2],
                   custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
                   pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                   logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                   rope_theta=rope_theta, q_data_type=q_dtype, kv_data_type=kv_dtype)
            break
        except ValueError as exc:
            if "float_workspace_buffer holds" not in str(exc) or size > (1 << 34):
                raise
            size *= 4
    return w.run(q, k, v, **scales, return_lse=return_lse)


@functools.cache
def _merge_grid(backend, kernel, threads) -> int:
    """The merge launch's grid (one occupancy query per compiled merge kernel, not per plan;
    the grid only spreads the merge's pairs, any size is correct)."""
    return kernel_ctas(backend, kernel, threads, MERGE_CTAS_PER_SM)


def _compiled(spec):
    """``(compiled kernel, threads per CTA, (kernels before, kernels after))`` of a prefill spec
    (tensor-core or CUDA-core); the kernels around it are a masked tensor-core spec's exact
    non-finite path (:mod:`nbinfer.kernels.value_scan`) and, with ``defer_merge``, the merge of
    split rows (:mod:`nbinfer.kernels.split_merge`)."""
    if isinstance(spec, MmaPrefillSpec):
        before, after = value_guard_kernels(spec)
        if spec.defer_merge:  # after the guarded twin, which rewrites its items' partials
            after = (*after, build_split_merge_kernel(spec))
        return build_prefill_mma_kernel(spec), spec.num_threads, (before, after)
    return build_prefill_kernel(spec), PREFILL_THREADS, ((), ())


def _packed_mask_words(masks, batch):
    """Each request's mask packed separately (little bit order), as int32 words, and the byte
    offset of each request's segment (FlashInfer's mask_indptr)."""
    flat = np.concatenate([m.ravel() for m in masks]) if batch else np.zeros(0, bool)
    sizes = np.array([m.size for m in masks], dtype=np.int64)
    indptr = np.zeros(batch + 1, dtype=np.int64)
    np.cumsum(sizes, out=indptr[1:])
    packed, byte_ptr = segment_packbits(flat, indptr, bitorder="little")
    padded = np.zeros(-(-max(packed.size, 1) // 4) * 4, dtype=np.uint8)
    padded[:packed.size] = packed
    return np.asarray(byte_ptr, dtype=np.int32), padded.view("<i4").astype(np.int32)
