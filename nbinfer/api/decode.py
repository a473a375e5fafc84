"""FlashInfer-compatible batch decode: ``BatchDecodeWithPagedKVCacheWrapper``.

``plan()`` runs on the CPU once per generation step: it validates the page table, splits long
requests into KV chunks so that every SM has work, and builds the work list and the merge map
into a :class:`~nbinfer.api.step.StepPlan`. ``run()`` launches the decode kernel (split rows
merged inside it) and is called once per layer with the same plan.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from .. import reference, scheduler
from .._checks import (
    check_dim,
    check_heads,
    check_ndim,
    check_positive_int,
    check_scales,
    check_sm_scale,
)
from ..kernels.decode import NUM_THREADS, DecodeSpec, build_decode_kernel
from ..kernels.decode_mma import mma_decode_supported
from ..scheduler import PlanLayout, compiled
from ..variants import compose, from_flashinfer_args
from ..variants import resolve as resolve_variant
from . import arrays, binding
from .base import WrapperBase, kv_strides, write_reference
from .dtypes import normalize_dtype
from .fast_path import TorchFastPath
from .launch import AttentionLaunch, TableReader
from .step import DeferredStepPlan, StepPlan
from .workspace import WorkspaceLayout, item_merge_lists

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "MIN_CHUNK", "kernel_ctas", "persistent_ctas",
           "split_cache"]

# A chunk shorter than this costs more in merge traffic than it gains in parallelism; chunk
# boundaries are multiples of it (the scheduler's granule).
MIN_CHUNK = 256
CTAS_PER_SM = 4
DECODE_STAGES = None  # the KV ring's depth per warp (None: DecodeSpec's default, 2)
DECODE_PAGE_GROUPS = None  # DecodeSpec.page_groups (None: its default, on)
# DecodeSpec.max_registers (None: its default, 128 = four CTAs per SM; 0: no cap). A bench knob.
DECODE_MAX_REGISTERS = None
# DecodeSpec.mma (q.k and p.v on tensor cores) where kernels.decode_mma supports the spec. None
# (default): for FP8 caches only, where it measured 1.2-1.4x faster than CUDA cores on the H200
# (1.6-1.8x an fp16 cache; bench/NOTES.md, issue 13, session 13); 16-bit caches measured the
# same either way. True: wherever supported; False: never. Batch decode only (the wrappers);
# single_decode_with_kv_cache stays on CUDA cores.
DECODE_MMA = None


def _use_mma(head_dim, group, kv_dtype, q_dtype, variant) -> bool:
    """DECODE_MMA's rule (above) for one decode configuration."""
    wanted = kv_dtype.startswith("float8") if DECODE_MMA is None else bool(DECODE_MMA)
    return wanted and mma_decode_supported(head_dim, group, kv_dtype, q_dtype, variant)


def persistent_ctas(backend: str, per_sm: int = 0) -> int:
    """The fixed grid: ``per_sm`` resident CTAs per SM (default four 128-thread decode CTAs, which
    the register cap allows); two in the simulator, where every CTA is a set of OS threads."""
    if backend != "cuda":
        return 2
    from numba import cuda

    return cuda.get_current_device().MULTIPROCESSOR_COUNT * (per_sm or CTAS_PER_SM)


def kernel_ctas(backend: str, kernel, threads: int, most: int | None = None) -> int:
    """The persistent grid of a compiled ``kernel`` of ``threads`` threads per CTA: as many CTAs
    per SM as an SM holds at once (its registers and shared memory decide, through the driver's
    occupancy calculator), at most ``most`` (default :data:`CTAS_PER_SM`, read at the call);
    :func:`persistent_ctas` in the simulator. A grid
    larger than what is resident would run its last CTAs as a second wave after the others'
    queues, twice as long for them."""
    if backend != "cuda":
        return persistent_ctas(backend)
    most = CTAS_PER_SM if most is None else most
    return persistent_ctas(backend, max(1, min(most, kernel.resident_ctas(threads))))


