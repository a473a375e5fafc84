# %% [markdown]
# # Lesson 08: a model's generation, end to end
#
# Lessons 01-07 built the parts one by one: attention states and their merge, the page table
# read as a block-sparse matrix, shared-prefix formats, the gather kernels, variants, the
# scheduler, tensor cores. This lesson puts a model on top of them the way a serving engine
# does (`nbinfer.engine`): many requests at once, one pool of KV pages, one forward pass per
# step over whatever the step holds.
#
# **You will learn**
#
# 1. the engine's loop: schedule a step's tokens under a budget (decodes first, then prompt
#    chunks), give them pages, run the model once over the whole batch, sample;
# 2. which pages each request holds over time: a long prompt arrives in chunks, pages are taken
#    one at a time as sequences grow, finished requests give theirs back;
# 3. why one `plan()` per step serves every layer;
# 4. what a shared prompt prefix saves: the prefix cache hands its pages to every request that
#    starts with it (fewer pages, fewer prefill tokens), and decode reads them once per step as
#    a cascade;
# 5. the check that makes all of it trustworthy: every request's tokens equal the request run
#    alone, without pages;
# 6. how a step can be launched before the previous step's tokens reach the host (placeholders
#    filled where the tokens are), which keeps a GPU from waiting on the host between steps;
# 7. what a layer does around attention, and why a GPU runs it as a few fused kernels.
#
# It runs on a CPU: the `tiny` model (2 layers, 4 query heads over 2 KV heads, head_dim 64) in
# float32 NumPy with random weights, attention through nbinfer's public wrappers on the
# reference backend. `python -m nbinfer.generate` runs the same engine from the command line,
# and on a GPU over the kernels (`TorchRunner`, CUDA graphs).

# %%
from nbinfer.lessons_tool import start_lesson

ROOT = start_lesson()  # Numba's CUDA simulator, chosen before Numba loads; the repository root

import json

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from nbinfer import scheduler
from nbinfer.engine import Engine, NumpyLlama, Request, generate_alone, init_weights, named_config
from nbinfer.engine.runners import ApiRunner
from nbinfer.scheduler.draw import plot_gantt
from nbinfer.viz import request_colors, save_figure, show, subplots

np.set_printoptions(linewidth=100)
rng = np.random.default_rng(8)

# %% [markdown]
# ## 1. A model, a pool, a handful of requests
#
# The pool is 48 pages of 4 tokens for the whole run. Six requests arrive over the first steps:
# four begin with the same 16-token "system prompt", one has a 40-token prompt (longer than a
# step's budget of 24 tokens), one is short.

# %%
cfg = named_config("tiny")
model = NumpyLlama(cfg, init_weights(cfg, seed=8), dtype=np.float32)
PAGE, POOL, BUDGET = 4, 48, 24
print(cfg)
print(f"KV per token over all layers: {cfg.kv_bytes_per_token(4)} bytes (float32); "
      f"the pool holds {POOL * PAGE} tokens")


def tokens(n):
    return list(rng.integers(0, cfg.vocab_size, size=n))


system = tokens(16)
requests = [Request(system + tokens(5), 10, arrival=0),
            Request(system + tokens(9), 8, arrival=1),
            Request(tokens(40), 6, arrival=2),  # longer than a step's budget: chunked
            Request(system + tokens(3), 12, arrival=3),
            Request(tokens(7), 9, arrival=5),
            Request(system + tokens(6), 7, arrival=6)]
names = [f"r{i}" for i in range(len(requests))]
for name, r in zip(names, requests, strict=True):
    print(f"{name}: prompt {len(r.prompt):2d} tokens, {r.max_new_tokens:2d} new, "
          f"arrives at step {r.arrival}")

# %% [markdown]
# ## 2. Run it, and keep what every step did
#
# A step report says which requests the step scheduled and how many tokens each (a decode is
# one token, a prompt chunk more), what was sampled, what finished. Beside it we record the
# pages every running request holds after the step, and the arguments the runner received:
# the step's batch as the attention sees it.


