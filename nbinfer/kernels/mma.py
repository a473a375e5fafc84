"""Warp-level tensor-core tile operations (``mma.sync.m16n8k16``) and their simulator twins.

A warp of the tensor-core prefill kernel owns 16 packed query rows. Its fragments follow the PTX
ISA layout of ``mma.m16n8k16`` (``g = lane // 4``, ``t = lane % 4``):

- accumulator of one 16 x 8 n-tile, 4 float32 per lane: element ``i`` is row ``g + 8 * (i // 2)``,
  column ``2 * t + i % 2``. A lane's array of ``4 * n`` accumulators covers ``n`` n-tiles: index
  ``4 * nt + i``;
- A operand (16 x 16, fp16/bf16 pairs in 4 b32 registers): rows ``g``, ``g + 8``, columns
  ``2t, 2t+1`` and ``2t+8, 2t+9``, which is exactly two adjacent accumulator n-tiles: P = softmax(S)
  becomes the A operand of ``P V`` without leaving registers (FlashAttention-2's trick);
- B operands are loaded from shared memory by ``ldmatrix`` (K rows as they are; V transposed by
  ``ldmatrix.trans``), 8 rows of 16 bytes per 8x8 matrix, 4 matrices per instruction.

Shared-memory rows are ``D + 8`` halves long (``RS`` bytes): consecutive rows then start 16 bytes
apart modulo 128, so the 8 row addresses of one ``ldmatrix`` matrix hit 8 different 16-byte bank
groups (no conflicts) and every row stays 16-byte aligned for ``cp.async``.

The simulator has no tensor cores, no ``ldmatrix`` and no shuffles, and a lane cannot read
another lane's registers. So the twins here work one level up: ``load_q`` / ``qk`` / ``pv`` /
``quad_reduce`` compute, for the calling lane, exactly the fragment elements the warp-wide
instructions would give it, from shared memory (``pv`` stages the P fragments through a shared
scratch, ``quad_reduce`` too, each meeting the block at ``syncthreads``). In the simulator an
address unit is one float32 slot per element (``ELEM = 4`` bytes instead of 2), and P is rounded
to the operand precision as the hardware does.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, types

from .primitives import device_jit, primitives

U32 = types.uint32
FULL_MASK = 0xFFFFFFFF


@functools.cache
def _gpu_mma_intrinsics():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    i32 = ir.IntType(32)
    f32 = ir.FloatType()

    def make_ldmatrix(trans: bool):
        text = ("ldmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "")
                + ".shared.b16 {$0, $1, $2, $3}, [$4];")

        @intrinsic
        def ldmatrix(typingctx, addr):
            sig = types.UniTuple(U32, 4)(addr)

            def codegen(context, builder, sig, args):
                a = context.cast(builder, args[0], sig.args[0], U32)
                fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32])
                # side_effect: stays below the barrier that published the tile.
                res = builder.call(ir.InlineAsm(fnty, text, "=r,=r,=r,=r,r", side_effect=True),
                                   [a])
                vals = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return ldmatrix

    def make_mma(kind: str):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

            def codegen(context, builder, sig, args):
                ins = [context.cast(builder, args[i], sig.args[i], U32) for i in range(6)]
                ins += [context.cast(builder, args[i], sig.args[i], float32) for i in range(6, 10)]
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                res = builder.call(asm, ins)
                vals = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return mma

    def make_pack(kind: str):
        # Two float32 -> one b32 of two halves, round to nearest; lo is the lower half (the
        # element with the smaller column index). cvt puts its first source in the upper half.
        text = f"cvt.rn.{kind}x2.f32 $0, $2, $1;"

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = U32(lo, hi)

            def codegen(context, builder, sig, args):
                vals = [context.cast(builder, args[i], sig.args[i], float32) for i in range(2)]
                fnty = ir.FunctionType(i32, [f32, f32])
                return builder.call(ir.InlineAsm(fnty, text, "=r,f,f"), vals)

            return sig, codegen

        return pack

    @intrinsic
    def sts_u32(typingctx, arr, addr, val):
        sig = types.void(arr, addr, val)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], U32)
            x = context.cast(builder, args[2], sig.args[2], U32)
            fnty = ir.FunctionType(ir.VoidType(), [i32, i32])
            builder.call(ir.InlineAsm(fnty, "st.shared.b32 [$0], $1;", "r,r", side_effect=True),
                         [a, x])
            return context.get_dummy_value()

        return sig, codegen

    return SimpleNamespace(ldmatrix=make_ldmatrix(False), ldmatrix_t=make_ldmatrix(True),
                           mma={"f16": make_mma("f16"), "bf16": make_mma("bf16")},
                           pack={"f16": make_pack("f16"), "bf16": make_pack("bf16")},
                           sts_u32=sts_u32)


def smem_row_bytes(head_dim: int, sim: bool) -> int:
    """Bytes between consecutive rows of a Q, K or V tile in shared memory: ``D`` elements
    plus 8 of padding (16 bytes on the GPU, so that the 8 rows one ``ldmatrix`` reads fall in
    distinct banks); the simulator's twins keep each element in a 4-byte slot."""
    return (head_dim + 8) * (4 if sim else 2)


