"""Every GQA group size 1..8, powers of two or not, with the head-dependent variants, in the
simulator: the decode kernel pads its head loop to a power of two, and a variant's hooks must
never run for a padding head (an ALiBi slope table or a sink vector has Hq entries)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err

from nbinfer import reference
from nbinfer import variants as V
from nbinfer.api.decode import BatchDecodeWithPagedKVCacheWrapper
from nbinfer.api.prefill import BatchPrefillWithRaggedKVCacheWrapper
from nbinfer.formats import PageTable

D, PS = 64, 4


def _flags(kind, hq):
    if kind == "alibi+cap+window":
        return dict(pos_encoding_mode="ALIBI", logits_soft_cap=20.0, window_left=9)
    if kind == "rope":
        return dict(pos_encoding_mode="ROPE_LLAMA")
    if kind == "sink":
        return dict(variant=V.attention_sink(np.linspace(-1.0, 1.5, hq)))
    return dict(variant=V.sigmoid_attention(0.5, -1.0))


@pytest.mark.parametrize("group", range(1, 9))
@pytest.mark.parametrize("kind", ["alibi+cap+window", "sink"])
def test_decode_every_group_size(rng, group, kind):
    hkv = 1 if group > 4 else 2
    hq = group * hkv
    pt = PageTable.from_kv_lens([13, 6], PS, rng=rng)
    cache = rng.standard_normal((pt.num_pages, 2, PS, hkv, D)).astype(np.float32)
    q = rng.standard_normal((2, hq, D)).astype(np.float32)
    w = BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8), "NHD")
    kw = _flags(kind, hq)
    w.plan(pt.indptr, pt.indices, pt.last_page_len, hq, hkv, D, PS, q_data_type="float32", **kw)
    out, lse = w.run(q, cache, return_lse=True)
    ref, ref_lse = reference.batch_decode_with_paged_kv_cache(
        q, cache, pt.indptr, pt.indices, pt.last_page_len, return_lse=True, **kw)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    np.testing.assert_allclose(lse, ref_lse, atol=1e-4)


@pytest.mark.parametrize("group", [3, 5, 6, 7])
@pytest.mark.parametrize("kind", ["rope", "sigmoid"])
def test_decode_position_and_sigmoid_variants_at_odd_group_sizes(rng, group, kind):
    test_decode_every_group_size(rng, group, kind)


@pytest.mark.parametrize("group, dtype", [(3, "float32"), (5, "float16"), (6, "float32"),
                                          (7, "float16")])
@pytest.mark.parametrize("kind", ["alibi+cap+window", "rope", "sink", "sigmoid"])
def test_prefill_group_sizes_that_are_not_powers_of_two(rng, group, dtype, kind):
    # float16 runs the tensor-core kernel's simulator twins, float32 the CUDA-core tile kernel.
    hq, hkv = group, 1
    qo, kv = np.array([0, 5, 8]), np.array([0, 9, 12])
    q = rng.standard_normal((8, hq, D)).astype(dtype)
    k = rng.standard_normal((12, hkv, D)).astype(dtype)
    v = rng.standard_normal((12, hkv, D)).astype(dtype)
    kw = _flags(kind, hq)
    w = BatchPrefillWithRaggedKVCacheWrapper(np.zeros(1 << 22, np.uint8), "NHD")
    w.plan(qo, kv, hq, hkv, D, causal=True, q_data_type=dtype, **kw)
    out = w.run(q, k, v)
    ref = reference.batch_prefill_with_ragged_kv_cache(q, k, v, qo, kv, causal=True, **kw)
    assert rel_err(out, ref) <= TOLERANCE[dtype]
