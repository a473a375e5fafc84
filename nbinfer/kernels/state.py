"""State-merge kernels behind the public ``merge_state`` family, with the LSE base in the spec.

nbinfer's LSEs are natural logs; FlashInfer's are base 2 (``s = log2 sum 2^x``). The spec carries
``lse_base`` so each base is compiled in, not converted in extra passes: the exponent is always
taken base 2, so a base-2 LSE is used as is and a natural one is multiplied by ``log2(e)`` on the
way in and ``ln(2)`` on the way out. (A scheduler's reduction map is contracted inside the
attention kernels, :mod:`.fused_merge`.)

Both kernels run one thread per ``VEC`` consecutive outputs of one (row, head) (16 bytes: 8
fp16/bf16 or 4 fp32 elements) on a 2-D grid: block ``x`` is the row, block ``y`` a chunk of the
row's ``H * D`` elements, so a thread finds its head by dividing by the compile-time ``head_dim``
(a shift) rather than by 64-bit divisions by run-time sizes. Each thread walks its states in
index order, so results are bitwise reproducible.

Bytes per output element: ``num_states`` values read (2 B fp16/bf16, 4 B fp32) plus the LSEs
(4 B per (row, head, state), shared through the cache by the ``D / VEC`` threads of the head),
one value written: a pure bandwidth kernel. One element (2 B) per thread left the H200 at about
1 TB/s: with at most 2048 threads per SM that is ~8 KiB of loads in flight per SM, far below
what 4.8 TB/s at ~600 ns latency needs (~3 MB over 132 SMs); ``VEC`` independent loads per
thread multiply the bytes in flight.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, types

from .common import FLOAT_DTYPES, ITEMSIZE, STORAGE, compile_kernel, state_finalize
from .primitives import LN2, LOG2E, device_jit, primitives

STATE_THREADS = 128
MAX_BLOCK = 1024
LSE_BASES = (2.0, math.e)


@dataclass(frozen=True)
class StateSpec:
    """What a state-merge kernel is compiled for: value dtype (in = out), head_dim, LSE base."""

    v_dtype: str = "float16"
    head_dim: int = 128
    lse_base: float = 2.0
    sim: bool = False
    # merge_pair writes its LSEs over ``sa`` (merge_state_in_place): a barrier between every
    # thread's read of its head's LSE and the write of the merged one
    in_place: bool = False

    def __post_init__(self):
        if self.v_dtype not in FLOAT_DTYPES:
            raise ValueError(f"v_dtype must be one of {FLOAT_DTYPES}, got {self.v_dtype!r}")
        if float(self.lse_base) not in LSE_BASES:
            raise ValueError(f"lse_base must be 2 or math.e, got {self.lse_base!r}")
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {self.head_dim}")
        if self.in_place and self.head_dim // self.vec > MAX_BLOCK:
            raise ValueError(f"an in-place merge keeps a head's {self.head_dim // self.vec} "
                             f"threads in one block: head_dim must be at most "
                             f"{MAX_BLOCK * self.vec} for {self.v_dtype}")

    @property
    def vec(self) -> int:
        """Elements per thread: 16 bytes (8 fp16/bf16, 4 fp32) when ``head_dim`` allows."""
        most = 16 // ITEMSIZE[self.v_dtype]
        return next(n for n in (8, 4, 2, 1) if n <= most and self.head_dim % n == 0)


def _codecs(spec: StateSpec):
    """(load, store, to_log2, from_log2) device functions for one spec."""
    prims = primitives(spec.sim)
    load = prims.convert[spec.v_dtype]
    to_bf16 = prims.from_f32_bf16
    OUT_BF16 = spec.v_dtype == "bfloat16"
    NATURAL = float(spec.lse_base) != 2.0
    F_LOG2E = float32(LOG2E)
    F_LN2 = float32(LN2)

    def store(out, i, x):
        if OUT_BF16:
            out[i] = to_bf16(x)
        else:
            out[i] = x

    def to_log2(s):
        # float32 constants only: a Python float literal would promote the math to float64.
        return s * F_LOG2E if NATURAL else s

    def from_log2(s):
        return s * F_LN2 if NATURAL else s

    if not spec.sim:
        device = device_jit(False)
        store, to_log2, from_log2 = device(store), device(to_log2), device(from_log2)
    return load, store, to_log2, from_log2


def _compile(kind: str, spec: StateSpec, fn, sig):
    return compile_kernel(kind, spec, sig, lambda: fn)


@functools.cache
def build_merge_pair(spec: StateSpec):
    """``merge_state``: ``(va, sa) + (vb, sb) -> (vo, so)``; ``mask[row] == 0`` keeps ``(va, sa)``.

    Arguments: ``va, sa, vb, sb, vo, so, mask (uint8 [rows], or size 0 to merge every row),
    num_heads`` with ``v* [rows * H * D]`` in ``v_dtype`` and ``s* [rows * H]`` float32 in
    ``lse_base``; launch with :func:`state_launch_config`. ``vo`` may alias ``va`` (each thread
    reads its elements before writing them); ``so`` may alias ``sa`` only with
    ``spec.in_place``, whose barrier holds the write of a head's LSE until every thread of the
    block (a block holds whole heads) has read it.
    """
    load, store, to_log2, from_log2 = _codecs(spec)
    exp2, finalize = primitives(spec.sim).exp2, state_finalize(spec.sim)
    D, VEC = spec.head_dim, spec.vec
    NEG_INF = float32(-np.inf)
    ZERO = float32(0.0)
    ONE = float32(1.0)

    IN_PLACE = spec.in_place

    def merge_pair(va, sa, vb, sb, vo, so, mask, num_heads):
        row = cuda.blockIdx.x
        e = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) * VEC  # element of the row
        # No early return: in place, every thread of the block must reach the barrier.
        active = e < num_heads * D
        row_head = row * num_heads + e // D
        lse = ZERO
        if active:
            t = row * num_heads * D + e
            keep = mask.size > 0 and mask[row] == 0
            a = cuda.local.array(VEC, float32)
            b = cuda.local.array(VEC, float32)
            # Every load before any store: vo may alias va, so the compiler could not move a
            # later load above an earlier store, and VEC loads in flight per thread is the
            # whole point.
            for k in range(VEC):
                a[k] = load(va[t + k])
                if not keep:
                    b[k] = load(vb[t + k])
            la = sa[row_head]
            lb = NEG_INF if keep else sb[row_head]
            wa, wb, lse = ONE, ZERO, la
            if not keep:
                ma = to_log2(la)
                mb = to_log2(lb)
                mmax = max(ma, mb)
                # Two empty states (both -inf): shift by 0 so the weights are 0, not NaN.
                mref = mmax if mmax > NEG_INF else ZERO
                wa = exp2(ma - mref)
                wb = exp2(mb - mref)
                # A NaN or +inf LSE makes den NaN (inf - inf): the merged row is NaN (the rule).
                inv, lse2 = finalize(mmax, wa + wb)
                wa, wb = wa * inv, wb * inv
                lse = from_log2(lse2)
            # An empty state (LSE -inf) is the identity: its values are never read (0 x NaN).
            use_a = keep or la != NEG_INF
            use_b = not keep and lb != NEG_INF
            for k in range(VEC):
                x = ZERO
                if use_a:
                    x = a[k] if keep else wa * a[k]
                if use_b:
                    x += wb * b[k]
                store(vo, t + k, x)
        if IN_PLACE:
            cuda.syncthreads()  # every thread of the block has read its head's sa (= so)
        if active and e % D == 0:
            so[row_head] = lse

    return _compile("merge_pair", spec, merge_pair, merge_signature("merge_pair", spec))


@functools.cache
def build_merge_stack(spec: StateSpec):
    """``merge_states``: ``v [rows, S, H, D]``, ``s [rows, S, H]`` -> ``vo [rows, H, D]``, ``so``.

    Arguments: ``v, s, vo, so, num_states, num_heads`` (flat arrays); launch with
    :func:`state_launch_config`. Two passes over the ``S`` LSEs (max, then weights) keep every
    exponent <= 0; with ``S == 0`` a row is empty: ``vo = 0``, ``so = -inf``.
    """
    load, store, to_log2, from_log2 = _codecs(spec)
    exp2, finalize = primitives(spec.sim).exp2, state_finalize(spec.sim)
    D, VEC = spec.head_dim, spec.vec
    NEG_INF = float32(-np.inf)
    ZERO = float32(0.0)

    def merge_stack(v, s, vo, so, num_states, num_heads):
        row = cuda.blockIdx.x
        e = (cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x) * VEC  # element of the row
        if e >= num_heads * D:
            return
        h = e // D
        d = e - h * D
        first = row * num_states  # state j of this row is partial row first + j
        mmax = NEG_INF
        for j in range(num_states):
            mmax = max(mmax, to_log2(s[(first + j) * num_heads + h]))
        mref = mmax if mmax > NEG_INF else ZERO
        acc = cuda.local.array(VEC, float32)
        for k in range(VEC):
            acc[k] = ZERO
        den = ZERO
        for j in range(num_states):
            p = (first + j) * num_heads + h
            if s[p] != NEG_INF:  # an empty state is the identity: its values are never read
                w = exp2(to_log2(s[p]) - mref)
                for k in range(VEC):  # VEC independent loads in flight per state
                    acc[k] += w * load(v[p * D + d + k])
                den += w
        inv, lse2 = finalize(mmax, den)
        out = row * num_heads * D + e
        for k in range(VEC):
            store(vo, out + k, acc[k] * inv)
        if d == 0:
            so[row * num_heads + h] = from_log2(lse2)

    return _compile("merge_stack", spec, merge_stack, merge_signature("merge_stack", spec))


def merge_signature(kind: str, spec: StateSpec):
    """The Numba signature of the ``"merge_pair"`` or ``"merge_stack"`` kernel of ``spec``
    (flat arrays and int32 scalars, as :func:`~.launch.launch_shared` binds them)."""
    vt = types.Array(STORAGE[spec.v_dtype], 1, "C")
    f32 = types.Array(float32, 1, "C")
    if kind == "merge_pair":
        return types.void(vt, f32, vt, f32, vt, f32, types.Array(types.uint8, 1, "C"), int32)
    if kind == "merge_stack":
        return types.void(vt, f32, vt, f32, int32, int32)
    raise ValueError(f"kind must be 'merge_pair' or 'merge_stack', got {kind!r}")


def state_launch_config(spec: StateSpec, rows: int, num_heads: int):
    """(grid, block) for ``rows`` rows of ``H * D`` outputs: grid ``(rows, chunks)``.

    Rows go on grid x (up to 2^31 - 1 blocks; y stops at 65535). A thread covers ``spec.vec``
    elements; a block holds whole heads, as many as fit in 128 threads (at least one, at most
    the row's), so that an in-place merge's barrier spans every thread of each of its heads.
    Only a head wider than :data:`MAX_BLOCK` threads spans blocks (never in place: StateSpec).
    """
    per_head = spec.head_dim // spec.vec
    block = min(max(1, min(int(num_heads), STATE_THREADS // per_head)) * per_head, MAX_BLOCK)
    threads = int(num_heads) * per_head
    return (max(int(rows), 1), max(-(-threads // block), 1)), (block,)
