"""Variant specs: every built-in hook against an independent NumPy formula, compose(),
from_flashinfer_args(), hashing (kernel-cache keys), validation, and float32 compilation.

Hooks are evaluated through ``nbinfer.variants.host`` (the float64 ufuncs the reference engine
uses); expected values are written here from the papers' formulas, not from the hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numba
import numpy as np
import pytest
from conftest import assert_close

from nbinfer.variants import (
    HOOK_KINDS,
    PARAMETER_FREE,
    POS_ENCODING_MODES,
    Variant,
    alibi,
    alibi_slopes,
    attention_sink,
    causal,
    compose,
    from_flashinfer_args,
    host,
    resolve,
    rope_llama,
    sigmoid_attention,
    sliding_window,
    soft_cap,
    standard,
)

# ---------------------------------------------------------------------------------------------
# independent NumPy formulas


def np_alibi_slopes(n: int) -> np.ndarray:
    """Press et al.'s reference construction (geometric sequences), in float64."""

    def power_of_2(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return np.array(power_of_2(n))
    closest = 2 ** math.floor(math.log2(n))
    extra = power_of_2(2 * closest)[0::2][: n - closest]
    return np.array(power_of_2(closest) + extra)


def np_rope(x, pos, rope_scale, rope_theta):
    """Llama rotate-half RoPE of x [L, H, D] at positions pos [L], float64 tables."""
    d = x.shape[-1]
    inv_freq = rope_theta ** (-2.0 * np.arange(d // 2) / d)
    angle = (np.asarray(pos, np.float64) / rope_scale)[:, None] * inv_freq[None, :]  # [L, D/2]
    angle = np.concatenate([angle, angle], axis=-1)[:, None, :]  # [L, 1, D]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotate_half = np.concatenate([-x2, x1], axis=-1)
    return x * np.cos(angle) + rotate_half * np.sin(angle)


def np_softmax_attention(s, v):
    """s [H, N] logits, v [N, H, D] -> (o [H, D], lse [H]) by plain dense softmax."""
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("hn,nhd->hd", p / l, v)
    return o, (m + np.log(l))[:, 0]


def grid(rng, lq=6, lkv=9, heads=4, max_pos=50):
    """Random logits [H, Lq, Lkv] and broadcastable absolute positions / head indices."""
    q_pos = rng.integers(0, max_pos, size=lq)[None, :, None]
    kv_pos = rng.integers(0, max_pos, size=lkv)[None, None, :]
    qo_head = np.arange(heads)[:, None, None]
    s = rng.normal(scale=4.0, size=(heads, lq, lkv))
    return s, q_pos, kv_pos, qo_head


# ---------------------------------------------------------------------------------------------
# built-ins against the formulas


def test_standard_is_identity(rng):
    v = standard()
    assert v.is_standard and v.use_softmax
    assert all(getattr(v, k) == () for k in HOOK_KINDS)
    s, qp, kp, h = grid(rng)
    assert host.transform_logits(v, s, qp, kp, h) is s
    assert host.logits_keep(v, qp, kp, h) is None
    x = rng.normal(size=(3, 2, 8))
    assert host.transform_vectors(v, "query_transform", x, np.arange(3), np.arange(2)) is x
    o, lse = rng.normal(size=(2, 8)), rng.normal(size=2)
    assert host.transform_output(v, o, lse, np.arange(2)[:, None]) is o


@pytest.mark.parametrize("cap", [30.0, 2.5])
def test_soft_cap_is_cap_tanh(rng, cap):
    s, qp, kp, h = grid(rng)
    s *= 20.0  # reach the saturated region
    out = host.transform_logits(soft_cap(cap), s, qp, kp, h)
    np.testing.assert_allclose(out, cap * np.tanh(s / cap), rtol=1e-6, atol=1e-6 * cap)
    assert np.all(np.abs(out) <= cap)
    assert soft_cap(cap).use_softmax and soft_cap(cap).param("cap") == cap


def test_alibi_slopes_power_of_two():
    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_allclose(alibi_slopes(16), 2.0 ** (-0.5 * np.arange(1, 17)), rtol=1e-7)
    assert alibi_slopes(8).dtype == np.float32 and alibi_slopes(1).tolist() == [2.0**-8]


def test_alibi_slopes_non_power_of_two():
    s12 = alibi_slopes(12)
    np.testing.assert_array_equal(s12[:8], alibi_slopes(8))
    np.testing.assert_allclose(s12[8:], 2.0 ** -np.array([0.5, 1.5, 2.5, 3.5]), rtol=1e-7)
    for n in (2, 3, 5, 6, 7, 12, 20, 24, 40, 64):
        np.testing.assert_allclose(alibi_slopes(n), np_alibi_slopes(n), rtol=1e-7, err_msg=n)


def test_alibi_bias(rng):
    heads = 12
    s, qp, kp, h = grid(rng, heads=heads, max_pos=1000)
    out = host.transform_logits(alibi(heads), s, qp, kp, h)
    slope = np_alibi_slopes(heads)[:, None, None]
    assert_close(out, s + slope * (kp - qp), "float32", "alibi")  # slopes are float32 constants


@pytest.mark.parametrize("rope_scale, rope_theta", [(1.0, 1e4), (8.0, 5e5)])
def test_rope_llama_matches_rotate_half(rng, rope_scale, rope_theta):
    length, heads, d = 5, 3, 16
    x = rng.normal(size=(length, heads, d))
    pos = rng.integers(0, 100_000, size=length)
    v = rope_llama(rope_scale, rope_theta)
    expected = np_rope(x, pos, rope_scale, rope_theta)
    for kind in ("query_transform", "key_transform"):
        out = host.transform_vectors(v, kind, x, pos, np.arange(heads))
        assert_close(out, expected, "float64", kind)


def test_rope_preserves_norm_and_is_relative(rng):
    d = 32
    v = rope_llama(1.0, 1e4)
    q, k = rng.normal(size=(2, d))
    a, b, t = (int(p) for p in rng.integers(0, 2000, size=3))

    def rot(kind, x, positions):
        xs = np.broadcast_to(x, (len(positions), 1, d))
        return host.transform_vectors(v, kind, xs, np.array(positions), np.array([0]))[:, 0]

    rq = rot("query_transform", q, [a, a + t, 0])
    rk = rot("key_transform", k, [b, b + t])
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-12)
    np.testing.assert_allclose(rq[2], q, rtol=1e-12)  # position 0 does not rotate
    tol = 1e-10 * np.linalg.norm(q) * np.linalg.norm(k)
    assert abs(rq[0] @ rk[0] - rq[1] @ rk[1]) <= tol  # depends only on the difference a - b


def test_causal_mask_bottom_right():
    qo_len, kv_len = 3, 7
    q_pos = (np.arange(qo_len) + kv_len - qo_len)[:, None]  # absolute positions 4, 5, 6
    kv_pos = np.arange(kv_len)[None, :]
    keep = host.logits_keep(causal(), q_pos, kv_pos, 0)
    np.testing.assert_array_equal(keep, kv_pos <= q_pos)
    assert keep.dtype == np.bool_ and keep.sum() == 5 + 6 + 7


@pytest.mark.parametrize("w", [0, 1, 5])
def test_sliding_window_mask(rng, w):
    _, qp, kp, h = grid(rng, max_pos=20)
    keep = host.logits_keep(sliding_window(w), qp, kp, h)
    np.testing.assert_array_equal(keep, np.broadcast_to(kp >= qp - w, keep.shape))
    both = host.logits_keep(compose(causal(), sliding_window(w)), qp, kp, h)
    np.testing.assert_array_equal(both, np.broadcast_to((kp <= qp) & (kp >= qp - w), keep.shape))


@pytest.mark.parametrize("scale, bias", [(0.75, -1.5), (0.3, 2.0)])
def test_sigmoid_attention(rng, scale, bias):
    v = sigmoid_attention(scale=scale, bias=bias)
    assert v.use_softmax is False and not v.is_standard
    s, qp, kp, h = grid(rng)
    s[0, 0, :3] = [-1e4, 1e4, 0.0]  # saturation: exactly 0 and 1, never NaN
    with np.errstate(over="ignore"):  # exp(7500) = inf: the weight is exactly 0, as intended
        out = host.transform_logits(v, s, qp, kp, h)
        expected = 1.0 / (1.0 + np.exp(-(s * scale + bias)))
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-12)
    assert np.all((out >= 0) & (out <= 1)) and out[0, 0, 0] == 0.0 and out[0, 0, 1] == 1.0


def sinks_for(rng, heads):
    return rng.normal(scale=2.0, size=heads).astype(np.float32)  # float32-exact sink logits


def test_attention_sink_formula(rng):
    heads, d = 4, 8
    sinks = sinks_for(rng, heads)
    o = rng.normal(size=(3, heads, d))
    lse = rng.normal(scale=3.0, size=(3, heads))
    out = host.transform_output(attention_sink(sinks), o, lse, np.arange(heads)[:, None])
    expected = o / (1.0 + np.exp(sinks.astype(np.float64)[None, :, None] - lse[..., None]))
    assert_close(out, expected, "float64", "sink")


def test_attention_sink_is_an_extra_zero_value_logit(rng):
    heads, n, d = 4, 11, 8
    sinks = sinks_for(rng, heads).astype(np.float64)
    s = rng.normal(scale=3.0, size=(heads, n))
    v = rng.normal(size=(n, heads, d))
    o, lse = np_softmax_attention(s, v)
    out = host.transform_output(attention_sink(sinks), o, lse, np.arange(heads)[:, None])
    s_ext = np.concatenate([s, sinks[:, None]], axis=1)
    v_ext = np.concatenate([v, np.zeros((1, heads, d))], axis=0)
    expected, _ = np_softmax_attention(s_ext, v_ext)
    assert_close(out, expected, "float64", "sink vs extra column")


def test_attention_sink_empty_rows_and_extremes(rng):
    heads, d = 3, 4
    v = attention_sink(sinks_for(rng, heads))
    heads_idx = np.arange(heads)[:, None]
    out = host.transform_output(v, np.zeros((heads, d)), np.full(heads, -np.inf), heads_idx)
    assert np.all(out == 0.0)  # empty KV row: O = 0, LSE = -inf -> 0, not NaN
    o = rng.normal(size=(heads, d))
    with np.errstate(over="ignore"):  # exp(sink + 1000) = inf -> o / inf = 0
        far = host.transform_output(v, o, np.array([-1e3, 1e3, 0.0]), heads_idx)
    assert np.all(np.isfinite(far)) and np.all(far[0] == 0.0)
    np.testing.assert_allclose(far[1], o[1], rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# compose and from_flashinfer_args


def test_compose_orders_logits_transforms(rng):
    s, qp, kp, h = grid(rng, heads=4, max_pos=200)
    s *= 5.0
    bias = np_alibi_slopes(4)[:, None, None] * (kp - qp)
    cap_then_bias = host.transform_logits(compose(soft_cap(10.0), alibi(4)), s, qp, kp, h)
    bias_then_cap = host.transform_logits(compose(alibi(4), soft_cap(10.0)), s, qp, kp, h)
    assert_close(cap_then_bias, 10.0 * np.tanh(s / 10.0) + bias, "float32", "cap, alibi")
    assert_close(bias_then_cap, 10.0 * np.tanh((s + bias) / 10.0), "float32", "alibi, cap")
    assert compose(soft_cap(10.0), alibi(4)) != compose(alibi(4), soft_cap(10.0))
    assert (soft_cap(10.0) + alibi(4)) == compose(soft_cap(10.0), alibi(4))


def test_compose_ands_masks(rng):
    def even_heads(q_pos, kv_pos, qo_head):
        return qo_head % 2 == 0

    _, qp, kp, h = grid(rng, max_pos=20)
    v = compose(causal(), Variant("even_heads", logits_mask=even_heads), sliding_window(4))
    assert len(v.logits_mask) == 3 and v.name == "causal+even_heads+sliding_window_4"
    keep = host.logits_keep(v, qp, kp, h)
    np.testing.assert_array_equal(keep, (kp <= qp) & (kp >= qp - 4) & (h % 2 == 0))


def test_compose_use_softmax():
    sig = sigmoid_attention(0.5, 0.25)
    with pytest.raises(ValueError, match="use_softmax"):
        compose(sig, attention_sink([0.5]))

    def scale_output(o, lse, qo_head):
        return o * 2.0

    with pytest.raises(ValueError, match="use_softmax"):
        compose(Variant("doubled", output_transform=scale_output), sig)
    # Masks, RoPE and logits transforms are defined under either normalisation.
    for other in (causal(), sliding_window(8), rope_llama(), alibi(4), soft_cap(5.0)):
        v = compose(other, sig)
        assert v.use_softmax is False
        assert v.logits_transform[-1] is sig.logits_transform[0]
    assert compose(attention_sink([0.5]), causal()).use_softmax is True


def test_standard_composes_with_anything():
    sig = sigmoid_attention(0.5, 0.25)
    for v in (causal(), soft_cap(30.0), sig, attention_sink([1.0, 2.0]), rope_llama()):
        assert compose(standard(), v) == v == compose(v, standard()) == standard() + v
        assert compose(standard(), v).use_softmax == v.use_softmax
    assert compose(standard(), standard()) == standard()
    assert compose(standard()).is_standard
    with pytest.raises(ValueError, match="at least one"):
        compose()
    with pytest.raises(TypeError, match="Variant"):
        compose(causal(), "causal")


FLASHINFER_CASES = [
    ({}, lambda: standard()),
    ({"causal": True}, lambda: causal()),
    ({"window_left": -1, "logits_soft_cap": 0.0}, lambda: standard()),
    ({"window_left": 5}, lambda: sliding_window(5)),
    ({"logits_soft_cap": 30.0}, lambda: soft_cap(30.0)),
    ({"pos_encoding_mode": "ROPE_LLAMA"}, lambda: rope_llama(1.0, 1e4)),
    (
        {"pos_encoding_mode": "ROPE_LLAMA", "rope_scale": 8.0, "rope_theta": 5e5, "causal": True},
        lambda: compose(rope_llama(8.0, 5e5), causal()),
    ),
    ({"pos_encoding_mode": "ALIBI", "num_qo_heads": 8}, lambda: alibi(8)),
    (
        {"causal": True, "window_left": 16, "logits_soft_cap": 50.0,
         "pos_encoding_mode": "ALIBI", "num_qo_heads": 8},
        lambda: compose(alibi(8), soft_cap(50.0), causal(), sliding_window(16)),
    ),
    (
        {"causal": True, "logits_soft_cap": 20.0, "pos_encoding_mode": "ROPE_LLAMA"},
        lambda: compose(rope_llama(), soft_cap(20.0), causal()),
    ),
]


@pytest.mark.parametrize("kwargs, expected", FLASHINFER_CASES)
def test_from_flashinfer_args(kwargs, expected):
    v = from_flashinfer_args(**kwargs)
    assert v == expected() and hash(v) == hash(expected())
    assert v.use_softmax


def test_from_flashinfer_args_behaviour(rng):
    """Everything on at once: bias then cap on the logits, causal AND window on the mask."""
    v = from_flashinfer_args(causal=True, window_left=3, logits_soft_cap=8.0,
                             pos_encoding_mode="ALIBI", num_qo_heads=4)
    s, qp, kp, h = grid(rng, heads=4, max_pos=30)
    bias = np_alibi_slopes(4)[:, None, None] * (kp - qp)
    assert_close(host.transform_logits(v, s, qp, kp, h), 8.0 * np.tanh((s + bias) / 8.0),
                 "float32", "alibi+cap")
    np.testing.assert_array_equal(host.logits_keep(v, qp, kp, h),
                                  np.broadcast_to((kp <= qp) & (kp >= qp - 3), s.shape))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"pos_encoding_mode": "ROPE"}, ValueError, "pos_encoding_mode"),
    ({"pos_encoding_mode": "rope_llama"}, ValueError, "pos_encoding_mode"),
    ({"pos_encoding_mode": "ALIBI"}, ValueError, "num_qo_heads"),
    ({"window_left": -2}, ValueError, "window_left"),
    ({"window_left": 2.0}, TypeError, "window_left"),
    ({"window_left": None}, TypeError, "window_left"),
    ({"causal": 1}, TypeError, "causal"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
    ({"logits_soft_cap": -30}, ValueError, "logits_soft_cap"),
    ({"logits_soft_cap": float("nan")}, ValueError, "logits_soft_cap"),
    ({"logits_soft_cap": float("inf")}, ValueError, "logits_soft_cap"),
    ({"logits_soft_cap": -float("inf")}, ValueError, "logits_soft_cap"),
    ({"logits_soft_cap": 1e39}, ValueError, "logits_soft_cap"),  # overflows float32
    ({"logits_soft_cap": "30"}, TypeError, "logits_soft_cap"),
    ({"logits_soft_cap": True}, TypeError, "logits_soft_cap"),
    ({"pos_encoding_mode": "ROPE_LLAMA", "rope_theta": 0.0}, ValueError, "rope_theta"),
])
def test_from_flashinfer_args_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        from_flashinfer_args(**kwargs)
    assert POS_ENCODING_MODES == ("NONE", "ROPE_LLAMA", "ALIBI")