def attention_variant(num_qo_heads, variant, **flags):
    """The variant FlashInfer's flags describe, composed with a user ``variant`` (a Variant, a
    built-in name or None)."""
    var = from_flashinfer_args(num_qo_heads=num_qo_heads, **flags)
    extra = resolve_variant(variant)
    return var if extra is None else compose(var, extra)


_TABLE_NAMES = ("indptr", "indices", "last_page_len")


class BatchDecodeWithPagedKVCacheWrapper(WrapperBase):
    """Batch decode attention over a paged KV cache, with FlashInfer's plan/run interface.

    Parameters
    ----------
    float_workspace_buffer : array (uint8 or any dtype), on the device that runs the kernels
        Scratch for partial states of split requests (FlashInfer suggests 128 MiB); any number
        of wrappers may share one (each keeps its plan in memory of its own).
    kv_layout : {"NHD", "HND"}
    use_cuda_graph : bool
        Fixed buffers for the page table (the ``paged_kv_*_buffer`` arguments) and a fixed
        workspace layout, so that a captured ``run()`` replays correctly after any ``plan()``.
    use_tensor_cores : bool
        Run each step as a prefill of one query row per request
        (:class:`~nbinfer.api.prefill.BatchPrefillWithPagedKVCacheWrapper`): for fp16/bf16 and
        head_dim 64 or 128 the tensor-core kernel, which puts a GQA group's heads in the rows
        of one MMA tile; otherwise the CUDA-core prefill kernel. Same results as the decode
        kernel within the tolerance of the dtype; plan() takes the prefill's host time.
    backend : {"auto", "cuda", "sim", "reference"}
        ``"auto"``: the simulator when active, else the GPU, else the reference engine.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, *, backend: str = "auto"):
        super().__init__(float_workspace_buffer, kv_layout, backend=backend)
        self._tensor_cores = None
        if use_tensor_cores:
            if use_cuda_graph:
                raise NotImplementedError("use_tensor_cores=True with use_cuda_graph=True: the "
                                          "prefill wrapper it runs on has no CUDA-graph mode")
            from .prefill import BatchPrefillWithPagedKVCacheWrapper

            # A decode step is a prefill of one query row per request: the tensor-core kernel
            # packs a GQA group's heads into the rows of one MMA tile, so each K/V tile is
            # loaded once for the group (FlashInfer's use_tensor_cores). One plan slot.
            self._tensor_cores = BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, kv_layout, backend=self._backend)
            self._tensor_cores._slot = self._slot
        buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                 "paged_kv_last_page_len_buffer")
        if use_cuda_graph and any(b is None for b in buffers):
            raise ValueError("use_cuda_graph=True needs paged_kv_indptr_buffer, "
                             "paged_kv_indices_buffer and paged_kv_last_page_len_buffer (fixed "
                             "addresses the captured kernel reads every step)")
        if use_cuda_graph:
            for name, buf in zip(names, buffers, strict=True):
                binding.check_int32_buffer(name, buf)
        self._graph_buffers = buffers if use_cuda_graph else None
        self._graph_layout = None
        # Per-wrapper memos of what stays the same between steps: validated static arguments,
        # one prepared launch per kernel spec (rebound to each step's layout), workspace
        # layouts, decode's qo_indptr per batch size (the grid is the config's: it follows the
        # kernel's registers).
        self._configs, self._launches, self._layouts, self._aranges = {}, {}, {}, {}
        self._planned = False
        self._table_reader = TableReader()  # page tables given as CUDA tensors
        self._device_index = arrays.torch_device_index(self._workspace)
        self._workspace_bytes = binding.nbytes(self._workspace)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph_buffers is not None

    # ------------------------------------------------------------------------------------------
    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, *, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
             fixed_split_size: int | None = None, variant=None) -> None:
        """Validate the page table and build the work list for this step (CPU only).

        ``indptr [B+1]``, ``indices [>= indptr[-1]]`` (only the first ``indptr[-1]`` are read),
        ``last_page_len [B]``: the page table as in FlashInfer, any integer dtype (range-checked
        before narrowing to int32) and array kind; ``variant`` is an extra
        :class:`~nbinfer.variants.Variant` (or a built-in name) composed after the one the
        keyword flags describe. ``fixed_split_size`` cuts every request's KV into chunks of
        exactly that many tokens, so a request's output bits do not depend on the rest of the
        batch (batch invariance).

        The work list comes from :func:`nbinfer.scheduler.plan` (LPT over a fixed persistent
        grid; from a wrapper's second plan() on, its compiled twin
        :func:`nbinfer.scheduler.compiled.plan_compiled`, which gives the same plan in a
        fraction of the host time); it is copied into the wrapper's plan memory with the page
        table in one asynchronous transfer on the current stream, and serves every run() until
        the next plan(). A failed plan() leaves no plan: run() raises until plan() succeeds.
        """
        if self._tensor_cores is not None:
            self._plan_tensor_cores(indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                                    head_dim, page_size, pos_encoding_mode=pos_encoding_mode,
                                    window_left=window_left, logits_soft_cap=logits_soft_cap,
                                    sm_scale=sm_scale, rope_scale=rope_scale,
                                    rope_theta=rope_theta, q_data_type=q_data_type,
                                    kv_data_type=kv_data_type, fixed_split_size=fixed_split_size,
                                    variant=variant)
            return
        self._install(self._build, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                      head_dim, page_size, pos_encoding_mode=pos_encoding_mode,
                      window_left=window_left, logits_soft_cap=logits_soft_cap,
                      sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                      q_data_type=q_data_type, kv_data_type=kv_data_type,
                      fixed_split_size=fixed_split_size, variant=variant)

    def _plan_tensor_cores(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                           head_dim, page_size, **flags) -> None:
        """plan() with ``use_tensor_cores``: the page table checked under decode's argument
        names, then the paged prefill's plan of one query row per request (its query at the
        request's last position, as in decode)."""
        try:
            page_size = check_positive_int("page_size", page_size)
            table = binding.page_table(indptr, indices, last_page_len, page_size)
        except BaseException as exc:
            self._slot.fail(exc)
            raise
        qo_indptr = np.arange(table[0].size, dtype=np.int32)
        self._tensor_cores.plan(qo_indptr, *table[:3], num_qo_heads, num_kv_heads, head_dim,
                                page_size, causal=False, **flags)

    def _build(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
               page_size, *, pos_encoding_mode, window_left, logits_soft_cap, sm_scale,
               rope_scale, rope_theta, q_data_type, kv_data_type, fixed_split_size, variant):
        # Everything but the page table is the same from step to step: validated once per
        # distinct set of arguments (keyed with their types, so 128 and 128.0 differ).
        statics = (num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
                   window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
                   kv_data_type, fixed_split_size, variant)
        cfg = self._config(statics)
        # A wrapper's first plan() uses the NumPy planner; later ones the compiled loops, which
        # cost Numba's CPU start-up (~0.3-0.6 s) once per process (compiled.load's docstring).
        fast = self._planned or compiled.loaded()
        sched, packed, guess, speculate = None, False, None, None
        # The prepared launch of (spec, heads), found once per config (heads are statics):
        # no tuple of the spec hashed per step.
        launch = cfg.launch
        if fast and self._backend != "reference":
            # the page-table check and the schedule in one compiled call
            compiled.load()
            raw = (indptr, indices, last_page_len)
            if self._backend == "cuda" and TableReader.accepts(raw, self._device_index):
                table = self._table_reader.read(raw, self._stream())
            else:
                table = binding.host_tables(*raw)
            qo_indptr = self._qo_arange(max(table[0].size - 1, 0))
            # Consecutive steps mostly keep their layout: the same call packs the step into
            # the staging buffer for the last step's layout, used if this step keeps it.
            guess = launch.last_layout if launch is not None else None
            if guess is not None:
                speculate = (launch.staging(guess.words["end"]),
                             *guess.pack_args(num_qo_heads, num_kv_heads, cfg.granule,
                                              fixed_split_size))
            indptr, indices, last, kv_lens, min_pages, sched, packed = \
                compiled.check_and_plan(*table, cfg.page_size, _TABLE_NAMES, qo_indptr,
                                        num_qo_heads, num_kv_heads, self._grid(cfg),
                                        granule=cfg.granule, fixed_split_size=fixed_split_size,
                                        speculate=speculate)
        elif fast:
            compiled.load()
            indptr, indices, last, kv_lens, min_pages = binding.page_table_fast(
                indptr, indices, last_page_len, cfg.page_size)
        else:
            indptr, indices, last, kv_lens = binding.page_table(indptr, indices, last_page_len,
                                                                cfg.page_size)
            min_pages = int(indices.max()) + 1 if indices.size else 0
        batch = indptr.size - 1
        qo_indptr = self._qo_arange(batch)
        fields = dict(batch_size=batch, num_qo_rows=batch, num_qo_heads=num_qo_heads,
                      num_kv_heads=num_kv_heads, head_dim=cfg.head_dim, page_size=cfg.page_size,
                      q_dtype=cfg.q_dtype, kv_dtype=cfg.kv_dtype, sm_scale=cfg.sm_scale,
                      variant=cfg.variant, qo_indptr=qo_indptr, kv_indptr=indptr,
                      kv_indices=indices, kv_last_page_len=last, kv_lens=kv_lens)
        if self._backend == "reference":
            return StepPlan(**fields)
        item_merge = None
        if sched is None and fast:  # (the compiled path scheduled with the check)
            sched, item_merge = compiled.plan_compiled(
                qo_indptr, kv_lens, num_qo_heads, num_kv_heads, self._grid(cfg),
                granule=cfg.granule, fixed_split_size=fixed_split_size)
        elif sched is None:
            sched = scheduler.plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads,
                                   self._grid(cfg), granule=cfg.granule,
                                   fixed_split_size=fixed_split_size)
            item_merge = item_merge_lists(sched)
        layout = self._layout_for(sched, batch, indices.size, num_qo_heads, num_kv_heads,
                                  cfg.head_dim, cfg.page_size, fixed_split_size)
        if launch is None:
            # The spec fixes the group size, not the head counts, which the fast path's shape
            # checks and strides depend on: one prepared launch per (spec, heads).
            launch_key = (cfg.spec, num_qo_heads, num_kv_heads)
            launch = self._launches.get(launch_key)
            if launch is None:
                launch = AttentionLaunch(cfg.spec, self._workspace, layout, self._backend,
                                         self._grid(cfg), cfg.sm_scale, self._memory,
                                         self._graph_buffers)
                self._launches[launch_key] = launch
            cfg.launch = launch
        launch.bind(layout, cfg.sm_scale)
        table = (indptr, indices, last)
        if packed and (layout is guess or layout == guess):  # (an exact layout is not memoised)
            staged = speculate[0]  # packed there by check_and_plan
        else:
            if item_merge is None:  # a PendingPlan: this step needs its arrays
                sched, item_merge = sched.get()
            staged = layout.stage(sched, item_merge, None if self._graph_buffers else table,
                                  out=launch.staging(layout.words["end"]), compiled=fast)
        if self._graph_buffers is None and fast:
            launch.last_layout = layout
        launch.upload(staged, table, self._stream())
        torch_fast = launch.fast
        if torch_fast is not None:
            torch_fast.update(batch, num_qo_heads, cfg.head_dim, min_pages)
        elif self._backend == "cuda" and arrays.array_kind(self._workspace) == "torch":
            torch_fast = TorchFastPath(SimpleNamespace(**fields), launch, self._kv_layout,
                                       self._workspace.device)
        if self._graph_buffers is not None:
            self._graph_layout = layout
        self._planned = True
        step = DeferredStepPlan if isinstance(sched, compiled.PendingPlan) else StepPlan
        return step._trusted(**fields, schedule=sched, spec=cfg.spec, launch=launch,
                             fast=torch_fast)

    def _qo_arange(self, batch: int) -> np.ndarray:
        """Decode's ``qo_indptr``: ``0..batch`` (int32, read-only, one per batch size)."""
        qo_indptr = self._aranges.get(batch)
        if qo_indptr is None:
            qo_indptr = self._aranges.setdefault(
                batch, binding.frozen(np.arange(batch + 1, dtype=np.int32)))
        return qo_indptr

    def _validate_statics(self, num_qo_heads, num_kv_heads, head_dim, page_size,
                          pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                          rope_theta, q_data_type, kv_data_type, fixed_split_size, variant):
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim", head_dim)
        page_size = check_positive_int("page_size", page_size)
        if fixed_split_size is not None:
            check_positive_int("fixed_split_size", fixed_split_size)
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type, kv=True)
        sm_scale = check_sm_scale(sm_scale, head_dim)
        var = attention_variant(num_qo_heads, variant, window_left=window_left,
                                logits_soft_cap=logits_soft_cap,
                                pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
                                rope_theta=rope_theta)
        spec = granule = None
        if self._backend != "reference":
            spec = DecodeSpec(head_dim=head_dim, group_size=group, page_size=page_size,
                              kv_dtype=kv_dtype, q_dtype=q_dtype, kv_layout=self._kv_layout,
                              variant=var, sparse=True, sim=self._backend == "sim",
                              stages=DECODE_STAGES or 2,
                              page_groups=DECODE_PAGE_GROUPS is None or bool(DECODE_PAGE_GROUPS),
                              mma=_use_mma(head_dim, group, kv_dtype, q_dtype, var),
                              **({} if DECODE_MAX_REGISTERS is None
                                 else {"max_registers": DECODE_MAX_REGISTERS or None}))
            granule = max(MIN_CHUNK, spec.tokens_per_group * 4)
        return SimpleNamespace(head_dim=head_dim, page_size=page_size, q_dtype=q_dtype,
                               kv_dtype=kv_dtype, sm_scale=sm_scale, variant=var, spec=spec,
                               granule=granule, num_ctas=None, launch=None)

    def _grid(self, cfg) -> int:
        """The config's persistent grid. It follows the kernel's occupancy (its registers and
        shared memory), so on the GPU the kernel is compiled (or loaded) here: asked for only
        once a schedule needs it, so a first plan() with a bad page table raises before any
        compile."""
        if cfg.num_ctas is None:
            cfg.num_ctas = kernel_ctas(self._backend, self._backend == "cuda" and
                                       build_decode_kernel(cfg.spec), NUM_THREADS)
        return cfg.num_ctas

    def _layout_for(self, sched, batch, pages, hq, hkv, d, page_size, fixed_split_size):
        """The plan's own layout, or in CUDA-graph mode one fixed layout for every step."""
        if self._graph_buffers is None:
            # Capacities rounded up to powers of two: consecutive steps of a generation share a
            # layout, so the prepared launch needs no rebinding (unless the rounded partial
            # states would not fit the workspace: then the exact layout).
            counts = (sched.num_ctas, hq, hkv, d, sched.num_work, sched.num_merge_rows,
                      sched.num_merge_nnz, batch, pages)
            layout = self._layouts.get(counts)  # this exact step seen before
            if layout is not None:
                return layout
            key = (*counts[:4], *map(_pow2, counts[4:]))
            layout = self._layouts.get(key)
            if layout is None:
                layout = WorkspaceLayout(PlanLayout(sched.num_ctas, *key[4:7]), hkv, hq, d,
                                         *key[7:])
                if layout.nbytes > self._workspace_bytes:
                    return WorkspaceLayout(PlanLayout.for_plan(sched), hkv, hq, d, batch, pages)
                if len(self._layouts) >= 256:
                    self._layouts.clear()
                self._layouts[key] = layout
            self._layouts[counts] = layout
            return layout
        layout = self._graph_layout
        if layout is None:  # fixed by the first plan() that succeeds (_build sets it)
            max_batch = int(self._graph_buffers[2].shape[0])
            max_pages = int(self._graph_buffers[1].shape[0])
            # With fixed chunks the item count grows with the KV: bound it by the page buffer.
            max_kv = max_pages * page_size if fixed_split_size else None
            plan_layout = PlanLayout.bound(sched.num_ctas, max_batch, hq, hkv, max_kv_len=max_kv,
                                           fixed_split_size=fixed_split_size)
            layout = WorkspaceLayout(plan_layout, hkv, hq, d, max_batch, max_pages)
        if (layout.num_kv_heads, layout.num_qo_heads, layout.head_dim) != (hkv, hq, d):
            raise ValueError("a CUDA-graph wrapper keeps its head counts and head_dim: planned "
                             f"{(hq, hkv, d)}, first plan had "
                             f"{(layout.num_qo_heads, layout.num_kv_heads, layout.head_dim)}")
        if sched.num_ctas != layout.plan.num_ctas:
            raise ValueError("a CUDA-graph wrapper keeps its kernel's grid: this plan's kernel "
                             f"runs {sched.num_ctas} CTAs, the first plan's "
                             f"{layout.plan.num_ctas} (plan the same variant and dtypes)")
        if not layout.fits(sched, batch, pages):
            raise ValueError(f"this step does not fit the CUDA-graph buffers: batch {batch} "
                             f"(max {layout.max_batch}), {pages} pages (max {layout.max_pages})")
        return layout

    # ------------------------------------------------------------------------------------------
    def run(self, q, paged_kv_cache, *, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out=None, lse=None,
            return_lse: bool = False):
        """Decode attention for the planned batch.

        Parameters
        ----------
        q : array [batch_size, num_qo_heads, head_dim], dtype ``q_data_type``; a strided view
            (contiguous last dimension) is read in place.
        paged_kv_cache : array ``[num_pages, 2, page_size, Hkv, D]`` (NHD) /
            ``[num_pages, 2, Hkv, page_size, D]`` (HND), or a ``(k_cache, v_cache)`` pair of
            ``[num_pages, page_size, Hkv, D]`` / ``[num_pages, Hkv, page_size, D]``; views with a
            contiguous last dimension and 16-byte strides are read in place. An FP8 plan
            (``kv_data_type`` ``float8_e4m3fn`` / ``float8_e5m2``) reads torch FP8 tensors or
            ``uint8`` arrays of the codes.
        q_scale, k_scale, v_scale : float, optional
            FlashInfer's scales of a quantised q / cache (None: 1): attention over
            ``q * q_scale``, ``k * k_scale``, ``v * v_scale`` (the logits' ``sm_scale`` times
            ``q_scale * k_scale``, the output times ``v_scale``; the cache is not rescaled).
            Read at launch: a captured CUDA graph keeps the scales of its capture.
        out, lse : optional outputs ([B, Hq, D] in q's dtype, [B, Hq] float32), C-contiguous,
            writable, on q's device: the result is written into them.
        return_lse : bool

        Returns
        -------
        out [B, Hq, D] of q's kind and dtype, and ``lse [B, Hq]`` float32 (natural log) if
        ``return_lse``.
        """
        if self._tensor_cores is not None:
            return self._tensor_cores.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale,
                                          v_scale=v_scale, out=out, lse=lse,
                                          return_lse=return_lse)
        step = self._slot.get()
        L = step.launch
        # check_scales inlined for the common call (a batch-1 run() is host-bound)
        if q_scale is None and k_scale is None and v_scale is None:
            qk_scale = v_scale = 1.0
            if L is not None and not L.unit_scales:
                L.scale(1.0, 1.0)
        else:
            qk_scale, v_scale = check_scales(q_scale, k_scale, v_scale)
            if L is not None:
                L.scale(qk_scale, v_scale)
        fast = step.fast
        if fast is not None:  # torch tensors matching the plan: a few comparisons
            res = fast(q, paged_kv_cache, out, lse, return_lse)
            if res is not None:
                return res if return_lse else res[0]
        B, Hq, D = step.batch_size, step.num_qo_heads, step.head_dim
        check_q("q", q, (B, Hq, D), ("batch_size planned", "num_qo_heads", "head_dim"),
                step.q_dtype)
        k_cache, v_cache, _ = split_cache(paged_kv_cache, self._kv_layout, step)
        binding.same_device(q=q, paged_kv_cache=k_cache, float_workspace_buffer=self._workspace)
        if self._backend == "reference":
            kv = (arrays.kv_values(k_cache, step.kv_dtype),
                  arrays.kv_values(v_cache, step.kv_dtype, v_scale))
            res = reference.batch_decode_with_paged_kv_cache(
                arrays.to_host(q), kv, *step.page_table, kv_layout=self._kv_layout,
                variant=step.variant, sm_scale=step.sm_scale * qk_scale,
                return_lse=return_lse or lse is not None)
            return write_reference(res, out, lse, q, (B, Hq, D), step.q_dtype, return_lse)
        names = ("paged_kv_cache", "paged_kv_cache") if not isinstance(
            paged_kv_cache, (tuple, list)) else ("k_cache", "v_cache")
        return self._launch(step, q, (k_cache, v_cache), names,
                            kv_strides(self._kv_layout, paged=True), out, lse, return_lse)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def check_q(name, q, shape, what, dtype):
    """Require ``q`` of ``shape`` (``what`` names each axis) and the planned dtype."""
    check_ndim(name, q, len(shape))
    for axis, n in enumerate(shape):
        check_dim(name, q, axis, n, what[axis])
    if arrays.storage_dtype(q, name) != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (planned q_data_type), "
                        f"got {arrays.storage_dtype(q, name)}")


