"""GPU-only device primitives and their CUDA-simulator twins.

Kernels in nbinfer are built by factories; each factory asks :func:`primitives` for the device
functions it needs. On a real GPU these are inline-PTX intrinsics and warp shuffles; under
``NUMBA_ENABLE_CUDASIM=1`` they are plain-Python twins with the same meaning (the simulator has no
shuffles, no inline PTX, no bf16), chosen when the kernel is built, never branched on at run time.

Storage dtypes: fp16 KV is stored as ``float16``; bf16 as its raw bits in ``int16`` (torch bf16
tensors have no ``__cuda_array_interface__`` typestr, so callers pass ``t.view(torch.int16)``);
fp32 as ``float32``; FP8 (``float8_e4m3fn``, ``float8_e5m2``) as its ``uint8`` codes, decoded to
float32 by the loads (exactly: every FP8 value is an f16 value).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import config, cuda, float32, int32, types

# Fast math without "no NaNs" / "no infinities": the kernels keep -inf as the empty state and
# must let a NaN reach the output (nbinfer's non-finite rule), which nnan/ninf would let LLVM
# fold away (e.g. ``den > 0`` assumed ordered). Kernels and their device functions alike.
FASTMATH = frozenset({"nsz", "arcp", "contract", "afn", "reassoc"})


def device_jit(sim: bool):
    """The decorator of every nbinfer device function.

    In the simulator, plain ``cuda.jit(device=True)``. On the GPU the function is typed and
    lowered by Numba once per argument types and marked ``alwaysinline`` for NVVM
    (``forceinline``), with the kernels' :data:`FASTMATH` flags, so that inside a kernel it
    compiles to the same code as if written there. Numba's own ``inline="always"`` gives the
    same PTX but copies and re-types the callee's IR at every call site: measured on the CPU
    (``compile_ptx``, sm_90), the decode kernel's Numba + NVVM time 6.2 -> 5.3 s, the tensor-core
    prefill's 10.0 -> 7.9 s, the CUDA-core prefill's 7.6 -> 5.1 s, with the same registers.
    """
    if sim:
        return cuda.jit(device=True)
    return cuda.jit(device=True, forceinline=True, fastmath=set(FASTMATH))

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def simulator() -> bool:
    """True when Numba's CUDA simulator is active (``NUMBA_ENABLE_CUDASIM=1``)."""
    return bool(config.ENABLE_CUDASIM)


