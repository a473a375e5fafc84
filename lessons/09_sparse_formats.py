# %% [markdown]
# # Lesson 09: sparse attention is indices and bits over one pool
#
# Lesson 02 read a page table as a block-sparse matrix (BSR) whose rows are requests and whose
# block columns are the physical pages of one KV pool. This lesson shows that the sparse
# patterns a serving system uses besides plain paging are the same thing again: a *different
# set of indices* or a *mask of bits* over the same pool, never a copy of the keys and values.
#
# **You will learn**
#
# 1. **top-k pages** (Quest): a cheap upper bound on every page's logits picks the pages worth
#    reading; the selection is a smaller page table over the same pool, and attention through
#    it is exact attention restricted to the kept tokens;
# 2. how much of the softmax those pages carry: the error against full attention as `k` grows;
# 3. **speculative token trees**: a draft model proposes a tree of tokens; one prefill pass
#    scores them all, each token attending to the prefix and to its own ancestors only, a
#    custom mask that equals running every root-to-leaf path on its own;
# 4. **packed bit masks**: the same mask stored as 1 bit per (query, key) pair instead of one
#    byte, which is what FlashInfer's kernels read.
#
# Everything runs on the float64 reference engine, so the lesson needs no GPU and no
# simulator.

# %%
import numpy as np

from nbinfer import reference
from nbinfer.formats import PageTable, packbits
from nbinfer.formats.topk import page_key_summaries, quest_page_scores, select_topk_pages
from nbinfer.formats.tree_mask import batch_tree_masks, plot_tree_mask, tree_mask
from nbinfer.viz import save_figure, show, subplots

np.set_printoptions(linewidth=100, precision=3, suppress=True)
rng = np.random.default_rng(9)

# %% [markdown]
# ## 1. One pool, one page table
#
# Two requests of 90 and 61 tokens, pages of 8 tokens, GQA with 4 query heads over 2 KV heads.
# The keys are random except that a few pages of each request hold keys close to the query's
# direction, the situation top-k selection is made for: most of the attention falls on a few
# pages.

