"""FlashInfer-compatible merges of attention states: ``merge_state``, ``merge_state_in_place``,
``merge_states``.

An attention state is ``(v, s)``: the attention output over a key set and the log-sum-exp of its
logits. Two states over disjoint key sets merge into the state over their union (see
:mod:`nbinfer.reference.merge`). As everywhere in nbinfer (the reference, the attention
wrappers' ``return_lse``), ``s`` is a natural-log LSE by default; ``lse_base=2`` takes and returns
FlashInfer's base-2 values (``s = log2 sum_j 2^(x_j)``). The base is compiled into the kernel
(:class:`~nbinfer.kernels.state.StateSpec`), so neither base costs a conversion pass.
"""

from __future__ import annotations

import math

import numpy as np

from .. import reference
from .._checks import check_dim, check_ndim, dtype_name
from ..kernels.launch import launch_shared
from ..kernels.state import (
    LSE_BASES,
    StateSpec,
    build_merge_pair,
    build_merge_stack,
    merge_signature,
    state_launch_config,
)
from . import arrays

__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


# ---------------------------------------------------------------------------------------------
# Shared input plumbing (also used by nbinfer.api.append)
def check_placement(backend: str, **named) -> str:
    """Require one array kind and one device for all ``named`` arrays; return the kind.

    ``"reference"`` runs the NumPy engine, so it takes NumPy arrays only; ``"sim"`` runs kernels
    on host memory; ``"cuda"`` takes NumPy arrays (copied to the GPU and back) or arrays on one
    CUDA device.
    """
    kinds = {name: arrays.array_kind(x) for name, x in named.items()}
    if len(set(kinds.values())) > 1:
        raise TypeError(f"arrays must all be of one kind, got {kinds}")
    kind = next(iter(kinds.values()))
    devices = {name: arrays.device_of(x) for name, x in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"arrays are on different devices: {devices}")
    device = next(iter(devices.values()))
    if backend == "reference" and kind != "numpy":
        raise TypeError(f"backend='reference' takes NumPy arrays, got {kind} arrays")
    if backend == "sim" and device != "host":
        raise ValueError(f"backend='sim' runs on host memory, got {kind} arrays on {device}")
    if backend == "cuda" and kind != "numpy" and device == "host":
        raise ValueError(f"backend='cuda' needs NumPy arrays or arrays on a CUDA device, "
                         f"got {kind} arrays in host memory")
    for name, x in named.items():
        # ml_dtypes' NumPy bfloat16 would reach the kernels as values, not as the int16 bits
        # they decode, and silently give wrong numbers.
        if isinstance(x, np.ndarray) and x.dtype.name == "bfloat16":
            raise TypeError(f"{name}: NumPy bfloat16 arrays are not supported; pass torch "
                            f"bfloat16 tensors or float16/float32 arrays")
    return kind


def check_contiguous(name: str, x) -> None:
    """Require C-contiguous memory: kernels see flat arrays, and in-place results must land in
    the caller's memory, not in a contiguous copy."""
    if not arrays.is_contiguous(x):
        strides = tuple(x.stride()) if arrays.array_kind(x) == "torch" else tuple(x.strides)
        raise ValueError(f"{name} must be contiguous (C order), got strides {strides}")


def check_writable(name: str, x) -> None:
    """An array updated in place must be contiguous and (for NumPy) writeable."""
    check_contiguous(name, x)
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} must be writeable (it is updated in place)")


def named_dtype(name: str, x) -> str:
    """:func:`arrays.storage_dtype` with the argument's name in the error."""
    return arrays.storage_dtype(x, name)


def _on_kernel(x, backend: str):
    """``(copy, argument)``: ``x`` as a merge kernel takes it. Arrays on the GPU go by address,
    with no view built (Numba's would wait on the array's stream, which a CUDA-graph capture
    forbids): ``(None, (address, elements))``. Host arrays: the simulator's flat array, or on
    the GPU a device copy, which the caller keeps until the results are back (the argument is
    only its address)."""
    if backend == "cuda" and arrays.on_device(x):
        return None, arrays.device_pointer(x)[:2]
    k = arrays.to_kernel(x, backend)
    return k, (k if backend == "sim" else arrays.device_pointer(k)[:2])


def _inputs(backend: str, *xs) -> tuple[list, list]:
    """``(copies, arguments)`` of read-only inputs (:func:`_on_kernel`)."""
    pairs = [_on_kernel(x, backend) for x in xs]
    return [c for c, _ in pairs], [a for _, a in pairs]


def _no_mask(backend: str):
    """merge_pair's mask argument for "merge every row": an empty array."""
    return np.zeros(0, np.uint8) if backend == "sim" else (0, 0)


