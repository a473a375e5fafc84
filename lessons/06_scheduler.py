# %% [markdown]
# # Lesson 06: the scheduler
#
# A decode batch in a serving system is lumpy: one request has 30,000 tokens of KV cache, the
# next has 30, and the lengths change every step. The GPU has a fixed number of SMs and wants
# every one of them busy until the step ends. FlashInfer's answer is a small CPU-side scheduler:
# `plan()` looks only at the *lengths* of one step's requests and writes down who does what. The
# kernel then follows that plan. This lesson takes nbinfer's scheduler (`nbinfer.scheduler`)
# apart.
#
# **You will learn**
#
# 1. chunking: how `plan()` picks the query tile `T_q` (mean query length x GQA group size) and
#    the KV chunk `L_kv` (total work / number of CTAs), and what that does to a skewed batch;
# 2. LPT (longest processing time first): a Gantt chart of CTA loads before balancing (one CTA
#    per request) and after (chunks + LPT), compared with round-robin, and Graham's 4/3 bound
#    checked against exact optima;
# 3. the reduction map (the paper's Figure 6: which partial states merge into which output row,
#    in which order), and why nbinfer merges in that fixed order instead of with atomics:
#    float32 merges in different orders give different bits;
# 4. the real persistent decode kernel in Numba's CUDA simulator: checked against the float64
#    reference, and bit-for-bit identical whenever the lengths (hence the plan) are the same.
#
# Why the grid is fixed and the plan packs into fixed offsets, so that a CUDA graph replays
# every step, is lesson 10. Sections 1-3 are pure NumPy; section 4 runs the kernel in the
# simulator at tiny shapes (the first cell picks it, so the lesson runs anywhere).

# %%
from nbinfer.lessons_tool import start_lesson

ROOT = start_lesson()  # Numba's CUDA simulator, chosen before Numba loads; the repository root

import dataclasses
import inspect
import itertools
import re

import numpy as np
from matplotlib.patches import Rectangle

import nbinfer.kernels.decode as decode_kernels
import nbinfer.kernels.fused_merge as fused_merge_kernels
import nbinfer.kernels.prefill as prefill_kernels
import nbinfer.kernels.prefill_mma as prefill_mma_kernels
from nbinfer import BatchDecodeWithPagedKVCacheWrapper, PageTable, reference, scheduler
from nbinfer.api.decode import MIN_CHUNK, persistent_ctas
from nbinfer.viz import request_colors, save_figure, show, subplots

np.set_printoptions(linewidth=100)
rng = np.random.default_rng(6)


