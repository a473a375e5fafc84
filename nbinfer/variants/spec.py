"""The attention-variant specification: scalar hooks that kernels capture as closures.

An attention variant changes *what* attention computes without changing *how* the engine moves
data. nbinfer describes a variant as a small, hashable spec of pure scalar Python functions
(hooks). The same spec is

* compiled into the GPU kernels (each hook becomes a captured ``cuda.jit(device=True)`` function,
  so it is inlined, not branched on at run time),
* run by the CUDA simulator on the CPU, and
* evaluated in float64 by the reference engine (``nbinfer.reference``).

Hook contracts (every argument is a scalar; positions are absolute token positions, so a query of a
prefill whose KV is longer than its query sits at ``qo_idx + kv_len - qo_len``):

``query_transform(x, x_pair, d, head_dim, pos, head) -> float``
    Rewrite element ``d`` of a query vector before the dot product. ``x_pair`` is element
    ``(d + head_dim // 2) % head_dim`` of the same vector (what rotary embeddings need).
``key_transform(x, x_pair, d, head_dim, pos, head) -> float``
    The same for keys; ``head`` is the KV head.
``logits_transform(s, q_pos, kv_pos, qo_head) -> float``
    Rewrite a logit ``s = sm_scale * (q . k)``.
``logits_mask(q_pos, kv_pos, qo_head) -> bool``
    ``True`` keeps the pair, ``False`` removes it (the logit becomes -inf; without softmax its
    weight becomes 0).
``output_transform(o, lse, qo_head) -> float``
    Rewrite one element of the final output, given the natural-log LSE of the final state. It runs
    once per output row, after all partial states are merged.

Hooks must be written for Numba: ``math`` functions, arithmetic, comparisons, and indexing into
captured NumPy arrays. Capture constants as ``numpy.float32`` so that GPU code does not silently
promote to float64; a hook that needs float64 for part of its work ends it with
:func:`~nbinfer.variants.precision.as_type_of` (``as_type_of(value, x)``: float32 in a kernel,
unchanged in the float64 reference), as RoPE does for its angle. A variant's identity (its
hash) is its name, its parameters, ``use_softmax`` and, for each hook, its code, the values it
closes over and the globals it reads (what Numba freezes into compiled code), so two calls of
the same factory with the same parameters give equal specs and share compiled kernels. Captured
arrays count by content at the time the spec is built: do not mutate them afterwards.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

HOOK_KINDS = (
    "query_transform",
    "key_transform",
    "logits_transform",
    "logits_mask",
    "output_transform",
)

# Number of scalar arguments each hook takes; checked when a spec is built.
HOOK_ARITY = {
    "query_transform": 6,
    "key_transform": 6,
    "logits_transform": 4,
    "logits_mask": 3,
    "output_transform": 3,
}

_VARARGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS


class _Identity:
    """Key for a value that has no content-based key: equal only to itself, and keeps it alive
    (so its ``id`` cannot be reused by another object while a spec or cache holds the key)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self):
        return id(self.value)


def _scalar_key(value):
    # Typed, so that 1, 1.0 and True (equal in Python, different types to Numba) differ; floats
    # by their exact bits, so that -0.0 differs from 0.0 and a NaN equals itself.
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    return (type(value).__name__, value)