def test_logits_soft_cap_message_says_what_is_accepted():
    with pytest.raises(ValueError) as info:
        from_flashinfer_args(logits_soft_cap=-2.5)
    msg = str(info.value)
    assert "logits_soft_cap must be a positive finite float" in msg
    assert "-2.5" in msg and "None or 0.0" in msg


@pytest.mark.parametrize("off", [None, 0.0, 0, -0.0, np.float32(0.0)])
def test_logits_soft_cap_none_or_zero_is_off(off):
    # FlashInfer's convention: 0.0 (and None) means no soft cap.
    assert from_flashinfer_args(logits_soft_cap=off) == standard()
    assert from_flashinfer_args(logits_soft_cap=np.float32(30.0)) == soft_cap(30.0)


# ---------------------------------------------------------------------------------------------
# resolve: the variant= argument


def test_resolve_passes_none_and_variants_through():
    assert resolve(None) is None
    v = compose(causal(), soft_cap(30.0))
    assert resolve(v) is v


@pytest.mark.parametrize("name, expected", [
    ("standard", standard),
    ("causal", causal),
    ("rope_llama", lambda: rope_llama(1.0, 1e4)),
    ("sigmoid", lambda: sigmoid_attention(1.0, 0.0)),
])
def test_resolve_names_of_parameter_free_builtins(name, expected):
    assert resolve(name) == expected()
    assert name in PARAMETER_FREE


