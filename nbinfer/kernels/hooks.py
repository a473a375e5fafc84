"""Compile a variant's scalar hooks into device functions that kernels capture as closures.

This is nbinfer's JIT: a :class:`~nbinfer.variants.Variant` holds plain Python functions; here each
becomes a ``cuda.jit(device=True)`` function and the hooks of one kind are chained into a single
device function. A kernel factory captures the chain, so the hook is inlined into the kernel and a
variant costs no run-time branch. Under the simulator the same Python functions run as they are.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import cuda

from ..variants import Variant


def _jit(sim: bool):
    if sim:
        return cuda.jit(device=True)
    return cuda.jit(device=True, inline="always")


def _chain_vector(fns, jit):
    # A vector transform sees its element and the element's rotation partner; when two transforms
    # chain, the second must see the partner as transformed by the first, so the first runs twice.
    f = jit(fns[0])
    if len(fns) == 1:
        return f
    rest = _chain_vector(fns[1:], jit)

    def chained(x, x_pair, d, head_dim, pos, head):
        y = f(x, x_pair, d, head_dim, pos, head)
        y_pair = f(x_pair, x, (d + head_dim // 2) % head_dim, head_dim, pos, head)
        return rest(y, y_pair, d, head_dim, pos, head)

    return jit(chained)


def _chain_logits(fns, jit):
    f = jit(fns[0])
    if len(fns) == 1:
        return f
    rest = _chain_logits(fns[1:], jit)

    def chained(s, q_pos, kv_pos, qo_head):
        return rest(f(s, q_pos, kv_pos, qo_head), q_pos, kv_pos, qo_head)

    return jit(chained)


def _chain_mask(fns, jit):
    f = jit(fns[0])
    if len(fns) == 1:
        return f
    rest = _chain_mask(fns[1:], jit)

    def chained(q_pos, kv_pos, qo_head):
        return f(q_pos, kv_pos, qo_head) and rest(q_pos, kv_pos, qo_head)

    return jit(chained)


def _chain_output(fns, jit):
    f = jit(fns[0])
    if len(fns) == 1:
        return f
    rest = _chain_output(fns[1:], jit)

    def chained(o, lse, qo_head):
        return rest(f(o, lse, qo_head), lse, qo_head)

    return jit(chained)


@functools.cache
def device_hooks(variant: Variant, sim: bool):
    """Device functions for ``variant``: one chained function per hook kind, identity if absent.

    The namespace also carries ``has_query``, ``has_key``, ``has_logits``, ``has_mask``,
    ``has_output`` and ``use_softmax`` so kernels can drop unused work at build time.
    """
    jit = _jit(sim)

    def vec_identity(x, x_pair, d, head_dim, pos, head):
        return x

    def logits_identity(s, q_pos, kv_pos, qo_head):
        return s

    def keep_all(q_pos, kv_pos, qo_head):
        return True

    def output_identity(o, lse, qo_head):
        return o

    def pick(kind, chain, identity):
        fns = getattr(variant, kind)
        return chain(fns, jit) if fns else jit(identity)

    return SimpleNamespace(
        query=pick("query_transform", _chain_vector, vec_identity),
        key=pick("key_transform", _chain_vector, vec_identity),
        logits=pick("logits_transform", _chain_logits, logits_identity),
        mask=pick("logits_mask", _chain_mask, keep_all),
        output=pick("output_transform", _chain_output, output_identity),
        has_query=bool(variant.query_transform),
        has_key=bool(variant.key_transform),
        has_logits=bool(variant.logits_transform),
        has_mask=bool(variant.logits_mask),
        has_output=bool(variant.output_transform),
        use_softmax=variant.use_softmax,
    )
