"""BlockSparseAttentionWrapper (prefill tile kernel in BSR mode) vs the reference, simulator."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer.api.sparse import BlockSparseAttentionWrapper
from nbinfer.formats import packbits


def _pattern(rng, M, N, R, C, density=0.6):
    mb, nb = -(-M // R), -(-N // C)
    dense = rng.random((mb, nb)) < density
    dense[0, -1] = True  # the partial last column is stored somewhere
    indptr = np.concatenate([[0], np.cumsum(dense.sum(1))]).astype(np.int32)
    # columns unsorted within a row: the wrapper must not depend on their order
    indices = np.concatenate([rng.permutation(np.flatnonzero(r)) for r in dense]).astype(np.int32)
    return indptr, indices


@pytest.mark.parametrize(
    "M, N, R, C, causal, mask",
    [(7, 9, 1, 1, False, None), (16, 5, 16, 1, True, None), (5, 33, 1, 16, False, "bool"),
     (20, 37, 16, 16, True, "packed"), (70, 100, 64, 64, False, None),
     (10, 13, 4, 4, True, "bool")],
    ids=["1x1", "16x1-causal", "1x16-mask", "16x16-causal-packed", "64x64", "4x4-partial"],
)
def test_block_sparse(rng, M, N, R, C, causal, mask):
    indptr, indices = _pattern(rng, M, N, R, C)
    hq, hkv, d = 4, 2, 64
    q = rng.standard_normal((M, hq, d)).astype(np.float32)
    k = rng.standard_normal((N, hkv, d)).astype(np.float32)
    v = rng.standard_normal((N, hkv, d)).astype(np.float32)
    elem = rng.random((indices.size, R, C)) < 0.7 if mask else None
    kw = {}
    if mask == "bool":
        kw = dict(mask=elem)
    elif mask == "packed":
        kw = dict(packed_mask=packbits(elem.ravel(), bitorder="little"))
    w = BlockSparseAttentionWrapper(np.zeros(1 << 22, np.uint8))
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, causal=causal, q_data_type="float32", **kw)
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.block_sparse_attention(q, k, v, indptr, indices, R, C, mask=elem,
                                                    causal=causal, return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-5)
    assert np.all(lse[~finite] == -np.inf) and np.all(out[~finite] == 0)


@pytest.mark.parametrize(
    "M, N, R, C, indptr, indices, mask",
    [(16, 40, 16, 16, [0, 2], [1, 0], False),
     (16, 24, 16, 1, [0, 6], [20, 0, 9, 3, 15, 12], False),
     (32, 40, 16, 16, [0, 3, 5], [2, 0, 1, 1, 2], True)],
    ids=["16x16", "16x1", "16x16-future-masked"],
)
def test_block_sparse_causal_rows_span_tiles(rng, M, N, R, C, indptr, indices, mask):
    """Causal block rows taller than a query tile (R * G > tile_q: at G = 4 a tile holds 8 rows).
    The prefill planner's causal trim counts a request's keys by sequence index
    (``kv_len - qo_len + qo_end``), which for a block row drops keys its first tiles can see
    (rel_err ~0.1 on the H200 test). The last case also stores a block column after the block
    row's last query (left out of its pages under causal) with an element mask."""
    hq, hkv, d = 4, 1, 64
    indptr, indices = np.array(indptr, np.int32), np.array(indices, np.int32)
    q = rng.standard_normal((M, hq, d)).astype(np.float32)
    k = rng.standard_normal((N, hkv, d)).astype(np.float32)
    v = rng.standard_normal((N, hkv, d)).astype(np.float32)
    elem = rng.random((indices.size, R, C)) < 0.7 if mask else None
    w = BlockSparseAttentionWrapper(np.zeros(1 << 22, np.uint8))
    w.plan(indptr, indices, M, N, R, C, hq, hkv, d, causal=True, q_data_type="float32",
           mask=elem)
    assert w.schedule.tile_rows < R  # block rows span several query tiles
    out, lse = w.run(q, k, v, return_lse=True)
    ref, ref_lse = reference.block_sparse_attention(q, k, v, indptr, indices, R, C, mask=elem,
                                                    causal=True, return_lse=True)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-5)
    assert np.all(lse[~finite] == -np.inf) and np.all(out[~finite] == 0)


def test_block_sparse_errors(rng):
    indptr, indices = _pattern(rng, 8, 8, 4, 4)
    w = BlockSparseAttentionWrapper(np.zeros(1 << 20, np.uint8))
    with pytest.raises(ValueError, match="indices"):
        w.plan(indptr, np.full_like(indices, 5), 8, 8, 4, 4, 2, 1, 64)
    with pytest.raises(ValueError, match="indptr"):
        w.plan(indptr[:-1], indices, 8, 8, 4, 4, 2, 1, 64)
    with pytest.raises(ValueError, match="mask"):
        w.plan(indptr, indices, 8, 8, 4, 4, 2, 1, 64, mask=np.ones((indices.size + 1, 4, 4), bool))
    w.plan(indptr, indices, 8, 8, 4, 4, 2, 1, 64, q_data_type="float32")
    q = np.zeros((8, 2, 64), np.float32)
    with pytest.raises(ValueError, match="k.shape"):
        w.run(q, np.zeros((9, 1, 64), np.float32), np.zeros((9, 1, 64), np.float32))
