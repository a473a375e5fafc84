# %% [markdown]
# # Lesson 07: tensor cores
#
# Lesson 04's decode kernel multiplies and adds on CUDA cores: one fused multiply-add per
# thread per instruction. A tensor core does a whole small matrix product per instruction: on
# the H200, `mma.sync.m16n8k16` has a warp multiply a 16 x 16 tile by a 16 x 8 tile and add the
# 16 x 8 result, 4096 FMAs in one instruction. nbinfer's prefill kernel (`kernels/prefill_mma.py`)
# is built from it. This lesson takes the instruction apart.
#
# **You will learn**
#
# 1. the fragment layout: which of the warp's 32 lanes holds which element of the A, B and C
#    tiles, and why the accumulator of `S = Q K^T` can be fed straight back as the A operand of
#    `O = P V` without leaving registers (FlashAttention-2's trick);
# 2. `ldmatrix`: one instruction loads four 8 x 8 tiles from shared memory into exactly that
#    layout, and why the kernel pads every shared-memory row by 8 halves (bank conflicts);
# 3. the simulator twins: how nbinfer's kernels run the same tile code in Numba's CUDA simulator,
#    which has no tensor cores, and that the twins give each lane exactly the fragments the
#    instruction would;
# 4. why the query tile must be at least 16 rows, and what that means for decode (a GQA group
#    of 4 fills a quarter of the tile) against prefill;
# 5. where decode (from an fp16 and from an FP8 cache), a shared-prefix cascade and causal
#    prefill land on one roofline, from the H200 benchmark JSON (with a GPU present, a live
#    sweep of causal prefill against torch SDPA);
# 6. Hopper's warpgroup MMA: core matrices, descriptors, why its accumulators are the same
#    fragments, and a standalone kernel built on it, measured rung by rung.
#
# The first cell picks Numba's CUDA simulator: the lesson runs anywhere.

# %%
from nbinfer.lessons_tool import gpu_present, run_bench, start_lesson

ROOT = start_lesson()  # Numba's CUDA simulator, chosen before Numba loads; the repository root

import json
import math
import re
import sys

import numpy as np
from matplotlib.colors import ListedColormap
from numba import cuda, float32

from nbinfer.kernels.mma import tile_ops
from nbinfer.viz import plot_roofline, save_figure, show, subplots

np.set_printoptions(linewidth=100, precision=4, suppress=True)
rng = np.random.default_rng(7)

# %% [markdown]
# ## 1. Who holds what: the fragments of `mma.m16n8k16`
#
# The PTX ISA fixes, for every lane `l` of the warp, which elements of each operand live in its
# registers. With `g = l // 4` (the lane's *group*, 0-7) and `t = l % 4` (its place in the
# group, 0-3):
#
# * **A** (16 x 16, fp16/bf16, 8 elements per lane in four 32-bit registers of two halves):
#   rows `g` and `g + 8`, columns `2t, 2t+1` and `2t+8, 2t+9`;
# * **B** (16 x 8, 4 elements per lane): column `g`, rows `2t, 2t+1` and `2t+8, 2t+9`;
# * **C/D** (16 x 8, float32, 4 per lane): rows `g` and `g + 8`, columns `2t, 2t+1`.
#
# Each function below returns, for every lane and every register slot, the (row, column) it
# holds. The assertions check that the 32 lanes cover every element exactly once.

