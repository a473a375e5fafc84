"""Compile a variant's scalar hooks into device functions that kernels capture as closures.

This is nbinfer's JIT: a :class:`~nbinfer.variants.Variant` holds plain Python functions; here each
becomes a ``cuda.jit(device=True)`` function and the hooks of one kind are chained into a single
device function. A kernel factory captures the chain, so the hook is inlined into the kernel and a
variant costs no run-time branch. Under the simulator the same Python functions run as they are.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from ..variants import Variant
from .primitives import device_jit


def _chain(fns, jit, link):
    """One device function for the hooks ``fns`` of one kind, applied in order.

    ``link(f, rest)`` returns the Python function that runs hook ``f`` and then the chain ``rest``
    of the remaining hooks; it is jitted like the hooks, so the whole chain inlines into a kernel.
    """
    f = jit(fns[0])
    if len(fns) == 1:
        return f
    return jit(link(f, _chain(fns[1:], jit, link)))


def _link_vector(f, rest):
    # A vector transform sees its element and the element's rotation partner; when two transforms
    # chain, the second must see the partner as transformed by the first, so the first runs twice.
    def chained(x, x_pair, d, head_dim, pos, head):
        y = f(x, x_pair, d, head_dim, pos, head)
        y_pair = f(x_pair, x, (d + head_dim // 2) % head_dim, head_dim, pos, head)
        return rest(y, y_pair, d, head_dim, pos, head)

    return chained


# Logits and output transforms map their first argument and pass the others through; masks AND.
# (Numba's inliner takes no *args, so each kind spells out its own signature.)
def _link_logits(f, rest):
    def chained(s, q_pos, kv_pos, qo_head):
        return rest(f(s, q_pos, kv_pos, qo_head), q_pos, kv_pos, qo_head)

    return chained


def _link_mask(f, rest):
    def chained(q_pos, kv_pos, qo_head):
        return f(q_pos, kv_pos, qo_head) and rest(q_pos, kv_pos, qo_head)

    return chained


def _link_output(f, rest):
    def chained(o, lse, qo_head):
        return rest(f(o, lse, qo_head), lse, qo_head)

    return chained


@functools.cache
def device_hooks(variant: Variant, sim: bool):
    """Device functions for ``variant``: one chained function per hook kind, identity if absent.

    The namespace also carries ``has_query``, ``has_key``, ``has_logits``, ``has_mask``,
    ``has_output`` and ``use_softmax`` so kernels can drop unused work at build time.
    """
    jit = device_jit(sim)

    def vec_identity(x, x_pair, d, head_dim, pos, head):
        return x

    def logits_identity(s, q_pos, kv_pos, qo_head):
        return s

    def keep_all(q_pos, kv_pos, qo_head):
        return True

    def output_identity(o, lse, qo_head):
        return o

    def pick(kind, link, identity):
        fns = getattr(variant, kind)
        return _chain(fns, jit, link) if fns else jit(identity)

    return SimpleNamespace(
        query=pick("query_transform", _link_vector, vec_identity),
        key=pick("key_transform", _link_vector, vec_identity),
        logits=pick("logits_transform", _link_logits, logits_identity),
        mask=pick("logits_mask", _link_mask, keep_all),
        output=pick("output_transform", _link_output, output_identity),
        has_query=bool(variant.query_transform),
        has_key=bool(variant.key_transform),
        has_logits=bool(variant.logits_transform),
        has_mask=bool(variant.logits_mask),
        has_output=bool(variant.output_transform),
        use_softmax=variant.use_softmax,
    )
