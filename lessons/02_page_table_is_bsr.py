# %% [markdown]
# # Lesson 02: a page table is a block-sparse matrix
#
# Serving systems do not keep a request's keys and values in one contiguous buffer. They cut a
# big KV pool into fixed-size *pages* and hand pages out as requests grow, like an operating
# system hands out memory pages; a *page table* records which physical pages hold each
# request's tokens, in order. FlashInfer's first idea is to read that page table as a
# block-sparse matrix, so that one attention kernel that walks block-sparse rows serves paged
# caches, ragged batches, shared prefixes and custom masks alike.
#
# **You will learn**
#
# 1. the three arrays of a FlashInfer page table (`kv_indptr`, `kv_indices`,
#    `kv_last_page_len`) and what they say about a batch;
# 2. that the same three arrays *are* a BSR matrix (block compressed sparse row) whose rows are
#    requests and whose block columns are physical pages: nothing is converted or copied;
# 3. what the block shape `(Br, Bc)` means: `Bc` is the page size (chosen by the memory
#    manager, so the kernel must accept any value) and `Br` the number of query rows that share
#    a block row; `(1, 1)` is token-level sparsity;
# 4. how a ragged batch of queries (8, 4 and 4 new tokens, as in the paper's Figure 2) becomes
#    block rows of `Br = 4` query tokens;
# 5. that attention through the page table equals dense attention over each request's gathered
#    keys, and that page table -> BSR -> page table loses nothing.

# %%
import numpy as np

from nbinfer import reference
from nbinfer.formats import BSR, PageTable
from nbinfer.variants import causal
from nbinfer.viz import plot_bsr, plot_page_table, save_figure, show, subplots

np.set_printoptions(linewidth=100)
rng = np.random.default_rng(7)

# %% [markdown]
# ## 1. A paged batch
#
# Three requests hold 13, 6 and 9 tokens of KV cache. Pages have 4 slots, so they need 4, 2 and
# 3 pages; the last page of each request is only partly filled (1, 2 and 1 tokens). The pool
# has 12 physical pages, and an allocator that has been running for a while hands out whatever
# pages are free, so each request's pages are scattered over the pool in no particular order.

# %%
page_size, num_pages = 4, 12
kv_lens = np.array([13, 6, 9])
pt = PageTable.from_kv_lens(kv_lens, page_size, num_pages=num_pages, rng=rng)
print(pt)
print("kv_indptr        =", pt.indptr)
print("kv_indices       =", pt.indices)
print("kv_last_page_len =", pt.last_page_len)
for b in range(pt.batch_size):
    print(f"request {b}: pages {pt.indices[pt.indptr[b]:pt.indptr[b + 1]]}, "
          f"{pt.kv_lens()[b]} tokens")

assert list(pt.indptr) == [0, 4, 6, 9]
assert list(pt.last_page_len) == [1, 2, 1]
np.testing.assert_array_equal(pt.kv_lens(), kv_lens)
assert len(set(pt.indices.tolist())) == pt.indices.size  # no page is given out twice
assert not np.all(np.diff(pt.indices) > 0)  # scattered, not one contiguous run

# %% [markdown]
# Reading the arrays: request `b` owns `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`, in logical
# order (its first page holds tokens 0-3, its second tokens 4-7, ...). Its length is
# `(pages - 1) * page_size + kv_last_page_len[b]`. The picture shows both sides of the mapping:
# each request's logical pages (top), and the physical pool they land in (bottom).

# %%
fig = plot_page_table(pt, title="a paged KV cache: 3 requests, page size 4, 12 physical pages")
save_figure(fig, "02_page_table.png")
show(fig)

# %% [markdown]
# ## 2. The same arrays, read as a BSR matrix
#
# Draw a matrix with one row per request and one column per physical KV slot (12 pages x 4 slots
# = 48 columns). Put a 1 where a request's query must read a slot. Cut the columns into blocks of
# `Bc = page_size` slots: a block column *is* a physical page, and row `b` has exactly one
# stored block per page in its page list. In BSR terms:
#
# | BSR array | page table array |
# |---|---|
# | `indptr` (where each block row's blocks start) | `kv_indptr` |
# | `indices` (block column of each stored block) | `kv_indices` |
# | valid columns of each row's last block | `kv_last_page_len` |
#
# So `PageTable.to_bsr()` only attaches a block shape and a matrix shape to the arrays it
# already has. The kernel never sees "a page table"; it sees block rows to walk.