def test_resolve_rejects_other_names_and_types():
    with pytest.raises(ValueError) as info:
        resolve("soft_cap")
    msg = str(info.value)
    assert msg.startswith("variant must be") and "'soft_cap'" in msg
    for name in PARAMETER_FREE:  # lists what it accepts ...
        assert repr(name) in msg
    # ... and where the variants with parameters come from.
    assert "nbinfer.variants.soft_cap(cap)" in msg and "nbinfer.variants.sliding_window" in msg
    for bad in ("", "Causal", "sliding_window_4"):
        with pytest.raises(ValueError, match="variant"):
            resolve(bad)
    for bad in (3, ["causal"], causal):  # a factory is not its product
        with pytest.raises(TypeError, match="variant"):
            resolve(bad)


# ---------------------------------------------------------------------------------------------
# hashing: specs are kernel-cache keys


BUILTIN_FACTORIES = {
    "standard": standard,
    "causal": causal,
    "sliding_window": lambda: sliding_window(7),
    "soft_cap": lambda: soft_cap(30.0),
    "alibi": lambda: alibi(12),
    "rope_llama": lambda: rope_llama(8.0, 5e5),
    "sigmoid": lambda: sigmoid_attention(0.75, -1.5),
    "attention_sink": lambda: attention_sink([0.5, -1.0]),
}


