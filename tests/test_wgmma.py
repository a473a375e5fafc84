"""Hopper's warpgroup MMA from Numba (nbinfer.kernels.wgmma): the operand layout and descriptor
on any machine, one warpgroup's Q K^T tile against NumPy on the H200."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer.kernels.wgmma import (
    copy_slot,
    core_offset,
    core_offset_mn,
    fragment_position,
    smem_descriptor,
    swizzled_offset,
    swizzled_slot,
)


@pytest.mark.parametrize("rows, d", [(64, 16), (64, 128), (128, 64)])
def test_core_layout_places_every_element_once(rows, d):
    # The no-swizzle K-major layout with the tile kernel's strides (LBO 128: a k-step's two core
    # matrices adjacent; SBO d / 8 * 128: an 8-row block's whole K) is a bijection onto the
    # operand's bytes, 2-byte aligned, each 8 x 8 core matrix 128 contiguous bytes. (The
    # kernels compile this function; whether LBO and SBO mean what it assumes only the gpu
    # tests below can tell.)
    sbo = d // 8 * 128
    offs = np.array([[core_offset(r, k, sbo, 128) for k in range(d)] for r in range(rows)])
    assert np.array_equal(np.sort(offs.ravel()), np.arange(0, rows * d * 2, 2))
    core = offs[8:16, 8:16]  # core matrix (1, 1)
    assert core.min() == sbo + 128 and core.max() == sbo + 128 + 126
    assert np.array_equal(core[:, 0], sbo + 128 + 16 * np.arange(8))  # rows 16 bytes apart


@pytest.mark.parametrize("kdim, n", [(16, 64), (64, 128)])
def test_mn_major_layout_places_every_element_once(kdim, n):
    # V's layout for the P V product: core matrices of 8 K-rows x 8 columns (16 bytes, the
    # columns contiguous), LBO 128 between K-neighbours, SBO kdim / 8 * 128 between N-neighbours.
    sbo = kdim // 8 * 128
    offs = np.array([[core_offset_mn(k, c, sbo, 128) for c in range(n)] for k in range(kdim)])
    assert np.array_equal(np.sort(offs.ravel()), np.arange(0, kdim * n * 2, 2))
    assert np.array_equal(offs[0, :8], 2 * np.arange(8))  # a core row: 8 columns, 16 bytes
    assert offs[8, 0] == 128 and offs[0, 8] == sbo


@pytest.mark.parametrize("rows, d", [(64, 128), (64, 64), (128, 128)])
def test_swizzled_layout_places_every_element_once(rows, d):
    # The 128-byte swizzle (what a SWIZZLE_128B TMA box writes and the warpgroup MMA reads in
    # mode 1): a bijection onto the tile's bytes; each 64-column block a run of 128-byte rows;
    # a row's 16-byte chunk c at c ^ (row % 8), so the eight chunks of rows r and r + 1 fall
    # on different 16-byte slots of their lines.
    offs = np.array([[swizzled_offset(r, c, rows) for c in range(d)] for r in range(rows)])
    assert np.array_equal(np.sort(offs.ravel()), np.arange(0, rows * d * 2, 2))
    assert offs[0, 64 % d] == (rows * 128 if d > 64 else 0)  # the second column block
    assert np.array_equal(offs[3, :64:8], 3 * 128 + 16 * (np.arange(8) ^ 3))
    assert np.array_equal(offs[:, 0] // 128, np.arange(rows))


@pytest.mark.parametrize("nt, rows, d", [(256, 64, 128), (256, 64, 64), (128, 64, 128)])
def test_swizzled_slots_copy_whole_lines_once(nt, rows, d):
    # The lean kernel's swizzled copies: every (row, chunk) of the tile once, each landing
    # where swizzled_offset puts it, one add per copy; eight consecutive threads read one
    # whole 128-byte half row (the request size that lifts the copies' ceiling).
    seen = np.zeros((rows, d // 8), int)
    for tid in range(nt):
        row, chunk, dst, row_step, dst_step = swizzled_slot(tid, nt, d, rows)
        for i in range(rows // row_step):
            r = row + i * row_step
            seen[r, chunk] += 1
            assert dst + i * dst_step == swizzled_offset(r, 8 * chunk, rows)
    assert (seen == 1).all()
    for t0 in range(0, nt, 8):  # eight threads: one row, chunks 8 b .. 8 b + 7 of one block
        slots = [swizzled_slot(t, nt, d, rows) for t in range(t0, t0 + 8)]
        assert len({s[0] for s in slots}) == 1
        assert sorted(s[1] for s in slots) == list(range(slots[0][1], slots[0][1] + 8))
        assert slots[0][1] % 8 == 0


@pytest.mark.parametrize("nt, rows, d", [(128, 64, 128), (256, 128, 128), (256, 64, 64),
                                         (128, 128, 64)])
@pytest.mark.parametrize("mn_major", [False, True])
def test_copy_slots_fill_the_layout_once(nt, rows, d, mn_major):
    # The cp.async staging of bench/wgmma_attention.py: every thread's copies i = 0, 1, ...
    # (one add per copy) cover each (row, 16-byte chunk) of the tile once, land where the
    # canonical layout puts that chunk's first element, and eight consecutive threads fill one
    # 128-byte core matrix.
    sbo = (rows if mn_major else d) // 8 * 128
    offset = core_offset_mn if mn_major else core_offset
    seen = np.zeros((rows, d // 8), int)
    firsts = []
    for tid in range(nt):
        row, chunk, dst, row_step, dst_step = copy_slot(tid, nt, d, mn_major, sbo)
        firsts.append(dst)
        for i in range(rows // row_step):
            r = row + i * row_step
            seen[r, chunk] += 1
            assert dst + i * dst_step == offset(r, 8 * chunk, sbo, 128)
    assert np.all(seen == 1)
    for t0 in range(0, nt, 8):
        group = sorted(firsts[t0:t0 + 8])
        assert group == list(range(group[0], group[0] + 128, 16)) and group[0] % 128 == 0


def test_fragment_positions_cover_the_tile_once():
    # The D map the tile kernels' epilogues store through: 128 threads x n / 2 accumulators
    # land on every element of the 64 x n result once, warp w on rows 16 w .. 16 w + 15.
    for n in (64, 128):
        seen = np.zeros((64, n), int)
        for tid in range(128):
            for i in range(n // 2):
                row, col = fragment_position(i, tid // 32, tid % 32)
                assert 16 * (tid // 32) <= row < 16 * (tid // 32) + 16
                seen[row, col] += 1
        assert np.all(seen == 1)


def test_smem_descriptor_fields():
    desc = smem_descriptor(0x1230, lbo=128, sbo=2048)
    assert desc & 0x3FFF == 0x1230 >> 4
    assert (desc >> 16) & 0x3FFF == 128 >> 4
    assert (desc >> 32) & 0x3FFF == 2048 >> 4
    assert desc >> 46 == 0  # base offset 0, no swizzle
    # addresses past the 14 bits the field holds (256 KiB of shared memory) do not spill over
    assert smem_descriptor(1 << 18, 0, 0) == 0


def _bits(x, dtype):
    """16-bit storage of a float32 array and the values it holds, as float64."""
    if dtype == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float64)
    u = x.astype(np.float32).view(np.uint32)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return u, (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _product_on_gpu(kernel, x_bits, y_bits, n):
    """A one-warpgroup tile kernel's float32 ``[64, n]`` result for two 16-bit operands."""
    from numba import cuda

    out = cuda.device_array(64 * n, np.float32)
    kernel[1, 128](cuda.to_device(x_bits.ravel()), cuda.to_device(y_bits.ravel()), out)
    return out.copy_to_host().reshape(64, n)


