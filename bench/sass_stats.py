"""Compile a decode or tensor-core prefill kernel for sm_90 without a GPU and count what its main
loop costs.

    python bench/sass_stats.py [--group 4] [--head-dim 128] [--dtype float16] [--variant standard]
    python bench/sass_stats.py --kernel prefill --group 1 --variant causal [--ragged]

Needs the CUDA toolkit's ``ptxas`` (registers, spills, shared memory) and, for the instruction
histogram of the hot loop, ``nvdisasm`` (``pip install nvidia-cuda-nvdisasm``; pass its path with
``--nvdisasm`` if it is not on PATH). The loop is found as the largest backward branch region.

Why: decode is HBM-bound only if a warp spends few instructions per byte. At 4.2 TB/s an H200 SM
receives about 16 bytes per cycle and issues at most 4 warp-instructions per cycle, so a group of
``TG`` tokens (``2 * TG * D * itemsize`` bytes of K and V) may cost at most ~``bytes / 4``
warp-instructions in total before the issue rate, not HBM, is the limit. The prefill kernel's
tile loop is bound by the tensor cores only if its mma instructions (HMMA) are a large share of
what each warp issues: an H200 SM sub-partition issues one warp-instruction per cycle and, through
``mma.sync``, finishes an m16n8k16 fp16 mma every ~2 cycles (about 660 TFLOP/s over 132 SMs).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _offline_numba():
    from nbinfer.kernels.offline import assume_device

    assume_device((9, 0))


def compile_spec(spec):
    from numba import cuda

    from nbinfer.kernels.common import FASTMATH
    from nbinfer.kernels.decode import DecodeSpec, decode_kernel_source, decode_signature
    from nbinfer.kernels.prefill import prefill_signature
    from nbinfer.kernels.prefill_mma import prefill_mma_kernel_source
    from nbinfer.kernels.prefill_wgmma import prefill_wgmma_kernel_source

    if isinstance(spec, DecodeSpec):
        source, sig = decode_kernel_source(spec), decode_signature(spec)
    elif getattr(spec, "lean", False):
        source, sig = prefill_wgmma_kernel_source(spec), prefill_signature(spec)
    else:
        source, sig = prefill_mma_kernel_source(spec), prefill_signature(spec)
    ptx, _ = cuda.compile_ptx(source, sig, cc=(9, 0), fastmath=set(FASTMATH))
    return ptx


def hot_loop(sass: str, marks=("DEPBAR",)) -> list[str]:
    """Histogram of the SASS opcodes of the per-group (per-tile) loop: the smallest loop (head
    label to backward branch) that waits on cp.async (DEPBAR), i.e. one round of the gather
    pipeline; ``marks``: opcodes the loop must contain (the prefill tile loop also has HMMA)."""
    lines = sass.splitlines()
    addr = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            addr[m.group(1)] = i
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)
        if m and m.group(1) in addr and addr[m.group(1)] < i:
            lo = addr[m.group(1)]
            body = lines[lo:i]
            shorter = best is None or i - lo < best[1] - best[0]
            if shorter and all(any(mk in x for x in body) for mk in marks):
                best = (lo, i)
    return lines[best[0]:best[1] + 1] if best else []


def loop_histogram(loop: list[str]):
    """Opcode counts of the SASS lines ``loop``."""
    ops = collections.Counter()
    for line in loop:
        m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=("decode", "prefill"), default="decode",
                    help="prefill: the tensor-core prefill kernel (fp16/bf16, D 64/128)")
    ap.add_argument("--ragged", action="store_true", help="prefill: ragged (affine) KV")
    ap.add_argument("--kv-tile", type=int, default=32, help="prefill: keys per KV tile")
    ap.add_argument("--warps", type=int, default=4, help="prefill: warps per CTA (16 rows each)")
    ap.add_argument("--q-shared", action="store_true", help="prefill: Q read from shared memory")
    ap.add_argument("--kv-split", action="store_true",
                    help="prefill: items of <= 16 packed rows split each tile's keys over warps")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--layout", default="NHD")
    ap.add_argument("--variant", default="standard")
    ap.add_argument("--stages", type=int, default=2, help="cp.async stages (decode and prefill)")
    ap.add_argument("--page-groups", type=int, choices=(0, 1), default=1,
                    help="decode: DecodeSpec.page_groups (1, the default: one page-table read "
                         "per group inside a page; 0: the general addressing)")
    ap.add_argument("--mma", action="store_true",
                    help="decode: DecodeSpec(mma=True), q.k and p.v on tensor cores")
    ap.add_argument("--wgmma", action="store_true",
                    help="prefill: MmaPrefillSpec(wgmma=True), the products on warpgroup MMA "
                         "(compiled for sm_90a; use --warps 8 --kv-tile 64)")
    ap.add_argument("--lean", action="store_true",
                    help="prefill: the lean warpgroup kernel (MmaPrefillSpec(lean=True): 8 warps, "
                         "64-key tiles, 2 stages, a 128-register cap unless --max-registers; "
                         "implies --wgmma)")
    ap.add_argument("--prefetch", action="store_true",
                    help="prefill: MmaPrefillSpec(prefetch=True), the per-item overlap (with "
                         "--lean: Q by cp.async, the next item's first tile and Q requested "
                         "during the last tile, unrolled stores; without: the next item's plan "
                         "and first tile, which needs --q-shared or --kv-tile 64 and "
                         "--defer-merge)")
    ap.add_argument("--lazy", action="store_true",
                    help="prefill, with --lean: MmaPrefillSpec(lazy_rescale=True), the online "
                         "softmax's rescale only when a row's maximum grows by more than 2^8")
    ap.add_argument("--qk-ahead", action="store_true",
                    help="prefill, with --lean: MmaPrefillSpec(qk_ahead=True), each tile's "
                         "S = Q K^T issued before the ring's refill")
    ap.add_argument("--swizzle", action="store_true",
                    help="prefill, with --lean: MmaPrefillSpec(swizzle=True), K and V tiles in "
                         "the 128-byte swizzled layout")
    ap.add_argument("--defer-merge", action="store_true",
                    help="prefill: split rows merged by a launch of their own (the lean kernel "
                         "and the one-launch cascade's CASCADE_TILES always)")
    ap.add_argument("--max-registers", type=int, default=None,
                    help="register cap (0: none); default: the spec's own cap")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
    ap.add_argument("--dump", default=None, help="write the hot loop's SASS to this file")
    args = ap.parse_args()
    if args.lean:
        from nbinfer.kernels.prefill_wgmma import LEAN_KV_TILE, LEAN_MAX_REGISTERS, LEAN_STAGES, LEAN_WARPS

        args.wgmma, args.kv_tile, args.stages, args.warps = (True, LEAN_KV_TILE, LEAN_STAGES,
                                                             LEAN_WARPS)
        args.q_shared = True
        if args.max_registers is None:
            args.max_registers = LEAN_MAX_REGISTERS
    _offline_numba()
    if args.wgmma:  # wgmma exists only on the architecture-specific target
        from numba.cuda.cudadrv import nvrtc

        nvrtc.get_arch_option = lambda *_: "compute_90a"
    from nbinfer.kernels.common import ITEMSIZE
    from nbinfer.kernels.decode import DecodeSpec
    from nbinfer.variants import builtins

    variant = {"standard": builtins.standard(), "rope": builtins.rope_llama(),
               "softcap": builtins.soft_cap(30.0), "sigmoid": builtins.sigmoid_attention(),
               "window": builtins.sliding_window(256), "causal": builtins.causal()}[args.variant]
    extra = {} if args.max_registers is None else {"max_registers": args.max_registers or None}
    q_dtype = "float16" if args.dtype.startswith("float8") else args.dtype  # FP8 is KV only
    if args.kernel == "prefill":
        from nbinfer.kernels.prefill_mma import MmaPrefillSpec

        spec = MmaPrefillSpec(args.head_dim, args.group, 1 if args.ragged else args.page_size,
                              args.dtype, args.dtype, args.layout, variant,
                              sparse=not args.ragged, kv_tile=args.kv_tile,
                              stages=args.stages, num_warps=args.warps,
                              q_shared=args.q_shared, kv_split=args.kv_split,
                              wgmma=args.wgmma, lean=args.lean, prefetch=args.prefetch,
                              lazy_rescale=args.lazy, qk_ahead=args.qk_ahead,
                              swizzle=args.swizzle,
                              defer_merge=args.lean or args.defer_merge, **extra)
    else:
        spec = DecodeSpec(args.head_dim, args.group, args.page_size, args.dtype, q_dtype,
                          args.layout, variant, stages=args.stages,
                          page_groups=bool(args.page_groups), mma=args.mma,
                          **extra)
    ptx = compile_spec(spec)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = ["ptxas", "-arch=sm_90a" if args.wgmma else "-arch=sm_90", "-O3", "-v", src, "-o",
               cubin]
        if getattr(spec, "max_registers", None):
            cmd.insert(1, f"--maxrregcount={spec.max_registers}")
        info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
        print(" ".join(line.split("info    : ")[-1] for line in info.splitlines()
                       if "Used" in line or "spill" in line))
        for line in info.splitlines():  # e.g. why ptxas serialised the wgmma chains
            if "Potential Performance" in line:
                print(line.split(" for the function")[0].split("info    : ")[-1])
        if args.nvdisasm:
            sass = subprocess.run([args.nvdisasm, "-c", cubin], capture_output=True, text=True,
                                  check=True).stdout
            marks = ("DEPBAR", "HGMMA" if args.wgmma else "HMMA")
            loop = hot_loop(sass, marks if args.kernel == "prefill" else ("DEPBAR",))
            if args.dump:
                with open(args.dump, "w") as f:
                    f.write("\n".join(loop) + "\n")
            ops = loop_histogram(loop)
            total = sum(ops.values())
            # float64 work anywhere in the kernel: Numba types an int64 mixed with a uint64 as
            # float64, and the SASS then converts, compares and adds in doubles
            every = loop_histogram(sass.splitlines())
            f64 = sum(1 for line in sass.splitlines()
                      if re.search(r"\*/.*\b(DADD|DMUL|DFMA|DSETP|DMNMX)\b|\.F64\b", line))
            print(f"whole kernel: {sum(every.values())} instructions, {f64} of them float64 "
                  f"(D* and F64 conversions)")
            if args.kernel == "prefill":
                hmma = ops.get("HMMA", 0) + ops.get("HGMMA", 0)
                print(f"tile loop: {total} instructions per warp per {spec.tile_kv}-key tile, "
                      f"{hmma} of them HMMA / HGMMA ({100 * hmma / max(total, 1):.0f} %)")
                print(", ".join(f"{k} {v}" for k, v in ops.most_common(24)))
                return
            kv_bytes = 2 * spec.tokens_per_group * spec.head_dim * ITEMSIZE[args.dtype]
            print(f"hot loop: {total} instructions per {kv_bytes}-byte group "
                  f"({total / (kv_bytes / 1024):.0f} per KiB of K+V)")
            print(", ".join(f"{k} {v}" for k, v in ops.most_common(20)))


if __name__ == "__main__":
    main()
