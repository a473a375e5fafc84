"""The decode kernel's two products on tensor cores (``DecodeSpec(mma=True)``): one warp, one
token group, ``S = Q K^T`` and ``O += P V`` as ``mma.sync`` with the GQA group as the M rows.

Why: the CUDA-core decode spends one FFMA per (head, dim, token) on each product, plus a
conversion per element and a reduce-scatter of partial dot products. At FP8 its main loop is
1178 warp-instructions (``bench/sass_stats.py``), and the kernel is issue-bound. On tensor cores
a 16-token FP8 group at ``D = 128`` takes 16 ``m16n8k16`` for ``S`` and 8 for ``O``; the heads
fill only ``G`` of the rows or columns they occupy, but issue slots are the scarce resource here,
not the tensor pipe.

Fragments (PTX ISA ``mma.m16n8k16`` / ``m16n8k8``, ``g = lane // 4``, ``t = lane % 4``):

- ``S = Q K^T``: A is Q (row ``g`` = head ``g``; rows ``>= G`` and ``g + 8`` zero), B is ``K^T``
  (column ``g`` of an n-tile = token ``8 nt + g``), C holds ``S[g][8 nt + 2t + i]`` in its first
  two registers. The sum over dims does not care which dims meet in which k-step, so lane ``t``
  takes the 16-byte chunks ``4 i + t`` of a key row whole (``ld.shared.v4``): k-step ``ks`` uses
  elements ``4 ks .. 4 ks + 3`` of that slice, and Q's fragment is loaded in the same order.
- ``O^T += V^T P^T``: B is ``P^T``, whose fragment (head ``g``; tokens ``2t, 2t+1`` and
  ``2t+8, 2t+9``) is exactly what S's accumulators hold: P never leaves registers (rounded to
  fp16/bf16). A is ``V^T`` with 16 dims per m-tile, so every accumulator register is a real
  (dim, head) pair (heads ``>= G`` aside) and a tile costs 4 registers, not 4 for 2 useful ones
  as ``O = P V`` with 16 head rows would. fp16/bf16 V comes through ``ldmatrix.trans``. FP8 has
  no 8-bit ``ldmatrix.trans`` on sm_90, so the dims are permuted instead (``out_dim``): a lane's
  dims are ``D / 8`` consecutive bytes of each of its four token rows, paired by one byte
  permute (``prmt``) per two dims before ``cvt.rn.f16x2.e4m3x2``. A lane's columns are heads
  ``2t, 2t + 1``, whose softmax factors come from quads ``2t, 2t + 1`` (two shuffles a group).

Shared-memory rows are the gather's, 16-byte chunk ``c`` of row ``r`` stored at
``c ^ swizzle(r)``: the K reads (two rows per quarter-warp), ``ldmatrix.trans`` (eight
consecutive rows) and the FP8 V reads (four rows of one parity) each hit distinct banks.

The simulator has no tensor cores and no cross-lane registers; its twins compute, per lane, the
same fragment elements from shared memory (P staged through a shared scratch, rounded to the
operand precision as the hardware does).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, types

from .mma import FULL_MASK
from .primitives import device_jit, primitives

U32 = types.uint32
MMA_HEAD_DIMS = (64, 128)
MMA_KINDS = {("float16", "float16"): "f16", ("bfloat16", "bfloat16"): "bf16",
             ("float8_e4m3fn", "float16"): "f16", ("float8_e5m2", "float16"): "f16"}


def mma_decode_supported(head_dim: int, group_size: int, kv_dtype: str, q_dtype: str,
                         variant) -> bool:
    """Whether ``DecodeSpec(mma=True)`` can run this configuration: ``D`` 64 or 128, at most 8
    heads per KV head (the rows ``g < 8``), fp16/bf16 queries over a cache of the same dtype or
    fp16 queries over FP8, and a variant without a q or K transform (RoPE) or a mask (the
    CUDA-core path skips masked keys' V; a product on tensor cores reads it)."""
    return (head_dim in MMA_HEAD_DIMS and group_size <= 8
            and (kv_dtype, q_dtype) in MMA_KINDS
            and not (variant.query_transform or variant.key_transform or variant.logits_mask))


# The KV ring's alignment the tensor-core path needs (bytes): its XOR address forms (below, in
# decode_mma_ops) take the chunk index from bits 4 .. 4 + log2(CR) - 1 of the address, CR <= 16.
ROW_ALIGN = 256


def key_chunk_addr(a00, i, nt, row_bytes):
    """``chunk_addr(base, 8 nt + g, 4 i + t)`` from ``a00 = chunk_addr(base, g, t)`` (base
    ROW_ALIGN-aligned): rows r and r + 8 share their swizzle, and chunk 4 i + t is chunk t's
    index XOR 4 i."""
    return (a00 ^ (64 * i)) + 8 * nt * row_bytes


def next_row_addr(v0, row_bytes, cmask):
    """``chunk_addr(base, r + 1, c)`` (+ any offset below 16) from ``v0 = chunk_addr(base, r,
    c)`` for an even row r (base ROW_ALIGN-aligned): the successor's swizzle is r's XOR 5."""
    return (v0 + row_bytes) ^ (16 * (5 & cmask))


def swizzle(row):
    """The XOR applied to 16-byte chunk indices of KV row ``row`` (low three bits). Rows
    ``2p, 2p + 1`` differ in bit 2 (the K reads), eight consecutive rows take eight values
    (``ldmatrix``), and rows of one parity four apart in bits 1-2 (the FP8 V reads)."""
    return (row & 3) | ((((row >> 2) ^ row) & 1) << 2)


@functools.cache
def _gpu_decode_intrinsics():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    i32 = ir.IntType(32)
    f32 = ir.FloatType()

    def make_lds_words(n):
        # n raw 32-bit words at a shared address (n = 2 or 4: one ld.shared.v2/v4).
        regs = ", ".join(f"${i}" for i in range(n))
        text = f"ld.shared.v{n}.b32 {{{regs}}}, [${n}];"

        @intrinsic
        def lds_words(typingctx, addr):
            sig = types.UniTuple(U32, n)(addr)

            def codegen(context, builder, sig, args):
                a = context.cast(builder, args[0], sig.args[0], U32)
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * n), [i32])
                # side_effect: stays below the barrier that published the group.
                res = builder.call(ir.InlineAsm(fnty, text, ",".join(["=r"] * n + ["r"]),
                                                side_effect=True), [a])
                vals = [builder.extract_value(res, i) for i in range(n)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return lds_words

    def make_word_op(text, nargs):
        # One 32-bit result from one or two 32-bit operands through an inline PTX body.
        fnty = ir.FunctionType(i32, [i32] * nargs)
        cons = "=r" + ",r" * nargs

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, a, t, U32) for a, t in zip(args, sig.args, strict=True)]
            return builder.call(ir.InlineAsm(fnty, text, cons), vals)

        if nargs == 1:
            @intrinsic
            def op1(typingctx, a):
                return U32(a), codegen

            return op1

        @intrinsic
        def op2(typingctx, a, b):
            return U32(a, b), codegen

        return op2

    def make_mma_k8(kind):
        text = (f"mma.sync.aligned.m16n8k8.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5}, {$6}, {$7, $8, $9, $10};")

        @intrinsic
        def mma(typingctx, a0, a1, b0, c0, c1, c2, c3):
            sig = types.UniTuple(float32, 4)(a0, a1, b0, c0, c1, c2, c3)

            def codegen(context, builder, sig, args):
                ins = [context.cast(builder, args[i], sig.args[i], U32) for i in range(3)]
                ins += [context.cast(builder, args[i], sig.args[i], float32)
                        for i in range(3, 7)]
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 3 + [f32] * 4)
                res = builder.call(ir.InlineAsm(fnty, text, "=f,=f,=f,=f,r,r,r,f,f,f,f"), ins)
                vals = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return mma

    # FP8 byte pairs -> f16x2 (the lower byte to the lower half, as mma wants the smaller k).
    e4m3 = "{.reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, %s;}"
    # The lanes' bytes of two token rows interleaved: [a.j, b.j, a.j+1, b.j+1] (j = 0 or 2).
    return SimpleNamespace(
        lds_words={n: make_lds_words(n) for n in (2, 4)},
        mma_k8={"f16": make_mma_k8("f16"), "bf16": make_mma_k8("bf16")},
        f8_lo={"float8_e4m3fn": make_word_op(e4m3 % "lo", 1),
               "float8_e5m2": make_word_op("prmt.b32 $0, $1, 0, 0x1404;", 1)},
        f8_hi={"float8_e4m3fn": make_word_op(e4m3 % "hi", 1),
               "float8_e5m2": make_word_op("prmt.b32 $0, $1, 0, 0x3424;", 1)},
        pair_lo=make_word_op("prmt.b32 $0, $1, $2, 0x5140;", 2),
        pair_hi=make_word_op("prmt.b32 $0, $1, $2, 0x7362;", 2),
    )


