"""Numba + NVVM time of nbinfer's kernels on a machine without a GPU, and ptxas's registers.

The device-side half of a cold compile (Numba typing and lowering, then NVVM to PTX) needs no
GPU: this script compiles each kernel spec with ``numba.cuda.compile_ptx`` for sm_90 in this
process, times it, and, when ``ptxas`` is found (``$CUDA_HOME/bin`` or ``PATH``), assembles the
PTX to report registers and spills as the H200 would see them. It also checks that every
kernel kind and every built-in variant compiles, without a device call.

Needs the CUDA toolkit's NVVM and libdevice; no driver, no NVRTC.

    python3 bench/compile_cpu.py                 # the timed cases
    python3 bench/compile_cpu.py --variants      # plus the decode kernel of every variant
    python3 bench/compile_cpu.py --out bench/results/issue14/compile_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CC = (9, 0)


def _patch_numba():
    """Compile without a driver (:func:`nbinfer.kernels.offline.assume_device`): kernels go
    to ``compile_ptx``, timed, instead of being loaded."""
    from numba.cuda import compile_ptx

    import nbinfer.kernels.compiled as compiled
    from nbinfer.kernels.offline import assume_device

    assume_device(CC)
    results = []

    def gpu_kernel(kind, spec, signature, build, options, module):
        t0 = time.perf_counter()
        ptx, _ = compile_ptx(build(), signature.args, fastmath=bool(options.get("fastmath")),
                             cc=CC)
        results.append(dict(kind=kind, seconds=time.perf_counter() - t0, ptx=ptx,
                            max_registers=options.get("max_registers")))
        return None

    compiled.gpu_kernel = gpu_kernel
    return results


def _ptxas(ptx: str, max_registers) -> dict:
    exe = shutil.which("ptxas") or shutil.which(
        "ptxas", path=os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin"))
    if exe is None:
        cands = sorted(Path("/usr/local").glob("cuda*/bin/ptxas"))
        exe = str(cands[-1]) if cands else None
    if exe is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [exe, f"-arch=sm_{CC[0]}{CC[1]}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")]
        if max_registers:
            cmd.insert(1, f"-maxrregcount={max_registers}")
        t0 = time.perf_counter()
        err = subprocess.run(cmd, capture_output=True, text=True).stderr
        secs = time.perf_counter() - t0
    regs = re.findall(r"Used (\d+) registers", err)
    spill = re.findall(r"(\d+) bytes spill stores", err)
    return {"regs": int(regs[-1]) if regs else None,
            "spill_bytes": int(spill[-1]) if spill else None, "ptxas_s": secs}


def cases(with_variants: bool):
    """(label, builder call) pairs: decode, both prefill kernels, append, merges, the scan."""
    from nbinfer.kernels import append, decode, prefill, prefill_mma, state, value_scan
    from nbinfer.variants import builtins as vb

    def dec(variant, dtype="float16", d=128, g=4):
        return decode.DecodeSpec(head_dim=d, group_size=g, page_size=16, kv_dtype=dtype,
                                 q_dtype=dtype, kv_layout="NHD", variant=variant)

    def pre(cls, variant, dtype="float16"):
        return cls(head_dim=128, group_size=4, page_size=16, kv_dtype=dtype, q_dtype=dtype,
                   kv_layout="NHD", variant=variant)

    out = [
        ("decode fp16 D128 G4", lambda: decode.build_decode_kernel(dec(vb.standard()))),
        ("prefill mma fp16 D128 G4 causal",
         lambda: prefill_mma.build_prefill_mma_kernel(pre(prefill_mma.MmaPrefillSpec,
                                                          vb.causal()))),
        ("prefill cuda-core fp32 D128 G4 causal",
         lambda: prefill.build_prefill_kernel(pre(prefill.PrefillSpec, vb.causal(),
                                                  "float32"))),
        ("append fp16 D128", lambda: append.build_append_kernel(
            append.AppendSpec(row_words=32, page_size=16, word_bytes=8, combined=True))),
        ("merge pair fp16 D128", lambda: state.build_merge_pair(state.StateSpec())),
        ("merge stack fp16 D128", lambda: state.build_merge_stack(state.StateSpec())),
        ("value scan fp16 D128", lambda: value_scan.build_value_scan_kernel(
            pre(prefill_mma.MmaPrefillSpec, vb.causal()))),
    ]
    if with_variants:
        for name, variant in [("sliding window", vb.sliding_window(128)),
                              ("soft cap", vb.soft_cap(30.0)), ("alibi", vb.alibi(32)),
                              ("rope", vb.rope_llama()), ("sigmoid", vb.sigmoid_attention()),
                              ("sinks", vb.attention_sink([0.5] * 32))]:
            out.append((f"decode fp16 D128 G4 {name}",
                        lambda v=variant: decode.build_decode_kernel(dec(v))))
        out.append(("decode bf16 D64 G8", lambda: decode.build_decode_kernel(
            dec(vb.standard(), "bfloat16", 64, 8))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", action="store_true", help="also every built-in variant")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    results = _patch_numba()
    rows = []
    for label, build in cases(args.variants):
        first = len(results)
        t0 = time.perf_counter()
        build()
        wall = time.perf_counter() - t0
        for r in results[first:]:
            row = dict(label=label, kind=r["kind"], wall_s=wall, numba_nvvm_s=r["seconds"],
                       ptx_lines=r["ptx"].count("\n"),
                       ptx_calls=len(re.findall(r"^\s*call", r["ptx"], re.M)),
                       **_ptxas(r["ptx"], r["max_registers"]))
            rows.append(row)
            print(f"{label:42s} {row['numba_nvvm_s']:6.2f} s  {row['ptx_lines']:6d} PTX lines  "
                  f"{row['ptx_calls']} calls  regs {row.get('regs')}  "
                  f"spill {row.get('spill_bytes')} B", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"cc": CC, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