def ceil_div(a, b):
    return -(-a // b)


# %% [markdown]
# ## 1. Chunking
#
# `scheduler.plan(qo_indptr, kv_lens, num_qo_heads, num_kv_heads, num_ctas)` sees lengths only:
# query rows per request (`qo_indptr`, as in a ragged batch; decode is `arange(B + 1)`), KV
# tokens per request, the head counts, and the number of CTAs of the GPU's persistent grid. Its
# first two decisions are tile sizes.
#
# ### 1a. The query tile `T_q`
#
# With grouped-query attention, `G = num_qo_heads / num_kv_heads` query heads read the same KV
# head. FlashInfer packs them into one tile: a tile of `T_q` packed rows holds `T_q / G` query
# tokens times `G` heads, and every KV byte it loads serves all of them. `T_q` is chosen from the
# mean packed length of the batch, `mean(qo_len) x G`: above 64 it is 128, above 16 it is 64,
# otherwise 16. We plan three batches with `G = 4`: plain decode (one new token per request),
# speculative verification (6 draft tokens per request) and a prefill batch.

# %%
G, HKV = 4, 1  # GQA group size and KV heads for sections 1-3 (one KV head: one item per chunk)
HQ = G * HKV
batches = {"decode": [1] * 8, "verify 6 draft tokens": [6] * 8, "prefill": [512, 300, 128, 40]}
tiles = {}
for name, qo in batches.items():
    qo_indptr = np.concatenate([[0], np.cumsum(qo)])
    p = scheduler.plan(qo_indptr, [2048] * len(qo), HQ, HKV, num_ctas=8)
    mean_packed = float(np.mean(qo)) * G
    tiles[name] = (p.tile_q, p.tile_rows)
    print(f"{name:22s} mean packed length {mean_packed:6.1f} -> T_q = {p.tile_q:3d} packed rows "
          f"= {p.tile_rows:2d} query tokens x G = {G}")
    assert p.tile_q == scheduler.choose_tile_q(mean_packed)
    assert p.tile_rows == max(1, min(p.tile_q // G, max(qo)))  # never taller than the longest
assert tiles["decode"] == (16, 1)  # decode: one query token per tile, all G heads in it
assert tiles["verify 6 draft tokens"] == (64, 6)
assert tiles["prefill"] == (128, 32)

# %% [markdown]
# In decode every tile is one token: its `G` heads are all the rows there are, so the KV of a
# request is read once per KV head whatever the tile height. The interesting decision in decode
# is therefore the second one.
#
# ### 1b. The KV chunk `L_kv`
#
# If every work item were exactly one CTA's fair share long, each CTA would get one item. So the
# chunk size *is* that share: total KV work divided by the number of CTAs (for decode, where each
# request is one query tile),
#
# $$L_{kv} = \left\lceil \frac{H_{kv} \sum_b \mathrm{kv}_b}{\#\mathrm{CTA}} \right\rceil,$$
#
# rounded up to a `granule` (the tokens a CTA consumes per round; 16 here). A request longer
# than `L_kv` is cut into `n = ceil(kv / L_kv)` chunks of *equal* size (again rounded up to the
# granule), so the chunks are as alike as possible, which is what the assignment below packs
# best. A shorter request stays whole and its CTA writes the output directly.
#
# The example batch for the rest of sections 1-2: one long request (3000 tokens) and seven short
# ones, on a toy GPU of 8 CTAs.

# %%
NUM_CTAS, GRANULE = 8, 16
kv_lens = np.concatenate([[3000], rng.integers(60, 400, size=7)])
decode_indptr = np.arange(kv_lens.size + 1)
lpt_plan = scheduler.plan(decode_indptr, kv_lens, HQ, HKV, NUM_CTAS, granule=GRANULE)
print("kv_lens:", kv_lens, " total:", kv_lens.sum())
print(lpt_plan.summary(max_items=14))

L_kv = ceil_div(ceil_div(HKV * int(kv_lens.sum()), NUM_CTAS), GRANULE) * GRANULE
assert lpt_plan.kv_chunk == L_kv
work = lpt_plan.work  # columns: request, kv_head, qo_start, qo_end, kv_start, kv_end, partial_row
chunks_of = {}
for b, kv in enumerate(kv_lens):
    mine = work[work[:, 0] == b]
    mine = mine[np.argsort(mine[:, 4])]
    chunks_of[b] = [(int(s), int(e)) for s, e in mine[:, 4:6]]
    sizes = mine[:, 5] - mine[:, 4]
    assert mine[0, 4] == 0 and mine[-1, 5] == kv and np.all(mine[1:, 4] == mine[:-1, 5])  # cover
    assert np.all(sizes <= L_kv)
    assert len(mine) == max(1, ceil_div(int(kv), L_kv))
    assert np.all(mine[:, 6] == -1) if len(mine) == 1 else np.all(mine[:, 6] >= 0)
    if len(mine) > 1:  # equal chunks, a multiple of the granule; only the last may be shorter
        assert np.all(sizes[:-1] == sizes[0]) and sizes[0] % GRANULE == 0 and sizes[-1] <= sizes[0]
long_sizes = np.diff(np.array(chunks_of[0]), axis=1).ravel()
print(f"L_kv = ceil({kv_lens.sum()} / {NUM_CTAS}) rounded up to {GRANULE} = {L_kv}")
print(f"request 0 ({kv_lens[0]} tokens) -> {len(chunks_of[0])} chunks of {long_sizes.tolist()}")
assert len(chunks_of[0]) > 1 and all(len(chunks_of[b]) == 1 for b in range(1, kv_lens.size))
assert long_sizes[0] < L_kv and long_sizes[-1] < long_sizes[0]

# %% [markdown]
# Request 0 became several chunks, each no longer than `L_kv` (the equal-size rule makes them a
# little shorter than `L_kv`, the last one shorter still); the seven short requests are single
# items. Every chunk of a split request writes a *partial* attention state (lesson 01) into the
# workspace; they are merged later.

# %%
fig, ax = subplots(figsize=(9, 3.4))
colors = request_colors(kv_lens.size)
for b in range(kv_lens.size):
    for k, (s, e) in enumerate(chunks_of[b]):
        ax.barh(b, e - s, left=s, height=0.7, color=colors[b], edgecolor="k", linewidth=0.8,
                alpha=0.55 if len(chunks_of[b]) > 1 else 1.0)
        if len(chunks_of[b]) > 1:
            ax.text((s + e) / 2, b, f"chunk {k}\n{e - s}", ha="center", va="center", fontsize=7)
ax.axvline(L_kv, color="crimson", ls="--", lw=1, label=f"L_kv = {L_kv} (total / {NUM_CTAS} CTAs)")
ax.set_yticks(range(kv_lens.size), labels=[f"request {b}" for b in range(kv_lens.size)], fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("KV token")
ax.legend(fontsize=8, loc="lower right", frameon=False)
ax.set_title("a skewed decode batch cut into KV chunks (pale = writes a partial state)", fontsize=10)
save_figure(fig, "06_chunking.png")
show(fig)

# %% [markdown]
# ## 2. LPT: who gets which chunk
#
# Each work item gets a cost `alpha * l_q + beta * l_kv` (`l_q` = packed query rows, here `G`;
# `l_kv` = KV tokens). The default `1 : 1` counts bytes: a packed query row is read and written
# once, a KV token is one K row and one V row. The assignment is *LPT*: sort the items by cost,
# largest first, and give each to the CTA whose queue is currently the lightest (a min-heap
# keyed by load; ties go to the lower CTA index, so the result is deterministic).
#
# Three schedules of the same batch on the same 8 CTAs:
#
# * **one CTA per request, no split** (the naive launch): `fixed_split_size = max(kv_lens)`
#   makes every request one item, and with 8 items on 8 CTAs each CTA gets one;
# * **chunks, round-robin**: the chunked items in work-table order, item `i` to CTA `i mod 8`;
# * **chunks + LPT**: what `plan()` does.
#
# The *makespan* (the longest queue) is the step's time in cost units. No schedule can beat the
# lower bound `max(total / #CTA, largest item)`.


# %%
def round_robin(p):
    """The same items as plan p, item i on CTA i mod num_ctas (a Plan, so it can be drawn)."""
    owner = np.arange(p.num_work) % p.num_ctas
    cta_work = np.argsort(owner, kind="stable").astype(np.int32)
    cta_indptr = np.zeros(p.num_ctas + 1, dtype=np.int32)
    cta_indptr[1:] = np.cumsum(np.bincount(owner, minlength=p.num_ctas))
    return dataclasses.replace(p, cta_indptr=cta_indptr, cta_work=cta_work)


one_per_request = scheduler.plan(decode_indptr, kv_lens, HQ, HKV, NUM_CTAS,
                                 fixed_split_size=int(kv_lens.max()))
assert one_per_request.num_work == kv_lens.size == NUM_CTAS
assert np.all(np.diff(one_per_request.cta_indptr) == 1)  # exactly one request per CTA
schedules = {"one CTA per request": one_per_request, "chunks, round-robin": round_robin(lpt_plan),
             "chunks + LPT": lpt_plan}
makespan = {}
for name, p in schedules.items():
    loads = p.cta_loads()
    makespan[name] = loads.max()
    print(f"{name:20s} makespan {loads.max():6.0f}  lower bound {p.lower_bound():7.2f}  "
          f"(ratio {loads.max() / p.lower_bound():.3f}), CTAs idle {1 - loads.mean() / loads.max():.0%}"
          " of the step")

before, rr, after = makespan.values()
print(f"chunks + LPT finish {before / after:.2f}x sooner than one CTA per request")
assert after < rr < before
assert before == kv_lens.max() + G  # without splitting, the long request is the whole step
rr_items = round_robin(lpt_plan).item_cta()
mixed = set(rr_items[work[:, 0] == 0].tolist()) & set(rr_items[work[:, 0] != 0].tolist())
assert mixed  # round-robin stacks short requests onto CTAs that hold a long chunk

# Chunking is not free: every extra chunk reads its query rows again (and writes a partial).
extra = lpt_plan.item_costs().sum() - one_per_request.item_costs().sum()
assert extra == (lpt_plan.num_work - one_per_request.num_work) * G

# The guarantees. Any greedy list schedule ends within one item of the average load; on this
# batch LPT is even within 4/3 of the lower bound (hence within 4/3 of the optimum).
costs = lpt_plan.item_costs()
assert after >= lpt_plan.lower_bound()
assert after <= costs.sum() / NUM_CTAS + costs.max() * (1 - 1 / NUM_CTAS)
assert after <= 4 / 3 * lpt_plan.lower_bound()

# %%
fig, axes = subplots(3, 1, figsize=(9, 8.2))
for ax, (name, p) in zip(axes, schedules.items(), strict=True):
    p.plot_gantt(ax=ax, title=f"{name}: makespan {makespan[name]:.0f}")
    ax.set_xlim(0, before * 1.02)
fig.suptitle(f"the same {kv_lens.size} requests on {NUM_CTAS} CTAs (colour = request, "
             "pale with edge = partial)", fontsize=11)
save_figure(fig, "06_lpt_gantt.png")
show(fig)

# %% [markdown]
# Without splitting, the long request *is* the step: one CTA works, seven wait. Chunking alone
# is not enough either: round-robin ignores sizes, so short requests land on CTAs that already
# hold a long chunk. LPT hands out the big chunks first and fills the gaps with the small
# requests.
#
# ### 2b. Graham's bound, checked against exact optima
#
# Graham (1969) proved that LPT's makespan is at most `4/3 - 1/(3m)` times the optimum on `m`
# machines. Finding the optimum is NP-hard in general, but for 3 CTAs and 8 items we can enumerate all
# `3^8` assignments. We check the bound on random instances, and on Graham's own tight example
# (`2m+1` items: `2m-1, 2m-1, 2m-2, 2m-2, ..., m+1, m+1, m, m, m`) where LPT hits it exactly.


# %%
def lpt_makespan(c, m):
    cta_indptr, cta_work = scheduler.lpt_assign(np.asarray(c, dtype=np.int64), m)
    owner = np.repeat(np.arange(m), np.diff(cta_indptr))
    loads = np.zeros(m, dtype=np.int64)
    np.add.at(loads, owner, np.asarray(c)[cta_work])
    return int(loads.max()), owner, cta_work


def optimum(c, m):
    """Exact best makespan by enumerating all m**n assignments; also returns a best assignment."""
    c = np.asarray(c, dtype=np.int64)
    assign = np.array(list(itertools.product(range(m), repeat=c.size)))
    loads = np.stack([(assign == j) @ c for j in range(m)], axis=1)
    best = int(np.argmin(loads.max(axis=1)))
    return int(loads[best].max()), assign[best]


M = 3
bound = 4 / 3 - 1 / (3 * M)
ratios = []
for _ in range(200):
    c = rng.integers(1, 30, size=8)
    lpt, _, _ = lpt_makespan(c, M)
    opt, _ = optimum(c, M)
    assert opt <= lpt <= bound * opt + 1e-9
    assert lpt <= c.sum() / M + c.max()
    ratios.append(lpt / opt)
ratios = np.array(ratios)
tight = [2 * M - 1 - i // 2 for i in range(2 * M - 2)] + [M] * 3
tight_lpt, tight_owner, tight_order = lpt_makespan(tight, M)
tight_opt, tight_assign = optimum(tight, M)
print(f"200 random instances, 3 CTAs, 8 items: LPT optimal in {np.mean(ratios == 1):.0%}, "
      f"worst LPT/OPT = {ratios.max():.3f}, Graham's bound = {bound:.3f}")
print(f"tight example {tight}: LPT {tight_lpt}, optimum {tight_opt}, "
      f"ratio {tight_lpt / tight_opt:.4f}")
assert ratios.max() <= bound
assert np.isclose(tight_lpt / tight_opt, bound)  # the bound is attained

# %%
fig, (ax_h, ax_t) = subplots(1, 2, figsize=(11, 3.4))
ax_h.hist(ratios, bins=np.linspace(1, 1.35, 36), color="C0")
ax_h.axvline(bound, color="crimson", ls="--", lw=1, label=f"Graham: 4/3 - 1/(3m) = {bound:.3f}")
ax_h.set_xlabel("LPT makespan / optimal makespan")
ax_h.set_ylabel("instances")
ax_h.legend(fontsize=8, frameon=False)
ax_h.set_title("200 random instances (3 CTAs, 8 items), optimum by enumeration", fontsize=10)
rows = [("LPT", tight_owner, np.asarray(tight)[tight_order]),
        ("optimal", tight_assign, np.asarray(tight))]
for k, (_, owner, sizes) in enumerate(rows):
    for cta in range(M):
        y = k * (M + 1) + cta
        left = 0
        for s in sizes[owner == cta]:
            ax_t.barh(y, s, left=left, color=f"C{int(s) % 10}", edgecolor="k")
            ax_t.text(left + s / 2, y, str(s), ha="center", va="center", fontsize=8)
            left += s
ax_t.set_yticks([k * (M + 1) + c for k in range(2) for c in range(M)],
                labels=[f"{name} CTA {c}" for name, _, _ in rows for c in range(M)], fontsize=8)
ax_t.invert_yaxis()
ax_t.set_xlabel("load")
ax_t.set_title(f"Graham's tight example: LPT {tight_lpt} vs optimal {tight_opt}", fontsize=10)
save_figure(fig, "06_lpt_vs_optimal.png")
show(fig)

# %% [markdown]
# ## 3. The reduction map
#
# The plan has two halves: the work queue of every CTA, and an index map from partial states to
# output rows (the paper's Figure 6). A request that was never split has no partials: its CTA
# writes its output row directly. A split request's output row is the merge ⊕ of its partial
# rows, listed in `merge_rows`, `merge_indptr`, `merge_indices` (a CSR matrix) in increasing
# `kv_start` order. A smaller batch makes the picture readable: six requests on six CTAs.

# %%
fig6_lens = np.array([200, 1500, 120, 260, 800, 90])
fig6 = scheduler.plan(np.arange(fig6_lens.size + 1), fig6_lens, HQ, HKV, 6, granule=GRANULE)
print(fig6)
for r, row in enumerate(fig6.merge_rows):
    parts = fig6.merge_indices[fig6.merge_indptr[r]:fig6.merge_indptr[r + 1]]
    print(f"output row {row} <- merge of partial rows {parts.tolist()}")
direct = sorted(set(range(fig6.batch_size)) - set(fig6.merge_rows.tolist()))
print(f"output rows {direct} <- written directly by one work item each")

# Every partial row is merged exactly once, by the output row of its own request, in KV order.
assert sorted(fig6.merge_indices.tolist()) == list(range(fig6.num_partials))
prow_item = {int(w[6]): w for w in fig6.work if w[6] >= 0}
for r, row in enumerate(fig6.merge_rows):
    items = [prow_item[int(pr)] for pr in fig6.merge_indices[fig6.merge_indptr[r]:fig6.merge_indptr[r + 1]]]
    assert all(w[0] == row for w in items)  # decode: output row b is request b
    assert items[0][4] == 0 and items[-1][5] == fig6_lens[row]
    assert all(a[5] == b[4] for a, b in zip(items, items[1:], strict=False))  # increasing kv_start
for b in direct:
    assert np.count_nonzero(fig6.work[:, 0] == b) == 1
assert fig6.num_merge_rows >= 2 and len(direct) >= 2  # both kinds appear in the picture
assert len(set(np.diff(fig6.merge_indptr).tolist())) > 1  # lists of different lengths


# %%
def draw_reduction_diagram(p, ax):
    """Work items (left, by request and KV order) -> output rows (right); Figure 6's shape."""
    colors = request_colors(p.batch_size)
    cta = p.item_cta()
    order = np.lexsort((p.work[:, 4], p.work[:, 0]))
    y_of = {int(i): -k for k, i in enumerate(order)}
    position = {}
    for r in range(p.num_merge_rows):
        lo, hi = p.merge_indptr[r], p.merge_indptr[r + 1]
        for k, pr in enumerate(p.merge_indices[lo:hi].tolist()):
            position[pr] = k
    for b in range(p.batch_size):
        items = [int(i) for i in order if p.work[i, 0] == b]
        y_out = float(np.mean([y_of[i] for i in items]))
        merged = len(items) > 1
        ax.add_patch(Rectangle((6.2, y_out - 0.35), 2.6, 0.7, facecolor=colors[b], alpha=0.9))
        ax.text(7.5, y_out, f"output row {b}\n" + ("⊕ of partials" if merged else "direct write"),
                ha="center", va="center", fontsize=7.5, color="white", fontweight="bold")
        for i in items:
            y = y_of[i]
            _, _, _, _, ks, ke, prow = p.work[i].tolist()
            ax.add_patch(Rectangle((0, y - 0.35), 3.4, 0.7, facecolor=colors[b],
                                   alpha=0.45 if prow >= 0 else 0.9, edgecolor="k", linewidth=0.6))
            ax.text(1.7, y, f"CTA {cta[i]}: r{b} kv [{ks}, {ke})" + (f" -> p{prow}" if prow >= 0 else ""),
                    ha="center", va="center", fontsize=7.5)
            ax.annotate("", xy=(6.2, y_out), xytext=(3.4, y),
                        arrowprops={"arrowstyle": "->", "color": colors[b], "lw": 1.4})
            if prow >= 0:
                ax.text(3.4 + 0.25 * 2.8, y + 0.25 * (y_out - y), f"#{position[prow]}",
                        ha="center", va="center",
                        fontsize=7, bbox={"boxstyle": "circle,pad=0.15", "facecolor": "white",
                                          "edgecolor": colors[b]})
    ax.set_xlim(-0.1, 8.9)
    ax.set_ylim(-len(order) + 0.4, 0.6)
    ax.set_axis_off()
    ax.set_title("work items -> output rows (#k: merge position, 0 = first)", fontsize=10)


fig, (ax_d, ax_m) = subplots(1, 2, figsize=(12.5, 4.6), gridspec_kw={"width_ratios": [2.2, 1]})
draw_reduction_diagram(fig6, ax_d)
fig6.plot_reduction_map(ax=ax_m, title="the same map as a matrix (plan.plot_reduction_map)")
fig.suptitle(f"reduction map of a {fig6.batch_size}-request decode batch on {fig6.num_ctas} CTAs",
             fontsize=11)
save_figure(fig, "06_reduction_map.png")
show(fig)

# %% [markdown]
# ### 3b. Why no atomics
#
# There is an obvious alternative to a reduction map: every CTA that finishes a chunk adds its
# weighted partial output into the output row with `atomicAdd`. ⊕ is associative and commutative
# (lesson 01), so mathematically the order does not matter. In float32 it does: `(a + b) + c`
# and `a + (b + c)` are rounded differently, and with atomics the order is whichever CTA happened
# to finish first, which changes from run to run. The same input would give different bits.
#
# We take request 0 of section 1 (its chunks from `lpt_plan`), random queries, keys and values,
# and compute each chunk's partial state, stored in float32 as the kernel stores it. Then we
# merge the partials the way the kernel's merge step does (weights relative to the largest
# LSE, a running numerator and denominator in float32), once in the map's order and once in
# every other order in which the chunks could arrive.


# %%
def merge_f32(o, lse, orders):
    """Merge float32 partial states o [n, H, D], lse [n, H] summing in each of `orders` [k, n].

    The largest LSE is found first (a max is exact in any order); then weights exp(lse - max)
    and num += w * o, den += w in the given order, one float32 rounding per step.
    """
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    w = np.exp(lse - lse.max(axis=0))
    num = np.zeros((len(orders), *o.shape[1:]), dtype=np.float32)
    den = np.zeros((len(orders), *lse.shape[1:]), dtype=np.float32)
    for step in range(orders.shape[1]):
        i = orders[:, step]
        num += w[i][..., None] * o[i]
        den += w[i]
    return num / den[..., None]


D = 64
req0 = chunks_of[0]
q0 = rng.standard_normal((1, HQ, D))
k0 = rng.standard_normal((int(kv_lens[0]), HKV, D))
v0 = rng.standard_normal((int(kv_lens[0]), HKV, D))
states = [reference.attention_state(q0, k0[s:e], v0[s:e]) for s, e in req0]
part_o = np.stack([st[0][0] for st in states]).astype(np.float32)  # [n, H, D]
part_lse = np.stack([st[1][0] for st in states]).astype(np.float32)  # [n, H]
exact, _ = reference.attention_state(q0, k0, v0)  # float64, all keys at once

n = len(req0)
orders = np.array(list(itertools.permutations(range(n))))  # orders[0] = the map's order
merged = merge_f32(part_o, part_lse, orders)  # [n!, H, D]
bits = merged.view(np.uint32).reshape(len(orders), -1)
fixed = merge_f32(part_o, part_lse, np.tile(np.arange(n), (100, 1)))  # map order, 100 times
distinct_results = np.unique(bits, axis=0).shape[0]
differs = (bits != bits[0]).sum(axis=1)  # elements whose bits differ from the map order's
per_element = np.array([np.unique(col).size for col in bits.T]).reshape(HQ, D)
rel = np.abs(merged - exact[0]).max(axis=(1, 2)) / np.abs(exact[0]).max()
print(f"{n} partial states, {len(orders)} merge orders -> {distinct_results} different float32 "
      f"results;\nan order differs from the map order in up to {differs.max()} of {bits.shape[1]} "
      f"elements, by up to {np.abs(merged - merged[0]).max():.1e}")
print(f"error against float64: map order {rel[0]:.1e}, best order {rel.min():.1e}, "
      f"worst {rel.max():.1e}")
print("map order merged 100 times ->", np.unique(fixed.view(np.uint32), axis=0).shape[0], "result")
assert np.array_equal(fixed[0].view(np.uint32), merged[0].view(np.uint32))
assert np.unique(fixed.view(np.uint32).reshape(100, -1), axis=0).shape[0] == 1
assert distinct_results > 1 and differs.max() > 0
index_of = {tuple(o): i for i, o in enumerate(orders.tolist())}
twin = np.array([index_of[(o[1], o[0], *o[2:])] for o in orders.tolist()])
assert np.array_equal(bits, bits[twin])  # 0 + a + b == 0 + b + a exactly: twins agree ...
assert distinct_results == len(orders) // 2  # ... and here every other pair of orders differs
assert rel[0] > rel.min()  # the map's order is not the most accurate one, just a fixed one
assert rel.max() < 1e-6  # every order is accurate; they just disagree in the last bits

# %% [markdown]
# Orders that only swap the first two partials agree (the first addition is to an exact zero,
# so `0 + a + b` and `0 + b + a` are both exactly `a + b`); apart from that, every order gave
# its own result. Every order is equally accurate (all within float32 rounding of the float64
# answer, and the map's order is not the best of them). What the fixed order buys is *reproducibility*:
# the same partials always give the same bits. In nbinfer's decode kernel the CTA that finishes
# the last chunk of a split row merges the whole list, reading the partials in the map's order,
# so it does not matter which CTA that is. The atomics left in the kernels are all on integers:
# a counter that elects that CTA (in the fused-merge epilogues: one counter per split row of a
# decode item, one per row of a prefill tile), and in the tensor-core kernel's guarded twin a
# bitwise OR that marks which keys of a shared-memory tile hold a non-finite V. Integer addition
# and OR are exact, so their order changes nothing. We check that in the kernels' source:

# %%
atomics = {mod.__name__.rsplit(".", 1)[-1]: re.findall(r"cuda\.atomic\.(\w+)\((\w+)",
                                                        inspect.getsource(mod))
           for mod in (decode_kernels, prefill_kernels, prefill_mma_kernels, fused_merge_kernels)}
print("atomic operations per kernel module:", atomics)
assert atomics == {"decode": [], "prefill": [], "prefill_mma": [("or_", "bad_keys")],
                   "fused_merge": [("add", "counters"), ("add", "counters")]}

# %%
fig, (ax_h, ax_e) = subplots(1, 2, figsize=(11.5, 3.4), gridspec_kw={"width_ratios": [1, 1.6]})
ax_h.hist(differs, bins=np.linspace(0, bits.shape[1], 33), color="C1")
ax_h.set_xlabel(f"output elements (of {bits.shape[1]}) whose bits differ from the map order")
ax_h.set_ylabel(f"merge orders (of {len(orders)})")
ax_h.set_title(f"{n} partial states merged in every order (float32)", fontsize=10)
image = ax_e.imshow(per_element, aspect="auto", cmap="magma_r", interpolation="nearest",
                    vmin=1, vmax=max(2, per_element.max()))
fig.colorbar(image, ax=ax_e, label="distinct float32 values")
ax_e.set_xlabel("head dimension")
ax_e.set_ylabel("query head")
ax_e.set_yticks(range(HQ))
ax_e.set_title("with atomics, an output element could be any of these; the map fixes one",
               fontsize=10)
save_figure(fig, "06_merge_order.png")
show(fig)

# %% [markdown]
# ## 4. The real kernel, in the simulator
#
# `BatchDecodeWithPagedKVCacheWrapper.plan()` calls `scheduler.plan` and copies the result into
# the wrapper's own plan memory (`wrapper.schedule` is that Plan); `run()` launches the
# persistent decode kernel, in which CTA `c` walks its queue and the last CTA of a split row
# merges the row's partials (kept in the workspace) in the map's order (one launch, no separate
# merge kernel). With `backend="auto"` and no GPU it runs in Numba's CUDA simulator, which
# executes every CUDA thread as an OS thread: slow, so the shapes are tiny (head_dim 64, two
# requests of 20 and 150 tokens, float32).
#
# Two simulator facts shape the example. The persistent grid there has `persistent_ctas("sim")`
# CTAs, and adaptive chunks are at least `MIN_CHUNK` tokens (the granule: shorter chunks cost
# more in merge traffic than they gain), so requests this short are never split on their own.
# `fixed_split_size=64` forces 64-token chunks so that the in-kernel merge runs.

# %%
SIM_HQ, SIM_HKV, SIM_D, PAGE = 4, 1, 64, 16
sim_lens = np.array([20, 150])
pt = PageTable.from_kv_lens(sim_lens, PAGE, num_pages=24, rng=rng)
cache = rng.standard_normal((pt.num_pages, 2, PAGE, SIM_HKV, SIM_D)).astype(np.float32)
q = rng.standard_normal((sim_lens.size, SIM_HQ, SIM_D)).astype(np.float32)
sim_ctas = persistent_ctas("sim")
print(f"simulator grid: {sim_ctas} CTAs, adaptive chunks >= {MIN_CHUNK} tokens")


def decode(page_table, cache, q, **plan_kw):
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD", backend="auto")
    w.plan(page_table.indptr, page_table.indices, page_table.last_page_len, SIM_HQ, SIM_HKV, SIM_D,
           PAGE, q_data_type="float32", **plan_kw)
    return w, *w.run(q, cache, return_lse=True)


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


adaptive = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD", backend="auto")
adaptive.plan(pt.indptr, pt.indices, pt.last_page_len, SIM_HQ, SIM_HKV, SIM_D, PAGE,
              q_data_type="float32")  # plan only: CPU work, no launch
assert adaptive.schedule.num_merge_rows == 0  # nothing split without fixed_split_size

w1, out1, lse1 = decode(pt, cache, q, fixed_split_size=64)
plan1 = w1.schedule
print(plan1.summary(max_items=12))
ref, ref_lse = reference.batch_decode_with_paged_kv_cache(q, cache, pt.indptr, pt.indices,
                                                          pt.last_page_len, return_lse=True)
print(f"kernel vs float64 reference: relative error {rel_err(out1, ref):.1e}, "
      f"max LSE error {np.abs(lse1 - ref_lse).max():.1e}")
assert plan1.num_ctas == sim_ctas and plan1.num_merge_rows == 1  # request 1 is split
assert plan1 == scheduler.plan(np.arange(3), sim_lens, SIM_HQ, SIM_HKV, sim_ctas,
                               granule=plan1.granule, fixed_split_size=64)
assert rel_err(out1, ref) <= 2e-5  # the test suite's float32 tolerance
np.testing.assert_allclose(lse1, ref_lse, atol=1e-5)

# %% [markdown]
# **Same lengths, same plan, same bits.** Now a second step with the same lengths, but
# everything else new: a fresh wrapper and workspace, and a freshly allocated page table whose
# pages are elsewhere in the pool (we copy the same KV into them). The plan only looks at
# lengths, so it is equal; the kernel follows the plan, so every output bit is equal too.
# Then the same data with `fixed_split_size=128`: a different plan, an equally accurate answer,
# different last bits, except for request 0, which is a single item in both plans.

# %%
pt2 = PageTable.from_kv_lens(sim_lens, PAGE, num_pages=24, rng=rng)
cache2 = np.zeros_like(cache)
for b in range(sim_lens.size):
    cache2[pt2.indices[pt2.indptr[b]:pt2.indptr[b + 1]]] = cache[pt.indices[pt.indptr[b]:pt.indptr[b + 1]]]
assert not np.array_equal(pt2.indices, pt.indices)
w2, out2, lse2 = decode(pt2, cache2, q, fixed_split_size=64)
assert w2.schedule == plan1
assert np.array_equal(out2.view(np.uint32), out1.view(np.uint32))
assert np.array_equal(lse2.view(np.uint32), lse1.view(np.uint32))
print("same lengths, other pages, other workspace: identical plan, identical output bits")

w3, out3, _ = decode(pt, cache, q, fixed_split_size=128)
changed = (out3.view(np.uint32) != out1.view(np.uint32)).reshape(sim_lens.size, -1).sum(axis=1)
print(f"fixed_split_size=128: {w3.schedule.num_work} work items instead of {plan1.num_work}; "
      f"relative error {rel_err(out3, ref):.1e}; output elements with different bits per "
      f"request: {changed.tolist()} (of {SIM_HQ * SIM_D} each)")
assert w3.schedule != plan1 and rel_err(out3, ref) <= 2e-5
assert changed[0] == 0 and np.all(changed[1:] > 0)  # request 0 is one item in both plans

# %% [markdown]
# So the bits of a request follow from how it was cut. That is what `fixed_split_size` is for
# in production (*batch invariance*): with adaptive chunks a request's cut depends on the rest
# of the batch (`L_kv` is the *batch's* total work / CTAs), hence so do its bits; with a fixed
# split size a request is cut the same way whatever else is in the batch. The planner shows it
# without running anything, on section 1's toy GPU of 8 CTAs: a 150-token request planned alone,
# and planned together with requests of 20 and 90 tokens.


# %%
def cuts(p, b):
    return sorted(p.work[p.work[:, 0] == b][:, 4].tolist())


for kw in ({}, {"fixed_split_size": 64}):
    alone = scheduler.plan(np.arange(2), [150], HQ, HKV, NUM_CTAS, granule=GRANULE, **kw)
    inside = scheduler.plan(np.arange(4), [20, 150, 90], HQ, HKV, NUM_CTAS, granule=GRANULE, **kw)
    print(f"{str(kw or 'adaptive'):24s} a request of 150 tokens alone: chunks start at "
          f"{cuts(alone, 0)}; in the batch: {cuts(inside, 1)}")
    assert (cuts(alone, 0) == cuts(inside, 1)) == bool(kw)

# %% [markdown]
# ## Summary
#
# * `plan()` is a few NumPy lines on the CPU: query tile `T_q` from `mean(qo_len) x G`, KV chunk
#   `L_kv` = total work / CTAs (rounded to a granule, equal chunks per request), LPT assignment
#   with cost `alpha * l_q + beta * l_kv`, and a reduction map.
# * Chunking makes balance *possible* (no item is bigger than one CTA's fair share); LPT makes it
#   *happen* (within 4/3 of optimal, often optimal); round-robin does not.
# * The reduction map fixes the merge order. Any order is equally accurate, but only a fixed one
#   is reproducible: same lengths -> same plan -> same bits.
# * Lesson 10 shows how a fixed persistent grid plus a fixed plan layout turn every
#   step-dependent decision into data, so one recorded launch (a CUDA graph) serves every step.
