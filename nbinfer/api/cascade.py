"""FlashInfer's ``MultiLevelCascadeAttentionWrapper``: shared-prefix levels merged exactly.

Each level is a paged prefill over the same physical pages (its own query segmentation and page
table: indices only, no KV copied). A shared prefix's tile serves every query of its segment
(rows = queries x GQA group), which is where cascade saves HBM traffic: the prefix is read once
per KV head and query tile, not once per request.

By default all levels run as **one launch** (:func:`nbinfer.scheduler.cascade_plan`): every
(level, segment) is a virtual request of one prefill plan, the levels' page tables are
concatenated, and each output row's states from every level and KV chunk are merged by the
kernel's fused merge, in level order. Where that cannot express the masks (``causal`` with a
last level of more than one row per segment, whose mask depends on positions inside the level),
or when :data:`CASCADE_LAUNCH` asks for it, the levels run one after another with
``return_lse`` and are merged by ``merge_state_in_place``; level by level, a last level of one
query row per segment (a decode step's own tokens) runs on the decode kernel.

Positions inside a level are relative to the level, so the wrapper accepts only the flags whose
result does not depend on absolute positions: ``causal`` (applied to the last level, where the
relative and absolute masks coincide), ``logits_soft_cap`` and ``sm_scale``. RoPE, ALiBi and
sliding windows across levels raise an error (the reference engine,
:func:`nbinfer.reference.multi_level_cascade_attention`, handles them).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from .. import reference
from .._checks import check_heads, check_positive_int, check_sm_scale
from ..reference.cascade import _check_levels
from ..scheduler import PlanLayout, compiled
from ..scheduler.cascade import cascade_plan
from ..scheduler.planner import check_weights
from ..variants import from_flashinfer_args
from . import arrays, binding
from .base import WrapperBase, write_reference
from .decode import MIN_CHUNK, BatchDecodeWithPagedKVCacheWrapper
from .dtypes import normalize_dtype
from .prefill import BatchPrefillWithPagedKVCacheWrapper, mma_item_overhead
from .state import merge_state_in_place
from .step import StepPlan
from .workspace import WorkspaceLayout

__all__ = ["MultiLevelCascadeAttentionWrapper"]

# How a cascade whose masks one launch can express runs. None: one launch (64 x (8192 + 256)
# tokens on the H200: 0.103 ms under graph replay, 4.5x plain decode; bench/NOTES.md, issue 13
# session 10). "levels": level by level, each prefix level on the prefill wrapper's own kernel
# (on an sm_90 GPU the lean warpgroup kernel, when its segments fill the tile) and a last level
# of one row per segment on the decode kernel, which streamed the same case's own tokens in
# 24 us where the one launch's tile spends ~51 us on them; merged by merge_state_in_place.
# Not yet timed against the one launch (bench/prefill.py's default run times both).
CASCADE_LAUNCH = None


class MultiLevelCascadeAttentionWrapper(WrapperBase):
    """Attention over KV split into shared-prefix levels.

    Parameters
    ----------
    num_levels : int
    float_workspace_buffer : array on the device that runs the kernels (partial states;
        shareable with other wrappers)
    kv_layout : {"NHD", "HND"}
    use_cuda_graph : bool
        Every plan() lays the one-launch cascade out in the same plan memory with the same
        kernel arguments, so a ``run()`` captured in a CUDA graph replays any later plan, as in
        FlashInfer. The four ``*_buf_arr`` lists (``num_levels`` int32 arrays each) are then
        required and fix the capacities: level ``l`` may have up to
        ``len(paged_kv_indptr_buf_arr[l]) - 1`` segments and ``len(paged_kv_indices_buf_arr[l])``
        pages; the first plan fixes the query rows (later plans may have fewer, as in
        FlashInfer). nbinfer reads each step's tables from its own plan memory, not from these
        buffers (it does not write them). Position-independent flags only, as always, and not
        ``causal`` with several query rows in a last-level segment (the level-by-level form).
    backend : {"auto", "cuda", "sim", "reference"}
    """

    def __init__(self, num_levels: int, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf_arr=None,
                 paged_kv_indptr_buf_arr=None, paged_kv_indices_buf_arr=None,
                 paged_kv_last_page_len_buf_arr=None, *, backend: str = "auto"):
        self._levels = check_positive_int("num_levels", num_levels)
        super().__init__(float_workspace_buffer, kv_layout, backend=backend)
        self._graph_caps = None
        if use_cuda_graph:
            self._graph_caps = self._check_graph_buffers(
                qo_indptr_buf_arr=qo_indptr_buf_arr,
                paged_kv_indptr_buf_arr=paged_kv_indptr_buf_arr,
                paged_kv_indices_buf_arr=paged_kv_indices_buf_arr,
                paged_kv_last_page_len_buf_arr=paged_kv_last_page_len_buf_arr)
        # The levels run one after another on one stream: they share the float workspace.
        self._wrappers = [_LevelWrapper(self._workspace, kv_layout, backend=self._backend)
                          for _ in range(self._levels)]
        self._fused = _FusedCascade(self._workspace, kv_layout, backend=self._backend)
        if self._graph_caps is not None:
            self._fused._graph = dict(caps=tuple(map(sum, self._graph_caps)))
        self._last_decode = None  # the last level's decode wrapper, made when first planned

    def _check_graph_buffers(self, **bufs) -> tuple[list, list]:
        """Validate use_cuda_graph's buffer lists; returns (segments, pages) per level."""
        for name, lst in bufs.items():
            if not isinstance(lst, (list, tuple)) or len(lst) != self._levels:
                raise ValueError(f"use_cuda_graph=True needs {name}: a list of num_levels="
                                 f"{self._levels} int32 arrays (fixed capacities)")
            for i, buf in enumerate(lst):
                binding.check_int32_buffer(f"{name}[{i}]", buf)
        segments = [int(b.shape[0]) - 1 for b in bufs["paged_kv_indptr_buf_arr"]]
        for i, n in enumerate(segments):
            for name, want in (("qo_indptr_buf_arr", n + 1),
                               ("paged_kv_last_page_len_buf_arr", n)):
                if int(bufs[name][i].shape[0]) < want:
                    raise ValueError(f"{name}[{i}] holds {int(bufs[name][i].shape[0])} "
                                     f"entries, paged_kv_indptr_buf_arr[{i}] asks for {want}")
            if n < 1:
                raise ValueError(f"paged_kv_indptr_buf_arr[{i}] must hold at least 2 entries")
        return segments, [int(b.shape[0]) for b in bufs["paged_kv_indices_buf_arr"]]

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._graph_caps is not None

    def plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
             paged_kv_last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, causal: bool = False, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
             fixed_split_size: int | None = None, alpha: float = 1.0,
             beta: float = 1.0) -> None:
        """One list entry per level (``num_levels`` of them): ``qo_indptr_arr[l]`` segments the
        query rows (each level a coarsening of the next), and level ``l``'s page table gives one
        entry per segment. ``causal`` masks inside the last level only.

        Schedule options of the one-launch cascade (nbinfer's, not FlashInfer's):
        ``fixed_split_size`` (KV chunk length in tokens, default: chosen from the total work)
        and the LPT cost weights ``alpha`` (per query row) and ``beta`` (per KV token), as in
        :func:`nbinfer.scheduler.plan`.
        """
        self._install(self._build, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                      paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                      causal=causal, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                      logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                      rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
                      schedule=dict(fixed_split_size=fixed_split_size, alpha=alpha, beta=beta))

    def _build(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
               paged_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
               causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
               rope_theta, q_data_type, kv_data_type, schedule):
        # Everything but the lists is the same from step to step: validated once per distinct
        # set of arguments (WrapperBase._config).
        statics = (num_qo_heads, num_kv_heads, head_dim, page_size, causal, pos_encoding_mode,
                   window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type,
                   kv_data_type, schedule["fixed_split_size"], schedule["alpha"],
                   schedule["beta"])
        cfg = self._config(statics)
        page_size, head_dim, q_dtype, kv_dtype, var = (cfg.page_size, cfg.head_dim, cfg.q_dtype,
                                                       cfg.kv_dtype, cfg.variant)
        names = ("qo_indptr_arr", "paged_kv_indptr_arr", "paged_kv_indices_arr",
                 "paged_kv_last_page_len")
        lists = (qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                 paged_kv_last_page_len)
        for name, lst in zip(names, lists, strict=True):
            if not isinstance(lst, (list, tuple)) or len(lst) != self._levels:
                got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
                raise ValueError(f"{name} must be a list of num_levels={self._levels} arrays, "
                                 f"got {got}")
        qo = [binding.frozen(arrays.host_int32(p, f"qo_indptr_arr[{i}]"))
              for i, p in enumerate(qo_indptr_arr)]
        # int32 tables in one compiled pass each once the compiled loops serve this wrapper
        # (the same checks and snapshots; any other table, and every error, goes through the
        # NumPy validator)
        check = binding.page_table_fast if self._fused._planned or compiled.loaded() else \
            binding.page_table
        tables = [check(paged_kv_indptr_arr[lvl], paged_kv_indices_arr[lvl],
                        paged_kv_last_page_len[lvl], page_size,
                        names=(f"paged_kv_indptr_arr[{lvl}]", f"paged_kv_indices_arr[{lvl}]",
                               f"paged_kv_last_page_len[{lvl}]"))[:4]
                  for lvl in range(self._levels)]
        host = [[t[i] for t in tables] for i in range(4)]  # indptrs, indices, lasts, kv_lens
        nnz = int(qo[-1][-1]) if qo[-1].size else 0
        if check is not binding.page_table_fast or not compiled.check_levels_fast(qo, host[0],
                                                                                  host[2]):
            _check_levels(nnz, qo, *host[:3])  # (the rules again, raising what is wrong)
        if CASCADE_LAUNCH not in (None, "levels"):
            raise ValueError(f"CASCADE_LAUNCH must be None or 'levels', got {CASCADE_LAUNCH!r}")
        if self._graph_caps is not None:
            for lvl, (segs, pages) in enumerate(zip(*self._graph_caps, strict=True)):
                if qo[lvl].size - 1 > segs or host[1][lvl].size > pages:
                    raise ValueError(f"level {lvl} has {qo[lvl].size - 1} segments and "
                                     f"{host[1][lvl].size} pages; its CUDA-graph buffers hold "
                                     f"{segs} and {pages}")
        rows = np.diff(qo[-1])  # query rows per last-level segment
        most = int(rows.max(initial=0))
        one_row = rows.size > 0 and most == 1 and int(rows.min()) == 1  # a decode step
        fused = self._backend != "reference" and CASCADE_LAUNCH is None and (
            not causal or most <= 1)
        if self._graph_caps is not None and not fused and self._backend != "reference":
            raise NotImplementedError("use_cuda_graph=True runs the one-launch cascade; this "
                                      "plan needs the level-by-level form (CASCADE_LAUNCH, or "
                                      "causal with several rows in a last-level segment)")
        # level by level, a last level of single rows on the decode kernel (a row sees its
        # segment's every key, causal or not)
        decode_last = not fused and self._backend != "reference" and one_row
        if fused:  # one launch; a single query row per last-level segment sees every key
            self._fused.plan_levels(qo, host, num_qo_heads, num_kv_heads, head_dim, page_size,
                                    cfg.fused, **schedule)
        for lvl, w in enumerate([] if fused or self._backend == "reference" else self._wrappers):
            if decode_last and lvl == self._levels - 1:
                if self._last_decode is None:
                    self._last_decode = BatchDecodeWithPagedKVCacheWrapper(
                        self._workspace, self._kv_layout, backend=self._backend)
                self._last_decode.plan(host[0][lvl], host[1][lvl], host[2][lvl], num_qo_heads,
                                       num_kv_heads, head_dim, page_size,
                                       logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                                       q_data_type=q_data_type, kv_data_type=kv_data_type,
                                       fixed_split_size=schedule["fixed_split_size"])
                continue
            w.plan(qo[lvl], host[0][lvl], host[1][lvl], host[2][lvl], num_qo_heads, num_kv_heads,
                   head_dim, page_size, causal=causal and lvl == self._levels - 1,
                   logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                   q_data_type=q_data_type, kv_data_type=kv_data_type,
                   fixed_split_size=schedule["fixed_split_size"])
        empty = binding.frozen(np.zeros(0, np.int32))
        lens = binding.frozen(np.zeros(0, np.int64))
        return StepPlan(len(qo[-1]) - 1, nnz, num_qo_heads, num_kv_heads, head_dim, page_size,
                        q_dtype, kv_dtype, cfg.sm_scale, var, qo[-1],
                        empty, empty, empty, lens,
                        schedule=self._fused.schedule if fused else None,
                        extra=dict(levels=tuple(qo), tables=tuple(tuple(t) for t in host[:3]),
                                   causal=causal, logits_soft_cap=logits_soft_cap, fused=fused,
                                   decode_last=decode_last))

    def _validate_statics(self, num_qo_heads, num_kv_heads, head_dim, page_size, causal,
                          pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                          rope_theta, q_data_type, kv_data_type, fixed_split_size, alpha, beta):
        """The static half of plan()'s arguments, validated (memoised per wrapper by
        :meth:`_build`): page size, head dim, dtypes, the variant, the checked ``sm_scale``, and
        ``fused``, what the one-launch wrapper's plan takes of them."""
        if pos_encoding_mode != "NONE" or window_left != -1 or rope_scale is not None or \
                rope_theta is not None:
            raise ValueError("MultiLevelCascadeAttentionWrapper supports position-independent "
                             "flags only (pos_encoding_mode='NONE', window_left=-1); positions "
                             "across levels are in nbinfer.reference.multi_level_cascade_attention")
        if fixed_split_size is not None:
            check_positive_int("fixed_split_size", fixed_split_size)
        check_weights(alpha, beta)  # also when nothing is scheduled
        page_size = check_positive_int("page_size", page_size)
        q_dtype = normalize_dtype("q_data_type", q_data_type)
        kv_dtype = normalize_dtype("kv_data_type", kv_data_type or q_data_type)
        group = check_heads(num_qo_heads, num_kv_heads)
        head_dim = check_positive_int("head_dim", head_dim)
        scale = check_sm_scale(sm_scale, head_dim)
        return SimpleNamespace(
            page_size=page_size, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
            sm_scale=scale,
            variant=_variant(causal=causal, logits_soft_cap=logits_soft_cap,
                             num_qo_heads=num_qo_heads),
            fused=(group, q_dtype, kv_dtype, scale,
                   _variant(logits_soft_cap=logits_soft_cap, num_qo_heads=num_qo_heads)))

    @property
    def one_launch(self) -> bool:
        """Whether the current plan runs all levels as one launch (else level by level)."""
        return bool(self.step_plan.extra["fused"])

    @property
    def last_level_on_decode(self) -> bool:
        """Whether the current plan runs level by level with its last level (one query row per
        segment) on the decode kernel."""
        return bool(self.step_plan.extra["decode_last"])

    @property
    def fused_wrapper(self):
        """The one-launch prefill wrapper the cascade runs (its ``step_plan`` and ``schedule``
        are the launch's)."""
        return self._fused

    def run(self, q, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False):
        """``q [nnz_qo, Hq, D]``; ``paged_kv_cache`` as in decode. Returns ``out`` (q's kind and
        dtype) and, with ``return_lse``, the LSE over all levels (natural log)."""
        step = self._slot.get()
        x = step.extra
        if self._backend == "reference":
            cache = paged_kv_cache
            cache = tuple(arrays.to_host(c) for c in cache) if isinstance(cache, (tuple, list)) \
                else arrays.to_host(cache)
            res = reference.multi_level_cascade_attention(
                arrays.to_host(q), list(x["levels"]), cache, *[list(t) for t in x["tables"]],
                causal=x["causal"], kv_layout=self._kv_layout,
                logits_soft_cap=x["logits_soft_cap"], sm_scale=step.sm_scale,
                return_lse=return_lse or lse is not None)
            return write_reference(res, out, lse, q, (step.num_qo_rows, step.num_qo_heads,
                                                      step.head_dim), step.q_dtype, return_lse)
        if x["fused"]:
            return self._fused.run(q, paged_kv_cache, out=out, lse=lse, return_lse=return_lse)
        last = self._levels - 1
        runs = [self._last_decode if x["decode_last"] and lvl == last else w
                for lvl, w in enumerate(self._wrappers)]
        o, s = runs[0].run(q, paged_kv_cache, out=out, lse=lse, return_lse=True)
        for w in runs[1:]:
            o_l, s_l = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(o, s, o_l, s_l, lse_base=math.e, backend=self._backend)
        return (o, s) if return_lse else o