# %%
class Recording(ApiRunner):
    """ApiRunner that keeps each step's batch (query rows and KV lengths per sequence)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.batches = []

    def forward(self, tokens, positions, qo_indptr, kv_indptr, kv_indices, last, levels=None,
                rows=None):
        kv_lens = (np.diff(kv_indptr) - 1) * self.page_size + last
        self.batches.append((qo_indptr.copy(), kv_lens, levels))
        return super().forward(tokens, positions, qo_indptr, kv_indptr, kv_indices, last,
                               levels=levels, rows=rows)


def serve(prefix_cache: bool):
    runner = Recording(model, POOL, PAGE)
    engine = Engine(runner, POOL, PAGE, max_step_tokens=BUDGET, prefix_cache=prefix_cache,
                    cascade="auto" if prefix_cache else "off")
    reports, holdings = [], []

    def on_step(report):  # after each step: the pages of every running request, and the
        reports.append(report)  # pages in use (running requests' and the prefix cache's)
        holdings.append(({s.rid: list(s.pages) for s in engine.running},
                         np.flatnonzero(engine.pool.refs > 0)))

    outputs = engine.run(requests, on_step=on_step)
    return engine, runner, reports, holdings, outputs


engine, runner, reports, holdings, outputs = serve(prefix_cache=True)
for rep in reports[:10]:
    print(f"step {rep.step:2d}: scheduled {list(rep.scheduled)}, {rep.attention or 'idle'}, "
          f"{rep.pages_in_use} pages in use")
print("...")
print(f"{engine.steps} steps; prefix hit rate {engine.prefix_hit_rate:.0%}; cascade steps "
      f"{engine.cascade_steps}")

assert all(rep.num_tokens <= BUDGET for rep in reports)  # the budget holds every step
chunks = [n for rep in reports for rid, n in rep.scheduled if rid == 2 and n > 1]
print("r2's prompt chunks:", chunks)
assert len(chunks) >= 2 and sum(chunks) <= len(requests[2].prompt)  # 40 tokens, two chunks+

# %% [markdown]
# ## 3. Which pages each request holds over time
#
# Left: the pool as a picture, one column per step and one row per physical page, coloured by
# the request holding it (dark grey: held by more than one running request, a shared prefix
# page; light grey: kept only by the prefix cache, free to evict). Right: what each step
# scheduled, one bar per request, prompt chunks light and decode tokens dark.

# %%
steps = len(reports)
colors = request_colors(len(requests))
palette = ["#ffffff", "#d0d0d0", "#555555"] + colors  # free, cached only, shared, r0, r1, ...
code = np.zeros((POOL, steps), dtype=int)  # 0 free, 1 cached only, 2 shared, 3 + request id
for t, (held, in_use) in enumerate(holdings):
    count = np.zeros(POOL, dtype=int)
    for pages in held.values():
        count[pages] += 1
    code[in_use, t] = 1  # in use: cached only, unless a running request holds it (below)
    for rid, pages in held.items():
        code[pages, t] = np.where(count[pages] > 1, 2, 3 + rid)
    assert len(in_use) == reports[t].pages_in_use

fig, ax = subplots(2, 2, figsize=(12.5, 8.2), gridspec_kw={"height_ratios": [1.25, 1]})
ax[0, 0].imshow(code, cmap=ListedColormap(palette), vmin=0, vmax=len(palette) - 1,
                aspect="auto", interpolation="nearest", origin="lower")
ax[0, 0].set_xlabel("step")
ax[0, 0].set_ylabel("physical page")
ax[0, 0].set_title("who holds each page of the pool (prefix cache on)")
ax[0, 0].legend(handles=[Patch(color=palette[2], label="shared"),
                         Patch(color=palette[1], label="prefix cache only")]
                + [Patch(color=c, label=n) for c, n in zip(colors, names, strict=True)],
                fontsize=7, loc="upper left", ncol=4)

bottom = np.zeros(steps)
for rid, name in enumerate(names):
    n_tok = np.array([dict(rep.scheduled).get(rid, 0) for rep in reports])
    is_decode = n_tok == 1
    ax[0, 1].bar(np.arange(steps), np.where(is_decode, 0, n_tok), bottom=bottom,
                 color=colors[rid], alpha=0.45, width=0.85)
    ax[0, 1].bar(np.arange(steps), np.where(is_decode, n_tok, 0), bottom=bottom,
                 color=colors[rid], width=0.85, label=name)
    bottom += n_tok
ax[0, 1].axhline(BUDGET, color="k", ls="--", lw=1)
ax[0, 1].text(steps - 0.5, BUDGET + 0.3, f"step budget ({BUDGET} tokens)", ha="right",
              va="bottom", fontsize=8)
ax[0, 1].set_ylim(0, BUDGET * 1.35)
ax[0, 1].set_xlabel("step")
ax[0, 1].set_ylabel("tokens in the step")
ax[0, 1].set_title("batch composition: prompt chunks (light), decode tokens (dark)")
ax[0, 1].legend(fontsize=7, ncol=3)

# every page comes back: at the end the pool holds only what the prefix cache keeps
assert not engine.running and engine.pool.num_free + engine.tree.num_pages == POOL
span = {names[r]: (min(t for t, (h, _) in enumerate(holdings) if r in h),
                   max(t for t, (h, _) in enumerate(holdings) if r in h)) for r in range(6)}
print("first and last step each request held pages:", span)
# pages are taken as the tokens come: a request never holds more than its tokens so far need
for t, (held, _) in enumerate(holdings):
    for rid, pages in held.items():
        computed = sum(n for rep in reports[:t + 1] for r, n in rep.scheduled if r == rid)
        assert len(pages) <= -(-computed // PAGE) + -(-len(requests[rid].prompt) // PAGE)
shared_steps = int((code == 2).any(axis=0).sum())
print(f"{shared_steps} steps had pages shared by several running requests")
assert shared_steps > 0

# %% [markdown]
# ## 4. One plan per step, for every layer
#
# A layer's attention needs the step's batch (query rows per sequence), the page table and the
# head counts, and nothing else: no layer changes which pages hold what, and every layer reads
# the same positions. So the runner plans once per step (`plan()`: validate, schedule, upload),
# then every layer only runs (`append.run` then `attention.run`). The counters of the runner's
# `StepAttention` show it; below, the plan of one mixed step (decodes and a prompt chunk
# together) over 4 CTAs, the work list every layer of that step runs.

# %%
worked = sum(1 for rep in reports if rep.scheduled)
print(f"{worked} steps with work: {runner.attention.plans} plans, {runner.attention.runs} "
      f"attention runs ({cfg.num_layers} layers)")
assert runner.attention.plans == worked
assert runner.attention.runs == worked * cfg.num_layers

# the mixed step (decodes and a prompt chunk together) with the most sequences
mixed = max((t for t, rep in enumerate(reports) if len({n == 1 for _, n in rep.scheduled}) == 2),
            key=lambda t: len(reports[t].scheduled))
work_step = sum(1 for rep in reports[:mixed] if rep.scheduled)
qo_indptr, kv_lens, _ = runner.batches[work_step]
step_plan = scheduler.plan(qo_indptr, kv_lens, cfg.num_heads, cfg.num_kv_heads, num_ctas=4,
                           granule=4)
print(f"step {mixed}: query rows {np.diff(qo_indptr).tolist()}, KV lengths {kv_lens.tolist()}")
print(f"its plan: {step_plan.num_work} work items over {step_plan.num_ctas} CTAs")
assert step_plan.num_qo_rows == qo_indptr[-1]
plot_gantt(step_plan, ax[1, 1], title=f"step {mixed}'s plan: the work list of every layer")
_ = ax[1, 1].set_yticks(range(step_plan.num_ctas))  # (the tick objects are not output)

# %% [markdown]
# ## 5. What the shared prefix saves
#
# The same requests again with the prefix cache (and so the cascade) off. With it on, a request
# that starts with cached tokens is admitted with their pages (their reference count goes up)
# and prefills only the rest; decode steps whose sequences share pages read each shared page
# once for all of them (a two-level cascade: the shared pages, then each sequence's own), the
# states merged exactly as in lesson 01.

# %%
engine_off, runner_off, reports_off, _, outputs_off = serve(prefix_cache=False)
prefill = {k: sum(n for rep in reps for _, n in rep.scheduled if n > 1)
           for k, reps in (("on", reports), ("off", reports_off))}
peak = {k: max(rep.pages_in_use for rep in reps)
        for k, reps in (("on", reports), ("off", reports_off))}
print(f"prompt tokens computed: {prefill['on']} with the prefix cache, {prefill['off']} "
      f"without; peak pages in use {peak['on']} vs {peak['off']}")


def kv_saved(levels):
    """KV tokens a cascade step does not read: each level-0 segment's shared pages are read
    once instead of once per member sequence."""
    shared_pages = np.diff(levels.paged_kv_indptr_arr[0])
    members = np.diff(levels.qo_indptr_arr[0])
    return int(PAGE * (shared_pages * (members - 1)).sum())


cascade_batches = [b for b in runner.batches if b[2] is not None]
saved = [kv_saved(levels) for _, _, levels in cascade_batches]
total = sum(int(kv_lens.sum()) for _, kv_lens, _ in cascade_batches)
print(f"{len(cascade_batches)} cascade steps read {sum(saved)} fewer KV tokens than paged "
      f"decode would ({sum(saved) / total:.0%} of {total})")
assert outputs == outputs_off  # the same tokens either way
assert engine.prefix_hit_rate > 0 and engine_off.prefix_hit_rate == 0
assert prefill["on"] < prefill["off"] and peak["on"] <= peak["off"]
assert cascade_batches and all(s > 0 for s in saved)

in_use = {k: [rep.pages_in_use for rep in reps] for k, reps in (("on", reports),
                                                                 ("off", reports_off))}
ax[1, 0].step(np.arange(len(in_use["off"])), in_use["off"], where="mid", color="0.5",
              label="prefix cache off")
ax[1, 0].step(np.arange(len(in_use["on"])), in_use["on"], where="mid", color="C0",
              label="prefix cache on (cached pages included)")
for t, rep in enumerate(reports):
    if rep.attention == "cascade":
        ax[1, 0].axvspan(t - 0.5, t + 0.5, color="C0", alpha=0.08, lw=0)
ax[1, 0].set_xlabel("step")
ax[1, 0].set_ylabel("pages in use")
ax[1, 0].set_title("pages in use (shaded: decode steps run as a cascade)")
ax[1, 0].legend(fontsize=8)
save_figure(fig, "08_engine.png")
show(fig)

# %% [markdown]
# ## 6. The check
#
# Every request alone, through the same model with a plain contiguous KV cache and no pages
# (`generate_alone`), must give exactly the engine's tokens: batching, chunking, paging, the
# prefix cache and the cascade change where keys and values live and in which order the work
# is done, never the result.

# %%
alone = [generate_alone(model, r.prompt, r.max_new_tokens) for r in requests]
for name, got, want in zip(names, outputs, alone, strict=True):
    print(f"{name}: {got}{'' if got == want else '  <- differs from ' + str(want)}")
assert outputs == alone

# %% [markdown]
# ## 7. Launching a step before the last one's tokens arrive
#
# On a GPU a step's sampled tokens reach the host only once the step has finished, and the
# host then schedules, allocates and plans the next step while the GPU waits. None of that
# needs the tokens' *values*: only how many tokens each sequence has (a request ends after
# `max_new_tokens`). With `Engine(overlap=True)` the next step is launched first, each token
# still "on the device" entering its batch as a placeholder `-1 - j` (row `j` of the last
# step's sampled tokens), which the runner fills in where the tokens are; the previous step is
# completed after that (tokens copied back, placeholders replaced, finished requests' pages
# released, full pages handed to the prefix cache). Below, the token ids one decode step was
# launched with, and what the runner read for them. (On this CPU nothing runs beside the host,
# so nothing gets faster here; `bench/engine_overlap_cpu.py` measures the effect against a
# device that takes time.)


# %%
class Watching(Recording):
    """Recording runner that also keeps the token ids each step was launched with, and the
    ids they stand for."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.launched, self.read = [], []

    def forward(self, tokens, *args, **kw):
        self.launched.append(np.asarray(tokens).copy())
        self.read.append(self.resolve(tokens))  # what the forward pass below reads
        return super().forward(tokens, *args, **kw)