@pytest.mark.gpu
@pytest.mark.parametrize("n, d, dtype", [(64, 128, "float16"), (128, 64, "float16"),
                                         (64, 64, "bfloat16"), (128, 128, "bfloat16")])
def test_wgmma_tile_product_matches_numpy(rng, n, d, dtype):
    # S = A B^T by d / 16 accumulating wgmma.m64nNk16 steps, both operands read from shared
    # memory through descriptors; the result's fragment layout (warp w: rows 16 w ..; the
    # mma.m16n8 layout per 8 columns) is what the kernel's epilogue assumes. A wrong layout,
    # stride or fragment map gives an error of order 1, not a rounding one.
    from nbinfer.kernels.wgmma import build_tile_product

    a_bits, a = _bits(rng.standard_normal((64, d)), dtype)
    b_bits, b = _bits(rng.standard_normal((n, d)), dtype)
    out = _product_on_gpu(build_tile_product(n, d, dtype), a_bits, b_bits, n)
    assert rel_err(out, a @ b.T) <= TOLERANCE["float32"]


@pytest.mark.gpu
@pytest.mark.parametrize("n, kdim, dtype", [(128, 64, "float16"), (64, 128, "float16"),
                                             (64, 128, "bfloat16"), (128, 128, "bfloat16")])
def test_wgmma_pv_product_matches_numpy(rng, n, kdim, dtype):
    # O = P V with P's fragments in registers (the layout S's accumulators leave them in) and
    # V MN-major in shared memory, read with the transpose flag: attention's second product.
    # Confirms the MN-major core-matrix layout (core_offset_mn) the module assumes.
    from nbinfer.kernels.wgmma import build_pv_product

    p_bits, p = _bits(rng.standard_normal((64, kdim)), dtype)
    v_bits, v = _bits(rng.standard_normal((kdim, n)), dtype)
    out = _product_on_gpu(build_pv_product(n, kdim, dtype), p_bits, v_bits, n)
    assert rel_err(out, p @ v) <= TOLERANCE["float32"]


