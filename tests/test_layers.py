"""The layer operations around attention (RMSNorm, fused add + RMSNorm, SiLU-and-multiply,
rotary embeddings from a cos/sin table): the reference against their definitions and the
engine's NumPy model, the kernels in the simulator against the reference (fp16 / fp32 arrays
through the api, bf16 as int16 bits through the kernels), strided rows of a fused projection,
and the errors. The GPU (torch tensors, the engine's model) is tests/test_engine_gpu.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SIMULATOR, assert_close

import nbinfer
from nbinfer import reference
from nbinfer.reference.layers import cos_sin_cache, round_to

BACKENDS = ["reference"] + (["sim"] if SIMULATOR else [])


def _table(rng, rot, max_pos=64):
    inv = 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot) * rng.uniform(0.5, 1.5)
    return cos_sin_cache(inv, max_pos)


# --- the reference ---------------------------------------------------------------------------
def test_reference_definitions(rng):
    x = rng.standard_normal((3, 8))
    w = rng.standard_normal(8)
    y = reference.layers.rmsnorm(x, w, 1e-5)
    assert np.allclose(np.sqrt(np.mean((y / w) ** 2, axis=-1)), 1.0 / np.sqrt(1 + 1e-5 / np.mean(
        x * x, axis=-1)))
    r = rng.standard_normal((3, 8))
    normed, total = reference.layers.fused_add_rmsnorm(x, r, w, 1e-5)
    assert np.array_equal(total, x + r) and np.allclose(normed, reference.layers.rmsnorm(
        x + r, w, 1e-5))
    g, u = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
    out = reference.layers.silu_and_mul(np.concatenate([g, u], axis=1))
    assert np.allclose(out, g * (1 / (1 + np.exp(-g))) * u)
    # a rotation keeps each pair's length; position 0 is the identity
    table = _table(rng, 8)
    q, k = rng.standard_normal((4, 2 * 8)), rng.standard_normal((4, 8))
    pos = np.array([0, 3, 17, 63])
    qr, kr = reference.layers.apply_rope_with_cos_sin_cache(pos, q, k, 8, table)
    assert np.allclose(qr[0], q[0]) and np.allclose(kr[0], k[0])
    qh, qrh = q.reshape(4, 2, 8), qr.reshape(4, 2, 8)
    assert np.allclose(qh[..., :4] ** 2 + qh[..., 4:] ** 2, qrh[..., :4] ** 2 + qrh[..., 4:] ** 2,
                       atol=1e-5)


def test_rope_table_is_the_engine_models_rotation(rng):
    # the NumPy model's own RoPE (Llama-3 frequency scaling) equals the table form
    from nbinfer.engine import NumpyLlama, init_weights, named_config
    from nbinfer.engine.model import rope_frequencies

    cfg = dataclasses.replace(named_config("tiny"), rope_theta=500000.0,
                              rope_scaling=named_config("llama-3.2-1b").rope_scaling)
    model = NumpyLlama(cfg, init_weights(cfg))
    x = rng.standard_normal((5, cfg.num_heads, cfg.head_dim))
    pos = rng.integers(0, 500, 5)
    table = cos_sin_cache(rope_frequencies(cfg), 512)
    got, _ = reference.layers.apply_rope_with_cos_sin_cache(pos, x, x[:, :1], cfg.head_dim, table)
    assert np.allclose(got, model.rope(x, pos), atol=1e-6)


def test_round_to_bfloat16_is_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -3.14159])
    assert list(round_to(x, "bfloat16")[:3]) == [1.0, 1.0, 1.0 + 4 * 2 ** -8]
    assert abs(round_to(x, "bfloat16")[3] + 3.140625) < 1e-12


# --- the api (reference backend, and the kernels in the simulator) ----------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, w_dtype", [("float16", "float16"), ("float32", "float32"),
                                            ("float16", "float32")])
def test_rmsnorm_and_fused_add(rng, backend, dtype, w_dtype):
    rows, hidden = 3, 80  # not a multiple of the simulator's 32 threads
    wide = rng.standard_normal((rows, hidden + 16)).astype(dtype)
    x = wide[:, 8:8 + hidden]  # rows strided, as a slice of a wider activation
    w = rng.uniform(0.5, 1.5, hidden).astype(w_dtype)
    out = nbinfer.rmsnorm(x, w, 1e-5, backend=backend)
    assert out.shape == (rows, hidden) and out.dtype == np.dtype(dtype)
    assert_close(out, reference.layers.rmsnorm(x, w, 1e-5), dtype, "rmsnorm")

    x = rng.standard_normal((rows, hidden)).astype(dtype)
    r = (3 * rng.standard_normal((rows, hidden))).astype(dtype)
    ref_normed, ref_total = reference.layers.fused_add_rmsnorm(x, r, w, 1e-5, dtype=dtype)
    nbinfer.fused_add_rmsnorm(x, r, w, 1e-5, backend=backend)
    assert np.array_equal(r.astype(np.float64), ref_total)  # the sum, rounded once, exactly
    assert_close(x, ref_normed, dtype, "fused_add_rmsnorm")


@pytest.mark.parametrize("backend", BACKENDS)
def test_read_only_strided_inputs_and_outputs_in_place(rng, backend):
    # a read-only strided input is read as it is (the simulator through a contiguous copy,
    # with that copy's strides); rmsnorm may write over its own input; a read-only out is
    # refused, never silently left unwritten
    wide = rng.standard_normal((3, 90)).astype(np.float16)
    wide.flags.writeable = False
    x, w = wide[:, 8:72], rng.uniform(0.5, 1.5, 64).astype(np.float16)
    assert_close(nbinfer.rmsnorm(x, w, backend=backend), reference.layers.rmsnorm(x, w, 1e-6),
                 "float16", "rmsnorm of a read-only slice")
    assert_close(nbinfer.silu_and_mul(wide[:, :80], backend=backend),
                 reference.layers.silu_and_mul(wide[:, :80]), "float16", "silu, read-only")
    y = x.copy()
    assert nbinfer.rmsnorm(y, w, out=y, backend=backend) is y
    assert_close(y, reference.layers.rmsnorm(x, w, 1e-6), "float16", "rmsnorm in place")
    ro = np.empty((3, 64), np.float16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        nbinfer.rmsnorm(x, w, out=ro, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_silu_and_mul(rng, backend, dtype):
    rows, d = 4, 40
    wide = (2 * rng.standard_normal((rows, 2 * d + 6))).astype(dtype)
    x = wide[:, :2 * d]
    out = nbinfer.silu_and_mul(x, backend=backend)
    assert out.shape == (rows, d)
    assert_close(out, reference.layers.silu_and_mul(x), dtype, "silu_and_mul")
    given = np.empty((rows, d), dtype)
    assert nbinfer.silu_and_mul(x, out=given, backend=backend) is given
    assert np.array_equal(given, out)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_neox, rot", [(True, 16), (False, 16), (True, 8)])
def test_rope_in_place_on_a_fused_qkv(rng, backend, is_neox, rot):
    # q and k are views of one [tokens, (Hq + 2 Hk) D] projection output, rotated in place;
    # 40 heads x rot / 2 pairs: at rot 16 more than one pass of the simulated kernel's 32
    # threads x 8 pairs, the second one partial
    n, hq, hk, d = 3, 32, 8, 16
    qkv = rng.standard_normal((n, (hq + 2 * hk) * d)).astype(np.float16)
    q, k = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d]
    v_before = qkv[:, (hq + hk) * d:].copy()
    table = _table(rng, rot)
    pos = rng.integers(0, 64, n).astype(np.int32)
    ref_q, ref_k = reference.layers.apply_rope_with_cos_sin_cache(pos, q, k, d, table, is_neox)
    nbinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, table, is_neox, backend=backend)
    assert_close(q, ref_q, "float16", "q")
    assert_close(k, ref_k, "float16", "k")
    assert np.array_equal(qkv[:, (hq + hk) * d:], v_before)  # v untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_out_of_place_partial_rotary(rng, backend):
    n, hq, hk, d, rot = 3, 2, 1, 16, 8
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hk, d)).astype(np.float32)
    keep_q, keep_k = q.copy(), k.copy()
    table = _table(rng, rot)
    pos = rng.integers(0, 64, n)  # int64
    qr, kr = nbinfer.apply_rope_with_cos_sin_cache(pos, q, k, d, table, backend=backend)
    ref_q, ref_k = reference.layers.apply_rope_with_cos_sin_cache(pos, q, k, d, table)
    assert qr.shape == q.shape and kr.shape == k.shape
    assert_close(qr, ref_q, "float32", "q")
    assert_close(kr, ref_k, "float32", "k")
    assert np.array_equal(qr[..., rot:], q[..., rot:])  # the unrotated dims, copied
    assert np.array_equal(q, keep_q) and np.array_equal(k, keep_k)  # inputs untouched


def test_rope_position_outside_the_table(rng):
    q, k = (rng.standard_normal((2, 16)).astype(np.float32) for _ in range(2))
    table = _table(rng, 8, max_pos=4)  # partial rotary: 8 of 16 dimensions
    with pytest.raises(ValueError, match="positions must be in 0..3"):
        nbinfer.apply_rope_with_cos_sin_cache(np.array([1, 4]), q, k, 16, table,
                                              backend="reference")
    with pytest.raises(ValueError, match="at least one row"):
        nbinfer.apply_rope_with_cos_sin_cache(np.array([0, 0]), q, k, 16, table[:0],
                                              backend="reference")
    if SIMULATOR:  # the kernel cannot raise: that token's rows become NaN (the unrotated
        # dimensions too), the others rotate
        qr, kr = nbinfer.apply_rope_with_cos_sin_cache(np.array([1, 4]), q, k, 16, table,
                                                       backend="sim")
        assert np.all(np.isnan(qr[1])) and np.all(np.isnan(kr[1]))
        assert np.all(np.isfinite(qr[0])) and np.all(np.isfinite(kr[0]))


# --- bf16 through the kernels (NumPy has no bfloat16: int16 bits) -------------------------------
def _bits(x):
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16).view(np.int16)


def _values(bits):
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.skipif(not SIMULATOR, reason="kernels run in the simulator here")
def test_bf16_kernels(rng):
    from nbinfer.kernels.layers import (
        NormSpec,
        RopeSpec,
        SiluMulSpec,
        build_rmsnorm_kernel,
        build_rope_kernel,
        build_silu_and_mul_kernel,
        norm_spec,
    )

    rows, hidden = 2, 48
    # the strided loop (items 0) and the row in registers (2 per thread, the second partial)
    for spec in (NormSpec("bfloat16", "float32", True, sim=True),
                 norm_spec("bfloat16", "float32", True, True, hidden)):
        x, r = _bits(rng.standard_normal((rows, hidden))), _bits(3 * rng.standard_normal(
            (rows, hidden)))
        w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
        ref_n, ref_t = reference.layers.fused_add_rmsnorm(_values(x), _values(r), w, 1e-6,
                                                          dtype="bfloat16")
        build_rmsnorm_kernel(spec)[rows, spec.threads](x.ravel(), r.ravel(), w, x.ravel(),
                                                       np.int32(hidden), np.int64(hidden),
                                                       np.int64(hidden), np.int64(hidden),
                                                       np.float32(1e-6))
        assert np.array_equal(_values(r), ref_t), spec.items
        assert_close(_values(x), ref_n, "bfloat16", f"fused_add_rmsnorm bf16, {spec.items}")

    d = 24
    gu = _bits(2 * rng.standard_normal((rows, 2 * d)))
    out = np.empty((rows, d), np.int16)
    spec = SiluMulSpec("bfloat16", sim=True)
    build_silu_and_mul_kernel(spec)[(rows, 1), spec.threads](gu.ravel(), out.ravel(),
                                                             np.int32(d), np.int64(2 * d),
                                                             np.int64(d))
    assert_close(_values(out), reference.layers.silu_and_mul(_values(gu)), "bfloat16", "silu")

    n, h, hd = 3, 2, 8
    q, k = _bits(rng.standard_normal((n, h * hd))), _bits(rng.standard_normal((n, hd)))
    table, pos = _table(rng, hd), np.array([5, 0, 40], np.int64)
    ref_q, ref_k = reference.layers.apply_rope_with_cos_sin_cache(pos, _values(q), _values(k),
                                                                  hd, table)
    spec = RopeSpec("bfloat16", hd, hd, True, "int64", False, sim=True)
    qf, kf = q.ravel(), k.ravel()
    build_rope_kernel(spec)[n, spec.threads](qf, qf, kf, kf, pos, table.ravel(), np.int32(h),
                                             np.int32(1), np.int64(64),
                                             *(np.int64(s) for s in (h * hd, hd, h * hd, hd,
                                                                     hd, hd, hd, hd)))
    assert_close(_values(q), ref_q, "bfloat16", "rope q")
    assert_close(_values(k), ref_k, "bfloat16", "rope k")


def test_norm_spec_holds_the_row_in_registers_up_to_32_per_thread():
    from nbinfer.kernels.layers import LAYER_THREADS, SIM_THREADS, NormSpec, norm_spec

    # the smallest power of two of elements per thread that covers the row
    assert [norm_spec("bfloat16", "float32", True, False, h).items
            for h in (1, 256, 257, 896, 2048, 4096, 8192)] == [1, 1, 2, 4, 8, 16, 32]
    assert norm_spec("float16", "float16", False, False, 8193).items == 0  # the strided loop
    assert SIM_THREADS == 32 and norm_spec("float16", "float16", False, True, 80).items == 4
    assert LAYER_THREADS * 32 == 8192
    with pytest.raises(ValueError, match="items"):
        NormSpec("float16", "float16", False, False, 3)


# --- errors ---------------------------------------------------------------------------------
def test_errors_name_the_argument(rng):
    x = rng.standard_normal((2, 8)).astype(np.float16)
    with pytest.raises(ValueError, match="weight"):
        nbinfer.rmsnorm(x, np.ones(6, np.float16), backend="reference")
    with pytest.raises(TypeError, match="weight must have the input's dtype"):
        nbinfer.rmsnorm(x.astype(np.float32), np.ones(8, np.float16), backend="reference")
    with pytest.raises(TypeError, match="input must have dtype"):
        nbinfer.rmsnorm(x.astype(np.int32), np.ones(8, np.float16), backend="reference")
    with pytest.raises(ValueError, match="residual"):
        nbinfer.fused_add_rmsnorm(x, x[:1].copy(), np.ones(8, np.float16), backend="reference")
    with pytest.raises(ValueError, match="even"):
        nbinfer.silu_and_mul(x[:, :7], backend="reference")
    with pytest.raises(ValueError, match="out"):
        nbinfer.silu_and_mul(x, out=np.empty((2, 3), np.float16), backend="reference")
    table = _table(rng, 8)
    with pytest.raises(ValueError, match="head_size"):
        nbinfer.apply_rope_with_cos_sin_cache(np.arange(2), x, x, 3, table, backend="reference")
    with pytest.raises(TypeError, match="positions must be int32 or int64"):
        nbinfer.apply_rope_with_cos_sin_cache(np.zeros(2), x, x, 8, table, backend="reference")
    with pytest.raises(ValueError, match="rotary dim"):
        nbinfer.apply_rope_with_cos_sin_cache(np.arange(2), x, x, 4, table, backend="reference")
    with pytest.raises(TypeError, match="cos_sin_cache must be float32"):
        nbinfer.apply_rope_with_cos_sin_cache(np.arange(2), x, x, 8, table.astype(np.float64),
                                              backend="reference")
