"""append_paged_kv_cache kernel and get_batch_indices_positions vs the reference engine.

The append is a copy, so results must match the reference bit for bit, and every cache slot the
append does not own must keep its bits. Simulator at tiny shapes; the H200 with torch tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SIMULATOR
from dense import random_paged_cache

from nbinfer import reference
from nbinfer.api.append import (
    PagedKVAppendWrapper,
    append_paged_kv_cache,
    get_batch_indices_positions,
)
from nbinfer.api.launch import defer_frees
from nbinfer.kernels.append import (
    AppendSpec,
    append_launch_config,
    build_append_kernel,
    choose_word_bytes,
)

HKV, PAGE = 2, 4


def _case(rng, dtype, dim, layout, as_tuple, old=(0, 3, 6), new=(2, 0, 5), page=PAGE):
    """A random cache (every slot random) whose page table already covers the append."""
    lens = np.array(old) + np.array(new)
    cache, indptr, indices, last = random_paged_cache(rng, list(lens), page, HKV, dim,
                                                      kv_layout=layout, as_tuple=as_tuple,
                                                      dtype=dtype)
    append_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    nnz = int(append_indptr[-1])
    bi, pos = get_batch_indices_positions(append_indptr, lens, nnz)
    key = rng.standard_normal((nnz, HKV, dim)).astype(dtype)
    value = rng.standard_normal((nnz, HKV, dim)).astype(dtype)
    return key, value, bi, pos, cache, indices, indptr, last


def _copy(cache):
    return tuple(c.copy() for c in cache) if isinstance(cache, tuple) else cache.copy()


def _equal(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# (dtype, head_dim) pairs that exercise each copy unit: rows of 6, 12, 16, 12 and 16 bytes.
WORDS = [(np.float16, 3, 2), (np.float16, 6, 4), (np.float16, 8, 8), (np.float32, 3, 4),
         (np.float32, 4, 8)]


@pytest.mark.parametrize("dtype, dim, word", WORDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_append_matches_reference(rng, dtype, dim, word, layout, as_tuple):
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, dtype, dim, layout, as_tuple)
    assert choose_word_bytes(dim * np.dtype(dtype).itemsize, [0]) == word
    want = _copy(cache)
    reference.append_paged_kv_cache(key, value, bi, pos, want, indices, indptr, last,
                                    kv_layout=layout)
    assert not _equal(want, cache)  # the append changes something
    append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last, layout)
    assert _equal(cache, want)


def test_misaligned_append_key_uses_narrow_words(rng):
    # A contiguous slice starting 2 bytes into a buffer cannot be read as 8-byte words.
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float16, 8, "NHD", False)
    buf = np.empty(key.size + 1, np.float16)
    shifted = buf[1:].reshape(key.shape)
    shifted[...] = key
    assert shifted.__array_interface__["data"][0] % 8 != 0
    want = _copy(cache)
    reference.append_paged_kv_cache(key, value, bi, pos, want, indices, indptr, last)
    append_paged_kv_cache(shifted, value, bi, pos, cache, indices, indptr, last)
    assert _equal(cache, want)


def test_bf16_bits_kernel(rng):
    # bf16 travels as int16 bits: the kernel copies 2-byte words whatever they mean.
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float32, 3, "HND", True)
    bits = [a.view(np.int16) for a in (key, value)]  # fp32 rows of 3 = bf16-sized rows of 6
    caches = [c.view(np.int16) for c in cache]
    want = _copy(cache)
    reference.append_paged_kv_cache(key, value, bi, pos, want, indices, indptr, last,
                                    kv_layout="HND")
    rw = 6 * 2 // 2
    kernel = build_append_kernel(AppendSpec(2, rw, PAGE, combined=False, sim=SIMULATOR))
    grid, block = append_launch_config(key.shape[0], HKV * rw)
    # HND cache [P, H, PS, rw] and sources [nnz, H, rw], strides in words.
    strides = (0, PAGE * HKV * rw, rw, PAGE * rw, HKV * rw, rw, HKV * rw, rw)
    kernel[grid, block](*(b.ravel().view(np.uint16) for b in bits), bi, pos, indptr, indices,
                        *(c.ravel().view(np.uint16) for c in caches), np.int32(HKV),
                        *(np.int64(x) for x in strides))
    assert _equal(cache, want)


def test_reference_backend_and_empty_append(rng):
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float32, 4, "NHD", False)
    want = _copy(cache)
    reference.append_paged_kv_cache(key, value, bi, pos, want, indices, indptr, last)
    append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last, backend="reference")
    assert _equal(cache, want)
    before = _copy(cache)
    append_paged_kv_cache(key[:0], value[:0], bi[:0], pos[:0], cache, indices, indptr, last)
    assert _equal(cache, before)


def test_get_batch_indices_positions_matches_reference(rng):
    lens = rng.integers(0, 6, size=4)
    seq_lens = lens + rng.integers(0, 9, size=4)
    append_indptr = [0, *np.cumsum(lens).tolist()]  # a list works too
    bi, pos = get_batch_indices_positions(append_indptr, seq_lens, append_indptr[-1])
    want_bi, want_pos = reference.get_batch_indices_positions(append_indptr, seq_lens,
                                                              append_indptr[-1])
    assert bi.dtype == pos.dtype == np.int32
    assert np.array_equal(bi, want_bi) and np.array_equal(pos, want_pos)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(bi=lambda a: a + 3), ValueError, "batch_indices values must lie in"),
        (dict(pos=lambda a: a + 1), ValueError, r"positions\[\d+\]=\d+ must lie in \[0, kv_len\)"),
        (dict(pos=lambda a: a[:-1]), ValueError, "positions.shape"),
        (dict(indices=lambda a: a + 100), ValueError, "kv_indices values must lie in"),
        (dict(last=lambda a: a + PAGE), ValueError, "kv_last_page_len"),
        (dict(key=lambda a: a.astype(np.float32)), TypeError, "append_key must have the cache's"),
        (dict(value=lambda a: a[:, :1]), ValueError, r"append_value.shape\[1\]"),
        (dict(key=lambda a: a[:-1], value=lambda a: a[:-1]), ValueError, "batch_indices.shape"),
        (dict(cache=np.asfortranarray), ValueError, "paged_kv_cache must have a contiguous last"),
        (dict(cache=lambda c: (c[:, 0], c[:2, 1])), ValueError, "v_cache.shape must equal"),
        (dict(layout="NDH"), ValueError, "kv_layout must be one of"),
    ],
)
def test_errors_before_any_write(rng, change, error, match):
    args = dict(zip(["key", "value", "bi", "pos", "cache", "indices", "indptr", "last"],
                    _case(rng, np.float16, 4, "NHD", False), strict=True))
    cache = args["cache"]
    before = _copy(cache)
    change = dict(change)
    layout = change.pop("layout", "NHD")
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(error, match=match):
        append_paged_kv_cache(*args.values(), layout)
    assert _equal(cache, before)  # validation runs before the launch


# --- plan once, run per layer ----------------------------------------------------------------
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_append_wrapper_equals_the_function_in_every_layer(rng, layout, as_tuple):
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float16, 8, layout,
                                                              as_tuple)
    layers = [cache, _copy(cache)]
    wrapper = PagedKVAppendWrapper(cache, layout)
    wrapper.plan(bi, pos, indices, indptr, last)
    for i, layer in enumerate(layers):
        k, v = key + i, value - i  # each layer its own keys and values
        want = _copy(layer)
        reference.append_paged_kv_cache(k, v, bi, pos, want, indices, indptr, last,
                                        kv_layout=layout)
        wrapper.run(k, v, layer)
        assert _equal(layer, want)


def test_append_wrapper_errors(rng):
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float16, 8, "NHD", False)
    wrapper = PagedKVAppendWrapper(cache)
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(key, value, cache)
    with pytest.raises(ValueError, match="positions"):  # the function's own validation
        wrapper.plan(bi, pos + 100, indices, indptr, last)
    with pytest.raises(RuntimeError, match="plan"):  # a failed plan leaves none
        wrapper.run(key, value, cache)
    wrapper.plan(bi, pos, indices, indptr, last)
    with pytest.raises(ValueError, match="append_key"):
        wrapper.run(key[:-1], value[:-1], cache)
    with pytest.raises(ValueError, match="paged_kv_cache"):
        wrapper.run(key, value, cache[:-1])
    small = PagedKVAppendWrapper(cache)
    small.reserve(1, 1, 1)
    with pytest.raises(ValueError, match="reserved"):
        small.plan(bi, pos, indices, indptr, last)
    with pytest.raises(ValueError, match="max_tokens"):
        small.reserve(0, 1, 1)


def test_reserved_append_keeps_every_section_at_one_address(rng):
    # A captured run replays the arguments it was captured with: once reserved, each index
    # array sits at a fixed offset whatever the step's batch or page count.
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float16, 8, "NHD", False)
    wrapper = PagedKVAppendWrapper(cache)
    wrapper.reserve(16, 8, 64)
    addresses = []
    for n_req in (3, 2):  # two steps of different batch sizes and page counts
        sub_ptr = indptr[:n_req + 1]
        keep = bi < n_req
        want = _copy(cache)
        reference.append_paged_kv_cache(key[keep], value[keep], bi[keep], pos[keep], want,
                                        indices, sub_ptr, last[:n_req])
        wrapper.plan(bi[keep], pos[keep], indices, sub_ptr, last[:n_req])
        addresses.append([v.__array_interface__["data"][0] for v in wrapper._planned[1]])
        wrapper.run(key[keep], value[keep], cache)
        assert _equal(cache, want)
    assert addresses[0] == addresses[1]


@pytest.mark.parametrize("case", range(30))
def test_the_compiled_check_and_staging_agree_with_the_numpy_checks(rng, case):
    # compiled.check_stage_append (the wrapper's plan() for int32 NumPy indices) accepts
    # exactly the indices _check_indices accepts, and stages the sections the kernel reads
    from nbinfer.api.append import _check_indices
    from nbinfer.scheduler import compiled

    _, _, bi, pos, _, indices, indptr, last = _case(rng, np.float16, 4, "NHD", False)
    bi, pos, indptr, indices, last = (np.array(a, dtype=np.int32)
                                      for a in (bi, pos, indptr, indices, last))
    num_pages = int(indices.max()) + 1 + int(rng.integers(0, 3))
    kind = case % 10
    if kind == 1:
        bi[int(rng.integers(bi.size))] = indptr.size - 1  # a request past the batch
    elif kind == 2:
        pos[int(rng.integers(pos.size))] += 100  # past its request's KV
    elif kind == 3:
        indices[int(rng.integers(indptr[-1]))] = num_pages  # a page past the pool
    elif kind == 4:
        last[int(rng.integers(last.size))] = PAGE + 1
    elif kind == 5:
        indptr[1], indptr[2] = indptr[2], indptr[1] - 1  # decreasing
    elif kind == 6:
        last = last[:-1]
    elif kind == 7:
        indices = indices[:int(indptr[-1]) - 1]  # fewer pages than indptr says
    elif kind == 8:
        pos[int(rng.integers(pos.size))] = -1
    try:
        want = _check_indices(bi, pos, indices, indptr, last, bi.size, num_pages, PAGE)
    except ValueError:
        want = None
    offsets = (0, bi.size, 2 * bi.size, 2 * bi.size + indptr.size)
    out = np.full(offsets[3] + max(int(indptr[-1]), 1) + 3, -7, np.int32)
    got = compiled.check_stage_append(bi, pos, indptr, indices, last, PAGE, num_pages, out,
                                      offsets)
    assert got is (want is not None), kind
    if want is not None:
        staged = np.concatenate(want[:4])
        np.testing.assert_array_equal(out[:staged.size], staged)
        assert (out[staged.size:] == -7).all()  # nothing past the sections


def test_append_wrapper_plans_with_the_compiled_check_after_the_first(rng):
    # From a wrapper's second plan() on (or once the loops are loaded), int32 indices take the
    # compiled check and staging: the same appends, the same errors (the NumPy checks name
    # them), and a reserved wrapper copies only the step's own words
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float16, 8, "NHD", False)
    bi, pos, indptr, indices, last = (np.array(a, dtype=np.int32)
                                      for a in (bi, pos, indptr, indices, last))
    for reserved in (False, True):
        layer = _copy(cache)
        wrapper = PagedKVAppendWrapper(layer)
        if reserved:
            wrapper.reserve(32, 8, 4096)
        for _ in range(2):
            wrapper.plan(bi, pos, indices, indptr, last)
        assert wrapper._compiled
        want = _copy(layer)
        reference.append_paged_kv_cache(key, value, bi, pos, want, indices, indptr, last)
        wrapper.run(key, value, layer)
        assert _equal(layer, want)
        with pytest.raises(ValueError, match=r"positions\[\d+\]=\d+ must lie in"):
            wrapper.plan(bi, pos + 100, indices, indptr, last)
        with pytest.raises(RuntimeError, match="plan"):  # a failed plan leaves none
            wrapper.run(key, value, layer)


# --- the H200 -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_gpu_torch_append(rng, dtype, layout, as_tuple):
    torch = pytest.importorskip("torch")
    tdt, dev = getattr(torch, dtype), "cuda"
    heads, dim, page = 8, 128, 16
    new = rng.integers(1, 65, size=32)
    lens = rng.integers(0, 2000, size=32) + new
    pages = -(-lens // page)
    num_pages = int(pages.sum()) + 64
    indices = torch.from_numpy(rng.permutation(num_pages)[: pages.sum()].astype(np.int32)).to(dev)
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)).to(dev)
    last = torch.from_numpy((lens - (pages - 1) * page).astype(np.int32)).to(dev)
    append_indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(new)]).astype(np.int32)).to(dev)
    nnz = int(new.sum())
    bi, pos = get_batch_indices_positions(append_indptr, torch.from_numpy(lens).to(dev), nnz)
    assert bi.is_cuda and pos.dtype == torch.int32
    shape = (num_pages, page, heads, dim) if layout == "NHD" else (num_pages, heads, page, dim)
    kc, vc = (torch.randn(shape, device=dev).to(tdt) for _ in range(2))
    cache = (kc, vc) if as_tuple else torch.stack([kc, vc], dim=1).contiguous()
    key, value = (torch.randn(nnz, heads, dim, device=dev).to(tdt) for _ in range(2))
    # Expected result by torch advanced indexing on a copy (page, slot of every token).
    want = [c.clone() for c in ((kc, vc) if as_tuple else (cache[:, 0], cache[:, 1]))]
    page_of = indices[indptr[bi.long()].long() + (pos // page).long()].long()
    slot = (pos % page).long()
    for w, new_rows in zip(want, (key, value), strict=True):
        if layout == "NHD":
            w[page_of, slot] = new_rows
        else:
            w[page_of, :, slot] = new_rows
    append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last, layout)
    got = cache if as_tuple else (cache[:, 0], cache[:, 1])
    torch.cuda.synchronize()
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.gpu
def test_gpu_numpy_round_trip(rng):
    key, value, bi, pos, cache, indices, indptr, last = _case(rng, np.float16, 128, "NHD", False)
    want = _copy(cache)
    reference.append_paged_kv_cache(key, value, bi, pos, want, indices, indptr, last)
    append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last, backend="cuda")
    assert _equal(cache, want)


@pytest.mark.gpu
def test_gpu_append_wrapper_replays_in_a_cuda_graph(rng):
    torch = pytest.importorskip("torch")
    heads, dim, page, num_pages = 8, 64, 16, 64
    cache = torch.zeros(num_pages, 2, page, heads, dim, dtype=torch.bfloat16, device="cuda")
    wrapper = PagedKVAppendWrapper(cache)
    wrapper.reserve(8, 8, num_pages)
    key, value = (torch.zeros(8, heads, dim, dtype=torch.bfloat16, device="cuda")
                  for _ in range(2))
    graph = None
    want = cache.clone()
    for step in range(3):  # a new plan each step, the same captured launch
        lens = rng.integers(1, 100, size=8)
        pages = -(-lens // page)
        ids = rng.permutation(num_pages)[:pages.sum()].astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        last = (lens - (pages - 1) * page).astype(np.int32)
        bi, pos = np.arange(8, dtype=np.int32), (lens - 1).astype(np.int32)
        wrapper.plan(bi, pos, ids, indptr, last)
        key.copy_(torch.randn(8, heads, dim, device="cuda"))
        value.copy_(torch.randn(8, heads, dim, device="cuda"))
        if graph is None:
            wrapper.run(key, value, cache)  # loads the kernel before the capture
            graph = torch.cuda.CUDAGraph()
            with defer_frees(), torch.cuda.graph(graph):
                wrapper.run(key, value, cache)
        graph.replay()
        page_of = torch.as_tensor(ids[indptr[:-1] + pos // page].astype(np.int64), device="cuda")
        slot = torch.as_tensor((pos % page).astype(np.int64), device="cuda")
        want[page_of, 0, slot] = key
        want[page_of, 1, slot] = value
        torch.cuda.synchronize()
        assert torch.equal(cache, want), step