@pytest.mark.parametrize("name", sorted(BUILTIN_FACTORIES))
def test_equal_factories_give_equal_specs(name):
    a, b = BUILTIN_FACTORIES[name](), BUILTIN_FACTORIES[name]()
    assert a is not b and a == b and hash(a) == hash(b)
    assert {a: "kernel"}[b] == "kernel"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.name = "other"


def test_specs_work_as_functools_cache_keys():
    builds = []

    @functools.cache
    def build_kernel(variant, head_dim):
        builds.append(variant.name)
        return object()

    k1 = build_kernel(compose(causal(), soft_cap(30.0)), 128)
    k2 = build_kernel(compose(causal(), soft_cap(30.0)), 128)
    k3 = build_kernel(compose(causal(), soft_cap(50.0)), 128)
    assert k1 is k2 and k3 is not k1 and builds == ["causal+soft_cap_30", "causal+soft_cap_50"]


def test_different_params_give_different_specs():
    specs = [
        standard(), causal(), sliding_window(3), sliding_window(4), soft_cap(30.0),
        soft_cap(50.0), alibi(8), alibi(16), rope_llama(1.0, 1e4), rope_llama(2.0, 1e4),
        rope_llama(1.0, 5e5), sigmoid_attention(1.0, 0.0), sigmoid_attention(1.0, -1.0),
        attention_sink([0.5]), attention_sink([0.25]), attention_sink([0.5, 0.5]),
        compose(causal(), sliding_window(3)), compose(sliding_window(3), causal()),
    ]
    assert len(set(specs)) == len(specs)
    assert len({hash(v) for v in specs}) == len(specs)


