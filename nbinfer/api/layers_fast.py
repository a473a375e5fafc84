"""The layer operations' fast path for torch CUDA tensors (:mod:`nbinfer.api.layers`).

The careful path checks every argument with descriptive errors and converts any array kind;
for torch CUDA tensors those checks reduce to a few attribute reads and comparisons, and the
conversion to a data pointer and a span. Each function here returns None whenever any
argument is not what it can take as it is (another array kind, a dtype or layout it does not
handle, a mismatch the careful path would report): the caller then takes the careful path,
which computes the same result or raises the error. Nothing here decides a result the careful
path would not; ``tests/test_gpu_layers.py`` compares the two bitwise.
"""

from __future__ import annotations

import sys

from ..kernels.layers import RopeSpec, SiluMulSpec, norm_spec
from . import arrays

__all__ = ["fast_fused_add_rmsnorm", "fast_rmsnorm", "fast_rope", "fast_silu_and_mul"]


class _Torch:
    """The torch handles the fast path reads, found once."""

    def __init__(self):
        import torch

        self.torch = torch
        # plain tensors and parameters (weights usually are); other subclasses may override
        # what a data pointer means: the careful path
        self.types = (torch.Tensor, torch.nn.Parameter)
        self.floats = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                       torch.float32: "float32"}
        self.ints = {torch.int32: "int32", torch.int64: "int64"}
        try:
            self.stream = torch._C._cuda_getCurrentRawStream  # one C call
        except AttributeError:  # pragma: no cover - older torch
            self.stream = lambda index: torch.cuda.current_stream(index).cuda_stream


_TORCH: list = []  # [_Torch] once torch is imported, [None] when it cannot be


def _torch():
    if not _TORCH:
        try:
            _TORCH.append(_Torch())
        except Exception:  # noqa: BLE001 - a torch that cannot load: the careful path
            _TORCH.append(None)
    return _TORCH[0]


def _device(backend: str, *xs):
    """``(torch handles, device index)`` when every array is a plain torch CUDA tensor on one
    device and the GPU backend would run (not the simulator); else None. A torch tensor
    cannot exist unless torch was imported, so this never imports it for other arrays."""
    if backend not in ("auto", "cuda") or "torch" not in sys.modules or arrays._sim():
        return None
    t = _torch()
    if t is None:
        return None
    index = None
    for x in xs:
        if type(x) not in t.types or not x.is_cuda:
            return None
        d = x.get_device()
        if index is None:
            index = d
        elif d != index:
            return None
    return t, index


def _row_span(x) -> int:
    """Elements from the first to the last of a 2-D array whose rows may be strided."""
    rows, width = x.shape
    return (rows - 1) * x.stride(0) + width if rows and width else 0


def _weight(t, weight, hidden: int, dtype: str):
    w_dtype = t.floats.get(weight.dtype)
    if (weight.dim() != 1 or weight.shape[0] != hidden or not weight.is_contiguous()
            or w_dtype not in (dtype, "float32")):
        return None
    return w_dtype


def _out(t, out, like, shape):
    """A new contiguous output, or ``out`` when it is one of ``like``'s dtype and shape."""
    if out is None:
        return t.torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.dtype is like.dtype and tuple(out.shape) == shape and out.is_contiguous():
        return out
    return None


def fast_rmsnorm(launch, input, weight, eps, out, backend):
    """:func:`~nbinfer.api.layers.rmsnorm` for torch CUDA tensors, or None."""
    found = _device(backend, input, weight, *(() if out is None else (out,)))
    if found is None or input.dim() != 2:
        return None
    t, index = found
    dtype = t.floats.get(input.dtype)
    rows, hidden = input.shape
    if dtype is None or (hidden > 1 and input.stride(1) != 1):
        return None
    w_dtype = _weight(t, weight, hidden, dtype)
    if w_dtype is None:
        return None
    out = _out(t, out, input, (rows, hidden))
    if out is None:
        return None
    if rows and hidden:
        span, stride = _row_span(input), input.stride(0)
        launch(norm_spec(dtype, w_dtype, False, False, hidden), "cuda", rows,
               [(input.data_ptr(), span), (input.data_ptr(), span),
                (weight.data_ptr(), hidden), (out.data_ptr(), rows * hidden)],
               (hidden, stride, stride, hidden, float(eps)), t.stream(index))
    return out


