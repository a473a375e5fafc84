"""RadixTree: insert/match/split semantics against a dict model, and its cascade levels against
plain batch attention over each request's full page list."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from conftest import assert_close

from nbinfer.formats.radix import CascadeLevels, RadixTree
from nbinfer.reference import batch_prefill_with_paged_kv_cache, multi_level_cascade_attention

matplotlib.use("Agg")
HQ, HKV, D = 4, 2, 8


class Pool:
    """Hands out page ids 0, 1, 2, ... (the test's allocator)."""

    def __init__(self):
        self.next = 0

    def take(self, n):
        self.next += n
        return list(range(self.next - n, self.next))


def add(tree, pool, tokens):
    """The serving-system workflow: reuse matched pages, allocate the rest, insert."""
    n, pages = tree.match(tokens)
    fresh = pool.take(-(-len(tokens) // tree.page_size) - pages.size)
    assert tree.insert(tokens, list(pages) + fresh) >= n
    return tree.lookup(tokens)


def random_sequences(rng, count, vocab=3, max_len=14):
    """Sequences that share prefixes: each extends a random prefix of an earlier one."""
    seqs = [list(rng.integers(0, vocab, int(rng.integers(1, max_len))))]
    while len(seqs) < count:
        base = seqs[int(rng.integers(len(seqs)))]
        keep = int(rng.integers(0, len(base) + 1))
        seqs.append(base[:keep] + list(rng.integers(0, vocab, int(rng.integers(keep == 0, 8)))))
    return seqs


def test_insert_match_split_and_tails():
    t = RadixTree(4)
    a = list(range(10))  # pages: [0..3] [4..7] [8, 9] (partial tail)
    assert t.insert(a, [10, 11, 12]) == 0
    assert len(t) == 1 and a in t
    assert t.match(a)[0] == 8 and t.match(a)[1].tolist() == [10, 11]  # tail never matched
    assert t.match(list(range(7)))[0] == 4  # page-aligned only
    assert t.match([9, 9, 9, 9])[0] == 0
    # Diverging in the second page splits the two-page node at the page boundary.
    b = list(range(4)) + [7, 7, 7, 7, 7]
    assert t.insert(b, [10, 20, 21]) == 4
    assert t.lookup(b).tolist() == [10, 20, 21]
    assert t.lookup(a).tolist() == [10, 11, 12]
    # A sequence ending inside a node (page aligned) and one with its own partial tail.
    assert t.insert(list(range(8)), [10, 11]) == 8 and list(range(8)) in t
    assert t.insert(list(range(6)), [10, 30]) == 4
    assert t.lookup(list(range(6))).tolist() == [10, 30]  # tail page 30 is its own
    # The very same sequence again: nothing stored, the caller's duplicate pages may be freed.
    assert t.insert(a, [10, 11, 99]) == 10 and t.lookup(a).tolist() == [10, 11, 12]
    assert len(t) == 4 and list(range(5)) not in t
    with pytest.raises(KeyError):
        t.lookup(list(range(5)))
    # Ending inside a three-page edge splits it; the longer sequence still reads all its pages.
    u = RadixTree(2)
    u.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    assert u.insert([1, 2, 3, 4], [7, 8]) == 4 and u.lookup([1, 2, 3, 4]).tolist() == [0, 1]
    assert u.match([1, 2, 3, 4, 5, 6])[1].tolist() == [0, 1, 2] and len(u) == 2


def test_random_tree_matches_dict_model(rng):
    ps = int(rng.integers(1, 5))
    t, pool = RadixTree(ps), Pool()
    full, tails, stored = {}, {}, set()  # model: full-page prefix -> page; sequence -> tail
    for s in random_sequences(rng, 25):
        got = add(t, pool, s).tolist()
        for i in range(len(s) // ps):
            full.setdefault(tuple(s[:(i + 1) * ps]), got[i])
        if len(s) % ps:
            tails.setdefault(tuple(s), got[-1])
        stored.add(tuple(s))
    assert len(t) == len(stored)
    for s in map(list, stored):
        want = [full[tuple(s[:(i + 1) * ps])] for i in range(len(s) // ps)]
        want += [tails[tuple(s)]] if len(s) % ps else []
        assert t.lookup(s).tolist() == want
    for s in random_sequences(rng, 20):
        k = 0
        while tuple(s[:(k + 1) * ps]) in full and (k + 1) * ps <= len(s):
            k += 1
        n, pages = t.match(s)
        assert n == k * ps and pages.tolist() == [full[tuple(s[:(i + 1) * ps])] for i in range(k)]


def test_insert_and_cascade_errors():
    t = RadixTree(2)
    t.insert([1, 2, 3], [0, 1])
    with pytest.raises(ValueError, match="pages must have ceil"):
        t.insert([1, 2, 3], [0])
    with pytest.raises(ValueError, match="must hold distinct page ids"):
        t.insert([5, 6, 7], [4, 4])
    with pytest.raises(ValueError, match=r"pages\[1\]=0 is a page the tree holds"):
        t.insert([5, 6, 7], [4, 0])
    with pytest.raises(ValueError, match="tokens must hold at least one token"):
        t.insert([], [])
    with pytest.raises(TypeError, match="tokens must be an integer array"):
        t.match([1.5])
    with pytest.raises(ValueError, match="page_size must be >= 1"):
        RadixTree(0)
    with pytest.raises(ValueError, match=r"batch\[0\] is not stored"):
        t.cascade_levels([[1, 2]])
    with pytest.raises(ValueError, match="qo_lens must hold 1"):
        t.cascade_levels([[1, 2, 3]], [1, 1])
    with pytest.raises(ValueError, match=r"batch\[1\]\[1\] \(pages\)\[0\]=1"):
        t.cascade_levels([[1, 2, 3], ([7, 7], [1])])
    t.insert([1, 2, 3, 4, 5], [0, 2, 3])
    with pytest.raises(ValueError, match="qo_lens.0.=3: request 0 has only 1 private"):
        t.cascade_levels([[1, 2, 3], [1, 2, 3, 4, 5]], [3, 1], causal=True)


def test_levels_of_a_known_batch():
    t = RadixTree(4)
    a, b, c = list(range(10)), list(range(4)) + [9] * 5, list(range(8)) + [5] * 5
    for s, pages in ((a, [0, 1, 2]), (b, [0, 3, 4]), (c, [0, 1, 5, 6])):
        t.insert(s, pages)
    lv = t.cascade_levels([a, b, c])  # a and c share page 1 below page 0: reordered to a, c, b
    assert isinstance(lv, CascadeLevels) and lv.num_levels == 3
    assert lv.order.tolist() == [0, 2, 1] and lv.rows.tolist() == [0, 2, 1]
    assert [x.tolist() for x in lv.qo_indptr_arr] == [[0, 3], [0, 2, 3], [0, 1, 2, 3]]
    assert [x.tolist() for x in lv.paged_kv_indices_arr] == [[0], [1], [2, 5, 6, 3, 4]]
    assert [x.tolist() for x in lv.paged_kv_last_page_len_arr] == [[4], [4, 0], [2, 1, 1]]
    # Without sharing there is one level: the plain page table, batch order kept.
    solo = t.cascade_levels([([7] * 5, [8, 9]), ([6] * 3, [10])], [2, 3])
    assert solo.num_levels == 1 and solo.order.tolist() == [0, 1]
    assert solo.qo_indptr_arr[0].tolist() == [0, 2, 5]
    assert solo.paged_kv_last_page_len_arr[0].tolist() == [1, 3]
    assert lv.plot() is not None and t.plot() is not None


def _full_table(tree, batch):
    """Each request's own full page list (the non-cascade page table), batch order."""
    pages = [tree.lookup(r) if not isinstance(r, tuple) else np.asarray(r[1]) for r in batch]
    lens = [len(r[0] if isinstance(r, tuple) else r) for r in batch]
    indptr = np.concatenate([[0], np.cumsum([p.size for p in pages])]).astype(np.int32)
    last = np.array([n - (p.size - 1) * tree.page_size for n, p in zip(lens, pages, strict=True)])
    return indptr, np.concatenate(pages).astype(np.int32), last.astype(np.int32)


@pytest.mark.parametrize("page_size", [1, 3, 4])
@pytest.mark.parametrize("mode", ["decode", "prefill", "causal", "causal_rope"])
def test_cascade_equals_batch_attention(rng, page_size, mode):
    tree, pool = RadixTree(page_size), Pool()
    seqs = random_sequences(rng, 12)
    for s in seqs:
        add(tree, pool, s)
    picks = rng.choice(len(seqs), size=7, replace=True)  # duplicates allowed
    batch = [seqs[i] for i in picks]
    for s in random_sequences(rng, 3):  # requests not inserted: matched pages + fresh ones
        n, pages = tree.match(s)
        batch.append((s, list(pages) + pool.take(-(-len(s) // page_size) - pages.size)))
    batch = [batch[i] for i in rng.permutation(len(batch))]
    causal = mode.startswith("causal")
    if mode == "decode":
        qo_lens = np.ones(len(batch), dtype=np.int32)
    else:
        probe = tree.cascade_levels(batch)
        ptr, last = probe.paged_kv_indptr_arr[-1], probe.paged_kv_last_page_len_arr[-1]
        own = np.where(np.diff(ptr) > 0, (np.diff(ptr) - 1) * page_size + last, 0)  # private
        qo_lens = np.zeros(len(batch), dtype=np.int32)
        total = np.array([len(r[0] if isinstance(r, tuple) else r) for r in batch])[probe.order]
        # Causal: queries must fit the last level and each must see at least one key.
        qo_lens[probe.order] = (rng.integers(1, np.minimum(own + 1, total) + 1) if causal
                                else rng.integers(0, 4, own.size))
    lv = tree.cascade_levels(batch, qo_lens, causal=causal)

    # Every page is listed exactly once over all levels: shared nodes are never copied.
    indptr, indices, last = _full_table(tree, batch)
    listed = np.concatenate(lv.paged_kv_indices_arr)
    assert listed.size == np.unique(listed).size
    assert set(listed.tolist()) == set(indices.tolist())

    cache = rng.standard_normal((pool.next + 1, 2, page_size, HKV, D))
    q = rng.standard_normal((int(qo_lens.sum()), HQ, D))
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    pe = "ROPE_LLAMA" if mode == "causal_rope" else "NONE"
    ref, ref_lse = batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last,
                                                     causal=causal, pos_encoding_mode=pe,
                                                     return_lse=True)
    o, lse = multi_level_cascade_attention(
        q[lv.rows], lv.qo_indptr_arr, cache, lv.paged_kv_indptr_arr, lv.paged_kv_indices_arr,
        lv.paged_kv_last_page_len_arr, causal=causal, pos_encoding_mode=pe, return_lse=True)
    out, out_lse = np.empty_like(o), np.empty_like(lse)
    out[lv.rows], out_lse[lv.rows] = o, lse
    assert_close(out, ref, what=f"cascade {mode} o")
    assert_close(out_lse, ref_lse, what=f"cascade {mode} lse")


def test_evict_drops_least_recently_used_leaves_first():
    tree = RadixTree(2)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8, 9]
    tree.insert(a, [0, 1, 2])
    tree.insert(b, [0, 1, 3, 4])  # shares pages 0 and 1 with a; page 4 is b's partial tail
    assert (len(tree), tree.num_pages) == (2, 5)
    tree.match(b)  # b was used last: a's own page goes first
    assert tree.evict(1) == [2]
    assert a not in tree and b in tree and tree.match(a)[0] == 4  # a's shared prefix stays
    # a leaf whose pages a caller still uses is skipped
    assert tree.evict(1, evictable=lambda page: page != 4) == []
    assert tree.evict(10) == [4, 3, 0, 1]  # b's tail, its page, then the now-bare prefix
    assert (len(tree), tree.num_pages, tree.match(b)[0]) == (0, 0, 0)
    tree.insert(a, [5, 6, 7])  # pages freed by eviction may be reused
    assert tree.lookup(a).tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="num_pages"):
        tree.evict(-1)


def test_evict_counts_the_use_of_sequences_shorter_than_a_page():
    tree = RadixTree(4)
    tree.insert(list(range(1, 9)), [0, 1])
    tree.insert([9, 9], [2])  # a tail hanging off the root
    tree.match([9, 9])  # used last
    assert tree.evict(1) == [0, 1] and [9, 9] in tree
