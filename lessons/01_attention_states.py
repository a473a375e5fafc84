# %% [markdown]
# # Lesson 01: attention states and the merge operator
#
# A GPU that attends one query to 100,000 cached tokens wants to cut the keys into chunks and
# give each chunk to a different thread block. This lesson is about the small piece of algebra
# that makes that legal, and that every later lesson leans on.
#
# **You will learn**
#
# 1. why the output of attention over a chunk of keys is not enough to combine chunks, and what
#    second number has to travel with it: the *attention state* `(O, LSE)`;
# 2. the merge operator ⊕ on states, checked on a hand-sized example where every number can be
#    verified on paper;
# 3. that ⊕ is associative and commutative: split the keys anywhere, merge the pieces in any
#    order or tree shape, and you get attention over all keys (to ~1e-15);
# 4. why the naive formula `exp(LSE)` overflows for realistic logits, and how carrying
#    `(m, l)` with `LSE = m + log l` keeps every exponential at most 1;
# 5. that the empty state `(O = 0, LSE = -inf)` is the identity of ⊕.
#
# Everything runs on the float64 reference engine, `nbinfer.reference`, in well under a second.

# %%
import math

import numpy as np
from matplotlib.patches import Patch

from nbinfer import reference
from nbinfer.viz import plot_chunk_weights, plot_states_merge, save_figure, show, subplots

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## 1. One query, four keys
#
# Attention of a query $q$ over keys $k_1..k_n$ with values $v_1..v_n$ is a weighted mean of the
# values, with weights given by a softmax over the logits $s_j = q \cdot k_j$ (times a scale
# that we set to 1 here):
#
# $$O = \sum_j \frac{e^{s_j}}{\sum_i e^{s_i}} v_j .$$
#
# Take $q = [1, 0]$ and keys $[1, 0], [2, 0], [3, 0], [4, 0]$, so the logits are simply
# $1, 2, 3, 4$, and give the keys the values $10, 20, 30, 40$. Tensors in nbinfer always carry
# a sequence axis and a head axis, `[tokens, heads, head_dim]`, so the scalar example becomes
# arrays with one token and one head. The values get a second channel that is always 0, because
# the reference engine wants values and keys of the same width; we read channel 0.

# %%
q = np.array([[[1.0, 0.0]]])  # [1 query, 1 head, head_dim 2]
k = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [4.0, 0.0]])[:, None, :]  # [4, 1, 2]
v = np.array([[10.0, 0.0], [20.0, 0.0], [30.0, 0.0], [40.0, 0.0]])[:, None, :]
scores = (k[:, 0, :] @ q[0, 0]).ravel()
print("logits:", scores)

o_all, lse_all = reference.attention_state(q, k, v, sm_scale=1.0)
print(f"attention over all four keys: O = {o_all[0, 0, 0]:.4f}, LSE = {lse_all[0, 0]:.4f}")
assert np.allclose(scores, [1, 2, 3, 4])
assert round(o_all[0, 0, 0], 2) == 34.93
assert np.isclose(lse_all[0, 0], math.log(sum(math.exp(s) for s in scores)))

# %% [markdown]
# ## 2. Two chunks, each locally right and globally wrong
#
# Now pretend two thread blocks share the work: chunk A holds keys 1-2, chunk B keys 3-4. Each
# computes ordinary attention over its own keys, normalising by its own sum of exponentials.
# Alongside the output we keep the chunk's **log-sum-exp**, $\mathrm{LSE} = \log \sum_{j \in
# \text{chunk}} e^{s_j}$: the (log of the) softmax denominator that the chunk used. The pair
# `(O, LSE)` is the chunk's *attention state*.

# %%
o_a, lse_a = reference.attention_state(q, k[:2], v[:2], sm_scale=1.0)
o_b, lse_b = reference.attention_state(q, k[2:], v[2:], sm_scale=1.0)
print(f"chunk A = keys 1-2: O = {o_a[0, 0, 0]:.2f}, LSE = {lse_a[0, 0]:.3f}")
print(f"chunk B = keys 3-4: O = {o_b[0, 0, 0]:.2f}, LSE = {lse_b[0, 0]:.3f}")
assert round(o_a[0, 0, 0], 2) == 17.31 and round(lse_a[0, 0], 3) == 2.313
assert round(o_b[0, 0, 0], 2) == 37.31 and round(lse_b[0, 0], 3) == 4.313

