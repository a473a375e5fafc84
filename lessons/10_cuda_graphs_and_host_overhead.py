# %% [markdown]
# # Lesson 10: CUDA graphs and host overhead
#
# At small batch a decode step's attention takes the GPU a few microseconds per layer. The host
# has to prepare it (`plan()`: validate the page table, schedule, copy the plan to the device)
# and to launch it (`run()`: check the arguments, bind them, call the driver), and a serving
# loop does that for every step and every layer. This lesson counts that host time, then shows
# the two design choices that let a CUDA graph replay *one* recorded launch for every step, so
# that the launches cost nothing more than the graph's replay.
#
# **You will learn**
#
# 1. what a launch costs on the host: the driver's own floor, what nbinfer's `run()` adds, and
#    how that compares with a torch SDPA call;
# 2. what `plan()` costs per step, from 1 to 256 requests, and why a wrapper's first `plan()`
#    is the expensive one;
# 3. why one plan per step serves every layer, and how a fixed persistent grid plus a fixed plan
#    layout turn every step-dependent decision into data at fixed addresses;
# 4. a launch recorded at step 1 (its arguments copied, as a graph captures them), replayed
#    after step 2's `plan()`, computing step 2 correctly.
#
# Sections 1-2 read the host-cost benchmark: on a machine with a GPU the lesson runs it
# (`bench/host.py` and `bench/launch_cost.py`, in a separate process); elsewhere it shows the
# figures recorded on the H200 host and says so. Sections 3-4 run in Numba's CUDA simulator at
# tiny shapes (the first cell picks it).

# %%
from nbinfer.lessons_tool import gpu_present, run_bench, start_lesson

ROOT = start_lesson()  # Numba's CUDA simulator, chosen before Numba loads; the repository root

import json

import numpy as np
from matplotlib.patches import Patch

from nbinfer import BatchDecodeWithPagedKVCacheWrapper, PageTable, PlanLayout, reference, scheduler
from nbinfer.api.decode import CTAS_PER_SM
from nbinfer.scheduler import HEADER_WORDS, WORK_FIELDS
from nbinfer.viz import request_colors, save_figure, show, subplots

np.set_printoptions(linewidth=100)
rng = np.random.default_rng(10)

# %% [markdown]
# ## 1. What a launch costs
#
# The figures: `run()` of a batch-1 decode step (Hq 32, Hkv 8, D 128, 512 tokens of KV, fp16,
# torch tensors), with and without a caller-provided `out`, timed in the same rounds as the
# prepared launch alone and a torch SDPA call on the same problem; and, from a second script,
# the driver's `cuLaunchKernel` for a kernel with one parameter (the floor of any launch on
# that machine).


# %%
recorded = ROOT / "bench" / "results" / "issue14"
if gpu_present():  # measure here, in a process without the simulator
    host, launch = run_bench("host.py"), run_bench("launch_cost.py")
    source = f"measured now on {host['device']}"
else:
    host = json.loads((recorded / "host_h200.json").read_text())
    launch = json.loads((recorded / "launch_cost.json").read_text())
    source = "recorded on the H200 host (bench/results/issue14), no GPU here"
run = host["run_batch1"]
print(source)
anatomy = {"cuLaunchKernel, 1-parameter kernel": launch["one_param_kernel"],
           "nbinfer's prepared launch (98 parameters)": run["launch_only_us"],
           "run(q, cache, out=out)": run["run_out_us"],
           "run(q, cache)": run["run_us"],
           "torch SDPA, same problem": run["sdpa_us"]}
for name, us in anatomy.items():
    print(f"{name:44s} {us:6.1f} us")
# run() is the launch plus a few us of checks and pointer writes, plus the output allocation
# (measured figures: printed, never asserted; another host or day moves them)
print(f"run() = launch {run['launch_only_us']:.1f} us + checks and pointer writes "
      f"{run['run_out_us'] - run['launch_only_us']:.1f} us + the output's allocation "
      f"{run['run_us'] - run['run_out_us']:.1f} us")

# %% [markdown]
# The launch itself is most of `run()`: the driver needs several microseconds per launch on
# this host whatever the kernel, and nbinfer's 98 parameters (a Numba array argument is seven
# 8-byte fields) add little to that. What `run()` adds on top is a handful of comparisons (the
# tensors match the plan), five 8-byte pointer writes into the prepared argument block, and,
# without `out=`, one `torch.empty_like` for the output.
#
# ## 2. What `plan()` costs
#
# `plan()` runs once per step. It validates the page table, schedules the step's work over the
# fixed grid (lesson 06), packs the plan into a pinned staging buffer and starts one
# asynchronous copy to the device. A wrapper's first `plan()` runs the NumPy scheduler of lesson
# 06; from its second on, the same scheduler compiled to machine code by Numba (equal array for
# array, tested), which would cost its start-up (a few tenths of a second) in a process that
# plans only once.

