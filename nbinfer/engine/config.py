"""Shapes of a Llama-family decoder: named configurations and Hugging Face ``config.json``.

One :class:`ModelConfig` describes every model the engine serves (Llama 2/3, Qwen2, ...):
RMSNorm, rotary position embeddings (optionally with Llama-3 frequency scaling), grouped-query
attention, a SwiGLU MLP, tied or separate input and output embeddings, optional q/k/v biases.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .._checks import check_positive_int

__all__ = ["CONFIGS", "ModelConfig", "config_from_hf", "named_config"]


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shapes and constants.

    Attributes
    ----------
    vocab_size, hidden_size, intermediate_size, num_layers : int
    num_heads, num_kv_heads, head_dim : int
        Query heads, KV heads (``num_heads`` a multiple of it: the GQA group) and head size.
    rope_theta : float
        Base of the rotary frequencies.
    rope_scaling : dict or None
        Llama-3 scaling ``{"factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}``, or None.
    rms_norm_eps : float
    tie_embeddings : bool
        The output projection is the input embedding (no ``lm_head.weight``).
    attention_bias : bool
        q/k/v projections carry biases (Qwen2).
    name : str
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=True)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    attention_bias: bool = False
    name: str = "custom"

    def __post_init__(self):
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim"):
            check_positive_int(key, getattr(self, key))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if self.rope_scaling is not None and (missing := set(_LLAMA3_SCALING) -
                                              set(self.rope_scaling)):
            raise ValueError(f"rope_scaling lacks {sorted(missing)} (Llama-3 scaling)")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        """Weights of the model (embeddings counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h

    def to_hf(self) -> dict:
        """This configuration as a Hugging Face ``config.json`` dict (Llama, or Qwen2 when the
        projections carry biases): :func:`config_from_hf` reads it back."""
        cfg = {"model_type": "qwen2" if self.attention_bias else "llama",
               "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
               "intermediate_size": self.intermediate_size,
               "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
               "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
               "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
               "tie_word_embeddings": self.tie_embeddings,
               "attention_bias": self.attention_bias, "_name_or_path": self.name}
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = {"rope_type": "llama3", **self.rope_scaling}
        return cfg

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV-cache bytes one token takes over all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


_LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

CONFIGS = {
    # small enough for the float64 reference engine in the test suite, with GQA (G = 2);
    # head_dim 64, the smallest the GPU kernels take, so the same model runs on both
    "tiny": ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
                        name="tiny"),
    # the shapes of meta-llama/Llama-3.2-1B (weights are never downloaded)
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                                rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                                rms_norm_eps=1e-5, tie_embeddings=True, name="llama-3.2-1b"),
    # the shapes of Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_embeddings=True,
                                attention_bias=True, name="qwen2.5-0.5b"),
}


def named_config(name: str) -> ModelConfig:
    """One of :data:`CONFIGS` by name."""
    if name not in CONFIGS:
        raise ValueError(f"config must be one of {sorted(CONFIGS)}, got {name!r}")
    return CONFIGS[name]


def config_from_hf(path_or_dict) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` (a path to it, to its folder,
    or the parsed dict) of a Llama or Qwen2 model."""
    if isinstance(path_or_dict, dict):
        cfg = path_or_dict
    else:
        path = Path(path_or_dict)
        path = path / "config.json" if path.is_dir() else path
        cfg = json.loads(path.read_text())
    arch = cfg.get("model_type", "llama")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"model_type must be 'llama' or 'qwen2', got {arch!r}")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"only Llama-3 rope_scaling is supported, got {scaling!r}")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=None if scaling is None else {k: scaling[k] for k in _LLAMA3_SCALING},
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        name=str(cfg.get("_name_or_path", arch)))
