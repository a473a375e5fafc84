"""attention_state, finalize, single decode and single prefill against the brute-force oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import assert_close
from dense import dense_attention, dense_output, flag_variant, hooks_round_to_float32

from nbinfer.formats import packbits
from nbinfer.reference import (
    attention_state,
    finalize,
    single_decode_with_kv_cache,
    single_prefill_with_kv_cache,
)
from nbinfer.variants import (
    alibi,
    attention_sink,
    causal,
    compose,
    rope_llama,
    sigmoid_attention,
    sliding_window,
    soft_cap,
)

HQ = 4

# Every built-in variant, alone and in a few combinations (built once so hooks compile once).
VARIANTS = {
    "none": None,
    "causal": causal(),
    "sliding_window": sliding_window(3),
    "soft_cap": soft_cap(5.0),
    "alibi": alibi(HQ),
    "rope_llama": rope_llama(2.0, 1e3),
    "sigmoid": sigmoid_attention(0.5, -1.0),
    "attention_sink": attention_sink([0.5, -1.0, 2.0, 0.0]),
    "causal_window_rope": compose(causal(), sliding_window(3), rope_llama()),
    "causal_sigmoid": compose(causal(), sigmoid_attention()),
}


def _tol(variant):
    return "float32" if hooks_round_to_float32(variant) else "float64"


def _randn(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_attention_state_every_variant(rng, name):
    variant = VARIANTS[name]
    lq, lkv, hkv, d = 5, 9, 2, 8
    q, k, v = _randn(rng, lq, HQ, d), _randn(rng, lkv, hkv, d), _randn(rng, lkv, hkv, d)
    mask = rng.random((lq, lkv)) < 0.8
    o, lse = attention_state(q, k, v, variant=variant, mask=mask)
    o_ref, lse_ref = dense_attention(q, k, v, variant=variant, visible=mask)
    assert_close(o, o_ref, _tol(variant), what=name)
    fin = np.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], lse_ref[fin], _tol(variant), what=f"{name} lse")
    if variant is not None and not variant.use_softmax:
        np.testing.assert_array_equal(lse, 0.0)
    out = finalize(o, lse, variant)
    assert_close(out, dense_output(o_ref, lse_ref, variant), _tol(variant), what=f"{name} out")


def test_attention_state_explicit_positions_and_scale(rng):
    variant = compose(rope_llama(), alibi(HQ), sliding_window(4))
    q, k, v = _randn(rng, 3, HQ, 8), _randn(rng, 11, 1, 8), _randn(rng, 11, 1, 8)
    q_pos = np.array([20, 3, 12], dtype=np.int64)
    kv_pos = rng.permutation(30)[:11]
    o, lse = attention_state(q, k, v, sm_scale=0.3, variant=variant, q_pos=q_pos, kv_pos=kv_pos)
    o_ref, lse_ref = dense_attention(q, k, v, sm_scale=0.3, variant=variant, q_pos=q_pos,
                                     kv_pos=kv_pos)
    assert_close(o, o_ref)
    fin = np.isfinite(lse_ref)
    assert_close(lse[fin], lse_ref[fin])


def test_attention_sink_finalize_formula(rng):
    # o / (1 + exp(sink - lse)): the sink adds exp(sink) to the softmax denominator.
    sinks = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    q, k, v = _randn(rng, 2, HQ, 8), _randn(rng, 6, 2, 8), _randn(rng, 6, 2, 8)
    o, lse = attention_state(q, k, v)
    out = finalize(o, lse, attention_sink(sinks))
    want = o / (1.0 + np.exp(sinks.astype(np.float64)[None, :] - lse))[..., None]
    assert_close(out, want)
    out2 = finalize(o, lse / math.log(2), attention_sink(sinks), lse_base=2)
    assert_close(out2, want)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("kv_len", [0, 1, 13])
def test_single_decode(rng, layout, group, kv_len):
    hkv, d = 2, 16
    hq = hkv * group
    q = _randn(rng, hq, d, dtype=np.float16)
    k, v = _randn(rng, kv_len, hkv, d), _randn(rng, kv_len, hkv, d)
    args = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    o, lse = single_decode_with_kv_cache(q, *args, kv_layout=layout, return_lse=True)
    o_ref, lse_ref = dense_attention(q[None], k, v)
    assert o.shape == (hq, d) and lse.shape == (hq,) and o.dtype == np.float64
    assert_close(o, o_ref[0])
    if kv_len == 0:
        assert np.all(o == 0) and np.all(lse == -np.inf)
    else:
        assert_close(lse, lse_ref[0])
    o2, lse2 = single_decode_with_kv_cache(q, *args, kv_layout=layout, return_lse=True,
                                           lse_base=2)
    np.testing.assert_array_equal(o2, o)
    assert_close(lse2[np.isfinite(lse2)], lse[np.isfinite(lse)] / math.log(2))


@pytest.mark.parametrize("flags", [
    dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=500.0),
    dict(pos_encoding_mode="ALIBI", window_left=5),
    dict(logits_soft_cap=3.0, sm_scale=0.7),
])
def test_single_decode_flags(rng, flags):
    q, k, v = _randn(rng, HQ, 8), _randn(rng, 12, 2, 8), _randn(rng, 12, 2, 8)
    o = single_decode_with_kv_cache(q, k, v, **flags)
    sm_scale = flags.pop("sm_scale", None)
    variant = flag_variant(HQ, **flags)
    o_ref, lse_ref = dense_attention(q[None], k, v, sm_scale=sm_scale, variant=variant)
    assert_close(o, o_ref[0], _tol(variant))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("qo_len,kv_len", [(4, 4), (3, 10), (6, 2), (5, 0)])
def test_single_prefill_causal(rng, layout, qo_len, kv_len):
    # Bottom-right causal: query i sits at i + kv_len - qo_len (qo_len > kv_len leaves the first
    # queries with no key at all).
    hkv, d = 1, 8
    q = _randn(rng, qo_len, HQ, d, dtype=np.float32)
    k, v = _randn(rng, kv_len, hkv, d), _randn(rng, kv_len, hkv, d)
    args = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    o, lse = single_prefill_with_kv_cache(q, *args, causal=True, kv_layout=layout,
                                          return_lse=True)
    visible = (np.arange(kv_len)[None, :] <= np.arange(qo_len)[:, None] + kv_len - qo_len)
    o_ref, lse_ref = dense_attention(q, k, v, visible=visible)
    assert_close(o, o_ref)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_ref))
    assert_close(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)])
    assert not np.isnan(o).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("packed", [False, True])
def test_single_prefill_custom_mask_and_flags(rng, packed):
    qo_len, kv_len, hkv, d = 5, 11, 2, 8
    q, k, v = _randn(rng, qo_len, HQ, d), _randn(rng, kv_len, hkv, d), _randn(rng, kv_len, hkv, d)
    mask = rng.random((qo_len, kv_len)) < 0.6
    kw = (dict(packed_custom_mask=packbits(mask.ravel(), "little")) if packed
          else dict(custom_mask=mask))
    flags = dict(causal=True, window_left=6, pos_encoding_mode="ROPE_LLAMA")
    o, lse = single_prefill_with_kv_cache(q, k, v, return_lse=True, **kw, **flags)
    o_ref, lse_ref = dense_attention(q, k, v, variant=flag_variant(HQ, **flags), visible=mask)
    assert_close(o, o_ref)
    fin = np.isfinite(lse_ref)
    assert_close(lse[fin], lse_ref[fin])


@pytest.mark.parametrize("name", ["soft_cap", "sigmoid", "attention_sink", "causal_sigmoid"])
def test_single_prefill_user_variant(rng, name):
    variant = VARIANTS[name]
    q, k, v = _randn(rng, 4, HQ, 8), _randn(rng, 7, 4, 8), _randn(rng, 7, 4, 8)
    o = single_prefill_with_kv_cache(q, k, v, variant=variant, pos_encoding_mode="ALIBI")
    full = flag_variant(HQ, variant, pos_encoding_mode="ALIBI")
    o_ref, lse_ref = dense_attention(q, k, v, variant=full)
    assert_close(o, dense_output(o_ref, lse_ref, full), _tol(full))