# %%
bsr = pt.to_bsr()
print(bsr)
print("indptr  =", bsr.indptr)
print("indices =", bsr.indices)
occupancy = bsr.to_dense()  # [requests, physical pages]
print("block occupancy (rows = requests, columns = physical pages P0..P11):")
print(occupancy.astype(int))

np.testing.assert_array_equal(bsr.indptr, pt.indptr)
np.testing.assert_array_equal(bsr.indices, pt.indices)
assert bsr.block_shape == (1, page_size) and bsr.shape == (3, num_pages * page_size)
assert bsr.nnz_blocks == pt.indices.size == 9
for b in range(pt.batch_size):
    owned = set(pt.indices[pt.indptr[b]:pt.indptr[b + 1]].tolist())
    assert set(np.flatnonzero(occupancy[b]).tolist()) == owned
assert not occupancy.any(axis=0).all()  # free pages are empty columns: never loaded

# %% [markdown]
# The figure is this lesson's version of the paper's Figure 2. Filled cells are pages a request
# reads, with the number of valid tokens inside; empty cells are not stored zeros, they are
# simply absent from `indices`, so no thread block ever loads them.

# %%
fig = plot_bsr(bsr, title="page table as BSR: rows = requests, block columns = physical pages",
               row_labels=[f"request {b}" for b in range(pt.batch_size)],
               col_labels=[f"P{p}" for p in range(num_pages)],
               xlabel="physical KV page (Bc = page size = 4 slots)",
               ylabel="request (Br = 1 query row)", figsize=(8.5, 2.8))
save_figure(fig, "02_page_table_bsr.png")
show(fig)

# %% [markdown]
# How much does the description cost? The index arrays are a few dozen bytes, while the KV pool
# they point into is (even for this toy with 2 KV heads of dimension 8 in float64) kilobytes; in a
# real model it is gigabytes. A new layout is a new set of index arrays over the same bytes.

# %%
num_kv_heads, num_qo_heads, head_dim = 2, 4, 8
kv_pool = rng.standard_normal((num_pages, 2, page_size, num_kv_heads, head_dim))  # NHD
index_bytes = bsr.indptr.nbytes + bsr.indices.nbytes + pt.last_page_len.nbytes
print(f"index arrays: {index_bytes} bytes, KV pool: {kv_pool.nbytes} bytes")
assert index_bytes < kv_pool.nbytes / 100

# %% [markdown]
# ## 3. Choosing the block shape `(Br, Bc)`
#
# `Bc` is not the kernel's choice: the memory manager picked the page size. Page size 1 is the
# extreme case, *token-level* (vector) sparsity, where every KV slot is its own block and any set
# of tokens can be selected. The same batch described at token level is a page table with
# `page_size = 1` whose indices are the physical slot numbers of the tokens.
#
# Both describe exactly the same set of (request, slot) pairs, as the element masks show. The
# page-level BSR needs one index per page, the token-level one an index per token: coarser blocks
# mean less bookkeeping and longer contiguous loads, finer blocks can express any selection. A
# kernel that gathers KV into shared memory before computing (a later lesson) runs dense
# tensor-core math on the gathered tile either way, which is why FlashInfer accepts any `Bc`.

# %%
slots = [pt.token_slots(b) for b in range(pt.batch_size)]
token_pt = PageTable(indptr=np.concatenate([[0], np.cumsum(kv_lens)]),
                     indices=np.concatenate(slots), last_page_len=np.ones(3, dtype=np.int32),
                     page_size=1, num_pages=num_pages * page_size)
