"""The FP8 codec of a quantised KV cache (nbinfer.reference.fp8) against independent definitions."""

from __future__ import annotations

import numpy as np
import pytest

from nbinfer.reference import fp8

CODES = np.arange(256, dtype=np.uint8)


def test_e5m2_is_the_upper_byte_of_float16():
    as_half = (CODES.astype(np.uint16) << 8).view(np.float16).astype(np.float64)
    np.testing.assert_array_equal(fp8.table("float8_e5m2"), as_half)  # NaNs compare equal


def test_e4m3fn_values_from_the_bit_layout():
    t = fp8.table("float8_e4m3fn")
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 15, c & 7
        if e == 15 and m == 7:
            assert np.isnan(t[c])
            continue
        want = (m / 8 * 2.0**-6) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        assert t[c] == (-want if s else want), hex(c)
    assert np.flatnonzero(np.isnan(t)).tolist() == [0x7F, 0xFF]
    assert (t[0x7E], t[0x01], t[0x08]) == (448.0, 2.0**-9, 2.0**-6)
    assert np.signbit(t[0x80]) and t[0x80] == 0.0 and np.isfinite(t).sum() == 254


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_every_code_round_trips(fmt):
    keep = ~np.isnan(fp8.table(fmt))
    np.testing.assert_array_equal(fp8.encode(fp8.decode(CODES, fmt), fmt)[keep], CODES[keep])


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_rounding_is_to_nearest_ties_to_even(fmt, rng):
    t = fp8.table(fmt)
    pos = np.array([c for c in range(0x80) if np.isfinite(t[c])])
    lo, hi = pos[:-1], pos[1:]
    mid = (t[lo] + t[hi]) / 2
    even = np.where(lo % 2 == 0, lo, hi)
    np.testing.assert_array_equal(fp8.encode(mid, fmt), even)
    np.testing.assert_array_equal(fp8.encode(-mid, fmt), even | 0x80)
    step = (t[hi] - t[lo]) * rng.uniform(0.01, 0.49, size=lo.size)
    np.testing.assert_array_equal(fp8.encode(t[lo] + step, fmt), lo)
    np.testing.assert_array_equal(fp8.encode(t[hi] - step, fmt), hi)


def test_out_of_range_and_nan():
    e4, e5 = "float8_e4m3fn", "float8_e5m2"
    big = np.array([449.0, 1e30, np.inf, -np.inf, np.nan])
    assert fp8.encode(big, e4).tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x7F]  # saturates
    # e5m2: 57344 is the largest finite value, 61440 is half an ulp above it (ties to even:
    # infinity's code 0x7C)
    assert fp8.encode([61439.0, 61440.0, 1e30, -np.inf, np.nan], e5).tolist() == \
        [0x7B, 0x7C, 0x7C, 0xFC, 0x7F]
    # half the smallest subnormal (2**-9) or less: zero (the tie goes to the even code, 0)
    assert fp8.encode([2.0**-10, 2.0**-17], e4).tolist() == [0x00, 0x00]
    assert fp8.encode([-(2.0**-18)], e5).tolist() == [0x80]  # smallest subnormal: signed zero


def test_decode_scales_and_validates():
    codes = np.array([[0x38, 0x40]], dtype=np.uint8)  # e4m3fn 1.0 and 2.0
    np.testing.assert_array_equal(fp8.decode(codes, "float8_e4m3fn", 0.5), [[0.5, 1.0]])
    with pytest.raises(TypeError, match="uint8"):
        fp8.decode(codes.astype(np.int16), "float8_e4m3fn")
    with pytest.raises(ValueError, match="fmt"):
        fp8.encode([1.0], "float8_e4m3")


@pytest.mark.parametrize("fmt", fp8.FORMATS)
def test_agrees_with_torch(fmt, rng):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, fmt)
    x = np.concatenate([rng.normal(scale=s, size=4000) for s in (1e-4, 1e-2, 1.0, 300.0, 1e5)])
    x = x.astype(np.float32)  # torch converts float32 to fp8 in one rounding
    want = torch.from_numpy(x).to(tdt).view(torch.uint8).numpy()
    np.testing.assert_array_equal(fp8.encode(x, fmt), want)
    np.testing.assert_array_equal(torch.from_numpy(CODES).view(tdt).double().numpy(),
                                  fp8.table(fmt))