@functools.cache
def _gpu_intrinsics():
    """Inline-PTX intrinsics (built lazily: importing llvmlite pieces is GPU-path only)."""
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def element_ptr(context, builder, aryty, ary, idx):
        arr = context.make_array(aryty)(context, builder, value=ary)
        return cgutils.get_item_pointer(context, builder, aryty, arr, [idx], wraparound=False)

    def make_bits_to_f32(text):
        # An integer's low bits -> float32 through the inline PTX ``text`` ($1 the integer as
        # a 32-bit register, $0 the float).
        @intrinsic
        def bits_to_f32(typingctx, bits):
            sig = types.float32(bits)

            def codegen(context, builder, sig, args):
                v = context.cast(builder, args[0], sig.args[0], types.uint32)
                fnty = ir.FunctionType(ir.FloatType(), [ir.IntType(32)])
                return builder.call(ir.InlineAsm(fnty, text, "=f,r"), [v])

            return sig, codegen

        return bits_to_f32

    # cvt.f32.f16 on the low 16 bits of an integer register: one instruction per element.
    f16_bits_to_f32 = make_bits_to_f32("{.reg .b16 h; cvt.u16.u32 h, $1; cvt.f32.f16 $0, h;}")
    # One FP8 code (the low byte) -> float32, as make_lds converts it.
    fp8_to_f32 = {
        "e4m3": make_bits_to_f32("{.reg .b16 a, lo, hi; .reg .b32 f; cvt.u16.u32 a, $1; "
                                 "cvt.rn.f16x2.e4m3x2 f, a; mov.b32 {lo, hi}, f; "
                                 "cvt.f32.f16 $0, lo;}"),
        "e5m2": make_bits_to_f32("{.reg .b16 a; cvt.u16.u32 a, $1; shl.b16 a, a, 8; "
                                 "cvt.f32.f16 $0, a;}"),
    }

    def make_cp_async(nbytes):
        # One cp.async of nbytes (4, 8 or 16) from global memory into shared memory: the copy
        # bypasses registers, so a warp can keep many KV rows in flight while it computes.
        cache = "cg" if nbytes == 16 else "ca"

        @intrinsic
        def cp_async(typingctx, dst, dst_idx, src, src_idx):
            sig = types.void(dst, dst_idx, src, src_idx)

            def codegen(context, builder, sig, args):
                dptr = element_ptr(context, builder, sig.args[0], args[0], args[1])
                sptr = element_ptr(context, builder, sig.args[2], args[2], args[3])
                i64 = ir.IntType(64)
                d = builder.ptrtoint(dptr, i64)
                s = builder.ptrtoint(sptr, i64)
                fnty = ir.FunctionType(ir.VoidType(), [i64, i64])
                asm = ir.InlineAsm(
                    fnty,
                    "{.reg .u64 a; .reg .u32 sa; .reg .u64 g; cvta.to.shared.u64 a, $0; "
                    "cvt.u32.u64 sa, a; cvta.to.global.u64 g, $1; "
                    f"cp.async.{cache}.shared.global [sa], [g], {nbytes};}}",
                    "l,l,~{memory}", side_effect=True)
                builder.call(asm, [d, s])
                return context.get_dummy_value()

            return sig, codegen

        return cp_async

    def make_asm_void(text):
        @intrinsic
        def op(typingctx):
            sig = types.void()

            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()

            return sig, codegen

        return op

    i32 = ir.IntType(32)

    @intrinsic
    def shared_addr(typingctx, arr, idx):
        # The 32-bit shared-window address of arr[idx]: computed once per stage, so every later
        # access is "base register + immediate" instead of 64-bit index arithmetic per element.
        sig = types.uint32(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0], args[1])
            fnty = ir.FunctionType(i32, [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "{.reg .u64 a; cvta.to.shared.u64 a, $1; cvt.u32.u64 $0, a;}",
                               "=r,l")
            return builder.call(asm, [builder.ptrtoint(ptr, ir.IntType(64))])

        return sig, codegen

    def make_lds(kind, n):
        # n consecutive storage elements at a shared address -> n float32, with the widest
        # loads (ld.shared.v4/v2) and one conversion per element.
        itemsize = {"f32": 4, "f16": 2, "bf16": 2, "e4m3": 1, "e5m2": 1}[kind]
        nbytes = n * itemsize
        words = max(nbytes // 4, 1)
        body, w = [], 0
        if nbytes == 2:  # two FP8 codes: a zero-extending 16-bit load into a 32-bit register
            body.append(f"ld.shared.u16 w0, [${n}];")
            w = 1
        while w < words:
            width = 4 if words - w >= 4 else (2 if words - w >= 2 else 1)
            regs = ",".join(f"w{w + i}" for i in range(width))
            dst = f".v{width}.b32 {{{regs}}}" if width > 1 else f".b32 {regs}"
            body.append(f"ld.shared{dst}, [${n}+{4 * w}];")
            w += width
        decl = f".reg .b32 {','.join(f'w{i}' for i in range(words))};"
        if kind in ("e4m3", "e5m2"):
            # Two codes -> an f16x2 pair -> two float32. e4m3: the sm_89+ conversion
            # cvt.rn.f16x2.e4m3x2 of a 16-bit pair (exact: every e4m3 value, NaN included, is
            # an f16 value). e5m2 is the upper byte of an f16, so one byte permute (prmt) per
            # pair puts each code above a zero byte. The f16 -> f32 step is the same as fp16's.
            pairs = -(-n // 2)
            for j in range(pairs):
                if kind == "e4m3":
                    if j % 2 == 0:
                        body.append(f"mov.b32 {{p{j}, p{j + 1}}}, w{j // 2};")
                    body.append(f"cvt.rn.f16x2.e4m3x2 f{j}, p{j};")
                else:
                    sel = "0x1404" if j % 2 == 0 else "0x3424"
                    body.append(f"prmt.b32 f{j}, w{j // 2}, 0, {sel};")
                body.append(f"mov.b32 {{h{2 * j}, h{2 * j + 1}}}, f{j};")
                for i in (2 * j, 2 * j + 1):
                    if i < n:
                        body.append(f"cvt.f32.f16 ${i}, h{i};")
            decl += f" .reg .b32 {','.join(f'f{j}' for j in range(pairs))};"
            decl += f" .reg .b16 {','.join(f'h{i}' for i in range(2 * pairs))};"
            if kind == "e4m3":
                decl += f" .reg .b16 {','.join(f'p{j}' for j in range(pairs + pairs % 2))};"
        else:
            for i in range(n):
                if kind == "f32":
                    body.append(f"mov.b32 ${i}, w{i};")
                elif kind == "f16":
                    if i % 2 == 0:
                        body.append(f"mov.b32 {{h{i}, h{i + 1}}}, w{i // 2};")
                    body.append(f"cvt.f32.f16 ${i}, h{i};")
                else:  # bf16: the bits are the top half of a float32
                    op = f"shl.b32 ${i}, w{i // 2}, 16;" if i % 2 == 0 else \
                        f"and.b32 ${i}, w{i // 2}, 0xFFFF0000;"
                    body.append(op)
            if kind == "f16":
                decl += f" .reg .b16 {','.join(f'h{i}' for i in range(n))};"
        text = "{" + decl + " " + " ".join(body) + "}"
        ret = types.UniTuple(float32, n)

        @intrinsic
        def lds(typingctx, arr, addr):
            sig = ret(arr, addr)

            def codegen(context, builder, sig, args):
                addr32 = context.cast(builder, args[1], sig.args[1], types.uint32)
                fnty = ir.FunctionType(ir.LiteralStructType([ir.FloatType()] * n), [i32])
                # side_effect keeps the load below the barrier that publishes the data.
                asm = ir.InlineAsm(fnty, text, ",".join(["=f"] * n + ["r"]), side_effect=True)
                res = builder.call(asm, [addr32])
                vals = [builder.extract_value(res, i) for i in range(n)]
                return context.make_tuple(builder, sig.return_type, vals)

            return sig, codegen

        return lds

    @intrinsic
    def sts_f32(typingctx, arr, addr, val):
        sig = types.void(arr, addr, float32)

        def codegen(context, builder, sig, args):
            addr32 = context.cast(builder, args[1], sig.args[1], types.uint32)
            fnty = ir.FunctionType(ir.VoidType(), [i32, ir.FloatType()])
            # No memory clobber: ordering against the other shared-memory asm comes from
            # side_effect (volatile asm keeps its order), and Numba's own loads may move freely.
            asm = ir.InlineAsm(fnty, "st.shared.f32 [$0], $1;", "r,f", side_effect=True)
            builder.call(asm, [addr32, args[2]])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async16_to(typingctx, sarr, saddr, src, src_idx):
        # 16 bytes global -> shared at a 32-bit shared address; .cg skips L1 (streamed once).
        sig = types.void(sarr, saddr, src, src_idx)

        def codegen(context, builder, sig, args):
            addr32 = context.cast(builder, args[1], sig.args[1], types.uint32)
            sptr = element_ptr(context, builder, sig.args[2], args[2], args[3])
            i64 = ir.IntType(64)
            fnty = ir.FunctionType(ir.VoidType(), [i32, i64])
            asm = ir.InlineAsm(
                fnty, "{.reg .u64 g; cvta.to.global.u64 g, $1; cp.async.cg.shared.global [$0], [g], 16;}",
                "r,l", side_effect=True)
            builder.call(asm, [addr32, builder.ptrtoint(sptr, i64)])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def load_cg(typingctx, arr, idx):
        # A float32 global load cached in L2 only: data another CTA wrote during this launch
        # (after its threadfence) is read from L2, never from a stale line in this SM's L1.
        sig = float32(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0], args[1])
            fnty = ir.FunctionType(ir.FloatType(), [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "ld.global.cg.f32 $0, [$1];", "=f,l", side_effect=True)
            return builder.call(asm, [builder.ptrtoint(ptr, ir.IntType(64))])

        return sig, codegen

    @intrinsic
    def load16(typingctx, arr, idx):
        # 16 bytes from element idx (16-byte aligned) as four 32-bit words, one vector load
        # through the read-only path.
        sig = types.UniTuple(types.uint32, 4)(arr, idx)

        def codegen(context, builder, sig, args):
            ptr = element_ptr(context, builder, sig.args[0], args[0], args[1])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ir.IntType(64)])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
                               "=r,=r,=r,=r,l")
            res = builder.call(asm, [builder.ptrtoint(ptr, ir.IntType(64))])
            vals = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    return SimpleNamespace(
        f16_bits_to_f32=f16_bits_to_f32,
        load_cg=load_cg,
        load16=load16,
        shared_addr=shared_addr,
        lds={(k, n): make_lds(k, n) for k in ("f16", "bf16", "f32", "e4m3", "e5m2")
             for n in (2, 4, 8, 16, 32)},
        fp8_to_f32=fp8_to_f32,
        sts_f32=sts_f32,
        cp_async16_to=cp_async16_to,
        cp_async={n: make_cp_async(n) for n in (4, 8, 16)},
        commit=make_asm_void("cp.async.commit_group;"),
        wait={n: make_asm_void(f"cp.async.wait_group {n};") for n in range(4)},
        asm_void=make_asm_void,  # a no-operand instruction as an intrinsic (kernels.wgmma)
    )