def fast_fused_add_rmsnorm(launch, input, residual, weight, eps, backend) -> bool:
    """:func:`~nbinfer.api.layers.fused_add_rmsnorm` for torch CUDA tensors; whether it ran."""
    found = _device(backend, input, residual, weight)
    if found is None or input.dim() != 2:
        return False
    t, index = found
    dtype = t.floats.get(input.dtype)
    rows, hidden = input.shape
    if (dtype is None or residual.dtype is not input.dtype or residual.shape != input.shape
            or not input.is_contiguous() or not residual.is_contiguous()):
        return False
    w_dtype = _weight(t, weight, hidden, dtype)
    if w_dtype is None:
        return False
    if rows and hidden:
        n = rows * hidden
        launch(norm_spec(dtype, w_dtype, True, False, hidden), "cuda", rows,
               [(input.data_ptr(), n), (residual.data_ptr(), n), (weight.data_ptr(), hidden),
                (input.data_ptr(), n)],
               (hidden, hidden, hidden, hidden, float(eps)), t.stream(index))
    return True


def fast_silu_and_mul(launch, input, out, backend):
    """:func:`~nbinfer.api.layers.silu_and_mul` for torch CUDA tensors, or None."""
    found = _device(backend, input, *(() if out is None else (out,)))
    if found is None or input.dim() != 2:
        return None
    t, index = found
    dtype = t.floats.get(input.dtype)
    rows, width = input.shape
    if dtype is None or width % 2 or (width > 1 and input.stride(1) != 1):
        return None
    d = width // 2
    out = _out(t, out, input, (rows, d))
    if out is None:
        return None
    if rows and d:
        spec = SiluMulSpec(dtype, False)
        launch(spec, "cuda", (rows, -(-d // spec.threads)),
               [(input.data_ptr(), _row_span(input)), (out.data_ptr(), rows * d)],
               (d, input.stride(0), d), t.stream(index))
    return out


def _heads(x, head_size: int):
    """``(tokens, heads, token stride, head stride, span)`` of a query or key tensor, 2-D
    ``[tokens, heads * head_size]`` or 3-D ``[tokens, heads, head_size]``; None otherwise."""
    if x.dim() == 2 and x.shape[1] % head_size == 0 and (x.shape[1] == 0 or x.stride(1) == 1):
        n, heads = x.shape[0], x.shape[1] // head_size
        s_tok, s_head = x.stride(0), head_size
    elif x.dim() == 3 and x.shape[2] == head_size and x.stride(2) == 1:
        n, heads = x.shape[0], x.shape[1]
        s_tok, s_head = x.stride(0), x.stride(1)
    else:
        return None
    span = (n - 1) * s_tok + (heads - 1) * s_head + head_size if n and heads else 0
    return n, heads, s_tok, s_head, span


def fast_rope(launch, positions, query, key, head_size, cos_sin_cache, is_neox, in_place,
              backend):
    """:func:`~nbinfer.api.layers.apply_rope_with_cos_sin_cache` (``in_place``: its in-place
    form) for torch CUDA tensors: ``(query_out, key_out)``, or None."""
    found = _device(backend, positions, query, key, cos_sin_cache)
    if found is None or type(head_size) is not int or head_size < 1:
        return None
    t, index = found
    dtype = t.floats.get(query.dtype)
    pos_dtype = t.ints.get(positions.dtype)
    q, k = _heads(query, head_size), _heads(key, head_size)
    if (dtype is None or pos_dtype is None or key.dtype is not query.dtype or q is None
            or k is None or positions.dim() != 1 or not positions.is_contiguous()
            or q[0] != k[0] or positions.shape[0] != q[0]):
        return None
    table = cos_sin_cache
    if (table.dtype is not t.torch.float32 or table.dim() != 2 or not table.is_contiguous()
            or table.shape[0] < 1 or table.shape[1] % 2 or not 0 < table.shape[1] <= head_size):
        return None
    max_pos, rot = table.shape
    n, hq, q_sn, q_sh, q_span = q
    _, hk, k_sn, k_sh, k_span = k
    if in_place:
        q_out, k_out = query, key
        qo, ko = (q_sn, q_sh, q_span), (k_sn, k_sh, k_span)
    else:
        q_out = t.torch.empty(query.shape, dtype=query.dtype, device=query.device)
        k_out = t.torch.empty(key.shape, dtype=key.dtype, device=key.device)
        qo = (hq * head_size, head_size, n * hq * head_size)
        ko = (hk * head_size, head_size, n * hk * head_size)
    if n and hq + hk:
        spec = RopeSpec(dtype, head_size, rot, bool(is_neox), pos_dtype,
                        not in_place and rot < head_size, False)
        launch(spec, "cuda", n,
               [(query.data_ptr(), q_span), (q_out.data_ptr(), qo[2]),
                (key.data_ptr(), k_span), (k_out.data_ptr(), ko[2]),
                (positions.data_ptr(), n), (table.data_ptr(), max_pos * rot)],
               (hq, hk, max_pos, q_sn, q_sh, qo[0], qo[1], k_sn, k_sh, ko[0], ko[1]),
               t.stream(index))
    return q_out, k_out