def make_temperature(t):
    """A user-defined variant: logits divided by a temperature captured as float32."""
    temp = np.float32(t)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return s / temp

    return Variant("temperature", logits_transform=logits_transform)


def make_relu_attention(shift):
    """A user-defined no-softmax variant: w = relu(s - shift)."""
    shift = np.float32(shift)
    zero = np.float32(0.0)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return max(s - shift, zero)

    return Variant("relu", logits_transform=logits_transform, use_softmax=False)


def make_head_bias(table):
    """A user-defined variant capturing an array: one additive bias per query head."""

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return s + table[qo_head]

    return Variant("head_bias", logits_transform=logits_transform)


def test_user_variant_hashes_by_code_and_captured_values(rng):
    # Same name, no params: only the captured values tell these apart.
    assert make_temperature(2.0) == make_temperature(2.0)
    assert hash(make_temperature(2.0)) == hash(make_temperature(2.0))
    assert make_temperature(2.0) != make_temperature(3.0)
    assert make_relu_attention(0.5) == make_relu_attention(0.5) != make_relu_attention(0.0)
    s, qp, kp, h = grid(rng)
    np.testing.assert_allclose(host.transform_logits(make_temperature(2.0), s, qp, kp, h), s / 2)
    np.testing.assert_allclose(host.transform_logits(make_relu_attention(0.5), s, qp, kp, h),
                               np.maximum(s - 0.5, 0.0))
    assert compose(causal(), make_relu_attention(0.5)).use_softmax is False


