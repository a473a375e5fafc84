"""What every plan/run wrapper shares: the workspace, the plan slot, the launch of a step.

A wrapper is built on one float workspace (scratch for partial states, shareable between
wrappers), owns its plan memory (:class:`~nbinfer.api.launch.PlanMemory`) and holds at most one
:class:`~nbinfer.api.step.StepPlan`, installed only when ``plan()`` succeeds.
"""

from __future__ import annotations

import numpy as np

from .._checks import KV_LAYOUTS, check_choice
from ..kernels.common import ARG
from . import arrays, binding
from .launch import PlanMemory
from .step import PlanSlot, StepPlan

__all__ = ["WrapperBase", "kv_strides", "write_reference"]


class WrapperBase:
    """The shared state of a plan/run wrapper (see the module docstring)."""

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD", *, backend: str = "auto"):
        check_choice("kv_layout", kv_layout, KV_LAYOUTS)
        self._backend = arrays.resolve_backend(backend)
        self._workspace = binding.check_workspace(float_workspace_buffer, self._backend)
        self._kv_layout = kv_layout
        self._slot = PlanSlot()
        self._memory = PlanMemory(self._backend)
        # the current stream of the workspace's device, in one C call for torch (plan() asks
        # for it every step)
        self._stream = arrays.stream_getter(self._workspace)
        self._configs: dict = {}  # validated static arguments of plan() (_config)

    @property
    def backend(self) -> str:
        """The backend that runs: ``"cuda"``, ``"sim"`` or ``"reference"``."""
        return self._backend

    @property
    def kv_layout(self) -> str:
        return self._kv_layout

    @property
    def step_plan(self) -> StepPlan:
        """The current :class:`~nbinfer.api.step.StepPlan` (RuntimeError when there is none)."""
        return self._slot.get()

    @property
    def schedule(self):
        """The scheduler's :class:`~nbinfer.scheduler.Plan` that run() executes (None on the
        reference backend)."""
        return self._slot.get().schedule

    def _config(self, statics: tuple):
        """The static half of plan()'s arguments (those the same from step to step) as the
        wrapper's ``_validate_statics(*statics)`` returns it, memoised per wrapper: keyed with
        the arguments' types (128 and 128.0 differ); an unhashable argument (a variant holding
        a list) is validated every time."""
        try:
            key = statics + tuple(map(type, statics))
            cfg = self._configs.get(key)
        except TypeError:
            key, cfg = None, None
        if cfg is None:
            cfg = self._validate_statics(*statics)
            if key is not None:
                if len(self._configs) >= 32:
                    self._configs.clear()
                self._configs[key] = cfg
        return cfg

    def _install(self, build, *args, **kwargs) -> StepPlan:
        """Run ``build(*args, **kwargs) -> StepPlan`` and install its result; on any error
        clear the slot (run() then raises) and re-raise."""
        try:
            step = build(*args, **kwargs)
        except BaseException as exc:
            self._slot.fail(exc)
            raise
        return self._slot.install(step)

    def _launch(self, step: StepPlan, q, kv, kv_names, kv_strides_of, out, lse, return_lse,
                q_strides_of=None):
        """Bind q, the KV views ``kv = (k, v)`` and the outputs to the step's launch and fire.

        ``kv_strides_of(strides) -> (page_stride, kv_stride_n, kv_stride_h)`` maps the element
        strides of the K view to the kernel's; ``q_strides_of`` the q strides (default
        ``[rows, heads, D]``).
        """
        be = self._backend
        rows = step.num_qo_rows
        L = step.launch
        P = L.launch
        if L.fast is not None:
            L.fast.dirty = True  # this call rebinds lengths and strides the fast path relies on
        kind = arrays.array_kind(q)
        shape = (rows, step.num_qo_heads, step.head_dim) if q_strides_of is None else \
            (step.num_qo_heads, step.head_dim)
        out_user, out_k = binding.output(out, "out", kind, q, shape, step.q_dtype, be)
        lse_user, lse_k = binding.output(lse, "lse", kind, q, shape[:-1], "float32", be)
        sq = binding.bind_view(P, ARG["q"], q, be, "q")
        sk = binding.bind_kv(P, *kv, be, kv_names)
        qn, qh = q_strides_of(sq) if q_strides_of is not None else (sq[0], sq[1])
        L.set_strides(*kv_strides_of(sk), qn, qh)
        binding.bind(P, ARG["o"], out_k, be)
        binding.bind(P, ARG["lse"], lse_k, be)
        L(arrays.current_stream(q))
        out_user = arrays.finish(kind, out_user, out_k, be)
        if return_lse or lse is not None:  # a given lse is filled even when not returned
            lse_user = arrays.finish(kind, lse_user, lse_k, be)
        return (out_user, lse_user) if return_lse else out_user


def kv_strides(layout: str, paged: bool):
    """``strides -> (page_stride, kv_stride_n, kv_stride_h)`` for a K view: paged
    ``[P, PS, H, D]`` (NHD) / ``[P, H, PS, D]`` (HND), or ragged ``[N, H, D]`` / ``[H, N, D]``."""
    if paged:
        if layout == "NHD":
            return lambda s: (s[0], s[1], s[2])
        return lambda s: (s[0], s[2], s[1])
    if layout == "NHD":
        return lambda s: (0, s[0], s[1])
    return lambda s: (0, s[1], s[0])


def write_reference(result, out, lse, q, shape, q_dtype, return_lse):
    """The reference engine's ``result`` (``out`` or ``(out, lse)``, float64) as run() returns
    it: written into the caller's ``out`` / ``lse`` when given (same rules as the kernels')."""
    o, s = result if isinstance(result, tuple) else (result, None)
    # Both buffers are checked before either is written: a rejected call writes nothing.
    if out is not None:
        binding.check_output("out", out, q, shape, q_dtype)
    if lse is not None:
        binding.check_output("lse", lse, q, shape[:-1], "float32")
    if out is not None:
        _assign(out, o)
        o = out
    if lse is not None:
        _assign(lse, s)
        s = lse
    return (o, s) if return_lse else o


def _assign(dst, values):
    if arrays.array_kind(dst) == "torch":
        import torch

        dst.copy_(torch.as_tensor(np.asarray(values)))
    else:
        dst[...] = np.asarray(values).astype(dst.dtype)