# %%
rows = host["plan"]
batch = [r["batch"] for r in rows]
for r in rows:
    print(f"batch {r['batch']:4d}: {r['pages']:6d} pages, plan() {r['plan_pinned_us']:7.1f} us "
          f"(page table in pinned host memory), {r['plan_device_us']:7.1f} us (on the GPU: one "
          f"device-to-host copy), first plan() of a wrapper {r['plan_first_us']:7.1f} us")
print(f"a wrapper's first plan() costs {min(r['plan_first_us'] / r['plan_pinned_us'] for r in rows):.1f}"
      f"-{max(r['plan_first_us'] / r['plan_pinned_us'] for r in rows):.1f}x a later one")
layers = 16  # Llama-3.2-1B
step_host = rows[0]["plan_pinned_us"] + layers * run["run_out_us"]
print(f"host time of one batch-1 decode step of a {layers}-layer model: plan() once + "
      f"{layers} run() = {step_host:.0f} us")

# %%
fig, (ax_l, ax_p) = subplots(1, 2, figsize=(12.5, 4.4), gridspec_kw={"width_ratios": [1, 1.1]})
names = list(anatomy)
colors = ["0.75", "C0", "C0", "C0", "C2"]
ax_l.barh(range(len(names)), list(anatomy.values()), color=colors)
for y, us in enumerate(anatomy.values()):
    ax_l.text(us, y, f" {us:.1f} us", va="center", fontsize=8)
ax_l.set_yticks(range(len(names)), labels=names, fontsize=8)
ax_l.invert_yaxis()
ax_l.set_xlabel("host time per call (us)")
ax_l.set_xlim(0, max(anatomy.values()) * 1.25)
ax_l.set_title(f"one launch, batch 1 ({source.split(' (')[0]})", fontsize=9)
for key, label, style in (("plan_pinned_us", "plan(), page table in pinned memory", "o-"),
                          ("plan_device_us", "plan(), page table on the GPU", "s-"),
                          ("plan_first_us", "a wrapper's first plan() (NumPy scheduler)", "^--")):
    ax_p.plot(batch, [r[key] for r in rows], style, label=label, ms=4)
ax_p.set_xscale("log", base=2)
ax_p.set_yscale("log")
ax_p.set_xticks(batch, labels=[str(b) for b in batch])
ticks = [t for t in (100, 200, 300, 500, 1000, 2000, 5000) if
         min(r["plan_pinned_us"] for r in rows) / 1.5 < t < max(r["plan_first_us"] for r in rows) * 1.5]
ax_p.set_yticks(ticks, labels=[str(t) for t in ticks])
ax_p.minorticks_off()
ax_p.set_xlabel("requests in the step")
ax_p.set_ylabel("host time per plan() (us)")
ax_p.set_title("plan(), once per step (serves every layer)", fontsize=9)
ax_p.legend(fontsize=8, frameon=False)
save_figure(fig, "10_host_cost.png")
show(fig)

# The bars and lines are the numbers printed above.
np.testing.assert_allclose([p.get_width() for p in ax_l.patches], list(anatomy.values()))
np.testing.assert_allclose(ax_p.lines[0].get_ydata(), [r["plan_pinned_us"] for r in rows])

# %% [markdown]
# The rest of this lesson uses lesson 06's toy scheduling problem: GQA group 4 over one KV head,
# a grid of 8 CTAs, and a batch of one long request and seven short ones.

# %%
G, HKV = 4, 1
HQ = G * HKV
NUM_CTAS, GRANULE = 8, 16
kv_lens = np.concatenate([[3000], rng.integers(60, 400, size=7)])
lpt_plan = scheduler.plan(np.arange(kv_lens.size + 1), kv_lens, HQ, HKV, NUM_CTAS,
                          granule=GRANULE)
SIM_HQ, SIM_HKV, SIM_D, PAGE = 4, 1, 64, 16


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# %% [markdown]
# ## 3. Plan reuse and a fixed layout
#
# A model with 32 layers attends over the same lengths in every layer of a step, so one plan
# serves all of them: `plan()` once per step, `run()` once per layer. The CPU cost is paid once.
#
# CUDA graphs remove the remaining CPU cost, the launches themselves: a graph records kernel
# launches once, with their arguments *by value* (grid size, pointers, offsets), and replays
# them. So a replay can only work with a new plan if nothing the launch was recorded with
# changes. Two design choices make that so:
#
# 1. **The grid is fixed.** The decode kernel is persistent: `num_ctas` CTAs (SMs x 4 on a GPU,
#    `persistent_ctas("sim")` in the simulator) whatever the batch, each looping over its queue.
#    A plan for 1 request and a plan for 50 have the same number of queues.
# 2. **The plan lives at fixed offsets.** `PlanLayout.bound(...)` fixes capacities (CTAs, work
#    items, merge rows, merge entries) large enough for every batch up to a maximum size, hence
#    the word offset of every section. Each step packs its plan into the same buffer; only the
#    bytes change, and a header says how many entries of each section are valid.

