"""Kernels for the decoder layer's operations around attention: RMSNorm (alone and fused with
the residual add), SiLU-and-multiply, and rotary embeddings from a cos/sin table
(:mod:`nbinfer.reference.layers` defines each).

Why they exist: a decode step of Llama-3.2-1B at batch 64 spent 0.81 of its 2.81 ms of GPU
time in a few hundred small elementwise kernels (bench/NOTES.md, issue 12): torch runs
``x + r``, the float32 casts, the norm, the two halves of RoPE and SiLU times up as separate
kernels of 1-3 us each, every one reading and writing its whole tensor. Each kernel here does
one of those groups in one pass: a token's row is read once and written once.

All three are pure bandwidth and latency: per token, RMSNorm reads and writes ``hidden`` values
(``2 x 2 x 2048`` B for the fused add at bf16, 16 KiB), SiLU-and-multiply reads ``2 I`` and
writes ``I`` values (``3 x 8192 x 2`` B = 48 KiB), RoPE reads and writes ``(Hq + Hk) D``
values and two ``R / 2`` float32 table entries. At batch 64 that is at most 3 MB a kernel, well
under a microsecond of HBM time: what they cost is their launch and one round trip of latency,
which is why fewer of them is the point.

Layout: one CTA per token row (grid ``x``), its threads striding over the row, so every load of
a warp is consecutive elements. Strides are run-time element counts (a row of a fused QKV
projection's output is wider than the q or k it holds); the last dimension is contiguous.

Every load of a pass comes before its first store. The outputs may alias the inputs (in-place
calls are FlashInfer's form), so the compiler issues no load ahead of an earlier store: a loop
that stored as it went made each element's loads wait for the previous element's round trip.
The norm holds its share of the row in registers (``NormSpec.items``) and RoPE eight pairs per
thread. The norm's sum of squares takes warp shuffles and one barrier on the GPU, a tree of
barriers in shared memory in the simulator (which has no shuffles). Measured inside a CUDA
graph on an H100 (``bench/layer_kernels.py``): the fused norm 4.0-4.2 us a launch against 5.05
for the loop that stored as it went, where an empty launch costs 2.3.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, types

from .common import FLOAT_DTYPES, STORAGE, compile_kernel
from .primitives import device_jit, primitives

LAYER_THREADS = 256
SIM_THREADS = 32  # the simulator's CTA (every simulated thread is an OS thread)
POS_DTYPES = ("int32", "int64")


def _check_dtype(name: str, value: str) -> None:
    if value not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {value!r}")


class _Threads:
    """A layer kernel's CTA size: :data:`LAYER_THREADS`, or :data:`SIM_THREADS` simulated."""

    @property
    def threads(self) -> int:
        return SIM_THREADS if self.sim else LAYER_THREADS


@dataclass(frozen=True)
class NormSpec(_Threads):
    """An RMSNorm kernel: activations' dtype, the weight's dtype (the model's, or float32),
    ``fused_add`` (the residual add first, FlashInfer's ``fused_add_rmsnorm``) and ``items``:
    the elements of a row each thread holds in registers (a power of two; rows of at most
    ``items * threads``), or 0 for a strided loop over rows of any length
    (:func:`norm_spec` picks it from the row length)."""

    dtype: str = "float16"
    weight_dtype: str = "float16"
    fused_add: bool = False
    sim: bool = False
    items: int = 0

    def __post_init__(self):
        _check_dtype("dtype", self.dtype)
        _check_dtype("weight_dtype", self.weight_dtype)
        if self.items not in (0, *NORM_ITEMS):
            raise ValueError(f"items must be 0 or one of {NORM_ITEMS}, got {self.items!r}")


NORM_ITEMS = (1, 2, 4, 8, 16, 32)  # registers per thread for the row (hidden <= 8192 at 256)


