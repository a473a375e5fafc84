"""Hopper's warpgroup MMA (``wgmma.mma_async``) from Numba: the first rung of issue 13's stretch.

The tensor-core kernels of this package issue ``mma.sync.m16n8k16``: one warp, a 16 x 8 x 16
product per instruction, both operands through registers (``ldmatrix``). On sm_90 a warpgroup
(four consecutive warps, 128 threads) can instead issue ``wgmma.mma_async.m64nNk16``: a 64 x N x
16 product per instruction (N up to 256), with A and B read by the tensor cores straight from
shared memory through 64-bit *matrix descriptors*, asynchronously. A 64 x 64 x 16 step is one
instruction per warp where ``mma.sync`` takes 8 ``HMMA`` and 4 ``ldmatrix``; this is how
FlashAttention-3 and cuDNN reach 500-650 TFLOP/s on the H200 where ``mma.sync`` kernels stop
near 330 (bench/NOTES.md, issue 13).

What it takes from Numba, all of it here:

- the ``sm_90a`` target: ``wgmma`` exists only for the architecture-specific target. Numba-CUDA
  (0.30) compiles for ``compute_90a`` whenever the device's compute capability is 9.0 or more
  (``CUDACodeLibrary._ensure_cc``), so a kernel built on the H200 may use it;
- the instruction as inline PTX returning ``N / 2`` float32 accumulators per thread (32 at
  N 64): an LLVM struct of that many floats, tied to the inputs so that it accumulates;
- the ordering instructions: ``wgmma.fence`` (before a warpgroup's first ``wgmma`` and after its
  accumulator registers were touched), ``wgmma.commit_group`` / ``wgmma.wait_group``, and
  ``fence.proxy.async.shared::cta`` between ordinary shared-memory stores and a ``wgmma`` that
  reads them (the tensor cores read through the async proxy);
- descriptors of operands laid out in the canonical *no-swizzle, K-major* form: 8 x 8 core
  matrices (8 rows of 16 bytes, 128 contiguous bytes), LBO bytes between core matrices adjacent
  along K and SBO bytes between core matrices adjacent along M (A) or N (B); and, for the lean
  prefill's K and V (``wgmma_tile_ops(swizzle=True)``), the *128-byte swizzled* form
  (:func:`swizzled_offset`), whose copies read whole 128-byte lines.

Attention needs two products of this kind: ``S = Q K^T`` with both operands in shared memory,
K-major (``mma``), and ``O += P V`` with P straight from S's registers and V as it lies in
memory, ``[keys, D]`` with D contiguous: an *MN-major* B, read with wgmma's transpose flag
(``mma_rs``). The MN-major no-swizzle layout is taken to mirror the K-major one (core matrices
of 8 K-rows x 16 bytes of N, LBO along K, SBO along N: :func:`core_offset_mn`); the gpu test of
``build_pv_product`` is what confirms it.

Layout of the result (PTX ISA, "wgmma .m64nNk16 register fragment D"): warp ``w`` of the
warpgroup holds rows ``16 w .. 16 w + 15``; ``acc[4 j + 2 h + c]`` is row ``16 w + lane // 4
+ 8 h``, column ``8 j + 2 (lane % 4) + c`` - the ``mma.m16n8`` accumulator layout, repeated
for each 8 columns.

Only the GPU build exists (the simulator has no warpgroup MMA); ``tests/test_wgmma.py``
checks both tile products against NumPy on the H200, and ``bench/wgmma_probe.py`` compiles
them for sm_90a on a machine without a GPU and counts their ``HGMMA`` instructions.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from numba import float32, types

U32 = types.uint32
U64 = types.uint64

# wgmma.mma_async's N values that this module builds (multiples of 8 up to 256 exist)
WGMMA_N = (64, 128)
# the operand types it builds, by nbinfer dtype name: PTX's type suffix
WGMMA_KINDS = {"float16": "f16", "bfloat16": "bf16"}


def core_offset(row: int, k: int, sbo: int, lbo: int, itemsize: int = 2) -> int:
    """Byte offset of element ``(row, k)`` of a K-major operand in the no-swizzle canonical
    layout: core matrix ``(row // 8, k // CE)`` (``CE = 16 / itemsize`` elements of K) at
    ``(row // 8) * sbo + (k // CE) * lbo``, 16 bytes per core-matrix row."""
    ce = 16 // itemsize
    return (row // 8) * sbo + (k // ce) * lbo + (row % 8) * 16 + (k % ce) * itemsize


def core_offset_mn(k: int, col: int, sbo: int, lbo: int, itemsize: int = 2) -> int:
    """Byte offset of element ``(k, col)`` of an MN-major operand (``col`` along N contiguous)
    in the no-swizzle layout: core matrix ``(k // 8, col // CE)`` at ``(col // CE) * sbo +
    (k // 8) * lbo``, each of 8 K-rows of 16 bytes (``CE = 16 / itemsize`` columns)."""
    ce = 16 // itemsize
    return (col // ce) * sbo + (k // 8) * lbo + (k % 8) * 16 + (col % ce) * itemsize


def copy_slot(tid: int, nt: int, d: int, mn_major: bool, sbo: int, lbo: int = 128,
              itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """Where thread ``tid`` of ``nt`` copies 16-byte chunks of a ``[rows, d]`` row-major tile
    into the canonical no-swizzle layout (K-major, :func:`core_offset`; or MN-major with the
    rows along K, :func:`core_offset_mn`): ``(row, chunk, dst, row_step, dst_step)``. Its i-th
    copy is row ``row + i row_step``, chunk ``chunk`` (elements ``8 chunk ..``), to shared
    byte ``dst + i dst_step``: one add per copy. Eight consecutive threads take one chunk of
    eight consecutive rows, so their destinations are one core matrix (128 contiguous bytes:
    no bank conflict) and a warp reads whole 32-byte sectors (four chunks of a row). Needs
    ``nt`` a multiple of ``8 x chunks per row``; a tile of ``n`` rows takes ``n / row_step``
    copies per thread."""
    per_row = d * itemsize // 16
    idx = tid % (8 * per_row)
    row, chunk = 8 * (tid // (8 * per_row)) + idx % 8, idx // 8
    row_step = nt // per_row  # rows one pass of the nt threads covers (a multiple of 8)
    # core_offset / core_offset_mn of (row, the chunk's first element), written out: a device
    # function compiled from this one cannot call another plain Python function
    if mn_major:
        return (row, chunk, chunk * sbo + (row // 8) * lbo + (row % 8) * 16, row_step,
                row_step // 8 * lbo)
    return (row, chunk, (row // 8) * sbo + chunk * lbo + (row % 8) * 16, row_step,
            row_step // 8 * sbo)


def swizzled_offset(row: int, col: int, rows: int, itemsize: int = 2) -> int:
    """Byte offset of element ``(row, col)`` of a ``[rows, d]`` row-major tile (``rows`` a
    multiple of 8) in the 128-byte swizzled layout: each 128-byte column block (64 16-bit
    elements) is ``rows`` rows of 128 bytes, and row ``r``'s 16-byte chunk ``c`` of the block
    sits at chunk ``c ^ (r % 8)``. What a ``SWIZZLE_128B`` TMA box writes, and what the
    warpgroup MMA reads with swizzle mode 1: K-major (K's rows are keys, the head dim K) with
    SBO 1024, MN-major (V's rows are keys along K, the head dim along N) with SBO 1024 and LBO
    ``rows x 128``, the next column block."""
    per_block = 128 // itemsize
    block, within = col // per_block, col % per_block
    chunk, e = within * itemsize // 16, within * itemsize % 16
    return block * rows * 128 + row * 128 + ((chunk ^ (row % 8)) * 16) + e


def swizzled_slot(tid: int, nt: int, d: int, rows: int,
                  itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """:func:`copy_slot` for the swizzled layout (:func:`swizzled_offset`): ``(row, chunk, dst,
    row_step, dst_step)``. Consecutive threads take consecutive chunks of one row, so eight
    threads read one whole 128-byte line and write one 128-byte row of a block (its chunks
    permuted: no bank conflict). The canonical layout's map (eight rows' 16-byte pieces per
    eight threads) measured ~2.2 TB/s of copies into the SMs at most, this one 8-12 TB/s
    (bench/NOTES.md, session 30). Needs ``nt`` a multiple of ``8 x chunks per row``."""
    per_row = d * itemsize // 16
    row, chunk = tid // per_row, tid % per_row
    row_step = nt // per_row  # a multiple of 8: row % 8 is the same on every pass
    # swizzled_offset of (row, the chunk's first element), written out (see copy_slot)
    dst = (chunk // 8) * rows * 128 + row * 128 + (((chunk % 8) ^ (row % 8)) * 16)
    return row, chunk, dst, row_step, row_step * 128


def fragment_position(i: int, warp: int, lane: int) -> tuple[int, int]:
    """``(row, column)`` of accumulator ``acc[i]`` of ``lane`` in ``warp`` (0-3) of the
    warpgroup: ``i = 4 j + 2 h + c`` is row ``16 warp + lane // 4 + 8 h``, column ``8 j + 2
    (lane % 4) + c`` (the module docstring's D layout)."""
    j, h, c = i // 4, (i // 2) % 2, i % 2
    return 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + c


def smem_descriptor(addr: int, lbo: int, sbo: int) -> int:
    """The 64-bit matrix descriptor of an operand at shared byte address ``addr`` (16-byte
    aligned), no swizzle: bits 0-13 ``addr >> 4``, 16-29 ``lbo >> 4``, 32-45 ``sbo >> 4``;
    base offset and swizzle mode (bits 49-51, 62-63) zero. Plain arithmetic: callable from
    Python (tests) and compiled into a kernel as it stands."""
    return (((addr >> 4) & 0x3FFF) | (((lbo >> 4) & 0x3FFF) << 16)
            | (((sbo >> 4) & 0x3FFF) << 32))


@functools.cache
def wgmma_intrinsics():
    """The GPU intrinsics, as a namespace: ``mma[(n, kind)](desc_a, desc_b, acc)`` (``acc`` a
    float32 array whose first ``n / 2`` elements are this thread's accumulators, updated in
    place: ``D = A B + D``, A and B K-major in shared memory), ``mma_rs[(n, kind)](a0, a1, a2,
    a3, desc_b, acc)`` (A from registers, B MN-major in shared memory), ``fence()``,
    ``commit()``, ``wait0()`` (all of this warpgroup's committed groups done), ``wait1()``
    (all but the most recent: a product left in flight while the one before it is used),
    ``hold[m](acc)`` (pins the first ``m`` accumulators between a wait and the next fence:
    call after ``wait0`` and before ``fence``) and ``proxy_fence()`` (shared stores made
    visible to the async proxy); for the lean prefill around them, ``opaque_u32(x)`` (``x``
    through a volatile move), ``addr_low(arr)`` (the low 32 bits of ``arr``'s address)
    and ``store_u32(arr, i, word)`` (two 16-bit elements as one store). Every register a
    ``wgmma`` reads (its A fragment, its accumulators) must be written before the ``fence``
    that precedes it."""
    from llvmlite import ir
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    f32 = ir.FloatType()
    i64 = ir.IntType(64)

    from .primitives import _gpu_intrinsics

    make_void = _gpu_intrinsics().asm_void  # volatile, with a memory clobber

    def check_acc(acc):
        if not (isinstance(acc, types.Array) and acc.dtype == float32):
            raise TypeError("wgmma: the accumulator must be a float32 array")

    def in_place(context, builder, arrty, arrval, m, asm, ins):
        # acc[0 .. m - 1] = asm(*ins, *acc[0 .. m - 1]): the asm returns the m floats as one
        # struct, tied to its last m inputs ("0" .. "m-1" after the other inputs).
        arr = context.make_array(arrty)(context, builder, value=arrval)
        ptrs = [cgutils.get_item_pointer(context, builder, arrty, arr,
                                         [context.get_constant(types.intp, i)],
                                         wraparound=False) for i in range(m)]
        res = builder.call(asm, ins + [builder.load(ptr) for ptr in ptrs])
        for i, ptr in enumerate(ptrs):
            builder.store(builder.extract_value(res, i), ptr)
        return context.get_dummy_value()

    def tied_asm(m, text, in_cons, in_types):
        # side_effect: the asm keeps its place among the fences, commits and waits
        constraints = ",".join(["=f"] * m + in_cons + [str(i) for i in range(m)])
        fnty = ir.FunctionType(ir.LiteralStructType([f32] * m), in_types + [f32] * m)
        return ir.InlineAsm(fnty, text, constraints, side_effect=True)

    def make_mma(n: int, kind: str, a_regs: bool, fresh: bool = False):
        # In place on a float32 array (a local array: SROA keeps it in registers) of at least
        # m = n / 2 elements, D = A B + D. a_regs False: A and B from shared memory through
        # descriptors, both K-major. a_regs True: A from four registers (this lane's m16k16
        # fragment of its warp's 16 rows, as mma.m16n8k16 takes it), B MN-major (transpose
        # flag 1). scale-a, scale-b 1; scale-d 1, or with ``fresh`` 0: D = A B, the array's
        # old values neither read nor zeroed first (a chain's first k-step; ptxas found the
        # zeros itself only while nothing else was issued between them and the chain).
        m = n // 2
        outs = ", ".join(f"${i}" for i in range(m))
        scale_d = 0 if fresh else 1
        if a_regs:
            operands = f"{{${m}, ${m + 1}, ${m + 2}, ${m + 3}}}, ${m + 4}, {scale_d}, 1, 1, 1"
            in_cons, in_types = ["r"] * 4 + ["l"], [ir.IntType(32)] * 4 + [i64]
        else:
            operands = f"${m}, ${m + 1}, {scale_d}, 1, 1, 0, 0"
            in_cons, in_types = ["l", "l"], [i64, i64]
        text = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{outs}}}, {operands};"
        if fresh:  # outputs only: the asm returns the m floats, nothing tied
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * m), in_types), text,
                               ",".join(["=f"] * m + in_cons), side_effect=True)
        else:
            asm = tied_asm(m, text, in_cons, in_types)
        n_in = len(in_types)

        def codegen(context, builder, sig, args):
            ins = [context.cast(builder, args[i], sig.args[i], U32 if a_regs and i < 4 else U64)
                   for i in range(n_in)]
            if not fresh:
                return in_place(context, builder, sig.args[n_in], args[n_in], m, asm, ins)
            arrty = sig.args[n_in]
            arr = context.make_array(arrty)(context, builder, value=args[n_in])
            res = builder.call(asm, ins)
            for i in range(m):
                ptr = cgutils.get_item_pointer(context, builder, arrty, arr,
                                               [context.get_constant(types.intp, i)],
                                               wraparound=False)
                builder.store(builder.extract_value(res, i), ptr)
            return context.get_dummy_value()

        if a_regs:
            @intrinsic
            def mma_rs(typingctx, a0, a1, a2, a3, desc_b, acc):
                check_acc(acc)
                return types.void(a0, a1, a2, a3, desc_b, acc), codegen

            return mma_rs

        @intrinsic
        def mma(typingctx, desc_a, desc_b, acc):
            check_acc(acc)
            return types.void(desc_a, desc_b, acc), codegen

        return mma

    def make_hold(m: int):
        # An empty asm that reads and rewrites the first m elements of a float32 array: once
        # the array is in registers nothing else ties the accumulators to the fence and wait
        # asm around them (volatile asm keeps its order, plain arithmetic need not), so LLVM
        # could move a read of a wgmma result above its wait_group or a rescale below its
        # fence. Placed right after a wait and right before a fence, as CUTLASS's
        # warpgroup_fence_operand is.
        asm = tied_asm(m, "", [], [])

        @intrinsic
        def hold(typingctx, acc):
            check_acc(acc)

            def codegen(context, builder, sig, args):
                return in_place(context, builder, sig.args[0], args[0], m, asm, [])

            return types.void(acc), codegen

        return hold

    @intrinsic
    def opaque_u32(typingctx, x):
        # x through a volatile mov: LLVM cannot hoist what is computed from the result out of
        # the loop it is called in (the lean prefill's eight Q descriptors: hoisted out of its
        # tile loop they held 16 registers, 153 instead of 128 with the rest of the loop)
        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
            asm = ir.InlineAsm(fnty, "mov.b32 $0, $1;", "=r,r", side_effect=True)
            return builder.call(asm, [context.cast(builder, args[0], sig.args[0], U32)])

        return U32(x), codegen

    def element_ptr(context, builder, aryty, ary, idx):
        arr = context.make_array(aryty)(context, builder, value=ary)
        return cgutils.get_item_pointer(context, builder, aryty, arr, [idx], wraparound=False)

    @intrinsic
    def addr_low(typingctx, arr):
        # The low 32 bits of arr's first element's address: its alignment, known on the device
        # (a kernel taking any strided view can then choose 16-byte copies where they are legal)
        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0],
                              context.get_constant(types.intp, 0))
            return builder.trunc(builder.ptrtoint(ptr, i64), ir.IntType(32))

        return U32(arr), codegen

    @intrinsic
    def store_u32(typingctx, arr, idx, val):
        # 32 bits at element idx of a 16-bit array (two elements, 4-byte aligned): one store
        # where two element stores would issue twice
        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0], args[1])
            word = context.cast(builder, args[2], sig.args[2], U32)
            builder.store(word, builder.bitcast(ptr, ir.IntType(32).as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(arr, idx, val), codegen

    kinds = [(n, kind) for n in WGMMA_N for kind in WGMMA_KINDS.values()]
    return SimpleNamespace(
        opaque_u32=opaque_u32,
        addr_low=addr_low,
        store_u32=store_u32,
        mma={nk: make_mma(*nk, a_regs=False) for nk in kinds},
        mma_fresh={nk: make_mma(*nk, a_regs=False, fresh=True) for nk in kinds},
        mma_rs={nk: make_mma(*nk, a_regs=True) for nk in kinds},
        fence=make_void("wgmma.fence.sync.aligned;"),
        commit=make_void("wgmma.commit_group.sync.aligned;"),
        wait0=make_void("wgmma.wait_group.sync.aligned 0;"),
        wait1=make_void("wgmma.wait_group.sync.aligned 1;"),
        hold={n // 2: make_hold(n // 2) for n in WGMMA_N},
        proxy_fence=make_void("fence.proxy.async.shared::cta;"))


def _tile_setup(name: str, n: int, k: int, smem_bytes: int, dtype: str):
    """Checks of a one-warpgroup tile kernel's shape (N, a K extent of 16-multiples, operands
    within 48 KiB of static shared memory) and dtype; ``(kind, intrinsics, shared_addr)``."""
    from .primitives import primitives

    if n not in WGMMA_N or k % 16 or k < 16 or smem_bytes > 48 * 1024:
        raise ValueError(f"{name}: n must be one of {WGMMA_N} and the K extent a multiple of "
                         f"16 whose operands fit 48 KiB of static shared memory, got n={n}, "
                         f"k={k} ({smem_bytes} bytes)")
    if dtype not in WGMMA_KINDS:
        raise ValueError(f"{name}: dtype must be one of {sorted(WGMMA_KINDS)}, got {dtype!r}")
    return WGMMA_KINDS[dtype], wgmma_intrinsics(), primitives(False).shared_addr


@functools.cache
def build_tile_product(n: int, d: int, dtype: str = "float16"):
    """A one-warpgroup kernel: ``S = A B^T`` for ``A [64, d]`` and ``B [n, d]`` (row-major,
    16-bit: their bits as uint16), float32 ``S [64, n]`` - the ``Q K^T`` of one 64-row tile
    against ``n`` keys, ``d / 16`` accumulating ``wgmma`` steps. Launch with one CTA of 128
    threads: ``kernel[1, 128](a_bits, b_bits, s)``.

    Both operands are staged into shared memory in the canonical no-swizzle K-major layout
    (:func:`core_offset`, LBO 128 bytes: the two core matrices of a k-step adjacent; SBO
    ``d / 8 * 128``: one 8-row block's whole K), by plain 2-byte stores (a teaching-grade
    staging, not a fast one: the point is the product and its fragment layout)."""
    from numba import cuda

    kind, intr, shared_addr = _tile_setup("build_tile_product", n, d, (64 + n) * d * 2, dtype)
    mma, hold = intr.mma[(n, kind)], intr.hold[n // 2]
    fence, commit, wait0, proxy_fence = intr.fence, intr.commit, intr.wait0, intr.proxy_fence
    LBO, SBO = 128, d // 8 * 128
    A_ELEMS, B_ELEMS = 64 * d, n * d
    SMEM_ELEMS = A_ELEMS + B_ELEMS  # array sizes must be single captured constants
    KSTEPS = d // 16
    KSTEP_BYTES = 2 * LBO  # a k-step's two core matrices along K
    ACC = n // 2  # accumulators per thread
    B_OFF = A_ELEMS * 2  # B's bytes after A's (both 128-byte multiples)

    descriptor = cuda.jit(device=True)(smem_descriptor)
    offset = cuda.jit(device=True)(core_offset)
    position = cuda.jit(device=True)(fragment_position)

    @cuda.jit(device=True)
    def place(row, k):  # uint16 index of element (row, k) of an operand in the layout
        return offset(row, k, SBO, LBO) // 2

    @cuda.jit(lineinfo=False)
    def tile_product(a, b, s):
        smem = cuda.shared.array(SMEM_ELEMS, types.uint16, alignment=128)
        tid = cuda.threadIdx.x
        for e in range(tid, A_ELEMS, 128):
            smem[place(e // d, e % d)] = a[e]
        for e in range(tid, B_ELEMS, 128):
            smem[A_ELEMS + place(e // d, e % d)] = b[e]
        proxy_fence()  # the generic-proxy stores above, visible to the tensor cores' reads
        cuda.syncthreads()
        base = shared_addr(smem, 0)
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = 0.0
        hold(acc)
        fence()  # the accumulators were written by ordinary instructions
        for kk in range(KSTEPS):
            da = descriptor(base + U32(kk * KSTEP_BYTES), LBO, SBO)
            db = descriptor(base + U32(B_OFF + kk * KSTEP_BYTES), LBO, SBO)
            mma(U64(da), U64(db), acc)
        commit()
        wait0()
        hold(acc)
        for i in range(ACC):
            row, col = position(i, tid // 32, tid % 32)
            s[row * n + col] = acc[i]

    return tile_product


@functools.cache
def build_pv_product(n: int, kdim: int, dtype: str = "float16"):
    """A one-warpgroup kernel: ``O = P V`` for ``P [64, kdim]`` and ``V [kdim, n]`` (row-major,
    16-bit bits as uint16), float32 ``O [64, n]`` - attention's second product, P from
    registers in the fragment layout S's accumulators leave it in (each lane packs its own
    elements; no shared memory), V staged MN-major (:func:`core_offset_mn`) and read with the
    transpose flag. ``kernel[1, 128](p_bits, v_bits, o)``."""
    from numba import cuda

    kind, intr, shared_addr = _tile_setup("build_pv_product", n, kdim, kdim * n * 2, dtype)
    mma_rs, hold = intr.mma_rs[(n, kind)], intr.hold[n // 2]
    fence, commit, wait0, proxy_fence = intr.fence, intr.commit, intr.wait0, intr.proxy_fence
    LBO, SBO = 128, kdim // 8 * 128
    V_ELEMS = kdim * n
    ACC = n // 2
    A_WORDS = 4 * (kdim // 16)
    KSTEPS = kdim // 16
    descriptor = cuda.jit(device=True)(smem_descriptor)
    offset_mn = cuda.jit(device=True)(core_offset_mn)
    position = cuda.jit(device=True)(fragment_position)

    @cuda.jit(device=True)
    def place(k, col):  # uint16 index of V's element (k, col) in the MN-major layout
        return offset_mn(k, col, SBO, LBO) // 2

    @cuda.jit(device=True)
    def pair(p, row, col):  # P[row, col], P[row, col + 1] as one b32 (lower column low)
        return U32(p[row * kdim + col]) | (U32(p[row * kdim + col + 1]) << U32(16))

    @cuda.jit(lineinfo=False)
    def pv_product(p, v, o):
        smem = cuda.shared.array(V_ELEMS, types.uint16, alignment=128)
        tid = cuda.threadIdx.x
        for e in range(tid, V_ELEMS, 128):
            smem[place(e // n, e % n)] = v[e]
        proxy_fence()
        cuda.syncthreads()
        base = shared_addr(smem, 0)
        warp, lane = tid // 32, tid % 32
        r0, t2 = 16 * warp + lane // 4, 2 * (lane % 4)
        acc = cuda.local.array(ACC, float32)
        for i in range(ACC):
            acc[i] = 0.0
        a = cuda.local.array(A_WORDS, U32)  # every k-step's A fragment, before the fence
        for kk in range(KSTEPS):
            c0 = 16 * kk + t2
            a[4 * kk] = pair(p, r0, c0)
            a[4 * kk + 1] = pair(p, r0 + 8, c0)
            a[4 * kk + 2] = pair(p, r0, c0 + 8)
            a[4 * kk + 3] = pair(p, r0 + 8, c0 + 8)
        hold(acc)
        fence()
        for kk in range(KSTEPS):
            mma_rs(a[4 * kk], a[4 * kk + 1], a[4 * kk + 2], a[4 * kk + 3],
                   U64(descriptor(base + U32(kk * 2 * LBO), LBO, SBO)), acc)
        commit()
        wait0()
        hold(acc)
        for i in range(ACC):
            row, col = position(i, warp, lane)
            o[row * n + col] = acc[i]

    return pv_product


@functools.cache
def wgmma_tile_ops(head_dim: int, tile_kv: int, dtype: str, num_warps: int,
                   swizzle: bool = False):
    """:func:`nbinfer.kernels.mma.tile_ops`' namespace for the tensor-core prefill on warpgroup
    MMA (``MmaPrefillSpec(wgmma=True)``): the same names, arguments and accumulator layouts,
    so the kernel's softmax, masks, hooks and epilogue run unchanged; what differs is

    - the layout: Q, K and V tiles in the canonical no-swizzle layouts (Q and K K-major with
      an 8-row block's whole head dim in one piece, V MN-major; with ``swizzle``, K and V in
      the 128-byte swizzled layout instead), no padding, so ``RS`` is meaningless here (0) and
      every address goes through ``q_offset`` / ``copy_map``;
    - ``qk_smem``: ``S = Q K^T`` of the calling warp's *warpgroup* (its 64 rows of the Q tile:
      warps ``4 w .. 4 w + 3`` call it together, as every warp of a warpgroup must), ``D / 16``
      ``wgmma.m64n{BC}k16``; each warp gets its 16 rows' scores in the ``mma.m16n8`` layout;
      ``qk_issue`` (same arguments) and ``qk_wait(s)`` are its two halves, so that a caller
      can issue other work while the chain runs;
    - ``pv`` / ``pv_sums``: ``O += P V`` by ``BC / 16`` ``wgmma.m64n{D}k16`` with P from the
      warp's registers and V through the transpose flag; the row sums (``pv_sums``) still by
      ``mma.sync`` against a fragment of ones; ``pv_words(pw, vbase, o)`` the same product for
      P already packed into its A words (``bench/wgmma_attention.py``'s softmax packs as it
      goes);
    - ``publish``: ``fence.proxy.async``, since the tensor cores read shared memory through the
      async proxy (after the thread's cp.async copies and stores, before the barrier);
    - no ``qk`` (Q always in shared memory), ``load_q``, ``scrub_pair`` (the guarded twin
      stays on ``mma.sync``).

    ``tile_kv`` and ``head_dim``: 64 or 128 (wgmma's N of the two products); ``num_warps`` 4 or
    8 (one or two warpgroups). ``swizzle``: K and V tiles in the 128-byte swizzled layout
    (:func:`swizzled_offset`; their stage 1024-byte aligned), copied whole lines at a time
    (:func:`swizzled_slot`) and read with swizzle-mode descriptors; Q stays canonical."""
    from numba import cuda

    from .mma import _gpu_mma_intrinsics, tile_ops
    from .primitives import device_jit

    if head_dim not in WGMMA_N or tile_kv not in WGMMA_N or num_warps not in (4, 8):
        raise ValueError(f"wgmma_tile_ops: head_dim and tile_kv in {WGMMA_N}, num_warps 4 or 8; "
                         f"got {head_dim}, {tile_kv}, {num_warps}")
    if dtype not in WGMMA_KINDS:
        raise ValueError(f"wgmma_tile_ops: dtype must be one of {sorted(WGMMA_KINDS)}, got "
                         f"{dtype!r}")
    D, BC, NT = head_dim, tile_kv, 32 * num_warps
    kind = WGMMA_KINDS[dtype]
    intr, mintr = wgmma_intrinsics(), _gpu_mma_intrinsics()
    mma_qk, mma_pv = intr.mma[(BC, kind)], intr.mma_rs[(D, kind)]
    mma_qk0 = intr.mma_fresh[(BC, kind)]
    hold_s, hold_o = intr.hold[BC // 2], intr.hold[D // 2]
    fence, commit, wait0, proxy_fence = intr.fence, intr.commit, intr.wait0, intr.proxy_fence
    mma, pack, sts_u32 = mintr.mma[kind], mintr.pack[kind], mintr.sts_u32
    ONES = U32(0x3C003C00 if dtype == "float16" else 0x3F803F80)  # two 1.0 of the operand type
    LBO = 128
    SBO_K = D // 8 * 128  # Q and K: an 8-row block holds its whole head dim
    SBO_V = BC // 8 * 128  # V: an 8-column block holds all the tile's keys
    QWG_BYTES = 64 * D * 2  # one warpgroup's 64 Q rows
    KSTEPS, VSTEPS = D // 16, BC // 16
    A_WORDS = 4 * VSTEPS  # P's A fragments (an array size must be one captured constant)
    NS, NO = BC // 2, D // 2
    jit_dev = device_jit(False)
    descriptor = cuda.jit(device=True)(smem_descriptor)
    slot = cuda.jit(device=True)(copy_slot)

    @jit_dev
    def store_pair(smem, addr, lo, hi):
        sts_u32(smem, addr, pack(lo, hi))

    @jit_dev
    def q_offset(p, d):
        return U32((p // 8) * SBO_K + (d // 8) * LBO + (p % 8) * 16 + (d % 8) * 2)

    sw_slot = cuda.jit(device=True)(swizzled_slot)

    @jit_dev
    def copy_map(tid):
        if swizzle:  # eight consecutive threads copy 128 bytes of a row (half of it at D 128)
            j0, c, dst, step, dst_step = sw_slot(tid, NT, D, BC, 2)
            return U32(j0), U32(c), U32(dst), U32(dst), U32(dst_step), U32(dst_step)
        # eight consecutive threads copy one chunk of eight rows: one 128-byte core matrix
        j0, c, dk, step, dk_step = slot(tid, NT, D, False, SBO_K, LBO, 2)
        _, _, dv, _, dv_step = slot(tid, NT, D, True, SBO_V, LBO, 2)
        return U32(j0), U32(c), U32(dk), U32(dv), U32(dk_step), U32(dv_step)

    @jit_dev
    def publish():
        proxy_fence()

    # K's and V's k-steps start 2 LBO bytes apart: a step's descriptor is the first one's low
    # word plus 2 LBO >> 4 (the start address field, bits 0-13, cannot carry: shared addresses
    # stay below 256 KiB) under a constant high word (SBO), one 32-bit add per step instead of
    # a shift, mask and or of a 64-bit value (ptxas: 595 -> 565 instructions per tile of the
    # lean prefill). Q's stay whole: built that way from one base, ptxas serialised the chains
    # for want of registers (bench/NOTES.md, session 17).
    STEP = 2 * LBO >> 4
    LO_LBO = U32((LBO >> 4) << 16)
    HI_K, HI_V = U64((SBO_K >> 4) << 32), U64((SBO_V >> 4) << 32)
    # Swizzled (the same one-add form): K's k-step ks at (ks // 4) column blocks of BC x 128
    # bytes plus 32 bytes a step inside one, LBO unused (1), SBO 1024; V's 16 keys are two
    # 8-key groups of 1024 bytes, LBO the next column block. Mode 1 (128 bytes) in bits 62-63.
    BLOCK = BC * 128
    SW_MODE = 1 << 62
    if swizzle:
        LO_K, LO_V = U32(1 << 16), U32((BLOCK >> 4) << 16)
        HI_K, HI_V = U64((1024 >> 4) << 32 | SW_MODE), U64((1024 >> 4) << 32 | SW_MODE)
        K_BLOCK, K_STEP, V_STEP = BLOCK >> 4, 32 >> 4, 2048 >> 4
    else:  # (k-step ks at ks STEP: four steps a "block")
        LO_K = LO_V = LO_LBO
        K_BLOCK, K_STEP, V_STEP = 4 * STEP, STEP, STEP

    @jit_dev
    def qk_issue(smem, kbase, qbase, warp, lane, s):
        # S = Q K^T's chain, committed and not waited for: ``s`` belongs to the tensor cores
        # until ``qk_wait``, and the caller may issue other work (the ring's refill) meanwhile
        qa = U32(qbase) + U32((warp // 4) * QWG_BYTES)
        fence()  # (the first k-step reads no accumulator: nothing to hold before the fence)
        lb = (U32(kbase) >> U32(4)) | LO_K
        mma_qk0(U64(descriptor(qa, LBO, SBO_K)), HI_K | U64(lb), s)
        for ks in range(1, KSTEPS):
            mma_qk(U64(descriptor(qa + U32(ks * 2 * LBO), LBO, SBO_K)),
                   HI_K | U64(lb + U32((ks // 4) * K_BLOCK + (ks % 4) * K_STEP)), s)
        commit()

    @jit_dev
    def qk_wait(s):
        wait0()
        hold_s(s)  # S's registers are read only after the chain's wait

    @jit_dev
    def qk_smem(smem, kbase, qbase, warp, lane, s):
        qk_issue(smem, kbase, qbase, warp, lane, s)
        qk_wait(s)

    @jit_dev
    def pv_words(pw, vbase, o):
        # O += P V for P already packed as the A words pw (p[8 kk .. 8 kk + 7] -> pw[4 kk ..],
        # mma.sync's packing) and V's tile at vbase, waited for
        hold_o(o)  # the rescaled accumulators, written before the fence
        fence()
        lv = (U32(vbase) >> U32(4)) | LO_V
        for kk in range(VSTEPS):
            mma_pv(pw[4 * kk], pw[4 * kk + 1], pw[4 * kk + 2], pw[4 * kk + 3],
                   HI_V | U64(lv + U32(kk * V_STEP)), o)
        commit()
        wait0()
        hold_o(o)

    def make_pv(sums: bool):
        @jit_dev
        def pv(smem, vbase, tid, lane, p, o, scratch):
            pw = cuda.local.array(A_WORDS, U32)
            for w in range(A_WORDS):
                pw[w] = pack(p[2 * w], p[2 * w + 1])
            pv_words(pw, vbase, o)
            if sums:
                # P times a column of ones: the rows' sums of the rounded P that met V
                for kk in range(VSTEPS):
                    o[NO], o[NO + 1], o[NO + 2], o[NO + 3] = mma(
                        pw[4 * kk], pw[4 * kk + 1], pw[4 * kk + 2], pw[4 * kk + 3], ONES, ONES,
                        o[NO], o[NO + 1], o[NO + 2], o[NO + 3])

        return pv

    def unavailable(*args):
        raise NotImplementedError("the warpgroup tile keeps Q in shared memory and has no "
                                  "guarded twin of its own")

    return SimpleNamespace(ELEM=2, RS=0, QF=1, QF_T=U32, SCRATCH=0, NS=NS, NO=NO,
                           TILE_BYTES=BC * D * 2, store_pair=store_pair, q_offset=q_offset,
                           copy_map=copy_map, publish=publish, qk_smem=qk_smem,
                           qk_issue=qk_issue, qk_wait=qk_wait,
                           pv=make_pv(False), pv_sums=make_pv(True), pv_words=pv_words,
                           quad_reduce=tile_ops(D, BC, dtype, num_warps, False).quad_reduce,
                           qk=unavailable, load_q=unavailable, scrub_pair=unavailable)


__all__ = ["WGMMA_KINDS", "WGMMA_N", "build_pv_product", "build_tile_product", "copy_slot",
           "core_offset", "core_offset_mn", "fragment_position", "smem_descriptor",
           "swizzled_offset", "swizzled_slot", "wgmma_intrinsics", "wgmma_tile_ops"]