@functools.cache
def tile_ops(head_dim: int, tile_kv: int, dtype: str, num_warps: int, sim: bool):
    """The warp tile operations of one tensor-core kernel, as a namespace.

    Parameters
    ----------
    head_dim : int
        ``D`` (a multiple of 16).
    tile_kv : int
        Keys per KV tile, ``BC`` (a multiple of 16).
    dtype : {"float16", "bfloat16"}
        Operand type of Q, K, V and P.
    num_warps : int
        Warps per CTA (the simulator twins size their scratch by it).
    sim : bool

    Returns
    -------
    namespace with ``ELEM`` (address bytes per element), ``RS`` (row stride in bytes), ``QF`` /
    ``QF_T`` (size and type of the per-lane Q fragment array), ``SCRATCH`` (float32 slots the
    twins need; 0 on the GPU) and the device functions

    ``store_pair(smem, addr, lo, hi)``
        Two float32 -> two operand elements at ``addr`` (and ``addr + ELEM``).
    ``load_q(smem, qbase, warp, lane, qf)``
        The warp's 16 Q rows (tile rows ``16 warp ...``) from ``qbase`` into fragments ``qf``.
    ``qk(smem, kbase, lane, qf, s)``
        ``s[4 * (BC / 8)] = Q K^T`` for the ``BC`` keys at ``kbase``.
    ``qk_smem(smem, kbase, qbase, warp, lane, s)``
        The same with Q read from shared memory (the tile rows ``16 warp ...`` at ``qbase``),
        one A fragment per k-step: for tiles whose scores need the registers Q would hold.
    ``pv(smem, vbase, tid, lane, p, o, scratch)``
        ``o[4 * (D / 8)] += P V`` with ``p`` (float32 in accumulator layout, rounded to the
        operand type here) and the ``BC x D`` V tile at ``vbase``.
    ``pv_sums(smem, vbase, tid, lane, p, o, scratch)``
        The same, and the rows' sums of the rounded ``P`` added to ``o[NO .. NO + 3]`` (an
        accumulator fragment of one more n-tile: rows g and g + 8 at ``NO`` and ``NO + 2``).
    ``quad_reduce(a, b, is_max, tid, scratch)``
        ``(a, b)`` reduced (max or sum) over the 4 lanes that share a row.
    ``scrub_pair(smem, addr) -> bool``
        Whether either of the two operand elements at ``addr`` is NaN or infinite; if so, both
        are overwritten with zeros.

    and the tiles' layout in shared memory (padded rows, ``RS`` bytes apart; the warpgroup
    tile ops of :func:`nbinfer.kernels.wgmma.wgmma_tile_ops` lay them out otherwise):
    ``TILE_BYTES`` (one K or V tile), ``q_offset(p, d)`` (byte offset of element ``d`` of Q's
    packed row ``p``, or of K's row ``p``, from the tile's start), ``copy_map(tid)`` (``(j0, c,
    dk, dv, dk_step, dv_step)``: the thread's first token row and 16-byte chunk of a KV tile
    and the destinations of its copies ``r = 0, 1, ...``: row ``j0 + r NT / chunks``, K at
    ``dk + r dk_step``, V at ``dv + r dv_step``) and ``publish()`` (what must follow the
    thread's shared stores and cp.async copies before a barrier publishes them to the
    products: nothing here).
    """
    if head_dim % 16 or tile_kv % 16:
        raise ValueError(f"tensor-core tiles need head_dim and tile_kv multiples of 16, got "
                         f"{head_dim}, {tile_kv}")
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"tensor-core operands are float16 or bfloat16, got {dtype!r}")
    D, BC = head_dim, tile_kv
    KSTEPS, NPAIRS, VSTEPS, DPAIRS = D // 16, BC // 16, BC // 16, D // 16
    NS, NO = BC // 2, D // 2  # accumulators per lane: S tile, O tile
    if sim:
        return _sim_tile_ops(D, BC, dtype, num_warps, NS, NO)
    intr = _gpu_mma_intrinsics()
    kind = "f16" if dtype == "float16" else "bf16"
    mma, pack, sts_u32 = intr.mma[kind], intr.pack[kind], intr.sts_u32
    ldmatrix, ldmatrix_t = intr.ldmatrix, intr.ldmatrix_t
    lds2 = primitives(False).make_lds(dtype, 2)
    F_INF = float32(np.inf)
    ONES = U32(0x3C003C00 if dtype == "float16" else 0x3F803F80)  # two 1.0 of the operand type
    ELEM = 2
    RS = smem_row_bytes(D, False)
    jit_dev = device_jit(False)

    @jit_dev
    def store_pair(smem, addr, lo, hi):
        sts_u32(smem, addr, pack(lo, hi))

    @jit_dev
    def mma_pair(a0, a1, a2, a3, b0, b1, b2, b3, acc, c):
        # One A fragment times two B fragments (n-tiles): acc[c .. c + 3] and acc[c + 4 ..]
        acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = mma(
            a0, a1, a2, a3, b0, b1, acc[c], acc[c + 1], acc[c + 2], acc[c + 3])
        acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7] = mma(
            a0, a1, a2, a3, b2, b3, acc[c + 4], acc[c + 5], acc[c + 6], acc[c + 7])

    @jit_dev
    def q_address(qbase, warp, lane):
        # Matrix m of ldmatrix.x4 takes its 8 row addresses from lanes 8m..8m+7: rows 0-7 / 8-15
        # (m odd: +8) of columns k0 / k0+8 (m >= 2): registers a0..a3 of the A fragment.
        row = U32(16 * warp + (lane % 8) + 8 * ((lane // 8) % 2))
        col = U32(8 * (lane // 16))
        return U32(qbase) + row * U32(RS) + col * U32(ELEM)

    @jit_dev
    def k_address(kbase, lane):
        # Matrices: keys n0..n0+7 at d k0 / k0+8, then keys n0+8.. : B fragments of two n-tiles.
        row = U32((lane % 8) + 8 * (lane // 16))
        col = U32(8 * ((lane // 8) % 2))
        return U32(kbase) + row * U32(RS) + col * U32(ELEM)

    @jit_dev
    def load_q(smem, qbase, warp, lane, qf):
        a = q_address(qbase, warp, lane)
        for ks in range(KSTEPS):
            r0, r1, r2, r3 = ldmatrix(a + U32(32 * ks))
            qf[4 * ks] = r0
            qf[4 * ks + 1] = r1
            qf[4 * ks + 2] = r2
            qf[4 * ks + 3] = r3

    @jit_dev
    def qk(smem, kbase, lane, qf, s):
        for i in range(NS):
            s[i] = float32(0.0)
        a = k_address(kbase, lane)
        for ks in range(KSTEPS):
            for npair in range(NPAIRS):
                b0, b1, b2, b3 = ldmatrix(a + U32(16 * RS * npair + 32 * ks))
                mma_pair(qf[4 * ks], qf[4 * ks + 1], qf[4 * ks + 2], qf[4 * ks + 3], b0, b1,
                         b2, b3, s, 8 * npair)

    @jit_dev
    def qk_smem(smem, kbase, qbase, warp, lane, s):
        for i in range(NS):
            s[i] = float32(0.0)
        qa = q_address(qbase, warp, lane)
        a = k_address(kbase, lane)
        for ks in range(KSTEPS):
            q0, q1, q2, q3 = ldmatrix(qa + U32(32 * ks))
            for npair in range(NPAIRS):
                b0, b1, b2, b3 = ldmatrix(a + U32(16 * RS * npair + 32 * ks))
                mma_pair(q0, q1, q2, q3, b0, b1, b2, b3, s, 8 * npair)

    def make_pv(sums: bool):
        @jit_dev
        def pv(smem, vbase, tid, lane, p, o, scratch):
            # V^T fragments by ldmatrix.trans: matrices are tokens k0..k0+7 / k0+8.. (m odd)
            # of dims n0..n0+7 / n0+8.. (m >= 2).
            row = U32((lane % 8) + 8 * ((lane // 8) % 2))
            col = U32(8 * (lane // 16))
            a = U32(vbase) + row * U32(RS) + col * U32(ELEM)
            for kk in range(VSTEPS):
                j = 8 * kk
                a0 = pack(p[j], p[j + 1])
                a1 = pack(p[j + 2], p[j + 3])
                a2 = pack(p[j + 4], p[j + 5])
                a3 = pack(p[j + 6], p[j + 7])
                for dp in range(DPAIRS):
                    b0, b1, b2, b3 = ldmatrix_t(a + U32(16 * RS * kk + 32 * dp))
                    mma_pair(a0, a1, a2, a3, b0, b1, b2, b3, o, 8 * dp)
                if sums:
                    # P times a column of ones (a constant B fragment): the rows' sums of
                    # the rounded P that meets V, in o[NO ..], one mma per 16 keys instead
                    # of an add per score and a quad reduction.
                    o[NO], o[NO + 1], o[NO + 2], o[NO + 3] = mma(
                        a0, a1, a2, a3, ONES, ONES, o[NO], o[NO + 1], o[NO + 2], o[NO + 3])

        return pv

    pv, pv_sums = make_pv(False), make_pv(True)

    @jit_dev
    def quad_reduce(a, b, is_max, tid, scratch):
        for off in (1, 2):
            xa = cuda.shfl_xor_sync(FULL_MASK, a, off)
            xb = cuda.shfl_xor_sync(FULL_MASK, b, off)
            if is_max:
                a = max(a, xa)
                b = max(b, xb)
            else:
                a += xa
                b += xb
        return a, b

    @jit_dev
    def scrub_pair(smem, addr):
        x0, x1 = lds2(smem, addr)
        if abs(x0) < F_INF and abs(x1) < F_INF:
            return False
        sts_u32(smem, addr, U32(0))
        return True

    return SimpleNamespace(ELEM=ELEM, RS=RS, QF=D // 4, QF_T=U32, SCRATCH=0, NS=NS, NO=NO,
                           store_pair=store_pair, load_q=load_q, qk=qk, qk_smem=qk_smem, pv=pv,
                           pv_sums=pv_sums, quad_reduce=quad_reduce, scrub_pair=scrub_pair,
                           **row_layout(D, BC, ELEM, RS, 32 * num_warps, jit_dev))


def row_layout(D: int, BC: int, ELEM: int, RS: int, NT: int, jit_dev) -> dict:
    """The padded-row tile layout's part of :func:`tile_ops`' namespace (see there):
    ``TILE_BYTES``, ``q_offset``, ``copy_map``, ``publish``."""
    CHUNKS = D // 8  # 16-byte copies (8 elements) per token row
    STEP = U32(NT // CHUNKS * RS)  # the rows one pass of the CTA's copies covers

    @jit_dev
    def q_offset(p, d):
        return U32(p) * U32(RS) + U32(d) * U32(ELEM)

    @jit_dev
    def copy_map(tid):
        # D / 8 consecutive threads copy one row's chunks: the whole row in one piece
        tu = U32(tid)
        c = tu % U32(CHUNKS)
        j0 = tu // U32(CHUNKS)
        dst = j0 * U32(RS) + c * U32(8 * ELEM)
        return j0, c, dst, dst, STEP, STEP

    @jit_dev
    def publish():
        pass

    return dict(TILE_BYTES=BC * RS, q_offset=q_offset, copy_map=copy_map, publish=publish)


def _sim_tile_ops(D, BC, dtype, num_warps, NS, NO):
    prims = primitives(True)
    ELEM = 4
    RS = smem_row_bytes(D, True)
    RSE = RS // ELEM  # row stride in float32 slots
    NT = 32 * num_warps
    bf16 = dtype == "bfloat16"
    to_f32, to_bf16 = prims.bf16, prims.from_f32_bf16

    def rounded(x):
        # The operand precision: what the hardware keeps of a float32 in an fp16/bf16 register.
        if bf16:
            return to_f32(to_bf16(float32(x)))
        return float32(np.float16(x))

    def stored(x):
        # Slots hold what cp.async would copy: fp16 values, or bf16 raw bits (as integers).
        return float32(to_bf16(float32(x))) if bf16 else float32(np.float16(x))

    def read(smem, i):
        return to_f32(int(smem[i])) if bf16 else smem[i]

    def store_pair(smem, addr, lo, hi):
        smem[addr // ELEM] = stored(lo)
        smem[addr // ELEM + 1] = stored(hi)

    def load_q(smem, qbase, warp, lane, qf):
        # The lane's two rows (g, g + 8) in full: qf[h * D + d].
        g = lane // 4
        for h in range(2):
            r = qbase // ELEM + (16 * warp + g + 8 * h) * RSE
            for d in range(D):
                qf[h * D + d] = read(smem, r + d)

    def qk(smem, kbase, lane, qf, s):
        t = lane % 4
        for idx in range(NS):
            h, col = (idx % 4) // 2, (idx // 4) * 8 + 2 * t + idx % 2
            r = kbase // ELEM + col * RSE
            acc = float32(0.0)
            for d in range(D):
                acc += qf[h * D + d] * read(smem, r + d)
            s[idx] = acc

    def qk_smem(smem, kbase, qbase, warp, lane, s):
        g, t = lane // 4, lane % 4
        for idx in range(NS):
            h, col = (idx % 4) // 2, (idx // 4) * 8 + 2 * t + idx % 2
            qr = qbase // ELEM + (16 * warp + g + 8 * h) * RSE
            r = kbase // ELEM + col * RSE
            acc = float32(0.0)
            for d in range(D):
                acc += read(smem, qr + d) * read(smem, r + d)
            s[idx] = acc

    def make_pv(sums: bool):
        @cuda.jit(device=True)  # binds the simulator's syncthreads
        def pv(smem, vbase, tid, lane, p, o, scratch):
            warp = tid // 32
            for idx in range(NS):
                scratch[tid * NS + idx] = rounded(p[idx])
            cuda.syncthreads()
            g, t = lane // 4, lane % 4
            for idx in range(NO + (4 if sums else 0)):
                h, dim = (idx % 4) // 2, (idx // 4) * 8 + 2 * t + idx % 2
                acc = float32(0.0)
                for j in range(BC):
                    # P[row g + 8h, key j] lives in lane 4g + (j % 8) // 2 at
                    # 4 (j // 8) + 2h + j % 2; past NO: the row sums (V = 1).
                    src = 32 * warp + 4 * g + (j % 8) // 2
                    pj = scratch[src * NS + 4 * (j // 8) + 2 * h + j % 2]
                    acc += pj * (read(smem, vbase // ELEM + j * RSE + dim) if idx < NO else 1.0)
                o[idx] += acc
            cuda.syncthreads()

        return pv

    @cuda.jit(device=True)
    def quad_reduce(a, b, is_max, tid, scratch):
        base = NT * NS  # after pv's region
        scratch[base + 2 * tid] = a
        scratch[base + 2 * tid + 1] = b
        cuda.syncthreads()
        q0 = tid - tid % 4
        ra, rb = scratch[base + 2 * q0], scratch[base + 2 * q0 + 1]
        for u in range(1, 4):
            xa, xb = scratch[base + 2 * (q0 + u)], scratch[base + 2 * (q0 + u) + 1]
            ra = max(ra, xa) if is_max else ra + xa
            rb = max(rb, xb) if is_max else rb + xb
        cuda.syncthreads()
        return ra, rb

    def scrub_pair(smem, addr):
        i = addr // ELEM
        if abs(read(smem, i)) < np.inf and abs(read(smem, i + 1)) < np.inf:
            return False
        smem[i] = 0.0  # +0.0 in fp16, and bf16 bits 0
        smem[i + 1] = 0.0
        return True

    return SimpleNamespace(ELEM=ELEM, RS=RS, QF=2 * D, QF_T=float32, SCRATCH=NT * (NS + 2),
                           NS=NS, NO=NO, store_pair=store_pair, load_q=load_q, qk=qk,
                           qk_smem=qk_smem, pv=make_pv(False), pv_sums=make_pv(True),
                           quad_reduce=quad_reduce, scrub_pair=scrub_pair,
                           **row_layout(D, BC, ELEM, RS, NT, device_jit(True)))


__all__ = ["smem_row_bytes", "tile_ops"]