# %%
page_size, num_pages, hq, hkv, d = 8, 40, 4, 2, 32
kv_lens = [90, 61]
pt = PageTable.from_kv_lens(kv_lens, page_size, num_pages=num_pages, rng=rng)
cache = rng.standard_normal((num_pages, 2, page_size, hkv, d)) * 0.5  # [pages, K/V, slot, Hkv, D]
q = rng.standard_normal((pt.batch_size, hq, d))
hot = {0: [2, 7, 9], 1: [1, 5]}  # logical pages whose keys line up with the query
for b, pages in hot.items():
    for lp in pages:
        phys = pt.indices[pt.indptr[b] + lp]
        for g in range(hkv):  # every key of the page near the mean query of its head group
            cache[phys, 0, :, g] += 1.5 * q[b, g * (hq // hkv):(g + 1) * (hq // hkv)].mean(0)
print(pt)
exact = reference.batch_decode_with_paged_kv_cache(q, cache, pt.indptr, pt.indices,
                                                   pt.last_page_len)
print("pages per request:", np.diff(pt.indptr), "of", num_pages, "in the pool")

# %% [markdown]
# ## 2. Top-k pages (Quest)
#
# For each page keep the elementwise minimum and maximum of its keys (two vectors per page and
# KV head, computed once when the page fills). For a query `q`, any key `k` in the page has
# `q . k <= sum_d max(q_d kmin_d, q_d kmax_d)`: an upper bound on every logit of the page,
# without reading the page. Keep the `k` pages with the largest bound (always including the
# last, partly filled page, so `kv_last_page_len` stays valid). The result is a page table
# whose indices are a subset of the original ones.

# %%
kmin, kmax = page_key_summaries(cache[:, 0], pt)
scores = quest_page_scores(q, kmin, kmax, pt)
top = select_topk_pages(pt, scores, top_k=4)
sel = top.table
print("kept logical pages:", [top.logical[sel.indptr[b]:sel.indptr[b + 1]].tolist()
                              for b in range(sel.batch_size)])
print("kept physical pages:", sel.indices)

for b in range(pt.batch_size):
    kept = set(sel.indices[sel.indptr[b]:sel.indptr[b + 1]].tolist())
    assert kept <= set(pt.indices[pt.indptr[b]:pt.indptr[b + 1]].tolist())  # same pool, fewer
    assert set(hot[b]) <= set(top.logical[sel.indptr[b]:sel.indptr[b + 1]].tolist()) or \
        len(hot[b]) >= 4  # the bound finds the pages that matter
assert sel.num_pages == pt.num_pages and np.array_equal(sel.last_page_len, pt.last_page_len)

# %% [markdown]
# Attention through the selected table reads only the kept pages. It equals exact attention of
# the full request with every key of a dropped page masked out: the selection is a sparsity
# pattern, not an approximation of the arithmetic.

# %%
sparse = reference.batch_decode_with_paged_kv_cache(q, cache, sel.indptr, sel.indices,
                                                    sel.last_page_len)
for b in range(pt.batch_size):
    k_all, v_all = reference.gather_kv(cache[:, 0], cache[:, 1],
                                       pt.indices[pt.indptr[b]:pt.indptr[b + 1]], kv_lens[b])
    keep = top.token_mask(b, kv_lens[b])
    o, _ = reference.attention_state(q[b][None], k_all, v_all, mask=keep[None, :])
    np.testing.assert_allclose(sparse[b], o[0], rtol=1e-12, atol=1e-12)
print("top-k decode == full attention with the dropped pages masked: checked")

# %% [markdown]
# ## 3. How many pages are enough?
#
# The error against full attention, as the number of kept pages grows from 1 to all of them.
# With all pages the selection is the full table and the error is exactly zero.

# %%
ks = list(range(1, int(np.diff(pt.indptr).max()) + 1))
errors = []
for k in ks:
    t = select_topk_pages(pt, scores, top_k=k).table
    o = reference.batch_decode_with_paged_kv_cache(q, cache, t.indptr, t.indices,
                                                   t.last_page_len)
    errors.append(float(np.abs(o - exact).max() / np.abs(exact).max()))
for k, e in zip(ks, errors, strict=True):
    print(f"top-{k:2d}: relative error {e:.2e}")
assert errors[-1] == 0.0  # every page kept: exact
assert errors[3] < errors[0] / 10  # the 4 pages that hold the aligned keys: 10x smaller
bytes_read = [sum(min(k, n) for n in np.diff(pt.indptr)) for k in ks]

# %% [markdown]
# ## 4. A speculative token tree
#
# In speculative decoding a small draft model proposes several continuations at once, as a
# tree: token 0 follows the prompt, tokens 1 and 2 are two alternatives after it, and so on.
# The large model scores every tree token in one pass. Token `i` may attend to the prompt and to
# its own ancestors (including itself), never to a sibling branch: a custom mask of shape
# `[tree tokens, prompt + tree tokens]`. As a BSR it is a prefill over the request's pages with
# a mask on the last block columns.

# %%
parent = np.array([-1, 0, 0, 1, 1, 2, 3])  # 7 draft tokens: 0 -> {1, 2}, 1 -> {3, 4}, ...
prompt_len = 12
mask = tree_mask(parent, prompt_len)
print(mask.astype(int)[:, prompt_len - 2:])  # the last two prompt columns, then the tree
batch = batch_tree_masks([parent], [prompt_len])
n_tree = parent.size
kv_len = prompt_len + n_tree
tree_pt = PageTable.from_kv_lens([kv_len], page_size, num_pages=num_pages, rng=rng)
tree_cache = rng.standard_normal((num_pages, 2, page_size, hkv, d))
q_tree = rng.standard_normal((n_tree, hq, d))
out = reference.batch_prefill_with_paged_kv_cache(
    q_tree, batch.qo_indptr, tree_cache, tree_pt.indptr, tree_pt.indices, tree_pt.last_page_len,
    custom_mask=batch.custom_mask)

# %% [markdown]
# The check: token `i` of the tree must see exactly what it would see if its own root-to-`i`
# path were the only continuation of the prompt, so run each path as a plain causal sequence
# and compare its last row.

# %%
k_seq, v_seq = reference.gather_kv(tree_cache[:, 0], tree_cache[:, 1], tree_pt.indices, kv_len)
for i in range(n_tree):
    path = [j for j in range(n_tree) if mask[i, prompt_len + j]]  # ancestors of i, and i
    cols = list(range(prompt_len)) + [prompt_len + j for j in path]
    o_path = reference.single_prefill_with_kv_cache(q_tree[path], k_seq[cols], v_seq[cols],
                                                    causal=True)
    np.testing.assert_allclose(out[i], o_path[-1], rtol=1e-12, atol=1e-12)
print("every tree token == its own path run alone: checked")
assert mask[3, prompt_len + 1] and not mask[3, prompt_len + 2]  # 3 sees its parent, not 2

# %% [markdown]
# ## 5. The same mask in bits
#
# A bool mask spends a byte per (query, key) pair; FlashInfer's kernels read it packed, 8 pairs
# per byte (`packed_custom_mask`, little bit order per request). The packed form gives the same
# result, at an eighth of the bytes.

# %%
out_packed = reference.batch_prefill_with_paged_kv_cache(
    q_tree, batch.qo_indptr, tree_cache, tree_pt.indptr, tree_pt.indices,
    tree_pt.last_page_len, packed_custom_mask=batch.packed_custom_mask)
np.testing.assert_array_equal(out_packed, out)
bool_bytes, packed_bytes = batch.custom_mask.nbytes, batch.packed_custom_mask.nbytes
print(f"mask: {bool_bytes} bytes as bool, {packed_bytes} bytes packed")
assert packed_bytes == -(-mask.size // 8) and bool_bytes == mask.size
assert np.array_equal(batch.packed_custom_mask, packbits(mask.ravel(), bitorder="little"))

# %%
fig, ax = subplots(2, 2, figsize=(11.5, 7.6), gridspec_kw={"height_ratios": [1, 1.3]})
top.plot(ax=ax[0, 0])
ax[0, 0].set_title("top-4 pages per request (solid, label: physical page)", fontsize=10)
ax[0, 1].plot(bytes_read, errors, "o-", color="C0")
for k, x, e in zip(ks, bytes_read, errors, strict=True):
    if k in (1, 4, ks[-1] - 1, ks[-1]):
        ax[0, 1].annotate(f"k={k}", (x, e), xytext=(4, 6), textcoords="offset points",
                          fontsize=8)
ax[0, 1].set_yscale("symlog", linthresh=1e-3)
ax[0, 1].set_xlabel(f"pages read (both requests; all: {bytes_read[-1]})")
ax[0, 1].set_ylabel("max |o_k - o| / max |o|")
ax[0, 1].set_title("error against full attention: 0 once every page is kept", fontsize=10)
plot_tree_mask(parent, prompt_len, ax=ax[1, 0])
ax[1, 0].set_title(f"draft tree of {n_tree} tokens after a {prompt_len}-token prompt",
                   fontsize=10)
# The packed mask drawn as its bytes: row i is byte i, column j its bit j (little bit order),
# which holds pair 8 i + j of the row-major mask; the bits past the mask's end are padding.
bits = np.unpackbits(batch.packed_custom_mask, bitorder="little").reshape(-1, 8).astype(float)
bits.ravel()[mask.size:] = 0.25
ax[1, 1].imshow(bits, cmap="Blues", vmin=0, vmax=1.3, aspect="auto", interpolation="nearest")
for i, byte in enumerate(batch.packed_custom_mask):
    ax[1, 1].text(8.0, i, f"0x{byte:02x}", va="center", fontsize=7)
ax[1, 1].set_xlim(-0.5, 9.2)
ax[1, 1].set_xticks(range(8))
ax[1, 1].set_xlabel("bit j of the byte (little bit order)")
ax[1, 1].set_ylabel("byte i: pairs 8 i .. 8 i + 7")
ax[1, 1].set_title(f"the same mask as {packed_bytes} bytes ({bool_bytes} as bool); "
                   "pale: padding", fontsize=10)
save_figure(fig, "09_sparse_formats.png")
show(fig)

# %% [markdown]
# ## Summary
#
# * Top-k page selection is a page table with fewer indices over the same pool: decode through
#   it is exact attention on the kept tokens. Here Quest's bound finds the pages that hold the
#   keys aligned with the query, and keeping those four instead of one cuts the error more than
#   tenfold; with every page kept it is exactly zero.
# * A speculative token tree is one prefill with a custom mask: each tree token sees the prompt
#   and its ancestors, which is the same as running every path alone.
# * Masks travel as bits: 8 (query, key) pairs per byte, same result.
#
# None of these copied a key or a value. The kernels of lesson 04 walk the indices and test the
# bits; the formats decide only which ones.
