"""What one kernel launch and its Python around it cost on the host (H200 host, torch).

    python bench/launch_cost.py [--out FILE]

The decode kernel of a batch-1 plan (Hq 32, Hkv 8, D 128, KV 512) is launched in several ways on
the same prepared arguments; each figure is the median over 20 rounds of the mean of 500
back-to-back calls (us):

- ``prepared``: :class:`nbinfer.kernels.launch.PreparedLaunch` (``cuLaunchKernelEx`` through
  ctypes with one pointer per parameter: ~100 parameters, a Numba array is 7);
- ``ctypes_bound``: ``cuLaunchKernel`` (eleven foreign-call arguments) packed once;
- ``ex_bound``: ``cuLaunchKernelEx`` (four: grid, block and stream in one struct) packed once;
- ``param_buffer``: ``cuLaunchKernel`` given the parameters as one packed buffer
  (``CU_LAUNCH_PARAM_BUFFER_POINTER``) instead of one pointer each;
- ``one_param_kernel``: a kernel with a single int32 parameter (the driver's floor);
- torch allocations run() may make (``torch.empty`` of the output) and the cost of writing one
  8-byte field of an argument block through NumPy, a memoryview and ``struct.pack_into``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import time

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper  # noqa: E402
from nbinfer.formats import PageTable  # noqa: E402
from nbinfer.kernels.launch import _driver  # noqa: E402


def per_call_us(fn, rounds=20, calls=500):
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter_ns() - t0) / calls / 1e3)
        torch.cuda.synchronize()
    return float(np.median(means))


def param_layout(types_):
    """Byte offsets of every parameter cell in a packed buffer (natural alignment)."""
    from numba import types

    cells, off = [], 0
    for ty in types_:
        if isinstance(ty, types.Array):
            for _ in range(7):
                cells.append((off, 8))
                off += 8
        else:
            size = ty.bitwidth // 8
            off = -(-off // size) * size
            cells.append((off, size))
            off += size
    return cells, -(-off // 8) * 8


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    HQ, HKV, D, PS = 32, 8, 128, 16
    pt = PageTable.from_kv_lens([512], PS, rng=np.random.default_rng(1))
    cache = torch.randn(pt.num_pages, 2, PS, HKV, D, dtype=torch.float16, device="cuda")
    q = torch.randn(1, HQ, D, dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    w = BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(pt.indptr, pt.indices, pt.last_page_len, HQ, HKV, D, PS, q_data_type=torch.float16)
    w.run(q, cache, out=out)
    ref = out.clone()
    P = w.step_plan.launch.launch
    stream = torch.cuda.current_stream().cuda_stream
    res = {"params": int(P._ptrs.size), "prepared": per_call_us(lambda: P(stream))}

    fn = _driver().launch
    bound = (P._func, *P.grid, *P.block, 0, stream, P._params, None)
    res["ctypes_bound"] = per_call_us(lambda: fn(*bound))
    fn_ex, args_ex, _cfg = _driver().bind_launch(P._func, P.grid, P.block, stream, P._params)
    res["ex_bound"] = per_call_us(lambda: fn_ex(*args_ex))

    # One packed buffer: each cell copied from the 8-byte cells of the prepared block.
    cells, size = param_layout(P._types)
    buf = (ctypes.c_uint8 * size)()
    raw = P._vals.view(np.uint8)
    for i, (off, n) in enumerate(cells):
        ctypes.memmove(ctypes.addressof(buf) + off, raw.ctypes.data + 8 * i, n)
    size_t = ctypes.c_size_t(size)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size_t), 0)
    out.zero_()
    fn(P._func, *P.grid, *P.block, 0, stream, None, extra)
    torch.cuda.synchronize()
    res["param_buffer_result_matches"] = bool(torch.equal(out, ref))
    bound_extra = (P._func, *P.grid, *P.block, 0, stream, None, ctypes.addressof(extra))
    res["param_buffer"] = per_call_us(lambda: fn(*bound_extra))

    from numba import cuda

    @cuda.jit("void(int32)")
    def tiny(x):
        pass

    tiny[1, 1](0)
    from numba import types

    fh = tiny.overloads[(types.int32,)]._codelibrary.get_cufunc().handle
    func = int(getattr(fh, "value", None) or int(fh))
    cell = (ctypes.c_int32 * 1)(0)
    ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(cell))
    tiny_args = (func, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(ptrs), None)
    res["one_param_kernel"] = per_call_us(lambda: fn(*tiny_args))

    shape = (1, HQ, D)
    dev = q.device
    res["torch_empty"] = per_call_us(lambda: torch.empty(shape, dtype=torch.float16, device=dev))
    res["torch_empty_like"] = per_call_us(lambda: torch.empty_like(q))
    res["tensor_new_empty"] = per_call_us(lambda: q.new_empty(shape))
    vals = np.zeros(64, dtype=np.int64)
    mv = memoryview(vals).cast("B").cast("q")
    res["numpy_item_write"] = per_call_us(lambda: vals.__setitem__(5, 12345))
    res["memoryview_write"] = per_call_us(lambda: mv.__setitem__(5, 12345))
    res["pack_into_3"] = per_call_us(lambda: struct.pack_into("<3q", vals, 16, 1, 2, 3))
    res["q_checks"] = per_call_us(lambda: (q.dtype is torch.float16 and q.is_contiguous()
                                           and q.shape == shape and q.device == dev))
    res["data_ptr"] = per_call_us(q.data_ptr)
    res["raw_stream"] = per_call_us(lambda: torch._C._cuda_getCurrentRawStream(0))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    for k, v in res.items():
        print(f"{k:30s} {v:.2f}" if isinstance(v, float) else f"{k:30s} {v}")


if __name__ == "__main__":
    main()