token_bsr = token_pt.to_bsr()
print(f"page level  {bsr.block_shape}: {bsr.nnz_blocks} stored blocks")
print(f"token level {token_bsr.block_shape}: {token_bsr.nnz_blocks} stored blocks")
print("request 0's slots:", slots[0])

np.testing.assert_array_equal(token_bsr.to_dense_mask(), bsr.to_dense_mask())
assert token_bsr.nnz_blocks == kv_lens.sum() == 28
for b in range(pt.batch_size):  # element mask row b = exactly request b's token slots
    np.testing.assert_array_equal(np.flatnonzero(bsr.to_dense_mask()[b]), np.sort(slots[b]))

# %%
fig, (ax_page, ax_tok) = subplots(2, 1, figsize=(13, 4.6))
labels = [f"request {b}" for b in range(pt.batch_size)]
plot_bsr(bsr, ax=ax_page, elements=True, row_labels=labels,
         col_labels=[f"P{p}" for p in range(num_pages)],
         title=f"page level, (Br, Bc) = (1, {page_size}): {bsr.nnz_blocks} blocks "
               "(pale = unused slots of partly filled last pages)",
         xlabel="physical KV slot, grouped by page", ylabel="")
plot_bsr(token_bsr, ax=ax_tok, elements=True, row_labels=labels,
         col_labels=[str(c) if c % 4 == 0 else "" for c in range(num_pages * page_size)],
         title=f"token level, (Br, Bc) = (1, 1): {token_bsr.nnz_blocks} blocks, same elements",
         xlabel="physical KV slot", ylabel="", color="C2")
fig.suptitle("one batch, two block shapes", fontsize=11)
save_figure(fig, "02_block_shapes.png")
show(fig)

# %% [markdown]
# ## 4. Attention through the page table
#
# Decode: each request has one new query token (with 4 query heads sharing 2 KV heads, grouped
# query attention). The reference engine's `batch_decode_with_paged_kv_cache` takes the query, the
# KV pool and the three page-table arrays, with FlashInfer's argument names and NHD layout
# `[num_pages, 2 (K/V), page_size, kv_heads, head_dim]`.
#
# To show that the page table alone decides what is read, we first *poison* every slot that is
# not in it (free pages and the unused tails of last pages) with huge values: a single poisoned
# key read by mistake would take all the softmax weight. The ground truth is plain dense
# attention over each request's keys, gathered in logical order with `token_slots`.

# %%
used = np.zeros(num_pages * page_size, dtype=bool)
used[np.concatenate(slots)] = True
pool_flat = kv_pool.transpose(0, 2, 1, 3, 4).reshape(num_pages * page_size, 2, num_kv_heads,
                                                     head_dim)  # [slot, K/V, heads, dim] copy
kv_pool.transpose(0, 2, 1, 3, 4)[~used.reshape(num_pages, page_size)] = 1e4  # poison in place
print(f"poisoned {np.count_nonzero(~used)} of {used.size} slots")

q = rng.standard_normal((pt.batch_size, num_qo_heads, head_dim))
o_paged, lse_paged = reference.batch_decode_with_paged_kv_cache(
    q, kv_pool, pt.indptr, pt.indices, pt.last_page_len, kv_layout="NHD", return_lse=True)