# %%
def a_fragment(lane):
    """(row, col) of A held in lane's slots 0-7 (registers a0..a3, two halves each)."""
    g, t = lane // 4, lane % 4
    return [(g + 8 * (r % 2), 2 * t + 8 * (r // 2) + h) for r in range(4) for h in range(2)]


def b_fragment(lane):
    """(k, n) of B held in lane's slots 0-3 (registers b0, b1, two halves each)."""
    g, t = lane // 4, lane % 4
    return [(2 * t + 8 * r + h, g) for r in range(2) for h in range(2)]


def c_fragment(lane, n_tile=0):
    """(row, col) of the accumulator held in lane's slots 0-3, for the n-tile `n_tile`."""
    g, t = lane // 4, lane % 4
    return [(g + 8 * (i // 2), 8 * n_tile + 2 * t + i % 2) for i in range(4)]


def owners(fragment, shape):
    """``[rows, cols]`` lane id holding each element (-1: nobody), checking uniqueness."""
    own = np.full(shape, -1)
    for lane in range(32):
        for r, c in fragment(lane):
            assert own[r, c] == -1, f"element {(r, c)} held twice"
            own[r, c] = lane
    return own


own_a, own_b, own_c = owners(a_fragment, (16, 16)), owners(b_fragment, (16, 8)), \
    owners(c_fragment, (16, 8))
assert (own_a >= 0).all() and (own_b >= 0).all() and (own_c >= 0).all()  # each exactly once
print("lane holding each element of C (16 x 8):")
print(own_c)

# %% [markdown]
# **The accumulator is the next A operand.** Attention computes `S = Q K^T` (an accumulator,
# 16 query rows x 8 keys per n-tile) and then `O = P V` with `P = softmax(S)` as the *A*
# operand (16 rows x 16 keys). Put two adjacent accumulator n-tiles side by side (keys 0-7 and
# 8-15) and compare with the A layout: every lane holds the same 8 elements. So the kernel
# rescales its own accumulator registers, rounds them to fp16 pairs, and multiplies, with no
# trip through shared memory. That is the check below, lane by lane.

# %%
for lane in range(32):
    two_tiles = c_fragment(lane, 0) + c_fragment(lane, 1)  # slots of n-tiles 0 and 1
    a = a_fragment(lane)
    assert sorted(two_tiles) == sorted(a)
    # and in register order: a0 = (c0, c1) of tile 0, a1 = (c2, c3), a2/a3 the same of tile 1
    assert two_tiles == [a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]
print("every lane: accumulator n-tiles 0 and 1 == its A fragment, register for register")

# %% [markdown]
# ## 2. `ldmatrix`: four 8 x 8 tiles in one instruction
#
# The kernel keeps Q, K and V tiles in shared memory, one row per token, and loads operands with
# `ldmatrix.x4`: lanes `8m ... 8m+7` each supply the address of one 16-byte row (8 halves) of
# tile `m`, and after the instruction lane `l` holds, of each tile `m`, row `l // 4`, elements
# `2 (l % 4)` and `2 (l % 4) + 1`: exactly one A-fragment register. The emulation below runs
# the kernel's own address arithmetic (`load_q` in `kernels/mma.py`: row
# `(l % 8) + 8 ((l // 8) % 2)`, column `8 (l // 16)`) over a Q tile and checks that every lane
# ends up with its A fragment.

# %%
D = 64
RS_HALVES = D + 8  # the kernel's padded row: D + 8 halves


def ldmatrix_x4(tile, row_col_of_lane):
    """Emulate ldmatrix.x4 on a [rows, cols] tile: returns regs[lane][m] = 2 elements."""
    starts = [row_col_of_lane(lane) for lane in range(32)]  # each lane's row address
    regs = [[None] * 4 for _ in range(32)]
    for m in range(4):
        rows = starts[8 * m: 8 * m + 8]  # tile m's 8 row addresses, from lanes 8m..8m+7
        for lane in range(32):
            r, c = rows[lane // 4]
            regs[lane][m] = (tile[r, c + 2 * (lane % 4)], tile[r, c + 2 * (lane % 4) + 1])
    return regs


q_tile = np.arange(16 * 16).reshape(16, 16)  # element (r, c) holds its own index
regs = ldmatrix_x4(q_tile, lambda lane: ((lane % 8) + 8 * ((lane // 8) % 2), 8 * (lane // 16)))
for lane in range(32):
    got = [x for m in range(4) for x in regs[lane][m]]
    want = [q_tile[r, c] for r, c in a_fragment(lane)]
    assert got == want
print("ldmatrix.x4 with load_q's addresses fills every lane's A fragment")

# %% [markdown]
# **Why `D + 8`.** Shared memory serves a request in 32 banks of 4 bytes; one phase of
# `ldmatrix` reads 8 rows of 16 bytes (4 banks each). The 8 rows hit 8 different groups of
# banks only if their addresses differ modulo 128 bytes. With rows of exactly `D = 64` halves
# (128 bytes) every row starts at the same bank: an 8-way conflict, the load takes 8 times as
# long. Padding each row by 8 halves (16 bytes) shifts consecutive rows by one bank group.

# %%
def bank_groups(row_bytes, rows=8):
    """The 16-byte bank group (0-7) each of 8 consecutive rows starts in."""
    return [(r * row_bytes // 16) % 8 for r in range(rows)]


for name, halves in (("D", D), ("D + 8", RS_HALVES)):
    groups = bank_groups(2 * halves)
    ways = max(groups.count(x) for x in set(groups))
    print(f"row of {name:5s} = {halves} halves: bank groups {groups} -> {ways}-way conflict")
assert len(set(bank_groups(2 * D))) == 1 and len(set(bank_groups(2 * RS_HALVES))) == 8

# %% [markdown]
# ## 3. The simulator twins
#
# Numba's CUDA simulator runs each thread as a Python thread: it has no tensor cores, no
# `ldmatrix`, and a lane cannot read another lane's registers. So `kernels/mma.py` gives every
# tile operation a *twin* (`tile_ops(..., sim=True)`) that computes, for the calling lane, the
# fragment elements the warp-wide instruction would give it, from shared memory. The kernel
# source is the same; only these few functions differ. Below, one warp (32 simulated threads)
# computes `S = Q K^T` for 16 query rows and 16 keys with the twins `load_q` and `qk`, then
# `O = P V` with `pv` (here `P` is just `S`, no softmax); each lane writes its accumulator
# registers, and the host places them with `c_fragment`: the matrices must be the float32
# products of the fp16 inputs.

# %%
BC = 16  # keys per tile
ops = tile_ops(D, BC, "float16", 1, sim=True)
RSE = D + 8  # row stride in (simulator) slots
KBASE, VBASE = 16 * RSE * ops.ELEM, 32 * RSE * ops.ELEM  # byte addresses of the K and V rows
QF, NS, NO = ops.QF, ops.NS, ops.NO


@cuda.jit
def one_warp_tile(smem, scratch, s_out, o_out):
    lane = cuda.threadIdx.x
    qf = cuda.local.array(QF, float32)
    s = cuda.local.array(NS, float32)
    o = cuda.local.array(NO, float32)
    ops.load_q(smem, 0, 0, lane, qf)
    ops.qk(smem, KBASE, lane, qf, s)
    for i in range(NS):
        s_out[lane, i] = s[i]
    for i in range(NO):
        o[i] = 0.0
    ops.pv(smem, VBASE, lane, lane, s, o, scratch)
    for i in range(NO):
        o_out[lane, i] = o[i]


q16, k16, v16 = (rng.standard_normal((n, D)).astype(np.float16) for n in (16, BC, BC))
smem = np.zeros(48 * RSE, np.float32)  # Q rows, then K rows, then V rows, padded
for base, x in ((0, q16), (16, k16), (32, v16)):
    smem.reshape(48, RSE)[base:base + x.shape[0], :D] = x
s_lanes, o_lanes = np.zeros((32, NS), np.float32), np.zeros((32, NO), np.float32)
one_warp_tile[1, 32](smem, np.zeros(ops.SCRATCH, np.float32), s_lanes, o_lanes)


def gather(lanes, width):
    """Place each lane's accumulator slots (4 per n-tile) into a [16, width] matrix."""
    out = np.full((16, width), np.nan, np.float32)
    for lane in range(32):
        for nt in range(width // 8):
            for i, (r, c) in enumerate(c_fragment(lane, nt)):
                out[r, c] = lanes[lane, 4 * nt + i]
    return out


S, O = gather(s_lanes, BC), gather(o_lanes, D)
S_want = q16.astype(np.float32) @ k16.astype(np.float32).T
O_want = S_want.astype(np.float16).astype(np.float32) @ v16.astype(np.float32)  # P rounded
print(f"S: max |twin - numpy| = {np.abs(S - S_want).max():.2e}; "
      f"O: {np.abs(O - O_want).max() / np.abs(O_want).max():.2e} (relative)")
assert not np.isnan(S).any() and not np.isnan(O).any()  # every element came from some lane
np.testing.assert_allclose(S, S_want, rtol=1e-5, atol=1e-4)
np.testing.assert_allclose(O, O_want, rtol=1e-4, atol=1e-3)

# %% [markdown]
# ## 4. Why the query tile is at least 16 rows
#
# The instruction's M is 16: whatever the kernel does, a warp multiplies 16 rows of Q. In
# prefill those are 16 query tokens (times the GQA group, packed as rows). In decode each request
# has *one* query token, so the rows of one KV head are its `G` query heads: with Llama's
# `G = 4`, three quarters of every tensor-core instruction multiplies padding. The roofline says
# it does not matter for decode, and why: one key (2 D bytes of K plus 2 D of V, fp16) serves
# `rows` query rows at `4 D` FLOP each, so the intensity is `rows` FLOP per byte. The H200
# feeds about 4.2 TB/s; its fp32 CUDA cores do 67 TFLOP/s (a ridge at ~16 FLOP/B), its fp16
# tensor cores 989 (~235 FLOP/B). Below ~16 rows the kernel waits for memory on *either* unit:
# decode's group of 1-8 rows stays on CUDA cores (lesson 04), and the tensor cores pay only when
# a tile has 16 rows or more of real work, prefill's case (or decode of a speculative tree, or
# a cascade's shared prefix read for many requests at once).

# %%
BW, PEAK_TC, PEAK_FP32 = 4.2e12, 989e12, 67e12  # measured copy, documented dense peaks
rows = np.arange(1, 65)
intensity = rows.astype(float)  # FLOP per byte of KV, fp16
filled = np.minimum(rows, 16) / 16 * 1.0
filled[rows > 16] = rows[rows > 16] / (16 * np.ceil(rows[rows > 16] / 16))
ridge_fp32, ridge_tc = PEAK_FP32 / BW, PEAK_TC / BW
print(f"ridges: fp32 CUDA cores {ridge_fp32:.0f} FLOP/B, fp16 tensor cores {ridge_tc:.0f} FLOP/B")
for g in (1, 4, 8):
    print(f"decode, G = {g}: {g / 16:.0%} of the m16 tile used; intensity {g} FLOP/B -> "
          f"memory-bound on CUDA cores already ({g} < {ridge_fp32:.0f})")
assert all(g < ridge_fp32 for g in (1, 2, 4, 8)) and 14 < ridge_fp32 < 18 < ridge_tc
# below 16 rows the two units reach the same (memory) roof: tensor cores gain nothing
useful_tc = np.minimum(BW * intensity, PEAK_TC * filled) / 1e12
assert np.allclose(useful_tc[rows <= 8], np.minimum(BW * intensity, PEAK_FP32)[rows <= 8] / 1e12)

fig, (ax_t, ax_r) = subplots(1, 2, figsize=(12.5, 4.4))
cmap = ListedColormap([tuple(np.array(c) * 0.55 + 0.45) for c in
                       [(0.12, 0.47, 0.71), (1.0, 0.5, 0.05), (0.17, 0.63, 0.17),
                        (0.84, 0.15, 0.16), (0.58, 0.4, 0.74), (0.55, 0.34, 0.29),
                        (0.89, 0.47, 0.76), (0.5, 0.5, 0.5)]])
ax_t.imshow(own_a // 4, cmap=cmap, aspect="equal")  # colour: the lane's group g
for r in range(16):
    for c in range(16):
        ax_t.text(c, r, own_a[r, c], ha="center", va="center", fontsize=6)
ax_t.set_title("A fragment (16 x 16): lane holding each element\n(colour: group g = lane // 4; "
               "two C n-tiles have the same map)", fontsize=9)
ax_t.set_xlabel("column (k)")
ax_t.set_ylabel("row (query)")
attainable_fp32 = np.minimum(BW * intensity, PEAK_FP32) / 1e12
# useful FLOP/s on tensor cores: the memory roof, or the peak times the share of the tile used
useful_tc = np.minimum(BW * intensity, PEAK_TC * filled) / 1e12
ax_r.plot(rows, attainable_fp32, color="C0", label="CUDA cores (fp32 FMA)")
ax_r.plot(rows, useful_tc, color="C3", ls="--",
          label="tensor cores, useful work (padding rows wasted)")
ax_r.axvspan(1, 8, color="C0", alpha=0.08, lw=0)
ax_r.text(1.3, useful_tc[-1] * 0.5, "decode,\nG = 1-8", fontsize=8)
ax_r.set_xscale("log", base=2)
ax_r.set_yscale("log")
ax_r.set_xlabel("query rows per key read (GQA group x query tokens)")
ax_r.set_ylabel("attainable TFLOP/s")
ax_r.set_title("below ~16 rows both units wait for memory", fontsize=10)
ax_r.legend(fontsize=8)
save_figure(fig, "07_fragments.png")
show(fig)

# ## 5. The roofline, from the benchmark JSON
#
# A roofline plots achieved FLOP/s against arithmetic intensity (FLOP per byte of memory
# traffic). A kernel cannot beat `bandwidth x intensity` (the slanted roof) nor the compute peak
# (the flat roof); where the roofs meet is the *ridge point*. The intensity is a property of the
# workload and of how the kernel moves its bytes, not of the GPU, so three workloads of the
# same model (Hq = 32, Hkv = 8, D = 128, fp16) land in three different places:
#
# * **decode**: `4 * Hq * D` FLOP per token (a multiply and an add for `q.k` and for `p v`, per
#   query head) over `2 * Hkv * D * 2` bytes (K and V, fp16): intensity `Hq / Hkv = G`,
#   whatever the batch or length;
# * **decode from an FP8 cache** (e4m3, lesson 04 section 8): the same FLOPs over one byte per
#   element, so intensity `2 G` and, where bandwidth is the roof, twice the attainable FLOP/s;
# * **shared-prefix decode as a cascade** (lesson 03): the same FLOPs, but the 8192-token prefix
#   is read once per query tile instead of once per request, so the bytes shrink and the
#   intensity grows by the same factor;
# * **causal prefill** (B 4, L 4096, H 32): every query row scores every earlier key,
#   `4 * H * D * L (L + 1) / 2` FLOP per request, over reading Q, K, V and writing O once.
#
# Ceilings: the measured HBM copy bandwidth (from the JSON), and two documented H200 peaks, fp16
# tensor cores (989 TFLOP/s dense) and fp32 CUDA cores (67 TFLOP/s). Times are GPU times:
# kernel-only for decode, CUDA-graph replay for the shared prefix, events around the call for
# prefill. The prefill and shared-prefix figures come from the newest `prefill_h200*.json`
# (`python3 bench/prefill.py`), decode from the newest `decode_h200*.json`, FP8 decode from the
# newest `issue13/decode_fp8_h200*.json` (`python3 bench/decode.py --fp8`, GPU time).

# %%
results = sorted((ROOT / "bench" / "results").glob("decode_h200*.json"),
                 key=lambda p: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p.stem)])
assert results, "no bench/results/decode_h200*.json"
bench_path = results[-1]
bench = json.loads(bench_path.read_text())
COPY_BW = float(bench["copy_ceiling"])  # bytes/s, the measured device copy on the H200

HQ_B, D_B, KV_ITEM = 32, 128, 2  # the benchmark model: Hq = 32, D = 128, fp16
PEAK_TC, PEAK_FP32 = 989e12, 67e12  # documented H200 dense peaks, FLOP/s
pre_results = sorted((ROOT / "bench" / "results").glob("prefill_h200*.json"),
                     key=lambda p: [int(x) if x.isdigit() else x
                                    for x in re.split(r"(\d+)", p.stem)])
assert pre_results, "no bench/results/prefill_h200*.json"
pre_path = pre_results[-1]
pre = json.loads(pre_path.read_text())
fp8_results = sorted((ROOT / "bench" / "results" / "issue13").glob("decode_fp8_h200*.json"))
assert fp8_results, "no bench/results/issue13/decode_fp8_h200*.json"
fp8_path = fp8_results[-1]
fp8_bench = json.loads(fp8_path.read_text())


def roof(ai):
    """The attainable FLOP/s at intensity `ai`: the lower of the two roofs."""
    return min(COPY_BW * ai, PEAK_TC)


points = []  # every measured point: workload, what ran, intensity, FLOP/s


def add(workload, label, flops, nbytes, seconds_, color, marker, note=""):
    points.append(dict(workload=workload, label=label, ai=flops / nbytes, flops=flops / seconds_,
                       color=color, marker=marker, note=note))


# Decode: kernel alone and cuDNN, every case of the decode JSON.
for case in bench["decode"]:
    flops = 4 * HQ_B * D_B * case["batch"] * case["kv_len"]
    hkv_b = case["kv_bytes"] // (case["batch"] * case["kv_len"] * 2 * D_B * KV_ITEM)
    assert case["kv_bytes"] == case["batch"] * case["kv_len"] * hkv_b * 2 * D_B * KV_ITEM
    assert flops / case["kv_bytes"] == HQ_B / hkv_b  # intensity = GQA group size
    for label, key, color, marker in (("decode, nbinfer kernel", "kernel_only", "C0", "o"),
                                      ("decode, torch SDPA cuDNN", "sdpa_cudnn", "C2", "D")):
        t = case[f"{key}_ms"] * 1e-3 if f"{key}_ms" in case else \
            case["kv_bytes"] / (case[f"{key}_tbps"] * 1e12)
        add("decode", label, flops, case["kv_bytes"], t, color, marker,
            note=f" ({case['batch']} x {case['kv_len']})")
G_B = HQ_B // hkv_b

# FP8 decode (e4m3): the same FLOPs as fp16 decode of the case, over its one-byte codes.
for case in fp8_bench["fp8"]:
    if case["format"] != "float8_e4m3fn" or case["group"] != G_B:
        continue
    flops = 4 * HQ_B * D_B * case["batch"] * case["kv_len"]
    assert case["fp8_kv_bytes"] * 2 == case["fp16_kv_bytes"] == flops // G_B
    add("decode, FP8 KV", "decode from FP8 (e4m3), nbinfer kernel", flops, case["fp8_kv_bytes"],
        case["fp8_gpu_ms"] * 1e-3, "C6", "o", note=f" ({case['batch']} x {case['kv_len']})")

# Shared prefix, 64 x (8192 + 256): lesson 03's byte model. The prefix level's work items say
# how often the prefix is read: items = reads x ceil(prefix / kv_chunk) chunks x Hkv heads.
sp = pre["shared_prefix"]
B_S, P_S, U_S = sp["batch"], sp["prefix"], sp["unique"]
lvl = sp["breakdown"]["prefix_level"]
reads, rem = divmod(lvl["items"], -(-P_S // lvl["kv_chunk"]) * hkv_b)
assert rem == 0 and reads == -(-B_S * G_B // 64)  # one read per 64-row query tile
token_bytes = hkv_b * 2 * D_B * KV_ITEM
flops_s = 4 * HQ_B * D_B * B_S * (P_S + U_S)
cascade_bytes = (reads * P_S + B_S * U_S) * token_bytes
plain_bytes = B_S * (P_S + U_S) * token_bytes
add("shared prefix", "shared prefix, nbinfer cascade", flops_s, cascade_bytes,
    sp["breakdown"]["cascade_graph_ms"] * 1e-3, "C1", "^")
add("shared prefix", "shared prefix, nbinfer plain decode", flops_s, plain_bytes,
    sp["breakdown"]["plain_graph_ms"] * 1e-3, "C1", "v")

# Causal prefill: FLOPs from the formula (the JSON's own count must agree), bytes Q K V O once.
cp = pre["causal_prefill"]
B_P, L_P, H_P, D_P = cp["B"], cp["L"], cp["H"], cp["D"]
flops_p = 4 * B_P * H_P * D_P * L_P * (L_P + 1) // 2
assert flops_p == cp["flops"]
bytes_p = 4 * B_P * L_P * H_P * D_P * KV_ITEM
for label, key, marker in (("causal prefill, nbinfer tensor cores", "nbinfer", "s"),
                           ("causal prefill, SDPA flash", "sdpa_flash", "P"),
                           ("causal prefill, SDPA cuDNN", "sdpa_cudnn", "X")):
    add("causal prefill", label, flops_p, bytes_p, cp[f"{key}_ms"] * 1e-3, "C3", marker)

ridge_tc, ridge_fp32 = PEAK_TC / COPY_BW, PEAK_FP32 / COPY_BW
print(f"{bench_path.name} + {pre_path.name} + {fp8_path.name}; ridge points: fp16 tensor "
      f"cores {ridge_tc:.0f}, fp32 CUDA cores {ridge_fp32:.1f} FLOP/B")
print(f"{'':52s} {'FLOP/B':>7} {'TFLOP/s':>8} {'roof':>7} {'of roof':>8}")
for p in points:
    p["of_roof"] = p["flops"] / roof(p["ai"])
    print(f"{p['label'] + p['note']:52s} {p['ai']:7.1f} {p['flops'] / 1e12:8.1f} "
          f"{roof(p['ai']) / 1e12:7.1f} {p['of_roof']:8.0%}")

ai_of = {w: {p["ai"] for p in points if p["workload"] == w} for w in
         ("decode", "decode, FP8 KV", "shared prefix", "causal prefill")}
# Where each workload sits follows from shapes and bytes (asserted); how close each measured
# point comes to its roof is the recorded run's (printed above, not asserted).
# Decode sits at G, left of both ridges: bandwidth-bound on any unit.
assert ai_of["decode"] == {G_B} and G_B < ridge_fp32
# FP8 halves the bytes of the same work: intensity 2 G, still left of both ridges, so its roof
# is twice fp16's (bandwidth is still the limit; how near the kernel comes is printed above).
assert ai_of["decode, FP8 KV"] == {2 * G_B} and 2 * G_B < ridge_fp32
assert roof(2 * G_B) == 2 * roof(G_B)
# The cascade reads the prefix `reads` times instead of 64: its intensity passes the CUDA-core
# ridge (on CUDA cores it would be compute-bound) but not the tensor-core one.
ai_cascade = flops_s / cascade_bytes
assert ridge_fp32 < ai_cascade < ridge_tc and math.isclose(
    ai_cascade / G_B, plain_bytes / cascade_bytes)
# Prefill is far right of both ridges: compute-bound, and the roof is the tensor cores'.
assert min(ai_of["causal prefill"]) > ridge_tc

# %%
fig, (ax_r, ax_b) = subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.3, 1]})
plot_roofline(points, memory_ceilings=[("HBM copy, measured", COPY_BW)],
              compute_ceilings=[("fp16 tensor cores", PEAK_TC), ("fp32 CUDA cores", PEAK_FP32)],
              ax=ax_r, ai_range=(1, 4096),
              title=f"H200 roofline: four workloads of one model (Hq {HQ_B}, Hkv {hkv_b}, "
                    f"D {D_B}, fp16)")
for text, ai_w, dx, dy in (("decode (= GQA group)", G_B, -30, -48),
                          ("decode from FP8 (= 2 G)", 2 * G_B, 20, -22),
                          ("shared prefix as a cascade", ai_cascade, -40, -50),
                          ("causal prefill", min(ai_of["causal prefill"]), -170, 10)):
    lowest = min(p["flops"] for p in points if p["ai"] == ai_w)  # arrow to the lowest point
    ax_r.annotate(f"{text}: {ai_w:.0f} FLOP/B", (ai_w, lowest / 1e12 * 0.93),
                  xytext=(dx, dy), textcoords="offset points", fontsize=8,
                  arrowprops={"arrowstyle": "->", "lw": 0.7})
ax_r.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
# Right: each point as a fraction of the roof at its own intensity, the distance the roofline
# says is left to gain.
order = sorted(range(len(points)), key=lambda i: (points[i]["ai"], points[i]["label"]))
labels_b = [points[i]["label"] + points[i]["note"] for i in order]
ax_b.barh(range(len(order)), [points[i]["of_roof"] * 100 for i in order],
          color=[points[i]["color"] for i in order])
ax_b.axvline(100, color="k", lw=1)
ax_b.set_yticks(range(len(order)), labels=labels_b, fontsize=7)
ax_b.invert_yaxis()
ax_b.set_xlabel("% of the roof at the point's own intensity")
ax_b.set_title("how far each kernel is from its roof", fontsize=10)
save_figure(fig, "07_roofline.png")
show(fig)

# The plotted points are exactly the ones computed above, series by series.
for i, label in enumerate(dict.fromkeys(p["label"] for p in points)):
    drawn = ax_r.collections[i].get_offsets()
    want = np.array([(p["ai"], p["flops"] / 1e12) for p in points if p["label"] == label])
    assert ax_r.collections[i].get_label() == label
    np.testing.assert_allclose(np.asarray(drawn), want, rtol=1e-12)

# %% [markdown]
# Read the chart from left to right. Decode sits at the GQA group size, far left of both
# ridges: memory-bound, so tensor cores would not help it (the production kernel uses CUDA
# cores) and the whole story is the distance to the slanted roof, which nbinfer's kernel and
# cuDNN have all but closed. An FP8 cache moves the same work twice as far right: half the
# bytes, a roof twice as high. The FP8 points sit well under that roof, and the roofline says
# why only by elimination: not bandwidth (they would be at the roof), not the fp32 CUDA-core
# peak (far above them); it is the instruction issue of converting every code before its FMA
# (lesson 04 section 8 counts the instructions), a limit this chart has no ceiling for. The
# cascade does the *same arithmetic* as plain decode on the shared-prefix batch but reads the
# prefix a few times instead of 64, so the point moves right
# by the byte ratio: past the CUDA-core ridge, which is why it runs on the tensor-core kernel.
# At its intensity the roof is several times higher than what it reaches: a 0.09 ms step is too
# short to fill the machine, the headroom a faster prefix level would use. (Plain decode of that
# batch appears *above* its roof because the prefix it re-reads 64 times stays in L2: the roof
# is for HBM.) Causal prefill is far right of every ridge: compute-bound, judged against the
# tensor cores' 989 TFLOP/s, where nbinfer's kernel reaches a fraction of what FlashAttention-2
# and cuDNN do on the same problem: the work of the speed issue, not of the bytes.
#
# %% [markdown]
# ## 6. Live: causal prefill against torch SDPA
#
# With a GPU (and torch) present, the cell runs `bench/prefill.py --sweep` in a separate process
# (this one runs the simulator): causal prefill of one sequence, 32 heads of 128, fp16, at three
# lengths, nbinfer's tensor-core kernel against torch SDPA's flash and cuDNN back ends, CUDA
# events around each call. Without one it shows the recorded H200 point (B 4, L 4096) from the
# benchmark JSON, and says so. Nothing below asserts on a measured speed.

# %%
if gpu_present():
    sweep = run_bench("prefill.py", "--sweep", "1024,4096,16384")
    rows_live, source = sweep["causal_sweep"], f"measured now on {sweep['device']}"
else:
    rows_live, source = [pre["causal_prefill"]], f"recorded on the H200 ({pre_path.name}), no GPU here"
print(source)
fig, ax = subplots(1, 1, figsize=(7.5, 3.8))
names = [("nbinfer", "nbinfer tensor cores", "C3"), ("sdpa_flash", "SDPA flash", "0.45"),
         ("sdpa_cudnn", "SDPA cuDNN", "0.7")]
width = 0.8 / len(names)
for j, (key, label, color) in enumerate(names):
    vals = [r.get(f"{key}_tflops", np.nan) for r in rows_live]
    ax.bar(np.arange(len(rows_live)) + (j - 1) * width, vals, width, label=label, color=color)
ax.set_xticks(range(len(rows_live)), [f"B {r['B']}, L {r['L']}" for r in rows_live])
ax.axhline(PEAK_TC / 1e12, color="k", lw=0.8, ls=":")
ax.text(-0.45, PEAK_TC / 1e12 * 0.94, "fp16 tensor-core peak (dense)", ha="left", va="top",
        fontsize=8)
ax.set_ylim(0, PEAK_TC / 1e12 * 1.08)
ax.set_ylabel("TFLOP/s (causal, fp16, H 32, D 128)")
ax.set_title(f"causal prefill: {source}", fontsize=9)
ax.legend(fontsize=8, loc="center left")
save_figure(fig, "07_prefill_live.png")
show(fig)
for r in rows_live:
    assert r["flops"] == 4 * r["B"] * r["H"] * r["D"] * r["L"] * (r["L"] + 1) / 2

# %% [markdown]
# ## 7. Hopper's warpgroup MMA (`wgmma`)
#
# `mma.sync` is Ampere's instruction; the H200 runs it at roughly a third of its tensor-core
# peak (FlashAttention-2 and nbinfer's kernel stop near 300 and 200 TFLOP/s of 989). Hopper
# adds `wgmma.mma_async.m64nNk16`: a *warpgroup* (four consecutive warps, 128 threads) issues a
# 64 x N x 16 product in one instruction, the tensor cores read B (and A, unless it comes from
# registers) **straight from shared memory** through a 64-bit *matrix descriptor*, and the
# instruction is asynchronous: `wgmma.fence`, `commit_group` and `wait_group` order it against
# the registers and the next tile. One such step replaces, per warp, 8 `mma.sync` and 4
# `ldmatrix` of section 2. nbinfer issues it from Numba through inline PTX
# (`nbinfer/kernels/wgmma.py`); the price is a fixed shared-memory layout.
#
# **Core matrices.** The tensor cores read an operand as 8 x 8 *core matrices*: 8 rows of 16
# bytes (8 fp16 values along K), 128 contiguous bytes each. The descriptor says where the
# operand starts and how far apart core matrices are: `LBO` between neighbours along K, `SBO`
# between neighbours along M (or N). nbinfer keeps an 8-row block's whole head dimension
# together (`LBO` = 128, `SBO` = D / 8 x 128). The cell maps a 16 x 32 tile, checks that every
# element gets its own two bytes and every core matrix is one 128-byte run, and packs the
# descriptor of a 64 x 128 Q tile.

# %%
from nbinfer.kernels.wgmma import (
    copy_slot,
    core_offset,
    core_offset_mn,
    fragment_position,
    smem_descriptor,
)

ROWS, KDIM = 16, 32
SBO_T, LBO_T = KDIM // 8 * 128, 128
offs = np.array([[core_offset(r, k, SBO_T, LBO_T) for k in range(KDIM)] for r in range(ROWS)])
assert np.array_equal(np.sort(offs.ravel()), np.arange(0, ROWS * KDIM * 2, 2))  # a bijection
core_id = offs // 128  # which 128-byte core matrix each element is in
for br in range(ROWS // 8):
    for bk in range(KDIM // 8):
        block = offs[8 * br:8 * br + 8, 8 * bk:8 * bk + 8]
        assert block.max() - block.min() == 126 and len(np.unique(core_id[8 * br:8 * br + 8,
                                                                         8 * bk:8 * bk + 8])) == 1
print("core matrix of each element (16 rows x 32 k):")
print(core_id)
q_desc = smem_descriptor(0x400, lbo=128, sbo=128 // 8 * 128)  # Q [64, 128] at byte 0x400
fields = dict(start=(q_desc & 0x3FFF) << 4, lbo=((q_desc >> 16) & 0x3FFF) << 4,
              sbo=((q_desc >> 32) & 0x3FFF) << 4, swizzle=q_desc >> 62)
print("Q tile descriptor:", hex(q_desc), fields)
assert fields == dict(start=0x400, lbo=128, sbo=2048, swizzle=0)

# %% [markdown]
# **V needs no transpose in memory.** `O = P V` wants B indexed (key, dim) with keys along K.
# V lies in memory as `[key, D]`, D contiguous: *MN-major* for B. `wgmma` reads MN-major core
# matrices (8 keys x 16 bytes of D) when its transpose flag is set, so V is copied as it lies and
# the hardware does what `ldmatrix.trans` did in section 2. And the accumulator layout is the
# one of section 1: warp `w` of the warpgroup holds rows `16 w ..` of the 64, each lane the
# `mma.m16n8` C fragment of every 8 columns. So P packed from S's registers is already wgmma's
# register-A operand, and the softmax code of the `mma.sync` kernel works unchanged on it:
# nbinfer's warpgroup path (`MmaPrefillSpec(wgmma=True)`) swaps only the two products and the
# tile layout under the same prefill kernel.

# %%
v_offs = np.array([[core_offset_mn(k, c, 64 // 8 * 128, 128) for c in range(128)]
                   for k in range(64)])  # a 64-key x D 128 V tile
assert np.array_equal(np.sort(v_offs.ravel()), np.arange(0, 64 * 128 * 2, 2))
assert np.array_equal(v_offs[0, :8], 2 * np.arange(8))  # a core-matrix row: 8 dims of one key
for warp in range(4):
    for lane in range(32):
        for i in range(32):  # N = 64: eight 8-column blocks of four accumulators
            r, c = fragment_position(i, warp, lane)
            rr, cc = c_fragment(lane, i // 4)[i % 4]
            assert (r, c) == (16 * warp + rr, cc)
print("wgmma's accumulators, per warp: the mma.m16n8 C fragment of every 8 columns")

# %% [markdown]
# **Who copies what.** `cp.async` writes 16 bytes per thread. If sixteen consecutive threads
# copied one row's sixteen chunks (the `mma.sync` kernel's order), their destinations in the
# canonical layout would sit `LBO` = 128 bytes apart, all in the same four banks: an 8-way
# conflict on every store. `copy_slot` instead gives eight consecutive threads one chunk of
# eight consecutive rows: one core matrix, 128 contiguous bytes, every bank once; the global
# side still reads whole 32-byte sectors.

# %%
def store_wavefronts(dsts):
    """Shared-memory wavefronts of 16-byte stores by 8 threads (a quarter warp): the most
    stores that share a bank group."""
    groups = [(d // 16) % 8 for d in dsts]
    return max(groups.count(x) for x in set(groups))


D_W, NT_W = 128, 256
slots = [copy_slot(tid, NT_W, D_W, False, D_W // 8 * 128) for tid in range(NT_W)]
ours = [store_wavefronts([slots[t][2] for t in range(q, q + 8)]) for q in range(0, NT_W, 8)]
row_major = [store_wavefronts([core_offset(t // 16, 8 * (t % 16), D_W // 8 * 128, 128)
                               for t in range(q, q + 8)]) for q in range(0, NT_W, 8)]
print(f"copy_slot: {max(ours)} wavefront per 8 stores; a row per 16 threads: {max(row_major)}")
assert max(ours) == 1 and max(row_major) == 8

# %% [markdown]
# **The ladder, measured.** A standalone attention kernel on these pieces
# (`bench/wgmma_attention.py`, contiguous Q, K, V; checked against SDPA before timing) was
# grown rung by rung on the H200 (bench/NOTES.md, "Issue 13, session 16"). The chart reads the
# committed JSON: each rung's TFLOP/s at B 4, L 4096, H 32, D 128, fp16, next to SDPA flash in
# the same process, and two *ablations* (timing only, not attention) that say where the rest of
# the time goes.

# %%
res16 = ROOT / "bench" / "results" / "issue13" / "session16"
rungs = [("1 warpgroup,\n1 stage", "call1", None, "wgmma_tflops"),
         ("2 warpgroups,\nK/V ring", "call3", "2wg-n64-s2", None),
         ("+ copies' addresses\nhoisted", "call4", "2wg-n64-s2", None),
         ("+ 128 registers:\n2 CTAs per SM", "call6", "2wg-n64-s2 r128", None),
         ("ablation:\nno copies", "call6", "2wg-n64-s2 no-copy", None),
         ("ablation: no copies,\nno softmax", "call6", "2wg-n64-s2 no-copy no-softmax", None)]
ladder = {True: [], False: []}
flash = {True: [], False: []}
for _, call, variant, key in rungs:
    data = json.loads((res16 / call / "wgmma_attention.json").read_text())
    assert not data.get("failed") and all(c["rel_err"] <= c["tolerance"] for c in data["checks"])
    for row in data["timed"]:
        tf = row[key] if key else row["wgmma_tflops"][variant]
        ladder[row["causal"]].append(tf)
        flash[row["causal"]].append(row["sdpa_flash_tflops"])
fig, ax = subplots(1, 1, figsize=(11, 4.2))
x = np.arange(len(rungs))
for j, causal in enumerate((True, False)):
    ax.bar(x + (j - 0.5) * 0.38, ladder[causal], 0.38, color=("C3", "C1")[j],
           label=("causal" if causal else "non-causal") + " (wgmma kernel)")
    ax.plot(x + (j - 0.5) * 0.38, flash[causal], "k_", ms=14, mew=2,
            label="SDPA flash, same run" if j == 0 else None)
ax.axvspan(3.5, 5.5, color="0.92", lw=0, zorder=0)
ax.text(4.5, max(ladder[False]) * 1.03, "ablations (not attention): what is left", ha="center",
        fontsize=8)
ax.set_ylim(0, max(ladder[False]) * 1.12)
ax.set_xticks(x, [r[0] for r in rungs], fontsize=8)
ax.set_ylabel("TFLOP/s (B 4, L 4096, H 32, D 128, fp16)")
ax.set_title("the standalone wgmma tile, rung by rung (bench/results/issue13/session16)",
             fontsize=10)
ax.legend(fontsize=8, loc="upper left")
save_figure(fig, "07_wgmma_ladder.png")
show(fig)
for causal in (True, False):
    print(f"{'causal' if causal else 'full':6s}: " + ", ".join(
        f"{t:.0f} ({t / f:.2f}x flash)" for t, f in zip(ladder[causal], flash[causal], strict=True)))
# the rungs' order is the text's: each real rung faster than the one before it; the
# ablations above the last real rung
for causal in (True, False):
    assert all(b > a for a, b in zip(ladder[causal][:3], ladder[causal][1:4], strict=True))
assert min(ladder[True][4:] + ladder[False][4:]) > max(ladder[True][3], ladder[False][3])

# %% [markdown]
# Two warpgroups sharing each K/V tile halve the copies per FLOP; computing the copies'
# addresses once per thread instead of per copy cut the registers, and at 128 registers two
# CTAs of 256 threads share an SM: 0.89x flash causal, 0.92x non-causal. The ablations say what
# is left: with no copies after the first tile the same loop runs far faster, and with the
# softmax gone too it passes flash by 2x. The copies are issued by the same warps that compute;
# FlashAttention-3 moves them to a producer warp on the Tensor Memory Accelerator.
#
# **Inside nbinfer's prefill.** Put into the full tensor-core kernel (every variant, mask, paged
# KV and merge), the warpgroup products need 206 registers, one CTA per SM, and measure *slower*
# than `mma.sync`. So nbinfer has a second, *lean* kernel (`nbinfer/kernels/prefill_wgmma.py`),
# as FlashInfer has an `fa3` backend next to its `fa2`: the standalone tile grown to nbinfer's
# plan (work items, ragged and paged KV, GQA, LSE, the non-finite rule) and nothing else, for the
# plain plans only (causal or no mask, no hooks). The plan's rule picks it on an sm_90 GPU. The
# chart reads the session-17 measurements: on the left the three kernels and SDPA flash in one
# process; on the right, from Nsight Compute's per-instruction samples of the lean kernel (causal),
# the share of the warps' time by how often the code runs: once per 64-key tile, once per
# *work item* (one 128-row query tile of one head: staging Q, the first tile, the epilogue), or
# once per masked tile.

# %%
sys.path.insert(0, str(ROOT / "bench"))  # bench/ncu_stalls.py reads Nsight's source-page CSV
import ncu_stalls  # noqa: E402

res17 = ROOT / "bench" / "results" / "issue13" / "session17"
ab = json.loads((res17 / "call4" / "r" / "prefill_lean_ab.json").read_text())["kv_tile_ab"]
bars = {}
for row in ab:
    bars[row["causal"]] = [row["kv_tile_64_tflops"], row["kv_tile_64w8gl_tflops"],
                           row["sdpa_flash_tflops"]]


def time_by_code(path):
    """Shares of the warp-state samples of one kernel's instructions, grouped by how many times
    each ran (per warp): the per-item code once per item (the most instructions), the masked
    tiles twice per item, the Q stager's loop 8 rounds per item in this build (counted per
    item), the clear-tile loop the largest of the other groups."""
    cols, rows = ncu_stalls.read_rows(str(path))  # the per-instruction table
    samples = cols.index(ncu_stalls.ALL)
    runs = cols.index("Instructions Executed")
    by_runs, count = {}, {}
    for r in rows:
        n = int(r[runs]) if r[runs].isdigit() else 0
        by_runs[n] = by_runs.get(n, 0) + (int(r[samples]) if r[samples].isdigit() else 0)
        count[n] = count.get(n, 0) + 1
    total = sum(by_runs.values())
    item = max((n for n in count if n > 1000), key=lambda n: count[n])  # most instructions
    per_item = (item, 2 * item, 8 * item)
    tile = max((n for n in by_runs if n > 0 and n not in per_item), key=by_runs.get)
    share = {"tile loop": by_runs[tile] / total,
             "per item": (by_runs[item] + by_runs.get(8 * item, 0)) / total,
             "masked tiles": by_runs.get(2 * item, 0) / total}
    share["rest"] = 1 - sum(share.values())
    return share


shares = {L: time_by_code(res17 / "call5" / f"ncu_prefill_{n}_sass.csv.gz")
          for n, L in ((1, 1024), (2, 4096))}
fig, (ax_k, ax_t) = subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.1]})
names = ["mma.sync", "lean wgmma", "SDPA flash"]
x = np.arange(3)
for j, causal in enumerate((True, False)):
    ax_k.bar(x + (j - 0.5) * 0.38, bars[causal], 0.38, color=("C3", "C1")[j],
             label="causal" if causal else "non-causal")
ax_k.set_xticks(x, names)
ax_k.set_ylabel("TFLOP/s (B 4, L 4096, H 32, D 128, fp16)")
ax_k.set_title("through nbinfer's ragged prefill (session 17, call 4)", fontsize=10)
ax_k.legend(fontsize=8)
left = np.zeros(2)
for k, part in enumerate(("tile loop", "per item", "masked tiles", "rest")):
    vals = np.array([shares[L][part] for L in (1024, 4096)])
    ax_t.barh([0, 1], vals, left=left, color=f"C{k}", label=part)
    left += vals
ax_t.set_yticks([0, 1], ["B 16, L 1024\n(9 tiles per item)", "B 4, L 4096\n(33 tiles per item)"])
ax_t.set_xlabel("share of the warps' time (Nsight Compute samples, lean kernel, causal)")
ax_t.legend(fontsize=8, ncol=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
save_figure(fig, "07_wgmma_lean.png")
show(fig)
for L in (1024, 4096):
    print(f"L {L}: " + ", ".join(f"{k} {v:.0%}" for k, v in shares[L].items()))
for causal in (True, False):
    mma, lean, fl = bars[causal]
    print(f"{'causal' if causal else 'full':6s}: mma.sync {mma:.0f}, lean {lean:.0f} "
          f"({lean / fl:.2f}x flash), flash {fl:.0f} TFLOP/s")
# what the text says: the lean kernel beats mma.sync in both modes; at L 4096 most of the time
# is the tile loop, but the work items' fixed cost is a large share, larger when items are short
assert all(bars[c][1] > bars[c][0] for c in (True, False))
assert shares[4096]["tile loop"] > 0.7 and shares[4096]["per item"] > 0.15
assert shares[1024]["per item"] > 1.5 * shares[4096]["per item"]

# %% [markdown]
# The lean kernel beats `mma.sync` by 11 % causal and 23 % non-causal, but stays below the
# standalone tile: every work item pays for staging Q, waiting for its first K/V tile and
# writing its rows, and causal items are short (33 tiles on average at L 4096, 9 at L 1024). That
# fixed cost, not the tensor cores, is what is left to remove: copying Q asynchronously,
# fetching the next item's first tile during this item's last, or making items longer.

# %% [markdown]
# **What the copies really cost: their requests, not their bytes.** Sessions 16-29 read the
# ablation above as "the copies' instructions cost the computing warps", and tried to take
# them away: a producer warpgroup that only copies (its consumers synchronised by mbarriers,
# `nbinfer/kernels/mbarrier.py`), then the Tensor Memory Accelerator (`nbinfer/kernels/tma.py`).
# Neither ran faster. Session 30 then timed the copies *alone* (consumers that release each
# stage as soon as it lands) and found the real limit: where eight threads copy 16-byte
# pieces of eight different rows (`copy_slot`, or a TMA box whose rows are 16 bytes), the SM
# takes in K and V at ~2.2 TB/s however the copies are issued; where each eight threads copy
# one whole 128-byte line, 8-12 TB/s. The layout that lets whole lines land without bank
# conflicts is the **128-byte swizzle** (`swizzled_offset`): each 64-column block is a run of
# 128-byte rows, and row `r`'s 16-byte chunk `c` is stored at chunk `c ^ (r % 8)`, so eight
# consecutive rows' chunk 0 fall in eight different bank groups. `wgmma` reads it directly
# (descriptor swizzle mode 1), as FlashAttention-3's kernels do. The cell counts, for one
# quarter warp of each copy map, the 128-byte lines it reads and the store wavefronts it needs.

# %%
from nbinfer.kernels.wgmma import swizzled_offset, swizzled_slot  # noqa: E402

ROWS_T = 64
sw_slots = [swizzled_slot(tid, NT_W, D_W, ROWS_T) for tid in range(NT_W)]
offs_sw = np.array([[swizzled_offset(r, c, ROWS_T) for c in range(D_W)] for r in range(ROWS_T)])
assert np.array_equal(np.sort(offs_sw.ravel()), np.arange(0, ROWS_T * D_W * 2, 2))


def lines_read(slot_list, q):
    """128-byte global lines the 8 threads q .. q + 7 read (rows of D_W fp16 = 2 lines each)."""
    return len({(slot_list[t][0], slot_list[t][1] // 8) for t in range(q, q + 8)})


canon_lines = max(lines_read(slots, q) for q in range(0, NT_W, 8))
sw_lines = max(lines_read(sw_slots, q) for q in range(0, NT_W, 8))
sw_waves = max(store_wavefronts([sw_slots[t][2] for t in range(q, q + 8)])
               for q in range(0, NT_W, 8))
print(f"8 threads of copy_slot read {canon_lines} lines (16 bytes of each); of swizzled_slot "
      f"{sw_lines} line; store wavefronts {max(ours)} and {sw_waves}")
assert (canon_lines, sw_lines, sw_waves) == (8, 1, 1)

# %% [markdown]
# The chart reads session 30's JSON (an H100; bench/results/issue13/session30). Left: the
# copies alone, in the three forms that read 16-byte pieces and the one that reads lines,
# converted from the TFLOP/s they would feed to bytes per second (each tile's 32 KiB of K and V
# counted once per 128-row query tile; the swizzled bar is far above HBM's ~3.35 TB/s because
# the 32 query tiles of a head read the same K and V, mostly from the L2). Right: the same
# change in two kernels: session 16's standalone tile with nothing changed but the K/V layout
# and its copy map, and nbinfer's own lean prefill through the ragged wrapper (`LEAN_SWIZZLE`,
# now on), each with SDPA flash from the same process.

# %%
res30 = ROOT / "bench" / "results" / "issue13" / "session30"
call3 = json.loads((res30 / "call3" / "ws_h100.json").read_text())
call4 = json.loads((res30 / "call4" / "ws_h100.json").read_text())
call5 = json.loads((res30 / "call5" / "swizzle_h100.json").read_text())["kv_tile_ab"]
assert not call3["failed"] and not call4["failed"]
alone = {r["causal"]: r["wgmma_tflops"] for r in call3["timed"]}
copies = [("computing warps'\ncp.async (r128)", "2wg-n64-s2 r128"),
          ("producer warpgroup,\ncp.async", "ws-s4 no-math"),
          ("TMA, 16-byte\nbox rows", "ws-tma-s4 no-math"),
          ("TMA, 128-byte\nswizzled rows", "ws-sw-s4 no-math")]
b4 = {r["causal"]: r for r in call4["timed"] if r["L"] == 4096 and r["D"] == 128}
lean_ab = {r["causal"]: r for r in call5}
kernels = {c: [b4[c]["wgmma_tflops"]["2wg-n64-s2 r128"],
               b4[c]["wgmma_tflops"]["2wg-n64-s2 r128 sw"],
               lean_ab[c]["kv_tile_64w8glqo16_tflops"], lean_ab[c]["kv_tile_64w8glqyo16_tflops"]]
           for c in (True, False)}
flash_k = {c: [b4[c]["sdpa_flash_tflops"]] * 2 + [lean_ab[c]["sdpa_flash_tflops"]] * 2
           for c in (True, False)}
# TFLOP/s -> TB/s of K and V into the SMs: each 128-row query tile reads 64-key tiles of 32 KiB
# (K and V, D 128), all 64 of them non-causal, 2 qt + 2 causal (the diagonal's two whole)
B_T, H_T, L_T = 4, 32, 4096
tiles = {True: sum(2 * qt + 2 for qt in range(L_T // 128)), False: (L_T // 128) * (L_T // 64)}
flop = {c: 4 * B_T * H_T * L_T * L_T * 128 / (2 if c else 1) for c in (True, False)}
per_byte = {c: flop[c] / (B_T * H_T * tiles[c] * 32768) for c in (True, False)}
intake = {c: {v: alone[c][v] / per_byte[c] for _, v in copies} for c in (True, False)}
fig, (ax_c, ax_k) = subplots(1, 2, figsize=(12.5, 4.2))
x = np.arange(len(copies))
for j, causal in enumerate((True, False)):
    ax_c.bar(x + (j - 0.5) * 0.38, [intake[causal][v] for _, v in copies], 0.38,
             color=("C3", "C1")[j], label="causal" if causal else "non-causal")
ax_c.set_xticks(x, [c[0] for c in copies], fontsize=8)
ax_c.set_ylabel("K and V into the SMs, TB/s")
ax_c.set_title("the copies alone (the first bar: the whole r128 kernel)", fontsize=10)
ax_c.legend(fontsize=8)
names_k = ["standalone,\n16-byte pieces", "standalone,\nswizzled lines",
           "nbinfer lean,\n16-byte pieces", "nbinfer lean,\nswizzled lines"]
x = np.arange(4)
for j, causal in enumerate((True, False)):
    ax_k.bar(x + (j - 0.5) * 0.38, kernels[causal], 0.38, color=("C3", "C1")[j],
             label="causal" if causal else "non-causal")
    ax_k.plot(x + (j - 0.5) * 0.38, flash_k[causal], "k_", ms=14, mew=2,
              label="SDPA flash, same run" if j == 0 else None)
ax_k.set_xticks(x, names_k, fontsize=8)
ax_k.set_ylabel("TFLOP/s (B 4, L 4096, H 32, D 128, fp16)")
ax_k.set_title("the same change in two kernels (H100, session 30)", fontsize=10)
ax_k.legend(fontsize=8, loc="upper left")
save_figure(fig, "07_swizzle.png")
show(fig)
for causal in (True, False):
    print(f"{'causal' if causal else 'full':6s} copies alone, TB/s: " + ", ".join(
        f"{n.replace(chr(10), ' ')} {intake[causal][v]:.1f}" for n, v in copies))
    print(f"{'causal' if causal else 'full':6s} kernels, TFLOP/s: " + ", ".join(
        f"{n.replace(chr(10), ' ')} {t:.0f} ({t / f:.2f}x flash)"
        for n, t, f in zip(names_k, kernels[causal], flash_k[causal], strict=True)))
# what the text says: the three 16-byte-piece forms of the copies alone stay within 25 % of one
# another and of the whole r128 kernel; whole lines move over 3x more; both kernels gain over
# 40 % from the layout alone, and nbinfer's lean prefill passes SDPA flash with it
for causal in (True, False):
    pieces = [intake[causal][v] for _, v in copies[:3]]
    assert max(pieces) < 1.25 * min(pieces) and max(pieces) < 2.6
    assert intake[causal]["ws-sw-s4 no-math"] > 3 * max(pieces)
    assert kernels[causal][1] > 1.4 * kernels[causal][0]
    assert kernels[causal][3] > 1.4 * kernels[causal][2] and kernels[causal][3] > flash_k[causal][3]

# %% [markdown]
# ## Summary
#
# * `mma.sync.m16n8k16` is a warp-wide instruction: each lane holds a fixed slice of A, B and C
#   (rows `g`, `g + 8`; columns from `t`), and two accumulator n-tiles have exactly the A
#   layout, so `P = softmax(S)` feeds `P V` from registers.
# * `ldmatrix.x4` loads four 8 x 8 tiles straight into that layout from per-lane row addresses;
#   rows padded to `D + 8` halves keep its 8 rows in 8 different bank groups.
# * In the simulator, twins of the few tile functions compute each lane's fragments from shared
#   memory, so the kernel source runs unchanged; they match NumPy to float32 rounding.
# * The tile has 16 rows: decode's 1-8 rows per KV head would waste most of it, and at that
#   intensity memory is the limit on any unit. Tensor cores are for prefill, cascades and other
#   many-rows-per-key work, which the roofline places right of every ridge.
# * Hopper's `wgmma` multiplies 64 x N x 16 per warpgroup instruction from shared memory laid
#   out in 128-byte core matrices (described by LBO and SBO); its accumulators keep section 1's
#   layout, so the softmax and the P-as-A trick carry over. What limits a kernel built on it is
#   no longer the products but feeding them: registers per SM, the copies, and inside an engine
#   the fixed cost of each work item.
# * The copies' cost is their *request size*: 16-byte pieces of eight rows per eight threads
#   cap K and V into an SM at ~2.2 TB/s whoever issues them (warps, a producer warpgroup, TMA);
#   whole 128-byte lines into the 128-byte swizzled layout lift that cap several times, and
#   took nbinfer's lean prefill past SDPA flash (1.14x causal, 1.33x non-causal on an H100).
#
# Lesson 08 puts these kernels under a model.
