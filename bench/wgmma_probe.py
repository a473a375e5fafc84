"""Can Numba reach Hopper's warpgroup MMA? Compile nbinfer.kernels.wgmma's tile kernels (the
Q K^T and the P V products) for sm_90a on a machine without a GPU and show what ptxas made of it.

Needs the CUDA toolkit (NVVM for Numba, ``ptxas``) and, for the instruction listing, ``nvdisasm``
(``--nvdisasm``; bench/sass_stats.py says where to get one). Prints the PTX target, the
``wgmma`` instructions in the PTX, ptxas's registers and shared memory, and the ``HGMMA`` /
``WARPGROUP`` instructions of the SASS:

    python3 bench/wgmma_probe.py --n 64 --d 128 --nvdisasm /path/to/nvdisasm

Whether the product is right is the H200's to say (tests/test_wgmma.py, marked gpu).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # wgmma_attention; nbinfer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="keys per tile (wgmma's N: 64 or 128)")
    ap.add_argument("--d", type=int, default=128, help="head dim (k-steps of 16)")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--product", default="qk",
                    choices=("qk", "pv", "attention", "pipe", "ws"),
                    help="qk: S = A B^T, both K-major in shared memory; pv: O = P V, P in "
                         "registers, V MN-major (--d is then the keys per step, kdim); "
                         "attention: bench/wgmma_attention.py's kernel at head dim --d; "
                         "pipe: its pipelined kernel (--n keys per tile, --stages, --wgs); "
                         "ws: its warp-specialised kernel (--stages, --overlap), under its "
                         "register cap")
    ap.add_argument("--stages", type=int, default=2, help="pipe: K / V buffers in the ring")
    ap.add_argument("--wgs", type=int, default=2, help="pipe: warpgroups (64 rows each) per CTA")
    ap.add_argument("--causal", action="store_true", help="attention: the causal kernel")
    ap.add_argument("--overlap", action="store_true",
                    help="attention, ws: the overlapped kernel")
    ap.add_argument("--tma", action="store_true", help="ws: K and V by TMA copies")
    ap.add_argument("--maxreg", type=int, default=0, help="pipe: ptxas's register cap")
    ap.add_argument("--swizzle", default="", choices=("", "k", "v", "kv"),
                    help="ws, pipe: these operands in the 128-byte swizzled layout (ws: by TMA "
                         "with --tma, else kv by cp.async; pipe: kv)")
    ap.add_argument("--nvdisasm", default=None)
    args = ap.parse_args()

    from nbinfer.kernels.offline import assume_device

    assume_device((9, 0))
    # assume_device pins compute_90 (what the other kernels are counted for); wgmma exists only
    # on the architecture-specific target, which Numba-CUDA picks itself on a 9.x device
    from numba.cuda.cudadrv import nvrtc

    nvrtc.get_arch_option = lambda *_: "compute_90a"
    from numba import cuda, types

    from nbinfer.kernels.wgmma import build_pv_product, build_tile_product

    if args.product == "pipe":
        import wgmma_attention

        kernel, sig = wgmma_attention.build_pipe(args.d, args.causal, args.dtype, args.n,
                                                 args.stages, args.wgs,
                                                 swizzle=bool(args.swizzle))
        kernel = SimpleNamespace(py_func=kernel)
    elif args.product == "ws":
        import wgmma_attention

        kernel, sig = wgmma_attention.build_ws(args.d, args.causal, args.dtype, args.stages,
                                               args.overlap, tma=args.tma,
                                               swizzle=args.swizzle)
        kernel = SimpleNamespace(py_func=kernel)
        cap = [f"-maxrregcount={wgmma_attention.WS_MAX_REGISTERS}"]
    elif args.product == "attention":
        import wgmma_attention  # beside this file

        kernel = wgmma_attention.build(args.d, args.causal, args.dtype, args.overlap)
        sig = (types.int16[::1],) * 3 + (types.int32[::1], types.int32, types.float32)
    else:
        build = build_tile_product if args.product == "qk" else build_pv_product
        kernel = build(args.n, args.d, args.dtype)
        sig = (types.uint16[::1], types.uint16[::1], types.float32[::1])
    cap = cap if args.product == "ws" else [f"-maxrregcount={args.maxreg}"] if args.maxreg else []
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0))
    print("PTX:", *[ln.strip() for ln in ptx.splitlines() if ln.startswith(".target")])
    asm = [ln.strip() for ln in ptx.splitlines() if ln.strip().startswith(("wgmma.", "fence."))]
    print(f"PTX wgmma / fence instructions: {len(asm)}")
    for ln in asm[:4]:
        print("   ", ln[:110])
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        info = subprocess.run(["ptxas", "-arch=sm_90a", "-O3", "-v", *cap, src, "-o", cubin],
                              capture_output=True, text=True, check=True).stderr
        print("ptxas:", " ".join(line.split("info    : ")[-1] for line in info.splitlines()
                                 if "Used" in line or "spill" in line or "arning" in line))
        if args.nvdisasm:
            sass = subprocess.run([args.nvdisasm, "-c", cubin], capture_output=True, text=True,
                                  check=True).stdout
            ops = [ln.split("*/")[-1].strip() for ln in sass.splitlines()
                   if "HGMMA" in ln or "WARPGROUP" in ln]
            print(f"SASS: {sum('HGMMA' in o for o in ops)} HGMMA")
            for o in ops:
                print("   ", o)


if __name__ == "__main__":
    main()
