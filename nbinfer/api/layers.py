"""FlashInfer's layer operations around attention: ``rmsnorm``, ``fused_add_rmsnorm``,
``silu_and_mul``, ``apply_rope_with_cos_sin_cache`` (and its in-place form).

Same names, arguments and in-place behaviour as ``flashinfer.norm``, ``flashinfer.activation``
and ``flashinfer.rope``; the kernels are :mod:`nbinfer.kernels.layers`, the definitions
:mod:`nbinfer.reference.layers`. Activations are 2-D ``[tokens, features]`` whose rows may be
strided (a row of a fused QKV or gate-up projection's output holds more than the operand), with
a contiguous last dimension; outputs are contiguous. Arrays of any kind nbinfer takes: NumPy
(the reference engine, or kernels in the simulator), torch / cupy / numba CUDA arrays on the GPU.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from .._checks import check_dim, check_ndim, check_positive_int, dtype_name
from ..kernels.launch import launch_shared
from ..kernels.layers import (
    RopeSpec,
    SiluMulSpec,
    build_layer_kernel,
    layer_signature,
    norm_spec,
)
from ..reference.layers import round_to
from . import arrays
from .layers_fast import fast_fused_add_rmsnorm, fast_rmsnorm, fast_rope, fast_silu_and_mul
from .state import check_placement, check_writable

__all__ = ["apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
           "fused_add_rmsnorm", "rmsnorm", "silu_and_mul"]

_FLOATS = ("float16", "bfloat16", "float32")
# torch CUDA tensors take the fast path (:mod:`.layers_fast`: the same launch after a few
# comparisons instead of the checks below); False: always the careful path
FAST_PATH = True


def _float_dtype(name: str, x) -> str:
    got = arrays.storage_dtype(x, name)
    if got not in _FLOATS:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {got}")
    return got


def _rows(name: str, x, width: int | None = None) -> tuple[int, int]:
    """``(rows, width)`` of a 2-D activation whose last dimension is contiguous (its row
    stride is the kernel view's: :func:`_views`)."""
    check_ndim(name, x, 2)
    if width is not None:
        check_dim(name, x, 1, width, "the expected width")
    arrays.check_strided(name, x)
    return int(x.shape[0]), int(x.shape[1])


def _views(be: str, named: dict) -> tuple[list, list]:
    """Each array as its kernel argument and the element strides the kernel must use with
    it: a flat NumPy view (simulator; a read-only array is read from a contiguous copy, with
    that copy's strides) or ``(pointer, elements)`` of device memory (GPU, which takes device
    arrays only)."""
    views, strides = [], []
    for name, x in named.items():
        if be == "cuda" and not arrays.on_device(x):
            raise TypeError(f"{name}: the GPU backend takes device arrays (torch, cupy or "
                            f"numba CUDA arrays), got host memory")
        view, st = arrays.kernel_view(x, be, name)
        views.append(view)
        strides.append(st)
    return views, strides


def _launch(spec, be: str, grid, views: list, scalars: tuple, stream: int) -> None:
    launch_shared(spec, lambda: (build_layer_kernel(spec), layer_signature(spec), spec.threads),
                  grid, (*views, *scalars), stream, sim=be == "sim")


def _write(dst, values, dtype: str) -> None:
    """Store float64 ``values`` into the NumPy array ``dst`` (its dtype), in place."""
    dst[...] = round_to(values, dtype).astype(dst.dtype)


def _given(**named) -> dict:
    """The named arrays that are not None (optional outputs join the placement check)."""
    return {k: v for k, v in named.items() if v is not None}


def _output(out, kind: str, template, shape, dtype: str, be: str):
    """``out`` checked against the result's shape, dtype and kind, or a new array."""
    if out is None:
        return arrays.empty_like_kind(kind, template, shape, dtype, be)[0]
    _check_out("out", out, shape, dtype, kind)
    return out


def _check_out(name: str, out, shape, dtype: str, kind: str) -> None:
    check_ndim(name, out, 2)
    for axis, n in enumerate(shape):
        check_dim(name, out, axis, n, "the result's shape")
    if _float_dtype(name, out) != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {dtype_name(out)}")
    if arrays.array_kind(out) != kind:
        raise TypeError(f"{name} must be a {kind} array like the input")
    check_writable(name, out)


def rmsnorm(input, weight, eps: float = 1e-6, *, out=None, backend: str = "auto"):
    """RMSNorm of every row: ``input / sqrt(mean(input^2) + eps) * weight``.

    Parameters
    ----------
    input : array [tokens, hidden], float16 / bfloat16 / float32 (rows may be strided)
    weight : array [hidden], the input's dtype or float32, contiguous
    eps : float
    out : array [tokens, hidden], optional
        Contiguous, the input's dtype and kind (may be ``input`` itself when contiguous).
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    Returns
    -------
    array [tokens, hidden] of the input's dtype and kind (``out`` when given)
    """
    if FAST_PATH:
        res = fast_rmsnorm(_launch, input, weight, eps, out, backend)
        if res is not None:
            return res
    be = arrays.resolve_backend(backend)
    dtype = _float_dtype("input", input)
    rows, hidden = _rows("input", input)
    w_dtype = _check_weight(weight, hidden, dtype)
    kind = check_placement(be, input=input, weight=weight, **_given(out=out))
    out = _output(out, kind, input, (rows, hidden), dtype, be)
    if be == "reference":
        _write(out, reference.layers.rmsnorm(input, weight, float(eps)), dtype)
        return out
    if rows and hidden:
        spec = norm_spec(dtype, w_dtype, False, be == "sim", hidden)
        views, st = _views(be, dict(input=input, residual=input, weight=weight, out=out))
        _launch(spec, be, rows, views, (hidden, st[0][0], st[1][0], hidden, float(eps)),
                arrays.current_stream(input))
    return out


def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, *,
                      backend: str = "auto") -> None:
    """In place: ``residual += input``, then ``input = rmsnorm(residual) * weight``.

    The sum is rounded to the residual's dtype before it is normalised (as when a model adds
    and normalises in two steps).

    Parameters
    ----------
    input : array [tokens, hidden], float16 / bfloat16 / float32, contiguous (overwritten)
    residual : array [tokens, hidden], same dtype, contiguous (overwritten)
    weight : array [hidden], the input's dtype or float32
    eps : float
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only
    """
    if FAST_PATH and fast_fused_add_rmsnorm(_launch, input, residual, weight, eps, backend):
        return None
    be = arrays.resolve_backend(backend)
    dtype = _float_dtype("input", input)
    rows, hidden = _rows("input", input)
    _rows("residual", residual, hidden)
    check_dim("residual", residual, 0, rows, "tokens of input")
    if _float_dtype("residual", residual) != dtype:
        raise TypeError(f"residual must have input's dtype {dtype}, got {dtype_name(residual)}")
    w_dtype = _check_weight(weight, hidden, dtype)
    check_placement(be, input=input, residual=residual, weight=weight)
    check_writable("input", input)
    check_writable("residual", residual)
    if be == "reference":
        normed, total = reference.layers.fused_add_rmsnorm(input, residual, weight, float(eps),
                                                           dtype=dtype)
        _write(residual, total, dtype)
        _write(input, normed, dtype)
        return None
    if rows and hidden:
        spec = norm_spec(dtype, w_dtype, True, be == "sim", hidden)
        views, _ = _views(be, dict(input=input, residual=residual, weight=weight, out=input))
        _launch(spec, be, rows, views, (hidden, hidden, hidden, hidden, float(eps)),
                arrays.current_stream(input))
    return None