@functools.cache
def norm_spec(dtype: str, weight_dtype: str, fused_add: bool, sim: bool,
              hidden: int) -> NormSpec:
    """The RMSNorm spec for rows of ``hidden`` elements: the row in registers (``items``, the
    smallest power of two with ``items * threads >= hidden``) up to 32 per thread, else the
    strided loop."""
    threads = SIM_THREADS if sim else LAYER_THREADS
    need = -(-int(hidden) // threads)
    items = next((n for n in NORM_ITEMS if n >= need), 0)
    return NormSpec(dtype, weight_dtype, fused_add, sim, items)


@dataclass(frozen=True)
class SiluMulSpec(_Threads):
    """A SiLU-and-multiply kernel for one dtype."""

    dtype: str = "float16"
    sim: bool = False

    def __post_init__(self):
        _check_dtype("dtype", self.dtype)


@dataclass(frozen=True)
class RopeSpec(_Threads):
    """A rotary-embedding kernel: dtype, ``head_dim``, ``rotary_dim`` (the table's width, even,
    at most ``head_dim``), ``is_neox`` (halves; else interleaved pairs), the positions' integer
    type, and ``copy_rest``: out of place with ``rotary_dim < head_dim``, the unrotated
    dimensions are copied to the output too."""

    dtype: str = "float16"
    head_dim: int = 128
    rotary_dim: int = 128
    is_neox: bool = True
    pos_dtype: str = "int64"
    copy_rest: bool = False
    sim: bool = False

    def __post_init__(self):
        _check_dtype("dtype", self.dtype)
        if self.pos_dtype not in POS_DTYPES:
            raise ValueError(f"pos_dtype must be one of {POS_DTYPES}, got {self.pos_dtype!r}")
        if not (self.rotary_dim > 0 and self.rotary_dim % 2 == 0
                and self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim must be even and in 2..head_dim={self.head_dim}, got "
                             f"{self.rotary_dim}")


def layer_signature(spec):
    """The kernel signature of a :class:`NormSpec`, :class:`SiluMulSpec` or
    :class:`RopeSpec` (the builders' docstrings name the arguments)."""
    st = types.Array(STORAGE[spec.dtype], 1, "C")
    if isinstance(spec, NormSpec):
        wt = types.Array(STORAGE[spec.weight_dtype], 1, "C")
        return types.void(st, st, wt, st, int32, int64, int64, int64, float32)
    if isinstance(spec, SiluMulSpec):
        return types.void(st, st, int32, int64, int64)
    pt = types.Array(types.int32 if spec.pos_dtype == "int32" else types.int64, 1, "C")
    ft = types.Array(float32, 1, "C")
    return types.void(st, st, st, st, pt, ft, int32, int32, int64, *([int64] * 8))


def build_layer_kernel(spec):
    """The compiled kernel of any of the three specs."""
    return {NormSpec: build_rmsnorm_kernel, SiluMulSpec: build_silu_and_mul_kernel,
            RopeSpec: build_rope_kernel}[type(spec)](spec)


def _codec(dtype: str, sim: bool):
    """``(load, store)``: element -> float32 and float32 -> element (bf16 as int16 bits, round
    to nearest even)."""
    prims = primitives(sim)
    load = prims.convert[dtype]
    to_bf16 = prims.from_f32_bf16
    BF16 = dtype == "bfloat16"

    def store(arr, i, x):
        if BF16:
            arr[i] = to_bf16(x)
        else:
            arr[i] = x

    return load, (store if sim else device_jit(False)(store))


@functools.cache
def build_rmsnorm_kernel(spec: NormSpec):
    """Compile (once per spec) the RMSNorm kernel.

    Arguments: ``x, residual, weight, out`` (flat), ``hidden`` (int32), ``x_stride,
    residual_stride, out_stride`` (int64 elements between rows), ``eps`` (float32). Grid: one
    CTA of ``spec.threads`` per row. Plain: ``out = rmsnorm(x) * weight`` (``residual``
    unused). ``fused_add``: ``residual = round(residual + x)`` first, then ``out =
    rmsnorm(residual) * weight`` (``out`` may be ``x``: FlashInfer's in-place form). Sums are
    float32; the second pass re-reads what the first wrote or read (L1 / L2 hits).
    """
    load, store = _codec(spec.dtype, spec.sim)
    load_w = primitives(spec.sim).convert[spec.weight_dtype]
    tree_sum = _tree_sum(spec.threads, spec.sim)
    if spec.items:
        return _rmsnorm_in_registers(spec, load, store, load_w, tree_sum)
    T = spec.threads
    FUSED = spec.fused_add
    ZERO = float32(0.0)

    def rmsnorm(x, residual, weight, out, hidden, x_stride, residual_stride, out_stride, eps):
        row = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        part = cuda.shared.array(T, float32)
        xs, rs, os_ = row * x_stride, row * residual_stride, row * out_stride
        acc = ZERO
        for e in range(tid, hidden, T):
            v = load(x[xs + e])
            if FUSED:
                store(residual, rs + e, v + load(residual[rs + e]))
                v = load(residual[rs + e])  # normalise the sum as stored (rounded)
            acc += v * v
        scale = float32(1.0) / math.sqrt(tree_sum(part, tid, acc) / float32(hidden) + eps)
        for e in range(tid, hidden, T):
            v = load(residual[rs + e]) if FUSED else load(x[xs + e])
            store(out, os_ + e, v * scale * load_w(weight[e]))

    return compile_kernel("rmsnorm", spec, layer_signature(spec), lambda: rmsnorm)


def _tree_sum(threads: int, sim: bool):
    """``tree_sum(part, tid, acc)``: the block's sum of every thread's ``acc`` through the
    shared array ``part`` (``threads`` float32), log2(threads) barriers, every thread taking
    part and getting the sum."""
    LEVELS = int(math.log2(threads))

    def tree_sum(part, tid, acc):
        part[tid] = acc
        cuda.syncthreads()
        stride = threads // 2
        for _ in range(LEVELS):
            if tid < stride:
                part[tid] += part[tid + stride]
            cuda.syncthreads()
            stride //= 2
        return part[0]

    return tree_sum if sim else device_jit(False)(tree_sum)


def _rmsnorm_in_registers(spec: NormSpec, load, store, load_w, tree_sum):
    """RMSNorm with each thread's ``items`` elements of the row held in registers.

    Why: the strided loop stores the rounded sum to ``residual`` and reads it back before the
    next element's loads, and since the arrays may alias, no load can be issued ahead of an
    earlier store: a row of 2048 at 256 threads was eight dependent HBM round trips (~7.5 us a
    launch at batch 64 on the H200, 32 launches per Llama-3.2-1B step). Here every load of the
    row comes first (24 in flight per thread for the fused add at 2048: x, residual, weight),
    the sum is rounded in a register, and the stores come last: one round trip, and in-place
    calls stay correct since nothing is read after the first store. The block's sum of
    squares takes warp shuffles and one barrier on the GPU (the simulator, without shuffles,
    takes the tree of barriers).
    """
    T, K, FUSED, SIM = spec.threads, spec.items, spec.fused_add, spec.sim
    WARPS = T // 32
    ZERO = float32(0.0)
    BF16, F16 = spec.dtype == "bfloat16", spec.dtype == "float16"
    prims = primitives(SIM)
    to_bf16, from_bf16 = prims.from_f32_bf16, prims.convert["bfloat16"]

    def _rounded(v):
        # the value as the activations' dtype stores it (the strided loop's store and re-read)
        if BF16:
            return from_bf16(to_bf16(v))
        if F16:
            return float32(np.float16(v))
        return v

    rounded = _rounded if SIM else device_jit(False)(_rounded)

    def rmsnorm(x, residual, weight, out, hidden, x_stride, residual_stride, out_stride, eps):
        row = int64(cuda.blockIdx.x)
        tid = cuda.threadIdx.x
        part = cuda.shared.array(T, float32)
        vals = cuda.local.array(K, float32)
        wts = cuda.local.array(K, float32)
        xs, rs, os_ = row * x_stride, row * residual_stride, row * out_stride
        for i in range(K):  # every load first, the weight's too: one round trip for the row
            e = tid + i * T
            v = w = ZERO
            if e < hidden:
                v = load(x[xs + e])
                if FUSED:
                    v = v + load(residual[rs + e])
                w = load_w(weight[e])
            vals[i] = v
            wts[i] = w
        acc = ZERO
        for i in range(K):
            if FUSED:
                vals[i] = rounded(vals[i])  # normalise the sum as stored
            acc += vals[i] * vals[i]
        if SIM:
            total = tree_sum(part, tid, acc)
        else:
            off = 16
            while off >= 1:
                acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, off)
                off //= 2
            if tid % 32 == 0:
                part[tid // 32] = acc
            cuda.syncthreads()
            total = ZERO
            for w in range(WARPS):  # every thread sums the warps' partials (broadcast reads)
                total += part[w]
        scale = float32(1.0) / math.sqrt(total / float32(hidden) + eps)
        for i in range(K):
            e = tid + i * T
            if e < hidden:
                if FUSED:
                    store(residual, rs + e, vals[i])
                store(out, os_ + e, vals[i] * scale * wts[i])

    return compile_kernel("rmsnorm", spec, layer_signature(spec), lambda: rmsnorm)


@functools.cache
def build_silu_and_mul_kernel(spec: SiluMulSpec):
    """Compile (once per spec) SiLU-and-multiply.

    Arguments: ``x, out`` (flat), ``d`` (int32: half of x's row), ``x_stride, out_stride``
    (int64). Grid ``(rows, ceil(d / threads))``: ``out[r, e] = silu(x[r, e]) * x[r, d + e]``,
    in float32, rounded once.
    """
    load, store = _codec(spec.dtype, spec.sim)
    T = spec.threads
    ONE = float32(1.0)

    def silu_and_mul(x, out, d, x_stride, out_stride):
        row = int64(cuda.blockIdx.x)
        e = cuda.blockIdx.y * T + cuda.threadIdx.x
        if e >= d:
            return
        g = load(x[row * x_stride + e])
        u = load(x[row * x_stride + d + e])
        store(out, row * out_stride + e, g / (ONE + math.exp(-g)) * u)

    return compile_kernel("silu_and_mul", spec, layer_signature(spec), lambda: silu_and_mul)


@functools.cache
def build_rope_kernel(spec: RopeSpec):
    """Compile (once per spec) the rotary embedding of q and k from a cos/sin table.

    Arguments: ``q, q_out, k, k_out`` (flat; ``*_out`` may be the input: in place),
    ``positions`` (``pos_dtype``), ``table`` (float32 ``[max_position, rotary_dim]``, ``cos |
    sin``), ``num_q_heads, num_k_heads`` (int32), ``max_position`` (int64), then int64 element
    strides ``q_sn, q_sh, qo_sn, qo_sh, k_sn, k_sh, ko_sn, ko_sh`` (token, head). Grid: one CTA
    per token; its threads stride over the ``(Hq + Hk) x rotary_dim / 2`` pairs, eight pairs
    per thread loaded before any is stored. A position
    outside the table writes NaN to the token's rows, unrotated dimensions copied out of place
    included (and reads nothing of ``table``).
    """
    load, store = _codec(spec.dtype, spec.sim)
    T = spec.threads
    D, R = spec.head_dim, spec.rotary_dim
    HALF = R // 2
    NEOX = spec.is_neox
    COPY = spec.copy_rest and R < D
    NAN = float32(math.nan)
    UNROLL = 8

    def rope(q, q_out, k, k_out, positions, table, num_q_heads, num_k_heads, max_position,
             q_sn, q_sh, qo_sn, qo_sh, k_sn, k_sh, ko_sn, ko_sh):
        tok = int64(cuda.blockIdx.x)
        pos = int64(positions[tok])
        bad = pos < 0 or pos >= max_position
        row = (pos if not bad else int64(0)) * R
        pairs = (num_q_heads + num_k_heads) * HALF
        # UNROLL pairs per thread per pass, every load of a pass before its first store: the
        # outputs may alias the inputs, so a load is never issued ahead of an earlier store,
        # and one pair at a time made each pass a dependent round trip (Llama-3.2-1B's 1280
        # pairs at 256 threads: five). Here one pass holds up to 2048 pairs.
        va = cuda.local.array(UNROLL, float32)
        vb = cuda.local.array(UNROLL, float32)
        vc = cuda.local.array(UNROLL, float32)
        vs = cuda.local.array(UNROLL, float32)
        vdst = cuda.local.array(UNROLL, int64)
        for first in range(cuda.threadIdx.x, pairs, T * UNROLL):
            for u in range(UNROLL):
                p = first + u * T
                a = b = c = s = NAN  # (a position outside the table: NaN, no read of it)
                dst = int64(-1)
                if p < pairs:
                    h = p // HALF
                    i = p - h * HALF
                    ia, ib = (i, i + HALF) if NEOX else (2 * i, 2 * i + 1)
                    if h < num_q_heads:
                        src = tok * q_sn + h * q_sh
                        a = load(q[src + ia])
                        b = load(q[src + ib])
                        dst = tok * qo_sn + h * qo_sh
                    else:
                        h -= num_q_heads
                        src = tok * k_sn + h * k_sh
                        a = load(k[src + ia])
                        b = load(k[src + ib])
                        # k's rows after q's: told apart by the offset's sign
                        dst = -2 - (tok * ko_sn + h * ko_sh)
                    if not bad:
                        c = table[row + i]
                        s = table[row + HALF + i]
                va[u] = a
                vb[u] = b
                vc[u] = c
                vs[u] = s
                vdst[u] = dst
            for u in range(UNROLL):
                p = first + u * T
                if p < pairs:
                    h = p // HALF
                    i = p - h * HALF
                    ia, ib = (i, i + HALF) if NEOX else (2 * i, 2 * i + 1)
                    a, b, c, s, dst = va[u], vb[u], vc[u], vs[u], vdst[u]
                    if dst >= 0:
                        store(q_out, dst + ia, a * c - b * s)
                        store(q_out, dst + ib, b * c + a * s)
                    else:
                        store(k_out, -2 - dst + ia, a * c - b * s)
                        store(k_out, -2 - dst + ib, b * c + a * s)
        if COPY:  # the unrotated dimensions, out of place
            REST = D - R
            for p in range(cuda.threadIdx.x, (num_q_heads + num_k_heads) * REST, T):
                h = p // REST
                j = R + p - h * REST
                if h < num_q_heads:
                    if bad:
                        store(q_out, tok * qo_sn + h * qo_sh + j, NAN)
                    else:
                        q_out[tok * qo_sn + h * qo_sh + j] = q[tok * q_sn + h * q_sh + j]
                else:
                    h -= num_q_heads
                    if bad:
                        store(k_out, tok * ko_sn + h * ko_sh + j, NAN)
                    else:
                        k_out[tok * ko_sn + h * ko_sh + j] = k[tok * k_sn + h * k_sh + j]

    return compile_kernel("rope", spec, layer_signature(spec), lambda: rope)
