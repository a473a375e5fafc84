# %% [markdown]
# # Lesson 03: composable formats
#
# Lesson 02 read a page table as one block-sparse (BSR) matrix. One matrix has one block shape,
# and its row height `Br` does two jobs at once: it says how many query rows share a block row,
# and so how many query rows one thread block serves from a single shared-memory copy of each KV
# block. FlashInfer does not pick one `Br` for a whole batch. It describes the batch with
# *several* BSR matrices over the same KV pool, each with the block shape that suits its part,
# runs the same attention kernel on each, and recombines the results with lesson 01's merge
# operator ⊕. The standard case is a shared prefix (a system prompt, a few-shot preamble) that
# many requests read.
#
# **You will learn**
#
# 1. why `Br` selects the memory tier: a KV block stored in a block row of `Br` query rows is
#    fetched from HBM once and then read `Br` times from shared memory, so the KV bytes a format
#    loads is the sum of its stored blocks, which can be computed from its index arrays;
# 2. how a radix tree's shared prefix becomes two BSR matrices over ONE page pool: a block row
#    of all queries over the prefix pages, and one row per request over its own pages. Only
#    index arrays are built; no KV byte moves;
# 3. that attending to the two parts separately and merging the two attention states with ⊕
#    gives exactly attention over each request's whole page list:
#    `MultiLevelCascadeAttentionWrapper`, run in Numba's CUDA simulator, against plain batch
#    decode and the float64 reference, with each level's state and the merge step shown;
# 4. the byte model for `B` requests that share a `P`-token prefix and have `U` tokens of their
#    own: plain paged decode reads `B (P + U)` tokens per KV head, the composed format
#    `P ceil(B G / T_q) + B U`. We derive it, check it against the index arrays and the
#    scheduler's work items, and evaluate it for the H200 benchmark configuration.
#
# The simulator part uses tiny shapes (4 requests, head_dim 64, pages of 4 tokens, float32);
# the byte model uses the real benchmark shapes, which only needs index arrays. The first cell
# picks Numba's CUDA simulator, so the lesson runs anywhere, GPU or not.

# %%
from nbinfer.lessons_tool import start_lesson

ROOT = start_lesson()  # Numba's CUDA simulator, chosen before Numba loads; the repository root

import math
import os

import numpy as np

from nbinfer import (
    BSR,
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    PageTable,
    reference,
    scheduler,
)
from nbinfer.api.decode import MIN_CHUNK, persistent_ctas
from nbinfer.api.prefill import MMA_CTAS_PER_SM, MMA_CTAS_PER_SM_CAPPED, mma_tiles
from nbinfer.formats import RadixTree
from nbinfer.kernels.prefill import PrefillSpec
from nbinfer.kernels.prefill_mma import MmaPrefillSpec
from nbinfer.scheduler.planner import TILE_Q_CHOICES
from nbinfer.variants import standard
from nbinfer.viz import plot_bsr, plot_states_merge, save_figure, show, subplots

np.set_printoptions(precision=4, suppress=True, linewidth=100)
# A fixed seed: every run draws the same data (set NBINFER_SEED to draw other data).
SEED = int(os.environ.get("NBINFER_SEED", 3))
rng = np.random.default_rng(SEED)
print("seed", SEED)
TOL_F32 = 2e-5  # relative error allowed for float32 inputs (the test suite's tolerance table)
VOCAB = 32000  # token ids are drawn from [0, VOCAB)


