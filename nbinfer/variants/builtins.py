"""Built-in attention variants, one small factory each; the product's name says what it is.

Every factory validates its parameters and returns a :class:`~nbinfer.variants.spec.Variant`
whose hooks close over ``numpy.float32`` constants (or small float32 tables), so a GPU kernel that
captures them stays in float32 while the reference engine evaluates the very same functions in
float64.
"""

from __future__ import annotations

import math

import numpy as np

from .precision import as_type_of
from .spec import Variant, compose

POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")

_ONE = np.float32(1.0)
_TWO_PI = 2.0 * math.pi
_INV_TWO_PI = 1.0 / (2.0 * math.pi)


def standard() -> Variant:
    """Plain scaled dot-product softmax attention (no hook)."""
    return Variant("standard")


def _causal_mask(q_pos, kv_pos, qo_head):
    return kv_pos <= q_pos


def causal() -> Variant:
    """Causal mask: a query at absolute position ``p`` sees keys at positions ``<= p``.

    With absolute query positions ``qo_idx + kv_len - qo_len`` this is FlashInfer's bottom-right
    aligned causal mask.
    """
    return Variant("causal", logits_mask=_causal_mask)


def is_causal_mask(hook) -> bool:
    """Whether ``hook`` is :func:`causal`'s mask: kernels that know it keep a key tile whose last
    key is at or before a row's position without evaluating the mask per score."""
    return hook is _causal_mask


_causal_variant = causal  # from_flashinfer_args takes a flag of the same name


def sliding_window(window_left: int) -> Variant:
    """Left window: a query at position ``p`` sees keys at positions ``>= p - window_left``.

    ``window_left`` counts the keys to the left of the query's own position, as FlashInfer's
    ``window_left`` does; combine with :func:`causal` to also hide the future.
    """
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left must be an int, got {type(window_left).__name__}")
    if window_left < 0:
        raise ValueError(f"window_left must be >= 0, got {window_left}")
    w = int(window_left)

    def logits_mask(q_pos, kv_pos, qo_head):
        return kv_pos + w >= q_pos

    return Variant(f"sliding_window_{w}", params=(("window_left", w),), logits_mask=logits_mask)


def soft_cap(cap: float) -> Variant:
    """Logits soft-capping (Gemma 2, Grok): ``s -> cap * tanh(s / cap)``; ``cap`` positive, finite."""
    return _soft_cap(cap, "cap")


