"""The Llama-family decoder in torch (fp32, fp16, bf16; any torch device).

The same layer as :class:`~nbinfer.engine.model.NumpyLlama`, over the same weight dictionary,
written with torch operations; attention again comes from an ``attend`` callback, so the model
runs over nbinfer's paged kernels in the engine, or over plain SDPA on contiguous KV in a test.
torch is an optional dependency: importing this module needs it, the rest of nbinfer does not.
"""

from __future__ import annotations

import numpy as np
import torch

from .._checks import check_positive_int
from .config import ModelConfig
from .model import _expected_names, rope_frequencies, weight_shapes

__all__ = ["TorchLlama", "generate_alone_sdpa", "sdpa_attend"]


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
    fused : bool, optional
        Run each layer's elementwise work as nbinfer's layer kernels (:mod:`nbinfer.api.layers`:
        the residual add fused into RMSNorm, RoPE from a cos/sin table, SiLU-and-multiply) on
        one GEMM for q/k/v and one for gate/up; default on a CUDA device. Otherwise torch
        operations, one per step of the formula (the form a CPU runs).
    max_positions : int
        Rows of the RoPE table the fused form reads at first (positions past it would give
        NaN rows): :meth:`ensure_positions` grows it, as :meth:`forward` does for positions
        given on the host and the engine's runner does before each step.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, device="cpu",
                 dtype=torch.float32, *, fused: bool | None = None, max_positions: int = 32768):
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
        # the norms run in float32: their weights converted once, not per call
        self._norm32 = {k: v.to(torch.float32) for k, v in self.w.items()
                        if k.endswith("norm.weight")}
        self._rms_norm = getattr(torch.nn.functional, "rms_norm", None)  # torch >= 2.4
        self.fused = self.device.type == "cuda" if fused is None else bool(fused)
        self.rope_version = 0  # counts the RoPE table's reallocations (a graph reads its address)
        self._retired: list = []  # earlier tables, kept alive: a captured graph may read one
        if self.fused:
            self._fuse_projections()
            self._cos_sin = self._rope_table(check_positive_int("max_positions",
                                                                max_positions))

    def ensure_positions(self, n: int) -> bool:
        """Make the fused form's RoPE table hold positions ``0 .. n - 1`` (at least doubling
        it when it grows); returns whether it was reallocated (``rope_version`` counts that:
        a CUDA graph captured before reads the old table, which stays allocated, and must be
        captured again)."""
        if not self.fused or n <= self._cos_sin.shape[0]:
            return False
        self._retired.append(self._cos_sin)
        self._cos_sin = self._rope_table(max(int(n), 2 * self._cos_sin.shape[0]))
        self.rope_version += 1
        return True

    def _fuse_projections(self) -> None:
        """One weight for q/k/v and one for gate/up per layer (one GEMM each instead of three
        and two); the named weights become views into them (the separate tensors are released
        unless the caller still holds them)."""
        self._qkv, self._gate_up = [], []
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            bias = [k[:-len("weight")] + "bias" for k in qkv] if self.cfg.attention_bias else None
            self._qkv.append((self._concat(qkv), self._concat(bias) if bias else None))
            self._gate_up.append(self._concat([p + "mlp.gate_proj.weight",
                                               p + "mlp.up_proj.weight"]))

    def _concat(self, keys: list) -> torch.Tensor:
        """The tensors named ``keys`` stacked along their first axis, each name rebound to its
        rows of the result."""
        whole = torch.cat([self.w[k] for k in keys])
        start = 0
        for k in keys:
            rows = self.w[k].shape[0]
            self.w[k] = whole[start:start + rows]
            start += rows
        return whole

    def _rope_table(self, rows: int) -> torch.Tensor:
        """``[rows, head_dim]`` float32 ``cos | sin`` of every position's angles, computed by
        the same float32 operations as :meth:`_angles` (so the same values)."""
        ang = torch.arange(rows, dtype=torch.float32, device=self.device)[:, None] * \
            self.inv_freq[None, :]
        return torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()

    @classmethod
    def random(cls, cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, *, seed: int = 0,
               **options):
        """A model with random weights drawn on ``device`` by torch (the distribution of
        :func:`~nbinfer.engine.init_weights`, not its values): a billion weights in a fraction
        of a second instead of NumPy's tens of seconds, for benchmarks. ``options``: the
        constructor's (``fused``, ``max_positions``)."""
        gen = torch.Generator(device=device).manual_seed(seed)
        weights = {}
        for name, shape in weight_shapes(cfg).items():
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape, dtype=dtype, device=device)
            else:
                w = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
                weights[name] = (w / shape[-1] ** 0.5).to(dtype)
        return cls(cfg, weights, device=device, dtype=dtype, **options)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [N, H, D]`` by the angles of ``positions [N]`` (two-halves layout)."""
        return self._rotate(x, *self._angles(positions))

    def _angles(self, positions):
        """``cos, sin [N, 1, D/2]`` (float32) of ``positions``: the same for every layer, so
        a forward pass computes them once."""
        ang = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        return ang.cos()[:, None, :], ang.sin()[:, None, :]

    @staticmethod
    def _rotate(x, cos, sin):
        xf = x.to(torch.float32)
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def _norm(self, x, name):
        xf, weight, eps = x.to(torch.float32), self._norm32[name], self.cfg.rms_norm_eps
        if self._rms_norm is not None:
            return self._rms_norm(xf, (xf.shape[-1],), weight, eps).to(self.dtype)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * weight).to(self.dtype)

    @torch.inference_mode()
    def forward(self, tokens, positions, attend, rows=None) -> torch.Tensor:
        """float32 logits ``[N, vocab]`` for ``tokens [N]`` at ``positions [N]`` (of the rows
        ``rows`` only, when given); ``attend`` as in :meth:`NumpyLlama.forward`, with torch
        tensors."""
        cfg, w = self.cfg, self.w
        if self.fused and not (torch.is_tensor(positions) and positions.device.type != "cpu"):
            # positions on the host: the table grows to hold them (device positions cannot be
            # read without a wait; the engine's runner grows it from its host copy)
            host = positions.numpy() if torch.is_tensor(positions) else np.asarray(positions)
            self.ensure_positions(int(host.max()) + 1 if host.size else 0)
        tokens = torch.as_tensor(tokens, device=self.device)
        positions = torch.as_tensor(positions, device=self.device)
        if self.fused:
            return self._forward_fused(tokens, positions, attend, rows)
        n, d = tokens.numel(), cfg.head_dim
        x = w["model.embed_tokens.weight"][tokens]
        cos, sin = self._angles(positions)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")
            qkv = []
            for name, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads),
                                ("v", cfg.num_kv_heads)):
                bias = w.get(p + f"self_attn.{name}_proj.bias") if cfg.attention_bias else None
                y = torch.nn.functional.linear(h, w[p + f"self_attn.{name}_proj.weight"], bias)
                qkv.append(y.view(n, heads, d))
            q, k, v = qkv
            o = attend(i, self._rotate(q, cos, sin), self._rotate(k, cos, sin), v)
            x = x + torch.nn.functional.linear(o.reshape(n, cfg.num_heads * d).to(self.dtype),
                                               w[p + "self_attn.o_proj.weight"])
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gate = torch.nn.functional.linear(h, w[p + "mlp.gate_proj.weight"])
            up = torch.nn.functional.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                               w[p + "mlp.down_proj.weight"])
        if rows is not None:
            x = x[rows]
        x = self._norm(x, "model.norm.weight")
        head = w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
        return torch.nn.functional.linear(x, head).to(torch.float32)

    def _forward_fused(self, tokens, positions, attend, rows):
        """:meth:`forward` with nbinfer's layer kernels: per layer two GEMMs fewer and one
        kernel for each of the residual add + norm (twice), RoPE of q and k, and SiLU times up,
        where the torch form launches a few dozen elementwise kernels."""
        from ..api import layers

        cfg, w = self.cfg, self.w
        n, d, hq, hk = tokens.numel(), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        linear = torch.nn.functional.linear
        x = w["model.embed_tokens.weight"][tokens]  # a new tensor: the residual stream
        h = layers.rmsnorm(x, self._norm32["model.layers.0.input_layernorm.weight"], eps)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_w, qkv_b = self._qkv[i]
            qkv = linear(h, qkv_w, qkv_b)  # [n, (hq + 2 hk) d]
            q, k = layers.apply_rope_with_cos_sin_cache(
                positions, qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d], d, self._cos_sin)
            v = qkv[:, (hq + hk) * d:].view(n, hk, d)  # rows strided: a view, no copy
            o = attend(i, q.view(n, hq, d), k.view(n, hk, d), v)
            a = linear(o.reshape(n, hq * d).to(self.dtype), w[p + "self_attn.o_proj.weight"])
            layers.fused_add_rmsnorm(a, x, self._norm32[p + "post_attention_layernorm.weight"],
                                     eps)
            down = linear(layers.silu_and_mul(linear(a, self._gate_up[i])),
                          w[p + "mlp.down_proj.weight"])
            nxt = (f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_layers
                   else "model.norm.weight")
            layers.fused_add_rmsnorm(down, x, self._norm32[nxt], eps)  # x += down; normed
            h = down
        if rows is not None:
            h = h[torch.as_tensor(rows, device=self.device)]
        head = w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
        return linear(h, head).to(torch.float32)


def sdpa_attend(cfg: ModelConfig, ks: list, vs: list):
    """An ``attend`` callback over plain contiguous per-layer caches ``ks[layer]``,
    ``vs[layer]`` (``[T, Hkv, D]`` tensors, grown in place of the list entries): torch's
    ``scaled_dot_product_attention``, causal, the new rows being the cache's last ones."""
    g = cfg.group_size

    def attend(layer, q, k, v):
        ks[layer] = k if ks[layer] is None else torch.cat([ks[layer], k])
        vs[layer] = v if vs[layer] is None else torch.cat([vs[layer], v])
        kk, vv = ks[layer], vs[layer]
        n, t = q.shape[0], kk.shape[0]
        # query row i sits at position t - n + i and sees keys 0 .. t - n + i
        mask = torch.arange(t, device=q.device)[None, :] <= \
            torch.arange(t - n, t, device=q.device)[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1).repeat_interleave(g, 0),
            vv.transpose(0, 1).repeat_interleave(g, 0), attn_mask=mask)
        return o.transpose(0, 1)
    return attend


@torch.inference_mode()
def generate_alone_sdpa(model: TorchLlama, prompt, max_new_tokens: int) -> list[int]:
    """Greedy tokens of one request through ``model`` with plain contiguous KV and SDPA
    attention (no paging, no nbinfer): what the GPU engine is checked against."""
    n_layers = model.cfg.num_layers
    ks, vs = [None] * n_layers, [None] * n_layers
    attend = sdpa_attend(model.cfg, ks, vs)
    out, new, start = [], list(prompt), 0
    for _ in range(max_new_tokens):
        pos = np.arange(start, start + len(new))
        logits = model.forward(np.asarray(new), pos, attend, rows=[len(new) - 1])
        start += len(new)
        new = [int(logits[0].argmax())]
        out.append(new[0])
    return out