@functools.cache
def primitives(sim: bool):
    """Device functions for one target: the GPU (``sim=False``) or the simulator (``sim=True``).

    Returns a namespace with

    converters ``f16``, ``bf16``, ``f32`` (storage element -> float32) and ``convert`` (the
    converter of each KV dtype by name, FP8 codes included: an element load decodes the code),
    ``from_f32_bf16`` (float32 -> bf16 bits, round to nearest even),
    ``exp2``, ``log2``, ``make_cp_async(n_elems, itemsize)``, ``commit``, ``wait(n)``;
    shared-memory access by 32-bit address: ``shared_addr(arr, idx)`` (bytes; in the simulator
    an offset into ``arr``), ``make_lds(dtype, n)(arr, addr)`` (n storage elements -> tuple of
    n float32, vector loads), ``sts_f32(arr, addr, x)``, ``cp_async16_to(sarr, addr, src, i)``,
    (16 bytes of ``src`` from element ``i``), ``load_cg(arr, i)`` (a float32 global load that
    bypasses L1), ``load16(arr, i)`` (16 bytes from element ``i``, 16-byte aligned, as four
    uint32 words). Each takes the array it addresses, so the simulator twin can index it; the GPU
    version only uses the address. ``SMEM_ALIGN``: the ``alignment`` of shared arrays that
    cp.async, ldmatrix or vector loads read (16; None in the simulator, which takes none).

    The simulator's shuffles are not provided: kernels use the warp collectives built by
    :func:`warp_collectives`, which have their own shared-memory twins.
    """
    ns = SimpleNamespace()
    if sim:
        def f16_to_f32(x):
            return float32(x)

        def f32_to_f32(x):
            return x

        def bf16_to_f32(bits):
            word = np.array([(int(bits) & 0xFFFF) << 16], dtype=np.uint32)
            return float32(word.view(np.float32)[0])

        def f32_to_bf16(x):
            b = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            return np.int16(np.uint16(b & 0xFFFF).view(np.int16))

        def fp8_table(fmt):
            from ..reference.fp8 import table

            values = table(fmt).astype(np.float32)

            def fp8_to_f32(code):
                return values[int(code) & 0xFF]
            return fp8_to_f32

        e4m3_to_f32, e5m2_to_f32 = fp8_table("float8_e4m3fn"), fp8_table("float8_e5m2")

        def exp2(x):
            if x != x:  # NaN stays NaN, as on the GPU
                return float32(x)
            return float32(2.0 ** x) if x > -math.inf else float32(0.0)

        def log2(x):
            return float32(math.log2(x))

        def make_cp_async(n, itemsize):
            def cp_async(dst, di, src, si):
                for e in range(n):
                    dst[di + e] = src[si + e]
            return cp_async

        def commit():
            pass

        def wait(n):
            def w():
                pass
            return w

        # Shared "addresses" in the simulator are byte offsets into the array passed alongside.
        def shared_addr(arr, idx):
            return idx * arr.itemsize

        convert = {"float16": f16_to_f32, "bfloat16": bf16_to_f32, "float32": f32_to_f32,
                   "float8_e4m3fn": e4m3_to_f32, "float8_e5m2": e5m2_to_f32}

        def make_lds(dtype, n):
            cvt = convert[dtype]

            def lds(arr, addr):
                i = addr // arr.itemsize
                return tuple(cvt(arr[i + e]) for e in range(n))
            return lds

        def sts_f32(arr, addr, val):
            arr[addr // 4] = val

        def load_cg(arr, idx):
            return arr[idx]

        def load16(arr, idx):
            w = np.ascontiguousarray(arr[idx:idx + 16 // arr.itemsize]).view(np.uint32)
            return int(w[0]), int(w[1]), int(w[2]), int(w[3])

        def cp_async16_to(sarr, saddr, src, src_idx):
            n = 16 // src.itemsize
            d = saddr // sarr.itemsize
            for e in range(n):
                sarr[d + e] = src[src_idx + e]

        ns.f16, ns.bf16, ns.f32, ns.from_f32_bf16 = f16_to_f32, bf16_to_f32, f32_to_f32, f32_to_bf16
        ns.convert = convert
        ns.exp2, ns.log2 = exp2, log2
        ns.make_cp_async, ns.commit, ns.wait = make_cp_async, commit, wait
        ns.shared_addr, ns.make_lds, ns.sts_f32, ns.cp_async16_to = (
            shared_addr, make_lds, sts_f32, cp_async16_to)
        ns.load_cg, ns.load16 = load_cg, load16
        ns.SMEM_ALIGN = None  # the simulator's shared arrays take no alignment
        return ns

    from numba.cuda import libdevice

    intr = _gpu_intrinsics()
    jit_dev = device_jit(False)

    @jit_dev
    def f16_to_f32(x):
        return float32(x)

    @jit_dev
    def f32_to_f32(x):
        return x

    @jit_dev
    def bf16_to_f32(bits):
        # bf16 is the top half of a float32: shift the 16 bits into place and reinterpret.
        return libdevice.int_as_float(int32(bits) << 16)

    @jit_dev
    def f32_to_bf16(x):
        b = libdevice.float_as_int(x)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return types.int16(b)

    @jit_dev
    def exp2(x):
        return libdevice.exp2f(x)

    @jit_dev
    def log2(x):
        return libdevice.log2f(x)

    def make_cp_async(n, itemsize):
        nbytes = n * itemsize
        if nbytes in (4, 8, 16):
            return intr.cp_async[nbytes]
        if nbytes % 16:
            raise ValueError(f"cp.async copies 4, 8 or 16 bytes or multiples of 16, got {nbytes}")
        chunk = 16 // itemsize
        reps = nbytes // 16
        cp16 = intr.cp_async[16]

        @jit_dev
        def cp_async(dst, di, src, si):
            for r in range(reps):
                cp16(dst, di + r * chunk, src, si + r * chunk)

        return cp_async

    ns.f16, ns.bf16, ns.f32, ns.from_f32_bf16 = f16_to_f32, bf16_to_f32, f32_to_f32, f32_to_bf16
    ns.convert = {"float16": f16_to_f32, "bfloat16": bf16_to_f32, "float32": f32_to_f32,
                  "float8_e4m3fn": intr.fp8_to_f32["e4m3"], "float8_e5m2": intr.fp8_to_f32["e5m2"]}
    ns.exp2, ns.log2 = exp2, log2
    ns.make_cp_async, ns.commit = make_cp_async, intr.commit
    ns.wait = lambda n: intr.wait[n]
    kinds = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "e4m3",
             "float8_e5m2": "e5m2"}
    ns.shared_addr, ns.sts_f32, ns.cp_async16_to = intr.shared_addr, intr.sts_f32, intr.cp_async16_to
    ns.load_cg, ns.load16 = intr.load_cg, intr.load16
    # Shared arrays read by cp.async, ldmatrix or ld.shared.v4 must start 16-byte aligned.
    ns.SMEM_ALIGN = 16
    ns.make_lds = lambda dtype, n: intr.lds[(kinds[dtype], n)]
    return ns