def _soft_cap(cap, name: str) -> Variant:
    """:func:`soft_cap` with errors naming ``name`` (``logits_soft_cap`` for FlashInfer's flag)."""
    accepted = "a positive finite float that fits in float32"
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {accepted}, got {type(cap).__name__}")
    cap = float(cap)
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"{name} must be {accepted}, got {cap}")
    c = _float32(name, cap)
    inv = _float32(f"1 / {name}", 1.0 / cap)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return c * math.tanh(s * inv)

    return Variant(f"soft_cap_{cap:g}", params=(("cap", cap),), logits_transform=logits_transform)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes, float32 ``[num_heads]``, as in Press et al. and FlashInfer.

    For a power of two ``n`` heads the slope of head ``h`` is ``2 ** (-8 (h + 1) / n)``; otherwise
    the closest smaller power of two ``n`` gives the first ``n`` slopes and the rest interleave
    ``2 ** (-4 (2 (h - n) + 1) / n)``.
    """
    num_heads = _positive_int("num_heads", num_heads)
    n = 2 ** int(math.floor(math.log2(num_heads)))
    h = np.arange(num_heads, dtype=np.float64)
    slopes = np.where(h < n, 2.0 ** (-8.0 * (h + 1) / n), 2.0 ** (-4.0 * (2 * (h - n) + 1) / n))
    return slopes.astype(np.float32)


def alibi(num_heads: int) -> Variant:
    """ALiBi positional bias: ``s -> s + slope[qo_head] * (kv_pos - q_pos)``."""
    slopes = alibi_slopes(num_heads)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return s + slopes[qo_head] * np.float32(kv_pos - q_pos)

    return Variant(
        f"alibi_{num_heads}", params=(("num_heads", int(num_heads)),),
        logits_transform=logits_transform,
    )


def rope_llama(rope_scale: float = 1.0, rope_theta: float = 1e4) -> Variant:
    """Fused rotary embedding, Llama's rotate-half form, applied to queries and keys.

    Element ``d`` of a vector at position ``pos`` rotates with angle
    ``pos / rope_scale * rope_theta ** (-2 (d mod D/2) / D)``:
    ``x[d] cos - x[d + D/2] sin`` in the first half and ``x[d] cos + x[d - D/2] sin`` in the second.

    Precision: the angle is formed in float64 (positions reach 1e5 radians, where a float32
    angle is off by 1e-2) and reduced to ``[-pi, pi)`` there; its cosine and sine are taken in
    the data's precision (:func:`~nbinfer.variants.precision.as_type_of`): float64 in the
    reference engine (exact), float32 in a kernel, within 2e-7 radians of exact at every
    position. With float64 sine and cosine of the whole angle the fused-RoPE decode ran at
    0.43 TB/s of KV on the H200, a tenth of the plain kernel (``bench/NOTES.md``, issue 13).
    """
    scale = _positive_float("rope_scale", rope_scale)
    theta = _positive_float("rope_theta", rope_theta)
    inv_scale = 1.0 / scale
    log_theta = math.log(theta)

    def rotate(x, x_pair, d, head_dim, pos, head):
        half = head_dim // 2
        i = d - half if d >= half else d
        # turns per position (float64: 1e-12 relative is needed at 1e5 radians); the same for
        # every key a kernel lane rotates, though the decode's loop recomputes it (bench/NOTES.md)
        turns_per_pos = inv_scale * math.exp(-2.0 * i * log_theta / head_dim) * _INV_TWO_PI
        turns = pos * turns_per_pos
        angle = as_type_of((turns - math.floor(turns + 0.5)) * _TWO_PI, x)  # in [-pi, pi)
        sign = _ONE if d >= half else -_ONE
        return x * math.cos(angle) + sign * x_pair * math.sin(angle)

    return Variant(
        f"rope_llama_{scale:g}_{theta:g}", params=(("rope_scale", scale), ("rope_theta", theta)),
        query_transform=rotate, key_transform=rotate,
    )


def sigmoid_attention(scale: float = 1.0, bias: float = 0.0) -> Variant:
    """FlashSigmoid: no softmax; weights ``sigmoid(s * scale + bias)``, output ``sum_j w_j v_j``."""
    scale = _finite_float("scale", scale)
    bias = _finite_float("bias", bias)
    a = _float32("scale", scale)
    b = _float32("bias", bias)

    def logits_transform(s, q_pos, kv_pos, qo_head):
        return _ONE / (_ONE + math.exp(-(s * a + b)))

    return Variant(
        f"sigmoid_{scale:g}_{bias:g}", params=(("scale", scale), ("bias", bias)),
        logits_transform=logits_transform, use_softmax=False,
    )


def attention_sink(sinks) -> Variant:
    """A learned sink logit per query head joins every softmax denominator (gpt-oss style).

    The output becomes ``o * l / (l + exp(sink - m))`` = ``o / (1 + exp(sink - lse))``: an
    output transform on the final merged state. The returned LSE stays the LSE over the keys.
    """
    table = np.asarray(sinks, dtype=np.float64)
    if table.ndim != 1 or table.size == 0:
        raise ValueError(f"sinks must be a non-empty 1-D sequence, got shape {table.shape}")
    with np.errstate(over="ignore", invalid="ignore"):
        table32 = table.astype(np.float32)
    if not (np.all(np.isfinite(table)) and np.all(np.isfinite(table32))):
        raise ValueError(f"sinks must be finite float32 values, got {table.tolist()}")

    def output_transform(o, lse, qo_head):
        return o / (_ONE + math.exp(table32[qo_head] - lse))

    return Variant(
        f"attention_sink_{table.size}", params=(("sinks", tuple(float(x) for x in table32)),),
        output_transform=output_transform,
    )


def from_flashinfer_args(
    *,
    causal: bool = False,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    pos_encoding_mode: str = "NONE",
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    num_qo_heads: int | None = None,
) -> Variant:
    """Build the variant that FlashInfer's keyword arguments describe.

    Order: rotary embedding (query/key transform), ALiBi then soft-cap (logits transforms, in
    FlashInfer's ``DefaultAttention`` order, so the cap bounds the biased logit), causal and window
    masks. ``window_left=-1`` and ``logits_soft_cap`` of ``None``/``0.0`` disable those (0.0 is
    FlashInfer's "no soft cap"); any other ``logits_soft_cap`` must be a positive finite float.
    (FlashInfer folds ``sm_scale / cap`` into the query, so with ALiBi *and* a soft cap its bias
    is divided by ``cap``; nbinfer adds the bias to ``sm_scale * q.k`` as in every other case.)
    """
    if pos_encoding_mode not in POS_ENCODING_MODES:
        raise ValueError(
            f"pos_encoding_mode must be one of {POS_ENCODING_MODES}, got {pos_encoding_mode!r}"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be bool, got {type(causal).__name__}")
    parts = []
    if pos_encoding_mode == "ROPE_LLAMA":
        parts.append(rope_llama(1.0 if rope_scale is None else rope_scale,
                                1e4 if rope_theta is None else rope_theta))
    if pos_encoding_mode == "ALIBI":
        if num_qo_heads is None:
            raise ValueError("pos_encoding_mode='ALIBI' needs num_qo_heads")
        parts.append(alibi(num_qo_heads))
    if logits_soft_cap is not None and not (
            isinstance(logits_soft_cap, (int, float, np.integer, np.floating))
            and not isinstance(logits_soft_cap, bool) and logits_soft_cap == 0):
        try:
            parts.append(_soft_cap(logits_soft_cap, "logits_soft_cap"))
        except (TypeError, ValueError) as err:
            raise type(err)(f"{err} (None or 0.0 means no soft cap)") from None
    if causal:
        parts.append(_causal_variant())
    if window_left is None or isinstance(window_left, bool) or not isinstance(
        window_left, (int, np.integer)
    ):
        raise TypeError(f"window_left must be an int, got {window_left!r}")
    if window_left < -1:
        raise ValueError(f"window_left must be -1 (off) or >= 0, got {window_left}")
    if window_left >= 0:
        parts.append(sliding_window(int(window_left)))
    return compose(*parts) if parts else standard()


# Built-ins that need no parameter, by the name that ``resolve`` accepts -> their factory.
PARAMETER_FREE = {
    "standard": standard,
    "causal": causal,
    "rope_llama": rope_llama,  # Llama's rope_scale 1, rope_theta 1e4
    "sigmoid": sigmoid_attention,  # scale 1, bias 0
}
_PARAMETRISED = ("sliding_window(window_left)", "soft_cap(cap)", "alibi(num_heads)",
                 "attention_sink(sinks)", "rope_llama(rope_scale, rope_theta)",
                 "sigmoid_attention(scale, bias)")


def resolve(variant) -> Variant | None:
    """The :class:`Variant` that a ``variant=`` argument names.

    Parameters
    ----------
    variant : None, Variant or str
        ``None`` (no extra variant) and a ``Variant`` are returned as they are; a string names a
        built-in that needs no parameter: ``"standard"``, ``"causal"``, ``"rope_llama"``
        (``rope_llama()``: scale 1, theta 1e4) or ``"sigmoid"`` (``sigmoid_attention()``: scale 1,
        bias 0). Variants with parameters are built by their factories,
        ``nbinfer.variants.sliding_window(window_left)``, ``soft_cap(cap)``, ``alibi(num_heads)``,
        ``attention_sink(sinks)``, and passed as the ``Variant`` they return.

    Returns
    -------
    Variant or None

    Raises
    ------
    ValueError
        An unknown string (the message lists the accepted names and the factories).
    TypeError
        Any other type.
    """
    if variant is None or isinstance(variant, Variant):
        return variant
    if isinstance(variant, str):
        factory = PARAMETER_FREE.get(variant)
        if factory is None:
            names = ", ".join(repr(n) for n in PARAMETER_FREE)
            made = ", ".join(f"nbinfer.variants.{f}" for f in _PARAMETRISED)
            raise ValueError(f"variant must be None, a Variant or the name of a built-in without "
                             f"parameters ({names}), got {variant!r}; variants with parameters "
                             f"come from their factories: {made}")
        return factory()
    raise TypeError(f"variant must be None, a nbinfer.variants.Variant or a str naming a "
                    f"built-in ({', '.join(repr(n) for n in PARAMETER_FREE)}), "
                    f"got {type(variant).__name__}")


def _positive_float(name, value) -> float:
    value = _finite_float(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _finite_float(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _float32(name, value) -> np.float32:
    """``value`` as the float32 constant a hook captures; it must stay finite and, if it was
    non-zero, non-zero (``cap=1e39`` or ``1 / cap`` overflowing would turn logits into NaN)."""
    with np.errstate(over="ignore"):
        v = np.float32(value)
    if not np.isfinite(v) or (v == 0 and value != 0):
        raise ValueError(f"{name} must fit in float32, got {value!r}")
    return v


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value)
