"""The two FP8 formats a KV cache can be stored in, decoded and encoded exactly (float64).

FlashInfer keeps a quantised cache as 8-bit codes with one scale per cache (``k_scale``,
``v_scale``): attention reads ``k = decode(k_codes) * k_scale`` and the same for V. This module
is the definition the reference engine and the tests use: every code's value, from the bit
layout, and the rounding from float to code.

- ``float8_e4m3fn``: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities ("fn":
  finite), ``S.1111.111`` is NaN, so the largest value is ``S.1111.110`` = 448; subnormals
  ``m / 8 * 2**-6`` down to ``2**-9``.
- ``float8_e5m2``: sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-style: exponent 31 is
  infinity (mantissa 0) or NaN; the largest finite value is 57344; subnormals ``m / 4 * 2**-14``.
  It is the upper byte of a float16.

Encoding rounds to the nearest code, ties to the even code (round-to-nearest-even, as the
hardware conversions do). Out of range, the two formats differ as torch's conversions do:
e4m3fn saturates (anything beyond 448 in magnitude, infinities too, becomes +-448), e5m2
overflows to +-infinity. NaN encodes as ``0x7F``.
"""

from __future__ import annotations

import functools

import numpy as np

FORMATS = ("float8_e4m3fn", "float8_e5m2")
_LAYOUT = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}  # exponent, mantissa, bias


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return fmt


@functools.cache
def _table(fmt: str) -> np.ndarray:
    e_bits, m_bits, bias = _LAYOUT[fmt]
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> m_bits) & ((1 << e_bits) - 1)
    m = codes & ((1 << m_bits) - 1)
    frac = m / float(1 << m_bits)
    value = np.where(e == 0, frac * 2.0 ** (1 - bias), (1.0 + frac) * 2.0 ** (e - bias)) * sign
    top = (1 << e_bits) - 1
    if fmt == "float8_e4m3fn":
        value[(e == top) & (m == (1 << m_bits) - 1)] = np.nan
    else:
        value[(e == top) & (m == 0)] = sign[(e == top) & (m == 0)] * np.inf
        value[(e == top) & (m != 0)] = np.nan
    value.flags.writeable = False
    return value


def table(fmt: str) -> np.ndarray:
    """The value of each of the 256 codes of ``fmt`` (float64 [256], read-only; NaN codes are
    NaN, e5m2's infinities infinite)."""
    return _table(_check_format(fmt))


def decode(codes, fmt: str, scale: float = 1.0) -> np.ndarray:
    """``codes`` (uint8 array of any shape) as float64 values times ``scale`` (the cache's
    ``k_scale`` / ``v_scale``)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    return _table(_check_format(fmt))[codes] * float(scale)


@functools.cache
def _positive(fmt: str):
    """The finite non-negative codes of ``fmt`` in increasing value (codes 0x00 up to the
    largest finite one) and their values."""
    t = _table(fmt)
    codes = np.array([c for c in range(0x80) if np.isfinite(t[c])], dtype=np.int64)
    return codes, t[codes]


def encode(x, fmt: str) -> np.ndarray:
    """The nearest ``fmt`` code of each value of ``x`` (uint8, ``x``'s shape); see the module
    docstring for ties, overflow and NaN."""
    codes, values = _positive(_check_format(fmt))
    x = np.asarray(x, dtype=np.float64)
    mag = np.abs(x)
    # the two neighbouring codes of each magnitude, then the nearer (ties to the even code)
    hi = np.clip(np.searchsorted(values, mag, side="left"), 0, values.size - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo])
    top = values[-1]
    if fmt == "float8_e5m2":
        # beyond the largest finite value by half an ulp or more (ties go to the even code,
        # which is infinity's 0x7C): infinity
        half_ulp = (top - values[-2]) / 2
        out = np.where(mag >= top + half_ulp, 0x7C, out)
    else:
        out = np.where(mag > top, codes[-1], out)  # saturate, infinities included
    out = np.where(np.signbit(x), out | 0x80, out)
    out = np.where(np.isnan(x), 0x7F, out)
    return out.astype(np.uint8)


__all__ = ["FORMATS", "decode", "encode", "table"]