for b in range(pt.batch_size):
    k_b, v_b = pool_flat[slots[b], 0], pool_flat[slots[b], 1]  # [kv_len, kv_heads, dim]
    o_b, lse_b = reference.attention_state(q[b:b + 1], k_b, v_b)
    np.testing.assert_allclose(o_paged[b], o_b[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_paged[b], lse_b[0], rtol=1e-12)
print("paged decode == dense attention over each request's gathered keys (rtol 1e-12)")
assert np.all(np.abs(o_paged) < 10)  # no poisoned value leaked into any output

# %% [markdown]
# ## 5. Ragged queries: `Br` query rows per block row
#
# In prefill (or chunked prefill, or speculative verification) requests bring several new query
# tokens at once. FlashInfer stores them *ragged*: all query tokens of the batch packed into one
# `[total_tokens, heads, head_dim]` tensor without padding, with `qo_indptr` marking where each
# request starts, exactly like `kv_indptr`. Take 8, 4 and 4 new tokens (the last tokens of each
# request's KV, now being attended to causally), so `qo_indptr = [0, 8, 12, 16]`.
#
# With `Br = 4`, the matrix rows are now query tokens, grouped 4 to a block row. Request 0 has
# two block rows, requests 1 and 2 one each. Every block row of a request reads that request's
# pages, so the BSR repeats each request's page list once per block row. `Br` is the tile of
# queries that one thread block processes together: all 4 rows share each loaded page. (The
# causal mask *inside* a block is applied element by element by the kernel; the BSR only says
# which pages a tile must load.)

# %%
qo_lens = np.array([8, 4, 4])
qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
br = 4
assert np.all(qo_lens % br == 0), "this simple construction keeps tiles inside one request"
tile_request = np.repeat(np.arange(pt.batch_size), qo_lens // br)  # request of each block row
pages_of = [pt.indices[pt.indptr[b]:pt.indptr[b + 1]] for b in range(pt.batch_size)]
ragged_bsr = BSR(indptr=np.concatenate([[0], np.cumsum([len(pages_of[b]) for b in tile_request])]),
                 indices=np.concatenate([pages_of[b] for b in tile_request]),
                 block_shape=(br, page_size), shape=(int(qo_indptr[-1]), num_pages * page_size),
                 last_block_len=pt.last_page_len[tile_request])
print(ragged_bsr)
print("qo_indptr =", qo_indptr, " block row -> request:", tile_request)
print("indptr    =", ragged_bsr.indptr)
print("indices   =", ragged_bsr.indices)

assert ragged_bsr.num_block_rows == 4 and ragged_bsr.nnz_blocks == 4 + 4 + 2 + 3
mask = ragged_bsr.to_dense_mask()
for b in range(pt.batch_size):  # every query row of request b reads exactly b's token slots
    for row in range(qo_indptr[b], qo_indptr[b + 1]):
        np.testing.assert_array_equal(np.flatnonzero(mask[row]), np.sort(slots[b]))

# %%
# What the causal mask keeps inside those pages: query i of request b sits at position
# kv_len - qo_len + i (bottom-right aligned) and reads its request's tokens 0..that position.
causal_keep = np.zeros(mask.shape, dtype=bool)
for b in range(pt.batch_size):
    for i in range(qo_lens[b]):
        q_pos = int(kv_lens[b]) - int(qo_lens[b]) + i
        causal_keep[qo_indptr[b] + i, slots[b][:q_pos + 1]] = True
assert not (causal_keep & ~mask).any()  # the mask only removes pairs the BSR loads
assert [int(causal_keep[r].sum()) for r in range(qo_indptr[1])] == \
    list(range(int(kv_lens[0]) - int(qo_lens[0]) + 1, int(kv_lens[0]) + 1))

fig, (ax_blk, ax_el) = subplots(2, 1, figsize=(12, 7.6),
                                gridspec_kw={"height_ratios": [1, 2.3]})
req_names = [f"request {b}\n({qo_lens[b]} queries)" for b in range(pt.batch_size)]
tile_names = [f"r{b}: q{r - qo_indptr[b]}-{r - qo_indptr[b] + br - 1}"
              for b, r in zip(tile_request, range(0, int(qo_indptr[-1]), br), strict=True)]
page_names = [f"P{p}" for p in range(num_pages)]
plot_bsr(ragged_bsr, ax=ax_blk, row_labels=tile_names, col_labels=page_names,
         row_bounds=qo_indptr, row_bounds_labels=req_names,
         title="block view: which pages each tile of Br = 4 queries loads",
         xlabel="physical KV page", ylabel="query tile")
plot_bsr(ragged_bsr, ax=ax_el, elements=True, row_bounds=qo_indptr,
         row_bounds_labels=req_names, row_labels=tile_names, col_labels=page_names,
         keep=causal_keep,
         title="element view: dark = read under the causal mask; pale = loaded with the page, "
               "masked (or past the last token)",
         xlabel="physical KV slot, by page", ylabel="ragged query token (qo_indptr = 0, 8, 12, 16)")
fig.suptitle("ragged causal queries (8, 4, 4 tokens) over the paged KV cache, blocks (Br, Bc) = "
             "(4, 4)", fontsize=11)
save_figure(fig, "02_ragged_query_bsr.png")
show(fig)

# %% [markdown]
# The block rows drive a tile loop, which is all an attention kernel does: for each block row,
# gather the valid KV slots of its blocks (in visiting order, which is the logical token order),
# and attend the tile's queries to them with the causal variant at the right absolute positions.
# The result equals causal attention computed request by request on gathered keys.

# %%
q_ragged = rng.standard_normal((int(qo_indptr[-1]), num_qo_heads, head_dim))
lens = ragged_bsr.block_col_lens()
out = np.zeros_like(q_ragged)
for t, b in enumerate(tile_request):
    blocks = range(ragged_bsr.indptr[t], ragged_bsr.indptr[t + 1])
    cols = np.concatenate([ragged_bsr.indices[j] * page_size + np.arange(lens[j]) for j in blocks])
    rows = np.arange(t * br, (t + 1) * br)
    q_pos = rows - qo_indptr[b] + kv_lens[b] - qo_lens[b]  # bottom-right aligned causal
    o_tile, _ = reference.attention_state(q_ragged[rows], pool_flat[cols, 0], pool_flat[cols, 1],
                                          variant=causal(), q_pos=q_pos)
    out[rows] = o_tile

for b in range(pt.batch_size):
    q_b = q_ragged[qo_indptr[b]:qo_indptr[b + 1]]
    o_b, _ = reference.attention_state(q_b, pool_flat[slots[b], 0], pool_flat[slots[b], 1],
                                       variant=causal())
    np.testing.assert_allclose(out[qo_indptr[b]:qo_indptr[b + 1]], o_b, rtol=1e-12, atol=1e-12)
print("tile loop over the ragged BSR == per-request causal attention (rtol 1e-12)")

# %% [markdown]
# ## 6. The round trip
#
# Because the BSR view keeps every array of the page table, reading it back gives the same page
# table: the conversion is a change of name, not of information.

# %%
back = PageTable.from_bsr(pt.to_bsr())
for name in ("indptr", "indices", "last_page_len"):
    np.testing.assert_array_equal(getattr(back, name), getattr(pt, name))
assert (back.page_size, back.num_pages) == (pt.page_size, pt.num_pages)
back_tok = PageTable.from_bsr(token_bsr)
np.testing.assert_array_equal(back_tok.indices, token_pt.indices)
print("page table -> BSR -> page table: identical (page level and token level)")

# %% [markdown]
# ## Exercise: the slots a request reads
#
# Fill in `my_token_slots`: from the page table's arrays, the physical slot ids
# `page * page_size + offset` of request `b`'s tokens, in logical order (what a kernel reads,
# token by token). The check runs it on page tables with pages scattered over the pool,
# partly filled last pages, page size 1 and an empty request. (Solution: `tests/test_exercises.py`.)

# %%
from nbinfer import exercises


def my_token_slots(indptr, indices, last_page_len, page_size, b):
    """Physical slots of request ``b``'s tokens: int array of its KV length."""
    raise NotImplementedError  # replace with your code


print(exercises.attempt(exercises.check_token_slots, my_token_slots))

# %% [markdown]
# ## Summary
#
# * A page table `(kv_indptr, kv_indices, kv_last_page_len)` is a BSR matrix with rows = query
#   rows of each request, block columns = physical pages, `Bc = page_size`. No data moves.
# * `Bc` comes from the memory manager (any value, 1 = token level); `Br` is how many query
#   rows share a block row, i.e. how many queries reuse each page a thread block loads.
# * Attention driven by the BSR's block rows equals dense attention over gathered keys.
#
# A request's keys can also be split into several BSR matrices (for example a shared prefix with
# a large `Br` and unique suffixes with `Br = 1`). Each produces attention states, and lesson 01's
# merge operator combines them exactly: that is what makes the formats *composable*.
