"""The Llama-family decoder in NumPy: the engine's reference model (float32 or float64).

Written once over a weight dictionary with Hugging Face names, so the same weights drive this
model, the torch model, and a checkpoint read from disk. Attention is not part of the layer
here: :meth:`NumpyLlama.forward` hands each layer's rotated ``q, k, v`` to an ``attend``
callback, which is where the engine puts its paged KV cache (append, then attention over the
pages), and where :func:`generate_alone` keeps a plain contiguous cache per request.
"""

from __future__ import annotations

import numpy as np

from .config import ModelConfig

__all__ = ["NumpyLlama", "generate_alone", "init_weights", "rope_frequencies", "weight_shapes"]


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The shape of every weight of ``cfg`` under Hugging Face's names: ``embed_tokens
    [vocab, hidden]``, per layer the two norms ``[hidden]``, ``{q,k,v,o}_proj`` (``[out, in]``;
    q/k/v biases when ``cfg.attention_bias``), ``mlp.{gate,up,down}_proj``, the final norm and,
    untied, ``lm_head [vocab, hidden]``."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, rows in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows * d, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows * d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def init_weights(cfg: ModelConfig, *, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights for ``cfg`` (:func:`weight_shapes`; NumPy arrays of ``dtype``): norms 1,
    everything else normal with std 1 / sqrt(fan in).

    That std makes every layer change the residual stream as much as the input does, so greedy
    tokens depend on attention over the whole context (with a tiny std the model would echo
    its last input token, and a test of it would prove little).
    """
    rng = np.random.default_rng(seed)
    return {name: (np.ones(shape, dtype) if name.endswith("norm.weight") else
                   (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype))
            for name, shape in weight_shapes(cfg).items()}


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies ``[head_dim / 2]`` (float64), with Llama-3 scaling if set:
    wavelengths beyond ``original / low_freq_factor`` are slowed by ``factor``, those under
    ``original / high_freq_factor`` kept, and the band between interpolated smoothly."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = cfg.rope_scaling
    if s is None:
        return inv
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


class NumpyLlama:
    """A Llama-family decoder on the CPU.

    Parameters
    ----------
    cfg : ModelConfig
    weights : dict of arrays (see :func:`init_weights`), any float dtype
    dtype : numpy float dtype, optional
        Compute dtype (float64 by default: the reference the engine is checked against).
    """

    def __init__(self, cfg: ModelConfig, weights: dict, dtype=np.float64):
        self.cfg, self.dtype = cfg, np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise TypeError(f"dtype must be float32 or float64, got {self.dtype}")
        missing = [k for k in _expected_names(cfg) if k not in weights]
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        self.w = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}
        self.inv_freq = rope_frequencies(cfg)

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate ``x [N, H, D]`` by the angles of ``positions [N]`` (the two-halves layout of
        Hugging Face's ``rotate_half``)."""
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _norm(self, x, weight):
        var = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(var + self.cfg.rms_norm_eps) * weight

    def forward(self, tokens, positions, attend, rows=None) -> np.ndarray:
        """Logits ``[N, vocab]`` for ``tokens [N]`` at ``positions [N]`` (only of the token
        rows ``rows`` when given: the LM head is the largest matrix, and a step samples from
        the last row of each sequence only).

        ``attend(layer, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> o [N, Hq, D]`` runs the
        attention of each layer for these tokens (storing k and v wherever it keeps its cache).
        """
        cfg, w = self.cfg, self.w
        tokens = np.asarray(tokens)
        positions = np.asarray(positions)
        n, d = tokens.size, cfg.head_dim
        x = w["model.embed_tokens.weight"][tokens]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            qkv = []
            for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads),
                                ("v", cfg.num_kv_heads)):
                y = h @ w[p + f"self_attn.{name}_proj.weight"].T
                if cfg.attention_bias:
                    y = y + w[p + f"self_attn.{name}_proj.bias"]
                qkv.append(y.reshape(n, heads, d))
            q, k, v = qkv
            o = attend(i, self.rope(q, positions), self.rope(k, positions), v)
            x = x + o.reshape(n, cfg.num_heads * d).astype(self.dtype) @ \
                w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        if rows is not None:
            x = x[rows]
        x = self._norm(x, w["model.norm.weight"])
        head = w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
        return x @ head.T


def _expected_names(cfg: ModelConfig) -> list[str]:
    return list(weight_shapes(cfg))


def generate_alone(model: NumpyLlama, prompt, max_new_tokens: int) -> list[int]:
    """Greedy tokens for one request with a plain contiguous KV cache and no paging: the
    definition the engine's output is checked against."""
    from .. import reference

    cfg = model.cfg
    ks = [np.zeros((0, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    vs = [np.zeros((0, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]

    def attend(layer, q, k, v):
        ks[layer] = np.concatenate([ks[layer], k])
        vs[layer] = np.concatenate([vs[layer], v])
        return reference.single_prefill_with_kv_cache(q, ks[layer], vs[layer], causal=True)

    tokens, out = list(prompt), []
    new = list(prompt)
    for _ in range(max_new_tokens):
        start = len(tokens) - len(new)
        logits = model.forward(new, np.arange(start, len(tokens)), attend)
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        tokens.append(nxt)
        new = [nxt]
    return out