def test_user_variant_hashes_captured_arrays_by_content(rng):
    table = rng.normal(size=4)
    a, b = make_head_bias(table), make_head_bias(table.copy())
    assert a == b and hash(a) == hash(b)
    changed = table.copy()
    changed[2] += 1.0
    assert make_head_bias(changed) != a
    assert make_head_bias(table.astype(np.float32)) != a  # same numbers, different dtype
    assert make_head_bias(table.reshape(2, 2)) != a  # same bytes, different shape
    s, qp, kp, h = grid(rng, heads=4)
    out = host.transform_logits(make_head_bias(changed), s, qp, kp, h)
    np.testing.assert_allclose(out, s + changed[:, None, None])


def test_captured_python_scalars_are_typed():
    # 2 == 2.0 == True in Python, but Numba types (and may compile) them differently.
    def make(c):
        def logits_transform(s, q_pos, kv_pos, qo_head):
            return s * c

        return Variant("times", logits_transform=logits_transform)

    assert len({make(2), make(2.0), make(True), make(np.float32(2)), make(np.int32(2))}) == 5
    assert make(0.0) != make(-0.0) and make(float("nan")) == make(float("nan"))


SOURCE = """
import numpy as np
T = np.float32({t})

def logits_transform(s, q_pos, kv_pos, qo_head):
    return s / T
"""


def test_globals_read_by_hooks_are_part_of_the_key():
    """A notebook cell re-run with a new global must not reuse the old compiled hook."""
    spaces = [{}, {}, {}]
    for ns, t in zip(spaces, (2.0, 4.0, 2.0), strict=True):
        exec(compile(SOURCE.format(t=t), "<notebook cell>", "exec"), ns)
    v2, v4, v2_again = (Variant("temp", logits_transform=ns["logits_transform"]) for ns in spaces)
    assert v2 != v4 and v2 == v2_again
    s = np.array([1.0, -3.0])
    np.testing.assert_array_equal(host.transform_logits(v2, s, 0, 0, 0), s / 2)
    np.testing.assert_array_equal(host.transform_logits(v4, s, 0, 0, 0), s / 4)


def test_equal_hooks_compile_once():
    a = soft_cap(30.0).logits_transform[0]
    b = soft_cap(30.0).logits_transform[0]
    assert a is not b
    assert host._ufunc("logits_transform", a) is host._ufunc("logits_transform", b)
    rope = rope_llama().query_transform[0]
    assert host._ufunc("query_transform", rope) is host._ufunc("key_transform", rope)


def test_repr_and_params():
    v = compose(causal(), soft_cap(30.0), sliding_window(4))
    assert repr(v) == "Variant(causal+soft_cap_30+sliding_window_4: cap=30.0, window_left=4)"
    assert v.param("window_left") == 4 and v.param("cap") == 30.0
    with pytest.raises(KeyError, match="theta"):
        v.param("theta")
    assert attention_sink([0.5, 1.0]).param("sinks") == (0.5, 1.0)
    assert alibi(12).param("num_heads") == 12 and alibi(12).name == "alibi_12"


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("build, error, match", [
    (lambda: soft_cap(0.0), ValueError, "cap must be a positive finite float"),
    (lambda: soft_cap(-3.0), ValueError, "cap"),
    (lambda: soft_cap(float("nan")), ValueError, "cap"),
    (lambda: soft_cap(float("inf")), ValueError, "cap"),
    (lambda: soft_cap(1e39), ValueError, "cap"),  # overflows float32
    (lambda: soft_cap(1e-40), ValueError, "cap"),  # 1 / cap overflows float32
    (lambda: soft_cap("30"), TypeError, "cap"),
    (lambda: soft_cap(True), TypeError, "cap"),
    (lambda: sliding_window(-1), ValueError, "window_left"),
    (lambda: sliding_window(2.0), TypeError, "window_left"),
    (lambda: alibi(0), ValueError, "num_heads"),
    (lambda: alibi(2.5), TypeError, "num_heads"),
    (lambda: alibi_slopes(-4), ValueError, "num_heads"),
    (lambda: rope_llama(rope_scale=0.0), ValueError, "rope_scale"),
    (lambda: rope_llama(rope_theta=-1.0), ValueError, "rope_theta"),
    (lambda: rope_llama(rope_theta=float("inf")), ValueError, "rope_theta"),
    (lambda: sigmoid_attention(scale=float("inf")), ValueError, "scale"),
    (lambda: sigmoid_attention(bias=float("nan")), ValueError, "bias"),
    (lambda: sigmoid_attention(bias=-1e39), ValueError, "bias"),
    (lambda: sigmoid_attention(scale=None), TypeError, "scale"),
    (lambda: attention_sink([]), ValueError, "sinks"),
    (lambda: attention_sink([[0.5, 1.0]]), ValueError, "sinks"),
    (lambda: attention_sink([0.5, float("nan")]), ValueError, "sinks"),
    (lambda: attention_sink([0.5, -float("inf")]), ValueError, "sinks"),
    (lambda: attention_sink([1e39]), ValueError, "sinks"),  # overflows float32
])
def test_builtin_params_validated(build, error, match):
    with pytest.raises(error, match=match):
        build()