# %%
assert CTAS_PER_SM == 4  # the GPU grid: persistent_ctas("cuda") = SM count x 4
for lens in ([700], [20, 150, 90], list(rng.integers(1, 500, size=50))):
    p = scheduler.plan(np.arange(len(lens) + 1), lens, HQ, HKV, NUM_CTAS, granule=GRANULE)
    print(f"batch of {len(lens):2d}: {p.num_work:2d} work items in {p.num_ctas} CTA queues")
    assert p.num_ctas == NUM_CTAS and p.cta_indptr.size == NUM_CTAS + 1

MAX_BATCH = 8
layout = PlanLayout.bound(NUM_CTAS, MAX_BATCH, HQ, HKV)
step_b_lens = rng.integers(100, 1200, size=5)
step_a = lpt_plan  # lesson 06's batch: 8 requests, one of them long
step_b = scheduler.plan(np.arange(step_b_lens.size + 1), step_b_lens, HQ, HKV, NUM_CTAS,
                        granule=GRANULE)
print(layout, f"= {layout.nbytes} bytes")
print(f"{'section':>14} {'fixed offset':>13} {'tight offset A':>15} {'tight offset B':>15}")
tight_a, tight_b = PlanLayout.for_plan(step_a).offsets(), PlanLayout.for_plan(step_b).offsets()
for name, off in layout.offsets().items():
    print(f"{name:>14} {off:13d} {tight_a[name]:15d} {tight_b[name]:15d}")
assert layout.fits(step_a) and layout.fits(step_b)
moved = [s for s in tight_a if tight_a[s] != tight_b[s]]
assert moved and set(moved) <= set(list(tight_a)[2:])  # tight layouts move sections after `work`

buffer = np.empty(layout.size, dtype=np.int32)  # stands for the wrapper's fixed plan memory
address = buffer.ctypes.data
snapshots = {}
for name, step in (("step A", step_a), ("step B", step_b)):
    layout.pack(step, out=buffer)  # in place: same memory, new bytes
    assert buffer.ctypes.data == address
    assert layout.unpack(buffer) == step
    snapshots[name] = buffer.copy()
assert not np.array_equal(snapshots["step A"], snapshots["step B"])
print(f"step A: {step_a.num_work} items, step B: {step_b.num_work} items, one buffer of "
      f"{layout.size} words at a fixed address; unpack() gives each step's plan back")

# %%
section_color = dict(zip(["header", "work", "cta_indptr", "cta_work", "merge_rows",
                          "merge_indptr", "merge_indices"], request_colors(7), strict=True))


def valid_words(p, name):
    return {"header": HEADER_WORDS, "work": p.num_work * WORK_FIELDS, "cta_indptr": p.num_ctas + 1,
            "cta_work": p.num_work, "merge_rows": p.num_merge_rows,
            "merge_indptr": p.num_merge_rows + 1, "merge_indices": p.num_merge_nnz}[name]


strips = [("step A, fixed layout", layout, step_a), ("step B, fixed layout", layout, step_b),
          ("step A, tight layout", PlanLayout.for_plan(step_a), step_a),
          ("step B, tight layout", PlanLayout.for_plan(step_b), step_b)]
fig, ax = subplots(figsize=(12, 3.2))
for y, (_, lay, p) in enumerate(strips):
    off = lay.offsets()
    names = list(section_color)
    for name, nxt in zip(names, names[1:] + ["end"], strict=True):
        used = valid_words(p, name)
        ax.broken_barh([(off[name], used)], (y - 0.38, 0.76), facecolors=section_color[name])
        ax.broken_barh([(off[name] + used, off[nxt] - off[name] - used)], (y - 0.38, 0.76),
                       facecolors="white", edgecolors=section_color[name], hatch="///", lw=0.5)
for x in layout.offsets().values():
    ax.axvline(x, color="k", lw=0.5, ls=":", alpha=0.6)