def _value_key(value, seen=frozenset()):
    """A hashable, content-based key for a value a hook captures (closure cell or global)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, types.FunctionType):
        return _function_key(value, seen)
    if isinstance(value, np.generic):
        return ("numpy", type(value).__name__, _value_key(value.item(), seen))
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return _scalar_key(value)
    if isinstance(value, tuple):
        return ("tuple", tuple(_value_key(v, seen) for v in value))
    try:
        hash(value)
    except TypeError:
        return ("identity", _Identity(value))
    return ("object", value)


def _global_names(code: types.CodeType):
    """Names a code object (and any code nested in it) may load from its globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _function_key(fn: Callable, seen=frozenset()) -> tuple:
    """Identify a hook by its code, the values it closes over and the globals it reads.

    Not by object identity: two calls of a factory give equal keys. Globals count because Numba
    freezes them into the compiled code as constants: a notebook that changes ``T = 2.0`` and
    redefines ``def hook(...): return s / T`` must not get the kernel compiled for the old ``T``.
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"hook must be a plain Python function, got {type(fn).__name__}")
    code = fn.__code__
    if id(fn) in seen:  # recursion through a closure cell or a global
        return ("recursive", code)
    seen = seen | {id(fn)}
    cells = []
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name assigned after the hook was defined)
            cells.append(("empty-cell",))
        else:
            cells.append(_value_key(value, seen))
    glob = fn.__globals__
    used = tuple(
        (name, _value_key(glob[name], seen)) for name in sorted(_global_names(code)) if name in glob
    )
    return (code, tuple(cells), used)


def _check_hooks(kind: str, hooks) -> tuple:
    if callable(hooks):
        hooks = (hooks,)
    try:
        hooks = tuple(hooks)
    except TypeError:
        raise TypeError(
            f"{kind} must be a function or a sequence of functions, got {type(hooks).__name__}"
        ) from None
    for fn in hooks:
        if not isinstance(fn, types.FunctionType):
            raise TypeError(f"{kind}: expected a plain Python function, got {type(fn).__name__}")
        code = fn.__code__
        n = code.co_argcount
        if n != HOOK_ARITY[kind] or code.co_kwonlyargcount or code.co_flags & _VARARGS:
            raise ValueError(
                f"{kind} hook {fn.__name__!r} must take exactly {HOOK_ARITY[kind]} positional "
                f"arguments, takes {n}"
                + (" and *args/**kwargs/keyword-only ones" if n == HOOK_ARITY[kind] else "")
            )
    return hooks


@dataclass(frozen=True, eq=False)
class Variant:
    """A hashable attention-variant spec.

    Parameters
    ----------
    name : str
        Readable name, used in kernel cache keys and reprs (``"soft_cap_30"``).
    params : tuple of (str, value) pairs
        Named parameters, for display and identity. Values must be hashable (use tuples, not lists).
    query_transform, key_transform, logits_transform, logits_mask, output_transform : tuple
        Functions (hooks) of each kind, applied in order (masks are AND-ed). Empty means
        identity / keep all. A single function may be passed instead of a tuple.
    use_softmax : bool
        ``True``: normalise with softmax (online, with an (m, l) state). ``False``: the output is
        the plain sum ``sum_j w_j v_j`` of the transformed logits ``w_j`` (FlashSigmoid-style).
    """

    name: str
    params: tuple = ()
    query_transform: tuple = ()
    key_transform: tuple = ()
    logits_transform: tuple = ()
    logits_mask: tuple = ()
    output_transform: tuple = ()
    use_softmax: bool = True
    _key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.use_softmax, bool):
            raise TypeError(f"use_softmax must be bool, got {type(self.use_softmax).__name__}")
        params = tuple(self.params)
        for item in params:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"params must be (name, value) pairs, got {item!r}")
            try:
                hash(item[1])
            except TypeError:
                raise TypeError(
                    f"parameter {item[0]!r} must be hashable, got {item[1]!r}"
                ) from None
        object.__setattr__(self, "params", params)
        for kind in HOOK_KINDS:
            object.__setattr__(self, kind, _check_hooks(kind, getattr(self, kind)))
        hook_keys = tuple(tuple(_function_key(f) for f in getattr(self, k)) for k in HOOK_KINDS)
        object.__setattr__(self, "_key", (self.name, params, self.use_softmax, hook_keys))
        # computed once: specs holding the variant are dictionary keys of every plan() and
        # run() memo, and the key is a nested tuple of the hooks' code keys
        object.__setattr__(self, "_hash", hash(self._key))

    def __hash__(self):
        return self._hash

    def __getstate__(self):
        # str hashes differ between processes (PYTHONHASHSEED): an unpickled variant (warmup's
        # worker processes) recomputes its hash instead of carrying its parent's
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_hash", hash(self._key))

    def __eq__(self, other):
        return isinstance(other, Variant) and self._key == other._key

    def __repr__(self):
        ps = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"Variant({self.name}{': ' + ps if ps else ''})"

    @property
    def is_standard(self) -> bool:
        """True when the variant adds no hook and uses softmax (plain scaled dot-product)."""
        return self.use_softmax and not any(getattr(self, k) for k in HOOK_KINDS)

    def param(self, name: str):
        """Return the value of parameter ``name``."""
        for k, v in self.params:
            if k == name:
                return v
        raise KeyError(f"variant {self.name!r} has no parameter {name!r}")

    def __add__(self, other: Variant) -> Variant:
        return compose(self, other)


def compose(*variants: Variant, name: str | None = None) -> Variant:
    """Combine variants into one: transforms chain left to right, masks are AND-ed.

    ``compose(causal(), soft_cap(30.0))`` is Gemma-2-style causal soft-capped attention.

    ``use_softmax``: a variant that uses softmax but has no output transform (masks, RoPE, ALiBi,
    soft cap, the standard variant) is well defined under either normalisation, so it composes
    with a no-softmax variant and the result has no softmax (``compose(causal(),
    sigmoid_attention())`` is causal sigmoid attention). An output transform reads the softmax
    LSE, so a softmax variant with one (attention sinks) and a no-softmax variant disagree, and
    composing them raises ``ValueError``.
    """
    if not variants:
        raise ValueError("compose needs at least one variant")
    for v in variants:
        if not isinstance(v, Variant):
            raise TypeError(f"compose takes Variant objects, got {type(v).__name__}")
    parts = [v for v in variants if not v.is_standard] or [variants[0]]
    use_softmax = all(v.use_softmax for v in parts)
    needs_softmax = [v.name for v in parts if v.use_softmax and v.output_transform]
    if not use_softmax and needs_softmax:
        no_softmax = [v.name for v in parts if not v.use_softmax]
        raise ValueError(
            f"cannot compose variants that disagree on use_softmax: {needs_softmax} need softmax "
            f"(their output transform reads its LSE), {no_softmax} use none"
        )
    hooks = {k: tuple(f for v in parts for f in getattr(v, k)) for k in HOOK_KINDS}
    return Variant(
        name=name or "+".join(v.name for v in parts),
        params=tuple(p for v in parts for p in v.params),
        use_softmax=use_softmax,
        **hooks,
    )