average = (o_a[0, 0, 0] + o_b[0, 0, 0]) / 2
print(f"plain average of the two outputs: {average:.2f}  (attention over all keys: 34.93)")
assert round(average, 1) == 27.3

# %% [markdown]
# The average is badly off because each chunk divided by its *own* denominator. Inside chunk A,
# key 2 gets weight 0.73; over all four keys it deserves only 0.09, since keys 3 and 4 have much
# larger logits. Chunk B's denominator $e^{4.313} \approx 74.7$ is more than seven times chunk
# A's $e^{2.313} \approx 10.1$, so B's output should count seven times as much, and an average
# cannot know that. The LSE is exactly the missing information.
#
# ## 3. The merge operator ⊕
#
# Undo each chunk's normalisation (multiply by its denominator $e^{\mathrm{LSE}}$), add, and
# normalise once by the total:
#
# $$\mathrm{LSE}_{A \oplus B} = \log\left(e^{\mathrm{LSE}_A} + e^{\mathrm{LSE}_B}\right), \qquad
# O_{A \oplus B} = \frac{e^{\mathrm{LSE}_A} O_A + e^{\mathrm{LSE}_B} O_B}
#                       {e^{\mathrm{LSE}_A} + e^{\mathrm{LSE}_B}} .$$
#
# First straight from the formula, then with the reference engine's `merge_state` (the same
# name and argument order as FlashInfer's).

# %%
w_a, w_b = math.exp(lse_a[0, 0]), math.exp(lse_b[0, 0])
by_hand = (w_a * o_a[0, 0, 0] + w_b * o_b[0, 0, 0]) / (w_a + w_b)
print(f"e^LSE_A = {w_a:.3f}, e^LSE_B = {w_b:.3f}, merged by hand: {by_hand:.4f}")

o_ab, lse_ab = reference.merge_state(o_a, lse_a, o_b, lse_b)
print(f"reference.merge_state: O = {o_ab[0, 0, 0]:.4f}, LSE = {lse_ab[0, 0]:.4f}")
assert round(w_a, 2) == 10.11 and round(w_b, 2) == 74.68
assert round(by_hand, 2) == 34.93
np.testing.assert_allclose(o_ab, o_all, rtol=1e-14)
np.testing.assert_allclose(lse_ab, lse_all, rtol=1e-14)

# %% [markdown]
# The merged state equals attention over all four keys, output *and* LSE, so the result is
# itself a valid state that can be merged again. The figure puts the two views side by side:
# on the left, the weights each key gets inside its chunk versus over all keys; on the right,
# the partial outputs, their merge, and the (wrong) plain average.

# %%
fig, (ax_w, ax_o) = subplots(1, 2, figsize=(11, 3.9))
plot_chunk_weights(scores, [[0, 1], [2, 3]], ax=ax_w, chunk_labels=["A", "B"],
                   title="softmax weight of each key: inside its chunk vs over all keys")
plot_states_merge([o_a[0, 0, 0], o_b[0, 0, 0]], [lse_a[0, 0], lse_b[0, 0]], o_ab[0, 0, 0],
                  ax=ax_o, labels=["chunk A\nkeys 1-2", "chunk B\nkeys 3-4"],
                  exact=o_all[0, 0, 0], average=average,
                  title="merging states with ⊕ is exact; averaging outputs is not")
fig.suptitle("q = [1, 0], logits 1, 2, 3, 4, values 10, 20, 30, 40", fontsize=11)
save_figure(fig, "01_why_averaging_fails.png")
show(fig)