@functools.cache
def decode_mma_ops(head_dim: int, tokens_per_group: int, kv_dtype: str, q_dtype: str,
                   num_warps: int, sim: bool):
    """The tensor-core products of one warp's token group, as a namespace of device functions.

    - ``chunk_addr(base, row, chunk)``: shared byte address of 16-byte chunk ``chunk`` of KV row
      ``row`` (the swizzled layout the gather writes and the products read);
    - ``load_q(q, qbase, lane, qf)``: this lane's Q fragment (``QF`` words; the simulator keeps
      the head's row, ``QF`` floats) of head ``lane // 4`` from ``q[qbase:]``; call only for
      heads ``< G`` (``clear_q`` zeroes the others);
    - ``scores(kvs, kbase, lane, qf, s)``: ``s[2 nt + i] = S[lane // 4][8 nt + 2 (lane % 4) + i]``
      (unscaled), ``NS = 2 TG / 8`` of them;
    - ``pv(kvs, vbase, lane, p, acc, scratch)``: ``O^T += V^T P^T`` with ``p`` as ``scores``
      left it (now P): ``acc[4 i + 2 r + c]`` is head ``2 (lane % 4) + c`` at dim
      ``out_dim(i, r, lane // 4)``, ``NO = D / 4`` accumulators;
    - ``head_alphas(alpha, lane, scratch)``: the factors of heads ``2t, 2t + 1`` (each quad
      passes its own head's);
    - ``quad_max(x, lane, warp, scratch)`` / ``quad_sum``: over the four lanes of one head.

    ``scratch`` is a shared float32 array of ``SCRATCH`` elements (1 on the GPU).
    """
    D, TG, NW = head_dim, tokens_per_group, num_warps
    prims = primitives(sim)
    IS = 1 if kv_dtype.startswith("float8") else 2
    FP8 = IS == 1
    CE = 16 // IS  # elements per 16-byte chunk
    CR = D // CE  # chunks per KV row
    CMASK = min(CR, 8) - 1  # the swizzle stays inside a row of fewer than 8 chunks
    KCH = D * IS // 64  # chunks of a key row per lane in S (D / 4 elements)
    NTS = TG // 8  # S n-tiles (8 tokens each)
    NS = 2 * NTS
    NTM = D // 16  # O^T m-tiles (16 dims each)
    NO = 4 * NTM
    VB = D // 8 * IS  # FP8 V: bytes of one token row per lane
    QF = D // 8  # Q fragment words (two halves each)
    kind = MMA_KINDS[(kv_dtype, q_dtype)]
    jit_dev = device_jit(sim)
    ZERO = float32(0.0)

    def chunk_addr(base, row, chunk):
        return base + U32(16) * U32(row * CR + (chunk ^ (swz(row) & CMASK)))

    @jit_dev
    def slice_dim(p, t):
        # Dim of element p of lane t's slice of a key row (chunks 4 i + t, CE elements each).
        return (4 * (p // CE) + t) * CE + p % CE

    def out_dim(i, r, g):
        # Dim of row g + 8 r of O^T's m-tile i: fp16/bf16 as ldmatrix.trans reads V; FP8 so
        # that a lane's dims are D / 8 consecutive bytes of a V row.
        if FP8:
            return g * (D // 8) + 2 * i + r
        return 16 * i + 8 * r + g

    # Plain Python in the simulator: its twins call these per element, and a simulated device
    # function costs far more per call than the arithmetic inside.
    swz = swizzle if sim else jit_dev(swizzle)
    if sim:
        return _sim_ops(D, TG, NW, kv_dtype, q_dtype, prims, chunk_addr, out_dim, NS, NO,
                        CE, IS)

    chunk_addr, out_dim = jit_dev(chunk_addr), jit_dev(out_dim)
    ops = _gpu_decode_intrinsics()
    from .mma import _gpu_mma_intrinsics

    mm = _gpu_mma_intrinsics()
    mma16, mma8, pack = mm.mma[kind], ops.mma_k8[kind], mm.pack[kind]
    ldsm_t = mm.ldmatrix_t
    lds4, lds2 = ops.lds_words[4], ops.lds_words[2]
    q_to_f32 = prims.convert[q_dtype]
    f8_lo, f8_hi = (ops.f8_lo[kv_dtype], ops.f8_hi[kv_dtype]) if FP8 else (None, None)
    pair_lo, pair_hi = ops.pair_lo, ops.pair_hi
    Z = U32(0)

    @jit_dev
    def load_q(q, qbase, lane, qf):
        t = lane % 4
        for w in range(QF):
            # Word w: k-step w // 2, half w % 2 -> slice elements 2 w, 2 w + 1.
            lo = q_to_f32(q[qbase + slice_dim(2 * w, t)])
            hi = q_to_f32(q[qbase + slice_dim(2 * w + 1, t)])
            qf[w] = pack(lo, hi)

    @jit_dev
    def clear_q(qf):
        for w in range(QF):
            qf[w] = Z

    # Addresses by XOR, not one register per row and chunk. In the swizzled layout rows r and
    # r + 8 share their swizzle, chunk 4 i + t of a row is chunk t's index XOR 4 i, and an even
    # row's successor has the swizzle XOR 5; with the ring ROW_ALIGN-aligned (the chunk index
    # is the address's bits 4 .. 4 + log2(CR) - 1, rows above it) every address of a group
    # follows from one per lane by an XOR and constant offsets (tests/test_kernels_decode.py
    # checks the identities). The XOR is applied after the group's base is added, so ptxas
    # cannot hoist the lane's part out of the loop into a register of its own: it had kept five
    # such offsets and, at the 128-register cap, reloaded them from local memory every group.
    ROW_BYTES = 16 * CR
    key_addr, row_after = jit_dev(key_chunk_addr), jit_dev(next_row_addr)

    @jit_dev
    def scores(kvs, kbase, lane, qf, s):
        g, t = lane // 4, lane % 4
        a00 = chunk_addr(kbase, g, t)
        for nt in range(NTS):
            # c2, c3 (rows g + 8 of A, all zero) are chained like c0, c1 rather than passed as
            # fresh zeros: they stay 0 (or NaN from an inf in K, never read) and the mma
            # accumulates its register quad in place, with no zeroing per k-step.
            c0 = ZERO
            c1 = ZERO
            c2 = ZERO
            c3 = ZERO
            for i in range(KCH):
                # = chunk_addr(kbase, 8 nt + g, 4 i + t)
                w0, w1, w2, w3 = lds4(key_addr(a00, U32(i), U32(nt), U32(ROW_BYTES)))
                if FP8:  # four k-steps of four codes each
                    ks = 4 * i
                    c0, c1, c2, c3 = mma16(qf[2 * ks], Z, qf[2 * ks + 1], Z, f8_lo(w0),
                                           f8_hi(w0), c0, c1, c2, c3)
                    c0, c1, c2, c3 = mma16(qf[2 * ks + 2], Z, qf[2 * ks + 3], Z, f8_lo(w1),
                                           f8_hi(w1), c0, c1, c2, c3)
                    c0, c1, c2, c3 = mma16(qf[2 * ks + 4], Z, qf[2 * ks + 5], Z, f8_lo(w2),
                                           f8_hi(w2), c0, c1, c2, c3)
                    c0, c1, c2, c3 = mma16(qf[2 * ks + 6], Z, qf[2 * ks + 7], Z, f8_lo(w3),
                                           f8_hi(w3), c0, c1, c2, c3)
                else:  # two k-steps of four halves each
                    ks = 2 * i
                    c0, c1, c2, c3 = mma16(qf[2 * ks], Z, qf[2 * ks + 1], Z, w0, w1, c0, c1,
                                           c2, c3)
                    c0, c1, c2, c3 = mma16(qf[2 * ks + 2], Z, qf[2 * ks + 3], Z, w2, w3, c0,
                                           c1, c2, c3)
            s[2 * nt] = c0
            s[2 * nt + 1] = c1

    @jit_dev
    def pv(kvs, vbase, lane, p, acc, scratch):
        # O^T += V^T P^T: B = P^T is the S accumulator as it is (head g, tokens 2t, 2t+1 and
        # 2t+8, 2t+9), A = V^T (m-tile i: dims out_dim(i, 0, g), out_dim(i, 1, g)).
        g, t = lane // 4, lane % 4
        if TG == 8:  # 8-token groups (fp16/bf16 at D 128): one k8 step; two m-tiles per x4
            b0 = pack(p[0], p[1])
            for iq in range(NTM // 2):
                a0, a1, a2, a3 = ldsm_t(chunk_addr(vbase, lane % 8, 4 * iq + lane // 8))
                i = 2 * iq
                acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3] = mma8(
                    a0, a1, b0, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3])
                i = 2 * iq + 1
                acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3] = mma8(
                    a2, a3, b0, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3])
        else:
            for kk in range(TG // 16):
                b0 = pack(p[4 * kk], p[4 * kk + 1])  # tokens 16 kk + 2t, + 1
                b1 = pack(p[4 * kk + 2], p[4 * kk + 3])  # tokens 16 kk + 8 + 2t, + 1
                r0 = 16 * kk
                if FP8:
                    # The lane's D/8 bytes (dims out_dim(i, r, g)) of rows 2t, 2t+1, 2t+8, 2t+9.
                    ci = g * VB // 16
                    # rows r0 + 2t (+ 8) and r0 + 2t + 1 (+ 8), as chunk_addr places them
                    v0 = chunk_addr(vbase, r0 + 2 * t, ci) + U32((g * VB) % 16)
                    v1 = row_after(v0, U32(ROW_BYTES), U32(CMASK))
                    if VB == 16:
                        x0 = lds4(v0)
                        x1 = lds4(v1)
                        x2 = lds4(v0 + U32(8 * ROW_BYTES))
                        x3 = lds4(v1 + U32(8 * ROW_BYTES))
                    else:
                        x0 = lds2(v0)
                        x1 = lds2(v1)
                        x2 = lds2(v0 + U32(8 * ROW_BYTES))
                        x3 = lds2(v1 + U32(8 * ROW_BYTES))
                    for w in range(VB // 4):
                        # Bytes 4w .. 4w+3 are m-tiles 2w (rows g, g+8) and 2w+1: one byte
                        # permute pairs two tokens' codes of two dims, one cvt per pair.
                        lo01, hi01 = pair_lo(x0[w], x1[w]), pair_hi(x0[w], x1[w])
                        lo23, hi23 = pair_lo(x2[w], x3[w]), pair_hi(x2[w], x3[w])
                        i = 2 * w
                        acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3] = mma16(
                            f8_lo(lo01), f8_hi(lo01), f8_lo(lo23), f8_hi(lo23), b0, b1,
                            acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3])
                        i = 2 * w + 1
                        acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3] = mma16(
                            f8_lo(hi01), f8_hi(hi01), f8_lo(hi23), f8_hi(hi23), b0, b1,
                            acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3])
                else:  # fp16/bf16 D 64: matrices (dims 16i | 16i+8) x (tokens 0-7 | 8-15)
                    m = lane // 8
                    for i in range(NTM):
                        a0, a1, a2, a3 = ldsm_t(chunk_addr(vbase, r0 + lane % 8 + 8 * (m // 2),
                                                           2 * i + m % 2))
                        acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3] = mma16(
                            a0, a1, a2, a3, b0, b1, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                            acc[4 * i + 3])

    @jit_dev
    def head_alphas(alpha, lane, scratch):
        # The lane's O columns are heads 2t and 2t+1; their factors live in quads 2t, 2t+1.
        t = lane % 4
        return (cuda.shfl_sync(FULL_MASK, alpha, 8 * t),
                cuda.shfl_sync(FULL_MASK, alpha, 8 * t + 4))

    @jit_dev
    def quad_max(x, lane, warp, scratch):
        x = max(x, cuda.shfl_xor_sync(FULL_MASK, x, 1))
        return max(x, cuda.shfl_xor_sync(FULL_MASK, x, 2))

    @jit_dev
    def quad_sum(x, lane, warp, scratch):
        x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
        return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)

    return SimpleNamespace(QF=QF, QF_T=U32, NS=NS, NO=NO, SCRATCH=1, chunk_addr=chunk_addr,
                           out_dim=out_dim, load_q=load_q, clear_q=clear_q, scores=scores,
                           pv=pv, head_alphas=head_alphas, quad_max=quad_max,
                           quad_sum=quad_sum)