ax.set_yticks(range(len(strips)), labels=[r[0] for r in strips], fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("int32 word offset in the wrapper's plan memory (dotted: fixed section starts)")
handles = [Patch(color=c, label=s) for s, c in section_color.items()]
handles.append(Patch(facecolor="white", edgecolor="k", hatch="///", label="unused capacity"))
ax.legend(handles=handles, fontsize=7.5, ncol=8, loc="lower center", bbox_to_anchor=(0.5, 1.0),
          frameon=False)
ax.set_title("two steps packed into one fixed layout: same offsets, different bytes", fontsize=10,
             pad=24)
save_figure(fig, "10_packed_plan.png")
show(fig)

# %% [markdown]
# In the fixed layout every section starts at the same word for both steps; only the filled part
# changes. Tight layouts (`PlanLayout.for_plan`) move the sections after `work` from one step to
# the next (those that moved are counted above), and a recorded launch would read garbage.
#
# ## 4. A recorded launch, replayed with a new plan
#
# The simulator has no CUDA graphs, but we can
# do what a graph does: copy the launch of step 1 (the kernel, its grid and every argument,
# exactly as `run()` bound them: a graph captures them by value) and call the copy again after
# step 2's `plan()`. With `use_cuda_graph=True` the wrapper keeps one fixed-capacity layout of
# its plan memory and reads the page table from caller-owned buffers, so step 2's plan and page
# table land in the same memory that the step-1 arguments point to (`wrapper.step_plan.launch`
# is the wrapper's prepared launch, `.layout` its offsets; `.launch.with_kernel(...)` copies its
# argument block). The batch keeps its size (2 slots; a finished request leaves an empty slot,
# here slot 0 in step 2), and `q` and `out` are the same arrays, refilled in place, as they are
# in a graph-captured serving loop.

# %%
POOL = 24
graph_cache = rng.standard_normal((POOL, 2, PAGE, SIM_HKV, SIM_D)).astype(np.float32)
q_buf = np.zeros((2, SIM_HQ, SIM_D), np.float32)
out_buf = np.zeros_like(q_buf)
table_bufs = (np.zeros(3, np.int32), np.zeros(POOL, np.int32), np.zeros(2, np.int32))
gw = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD", use_cuda_graph=True,
                                        paged_kv_indptr_buffer=table_bufs[0],
                                        paged_kv_indices_buffer=table_bufs[1],
                                        paged_kv_last_page_len_buffer=table_bufs[2], backend="auto")
recorded = None
for step, lens in enumerate(([20, 150], [0, 130])):
    step_pt = PageTable.from_kv_lens(lens, PAGE, num_pages=POOL, rng=rng)
    gw.plan(step_pt.indptr, step_pt.indices, step_pt.last_page_len, SIM_HQ, SIM_HKV, SIM_D, PAGE,
            q_data_type="float32", fixed_split_size=64)
    q_buf[:] = rng.standard_normal(q_buf.shape)
    if recorded is None:
        gw.run(q_buf, graph_cache, out=out_buf)  # step 1: an ordinary run() ...
        prepared = gw.step_plan.launch.launch
        recorded = prepared.with_kernel(prepared.kernel)  # ... whose arguments we copy
        first_plan, first_layout = gw.schedule, gw.step_plan.launch.layout
    else:
        assert gw.schedule != first_plan
        assert gw.step_plan.launch.layout == first_layout  # same offsets for the new plan
        out_buf[:] = np.nan
        recorded(0)  # replay step 1's launch: it reads step 2's plan from the plan memory
    expect = reference.batch_decode_with_paged_kv_cache(q_buf, graph_cache, step_pt.indptr,
                                                        step_pt.indices, step_pt.last_page_len)
    print(f"step {step + 1}: lengths {lens}, {gw.schedule.num_work} work items, "
          f"{gw.schedule.num_merge_rows} split row(s), grid {recorded.grid[0]} CTAs, "
          f"relative error {rel_err(out_buf, expect):.1e}")
    assert rel_err(out_buf, expect) <= 2e-5
assert np.all(out_buf[0] == 0)  # the empty slot: no keys, output 0

# %% [markdown]
# The step-1 launch never saw step 2's lengths, yet it computed step 2 correctly, empty slot and
# all: everything step-dependent was data in the plan memory and the page-table buffers, read
# through addresses that did not move. On a GPU the same loop captures `run()` in a real
# `torch.cuda.CUDAGraph` and replays it after each `plan()`: the GPU test
# `tests/test_gpu_scheduler.py::test_cuda_graph_replays_new_plans` does that over uniform,
# skewed and padded steps through one graph.
#
# ## Summary
#
# * A launch costs the host several microseconds of driver time whatever the kernel; nbinfer's
#   `run()` adds a few microseconds of checks and pointer writes on top, and the output
#   allocation when no `out=` is given.
# * `plan()` runs once per step and serves every layer; from a wrapper's second step on it runs
#   a compiled scheduler, a few hundred microseconds even at 256 requests.
# * A fixed persistent grid plus a fixed plan layout turn every step-dependent decision into
#   data at fixed addresses, so one recorded launch (a CUDA graph) replays any later step's
#   plan: the graph removes the per-layer launch cost, the plan stays per step.