def _run(kind: str, spec: StateSpec, rows: int, heads: int, args: tuple, stream: int) -> None:
    """Launch the ``kind`` merge kernel of ``spec`` over ``rows`` rows of ``heads`` heads on
    ``stream`` (``args``: the kernel's arguments as :func:`_on_kernel` gives them)."""
    grid, block = state_launch_config(spec, rows, heads)
    build = build_merge_pair if kind == "merge_pair" else build_merge_stack
    launch_shared((kind, spec, block), lambda: (build(spec), merge_signature(kind, spec), block),
                  grid, args, stream, sim=spec.sim)


def _check_base(lse_base) -> float:
    if isinstance(lse_base, bool) or not isinstance(lse_base, (int, float)):
        raise TypeError(f"lse_base must be 2 or math.e, got {type(lse_base).__name__}")
    if float(lse_base) not in LSE_BASES:
        raise ValueError(f"lse_base must be 2 (FlashInfer) or math.e, got {lse_base!r}")
    return float(lse_base)


def _check_state(v_name, v, s_name, s, v_ndim):
    """Validate ``v [..., H, D]`` (fp16/bf16/fp32) and ``s = v.shape[:-1]`` float32."""
    check_ndim(v_name, v, v_ndim)
    check_ndim(s_name, s, v_ndim - 1)
    v_dtype = named_dtype(v_name, v)
    if dtype_name(s) != "float32":
        raise TypeError(f"{s_name} must be float32 (FlashInfer's LSE dtype), got {dtype_name(s)}")
    if tuple(s.shape) != tuple(v.shape[:-1]):
        raise ValueError(f"{s_name}.shape must be {v_name}.shape[:-1] = {tuple(v.shape[:-1])}, "
                         f"got {tuple(s.shape)}")
    return v_dtype


def _check_same(name, x, ref_name, ref):
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name}.shape must equal {ref_name}.shape {tuple(ref.shape)}, "
                         f"got {tuple(x.shape)}")
    if named_dtype(name, x) != named_dtype(ref_name, ref):
        raise TypeError(f"{name} must have {ref_name}'s dtype {arrays.storage_dtype(ref)}, "
                        f"got {arrays.storage_dtype(x)}")


# ---------------------------------------------------------------------------------------------
def merge_state(v_a, s_a, v_b, s_b, *, lse_base: float = math.e, backend: str = "auto"):
    """Merge two attention states computed over disjoint key sets.

    Parameters
    ----------
    v_a, v_b : array [seq_len, num_heads, head_dim], float16 / bfloat16 / float32 (same dtype)
        Attention outputs of segments A and B.
    s_a, s_b : array [seq_len, num_heads], float32
        Their LSEs in ``lse_base`` (``-inf`` marks an empty segment).
    lse_base : {2, math.e}, keyword-only
        2 (default) is FlashInfer's convention.
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    Returns
    -------
    v : array [seq_len, num_heads, head_dim], dtype of ``v_a``
    s : array [seq_len, num_heads], float32, in ``lse_base``
        Same array kind as the inputs (float64 NumPy arrays from ``backend="reference"``).
    """
    be = arrays.resolve_backend(backend)
    base = _check_base(lse_base)
    v_dtype = _check_state("v_a", v_a, "s_a", s_a, 3)
    _check_state("v_b", v_b, "s_b", s_b, 3)
    _check_same("v_b", v_b, "v_a", v_a)
    kind = check_placement(be, v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)
    if be == "reference":
        return reference.merge_state(v_a, s_a, v_b, s_b, lse_base=base)
    rows, heads, dim = (int(n) for n in v_a.shape)
    vo = arrays.empty_kind(kind, v_a, (rows, heads, dim), v_dtype, be)
    so = arrays.empty_kind(kind, v_a, (rows, heads), "float32", be)
    (vo_k, vo_arg), (so_k, so_arg) = _on_kernel(vo, be), _on_kernel(so, be)
    if rows * heads * dim:
        keep, ins = _inputs(be, v_a, s_a, v_b, s_b)
        args = (*ins, vo_arg, so_arg, _no_mask(be), heads)
        _run("merge_pair", StateSpec(v_dtype, dim, base, be == "sim"), rows, heads, args,
             arrays.current_stream(v_a))
    return arrays.finish(kind, vo, vo_k, be), arrays.finish(kind, so, so_k, be)