def _sim_ops(D, TG, NW, kv_dtype, q_dtype, prims, chunk_addr, out_dim, NS, NO, CE, IS):
    to_f32 = prims.convert[q_dtype]
    kv_f32 = prims.convert[kv_dtype]
    bf16 = q_dtype == "bfloat16"
    NTS = NS // 2
    NTM = NO // 4

    def rounded(x):
        # P as the A operand: what an fp16/bf16 register keeps of a float32.
        if bf16:
            return prims.bf16(prims.from_f32_bf16(float32(x)))
        return float32(np.float16(x))

    def kv_at(kvs, base, row, d):
        return kv_f32(kvs[(chunk_addr(base, row, d // CE) + (d % CE) * IS) // IS])

    def load_q(q, qbase, lane, qf):
        for d in range(D):
            qf[d] = to_f32(q[qbase + d])

    def clear_q(qf):
        for d in range(D):
            qf[d] = float32(0.0)

    def scores(kvs, kbase, lane, qf, s):
        t = lane % 4
        for nt in range(NTS):
            for i in range(2):
                row = 8 * nt + 2 * t + i
                acc = float32(0.0)
                for d in range(D):
                    acc += qf[d] * kv_at(kvs, kbase, row, d)
                s[2 * nt + i] = acc

    @cuda.jit(device=True)  # binds the simulator's syncthreads
    def pv(kvs, vbase, lane, p, acc, scratch):
        # Each lane stages its P (head g, its tokens) rounded as the B operand, then forms its
        # O^T elements: rows out_dim(i, r, g), columns heads 2t, 2t+1.
        warp = cuda.threadIdx.x // 32
        g, t = lane // 4, lane % 4
        base = warp * 8 * TG
        for nt in range(NTS):
            for i in range(2):
                scratch[base + g * TG + 8 * nt + 2 * t + i] = rounded(p[2 * nt + i])
        cuda.syncthreads()
        for i in range(NTM):
            for r in range(2):
                dim = out_dim(i, r, g)
                x0 = float32(0.0)
                x1 = float32(0.0)
                for k in range(TG):
                    v = kv_at(kvs, vbase, k, dim)
                    x0 += scratch[base + 2 * t * TG + k] * v
                    x1 += scratch[base + (2 * t + 1) * TG + k] * v
                acc[4 * i + 2 * r] += x0
                acc[4 * i + 2 * r + 1] += x1
        cuda.syncthreads()

    @cuda.jit(device=True)
    def head_alphas(alpha, lane, scratch):
        warp = cuda.threadIdx.x // 32
        base = NW * 8 * TG + warp * 32
        scratch[base + lane] = alpha
        cuda.syncthreads()
        t = lane % 4
        a0, a1 = scratch[base + 8 * t], scratch[base + 8 * t + 4]
        cuda.syncthreads()
        return a0, a1

    def make_quad(is_max):
        @cuda.jit(device=True)
        def quad(x, lane, warp, scratch):
            base = NW * 8 * TG + warp * 32
            scratch[base + lane] = x
            cuda.syncthreads()
            q0 = base + lane - lane % 4
            r = scratch[q0]
            for u in range(1, 4):
                r = max(r, scratch[q0 + u]) if is_max else r + scratch[q0 + u]
            cuda.syncthreads()
            return r

        return quad

    return SimpleNamespace(QF=D, QF_T=float32, NS=NS, NO=NO, SCRATCH=NW * (8 * TG + 32),
                           chunk_addr=chunk_addr, out_dim=out_dim, load_q=load_q,
                           clear_q=clear_q, scores=scores, pv=pv, head_alphas=head_alphas,
                           quad_max=make_quad(True), quad_sum=make_quad(False))


__all__ = ["MMA_HEAD_DIMS", "ROW_ALIGN", "decode_mma_ops", "key_chunk_addr", "mma_decode_supported",
           "next_row_addr", "swizzle"]
