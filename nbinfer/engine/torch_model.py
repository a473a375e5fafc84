"""The Llama-family decoder in torch (fp32, fp16, bf16; any torch device).

The same layer as :class:`~nbinfer.engine.model.NumpyLlama`, over the same weight dictionary,
written with torch operations; attention again comes from an ``attend`` callback, so the model
runs over nbinfer's paged kernels in the engine, or over plain SDPA on contiguous KV in a test.
torch is an optional dependency: importing this module needs it, the rest of nbinfer does not.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import ModelConfig
from .model import _expected_names, rope_frequencies

__all__ = ["TorchLlama"]


class TorchLlama:
    """A Llama-family decoder in torch.

    Parameters
    ----------
    cfg : ModelConfig
    weights : dict of NumPy arrays or torch tensors (see :func:`~nbinfer.engine.init_weights`)
    device : torch device or str
    dtype : torch.float32, torch.float16 or torch.bfloat16
        Storage and compute dtype of the weights and activations; norms, RoPE angles and the
        logits are computed in float32.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, device="cpu",
                 dtype=torch.float32):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        missing = [k for k in _expected_names(cfg) if k not in weights]
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensors, e.g. {missing[:3]}")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.w = {k: torch.as_tensor(np.asarray(v) if not torch.is_tensor(v) else v)
                  .to(self.device, dtype) for k, v in weights.items()}
        self.inv_freq = torch.as_tensor(rope_frequencies(cfg), dtype=torch.float32,
                                        device=self.device)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, H, D]`` by the angles of ``positions [N]`` (two-halves layout)."""
        ang = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        xf = x.to(torch.float32)
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def _norm(self, x, weight):
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return (xf * weight.to(torch.float32)).to(self.dtype)

    @torch.inference_mode()
    def forward(self, tokens, positions, attend) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for ``tokens [N]`` at ``positions [N]``; ``attend``
        as in :meth:`NumpyLlama.forward`, with torch tensors."""
        cfg, w = self.cfg, self.w
        tokens = torch.as_tensor(tokens, device=self.device)
        positions = torch.as_tensor(positions, device=self.device)
        n, d = tokens.numel(), cfg.head_dim
        x = w["model.embed_tokens.weight"][tokens]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            qkv = []
            for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads),
                                ("v", cfg.num_kv_heads)):
                bias = w.get(p + f"self_attn.{name}_proj.bias") if cfg.attention_bias else None
                y = torch.nn.functional.linear(h, w[p + f"self_attn.{name}_proj.weight"], bias)
                qkv.append(y.view(n, heads, d))
            q, k, v = qkv
            o = attend(i, self.rope(q, positions), self.rope(k, positions), v)
            x = x + torch.nn.functional.linear(o.reshape(n, cfg.num_heads * d).to(self.dtype),
                                               w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.linear(h, w[p + "mlp.gate_proj.weight"])
            up = torch.nn.functional.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                               w[p + "mlp.down_proj.weight"])
        x = self._norm(x, w["model.norm.weight"])
        head = w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
        return torch.nn.functional.linear(x, head).to(torch.float32)
