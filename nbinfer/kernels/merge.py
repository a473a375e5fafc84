"""Merge kernels: the attention-state operator on the GPU, in a fixed order and without atomics.

``merge_rows`` contracts variable-length lists of partial states, driven by an index map
(``indptr``/``indices`` over partial rows, ``rows`` naming the output row each list produces).
It contracts a scheduler's reduction map as a separate launch (the decode kernel fuses the same
contraction into its last CTA per split row; prefill-sized partials use this kernel).
``merge_state`` / ``merge_states`` live in :mod:`nbinfer.kernels.state`.

One thread per (row, head, d); it walks its partials in index order, so the result is bitwise
reproducible. Bytes: each partial element is read once (4 B) plus its LSE (cached), each output
written once; FLOPs are negligible, so this is a pure bandwidth kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, types

from ..variants import Variant, standard
from .decode import STORAGE
from .hooks import device_hooks
from .primitives import LN2, LOG2E, primitives

MERGE_THREADS = 128


@dataclass(frozen=True)
class MergeSpec:
    """What a merge kernel is compiled for: value dtypes in/out, and the variant's output hook."""

    v_dtype: str = "float32"
    out_dtype: str = "float32"
    variant: Variant = standard()
    sim: bool = False


def _loader(prims, dtype):
    return {"float16": prims.f16, "bfloat16": prims.bf16, "float32": prims.f32}[dtype]


@functools.cache
def build_merge_rows(spec: MergeSpec):
    """Variable-length merge: ``v [P*H*D]``, ``s [P*H]`` (natural-log LSE) -> ``o``, ``lse``.

    Arguments: ``v, s, indptr [M+1], indices [nnz], rows [M], o [*H*D], lse [*H] (float32),
    num_heads, head_dim, total`` where ``total = M * H * D`` is the thread count.
    Softmax variants merge with the operator; non-softmax variants (sigmoid) sum.
    """
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    value = _loader(prims, spec.v_dtype)
    OUT_BF16 = spec.out_dtype == "bfloat16"
    SOFTMAX = hooks.use_softmax
    HAS_OUT = hooks.has_output
    hook_output = hooks.output
    exp2, log2, to_bf16 = prims.exp2, prims.log2, prims.from_f32_bf16
    NEG_INF = float32(-np.inf)
    ZERO = float32(0.0)
    F_LOG2E = float32(LOG2E)
    F_LN2 = float32(LN2)

    def merge_rows(v, s, indptr, indices, rows, o, lse, num_heads, head_dim, total):
        t = cuda.grid(1)
        if t >= total:
            return
        d = t % head_dim
        h = (t // head_dim) % num_heads
        i = t // (head_dim * num_heads)
        lo = indptr[i]
        hi = indptr[i + 1]
        mmax = NEG_INF
        if SOFTMAX:
            for j in range(lo, hi):
                mmax = max(mmax, s[indices[j] * num_heads + h] * F_LOG2E)
        mref = mmax if mmax > NEG_INF else ZERO
        num = ZERO
        den = ZERO
        for j in range(lo, hi):
            p = indices[j]
            x = value(v[(p * num_heads + h) * head_dim + d])
            if SOFTMAX:
                w = exp2(s[p * num_heads + h] * F_LOG2E - mref)
                num += w * x
                den += w
            else:
                num += x
        if SOFTMAX:
            out = num / den if den > ZERO else ZERO
            lse_val = (mmax + log2(den)) * F_LN2 if den > ZERO else NEG_INF
        else:
            out = num
            lse_val = ZERO
        if HAS_OUT:
            out = float32(hook_output(out, lse_val, h))
        row = rows[i]
        if OUT_BF16:
            o[(row * num_heads + h) * head_dim + d] = to_bf16(out)
        else:
            o[(row * num_heads + h) * head_dim + d] = out
        if d == 0:
            lse[row * num_heads + h] = lse_val

    if sim:
        return cuda.jit(merge_rows)
    return cuda.jit(merge_rows_signature(spec), fastmath=True)(merge_rows)


def merge_rows_signature(spec: MergeSpec):
    """The explicit signature :func:`build_merge_rows` compiles with."""
    vt = types.Array(STORAGE[spec.v_dtype], 1, "C")
    ot = types.Array(STORAGE[spec.out_dtype], 1, "C")
    i32 = types.Array(int32, 1, "C")
    f32 = types.Array(float32, 1, "C")
    return types.void(vt, f32, i32, i32, i32, ot, f32, int32, int32, int32)


def merge_launch_config(total: int):
    """(grid, block) for a merge over ``total`` output elements."""
    return (max((int(total) + MERGE_THREADS - 1) // MERGE_THREADS, 1),), (MERGE_THREADS,)