def ceil_div(a, b):
    return -(-a // b)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# %% [markdown]
# ## 1. `Br` is the memory-tier selector
#
# A kernel gives each block row of a BSR matrix to one thread block (CTA). The CTA walks the
# row's stored blocks; for each block it copies the block's KV slots from HBM (global memory)
# into shared memory once, and then every query row of the block row reads them there. So a
# KV block listed in a block row of `Br` query rows costs one HBM load and `Br` shared-memory
# reads. `Br` decides which tier serves the repeated reads: with `Br = 1` every query row
# fetches the block from HBM itself.
#
# Take 8 decode requests (one query row each) that share a 3-page prefix, pages of 4 slots, and
# look only at the prefix. The two BSR matrices below hold the same elements (every query row
# reads every prefix slot) with two block shapes: `(1, 4)`, eight block rows as in a plain page
# table, and `(8, 4)`, one block row for all eight queries.

# %%
toy_pages = np.array([2, 0, 1])  # the prefix's physical pages, in logical order
toy_rows, toy_ps = 8, 4
toy_shape = (toy_rows, toy_pages.size * toy_ps)
per_request = BSR(np.arange(toy_rows + 1) * toy_pages.size, np.tile(toy_pages, toy_rows),
                  (1, toy_ps), toy_shape)
one_row = BSR([0, toy_pages.size], toy_pages, (toy_rows, toy_ps), toy_shape)
for name, m in (("Br = 1", per_request), ("Br = 8", one_row)):
    reads = int(m.to_dense_mask().sum())  # (query row, KV slot) pairs: what the queries read
    loads = int(m.block_col_lens().sum())  # KV slots copied from HBM: one per stored block slot
    print(f"{name}: {m.nnz_blocks:2d} stored blocks, {loads:3d} slots loaded from HBM, "
          f"{reads} slot reads by query rows, {reads - loads:3d} of them served by a copy "
          f"already in shared memory")

np.testing.assert_array_equal(per_request.to_dense_mask(), one_row.to_dense_mask())
assert per_request.nnz_blocks == toy_rows * one_row.nnz_blocks == 24
assert per_request.block_col_lens().sum() == toy_rows * one_row.block_col_lens().sum() == 96

# %%
fig, axes = subplots(1, 2, figsize=(11, 3.6))
for ax, m, color, label in ((axes[0], per_request, "C0", "Br = 1: one block row per request"),
                            (axes[1], one_row, "C1", "Br = 8: one block row for all")):
    loads = int(m.block_col_lens().sum())
    plot_bsr(m, ax=ax, elements=True, color=color,
             col_labels=[f"P{p}" for p in range(toy_pages.size)],
             row_labels=[f"q{r}" if m.block_shape[0] == 1 else f"q{r}-q{r + m.block_shape[0] - 1}"
                         for r in range(0, toy_rows, m.block_shape[0])],
             title=f"{label}\n{m.nnz_blocks} stored blocks = {loads} KV slots loaded from HBM",
             xlabel="prefix KV slot, by physical page", ylabel="query row (request)")
fig.suptitle("the same 8 x 12 reads, two block heights: Br decides how often HBM is read",
             fontsize=11)
save_figure(fig, "03_memory_tier.png")
show(fig)

# %% [markdown]
# The elements are the same; only the bookkeeping differs, and the bookkeeping is the traffic:
# **the number of KV slots a format loads from HBM is the sum of the valid slots of its stored
# blocks** (per KV head), `BSR.block_col_lens().sum()`. That is a property of the index arrays
# alone, which is why we can count traffic below without running anything.
#
# Why not always `Br` = everything? A block row is served by one CTA, whose query rows (times
# the `G` query heads of a GQA group: FlashInfer's *packed rows*) must fit in its shared memory
# and registers. nbinfer's CUDA-core prefill kernel (fp32, the simulator sections below) holds
# a tile of `T_q = 32` packed rows (`PrefillSpec.tile_q`), its tensor-core kernel (fp16/bf16,
# the byte model of section 4) 64 (`MmaPrefillSpec.tile_q`), i.e. `T_q / G` query rows; a taller block row is
# cut into several tiles, and each tile loads the row's blocks again. And a big `Br` only pays
# off where the rows really read the same blocks, as with a shared prefix. A request's own
# tokens are read by that request alone; there `Br = 1` is right. Hence *two* matrices, each
# with its own `Br`.
#
# ## 2. A shared prefix as two BSR matrices over one page pool
#
# A serving system already knows which requests share a prefix: its radix tree of token
# sequences (SGLang's RadixAttention) stores every sequence's KV in pages of one pool, sharing
# the pages of common prefixes. `nbinfer.formats.RadixTree` is that tree, page-granular. We
# serve four requests the way a server does: look up the longest cached prefix (`match`), give
# the rest fresh pages from a shuffled free list (a pool that has been in use for a while), and
# `insert`. All four start with the same 12-token prompt (3 pages of 4), then have 1-9 tokens of
# their own. Each request's first own token is different, so their paths split right after the
# prompt.

# %%
PS, POOL = 4, 20  # page size (tokens) and physical pages in the pool
PREFIX_LEN = 12
assert PREFIX_LEN % PS == 0, "the tree shares whole pages only"


def serve(tree, prefix, own_lens, free, rng):
    """Insert one sequence per request: the shared prefix, then own tokens; return them."""
    seqs = []
    for b, u in enumerate(own_lens):
        # The first own token (VOCAB + b) is unique to the request: paths split after the prefix.
        toks = np.concatenate([prefix, [VOCAB + b], rng.integers(0, VOCAB, int(u) - 1)])
        _, cached = tree.match(toks)  # pages the tree already holds for a prefix of toks
        fresh = [free.pop() for _ in range(ceil_div(toks.size, tree.page_size) - cached.size)]
        tree.insert(toks, np.concatenate([cached, fresh]).astype(np.int64))
        seqs.append(toks)
    return seqs


tree = RadixTree(PS)
own_lens = rng.integers(1, 10, size=4)
free_pages = list(rng.permutation(POOL))
seqs = serve(tree, rng.integers(0, VOCAB, PREFIX_LEN), own_lens, free_pages, rng)
levels = tree.cascade_levels(seqs)  # decode: one query per request
B = len(seqs)
print("own tokens per request:", own_lens, " free pages left:", len(free_pages))
for lvl in range(levels.num_levels):
    print(f"level {lvl}: qo_indptr {levels.qo_indptr_arr[lvl]}, "
          f"kv_indptr {levels.paged_kv_indptr_arr[lvl]}, "
          f"kv_indices {levels.paged_kv_indices_arr[lvl]}, "
          f"last_page_len {levels.paged_kv_last_page_len_arr[lvl]}")

assert len(tree) == B and levels.num_levels == 2
_, prefix_pages = tree.match(seqs[0][:PREFIX_LEN])
np.testing.assert_array_equal(levels.qo_indptr_arr[0], [0, B])  # one segment: all queries
np.testing.assert_array_equal(levels.paged_kv_indices_arr[0], prefix_pages)  # listed once
np.testing.assert_array_equal(levels.qo_indptr_arr[1], np.arange(B + 1))  # one per request
assert set(levels.paged_kv_indices_arr[0]).isdisjoint(levels.paged_kv_indices_arr[1])

# %% [markdown]
# `cascade_levels` turned the tree into FlashInfer's multi-level cascade arguments: per level a
# `qo_indptr` (which query rows form a segment) and a page table with one entry per segment.
# Level 0 has one segment holding all four queries, with the prompt's 3 pages; level 1 has one
# segment per request, with its own pages and its `last_page_len`. (Requests may be reordered
# so that those below a tree node are adjacent; `levels.rows` maps back. Here the order is
# already right.)
#
# The plain page table of the same batch is what the tree returns for each whole sequence
# (`lookup`). The claim that *nothing is copied* is checked page by page: for every request,
# level 0's pages followed by its level-1 pages are exactly its plain page list, the same
# physical page ids in the same pool, with the same fill of the last page.

# %%
plain_lists = [tree.lookup(s) for s in seqs]
plain = PageTable(np.concatenate([[0], np.cumsum([p.size for p in plain_lists])]),
                  np.concatenate(plain_lists),
                  [s.size - (p.size - 1) * PS for s, p in zip(seqs, plain_lists, strict=True)],
                  PS, POOL)
print(plain, " kv_lens", plain.kv_lens())
row_of = np.argsort(levels.order)  # level-1 segment of each request
for b in range(B):
    s = row_of[b]
    own = levels.paged_kv_indices_arr[1][levels.paged_kv_indptr_arr[1][s]:
                                         levels.paged_kv_indptr_arr[1][s + 1]]
    print(f"request {b}: plain {plain_lists[b]} = level 0 {levels.paged_kv_indices_arr[0]} "
          f"+ level 1 {own}")
    np.testing.assert_array_equal(np.concatenate([levels.paged_kv_indices_arr[0], own]),
                                  plain_lists[b])
    assert levels.paged_kv_last_page_len_arr[1][s] == plain.last_page_len[b]
np.testing.assert_array_equal(levels.rows, np.arange(B))  # requests kept their order

used = np.unique(np.concatenate(levels.paged_kv_indices_arr))
assert used.max() < POOL  # every level indexes the one pool
assert used.size == prefix_pages.size + ceil_div(own_lens, PS).sum()  # prompt stored once
assert used.size + len(free_pages) == POOL  # and nothing else was allocated
assert plain.indices.size == used.size + (B - 1) * prefix_pages.size  # plain lists repeat it
level_bytes = sum(a.nbytes for arrs in (levels.qo_indptr_arr, levels.paged_kv_indptr_arr,
                                        levels.paged_kv_indices_arr,
                                        levels.paged_kv_last_page_len_arr) for a in arrs)
print(f"pool pages in use: {used.size} of {POOL}; the plain page lists name "
      f"{plain.indices.size} pages ({B} x the {prefix_pages.size} prompt pages); "
      f"the two levels' index arrays take {level_bytes} bytes")

# %% [markdown]
# The radix tree (left: each box is a node with its pages, `+ p<id>(<n>)` a partly filled last
# page with `n` tokens) and `CascadeLevels.plot` (right: query rows x the pages they read,
# coloured by the level that reads them).

# %%
fig, (ax_tree, ax_lv) = subplots(1, 2, figsize=(12, 3.6), gridspec_kw={"width_ratios": [1.2, 1]})
tree.plot(ax=ax_tree)
levels.plot(ax=ax_lv)
ax_lv.set_yticks(range(B), labels=[f"request {b}" for b in levels.order], fontsize=8)
save_figure(fig, "03_radix_cascade.png")
show(fig)

# %% [markdown]
# Now the two levels as BSR matrices, drawn element by element over the *same* columns: the
# physical KV slots of the pool, grouped by page. The kernel processes a level in query tiles
# of up to `T_q / G` rows: with `G = 4` query heads per KV head and `T_q = 32` that is 8 rows,
# more than our 4 requests, so level 0 is a single block row with `Br = 4`: one tile per KV
# head, every prefix page loaded once. Level 1 has `Br = 1`. On top, for comparison, the
# plain page table (lesson 02), whose rows each list the prompt pages again.
#
# The helper `tile_bsr` writes one level as the BSR its kernel walks: one block row per query
# tile, listing the segment's pages. Its `block_col_lens().sum()` is the level's KV traffic in
# tokens per KV head.

# %%
HQ, HKV, D = 8, 2, 64  # tiny shapes for the simulator: GQA group G = 4
G = HQ // HKV
T_Q = PrefillSpec(D, G, PS, "float32", "float32", "NHD", standard()).tile_q
TILE_ROWS = T_Q // G


def tile_bsr(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size, num_pages,
             tile_rows):
    """One level's page table as the BSR its kernel walks: a segment of n query rows becomes
    ceil(n / tile_rows) block rows (query tiles, the last one possibly partial), each listing
    the segment's pages. Block shape (tile_rows, page_size); rows are tile slots."""
    qo_lens = np.diff(np.asarray(qo_indptr))
    seg = np.repeat(np.arange(qo_lens.size), ceil_div(qo_lens, tile_rows))
    pages = [np.asarray(kv_indices)[kv_indptr[s]:kv_indptr[s + 1]] for s in seg]
    indptr = np.concatenate([[0], np.cumsum([p.size for p in pages], dtype=np.int64)])
    return BSR(indptr, np.concatenate([np.zeros(0, np.int64), *pages]), (tile_rows, page_size),
               (seg.size * tile_rows, num_pages * page_size),
               last_block_len=np.asarray(kv_last_page_len)[seg])


def level_tables(lv):
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of every level."""
    return list(zip(lv.qo_indptr_arr, lv.paged_kv_indptr_arr, lv.paged_kv_indices_arr,
                    lv.paged_kv_last_page_len_arr, strict=True))


def rows_per_tile(qo_indptr, tile_rows):
    """The scheduler's rule: a tile has tile_rows query rows, but never more than the longest
    segment (so decode gets tiles of 1 row)."""
    return max(1, min(tile_rows, int(np.diff(np.asarray(qo_indptr)).max())))


level_bsr = [tile_bsr(*t, PS, POOL, rows_per_tile(t[0], TILE_ROWS)) for t in level_tables(levels)]
plain_bsr = plain.to_bsr()
for name, m in (("plain", plain_bsr), ("level 0", level_bsr[0]), ("level 1", level_bsr[1])):
    print(f"{name:8s} {m}: {int(m.block_col_lens().sum())} KV tokens loaded per KV head")

assert (T_Q, TILE_ROWS) == (32, 8) and B <= TILE_ROWS
assert level_bsr[0].block_shape == (B, PS) and level_bsr[0].num_block_rows == 1
assert level_bsr[1].block_shape == (1, PS) and level_bsr[1].num_block_rows == B
# Element by element, the two levels together are the plain matrix, and they do not overlap.
mask0, mask1 = level_bsr[0].to_dense_mask(), level_bsr[1].to_dense_mask()
assert not np.any(mask0 & mask1)
np.testing.assert_array_equal(mask0 | mask1, plain_bsr.to_dense_mask())
# Traffic: the plain table loads the prompt once per request, level 0 once for all.
plain_tokens = int(plain_bsr.block_col_lens().sum())
level_tokens = [int(m.block_col_lens().sum()) for m in level_bsr]
assert plain_tokens == B * PREFIX_LEN + own_lens.sum() == plain.kv_lens().sum()
assert level_tokens == [PREFIX_LEN, own_lens.sum()]

# %%
fig, axes = subplots(3, 1, figsize=(13, 5.6))
page_labels = [f"P{p}" for p in range(POOL)]
request_labels = [f"request {b}" for b in range(B)]
panels = [
    (plain_bsr, "C0", request_labels,
     f"plain page table, Br = 1: each request lists the prompt pages again "
     f"({plain_tokens} tokens loaded per KV head)"),
    (level_bsr[0], "C1", [f"all {B}\nrequests"],
     f"level 0 (shared prompt), Br = {B}: one block row, one tile "
     f"({level_tokens[0]} tokens loaded)"),
    (level_bsr[1], "C2", request_labels,
     f"level 1 (own tokens), Br = 1: one block row per request ({level_tokens[1]} tokens loaded)"),
]
for ax, (m, color, labels, title) in zip(axes, panels, strict=True):
    plot_bsr(m, ax=ax, elements=True, color=color, row_labels=labels, col_labels=page_labels,
             title=title, xlabel="", ylabel="")
fig.suptitle("a shared prompt as two BSR matrices over one page pool: new index arrays, "
             "no KV copied\n(columns: the physical KV slots of the ONE pool, grouped by page, "
             "the same in every panel)", fontsize=11)
save_figure(fig, "03_two_bsr_one_pool.png")
show(fig)

# %% [markdown]
# ## 3. The merge that recombines them
#
# Level 0 gives each query an attention state `(O_0, LSE_0)` over the prompt's keys, level 1 a
# state `(O_1, LSE_1)` over its own keys. The two key sets are disjoint and together are the
# request's whole sequence, so lesson 01's operator gives attention over the whole sequence:
#
# $$\mathrm{LSE} = \log\left(e^{\mathrm{LSE}_0} + e^{\mathrm{LSE}_1}\right), \qquad
# O = e^{\mathrm{LSE}_0 - \mathrm{LSE}}\, O_0 + e^{\mathrm{LSE}_1 - \mathrm{LSE}}\, O_1 .$$
#
# `MultiLevelCascadeAttentionWrapper` does exactly this over the same cache. By default it runs
# every level in one launch of the prefill tile kernel (`cascade.one_launch`), whose fused merge
# applies ⊕ to each query's states from both levels; where the masks need it, it plans one
# prefill per level, runs each with `return_lse` and merges the results with
# `merge_state_in_place`. We run it in the simulator on a fresh float32 cache (NHD layout) and
# compare it with plain batch decode over each request's full page list, once with nbinfer's
# decode kernel (also in the simulator) and once with the float64 reference. The values are
# drawn positive (uniform on [0.1, 1]) only so that the bars in the picture below are positive;
# nothing else depends on it.

# %%
cache = rng.standard_normal((POOL, 2, PS, HKV, D)).astype(np.float32)
cache[:, 1] = rng.uniform(0.1, 1.0, size=cache[:, 1].shape)
q = rng.standard_normal((B, HQ, D)).astype(np.float32)  # one decode query per request
cache_before = cache.copy()

cascade = MultiLevelCascadeAttentionWrapper(levels.num_levels, np.zeros(1 << 22, np.uint8), "NHD")
cascade.plan(levels.qo_indptr_arr, levels.paged_kv_indptr_arr, levels.paged_kv_indices_arr,
             levels.paged_kv_last_page_len_arr, HQ, HKV, D, PS, q_data_type="float32")
assert cascade.one_launch  # no causal mask here: both levels in one launch
out_levels, lse_levels = cascade.run(q[levels.rows], cache, return_lse=True)
out_cascade = np.empty_like(out_levels)
lse_cascade = np.empty_like(lse_levels)
out_cascade[levels.rows], lse_cascade[levels.rows] = out_levels, lse_levels  # batch order

decode = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD")
decode.plan(plain.indptr, plain.indices, plain.last_page_len, HQ, HKV, D, PS,
            q_data_type="float32")
out_decode, lse_decode = decode.run(q, cache, return_lse=True)

out_ref, lse_ref = reference.batch_decode_with_paged_kv_cache(
    q, cache, plain.indptr, plain.indices, plain.last_page_len, return_lse=True)
for name, o, s in (("cascade (2 levels, merged)", out_cascade, lse_cascade),
                   ("plain batch decode", out_decode, lse_decode)):
    print(f"{name:27s} vs float64 reference: relative error {rel_err(o, out_ref):.1e}, "
          f"max LSE error {np.abs(s - lse_ref).max():.1e}")
    assert rel_err(o, out_ref) <= TOL_F32 and np.abs(s - lse_ref).max() <= 1e-5
assert rel_err(out_cascade, out_decode) <= TOL_F32
np.testing.assert_array_equal(cache, cache_before)  # the pool was only read

# %% [markdown]
# Now the same computation in the open. Each level is an ordinary
# `BatchPrefillWithPagedKVCacheWrapper` plan over the same `cache`, with that level's
# `qo_indptr` and page table; it returns the level's states. Each state is itself exact
# attention over that level's keys (checked against the float64 reference for the level's own
# page table). The plans show the tiles: level 0 has one work item per KV head whose query rows
# are all 4 requests, level 1 one per request and KV head.

# %%
states = []
for lvl, (qo, kv_indptr, kv_indices, kv_last) in enumerate(level_tables(levels)):
    w = BatchPrefillWithPagedKVCacheWrapper(np.zeros(1 << 22, np.uint8), "NHD")
    w.plan(qo, kv_indptr, kv_indices, kv_last, HQ, HKV, D, PS, q_data_type="float32")
    o_l, lse_l = w.run(q[levels.rows], cache, return_lse=True)
    ref_o, ref_lse = reference.batch_prefill_with_paged_kv_cache(
        q[levels.rows], qo, cache, kv_indptr, kv_indices, kv_last, return_lse=True)
    assert rel_err(o_l, ref_o) <= TOL_F32 and np.abs(lse_l - ref_lse).max() <= 1e-5
    work = w.schedule.work  # the work items of the scheduler's Plan that run() executed
    print(f"level {lvl}: work items (request, kv_head, qo_start, qo_end, kv_start, kv_end, "
          f"partial_row):\n{work}")
    assert work.shape[0] == HKV * (qo.size - 1)  # one tile per segment and KV head
    np.testing.assert_array_equal(work[:, 3] - work[:, 2], np.repeat(np.diff(qo), HKV))
    states.append((o_l, lse_l))

(o0, lse0), (o1, lse1) = states
o_merged, lse_merged = reference.merge_state(o0, lse0, o1, lse1)  # lesson 01's operator
share0 = np.exp(lse0 - lse_merged)  # each level's share of the softmax mass
share1 = np.exp(lse1 - lse_merged)
by_hand = share0[..., None] * o0 + share1[..., None] * o1
np.testing.assert_allclose(share0 + share1, 1.0, rtol=1e-12)
np.testing.assert_allclose(by_hand, o_merged, rtol=1e-12, atol=1e-12)
assert rel_err(o_merged, out_levels) <= TOL_F32  # what the wrapper computed
np.testing.assert_allclose(lse_merged, lse_levels, atol=1e-5)
assert rel_err(o_merged[row_of], out_ref) <= TOL_F32
print("prompt's share of the softmax mass, per request (rows) and query head (columns):")
print(share0[row_of])

# %% [markdown]
# The merged state equals plain attention over the whole page list, output and LSE, for every
# request and head. The picture takes one request and one query head: the two level outputs
# (value channel 0), their weights in ⊕, and the merge next to the reference; on the right, the
# prompt's share of each request's softmax mass, which is all the merge needs to know.

# %%
b0, h0 = 0, 0
r0 = row_of[b0]
fig, (ax_m, ax_s) = subplots(1, 2, figsize=(11, 3.9))
plot_states_merge([o0[r0, h0, 0], o1[r0, h0, 0]], [lse0[r0, h0], lse1[r0, h0]],
                  o_merged[r0, h0, 0], ax=ax_m, labels=["level 0\nshared prompt",
                                                         "level 1\nown tokens"],
                  exact=out_ref[b0, h0, 0],
                  title=f"request {b0}, query head {h0}: two level states, one merge")
x = np.arange(B)
s0 = share0[row_of, h0]
ax_s.bar(x, s0, 0.6, color="C1", label="level 0 (shared prompt)")
ax_s.bar(x, 1 - s0, 0.6, bottom=s0, color="C2", label="level 1 (own tokens)")
for xi, (v, n) in enumerate(zip(s0, own_lens, strict=True)):
    ax_s.text(xi, v / 2, f"{v:.2f}", ha="center", va="center", color="white", fontsize=9)
    ax_s.text(xi, 1.02, f"{PREFIX_LEN}+{n} keys", ha="center", va="bottom", fontsize=8)
ax_s.set_xticks(x, labels=[f"request {b}" for b in range(B)], fontsize=8)
ax_s.set_ylim(0, 1.25)
ax_s.set_ylabel(f"share of softmax mass, head {h0}")
ax_s.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
ax_s.set_title("exp(LSE_level - LSE): the weights ⊕ gives each level", fontsize=10)
save_figure(fig, "03_merge_levels.png")
show(fig)

# %% [markdown]
# ## 4. The byte model
#
# Section 1 gave the rule: KV traffic is the valid slots of the stored blocks of the matrices a
# kernel walks, per KV head. Now apply it to `B` decode requests that share a `P`-token prefix
# and have `U` tokens each of their own, with `G` query heads per KV head and query tiles of
# `T_q` packed rows (`T_q / G` query rows).
#
# * **Plain paged decode**: one block row per request, listing all its `P + U` tokens:
#   $$\text{plain} = B\,(P + U).$$
# * **Composed (cascade)**: level 0 is one segment of `B` query rows over `P` tokens, cut into
#   tiles of `T_q / G` rows, so it is read once per tile, `ceil(B / (T_q / G)) = ceil(B G / T_q)`
#   times (when `G` divides `T_q`); level 1 is `B` block rows of `U` tokens:
#   $$\text{composed} = P \left\lceil \frac{B G}{T_q} \right\rceil + B\,U.$$
# * If one block row could hold the whole batch (`Br = B`), the prefix would be read once:
#   `P + B U`. The tile height is what stands between the two.
#
# In bytes, every token costs one K and one V row per KV head: `x H_kv x 2 x D x` bytes per
# element. The configuration is the one of the upcoming H200 benchmark: 64 requests, an
# 8192-token shared prefix, 256 own tokens each, `H_q = 32`, `H_kv = 8`, `D = 128`; fp16 KV and
# pages of 16 tokens as in `bench/decode.py`. `T_q` comes from the spec of the kernel that runs
# it there (the tensor-core prefill kernel), the grid from its CTAs per SM.

# %%
B_H200, P_H200, U_H200 = 64, 8192, 256
HQ_H200, HKV_H200, D_H200, PS_H200, KV_BYTES = 32, 8, 128, 16, 2  # fp16
G_H200 = HQ_H200 // HKV_H200
# the one-launch cascade's kernel (its tiles: nbinfer.api.prefill.CASCADE_TILES)
spec = MmaPrefillSpec(D_H200, G_H200, PS_H200, "float16", "float16", "NHD", standard(),
                      **mma_tiles(D_H200, all_split=True))
T_Q_H200 = spec.tile_q
# the H200's 132 SMs x the kernel's CTAs per SM (three under the cascade kernel's register cap)
NUM_CTAS_H200 = 132 * (MMA_CTAS_PER_SM_CAPPED if spec.max_registers else MMA_CTAS_PER_SM)
TOKEN_BYTES = HKV_H200 * 2 * D_H200 * KV_BYTES  # K + V of one token, all KV heads


def plain_model(b, p, u):
    return b * (p + u)


def composed_model(b, p, u, g, t_q):
    return p * ceil_div(b * g, t_q) + b * u


print(f"T_q = {T_Q_H200} packed rows = {spec.tile_rows} query rows x G = {G_H200}; "
      f"one token of KV = {TOKEN_BYTES} bytes")
assert T_Q_H200 == 64 and T_Q_H200 % G_H200 == 0

# %% [markdown]
# To check the formula against real index arrays, we build the benchmark's batch exactly as in
# section 2, at full size: a radix tree of 64 sequences of 8448 tokens in a pool of 1536 pages,
# then its cascade levels. Two independent counts per format:
#
# * **walk**: each level as the BSR its kernel walks (`tile_bsr`, tile height by the
#   scheduler's rule), summing `block_col_lens()`;
# * **plan**: the scheduler's actual work items for the persistent H200 grid, summing
#   `kv_end - kv_start` over all items, divided by `H_kv` (a kernel gathers each item's KV
#   range into shared memory once; lesson 04 counted the loads of the decode kernels). The
#   plan also splits long rows into KV chunks; that changes who reads what, never how much,
#   which we check by planning the same batch for a 2-CTA grid too.

# %%
def shared_prefix_batch(b, p, u, page_size, rng):
    """A radix tree holding b sequences that share p tokens and have u own tokens each."""
    num_pages = ceil_div(p, page_size) + b * ceil_div(u, page_size)
    t = RadixTree(page_size)
    s = serve(t, rng.integers(0, VOCAB, p), [u] * b, list(rng.permutation(num_pages)), rng)
    return t, s, num_pages


def plain_table(t, s, num_pages):
    lists = [t.lookup(x) for x in s]
    return PageTable(np.concatenate([[0], np.cumsum([p.size for p in lists])]),
                     np.concatenate(lists),
                     [x.size - (p.size - 1) * t.page_size for x, p in zip(s, lists, strict=True)],
                     t.page_size, num_pages)


def traffic(tables, page_size, num_pages, hq, hkv, t_q, num_ctas, granule):
    """KV tokens per KV head of a list of levels (qo_indptr, kv_indptr, kv_indices, last):
    (walked over the tile BSRs, summed over the scheduler's work items, the plans)."""
    walked = planned = 0
    plans = []
    for qo, kv_indptr, kv_indices, last in tables:
        kv_lens = reference.kv_lengths(kv_indptr, last, page_size)
        plan = scheduler.plan(qo, kv_lens, hq, hkv, num_ctas, granule=granule, tile_q=t_q)
        m = tile_bsr(qo, kv_indptr, kv_indices, last, page_size, num_pages, plan.tile_rows)
        walked += int(m.block_col_lens().sum())
        planned += int((plan.work[:, 5] - plan.work[:, 4]).astype(np.int64).sum())
        plans.append(plan)
    assert planned % hkv == 0
    return walked, planned // hkv, plans


def both_formats(b, p, u, rng, num_ctas=NUM_CTAS_H200):
    t, s, num_pages = shared_prefix_batch(b, p, u, PS_H200, rng)
    lv = t.cascade_levels(s)
    pt = plain_table(t, s, num_pages)
    plain_tables = [(np.arange(b + 1), pt.indptr, pt.indices, pt.last_page_len)]
    args = (PS_H200, num_pages, HQ_H200, HKV_H200, T_Q_H200, num_ctas, MIN_CHUNK)
    return traffic(plain_tables, *args), traffic(level_tables(lv), *args), lv, num_pages


(plain_walk, plain_plan, plain_plans), (comp_walk, comp_plan, comp_plans), lv_h200, pool_h200 = \
    both_formats(B_H200, P_H200, U_H200, rng)
plain_pred = plain_model(B_H200, P_H200, U_H200)
comp_pred = composed_model(B_H200, P_H200, U_H200, G_H200, T_Q_H200)
print(f"built and planned: {lv_h200.num_levels} levels, "
      f"pool of {pool_h200} pages")
print(f"{'tokens per KV head':20s} {'formula':>9s} {'walk':>9s} {'plan':>9s}")
print(f"{'plain decode':20s} {plain_pred:9d} {plain_walk:9d} {plain_plan:9d}")
print(f"{'composed (cascade)':20s} {comp_pred:9d} {comp_walk:9d} {comp_plan:9d}")
print(f"level 0 tiles: {comp_plans[0].tile_rows} query rows each, "
      f"{ceil_div(B_H200, comp_plans[0].tile_rows)} tiles; "
      f"level 0 work items: {comp_plans[0].num_work} (KV chunks of {comp_plans[0].kv_chunk})")

assert lv_h200.num_levels == 2 and pool_h200 == 8192 // 16 + 64 * 256 // 16
assert plain_pred == plain_walk == plain_plan
assert comp_pred == comp_walk == comp_plan
assert comp_plans[0].tile_rows == T_Q_H200 // G_H200 and comp_plans[1].tile_rows == 1
# Chunking moves work between CTAs, not bytes: the same totals on a 2-CTA grid.
(pw2, pp2, _), (cw2, cp2, _), _, _ = both_formats(B_H200, P_H200, U_H200, rng,
                                                  num_ctas=persistent_ctas("sim"))
assert (pw2, pp2, cw2, cp2) == (plain_pred, plain_pred, comp_pred, comp_pred)

# %% [markdown]
# Formula, index-array walk and scheduler plan agree. In bytes (fp16, all 8 KV heads, K and
# V), with the ideal single-block-row prefix and a taller tile for comparison: 128 packed rows
# is the largest tile the scheduler's `choose_tile_q` picks; nbinfer's tensor-core prefill
# kernel uses 64 (four warps of 16 rows, the most its 255 registers per thread allow).
#
# The model counts KV only. The plans add one more kind of traffic: rows whose KV is split into
# chunks write one partial state per chunk (float32 output and LSE for every query head), which
# the merge reads back. Counted from the plans, that is at most about an eighth of either
# format's KV bytes (an upper bound: partial states may never leave L2), more for the finer
# chunks of a larger grid.

# %%
ideal_pred = P_H200 + B_H200 * U_H200
tall_pred = composed_model(B_H200, P_H200, U_H200, G_H200, 128)
rows = [("plain paged decode", plain_pred), (f"composed, T_q = {T_Q_H200}", comp_pred),
        ("composed, T_q = 128", tall_pred), ("prefix read once (Br = B)", ideal_pred)]
for name, tokens in rows:
    print(f"{name:27s} {tokens:7d} tokens/KV head = {tokens * TOKEN_BYTES / 1e9:5.3f} GB, "
          f"{plain_pred / tokens:5.2f}x fewer than plain")
assert max(TILE_Q_CHOICES) == 128

# What the plans add on top of KV: partial states of split rows (float32 O and LSE for all
# query heads), written once and read once by the merge (at most; they may stay in L2).
for name, plans, tokens in (("plain", plain_plans, plain_pred), ("composed", comp_plans,
                                                                 comp_pred)):
    partial = sum(p.num_partials * HQ_H200 * (D_H200 + 1) * 4 * 2 for p in plans)
    share = partial / (tokens * TOKEN_BYTES)
    print(f"{name:9s} partial states: {sum(p.num_partials for p in plans):4d} rows, "
          f"<= {partial / 1e6:4.1f} MB = {100 * share:.1f} % of its KV bytes")
    assert share < 0.125

# %% [markdown]
# The figure sweeps the batch size with everything else fixed. Plain decode grows with
# `B (P + U)`; the composed format pays the prefix once per tile of 16 requests, so its curve
# steps up every 16 requests, while the ideal pays it once. The dots are index-array walks of
# radix-tree batches (like the check above), on the formula's lines. When `B` is a multiple of
# the tile's `T_q / G` rows, as 64 is, the ratio no longer depends on `B`:
# `(P + U) / (P G / T_q + U)`. A taller tile is the only way up from there.

# %%
walked_at = {}
for b in (1, 4, 8, 9, 16, 32, 64, 128):
    (pw, _, _), (cw, _, _), _, _ = both_formats(b, P_H200, U_H200, rng)
    walked_at[b] = (pw, cw)
    assert pw == plain_model(b, P_H200, U_H200)
    assert cw == composed_model(b, P_H200, U_H200, G_H200, T_Q_H200)
plateau = (P_H200 + U_H200) / (P_H200 * G_H200 / T_Q_H200 + U_H200)
for b in (T_Q_H200 // G_H200, B_H200, 256):
    assert math.isclose(plain_model(b, P_H200, U_H200) /
                        composed_model(b, P_H200, U_H200, G_H200, T_Q_H200), plateau)

fig, (ax_b, ax_r) = subplots(1, 2, figsize=(12, 4.2))
bs = np.arange(1, 257)
gb = TOKEN_BYTES / 1e9
curves = [("plain paged decode: B (P + U)", plain_model(bs, P_H200, U_H200), "C0", "-"),
          (f"composed, T_q = {T_Q_H200}: P ceil(BG/T_q) + BU",
           composed_model(bs, P_H200, U_H200, G_H200, T_Q_H200), "C1", "-"),
          ("composed, T_q = 128", composed_model(bs, P_H200, U_H200, G_H200, 128), "C1", ":"),
          ("prefix read once: P + BU", P_H200 + bs * U_H200, "C2", "--")]
for label, tokens, color, ls in curves:
    # The composed curves jump between integer B: hold each value until the next B.
    style = dict(color=color, ls=ls, lw=1.4,
                 drawstyle="steps-post" if label.startswith("composed") else "default")
    ax_b.plot(bs, tokens * gb, label=label, **style)
    if not label.startswith("plain"):  # plain / plain is 1 everywhere: no line for it
        ax_r.plot(bs, plain_model(bs, P_H200, U_H200) / tokens, label=label.split(":")[0],
                  **style)
wb = np.array(sorted(walked_at))
ax_b.scatter(wb, [walked_at[b][0] * gb for b in wb], color="C0", zorder=3, s=22,
             label="counted from the plain index arrays")
ax_b.scatter(wb, [walked_at[b][1] * gb for b in wb], color="C1", zorder=3, s=22,
             label="counted from the composed index arrays")
for ax in (ax_b, ax_r):
    ax.axvline(B_H200, color="0.5", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests B sharing the prefix")
    ax.grid(True, lw=0.4, alpha=0.5)
ax_b.set_yscale("log")
ax_b.set_ylabel("KV bytes per call (GB, fp16, all KV heads)")
ax_b.set_title(f"KV traffic, P = {P_H200}, U = {U_H200}, H_kv = {HKV_H200}, D = {D_H200}",
               fontsize=10)
ax_b.legend(fontsize=7, frameon=False)
ax_r.axhline(1, color="0.6", lw=0.8)
ax_r.set_ylabel("plain bytes / format bytes (1 = no saving)")
ax_r.set_title(f"predicted byte reduction (benchmark: B = {B_H200}, dashed line)", fontsize=10)
ax_r.plot([B_H200], [plain_pred / comp_pred], "o", color="C1", ms=5)
ax_r.annotate(f"{plain_pred / comp_pred:.1f}x at B = {B_H200}", (B_H200, plain_pred / comp_pred),
              xytext=(8, -30), textcoords="offset points", fontsize=9, color="C1",
              ha="left", va="top", arrowprops=dict(arrowstyle="-", color="C1", lw=0.8))
ax_r.legend(fontsize=7, frameon=False)
save_figure(fig, "03_byte_model.png")
show(fig)

# %% [markdown]
# The byte model's prediction for the benchmark case, and what follows from it without any
# timing: both formats do the same arithmetic (every query head scores every key of its request
# once, `4 H_q D` FLOPs per token), so the arithmetic intensity grows by the same factor as the
# bytes shrink, starting from the GQA group `G` for plain fp16 decode.

# %%
flops = 4 * HQ_H200 * D_H200 * B_H200 * (P_H200 + U_H200)
plain_gb, comp_gb = plain_pred * TOKEN_BYTES / 1e9, comp_pred * TOKEN_BYTES / 1e9
ratio = plain_pred / comp_pred
ai_plain, ai_comp = flops / (plain_pred * TOKEN_BYTES), flops / (comp_pred * TOKEN_BYTES)
print(f"KV bytes per call: plain {plain_gb:.2f} GB, composed {comp_gb:.2f} GB -> "
      f"{ratio:.1f}x fewer")
print(f"FLOPs {flops / 1e9:.2f} G (both); intensity plain {ai_plain:.1f}, "
      f"composed {ai_comp:.1f} FLOP/byte")
assert ai_plain == G_H200 and math.isclose(ai_comp, G_H200 * ratio)
# The numbers quoted in the last cell:
assert (f"{plain_gb:.2f}", f"{comp_gb:.2f}", f"{ratio:.1f}") == ("2.21", "0.20", "11.0")
assert (f"{plain_pred / ideal_pred:.0f}", f"{ai_comp:.0f}") == ("22", "44")

# %% [markdown]
# ## Summary
#
# * `Br` is the memory-tier selector: a KV block in a block row of `Br` query rows is loaded
#   from HBM once and read `Br` times from shared memory. A format's KV traffic is therefore the
#   sum of its stored blocks' valid slots, a property of its index arrays.
# * A shared prefix and the requests' own tokens are two BSR matrices over ONE page pool: a
#   block row of all queries over the prefix pages (large `Br`), and a row per request over its
#   own pages (`Br = 1`). A radix tree already knows the split; `cascade_levels` only writes
#   index arrays, and each request's levels concatenate to its plain page list.
# * Each level yields attention states; lesson 01's ⊕ merges them into exactly the attention
#   over the whole sequence (`MultiLevelCascadeAttentionWrapper` = plain decode = reference, to
#   float32 rounding); in nbinfer both levels run in one kernel launch, whose CTAs merge the
#   states (on the tensor-core kernel a short launch after it does).
# * Byte model: plain decode reads `B (P + U)` tokens per KV head, the composed format
#   `P ceil(B G / T_q) + B U`; formula, index-array walk and scheduler plan agree. For the
#   benchmark case that is 11x fewer bytes with the tensor-core tile (`T_q = 64`).
#
# What the H200 measured for this configuration (`bench/results/issue13/session11/call4/
# cascade_sweep.json` and `call5/`: 5.1-5.2x faster than plain decode replayed from a CUDA
# graph, 4.5-4.7x per Python call, against the 11x the bytes allow) and why is in
# `bench/NOTES.md` ("One-launch cascade, measured", "Lesson 03's reading of the measurement",
# "Issue 13, session 8" and "session 11"); lesson 07 places the cascade on the roofline beside
# decode and prefill.