def lt_ok(s, q_pos, kv_pos, qo_head):
    return s


def lt_three(s, q_pos, kv_pos):
    return s


def lt_varargs(s, q_pos, kv_pos, qo_head, *rest):
    return s


def lt_kwonly(s, q_pos, kv_pos, qo_head, *, extra):
    return s


@pytest.mark.parametrize("kwargs, error, match", [
    ({"logits_transform": lt_three}, ValueError, "logits_transform.*lt_three.*4"),
    ({"logits_mask": lt_ok}, ValueError, "logits_mask.*3.*takes 4"),
    ({"query_transform": lt_ok}, ValueError, "query_transform.*6"),
    ({"output_transform": lt_ok}, ValueError, "output_transform.*3"),
    ({"logits_transform": lt_varargs}, ValueError, "logits_transform.*args"),
    ({"logits_transform": lt_kwonly}, ValueError, "logits_transform.*keyword"),
    ({"logits_transform": abs}, TypeError, "logits_transform.*function"),
    ({"logits_mask": numba.njit(lambda a, b, c: True)}, TypeError, "logits_mask"),
    ({"logits_transform": (lt_ok, "lt_ok")}, TypeError, "logits_transform.*str"),
    ({"logits_transform": None}, TypeError, "logits_transform"),
    ({"logits_transform": 3.0}, TypeError, "logits_transform"),
    ({"params": (("table", [1, 2]),)}, TypeError, "'table'.*hashable"),
    ({"params": (("table", np.ones(2)),)}, TypeError, "'table'.*hashable"),
    ({"params": (("cap",),)}, TypeError, "params"),
    ({"params": ((1, 2.0),)}, TypeError, "params"),
    ({"use_softmax": 1}, TypeError, "use_softmax"),
])
def test_variant_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        Variant("custom", **kwargs)


def test_variant_name_and_hook_forms():
    with pytest.raises(TypeError, match="name"):
        Variant("")
    with pytest.raises(TypeError, match="name"):
        Variant(None)
    one, seq = Variant("a", logits_transform=lt_ok), Variant("a", logits_transform=[lt_ok])
    assert one.logits_transform == (lt_ok,) and one == seq
    assert Variant("a", params=[("k", 1)]).params == (("k", 1),)


# ---------------------------------------------------------------------------------------------
# hooks compile with Numba for float32 (what the GPU kernels capture; PTX needs a real GPU)

F32, I32 = numba.float32, numba.int32
SIGNATURES = {
    "query_transform": (F32, F32, I32, I32, I32, I32),
    "key_transform": (F32, F32, I32, I32, I32, I32),
    "logits_transform": (F32, I32, I32, I32),
    "logits_mask": (I32, I32, I32),
    "output_transform": (F32, F32, I32),
}

# The return type each built-in hook must have when compiled for float32 arguments. RoPE computes
# its angle (pos * inv_freq reaches 1e5 radians, where float32 loses 1e-2) and the rotation in
# float64 on purpose, so it returns float64; the kernel rounds the element when it stores it.
RETURN_TYPES = {
    "causal": ("logits_mask", numba.boolean),
    "sliding_window": ("logits_mask", numba.boolean),
    "soft_cap": ("logits_transform", F32),
    "alibi": ("logits_transform", F32),
    "sigmoid": ("logits_transform", F32),
    # float32 too: the angle is formed in float64, its sine and cosine in the data's precision
    "rope_llama": ("query_transform", F32),
    "attention_sink": ("output_transform", F32),
}


@pytest.fixture(scope="module")
def compiled_f32():
    """Each built-in's hooks compiled once with numba.njit for float32/int32 arguments (after
    registering ``as_type_of``, as nbinfer does before it compiles hooks)."""
    from nbinfer.variants.precision import register

    register("cpu")
    out = {}
    for name, factory in BUILTIN_FACTORIES.items():
        v = factory()
        for kind in HOOK_KINDS:
            for fn in getattr(v, kind):
                disp = numba.njit(fn)
                disp.compile(SIGNATURES[kind])
                out[name, kind] = (disp, disp.overloads[SIGNATURES[kind]].signature.return_type)
    return out