def _check_weight(weight, hidden: int, dtype: str) -> str:
    check_ndim("weight", weight, 1)
    check_dim("weight", weight, 0, hidden, "hidden size of input")
    w_dtype = _float_dtype("weight", weight)
    if w_dtype not in (dtype, "float32"):
        raise TypeError(f"weight must have the input's dtype {dtype} or float32, got {w_dtype}")
    if not arrays.is_contiguous(weight):
        raise ValueError("weight must be contiguous")
    return w_dtype


def silu_and_mul(input, *, out=None, backend: str = "auto"):
    """``silu(input[:, :d]) * input[:, d:]``: the gated MLP's activation on one GEMM's output
    over the gate and up projections concatenated (gate first).

    Parameters
    ----------
    input : array [tokens, 2 d], float16 / bfloat16 / float32 (rows may be strided)
    out : array [tokens, d], optional; contiguous, the input's dtype and kind
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    Returns
    -------
    array [tokens, d] of the input's dtype and kind (``out`` when given)
    """
    if FAST_PATH:
        res = fast_silu_and_mul(_launch, input, out, backend)
        if res is not None:
            return res
    be = arrays.resolve_backend(backend)
    dtype = _float_dtype("input", input)
    rows, width = _rows("input", input)
    if width % 2:
        raise ValueError(f"input's last dimension must be even (gate | up), got {width}")
    d = width // 2
    kind = check_placement(be, input=input, **_given(out=out))
    out = _output(out, kind, input, (rows, d), dtype, be)
    if be == "reference":
        _write(out, reference.layers.silu_and_mul(input), dtype)
        return out
    if rows and d:
        spec = SiluMulSpec(dtype, be == "sim")
        views, st = _views(be, dict(input=input, out=out))
        _launch(spec, be, (rows, -(-d // spec.threads)), views, (d, st[0][0], d),
                arrays.current_stream(input))
    return out


def _rope_operand(name: str, x, head_size: int, dtype: str):
    """``(tokens, heads, token stride, head stride)`` of a query or key array, 2-D
    ``[tokens, heads * head_size]`` or 3-D ``[tokens, heads, head_size]``."""
    if len(x.shape) not in (2, 3):
        raise ValueError(f"{name} must be [tokens, heads * head_size] or [tokens, heads, "
                         f"head_size], got shape {tuple(x.shape)}")
    if _float_dtype(name, x) != dtype:
        raise TypeError(f"{name} must have query's dtype {dtype}, got {dtype_name(x)}")
    st = arrays.check_strided(name, x)
    if len(x.shape) == 3:
        check_dim(name, x, 2, head_size, "head_size")
        return int(x.shape[0]), int(x.shape[1]), int(st[0]), int(st[1])
    if x.shape[1] % head_size:
        raise ValueError(f"{name}'s width {x.shape[1]} is not a multiple of head_size="
                         f"{head_size}")
    return int(x.shape[0]), int(x.shape[1]) // head_size, int(st[0]), head_size


def _rope(positions, query, key, head_size, cos_sin_cache, is_neox, be, in_place):
    head_size = check_positive_int("head_size", head_size)
    dtype = _float_dtype("query", query)
    nq, hq, q_sn, q_sh = _rope_operand("query", query, head_size, dtype)
    nk, hk, k_sn, k_sh = _rope_operand("key", key, head_size, dtype)
    check_ndim("positions", positions, 1)
    check_dim("positions", positions, 0, nq, "tokens of query")
    if nk != nq:
        raise ValueError(f"key has {nk} tokens, query {nq}")
    pos_dtype = dtype_name(positions)
    if pos_dtype not in ("int32", "int64"):
        raise TypeError(f"positions must be int32 or int64, got {pos_dtype}")
    check_ndim("cos_sin_cache", cos_sin_cache, 2)
    if dtype_name(cos_sin_cache) != "float32":
        raise TypeError(f"cos_sin_cache must be float32, got {dtype_name(cos_sin_cache)}")
    max_pos, rot = (int(n) for n in cos_sin_cache.shape)
    if max_pos < 1:
        raise ValueError("cos_sin_cache must have at least one row (position 0)")
    if rot % 2 or not 0 < rot <= head_size:
        raise ValueError(f"cos_sin_cache's width (the rotary dim) must be even and in 2.."
                         f"head_size={head_size}, got {rot}")
    if not arrays.is_contiguous(cos_sin_cache):
        raise ValueError("cos_sin_cache must be contiguous")
    kind = check_placement(be, positions=positions, query=query, key=key,
                           cos_sin_cache=cos_sin_cache)
    if in_place:
        q_out, k_out = query, key
        for name, x in (("query", query), ("key", key)):
            if isinstance(x, np.ndarray) and not x.flags.writeable:
                raise ValueError(f"{name} must be writeable (it is rotated in place)")
    else:
        q_out = arrays.empty_like_kind(kind, query, tuple(query.shape), dtype, be)[0]
        k_out = arrays.empty_like_kind(kind, key, tuple(key.shape), dtype, be)[0]
    if be == "reference":
        pos = np.asarray(positions)
        if pos.size and (pos.min() < 0 or pos.max() >= max_pos):
            raise ValueError(f"positions must be in 0..{max_pos - 1} (the table's rows)")
        qr, kr = reference.layers.apply_rope_with_cos_sin_cache(
            positions, query, key, head_size, cos_sin_cache, is_neox)
        _write(q_out, qr, dtype)
        _write(k_out, kr, dtype)
        return q_out, k_out
    if not nq or not hq + hk:
        return q_out, k_out
    spec = RopeSpec(dtype, head_size, rot, bool(is_neox), pos_dtype,
                    not in_place and rot < head_size, be == "sim")
    qo_sn, qo_sh = hq * head_size, head_size
    ko_sn, ko_sh = hk * head_size, head_size
    if in_place:
        qo_sn, qo_sh, ko_sn, ko_sh = q_sn, q_sh, k_sn, k_sh
    if be == "sim":
        # The simulator copies each argument in and back out in turn: views of one buffer
        # (q and k of a fused QKV output) would overwrite each other's results. Rotate
        # contiguous copies, then store them.
        host = arrays.to_host_exact  # NumPy views of host memory (torch CPU tensors too)
        qc, kc = (np.ascontiguousarray(host(x)).reshape(nq, -1) for x in (query, key))
        qo_c = qc if in_place else np.empty_like(qc)
        ko_c = kc if in_place else np.empty_like(kc)
        _launch(spec, be, nq, [a.reshape(-1) for a in (qc, qo_c, kc, ko_c)]
                + [np.ascontiguousarray(host(positions)),
                   np.ascontiguousarray(host(cos_sin_cache)).reshape(-1)],
                (hq, hk, max_pos, hq * head_size, head_size, hq * head_size, head_size,
                 hk * head_size, head_size, hk * head_size, head_size), 0)
        host(q_out)[...] = qo_c.reshape(q_out.shape)
        host(k_out)[...] = ko_c.reshape(k_out.shape)
        return q_out, k_out
    views, _ = _views(be, dict(query=query, q_out=q_out, key=key, k_out=k_out,
                               positions=positions, cos_sin_cache=cos_sin_cache))
    _launch(spec, be, nq, views, (hq, hk, max_pos, q_sn, q_sh, qo_sn, qo_sh, k_sn, k_sh,
                                  ko_sn, ko_sh), arrays.current_stream(query))
    return q_out, k_out


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size: int,
                                          cos_sin_cache, is_neox: bool = True, *,
                                          backend: str = "auto") -> None:
    """Rotate ``query`` and ``key`` in place by their tokens' positions (FlashInfer's
    vLLM-compatible form).

    Parameters
    ----------
    positions : int32 / int64 array [tokens]
    query : array [tokens, Hq * head_size] or [tokens, Hq, head_size], float16 / bfloat16 /
        float32; rows may be strided (a view of a fused QKV output)
    key : array [tokens, Hk * head_size] or [tokens, Hk, head_size], query's dtype
    head_size : int
    cos_sin_cache : float32 array [max_position, rotary_dim]: row ``p`` is ``cos | sin`` of
        position ``p``'s angles (:func:`nbinfer.reference.layers.cos_sin_cache`); dimensions
        past ``rotary_dim`` are left as they are
    is_neox : bool
        Pairs ``(i, i + rotary_dim / 2)`` (True) or ``(2 i, 2 i + 1)``.
    backend : {"auto", "cuda", "sim", "reference"}, keyword-only

    A position outside the table is an error in the reference; the kernels cannot raise, so
    they write NaN into that token's rows (never a read outside the table).
    """
    if FAST_PATH and fast_rope(_launch, positions, query, key, head_size, cos_sin_cache,
                               is_neox, True, backend) is not None:
        return None
    _rope(positions, query, key, head_size, cos_sin_cache, is_neox,
          arrays.resolve_backend(backend), True)


def apply_rope_with_cos_sin_cache(positions, query, key, head_size: int, cos_sin_cache,
                                  is_neox: bool = True, *, backend: str = "auto"):
    """As :func:`apply_rope_with_cos_sin_cache_inplace`, into new contiguous arrays of the
    inputs' shapes; returns ``(query_rotated, key_rotated)``."""
    if FAST_PATH:
        res = fast_rope(_launch, positions, query, key, head_size, cos_sin_cache, is_neox,
                        False, backend)
        if res is not None:
            return res
    return _rope(positions, query, key, head_size, cos_sin_cache, is_neox,
                 arrays.resolve_backend(backend), False)
