"""The decoder layer's operations around attention, in float64: RMSNorm (alone and fused with
the residual add), SiLU-and-multiply, and rotary embeddings from a cos/sin table.

These are FlashInfer's ``flashinfer.norm``, ``flashinfer.activation`` and ``flashinfer.rope``
operations, written as the definitions the kernels of :mod:`nbinfer.kernels.layers` are tested
against. None of them reads more than one token's row at a time, which is why a GPU runs each
as one small pass over memory; in a decode step of a small model they are a few hundred tiny
kernels when each is written as separate tensor operations (bench/NOTES.md, issue 12).

Rounding is part of the definition where the storage type is narrow: ``fused_add_rmsnorm``
normalises the residual *as stored* (the sum rounded to the input's dtype first), as a model
that adds and then normalises in separate 16-bit steps does.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply_rope_with_cos_sin_cache", "cos_sin_cache", "fused_add_rmsnorm", "rmsnorm",
           "round_to", "silu_and_mul"]


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def rmsnorm(x, weight, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis.

    Parameters
    ----------
    x : array [..., hidden]
    weight : array [hidden]
    eps : float

    Returns
    -------
    float64 array of ``x``'s shape
    """
    xf = _f64(x)
    return xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + eps) * _f64(weight)


def fused_add_rmsnorm(x, residual, weight, eps: float = 1e-6, dtype=None):
    """FlashInfer's fused add + RMSNorm: the residual becomes ``residual + x`` (rounded to
    ``dtype``, the storage type, when given) and the output is its RMSNorm.

    Parameters
    ----------
    x, residual : arrays [tokens, hidden]
    weight : array [hidden]
    eps : float
    dtype : numpy dtype or str, optional
        The storage type of ``residual`` (e.g. ``"float16"``); ``ml_dtypes``-free types only,
        so bfloat16 is rounded by :func:`round_to`.

    Returns
    -------
    (normed, new_residual) : float64 arrays [tokens, hidden]
    """
    total = _f64(residual) + _f64(x)
    if dtype is not None:
        total = round_to(total, dtype)
    return rmsnorm(total, weight, eps), total


def round_to(x, dtype) -> np.ndarray:
    """``x`` rounded to the 16- or 32-bit float ``dtype`` (``"bfloat16"`` included: round to
    nearest even on the top 16 bits of the float32), returned as float64."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name == "bfloat16":
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.asarray(x).astype(name).astype(np.float64)


def silu_and_mul(x) -> np.ndarray:
    """``silu(x[..., :d]) * x[..., d:]`` with ``silu(g) = g / (1 + exp(-g))``: the gated MLP's
    activation on the output of one GEMM over the gate and up projections concatenated.

    Parameters
    ----------
    x : array [..., 2 d]

    Returns
    -------
    float64 array [..., d]
    """
    xf = _f64(x)
    if xf.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even (gate | up), got {xf.shape[-1]}")
    d = xf.shape[-1] // 2
    g, u = xf[..., :d], xf[..., d:]
    return g / (1.0 + np.exp(-g)) * u


def cos_sin_cache(inv_freq, max_position: int) -> np.ndarray:
    """The table :func:`apply_rope_with_cos_sin_cache` reads: row ``p`` is ``cos(p f) |
    sin(p f)`` for the inverse frequencies ``f [rotary_dim / 2]``; float32 ``[max_position,
    rotary_dim]`` (any frequency scaling, e.g. Llama 3's, is already in ``f``)."""
    ang = np.arange(int(max_position), dtype=np.float64)[:, None] * _f64(inv_freq)[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


def apply_rope_with_cos_sin_cache(positions, query, key, head_size: int, cos_sin_cache,
                                  is_neox: bool = True):
    """Rotate every head of ``query`` and ``key`` by the angles of its token's position.

    For a pair ``(a, b)`` of a head's rotary dimensions and the table row ``c | s`` of the
    token's position, ``(a, b) -> (a c_i - b s_i, b c_i + a s_i)``. ``is_neox``: pair ``i``
    is dimensions ``(i, i + R / 2)`` (the two halves, Llama / NeoX); otherwise ``(2 i, 2 i +
    1)`` (interleaved, GPT-J). Dimensions past the table's ``R`` (partial rotary) are kept.

    Parameters
    ----------
    positions : int array [tokens]
    query : array [tokens, Hq * head_size] or [tokens, Hq, head_size]
    key : array [tokens, Hk * head_size] or [tokens, Hk, head_size]
    head_size : int
    cos_sin_cache : float array [max_position, R], ``R <= head_size`` even
    is_neox : bool

    Returns
    -------
    (query, key) rotated: float64 arrays of the inputs' shapes
    """
    table = _f64(cos_sin_cache)
    r = table.shape[1]
    half = r // 2
    pos = np.asarray(positions, dtype=np.int64)
    cos, sin = table[pos, :half][:, None, :], table[pos, half:][:, None, :]
    out = []
    for x in (query, key):
        xf = _f64(x)
        h = xf.reshape(xf.shape[0], -1, head_size).copy()
        if is_neox:
            a, b = h[..., :half].copy(), h[..., half:r].copy()
            h[..., :half], h[..., half:r] = a * cos - b * sin, b * cos + a * sin
        else:
            a, b = h[..., 0:r:2].copy(), h[..., 1:r:2].copy()
            h[..., 0:r:2], h[..., 1:r:2] = a * cos - b * sin, b * cos + a * sin
        out.append(h.reshape(xf.shape))
    return out[0], out[1]