def split_cache(paged_kv_cache, layout, step, indices_name="indices"):
    """Validate a paged cache against the plan; return ``(k, v, combined)`` 4-D K and V views.
    Every page id of the plan must lie in the cache."""
    PS, Hkv, D, kv_dtype = step.page_size, step.num_kv_heads, step.head_dim, step.kv_dtype
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache tuple must be (k_cache, v_cache), "
                             f"got {len(paged_kv_cache)} items")
        k, v = paged_kv_cache
        for name, a in (("k_cache", k), ("v_cache", v)):
            arrays.array_kind(a, name)
            check_ndim(name, a, 4)
            _check_page_dims(name, a, 1, layout, PS, Hkv, D, kv_dtype)
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k.shape)} vs "
                             f"{tuple(v.shape)}")
        out = (k, v, False)
    else:
        arrays.array_kind(paged_kv_cache, "paged_kv_cache")
        check_ndim("paged_kv_cache", paged_kv_cache, 5)
        check_dim("paged_kv_cache", paged_kv_cache, 1, 2, "K and V")
        _check_page_dims("paged_kv_cache", paged_kv_cache, 2, layout, PS, Hkv, D, kv_dtype)
        out = (paged_kv_cache[:, 0], paged_kv_cache[:, 1], True)
    num_pages = int(out[0].shape[0])
    indices = step.kv_indices
    if indices.size and int(indices.max()) >= num_pages:
        raise ValueError(f"{indices_name} values must lie in [0, {num_pages}) (pages in "
                         f"paged_kv_cache), got {int(indices.max())}")
    return out


def _check_page_dims(name, a, first, layout, page_size, num_kv_heads, head_dim, kv_dtype):
    ps_axis, h_axis = (first, first + 1) if layout == "NHD" else (first + 1, first)
    check_dim(name, a, ps_axis, page_size, "page_size planned")
    check_dim(name, a, h_axis, num_kv_heads, "num_kv_heads")
    check_dim(name, a, first + 2, head_dim, "head_dim")
    arrays.check_kv_dtype(name, a, kv_dtype)
