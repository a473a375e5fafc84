"""The engine on the H200: output tokens/s against Hugging Face transformers ``generate``.

    python bench/engine.py --out bench/results/issue12/engine_h200.json [--plot PNG] [--small]

A Llama-3.2-1B-shaped model with random bf16 weights (drawn on the GPU; the same weights in
both), 64 requests of 1024-token prompts and 256 new tokens each, all arriving at once, greedy:

- ``hf``: ``LlamaForCausalLM.generate`` (SDPA attention), its dynamic and its static cache,
  all 64 prompts as one batch (equal lengths: no padding);
- ``engine``: nbinfer's engine (paged pool, continuous batching, prefill chunks of up to
  ``--step-tokens``), eager and with CUDA-graph decode steps;
- ``shared``: the same with a 90 % common prompt prefix: prefix caching + cascade decode
  against the engine with both off (each eager and with graphs);
- ``overlap``: with graphs, each step launched before the previous step's tokens reach the
  host (``Engine(overlap=True)``), plain and shared;
- ``torch ops``: the overlap rows again on the same weights with each layer's elementwise work
  as torch operations (``TorchLlama(fused=False)``) instead of nbinfer's layer kernels;
- one eager run with CUDA-event timing: the share of GPU time in append + attention.

Every run is timed from the first token in to the last token out (``torch.cuda.synchronize``
before and after), after a warm-up run of the same configuration on as many short requests (kernels
compiled or loaded, the graph bucket of the batch captured). Output tokens/s = 64 * 256 / wall.
The per-step latencies (``on_step`` wall clock, the step ends with the sampled tokens on the
host) separate prefill steps from decode steps; in the overlap rows ``decode_host_ms_p50`` is a
decode step's wall time less its wait for the step before it in ``fetch()``: the host half of
the step, which binds when it exceeds the replayed step's GPU time (``graph_replay_gpu_ms``).
The last lines are a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch

os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

from engine_overlap_cpu import time_fetch  # noqa: E402 (this folder: python3 bench/engine.py)

from nbinfer.engine import Engine, Request, named_config  # noqa: E402
from nbinfer.engine.torch_model import TorchLlama  # noqa: E402
from nbinfer.engine.torch_runner import TorchRunner  # noqa: E402

PAGE = 16


def make_requests(rng, n, prompt, new, shared, vocab):
    common = list(rng.integers(0, vocab, size=int(round(prompt * shared))))
    return [Request(common + list(rng.integers(0, vocab, size=prompt - len(common))), new)
            for _ in range(n)]


def engine_run(model, reqs, warm, *, graphs, prefix, cascade, step_tokens, timing=False,
               overlap=False, around=contextlib.nullcontext):
    """One engine run to completion, after a warm-up run of ``warm`` on the same runner (the
    kernels loaded, the graph buckets captured); wall time, tokens/s and step statistics.
    ``cascade``: the engine's mode ("off", "auto": its rule, "always"); when it is not "off"
    the warm-up runs twice, paged and cascading (every graph the run may replay captured
    before it: a warm-up that only cascaded left the paged buckets to the timed run).
    ``around()``: a context manager entered around the timed run only (a profiler's)."""
    need = sum(-(-(len(r.prompt) + r.max_new_tokens) // PAGE) for r in reqs)
    pages = need + 64
    runner = TorchRunner(model, pages, PAGE, cuda_graphs=graphs, timing=timing,
                         graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64),
                         cascade_graphs=cascade != "off")

    def engine(mode=cascade):
        return Engine(runner, pages, PAGE, max_step_tokens=step_tokens, max_batch=len(reqs),
                      prefix_cache=prefix, cascade=mode, overlap=overlap)

    for mode in ("off",) if cascade == "off" else ("off", "always"):
        engine(mode).run(warm)
    runner.attention_seconds = 0.0
    engine = engine()
    steps, last = [], [0.0]
    # With overlap a step's wall time is its host work plus the wait in fetch() for the step
    # before it: the host half of a step is the wall time less that wait (without overlap the
    # wait is inside the sampling's argmax, not separable).
    waited = time_fetch(runner)

    def on_step(rep):
        now = time.perf_counter()
        decode = all(n == 1 for _, n in rep.scheduled)
        steps.append((now - last[0], decode, rep.attention, waited[0]))
        last[0], waited[0] = now, 0.0

    torch.cuda.synchronize()
    t0 = last[0] = time.perf_counter()
    with around(), replay_events() as replays:
        outputs = engine.run(reqs, on_step=on_step)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    n_out = sum(len(o) for o in outputs)
    dec = [s * 1e3 for s, d, _, _ in steps if d]
    pre = [s * 1e3 for s, d, _, _ in steps if not d]
    host = [(s - w) * 1e3 for s, d, _, w in steps if d]
    res = dict(wall_s=wall, tokens_per_s=n_out / wall, steps=len(steps),
               decode_steps=len(dec), decode_step_ms_p50=float(np.median(dec)) if dec else None,
               decode_step_ms_p99=float(np.percentile(dec, 99)) if dec else None,
               prefill_steps=len(pre), prefill_s=sum(pre) / 1e3,
               prefix_hit_rate=engine.prefix_hit_rate, cascade_steps=engine.cascade_steps,
               graph_replays=runner.graph_replays, preemptions=engine.preemptions)
    if overlap and host:
        res["decode_host_ms_p50"] = float(np.median(host))  # the step less its fetch wait
        res["decode_fetch_ms_mean"] = float(np.mean([w for _, d, _, w in steps if d])) * 1e3
    if timing:
        res["attention_s"] = runner.attention_seconds
        res["attention_share"] = runner.attention_seconds / wall
    if replays:  # every replay of the run, each between its own events
        times = [a.elapsed_time(b) for a, b in replays]
        res["replay_gpu_ms_run_p50"] = float(np.median(times))
        res["replay_gpu_ms_run_mean"] = float(np.mean(times))
    if graphs and runner._graphs:
        graph = last_graph(runner, engine.cascade_steps > 0)
        res["graph_replay_gpu_ms"] = replay_ms(graph)
        res["graph_replay_kernels"] = replay_breakdown(graph)
    return res, outputs


@contextlib.contextmanager
def replay_events():
    """Inside, every ``CUDAGraph.replay()`` is bracketed by two timing events on the current
    stream; yields the list of their pairs. An event's time is when the stream reaches it, so a
    pair measures its replay's GPU time even when the host runs ahead (overlap): the steps of
    the run itself, where :func:`replay_ms` replays only the last plan (with the features off
    the requests finish over several steps, and the last one holds fewer live rows)."""
    pairs, replay = [], torch.cuda.CUDAGraph.replay

    def timed(graph):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        pairs.append((start, end))

    torch.cuda.CUDAGraph.replay = timed
    try:
        yield pairs
    finally:
        torch.cuda.CUDAGraph.replay = replay


def last_graph(runner, cascaded: bool):
    """The CUDA graph of the largest decode step the run replayed: the largest bucket's, a
    cascade step's when the run cascaded (the warm-up may have captured one the run never
    replayed), holding its last plan (the final KV lengths)."""
    keys = [k for k in runner._graphs if (k[1] > 0) == cascaded] or list(runner._graphs)
    return runner._graphs[max(keys)].graph


def replay_ms(graph, reps=20):
    """GPU time of one replay of ``graph`` (:func:`last_graph`), CUDA events around
    back-to-back replays: the step without the host."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def replay_breakdown(graph, reps=10):
    """The same replayed step as :func:`replay_ms` under torch.profiler (CUPTI reports each
    kernel node of a graph): its GPU time by kernel kind, ms per replay, and the top kernels.
    Where the replayed step's time goes in each row, not in an eager stand-in."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    return kernel_kinds(prof, reps, top=8)


def gpu_breakdown(model, reqs, step_tokens, *, prefix=False, cascade="off", top=None):
    """GPU kernel time by kind over the decode steps of a short eager run (torch.profiler):
    GEMMs, nbinfer's attention, nbinfer's append, nbinfer's layer kernels (fused norms, RoPE,
    SiLU-and-multiply), everything else (torch's elementwise kernels, embedding, argmax).
    ``prefix`` / ``cascade``: the engine's prefix cache and cascade mode; ``top``: also the
    ``top`` kernels by time per step (``"top kernels us"``)."""
    from torch.profiler import ProfilerActivity, profile

    short = [Request(r.prompt, 8) for r in reqs]
    pages = sum(-(-(len(r.prompt) + 8) // PAGE) for r in short) + 64
    runner = TorchRunner(model, pages, PAGE)
    engine = Engine(runner, pages, PAGE, max_step_tokens=step_tokens, max_batch=len(reqs),
                    prefix_cache=prefix, cascade=cascade)
    for r in short:
        engine.add_request(r)
    while True:  # prefill, up to the first decode-only step
        rep = engine.step()
        if not engine.waiting and all(n == 1 for _, n in rep.scheduled):
            break
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    res = kernel_kinds(prof, steps, top)
    res["cascade_steps"] = engine.cascade_steps
    return res


def kernel_kinds(prof, steps, top=None):
    """A torch.profiler run's GPU kernel time by kind, ms per step over ``steps`` steps: GEMMs,
    nbinfer's attention (merges included), append, layer kernels (fused norms, RoPE,
    SiLU-and-multiply), everything else; ``top``: also the ``top`` kernels, us per step."""
    kinds = {"gemm": 0.0, "attention": 0.0, "append": 0.0, "layer kernels": 0.0, "other": 0.0}
    names = {}
    for ev in prof.key_averages():
        name, us = ev.key.lower(), ev.self_device_time_total
        names[ev.key[:80]] = names.get(ev.key[:80], 0.0) + us / steps  # (specs share prefixes)
        if "append" in name:
            kinds["append"] += us
        elif any(k in name for k in ("rmsnorm", "silu_and_mul", "rope")):
            kinds["layer kernels"] += us  # nbinfer.kernels.layers (the fused model's)
        elif any(k in name for k in ("decode", "prefill", "value_scan", "attention", "merge")):
            kinds["attention"] += us
        elif any(k in name for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul")):
            kinds["gemm"] += us
        else:
            kinds["other"] += us
    res = {k: v / 1e3 / steps for k, v in kinds.items()} | {"steps": steps}
    if top:
        res["top kernels us"] = dict(sorted(names.items(), key=lambda kv: -kv[1])[:top])
    return res


def hf_model(model, cfg):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = {k: v for k, v in cfg.to_hf().items() if k not in ("model_type", "_name_or_path")}
    config = LlamaConfig(**hf_cfg, attn_implementation="sdpa")
    with torch.device("cuda"):
        hf = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    missing, unexpected = hf.load_state_dict(model.w, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf


@torch.inference_mode()
def hf_run(hf, reqs, cache):
    ids = torch.tensor([r.prompt for r in reqs], device="cuda")
    new = reqs[0].max_new_tokens
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                      min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
                      cache_implementation=cache)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gen = out[:, ids.shape[1]:].tolist()
    return dict(wall_s=wall, tokens_per_s=sum(len(g) for g in gen) / wall), gen


def agreement(a, b, k=16):
    """Share of requests whose first ``k`` greedy tokens agree (bf16: informational only)."""
    return float(np.mean([x[:k] == y[:k] for x, y in zip(a, b, strict=True)]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--small", action="store_true", help="8 x 256 + 32 (a quick check)")
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=1024,
                    help="prompt tokens per request (the issue's benchmark: 1024)")
    ap.add_argument("--shared-only", action="store_true",
                    help="only the 90 %%-shared-prefix rows (no HF, no breakdown): a quick A/B")
    ap.add_argument("--layer-ops", choices=("nbinfer", "torch"), default="nbinfer",
                    help="the model's elementwise work in the main rows: nbinfer's layer "
                         "kernels (TorchLlama's default on a GPU) or torch operations")
    a = ap.parse_args()
    cfg = named_config("llama-3.2-1b")
    n, prompt, new = (8, 256, 32) if a.small else (64, a.prompt, 256)
    model = TorchLlama.random(cfg, "cuda", torch.bfloat16, seed=0,
                              fused=a.layer_ops == "nbinfer")
    # the same weights with each layer's elementwise work as torch operations (the model's
    # form before nbinfer's layer kernels): the A/B rows "..., torch ops" (none when the main
    # rows run that form already)
    torch_ops = (TorchLlama(cfg, model.w, "cuda", torch.bfloat16, fused=False)
                 if a.layer_ops == "nbinfer" else None)
    rng = np.random.default_rng(0)
    plain = make_requests(rng, n, prompt, new, 0.0, cfg.vocab_size)
    shared = make_requests(rng, n, prompt, new, 0.9, cfg.vocab_size)
    # as many requests as the runs (their decode steps fill the same graph bucket), short, two
    # pages of them shared (a prefix-cache run's warm-up then captures its cascade graph too)
    warm = make_requests(rng, n, 48, 4, 0.75, cfg.vocab_size)
    results = dict(device=torch.cuda.get_device_name(), model=cfg.name, dtype="bfloat16",
                   cascade_rule=Engine.CASCADE_RULE, requests=n, prompt=prompt,
                   new_tokens=new, page_size=PAGE, step_tokens=a.step_tokens,
                   layer_ops=a.layer_ops)
    # cascade="auto" is the engine's rule (Engine.CASCADE_RULE): at 1024-token prompts (912
    # shared tokens, 2 KiB of KV each a layer: 20.3 us of saved reads a layer against its
    # 15.4 us) it cascades the decode steps of the overlap rows and keeps the others paged
    # (their host time counts); "always" cascades every step that shares pages, the rule's A/B.
    # --prompt 4096 is a shape where the rule cascades in every row.
    runs = {
        "engine eager": dict(reqs=plain, graphs=False, prefix=False, cascade="off"),
        "engine graphs": dict(reqs=plain, graphs=True, prefix=False, cascade="off"),
        "shared, both off, eager": dict(reqs=shared, graphs=False, prefix=False, cascade="off"),
        "shared, prefix+cascade, eager": dict(reqs=shared, graphs=False, prefix=True,
                                              cascade="auto"),
        "shared, both off, graphs": dict(reqs=shared, graphs=True, prefix=False, cascade="off"),
        "shared, prefix+cascade, graphs": dict(reqs=shared, graphs=True, prefix=True,
                                               cascade="auto"),
        "shared, prefix only, graphs": dict(reqs=shared, graphs=True, prefix=True,
                                            cascade="off"),
        # each step launched before the last one's tokens reach the host (Engine's overlap)
        "engine graphs, overlap": dict(reqs=plain, graphs=True, prefix=False, cascade="off",
                                       overlap=True),
        "shared, both off, graphs, overlap": dict(reqs=shared, graphs=True, prefix=False,
                                                  cascade="off", overlap=True),
        "shared, prefix+cascade, graphs, overlap": dict(reqs=shared, graphs=True, prefix=True,
                                                        cascade="auto", overlap=True),
        # the cascade on every step that shares pages (the rule's A/B: "auto" decides by
        # the KV bytes the step saves, Engine.CASCADE_RULE)
        "shared, prefix+cascade always, graphs, overlap": dict(
            reqs=shared, graphs=True, prefix=True, cascade="always", overlap=True),
        # the cascade's worth on top of the prefix cache, with overlap hiding host time
        "shared, prefix only, graphs, overlap": dict(reqs=shared, graphs=True, prefix=True,
                                                     cascade="off", overlap=True),
    }
    if torch_ops is not None:
        runs.update({
            "engine graphs, overlap, torch ops": dict(reqs=plain, graphs=True, prefix=False,
                                                      cascade="off", overlap=True,
                                                      model=torch_ops),
            "shared, both off, graphs, overlap, torch ops": dict(
                reqs=shared, graphs=True, prefix=False, cascade="off", overlap=True,
                model=torch_ops),
            "shared, prefix+cascade, graphs, overlap, torch ops": dict(
                reqs=shared, graphs=True, prefix=True, cascade="auto", overlap=True,
                model=torch_ops)})
    if a.shared_only:
        runs = {k: v for k, v in runs.items() if k.startswith("shared")}
    outputs = {}
    for name, kw in runs.items():
        reqs, m = kw.pop("reqs"), kw.pop("model", model)
        results[name], outputs[name] = engine_run(m, reqs, warm, step_tokens=a.step_tokens,
                                                  **kw)
        print(name, json.dumps(results[name]), flush=True)
    if a.shared_only:
        results["shared-prefix speedup"] = shared_speedups(results)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        for k, v in results.items():
            if isinstance(v, dict) and "tokens_per_s" in v:
                host = v.get("decode_host_ms_p50")
                print(f"{k:50s} {v['tokens_per_s']:9.0f} {v['wall_s']:7.2f} "
                      f"{v['decode_step_ms_p50']:7.2f} prefill {v['prefill_s']:.3f} s, hit "
                      f"{v['prefix_hit_rate']:.3f}, cascade steps {v['cascade_steps']}"
                      + ("" if host is None else f", host {host:.2f} ms")
                      + ("" if v.get("graph_replay_gpu_ms") is None
                         else f", replay GPU {v['graph_replay_gpu_ms']:.2f} ms")
                      + ("" if v.get("replay_gpu_ms_run_p50") is None
                         else f" (run's replays p50 {v['replay_gpu_ms_run_p50']:.2f})"))
        print("shared-prefix speedup", {n: round(x, 2) for n, x in
                                        results["shared-prefix speedup"].items()})
        print("replayed step, GPU ms by kernel kind (profiler):")
        for k, v in results.items():
            kinds = v.get("graph_replay_kernels") if isinstance(v, dict) else None
            if kinds:
                print(f"  {k:48s} " + " ".join(f"{n} {kinds[n]:.3f}" for n in (
                    "gemm", "attention", "append", "layer kernels", "other")))
        return
    results["engine eager, timed"], _ = engine_run(model, plain, warm, graphs=False,
                                                   prefix=False, cascade="off",
                                                   step_tokens=a.step_tokens, timing=True)
    results["decode step GPU ms by kernel kind (eager, profiler)"] = gpu_breakdown(
        model, plain, a.step_tokens)
    print("breakdown", results["decode step GPU ms by kernel kind (eager, profiler)"], flush=True)
    if torch_ops is not None:
        key = "decode step GPU ms by kernel kind, torch ops (eager, profiler)"
        results[key] = gpu_breakdown(torch_ops, plain, a.step_tokens)
        print("breakdown, torch ops", results[key], flush=True)
    hf = hf_model(model, cfg)
    for cache in ("dynamic", "static"):
        hf_run(hf, warm, cache)
        results[f"hf {cache}"], outputs[f"hf {cache}"] = hf_run(hf, plain, cache)
        print(f"hf {cache}", json.dumps(results[f"hf {cache}"]), flush=True)
    best_hf = max(results["hf dynamic"]["tokens_per_s"], results["hf static"]["tokens_per_s"])
    results["speedup vs hf"] = {k: results[k]["tokens_per_s"] / best_hf
                                for k in ("engine eager", "engine graphs",
                                          "engine graphs, overlap")}
    results["shared-prefix speedup"] = shared_speedups(results)
    if torch_ops is not None:
        results["layer kernels vs torch ops, engine graphs, overlap"] = results[
            "engine graphs, overlap"]["tokens_per_s"] / results[
            "engine graphs, overlap, torch ops"]["tokens_per_s"]
    # bf16 greedy decoding of random weights: near-ties part the two ways early (the fp32
    # equality of the two models is tests/test_engine_gpu.py's); informational only
    for k in (1, 16):
        results[f"agreement first {k} tokens, engine graphs vs hf dynamic (bf16)"] = agreement(
            outputs["engine graphs"], outputs["hf dynamic"], k)
    results["agreement, engine eager vs graphs"] = agreement(
        outputs["engine eager"], outputs["engine graphs"], new)
    results["agreement, engine graphs vs graphs with overlap"] = agreement(
        outputs["engine graphs"], outputs["engine graphs, overlap"], new)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    if a.plot:
        plot(results, a.plot)
    print(f"\n{'run':34s} {'tokens/s':>9s} {'wall s':>7s} {'decode ms p50':>13s} "
          f"{'replay GPU ms':>13s} {'host ms p50':>11s}")
    for k, v in results.items():
        if isinstance(v, dict) and "tokens_per_s" in v:
            d, g = v.get("decode_step_ms_p50"), v.get("graph_replay_gpu_ms")
            h = v.get("decode_host_ms_p50")
            print(f"{k:34s} {v['tokens_per_s']:9.0f} {v['wall_s']:7.2f} "
                  f"{'' if d is None else f'{d:13.2f}'} {'' if g is None else f'{g:13.2f}'} "
                  f"{'' if h is None else f'{h:11.2f}'}")
    for k in ("speedup vs hf", "shared-prefix speedup"):
        print(k, {n: round(x, 2) for n, x in results[k].items()})


def shared_speedups(results) -> dict:
    """Tokens/s of each shared-prefix row with the prefix cache against the same row with both
    off (the rows the run has)."""
    out = {}
    for mode in ("eager", "graphs", "graphs, overlap", "graphs, overlap, torch ops"):
        off = results.get(f"shared, both off, {mode}")
        for on in ("prefix+cascade", "prefix+cascade always", "prefix only"):
            row = results.get(f"shared, {on}, {mode}")
            if off is not None and row is not None:
                out[f"{on} vs both off, {mode}"] = row["tokens_per_s"] / off["tokens_per_s"]
    return out


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k, v in results.items() if isinstance(v, dict) and "tokens_per_s" in v
             and "timed" not in k]
    vals = [results[k]["tokens_per_s"] for k in names]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    colors = ["#888888" if k.startswith("hf") else "#1f77b4" for k in names]
    ax.barh(names, vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals) * 1.12)
    ax.set_xlabel("output tokens / s")
    ax.set_title(f"{results['model']} bf16 on {results['device']}: {results['requests']} "
                 f"requests x {results['prompt']} prompt + {results['new_tokens']} new",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
