"""A small serving engine over nbinfer's attention: a Llama-family model, one paged KV pool,
continuous batching with chunked prefill and preemption.

Modules: :mod:`.config` (model shapes, named configurations, Hugging Face ``config.json``),
:mod:`.model` (the NumPy decoder, random weights, RoPE), :mod:`.pool` (page ids with reference
counts), :mod:`.runners` (a model over the paged caches), :mod:`.engine` (the step scheduler),
:mod:`.checkpoint` (Hugging Face folders, read with NumPy), :mod:`.torch_model` and
:mod:`.torch_runner` (the decoder in torch and its GPU runner with CUDA graphs; they need the
optional ``nbinfer[torch]``, so they are not imported here).
"""

from .config import CONFIGS, ModelConfig, config_from_hf, named_config
from .engine import Engine, Request, StepReport
from .model import NumpyLlama, generate_alone, init_weights, rope_frequencies, weight_shapes
from .pool import PagePool, pages_for_budget
from .runners import ApiRunner, NumpyRunner, StepAttention

__all__ = ["CONFIGS", "ApiRunner", "Engine", "ModelConfig", "NumpyLlama", "NumpyRunner",
           "PagePool", "Request", "StepAttention", "StepReport", "config_from_hf",
           "generate_alone", "init_weights", "named_config", "pages_for_budget",
           "rope_frequencies", "weight_shapes"]