def test_wgmma_prefill_spec_needs_the_gpu_and_the_row_tile():
    # The simulator has no warpgroup MMA; the spec says so instead of building a kernel that
    # cannot run (only the lean kernel has a form there), and so for the tile shapes the
    # warpgroup path does not take.
    from nbinfer.kernels.prefill_mma import MmaPrefillSpec
    from nbinfer.variants import builtins

    args = (128, 4, 16, "float16", "float16", "NHD", builtins.causal())
    for bad in (dict(sim=True), dict(kv_tile=32), dict(num_warps=2), dict(kv_split=True),
                dict(value_guard=True)):
        opts = dict(kv_tile=64, num_warps=8, wgmma=True) | bad
        with pytest.raises(ValueError, match="wgmma=True needs"):
            MmaPrefillSpec(*args, **opts)
    assert MmaPrefillSpec(*args, kv_tile=64, num_warps=8, wgmma=True).tile_q == 128
    # the lean kernel alone has a simulator form (tests/test_kernels_prefill_wgmma.py)
    lean = dict(kv_tile=64, num_warps=8, wgmma=True, lean=True, stages=2, defer_merge=True)
    assert MmaPrefillSpec(*args, sim=True, **lean).sim


def test_the_swizzled_lean_spec_is_the_gpus_and_holds_a_kilobyte_more():
    # swizzle is a lean rung and a GPU layout: refused without lean (naming the flag) and in
    # the simulator; its shared buffer is 1 KiB larger (the stages start on a 1024-byte
    # boundary) and the companions on mma.sync drop it.
    from nbinfer.kernels.prefill_mma import MmaPrefillSpec, shared_layout
    from nbinfer.variants import builtins

    args = (128, 4, 16, "float16", "float16", "NHD", builtins.causal())
    lean = dict(kv_tile=64, num_warps=8, wgmma=True, lean=True, stages=2, defer_merge=True)
    with pytest.raises(ValueError, match="swizzle"):
        MmaPrefillSpec(*args, kv_tile=64, num_warps=8, wgmma=True, swizzle=True)
    with pytest.raises(ValueError, match="sim=True"):
        MmaPrefillSpec(*args, sim=True, swizzle=True, **lean)
    plain, swizzled = (MmaPrefillSpec(*args, swizzle=sw, **lean) for sw in (False, True))
    a, b = shared_layout(plain), shared_layout(swizzled)
    assert b["total"] == a["total"] + 1024 and b["stage"] == a["stage"]
    assert b["q_base"] == a["q_base"] and b["dynamic"] == b["total"]
    assert b["stage"] % 1024 == 0 and b["q_base"] % 1024 == 0  # stays on the boundary
    assert not swizzled.on_mma_sync().swizzle


def test_lean_prefill_spec_takes_plain_variants_only():
    # The lean warpgroup kernel (kernels/prefill_wgmma.py) computes causal or unmasked softmax
    # attention with no hooks; the spec refuses everything else, and the plan's rule asks the
    # same question (lean_eligible) before choosing it.
    from nbinfer.kernels.prefill_mma import MmaPrefillSpec
    from nbinfer.kernels.prefill_wgmma import lean_eligible
    from nbinfer.variants import builtins

    assert lean_eligible(builtins.causal(), False, False)
    assert lean_eligible(builtins.standard(), False, False)
    assert not lean_eligible(builtins.causal(), True, False)  # custom mask
    assert not lean_eligible(builtins.causal(), False, True)  # block positions (BSR)
    for var in (builtins.sliding_window(8), builtins.soft_cap(30.0), builtins.rope_llama(),
                builtins.sigmoid_attention()):
        assert not lean_eligible(var, False, False), var.name
    ok = dict(kv_tile=64, num_warps=8, wgmma=True, lean=True, q_shared=True, stages=2,
              defer_merge=True, max_registers=128)
    spec = MmaPrefillSpec(128, 4, 16, "float16", "float16", "NHD", builtins.causal(), **ok)
    assert spec.tile_q == 128 and spec.lean
    for var, bad in ((builtins.soft_cap(30.0), {}), (builtins.causal(), dict(num_warps=4)),
                     (builtins.causal(), dict(stages=3)),
                     (builtins.causal(), dict(defer_merge=False)),
                     (builtins.causal(), dict(custom_mask=True))):
        with pytest.raises(ValueError, match="lean=True needs"):
            MmaPrefillSpec(128, 4, 16, "float16", "float16", "NHD", var, **(ok | bad))