def test_every_builtin_hook_compiles_for_float32(compiled_f32):
    expected = {(name, kind) for name, (kind, _) in RETURN_TYPES.items()}
    expected.add(("rope_llama", "key_transform"))
    assert set(compiled_f32) == expected


@pytest.mark.parametrize("name", sorted(RETURN_TYPES))
def test_float32_return_types(compiled_f32, name):
    kind, rtype = RETURN_TYPES[name]
    disp, got = compiled_f32[name, kind]
    assert got == rtype, f"{name}.{kind} returns {got} for float32 inputs, expected {rtype}"
    assert disp.nopython_signatures[0].return_type == rtype


def test_float32_hooks_agree_with_float64_host(compiled_f32, rng):
    f32 = np.float32
    s = f32(rng.normal(scale=20.0))
    q, k = (np.int32(p) for p in rng.integers(0, 500, size=2))
    for name in ("soft_cap", "alibi", "sigmoid"):
        disp, _ = compiled_f32[name, "logits_transform"]
        got = disp(s, q, k, np.int32(3))
        want = host.transform_logits(BUILTIN_FACTORIES[name](), np.float64(s), q, k, 3)
        assert isinstance(got, float) and abs(got - want) <= 1e-5 * max(1.0, abs(want)), name
    disp, _ = compiled_f32["attention_sink", "output_transform"]
    assert disp(f32(1.5), f32(-np.inf), np.int32(1)) == 0.0
    np.testing.assert_allclose(disp(f32(1.5), f32(0.25), np.int32(0)),
                               1.5 / (1.0 + np.exp(0.5 - 0.25)), rtol=1e-6)
    disp, _ = compiled_f32["sliding_window", "logits_mask"]
    assert disp(np.int32(10), np.int32(3), np.int32(0)) and not disp(np.int32(10), np.int32(2),
                                                                      np.int32(0))


def test_keys_of_unusual_captures():
    """Unhashable captures key by identity (kept alive); self-reference does not recurse."""
    box_a, box_b = [1.0], [1.0]

    def make(box):
        def logits_transform(s, q_pos, kv_pos, qo_head):
            return s + box[0]

        return Variant("boxed", logits_transform=logits_transform)

    assert make(box_a) == make(box_a) and make(box_a) != make(box_b)

    def recursive(s, q_pos, kv_pos, qo_head):
        return recursive(s, q_pos, kv_pos, qo_head) if s > 0 else s

    assert Variant("r", logits_transform=recursive) == Variant("r", logits_transform=recursive)


def test_rope_float32_path_stays_accurate_at_large_positions(compiled_f32, rng):
    """Compiled for float32 (a kernel's types) the RoPE hook still forms and reduces the angle
    in float64, and only its sine and cosine are float32: at positions 1e5-2e5 the rotation is
    within float32 rounding of the exact one (a float32 angle would be off by 1e-2 radians)."""
    disp, _ = compiled_f32["rope_llama", "key_transform"]
    d = 128
    x = rng.normal(size=d).astype(np.float32)
    pos = int(rng.integers(100_000, 200_000))
    got = np.array([disp(x[i], x[(i + d // 2) % d], np.int32(i), np.int32(d), np.int32(pos),
                         np.int32(0)) for i in range(d)])
    want = np_rope(x[None, None].astype(np.float64), [pos], 8.0, 5e5)[0, 0]
    assert np.abs(got - want).max() <= 2e-6 * np.abs(x).max()


def test_hook_key_follows_the_as_type_of_rule(monkeypatch):
    """A hook that calls as_type_of is keyed (in the kernel cache too) by the overload's rule,
    not only by as_type_of's plain-Python body: a changed rule must not load old kernels."""
    from nbinfer.kernels.cache import stable
    from nbinfer.variants import precision

    before = stable(rope_llama(8.0, 5e5))

    def narrowing_half_too(types):  # a different rule
        def impl(value, x):
            return lambda value, x: value

        return impl

    monkeypatch.setattr(precision, "_implementation", narrowing_half_too)
    assert stable(rope_llama(8.0, 5e5)) != before


def test_variant_hash_is_cached_and_not_pickled():
    """The hash is computed once (plan() and run() memos hash specs holding the variant), and an
    unpickled variant recomputes it: str hashes differ between processes."""
    import pickle

    v = sliding_window(64)
    assert hash(v) == hash(v._key) and "_hash" not in v.__getstate__()
    w = pickle.loads(pickle.dumps(standard()))
    assert w == standard() and hash(w) == hash(standard())