@functools.lru_cache(maxsize=64)
def _cached_variant(causal, logits_soft_cap, num_qo_heads, types):
    return from_flashinfer_args(causal=causal, logits_soft_cap=logits_soft_cap,
                                num_qo_heads=num_qo_heads)


def _variant(*, causal=False, logits_soft_cap=None, num_qo_heads=None):
    """:func:`~nbinfer.variants.from_flashinfer_args` of a cascade plan's flags, built once per
    distinct set (variants are immutable; building one checks every hook: ~10 us, twice per
    serving step's plan())."""
    args = (causal, logits_soft_cap, num_qo_heads)
    try:
        return _cached_variant(*args, tuple(map(type, args)))
    except TypeError:  # unhashable: the builder names what is wrong
        return from_flashinfer_args(causal=causal, logits_soft_cap=logits_soft_cap,
                                    num_qo_heads=num_qo_heads)


class _FusedCascade(BatchPrefillWithPagedKVCacheWrapper):
    """All levels of a cascade as one paged-prefill launch (virtual requests, one merge map)."""

    _planned = False  # whether a plan was built (the compiled planner from the second on)

    _indices_name = "paged_kv_indices_arr"
    # Every row is merged from its items (cascade_plan gives each item partial rows, even in a
    # one-level cascade): the merge runs as a launch of its own.
    _all_split = True

    def plan_levels(self, qo, tables, num_qo_heads, num_kv_heads, head_dim, page_size,
                    statics, **schedule):
        """``qo``: per-level query indptrs (validated); ``tables``: ``[indptrs, indices,
        last_page_lens, kv_lens]``, one validated array per level each (binding.page_table);
        ``statics``: ``(group size, q dtype, kv dtype, sm_scale, variant)``, validated (the
        cascade wrapper's ``_validate_statics``); ``schedule``: ``fixed_split_size``, ``alpha``,
        ``beta`` for :func:`~nbinfer.scheduler.cascade_plan`."""
        self._install(self._build_levels, qo, tables, num_qo_heads, num_kv_heads, head_dim,
                      page_size, statics, **schedule)

    def _build_levels(self, qo, tables, num_qo_heads, num_kv_heads, head_dim, page_size,
                      statics, **schedule):
        group, q_dtype, kv_dtype, scale, var = statics
        kv_lens = list(tables[3])
        indptrs, offset = [], 0
        for ptr in tables[0]:
            indptrs.append(ptr[:-1] + offset)
            offset += int(ptr[-1])
        table = tuple(binding.frozen(a) for a in (
            np.append(np.concatenate(indptrs), offset).astype(np.int32),
            np.concatenate(tables[1]).astype(np.int32), np.concatenate(tables[2]).astype(np.int32)))
        nnz = int(qo[0][-1])
        batch = table[2].size
        step = StepPlan(batch, nnz, num_qo_heads, num_kv_heads, head_dim, page_size, q_dtype,
                        kv_dtype, scale, var, binding.frozen(np.array([0, nnz], np.int32)), *table,
                        binding.frozen(np.concatenate(kv_lens)), (None,) * batch)
        spec, kernel, threads, companions, num_ctas = self._kernel(step, group)
        # As decode's plan(): the NumPy planner the first time (a script that plans once never
        # loads Numba's CPU target), then the compiled loops: the same plan, a serving step's
        # cascade planned in ~20x less time (bench/NOTES.md, session 22).
        fast = self._backend != "reference" and (self._planned or compiled.loaded())
        sched, qo_start, qo_end, _ = cascade_plan(qo, kv_lens, num_qo_heads, num_kv_heads,
                                                  num_ctas, granule=MIN_CHUNK,
                                                  tile_q=spec.tile_q,
                                                  item_overhead=mma_item_overhead(spec),
                                                  compiled=fast, trusted=True, **schedule)
        self._planned = True
        layout = None if self._graph is None else self._graph_layout(
            step, spec, sched, len(qo), schedule["fixed_split_size"])
        return self._upload(step, spec, (kernel, companions), threads, sched, qo_start, qo_end,
                            layout=layout, keep=self._graph)

    # CUDA-graph mode (MultiLevelCascadeAttentionWrapper(use_cuda_graph=True)): ``caps`` =
    # (segments, pages) over all levels; the first plan adds its layout, kernel spec and rows.
    _graph = None

    def _graph_layout(self, step, spec, sched, levels: int, fixed_split_size):
        """The one layout every plan of a CUDA-graph cascade uses (fixed by the first plan),
        after checking that this plan keeps its kernel and fits it."""
        g = self._graph
        if "layout" not in g:
            segments, pages = g["caps"]
            rows = step.num_qo_rows
            # cascade_plan schedules the levels' rows as one batch of levels x rows query rows
            # (PlanLayout.bound's items and partial rows), then gives every chunk that wrote
            # its rows directly partial rows of its own: at most levels x rows more.
            b = PlanLayout.bound(sched.num_ctas, levels * rows, step.num_qo_heads,
                                 step.num_kv_heads, max_tile_q=spec.tile_q,
                                 fixed_split_size=fixed_split_size,
                                 max_kv_len=pages * step.page_size if fixed_split_size else None)
            plan = PlanLayout(b.num_ctas, b.max_work, b.max_merge_rows,
                              b.max_merge_nnz + levels * rows)
            g.update(layout=WorkspaceLayout(plan, step.num_kv_heads, step.num_qo_heads,
                                            step.head_dim, segments, pages),
                     spec=spec, rows=rows)
        if spec != g["spec"]:
            raise ValueError("a CUDA-graph cascade keeps its kernel: plan the same heads, "
                             "head_dim, page size, dtypes and logits_soft_cap as the first plan")
        if step.num_qo_rows > g["rows"]:
            raise ValueError(f"a CUDA-graph cascade plans at most the first plan's "
                             f"{g['rows']} query rows, got {step.num_qo_rows}")
        if not g["layout"].fits(sched, step.batch_size, step.kv_indices.size):
            raise ValueError(f"this cascade's schedule ({sched.num_work} items, "
                             f"{sched.num_merge_nnz} partial rows) outgrows the layout the "
                             f"first plan fixed ({g['layout'].plan}); plan the largest step "
                             f"first")
        return g["layout"]


class _LevelWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """One level of a cascade run level by level (errors name the cascade's arguments)."""

    _indices_name = "paged_kv_indices_arr"
