"""Input validation shared by every public function.

Each check raises before any work is done, with a ValueError or TypeError whose message names
the argument, the expected value and the actual value. Checks work on anything array-like that
exposes ``shape``/``dtype`` (NumPy arrays, and for shape/dtype checks, device arrays too).
"""

from __future__ import annotations

import numbers

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
KV_LAYOUTS = ("NHD", "HND")


def dtype_name(a) -> str:
    """Readable dtype of ``a`` (torch tensors included)."""
    return str(getattr(a, "dtype", type(a).__name__)).replace("torch.", "")


def check_ndim(name: str, a, ndim) -> None:
    """Require ``a.ndim`` to be ``ndim`` (an int or a tuple of allowed ranks)."""
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    actual = len(getattr(a, "shape", ()))
    if not hasattr(a, "shape"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if actual not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} dimensions, got {actual} (shape {tuple(a.shape)})")


def check_dim(name: str, a, axis: int, expected: int, what: str = "") -> None:
    """Require ``a.shape[axis] == expected``."""
    actual = a.shape[axis]
    if actual != expected:
        label = f" ({what})" if what else ""
        raise ValueError(
            f"{name}.shape[{axis}]{label} must be {expected}, got {actual} (shape {tuple(a.shape)})"
        )


def check_float(name: str, a, allowed=FLOAT_DTYPES) -> None:
    """Require a floating dtype from ``allowed``."""
    dt = getattr(a, "dtype", None)
    try:
        ok = dt is not None and np.dtype(dt) in allowed
    except TypeError:
        ok = False
    if not ok:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {dtype_name(a)}")


INT32_MIN, INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)
_INT32 = np.dtype(np.int32)


def as_integer_array(name: str, a, ndim: int = 1) -> np.ndarray:
    """Return ``a`` as a NumPy array of its own integer dtype (nothing narrowed, nothing wrapped).

    Any integer dtype is accepted (int8 ... uint64); booleans, floats and objects raise a
    TypeError naming ``name``. An empty Python list counts as an empty int64 array. Range-check the
    result (e.g. with :func:`check_range`, which compares exactly for every integer dtype) before
    converting it to a narrower type.
    """
    arr = np.asarray(a)
    if arr.size == 0 and not isinstance(a, np.ndarray):
        arr = arr.astype(np.int64)  # np.asarray([]) is float64; an empty list is a valid index list
    if arr.dtype.kind not in "iu":  # (np.issubdtype(.., np.integer), without its ~1 us)
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got {arr.ndim} (shape {arr.shape})")
    return arr


def as_index_array(name: str, a, ndim: int = 1) -> np.ndarray:
    """Return ``a`` as a contiguous int32 NumPy array; reject non-integer input and int overflow.

    Values are range-checked in their own dtype before the conversion, so an int64 ``2**32 + 1``
    raises instead of wrapping to 1.
    """
    arr = as_integer_array(name, a, ndim)
    if arr.size and arr.dtype != _INT32:  # (int32 values are in range by their type)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            flat = arr.reshape(-1)
            bad = int(np.argmax((flat < INT32_MIN) | (flat > INT32_MAX)))
            raise ValueError(f"{name} has values outside the int32 range [{INT32_MIN}, "
                             f"{INT32_MAX}]: {name}[{bad}]={int(flat[bad])}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def check_indptr(name: str, indptr, *, length: int | None = None, total: int | None = None) -> np.ndarray:
    """Validate a CSR-style index pointer: int, 1-D, starts at 0, non-decreasing.

    ``length`` is the expected number of entries (rows + 1); ``total`` the expected last value.
    Returns the pointer as int32.
    """
    arr = as_index_array(name, indptr)
    if arr.size == 0:
        raise ValueError(f"{name} must have at least one entry (rows + 1), got an empty array")
    if length is not None and arr.size != length:
        raise ValueError(f"{name} must have length {length}, got {arr.size}")
    if arr[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {arr[0]}")
    steps = np.diff(arr)
    if np.any(steps < 0):
        bad = int(np.argmax(steps < 0))
        raise ValueError(
            f"{name} must be non-decreasing, but {name}[{bad + 1}]={arr[bad + 1]} < "
            f"{name}[{bad}]={arr[bad]}"
        )
    if total is not None and arr[-1] != total:
        raise ValueError(f"{name}[-1] must be {total}, got {arr[-1]}")
    return arr


def check_range(name: str, arr: np.ndarray, low: int, high: int) -> None:
    """Require every element of ``arr`` to lie in ``[low, high)``.

    Comparisons are exact for every integer dtype (uint64 included), so call it before narrowing.
    """
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < low or hi >= high:
        flat = arr.reshape(-1)
        bad = int(np.argmax((flat < low) | (flat >= high)))
        raise ValueError(
            f"{name} values must lie in [{low}, {high}), got {name}[{bad}]={int(flat[bad])}"
        )


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    """Require an integer ``>= minimum``; return it as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_choice(name: str, value, choices) -> None:
    """Require ``value`` to be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_heads(num_qo_heads: int, num_kv_heads: int) -> int:
    """Require a GQA-compatible head count; return the group size."""
    check_positive_int("num_qo_heads", num_qo_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_qo_heads % num_kv_heads:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_qo_heads // num_kv_heads


def check_scales(q_scale=None, k_scale=None, v_scale=None) -> tuple[float, float]:
    """FlashInfer's per-call scales of a quantised q / KV cache as ``(q_scale * k_scale,
    v_scale)``: each a finite real number, ``None`` meaning 1. The logits are ``q.k * sm_scale
    * q_scale * k_scale`` and the output is multiplied by ``v_scale``, which is attention over
    ``k * k_scale`` and ``v * v_scale`` without rescaling the cache."""
    if q_scale is None and k_scale is None and v_scale is None:
        return 1.0, 1.0  # every unquantised run(): no loop (run() is host-bound at batch 1)
    vals = []
    for name, x in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if x is None:
            vals.append(1.0)
            continue
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{name} must be a real number or None, got {type(x).__name__}")
        if not np.isfinite(x):
            raise ValueError(f"{name} must be finite, got {x}")
        vals.append(float(x))
    return vals[0] * vals[1], vals[2]


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """Resolve the softmax scale: ``None`` means ``1/sqrt(head_dim)``."""
    if sm_scale is None:
        return 1.0 / float(np.sqrt(head_dim))
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
    if not np.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    return float(sm_scale)
