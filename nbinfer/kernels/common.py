"""What every attention kernel shares: the spec base, storage types, the argument list, the plan
sections it reads, the compile options and the one state finalize.

The decode kernel (:mod:`.decode`) and both prefill kernels (:mod:`.prefill`,
:mod:`.prefill_mma`) take the same leading arguments, named in :data:`ATTENTION_ARGS`, then the
word offsets of the plan sections they read (:data:`DECODE_PLAN_SECTIONS`,
:data:`PREFILL_PLAN_SECTIONS`) inside the int32 ``plan`` array. The api binds arguments by these
names, never by position.

Strides are arguments, not constants: q and the KV may be strided views (a q sliced out of a
fused QKV tensor, a cache that is a slice of a larger pool) as long as the last dimension is
contiguous. Per token the kernels add ``pos * kv_stride_n`` (plus ``page * page_stride`` when
paged) to ``hk * kv_stride_h``; per query row ``row * q_stride_n + head * q_stride_h``. All are
element counts; cp.async moves 16 bytes at a time, so the KV strides must be multiples of
16 bytes (checked on the host).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, types
from numba.core.types import float16

from ..variants import Variant
from .primitives import FASTMATH, LN2, device_jit, primitives

HEAD_DIMS = (64, 128, 256)
# Queries, outputs and every float state: the float dtypes. A KV cache may also hold FP8 codes
# (nbinfer.reference.fp8), which the kernels decode on load; the scales are run-time scalars.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
KV_DTYPES = FLOAT_DTYPES + FP8_DTYPES
# Numba storage type of each dtype: bf16 travels as its raw bits, FP8 as its codes.
STORAGE = {"float16": float16, "bfloat16": types.int16, "float32": float32,
           "float8_e4m3fn": types.uint8, "float8_e5m2": types.uint8}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
# The scheduler's work table (nbinfer.scheduler): request, kv_head, qo_start, qo_end, kv_start,
# kv_end, partial_row (-1: write the output directly).
WORK_FIELDS = 7

# The leading arguments of every attention kernel, in order (then the plan-section offsets).
# The scales follow FlashInfer's folding: ``sm_scale`` already holds ``q_scale * k_scale`` (a
# scalar on the logits is a scalar on K), and ``v_scale`` multiplies the normalised output (and
# every partial state, which the merge combines linearly), so a quantised cache is never
# rescaled in memory.
ATTENTION_ARGS = ("q", "k", "v", "kv_indptr", "kv_indices", "kv_last_page_len", "plan", "o",
                  "lse", "tmp_o", "tmp_lse", "counters", "num_kv_heads", "page_stride",
                  "kv_stride_n", "kv_stride_h", "q_stride_n", "q_stride_h", "sm_scale", "v_scale")
ARG = {name: i for i, name in enumerate(ATTENTION_ARGS)}
DECODE_PLAN_SECTIONS = ("work", "cta_indptr", "cta_work", "merge_rows", "merge_indptr",
                        "merge_indices", "item_merge")
PREFILL_PLAN_SECTIONS = DECODE_PLAN_SECTIONS + ("qo_indptr", "mask_indptr", "mask_words",
                                                "q_pos0", "qo_end", "value_flags")
# The value scan (:mod:`.value_scan`) splits each (request, kv head) pair's KV into this many
# parts, one flag each: ``value_flags`` holds ``[B * Hkv * VALUE_SCAN_SPLITS]`` words.
VALUE_SCAN_SPLITS = 8

@dataclass(frozen=True)
class AttentionSpec:
    """What every attention kernel is compiled for (hashable: part of the kernel cache key):
    shapes, storage dtypes, layout, variant, paged (``sparse``) or affine KV, and the target."""

    head_dim: int
    group_size: int
    page_size: int
    kv_dtype: str
    q_dtype: str
    kv_layout: str
    variant: Variant
    sparse: bool = True
    sim: bool = False

    # Largest GQA group the kernel's tile holds (subclasses).
    max_group = 32

    def __post_init__(self):
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")
        if not 1 <= self.group_size <= self.max_group:
            raise ValueError(f"group size (num_qo_heads // num_kv_heads) must be in "
                             f"[1, {self.max_group}], got {self.group_size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        for name, allowed in (("kv_dtype", KV_DTYPES), ("q_dtype", FLOAT_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        if self.kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {self.kv_layout!r}")


def attention_signature(kv_dtype: str, q_dtype: str, num_offsets: int):
    """The signature of the plan-driven attention kernels: :data:`ATTENTION_ARGS` typed, then
    ``num_offsets`` int32 word offsets into ``plan``."""
    kv = types.Array(STORAGE[kv_dtype], 1, "C")
    qo = types.Array(STORAGE[q_dtype], 1, "C")
    i32 = types.Array(int32, 1, "C")
    f32 = types.Array(float32, 1, "C")
    return types.void(qo, kv, kv, i32, i32, i32, i32, qo, f32, f32, f32, i32,
                      int32, int64, int64, int64, int64, int64, float32, float32,
                      *([int32] * num_offsets))


def compile_kernel(kind: str, spec, signature, build, module: str | None = None, **options):
    """The kernel ``build()`` (a zero-argument function returning the Python kernel) for
    ``spec``: in the simulator a lazily compiled Numba kernel; on the GPU a
    :class:`~.compiled.CompiledKernel` for ``signature`` with :data:`FASTMATH` (and
    ``options``), from the persistent disk cache when it holds this kernel (:mod:`.cache`),
    else compiled and stored. ``kind`` names the kernel and ``module`` (default: where
    ``build`` is defined) the source it is built from, in the cache key."""
    if spec.sim:
        return cuda.jit(build())
    from .compiled import gpu_kernel

    return gpu_kernel(kind, spec, signature, build, dict(options, fastmath=set(FASTMATH)),
                      module or build.__module__)


@functools.cache
def state_finalize(sim: bool):
    """``finalize(m, den) -> (inv, lse2)``: the end of every softmax state, written once.

    ``m`` is the running maximum and ``den`` the running sum of ``exp2(x - m)``, both in log2
    units; returns the factor that normalises the accumulated output and the log-sum-exp, still
    in log2 units (multiply by ln 2 for nbinfer's natural LSE):

    - ``den > 0``: ``(1 / den, m + log2(den))``;
    - ``den == 0`` (no kept key; an empty state): ``(0, -inf)``, so O = 0, never NaN;
    - ``den`` NaN (a NaN logit or LSE reached the sum): ``(NaN, NaN)``, so the row's output and
      LSE are NaN, as in the reference engine.
    """
    log2 = primitives(sim).log2
    ZERO = float32(0.0)
    ONE = float32(1.0)
    NEG_INF = float32(-np.inf)
    jit_dev = device_jit(sim)

    @jit_dev
    def finalize(m, den):
        if den > ZERO:
            return ONE / den, m + log2(den)
        if den == ZERO:
            return ZERO, NEG_INF
        return den, den  # NaN

    return finalize


F_LN2 = float32(LN2)

# The non-finite rule for masked keys (README, Conventions): a key that a row does not keep
# (masked, or past the range) must not reach the row even when its V holds NaN or inf, yet its V
# sits in the same shared-memory tile as kept keys, and ``0 * NaN`` is NaN. A kept key is read
# whatever its weight: its non-finite V poisons the row even when the variant set its logit to
# -inf. Kernels whose keep set can differ from "every key in range" (a mask hook or a custom
# mask) therefore guard the p.V product:
# the CUDA-core kernels skip ``p == 0`` there and mark a kept key of weight 0 by
# ``p = KEPT_FLOOR`` (2^-126, the smallest normal float32) in the p.V product only, never in the
# softmax sum; a softmax logit of -inf of a kept key travels as KEPT_LOGIT (-FLT_MAX) to stay
# apart from the masked ones (its weight is then set to exactly 0). KEPT_FLOOR times a finite V
# is below 1e-33, under fp16/fp32 resolution; times NaN or inf it poisons the row, as the rule
# says. :func:`kept_weights` is that encoding, written once.
# The tensor-core prefill kernel cannot skip a key inside its P.V mma, and every guard inside its
# loop cost 12-54 % of causal throughput (bench/NOTES.md). So it stays unguarded and a masked
# spec runs as three launches over one argument block (:mod:`.value_scan`): a scan flags each
# (request, kv head) whose V holds a non-finite value, the fast kernel runs everything, and a
# guarded twin of it (``MmaPrefillSpec.value_guard``) recomputes only the flagged requests
# exactly, cleaning V in shared memory and poisoning the rows that keep a bad key.
# A raw score of -inf (only inf in q or K gives one) is turned into NaN before the variant sees
# it: infinite inputs of a kept key poison the row, as NaN ones do.
KEPT_FLOOR = float32(2.0 ** -126)
KEPT_LOGIT = float32(-np.finfo(np.float32).max)
F_INF = float32(np.inf)


def guards_masked_values(hooks, custom_mask: bool = False) -> bool:
    """Whether a CUDA-core kernel with these device hooks must guard ``p.V`` against unkept
    keys' V."""
    return bool(hooks.has_mask or custom_mask)


def kept_weights(softmax: bool, sim: bool):
    """The guard's encoding (see above) as two device functions, for kernels that guard ``p.V``:

    ``kept_logit(s) -> s'``
        The stored logit (or, without softmax, weight) of a key its row keeps: a softmax -inf
        becomes KEPT_LOGIT, a weight of exactly 0 becomes KEPT_FLOOR; anything else is unchanged.
        Unkept keys store the kernel's MASKED value (-inf, or 0 without softmax).
    ``split_weight(s, p) -> (p_sum, p_pv)``
        For a stored softmax logit ``s`` and its ``p = exp2(s - m)``: the weight the softmax sum
        takes, and the one the p.V product takes (0 exactly when the key is not kept).
    """
    ZERO = float32(0.0)
    NEG_INF = float32(-np.inf)
    jit_dev = device_jit(sim)

    @jit_dev
    def kept_logit(s):
        if softmax and s == NEG_INF:
            return KEPT_LOGIT
        if not softmax and s == ZERO:
            return KEPT_FLOOR
        return s

    @jit_dev
    def split_weight(s, p):
        p_sum = ZERO if s == KEPT_LOGIT else p
        return p_sum, (KEPT_FLOOR if p_sum == ZERO and s > NEG_INF else p_sum)

    return kept_logit, split_weight


__all__ = ["ARG", "ATTENTION_ARGS", "AttentionSpec", "DECODE_PLAN_SECTIONS", "F_INF", "F_LN2",
           "FASTMATH", "FLOAT_DTYPES", "FP8_DTYPES", "HEAD_DIMS", "ITEMSIZE", "KEPT_FLOOR",
           "KEPT_LOGIT", "KV_DTYPES", "PREFILL_PLAN_SECTIONS", "STORAGE", "VALUE_SCAN_SPLITS",
           "WORK_FIELDS", "attention_signature", "compile_kernel", "guards_masked_values",
           "kept_weights", "state_finalize"]
