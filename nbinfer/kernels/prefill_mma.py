"""Batch prefill on tensor cores: ``mma.sync.m16n8k16`` tiles with the online softmax in registers.

Same work items, arguments, masks, variants and fused merge as the CUDA-core tile kernel
(:mod:`.prefill`); what changes is the inner loop. A CTA of ``W`` warps takes ``16 W`` packed
rows (query rows x GQA group); warp ``w`` owns rows ``16 w ...`` for the whole item (a
``kv_split`` spec's items of at most 16 packed rows instead give every warp those rows and a
share of each tile's keys):

1. Q (transformed by the variant's query hook, rounded to fp16/bf16) is staged through shared
   memory once per item; with 32-key tiles it is then held in registers as ``mma`` A fragments
   (``D / 4`` words), with 64-key tiles (the default at D = 128) it stays in shared memory and
   each k-step reads its A fragment (the tile's scores need those registers).
2. KV tiles of ``BC`` (32 or 64) tokens are gathered through the loading rule (page table or
   affine) by ``cp.async`` into ``stages`` (2-4) shared-memory stages in turn: tiles
   ``i + 1 .. i + stages - 1`` are in flight while tile ``i`` is computed, and one barrier per
   tile both publishes tile ``i`` and frees tile ``i - 1``'s stage for the next load.
3. ``S = Q K^T``: ``D / 16 x BC / 8`` mma per warp; scores stay in accumulator registers, where
   every element knows its (packed row, key): the variant's logits hook and masks run there.
   A *clear* tile, every key kept for every row of the warp (no hook reads positions, or the
   only mask is causal and the tile ends at or before the warp's first row), skips that
   per-score work: its raw scores keep the scale for the exponent's FFMA, and one min per score
   finds the -inf that the non-finite rule turns into NaN.
4. Online softmax per row: max over the 4 lanes sharing a row (two shuffles), ``O`` and the
   row sums rescaled (skipped when no row of the warp changed its maximum),
   ``P = exp2(scale S - m)`` converted in registers into the A operand of
5. ``O += P V``: ``BC / 16 x D / 8`` mma per warp, V^T fragments by ``ldmatrix.trans``, and
   one more mma per 16 keys with a B fragment of ones: the rows' sums of the same rounded P
   (no add per score, no quad reduction).
   P is rounded to the operand type, as in FlashAttention; for a variant without softmax
   (sigmoid: P in [0, 1]) a custom logits transform must keep P within fp16/bf16 range.

Arithmetic per tile and warp (D = 128, BC = 64): 2 x 64 mma (2 x 262 kFLOP), 72 ldmatrix.x4,
32 scores and 64 accumulators of element-wise work per lane. Bytes per tile: ``2 BC D 2`` = 32
KiB of KV for ``4 x 16 W x BC x D`` = 2 MFLOP (W = 4): 64 FLOP/byte, so a tile streamed from HBM
at 4.2 TB/s could feed ~270 TFLOP/s; measured, the kernel runs a causal prefill at ~190-198
TFLOP/s (bench/NOTES.md, "Issue 13, session 9"): it waits on its own dependencies (mma
accumulator chains, the softmax between the two GEMMs, loads) with only one other warp per
scheduler to hide them, not on bytes (``python3 bench/sass_stats.py --kernel prefill`` counts
the loop: a clear 64-key tile ~550 instructions per warp, 132 of them mma).

Masked specs and non-finite V: an unkept key's ``P = 0`` meets its V in the tile's ``P V`` mma,
and ``0 x NaN`` is NaN. The kernel stays unguarded; its twin compiled with ``value_guard=True``
runs after it, only on the (request, kv head) pairs a scan flagged (:mod:`.value_scan`), and per
tile zeroes V rows holding NaN/inf in shared memory and gives the rows that keep such a key a
NaN logit: exactly nbinfer's rule, at the cost of a scan and an empty launch when V is finite.

Shared memory (:func:`shared_layout`): ``stages`` stages of K and V, ``2 x BC x (D + 8) x 2``
bytes each; with 32-key tiles (2 stages: 34 KiB at D = 128) the Q staging area aliases the last
stage (Q moves to registers before that stage is first loaded), with 64-key tiles Q has its own
area after them (87 KiB at D = 128 with 2 stages: more than a kernel may declare statically, so
it is allocated at launch).
The fused merge reuses all of it after the item's loop.

``wgmma=True`` (sm_90 only) does the two products on Hopper's warpgroup MMA instead
(:func:`nbinfer.kernels.wgmma.wgmma_tile_ops`): 8 warps form two warpgroups of 64 packed rows,
Q, K and V tiles sit unpadded in the canonical core-matrix layouts (``2 x 64 x D x 2`` bytes
per stage; the lean kernel's K and V, with ``swizzle``, in the 128-byte swizzled one), each
warpgroup's ``Q K^T`` and ``P V`` are one ``wgmma`` chain each, and every step above (masks,
softmax, row sums, epilogue, merge) is unchanged, because wgmma's accumulators are laid out
as ``mma.m16n8``'s. Its guarded twin runs on ``mma.sync``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, types

from ..variants.builtins import is_causal_mask
from .common import F_INF, F_LN2, VALUE_SCAN_SPLITS, compile_kernel, state_finalize
from .dependent import dependent_launch
from .fused_merge import build_merge_list
from .hooks import device_hooks
from .loading import loading_module
from .mma import FULL_MASK, smem_row_bytes, tile_ops
from .positions import position_module, prefill_item_reader
from .prefill import PrefillSpec, prefill_signature
from .primitives import LOG2E, device_jit, primitives
from .wgmma import wgmma_intrinsics, wgmma_tile_ops

TILE_KV = 32
KV_TILES = (32, 64)
STAGES = (2, 3, 4)
MMA_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class MmaPrefillSpec(PrefillSpec):
    """A :class:`~.prefill.PrefillSpec` for the tensor-core kernel: q and kv of one 16-bit type,
    head_dim 64 or 128; ``num_warps`` warps of 16 packed rows each; KV tiles of ``kv_tile``
    keys (32, or 64 with Q's fragments read from shared memory per k-step, since the tile's
    scores take the registers Q would hold)."""

    num_warps: int = 4
    kv_tile: int = TILE_KV
    # Q in shared memory at 32-key tiles too (64-key tiles always keep it there), so that a
    # register cap of ~168 fits three CTAs per SM without spilling (bench/NOTES.md)
    q_shared: bool = False
    max_registers: int | None = None  # ptxas's cap (None: up to 255)
    # KV tiles in shared memory at once: tile i computed while tiles i + 1 .. i + stages - 1
    # are in flight (2: double buffering)
    stages: int = 2
    # Leave split rows' partial states to a merge launch of their own (:mod:`.split_merge`)
    # instead of the fused merge in the CTA that finishes a row's last chunk.
    defer_merge: bool = False
    # The guarded twin of a masked spec (:mod:`.value_scan`): runs only the work items of
    # flagged (request, kv head) pairs, with V cleaned in shared memory per tile.
    value_guard: bool = False
    # Items of at most 16 packed rows (nrows x G <= 16: a decode step's GQA group, a cascade's
    # own level) run with the warps splitting each KV tile's keys (kv_tile / split_warps
    # each) instead of its rows; their states are merged through shared memory at the item's
    # end. Chosen per item at run time: the other items of the same launch keep the row tile.
    kv_split: bool = False
    # The products on Hopper's warpgroup MMA (nbinfer.kernels.wgmma.wgmma_tile_ops): tiles in
    # the canonical layouts, each warpgroup's Q K^T and P V one wgmma chain. GPU only (sm_90;
    # the lean kernel also has a simulator form over the mma.sync twins); 64-key tiles, 4 or 8
    # warps, no kv_split; its guarded twin runs on mma.sync.
    wgmma: bool = False
    # With ``wgmma``: the lean warpgroup kernel (:mod:`.prefill_wgmma`) instead of this one's
    # warpgroup form: plain variants only (causal or none, no hooks, no custom mask), 8 warps,
    # 64-key tiles, 2 stages, split rows merged by the merge launch (``defer_merge``).
    lean: bool = False
    # With ``lean``: a work item's fixed cost overlapped with its neighbours' tiles: Q copied by
    # cp.async, the next item's first KV tile and Q requested during this item's last tile,
    # the output stored by one unrolled loop per path (:mod:`.prefill_wgmma`). On this kernel
    # (``mma.sync``; Q in shared memory, two stages, ``defer_merge``, neither ``kv_split`` nor
    # ``value_guard``): the next item's plan entries read and its first KV tile requested
    # during this item's last tile, into the stage the ring has free.
    prefetch: bool = False
    # With ``lean``: the online softmax's rescale only when a row's maximum grows by more than
    # 2^8 (the rest of the tiles skip it; exact: O and its sum share the stale reference).
    lazy_rescale: bool = False
    # With ``lean``: each tile's S = Q K^T chain issued before the ring's refill (the next
    # tile's cp.async copies then queue behind the tensor cores' work, not ahead of it).
    qk_ahead: bool = False
    # With ``lean`` on the GPU: K and V tiles in the 128-byte swizzled layout, each copy of
    # eight threads one whole 128-byte line (kernels.wgmma.swizzled_slot), where the canonical
    # layout's copies read 16-byte pieces of eight rows: those capped the SMs' intake of K and
    # V at ~2.2 TB/s (bench/NOTES.md, session 30).
    swizzle: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim not in MMA_HEAD_DIMS:
            raise ValueError(f"the tensor-core prefill kernel takes head_dim in {MMA_HEAD_DIMS}, "
                             f"got {self.head_dim}")
        if self.q_dtype != self.kv_dtype or self.q_dtype not in ("float16", "bfloat16"):
            raise ValueError("the tensor-core prefill kernel needs q and kv of the same 16-bit "
                             f"type, got q {self.q_dtype}, kv {self.kv_dtype}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8, got {self.num_warps}")
        if self.kv_tile not in KV_TILES:
            raise ValueError(f"kv_tile must be one of {KV_TILES}, got {self.kv_tile}")
        if self.stages not in STAGES:
            raise ValueError(f"stages must be in {STAGES}, got {self.stages}")
        # (the simulator has no warpgroup MMA: only the lean kernel has a form there, over
        # the mma.sync twins)
        if self.wgmma and ((self.sim and not self.lean) or self.kv_tile != 64
                           or self.num_warps not in (4, 8) or self.kv_split or self.value_guard):
            raise ValueError("wgmma=True needs the GPU (in the simulator only lean=True), "
                             "kv_tile 64, num_warps 4 or 8, and neither kv_split nor "
                             f"value_guard; got sim={self.sim}, kv_tile={self.kv_tile}, "
                             f"num_warps={self.num_warps}, kv_split={self.kv_split}, "
                             f"value_guard={self.value_guard}")
        if self.lean:
            from .prefill_wgmma import LEAN_KV_TILE, LEAN_STAGES, LEAN_WARPS, lean_eligible

            if not (self.wgmma and self.num_warps == LEAN_WARPS and self.stages == LEAN_STAGES
                    and self.defer_merge and lean_eligible(self.variant, self.custom_mask,
                                                           self.block_positions)):
                raise ValueError(
                    f"lean=True needs wgmma, {LEAN_WARPS} warps, {LEAN_KV_TILE}-key tiles, "
                    f"{LEAN_STAGES} stages, defer_merge, and a plain variant (causal or none, no "
                    f"hooks, no custom mask, no block positions); got wgmma={self.wgmma}, "
                    f"num_warps={self.num_warps}, stages={self.stages}, "
                    f"defer_merge={self.defer_merge}, variant {self.variant.name!r}, "
                    f"custom_mask={self.custom_mask}, block_positions={self.block_positions}")
        rungs = {n: getattr(self, n) for n in ("lazy_rescale", "qk_ahead", "swizzle")}
        if any(rungs.values()) and not self.lean:
            raise ValueError("lazy_rescale, qk_ahead and swizzle are the lean kernel's "
                             f"(lean=True); got lean=False with "
                             f"{[n for n, on in rungs.items() if on]} set")
        if self.prefetch and not self.lean and not mma_prefetch_allowed(
                self.q_in_shared, self.stages, self.defer_merge, wgmma=self.wgmma,
                kv_split=self.kv_split, value_guard=self.value_guard):
            raise ValueError("prefetch=True on the mma.sync kernel needs Q in shared memory, 2 "
                             "stages, defer_merge, and neither wgmma, kv_split nor value_guard; "
                             f"got q_in_shared={self.q_in_shared}, stages={self.stages}, "
                             f"defer_merge={self.defer_merge}, wgmma={self.wgmma}, "
                             f"kv_split={self.kv_split}, value_guard={self.value_guard}")
        if self.swizzle and self.sim:
            raise ValueError("swizzle=True is a layout of the GPU's warpgroup MMA; the "
                             "simulator's lean kernel runs on the mma.sync twins (got "
                             "sim=True)")
        if self.max_registers is not None and not 64 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in [64, 255] or None, got "
                             f"{self.max_registers}")
        if self.kv_split and self.num_warps < 2:
            raise ValueError("kv_split needs at least 2 warps to split a tile's keys over")

    def on_mma_sync(self, **changes) -> MmaPrefillSpec:
        """This spec with ``changes`` and none of the warpgroup kernels' fields (``wgmma``,
        ``lean`` and the lean kernel's rungs): the form of a companion that runs on
        ``mma.sync`` whatever the main kernel (the guarded twin, the value scan, the merge)."""
        return dataclasses.replace(self, wgmma=False, lean=False, prefetch=False,
                                   lazy_rescale=False, qk_ahead=False, swizzle=False, **changes)

    @property
    def tile_q(self) -> int:
        return 16 * self.num_warps

    @property
    def tile_kv(self) -> int:
        return self.kv_tile

    @property
    def q_in_shared(self) -> bool:
        """Whether Q stays in shared memory (read per k-step) instead of registers."""
        return q_in_shared_memory(self.q_shared, self.kv_tile)

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def split_warps(self) -> int:
        """Warps that share a KV tile's keys in a ``kv_split`` item (16 keys or more each)."""
        return min(self.num_warps, self.kv_tile // 16)


def mma_prefetch_allowed(q_in_shared: bool, stages: int, defer_merge: bool, *,
                         wgmma: bool = False, kv_split: bool = False,
                         value_guard: bool = False) -> bool:
    """Whether the ``mma.sync`` kernel's per-item overlap (``MmaPrefillSpec(prefetch=True)``
    without ``lean``) can run on these options: the next item's first KV tile goes into the
    stage the ring frees at the last tile (two stages), each warp's Q is read from shared
    memory until then, and the item's partials are merged after the launch. The spec's check
    and the api's rule (``nbinfer.api.prefill.mma_tiles``) both ask this."""
    return (bool(q_in_shared) and stages == 2 and bool(defer_merge)
            and not (wgmma or kv_split or value_guard))


def q_in_shared_memory(q_shared: bool, kv_tile: int) -> bool:
    """Whether Q stays in shared memory (read per k-step) instead of registers: asked for, or
    forced by a tile of more than :data:`TILE_KV` keys (``MmaPrefillSpec.q_in_shared``)."""
    return bool(q_shared) or kv_tile > TILE_KV


def array_addr_low(sim: bool):
    """``addr_low(arr)``: the low 32 bits of an array's address (a kernel's alignment check
    before 16-byte copies), on the GPU an intrinsic (the data pointer truncated), in the
    simulator from NumPy."""
    if not sim:
        return wgmma_intrinsics().addr_low

    def addr_low(arr):
        return np.uint32(np.asarray(arr).__array_interface__["data"][0] & 0xFFFFFFFF)

    return addr_low


def mma_eligible(head_dim: int, q_dtype: str, kv_dtype: str) -> bool:
    """Whether the tensor-core kernel serves this problem (else the CUDA-core tile kernel)."""
    return head_dim in MMA_HEAD_DIMS and q_dtype == kv_dtype and q_dtype in ("float16",
                                                                              "bfloat16")


@functools.cache
def build_prefill_mma_kernel(spec: MmaPrefillSpec):
    """Compile (once per spec) the tensor-core prefill kernel; arguments as
    :func:`nbinfer.kernels.prefill.build_prefill_kernel`, launched with ``spec.num_threads``."""
    from .launch import use_dynamic_shared  # host code: not part of the kernel's source key

    opts = {"max_registers": spec.max_registers} if spec.max_registers else {}
    if spec.lean:
        from .prefill_wgmma import prefill_wgmma_kernel_source

        kernel = compile_kernel("prefill_wgmma", spec, prefill_signature(spec),
                                lambda: prefill_wgmma_kernel_source(spec),
                                prefill_wgmma_kernel_source.__module__, **opts)
    else:
        kernel = compile_kernel("prefill_mma", spec, prefill_signature(spec),
                                lambda: prefill_mma_kernel_source(spec), __name__, **opts)
    return use_dynamic_shared(kernel, shared_layout(spec)["dynamic"], spec.sim)


def shared_layout(spec: MmaPrefillSpec) -> dict:
    """Byte sizes of the kernel's main shared buffer: ``stage`` (one K and V tile), ``q_base``
    (where Q is staged: aliasing the last stage, the first one loaded after Q has moved to
    registers, or after the stages when Q stays in shared memory), ``total`` and ``dynamic``
    (``total`` when it is allocated at launch, past the static limit; else 0). With
    ``swizzle`` the stages and ``q_base`` count from the buffer's first 1024-byte boundary,
    and ``total`` holds 1 KiB more to leave room for it."""
    from .launch import STATIC_SHARED_LIMIT  # host code: not part of the kernel's source key

    n = spec.stages

    def sizes(row_bytes):
        stage = 2 * spec.tile_kv * row_bytes
        q_bytes = spec.tile_q * row_bytes
        if spec.q_in_shared:
            return stage, n * stage, n * stage + q_bytes
        if q_bytes > stage:
            raise ValueError(f"{spec.tile_q} Q rows do not fit in one KV stage")
        return stage, (n - 1) * stage, n * stage

    # The GPU's sizes decide static or dynamic (1 KiB is left for the row flags); the
    # simulator's twins keep 4-byte slots but take the same path as the GPU would.
    def row_bytes(sim):  # wgmma's canonical layouts have no padding (its twins' rows do)
        return 2 * spec.head_dim if spec.wgmma and not sim else smem_row_bytes(spec.head_dim,
                                                                                sim)

    gpu = sizes(row_bytes(False))
    stage, q_base, total = sizes(row_bytes(spec.sim))
    if spec.swizzle:  # 1 KiB more, to start the stages on a 1024-byte boundary
        gpu, total = (*gpu[:2], gpu[2] + 1024), total + 1024
    dynamic = total if gpu[2] > STATIC_SHARED_LIMIT - 1024 else 0
    return dict(stage=stage, q_base=q_base, total=total, dynamic=dynamic)


def kv_tile_loader(spec: MmaPrefillSpec, ops):
    """``load_kv_tile(smem, kb, k, v, kv_indices, kv_indptr, b, ib, row_stride, head_off,
    page_stride, t0, end, hk, tid)``: one KV tile of ``spec`` (keys ``t0 .. t0 + BC - 1`` of
    the item's request, through the loading rule) into the stage at shared address ``kb`` (K,
    then V ``ops.TILE_BYTES`` on) by ``cp.async``, as one commit group; ``ops`` (``tile_ops``
    or ``wgmma_tile_ops``) decides where each copy lands. Shared by both tensor-core kernels."""
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    D, HALF, NT, BC = spec.head_dim, spec.head_dim // 2, spec.num_threads, spec.tile_kv
    CHUNKS = D // 8  # 16-byte copies (8 elements) per token row
    ROWS_PER_PASS = NT // CHUNKS  # token rows one pass of the CTA's 16-byte copies covers
    COPIES = BC // ROWS_PER_PASS  # copies per thread per K (or V) tile
    TILE_BYTES, copy_map, store_pair, q_offset = (ops.TILE_BYTES, ops.copy_map, ops.store_pair,
                                                  ops.q_offset)
    token_offset = loading_module(spec.sparse, spec.page_size, sim).token_offset
    key_position = position_module(spec.page_size, spec.block_positions, sim).key_position
    hook_key, HAS_K = hooks.key, hooks.has_key
    cp_async16_to, commit = prims.cp_async16_to, prims.commit
    kv_f32 = prims.convert[spec.kv_dtype]
    U32 = types.uint32
    jit_dev = device_jit(sim)

    # A *straight* tile: every row in range and, paged, every copy's page known from the row's
    # place in the tile (pages of PS tokens, PS a multiple of the rows one pass covers, and the
    # tile starting on a page or lying inside one). Its copies then need one page-table read
    # per page and one 64-bit add per copy; the rest (a ragged end, page size 1) take the
    # general path, which addresses each copy from its token.
    SPARSE, PS = spec.sparse, spec.page_size
    PS_STRAIGHT = not SPARSE or PS % ROWS_PER_PASS == 0
    # pages a tile starting on a page touches (rounded up: pages of 24 cover a 64-key tile in 3)
    TILE_PAGES = -(-BC // PS) if SPARSE else 1

    @jit_dev
    def straight(t0, end):
        if t0 + BC > end:
            return False
        if not SPARSE:
            return True
        if PS <= BC:  # (the caller checked PS_STRAIGHT at compile time)
            return U32(t0) % U32(PS) == U32(0)
        return U32(t0) % U32(PS) + U32(BC) <= U32(PS)

    @jit_dev
    def load_kv_tile(smem, kb, k, v, kv_indices, kv_indptr, b, ib, row_stride, head_off,
                     page_stride, t0, end, hk, tid):
        # BC token rows of K and V, D * 2 bytes each, in 16-byte cp.async copies; rows past the
        # range re-read the last token (masked later), so no copy is conditional.
        # A fixed number of copies per thread, each at a fixed (row, chunk) of the tile: a
        # thread's chunk and first row are the same for every tile, so per copy only the token's
        # offset is computed (a runtime-bounded loop here cost ~300 instructions per tile).
        # (row j0 + r ROWS_PER_PASS, chunk c) of K to kb + dk + r dk_step, of V to vb + dv +
        # r dv_step: padded rows, or wgmma's core matrices (ops.copy_map)
        vb = kb + U32(TILE_BYTES)
        j0, c, dk, dv, dk_step, dv_step = copy_map(tid)
        if PS_STRAIGHT and straight(t0, end):
            # Copy r is row j0 + r RPP: page (r RPP) // PS of the tile (j0 < RPP <= PS never
            # crosses a page), so its offset is its page's first copy plus a constant number
            # of rows (D = 128: 16 copies of K and V in ~60 instructions, not ~190).
            pages = cuda.local.array(TILE_PAGES, int64)
            for pg in range(TILE_PAGES):
                pos = U32(t0) + U32(pg * PS) + j0 if SPARSE else U32(t0) + j0
                pages[pg] = token_offset(kv_indices, ib, pos, row_stride, head_off,
                                         page_stride) + int64(8 * c)
            for r in range(COPIES):
                row = r * ROWS_PER_PASS
                pg = row // PS if SPARSE and PS <= BC else 0
                within = row % PS if SPARSE and PS <= BC else row
                off = pages[pg] + int64(within) * row_stride
                cp_async16_to(smem, vb + dv + U32(r) * dv_step, v, off)
                if not HAS_K:
                    cp_async16_to(smem, kb + dk + U32(r) * dk_step, k, off)
        else:
            last = end - 1
            for r in range(COPIES):
                j = j0 + U32(r * ROWS_PER_PASS)
                pos = min(t0 + int64(j), last)
                off = token_offset(kv_indices, ib, U32(pos), row_stride, head_off, page_stride)
                cp_async16_to(smem, vb + dv + U32(r) * dv_step, v, off + int64(8 * c))
                if not HAS_K:
                    cp_async16_to(smem, kb + dk + U32(r) * dk_step, k, off + int64(8 * c))
        if HAS_K:  # the key hook (RoPE) runs on the way in: through registers
            for e in range(tid, BC * HALF, NT):
                j = e // HALF
                d = 2 * (e % HALF)
                pos = min(t0 + j, end - 1)
                off = token_offset(kv_indices, ib, U32(pos), row_stride, head_off, page_stride)
                kp = key_position(kv_indptr, kv_indices, b, pos)
                x0 = kv_f32(k[off + d])
                x1 = kv_f32(k[off + d + 1])
                y0 = float32(hook_key(x0, kv_f32(k[off + (d + HALF) % D]), d, D, kp, hk))
                y1 = float32(hook_key(x1, kv_f32(k[off + (d + 1 + HALF) % D]), d + 1, D, kp, hk))
                store_pair(smem, kb + q_offset(j, d), y0, y1)
        commit()

    return load_kv_tile


def q_row_offsetter(group_size: int, sim: bool):
    """``q_offset_of(p, d, q0, qs, nrows, hk, q_stride_n, q_stride_h) -> int64``: the element
    offset in q of column ``d`` of an item's packed Q row ``p`` (query row ``p // G`` of the
    item's ``nrows``, clamped to its last row; head ``hk G + p % G``). Every Q tile loader
    asks it: the stager, the ``mma.sync`` kernel's copier and the lean kernel's."""
    G = group_size
    U32 = types.uint32

    @device_jit(sim)
    def q_offset_of(p, d, q0, qs, nrows, hk, q_stride_n, q_stride_h):
        # Every index is cast back to uint32 or int64 as it is made: Numba types uint32 op
        # uint32 as uint64, and a uint64 met by an int64 (min, +) as float64, which put 20
        # double-precision instructions (DSETP, DADD, F2I.F64) into each unrolled round of the
        # stager: 15 % of the one-launch cascade's warp time on an H100 (bench/NOTES.md,
        # session 31).
        row = U32(U32(p) // U32(G))
        return ((int64(q0 + qs) + min(int64(row), int64(nrows - 1))) * q_stride_n
                + (int64(hk * G) + int64(U32(p) % U32(G))) * q_stride_h + int64(d))

    return q_offset_of


def q_source_indexer(group_size: int, sim: bool):
    """``q_source(e, per_row, width, q0, qs, nrows, hk, q_stride_n, q_stride_h) -> (p, d, row,
    offset)``: piece ``e`` of an item's Q tile cut into ``per_row`` pieces of ``width``
    elements per packed row: its packed row ``p`` (query row ``p // G``, head ``hk G + p %
    G``), first column ``d``, query row within the item, and the element offset of its source
    in q (:func:`q_row_offsetter`). Shared by the stager and the copier."""
    G = group_size
    U32 = types.uint32
    q_offset_of = q_row_offsetter(G, sim)

    @device_jit(sim)
    def q_source(e, per_row, width, q0, qs, nrows, hk, q_stride_n, q_stride_h):
        p = U32(e // U32(per_row))
        d = U32(U32(width) * (e % U32(per_row)))
        off = q_offset_of(p, d, q0, qs, nrows, hk, q_stride_n, q_stride_h)
        return p, d, U32(p // U32(G)), off

    return q_source


def q_tile_stager(spec: MmaPrefillSpec, ops):
    """``stage_q(smem, qbase, q, q0, qs, nrows, hk, pos0, q_stride_n, q_stride_h, tid, sign)``:
    the item's ``tile_q`` packed rows of Q (query row ``p // G``, head ``hk G + p % G``) through
    the variant's query hook, times ``sign`` (1 or -1: exact), rounded to the operand type,
    stored at shared address ``qbase`` where ``ops.q_offset`` places them; rows past ``nrows``
    are zeros. Shared by both tensor-core kernels (the caller publishes and waits)."""
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    D, HALF, NT, G = spec.head_dim, spec.head_dim // 2, spec.num_threads, spec.group_size
    Q_PAIRS = spec.tile_q * HALF // NT  # Q element pairs each thread stages per item
    hook_query, HAS_Q = hooks.query, hooks.has_query
    q_f32 = prims.convert[spec.q_dtype]
    store_pair, q_offset = ops.store_pair, ops.q_offset
    q_source = q_source_indexer(G, sim)
    ZERO = float32(0.0)
    U32 = types.uint32

    @device_jit(sim)
    def stage_q(smem, qbase, q, q0, qs, nrows, hk, pos0, q_stride_n, q_stride_h, tid, sign):
        # A fixed count of element pairs per thread, every load unconditional (rows past
        # nrows read the last row and store zeros): the loads of a thread are independent
        # and issue back to back, where a guarded runtime loop waited on each in turn.
        tu = U32(tid)
        for r in range(Q_PAIRS):
            p, d, row, src = q_source(U32(tu + U32(r * NT)), HALF, 2, q0, qs, nrows, hk,
                                      q_stride_n, q_stride_h)
            x0 = q_f32(q[src])
            x1 = q_f32(q[src + 1])
            if HAS_Q:
                qb = src - int64(d)  # the row's first element
                qp = pos0 + row
                qh = int64(hk * G) + int64(p % U32(G))
                y0 = float32(hook_query(x0, q_f32(q[qb + (d + HALF) % D]), d, D, qp, qh))
                x1 = float32(hook_query(x1, q_f32(q[qb + (d + 1 + HALF) % D]), d + 1, D,
                                        qp, qh))
                x0 = y0
            if row >= nrows:
                x0 = ZERO
                x1 = ZERO
            store_pair(smem, qbase + q_offset(p, d), x0 * sign, x1 * sign)

    return stage_q


def q_tile_copier(spec: MmaPrefillSpec, ops):
    """``(copy_q, addr_low)`` for ``spec``'s Q tile by ``cp.async``, or ``(None, None)``.
    ``copy_q(smem, qbase, q, q0, qs, nrows, hk, q_stride_n, q_stride_h, tid)`` issues the
    item's ``tile_q`` packed rows of Q as 16-byte copies to where ``ops.q_offset`` places them
    (no commit: the caller's next commit takes them into its group); rows past ``nrows`` copy
    the last row (computed, never stored), and the 16-row blocks of warps that skip the item's
    math are not copied at all. ``addr_low(arr)``: the low 32 bits of an array's
    address, for the caller's alignment check (q's base 16-byte aligned, its strides multiples
    of 8 elements; else the stager).

    Only where a copy is the stager's result: Q kept in shared memory (the tensor cores' tile
    ops read it there), no query hook (RoPE fused into the stager), the ``mma.sync`` tile (the
    warpgroup form's canonical layout is the lean kernel's copier's), and copies that divide
    among the CTA's threads. Why: the stager's 16-bit loads, two per element pair and 64 per
    thread of a 64-row tile at D 128, were 13-15 % of the one-launch cascade's warp time on an
    H100 (short items: a 16 KiB Q tile for 4-8 KV tiles; bench/NOTES.md, session 31); eight
    16-byte copies per thread take Q in the same group as the item's first KV tile, whose wait
    covers their latency."""
    sim = spec.sim
    D, NT, G = spec.head_dim, spec.num_threads, spec.group_size
    CH = D // 8  # 16-byte chunks of a row
    COPIES = spec.tile_q * CH // NT
    if (not spec.q_in_shared or spec.wgmma or device_hooks(spec.variant, sim).has_query
            or D % 8 or (spec.tile_q * CH) % NT):
        return None, None
    q_offset = ops.q_offset
    q_source = q_source_indexer(G, sim)
    cp16 = primitives(sim).cp_async16_to
    U32 = types.uint32
    TQ = spec.tile_q
    ZERO = float32(0.0)

    @device_jit(sim)
    def copy_q(smem, qbase, q, q0, qs, nrows, hk, q_stride_n, q_stride_h, tid):
        # consecutive threads take consecutive chunks of a row: whole rows per warp-copy
        tu = U32(tid)
        # Only the rows of the warps that compute: the 16-row blocks that hold a live packed
        # row (a warp whose rows are all past nrows skips the item's math, and a kv_split
        # item's warps all read rows 0-15). A decode-like item of G packed rows (the cascade's
        # own level: 512 items of 4 rows) copies 4 KiB instead of 16 KiB. The simulator's
        # idle warps still compute (never stored): there the uncopied rows are zeroed, so that
        # they compute on zeros and a block wrongly left out zeroes live rows (tests see it).
        live = min(U32(U32(U32(U32(nrows) * U32(G)) + U32(15)) // U32(16)) * U32(16), U32(TQ))
        for i in range(COPIES):
            p, d, _, off = q_source(U32(tu + U32(i * NT)), CH, 8, q0, qs, nrows, hk,
                                    q_stride_n, q_stride_h)
            if p < live:  # (uniform per warp: a warp's copies are whole rows of one block)
                cp16(smem, qbase + q_offset(p, d), q, off)
            elif sim:  # the simulator's slots: one 4-byte word per element
                w = (qbase + q_offset(p, d)) // 4
                for e in range(8):
                    smem[w + e] = ZERO

    return copy_q, array_addr_low(sim)


def prefill_mma_kernel_source(spec: MmaPrefillSpec):
    sim = spec.sim
    prims = primitives(sim)
    hooks = device_hooks(spec.variant, sim)
    D = spec.head_dim
    HALF = D // 2
    G = spec.group_size
    NW = spec.num_warps
    NT = spec.num_threads
    TQ = spec.tile_q
    BC = spec.tile_kv
    WGMMA = spec.wgmma
    let_dependents = dependent_launch(sim).trigger  # (:mod:`.dependent`)
    ops = wgmma_tile_ops(D, BC, spec.q_dtype, NW) if WGMMA else tile_ops(D, BC, spec.q_dtype,
                                                                          NW, sim)
    ELEM, RS = ops.ELEM, ops.RS
    publish = ops.publish
    NS, NO, QF, QF_T = ops.NS, ops.NO, ops.QF, ops.QF_T
    load_q, quad_reduce = ops.load_q, ops.quad_reduce
    scrub_pair = ops.scrub_pair
    GUARD = spec.value_guard
    Q_SMEM = spec.q_in_shared
    TILE_BYTES = ops.TILE_BYTES  # one K (or V) tile
    shared = shared_layout(spec)
    STAGE_BYTES = shared["stage"]
    Q_BASE = shared["q_base"]  # aliasing the last stage (Q moves to registers), or its own area
    NSTG = spec.stages
    DEFER_MERGE = spec.defer_merge
    SMEM_FLOATS = shared["total"] // 4
    SMEM_DECL = 0 if shared["dynamic"] else SMEM_FLOATS  # 0: allocated at launch
    # Tiles on a 256-byte boundary: allocated at launch they followed the static arrays at 16
    # bytes, 32 past a 128-byte line (the decode's ring at 48 past one was slow: NOTES).
    SMEM_ALIGN = max(prims.SMEM_ALIGN, 256) if prims.SMEM_ALIGN else prims.SMEM_ALIGN
    SCRATCH = max(ops.SCRATCH, 1)
    BAD_WORDS = BC // 32  # the guarded twin's bit per key of a tile (a 64-key tile: two words)
    FLAG_WORDS = 2 * TQ + 3  # the tile merge's row flags and lists (fused_merge)
    fused = build_merge_list(G, D, NT, SMEM_FLOATS, spec.variant, spec.q_dtype, sim)
    finish_split_tile, store, OUTS = fused.finish_split_tile, fused.store, fused.OUTS
    read_item = prefill_item_reader(spec.sparse, spec.page_size, spec.block_positions, sim)
    pos_fns = position_module(spec.page_size, spec.block_positions, sim)
    key_position, mask_bit = pos_fns.key_position, pos_fns.mask_bit
    hook_logits = hooks.logits
    hook_mask, hook_output = hooks.mask, hooks.output
    SOFTMAX = hooks.use_softmax
    NA = NO + (4 if SOFTMAX else 0)  # accumulators: the output's, then the row sums'
    HAS_LOGITS, HAS_MASK, HAS_OUT = hooks.has_logits, hooks.has_mask, hooks.has_output
    CUSTOM = spec.custom_mask
    # Scores come out of the mma unscaled: scale (and log2 e for exp2) in float32 registers.
    PRE = float32(LOG2E if (SOFTMAX and not HAS_LOGITS) else 1.0)
    POST_LOG2E = float32(LOG2E if (SOFTMAX and HAS_LOGITS) else 1.0)
    NEG_INF = float32(-np.inf)
    NAN = float32(np.nan)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    finalize = state_finalize(sim)
    MASKED = NEG_INF if SOFTMAX else ZERO
    SKIP_IDLE_WARPS = not sim  # the simulator twins meet at barriers: every warp computes
    # Tiles whose every score is kept take a short path (see the tile loop): possible when no
    # hook reads a score's positions, or the only mask is causal over affine key positions.
    CLEAR_TILES = not (HAS_LOGITS or CUSTOM or GUARD) and (
        not HAS_MASK or (all(is_causal_mask(f) for f in spec.variant.logits_mask)
                         and not spec.block_positions))
    U32 = types.uint32
    exp2 = prims.exp2
    # At the top of tile i, tiles i + 1 .. i + NSTG - 2 may still be in flight.
    shared_addr, commit, wait_tile = prims.shared_addr, prims.commit, prims.wait(NSTG - 2)
    jit_dev = device_jit(sim)

    def make_row_extremes(NSX):
        HS = NSX // 2  # scores of one row in a lane
        TREE = HS.bit_length() - 1  # levels of the pairwise reduction (HS is a power of two)

        @jit_dev
        def row_extremes(s, is_max):
            # The maxima (or minima) of the lane's scores of its two rows: accumulators with
            # (idx % 4) // 2 == 0 belong to row g, the others to row g + 8. A pairwise tree,
            # not a running value: the same HS - 1 FMNMX per row, but log2(HS) dependent steps
            # instead of HS (the loop's largest stall is on such fixed-latency dependencies).
            w = cuda.local.array(NSX, float32)  # constant indices: registers
            for idx in range(NSX):
                w[((idx % 4) // 2) * HS + (idx // 4) * 2 + idx % 2] = s[idx]
            for lvl in range(TREE):
                half = HS >> (lvl + 1)
                for h in range(2):
                    for j in range(half):
                        a = w[h * HS + j]
                        b = w[h * HS + j + half]
                        w[h * HS + j] = max(a, b) if is_max else min(a, b)
            return w[0], w[HS]

        return row_extremes

    def make_tile_math(tops, KW):
        """A warp's work on one KV tile in shared memory: scores of its 16 packed rows against
        ``KW`` keys of the tile from key ``koff`` on (the whole tile: ``KW = BC``; a
        ``kv_split`` item: the warp's share), masks, the online softmax, ``O += P V``. The
        warp's rows are Q tile rows ``16 qwarp ...``. Returns the rows' new maxima and
        poison marks (the accumulators are updated in place)."""
        NSX = tops.NS
        row_extremes = make_row_extremes(NSX)
        # With softmax the rows' sums come out of the P V mma (one more n-tile, of ones), in
        # the four accumulators after the output's.
        pvx = tops.pv_sums if SOFTMAX else tops.pv
        qk_x, qk_smem_x, quad_x = tops.qk, tops.qk_smem, tops.quad_reduce

        @jit_dev
        def tile_math(smem, kb, qbase, qwarp, koff, tid, lane, qf, s, acc, scratch, active,
                      t0, end, pos0, pr0, pr1, ok0, ok1, m0, m1, poison0, poison1, scale,
                      raw_scores, bad_lo, bad_hi, kv_indptr, kv_indices, b, plan,
                      mask_indptr_off, mask_words_off, qs, kv_len, hk):
            t = lane % 4
            kw = kb + U32(koff * RS)  # this warp's first key row of the tile
            tk = t0 + koff
            if active:
                if Q_SMEM:
                    qk_smem_x(smem, kw, qbase, qwarp, lane, s)
                else:
                    qk_x(smem, kw, lane, qf, s)
            clear = CLEAR_TILES and tk + KW <= end and (
                not HAS_MASK or tk + KW - 1 <= pos0 + (16 * qwarp) // G)
            # The scale still to apply to s: a clear tile's raw scores take it inside the
            # exponent's FFMA (the maximum of raw scores times a positive scale is the
            # maximum of the scaled ones), the other tiles' are scaled below.
            ks = ONE
            if active and clear:
                # Every key of the tile is kept for every row of this warp (no hook reads
                # positions; a causal mask's last key is at or before the warp's first row):
                # no per-score positions or masks. Rows past nrows are computed on zero
                # queries and never stored.
                if raw_scores:
                    # The non-finite rule: a -inf score (only inf in q or K gives one) must
                    # poison its row as NaN does, where exp2 would make it a 0. One min per
                    # score finds it; the row is marked, and made NaN at the end.
                    lo0, lo1 = row_extremes(s, False)
                    if lo0 == NEG_INF:
                        poison0 = ONE
                    if lo1 == NEG_INF:
                        poison1 = ONE
                    ks = scale
                else:
                    for idx in range(NSX):
                        x = s[idx] * scale
                        if x == NEG_INF:
                            x = NAN
                        s[idx] = x
            elif active:
                for idx in range(NSX):
                    h = (idx % 4) // 2
                    pr = pr1 if h else pr0
                    pos = tk + (idx // 4) * 8 + 2 * t + idx % 2
                    qrow = pr // G
                    q_pos = pos0 + qrow
                    qo_head = hk * G + pr % G
                    keep = (ok1 if h else ok0) and pos < end
                    kp = key_position(kv_indptr, kv_indices, b, min(pos, end - 1))
                    x = s[idx] * scale
                    if x == NEG_INF:  # only inf in q or K gives it: poison, as NaN does
                        x = NAN
                    if HAS_LOGITS:
                        x = float32(hook_logits(x, q_pos, kp, qo_head)) * POST_LOG2E
                    if HAS_MASK:
                        keep = keep and hook_mask(q_pos, kp, qo_head)
                    if CUSTOM and keep:
                        keep = mask_bit(plan, mask_indptr_off, mask_words_off, b,
                                        qs + qrow, kv_len, pos) != 0
                    jt = pos - t0
                    bad = bad_hi if jt >= 32 else bad_lo
                    if GUARD and keep and (bad >> U32(jt % 32)) & U32(1):
                        x = NAN
                    s[idx] = x if keep else MASKED
            if SOFTMAX:
                mx0, mx1 = row_extremes(s, True)
                if active:
                    mx0, mx1 = quad_x(mx0, mx1, True, tid, scratch)
                mx0 = max(m0, mx0 * ks)
                mx1 = max(m1, mx1 * ks)
                mr0 = mx0 if mx0 > NEG_INF else ZERO
                mr1 = mx1 if mx1 > NEG_INF else ZERO
                a0 = exp2(m0 - mr0)
                a1 = exp2(m1 - mr1)
                m0 = mx0
                m1 = mx1
                for idx in range(NSX):  # one FFMA and one exp2 per score
                    s[idx] = exp2(s[idx] * ks - (mr1 if (idx % 4) // 2 else mr0))
                # Past the first tiles a row's maximum rarely moves: skip the 2 x D / 4 + 4
                # multiplications by exactly 1 when no lane of the warp needs them.
                if sim or cuda.any_sync(FULL_MASK, a0 != ONE or a1 != ONE):
                    for idx in range(NA):  # the output and the row sums
                        acc[idx] *= a1 if (idx % 4) // 2 else a0
            if active:
                pvx(smem, kw + U32(TILE_BYTES), tid, lane, s, acc, scratch)
            return m0, m1, poison0, poison1

        return tile_math

    full_tile = make_tile_math(ops, BC)
    KV_SPLIT = spec.kv_split
    SW = spec.split_warps  # warps sharing a kv_split item's tiles
    KW = BC // SW  # keys of a tile per warp there
    # A kv_split item's states meet in shared memory (from word 0: the KV stages, free after
    # the item's loop), lane-major (conflict-free): warps 1 .. SW - 1 leave their rescaled
    # accumulators and poison marks for warp 0 to add, after every warp's two row maxima.
    SPLIT_SLOTS = NA + 2
    SPLIT_M = (SW - 1) * SPLIT_SLOTS * 32
    if KV_SPLIT:
        split_tile = make_tile_math(tile_ops(D, KW, spec.q_dtype, NW, sim), KW)
        if SPLIT_M + 64 * SW > SMEM_FLOATS:
            raise ValueError("the kv_split merge does not fit the kernel's shared memory")
    else:
        split_tile = full_tile  # never called

    load_kv_tile = kv_tile_loader(spec, ops)
    stage_q = q_tile_stager(spec, ops)
    copy_q, addr_low = q_tile_copier(spec, ops)
    Q_ASYNC = copy_q is not None
    wait_all = prims.wait(0)
    # spec.prefetch: the next work item's plan entries read, and its first KV tile requested,
    # during this item's last tile (its refill has no tile of this item left to fetch), into
    # the stage the ring frees: the item's start no longer waits on plan reads, page ids and
    # a KV tile's latency in turn. (Q still comes at the item's start: every warp reads this
    # item's Q until its last tile is done.)
    PREFETCH = spec.prefetch

    def prefill_mma_kernel(q, k, v, kv_indptr, kv_indices, kv_last, plan, o, lse, tmp_o,
                           tmp_lse, counters, hkv, page_stride, kv_stride_n, kv_stride_h,
                           q_stride_n, q_stride_h, sm_scale, v_scale, work_off,
                           cta_indptr_off, cta_work_off, merge_rows_off, merge_indptr_off,
                           merge_indices_off, item_merge_off, qo_indptr_off, mask_indptr_off,
                           mask_words_off, q_pos0_off, qo_end_off, value_flags_off):
        # [stage 0 K|V, stage 1 K|V]; merge scratch after the loop. At least 16-byte aligned
        # (cp.async destinations and ldmatrix rows must be); SMEM_ALIGN makes it 256.
        smem = cuda.shared.array(SMEM_DECL, float32, alignment=SMEM_ALIGN)
        # guarded twin: the tile's keys with bad V, one bit per key in 32-bit words
        bad_keys = cuda.shared.array(BAD_WORDS, U32)
        scratch = cuda.shared.array(SCRATCH, float32)  # simulator twins only
        flags = cuda.shared.array(FLAG_WORDS, int32)
        qf = cuda.local.array(1 if Q_SMEM else QF, QF_T)
        s = cuda.local.array(NS, float32)
        acc = cuda.local.array(NA, float32)
        mnum = cuda.local.array(OUTS, float32)

        if DEFER_MERGE:  # the merge launch after this one may start as this kernel's CTAs end
            let_dependents()
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        base = shared_addr(smem, 0)
        hq = hkv * G
        scale = sm_scale * PRE
        # A clear tile's scale may wait for exp2's FFMA only when it is positive (the maximum
        # of raw scores times it is then the maximum of the scaled scores).
        raw_scores = SOFTMAX and scale > ZERO
        # Q by cp.async (q_tile_copier) when its base and strides allow 16-byte copies
        q_async = Q_ASYNC and (addr_low(q) % U32(16) == U32(0) and q_stride_n % 8 == 0
                               and q_stride_h % 8 == 0)
        c = cuda.blockIdx.x
        w_hi = plan[cta_indptr_off + c + 1]
        phase = U32(0)  # the stage of the item's tile 0 (PREFETCH: where the one before put it)
        ready = False  # the item's tile 0 requested by the item before (PREFETCH)
        for wi in range(plan[cta_indptr_off + c], w_hi):
            item = plan[cta_work_off + wi]
            (b, hk, qs, nrows, start, end, prow, q0, kv_len, ib, row_stride, head_off,
             pos0) = read_item(plan, item, work_off, qo_indptr_off, qo_end_off, q_pos0_off,
                               kv_indptr, kv_last, kv_stride_n, kv_stride_h)
            n_tiles = (end - start + BC - 1) // BC if end > start else 0
            nxt_item = plan[cta_work_off + wi + 1] if PREFETCH and wi + 1 < w_hi else -1
            if GUARD:
                flagged = 0
                first_flag = value_flags_off + (b * hkv + hk) * VALUE_SCAN_SPLITS
                for part in range(VALUE_SCAN_SPLITS):
                    flagged |= plan[first_flag + part]
                if flagged == 0:
                    continue  # finite V: the fast kernel's result stands

            cuda.syncthreads()  # the previous item (and its merge) is done with shared memory
            if q_async:  # Q's copies join tile 0's group: its wait covers them
                copy_q(smem, base + U32(Q_BASE), q, q0, qs, nrows, hk, q_stride_n, q_stride_h,
                       tid)
            if PREFETCH and ready:
                # tile 0 is in stage `phase` already (its own group, before Q's); two stages:
                # the first tile's wait (all groups) covers both
                commit()
            else:
                # Tiles 0 .. NSTG - 2 into stages 0 .. NSTG - 2: one cp.async group each, empty
                # past the last tile, so that group i is always tile i. Issued before Q's
                # loads, so that their latencies overlap (Q's staging area is another part of
                # shared memory).
                phase = U32(0)
                for pt in range(NSTG - 1):
                    if pt < n_tiles:
                        load_kv_tile(smem, base + U32(pt * STAGE_BYTES), k, v, kv_indices,
                                     kv_indptr, b, ib, row_stride, head_off, page_stride,
                                     start + pt * BC, end, hk, tid)
                    else:
                        commit()
            if q_async:
                if n_tiles == 0:
                    wait_all()  # no tile waits for Q's copies: none may outlive the item
            else:
                # Q tile -> its staging area (rounded to the operand type, after the query hook)
                stage_q(smem, base + U32(Q_BASE), q, q0, qs, nrows, hk, pos0, q_stride_n,
                        q_stride_h, tid, ONE)
            publish()  # (wgmma: the tensor cores read Q through the async proxy)
            cuda.syncthreads()
            # A kv_split item: every warp takes the tile's first 16 packed rows (all of them)
            # and a share of each tile's keys; warps past SW (8 warps, or 32-key tiles) idle.
            ksplit = KV_SPLIT and nrows * G <= 16
            qwarp = 0 if ksplit else warp
            if not Q_SMEM:
                load_q(smem, base + U32(Q_BASE), qwarp, lane, qf)
                cuda.syncthreads()  # the last stage is free for KV

            # This lane's two rows: packed rows 16 qwarp + g (h = 0) and + 8 (h = 1).
            pr0 = 16 * qwarp + g
            pr1 = pr0 + 8
            ok0 = pr0 // G < nrows
            ok1 = pr1 // G < nrows
            if WGMMA:  # a warpgroup's warps compute together, as wgmma requires
                active = (64 * (warp // 4)) // G < nrows
            else:
                active = ((warp < SW) if ksplit else (16 * warp) // G < nrows) or \
                    not SKIP_IDLE_WARPS
            m0 = NEG_INF
            m1 = NEG_INF
            poison0 = ZERO  # a clear tile met a -inf score in the row (see the tile loop)
            poison1 = ZERO
            for i in range(NA):
                acc[i] = ZERO
            if GUARD and tid == 0:
                for i in range(BAD_WORDS):  # the first tile's barrier orders this before its
                    bad_keys[i] = U32(0)  # atomics
            cur = phase  # stage of tile it
            ready = False
            for it in range(n_tiles):
                t0 = start + it * BC
                wait_tile()
                publish()
                # One barrier per tile: tile it is in shared memory for every warp, and every
                # warp is done with tile it - 1, whose stage takes tile it + NSTG - 1 now.
                cuda.syncthreads()
                nxt = cur + U32(NSTG - 1) if cur < U32(1) else cur - U32(1)
                if it + NSTG - 1 < n_tiles:
                    load_kv_tile(smem, base + nxt * U32(STAGE_BYTES), k, v, kv_indices,
                                 kv_indptr, b, ib, row_stride, head_off, page_stride,
                                 t0 + (NSTG - 1) * BC, end, hk, tid)
                elif PREFETCH and nxt_item >= 0:
                    # the next item's tile 0 into the stage this item no longer needs
                    (nb_, nhk, nqs, nrows_, nstart, nend, nprow, nq0, nkv_len, nib,
                     nrow_stride, nhead_off, npos0) = read_item(
                        plan, nxt_item, work_off, qo_indptr_off, qo_end_off, q_pos0_off,
                        kv_indptr, kv_last, kv_stride_n, kv_stride_h)
                    if nend > nstart:
                        load_kv_tile(smem, base + nxt * U32(STAGE_BYTES), k, v, kv_indices,
                                     kv_indptr, nb_, nib, nrow_stride, nhead_off, page_stride,
                                     nstart, nend, nhk, tid)
                        phase = nxt
                        ready = True
                    else:
                        commit()
                else:
                    commit()  # an empty group keeps group i meaning tile i
                kb = base + cur * U32(STAGE_BYTES)
                cur = cur + U32(1) if cur < U32(NSTG - 1) else U32(0)
                bad_lo = U32(0)
                bad_hi = U32(0)
                if GUARD:
                    # Clean V: a key whose V row holds NaN/inf gets a zero row (so 0 * V is 0
                    # for the rows that do not keep it) and a bit (so the rows that keep it get
                    # a NaN logit below: the rule's poison). BC x D / 2 words, once per tile.
                    for e in range(tid, BC * HALF, NT):
                        j = e // HALF
                        if scrub_pair(smem, kb + U32(TILE_BYTES + j * RS + 2 * (e % HALF) * ELEM)):
                            cuda.atomic.or_(bad_keys, j // 32, U32(1) << U32(j % 32))
                    cuda.syncthreads()
                    bad_lo = bad_keys[0]
                    bad_hi = bad_keys[BAD_WORDS - 1]  # keys 32-63 of a 64-key tile
                if ksplit:
                    m0, m1, poison0, poison1 = split_tile(
                        smem, kb, base + U32(Q_BASE), 0, KW * (warp % SW), tid, lane, qf, s,
                        acc, scratch, active, t0, end, pos0, pr0, pr1, ok0, ok1, m0, m1,
                        poison0, poison1, scale, raw_scores, bad_lo, bad_hi, kv_indptr,
                        kv_indices, b, plan, mask_indptr_off, mask_words_off, qs, kv_len, hk)
                else:
                    m0, m1, poison0, poison1 = full_tile(
                        smem, kb, base + U32(Q_BASE), warp, 0, tid, lane, qf, s, acc,
                        scratch, active, t0, end, pos0, pr0, pr1, ok0, ok1, m0, m1, poison0,
                        poison1, scale, raw_scores, bad_lo, bad_hi, kv_indptr, kv_indices, b,
                        plan, mask_indptr_off, mask_words_off, qs, kv_len, hk)
                if GUARD:
                    cuda.syncthreads()
                    if tid == 0:
                        for i in range(BAD_WORDS):  # every thread has read them; the next
                            bad_keys[i] = U32(0)  # tile sets them

            if ksplit:
                # The warps' states meet: each rescales its own to the rows' maximum over the
                # warps (acc 2^(m_w - m): the output and, with softmax, the row sums), then warp
                # 0 adds the others' (only its rows are stored below). Two short loops with
                # constant indices keep acc in registers (one loop over warps and accumulators
                # with a factor per warp did not).
                cuda.syncthreads()  # every warp is done with the last tile's stage
                if SOFTMAX:
                    if warp < SW:
                        smem[SPLIT_M + 64 * warp + lane] = m0
                        smem[SPLIT_M + 64 * warp + 32 + lane] = m1
                    cuda.syncthreads()
                    if warp < SW:
                        mx0 = m0
                        mx1 = m1
                        for w in range(SW):
                            mx0 = max(mx0, smem[SPLIT_M + 64 * w + lane])
                            mx1 = max(mx1, smem[SPLIT_M + 64 * w + 32 + lane])
                        c0 = exp2(m0 - (mx0 if mx0 > NEG_INF else ZERO))
                        c1 = exp2(m1 - (mx1 if mx1 > NEG_INF else ZERO))
                        for i in range(NA):
                            acc[i] *= c1 if (i % 4) // 2 else c0
                        m0 = mx0
                        m1 = mx1
                if warp > 0 and warp < SW:
                    sb = (warp - 1) * SPLIT_SLOTS * 32 + lane
                    for i in range(NA):
                        smem[sb + 32 * i] = acc[i]
                    smem[sb + 32 * NA] = poison0
                    smem[sb + 32 * (NA + 1)] = poison1
                cuda.syncthreads()
                if warp == 0:
                    for i in range(NA):
                        x = acc[i]
                        for w in range(SW - 1):
                            x += smem[w * SPLIT_SLOTS * 32 + lane + 32 * i]
                        acc[i] = x
                        if not sim and i % 8 == 7:
                            # ptxas issued all (SW - 1) x NA loads at once (1.4 KiB of spills
                            # at 64-key tiles): a warp barrier every 8 bounds that
                            cuda.syncwarp()
                    for w in range(SW - 1):
                        poison0 = max(poison0, smem[w * SPLIT_SLOTS * 32 + lane + 32 * NA])
                        poison1 = max(poison1, smem[w * SPLIT_SLOTS * 32 + lane + 32 * NA + 32])
                else:
                    ok0 = False
                    ok1 = False

            # Finish: the output (whole KV seen) or this chunk's partial state. One flat loop
            # over the accumulators (constant indices: they stay in registers), rows by h.
            if SOFTMAX:
                # Rows g and g + 8's sums over every key (the mma summed the quad's columns).
                inv0, lse0 = finalize(m0, acc[NO])
                inv1, lse1 = finalize(m1, acc[NO + 2])
                inv0 *= v_scale
                inv1 *= v_scale
                lse0 *= F_LN2
                lse1 *= F_LN2
            else:
                inv0 = inv1 = v_scale
                lse0 = lse1 = ZERO
            split = prow >= 0
            # Output rows (or partial rows) and heads of the lane's two packed rows.
            row0 = (prow if split else q0 + qs) + pr0 // G
            row1 = (prow if split else q0 + qs) + pr1 // G
            head0 = hk * G + pr0 % G
            head1 = hk * G + pr1 % G
            ob0 = (row0 * hq + head0) * D + 2 * t
            ob1 = (row1 * hq + head1) * D + 2 * t
            f0 = poison0
            f1 = poison1
            for idx in range(NO):
                acc[idx] *= inv1 if (idx % 4) // 2 else inv0
                if not abs(acc[idx]) < F_INF:
                    if (idx % 4) // 2:
                        f1 = ONE
                    else:
                        f0 = ONE
            # The non-finite rule: a NaN or inf anywhere in a row's output (from q, or the K or
            # V row of a key it keeps), or a -inf score met in a clear tile, makes the whole row
            # and its LSE NaN. A row's D outputs are spread over the 4 lanes of its quad: sum
            # their flags.
            f0, f1 = quad_reduce(f0, f1, False, tid, scratch)
            if f0 > ZERO:
                lse0 = NAN
            if f1 > ZERO:
                lse1 = NAN
            for idx in range(NO):
                if (f1 if (idx % 4) // 2 else f0) > ZERO:
                    acc[idx] = NAN
            # Accumulators 4 nt + (0, 1) are row 0's dims 8 nt + 2 t + (0, 1); + (2, 3) row 1's.
            for nt in range(D // 8):
                for h in range(2):
                    if ok1 if h else ok0:
                        i = (ob1 if h else ob0) + 8 * nt
                        x0 = acc[4 * nt + 2 * h]
                        x1 = acc[4 * nt + 2 * h + 1]
                        if split:
                            tmp_o[i] = x0
                            tmp_o[i + 1] = x1
                        else:
                            if HAS_OUT:
                                lh = lse1 if h else lse0
                                qh = head1 if h else head0
                                x0 = float32(hook_output(x0, lh, qh))
                                x1 = float32(hook_output(x1, lh, qh))
                            store(o, i, x0)
                            store(o, i + 1, x1)
            if t == 0:
                dst = tmp_lse if split else lse
                if ok0:
                    dst[row0 * hq + head0] = lse0
                if ok1:
                    dst[row1 * hq + head1] = lse1
            if prow >= 0 and not DEFER_MERGE:
                finish_split_tile(plan, counters, flags, tmp_o, tmp_lse, o, lse, item, hk,
                                  hkv, hq, nrows, tid, item_merge_off, merge_rows_off,
                                  merge_indptr_off, merge_indices_off, smem, mnum)

    return prefill_mma_kernel


__all__ = ["MMA_HEAD_DIMS", "MmaPrefillSpec", "build_prefill_mma_kernel", "mma_eligible",
           "prefill_mma_kernel_source"]