runner_ov = Watching(model, POOL, PAGE)
engine_ov = Engine(runner_ov, POOL, PAGE, max_step_tokens=BUDGET, prefix_cache=True,
                   overlap=True)
outputs_ov = engine_ov.run(requests)
with_placeholders = [t for t, ids in enumerate(runner_ov.launched) if (ids < 0).any()]
t = with_placeholders[len(with_placeholders) // 2]
print(f"launched with: {runner_ov.launched[t].tolist()}")
print(f"read as:       {runner_ov.read[t].tolist()}")
print(f"{len(with_placeholders)} of {len(runner_ov.launched)} forward passes held placeholders")
assert outputs_ov == outputs == alone  # the same tokens
assert (runner_ov.read[t] >= 0).all() and (runner_ov.launched[t] < 0).any()

# %% [markdown]
# ## 8. The layer around attention, as a GPU runs it
#
# Attention is one part of a layer. Around it the model adds the residual and normalises
# (twice), rotates q and k, and multiplies SiLU of the gate by up. Written as above, one
# operation per step of the formula, each of those steps is a separate elementwise kernel on a
# GPU: it reads its whole tensor, writes it back, and costs a launch (1-3 us). At a decode
# step's few rows the bytes are tiny and the count is what costs: on the H200 (the engine's
# benchmark, Llama-3.2-1B shapes, 64 requests, `bench/results/issue12/engine_h200.json`) these
# kernels took a large share of a decode step's GPU time (below). nbinfer's layer kernels, with
# FlashInfer's names (`fused_add_rmsnorm`, `apply_rope_with_cos_sin_cache`, `silu_and_mul`,
# `rmsnorm`), do each group in one pass over a token's row; with q/k/v and gate/up as one GEMM
# each, a layer is four GEMMs and four such kernels (the torch model's form on a GPU).
#
# Below, the same forward pass written that way, its layer kernels run by the simulator here,
# gives the model's logits; and the elementwise steps of the formula-per-step form are counted,
# not listed: every NumPy ufunc call on the activations is one such kernel.


# %%
from nbinfer import (
    apply_rope_with_cos_sin_cache,
    fused_add_rmsnorm,
    reference,
    rmsnorm,
    silu_and_mul,
)
from nbinfer.engine.model import rope_frequencies

launches = []


def counted(fn):
    def call(*args, **kw):
        launches.append(fn.__name__)
        return fn(*args, **kw)
    return call


def mm(a, b):
    launches.append("matmul")
    return a @ b


def fused_forward(m, tokens, positions, attend):
    """``m.forward`` with nbinfer's layer kernels and one GEMM for q/k/v and one for gate/up."""
    cfg, w, eps = m.cfg, m.w, m.cfg.rms_norm_eps
    n, d, hq, hk = len(tokens), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    table = reference.layers.cos_sin_cache(rope_frequencies(cfg), int(max(positions)) + 1)
    x = w["model.embed_tokens.weight"][tokens].copy()  # the residual stream
    h = counted(rmsnorm)(x, w["model.layers.0.input_layernorm.weight"], eps)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = mm(h, np.concatenate([w[p + f"self_attn.{k}_proj.weight"] for k in "qkv"]).T)
        q, k = counted(apply_rope_with_cos_sin_cache)(
            positions, qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d], d, table)
        v = qkv[:, (hq + hk) * d:].reshape(n, hk, d)
        o = attend(i, q.reshape(n, hq, d), k.reshape(n, hk, d), v)
        a = np.ascontiguousarray(mm(o.reshape(n, hq * d).astype(m.dtype),
                                    w[p + "self_attn.o_proj.weight"].T))
        counted(fused_add_rmsnorm)(a, x, w[p + "post_attention_layernorm.weight"], eps)
        gate_up = np.concatenate([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        down = mm(counted(silu_and_mul)(mm(a, gate_up.T)), w[p + "mlp.down_proj.weight"].T)
        nxt = (f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_layers
               else "model.norm.weight")
        counted(fused_add_rmsnorm)(down, x, w[nxt], eps)  # x += down, then down = norm(x)
        h = down
    head = w["model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"]
    return mm(h, head.T)


class Counting(np.ndarray):
    """Activations that count the elementwise operations (ufuncs) and the matrix products
    applied to them."""

    ops: list = []

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        Counting.ops.append(ufunc.__name__)  # a reduction (the norm's mean) counts as one too

        def plain(x):
            return x.view(np.ndarray) if isinstance(x, Counting) else x

        if out is not None:
            kw["out"] = tuple(plain(x) for x in out)
        res = getattr(ufunc, method)(*(plain(x) for x in inputs), **kw)
        return res.view(Counting) if isinstance(res, np.ndarray) else res


def sdpa_like(layer, q, k, v):  # attention over the step's own rows (a prompt, causal)
    return reference.single_prefill_with_kv_cache(np.asarray(q), np.asarray(k), np.asarray(v),
                                                  causal=True)


step_tokens = np.array(requests[0].prompt[:6])
positions = np.arange(step_tokens.size)
want = model.forward(step_tokens, positions, sdpa_like)
got = fused_forward(model, step_tokens, positions, sdpa_like)
err = float(np.abs(got - want).max() / np.abs(want).max())
print(f"fused form against the model's logits: max error {err:.1e} of the largest logit, "
      f"same greedy tokens: {bool((got.argmax(-1) == want.argmax(-1)).all())}")
assert err < 1e-4 and (got.argmax(-1) == want.argmax(-1)).all()

# the formula-per-step form, counted: the embedding rows as Counting, so every later
# activation is one too (the weights stay plain arrays)
embed = model.w["model.embed_tokens.weight"]
model.w["model.embed_tokens.weight"] = embed.view(Counting)
Counting.ops.clear()
model.forward(step_tokens, positions, sdpa_like)
model.w["model.embed_tokens.weight"] = embed
# kernels of one forward pass (both layers and the LM head), each form counted as it ran
per_step = {"matrix products": sum(op == "matmul" for op in Counting.ops),
            "elementwise": sum(op != "matmul" for op in Counting.ops)}
fused_step = {"matrix products": launches.count("matmul"),
              "elementwise": sum(op != "matmul" for op in launches)}
print(f"kernels per forward pass, one operation per step: {per_step}; fused: {fused_step}")
assert per_step["elementwise"] >= 4 * fused_step["elementwise"]
assert fused_step["matrix products"] < per_step["matrix products"]

measured = json.loads((ROOT / "bench/results/issue12/engine_h200.json").read_text())[
    "decode step GPU ms by kernel kind (eager, profiler)"]
kinds = {"GEMMs": measured["gemm"], "attention": measured["attention"],
         "append": measured["append"], "elementwise (torch)": measured["other"]}
share = kinds["elementwise (torch)"] / sum(kinds.values())
print(f"H200 decode step, GPU ms by kernel kind: "
      f"{ {k: round(v, 2) for k, v in kinds.items()} } ({share:.0%} elementwise)")
assert share > 0.25  # what the layer kernels are for

fig2, ax2 = subplots(1, 2, figsize=(11, 3.2))
labels = list(per_step)
xs = np.arange(len(labels))
ax2[0].bar(xs - 0.2, [per_step[k] for k in labels], 0.4, color="0.6",
           label="one operation per step of the formula")
ax2[0].bar(xs + 0.2, [fused_step[k] for k in labels], 0.4, color="C0",
           label="fused GEMMs and layer kernels")
ax2[0].set_xticks(xs, labels)
ax2[0].set_ylabel(f"kernels per forward pass ({cfg.num_layers} layers)")
ax2[0].set_title("the tiny model's forward pass, counted (attention aside)")
ax2[0].legend(fontsize=8, loc="upper left")
ax2[1].barh(list(kinds), list(kinds.values()), color=["C1", "C2", "C3", "0.6"])
ax2[1].set_xlabel("GPU ms per decode step")
ax2[1].set_title("H200, Llama-3.2-1B shapes, 64 requests, torch form (measured)")
save_figure(fig2, "08_layer_kernels.png")
show(fig2)

# %% [markdown]
# ## Exercises
#
# 1. Shrink the pool to 20 pages and run again: count `engine.preemptions`, find the steps where
#    a request lost its pages in the pool picture, and check that the tokens still equal
#    `alone`.
# 2. Set `BUDGET = 8`: how many steps does r2's prompt take now, and what happens to the decode
#    latency of the others (steps between two of their tokens)?
# 3. Make every request share the system prompt and give them all the same `max_new_tokens`:
#    how much of the decode steps' KV traffic does the cascade save?
# 4. With `overlap=True`, compare `engine_ov.prefix_hit_rate` with `engine.prefix_hit_rate`
#    and the steps at which each request was admitted: why can the overlap admit a request a
#    step later, or find fewer of its tokens cached, and why can it never change a token?
