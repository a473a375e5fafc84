"""Tree (speculative decoding) masks: vs a brute-force ancestor walk, and tree attention through
the reference == each tree token attending sequentially to prefix + its root-to-node path."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from conftest import assert_close

from nbinfer.formats import causal_mask, segment_unpackbits
from nbinfer.formats.tree_mask import (
    batch_tree_masks,
    plot_tree_mask,
    tree_depths,
    tree_mask,
    tree_positions,
)
from nbinfer.reference import (
    attention_state,
    batch_prefill_with_ragged_kv_cache,
    single_decode_with_kv_cache,
)
from nbinfer.variants import rope_llama

matplotlib.use("Agg")
HQ, HKV, D = 4, 2, 8


def random_parent(rng, n):
    return np.array([int(rng.integers(-1, i)) for i in range(n)], dtype=np.int32)


def path_to_root(parent, i):
    """Tree tokens from the root down to ``i`` (inclusive), by walking parent pointers."""
    path = []
    while i >= 0:
        path.append(i)
        i = int(parent[i])
    return path[::-1]


def brute_mask(parent, prefix_len):
    n = len(parent)
    mask = np.zeros((n, prefix_len + n), dtype=bool)
    for i in range(n):
        mask[i, :prefix_len] = True
        for j in path_to_root(parent, i):
            mask[i, prefix_len + j] = True
    return mask


@pytest.mark.parametrize("n", [0, 1, 7, 16])
def test_mask_and_positions_vs_ancestor_walk(rng, n):
    for _ in range(5):
        parent, prefix = random_parent(rng, n), int(rng.integers(0, 6))
        mask = tree_mask(parent, prefix)
        assert mask.dtype == np.bool_ and mask.shape == (n, prefix + n)
        np.testing.assert_array_equal(mask, brute_mask(parent, prefix))
        want = [prefix + len(path_to_root(parent, i)) - 1 for i in range(n)]
        assert tree_positions(parent, prefix).tolist() == want
        assert tree_depths(parent).tolist() == [w - prefix for w in want]


def test_chain_is_causal_and_star_is_diagonal():
    np.testing.assert_array_equal(tree_mask([-1, 0, 1, 2], 3), causal_mask(4, 7))
    star = tree_mask([-1, -1, -1], 2)
    np.testing.assert_array_equal(star[:, 2:], np.eye(3, dtype=bool))
    assert star[:, :2].all() and tree_positions([-1, -1, -1], 2).tolist() == [2, 2, 2]
    assert tree_positions([-1, 0, 0, 1], 5).tolist() == [5, 6, 6, 7]


def test_batch_layout_and_packing(rng):
    parents = [random_parent(rng, int(rng.integers(0, 9))) for _ in range(4)]
    prefix = rng.integers(0, 7, 4)
    batch = batch_tree_masks(parents, prefix)
    n = np.array([p.size for p in parents])
    assert batch.qo_indptr.tolist() == [0, *np.cumsum(n).tolist()]
    assert batch.kv_lens.tolist() == (prefix + n).tolist()
    flat = np.concatenate([brute_mask(p, int(k)).ravel() for p, k in zip(parents, prefix,
                                                                          strict=True)])
    np.testing.assert_array_equal(batch.custom_mask, flat)
    sizes = n * (prefix + n)
    assert batch.mask_indptr.tolist() == [0, *np.cumsum((sizes + 7) // 8).tolist()]
    unpacked = segment_unpackbits(batch.packed_custom_mask, batch.mask_indptr, sizes, "little")
    np.testing.assert_array_equal(unpacked, flat)
    for b in range(4):
        np.testing.assert_array_equal(batch.mask(b), brute_mask(parents[b], int(prefix[b])))
    np.testing.assert_array_equal(batch.positions, np.concatenate(
        [tree_positions(p, int(k)) for p, k in zip(parents, prefix, strict=True)]))


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match=r"parent\[2\] must be -1 \(a root\) or an earlier"):
        tree_mask([-1, 0, 2])
    with pytest.raises(ValueError, match=r"parent\[0\]"):
        tree_mask([0])
    with pytest.raises(TypeError, match="parent must be an integer array"):
        tree_mask([-1.0])
    with pytest.raises(ValueError, match="prefix_len must be >= 0"):
        tree_mask([-1], -1)
    with pytest.raises(ValueError, match="prefix_lens must have length 2"):
        batch_tree_masks([[-1], [-1, 0]], [1])
    with pytest.raises(ValueError, match=r"parents\[1\]\[1\]"):
        batch_tree_masks([[-1], [-1, 5]], [1, 1])
    with pytest.raises(TypeError, match="parents must be a list"):
        batch_tree_masks(np.array([-1, 0]), [1])


@pytest.mark.parametrize("packed", [False, True])
def test_tree_attention_equals_per_branch_sequential(rng, packed):
    parents = [random_parent(rng, int(rng.integers(1, 10))) for _ in range(3)]
    prefix = rng.integers(0, 6, 3)
    batch = batch_tree_masks(parents, prefix)
    kv_indptr = np.concatenate([[0], np.cumsum(batch.kv_lens)]).astype(np.int32)
    q = rng.standard_normal((int(batch.qo_indptr[-1]), HQ, D))
    k = rng.standard_normal((int(kv_indptr[-1]), HKV, D))
    v = rng.standard_normal((int(kv_indptr[-1]), HKV, D))
    masks = (dict(packed_custom_mask=batch.packed_custom_mask, mask_indptr=batch.mask_indptr)
             if packed else dict(custom_mask=batch.custom_mask))
    o = batch_prefill_with_ragged_kv_cache(q, k, v, batch.qo_indptr, kv_indptr, **masks)
    want = np.zeros_like(o)
    for b, parent in enumerate(parents):
        kb, vb = k[kv_indptr[b]:kv_indptr[b + 1]], v[kv_indptr[b]:kv_indptr[b + 1]]
        for i in range(parent.size):
            keep = list(range(prefix[b])) + [int(prefix[b]) + j for j in path_to_root(parent, i)]
            want[batch.qo_indptr[b] + i] = single_decode_with_kv_cache(
                q[batch.qo_indptr[b] + i], kb[keep], vb[keep])
    assert_close(o, want, what="tree attention")


def test_positions_give_rope_of_the_branch(rng):
    """RoPE at tree_positions + the mask == decoding each branch as a plain sequence."""
    parent, prefix = random_parent(rng, 9), 4
    n = parent.size
    q = rng.standard_normal((n, HQ, D))
    k, v = rng.standard_normal((prefix + n, HKV, D)), rng.standard_normal((prefix + n, HKV, D))
    pos = tree_positions(parent, prefix)
    o, _ = attention_state(q, k, v, variant=rope_llama(), q_pos=pos,
                           kv_pos=np.concatenate([np.arange(prefix), pos]),
                           mask=tree_mask(parent, prefix))
    want = np.stack([single_decode_with_kv_cache(
        q[i], k[list(range(prefix)) + [prefix + j for j in path_to_root(parent, i)]],
        v[list(range(prefix)) + [prefix + j for j in path_to_root(parent, i)]],
        pos_encoding_mode="ROPE_LLAMA") for i in range(n)])
    assert_close(o, want, what="tree attention with RoPE")


def test_plot():
    fig = plot_tree_mask([-1, 0, 0, 1, -1], 3)
    assert len(fig.axes) == 1