# %% [markdown]
# ## 4. Split anywhere, merge in any order
#
# ⊕ is associative and commutative (it is a sum of exponentially weighted terms in disguise),
# so *how* the keys are cut and in *which order or tree shape* the pieces are merged does not
# matter, apart from floating-point rounding. We check this on random data with several queries,
# heads and a realistic head dimension: every split point of a 37-key sequence, then five uneven
# chunks merged as a left fold, a right fold, a balanced tree, a random order, and all at once
# with `merge_states`.

# %%
rng = np.random.default_rng(2024)
L_q, H, D, L_kv = 3, 2, 16, 37
Q = rng.standard_normal((L_q, H, D))
K = rng.standard_normal((L_kv, H, D))
V = rng.standard_normal((L_kv, H, D))
O_ref, LSE_ref = reference.attention_state(Q, K, V)  # default scale 1/sqrt(D)


def state(lo, hi):
    """Attention state of every query over keys lo..hi-1."""
    return reference.attention_state(Q, K[lo:hi], V[lo:hi])


def max_err(st):
    return max(np.abs(st[0] - O_ref).max(), np.abs(st[1] - LSE_ref).max())


split_errors = []
for cut in range(1, L_kv):
    split_errors.append(max_err(reference.merge_state(*state(0, cut), *state(cut, L_kv))))
print(f"2-way split at every point 1..{L_kv - 1}: worst error {max(split_errors):.1e}")
assert max(split_errors) < 1e-12