def merge_state_in_place(v, s, v_other, s_other, mask=None, *, lse_base: float = math.e,
                         backend: str = "auto") -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)``, overwriting ``v`` and ``s``.

    Parameters
    ----------
    v : array [seq_len, num_heads, head_dim], float16 / bfloat16 / float32, contiguous
        Attention output to update in place.
    s : array [seq_len, num_heads], float32, contiguous
        Its LSE in ``lse_base``; updated in place.
    v_other, s_other : arrays of the same shapes and dtypes
        The state merged in (not modified).
    mask : bool array [seq_len], optional
        Merge only rows where ``mask`` is True; the others keep their values. A fixed-shape mask
        keeps the launch identical from step to step (CUDA graphs).
    lse_base : {2, math.e}, keyword-only
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    Returns
    -------
    None
    """
    be = arrays.resolve_backend(backend)
    base = _check_base(lse_base)
    v_dtype = _check_state("v", v, "s", s, 3)
    _check_state("v_other", v_other, "s_other", s_other, 3)
    _check_same("v_other", v_other, "v", v)
    named = dict(v=v, s=s, v_other=v_other, s_other=s_other)
    rows = int(v.shape[0])
    if mask is not None:
        check_ndim("mask", mask, 1)
        check_dim("mask", mask, 0, rows, "seq_len")
        if dtype_name(mask) != "bool":
            raise TypeError(f"mask must be a bool array, got dtype {dtype_name(mask)}")
        named["mask"] = mask
    kind = check_placement(be, **named)
    check_writable("v", v)
    check_writable("s", s)
    if be == "reference":
        reference.merge_state_in_place(v, s, v_other, s_other, mask, lse_base=base)
        return None
    heads, dim = int(v.shape[1]), int(v.shape[2])
    if not rows * heads * dim:
        return None
    (v_k, v_arg), (s_k, s_arg) = _on_kernel(v, be), _on_kernel(s, be)
    keep, (vb_arg, sb_arg, *mask_arg) = _inputs(
        be, v_other, s_other, *(() if mask is None else (_bool_as_uint8(mask, kind),)))
    # v is both va and vo (each thread reads its elements, then writes them), s both sa and so
    # (the in-place kernel's barrier orders a head's reads of its LSE before the write). No
    # scratch, no copy: nothing is allocated, so the call can be captured in a CUDA graph.
    args = (v_arg, s_arg, vb_arg, sb_arg, v_arg, s_arg,
            mask_arg[0] if mask_arg else _no_mask(be), heads)
    _run("merge_pair", StateSpec(v_dtype, dim, base, be == "sim", in_place=True), rows, heads,
         args, arrays.current_stream(v))
    arrays.finish(kind, v, v_k, be)
    arrays.finish(kind, s, s_k, be)
    return None


def merge_states(v, s, *, lse_base: float = math.e, backend: str = "auto"):
    """Merge ``num_states`` attention states of every row into one.

    Parameters
    ----------
    v : array [seq_len, num_states, num_heads, head_dim], float16 / bfloat16 / float32
    s : array [seq_len, num_states, num_heads], float32, in ``lse_base``
    lse_base : {2, math.e}, keyword-only
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    Returns
    -------
    v_merged : array [seq_len, num_heads, head_dim], dtype of ``v``
    s_merged : array [seq_len, num_heads], float32
        With ``num_states == 0`` every row is empty: ``v = 0``, ``s = -inf``.
    """
    be = arrays.resolve_backend(backend)
    base = _check_base(lse_base)
    v_dtype = _check_state("v", v, "s", s, 4)
    kind = check_placement(be, v=v, s=s)
    if be == "reference":
        return reference.merge_states(v, s, lse_base=base)
    rows, states, heads, dim = (int(n) for n in v.shape)
    vo = arrays.empty_kind(kind, v, (rows, heads, dim), v_dtype, be)
    so = arrays.empty_kind(kind, v, (rows, heads), "float32", be)
    (vo_k, vo_arg), (so_k, so_arg) = _on_kernel(vo, be), _on_kernel(so, be)
    if rows * heads * dim:
        keep, ins = _inputs(be, v, s)
        args = (*ins, vo_arg, so_arg, states, heads)
        _run("merge_stack", StateSpec(v_dtype, dim, base, be == "sim"), rows, heads, args,
             arrays.current_stream(v))
    return arrays.finish(kind, vo, vo_k, be), arrays.finish(kind, so, so_k, be)


def _bool_as_uint8(mask, kind):
    """The mask's bytes as uint8 (no copy): kernels take uint8, bool is one byte 0/1."""
    if kind == "torch":
        import torch

        return mask.contiguous().view(torch.uint8)
    return mask.view(np.uint8) if kind != "numpy" else np.ascontiguousarray(mask).view(np.uint8)

