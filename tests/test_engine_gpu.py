"""The engine on a GPU: the torch model over nbinfer's kernels against the same torch model
with plain SDPA attention over contiguous KV (``generate_alone_sdpa``, no paging, no nbinfer).

- fp32: greedy tokens equal, token for token, for 8 requests x 64 new tokens with staggered
  arrivals and a 48-token shared prompt prefix, with prefix caching (and so cascade decode
  steps) on and off, and with a pool small enough to preempt;
- bf16: every sampled token's logits against the fp32 model teacher-forced on the same tokens,
  no further off than the bf16 SDPA model is;
- CUDA graphs: the graph-replayed decode steps give the eager engine's tokens, and so does
  the engine's overlap (each step launched before the last one's tokens reach the host).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from nbinfer.engine import Engine, Request, init_weights, named_config  # noqa: E402

CFG = named_config("tiny")


@pytest.fixture(scope="module")
def weights():
    return init_weights(CFG, seed=5)


def _model(weights, dtype):
    from nbinfer.engine.torch_model import TorchLlama

    return TorchLlama(CFG, weights, device="cuda", dtype=dtype)


def _requests(seed, n=8, prompt=64, new=64, shared=48):
    rng = np.random.default_rng(seed)
    common = list(rng.integers(0, CFG.vocab_size, size=shared))
    return [Request(common + list(rng.integers(0, CFG.vocab_size, size=prompt - shared)), new,
                    arrival=int(2 * i)) for i in range(n)]


def _engine(model, num_pages=256, page_size=16, **kw):
    from nbinfer.engine.torch_runner import TorchRunner

    graphs = kw.pop("cuda_graphs", False)
    runner = TorchRunner(model, num_pages, page_size, cuda_graphs=graphs,
                         cascade_graphs=kw.pop("cascade_graphs", False))
    # "always": the tiny model's shared reads (a few KiB a layer) never pay for the cascade by
    # the engine's cost rule, and these tests are about the cascade step's tokens
    kw.setdefault("cascade", "always")
    return Engine(runner, num_pages, page_size, max_step_tokens=kw.pop("max_step_tokens", 96),
                  **kw)


@pytest.mark.parametrize("prefix_cache, num_pages", [(True, 256), (False, 256), (True, 14)])
def test_fp32_tokens_equal_sdpa_over_contiguous_kv(weights, prefix_cache, num_pages):
    from nbinfer.engine.torch_model import generate_alone_sdpa

    model = _model(weights, torch.float32)
    requests = _requests(1)
    engine = _engine(model, num_pages, prefix_cache=prefix_cache)
    got = engine.run(requests)
    want = [generate_alone_sdpa(model, r.prompt, r.max_new_tokens) for r in requests]
    assert got == want
    assert sum(len(o) for o in got) == 8 * 64
    if prefix_cache and num_pages == 256:
        assert engine.prefix_hit_rate > 0 and engine.cascade_steps > 0
    if num_pages == 14:
        assert engine.preemptions > 0


def test_bf16_logits_within_the_sdpa_models_own_error(weights):
    from nbinfer.engine.torch_model import sdpa_attend
    from nbinfer.engine.torch_runner import TorchRunner

    class Recording(TorchRunner):
        def forward(self, *args, **kw):
            logits = super().forward(*args, **kw)
            self.seen.append(logits.float().cpu())
            return logits

    bf16, fp32 = _model(weights, torch.bfloat16), _model(weights, torch.float32)
    requests = _requests(2, n=4, new=24)
    runner = Recording(bf16, 128, 16)
    runner.seen = []
    engine = Engine(runner, 128, 16, max_step_tokens=64, prefix_cache=True, cascade="always")
    reports = []
    outputs = engine.run(requests, on_step=reports.append)
    # each sampled token's logits, in step order, per request
    logits = {i: [] for i in range(len(requests))}
    for rep, step_logits in zip([r for r in reports if r.scheduled], runner.seen, strict=True):
        for (rid, _), row in zip(rep.sampled, step_logits, strict=True):
            logits[rid].append(row)
    worst_engine = worst_sdpa = 0.0
    for i, (r, out) in enumerate(zip(requests, outputs, strict=True)):
        seq = np.array(r.prompt + out[:-1])
        rows = np.arange(len(r.prompt) - 1, seq.size)

        truth, sdpa = (_forced(m, seq, rows, sdpa_attend) for m in (fp32, bf16))
        got = torch.stack(logits[i])
        assert got.shape == truth.shape
        worst_engine = max(worst_engine, float((got - truth).abs().max()))
        worst_sdpa = max(worst_sdpa, float((sdpa - truth).abs().max()))
    print(f"bf16 max |logit error|: engine {worst_engine:.4f}, SDPA {worst_sdpa:.4f}")
    assert worst_engine <= 2 * worst_sdpa + 1e-2


def _forced(model, seq, rows, sdpa_attend):
    """Teacher-forced logits of ``rows``: one causal SDPA pass over the tokens ``seq``."""
    ks, vs = [None] * CFG.num_layers, [None] * CFG.num_layers
    return model.forward(seq, np.arange(seq.size), sdpa_attend(CFG, ks, vs), rows=rows).cpu()


def test_cuda_graph_decode_gives_the_eager_tokens(weights):
    model = _model(weights, torch.float32)
    requests = _requests(3, n=6, new=32)
    eager = _engine(model, prefix_cache=True).run(requests)
    engine = _engine(model, prefix_cache=True, cuda_graphs=True)
    assert engine.run(requests) == eager
    assert engine.runner.graph_replays > 0
    # with cascade_graphs, decode steps over the shared prefix cascade under graphs too (the
    # cascade wrapper's CUDA-graph mode), replayed from graphs of their own
    engine = _engine(model, prefix_cache=True, cuda_graphs=True, cascade_graphs=True)
    assert engine.run(requests) == eager
    assert engine.cascade_steps > 0 and any(levels for _, levels in engine.runner._graphs)
    # each step launched before the last one's tokens reach the host: the placeholders are
    # filled on the device, in the eager forward and in the graph's token buffer alike
    for graphs, pages in ((False, 256), (True, 256), (True, 14)):
        engine = _engine(model, pages, prefix_cache=True, cuda_graphs=graphs, overlap=True)
        assert engine.run(requests) == eager, (graphs, pages)
        assert engine.runner.graph_replays > 0 or not graphs


def test_generate_command_on_the_gpu(capsys):
    from nbinfer.generate import main

    assert main(["--quiet", "--cuda-graphs", "on", "--shared-prefix", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "GPU torch float32" in out and "check: 6/6 requests" in out
    # the overlap with CUDA graphs and the runner's timing (events read without waiting)
    assert main(["--quiet", "--cuda-graphs", "on", "--overlap", "on", "--output-len", "24"]) == 0
    out = capsys.readouterr().out
    assert "check: 6/6 requests" in out and "attention " in out
    assert main(["--device", "gpu", "--dtype", "float64"]) == 2


def test_torch_model_equals_hugging_face_llama(weights):
    # The engine's torch model is the Llama of transformers (the benchmark's anchor): the same
    # weights give the same fp32 logits, Llama-3 RoPE scaling included.
    transformers = pytest.importorskip("transformers")
    from dataclasses import replace

    from nbinfer.engine.torch_model import TorchLlama, sdpa_attend

    cfg = replace(CFG, rope_scaling=named_config("llama-3.2-1b").rope_scaling,
                  tie_embeddings=False)
    ours = TorchLlama(cfg, init_weights(cfg, seed=6), device="cuda", dtype=torch.float32)
    hf_cfg = {k: v for k, v in cfg.to_hf().items() if k not in ("model_type", "_name_or_path")}
    config = transformers.LlamaConfig(**hf_cfg, attn_implementation="sdpa")
    with torch.device("cuda"):
        hf = transformers.LlamaForCausalLM(config).float().eval()
    missing, unexpected = hf.load_state_dict(ours.w, strict=False)
    assert not missing and not unexpected
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, size=300)
    with torch.inference_mode():
        want = hf(torch.as_tensor(tokens[None], device="cuda")).logits[0].float().cpu()
    ks, vs = [None] * cfg.num_layers, [None] * cfg.num_layers
    got = ours.forward(tokens, np.arange(tokens.size), sdpa_attend(cfg, ks, vs)).cpu()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype, tol, bias", [("float32", 1e-5, False), ("bfloat16", 2e-2, False),
                                             ("float32", 1e-5, True)])
def test_fused_layer_kernels_equal_the_torch_operations(dtype, tol, bias):
    # The model's default form on a GPU (nbinfer's layer kernels on one QKV and one gate-up
    # GEMM) against its torch-operation form on the same weights: logits of a prompt equal
    # to rounding, and in fp32 the same greedy tokens; with q/k/v biases (Qwen2) too
    from dataclasses import replace

    from nbinfer.engine.torch_model import TorchLlama, generate_alone_sdpa, sdpa_attend

    cfg = replace(CFG, attention_bias=bias)
    weights = init_weights(cfg, seed=9)
    dt = getattr(torch, dtype)
    fused = TorchLlama(cfg, weights, device="cuda", dtype=dt)
    plain = TorchLlama(cfg, weights, device="cuda", dtype=dt, fused=False)
    assert fused.fused and not plain.fused
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, size=200)
    pos = np.arange(tokens.size)
    got, want = (m.forward(tokens, pos, sdpa_attend(cfg, [None] * cfg.num_layers,
                                                    [None] * cfg.num_layers))
                 for m in (fused, plain))
    assert float((got - want).norm() / want.norm()) <= tol
    if dtype == "float32":
        assert generate_alone_sdpa(fused, list(tokens[:40]), 24) == \
            generate_alone_sdpa(plain, list(tokens[:40]), 24)


def test_rope_table_grows_under_the_engine_and_graphs_are_captured_again(weights):
    # A fused model whose RoPE table starts at 8 rows: the runner grows it from the step's
    # host positions before each forward (device positions cannot be read there), and the
    # decode graphs captured on an older table are captured again; tokens equal a model
    # whose table held every position from the start
    from nbinfer.engine.torch_model import TorchLlama

    small = TorchLlama(CFG, weights, device="cuda", dtype=torch.float32, max_positions=8)
    want = _engine(_model(weights, torch.float32), cuda_graphs=True).run(_requests(4))
    got = _engine(small, cuda_graphs=True).run(_requests(4))
    assert got == want
    assert small.rope_version >= 2 and small._cos_sin.shape[0] >= 64 + 64