# %%
cuts = [0, 5, 6, 19, 30, L_kv]  # five chunks of sizes 5, 1, 13, 11, 7
parts = [state(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]


def merge(x, y):
    return reference.merge_state(x[0], x[1], y[0], y[1])


def left_fold(states):
    acc = states[0]
    for st in states[1:]:
        acc = merge(acc, st)
    return acc


def right_fold(states):
    acc = states[-1]
    for st in states[-2::-1]:
        acc = merge(st, acc)
    return acc


def tree(states):
    if len(states) == 1:
        return states[0]
    mid = len(states) // 2
    return merge(tree(states[:mid]), tree(states[mid:]))


shuffled = [parts[i] for i in rng.permutation(len(parts))]
stacked_v = np.stack([p[0] for p in parts], axis=1)  # [L_q, num_states, H, D]
stacked_s = np.stack([p[1] for p in parts], axis=1)  # [L_q, num_states, H]
orders = {
    "left fold ((((A B) C) D) E)": left_fold(parts),
    "right fold (A (B (C (D E))))": right_fold(parts),
    "balanced tree ((A B) (C (D E)))": tree(parts),
    "random order, left fold": left_fold(shuffled),
    "merge_states, all at once": reference.merge_states(stacked_v, stacked_s),
}
order_errors = {name: max_err(st) for name, st in orders.items()}
for name, err in order_errors.items():
    print(f"{name:34s} max |error| = {err:.1e}")
assert max(order_errors.values()) < 1e-12

# %% [markdown]
# The errors are at the level of float64 rounding (~1e-16 relative), many orders of magnitude
# below the 1e-12 we assert. They are not exactly zero, and they differ between orders: floating
# point addition is not associative. That is why nbinfer's scheduler (a later lesson) fixes one
# merge order per batch, so that the same input always gives bit-identical output.

# %%
fig, (ax_s, ax_t) = subplots(1, 2, figsize=(11.5, 3.8), gridspec_kw={"width_ratios": [1.2, 1]})
ax_s.semilogy(range(1, L_kv), np.maximum(split_errors, 1e-18), "o-", ms=3, color="C0")
ax_s.axhline(1e-12, color="0.4", ls="--", lw=1, label="asserted bound 1e-12")
ax_s.set_xlabel("split point p (keys 0..p-1 | keys p..36)")
ax_s.set_ylabel("max |merged - one-shot|")
ax_s.set_title("two chunks, every split point: float64 rounding only", fontsize=10)
ax_s.set_ylim(1e-18, 1e-9)
ax_s.legend(fontsize=8, frameon=False)
# The five orders against each other: equal to ~1e-16, yet not bit for bit (the diagonal is 0).
names = list(orders)
pair = np.array([[np.abs(orders[a][0] - orders[b][0]).max() for b in names] for a in names])
assert pair.max() < 1e-14 and (pair[~np.eye(len(names), dtype=bool)] > 0).any()
shown = np.log10(np.where(pair > 0, pair, np.nan))
image = ax_t.imshow(shown, cmap="viridis", vmin=-18, vmax=-14)
for i in range(len(names)):
    for j in range(len(names)):
        ax_t.text(j, i, "0" if pair[i, j] == 0 else f"{pair[i, j]:.0e}", ha="center",
                  va="center", fontsize=7, color="black" if pair[i, j] == 0 else "white")
short = ["left fold", "right fold", "tree", "random order", "merge_states"]
ax_t.set_xticks(range(len(names)), labels=short, fontsize=8, rotation=30, ha="right")
ax_t.set_yticks(range(len(names)), labels=short, fontsize=8)
fig.colorbar(image, ax=ax_t, label="log10 max |difference|")
ax_t.set_title("five merge orders, pairwise: equal up to the last bits", fontsize=10)
fig.suptitle("⊕ is associative and commutative: any order gives the same state, up to "
             "float64 rounding", fontsize=11)
save_figure(fig, "01_merge_any_order.png")
show(fig)

# %% [markdown]
# ## 5. Overflow, and the `(m, l)` encoding
#
# The formula in section 3 computes $e^{\mathrm{LSE}}$. Real logits are not 1 to 4: large
# activations can push them into the hundreds (one reason some models cap their logits), and
# $e^{x}$ overflows float32 above $x \approx 88.7$ and float64 above $x \approx 709.8$. Then the
# formula computes `inf / inf = nan`.
#
# The cure is the same trick as a numerically safe softmax: express every exponential relative
# to a running maximum $m$. A state is stored as $(O, m, l)$ with $m = \max_j s_j$ and
# $l = \sum_j e^{s_j - m}$, so $\mathrm{LSE} = m + \log l$ and $1 \le l \le n$ never overflows.
# Merging rescales both sides to the larger maximum; every exponential it evaluates is at most 1:
#
# $$m = \max(m_A, m_B),\quad l = l_A e^{m_A - m} + l_B e^{m_B - m},\quad
# O = \frac{l_A e^{m_A - m} O_A + l_B e^{m_B - m} O_B}{l}.$$

# %%
def ml_state(s, vals, dtype):
    """(O, m, l) of one query over logits s and scalar values, in the given dtype."""
    s, vals = s.astype(dtype), vals.astype(dtype)
    m = s.max()
    p = np.exp(s - m)
    return (p * vals).sum() / p.sum(), m, p.sum()


def merge_ml(a, b):
    """⊕ on (O, m, l) states: every exponential is exp(non-positive) <= 1."""
    (o_1, m_1, l_1), (o_2, m_2, l_2) = a, b
    m = max(m_1, m_2)
    w_1, w_2 = l_1 * np.exp(m_1 - m), l_2 * np.exp(m_2 - m)
    return (w_1 * o_1 + w_2 * o_2) / (w_1 + w_2), m, w_1 + w_2


def merge_naive(a, b):
    """⊕ straight from the LSE formula: exp(LSE) overflows for large logits."""
    (o_1, m_1, l_1), (o_2, m_2, l_2) = a, b
    e_1, e_2 = np.exp(m_1 + np.log(l_1)), np.exp(m_2 + np.log(l_2))
    return (e_1 * o_1 + e_2 * o_2) / (e_1 + e_2)


# The toy example's LSE really is m + log l:
o_t, m_t, l_t = ml_state(scores[:2], v[:2, 0, 0], np.float64)
assert np.isclose(m_t + np.log(l_t), lse_a[0, 0])

# Shift every logit of the toy example by `offset`: softmax is shift invariant, so the exact
# answer stays 34.93 however large the logits get.
offsets = np.arange(0, 1001)
curves = {}
for dtype in (np.float32, np.float64):
    naive, safe = [], []
    with np.errstate(over="ignore", invalid="ignore"):
        for c in offsets:
            a = ml_state(scores[:2] + c, v[:2, 0, 0], dtype)
            b = ml_state(scores[2:] + c, v[2:, 0, 0], dtype)
            naive.append(merge_naive(a, b))
            safe.append(merge_ml(a, b)[0])
    curves[np.dtype(dtype).name] = (np.array(naive, dtype=np.float64), np.array(safe))

for name, (naive, safe) in curves.items():
    first_bad = offsets[np.argmax(~np.isfinite(naive))]
    print(f"{name}: naive merge first fails at offset {first_bad}; "
          f"(m, l) merge at offset 1000 = {safe[-1]:.4f}")
    assert np.all(np.isfinite(safe)) and np.allclose(safe, o_all[0, 0, 0], rtol=1e-6)
assert not np.isfinite(curves["float32"][0][offsets == 90][0])  # exp(90+) > float32 max
assert np.isfinite(curves["float64"][0][offsets == 700][0])
assert not np.isfinite(curves["float64"][0][offsets == 710][0])  # exp(710+) > float64 max

# %% [markdown]
# The reference engine's `merge_state` takes LSEs, but internally subtracts the larger LSE before
# exponentiating (the same rescaling), so it is safe at any logit size. We check it at logits
# around 1000, where the one-shot `attention_state` (which subtracts the row maximum) is the
# ground truth.

# %%
big = 1000.0
o_a_big, lse_a_big = reference.attention_state(q, k[:2] + [big, 0], v[:2], sm_scale=1.0)
o_b_big, lse_b_big = reference.attention_state(q, k[2:] + [big, 0], v[2:], sm_scale=1.0)
o_big, lse_big = reference.merge_state(o_a_big, lse_a_big, o_b_big, lse_b_big)
print(f"logits {scores + big}: LSE_A = {lse_a_big[0, 0]:.3f}, LSE_B = {lse_b_big[0, 0]:.3f}, "
      f"merged O = {o_big[0, 0, 0]:.4f}")
with np.errstate(over="ignore", invalid="ignore"):
    print("naive float64 exp(LSE_A):", np.exp(lse_a_big[0, 0]))
assert np.isclose(lse_a_big[0, 0], lse_a[0, 0] + big)
assert round(o_big[0, 0, 0], 2) == 34.93 and np.isclose(lse_big[0, 0], lse_all[0, 0] + big)

# %%
fig, ax = subplots(figsize=(8.5, 2.9))
exact = o_all[0, 0, 0]
rows = [(f"{kind}, {name}", res) for kind, i in (("exp(LSE) formula", 0), ("(m, l) merge", 1))
        for name, res in ((n, c[i]) for n, c in curves.items())]
for y, (_, res) in enumerate(rows):
    good = np.isfinite(res) & np.isclose(res, exact, rtol=1e-5)
    # Runs of consecutive offsets with the same outcome become one horizontal bar.
    edges = np.flatnonzero(np.diff(good.astype(int))) + 1
    for lo, hi in zip(np.r_[0, edges], np.r_[edges, good.size], strict=True):
        color = "#2ca02c" if good[lo] else "#d62728"
        ax.broken_barh([(offsets[lo], offsets[hi - 1] - offsets[lo] + 1)], (y - 0.35, 0.7),
                       facecolors=color)
        if not good[lo]:
            ax.text(offsets[lo] + 8, y, f"NaN from offset {offsets[lo]}", va="center",
                    color="white", fontsize=8, fontweight="bold")
ax.set_yticks(range(len(rows)), labels=[r[0] for r in rows], fontsize=9)
ax.invert_yaxis()
ax.set_xlim(0, offsets[-1])
ax.set_xlabel("offset added to every logit (logits = 1..4 + offset)")
ax.legend(handles=[Patch(color="#2ca02c", label=f"correct ({exact:.2f})"),
                   Patch(color="#d62728", label="NaN (exp overflowed)")],
          loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
ax.set_title("merging chunk A and chunk B as the logits grow", fontsize=10, pad=22)
save_figure(fig, "01_overflow.png")
show(fig)

# %% [markdown]
# Where the `exp(LSE)` formula gives a number it is exactly right; it just stops giving one once
# $e^{\mathrm{LSE}}$ times the output leaves the floating-point range (a few units before 88.7
# and 709.8, because $e^{\mathrm{LSE}}$ is multiplied by $O \approx 37$). In a GPU kernel this
# is the difference between carrying `(m, l)` per query row, as FlashAttention's online softmax
# does, and carrying `LSE` only to turn it back into $e^{\mathrm{LSE}}$. Storing a single LSE
# between kernels is fine, as FlashInfer does, as long as the merge first subtracts the larger
# LSE: that treats each state as $(m = \mathrm{LSE}, l = 1)$, a perfectly valid encoding.
#
# FlashInfer reports LSE in base 2 (GPUs have a fast `exp2`); the reference engine does too when
# asked with `lse_base=2`. It is the same number divided by $\ln 2$.

# %%
_, lse_a_base2 = reference.attention_state(q, k[:2], v[:2], sm_scale=1.0, lse_base=2)
assert np.isclose(lse_a_base2[0, 0], lse_a[0, 0] / math.log(2))
print(f"LSE_A natural = {lse_a[0, 0]:.4f}, base 2 = {lse_a_base2[0, 0]:.4f}")

# %% [markdown]
# ## 6. The empty state is the identity
#
# A chunk with no keys (a request whose KV is shorter than the chunk grid, a fully masked tile)
# has denominator 0, so its state is $O = 0$, $\mathrm{LSE} = \log 0 = -\infty$. In the merge
# formula it contributes $e^{-\infty} = 0$ weight, so merging it changes nothing, and two empty
# states merge to an empty state rather than `0/0 = nan`. This lets a kernel launch a fixed grid
# and let surplus blocks emit empty states.

# %%
empty_o, empty_lse = reference.attention_state(Q, K[:0], V[:0])  # zero keys
print("state over no keys: O all zero:", bool(np.all(empty_o == 0)), "LSE:", empty_lse[0])
assert np.all(empty_o == 0) and np.all(empty_lse == -np.inf)

x = parts[2]
for merged in (reference.merge_state(*x, empty_o, empty_lse),
               reference.merge_state(empty_o, empty_lse, *x)):
    np.testing.assert_array_equal(merged[0], x[0])  # bit-identical, not just close
    np.testing.assert_array_equal(merged[1], x[1])
both_empty = reference.merge_state(empty_o, empty_lse, empty_o, empty_lse)
assert np.all(both_empty[0] == 0) and np.all(both_empty[1] == -np.inf)
print("x ⊕ empty == empty ⊕ x == x, and empty ⊕ empty == empty (no NaN)")

# %% [markdown]
# ## Exercise: write ⊕
#
# Fill in `my_merge` below: two attention states of float64 `o [N, H, D]` and natural-log
# `lse [N, H]` (`-inf` for a state over no keys) in, their merge out. The check compares it
# with the reference on random states, states of very different weight, LSEs near 1000, and an
# empty state on either side or both, and says which case breaks. (A solution is in
# `tests/test_exercises.py`; try first.)

# %%
from nbinfer import exercises


def my_merge(o_a, lse_a, o_b, lse_b):
    """Your ⊕: returns ``(o, lse)`` of the keys of both states."""
    raise NotImplementedError  # replace with your code


print(exercises.attempt(exercises.check_merge, my_merge))

# %% [markdown]
# ## Summary
#
# * An attention state is `(O, LSE)`: the normalised output and the log of the softmax
#   denominator it was normalised by. Output alone cannot be combined; output plus scale can.
# * ⊕ un-normalises, adds and re-normalises. It is associative and commutative with identity
#   `(0, -inf)`, so states form a commutative monoid, the same algebra as `+` in a GEMM's
#   reduction. Any split and any reduction tree gives the same answer up to rounding.
# * Compute it in `(m, l)` form (max-shifted), never via `exp(LSE)` directly.
#
# Lesson 02 turns to the other half of FlashInfer's design: describing *which* keys each query
# reads, for every KV-cache layout, with one block-sparse matrix format.
