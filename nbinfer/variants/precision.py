"""A hook's working precision: float64 in the reference engine, float32 in a kernel.

The reference engine evaluates every hook in float64 and the kernels compile the very same
function with float32 data. Most hooks need nothing more: their float32 constants keep a
kernel in float32 while the reference computes exactly. A hook that needs float64 for part of
its work (RoPE's angle, ``pos * freq``, reaches 1e5 radians) would otherwise stay in float64
for the rest too, and a kernel's float64 sine and cosine cost a tenth of the decode's bandwidth.
:func:`as_type_of` ends the float64 part: ``as_type_of(value, x)`` is ``value`` converted to
``x``'s float type, so the kernel continues in float32 and the reference in float64.

Numba compiles it through an overload registered on first use (:func:`register`, called before
hooks are compiled for the CPU or a GPU), so ``import nbinfer`` does not import Numba; plain
Python (the simulator, a direct call) returns ``value`` unchanged.
"""

from __future__ import annotations

import numpy as np

_REGISTERED: set = set()


def as_type_of(value, x):
    """``value`` in the float type of ``x``: float32 when ``x`` is a float32 (a kernel's data),
    unchanged otherwise (the float64 reference; plain Python)."""
    # Compiled code runs _implementation's rule, not this body. Reading it here (a name load
    # that python -O keeps, unlike an assert) puts its code into the key of every hook that
    # calls as_type_of (variants.spec._function_key keys the globals a hook reads,
    # recursively), so a changed rule is a different kernel on disk.
    _implementation  # noqa: B018
    return value


def register(target: str) -> None:
    """Register :func:`as_type_of` with Numba's ``"cpu"`` target (the reference engine's hooks)
    or its ``"cuda"`` target (kernels), once per process each; the CPU registration does not
    load Numba's CUDA modules."""
    if target in _REGISTERED:
        return
    if target == "cpu":
        from numba.core import types
        from numba.core.extending import overload
    elif target == "cuda":
        try:
            from numba.cuda import types
            from numba.cuda.extending import overload
        except ImportError:  # pragma: no cover - a numba-cuda sharing numba's type system
            from numba.core import types
            from numba.core.extending import overload
    else:
        raise ValueError(f"target must be 'cpu' or 'cuda', got {target!r}")
    overload(as_type_of)(_implementation(types))
    _REGISTERED.add(target)


def _implementation(types):
    def as_type_of_impl(value, x):
        if isinstance(x, types.Float) and x.bitwidth == 32:
            return lambda value, x: np.float32(value)
        return lambda value, x: value

    return as_type_of_impl


__all__ = ["as_type_of", "register"]
